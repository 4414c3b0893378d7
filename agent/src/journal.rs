//! Durable agent state: one JSON record per job under `<state_dir>/jobs/`, so that an agent restarted
//! after `kill -9` or a reboot knows which jobs it was serving.
//!
//! Every write goes through [`write_durable`] (sluice-archive's one durable-write helper): temp file → fsync → rename → fsync(dir). Records carry a
//! version; a record of an unknown version is kept on disk and reported, never misread.

use serde::{Deserialize, Serialize};
use sluice_core::durable::write_durable;
use sluice_proto::msg::{JobId, JobStart};
use std::path::{Path, PathBuf};

pub const RECORD_VERSION: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("journal {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("journal record {path} is unreadable: {message}")]
    Corrupt { path: PathBuf, message: String },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobRecord {
    pub version: u32,
    pub start: JobStart,
    pub started_at: u64,
    /// Staging finished: after a restart the staged data is in use and must not be staged again.
    #[serde(default)]
    pub ready: bool,
    /// The job ended; the record stays while checkpoints are pending or retained on the hot tier.
    #[serde(default)]
    pub ended: bool,
    /// The archive URL resolved when the job started (stable even if the config changes).
    #[serde(default)]
    pub archive_url: Option<String>,
    /// Committed checkpoints of the job on this node.
    #[serde(default)]
    pub ckpts: Vec<CkptRecord>,
    /// Datasets the job's steps added and this node staged (`srun --stage-in`): after a restart
    /// they are in use and must not be staged again.
    #[serde(default)]
    pub step_stage_in: Vec<sluice_proto::options::StageSpec>,
    /// The agent learnt of the job from a step, not from the prolog (see `Job::from_step`).
    #[serde(default)]
    pub from_step: bool,
    /// `$SLUICE_CKPT_DIR` is on the RAM tier (`--ckpt-tier=ram`, and a share was free).
    #[serde(default)]
    pub ram: bool,
    /// The RAM tier's root the job's tmpfs is under (`<root>/jobs/<id>`): an agent restarted with
    /// another `[fast_tier]`, or none, still finds the checkpoints there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ram_root: Option<PathBuf>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CkptRecord {
    pub tag: String,
    pub committed_at: u64,
    pub archived_at: Option<u64>,
    pub on_hot: bool,
    /// Its copy on the RAM tier is still there (`--ckpt-tier=ram`); with `on_hot` false it is
    /// not flushed yet.
    #[serde(default)]
    pub in_ram: bool,
    /// Flushed from the RAM tier and not verified yet: each file's BLAKE3 (hex) as the flush read
    /// it, which the hot tier's copy must match (see `ckpt::CkptEntry::flush_hashes`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flush_blake3: Option<std::collections::BTreeMap<String, String>>,
    /// Lost with the RAM tier before it was flushed: what the user is told.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lost: Option<String>,
    /// Marked bad with `sluice ckpt poison` (retention keeps a good one instead).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub poisoned: bool,
    /// This node's part as sealed for its replicas (`Replication::part`): what a restore from
    /// replicas is served of this node's own copy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica_part: Option<sluice_peer::ReplicaSeal>,
}

/// Removes `path` durably (the directory entry removal is fsynced).
pub fn remove_durable(path: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    }
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

#[derive(Debug, Clone)]
pub struct Journal {
    dir: PathBuf,
}

impl Journal {
    /// Opens (creating if needed) the journal under `state_dir`, root-only.
    pub fn open(state_dir: &Path) -> Result<Journal, JournalError> {
        let dir = state_dir.join("jobs");
        let io = |source| JournalError::Io {
            path: dir.clone(),
            source,
        };
        std::fs::create_dir_all(&dir).map_err(io)?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(state_dir, std::fs::Permissions::from_mode(0o700)).map_err(io)?;
        // Leftover temp files are writes that never completed: the renamed record (if any) is intact.
        if let Ok(entries) = std::fs::read_dir(&dir) {
            for e in entries.flatten() {
                if e.file_name().to_string_lossy().ends_with(".tmp") {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        Ok(Journal { dir })
    }

    fn path(&self, job_id: JobId) -> PathBuf {
        self.dir.join(format!("{job_id}.json"))
    }

    pub fn save(&self, record: &JobRecord) -> Result<(), JournalError> {
        let path = self.path(record.start.job_id);
        let data = serde_json::to_vec_pretty(record).map_err(|e| JournalError::Corrupt {
            path: path.clone(),
            message: e.to_string(),
        })?;
        write_durable(&path, &data).map_err(|source| JournalError::Io { path, source })
    }

    pub fn remove(&self, job_id: JobId) -> Result<(), JournalError> {
        let path = self.path(job_id);
        remove_durable(&path).map_err(|source| JournalError::Io { path, source })
    }

    /// Every readable record; unreadable ones are returned as errors and left in place for an admin.
    pub fn load(&self) -> Result<(Vec<JobRecord>, Vec<JournalError>), JournalError> {
        let mut records = Vec::new();
        let mut bad = Vec::new();
        let entries = std::fs::read_dir(&self.dir).map_err(|source| JournalError::Io {
            path: self.dir.clone(),
            source,
        })?;
        for e in entries.flatten() {
            let path = e.path();
            if path.extension().is_none_or(|x| x != "json") {
                continue;
            }
            let parsed = std::fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|d| serde_json::from_slice::<JobRecord>(&d).map_err(|e| e.to_string()))
                .and_then(|r| {
                    if r.version == RECORD_VERSION {
                        Ok(r)
                    } else {
                        Err(format!("record version {} is not supported", r.version))
                    }
                });
            match parsed {
                Ok(r) => records.push(r),
                Err(message) => bad.push(JournalError::Corrupt { path, message }),
            }
        }
        records.sort_by_key(|r| r.start.job_id);
        Ok((records, bad))
    }
}

/// A one-node job of user alice (uid 1000) on n1, for the tests of the journal and the job table.
#[cfg(test)]
pub(crate) fn alice_start(job_id: JobId, options: Vec<(String, String)>) -> JobStart {
    JobStart {
        job_id,
        uid: 1000,
        gid: 1000,
        user: "alice".into(),
        node: "n1".into(),
        nodes: vec!["n1".into()],
        job_name: "train".into(),
        options,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(job_id: JobId) -> JobRecord {
        JobRecord {
            step_stage_in: Vec::new(),
            from_step: false,
            ram: false,
            ram_root: None,
            version: RECORD_VERSION,
            start: alice_start(job_id, vec![("stage-in".into(), "/data".into())]),
            started_at: 1,
            ready: false,
            ended: false,
            archive_url: None,
            ckpts: Vec::new(),
        }
    }

    #[test]
    fn save_load_remove() {
        let tmp = tempfile::tempdir().unwrap();
        let j = Journal::open(tmp.path()).unwrap();
        j.save(&record(7)).unwrap();
        j.save(&record(3)).unwrap();
        std::fs::write(tmp.path().join("jobs/9.json"), b"{ torn").unwrap();
        std::fs::write(tmp.path().join("jobs/.5.json.tmp"), b"partial").unwrap();
        let j = Journal::open(tmp.path()).unwrap();
        assert!(!tmp.path().join("jobs/.5.json.tmp").exists());
        let (records, bad) = j.load().unwrap();
        assert_eq!(
            records.iter().map(|r| r.start.job_id).collect::<Vec<_>>(),
            vec![3, 7]
        );
        assert_eq!(bad.len(), 1);
        j.remove(7).unwrap();
        j.remove(7).unwrap();
        assert_eq!(j.load().unwrap().0.len(), 1);
    }

    /// This node's sealed part of a checkpoint survives a restart of the agent (it serves it to a
    /// restore from replicas), and a record written before parts were journaled still reads.
    #[test]
    fn a_checkpoints_sealed_part_is_kept_and_older_records_read() {
        let tmp = tempfile::tempdir().unwrap();
        let j = Journal::open(tmp.path()).unwrap();
        let part = sluice_peer::ReplicaSeal {
            files: vec![sluice_peer::ReplicaFile {
                path: "shards/rank0.bin".into(),
                size: 3,
                blake3: blake3::hash(b"abc").to_hex().to_string(),
            }],
            nodes: vec!["n1".into(), "n2".into()],
            committed_at: 1_750_000_000,
        };
        let mut rec = record(8);
        rec.ckpts.push(CkptRecord {
            tag: "s1".into(),
            committed_at: 1_750_000_000,
            archived_at: None,
            on_hot: true,
            in_ram: true,
            flush_blake3: None,
            lost: None,
            poisoned: false,
            replica_part: Some(part.clone()),
        });
        j.save(&rec).unwrap();
        let (records, _) = j.load().unwrap();
        assert_eq!(records[0].ckpts[0].replica_part, Some(part));
        let older = r#"{"tag":"s0","committed_at":1,"archived_at":null,"on_hot":true}"#;
        let c: CkptRecord = serde_json::from_str(older).unwrap();
        assert_eq!((c.tag.as_str(), c.replica_part), ("s0", None));
    }
}
