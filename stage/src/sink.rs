//! Where a unit fetched from a peer is written: [`HashingSink`], the one [`UnitSink`] of
//! object-store staging, POSIX staging and a checkpoint's shared restore.
//!
//! The bytes go at the unit's offset of the file and are hashed on the blocking thread that
//! writes them, after the write succeeded: the hash the fetch compares with the owner's is the
//! hash of what is in the file, and neither writing nor hashing runs on the runtime's workers. A
//! stager's sink gathers the bytes in a buffer of the node's stage-in [`Budget`], leased when the
//! first bytes arrive (so a fetch waiting for its owner holds none) and given back by
//! [`HashingSink::close`]; the restore's sink writes each piece as it arrives.

use super::budget::{Budget, Lease};
use super::{Progress, StageError, hot_tier_error};
use sluice_core::rt::blocking;
use sluice_peer::UnitSink;
use std::io;
use std::sync::Arc;
use std::sync::atomic::Ordering;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A file a [`HashingSink`] writes to, from a blocking thread.
pub trait WriteAt: Send + Sync + 'static {
    /// Writes all of `buf` at `offset`.
    fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;
}

impl WriteAt for std::fs::File {
    fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        sluice_core::pagecache::write_all_at(self, buf, offset)
    }
}

/// Whom a [`HashingSink`] tells about its writes: what is counted, and what a failure means.
pub trait SinkTarget: Send + Sync {
    /// Why a write failed, for whoever closes the sink (the client only carries a message).
    type Error: std::fmt::Display + Send;
    /// `n` more bytes are in the file.
    fn written(&self, n: u64);
    /// The error a failed write becomes.
    fn failed(&self, e: io::Error) -> Self::Error;
}

/// Counts nothing and keeps the I/O error as it is (a checkpoint's restore).
impl SinkTarget for () {
    type Error = io::Error;
    fn written(&self, _n: u64) {}
    fn failed(&self, e: io::Error) -> io::Error {
        e
    }
}

/// A stager's unit from a peer: its bytes are counted as staged and as taken from peers in
/// `progress`; a failed write is the hot tier's error for `rel` ([`hot_tier_error`]).
pub(super) struct PeerUnit<'a> {
    pub(super) progress: &'a Progress,
    pub(super) node: &'a str,
    pub(super) dataset: &'a str,
    pub(super) rel: &'a str,
}

impl SinkTarget for PeerUnit<'_> {
    type Error = StageError;

    fn written(&self, n: u64) {
        self.progress.bytes_done.fetch_add(n, Ordering::Relaxed);
        self.progress.peer_bytes.fetch_add(n, Ordering::Relaxed);
    }

    fn failed(&self, e: io::Error) -> StageError {
        let errno = e.raw_os_error();
        hot_tier_error(self.node, self.dataset, self.rel, errno, e.to_string())
    }
}

/// Writes a unit at its offset of `file`, hashing what it wrote; see the module header.
pub struct HashingSink<F: WriteAt, T: SinkTarget> {
    file: Arc<F>,
    target: T,
    /// Where the buffer comes from; `None` writes each piece as it arrives.
    budget: Option<Arc<Budget>>,
    /// Where the next write goes.
    at: u64,
    lease: Option<Lease>,
    buf: Vec<u8>,
    /// Lent to each blocking write; `None` only while one runs (or after `finish`).
    hasher: Option<blake3::Hasher>,
    written: u64,
    hash: Option<blake3::Hash>,
    error: Option<T::Error>,
}

impl<F: WriteAt, T: SinkTarget> HashingSink<F, T> {
    /// A sink that writes at `at` of `file` through one buffer of `budget`.
    pub(crate) fn buffered(file: Arc<F>, at: u64, budget: Arc<Budget>, target: T) -> Self {
        Self::new(file, at, Some(budget), target)
    }

    /// A sink that writes each piece at `at` of `file` as it arrives.
    pub fn direct(file: Arc<F>, at: u64, target: T) -> Self {
        Self::new(file, at, None, target)
    }

    fn new(file: Arc<F>, at: u64, budget: Option<Arc<Budget>>, target: T) -> Self {
        HashingSink {
            file,
            target,
            budget,
            at,
            lease: None,
            buf: Vec::new(),
            hasher: Some(blake3::Hasher::new()),
            written: 0,
            hash: None,
            error: None,
        }
    }

    /// Writes `buf` at the sink's offset on a blocking thread, hashing it there once written;
    /// hands `buf` back either way.
    async fn put<B: AsRef<[u8]> + Send + 'static>(&mut self, buf: B) -> (B, Result<(), BoxError>) {
        let (file, at, mut hasher) = (self.file.clone(), self.at, self.hasher.take());
        let (buf, hasher, r) = blocking(move || {
            let r = file.write_all_at(buf.as_ref(), at);
            if let (Ok(()), Some(h)) = (&r, hasher.as_mut()) {
                h.update(buf.as_ref());
            }
            (buf, hasher, r)
        })
        .await;
        self.hasher = hasher;
        match r {
            Ok(()) => {
                let n = buf.as_ref().len() as u64;
                self.at += n;
                self.written += n;
                self.target.written(n);
                (buf, Ok(()))
            }
            Err(e) => {
                let e = self.target.failed(e);
                let message = e.to_string();
                self.error = Some(e);
                (buf, Err(message.into()))
            }
        }
    }

    /// Writes the buffer out and keeps it, emptied, for the next bytes.
    async fn flush(&mut self) -> Result<(), BoxError> {
        let buf = std::mem::take(&mut self.buf);
        let (mut buf, r) = self.put(buf).await;
        if r.is_ok() {
            buf.clear();
        }
        self.buf = buf;
        r
    }

    /// Gives the buffer back to the budget; says what the sink did: the bytes it wrote (counted
    /// as they went, to be taken back if the fetch failed), the hash of them all once the fetch
    /// finished it, and why a write failed if one did.
    pub(crate) fn close(mut self) -> (u64, Option<blake3::Hash>, Option<T::Error>) {
        if let Some(lease) = self.lease.as_mut() {
            lease.buf = std::mem::take(&mut self.buf);
        }
        (self.written, self.hash, self.error.take())
    }
}

#[async_trait::async_trait]
impl<F: WriteAt, T: SinkTarget> UnitSink for HashingSink<F, T> {
    async fn write(&mut self, bytes: bytes::Bytes) -> Result<(), BoxError> {
        let Some(budget) = &self.budget else {
            return self.put(bytes).await.1;
        };
        if self.lease.is_none() {
            let mut lease = budget.lease().await;
            self.buf = std::mem::take(&mut lease.buf);
            self.lease = Some(lease);
        }
        let cap = self.buf.capacity();
        let mut rest = &bytes[..];
        while !rest.is_empty() {
            let n = rest.len().min(cap - self.buf.len());
            self.buf.extend_from_slice(&rest[..n]);
            rest = &rest[n..];
            if self.buf.len() == cap {
                self.flush().await?;
            }
        }
        Ok(())
    }

    async fn finish(&mut self) -> Result<blake3::Hash, BoxError> {
        if !self.buf.is_empty() {
            self.flush().await?;
        }
        let hash = self
            .hasher
            .take()
            .map_or_else(|| blake3::hash(b""), |h| h.finalize());
        self.hash = Some(hash);
        Ok(hash)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    const ENOSPC: i32 = nix::errno::Errno::ENOSPC as i32;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// A file in memory that takes at most `room` bytes, like a full hot tier.
    struct MemFile {
        bytes: Mutex<Vec<u8>>,
        room: usize,
    }

    impl MemFile {
        fn new(room: usize) -> Arc<MemFile> {
            Arc::new(MemFile {
                bytes: Mutex::new(Vec::new()),
                room,
            })
        }

        fn bytes(&self) -> Vec<u8> {
            self.bytes.lock().unwrap().clone()
        }
    }

    impl WriteAt for MemFile {
        fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
            let end = offset as usize + buf.len();
            if end > self.room {
                return Err(io::Error::from_raw_os_error(ENOSPC));
            }
            let mut bytes = self.bytes.lock().unwrap();
            if bytes.len() < end {
                bytes.resize(end, 0);
            }
            bytes[offset as usize..end].copy_from_slice(buf);
            Ok(())
        }
    }

    /// Counts what the sink reports written, and names its failures.
    #[derive(Default)]
    struct Counter(AtomicU64);

    impl SinkTarget for &Counter {
        type Error = String;
        fn written(&self, n: u64) {
            self.0.fetch_add(n, Ordering::Relaxed);
        }
        fn failed(&self, e: io::Error) -> String {
            format!("hot tier: {e}")
        }
    }

    fn body() -> Vec<u8> {
        (0..1000u32).map(|i| (i * 7 % 251) as u8).collect()
    }

    async fn send(
        sink: &mut dyn UnitSink,
        body: &[u8],
        piece: usize,
    ) -> Result<blake3::Hash, BoxError> {
        for p in body.chunks(piece) {
            sink.write(bytes::Bytes::copy_from_slice(p)).await?;
        }
        sink.finish().await
    }

    #[tokio::test]
    async fn a_buffered_sink_writes_at_its_offset_and_hashes_what_it_wrote() {
        let (file, counter, budget) = (MemFile::new(4096), Counter::default(), Budget::with(1, 64));
        let body = body();
        let mut sink = HashingSink::buffered(file.clone(), 100, budget.clone(), &counter);
        // Pieces that do not line up with the buffer's 64 bytes.
        let hash = send(&mut sink, &body, 37).await.unwrap();
        assert_eq!(hash, blake3::hash(&body));
        assert_eq!(&file.bytes()[100..], &body[..]);
        assert_eq!(sink.close(), (1000, Some(hash), None));
        assert_eq!(counter.0.load(Ordering::Relaxed), 1000);
        assert_eq!(budget.free(), (1, 1), "the slot and its buffer are back");
    }

    #[tokio::test]
    async fn a_buffered_sink_leases_nothing_before_the_first_bytes_and_waits_for_the_budget() {
        let (file, counter, budget) = (MemFile::new(4096), Counter::default(), Budget::with(1, 64));
        let mut sink = HashingSink::buffered(file.clone(), 0, budget.clone(), &counter);
        assert_eq!(
            budget.free().0,
            1,
            "a fetch waiting for its owner holds no slot"
        );
        let held = budget.lease().await;
        {
            let write = sink.write(bytes::Bytes::from_static(b"abc"));
            tokio::pin!(write);
            assert!(
                futures::poll!(write.as_mut()).is_pending(),
                "no bytes are taken beyond the budget"
            );
            drop(held);
            write.await.unwrap();
        }
        assert_eq!(sink.finish().await.unwrap(), blake3::hash(b"abc"));
        drop(sink.close());
        assert_eq!(budget.free(), (1, 1));
    }

    #[tokio::test]
    async fn a_direct_sink_writes_each_piece_as_it_comes() {
        let file = MemFile::new(4096);
        let body = body();
        let mut sink = HashingSink::direct(file.clone(), 0, ());
        let hash = send(&mut sink, &body, 300).await.unwrap();
        assert_eq!(hash, blake3::hash(&body));
        assert_eq!(file.bytes(), body);
        assert_eq!(sink.close().0, 1000);
    }

    #[tokio::test]
    async fn a_failed_write_is_the_fetch_error_and_counts_only_what_was_written() {
        // Room for 128 bytes: the third buffer of 64 does not fit.
        let (file, counter, budget) = (MemFile::new(128), Counter::default(), Budget::with(1, 64));
        let mut sink = HashingSink::buffered(file.clone(), 0, budget.clone(), &counter);
        let e = send(&mut sink, &body(), 50).await.unwrap_err();
        let (written, hash, error) = sink.close();
        let error = error.expect("the sink knows why");
        assert!(error.starts_with("hot tier: "), "{error}");
        assert_eq!(
            e.to_string(),
            error,
            "the client carries the sink's message"
        );
        assert_eq!((written, hash), (128, None));
        assert_eq!(counter.0.load(Ordering::Relaxed), 128);
        assert_eq!(
            budget.free(),
            (1, 1),
            "a failed sink gives its buffer back too"
        );

        let mut sink = HashingSink::direct(MemFile::new(10), 0, ());
        let e = send(&mut sink, b"more than ten bytes", 5)
            .await
            .unwrap_err();
        let (written, _, error) = sink.close();
        assert_eq!(error.unwrap().raw_os_error(), Some(ENOSPC));
        assert_eq!(written, 10, "{e}");
    }

    #[tokio::test]
    async fn a_short_unit_is_finished_from_the_partial_buffer_and_an_empty_one_hashes_empty() {
        let (file, counter, budget) = (MemFile::new(4096), Counter::default(), Budget::with(1, 64));
        let mut sink = HashingSink::buffered(file.clone(), 0, budget, &counter);
        assert_eq!(
            send(&mut sink, b"short", 64).await.unwrap(),
            blake3::hash(b"short")
        );
        assert_eq!(file.bytes(), b"short");
        let mut empty = HashingSink::direct(MemFile::new(0), 0, ());
        assert_eq!(empty.finish().await.unwrap(), blake3::hash(b""));
    }
}
