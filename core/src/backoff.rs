//! The pause before work whose last attempt failed is attempted again — a checkpoint archive whose
//! store requests failed even after object_store's own retries (the site's `[retry]` policy,
//! [`crate::config::Config::retry`]). This is not a second retry loop around a request: a
//! worker makes attempts on its own turns, and [`Schedule`] says which keys a turn may attempt.
//!
//! Times are [`tokio::time::Instant`]s, so tests run the schedule with paused time.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::hash::Hash;
use std::time::Duration;
use tokio::time::Instant;

/// Exponential backoff: no pause after no failure, then `base × 2^failures`, at most `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    base: Duration,
    max: Duration,
}

impl Backoff {
    /// Checkpoint archives: 2 s after the first failure, 4 s after the second, ..., at most
    /// `max` (`[ckpt] retry_pause_max`, 2 min unless the site says otherwise).
    pub const fn archive(max: Duration) -> Backoff {
        Backoff::new(Duration::from_secs(1), max)
    }

    pub const fn new(base: Duration, max: Duration) -> Backoff {
        Backoff { base, max }
    }

    /// The pause after `failures` consecutive failed attempts.
    pub fn delay(&self, failures: u64) -> Duration {
        if failures == 0 {
            return Duration::ZERO;
        }
        let factor = 1u32 << failures.min(31);
        self.base.saturating_mul(factor).min(self.max)
    }
}

/// When each key (a checkpoint tag, ...) may be attempted next. The failure count stays with the
/// caller's own record of the work (it decides other things too); the schedule only turns it into
/// a time.
#[derive(Debug)]
pub struct Schedule<K> {
    backoff: Backoff,
    next_try: HashMap<K, Instant>,
}

impl<K: Eq + Hash> Schedule<K> {
    pub fn new(backoff: Backoff) -> Schedule<K> {
        Schedule {
            backoff,
            next_try: HashMap::new(),
        }
    }

    /// Whether `key` may be attempted at `now`: it has not failed, or its pause is over.
    pub fn ready<Q>(&self, key: &Q, now: Instant) -> bool
    where
        K: Borrow<Q>,
        Q: Eq + Hash + ?Sized,
    {
        self.next_try.get(key).is_none_or(|t| now >= *t)
    }

    /// After a turn that attempted `key` (or had nothing to attempt): with `failures` consecutive
    /// failed attempts so far it waits [`Backoff::delay`] from `now`; with none it is ready again.
    pub fn update(&mut self, key: K, failures: u64, now: Instant) {
        if failures == 0 {
            self.next_try.remove(&key);
        } else {
            self.next_try
                .insert(key, now + self.backoff.delay(failures));
        }
    }

    /// When `key` may be attempted next; `None` when it may be at once.
    pub fn next_try<Q>(&self, key: &Q) -> Option<Instant>
    where
        K: Borrow<Q>,
        Q: Eq + Hash + ?Sized,
    {
        self.next_try.get(key).copied()
    }

    /// Drops what is known about `key` (its work is gone).
    pub fn forget<Q>(&mut self, key: &Q)
    where
        K: Borrow<Q>,
        Q: Eq + Hash + ?Sized,
    {
        self.next_try.remove(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn archive_pauses_double_from_two_seconds_up_to_two_minutes() {
        let pauses: Vec<u64> = [0, 1, 2, 3, 4, 5, 6, 7, 8, 40, u64::MAX]
            .iter()
            .map(|&f| {
                Backoff::archive(Duration::from_secs(120))
                    .delay(f)
                    .as_secs()
            })
            .collect();
        assert_eq!(pauses, [0, 2, 4, 8, 16, 32, 64, 120, 120, 120, 120]);
        // A site's shorter `retry_pause_max` caps it sooner.
        let short = Backoff::archive(Duration::from_secs(8));
        let pauses: Vec<u64> = [1, 2, 3, 4, 40]
            .iter()
            .map(|&f| short.delay(f).as_secs())
            .collect();
        assert_eq!(pauses, [2, 4, 8, 8, 8]);
        // No overflow with a large base either.
        let huge = Backoff::new(Duration::from_secs(u64::MAX / 2), Duration::MAX);
        assert_eq!(huge.delay(u64::MAX), Duration::MAX);
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_key_waits_out_its_pause_and_others_do_not() {
        let mut s: Schedule<String> = Schedule::new(Backoff::archive(Duration::from_secs(120)));
        let t0 = Instant::now();
        assert!(s.ready("step-1", t0), "a key never attempted is ready");
        s.update("step-1".into(), 1, t0);
        s.update("step-2".into(), 0, t0);
        assert!(!s.ready("step-1", t0));
        assert!(s.ready("step-2", t0));
        assert_eq!(s.next_try("step-1"), Some(t0 + Duration::from_secs(2)));

        tokio::time::advance(Duration::from_millis(1999)).await;
        assert!(!s.ready("step-1", Instant::now()));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(s.ready("step-1", Instant::now()));

        // A second failure: twice as long from then; a success: ready at once.
        s.update("step-1".into(), 2, Instant::now());
        assert!(!s.ready("step-1", Instant::now() + Duration::from_millis(3999)));
        assert!(s.ready("step-1", Instant::now() + Duration::from_secs(4)));
        s.update("step-1".into(), 0, Instant::now());
        assert!(s.ready("step-1", Instant::now()));
        assert_eq!(s.next_try("step-1"), None);

        s.update("step-3".into(), 5, Instant::now());
        s.forget("step-3");
        assert!(s.ready("step-3", Instant::now()));
    }

    /// A worker that takes a turn every 2 s (ckpt.scan_interval) and whose every attempt fails:
    /// the attempts are spaced 2 s, 4 s, 8 s, ... apart, then every 2 minutes.
    #[tokio::test(start_paused = true)]
    async fn a_worker_turning_every_two_seconds_attempts_a_failing_key_ever_less_often() {
        let mut s: Schedule<&str> = Schedule::new(Backoff::archive(Duration::from_secs(120)));
        let start = Instant::now();
        let (mut failures, mut attempts) = (0u64, Vec::new());
        while start.elapsed() < Duration::from_secs(400) {
            if s.ready("tag", Instant::now()) {
                attempts.push(start.elapsed().as_secs());
                failures += 1; // the store is down
                s.update("tag", failures, Instant::now());
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        assert_eq!(attempts, [0, 2, 6, 14, 30, 62, 126, 246, 366]);
    }
}
