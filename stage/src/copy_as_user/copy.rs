//! The piece copier: regular files copied by [`copy_threads`] threads, each file whole or, where a
//! side is not a local file system, in pieces ([`piece_for`]); peer units and the files a cache may
//! keep go through a buffer and are hashed on the way. Progress and each copied unit, file or
//! hash are reported to the agent as they are done.

use super::error::HelperError;
use super::protocol::{FileIdent, HelperMsg, send};
use crate::local_fs::{is_local_fs, preallocate};
use sluice_core::config::StripeClass;
use std::fs;
use std::io::{self, Read, Seek, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Duration;

/// Copy threads in the helper: one per core, at least 2 and at most 8. Copying through the page
/// cache is CPU-bound on local disks, so threads beyond the cores only contend; 8 is enough to hide
/// per-file latency on parallel file systems.
fn copy_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .clamp(2, 8)
}

/// Files larger than this are copied as several pieces in parallel, so one big file uses every
/// copy thread, where that is faster ([`piece_for`]).
pub(super) const PIECE: u64 = 64 << 20;

/// The piece size for copying `src` to `dst`: [`PIECE`], unless both are on local file systems,
/// where each file is copied whole by one thread. Local file systems (ext4, XFS, btrfs, tmpfs)
/// serialize buffered writes to one inode on its lock, so a second thread on the same file gains
/// at most a few percent and, on a busy node, spends a core spinning on that lock: one file of
/// 1 GiB on ext4 took 0.28 s with one thread and 0.29–0.35 s with two while another process kept
/// one of two cores busy (`cp -a`: 0.29–0.31 s). A network or parallel file system (Lustre,
/// BeeGFS, NFS, GPFS) on either side is limited by each stream's latency instead, which parallel
/// pieces hide. A side whose file system cannot be told counts as not local.
pub(super) fn piece_for(src: &Path, dst: &Path) -> u64 {
    // `dst` does not exist yet: its nearest existing ancestor tells where it will be.
    let local = |p: &Path| {
        p.ancestors()
            .find_map(|a| nix::sys::statfs::statfs(a).ok())
            .is_some_and(|st| is_local_fs(st.filesystem_type()))
    };
    if local(src) && local(dst) {
        u64::MAX
    } else {
        PIECE
    }
}

/// One regular file to copy: where from, where to, its size when listed and its permission bits.
pub(super) struct FileJob {
    pub(super) src: PathBuf,
    pub(super) dst: PathBuf,
    pub(super) size: u64,
    pub(super) mode: u32,
    /// On a Lustre shared tier: `lfs` and the stripe layout the file is created with.
    pub(super) stripe: Option<(Arc<PathBuf>, StripeClass)>,
    /// A replica's file with units this node does not copy: made before its pieces, and given its
    /// mode by the agent once it wrote the other units (see [`super::modes`]).
    pub(super) partial: bool,
    /// A file the node's cache may keep ([`super::copy_tree_cached`]): the identity it had when
    /// this helper opened it, which every piece's descriptor must still have before and after its
    /// copy.
    pub(super) cache: Option<Identified>,
    /// A resumable copy ([`super::copy_tree_resumable`]): the file's path below the dataset,
    /// reported in a `whole` line with its source's identity once it is copied whole.
    pub(super) whole: Option<String>,
}

impl FileJob {
    /// `size` bytes of `src` to copy to `dst` with `mode`, whole by this helper.
    pub(super) fn new(src: PathBuf, dst: PathBuf, size: u64, mode: u32) -> FileJob {
        FileJob {
            src,
            dst,
            size,
            mode,
            stripe: None,
            partial: false,
            cache: None,
            whole: None,
        }
    }
}

/// A byte range of one file, the unit a copy thread takes. Files up to [`PIECE`] are one piece;
/// the last piece of a file copies to its end, so a file that grew since the walk is copied whole.
pub(super) struct Piece {
    pub(super) file: usize,
    pub(super) offset: u64,
    /// `None`: to the end of the file.
    pub(super) len: Option<u64>,
    /// Of a file made before its pieces are copied ([`copy_files`] makes those of several pieces).
    pub(super) shared: bool,
    /// A peer unit of the file listed as this: copied through a buffer, hashed, and reported.
    pub(super) unit: Option<usize>,
}

/// A file of a cached copy: its number in the `ident` lines, its identity then, and the piece
/// size its hash is taken in.
#[derive(Debug, Clone, Copy)]
pub(super) struct Identified {
    pub(super) idx: usize,
    pub(super) file: FileIdent,
    pub(super) piece: u64,
}

/// The hash a cached copy reports for a file (`copied IDX PIECE HASH`): the BLAKE3 of the BLAKE3
/// hashes of its `PIECE`-byte ranges, in order. The helper's copy threads hash the pieces they
/// copy; the agent hashes the staged file the same way before it keeps it.
pub fn piece_hashes_hash(pieces: &[blake3::Hash]) -> blake3::Hash {
    let mut h = blake3::Hasher::new();
    for p in pieces {
        h.update(p.as_bytes());
    }
    h.finalize()
}

/// Opens a source file for reading, never through a link (the walk found a regular file there).
pub(super) fn open_source(path: &Path) -> Result<fs::File, HelperError> {
    fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
        .open(path)
        .map_err(HelperError::io("opening", path))
}

/// Opens a source file as [`open_source`] does, with the identity `fstat` gives on that
/// descriptor; `None` for what is no longer a regular file.
pub(super) fn identify(path: &Path) -> Result<Option<(fs::File, FileIdent)>, HelperError> {
    let opened = open_source(path)?;
    let file = FileIdent::of(&opened).map_err(HelperError::io("reading", path))?;
    Ok(file.map(|file| (opened, file)))
}

/// Reorders `files` to take one file from each directory in turn, so that copy threads mostly
/// create files in different directories: creating a file locks its directory.
pub(super) fn interleave_directories(files: Vec<FileJob>) -> Vec<FileJob> {
    let mut seen: std::collections::HashMap<&Path, u64> = std::collections::HashMap::new();
    let mut rounds: Vec<u64> = Vec::with_capacity(files.len());
    for f in &files {
        let n = seen.entry(f.dst.parent().unwrap_or(&f.dst)).or_default();
        rounds.push(*n);
        *n += 1;
    }
    let mut keyed: Vec<(u64, FileJob)> = rounds.into_iter().zip(files).collect();
    keyed.sort_by_key(|(round, _)| *round); // stable: the walk's order within a round
    keyed.into_iter().map(|(_, f)| f).collect()
}

/// Opens `job`'s source and creates its destination (which must not exist) with `mode`.
pub(super) fn create_pair(
    job: &FileJob,
    mode: u32,
    umask: u32,
) -> Result<(fs::File, fs::File), HelperError> {
    let src = fs::File::open(&job.src).map_err(HelperError::io("opening", &job.src))?;
    if let Some((lfs, class)) = &job.stripe {
        // `lfs setstripe` creates the empty file with its layout (this process is the job user:
        // it can do nothing through the path that the user could not do themselves).
        let out = std::process::Command::new(lfs.as_path())
            .args(crate::lustre::setstripe_args(class, job.dst.as_os_str()))
            .stdin(std::process::Stdio::null())
            .output()
            .map_err(|source| HelperError::RunLfs {
                lfs: lfs.to_path_buf(),
                source,
            })?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            return Err(HelperError::Setstripe {
                lfs: lfs.to_path_buf(),
                dst: job.dst.clone(),
                reason: err.lines().last().unwrap_or("").trim().to_string(),
            });
        }
        let dst = fs::OpenOptions::new()
            .write(true)
            .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
            .open(&job.dst)
            .map_err(HelperError::io("opening", &job.dst))?;
        set_mode(&dst, job, mode)?;
        return Ok((src, dst));
    }
    Ok((src, create_dst(job, mode, umask)?))
}

/// Creates `job`'s destination (which must not exist) with `mode`, never through a link.
pub(super) fn create_dst(job: &FileJob, mode: u32, umask: u32) -> Result<fs::File, HelperError> {
    let dst = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
        .open(&job.dst)
        .map_err(HelperError::io("creating", &job.dst))?;
    if mode & umask != 0 {
        set_mode(&dst, job, mode)?;
    }
    preallocate(&dst, job.size).map_err(HelperError::io("allocating space for", &job.dst))?;
    Ok(dst)
}

/// After the last piece of a file (copied to the source's end) ended at `end`: the file is cut
/// there, so that a source that shrank since it was listed leaves no preallocated tail.
fn trim_to(dst: &fs::File, job: &FileJob, p: &Piece, end: u64) -> Result<(), HelperError> {
    if p.len.is_none() && end < job.size {
        dst.set_len(end)
            .map_err(HelperError::io("truncating", &job.dst))?;
    }
    Ok(())
}

fn set_mode(dst: &fs::File, job: &FileJob, mode: u32) -> Result<(), HelperError> {
    dst.set_permissions(fs::Permissions::from_mode(mode))
        .map_err(HelperError::io("setting the mode of", &job.dst))
}

/// Copies `len` bytes (`None`: to the end of the file) from `src` to `dst`, each at its current
/// offset. `std::io::copy` copies file to file in the kernel (`copy_file_range`) and falls back to
/// read/write where the file systems do not support that.
fn copy_range(mut src: &fs::File, mut dst: &fs::File, len: Option<u64>) -> io::Result<u64> {
    match len {
        Some(n) => io::copy(&mut src.take(n), &mut dst),
        None => io::copy(&mut src, &mut dst),
    }
}

/// What [`copy_piece`] did.
#[derive(Debug, PartialEq, Eq)]
struct PieceCopied {
    bytes: u64,
    /// A peer unit's hash, or an identified file's piece's when it stayed the file identified.
    hash: Option<blake3::Hash>,
    /// A peer unit of an identified file: whether it stayed the file identified.
    same: bool,
    /// Of a resumable copy's file ([`FileJob::whole`]): the source descriptor's identity, when it
    /// was the same before and after the copy.
    source: Option<FileIdent>,
}

/// Copies one piece: whole small files from scratch; pieces of a file made before (by
/// [`copy_files`], or the first run of a replica) through their own descriptors, at their offset.
/// A peer unit goes through `buf` and is hashed on the way.
fn copy_piece(
    job: &FileJob,
    p: &Piece,
    umask: u32,
    buf: &mut Vec<u8>,
) -> Result<PieceCopied, HelperError> {
    let copy_err = HelperError::io("copying", &job.src);
    let (src, dst) = if p.shared {
        let src = fs::File::open(&job.src).map_err(HelperError::io("opening", &job.src))?;
        let dst = fs::OpenOptions::new()
            .write(true)
            .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
            .open(&job.dst)
            .map_err(HelperError::io("opening", &job.dst))?;
        (src, dst)
    } else {
        create_pair(job, job.mode, umask)?
    };
    if p.unit.is_some() {
        let len = p.len.expect("a unit has a length");
        if buf.is_empty() {
            buf.resize(UNIT_BUF, 0);
        }
        // Of an identified file, whether this descriptor is the file identified, before and
        // after the copy: `changed` otherwise.
        let same = |f: &fs::File| {
            job.cache
                .is_none_or(|c| FileIdent::of(f).ok().flatten() == Some(c.file))
        };
        let before = same(&src);
        let hash = copy_hashed(&src, &dst, p.offset, len, buf).map_err(copy_err)?;
        return Ok(PieceCopied {
            bytes: len,
            hash: Some(hash),
            same: before && same(&src),
            source: None,
        });
    }
    if let Some(c) = job.cache {
        // Cacheable only if this descriptor is the file identified, before and after the copy,
        // and gave exactly the bytes of the piece.
        let same = |f: &fs::File| FileIdent::of(f).ok().flatten() == Some(c.file);
        let before = same(&src);
        if buf.is_empty() {
            buf.resize(UNIT_BUF, 0);
        }
        let (n, hash) = copy_to_end_hashed(&src, &dst, p.offset, p.len, buf).map_err(copy_err)?;
        let want = p.len.unwrap_or(c.file.size.saturating_sub(p.offset));
        let kept = before && n == want && same(&src);
        trim_to(&dst, job, p, p.offset + n)?;
        return Ok(PieceCopied {
            bytes: n,
            hash: kept.then_some(hash),
            same: true,
            source: None,
        });
    }
    if p.shared {
        (&src)
            .seek(io::SeekFrom::Start(p.offset))
            .map_err(copy_err)?;
        (&dst)
            .seek(io::SeekFrom::Start(p.offset))
            .map_err(copy_err)?;
    }
    let identity = |f: &fs::File| match &job.whole {
        Some(_) => FileIdent::of(f).ok().flatten(),
        None => None,
    };
    let before = identity(&src);
    let bytes = copy_range(&src, &dst, p.len).map_err(copy_err)?;
    trim_to(&dst, job, p, p.offset + bytes)?;
    let after = identity(&src);
    Ok(PieceCopied {
        bytes,
        hash: None,
        same: true,
        source: before.filter(|_| before == after),
    })
}

/// The buffer a copy thread reads peer units through.
const UNIT_BUF: usize = 1 << 20;

/// Copies `len` bytes at `offset` from `src` to the same offset of `dst` through `buf`, and
/// returns their BLAKE3 hash. A source shorter than that is an error: the unit's length is what
/// every node of the job expects.
fn copy_hashed(
    src: &fs::File,
    dst: &fs::File,
    offset: u64,
    len: u64,
    buf: &mut [u8],
) -> io::Result<blake3::Hash> {
    let (n, hash) = copy_to_end_hashed(src, dst, offset, Some(len), buf)?;
    if n < len {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!(
                "the file ends at {} bytes, shorter than when it was listed",
                offset + n
            ),
        ));
    }
    Ok(hash)
}

/// Copies from `offset` of `src` to the same offset of `dst` through `buf`, `len` bytes or (`None`)
/// to the end of `src`, whichever comes first; returns the bytes copied and their BLAKE3 hash.
fn copy_to_end_hashed(
    src: &fs::File,
    dst: &fs::File,
    offset: u64,
    len: Option<u64>,
    buf: &mut [u8],
) -> io::Result<(u64, blake3::Hash)> {
    let mut hasher = blake3::Hasher::new();
    let end = len.map_or(u64::MAX, |n| offset + n);
    let mut at = offset;
    while at < end {
        let n = (end - at).min(buf.len() as u64) as usize;
        let got = src.read_at(&mut buf[..n], at)?;
        if got == 0 {
            break;
        }
        hasher.update(&buf[..got]);
        sluice_core::pagecache::write_all_at(dst, &buf[..got], at)?;
        at += got as u64;
    }
    Ok((at - offset, hasher.finalize()))
}

/// Copies `files` with [`copy_threads`] threads, reporting progress on `out` every 200 ms and once
/// more when the last file is done.
pub(super) fn copy_files(
    files: &[FileJob],
    umask: u32,
    piece: u64,
    out: &mut impl Write,
) -> Result<(), HelperError> {
    // Files of several pieces are created here, owner-writable so that every piece can open them;
    // the thread that finishes a file's last piece gives it its final mode.
    let mut pieces = Vec::with_capacity(files.len());
    for (i, f) in files.iter().enumerate() {
        let n = f.size.div_ceil(piece).max(1);
        if n > 1 {
            create_pair(f, f.mode | 0o200, umask)?;
        }
        for k in 0..n {
            pieces.push(Piece {
                file: i,
                offset: k * piece,
                len: (k + 1 < n).then_some(piece),
                shared: n > 1,
                unit: None,
            });
        }
    }
    run_pieces(files, &pieces, umask, out)
}

/// Copies `pieces` of `files` with [`copy_threads`] threads, reporting progress on `out` every
/// 200 ms and once more when the last piece is done, and each peer unit's hash as it is done.
pub(super) fn run_pieces(
    files: &[FileJob],
    pieces: &[Piece],
    umask: u32,
    out: &mut impl Write,
) -> Result<(), HelperError> {
    let pieces_left: Vec<AtomicU64> = {
        let mut n = vec![0u64; files.len()];
        for p in pieces {
            n[p.file] += 1;
        }
        n.into_iter().map(AtomicU64::new).collect()
    };
    // Of an identified file: each piece's offset and hash (`None`: not cacheable).
    type PieceHashes = std::sync::Mutex<Vec<(u64, Option<blake3::Hash>)>>;
    let piece_hashes: Vec<PieceHashes> = files.iter().map(|_| Default::default()).collect();
    // Of a resumable copy's file: the bytes its pieces copied, and its source's identity while
    // they did (`Err`: it changed, or some piece could not tell).
    type Source = std::sync::Mutex<(u64, Result<Option<FileIdent>, ()>)>;
    let sources: Vec<Source> = files
        .iter()
        .map(|_| std::sync::Mutex::new((0, Ok(None))))
        .collect();
    let next = AtomicUsize::new(0);
    let (files_done, bytes_done) = (AtomicU64::new(0), AtomicU64::new(0));
    let failed = AtomicBool::new(false);
    let first_error: std::sync::Mutex<Option<HelperError>> = std::sync::Mutex::new(None);
    let run_piece = |p: &Piece, buf: &mut Vec<u8>, lines: &mpsc::Sender<HelperMsg>| {
        let job = &files[p.file];
        let PieceCopied {
            bytes: n,
            hash,
            same,
            source,
        } = copy_piece(job, p, umask, buf)?;
        if job.whole.is_some() {
            let mut slot = sources[p.file].lock().unwrap_or_else(|p| p.into_inner());
            slot.0 += n;
            slot.1 = match (slot.1, source) {
                (Ok(None), Some(id)) => Ok(Some(id)),
                (Ok(Some(was)), Some(id)) if was == id => Ok(Some(id)),
                _ => Err(()),
            };
        }
        if let (Some(idx), Some(hash)) = (p.unit, hash) {
            // Before its unit, so that the agent never caches the file from its last unit in.
            if !same {
                lines.send(HelperMsg::Changed { idx }).ok();
            }
            lines
                .send(HelperMsg::Unit {
                    idx,
                    offset: p.offset,
                    hash,
                })
                .ok();
        } else if job.cache.is_some() {
            let mut h = piece_hashes[p.file]
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            h.push((p.offset, hash));
        }
        // The agent finishes a partial file: it writes the rest and gives it its mode.
        if pieces_left[p.file].fetch_sub(1, Ordering::AcqRel) == 1 && !job.partial {
            if p.shared && job.mode & 0o200 == 0 {
                fs::set_permissions(&job.dst, fs::Permissions::from_mode(job.mode))
                    .map_err(HelperError::io("setting the mode of", &job.dst))?;
            }
            files_done.fetch_add(1, Ordering::Relaxed);
            // (A replica's identified file reports its units instead.)
            if let (Some(c), None) = (job.cache, p.unit) {
                let mut h = std::mem::take(
                    &mut *piece_hashes[p.file]
                        .lock()
                        .unwrap_or_else(|p| p.into_inner()),
                );
                h.sort_by_key(|(offset, _)| *offset);
                let hashes: Option<Vec<blake3::Hash>> = h.into_iter().map(|(_, h)| h).collect();
                if let Some(hashes) = hashes {
                    let hash = piece_hashes_hash(&hashes);
                    lines
                        .send(HelperMsg::Copied {
                            idx: c.idx,
                            piece: c.piece,
                            hash,
                        })
                        .ok();
                }
            }
            // Whole, with its mode, from one unchanged version of the source: the agent may
            // note it for a restart ([`super::copy_tree_resumable`]).
            if let Some(path) = &job.whole {
                let slot = sources[p.file].lock().unwrap_or_else(|p| p.into_inner());
                if let (bytes, Ok(Some(id))) = *slot
                    && bytes == id.size
                {
                    lines
                        .send(HelperMsg::Whole {
                            file: id,
                            path: path.clone(),
                        })
                        .ok();
                }
            }
        }
        Ok::<u64, HelperError>(n)
    };
    std::thread::scope(|s| {
        // Every copy thread holds a sender; the channel closes when the last one ends, which wakes
        // the reporting loop at once rather than at its next tick.
        let (lines, finished) = mpsc::channel::<HelperMsg>();
        for _ in 0..copy_threads().min(pieces.len()) {
            let lines = lines.clone();
            let run_piece = &run_piece;
            let next = &next;
            let (bytes_done, failed, first_error) = (&bytes_done, &failed, &first_error);
            s.spawn(move || {
                let mut buf = Vec::new();
                while !failed.load(Ordering::Relaxed) {
                    let Some(p) = pieces.get(next.fetch_add(1, Ordering::Relaxed)) else {
                        break;
                    };
                    match run_piece(p, &mut buf, &lines) {
                        Ok(n) => {
                            bytes_done.fetch_add(n, Ordering::Relaxed);
                        }
                        Err(e) => {
                            failed.store(true, Ordering::Relaxed);
                            let mut slot = first_error.lock().unwrap_or_else(|p| p.into_inner());
                            slot.get_or_insert(e);
                            break;
                        }
                    }
                }
            });
        }
        drop(lines);
        // Pass on the units done and report progress while the copy threads work.
        let mut last = std::time::Instant::now();
        loop {
            let wait = TICK
                .saturating_sub(last.elapsed())
                .max(Duration::from_millis(1));
            match finished.recv_timeout(wait) {
                Ok(line) => {
                    send(out, &line);
                    while let Ok(line) = finished.try_recv() {
                        send(out, &line);
                    }
                    out.flush().ok();
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
            if last.elapsed() >= TICK {
                report_progress(out, &files_done, &bytes_done);
                last = std::time::Instant::now();
            }
        }
    });
    if let Some(e) = first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    report_progress(out, &files_done, &bytes_done);
    Ok(())
}

/// How often the helper reports progress.
const TICK: Duration = Duration::from_millis(200);

/// One `progress F B` line for the agent (a reader that went away is not the copy's problem).
fn report_progress(out: &mut impl Write, files_done: &AtomicU64, bytes_done: &AtomicU64) {
    let progress = HelperMsg::Progress {
        files: files_done.load(Ordering::Relaxed),
        bytes: bytes_done.load(Ordering::Relaxed),
    };
    send(out, &progress);
    out.flush().ok();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file whose descriptor no longer has the identity the helper reported (rewritten,
    /// replaced or grown after it was identified) is copied as it is now, but gives no hash: the
    /// agent is told nothing it could keep.
    #[test]
    fn a_file_changed_after_it_was_identified_is_copied_but_not_hashed() {
        let src = tempfile::tempdir().unwrap();
        let dst = tempfile::tempdir().unwrap();
        fs::write(src.path().join("f"), b"the bytes now").unwrap();
        let f = fs::File::open(src.path().join("f")).unwrap();
        let now = FileIdent::of(&f).unwrap().unwrap();
        let piece = Piece {
            file: 0,
            offset: 0,
            len: None,
            shared: false,
            unit: None,
        };
        let job = |file: FileIdent, to: &str| FileJob {
            cache: Some(Identified {
                idx: 0,
                file,
                piece: PIECE,
            }),
            ..FileJob::new(src.path().join("f"), dst.path().join(to), file.size, 0o644)
        };
        let mut buf = Vec::new();
        let same = copy_piece(&job(now, "same"), &piece, 0o022, &mut buf).unwrap();
        assert_eq!(
            (same.bytes, same.hash, same.same),
            (13, Some(blake3::hash(b"the bytes now")), true)
        );
        for (what, then) in [
            (
                "mtime",
                FileIdent {
                    mtime_ns: now.mtime_ns ^ 1,
                    ..now
                },
            ),
            (
                "inode",
                FileIdent {
                    ino: now.ino + 1,
                    ..now
                },
            ),
            ("size", FileIdent { size: 9, ..now }),
        ] {
            let PieceCopied { bytes: n, hash, .. } =
                copy_piece(&job(then, what), &piece, 0o022, &mut buf).unwrap();
            assert_eq!((n, hash), (13, None), "{what} changed");
            assert_eq!(fs::read(dst.path().join(what)).unwrap(), b"the bytes now");
        }
    }

    #[test]
    fn big_files_are_split_into_pieces_only_where_a_side_is_not_a_local_file_system() {
        use nix::sys::statfs::{EXT4_SUPER_MAGIC, NFS_SUPER_MAGIC, PROC_SUPER_MAGIC};
        assert!(is_local_fs(EXT4_SUPER_MAGIC));
        assert!(!is_local_fs(NFS_SUPER_MAGIC));
        assert!(!is_local_fs(nix::sys::statfs::FsType(
            crate::lustre::LL_SUPER_MAGIC as _
        )));
        let dir = tempfile::tempdir().unwrap();
        // A destination that does not exist yet is judged by its nearest existing ancestor.
        let dst = dir.path().join("job/ds");
        let here = nix::sys::statfs::statfs(dir.path())
            .unwrap()
            .filesystem_type();
        let want = if is_local_fs(here) { u64::MAX } else { PIECE };
        assert_eq!(piece_for(dir.path(), &dst), want);
        // /proc stands in for a file system that is not local: pieces.
        assert!(!is_local_fs(PROC_SUPER_MAGIC));
        assert_eq!(piece_for(Path::new("/proc/self"), &dst), PIECE);
        assert_eq!(piece_for(dir.path(), Path::new("/proc/self/x")), PIECE);
    }

    #[test]
    fn copy_threads_take_files_from_each_directory_in_turn() {
        let job = |p: &str| FileJob::new(PathBuf::from(p), PathBuf::from("/d").join(p), 1, 0o644);
        let files = ["a/1", "a/2", "a/3", "b/1", "b/2", "top"].map(job).into();
        let order: Vec<PathBuf> = interleave_directories(files)
            .into_iter()
            .map(|f| f.src)
            .collect();
        assert_eq!(
            order,
            ["a/1", "b/1", "top", "a/2", "b/2", "a/3"].map(PathBuf::from)
        );
    }

    #[test]
    fn a_file_that_shrank_since_it_was_listed_leaves_no_preallocated_tail() {
        let dir = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..3u32 << 20).map(|i| (i % 251) as u8).collect();
        fs::write(dir.path().join("src"), &data).unwrap();
        // Listed at 4 MiB (preallocated where the tier is ext4), 3 MiB when copied: whole, and in
        // 1 MiB pieces whose last one copies to the end.
        for (name, piece) in [("whole", u64::MAX), ("pieces", 1 << 20)] {
            let job = FileJob::new(
                dir.path().join("src"),
                dir.path().join(name),
                4 << 20,
                0o644,
            );
            copy_files(std::slice::from_ref(&job), 0o022, piece, &mut Vec::new()).unwrap();
            assert_eq!(fs::read(&job.dst).unwrap(), data, "{name}");
        }
    }
}
