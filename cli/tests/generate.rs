//! What the install steps of docs/admin-guide.md put on a node, checked the way a user meets it:
//! `sluice generate man DIR` writes a page for every command `sluice --help` lists, which man(1)
//! renders without a warning and whose NAME and SYNOPSIS name that command; `sluice generate
//! completions SHELL` gives scripts that bash, zsh and fish accept and that complete sluice's
//! commands; `sluice --version` names the protocol and `sluice --help` the exit statuses sluice
//! really returns. (The agent's page is checked the same way in agent/tests/sluiced_cli.rs; what
//! both share is `sluice_e2e::pages`.)
//!
//! A check that needs a program this machine lacks (man, zsh, fish) fails and says what to install
//! (tests/harness/install.sh installs them all): it never passes unchecked.

use sluice_e2e::pages::{
    Binary, assert_has, assert_offers, exit_statuses, man, man_command, require, section, succeeded,
};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::{Command, Output};

const SLUICE: Binary = Binary {
    name: "sluice",
    path: env!("CARGO_BIN_EXE_sluice"),
    unset: &["SLUICE_SOCKET", "SLURMD_NODENAME", "SLURM_JOB_ID"],
};

fn sluice(args: &[&str]) -> Output {
    SLUICE.run(args)
}

/// The commands `sluice ARGS --help` lists under "Commands:", without `help`.
fn listed_commands(args: &[&str]) -> Vec<String> {
    let mut all = args.to_vec();
    all.push("--help");
    let help = succeeded(&sluice(&all));
    help.lines()
        .skip_while(|l| *l != "Commands:")
        .skip(1)
        .take_while(|l| !l.is_empty())
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_string)
        .collect()
}

/// Every command a user can reach from `sluice --help`, as its words: [], ["status"], ["ckpt",
/// "list"], ...
fn all_commands(prefix: Vec<String>, into: &mut Vec<Vec<String>>) {
    let args: Vec<&str> = prefix.iter().map(String::as_str).collect();
    for sub in listed_commands(&args) {
        let mut words = prefix.clone();
        words.push(sub);
        all_commands(words, into);
    }
    into.push(prefix);
}

/// `sluice generate man` into a fresh directory: the directory and the pages it printed.
fn generate_pages() -> (tempfile::TempDir, Vec<PathBuf>) {
    let dir = tempfile::tempdir().unwrap();
    let man1 = dir.path().join("share/man/man1");
    let out = succeeded(&sluice(&["generate", "man", man1.to_str().unwrap()]));
    let printed = out.lines().map(PathBuf::from).collect();
    (dir, printed)
}

fn page_name(words: &[String]) -> String {
    std::iter::once("sluice")
        .chain(words.iter().map(String::as_str))
        .collect::<Vec<_>>()
        .join("-")
}

#[test]
fn every_command_in_help_has_its_man_page_and_nothing_else_has_one() {
    let mut commands = Vec::new();
    all_commands(Vec::new(), &mut commands);
    let expected: BTreeSet<String> = commands
        .iter()
        .map(|words| format!("{}.1", page_name(words)))
        .collect();
    // The help parsing found the tree, not just the top.
    for page in [
        "sluice",
        "sluice-status",
        "sluice-job",
        "sluice-ckpt",
        "sluice-ckpt-commit",
        "sluice-ckpt-list",
        "sluice-ckpt-verify",
        "sluice-ckpt-restore",
        "sluice-cache",
        "sluice-cache-list",
        "sluice-cache-stats",
        "sluice-cache-warm",
        "sluice-cache-evict",
    ] {
        let page = format!("{page}.1");
        assert!(expected.contains(&page), "{page} in {expected:?}");
    }

    let (dir, printed) = generate_pages();
    let man1 = dir.path().join("share/man/man1");
    let written: BTreeSet<String> = std::fs::read_dir(&man1)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    // No page for `generate` (an install step, not a user's command) or for `help`.
    assert_eq!(written, expected);
    let printed: BTreeSet<PathBuf> = printed.into_iter().collect();
    let paths: BTreeSet<PathBuf> = written.iter().map(|p| man1.join(p)).collect();
    assert_eq!(
        printed, paths,
        "sluice generate man prints the files it wrote"
    );

    // The pages' own source names the command in NAME, and each is cross-referenced.
    for words in &commands {
        let name = page_name(words);
        let page = std::fs::read_to_string(man1.join(format!("{name}.1"))).unwrap();
        assert_has(&page, &format!(".TH {name} 1 \"\" \"sluice "));
        assert_has(
            &page,
            &format!(".SH NAME\n{} \\- ", name.replace('-', "\\-")),
        );
        assert_has(&page, ".SH \"EXIT STATUS\"");
        if !words.is_empty() {
            assert_has(&page, ".SH \"SEE ALSO\"");
        }
    }
}

#[test]
fn man_renders_every_page_without_warnings_naming_its_command() {
    require("man", "rendering the man pages with man -l");
    let mut commands = Vec::new();
    all_commands(Vec::new(), &mut commands);
    let (dir, _) = generate_pages();
    let man1 = dir.path().join("share/man/man1");
    for words in &commands {
        let name = page_name(words);
        let rendered = man(&man1.join(format!("{name}.1")));
        let first_line = rendered.lines().next().unwrap_or_default();
        assert!(
            first_line.starts_with(&format!("{name}(1)")) && first_line.contains("sluice manual"),
            "{first_line}"
        );
        let title = section(&rendered, "NAME");
        assert!(
            title.starts_with(&format!("{name} - ")),
            "NAME of {name}: {title}"
        );
        let invocation = std::iter::once("sluice")
            .chain(words.iter().map(String::as_str))
            .collect::<Vec<_>>()
            .join(" ");
        let synopsis = section(&rendered, "SYNOPSIS");
        assert!(
            synopsis.starts_with(&format!("{invocation} ")),
            "SYNOPSIS of {name}: {synopsis}"
        );
        let exit = section(&rendered, "EXIT STATUS");
        for code in ["0 success", "1 failure", "2 usage error"] {
            assert!(
                exit.contains(code),
                "EXIT STATUS of {name} lacks {code:?}: {exit}"
            );
        }
    }

    let top = man(&man1.join("sluice.1"));
    assert_eq!(
        section(&top, "VERSION"),
        format!(
            "v{} (protocol {})",
            env!("CARGO_PKG_VERSION"),
            sluice_proto::PROTO_VERSION
        )
    );
    let subcommands = section(&top, "SUBCOMMANDS");
    for page in ["sluice-status(1)", "sluice-job(1)", "sluice-ckpt(1)"] {
        assert_has(&subcommands, page);
    }
    assert!(!top.contains("generate"), "{top}");
    let ckpt = section(&man(&man1.join("sluice-ckpt.1")), "SEE ALSO");
    assert_has(&ckpt, "sluice(1)");
    assert_has(&ckpt, "sluice-ckpt-restore(1)");
}

#[test]
fn bash_completion_parses_and_completes_commands_and_options() {
    let dir = tempfile::tempdir().unwrap();
    let script = SLUICE.checked_completion("bash", dir.path());

    let top = SLUICE.bash_complete(&script, &["sluice", ""]);
    assert_offers(
        &top,
        &["status", "job", "ckpt", "cache", "--socket", "--timeout"],
    );
    let cache = SLUICE.bash_complete(&script, &["sluice", "cache", ""]);
    assert_offers(&cache, &["list", "stats", "warm", "evict"]);
    assert!(!top.iter().any(|w| w == "generate"), "{top:?}");

    let ckpt = SLUICE.bash_complete(&script, &["sluice", "ckpt", ""]);
    assert_offers(&ckpt, &["commit", "list", "verify", "restore"]);

    // A prefix narrows it, and a command's own options come after it.
    assert_eq!(
        SLUICE.bash_complete(&script, &["sluice", "ckpt", "re"]),
        ["restore"]
    );
    let list = SLUICE.bash_complete(&script, &["sluice", "ckpt", "list", "--"]);
    assert_offers(&list, &["--job", "--config", "--json", "--socket"]);
    assert!(!list.iter().any(|w| w == "commit"), "{list:?}");
}

/// What `shell`, run with `args` and then the path of the completion script `sluice generate`
/// writes for it (checked first), prints; its `HOME` is a fresh directory (fish writes there).
fn sourced_completion(shell: &str, args: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let script = SLUICE.checked_completion(shell, dir.path());
    let out = Command::new(shell)
        .args(args)
        .arg(&script)
        .env("HOME", dir.path())
        .output()
        .unwrap();
    succeeded(&out)
}

#[test]
fn zsh_completion_parses() {
    // Loading it defines the completion function zsh's compinit would call for `sluice`.
    let out = sourced_completion(
        "zsh",
        &[
            "-f",
            "-c",
            "source \"$1\" 2>/dev/null; whence -w _sluice",
            "zsh",
        ],
    );
    assert_eq!(out.trim(), "_sluice: function");
}

#[test]
fn fish_completion_parses_and_offers_the_ckpt_commands() {
    let out = sourced_completion(
        "fish",
        &[
            "--no-config",
            "-c",
            "source $argv[1]; complete -C 'sluice ckpt '",
        ],
    );
    let offered: Vec<String> = out
        .lines()
        .filter_map(|l| l.split('\t').next())
        .map(str::to_string)
        .collect();
    assert_offers(&offered, &["commit", "list", "verify", "restore"]);
}

#[test]
fn version_names_the_protocol() {
    SLUICE.assert_version(env!("CARGO_PKG_VERSION"), sluice_proto::PROTO_VERSION);
}

#[test]
fn help_documents_the_exit_statuses_sluice_returns() {
    let statuses = ["  0  success", "  1  failure", "  2  usage error"];
    // A failure: no agent on that socket.
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("none.sock");
    let no_agent = ["--socket", socket.to_str().unwrap(), "status"];
    for help in SLUICE.assert_exit_statuses(statuses, &["no-such-command"], &no_agent) {
        assert!(exit_statuses(&help)[1].contains("ckpt verify"), "{help}");
    }
}

#[test]
fn generate_is_kept_out_of_the_help_and_fails_like_any_command() {
    let help = succeeded(&sluice(&["--help"]));
    assert!(!help.contains("generate"), "{help}");
    SLUICE.exits(&["generate", "completions", "tcsh"], 2);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("file");
    std::fs::write(&file, "").unwrap();
    let out = SLUICE.exits(&["generate", "man", file.to_str().unwrap()], 1);
    assert_has(&out, &format!("creating {}", file.display()));
}

#[test]
fn the_admin_guide_install_steps_put_pages_and_completions_where_man_bash_and_zsh_look() {
    let root = tempfile::tempdir().unwrap();
    let bash = SLUICE.run_admin_guide_install_steps(
        root.path(),
        &[
            "usr/local/share/man/man1/sluice.1",
            "usr/local/share/man/man1/sluice-ckpt-restore.1",
            "usr/local/share/zsh/site-functions/_sluice",
        ],
    );
    // bash-completion loads completions/NAME when NAME is first completed: the file must be
    // sluice's, and complete.
    require("bash", "the installed bash completion");
    assert_offers(
        &SLUICE.bash_complete(&bash, &["sluice", "ckpt", ""]),
        &["commit", "list", "verify", "restore"],
    );
    require("man", "man finding the installed page through MANPATH");
    let out = man_command()
        .arg("sluice-ckpt-list")
        .env("MANPATH", root.path().join("usr/local/share/man"))
        .output()
        .unwrap();
    assert_has(&section(&succeeded(&out), "NAME"), "sluice-ckpt-list - ");
}
