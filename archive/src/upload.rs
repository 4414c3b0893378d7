//! Uploading one node's part of a checkpoint.
//!
//! ```text
//! reader (1 blocking thread)   compress (compress_threads blocking tasks)      assembler (async)
//! walk → open → read chunks ──→ hash (BLAKE3 subtree) + encode_chunk, in order → part buffers:
//!   fstat before/after:          transform chosen per file from a sample          ≤ part: one PUT
//!   Modified                                                                      > part: multipart
//! ```
//!
//! The reader is the only code touching the user's files ([`super::walk`]); it only reads, so
//! reading overlaps hashing and encoding. With a power-of-two chunk size (the default) each chunk
//! is hashed as a BLAKE3 subtree on its encoder thread and the file's hash merged from those, as
//! restore does ([`super::download::file_hash`]); otherwise the reader hashes in order.
//!
//! Memory is bounded by the configuration, not by timing: raw chunks are reused buffers, and frames
//! are copied into a fixed pool of part buffers ([`part_buffers`]: one being filled, the others in
//! PUTs) that return to the pool when their upload drops them; an object's small last piece is
//! copied out of the pool, so small files do not hold whole part buffers. The assembler awaits a
//! part buffer, then a request permit before each PUT or part, which throttles everything upstream;
//! uploads run as spawned tasks that abort their multipart upload when the archive fails or is
//! dropped.

use super::format::{self, FileCompression, Frame};
use super::manifest::{ChunkEntry, FileEntry, PART_FORMAT, PartManifest, VERSION};
use super::resume::{Identity, Journal, Pending};
use super::walk::{self, Snapshot, TreeFile, WalkError};
use super::{ArchiveError, ArchiveProgress, Archiver, check_name, unix_ms_now};
use blake3::hazmat::{ChainingValue, HasherExt};
use bytes::Bytes;
use futures::future::{BoxFuture, FutureExt, Shared};
use futures::stream::{FuturesUnordered, StreamExt};
use object_store::path::Path as ObjPath;
use object_store::{
    Attribute, Attributes, MultipartUpload, ObjectStoreExt, PutMultipartOptions, PutOptions,
    PutPayload,
};
use sluice_core::config::CkptConfig;
use sluice_core::rt::blocking;
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The part size for an object of at most `stored_bound` bytes: the configured one, raised (to whole
/// MiB) so the object needs at most [`super::MAX_PARTS`] parts.
pub(crate) fn part_size_for(configured: u64, stored_bound: u64) -> u64 {
    let min = stored_bound.div_ceil(super::MAX_PARTS);
    configured.max(min.div_ceil(1 << 20) << 20)
}

/// An upper bound of the stored size of a file: every chunk stored raw, plus its header.
fn stored_bound(size: u64, chunk_size: u64) -> u64 {
    size + size.div_ceil(chunk_size) * format::HEADER_LEN as u64
}

type Choice = Shared<BoxFuture<'static, FileCompression>>;

/// How a file's content hash is computed.
#[derive(Clone, Copy)]
enum HashBy {
    /// One chunk: the encoder thread hashes it, and that is the file's hash.
    Whole,
    /// Chunks of a power-of-two size (two at least): each a BLAKE3 subtree hashed on its encoder
    /// thread, merged when the file ends.
    Subtrees,
    /// The reader hashes the file in order (a chunk size that is not a power of two).
    Reader,
}

impl HashBy {
    fn of(size: u64, chunk_size: u64) -> HashBy {
        if size <= chunk_size {
            HashBy::Whole
        } else if chunk_size.is_power_of_two() {
            HashBy::Subtrees
        } else {
            HashBy::Reader
        }
    }

    /// Blocking: call from an encoder thread.
    fn chunk(self, data: &[u8], offset: u64) -> ChunkHash {
        match self {
            HashBy::Whole => ChunkHash::Whole(blake3::hash(data)),
            HashBy::Subtrees => ChunkHash::Subtree(
                blake3::Hasher::new()
                    .set_input_offset(offset)
                    .update(data)
                    .finalize_non_root(),
            ),
            HashBy::Reader => ChunkHash::None,
        }
    }
}

enum ChunkHash {
    Whole(blake3::Hash),
    Subtree(ChainingValue),
    None,
}

/// How many part buffers an upload uses: one being filled, and parts in flight for half the
/// requests. Parts are the archive's largest memory (16 MiB each by default), and a part's PUT is
/// long enough that half the requests carrying parts keep the store busy; the other requests carry
/// small objects, copied out of the pool (see [`small_piece`]).
fn part_buffers(concurrency: usize) -> usize {
    concurrency.div_ceil(2) + 1
}

/// The most bytes of buffers one upload holds at once with `cfg`, whatever the files: its part
/// buffers ([`part_buffers`] of `part_size`), and the chunk buffers of the pipeline — raw chunks
/// (the one being read, two in the channel, one per encoder), the encoders' plane scratch, and
/// frames (one per encoder and the one being copied into a part). Objects above
/// `part_size × MAX_PARTS` stored bytes raise their part size (see [`part_size_for`]) and this
/// bound with it. The config's node memory budget (`[agent] memory`) is checked against it.
pub(crate) fn in_flight_bound(cfg: &super::ArchiveConfig) -> u64 {
    let threads = cfg.compress_threads.max(1) as u64;
    let chunk = cfg.chunk_size as u64;
    let raw = threads + 3;
    let scratch = threads;
    let frames = threads + 1;
    part_buffers(cfg.concurrency) as u64 * cfg.part_size
        + (raw + scratch + frames) * (chunk + format::HEADER_LEN as u64)
}

/// The most bytes of buffers one checkpoint upload holds at once under a `[ckpt]` section
/// (`part_size`, `concurrency`, and the default chunk size and compress threads): what
/// [`Config::parse`](sluice_core::config::Config::parse) checks `[agent] memory` against, and what
/// each of the node's upload slots ([`Config::upload_slots`](sluice_core::config::Config::upload_slots))
/// stands for.
pub fn upload_memory(ckpt: &CkptConfig) -> u64 {
    in_flight_bound(&super::ArchiveConfig {
        part_size: ckpt.part_size,
        concurrency: ckpt.concurrency,
        ..super::ArchiveConfig::default()
    })
}

/// An object's last piece small enough to be copied out of its part buffer (which then returns to
/// the pool at once).
fn small_piece(len: usize, part_size: u64) -> bool {
    len as u64 <= part_size / 8
}

/// Raw chunk buffers, reused: the reader takes one per chunk, its encoder gives it back. Their
/// number is bounded by the pipeline (the channel, the encoders in flight, the one being read).
#[derive(Clone, Default)]
struct RawBuffers(Arc<Mutex<Vec<Vec<u8>>>>);

impl RawBuffers {
    fn take(&self, len: usize) -> Vec<u8> {
        let mut buf = self
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop()
            .unwrap_or_default();
        buf.resize(len, 0);
        buf
    }

    fn give(&self, buf: Vec<u8>) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(buf);
    }

    /// A buffer as it was given back (its length and contents unspecified), for code that clears
    /// or resizes it itself.
    fn take_any(&self) -> Vec<u8> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop()
            .unwrap_or_default()
    }
}

/// An encoded frame's bytes in a buffer of the upload's frame pool, back to the pool when the
/// assembler has copied it into a part buffer and drops it.
struct FrameBuf {
    buf: Vec<u8>,
    pool: RawBuffers,
}

impl AsRef<[u8]> for FrameBuf {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for FrameBuf {
    fn drop(&mut self) {
        self.pool.give(std::mem::take(&mut self.buf));
    }
}

/// Encodes one chunk on an encoder thread with the upload's reused buffers: the raw chunk goes
/// back to `raw`, the planes' scratch to `scratch`, and the frame's buffer returns to `frames` once
/// the frame is dropped. Each pool holds at most one buffer per chunk in flight, so the encoders
/// allocate nothing per chunk in the steady state.
fn encode_pooled(data: Vec<u8>, c: FileCompression, pools: &EncodePools) -> Frame {
    let mut grouped = pools.scratch.take_any();
    let mut out = pools.frames.take_any();
    let (codec, transform) = format::encode_chunk_into(&data, c, &mut grouped, &mut out);
    let blake3 = blake3::hash(&out);
    let raw_len = data.len() as u64;
    pools.raw.give(data);
    pools.scratch.give(grouped);
    Frame {
        bytes: Bytes::from_owner(FrameBuf {
            buf: out,
            pool: pools.frames.clone(),
        }),
        raw_len,
        codec,
        transform,
        blake3,
    }
}

/// The buffers an upload's encoders reuse (see [`encode_pooled`]).
#[derive(Clone, Default)]
struct EncodePools {
    raw: RawBuffers,
    scratch: RawBuffers,
    frames: RawBuffers,
}

/// The fixed pool of part buffers: `slots` of them exist at most, allocated on first use and then
/// reused.
struct PartPool {
    free: Mutex<Vec<Vec<u8>>>,
    slots: Arc<Semaphore>,
    capacity: usize,
}

impl PartPool {
    fn new(slots: usize, capacity: u64) -> Arc<PartPool> {
        Arc::new(PartPool {
            free: Mutex::new(Vec::new()),
            slots: Arc::new(Semaphore::new(slots)),
            capacity: capacity as usize,
        })
    }

    async fn get(self: &Arc<Self>) -> PartBuf {
        let slot = self
            .slots
            .clone()
            .acquire_owned()
            .await
            .expect("the part pool is never closed");
        let buf = self.free.lock().unwrap_or_else(|e| e.into_inner()).pop();
        PartBuf {
            buf: buf.unwrap_or_else(|| Vec::with_capacity(self.capacity)),
            pool: self.clone(),
            _slot: slot,
        }
    }
}

/// A part buffer of the pool; back to the pool when dropped (by the upload that sent it).
struct PartBuf {
    buf: Vec<u8>,
    pool: Arc<PartPool>,
    _slot: OwnedSemaphorePermit,
}

impl PartBuf {
    fn into_payload(self) -> PutPayload {
        in_pieces(Bytes::from_owner(self))
    }
}

/// Bytes of one piece of a payload (see [`in_pieces`]): what `zstd` and `cp` write at a time.
const WRITE_PIECE: usize = 128 << 10;

/// `bytes` as a payload of [`WRITE_PIECE`] slices of it (no copy). A `file://` store
/// (object_store's `LocalFileSystem`) writes each slice with its own `write(2)`, and the kernel
/// sizes the page-cache folios a write allocates by the write: one 16 MiB write takes 2 MiB folios.
/// On a VM guest with free page reporting (virtio-balloon reports free blocks of 2 MiB and up to
/// the host, which takes them back) the kernel's copy into such folios faults their pages in from
/// the host: on the 2-core test VM a part buffer written whole cost 2-4× the system CPU of the same
/// bytes written in 128 KiB pieces (1 GiB of bf16, 719 MB stored: sys 1.2-1.6 s → 0.4-0.6 s), and
/// made compression slower than `zstd -T0` when other work held the CPUs. Remote stores send the
/// slices as one request body.
fn in_pieces(bytes: Bytes) -> PutPayload {
    (0..bytes.len())
        .step_by(WRITE_PIECE)
        .map(|at| bytes.slice(at..bytes.len().min(at + WRITE_PIECE)))
        .collect()
}

impl AsRef<[u8]> for PartBuf {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for PartBuf {
    fn drop(&mut self) {
        let mut buf = std::mem::take(&mut self.buf);
        buf.clear();
        // The slot is released after this, with the fields: the buffer is back first.
        self.pool
            .free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(buf);
    }
}

/// What the reader thread produces, in file order.
enum ReadItem {
    Start {
        index: usize,
        compression: Choice,
    },
    Chunk {
        data: Vec<u8>,
        offset: u64,
        hash: HashBy,
        compression: Choice,
    },
    /// `hash`: the file's, when the reader hashed it (or it is empty). `read`: the version read.
    End {
        index: usize,
        hash: Option<blake3::Hash>,
        read: Snapshot,
    },
}

/// A read item after compression.
enum Encoded {
    Start {
        index: usize,
        compression: FileCompression,
    },
    Chunk(Frame, ChunkHash),
    End {
        index: usize,
        hash: Option<blake3::Hash>,
        read: Snapshot,
    },
}

/// Why the reader stopped early.
enum Stop {
    /// The pipeline is gone (it failed elsewhere): nothing to report.
    Closed,
    Failed(ArchiveError),
}

struct Reader {
    rt: tokio::runtime::Handle,
    root: Arc<OwnedFd>,
    files: Arc<Vec<TreeFile>>,
    uid: u32,
    chunk_size: u64,
    level: i32,
    tag: String,
    raw: RawBuffers,
    tx: mpsc::Sender<Result<ReadItem, ArchiveError>>,
}

impl Reader {
    fn send(&self, item: ReadItem) -> Result<(), Stop> {
        self.tx.blocking_send(Ok(item)).map_err(|_| Stop::Closed)
    }

    fn walk_error(&self, e: WalkError) -> Stop {
        Stop::Failed(walk_error(&self.tag, e))
    }

    fn modified(&self, f: &TreeFile) -> Stop {
        Stop::Failed(ArchiveError::Modified {
            tag: self.tag.clone(),
            path: f.rel.clone(),
        })
    }

    fn read_at(
        &self,
        file: &std::fs::File,
        f: &TreeFile,
        buf: &mut [u8],
        at: u64,
    ) -> Result<(), Stop> {
        file.read_exact_at(buf, at).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                // Shorter than when we looked: it is being rewritten.
                self.modified(f)
            } else {
                Stop::Failed(ArchiveError::Read {
                    tag: self.tag.clone(),
                    path: f.rel.clone(),
                    detail: e.to_string(),
                })
            }
        })
    }

    fn run(self) {
        for index in 0..self.files.len() {
            match self.read_file(index) {
                Ok(()) => {}
                Err(Stop::Closed) => return,
                Err(Stop::Failed(e)) => {
                    let _ = self.tx.blocking_send(Err(e));
                    return;
                }
            }
        }
    }

    fn read_file(&self, index: usize) -> Result<(), Stop> {
        let f = &self.files[index];
        let (file, before) =
            walk::open_file(&self.root, f, self.uid).map_err(|e| self.walk_error(e))?;
        if before.ino != f.ino || before.size != f.size {
            return Err(self.modified(f));
        }
        let sample = match format::sample_range(f.size) {
            Some(r) => {
                let mut buf = vec![0u8; (r.end - r.start) as usize];
                self.read_at(&file, f, &mut buf, r.start)?;
                Some(buf)
            }
            None => None,
        };
        let level = self.level;
        let compression: Choice = self
            .rt
            .spawn_blocking(move || format::choose_compression(sample.as_deref(), level))
            .map(|r| r.unwrap_or(FileCompression::STORED))
            .boxed()
            .shared();
        self.send(ReadItem::Start {
            index,
            compression: compression.clone(),
        })?;
        let hash = HashBy::of(f.size, self.chunk_size);
        let mut hasher = blake3::Hasher::new();
        let mut offset = 0;
        while offset < f.size {
            let n = self.chunk_size.min(f.size - offset);
            let mut data = self.raw.take(n as usize);
            self.read_at(&file, f, &mut data, offset)?;
            if let HashBy::Reader = hash {
                hasher.update(&data);
            }
            self.send(ReadItem::Chunk {
                data,
                offset,
                hash,
                compression: compression.clone(),
            })?;
            offset += n;
        }
        // Torn-write check: the file must be exactly as it was when we started reading it.
        let after: Snapshot = Snapshot::of(&file, &f.rel).map_err(|e| self.walk_error(e))?;
        if after != before {
            return Err(self.modified(f));
        }
        self.send(ReadItem::End {
            index,
            hash: (f.size == 0 || matches!(hash, HashBy::Reader)).then(|| hasher.finalize()),
            read: after,
        })
    }
}

pub(super) fn walk_error(tag: &str, e: WalkError) -> ArchiveError {
    match e {
        // Gone since we listed it: the checkpoint is being rewritten or removed.
        WalkError::Io {
            path,
            errno: nix::errno::Errno::ENOENT,
        } => ArchiveError::Modified {
            tag: tag.into(),
            path,
        },
        WalkError::Refused { path, reason } => ArchiveError::Refused {
            tag: tag.into(),
            path,
            reason,
        },
        WalkError::Io { path, errno } => ArchiveError::Read {
            tag: tag.into(),
            path,
            detail: errno.to_string(),
        },
    }
}

enum PartMsg {
    Part {
        payload: PutPayload,
        permit: OwnedSemaphorePermit,
    },
    /// The last part was sent; note the object in the resume log once it is complete.
    Finish(Option<Pending>),
}

/// The file being assembled into its object.
struct Current {
    index: usize,
    key: ObjPath,
    compression: FileCompression,
    chunks: Vec<ChunkEntry>,
    stored: u64,
    /// The chunks' subtree chaining values, or the hash of the one chunk.
    subtrees: Vec<ChainingValue>,
    whole: Option<blake3::Hash>,
    /// The stored bytes not yet sent: at most one part.
    buf: Option<PartBuf>,
    part_size: u64,
    /// Set once the object goes multipart: the channel to its upload task.
    multipart: Option<mpsc::Sender<PartMsg>>,
}

struct Assembler<'a> {
    archiver: &'a Archiver,
    tag: String,
    node: String,
    files: Arc<Vec<TreeFile>>,
    requests: Arc<Semaphore>,
    parts: Arc<PartPool>,
    progress: ArchiveProgress,
    cancel: CancellationToken,
    tasks: FuturesUnordered<JoinHandle<Result<(), ArchiveError>>>,
    cur: Option<Current>,
    done: Vec<FileEntry>,
    /// The resume log, when the upload keeps one.
    journal: Option<Journal>,
}

impl Assembler<'_> {
    fn stopped(&self) -> ArchiveError {
        ArchiveError::Stopped {
            tag: self.tag.clone(),
        }
    }

    async fn permit(&self) -> OwnedSemaphorePermit {
        self.requests
            .clone()
            .acquire_owned()
            .await
            .expect("the request semaphore is never closed")
    }

    async fn push(&mut self, item: Encoded) -> Result<(), ArchiveError> {
        match item {
            Encoded::Start { index, compression } => {
                let f = &self.files[index];
                let chunk = self.archiver.cfg.chunk_size as u64;
                self.cur = Some(Current {
                    index,
                    key: self.archiver.data_key(&self.tag, &f.rel),
                    compression,
                    chunks: Vec::with_capacity(f.size.div_ceil(chunk) as usize),
                    stored: 0,
                    subtrees: Vec::new(),
                    whole: None,
                    buf: None,
                    part_size: part_size_for(
                        self.archiver.cfg.part_size,
                        stored_bound(f.size, chunk),
                    ),
                    multipart: None,
                });
            }
            Encoded::Chunk(frame, hash) => {
                let cur = self.cur.as_mut().expect("a chunk follows its file's start");
                match hash {
                    ChunkHash::Whole(h) => cur.whole = Some(h),
                    ChunkHash::Subtree(cv) => cur.subtrees.push(cv),
                    ChunkHash::None => {}
                }
                let len = frame.bytes.len() as u64;
                cur.chunks.push(ChunkEntry {
                    offset: cur.stored,
                    stored: len,
                    raw: frame.raw_len,
                    codec: frame.codec,
                    transform: frame.transform,
                    blake3: frame.blake3.to_hex().to_string(),
                });
                cur.stored += len;
                self.progress.bytes_done(frame.raw_len);
                // Stored size above the part size: multipart, in parts of exactly part_size (the
                // last may be shorter). A full part is sent when more bytes come, so at least one
                // byte stays for the last part.
                let mut rest = &frame.bytes[..];
                while !rest.is_empty() {
                    let cur = self.cur.as_ref().expect("the current file");
                    if cur
                        .buf
                        .as_ref()
                        .is_some_and(|b| b.buf.len() as u64 >= cur.part_size)
                    {
                        self.send_part().await?;
                    }
                    if self.cur.as_ref().is_some_and(|c| c.buf.is_none()) {
                        let buf = self.parts.get().await;
                        self.cur.as_mut().expect("the current file").buf = Some(buf);
                    }
                    let cur = self.cur.as_mut().expect("the current file");
                    let buf = &mut cur.buf.as_mut().expect("a part buffer").buf;
                    let n = (cur.part_size as usize - buf.len()).min(rest.len());
                    buf.extend_from_slice(&rest[..n]);
                    rest = &rest[n..];
                }
            }
            Encoded::End { index, hash, read } => {
                let cur = self.cur.take().expect("an end follows its file's start");
                debug_assert_eq!(cur.index, index);
                self.finish_file(cur, hash, read).await?;
            }
        }
        Ok(())
    }

    /// Hands the full part buffer to the multipart task.
    async fn send_part(&mut self) -> Result<(), ArchiveError> {
        if self.cur.as_ref().is_some_and(|c| c.multipart.is_none()) {
            self.start_multipart().await?;
        }
        let permit = self.permit().await;
        let cur = self
            .cur
            .as_mut()
            .expect("sending a part of the current file");
        let payload = cur.buf.take().expect("a full part").into_payload();
        let tx = cur.multipart.clone().expect("multipart started");
        tx.send(PartMsg::Part { payload, permit })
            .await
            .map_err(|_| self.stopped())?;
        self.poll_errors()
    }

    async fn start_multipart(&mut self) -> Result<(), ArchiveError> {
        let cur = self.cur.as_mut().expect("a current file");
        let key = cur.key.clone();
        let opts = PutMultipartOptions {
            attributes: self.archiver.data_attributes(),
            ..Default::default()
        };
        let upload = self
            .archiver
            .store
            .put_multipart_opts(&key, opts)
            .await
            .map_err(self.archiver.store_err("start multipart upload", &key))?;
        let (tx, rx) = mpsc::channel(1);
        cur.multipart = Some(tx);
        let task = MultipartTask {
            upload,
            rx,
            cancel: self.cancel.clone(),
            throttle: self.archiver.throttle.clone(),
            progress: self.progress.clone(),
            url: self.archiver.url.clone(),
            key,
            tag: self.tag.clone(),
        };
        self.tasks.push(tokio::spawn(task.run()));
        Ok(())
    }

    async fn finish_file(
        &mut self,
        mut cur: Current,
        hash: Option<blake3::Hash>,
        read: Snapshot,
    ) -> Result<(), ArchiveError> {
        let f = &self.files[cur.index];
        let chunk = self.archiver.cfg.chunk_size as u64;
        let hash = hash
            .or(cur.whole)
            .unwrap_or_else(|| super::download::file_hash(&cur.subtrees, chunk, f.size));
        let entry = FileEntry {
            path: f.rel.clone(),
            node: self.node.clone(),
            size: f.size,
            mode: f.mode,
            blake3: hash.to_hex().to_string(),
            compression: cur.compression,
            stored_size: cur.stored,
            chunks: std::mem::take(&mut cur.chunks),
            storage_class: self.archiver.data_class.clone(),
        };
        let pending = self
            .journal
            .as_ref()
            .map(|j| j.pending(Identity::read(&read), entry.clone()));
        self.done.push(entry);
        let permit = self.permit().await;
        let payload = match cur.buf.take() {
            Some(b) if small_piece(b.buf.len(), cur.part_size) => {
                in_pieces(Bytes::copy_from_slice(&b.buf))
            }
            Some(b) => b.into_payload(),
            None => PutPayload::default(),
        };
        if let Some(tx) = cur.multipart.take() {
            tx.send(PartMsg::Part { payload, permit })
                .await
                .map_err(|_| self.stopped())?;
            tx.send(PartMsg::Finish(pending))
                .await
                .map_err(|_| self.stopped())?;
        } else {
            let (store, key, throttle, progress, cancel) = (
                self.archiver.store.clone(),
                cur.key,
                self.archiver.throttle.clone(),
                self.progress.clone(),
                self.cancel.clone(),
            );
            let err = self.archiver.store_err("put", &key);
            let opts = PutOptions {
                attributes: self.archiver.data_attributes(),
                ..Default::default()
            };
            let stopped = self.stopped();
            self.tasks.push(tokio::spawn(async move {
                let n = payload.content_length() as u64;
                let put = async {
                    if let Some(t) = &throttle {
                        t.acquire(n).await;
                    }
                    store.put_opts(&key, payload, opts).await
                };
                let r = tokio::select! {
                    r = put => r.map_err(err),
                    _ = cancel.cancelled() => Err(stopped),
                };
                drop(permit);
                let put = r?;
                progress.stored(n);
                progress.file_done();
                if let Some(p) = pending {
                    p.stored(put.e_tag);
                }
                Ok(())
            }));
        }
        self.poll_errors()
    }

    /// Surfaces a failed upload early, without waiting.
    fn poll_errors(&mut self) -> Result<(), ArchiveError> {
        while let Some(Some(r)) = self.tasks.next().now_or_never() {
            r.expect("upload task panicked")?;
        }
        Ok(())
    }

    /// Waits for every upload; their objects are then durable.
    async fn finish(&mut self) -> Result<Vec<FileEntry>, ArchiveError> {
        while let Some(r) = self.tasks.next().await {
            r.expect("upload task panicked")?;
        }
        let mut done = std::mem::take(&mut self.done);
        done.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(done)
    }

    /// After a failure: stop every upload and abort the multipart ones, and wait for that. Returns
    /// the first error an upload task failed with by itself (not because it was stopped): when the
    /// assembler only saw a task go away, that is the cause to report.
    async fn shut_down(&mut self) -> Option<ArchiveError> {
        self.cancel.cancel();
        self.cur = None;
        let mut cause = None;
        while let Some(r) = self.tasks.next().await {
            if let Ok(Err(e)) = r
                && cause.is_none()
                && !matches!(e, ArchiveError::Stopped { .. })
            {
                cause = Some(e);
            }
        }
        cause
    }
}

/// Drives one multipart upload: parts as the assembler sends them (concurrently, each holding a
/// request permit), then `complete`. Aborts the upload on any failure, on cancellation, and when
/// the assembler goes away without saying `Finish`.
struct MultipartTask {
    upload: Box<dyn MultipartUpload>,
    rx: mpsc::Receiver<PartMsg>,
    cancel: CancellationToken,
    throttle: Option<Arc<super::Throttle>>,
    progress: ArchiveProgress,
    url: String,
    key: ObjPath,
    tag: String,
}

impl MultipartTask {
    fn store_err(&self, op: &'static str) -> impl Fn(object_store::Error) -> ArchiveError + use<> {
        let (url, key) = (self.url.clone(), self.key.to_string());
        move |error| ArchiveError::Store {
            url: url.clone(),
            op,
            key: key.clone(),
            error: Box::new(error),
        }
    }

    async fn run(mut self) -> Result<(), ArchiveError> {
        let part_err = self.store_err("upload part");
        let mut inflight = FuturesUnordered::new();
        let mut finished = false;
        let mut pending = None;
        let result = loop {
            if finished && inflight.is_empty() {
                break Ok(());
            }
            tokio::select! {
                _ = self.cancel.cancelled() => break Err(ArchiveError::Stopped { tag: self.tag.clone() }),
                Some(r) = inflight.next(), if !inflight.is_empty() => {
                    if let Err(e) = r {
                        break Err(part_err(e));
                    }
                }
                msg = self.rx.recv(), if !finished => match msg {
                    Some(PartMsg::Part { payload, permit }) => {
                        let n = payload.content_length() as u64;
                        let put = self.upload.put_part(payload);
                        let (throttle, progress) = (self.throttle.clone(), self.progress.clone());
                        inflight.push(async move {
                            if let Some(t) = &throttle {
                                t.acquire(n).await;
                            }
                            let r = put.await;
                            drop(permit);
                            if r.is_ok() {
                                progress.stored(n);
                            }
                            r
                        });
                    }
                    Some(PartMsg::Finish(p)) => {
                        finished = true;
                        pending = p;
                    }
                    None => break Err(ArchiveError::Stopped { tag: self.tag.clone() }),
                },
            }
        };
        let result = match result {
            Ok(()) => self
                .upload
                .complete()
                .await
                .map_err(self.store_err("complete multipart upload")),
            Err(e) => Err(e),
        };
        match result {
            Ok(done) => {
                self.progress.file_done();
                if let Some(p) = pending {
                    p.stored(done.e_tag);
                }
                Ok(())
            }
            Err(e) => {
                drop(inflight);
                if let Err(abort) = self.upload.abort().await {
                    tracing::warn!(
                        url = self.url,
                        key = %self.key,
                        "aborting a failed multipart upload failed ({abort}); the store's \
                         AbortIncompleteMultipartUpload lifecycle rule has to clean it"
                    );
                }
                Err(e)
            }
        }
    }
}

impl Archiver {
    /// The attributes of a data object's PUT or multipart upload: its storage class, if one is
    /// configured (object_store sends it as `x-amz-storage-class` to S3, `x-ms-access-tier` to
    /// Azure, `x-goog-storage-class` to GCS). Manifests and notes are written without.
    fn data_attributes(&self) -> Attributes {
        let mut a = Attributes::new();
        if let Some(class) = &self.data_class {
            a.insert(Attribute::StorageClass, class.clone().into());
        }
        a
    }

    /// Uploads this node's files of checkpoint `tag` — the directory `dir`, whose files must all
    /// belong to `expected_uid` (see [`super::walk`]) — to `BASE/TAG/data/<relpath>`, then writes
    /// `BASE/TAG/parts/<node>.json`. Idempotent: a rerun uploads again. A file that changes while it
    /// is read fails the upload with [`ArchiveError::Modified`] (retry later); no part manifest is
    /// written then. Once the checkpoint is published, returns the node's existing part.
    ///
    /// `flushed`: the hashes of a checkpoint flushed from the RAM tier. The hashes the upload
    /// computes of the hot tier's copy (as it reads it for the MANIFEST) must be those, file for
    /// file; else [`ArchiveError::NotAsFlushed`] and no part manifest, so no node publishes a copy
    /// that is not what the job saved.
    ///
    /// With a resume directory ([`Archiver::with_resume_dir`]) a rerun after an interruption
    /// uploads only the files whose objects it did not store yet (see [`super::resume`]).
    pub async fn upload_part(
        &self,
        tag: &str,
        node: &str,
        dir: Arc<OwnedFd>,
        expected_uid: u32,
        progress: &ArchiveProgress,
        flushed: Option<&crate::flush::FlushHashes>,
    ) -> Result<PartManifest, ArchiveError> {
        check_name("checkpoint tag", tag)?;
        check_name("node name", node)?;
        let resume = self.resume_log(tag, node);
        // A published checkpoint is immutable.
        if self.manifest_opt(tag).await?.is_some() {
            if let Some(log) = &resume {
                log.remove().await;
            }
            return self
                .part_opt(tag, node)
                .await?
                .ok_or_else(|| ArchiveError::AlreadyPublished {
                    url: self.url.clone(),
                    tag: tag.into(),
                    node: node.into(),
                });
        }
        // A part manifest exists only while the data objects match it: drop ours before uploading.
        let part_key = self.part_key(tag, node);
        match self.store.delete(&part_key).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(self.store_err("delete", &part_key)(e)),
        }

        let (root, t) = (dir.clone(), tag.to_string());
        let tree = blocking(move || walk::walk(&root, expected_uid))
            .await
            .map_err(|e| walk_error(&t, e))?;
        if !tree.superseded.is_empty() {
            tracing::warn!(
                tag,
                node,
                files = ?tree.superseded,
                "left out of the archive: writers' temporary files whose finished file stands \
                 beside them (a writer killed mid-save leaves one)"
            );
        }
        progress.set_totals(
            tree.files.len() as u64,
            tree.files.iter().map(|f| f.size).sum(),
        );
        let dirs = tree.dirs;
        let (mut entries, files, journal) = match &resume {
            Some(log) => {
                let plan = self
                    .resume_plan(log, tag, node, tree.files, progress)
                    .await?;
                (plan.resumed, plan.upload, plan.journal)
            }
            None => (Vec::new(), tree.files, None),
        };
        let (journal, writer) = journal.unzip();
        let uploaded = self
            .upload_files(
                tag,
                node,
                dir,
                expected_uid,
                Arc::new(files),
                progress.clone(),
                journal,
            )
            .await;
        // Every upload task is done: the log holds each object they stored.
        if let Some(w) = writer {
            w.finish().await;
        }
        entries.extend(uploaded?);
        entries.sort_by(|a, b| a.path.cmp(&b.path));
        if let Some(flushed) = flushed {
            let damaged = crate::flush::differences(
                flushed,
                entries.iter().map(|e| (e.path.as_str(), e.content_hash())),
            );
            if !damaged.is_empty() {
                return Err(ArchiveError::NotAsFlushed {
                    tag: tag.into(),
                    damaged,
                });
            }
        }

        let part = PartManifest {
            format: PART_FORMAT.into(),
            version: VERSION,
            tag: tag.into(),
            node: node.into(),
            job_id: self.job,
            created_unix_ms: unix_ms_now(),
            chunk_size: self.cfg.chunk_size as u64,
            dirs,
            files: entries,
        };
        let json = part.to_json();
        super::check_manifest_size(tag, &format!("parts/{node}.json"), json.len())?;
        // Every data object is durable (all puts returned): now the part may say so.
        self.store
            .put(&part_key, PutPayload::from(json))
            .await
            .map_err(self.store_err("put", &part_key))?;
        if let Some(log) = &resume {
            log.remove().await;
        }
        tracing::info!(
            tag,
            node,
            url = self.url,
            files = part.files.len(),
            raw = part.raw_bytes(),
            stored = part.stored_bytes(),
            "checkpoint part archived"
        );
        Ok(part)
    }

    /// Uploads `files`, noting each object stored in `journal`; returns their entries.
    #[allow(clippy::too_many_arguments)]
    async fn upload_files(
        &self,
        tag: &str,
        node: &str,
        dir: Arc<OwnedFd>,
        uid: u32,
        files: Arc<Vec<TreeFile>>,
        progress: ArchiveProgress,
        journal: Option<Journal>,
    ) -> Result<Vec<FileEntry>, ArchiveError> {
        let cancel = CancellationToken::new();
        // If this future is dropped, the upload tasks stop and abort their multipart uploads.
        let _stop_tasks = cancel.clone().drop_guard();
        let (tx, rx) = mpsc::channel(2);
        let pools = EncodePools::default();
        let raw = pools.raw.clone();
        let reader = Reader {
            rt: tokio::runtime::Handle::current(),
            root: dir,
            files: files.clone(),
            uid,
            chunk_size: self.cfg.chunk_size as u64,
            level: self.cfg.zstd_level,
            tag: tag.into(),
            raw,
            tx,
        };
        let reader = tokio::task::spawn_blocking(move || reader.run());
        let encoded = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|item| (item, rx))
        })
        .map(|item| {
            let pools = pools.clone();
            async move {
                Ok::<_, ArchiveError>(match item? {
                    ReadItem::Start { index, compression } => Encoded::Start {
                        index,
                        compression: compression.await,
                    },
                    ReadItem::Chunk {
                        data,
                        offset,
                        hash,
                        compression,
                    } => {
                        let c = compression.await;
                        let (frame, hash) = blocking(move || {
                            let hash = hash.chunk(&data, offset);
                            (encode_pooled(data, c, &pools), hash)
                        })
                        .await;
                        Encoded::Chunk(frame, hash)
                    }
                    ReadItem::End { index, hash, read } => Encoded::End { index, hash, read },
                })
            }
        })
        .buffered(self.cfg.compress_threads);
        let mut asm = Assembler {
            archiver: self,
            tag: tag.into(),
            node: node.into(),
            files,
            requests: Arc::new(Semaphore::new(self.cfg.concurrency)),
            parts: PartPool::new(part_buffers(self.cfg.concurrency), self.cfg.part_size),
            progress,
            cancel,
            tasks: FuturesUnordered::new(),
            cur: None,
            done: Vec::new(),
            journal,
        };
        let result = async {
            let mut encoded = std::pin::pin!(encoded);
            while let Some(item) = encoded.next().await {
                asm.push(item?).await?;
            }
            asm.finish().await
        }
        .await;
        let result = match result {
            Err(e) => {
                let cause = asm.shut_down().await;
                match (e, cause) {
                    (ArchiveError::Stopped { .. }, Some(cause)) => Err(cause),
                    (e, _) => Err(e),
                }
            }
            ok => ok,
        };
        // The reader has stopped: it sent everything, or its channel is closed.
        reader.await.expect("checkpoint reader panicked");
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_core::config::Config;

    /// The archive's part memory is the pool's: no more buffers than slots, each reused once its
    /// upload drops it.
    #[tokio::test]
    async fn part_buffers_are_bounded_and_reused() {
        let pool = PartPool::new(2, 1 << 20);
        let mut a = pool.get().await;
        a.buf.extend_from_slice(&[7; 1000]);
        let b = pool.get().await;
        let a_ptr = a.buf.as_ptr();
        let payload = a.into_payload();
        let third = pool.get();
        tokio::pin!(third);
        assert!(
            futures::poll!(&mut third).is_pending(),
            "a third buffer while two are out"
        );
        // Dropping the payload (the PUT is done) returns its buffer, emptied, to the pool.
        let held = payload.clone();
        drop(payload);
        assert!(
            futures::poll!(&mut third).is_pending(),
            "a payload still refers to it"
        );
        drop(held);
        let c = third.await;
        assert_eq!(c.buf.as_ptr(), a_ptr);
        assert!(c.buf.is_empty() && c.buf.capacity() >= 1 << 20);
        drop(b);
    }

    /// A part is handed to the store as slices of its buffer (no copy), each at most a write
    /// piece, that add up to it byte for byte.
    #[test]
    fn payloads_are_pieces_of_the_part_buffer() {
        let data: Vec<u8> = (0..2 * WRITE_PIECE + 1000)
            .map(|i| (i % 251) as u8)
            .collect();
        let bytes = Bytes::from(data.clone());
        let payload = in_pieces(bytes.clone());
        let lens: Vec<usize> = payload.iter().map(|p| p.len()).collect();
        assert_eq!(lens, [WRITE_PIECE, WRITE_PIECE, 1000]);
        assert_eq!(payload.iter().next().unwrap().as_ptr(), bytes.as_ptr());
        assert_eq!(payload.iter().flatten().copied().collect::<Vec<u8>>(), data);
        assert_eq!(in_pieces(Bytes::new()).content_length(), 0);
    }

    /// The encoders' reused buffers write the same frames as [`format::encode_chunk`], and a chunk
    /// allocates nothing once its buffers have come back.
    #[test]
    fn pooled_encoding_writes_the_same_frames_and_reuses_its_buffers() {
        use crate::synth::{bf16_weights, fp32_values};
        let pools = EncodePools::default();
        let level = 1;
        let chunks = [
            bf16_weights(100_000, 1),
            fp32_values(50_001, 2),
            vec![0u8; 70_000],
            (0..=255u8).cycle().take(3000).collect(),
            vec![],
        ];
        let mut seen = Vec::new();
        for (i, raw) in chunks.iter().enumerate() {
            let c = format::choose_compression(Some(raw), level);
            let want = format::encode_chunk(raw, c);
            let got = encode_pooled(raw.clone(), c, &pools);
            assert_eq!(got.bytes, want.bytes, "chunk {i}");
            assert_eq!(
                (got.raw_len, got.codec, got.transform, got.blake3),
                (want.raw_len, want.codec, want.transform, want.blake3)
            );
            seen.push(got.bytes.as_ptr());
            drop(got);
            // Raw chunk, scratch and frame are back: one of each.
            assert_eq!(lock_len(&pools.frames), 1);
            assert_eq!(lock_len(&pools.scratch), 1);
            assert_eq!(lock_len(&pools.raw), 1);
            let _ = pools.raw.take_any(); // the reader would take a new chunk's buffer
        }
        // Once large enough, the same frame buffer serves every chunk.
        assert_eq!(seen[1], seen[2]);
    }

    fn lock_len(b: &RawBuffers) -> usize {
        b.0.lock().unwrap().len()
    }

    #[test]
    fn the_memory_budget_bounds_stage_and_archive_buffers() {
        let cfg = |agent: &str, rest: &str| {
            Config::parse(
                &format!(
                    "[agent]\nsocket='/s'\nstate_dir='/st'\n{agent}[hot_tier]\nroot='/h'\n{rest}"
                ),
                "n1",
                upload_memory,
            )
        };
        // Not set: no budget, stage.memory as before.
        let c = cfg("", "").unwrap();
        assert_eq!((c.memory, c.stage.memory), (None, 32 << 20));
        assert_eq!(
            c.upload_slots(upload_memory(&c.ckpt)),
            None,
            "no budget, no limit on uploads"
        );
        // The defaults: 5 part buffers of 16MiB, and 3 chunk buffers per compress thread plus 4.
        let archive = upload_memory(&c.ckpt);
        let threads = crate::ArchiveConfig::default().compress_threads as u64;
        assert_eq!(archive, (80 << 20) + (3 * threads + 4) * ((4 << 20) + 16));
        let c = cfg("memory='256MiB'\n", "").unwrap();
        assert_eq!((c.memory, c.stage.memory), (Some(256 << 20), 32 << 20));
        assert!(c.stage.memory + upload_memory(&c.ckpt) <= 256 << 20);
        // Uploads at once, over all jobs: what the budget holds beside stage-in, at least one.
        let slots = c.upload_slots(archive).unwrap();
        assert_eq!(slots as u64, ((256 << 20) - c.stage.memory) / archive);
        assert!(slots >= 1 && c.stage.memory + slots as u64 * archive <= 256 << 20);
        let c = cfg("memory='2GiB'\n", "").unwrap();
        assert!(
            c.upload_slots(archive).unwrap() > slots,
            "a larger budget holds more uploads"
        );
        // A tight budget: an unset stage.memory gets what the archive leaves.
        let mib = archive.div_ceil(1 << 20) + 8;
        let c = cfg(&format!("memory='{mib}MiB'\n"), "").unwrap();
        assert_eq!(c.stage.memory + upload_memory(&c.ckpt), mib << 20);
        assert_eq!(
            c.upload_slots(archive),
            Some(1),
            "one upload at a time in a tight budget"
        );
        // Set explicitly, their sum must fit: the message names what to change.
        let e = cfg(&format!("memory='{mib}MiB'\n"), "[stage]\nmemory='32MiB'\n").unwrap_err();
        assert!(e.contains(&format!("agent.memory ({mib}MiB)")), "{e}");
        assert!(e.contains("stage.memory (32MiB)"), "{e}");
        assert!(
            e.contains("ckpt.part_size = 16MiB and ckpt.concurrency = 8"),
            "{e}"
        );
        // Smaller parts fit the same budget.
        let c = cfg(
            &format!("memory='{mib}MiB'\n"),
            "[stage]\nmemory='32MiB'\n[ckpt]\npart_size='8MiB'\n",
        )
        .unwrap();
        assert!(c.stage.memory + upload_memory(&c.ckpt) <= mib << 20);
        let e = cfg("memory='lots'\n", "").unwrap_err();
        assert!(e.contains("lots"), "{e}");
        // The example's budget holds its stage-in and the real upload figure.
        let example = include_str!("../../slurm-conf/sluice.toml");
        let c = Config::parse(example, "n1", upload_memory).unwrap();
        assert!(c.memory.is_some() && c.upload_slots(upload_memory(&c.ckpt)).is_some());
    }
}
