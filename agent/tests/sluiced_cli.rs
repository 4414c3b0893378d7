//! What the install steps of docs/admin-guide.md put on a node for the agent, checked the way an
//! admin meets it: `sluiced generate man DIR` writes sluiced.8, which man(1) renders without a
//! warning; `sluiced generate completions SHELL` gives scripts bash and zsh accept and that
//! complete the agent's options (and not its internal commands); `sluiced --version` names the
//! protocol and `sluiced --help` the exit statuses the agent really returns. (The CLI's pages are
//! checked the same way in cli/tests/generate.rs; what both share is `sluice_e2e::pages`.)
//!
//! A check that needs a program this machine lacks (man, zsh) fails and says what to install
//! (tests/harness/install.sh installs them all): it never passes unchecked.

use sluice_e2e::pages::{
    Binary, assert_has, assert_offers, exit_statuses, man, parses, require, section, succeeded,
    text,
};
use std::process::Output;

const SLUICED: Binary = Binary {
    name: "sluiced",
    path: env!("CARGO_BIN_EXE_sluiced"),
    unset: &["SLUICE_LOG"],
};

fn sluiced(args: &[&str]) -> Output {
    SLUICED.run(args)
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
    let rendered = man(&page);
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

#[test]
fn bash_completion_parses_and_completes_the_options_only() {
    require("bash", "the bash completion");
    let dir = tempfile::tempdir().unwrap();
    let script = SLUICED.completion_script("bash", dir.path());
    parses("bash", &["-n"], &script);
    let offered = SLUICED.bash_complete(&script, &["sluiced", ""]);
    assert_offers(&offered, &["--config", "--node", "--check", "--version"]);
    for internal in ["copy-as-user", "generate"] {
        assert!(!offered.iter().any(|o| o == internal), "{offered:?}");
    }
    assert_eq!(
        SLUICED.bash_complete(&script, &["sluiced", "--ch"]),
        ["--check"]
    );
}

#[test]
fn zsh_completion_parses() {
    require("zsh", "the zsh completion");
    let dir = tempfile::tempdir().unwrap();
    let script = SLUICED.completion_script("zsh", dir.path());
    let source = std::fs::read_to_string(&script).unwrap();
    assert!(source.starts_with("#compdef sluiced\n"), "{source}");
    assert!(!source.contains("copy-as-user"), "{source}");
    parses("zsh", &["-n", "-f"], &script);
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
        let exit = exit_statuses(&help);
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

/// The install steps of docs/admin-guide.md for the agent (its `sluiced generate …` lines, with
/// their `> FILE`), run as an admin runs them but with every absolute path under `root`, and the
/// guide's `install -d` making each `> FILE`'s directory. (cli/tests/generate.rs checks the same
/// for sluice.)
#[test]
fn the_admin_guide_install_steps_put_the_page_and_completions_where_man_bash_and_zsh_look() {
    let root = tempfile::tempdir().unwrap();
    SLUICED.run_admin_guide_install_steps(root.path());
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
    let offered = SLUICED.bash_complete(&bash, &["sluiced", "--c"]);
    assert_eq!(offered, ["--config", "--check"]);
}
