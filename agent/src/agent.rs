//! The agent's engine: the jobs on this node and what each request does to them.
//!
//! Authorisation happens here, from the peer credentials the server read off the socket — never from
//! anything inside a message. Root (the plugin's prolog/epilog, an admin) may do everything; a user may
//! wait for and look at their own jobs only.

use crate::job::Job;
use crate::journal::{CkptRecord, JobRecord, Journal, RECORD_VERSION};
use crate::stage::{self, StageCtx};
use sluice_archive::config::Config;
use sluice_archive::safefs::{self, Owner};
use sluice_proto::msg::{
    ErrorCode, ErrorReply, JobDirs, JobId, JobStart, JobState, NodeStatus, Request, Response,
};
use sluice_proto::options::{self, StageMode, StageTier};
use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio_util::task::TaskTracker;

/// Who is on the other end of the socket, from `SO_PEERCRED`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    pub uid: u32,
    pub gid: u32,
}

impl Peer {
    pub fn is_root(self) -> bool {
        self.uid == 0
    }
}

/// Ended jobs kept for `sluice job`/`status` before they are forgotten.
const KEEP_ENDED: usize = 64;
/// Longest a task may ask to wait for staging.
const MAX_WAIT: Duration = Duration::from_secs(48 * 3600);
/// Most `(name, value)` option pairs accepted in one JobStart.
const MAX_OPTION_PAIRS: usize = 32;

pub struct Agent {
    pub cfg: Arc<Config>,
    jobs: Mutex<HashMap<JobId, Arc<Job>>>,
    pub(crate) journal: Journal,
    pub tracker: TaskTracker,
    /// Cancelled when the agent stops: background workers return (their work resumes from the journal).
    pub(crate) stopping: tokio_util::sync::CancellationToken,
    /// The node-wide cap on archive upload bandwidth (`ckpt.bandwidth_limit`), shared by all jobs.
    pub(crate) bandwidth: Option<sluice_archive::Bandwidth>,
    /// The node-wide stage-in download budget (`stage.concurrency`, `stage.memory`), shared by all jobs.
    stage_budget: Arc<stage::Budget>,
    /// The `sluiced` binary that runs `copy-as-user` (the running executable, unless a test says otherwise).
    helper_exe: std::path::PathBuf,
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn reply(code: ErrorCode, message: impl Into<String>) -> Response {
    Response::Error(ErrorReply::new(code, message))
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f)
        .await
        .expect("blocking task panicked")
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("hot tier {path}: {source}")]
    HotTier {
        path: String,
        source: safefs::SafeFsError,
    },
    #[error("hot tier {path}: {source}")]
    HotTierIo {
        path: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Journal(#[from] crate::journal::JournalError),
}

impl Agent {
    /// Prepares the hot tier (`<root>/jobs`, root-owned, 0711: users may traverse to their own job
    /// directory but not list others) and opens the journal.
    pub fn new(cfg: Arc<Config>) -> Result<Arc<Agent>, AgentError> {
        let root = cfg.hot_root.display().to_string();
        std::fs::create_dir_all(&cfg.hot_root).map_err(|source| AgentError::HotTierIo {
            path: root.clone(),
            source,
        })?;
        let root_fd =
            safefs::open_root_dir(&cfg.hot_root).map_err(|source| AgentError::HotTier {
                path: root.clone(),
                source,
            })?;
        let jobs = safefs::ensure_dir(&root_fd, "jobs", Some(Owner { uid: 0, gid: 0 }), 0o711)
            .map_err(|source| AgentError::HotTier {
                path: format!("{root}/jobs"),
                source,
            })?;
        nix::sys::stat::fchmod(&jobs, nix::sys::stat::Mode::from_bits_truncate(0o711)).map_err(
            |e| AgentError::HotTierIo {
                path: format!("{root}/jobs"),
                source: e.into(),
            },
        )?;
        let journal = Journal::open(&cfg.state_dir)?;
        let helper_exe = std::env::current_exe().map_err(|source| AgentError::HotTierIo {
            path: "/proc/self/exe".into(),
            source,
        })?;
        let bandwidth = cfg.ckpt.bandwidth_limit.map(sluice_archive::Bandwidth::new);
        Ok(Arc::new(Agent {
            stopping: tokio_util::sync::CancellationToken::new(),
            bandwidth,
            stage_budget: stage::Budget::new(&cfg.stage),
            cfg,
            jobs: Mutex::new(HashMap::new()),
            journal,
            tracker: TaskTracker::new(),
            helper_exe,
        }))
    }

    /// Like [`Agent::new`], with the `sluiced` binary used for user-identity copies given explicitly.
    pub fn with_helper(
        cfg: Arc<Config>,
        helper_exe: std::path::PathBuf,
    ) -> Result<Arc<Agent>, AgentError> {
        let agent = Agent::new(cfg)?;
        let mut agent = Arc::into_inner(agent).expect("just created");
        agent.helper_exe = helper_exe;
        Ok(Arc::new(agent))
    }

    /// Stops all staging (it resumes from the journal when the agent starts again). Call before exit
    /// and wait for [`Agent::tracker`] so no copy helper outlives the agent.
    pub fn shutdown(&self) {
        self.stopping.cancel();
        for job in self.jobs().values() {
            job.cancel.cancel();
        }
        self.tracker.close();
    }

    pub(crate) fn jobs(&self) -> std::sync::MutexGuard<'_, HashMap<JobId, Arc<Job>>> {
        self.jobs.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn job(&self, job_id: JobId) -> Option<Arc<Job>> {
        self.jobs().get(&job_id).cloned()
    }

    /// Resumes the jobs recorded in the journal: staging that was cut short starts again; jobs that
    /// were already staged stay as they are (their tasks may be using the data); pending checkpoint
    /// archives continue.
    pub fn recover(self: &Arc<Self>) -> Result<usize, AgentError> {
        let (records, bad) = self.journal.load()?;
        for e in bad {
            tracing::error!("{e}; left in place for inspection");
        }
        let n = records.len();
        self.spawn_housekeeping();
        for r in records {
            tracing::info!(
                job_id = r.start.job_id,
                ready = r.ready,
                ended = r.ended,
                "recovering job from the journal"
            );
            let url = Ok(r.archive_url.clone());
            let (job_id, ended) = (r.start.job_id, r.ended);
            self.register(r, url, false);
            if let (false, Some(squeue)) = (ended, self.cfg.squeue.clone()) {
                // The job may have ended while the agent was down (its epilog found no agent):
                // ask Slurm, and end it here too if Slurm no longer runs it.
                let this = self.clone();
                self.tracker.spawn(async move {
                    if slurm_job_gone(&squeue, job_id).await {
                        tracing::info!(
                            job_id,
                            "the job ended while the agent was down; cleaning up"
                        );
                        this.job_end(job_id).await;
                    }
                });
            }
        }
        Ok(n)
    }

    /// Every minute: when the hot tier is above its high-water mark, trims the checkpoints that ended
    /// jobs left on it (archived ones only, never a job's newest archived one).
    fn spawn_housekeeping(self: &Arc<Self>) {
        let this = self.clone();
        self.tracker.spawn(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(60)) => {}
                    _ = this.stopping.cancelled() => return,
                }
                if !this.above_high_water().await {
                    continue;
                }
                let mut ended: Vec<Arc<Job>> = this
                    .jobs()
                    .values()
                    .filter(|j| j.is_ended())
                    .cloned()
                    .collect();
                ended.sort_by_key(|j| j.started_at);
                for job in ended {
                    this.trim(&job).await;
                }
            }
        });
    }

    fn dirs(&self, job_id: JobId) -> JobDirs {
        let base = self.cfg.hot_root.join("jobs").join(job_id.to_string());
        JobDirs {
            stage_dir: base.join("stage").display().to_string(),
            ckpt_dir: base.join("ckpt").display().to_string(),
            restored_tag: None,
            notes: Vec::new(),
        }
    }

    pub async fn handle(self: &Arc<Self>, peer: Peer, request: Request) -> Response {
        match request {
            Request::JobStart(start) => {
                if !peer.is_root() {
                    return reply(
                        ErrorCode::Forbidden,
                        "only root (the Slurm prolog) may announce jobs",
                    );
                }
                self.job_start(start).await
            }
            Request::JobEnd { job_id } => {
                if !peer.is_root() {
                    return reply(
                        ErrorCode::Forbidden,
                        "only root (the Slurm epilog) may end jobs",
                    );
                }
                self.job_end(job_id).await
            }
            Request::WaitStaged { job_id, timeout_ms } => {
                self.wait_staged(peer, job_id, timeout_ms).await
            }
            Request::Job { job_id } => match self.authorised_job(peer, job_id) {
                Ok(job) => Response::Job(job.status()),
                Err(e) => Response::Error(e),
            },
            Request::Status => Response::Status(self.status(peer).await),
            Request::CkptCommit { job_id, tag } => match self.authorised_job(peer, job_id) {
                Ok(job) => self.ckpt_commit(&job, &tag).await,
                Err(e) => Response::Error(e),
            },
            Request::CkptList { job_id } => match self.authorised_job(peer, job_id) {
                Ok(job) => Response::Ckpts {
                    ckpts: job.ckpt_statuses(),
                },
                Err(e) => Response::Error(e),
            },
        }
    }

    fn authorised_job(&self, peer: Peer, job_id: JobId) -> Result<Arc<Job>, ErrorReply> {
        let job = self.job(job_id).ok_or_else(|| {
            ErrorReply::new(
                ErrorCode::NotFound,
                format!(
                    "the sluice agent on node {} has no record of job {job_id}",
                    self.cfg.node
                ),
            )
        })?;
        if !peer.is_root() && peer.uid != job.start.uid {
            return Err(ErrorReply::new(
                ErrorCode::Forbidden,
                format!("job {job_id} belongs to another user"),
            ));
        }
        Ok(job)
    }

    async fn job_start(self: &Arc<Self>, start: JobStart) -> Response {
        if let Err(m) = check_job_start(&start) {
            return reply(ErrorCode::BadRequest, m);
        }
        if start.node != self.cfg.node {
            tracing::warn!(
                job_id = start.job_id,
                "job start for node {} reached the agent of node {}",
                start.node,
                self.cfg.node
            );
        }
        if let Some(existing) = self.job(start.job_id) {
            if existing.state() != JobState::Ended
                && !existing.is_ended()
                && existing.start == start
            {
                return Response::Ok; // a repeated prolog: idempotent
            }
        }
        let archive_url = match self.check_sources(&start).await {
            Ok(()) => self.resolve_archive(&start).await,
            Err(refusal) => Err(refusal),
        };
        let record = JobRecord {
            version: RECORD_VERSION,
            start,
            started_at: now(),
            ready: false,
            ended: false,
            archive_url: archive_url.clone().ok().flatten(),
            ckpts: Vec::new(),
        };
        let journal = self.journal.clone();
        let saved = record.clone();
        if let Err(e) = blocking(move || journal.save(&saved)).await {
            tracing::error!("{e}");
            return reply(
                ErrorCode::Internal,
                format!(
                    "the sluice agent on node {} cannot write its journal: {e}",
                    self.cfg.node
                ),
            );
        }
        self.register(record, archive_url, true);
        Response::Ok
    }

    /// Object-store sources must be allowed for the job's user by `[[stage.allow]]`: the agent reads
    /// them with its own credentials, so this is what keeps one user from staging another's data.
    async fn check_sources(&self, start: &JobStart) -> Result<(), String> {
        let lookup = |name: &str| {
            start
                .options
                .iter()
                .rev()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        };
        let Ok(opts) = options::parse_job_options(lookup) else {
            return Ok(());
        }; // reported by run_job
        let objects: Vec<String> = opts
            .stage_in
            .iter()
            .filter(|s| matches!(s.source, options::Source::Object { .. }))
            .map(|s| s.source.to_string())
            .collect();
        if objects.is_empty() {
            return Ok(());
        }
        let (user, gid) = (start.user.clone(), start.gid);
        let groups = blocking(move || user_groups(&user, gid)).await;
        let rules = &self.cfg.stage.allow;
        for url in objects {
            if !crate::ckpt::allowed_by(
                rules,
                &url,
                &start.user,
                &groups,
                start.job_id,
                &start.job_name,
            ) {
                return Err(format!(
                    "--stage-in={url} is not allowed by the site's policy for user {} (sluice reads object stores with the site's credentials); ask your admin to allow that prefix",
                    start.user
                ));
            }
        }
        Ok(())
    }

    /// The job's archive URL under the site's policy (`Err` = refused, with the reason).
    async fn resolve_archive(&self, start: &JobStart) -> Result<Option<String>, String> {
        let lookup = |name: &str| {
            start
                .options
                .iter()
                .rev()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        };
        let requested = match lookup(options::names::CKPT_ARCHIVE)
            .map(|v| options::parse_ckpt_archive(&v))
            .transpose()
        {
            Ok(r) => r,
            Err(e) => return Err(e.to_string()),
        };
        let (user, gid) = (start.user.clone(), start.gid);
        let groups = blocking(move || user_groups(&user, gid)).await;
        crate::ckpt::resolve_archive(
            &self.cfg.ckpt,
            requested.as_deref(),
            &start.user,
            &groups,
            start.job_id,
            &start.job_name,
        )
    }

    /// Puts a job in the table; starts its staging and restore (unless a recovered job was already
    /// staged or ended) and its checkpoint worker.
    fn register(
        self: &Arc<Self>,
        record: JobRecord,
        archive_url: Result<Option<String>, String>,
        fresh_dirs: bool,
    ) {
        let start = record.start.clone();
        let lookup = |name: &str| {
            start
                .options
                .iter()
                .rev()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        };
        let options = options::parse_job_options(lookup).map_err(|e| e.to_string());
        let job = Arc::new(Job::new(
            start.clone(),
            options,
            self.dirs(start.job_id),
            record.started_at,
            archive_url,
            self.cfg.ckpt.keep,
        ));
        for c in &record.ckpts {
            let entry = Arc::new(crate::ckpt::CkptEntry::new(&c.tag, c.committed_at));
            if let Some(at) = c.archived_at {
                entry.set_archived(at);
            }
            entry.set_on_hot(c.on_hot);
            job.ckpts.insert(entry);
        }
        if record.ended {
            job.ended.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        {
            let mut jobs = self.jobs();
            if let Some(old) = jobs.insert(start.job_id, job.clone()) {
                // A new run of the same job id (requeue): the old run's worker must stop before it
                // trims, finalises or journals anything, since those act on paths keyed by the id.
                old.cancel.cancel();
                old.ended.store(true, std::sync::atomic::Ordering::Relaxed);
                old.set_ended();
                old.ckpts.wake.notify_one();
            }
            prune_ended(&mut jobs);
        }
        if record.ready || record.ended {
            job.set_ready();
        } else {
            let this = self.clone();
            let j = job.clone();
            self.tracker
                .spawn(async move { this.run_job(j, fresh_dirs).await });
        }
        let this = self.clone();
        self.tracker
            .spawn(async move { this.ckpt_worker(job).await });
    }

    async fn run_job(self: Arc<Self>, job: Arc<Job>, fresh_dirs: bool) {
        let job_id = job.start.job_id;
        let node = self.cfg.node.clone();
        let options = match &job.options {
            Ok(o) => o.clone(),
            Err(m) => return job.set_failed(format!("invalid sluice option: {m}")),
        };
        if let Err(m) = &job.archive_url {
            return job.set_failed(m.clone());
        }
        if options.stage_tier == StageTier::Shared {
            return job.set_failed("--stage-tier=shared: no shared tier is configured on this cluster; use --stage-tier=local".into());
        }
        if options.stage_mode == StageMode::Shard {
            return job.set_failed("--stage-mode=shard is not supported by this sluice version yet; use --stage-mode=replicate".into());
        }
        let owner = Owner {
            uid: job.start.uid,
            gid: job.start.gid,
        };
        let hot_root = self.cfg.hot_root.clone();
        let (stage_fd, ckpt_fd) =
            match blocking(move || prepare_job_dirs(&hot_root, job_id, owner, fresh_dirs)).await {
                Ok((s, c)) => (Arc::new(s), Arc::new(c)),
                Err(e) => {
                    tracing::error!(job_id, "preparing job directories: {e}");
                    return job.set_failed(format!(
                        "sluice could not prepare the job directory on node {node}: {e}"
                    ));
                }
            };
        let ctx = StageCtx {
            cfg: self.cfg.clone(),
            owner,
            user: job.start.user.clone(),
            stage_path: job.dirs.stage_dir.clone().into(),
            stage_fd,
            helper_exe: self.helper_exe.clone(),
            cancel: job.cancel.child_token(),
            budget: self.stage_budget.clone(),
        };
        let staging = futures::future::try_join_all(
            options
                .stage_in
                .iter()
                .zip(&job.stages)
                .map(|(spec, progress)| stage::stage(&ctx, spec, progress.clone())),
        );
        let staging = async {
            staging
                .await
                .map(drop)
                .map_err(|e| format!("stage-in failed on node {node}: {e}"))
        };
        let restoring = async {
            match (&options.ckpt_restore, job.archive_url.clone().ok().flatten()) {
                (None, _) => Ok(()),
                (Some(_), None) => Err("--ckpt-restore needs --ckpt-archive (or an admin default archive) to restore from".to_string()),
                (Some(which), Some(url)) => {
                    let (tag, notes) = self.restore_ckpt(&job, &url, which, ckpt_fd.clone()).await?;
                    job.set_restored(Some(tag), notes);
                    self.persist(&job).await;
                    Ok(())
                }
            }
        };
        let limit = self.cfg.stage.timeout;
        match tokio::time::timeout(limit, futures::future::try_join(staging, restoring)).await {
            Ok(Ok(_)) => {
                tracing::info!(job_id, "staged {} dataset(s)", options.stage_in.len());
                job.set_ready();
                self.persist(&job).await;
            }
            Ok(Err(e)) => {
                tracing::warn!(job_id, "{e}");
                job.cancel.cancel();
                job.set_failed(e);
            }
            Err(_) => {
                job.cancel.cancel();
                job.set_failed(format!(
                    "stage-in on node {node} did not finish within {} (the admin's stage timeout); {}",
                    humantime::format_duration(limit),
                    progress_summary(&job)
                ));
            }
        }
    }

    /// Writes the job's current record to the journal (errors are logged: the in-memory state stays
    /// authoritative until the next successful write).
    pub(crate) async fn persist(&self, job: &Job) {
        if self.replaced(job) {
            return;
        }
        let record = JobRecord {
            version: RECORD_VERSION,
            start: job.start.clone(),
            started_at: job.started_at,
            ready: job.state() == JobState::Ready,
            ended: job.is_ended(),
            archive_url: job.archive_url.clone().ok().flatten(),
            ckpts: job
                .ckpts
                .entries()
                .iter()
                .map(|e| CkptRecord {
                    tag: e.tag.clone(),
                    committed_at: e.committed_at,
                    archived_at: e.archived_at(),
                    on_hot: e.on_hot(),
                })
                .collect(),
        };
        let journal = self.journal.clone();
        if let Err(e) = blocking(move || journal.save(&record)).await {
            tracing::error!(job_id = job.start.job_id, "{e}");
        }
    }

    /// Whether a newer run of the same job id took this job's place in the table (a requeue): the
    /// old run must no longer touch `jobs/<id>` or the journal record `<id>.json`.
    pub(crate) fn replaced(&self, job: &Job) -> bool {
        self.jobs()
            .get(&job.start.job_id)
            .is_some_and(|current| !std::ptr::eq(&**current, job))
    }

    /// Forgets a finished job on disk (its journal record).
    pub(crate) async fn forget(&self, job_id: JobId) {
        let journal = self.journal.clone();
        if let Err(e) = blocking(move || journal.remove(job_id)).await {
            tracing::error!(job_id, "{e}");
        }
    }

    /// Ends a job on this node: stops staging, removes the staged data at once, then gives pending
    /// checkpoint archives up to `ckpt.epilog_wait`; the checkpoint worker finishes the rest (trim,
    /// removal of the job directory) in the background.
    async fn job_end(self: &Arc<Self>, job_id: JobId) -> Response {
        let Some(job) = self.job(job_id) else {
            // Unknown (e.g. the agent lost its state): remove whatever the job left.
            let hot_root = self.cfg.hot_root.clone();
            let removed = blocking(move || {
                let root = safefs::open_root_dir(&hot_root)?;
                let jobs = safefs::open_dir(&root, "jobs")?;
                safefs::remove_tree(&jobs, &job_id.to_string())
            })
            .await;
            return match removed {
                Ok(_) => Response::Ok,
                Err(e) => reply(
                    ErrorCode::Internal,
                    format!(
                        "removing job {job_id}'s data on node {}: {e}",
                        self.cfg.node
                    ),
                ),
            };
        };
        job.cancel.cancel();
        job.ended.store(true, std::sync::atomic::Ordering::Relaxed);
        // Staged data goes now, in a task of its own so that it finishes even if the epilog gives up.
        let hot_root = self.cfg.hot_root.clone();
        let removed = self
            .tracker
            .spawn(blocking(move || {
                let root = safefs::open_root_dir(&hot_root)?;
                let jobs = safefs::open_dir(&root, "jobs")?;
                // The checkpoint worker may be removing the whole job directory meanwhile: what is
                // already gone is removed.
                let gone = |e: &safefs::SafeFsError| e.errno() == Some(nix::errno::Errno::ENOENT);
                match safefs::open_dir(&jobs, &job_id.to_string()) {
                    Ok(dir) => match safefs::remove_tree(&dir, "stage") {
                        Err(e) if gone(&e) => Ok(Default::default()),
                        other => other,
                    },
                    Err(e) if gone(&e) => Ok(Default::default()),
                    Err(e) => Err(e),
                }
            }))
            .await;
        match &removed {
            Ok(Ok(r)) => tracing::info!(job_id, "job ended; removed {} staged entries", r.entries),
            Ok(Err(e)) => tracing::error!(job_id, "removing staged data: {e}"),
            Err(e) => tracing::error!(job_id, "removing staged data: {e}"),
        }
        self.persist(&job).await;
        job.ckpts.wake.notify_one();
        // Wait (bounded) until the checkpoint worker finished: archives done and the job cleaned up.
        let mut rx = job.subscribe();
        let _ = tokio::time::timeout(
            self.cfg.ckpt.epilog_wait,
            rx.wait_for(|s| *s == JobState::Ended),
        )
        .await;
        match removed {
            Ok(Ok(_)) => Response::Ok,
            Ok(Err(e)) => reply(
                ErrorCode::Internal,
                format!(
                    "removing job {job_id}'s staged data on node {}: {e}",
                    self.cfg.node
                ),
            ),
            Err(e) => reply(ErrorCode::Internal, format!("cleanup task failed: {e}")),
        }
    }

    async fn wait_staged(&self, peer: Peer, job_id: JobId, timeout_ms: u64) -> Response {
        let job = match self.authorised_job(peer, job_id) {
            Ok(job) => job,
            Err(_) if self.job(job_id).is_none() => {
                return reply(
                    ErrorCode::NotFound,
                    format!(
                        "the sluice agent on node {} has no record of job {job_id}: the job's prolog could not hand it over (see slurmd's log on that node)",
                        self.cfg.node
                    ),
                );
            }
            Err(e) => return Response::Error(e),
        };
        let limit = Duration::from_millis(timeout_ms).min(MAX_WAIT);
        let mut rx = job.subscribe();
        let waited = tokio::time::timeout(limit, rx.wait_for(|s| *s != JobState::Staging)).await;
        let node = &self.cfg.node;
        match waited {
            Ok(Ok(state)) => match *state {
                JobState::Ready => Response::Ready(job.task_dirs()),
                JobState::Failed => reply(
                    ErrorCode::StageFailed,
                    job.error().unwrap_or_else(|| "stage-in failed".into()),
                ),
                JobState::Ended => reply(
                    ErrorCode::NotFound,
                    format!("job {job_id} already ended on node {node}"),
                ),
                JobState::Staging => unreachable!("wait_for returned a staging state"),
            },
            Ok(Err(_)) => reply(ErrorCode::Internal, "the job's state was dropped"),
            Err(_) => reply(
                ErrorCode::Timeout,
                format!(
                    "stage-in on node {node} did not finish within {} s ({}); the job stops here — raise the plugin's stage_timeout or stage less data",
                    limit.as_secs(),
                    progress_summary(&job)
                ),
            ),
        }
    }

    async fn status(&self, peer: Peer) -> NodeStatus {
        let mut jobs: Vec<_> = self
            .jobs()
            .values()
            .filter(|j| peer.is_root() || j.start.uid == peer.uid)
            .map(|j| j.status())
            .collect();
        jobs.sort_by_key(|j| j.job_id);
        let hot_used_bytes = jobs
            .iter()
            .filter(|j| j.state != JobState::Ended)
            .flat_map(|j| j.stages.iter())
            .map(|s| s.bytes_done)
            .sum();
        let root = self.cfg.hot_root.clone();
        let (total, free) = blocking(move || {
            nix::sys::statvfs::statvfs(&root)
                .map(|s| {
                    (
                        s.blocks() * s.fragment_size(),
                        s.blocks_available() * s.fragment_size(),
                    )
                })
                .unwrap_or((0, 0))
        })
        .await;
        NodeStatus {
            node: self.cfg.node.clone(),
            agent_version: env!("CARGO_PKG_VERSION").to_string(),
            hot_root: self.cfg.hot_root.display().to_string(),
            hot_total_bytes: total,
            hot_free_bytes: free,
            hot_used_bytes,
            jobs,
        }
    }
}

/// True when Slurm says the job is no longer running (unknown to it, or finished). Any doubt
/// (squeue missing, slurmctld unreachable) counts as running: cleaning up a running job's data
/// would be far worse than a late cleanup.
async fn slurm_job_gone(squeue: &std::path::Path, job_id: JobId) -> bool {
    let out = tokio::time::timeout(
        Duration::from_secs(15),
        tokio::process::Command::new(squeue)
            .args([
                "--noheader",
                "--jobs",
                &job_id.to_string(),
                "--format",
                "%T",
            ])
            .stdin(std::process::Stdio::null())
            .output(),
    )
    .await;
    let Ok(Ok(out)) = out else { return false };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        return stderr.contains("Invalid job id");
    }
    let state = stdout.trim();
    state.is_empty()
        || matches!(
            state,
            "COMPLETED"
                | "COMPLETING"
                | "FAILED"
                | "CANCELLED"
                | "TIMEOUT"
                | "NODE_FAIL"
                | "OUT_OF_MEMORY"
                | "BOOT_FAIL"
                | "DEADLINE"
                | "PREEMPTED"
        )
}

/// Where each dataset's staging stands, for timeout messages.
fn progress_summary(job: &Job) -> String {
    let parts: Vec<String> = job
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

/// Shape checks on a JobStart beyond what serde does: it comes from root, but from a process that
/// read user-controlled environment.
fn check_job_start(s: &JobStart) -> Result<(), String> {
    if s.user.is_empty()
        || s.user.len() > 64
        || !s
            .user
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '$'))
    {
        return Err(format!("invalid user name {:?}", s.user));
    }
    if s.uid == 0 {
        return Err("sluice does not stage data for root jobs".into());
    }
    if s.options.len() > MAX_OPTION_PAIRS {
        return Err(format!(
            "{} option values; at most {MAX_OPTION_PAIRS} are accepted",
            s.options.len()
        ));
    }
    if s.nodes.len() > 65536 || s.nodes.iter().any(|n| n.is_empty() || n.len() > 255) {
        return Err("invalid node list".into());
    }
    Ok(())
}

/// Creates `<hot>/jobs/<id>/{stage,ckpt}` owned by the job user. A fresh start removes anything a
/// previous run of the same job id left (a requeued job must not trust stale data); a recovery keeps
/// `ckpt` and re-creates only `stage`.
fn prepare_job_dirs(
    hot_root: &std::path::Path,
    job_id: JobId,
    owner: Owner,
    fresh: bool,
) -> Result<(OwnedFd, OwnedFd), safefs::SafeFsError> {
    let root = safefs::open_root_dir(hot_root)?;
    let jobs = safefs::open_dir(&root, "jobs")?;
    let name = job_id.to_string();
    let job_dir = if fresh {
        safefs::remove_tree(&jobs, &name)?;
        safefs::create_dir(&jobs, &name, Some(owner), 0o700)?
    } else {
        safefs::ensure_dir(&jobs, &name, Some(owner), 0o700)?
    };
    safefs::remove_tree(&job_dir, "stage")?;
    let stage = safefs::create_dir(&job_dir, "stage", Some(owner), 0o755)?;
    let ckpt = safefs::ensure_dir(&job_dir, "ckpt", Some(owner), 0o755)?;
    Ok((stage, ckpt))
}

/// Names of the groups `user` belongs to (for the archive allow-list). Empty if unknown.
fn user_groups(user: &str, gid: u32) -> Vec<String> {
    let Ok(name) = std::ffi::CString::new(user) else {
        return Vec::new();
    };
    nix::unistd::getgrouplist(&name, nix::unistd::Gid::from_raw(gid))
        .unwrap_or_default()
        .into_iter()
        .filter_map(|g| {
            nix::unistd::Group::from_gid(g)
                .ok()
                .flatten()
                .map(|g| g.name)
        })
        .collect()
}

fn prune_ended(jobs: &mut HashMap<JobId, Arc<Job>>) {
    let mut ended: Vec<_> = jobs
        .values()
        .filter(|j| j.state() == JobState::Ended)
        .map(|j| (j.started_at, j.start.job_id))
        .collect();
    if ended.len() > KEEP_ENDED {
        ended.sort();
        for (_, id) in &ended[..ended.len() - KEEP_ENDED] {
            jobs.remove(id);
        }
    }
}
