//! Test helpers the crates above share (feature `testing`, for their dev-dependencies only): where
//! an `O_DIRECT` test writes, and what it says when the file system there refuses `O_DIRECT`; who
//! the test process is, and the check that a root-only test runs as root.

/// What a test that needs `O_DIRECT` says where the file system refuses it.
pub const DIRECT_IO_REFUSED: &str = "the target directory's file system refuses O_DIRECT \
    (EINVAL), so the O_DIRECT path cannot be checked here: put the target directory \
    (CARGO_TARGET_DIR) on a disk file system such as ext4 or XFS";

/// A temporary directory for `O_DIRECT` tests: beside the test binary (the target directory, on
/// the build machine's disk), since `/tmp` is often a tmpfs, which refuses `O_DIRECT`; the temp
/// directory where the target directory is not writable (another user runs the binaries).
pub fn direct_io_dir() -> tempfile::TempDir {
    let exe = std::env::current_exe().unwrap();
    tempfile::tempdir_in(exe.parent().unwrap())
        .or_else(|_| tempfile::tempdir())
        .unwrap()
}

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
pub fn me() -> crate::safefs::Owner {
    crate::safefs::Owner {
        uid: nix::unistd::getuid().as_raw(),
        gid: nix::unistd::getgid().as_raw(),
    }
}
