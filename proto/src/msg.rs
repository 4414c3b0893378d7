//! Requests and responses that cross the agent's socket.
//!
//! Identity never travels in a message: the agent authorises from the connection's peer credentials
//! (`SO_PEERCRED`). The only uid/gid fields are in [`JobStart`], which the agent accepts as a
//! request from root (the plugin in `job_prolog`) alone; inside a [`StepStart`], which a user's task
//! sends, the agent ignores them and uses the job's identity as root or Slurm gave it.

use serde::{Deserialize, Serialize};

pub type JobId = u32;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobStart {
    pub job_id: JobId,
    pub uid: u32,
    pub gid: u32,
    pub user: String,
    /// This node's Slurm name (`SLURMD_NODENAME`).
    pub node: String,
    /// Every node of the job, expanded (`n1`, `n2`, ...).
    pub nodes: Vec<String>,
    /// `SLURM_JOB_NAME` (for the archive URL's `{job_name}`).
    #[serde(default)]
    pub job_name: String,
    /// The job's sluice options exactly as Slurm passed them (option name without `--`, raw value).
    /// Deliberately unparsed: the agent (root) validates them itself with
    /// [`crate::options::parse_job_options`] and never trusts the submit-time check.
    pub options: Vec<(String, String)>,
}

/// A job step as its tasks see it: the step id, and the job as seen from the step (`nodes` are the
/// step's nodes, `options` the step's sluice options, raw). Sent by the job user's task, so the
/// agent reads only `options`, `nodes` (which must be the job's) and the ids from it: `uid`, `gid`,
/// `user` and `job_name` are replaced by the job's verified identity (`sluice_agent::identity`)
/// whatever they say.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepStart {
    pub step_id: u32,
    pub start: JobStart,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Root only: the job starts on this node (from `job_prolog`). Returns quickly; staging runs on.
    JobStart(JobStart),
    /// Root only: the job ended on this node (from `job_epilog`).
    JobEnd { job_id: JobId },
    /// Owner or root: wait until this node finished staging the job, at most `timeout_ms`. With
    /// `step` (a task of a step other than the batch script), also the datasets the step's own
    /// options add (`srun --stage-in` inside an allocation), staged on the step's nodes; an agent
    /// that predates it ignores the field.
    WaitStaged {
        job_id: JobId,
        timeout_ms: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        step: Option<Box<StepStart>>,
    },
    /// Anyone: this node's state; users see their own jobs only.
    Status,
    /// Owner or root: one job's state on this node.
    Job { job_id: JobId },
    /// Owner or root: checkpoint `$SLUICE_CKPT_DIR/TAG` of the job is complete on this node; archive it.
    CkptCommit { job_id: JobId, tag: String },
    /// Owner or root: the job's checkpoints on this node and their archive state.
    CkptList { job_id: JobId },
    /// Anyone: the checkpoints in the archive at `url` that the peer may see (root: all; a user:
    /// those their own jobs archived, at a URL the site's `[[ckpt.allow]]` rules allow them). The
    /// agent reads the archive with the site's credentials, for users who cannot read its
    /// configuration.
    ArchiveList { url: String },
    /// As [`Request::ArchiveList`]: re-check one of the peer's archived checkpoints (`latest`: the
    /// newest intact one) against its MANIFEST.
    ArchiveVerify { url: String, tag: String },
    /// As [`Request::ArchiveList`]: restore one of the peer's checkpoints into the directory whose
    /// open descriptor travels with the request (`SCM_RIGHTS`); it must be the peer's own and
    /// empty. With `dry_run`, no descriptor: only which checkpoint it would be, and its size.
    ArchiveRestore {
        url: String,
        tag: String,
        #[serde(default)]
        dry_run: bool,
        /// Restore `tag` even though it is poisoned ([`PoisonMark`]); an agent before poisoning
        /// ignores it (and knows no poison).
        #[serde(default, skip_serializing_if = "is_false")]
        force: bool,
    },
    /// As [`Request::ArchiveList`]: mark one of the peer's archived checkpoints bad (write-once,
    /// beside its MANIFEST): `latest` passes over it, a named restore refuses it unless forced.
    ArchivePoison {
        url: String,
        tag: String,
        reason: String,
    },
    /// Owner or root: as [`Request::ArchivePoison`], for a checkpoint of the job at the job's
    /// archive — one it committed (archived yet or not: the mark waits beside where its MANIFEST
    /// will be) or one of the job user's archived there before (the restored one).
    CkptPoison {
        job_id: JobId,
        tag: String,
        reason: String,
    },
    /// Root only: this node's cache — its counters, and with `entries` the entries whose source URL
    /// starts with `prefix` (all without one), least recently used first.
    CacheList {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        prefix: Option<String>,
        #[serde(default)]
        entries: bool,
    },
    /// Root only: fill this node's cache with the dataset at `url` (as a job would stage it, with
    /// the agent's credentials, into the cache only). Returns when it is done.
    CacheWarm { url: String },
    /// Root only: fill the caches of `nodes` (this one among them or not) with the dataset at
    /// `url`, each node's through its own agent, which this agent asks over the peer port (with
    /// the admin key of the cluster secret). Returns when every node is done: one row each, in
    /// the order given. An agent that predates it answers "unknown request".
    CacheWarmNodes { url: String, nodes: Vec<String> },
    /// Root only: remove the entries whose source URL starts with `prefix` (entries a job is
    /// reading or filling right now stay); with `dry_run`, only say which.
    CacheEvict {
        prefix: String,
        #[serde(default)]
        dry_run: bool,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum Response {
    Ok,
    Ready(JobDirs),
    Status(NodeStatus),
    Job(JobStatus),
    Ckpts { ckpts: Vec<CkptStatus> },
    Archive(ArchiveListing),
    Verified(ArchiveVerified),
    Restored(ArchiveRestored),
    Cache(CacheListing),
    CacheWarmed(CacheWarmed),
    CacheWarmedNodes { nodes: Vec<NodeWarmed> },
    CacheEvicted(CacheEvicted),
    Poisoned(CkptPoisoned),
    Error(ErrorReply),
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// Who marked a checkpoint bad, when and why: the content of its poison mark, which is written
/// once and never replaced.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoisonMark {
    /// The user name and uid of whoever poisoned it (the checkpoint's owner, or root).
    pub user: String,
    pub uid: u32,
    /// Unix milliseconds.
    pub at_unix_ms: u64,
    pub reason: String,
}

/// The most bytes of a poison reason (it travels in every listing of the checkpoint).
pub const MAX_POISON_REASON: usize = 1000;

/// [`Request::ArchivePoison`]'s and [`Request::CkptPoison`]'s answer: the checkpoint's mark, now
/// written, or the one it had already (`already`: the first reason stands).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CkptPoisoned {
    pub url: String,
    pub tag: String,
    pub mark: PoisonMark,
    pub already: bool,
    /// Not archived yet: the mark waits for its MANIFEST (nothing restores the tag before).
    #[serde(default)]
    pub unpublished: bool,
}

/// This node's cross-job cache: counters since the agent started, sizes now.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheStats {
    /// Where the entries are (`<hot_tier.root>/cache`).
    pub root: String,
    /// The cache's size limit, and its watermarks: filling past `high_water_bytes` evicts the least
    /// recently used entries down to `low_water_bytes`.
    pub capacity_bytes: u64,
    pub high_water_bytes: u64,
    pub low_water_bytes: u64,
    /// Bytes and count of the complete entries now (fills in progress not counted).
    pub used_bytes: u64,
    pub entries: u64,
    /// Objects staged from the cache, and objects that were looked up and not there.
    pub hits: u64,
    pub misses: u64,
    /// Bytes placed into jobs from the cache: bytes the origin did not serve again.
    pub hit_bytes: u64,
    /// Bytes written into new entries.
    pub filled_bytes: u64,
    pub evictions: u64,
    pub evicted_bytes: u64,
}

impl CacheStats {
    /// Hits over lookups, 0..=1; `None` before the first lookup.
    pub fn hit_ratio(&self) -> Option<f64> {
        let lookups = self.hits + self.misses;
        (lookups > 0).then(|| self.hits as f64 / lookups as f64)
    }
}

/// One entry of the cache: a complete copy of one object as the origin listed it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheEntry {
    /// The object (`s3://bucket/key`, `az://container/blob`, `gs://bucket/key`).
    pub url: String,
    /// What the origin listed it with: a changed object has another ETag or version, and misses.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etag: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    pub size: u64,
    /// Seconds since the epoch when a job last used it (or it was filled).
    pub last_use: u64,
    /// A job is reading it right now (never evicted while so).
    pub in_use: bool,
}

/// [`Request::CacheList`]'s answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheListing {
    pub node: String,
    pub stats: CacheStats,
    #[serde(default)]
    pub entries: Vec<CacheEntry>,
    /// Entries that matched and are not in `entries` (one answer holds at most
    /// [`CACHE_LIST_LIMIT`]; a prefix narrows the listing).
    #[serde(default)]
    pub left_out: u64,
}

/// The most entries one [`CacheListing`] carries (each is a few hundred bytes of a 1 MiB frame).
pub const CACHE_LIST_LIMIT: usize = 2000;

/// [`Request::CacheWarm`]'s answer: the dataset's objects, and how many were cached already.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheWarmed {
    pub node: String,
    pub url: String,
    pub files: u64,
    pub bytes: u64,
    /// Of `files`/`bytes`: what was in the cache already (nothing read from the origin).
    pub cached_files: u64,
    pub cached_bytes: u64,
    /// Of `files`/`bytes`: read from the origin into the cache now. What is in neither was skipped.
    #[serde(default)]
    pub filled_files: u64,
    #[serde(default)]
    pub filled_bytes: u64,
    /// Objects that could not be cached (larger than the cache, or the cache is full of entries
    /// in use), with why.
    #[serde(default)]
    pub skipped: Vec<String>,
}

/// One node's row of [`Request::CacheWarmNodes`]'s answer: what its agent warmed, or why it did
/// not (unreachable, no cache, the dataset not found, ...).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeWarmed {
    pub node: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warmed: Option<CacheWarmed>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The most nodes one [`Request::CacheWarmNodes`] names.
pub const WARM_NODES_LIMIT: usize = 4096;

/// [`Request::CacheEvict`]'s answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheEvicted {
    pub node: String,
    pub entries: u64,
    pub bytes: u64,
    /// Entries that matched and stay because a job is reading or filling them.
    pub in_use: u64,
    pub dry_run: bool,
}

/// The checkpoints of an archive the peer may see ([`Request::ArchiveList`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArchiveListing {
    /// The archive, as the agent names it (no credentials).
    pub url: String,
    /// Oldest first.
    pub ckpts: Vec<ArchivedCkpt>,
    /// Older checkpoints not sent (an answer must fit one frame).
    #[serde(default)]
    pub left_out: u64,
}

/// One checkpoint of an archive, with what `sluice ckpt list URL` shows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArchivedCkpt {
    pub tag: String,
    /// `complete`, `partial` or `invalid`.
    pub state: String,
    /// Why an invalid checkpoint cannot be used.
    #[serde(default)]
    pub reason: Option<String>,
    pub files: u64,
    pub raw_bytes: u64,
    pub stored_bytes: u64,
    /// Unix milliseconds.
    pub created_unix_ms: u64,
    /// The job that archived it, from its MANIFEST.
    pub job_id: Option<JobId>,
    pub user: Option<String>,
    pub job_name: Option<String>,
    pub nodes: Vec<String>,
    #[serde(default)]
    pub data_classes: Vec<String>,
    /// Marked bad: `latest` passes over it, a named restore refuses it unless forced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub poison: Option<PoisonMark>,
}

/// What a verify through the agent found ([`Request::ArchiveVerify`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArchiveVerified {
    pub url: String,
    /// The checkpoint checked (`latest` resolved).
    pub tag: String,
    pub ok: bool,
    pub files: u64,
    pub raw_bytes: u64,
    pub stored_bytes: u64,
    /// `(path, what is wrong)` of every damaged file.
    pub damaged: Vec<(String, String)>,
}

/// What a restore through the agent did, or would do ([`Request::ArchiveRestore`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArchiveRestored {
    pub url: String,
    /// The checkpoint restored (`latest` resolved).
    pub tag: String,
    pub files: u64,
    pub raw_bytes: u64,
    pub stored_bytes: u64,
    /// Damaged newer checkpoints of the peer's that `latest` passed over.
    pub skipped: Vec<String>,
    /// What the caller should read: poisoned newer checkpoints `latest` passed over, a poisoned
    /// one restored because forced. An agent before poisoning sends none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

/// The directories a job's tasks see.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobDirs {
    pub stage_dir: String,
    pub ckpt_dir: String,
    /// The checkpoint placed in `ckpt_dir` by `--ckpt-restore`, if any.
    #[serde(default)]
    pub restored_tag: Option<String>,
    /// Things the job's user should read in the job output (e.g. a restore that fell back).
    #[serde(default)]
    pub notes: Vec<String>,
    /// More variables for the job's tasks (`SLUICE_SHARD_INDEX`, ...). The plugin sets only
    /// names that start with `SLUICE_`.
    #[serde(default)]
    pub env: Vec<(String, String)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CkptState {
    /// Committed; waiting for its turn to be archived.
    Committed,
    /// Being uploaded from this node.
    Archiving,
    /// This node's part is uploaded; waiting for the job's other nodes before the MANIFEST is published.
    WaitingForNodes,
    /// The MANIFEST is published: the checkpoint is safe in the archive.
    Archived,
    /// The last attempt failed (the error says why); it is retried.
    Retrying,
    /// Files changed while being archived: archived again after the next commit of this tag.
    Modified,
    /// The archive already holds this tag with other content (archives are immutable): not
    /// archived, kept on the hot tier (never trimmed); save the state under a new tag.
    Refused,
    /// Some node of the job never sent its part within `ckpt.publish_wait`: not archived, kept on
    /// the hot tier (never trimmed); the error names the nodes.
    Incomplete,
}

impl CkptState {
    pub fn as_str(self) -> &'static str {
        match self {
            CkptState::Committed => "committed",
            CkptState::Archiving => "archiving",
            CkptState::WaitingForNodes => "waiting-for-nodes",
            CkptState::Archived => "archived",
            CkptState::Retrying => "retrying",
            CkptState::Modified => "modified",
            CkptState::Refused => "refused",
            CkptState::Incomplete => "incomplete",
        }
    }
}

/// One committed checkpoint of a job, as this node's agent sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CkptStatus {
    pub tag: String,
    pub state: CkptState,
    /// Still on this node's hot tier (retention has not trimmed it).
    pub on_hot_tier: bool,
    /// On the RAM tier (`--ckpt-tier=ram`): with `on_hot_tier` false, not flushed to the hot
    /// tier yet (the job's end waits for it).
    #[serde(default)]
    pub in_ram: bool,
    pub archive_url: String,
    pub files: u64,
    pub raw_bytes: u64,
    pub stored_bytes: u64,
    pub bytes_done: u64,
    /// Seconds since the Unix epoch.
    pub committed_at: u64,
    pub archived_at: Option<u64>,
    pub error: Option<String>,
    /// sluice will not archive it by itself: the error says what the user has to do (commit it
    /// again, save under a new tag, bring a node back).
    #[serde(default)]
    pub action_needed: bool,
    /// This node's part of the checkpoint on other nodes of the job (`[fast_tier] replicas`);
    /// `None` for a job without replicas (and from an agent that predates them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<ReplicaStatus>,
}

/// Where this node's part of a checkpoint is replicated: what `sluice ckpt list` shows.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaStatus {
    /// How many other nodes should hold it.
    pub wanted: u8,
    /// The nodes whose agents hold a sealed copy of it now, in placement order.
    pub held_by: Vec<String>,
    /// Why fewer than `wanted` hold it, while they do (a node had no room, was not reached).
    #[serde(default)]
    pub short: Option<String>,
    /// The replicas went once the archive held the checkpoint.
    #[serde(default)]
    pub freed: bool,
    /// Every node's part of the checkpoint (not only this node's) is held by `wanted` other
    /// nodes: losing any one node loses nothing of it.
    #[serde(default)]
    pub protected: bool,
}

impl CkptStatus {
    /// What the job's user must read about this checkpoint in the job output, if anything: a
    /// refusal or a final failure (not a transient error, which is retried).
    pub fn problem(&self) -> Option<String> {
        if !self.action_needed {
            return None;
        }
        let why = self.error.as_deref().unwrap_or(self.state.as_str());
        Some(format!("checkpoint {} is NOT archived: {why}", self.tag))
    }
}

/// Stable error codes; the message says what to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The request is malformed, too large, or of another protocol version.
    BadRequest,
    /// The peer may not do this.
    Forbidden,
    /// No such job on this node.
    NotFound,
    /// Staging failed because of the job's input (missing dataset, denied access, disk full).
    StageFailed,
    /// A deadline passed.
    Timeout,
    /// The agent itself is broken (cannot create directories, journal fails...).
    Internal,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct ErrorReply {
    pub code: ErrorCode,
    pub message: String,
}

impl ErrorReply {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ErrorReply {
            code,
            message: message.into(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    /// Datasets are being staged.
    Staging,
    /// Everything staged; tasks may run.
    Ready,
    /// Staging failed; the job's tasks will fail with the error.
    Failed,
    /// The job ended; cleanup is done or in progress.
    Ended,
}

impl JobState {
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Staging => "staging",
            JobState::Ready => "ready",
            JobState::Failed => "failed",
            JobState::Ended => "ended",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StageState {
    Pending,
    Listing,
    Copying,
    Done,
    Failed,
}

impl StageState {
    pub fn as_str(self) -> &'static str {
        match self {
            StageState::Pending => "pending",
            StageState::Listing => "listing",
            StageState::Copying => "copying",
            StageState::Done => "done",
            StageState::Failed => "failed",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageProgress {
    pub name: String,
    pub source: String,
    pub state: StageState,
    pub files_done: u64,
    /// Known once listing finished.
    pub files_total: Option<u64>,
    pub bytes_done: u64,
    pub bytes_total: Option<u64>,
    /// Of `bytes_done`: the bytes this node read from the origin itself, and those it took from
    /// the job's other nodes (peer transfers, `[peer]`). An agent before peer transfers sends
    /// neither.
    #[serde(default)]
    pub origin_bytes: u64,
    #[serde(default)]
    pub peer_bytes: u64,
    /// Of `bytes_done`: placed from this node's cache (`[cache]`), read from neither.
    #[serde(default)]
    pub cache_bytes: u64,
    /// Of `bytes_done`: files a restarted agent found staged whole (the object version it lists
    /// now, the file as it was written) and kept, read from nowhere. An agent before resumed
    /// staging sends none.
    #[serde(default)]
    pub resumed_bytes: u64,
    /// Milliseconds spent so far (or in total, once done).
    pub elapsed_ms: u64,
    pub error: Option<String>,
}

impl StageProgress {
    /// Average rate so far, bytes per second.
    pub fn rate_bps(&self) -> u64 {
        self.bytes_done
            .saturating_mul(1000)
            .checked_div(self.elapsed_ms)
            .unwrap_or(0)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobStatus {
    pub job_id: JobId,
    pub user: String,
    pub uid: u32,
    pub node: String,
    pub nodes: Vec<String>,
    pub state: JobState,
    pub dirs: JobDirs,
    pub stages: Vec<StageProgress>,
    /// Seconds since the Unix epoch.
    pub started_at: u64,
    pub error: Option<String>,
    /// Committed checkpoints of the job on this node.
    #[serde(default)]
    pub ckpts: Vec<CkptStatus>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeStatus {
    pub node: String,
    pub agent_version: String,
    pub hot_root: String,
    /// File-system size and free bytes under the hot-tier root.
    pub hot_total_bytes: u64,
    pub hot_free_bytes: u64,
    /// Bytes held by jobs' directories on the hot tier, as the agent counted them.
    pub hot_used_bytes: u64,
    pub jobs: Vec<JobStatus>,
    /// The cross-job cache (`[cache]`); `None` without one (or from an agent before it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache: Option<CacheStats>,
    /// The agent's background loops the caller may see: the node's own (housekeeping, the peer
    /// server) and the checkpoint workers of the caller's jobs (root: of every job). Empty from an
    /// agent before them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub workers: Vec<WorkerStatus>,
}

/// What one of the agent's background loops is doing, as it last said: the checkpoint worker of a
/// job (`ckpt job 42`: flushing, verifying, archiving its checkpoints), housekeeping, the peer
/// server. A worker whose `last_error` stays set, or that stays in one state for long, is stuck.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerStatus {
    pub name: String,
    /// The job it works for; `None` for the node's own loops.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_id: Option<JobId>,
    /// A word such as `idle`, `archiving`, `port taken, retrying`.
    pub state: String,
    /// When it entered `state` (seconds since the Unix epoch).
    pub since: u64,
    /// Turns of its loop so far.
    pub turns: u64,
    /// The error its last turn met; `None` once a turn succeeds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `workers` is new: a CLI reads an older agent's status (no such field), and an agent
    /// without workers to show sends exactly what an older one did.
    #[test]
    fn node_status_without_workers_is_the_older_agents() {
        let older = r#"{"node":"n1","agent_version":"0.1.0","hot_root":"/hot",
            "hot_total_bytes":10,"hot_free_bytes":5,"hot_used_bytes":1,"jobs":[]}"#;
        let status: NodeStatus = serde_json::from_str(older).unwrap();
        assert!(status.workers.is_empty() && status.cache.is_none());
        let again = serde_json::to_value(&status).unwrap();
        assert_eq!(
            again,
            serde_json::from_str::<serde_json::Value>(older).unwrap()
        );

        let stuck = WorkerStatus {
            name: "ckpt job 7".into(),
            job_id: Some(7),
            state: "idle".into(),
            since: 100,
            turns: 2,
            last_error: Some("store down".into()),
        };
        let with = NodeStatus {
            workers: vec![stuck],
            ..status
        };
        let text = serde_json::to_string(&with).unwrap();
        assert_eq!(serde_json::from_str::<NodeStatus>(&text).unwrap(), with);
    }
}
