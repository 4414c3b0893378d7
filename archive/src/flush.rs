//! Flushing a checkpoint from the RAM tier to the NVMe hot tier (`--ckpt-tier=ram`).
//!
//! The source is the job user's tree on a tmpfs, read as [`crate::walk`] reads a checkpoint for the
//! archive (fd-relative, no links followed, only regular files and directories of the job user);
//! the copy is written as root, owned by the job user, in a directory the agent created. Each file
//! is copied block by block through [`BUFFERS`] 4 KiB-aligned buffers ([`sluice_core::iobuf`]): one
//! thread reads the next blocks from RAM while another writes block N to the disk with `O_DIRECT`
//! (no page-cache copy of a checkpoint that is in RAM already; the tail shorter than a block, or
//! every block where the file system refuses `O_DIRECT`, through the page cache). The source bytes are hashed (BLAKE3) as
//! they are read — one pass over RAM, no second read of anything — and every copy is fsynced, so a
//! flush that returns `Ok` left a durable copy and the hash of every file it read ([`Flushed`]).
//! A source file that changes while it is copied fails the flush ([`FlushError::Modified`]): a
//! committed checkpoint must not change.
//!
//! The copy is verified later, where it is read anyway: the archive's upload reads and hashes
//! every file of the hot tier's copy for its MANIFEST, and refuses a part whose hashes are not the
//! flush's ([`crate::Archiver::upload_part`] with the flush's hashes). Where no archive reads it, the agent reads
//! it back once, in the background ([`verify_tree`]). Reading the copy back inside the flush doubled
//! the flush's disk I/O for a check the upload repeats.

use crate::download::Output;
use crate::walk::{self, WalkError};
use sluice_core::iobuf::AlignedBuf;
use sluice_core::safefs::{self, Owner};
use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::sync::mpsc::sync_channel;

#[derive(Debug, thiserror::Error)]
pub enum FlushError {
    /// The checkpoint holds something sluice does not copy (a symlink, a FIFO, another user's file).
    #[error(transparent)]
    Refused(WalkError),
    #[error("'{path}' changed while it was flushed; a committed checkpoint must not change")]
    Modified { path: String },
    #[error("'{path}': the copy on the hot tier does not read back as it was flushed")]
    Mismatch { path: String },
    #[error("flushing '{path}': {source}")]
    Io {
        path: String,
        #[source]
        source: io::Error,
    },
}

impl FlushError {
    /// The errno of a failed read or write (`ENOSPC`: the hot tier is full).
    pub fn errno(&self) -> Option<i32> {
        match self {
            FlushError::Io { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

/// What a flush copied.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Flushed {
    pub files: u64,
    pub bytes: u64,
    /// Every file's whole blocks went through `O_DIRECT`.
    pub direct: bool,
    /// The BLAKE3 of every file as it was read from RAM, by `/`-separated relative path: what the
    /// copy must hash to when it is read back (by the archive's upload, or [`verify_tree`]).
    pub hashes: FlushHashes,
}

/// Files' BLAKE3 by relative path, as a flush read them.
pub type FlushHashes = BTreeMap<String, blake3::Hash>;

/// The files of a tree read back (by path, with their hashes) that are not what the flush read:
/// a different hash, a file missing on either side. Empty when the copy is the flushed tree.
pub fn differences<'a>(
    flushed: &FlushHashes,
    read: impl IntoIterator<Item = (&'a str, blake3::Hash)>,
) -> Vec<crate::Damaged> {
    let mut seen = std::collections::BTreeSet::new();
    let mut damaged = Vec::new();
    for (path, hash) in read {
        seen.insert(path);
        match flushed.get(path) {
            Some(h) if *h == hash => {}
            Some(h) => damaged.push(crate::Damaged {
                path: path.to_string(),
                detail: format!(
                    "BLAKE3 {} on the hot tier, {} when flushed from RAM",
                    hash.to_hex(),
                    h.to_hex()
                ),
            }),
            None => damaged.push(crate::Damaged {
                path: path.to_string(),
                detail: "on the hot tier, but not flushed from RAM".into(),
            }),
        }
    }
    for path in flushed.keys().filter(|p| !seen.contains(p.as_str())) {
        damaged.push(crate::Damaged {
            path: path.clone(),
            detail: "flushed from RAM, but missing on the hot tier".into(),
        });
    }
    damaged
}

fn io_err(path: &str) -> impl FnOnce(io::Error) -> FlushError + '_ {
    move |source| FlushError::Io {
        path: path.to_string(),
        source,
    }
}

fn safefs_err(path: &str) -> impl FnOnce(safefs::SafeFsError) -> FlushError + '_ {
    move |e| FlushError::Io {
        path: path.to_string(),
        source: e
            .errno()
            .map_or_else(|| io::Error::other(e.to_string()), io::Error::from),
    }
}

/// The aligned buffers of one flush: one being filled from RAM while up to three wait for, or are
/// in, the writer. Two (strict double buffering) left the disk idle whenever the reader was late:
/// on a loaded 2-core node the flush of 1 GiB took ~1.05 s with two, ~0.93 s with three and
/// ~0.83 s with four (8 MiB blocks); more, or larger blocks, gained nothing there.
pub const BUFFERS: usize = 4;

fn walk_err(e: WalkError) -> FlushError {
    match e {
        WalkError::Io { path, errno } => FlushError::Io {
            path,
            source: io::Error::from(errno),
        },
        refused => FlushError::Refused(refused),
    }
}

/// Copies the tree below `src` (the job user `uid`'s) into `dst`, an empty directory, owned by
/// `owner`, through buffers of `block` bytes; hashes every file as it reads it and fsyncs every
/// copy, then `dst` itself. Blocking.
pub fn flush_tree(
    src: &OwnedFd,
    uid: u32,
    dst: &OwnedFd,
    owner: Owner,
    block: usize,
) -> Result<Flushed, FlushError> {
    let tree = walk::walk(src, uid).map_err(walk_err)?;
    for d in &tree.dirs {
        let parts: Vec<&str> = d.split('/').collect();
        safefs::ensure_dirs(dst, &parts, Some(owner)).map_err(safefs_err(d))?;
    }
    let mut done = Flushed {
        direct: true,
        ..Flushed::default()
    };
    let mut bufs: Vec<AlignedBuf> = (0..BUFFERS).map(|_| AlignedBuf::new(block)).collect();
    for f in &tree.files {
        let (from, before) = walk::open_file(src, f, uid).map_err(FlushError::Refused)?;
        let parts = f.parts();
        let (name, dirs) = parts.split_last().expect("a file has a name");
        let dir = safefs::ensure_dirs(dst, dirs, Some(owner)).map_err(safefs_err(&f.rel))?;
        let to = safefs::create_file(&dir, name, Some(owner), 0o600).map_err(safefs_err(&f.rel))?;
        to.set_permissions(std::fs::Permissions::from_mode(f.mode & 0o777))
            .map_err(io_err(&f.rel))?;
        let out = Output::new(to);
        let (hash, size) = copy_file(&from, &out, &mut bufs, block).map_err(io_err(&f.rel))?;
        let after = walk::Snapshot::of(&from, &f.rel).map_err(FlushError::Refused)?;
        if size != f.size
            || after.mtime_ns() != before.mtime_ns()
            || after.ctime_ns() != before.ctime_ns()
        {
            return Err(FlushError::Modified {
                path: f.rel.clone(),
            });
        }
        out.file().sync_all().map_err(io_err(&f.rel))?;
        done.hashes.insert(f.rel.clone(), hash);
        done.files += 1;
        done.bytes += size;
        done.direct &= out.direct() || size < sluice_core::iobuf::ALIGN as u64;
    }
    for d in &tree.dirs {
        let parts: Vec<&str> = d.split('/').collect();
        let fd = safefs::ensure_dirs(dst, &parts, Some(owner)).map_err(safefs_err(d))?;
        nix::unistd::fsync(&fd).map_err(|e| io_err(d)(io::Error::from(e)))?;
    }
    nix::unistd::fsync(dst).map_err(|e| io_err(".")(io::Error::from(e)))?;
    Ok(done)
}

/// Copies `from` to `out` block by block: this thread reads and hashes, another writes, the
/// buffers passing between them (all but the one being read may be queued for the writer).
/// Returns the source's hash and the bytes copied.
fn copy_file(
    from: &File,
    out: &Output,
    bufs: &mut [AlignedBuf],
    block: usize,
) -> io::Result<(blake3::Hash, u64)> {
    let (to_write, written_rx) = sync_channel::<(AlignedBuf, u64)>(bufs.len() - 1);
    let (give_back, free) = sync_channel::<AlignedBuf>(bufs.len());
    for b in bufs.iter_mut() {
        give_back
            .send(std::mem::take(b))
            .expect("the channel holds every buffer");
    }
    let mut hasher = blake3::Hasher::new();
    let mut offset = 0u64;
    let mut spare = Vec::new();
    let result = std::thread::scope(|s| {
        let writer = s.spawn(move || -> io::Result<()> {
            for (buf, at) in written_rx {
                let r = out.write_aligned_at(&buf, at);
                // Handed back even after a failure, so the reader never waits on a lost buffer.
                let _ = give_back.send(buf);
                r?;
            }
            Ok(())
        });
        let read = (|| -> io::Result<()> {
            loop {
                let Ok(mut buf) = free.recv() else {
                    return Ok(()); // the writer stopped: its error is the one to report
                };
                let n = read_full(from, buf.reuse(block), offset)?;
                buf.truncate(n);
                if n == 0 {
                    spare.push(buf);
                    return Ok(());
                }
                hasher.update(&buf);
                if to_write.send((buf, offset)).is_err() {
                    return Ok(());
                }
                offset += n as u64;
            }
        })();
        drop(to_write);
        let written = writer.join().expect("the flush writer panicked");
        read.and(written)
    });
    // The buffers come back for the next file (a slot left empty is allocated again on use).
    for (slot, buf) in bufs
        .iter_mut()
        .zip(spare.into_iter().chain(free.try_iter()))
    {
        *slot = buf;
    }
    result.map(|()| (hasher.finalize(), offset))
}

/// Reads into `buf` at `offset` until it is full or the file ends; returns the bytes read.
fn read_full(f: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read_at(&mut buf[n..], offset + n as u64) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Reads the flushed copy below `dir` back (the job user `uid`'s files) and compares each file's
/// BLAKE3 with what the flush read ([`differences`]); `Err(Mismatch)` names the first file that
/// differs. Blocking; for a checkpoint no archive reads.
pub fn verify_tree(dir: &OwnedFd, uid: u32, flushed: &FlushHashes) -> Result<(), FlushError> {
    let read = hash_tree(dir, uid)?;
    match differences(flushed, read.iter().map(|(p, h)| (p.as_str(), *h)))
        .into_iter()
        .next()
    {
        None => Ok(()),
        Some(d) => Err(FlushError::Mismatch { path: d.path }),
    }
}

/// The BLAKE3 of every file below `dir` (the job user `uid`'s files, opened as
/// [`walk::open_file`] does: never through a link), by relative path. Read through the page cache,
/// which is told to drop the pages again: the tree is there to be archived or restored later, not
/// read now. Blocking.
pub fn hash_tree(dir: &OwnedFd, uid: u32) -> Result<FlushHashes, FlushError> {
    let tree = walk::walk(dir, uid).map_err(walk_err)?;
    let mut buf = AlignedBuf::new(1 << 20);
    let mut read = FlushHashes::new();
    for f in &tree.files {
        let (file, _) = walk::open_file(dir, f, uid).map_err(FlushError::Refused)?;
        let mut hasher = blake3::Hasher::new();
        let mut offset = 0u64;
        loop {
            let n = read_full(&file, buf.reuse(1 << 20), offset).map_err(io_err(&f.rel))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            offset += n as u64;
        }
        let _ = nix::fcntl::posix_fadvise(
            &file,
            0,
            0,
            nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED,
        );
        read.insert(f.rel.clone(), hasher.finalize());
    }
    Ok(read)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn me() -> Owner {
        Owner {
            uid: nix::unistd::getuid().as_raw(),
            gid: nix::unistd::getgid().as_raw(),
        }
    }

    #[test]
    fn a_tree_is_copied_byte_identical_with_its_modes() {
        let src = tempfile::tempdir().unwrap();
        let dst = tempfile::tempdir().unwrap();
        let big: Vec<u8> = (0..(3 << 20) + 12_345u32)
            .map(|i| (i % 251) as u8)
            .collect();
        std::fs::create_dir_all(src.path().join("model/shards")).unwrap();
        std::fs::write(src.path().join("model/shards/0.bin"), &big).unwrap();
        std::fs::write(src.path().join("model/small"), b"tail only").unwrap();
        std::fs::write(src.path().join("empty"), b"").unwrap();
        std::fs::set_permissions(
            src.path().join("model/small"),
            std::fs::Permissions::from_mode(0o640),
        )
        .unwrap();
        let s = safefs::open_root_dir(src.path()).unwrap();
        let d = safefs::open_root_dir(dst.path()).unwrap();
        // 1 MiB blocks: the big file takes four, the last one partial.
        let done = flush_tree(&s, me().uid, &d, me(), 1 << 20).unwrap();
        assert_eq!((done.files, done.bytes), (3, big.len() as u64 + 9));
        assert_eq!(
            std::fs::read(dst.path().join("model/shards/0.bin")).unwrap(),
            big
        );
        assert_eq!(
            std::fs::read(dst.path().join("model/small")).unwrap(),
            b"tail only"
        );
        assert_eq!(std::fs::read(dst.path().join("empty")).unwrap(), b"");
        let mode = std::fs::metadata(dst.path().join("model/small"))
            .unwrap()
            .permissions();
        assert_eq!(mode.mode() & 0o777, 0o640);
    }

    /// A flushed tree in `dst` whose `model/shards/0.bin` is then changed on the "disk" (as a
    /// failing device or a stray writer would), with what the flush read.
    fn flushed_then_damaged() -> (tempfile::TempDir, tempfile::TempDir, Flushed) {
        let src = tempfile::tempdir().unwrap();
        let dst = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(src.path().join("model/shards")).unwrap();
        let big: Vec<u8> = (0..(2 << 20) + 77u32).map(|i| (i % 253) as u8).collect();
        std::fs::write(src.path().join("model/shards/0.bin"), &big).unwrap();
        std::fs::write(src.path().join("meta"), b"step 7").unwrap();
        let s = safefs::open_root_dir(src.path()).unwrap();
        let d = safefs::open_root_dir(dst.path()).unwrap();
        let done = flush_tree(&s, me().uid, &d, me(), 1 << 20).unwrap();
        (src, dst, done)
    }

    fn damage(dst: &std::path::Path) {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(dst.join("model/shards/0.bin"))
            .unwrap();
        f.write_all_at(b"\xff", 1 << 20).unwrap();
    }

    #[test]
    fn the_flush_hashes_what_it_read_and_a_read_back_finds_a_damaged_copy() {
        let (src, dst, done) = flushed_then_damaged();
        let want = |p: &str| blake3::hash(&std::fs::read(src.path().join(p)).unwrap());
        assert_eq!(
            done.hashes,
            [
                ("meta", want("meta")),
                ("model/shards/0.bin", want("model/shards/0.bin"))
            ]
            .into_iter()
            .map(|(p, h)| (p.to_string(), h))
            .collect::<FlushHashes>()
        );
        let d = safefs::open_root_dir(dst.path()).unwrap();
        verify_tree(&d, me().uid, &done.hashes).unwrap();
        damage(dst.path());
        let e = verify_tree(&d, me().uid, &done.hashes).unwrap_err();
        assert!(
            matches!(&e, FlushError::Mismatch { path } if path == "model/shards/0.bin"),
            "{e}"
        );
        // A file missing on either side is a difference too.
        std::fs::remove_file(dst.path().join("meta")).unwrap();
        let read = [
            ("model/shards/0.bin", want("model/shards/0.bin")),
            ("extra", want("meta")),
        ];
        let diff = differences(&done.hashes, read);
        let paths: Vec<&str> = diff.iter().map(|d| d.path.as_str()).collect();
        assert_eq!(paths, ["extra", "meta"], "{diff:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_upload_of_a_copy_that_is_not_as_flushed_writes_no_part() {
        use crate::{ArchiveConfig, ArchiveError, ArchiveProgress, Archiver};
        use object_store::ObjectStoreExt;
        let (_src, dst, done) = flushed_then_damaged();
        let store = std::sync::Arc::new(object_store::memory::InMemory::new());
        let cfg = ArchiveConfig {
            part_size: 256 << 10,
            concurrency: 2,
            zstd_level: 1,
            chunk_size: 64 << 10,
            compress_threads: 1,
            bandwidth_limit: None,
        };
        let a = Archiver::new(store.clone(), "u/run", cfg).unwrap();
        let fd = || std::sync::Arc::new(safefs::open_root_dir(dst.path()).unwrap());
        let progress = ArchiveProgress::default();
        // Intact: the upload's hashes are the flush's, and the part is written.
        let part = a
            .upload_part("s1", "n1", fd(), me().uid, &progress, Some(&done.hashes))
            .await
            .unwrap();
        assert_eq!(part.files.len(), 2);
        damage(dst.path());
        let e = a
            .upload_part("s1", "n1", fd(), me().uid, &progress, Some(&done.hashes))
            .await
            .unwrap_err();
        match &e {
            ArchiveError::NotAsFlushed { damaged, .. } => {
                assert_eq!(damaged.len(), 1, "{e}");
                assert_eq!(damaged[0].path, "model/shards/0.bin", "{e}");
            }
            other => panic!("{other}"),
        }
        let part_key = object_store::path::Path::from("u/run/s1/parts/n1.json");
        assert!(
            store.head(&part_key).await.is_err(),
            "a part was written for a copy that is not what was flushed"
        );
    }

    #[test]
    fn a_symlink_in_the_checkpoint_is_refused_by_name() {
        let src = tempfile::tempdir().unwrap();
        let dst = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink("/etc/shadow", src.path().join("evil")).unwrap();
        let s = safefs::open_root_dir(src.path()).unwrap();
        let d = safefs::open_root_dir(dst.path()).unwrap();
        let e = flush_tree(&s, me().uid, &d, me(), 1 << 20).unwrap_err();
        assert!(matches!(e, FlushError::Refused(_)), "{e}");
        assert!(e.to_string().contains("evil"), "{e}");
    }

    /// A hot-tier checkpoint hashed for its replicas: every file's BLAKE3 by path; a link the job
    /// user left to another file (another user's, say) is refused by name, never read.
    #[test]
    fn a_tree_is_hashed_file_by_file_and_a_symlink_is_refused() {
        let src = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(src.path().join("model")).unwrap();
        std::fs::write(src.path().join("model/0.bin"), vec![7u8; (2 << 20) + 5]).unwrap();
        std::fs::write(src.path().join("meta"), b"m").unwrap();
        let s = safefs::open_root_dir(src.path()).unwrap();
        let hashes = hash_tree(&s, me().uid).unwrap();
        let want: FlushHashes = [
            ("meta".to_string(), blake3::hash(b"m")),
            (
                "model/0.bin".to_string(),
                blake3::hash(&vec![7u8; (2 << 20) + 5]),
            ),
        ]
        .into();
        assert_eq!(hashes, want);
        std::os::unix::fs::symlink("/etc/shadow", src.path().join("model/evil")).unwrap();
        let e = hash_tree(&s, me().uid).unwrap_err();
        assert!(
            matches!(e, FlushError::Refused(_)) && e.to_string().contains("evil"),
            "{e}"
        );
    }
}
