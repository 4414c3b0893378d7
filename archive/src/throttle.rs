//! The optional bandwidth cap on uploads, so archiving never starves the node's network.
//!
//! A virtual-time token bucket: each request reserves its bytes on a timeline that advances at
//! `rate` bytes per second, and waits until its reservation starts. The first request goes at once;
//! a steady stream averages `rate`. Uses tokio's clock, so tests run it with `tokio::time::pause()`.

use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

#[derive(Debug)]
pub struct Throttle {
    rate: u64,
    /// When the bytes reserved so far will have drained.
    next_free: Mutex<Option<Instant>>,
}

impl Throttle {
    pub fn new(bytes_per_second: u64) -> Throttle {
        Throttle {
            rate: bytes_per_second.max(1),
            next_free: Mutex::new(None),
        }
    }

    /// Waits until `bytes` may be sent.
    pub async fn acquire(&self, bytes: u64) {
        let start = {
            let mut next = self.next_free.lock().unwrap_or_else(|e| e.into_inner());
            let now = Instant::now();
            let start = next.map_or(now, |t| t.max(now));
            *next = Some(start + Duration::from_secs_f64(bytes as f64 / self.rate as f64));
            start
        };
        tokio::time::sleep_until(start).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[tokio::test(start_paused = true)]
    async fn averages_the_configured_rate() {
        let t = Arc::new(Throttle::new(1 << 20));
        let t0 = Instant::now();
        for _ in 0..5 {
            t.acquire(1 << 20).await;
        }
        // The first MiB goes at once, each next one a second later.
        assert_eq!(t0.elapsed(), Duration::from_secs(4));

        // Concurrent senders share the rate.
        let t1 = Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..4 {
            let t = t.clone();
            tasks.spawn(async move { t.acquire(512 << 10).await });
        }
        tasks.join_all().await;
        // 1 MiB still drains from before (1 s), then 3 × 0.5 s before the last one starts.
        assert_eq!(t1.elapsed(), Duration::from_millis(2500));

        // After an idle period there is no catch-up burst beyond one request.
        tokio::time::sleep(Duration::from_secs(60)).await;
        let t2 = Instant::now();
        t.acquire(1 << 20).await;
        t.acquire(1 << 20).await;
        assert_eq!(t2.elapsed(), Duration::from_secs(1));
    }
}
