//! The running test cluster as `tests/harness/cluster.sh up` described it in its env file: its
//! users, nodes and paths, fresh work and data directories, bounded waits on the nodes' state, and
//! the evidence a failed test prints (Slurm's view of a job, its output, log tails). Also the small
//! helpers everything else uses (`run`, `unique`, `write_atomically`, `tail_of`, `now_s`).

use super::jobs::Job;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Where `cluster.sh up` writes its env file; `SLUICE_TEST_ENV` overrides it.
pub const DEFAULT_ENV_FILE: &str = "/run/sluice-test/env";

/// How often the waits below poll.
pub(super) const POLL: Duration = Duration::from_millis(200);

/// The running test cluster, as described by the harness's env file.
#[derive(Clone)]
pub struct Cluster {
    vars: BTreeMap<String, String>,
    pub user: String,
    pub other_user: String,
    pub nodes: Vec<String>,
}

impl Cluster {
    /// Reads the env file; panics with the command to run when the cluster is not up.
    pub fn get() -> Cluster {
        let path = env_file();
        let text = fs::read_to_string(&path).unwrap_or_else(|e| {
            panic!(
                "cannot read the test cluster's env file {}: {e}\n\
                 These tests need the Slurm test cluster: run tests/harness/run-e2e.sh as root \
                 (or tests/harness/cluster.sh up, then cargo test -p sluice-e2e -- --ignored --test-threads=1)",
                path.display()
            )
        });
        let vars = parse_env_file(&text);
        let get = |k: &str| {
            vars.get(k)
                .cloned()
                .unwrap_or_else(|| panic!("{} has no {k}", path.display()))
        };
        Cluster {
            user: get("SLUICE_TEST_USER"),
            other_user: get("SLUICE_TEST_OTHER_USER"),
            nodes: get("SLUICE_TEST_NODES")
                .split_whitespace()
                .map(String::from)
                .collect(),
            vars,
        }
    }

    /// [`Cluster::get`] for a test of sluice itself: it fails unless the plugin and agents run.
    pub fn for_sluice() -> Cluster {
        let cluster = Cluster::get();
        cluster.require_sluice();
        cluster
    }

    /// [`Cluster::for_sluice`] for a test that needs Garage (S3) too.
    pub fn for_s3() -> Cluster {
        let cluster = Cluster::for_sluice();
        cluster.require_s3();
        cluster
    }

    pub fn var(&self, key: &str) -> &str {
        self.vars
            .get(key)
            .map(String::as_str)
            .unwrap_or_else(|| panic!("the env file has no {key}"))
    }

    /// Tests of sluice itself need the plugin and the agents; a cluster brought up without them
    /// (SLUICE_NO_PLUGIN=1 / SLUICE_NO_AGENTS=1, for comparison) fails them with this explanation.
    pub fn require_sluice(&self) {
        assert_eq!(
            (
                self.var("SLUICE_TEST_PLUGIN"),
                self.var("SLUICE_TEST_AGENTS")
            ),
            ("1", "1"),
            "this test needs the sluice plugin and agents, but the cluster was started with \
             SLUICE_NO_PLUGIN=1 or SLUICE_NO_AGENTS=1; restart it with tests/harness/cluster.sh up"
        );
    }

    pub fn require_s3(&self) {
        assert_eq!(
            self.var("SLUICE_TEST_S3"),
            "1",
            "this test needs Garage, but the cluster was started with SLUICE_NO_GARAGE=1"
        );
    }

    /// The hot-tier root of one virtual node (`[hot_tier] root` with `%n` expanded).
    pub fn hot_root(&self, node: &str) -> PathBuf {
        PathBuf::from(self.var("SLUICE_TEST_HOT_ROOT").replace("%n", node))
    }

    /// `<hot root>/jobs/<job id>` on one node: where the agent keeps a job's stage and ckpt dirs.
    pub fn job_dir(&self, node: &str, job: &Job) -> PathBuf {
        self.hot_root(node).join("jobs").join(job.id.to_string())
    }

    pub fn user_home(&self) -> PathBuf {
        PathBuf::from(format!("/home/{}", self.user))
    }

    /// The uid and gid of a user (`id -u`, `id -g`).
    pub fn ids_of(&self, user: &str) -> (u32, u32) {
        let id = |flag: &str| -> u32 {
            run(Command::new("id").arg(flag).arg(user))
                .trim()
                .parse()
                .unwrap_or_else(|e| panic!("id {flag} {user}: {e}"))
        };
        (id("-u"), id("-g"))
    }

    /// A fresh directory in the test user's home, owned by the user, for one test's job scripts,
    /// outputs and the listings its tasks write. The name is unique per run.
    pub fn workdir(&self, test: &str) -> PathBuf {
        let dir = self
            .user_home()
            .join("e2e")
            .join(format!("{test}-{}", unique()));
        fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
        let (uid, gid) = self.ids_of(&self.user);
        let mut p = dir.as_path();
        // Chown the whole chain below the home so the user can write into it.
        while p != self.user_home() {
            std::os::unix::fs::chown(p, Some(uid), Some(gid)).expect("chown workdir");
            p = p.parent().expect("workdir below home");
        }
        dir
    }

    /// A fresh root-owned directory under the harness root (world-readable), for test datasets.
    pub fn data_dir(&self, test: &str) -> PathBuf {
        let dir = PathBuf::from(self.var("SLUICE_TEST_ROOT"))
            .join("e2e")
            .join(format!("{test}-{}", unique()));
        fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
        let mut p = dir.as_path();
        while p.starts_with(self.var("SLUICE_TEST_ROOT")) {
            fs::set_permissions(p, fs::Permissions::from_mode(0o755)).expect("chmod data dir");
            p = p.parent().unwrap();
        }
        dir
    }
}

impl Cluster {
    /// `sinfo -N`: node name → state (e.g. `idle`, `drained`, `mixed`).
    pub fn node_states(&self) -> BTreeMap<String, String> {
        let out = run(Command::new("sinfo").args(["-h", "-N", "-o", "%N %T"]));
        out.lines()
            .filter_map(|l| l.split_once(' '))
            .map(|(n, s)| (n.to_string(), s.trim().to_string()))
            .collect()
    }

    /// Waits until every node is idle; panics at once if one is drained or down (a user mistake
    /// must never take a node out of service), or after `timeout`.
    pub fn assert_nodes_return_idle(&self, after: &Job, timeout: Duration) {
        let start = Instant::now();
        loop {
            let states = self.node_states();
            let bad: Vec<_> = states
                .iter()
                .filter(|(_, s)| s.contains("drain") || s.starts_with("down") || s.contains("fail"))
                .collect();
            assert!(
                bad.is_empty(),
                "after job {}, nodes are out of service: {bad:?}\n{}",
                after.id,
                self.evidence(after)
            );
            if states.len() == self.nodes.len() && states.values().all(|s| s == "idle") {
                return;
            }
            assert!(
                start.elapsed() < timeout,
                "after job {}, nodes are not all idle within {timeout:?}: {states:?}\n{}",
                after.id,
                self.evidence(after)
            );
            std::thread::sleep(POLL);
        }
    }

    /// Waits until no node has a directory for the job in its hot tier any more.
    pub fn assert_hot_tier_cleaned(&self, job: &Job, timeout: Duration) {
        let dirs: Vec<PathBuf> = self.nodes.iter().map(|n| self.job_dir(n, job)).collect();
        self.wait_for(
            &format!(
                "job {}'s hot-tier directories {dirs:?} to be removed",
                job.id
            ),
            timeout,
            Some(job),
            || dirs.iter().all(|d| !d.exists()),
        );
    }

    /// What every job must leave: no directory in any node's hot tier, and every node back in
    /// service ([`Cluster::assert_hot_tier_cleaned`], then [`Cluster::assert_nodes_return_idle`]).
    pub fn assert_job_left_nothing(&self, job: &Job, timeout: Duration) {
        self.assert_hot_tier_cleaned(job, timeout);
        self.assert_nodes_return_idle(job, timeout);
    }

    /// Polls `done` every 200 ms for at most `timeout`; panics naming `what`, with the evidence.
    pub fn wait_for(
        &self,
        what: &str,
        timeout: Duration,
        job: Option<&Job>,
        mut done: impl FnMut() -> bool,
    ) {
        let start = Instant::now();
        while !done() {
            if start.elapsed() > timeout {
                let evidence = job
                    .map(|j| self.evidence(j))
                    .unwrap_or_else(|| self.log_tails());
                panic!("timed out after {timeout:?} waiting for {what}\n{evidence}");
            }
            std::thread::sleep(POLL);
        }
    }

    /// Everything a reader of a failed test needs: Slurm's view of the job, its output, log tails.
    pub fn evidence(&self, job: &Job) -> String {
        let mut s = String::new();
        let state = Command::new("scontrol")
            .args(["show", "job", &job.id.to_string()])
            .output();
        if let Ok(o) = state {
            let _ = write!(
                s,
                "\n----- scontrol show job {} -----\n{}",
                job.id,
                String::from_utf8_lossy(&o.stdout)
            );
        }
        let _ = write!(
            s,
            "\n----- output of job {} ({}) -----\n{}",
            job.id,
            job.output.display(),
            job.output_text()
        );
        if !job.submit_stderr.is_empty() {
            let _ = write!(s, "\n----- sbatch stderr -----\n{}", job.submit_stderr);
        }
        s + &self.log_tails()
    }

    /// The last lines of slurmctld's, each slurmd's and each agent's log.
    pub fn log_tails(&self) -> String {
        let slurm = PathBuf::from(self.var("SLUICE_TEST_SLURM_LOG_DIR"));
        let mut files = vec![slurm.join("slurmctld.log")];
        files.extend(
            self.nodes
                .iter()
                .map(|n| slurm.join(format!("slurmd-{n}.log"))),
        );
        files.extend(self.nodes.iter().map(|n| self.agent_log(n)));
        files.iter().map(|f| tail_of(f)).collect()
    }

    /// The log file of one node's agent.
    pub fn agent_log(&self, node: &str) -> PathBuf {
        PathBuf::from(self.var("SLUICE_TEST_SLUICE_LOG_DIR")).join(format!("{node}.log"))
    }
}

/// Tries `attempt` every `every` until it gives a value, and returns that; panics with `failure()`
/// once `timeout` has passed. For a moment a test must act on as it happens (a kill that must land
/// inside a transfer), which [`Cluster::wait_for`]'s 200 ms would miss.
pub fn poll_closely<T>(
    every: Duration,
    timeout: Duration,
    mut attempt: impl FnMut() -> Option<T>,
    failure: impl FnOnce() -> String,
) -> T {
    let start = Instant::now();
    loop {
        if let Some(value) = attempt() {
            return value;
        }
        if start.elapsed() >= timeout {
            panic!("{}", failure());
        }
        std::thread::sleep(every);
    }
}

/// The last 25 lines of a log file under a header, for failure messages.
pub fn tail_of(file: &Path) -> String {
    let text = fs::read_to_string(file).unwrap_or_else(|e| format!("(cannot read: {e})"));
    let lines: Vec<&str> = text.lines().collect();
    format!(
        "\n----- tail of {} -----\n{}\n",
        file.display(),
        lines[lines.len().saturating_sub(25)..].join("\n")
    )
}

/// Runs a command as root, panicking with its stderr when it fails; returns stdout.
pub fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A name part unique across runs and within one: seconds since the epoch, pid, counter.
pub fn unique() -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    format!(
        "{secs}-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// Parses the harness's env file: `KEY='value'` lines, `#` comments.
fn parse_env_file(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| {
            (
                k.trim().to_string(),
                v.trim().trim_matches('\'').to_string(),
            )
        })
        .collect()
}

/// The harness's env file: `SLUICE_TEST_ENV`, or where `cluster.sh up` writes it.
pub fn env_file() -> PathBuf {
    std::env::var_os("SLUICE_TEST_ENV").map_or_else(|| DEFAULT_ENV_FILE.into(), PathBuf::from)
}

/// The harness's run directory (`/run/sluice-test`): pid files, the env file, the fault proxy's
/// control and stats files.
pub fn run_dir() -> PathBuf {
    env_file()
        .parent()
        .expect("the env file is in a directory")
        .to_path_buf()
}

/// Replaces a file's content in one step (temp file, then rename), so a reader never sees half.
pub fn write_atomically(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    fs::write(&tmp, text).unwrap_or_else(|e| panic!("write {}: {e}", tmp.display()));
    fs::rename(&tmp, path).unwrap_or_else(|e| panic!("rename to {}: {e}", path.display()));
}

/// Seconds since the epoch, for timelines in test output and in the files job scripts write.
pub fn now_s() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}
