//! A job's set-up on this node, in three steps: the plan (its options checked against what this
//! node offers, and how the job's nodes share the work: [`SetUpPlan`]), its directories prepared
//! ([`Prepared`]), then its datasets staged and its checkpoint restored side by side, within the
//! admin's stage timeout. A failure is the job's ([`SetupError`], what its tasks show); the node
//! stays up.

use super::{Agent, ClosePeers};
use crate::ckpt::{self, RestoreError};
use crate::job::Job;
use crate::policy::PolicyError;
use sluice_core::config::SharedTierConfig;
use sluice_core::rt::blocking;
use sluice_core::safefs::{Owner, SafeFsError};
use sluice_proto::options::{self, JobOptions, OptionError, StageMode, StageTier};
use sluice_stage::{self as stage, ShardPlan, Sharing, StageCtx, StageError};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

/// Why a job could not be set up on this node (staged, restored). The message is what its tasks
/// show; the job fails, the node stays up.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SetupError {
    #[error("invalid sluice option: {0}")]
    Options(OptionError),
    #[error(transparent)]
    Policy(PolicyError),
    #[error(
        "--stage-tier=shared: no shared tier is configured on this cluster; use --stage-tier=local"
    )]
    SharedTier,
    #[error("--ckpt-tier=ram: no RAM tier is configured on this cluster; use --ckpt-tier=local")]
    RamTier,
    #[error(
        "--ckpt-replicas={asked}: this cluster keeps at most {max} replica(s) of a checkpoint ([fast_tier] max_replicas); ask for {max} or fewer"
    )]
    Replicas { asked: u8, max: u8 },
    #[error(
        "--ckpt-replicas: this cluster has no RAM tier ([fast_tier]), where nodes hold each other's replicas; drop --ckpt-replicas (the job's checkpoints are protected by the archive alone)"
    )]
    ReplicasNeedFastTier,
    #[error("sluice could not prepare the job's RAM tier on node {node}: {source}")]
    RamDir {
        node: String,
        source: crate::ram_tier::RamTierError,
    },
    #[error(
        "--stage-mode=shard: this node ({node}) is not in the job's node list ({nodes}); the job start named a node outside the job"
    )]
    NotInJob { node: String, nodes: String },
    #[error("sluice could not prepare the job directory on node {node}: {source}")]
    JobDir { node: String, source: SafeFsError },
    #[error("stage-in failed on node {node}: {source}")]
    Stage { node: String, source: StageError },
    #[error(
        "sluice hit a bug while setting up the job on node {node} ({bug}); the job was not started — tell your admin, whose agent log has the details"
    )]
    Bug { node: String, bug: String },
    #[error(transparent)]
    Restore(#[from] RestoreError),
    #[error(
        "stage-in on node {node} did not finish within {limit} (the admin's stage timeout); {progress}"
    )]
    Timeout {
        node: String,
        limit: String,
        progress: String,
    },
}

impl SetupError {
    /// What failed, for the `sluice_failures_total{operation}` label: the staging or the restore,
    /// or the step before them (`setup`).
    pub(crate) fn operation(&self) -> &'static str {
        match self {
            SetupError::Stage { .. } | SetupError::Timeout { .. } => "stage",
            SetupError::Restore(_) => "restore",
            SetupError::Options(_)
            | SetupError::Policy(_)
            | SetupError::SharedTier
            | SetupError::RamTier
            | SetupError::Replicas { .. }
            | SetupError::ReplicasNeedFastTier
            | SetupError::RamDir { .. }
            | SetupError::NotInJob { .. }
            | SetupError::JobDir { .. }
            | SetupError::Bug { .. } => "setup",
        }
    }

    /// A stable word for this error, for the `sluice_failures_total{code}` label: a staging's or a
    /// restore's own code ([`StageError::code`], [`RestoreError::code`]). Dashboards and alerts
    /// query these words: keep them.
    pub(crate) fn code(&self) -> &'static str {
        match self {
            SetupError::Options(_) => "options",
            SetupError::Policy(_) => "policy",
            SetupError::SharedTier => "shared_tier",
            SetupError::RamTier => "ram_tier",
            SetupError::Replicas { .. } | SetupError::ReplicasNeedFastTier => "replicas",
            SetupError::RamDir { .. } => "ram_dir",
            SetupError::NotInJob { .. } => "not_in_job",
            SetupError::JobDir { .. } => "job_dir",
            SetupError::Bug { .. } => "bug",
            SetupError::Stage { source, .. } => source.code(),
            SetupError::Restore(e) => e.code(),
            SetupError::Timeout { .. } => "timeout",
        }
    }
}

/// How a job's set-up goes, once its options are checked: where its datasets go and how the job's
/// nodes share the work.
struct SetUpPlan {
    options: JobOptions,
    /// `--stage-tier=shared`: the site's shared tier.
    shared_tier: Option<SharedTierConfig>,
    owner: Owner,
    /// Shard, and the shared tier: the files this node owns.
    shard: Option<ShardPlan>,
    /// The job's other nodes, joined for the set-up (closed when the plan goes).
    peers: ClosePeers,
}

/// The job's directories, prepared for its staging and its restore.
struct Prepared {
    /// `--stage-tier=shared`: the job's directory there.
    shared_job: Option<Arc<stage::shared::SharedJob>>,
    /// What the job's staging writes into (this node's stage directory, or the shared tier's).
    stage: StageCtx,
    /// `$SLUICE_CKPT_DIR`, where a restore goes.
    ckpt_fd: Arc<OwnedFd>,
}

impl Agent {
    /// Stages the job's datasets and restores its checkpoint, within the admin's stage timeout.
    pub(super) async fn set_up(&self, job: &Arc<Job>, fresh_dirs: bool) -> Result<(), SetupError> {
        let job_id = job.start.job_id;
        let node = self.cfg.node.clone();
        let plan = self.plan_set_up(job)?;
        // A requeue: the run before must have stopped writing into the job's directories before
        // they are prepared (its worker may be mid-flush from the RAM tier).
        if !job
            .wait_for_previous_run(crate::ckpt::PREVIOUS_RUN_WAIT)
            .await
        {
            tracing::warn!(
                job_id,
                "the run before this requeue still works on its checkpoints; setting up regardless"
            );
        }
        let prepared = self.prepare_dirs(job, &plan, fresh_dirs).await?;
        let staging = self.stage_datasets(job, &plan, &prepared);
        let restoring = self.restore_ckpt(job, &plan, &prepared.ckpt_fd);
        let limit = self.cfg.stage.timeout;
        match tokio::time::timeout(limit, futures::future::try_join(staging, restoring)).await {
            Ok(Ok(_)) => {
                tracing::info!(job_id, "staged {} dataset(s)", plan.options.stage_in.len());
                if let Some(p) = &plan.peers.0 {
                    job.add_stage_notes(p.notes());
                }
                self.metrics.set_up_done(job);
                job.set_ready();
                self.jobs.persist(job).await;
                // Staged: a restarted agent no longer stages the job (the journal says it is
                // ready), but serves the job's other nodes the files its staging logs name, so
                // they stay until the job ends.
                Ok(())
            }
            Ok(Err(e)) => Err(e),
            Err(_) => Err(SetupError::Timeout {
                node,
                limit: humantime::format_duration(limit).to_string(),
                progress: job.progress_summary(),
            }),
        }
    }

    /// The job's options against what this node offers, and how its nodes share the work; joins
    /// the job's peers.
    fn plan_set_up(&self, job: &Arc<Job>) -> Result<SetUpPlan, SetupError> {
        let job_id = job.start.job_id;
        let options = job.options.clone().map_err(SetupError::Options)?;
        if let Some(refusal) = job.archive_refusal() {
            return Err(SetupError::Policy(refusal.clone()));
        }
        let shared_tier = match (options.stage_tier, &self.cfg.shared_tier) {
            (StageTier::Shared, None) => return Err(SetupError::SharedTier),
            (StageTier::Shared, Some(cfg)) => Some(cfg.clone()),
            (StageTier::Local, _) => None,
        };
        if options.ckpt_tier == options::CkptTier::Ram && self.ram.is_none() {
            return Err(SetupError::RamTier);
        }
        // Replicas of hot-tier checkpoints too (`--ckpt-tier=local`): every node holds the
        // others' in its RAM tier's replica area, so the cluster needs a RAM tier all the same.
        if options.ckpt_replicas.is_some_and(|n| n > 0) && self.ram.is_none() {
            return Err(SetupError::ReplicasNeedFastTier);
        }
        let ram_cfg = self.ram.as_ref().map(|r| r.config());
        if let (Some(asked), Some(ft)) = (options.ckpt_replicas, ram_cfg)
            && asked > ft.max_replicas
        {
            return Err(SetupError::Replicas {
                asked,
                max: ft.max_replicas,
            });
        }
        let owner = Owner {
            uid: job.start.uid,
            gid: job.start.gid,
        };
        // Shard, and the shared tier: each node stages the files it owns. Replicate: the job's
        // nodes share its datasets through their peers.
        let shard = match (options.stage_mode, &shared_tier) {
            (StageMode::Shard, _) | (_, Some(_)) => Some(
                ShardPlan::new(&job.start.nodes, &job.start.node).ok_or_else(|| {
                    SetupError::NotInJob {
                        node: job.start.node.clone(),
                        nodes: job.start.nodes.join(","),
                    }
                })?,
            ),
            (StageMode::Replicate, None) => None,
        };
        // The pieces of work the job's nodes share: each dataset (replicate, object stores and
        // POSIX sources alike), and the restore (`--ckpt-restore`: each file of the checkpoint
        // read by one node).
        let restores = usize::from(options.ckpt_restore.is_some());
        let shared_work = match shard {
            Some(_) => restores,
            None => options.stage_in.len() + restores,
        };
        // The job's object-store datasets, as admitted: what its peers may read from this node's
        // cache.
        let datasets: Vec<String> = options
            .stage_in
            .iter()
            .filter(|s| s.source.bucket_url().is_some())
            .map(|s| s.source.to_string())
            .collect();
        // On the shared tier the job joins its peers even with nothing to share through them:
        // its other nodes tell from this node's agent answering for the job that it is alive,
        // and take over its share when it is not (`stage::shared`).
        // A job with replicas joins as well: its other nodes push their parts of its checkpoints
        // to this node's replica area as an agent of the job.
        let replicas = ram_cfg.is_some_and(|ft| crate::job::replicas_asked(&options, ft) > 0);
        let peers = ClosePeers(self.peers.get().and_then(|p| match &shared_tier {
            Some(_) => p.join(job_id, &job.start.nodes, owner, shared_work, &[]),
            None if shared_work == 0 && !replicas => None,
            None => p.join(job_id, &job.start.nodes, owner, shared_work, &datasets),
        }));
        Ok(SetUpPlan {
            options,
            shared_tier,
            owner,
            shard,
            peers,
        })
    }

    /// Prepares the job's directories on the hot tier (or the shared tier) and the RAM tier.
    async fn prepare_dirs(
        &self,
        job: &Arc<Job>,
        plan: &SetUpPlan,
        fresh_dirs: bool,
    ) -> Result<Prepared, SetupError> {
        let job_id = job.start.job_id;
        let node = self.cfg.node.clone();
        let SetUpPlan {
            options,
            shared_tier,
            shard,
            peers,
            ..
        } = plan;
        let owner = plan.owner;
        let hot = self.hot.clone();
        // A fresh start removes what an earlier run of the job id left, except the committed
        // checkpoints this run inherited. A recovered job's datasets on this node's hot tier
        // resume: what the run before the agent's restart staged of them stays, and their staging
        // logs say which files of it are whole ([`stage::resume`]) — object-store datasets, and
        // POSIX ones the copy helper copies whole (alone, without a cache, or a shard); those
        // shared with peers or through the cache are staged again from the start.
        let resuming = !fresh_dirs && shared_tier.is_none();
        let posix_resumes = shard.is_some() || (peers.0.is_none() && self.cache.is_none());
        let keep_staged: Vec<String> = options
            .stage_in
            .iter()
            .filter(|s| resuming && (s.source.bucket_url().is_some() || posix_resumes))
            .map(|s| s.name.clone())
            .collect();
        let resume = match shared_tier {
            None => {
                let state_dir = self.cfg.state_dir.clone();
                let open = move || stage::resume::JobResume::open(&state_dir, job_id, resuming);
                Some(Arc::new(blocking(open).await))
            }
            Some(_) => None,
        };
        let inherited: Vec<String> = job.ckpts.entries().iter().map(|e| e.tag.clone()).collect();
        let (stage_fd, ckpt_fd) = blocking(move || {
            let fresh = fresh_dirs && inherited.is_empty();
            let dirs = hot.prepare_job(job_id, owner, fresh, &keep_staged)?;
            if fresh_dirs && !inherited.is_empty() {
                hot.remove_ckpt_except(job_id, &inherited, owner.into())?;
            }
            Ok(dirs)
        })
        .await
        .map_err(|source| {
            tracing::error!(job_id, "preparing job directories: {source}");
            SetupError::JobDir {
                node: node.clone(),
                source,
            }
        })?;
        // On the RAM tier `$SLUICE_CKPT_DIR` is the job's tmpfs: a restore goes there. A tmpfs
        // holding checkpoints this run inherited is kept (never prepared fresh).
        let ckpt_fd = match self.ckpt.dirs(job).ram() {
            Some(tier) => {
                let ram = tier.clone();
                let keep: Vec<String> = job
                    .ckpts
                    .entries()
                    .iter()
                    .filter(|e| e.in_ram())
                    .map(|e| e.tag.clone())
                    .collect();
                blocking(move || ram.prepare(job_id, owner, fresh_dirs, &keep))
                    .await
                    .map_err(|source| {
                        tracing::error!(job_id, "preparing the job's RAM tier: {source}");
                        SetupError::RamDir {
                            node: node.clone(),
                            source,
                        }
                    })?
            }
            None => ckpt_fd,
        };
        // On the shared tier the datasets go into the job's shared directory, not this node's.
        let shared_job = match &shared_tier {
            Some(cfg) => {
                let (cfg, this_node) = (cfg.clone(), job.start.node.clone());
                let opened = blocking(move || {
                    stage::shared::SharedJob::open(&cfg, job_id, &this_node, owner, fresh_dirs)
                })
                .await
                .map_err(|source| {
                    tracing::error!(
                        job_id,
                        "preparing the job's shared-tier directory: {source}"
                    );
                    SetupError::JobDir {
                        node: node.clone(),
                        source,
                    }
                })?;
                Some(Arc::new(opened))
            }
            None => None,
        };
        let stage_fd = match &shared_job {
            Some(s) => s.stage.try_clone().map_err(|e| SetupError::JobDir {
                node: node.clone(),
                source: SafeFsError::Sys {
                    op: "dup",
                    path: job.dirs.stage_dir.clone(),
                    errno: nix::errno::Errno::from_raw(e.raw_os_error().unwrap_or(0)),
                },
            })?,
            None => stage_fd,
        };
        let ctx = StageCtx {
            cfg: self.cfg.clone(),
            owner,
            user: job.start.user.clone(),
            stage_path: job.dirs.stage_dir.clone().into(),
            stage_fd: Arc::new(stage_fd),
            helper_exe: self.helper_exe.clone(),
            cancel: job.cancel.child_token(),
            budget: self.stage_budget.clone(),
            shared_tier: shared_job
                .as_ref()
                .map(|s| Arc::new(s.layout_for(&job.start.node))),
            cache: self.cache.clone(),
            resume,
        };
        Ok(Prepared {
            shared_job,
            stage: ctx,
            ckpt_fd: Arc::new(ckpt_fd),
        })
    }

    /// Stages the job's datasets: this node's own part ([`stage_own_share`]), then, on the
    /// shared tier, waits for the other nodes' shares, taking over those of nodes found dead.
    async fn stage_datasets(
        &self,
        job: &Arc<Job>,
        plan: &SetUpPlan,
        prepared: &Prepared,
    ) -> Result<(), SetupError> {
        let job_id = job.start.job_id;
        let ctx = &prepared.stage;
        let mut result = stage_own_share(job, plan, prepared).await;
        if let (Some(shared), Some(shard)) = (&prepared.shared_job, &plan.shard) {
            // The job's other nodes learn how this node's share went (unless they took it
            // over), then this node waits for theirs, taking over the share of a node found
            // dead: its tasks see the whole dataset or fail.
            let (s, n, r) = (shared.clone(), job.start.node.clone(), result.clone());
            let marked = blocking(move || {
                if s.is_taken_over(&n) {
                    return Ok(());
                }
                s.mark(&n, r.as_ref().map(|_| ()))
            })
            .await;
            if let Err(e) = marked {
                tracing::error!(job_id, "marking this node's share on the shared tier: {e}");
            }
            if result.is_ok() {
                let take = |sub: ShardPlan| -> futures::future::BoxFuture<'_, _> {
                    let specs = &plan.options.stage_in;
                    Box::pin(async move {
                        let sub = &sub;
                        futures::future::try_join_all(specs.iter().zip(&job.stages).map(
                            |(spec, own)| async move {
                                let part = Arc::new(stage::Progress::new(spec));
                                let r =
                                    stage::stage_with(ctx, spec, part.clone(), Sharing::Shard(sub))
                                        .await;
                                // What this node wrote for the lost node counts as its own.
                                own.absorb(&part);
                                r
                            },
                        ))
                        .await
                        .map(drop)
                    })
                };
                let liveness = plan
                    .peers
                    .0
                    .as_deref()
                    .map(|p| p as &dyn stage::shared::Liveness);
                result = shared
                    .wait_for_all(shard, &ctx.cancel, liveness, &take)
                    .await
                    .map(|notes| job.add_stage_notes(notes));
            }
        }
        result.map_err(|source| SetupError::Stage {
            node: self.cfg.node.clone(),
            source,
        })
    }

    /// `--ckpt-restore`: places the checkpoint in `$SLUICE_CKPT_DIR` (`ckpt_fd`).
    async fn restore_ckpt(
        &self,
        job: &Arc<Job>,
        plan: &SetUpPlan,
        ckpt_fd: &Arc<OwnedFd>,
    ) -> Result<(), SetupError> {
        let job_id = job.start.job_id;
        let SetUpPlan { options, peers, .. } = plan;
        let owner = plan.owner;
        let Some(which) = &options.ckpt_restore else {
            return Ok(());
        };
        let url = job.archive_url().ok_or(RestoreError::NoArchive)?;
        let started = std::time::Instant::now();
        let (tag, notes) = ckpt::restore(
            &self.ckpt,
            job,
            url,
            which,
            ckpt_fd.clone(),
            peers.0.clone(),
        )
        .await?;
        self.metrics.restored(tag.as_deref(), started.elapsed());
        if let Some(t) = tag.clone() {
            let dir = ckpt_fd.clone();
            if let Err(e) = blocking(move || ckpt::write_restored_signal(&dir, &t, owner)).await {
                tracing::warn!(job_id, "writing the restored checkpoint's signal file: {e}");
            }
        }
        job.set_restored(tag, notes);
        self.jobs.persist(job).await;
        Ok(())
    }
}

/// Stages this node's own part of the job's datasets: all of them, or its share (shard, the
/// shared tier, where it stops as soon as the job's other nodes took its share over).
async fn stage_own_share(
    job: &Arc<Job>,
    plan: &SetUpPlan,
    prepared: &Prepared,
) -> Result<(), StageError> {
    let shared_job = &prepared.shared_job;
    if shared_job.as_ref().is_some_and(|s| s.done) {
        // A restarted agent: this node's share is written, and tasks may be reading it.
        return Ok(());
    }
    if shared_job.as_ref().is_some_and(|s| s.taken_over) {
        // The job's other nodes found this node's agent dead and write its share: a
        // restarted agent leaves it to them, so two writers never race on a file.
        tracing::warn!(
            job_id = job.start.job_id,
            "this node's share on the shared tier was taken over"
        );
        return Ok(());
    }
    let writing = futures::future::try_join_all(plan.options.stage_in.iter().zip(&job.stages).map(
        |(spec, progress)| {
            let sharing = match (&plan.shard, &plan.peers.0) {
                (Some(plan), _) => Sharing::Shard(plan),
                (None, Some(p)) => Sharing::Peers(p),
                (None, None) => Sharing::Alone,
            };
            stage::stage_with(&prepared.stage, spec, progress.clone(), sharing)
        },
    ));
    // An agent that was found dead while it wrote (it hung, or its peer port could not be
    // reached) stops as soon as it sees the takeover.
    let taken_over = async {
        let Some(shared) = shared_job else {
            return std::future::pending().await;
        };
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let (s, n) = (shared.clone(), job.start.node.clone());
            if blocking(move || s.is_taken_over(&n)).await {
                tracing::warn!(
                    job_id = job.start.job_id,
                    "this node's share on the shared tier was taken over; it stops writing it"
                );
                return;
            }
        }
    };
    tokio::select! {
        r = writing => r.map(drop),
        () = taken_over => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_set_up_is_labelled_by_what_failed() {
        let stage = SetupError::Stage {
            node: "n1".into(),
            source: StageError::NotFound {
                dataset: "s3://b/x".into(),
            },
        };
        assert_eq!((stage.operation(), stage.code()), ("stage", "not_found"));
        let restore = SetupError::Restore(RestoreError::NoArchive);
        assert_eq!(
            (restore.operation(), restore.code()),
            ("restore", "no_archive")
        );
        assert_eq!(
            (SetupError::RamTier.operation(), SetupError::RamTier.code()),
            ("setup", "ram_tier")
        );
    }
}
