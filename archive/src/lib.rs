//! sluice-archive: the checkpoint archive engine — committed checkpoints from the hot tier to object
//! storage, and back — and the object stores it talks to: [`store`] (object-store clients from the
//! admin's store profiles, with the site's retry policy in object_store's terms), [`url`]s of
//! archives, the RAM tier's [`flush`]. It stands on sluice-core (config, root-safe file access,
//! durable writes, aligned buffers, blocking work); [`upload_memory`] is the figure the core's
//! config checks the node's memory budget against. The CLI depends on this crate, never on the
//! agent.
//!
//! # On-store layout
//!
//! Below the archive URL's base prefix (`s3://ckpt/alice/run1` → bucket `ckpt`, base `alice/run1`):
//!
//! ```text
//! BASE/.jobs/<job>/TAG/<node>.json  a node's note that job <job> committed TAG (time): first;
//!                               removed once TAG is published (not a tag: tags never start with '.')
//! BASE/TAG/data/<relpath>       one object per file: its chunks' frames (format.rs)
//! BASE/TAG/parts/<node>.json    what one node archived (PartManifest, with its job id), after its
//!                               data objects; empty for a node that holds none of the tag
//! BASE/TAG/MANIFEST             the checkpoint (Manifest): written last, after every part
//! BASE/TAG/POISON               who marked the checkpoint bad, when and why (poison.rs): written
//!                               once, at any time; `latest` passes over it, a named restore needs force
//! ```
//!
//! **Tiering.** Data objects are written in the storage class (S3, GCS) or access tier (Azure) of
//! the store profile's `data_class` ([`Archiver::with_data_class`]), and each file's manifest entry
//! records it; notes, parts and MANIFESTs, which listing, publishing and restore read first, are
//! always written in the store's default class.
//!
//! **Any subset of nodes.** A multi-node job's node that commits a tag notes it under
//! `.jobs/<job>/` (one listing of the job's own notes, however many tags the prefix holds); the
//! job's other nodes see the note ([`Archiver::commits_of_job`]) and answer with their part, or
//! with an empty part when they hold nothing of the tag (rank 0's `torch.save`), so publishing
//! never waits for files a node does not have. Parts and notes carry the job id, and a publisher
//! merges only its own job's parts: a tag reused under a shared prefix never mixes jobs.
//!
//! **Publish last.** A node writes its part manifest only after every one of its data objects is
//! durable (each `put` / multipart `complete` returned); any node that finds all parts present merges
//! them and writes `MANIFEST` — deterministic bytes, with a create-only put where the store supports
//! it, so nodes racing to publish agree. No MANIFEST, no checkpoint: [`Archiver::list`] reports such a
//! tag as partial, and restore and [`Archiver::latest`] never use it.
//!
//! # Pipeline
//!
//! [`Archiver::upload_part`] walks the checkpoint directory fd-relative as root with the checks of
//! [`walk`]; one blocking thread reads files in order (hashing the raw bytes and checking each file
//! did not change while read), several blocking tasks compress chunks ([`format`]), and the async
//! side copies frames into a fixed pool of part buffers and assembles objects: one PUT for objects
//! up to the part size, a multipart upload above it. Requests in flight are bounded by a semaphore,
//! memory by the chunks in flight and the pool: about `(2 × compress_threads + 3) × chunk_size +
//! (⌈concurrency / 2⌉ + 1) × part_size`, plus small last pieces copied out of the pool (the part size
//! grows for objects that would otherwise need more than [`MAX_PARTS`] parts). Each blocking
//! thread that encodes or decodes keeps a chunk-sized buffer or two (and its zstd contexts) for
//! its next chunk, until the runtime retires the idle thread.
//! Restore and verify fetch chunk ranges with parallel ranged GETs, each body streamed into one of
//! `concurrency` reused receive buffers, and decode them on blocking threads; restore writes whole
//! aligned blocks with `O_DIRECT` (no page-cache copy; the restored files are not left in the page
//! cache) where the file system allows it, and fsyncs every file before it returns.

#![forbid(unsafe_code)]

pub mod access;
mod download;
pub mod flush;
pub mod format;
pub mod manifest;
pub mod poison;
mod resume;
pub use resume::Identity as FileIdentity;
pub mod store;
pub mod synth;
#[cfg(feature = "testing")]
pub mod testing;
mod throttle;
mod upload;
mod url;
pub mod walk;

pub use download::VerifyReport;
pub use format::{Codec, FileCompression, Transform};
pub use manifest::{ChunkEntry, FileEntry, JobMeta, Manifest, PartManifest};
pub use resume::prune_resume_logs;
pub use upload::upload_memory;
pub use url::{ArchiveLocation, ArchiveStore, open_archive, open_archive_with, parse_archive_url};

use futures::{StreamExt, TryStreamExt};
use object_store::path::Path as ObjPath;
use object_store::{ObjectMeta, ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use sluice_core::config::within;
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use throttle::Throttle;

/// S3's (and GCS's XML API's) limit on the parts of one multipart upload; Azure allows 50,000 blocks.
pub const MAX_PARTS: u64 = 10_000;

/// The largest MANIFEST or part manifest read or written: about 300,000 chunk entries, 1.2 TB of
/// checkpoint in the default 4 MiB chunks (a larger checkpoint needs a larger `ckpt.chunk_size`).
pub const MAX_MANIFEST_BYTES: u64 = 64 << 20;

/// Tunables of the archive path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArchiveConfig {
    /// Objects above this stored size are uploaded as multipart uploads of parts this large (raised
    /// per object so it never needs more than [`MAX_PARTS`] parts); also the size of restore's
    /// ranged GETs. S3 needs at least 5 MiB.
    pub part_size: u64,
    /// Requests in flight (uploads, parts, ranged GETs).
    pub concurrency: usize,
    /// zstd level; 0 turns compression off (every chunk stored raw). Level 1 is the default: on
    /// byte-grouped tensors it compresses *better* than 3 (bf16 1.46× vs 1.41×, fp32 1.19× vs
    /// 1.17×) and faster, because the gain is entropy coding of exponents, not matches.
    pub zstd_level: i32,
    /// Raw bytes per independently compressed chunk: a multiple of 4 KiB, at most 64 MiB.
    pub chunk_size: usize,
    /// Chunks compressed at once, each on a blocking thread.
    pub compress_threads: usize,
    /// Upload cap in bytes per second.
    pub bandwidth_limit: Option<u64>,
}

impl Default for ArchiveConfig {
    fn default() -> Self {
        ArchiveConfig {
            part_size: 16 << 20,
            concurrency: 8,
            zstd_level: 1,
            chunk_size: 4 << 20,
            // Background work on a training node: half the cores, no more than 8, and at least 2
            // so that one chunk compresses while another is read and hashed (with 1, a 2-core
            // node compressed at half the speed of `zstd -T0`).
            compress_threads: std::thread::available_parallelism()
                .map(|n| n.get() / 2)
                .unwrap_or(1)
                .clamp(2, 8),
            bandwidth_limit: None,
        }
    }
}

impl ArchiveConfig {
    pub fn validate(&self) -> Result<(), String> {
        within(
            self.part_size,
            64 << 10..=5 << 30,
            "part size must be between 64KiB and 5GiB",
        )?;
        within(self.concurrency, 1..=1024, "concurrency must be 1..=1024")?;
        within(self.zstd_level, 0..=19, "zstd level must be 0 (off) to 19")?;
        if self.chunk_size < 64 << 10
            || self.chunk_size > format::MAX_CHUNK
            || !self.chunk_size.is_multiple_of(4096)
        {
            return Err(format!(
                "chunk size must be a multiple of 4KiB between 64KiB and 64MiB, got {}",
                self.chunk_size
            ));
        }
        within(
            self.compress_threads,
            1..=256,
            "compress threads must be 1..=256",
        )?;
        if self.bandwidth_limit == Some(0) {
            return Err("a bandwidth limit of 0 would never upload anything".into());
        }
        Ok(())
    }
}

/// [`ArchiveError::code`] is each variant's name in snake_case (derived), but for a store error and
/// a failed write, which say more.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum ArchiveError {
    #[error("archive URL '{url}': {reason}")]
    BadUrl { url: String, reason: String },
    #[error("invalid archive settings: {0}")]
    BadConfig(String),
    #[error(
        "'{name}' is not a usable {what}: use 1-200 letters, digits, '.', '_', '-' or '+', not starting with '.'"
    )]
    BadName { what: &'static str, name: String },
    /// The checkpoint holds something root must not read (a symlink, another user's file, ...).
    #[error("checkpoint {tag}: '{path}' {reason}; nothing was archived")]
    Refused {
        tag: String,
        path: String,
        reason: String,
    },
    /// A file changed while it was read: retry later. No manifest was written.
    #[error(
        "checkpoint {tag}: '{path}' changed while it was being archived (is the job still writing it?); nothing was published"
    )]
    Modified { tag: String, path: String },
    #[error("checkpoint {tag}: reading '{path}': {detail}")]
    Read {
        tag: String,
        path: String,
        detail: String,
    },
    /// Writing a restored file; `errno` tells a full hot tier (ENOSPC, EDQUOT) from the rest.
    #[error("restoring checkpoint {tag}: writing '{path}': {detail}")]
    Write {
        tag: String,
        path: String,
        detail: String,
        errno: Option<i32>,
    },
    /// A store request failed (after object_store's retries); [`ArchiveError::store_kind`] says how.
    #[error("{url}: {op} '{key}': {error}")]
    Store {
        url: String,
        op: &'static str,
        key: String,
        #[source]
        error: Box<object_store::Error>,
    },
    #[error("checkpoint {tag} is not archived at {url}: it has no MANIFEST (partial or missing)")]
    NotArchived { url: String, tag: String },
    #[error("checkpoint {tag} at {url}: unusable {what}: {reason}")]
    BadManifest {
        url: String,
        tag: String,
        what: String,
        reason: String,
    },
    /// Data that does not match the manifest: every damaged file (at least one) and what is wrong.
    #[error("checkpoint {tag} at {url} is damaged: {}", describe(damaged))]
    Corrupt {
        url: String,
        tag: String,
        damaged: Vec<Damaged>,
    },
    #[error(
        "checkpoint {tag}: nodes {} and {} both archived '{path}' with different contents",
        nodes.0, nodes.1
    )]
    Conflict {
        tag: String,
        path: String,
        nodes: (String, String),
    },
    /// A manifest would exceed [`MAX_MANIFEST_BYTES`], which readers refuse.
    #[error(
        "checkpoint {tag}: its {what} would be {size} bytes, more than the {} MiB a manifest may be; use a larger ckpt.chunk_size",
        MAX_MANIFEST_BYTES >> 20
    )]
    ManifestTooLarge {
        tag: String,
        what: String,
        size: u64,
    },
    #[error("archiving checkpoint {tag} was stopped")]
    Stopped { tag: String },
    #[error("checkpoint {tag} is already published at {url}, without a part from node {node}")]
    AlreadyPublished {
        url: String,
        tag: String,
        node: String,
    },
    /// The hot tier's copy of a checkpoint flushed from the RAM tier does not hash as the flush
    /// read it ([`Archiver::upload_part`] with the flush's hashes): no part manifest was written.
    #[error(
        "checkpoint {tag}: the hot tier's copy is not what was flushed from RAM: {}; nothing was published",
        describe(damaged)
    )]
    NotAsFlushed { tag: String, damaged: Vec<Damaged> },
}

/// One damaged file of a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Damaged {
    pub path: String,
    pub detail: String,
}

fn describe(damaged: &[Damaged]) -> String {
    let Some(first) = damaged.first() else {
        return "no file named".into();
    };
    match damaged.len() {
        1 => format!("'{}': {}", first.path, first.detail),
        n => format!(
            "'{}': {} (and {} more damaged file(s))",
            first.path,
            first.detail,
            n - 1
        ),
    }
}

impl ArchiveError {
    /// A file changed while it was read: archive it again once it is stable.
    pub fn is_modified(&self) -> bool {
        matches!(self, ArchiveError::Modified { .. })
    }

    /// Retrying cannot help: the archive holds something this checkpoint cannot be published over
    /// (another MANIFEST, nodes that disagree on a file, a manifest larger than readers accept, one
    /// that cannot be read), or the request itself is malformed. A store error or a file that
    /// changed is never permanent.
    pub fn is_permanent(&self) -> bool {
        matches!(
            self,
            ArchiveError::AlreadyPublished { .. }
                | ArchiveError::Conflict { .. }
                | ArchiveError::ManifestTooLarge { .. }
                | ArchiveError::BadManifest { .. }
                | ArchiveError::BadName { .. }
                | ArchiveError::BadConfig(_)
        )
    }

    /// Damaged or missing data: the caller may fall back to an older checkpoint.
    pub fn is_corrupt(&self) -> bool {
        matches!(
            self,
            ArchiveError::Corrupt { .. } | ArchiveError::BadManifest { .. }
        )
    }

    /// A stable word for this error, for the agent's `sluice_failures_total{code}` label: one per
    /// variant (a store error by its [`store::StoreErrorKind`], a failed write as `no_space` when the
    /// disk is full), never a message text. Dashboards and alerts query these words: keep them.
    pub fn code(&self) -> &'static str {
        match self {
            ArchiveError::Write { errno, .. } => {
                let full = [nix::errno::Errno::ENOSPC, nix::errno::Errno::EDQUOT];
                if full.iter().any(|f| *errno == Some(*f as i32)) {
                    "no_space"
                } else {
                    "write"
                }
            }
            ArchiveError::Store { .. } => match self.store_kind() {
                Some(store::StoreErrorKind::NotFound) => "store_not_found",
                Some(store::StoreErrorKind::Denied) => "store_denied",
                Some(store::StoreErrorKind::Throttled) => "store_throttled",
                Some(store::StoreErrorKind::Unreachable) => "store_unreachable",
                Some(store::StoreErrorKind::TimedOut) => "store_timed_out",
                Some(store::StoreErrorKind::Other) | None => "store_other",
            },
            other => other.into(),
        }
    }

    /// What a failed store request means (unreachable, not found, ...); `None` for errors that are
    /// not a store request's.
    pub fn store_kind(&self) -> Option<store::StoreErrorKind> {
        match self {
            ArchiveError::Store { error, .. } => Some(store::classify(error)),
            _ => None,
        }
    }

    /// This error for people: a store's error code and message instead of its raw XML reply, and
    /// no retry bookkeeping ([`store::describe`]); other errors as they display.
    pub fn describe(&self) -> String {
        match self {
            ArchiveError::Store {
                url,
                op,
                key,
                error,
            } => {
                format!("{url}: {op} '{key}': {}", store::describe(error))
            }
            other => other.to_string(),
        }
    }
}

/// Live counters of one upload or restore, read by status requests while workers update them.
/// Cloning shares the counters.
#[derive(Debug, Clone, Default)]
pub struct ArchiveProgress {
    inner: Arc<Counters>,
}

#[derive(Debug, Default)]
struct Counters {
    files_done: AtomicU64,
    files_total: AtomicU64,
    bytes_done: AtomicU64,
    bytes_total: AtomicU64,
    stored_bytes: AtomicU64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ProgressSnapshot {
    pub files_done: u64,
    pub files_total: u64,
    /// Raw bytes read and compressed (upload) or decoded (restore, verify).
    pub bytes_done: u64,
    pub bytes_total: u64,
    /// Stored bytes uploaded (upload) or downloaded (restore, verify).
    pub stored_bytes: u64,
}

impl ArchiveProgress {
    pub fn snapshot(&self) -> ProgressSnapshot {
        let c = &self.inner;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ProgressSnapshot {
            files_done: l(&c.files_done),
            files_total: l(&c.files_total),
            bytes_done: l(&c.bytes_done),
            bytes_total: l(&c.bytes_total),
            stored_bytes: l(&c.stored_bytes),
        }
    }

    fn set_totals(&self, files: u64, bytes: u64) {
        self.inner.files_total.store(files, Ordering::Relaxed);
        self.inner.bytes_total.store(bytes, Ordering::Relaxed);
    }

    fn file_done(&self) {
        self.inner.files_done.fetch_add(1, Ordering::Relaxed);
    }

    fn bytes_done(&self, n: u64) {
        self.inner.bytes_done.fetch_add(n, Ordering::Relaxed);
    }

    fn stored(&self, n: u64) {
        self.inner.stored_bytes.fetch_add(n, Ordering::Relaxed);
    }
}

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(tag = "state", rename_all = "lowercase")]
pub enum CheckpointState {
    /// A valid MANIFEST: restorable.
    Complete,
    /// Data or parts, but no MANIFEST (an archive in progress, or one that failed).
    Partial,
    /// A MANIFEST this agent cannot use.
    Invalid { reason: String },
}

/// One tag of an archive, as [`Archiver::list`] reports it (and `sluice ckpt list --json` prints
/// it: the state as `"state": "complete" | "partial" | "invalid"`, with `"reason"` for an invalid one).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CheckpointInfo {
    pub tag: String,
    #[serde(flatten)]
    pub state: CheckpointState,
    pub files: u64,
    /// Raw bytes (for a partial tag: of the parts written so far).
    pub raw_bytes: u64,
    /// Bytes in the store (for a partial tag: of the data objects found).
    pub stored_bytes: u64,
    /// Raw / stored, for a complete checkpoint.
    pub ratio: Option<f64>,
    /// The manifest's time; for a partial tag, that of its newest object (Unix ms).
    pub created_unix_ms: u64,
    pub job: Option<JobMeta>,
    /// Complete: the nodes of the checkpoint. Partial: the nodes whose parts are written.
    pub nodes: Vec<String>,
    /// The storage classes (S3, GCS) or access tiers (Azure) its data objects were written with,
    /// from the manifests (no request per object): sorted, `"default"` for objects written without
    /// one; empty for a checkpoint without files and an invalid one.
    pub data_classes: Vec<String>,
    /// A complete checkpoint's poison mark that counts ([`poison`]): `latest` passes over it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub poison: Option<sluice_proto::msg::PoisonMark>,
}

impl CheckpointInfo {
    /// A tag whose MANIFEST cannot be used, and why.
    pub fn invalid(tag: String, reason: String) -> CheckpointInfo {
        CheckpointInfo {
            tag,
            state: CheckpointState::Invalid { reason },
            files: 0,
            raw_bytes: 0,
            stored_bytes: 0,
            ratio: None,
            created_unix_ms: 0,
            job: None,
            nodes: Vec::new(),
            data_classes: Vec::new(),
            poison: None,
        }
    }
}

/// An upload bandwidth cap (bytes per second) that several archivers can share.
#[derive(Debug, Clone)]
pub struct Bandwidth(Arc<Throttle>);

impl Bandwidth {
    pub fn new(bytes_per_second: u64) -> Bandwidth {
        Bandwidth(Arc::new(Throttle::new(bytes_per_second)))
    }
}

/// Archives checkpoints under one base prefix of one object store, and restores them.
#[derive(Debug, Clone)]
pub struct Archiver {
    store: Arc<dyn ObjectStore>,
    base: ObjPath,
    /// The archive URL, for messages (never holds credentials).
    url: String,
    cfg: ArchiveConfig,
    throttle: Option<Arc<Throttle>>,
    /// The job this archiver writes and publishes for (parts and commit markers carry it).
    job: Option<u32>,
    /// Where uploads keep their resume logs ([`Archiver::with_resume_dir`]).
    resume_dir: Option<std::path::PathBuf>,
    /// The storage class data objects are written with ([`Archiver::with_data_class`]).
    data_class: Option<String>,
}

/// What [`Archiver::try_publish`] found.
#[derive(Debug, Clone, PartialEq)]
pub enum Publish {
    /// The MANIFEST is there (written now, or before).
    Published(Manifest),
    /// These nodes of the job have not written their part for this job yet.
    Waiting { missing: Vec<String> },
}

impl Publish {
    /// The MANIFEST, once published.
    pub fn into_manifest(self) -> Option<Manifest> {
        match self {
            Publish::Published(m) => Some(m),
            Publish::Waiting { .. } => None,
        }
    }
}

/// A node's note that its job committed a tag: `BASE/.jobs/<job>/TAG/<node>.json`, written at
/// the commit, before any data, and removed once the tag is published. The job's other nodes read it to learn of the commit, and a node that
/// holds nothing of the tag answers with an empty part, so a checkpoint that only some nodes wrote
/// is published too.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct CommitMarker {
    job_id: u32,
    node: String,
    at_unix_ms: u64,
}

/// Checks a tag or node name: it becomes one component of object keys and of hot-tier paths.
pub fn check_name(what: &'static str, name: &str) -> Result<(), ArchiveError> {
    let ok = !name.is_empty()
        && name.len() <= 200
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '+'));
    if ok {
        Ok(())
    } else {
        Err(ArchiveError::BadName {
            what,
            name: name.to_string(),
        })
    }
}

/// Refuses to write a manifest that readers would refuse to read.
fn check_manifest_size(tag: &str, what: &str, size: usize) -> Result<(), ArchiveError> {
    if size as u64 > MAX_MANIFEST_BYTES {
        return Err(ArchiveError::ManifestTooLarge {
            tag: tag.into(),
            what: what.into(),
            size: size as u64,
        });
    }
    Ok(())
}

fn unix_ms_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl Archiver {
    /// An archiver for `base` (a `/`-separated prefix, may be empty) inside `store`.
    pub fn new(
        store: Arc<dyn ObjectStore>,
        base: &str,
        cfg: ArchiveConfig,
    ) -> Result<Archiver, ArchiveError> {
        let url = format!("{store}/{}", base.trim_matches('/'));
        Archiver::with_url(store, base, cfg, url)
    }

    /// Like [`Archiver::new`], naming the archive `url` in messages.
    pub fn with_url(
        store: Arc<dyn ObjectStore>,
        base: &str,
        cfg: ArchiveConfig,
        url: String,
    ) -> Result<Archiver, ArchiveError> {
        cfg.validate().map_err(ArchiveError::BadConfig)?;
        let base = base.trim_matches('/');
        if !base.is_empty() {
            manifest::check_rel_path(base).map_err(|reason| ArchiveError::BadUrl {
                url: url.clone(),
                reason,
            })?;
        }
        Ok(Archiver {
            store,
            base: ObjPath::from_iter(base.split('/').filter(|s| !s.is_empty())),
            url,
            throttle: cfg.bandwidth_limit.map(|r| Arc::new(Throttle::new(r))),
            cfg,
            job: None,
            resume_dir: None,
            data_class: None,
        })
    }

    /// Writes and publishes for `job_id`: parts carry it, and publishing merges only its parts.
    pub fn for_job(mut self, job_id: u32) -> Archiver {
        self.job = Some(job_id);
        self
    }

    /// Shares one bandwidth cap among archivers (all the archives of a node), instead of the
    /// per-archiver one `bandwidth_limit` sets.
    pub fn with_bandwidth(mut self, cap: &Bandwidth) -> Archiver {
        self.throttle = Some(cap.0.clone());
        self
    }

    /// Lets [`Archiver::upload_part`] resume an interrupted upload per data object: it logs each
    /// object once stored in `dir` (root's agent state, created 0700 if missing; one log per
    /// archive, tag and node, removed when the part is written) and reuses what the log, the
    /// files and the store agree on. See `resume.rs`.
    pub fn with_resume_dir(mut self, dir: std::path::PathBuf) -> Archiver {
        self.resume_dir = Some(dir);
        self
    }

    /// Writes data objects with this storage class (S3, GCS) or access tier (Azure), e.g.
    /// `STANDARD_IA` or `Cool` (the store profile's `data_class`, checked when the config is
    /// read); `None` leaves them in the store's default class. Only data objects: part
    /// manifests, MANIFESTs and commit notes, which listing, publishing and restore read first,
    /// stay in the default class. Each file's manifest entry records the class it was written
    /// with. A store that does not take the attribute (a `file://` archive) must not be given one.
    pub fn with_data_class(mut self, class: Option<String>) -> Archiver {
        self.data_class = class;
        self
    }

    pub fn data_class(&self) -> Option<&str> {
        self.data_class.as_deref()
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn config(&self) -> &ArchiveConfig {
        &self.cfg
    }

    /// The key of `parts` (each one path component, encoded as object_store does) below the base.
    fn key<'a>(&self, parts: impl IntoIterator<Item = &'a str>) -> ObjPath {
        parts
            .into_iter()
            .fold(self.base.clone(), |key, part| key.join(part))
    }

    fn data_prefix(&self, tag: &str) -> ObjPath {
        self.key([tag, "data"])
    }

    /// The object holding file `rel` (a checked relative path) of `tag`.
    fn data_key(&self, tag: &str, rel: &str) -> ObjPath {
        self.key([tag, "data"].into_iter().chain(rel.split('/')))
    }

    fn part_key(&self, tag: &str, node: &str) -> ObjPath {
        self.key([tag, "parts", &format!("{node}.json")])
    }

    fn manifest_key(&self, tag: &str) -> ObjPath {
        self.key([tag, "MANIFEST"])
    }

    /// Where the commit notes of `job` live: listed in one call by [`Archiver::commits_of_job`].
    fn commits_prefix(&self, job: u32) -> ObjPath {
        self.key([".jobs", &job.to_string()])
    }

    fn commit_key(&self, job: u32, tag: &str, node: &str) -> ObjPath {
        self.key([".jobs", &job.to_string(), tag, &format!("{node}.json")])
    }

    fn job_id(&self) -> Result<u32, ArchiveError> {
        self.job.ok_or(ArchiveError::BadConfig(
            "this archiver writes for no job (Archiver::for_job)".into(),
        ))
    }

    /// Notes in the archive that `node` of this archiver's job committed `tag` (see
    /// [`CommitMarker`]); the job's other nodes find it with [`Archiver::commits_of_job`].
    pub async fn announce_commit(&self, tag: &str, node: &str) -> Result<(), ArchiveError> {
        check_name("checkpoint tag", tag)?;
        check_name("node name", node)?;
        let marker = CommitMarker {
            job_id: self.job_id()?,
            node: node.into(),
            at_unix_ms: unix_ms_now(),
        };
        let key = self.commit_key(marker.job_id, tag, node);
        let json = serde_json::to_vec(&marker).expect("a marker serialises");
        self.store
            .put(&key, PutPayload::from(json))
            .await
            .map_err(self.store_err("put", &key))?;
        Ok(())
    }

    /// The tags this archiver's job committed on some node and that are not published yet: one
    /// listing of the job's notes, then a MANIFEST check per noted tag (a job's own few tags, never
    /// every tag under the prefix).
    pub async fn commits_of_job(&self) -> Result<Vec<String>, ArchiveError> {
        let job_id = self.job_id()?;
        let prefix = self.commits_prefix(job_id);
        let depth = prefix.parts().count();
        let notes: Vec<ObjectMeta> = self
            .store
            .list(Some(&prefix))
            .try_collect()
            .await
            .map_err(self.store_err("list", &prefix))?;
        let mut noted = BTreeSet::new();
        for o in notes.iter().filter(|o| o.size < 4096) {
            let parts: Vec<_> = o.location.parts().skip(depth).collect();
            let [tag, _node] = parts.as_slice() else {
                continue;
            };
            let tag = tag.as_ref();
            if check_name("checkpoint tag", tag).is_err() || noted.contains(tag) {
                continue;
            }
            let Ok(Some(bytes)) = self.get_opt(&o.location, tag, "commit marker").await else {
                continue;
            };
            if serde_json::from_slice::<CommitMarker>(&bytes).is_ok_and(|m| m.job_id == job_id) {
                noted.insert(tag.to_string());
            }
        }
        let mut tags = Vec::new();
        for tag in noted {
            match self.store.head(&self.manifest_key(&tag)).await {
                Ok(_) => {}
                Err(object_store::Error::NotFound { .. }) => tags.push(tag),
                Err(e) => return Err(self.store_err("head", &self.manifest_key(&tag))(e)),
            }
        }
        Ok(tags)
    }

    /// Removes the job's commit notes of a published tag (best effort: a leftover note is a few
    /// bytes, and [`Archiver::commits_of_job`] skips published tags anyway).
    async fn remove_commit_notes(&self, tag: &str) {
        let Some(job_id) = self.job else { return };
        let prefix = self.key([".jobs", &job_id.to_string(), tag]);
        let notes: Result<Vec<ObjectMeta>, _> = self.store.list(Some(&prefix)).try_collect().await;
        for o in notes.unwrap_or_default() {
            if let Err(e) = self.store.delete(&o.location).await {
                tracing::debug!(url = self.url, key = %o.location, "removing a commit note: {e}");
            }
        }
    }

    /// Writes `node`'s part of `tag` for this archiver's job with no files: the node holds nothing
    /// of the checkpoint, so publishing need not wait for it.
    pub async fn put_empty_part(&self, tag: &str, node: &str) -> Result<(), ArchiveError> {
        check_name("checkpoint tag", tag)?;
        check_name("node name", node)?;
        let part = PartManifest {
            format: manifest::PART_FORMAT.into(),
            version: manifest::VERSION,
            tag: tag.into(),
            node: node.into(),
            job_id: Some(self.job_id()?),
            created_unix_ms: unix_ms_now(),
            chunk_size: self.cfg.chunk_size as u64,
            dirs: Vec::new(),
            files: Vec::new(),
        };
        let key = self.part_key(tag, node);
        self.store
            .put(&key, PutPayload::from(part.to_json()))
            .await
            .map_err(self.store_err("put", &key))?;
        Ok(())
    }

    fn store_err(
        &self,
        op: &'static str,
        key: &ObjPath,
    ) -> impl FnOnce(object_store::Error) -> ArchiveError + use<> {
        let (url, key) = (self.url.clone(), key.to_string());
        move |error| ArchiveError::Store {
            url,
            op,
            key,
            error: Box::new(error),
        }
    }

    /// Reads a manifest object (`what` names it in messages: "MANIFEST", "parts/n1.json"); `None`
    /// when it does not exist. Anyone who can write the archive prefix can put an object there, so
    /// one larger than [`MAX_MANIFEST_BYTES`] is refused from its size alone, before its body is
    /// read, and the body is never read past the limit either (the size could lie).
    async fn get_opt(
        &self,
        key: &ObjPath,
        tag: &str,
        what: &str,
    ) -> Result<Option<bytes::Bytes>, ArchiveError> {
        let too_large = |size: u64| ArchiveError::BadManifest {
            url: self.url.clone(),
            tag: tag.into(),
            what: what.into(),
            reason: format!(
                "the object is {size} bytes, more than the {} MiB a manifest may be; it was not read",
                MAX_MANIFEST_BYTES >> 20
            ),
        };
        let got = match self.store.get(key).await {
            Ok(r) => r,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(self.store_err("get", key)(e)),
        };
        if got.meta.size > MAX_MANIFEST_BYTES {
            return Err(too_large(got.meta.size));
        }
        let mut body = Vec::with_capacity(got.meta.size as usize);
        let mut stream = got.into_stream();
        while let Some(piece) = stream.next().await {
            let piece = piece.map_err(self.store_err("get", key))?;
            if (body.len() + piece.len()) as u64 > MAX_MANIFEST_BYTES {
                return Err(too_large((body.len() + piece.len()) as u64));
            }
            body.extend_from_slice(&piece);
        }
        Ok(Some(body.into()))
    }

    /// The MANIFEST of `tag`, if there is one; an unusable one is an error.
    async fn manifest_opt(&self, tag: &str) -> Result<Option<Manifest>, ArchiveError> {
        let Some(bytes) = self
            .get_opt(&self.manifest_key(tag), tag, "MANIFEST")
            .await?
        else {
            return Ok(None);
        };
        Manifest::parse(&bytes, tag)
            .map(Some)
            .map_err(|reason| ArchiveError::BadManifest {
                url: self.url.clone(),
                tag: tag.into(),
                what: "MANIFEST".into(),
                reason,
            })
    }

    /// The MANIFEST of a complete checkpoint.
    pub async fn manifest(&self, tag: &str) -> Result<Manifest, ArchiveError> {
        check_name("checkpoint tag", tag)?;
        self.manifest_opt(tag)
            .await?
            .ok_or_else(|| ArchiveError::NotArchived {
                url: self.url.clone(),
                tag: tag.into(),
            })
    }

    async fn part_opt(&self, tag: &str, node: &str) -> Result<Option<PartManifest>, ArchiveError> {
        let what = format!("parts/{node}.json");
        let Some(bytes) = self.get_opt(&self.part_key(tag, node), tag, &what).await? else {
            return Ok(None);
        };
        PartManifest::parse(&bytes, tag, node)
            .map(Some)
            .map_err(|reason| ArchiveError::BadManifest {
                url: self.url.clone(),
                tag: tag.into(),
                what,
                reason,
            })
    }

    /// Sizes of the objects below `prefix`, by key.
    async fn object_sizes(
        &self,
        prefix: &ObjPath,
    ) -> Result<HashMap<ObjPath, (u64, u64)>, ArchiveError> {
        self.store
            .list(Some(prefix))
            .map_ok(|m| {
                let ms = m.last_modified.timestamp_millis().max(0) as u64;
                (m.location, (m.size, ms))
            })
            .try_collect()
            .await
            .map_err(self.store_err("list", prefix))
    }

    /// Checks that every data object of `m` exists with the size the manifest gives it: one listing,
    /// no data read. Catches missing and truncated objects; [`Archiver::verify`] catches the rest.
    pub async fn check_objects(&self, m: &Manifest) -> Result<(), ArchiveError> {
        let sizes = self.object_sizes(&self.data_prefix(&m.tag)).await?;
        let mut bad: Vec<Damaged> = Vec::new();
        for f in &m.files {
            match sizes.get(&self.data_key(&m.tag, &f.path)) {
                None => bad.push(Damaged {
                    path: f.path.clone(),
                    detail: "its data object is missing".into(),
                }),
                Some((size, _)) if *size != f.stored_size => bad.push(Damaged {
                    path: f.path.clone(),
                    detail: format!(
                        "its data object holds {size} bytes, the manifest says {}",
                        f.stored_size
                    ),
                }),
                Some(_) => {}
            }
        }
        self.corrupt(&m.tag, bad)
    }

    fn corrupt(&self, tag: &str, damaged: Vec<Damaged>) -> Result<(), ArchiveError> {
        if damaged.is_empty() {
            return Ok(());
        }
        Err(ArchiveError::Corrupt {
            url: self.url.clone(),
            tag: tag.into(),
            damaged,
        })
    }

    /// Writes MANIFEST once: a create-only put where the store supports it; when it already exists
    /// with the same bytes (another node published first) that is success.
    async fn put_manifest(&self, m: &Manifest) -> Result<Manifest, ArchiveError> {
        let key = self.manifest_key(&m.tag);
        let bytes = bytes::Bytes::from(m.to_json());
        check_manifest_size(&m.tag, "MANIFEST", bytes.len())?;
        let opts = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        match self
            .store
            .put_opts(&key, PutPayload::from(bytes.clone()), opts)
            .await
        {
            Ok(_) => Ok(m.clone()),
            Err(object_store::Error::NotImplemented { .. }) => {
                // The store cannot create-only; the content is deterministic, so overwriting a
                // concurrent publisher's identical MANIFEST is harmless.
                self.store
                    .put(&key, PutPayload::from(bytes))
                    .await
                    .map_err(self.store_err("put", &key))?;
                Ok(m.clone())
            }
            Err(
                object_store::Error::AlreadyExists { .. }
                | object_store::Error::Precondition { .. },
            ) => {
                let existing = self.manifest(&m.tag).await?;
                if existing != *m {
                    tracing::warn!(
                        tag = m.tag,
                        url = self.url,
                        "another node published a different MANIFEST first; keeping it"
                    );
                }
                Ok(existing)
            }
            Err(e) => Err(self.store_err("put", &key)(e)),
        }
    }

    /// Publishes `tag`'s MANIFEST once every node of `nodes` wrote its part — for this archiver's
    /// job, when it has one: a part another job left under a reused tag counts as missing. A node
    /// that holds nothing of the tag writes an empty part ([`Archiver::put_empty_part`]); the
    /// MANIFEST names the nodes that contributed files. Publishing is idempotent.
    pub async fn try_publish(
        &self,
        tag: &str,
        nodes: &[String],
        job: JobMeta,
    ) -> Result<Publish, ArchiveError> {
        check_name("checkpoint tag", tag)?;
        if nodes.is_empty() {
            return Err(ArchiveError::BadName {
                what: "node list",
                name: String::new(),
            });
        }
        for n in nodes {
            check_name("node name", n)?;
        }
        if let Some(m) = self.manifest_opt(tag).await? {
            return Ok(Publish::Published(m));
        }
        let mut parts = Vec::with_capacity(nodes.len());
        let mut missing = Vec::new();
        for node in nodes {
            match self.part_opt(tag, node).await? {
                Some(p) if self.job.is_none() || p.job_id == self.job => parts.push(p),
                _ => missing.push(node.clone()),
            }
        }
        if !missing.is_empty() {
            return Ok(Publish::Waiting { missing });
        }
        let m = manifest::merge(tag, job, parts).map_err(|c| ArchiveError::Conflict {
            tag: tag.into(),
            path: c.path,
            nodes: c.nodes,
        })?;
        // Belt and braces: every object the manifest names is there, with its size.
        self.check_objects(&m).await?;
        let m = self.put_manifest(&m).await?;
        tracing::info!(
            tag,
            url = self.url,
            files = m.files.len(),
            nodes = ?m.nodes,
            "checkpoint published"
        );
        self.remove_commit_notes(tag).await;
        Ok(Publish::Published(m))
    }

    /// The tags under the base prefix, oldest first.
    ///
    /// Memory stays bounded whatever the archive holds: MANIFESTs (up to 64 MiB each) are read
    /// `concurrency` at a time and each is dropped once its summary is taken (issue 10, defect 7).
    pub async fn list(&self) -> Result<Vec<CheckpointInfo>, ArchiveError> {
        let tags = self.tags().await?;
        let mut out: Vec<CheckpointInfo> = futures::stream::iter(tags)
            .map(|tag| async move { self.info(tag).await })
            .buffer_unordered(self.cfg.concurrency)
            .try_collect()
            .await?;
        out.sort_by(|a, b| (a.created_unix_ms, &a.tag).cmp(&(b.created_unix_ms, &b.tag)));
        Ok(out)
    }

    /// The names below the base prefix that can be tags.
    async fn tags(&self) -> Result<Vec<String>, ArchiveError> {
        let base = (!self.base.as_ref().is_empty()).then_some(&self.base);
        let listing = self
            .store
            .list_with_delimiter(base)
            .await
            .map_err(self.store_err("list", &self.base))?;
        Ok(listing
            .common_prefixes
            .iter()
            .filter_map(|p| p.filename())
            .filter(|t| check_name("checkpoint tag", t).is_ok())
            .map(String::from)
            .collect())
    }

    async fn info(&self, tag: String) -> Result<CheckpointInfo, ArchiveError> {
        match self.manifest_opt(&tag).await {
            Ok(Some(m)) => Ok(CheckpointInfo {
                poison: self.poisoned(&m).await?,
                tag,
                state: CheckpointState::Complete,
                files: m.files.len() as u64,
                raw_bytes: m.raw_bytes,
                stored_bytes: m.stored_bytes,
                ratio: Some(m.ratio()),
                created_unix_ms: m.created_unix_ms,
                job: Some(m.job.clone()),
                nodes: m.nodes.clone(),
                data_classes: manifest::storage_classes(&m.files),
            }),
            Ok(None) => {
                let data = self.object_sizes(&self.data_prefix(&tag)).await?;
                let parts_prefix = self.key([tag.as_str(), "parts"]);
                let part_objects = self.object_sizes(&parts_prefix).await?;
                let mut nodes = Vec::new();
                let mut raw = 0;
                let mut classes = BTreeSet::new();
                for key in part_objects.keys() {
                    let Some(node) = key.filename().and_then(|f| f.strip_suffix(".json")) else {
                        continue;
                    };
                    if check_name("node name", node).is_err() {
                        continue;
                    }
                    // An unreadable part just does not count.
                    if let Ok(Some(p)) = self.part_opt(&tag, node).await {
                        raw += p.raw_bytes();
                        nodes.push(node.to_string());
                        classes.extend(manifest::storage_classes(&p.files));
                    }
                }
                nodes.sort();
                Ok(CheckpointInfo {
                    tag,
                    state: CheckpointState::Partial,
                    files: data.len() as u64,
                    raw_bytes: raw,
                    stored_bytes: data.values().map(|(s, _)| s).sum(),
                    ratio: None,
                    created_unix_ms: data
                        .values()
                        .chain(part_objects.values())
                        .map(|(_, t)| *t)
                        .max()
                        .unwrap_or(0),
                    job: None,
                    nodes,
                    data_classes: classes.into_iter().collect(),
                    poison: None,
                })
            }
            Err(e @ ArchiveError::BadManifest { .. }) => {
                let ArchiveError::BadManifest { reason, .. } = e else {
                    unreachable!()
                };
                Ok(CheckpointInfo::invalid(tag, reason))
            }
            Err(e) => Err(e),
        }
    }

    /// The newest complete checkpoint (by manifest time) that is not in `exclude`, not poisoned,
    /// and whose data objects are all present with the right sizes ([`Archiver::latest_good`],
    /// without the poisoned ones it passed over).
    pub async fn latest(&self, exclude: &[String]) -> Result<Option<String>, ArchiveError> {
        Ok(self.latest_good(exclude).await?.tag)
    }

    /// The newest complete checkpoint (by manifest time) that is not in `exclude`, not poisoned
    /// ([`poison`]), and whose data objects are all present with the right sizes; with the
    /// poisoned newer ones it passed over, for the caller to say so. A restore that then finds
    /// damaged content fails with [`ArchiveError::Corrupt`]; call again with that tag excluded to
    /// fall back. Reads the MANIFESTs as [`Archiver::list`] does, then again one at a time, newest
    /// first, stopping at the first intact one: never more than `concurrency` in memory.
    pub async fn latest_good(&self, exclude: &[String]) -> Result<Latest, ArchiveError> {
        let mut all = self.list().await?;
        all.reverse();
        let mut poisoned = Vec::new();
        for info in all {
            if info.state != CheckpointState::Complete || exclude.contains(&info.tag) {
                continue;
            }
            if let Some(mark) = info.poison {
                poisoned.push((info.tag, mark));
                continue;
            }
            // Gone or replaced since the listing: the next one.
            let m = match self.manifest_opt(&info.tag).await {
                Ok(Some(m)) => m,
                Ok(None) | Err(ArchiveError::BadManifest { .. }) => continue,
                Err(e) => return Err(e),
            };
            match self.check_objects(&m).await {
                Ok(()) => {
                    return Ok(Latest {
                        tag: Some(info.tag),
                        poisoned,
                    });
                }
                Err(e) if e.is_corrupt() => {
                    tracing::warn!(
                        tag = info.tag,
                        url = self.url,
                        "skipping damaged checkpoint: {e}"
                    );
                }
                Err(e) => return Err(e),
            }
        }
        Ok(Latest {
            tag: None,
            poisoned,
        })
    }
}

/// What [`Archiver::latest_good`] found.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Latest {
    /// The newest intact checkpoint that is not poisoned.
    pub tag: Option<String>,
    /// The poisoned checkpoints passed over on the way, newest first, with their marks.
    pub poisoned: Vec<(String, sluice_proto::msg::PoisonMark)>,
}

#[cfg(test)]
mod tests;
