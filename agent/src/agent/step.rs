//! Step-level staging: `srun --stage-in=…` (and `--stage-mode`) inside an allocation stages what
//! the step adds, on the step's nodes, for the step's tasks, into the job's `$SLUICE_STAGE_DIR`.
//!
//! Every task of a step other than the batch script sends its step's options with `WaitStaged`
//! (the plugin cannot tell which of them srun inherited from the job). Here they are compared with
//! the job's:
//!
//! - **The job is known** (it used sluice options itself): the datasets the step names that the
//!   job does not are staged once per node, whichever task asks first, after the job's own
//!   staging; the other tasks (and later steps naming the same dataset) wait for that one staging.
//!   A NAME the job or an earlier step already uses for another source is refused, with the
//!   reason in the step's output. What is staged is journaled, so a restarted agent does not stage
//!   it again under running tasks, and job end removes it with the job's other data.
//! - **The job is unknown** (an `salloc` or `sbatch` without sluice options, so no prolog call):
//!   the step's options start the job on this node as the prolog would, after Slurm confirms (by
//!   `squeue`) that the job runs as the asking user. The epilog will not call either, so
//!   housekeeping ends such a job once Slurm no longer runs it.
//!
//! The same site policy applies as to a job (`[[stage.allow]]` for the job's user). A step's
//! datasets are read by each of its nodes from the origin (`--stage-mode=shard` splits them over
//! the step's nodes); peer transfers and the shared tier are for job-level staging.

use super::*;
use crate::identity::JobIdentity;
use crate::job::{Extra, ExtraState};
use sluice_core::safefs;
use sluice_proto::msg::StepStart;
use sluice_proto::options::StageSpec;
use std::sync::atomic::Ordering;

impl Agent {
    /// Stages what `step` adds to job `job_id` on this node, or starts the job from it; returns
    /// once those datasets are staged (or the job was handed to its own set-up). `Err` is the reply
    /// the step's task gets instead.
    pub(super) async fn stage_step(
        self: &Arc<Self>,
        peer: Peer,
        job_id: JobId,
        step: StepStart,
        limit: Duration,
    ) -> Result<Option<ShardPlan>, ErrorReply> {
        let claimed = step.start;
        if claimed.job_id != job_id {
            return Err(ErrorReply::new(
                ErrorCode::BadRequest,
                "the step's job id differs from the request's",
            ));
        }
        let Ok(opts) = job::parse_options(&claimed) else {
            // Checked again (and reported) where the options are used.
            return Ok(None);
        };
        let Some(job) = self.jobs.get(job_id).filter(|j| !j.has_ended()) else {
            if opts.stage_in.is_empty() {
                return Ok(None);
            }
            self.start_from_step(peer, claimed).await?;
            return Ok(None);
        };
        self.authorised_job(peer, job_id)?;
        // Who the step runs as is the job's user, as root announced it: nothing of the identity
        // the frame claims is kept. The step runs on this node, among the job's nodes.
        let id = JobIdentity::announced_by_root(&job.start);
        let mut start = id.stamp(claimed);
        start.node = self.cfg.node.clone();
        id.check_step_nodes(&start.nodes)
            .map_err(|m| ErrorReply::new(ErrorCode::BadRequest, m))?;
        check_job_start(&start)
            .map_err(|e| ErrorReply::new(ErrorCode::BadRequest, e.to_string()))?;
        let Ok(job_opts) = job.options.clone() else {
            return Ok(None);
        };
        let added: Vec<StageSpec> = opts
            .stage_in
            .iter()
            .filter(|s| !job_opts.stage_in.contains(s))
            .cloned()
            .collect();
        if added.is_empty() {
            return Ok(None);
        }
        let refuse = |m: String| ErrorReply::new(ErrorCode::StageFailed, m);
        for s in &added {
            if let Some(j) = job_opts.stage_in.iter().find(|j| j.name == s.name) {
                return Err(refuse(format!(
                    "--stage-in {}: the job already stages {} under that NAME; the step names {} — choose another NAME for the step's dataset",
                    s.name, j.source, s.source
                )));
            }
        }
        if job_opts.stage_tier == StageTier::Shared || opts.stage_tier == StageTier::Shared {
            return Err(refuse(
                "--stage-in on a step: a step's datasets are staged to the node-local tier only; give --stage-tier=shared and its datasets to sbatch/salloc instead".into(),
            ));
        }
        if let Err(e) = self.apply_policy(&start).await {
            return Err(refuse(e.to_string()));
        }
        let plan = match opts.stage_mode {
            StageMode::Shard => {
                Some(ShardPlan::new(&start.nodes, &start.node).ok_or_else(|| {
                    refuse(format!(
                        "--stage-mode=shard: node {} is not one of the step's nodes {:?}",
                        start.node, start.nodes
                    ))
                })?)
            }
            StageMode::Replicate => None,
        };
        // The job's own staging first: it prepares the stage directory.
        let mut rx = job.subscribe();
        match tokio::time::timeout(limit, rx.wait_for(|s| *s != JobState::Staging)).await {
            Ok(Ok(s)) if *s == JobState::Ready => {}
            // Failed, ended or out of time: the wait that follows says which.
            _ => return Ok(None),
        }
        let mut entries = Vec::new();
        for spec in added {
            entries.push(self.extra(&job, spec, plan.clone())?);
        }
        for entry in entries {
            let mut state = entry.state.subscribe();
            let done = tokio::time::timeout(limit, state.wait_for(|s| *s != ExtraState::Staging));
            match done.await {
                Ok(Ok(s)) => match &*s {
                    ExtraState::Done => {}
                    ExtraState::Failed(why) => return Err(refuse(why.clone())),
                    ExtraState::Staging => unreachable!("wait_for returned a staging state"),
                },
                Ok(Err(_)) => {
                    return Err(ErrorReply::new(
                        ErrorCode::Internal,
                        "the step's staging was dropped",
                    ));
                }
                Err(_) => {
                    let p = entry.progress.snapshot();
                    return Err(ErrorReply::new(
                        ErrorCode::Timeout,
                        format!(
                            "stage-in of the step's dataset {} on node {} did not finish within {} s ({} of {} bytes); the step stops here",
                            p.name,
                            self.cfg.node,
                            limit.as_secs(),
                            p.bytes_done,
                            p.bytes_total.map_or("?".into(), |b| b.to_string())
                        ),
                    ));
                }
            }
        }
        Ok(plan)
    }

    /// The staging of the step's dataset `spec` on this node: the one under way or done, or a new
    /// one, started in a task of its own (it finishes for the step's other tasks even if the
    /// asking one goes away).
    fn extra(
        self: &Arc<Self>,
        job: &Arc<Job>,
        spec: StageSpec,
        plan: Option<ShardPlan>,
    ) -> Result<Arc<Extra>, ErrorReply> {
        let mut extras = lock(&job.extras);
        if let Some(e) = extras.get(&spec.name) {
            if e.spec == spec {
                return Ok(e.clone());
            }
            return Err(ErrorReply::new(
                ErrorCode::StageFailed,
                format!(
                    "--stage-in {}: an earlier step of the job staged {} under that NAME; this step names {} — choose another NAME",
                    spec.name, e.spec.source, spec.source
                ),
            ));
        }
        let (state, _) = tokio::sync::watch::channel(ExtraState::Staging);
        let entry = Arc::new(Extra {
            progress: Arc::new(stage::Progress::new(&spec)),
            spec,
            state,
        });
        extras.insert(entry.spec.name.clone(), entry.clone());
        drop(extras);
        let (this, j, e, span) = (self.clone(), job.clone(), entry.clone(), job.span());
        drop(
            self.spawn(
                async move {
                    let result = this.stage_extra(&j, &e, plan).await;
                    let state = match result {
                        Ok(()) => ExtraState::Done,
                        Err(why) => {
                            tracing::warn!("{why}");
                            ExtraState::Failed(why)
                        }
                    };
                    e.state.send_replace(state);
                    this.jobs.persist(&j).await;
                }
                .instrument(span),
            ),
        );
        Ok(entry)
    }

    /// Stages one dataset of a step into the job's stage directory (replacing what a cut-short
    /// attempt left under its NAME), within the admin's stage timeout.
    async fn stage_extra(
        &self,
        job: &Arc<Job>,
        e: &Extra,
        plan: Option<ShardPlan>,
    ) -> Result<(), String> {
        let (hot, job_id, name) = (self.hot.clone(), job.start.job_id, e.spec.name.clone());
        let node = self.cfg.node.clone();
        let who = safefs::RemoveAs { uid: job.start.uid };
        let fd = blocking(move || {
            let fd = hot.open_stage(job_id)?;
            // What a cut-short attempt left: the dataset, and a shard manifest next to it.
            safefs::remove_tree(&fd, &name, who)?.all_gone(&name)?;
            let manifest = stage::shard::manifest_name(&name);
            safefs::remove_tree(&fd, &manifest, who)?.all_gone(&manifest)?;
            Ok::<_, SafeFsError>(fd)
        })
        .await
        .map_err(|e| format!("sluice could not prepare the job directory on node {node}: {e}"))?;
        let ctx = StageCtx {
            cfg: self.cfg.clone(),
            owner: Owner {
                uid: job.start.uid,
                gid: job.start.gid,
            },
            user: job.start.user.clone(),
            stage_path: job.dirs.stage_dir.clone().into(),
            stage_fd: Arc::new(fd),
            helper_exe: self.helper_exe.clone(),
            cancel: job.cancel.child_token(),
            budget: self.stage_budget.clone(),
            shared_tier: None,
            cache: self.cache.clone(),
            resume: None,
        };
        let sharing = plan.as_ref().map_or(Sharing::Alone, Sharing::Shard);
        let limit = self.cfg.stage.timeout;
        let staged = stage::stage_with(&ctx, &e.spec, e.progress.clone(), sharing);
        match tokio::time::timeout(limit, staged).await {
            Ok(Ok(())) => {
                tracing::info!(job_id, "staged the step's dataset {}", e.spec.name);
                Ok(())
            }
            Ok(Err(source)) => Err(SetupError::Stage { node, source }.to_string()),
            Err(_) => Err(format!(
                "stage-in of the step's dataset {} on node {node} did not finish within {} (the admin's stage timeout)",
                e.spec.name,
                humantime::format_duration(limit)
            )),
        }
    }

    /// Starts a job the agent learnt of from one of its steps, as the prolog would have, once
    /// Slurm confirms the job runs on this node as the asking user: the start then carries the
    /// identity Slurm and NSS give ([`JobIdentity::confirmed_by_slurm`]), never the frame's.
    async fn start_from_step(
        self: &Arc<Self>,
        peer: Peer,
        claimed: JobStart,
    ) -> Result<(), ErrorReply> {
        let job_id = claimed.job_id;
        let node = &self.cfg.node;
        let start = if peer.is_root() {
            claimed
        } else {
            let Some(squeue) = self.cfg.squeue.clone() else {
                return Err(ErrorReply::new(
                    ErrorCode::Forbidden,
                    format!(
                        "the sluice agent on node {node} cannot confirm that job {job_id} is yours ([agent] squeue is off), so it does not stage for the step; give the --stage-* options to sbatch/salloc"
                    ),
                ));
            };
            let id = JobIdentity::confirmed_by_slurm(&squeue, job_id, node, peer)
                .await
                .map_err(|why| {
                    ErrorReply::new(
                        ErrorCode::Forbidden,
                        format!(
                            "the sluice agent on node {node} does not stage for this step: {why}"
                        ),
                    )
                })?;
            let mut start = id.stamp(claimed);
            start.node = node.clone();
            id.check_step_nodes(&start.nodes)
                .map_err(|m| ErrorReply::new(ErrorCode::BadRequest, m))?;
            start
        };
        match self.job_start(start).await {
            Response::Ok => {}
            Response::Error(e) => return Err(e),
            other => {
                return Err(ErrorReply::new(
                    ErrorCode::Internal,
                    format!("starting the job from its step: {other:?}"),
                ));
            }
        }
        if let Some(job) = self.jobs.get(job_id) {
            job.from_step.store(true, Ordering::Relaxed);
            self.jobs.persist(&job).await;
        }
        Ok(())
    }

    /// Ends the jobs the agent learnt of from a step once Slurm no longer runs them (their epilog
    /// does not call the agent). From housekeeping.
    pub(super) async fn end_gone_step_jobs(self: &Arc<Self>) {
        let Some(squeue) = self.cfg.squeue.clone() else {
            return;
        };
        let jobs: Vec<Arc<Job>> = self
            .jobs
            .snapshot()
            .into_iter()
            .filter(|j| j.from_step.load(Ordering::Relaxed) && !j.has_ended())
            .collect();
        for job in jobs {
            let job_id = job.start.job_id;
            if slurm_job_gone(&squeue, job_id).await {
                tracing::info!(
                    job_id,
                    "job started by a step is no longer run by Slurm: ending it here"
                );
                drop(self.job_end(job_id).await);
            }
        }
    }
}
