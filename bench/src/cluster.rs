//! What the cases that run real Slurm jobs on the test cluster share (`agg`, `cache`, `commit`):
//! the byte-counting relay in front of Garage (the end-to-end tests' own, `sluice_e2e::relay`), the
//! test user's jobs (a work directory in their home, `sbatch` as them, the job's state and bounded
//! waits on it), what a node's agent knows of a job, and the datasets' file trees that the jobs'
//! tasks list (`find -printf '%s %P\n'`) and the driver compares with the source.

use crate::measure::run_quiet;
use crate::run::{Bench, remove};
use anyhow::{Context, Result, anyhow, bail};
use sluice_e2e::agent_addrs;
use sluice_e2e::relay::CountingRelay;
use sluice_proto::msg::{JobStatus, Request, Response};
use std::collections::BTreeMap;
use std::io::Write;
use std::net::TcpStream;
use std::os::unix::fs::chown;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The bucket the agents reach through the origin relay (their `s3://datasets-relayed` store
/// profile points at its port).
pub(crate) const RELAYED: &str = "datasets-relayed";
/// What the test user's commands see as PATH (nothing from root's shell).
const USER_PATH: &str = "/usr/local/bin:/usr/bin:/bin";
/// Slurm's states of a job that has not ended.
const LIVE: [&str; 5] = ["PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "UNKNOWN"];

/// How a case waits on its jobs: the longest one may take (then it is cancelled), and how often the
/// driver looks (what a case times after a wait is only as fine as this).
#[derive(Clone, Copy)]
pub(crate) struct Patience {
    pub(crate) limit: Duration,
    pub(crate) every: Duration,
}

/// A dataset's files (path below it → size).
pub(crate) type Tree = BTreeMap<String, u64>;

pub(crate) fn source_tree(dir: &Path) -> Result<Tree> {
    fn walk(root: &Path, d: &Path, out: &mut Tree) -> Result<()> {
        for e in std::fs::read_dir(d)? {
            let e = e?;
            let md = e.metadata()?;
            if md.is_dir() {
                walk(root, &e.path(), out)?;
            } else {
                let rel = e.path().strip_prefix(root)?.to_string_lossy().into_owned();
                out.insert(rel, md.len());
            }
        }
        Ok(())
    }
    let mut t = Tree::new();
    walk(dir, dir, &mut t)?;
    Ok(t)
}

/// A task's `find -printf '%s %P\n'` listing.
pub(crate) fn parse_listing(text: &str) -> Result<Tree> {
    text.lines()
        .map(|l| {
            let (size, path) = l
                .split_once(' ')
                .ok_or_else(|| anyhow!("bad listing line {l:?}"))?;
            Ok((path.to_string(), size.parse()?))
        })
        .collect()
}

pub(crate) fn tree_bytes(t: &Tree) -> u64 {
    t.values().sum()
}

/// A tree's size as a report row shows it: the file's size, or "N x" the files' mean size.
pub(crate) fn tree_label(t: &Tree) -> String {
    let bytes = tree_bytes(t);
    if t.len() == 1 {
        crate::run::size_label(bytes)
    } else {
        format!(
            "{} x {}",
            t.len(),
            crate::run::size_label(bytes / t.len() as u64)
        )
    }
}

/// How `got` differs from `want`, for an error.
pub(crate) fn describe_diff(want: &Tree, got: &Tree) -> String {
    let missing: Vec<&String> = want.keys().filter(|k| !got.contains_key(*k)).collect();
    let extra: Vec<&String> = got.keys().filter(|k| !want.contains_key(*k)).collect();
    let wrong: Vec<&String> = want
        .iter()
        .filter(|(k, v)| got.get(*k).is_some_and(|g| g != *v))
        .map(|(k, _)| k)
        .collect();
    format!(
        "{} files / {} bytes, expected {} / {}; {} missing (e.g. {:?}), {} unexpected (e.g. {:?}), {} of the wrong size (e.g. {:?})",
        got.len(),
        tree_bytes(got),
        want.len(),
        tree_bytes(want),
        missing.len(),
        missing.first(),
        extra.len(),
        extra.first(),
        wrong.len(),
        wrong.first()
    )
}

/// What the agent on `socket` (the agent of `node`) knows of job `id`.
pub(crate) fn agent_job(socket: &Path, node: &str, id: u32) -> Result<JobStatus> {
    match sluice_proto::client::call(socket, Request::Job { job_id: id }, Duration::from_secs(10)) {
        Ok(Response::Job(s)) => Ok(s),
        other => bail!("the agent of {node} on job {id}: {other:?}"),
    }
}

impl Bench {
    /// A hop in front of Garage that a store profile of the agents points at: the port named by
    /// the env file's `var`, and Garage's `host:port` it forwards to.
    pub(crate) fn s3_hop(&self, var: &str) -> Result<(u16, String)> {
        let port: u16 = self
            .env(var)
            .parse()
            .with_context(|| format!("{var} in the cluster env file"))?;
        let upstream = self
            .env("SLUICE_TEST_S3_ENDPOINT")
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_string();
        Ok((port, upstream))
    }

    /// The byte-counting relay on the port of the agents' [`RELAYED`] store profile
    /// (`SLUICE_TEST_ORIGIN_RELAY_PORT`), in front of Garage.
    pub(crate) fn origin_relay(&self) -> Result<CountingRelay> {
        let (port, upstream) = self.s3_hop("SLUICE_TEST_ORIGIN_RELAY_PORT")?;
        CountingRelay::start(port, &upstream).with_context(|| {
            format!(
                "listening on 127.0.0.1:{port} for the origin relay (is a test's relay running?)"
            )
        })
    }

    /// Uploads the driver's data sets `names` (below its data directory) to the relayed bucket as
    /// `bench/NAME`, straight to Garage (untimed; rclone skips what is there already).
    pub(crate) fn upload_relayed(&self, names: &[&str]) -> Result<()> {
        for name in names {
            let src = self.data.join(name);
            run_quiet(&mut self.rclone_tuned(&[
                "copy",
                src.to_str().unwrap(),
                &format!("s3:{RELAYED}/bench/{name}"),
            ]))
            .with_context(|| format!("uploading {name} to s3:{RELAYED}"))?;
        }
        Ok(())
    }

    /// A fresh directory `~/BASE/LABEL` of the test user, both owned by them, for one job's script
    /// output and listings.
    pub(crate) fn user_workdir(&self, base: &str, label: &str) -> Result<PathBuf> {
        let base = PathBuf::from(format!("/home/{}/{base}", self.a.user));
        let dir = base.join(label);
        remove(&dir)?;
        std::fs::create_dir_all(&dir)?;
        for d in [&base, &dir] {
            chown(d, Some(self.uid), Some(self.gid))?;
        }
        Ok(dir)
    }

    /// Submits `script` as the test user (a clean environment, in `cwd`), named `name`, its output
    /// to `output`; returns the job id.
    pub(crate) fn sbatch(
        &self,
        name: &str,
        cwd: &Path,
        output: &Path,
        args: &[String],
        script: &str,
    ) -> Result<u32> {
        let mut c = Command::new("runuser");
        c.args(["-u", &self.a.user, "--", "env", "-i"])
            .arg(format!("HOME=/home/{}", self.a.user))
            .arg(format!("USER={}", self.a.user))
            .arg(format!("PATH={USER_PATH}"))
            .arg("LANG=C.UTF-8")
            .args(["sbatch", "--parsable", "-J", name])
            .arg(format!("--output={}", output.display()))
            .args(args)
            .current_dir(cwd)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = c.spawn().context("runuser sbatch")?;
        child.stdin.take().unwrap().write_all(script.as_bytes())?;
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!(
                "sbatch {args:?} failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let text = String::from_utf8_lossy(&out.stdout);
        text.trim()
            .split(';')
            .next()
            .unwrap_or_default()
            .parse()
            .with_context(|| format!("sbatch printed {text:?}"))
    }

    /// `scontrol show job -o ID`: the job's line (empty when scontrol says nothing).
    pub(crate) fn job_line(&self, id: u32) -> String {
        Command::new("scontrol")
            .args(["show", "job", "-o", &id.to_string()])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default()
    }

    /// The job's `JobState` (`UNKNOWN` when scontrol does not say).
    pub(crate) fn job_state(&self, id: u32) -> String {
        self.job_line(id)
            .split_whitespace()
            .find_map(|w| w.strip_prefix("JobState="))
            .unwrap_or("UNKNOWN")
            .to_string()
    }

    /// Why a job broke: its state line and the tail of its output (`W/job.out`).
    pub(crate) fn job_evidence(&self, id: u32, w: &Path) -> String {
        let line = self.job_line(id);
        let out = std::fs::read_to_string(w.join("job.out")).unwrap_or_default();
        let tail: Vec<&str> = out.lines().rev().take(20).collect();
        format!(
            "job {id}: {line}; output: {}",
            tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
        )
    }

    /// Polls until `done()`: an error if the job ends first (a job that reaches what `done` waits
    /// for between the two looks has not), or after `p.limit` (the job is cancelled then).
    pub(crate) fn wait_job(
        &self,
        id: u32,
        w: &Path,
        p: Patience,
        done: &dyn Fn() -> bool,
        what: &str,
    ) -> Result<()> {
        let t = Instant::now();
        while !done() {
            let state = self.job_state(id);
            if done() {
                break;
            }
            if !LIVE.contains(&state.as_str()) {
                bail!(
                    "job ended {state} before {what}: {}",
                    self.job_evidence(id, w)
                );
            }
            if t.elapsed() > p.limit {
                let _ = Command::new("scancel").arg(id.to_string()).status();
                bail!(
                    "no {what} after {} s: {}",
                    p.limit.as_secs(),
                    self.job_evidence(id, w)
                );
            }
            std::thread::sleep(p.every);
        }
        Ok(())
    }

    /// Polls until the job is COMPLETED; an error if it ends otherwise or takes too long.
    pub(crate) fn wait_completed(&self, id: u32, w: &Path, p: Patience) -> Result<()> {
        let completed = || self.job_state(id) == "COMPLETED";
        self.wait_job(id, w, p, &completed, "COMPLETED")
    }

    /// The job's nodes, one name each (`scontrol show hostnames` of its `NodeList`).
    pub(crate) fn job_nodes(&self, id: u32) -> Result<Vec<String>> {
        let line = self.job_line(id);
        let list = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("NodeList="))
            .ok_or_else(|| anyhow!("job {id} has no NodeList: {line}"))?;
        let out = run_quiet(Command::new("scontrol").args(["show", "hostnames", list]))?;
        Ok(out.lines().map(str::to_string).collect())
    }
}

// ------------------------------------------------------------------------------ the agents

/// A node's agent as the harness started it (from its pid file and `/proc`), to restart it with
/// another configuration and to start it again as it was.
#[derive(Clone)]
pub(crate) struct AgentProc {
    pub(crate) argv: Vec<String>,
    env: Vec<(String, String)>,
}

impl Bench {
    fn agent_pid_file(&self, node: &str) -> PathBuf {
        let run_dir = self.a.env.parent().unwrap_or(Path::new("/run/sluice-test"));
        run_dir.join(format!("sluiced-{node}.pid"))
    }

    /// The socket of `node`'s agent.
    pub(crate) fn socket_of(&self, node: &str) -> PathBuf {
        PathBuf::from(self.env("SLUICE_TEST_SOCKET").replace("%n", node))
    }

    fn agent_pid(&self, node: &str) -> Result<u32> {
        let f = self.agent_pid_file(node);
        std::fs::read_to_string(&f)
            .with_context(|| format!("reading {}", f.display()))?
            .trim()
            .parse()
            .with_context(|| format!("{} holds no pid", f.display()))
    }

    pub(crate) fn agent_proc(&self, node: &str) -> Result<AgentProc> {
        let pid = self.agent_pid(node)?;
        let split = |b: Vec<u8>| -> Vec<String> {
            b.split(|c| *c == 0)
                .filter(|s| !s.is_empty())
                .map(|s| String::from_utf8_lossy(s).into_owned())
                .collect()
        };
        let argv = split(
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .with_context(|| format!("the agent of {node} (pid {pid}) is not running"))?,
        );
        if !argv.iter().any(|a| a.contains("sluiced")) {
            bail!("pid {pid} is not sluiced: {argv:?}");
        }
        let env = split(std::fs::read(format!("/proc/{pid}/environ"))?)
            .into_iter()
            .filter_map(|kv| kv.split_once('=').map(|(k, v)| (k.into(), v.into())))
            .collect();
        Ok(AgentProc { argv, env })
    }

    /// SIGKILLs `node`'s agent and waits until it, and its peer and metrics ports, are gone.
    pub(crate) fn kill_agent(&self, node: &str) -> Result<()> {
        let pid = self.agent_pid(node)?;
        let _ = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
        let ports = agent_addrs(|v| self.env(v), node);
        let t = Instant::now();
        loop {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let gone = stat
                .rsplit_once(") ")
                .is_none_or(|(_, r)| r.starts_with('Z'));
            if gone && ports.iter().all(|a| TcpStream::connect(a).is_err()) {
                return Ok(());
            }
            if t.elapsed() > Duration::from_secs(20) {
                bail!("the agent of {node} (pid {pid}) or its ports {ports:?} are still there");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Starts an agent as `p` says (its own session, output appended to the node's agent log),
    /// records its pid where the harness keeps it, and waits until it answers.
    pub(crate) fn start_agent(&self, node: &str, p: &AgentProc) -> Result<()> {
        let log_path =
            PathBuf::from(self.env("SLUICE_TEST_SLUICE_LOG_DIR")).join(format!("{node}.log"));
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)?;
        let mut child = Command::new("setsid")
            .args(&p.argv)
            .env_clear()
            .envs(p.env.iter().map(|(k, v)| (k, v)))
            .current_dir("/")
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("starting {:?}", p.argv))?;
        std::fs::write(self.agent_pid_file(node), format!("{}\n", child.id()))?;
        std::thread::spawn(move || {
            let _ = child.wait();
        });
        let t = Instant::now();
        while sluice_proto::client::call(
            &self.socket_of(node),
            Request::Status,
            Duration::from_secs(2),
        )
        .is_err()
        {
            if t.elapsed() > Duration::from_secs(30) {
                bail!("the restarted agent of {node} does not answer after 30 s");
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Ok(())
    }
}
