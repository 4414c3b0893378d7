//! One job on this node: its identity, directories, staging progress and state.

use crate::stage::Progress;
use sluice_proto::msg::{JobDirs, JobStart, JobState, JobStatus};
use sluice_proto::options::JobOptions;
use std::sync::{Arc, Mutex};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

pub struct Job {
    pub start: JobStart,
    /// Parsed and validated on the root side; `Err` holds the message the job will fail with.
    pub options: Result<JobOptions, String>,
    pub dirs: JobDirs,
    pub started_at: u64,
    pub stages: Vec<Arc<Progress>>,
    state: watch::Sender<JobState>,
    error: Mutex<Option<String>>,
    /// Cancelled when the job ends: stops its staging.
    pub cancel: CancellationToken,
}

impl Job {
    pub fn new(
        start: JobStart,
        options: Result<JobOptions, String>,
        dirs: JobDirs,
        started_at: u64,
    ) -> Job {
        let stages = match &options {
            Ok(o) => o
                .stage_in
                .iter()
                .map(|s| Arc::new(Progress::new(s)))
                .collect(),
            Err(_) => Vec::new(),
        };
        let (state, _) = watch::channel(JobState::Staging);
        Job {
            start,
            options,
            dirs,
            started_at,
            stages,
            state,
            error: Mutex::new(None),
            cancel: CancellationToken::new(),
        }
    }

    pub fn state(&self) -> JobState {
        *self.state.borrow()
    }

    pub fn subscribe(&self) -> watch::Receiver<JobState> {
        self.state.subscribe()
    }

    pub fn error(&self) -> Option<String> {
        self.error.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn set_ready(&self) {
        self.state.send_replace(JobState::Ready);
    }

    pub fn set_failed(&self, message: String) {
        *self.error.lock().unwrap_or_else(|e| e.into_inner()) = Some(message);
        self.state.send_replace(JobState::Failed);
    }

    pub fn set_ended(&self) {
        self.state.send_replace(JobState::Ended);
    }

    pub fn status(&self) -> JobStatus {
        JobStatus {
            job_id: self.start.job_id,
            user: self.start.user.clone(),
            uid: self.start.uid,
            node: self.start.node.clone(),
            nodes: self.start.nodes.clone(),
            state: self.state(),
            dirs: self.dirs.clone(),
            stages: self.stages.iter().map(|p| p.snapshot()).collect(),
            started_at: self.started_at,
            error: self.error(),
        }
    }
}
