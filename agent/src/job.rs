//! One job on this node: its identity, directories, staging progress and state.

use crate::ckpt::JobCkpts;
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
    /// Where committed checkpoints are archived (`Ok(None)`: nowhere configured; `Err`: refused by policy).
    pub archive_url: Result<Option<String>, String>,
    /// Committed checkpoints kept on the hot tier once archived.
    pub keep: u32,
    pub ckpts: JobCkpts,
    /// Set by the epilog; the checkpoint worker then finishes pending archives and cleans up.
    pub ended: std::sync::atomic::AtomicBool,
    restored: Mutex<(Option<String>, Vec<String>)>,
}

impl Job {
    pub fn new(
        start: JobStart,
        options: Result<JobOptions, String>,
        dirs: JobDirs,
        started_at: u64,
        archive_url: Result<Option<String>, String>,
        default_keep: u32,
    ) -> Job {
        let keep = options
            .as_ref()
            .ok()
            .and_then(|o| o.ckpt_keep)
            .unwrap_or(default_keep);
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
            archive_url,
            keep,
            ckpts: JobCkpts::default(),
            ended: std::sync::atomic::AtomicBool::new(false),
            restored: Mutex::new((None, Vec::new())),
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

    pub fn is_ended(&self) -> bool {
        self.ended.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Records what `--ckpt-restore` placed in the checkpoint directory, and notes for the job output.
    pub fn set_restored(&self, tag: Option<String>, notes: Vec<String>) {
        *self.restored.lock().unwrap_or_else(|e| e.into_inner()) = (tag, notes);
    }

    /// The directories, restored tag and notes the job's tasks get.
    pub fn task_dirs(&self) -> JobDirs {
        let (tag, notes) = self
            .restored
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        JobDirs {
            restored_tag: tag,
            notes,
            ..self.dirs.clone()
        }
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
            ckpts: self.ckpt_statuses(),
        }
    }

    pub fn ckpt_statuses(&self) -> Vec<sluice_proto::msg::CkptStatus> {
        let url = self.archive_url.clone().ok().flatten().unwrap_or_default();
        self.ckpts
            .entries()
            .iter()
            .map(|e| e.status(&url))
            .collect()
    }
}
