//! The shape of the agent's background loops (housekeeping, one checkpoint worker per job, and the
//! tiers to come): a type with `run(cancel, status)`, started by [`Workers::spawn`] on the agent's
//! one task tracker with a child of its one cancellation token, and a [`WorkerStatus`] that
//! `sluice status` shows and metrics count while it runs. A worker returns when its work is done or
//! when the token is cancelled (the agent stopping); work cut short resumes from the journal.

use crate::rt::{lock, now_secs};
use sluice_proto::msg::JobId;
pub use sluice_proto::msg::WorkerStatus;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// A background loop of the agent.
pub trait Worker: Send + 'static {
    /// What `status` calls it, e.g. `ckpt job 42`.
    fn name(&self) -> String;
    /// The job it works for, if any: a user's `sluice status` shows the workers of their own jobs
    /// and the node's, never another user's job's.
    fn job_id(&self) -> Option<JobId> {
        None
    }
    fn run(
        self,
        cancel: CancellationToken,
        status: Arc<StatusCell>,
    ) -> impl Future<Output = ()> + Send;
}

/// A worker's status, written by the worker and read by anyone.
#[derive(Debug)]
pub struct StatusCell {
    name: String,
    job_id: Option<JobId>,
    /// The state, since when, and the error of the last turn.
    now: Mutex<(&'static str, u64, Option<String>)>,
    turns: AtomicU64,
}

impl StatusCell {
    fn new(name: String, job_id: Option<JobId>) -> StatusCell {
        StatusCell {
            name,
            job_id,
            now: Mutex::new(("starting", now_secs(), None)),
            turns: AtomicU64::new(0),
        }
    }

    pub fn set(&self, state: &'static str) {
        let mut now = lock(&self.now);
        if now.0 != state {
            *now = (state, now_secs(), now.2.take());
        }
    }

    /// One more turn of the loop; `error` is what went wrong in it, if anything.
    pub fn turn(&self, error: Option<String>) {
        self.turns.fetch_add(1, Ordering::Relaxed);
        lock(&self.now).2 = error;
    }

    pub fn snapshot(&self) -> WorkerStatus {
        let (state, since, last_error) = lock(&self.now).clone();
        WorkerStatus {
            name: self.name.clone(),
            job_id: self.job_id,
            state: state.to_string(),
            since,
            turns: self.turns.load(Ordering::Relaxed),
            last_error,
        }
    }
}

/// The running workers of the agent.
#[derive(Debug)]
pub struct Workers {
    tracker: TaskTracker,
    cancel: CancellationToken,
    cells: Mutex<Vec<Weak<StatusCell>>>,
}

impl Workers {
    pub fn new(tracker: TaskTracker, cancel: CancellationToken) -> Workers {
        Workers {
            tracker,
            cancel,
            cells: Mutex::new(Vec::new()),
        }
    }

    /// Starts `worker` on the agent's tracker; it sees the agent's cancellation.
    pub fn spawn(&self, worker: impl Worker) {
        let cell = Arc::new(StatusCell::new(worker.name(), worker.job_id()));
        {
            let mut cells = lock(&self.cells);
            cells.retain(|c| c.strong_count() > 0);
            cells.push(Arc::downgrade(&cell));
        }
        let cancel = self.cancel.child_token();
        self.tracker.spawn(worker.run(cancel, cell));
    }

    /// The workers still running: the node's own by name, then the jobs' by job id.
    pub fn statuses(&self) -> Vec<WorkerStatus> {
        let mut v: Vec<_> = lock(&self.cells)
            .iter()
            .filter_map(Weak::upgrade)
            .map(|c| c.snapshot())
            .collect();
        v.sort_by(|a, b| (a.job_id, &a.name).cmp(&(b.job_id, &b.name)));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Ticker(u32);

    impl Worker for Ticker {
        fn name(&self) -> String {
            format!("ticker {}", self.0)
        }
        fn job_id(&self) -> Option<JobId> {
            (self.0 > 0).then_some(self.0)
        }
        async fn run(self, cancel: CancellationToken, status: Arc<StatusCell>) {
            loop {
                status.set("idle");
                status.turn(Some("store down".into()));
                tokio::select! {
                    _ = tokio::time::sleep(std::time::Duration::from_secs(1)) => {}
                    _ = cancel.cancelled() => return,
                }
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn workers_report_and_stop_with_the_agent() {
        let (tracker, cancel) = (TaskTracker::new(), CancellationToken::new());
        let workers = Workers::new(tracker.clone(), cancel.clone());
        workers.spawn(Ticker(10));
        workers.spawn(Ticker(9));
        workers.spawn(Ticker(0));
        tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
        let s = workers.statuses();
        // The node's own first, then the jobs' in job order (not "10" before "9").
        assert_eq!(
            s.iter()
                .map(|w| (w.name.as_str(), w.job_id))
                .collect::<Vec<_>>(),
            [
                ("ticker 0", None),
                ("ticker 9", Some(9)),
                ("ticker 10", Some(10))
            ]
        );
        assert!(s.iter().all(|w| w.state == "idle" && w.turns == 3));
        assert_eq!(s[0].last_error.as_deref(), Some("store down"));
        cancel.cancel();
        tracker.close();
        tracker.wait().await;
        assert!(
            workers.statuses().is_empty(),
            "stopped workers are not listed"
        );
    }
}
