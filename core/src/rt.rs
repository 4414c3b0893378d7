//! Small runtime helpers every part of sluice uses: the wall clock in the seconds that records and
//! manifests carry, mutexes that a panic elsewhere does not poison for everyone, and (feature
//! `runtime`) blocking work off the async workers and where a panic is contained.
//!
//! **Panics.** A panic is a bug. The agent's panic hook (`sluiced`) logs every one and aborts the
//! process — systemd restarts it and the journal resumes — unless the panic happens inside
//! [`contained`] work: one job's set-up, whose panic fails that job with a message in its output
//! instead of leaving it "staging" until the plugin's timeout. Whether the running code is
//! contained is a per-thread flag that [`contained`] sets around each poll of its future and that
//! [`blocking`] carries to the blocking thread it runs a closure on.

use std::cell::Cell;
use std::sync::{Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};
#[cfg(feature = "runtime")]
use std::{
    future::Future,
    panic::AssertUnwindSafe,
    pin::Pin,
    task::{Context, Poll},
};

thread_local! {
    static CONTAINED: Cell<bool> = const { Cell::new(false) };
}

/// Whether a panic on this thread now is caught by [`contained`] (the panic hook's question).
pub fn panic_is_contained() -> bool {
    CONTAINED.with(Cell::get)
}

#[cfg(feature = "runtime")]
/// Sets this thread's flag for its lifetime and puts the previous value back when dropped, also
/// while unwinding.
struct Flag(bool);

#[cfg(feature = "runtime")]
impl Flag {
    fn set(to: bool) -> Flag {
        Flag(CONTAINED.with(|c| c.replace(to)))
    }
}

#[cfg(feature = "runtime")]
impl Drop for Flag {
    fn drop(&mut self) {
        CONTAINED.with(|c| c.set(self.0));
    }
}

#[cfg(feature = "runtime")]
/// Runs blocking file I/O, hashing or compression on tokio's blocking pool, never on a runtime
/// worker. A panic in `f` is a bug and propagates (inside [`contained`] work too).
pub async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let inside = panic_is_contained();
    let done = tokio::task::spawn_blocking(move || {
        let _flag = Flag::set(inside);
        f()
    });
    match done.await {
        Ok(v) => v,
        // The hook saw the panic on the blocking thread; carry it on here, message and all.
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(e) => panic!("blocking task did not finish: {e}"),
    }
}

#[cfg(feature = "runtime")]
/// Runs `f`; a panic in it (or in [`blocking`] work it awaits) is `Err` with the panic's message
/// instead of unwinding further, and the panic hook lets it be.
pub async fn contained<F: Future>(f: F) -> Result<F::Output, String> {
    use futures::FutureExt;
    AssertUnwindSafe(Contained(Box::pin(f)))
        .catch_unwind()
        .await
        .map_err(|payload| {
            payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".into())
        })
}

#[cfg(feature = "runtime")]
/// A future polled with this thread's flag set.
struct Contained<F>(Pin<Box<F>>);

#[cfg(feature = "runtime")]
impl<F: Future> Future for Contained<F> {
    type Output = F::Output;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let _flag = Flag::set(true);
        self.0.as_mut().poll(cx)
    }
}

/// Seconds since the Unix epoch (0 if the clock is before it).
pub fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Locks `m`; a poisoned lock still yields its data (every value behind these locks is valid after
/// any partial update).
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(all(test, feature = "runtime"))]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_panic_in_contained_work_is_an_error_and_the_flag_follows_it() {
        assert!(!panic_is_contained());
        let r = contained(async {
            assert!(panic_is_contained());
            blocking(|| {
                assert!(panic_is_contained(), "blocking work inherits the flag");
                panic!("bug in a set-up");
            })
            .await
        })
        .await;
        let message: String = r.unwrap_err();
        assert_eq!(message, "bug in a set-up");
        assert!(
            !panic_is_contained(),
            "the flag is put back after unwinding"
        );
        // Blocking work outside contained work is not contained.
        assert!(!blocking(panic_is_contained).await);
        assert_eq!(contained(async { 7 }).await, Ok(7));
    }
}
