//! The per-job checkpoint worker of the agent: turns commits into archives, publishes manifests,
//! applies retention, and cleans up after the job — also after the job ended and after a restart.

use crate::agent::Agent;
use crate::ckpt::{self, CkptEntry, CommitOutcome};
use crate::job::Job;
use sluice_archive::safefs::{self, Owner};
use sluice_archive::{self as archive, ArchiveProgress, Archiver, JobMeta};
use sluice_proto::msg::{CkptState, ErrorCode, ErrorReply, JobState, Response};
use sluice_proto::options::Restore;
use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f)
        .await
        .expect("blocking task panicked")
}

/// Automatic re-reads of a checkpoint whose files changed while it was archived.
const MAX_MODIFIED_RETRIES: u64 = 4;

/// Longest pause between attempts to archive a checkpoint whose store is failing.
const MAX_BACKOFF: Duration = Duration::from_secs(120);

/// Opens `<hot>/jobs/<id>` without following links.
fn open_job_dir(hot_root: &std::path::Path, job_id: u32) -> Result<OwnedFd, safefs::SafeFsError> {
    let root = safefs::open_root_dir(hot_root)?;
    let jobs = safefs::open_dir(&root, "jobs")?;
    safefs::open_dir(&jobs, &job_id.to_string())
}

fn open_ckpt_dir(hot_root: &std::path::Path, job_id: u32) -> Result<OwnedFd, safefs::SafeFsError> {
    safefs::open_dir(open_job_dir(hot_root, job_id)?, "ckpt")
}

impl Agent {
    /// `sluice ckpt commit TAG` (or a framework signal): record the commit and wake the worker.
    pub(crate) async fn ckpt_commit(&self, job: &Arc<Job>, tag: &str) -> Response {
        if job.is_ended() {
            return Response::Error(ErrorReply::new(
                ErrorCode::BadRequest,
                format!("job {} has ended", job.start.job_id),
            ));
        }
        self.commit_tag(job, tag).await
    }

    /// Records a commit (from a request, a framework signal, or another node via the archive).
    async fn commit_tag(&self, job: &Arc<Job>, tag: &str) -> Response {
        let (hot, id, uid, t) = (
            self.cfg.hot_root.clone(),
            job.start.job_id,
            job.start.uid,
            tag.to_string(),
        );
        let checked = blocking(move || {
            let dir = open_ckpt_dir(&hot, id)
                .map_err(|e| format!("the job's checkpoint directory: {e}"))?;
            ckpt::check_commit_dir(&dir, &t, uid)
        })
        .await;
        if let Err(m) = checked {
            return Response::Error(ErrorReply::new(ErrorCode::BadRequest, m));
        }
        match job.ckpts.commit(tag, now()) {
            Ok(outcome) => {
                if outcome != CommitOutcome::AlreadyPending {
                    tracing::info!(job_id = id, tag, ?outcome, "checkpoint committed");
                    self.persist(job).await;
                    job.ckpts.wake.notify_one();
                }
                if job
                    .archive_url
                    .as_ref()
                    .ok()
                    .and_then(|u| u.as_ref())
                    .is_none()
                {
                    return Response::Error(ErrorReply::new(
                        ErrorCode::BadRequest,
                        format!(
                            "checkpoint {tag} is committed but will not be archived: the job has no --ckpt-archive and the site sets no default"
                        ),
                    ));
                }
                Response::Ok
            }
            Err(m) => Response::Error(ErrorReply::new(ErrorCode::BadRequest, m)),
        }
    }

    pub(crate) async fn ckpt_worker(self: Arc<Self>, job: Arc<Job>) {
        let job_id = job.start.job_id;
        let url = job.archive_url.clone().ok().flatten();
        let mut archiver: Option<Arc<Archiver>> = None;
        let mut next_try: HashMap<String, Instant> = HashMap::new();
        let mut last_remote_scan: Option<Instant> = None;
        let mut ended_at: Option<Instant> = None;
        loop {
            if job.is_ended() && job.state() == JobState::Ended {
                return; // replaced by a newer run of the same job id
            }
            // Framework completion signals, while the job runs and its directories exist.
            if !job.is_ended() && matches!(job.state(), JobState::Ready) {
                let (hot, uid) = (self.cfg.hot_root.clone(), job.start.uid);
                let tags = blocking(move || {
                    open_ckpt_dir(&hot, job_id)
                        .map(|d| ckpt::scan_signals(&d, uid))
                        .unwrap_or_default()
                })
                .await;
                for tag in tags {
                    if job.ckpts.get(&tag).is_none() {
                        let _ = self.commit_tag(&job, &tag).await;
                    }
                }
            }
            if let Some(url) = &url {
                if archiver.is_none() {
                    match archive::open_archive(&self.cfg, url) {
                        Ok(a) => {
                            archiver = Some(Arc::new(match &self.bandwidth {
                                Some(bw) => a.with_bandwidth(bw),
                                None => a,
                            }))
                        }
                        Err(e) => {
                            tracing::warn!(job_id, "archive {url}: {e}");
                            for entry in job.ckpts.entries().iter().filter(|e| e.needs_upload()) {
                                entry.set_error(
                                    CkptState::Retrying,
                                    format!("cannot open the archive: {e}"),
                                );
                            }
                        }
                    }
                }
                if let Some(a) = archiver.clone() {
                    // Commits made on the job's other nodes reach this node through the archive.
                    let due = last_remote_scan
                        .is_none_or(|t| t.elapsed() >= self.cfg.ckpt.scan_interval * 3);
                    if job.start.nodes.len() > 1 && due {
                        last_remote_scan = Some(Instant::now());
                        self.adopt_remote_commits(&job, &a).await;
                    }
                    for entry in job.ckpts.entries() {
                        if next_try
                            .get(&entry.tag)
                            .is_some_and(|t| Instant::now() < *t)
                        {
                            continue;
                        }
                        // A checkpoint that changed while being read is retried a few times after a
                        // pause (a commit seen through the archive may arrive before this node's
                        // writes finish), then waits for an explicit commit.
                        let retry_modified = entry.state() == CkptState::Modified
                            && entry.failures.load(Ordering::Relaxed) <= MAX_MODIFIED_RETRIES;
                        if entry.needs_upload() || retry_modified {
                            self.archive_part(&job, &entry, &a).await;
                        }
                        if entry.state() == CkptState::WaitingForNodes {
                            self.publish(&job, &entry, &a).await;
                        }
                        let failures = entry.failures.load(Ordering::Relaxed);
                        if failures > 0 {
                            let backoff =
                                Duration::from_secs(1u64 << failures.min(7)).min(MAX_BACKOFF);
                            next_try.insert(entry.tag.clone(), Instant::now() + backoff);
                        } else {
                            next_try.remove(&entry.tag);
                        }
                    }
                }
            }
            self.trim(&job).await;
            if job.is_ended() && (!job.ckpts.pending() || url.is_none()) {
                // A commit made on another node just before the end may not have reached this node
                // yet: a multi-node job's uncommitted directories wait out ckpt.epilog_wait (while
                // commits are adopted from the archive) before they are deleted.
                let ended_at = *ended_at.get_or_insert_with(Instant::now);
                let wait = url.is_some()
                    && job.start.nodes.len() > 1
                    && ended_at.elapsed() < self.cfg.ckpt.epilog_wait
                    && self.has_uncommitted_dirs(&job).await;
                if !wait {
                    self.finalize(&job).await;
                    return;
                }
                last_remote_scan = None; // adopt at the next turn
            }
            tokio::select! {
                _ = job.ckpts.wake.notified() => {}
                _ = tokio::time::sleep(self.cfg.ckpt.scan_interval) => {}
                _ = self.stopping.cancelled() => return,
            }
        }
    }

    /// Uploads this node's files of one checkpoint.
    async fn archive_part(&self, job: &Job, entry: &Arc<CkptEntry>, archiver: &Arc<Archiver>) {
        let job_id = job.start.job_id;
        let generation = entry.generation();
        entry.set_state(CkptState::Archiving);
        let (hot, tag) = (self.cfg.hot_root.clone(), entry.tag.clone());
        let dir = blocking(move || safefs::open_dir(open_ckpt_dir(&hot, job_id)?, &tag)).await;
        let dir = match dir {
            Ok(d) => Arc::new(d),
            Err(e) => {
                return entry.set_error(
                    CkptState::Modified,
                    format!("the checkpoint directory is gone or unusable ({e}); commit it again once it is complete"),
                );
            }
        };
        // A prefix several users may archive into (an allow rule without `{user}`): never
        // overwrite another user's checkpoint of the same tag (their restore would then get ours,
        // or nothing). A refusal is final for this commit, as for a refused tree. Their restores
        // never pick ours anyway: restore checks the owner (F2 in docs/SECURITY.md).
        if let Ok(m) = archiver.manifest(&entry.tag).await {
            if m.job.user != job.start.user {
                let message = format!(
                    "checkpoint {} in {} was archived by user {}; sluice does not overwrite \
                     another user's checkpoint: commit it under another tag, or archive under a \
                     prefix of your own",
                    entry.tag,
                    archiver.url(),
                    m.job.user
                );
                tracing::warn!(job_id, tag = entry.tag, "{message}");
                entry
                    .failures
                    .store(MAX_MODIFIED_RETRIES + 1, Ordering::Relaxed);
                entry.refused.store(true, Ordering::Relaxed);
                return entry.set_error(CkptState::Modified, message);
            }
        }
        let progress = ArchiveProgress::default();
        let result = archiver
            .upload_part(&entry.tag, &self.cfg.node, dir, job.start.uid, &progress)
            .await;
        entry
            .bytes_done
            .store(progress.snapshot().bytes_done, Ordering::Relaxed);
        if entry.generation() != generation {
            return entry.set_state(CkptState::Committed); // re-committed meanwhile: upload again
        }
        match result {
            Ok(part) => {
                entry
                    .files
                    .store(part.files.len() as u64, Ordering::Relaxed);
                entry.raw_bytes.store(part.raw_bytes(), Ordering::Relaxed);
                entry
                    .stored_bytes
                    .store(part.stored_bytes(), Ordering::Relaxed);
                entry.failures.store(0, Ordering::Relaxed);
                entry.set_state(CkptState::WaitingForNodes);
                tracing::info!(job_id, tag = entry.tag, "checkpoint part uploaded");
            }
            Err(e @ archive::ArchiveError::Refused { .. }) => {
                // A symlink, a hard link, another user's file: retrying cannot help. It is not a
                // checkpoint sluice keeps: it goes with the uncommitted directories at job end,
                // unless the user fixes it and commits it again before.
                tracing::warn!(job_id, tag = entry.tag, "{e}");
                entry
                    .failures
                    .store(MAX_MODIFIED_RETRIES + 1, Ordering::Relaxed);
                entry.refused.store(true, Ordering::Relaxed);
                entry.set_error(
                    CkptState::Modified,
                    format!("{e}; fix the checkpoint and commit it again"),
                );
            }
            Err(e) if e.is_modified() => {
                tracing::warn!(job_id, tag = entry.tag, "{e}");
                entry.failures.fetch_add(1, Ordering::Relaxed);
                entry.set_error(
                    CkptState::Modified,
                    format!("{e}; sluice retries a few times, then waits for the next commit of this tag"),
                );
            }
            Err(e) => {
                tracing::warn!(job_id, tag = entry.tag, "archive attempt failed: {e}");
                entry.failures.fetch_add(1, Ordering::Relaxed);
                let text = e.to_string();
                let message = if crate::stage::is_unreachable(&text) {
                    format!(
                        "the archive store is unreachable; retrying ({})",
                        crate::stage::concise(&text)
                    )
                } else {
                    crate::stage::concise(&text)
                };
                entry.set_error(CkptState::Retrying, message);
            }
        }
    }

    /// Publishes the MANIFEST once every node's part is in the archive.
    async fn publish(&self, job: &Job, entry: &Arc<CkptEntry>, archiver: &Arc<Archiver>) {
        let meta = JobMeta {
            job_id: job.start.job_id,
            user: job.start.user.clone(),
            job_name: job.start.job_name.clone(),
        };
        match archiver
            .try_publish(&entry.tag, &job.start.nodes, meta)
            .await
        {
            Ok(Some(_)) => {
                entry.set_archived(now());
                tracing::info!(
                    job_id = job.start.job_id,
                    tag = entry.tag,
                    "checkpoint archived"
                );
                self.persist(job).await;
            }
            Ok(None) => {}
            Err(e) => {
                entry.failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    job_id = job.start.job_id,
                    tag = entry.tag,
                    "publishing: {e}"
                );
            }
        }
    }

    /// Commits, on this node, checkpoints that another node of the job committed (seen as a tag in the
    /// archive with parts but no MANIFEST) and that this node holds.
    async fn adopt_remote_commits(&self, job: &Arc<Job>, archiver: &Arc<Archiver>) {
        let Ok(list) = archiver.list().await else {
            return;
        };
        for info in list
            .into_iter()
            .filter(|i| i.state == archive::CheckpointState::Partial)
        {
            if job.ckpts.get(&info.tag).is_some() {
                continue;
            }
            let (hot, id, uid, t) = (
                self.cfg.hot_root.clone(),
                job.start.job_id,
                job.start.uid,
                info.tag.clone(),
            );
            let here = blocking(move || {
                open_ckpt_dir(&hot, id)
                    .map(|d| ckpt::check_commit_dir(&d, &t, uid).is_ok())
                    .unwrap_or(false)
            })
            .await;
            if here {
                tracing::info!(
                    job_id = id,
                    tag = info.tag,
                    "committed on another node of the job"
                );
                let _ = self.commit_tag(job, &info.tag).await;
            }
        }
    }

    /// Whether the hot tier is fuller than `ckpt.high_water` percent of its size.
    pub(crate) async fn above_high_water(&self) -> bool {
        let (root, high) = (self.cfg.hot_root.clone(), self.cfg.ckpt.high_water as u64);
        blocking(move || {
            nix::sys::statvfs::statvfs(&root).is_ok_and(|s| {
                let total = s.blocks();
                let used = total.saturating_sub(s.blocks_free());
                total > 0 && used * 100 > total * high
            })
        })
        .await
    }

    /// Whether the job's checkpoint directory holds directories that are not committed checkpoints.
    async fn has_uncommitted_dirs(&self, job: &Job) -> bool {
        let (hot, id) = (self.cfg.hot_root.clone(), job.start.job_id);
        let committed: Vec<String> = job.ckpts.entries().iter().map(|e| e.tag.clone()).collect();
        blocking(move || {
            let Ok(dir) = open_ckpt_dir(&hot, id) else {
                return false;
            };
            let Ok(mut d) = nix::dir::Dir::from_fd(dir) else {
                return false;
            };
            d.iter().filter_map(|e| e.ok()).any(|e| {
                let name = e.file_name().to_str().unwrap_or(".");
                e.file_type() == Some(nix::dir::Type::Directory)
                    && name != "."
                    && name != ".."
                    && !committed.iter().any(|c| c == name)
            })
        })
        .await
    }

    /// Retention: removes archived checkpoints beyond the newest `keep` from the hot tier; above the
    /// high-water mark, every archived checkpoint but the newest.
    pub(crate) async fn trim(&self, job: &Job) {
        if self.replaced(job) {
            return;
        }
        let keep = if self.above_high_water().await {
            1
        } else {
            job.keep
        };
        let victims = job.ckpts.to_trim(keep);
        if victims.is_empty() {
            return;
        }
        let (hot, id) = (self.cfg.hot_root.clone(), job.start.job_id);
        let tags: Vec<String> = victims.iter().map(|e| e.tag.clone()).collect();
        let results = blocking(move || {
            let dir = open_ckpt_dir(&hot, id)?;
            Ok::<_, safefs::SafeFsError>(
                tags.iter()
                    .map(|t| safefs::remove_tree(&dir, t))
                    .collect::<Vec<_>>(),
            )
        })
        .await;
        match results {
            Ok(results) => {
                for (entry, r) in victims.iter().zip(results) {
                    match r {
                        Ok(_) => {
                            entry.set_on_hot(false);
                            tracing::info!(
                                job_id = id,
                                tag = entry.tag,
                                "trimmed from the hot tier (archived)"
                            );
                        }
                        Err(e) => tracing::warn!(job_id = id, tag = entry.tag, "trimming: {e}"),
                    }
                }
                self.persist(job).await;
            }
            Err(e) => tracing::warn!(job_id = id, "trimming: {e}"),
        }
    }

    /// After the job ended and nothing is pending: remove what is not a kept checkpoint. The job
    /// directory (and the journal record) stay while committed checkpoints remain on the hot tier.
    async fn finalize(&self, job: &Arc<Job>) {
        let (hot, id) = (self.cfg.hot_root.clone(), job.start.job_id);
        if self.replaced(job) {
            // Requeued: `jobs/<id>` and the journal record belong to the new run now.
            tracing::info!(
                job_id = id,
                "job finished on this node; a newer run replaced it"
            );
            return;
        }
        let keep: Vec<String> = job
            .ckpts
            .entries()
            .iter()
            .filter(|e| e.on_hot() && !e.refused.load(Ordering::Relaxed))
            .map(|e| e.tag.clone())
            .collect();
        let keep_any = !keep.is_empty();
        let removed = blocking(move || -> Result<(), safefs::SafeFsError> {
            let root = safefs::open_root_dir(&hot)?;
            let jobs = safefs::open_dir(&root, "jobs")?;
            if !keep_any {
                safefs::remove_tree(&jobs, &id.to_string())?;
                return Ok(());
            }
            // Uncommitted leftovers (torn saves, framework marker files) go; committed ones stay.
            let ckpt = safefs::open_dir(safefs::open_dir(&jobs, &id.to_string())?, "ckpt")?;
            let dup = ckpt
                .try_clone()
                .map_err(|e| safefs::SafeFsError::BadPath(e.to_string()))?;
            let names: Vec<String> = nix::dir::Dir::from_fd(dup)
                .map(|mut d| {
                    d.iter()
                        .filter_map(|e| e.ok())
                        .filter_map(|e| e.file_name().to_str().ok().map(String::from))
                        .filter(|n| n != "." && n != "..")
                        .collect()
                })
                .unwrap_or_default();
            for n in names.iter().filter(|n| !keep.contains(n)) {
                safefs::remove_tree(&ckpt, n)?;
            }
            Ok(())
        })
        .await;
        if let Err(e) = removed {
            tracing::error!(job_id = id, "cleaning up after the job: {e}");
        }
        if keep_any {
            self.persist(job).await;
        } else if !self.replaced(job) {
            self.forget(id).await;
        }
        job.set_ended();
        tracing::info!(
            job_id = id,
            retained = keep_any,
            "job finished on this node"
        );
    }

    /// Takes `tag` from a checkpoint an ended job of the same user left on this node's hot tier (same
    /// archive), if that copy is complete and verifies against the archive's MANIFEST (sizes and
    /// BLAKE3 of every file). The directory is moved, not copied. Returns the note for the job, or
    /// `None` when there is no usable copy (then the caller restores from the archive).
    async fn restore_from_hot_tier(
        &self,
        job: &Arc<Job>,
        url: &str,
        tag: &str,
        archiver: &Archiver,
        ckpt_dir: Arc<OwnedFd>,
    ) -> Option<String> {
        let uid = job.start.uid;
        let (old_job, old_entry) = self.jobs().values().find_map(|j| {
            let same = j.is_ended() && j.start.uid == uid && j.start.job_id != job.start.job_id;
            let same = same && j.archive_url.as_ref().ok().and_then(|u| u.as_deref()) == Some(url);
            let e = j
                .ckpts
                .get(tag)
                .filter(|e| same && e.on_hot() && e.state() == CkptState::Archived)?;
            Some((j.clone(), e))
        })?;
        let manifest = archiver.manifest(tag).await.ok()?;
        let (hot, old_id, t) = (
            self.cfg.hot_root.clone(),
            old_job.start.job_id,
            tag.to_string(),
        );
        let dest = ckpt_dir.clone();
        // Move first (the old job's directory is the user's: verifying in place and then moving
        // would leave a window to swap files), verify, and move back if the copy is not usable
        // (e.g. only this node's part of a multi-node checkpoint): it stays the old job's kept copy.
        let verified = blocking(move || -> Result<(), String> {
            let old_dir = open_ckpt_dir(&hot, old_id).map_err(|e| e.to_string())?;
            nix::fcntl::renameat(&old_dir, t.as_str(), &*dest, t.as_str())
                .map_err(|e| e.to_string())?;
            let result = verify_local(&dest, &t, uid, &manifest);
            if result.is_err()
                && nix::fcntl::renameat(&*dest, t.as_str(), &old_dir, t.as_str()).is_err()
            {
                let _ = safefs::remove_tree(&*dest, &t);
                return Err("the copy failed verification and could not be put back".into());
            }
            result.map_err(|e| format!("{e} (left in place)"))
        })
        .await;
        let moved = verified.is_ok()
            || verified
                .as_ref()
                .is_err_and(|e| e.contains("could not be put back"));
        if moved {
            old_entry.set_on_hot(false);
            self.persist(&old_job).await;
        }
        match verified {
            Ok(()) => {
                let entry = Arc::new(CkptEntry::new(tag, now()));
                entry.set_archived(now());
                job.ckpts.insert(entry);
                tracing::info!(
                    job_id = job.start.job_id,
                    tag,
                    from_job = old_id,
                    "checkpoint restored from the hot tier"
                );
                Some(format!(
                    "checkpoint {tag} restored from this node's hot tier (left by job {old_id}, verified against {url})"
                ))
            }
            Err(e) => {
                tracing::info!(
                    job_id = job.start.job_id,
                    tag,
                    "hot-tier copy unusable ({e}); restoring from the archive"
                );
                None
            }
        }
    }

    /// `--ckpt-restore`: places a checkpoint from the archive in the job's checkpoint directory,
    /// verified against its MANIFEST. `latest` falls back to the next newest intact checkpoint and
    /// says so in the returned notes.
    ///
    /// Only the job user's own checkpoints are restored (F2 in docs/SECURITY.md): an allow rule
    /// without `{user}` lets several users archive under one prefix, and the URL alone must not hand
    /// B what A archived, nor make A's `latest` pick what B published there. The owner is the user
    /// name the MANIFEST records (`job.user`, written by the agent from slurmd's `SLURM_JOB_USER`).
    /// It is checked before anything is fetched and again on the MANIFEST the restore used, in case
    /// it was replaced meanwhile. `latest` skips other users' checkpoints and says so; an explicit
    /// tag of another user fails the job.
    pub(crate) async fn restore_ckpt(
        &self,
        job: &Arc<Job>,
        url: &str,
        which: &Restore,
        ckpt_dir: Arc<OwnedFd>,
    ) -> Result<(String, Vec<String>), String> {
        let archiver = archive::open_archive(&self.cfg, url)
            .map_err(|e| format!("--ckpt-restore: archive {url}: {e}"))?;
        let owner = Owner {
            uid: job.start.uid,
            gid: job.start.gid,
        };
        let mut notes = Vec::new();
        let mut exclude: Vec<String> = Vec::new();
        // Other users' checkpoints `latest` passed over: all of them up front (one listing), and
        // any that turn up later.
        let mut foreign: Vec<String> = Vec::new();
        if *which == Restore::Latest {
            let list = archiver
                .list()
                .await
                .map_err(|e| format!("--ckpt-restore: listing {url}: {e}"))?;
            foreign = list
                .into_iter()
                .filter(|i| i.job.as_ref().is_some_and(|m| m.user != job.start.user))
                .map(|i| i.tag)
                .collect();
            exclude.clone_from(&foreign);
        }
        let done = |tag: String, mut notes: Vec<String>, foreign: &[String]| {
            if !foreign.is_empty() {
                notes.insert(0, foreign_note(url, foreign));
            }
            Ok((tag, notes))
        };
        loop {
            let tag = match which {
                Restore::Tag(t) => t.clone(),
                Restore::Latest => match archiver.latest(&exclude).await {
                    Ok(Some(t)) => t,
                    Ok(None) if exclude.is_empty() => {
                        return Err(format!(
                            "--ckpt-restore=latest: no archived checkpoint in {url}"
                        ));
                    }
                    Ok(None) if notes.is_empty() => {
                        return Err(format!(
                            "--ckpt-restore=latest: no checkpoint of yours in {url} ({}); \
                             archive under a prefix of your own, or submit without \
                             --ckpt-restore",
                            foreign_note(url, &foreign)
                        ));
                    }
                    Ok(None) => {
                        if !foreign.is_empty() {
                            notes.insert(0, foreign_note(url, &foreign));
                        }
                        return Err(format!(
                            "--ckpt-restore=latest: no intact checkpoint left in {url} ({})",
                            notes.join("; ")
                        ));
                    }
                    Err(e) => return Err(format!("--ckpt-restore: listing {url}: {e}")),
                },
            };
            // Before anything is fetched or moved. A missing or unreadable MANIFEST is left to the
            // restore below, which reports it (and the owner is checked again after).
            if let Ok(m) = archiver.manifest(&tag).await {
                if m.job.user != job.start.user {
                    refuse_foreign(job, url, &tag, &m.job, which)?;
                    exclude.push(tag.clone());
                    foreign.push(tag);
                    continue;
                }
            }
            if let Some(note) = self
                .restore_from_hot_tier(job, url, &tag, &archiver, ckpt_dir.clone())
                .await
            {
                notes.push(note);
                return done(tag, notes, &foreign);
            }
            let (dir, t) = (ckpt_dir.clone(), tag.clone());
            let dest = blocking(move || {
                safefs::remove_tree(&*dir, &t)?;
                safefs::create_dir(&*dir, &t, Some(owner), 0o755)
            })
            .await
            .map_err(|e| format!("--ckpt-restore: creating $SLUICE_CKPT_DIR/{tag}: {e}"))?;
            let progress = ArchiveProgress::default();
            let restored = archiver
                .restore(&tag, Arc::new(dest), owner, &progress)
                .await;
            // The MANIFEST the restore used may have been replaced since the check above.
            let other_owner = restored
                .as_ref()
                .ok()
                .filter(|m| m.job.user != job.start.user)
                .map(|m| m.job.clone());
            match restored {
                Ok(manifest) if other_owner.is_none() => {
                    let entry = Arc::new(CkptEntry::new(&tag, now()));
                    entry
                        .files
                        .store(manifest.files.len() as u64, Ordering::Relaxed);
                    entry
                        .raw_bytes
                        .store(manifest.raw_bytes(), Ordering::Relaxed);
                    entry
                        .stored_bytes
                        .store(manifest.stored_bytes(), Ordering::Relaxed);
                    entry.set_archived(now());
                    job.ckpts.insert(entry);
                    tracing::info!(job_id = job.start.job_id, tag, "checkpoint restored");
                    return done(tag, notes, &foreign);
                }
                result => {
                    let dir = ckpt_dir.clone();
                    let t = tag.clone();
                    let _ = blocking(move || safefs::remove_tree(&*dir, &t)).await;
                    if let Some(other) = other_owner {
                        refuse_foreign(job, url, &tag, &other, which)?;
                        foreign.push(tag.clone());
                    } else if let Err(e) = result {
                        match which {
                            Restore::Latest => notes.push(format!(
                                "checkpoint {tag} in {url} cannot be restored ({e}); falling back to the next newest"
                            )),
                            Restore::Tag(_) => return Err(format!("--ckpt-restore={tag}: {e}")),
                        }
                    }
                    exclude.push(tag);
                }
            }
        }
    }
}

/// The note for checkpoints of other users that `--ckpt-restore=latest` passed over. Names the tags
/// (at most a few), not their owners.
fn foreign_note(url: &str, tags: &[String]) -> String {
    const SHOWN: usize = 5;
    let mut shown = tags
        .iter()
        .take(SHOWN)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if tags.len() > SHOWN {
        shown.push_str(&format!(" and {} more", tags.len() - SHOWN));
    }
    format!(
        "skipped {} checkpoint(s) in {url} archived by other users ({shown}): sluice restores \
         only your own",
        tags.len()
    )
}

/// Checkpoint `tag` was archived by `owner`, not by the job's user: an explicit tag fails the job
/// (`Err`, the message it shows); `latest` passes over it (`Ok`).
fn refuse_foreign(
    job: &Job,
    url: &str,
    tag: &str,
    owner: &JobMeta,
    which: &Restore,
) -> Result<(), String> {
    match which {
        Restore::Latest => Ok(()),
        Restore::Tag(_) => Err(format!(
            "--ckpt-restore={tag}: checkpoint {tag} in {url} was archived by user {}, not by {}; \
             sluice restores only your own checkpoints. Restore one of yours, or archive under a \
             prefix of your own (ask your admin for a --ckpt-archive rule with {{user}})",
            owner.user, job.start.user
        )),
    }
}

/// Checks that the checkpoint directory `tag` below `dir` holds exactly the MANIFEST's files, with
/// their sizes and BLAKE3 content hashes (read fd-relative, without following links).
fn verify_local(
    dir: &OwnedFd,
    tag: &str,
    uid: u32,
    manifest: &archive::Manifest,
) -> Result<(), String> {
    use std::io::Read;
    let root = safefs::open_dir(dir, tag).map_err(|e| e.to_string())?;
    let tree = archive::walk::walk(&root, uid).map_err(|e| e.to_string())?;
    let mut want: Vec<(&str, u64)> = manifest
        .files
        .iter()
        .map(|f| (f.path.as_str(), f.size))
        .collect();
    want.sort();
    let have: Vec<(&str, u64)> = tree
        .files
        .iter()
        .map(|f| (f.rel.as_str(), f.size))
        .collect();
    if want != have {
        return Err(
            "the local copy does not hold exactly the archived files (a multi-node checkpoint?)"
                .into(),
        );
    }
    for f in &tree.files {
        let (mut file, _) = archive::walk::open_file(&root, f, uid).map_err(|e| e.to_string())?;
        let mut hasher = blake3::Hasher::new();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = file.read(&mut buf).map_err(|e| e.to_string())?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
        }
        let expected = manifest
            .files
            .iter()
            .find(|m| m.path == f.rel)
            .map(|m| m.content_hash());
        if Some(hasher.finalize()) != expected {
            return Err(format!("{} differs from the archived file", f.rel));
        }
    }
    Ok(())
}
