//! Flushing a checkpoint from the RAM tier to the NVMe hot tier (`--ckpt-tier=ram`).
//!
//! The source is the job user's tree on a tmpfs, read as [`crate::walk`] reads a checkpoint for the
//! archive (fd-relative, no links followed, only regular files and directories of the job user);
//! the copy is written as root, owned by the job user, in a directory the agent created. Each file
//! is copied block by block through two 4 KiB-aligned buffers ([`crate::iobuf`]): one thread reads
//! block N+1 from RAM while another writes block N to the disk with `O_DIRECT` (no page-cache copy
//! of a checkpoint that is in RAM already; the tail shorter than a block, or every block where the
//! file system refuses `O_DIRECT`, through the page cache). The source bytes are hashed (BLAKE3) as
//! they are read; every copy is fsynced, then read back and its hash compared, so a flush that
//! returns `Ok` left a durable, verified copy. A source file that changes while it is copied fails
//! the flush ([`FlushError::Modified`]): a committed checkpoint must not change.

use crate::download::Output;
use crate::iobuf::AlignedBuf;
use crate::safefs::{self, Owner};
use crate::walk::{self, WalkError};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::sync::mpsc::sync_channel;

#[derive(Debug, thiserror::Error)]
pub enum FlushError {
    /// The checkpoint holds something sluice does not copy (a symlink, a FIFO, another user's file).
    #[error(transparent)]
    Refused(WalkError),
    #[error("'{path}' changed while it was flushed; a committed checkpoint must not change")]
    Modified { path: String },
    #[error("'{path}': the copy on the hot tier does not read back as written")]
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
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Flushed {
    pub files: u64,
    pub bytes: u64,
    /// Every file's whole blocks went through `O_DIRECT`.
    pub direct: bool,
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

/// Copies the tree below `src` (the job user `uid`'s) into `dst`, an empty directory, owned by
/// `owner`, through buffers of `block` bytes; fsyncs and verifies every file, then `dst` itself.
/// Blocking.
pub fn flush_tree(
    src: &OwnedFd,
    uid: u32,
    dst: &OwnedFd,
    owner: Owner,
    block: usize,
) -> Result<Flushed, FlushError> {
    let tree = walk::walk(src, uid).map_err(|e| match e {
        WalkError::Io { path, errno } => FlushError::Io {
            path,
            source: io::Error::from(errno),
        },
        refused => FlushError::Refused(refused),
    })?;
    for d in &tree.dirs {
        let parts: Vec<&str> = d.split('/').collect();
        safefs::ensure_dirs(dst, &parts, Some(owner)).map_err(safefs_err(d))?;
    }
    let mut done = Flushed {
        direct: true,
        ..Flushed::default()
    };
    let mut bufs = [AlignedBuf::new(block), AlignedBuf::new(block)];
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
        // Opened for writing only: read back through the open file itself, not a path.
        let back = File::open(format!("/proc/self/fd/{}", out.file().as_raw_fd()))
            .map_err(io_err(&f.rel))?;
        if read_hash(&back, &mut bufs[0], block).map_err(io_err(&f.rel))? != hash {
            return Err(FlushError::Mismatch {
                path: f.rel.clone(),
            });
        }
        done.files += 1;
        done.bytes += size;
        done.direct &= out.direct() || size < crate::iobuf::ALIGN as u64;
    }
    for d in &tree.dirs {
        let parts: Vec<&str> = d.split('/').collect();
        let fd = safefs::ensure_dirs(dst, &parts, Some(owner)).map_err(safefs_err(d))?;
        nix::unistd::fsync(&fd).map_err(|e| io_err(d)(io::Error::from(e)))?;
    }
    nix::unistd::fsync(dst).map_err(|e| io_err(".")(io::Error::from(e)))?;
    Ok(done)
}

/// Copies `from` to `out` block by block: this thread reads and hashes, another writes, the two
/// buffers passing between them. Returns the source's hash and the bytes copied.
fn copy_file(
    from: &File,
    out: &Output,
    bufs: &mut [AlignedBuf; 2],
    block: usize,
) -> io::Result<(blake3::Hash, u64)> {
    let (to_write, written_rx) = sync_channel::<(AlignedBuf, u64)>(1);
    let (give_back, free) = sync_channel::<AlignedBuf>(2);
    for b in bufs.iter_mut() {
        give_back
            .send(std::mem::take(b))
            .expect("the channel holds two");
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

/// The BLAKE3 of `f`, read back from the start (after an fsync, from the disk where the writes
/// bypassed the page cache).
fn read_hash(f: &File, buf: &mut AlignedBuf, block: usize) -> io::Result<blake3::Hash> {
    let mut hasher = blake3::Hasher::new();
    let mut offset = 0u64;
    loop {
        let n = read_full(f, buf.reuse(block), offset)?;
        if n == 0 {
            return Ok(hasher.finalize());
        }
        hasher.update(&buf[..n]);
        offset += n as u64;
    }
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
    fn a_tree_is_copied_byte_identical_with_its_modes_and_verified() {
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
}
