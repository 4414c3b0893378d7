//! The node's budget for stage-in downloads: request slots and reused buffers.

use sluice_core::rt::lock;
use std::sync::{Arc, Mutex};
use tokio::sync::Semaphore;

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
    pub fn new(cfg: &sluice_core::config::StageConfig) -> Arc<Budget> {
        Budget::with(
            cfg.concurrency,
            (cfg.memory / cfg.concurrency as u64) as usize,
        )
    }

    pub(super) fn with(requests: usize, buffer: usize) -> Arc<Budget> {
        Arc::new(Budget {
            requests: Arc::new(Semaphore::new(requests)),
            buffer: buffer.max(1),
            idle: Mutex::new(Vec::new()),
        })
    }

    /// Free request slots and idle buffers, for tests that check a download gave everything back.
    #[cfg(test)]
    pub(super) fn free(&self) -> (usize, usize) {
        (self.requests.available_permits(), lock(&self.idle).len())
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
    pub(super) buf: Vec<u8>,
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

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_core::config::Config;

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
            "n1", sluice_archive::upload_memory)
        .unwrap();
        let budget = Budget::new(&cfg.stage);
        assert_eq!(budget.buffer, 2 << 20);
        assert_eq!(budget.requests.available_permits(), 4);
    }
}
