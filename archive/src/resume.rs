//! Per-object resume of an interrupted checkpoint upload (issue 10, defect 8).
//!
//! Without it a restarted upload starts over — every file read, hashed, compressed and PUT again —
//! so an agent restarted more often than one upload takes never finishes one. With a resume
//! directory ([`Archiver::with_resume_dir`], root's agent state) [`Archiver::upload_part`] keeps a
//! log per (archive URL, tag, node), `<dir>/<hash>.resume`, of JSON lines:
//!
//! ```text
//! {"format":"sluice-upload-resume","version":1,...,"chunk_size":..,"zstd_level":..}  the header
//! {"file":{"ino":..,"size":..,"mtime_ns":..,"ctime_ns":..},"e_tag":..,"entry":{FileEntry}}
//! ...                                                   one line per data object once it is durable
//! ```
//!
//! A line is appended when a data object's PUT or multipart `complete` returned, naming the version
//! of the source file that was read (inode, size, mtime, ctime, from the reader's fstat) and the
//! object's entity tag. The next upload of the tag reuses an entry, without reading the file,
//! only when the walked file is that version (a rewrite, a touch or a chmod changes its ctime), and
//! a listing of the tag's data objects shows its object with the recorded stored size (and entity
//! tag, where the store gave one): anything else is uploaded again, so an entry is never trusted
//! further than the file and the store confirm it. The entry is the [`FileEntry`] a fresh upload
//! writes for that file, so the part manifest comes out the same; the header holds everything the
//! entries' bytes depend on (this build, the manifest version, the chunk size, the zstd level, the
//! URL, tag and node), and a log with another header is discarded.
//!
//! Losing lines costs re-uploads, nothing more, so the log is cheap to write: each line is one
//! `write` (it survives the agent being killed), fsynced every [`SYNC_EVERY`] lines or
//! [`SYNC_INTERVAL`] and at the end (for a crash of the node). A torn last line is skipped. Each
//! upload starts by rewriting the log (through [`write_durable`]) with the entries it confirmed,
//! so the log never holds more than one line per file plus the files re-uploaded since; it is
//! removed once the part manifest is written, or when the tag turns out to be published already.
//! Any trouble with the log itself is logged and the upload goes on without it.

use super::manifest::{FileEntry, VERSION};
use super::walk::{Snapshot, TreeFile};
use super::{ArchiveError, ArchiveProgress, Archiver};
use futures::TryStreamExt;
use object_store::path::Path as ObjPath;
use serde::{Deserialize, Serialize};
use sluice_core::durable::write_durable;
use sluice_core::rt::blocking;
use std::collections::{HashMap, HashSet};
use std::io::{BufRead, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime};

const FORMAT: &str = "sluice-upload-resume";
const LOG_VERSION: u32 = 1;
const SUFFIX: &str = ".resume";
/// Lines written between two fsyncs at most.
const SYNC_EVERY: usize = 64;
/// The longest a written line waits for its fsync (while the upload goes on).
const SYNC_INTERVAL: Duration = Duration::from_secs(1);

/// What every entry of a log depends on: a log whose header differs from the upload's is discarded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Header {
    format: String,
    version: u32,
    /// The build that encoded the entries: its encoder decides each object's bytes.
    encoder: String,
    manifest_version: u32,
    url: String,
    tag: String,
    node: String,
    chunk_size: u64,
    zstd_level: i32,
}

/// One version of a file: a rewrite, a truncate, a touch or a chmod changes it (its ctime at
/// least, which no user can set back). The archive's resume logs and the agent's staging logs
/// record files by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    pub ino: u64,
    pub size: u64,
    pub mtime_ns: i64,
    pub ctime_ns: i64,
}

impl Identity {
    /// Blocking. The file open as `file`, now (`fstat`).
    pub fn of(file: &std::fs::File) -> std::io::Result<Identity> {
        use std::os::unix::fs::MetadataExt;
        let m = file.metadata()?;
        Ok(Identity {
            ino: m.ino(),
            size: m.size(),
            mtime_ns: m.mtime() * 1_000_000_000 + m.mtime_nsec(),
            ctime_ns: m.ctime() * 1_000_000_000 + m.ctime_nsec(),
        })
    }

    /// The version the reader read (its fstat, equal before and after reading).
    pub(crate) fn read(s: &Snapshot) -> Identity {
        Identity {
            ino: s.ino,
            size: s.size,
            mtime_ns: s.mtime_ns(),
            ctime_ns: s.ctime_ns(),
        }
    }

    fn walked(f: &TreeFile) -> Identity {
        Identity {
            ino: f.ino,
            size: f.size,
            mtime_ns: f.mtime_ns,
            ctime_ns: f.ctime_ns,
        }
    }
}

/// A log line: a data object that is durable, and the file version it holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Record {
    file: Identity,
    /// The entity tag the store gave the object, if any.
    e_tag: Option<String>,
    entry: FileEntry,
}

impl Record {
    /// The entry a fresh upload of the walked file `f` would write: same version, same path, node
    /// and mode, and an entry whose chunks add up.
    fn describes(&self, f: &TreeFile, node: &str) -> bool {
        let e = &self.entry;
        self.file == Identity::walked(f)
            && e.path == f.rel
            && e.node == node
            && e.size == f.size
            && e.mode == f.mode
            && e.chunks.iter().map(|c| c.raw).sum::<u64>() == e.size
            && e.chunks.iter().map(|c| c.stored).sum::<u64>() == e.stored_size
    }
}

/// Entity tags as stores spell them, with or without quotes or a weak marker.
fn same_e_tag(recorded: Option<&str>, listed: Option<&str>) -> bool {
    let norm = |t: &str| t.trim_start_matches("W/").trim_matches('"').to_string();
    match (recorded, listed) {
        (Some(a), Some(b)) => norm(a) == norm(b),
        // The store gave none for one of them: the size alone decides.
        _ => true,
    }
}

/// The resume log of one (archive, tag, node).
#[derive(Debug, Clone)]
pub(crate) struct ResumeLog {
    dir: PathBuf,
    path: PathBuf,
    header: Header,
}

impl ResumeLog {
    fn new(dir: &Path, a: &Archiver, tag: &str, node: &str) -> ResumeLog {
        let mut h = blake3::Hasher::new();
        for part in [a.url.as_str(), tag, node] {
            h.update(&(part.len() as u64).to_le_bytes());
            h.update(part.as_bytes());
        }
        let name = format!("{}{SUFFIX}", &h.finalize().to_hex()[..32]);
        ResumeLog {
            dir: dir.to_path_buf(),
            path: dir.join(name),
            header: Header {
                format: FORMAT.into(),
                version: LOG_VERSION,
                encoder: env!("CARGO_PKG_VERSION").into(),
                manifest_version: VERSION,
                url: a.url.clone(),
                tag: tag.into(),
                node: node.into(),
                chunk_size: a.cfg.chunk_size as u64,
                zstd_level: a.cfg.zstd_level,
            },
        }
    }

    /// Blocking. The records of the log by path (the last line of a path wins); `None` when there
    /// is no log or it was written for other settings. Lines that do not parse (a torn last line)
    /// are skipped.
    fn load(&self) -> Option<HashMap<String, Record>> {
        let file = match std::fs::File::open(&self.path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
            Err(e) => {
                tracing::warn!(path = %self.path.display(), "cannot read the resume log ({e}); uploading every file");
                return None;
            }
        };
        let mut lines = std::io::BufReader::new(file).split(b'\n');
        let header = lines
            .next()
            .and_then(|l| l.ok())
            .and_then(|l| serde_json::from_slice::<Header>(&l).ok());
        if header.as_ref() != Some(&self.header) {
            tracing::info!(
                path = %self.path.display(),
                "discarding a resume log written for other settings or by another version"
            );
            return None;
        }
        let mut records = HashMap::new();
        for line in lines {
            let Ok(line) = line else { break };
            if let Ok(r) = serde_json::from_slice::<Record>(&line) {
                records.insert(r.entry.path.clone(), r);
            }
        }
        Some(records)
    }

    /// Blocking. Replaces the log with the header and `kept`, and opens it to append to.
    fn start(&self, kept: &[Record]) -> std::io::Result<std::fs::File> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.dir)?;
        let mut text = serde_json::to_vec(&self.header).expect("a header serialises");
        text.push(b'\n');
        for r in kept {
            serde_json::to_writer(&mut text, r).expect("a record serialises");
            text.push(b'\n');
        }
        write_durable(&self.path, &text)?;
        std::fs::OpenOptions::new()
            .append(true)
            .mode(0o600)
            .open(&self.path)
    }

    /// Removes the log: the part is written, or the tag is published.
    pub(crate) async fn remove(&self) {
        let path = self.path.clone();
        match blocking(move || std::fs::remove_file(path)).await {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(path = %self.path.display(), "cannot remove the resume log: {e}")
            }
        }
    }
}

/// Where upload tasks note the data objects they stored; cloned into each. Lines are written by
/// [`Writer`]'s thread, in the order the objects completed.
#[derive(Debug, Clone)]
pub(crate) struct Journal {
    tx: mpsc::Sender<Record>,
}

impl Journal {
    /// A file's object whose upload is under way: noted once the store says it is durable.
    pub(crate) fn pending(&self, file: Identity, entry: FileEntry) -> Pending {
        Pending {
            tx: self.tx.clone(),
            file,
            entry,
        }
    }
}

pub(crate) struct Pending {
    tx: mpsc::Sender<Record>,
    file: Identity,
    entry: FileEntry,
}

impl Pending {
    /// The object's PUT or `complete` returned, with this entity tag.
    pub(crate) fn stored(self, e_tag: Option<String>) {
        // The writer only stops early on a write error, which it logged.
        let _ = self.tx.send(Record {
            file: self.file,
            e_tag,
            entry: self.entry,
        });
    }
}

/// The thread writing a log: it ends, after a last fsync, once every [`Journal`] is dropped.
pub(crate) struct Writer {
    done: tokio::task::JoinHandle<()>,
}

impl Writer {
    fn spawn(mut file: std::fs::File, path: PathBuf) -> (Journal, Writer) {
        let (tx, rx) = mpsc::channel::<Record>();
        let done = tokio::task::spawn_blocking(move || {
            let sync = |file: &std::fs::File| {
                if let Err(e) = file.sync_data() {
                    tracing::warn!(path = %path.display(), "fsync of the resume log: {e}");
                }
            };
            let (mut unsynced, mut since) = (0usize, Instant::now());
            loop {
                match rx.recv_timeout(SYNC_INTERVAL) {
                    Ok(r) => {
                        let mut line = serde_json::to_vec(&r).expect("a record serialises");
                        line.push(b'\n');
                        if let Err(e) = file.write_all(&line) {
                            tracing::warn!(
                                path = %path.display(),
                                "writing the resume log failed ({e}); a restart will upload \
                                 the files stored from here on again"
                            );
                            return;
                        }
                        unsynced += 1;
                        if unsynced >= SYNC_EVERY || since.elapsed() >= SYNC_INTERVAL {
                            sync(&file);
                            (unsynced, since) = (0, Instant::now());
                        }
                    }
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        if unsynced > 0 {
                            sync(&file);
                            (unsynced, since) = (0, Instant::now());
                        }
                    }
                    Err(mpsc::RecvTimeoutError::Disconnected) => {
                        if unsynced > 0 {
                            sync(&file);
                        }
                        return;
                    }
                }
            }
        });
        (Journal { tx }, Writer { done })
    }

    /// Waits until every line is written (every [`Journal`] must be dropped by then).
    pub(crate) async fn finish(self) {
        self.done.await.expect("the resume log writer panicked");
    }
}

/// What a resumed upload starts from.
pub(crate) struct Plan {
    /// Entries of files whose objects are already stored, reused as they are.
    pub resumed: Vec<FileEntry>,
    /// The files still to upload, in walk order.
    pub upload: Vec<TreeFile>,
    /// Where their uploads note what they stored; `None` when the log cannot be written.
    pub journal: Option<(Journal, Writer)>,
}

impl Archiver {
    /// The resume log of `tag`'s part of `node`, when this archiver keeps them.
    pub(crate) fn resume_log(&self, tag: &str, node: &str) -> Option<ResumeLog> {
        let dir = self.resume_dir.as_ref()?;
        Some(ResumeLog::new(dir, self, tag, node))
    }

    /// Splits the walked `files` into those the log and the store show stored already and those
    /// to upload, counts the former in `progress`, and starts the log again with them.
    pub(crate) async fn resume_plan(
        &self,
        log: &ResumeLog,
        tag: &str,
        node: &str,
        files: Vec<TreeFile>,
        progress: &ArchiveProgress,
    ) -> Result<Plan, ArchiveError> {
        let l = log.clone();
        let mut records = blocking(move || l.load()).await.unwrap_or_default();
        let candidates: HashSet<ObjPath> = files
            .iter()
            .filter(|f| records.get(&f.rel).is_some_and(|r| r.describes(f, node)))
            .map(|f| self.data_key(tag, &f.rel))
            .collect();
        // One listing of the tag's data objects, as publishing does, rather than a HEAD per file.
        let listed: HashMap<ObjPath, (u64, Option<String>)> = if candidates.is_empty() {
            HashMap::new()
        } else {
            let prefix = self.data_prefix(tag);
            self.store
                .list(Some(&prefix))
                .try_filter(|m| futures::future::ready(candidates.contains(&m.location)))
                .map_ok(|m| (m.location, (m.size, m.e_tag)))
                .try_collect()
                .await
                .map_err(self.store_err("list", &prefix))?
        };
        let (mut kept, mut resumed, mut upload) = (Vec::new(), Vec::new(), Vec::new());
        for f in files {
            let stored = records.remove(&f.rel).filter(|r| {
                r.describes(&f, node)
                    && listed
                        .get(&self.data_key(tag, &f.rel))
                        .is_some_and(|(size, e_tag)| {
                            *size == r.entry.stored_size
                                && same_e_tag(r.e_tag.as_deref(), e_tag.as_deref())
                        })
            });
            match stored {
                Some(r) => {
                    resumed.push(r.entry.clone());
                    kept.push(r);
                }
                None => upload.push(f),
            }
        }
        if !candidates.is_empty() {
            let bytes: u64 = resumed.iter().map(|e| e.size).sum();
            for _ in &resumed {
                progress.file_done();
            }
            progress.bytes_done(bytes);
            tracing::info!(
                tag,
                node,
                url = self.url,
                files = resumed.len(),
                bytes,
                to_upload = upload.len(),
                "resuming the checkpoint's upload: files already archived are not uploaded again"
            );
        }
        let (l, path) = (log.clone(), log.path.clone());
        let journal = match blocking(move || l.start(&kept)).await {
            Ok(file) => Some(Writer::spawn(file, path)),
            Err(e) => {
                tracing::warn!(
                    path = %log.path.display(),
                    "cannot write the resume log ({e}); this upload cannot be resumed"
                );
                None
            }
        };
        Ok(Plan {
            resumed,
            upload,
            journal,
        })
    }
}

/// Removes the resume logs in `dir` not written to for `older_than` (a tag that was refused or
/// given up, a job gone), and returns how many. For the agent's housekeeping.
pub fn prune_resume_logs(dir: &Path, older_than: Duration) -> std::io::Result<usize> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    let now = SystemTime::now();
    let mut removed = 0;
    for e in entries {
        let e = e?;
        if !e.file_name().to_string_lossy().ends_with(SUFFIX) {
            continue;
        }
        let Ok(meta) = e.metadata() else { continue };
        let old = meta
            .modified()
            .ok()
            .and_then(|m| now.duration_since(m).ok())
            .is_some_and(|age| age >= older_than);
        if meta.is_file() && old && std::fs::remove_file(e.path()).is_ok() {
            removed += 1;
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e_tags_compare_as_stores_spell_them() {
        assert!(same_e_tag(Some("\"abc-2\""), Some("abc-2")));
        assert!(same_e_tag(Some("W/\"x\""), Some("\"x\"")));
        assert!(!same_e_tag(Some("\"a\""), Some("\"b\"")));
        assert!(same_e_tag(None, Some("\"b\"")));
    }

    #[test]
    fn old_logs_are_pruned_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(format!("a{SUFFIX}")), b"{}\n").unwrap();
        std::fs::write(dir.path().join("other"), b"x").unwrap();
        assert_eq!(
            prune_resume_logs(dir.path(), Duration::from_secs(3600)).unwrap(),
            0
        );
        assert_eq!(prune_resume_logs(dir.path(), Duration::ZERO).unwrap(), 1);
        assert!(dir.path().join("other").exists());
        assert_eq!(
            prune_resume_logs(&dir.path().join("missing"), Duration::ZERO).unwrap(),
            0
        );
    }
}
