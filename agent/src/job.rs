//! One job on this node: its identity, directories, staging progress and state.
//!
//! A job's life on a node: `Staging` → `Ready` or `Failed` (what its tasks wait for) while it runs;
//! then Slurm ends it (the epilog: [`Job::mark_ended`]), its checkpoint worker finishes pending
//! archives and cleans up, and it is *finished* here ([`Job::finish`], state `Ended`). "Ended in
//! Slurm" and "finished on this node" are two steps of one lifecycle, kept by this type alone:
//! finishing implies ended.

pub mod ckpts;

use crate::policy::PolicyError;
use ckpts::JobCkpts;
use sluice_core::rt::lock;
use sluice_proto::msg::{JobDirs, JobStart, JobState, JobStatus};
use sluice_proto::options::{self, JobOptions, OptionError, StageMode};
use sluice_stage::{Progress, ShardPlan};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// The job's sluice options, parsed from what the prolog forwarded (the last value of a repeated
/// option wins, as on the command line).
pub fn parse_options(start: &JobStart) -> Result<JobOptions, OptionError> {
    options::parse_job_options(|name: &str| {
        start
            .options
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    })
}

/// The replicas a job asks for: its `--ckpt-replicas`, else, for a RAM-tier job, the site's
/// `[fast_tier] replicas` (a hot-tier job's checkpoints are replicated only when it asks: they are
/// the size of the node's NVMe share, and the replicas are held in the other nodes' RAM); never
/// more than the site's `max_replicas` (the set-up refuses a job that asks for more).
pub fn replicas_asked(options: &JobOptions, fast_tier: &sluice_core::config::FastTierConfig) -> u8 {
    let site = match options.ckpt_tier {
        sluice_proto::options::CkptTier::Ram => fast_tier.replicas,
        sluice_proto::options::CkptTier::Local => 0,
    };
    options
        .ckpt_replicas
        .unwrap_or(site)
        .min(fast_tier.max_replicas)
}

pub struct Job {
    pub start: JobStart,
    /// Parsed and validated on the root side; `Err` is what the job will fail with.
    pub options: Result<JobOptions, OptionError>,
    pub dirs: JobDirs,
    pub started_at: u64,
    pub stages: Vec<Arc<Progress>>,
    state: watch::Sender<JobState>,
    error: Mutex<Option<String>>,
    /// Cancelled when the job ends (or the agent stops): stops its staging.
    pub cancel: CancellationToken,
    /// Where committed checkpoints are archived (`Ok(None)`: nowhere configured; `Err`: refused).
    archive: Result<Option<String>, PolicyError>,
    /// Committed checkpoints kept on the hot tier once archived.
    pub keep: u32,
    pub ckpts: JobCkpts,
    /// Slurm ended the job (the epilog came, or the job was replaced by a newer run).
    ended: AtomicBool,
    /// Its journal record was removed: nothing of this run writes one again (the job table's
    /// journal lock orders this against a write already under way).
    pub(crate) forgotten: AtomicBool,
    restored: Mutex<(Option<String>, Vec<String>)>,
    /// Notes from staging for the job output (e.g. a peer routed around).
    stage_notes: Mutex<Vec<String>>,
    /// Datasets the job's steps added on this node (`srun --stage-in` in the allocation), by NAME.
    pub extras: Mutex<std::collections::BTreeMap<String, Arc<Extra>>>,
    /// The agent learnt of the job from a step (no job-level option, so no prolog or epilog call):
    /// housekeeping ends it once Slurm no longer runs it.
    pub from_step: AtomicBool,
    /// `$SLUICE_CKPT_DIR` is on the RAM tier (`dirs.ckpt_dir` says where).
    pub ram: AtomicBool,
    /// The RAM tier the job's tmpfs is in: the agent's `[fast_tier]`, or, for a job recovered by an
    /// agent whose config no longer has that root, one opened at the root its record names (its
    /// checkpoints are flushed from there all the same).
    pub ram_tier: std::sync::OnceLock<Arc<crate::ram_tier::RamTier>>,
    /// The replicas of a hot-tier job's checkpoints ([`replicas_asked`] against the node's
    /// `[fast_tier]`, set by the agent as it takes the job): a RAM-tier job's come from its tier.
    pub hot_replicas: std::sync::atomic::AtomicU8,
    /// The run of the same job id this one replaced (a requeue), while anything of it still runs.
    previous: std::sync::OnceLock<std::sync::Weak<Job>>,
    /// Cancelled when this run's checkpoint worker has stopped: from then on nothing of this run
    /// touches the job's directories.
    worker_gone: CancellationToken,
}

/// A dataset a step of the job added: its spec, progress, and how its staging went.
pub struct Extra {
    pub spec: options::StageSpec,
    pub progress: Arc<Progress>,
    pub state: watch::Sender<ExtraState>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExtraState {
    Staging,
    Done,
    Failed(String),
}

impl Job {
    pub fn new(
        start: JobStart,
        dirs: JobDirs,
        started_at: u64,
        archive: Result<Option<String>, PolicyError>,
        default_keep: u32,
        cancel: CancellationToken,
    ) -> Job {
        let options = parse_options(&start);
        let keep = options
            .as_ref()
            .ok()
            .and_then(|o| o.ckpt_keep)
            .unwrap_or(default_keep);
        let stages = match &options {
            Ok(o) => o
                .stage_in
                .iter()
                .map(|s| Arc::new(Progress::new(s)))
                .collect(),
            Err(_) => Vec::new(),
        };
        let (state, _) = watch::channel(JobState::Staging);
        Job {
            start,
            options,
            dirs,
            started_at,
            stages,
            state,
            error: Mutex::new(None),
            cancel,
            archive,
            keep,
            ckpts: JobCkpts::default(),
            ended: AtomicBool::new(false),
            forgotten: AtomicBool::new(false),
            restored: Mutex::new((None, Vec::new())),
            stage_notes: Mutex::new(Vec::new()),
            extras: Mutex::new(std::collections::BTreeMap::new()),
            from_step: AtomicBool::new(false),
            ram: AtomicBool::new(false),
            ram_tier: std::sync::OnceLock::new(),
            hot_replicas: std::sync::atomic::AtomicU8::new(0),
            previous: std::sync::OnceLock::new(),
            worker_gone: CancellationToken::new(),
        }
    }

    /// This run replaces `old`, a run before it of the same job id (a requeue onto this node).
    pub fn replaces(&self, old: &Arc<Job>) {
        let _ = self.previous.set(Arc::downgrade(old));
    }

    /// Held by this run's checkpoint worker while it runs: dropped (also by a panic), it tells a
    /// newer run of the job that this one no longer touches the job's directories.
    pub fn worker_running(&self) -> tokio_util::sync::DropGuard {
        self.worker_gone.clone().drop_guard()
    }

    /// Waits, at most `limit`, until the run this one replaced has stopped touching the job's
    /// directories (its checkpoint worker finishes what it was doing, e.g. flushing a checkpoint
    /// from the RAM tier, and stops): a requeue's set-up and worker must not clear or flush into
    /// directories the old run still writes. `false`: it still runs after `limit`.
    pub async fn wait_for_previous_run(&self, limit: std::time::Duration) -> bool {
        let Some(old) = self.previous.get().and_then(std::sync::Weak::upgrade) else {
            return true; // no run before, or nothing of it is left
        };
        let gone = old.worker_gone.clone();
        drop(old);
        tokio::time::timeout(limit, gone.cancelled()).await.is_ok()
    }

    /// The span of everything the agent does for this job: every log line inside carries the
    /// job's id and user (`[agent] log_format = "json"` puts them in each line's `span`).
    pub fn span(&self) -> tracing::Span {
        tracing::info_span!("job", job_id = self.start.job_id, user = %self.start.user)
    }

    pub fn state(&self) -> JobState {
        *self.state.borrow()
    }

    pub fn subscribe(&self) -> watch::Receiver<JobState> {
        self.state.subscribe()
    }

    pub fn error(&self) -> Option<String> {
        lock(&self.error).clone()
    }

    pub fn set_ready(&self) {
        self.state.send_replace(JobState::Ready);
    }

    /// Staging or restore failed: `message` is what the job's tasks show.
    pub fn set_failed(&self, message: impl std::fmt::Display) {
        *lock(&self.error) = Some(message.to_string());
        self.state.send_replace(JobState::Failed);
    }

    /// The archive URL, if the job has one.
    pub fn archive_url(&self) -> Option<&str> {
        self.archive.as_ref().ok().and_then(|u| u.as_deref())
    }

    /// Why the policy refused the job's archive, if it did.
    pub fn archive_refusal(&self) -> Option<&PolicyError> {
        self.archive.as_ref().err()
    }

    /// Slurm ended the job: no new commits, staging stops, the checkpoint worker winds down.
    pub fn mark_ended(&self) {
        self.ended.store(true, Ordering::Relaxed);
        self.cancel.cancel();
    }

    /// Whether Slurm ended the job (it may still be finishing here).
    pub fn has_ended(&self) -> bool {
        self.ended.load(Ordering::Relaxed)
    }

    /// Nothing is left to do for the job on this node (or a newer run replaced it).
    pub fn finish(&self) {
        self.mark_ended();
        self.state.send_replace(JobState::Ended);
    }

    pub fn is_finished(&self) -> bool {
        self.state() == JobState::Ended
    }

    /// Records what `--ckpt-restore` placed in the checkpoint directory, and notes for the job output.
    pub fn set_restored(&self, tag: Option<String>, notes: Vec<String>) {
        *lock(&self.restored) = (tag, notes);
    }

    /// Records what staging has to tell the job's user (the job's data is complete either way).
    pub fn add_stage_notes(&self, notes: Vec<String>) {
        lock(&self.stage_notes).extend(notes);
    }

    /// The directories, restored tag and notes the job's tasks get. The notes include staging's
    /// and every checkpoint that sluice will not archive by itself, so each step's output says so
    /// while the job runs (the batch step's end prints them again in the job summary).
    /// `$SLUICE_CKPT_DIR` is on the RAM tier: committed checkpoints are flushed to the hot tier.
    pub fn is_ram(&self) -> bool {
        self.ram.load(Ordering::Relaxed)
    }

    pub fn task_dirs(&self) -> JobDirs {
        let (tag, mut notes) = lock(&self.restored).clone();
        notes.splice(0..0, lock(&self.stage_notes).iter().cloned());
        notes.extend(self.ckpt_statuses().iter().filter_map(|c| c.problem()));
        let shard = matches!(&self.options, Ok(o) if o.stage_mode == StageMode::Shard);
        let env = shard
            .then(|| ShardPlan::new(&self.start.nodes, &self.start.node))
            .flatten()
            .map(|plan| plan.env())
            .unwrap_or_default();
        JobDirs {
            restored_tag: tag,
            notes,
            env,
            ..self.dirs.clone()
        }
    }

    pub fn status(&self) -> JobStatus {
        JobStatus {
            job_id: self.start.job_id,
            user: self.start.user.clone(),
            uid: self.start.uid,
            node: self.start.node.clone(),
            nodes: self.start.nodes.clone(),
            state: self.state(),
            dirs: self.dirs.clone(),
            stages: self
                .stages
                .iter()
                .chain(lock(&self.extras).values().map(|e| &e.progress))
                .map(|p| p.snapshot())
                .collect(),
            started_at: self.started_at,
            // A checkpoint lost with the RAM tier is the job's problem too (`sluice status`).
            error: self.error().or_else(|| {
                self.ckpts
                    .entries()
                    .iter()
                    .find(|e| e.is_lost())
                    .map(|e| e.status("", 0).problem().unwrap_or_default())
            }),
            ckpts: self.ckpt_statuses(),
        }
    }

    pub fn ckpt_statuses(&self) -> Vec<sluice_proto::msg::CkptStatus> {
        let url = self.archive_url().unwrap_or_default();
        let replicas = self.replicas_wanted();
        self.ckpts
            .entries()
            .iter()
            .map(|e| e.status(url, replicas))
            .collect()
    }

    /// How many other nodes of the job hold a replica of each checkpoint's part of this node
    /// ([`replicas_asked`]; at most the job's other nodes).
    pub fn replicas_wanted(&self) -> u8 {
        let others = self.start.nodes.len().saturating_sub(1);
        let asked = match (self.ram_tier.get(), &self.options) {
            (Some(tier), Ok(options)) if self.is_ram() => replicas_asked(options, tier.config()),
            _ => self.hot_replicas.load(Ordering::Relaxed),
        };
        asked.min(u8::try_from(others).unwrap_or(u8::MAX))
    }

    /// Where each dataset's staging stands, for timeout messages.
    pub fn progress_summary(&self) -> String {
        let parts: Vec<String> = self
            .stages
            .iter()
            .map(|p| {
                let s = p.snapshot();
                let total = s.bytes_total.map_or("?".to_string(), |b| b.to_string());
                format!(
                    "{} ({}): {}, {}/{} bytes",
                    s.name,
                    s.source,
                    s.state.as_str(),
                    s.bytes_done,
                    total
                )
            })
            .collect();
        if parts.is_empty() {
            "no dataset".into()
        } else {
            parts.join("; ")
        }
    }
}
