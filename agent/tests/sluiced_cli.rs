//! What the install steps of docs/admin-guide.md put on a node for the agent, checked the way an
//! admin meets it: `sluiced generate man DIR` writes sluiced.8, which man(1) renders without a
//! warning; `sluiced generate completions SHELL` gives scripts bash and zsh accept and that
//! complete the agent's options (and not its internal commands); `sluiced --version` names the
//! protocol and `sluiced --help` the exit statuses the agent really returns. (The CLI's pages are
//! checked the same way in cli/tests/generate.rs; what both share is `sluice_e2e::pages`.)
//!
//! A check that needs a program this machine lacks (man, zsh) fails and says what to install
//! (tests/harness/install.sh installs them all): it never passes unchecked.

use sluice_e2e::pages::{Binary, assert_has, assert_offers, man, require, section, succeeded};

const SLUICED: Binary = Binary {
    name: "sluiced",
    path: env!("CARGO_BIN_EXE_sluiced"),
    unset: &["SLUICE_LOG"],
};

#[test]
fn the_man_page_is_sluiced_8_and_man_renders_it_without_warnings() {
    let dir = tempfile::tempdir().unwrap();
    let man8 = dir.path().join("share/man/man8");
    let out = succeeded(&SLUICED.run(&["generate", "man", man8.to_str().unwrap()]));
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
    let version = format!(
        "v{} (protocol {})",
        env!("CARGO_PKG_VERSION"),
        sluice_proto::PROTO_VERSION
    );
    assert_eq!(section(&rendered, "VERSION"), version);
    assert_eq!(section(&rendered, "SEE ALSO"), "sluice(1)");
    for internal in ["copy-as-user", "generate"] {
        assert!(!rendered.contains(internal), "{rendered}");
    }
}

#[test]
fn bash_completion_parses_and_completes_the_options_only() {
    let dir = tempfile::tempdir().unwrap();
    let script = SLUICED.checked_completion("bash", dir.path());
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
    let dir = tempfile::tempdir().unwrap();
    let script = SLUICED.checked_completion("zsh", dir.path());
    let source = std::fs::read_to_string(&script).unwrap();
    assert!(!source.contains("copy-as-user"), "{source}");
}

#[test]
fn version_names_the_protocol() {
    SLUICED.assert_version(env!("CARGO_PKG_VERSION"), sluice_proto::PROTO_VERSION);
}

#[test]
fn help_documents_the_exit_statuses_sluiced_returns() {
    let statuses = [
        "  0  stopped by SIGTERM",
        "  1  failure",
        "  2  usage error",
    ];
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("sluice.toml");
    let check_missing = ["--config", missing.to_str().unwrap(), "--check"];
    for help in SLUICED.assert_exit_statuses(statuses, &["--no-such-option"], &check_missing) {
        for internal in ["copy-as-user", "generate"] {
            assert!(!help.contains(internal), "{help}");
        }
    }
}

/// The install steps of docs/admin-guide.md for the agent (its `sluiced generate …` lines, with
/// their `> FILE`), run as an admin runs them but with every absolute path under `root`, and the
/// guide's `install -d` making each `> FILE`'s directory. (cli/tests/generate.rs checks the same
/// for sluice.)
#[test]
fn the_admin_guide_install_steps_put_the_page_and_completions_where_man_bash_and_zsh_look() {
    let root = tempfile::tempdir().unwrap();
    let bash = SLUICED.run_admin_guide_install_steps(
        root.path(),
        &[
            "usr/local/share/man/man8/sluiced.8",
            "usr/local/share/zsh/site-functions/_sluiced",
        ],
    );
    require("bash", "the installed bash completion");
    let offered = SLUICED.bash_complete(&bash, &["sluiced", "--c"]);
    assert_eq!(offered, ["--config", "--check"]);
}
