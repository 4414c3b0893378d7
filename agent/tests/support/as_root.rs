//! What the in-process agent tests that run as root share (`agent/tests/agent.rs`, `metrics.rs`):
//! the `root_test!` shape, the job of user nobody, the test dataset, and the agent started on a
//! configuration as `sluiced` runs it. Each includes this file with `#[macro_use] #[path]`
//! (integration tests share no crate).

use sluice_core::config::Config;
use sluice_proto::msg::Request;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// The job user of these tests.
pub use sluice_proto::testing::NOBODY;

/// Every test here needs root, like sluiced itself (the job's files belong to another user), so each
/// is `#[ignore]`d with that reason and run by tests/harness/run-e2e.sh (as root, `--ignored`); run
/// by hand without root, it fails here rather than passing without having run.
pub const NEEDS_ROOT: &str = "needs root, like sluiced (the job's files belong to another user); run as root with --ignored, as tests/harness/run-e2e.sh does";

pub fn require_root() {
    assert!(nix::unistd::geteuid().is_root(), "this test {NEEDS_ROOT}");
}

/// A root-only test: the agent's own runtime shape, `#[ignore]`d with [`NEEDS_ROOT`]'s reason (an
/// attribute takes only a literal), failing at once when run without root.
macro_rules! root_test {
    ($(#[$meta:meta])* async fn $name:ident() $body:block) => {
        $(#[$meta])*
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        #[ignore = "needs root, like sluiced (the job's files belong to another user); run as root with --ignored, as tests/harness/run-e2e.sh does"]
        async fn $name() {
            $crate::as_root::require_root();
            $body
        }
    };
}

/// A job of user nobody on node n1 with these sluice options, as its prolog announces it.
pub fn nobody_job(job_id: u32, job_name: &str, options: Vec<(String, String)>) -> Request {
    Request::JobStart(sluice_proto::testing::nobody_job(
        job_id, "n1", job_name, options,
    ))
}

/// The test dataset: 300,000 + 0 + 8 bytes in 3 files, its directories open to everyone.
pub fn make_dataset(dir: &Path) {
    std::fs::create_dir_all(dir.join("train/shard-0")).unwrap();
    std::fs::write(dir.join("train/shard-0/a.bin"), vec![1u8; 300_000]).unwrap();
    std::fs::write(dir.join("train/empty"), b"").unwrap();
    std::fs::write(dir.join("labels.txt"), b"cat\ndog\n").unwrap();
    for p in [
        dir.to_path_buf(),
        dir.join("train"),
        dir.join("train/shard-0"),
    ] {
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
}

/// A temp directory for a root test whose agents mount tmpfs below it (RAM tiers, replica areas):
/// what is mounted below it is unmounted when it goes, so that no test leaves mounts behind (a
/// job's tmpfs outlives its agent by design, and hundreds had piled up on the test machines).
pub struct TestDir(tempfile::TempDir);

impl TestDir {
    pub fn new() -> TestDir {
        TestDir(tempfile::tempdir().unwrap())
    }

    pub fn path(&self) -> &Path {
        self.0.path()
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let mut below: Vec<std::path::PathBuf> = std::fs::read_to_string("/proc/self/mounts")
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split(' ').nth(1).map(std::path::PathBuf::from))
            .filter(|p| p.starts_with(self.0.path()))
            .collect();
        below.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        for m in below {
            let _ = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH);
        }
    }
}

/// Gives `root` and everything below it to [`NOBODY`], as if the job user had written it.
pub fn give_to_nobody(root: &Path) {
    std::os::unix::fs::lchown(root, Some(NOBODY), Some(NOBODY)).unwrap();
    if root.is_dir() && !root.is_symlink() {
        for e in std::fs::read_dir(root).unwrap() {
            give_to_nobody(&e.unwrap().path());
        }
    }
}

/// An agent running in this process (on node `n1`, unless started with [`spawn_agent_on`]).
pub struct Running {
    pub cfg: Arc<Config>,
    shutdown: CancellationToken,
    handle: tokio::task::JoinHandle<Result<(), sluice_agent::AgentError>>,
}

/// Starts the agent on the configuration `cfg` (TOML) for node `n1`: its hot tier's parent made and
/// open to everyone, its socket (left by a previous agent on the same state, if any) bound anew and
/// open to every user, and the agent's one entry point spawned as sluiced runs it, the copy helper
/// being this build's `sluiced`.
pub fn spawn_agent(cfg: &str) -> Running {
    spawn_agent_on(cfg, "n1")
}

/// [`spawn_agent`] for node `node` (`%n` in the configuration is its name).
pub fn spawn_agent_on(cfg: &str, node: &str) -> Running {
    let cfg = Arc::new(Config::parse(cfg, node, sluice_archive::upload_memory).unwrap());
    let hot_parent = cfg.hot_root.parent().unwrap();
    std::fs::create_dir_all(hot_parent).unwrap();
    std::fs::set_permissions(hot_parent, std::fs::Permissions::from_mode(0o755)).unwrap();
    let _ = std::fs::remove_file(&cfg.socket);
    let listener = tokio::net::UnixListener::bind(&cfg.socket).unwrap();
    std::fs::set_permissions(&cfg.socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    let shutdown = CancellationToken::new();
    let handle = tokio::spawn(sluice_agent::run_with_helper(
        cfg.clone(),
        listener,
        shutdown.clone(),
        env!("CARGO_BIN_EXE_sluiced").into(),
    ));
    Running {
        cfg,
        shutdown,
        handle,
    }
}

impl Running {
    /// Shuts the agent down and waits for it to end, which it must do cleanly.
    pub async fn stop(self) {
        self.shutdown.cancel();
        self.handle.await.unwrap().unwrap();
    }
}
