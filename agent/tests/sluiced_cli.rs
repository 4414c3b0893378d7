//! What the install steps of docs/admin-guide.md put on a node for the agent, checked the way an
//! admin meets it: `sluiced generate man DIR` writes sluiced.8, which man(1) renders without a
//! warning; `sluiced generate completions SHELL` gives scripts bash and zsh accept and that
//! complete the agent's options (and not its internal commands); `sluiced --version` names the
//! protocol and `sluiced --help` the exit statuses the agent really returns. (The CLI's pages are
//! checked the same way in cli/tests/generate.rs.)
//!
//! A check that needs a program this machine lacks (man, zsh) fails and says what to install
//! (tests/harness/install.sh installs them all): it never passes unchecked.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn sluiced(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sluiced"))
        .args(args)
        .env_remove("SLUICE_LOG")
        .output()
        .unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8(bytes.to_vec()).unwrap()
}

#[track_caller]
fn succeeded(out: &Output) -> String {
    assert!(
        out.status.success(),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

#[track_caller]
fn assert_has(text: &str, part: &str) {
    assert!(text.contains(part), "{part:?} is not in:\n{text}");
}

/// Fails the test unless `program` is on PATH, naming the check that needs it and the Debian
/// package to install.
#[track_caller]
fn require(program: &str, check: &str) {
    let found = std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|d| d.join(program).is_file()));
    let package = match program {
        "man" => "man-db",
        other => other,
    };
    assert!(
        found,
        "{check} needs {program}, which is not on PATH: install {package} \
         (tests/harness/install.sh installs it)"
    );
}

/// The text of section `heading` in a rendered page, its words joined by single spaces.
fn section(rendered: &str, heading: &str) -> String {
    rendered
        .lines()
        .skip_while(|l| *l != heading)
        .skip(1)
        .take_while(|l| l.is_empty() || l.starts_with(' '))
        .flat_map(str::split_whitespace)
        .collect::<Vec<_>>()
        .join(" ")
}

fn version() -> String {
    format!(
        "{} (protocol {})",
        env!("CARGO_PKG_VERSION"),
        sluice_proto::PROTO_VERSION
    )
}

#[test]
fn the_man_page_is_sluiced_8_and_man_renders_it_without_warnings() {
    let dir = tempfile::tempdir().unwrap();
    let man8 = dir.path().join("share/man/man8");
    let out = succeeded(&sluiced(&["generate", "man", man8.to_str().unwrap()]));
    let page = man8.join("sluiced.8");
    assert_eq!(out, format!("{}\n", page.display()));
    let names: Vec<_> = std::fs::read_dir(&man8)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["sluiced.8"], "one page, none for internal commands");
    let source = std::fs::read_to_string(&page).unwrap();
    assert_has(&source, ".TH sluiced 8 \"\" \"sluice ");
    assert_has(&source, ".SH NAME\nsluiced \\- ");

    require("man", "rendering sluiced.8 with man -l");
    let out = Command::new("man")
        .args(["--warnings", "-l"])
        .arg(&page)
        .env("MANWIDTH", "80")
        .env("MANPAGER", "cat")
        .env("LC_ALL", "C.UTF-8")
        .output()
        .unwrap();
    let stderr = text(&out.stderr);
    assert!(out.status.success() && stderr.is_empty(), "{stderr}");
    let rendered = text(&out.stdout);
    assert!(rendered.starts_with("sluiced(8)"), "{rendered}");
    assert!(
        section(&rendered, "NAME").starts_with("sluiced - "),
        "{rendered}"
    );
    assert!(
        section(&rendered, "SYNOPSIS").starts_with("sluiced [--config]"),
        "{rendered}"
    );
    let options = section(&rendered, "OPTIONS");
    for option in ["--config <PATH>", "--node <NAME>", "--check"] {
        assert_has(&options, option);
    }
    assert_has(&section(&rendered, "DESCRIPTION"), "SLUICE_LOG");
    let exit = section(&rendered, "EXIT STATUS");
    for code in ["0 stopped by SIGTERM", "1 failure", "2 usage error"] {
        assert_has(&exit, code);
    }
    assert_eq!(section(&rendered, "VERSION"), format!("v{}", version()));
    assert_eq!(section(&rendered, "SEE ALSO"), "sluice(1)");
    for internal in ["copy-as-user", "generate"] {
        assert!(!rendered.contains(internal), "{rendered}");
    }
}

fn completion_script(shell: &str, dir: &Path) -> PathBuf {
    let script = succeeded(&sluiced(&["generate", "completions", shell]));
    let path = dir.join(format!("sluiced.{shell}"));
    std::fs::write(&path, script).unwrap();
    path
}

/// What bash offers for `words` (the last one being completed): the script sourced, the function
/// `complete -p sluiced` names called with COMP_WORDS and COMP_CWORD set.
fn bash_complete(script: &Path, words: &[&str]) -> Vec<String> {
    let driver = r#"
        script=$1; shift
        source "$script" || exit 1
        spec=$(complete -p sluiced) || exit 1
        [[ $spec =~ -F\ ([^ ]+) ]] || { echo "no completion function in: $spec" >&2; exit 1; }
        COMP_WORDS=("$@")
        COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 ))
        COMP_LINE="${COMP_WORDS[*]}"
        COMP_POINT=${#COMP_LINE}
        prev=""
        (( COMP_CWORD > 0 )) && prev=${COMP_WORDS[COMP_CWORD-1]}
        "${BASH_REMATCH[1]}" sluiced "${COMP_WORDS[COMP_CWORD]}" "$prev"
        printf '%s\n' "${COMPREPLY[@]}"
    "#;
    let out = Command::new("bash")
        .args(["--norc", "--noprofile", "-c", driver, "bash"])
        .arg(script)
        .args(words)
        .output()
        .unwrap();
    succeeded(&out).lines().map(str::to_string).collect()
}

#[test]
fn bash_completion_parses_and_completes_the_options_only() {
    require("bash", "the bash completion");
    let dir = tempfile::tempdir().unwrap();
    let script = completion_script("bash", dir.path());
    succeeded(
        &Command::new("bash")
            .arg("-n")
            .arg(&script)
            .output()
            .unwrap(),
    );
    let offered = bash_complete(&script, &["sluiced", ""]);
    for option in ["--config", "--node", "--check", "--version"] {
        assert!(offered.iter().any(|o| o == option), "{option}: {offered:?}");
    }
    for internal in ["copy-as-user", "generate"] {
        assert!(!offered.iter().any(|o| o == internal), "{offered:?}");
    }
    assert_eq!(bash_complete(&script, &["sluiced", "--ch"]), ["--check"]);
}

#[test]
fn zsh_completion_parses() {
    require("zsh", "the zsh completion");
    let dir = tempfile::tempdir().unwrap();
    let script = completion_script("zsh", dir.path());
    let source = std::fs::read_to_string(&script).unwrap();
    assert!(source.starts_with("#compdef sluiced\n"), "{source}");
    assert!(!source.contains("copy-as-user"), "{source}");
    succeeded(
        &Command::new("zsh")
            .args(["-n", "-f"])
            .arg(&script)
            .output()
            .unwrap(),
    );
}

#[test]
fn version_names_the_protocol() {
    assert_eq!(
        succeeded(&sluiced(&["--version"])),
        format!("sluiced {}\n", version())
    );
}

#[test]
fn help_documents_the_exit_statuses_sluiced_returns() {
    for flag in ["--help", "-h"] {
        let help = succeeded(&sluiced(&[flag]));
        let exit: Vec<&str> = help
            .lines()
            .skip_while(|l| *l != "Exit status:")
            .skip(1)
            .collect();
        assert!(exit[0].starts_with("  0  stopped by SIGTERM"), "{help}");
        assert!(exit[1].starts_with("  1  failure"), "{help}");
        assert!(exit[2].starts_with("  2  usage error"), "{help}");
        for internal in ["copy-as-user", "generate"] {
            assert!(!help.contains(internal), "{help}");
        }
    }
    let usage = sluiced(&["--no-such-option"]);
    assert_eq!(usage.status.code(), Some(2), "{}", text(&usage.stderr));
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("sluice.toml");
    let bad = sluiced(&["--config", missing.to_str().unwrap(), "--check"]);
    assert_eq!(bad.status.code(), Some(1), "{}", text(&bad.stderr));
    assert_has(&text(&bad.stderr), "sluiced: ");
}

/// `path` as it lands under `root` when it is absolute (the admin guide's install steps write to
/// /usr).
fn under(root: &Path, path: &str) -> PathBuf {
    match path.strip_prefix('/') {
        Some(relative) => root.join(relative),
        None => PathBuf::from(path),
    }
}

/// The install steps of docs/admin-guide.md for the agent (its `sluiced generate …` lines, with their `> FILE`),
/// run as an admin runs them but with every absolute path under `root`. (cli/tests/generate.rs
/// checks the same for sluice, and that `install -d` makes each `> FILE`'s directory.)
#[test]
fn the_admin_guide_install_steps_put_the_page_and_completions_where_man_bash_and_zsh_look() {
    let guide = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/admin-guide.md"
    ))
    .unwrap();
    let root = tempfile::tempdir().unwrap();
    let steps: Vec<&str> = guide
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("sluiced generate "))
        .map(|l| l.split(" #").next().unwrap().trim())
        .collect();
    assert!(
        steps.len() >= 3,
        "the admin guide's steps for sluiced: {steps:?}"
    );
    for step in &steps {
        let (command, target) = match step.split_once(" > ") {
            Some((command, target)) => (command, Some(target.trim())),
            None => (*step, None),
        };
        let args: Vec<String> = command
            .split_whitespace()
            .skip(1)
            .map(|a| under(root.path(), a).to_str().unwrap().to_string())
            .collect();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = succeeded(&sluiced(&args));
        if let Some(target) = target {
            let file = under(root.path(), target);
            std::fs::create_dir_all(file.parent().unwrap()).unwrap();
            std::fs::write(file, out).unwrap();
        }
    }
    for file in [
        "usr/local/share/man/man8/sluiced.8",
        "usr/local/share/zsh/site-functions/_sluiced",
    ] {
        assert!(root.path().join(file).is_file(), "{file} is not installed");
    }
    let bash = root
        .path()
        .join("usr/share/bash-completion/completions/sluiced");
    require("bash", "the installed bash completion");
    let offered = bash_complete(&bash, &["sluiced", "--c"]);
    assert_eq!(offered, ["--config", "--check"]);
}
