//! The RAM tier (`[fast_tier]`, `--ckpt-tier=ram`): a job's checkpoints saved at memory speed.
//!
//! Each such job gets its own tmpfs of `job_share` bytes at `<root>/jobs/<id>` (mounted by the
//! agent, `nosuid,nodev`, root's), and `$SLUICE_CKPT_DIR` is its `ckpt` directory, the job user's.
//! The share is the kernel's limit: a save that does not fit fails in the writer with `ENOSPC`
//! ("No space left on device"), never by taking memory from the node. The node's jobs together
//! hold at most `capacity`: a job that finds no room left gets the NVMe hot tier instead, with a
//! note in its output. Committed checkpoints are flushed to the hot tier ([`crate::ckpt`]) and
//! archived from there; the tmpfs goes when the job is finished on this node, after every
//! committed checkpoint in it was flushed.
//!
//! With `mount = false` the admin has mounted a tmpfs at `root` already; jobs get directories in
//! it and the share is not enforced.

use sluice_archive::config::FastTierConfig;
use sluice_archive::rt::lock;
use sluice_archive::safefs::{self, Owner, SafeFsError};
use sluice_proto::msg::JobId;
use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

const JOBS: &str = "jobs";
const CKPT: &str = "ckpt";
/// `fast_tier.flush_block` when the config does not say.
pub const DEFAULT_FLUSH_BLOCK: u64 = 8 << 20;

#[derive(Debug, thiserror::Error)]
pub enum RamTierError {
    #[error(
        "the RAM tier of node {node} is full: {used} of {capacity} bytes are other jobs' shares, and this job's is {share}"
    )]
    Full {
        node: String,
        used: u64,
        capacity: u64,
        share: u64,
    },
    #[error("RAM tier {path}: {source}")]
    Dir {
        path: String,
        #[source]
        source: SafeFsError,
    },
    #[error("mounting the job's tmpfs at {path}: {errno}")]
    Mount {
        path: String,
        errno: nix::errno::Errno,
    },
}

/// The node's RAM tier and the shares its jobs hold.
#[derive(Debug)]
pub struct RamTier {
    cfg: FastTierConfig,
    node: String,
    shares: Mutex<BTreeMap<JobId, u64>>,
}

impl RamTier {
    pub fn new(cfg: FastTierConfig, node: &str) -> RamTier {
        RamTier {
            cfg,
            node: node.to_string(),
            shares: Mutex::new(BTreeMap::new()),
        }
    }

    /// The RAM tier of a job recovered by an agent whose `[fast_tier]` no longer has the job's
    /// root (`root`, from its journal record; `None` for a record that did not keep it): no
    /// capacity to share out, only the job's tmpfs to flush from and remove. Its flush uses the
    /// default block.
    pub fn stray(root: Option<PathBuf>, node: &str) -> RamTier {
        RamTier::new(
            FastTierConfig {
                root: root.unwrap_or_default(),
                capacity: 0,
                job_share: 0,
                flush_block: DEFAULT_FLUSH_BLOCK,
                mount: false,
            },
            node,
        )
    }

    pub fn config(&self) -> &FastTierConfig {
        &self.cfg
    }

    fn job_path(&self, job_id: JobId) -> PathBuf {
        self.cfg.root.join(JOBS).join(job_id.to_string())
    }

    /// `$SLUICE_CKPT_DIR` of a job on the RAM tier.
    pub fn ckpt_dir(&self, job_id: JobId) -> PathBuf {
        self.job_path(job_id).join(CKPT)
    }

    /// Takes the job's share of the node's capacity (again, for a recovered job: whatever the
    /// others hold, its tmpfs exists already).
    pub fn reserve(&self, job_id: JobId, recovered: bool) -> Result<(), RamTierError> {
        let mut shares = lock(&self.shares);
        let used: u64 = shares
            .iter()
            .filter(|(id, _)| **id != job_id)
            .map(|(_, s)| s)
            .sum();
        if !recovered && used + self.cfg.job_share > self.cfg.capacity {
            return Err(RamTierError::Full {
                node: self.node.clone(),
                used,
                capacity: self.cfg.capacity,
                share: self.cfg.job_share,
            });
        }
        shares.insert(job_id, self.cfg.job_share);
        Ok(())
    }

    /// Bytes of the node's capacity the jobs hold now.
    pub fn reserved(&self) -> u64 {
        lock(&self.shares).values().sum()
    }

    /// Makes the job's tmpfs and its `ckpt` directory, owned by the job user (blocking). `fresh`
    /// (a job starting) first removes what an earlier run of the job id left.
    pub fn prepare(
        &self,
        job_id: JobId,
        owner: Owner,
        fresh: bool,
    ) -> Result<OwnedFd, RamTierError> {
        let path = self.job_path(job_id);
        let dir_err = |source| RamTierError::Dir {
            path: path.display().to_string(),
            source,
        };
        std::fs::create_dir_all(self.cfg.root.join(JOBS)).map_err(|e| RamTierError::Dir {
            path: self.cfg.root.display().to_string(),
            source: SafeFsError::Sys {
                op: "mkdir",
                path: self.cfg.root.display().to_string(),
                errno: nix::errno::Errno::from_raw(e.raw_os_error().unwrap_or(0)),
            },
        })?;
        let jobs = safefs::open_dir(
            safefs::open_root_dir(&self.cfg.root).map_err(dir_err)?,
            JOBS,
        )
        .map_err(dir_err)?;
        let name = job_id.to_string();
        if fresh {
            unmount(&path);
            safefs::remove_tree(&jobs, &name, owner.into())
                .and_then(|r| r.all_gone(&name))
                .map_err(dir_err)?;
        }
        safefs::ensure_dir(&jobs, &name, None, 0o755).map_err(dir_err)?;
        if self.cfg.mount && !is_mount_point(&path) {
            use nix::mount::MsFlags;
            let data = format!("size={},mode=0755,uid=0,gid=0", self.cfg.job_share);
            nix::mount::mount(
                Some("sluice-ram"),
                &path,
                Some("tmpfs"),
                MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
                Some(data.as_str()),
            )
            .map_err(|errno| RamTierError::Mount {
                path: path.display().to_string(),
                errno,
            })?;
        }
        let job = safefs::open_dir(&jobs, &name).map_err(dir_err)?;
        safefs::ensure_dir(&job, CKPT, Some(owner), 0o755).map_err(dir_err)
    }

    /// The job's `ckpt` directory, opened without following links.
    pub fn open_ckpt(&self, job_id: JobId) -> Result<OwnedFd, SafeFsError> {
        let jobs = safefs::open_dir(safefs::open_root_dir(&self.cfg.root)?, JOBS)?;
        safefs::open_dir(safefs::open_dir(jobs, &job_id.to_string())?, CKPT)
    }

    /// Bytes used and the size of the job's tmpfs (zeros if it is gone).
    pub fn usage(&self, job_id: JobId) -> (u64, u64) {
        nix::sys::statvfs::statvfs(&self.job_path(job_id))
            .map(|s| {
                let f = s.fragment_size();
                ((s.blocks() - s.blocks_free()) * f, s.blocks() * f)
            })
            .unwrap_or((0, 0))
    }

    /// Removes the job's tmpfs and gives its share back (blocking). Without a tmpfs of its own
    /// (`mount = false`), only what is `who`'s (the job user's) or root's goes.
    pub fn remove(&self, job_id: JobId, who: safefs::RemoveAs) -> Result<(), SafeFsError> {
        let path = self.job_path(job_id);
        unmount(&path);
        let jobs = safefs::open_dir(safefs::open_root_dir(&self.cfg.root)?, JOBS)?;
        safefs::remove_tree(&jobs, &job_id.to_string(), who)?;
        lock(&self.shares).remove(&job_id);
        Ok(())
    }
}

/// Whether `path` is a mount point (another device than its parent's).
fn is_mount_point(path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let (Ok(here), Some(Ok(up))) = (
        std::fs::symlink_metadata(path),
        path.parent().map(std::fs::symlink_metadata),
    ) else {
        return false;
    };
    here.dev() != up.dev()
}

fn unmount(path: &Path) {
    if is_mount_point(path) {
        if let Err(e) = nix::mount::umount2(path, nix::mount::MntFlags::MNT_DETACH) {
            tracing::warn!("unmounting the RAM tier at {}: {e}", path.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tier(root: &Path, mount: bool) -> RamTier {
        RamTier::new(
            FastTierConfig {
                root: root.to_path_buf(),
                capacity: 3 << 20,
                job_share: 1 << 20,
                flush_block: 1 << 20,
                mount,
            },
            "n1",
        )
    }

    fn me() -> Owner {
        Owner {
            uid: nix::unistd::getuid().as_raw(),
            gid: nix::unistd::getgid().as_raw(),
        }
    }

    #[test]
    fn shares_are_bounded_by_the_capacity() {
        let t = tempfile::tempdir().unwrap();
        let r = tier(t.path(), false);
        for id in 1..=3 {
            r.reserve(id, false).unwrap();
        }
        let e = r.reserve(4, false).unwrap_err();
        assert!(e.to_string().contains("RAM tier of node n1 is full"), "{e}");
        // A recovered job's tmpfs exists: it keeps its share.
        r.reserve(4, true).unwrap();
        assert_eq!(r.reserved(), 4 << 20);
        r.prepare(2, me(), true).unwrap();
        std::fs::write(r.ckpt_dir(2).join("x"), b"1").unwrap();
        r.remove(2, me().into()).unwrap();
        assert!(!r.ckpt_dir(2).exists());
        assert_eq!(r.reserved(), 3 << 20);
    }

    #[test]
    #[ignore = "needs root, like sluiced (it mounts a tmpfs); run as root with --ignored, as tests/harness/run-e2e.sh does"]
    fn a_job_gets_its_own_tmpfs_of_its_share() {
        assert!(
            nix::unistd::geteuid().is_root(),
            "this test needs root: it mounts a tmpfs"
        );
        let t = tempfile::tempdir().unwrap();
        let r = tier(t.path(), true);
        r.reserve(7, false).unwrap();
        let owner = Owner {
            uid: 65534,
            gid: 65534,
        };
        r.prepare(7, owner, true).unwrap();
        let (_, size) = r.usage(7);
        assert_eq!(size, 1 << 20);
        let st = std::fs::metadata(r.ckpt_dir(7)).unwrap();
        assert_eq!(std::os::unix::fs::MetadataExt::uid(&st), 65534);
        // Past the share: ENOSPC, whatever the node's free memory.
        let e = std::fs::write(r.ckpt_dir(7).join("big"), vec![0u8; 2 << 20]).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(nix::libc::ENOSPC));
        r.remove(7, owner.into()).unwrap();
        assert!(!t.path().join("jobs/7").exists());
    }
}
