//! The agent crate's modules depend on each other one way (docs/ARCHITECTURE.md): the agent on top
//! of everything, only the socket server (and `lib.rs`, the binary) above it, and no cycle among
//! the crate's top-level modules. Between crates (core, archive, peer, stage, agent) a cycle is a
//! compile error; inside the agent it is not, so this test reads `src/` and fails on a cycle or on
//! a new user of the agent.
//!
//! A module uses another when its files name `crate::other` (a path or a `use crate::{...}`
//! group). Comments and string literals are skipped; `super::` never leaves a top-level module.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The modules allowed to use `agent`.
const ABOVE_THE_AGENT: &[&str] = &["server"];

#[test]
fn no_module_depends_on_the_agent_and_none_is_in_a_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = dependencies(&src);
    assert!(
        graph.len() > 10 && graph.contains_key("agent") && graph.contains_key("ckpt"),
        "the crate's modules were not found under {}: {graph:?}",
        src.display()
    );
    let users: Vec<&str> = graph
        .iter()
        .filter(|(m, deps)| deps.contains("agent") && !ABOVE_THE_AGENT.contains(&m.as_str()))
        .map(|(m, _)| m.as_str())
        .collect();
    assert!(
        users.is_empty(),
        "{users:?} use the agent: take what they need as a narrow context (like StageCtx, CkptCtx) instead\n{graph:#?}"
    );
    for start in graph.keys() {
        if let Some(cycle) = path_back(&graph, start) {
            panic!(
                "the modules {} form a cycle: move what they share below them\n{graph:#?}",
                cycle.join(" -> ")
            );
        }
    }
}

/// Each top-level module of the crate under `src` and the other top-level modules it names.
fn dependencies(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let module = |file: &Path| -> Option<String> {
        let first = file.strip_prefix(src).ok()?.components().next()?;
        let name = first.as_os_str().to_str()?;
        let name = name.strip_suffix(".rs").unwrap_or(name);
        (name != "lib" && name != "bin").then(|| name.to_string())
    };
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        if let Some(m) = module(file) {
            graph.entry(m).or_default();
        }
    }
    for file in &files {
        let Some(m) = module(file) else { continue };
        let code = code_only(&std::fs::read_to_string(file).unwrap());
        let named: BTreeSet<String> = crate_paths(&code)
            .into_iter()
            .filter(|n| *n != m && graph.contains_key(n))
            .collect();
        graph.get_mut(&m).unwrap().extend(named);
    }
    graph
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `text` without comments, and with string and char literals (raw ones too) emptied.
fn code_only(text: &str) -> String {
    let t: Vec<char> = text.chars().collect();
    let at = |i: usize| t.get(i).copied().unwrap_or(' ');
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < t.len() {
        let word_start = i == 0 || !(at(i - 1).is_alphanumeric() || at(i - 1) == '_');
        match t[i] {
            '/' if at(i + 1) == '/' => {
                while i < t.len() && t[i] != '\n' {
                    i += 1;
                }
                continue;
            }
            '/' if at(i + 1) == '*' => {
                i += 2;
                while i < t.len() && !(t[i - 1] == '*' && t[i] == '/') {
                    i += 1;
                }
            }
            // r"…", r#"…"#, br#"…"#: up to the quote and as many #.
            'r' if word_start || (i > 0 && at(i - 1) == 'b') => {
                let hashes = t[i + 1..].iter().take_while(|c| **c == '#').count();
                if at(i + 1 + hashes) != '"' {
                    out.push('r');
                    i += 1;
                    continue;
                }
                i += hashes + 2;
                while i < t.len() && !(t[i] == '"' && (1..=hashes).all(|k| at(i + k) == '#')) {
                    i += 1;
                }
                i += hashes;
                out.push_str("\"\"");
            }
            '"' => {
                i += 1;
                while i < t.len() && t[i] != '"' {
                    i += if t[i] == '\\' { 2 } else { 1 };
                }
                out.push_str("\"\"");
            }
            // 'x' and '\n' are chars; 'a (a lifetime) is code.
            '\'' if at(i + 1) == '\\' => {
                i += 3;
                while i < t.len() && t[i] != '\'' {
                    i += 1;
                }
                out.push_str("' '");
            }
            '\'' if at(i + 2) == '\'' => {
                i += 2;
                out.push_str("' '");
            }
            c => out.push(c),
        }
        i += 1;
    }
    out
}

/// The first segment of every `crate::…` path in `code`, and each name a `crate::{…}` group opens
/// with.
fn crate_paths(code: &str) -> Vec<String> {
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    let mut names = Vec::new();
    for (at, _) in code.match_indices("crate::") {
        let before = code[..at].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue; // `sluice_archive::…` and the like end in "crate::" only by accident
        }
        let rest = code[at + "crate::".len()..].trim_start();
        let Some(group) = rest.strip_prefix('{') else {
            names.push(ident(rest));
            continue;
        };
        // The names at the group's top level: `a`, `b::c`, `d::{e, f}` give a, b, d.
        let mut depth = 0;
        let mut item_start = true;
        for (i, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => break,
                '}' => depth -= 1,
                ',' if depth == 0 => item_start = true,
                c if c.is_whitespace() => {}
                _ if item_start && depth == 0 => {
                    names.push(ident(&group[i..]));
                    item_start = false;
                }
                _ => {}
            }
        }
    }
    names
}

/// A way from `start` back to itself, if there is one.
fn path_back(graph: &BTreeMap<String, BTreeSet<String>>, start: &str) -> Option<Vec<String>> {
    let mut stack = vec![vec![start.to_string()]];
    let mut seen = BTreeSet::new();
    while let Some(path) = stack.pop() {
        let last = path.last().unwrap();
        for next in &graph[last] {
            if next == start {
                let mut cycle = path.clone();
                cycle.push(start.to_string());
                return Some(cycle);
            }
            if seen.insert(next.clone()) {
                let mut longer = path.clone();
                longer.push(next.clone());
                stack.push(longer);
            }
        }
    }
    None
}
