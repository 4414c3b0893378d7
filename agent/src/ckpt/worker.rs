//! The per-job checkpoint worker: turns commits into archives, publishes manifests, applies
//! retention, and cleans up after the job — also after the job ended and after a restart.

use super::replicate::replicate_pending;
use super::restore::{VerifyError, verify_local};
use super::{CkptCtx, CkptEntry, CommitError, CommitOutcome, check_commit_dir, scan_signals};
use crate::job::Job;
use sluice_archive::flush::{FlushError, Flushed};
use sluice_archive::store::StoreErrorKind;
use sluice_archive::{
    self as archive, ArchiveError, ArchiveProgress, Archiver, JobMeta, Manifest, Publish,
};
use sluice_core::backoff::{Backoff, Schedule};
use sluice_core::rt::{blocking, now_secs};
use sluice_core::safefs::{self, Owner};
use sluice_core::worker::{StatusCell, Worker};
use sluice_proto::msg::{CkptState, JobState};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// Where interrupted uploads keep what they stored, so that an agent restarted mid-archive resumes
/// per data object instead of from the start (issue 10, defect 8). Root-only agent state.
pub(crate) fn resume_dir(cfg: &sluice_core::config::Config) -> std::path::PathBuf {
    cfg.state_dir.join("uploads")
}

/// How long a resume log nobody wrote to is kept (a tag given up, a job long gone).
pub(crate) const RESUME_LOG_AGE: std::time::Duration =
    std::time::Duration::from_secs(7 * 24 * 3600);

/// Records a commit of `tag` for `job` (from `sluice ckpt commit`, a framework signal, or another
/// node through the archive) and wakes the job's worker.
pub(crate) async fn commit(
    ctx: &CkptCtx,
    job: &Arc<Job>,
    tag: &str,
) -> Result<CommitOutcome, CommitError> {
    commit_as_of(ctx, job, tag, now_secs(), None).await
}

/// [`commit`], recording `committed_at` as the commit's time: a checkpoint restored from replicas
/// keeps the time it was saved at, so that it is the same checkpoint to every node's index (not a
/// newer one that other nodes would take in place of the replicas they hold) and no newer than the
/// checkpoints saved after it. `own_part`: the paths of this node's own part as it was sealed
/// before, which alone its replicas are of ([`crate::job::CkptEntry::set_own_part`]).
pub(crate) async fn commit_as_of(
    ctx: &CkptCtx,
    job: &Arc<Job>,
    tag: &str,
    committed_at: u64,
    own_part: Option<Arc<std::collections::BTreeSet<String>>>,
) -> Result<CommitOutcome, CommitError> {
    let (dirs, id, uid, t) = (
        ctx.dirs(job),
        job.start.job_id,
        job.start.uid,
        tag.to_string(),
    );
    blocking(move || {
        let dir = dirs.user().map_err(CommitError::NoCkptDir)?;
        check_commit_dir(&dir, &t, uid)
    })
    .await?;
    let outcome = job.ckpts.commit(tag, committed_at)?;
    if job.is_ram() && outcome != CommitOutcome::AlreadyPending {
        // On the RAM tier only, until the worker has flushed it to the hot tier.
        if let Some(entry) = job.ckpts.get(tag) {
            entry.set_in_ram(true);
            entry.set_on_hot(false);
            entry.set_flush_hashes(None);
        }
    }
    if outcome != CommitOutcome::AlreadyPending {
        if let Some(entry) = job.ckpts.get(tag) {
            entry.set_own_part(own_part);
        }
        tracing::info!(job_id = id, tag, ?outcome, "checkpoint committed");
        ctx.jobs.persist(job).await;
        job.ckpts.wake.notify_one();
    }
    Ok(outcome)
}

/// Retention: removes archived checkpoints beyond the newest `keep` good ones from the hot tier;
/// above the high-water mark, every archived checkpoint but the newest good one (poisoned ones
/// never count: [`crate::job::JobCkpts::to_trim`]).
pub(crate) async fn trim(ctx: &CkptCtx, job: &Job) {
    if ctx.jobs.replaced(job) {
        return;
    }
    let hot = ctx.hot.clone();
    let keep = if blocking(move || hot.above_high_water()).await {
        1
    } else {
        job.keep
    };
    let victims = job.ckpts.to_trim(keep);
    if victims.is_empty() {
        return;
    }
    let (hot, id) = (ctx.hot.clone(), job.start.job_id);
    match remove_ckpts(move || hot.open_ckpt(id), job, &victims).await {
        Ok(results) => {
            for (entry, r) in victims.iter().zip(results) {
                match r {
                    Ok(_) => {
                        entry.set_on_hot(false);
                        tracing::info!(
                            job_id = id,
                            tag = entry.tag,
                            "trimmed from the hot tier (archived)"
                        );
                    }
                    Err(e) => tracing::warn!(job_id = id, tag = entry.tag, "trimming: {e}"),
                }
            }
            ctx.jobs.persist(job).await;
        }
        Err(e) => tracing::warn!(job_id = id, "trimming: {e}"),
    }
}

/// Removes the checkpoints `victims` of `job` from the directory `open` opens, as the job's user
/// would (on a blocking thread): how each removal went, or why the directory would not open.
async fn remove_ckpts(
    open: impl FnOnce() -> Result<std::os::fd::OwnedFd, safefs::SafeFsError> + Send + 'static,
    job: &Job,
    victims: &[Arc<CkptEntry>],
) -> Result<Vec<Result<safefs::Removed, safefs::SafeFsError>>, safefs::SafeFsError> {
    let who = safefs::RemoveAs { uid: job.start.uid };
    let tags: Vec<String> = victims.iter().map(|e| e.tag.clone()).collect();
    blocking(move || {
        let dir = open()?;
        Ok(tags
            .iter()
            .map(|t| safefs::remove_tree(&dir, t, who))
            .collect())
    })
    .await
}

/// Frees what a finished job keeps on the hot tier when the tier is above its high-water mark: the
/// hot copies of its archived checkpoints (safe in the archive). Never an unarchived or a refused
/// one. When nothing of the job is left there, its directory and journal record go too.
pub(crate) async fn release(ctx: &CkptCtx, job: &Arc<Job>) {
    if ctx.jobs.replaced(job) {
        return;
    }
    let id = job.start.job_id;
    let archived: Vec<Arc<CkptEntry>> = job
        .ckpts
        .entries()
        .into_iter()
        .filter(|e| e.on_hot() && e.state() == CkptState::Archived)
        .collect();
    let hot = ctx.hot.clone();
    let Ok(removed) = remove_ckpts(move || hot.open_ckpt(id), job, &archived).await else {
        return;
    };
    for (entry, r) in archived.iter().zip(removed) {
        if r.is_ok() {
            entry.set_on_hot(false);
            tracing::info!(
                job_id = id,
                tag = entry.tag,
                "hot tier above its high-water mark: archived copy of a finished job removed"
            );
        }
    }
    if job.ckpts.entries().iter().any(|e| e.on_hot()) {
        ctx.jobs.persist(job).await;
    } else {
        let (hot, who) = (ctx.hot.clone(), safefs::RemoveAs { uid: job.start.uid });
        if let Err(e) = blocking(move || hot.remove_job(id, who)).await {
            tracing::warn!(job_id = id, "removing the job directory: {e}");
        }
        ctx.jobs.forget(job).await;
    }
}

/// How long a requeued job's set-up and checkpoint worker wait for the run before to stop touching
/// the job's directories (it finishes the flush or upload it is in, then stops).
pub(crate) const PREVIOUS_RUN_WAIT: std::time::Duration = std::time::Duration::from_secs(120);

/// The loop of one job's checkpoints on this node, from its start until nothing is left to do
/// after it ended (or the agent stops: the journal carries the rest).
pub(crate) struct CkptWorker {
    ctx: Arc<CkptCtx>,
    job: Arc<Job>,
    /// When each tag whose flush failed may be tried again.
    flush_retries: Schedule<String>,
    ended_at: Option<Instant>,
    /// Framework signals were looked for once after the job ended.
    scanned_after_end: bool,
    /// What this node's replicas keep between turns (`[fast_tier] replicas`).
    replicas: super::replicate::Replicas,
    /// The archive side between its turns; `None` while a turn of it runs (`archive_turn`).
    archiving: Option<Archiving>,
    archive_turn: Option<tokio::task::JoinHandle<Archiving>>,
}

/// A job's archive side on this node: its uploads and publishes, and the commits the job's other
/// nodes announced through the archive. A turn of it runs in a task of its own beside the
/// worker's loop ([`Archiving::turn`]): while the store is down each of its requests takes its
/// retries' time (seconds), which must not hold back the flushes and replicas of new commits
/// (a checkpoint protected by replicas in an outage is the point of them).
struct Archiving {
    ctx: Arc<CkptCtx>,
    job: Arc<Job>,
    archiver: Option<Arc<Archiver>>,
    /// When each tag whose upload or publish failed may be tried again.
    retries: Schedule<String>,
    last_remote_scan: Option<Instant>,
    /// Tags other nodes committed that this node answered with an empty part.
    answered_empty: HashSet<String>,
    /// Since when each tag whose part is archived waits for other nodes' parts (bounded by
    /// `ckpt.publish_wait`).
    waiting_since: HashMap<String, Instant>,
}

impl Worker for CkptWorker {
    fn name(&self) -> String {
        format!("ckpt job {}", self.job.start.job_id)
    }

    fn job_id(&self) -> Option<sluice_proto::msg::JobId> {
        Some(self.job.start.job_id)
    }

    async fn run(self, cancel: CancellationToken, status: Arc<StatusCell>) {
        let span = self.job.span();
        self.turns(cancel, status).instrument(span).await
    }
}

impl CkptWorker {
    async fn turns(mut self, cancel: CancellationToken, status: Arc<StatusCell>) {
        let _running = self.job.worker_running();
        // A requeue: the run before may still be flushing or archiving into the job's directories.
        status.set("waiting for the run before");
        if !self.job.wait_for_previous_run(PREVIOUS_RUN_WAIT).await {
            tracing::warn!(
                "the run of this job before the requeue still works on its checkpoints after {}; going on",
                humantime::format_duration(PREVIOUS_RUN_WAIT)
            );
        }
        // The set-up prepares the job's directories first: it clears what the run before left
        // half-done there (a `.flush-TAG`, torn saves). Flushing into them meanwhile raced it (the
        // new run failed with "rmdir .flush-TAG: ENOTEMPTY"). The checkpoints a requeue inherits
        // wait where they are, kept, until the set-up is over (ready or failed).
        status.set("waiting for the set-up");
        let mut state = self.job.subscribe();
        tokio::select! {
            _ = state.wait_for(|s| *s != JobState::Staging) => {}
            _ = cancel.cancelled() => return,
        }
        loop {
            if self.job.is_finished() {
                // Replaced by a newer run of the same job id: the archive side's turn under way
                // finishes first (the new run waits for this worker).
                self.archive_home().await;
                return;
            }
            status.set("scanning");
            self.adopt_framework_signals().await;
            self.adopt_peer_commits().await;
            if self.job.is_ram() {
                status.set("flushing");
                self.flush_pending().await;
                status.set("replicating");
                replicate_pending(&self.ctx, &self.job, &mut self.replicas).await;
                status.set("verifying");
                self.verify_unarchived().await;
                self.free_ram().await;
            } else if self.job.replicas_wanted() > 0 {
                status.set("replicating");
                self.hash_for_replicas().await;
                replicate_pending(&self.ctx, &self.job, &mut self.replicas).await;
            }
            // The archive side's next turn, beside this loop (see `Archiving`).
            if let Some(a) = self.archiving.take() {
                let turn = a.turn().instrument(tracing::Span::current());
                self.archive_turn = Some(tokio::spawn(turn));
            }
            trim(&self.ctx, &self.job).await;
            if self.job.has_ended() {
                // What the archive side's turn archived decides what is left to wait for, and
                // what retention may take off the hot tier before the worker is done.
                self.archive_home().await;
                trim(&self.ctx, &self.job).await;
                if self.wind_down().await {
                    return;
                }
            }
            status.turn(self.first_error());
            status.set("idle");
            // Until a commit, the next scan, or the archive side's turn home after the job
            // ended (its end waits for it); a turn home while the job runs waits for the next.
            let pause = tokio::time::sleep(self.ctx.cfg.ckpt.scan_interval);
            tokio::pin!(pause);
            let mut turn = self.archive_turn.take();
            loop {
                tokio::select! {
                    _ = self.job.ckpts.wake.notified() => break,
                    _ = &mut pause => break,
                    _ = cancel.cancelled() => {
                        if let Some(t) = turn {
                            t.abort();
                        }
                        return;
                    }
                    done = async { turn.as_mut().expect("polled only while a turn runs").await },
                        if turn.is_some() =>
                    {
                        turn = None;
                        self.archiving = Some(self.came_home(done));
                        if self.job.has_ended() {
                            break;
                        }
                    }
                }
            }
            self.archive_turn = turn;
        }
    }
}

impl CkptWorker {
    pub(crate) fn new(ctx: Arc<CkptCtx>, job: Arc<Job>) -> CkptWorker {
        CkptWorker {
            archiving: Some(Archiving::new(&ctx, &job)),
            archive_turn: None,
            flush_retries: Schedule::new(Backoff::archive(ctx.cfg.ckpt.retry_pause_max)),
            ctx,
            job,
            ended_at: None,
            scanned_after_end: false,
            replicas: Default::default(),
        }
    }

    /// The archive side back from its turn (a turn that panicked leaves a fresh one, said in the
    /// log).
    fn came_home(&self, done: Result<Archiving, tokio::task::JoinError>) -> Archiving {
        done.unwrap_or_else(|e| {
            tracing::error!(
                job_id = self.job.start.job_id,
                "the archive side's turn failed: {e}"
            );
            Archiving::new(&self.ctx, &self.job)
        })
    }

    /// Waits for the archive side's turn under way, if one is.
    async fn archive_home(&mut self) {
        if let Some(turn) = self.archive_turn.take() {
            let done = turn.await;
            self.archiving = Some(self.came_home(done));
        }
    }

    fn first_error(&self) -> Option<String> {
        self.job.ckpt_statuses().into_iter().find_map(|c| c.error)
    }

    /// Framework completion signals, while the job runs and its directories exist, and once more
    /// at the first turn after the job ended: a signal written in the job's last moments (DCP's
    /// `.metadata` just before the processes exit, after the previous scan) still commits its
    /// checkpoint, which would otherwise go with the uncommitted directories at job end.
    async fn adopt_framework_signals(&mut self) {
        let job = self.job.clone();
        if job.state() != JobState::Ready {
            return;
        }
        if job.has_ended() {
            if self.scanned_after_end {
                return;
            }
            self.scanned_after_end = true;
        }
        let (dirs, uid) = (self.ctx.dirs(&job), job.start.uid);
        let tags = blocking(move || {
            dirs.user()
                .map(|d| scan_signals(&d, uid))
                .unwrap_or_default()
        })
        .await;
        for tag in tags {
            if job.ckpts.get(&tag).is_none()
                && commit(&self.ctx, &job, &tag).await.is_ok()
                && let Some(notices) = super::announce(&self.ctx, &job, &tag)
            {
                drop(tokio::spawn(notices));
            }
        }
    }

    /// After the job ended: true once nothing is pending and the job is cleaned up. A commit made
    /// on another node just before the end may not have reached this node yet: a multi-node job's
    /// uncommitted directories wait out `ckpt.epilog_wait` (while commits are adopted from the
    /// archive) before they are deleted.
    async fn wind_down(&mut self) -> bool {
        let job = self.job.clone();
        // A checkpoint only in RAM is flushed first, archive or not: the tmpfs goes with the job;
        // and its copy is verified while the RAM copy is there to flush it again.
        if job
            .ckpts
            .entries()
            .iter()
            .any(|e| e.needs_flush() || e.awaits_verify())
        {
            return false;
        }
        let has_archive = job.archive_url().is_some();
        if has_archive && job.ckpts.pending() {
            // Everything is flushed and verified on NVMe: the RAM share goes now, not once the
            // archive is back (hours, in an outage), unless another node's late commit may still
            // be adopted into this node's uncommitted directories there.
            let in_ram = job.ckpts.entries().iter().any(|e| e.in_ram());
            if in_ram && (job.start.nodes.len() <= 1 || !self.has_uncommitted_dirs().await) {
                self.release_ram().await;
            }
            return false;
        }
        let ended_at = *self.ended_at.get_or_insert_with(Instant::now);
        let multi_node = has_archive && job.start.nodes.len() > 1;
        // Another node's last commit may reach the archive just after this node's end: a node
        // answers (with its part, or an empty one) for two more scans before it is done.
        let grace = self.ctx.cfg.ckpt.scan_interval * 2;
        let wait = multi_node
            && (ended_at.elapsed() < grace
                || (ended_at.elapsed() < self.ctx.cfg.ckpt.epilog_wait
                    && self.has_uncommitted_dirs().await));
        if wait {
            if let Some(a) = self.archiving.as_mut() {
                a.last_remote_scan = None; // adopt at the next turn
            }
            return false;
        }
        self.finalize().await;
        true
    }

    /// Removes the ended job's RAM tier (its tmpfs, and its share of the node's) once every
    /// committed checkpoint of it is on the hot tier, and journals that nothing of it is in RAM:
    /// an agent that recovers the job later takes no share for it.
    async fn release_ram(&self) {
        let job = &self.job;
        let Some(ram) = self.ctx.dirs(job).ram().cloned() else {
            return;
        };
        let (id, who) = (job.start.job_id, safefs::RemoveAs { uid: job.start.uid });
        match blocking(move || ram.remove(id, who)).await {
            Ok(()) => {
                let entries = job.ckpts.entries();
                if entries.iter().any(|e| e.in_ram()) {
                    entries.iter().for_each(|e| e.set_in_ram(false));
                    self.ctx.jobs.persist(job).await;
                    tracing::info!(
                        job_id = id,
                        "the job's RAM tier is given back: its checkpoints are on NVMe"
                    );
                }
            }
            Err(e) => tracing::error!(job_id = id, "removing the job's RAM tier: {e}"),
        }
    }

    /// Tags other nodes of the job said they committed (commit notices on the peer port, which
    /// travel while the archive is down): committed here too when this node holds the tag; a tag
    /// it holds none of becomes an empty part among its replicas.
    async fn adopt_peer_commits(&mut self) {
        let job = self.job.clone();
        for tag in job.ckpts.take_committed_elsewhere() {
            if job.ckpts.get(&tag).is_some() || self.replicas.holds_empty(&tag) {
                continue;
            }
            let id = job.start.job_id;
            match holds(&self.ctx, &self.job, &tag).await {
                Ok(()) => {
                    tracing::info!(
                        job_id = id,
                        tag,
                        "committed on another node of the job (its notice)"
                    );
                    let _ = commit(&self.ctx, &job, &tag).await;
                }
                Err(CommitError::Missing { .. }) => {
                    self.replicas.hold_empty(tag);
                }
                Err(e) => tracing::warn!(job_id = id, tag, "committed on another node: {e}"),
            }
        }
    }

    /// `--ckpt-tier=ram`: copies each committed checkpoint that is only in RAM to the hot tier
    /// (durable, each file hashed as read: [`sluice_archive::flush`]), where it is archived from.
    /// Its RAM copy stays until the copy is verified against those hashes (by its upload, or
    /// [`Self::verify_unarchived`]); [`Self::free_ram`] then frees it, unless it is the newest.
    async fn flush_pending(&mut self) {
        let job = self.job.clone();
        let block = self
            .ctx
            .dirs(&job)
            .ram()
            .map_or(crate::ram_tier::DEFAULT_FLUSH_BLOCK, |t| {
                t.config().flush_block
            }) as usize;
        self.find_lost().await;
        let owner = Owner {
            uid: job.start.uid,
            gid: job.start.gid,
        };
        for entry in job.ckpts.entries() {
            if !entry.needs_flush() || !self.flush_retries.ready(entry.tag.as_str(), Instant::now())
            {
                continue;
            }
            let generation = entry.generation();
            let (dirs, tag) = (self.ctx.dirs(&job), entry.tag.clone());
            let started = Instant::now();
            let result = blocking(move || flush_one(&dirs, &tag, owner, block)).await;
            if entry.generation() != generation {
                continue; // committed again meanwhile: flushed again at the next turn
            }
            let id = job.start.job_id;
            match result {
                Ok(done) => {
                    let (files, bytes, direct) = (done.files, done.bytes, done.direct);
                    entry.set_flushed(done.hashes);
                    tracing::info!(
                        job_id = id,
                        tag = entry.tag,
                        files,
                        bytes,
                        direct,
                        secs = started.elapsed().as_secs_f64(),
                        "checkpoint flushed from the RAM tier to the hot tier"
                    );
                    self.ctx.jobs.persist(&job).await;
                }
                Err(e @ FlushError::Refused(_)) => {
                    tracing::warn!(job_id = id, tag = entry.tag, "not flushed: {e}");
                    entry.refuse(format!(
                        "{e}; it was not flushed from the RAM tier and goes with the job: fix the checkpoint and commit it again"
                    ));
                }
                Err(e @ FlushError::Modified { .. }) => {
                    tracing::warn!(job_id = id, tag = entry.tag, "{e}");
                    entry.note_failure();
                    entry.set_error(
                        CkptState::Modified,
                        format!("{e}; sluice retries a few times, then waits for the next commit of this tag"),
                    );
                }
                Err(e) => {
                    tracing::warn!(job_id = id, tag = entry.tag, "flush attempt failed: {e}");
                    entry.note_failure();
                    let message = if sluice_stage::is_no_space(e.errno()) {
                        format!(
                            "the hot tier is full, so the checkpoint stays in RAM and its flush is retried ({e})"
                        )
                    } else {
                        format!("flushing it from the RAM tier failed, retrying: {e}")
                    };
                    entry.set_error(CkptState::Retrying, message);
                }
            }
            self.flush_retries
                .update(entry.tag.clone(), entry.failures(), Instant::now());
        }
    }

    /// Hashes the files of each hot-tier checkpoint committed since its replicas were last
    /// placed: what its replicas are checked against, as a RAM-tier one's flush hashes are
    /// (`--ckpt-replicas` with `--ckpt-tier=local`). Read as the job user's files, never through
    /// a link; a checkpoint that cannot be read is not replicated and says why, until it is
    /// committed again.
    async fn hash_for_replicas(&self) {
        let pending = self.job.ckpts.entries().into_iter().filter(|e| {
            e.archived_at().is_none() && e.on_hot() && !e.is_refused() && e.needs_hashing()
        });
        for entry in pending {
            let generation = entry.generation();
            let (dirs, tag, uid) = (
                self.ctx.dirs(&self.job),
                entry.tag.clone(),
                self.job.start.uid,
            );
            let hashed = blocking(move || {
                let dir = safefs::open_dir(&dirs.hot().map_err(|e| e.to_string())?, &tag)
                    .map_err(|e| e.to_string())?;
                sluice_archive::flush::hash_tree(&dir, uid).map_err(|e| e.to_string())
            })
            .await;
            if entry.generation() != generation {
                continue; // committed again meanwhile: hashed again at the next turn
            }
            match hashed {
                Ok(hashes) => entry.set_hashed(hashes),
                Err(e) => {
                    tracing::warn!(
                        job_id = self.job.start.job_id,
                        tag = entry.tag,
                        "not replicated: {e}"
                    );
                    entry.hash_failed(format!("its files could not be read: {e}"));
                }
            }
        }
    }

    /// Committed checkpoints that are only in RAM and cannot be flushed any more: the job's tmpfs
    /// is gone (the node rebooted, an admin removed it), or the checkpoint's directory in it. They
    /// are lost: said in the agent log, `sluice ckpt list` / `sluice status` and the job's end
    /// summary — never left pending.
    async fn find_lost(&self) {
        let job = &self.job;
        let unflushed: Vec<Arc<CkptEntry>> = job
            .ckpts
            .entries()
            .into_iter()
            .filter(|e| e.in_ram() && (e.needs_flush() || e.awaits_verify()))
            .collect();
        if unflushed.is_empty() {
            return;
        }
        let dirs = self.ctx.dirs(job);
        let where_ = dirs.ram().map_or_else(
            || "the RAM tier".to_string(),
            |t| t.ckpt_dir(job.start.job_id).display().to_string(),
        );
        let tags: Vec<String> = unflushed.iter().map(|e| e.tag.clone()).collect();
        let gone = blocking(move || match dirs.user() {
            Err(e) if e.errno() == Some(nix::errno::Errno::ENOENT) => Some(vec![true; tags.len()]),
            Err(_) => None, // not known to be gone: the flush reports what is wrong
            Ok(ram) => Some(
                tags.iter()
                    .map(|t| {
                        safefs::open_dir(&ram, t)
                            .is_err_and(|e| e.errno() == Some(nix::errno::Errno::ENOENT))
                    })
                    .collect(),
            ),
        })
        .await;
        let Some(gone) = gone else { return };
        let mut changed = false;
        for (entry, gone) in unflushed.iter().zip(gone) {
            if !gone {
                continue;
            }
            changed = true;
            entry.set_in_ram(false);
            if entry.awaits_verify() || entry.on_hot() {
                // Flushed already: the hot tier's copy is archived (or kept) as it is.
                tracing::warn!(
                    job_id = job.start.job_id,
                    tag = entry.tag,
                    "the RAM copy of a flushed checkpoint is gone ({where_}); its hot tier copy is kept"
                );
                continue;
            }
            let message = format!(
                "LOST: committed on the RAM tier and never flushed to NVMe, and its RAM copy                  ({where_}/{}) is gone — the node rebooted or the job's tmpfs was removed;                  nothing of it is on the hot tier or in the archive: save the state again",
                entry.tag
            );
            tracing::error!(job_id = job.start.job_id, tag = entry.tag, "{message}");
            entry.lose(message);
        }
        if changed {
            self.ctx.jobs.persist(job).await;
        }
    }

    /// Verifies flushed copies that no upload is about to verify, by reading them back, one per
    /// turn and only once nothing waits to be flushed (the read-back is the background's work,
    /// never ahead of a flush): every flushed checkpoint of a job without `--ckpt-archive`, and
    /// those whose upload cannot run now (the archive is unreachable, the tag refused). Also, once
    /// the job's tmpfs is more than half full, those still waiting for their upload, so that RAM
    /// is freed as soon as a slow archive would have freed it. A copy that does not read back as
    /// flushed is flushed again from RAM.
    async fn verify_unarchived(&self) {
        let job = &self.job;
        let entries = job.ckpts.entries();
        if entries.iter().any(|e| e.needs_flush()) || !entries.iter().any(|e| e.awaits_verify()) {
            return;
        }
        let has_archive = job.archive_url().is_some();
        let dirs = self.ctx.dirs(job);
        let tight = match dirs.ram().cloned() {
            Some(tier) => {
                let id = job.start.job_id;
                let (used, size) = blocking(move || tier.usage(id)).await;
                size > 0 && used * 2 > size
            }
            None => false,
        };
        let Some(entry) = entries.into_iter().find(|e| {
            e.awaits_verify()
                && (!has_archive
                    || tight
                    || !matches!(
                        e.state(),
                        CkptState::Committed | CkptState::Archiving | CkptState::WaitingForNodes
                    ))
        }) else {
            return;
        };
        let Some(hashes) = entry.flush_hashes() else {
            return;
        };
        let (generation, tag, uid) = (entry.generation(), entry.tag.clone(), job.start.uid);
        let started = Instant::now();
        let result = blocking(move || {
            let failed = |e: safefs::SafeFsError| ReadBack::Failed(e.to_string());
            let hot = dirs.hot().map_err(failed)?;
            let dir = safefs::open_dir(&hot, &tag).map_err(failed)?;
            sluice_archive::flush::verify_tree(&dir, uid, &hashes).map_err(|e| match e {
                FlushError::Mismatch { path } => ReadBack::Differs(path),
                other => ReadBack::Failed(other.to_string()),
            })
        })
        .await;
        if entry.generation() != generation || entry.flush_hashes().is_none() {
            return; // committed again, or verified by its upload meanwhile
        }
        let id = job.start.job_id;
        match result {
            Ok(()) => {
                entry.set_verified();
                tracing::info!(
                    job_id = id,
                    tag = entry.tag,
                    secs = started.elapsed().as_secs_f64(),
                    "the hot tier's copy reads back as flushed from RAM (verified)"
                );
                self.ctx.jobs.persist(job).await;
            }
            Err(ReadBack::Differs(path)) => {
                let damaged = [archive::Damaged {
                    path,
                    detail: "reads back with another BLAKE3 than when flushed from RAM".into(),
                }];
                not_as_flushed(&self.ctx, &self.job, &entry, &damaged, "a read-back").await;
            }
            Err(ReadBack::Failed(e)) => tracing::warn!(
                job_id = id,
                tag = entry.tag,
                "reading back the flushed copy: {e}; tried again later"
            ),
        }
    }

    /// Removes from the RAM tier the checkpoints that are safe on the hot tier (flushed and
    /// verified), but the newest good one ([`crate::job::JobCkpts::ram_to_free`]).
    async fn free_ram(&self) {
        let job = &self.job;
        let victims = job.ckpts.ram_to_free();
        if victims.is_empty() {
            return;
        }
        let dirs = self.ctx.dirs(job);
        match remove_ckpts(move || dirs.user(), job, &victims).await {
            Ok(removed) => {
                for (e, r) in victims.iter().zip(removed) {
                    if r.is_ok() {
                        e.set_in_ram(false);
                    }
                }
                self.ctx.jobs.persist(job).await;
            }
            Err(e) => tracing::warn!(job_id = job.start.job_id, "freeing the RAM tier: {e}"),
        }
    }

    /// Whether the job's checkpoint directory holds directories that are not committed checkpoints.
    async fn has_uncommitted_dirs(&self) -> bool {
        let dirs = self.ctx.dirs(&self.job);
        let committed: Vec<String> = self
            .job
            .ckpts
            .entries()
            .iter()
            .map(|e| e.tag.clone())
            .collect();
        blocking(move || {
            dirs.user()
                .map(crate::hot_tier::subdirs)
                .unwrap_or_default()
                .iter()
                .any(|name| !committed.contains(name))
        })
        .await
    }

    /// After the job ended and nothing is pending: remove what is not a kept checkpoint. The job
    /// directory (and the journal record) stay while committed checkpoints remain on the hot tier.
    async fn finalize(&self) {
        let job = &self.job;
        let id = job.start.job_id;
        if self.ctx.jobs.replaced(job) {
            // Requeued: `jobs/<id>` and the journal record belong to the new run now.
            tracing::info!(
                job_id = id,
                "job finished on this node; a newer run replaced it"
            );
            return;
        }
        let keep: Vec<String> = job
            .ckpts
            .entries()
            .iter()
            .filter(|e| e.on_hot() && !e.is_refused())
            .map(|e| e.tag.clone())
            .collect();
        let keep_any = !keep.is_empty();
        let hot = self.ctx.hot.clone();
        let who = safefs::RemoveAs { uid: job.start.uid };
        // Uncommitted leftovers (torn saves, framework marker files) go; committed ones stay.
        let removed = blocking(move || {
            if keep_any {
                hot.remove_ckpt_except(id, &keep, who)
            } else {
                hot.remove_job(id, who).map(|r| {
                    if r.skipped > 0 {
                        tracing::warn!(
                            job_id = id,
                            skipped = r.skipped,
                            "the job's directory on the hot tier holds entries of other users \
                             (moved in by the job's user); they were left in place with the \
                             directories holding them — check them and remove them by hand"
                        );
                    }
                })
            }
        })
        .await;
        if let Err(e) = removed {
            tracing::error!(job_id = id, "cleaning up after the job: {e}");
        }
        // Every committed checkpoint of the RAM tier is on the hot tier now (wind_down waited).
        self.release_ram().await;
        if keep_any {
            self.ctx.jobs.persist(job).await;
        } else if !self.ctx.jobs.replaced(job) {
            self.ctx.jobs.forget(job).await;
        }
        job.finish();
        tracing::info!(
            job_id = id,
            retained = keep_any,
            "job finished on this node"
        );
    }
}

impl Archiving {
    fn new(ctx: &Arc<CkptCtx>, job: &Arc<Job>) -> Archiving {
        Archiving {
            ctx: ctx.clone(),
            job: job.clone(),
            archiver: None,
            retries: Schedule::new(Backoff::archive(ctx.cfg.ckpt.retry_pause_max)),
            last_remote_scan: None,
            answered_empty: HashSet::new(),
            waiting_since: HashMap::new(),
        }
    }

    /// One turn: the commits other nodes announced through the archive, then each pending tag's
    /// upload and publish at its own backoff, then the replicas of what is archived freed.
    async fn turn(mut self) -> Archiving {
        if let Some(url) = self.job.archive_url().map(String::from)
            && let Some(archiver) = self.archiver(&url)
        {
            self.archive_pending(&archiver).await;
            super::replicate::free_replicas_of_archived(&self.ctx, &self.job).await;
        }
        self
    }

    /// The archive, opened at the first turn that needs it (a failure is shown on every pending
    /// checkpoint and tried again at the next turn).
    fn archiver(&mut self, url: &str) -> Option<Arc<Archiver>> {
        if self.archiver.is_none() {
            match archive::open_archive(&self.ctx.cfg, url) {
                Ok(a) => {
                    let a = a
                        .for_job(self.job.start.job_id)
                        .with_resume_dir(resume_dir(&self.ctx.cfg));
                    self.archiver = Some(Arc::new(match &self.ctx.bandwidth {
                        Some(bw) => a.with_bandwidth(bw),
                        None => a,
                    }))
                }
                Err(e) => {
                    tracing::warn!(job_id = self.job.start.job_id, "archive {url}: {e}");
                    for entry in self.job.ckpts.entries().iter().filter(|e| e.needs_upload()) {
                        entry.set_error(
                            CkptState::Retrying,
                            format!("cannot open the archive: {e}"),
                        );
                    }
                }
            }
        }
        self.archiver.clone()
    }

    /// One turn of uploads and publishes, each tag at its own backoff.
    async fn archive_pending(&mut self, archiver: &Arc<Archiver>) {
        let job = self.job.clone();
        // Commits made on the job's other nodes reach this node through the archive.
        let due = self
            .last_remote_scan
            .is_none_or(|t| t.elapsed() >= self.ctx.cfg.ckpt.scan_interval * 3);
        if job.start.nodes.len() > 1 && due {
            self.last_remote_scan = Some(Instant::now());
            self.adopt_remote_commits(archiver).await;
        }
        for entry in job.ckpts.entries() {
            if !self.retries.ready(entry.tag.as_str(), Instant::now()) {
                continue;
            }
            // A checkpoint that changed while being read is retried a few times after a pause (a
            // commit seen through the archive may arrive before this node's writes finish), then
            // waits for an explicit commit.
            if entry.needs_upload() || entry.retries_modified() {
                self.archive_part(&entry, archiver).await;
            }
            if entry.state() == CkptState::WaitingForNodes {
                self.publish(&entry, archiver).await;
            }
            self.retries
                .update(entry.tag.clone(), entry.failures(), Instant::now());
        }
    }

    /// Uploads this node's files of one checkpoint.
    async fn archive_part(&self, entry: &Arc<CkptEntry>, archiver: &Arc<Archiver>) {
        let job = &self.job;
        let job_id = job.start.job_id;
        let generation = entry.generation();
        entry.set_state(CkptState::Archiving);
        // First tell the job's other nodes (they answer with their parts, or with an empty one).
        if job.start.nodes.len() > 1
            && let Err(e) = archiver
                .announce_commit(&entry.tag, &self.ctx.cfg.node)
                .await
        {
            entry.note_failure();
            return entry.set_error(CkptState::Retrying, e.describe());
        }
        let (hot, tag) = (self.ctx.hot.clone(), entry.tag.clone());
        let dir =
            blocking(move || sluice_core::safefs::open_dir(hot.open_ckpt(job_id)?, &tag)).await;
        let dir = match dir {
            Ok(d) => Arc::new(d),
            Err(e) => {
                return entry.set_error(
                    CkptState::Modified,
                    format!("the checkpoint directory is gone or unusable ({e}); commit it again once it is complete"),
                );
            }
        };
        // A prefix several users may archive into (an allow rule without `{user}`): never
        // overwrite another user's checkpoint of the same tag (their restore would then get ours,
        // or nothing). A refusal is final for this commit, as for a refused tree. Their restores
        // never pick ours anyway: restore checks the owner (F2 in docs/SECURITY.md).
        if let Ok(m) = archiver.manifest(&entry.tag).await {
            if m.job.user != job.start.user {
                let message = format!(
                    "checkpoint {} in {} was archived by user {}; sluice does not overwrite \
                     another user's checkpoint: commit it under another tag, or archive under a \
                     prefix of your own",
                    entry.tag,
                    archiver.url(),
                    m.job.user
                );
                tracing::warn!(job_id, tag = entry.tag, "{message}");
                return entry.refuse(message);
            }
            // Archives are immutable: the tag is archived already (by an earlier job under a
            // reused prefix, an earlier run of this one, or this job's other nodes). This node's
            // files are compared with what the MANIFEST holds of this node's part.
            return self.compare_with_archived(entry, &m, archiver.url()).await;
        }
        // Within the node's memory budget: another job's upload may have to finish first.
        let _slot = self.ctx.upload_slot().await;
        let progress = ArchiveProgress::default();
        let started = Instant::now();
        // Flushed from RAM: the upload's hashes of the hot tier's copy verify the flush.
        let flushed = entry.flush_hashes();
        let result = archiver
            .upload_part(
                &entry.tag,
                &self.ctx.cfg.node,
                dir,
                job.start.uid,
                &progress,
                flushed.as_deref(),
            )
            .await;
        self.ctx.metrics.part_uploaded(started.elapsed(), &result);
        entry.set_bytes_done(progress.snapshot().bytes_done);
        if entry.generation() != generation {
            return entry.set_state(CkptState::Committed); // re-committed meanwhile: upload again
        }
        match result {
            Ok(part) => {
                entry.set_sizes(
                    part.files.len() as u64,
                    part.raw_bytes(),
                    part.stored_bytes(),
                );
                entry.set_state(CkptState::WaitingForNodes);
                tracing::info!(job_id, tag = entry.tag, "checkpoint part uploaded");
                if flushed.is_some() {
                    entry.set_verified();
                    tracing::info!(
                        job_id,
                        tag = entry.tag,
                        "the hot tier's copy hashes as flushed from RAM (verified by its upload)"
                    );
                    self.ctx.jobs.persist(job).await;
                }
            }
            Err(ArchiveError::NotAsFlushed { damaged, .. }) => {
                not_as_flushed(&self.ctx, &self.job, entry, &damaged, "its upload").await;
            }
            Err(e @ ArchiveError::Refused { .. }) => {
                // A symlink, a hard link, another user's file: retrying cannot help. It is not a
                // checkpoint sluice keeps: it goes with the uncommitted directories at job end,
                // unless the user fixes it and commits it again before.
                tracing::warn!(job_id, tag = entry.tag, "{e}");
                entry.refuse(format!("{e}; fix the checkpoint and commit it again"));
            }
            Err(e) if e.is_permanent() => {
                tracing::warn!(job_id, tag = entry.tag, "archive refused: {e}");
                entry.conflict(format!(
                    "{e}; retrying cannot help: this copy is kept on the hot tier, not archived — \
                     save the state under a new tag"
                ));
            }
            Err(e) if e.is_modified() => {
                tracing::warn!(job_id, tag = entry.tag, "{e}");
                entry.note_failure();
                entry.set_error(
                    CkptState::Modified,
                    format!("{e}; sluice retries a few times, then waits for the next commit of this tag"),
                );
            }
            Err(e) => {
                tracing::warn!(job_id, tag = entry.tag, "archive attempt failed: {e}");
                entry.note_failure();
                let message = match e.store_kind() {
                    Some(StoreErrorKind::Unreachable | StoreErrorKind::TimedOut) => {
                        format!(
                            "the archive store is unreachable; retrying ({})",
                            e.describe()
                        )
                    }
                    _ => e.describe(),
                };
                entry.set_error(CkptState::Retrying, message);
            }
        }
    }

    /// The archive already holds `entry`'s tag: identical content counts as archived (a re-upload
    /// after a crash); other content is refused and kept on the hot tier, never trimmed as if it
    /// were archived (issue 10, defect 2).
    async fn compare_with_archived(&self, entry: &Arc<CkptEntry>, m: &Manifest, url: &str) {
        let job = &self.job;
        let (hot, id, uid, tag, node, manifest) = (
            self.ctx.hot.clone(),
            job.start.job_id,
            job.start.uid,
            entry.tag.clone(),
            self.ctx.cfg.node.clone(),
            m.clone(),
        );
        let same = blocking(move || {
            let ckpt = hot.open_ckpt(id)?;
            Ok::<_, VerifyError>(verify_local(&ckpt, &tag, uid, &manifest, Some(&node)))
        })
        .await;
        // Flushed from RAM: what the MANIFEST holds of this node's files must be what the flush read.
        if let (Ok(Ok(())), Some(flushed)) = (&same, entry.flush_hashes()) {
            let node = &self.ctx.cfg.node;
            let damaged = sluice_archive::flush::differences(
                &flushed,
                m.files
                    .iter()
                    .filter(|f| &f.node == node)
                    .map(|f| (f.path.as_str(), f.content_hash())),
            );
            if !damaged.is_empty() {
                return not_as_flushed(
                    &self.ctx,
                    &self.job,
                    entry,
                    &damaged,
                    "the archived MANIFEST",
                )
                .await;
            }
            entry.set_verified();
        }
        match same {
            Ok(Ok(())) => {
                entry.set_sizes(m.files.len() as u64, m.raw_bytes, m.stored_bytes);
                entry.set_archived(now_secs());
                tracing::info!(
                    job_id = id,
                    tag = entry.tag,
                    "identical to the archived checkpoint"
                );
                self.ctx.jobs.persist(job).await;
            }
            Ok(Err(e)) => {
                let message = format!(
                    "checkpoint {} is already archived in {url} (by job {}) with other content \
                     ({e}); archives are immutable: this copy is kept on the hot tier, not \
                     archived — save the state under a new tag",
                    entry.tag, m.job.job_id
                );
                tracing::warn!(job_id = id, tag = entry.tag, "{message}");
                entry.conflict(message);
            }
            Err(e) => {
                entry.note_failure();
                entry.set_error(
                    CkptState::Retrying,
                    format!("the checkpoint directory: {e}"),
                );
            }
        }
    }

    /// Publishes the MANIFEST once every node's part is in the archive. While parts are missing it
    /// asks again at the archive backoff (the last node to upload publishes at once by itself), for
    /// `ckpt.publish_wait` at most: then the checkpoint is incomplete, kept here and named in the
    /// job output.
    async fn publish(&mut self, entry: &Arc<CkptEntry>, archiver: &Arc<Archiver>) {
        let job = &self.job;
        let meta = JobMeta {
            job_id: job.start.job_id,
            user: job.start.user.clone(),
            job_name: job.start.job_name.clone(),
        };
        match archiver
            .try_publish(&entry.tag, &job.start.nodes, meta)
            .await
        {
            Ok(Publish::Published(_)) => {
                self.waiting_since.remove(&entry.tag);
                entry.set_archived(now_secs());
                tracing::info!(
                    job_id = job.start.job_id,
                    tag = entry.tag,
                    "checkpoint archived"
                );
                self.ctx.jobs.persist(job).await;
            }
            Ok(Publish::Waiting { missing }) => {
                let limit = self.ctx.cfg.ckpt.publish_wait;
                let waited = self
                    .waiting_since
                    .entry(entry.tag.clone())
                    .or_insert_with(Instant::now)
                    .elapsed();
                let nodes = missing.join(", ");
                if waited >= limit {
                    let message = format!(
                        "node(s) {nodes} of the job never sent their part (waited {}, \
                         ckpt.publish_wait); this node's files are kept on its hot tier, not \
                         archived — bring the node's agent back and commit the tag again, or \
                         save the state under a new tag",
                        humantime::format_duration(limit)
                    );
                    tracing::warn!(job_id = job.start.job_id, tag = entry.tag, "{message}");
                    self.waiting_since.remove(&entry.tag);
                    entry.incomplete(message);
                    self.ctx.jobs.persist(job).await;
                } else {
                    entry.note_failure(); // asks again at the backoff, not every scan
                    let left = limit.saturating_sub(waited).as_secs();
                    entry.set_error(
                        CkptState::WaitingForNodes,
                        format!(
                            "waiting for the part of node(s) {nodes} of the job (at most {} more)",
                            humantime::format_duration(std::time::Duration::from_secs(left))
                        ),
                    );
                }
            }
            Err(e) if e.is_permanent() => {
                tracing::warn!(
                    job_id = job.start.job_id,
                    tag = entry.tag,
                    "publishing: {e}"
                );
                entry.conflict(format!(
                    "{e}; the checkpoint cannot be published and is kept on the hot tier of each \
                     node — save the state under a new tag"
                ));
            }
            Err(e) => {
                entry.note_failure();
                entry.set_error(CkptState::WaitingForNodes, e.describe());
                tracing::warn!(
                    job_id = job.start.job_id,
                    tag = entry.tag,
                    "publishing: {e}"
                );
            }
        }
    }

    /// Answers the commits another node of the job announced in the archive
    /// ([`Archiver::commits_of_job`]): a tag this node holds is committed here too (its part is
    /// uploaded); for a tag it does not hold at all it writes an empty part, so the checkpoint is
    /// published without waiting for this node (e.g. `torch.save` on rank 0 only).
    async fn adopt_remote_commits(&mut self, archiver: &Arc<Archiver>) {
        let job = self.job.clone();
        let tags = match archiver.commits_of_job().await {
            Ok(tags) => tags,
            Err(e) => {
                tracing::warn!(job_id = job.start.job_id, "reading the job's commits: {e}");
                return;
            }
        };
        for tag in tags {
            if job.ckpts.get(&tag).is_some() || self.answered_empty.contains(&tag) {
                continue;
            }
            let id = job.start.job_id;
            match holds(&self.ctx, &self.job, &tag).await {
                Ok(()) => {
                    tracing::info!(job_id = id, tag, "committed on another node of the job");
                    let _ = commit(&self.ctx, &job, &tag).await;
                }
                Err(CommitError::Missing { .. }) => {
                    match archiver.put_empty_part(&tag, &self.ctx.cfg.node).await {
                        Ok(()) => {
                            tracing::info!(
                                job_id = id,
                                tag,
                                "committed on another node; this node holds none of it"
                            );
                            self.answered_empty.insert(tag);
                        }
                        Err(e) => tracing::warn!(job_id = id, tag, "answering a commit: {e}"),
                    }
                }
                // A directory this node cannot archive (a symlink, another owner): publishing
                // waits for it, and `sluice ckpt list` on the committing node names this node.
                Err(e) => tracing::warn!(job_id = id, tag, "committed on another node: {e}"),
            }
        }
    }
}

/// Whether this node holds `tag` as a directory it may commit (blocking work, awaited).
async fn holds(ctx: &CkptCtx, job: &Job, tag: &str) -> Result<(), CommitError> {
    let (dirs, uid, t) = (ctx.dirs(job), job.start.uid, tag.to_string());
    blocking(move || {
        dirs.user()
            .map_err(CommitError::NoCkptDir)
            .and_then(|d| check_commit_dir(&d, &t, uid))
    })
    .await
}

/// The hot tier's copy of a flushed checkpoint is not what the flush read from RAM (found by
/// `by`): flushed again from its RAM copy, which is kept until the copy is verified; where
/// that is gone too, the checkpoint is refused, not archived.
async fn not_as_flushed(
    ctx: &CkptCtx,
    job: &Arc<Job>,
    entry: &Arc<CkptEntry>,
    damaged: &[archive::Damaged],
    by: &str,
) {
    let first = damaged
        .first()
        .map_or_else(String::new, |d| format!("'{}': {}", d.path, d.detail));
    let more = damaged.len().saturating_sub(1);
    let what = if more > 0 {
        format!("{first} (and {more} more file(s))")
    } else {
        first
    };
    if entry.in_ram() {
        let message = format!(
            "the hot tier's copy is not what was flushed from RAM ({what}, found by {by}): flushing it again from RAM"
        );
        tracing::warn!(job_id = job.start.job_id, tag = entry.tag, "{message}");
        entry.reflush(message);
    } else {
        let message = format!(
            "the hot tier's copy is not what was flushed from RAM ({what}, found by {by}), and the RAM copy is gone: it is not archived — save the state under a new tag"
        );
        tracing::error!(job_id = job.start.job_id, tag = entry.tag, "{message}");
        entry.conflict(message);
    }
    ctx.jobs.persist(job).await;
    job.ckpts.wake.notify_one();
}

/// Why a read-back of a flushed copy did not verify it.
enum ReadBack {
    /// This file reads back with another hash than the flush read.
    Differs(String),
    /// It could not be read (tried again later).
    Failed(String),
}

/// Flushes `$SLUICE_CKPT_DIR/TAG` from the RAM tier to the hot tier's `ckpt/TAG` (blocking): into
/// `.flush-TAG` first, renamed into place once every file is durable, so a flush cut
/// short (the agent killed) never looks like a checkpoint and is simply done again.
fn flush_one(
    dirs: &super::CkptDirs,
    tag: &str,
    owner: Owner,
    block: usize,
) -> Result<Flushed, FlushError> {
    let io = |what: &str| {
        let path = what.to_string();
        move |e: safefs::SafeFsError| FlushError::Io {
            path,
            source: e.errno().map_or_else(
                || std::io::Error::other(e.to_string()),
                std::io::Error::from,
            ),
        }
    };
    let ram = dirs.user().map_err(io("$SLUICE_CKPT_DIR"))?;
    let src = safefs::open_dir(&ram, tag).map_err(io(tag))?;
    let hot = dirs
        .hot()
        .map_err(io("the hot tier's checkpoint directory"))?;
    let tmp = format!(".flush-{tag}");
    safefs::remove_tree(&hot, &tmp, owner.into())
        .and_then(|r| r.all_gone(&tmp))
        .map_err(io(&tmp))?;
    let dst = safefs::create_dir(&hot, &tmp, Some(owner), 0o755).map_err(io(&tmp))?;
    let done = sluice_archive::flush::flush_tree(&src, owner.uid, &dst, owner, block)?;
    // An earlier flush of the tag (committed again since): replaced by this one.
    safefs::remove_tree(&hot, tag, owner.into())
        .and_then(|r| r.all_gone(tag))
        .map_err(io(tag))?;
    nix::fcntl::renameat(&hot, tmp.as_str(), &hot, tag).map_err(|e| {
        io(tag)(safefs::SafeFsError::Sys {
            op: "rename",
            path: tag.into(),
            errno: e,
        })
    })?;
    nix::unistd::fsync(&hot).map_err(|e| {
        io(tag)(safefs::SafeFsError::Sys {
            op: "fsync",
            path: tag.into(),
            errno: e,
        })
    })?;
    Ok(done)
}
