//! Stage-in: copying a job's datasets from their origin onto this node's hot tier.
//!
//! - Object stores (`s3://`, `az://`, `gs://`) are read by the agent itself, because only the agent holds
//!   the credentials. Listing is pipelined with the downloads; objects larger than the part size are
//!   fetched as parallel ranged GETs. Every response body streams through a reused buffer from the
//!   node's one [`Budget`] and is written at its offset, so the agent's memory is bounded by the
//!   budget, not by part sizes, datasets or jobs. Files are written as root with fd-relative,
//!   no-follow operations ([`sluice_core::safefs`]) and owned by the job user.
//! - POSIX sources are read by a helper process running with the job user's identity
//!   ([`copy_as_user`]), so a user can stage only what they could read themselves.
//!
//! - With `[peer]`, a multi-node job's datasets are shared by its nodes ([`peers`]): each
//!   `peer.unit_size` range of each object (or POSIX file, read by each node's helper as the job
//!   user: [`posix`]) is read from the origin by one owner node and fetched from it by the others
//!   as it arrives, so the origin serves each byte once per job. An object-store dataset is
//!   listed once per job too: one node lists it and the others take its listing
//!   ([`peers::listing`]). Every node ends with the whole dataset; a fetched unit's bytes stream
//!   through the same [`Budget`] buffers as an origin read's.
//! - With `[cache]`, an object the node's cache holds (same URL, ETag, size) is copied from it,
//!   and every object read is written into a new entry from the same buffers ([`crate::cache`]).
//!
//! - With `--stage-mode=shard`, each node stages only the files it owns and writes a manifest of
//!   the whole dataset ([`shard`]); object-store and POSIX sources alike. With
//!   `--stage-tier=shared`, each node writes the files it owns into the job's directory on the
//!   shared tier, which every node of the job sees ([`shared`]).
//!
//! - After an agent restart, a job's datasets on the hot tier resume ([`resume`]): files staged
//!   whole before, of the object version the origin lists now (or, for a POSIX source, whose
//!   source file the job user's helper finds at the version it copied) and unchanged since, are
//!   kept; the rest is read again. POSIX datasets shared with peers or through the cache, and the
//!   shared tier, are staged again from the start.
//!
//! Object keys are not file paths: [`map_key`] is the single place that decides where a key lands.
//!
//! Parts: [`budget`] (the node-wide download budget), [`object`] (object-store listings and ranged
//! downloads, each range from the origin or a peer), [`peers`] (the job's units on this node, what
//! the peer server serves from), [`posix`] (the parent side of a POSIX copy: starting the helper,
//! reading its progress, classifying its exit), [`copy_as_user`] (the helper itself, a separate
//! process as the job user), [`shard`] (which node owns which file, the shard manifest),
//! [`shared`] (the job's directory on the shared tier: each node's share, the wait for all of
//! them, removal), [`lustre`] (Lustre detection and stripe layouts), [`resume`] (the staging logs
//! a restarted agent resumes from), [`cache`] (the node's cross-job cache of staged objects and
//! POSIX files).
//!
//! The agent (`sluice-agent`) owns the jobs and calls in through [`StageCtx`]; the transfers
//! between nodes are `sluice-peer`'s.
#![forbid(unsafe_code)]

mod budget;
pub mod cache;
pub mod copy_as_user;
pub mod local_fs;
pub mod lustre;
mod object;
pub mod peers;
mod posix;
pub mod resume;
pub mod shard;
pub mod shared;
pub mod sink;

pub use budget::{Budget, Lease};
pub use object::{KeyPath, map_key};
pub use peers::{JobPeers, NodePeers, ReplicaPeers, WarmHere, error_chain, warm_nodes};
pub use shard::ShardPlan;

use sluice_core::config::Config;
use sluice_core::rt::lock;
use sluice_core::safefs::Owner;
use sluice_proto::msg::{StageProgress, StageState};
use sluice_proto::options::{Source, StageSpec};
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio_util::sync::CancellationToken;

/// [`StageError::code`] is each variant's name in snake_case, derived.
#[derive(Debug, Clone, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum StageError {
    #[error("dataset {dataset} not found — check the path (and the bucket or container name)")]
    NotFound { dataset: String },
    #[error("access to dataset {dataset} was denied: {detail}")]
    Denied { dataset: String, detail: String },
    #[error(
        "the hot tier of node {node} is full while staging {dataset} — stage less data, or ask your admin for room"
    )]
    NoSpace { node: String, dataset: String },
    #[error("reading {dataset}: {detail}")]
    Origin { dataset: String, detail: String },
    #[error("writing {path} on the hot tier: {detail}")]
    HotTier { path: String, detail: String },
    #[error(
        "{dataset}: {count} object key(s) cannot be file names and were not staged (e.g. '{example}'); rename them"
    )]
    BadKeys {
        dataset: String,
        count: u64,
        example: String,
    },
    #[error(
        "{dataset} holds object keys with '.' or '..' segments, which cannot be file names; it was not staged — rename those objects"
    )]
    UnsafeKeys { dataset: String },
    #[error(
        "cannot reach the object store holding {dataset} (connection failed, after retries) — the store may be down; resubmit later, or ask your admin"
    )]
    Unreachable { dataset: String },
    #[error("staging {dataset} was cancelled (the job ended or the agent stopped)")]
    Cancelled { dataset: String },
    #[error("node {node} of the job could not stage its share into the shared tier: {detail}")]
    SharedPeer { node: String, detail: String },
}

impl StageError {
    /// A stable word for this error, for the `sluice_failures_total{operation="stage",code}`
    /// label (the agent's `metrics`). Dashboards and alerts query these words: keep them.
    pub fn code(&self) -> &'static str {
        self.into()
    }
}

/// Live counters of one dataset's staging, read by status requests while workers update them.
#[derive(Debug)]
pub struct Progress {
    pub name: String,
    pub source: String,
    state: Mutex<StageState>,
    files_done: AtomicU64,
    files_total: AtomicU64,
    bytes_done: AtomicU64,
    bytes_total: AtomicU64,
    /// Of `bytes_done`: read from the origin by this node, and taken from the job's other nodes.
    origin_bytes: AtomicU64,
    peer_bytes: AtomicU64,
    /// Of `bytes_done`: placed from this node's cache.
    cache_bytes: AtomicU64,
    /// Of `bytes_done`: files a restarted agent found staged whole and kept ([`resume`]).
    resumed_bytes: AtomicU64,
    started: Mutex<Option<Instant>>,
    elapsed_ms: AtomicU64,
    error: Mutex<Option<String>>,
}

const UNKNOWN: u64 = u64::MAX;

impl Progress {
    pub fn new(spec: &StageSpec) -> Progress {
        Progress {
            name: spec.name.clone(),
            source: spec.source.to_string(),
            state: Mutex::new(StageState::Pending),
            files_done: AtomicU64::new(0),
            files_total: AtomicU64::new(UNKNOWN),
            bytes_done: AtomicU64::new(0),
            bytes_total: AtomicU64::new(UNKNOWN),
            origin_bytes: AtomicU64::new(0),
            peer_bytes: AtomicU64::new(0),
            cache_bytes: AtomicU64::new(0),
            resumed_bytes: AtomicU64::new(0),
            started: Mutex::new(None),
            elapsed_ms: AtomicU64::new(0),
            error: Mutex::new(None),
        }
    }

    fn set_state(&self, state: StageState) {
        if state == StageState::Listing {
            *lock(&self.started) = Some(Instant::now());
        }
        if matches!(state, StageState::Done | StageState::Failed)
            && let Some(t) = *lock(&self.started)
        {
            self.elapsed_ms
                .store(t.elapsed().as_millis() as u64, Ordering::Relaxed);
        }
        *lock(&self.state) = state;
    }

    fn fail(&self, e: &StageError) {
        *lock(&self.error) = Some(e.to_string());
        self.set_state(StageState::Failed);
    }

    /// Takes in a progress line of the copy helper.
    fn apply(&self, event: copy_as_user::Event) {
        use copy_as_user::Event;
        match event {
            Event::Total { files, bytes } => {
                self.files_total.store(files, Ordering::Relaxed);
                self.bytes_total.store(bytes, Ordering::Relaxed);
            }
            Event::Progress { files, bytes } => {
                self.files_done.store(files, Ordering::Relaxed);
                self.bytes_done.store(bytes, Ordering::Relaxed);
                // Every node reads a POSIX source itself.
                self.origin_bytes.store(bytes, Ordering::Relaxed);
            }
        }
    }

    /// Adds what `part` staged for the same dataset (this node's part of a lost node's share on the
    /// shared tier) to this dataset's files and bytes, so that `sluice job` counts everything the
    /// node wrote.
    pub fn absorb(&self, part: &Progress) {
        for (mine, theirs) in [
            (&self.files_total, &part.files_total),
            (&self.bytes_total, &part.bytes_total),
        ] {
            let add = theirs.load(Ordering::Relaxed);
            if add != UNKNOWN {
                let _ = mine.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                    Some(if v == UNKNOWN { add } else { v + add })
                });
            }
        }
        for (mine, theirs) in [
            (&self.files_done, &part.files_done),
            (&self.bytes_done, &part.bytes_done),
            (&self.origin_bytes, &part.origin_bytes),
            (&self.peer_bytes, &part.peer_bytes),
            (&self.cache_bytes, &part.cache_bytes),
            (&self.resumed_bytes, &part.resumed_bytes),
        ] {
            mine.fetch_add(theirs.load(Ordering::Relaxed), Ordering::Relaxed);
        }
    }

    /// A whole file of `size` bytes placed from this node's cache.
    fn file_from_cache(&self, size: u64) {
        self.file_done(size, &self.cache_bytes);
    }

    /// A whole file of `size` bytes a restarted agent found staged and kept ([`resume`]).
    fn file_kept(&self, size: u64) {
        self.file_done(size, &self.resumed_bytes);
    }

    /// A whole file of `size` bytes staged, counted also in `from` (where its bytes came from).
    fn file_done(&self, size: u64, from: &AtomicU64) {
        self.bytes_done.fetch_add(size, Ordering::Relaxed);
        from.fetch_add(size, Ordering::Relaxed);
        self.files_done.fetch_add(1, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> StageProgress {
        let state = *lock(&self.state);
        let elapsed_ms = match (state, *lock(&self.started)) {
            (StageState::Listing | StageState::Copying, Some(t)) => t.elapsed().as_millis() as u64,
            _ => self.elapsed_ms.load(Ordering::Relaxed),
        };
        let known = |v: u64| (v != UNKNOWN).then_some(v);
        StageProgress {
            name: self.name.clone(),
            source: self.source.clone(),
            state,
            files_done: self.files_done.load(Ordering::Relaxed),
            files_total: known(self.files_total.load(Ordering::Relaxed)),
            bytes_done: self.bytes_done.load(Ordering::Relaxed),
            bytes_total: known(self.bytes_total.load(Ordering::Relaxed)),
            origin_bytes: self.origin_bytes.load(Ordering::Relaxed),
            peer_bytes: self.peer_bytes.load(Ordering::Relaxed),
            cache_bytes: self.cache_bytes.load(Ordering::Relaxed),
            resumed_bytes: self.resumed_bytes.load(Ordering::Relaxed),
            elapsed_ms,
            error: lock(&self.error).clone(),
        }
    }
}

/// What a staging run needs to know about its job.
pub struct StageCtx {
    pub cfg: Arc<Config>,
    pub owner: Owner,
    pub user: String,
    /// `<hot>/jobs/<id>/stage`, as a path (for the user-identity helper) and as an fd (for root).
    pub stage_path: PathBuf,
    pub stage_fd: Arc<OwnedFd>,
    /// The `sluiced` binary, for `copy-as-user`.
    pub helper_exe: PathBuf,
    pub cancel: CancellationToken,
    /// The node's download budget, shared by every staging run of the agent.
    pub budget: Arc<Budget>,
    /// `Some`: `stage_fd` is the job's directory on the shared tier ([`shared`]), which the job's
    /// other nodes write into too: directories may exist already, a file left by an earlier run of
    /// the job id is replaced, files get the layout of their size class, and no shard manifest is
    /// written (every node sees every file).
    pub shared_tier: Option<Arc<shared::Layout>>,
    /// The node's cross-job cache (`[cache]`): object-store datasets are taken from it where it
    /// holds their objects, and fill it as they are staged ([`crate::cache`]).
    pub cache: Option<Arc<crate::cache::Cache>>,
    /// The job's staging logs ([`resume`]): datasets on the node's hot tier (object stores, and
    /// POSIX sources the helper copies whole) note the files they staged whole, and, after an
    /// agent restart, keep those rather than read them again. `None`: nothing is noted or kept
    /// (a step's datasets, the tests' runs).
    pub resume: Option<Arc<resume::JobResume>>,
}

/// How a dataset is staged with respect to the job's other nodes.
#[derive(Clone, Copy)]
pub enum Sharing<'a> {
    /// This node reads the whole dataset from the origin.
    Alone,
    /// The whole dataset, each unit read from the origin by one node of the job and taken from it
    /// by the others (object stores, and POSIX sources through the copy helper: [`posix`]).
    /// `peers` counts the job's datasets shared so, and each must be staged through it exactly
    /// once.
    Peers(&'a Arc<JobPeers>),
    /// Only the files this node owns, plus the manifest of the whole dataset.
    Shard(&'a ShardPlan),
}

/// Stages one dataset into `$SLUICE_STAGE_DIR/NAME`, updating `progress`.
pub async fn stage(
    ctx: &StageCtx,
    spec: &StageSpec,
    progress: Arc<Progress>,
) -> Result<(), StageError> {
    stage_with(ctx, spec, progress, Sharing::Alone).await
}

/// [`stage`], shared with the job's other nodes as `sharing` says.
pub async fn stage_with(
    ctx: &StageCtx,
    spec: &StageSpec,
    progress: Arc<Progress>,
    sharing: Sharing<'_>,
) -> Result<(), StageError> {
    progress.set_state(StageState::Listing);
    let shard = match sharing {
        Sharing::Shard(plan) => Some(plan),
        _ => None,
    };
    let run = async {
        match &spec.source {
            Source::Posix { path } => posix::stage(ctx, spec, path, &progress, sharing).await,
            Source::Object {
                scheme,
                bucket,
                prefix,
            } => {
                let source = spec.source.to_string();
                let store =
                    sluice_archive::store::open(&ctx.cfg, *scheme, bucket).map_err(|e| {
                        StageError::Origin {
                            dataset: source.clone(),
                            detail: e.to_string(),
                        }
                    })?;
                let peers = match sharing {
                    Sharing::Peers(p) => Some(p.clone()),
                    _ => None,
                };
                object::stage(ctx, spec, store, prefix, progress.clone(), peers, shard).await
            }
        }
    };
    let result = tokio::select! {
        r = run => r,
        _ = ctx.cancel.cancelled() => Err(StageError::Cancelled { dataset: spec.source.to_string() }),
    };
    match &result {
        Ok(()) => progress.set_state(StageState::Done),
        Err(e) => progress.fail(e),
    }
    result
}

/// `sluice cache warm URL`: fills the node's cache with the dataset at `url` (object stores only),
/// as staging would, but into the cache alone.
pub async fn warm(
    cfg: Arc<Config>,
    budget: Arc<Budget>,
    cache: Arc<crate::cache::Cache>,
    cancel: CancellationToken,
    url: &str,
) -> Result<sluice_proto::msg::CacheWarmed, StageError> {
    tokio::select! {
        r = object::warm(cfg, budget, cache, url) => r,
        _ = cancel.cancelled() => Err(StageError::Cancelled { dataset: url.to_string() }),
    }
}

/// Whether `errno` says the file system (or the user's quota) is full: `ENOSPC` or `EDQUOT`.
pub fn is_no_space(errno: Option<i32>) -> bool {
    errno == Some(nix::errno::Errno::ENOSPC as i32)
        || errno == Some(nix::errno::Errno::EDQUOT as i32)
}

/// A write to the hot tier that failed with `errno`: [`StageError::NoSpace`] for `dataset` on
/// `node` when the tier (or the user's quota) is full, else [`StageError::HotTier`] for `path`.
pub(crate) fn hot_tier_error(
    node: &str,
    dataset: &str,
    path: &str,
    errno: Option<i32>,
    detail: String,
) -> StageError {
    if is_no_space(errno) {
        StageError::NoSpace {
            node: node.to_string(),
            dataset: dataset.to_string(),
        }
    } else {
        StageError::HotTier {
            path: path.to_string(),
            detail,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `sluice_failures_total{operation="stage",code}` words (derived from the variants' names):
    /// pinned, so a renamed variant cannot change what dashboards query.
    #[test]
    fn error_codes_are_stable_words() {
        let (d, n) = (|| "ds".to_string(), String::new);
        #[rustfmt::skip]
        let codes = [
            (StageError::NotFound { dataset: d() }, "not_found"),
            (StageError::Denied { dataset: d(), detail: n() }, "denied"),
            (StageError::NoSpace { node: n(), dataset: d() }, "no_space"),
            (StageError::Origin { dataset: d(), detail: n() }, "origin"),
            (StageError::HotTier { path: n(), detail: n() }, "hot_tier"),
            (StageError::BadKeys { dataset: d(), count: 1, example: n() }, "bad_keys"),
            (StageError::UnsafeKeys { dataset: d() }, "unsafe_keys"),
            (StageError::Unreachable { dataset: d() }, "unreachable"),
            (StageError::Cancelled { dataset: d() }, "cancelled"),
            (StageError::SharedPeer { node: n(), detail: n() }, "shared_peer"),
        ];
        for (error, code) in codes {
            assert_eq!(error.code(), code, "{error:?}");
        }
    }

    #[test]
    fn a_takeover_part_counts_as_the_nodes_own_staging() {
        let spec = sluice_proto::options::parse_stage_entry("ds=s3://b/ds").unwrap();
        let own = Progress::new(&spec);
        own.files_total.store(3, Ordering::Relaxed);
        own.bytes_total.store(300, Ordering::Relaxed);
        own.apply(copy_as_user::Event::Progress {
            files: 3,
            bytes: 300,
        });
        let part = Progress::new(&spec);
        part.apply(copy_as_user::Event::Total {
            files: 2,
            bytes: 50,
        });
        part.apply(copy_as_user::Event::Progress {
            files: 2,
            bytes: 50,
        });
        own.absorb(&part);
        let s = own.snapshot();
        assert_eq!(
            (s.files_done, s.files_total, s.bytes_done, s.bytes_total),
            (5, Some(5), 350, Some(350))
        );
        assert_eq!(s.origin_bytes, 350);
        // A part that never listed adds what it did, and no total.
        own.absorb(&Progress::new(&spec));
        assert_eq!(own.snapshot().bytes_total, Some(350));
    }
}
