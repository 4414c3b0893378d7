//! A job's checkpoints on this node, as state: each committed checkpoint's entry ([`CkptEntry`])
//! and the job's set of them ([`JobCkpts`]), with the rules that need nothing but that state — what
//! a commit does to a tag ([`JobCkpts::commit`]), which tags retention removes
//! ([`JobCkpts::to_trim`]), what a checkpoint needs next. The work on them (archive, flush,
//! retention on disk, restore) is [`crate::ckpt`]'s, which reads and changes them through the job.

use nix::errno::Errno;
use sluice_archive::flush::FlushHashes;
use sluice_core::rt::lock;
use sluice_core::safefs::SafeFsError;
use sluice_proto::msg::{CkptState, CkptStatus, ReplicaStatus};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Automatic re-reads of a checkpoint whose files changed while it was archived.
pub(crate) const MAX_MODIFIED_RETRIES: u64 = 4;

/// Why a commit is refused. The message is what `sluice ckpt commit` prints.
#[derive(Debug, thiserror::Error)]
pub enum CommitError {
    #[error("{0}")]
    BadTag(String),
    #[error("there is no checkpoint directory $SLUICE_CKPT_DIR/{tag} on this node")]
    Missing { tag: String },
    #[error("$SLUICE_CKPT_DIR/{tag} is not a directory (symlinks are not followed)")]
    NotADirectory { tag: String },
    #[error("$SLUICE_CKPT_DIR/{tag}: {source}")]
    Unusable {
        tag: String,
        #[source]
        source: SafeFsError,
    },
    #[error("$SLUICE_CKPT_DIR/{tag}: {errno}")]
    Stat { tag: String, errno: Errno },
    #[error("$SLUICE_CKPT_DIR/{tag} is not owned by the job's user")]
    NotOwned { tag: String },
    #[error("the job's checkpoint directory: {0}")]
    NoCkptDir(#[source] SafeFsError),
    #[error(
        "checkpoint {tag} is already archived (or waiting for the job's other nodes); archives are immutable — save the new state under a new tag"
    )]
    Immutable { tag: String },
    #[error("job {0} has ended")]
    JobEnded(u32),
}

/// One committed checkpoint.
#[derive(Debug)]
pub struct CkptEntry {
    pub tag: String,
    pub committed_at: u64,
    state: Mutex<CkptState>,
    archived_at: Mutex<Option<u64>>,
    error: Mutex<Option<String>>,
    on_hot: AtomicBool,
    /// Its copy on the RAM tier is there (`--ckpt-tier=ram`).
    in_ram: AtomicBool,
    /// Flushed from the RAM tier, and the hot tier's copy not verified yet: the BLAKE3 of each file
    /// as the flush read it from RAM. The RAM copy stays until the copy is verified against these
    /// (by the archive's upload, or a read-back where no archive reads it).
    flush_hashes: Mutex<Option<Arc<FlushHashes>>>,
    /// Bumped by every (re-)commit: an archive attempt of an older generation is discarded.
    generation: AtomicU64,
    files: AtomicU64,
    raw_bytes: AtomicU64,
    stored_bytes: AtomicU64,
    bytes_done: AtomicU64,
    /// Attempts since the last success, for backoff.
    failures: AtomicU64,
    /// Refused by the archive (a symlink, a hard link, a foreign file): not a checkpoint sluice will
    /// keep; deleted with the job's uncommitted directories when the job ends.
    refused: AtomicBool,
    /// Committed on the RAM tier and gone with it before it was flushed: what the user is told.
    lost: Mutex<Option<String>>,
    /// Marked bad (`sluice ckpt poison`): never the last good checkpoint retention keeps.
    poisoned: AtomicBool,
    /// This node's part on other nodes of the job (`[fast_tier] replicas`).
    replication: Mutex<Replication>,
    /// Committed by a restore from replicas: the paths of this node's own part as it was sealed
    /// before (the copy holds every node's files). Its replicas are of those alone, so that the
    /// holders that kept them are sealed again as they are, not sent the whole checkpoint.
    own_part: Mutex<Option<Arc<BTreeSet<String>>>>,
}

/// Where this node's part of a checkpoint is replicated, and what to replicate it from.
#[derive(Debug, Default)]
pub struct Replication {
    /// The hashes of the part's files as its flush read them from RAM, kept for the replicas
    /// (the flush's own go once the hot tier's copy verifies): set by the flush, dropped once the
    /// replicas are sealed or the checkpoint is archived. Of the generation below.
    pub source: Option<Arc<FlushHashes>>,
    /// The commit's generation the holders hold.
    pub generation: u64,
    /// The nodes whose agents sealed a replica, in placement order.
    pub holders: Vec<String>,
    /// Why fewer than asked hold one, while they do.
    pub short: Option<String>,
    /// The holders were told to free it (the archive holds the checkpoint).
    pub freed: bool,
    /// Every node's part of the checkpoint is held by as many other nodes as the job asks.
    pub protected: bool,
    /// This node's part as it was sealed (its files with the flush's BLAKE3, the job's nodes,
    /// the commit's time), once built: what this node serves of its own copy to a restore from
    /// replicas ([`crate::ckpt::NodeReplicas`]). Journaled, so that a restarted agent or a
    /// requeue still serves it. Of the generation above.
    pub part: Option<Arc<sluice_peer::ReplicaSeal>>,
    /// `source` is the seal's, not a flush's: the part is placed again after a restart (a holder
    /// was lost with its node), with only its sealed files, whatever else the copy holds now (a
    /// restore put the other nodes' files beside them).
    pub from_seal: bool,
}

impl CkptEntry {
    pub fn new(tag: &str, committed_at: u64) -> CkptEntry {
        CkptEntry {
            tag: tag.to_string(),
            committed_at,
            state: Mutex::new(CkptState::Committed),
            archived_at: Mutex::new(None),
            error: Mutex::new(None),
            on_hot: AtomicBool::new(true),
            in_ram: AtomicBool::new(false),
            flush_hashes: Mutex::new(None),
            generation: AtomicU64::new(1),
            files: AtomicU64::new(0),
            raw_bytes: AtomicU64::new(0),
            stored_bytes: AtomicU64::new(0),
            bytes_done: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            refused: AtomicBool::new(false),
            lost: Mutex::new(None),
            poisoned: AtomicBool::new(false),
            replication: Mutex::new(Replication::default()),
            own_part: Mutex::new(None),
        }
    }

    /// Its part for replicas is `paths` of the copy (a restore from replicas), or the whole copy.
    pub fn set_own_part(&self, paths: Option<Arc<BTreeSet<String>>>) {
        *lock(&self.own_part) = paths;
    }

    /// Its replication state, to read or change (the checkpoint worker's).
    pub fn replication(&self) -> std::sync::MutexGuard<'_, Replication> {
        lock(&self.replication)
    }

    /// Marked bad: retention does not count it among the checkpoints it keeps.
    pub fn set_poisoned(&self) {
        self.poisoned.store(true, Ordering::Relaxed);
    }

    pub fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::Relaxed)
    }

    pub fn state(&self) -> CkptState {
        *lock(&self.state)
    }

    pub fn set_state(&self, state: CkptState) {
        *lock(&self.state) = state;
        if matches!(
            state,
            CkptState::Archived | CkptState::WaitingForNodes | CkptState::Archiving
        ) {
            *lock(&self.error) = None;
        }
    }

    pub fn set_error(&self, state: CkptState, message: String) {
        *lock(&self.state) = state;
        *lock(&self.error) = Some(message);
    }

    /// A failed attempt (archive, publish): counts towards backoff and the modified-retry limit.
    pub fn note_failure(&self) {
        self.failures.fetch_add(1, Ordering::Relaxed);
    }

    /// Attempts since the last success.
    pub fn failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
    }

    /// Refused for its content or its owner: no automatic retry, not kept after the job, until the
    /// user commits it again. `message` is what `sluice ckpt list` shows.
    pub fn refuse(&self, message: String) {
        self.failures
            .store(MAX_MODIFIED_RETRIES + 1, Ordering::Relaxed);
        self.refused.store(true, Ordering::Relaxed);
        self.set_error(CkptState::Modified, message);
    }

    /// The archive holds this tag with other content: it stays here, unarchived and never
    /// trimmed, and is not retried (`message` says what to do).
    pub fn conflict(&self, message: String) {
        self.set_error(CkptState::Refused, message);
    }

    /// Some node of the job never sent its part: kept here unarchived (never trimmed) until the
    /// user commits it again; `message` names the nodes.
    pub fn incomplete(&self, message: String) {
        self.set_error(CkptState::Incomplete, message);
    }

    /// Its only copy, on the RAM tier, is gone: nothing of it is left (`message` says so in
    /// `sluice ckpt list`, `sluice status` and the job's end summary).
    pub fn lose(&self, message: String) {
        *lock(&self.lost) = Some(message.clone());
        self.in_ram.store(false, Ordering::Relaxed);
        self.conflict(message);
    }

    pub fn is_lost(&self) -> bool {
        lock(&self.lost).is_some()
    }

    /// What [`Self::lose`] said, for the journal.
    pub fn lost(&self) -> Option<String> {
        lock(&self.lost).clone()
    }

    pub fn is_refused(&self) -> bool {
        self.refused.load(Ordering::Relaxed)
    }

    /// sluice will not archive it by itself: the user has to act (the job output says so).
    pub fn action_needed(&self) -> bool {
        match self.state() {
            CkptState::Refused | CkptState::Incomplete => true,
            CkptState::Modified => self.is_refused() || !self.retries_modified(),
            _ => false,
        }
    }

    /// Files changed while they were read: retried a few times, then it waits for a new commit.
    pub fn retries_modified(&self) -> bool {
        self.state() == CkptState::Modified && self.failures() <= MAX_MODIFIED_RETRIES
    }

    /// What was archived (or restored): files and their raw and stored sizes.
    pub fn set_sizes(&self, files: u64, raw_bytes: u64, stored_bytes: u64) {
        self.files.store(files, Ordering::Relaxed);
        self.raw_bytes.store(raw_bytes, Ordering::Relaxed);
        self.stored_bytes.store(stored_bytes, Ordering::Relaxed);
    }

    pub fn set_bytes_done(&self, bytes: u64) {
        self.bytes_done.store(bytes, Ordering::Relaxed);
    }

    pub fn set_archived(&self, at: u64) {
        *lock(&self.archived_at) = Some(at);
        self.failures.store(0, Ordering::Relaxed);
        self.set_state(CkptState::Archived);
    }

    pub fn archived_at(&self) -> Option<u64> {
        *lock(&self.archived_at)
    }

    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    pub fn on_hot(&self) -> bool {
        self.on_hot.load(Ordering::Relaxed)
    }

    pub fn set_on_hot(&self, v: bool) {
        self.on_hot.store(v, Ordering::Relaxed);
    }

    pub fn in_ram(&self) -> bool {
        self.in_ram.load(Ordering::Relaxed)
    }

    pub fn set_in_ram(&self, v: bool) {
        self.in_ram.store(v, Ordering::Relaxed);
    }

    /// Its flush from the RAM tier is durable: on the hot tier, to be archived, and to be verified
    /// against `hashes` (what the flush read) before its RAM copy may go.
    pub fn set_flushed(&self, hashes: FlushHashes) {
        self.on_hot.store(true, Ordering::Relaxed);
        self.failures.store(0, Ordering::Relaxed);
        let hashes = Arc::new(hashes);
        self.set_replica_source(&hashes);
        *lock(&self.flush_hashes) = Some(hashes);
        *lock(&self.state) = CkptState::Committed;
        *lock(&self.error) = None;
    }

    /// A hot-tier checkpoint's files were hashed for its replicas (it has no flush, whose hashes
    /// a RAM-tier one's replicas are checked against): this commit's part is placed from them.
    pub fn set_hashed(&self, hashes: FlushHashes) {
        self.set_replica_source(&Arc::new(hashes));
    }

    /// A hot-tier checkpoint's files could not be hashed for its replicas (`why`, shown in
    /// `sluice ckpt list`): not replicated, and not hashed again until it is committed again.
    pub fn hash_failed(&self, why: String) {
        *lock(&self.replication) = Replication {
            generation: self.generation(),
            short: Some(why),
            ..Replication::default()
        };
    }

    /// Whether a hot-tier checkpoint's files are to be hashed for its replicas: not since this
    /// commit (a new commit, or one the agent took back from its journal before it was sealed).
    pub fn needs_hashing(&self) -> bool {
        let r = lock(&self.replication);
        r.source.is_none()
            && !r.freed
            && (r.generation != self.generation() || r.part.is_none() && r.short.is_none())
    }

    /// The files (of this node's own part, [`Self::set_own_part`]) that this commit's replicas
    /// are of, with what they hash to.
    fn set_replica_source(&self, hashes: &Arc<FlushHashes>) {
        let own = lock(&self.own_part).clone();
        let source = match &own {
            Some(paths) => Arc::new(
                hashes
                    .iter()
                    .filter(|(p, _)| paths.contains(*p))
                    .map(|(p, h)| (p.clone(), *h))
                    .collect(),
            ),
            None => hashes.clone(),
        };
        *lock(&self.replication) = Replication {
            source: Some(source),
            generation: self.generation(),
            from_seal: own.is_some(),
            ..Replication::default()
        };
    }

    /// What the flush read, while the hot tier's copy is not verified yet.
    pub fn flush_hashes(&self) -> Option<Arc<FlushHashes>> {
        lock(&self.flush_hashes).clone()
    }

    /// Restores the hashes of a flush not verified yet (an agent restarted in between).
    pub fn set_flush_hashes(&self, hashes: Option<FlushHashes>) {
        *lock(&self.flush_hashes) = hashes.map(Arc::new);
    }

    /// The hot tier's copy hashes as the flush read it: its RAM copy may go now.
    pub fn set_verified(&self) {
        *lock(&self.flush_hashes) = None;
    }

    /// The hot tier's copy is not what was flushed: flushed again from RAM (still there), with
    /// `message` in `sluice ckpt list` until then.
    pub fn reflush(&self, message: String) {
        self.on_hot.store(false, Ordering::Relaxed);
        *lock(&self.flush_hashes) = None;
        self.set_error(CkptState::Committed, message);
    }

    /// Flushed, and the copy not verified yet: its RAM copy must stay.
    pub fn awaits_verify(&self) -> bool {
        self.in_ram() && self.on_hot() && lock(&self.flush_hashes).is_some()
    }

    /// Committed on the RAM tier and not yet flushed to the hot tier.
    pub fn needs_flush(&self) -> bool {
        self.in_ram()
            && !self.on_hot()
            && !self.is_refused()
            && (matches!(self.state(), CkptState::Committed | CkptState::Retrying)
                || self.retries_modified())
    }

    /// Needs (another) upload attempt from this node (from the hot tier: flushed first).
    pub fn needs_upload(&self) -> bool {
        self.on_hot()
            && matches!(
                self.state(),
                CkptState::Committed | CkptState::Archiving | CkptState::Retrying
            )
    }

    /// What `sluice ckpt list` says of its replicas when the job asked for `wanted` (0: none).
    fn replica_status(&self, wanted: u8) -> Option<ReplicaStatus> {
        (wanted > 0).then(|| {
            let r = lock(&self.replication);
            ReplicaStatus {
                wanted,
                held_by: r.holders.clone(),
                short: r.short.clone(),
                freed: r.freed,
                protected: r.protected,
            }
        })
    }

    pub fn status(&self, archive_url: &str, replicas: u8) -> CkptStatus {
        CkptStatus {
            tag: self.tag.clone(),
            state: self.state(),
            on_hot_tier: self.on_hot(),
            in_ram: self.in_ram(),
            archive_url: archive_url.to_string(),
            files: self.files.load(Ordering::Relaxed),
            raw_bytes: self.raw_bytes.load(Ordering::Relaxed),
            stored_bytes: self.stored_bytes.load(Ordering::Relaxed),
            bytes_done: self.bytes_done.load(Ordering::Relaxed),
            committed_at: self.committed_at,
            archived_at: self.archived_at(),
            error: lock(&self.error).clone(),
            action_needed: self.action_needed(),
            replicas: self.replica_status(replicas),
        }
    }
}

/// A job's checkpoints on this node.
#[derive(Debug, Default)]
pub struct JobCkpts {
    entries: Mutex<BTreeMap<String, Arc<CkptEntry>>>,
    /// Tags other nodes of the job said they committed (commit notices on the peer port), for the
    /// worker to commit here too.
    elsewhere: Mutex<std::collections::BTreeSet<String>>,
    /// Wakes the job's checkpoint worker (a commit arrived, the job ended).
    pub wake: tokio::sync::Notify,
}

/// What a commit request did.
#[derive(Debug, PartialEq, Eq)]
pub enum CommitOutcome {
    New,
    /// Committed again after files changed during its archive (or after it was given up as
    /// incomplete): archived anew.
    Recommitted,
    /// Already committed and not yet archived: nothing to do.
    AlreadyPending,
}

impl JobCkpts {
    /// Another node of the job committed `tag`: the worker commits this node's files of it.
    pub fn committed_elsewhere(&self, tag: &str) {
        lock(&self.elsewhere).insert(tag.to_string());
        self.wake.notify_one();
    }

    /// The tags other nodes committed since the last call.
    pub fn take_committed_elsewhere(&self) -> Vec<String> {
        std::mem::take(&mut *lock(&self.elsewhere))
            .into_iter()
            .collect()
    }

    pub fn entries(&self) -> Vec<Arc<CkptEntry>> {
        let mut v: Vec<_> = lock(&self.entries).values().cloned().collect();
        v.sort_by(|a, b| (a.committed_at, &a.tag).cmp(&(b.committed_at, &b.tag)));
        v
    }

    pub fn get(&self, tag: &str) -> Option<Arc<CkptEntry>> {
        lock(&self.entries).get(tag).cloned()
    }

    pub fn insert(&self, entry: Arc<CkptEntry>) {
        lock(&self.entries).insert(entry.tag.clone(), entry);
    }

    /// Records a commit of `tag`. An already archived tag is refused: archives are immutable, so a
    /// changed checkpoint needs a new tag. A lost one (nothing of it is left anywhere) is saved
    /// anew under its tag.
    pub fn commit(&self, tag: &str, now: u64) -> Result<CommitOutcome, CommitError> {
        let mut entries = lock(&self.entries);
        match entries.get(tag) {
            None => {
                entries.insert(tag.to_string(), Arc::new(CkptEntry::new(tag, now)));
                Ok(CommitOutcome::New)
            }
            Some(e) if e.is_lost() => {
                entries.insert(tag.to_string(), Arc::new(CkptEntry::new(tag, now)));
                Ok(CommitOutcome::New)
            }
            Some(e) => match e.state() {
                CkptState::Modified | CkptState::Incomplete => {
                    e.generation.fetch_add(1, Ordering::Relaxed);
                    e.failures.store(0, Ordering::Relaxed);
                    e.refused.store(false, Ordering::Relaxed);
                    e.set_state(CkptState::Committed);
                    Ok(CommitOutcome::Recommitted)
                }
                CkptState::Archived | CkptState::WaitingForNodes | CkptState::Refused => {
                    Err(CommitError::Immutable {
                        tag: tag.to_string(),
                    })
                }
                _ => Ok(CommitOutcome::AlreadyPending),
            },
        }
    }

    /// Any checkpoint that still needs work from this node (upload, or waiting for other nodes).
    pub fn pending(&self) -> bool {
        lock(&self.entries).values().any(|e| {
            !matches!(
                e.state(),
                CkptState::Archived
                    | CkptState::Modified
                    | CkptState::Refused
                    | CkptState::Incomplete
            )
        })
    }

    /// Checkpoints whose RAM-tier copy may go now: safe on the hot tier (flushed and verified),
    /// all but the newest good one (a poisoned checkpoint is no reason to keep a copy in RAM, and
    /// the newest good one below it keeps its copy).
    pub fn ram_to_free(&self) -> Vec<Arc<CkptEntry>> {
        let entries = self.entries();
        let keep = entries
            .iter()
            .rev()
            .find(|e| !e.is_poisoned())
            .map(|e| e.tag.clone());
        entries
            .into_iter()
            .filter(|e| e.in_ram() && e.on_hot() && !e.awaits_verify())
            .filter(|e| keep.as_deref() != Some(e.tag.as_str()))
            .collect()
    }

    /// Tags retention removes now: archived ones on the hot tier beyond the newest `keep` good
    /// ones. A poisoned checkpoint is never one of those (the newest good one stays, however many
    /// poisoned ones follow it), and goes once archived: the archive keeps it for a forced restore.
    pub fn to_trim(&self, keep: u32) -> Vec<Arc<CkptEntry>> {
        let archived: Vec<_> = self
            .entries()
            .into_iter()
            .filter(|e| e.state() == CkptState::Archived && e.on_hot())
            .collect();
        let good = archived.iter().filter(|e| !e.is_poisoned()).count();
        let mut excess = good.saturating_sub(keep.max(1) as usize);
        archived
            .into_iter()
            .filter(|e| {
                if e.is_poisoned() {
                    return true;
                }
                let trim = excess > 0;
                excess = excess.saturating_sub(1);
                trim
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The RAM tier keeps the newest good checkpoint: a poisoned newer one goes once it is safe
    /// on the hot tier, and one not verified there yet stays.
    #[test]
    fn the_ram_tier_keeps_the_newest_good_checkpoint() {
        let c = JobCkpts::default();
        for (i, t) in ["a", "b", "c", "d"].iter().enumerate() {
            c.commit(t, i as u64).unwrap();
            let e = c.get(t).unwrap();
            e.set_in_ram(true);
            e.set_on_hot(true);
        }
        let freed = || {
            c.ram_to_free()
                .iter()
                .map(|e| e.tag.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(freed(), ["a", "b", "c"]);
        c.get("d").unwrap().set_poisoned();
        c.get("c").unwrap().set_poisoned();
        assert_eq!(freed(), ["a", "c", "d"], "b is the newest good one");
        c.get("a").unwrap().set_poisoned();
        c.get("b").unwrap().set_poisoned();
        assert_eq!(freed(), ["a", "b", "c", "d"], "nothing good to keep");
        c.get("a")
            .unwrap()
            .set_flush_hashes(Some(FlushHashes::default()));
        assert_eq!(
            freed(),
            ["b", "c", "d"],
            "a is not verified on the hot tier"
        );
    }

    /// A hot-tier checkpoint is hashed for its replicas once per commit: again after an agent
    /// restart that lost the hashes before a seal, not again after a failure until it is
    /// committed again.
    #[test]
    fn a_hot_tier_checkpoint_is_hashed_once_per_commit() {
        let c = JobCkpts::default();
        c.commit("s1", 1).unwrap();
        let e = c.get("s1").unwrap();
        assert!(e.needs_hashing(), "a new commit");
        e.set_hashed(FlushHashes::default());
        assert!(!e.needs_hashing(), "hashed: placed from the hashes");
        e.hash_failed("its files could not be read: a link".into());
        assert!(!e.needs_hashing(), "a failure waits for the next commit");
        assert_eq!(
            e.replication().short.as_deref(),
            Some("its files could not be read: a link")
        );
        e.set_state(CkptState::Modified);
        assert_eq!(c.commit("s1", 2).unwrap(), CommitOutcome::Recommitted);
        assert!(e.needs_hashing(), "committed again");
    }

    #[test]
    fn commit_and_retention_rules() {
        let c = JobCkpts::default();
        for (i, t) in ["a", "b", "c"].iter().enumerate() {
            assert_eq!(c.commit(t, i as u64).unwrap(), CommitOutcome::New);
        }
        assert_eq!(c.commit("a", 9).unwrap(), CommitOutcome::AlreadyPending);
        assert!(
            c.to_trim(1).is_empty(),
            "nothing is archived yet: nothing may be trimmed"
        );
        c.get("a").unwrap().set_archived(10);
        c.get("b").unwrap().set_archived(11);
        // c is not archived: with keep=1 only a goes (b is the newest archived).
        assert_eq!(
            c.to_trim(1)
                .iter()
                .map(|e| e.tag.clone())
                .collect::<Vec<_>>(),
            vec!["a"]
        );
        assert!(c.to_trim(2).is_empty());
        assert!(
            c.commit("b", 12)
                .unwrap_err()
                .to_string()
                .contains("immutable")
        );
        c.get("c")
            .unwrap()
            .set_error(CkptState::Modified, "changed".into());
        assert_eq!(c.commit("c", 13).unwrap(), CommitOutcome::Recommitted);
        assert_eq!(c.get("c").unwrap().generation(), 2);
        assert!(c.pending());
        // A poisoned checkpoint is not the last good one: with keep=1, b (good) stays, c
        // (newer, poisoned) goes once archived.
        c.get("c").unwrap().set_archived(16);
        c.get("c").unwrap().set_poisoned();
        let trimmed = |k| {
            c.to_trim(k)
                .iter()
                .map(|e| e.tag.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(trimmed(1), ["a", "c"]);
        assert_eq!(trimmed(2), ["c"]);
        c.get("c").unwrap().set_state(CkptState::Committed);
        // A lost checkpoint left nothing anywhere: its tag takes a new save.
        c.commit("d", 14).unwrap();
        c.get("d").unwrap().lose("LOST".into());
        assert_eq!(c.commit("d", 15).unwrap(), CommitOutcome::New);
        assert!(!c.get("d").unwrap().is_lost());
    }
}
