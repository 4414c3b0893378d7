//! Stage-in from object stores: pipelined listing, one download task per object, parallel ranged
//! GETs for large objects, every body streamed through a [`Budget`] buffer to its offset.
//!
//! Shared with the job's other nodes ([`JobPeers`]), an object's ranges are its peer units: this
//! node GETs the ones it owns, hashing them as they arrive, and fetches the others from their
//! owners, through the same budget buffers; a unit its owner cannot serve is taken from the next
//! owner, or read from the origin (see `unit_from_peers` for which answer leads where). A node
//! that misses its own cache first asks the job's other nodes whether theirs holds the object
//! (once per object, and only for one it owns units of): if one does, it takes its own units from
//! that cache instead of the origin (`unit_from_peer_cache`), and the other nodes take them from it
//! as usual.

use super::peers::NextStep;
use super::peers::listing::{Listed, Listing};
use super::resume::{self, DatasetLog};
use super::shard::{ShardManifest, ShardPlan};
use super::sink::{HashingSink, PeerUnit, WriteAt};
use super::{
    Budget, JobPeers, Lease, Progress, StageCtx, StageError, hot_tier_error, is_no_space, local_fs,
};
use crate::cache::{Cache, Fill, Hit, Key};
use futures::StreamExt;
use object_store::path::Path as ObjPath;
use object_store::{GetOptions, ObjectMeta, ObjectStore, ObjectStoreExt};
use sluice_archive::store::{self, StoreErrorKind};
use sluice_core::rt::{blocking, lock};
use sluice_core::safefs::{self, Owner};
use sluice_peer::{CachedObject, HashFrom, Unit, UnitPieces, units_of, versioned};
use sluice_proto::msg::StageState;
use sluice_proto::options::StageSpec;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::task::JoinSet;

/// Where an object key lands, relative to the dataset directory.
#[derive(Debug, PartialEq, Eq)]
pub enum KeyPath {
    /// A file at these path components.
    File(Vec<String>),
    /// A zero-byte "directory marker" (`dir/`), as consoles create: nothing to write.
    DirMarker,
    /// The key cannot be a file name below the dataset directory.
    Reject,
}

/// Maps `key` (listed under `prefix`) to path components below the dataset directory. Every
/// component must be a plain file name: no `.`/`..`, no empty segments, no NUL, bounded depth.
pub fn map_key(prefix: &str, key: &str) -> KeyPath {
    let rest = if prefix.is_empty() {
        key
    } else {
        match key.strip_prefix(prefix).and_then(|r| r.strip_prefix('/')) {
            Some(r) => r,
            None => return KeyPath::Reject,
        }
    };
    if rest.is_empty() {
        return KeyPath::Reject;
    }
    let (rest, marker) = match rest.strip_suffix('/') {
        Some(r) => (r, true),
        None => (rest, false),
    };
    let parts: Vec<&str> = rest.split('/').collect();
    if parts.len() > safefs::MAX_DEPTH
        || parts
            .iter()
            .any(|p| safefs::check_component(p).is_err() || p.len() > 255)
    {
        return KeyPath::Reject;
    }
    if marker {
        KeyPath::DirMarker
    } else {
        KeyPath::File(parts.into_iter().map(String::from).collect())
    }
}

/// The store's error as the job will show it, decided from its kind (never its text).
pub(crate) fn origin_error(source: &str, e: object_store::Error) -> StageError {
    let dataset = source.to_string();
    // A key with '.' or '..' segments is the dataset's problem, whatever the store says.
    if let object_store::Error::InvalidPath { .. } = e {
        return StageError::UnsafeKeys { dataset };
    }
    // Every GET asks for the ETag the listing gave (If-Match).
    if let object_store::Error::Precondition { .. } = e {
        return StageError::Origin {
            dataset,
            detail: "the object changed while it was being staged (it no longer has the ETag it was listed with); resubmit the job to stage the new version".into(),
        };
    }
    match store::classify(&e) {
        // A missing bucket or container is the user's mistake, like a missing prefix.
        StoreErrorKind::NotFound => StageError::NotFound { dataset },
        StoreErrorKind::Denied => StageError::Denied {
            dataset,
            detail: store::describe(&e),
        },
        // No answer, after object_store's retries ([retry] keeps max_retries >= 1).
        StoreErrorKind::Unreachable | StoreErrorKind::TimedOut => {
            StageError::Unreachable { dataset }
        }
        StoreErrorKind::Throttled | StoreErrorKind::Other => StageError::Origin {
            dataset,
            detail: store::describe(&e),
        },
    }
}

/// Downloads objects of one dataset; shared by its download tasks.
struct Fetcher {
    store: Arc<dyn ObjectStore>,
    /// Request slots and buffers, shared with every other download on the node.
    budget: Arc<Budget>,
    source: String,
    node: String,
    part_size: u64,
    owner: Owner,
    progress: Arc<Progress>,
    /// The job's peers, when the dataset is shared with the job's other nodes.
    peers: Option<Arc<JobPeers>>,
    /// The dataset's name: unit file names are `NAME/path` (`NAME` for a single object).
    name: String,
    /// Staging into the job's directory on the shared tier (see [`StageCtx::shared_tier`]).
    shared_tier: Option<Arc<super::shared::Layout>>,
    /// The node's cache: objects are copied from it when it has them, and filled into it as
    /// they are staged ([`crate::cache`]).
    cache: Option<Arc<Cache>>,
    cfg: Arc<sluice_core::config::Config>,
    /// `s3://bucket`: objects' URLs are this and their location (the cache's keys).
    bucket_url: String,
    /// The dataset's staging log: files staged whole are noted in it, and after an agent restart
    /// those it names are kept rather than read again ([`super::resume`]).
    log: Option<Arc<DatasetLog>>,
    /// The stage directory holds what a run before an agent restart left: a file is created in
    /// place of whatever is at its path, and directories that exist are used.
    replace: bool,
}

/// Where an object's bytes go: the job's file, the cache entry being filled beside it (the same
/// bytes at the same offsets), and the ETag every GET of the object asks for.
struct Dest {
    file: Arc<std::fs::File>,
    tee: Option<Fill>,
    etag: Option<String>,
    /// On a local file system, taken around each write: there the kernel serializes writes to one
    /// file anyway, and the parts waiting for it sleep here rather than spin on the inode's lock
    /// (see [`local_fs::one_writer`]).
    writing: Option<Mutex<()>>,
    /// The node's cache, which a full hot tier takes room from before it fails the job.
    cache: Option<Arc<Cache>>,
}

impl Dest {
    fn new(
        file: Arc<std::fs::File>,
        tee: Option<Fill>,
        etag: Option<String>,
        cache: Option<Arc<Cache>>,
    ) -> Dest {
        let writing = local_fs::one_writer(&file).then(|| Mutex::new(()));
        Dest {
            file,
            tee,
            etag,
            writing,
            cache,
        }
    }
}

impl WriteAt for Dest {
    /// Writes `buf` at `offset` of the job's file and of the cache entry beside it.
    fn write_all_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        let _one = self.writing.as_ref().map(lock);
        let mut r = sluice_core::pagecache::write_all_at(&self.file, buf, offset);
        // A full hot tier takes room from the cache before it fails the job.
        while r.as_ref().is_err_and(|e| is_no_space(e.raw_os_error()))
            && self
                .cache
                .as_ref()
                .is_some_and(|c| c.yield_space(buf.len() as u64 + (64 << 20)) > 0)
        {
            r = sluice_core::pagecache::write_all_at(&self.file, buf, offset);
        }
        if let (Ok(()), Some(fill)) = (&r, &self.tee) {
            fill.write_at(buf, offset);
        }
        r
    }
}

/// Where an object's staged copy is, for serving its units to peers: the directory its path is
/// relative to, its path below it, and its unit file name.
struct Staged {
    root: Arc<OwnedFd>,
    unit_file: String,
    /// Where the path below `root` starts in `unit_file`.
    rel_at: usize,
}

impl Staged {
    /// The object listed as `meta`, staged at `path` below `root`, whose first `rel_at` bytes
    /// are not part of the path below `root` (the dataset's `NAME/`, or nothing for a dataset
    /// that is one object).
    ///
    /// Its units go by `path` and the version this node listed (the ETag, else the version id):
    /// two nodes that listed an object on either side of its overwrite never exchange its units.
    /// A node asked for a unit of a version it did not list answers `NotOwner` at once, so each
    /// node reads what it misses from the origin, with the `If-Match` of its own listing, and ends
    /// with the version it listed, whole — never a file of two versions' ranges, and never one
    /// cached under the other version's key. (Where the origin no longer has a node's version,
    /// that node fails the job with "the object changed while it was being staged".)
    fn new(root: Arc<OwnedFd>, path: String, rel_at: usize, meta: &ObjectMeta) -> Staged {
        let version = meta.e_tag.as_deref().or(meta.version.as_deref());
        Staged {
            root,
            unit_file: versioned(&path, version),
            rel_at,
        }
    }
}

impl Fetcher {
    fn hot_error(&self, path: &str, errno: Option<i32>, detail: String) -> StageError {
        hot_tier_error(&self.node, &self.source, path, errno, detail)
    }

    fn safefs_error(&self, path: &str, e: safefs::SafeFsError) -> StageError {
        self.hot_error(path, e.errno().map(|e| e as i32), e.to_string())
    }

    /// Creates `parts` below `root` and fills it with the object.
    async fn fetch(
        self: Arc<Self>,
        root: Arc<OwnedFd>,
        parts: Vec<String>,
        meta: ObjectMeta,
    ) -> Result<(), StageError> {
        let rel = parts.join("/");
        let owner = self.owner;
        let staged = Staged::new(
            root.clone(),
            format!("{}/{rel}", self.name),
            self.name.len() + 1,
            &meta,
        );
        let path = format!("{}/{rel}", self.name);
        let staged = match self.resume(&root, &rel, &path, &meta, staged).await {
            Ok(()) => return Ok(()),
            Err(staged) => staged,
        };
        if let Some(linked) = self.link_from_cache(&root, &parts, &meta).await {
            return linked;
        }
        let (shared_tier, size, replace) = (self.shared_tier.clone(), meta.size, self.replace);
        let file = blocking(move || {
            let (file_name, dirs) = parts
                .split_last()
                .expect("map_key yields at least one component");
            let dirs: Vec<&str> = dirs.iter().map(String::as_str).collect();
            let d = safefs::ensure_dirs(&root, &dirs, Some(owner)).map_err(errno_text)?;
            new_file(&d, file_name, size, owner, shared_tier.as_deref(), replace)
        })
        .await
        .map_err(|(errno, detail)| self.hot_error(&rel, errno, detail))?;
        self.fill_and_log(file, &rel, path, meta, staged).await
    }

    /// With `[cache] link_hits`, for a job staging alone on this node's hot tier: links the
    /// cache's entry of the object as `parts` below `root` (see `cache`, Linked hits). `None`:
    /// stage it as usual (no such entry, not such a job, or the link could not be made: then the
    /// usual staging copies it from the cache).
    async fn link_from_cache(
        &self,
        root: &Arc<OwnedFd>,
        parts: &[String],
        meta: &ObjectMeta,
    ) -> Option<Result<(), StageError>> {
        let cache = self.cache.clone().filter(|c| c.links_hits())?;
        if self.peers.is_some() || self.shared_tier.is_some() {
            return None;
        }
        let key = Key::of(&self.cfg, &self.bucket_url, meta)?;
        let rel = parts.join("/");
        let (root, parts, owner, replace) =
            (root.clone(), parts.to_vec(), self.owner, self.replace);
        let linked = blocking(move || {
            let hit = cache.lookup(&key)?;
            let (name, dirs) = parts
                .split_last()
                .expect("map_key yields at least one component");
            let dirs: Vec<&str> = dirs.iter().map(String::as_str).collect();
            let made = safefs::ensure_dirs(&root, &dirs, Some(owner)).and_then(|d| {
                if replace {
                    // What the run before an agent restart left there.
                    safefs::remove_tree(&d, name, owner.into()).and_then(|r| r.all_gone(name))?;
                }
                Ok(d)
            });
            Some(made.map(|d| (hit.link_into(&d, name), name.clone())))
        })
        .await?;
        match linked {
            Err(e) => Some(Err(self.safefs_error(&rel, e))),
            Ok((Ok(()), _)) => {
                self.progress.file_from_cache(meta.size);
                Some(Ok(()))
            }
            Ok((Err(e), name)) => {
                tracing::warn!(
                    "{}: linking the cache's copy of {rel} as {name}: {e}; copying it",
                    self.source
                );
                None
            }
        }
    }

    /// [`fill`](Self::fill), then notes in the staging log that the file at `path` (below the
    /// stage directory) is whole, as it is now.
    async fn fill_and_log(
        self: Arc<Self>,
        file: std::fs::File,
        rel: &str,
        path: String,
        meta: ObjectMeta,
        staged: Staged,
    ) -> Result<(), StageError> {
        // The agent's own descriptor: what it wrote, whatever is at the path by then.
        let probe = self.log.as_ref().and_then(|_| file.try_clone().ok());
        self.clone().fill(file, rel, meta.clone(), staged).await?;
        if let (Some(log), Some(probe)) = (&self.log, probe)
            && let Ok(id) = blocking(move || resume::Identity::of(&probe)).await
        {
            log.done(resume::Entry::new(path, &meta, id)).await;
        }
        Ok(())
    }

    /// After an agent restart: keeps the staged file `rel` below `root` (at `path` below the
    /// stage directory) when the staging log says the run before staged it whole from the object
    /// the origin lists now as `meta`, and it is still that file ([`resume::resumable`]). Shared
    /// with the job's peers, its units are served with hashes of the file as it is read back now,
    /// if it is still that file after the read ([`resume::hash_kept`]), marked as read back: the
    /// job's other nodes never cache them. `Err(staged)`: not kept, stage it.
    async fn resume(
        &self,
        root: &Arc<OwnedFd>,
        rel: &str,
        path: &str,
        meta: &ObjectMeta,
        staged: Staged,
    ) -> Result<(), Staged> {
        let Some(entry) = self
            .log
            .as_ref()
            .and_then(|log| log.take(path))
            .filter(|e| e.describes(meta))
        else {
            return Err(staged);
        };
        let (r, rel_owned, owner) = (root.clone(), rel.to_string(), self.owner);
        let changed = || {
            tracing::debug!(
                "{}: {path} changed since it was staged; staging it again",
                self.source
            );
        };
        let size = meta.size;
        match (&self.peers, size > 0) {
            (Some(peers), true) => {
                let units = units_of(&staged.unit_file, size, peers.unit_size());
                let ranges: Vec<(u64, u64)> = units.iter().map(|u| (u.offset, u.len)).collect();
                let mut lease = self.budget.lease().await;
                let mut buf = std::mem::take(&mut lease.buf);
                let (hashes, buf) = blocking(move || {
                    let h = resume::hash_kept(&r, &rel_owned, owner, &entry, &ranges, &mut buf);
                    (h, buf)
                })
                .await;
                lease.buf = buf;
                drop(lease);
                let Some(hashes) = hashes else {
                    changed();
                    return Err(staged);
                };
                // Read back from a file the job user can write: for the job's copies only, never
                // for a cross-job cache (the mark travels with the units).
                peers.add_object(staged.root, staged.rel_at, &units);
                for (unit, hash) in units.iter().zip(hashes) {
                    peers.held_from(unit, hash, HashFrom::ReadBack);
                }
            }
            _ => {
                let kept = blocking(move || resume::resumable(&r, &rel_owned, owner, &entry)).await;
                if kept.is_none() {
                    changed();
                    return Err(staged);
                }
            }
        }
        self.progress.file_kept(size);
        Ok(())
    }

    /// GETs `range` of the object and writes it at the same offset of `file`, streaming the body
    /// through the lease's buffer; with `hasher`, hashes the bytes as they are written and returns
    /// it (for a peer unit's hash, as its owner read it). Fails unless exactly `range`'s bytes
    /// arrive.
    async fn get_part(
        &self,
        mut lease: Lease,
        file: Arc<Dest>,
        rel: &str,
        location: &ObjPath,
        range: std::ops::Range<u64>,
        mut hasher: Option<blake3::Hasher>,
    ) -> Result<Option<blake3::Hasher>, StageError> {
        let dataset = || format!("{}: {location}", self.source);
        let wrong_size = |got: u64| StageError::Origin {
            dataset: dataset(),
            detail: format!(
                "expected {} bytes at offset {}, got {got} (object changed while staging?)",
                range.end - range.start,
                range.start
            ),
        };
        let opts = GetOptions {
            range: Some(range.clone().into()),
            if_match: file.etag.clone(),
            ..GetOptions::default()
        };
        let mut body = self
            .store
            .get_opts(location, opts)
            .await
            .map_err(|e| origin_error(&dataset(), e))?
            .into_stream();
        let origin = &self.progress.origin_bytes;
        // The buffer's bytes belong at `at`; everything before `at` is written.
        let mut at = range.start;
        let mut buf = std::mem::take(&mut lease.buf);
        let cap = buf.capacity();
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| origin_error(&dataset(), e))?;
            let got = at - range.start + (buf.len() + chunk.len()) as u64;
            if got > range.end - range.start {
                return Err(wrong_size(got));
            }
            let mut rest = &chunk[..];
            while !rest.is_empty() {
                let n = rest.len().min(cap - buf.len());
                buf.extend_from_slice(&rest[..n]);
                rest = &rest[n..];
                if buf.len() == cap {
                    buf = self
                        .write_at(&file, rel, buf, &mut at, &mut hasher, origin)
                        .await?;
                }
            }
        }
        if !buf.is_empty() {
            buf = self
                .write_at(&file, rel, buf, &mut at, &mut hasher, origin)
                .await?;
        }
        lease.buf = buf;
        if at != range.end {
            return Err(wrong_size(at - range.start));
        }
        Ok(hasher)
    }

    /// Writes `buf` at `*at` of `file` on a blocking thread (hashing it there too, with a
    /// `hasher`), advances `*at`, counts the bytes as done and in `from`, and hands the buffer back
    /// empty.
    async fn write_at(
        &self,
        file: &Arc<Dest>,
        rel: &str,
        buf: Vec<u8>,
        at: &mut u64,
        hasher: &mut Option<blake3::Hasher>,
        from: &AtomicU64,
    ) -> Result<Vec<u8>, StageError> {
        let (d, offset, mut h) = (file.clone(), *at, hasher.take());
        let (mut buf, h, written) = blocking(move || {
            let r = d.write_all_at(&buf, offset);
            if let (Ok(()), Some(h)) = (&r, h.as_mut()) {
                h.update(&buf);
            }
            (buf, h, r)
        })
        .await;
        *hasher = h;
        written.map_err(|e| self.hot_error(rel, e.raw_os_error(), e.to_string()))?;
        let n = buf.len() as u64;
        *at += n;
        self.progress.bytes_done.fetch_add(n, Ordering::Relaxed);
        from.fetch_add(n, Ordering::Relaxed);
        buf.clear();
        Ok(buf)
    }

    /// Takes back the count of bytes written by an attempt whose bytes will be written again.
    fn uncount(&self, n: u64, from: &AtomicU64) {
        self.progress.bytes_done.fetch_sub(n, Ordering::Relaxed);
        from.fetch_sub(n, Ordering::Relaxed);
    }

    /// Writes the object's bytes into `file`: from the node's cache if it holds the object;
    /// else one GET for small objects, parallel ranged GETs of `part_size` for large ones, or,
    /// shared with the job's peers, unit by unit — filling a cache entry beside it (committed only
    /// if no unit came with a hash a peer read back from a staged copy, [`HashFrom::ReadBack`]).
    async fn fill(
        self: Arc<Self>,
        file: std::fs::File,
        rel: &str,
        meta: ObjectMeta,
        staged: Staged,
    ) -> Result<(), StageError> {
        let key = self
            .cache
            .as_ref()
            .and_then(|_| Key::of(&self.cfg, &self.bucket_url, &meta));
        let mut tee = None;
        if let (Some(cache), Some(key)) = (self.cache.clone(), key) {
            let k = key.clone();
            let c = cache.clone();
            if let Some(hit) = blocking(move || c.lookup(&k)).await {
                return self.fill_from_cache(hit, file, rel, &meta, staged).await;
            }
            match blocking(move || cache.begin_fill(key)).await {
                Ok(fill) => tee = Some(fill),
                Err(why) => tracing::info!("{}: not cached: {why}", self.source),
            }
        }
        let dest = Arc::new(Dest::new(
            Arc::new(file),
            tee,
            meta.e_tag.clone(),
            self.cache.clone(),
        ));
        let filled = match self.peers.clone() {
            Some(peers) => {
                let cached_at = self.peer_cache_of(&peers, &meta, &staged).await;
                self.clone()
                    .fill_shared(&peers, &dest, rel, meta, staged, cached_at)
                    .await
            }
            None => self.clone().fill_plain(&dest, rel, meta).await,
        };
        if filled.is_ok()
            && let Some(fill) = Arc::into_inner(dest).and_then(|d| d.tee)
        {
            blocking(move || fill.commit()).await;
        }
        filled
    }

    /// Places a cached object into `file`; shared with the job's peers, the object's units are
    /// this node's to serve, hashed as they are copied.
    async fn fill_from_cache(
        &self,
        hit: Hit,
        file: std::fs::File,
        rel: &str,
        meta: &ObjectMeta,
        staged: Staged,
    ) -> Result<(), StageError> {
        let unit_size = self.peers.as_ref().map(|p| p.unit_size());
        let (size, cache) = (meta.size, self.cache.clone());
        let copied = blocking(move || {
            let mut r = hit.copy_to(&file, unit_size);
            // A full hot tier takes room from the cache's other entries, then tries again.
            while r.as_ref().is_err_and(|e| is_no_space(e.raw_os_error()))
                && cache.as_ref().is_some_and(|c| c.yield_space(size) > 0)
            {
                r = file.set_len(0).and_then(|()| hit.copy_to(&file, unit_size));
            }
            r
        })
        .await
        .map_err(|e| self.hot_error(rel, e.raw_os_error(), e.to_string()))?;
        if let (Some(peers), Some(unit_size)) = (&self.peers, unit_size)
            && size > 0
        {
            let units = units_of(&staged.unit_file, size, unit_size);
            peers.add_object(staged.root, staged.rel_at, &units);
            for (unit, hash) in units.iter().zip(copied) {
                peers.held(unit, hash);
            }
        }
        self.progress.file_from_cache(size);
        Ok(())
    }

    /// [`fill`](Self::fill) from the origin alone.
    async fn fill_plain(
        self: Arc<Self>,
        file: &Arc<Dest>,
        rel: &str,
        meta: ObjectMeta,
    ) -> Result<(), StageError> {
        let size = meta.size;
        if size > self.part_size {
            let f = file.clone();
            blocking(move || local_fs::set_size(&f.file, size))
                .await
                .map_err(|e| self.hot_error(rel, e.raw_os_error(), e.to_string()))?;
        }
        let mut parts = JoinSet::new();
        let mut offset = 0;
        while offset < size {
            let end = (offset + self.part_size).min(size);
            let lease = self.budget.lease().await;
            let (this, file, location) = (self.clone(), file.clone(), meta.location.clone());
            let rel = rel.to_string();
            parts.spawn(async move {
                this.get_part(lease, file, &rel, &location, offset..end, None)
                    .await
                    .map(drop)
            });
            offset = end;
            while let Some(done) = parts.try_join_next() {
                done.expect("part task panicked")?;
            }
        }
        all_of(&mut parts, "part").await?;
        self.progress.files_done.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// The peer whose cross-job cache holds the object (this node's missed), when this node owns
    /// some of its units: it takes those from that cache before the origin. Asked only of an
    /// object the cache could hold (listed with an ETag or version), and never for one this
    /// node owns nothing of (its owners ask).
    async fn peer_cache_of(
        &self,
        peers: &Arc<JobPeers>,
        meta: &ObjectMeta,
        staged: &Staged,
    ) -> Option<(String, CachedObject)> {
        if meta.size == 0 {
            return None;
        }
        let key = Key::of(&self.cfg, &self.bucket_url, meta)?;
        let owns_some = units_of(&staged.unit_file, meta.size, peers.unit_size())
            .iter()
            .any(|u| peers.route(u).is_none());
        if !owns_some {
            return None;
        }
        let object = CachedObject {
            url: key.url,
            etag: key.etag,
            version: key.version,
            size: key.size,
        };
        let node = peers.find_cached(&object).await?;
        tracing::debug!("{}: {} is cached on peer {node}", self.source, object.url);
        Some((node, object))
    }

    /// [`fill`](Self::fill) for a dataset shared with the job's other nodes: the object's units
    /// this node owns are GETs from the origin (or, with `cached_at`, fetches from that peer's
    /// cache), the others fetches from their owners, all at once (a fetch waits for its owner's
    /// read without holding a budget buffer).
    async fn fill_shared(
        self: Arc<Self>,
        peers: &Arc<JobPeers>,
        file: &Arc<Dest>,
        rel: &str,
        meta: ObjectMeta,
        staged: Staged,
        cached_at: Option<(String, CachedObject)>,
    ) -> Result<(), StageError> {
        let (size, unit_size) = (meta.size, peers.unit_size());
        if size > unit_size {
            let f = file.clone();
            blocking(move || local_fs::set_size(&f.file, size))
                .await
                .map_err(|e| self.hot_error(rel, e.raw_os_error(), e.to_string()))?;
        }
        if size > 0 {
            let units = units_of(&staged.unit_file, size, unit_size);
            peers.add_object(staged.root, staged.rel_at, &units);
            let mut tasks = JoinSet::new();
            for unit in units {
                let (this, file, location) = (self.clone(), file.clone(), meta.location.clone());
                let rel = rel.to_string();
                match peers.route(&unit) {
                    None if cached_at
                        .as_ref()
                        .is_some_and(|(node, _)| peers.cache_usable(node)) =>
                    {
                        let (node, object) = cached_at.clone().expect("checked above");
                        tasks.spawn(async move {
                            this.unit_from_peer_cache(&file, &rel, &location, unit, &node, &object)
                                .await
                        });
                    }
                    // Another node's (its agent lost): within the job's fallback budget.
                    None if peers.is_fallback(&unit) => {
                        tasks.spawn(async move {
                            this.unit_from_origin_now(&file, &rel, &location, &unit)
                                .await
                        });
                    }
                    None => {
                        // Piece by piece, each through a budget slot as it frees: a node works on
                        // few units at a time and finishes them in turn (see `UnitPieces`).
                        let unit = Arc::new(unit);
                        let piece = UnitPieces::piece_size(
                            unit_size,
                            self.cfg.stage.concurrency,
                            self.part_size,
                        );
                        let pieces = UnitPieces::new(unit.len, piece);
                        let ranges: Vec<_> = pieces.ranges().collect();
                        let pieces = Arc::new(Mutex::new(pieces));
                        for (i, range) in ranges.into_iter().enumerate() {
                            let lease = self.budget.lease().await;
                            let (this, file, location) =
                                (this.clone(), file.clone(), location.clone());
                            let (rel, unit, pieces) = (rel.clone(), unit.clone(), pieces.clone());
                            tasks.spawn(async move {
                                this.piece_from_origin(
                                    lease, &file, &rel, &location, &unit, &pieces, i, range,
                                )
                                .await
                            });
                        }
                    }
                    Some(node) => {
                        tasks.spawn(async move {
                            this.unit_from_peers(&file, &rel, &location, unit, node)
                                .await
                        });
                    }
                }
                while let Some(done) = tasks.try_join_next() {
                    done.expect("unit task panicked")?;
                }
            }
            all_of(&mut tasks, "unit").await?;
        }
        self.progress.files_done.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// GETs piece `i` of `unit` (`range` within the unit) from the origin, hashing it; once it
    /// is the unit's last piece in, tells the job's peers this node holds the unit.
    #[allow(clippy::too_many_arguments)]
    async fn piece_from_origin(
        &self,
        lease: Lease,
        file: &Arc<Dest>,
        rel: &str,
        location: &ObjPath,
        unit: &Unit,
        pieces: &Mutex<UnitPieces>,
        i: usize,
        range: std::ops::Range<u64>,
    ) -> Result<(), StageError> {
        let peers = self.peers.as_ref().expect("a shared dataset has peers");
        let hasher = lock(pieces).hasher(i);
        let range = unit.offset + range.start..unit.offset + range.end;
        match self
            .get_part(lease, file.clone(), rel, location, range, Some(hasher))
            .await
        {
            Ok(hasher) => {
                let hash = lock(pieces).done(i, hasher.expect("hashed as it was read"));
                if let Some(hash) = hash {
                    peers.held(unit, hash);
                }
                Ok(())
            }
            Err(e) => {
                peers.failed(unit, e.to_string());
                Err(e)
            }
        }
    }

    /// Fetches `unit` from `node`, its owner, and writes it at its offset; where a failed fetch
    /// leads (another owner, the same one once more, or the origin) is [`JobPeers::next_after`]'s
    /// to say, as for POSIX datasets. Every origin read goes through the node's budget, so a lost
    /// node's units reach the origin no faster than `stage.concurrency` requests at a time,
    /// whatever the number of waiting units.
    async fn unit_from_peers(
        &self,
        file: &Arc<Dest>,
        rel: &str,
        location: &ObjPath,
        unit: Unit,
        mut node: String,
    ) -> Result<(), StageError> {
        let peers = self.peers.as_ref().expect("a shared dataset has peers");
        let mut retried: Option<String> = None;
        loop {
            let mut sink = self.peer_sink(file, rel, &unit);
            let fetched = peers.fetch(&node, &unit, &mut sink).await;
            let (written, hash, sink_error) = sink.close();
            let e = match fetched {
                Ok(from) => {
                    if let (HashFrom::ReadBack, Some(fill)) = (from, &file.tee) {
                        // Checked against a hash read back from a file its user could write: good
                        // for this job's copy, never for the cache other users' jobs read.
                        fill.taint(&format!(
                            "node {node} served part of it from a copy it kept over an agent restart, not from the origin"
                        ));
                    }
                    peers.held_from(&unit, hash.expect("a finished sink has a hash"), from);
                    return Ok(());
                }
                Err(e) => e,
            };
            self.uncount(written, &self.progress.peer_bytes);
            match peers.next_after(&unit, &node, &e, &mut retried, &self.source) {
                NextStep::From(next) => node = next,
                NextStep::Origin => {
                    return self.unit_from_origin_now(file, rel, location, &unit).await;
                }
                NextStep::Fail(why) => {
                    let e = sink_error.unwrap_or_else(|| StageError::HotTier {
                        path: rel.to_string(),
                        detail: why,
                    });
                    peers.failed(&unit, e.to_string());
                    return Err(e);
                }
            }
        }
    }

    /// Takes `unit`, which this node owns, from the cache of `node`, a peer that holds the whole
    /// object; the origin if that does not work out: the peer's cache no longer has it (this
    /// unit only), or the peer is slow, unreachable or answers wrong bytes (then its cache is not
    /// asked again for the job). Either way only this node's own units reach the origin, through
    /// its budget, as without a cache: a failing cache never makes the job's nodes all read it.
    async fn unit_from_peer_cache(
        &self,
        file: &Arc<Dest>,
        rel: &str,
        location: &ObjPath,
        unit: Unit,
        node: &str,
        object: &CachedObject,
    ) -> Result<(), StageError> {
        let peers = self.peers.as_ref().expect("a shared dataset has peers");
        let mut sink = self.peer_sink(file, rel, &unit);
        let fetched = peers.fetch_cached(node, object, &unit, &mut sink).await;
        let (written, hash, sink_error) = sink.close();
        match fetched {
            Ok(true) => {
                peers.held(&unit, hash.expect("a finished sink has a hash"));
                return Ok(());
            }
            Ok(false) => {}
            Err(e @ sluice_peer::PeerError::Sink { .. }) => {
                let e = sink_error.unwrap_or_else(|| StageError::HotTier {
                    path: rel.to_string(),
                    detail: super::peers::error_chain(&e),
                });
                peers.failed(&unit, e.to_string());
                return Err(e);
            }
            Err(e) => peers.cache_off(node, &super::peers::error_chain(&e)),
        }
        self.uncount(written, &self.progress.peer_bytes);
        self.unit_from_origin_now(file, rel, location, &unit).await
    }

    /// GETs `unit`, which this node now reads from the origin after a peer failed it (or its
    /// cache did not have it), in one request once a budget slot is free, and tells the job's peers
    /// this node holds it. Another node's unit waits for the job's fallback budget first
    /// ([`JobPeers::fallback`]).
    async fn unit_from_origin_now(
        &self,
        file: &Arc<Dest>,
        rel: &str,
        location: &ObjPath,
        unit: &Unit,
    ) -> Result<(), StageError> {
        let peers = self.peers.as_ref().expect("a shared dataset has peers");
        let _fallback = peers.fallback(unit).await;
        let lease = self.budget.lease().await;
        // One request: a fallback, not the owner's pipelined reads.
        let whole = UnitPieces::new(unit.len, unit.len.max(1024).next_power_of_two());
        self.piece_from_origin(
            lease,
            file,
            rel,
            location,
            unit,
            &Mutex::new(whole),
            0,
            0..unit.len,
        )
        .await
    }
}

impl Fetcher {
    /// Where a unit fetched from a peer goes: at its offset of `file`, through a buffer of the
    /// node's budget.
    fn peer_sink<'a>(
        &'a self,
        file: &Arc<Dest>,
        rel: &'a str,
        unit: &Unit,
    ) -> HashingSink<Dest, PeerUnit<'a>> {
        let target = PeerUnit {
            progress: &self.progress,
            node: &self.node,
            dataset: &self.source,
            rel,
        };
        HashingSink::buffered(file.clone(), unit.offset, self.budget.clone(), target)
    }
}

pub(super) async fn stage(
    ctx: &StageCtx,
    spec: &StageSpec,
    store: Arc<dyn ObjectStore>,
    prefix: &str,
    progress: Arc<Progress>,
    peers: Option<Arc<JobPeers>>,
    shard: Option<&ShardPlan>,
) -> Result<(), StageError> {
    let source = spec.source.to_string();
    let mut manifest = shard.map(|plan| ShardManifest::new(plan, &spec.name, &source));
    // However this ends, the job's peers learn that this node knows every unit it will.
    let _done = peers.as_ref().map(JobPeers::dataset_guard);
    // Resumed staging is for the node's own hot tier (the shared tier has its own marks).
    let resume = ctx.resume.clone().filter(|_| ctx.shared_tier.is_none());
    let replace = resume.as_ref().is_some_and(|r| r.resuming());
    let log = match resume {
        Some(r) => {
            let spec = spec.clone();
            let log = blocking(move || r.dataset(&spec)).await.map(Arc::new);
            if let Some(log) = &log {
                log.tick();
            }
            log
        }
        None => None,
    };
    let fetcher = Arc::new(Fetcher {
        store: store.clone(),
        budget: ctx.budget.clone(),
        source: source.clone(),
        node: ctx.cfg.node.clone(),
        part_size: ctx.cfg.stage.part_size,
        owner: ctx.owner,
        progress: progress.clone(),
        peers,
        name: spec.name.clone(),
        // Whose files these are decides what it may replace on the shared tier.
        shared_tier: ctx
            .shared_tier
            .as_ref()
            .map(|l| Arc::new(l.for_plan(shard))),
        cache: ctx.cache.clone(),
        cfg: ctx.cfg.clone(),
        bucket_url: spec.source.bucket_url().unwrap_or_default(),
        log,
        replace,
    });
    let (fd, name, owner) = (ctx.stage_fd.clone(), spec.name.clone(), ctx.owner);
    // On the shared tier every node sees every file: no manifest.
    if ctx.shared_tier.is_some() {
        manifest = None;
    }

    // A prefix may name one object rather than a "directory": then NAME is that file.
    let listed = Listing::open(
        store.clone(),
        prefix,
        &source,
        &spec.name,
        fetcher.peers.clone(),
    )
    .await?;
    let mut listing = match listed {
        Listed::Objects(listing) => listing,
        Listed::Single(meta) => {
            if let Some(plan) = shard {
                if let Some(m) = manifest.as_mut() {
                    m.add(plan, spec.name.clone(), meta.size);
                }
                if !plan.owns(&spec.name) {
                    progress.files_total.store(0, Ordering::Relaxed);
                    progress.bytes_total.store(0, Ordering::Relaxed);
                    return write_manifest(ctx, &fetcher, manifest).await;
                }
            }
            progress.files_total.store(1, Ordering::Relaxed);
            progress.bytes_total.store(meta.size, Ordering::Relaxed);
            progress.set_state(StageState::Copying);
            let staged = Staged::new(fd.clone(), name.clone(), 0, &meta);
            let staged = match fetcher.resume(&fd, &name, &name, &meta, staged).await {
                Ok(()) => return write_manifest(ctx, &fetcher, manifest).await,
                Err(staged) => staged,
            };
            let (shared_tier, size) = (fetcher.shared_tier.clone(), meta.size);
            let file = blocking(move || {
                new_file(&fd, &name, size, owner, shared_tier.as_deref(), replace)
            })
            .await
            .map_err(|(errno, detail)| fetcher.hot_error(&spec.name, errno, detail))?;
            let path = spec.name.clone();
            fetcher
                .clone()
                .fill_and_log(file, &spec.name, path, meta, staged)
                .await?;
            if let Some(log) = &fetcher.log {
                log.finish().await;
            }
            return write_manifest(ctx, &fetcher, manifest).await;
        }
    };

    let shared_tier = ctx.shared_tier.is_some();
    let root = blocking(move || {
        if shared_tier || replace {
            // The job's other nodes make it too, or the run before the agent's restart did.
            safefs::ensure_dir(&*fd, &name, Some(owner), 0o755)
        } else {
            safefs::create_dir(&*fd, &name, Some(owner), 0o755)
        }
    })
    .await
    .map(Arc::new)
    .map_err(|e| fetcher.safefs_error(&spec.name, e))?;
    let mut tasks: JoinSet<Result<(), StageError>> = JoinSet::new();
    let (mut files, mut bytes, mut bad, mut example) = (0u64, 0u64, 0u64, String::new());
    // Files of the dataset, this node's or not (a shard node may own none of them).
    let mut listed = 0u64;
    // Objects waiting for a download slot; bounds the tasks (and listing read-ahead) in memory.
    let max_pending = ctx.cfg.stage.concurrency * 4;
    while let Some(item) = listing.next().await {
        let meta = item?;
        let parts = match map_key(prefix, meta.location.as_ref()) {
            KeyPath::File(parts) => parts,
            KeyPath::DirMarker => continue,
            KeyPath::Reject => {
                bad += 1;
                if example.is_empty() {
                    example = meta.location.to_string();
                }
                continue;
            }
        };
        listed += 1;
        if let Some(plan) = shard {
            let path = format!("{}/{}", spec.name, parts.join("/"));
            let mine = plan.owns(&path);
            if let Some(m) = manifest.as_mut() {
                m.add(plan, path, meta.size);
            }
            if !mine {
                continue;
            }
        }
        files += 1;
        bytes += meta.size;
        if files == 1 {
            progress.set_state(StageState::Copying);
        }
        while tasks.len() >= max_pending {
            if let Some(done) = tasks.join_next().await {
                done.expect("stage task panicked")?;
            }
        }
        while let Some(done) = tasks.try_join_next() {
            done.expect("stage task panicked")?;
        }
        tasks.spawn(fetcher.clone().fetch(root.clone(), parts, meta));
    }
    progress.files_total.store(files, Ordering::Relaxed);
    progress.bytes_total.store(bytes, Ordering::Relaxed);
    all_of(&mut tasks, "stage").await?;
    if listed == 0 && bad == 0 {
        return Err(StageError::NotFound { dataset: source });
    }
    if bad > 0 {
        return Err(StageError::BadKeys {
            dataset: source,
            count: bad,
            example,
        });
    }
    if let Some(log) = &fetcher.log {
        // Files the run before the restart staged of objects the origin no longer lists.
        let gone = log.leftovers();
        if !gone.is_empty() {
            let (fd, who) = (ctx.stage_fd.clone(), ctx.owner.into());
            blocking(move || {
                for e in gone {
                    remove_staged(&fd, e.path(), who);
                }
            })
            .await;
        }
        log.finish().await;
    }
    write_manifest(ctx, &fetcher, manifest).await
}

/// Blocking. Removes the staged file `path` (below the stage directory `stage`), without following
/// links; what cannot be removed stays (it is the job user's own file, or another user's).
fn remove_staged(stage: &OwnedFd, path: &str, who: safefs::RemoveAs) {
    let parts: Vec<&str> = path.split('/').collect();
    let (name, dirs) = parts.split_last().expect("split yields one part");
    let dir = dirs.iter().try_fold(None::<OwnedFd>, |d, name| match &d {
        None => safefs::open_dir(stage, name).map(Some),
        Some(d) => safefs::open_dir(d, name).map(Some),
    });
    let removed = match dir {
        Ok(Some(d)) => safefs::remove_tree(&d, name, who),
        Ok(None) => safefs::remove_tree(stage, name, who),
        Err(e) => Err(e),
    };
    if let Err(e) = removed {
        tracing::info!("removing {path}, whose object is no longer listed: {e}");
    }
}

/// What `sluice cache warm` did with one object.
enum Warmed {
    Cached(u64),
    Filled(u64),
    Skipped(String),
}

impl Fetcher {
    /// Fills a cache entry with the object, with no job's copy beside it.
    async fn warm_object(self: Arc<Self>, meta: ObjectMeta) -> Result<Warmed, StageError> {
        let cache = self.cache.clone().expect("warming has a cache");
        let Some(key) = Key::of(&self.cfg, &self.bucket_url, &meta) else {
            return Ok(Warmed::Skipped(format!(
                "{}/{}: the store lists it with neither an ETag nor a version",
                self.bucket_url, meta.location
            )));
        };
        let size = key.size;
        if cache.contains(&key) {
            return Ok(Warmed::Cached(size));
        }
        let fill = match blocking(move || cache.begin_fill(key)).await {
            Ok(fill) => fill,
            Err(why) => return Ok(Warmed::Skipped(why)),
        };
        let dest = Arc::new(Dest::new(
            fill.file(),
            None,
            meta.e_tag.clone(),
            self.cache.clone(),
        ));
        let rel = meta.location.to_string();
        self.clone().fill_plain(&dest, &rel, meta).await?;
        drop(dest);
        Ok(if blocking(move || fill.commit()).await {
            Warmed::Filled(size)
        } else {
            Warmed::Skipped(format!(
                "{rel}: the cache entry could not be written (see the agent's log)"
            ))
        })
    }
}

/// `sluice cache warm URL`: fills the node's cache with the objects at `url` that it does not
/// hold, read with the agent's credentials through the node's download budget.
pub(super) async fn warm(
    cfg: Arc<sluice_core::config::Config>,
    budget: Arc<Budget>,
    cache: Arc<Cache>,
    url: &str,
) -> Result<sluice_proto::msg::CacheWarmed, StageError> {
    let spec = sluice_proto::options::parse_stage_entry(&format!("warm={url}")).map_err(|e| {
        StageError::Origin {
            dataset: url.to_string(),
            detail: e.to_string(),
        }
    })?;
    let sluice_proto::options::Source::Object {
        scheme,
        bucket,
        prefix,
    } = &spec.source
    else {
        return Err(StageError::Origin {
            dataset: url.to_string(),
            detail: "only object-store datasets (s3://, az://, gs://) are cached".into(),
        });
    };
    let source = spec.source.to_string();
    let store = store::open(&cfg, *scheme, bucket).map_err(|e| StageError::Origin {
        dataset: source.clone(),
        detail: e.to_string(),
    })?;
    let fetcher = Arc::new(Fetcher {
        store: store.clone(),
        budget,
        source: source.clone(),
        node: cfg.node.clone(),
        part_size: cfg.stage.part_size,
        owner: Owner { uid: 0, gid: 0 },
        progress: Arc::new(Progress::new(&spec)),
        peers: None,
        name: spec.name.clone(),
        shared_tier: None,
        cache: Some(cache),
        bucket_url: spec.source.bucket_url().unwrap_or_default(),
        cfg: cfg.clone(),
        log: None,
        replace: false,
    });
    let mut out = sluice_proto::msg::CacheWarmed {
        node: cfg.node.clone(),
        url: source.clone(),
        files: 0,
        bytes: 0,
        cached_files: 0,
        cached_bytes: 0,
        filled_files: 0,
        filled_bytes: 0,
        skipped: Vec::new(),
    };
    let mut tasks: JoinSet<Result<Warmed, StageError>> = JoinSet::new();
    let take = |done: Result<Warmed, StageError>, out: &mut sluice_proto::msg::CacheWarmed| {
        match done? {
            Warmed::Cached(n) => {
                out.cached_files += 1;
                out.cached_bytes += n;
            }
            Warmed::Filled(n) => {
                out.filled_files += 1;
                out.filled_bytes += n;
            }
            Warmed::Skipped(why) => out.skipped.push(why),
        }
        Ok::<_, StageError>(())
    };
    let mut objects = Vec::new();
    if !prefix.is_empty() {
        match store.head(&ObjPath::from(prefix.as_str())).await {
            Ok(meta) => objects.push(meta),
            Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(origin_error(&source, e)),
        }
    }
    let single = !objects.is_empty();
    let list_prefix = (!prefix.is_empty()).then(|| ObjPath::from(prefix.as_str()));
    let mut listing = (!single).then(|| store.list(list_prefix.as_ref()));
    let max_pending = cfg.stage.concurrency * 4;
    loop {
        let meta = match (objects.pop(), listing.as_mut()) {
            (Some(meta), _) => meta,
            (None, Some(l)) => match l.next().await {
                Some(item) => item.map_err(|e| origin_error(&source, e))?,
                None => break,
            },
            (None, None) => break,
        };
        if !single {
            match map_key(prefix, meta.location.as_ref()) {
                KeyPath::File(_) => {}
                KeyPath::DirMarker => continue,
                KeyPath::Reject => {
                    out.skipped.push(format!(
                        "{}: not a file name a job could stage",
                        meta.location
                    ));
                    continue;
                }
            }
        }
        out.files += 1;
        out.bytes += meta.size;
        while tasks.len() >= max_pending {
            if let Some(done) = tasks.join_next().await {
                take(done.expect("warm task panicked"), &mut out)?;
            }
        }
        tasks.spawn(fetcher.clone().warm_object(meta));
    }
    while let Some(done) = tasks.join_next().await {
        take(done.expect("warm task panicked"), &mut out)?;
    }
    if out.files == 0 {
        return Err(StageError::NotFound { dataset: source });
    }
    Ok(out)
}

/// Creates the staged file `name` (of `size` bytes) in `dir`, owned by the job user. On the shared
/// tier the file gets its size class's layout, and something already at the name (left by an
/// earlier run of the job id, or by a lost node) is replaced only if this node owns the name and
/// its share was not taken over ([`super::shared::create_file`]): a node found dead never removes
/// a file a survivor wrote. With `replace` (an agent restarted while staging on its own hot
/// tier), what the run before left at that name is removed first. Errors as (errno, text).
fn new_file(
    dir: &OwnedFd,
    name: &str,
    size: u64,
    owner: Owner,
    shared_tier: Option<&super::shared::Layout>,
    replace: bool,
) -> Result<std::fs::File, (Option<i32>, String)> {
    match shared_tier {
        None => {
            if replace {
                safefs::remove_tree(dir, name, owner.into())
                    .and_then(|r| r.all_gone(name))
                    .map_err(errno_text)?;
            }
            safefs::create_file(dir, name, Some(owner), 0o644).map_err(errno_text)
        }
        Some(layout) => {
            super::shared::create_file(dir, name, size, owner, layout).map_err(|e| (None, e))
        }
    }
}

fn errno_text(e: safefs::SafeFsError) -> (Option<i32>, String) {
    (e.errno().map(|e| e as i32), e.to_string())
}

/// Writes a shard dataset's manifest next to it (`$SLUICE_STAGE_DIR/NAME.shard.json`), owned by
/// the job user; nothing without one.
async fn write_manifest(
    ctx: &StageCtx,
    fetcher: &Fetcher,
    manifest: Option<ShardManifest>,
) -> Result<(), StageError> {
    let Some(mut manifest) = manifest else {
        return Ok(());
    };
    let name = super::shard::manifest_name(&fetcher.name);
    let (fd, owner, bytes) = (ctx.stage_fd.clone(), ctx.owner, manifest.to_json());
    let file_name = name.clone();
    let written = blocking(move || {
        let mut f = safefs::create_file(&*fd, &file_name, Some(owner), 0o644)
            .map_err(|e| (e.errno().map(|e| e as i32), e.to_string()))?;
        std::io::Write::write_all(&mut f, &bytes).map_err(|e| (e.raw_os_error(), e.to_string()))
    })
    .await;
    written.map_err(|(errno, detail)| fetcher.hot_error(&name, errno, detail))
}

/// Waits for all of the `what` tasks (parts, units, files): the first error.
async fn all_of(tasks: &mut JoinSet<Result<(), StageError>>, what: &str) -> Result<(), StageError> {
    while let Some(done) = tasks.join_next().await {
        done.unwrap_or_else(|e| panic!("{what} task panicked: {e:?}"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shared tier's files: a node found dead while it is alive (its peer port flooded, say)
    /// goes on writing its share until it sees the takeover; what it creates then must never
    /// replace a file a survivor wrote, or the job's tasks would read its half-written file.
    #[test]
    fn a_node_found_dead_never_replaces_a_file_a_survivor_wrote() {
        use super::super::shared::{SharedJob, Takeover};
        let root = tempfile::tempdir().unwrap();
        let cfg = sluice_core::config::SharedTierConfig {
            job_dir: format!("{}/job-%j", root.path().display()),
            lfs: "lfs".into(),
            stripes: Vec::new(),
        };
        let owner = Owner {
            uid: nix::unistd::getuid().as_raw(),
            gid: nix::unistd::getgid().as_raw(),
        };
        let nodes: Vec<String> = ["n1", "n2"].map(String::from).into();
        let n1 = SharedJob::open(&cfg, 11, "n1", owner, true).unwrap();
        let n2 = SharedJob::open(&cfg, 11, "n2", owner, true).unwrap();
        let path = root.path().join("job-11/stage/x");
        let write = |f: std::io::Result<std::fs::File>, bytes: &[u8]| {
            std::io::Write::write_all(&mut f.unwrap(), bytes).unwrap()
        };
        let create = |job: &SharedJob, layout: &super::super::shared::Layout| {
            new_file(&job.stage, "x", 8, owner, Some(layout), false)
                .map_err(|(_, e)| e)
                .map_err(std::io::Error::other)
        };
        // n2 owns x. An earlier run of the job id left a file there: n2 replaces it.
        std::fs::write(&path, b"stale").unwrap();
        let own = n2
            .layout_for("n2")
            .for_plan(Some(&ShardPlan::new(&nodes, "n2").unwrap()));
        write(create(&n2, &own), b"n2-half");
        assert_eq!(std::fs::read(&path).unwrap(), b"n2-half");
        // n1 finds n2 dead and takes its share over: it replaces n2's half-written x, whole.
        let t = n1
            .claim(&Takeover::alone("n2", "n1", "unreachable"))
            .unwrap();
        let part = ShardPlan::new(&nodes, "n1")
            .unwrap()
            .takeover(&t.lost, &t.survivors)
            .unwrap();
        write(
            create(&n1, &n1.layout_for("n1").for_plan(Some(&part))),
            b"survivor",
        );
        // n2's agent, alive and not yet aware of the takeover, goes on with x: refused, and the
        // survivor's file is what the tasks read.
        let e = create(&n2, &own).unwrap_err().to_string();
        assert!(
            e.contains("taken over") && e.contains("'x' is not replaced"),
            "{e}"
        );
        assert_eq!(std::fs::read(&path).unwrap(), b"survivor");
        // A name of n2's share that is still free is not the survivor's: n2 may create it (its
        // watch of the takeover mark stops it soon), and nothing is removed by that.
        new_file(&n2.stage, "y", 1, owner, Some(&own), false).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"survivor");
    }

    fn fetcher(store: Arc<dyn ObjectStore>, part_size: u64, budget: Arc<Budget>) -> Arc<Fetcher> {
        let spec = StageSpec {
            name: "ds".into(),
            source: sluice_proto::options::parse_stage_entry("ds=s3://b/ds")
                .unwrap()
                .source,
        };
        Arc::new(Fetcher {
            store,
            budget,
            source: "s3://b/ds".into(),
            node: "n1".into(),
            part_size,
            owner: Owner {
                uid: nix::unistd::getuid().as_raw(),
                gid: nix::unistd::getgid().as_raw(),
            },
            progress: Arc::new(Progress::new(&spec)),
            peers: None,
            name: "ds".into(),
            shared_tier: None,
            cache: None,
            cfg: Arc::new(
                sluice_core::config::Config::parse(
                    "[agent]\nsocket='/s'\nstate_dir='/st'\n[hot_tier]\nroot='/h'\n",
                    "n1",
                    sluice_archive::upload_memory,
                )
                .unwrap(),
            ),
            bucket_url: "s3://b".into(),
            log: None,
            replace: false,
        })
    }

    fn staged(dir: &std::path::Path, name: &str) -> Staged {
        Staged {
            root: Arc::new(safefs::open_root_dir(dir).unwrap()),
            unit_file: name.into(),
            rel_at: 0,
        }
    }

    #[tokio::test]
    async fn parts_stream_through_small_buffers_to_their_offsets() {
        let store: Arc<dyn ObjectStore> = Arc::new(object_store::memory::InMemory::new());
        let data: Vec<u8> = (0..300_001u32).map(|i| (i % 253) as u8).collect();
        store
            .put(&ObjPath::from("ds/x.bin"), data.clone().into())
            .await
            .unwrap();
        let meta = store.head(&ObjPath::from("ds/x.bin")).await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        // 64 KiB parts through 4 KiB buffers, 3 requests at a time.
        let budget = Budget::with(3, 4096);
        let f = fetcher(store.clone(), 64 << 10, budget.clone());
        let file = std::fs::File::create(dir.path().join("x.bin")).unwrap();
        f.clone()
            .fill(file, "x.bin", meta.clone(), staged(dir.path(), "x.bin"))
            .await
            .unwrap();
        assert_eq!(std::fs::read(dir.path().join("x.bin")).unwrap(), data);
        let p = f.progress.snapshot();
        assert_eq!((p.files_done, p.bytes_done), (1, 300_001));
        let (slots, buffers) = budget.free();
        assert_eq!(slots, 3);
        assert!(buffers <= 3);

        // The object shrank after it was listed: the short range is an error, not a short file.
        let listed_bigger = ObjectMeta {
            size: 300_001 + 10,
            ..meta
        };
        let file = std::fs::File::create(dir.path().join("y.bin")).unwrap();
        let e = f
            .fill(file, "y.bin", listed_bigger, staged(dir.path(), "y.bin"))
            .await
            .unwrap_err();
        assert!(
            e.to_string().contains("object changed while staging"),
            "{e}"
        );
    }

    #[test]
    fn hostile_keys_never_leave_the_dataset() {
        let f = |p: &str, k: &str| map_key(p, k);
        assert_eq!(
            f("ds", "ds/a/b.bin"),
            KeyPath::File(vec!["a".into(), "b.bin".into()])
        );
        assert_eq!(f("", "top.bin"), KeyPath::File(vec!["top.bin".into()]));
        assert_eq!(f("ds", "ds/dir/"), KeyPath::DirMarker);
        for bad in [
            "ds/../x",
            "ds/a/../../x",
            "ds/..",
            "ds//x",
            "ds/./x",
            "ds/a\0b",
            "dsx/y",
            "other/x",
            "ds/",
        ] {
            assert_eq!(f("ds", bad), KeyPath::Reject, "{bad:?}");
        }
        assert_eq!(f("", "/etc/passwd"), KeyPath::Reject);
        assert_eq!(f("", "a\0b"), KeyPath::Reject);
        let deep = vec!["d"; safefs::MAX_DEPTH + 1].join("/");
        assert_eq!(f("", &deep), KeyPath::Reject);
    }

    /// A fetcher like [`fetcher`], with a cache in `dir`.
    fn cached_fetcher(store: Arc<dyn ObjectStore>, dir: &std::path::Path) -> Arc<Fetcher> {
        cached_fetcher_with(store, dir, "")
    }

    /// [`cached_fetcher`] with more `[cache]` settings.
    fn cached_fetcher_with(
        store: Arc<dyn ObjectStore>,
        dir: &std::path::Path,
        more: &str,
    ) -> Arc<Fetcher> {
        let cfg = Arc::new(
            sluice_core::config::Config::parse(
                &format!(
                    "[agent]\nsocket='/s'\nstate_dir='/st'\n[hot_tier]\nroot='{}'\n[cache]\nsize='16MiB'\nmin_free=0\n{more}\n",
                    dir.display()
                ),
                "n1", sluice_archive::upload_memory)
            .unwrap(),
        );
        let cache = Cache::open(&cfg).unwrap().unwrap();
        let f = fetcher(store, 64 << 10, Budget::with(3, 4096));
        let mut f = Arc::into_inner(f).unwrap();
        f.cache = Some(cache);
        f.cfg = cfg;
        Arc::new(f)
    }

    /// With `link_hits`, a job's hit is a hard link to the cache's entry: the same file, read-only,
    /// nothing copied; a miss is still the job user's own copy. Evicting the entry leaves the
    /// job's copy whole, and a hit after an agent restart replaces what the run before left.
    #[tokio::test]
    async fn with_link_hits_a_hit_is_a_read_only_link_to_the_entry() {
        use std::os::unix::fs::MetadataExt;
        let store: Arc<dyn ObjectStore> = Arc::new(object_store::memory::InMemory::new());
        let data: Vec<u8> = (0..200_000u32).map(|i| (i % 239) as u8).collect();
        let at = ObjPath::from("ds/x.bin");
        store.put(&at, data.clone().into()).await.unwrap();
        let meta = store.head(&at).await.unwrap();
        let (hot, dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let f = cached_fetcher_with(store.clone(), hot.path(), "link_hits = true");
        let root = Arc::new(safefs::open_root_dir(dir.path()).unwrap());
        let stage = |f: &Arc<Fetcher>, parts: &[&str]| {
            let parts = parts.iter().map(|p| p.to_string()).collect();
            f.clone().fetch(root.clone(), parts, meta.clone())
        };
        stage(&f, &["a"]).await.unwrap();
        let a = std::fs::metadata(dir.path().join("a")).unwrap();
        assert_eq!(
            (a.nlink(), a.mode() & 0o7777),
            (1, 0o644),
            "a miss: the user's copy"
        );
        stage(&f, &["sub", "b"]).await.unwrap();
        let b_path = dir.path().join("sub/b");
        let b = std::fs::metadata(&b_path).unwrap();
        let entries: Vec<_> = std::fs::read_dir(hot.path().join("cache/data"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| !p.to_string_lossy().ends_with(".meta"))
            .collect();
        assert_eq!(entries.len(), 1);
        let entry = std::fs::metadata(&entries[0]).unwrap();
        assert_eq!(
            (b.ino(), b.nlink(), b.mode() & 0o7777, b.uid()),
            (entry.ino(), 2, 0o444, entry.uid()),
            "a hit: a read-only link to the entry"
        );
        assert_eq!(std::fs::read(&b_path).unwrap(), data);
        assert_eq!(f.progress.snapshot().cache_bytes, 200_000);
        let cache = f.cache.clone().unwrap();
        assert_eq!(cache.stats().hits, 1);
        // The cache's name goes; the job's copy stays.
        assert_eq!(cache.evict_prefix("", false).entries, 1);
        assert_eq!(cache.stats().entries, 0);
        assert_eq!(std::fs::read(&b_path).unwrap(), data);
        assert_eq!(std::fs::metadata(&b_path).unwrap().nlink(), 1);

        // A restarted agent's run (`replace`) links over what the run before left: here a copy
        // (a miss, which filled the cache again).
        stage(&f, &["c"]).await.unwrap();
        assert_eq!(std::fs::metadata(dir.path().join("c")).unwrap().nlink(), 1);
        let mut again =
            Arc::into_inner(cached_fetcher_with(store, hot.path(), "link_hits = true")).unwrap();
        again.replace = true;
        let again = Arc::new(again);
        again
            .clone()
            .fetch(root.clone(), vec!["c".into()], meta)
            .await
            .unwrap();
        let c = std::fs::metadata(dir.path().join("c")).unwrap();
        assert_eq!(
            (c.nlink(), c.mode() & 0o7777),
            (2, 0o444),
            "linked over the user's copy"
        );
        assert_eq!(std::fs::read(dir.path().join("c")).unwrap(), data);
    }

    #[tokio::test]
    async fn a_second_stage_of_an_object_comes_from_the_cache_and_a_changed_one_does_not() {
        let store: Arc<dyn ObjectStore> = Arc::new(object_store::memory::InMemory::new());
        let data: Vec<u8> = (0..200_000u32).map(|i| (i % 241) as u8).collect();
        let at = ObjPath::from("ds/x.bin");
        store.put(&at, data.clone().into()).await.unwrap();
        let meta = store.head(&at).await.unwrap();
        let hot = tempfile::tempdir().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let f = cached_fetcher(store.clone(), hot.path());
        let file = |name: &str| std::fs::File::create(dir.path().join(name)).unwrap();
        f.clone()
            .fill(file("a"), "a", meta.clone(), staged(dir.path(), "a"))
            .await
            .unwrap();
        let cache = f.cache.clone().unwrap();
        assert_eq!(cache.stats().entries, 1);
        assert_eq!(f.progress.snapshot().cache_bytes, 0);
        // The origin no longer has it: only the cache can answer.
        store.delete(&at).await.unwrap();
        f.clone()
            .fill(file("b"), "b", meta.clone(), staged(dir.path(), "b"))
            .await
            .unwrap();
        assert_eq!(std::fs::read(dir.path().join("b")).unwrap(), data);
        let p = f.progress.snapshot();
        assert_eq!(
            (p.cache_bytes, p.bytes_done, p.files_done),
            (200_000, 400_000, 2)
        );
        assert_eq!(cache.stats().hits, 1);

        // Overwritten after it was listed: the GET asks for the listed ETag, and the job is told.
        store.put(&at, vec![1u8; 200_000].into()).await.unwrap();
        let listed = store.head(&at).await.unwrap();
        store.put(&at, vec![2u8; 200_000].into()).await.unwrap();
        let e = f
            .clone()
            .fill(file("c"), "c", listed.clone(), staged(dir.path(), "c"))
            .await
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("the object changed while it was being staged"),
            "{e}"
        );
        // ... and nothing of it is cached.
        assert_eq!(cache.stats().entries, 1);
        let now = store.head(&at).await.unwrap();
        f.clone()
            .fill(file("d"), "d", now, staged(dir.path(), "d"))
            .await
            .unwrap();
        assert_eq!(
            std::fs::read(dir.path().join("d")).unwrap(),
            vec![2u8; 200_000]
        );
        assert_eq!(cache.stats().entries, 2);
    }

    // ------------------------------------------------------------- resuming after a restart

    use crate::peers::tests::CountingStore;
    use crate::resume::JobResume;
    use std::collections::BTreeMap;
    use std::time::Duration;

    /// The dataset `ds/`: 150 small objects, a large one of several parts (64 KiB) and an empty
    /// one; returns the store and each file's bytes.
    async fn resume_origin() -> (Arc<CountingStore>, BTreeMap<String, Vec<u8>>) {
        let mut files = BTreeMap::new();
        for i in 0..150u32 {
            let n = 500 + (i as usize * 37) % 3000;
            files.insert(
                format!("d{}/f{i:03}.bin", i % 7),
                (0..n).map(|j| (j as u32 * 31 + i) as u8).collect(),
            );
        }
        files.insert(
            "big.bin".into(),
            (0..300_000u32).map(|i| (i % 251) as u8).collect(),
        );
        files.insert("empty".into(), Vec::new());
        (CountingStore::holding(&files).await, files)
    }

    /// One run of the agent staging `ds` alone into `stage` with the job's staging logs under
    /// `state` (`resuming`: the agent restarted while it was staging).
    fn resume_ctx(stage: &std::path::Path, state: &std::path::Path, resuming: bool) -> StageCtx {
        let cfg = Arc::new(
            sluice_core::config::Config::parse(
                "[agent]\nsocket='/s'\nstate_dir='/st'\n[hot_tier]\nroot='/h'\n\
                 [stage]\npart_size='64KiB'\nconcurrency=4\n",
                "n1",
                sluice_archive::upload_memory,
            )
            .unwrap(),
        );
        StageCtx {
            budget: Budget::new(&cfg.stage),
            cfg,
            owner: Owner {
                uid: nix::unistd::getuid().as_raw(),
                gid: nix::unistd::getgid().as_raw(),
            },
            user: "me".into(),
            stage_path: stage.into(),
            stage_fd: Arc::new(safefs::open_root_dir(stage).unwrap()),
            helper_exe: "/bin/false".into(),
            cancel: tokio_util::sync::CancellationToken::new(),
            shared_tier: None,
            cache: None,
            resume: Some(Arc::new(JobResume::open(state, 42, resuming))),
        }
    }

    fn ds_spec() -> StageSpec {
        sluice_proto::options::parse_stage_entry("ds=s3://b/ds").unwrap()
    }

    async fn stage_ds(
        ctx: &StageCtx,
        store: &Arc<CountingStore>,
    ) -> (Result<(), StageError>, sluice_proto::msg::StageProgress) {
        let progress = Arc::new(Progress::new(&ds_spec()));
        let store = store.clone() as Arc<dyn ObjectStore>;
        let r = tokio::time::timeout(
            Duration::from_secs(60),
            stage(ctx, &ds_spec(), store, "ds", progress.clone(), None, None),
        )
        .await
        .expect("staging finished");
        (r, progress.snapshot())
    }

    /// Every file below `dir`, relative, with its bytes.
    fn tree(dir: &std::path::Path) -> BTreeMap<String, Vec<u8>> {
        let mut out = BTreeMap::new();
        let mut stack = vec![dir.to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    stack.push(p);
                } else {
                    let rel = p.strip_prefix(dir).unwrap().to_string_lossy().into_owned();
                    out.insert(rel, std::fs::read(&p).unwrap());
                }
            }
        }
        out
    }

    fn bytes_of(files: &BTreeMap<String, Vec<u8>>) -> u64 {
        files.values().map(|v| v.len() as u64).sum()
    }

    /// The agent is killed while staging (its task dropped with GETs in flight, after about a
    /// hundred objects are whole and a batch of the log is written) and restarted: the files the
    /// log names are kept, every other byte is read from the origin once, and the dataset ends
    /// whole and identical.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_restarted_stage_reads_only_what_was_not_staged_whole_before() {
        let (store, files) = resume_origin().await;
        let total = bytes_of(&files);
        let (hot, state) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        store.stall_after.store(100, Ordering::SeqCst);
        let ctx = resume_ctx(hot.path(), state.path(), false);
        let progress = Arc::new(Progress::new(&ds_spec()));
        let run = {
            let (store, progress) = (store.clone() as Arc<dyn ObjectStore>, progress.clone());
            async move { stage(&ctx, &ds_spec(), store, "ds", progress, None, None).await }
        };
        let task = tokio::spawn(run);
        // Until every GET that will answer has, and the files they fill are written.
        let mut last = u64::MAX;
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let done = progress.snapshot().files_done;
            if done == last && store.gets.load(Ordering::SeqCst) > 100 {
                break;
            }
            last = done;
        }
        task.abort();
        let _ = task.await;
        let before = progress.snapshot();
        assert!(before.files_done > 64 && before.files_done < files.len() as u64);
        let served_before = store.served.load(Ordering::SeqCst);

        store.stall_after.store(u64::MAX, Ordering::SeqCst);
        let (r, p) = stage_ds(&resume_ctx(hot.path(), state.path(), true), &store).await;
        r.unwrap();
        assert_eq!(tree(&hot.path().join("ds")), files, "the dataset, whole");
        let served_after = store.served.load(Ordering::SeqCst) - served_before;
        // Kept: what the log's batches named (the lines of the last files were still in memory
        // when the agent died: those are read again).
        assert!(p.resumed_bytes > 0, "{p:?}");
        assert!(p.resumed_bytes <= before.bytes_done, "{p:?} vs {before:?}");
        assert_eq!(
            served_after,
            total - p.resumed_bytes,
            "the origin served what was not kept, once"
        );
        assert_eq!(
            (p.bytes_done, p.files_done, p.origin_bytes + p.resumed_bytes),
            (total, files.len() as u64, total),
            "{p:?}"
        );
        eprintln!(
            "dataset {total} B; before the kill the origin served {served_before} B; after the \
             restart {served_after} B ({} B kept)",
            p.resumed_bytes
        );
    }

    /// Staged whole, then changed before the agent comes back: a file deleted, one truncated, one
    /// rewritten in place with its mtime set back (its ctime gives it away), an object overwritten
    /// at the origin (another ETag), one deleted there and one added. Exactly those are read again
    /// (and the deleted object's file goes); everything else is kept, byte for byte.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn files_changed_since_they_were_staged_are_read_again() {
        let (store, mut files) = resume_origin().await;
        let (hot, state) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let (r, p) = stage_ds(&resume_ctx(hot.path(), state.path(), false), &store).await;
        r.unwrap();
        assert_eq!(p.resumed_bytes, 0);
        let ds = hot.path().join("ds");
        // ctime has the kernel's tick: change the files after it moved on.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut read_again = 0u64;
        std::fs::remove_file(ds.join("d0/f000.bin")).unwrap();
        read_again += files["d0/f000.bin"].len() as u64;
        std::fs::OpenOptions::new()
            .write(true)
            .open(ds.join("d1/f001.bin"))
            .unwrap()
            .set_len(10)
            .unwrap();
        read_again += files["d1/f001.bin"].len() as u64;
        let rewritten = ds.join("d2/f002.bin");
        let mtime = std::fs::metadata(&rewritten).unwrap().modified().unwrap();
        std::fs::write(&rewritten, vec![0u8; files["d2/f002.bin"].len()]).unwrap();
        std::fs::File::options()
            .write(true)
            .open(&rewritten)
            .unwrap()
            .set_modified(mtime)
            .unwrap();
        read_again += files["d2/f002.bin"].len() as u64;
        // At the origin: big.bin overwritten (same size, another ETag), one object gone, one new.
        let big: Vec<u8> = files["big.bin"].iter().map(|b| b ^ 0xff).collect();
        store
            .inner
            .put(&ObjPath::from("ds/big.bin"), big.clone().into())
            .await
            .unwrap();
        files.insert("big.bin".into(), big);
        read_again += 300_000;
        store
            .inner
            .delete(&ObjPath::from("ds/d3/f003.bin"))
            .await
            .unwrap();
        files.remove("d3/f003.bin");
        store
            .inner
            .put(&ObjPath::from("ds/new.bin"), vec![7u8; 4321].into())
            .await
            .unwrap();
        files.insert("new.bin".into(), vec![7u8; 4321]);
        read_again += 4321;

        let served_before = store.served.load(Ordering::SeqCst);
        let (r, p) = stage_ds(&resume_ctx(hot.path(), state.path(), true), &store).await;
        r.unwrap();
        assert_eq!(tree(&ds), files, "the dataset as the origin has it now");
        assert_eq!(
            store.served.load(Ordering::SeqCst) - served_before,
            read_again,
            "only the changed files were read"
        );
        let total = bytes_of(&files);
        assert_eq!(
            (p.bytes_done, p.resumed_bytes, p.origin_bytes),
            (total, total - read_again, read_again)
        );

        // A third run (the agent restarted again) keeps everything, the files read again included.
        let served_before = store.served.load(Ordering::SeqCst);
        let (r, p) = stage_ds(&resume_ctx(hot.path(), state.path(), true), &store).await;
        r.unwrap();
        assert_eq!(store.served.load(Ordering::SeqCst), served_before);
        assert_eq!((p.resumed_bytes, p.origin_bytes), (total, 0));
        assert_eq!(tree(&ds), files);

        // A fresh run of the job id trusts nothing (its stage directory is new, as the agent
        // makes it).
        std::fs::remove_dir_all(&ds).unwrap();
        let (r, p) = stage_ds(&resume_ctx(hot.path(), state.path(), false), &store).await;
        r.unwrap();
        assert_eq!((p.resumed_bytes, p.origin_bytes), (0, total));
    }

    /// A dataset that is one object resumes too.
    #[tokio::test]
    async fn a_single_object_dataset_is_kept_across_a_restart() {
        let store = Arc::new(CountingStore::new());
        let data = vec![3u8; 100_000];
        store
            .inner
            .put(&ObjPath::from("ds"), data.clone().into())
            .await
            .unwrap();
        let (hot, state) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        stage_ds(&resume_ctx(hot.path(), state.path(), false), &store)
            .await
            .0
            .unwrap();
        let served = store.served.load(Ordering::SeqCst);
        let (r, p) = stage_ds(&resume_ctx(hot.path(), state.path(), true), &store).await;
        r.unwrap();
        assert_eq!(store.served.load(Ordering::SeqCst), served);
        assert_eq!(p.resumed_bytes, 100_000);
        assert_eq!(std::fs::read(hot.path().join("ds")).unwrap(), data);
    }
}
