//! Checkpoints of a job on this node: commit, archive scheduling, retention.
//!
//! A checkpoint is the directory `$SLUICE_CKPT_DIR/TAG`. It becomes *committed* by `sluice ckpt commit`
//! or by a framework's completion signal, found by rescanning (never by file-system events alone):
//! DeepSpeed's `latest` file, Megatron's `latest_checkpointed_iteration.txt`, and the `.metadata` file
//! that `torch.distributed.checkpoint` writes last. Only committed checkpoints are archived, restored
//! or counted by retention.
//!
//! Multi-node jobs: every node archives its own files of a checkpoint as one *part*; the archive's
//! MANIFEST is published when every node's part is there. A node learns about a commit made on another
//! node from the archive itself (the committing node's note under `TAG/commits/`), so one commit, or
//! one framework signal on one node, is enough; a node that holds none of the tag answers with an
//! empty part, so a checkpoint written on some nodes only (rank 0's `torch.save`) is archived too.
//!
//! Retention keeps the newest `--ckpt-keep` archived checkpoints on the hot tier and deletes older
//! archived ones. It never deletes a checkpoint that is not archived, never the newest archived one
//! that is not poisoned (keep >= 1; a poisoned one is not "the last good one", and goes once
//! archived), and never an uncommitted directory while the job runs.
//!
//! Parts: this module ([`CkptCtx`], what the rest needs of the agent; [`CkptDirs`], where a job's
//! checkpoints are), [`signals`] (commit checks and frameworks' completion signals), `worker` (the
//! per-job loop from commit to MANIFEST, retention and clean-up), `restore` (`--ckpt-restore`). A
//! checkpoint's entry and a job's set of them, with the commit and retention rules, are the job's
//! state ([`crate::job::ckpts`], re-exported here), so that the job needs nothing of this module.

mod node_replicas;
mod notices;
mod replica_restore;
mod replicate;
mod restore;
mod shared_restore;
mod signals;
mod worker;
pub(crate) use worker::PREVIOUS_RUN_WAIT;

pub use crate::job::ckpts::{CkptEntry, CommitError, CommitOutcome, JobCkpts};
pub(crate) use node_replicas::NodeReplicas;
pub(crate) use notices::{CommitNotices, announce};
pub(crate) use restore::{RestoreError, restore};
pub use signals::{check_commit_dir, scan_signals, write_restored_signal};
pub(crate) use worker::{
    CkptWorker, RESUME_LOG_AGE, commit, commit_as_of, release, resume_dir, trim,
};

use crate::hot_tier::HotTier;
use crate::job::Job;
use crate::job_table::JobTable;
use crate::metrics::Metrics;
use crate::ram_tier::RamTier;
use sluice_core::config::Config;
use sluice_core::safefs::SafeFsError;
use sluice_proto::msg::JobId;
use std::sync::Arc;

/// What the checkpoint side needs of the agent (a job's worker, its restore, a commit, retention
/// and the high-water trim) instead of the whole agent: the node's configuration, hot tier, job
/// table and metrics, and its shared limits on archive uploads.
pub(crate) struct CkptCtx {
    pub(crate) cfg: Arc<Config>,
    pub(crate) hot: HotTier,
    /// The jobs on this node and their journal: a job's record is written after each change of
    /// its checkpoints, and a restore looks for the copy an ended job left on the hot tier.
    pub(crate) jobs: Arc<JobTable>,
    /// The node-wide cap on archive upload bandwidth (`ckpt.bandwidth_limit`), shared by all jobs.
    pub(crate) bandwidth: Option<sluice_archive::Bandwidth>,
    /// Checkpoint uploads the node's `[agent] memory` budget holds at once, over all jobs (each
    /// holds up to `sluice_archive::upload_memory` of buffers); `None` without a budget.
    upload_slots: Option<Arc<tokio::sync::Semaphore>>,
    /// The agent's event counters (shared with it).
    pub(crate) metrics: Metrics,
    /// The peer layer, for replicas of checkpoints (`[fast_tier] replicas`); set when peers start.
    pub(crate) peers: std::sync::OnceLock<sluice_stage::ReplicaPeers>,
    /// The nodes' leaf switches (`[fast_tier] topology`), which replicas are placed apart by.
    pub(crate) switches: crate::topology::Switches,
}

impl CkptCtx {
    pub(crate) fn new(
        cfg: Arc<Config>,
        hot: HotTier,
        jobs: Arc<JobTable>,
        metrics: Metrics,
    ) -> CkptCtx {
        CkptCtx {
            bandwidth: cfg.ckpt.bandwidth_limit.map(sluice_archive::Bandwidth::new),
            upload_slots: cfg
                .upload_slots(sluice_archive::upload_memory(&cfg.ckpt))
                .map(|n| Arc::new(tokio::sync::Semaphore::new(n))),
            switches: crate::topology::Switches::load(
                cfg.fast_tier
                    .as_ref()
                    .filter(|f| f.max_replicas > 0)
                    .and_then(|f| f.topology.as_deref()),
            ),
            cfg,
            hot,
            jobs,
            metrics,
            peers: std::sync::OnceLock::new(),
        }
    }

    /// Where `job`'s checkpoints are.
    pub(crate) fn dirs(&self, job: &Job) -> CkptDirs {
        CkptDirs {
            hot: self.hot.clone(),
            ram: job.ram_tier.get().cloned().filter(|_| job.is_ram()),
            job_id: job.start.job_id,
        }
    }

    /// Waits until the node's memory budget holds one more checkpoint upload; the upload holds
    /// the permit while it runs (`None`: no budget, no wait).
    pub(crate) async fn upload_slot(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        let slots = self.upload_slots.clone()?;
        slots.acquire_owned().await.ok()
    }
}

/// Where a job's checkpoints are: `$SLUICE_CKPT_DIR` (the RAM tier's, or the hot tier's), and the
/// hot tier's, which checkpoints are archived from. Cheap to clone into a blocking closure.
#[derive(Clone)]
pub(crate) struct CkptDirs {
    hot: HotTier,
    ram: Option<Arc<RamTier>>,
    job_id: JobId,
}

impl CkptDirs {
    /// `$SLUICE_CKPT_DIR`, where the job writes and commits (blocking).
    pub(crate) fn user(&self) -> Result<std::os::fd::OwnedFd, SafeFsError> {
        match &self.ram {
            Some(ram) => ram.open_ckpt(self.job_id),
            None => self.hot.open_ckpt(self.job_id),
        }
    }

    /// The hot tier's `jobs/<id>/ckpt` (blocking).
    pub(crate) fn hot(&self) -> Result<std::os::fd::OwnedFd, SafeFsError> {
        self.hot.open_ckpt(self.job_id)
    }

    pub(crate) fn ram(&self) -> Option<&Arc<RamTier>> {
        self.ram.as_ref()
    }
}
