//! Stage-in: copying a job's datasets from their origin onto this node's hot tier.
//!
//! - Object stores (`s3://`, `az://`, `gs://`) are read by the agent itself, because only the agent holds
//!   the credentials. Listing is pipelined with the downloads; objects larger than the part size are
//!   fetched as parallel ranged GETs. Every response body streams through a reused buffer from the
//!   node's one [`Budget`] and is written at its offset, so the agent's memory is bounded by the
//!   budget, not by part sizes, datasets or jobs. Files are written as root with fd-relative,
//!   no-follow operations ([`sluice_archive::safefs`]) and owned by the job user.
//! - POSIX sources are read by a helper process running with the job user's identity
//!   ([`crate::posix_copy`]), so a user can stage only what they could read themselves.
//!
//! Object keys are not file paths: [`map_key`] is the single place that decides where a key lands.

use futures::StreamExt;
use object_store::path::Path as ObjPath;
use object_store::{GetOptions, ObjectMeta, ObjectStore, ObjectStoreExt};
use sluice_archive::config::Config;
use sluice_archive::safefs::{self, Owner};
use sluice_archive::store;
use sluice_proto::msg::{StageProgress, StageState};
use sluice_proto::options::{Source, StageSpec};
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::io::{AsyncBufReadExt, AsyncReadExt};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Clone, thiserror::Error)]
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
    started: Mutex<Option<Instant>>,
    elapsed_ms: AtomicU64,
    error: Mutex<Option<String>>,
}

const UNKNOWN: u64 = u64::MAX;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

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
            started: Mutex::new(None),
            elapsed_ms: AtomicU64::new(0),
            error: Mutex::new(None),
        }
    }

    fn set_state(&self, state: StageState) {
        if state == StageState::Listing {
            *lock(&self.started) = Some(Instant::now());
        }
        if matches!(state, StageState::Done | StageState::Failed) {
            if let Some(t) = *lock(&self.started) {
                self.elapsed_ms
                    .store(t.elapsed().as_millis() as u64, Ordering::Relaxed);
            }
        }
        *lock(&self.state) = state;
    }

    fn fail(&self, e: &StageError) {
        *lock(&self.error) = Some(e.to_string());
        self.set_state(StageState::Failed);
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
            elapsed_ms,
            error: lock(&self.error).clone(),
        }
    }
}

/// The node's budget for stage-in downloads, shared by every dataset of every job the agent
/// stages: at most `requests` object-store requests in flight, each streaming its response body
/// through one buffer of `buffer` bytes. Buffers are reused rather than freed, so the memory they
/// take is at most `requests × buffer` for the agent's lifetime, whatever the sizes of the parts
/// and objects (a fresh allocation per response body is what let the allocator's arenas grow).
pub struct Budget {
    requests: Arc<Semaphore>,
    buffer: usize,
    /// Buffers not in use; never more than `requests` of them exist.
    idle: Mutex<Vec<Vec<u8>>>,
}

impl std::fmt::Debug for Budget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Budget")
            .field("requests_free", &self.requests.available_permits())
            .field("buffer", &self.buffer)
            .finish()
    }
}

impl Budget {
    /// The budget `[stage]` configures: `concurrency` requests, `memory` bytes of buffers.
    pub fn new(cfg: &sluice_archive::config::StageConfig) -> Arc<Budget> {
        Budget::with(
            cfg.concurrency,
            (cfg.memory / cfg.concurrency as u64) as usize,
        )
    }

    fn with(requests: usize, buffer: usize) -> Arc<Budget> {
        Arc::new(Budget {
            requests: Arc::new(Semaphore::new(requests)),
            buffer: buffer.max(1),
            idle: Mutex::new(Vec::new()),
        })
    }

    /// Waits for a request slot and returns it with its buffer (empty, with `buffer` bytes of
    /// capacity); both go back to the budget when the [`Lease`] is dropped.
    pub async fn lease(self: &Arc<Self>) -> Lease {
        let permit = self
            .requests
            .clone()
            .acquire_owned()
            .await
            .expect("the budget's semaphore is never closed");
        let buf = lock(&self.idle)
            .pop()
            .unwrap_or_else(|| Vec::with_capacity(self.buffer));
        Lease {
            buf,
            budget: self.clone(),
            _permit: permit,
        }
    }
}

/// One request's share of the [`Budget`]: a slot and a buffer.
pub struct Lease {
    buf: Vec<u8>,
    budget: Arc<Budget>,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut buf = std::mem::take(&mut self.buf);
        // A buffer lent to a blocking write that failed may be gone; a smaller one is not reused.
        if buf.capacity() == self.budget.buffer {
            buf.clear();
            lock(&self.budget.idle).push(buf);
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
}

/// Stages one dataset into `$SLUICE_STAGE_DIR/NAME`, updating `progress`.
pub async fn stage(
    ctx: &StageCtx,
    spec: &StageSpec,
    progress: Arc<Progress>,
) -> Result<(), StageError> {
    progress.set_state(StageState::Listing);
    let run = async {
        match &spec.source {
            Source::Posix { path } => stage_posix(ctx, spec, path, &progress).await,
            Source::Object {
                scheme,
                bucket,
                prefix,
            } => {
                let source = spec.source.to_string();
                let store =
                    store::open(&ctx.cfg, *scheme, bucket).map_err(|e| StageError::Origin {
                        dataset: source.clone(),
                        detail: e.to_string(),
                    })?;
                stage_objects(ctx, spec, store, prefix, progress.clone()).await
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

fn origin_error(source: &str, e: object_store::Error) -> StageError {
    match e {
        object_store::Error::NotFound { .. } => StageError::NotFound {
            dataset: source.to_string(),
        },
        object_store::Error::PermissionDenied { source: s, .. }
        | object_store::Error::Unauthenticated { source: s, .. } => StageError::Denied {
            dataset: source.to_string(),
            detail: s.to_string(),
        },
        // A missing bucket or container is the user's mistake, like a missing prefix; the store's
        // raw XML reply helps nobody.
        object_store::Error::Generic { source: s, .. }
            if ["NoSuchBucket", "ContainerNotFound", "NoSuchContainer"]
                .iter()
                .any(|c| s.to_string().contains(c)) =>
        {
            StageError::NotFound {
                dataset: source.to_string(),
            }
        }
        object_store::Error::InvalidPath { .. } => StageError::UnsafeKeys {
            dataset: source.to_string(),
        },
        other => {
            let text = other.to_string();
            if is_unreachable(&text) {
                StageError::Unreachable {
                    dataset: source.to_string(),
                }
            } else {
                StageError::Origin {
                    dataset: source.to_string(),
                    detail: concise(&text),
                }
            }
        }
    }
}

/// A request that never got an HTTP answer (refused, reset, DNS, TLS): the store is unreachable.
pub fn is_unreachable(error_text: &str) -> bool {
    [
        "error sending request",
        "Connection refused",
        "connection refused",
        "dns error",
        "tcp connect error",
    ]
    .iter()
    .any(|needle| error_text.contains(needle))
}

/// A store's error for people: the S3/Azure error code instead of the raw XML body, and no retry
/// bookkeeping.
pub fn concise(error_text: &str) -> String {
    let code = |tag: &str| {
        let open = format!("<{tag}>");
        let start = error_text.find(&open)? + open.len();
        let end = error_text[start..].find('<')? + start;
        Some(error_text[start..end].to_string())
    };
    let head = error_text.split("<?xml").next().unwrap_or(error_text);
    let head = head
        .split(", after ")
        .next()
        .unwrap_or(head)
        .trim_end_matches([' ', ':', '-']);
    match (code("Code"), code("Message")) {
        (Some(c), Some(m)) => format!("{head}: {c}: {m}"),
        (Some(c), None) => format!("{head}: {c}"),
        _ => head.to_string(),
    }
}

fn is_no_space(errno: Option<i32>) -> bool {
    errno == Some(nix::errno::Errno::ENOSPC as i32)
        || errno == Some(nix::errno::Errno::EDQUOT as i32)
}

/// Runs blocking file work on the blocking pool, never on a runtime worker.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f)
        .await
        .expect("blocking file task panicked")
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
}

impl Fetcher {
    fn hot_error(&self, path: &str, errno: Option<i32>, detail: String) -> StageError {
        if is_no_space(errno) {
            StageError::NoSpace {
                node: self.node.clone(),
                dataset: self.source.clone(),
            }
        } else {
            StageError::HotTier {
                path: path.to_string(),
                detail,
            }
        }
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
        let file = blocking(move || {
            let (file_name, dirs) = parts
                .split_last()
                .expect("map_key yields at least one component");
            let dirs: Vec<&str> = dirs.iter().map(String::as_str).collect();
            let d = safefs::ensure_dirs(&root, &dirs, Some(owner))?;
            safefs::create_file(&d, file_name, Some(owner), 0o644)
        })
        .await
        .map_err(|e| self.safefs_error(&rel, e))?;
        self.fill(Arc::new(file), &rel, meta).await
    }

    /// GETs `range` of the object and writes it at the same offset of `file`, streaming the body
    /// through the lease's buffer. Fails unless exactly `range`'s bytes arrive.
    async fn get_part(
        &self,
        mut lease: Lease,
        file: Arc<std::fs::File>,
        rel: &str,
        location: &ObjPath,
        range: std::ops::Range<u64>,
    ) -> Result<(), StageError> {
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
            ..GetOptions::default()
        };
        let mut body = self
            .store
            .get_opts(location, opts)
            .await
            .map_err(|e| origin_error(&dataset(), e))?
            .into_stream();
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
                    buf = self.write_at(&file, rel, buf, &mut at).await?;
                }
            }
        }
        if !buf.is_empty() {
            buf = self.write_at(&file, rel, buf, &mut at).await?;
        }
        lease.buf = buf;
        if at != range.end {
            return Err(wrong_size(at - range.start));
        }
        Ok(())
    }

    /// Writes `buf` at `*at` of `file` on a blocking thread, advances `*at`, and hands the buffer
    /// back empty.
    async fn write_at(
        &self,
        file: &Arc<std::fs::File>,
        rel: &str,
        buf: Vec<u8>,
        at: &mut u64,
    ) -> Result<Vec<u8>, StageError> {
        let (f, offset) = (file.clone(), *at);
        let (mut buf, written) = blocking(move || {
            let r = f.write_all_at(&buf, offset);
            (buf, r)
        })
        .await;
        written.map_err(|e| self.hot_error(rel, e.raw_os_error(), e.to_string()))?;
        let n = buf.len() as u64;
        *at += n;
        self.progress.bytes_done.fetch_add(n, Ordering::Relaxed);
        buf.clear();
        Ok(buf)
    }

    /// Writes the object's bytes into `file`: one GET for small objects, parallel ranged GETs of
    /// `part_size` for large ones.
    async fn fill(
        self: Arc<Self>,
        file: Arc<std::fs::File>,
        rel: &str,
        meta: ObjectMeta,
    ) -> Result<(), StageError> {
        let size = meta.size;
        if size > self.part_size {
            let f = file.clone();
            blocking(move || f.set_len(size))
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
                this.get_part(lease, file, &rel, &location, offset..end)
                    .await
            });
            offset = end;
            while let Some(done) = parts.try_join_next() {
                done.expect("part task panicked")?;
            }
        }
        while let Some(done) = parts.join_next().await {
            done.expect("part task panicked")?;
        }
        self.progress.files_done.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

async fn stage_objects(
    ctx: &StageCtx,
    spec: &StageSpec,
    store: Arc<dyn ObjectStore>,
    prefix: &str,
    progress: Arc<Progress>,
) -> Result<(), StageError> {
    let source = spec.source.to_string();
    let fetcher = Arc::new(Fetcher {
        store: store.clone(),
        budget: ctx.budget.clone(),
        source: source.clone(),
        node: ctx.cfg.node.clone(),
        part_size: ctx.cfg.stage.part_size,
        owner: ctx.owner,
        progress: progress.clone(),
    });
    let (fd, name, owner) = (ctx.stage_fd.clone(), spec.name.clone(), ctx.owner);

    // A prefix may name one object rather than a "directory": then NAME is that file.
    if !prefix.is_empty() {
        match store.head(&ObjPath::from(prefix)).await {
            Ok(meta) => {
                progress.files_total.store(1, Ordering::Relaxed);
                progress.bytes_total.store(meta.size, Ordering::Relaxed);
                progress.set_state(StageState::Copying);
                let file = blocking(move || safefs::create_file(&*fd, &name, Some(owner), 0o644))
                    .await
                    .map_err(|e| fetcher.safefs_error(&spec.name, e))?;
                return fetcher.clone().fill(Arc::new(file), &spec.name, meta).await;
            }
            Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(origin_error(&source, e)),
        }
    }

    let root = blocking(move || safefs::create_dir(&*fd, &name, Some(owner), 0o755))
        .await
        .map(Arc::new)
        .map_err(|e| fetcher.safefs_error(&spec.name, e))?;
    let list_prefix = (!prefix.is_empty()).then(|| ObjPath::from(prefix));
    let mut listing = store.list(list_prefix.as_ref());
    let mut tasks: JoinSet<Result<(), StageError>> = JoinSet::new();
    let (mut files, mut bytes, mut bad, mut example) = (0u64, 0u64, 0u64, String::new());
    // Objects waiting for a download slot; bounds the tasks (and listing read-ahead) in memory.
    let max_pending = ctx.cfg.stage.concurrency * 4;
    while let Some(item) = listing.next().await {
        let meta = item.map_err(|e| origin_error(&source, e))?;
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
    while let Some(done) = tasks.join_next().await {
        done.expect("stage task panicked")?;
    }
    if files == 0 && bad == 0 {
        return Err(StageError::NotFound { dataset: source });
    }
    if bad > 0 {
        return Err(StageError::BadKeys {
            dataset: source,
            count: bad,
            example,
        });
    }
    Ok(())
}

/// Copies a POSIX source with the job user's identity, through `sluiced copy-as-user`.
async fn stage_posix(
    ctx: &StageCtx,
    spec: &StageSpec,
    path: &str,
    progress: &Progress,
) -> Result<(), StageError> {
    let source = spec.source.to_string();
    let dest = ctx.stage_path.join(&spec.name);
    let mut child = tokio::process::Command::new(&ctx.helper_exe)
        .arg("copy-as-user")
        .arg("--uid")
        .arg(ctx.owner.uid.to_string())
        .arg("--gid")
        .arg(ctx.owner.gid.to_string())
        .arg("--user")
        .arg(&ctx.user)
        .arg("--src")
        .arg(path)
        .arg("--dst")
        .arg(&dest)
        .env_clear()
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| StageError::Origin {
            dataset: source.clone(),
            detail: format!("cannot start the copy helper: {e}"),
        })?;
    let stdout = child.stdout.take().expect("stdout is piped");
    let mut stderr = child.stderr.take().expect("stderr is piped");
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        if let Some(event) = crate::posix_copy::Event::parse(&line) {
            event.apply(
                &progress.files_done,
                &progress.files_total,
                &progress.bytes_done,
                &progress.bytes_total,
            );
            if matches!(event, crate::posix_copy::Event::Total { .. }) {
                progress.set_state(StageState::Copying);
            }
        }
    }
    let mut err_text = String::new();
    let _ = (&mut stderr)
        .take(64 * 1024)
        .read_to_string(&mut err_text)
        .await;
    let status = child.wait().await.map_err(|e| StageError::Origin {
        dataset: source.clone(),
        detail: e.to_string(),
    })?;
    if status.success() {
        return Ok(());
    }
    let message = err_text
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("copy helper failed")
        .to_string();
    Err(crate::posix_copy::classify(
        &source,
        &ctx.cfg.node,
        status.code(),
        message,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_errors_read_like_sentences() {
        let xml = "Generic S3 error: Error performing PUT http://h/b/k in 1.2s, after 3 retries, max_retries: 10, retry_timeout: 180s - Server returned non-2xx status code: 503 Service Unavailable: <?xml version=\"1.0\"?><Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>";
        let c = concise(xml);
        assert!(!c.contains("<?xml") && !c.contains("retries"), "{c}");
        assert!(
            c.ends_with("SlowDown: Please reduce your request rate."),
            "{c}"
        );
        assert!(is_unreachable("HTTP error: error sending request for url"));
        assert!(!is_unreachable("404 Not Found"));
    }

    #[tokio::test]
    async fn the_budget_bounds_requests_and_reuses_buffers() {
        let budget = Budget::with(2, 1024);
        let a = budget.lease().await;
        let b = budget.lease().await;
        assert_eq!((a.buf.capacity(), b.buf.capacity()), (1024, 1024));
        let a_ptr = a.buf.as_ptr();
        // A third request waits for a slot, whichever dataset or job it belongs to.
        let third = budget.lease();
        tokio::pin!(third);
        assert!(futures::poll!(third.as_mut()).is_pending());
        drop(a);
        let c = third.await;
        assert_eq!(c.buf.as_ptr(), a_ptr, "the freed buffer is reused");
        assert!(c.buf.is_empty());
        drop((b, c));
        assert_eq!(lock(&budget.idle).len(), 2, "never more buffers than slots");

        let cfg = Config::parse(
            "[agent]\nsocket='/s'\nstate_dir='/t'\n[hot_tier]\nroot='/h'\n[stage]\nconcurrency=4\nmemory='8MiB'\n",
            "n1",
        )
        .unwrap();
        let budget = Budget::new(&cfg.stage);
        assert_eq!(budget.buffer, 2 << 20);
        assert_eq!(budget.requests.available_permits(), 4);
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
        })
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
        let file = Arc::new(std::fs::File::create(dir.path().join("x.bin")).unwrap());
        f.clone().fill(file, "x.bin", meta.clone()).await.unwrap();
        assert_eq!(std::fs::read(dir.path().join("x.bin")).unwrap(), data);
        let p = f.progress.snapshot();
        assert_eq!((p.files_done, p.bytes_done), (1, 300_001));
        assert_eq!(budget.requests.available_permits(), 3);
        assert!(lock(&budget.idle).len() <= 3);

        // The object shrank after it was listed: the short range is an error, not a short file.
        let listed_bigger = ObjectMeta {
            size: 300_001 + 10,
            ..meta
        };
        let file = Arc::new(std::fs::File::create(dir.path().join("y.bin")).unwrap());
        let e = f.fill(file, "y.bin", listed_bigger).await.unwrap_err();
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
}
