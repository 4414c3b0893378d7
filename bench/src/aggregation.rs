//! The aggregation cases (`agg`, issue 11): real 3-node Slurm jobs stage one dataset, and the origin
//! is measured from its own side. Every job reads Garage through this driver's relay on the port of
//! the agents' `s3://datasets-relayed` store profile (`SLUICE_TEST_ORIGIN_RELAY_PORT`, which
//! `tests/harness/cluster.sh` configures), which counts the bytes Garage sends back and can pace all
//! its connections together to one bandwidth. The peer is what sites do today: `rclone copy` on
//! every node in a step of the job (`srun -N3 --ntasks-per-node=1`), through the same relay.
//!
//! Three measurements:
//! 1. origin bytes per 3-node job ÷ dataset bytes, for `--stage-mode=replicate` (peers),
//!    `--stage-mode=shard` and `--stage-tier=shared`, on one big object and on many small ones;
//! 2. with the origin paced, 3-node replicate staging time ÷ 1-node staging time (the agents' own
//!    stage time: the longest `elapsed_ms` of the job's stages over its nodes; rclone: the step's
//!    first start to last end on the nodes);
//! 3. the agents' own CPU (utime + stime of each `sluiced`, `/proc/PID/stat`) per GiB landed on the
//!    nodes, and their peak RSS (`VmHWM`, reset through `/proc/PID/clear_refs` before the job).
//!
//! Every job's tasks list what they hold (`find -printf '%s %P'` on each node); the driver compares
//! the listing with the source tree (every node whole for replicate and shared, the nodes' disjoint
//! union for shard), so a broken run is an error, never a number.

use crate::measure::{median, run_quiet};
use crate::run::{Bench, GIB, MIB, Report, Row, log, remove, size_label};
use anyhow::{Context, Result, anyhow, bail};
use sluice_proto::msg::{JobStatus, Request, Response, StageState};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::fs::chown;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The bucket the agents reach through the relay (its store profile points at the relay's port).
const RELAYED: &str = "datasets-relayed";
/// The ceiling on origin bytes per job, and on 3-node ÷ 1-node staging time when paced.
const ORIGIN_TARGET: f64 = 1.02;
const PACED_TARGET: f64 = 1.15;
/// The existing RSS budget of the agent (the `rss` case's).
const RSS_BUDGET_MIB: f64 = 256.0;
/// A job, staging included (the plugin's stage_timeout is 120 s), and its end after the epilogs.
const JOB_TIMEOUT: Duration = Duration::from_secs(400);
/// What the test user's commands see as PATH (nothing from root's shell).
const USER_PATH: &str = "/usr/local/bin:/usr/bin:/bin";
/// The peer's flags: the tuned rclone of the other cases.
const RCLONE_FLAGS: &str = "--transfers 32 --multi-thread-streams 8 --checkers 32";

// ------------------------------------------------------------------------------------ the relay

/// A TCP relay in front of Garage, counting what Garage sends back (bodies, listings, headers):
/// what the origin served. Paced, all its connections together carry at most `rate` bytes a second.
/// Stops, cutting its connections, when dropped.
struct Relay {
    served: Arc<AtomicU64>,
    pace: Arc<Pace>,
    stop: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
    port: u16,
    accept: Option<JoinHandle<()>>,
}

impl Relay {
    fn start(port: u16, upstream: String) -> Result<Relay> {
        let listener = TcpListener::bind(("127.0.0.1", port)).with_context(|| {
            format!(
                "listening on 127.0.0.1:{port} for the origin relay (is a test's relay running?)"
            )
        })?;
        let served = Arc::new(AtomicU64::new(0));
        let pace = Arc::new(Pace::default());
        let stop = Arc::new(AtomicBool::new(false));
        let conns: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let (s, p, st, c) = (served.clone(), pace.clone(), stop.clone(), conns.clone());
        let accept = std::thread::spawn(move || {
            for client in listener.incoming() {
                if st.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(&upstream) else {
                    continue;
                };
                let (Ok(c1), Ok(s1), Ok(c2), Ok(s2)) = (
                    client.try_clone(),
                    server.try_clone(),
                    client.try_clone(),
                    server.try_clone(),
                ) else {
                    continue;
                };
                c.lock().unwrap().extend([c1, s1]);
                std::thread::spawn(move || pipe(c2, s2, None, None));
                let (s, p) = (s.clone(), p.clone());
                std::thread::spawn(move || pipe(server, client, Some(&s), Some(&p)));
            }
        });
        Ok(Relay {
            served,
            pace,
            stop,
            conns,
            port,
            accept: Some(accept),
        })
    }

    /// The bytes served since the last call.
    fn take_served(&self) -> u64 {
        self.served.swap(0, Ordering::SeqCst)
    }

    /// At most `bytes_per_sec` from the origin over all connections together (0: unpaced).
    fn set_pace(&self, bytes_per_sec: u64) {
        self.pace.rate.store(bytes_per_sec, Ordering::SeqCst);
        *self.pace.next.lock().unwrap() = None;
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for c in self.conns.lock().unwrap().drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
        let _ = TcpStream::connect(("127.0.0.1", self.port)); // wakes the accept loop
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

/// One timeline for every connection: each chunk relayed back waits for its slot in it.
#[derive(Default)]
struct Pace {
    rate: AtomicU64,
    next: Mutex<Option<Instant>>,
}

impl Pace {
    fn wait(&self, n: usize) {
        let rate = self.rate.load(Ordering::SeqCst);
        if rate == 0 {
            return;
        }
        let until = {
            let mut next = self.next.lock().unwrap();
            let start = next.map_or_else(Instant::now, |t| t.max(Instant::now()));
            let end = start + Duration::from_secs_f64(n as f64 / rate as f64);
            *next = Some(end);
            end
        };
        std::thread::sleep(until.saturating_duration_since(Instant::now()));
    }
}

fn pipe(mut from: TcpStream, mut to: TcpStream, count: Option<&AtomicU64>, pace: Option<&Pace>) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Some(c) = count {
            c.fetch_add(n as u64, Ordering::SeqCst);
        }
        if let Some(p) = pace {
            p.wait(n);
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

// ------------------------------------------------------------------------------------ agents

/// One node's agent, as `cluster.sh up` started it (its pid file).
struct Agent {
    node: String,
    pid: u32,
    socket: PathBuf,
}

fn clock_ticks() -> f64 {
    // SAFETY: sysconf only reads a system constant.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 { t as f64 } else { 100.0 }
}

impl Agent {
    /// utime + stime (+ those of waited-for children: copy helpers), seconds.
    fn cpu_s(&self) -> Result<f64> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid))
            .with_context(|| format!("the agent of {} (pid {}) is gone", self.node, self.pid))?;
        // Fields after the command's closing parenthesis: state is field 3, utime 14 .. cstime 17.
        let rest = stat.rsplit_once(") ").map(|(_, r)| r).unwrap_or("");
        let f: Vec<f64> = rest
            .split_whitespace()
            .skip(11)
            .take(4)
            .filter_map(|v| v.parse().ok())
            .collect();
        if f.len() != 4 {
            bail!("cannot read /proc/{}/stat: {stat:?}", self.pid);
        }
        Ok(f.iter().sum::<f64>() / clock_ticks())
    }

    fn vm_hwm_kib(&self) -> Result<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid))?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| anyhow!("no VmHWM in /proc/{}/status", self.pid))
    }

    /// Resets VmHWM to the current RSS (clear_refs "5", Linux >= 4.0).
    fn reset_hwm(&self) -> Result<()> {
        std::fs::write(format!("/proc/{}/clear_refs", self.pid), "5")
            .with_context(|| format!("resetting the peak RSS of pid {}", self.pid))
    }

    fn job(&self, id: u32) -> Result<JobStatus> {
        match sluice_proto::client::call(
            &self.socket,
            Request::Job { job_id: id },
            Duration::from_secs(10),
        ) {
            Ok(Response::Job(s)) => Ok(s),
            other => bail!("the agent of {} on job {id}: {other:?}", self.node),
        }
    }
}

// ------------------------------------------------------------------------------------ jobs

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum How {
    Replicate,
    Shard,
    Shared,
    Rclone,
}

impl How {
    fn label(self) -> &'static str {
        match self {
            How::Replicate => "replicate",
            How::Shard => "shard",
            How::Shared => "shared",
            How::Rclone => "rclone",
        }
    }

    /// How many times a 3-node job writes the dataset: once per node, or once for the job.
    fn landed_copies(self) -> f64 {
        match self {
            How::Replicate | How::Rclone => 3.0,
            How::Shard | How::Shared => 1.0,
        }
    }

    fn sbatch_args(self) -> &'static [&'static str] {
        match self {
            How::Replicate => &["--stage-mode=replicate"],
            How::Shard => &["--stage-mode=shard"],
            How::Shared => &["--stage-tier=shared"],
            How::Rclone => &[],
        }
    }
}

/// What one job showed.
#[derive(Debug, Default, Clone)]
struct Outcome {
    /// Bytes the origin sent back through the relay during the job.
    served: u64,
    /// Staging time (see the module doc), seconds.
    stage_s: f64,
    /// From submission to the batch script's first line.
    submit_to_start_s: f64,
    /// CPU seconds: the agents' together (sluice), rclone's user + sys on every node (rclone).
    cpu_s: f64,
    /// The agents' highest VmHWM during the job, MiB (sluice only).
    hwm_mib: f64,
    origin_bytes: u64,
    peer_bytes: u64,
}

/// A dataset's expected files (path below it → size).
type Tree = BTreeMap<String, u64>;

fn source_tree(dir: &Path) -> Result<Tree> {
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
fn parse_listing(text: &str) -> Result<Tree> {
    text.lines()
        .map(|l| {
            let (size, path) = l
                .split_once(' ')
                .ok_or_else(|| anyhow!("bad listing line {l:?}"))?;
            Ok((path.to_string(), size.parse()?))
        })
        .collect()
}

fn tree_bytes(t: &Tree) -> u64 {
    t.values().sum()
}

fn describe_diff(want: &Tree, got: &Tree) -> String {
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

/// One dataset a job stages: its name in the job and its prefix in the relayed bucket.
struct Ds<'t> {
    name: &'static str,
    prefix: String,
    tree: &'t Tree,
}

impl Bench {
    fn agents(&self) -> Result<Vec<Agent>> {
        let run_dir = self.a.env.parent().unwrap_or(Path::new("/run/sluice-test"));
        let socket = self.env("SLUICE_TEST_SOCKET");
        self.env("SLUICE_TEST_NODES")
            .split_whitespace()
            .map(|n| {
                let pidfile = run_dir.join(format!("sluiced-{n}.pid"));
                let pid = std::fs::read_to_string(&pidfile)
                    .with_context(|| format!("reading {}", pidfile.display()))?
                    .trim()
                    .parse()
                    .with_context(|| format!("{} holds no pid", pidfile.display()))?;
                Ok(Agent {
                    node: n.to_string(),
                    pid,
                    socket: PathBuf::from(socket.replace("%n", n)),
                })
            })
            .collect()
    }

    /// A fresh directory in the test user's home for one job's script output and listings.
    fn agg_workdir(&self, label: &str) -> Result<PathBuf> {
        let base = PathBuf::from(format!("/home/{}/sluice-bench-agg", self.a.user));
        let dir = base.join(label);
        remove(&dir)?;
        std::fs::create_dir_all(&dir)?;
        for d in [&base, &dir] {
            chown(d, Some(self.uid), Some(self.gid))?;
        }
        Ok(dir)
    }

    /// The batch script: a sluice job's tasks list what they hold, then the script waits for the
    /// driver's go (so the agents still know the job while the driver reads them); an rclone job's
    /// tasks copy the dataset through the relay first, timed, and remove their copy afterwards.
    fn agg_script(&self, how: How, w: &Path, datasets: &[Ds]) -> String {
        let w = w.display();
        let names = datasets
            .iter()
            .map(|d| d.name)
            .collect::<Vec<_>>()
            .join(" ");
        let list = |dir: &str| {
            format!(
                "for n in {names}; do\n  if [ -d \"{dir}/$n\" ]; then find \"{dir}/$n\" -type f -printf \"%s %P\\n\" > \"$o/files-$n\"; \
                 else : > \"$o/files-$n\"; fi\ndone\n"
            )
        };
        if how == How::Rclone {
            let copies: String = datasets
                .iter()
                .map(|d| {
                    format!(
                        "{{ time {rclone} copy relayed:{RELAYED}/{p} \"$d/{n}\" {RCLONE_FLAGS} 2> \"$o/rclone-{n}.err\"; }} 2> \"$o/cpu-{n}\"\n\
                         echo $? > \"$o/rc-{n}\"\n",
                        rclone = self.a.rclone.display(),
                        p = d.prefix,
                        n = d.name
                    )
                })
                .collect();
            format!(
                "#!/bin/bash\ndate +%s.%N > \"{w}/start\"\n\
                 export RCLONE_CONFIG=/notfound RCLONE_CONFIG_RELAYED_TYPE=s3 RCLONE_CONFIG_RELAYED_PROVIDER=Other \
                 RCLONE_CONFIG_RELAYED_ENDPOINT=http://127.0.0.1:{port} RCLONE_CONFIG_RELAYED_REGION={region} \
                 RCLONE_CONFIG_RELAYED_ACCESS_KEY_ID={key} RCLONE_CONFIG_RELAYED_SECRET_ACCESS_KEY={secret}\n\
                 srun --ntasks-per-node=1 /bin/bash -c '\n\
                 o=\"{w}/$SLURMD_NODENAME\"; mkdir -p \"$o\"; d=\"{w}/copy-$SLURMD_NODENAME\"\n\
                 TIMEFORMAT=\"%U %S\"\ndate +%s.%N > \"$o/t0\"\n{copies}date +%s.%N > \"$o/t1\"\n{list}rm -rf \"$d\"\ntouch \"$o/done\"\n'\n",
                port = self.env("SLUICE_TEST_ORIGIN_RELAY_PORT"),
                region = self.env("SLUICE_TEST_S3_REGION"),
                key = self.env("SLUICE_TEST_S3_KEY_ID"),
                secret = self.env("SLUICE_TEST_S3_SECRET"),
                list = list("$d"),
            )
        } else {
            format!(
                "#!/bin/bash\ndate +%s.%N > \"{w}/start\"\n\
                 srun --ntasks-per-node=1 /bin/bash -c '\n\
                 o=\"{w}/$SLURMD_NODENAME\"; mkdir -p \"$o\"\necho \"$SLUICE_STAGE_DIR\" > \"$o/stage_dir\"\n{list}touch \"$o/done\"\n'\n\
                 rc=$?\ntouch \"{w}/staged\"\n\
                 i=0; while [ ! -e \"{w}/go\" ] && [ $i -lt 3000 ]; do sleep 0.1; i=$((i+1)); done\nexit $rc\n",
                list = list("$SLUICE_STAGE_DIR"),
            )
        }
    }

    fn sbatch(&self, w: &Path, args: &[String], script: &str) -> Result<u32> {
        let mut c = Command::new("runuser");
        c.args(["-u", &self.a.user, "--", "env", "-i"])
            .arg(format!("HOME=/home/{}", self.a.user))
            .arg(format!("USER={}", self.a.user))
            .arg(format!("PATH={USER_PATH}"))
            .arg("LANG=C.UTF-8")
            .args(["sbatch", "--parsable", "-J", "sluice-bench-agg"])
            .arg(format!("--output={}/job.out", w.display()))
            .args(args)
            .current_dir(w)
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

    fn job_state(&self, id: u32) -> Result<(String, String)> {
        let out = Command::new("scontrol")
            .args(["show", "job", "-o", &id.to_string()])
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let state = text
            .split_whitespace()
            .find_map(|w| w.strip_prefix("JobState="))
            .unwrap_or("UNKNOWN")
            .to_string();
        Ok((state, text))
    }

    /// Why a job broke: its state line and the tail of its output.
    fn job_evidence(&self, id: u32, w: &Path) -> String {
        let line = self.job_state(id).map(|s| s.1).unwrap_or_default();
        let out = std::fs::read_to_string(w.join("job.out")).unwrap_or_default();
        let tail: Vec<&str> = out.lines().rev().take(8).collect();
        format!(
            "job {id}: {line}; output: {}",
            tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
        )
    }

    /// Polls until `done()` or the job leaves its live states (an error unless `ended_ok`).
    fn wait_job(&self, id: u32, w: &Path, done: &dyn Fn() -> bool, what: &str) -> Result<()> {
        let t = Instant::now();
        loop {
            if done() {
                return Ok(());
            }
            let (state, _) = self.job_state(id)?;
            match state.as_str() {
                "PENDING" | "CONFIGURING" | "RUNNING" | "COMPLETING" | "UNKNOWN" | "COMPLETED" => {}
                _ => bail!(
                    "job ended {state} before {what}: {}",
                    self.job_evidence(id, w)
                ),
            }
            if state == "COMPLETED" && !done() {
                bail!("job COMPLETED before {what}: {}", self.job_evidence(id, w));
            }
            if t.elapsed() > JOB_TIMEOUT {
                let _ = Command::new("scancel").arg(id.to_string()).status();
                bail!(
                    "no {what} after {} s: {}",
                    JOB_TIMEOUT.as_secs(),
                    self.job_evidence(id, w)
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn wait_completed(&self, id: u32, w: &Path) -> Result<()> {
        let completed = || {
            self.job_state(id)
                .map(|(s, _)| s == "COMPLETED")
                .unwrap_or(false)
        };
        self.wait_job(id, w, &completed, "COMPLETED")
    }

    /// Submits one job on `nodes` nodes staging `datasets` the way `how` says, checks what every
    /// node holds, and reports what the origin served, the staging time and the agents' CPU and RSS.
    fn agg_job(
        &self,
        relay: &Relay,
        agents: &[Agent],
        how: How,
        nodes: usize,
        datasets: &[Ds],
        label: &str,
    ) -> Result<Outcome> {
        let w = self.agg_workdir(label)?;
        let mut args = vec![format!("-N{nodes}")];
        if how != How::Rclone {
            let stage_in: Vec<String> = datasets
                .iter()
                .map(|d| format!("{}=s3://{RELAYED}/{}", d.name, d.prefix))
                .collect();
            args.push(format!("--stage-in={}", stage_in.join(",")));
            args.extend(how.sbatch_args().iter().map(|s| s.to_string()));
        }
        let script = self.agg_script(how, &w, datasets);
        let sluice = how != How::Rclone;
        if sluice {
            for a in agents {
                a.reset_hwm()?;
            }
        }
        let cpu_before: Vec<f64> = agents.iter().map(Agent::cpu_s).collect::<Result<_>>()?;
        relay.take_served();
        let submitted = std::time::SystemTime::now();
        let id = self.sbatch(&w, &args, &script)?;
        let mut o = Outcome::default();
        if sluice {
            let staged = w.join("staged");
            let result = (|| -> Result<()> {
                self.wait_job(id, &w, &|| staged.exists(), "its tasks listed the stage")?;
                o.served = relay.take_served();
                let cpu_after: Vec<f64> = agents.iter().map(Agent::cpu_s).collect::<Result<_>>()?;
                o.cpu_s = cpu_after.iter().zip(&cpu_before).map(|(a, b)| a - b).sum();
                for a in agents {
                    o.hwm_mib = o.hwm_mib.max(a.vm_hwm_kib()? as f64 / 1024.0);
                }
                let job_nodes = self.job_nodes(id)?;
                for a in agents.iter().filter(|a| job_nodes.contains(&a.node)) {
                    let s = a.job(id)?;
                    for p in &s.stages {
                        if p.state != StageState::Done {
                            bail!(
                                "{}: stage {} is {:?} ({:?})",
                                a.node,
                                p.name,
                                p.state,
                                p.error
                            );
                        }
                        o.stage_s = o.stage_s.max(p.elapsed_ms as f64 / 1000.0);
                        o.origin_bytes += p.origin_bytes;
                        o.peer_bytes += p.peer_bytes;
                    }
                }
                Ok(())
            })();
            std::fs::write(w.join("go"), "")?;
            result.with_context(|| self.job_evidence(id, &w))?;
        }
        self.wait_completed(id, &w)?;
        if !sluice {
            o.served = relay.take_served();
        }
        o.submit_to_start_s = read_time(&w.join("start"))?
            - submitted
                .duration_since(std::time::UNIX_EPOCH)?
                .as_secs_f64();
        self.check_listings(id, how, &w, datasets, &mut o)?;
        remove(&w)?;
        Ok(o)
    }

    fn job_nodes(&self, id: u32) -> Result<Vec<String>> {
        let (_, line) = self.job_state(id)?;
        let list = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("NodeList="))
            .ok_or_else(|| anyhow!("job {id} has no NodeList: {line}"))?;
        let out = run_quiet(Command::new("scontrol").args(["show", "hostnames", list]))?;
        Ok(out.lines().map(str::to_string).collect())
    }

    /// What the tasks listed against the sources: every node whole (replicate, shared, rclone), or
    /// the nodes' disjoint union (shard). For rclone also its exit status, time and CPU.
    fn check_listings(
        &self,
        id: u32,
        how: How,
        w: &Path,
        datasets: &[Ds],
        o: &mut Outcome,
    ) -> Result<()> {
        let nodes = self.job_nodes(id)?;
        let mut stage_dirs = Vec::new();
        let (mut t0, mut t1) = (f64::INFINITY, 0.0f64);
        for n in &nodes {
            let dir = w.join(n);
            if !dir.join("done").exists() {
                bail!(
                    "no task ran to the end on {n}: {}",
                    self.job_evidence(id, w)
                );
            }
            if let Ok(s) = std::fs::read_to_string(dir.join("stage_dir")) {
                stage_dirs.push(s.trim().to_string());
            }
            if how == How::Rclone {
                for d in datasets {
                    let rc = std::fs::read_to_string(dir.join(format!("rc-{}", d.name)))?;
                    if rc.trim() != "0" {
                        let err =
                            std::fs::read_to_string(dir.join(format!("rclone-{}.err", d.name)))
                                .unwrap_or_default();
                        bail!("rclone on {n} exited {}: {}", rc.trim(), err.trim());
                    }
                    let cpu = std::fs::read_to_string(dir.join(format!("cpu-{}", d.name)))?;
                    o.cpu_s += cpu
                        .split_whitespace()
                        .map(|v| v.parse::<f64>())
                        .sum::<Result<f64, _>>()
                        .with_context(|| format!("rclone's time on {n}: {cpu:?}"))?;
                }
                t0 = t0.min(read_time(&dir.join("t0"))?);
                t1 = t1.max(read_time(&dir.join("t1"))?);
            }
        }
        if how == How::Rclone {
            o.stage_s = t1 - t0;
        }
        if how == How::Shared && stage_dirs.windows(2).any(|p| p[0] != p[1]) {
            bail!("the nodes see different stage directories on the shared tier: {stage_dirs:?}");
        }
        for d in datasets {
            let mut union = Tree::new();
            for n in &nodes {
                let got = parse_listing(&std::fs::read_to_string(
                    w.join(n).join(format!("files-{}", d.name)),
                )?)?;
                if how == How::Shard {
                    for (p, s) in got {
                        if union.insert(p.clone(), s).is_some() {
                            bail!("{}: {p} is held by two nodes in shard mode", d.name);
                        }
                    }
                } else if &got != d.tree {
                    bail!(
                        "{} on {n} ({}): {}",
                        d.name,
                        how.label(),
                        describe_diff(d.tree, &got)
                    );
                }
            }
            if how == How::Shard && &union != d.tree {
                bail!(
                    "{}: the shard nodes together hold {}",
                    d.name,
                    describe_diff(d.tree, &union)
                );
            }
        }
        Ok(())
    }

    // ------------------------------------------------------------------------------------ the case

    /// Uploads the big and small datasets to the relayed bucket, straight to Garage (untimed).
    fn agg_upload(&self) -> Result<()> {
        for name in ["big", "small"] {
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

    pub(crate) fn agg_cases(&self, r: &mut Report) {
        let case = "agg";
        let result = (|| -> Result<()> {
            self.agg_upload()?;
            let agents = self.agents()?;
            let port: u16 = self
                .env("SLUICE_TEST_ORIGIN_RELAY_PORT")
                .parse()
                .context("SLUICE_TEST_ORIGIN_RELAY_PORT in the cluster env file")?;
            let upstream = self
                .env("SLUICE_TEST_S3_ENDPOINT")
                .trim_start_matches("http://")
                .trim_end_matches('/')
                .to_string();
            let relay = Relay::start(port, upstream)?;
            r.note(format!(
                "agg rows: real Slurm jobs as {} against the cluster's agents ([peer] on, [shared_tier] a local stand-in), \
                 Garage read through the bench's byte-counting relay on 127.0.0.1:{port}; peer = `rclone copy {RCLONE_FLAGS}` \
                 in an `srun --ntasks-per-node=1` step of the job; paced rows at {} MiB/s for all clients together",
                self.a.user,
                self.sizes.agg_pace / MIB
            ));
            let big = source_tree(&self.data.join("big"))?;
            let small = source_tree(&self.data.join("small"))?;
            self.agg_origin(r, &relay, &agents, &big, &small)?;
            self.agg_paced(r, &relay, &agents, &big)?;
            self.agg_rss(r, &relay, &agents, &big)
        })();
        if let Err(e) = result {
            r.error(case, e);
        }
    }

    /// Part 1: origin bytes per 3-node job, each sluice mode and rclone on every node, alternating.
    fn agg_origin(
        &self,
        r: &mut Report,
        relay: &Relay,
        agents: &[Agent],
        big: &Tree,
        small: &Tree,
    ) -> Result<()> {
        let hows = [How::Replicate, How::Shard, How::Shared, How::Rclone];
        for (shape, name, tree) in [("one object", "big", big), ("many objects", "small", small)] {
            let ds = [Ds {
                name: "ds",
                prefix: format!("bench/{name}"),
                tree,
            }];
            let bytes = tree_bytes(tree);
            let mut samples: Vec<Vec<Outcome>> = vec![Vec::new(); hows.len()];
            for rep in 0..self.a.reps {
                for k in 0..hows.len() {
                    let i = (k + rep) % hows.len();
                    let how = hows[i];
                    let o = self
                        .agg_job(
                            relay,
                            agents,
                            how,
                            3,
                            &ds,
                            &format!("origin-{name}-{}", how.label()),
                        )
                        .with_context(|| {
                            format!("{} of {shape}, repetition {}", how.label(), rep + 1)
                        })?;
                    log(format!(
                        "agg: 3-node {} of {shape}: origin served {} bytes ({:.4}x), staging {:.2} s",
                        how.label(),
                        o.served,
                        o.served as f64 / bytes as f64,
                        o.stage_s
                    ));
                    samples[i].push(o);
                }
            }
            let size = if tree.len() == 1 {
                size_label(bytes)
            } else {
                format!("{} x {}", tree.len(), size_label(bytes / tree.len() as u64))
            };
            let ratios = |v: &[Outcome]| {
                v.iter()
                    .map(|o| o.served as f64 / bytes as f64)
                    .collect::<Vec<_>>()
            };
            let per_gib = |how: How, v: &[Outcome]| {
                median(&v.iter().map(|o| o.cpu_s).collect::<Vec<_>>())
                    / (how.landed_copies() * bytes as f64 / GIB)
            };
            let peer = ratios(&samples[3]);
            for (i, how) in hows[..3].iter().enumerate() {
                let s = ratios(&samples[i]);
                let (sm, pm) = (median(&s), median(&peer));
                r.rows.push(Row {
                    case: format!("agg: origin bytes / dataset, 3-node {}, {shape}", how.label()),
                    size: size.clone(),
                    bytes,
                    unit: "x".into(),
                    sluice: sm,
                    peer_name: "rclone copy on each node".into(),
                    peer: Some(pm),
                    ratio: Some(pm / sm),
                    sluice_cpu_s_per_gib: Some(per_gib(*how, &samples[i])),
                    peer_cpu_s_per_gib: Some(per_gib(How::Rclone, &samples[3])),
                    target: format!("<= {ORIGIN_TARGET:.2}x"),
                    met: Some(sm <= ORIGIN_TARGET),
                    note: format!(
                        "counted by the bench's relay in front of Garage; CPU = the 3 agents' (sluice) / rclone's on 3 nodes, per GiB written on the nodes (3 copies for replicate and rclone, 1 for shard and shared); peer bytes {:.0}% of landed",
                        100.0 * median(&samples[i].iter().map(|o| o.peer_bytes as f64).collect::<Vec<_>>())
                            / (how.landed_copies() * bytes as f64)
                    ),
                    sluice_samples: s,
                    peer_samples: peer.clone(),
                    sluice_cpu_s: samples[i].iter().map(|o| o.cpu_s).collect(),
                    peer_cpu_s: samples[3].iter().map(|o| o.cpu_s).collect(),
                    ..Row::default()
                });
            }
        }
        Ok(())
    }

    /// Part 2: the origin paced for everyone together: 3-node ÷ 1-node staging time of the big object.
    fn agg_paced(&self, r: &mut Report, relay: &Relay, agents: &[Agent], big: &Tree) -> Result<()> {
        let rate = self.sizes.agg_pace;
        let bytes = tree_bytes(big);
        let ds = [Ds {
            name: "ds",
            prefix: "bench/big".into(),
            tree: big,
        }];
        let runs = [
            (How::Replicate, 1),
            (How::Replicate, 3),
            (How::Rclone, 1),
            (How::Rclone, 3),
        ];
        let mut samples: Vec<Vec<Outcome>> = vec![Vec::new(); runs.len()];
        relay.set_pace(rate);
        let result = (|| -> Result<()> {
            for rep in 0..self.a.reps {
                for k in 0..runs.len() {
                    let i = (k + rep) % runs.len();
                    let (how, n) = runs[i];
                    let o = self
                        .agg_job(
                            relay,
                            agents,
                            how,
                            n,
                            &ds,
                            &format!("paced-{}-{n}", how.label()),
                        )
                        .with_context(|| {
                            format!(
                                "paced {} on {n} node(s), repetition {}",
                                how.label(),
                                rep + 1
                            )
                        })?;
                    log(format!(
                        "agg: paced {} on {n} node(s): staging {:.2} s (submit to script {:.2} s), origin {:.4}x",
                        how.label(),
                        o.stage_s,
                        o.submit_to_start_s,
                        o.served as f64 / bytes as f64
                    ));
                    samples[i].push(o);
                }
            }
            Ok(())
        })();
        relay.set_pace(0);
        result?;
        let times = |v: &[Outcome]| v.iter().map(|o| o.stage_s).collect::<Vec<_>>();
        let m: Vec<f64> = samples.iter().map(|v| median(&times(v))).collect();
        let (s, p) = (m[1] / m[0], m[3] / m[2]);
        let size = format!("{} at {} MiB/s", size_label(bytes), rate / MIB);
        r.rows.push(Row {
            case: "agg: paced origin, 3-node / 1-node staging time (replicate)".into(),
            size: size.clone(),
            bytes,
            unit: "x".into(),
            sluice: s,
            peer_name: "rclone copy on each node".into(),
            peer: Some(p),
            ratio: Some(p / s),
            target: format!("<= {PACED_TARGET:.2}x"),
            met: Some(s <= PACED_TARGET),
            note: format!(
                "staging time: sluice = the longest stage elapsed_ms of the job's agents, rclone = the srun step's first start to last end; medians 1-node/3-node: sluice {:.2}/{:.2} s, rclone {:.2}/{:.2} s; submit to script start, sluice 1-node/3-node: {:.2}/{:.2} s",
                m[0],
                m[1],
                m[2],
                m[3],
                median(&samples[0].iter().map(|o| o.submit_to_start_s).collect::<Vec<_>>()),
                median(&samples[1].iter().map(|o| o.submit_to_start_s).collect::<Vec<_>>()),
            ),
            sluice_samples: samples[1]
                .iter()
                .zip(&samples[0])
                .map(|(a, b)| a.stage_s / b.stage_s)
                .collect(),
            peer_samples: samples[3]
                .iter()
                .zip(&samples[2])
                .map(|(a, b)| a.stage_s / b.stage_s)
                .collect(),
            ..Row::default()
        });
        r.rows.push(Row {
            case: "agg: paced origin, 3-node staging time".into(),
            size,
            bytes,
            unit: "s".into(),
            sluice: m[1],
            peer_name: "rclone copy on each node".into(),
            peer: Some(m[3]),
            ratio: Some(m[3] / m[1]),
            target: "-".into(),
            note: format!("1-node: sluice {:.2} s, rclone {:.2} s", m[0], m[2]),
            sluice_samples: times(&samples[1]),
            peer_samples: times(&samples[3]),
            ..Row::default()
        });
        Ok(())
    }

    /// Part 3: the agents' CPU per GiB and peak RSS during a 3-node replicate of two copies of the
    /// big object (4 GiB in --full), unpaced.
    fn agg_rss(&self, r: &mut Report, relay: &Relay, agents: &[Agent], big: &Tree) -> Result<()> {
        let ds = ["a", "b"].map(|name| Ds {
            name,
            prefix: "bench/big".into(),
            tree: big,
        });
        let per_node = 2 * tree_bytes(big);
        let mut samples = Vec::new();
        for rep in 0..self.a.reps {
            let o = self
                .agg_job(relay, agents, How::Replicate, 3, &ds, "rss")
                .with_context(|| {
                    format!("3-node replicate of 2 datasets, repetition {}", rep + 1)
                })?;
            log(format!(
                "agg: 3-node replicate of {}: agents' peak RSS {:.1} MiB, CPU {:.2} s, origin {:.4}x",
                size_label(per_node),
                o.hwm_mib,
                o.cpu_s,
                o.served as f64 / per_node as f64
            ));
            if o.origin_bytes + o.peer_bytes != 3 * per_node {
                bail!(
                    "the agents landed {} origin + {} peer bytes, expected {} on 3 nodes",
                    o.origin_bytes,
                    o.peer_bytes,
                    3 * per_node
                );
            }
            samples.push(o);
        }
        let landed = 3.0 * per_node as f64 / GIB;
        let hwm: Vec<f64> = samples.iter().map(|o| o.hwm_mib).collect();
        let worst = hwm.iter().cloned().fold(0.0, f64::max);
        let cpu: Vec<f64> = samples.iter().map(|o| o.cpu_s).collect();
        let peer_share = median(
            &samples
                .iter()
                .map(|o| o.peer_bytes as f64)
                .collect::<Vec<_>>(),
        ) / (3 * per_node) as f64;
        let size = format!("2 x {} on 3 nodes", size_label(tree_bytes(big)));
        r.rows.push(Row {
            case: "agg: agent CPU per GiB landed, 3-node replicate".into(),
            size: size.clone(),
            bytes: 3 * per_node,
            unit: "s/GiB".into(),
            sluice: median(&cpu) / landed,
            peer_name: "-".into(),
            sluice_cpu_s_per_gib: Some(median(&cpu) / landed),
            target: "-".into(),
            note: format!(
                "utime+stime of the 3 agents (/proc/PID/stat) from submission to staged, per GiB written on the nodes; {:.0}% of it came from peers",
                100.0 * peer_share
            ),
            sluice_samples: cpu.iter().map(|c| c / landed).collect(),
            sluice_cpu_s: cpu.clone(),
            ..Row::default()
        });
        r.rows.push(Row {
            case: "agg: agent peak RSS, 3-node replicate".into(),
            size,
            bytes: 3 * per_node,
            unit: "MiB".into(),
            sluice: worst,
            peer_name: "-".into(),
            sluice_cpu_s_per_gib: Some(median(&cpu) / landed),
            target: format!("<= {RSS_BUDGET_MIB:.0} MiB"),
            met: Some(worst <= RSS_BUDGET_MIB),
            note: format!(
                "the highest VmHWM of the 3 agents (reset through clear_refs before the job), worst of {} run(s); the same budget as the rss row",
                hwm.len()
            ),
            sluice_samples: hwm,
            sluice_cpu_s: cpu,
            ..Row::default()
        });
        Ok(())
    }
}

fn read_time(path: &Path) -> Result<f64> {
    let t = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    t.trim()
        .parse()
        .with_context(|| format!("{} holds {t:?}", path.display()))
}
