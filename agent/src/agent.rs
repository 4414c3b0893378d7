//! The agent's engine: the jobs on this node and what each request does to them.
//!
//! Authorisation happens here, from the peer credentials the server read off the socket — never from
//! anything inside a message. Root (the plugin's prolog/epilog, an admin) may do everything; a user may
//! wait for and look at their own jobs only.
//!
//! The parts it drives own their state: [`HotTier`] the directory layout, [`Policy`] who may stage or
//! archive what, [`sluice_stage`] the downloads and their budget, [`crate::ckpt`] the checkpoints
//! (commit, the per-job [`CkptWorker`], restore, retention), [`JobTable`] the jobs and what of them
//! survives a restart, and [`Workers`] the background loops. `Agent` dispatches requests.

use crate::archive_access::ArchiveAccess;
use crate::ckpt::{self, CkptCtx, CkptEntry, CkptWorker, CommitError};
use crate::hot_tier::{HotTier, HotTierError};
use crate::job::{self, Job};
use crate::job_table::JobTable;
use crate::journal::{CkptRecord, JobRecord, JournalError, RECORD_VERSION};
use crate::policy::{Policy, PolicyError, Requester};
use crate::replica_area::ReplicaArea;
use sluice_core::config::Config;
use sluice_core::rt::{blocking, lock, now_secs};
use sluice_core::safefs::{self, Owner, SafeFsError};
use sluice_core::worker::{StatusCell, Worker, WorkerStatus, Workers};
use sluice_proto::msg::{
    ErrorCode, ErrorReply, JobId, JobStart, JobState, NodeStatus, Request, Response,
};
use sluice_proto::options::{self, StageMode, StageTier};
use sluice_stage::{self as stage, JobPeers, NodePeers, ShardPlan, Sharing, StageCtx};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

mod setup;
mod step;

use setup::SetupError;

pub use crate::identity::Peer;
use crate::identity::{JobIdentity, squeue_job};

/// Longest a task may ask to wait for staging.
const MAX_WAIT: Duration = Duration::from_secs(48 * 3600);
/// Most `(name, value)` option pairs accepted in one JobStart.
const MAX_OPTION_PAIRS: usize = 32;
/// Longest `sluice ckpt commit` waits for the archive to take the commit's notice (the CLI gives
/// the agent 10 s to answer).
const ANNOUNCE_WAIT: Duration = Duration::from_secs(3);
/// When a notice still not taken is given up (the worker notes the commit again before uploading).
const ANNOUNCE_GIVE_UP: Duration = Duration::from_secs(120);

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    HotTier(#[from] HotTierError),
    #[error(transparent)]
    Journal(#[from] JournalError),
    #[error("cannot find the running sluiced binary for copy-as-user: {0}")]
    HelperExe(#[source] std::io::Error),
    #[error(transparent)]
    Metrics(#[from] crate::metrics::MetricsError),
    #[error(transparent)]
    Cache(#[from] sluice_stage::cache::CacheError),
}

fn reply(code: ErrorCode, message: impl Into<String>) -> Response {
    Response::Error(ErrorReply::new(code, message))
}

pub struct Agent {
    cfg: Arc<Config>,
    hot: HotTier,
    policy: Policy,
    /// The jobs on this node and their journal, shared with the checkpoint workers and the metrics.
    jobs: Arc<JobTable>,
    /// The node-wide stage-in download budget (`stage.concurrency`, `stage.memory`), shared by all jobs.
    stage_budget: Arc<stage::Budget>,
    /// What the checkpoint workers, restores and commits use: the job table, the hot tier, the
    /// node's upload bandwidth and memory, the metrics.
    ckpt: Arc<CkptCtx>,
    /// The `sluiced` binary that runs `copy-as-user`.
    helper_exe: PathBuf,
    /// The agent's one cancellation: every job's token and every worker's is a child of it.
    cancel: CancellationToken,
    /// Every task the agent starts (requests, staging, workers), waited for when it stops.
    tracker: TaskTracker,
    workers: Arc<Workers>,
    /// What the Prometheus endpoint counts (recorded whether or not `[metrics]` serves it).
    pub(crate) metrics: crate::metrics::Metrics,
    /// Peer transfers with the other agents of multi-node jobs (`[peer]`), once started.
    peers: OnceLock<NodePeers>,
    /// The cross-job cache (`[cache]`).
    cache: Option<Arc<sluice_stage::cache::Cache>>,
    /// The RAM tier for `--ckpt-tier=ram` (`[fast_tier]`).
    ram: Option<Arc<crate::ram_tier::RamTier>>,
    /// Other nodes' replicas of their checkpoint parts (`[fast_tier] replicas`), once peers start.
    replicas: OnceLock<Arc<ReplicaArea>>,
    /// Users' requests on their archives, through this agent's places.
    pub(crate) archive_access: ArchiveAccess,
}

impl Agent {
    /// Prepares the hot tier and opens the journal. Nothing runs until [`Agent::recover`].
    pub(crate) fn new(
        cfg: Arc<Config>,
        helper_exe: PathBuf,
        cancel: CancellationToken,
        tracker: TaskTracker,
    ) -> Result<Arc<Agent>, AgentError> {
        let hot = HotTier::open(&cfg.hot_root, cfg.ckpt.high_water)?;
        let jobs = Arc::new(JobTable::open(&cfg.state_dir)?);
        let cache = sluice_stage::cache::Cache::open(&cfg)?;
        let ram = cfg
            .fast_tier
            .clone()
            .map(|f| Arc::new(crate::ram_tier::RamTier::new(f, &cfg.node)));
        let metrics = crate::metrics::Metrics::default();
        let ckpt = Arc::new(CkptCtx::new(
            cfg.clone(),
            hot.clone(),
            jobs.clone(),
            metrics.clone(),
        ));
        Ok(Arc::new(Agent {
            cache,
            ram,
            hot,
            policy: Policy::new(&cfg),
            stage_budget: stage::Budget::new(&cfg.stage),
            ckpt,
            jobs,
            helper_exe,
            workers: Arc::new(Workers::new(tracker.clone(), cancel.clone())),
            metrics,
            peers: OnceLock::new(),
            replicas: OnceLock::new(),
            archive_access: ArchiveAccess::new(cfg.clone()),
            cancel,
            tracker,
            cfg,
        }))
    }

    /// Starts serving peers (the job's other nodes fetch units of its datasets from this node) and
    /// shares the datasets of multi-node jobs (object stores and POSIX sources) from now on. Call before
    /// [`Agent::recover`], so that recovered jobs are shared too.
    pub(crate) fn start_peers(
        &self,
        mut peers: NodePeers,
        service: impl sluice_core::worker::Worker,
    ) {
        peers.share_cache(self.cache.clone());
        peers.serve_warm(stage::WarmHere {
            cfg: self.cfg.clone(),
            budget: self.stage_budget.clone(),
            cache: self.cache.clone(),
            cancel: self.cancel.clone(),
        });
        let _ = self.ckpt.peers.set(peers.replica_peers());
        peers.serve_events(Arc::new(ckpt::CommitNotices {
            jobs: self.jobs.clone(),
        }));
        // Other nodes' replicas of RAM-tier checkpoints (`[fast_tier] replicas`), on the peer port.
        if let Some(ft) = self.cfg.fast_tier.as_ref().filter(|f| f.max_replicas > 0) {
            let dir = ft.root.join("replicas");
            match ReplicaArea::open(&dir, ft.replica_room, ft.mount) {
                Ok(area) => {
                    let area = Arc::new(area);
                    // The area's parts, and this node's own parts of its jobs' checkpoints.
                    peers.serve_replicas(Arc::new(ckpt::NodeReplicas {
                        area: area.clone(),
                        ckpt: self.ckpt.clone(),
                    }));
                    let _ = self.replicas.set(area);
                }
                Err(e) => tracing::error!(
                    "this node takes no replicas of other nodes' checkpoints ({}): {e}",
                    dir.display()
                ),
            }
        }
        if self.peers.set(peers).is_ok() {
            self.workers.spawn(service);
        }
    }

    /// Starts a task the agent waits for when it stops.
    pub(crate) fn spawn<T: Send + 'static>(
        &self,
        task: impl std::future::Future<Output = T> + Send + 'static,
    ) -> tokio::task::JoinHandle<T> {
        self.tracker.spawn(task)
    }

    /// Whether a recovered RAM job's tmpfs root (`None`: a record from before roots were kept) is
    /// under this agent's `[fast_tier]`.
    fn is_own_ram_root(&self, root: Option<&std::path::Path>) -> bool {
        match (&self.ram, root) {
            (Some(tier), Some(root)) => tier.config().root == root,
            (Some(_), None) => true,
            (None, _) => false,
        }
    }

    /// The state the metrics endpoint reads at each scrape.
    pub(crate) fn metrics_snapshot(&self) -> crate::metrics::Snapshot {
        crate::metrics::Snapshot::new(
            self.jobs.clone(),
            self.hot.clone(),
            self.cfg.clone(),
            self.cache.clone(),
            self.workers.clone(),
        )
    }

    /// Tasks the agent runs now: requests, set-ups, workers.
    pub fn tasks_in_flight(&self) -> usize {
        self.tracker.len()
    }

    /// What the background loops are doing (`sluice status`, the metrics).
    pub fn worker_statuses(&self) -> Vec<WorkerStatus> {
        self.workers.statuses()
    }

    /// Resumes the jobs recorded in the journal: staging that was cut short resumes — of its
    /// datasets on this node's hot tier, the files the staging log shows staged whole (of the
    /// object version the origin lists now, or from a POSIX source file still at the version
    /// copied, and unchanged since) are kept and the rest is read again ([`stage::resume`]); POSIX
    /// datasets shared with peers or through the cache, and the shared tier, start again. Jobs that
    /// were already staged stay as they are (their tasks may be using the data); pending
    /// checkpoint archives continue. Starts housekeeping.
    pub(crate) fn recover(self: &Arc<Self>) -> Result<usize, AgentError> {
        let (records, bad) = self.jobs.load()?;
        for e in bad {
            tracing::error!("{e}; left in place for inspection");
        }
        // Staging logs are read for jobs still staging (to resume) or staged and running (to
        // serve their peers); the rest are of jobs ended or forgotten while the agent was down.
        let staging = records
            .iter()
            .filter(|r| !r.ended)
            .map(|r| r.start.job_id)
            .collect();
        let pruned = stage::resume::prune(&self.cfg.state_dir, &staging);
        if pruned > 0 {
            tracing::info!(pruned, "removed the staging logs of jobs no longer staging");
        }
        let n = records.len();
        self.workers.spawn(Housekeeper {
            agent: self.clone(),
        });
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
                drop(self.spawn(async move {
                    if slurm_job_gone(&squeue, job_id).await {
                        tracing::info!(
                            job_id,
                            "the job ended while the agent was down; cleaning up"
                        );
                        this.job_end(job_id).await;
                    }
                }));
            }
        }
        Ok(n)
    }

    /// Answers one request. What it logs about a job it knows carries the job's id and user (the
    /// job's span), like the job's staging and checkpoint work.
    pub async fn handle(self: &Arc<Self>, peer: Peer, request: Request) -> Response {
        let job_id = match &request {
            Request::JobEnd { job_id }
            | Request::WaitStaged { job_id, .. }
            | Request::Job { job_id }
            | Request::CkptCommit { job_id, .. }
            | Request::CkptPoison { job_id, .. }
            | Request::CkptList { job_id } => Some(*job_id),
            Request::JobStart(start) => Some(start.job_id),
            _ => None,
        };
        let span = job_id
            .and_then(|id| self.jobs.get(id))
            .map_or_else(tracing::Span::none, |job| job.span());
        self.answer(peer, request).instrument(span).await
    }

    async fn answer(self: &Arc<Self>, peer: Peer, request: Request) -> Response {
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
            Request::WaitStaged {
                job_id,
                timeout_ms,
                step,
            } => {
                let limit = Duration::from_millis(timeout_ms).min(MAX_WAIT);
                let step_plan = match step {
                    Some(step) => match self.stage_step(peer, job_id, *step, limit).await {
                        Ok(plan) => plan,
                        Err(refused) => return Response::Error(refused),
                    },
                    None => None,
                };
                match self.wait_staged(peer, job_id, timeout_ms).await {
                    // A step that sharded its own datasets: its tasks' place among its nodes.
                    Response::Ready(mut dirs) if step_plan.is_some() => {
                        dirs.env = step_plan.map(|p| p.env()).unwrap_or_default();
                        Response::Ready(dirs)
                    }
                    other => other,
                }
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
            Request::CkptPoison {
                job_id,
                tag,
                reason,
            } => match self.authorised_job(peer, job_id) {
                Ok(job) => self.ckpt_poison(peer, &job, &tag, &reason).await,
                Err(e) => Response::Error(e),
            },
            Request::ArchivePoison { url, tag, reason } => {
                let request = Request::ArchivePoison {
                    url,
                    tag: tag.clone(),
                    reason,
                };
                let answer = self.archive_access.handle(peer, request, None).await;
                if let Response::Poisoned(p) = &answer {
                    self.note_poisoned(&p.url, &tag).await;
                }
                answer
            }
            // The socket server sends these there itself, with the restore directory passed.
            r @ (Request::ArchiveList { .. }
            | Request::ArchiveVerify { .. }
            | Request::ArchiveRestore { .. }) => self.archive_access.handle(peer, r, None).await,
            r @ (Request::CacheList { .. }
            | Request::CacheWarm { .. }
            | Request::CacheWarmNodes { .. }
            | Request::CacheEvict { .. }) => self.cache_request(peer, r).await,
        }
    }

    fn authorised_job(&self, peer: Peer, job_id: JobId) -> Result<Arc<Job>, ErrorReply> {
        let job = self.jobs.get(job_id).ok_or_else(|| {
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
        if let Err(e) = check_job_start(&start) {
            return reply(ErrorCode::BadRequest, e.to_string());
        }
        if start.node != self.cfg.node {
            tracing::warn!(
                job_id = start.job_id,
                "job start for node {} reached the agent of node {}",
                start.node,
                self.cfg.node
            );
        }
        if let Some(existing) = self.jobs.get(start.job_id)
            && !existing.has_ended()
            && existing.start == start
        {
            return Response::Ok; // a repeated prolog: idempotent
        }
        let archive_url = self.apply_policy(&start).await;
        // A new run of the same job id on this node (a requeue): its record carries the run
        // before's checkpoints that are still here from its first write on, so that an agent
        // killed at any point of the new run's start still knows them.
        let inherited = self
            .jobs
            .get(start.job_id)
            .map(|old| Inherited::from(&old))
            .unwrap_or_default();
        let record = JobRecord {
            version: RECORD_VERSION,
            start,
            started_at: now_secs(),
            ready: false,
            ended: false,
            archive_url: archive_url.clone().ok().flatten(),
            ckpts: inherited.ckpts,
            step_stage_in: Vec::new(),
            from_step: false,
            ram: inherited.ram_root.is_some(),
            ram_root: inherited.ram_root,
        };
        if let Err(e) = self.jobs.save(&record).await {
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

    /// The site's policy for a starting job: its object-store sources must be allowed, and its
    /// archive URL is resolved (`Err`: refused, with the reason the job will show). Options that do
    /// not parse are reported when the job is set up.
    async fn apply_policy(&self, start: &JobStart) -> Result<Option<String>, PolicyError> {
        let Ok(opts) = job::parse_options(start) else {
            return Ok(None);
        };
        // `start` is root's or was stamped with a verified identity ([`JobIdentity::stamp`]).
        let (id, job_id) = (JobIdentity::announced_by_root(start), start.job_id);
        let who = blocking(move || Requester::of(&id, job_id)).await;
        self.policy.check_stage(&who, &opts)?;
        let requested = opts
            .ckpt_archive
            .as_deref()
            .map(options::parse_ckpt_archive)
            .transpose()
            .map_err(|e| PolicyError::BadArchive(e.to_string()))?;
        self.policy.archive_url(&who, requested.as_deref())
    }

    /// Puts a job in the table; starts its staging and restore (unless a recovered job was already
    /// staged or ended) and its checkpoint worker.
    fn register(
        self: &Arc<Self>,
        record: JobRecord,
        archive_url: Result<Option<String>, PolicyError>,
        fresh_dirs: bool,
    ) {
        let start = record.start.clone();
        let mut dirs = self.hot.task_dirs(start.job_id);
        if let (Some(shared), Ok(o)) = (&self.cfg.shared_tier, crate::job::parse_options(&start))
            && o.stage_tier == StageTier::Shared
        {
            dirs.stage_dir = stage::shared::stage_dir(shared, start.job_id)
                .display()
                .to_string();
        }
        // The RAM tier: a recovered job keeps what it had, and so does a requeued one whose run
        // before left checkpoints in it (its record says so: [`Inherited`]); a new one gets a
        // share if one is free, else the hot tier with a note (a job without [fast_tier] is
        // refused at set-up).
        let wants_ram = matches!(crate::job::parse_options(&start), Ok(o) if o.ckpt_tier == options::CkptTier::Ram);
        let mut ram_note = None;
        if record.ram && fresh_dirs && !wants_ram {
            ram_note = Some(
                "the run before this one left checkpoints on the RAM tier: this run keeps it as $SLUICE_CKPT_DIR until they are safe on NVMe".to_string(),
            );
        }
        let mut ram_tier = None;
        let ram = match &self.ram {
            _ if record.ram && !self.is_own_ram_root(record.ram_root.as_deref()) => {
                // Recovered by an agent whose config lost that RAM tier: its checkpoints are
                // flushed from where the record says its tmpfs is (gone: the worker says so).
                let tier = crate::ram_tier::RamTier::stray(record.ram_root.clone(), &self.cfg.node);
                tracing::warn!(
                    job_id = start.job_id,
                    ram_root = %tier.config().root.display(),
                    "the job's checkpoints are on a RAM tier this agent's [fast_tier] does not name; they are flushed from there"
                );
                dirs.ckpt_dir = tier.ckpt_dir(start.job_id).display().to_string();
                ram_tier = Some(Arc::new(tier));
                true
            }
            // An ended job with nothing left in RAM (finished, retained on the hot tier for its
            // archive or its retention) takes no share of the node's RAM tier: new jobs would be
            // sent to NVMe for it after every agent restart. Its directory, if any is left, still
            // goes at its end.
            Some(tier)
                if !fresh_dirs
                    && record.ended
                    && record.ram
                    && record.ckpts.iter().all(|c| !c.in_ram) =>
            {
                dirs.ckpt_dir = tier.ckpt_dir(start.job_id).display().to_string();
                ram_tier = Some(tier.clone());
                true
            }
            Some(tier) if record.ram || (wants_ram && fresh_dirs) => {
                match tier.reserve(start.job_id, record.ram) {
                    Ok(()) => {
                        dirs.ckpt_dir = tier.ckpt_dir(start.job_id).display().to_string();
                        ram_tier = Some(tier.clone());
                        true
                    }
                    Err(e) => {
                        ram_note = Some(format!(
                            "--ckpt-tier=ram: {e}; this job's checkpoints go to the NVMe hot tier instead ($SLUICE_CKPT_DIR={})",
                            dirs.ckpt_dir
                        ));
                        false
                    }
                }
            }
            _ => false,
        };
        let job = Arc::new(Job::new(
            start.clone(),
            dirs,
            record.started_at,
            archive_url,
            self.cfg.ckpt.keep,
            self.cancel.child_token(),
        ));
        job.ram.store(ram, std::sync::atomic::Ordering::Relaxed);
        if let (Some(tier), Ok(options)) = (&self.ram, &job.options) {
            let asked = job::replicas_asked(options, tier.config());
            job.hot_replicas
                .store(asked, std::sync::atomic::Ordering::Relaxed);
        }
        if let Some(tier) = ram_tier {
            let _ = job.ram_tier.set(tier);
        }
        if let Some(note) = ram_note {
            tracing::warn!(job_id = start.job_id, "{note}");
            job.add_stage_notes(vec![note]);
        }
        for c in &record.ckpts {
            let entry = Arc::new(CkptEntry::new(&c.tag, c.committed_at));
            if let Some(at) = c.archived_at {
                entry.set_archived(at);
            }
            entry.set_on_hot(c.on_hot);
            entry.set_in_ram(c.in_ram);
            entry.set_flush_hashes(c.flush_blake3.as_ref().map(|h| {
                h.iter()
                    .filter_map(|(p, x)| Some((p.clone(), blake3::Hash::from_hex(x).ok()?)))
                    .collect()
            }));
            if let Some(message) = &c.lost {
                entry.lose(message.clone());
            }
            if c.poisoned {
                entry.set_poisoned();
            }
            {
                let mut r = entry.replication();
                r.part = c.replica_part.clone().map(Arc::new);
                r.generation = entry.generation();
            }
            job.ckpts.insert(entry);
        }
        if record.ended {
            job.mark_ended();
        }
        job.from_step
            .store(record.from_step, std::sync::atomic::Ordering::Relaxed);
        for spec in &record.step_stage_in {
            let (state, _) = tokio::sync::watch::channel(job::ExtraState::Done);
            let progress = Arc::new(stage::Progress::new(spec));
            lock(&job.extras).insert(
                spec.name.clone(),
                Arc::new(job::Extra {
                    spec: spec.clone(),
                    progress,
                    state,
                }),
            );
        }
        // A run before of the same job id (a requeue) is finished here; what of its checkpoints
        // is still here, the new run's record carries ([`Inherited`]).
        self.jobs.insert(job.clone());
        if record.ready || record.ended {
            // Staged before a restart: the hashes of what this node read went with the agent.
            // Its peers still staging are told at once (not after the join grace) that it knows
            // nothing yet; a job that still runs then serves the files its staging logs name, with
            // hashes read back from them ([`Agent::serve_staged`]). (A job restarted mid-stage is
            // set up again below, and serves the files it keeps the same way: `stage::resume`.)
            if let Some(peers) = self.peers.get() {
                peers.leave(start.job_id);
            }
            if record.ready && !record.ended {
                self.serve_staged(&job);
            }
            // Its tmpfs, set up by an agent before they were private: closed to other users now.
            if let Some(tier) = self.ckpt.dirs(&job).ram().cloned() {
                let (id, owner) = (
                    start.job_id,
                    Owner {
                        uid: start.uid,
                        gid: start.gid,
                    },
                );
                drop(self.spawn(blocking(move || {
                    if let Err(e) = tier.make_private(id, owner) {
                        tracing::warn!(job_id = id, "making the job's RAM tier private: {e}");
                    }
                })));
            }
            job.set_ready();
        } else {
            let (this, j) = (self.clone(), job.clone());
            let span = job.span();
            drop(
                self.spawn(
                    async move {
                        let done = sluice_core::rt::contained(this.set_up(&j, fresh_dirs));
                        let done = done.await.unwrap_or_else(|bug| {
                            Err(SetupError::Bug {
                                node: this.cfg.node.clone(),
                                bug,
                            })
                        });
                        if let Err(e) = done {
                            this.metrics.set_up_done(&j);
                            this.metrics.failure(e.operation(), e.code());
                            tracing::warn!(job_id = j.start.job_id, "{e}");
                            j.cancel.cancel();
                            j.set_failed(e);
                        }
                    }
                    .instrument(span),
                ),
            );
        }
        self.workers.spawn(CkptWorker::new(self.ckpt.clone(), job));
    }

    /// After a restart, a job recovered staged and still running (`--stage-mode=replicate` on the
    /// hot tier, shared with its peers): its other nodes may still be staging, and ask this node
    /// for the units it owns of the job's object-store datasets. It serves those of the files its
    /// staging logs name that are still as staged, hashed again from the files
    /// ([`stage::resume::serve_staged`]); any other unit is answered "not mine" and read from the
    /// origin by the node that asks.
    fn serve_staged(self: &Arc<Self>, job: &Arc<Job>) {
        let (Some(node_peers), Ok(options)) = (self.peers.get(), job.options.clone()) else {
            return;
        };
        if options.stage_mode != StageMode::Replicate || options.stage_tier != StageTier::Local {
            return;
        }
        let specs: Vec<_> = options
            .stage_in
            .iter()
            .filter(|s| s.source.bucket_url().is_some())
            .cloned()
            .collect();
        if specs.is_empty() {
            // POSIX datasets only: no staging log names their files (see `stage::resume`).
            return;
        }
        let datasets: Vec<String> = specs.iter().map(|s| s.source.to_string()).collect();
        let job_id = job.start.job_id;
        let owner = Owner {
            uid: job.start.uid,
            gid: job.start.gid,
        };
        let Some(peers) = node_peers.join(job_id, &job.start.nodes, owner, 1, &datasets) else {
            return;
        };
        let (hot, state_dir) = (self.hot.clone(), self.cfg.state_dir.clone());
        let span = job.span();
        let serve = async move {
            let peers = ClosePeers(Some(peers));
            let stage = match blocking(move || hot.open_stage(job_id)).await {
                Ok(fd) => Arc::new(fd),
                Err(e) => {
                    tracing::warn!(job_id, "the job's stage directory: {e}; serving none of it");
                    return;
                }
            };
            let open = move || stage::resume::JobResume::open(&state_dir, job_id, true);
            let resume = Arc::new(blocking(open).await);
            let jp = peers.0.as_ref().expect("joined");
            let (files, bytes) = stage::resume::serve_staged(jp, resume, specs, stage, owner).await;
            tracing::info!(
                job_id,
                files,
                bytes,
                "serving the job's other nodes what this node staged before the agent restarted"
            );
        };
        drop(self.spawn(serve.instrument(span)));
    }

    /// `sluice ckpt commit TAG`: record the commit and wake the job's checkpoint worker.
    async fn ckpt_commit(&self, job: &Arc<Job>, tag: &str) -> Response {
        let committed = if job.has_ended() {
            Err(CommitError::JobEnded(job.start.job_id))
        } else {
            ckpt::commit(&self.ckpt, job, tag).await
        };
        if let Err(e) = committed {
            return reply(ErrorCode::BadRequest, e.to_string());
        }
        // The job's other nodes commit their parts too: told over the peer port at once (with
        // replicas), and through the archive below.
        if let Some(notices) = ckpt::announce(&self.ckpt, job, tag) {
            drop(self.spawn(notices));
        }
        let Some(url) = job.archive_url() else {
            return reply(
                ErrorCode::BadRequest,
                format!(
                    "checkpoint {tag} is committed but will not be archived: the job has no --ckpt-archive and the site sets no default"
                ),
            );
        };
        // The job's other nodes learn of the commit from the archive: note it there before the
        // command returns, so a job that ends right after its last commit still has every node
        // answer it. In an outage the store's retries would hold the job's command for as long
        // as they take: it waits [`ANNOUNCE_WAIT`] at most, and the notice goes on in the
        // background (the checkpoint worker notes it again before uploading; with replicas the
        // peer notice above has told the other nodes already).
        if job.start.nodes.len() > 1 {
            let (cfg, url, id, t) = (
                self.cfg.clone(),
                url.to_string(),
                job.start.job_id,
                tag.to_string(),
            );
            let announce = self.spawn(async move {
                let announced = match sluice_archive::open_archive(&cfg, &url) {
                    Ok(a) => {
                        let for_job = a.for_job(id);
                        let notice = for_job.announce_commit(&t, &cfg.node);
                        match tokio::time::timeout(ANNOUNCE_GIVE_UP, notice).await {
                            Ok(r) => r.map_err(|e| e.to_string()),
                            Err(_) => {
                                Err(format!("no answer within {}s", ANNOUNCE_GIVE_UP.as_secs()))
                            }
                        }
                    }
                    Err(e) => Err(e.to_string()),
                };
                if let Err(e) = announced {
                    tracing::warn!(job_id = id, tag = t, "announcing the commit: {e}");
                }
            });
            if tokio::time::timeout(ANNOUNCE_WAIT, announce).await.is_err() {
                tracing::info!(
                    job_id = job.start.job_id,
                    tag,
                    "the archive is slow to take the commit's notice: answered the job, the notice goes on"
                );
            }
        }
        Response::Ok
    }

    /// `sluice ckpt poison TAG` from inside the job: the mark at the job's archive, and the
    /// job's entry marked so that retention keeps a good checkpoint instead.
    async fn ckpt_poison(&self, peer: Peer, job: &Arc<Job>, tag: &str, reason: &str) -> Response {
        match self.archive_access.poison_job(peer, job, tag, reason).await {
            Ok(p) => {
                self.note_poisoned(job.archive_url().unwrap_or(&p.url), tag)
                    .await;
                Response::Poisoned(p)
            }
            Err(e) => Response::Error(e),
        }
    }

    /// Marks `tag` poisoned in the jobs on this node that archive to `url` (retention then keeps
    /// a good checkpoint of theirs on the hot tier rather than it).
    async fn note_poisoned(&self, url: &str, tag: &str) {
        for job in self.jobs.snapshot() {
            let Some(entry) = job.ckpts.get(tag) else {
                continue;
            };
            if job.archive_url() == Some(url) && !entry.is_poisoned() {
                entry.set_poisoned();
                self.jobs.persist(&job).await;
            }
        }
    }

    /// Ends a job on this node: stops staging, removes the staged data at once, then gives pending
    /// checkpoint archives up to `ckpt.epilog_wait`; the checkpoint worker finishes the rest (trim,
    /// removal of the job directory) in the background.
    async fn job_end(self: &Arc<Self>, job_id: JobId) -> Response {
        let node = &self.cfg.node;
        let Some(job) = self.jobs.get(job_id) else {
            // Unknown (e.g. its journal record could not be read): its staged data goes, but its
            // checkpoints may not be archived, so they stay for the admin (issue 10, defect 5).
            let hot = self.hot.clone();
            return match blocking(move || hot.remove_unknown_job(job_id)).await {
                Ok(false) => Response::Ok,
                Ok(true) => {
                    tracing::warn!(
                        job_id,
                        "job end for a job this agent has no record of: its staged data was \
                         removed; its checkpoint directory is kept (it may hold checkpoints that \
                         are not archived) — check it and remove it by hand"
                    );
                    Response::Ok
                }
                Err(e) => reply(
                    ErrorCode::Internal,
                    format!("removing job {job_id}'s data on node {node}: {e}"),
                ),
            };
        };
        job.mark_ended();
        // Peers get no more of its units from here (requests waiting for one are answered `gone`).
        if let Some(peers) = self.peers.get() {
            peers.leave(job_id);
        }
        // Staged data goes now, in a task of its own so that it finishes even if the epilog gives
        // up; on the shared tier the job's directory there too (every node of the job tries).
        let hot = self.hot.clone();
        let shared = self
            .cfg
            .shared_tier
            .clone()
            .filter(|_| matches!(&job.options, Ok(o) if o.stage_tier == StageTier::Shared));
        let state_dir = self.cfg.state_dir.clone();
        // Only the job user's and root's entries go: another user's files that the job's user
        // moved in stay where they are (issue 24, finding 7).
        let who = safefs::RemoveAs { uid: job.start.uid };
        let removed = self
            .spawn(blocking(move || {
                if let Err(e) = stage::resume::forget(&state_dir, job_id) {
                    tracing::warn!(job_id, "removing the job's staging logs: {e}");
                }
                let mut r = hot.remove_staged(job_id, who)?;
                if let Some(cfg) = shared {
                    match stage::shared::remove(&cfg, job_id, who) {
                        Ok(s) => {
                            (r.entries, r.skipped) = (r.entries + s.entries, r.skipped + s.skipped)
                        }
                        Err(e) => {
                            tracing::error!(job_id, "removing the job's shared-tier directory: {e}")
                        }
                    }
                }
                Ok::<_, SafeFsError>(r)
            }))
            .await;
        match &removed {
            Ok(Ok(r)) if r.skipped > 0 => tracing::warn!(
                job_id,
                removed = r.entries,
                skipped = r.skipped,
                "job ended; its staged data holds entries of other users (moved in by the job's \
                 user), left in place with the directories holding them — check them and remove \
                 them by hand"
            ),
            Ok(Ok(r)) => tracing::info!(job_id, "job ended; removed {} staged entries", r.entries),
            Ok(Err(e)) => tracing::error!(job_id, "removing staged data: {e}"),
            Err(e) => tracing::error!(job_id, "removing staged data: {e}"),
        }
        self.jobs.persist(&job).await;
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
                format!("removing job {job_id}'s staged data on node {node}: {e}"),
            ),
            Err(e) => reply(ErrorCode::Internal, format!("cleanup task failed: {e}")),
        }
    }

    async fn wait_staged(&self, peer: Peer, job_id: JobId, timeout_ms: u64) -> Response {
        let job = match self.authorised_job(peer, job_id) {
            Ok(job) => job,
            Err(_) if self.jobs.get(job_id).is_none() => {
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
                    job.progress_summary()
                ),
            ),
        }
    }

    /// `sluice cache list|warm|evict`: root's, like the cache's files.
    async fn cache_request(self: &Arc<Self>, peer: Peer, request: Request) -> Response {
        if !peer.is_root() {
            return reply(
                ErrorCode::Forbidden,
                "the cache is the node's, not a job's: sluice cache commands are for admins (run them as root)",
            );
        }
        if let Request::CacheWarmNodes { url, nodes } = request {
            if nodes.len() > sluice_proto::msg::WARM_NODES_LIMIT {
                return reply(
                    ErrorCode::BadRequest,
                    format!(
                        "{} nodes are more than one warm asks of ({} at most)",
                        nodes.len(),
                        sluice_proto::msg::WARM_NODES_LIMIT
                    ),
                );
            }
            let here = stage::WarmHere {
                cfg: self.cfg.clone(),
                budget: self.stage_budget.clone(),
                cache: self.cache.clone(),
                cancel: self.cancel.clone(),
            };
            let nodes = stage::warm_nodes(&here, self.peers.get(), &url, &nodes).await;
            return Response::CacheWarmedNodes { nodes };
        }
        let Some(cache) = self.cache.clone() else {
            return reply(
                ErrorCode::NotFound,
                format!(
                    "node {} has no cache: add a [cache] section to the agent's configuration",
                    self.cfg.node
                ),
            );
        };
        match request {
            Request::CacheList { prefix, entries } => {
                let mut listed = if entries {
                    cache.entries(prefix.as_deref())
                } else {
                    Vec::new()
                };
                let left_out = listed
                    .len()
                    .saturating_sub(sluice_proto::msg::CACHE_LIST_LIMIT);
                listed.truncate(sluice_proto::msg::CACHE_LIST_LIMIT);
                Response::Cache(sluice_proto::msg::CacheListing {
                    node: self.cfg.node.clone(),
                    stats: cache.stats(),
                    entries: listed,
                    left_out: left_out as u64,
                })
            }
            Request::CacheEvict { prefix, dry_run } => {
                Response::CacheEvicted(blocking(move || cache.evict_prefix(&prefix, dry_run)).await)
            }
            Request::CacheWarm { url } => {
                let (cfg, budget) = (self.cfg.clone(), self.stage_budget.clone());
                match stage::warm(cfg, budget, cache, self.cancel.child_token(), &url).await {
                    Ok(warmed) => Response::CacheWarmed(warmed),
                    Err(e) => reply(ErrorCode::StageFailed, e.to_string()),
                }
            }
            _ => unreachable!("only cache requests come here"),
        }
    }

    async fn status(&self, peer: Peer) -> NodeStatus {
        let mut jobs: Vec<_> = self
            .jobs
            .snapshot()
            .iter()
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
        // A user sees the node's own loops and their jobs' checkpoint workers: a worker's error
        // may name another user's archive.
        let workers = self
            .worker_statuses()
            .into_iter()
            .filter(|w| {
                peer.is_root()
                    || w.job_id
                        .is_none_or(|id| jobs.iter().any(|j| j.job_id == id))
            })
            .collect();
        let hot = self.hot.clone();
        let usage = blocking(move || hot.usage()).await;
        NodeStatus {
            node: self.cfg.node.clone(),
            agent_version: env!("CARGO_PKG_VERSION").to_string(),
            hot_root: self.hot.root().display().to_string(),
            hot_total_bytes: usage.total_bytes,
            hot_free_bytes: usage.free_bytes,
            hot_used_bytes,
            jobs,
            cache: self.cache.as_ref().map(|c| c.stats()),
            workers,
        }
    }
}

/// A job's peer state while its set-up runs: however the set-up ends (staged, failed, timed out,
/// cancelled), dropping it tells the job's other nodes that the units this node never got will not
/// come, so none of them waits for this node. Units it holds are served until the job ends.
struct ClosePeers(Option<Arc<JobPeers>>);

impl Drop for ClosePeers {
    fn drop(&mut self) {
        if let Some(p) = &self.0 {
            p.close("its set-up on that node ended");
        }
    }
}

/// Every `agent.housekeeping_interval` (a minute by default): ends the jobs learnt of from a step
/// that Slurm no longer runs, prunes old upload resume logs, and when the hot tier is above its
/// high-water mark, trims the checkpoints that ended jobs left on it (archived ones only, never a
/// job's newest archived one).
struct Housekeeper {
    agent: Arc<Agent>,
}

impl Worker for Housekeeper {
    fn name(&self) -> String {
        "housekeeping".into()
    }

    async fn run(self, cancel: CancellationToken, status: Arc<StatusCell>) {
        let period = self.agent.cfg.housekeeping_interval;
        let above = || {
            let hot = self.agent.hot.clone();
            blocking(move || hot.above_high_water())
        };
        loop {
            status.set("idle");
            tokio::select! {
                _ = tokio::time::sleep(period) => {}
                _ = cancel.cancelled() => return,
            }
            let dir = ckpt::resume_dir(&self.agent.cfg);
            match blocking(move || sluice_archive::prune_resume_logs(&dir, ckpt::RESUME_LOG_AGE))
                .await
            {
                Ok(0) => {}
                Ok(n) => tracing::info!(removed = n, "old upload resume logs removed"),
                Err(e) => tracing::warn!("pruning upload resume logs: {e}"),
            }
            self.agent.end_gone_step_jobs().await;
            self.agent.free_replicas_of_forgotten_jobs().await;
            // The cache gives way first: jobs' checkpoints matter more than later jobs' speed.
            if let Some(cache) = self.agent.cache.clone() {
                while above().await {
                    status.set("evicting cache entries");
                    let c = cache.clone();
                    if blocking(move || c.yield_space(1 << 30)).await == 0 {
                        break;
                    }
                }
            }
            if above().await {
                status.set("trimming");
                let mut ended: Vec<Arc<Job>> = self
                    .agent
                    .jobs
                    .snapshot()
                    .into_iter()
                    .filter(|j| j.has_ended())
                    .collect();
                ended.sort_by_key(|j| j.started_at);
                for job in &ended {
                    ckpt::trim(&self.agent.ckpt, job).await;
                }
                // Still above: the archived copies finished jobs keep go too, oldest job first.
                for job in ended.iter().filter(|j| j.is_finished()) {
                    if !above().await {
                        break;
                    }
                    ckpt::release(&self.agent.ckpt, job).await;
                }
            }
            status.turn(None);
        }
    }
}

impl Agent {
    /// Frees the replicas other nodes pushed here for jobs this node no longer knows (forgotten
    /// once finished): a requeue of the job would have registered it again.
    async fn free_replicas_of_forgotten_jobs(&self) {
        let Some(area) = self.replicas.get() else {
            return;
        };
        for job_id in area.jobs() {
            if self
                .jobs
                .get(job_id)
                .is_none_or(|j| j.forgotten.load(std::sync::atomic::Ordering::Relaxed))
            {
                let area = area.clone();
                blocking(move || area.free_job(job_id)).await;
                tracing::info!(job_id, "replicas of a job this node no longer knows freed");
            }
        }
    }
}

/// True when Slurm says the job is no longer running (unknown to it, or finished). Any doubt
/// (squeue missing, slurmctld unreachable) counts as running: cleaning up a running job's data
/// would be far worse than a late cleanup.
async fn slurm_job_gone(squeue: &std::path::Path, job_id: JobId) -> bool {
    let Some(out) = squeue_job(squeue, job_id, "%T").await else {
        return false;
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        // The one place the agent reads another program's message: squeue exits 1 both for a job
        // id it no longer knows and for a controller it cannot reach, and only its text tells them
        // apart. Anything else counts as running.
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

/// A JobStart that fails the shape checks beyond serde's.
#[derive(Debug, thiserror::Error)]
enum BadJobStart {
    #[error("invalid user name {0:?}")]
    User(String),
    #[error("sluice does not stage data for root jobs")]
    Root,
    #[error("{0} option values; at most {MAX_OPTION_PAIRS} are accepted")]
    TooManyOptions(usize),
    #[error("invalid node list")]
    Nodes,
}

/// Shape checks on a JobStart beyond what serde does: it comes from root, but from a process that
/// read user-controlled environment.
fn check_job_start(s: &JobStart) -> Result<(), BadJobStart> {
    if s.user.is_empty()
        || s.user.len() > 64
        || !s
            .user
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '$'))
    {
        return Err(BadJobStart::User(s.user.clone()));
    }
    if s.uid == 0 {
        return Err(BadJobStart::Root);
    }
    if s.options.len() > MAX_OPTION_PAIRS {
        return Err(BadJobStart::TooManyOptions(s.options.len()));
    }
    if s.nodes.len() > 65536 || s.nodes.iter().any(|n| n.is_empty() || n.len() > 255) {
        return Err(BadJobStart::Nodes);
    }
    Ok(())
}

/// What a new run of a job id on this node (a requeue) takes over from the run before: its
/// committed checkpoints still on this node (issue 10, defect 3), and its RAM tier while that holds
/// committed checkpoints of it (issue 24, finding 5). The new run's worker archives the unarchived
/// ones, flushes those only in RAM and verifies flushed copies not verified yet; none is removed
/// as stale data, and the tmpfs is never prepared fresh ([`crate::ram_tier::RamTier::prepare`]'s
/// `keep`). One the run before lost (its tmpfs went before the flush) is carried as lost, so that
/// the new run's output says so too. Refused ones go with the run before.
#[derive(Default)]
struct Inherited {
    ckpts: Vec<CkptRecord>,
    /// The run before's RAM-tier root, when the new run takes its tmpfs over.
    ram_root: Option<std::path::PathBuf>,
}

impl Inherited {
    fn from(old: &Job) -> Inherited {
        let entries = old.ckpts.entries();
        let holds_ram = entries
            .iter()
            .any(|e| e.in_ram() && !e.is_refused() && !e.is_lost());
        let ram_root = old
            .ram_tier
            .get()
            .filter(|_| old.is_ram() && holds_ram)
            .map(|tier| tier.config().root.clone());
        let in_ram = ram_root.is_some();
        let ckpts = entries
            .iter()
            .filter(|e| e.is_lost() || (!e.is_refused() && (e.on_hot() || (in_ram && e.in_ram()))))
            .map(|e| {
                let mut c = CkptRecord::from(&**e);
                c.in_ram &= in_ram;
                if !c.in_ram {
                    c.flush_blake3 = None;
                }
                c
            })
            .collect();
        Inherited { ckpts, ram_root }
    }
}
