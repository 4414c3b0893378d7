//! Small runtime helpers every part of the engine uses: blocking work off the async workers, the
//! wall clock in the seconds that records and manifests carry, and mutexes that a panic elsewhere
//! does not poison for everyone.

use std::sync::{Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

/// Runs blocking file I/O, hashing or compression on tokio's blocking pool, never on a runtime
/// worker. A panic in `f` is a bug and propagates.
pub async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f)
        .await
        .expect("blocking task panicked")
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
