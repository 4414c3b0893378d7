//! Reading a checkpoint back: verify (decode everything, write nothing) and restore (decode into a
//! directory on the hot tier). One pipeline serves both, so what verify passes restore reads the
//! same way.
//!
//! Each file's chunks are fetched in ranges of about the part size, with parallel ranged GETs
//! (`concurrency` in flight); each range is checked chunk by chunk (BLAKE3 of every frame, header
//! against the manifest) and decoded on a blocking thread, and written at its offset. Results are
//! consumed in file order, so the hash of each file's raw content is checked too, before the file
//! counts as restored.

use super::format;
use super::manifest::{FileEntry, Manifest, check_rel_path};
use super::{ArchiveError, ArchiveProgress, Archiver, Damaged};
use blake3::hazmat::{
    ChainingValue, HasherExt, Mode, left_subtree_len, merge_subtrees_non_root, merge_subtrees_root,
};
use futures::{Stream, StreamExt};
use sluice_core::iobuf::{self, AlignedBuf};
use sluice_core::rt::blocking;
use sluice_core::safefs::{self, Owner};
use std::cell::RefCell;
use std::fs::File;
use std::ops::Range;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// What [`Archiver::verify`] checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyReport {
    pub tag: String,
    pub files: u64,
    pub raw_bytes: u64,
    pub stored_bytes: u64,
}

/// Where decoded chunks go.
#[derive(Clone)]
enum Sink {
    Verify,
    Restore { dest: Arc<OwnedFd>, owner: Owner },
}

/// One ranged GET: consecutive chunks of one file.
struct Work {
    file: usize,
    chunks: Range<usize>,
    /// Bytes of the data object.
    range: Range<u64>,
    /// Where the first chunk's content starts in the file.
    raw_offset: u64,
    last_of_file: bool,
}

/// What one range decoded to, for the file's content hash.
enum Hashed {
    /// BLAKE3 chaining values of its chunks (the file's chunks are subtrees, see [`tree_piece`]).
    Subtrees(Vec<ChainingValue>),
    /// Its raw bytes, for a hasher fed in file order.
    Raw(Vec<Vec<u8>>),
}

struct Decoded {
    raw_bytes: u64,
    hashed: Hashed,
}

/// The chunk size of a file whose chunks are whole BLAKE3 subtrees: two chunks at least, all but
/// the last of one power-of-two size of at least BLAKE3's 1 KiB chunk.
fn tree_piece(f: &FileEntry) -> Option<u64> {
    let piece = f.chunks.first()?.raw;
    let uniform = f.chunks.len() >= 2
        && piece.is_power_of_two()
        && piece >= blake3::CHUNK_LEN as u64
        && f.chunks[..f.chunks.len() - 1]
            .iter()
            .all(|c| c.raw == piece)
        && f.chunks.last().is_some_and(|c| c.raw <= piece);
    uniform.then_some(piece)
}

/// BLAKE3 of a file of `len` bytes from the chaining values of its chunks of `piece` bytes (the
/// last may be shorter; two chunks at least), split as BLAKE3's tree is: the left subtree is the
/// largest power of two of 1 KiB chunks below the length, so always whole pieces.
pub(super) fn file_hash(cvs: &[ChainingValue], piece: u64, len: u64) -> blake3::Hash {
    fn halves(cvs: &[ChainingValue], piece: u64, len: u64) -> (ChainingValue, ChainingValue) {
        let left = left_subtree_len(len);
        let k = (left / piece) as usize;
        (
            subtree(&cvs[..k], piece, left),
            subtree(&cvs[k..], piece, len - left),
        )
    }
    fn subtree(cvs: &[ChainingValue], piece: u64, len: u64) -> ChainingValue {
        if cvs.len() == 1 {
            return cvs[0];
        }
        let (l, r) = halves(cvs, piece, len);
        merge_subtrees_non_root(&l, &r, Mode::Hash)
    }
    let (l, r) = halves(cvs, piece, len);
    merge_subtrees_root(&l, &r, Mode::Hash)
}

/// The content check of one file whose ranges are arriving.
struct FileCheck {
    hasher: blake3::Hasher,
    subtrees: Vec<ChainingValue>,
    /// Already reported damaged: the rest of it is ignored.
    bad: bool,
}

impl FileCheck {
    fn new() -> FileCheck {
        FileCheck {
            hasher: blake3::Hasher::new(),
            subtrees: Vec::new(),
            bad: false,
        }
    }
}

/// Why one piece of work failed.
enum WorkError {
    /// The data does not match the manifest: names the file.
    Damaged(String),
    Fatal(ArchiveError),
    /// Not done: the restore had already failed.
    Stopped,
}

/// Splits every file into ranges of whole chunks of about `range_size` stored bytes (at least one
/// chunk each; a file without chunks gets one empty range, so it is created). The ranges of `width`
/// files at a time are taken in turn, so that the writes in flight go to different files: writes
/// to one file serialise on its inode lock. Each file's ranges stay in order.
fn plan(files: &[FileEntry], range_size: u64, width: usize) -> Vec<Work> {
    let mut per_file: Vec<Vec<Work>> = Vec::with_capacity(files.len());
    for (i, f) in files.iter().enumerate() {
        let mut work = Vec::new();
        let (mut first, mut raw_offset) = (0, 0);
        while first < f.chunks.len() {
            let start = f.chunks[first].offset;
            let mut end = first;
            let mut stored = 0;
            while end < f.chunks.len()
                && (end == first || stored + f.chunks[end].stored <= range_size)
            {
                stored += f.chunks[end].stored;
                end += 1;
            }
            work.push(Work {
                file: i,
                chunks: first..end,
                range: start..start + stored,
                raw_offset,
                last_of_file: false,
            });
            raw_offset += f.chunks[first..end].iter().map(|c| c.raw).sum::<u64>();
            first = end;
        }
        if work.is_empty() {
            work.push(Work {
                file: i,
                chunks: 0..0,
                range: 0..0,
                raw_offset: 0,
                last_of_file: false,
            });
        }
        work.last_mut()
            .expect("one range per file at least")
            .last_of_file = true;
        per_file.push(work);
    }
    let mut work = Vec::new();
    for group in per_file.chunks_mut(width.max(1)) {
        let mut queues: Vec<_> = group.iter_mut().map(|w| w.drain(..)).collect();
        loop {
            let before = work.len();
            work.extend(queues.iter_mut().filter_map(|q| q.next()));
            if work.len() == before {
                break;
            }
        }
    }
    work
}

/// Receive buffers of the ranged GETs, reused: at most `concurrency` are in use at once, and a
/// fresh buffer per range cost page faults and zeroing of every byte received.
#[derive(Default)]
struct Buffers {
    idle: Mutex<Vec<Vec<u8>>>,
}

impl Buffers {
    fn take(&self) -> Vec<u8> {
        self.idle
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop()
            .unwrap_or_default()
    }

    fn give(&self, mut buf: Vec<u8>) {
        buf.clear();
        self.idle
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(buf);
    }
}

enum Fetch {
    Store(object_store::Error),
    /// More bytes than the range arrived.
    TooLong(String),
}

/// GETs `range` of `key`, streaming the body into `buf` (emptied first). Fewer bytes than asked
/// are left for the caller's size check.
async fn fetch_into(
    store: &dyn object_store::ObjectStore,
    key: &object_store::path::Path,
    range: Range<u64>,
    buf: &mut Vec<u8>,
) -> Result<(), Fetch> {
    let len = (range.end - range.start) as usize;
    buf.clear();
    buf.reserve(len);
    let opts = object_store::GetOptions {
        range: Some(range.into()),
        ..object_store::GetOptions::default()
    };
    let mut body = store
        .get_opts(key, opts)
        .await
        .map_err(Fetch::Store)?
        .into_stream();
    while let Some(piece) = body.next().await {
        let piece = piece.map_err(Fetch::Store)?;
        if buf.len() + piece.len() > len {
            return Err(Fetch::TooLong(format!(
                "the store returned more than the {len} bytes of the range"
            )));
        }
        buf.extend_from_slice(&piece);
    }
    Ok(())
}

fn write_error(tag: &str, path: &str, e: safefs::SafeFsError) -> ArchiveError {
    ArchiveError::Write {
        tag: tag.into(),
        path: path.into(),
        errno: e.errno().map(|e| e as i32),
        detail: e.to_string(),
    }
}

fn io_write_error(tag: &str, path: &str, e: std::io::Error) -> ArchiveError {
    ArchiveError::Write {
        tag: tag.into(),
        path: path.into(),
        errno: e.raw_os_error(),
        detail: e.to_string(),
    }
}

/// Creates `path` below `dest` (parents too) for `owner`, with exactly the permission bits `mode`.
fn create(
    dest: &OwnedFd,
    path: &str,
    mode: u32,
    owner: Owner,
    tag: &str,
) -> Result<File, ArchiveError> {
    let parts = check_rel_path(path).map_err(|detail| ArchiveError::Write {
        tag: tag.into(),
        path: path.into(),
        detail,
        errno: None,
    })?;
    let (name, dirs) = parts.split_last().expect("a path has a file name");
    let dir =
        safefs::ensure_dirs(dest, dirs, Some(owner)).map_err(|e| write_error(tag, path, e))?;
    let file = safefs::create_file(&dir, name, Some(owner), 0o600)
        .map_err(|e| write_error(tag, path, e))?;
    // Set the mode exactly (creation is filtered by the umask); never setuid/setgid/sticky.
    file.set_permissions(std::fs::Permissions::from_mode(mode & 0o777))
        .map_err(|e| io_write_error(tag, path, e))?;
    Ok(file)
}

impl Archiver {
    /// Downloads every object of checkpoint `tag` and checks it against its MANIFEST: object sizes,
    /// every chunk's checksum and header, every file's content checksum. Fails with
    /// [`ArchiveError::Corrupt`] naming every damaged file.
    pub async fn verify(&self, tag: &str) -> Result<VerifyReport, ArchiveError> {
        self.verify_with_progress(tag, &ArchiveProgress::default())
            .await
    }

    /// [`Archiver::verify`], counting what it has checked in `progress` (the totals are set once
    /// the MANIFEST is read), for a caller that shows how far it is.
    pub async fn verify_with_progress(
        &self,
        tag: &str,
        progress: &ArchiveProgress,
    ) -> Result<VerifyReport, ArchiveError> {
        let m = self.manifest(tag).await?;
        progress.set_totals(m.files.len() as u64, m.raw_bytes);
        self.check_objects(&m).await?;
        self.read_back(&m, Sink::Verify, progress.clone()).await?;
        Ok(VerifyReport {
            tag: tag.into(),
            files: m.files.len() as u64,
            raw_bytes: m.raw_bytes,
            stored_bytes: m.stored_bytes,
        })
    }

    /// Restores checkpoint `tag` into `dest` (a directory fd, normally empty: existing files are not
    /// overwritten), every file and directory owned by `owner`. Refuses a tag without a valid
    /// MANIFEST; fails with [`ArchiveError::Corrupt`] naming the file when data does not match it.
    /// On failure `dest` holds a partial tree, which the caller removes.
    pub async fn restore(
        &self,
        tag: &str,
        dest: Arc<OwnedFd>,
        owner: Owner,
        progress: &ArchiveProgress,
    ) -> Result<Manifest, ArchiveError> {
        self.restore_files(tag, dest, owner, progress, &|_| true)
            .await
    }

    /// [`Archiver::restore`] of the files `keep` selects only (every directory is made): a node of
    /// a multi-node job restores its share from the archive and takes the rest from the job's
    /// other nodes. Returns the whole MANIFEST.
    pub async fn restore_files(
        &self,
        tag: &str,
        dest: Arc<OwnedFd>,
        owner: Owner,
        progress: &ArchiveProgress,
        keep: &(dyn Fn(&FileEntry) -> bool + Sync),
    ) -> Result<Manifest, ArchiveError> {
        let whole = self.manifest(tag).await?;
        let files: Vec<FileEntry> = whole.files.iter().filter(|f| keep(f)).cloned().collect();
        let m = Manifest {
            raw_bytes: files.iter().map(|f| f.size).sum(),
            stored_bytes: files.iter().map(|f| f.stored_size).sum(),
            files,
            ..whole.clone()
        };
        progress.set_totals(m.files.len() as u64, m.raw_bytes);
        self.check_objects(&m).await?;
        let (d, dirs, t) = (dest.clone(), m.dirs.clone(), tag.to_string());
        blocking(move || {
            for dir in &dirs {
                let parts = check_rel_path(dir).map_err(|detail| ArchiveError::Write {
                    tag: t.clone(),
                    path: dir.clone(),
                    detail,
                    errno: None,
                })?;
                safefs::ensure_dirs(&d, &parts, Some(owner))
                    .map_err(|e| write_error(&t, dir, e))?;
            }
            Ok::<_, ArchiveError>(())
        })
        .await?;
        self.read_back(&m, Sink::Restore { dest, owner }, progress.clone())
            .await?;
        tracing::info!(
            tag,
            url = self.url,
            files = m.files.len(),
            "checkpoint restored"
        );
        Ok(whole)
    }

    /// The shared pipeline of verify and restore. Verify goes on past damaged files to name them
    /// all; restore stops at the first.
    async fn read_back(
        &self,
        m: &Manifest,
        sink: Sink,
        progress: ArchiveProgress,
    ) -> Result<(), ArchiveError> {
        let keep_going = matches!(sink, Sink::Verify);
        let files = Arc::new(m.files.clone());
        let outputs: Arc<Vec<Mutex<Option<Arc<Output>>>>> =
            Arc::new(files.iter().map(|_| Mutex::new(None)).collect());
        let work = plan(&files, self.cfg.part_size, self.cfg.concurrency);
        // Set when restore gives up: work not yet started then does nothing, so no file is created
        // or written after this function returns (the caller may be removing the tree).
        let stop = Arc::new(AtomicBool::new(false));
        let buffers = Arc::new(Buffers::default());
        let results = futures::stream::iter(work)
            .map(|w| {
                let (files, outputs, sink, progress, stop) = (
                    files.clone(),
                    outputs.clone(),
                    sink.clone(),
                    progress.clone(),
                    stop.clone(),
                );
                let key = self.data_key(&m.tag, &files[w.file].path);
                let (store, url, tag) = (self.store.clone(), self.url.clone(), m.tag.clone());
                let buffers = buffers.clone();
                async move {
                    let (file, last) = (w.file, w.last_of_file);
                    let outcome = async {
                        if stop.load(Ordering::Relaxed) {
                            return Err(WorkError::Stopped);
                        }
                        let mut buf = buffers.take();
                        if !w.range.is_empty() {
                            let got = fetch_into(&*store, &key, w.range.clone(), &mut buf).await;
                            if let Err(error) = got {
                                buffers.give(buf);
                                return Err(match error {
                                    Fetch::Store(error) => WorkError::Fatal(ArchiveError::Store {
                                        url,
                                        op: "get",
                                        key: key.to_string(),
                                        error: Box::new(error),
                                    }),
                                    Fetch::TooLong(detail) => WorkError::Damaged(detail),
                                });
                            }
                        }
                        progress.stored(buf.len() as u64);
                        let (buf, outcome) = blocking(move || {
                            if stop.load(Ordering::Relaxed) {
                                return (buf, Err(WorkError::Stopped));
                            }
                            let outcome = decode_and_write(&w, &buf, &files, &outputs, &sink, &tag);
                            (buf, outcome)
                        })
                        .await;
                        buffers.give(buf);
                        outcome
                    }
                    .await;
                    (file, last, outcome)
                }
            })
            .buffered(self.cfg.concurrency);
        let mut results = std::pin::pin!(results);
        let outcome = self
            .consume(m, &files, &outputs, results.as_mut(), keep_going, &progress)
            .await;
        if outcome.is_err() {
            stop.store(true, Ordering::Relaxed);
            // Wait for the work in flight (at most `concurrency` ranges) to finish or give up.
            while results.next().await.is_some() {}
        }
        outcome
    }

    /// Checks the results in order: each file's content hash once its last range is in.
    async fn consume(
        &self,
        m: &Manifest,
        files: &[FileEntry],
        outputs: &[Mutex<Option<Arc<Output>>>],
        mut results: Pin<&mut impl Stream<Item = (usize, bool, Result<Decoded, WorkError>)>>,
        keep_going: bool,
        progress: &ArchiveProgress,
    ) -> Result<(), ArchiveError> {
        // Each file's ranges arrive in order, those of a few files interleaved (see `plan`).
        let mut damaged: Vec<Damaged> = Vec::new();
        let mut checks: Vec<Option<FileCheck>> = files.iter().map(|_| None).collect();
        let mut syncs = Vec::new();
        while let Some((file, last, outcome)) = results.next().await {
            let f = &files[file];
            let check = checks[file].get_or_insert_with(FileCheck::new);
            match outcome {
                Err(WorkError::Fatal(e)) => return Err(e),
                Err(WorkError::Stopped) => unreachable!("work stops only after consume returned"),
                Err(WorkError::Damaged(detail)) => {
                    if !keep_going {
                        return Err(self.corrupt_one(&m.tag, &f.path, detail));
                    }
                    if !check.bad {
                        damaged.push(Damaged {
                            path: f.path.clone(),
                            detail,
                        });
                        check.bad = true;
                    }
                }
                Ok(d) if !check.bad => {
                    match d.hashed {
                        Hashed::Subtrees(v) => check.subtrees.extend(v),
                        Hashed::Raw(raws) => {
                            let mut h = std::mem::replace(&mut check.hasher, blake3::Hasher::new());
                            check.hasher = blocking(move || {
                                for r in &raws {
                                    h.update(r);
                                }
                                h
                            })
                            .await;
                        }
                    }
                    progress.bytes_done(d.raw_bytes);
                }
                Ok(_) => {}
            }
            if !last {
                continue;
            }
            let check = checks[file].take().expect("checked above");
            let out = outputs[file]
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take();
            if check.bad {
                continue;
            }
            let hash = match tree_piece(f) {
                Some(piece) => file_hash(&check.subtrees, piece, f.size),
                None => check.hasher.finalize(),
            };
            if hash != f.content_hash() {
                let detail = "content checksum mismatch after decoding".to_string();
                if !keep_going {
                    return Err(self.corrupt_one(&m.tag, &f.path, detail));
                }
                damaged.push(Damaged {
                    path: f.path.clone(),
                    detail,
                });
                continue;
            }
            if let Some(out) = out {
                // Durable before the restore returns; the disk writes it while the rest arrives.
                let (tag, path) = (m.tag.clone(), f.path.clone());
                syncs.push(tokio::task::spawn_blocking(move || {
                    out.file
                        .sync_all()
                        .map_err(|e| io_write_error(&tag, &path, e))
                }));
            }
            progress.file_done();
        }
        for sync in syncs {
            sync.await.expect("fsync task panicked")?;
        }
        self.corrupt(&m.tag, damaged)
    }

    fn corrupt_one(&self, tag: &str, path: &str, detail: String) -> ArchiveError {
        ArchiveError::Corrupt {
            url: self.url.clone(),
            tag: tag.into(),
            damaged: vec![Damaged {
                path: path.into(),
                detail,
            }],
        }
    }
}

/// Starts writing `len` bytes at `offset` of `file` to disk without waiting, so the disk writes
/// while the rest arrives and the fsync at the end has little left to do (below the kernel's dirty
/// threshold nothing would be written before it). On Linux `POSIX_FADV_DONTNEED` starts writeback
/// of the dirty pages of the range and drops only its clean ones, which these are not yet. A hint:
/// the fsync reports any write error.
fn start_writeback(file: &File, offset: u64, len: usize) {
    use std::os::fd::AsFd;
    let _ = nix::fcntl::posix_fadvise(
        file.as_fd(),
        offset as i64,
        len as i64,
        nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED,
    );
}

/// A file being restored. The whole blocks of a chunk decoded into an [`AlignedBuf`] at an aligned
/// file offset are written with `O_DIRECT` where the file system allows it: straight from the decode
/// buffer to the disk, without the page-cache copy (the largest CPU cost of a restore on a busy
/// node) and without a gigabyte of dirty pages for the final fsync to write at the end. The rest
/// (tails shorter than a block, chunks of files hashed in order, or every write where `O_DIRECT` is
/// refused) go through the page cache, their writeback started at once.
pub(crate) struct Output {
    file: File,
    /// The same file opened again with `O_DIRECT`; `None` when the file system refuses it.
    direct: Option<File>,
    /// Set when a direct write was refused (`EINVAL`): the rest go through the page cache.
    no_direct: AtomicBool,
}

impl Output {
    pub(crate) fn new(file: File) -> Output {
        use nix::fcntl::OFlag;
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::OpenOptionsExt;
        // The open file itself, through its /proc link: not a path anyone can swap.
        let direct = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags((OFlag::O_DIRECT | OFlag::O_CLOEXEC).bits())
            .open(format!("/proc/self/fd/{}", file.as_raw_fd()))
            .ok();
        Output {
            file,
            direct,
            no_direct: AtomicBool::new(false),
        }
    }

    /// Writes `buf` at `offset`: its whole blocks directly when `offset` is aligned too, the rest
    /// through the page cache.
    pub(crate) fn write_aligned_at(&self, buf: &AlignedBuf, offset: u64) -> std::io::Result<()> {
        let mut done = 0;
        if let Some(direct) = &self.direct
            && iobuf::is_aligned(offset)
            && buf.aligned_len() > 0
            && !self.no_direct.load(Ordering::Relaxed)
        {
            match direct.write_all_at(buf.blocks(), offset) {
                Ok(()) => done = buf.aligned_len(),
                Err(e) if e.raw_os_error() == Some(nix::libc::EINVAL) => {
                    self.no_direct.store(true, Ordering::Relaxed);
                }
                Err(e) => return Err(e),
            }
        }
        self.write_cached_at(&buf[done..], offset + done as u64)
    }

    /// Whether every write went through `O_DIRECT` where it could (none was refused).
    pub(crate) fn direct(&self) -> bool {
        self.direct.is_some() && !self.no_direct.load(Ordering::Relaxed)
    }

    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    /// Writes `raw` at `offset` through the page cache and starts its writeback.
    fn write_cached_at(&self, raw: &[u8], offset: u64) -> std::io::Result<()> {
        if !raw.is_empty() {
            sluice_core::pagecache::write_all_at(&self.file, raw, offset)?;
            start_writeback(&self.file, offset, raw.len());
        }
        Ok(())
    }
}

thread_local! {
    /// The decoded chunk, reused by each blocking thread: aligned, so that its whole blocks can be
    /// written with `O_DIRECT`.
    static RAW: RefCell<AlignedBuf> = const { RefCell::new(AlignedBuf::empty()) };
}

/// Checks and decodes the chunks of one range, and writes them to the restored file; hashes each
/// chunk as a BLAKE3 subtree where the file allows it. Blocking.
fn decode_and_write(
    w: &Work,
    data: &[u8],
    files: &[FileEntry],
    outputs: &[Mutex<Option<Arc<Output>>>],
    sink: &Sink,
    tag: &str,
) -> Result<Decoded, WorkError> {
    let f = &files[w.file];
    if data.len() as u64 != w.range.end - w.range.start {
        return Err(WorkError::Damaged(format!(
            "the store returned {} bytes for a range of {}",
            data.len(),
            w.range.end - w.range.start
        )));
    }
    let out = match sink {
        Sink::Restore { dest, owner } => {
            let mut slot = outputs[w.file].lock().unwrap_or_else(|e| e.into_inner());
            match &*slot {
                Some(file) => Some(file.clone()),
                None => {
                    let file =
                        create(dest, &f.path, f.mode, *owner, tag).map_err(WorkError::Fatal)?;
                    let out = Arc::new(Output::new(file));
                    *slot = Some(out.clone());
                    Some(out)
                }
            }
        }
        _ => None,
    };
    let piece = tree_piece(f);
    let mut hashed = match piece {
        Some(_) => Hashed::Subtrees(Vec::with_capacity(w.chunks.len())),
        None => Hashed::Raw(Vec::with_capacity(w.chunks.len())),
    };
    let total = f.chunks.len();
    let mut offset = w.raw_offset;
    RAW.with_borrow_mut(|reused| {
        for i in w.chunks.clone() {
            let c = &f.chunks[i];
            let at = (c.offset - w.range.start) as usize;
            let frame = &data[at..at + c.stored as usize];
            let damaged = |e| WorkError::Damaged(format!("chunk {} of {total}: {e}", i + 1));
            let written = match &mut hashed {
                Hashed::Subtrees(cvs) => {
                    // Reallocated only when a larger chunk comes.
                    let raw = reused.reuse(c.raw as usize);
                    format::decode_chunk_to(frame, &c.expected(), raw).map_err(damaged)?;
                    // Hashed while the chunk is still in the cache from decoding, then written.
                    cvs.push(
                        blake3::Hasher::new()
                            .set_input_offset(offset)
                            .update(raw)
                            .finalize_non_root(),
                    );
                    match &out {
                        Some(out) => out.write_aligned_at(reused, offset),
                        None => Ok(()),
                    }
                }
                Hashed::Raw(raws) => {
                    let mut raw = Vec::new();
                    format::decode_chunk_into(frame, &c.expected(), &mut raw).map_err(damaged)?;
                    let written = match &out {
                        Some(out) => out.write_cached_at(&raw, offset),
                        None => Ok(()),
                    };
                    raws.push(raw);
                    written
                }
            };
            written.map_err(|e| WorkError::Fatal(io_write_error(tag, &f.path, e)))?;
            offset += c.raw;
        }
        Ok(())
    })?;
    Ok(Decoded {
        raw_bytes: offset - w.raw_offset,
        hashed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_takes_the_ranges_of_a_few_files_in_turn() {
        let file = |path: &str, chunks: u64| FileEntry {
            path: path.into(),
            node: "n1".into(),
            size: chunks * 100,
            mode: 0o644,
            blake3: blake3::hash(b"").to_hex().to_string(),
            compression: format::FileCompression::STORED,
            stored_size: chunks * 116,
            chunks: (0..chunks)
                .map(|i| super::super::ChunkEntry {
                    offset: i * 116,
                    stored: 116,
                    raw: 100,
                    codec: format::Codec::Stored,
                    transform: format::Transform::None,
                    blake3: blake3::hash(b"").to_hex().to_string(),
                })
                .collect(),
            storage_class: None,
        };
        // One chunk per range; files of 3, 1, 0 and 2 ranges, two files at a time.
        let files = [file("a", 3), file("b", 1), file("c", 0), file("d", 2)];
        let order: Vec<(usize, u64, bool)> = plan(&files, 116, 2)
            .iter()
            .map(|w| (w.file, w.raw_offset, w.last_of_file))
            .collect();
        assert_eq!(
            order,
            [
                (0, 0, false),
                (1, 0, true),
                (0, 100, false),
                (0, 200, true),
                (2, 0, true),
                (3, 0, false),
                (3, 100, true),
            ]
        );
    }

    /// The whole blocks of an aligned buffer at an aligned offset go through `O_DIRECT`; its tail,
    /// and a write at an unaligned offset, through the page cache; the file reads back as written.
    /// The file sits in the target directory, not in `/tmp` (often a tmpfs, which before Linux 6.6
    /// refuses `O_DIRECT`): where the file system refuses it all the same, the test fails and says
    /// so, rather than check the page-cache path alone.
    #[test]
    fn aligned_blocks_are_written_directly_and_the_rest_through_the_page_cache() {
        use std::io::Read;
        let dir = sluice_core::testing::direct_io_dir();
        let path = dir.path().join("restored");
        let out = Output::new(File::create_new(&path).unwrap());
        let block = iobuf::ALIGN;
        let mut buf = AlignedBuf::empty();
        let mut expected = vec![0u8; 6 * block + 10];
        let mut write = |len: usize, offset: usize, seed: u8| {
            for (i, b) in buf.reuse(len).iter_mut().enumerate() {
                *b = seed.wrapping_add((i % 253) as u8);
            }
            out.write_aligned_at(&buf, offset as u64).unwrap();
            expected[offset..offset + len].copy_from_slice(&buf);
        };
        write(2 * block + 100, 0, 1); // two blocks direct, a tail cached
        write(2 * block, 3 * block, 2); // two blocks direct
        write(block - 1, 5 * block + 11, 3); // unaligned offset: cached
        assert!(
            out.direct.is_some(),
            "{} ({})",
            sluice_core::testing::DIRECT_IO_REFUSED,
            dir.path().display()
        );
        assert!(
            !out.no_direct.load(Ordering::Relaxed),
            "the aligned writes were refused with EINVAL"
        );
        out.file.sync_all().unwrap();
        let mut back = Vec::new();
        File::open(&path).unwrap().read_to_end(&mut back).unwrap();
        assert_eq!(back.len(), expected.len());
        assert!(back == expected, "the file does not read back as written");
    }

    #[test]
    fn merged_subtree_hashes_are_the_file_hash() {
        let data: Vec<u8> = (0..500_000u32).map(|i| (i * 31 + i / 7) as u8).collect();
        for piece in [1024usize, 4096, 65536] {
            for len in [piece + 1, 2 * piece, 2 * piece + 5, 7 * piece - 3, 300_000] {
                let cvs: Vec<ChainingValue> = data[..len]
                    .chunks(piece)
                    .enumerate()
                    .map(|(i, c)| {
                        blake3::Hasher::new()
                            .set_input_offset((i * piece) as u64)
                            .update(c)
                            .finalize_non_root()
                    })
                    .collect();
                assert_eq!(
                    file_hash(&cvs, piece as u64, len as u64),
                    blake3::hash(&data[..len]),
                    "piece {piece} len {len}"
                );
            }
        }
    }
}
