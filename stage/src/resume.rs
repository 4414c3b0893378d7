//! Resuming a job's staging after the agent restarts (issue 11 item 6).
//!
//! Without this, an agent killed while a job's datasets were being staged stages them again from
//! the origin, every byte, when it comes back. With it, each dataset keeps a log of the files it
//! staged whole, and a restarted agent keeps those files instead of reading them again; a file
//! the log does not name, or names for another object version, another source file version or
//! another file than the one now at its path, is read again. Object-store datasets
//! ([`super::object`]) and POSIX datasets the copy helper copies whole ([`super::posix`]: alone
//! on a node without a cache, or a shard) resume so.
//!
//! # Where "file F is complete" is recorded, and why there
//!
//! In root's state directory, one log per dataset of the job:
//! `<state_dir>/staging/<job>/<hash of NAME and URL>.log`, JSON lines:
//!
//! ```text
//! {"format":"sluice-stage-resume","version":1,"job":..,"name":..,"source":..,"boot_id":..}
//! {"path":"NAME/a/b.bin","location":"ds/a/b.bin","e_tag":..,"version":..,"size":..,"file":{"ino":..,"size":..,"mtime_ns":..,"ctime_ns":..}}
//! {"path":"NAME/a/c.bin","source":{"dev":..,"ino":..,"size":..,"mtime":..,"mtime_ns":..,"ctime":..,"ctime_ns":..},"file":{..}}
//! ```
//!
//! A line names a staged file (its path below `$SLUICE_STAGE_DIR`), what it was copied from, and
//! the file as it was once its last byte was written: inode, size, mtime and ctime. Not an
//! extended attribute on the staged file: the job user owns that file and may rewrite it while
//! the attribute (which they cannot touch) stays, so an attribute would have to carry the same
//! identity anyway — and it could not, since setting it changes the ctime it would hold. The log
//! is root's alone, next to the journal.
//!
//! What it was copied from:
//! - an object: its key, the ETag and version id the listing gave, its size. The agent read it
//!   and wrote the file itself, and takes the file's identity from an fstat of its own
//!   descriptor.
//! - a POSIX file: its device, inode, size, mtime and ctime (the identity the cache keys POSIX
//!   files by, [`crate::cache`]). The copy helper reads POSIX sources as the job user, so that a user stages
//!   only what they can read; it cannot write root's log, and must not be able to. So the helper
//!   reports each file it copied whole (`whole` lines, [`super::copy_as_user::copy_tree_resumable`])
//!   with its source's identity from an fstat of the descriptor it read, the same before and
//!   after every piece; the agent then opens the staged file itself (fd-relative, no link
//!   followed, a one-link regular file of the job user) and writes the line with the identity it
//!   finds. The source's part is the helper's word — the job user's — and so only ever decides
//!   about that user's own copy; the staged file's part is the agent's own observation.
//!
//! A restarted agent keeps a file only when all of these hold ([`DatasetLog::take`],
//! [`Entry::describes`], [`resumable`]):
//! - the log is from this boot of the node (`boot_id`) and for this job, dataset name and URL;
//! - the origin lists the object now with the recorded ETag, version id and size; or, for a POSIX
//!   file, the helper of the restarted agent, as the job user, opens the source now and finds the
//!   recorded device, inode, size, mtime and ctime (the agent offers it the file, `keep` lines,
//!   and the helper reports how many it kept; a source the user can no longer read fails as
//!   without resuming);
//! - the path, opened without following links, is a regular file of the job user with one link,
//!   and its inode, size, mtime and ctime are the recorded ones. The job user can change their
//!   file's content and mtime, but not its ctime: any write, truncation, `touch`, chmod, link or
//!   rename sets it to the current time. So a file the user changed after it was recorded is read
//!   again, whatever they did.
//!
//! Either way there is a moment between the last write and the fstat that the line records (for a
//! POSIX file, between the helper's report and the agent's fstat) in which the job user could
//! change their copy unseen; what they change there is their own job's copy, which they may change
//! at any time anyway, and it is trusted for nothing more (below).
//!
//! Why the boot id instead of an fsync of every staged file: the log is written as files
//! complete, in batches ([`SYNC_EVERY`] lines, or every [`SYNC_INTERVAL`]: one `write` each, so
//! 2,000 small objects cost about 32 writes), and never fsynced, and
//! neither are the staged files. Killing the agent loses nothing either wrote (the kernel's page
//! cache has it, and it is what a restarted agent reads); only a crash of the node could leave a
//! line whose file's bytes never reached the disk, and after one the boot id differs and the log
//! is ignored (Slurm has failed or requeued the node's jobs by then anyway). An fsync per staged
//! file would make every small-object dataset pay, for a case the boot id already excludes.
//! Losing lines costs re-reads, nothing more: the log is a hint that every restart checks again.
//!
//! # What a kept file is trusted for
//!
//! For the job's own copy: its user changing it affects only their job. Nothing more:
//! - it never fills the node's cross-job cache ([`crate::cache`]): a cache entry is only written
//!   from bytes read from the origin as they arrive, so a file a user could have changed between
//!   the kill and the restart (in the moment after its check) is never served to another job
//!   under the object's key;
//! - shared with the job's other nodes, its units are served with hashes computed by reading the
//!   file back now, unit by unit, never from the log, and only if the file is still the one noted
//!   once they are read ([`hash_kept`]); a peer checks the bytes it receives against them, as it
//!   checks an origin read's. But a read-back's hash is of whatever the job user left in their
//!   file (they could write it in the moments named above, or between the check and the read), so
//!   those units are served marked as read back ([`sluice_peer::HashFrom::ReadBack`], MAC'd): the
//!   job's other nodes write them into the job's copies and never into their cross-job caches, and
//!   pass the mark on with them. (Otherwise a user who rewrote a kept file at the right moment
//!   would plant bytes in other nodes' caches, served to every user's later jobs under the
//!   object's ETag.)
//!
//! Not resumed, staged again from the start: POSIX datasets shared with the job's peers or staged
//! through the node's cache (the agent writes parts of those files itself, and the helper's runs
//! there make the tree afresh); and staging into the shared tier, whose per-node completion marks
//! already let a restarted agent skip a share that was written.
//!
//! # After staging
//!
//! A restarted agent does not stage a job the journal says is staged (`ready`). Its files are
//! the job's, as they are; but the job's other nodes may still be staging, and would ask this
//! node for the units it owns. So the log stays until the job ends, and a restarted agent serves
//! the files it names that are still as noted, with hashes read back from them ([`serve_staged`]);
//! other units are "not mine", read from the origin by the node that asks.
//!
//! The log is removed when the job ends, and when a new run of the job id starts.

use super::copy_as_user::FileIdent;
use serde::{Deserialize, Serialize};
use sluice_core::durable::write_durable;
use sluice_core::safefs::Owner;
use sluice_proto::msg::JobId;
use sluice_proto::options::StageSpec;
use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use object_store::ObjectMeta;
use sluice_core::rt::{blocking, lock};

const FORMAT: &str = "sluice-stage-resume";
const LOG_VERSION: u32 = 1;
/// Lines kept in memory before they are written, at most.
pub(crate) const SYNC_EVERY: usize = 64;
/// The longest a completed file waits for its line to be written (while staging goes on).
pub(crate) const SYNC_INTERVAL: Duration = Duration::from_secs(1);

/// Where the staging logs of `job` are (root's agent state).
pub fn job_dir(state_dir: &Path, job: JobId) -> PathBuf {
    state_dir.join("staging").join(job.to_string())
}

/// Blocking. Removes the staging logs of `job` (it is staged, ended, or starts afresh).
pub fn forget(state_dir: &Path, job: JobId) -> std::io::Result<()> {
    match std::fs::remove_dir_all(job_dir(state_dir, job)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Blocking. Removes the staging logs of every job but `staging` (those a restarted agent still
/// stages); returns how many jobs' logs went.
pub fn prune(state_dir: &Path, staging: &HashSet<JobId>) -> usize {
    let Ok(entries) = std::fs::read_dir(state_dir.join("staging")) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let keep = e
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<JobId>().ok())
            .is_some_and(|id| staging.contains(&id));
        if !keep && std::fs::remove_dir_all(e.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// This boot of the node, as the kernel names it; `None` where it cannot be read (then no log is
/// ever trusted).
fn boot_id() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

/// One job's staging logs: what [`super::StageCtx::resume`] holds.
#[derive(Debug)]
pub struct JobResume {
    dir: PathBuf,
    job: JobId,
    /// The agent restarted while the job was staging: its stage directory holds what the run
    /// before staged, and the logs say which of it is whole.
    resuming: bool,
    boot_id: Option<String>,
}

impl JobResume {
    /// Blocking. The staging logs of `job`; unless `resuming`, those of an earlier run of the job
    /// id are removed.
    pub fn open(state_dir: &Path, job: JobId, resuming: bool) -> JobResume {
        if !resuming && let Err(e) = forget(state_dir, job) {
            tracing::warn!(job_id = job, "removing an earlier run's staging logs: {e}");
        }
        JobResume {
            dir: job_dir(state_dir, job),
            job,
            resuming,
            boot_id: boot_id(),
        }
    }

    /// Whether the stage directory holds what a run before the agent's restart left.
    pub(crate) fn resuming(&self) -> bool {
        self.resuming
    }

    fn header(&self, spec: &StageSpec) -> Header {
        Header {
            format: FORMAT.into(),
            version: LOG_VERSION,
            job: self.job,
            name: spec.name.clone(),
            source: spec.source.to_string(),
            boot_id: self.boot_id.clone(),
        }
    }

    /// Where the log of the dataset `header` names is.
    fn log_path(&self, header: &Header) -> PathBuf {
        let mut h = blake3::Hasher::new();
        for part in [header.name.as_str(), header.source.as_str()] {
            h.update(&(part.len() as u64).to_le_bytes());
            h.update(part.as_bytes());
        }
        self.dir
            .join(format!("{}.log", &h.finalize().to_hex()[..32]))
    }

    /// Blocking. The entries of `spec`'s log (of this boot, job and dataset), read without
    /// changing it: what a restarted agent serves of a job staged before ([`serve_staged`]).
    pub(crate) fn entries(&self, spec: &StageSpec) -> Vec<Entry> {
        let header = self.header(spec);
        if header.boot_id.is_none() {
            return Vec::new();
        }
        load(&self.log_path(&header), &header)
            .into_values()
            .collect()
    }

    /// Blocking. The log of `spec`'s dataset: the entries of the run before the restart (when
    /// resuming, and its log is for this boot, job and dataset), rewritten through the durable
    /// helper, then open to append to. `None` when the log cannot be written (staging goes on
    /// without one: a later restart reads everything again).
    pub(crate) fn dataset(&self, spec: &StageSpec) -> Option<DatasetLog> {
        let header = self.header(spec);
        let path = self.log_path(&header);
        let earlier = if self.resuming && header.boot_id.is_some() {
            load(&path, &header)
        } else {
            HashMap::new()
        };
        let opened = (|| {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&self.dir)?;
            let mut text = serde_json::to_vec(&header).expect("a header serialises");
            text.push(b'\n');
            for e in earlier.values() {
                serde_json::to_writer(&mut text, e).expect("an entry serialises");
                text.push(b'\n');
            }
            write_durable(&path, &text)?;
            std::fs::OpenOptions::new()
                .append(true)
                .mode(0o600)
                .open(&path)
        })();
        match opened {
            Ok(file) => Some(DatasetLog {
                earlier: Mutex::new(earlier),
                out: Mutex::new(Out {
                    file,
                    buf: Vec::new(),
                    lines: 0,
                    since: Instant::now(),
                }),
                path,
                writes: Default::default(),
            }),
            Err(e) => {
                tracing::warn!(
                    path = %path.display(),
                    "cannot write the staging log ({e}); an agent restart would stage {} again from the start",
                    spec.source
                );
                None
            }
        }
    }
}

/// Blocking. The entries of the log at `path` by staged path (the last line of a path wins), if
/// its header is `header`; lines that do not parse (a torn last line) are skipped.
fn load(path: &Path, header: &Header) -> HashMap<String, Entry> {
    let text = match std::fs::read(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return HashMap::new(),
        Err(e) => {
            tracing::warn!(path = %path.display(), "cannot read the staging log ({e}); staging every file again");
            return HashMap::new();
        }
    };
    let mut lines = text.split(|b| *b == b'\n');
    let head = lines
        .next()
        .and_then(|l| serde_json::from_slice::<Header>(l).ok());
    if head.as_ref() != Some(header) {
        tracing::info!(
            path = %path.display(),
            "discarding a staging log of another boot, run or dataset"
        );
        return HashMap::new();
    }
    lines
        .filter_map(|l| serde_json::from_slice::<Entry>(l).ok())
        .map(|e| (e.path.clone(), e))
        .collect()
}

/// What every line of a log depends on: a log with another header is discarded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Header {
    format: String,
    version: u32,
    job: JobId,
    name: String,
    source: String,
    /// The boot the lines were written in: only then are the files they name as written.
    boot_id: Option<String>,
}

/// One version of a staged file (inode, size, mtime, ctime): the job user can change the content
/// and the mtime, not the ctime — any change to the file sets it to now.
pub(crate) use sluice_archive::FileIdentity as Identity;

/// A log line: the staged file `path` (below the stage directory) was written whole from `of`,
/// and was then `file`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Entry {
    path: String,
    #[serde(flatten)]
    of: Of,
    file: Identity,
}

/// What a staged file was copied from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
enum Of {
    /// The object listed as (`location`, `e_tag`, `version`, `size`).
    Object {
        location: String,
        e_tag: Option<String>,
        version: Option<String>,
        size: u64,
    },
    /// The POSIX source file the copy helper read, as the job user, with this identity (device,
    /// inode, size, mtime, ctime) before and after every piece of the copy.
    Posix { source: FileIdent },
}

impl Entry {
    pub(crate) fn new(path: String, meta: &ObjectMeta, file: Identity) -> Entry {
        Entry {
            path,
            of: Of::Object {
                location: meta.location.to_string(),
                e_tag: meta.e_tag.clone(),
                version: meta.version.clone(),
                size: meta.size,
            },
            file,
        }
    }

    /// A file the copy helper copied whole from a POSIX `source` of that identity.
    pub(crate) fn posix(path: String, source: FileIdent, file: Identity) -> Entry {
        Entry {
            path,
            of: Of::Posix { source },
            file,
        }
    }

    /// The staged file's path below the stage directory.
    pub(crate) fn path(&self) -> &str {
        &self.path
    }

    /// The name its units go by among the job's nodes, as [`super::object`] names an object's
    /// units: its path and the version listed (the ETag, else the version id). `None` for a POSIX
    /// file: datasets the helper copies whole are not shared through peers.
    pub(crate) fn unit_file(&self) -> Option<String> {
        match &self.of {
            Of::Object { e_tag, version, .. } => Some(sluice_peer::versioned(
                &self.path,
                e_tag.as_deref().or(version.as_deref()),
            )),
            Of::Posix { .. } => None,
        }
    }

    /// The POSIX source file's identity when this file was copied from it.
    pub(crate) fn posix_source(&self) -> Option<FileIdent> {
        match &self.of {
            Of::Posix { source } if source.size == self.file.size => Some(*source),
            _ => None,
        }
    }

    /// The origin lists the object now as it was when this file was staged: same key, same
    /// version (ETag and version id; an object listed with neither is never kept, since nothing
    /// would tell an overwrite of the same size), same size.
    pub(crate) fn describes(&self, meta: &ObjectMeta) -> bool {
        let Of::Object {
            location,
            e_tag,
            version,
            size,
        } = &self.of
        else {
            return false;
        };
        (meta.e_tag.is_some() || meta.version.is_some())
            && *location == meta.location.as_ref()
            && *e_tag == meta.e_tag
            && *version == meta.version
            && *size == meta.size
            && self.file.size == meta.size
    }
}

struct Out {
    file: std::fs::File,
    /// Lines not written yet.
    buf: Vec<u8>,
    lines: usize,
    since: Instant,
}

/// The staging log of one dataset, shared by its download tasks.
pub(crate) struct DatasetLog {
    path: PathBuf,
    /// Entries of the run before the restart not looked at yet.
    earlier: Mutex<HashMap<String, Entry>>,
    out: Mutex<Out>,
    /// Writes to the log file since it was opened (batches of lines).
    pub(crate) writes: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for DatasetLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DatasetLog")
            .field("path", &self.path)
            .finish()
    }
}

impl DatasetLog {
    /// The run before the restart's entry for the staged file `path`, if any (each is handed out
    /// once).
    pub(crate) fn take(&self, path: &str) -> Option<Entry> {
        lock(&self.earlier).remove(path)
    }

    /// The entries of the run before the restart that no listed object asked for: files of
    /// objects the origin no longer lists.
    pub(crate) fn leftovers(&self) -> Vec<Entry> {
        std::mem::take(&mut *lock(&self.earlier))
            .into_values()
            .collect()
    }

    /// Notes that a file is staged whole. The line is written with the next batch.
    pub(crate) async fn done(&self, entry: Entry) {
        let batch = {
            let mut out = lock(&self.out);
            serde_json::to_writer(&mut out.buf, &entry).expect("an entry serialises");
            out.buf.push(b'\n');
            out.lines += 1;
            (out.lines >= SYNC_EVERY || out.since.elapsed() >= SYNC_INTERVAL)
                .then(|| take_batch(&mut out))
        };
        if let Some(batch) = batch {
            self.write(batch).await;
        }
    }

    /// Writes the lines waiting for a batch every [`SYNC_INTERVAL`] while the log is in use, so a
    /// line waits no longer than that even when no other file completes (a slow origin).
    pub(crate) fn tick(self: &Arc<Self>) {
        let log = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(SYNC_INTERVAL).await;
                let Some(log) = log.upgrade() else { return };
                log.finish().await;
            }
        });
    }

    /// Writes the lines not written yet (the dataset is staged).
    pub(crate) async fn finish(&self) {
        let batch = take_batch(&mut lock(&self.out));
        if !batch.is_empty() {
            self.write(batch).await;
        }
    }

    async fn write(&self, batch: Vec<u8>) {
        let file = match lock(&self.out).file.try_clone() {
            Ok(f) => f,
            Err(e) => return self.lost(&e),
        };
        // One write of whole lines to a file opened O_APPEND: batches never interleave.
        if let Err(e) = blocking(move || (&file).write_all(&batch)).await {
            self.lost(&e);
        }
        self.writes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    fn lost(&self, e: &std::io::Error) {
        tracing::warn!(
            path = %self.path.display(),
            "writing the staging log failed ({e}); an agent restart would stage those files again"
        );
    }
}

fn take_batch(out: &mut Out) -> Vec<u8> {
    out.lines = 0;
    out.since = Instant::now();
    std::mem::take(&mut out.buf)
}

/// Blocking. The staged file `rel` below `root`, opened for reading, when it is the file `entry`
/// recorded: opened without following links, a regular file of `owner` with one link (see
/// [`super::peers::open_staged`]), with the recorded inode, size, mtime and ctime.
pub(crate) fn resumable(
    root: &OwnedFd,
    rel: &str,
    owner: Owner,
    entry: &Entry,
) -> Option<std::fs::File> {
    let file = super::peers::open_staged(root, rel, owner).ok()?;
    (Identity::of(&file).ok()? == entry.file).then_some(file)
}

/// After an agent restart, a job that had finished staging on this node and still runs: the
/// job's other nodes may still be staging (each node's set-up waits for nobody), and ask this node
/// for the units it owns. Offers `peers` every file that `specs`' staging logs name and that is
/// still the file noted ([`resumable`]: the job user may have changed their copy since), each unit
/// with the hash of the file read back now ([`hash_kept`]: still the file noted after the read),
/// never a hash from the log, and marked as read back; returns the files and bytes offered. The caller then closes `peers`: a unit of any other file is
/// answered "not mine", and the asking node reads it from the origin.
///
/// Only object-store datasets: their log names every file staged, by its object version. A POSIX
/// dataset shared through peers keeps no log (the agent writes part of each file itself), so its
/// units are read from the origin by the job's other nodes once this node's agent restarted.
pub async fn serve_staged(
    peers: &super::JobPeers,
    resume: Arc<JobResume>,
    specs: Vec<StageSpec>,
    stage: Arc<OwnedFd>,
    owner: Owner,
) -> (u64, u64) {
    let entries = blocking(move || {
        specs
            .iter()
            .flat_map(|spec| resume.entries(spec))
            .collect::<Vec<_>>()
    })
    .await;
    let unit_size = peers.unit_size();
    let (mut files, mut bytes) = (0, 0);
    let mut buf = Vec::with_capacity(1 << 20);
    for entry in entries {
        let Some(unit_file) = entry.unit_file().filter(|_| entry.file.size > 0) else {
            continue;
        };
        let units = sluice_peer::units_of(&unit_file, entry.file.size, unit_size);
        let ranges: Vec<(u64, u64)> = units.iter().map(|u| (u.offset, u.len)).collect();
        let root = stage.clone();
        let (hashes, b) = blocking(move || {
            let hashes = hash_kept(&root, entry.path(), owner, &entry, &ranges, &mut buf);
            (hashes, buf)
        })
        .await;
        buf = b;
        let Some(hashes) = hashes else { continue };
        // Units name their file by its path below the stage directory: `stage` is their root.
        peers.add_object(stage.clone(), 0, &units);
        for (unit, hash) in units.iter().zip(hashes) {
            peers.held_from(unit, hash, sluice_peer::HashFrom::ReadBack);
        }
        files += 1;
        bytes += units.iter().map(|u| u.len).sum::<u64>();
    }
    (files, bytes)
}

/// Blocking. The BLAKE3 of each unit (`(offset, len)` pairs, in order) of the kept file `rel`
/// below `root`, read back now through `buf`, when it is the file `entry` recorded
/// ([`resumable`]) both before and after the read: a file its user wrote while it was hashed (any
/// write sets its ctime) is not kept, and is read from the origin again. Even so the hashes are
/// of a file the job user can write, and are served marked as such
/// ([`sluice_peer::HashFrom::ReadBack`]).
pub(crate) fn hash_kept(
    root: &OwnedFd,
    rel: &str,
    owner: Owner,
    entry: &Entry,
    units: &[(u64, u64)],
    buf: &mut Vec<u8>,
) -> Option<Vec<blake3::Hash>> {
    let file = resumable(root, rel, owner, entry)?;
    hash_unchanged(&file, entry, units, buf)
}

/// Blocking. The second half of [`hash_kept`]: the units' hashes of the opened `file`, when it is
/// still the file `entry` recorded after the read.
fn hash_unchanged(
    file: &std::fs::File,
    entry: &Entry,
    units: &[(u64, u64)],
    buf: &mut Vec<u8>,
) -> Option<Vec<blake3::Hash>> {
    let hashes = hash_units(file, units, buf).ok()?;
    (Identity::of(file).ok()? == entry.file).then_some(hashes)
}

/// Blocking. Each unit's BLAKE3 (`(offset, len)` pairs, in order), read back from `file` through
/// `buf`; an error if the file is shorter than the units.
pub(crate) fn hash_units(
    file: &std::fs::File,
    units: &[(u64, u64)],
    buf: &mut Vec<u8>,
) -> std::io::Result<Vec<blake3::Hash>> {
    let cap = buf.capacity().max(64 << 10);
    buf.resize(cap, 0);
    let hashes = units
        .iter()
        .map(|&(offset, len)| {
            let mut h = blake3::Hasher::new();
            let mut at = offset;
            while at < offset + len {
                let n = (offset + len - at).min(cap as u64) as usize;
                file.read_exact_at(&mut buf[..n], at)?;
                h.update(&buf[..n]);
                at += n as u64;
            }
            Ok(h.finalize())
        })
        .collect();
    buf.clear();
    hashes
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_proto::options::parse_stage_entry;

    fn meta(location: &str, e_tag: Option<&str>, size: u64) -> ObjectMeta {
        ObjectMeta {
            location: location.into(),
            last_modified: Default::default(),
            size,
            e_tag: e_tag.map(String::from),
            version: None,
        }
    }

    #[tokio::test]
    async fn a_log_is_read_back_by_the_next_run_of_the_same_boot_job_and_dataset_only() {
        let state = tempfile::tempdir().unwrap();
        let spec = parse_stage_entry("ds=s3://b/ds").unwrap();
        let id = Identity {
            ino: 1,
            size: 10,
            mtime_ns: 2,
            ctime_ns: 3,
        };
        let first = JobResume::open(state.path(), 7, false);
        let log = first.dataset(&spec).unwrap();
        for i in 0..SYNC_EVERY * 2 + 1 {
            let m = meta(&format!("ds/f{i}"), Some("e"), 10);
            log.done(Entry::new(format!("ds/f{i}"), &m, id)).await;
        }
        // Batched: two full batches written, the last line still in memory.
        assert_eq!(log.writes.load(std::sync::atomic::Ordering::Relaxed), 2);
        log.finish().await;
        // A torn line, as a kill in the middle of a write leaves.
        let path = log.path.clone();
        drop(log);
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        f.write_all(b"{\"path\":\"ds/torn\",\"loc").unwrap();

        let again = JobResume::open(state.path(), 7, true)
            .dataset(&spec)
            .unwrap();
        let e = again.take("ds/f3").unwrap();
        assert!(e.describes(&meta("ds/f3", Some("e"), 10)));
        assert!(!e.describes(&meta("ds/f3", Some("other"), 10)));
        assert!(!e.describes(&meta("ds/f3", Some("e"), 11)));
        assert!(!e.describes(&meta("ds/f4", Some("e"), 10)));
        assert!(!e.describes(&meta("ds/f3", None, 10)));
        assert!(again.take("ds/f3").is_none(), "handed out once");
        assert_eq!(again.leftovers().len(), SYNC_EVERY * 2);

        // A POSIX file's line goes by its source's identity, never an object's listing.
        let source = FileIdent {
            dev: 1,
            ino: 2,
            size: 10,
            mtime: 3,
            mtime_ns: 4,
            ctime: 5,
            ctime_ns: 6,
        };
        let posix = Entry::posix("ds/p".into(), source, id);
        let line = serde_json::to_string(&posix).unwrap();
        let back: Entry = serde_json::from_str(&line).unwrap();
        assert_eq!(
            (back.posix_source(), &back),
            (Some(source), &posix),
            "{line}"
        );
        assert!(!back.describes(&meta("ds/p", Some("e"), 10)));
        assert_eq!(e.posix_source(), None);

        // Another dataset of the job, or another boot: nothing.
        let other = parse_stage_entry("ds=s3://b/other").unwrap();
        assert!(
            JobResume::open(state.path(), 7, true)
                .dataset(&other)
                .unwrap()
                .leftovers()
                .is_empty()
        );
        let mut stranger = JobResume::open(state.path(), 7, true);
        stranger.boot_id = Some("another boot".into());
        assert!(stranger.dataset(&spec).unwrap().leftovers().is_empty());
        // A fresh run of the job id starts without the logs.
        let _ = JobResume::open(state.path(), 7, false);
        assert!(!job_dir(state.path(), 7).exists());
    }

    /// Finding 4 of issue 24: a kept file the job user rewrites in place after the agent checked
    /// its identity, and before it hashed it (the user watches the agent's open with inotify),
    /// is not kept: its units are never offered under hashes of the user's bytes. Before, the
    /// identity was checked once, before the read, and the hashes of the rewritten bytes were
    /// served to the job's other nodes, which filled their caches with them.
    #[test]
    fn a_kept_file_rewritten_while_it_is_hashed_is_not_kept() {
        let dir = tempfile::tempdir().unwrap();
        let origin: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let planted = vec![0x5a; origin.len()];
        let path = dir.path().join("f");
        std::fs::write(&path, &origin).unwrap();
        let size = origin.len() as u64;
        let id = Identity::of(&std::fs::File::open(&path).unwrap()).unwrap();
        let entry = Entry::new("f".into(), &meta("ds/f", Some("e"), size), id);
        let root = sluice_core::safefs::open_root_dir(dir.path()).unwrap();
        let owner = Owner {
            uid: nix::unistd::geteuid().as_raw(),
            gid: nix::unistd::getegid().as_raw(),
        };
        let units = [(0, 65_536), (65_536, size - 65_536)];
        let mut buf = Vec::with_capacity(4096);
        // Unchanged: kept, with the hashes of its bytes.
        let want: Vec<blake3::Hash> = units
            .iter()
            .map(|&(o, l)| blake3::hash(&origin[o as usize..(o + l) as usize]))
            .collect();
        assert_eq!(
            hash_kept(&root, "f", owner, &entry, &units, &mut buf),
            Some(want)
        );
        // A write lands in a later clock tick than the file's last change: its ctime tells.
        std::thread::sleep(Duration::from_millis(30));
        // The user rewrites it after the identity check, before the read ([`hash_kept`]'s halves).
        let file = resumable(&root, "f", owner, &entry).expect("still the file recorded");
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.write_all_at(&planted, 0).unwrap();
        let hashes = hash_unchanged(&file, &entry, &units, &mut buf);
        assert_eq!(
            hashes, None,
            "the rewritten file is read from the origin again"
        );
        // And it is not kept later either.
        assert_eq!(hash_kept(&root, "f", owner, &entry, &units, &mut buf), None);
    }

    #[test]
    fn prune_keeps_the_logs_of_jobs_still_staging() {
        let state = tempfile::tempdir().unwrap();
        for job in [1, 2, 3] {
            std::fs::create_dir_all(job_dir(state.path(), job)).unwrap();
        }
        assert_eq!(prune(state.path(), &HashSet::from([2])), 2);
        assert!(job_dir(state.path(), 2).exists());
        assert!(!job_dir(state.path(), 1).exists());
        forget(state.path(), 2).unwrap();
        forget(state.path(), 2).unwrap();
        assert!(!job_dir(state.path(), 2).exists());
    }
}
