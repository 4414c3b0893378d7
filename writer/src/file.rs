//! [`AlignedWriter`]: one checkpoint file written through 4 KiB-aligned buffers, with `O_DIRECT`
//! where the file system takes it, double-buffered: a writer thread writes block N while the caller
//! fills block N+1.
//!
//! - **Alignment.** `O_DIRECT` needs the buffer's address, the file offset and the length to be
//!   multiples of the logical block size; [`sluice_core::iobuf::AlignedBuf`] gives the first,
//!   and every block but the last is a whole multiple of [`ALIGN`] long, so each lands at an aligned
//!   offset. The last block's whole 4 KiB pages are written with `O_DIRECT` too; its unaligned tail
//!   (`len % 4096` bytes) is written after `O_DIRECT` was switched off on the descriptor
//!   (`fcntl(F_SETFL)`), through the page cache, and `close` fsyncs both. No padding, no truncate:
//!   the file never holds a byte the caller did not write.
//! - **Where `O_DIRECT` is refused.** tmpfs (a RAM tier, `/dev/shm`) refuses `open(O_DIRECT)` with
//!   `EINVAL`; some file systems accept the open and refuse the first write with `EINVAL`. Either way
//!   the file is written through the page cache instead ([`AlignedWriter::is_direct`] says which),
//!   which on tmpfs *is* the memory the file lives in.
//! - **Double buffering.** Two buffers of `block_size` bytes: the caller fills one while the thread
//!   writes the other; a full buffer is handed over, and the caller waits only when the thread is
//!   still writing the previous one. An error of the thread is kept and returned by the next
//!   [`write`](AlignedWriter::write) or by [`close`](AlignedWriter::close).

use sluice_core::iobuf::{ALIGN, AlignedBuf, round_up};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;

/// The block size when the caller names none: large enough that one `pwrite` per block keeps an
/// NVMe busy, small enough that two of them per open file cost little memory.
pub const DEFAULT_BLOCK: usize = 8 << 20;

/// A failed write of a checkpoint file: what was done, to which file, and the OS error.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("open {path} for writing: {source}")]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("write {path} at offset {offset}: {source}")]
    Write {
        path: PathBuf,
        offset: u64,
        #[source]
        source: io::Error,
    },
    #[error("fsync {path}: {source}")]
    Sync {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path}: the writer thread stopped unexpectedly")]
    ThreadLost { path: PathBuf },
    #[error("{path}: {what}")]
    Usage { path: PathBuf, what: String },
}

impl WriteError {
    /// The `errno` of the OS error behind this one, for the C ABI's return codes (`EIO` where
    /// there is none).
    pub fn errno(&self) -> i32 {
        match self {
            WriteError::Open { source, .. }
            | WriteError::Write { source, .. }
            | WriteError::Sync { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
            WriteError::ThreadLost { .. } => libc::EIO,
            WriteError::Usage { .. } => libc::EINVAL,
        }
    }
}

/// The file and how it is written, shared by the caller's side and the writer thread.
struct Target {
    path: PathBuf,
    file: File,
}

impl Target {
    /// Whether the descriptor has `O_DIRECT` set now.
    fn direct(&self) -> bool {
        nix::fcntl::fcntl(&self.file, nix::fcntl::FcntlArg::F_GETFL)
            .map(|f| nix::fcntl::OFlag::from_bits_truncate(f).contains(nix::fcntl::OFlag::O_DIRECT))
            .unwrap_or(false)
    }

    /// Switches `O_DIRECT` off, for the unaligned tail and for a file system that refused a direct
    /// write.
    fn buffered(&self) -> io::Result<()> {
        use nix::fcntl::{FcntlArg, OFlag, fcntl};
        let flags = OFlag::from_bits_truncate(fcntl(&self.file, FcntlArg::F_GETFL)?);
        fcntl(&self.file, FcntlArg::F_SETFL(flags - OFlag::O_DIRECT))?;
        Ok(())
    }

    /// Writes `buf` at `offset`: its whole pages directly when the descriptor has `O_DIRECT`
    /// (falling back to the page cache for good if the file system refuses that with `EINVAL`),
    /// the rest through the page cache. Only the last block of a file has a tail.
    fn write_block(&self, buf: &AlignedBuf, offset: u64) -> Result<(), WriteError> {
        let err = |at: u64, source| WriteError::Write {
            path: self.path.clone(),
            offset: at,
            source,
        };
        let mut tail_from = 0;
        if self.direct() && !buf.blocks().is_empty() {
            match self.file.write_all_at(buf.blocks(), offset) {
                Ok(()) => tail_from = buf.aligned_len(),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    // The open was accepted but a direct write is not: the page cache it is.
                    self.buffered().map_err(|e| err(offset, e))?;
                }
                Err(e) => return Err(err(offset, e)),
            }
        }
        if tail_from < buf.len() {
            if self.direct() {
                self.buffered().map_err(|e| err(offset, e))?;
            }
            let at = offset + tail_from as u64;
            self.file
                .write_all_at(&buf[tail_from..], at)
                .map_err(|e| err(at, e))?;
        }
        Ok(())
    }
}

/// One file being written. Not `Sync`: one caller writes it, in order; the bytes land in the file
/// in the order they were given.
pub struct AlignedWriter {
    target: Arc<Target>,
    block: usize,
    /// The buffer being filled and the bytes in it.
    fill: AlignedBuf,
    filled: usize,
    /// The second buffer while the thread does not hold it.
    spare: Option<AlignedBuf>,
    /// The file offset of `fill`'s first byte: the bytes handed to the thread so far.
    offset: u64,
    to_thread: Option<SyncSender<(AlignedBuf, u64)>>,
    from_thread: Receiver<Result<AlignedBuf, WriteError>>,
    thread: Option<JoinHandle<()>>,
    /// The thread's first error, returned to every later call.
    failed: Option<WriteError>,
    direct_at_open: bool,
}

impl AlignedWriter {
    /// Creates (or truncates) `path`, mode 0644 before the umask, for writing in blocks of
    /// `block_size` bytes (rounded up to 4 KiB; 0: [`DEFAULT_BLOCK`]).
    pub fn create(path: &Path, block_size: usize) -> Result<AlignedWriter, WriteError> {
        AlignedWriter::create_with(path, block_size, |o| o.open(path))
    }

    /// `create`, opening through `open` (the tests stand in a file system that refuses
    /// `O_DIRECT`: tmpfs did until Linux 6.6).
    fn create_with(
        path: &Path,
        block_size: usize,
        open_with: impl Fn(&OpenOptions) -> io::Result<File>,
    ) -> Result<AlignedWriter, WriteError> {
        let block = round_up(if block_size == 0 {
            DEFAULT_BLOCK
        } else {
            block_size
        });
        let open = |direct: bool| {
            let mut o = OpenOptions::new();
            o.write(true).create(true).truncate(true).mode(0o644);
            if direct {
                o.custom_flags(libc::O_DIRECT);
            }
            open_with(&o)
        };
        let file = match open(true) {
            // tmpfs and a few others: no O_DIRECT at all.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => open(false),
            other => other,
        }
        .map_err(|source| WriteError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        let target = Arc::new(Target {
            path: path.to_path_buf(),
            file,
        });
        let direct_at_open = target.direct();
        // Capacity 1: one full block queued while the other is being filled is all double
        // buffering needs; the caller blocks on `from_thread` for the buffer to come back.
        let (to_thread, blocks) = sync_channel::<(AlignedBuf, u64)>(1);
        let (done, from_thread) = sync_channel::<Result<AlignedBuf, WriteError>>(2);
        let t = Arc::clone(&target);
        let thread = std::thread::Builder::new()
            .name("sluice-writer".into())
            .spawn(move || {
                for (buf, offset) in blocks {
                    let r = t.write_block(&buf, offset).map(|()| buf);
                    let stop = r.is_err();
                    if done.send(r).is_err() || stop {
                        return;
                    }
                }
            })
            .map_err(|source| WriteError::Open {
                path: path.to_path_buf(),
                source,
            })?;
        Ok(AlignedWriter {
            target,
            block,
            fill: AlignedBuf::new(block),
            filled: 0,
            spare: Some(AlignedBuf::new(block)),
            offset: 0,
            to_thread: Some(to_thread),
            from_thread,
            thread: Some(thread),
            failed: None,
            direct_at_open,
        })
    }

    pub fn path(&self) -> &Path {
        &self.target.path
    }

    /// Whether the file was opened with `O_DIRECT` (false on tmpfs, where it is written through
    /// the page cache from the start).
    pub fn is_direct(&self) -> bool {
        self.direct_at_open
    }

    /// The bytes given to [`write`](Self::write) so far: the file's length after `close`.
    pub fn position(&self) -> u64 {
        self.offset + self.filled as u64
    }

    /// Appends `bytes` to the file (copied: the caller may reuse its buffer at once).
    pub fn write(&mut self, mut bytes: &[u8]) -> Result<(), WriteError> {
        self.check()?;
        while !bytes.is_empty() {
            let n = (self.block - self.filled).min(bytes.len());
            self.fill[self.filled..self.filled + n].copy_from_slice(&bytes[..n]);
            self.filled += n;
            bytes = &bytes[n..];
            if self.filled == self.block {
                self.hand_over()?;
            }
        }
        Ok(())
    }

    /// Writes whatever is buffered, waits for the thread to finish every block, so that the file
    /// holds all bytes given so far (for a caller that writes at the next offset by other means,
    /// such as cuFile). A partial last block is written as the file's tail would be, so call it
    /// at 4 KiB-aligned positions to keep the following blocks aligned.
    pub fn flush(&mut self) -> Result<(), WriteError> {
        self.check()?;
        if self.filled > 0 {
            self.hand_over()?;
        }
        // Both buffers back: nothing is in flight.
        if self.spare.is_none() {
            let buf = self.receive()?;
            self.spare = Some(buf);
        }
        Ok(())
    }

    /// The descriptor's file, for writes at [`position`](Self::position) after a
    /// [`flush`](Self::flush) (cuFile registers it); such writes are counted with
    /// [`skip`](Self::skip).
    pub fn file(&self) -> &File {
        &self.target.file
    }

    /// Counts `len` bytes written at the current position by other means (after a `flush`).
    pub fn skip(&mut self, len: u64) -> Result<(), WriteError> {
        if self.filled != 0 {
            return Err(WriteError::Usage {
                path: self.target.path.clone(),
                what: "bytes written around the writer without a flush first".into(),
            });
        }
        self.offset += len;
        Ok(())
    }

    /// Writes the rest, the unaligned tail included, waits for the thread and fsyncs the file.
    /// The file is complete and durable when this returns `Ok`.
    pub fn close(mut self) -> Result<u64, WriteError> {
        self.flush()?;
        self.stop_thread();
        self.check()?;
        self.target
            .file
            .sync_all()
            .map_err(|source| WriteError::Sync {
                path: self.target.path.clone(),
                source,
            })?;
        Ok(self.offset)
    }

    /// Sends the filled buffer (its first `filled` bytes) to the thread and takes the other one,
    /// waiting for the thread to give it back when it still writes it.
    fn hand_over(&mut self) -> Result<(), WriteError> {
        let mut full = std::mem::replace(&mut self.fill, AlignedBuf::empty());
        full.truncate(self.filled);
        let offset = self.offset;
        self.offset += self.filled as u64;
        self.filled = 0;
        // Queued first, so the thread starts on it the moment it finishes the block before.
        let sent = self
            .to_thread
            .as_ref()
            .is_some_and(|tx| tx.send((full, offset)).is_ok());
        // The thread's side closed: it failed and says why on `from_thread`.
        if !sent {
            return Err(self.thread_error());
        }
        self.fill = match self.spare.take() {
            Some(b) => b,
            None => self.receive()?,
        };
        Ok(())
    }

    fn receive(&mut self) -> Result<AlignedBuf, WriteError> {
        match self.from_thread.recv() {
            Ok(Ok(mut buf)) => {
                // Back to its whole capacity, to be filled again.
                buf.reuse(self.block);
                Ok(buf)
            }
            Ok(Err(e)) => {
                self.failed = Some(e);
                Err(self.thread_error())
            }
            Err(_) => Err(self.thread_error()),
        }
    }

    fn thread_error(&mut self) -> WriteError {
        if let Ok(Err(e)) = self.from_thread.try_recv() {
            self.failed = Some(e);
        }
        self.check().err().unwrap_or(WriteError::ThreadLost {
            path: self.target.path.clone(),
        })
    }

    /// The thread's error, as a fresh value (the first one is kept for later calls).
    fn check(&self) -> Result<(), WriteError> {
        match &self.failed {
            None => Ok(()),
            Some(e) => Err(match e {
                WriteError::Write {
                    path,
                    offset,
                    source,
                } => WriteError::Write {
                    path: path.clone(),
                    offset: *offset,
                    source: match source.raw_os_error() {
                        Some(code) => io::Error::from_raw_os_error(code),
                        None => io::Error::new(source.kind(), source.to_string()),
                    },
                },
                other => WriteError::Usage {
                    path: self.target.path.clone(),
                    what: other.to_string(),
                },
            }),
        }
    }

    fn stop_thread(&mut self) {
        self.to_thread = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // An error the thread sent after the last block we waited for.
        while let Ok(r) = self.from_thread.try_recv() {
            if let Err(e) = r {
                self.failed.get_or_insert(e);
            }
        }
    }
}

impl Drop for AlignedWriter {
    /// A writer dropped without `close` (an error, a panic in the caller) stops its thread; what
    /// it held is written or not, and nothing is fsynced: the file is incomplete, which the caller
    /// that did not close it knows.
    fn drop(&mut self) {
        self.stop_thread();
    }
}

/// The alignment of every block written directly.
pub const BLOCK_ALIGN: usize = ALIGN;

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_core::testing::{DIRECT_IO_REFUSED, direct_io_dir};

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3] ^ seed)
            .collect()
    }

    /// Writes `data` in pieces of `piece` bytes with blocks of `block` bytes and reads it back.
    fn roundtrip(dir: &Path, name: &str, data: &[u8], piece: usize, block: usize) -> bool {
        let path = dir.join(name);
        let mut w = AlignedWriter::create(&path, block).unwrap();
        let direct = w.is_direct();
        for chunk in data.chunks(piece.max(1)) {
            w.write(chunk).unwrap();
        }
        assert_eq!(w.position(), data.len() as u64);
        assert_eq!(w.close().unwrap(), data.len() as u64);
        let back = std::fs::read(&path).unwrap();
        assert_eq!(back.len(), data.len(), "{name}: length");
        assert!(back == data, "{name}: the bytes read back differ");
        direct
    }

    const SIZES: [usize; 10] = [
        0,
        1,
        4095,
        4096,
        4097,
        65536,
        65536 + 100,
        (1 << 20) - 1,
        3 << 20,
        (3 << 20) + 4095,
    ];

    #[test]
    fn aligned_and_unaligned_sizes_read_back_byte_identical() {
        let dir = direct_io_dir();
        for (i, &size) in SIZES.iter().enumerate() {
            let data = pattern(size, i as u8);
            // Blocks of 64 KiB so that most sizes span several blocks (both buffers in turn), in
            // pieces that straddle block boundaries, in one piece, and byte-sized pieces for small ones.
            for piece in [size.max(1), 1000, 65536 + 7] {
                roundtrip(dir.path(), &format!("f{size}-{piece}"), &data, piece, 65536);
            }
            if size <= 65536 {
                roundtrip(dir.path(), &format!("f{size}-1"), &data, 1, 4096);
            }
        }
    }

    #[test]
    fn a_disk_file_system_is_written_with_o_direct() {
        let dir = direct_io_dir();
        let direct = roundtrip(dir.path(), "d", &pattern(200_000, 3), 50_000, 65536);
        // The target directory is on the build machine's disk. A file system that refuses
        // O_DIRECT there leaves this test nothing to check (the fallback is tested below).
        assert!(direct, "{DIRECT_IO_REFUSED} ({})", dir.path().display());
    }

    /// A file system that refuses `open(O_DIRECT)` with EINVAL (tmpfs before Linux 6.6, some
    /// network and FUSE file systems): the writer opens the file again without it, writes through
    /// the page cache, and the file is still exact.
    #[test]
    fn where_o_direct_is_refused_the_writer_falls_back_to_buffered_writes() {
        let dir = direct_io_dir();
        let tried_direct = std::cell::Cell::new(0);
        for size in [0, 4096, 100_001, (1 << 20) + 3] {
            let path = dir.path().join(format!("t{size}"));
            let data = pattern(size, 9);
            let mut w = AlignedWriter::create_with(&path, 65536, |o| {
                // The first attempt of each file is the O_DIRECT one: refuse it as tmpfs did.
                tried_direct.set(tried_direct.get() + 1);
                if tried_direct.get() % 2 == 1 {
                    return Err(io::Error::from_raw_os_error(libc::EINVAL));
                }
                o.open(&path)
            })
            .unwrap();
            assert!(!w.is_direct(), "reported as written with O_DIRECT");
            for chunk in data.chunks(7777) {
                w.write(chunk).unwrap();
            }
            assert_eq!(w.close().unwrap(), size as u64);
            assert!(std::fs::read(&path).unwrap() == data, "{size} bytes differ");
        }
        assert_eq!(
            tried_direct.get(),
            8,
            "one refused O_DIRECT open, one buffered, per file"
        );
    }

    /// The RAM tier's file system, for real: /dev/shm. Before Linux 6.6 tmpfs refuses O_DIRECT
    /// (the fallback above); since then it accepts it. Either way the bytes must be exact.
    #[test]
    fn a_tmpfs_file_reads_back_byte_identical() {
        let shm = Path::new("/dev/shm");
        assert!(
            shm.is_dir(),
            "no /dev/shm here, where the RAM tier's tmpfs case is tried: mount a tmpfs there"
        );
        let dir = tempfile::tempdir_in(shm).unwrap();
        for size in [0, 4096, 100_001, (1 << 20) + 3] {
            let direct = roundtrip(
                dir.path(),
                &format!("t{size}"),
                &pattern(size, 9),
                7777,
                65536,
            );
            eprintln!(
                "tmpfs, {size} bytes: O_DIRECT {}",
                if direct { "accepted" } else { "refused" }
            );
        }
    }

    #[test]
    fn bytes_written_around_the_writer_after_a_flush_keep_their_place() {
        let dir = direct_io_dir();
        let path = dir.path().join("around");
        let mut w = AlignedWriter::create(&path, 8192).unwrap();
        w.write(&[1; 4096]).unwrap();
        w.flush().unwrap();
        // Written directly, as cuFile would: from aligned memory, at an aligned offset.
        let mut page = AlignedBuf::new(4096);
        page.fill(2);
        w.file().write_all_at(&page, w.position()).unwrap();
        w.skip(4096).unwrap();
        w.write(&[3; 10]).unwrap();
        assert_eq!(w.close().unwrap(), 8202);
        let back = std::fs::read(&path).unwrap();
        assert_eq!(&back[..4096], &[1; 4096]);
        assert_eq!(&back[4096..8192], &[2; 4096]);
        assert_eq!(&back[8192..], &[3; 10]);
    }

    #[test]
    fn an_open_that_fails_names_the_file_and_the_os_error() {
        let e = AlignedWriter::create(Path::new("/nonexistent-dir/x"), 0)
            .err()
            .unwrap();
        assert_eq!(e.errno(), libc::ENOENT);
        assert!(e.to_string().contains("/nonexistent-dir/x"), "{e}");
    }

    /// A write that fails (the disk is full) reaches the caller, at the latest at close.
    #[test]
    fn a_failed_write_reaches_the_caller() {
        let full = Path::new("/dev/full");
        assert!(
            full.exists(),
            "no /dev/full here, the device that answers every write with ENOSPC: create it \
             (mknod -m 666 /dev/full c 1 7)"
        );
        let mut w = AlignedWriter::create(full, 4096).unwrap();
        let mut saw = w.write(&[0; 3 * 4096]).err();
        if saw.is_none() {
            saw = w.close().err();
        }
        let e = saw.expect("writing /dev/full succeeded");
        assert_eq!(e.errno(), libc::ENOSPC, "{e}");
    }
}
