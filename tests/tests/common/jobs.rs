//! Users and jobs: commands run as the unprivileged test users, `sbatch` and its result, the jobs
//! it created and their end as `scontrol` reports it, and the files a job's tasks write.

use super::cluster::{Cluster, POLL, run};
use std::fs;
use std::io::Write as _;
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

    /// Number of jobs Slurm knows (any state, including recently finished) with this name.
    pub fn jobs_named(&self, name: &str) -> usize {
        let out = run(Command::new("squeue").args(["-h", "-t", "all", "-n", name, "-o", "%i"]));
        out.lines().filter(|l| !l.trim().is_empty()).count()
    }

    /// One field of `scontrol show job -o` (e.g. `BatchHost`, `NodeList`, `RunTime`).
    pub fn job_field(&self, job: &Job, name: &str) -> Option<String> {
        let raw = self.job_state(job)?.raw;
        raw.split_whitespace()
            .find_map(|kv| kv.strip_prefix(name).and_then(|v| v.strip_prefix('=')))
            .map(String::from)
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

/// Reads one file a task wrote under `<out>/<node>/`.
pub fn task_file(out: &Path, node: &str, name: &str) -> String {
    let path = out.join(node).join(name);
    fs::read_to_string(&path).unwrap_or_else(|e| format!("(missing {}: {e})", path.display()))
}
