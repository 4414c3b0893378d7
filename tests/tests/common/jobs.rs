//! Users and jobs: commands run as the unprivileged test users, `sbatch` and its result, the jobs
//! it created and their end as `scontrol` reports it, the files a job's tasks write, and the `sluice`
//! CLI where jobs and users can run it.

use super::cluster::{Cluster, POLL, run, unique};
use std::collections::BTreeSet;
use std::fs;
use std::io::Write as _;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// PATH of the test user's commands: nothing from the root shell that runs the tests.
const USER_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

impl Cluster {
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
        self.sbatch_as(&self.user, workdir, args, script)
    }

    /// `sbatch --parsable ARGS` as `user`, in `cwd`, with `script` on stdin.
    pub fn sbatch_as(&self, user: &str, cwd: &Path, args: &[&str], script: &str) -> Submission {
        let mut all = vec!["--parsable"];
        all.extend_from_slice(args);
        let out = self.as_someone(user, cwd, "sbatch", &all, Some(script));
        Submission::of(&all, out)
    }

    /// Submits a batch job whose output goes to `<workdir>/job-<id>.out`; panics if sbatch refuses.
    pub fn submit(&self, workdir: &Path, args: &[&str], script: &str) -> Job {
        let output = workdir.join("job-%j.out");
        self.submit_with_output(&self.user, workdir, &output, args, script)
    }

    /// Submits a batch job as `user`, who has no work directory (the other user): from /tmp, its
    /// output in `/tmp/sluice-e2e-<test>-<unique>.out`; panics if sbatch refuses.
    pub fn submit_as(&self, user: &str, test: &str, args: &[&str], script: &str) -> Job {
        let output = PathBuf::from(format!("/tmp/sluice-e2e-{test}-{}.out", unique()));
        self.submit_with_output(user, Path::new("/tmp"), &output, args, script)
    }

    /// Submits with `--output=OUTPUT` (`%j` for the job id); panics if sbatch refuses.
    fn submit_with_output(
        &self,
        user: &str,
        cwd: &Path,
        output: &Path,
        args: &[&str],
        script: &str,
    ) -> Job {
        let output_opt = format!("--output={}", output.display());
        let mut all = vec![output_opt.as_str()];
        all.extend_from_slice(args);
        let sub = self.sbatch_as(user, cwd, &all, script);
        assert!(
            sub.success,
            "sbatch {:?} as {user} was refused:\n{}\n{}",
            sub.args,
            sub.stderr,
            self.log_tails()
        );
        let id = sub.job_id().unwrap_or_else(|| {
            panic!(
                "sbatch printed no job id: {:?} / {:?}",
                sub.stdout, sub.stderr
            )
        });
        Job {
            id,
            output: output
                .to_string_lossy()
                .replace("%j", &id.to_string())
                .into(),
            submit_stderr: sub.stderr,
        }
    }

    /// Waits for the job to end (see [`Cluster::wait_end`]) and prints, for the test log, how it
    /// ended, how long after `since` (`what` names that moment), and its output; returns the end
    /// and the output.
    pub fn wait_end_and_report(
        &self,
        test: &str,
        job: &Job,
        timeout: Duration,
        since: (&str, Instant),
    ) -> (JobEnd, String) {
        let end = self.wait_end(job, timeout);
        let output = job.output_text();
        eprintln!(
            "[{test}] job {} {} ({}) {:.1} s after {}; output:\n{output}",
            job.id,
            end.state,
            end.exit_code,
            since.1.elapsed().as_secs_f64(),
            since.0
        );
        (end, output)
    }

    /// Waits for the job to end (see [`Cluster::wait_end`]) and asserts it COMPLETED with exit code
    /// 0; `what` names the job in the failure message.
    pub fn assert_completes(&self, job: &Job, timeout: Duration, what: &str) -> JobEnd {
        let end = self.wait_end(job, timeout);
        assert_eq!(
            (end.state.as_str(), end.exit_code.as_str()),
            ("COMPLETED", "0:0"),
            "{what} did not complete\n{}",
            self.evidence(job)
        );
        end
    }

    /// Asserts the job ended in `state`; `why` says why it must have, with the evidence.
    pub fn assert_ended(&self, job: &Job, end: &JobEnd, state: &str, why: &str) {
        assert_eq!(end.state, state, "{why}\n{}", self.evidence(job));
    }

    /// Asserts that the batch script made by [`marker_script`] did not run.
    pub fn assert_script_did_not_run(&self, job: &Job, marker: &Path, why: &str) {
        assert!(
            !marker.exists(),
            "the job script ran although {why}\n{}",
            self.evidence(job)
        );
    }

    /// The nodes a job ran on, in Slurm's order (rank 0 first), from `scontrol show hostnames`.
    pub fn job_nodes(&self, job: &Job) -> Vec<String> {
        let list = self
            .job_field(job, "NodeList")
            .unwrap_or_else(|| panic!("no NodeList for job {}", job.id));
        run(Command::new("scontrol").args(["show", "hostnames", &list]))
            .lines()
            .map(String::from)
            .collect()
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
        let raw = String::from_utf8_lossy(&out.stdout).into_owned();
        let field = |name| field_of(&raw, name);
        Some(JobEnd {
            state: field("JobState")?,
            exit_code: field("ExitCode")?,
            reason: field("Reason"),
            raw,
        })
    }

    /// Number of jobs Slurm knows (any state, including recently finished) with this name.
    pub fn jobs_named(&self, name: &str) -> usize {
        let out = run(Command::new("squeue").args(["-h", "-t", "all", "-n", name, "-o", "%i"]));
        out.lines().filter(|l| !l.trim().is_empty()).count()
    }

    /// One field of `scontrol show job -o` (e.g. `BatchHost`, `NodeList`, `RunTime`).
    pub fn job_field(&self, job: &Job, name: &str) -> Option<String> {
        self.job_state(job)?.field(name)
    }

    /// `scontrol requeue` of a running job, then waits (at most `timeout`) until its next run
    /// starts. Slurm kills the run, runs the epilogs, and puts the job back in the queue with a
    /// begin time in the future (Reason=BeginTime; slurm.conf(5): the requeue delay defaults to the
    /// credential lifetime, 120 s): while it is pending, this tries to let it start at once, and
    /// records what Slurm answered.
    pub fn requeue_and_release(&self, job: &Job, timeout: Duration) -> Requeued {
        run(Command::new("scontrol").args(["requeue", &job.id.to_string()]));
        let mut r = Requeued {
            at: Instant::now(),
            pending_at: None,
            pending: String::new(),
            released: None,
            refusals: BTreeSet::new(),
            started_in: String::new(),
        };
        let mut last_try: Option<Instant> = None;
        let id = job.id.to_string();
        let jobid = format!("jobid={id}");
        let attempts: [Vec<&str>; 3] = [
            vec!["update", &jobid, "begintime=now"],
            vec!["update", &jobid, "StartTime=now"],
            vec!["release", &id],
        ];
        loop {
            let state = self
                .job_state(job)
                .unwrap_or_else(|| panic!("Slurm forgot job {} after the requeue", job.id));
            let restarts = state.field("Restarts").unwrap_or_default();
            if state.state == "PENDING" && r.pending_at.is_none() {
                r.pending_at = Some(Instant::now());
                r.pending = format!(
                    "Reason={} EligibleTime={} Restarts={restarts} (at {:.3})",
                    state.reason.clone().unwrap_or_default(),
                    state.field("EligibleTime").unwrap_or_default(),
                    super::cluster::now_s()
                );
            }
            let due = last_try.is_none_or(|t| t.elapsed() > Duration::from_secs(2));
            if state.state == "PENDING" && r.released.is_none() && due {
                last_try = Some(Instant::now());
                for args in &attempts {
                    let out = Command::new("scontrol").args(args).output().unwrap();
                    if out.status.success() {
                        r.released = Some(format!("scontrol {}", args.join(" ")));
                        break;
                    }
                    r.refusals.insert(format!(
                        "scontrol {}: {}",
                        args.join(" "),
                        String::from_utf8_lossy(&out.stderr).trim()
                    ));
                }
            }
            // Pending once (the epilogs are done), then anything else: the next run started.
            if r.pending_at.is_some() && state.state != "PENDING" {
                r.started_in = format!("{} (Restarts={restarts})", state.state);
                return r;
            }
            assert!(
                r.at.elapsed() < timeout,
                "job {} did not start again within {timeout:?} of scontrol requeue \
                 (pending: {}; refused: {:?})\n{}",
                job.id,
                r.pending,
                r.refusals,
                self.evidence(job)
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// What [`Cluster::requeue_and_release`] saw of a requeue.
pub struct Requeued {
    /// When `scontrol requeue` returned.
    pub at: Instant,
    /// When the job was first seen pending again (its epilogs done), and what Slurm said of it.
    pub pending_at: Option<Instant>,
    pub pending: String,
    /// The command that let it start at once, and those Slurm refused.
    pub released: Option<String>,
    pub refusals: BTreeSet<String>,
    /// The state its next run was first seen in.
    pub started_in: String,
}

/// The first `NAME=value` of `scontrol show job -o` output.
fn field_of(raw: &str, name: &str) -> Option<String> {
    raw.split_whitespace()
        .find_map(|kv| kv.strip_prefix(name).and_then(|v| v.strip_prefix('=')))
        .map(String::from)
}

/// Result of one sbatch call.
pub struct Submission {
    pub args: Vec<String>,
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
}

impl Submission {
    /// What `sbatch --parsable ARGS` did.
    pub fn of(args: &[&str], out: Output) -> Submission {
        Submission {
            args: args.iter().map(|s| s.to_string()).collect(),
            success: out.status.success(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    /// The job id `--parsable` printed (`ID` or `ID;CLUSTER`).
    pub fn job_id(&self) -> Option<u32> {
        self.stdout.trim().split(';').next()?.parse().ok()
    }
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
    /// One field of the `scontrol show job -o` line this was read from (e.g. `Restarts`).
    pub fn field(&self, name: &str) -> Option<String> {
        field_of(&self.raw, name)
    }

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

/// What a command run as a user printed, for an assertion's message: its exit status, stdout and
/// stderr.
pub fn printed(out: &Output) -> String {
    format!(
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A batch script that leaves `<work>/script-ran` behind, then runs one step: how a test tells whether
/// the script ran at all. Returns the script and the marker's path.
pub fn marker_script(work: &Path) -> (String, PathBuf) {
    let ran = work.join("script-ran");
    (
        format!("#!/bin/bash\ntouch '{}'\nsrun true\n", ran.display()),
        ran,
    )
}

/// Python that the job scripts of the tests share, put in place of their line `# sluice-e2e: log,
/// fail`: `log(event)` appends a timed line to `OUT/events`; `fail(msg)` logs it, says on stderr who
/// failed (`WHO`, on `NODE`) and exits 1. The script imports `os`, `sys` and `time`.
pub fn with_py_helpers(script: &str) -> String {
    const MARK: &str = "\n# sluice-e2e: log, fail\n";
    const HELPERS: &str = r#"

def log(event):
    with open(os.path.join(OUT, "events"), "a") as f:
        f.write(f"{time.time():.3f} rank {RANK}: {event}\n")


def fail(msg):
    log("FAILED " + msg)
    print(f"{WHO} on {NODE}: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)
"#;
    assert!(script.contains(MARK), "the job script has no {MARK:?} line");
    script.replacen(MARK, HELPERS, 1)
}

/// The `sluice` CLI built next to the test binaries (`cargo build --workspace`), for root.
pub fn built_cli() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    exe.ancestors()
        .map(|d| d.join("sluice"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "no sluice CLI built next to {}: run cargo build --workspace (run-e2e.sh does)",
                exe.display()
            )
        })
}

impl Cluster {
    /// The `sluice` CLI, copied where every user may run it (the build tree may not be readable): for
    /// job scripts and for commands run as a user. One copy per build (named by the binary's size and
    /// modification time), reused across tests and runs.
    pub fn user_cli(&self) -> PathBuf {
        let built = built_cli();
        let md = fs::metadata(&built).unwrap_or_else(|e| panic!("{}: {e}", built.display()));
        let dir = PathBuf::from(self.var("SLUICE_TEST_ROOT")).join("e2e-bin");
        fs::create_dir_all(&dir).unwrap();
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
        let dest = dir.join(format!("sluice-{}-{}", md.mtime(), md.len()));
        if fs::metadata(&dest).is_ok_and(|d| d.len() == md.len()) {
            return dest;
        }
        // Replace older copies, then copy under a temporary name and rename (tests may race).
        for e in fs::read_dir(&dir).into_iter().flatten().flatten() {
            if e.file_name().to_string_lossy().starts_with("sluice-") {
                let _ = fs::remove_file(e.path());
            }
        }
        let tmp = dir.join(format!(".sluice-{}", unique()));
        fs::copy(&built, &tmp).unwrap_or_else(|e| panic!("copy {}: {e}", built.display()));
        fs::set_permissions(&tmp, fs::Permissions::from_mode(0o755)).unwrap();
        fs::rename(&tmp, &dest).unwrap();
        dest
    }
}

/// Reads one file a task wrote under `<out>/<node>/`.
impl Cluster {
    /// The task on `node` ran [`listing_script`](super::listing_script) to its end.
    pub fn assert_task_done(&self, job: &Job, out: &Path, node: &str) {
        assert!(
            out.join(node).join("done").exists(),
            "no task ran to the end on {node}\n{}",
            self.evidence(job)
        );
    }

    /// The job directory the task on `node` listed (`jobdir`, see
    /// [`listing_script`](super::listing_script)) is the job user's, mode 0700.
    pub fn assert_job_dir_private(&self, out: &Path, node: &str) {
        assert_eq!(
            task_file(out, node, "jobdir").trim(),
            format!("{} 700", self.user),
            "the job directory on {node} must belong to the job user, mode 0700"
        );
    }

    /// Every entry under `$SLUICE_STAGE_DIR` that the task on `node` listed (`owners`, see
    /// `listing_script`) is the job user's, and there is at least one.
    pub fn assert_staged_owned_by_user(&self, out: &Path, node: &str) {
        let owners = task_file(out, node, "owners");
        let mine = format!("{} ", self.user);
        assert!(
            !owners.is_empty() && owners.lines().all(|l| l.starts_with(&mine)),
            "entries under SLUICE_STAGE_DIR on {node} not owned by {}:\n{owners}",
            self.user
        );
    }
}

pub fn task_file(out: &Path, node: &str, name: &str) -> String {
    let path = out.join(node).join(name);
    fs::read_to_string(&path).unwrap_or_else(|e| format!("(missing {}: {e})", path.display()))
}
