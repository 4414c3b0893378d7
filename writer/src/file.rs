//! [`AlignedWriter`]: one checkpoint file written through 4 KiB-aligned buffers, with `O_DIRECT`
//! where the file system takes it, by a few writer threads at once while the caller fills the next
//! block.
//!
//! - **Alignment.** `O_DIRECT` needs the buffer's address, the file offset and the length to be
//!   multiples of the logical block size; [`sluice_core::iobuf::AlignedBuf`] gives the first,
//!   and every block but the last is a whole multiple of [`ALIGN`] long, so each lands at an aligned
//!   offset. The last block's whole 4 KiB pages are written with `O_DIRECT` too; its unaligned tail
//!   (`len % 4096` bytes) is written after `O_DIRECT` was switched off on the descriptor
//!   (`fcntl(F_SETFL)`), through the page cache, and `close` fsyncs both. No padding, no truncate:
//!   the file never holds a byte the caller did not write.
//! - **Where `O_DIRECT` is refused.** tmpfs (a RAM tier, `/dev/shm`) refuses `open(O_DIRECT)` with
//!   `EINVAL` before Linux 6.6; some file systems accept the open and refuse the first write with
//!   `EINVAL`. Either way the file is written through the page cache instead
//!   ([`AlignedWriter::is_direct`] says which), which on tmpfs *is* the memory the file lives in.
//! - **Several writer threads.** Up to [`Options::threads`] threads take full blocks from one
//!   queue and `pwrite` each at its own offset (blocks never overlap, so their order does not
//!   matter). Memory is a pool of at most `threads + 1` buffers of `block_size` bytes per open
//!   file: the caller fills one while the threads write the others, and waits only when all are
//!   in flight. Buffers and threads are taken only when the bytes call for them: a file of one
//!   block uses one buffer and one thread, whatever the setting. A partial block (the file's last,
//!   or one before a [`flush`](AlignedWriter::flush)) is written only after every block before it
//!   is on disk, so switching `O_DIRECT` off for its tail never meets a direct write in flight.
//! - **Never a partial file under the final name.** A regular file is written under a hidden
//!   temporary name beside it (`.NAME.PID.SEQ.tmp`, [`sluice_core::durable::temp_beside`]) and
//!   `close` fsyncs it, renames it to its name and fsyncs the directory. Any error (a write, the
//!   fsync, a writer thread lost) fails `close`, and a writer that did not close successfully
//!   removes its temporary file when dropped: the name then holds what it held before the open
//!   (nothing, or the previous complete file). After a crash only a hidden `.tmp` file can remain;
//!   once a later save finishes `NAME`, the archive leaves it out (`sluice_archive::walk`).
//!   A path that exists and is not a regular file (a device such as `/dev/null`, a symbolic link)
//!   is written in place, as it always was.
//! - **Errors.** The first error of any thread is kept and returned by the next
//!   [`write`](AlignedWriter::write) and by [`close`](AlignedWriter::close); the other threads stop
//!   writing as soon as they see it.

use sluice_core::durable;
use sluice_core::iobuf::{ALIGN, AlignedBuf, round_up};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// The block size when the caller names none: large enough that one `pwrite` per block keeps an
/// NVMe busy, small enough that a few of them per open file cost little memory.
pub const DEFAULT_BLOCK: usize = 8 << 20;

/// The writer threads per file when neither the caller nor `SLUICE_WRITER_THREADS` names a number
/// (measured in bench/README.md's writer section).
pub const DEFAULT_THREADS: usize = 2;

/// The most writer threads one file may have.
pub const MAX_THREADS: usize = 64;

/// The environment variable that sets the writer threads per file where the caller passes 0.
pub const THREADS_ENV: &str = "SLUICE_WRITER_THREADS";

/// How a file is written.
#[derive(Clone, Copy, Debug, Default)]
pub struct Options {
    /// Bytes per block, rounded up to 4 KiB; 0: [`DEFAULT_BLOCK`].
    pub block_size: usize,
    /// Writer threads, at most [`MAX_THREADS`]; 0: `$SLUICE_WRITER_THREADS`, else
    /// [`DEFAULT_THREADS`].
    pub threads: usize,
}

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
    #[error("give {path} its name (rename from {tmp}, fsync the directory): {source}")]
    Publish {
        path: PathBuf,
        tmp: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path}: a writer thread stopped unexpectedly")]
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
            | WriteError::Sync { source, .. }
            | WriteError::Publish { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
            WriteError::ThreadLost { .. } => libc::EIO,
            WriteError::Usage { .. } => libc::EINVAL,
        }
    }

    /// A copy to return again (the first error is kept for every later call).
    fn again(&self) -> WriteError {
        let os = |source: &io::Error| match source.raw_os_error() {
            Some(code) => io::Error::from_raw_os_error(code),
            None => io::Error::new(source.kind(), source.to_string()),
        };
        match self {
            WriteError::Write {
                path,
                offset,
                source,
            } => WriteError::Write {
                path: path.clone(),
                offset: *offset,
                source: os(source),
            },
            WriteError::ThreadLost { path } => WriteError::ThreadLost { path: path.clone() },
            WriteError::Open { path, .. }
            | WriteError::Sync { path, .. }
            | WriteError::Publish { path, .. }
            | WriteError::Usage { path, .. } => WriteError::Usage {
                path: path.clone(),
                what: self.to_string(),
            },
        }
    }
}

/// The writer threads per file: `threads` if not 0, else `$SLUICE_WRITER_THREADS`, else
/// [`DEFAULT_THREADS`]; a value out of `1..=MAX_THREADS` is refused with what to set.
fn threads_for(path: &Path, threads: usize, env: Option<String>) -> Result<usize, WriteError> {
    let usage = |what: String| WriteError::Usage {
        path: path.to_path_buf(),
        what,
    };
    let from_env = |v: &str| {
        v.trim()
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=MAX_THREADS).contains(n))
            .ok_or_else(|| {
                usage(format!(
                    "{THREADS_ENV}={v} is not a number of writer threads: set 1 to {MAX_THREADS}, \
                     or unset it for the default ({DEFAULT_THREADS})"
                ))
            })
    };
    let n = match (threads, env) {
        (0, Some(v)) => from_env(&v)?,
        (0, None) => DEFAULT_THREADS,
        (n, _) => n,
    };
    if n > MAX_THREADS {
        return Err(usage(format!(
            "{n} writer threads: choose 1 to {MAX_THREADS} (0 for the default)"
        )));
    }
    Ok(n)
}

/// The file and how it is written, shared by the caller's side and the writer threads.
struct Target {
    /// The name the file gets at `close`, which errors name.
    path: PathBuf,
    /// Where it is written until then; `None`: written in place (not a regular file).
    tmp: Option<PathBuf>,
    file: File,
    /// Set by the first thread that fails: the others stop writing.
    failed: AtomicBool,
    /// Tests: every write at or past this offset fails with `ENOSPC`, as a full disk would.
    #[cfg(test)]
    fail_from: Option<u64>,
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

    fn pwrite(&self, bytes: &[u8], offset: u64) -> io::Result<()> {
        #[cfg(test)]
        if self
            .fail_from
            .is_some_and(|at| offset + bytes.len() as u64 > at)
        {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        self.file.write_all_at(bytes, offset)
    }

    /// Writes `buf` at `offset`: its whole pages directly when the descriptor has `O_DIRECT`
    /// (falling back to the page cache for good if the file system refuses that with `EINVAL`),
    /// the rest through the page cache. Only a partial block has a tail. With `O_DIRECT`, `buf`
    /// starts at a 4 KiB-aligned address (an [`AlignedBuf`], or caller memory checked to be).
    fn write_block(&self, buf: &[u8], offset: u64) -> Result<(), WriteError> {
        let err = |at: u64, source| WriteError::Write {
            path: self.path.clone(),
            offset: at,
            source,
        };
        let mut tail_from = 0;
        let aligned_len = buf.len() / ALIGN * ALIGN;
        if self.direct() && aligned_len > 0 {
            match self.pwrite(&buf[..aligned_len], offset) {
                Ok(()) => tail_from = aligned_len,
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
            self.pwrite(&buf[tail_from..], at).map_err(|e| err(at, e))?;
        }
        Ok(())
    }
}

/// One writer thread: takes blocks from the shared queue until it closes, writes each at its
/// offset and gives the buffer back (or the error, after which it stops).
fn write_blocks(
    t: &Target,
    blocks: &Mutex<Receiver<(AlignedBuf, u64)>>,
    done: &SyncSender<Result<AlignedBuf, WriteError>>,
) {
    loop {
        // The lock is held only while waiting for the next block, never while writing one.
        let next = match blocks.lock() {
            Ok(queue) => queue.recv(),
            Err(_) => return,
        };
        let Ok((buf, offset)) = next else { return };
        // After another thread's error the file is lost anyway: give the buffer back unwritten.
        let r = if t.failed.load(Ordering::Acquire) {
            Ok(buf)
        } else {
            t.write_block(&buf, offset).map(|()| buf)
        };
        if r.is_err() {
            t.failed.store(true, Ordering::Release);
        }
        let stop = r.is_err();
        if done.send(r).is_err() || stop {
            return;
        }
    }
}

/// One file being written. Not `Sync`: one caller writes it, in order; the bytes land in the file
/// at the offsets they were given at.
pub struct AlignedWriter {
    target: Arc<Target>,
    block: usize,
    threads: usize,
    /// The buffer being filled (none before the first byte and after a hand-over) and the bytes
    /// in it.
    fill: Option<AlignedBuf>,
    filled: usize,
    /// Buffers back from the threads, to be filled again.
    spare: Vec<AlignedBuf>,
    /// Buffers allocated (at most `threads + 1`) and those with the threads now.
    allocated: usize,
    in_flight: usize,
    /// The file offset of `fill`'s first byte: the bytes handed to the threads so far.
    offset: u64,
    to_threads: Option<SyncSender<(AlignedBuf, u64)>>,
    queue: Arc<Mutex<Receiver<(AlignedBuf, u64)>>>,
    done: SyncSender<Result<AlignedBuf, WriteError>>,
    from_threads: Receiver<Result<AlignedBuf, WriteError>>,
    running: Vec<JoinHandle<()>>,
    /// The first error, returned to every later call.
    failed: Option<WriteError>,
    /// Set once `close` gave the file its name: the temporary file is then not removed.
    published: bool,
    direct_at_open: bool,
}

impl AlignedWriter {
    /// Creates `path` (replacing it at `close`), mode 0644 before the umask, for writing in blocks
    /// of `block_size` bytes (rounded up to 4 KiB; 0: [`DEFAULT_BLOCK`]) by the default number of
    /// writer threads.
    pub fn create(path: &Path, block_size: usize) -> Result<AlignedWriter, WriteError> {
        AlignedWriter::open(
            path,
            Options {
                block_size,
                threads: 0,
            },
        )
    }

    /// Creates `path` (replacing it at `close`), mode 0644 before the umask, written as `options`
    /// say.
    pub fn open(path: &Path, options: Options) -> Result<AlignedWriter, WriteError> {
        AlignedWriter::create_with(path, options, |o, p| o.open(p))
    }

    /// `open`, opening through `open_with` (the tests stand in a file system that refuses
    /// `O_DIRECT`: tmpfs did until Linux 6.6).
    fn create_with(
        path: &Path,
        options: Options,
        open_with: impl Fn(&OpenOptions, &Path) -> io::Result<File>,
    ) -> Result<AlignedWriter, WriteError> {
        let block = round_up(if options.block_size == 0 {
            DEFAULT_BLOCK
        } else {
            options.block_size
        });
        let threads = threads_for(path, options.threads, std::env::var(THREADS_ENV).ok())?;
        let open_error = |source| WriteError::Open {
            path: path.to_path_buf(),
            source,
        };
        // A regular file (or none yet) is written under a temporary name; anything else in place.
        let in_place = path
            .symlink_metadata()
            .is_ok_and(|m| !m.file_type().is_file());
        let tmp = if in_place {
            None
        } else {
            Some(durable::temp_beside(path).map_err(open_error)?)
        };
        let open = |direct: bool| {
            let mut o = OpenOptions::new();
            o.write(true).mode(0o644);
            if in_place {
                o.create(true).truncate(true);
            } else {
                o.create_new(true);
            }
            if direct {
                o.custom_flags(libc::O_DIRECT);
            }
            open_with(&o, tmp.as_deref().unwrap_or(path))
        };
        let file = match open(true) {
            // tmpfs and a few others: no O_DIRECT at all.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => open(false),
            other => other,
        }
        .map_err(open_error)?;
        let target = Arc::new(Target {
            path: path.to_path_buf(),
            tmp,
            file,
            failed: AtomicBool::new(false),
            #[cfg(test)]
            fail_from: None,
        });
        let direct_at_open = target.direct();
        // Neither channel ever blocks a sender: there are at most `threads + 1` buffers.
        let (to_threads, queue) = sync_channel(threads + 1);
        let (done, from_threads) = sync_channel(threads + 1);
        Ok(AlignedWriter {
            target,
            block,
            threads,
            fill: None,
            filled: 0,
            spare: Vec::new(),
            allocated: 0,
            in_flight: 0,
            offset: 0,
            to_threads: Some(to_threads),
            queue: Arc::new(Mutex::new(queue)),
            done,
            from_threads,
            running: Vec::new(),
            failed: None,
            published: false,
            direct_at_open,
        })
    }

    /// The file's name (where it is once closed).
    pub fn path(&self) -> &Path {
        &self.target.path
    }

    /// Whether the file was opened with `O_DIRECT` (false on tmpfs before Linux 6.6, where it is
    /// written through the page cache from the start).
    pub fn is_direct(&self) -> bool {
        self.direct_at_open
    }

    /// The writer threads this file may use (it starts them only as its blocks need them).
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// The bytes given to [`write`](Self::write) so far: the file's length after `close`.
    pub fn position(&self) -> u64 {
        self.offset + self.filled as u64
    }

    /// Appends `bytes` to the file. When this returns, the caller may reuse its buffer: the bytes
    /// were copied into the writer's buffers, or, for a span of at least two whole blocks starting
    /// at a block boundary of the file (and, with `O_DIRECT`, at a 4 KiB-aligned address), written
    /// straight from the caller's memory by the writer threads, which saves the copy.
    pub fn write(&mut self, mut bytes: &[u8]) -> Result<(), WriteError> {
        self.check()?;
        let whole = bytes.len() / self.block * self.block;
        if self.filled == 0
            && whole >= 2 * self.block
            && self.offset.is_multiple_of(self.block as u64)
            && ((bytes.as_ptr() as usize).is_multiple_of(ALIGN) || !self.target.direct())
        {
            self.write_straight(&bytes[..whole])?;
            bytes = &bytes[whole..];
        }
        while !bytes.is_empty() {
            let fill = match &mut self.fill {
                Some(b) => b,
                None => {
                    let b = self.free_buffer()?;
                    self.fill.insert(b)
                }
            };
            let n = (self.block - self.filled).min(bytes.len());
            fill[self.filled..self.filled + n].copy_from_slice(&bytes[..n]);
            self.filled += n;
            bytes = &bytes[n..];
            if self.filled == self.block {
                self.hand_over()?;
            }
        }
        Ok(())
    }

    /// Writes whatever is buffered and waits for the threads to finish every block, so that the
    /// file holds all bytes given so far (for a caller that writes at the next offset by other
    /// means, such as cuFile). A partial last block is written as the file's tail would be, so
    /// call it at 4 KiB-aligned positions to keep the following blocks aligned.
    pub fn flush(&mut self) -> Result<(), WriteError> {
        self.check()?;
        self.wait_all()?;
        if self.filled > 0 {
            // After every block before it, on this thread: the tail switches O_DIRECT off.
            let mut last = self.fill.take().expect("bytes are buffered");
            last.truncate(self.filled);
            let r = self.target.write_block(&last, self.offset);
            last.reuse(self.block);
            self.spare.push(last);
            if let Err(e) = r {
                return Err(self.fail(e));
            }
            self.offset += self.filled as u64;
            self.filled = 0;
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

    /// Writes the rest, the unaligned tail included, waits for the threads, fsyncs the file and
    /// gives it its name (fsyncing the directory). The file is complete and durable under its
    /// name when this returns `Ok`; on an error nothing new is left under the name.
    pub fn close(mut self) -> Result<u64, WriteError> {
        self.flush()?;
        self.stop_threads();
        self.check()?;
        self.target
            .file
            .sync_all()
            .map_err(|source| WriteError::Sync {
                path: self.target.path.clone(),
                source,
            })?;
        if let Some(tmp) = &self.target.tmp {
            durable::publish(tmp, &self.target.path).map_err(|source| WriteError::Publish {
                path: self.target.path.clone(),
                tmp: tmp.clone(),
                source,
            })?;
        }
        self.published = true;
        Ok(self.offset)
    }

    /// Tests: every write at or past byte `at` fails with `ENOSPC` (before any thread started).
    #[cfg(test)]
    fn failing_from(mut self, at: u64) -> AlignedWriter {
        Arc::get_mut(&mut self.target)
            .expect("no thread started yet")
            .fail_from = Some(at);
        self
    }

    /// Writes `span` (whole blocks, at the current offset) from the caller's memory: up to
    /// `threads` scoped threads take its blocks in turn, after the blocks with the pool's threads
    /// are written (never more than `threads` writing at once); returns when all are written.
    fn write_straight(&mut self, span: &[u8]) -> Result<(), WriteError> {
        self.wait_all()?;
        let blocks: Vec<&[u8]> = span.chunks(self.block).collect();
        let next = AtomicUsize::new(0);
        let (target, block, start) = (&*self.target, self.block as u64, self.offset);
        let one = || -> Result<(), WriteError> {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= blocks.len() || target.failed.load(Ordering::Acquire) {
                    return Ok(());
                }
                if let Err(e) = target.write_block(blocks[i], start + i as u64 * block) {
                    target.failed.store(true, Ordering::Release);
                    return Err(e);
                }
            }
        };
        let threads = self.threads.min(blocks.len());
        let r = std::thread::scope(|s| {
            // The calling thread is one of them.
            // One that cannot be started leaves its share to the others.
            let helpers: Vec<_> = (1..threads)
                .filter_map(|_| std::thread::Builder::new().spawn_scoped(s, one).ok())
                .collect();
            let mut r = one();
            for h in helpers {
                let lost = || WriteError::ThreadLost {
                    path: target.path.clone(),
                };
                let h = h.join().unwrap_or_else(|_| Err(lost()));
                if r.is_ok() {
                    r = h;
                }
            }
            r
        });
        match r {
            Ok(()) => {
                self.offset += span.len() as u64;
                Ok(())
            }
            Err(e) => Err(self.fail(e)),
        }
    }

    /// A buffer to fill: one back from the threads, a new one while fewer than `threads + 1`
    /// exist, else the next one a thread gives back.
    fn free_buffer(&mut self) -> Result<AlignedBuf, WriteError> {
        while let Ok(r) = self.from_threads.try_recv() {
            let b = self.returned(r)?;
            self.spare.push(b);
        }
        if let Some(b) = self.spare.pop() {
            return Ok(b);
        }
        if self.allocated < self.threads + 1 {
            self.allocated += 1;
            return Ok(AlignedBuf::new(self.block));
        }
        self.receive()
    }

    /// Queues the full buffer for the threads, starting one more while every running thread has
    /// a block.
    fn hand_over(&mut self) -> Result<(), WriteError> {
        let full = self.fill.take().expect("a full buffer");
        let offset = self.offset;
        self.offset += self.filled as u64;
        self.filled = 0;
        let sent = self
            .to_threads
            .as_ref()
            .is_some_and(|tx| tx.send((full, offset)).is_ok());
        if !sent {
            return Err(self.fail(WriteError::ThreadLost {
                path: self.target.path.clone(),
            }));
        }
        self.in_flight += 1;
        if self.running.len() < self.threads && self.in_flight > self.running.len() {
            self.start_thread()?;
        }
        Ok(())
    }

    fn start_thread(&mut self) -> Result<(), WriteError> {
        let t = Arc::clone(&self.target);
        let queue = Arc::clone(&self.queue);
        let done = self.done.clone();
        let n = self.running.len();
        match std::thread::Builder::new()
            .name(format!("sluice-writer-{n}"))
            .spawn(move || write_blocks(&t, &queue, &done))
        {
            Ok(h) => {
                self.running.push(h);
                Ok(())
            }
            // One running thread writes everything, more slowly; none would lose the file.
            Err(_) if n > 0 => Ok(()),
            Err(source) => Err(self.fail(WriteError::Write {
                path: self.target.path.clone(),
                offset: self.offset,
                source,
            })),
        }
    }

    /// Waits until no block is with the threads.
    fn wait_all(&mut self) -> Result<(), WriteError> {
        while self.in_flight > 0 {
            let b = self.receive()?;
            self.spare.push(b);
        }
        Ok(())
    }

    /// The next buffer a thread gives back, waiting for it.
    fn receive(&mut self) -> Result<AlignedBuf, WriteError> {
        // `self.done` keeps the channel open, so this waits as long as a block is in flight.
        match self.from_threads.recv() {
            Ok(r) => self.returned(r),
            Err(_) => Err(self.fail(WriteError::ThreadLost {
                path: self.target.path.clone(),
            })),
        }
    }

    fn returned(&mut self, r: Result<AlignedBuf, WriteError>) -> Result<AlignedBuf, WriteError> {
        self.in_flight -= 1;
        match r {
            Ok(mut buf) => {
                // Back to its whole capacity, to be filled again.
                buf.reuse(self.block);
                Ok(buf)
            }
            Err(e) => Err(self.fail(e)),
        }
    }

    /// Keeps the first error and returns it (or the one kept before).
    fn fail(&mut self, e: WriteError) -> WriteError {
        self.target.failed.store(true, Ordering::Release);
        self.failed.get_or_insert(e).again()
    }

    fn check(&self) -> Result<(), WriteError> {
        match &self.failed {
            None => Ok(()),
            Some(e) => Err(e.again()),
        }
    }

    fn stop_threads(&mut self) {
        self.to_threads = None;
        for t in self.running.drain(..) {
            if t.join().is_err() {
                self.failed.get_or_insert(WriteError::ThreadLost {
                    path: self.target.path.clone(),
                });
            }
        }
        // An error a thread sent after the last block waited for.
        while let Ok(r) = self.from_threads.try_recv() {
            if let Err(e) = r {
                self.failed.get_or_insert(e);
            }
        }
    }
}

impl Drop for AlignedWriter {
    /// A writer dropped without a successful `close` (an error, an abort, a panic in the caller)
    /// stops its threads and removes its temporary file: nothing new appears under the name.
    fn drop(&mut self) {
        self.target.failed.store(true, Ordering::Release);
        self.stop_threads();
        if !self.published
            && let Some(tmp) = &self.target.tmp
        {
            let _ = std::fs::remove_file(tmp);
        }
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

    /// Writes `data` in pieces of `piece` bytes with blocks of `block` bytes by `threads` writer
    /// threads and reads it back; whether it was written with `O_DIRECT`.
    fn roundtrip_by(
        dir: &Path,
        name: &str,
        data: &[u8],
        piece: usize,
        block: usize,
        threads: usize,
    ) -> bool {
        let path = dir.join(name);
        let options = Options {
            block_size: block,
            threads,
        };
        let mut w = AlignedWriter::open(&path, options).unwrap();
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

    fn roundtrip(dir: &Path, name: &str, data: &[u8], piece: usize, block: usize) -> bool {
        roundtrip_by(dir, name, data, piece, block, 0)
    }

    /// The directory's entries, sorted: what a user listing it sees.
    fn listing(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
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
            let options = Options {
                block_size: 65536,
                threads: 0,
            };
            let mut w = AlignedWriter::create_with(&path, options, |o, p| {
                // The first attempt of each file is the O_DIRECT one: refuse it as tmpfs did.
                tried_direct.set(tried_direct.get() + 1);
                if tried_direct.get() % 2 == 1 {
                    return Err(io::Error::from_raw_os_error(libc::EINVAL));
                }
                o.open(p)
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

    /// `bytes` in 4 KiB-aligned memory.
    fn aligned(bytes: &[u8]) -> AlignedBuf {
        let mut b = AlignedBuf::new(bytes.len());
        b.truncate(bytes.len());
        b.copy_from_slice(bytes);
        b
    }

    /// A writer of `path` on a file system that refuses `open(O_DIRECT)`, as tmpfs did before
    /// Linux 6.6: the page-cache path.
    fn refusing_direct(path: &Path, options: Options) -> AlignedWriter {
        let tried = std::cell::Cell::new(0);
        let w = AlignedWriter::create_with(path, options, |o, p| {
            tried.set(tried.get() + 1);
            if tried.get() == 1 {
                return Err(io::Error::from_raw_os_error(libc::EINVAL));
            }
            o.open(p)
        })
        .unwrap();
        assert!(!w.is_direct());
        w
    }

    /// Sizes around the 4 KiB page and the block (64 KiB here): none, one byte, a page less one,
    /// a page, a page and one, several blocks and an odd tail, several blocks exactly.
    const EDGE_SIZES: [usize; 8] = [
        0,
        1,
        4095,
        4096,
        4097,
        7 * 65536 + 4096 * 3 + 123,
        3 * 65536,
        (3 << 20) + 4095,
    ];

    #[test]
    fn one_two_and_four_writer_threads_write_the_same_bytes_direct_and_through_the_page_cache() {
        let dir = direct_io_dir();
        for (i, &size) in EDGE_SIZES.iter().enumerate() {
            // 4 KiB-aligned, as pinned tensors are: large pieces go straight from it.
            let data = aligned(&pattern(size, i as u8));
            for threads in [1, 2, 4] {
                for piece in [size.max(1), 65536 + 7, 1000] {
                    let name = format!("d{size}-{threads}-{piece}");
                    let direct = roundtrip_by(dir.path(), &name, &data, piece, 65536, threads);
                    assert!(direct, "{DIRECT_IO_REFUSED} ({})", dir.path().display());
                    let path = dir.path().join(format!("b{size}-{threads}-{piece}"));
                    let options = Options {
                        block_size: 65536,
                        threads,
                    };
                    let mut w = refusing_direct(&path, options);
                    for chunk in data.chunks(piece) {
                        w.write(chunk).unwrap();
                    }
                    assert_eq!(w.close().unwrap(), size as u64);
                    assert!(
                        std::fs::read(&path).unwrap()[..] == data[..],
                        "{path:?} differs"
                    );
                }
            }
        }
        // Only the files, no temporary file left behind.
        assert!(
            listing(dir.path()).iter().all(|n| !n.starts_with('.')),
            "{:?}",
            listing(dir.path())
        );
    }

    #[test]
    fn threads_and_buffers_are_taken_only_as_the_bytes_need_them() {
        let dir = direct_io_dir();
        let options = |threads| Options {
            block_size: 65536,
            threads,
        };
        // One block: one buffer and one thread, whatever the setting.
        let mut w = AlignedWriter::open(&dir.path().join("one"), options(8)).unwrap();
        w.write(&pattern(65536, 1)).unwrap();
        w.flush().unwrap();
        assert_eq!((w.running.len(), w.allocated), (1, 1));
        w.close().unwrap();
        // Many blocks: never more than `threads` threads and `threads + 1` buffers.
        let mut w = AlignedWriter::open(&dir.path().join("many"), options(3)).unwrap();
        for _ in 0..64 {
            w.write(&pattern(65536, 2)).unwrap();
            assert!(w.running.len() <= 3 && w.allocated <= 4);
        }
        w.close().unwrap();
        // Whole blocks from aligned memory: written straight from it, no buffer taken.
        let src = aligned(&pattern(8 * 65536, 3));
        let mut w = AlignedWriter::open(&dir.path().join("straight"), options(4)).unwrap();
        w.write(&src).unwrap();
        w.write(&src[..100]).unwrap();
        assert_eq!((w.running.len(), w.allocated), (0, 1));
        w.close().unwrap();
        let back = std::fs::read(dir.path().join("straight")).unwrap();
        assert!(back[..8 * 65536] == src[..] && back[8 * 65536..] == src[..100]);
        // An empty file: nothing at all.
        let w = AlignedWriter::open(&dir.path().join("none"), options(4)).unwrap();
        assert_eq!((w.running.len(), w.allocated), (0, 0));
        assert_eq!(w.close().unwrap(), 0);
        assert_eq!(std::fs::metadata(dir.path().join("none")).unwrap().len(), 0);
    }

    #[test]
    fn the_number_of_threads_comes_from_the_caller_then_the_environment_then_the_default() {
        let p = Path::new("/x");
        assert_eq!(threads_for(p, 3, Some("5".into())).unwrap(), 3);
        assert_eq!(threads_for(p, 0, Some(" 5 ".into())).unwrap(), 5);
        assert_eq!(threads_for(p, 0, None).unwrap(), DEFAULT_THREADS);
        for bad in ["0", "65", "four", ""] {
            let e = threads_for(p, 0, Some(bad.into())).unwrap_err();
            assert_eq!(e.errno(), libc::EINVAL);
            assert!(e.to_string().contains(THREADS_ENV), "{e}");
        }
        let e = threads_for(p, MAX_THREADS + 1, None).unwrap_err();
        assert!(e.to_string().contains("choose 1 to 64"), "{e}");
    }

    #[test]
    fn until_close_the_file_has_no_name_and_an_older_file_keeps_its_bytes() {
        let dir = direct_io_dir();
        let path = dir.path().join("model.pt");
        std::fs::write(&path, b"the previous checkpoint").unwrap();
        let mut w = AlignedWriter::create(&path, 65536).unwrap();
        w.write(&pattern(200_000, 4)).unwrap();
        w.flush().unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"the previous checkpoint");
        let names = listing(dir.path());
        assert_eq!(names.len(), 2, "{names:?}");
        assert!(names[0].starts_with(".model.pt.") && names[0].ends_with(".tmp"));
        w.close().unwrap();
        assert_eq!(listing(dir.path()), ["model.pt"]);
        assert!(std::fs::read(&path).unwrap() == pattern(200_000, 4));
    }

    /// A write that fails partway (the disk fills up) at a block in the middle, at the tail, or
    /// in the page-cache path: close fails with the OS error, and the name holds what it held
    /// before: nothing, or the previous complete file. No temporary file stays behind either.
    #[test]
    fn a_failure_mid_file_fails_close_and_leaves_no_file_called_complete() {
        let dir = direct_io_dir();
        let size = 10 * 65536 + 100;
        let data = aligned(&pattern(size, 5));
        // Small pieces go through the writer's buffers, one large aligned one straight.
        for (threads, piece) in [(1, 30_000), (2, 30_000), (4, 30_000), (1, size), (4, size)] {
            for fail_at in [5 * 65536 + 10, size as u64 - 50] {
                for buffered in [false, true] {
                    for previous in [None, Some(&b"old"[..])] {
                        let path = dir.path().join("f");
                        let _ = std::fs::remove_file(&path);
                        if let Some(old) = previous {
                            std::fs::write(&path, old).unwrap();
                        }
                        let options = Options {
                            block_size: 65536,
                            threads,
                        };
                        let w = if buffered {
                            refusing_direct(&path, options)
                        } else {
                            AlignedWriter::open(&path, options).unwrap()
                        };
                        let mut w = w.failing_from(fail_at);
                        let case = format!(
                            "{threads} threads, fail at {fail_at}, buffered {buffered}, previous {previous:?}"
                        );
                        let r = data.chunks(piece).try_for_each(|c| w.write(c));
                        let e = match r {
                            Err(e) => {
                                drop(w);
                                e
                            }
                            Ok(()) => w.close().expect_err(&case),
                        };
                        assert_eq!(e.errno(), libc::ENOSPC, "{case}: {e}");
                        assert!(e.to_string().contains(&*path.to_string_lossy()), "{e}");
                        match previous {
                            None => assert_eq!(listing(dir.path()), Vec::<String>::new(), "{case}"),
                            Some(old) => {
                                assert_eq!(listing(dir.path()), ["f"], "{case}");
                                assert_eq!(std::fs::read(&path).unwrap(), old, "{case}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_writer_dropped_without_close_leaves_nothing() {
        let dir = direct_io_dir();
        let options = Options {
            block_size: 65536,
            threads: 4,
        };
        let mut w = AlignedWriter::open(&dir.path().join("x"), options).unwrap();
        w.write(&pattern(1 << 20, 6)).unwrap();
        drop(w);
        assert_eq!(listing(dir.path()), Vec::<String>::new());
    }

    /// A file system that really fills up: a 1 MiB tmpfs, written 4 MiB by four threads.
    #[test]
    #[ignore = "needs root: mounts a tmpfs"]
    fn a_full_file_system_fails_close_and_leaves_no_file() {
        sluice_core::testing::assert_root("it mounts a small tmpfs to fill up");
        let dir = tempfile::tempdir().unwrap();
        let mnt = dir.path();
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=1m", "sluice-writer-test"])
            .arg(mnt)
            .status()
            .unwrap();
        assert!(mounted.success(), "mount a tmpfs on {}", mnt.display());
        let outcome = std::panic::catch_unwind(|| {
            let options = Options {
                block_size: 65536,
                threads: 4,
            };
            let mut w = AlignedWriter::open(&mnt.join("big"), options).unwrap();
            let r = pattern(4 << 20, 7)
                .chunks(100_000)
                .try_for_each(|c| w.write(c));
            let e = match r {
                Err(e) => {
                    drop(w);
                    e
                }
                Ok(()) => w.close().expect_err("4 MiB fit in a 1 MiB tmpfs"),
            };
            assert_eq!(e.errno(), libc::ENOSPC, "{e}");
            assert_eq!(listing(mnt), Vec::<String>::new());
        });
        let unmounted = std::process::Command::new("umount").arg(mnt).status();
        if let Err(panic) = outcome {
            std::panic::resume_unwind(panic);
        }
        assert!(unmounted.unwrap().success(), "umount {}", mnt.display());
    }
}
