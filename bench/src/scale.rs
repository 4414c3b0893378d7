//! The scale case (`scale`, issue 29): one dataset staged with `--stage-mode=replicate` on N = 3,
//! 8, 16 and 32 nodes (`--smoke`: 3 and 8), against the same dataset staged on one node.
//!
//! 32 `slurmd` do not fit this 2-core machine, so the nodes are a fleet of `sluiced` agents on
//! it (`sluice_e2e::fleet`), driven through the SPANK plugin's job protocol without Slurm: each
//! node's `JobStart` as the prolog sends it (the job's node list and its raw options, user
//! `sluiceuser`), `WaitStaged` as `task_init` sends it, `JobEnd` as the epilog does. Their hot
//! tiers share one tmpfs, so the disk is not what is measured. Their origin is the test
//! cluster's Garage behind the fleet's relay, which counts what Garage sends back and the requests
//! it gets (listings, GETs, HEADs), and paces all its connections together to one rate.
//!
//! Each repetition runs the 1-node job and every N-node job once, the first rotating. A job's
//! numbers:
//! - **origin bytes** ÷ dataset: bytes the relay counted from the job's start until every node
//!   staged (bodies, listings, headers);
//! - **listing passes**: the job's listing requests ÷ those of the 1-node job (one pass is one
//!   listing of the dataset, however many pages);
//! - **paced staging time**: from the fleet sending the nodes' `JobStart`s to the last node's
//!   answer to `WaitStaged`; the row is N-node ÷ 1-node;
//! - the agents' **peak RSS** (`VmHWM`, reset before the job; the highest over the job's nodes)
//!   and **CPU** (utime + stime of the job's agents from its start until staged) per GiB landed
//!   per node (the mean over the nodes: all of it ÷ N × the dataset).
//!
//! The JSON keeps every job (the 1-node ones and the N-node ones, each node's staging time among
//! them) in the `sluice_extra` of its N's staging-time row.
//!
//! Every node's staged tree is compared byte for byte with the source, and every stage must be
//! done: a broken run is an error, never a number. Nodes that routed around another are noted.

use crate::aggregation::RSS_BUDGET_MIB;
use crate::cluster::RELAYED;
use crate::data;
use crate::measure::{interleaved, median};
use crate::run::{Bench, GIB, MIB, Mode, Report, Row, log, size_label};
use anyhow::{Context, Result, anyhow, bail};
use sluice_e2e::fleet::{Fleet, FleetSpec, Garage, compare_trees};
use sluice_e2e::relay::Requests;
use sluice_proto::msg::StageState;
use std::path::Path;

/// The targets: origin bytes per job ÷ dataset, listing passes per job, and paced staging
/// time N-node ÷ 1-node.
const ORIGIN_TARGET: f64 = 1.01;
const PASSES_TARGET: f64 = 1.0;
const PACED_TARGET: f64 = 1.2;
/// The dataset's name in the jobs and below `bench/` in the relayed bucket.
const NAME: &str = "scale";
/// The dataset of many small objects (the memory each object costs an agent).
const MANY: &str = "scale-many";
/// The nodes of its job.
const MANY_NODES: usize = 3;

/// What the case stages, on how many nodes, how fast the origin serves it.
struct Plan {
    nodes: &'static [usize],
    files: u64,
    file_size: u64,
    /// Bytes per second the relay lets through, all connections together.
    pace: u64,
    /// Objects of 1 KiB in the many-objects dataset.
    many: u64,
}

impl Plan {
    fn of(mode: Mode) -> Plan {
        match mode {
            Mode::Smoke => Plan {
                nodes: &[3, 8],
                files: 64,
                file_size: 64 << 10,
                pace: 8 * MIB,
                many: 500,
            },
            // 256 MiB: about 21 s for one node at the paced rate; 8 GiB landed on the 32 nodes'
            // tmpfs together.
            Mode::Scaled | Mode::Full => Plan {
                nodes: &[3, 8, 16, 32],
                files: 64,
                file_size: 4 * MIB,
                pace: 12 * MIB,
                many: 10_000,
            },
        }
    }

    fn bytes(&self) -> u64 {
        self.files * self.file_size
    }
}

/// What one job showed.
#[derive(Debug, Clone)]
struct Outcome {
    nodes: usize,
    served: u64,
    requests: Requests,
    /// Job start to the last node staged, seconds.
    stage_s: f64,
    /// The longest stage time the job's agents report (`elapsed_ms`), seconds.
    agent_stage_s: f64,
    /// The job's agents' CPU seconds together.
    cpu_s: f64,
    /// The highest peak RSS of the job's agents, MiB.
    hwm_mib: f64,
    /// Bytes the nodes took from peers, together.
    peer_bytes: u64,
    /// The notes the nodes' job output would show (a peer routed around).
    notes: Vec<String>,
    /// Each node's job start to staged, seconds.
    node_s: Vec<(String, f64)>,
}

impl Outcome {
    /// The job as the JSON keeps it (`sluice_extra` of its staging-time row).
    fn record(&self) -> serde_json::Value {
        serde_json::json!({
            "nodes": self.nodes,
            "stage_s": self.stage_s,
            "agent_stage_s": self.agent_stage_s,
            "served_bytes": self.served,
            "list_requests": self.requests.lists,
            "get_requests": self.requests.gets,
            "head_requests": self.requests.heads,
            "cpu_s": self.cpu_s,
            "vm_hwm_mib": self.hwm_mib,
            "peer_bytes": self.peer_bytes,
            "node_stage_s": self.node_s.iter().cloned().collect::<std::collections::BTreeMap<_, _>>(),
        })
    }
}

impl Bench {
    pub(crate) fn scale_case(&self, r: &mut Report) {
        if let Err(e) = self.scale_rows(r) {
            r.error("scale", e);
        }
    }

    fn scale_rows(&self, r: &mut Report) -> Result<()> {
        let plan = Plan::of(self.a.mode);
        let source = self.data.join(NAME);
        data::cached(
            &source,
            &format!("{NAME} {} {}", plan.files, plan.file_size),
            |d| data::random_tree(d, plan.files, plan.file_size),
        )?;
        data::chown_tree(&source, 0, 0)?;
        let many = self.data.join(MANY);
        data::cached(&many, &format!("{MANY} {} 1024", plan.many), |d| {
            data::random_tree(d, plan.many, 1024)
        })?;
        data::chown_tree(&many, 0, 0)?;
        self.upload_relayed(&[NAME, MANY])?;
        let most = *plan.nodes.iter().max().unwrap_or(&1);
        let spec = FleetSpec {
            nodes: most,
            root: self.a.root.join("fleet"),
            sluiced: self.a.sluiced.clone(),
            // Every node's copy, and room for what the agents keep beside it.
            hot_tier_size: most as u64 * plan.bytes() * 5 / 4 + 256 * MIB,
            user: self.a.user.clone(),
            garage: Garage::from_env(|v| self.env(v)),
            log_filter: "warn".into(),
        };
        let fleet = Fleet::start(&spec).map_err(|e| anyhow!(e))?;
        log(format!(
            "scale: {most} agents up under {}; origin paced to {} MiB/s",
            spec.root.display(),
            plan.pace / MIB
        ));
        fleet.relay().set_pace(plan.pace);
        let sizes: Vec<usize> = std::iter::once(1)
            .chain(plan.nodes.iter().copied())
            .collect();
        let outcomes = interleaved(sizes.len(), self.a.reps, |i, rep| {
            let o = self
                .scale_job(&fleet, sizes[i], NAME, "", &source)
                .with_context(|| format!("{}-node job (repetition {})", sizes[i], rep + 1))?;
            log(format!(
                "scale: {} node(s) {}/{}: {:.2} s, origin {:.3}x, {} listing request(s), CPU {:.2} s, peak RSS {:.0} MiB",
                o.nodes,
                rep + 1,
                self.a.reps,
                o.stage_s,
                o.served as f64 / plan.bytes() as f64,
                o.requests.lists,
                o.cpu_s,
                o.hwm_mib
            ));
            Ok(o)
        })?;
        // The same few-object job and one of many small objects, unpaced, on MANY_NODES nodes:
        // what the difference in the agents' peak memory costs an object.
        fleet.relay().set_pace(0);
        // An eighth of the objects (one of random_tree's 8 directories), then all of them: the same
        // sizes, so what differs is the state each object costs.
        let few = self.scale_job(&fleet, MANY_NODES, MANY, "shard-0", &many.join("shard-0"))?;
        let lots = self.scale_job(&fleet, MANY_NODES, MANY, "", &many)?;
        drop(fleet);
        if outcomes[0].iter().any(|o| o.requests.lists == 0) {
            bail!("the relay counted no listing request of a 1-node job: it cannot count passes");
        }
        self.scale_report(r, &plan, &outcomes);
        let more = plan.many - plan.many.div_ceil(8);
        let per_k = (lots.hwm_mib - few.hwm_mib) * 1024.0 / (more as f64 / 1000.0);
        r.rows.push(Row {
            case: format!("scale: {MANY_NODES}-node agent memory per 1,000 objects"),
            size: format!("{} x 1 KiB", plan.many),
            bytes: plan.many * 1024,
            unit: "KiB".into(),
            sluice: per_k,
            peer_name: "-".into(),
            sluice_samples: vec![per_k],
            target: "-".into(),
            note: format!(
                "peak RSS (VmHWM, the highest of the job's agents) of a job of {} objects of 1 KiB, {:.1} MiB, less that of a job of an eighth of them, {:.1} MiB, per 1,000 objects more: the job's per-object state (listing, units, versions); {} listing request(s)",
                plan.many,
                lots.hwm_mib,
                few.hwm_mib,
                lots.requests.lists
            ),
            ..Row::default()
        });
        Ok(())
    }

    /// One job on the fleet's first `n` nodes staging the dataset `name` (or its directory
    /// `below`; `source` here): started, waited for, checked, measured, ended.
    fn scale_job(
        &self,
        fleet: &Fleet,
        n: usize,
        name: &str,
        below: &str,
        source: &Path,
    ) -> Result<Outcome> {
        let nodes: Vec<String> = fleet.nodes().into_iter().take(n).collect();
        let url = match below {
            "" => format!("s3://{RELAYED}/bench/{name}"),
            below => format!("s3://{RELAYED}/bench/{name}/{below}"),
        };
        let options = [
            ("stage-in", format!("{name}={url}")),
            ("stage-mode", "replicate".to_string()),
        ]
        .map(|(k, v)| (k.to_string(), v));
        fleet.reset_peaks().map_err(|e| anyhow!(e))?;
        let cpu_before = self.job_cpu(fleet, &nodes)?;
        let (served, requests) = (fleet.relay().served(), fleet.relay().requests());
        let mut job = fleet.start_job(&nodes, &options).map_err(|e| anyhow!(e))?;
        let staged = job.wait_staged();
        let served = fleet.relay().served() - served;
        let requests = fleet.relay().requests().since(requests);
        let cpu_s = self.job_cpu(fleet, &nodes)? - cpu_before;
        let hwm_kib = fleet
            .usage()
            .map_err(|e| anyhow!(e))?
            .into_iter()
            .filter(|u| nodes.contains(&u.node))
            .map(|u| u.vm_hwm_kib)
            .max()
            .unwrap_or(0);
        let mut notes = Vec::new();
        let (mut agent_stage_s, mut peer_bytes) = (0.0f64, 0);
        for s in &staged {
            let dirs = s.dirs.as_ref().map_err(|e| {
                anyhow!("{} did not stage: {e}\n{}", s.node, fleet.log_tail(&s.node))
            })?;
            compare_trees(source, &Path::new(&dirs.stage_dir).join(name))
                .map_err(|e| anyhow!("{}: {e}", s.node))?;
            notes.extend(dirs.notes.iter().map(|n| format!("{}: {n}", s.node)));
            let status = fleet.job_status(&s.node, &job).map_err(|e| anyhow!(e))?;
            for p in &status.stages {
                if p.state != StageState::Done {
                    bail!("{}: stage {} is {}", s.node, p.name, p.state.as_str());
                }
                agent_stage_s = agent_stage_s.max(p.elapsed_ms as f64 / 1000.0);
                peer_bytes += p.peer_bytes;
            }
        }
        let stage_s = staged
            .iter()
            .map(|s| s.after.as_secs_f64())
            .fold(0.0, f64::max);
        fleet.end_job(&job).map_err(|e| anyhow!(e))?;
        if requests.unframed > 0 {
            bail!(
                "the relay lost track of {} connection(s): its request counts are not whole",
                requests.unframed
            );
        }
        Ok(Outcome {
            nodes: n,
            served,
            requests,
            stage_s,
            agent_stage_s,
            cpu_s,
            hwm_mib: hwm_kib as f64 / 1024.0,
            peer_bytes,
            notes,
            node_s: staged
                .iter()
                .map(|s| (s.node.clone(), s.after.as_secs_f64()))
                .collect(),
        })
    }

    /// The CPU seconds the agents of `nodes` used so far, together.
    fn job_cpu(&self, fleet: &Fleet, nodes: &[String]) -> Result<f64> {
        Ok(fleet
            .usage()
            .map_err(|e| anyhow!(e))?
            .iter()
            .filter(|u| nodes.contains(&u.node))
            .map(|u| u.cpu_s)
            .sum())
    }

    /// The rows of every N: `outcomes[0]` are the 1-node jobs', `outcomes[k]` the k-th size's.
    fn scale_report(&self, r: &mut Report, plan: &Plan, outcomes: &[Vec<Outcome>]) {
        let bytes = plan.bytes();
        let size = format!("{} x {}", plan.files, size_label(plan.file_size));
        let med = |v: &[Outcome], f: &dyn Fn(&Outcome) -> f64| {
            median(&v.iter().map(f).collect::<Vec<_>>())
        };
        let one = &outcomes[0];
        let one_s = med(one, &|o| o.stage_s);
        let one_lists = med(one, &|o| o.requests.lists as f64);
        for v in &outcomes[1..] {
            let n = v[0].nodes;
            let landed = n as f64 * bytes as f64 / GIB;
            let origin: Vec<f64> = v.iter().map(|o| o.served as f64 / bytes as f64).collect();
            let passes: Vec<f64> = v
                .iter()
                .map(|o| o.requests.lists as f64 / one_lists)
                .collect();
            let paced: Vec<f64> = v.iter().map(|o| o.stage_s / one_s).collect();
            let hwm: Vec<f64> = v.iter().map(|o| o.hwm_mib).collect();
            let cpu: Vec<f64> = v.iter().map(|o| o.cpu_s / landed).collect();
            let worst_hwm = hwm.iter().copied().fold(0.0, f64::max);
            let cpu_s: Vec<f64> = v.iter().map(|o| o.cpu_s).collect();
            let row = |case: &str, unit: &str, samples: Vec<f64>| Row {
                case: format!("scale: {n}-node {case}"),
                size: size.clone(),
                bytes,
                unit: unit.into(),
                sluice: median(&samples),
                peer_name: "-".into(),
                sluice_samples: samples,
                sluice_cpu_s: cpu_s.clone(),
                ..Row::default()
            };
            let (o, p, t) = (median(&origin), median(&passes), median(&paced));
            r.rows.push(Row {
                target: format!("<= {ORIGIN_TARGET:.2}x"),
                met: Some(o <= ORIGIN_TARGET),
                note: format!(
                    "bytes Garage sent the fleet's relay from the job's start until every node staged; peers gave {:.0}% of what landed",
                    100.0 * med(v, &|o| o.peer_bytes as f64) / (landed * GIB)
                ),
                ..row("origin bytes / dataset (replicate)", "x", origin)
            });
            r.rows.push(Row {
                target: format!("<= {PASSES_TARGET:.0} pass"),
                met: Some(p <= PASSES_TARGET),
                note: format!(
                    "listing requests per job {} (1-node job: {one_lists}); object GETs {}, HEADs {}",
                    med(v, &|o| o.requests.lists as f64),
                    med(v, &|o| o.requests.gets as f64),
                    med(v, &|o| o.requests.heads as f64),
                ),
                ..row("origin listing passes per job", "x", passes)
            });
            r.rows.push(Row {
                target: format!("<= {PACED_TARGET:.2}x"),
                met: Some(t <= PACED_TARGET),
                note: format!(
                    "origin paced to {} MiB/s for all nodes together; job start to the last node staged: {n}-node {:.2} s, 1-node {one_s:.2} s (agents' own longest stage time {:.2} s, {:.2} s)",
                    plan.pace / MIB,
                    med(v, &|o| o.stage_s),
                    med(v, &|o| o.agent_stage_s),
                    med(one, &|o| o.agent_stage_s),
                ),
                sluice_extra: one.iter().chain(v).map(Outcome::record).collect(),
                ..row("/ 1-node staging time, paced origin", "x", paced)
            });
            r.rows.push(Row {
                target: format!("<= {RSS_BUDGET_MIB:.0} MiB"),
                met: Some(worst_hwm <= RSS_BUDGET_MIB),
                note: format!(
                    "the highest VmHWM of the job's {n} agents (reset before the job), worst of {} run(s); 1-node: {:.0} MiB",
                    v.len(),
                    one.iter().map(|o| o.hwm_mib).fold(0.0, f64::max)
                ),
                sluice: worst_hwm,
                ..row("agent peak RSS (max over nodes)", "MiB", hwm)
            });
            r.rows.push(Row {
                target: "-".into(),
                note: format!(
                    "utime+stime of the job's {n} agents from its start until staged, over {n} x the dataset; 1-node: {:.2} s/GiB",
                    med(one, &|o| o.cpu_s) / (bytes as f64 / GIB)
                ),
                sluice_cpu_s_per_gib: Some(median(&cpu)),
                ..row("agent CPU per GiB landed per node", "s/GiB", cpu.clone())
            });
            let notes: Vec<&String> = v.iter().flat_map(|o| &o.notes).collect();
            if !notes.is_empty() {
                r.note(format!(
                    "scale: {n}-node jobs routed around a node ({} note(s)), e.g. {}",
                    notes.len(),
                    notes[0]
                ));
            }
        }
    }
}
