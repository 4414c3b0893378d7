//! What the crate's unit tests share: who the test process is and the check that a root-only test
//! runs as root. Compiled for tests only; nothing here ships in the agent.

use sluice_core::safefs::Owner;

/// Fails the test, saying why it needs root, unless it runs as root. Such tests are also
/// `#[ignore]`d with the reason, so that a plain `cargo test` reports them ignored rather than
/// passed; tests/harness/run-e2e.sh runs them as root with `--ignored`.
#[track_caller]
pub fn assert_root(why: &str) {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test needs root: {why}"
    );
}

/// The test process's own uid and gid, as the owner of what a test creates for "its" job.
pub fn me() -> Owner {
    Owner {
        uid: nix::unistd::getuid().as_raw(),
        gid: nix::unistd::getgid().as_raw(),
    }
}
