//! The jobs on this node and their journal, below everything that uses them: the agent's requests,
//! the checkpoint workers, restore, housekeeping and the metrics all find jobs here, and a job's
//! record reaches the journal only through this table ([`JobTable::save`] when the job starts,
//! [`JobTable::persist`] after).
//!
//! One job id holds one run: a requeued job's new run takes the old one's place
//! ([`JobTable::insert`]), and from then on the old run's work must no longer touch `jobs/<id>` or
//! the record `<id>.json` ([`JobTable::replaced`]). Ended jobs stay for `sluice job` and
//! `sluice status` until more than [`KEEP_ENDED`] of them hold nothing on the hot tier any more.

use crate::job::ckpts::CkptEntry;
use crate::job::{self, Job};
use crate::journal::{CkptRecord, JobRecord, Journal, JournalError, RECORD_VERSION};
use sluice_core::rt::{blocking, lock};
use sluice_proto::msg::{JobId, JobState};
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

/// Ended jobs kept for `sluice job`/`status` before they are forgotten.
const KEEP_ENDED: usize = 64;

/// The job table and the journal that outlives it.
pub struct JobTable {
    jobs: Mutex<HashMap<JobId, Arc<Job>>>,
    journal: Journal,
    /// Held across every write and removal of a record, so that a write of a job that raced with
    /// its removal sees [`Job::forgotten`] and leaves the record removed.
    writing: tokio::sync::Mutex<()>,
}

impl JobTable {
    /// An empty table over the journal under `state_dir` (created if needed, root-only). The jobs
    /// it records come back through [`JobTable::load`].
    pub(crate) fn open(state_dir: &Path) -> Result<JobTable, JournalError> {
        Ok(JobTable {
            jobs: Mutex::new(HashMap::new()),
            journal: Journal::open(state_dir)?,
            writing: tokio::sync::Mutex::new(()),
        })
    }

    /// Every record the journal holds, and the errors of those it cannot read.
    pub(crate) fn load(&self) -> Result<(Vec<JobRecord>, Vec<JournalError>), JournalError> {
        self.journal.load()
    }

    fn jobs(&self) -> std::sync::MutexGuard<'_, HashMap<JobId, Arc<Job>>> {
        lock(&self.jobs)
    }

    pub(crate) fn get(&self, job_id: JobId) -> Option<Arc<Job>> {
        self.jobs().get(&job_id).cloned()
    }

    /// Every job in the table, at this moment.
    pub(crate) fn snapshot(&self) -> Vec<Arc<Job>> {
        self.jobs().values().cloned().collect()
    }

    /// Puts `job` in the table, and forgets the oldest finished jobs beyond [`KEEP_ENDED`].
    pub(crate) fn insert(&self, job: Arc<Job>) {
        let mut jobs = self.jobs();
        if let Some(old) = jobs.get(&job.start.job_id) {
            job.replaces(old);
        }
        if let Some(old) = jobs.insert(job.start.job_id, job) {
            // A new run of the same job id (requeue): the old run's worker must stop before it
            // trims, finalises or journals anything, since those act on paths keyed by the id.
            // What of its checkpoints is still here, the new run's record carries.
            old.finish();
            old.ckpts.wake.notify_one();
        }
        prune_ended(&mut jobs);
    }

    /// Whether a newer run of the same job id took this job's place in the table (a requeue): the
    /// old run must no longer touch `jobs/<id>` or the journal record `<id>.json`.
    pub(crate) fn replaced(&self, job: &Job) -> bool {
        self.jobs()
            .get(&job.start.job_id)
            .is_some_and(|current| !std::ptr::eq(&**current, job))
    }

    /// Writes a starting job's first record, before the job is in the table.
    pub(crate) async fn save(&self, record: &JobRecord) -> Result<(), JournalError> {
        let journal = self.journal.clone();
        let saved = record.clone();
        blocking(move || journal.save(&saved)).await
    }

    /// Writes the job's current record to the journal (errors are logged: the in-memory state stays
    /// authoritative until the next successful write).
    /// Nothing is written for a run a newer one replaced, or whose record was removed (a set-up
    /// that records the job ready as the epilog's clean-up forgets it must not bring it back).
    pub(crate) async fn persist(&self, job: &Job) {
        let _writing = self.writing.lock().await;
        if self.replaced(job) || job.forgotten.load(Ordering::Relaxed) {
            return;
        }
        let record = JobRecord::from(job);
        let journal = self.journal.clone();
        if let Err(e) = blocking(move || journal.save(&record)).await {
            tracing::error!(job_id = job.start.job_id, "{e}");
        }
    }

    /// Forgets a finished job on disk (its journal record).
    pub(crate) async fn forget(&self, job: &Job) {
        let _writing = self.writing.lock().await;
        job.forgotten.store(true, Ordering::Relaxed);
        let (journal, job_id) = (self.journal.clone(), job.start.job_id);
        if let Err(e) = blocking(move || journal.remove(job_id)).await {
            tracing::error!(job_id, "{e}");
        }
    }
}

/// A job as the journal keeps it.
impl From<&Job> for JobRecord {
    fn from(job: &Job) -> JobRecord {
        JobRecord {
            version: RECORD_VERSION,
            start: job.start.clone(),
            started_at: job.started_at,
            ready: job.state() == JobState::Ready,
            ended: job.has_ended(),
            archive_url: job.archive_url().map(String::from),
            ckpts: job
                .ckpts
                .entries()
                .iter()
                .map(|e| CkptRecord::from(&**e))
                .collect(),
            step_stage_in: lock(&job.extras)
                .values()
                .filter(|e| *e.state.borrow() == job::ExtraState::Done)
                .map(|e| e.spec.clone())
                .collect(),
            from_step: job.from_step.load(std::sync::atomic::Ordering::Relaxed),
            ram: job.is_ram(),
            ram_root: job
                .ram_tier
                .get()
                .filter(|_| job.is_ram())
                .map(|t| t.config().root.clone()),
        }
    }
}

/// A checkpoint's entry as the journal keeps it.
impl From<&CkptEntry> for CkptRecord {
    fn from(e: &CkptEntry) -> CkptRecord {
        CkptRecord {
            tag: e.tag.clone(),
            committed_at: e.committed_at,
            archived_at: e.archived_at(),
            on_hot: e.on_hot(),
            in_ram: e.in_ram(),
            flush_blake3: e.flush_hashes().map(|h| {
                h.iter()
                    .map(|(p, x)| (p.clone(), x.to_hex().to_string()))
                    .collect()
            }),
            lost: e.lost(),
            poisoned: e.is_poisoned(),
            replica_part: e.replication().part.as_deref().cloned(),
        }
    }
}

/// Forgets the oldest finished jobs beyond [`KEEP_ENDED`] — only those that hold nothing on the hot
/// tier any more: a job with checkpoints there stays in the table (its count is bounded by the hot
/// tier itself), so retention and high-water trimming keep seeing them (issue 10, defect 4).
fn prune_ended(jobs: &mut HashMap<JobId, Arc<Job>>) {
    let mut ended: Vec<_> = jobs
        .values()
        .filter(|j| j.is_finished() && !j.ckpts.entries().iter().any(|e| e.on_hot()))
        .map(|j| (j.started_at, j.start.job_id))
        .collect();
    if ended.len() > KEEP_ENDED {
        ended.sort();
        for (_, id) in &ended[..ended.len() - KEEP_ENDED] {
            jobs.remove(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_proto::msg::JobDirs;
    use tokio_util::sync::CancellationToken;

    fn run_of(job_id: JobId, started_at: u64) -> Arc<Job> {
        let start = crate::journal::alice_start(job_id, Vec::new());
        let dirs = JobDirs {
            stage_dir: "/hot/stage".into(),
            ckpt_dir: "/hot/ckpt".into(),
            restored_tag: None,
            notes: Vec::new(),
            env: Vec::new(),
        };
        let cancel = CancellationToken::new();
        Arc::new(Job::new(start, dirs, started_at, Ok(None), 1, cancel))
    }

    /// A job table in a fresh state directory (which lives as long as the first value).
    fn open_table() -> (tempfile::TempDir, JobTable) {
        let state = tempfile::tempdir().unwrap();
        let table = JobTable::open(state.path()).unwrap();
        (state, table)
    }

    /// A run of `job_id` in `table`, with its record written.
    async fn recorded(table: &JobTable, job_id: JobId, started_at: u64) -> Arc<Job> {
        let job = run_of(job_id, started_at);
        table.insert(job.clone());
        table.persist(&job).await;
        job
    }

    /// A requeue's set-up and worker wait until the run before has stopped touching the job's
    /// directories: its checkpoint worker is gone (a RAM-tier flush cut short otherwise made the
    /// new run fail with "rmdir .flush-TAG: ENOTEMPTY").
    #[tokio::test]
    async fn a_new_run_waits_until_the_old_runs_worker_has_stopped() {
        let (_state, table) = open_table();
        let short = std::time::Duration::from_millis(50);
        let old = run_of(7, 100);
        let worker = old.worker_running();
        table.insert(old.clone());
        assert!(
            old.wait_for_previous_run(short).await,
            "a first run waits for nothing"
        );
        let new = run_of(7, 200);
        table.insert(new.clone());
        assert!(
            !new.wait_for_previous_run(short).await,
            "the old run's worker still runs"
        );
        drop(worker);
        assert!(
            new.wait_for_previous_run(short).await,
            "the old run's worker has stopped"
        );
        // A run before whose job is gone altogether (nothing holds it) is nothing to wait for.
        let newer = run_of(7, 300);
        table.insert(newer.clone());
        drop((old, new));
        assert!(newer.wait_for_previous_run(short).await);
    }

    #[tokio::test]
    async fn a_new_run_of_a_job_id_takes_the_old_runs_place_and_record() {
        let (_state, table) = open_table();
        let old = recorded(&table, 7, 100).await;
        let new = run_of(7, 200);
        table.insert(new.clone());
        assert!(old.is_finished(), "the old run's worker must stop");
        assert!(table.replaced(&old) && !table.replaced(&new));
        assert!(Arc::ptr_eq(&table.get(7).unwrap(), &new));
        // The old run, finishing late, no longer writes the record the new run owns.
        table.persist(&new).await;
        old.mark_ended();
        table.persist(&old).await;
        let (records, bad) = table.load().unwrap();
        assert!(bad.is_empty());
        assert_eq!(records.len(), 1);
        assert_eq!((records[0].started_at, records[0].ended), (200, false));
        table.forget(&new).await;
        assert!(table.load().unwrap().0.is_empty());
    }

    /// A set-up that records its job ready while the epilog's clean-up forgets the job must not
    /// bring the record back (CI once found `jobs/31.json` left behind after a job's end).
    #[tokio::test]
    async fn a_forgotten_job_is_never_written_again() {
        let (_state, table) = open_table();
        let job = recorded(&table, 8, 100).await;
        assert_eq!(table.load().unwrap().0.len(), 1);
        table.forget(&job).await;
        table.persist(&job).await;
        assert!(
            table.load().unwrap().0.is_empty(),
            "a late write brought the forgotten record back"
        );
    }

    #[test]
    fn finished_jobs_beyond_the_kept_ones_are_forgotten_oldest_first() {
        let (_state, table) = open_table();
        let running = run_of(1, 0);
        table.insert(running);
        for id in 2..(KEEP_ENDED as u32 + 4) {
            let job = run_of(id, u64::from(id));
            job.finish();
            table.insert(job);
        }
        // Ids 2..=KEEP_ENDED+3 finished: the two oldest go, the running job stays.
        let mut ids: Vec<JobId> = table.snapshot().iter().map(|j| j.start.job_id).collect();
        ids.sort();
        assert_eq!(ids.len(), KEEP_ENDED + 1);
        assert_eq!(&ids[..2], &[1, 4]);
    }
}
