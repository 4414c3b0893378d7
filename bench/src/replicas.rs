//! The replicas case (`replicas`, issue 26): real 3-node `--ckpt-tier=ram` jobs of the test user
//! (`bench/py/replicas_job.py`, one task per node) save `s1`, commit it, save `s2` at once while
//! `s1` flushes, replicates and archives, and commit `s2`. Three jobs, one repetition each:
//!
//! - **archive**: `--ckpt-replicas=1`, the archive up: commit → protected (every node's
//!   `sluice ckpt list` says so, polled every 50 ms through the agents' sockets) against commit →
//!   archived (every node says archived); then n2 is lost (its agent SIGKILLed, its RAM tier, its
//!   state and the job's hot-tier directory removed, its agent started again empty) and the job is
//!   requeued: `--ckpt-restore=latest` restores `s2` from the archive.
//! - **replicas**: the same with the archive down (the harness's fault proxy in front of Garage
//!   refusing every connection from before the first save): `s2` is only protected, and the
//!   requeue restores it from the replicas, the archive's store asked for nothing.
//! - **off**: `--ckpt-replicas=0`, the archive up, no requeue: the save stall without replicas.
//!
//! The restore's time is each node's agent's own (`sluice_restore_duration_seconds_sum` before
//! and after the requeue; the job waits for its slowest node, so the row takes the largest); every
//! rank of run 2 loads `s2` and compares it tensor for tensor with what it saved. The stall is
//! `s2`'s `sluice_ckpt.save(async_=True)` in the job, against a plain copy of the same tensors in
//! the same process (the floor). A job that fails, a wrong tensor, or a restore that read the
//! archive while it was down is an error, never a number.
//!
//! Not part of a plain `--smoke` run (it takes about 5 minutes even at the smoke size): `--smoke
//! --cases replicas` runs it at that size.
//!
//! The harness's agents give replicas 64 MiB of room and a job 768 MiB of RAM tier: above the
//! smoke size the case restarts all three with room for the parts (`[fast_tier] job_share`,
//! `replica_room`, `capacity`), and as the harness started them afterwards. A restore puts every
//! node's files of `s2` on every node, so a job's share must hold `s1` and the whole of `s2`: at
//! `--full` (1 GiB per node) the three nodes' RAM tiers, the replicas and the ranks' tensors
//! take about 20 GiB of RAM.

use crate::cluster::{AgentProc, Patience};
use crate::measure::median;
use crate::run::{Bench, GIB, MIB, Mode, Report, Row, log, remove, size_label};
use anyhow::{Context, Result, anyhow, bail};
use serde_json::Value;
use sluice_proto::msg::{CkptState, CkptStatus, Request, Response};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::fs::{PermissionsExt, chown};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The job's nodes, and the one that is lost.
const NODES: [&str; 3] = ["n1", "n2", "n3"];
const LOST: &str = "n2";
/// The targets: the stall at most 1.1× the copy (as without replicas); a restore from
/// replicas at least 3× faster than from the archive.
const STALL_TARGET: f64 = 1.1;
const RESTORE_TARGET: f64 = 3.0;
/// A job's run, from submission to its reports; and how often the driver looks.
const JOBS: Patience = Patience {
    limit: Duration::from_secs(600),
    every: Duration::from_millis(50),
};
/// The harness's RAM-tier room for replicas (tests/harness/cluster.sh): each node may hold `s1`
/// and `s2` of both other nodes.
const HARNESS_REPLICA_ROOM: u64 = 64 * MIB;

/// Each node's part of `s1` and of `s2`.
fn part_bytes(mode: Mode) -> u64 {
    match mode {
        Mode::Smoke => 8 * MIB,
        Mode::Scaled => 256 * MIB,
        Mode::Full => 1024 * MIB,
    }
}

fn now_s() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

/// One job of the case.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Variant {
    Archive,
    Replicas,
    Off,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::Archive => "archive",
            Variant::Replicas => "replicas",
            Variant::Off => "off",
        }
    }
}

/// What one job measured.
#[derive(Default)]
struct Measured {
    /// Each rank's copy floor and `s2`'s stall, seconds.
    memcpy: Vec<f64>,
    stall: Vec<f64>,
    /// Commit of `s2` → protected, → archived on every node.
    protected_s: Option<f64>,
    archived_s: Option<f64>,
    /// The slowest node's restore after the requeue, and every node's.
    restore_s: Option<f64>,
    restores: BTreeMap<String, f64>,
    /// Requests the fault proxy passed to the archive's store during run 2.
    archive_requests: Option<u64>,
    /// Bytes of one node's part of `s2`.
    size: u64,
}

/// The harness's fault proxy (`tests/harness/faultproxy.py`) on the port of the agents'
/// `s3://ckpt-faulty` profile, in front of Garage: `pass` or `refuse` (which closes the listener
/// and every connection through it).
struct FaultProxy {
    child: Child,
    control: PathBuf,
    stats: PathBuf,
}

impl FaultProxy {
    fn start(b: &Bench, dir: &Path) -> Result<FaultProxy> {
        let (port, upstream) = b.s3_hop("SLUICE_TEST_FAULT_PROXY_PORT")?;
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            bail!(
                "something listens on 127.0.0.1:{port}, the fault proxy's port (a test's proxy?)"
            );
        }
        let (control, stats) = (dir.join("faultproxy.ctl"), dir.join("faultproxy.json"));
        std::fs::write(&control, "pass\n")?;
        let log = std::fs::File::create(dir.join("faultproxy.log"))?;
        let child = Command::new("/usr/bin/python3")
            .arg(b.a.repo.join("tests/harness/faultproxy.py"))
            .args(["--port", &port.to_string(), "--upstream", &upstream])
            .arg("--control")
            .arg(&control)
            .arg("--stats")
            .arg(&stats)
            .args(["--max-lifetime", "1800"])
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting tests/harness/faultproxy.py")?;
        let proxy = FaultProxy {
            child,
            control,
            stats,
        };
        let t = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if t.elapsed() > Duration::from_secs(10) {
                bail!("the fault proxy does not listen on {port} after 10 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(proxy)
    }

    fn set(&self, mode: &str) -> Result<()> {
        let tmp = self.control.with_extension("tmp");
        std::fs::write(&tmp, format!("{mode}\n"))?;
        std::fs::rename(&tmp, &self.control)?;
        std::thread::sleep(Duration::from_millis(300));
        Ok(())
    }

    /// Requests passed to the store so far.
    fn forwarded(&self) -> u64 {
        std::fs::read_to_string(&self.stats)
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
            .and_then(|v| v["forwarded"].as_u64())
            .unwrap_or(0)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `GET /metrics` of the agent at `addr`: the value of the series `name` (0 when absent).
fn metric(addr: &str, name: &str) -> Result<f64> {
    let mut s = std::net::TcpStream::connect(addr)
        .with_context(|| format!("connecting to the metrics port {addr}"))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut body = String::new();
    s.read_to_string(&mut body)?;
    Ok(body
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0))
}

impl Bench {
    fn metrics_addr(&self, node: &str) -> Result<String> {
        sluice_e2e::split_pairs(
            self.env("SLUICE_TEST_METRICS_ADDRS").split_whitespace(),
            '=',
        )
        .remove(node)
        .ok_or_else(|| anyhow!("no metrics address of {node} in SLUICE_TEST_METRICS_ADDRS"))
    }

    /// Each node's agent's restore time so far (`sluice_restore_duration_seconds_sum`).
    fn restore_sums(&self) -> Result<BTreeMap<String, f64>> {
        NODES
            .iter()
            .map(|n| {
                let v = metric(
                    &self.metrics_addr(n)?,
                    "sluice_restore_duration_seconds_sum",
                )?;
                Ok((n.to_string(), v))
            })
            .collect()
    }

    /// `tag` as each node's agent lists it for job `id` (`None` for a node that lists none).
    fn ckpt_on_nodes(&self, id: u32, tag: &str) -> Vec<Option<CkptStatus>> {
        NODES
            .iter()
            .map(|n| {
                match sluice_proto::client::call(
                    &self.socket_of(n),
                    Request::CkptList { job_id: id },
                    Duration::from_secs(10),
                ) {
                    Ok(Response::Ckpts { ckpts }) => ckpts.into_iter().find(|c| c.tag == tag),
                    _ => None,
                }
            })
            .collect()
    }

    /// `node` is lost and replaced: its agent SIGKILLed; its RAM tier (job tmpfs and replica
    /// area), its agent's state and the hot-tier directory of job `id` removed; its agent started
    /// again, empty.
    fn replace_node(&self, node: &str, id: u32, agent: &AgentProc) -> Result<()> {
        self.kill_agent(node)?;
        let ram = PathBuf::from(self.env("SLUICE_TEST_RAM_TIER_ROOT")).join(node);
        for m in &sluice_e2e::mounts_below(&ram) {
            nix::mount::umount2(m, nix::mount::MntFlags::MNT_DETACH)
                .with_context(|| format!("umount {}", m.display()))?;
        }
        let hot = PathBuf::from(self.env("SLUICE_TEST_HOT_ROOT").replace("%n", node));
        let state = hot
            .parent()
            .ok_or_else(|| anyhow!("hot root {} has no parent", hot.display()))?
            .join("state");
        for dir in [&ram, &state] {
            for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
                remove(&e.path())?;
            }
        }
        remove(&hot.join("jobs").join(id.to_string()))?;
        self.start_agent(node, agent)
    }

    /// `scontrol requeue`, then the job released as soon as Slurm holds it pending (a requeued
    /// job waits for its begin time otherwise), until its next run has started.
    fn requeue(&self, id: u32, w: &Path) -> Result<()> {
        crate::measure::run_quiet(Command::new("scontrol").args(["requeue", &id.to_string()]))?;
        let (t, mut pending) = (Instant::now(), false);
        let (jobid, id_s) = (format!("jobid={id}"), id.to_string());
        loop {
            let state = self.job_state(id);
            if state == "PENDING" {
                pending = true;
                for args in [
                    vec!["update", &jobid, "begintime=now"],
                    vec!["release", &id_s],
                ] {
                    if Command::new("scontrol")
                        .args(&args)
                        .output()
                        .is_ok_and(|o| o.status.success())
                    {
                        break;
                    }
                }
            } else if pending {
                return Ok(());
            }
            if t.elapsed() > Duration::from_secs(200) {
                bail!(
                    "job {id} did not run again within 200 s of its requeue: {}",
                    self.job_evidence(id, w)
                );
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// Each node's report of `phase` (`W/PHASE/NODE/report.json`), once all three are there; any
    /// error in one is the case's error.
    fn rank_reports(&self, id: u32, w: &Path, phase: &str) -> Result<BTreeMap<String, Value>> {
        let path = |n: &str| w.join(phase).join(n).join("report.json");
        self.wait_job(
            id,
            w,
            JOBS,
            &|| NODES.iter().all(|n| path(n).exists()),
            &format!("every node's {phase} report"),
        )?;
        let mut out = BTreeMap::new();
        for n in NODES {
            let r: Value = serde_json::from_slice(&std::fs::read(path(n))?)?;
            if let Some(e) = r["errors"].as_array().filter(|e| !e.is_empty()) {
                bail!("job {id}, {phase} on {n}: {e:?}");
            }
            out.insert(n.to_string(), r);
        }
        Ok(out)
    }

    fn replicas_job(
        &self,
        v: Variant,
        w: &Path,
        proxy: &FaultProxy,
        bytes: u64,
    ) -> Result<Measured> {
        let wv = w.join(v.name());
        std::fs::create_dir_all(&wv)?;
        chown(&wv, Some(self.uid), Some(self.gid))?;
        proxy.set("pass")?;
        let script = format!(
            "#!/bin/bash\nexport OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
             PYTHONPATH={wd}/py SLUICE_WRITER_LIB={wd}/lib/libsluice_writer.so SLUICE_CLI={wd}/lib/sluice\n\
             srun -N3 -n3 --ntasks-per-node=1 {py} {wd}/replicas_job.py {wv} {bytes}\n",
            wd = w.display(),
            wv = wv.display(),
            py = crate::ramtier::torch_python().display(),
        );
        let archive = format!(
            "s3://ckpt-faulty/{}/bench-replicas-{}-{}",
            self.a.user,
            std::process::id(),
            v.name()
        );
        let replicas = if v == Variant::Off { 0 } else { 1 };
        let args = [
            "-N3".to_string(),
            "--ckpt-tier=ram".to_string(),
            format!("--ckpt-replicas={replicas}"),
            format!("--ckpt-archive={archive}"),
            "--ckpt-restore=latest".to_string(),
            "--requeue".to_string(),
            "--open-mode=append".to_string(),
        ];
        let id = self.sbatch(
            &format!("sluice-bench-replicas-{}", v.name()),
            w,
            &wv.join("job.out"),
            &args,
            &script,
        )?;
        let measured = self.replicas_runs(v, id, &wv, proxy);
        let _ = std::fs::write(wv.join("end"), "");
        let _ = proxy.set("pass");
        if measured.is_err() {
            let _ = Command::new("scancel").arg(id.to_string()).status();
            return measured;
        }
        // The next job starts with empty replica areas. This one's may hold replicas that are
        // never freed: the lost node's part of `s1`, which only a replica keeps, so `s1` is never
        // archived (the replaced node restored `s2` alone).
        self.empty_replica_areas()?;
        measured
    }

    /// Each node's agent restarted with an empty replica area (its tmpfs unmounted and removed).
    fn empty_replica_areas(&self) -> Result<()> {
        let ram = PathBuf::from(self.env("SLUICE_TEST_RAM_TIER_ROOT"));
        for node in NODES {
            let agent = self.agent_proc(node)?;
            self.kill_agent(node)?;
            let area = ram.join(node).join("replicas");
            for m in sluice_e2e::mounts_below(&ram.join(node))
                .into_iter()
                .filter(|m| m.starts_with(&area))
            {
                nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH)
                    .with_context(|| format!("umount {}", m.display()))?;
            }
            remove(&area)?;
            self.start_agent(node, &agent)?;
        }
        Ok(())
    }

    fn replicas_runs(&self, v: Variant, id: u32, w: &Path, proxy: &FaultProxy) -> Result<Measured> {
        self.wait_job(
            id,
            w,
            JOBS,
            &|| NODES.iter().all(|n| w.join(format!("ready-{n}")).exists()),
            "every node's task",
        )?;
        if v == Variant::Replicas {
            proxy.set("refuse")?;
        }
        std::fs::write(w.join("go"), "")?;
        let saved = self.rank_reports(id, w, "save")?;
        let t_commit = saved
            .values()
            .find_map(|r| r["t_commit"].as_f64())
            .ok_or_else(|| anyhow!("no rank reported s2's commit: {saved:?}"))?;
        let mut m = Measured {
            memcpy: saved
                .values()
                .filter_map(|r| r["memcpy_s"].as_f64())
                .collect(),
            stall: saved
                .values()
                .filter_map(|r| r["stall_s2"].as_f64())
                .collect(),
            size: saved
                .values()
                .filter_map(|r| r["size"].as_u64())
                .max()
                .unwrap_or(0),
            ..Measured::default()
        };
        if v == Variant::Off {
            std::fs::write(w.join("end"), "")?;
            self.wait_completed(id, w, JOBS)?;
            return Ok(m);
        }
        // Commit → protected, and (with the archive up) → archived, on every node.
        let t = Instant::now();
        while m.protected_s.is_none() || (v == Variant::Archive && m.archived_s.is_none()) {
            let on = self.ckpt_on_nodes(id, "s2");
            let all =
                |f: &dyn Fn(&CkptStatus) -> bool| on.iter().all(|c| c.as_ref().is_some_and(f));
            if m.protected_s.is_none()
                && all(&|c| c.replicas.as_ref().is_some_and(|r| r.protected || r.freed))
            {
                m.protected_s = Some(now_s() - t_commit);
            }
            if m.archived_s.is_none() && all(&|c| c.state == CkptState::Archived) {
                m.archived_s = Some(now_s() - t_commit);
            }
            if t.elapsed() > JOBS.limit {
                bail!(
                    "s2 of job {id} is not protected (or archived) after {} s: {on:?}",
                    JOBS.limit.as_secs()
                );
            }
            std::thread::sleep(JOBS.every);
        }
        // n2 is lost with everything on it; the job runs again and restores s2.
        let agent = self.agent_proc(LOST)?;
        self.replace_node(LOST, id, &agent)?;
        let before = self.restore_sums()?;
        let asked = proxy.forwarded();
        self.requeue(id, w)?;
        let loaded = self.rank_reports(id, w, "load")?;
        for (n, r) in &loaded {
            if r["equal"] != Value::Bool(true) {
                bail!("job {id}'s run 2 on {n} did not load s2 as it was saved: {r}");
            }
        }
        self.wait_completed(id, w, JOBS)?;
        m.archive_requests = Some(proxy.forwarded() - asked);
        let after = self.restore_sums()?;
        for n in NODES {
            m.restores.insert(n.to_string(), after[n] - before[n]);
        }
        m.restore_s = m.restores.values().copied().reduce(f64::max);
        let output = std::fs::read_to_string(w.join("job.out")).unwrap_or_default();
        let from_replicas = output.contains("checkpoint s2 restored from replicas");
        match v {
            Variant::Replicas if !from_replicas || m.archive_requests != Some(0) => bail!(
                "job {id}'s requeue did not restore s2 from replicas alone ({} requests reached \
                 the archive while it was down): {}",
                m.archive_requests.unwrap_or(0),
                self.job_evidence(id, w)
            ),
            Variant::Archive if from_replicas => bail!(
                "job {id}'s requeue restored the archived s2 from replicas: {}",
                self.job_evidence(id, w)
            ),
            _ => {}
        }
        Ok(m)
    }

    /// The agents with room for `part`-byte parts (or as the harness started them, `None`).
    fn replica_agents(&self, originals: &[(String, AgentProc)], part: Option<u64>) -> Result<()> {
        for (node, agent) in originals {
            let mut p = agent.clone();
            if let Some(part) = part {
                let at = 1 + p
                    .argv
                    .iter()
                    .position(|a| a == "--config")
                    .ok_or_else(|| anyhow!("the agent runs without --config: {:?}", p.argv))?;
                let text = std::fs::read_to_string(&p.argv[at])?;
                let config = self.a.root.join("replicas-agent.toml");
                std::fs::write(&config, with_room(&text, part)?)?;
                std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o600))?;
                p.argv[at] = config.display().to_string();
            }
            self.kill_agent(node)?;
            self.start_agent(node, &p)?;
        }
        Ok(())
    }

    pub(crate) fn replicas_case(&self, r: &mut Report) {
        // Three jobs, two of them lost a node and requeued: about five minutes of Slurm time even
        // at the smoke size, which the README's test command has no room for.
        if self.a.mode == Mode::Smoke && self.a.cases.is_none() {
            r.note(
                "replicas: not part of --smoke without --cases (about 5 minutes of jobs and requeues); \
                 bench/run --smoke --cases replicas runs it"
                    .into(),
            );
            return;
        }
        if let Err(e) = self.replicas_rows(r) {
            r.error("replicas", e);
        }
    }

    fn replicas_rows(&self, r: &mut Report) -> Result<()> {
        let bytes = part_bytes(self.a.mode);
        let w = self.job_workdir("sluice-bench-replicas", "replicas_job.py")?;
        chown(&w, Some(self.uid), Some(self.gid))?;
        let originals: Vec<(String, AgentProc)> = NODES
            .iter()
            .map(|n| Ok((n.to_string(), self.agent_proc(n)?)))
            .collect::<Result<_>>()?;
        let bigger = 4 * bytes > HARNESS_REPLICA_ROOM;
        if bigger {
            self.replica_agents(&originals, Some(bytes))?;
        }
        let proxy = FaultProxy::start(self, &w)?;
        let mut runs = BTreeMap::new();
        let mut failed = None;
        for v in [Variant::Replicas, Variant::Archive, Variant::Off] {
            log(format!(
                "replicas: the {} job ({} per node)",
                v.name(),
                size_label(bytes)
            ));
            match self.replicas_job(v, &w, &proxy, bytes) {
                Ok(m) => {
                    log(format!(
                        "replicas: {}: stall {:.3} s (copy {:.3} s), protected {:?} s, archived {:?} s, restore {:?} s {:?}, archive requests during it {:?}",
                        v.name(),
                        median(&m.stall),
                        median(&m.memcpy),
                        m.protected_s,
                        m.archived_s,
                        m.restore_s,
                        m.restores,
                        m.archive_requests
                    ));
                    runs.insert(v.name(), m);
                }
                Err(e) => {
                    failed = Some(e.context(format!("the {} job", v.name())));
                    break;
                }
            }
        }
        drop(proxy);
        if bigger {
            self.replica_agents(&originals, None)?;
        }
        let _ = remove(&w);
        if let Some(e) = failed {
            return Err(e);
        }
        r.rows.extend(replicas_table(&runs));
        Ok(())
    }
}

/// The harness's agent configuration `text` with `[fast_tier]` room for `part`-byte parts: a job's
/// share for `s1` and the whole of `s2` (a restore puts every node's files on every node), replica
/// room for both of both other nodes, a capacity for two jobs.
fn with_room(text: &str, part: u64) -> Result<String> {
    let mib = |b: u64| format!("\"{}MiB\"", b.div_ceil(MIB));
    let (share, room) = (4 * part + 64 * MIB, 4 * part + 64 * MIB);
    let (mut out, mut section, mut set) = (String::new(), "", 0);
    for line in text.lines() {
        let t = line.trim();
        if t.starts_with('[') {
            section = t;
        }
        let key = t.split('=').next().unwrap_or("").trim();
        let value = match (section, key) {
            ("[fast_tier]", "job_share") => Some(mib(share)),
            ("[fast_tier]", "replica_room") => Some(mib(room)),
            ("[fast_tier]", "capacity") => Some(mib(2 * share + room)),
            _ => None,
        };
        match value {
            Some(v) => {
                set += 1;
                out.push_str(&format!("{key} = {v}\n"));
            }
            None => out.push_str(&format!("{line}\n")),
        }
    }
    if set != 3 {
        bail!(
            "the agents' configuration has no [fast_tier] job_share, replica_room and capacity to raise"
        );
    }
    Ok(out)
}

/// The case's rows from its three jobs.
fn replicas_table(runs: &BTreeMap<&str, Measured>) -> Vec<Row> {
    let (rep, arc, off) = (&runs["replicas"], &runs["archive"], &runs["off"]);
    // Each node's file of s2 as the job saved it (torch.save of the tensors).
    let part = rep.size.max(arc.size);
    let size = format!("{} per node, 3 nodes", size_label(part));
    let total = 3 * part;
    let row = |case: &str, unit: &str, sluice: Vec<f64>, peer_name: &str, peer: Vec<f64>| Row {
        case: case.into(),
        size: size.clone(),
        bytes: total,
        unit: unit.into(),
        sluice: median(&sluice),
        peer_name: peer_name.into(),
        peer: Some(median(&peer)),
        ratio: Some(median(&peer) / median(&sluice)),
        sluice_samples: sluice,
        peer_samples: peer,
        ..Row::default()
    };
    let on: Vec<f64> = rep.stall.iter().chain(&arc.stall).copied().collect();
    let copy: Vec<f64> = rep.memcpy.iter().chain(&arc.memcpy).copied().collect();
    let mut stall = row(
        "replicas: save stall of s2 while s1 replicates (--ckpt-replicas=1)",
        "s",
        on.clone(),
        "memcpy (dst.copy_(src), same process)",
        copy,
    );
    stall.target = format!(">= {:.2}x (<= {STALL_TARGET:.1}x)", 1.0 / STALL_TARGET);
    stall.met = Some(stall.sluice <= STALL_TARGET * stall.peer.unwrap_or(0.0));
    stall.note = "sluice_ckpt.save(async_=True) until it returns, every rank of the replicas and archive jobs; the copy: the same tensors into preallocated ones, median of 3".into();
    let mut on_off = row(
        "replicas: save stall of s2 while s1 replicates (--ckpt-replicas=1)",
        "s",
        on,
        "the same with --ckpt-replicas=0",
        off.stall.clone(),
    );
    on_off.target = format!(">= {:.2}x", 1.0 / STALL_TARGET);
    on_off.met = on_off.ratio.map(|x| x >= 1.0 / STALL_TARGET);
    on_off.note =
        "replication runs in the agent, beside the job: the save does not wait for it".into();
    let protected = arc.protected_s.unwrap_or(f64::NAN);
    let archived = arc.archived_s.unwrap_or(f64::NAN);
    let mut to_protected = row(
        "replicas: commit of s2 -> protected on every node",
        "s",
        vec![protected],
        "commit of s2 -> archived on every node (S3, Garage)",
        vec![archived],
    );
    to_protected.note = format!(
        "polled every 50 ms through the agents' sockets; s1 ({}) flushed, replicated and archived just before; \
         with the archive down: protected after {:.2} s",
        size_label(total),
        rep.protected_s.unwrap_or(f64::NAN)
    );
    let mut restore = row(
        "replicas: restore of s2 after losing n2, from replicas",
        "s",
        vec![rep.restore_s.unwrap_or(f64::NAN)],
        "from the archive (S3, Garage)",
        vec![arc.restore_s.unwrap_or(f64::NAN)],
    );
    restore.target = format!(">= {RESTORE_TARGET:.1}x, 0 archive requests");
    restore.met =
        Some(restore.ratio.is_some_and(|x| x >= RESTORE_TARGET) && rep.archive_requests == Some(0));
    let per_node = |m: &Measured| {
        m.restores
            .iter()
            .map(|(n, s)| format!("{n} {s:.2}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    restore.note = format!(
        "the slowest node's restore (sluice_restore_duration_seconds), s: from replicas {}; from the archive {}; \
         archive requests while restoring from replicas: {} (the archive was down); {:.2} GiB/s from replicas",
        per_node(rep),
        per_node(arc),
        rep.archive_requests.unwrap_or(0),
        total as f64 / GIB / rep.restore_s.unwrap_or(f64::NAN)
    );
    vec![stall, on_off, to_protected, restore]
}
