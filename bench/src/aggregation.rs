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

use crate::cluster::{
    Patience, RELAYED, Tree, agent_job, describe_diff, parse_listing, source_tree, tree_bytes,
    tree_label,
};
use crate::measure::{interleaved, median, process_cpu_s};
use crate::run::{Bench, GIB, MIB, Report, Row, log, remove, size_label};
use anyhow::{Context, Result, bail};
use sluice_e2e::procfs;
use sluice_e2e::relay::CountingRelay;
use sluice_proto::msg::{JobStatus, StageState};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The ceiling on origin bytes per job, and on 3-node ÷ 1-node staging time when paced.
const ORIGIN_TARGET: f64 = 1.02;
const PACED_TARGET: f64 = 1.15;
/// The existing RSS budget of the agent (the `rss` case's).
pub(crate) const RSS_BUDGET_MIB: f64 = 256.0;
/// A job, staging included (the plugin's stage_timeout is 120 s), and its end after the epilogs.
const JOBS: Patience = Patience {
    limit: Duration::from_secs(400),
    every: Duration::from_millis(100),
};
/// The peer's flags: the tuned rclone of the other cases.
const RCLONE_FLAGS: &str = "--transfers 32 --multi-thread-streams 8 --checkers 32";

// ------------------------------------------------------------------------------------ agents

/// One node's agent, as `cluster.sh up` started it (its pid file).
struct Agent {
    node: String,
    pid: u32,
    socket: PathBuf,
}

impl Agent {
    /// utime + stime (+ those of waited-for children: copy helpers), seconds.
    fn cpu_s(&self) -> Result<f64> {
        process_cpu_s(self.pid)
            .with_context(|| format!("the agent of {} (pid {})", self.node, self.pid))
    }

    fn vm_hwm_kib(&self) -> Result<u64> {
        procfs::vm_hwm_kib(self.pid)
            .with_context(|| format!("the peak RSS of the agent of {}", self.node))
    }

    /// Resets VmHWM to the current RSS.
    fn reset_hwm(&self) -> Result<()> {
        procfs::reset_hwm(self.pid)
            .with_context(|| format!("resetting the peak RSS of pid {}", self.pid))
    }

    fn job(&self, id: u32) -> Result<JobStatus> {
        agent_job(&self.socket, &self.node, id)
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

/// What every part of the case runs against: the cluster's agents, the byte-counting relay in
/// front of Garage, and the big and the small source tree.
struct Rig {
    agents: Vec<Agent>,
    relay: CountingRelay,
    big: Tree,
    small: Tree,
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

    /// Submits one job on `nodes` nodes staging `datasets` the way `how` says, checks what every
    /// node holds, and reports what the origin served, the staging time and the agents' CPU and RSS.
    fn agg_job(
        &self,
        rig: &Rig,
        how: How,
        nodes: usize,
        datasets: &[Ds],
        label: &str,
    ) -> Result<Outcome> {
        let Rig { relay, agents, .. } = rig;
        let w = self.user_workdir("sluice-bench-agg", label)?;
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
        let id = self.sbatch("sluice-bench-agg", &w, &w.join("job.out"), &args, &script)?;
        let mut o = Outcome::default();
        if sluice {
            let staged = w.join("staged");
            let result = (|| -> Result<()> {
                self.wait_job(
                    id,
                    &w,
                    JOBS,
                    &|| staged.exists(),
                    "its tasks listed the stage",
                )?;
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
        self.wait_completed(id, &w, JOBS)?;
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

    pub(crate) fn agg_cases(&self, r: &mut Report) {
        let case = "agg";
        let result = (|| -> Result<()> {
            self.upload_relayed(&["big", "small"])?;
            let agents = self.agents()?;
            let relay = self.origin_relay()?;
            r.note(format!(
                "agg rows: real Slurm jobs as {} against the cluster's agents ([peer] on, [shared_tier] a local stand-in), \
                 Garage read through the bench's byte-counting relay on 127.0.0.1:{}; peer = `rclone copy {RCLONE_FLAGS}` \
                 in an `srun --ntasks-per-node=1` step of the job; paced rows at {} MiB/s for all clients together",
                self.a.user,
                relay.port(),
                self.sizes.agg_pace / MIB
            ));
            let rig = Rig {
                agents,
                relay,
                big: source_tree(&self.data.join("big"))?,
                small: source_tree(&self.data.join("small"))?,
            };
            if self.wants_part(case, "origin") {
                self.agg_origin(r, &rig)?;
            }
            if self.wants_part(case, "paced") {
                self.agg_paced(r, &rig)?;
            }
            if self.wants_part(case, "rss") {
                self.agg_rss(r, &rig)?;
            }
            Ok(())
        })();
        if let Err(e) = result {
            r.error(case, e);
        }
    }

    /// Part 1: origin bytes per 3-node job, each sluice mode and rclone on every node, alternating.
    fn agg_origin(&self, r: &mut Report, rig: &Rig) -> Result<()> {
        let Rig { big, small, .. } = rig;
        let hows = [How::Replicate, How::Shard, How::Shared, How::Rclone];
        for (shape, name, tree) in [("one object", "big", big), ("many objects", "small", small)] {
            let ds = [Ds {
                name: "ds",
                prefix: format!("bench/{name}"),
                tree,
            }];
            let bytes = tree_bytes(tree);
            let samples = interleaved(hows.len(), self.a.reps, |i, rep| {
                let how = hows[i];
                let job_name = format!("origin-{name}-{}", how.label());
                let o = self.agg_job(rig, how, 3, &ds, &job_name).with_context(|| {
                    format!("{} of {shape}, repetition {}", how.label(), rep + 1)
                })?;
                log(format!(
                    "agg: 3-node {} of {shape}: origin served {} bytes ({:.4}x), staging {:.2} s",
                    how.label(),
                    o.served,
                    o.served as f64 / bytes as f64,
                    o.stage_s
                ));
                Ok(o)
            })?;
            let size = tree_label(tree);
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
    fn agg_paced(&self, r: &mut Report, rig: &Rig) -> Result<()> {
        let Rig { relay, big, .. } = rig;
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
        relay.set_pace(rate);
        let samples = interleaved(runs.len(), self.a.reps, |i, rep| {
            let (how, n) = runs[i];
            let job_name = format!("paced-{}-{n}", how.label());
            let o = self.agg_job(rig, how, n, &ds, &job_name).with_context(|| {
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
            Ok(o)
        });
        relay.set_pace(0);
        let samples = samples?;
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
    fn agg_rss(&self, r: &mut Report, rig: &Rig) -> Result<()> {
        let big = &rig.big;
        let ds = ["a", "b"].map(|name| Ds {
            name,
            prefix: "bench/big".into(),
            tree: big,
        });
        let per_node = 2 * tree_bytes(big);
        let mut samples = Vec::new();
        for rep in 0..self.a.reps {
            let o = self
                .agg_job(rig, How::Replicate, 3, &ds, "rss")
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
