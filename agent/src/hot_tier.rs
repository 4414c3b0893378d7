//! The node's hot tier (node-local NVMe): the only place that knows its layout.
//!
//! ```text
//! <root>/jobs/                 root-owned, 0711: users traverse to their own job, never list others
//! <root>/jobs/<id>/            the job user's, 0700
//! <root>/jobs/<id>/stage/      $SLUICE_STAGE_DIR: staged datasets, removed at job end
//! <root>/jobs/<id>/ckpt/       $SLUICE_CKPT_DIR: checkpoints, kept by retention after the job
//! ```
//!
//! Every directory is opened fd-relative without following links ([`safefs`]); the paths handed to
//! tasks ([`HotTier::task_dirs`]) are for the job's own processes, never for root's file operations.
//! Blocking calls: run them on the blocking pool.

use sluice_core::safefs::{self, Owner, RemoveAs, Removed, SafeFsError};
use sluice_proto::msg::{JobDirs, JobId};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

const JOBS: &str = "jobs";
const STAGE: &str = "stage";
const CKPT: &str = "ckpt";

#[derive(Debug, thiserror::Error)]
pub enum HotTierError {
    #[error("hot tier {path}: {source}")]
    Create {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("hot tier {path}: {source}")]
    Open {
        path: String,
        #[source]
        source: SafeFsError,
    },
}

/// The names of the directories in `dir` (a checkpoint directory: its tags and leftovers).
pub fn subdirs(dir: OwnedFd) -> Vec<String> {
    let Ok(mut d) = nix::dir::Dir::from_fd(dir) else {
        return Vec::new();
    };
    d.iter()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type() == Some(nix::dir::Type::Directory))
        .filter_map(|e| e.file_name().to_str().ok().map(String::from))
        .filter(|n| n != "." && n != "..")
        .collect()
}

/// Size and free space of the hot tier's file system.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub total_bytes: u64,
    /// Available to unprivileged writers (what a job can still write).
    pub free_bytes: u64,
    /// Used by anyone, root's reserve excluded.
    pub used_bytes: u64,
}

impl Usage {
    /// Whether more than `percent` of the file system is used.
    pub fn above(&self, percent: u8) -> bool {
        self.total_bytes > 0 && self.used_bytes * 100 > self.total_bytes * u64::from(percent)
    }
}

#[derive(Debug, Clone)]
pub struct HotTier {
    root: PathBuf,
    /// Percent of the hot tier above which retention keeps only each job's newest archived checkpoint.
    high_water: u8,
}

impl HotTier {
    /// Prepares `<root>/jobs` (root-owned, 0711, whatever mode it had).
    pub fn open(root: &Path, high_water: u8) -> Result<HotTier, HotTierError> {
        let shown = root.display().to_string();
        let open = |path: String| move |source| HotTierError::Open { path, source };
        std::fs::create_dir_all(root).map_err(|source| HotTierError::Create {
            path: shown.clone(),
            source,
        })?;
        let root_fd = safefs::open_root_dir(root).map_err(open(shown.clone()))?;
        let jobs = safefs::ensure_dir(&root_fd, JOBS, Some(Owner { uid: 0, gid: 0 }), 0o711)
            .map_err(open(format!("{shown}/{JOBS}")))?;
        nix::sys::stat::fchmod(&jobs, nix::sys::stat::Mode::from_bits_truncate(0o711))
            .map_err(|errno| SafeFsError::Sys {
                op: "fchmod",
                path: JOBS.into(),
                errno,
            })
            .map_err(open(format!("{shown}/{JOBS}")))?;
        Ok(HotTier {
            root: root.to_path_buf(),
            high_water,
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    fn jobs(&self) -> Result<OwnedFd, SafeFsError> {
        safefs::open_dir(safefs::open_root_dir(&self.root)?, JOBS)
    }

    /// The directories a job's tasks see (`SLUICE_STAGE_DIR`, `SLUICE_CKPT_DIR`).
    pub fn task_dirs(&self, job_id: JobId) -> JobDirs {
        let base = self.root.join(JOBS).join(job_id.to_string());
        JobDirs {
            stage_dir: base.join(STAGE).display().to_string(),
            ckpt_dir: base.join(CKPT).display().to_string(),
            restored_tag: None,
            notes: Vec::new(),
            env: Vec::new(),
        }
    }

    /// Creates `jobs/<id>/{stage,ckpt}` owned by the job user. `fresh` (a job starting) removes
    /// anything a previous run of the same job id left (a requeued job must not trust stale data); a
    /// recovery keeps `ckpt`, and of `stage` only the entries named in `keep_staged` (the
    /// datasets a restarted agent resumes: `stage::resume`); with none, `stage` is
    /// re-created empty. Returns the (stage, ckpt) directories.
    pub fn prepare_job(
        &self,
        job_id: JobId,
        owner: Owner,
        fresh: bool,
        keep_staged: &[String],
    ) -> Result<(OwnedFd, OwnedFd), SafeFsError> {
        let jobs = self.jobs()?;
        let name = job_id.to_string();
        let who = owner.into();
        let job_dir = if fresh {
            safefs::remove_tree(&jobs, &name, who)?.all_gone(&name)?;
            safefs::create_dir(&jobs, &name, Some(owner), 0o700)?
        } else {
            safefs::ensure_dir(&jobs, &name, Some(owner), 0o700)?
        };
        let stage = if fresh || keep_staged.is_empty() {
            safefs::remove_tree(&job_dir, STAGE, who)?.all_gone(STAGE)?;
            safefs::create_dir(&job_dir, STAGE, Some(owner), 0o755)?
        } else {
            let stage = safefs::ensure_dir(&job_dir, STAGE, Some(owner), 0o755)?;
            // What else a cut-short set-up left (datasets that do not resume, shard manifests,
            // a step's datasets) is staged again, from the start.
            for entry in list_names(&stage)? {
                if !keep_staged.contains(&entry) {
                    safefs::remove_tree(&stage, &entry, who)?;
                }
            }
            stage
        };
        let ckpt = safefs::ensure_dir(&job_dir, CKPT, Some(owner), 0o755)?;
        Ok((stage, ckpt))
    }

    /// `jobs/<id>/stage`, opened without following links.
    pub fn open_stage(&self, job_id: JobId) -> Result<OwnedFd, SafeFsError> {
        safefs::open_dir(safefs::open_dir(self.jobs()?, &job_id.to_string())?, STAGE)
    }

    /// `jobs/<id>/ckpt`, opened without following links.
    pub fn open_ckpt(&self, job_id: JobId) -> Result<OwnedFd, SafeFsError> {
        safefs::open_dir(safefs::open_dir(self.jobs()?, &job_id.to_string())?, CKPT)
    }

    /// Removes `jobs/<id>` with everything in it that is `who`'s (the job user's) or root's.
    pub fn remove_job(&self, job_id: JobId, who: RemoveAs) -> Result<Removed, SafeFsError> {
        safefs::remove_tree(self.jobs()?, &job_id.to_string(), who)
    }

    /// Removes `jobs/<id>/stage`, what is `who`'s (the job user's) or root's in it. What is already
    /// gone (the checkpoint worker may be removing the whole job directory meanwhile) counts as
    /// removed.
    pub fn remove_staged(&self, job_id: JobId, who: RemoveAs) -> Result<Removed, SafeFsError> {
        let gone = |e: &SafeFsError| e.errno() == Some(nix::errno::Errno::ENOENT);
        match safefs::open_dir(self.jobs()?, &job_id.to_string()) {
            Ok(dir) => match safefs::remove_tree(&dir, STAGE, who) {
                Err(e) if gone(&e) => Ok(Removed::default()),
                other => other,
            },
            Err(e) if gone(&e) => Ok(Removed::default()),
            Err(e) => Err(e),
        }
    }

    /// Cleans up after a job the agent has no record of: its staged data goes; its checkpoint
    /// directory stays unless it is empty (the agent cannot know whether what it holds is
    /// archived). Returns whether something was kept. Whose it is, is the owner of `jobs/<id>`:
    /// root made it in root's `jobs` and gave it to the job user, who cannot replace it.
    pub fn remove_unknown_job(&self, job_id: JobId) -> Result<bool, SafeFsError> {
        let who = match safefs::open_dir(self.jobs()?, &job_id.to_string()) {
            Ok(dir) => RemoveAs {
                uid: nix::sys::stat::fstat(&dir)
                    .map_err(|errno| SafeFsError::Sys {
                        op: "stat",
                        path: job_id.to_string(),
                        errno,
                    })?
                    .st_uid,
            },
            Err(e) if e.errno() == Some(nix::errno::Errno::ENOENT) => return Ok(false),
            Err(e) => return Err(e),
        };
        let staged = self.remove_staged(job_id, who)?;
        if staged.skipped > 0 {
            tracing::warn!(
                job_id,
                skipped = staged.skipped,
                "the job's staged data holds entries of other users (moved in by the job's user), \
                 left in place with the directories holding them — check them and remove them by \
                 hand"
            );
        }
        let kept = match self.open_ckpt(job_id) {
            Ok(ckpt) => !list_names(&ckpt)?.is_empty(),
            Err(e) if e.errno() == Some(nix::errno::Errno::ENOENT) => false,
            Err(e) => return Err(e),
        };
        if !kept {
            self.remove_job(job_id, who)?;
        }
        Ok(kept)
    }

    /// Removes everything in `jobs/<id>/ckpt` but the entries named in `keep` (what is `who`'s,
    /// the job user's, or root's).
    pub fn remove_ckpt_except(
        &self,
        job_id: JobId,
        keep: &[String],
        who: RemoveAs,
    ) -> Result<(), SafeFsError> {
        let ckpt = self.open_ckpt(job_id)?;
        for name in list_names(&ckpt)?.iter().filter(|n| !keep.contains(n)) {
            safefs::remove_tree(&ckpt, name, who)?;
        }
        Ok(())
    }

    /// The directories in `jobs/<id>/ckpt` (checkpoints and torn saves alike); empty if it is gone.
    pub fn ckpt_subdirs(&self, job_id: JobId) -> Vec<String> {
        match self.open_ckpt(job_id) {
            Ok(dir) => subdirs(dir),
            Err(_) => Vec::new(),
        }
    }

    /// Size and free space of the file system (zeros if it cannot be read).
    pub fn usage(&self) -> Usage {
        nix::sys::statvfs::statvfs(&self.root)
            .map(|s| {
                let frag = s.fragment_size();
                Usage {
                    total_bytes: s.blocks() * frag,
                    free_bytes: s.blocks_available() * frag,
                    used_bytes: s.blocks().saturating_sub(s.blocks_free()) * frag,
                }
            })
            .unwrap_or_default()
    }

    /// Whether the hot tier is fuller than its high-water mark (`ckpt.high_water`).
    pub fn above_high_water(&self) -> bool {
        self.usage().above(self.high_water)
    }
}

/// The names in a directory, `.` and `..` left out.
pub(crate) fn list_names(dir: &OwnedFd) -> Result<Vec<String>, SafeFsError> {
    let dup = nix::unistd::dup(dir).map_err(|errno| SafeFsError::Sys {
        op: "dup",
        path: CKPT.into(),
        errno,
    })?;
    Ok(nix::dir::Dir::from_fd(dup)
        .map(|mut d| {
            d.iter()
                .filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().to_str().ok().map(String::from))
                .filter(|n| n != "." && n != "..")
                .collect()
        })
        .unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[ignore = "needs root (the jobs directory is made root's, as sluiced runs); run as root with --ignored, as tests/harness/run-e2e.sh does"]
    fn layout_and_cleanup() {
        sluice_core::testing::assert_root("HotTier::open makes the jobs directory root's");
        let tmp = tempfile::tempdir().unwrap();
        let me = Owner {
            uid: nix::unistd::geteuid().as_raw(),
            gid: nix::unistd::getegid().as_raw(),
        };
        let hot = HotTier::open(tmp.path(), 90).unwrap();
        let dirs = hot.task_dirs(7);
        assert_eq!(
            dirs.stage_dir,
            tmp.path().join("jobs/7/stage").display().to_string()
        );
        assert_eq!(
            dirs.ckpt_dir,
            tmp.path().join("jobs/7/ckpt").display().to_string()
        );
        hot.prepare_job(7, me, true, &[]).unwrap();
        std::fs::create_dir(tmp.path().join("jobs/7/ckpt/s1")).unwrap();
        std::fs::create_dir(tmp.path().join("jobs/7/ckpt/torn")).unwrap();
        std::fs::write(tmp.path().join("jobs/7/stage/x"), b"x").unwrap();
        // A recovery keeps checkpoints and re-creates the stage directory empty ...
        hot.prepare_job(7, me, false, &[]).unwrap();
        assert!(!tmp.path().join("jobs/7/stage/x").exists());
        // ... or keeps the datasets it resumes, and only those.
        std::fs::create_dir(tmp.path().join("jobs/7/stage/ds")).unwrap();
        std::fs::write(tmp.path().join("jobs/7/stage/ds/f"), b"f").unwrap();
        std::fs::write(tmp.path().join("jobs/7/stage/posix"), b"p").unwrap();
        hot.prepare_job(7, me, false, &["ds".into(), "absent".into()])
            .unwrap();
        assert!(tmp.path().join("jobs/7/stage/ds/f").exists());
        assert!(!tmp.path().join("jobs/7/stage/posix").exists());
        let mut subdirs = hot.ckpt_subdirs(7);
        subdirs.sort();
        assert_eq!(subdirs, ["s1", "torn"]);
        hot.remove_ckpt_except(7, &["s1".into()], me.into())
            .unwrap();
        assert_eq!(hot.ckpt_subdirs(7), ["s1"]);
        hot.remove_staged(7, me.into()).unwrap();
        assert!(!tmp.path().join("jobs/7/stage").exists());
        hot.remove_job(7, me.into()).unwrap();
        assert!(!tmp.path().join("jobs/7").exists());
        // Already gone counts as removed for staged data.
        hot.remove_staged(7, me.into()).unwrap();
        // An unknown job's checkpoints stay; an empty one goes whole.
        hot.prepare_job(9, me, true, &[]).unwrap();
        std::fs::write(tmp.path().join("jobs/9/stage/x"), b"x").unwrap();
        std::fs::create_dir(tmp.path().join("jobs/9/ckpt/s1")).unwrap();
        assert!(hot.remove_unknown_job(9).unwrap(), "kept");
        assert!(tmp.path().join("jobs/9/ckpt/s1").exists());
        assert!(!tmp.path().join("jobs/9/stage").exists());
        std::fs::remove_dir(tmp.path().join("jobs/9/ckpt/s1")).unwrap();
        assert!(!hot.remove_unknown_job(9).unwrap());
        assert!(!tmp.path().join("jobs/9").exists());
        assert!(!hot.remove_unknown_job(10).unwrap(), "never there");
        // A fresh start of the same id removes what the previous run left.
        hot.prepare_job(8, me, true, &[]).unwrap();
        std::fs::create_dir(tmp.path().join("jobs/8/ckpt/old")).unwrap();
        hot.prepare_job(8, me, true, &[]).unwrap();
        assert!(hot.ckpt_subdirs(8).is_empty());
    }

    #[test]
    #[ignore = "needs root (the job's files belong to other users, as with sluiced); run as root with --ignored, as tests/harness/run-e2e.sh does"]
    fn another_users_files_moved_into_a_job_stay() {
        sluice_core::testing::assert_root("the job's files belong to other users");
        let tmp = tempfile::tempdir().unwrap();
        let hot = HotTier::open(tmp.path(), 90).unwrap();
        let (user, other) = (4401, 4402);
        let owner = Owner {
            uid: user,
            gid: user,
        };
        hot.prepare_job(20, owner, true, &[]).unwrap();
        let stage = tmp.path().join("jobs/20/stage");
        std::fs::write(stage.join("mine"), b"m").unwrap();
        std::os::unix::fs::chown(stage.join("mine"), Some(user), None).unwrap();
        // The job's user moved in a directory of another user's (one that user let them move).
        let loot = stage.join("loot");
        std::fs::create_dir(&loot).unwrap();
        std::fs::write(loot.join("secret"), b"theirs").unwrap();
        for p in [&loot, &loot.join("secret")] {
            std::os::unix::fs::chown(p, Some(other), Some(other)).unwrap();
        }
        // Job end: the job's own data goes, the other user's stays, counted.
        let r = hot.remove_staged(20, owner.into()).unwrap();
        assert_eq!((r.entries, r.skipped), (1, 1), "{r:?}");
        assert!(!stage.join("mine").exists());
        assert_eq!(std::fs::read(loot.join("secret")).unwrap(), b"theirs");
        // So does a job the agent has no record of (its owner is its directory's).
        assert!(!hot.remove_unknown_job(20).unwrap());
        assert_eq!(std::fs::read(loot.join("secret")).unwrap(), b"theirs");
        // A fresh start of the job id cannot clear the way: it fails, saying what to do.
        let e = hot.prepare_job(20, owner, true, &[]).unwrap_err();
        assert!(
            e.to_string().contains("holds 1 entries of other users")
                && e.to_string().contains("move them out"),
            "{e}"
        );
        assert_eq!(std::fs::read(loot.join("secret")).unwrap(), b"theirs");
    }

    #[test]
    fn high_water() {
        let u = Usage {
            total_bytes: 100,
            free_bytes: 5,
            used_bytes: 91,
        };
        assert!(u.above(90));
        assert!(!u.above(91));
        assert!(
            !Usage::default().above(0),
            "an unreadable file system is never full"
        );
    }
}
