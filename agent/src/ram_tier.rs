//! The RAM tier (`[fast_tier]`, `--ckpt-tier=ram`): a job's checkpoints saved at memory speed.
//!
//! Each such job gets its own tmpfs of `job_share` bytes at `<root>/jobs/<id>` (mounted by the
//! agent, `nosuid,nodev`), and `$SLUICE_CKPT_DIR` is its `ckpt` directory. Private by
//! construction, as on the hot tier ([`crate::hot_tier`]):
//!
//! ```text
//! <root>/jobs/                 the agent's (root's), 0711: users traverse to their own job, never list others
//! <root>/jobs/<id>/            the job's tmpfs, its root the job user's, 0700 (uid=,gid=,mode=0700)
//! <root>/jobs/<id>/ckpt/       $SLUICE_CKPT_DIR, the job user's
//! ```
//!
//! A second user on the node can neither list nor read anything of it, whatever modes the job's
//! files have (the writer creates them 0644); the job's tasks and the agent (root) can.
//! The share is the kernel's limit: a save that does not fit fails in the writer with `ENOSPC`
//! ("No space left on device"), never by taking memory from the node. The node's jobs together
//! hold at most `capacity`: a job that finds no room left gets the NVMe hot tier instead, with a
//! note in its output. Committed checkpoints are flushed to the hot tier ([`crate::ckpt`]) and
//! archived from there; the tmpfs goes when the job is finished on this node, after every
//! committed checkpoint in it was flushed. A new run of the job id on this node (a requeue) keeps
//! the tmpfs while it holds checkpoints of the run before ([`RamTier::prepare`]'s `keep`).
//!
//! With `mount = false` the admin has mounted a tmpfs at `root` already; jobs get directories in
//! it (the job user's, 0700) and the share is not enforced.

use sluice_core::config::FastTierConfig;
use sluice_core::rt::lock;
use sluice_core::safefs::{self, Owner, SafeFsError};
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
                replicas: 0,
                max_replicas: 0,
                replica_room: 0,
                topology: None,
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

    /// Makes the job's tmpfs and its `ckpt` directory, owned by the job user, private to them
    /// (blocking). `fresh` (a job starting) first removes what an earlier run of the job id left —
    /// unless `keep` names checkpoints of that run still in it (a requeue: committed, and maybe not
    /// flushed yet): then the tmpfs stays, and of its `ckpt` only those entries.
    pub fn prepare(
        &self,
        job_id: JobId,
        owner: Owner,
        fresh: bool,
        keep: &[String],
    ) -> Result<OwnedFd, RamTierError> {
        let path = self.job_path(job_id);
        let dir_err = |source| RamTierError::Dir {
            path: path.display().to_string(),
            source,
        };
        std::fs::create_dir_all(&self.cfg.root).map_err(|e| RamTierError::Dir {
            path: self.cfg.root.display().to_string(),
            source: SafeFsError::Sys {
                op: "mkdir",
                path: self.cfg.root.display().to_string(),
                errno: nix::errno::Errno::from_raw(e.raw_os_error().unwrap_or(0)),
            },
        })?;
        let jobs = self.jobs_dir().map_err(dir_err)?;
        let name = job_id.to_string();
        if fresh && keep.is_empty() {
            unmount(&path);
            safefs::remove_tree(&jobs, &name, owner.into())
                .and_then(|r| r.all_gone(&name))
                .map_err(dir_err)?;
        }
        // The mount point (with `mount = false`, the job's directory itself).
        safefs::ensure_dir(&jobs, &name, Some(owner), 0o700).map_err(dir_err)?;
        let data = format!(
            "size={},mode=0700,uid={},gid={}",
            self.cfg.job_share, owner.uid, owner.gid
        );
        if self.cfg.mount && !is_mount_point(&path) {
            mount_tmpfs("sluice-ram", &path, &data, nix::mount::MsFlags::empty()).map_err(
                |errno| RamTierError::Mount {
                    path: path.display().to_string(),
                    errno,
                },
            )?;
        } else if self.cfg.mount && fresh {
            // A new run of the job id (a requeue) keeps the tmpfs of the run before, with its
            // checkpoints: at this agent's `job_share` (an admin may have changed it and restarted
            // the agent in between), which is what the run's share counts. A tmpfs cannot shrink
            // below what it holds: it then keeps its size, said in the log.
            let remount = nix::mount::MsFlags::MS_REMOUNT;
            if let Err(errno) = mount_tmpfs("sluice-ram", &path, &data, remount) {
                tracing::warn!(
                    job_id,
                    "resizing the job's RAM tier {} to {} bytes: {errno}; it keeps the size it was mounted with",
                    path.display(),
                    self.cfg.job_share
                );
            }
        }
        let job = safefs::open_dir(&jobs, &name).map_err(dir_err)?;
        // Whatever mounted it (an agent before tmpfs roots were private: root's, 0755), the job's
        // tmpfs is the job user's, 0700. A user cannot put an entry in `jobs`: this is ours.
        private(&job, owner, &name).map_err(dir_err)?;
        let ckpt = safefs::ensure_dir(&job, CKPT, Some(owner), 0o755).map_err(dir_err)?;
        if fresh && !keep.is_empty() {
            // The run before's torn saves go; its committed checkpoints stay, to be flushed.
            for entry in crate::hot_tier::list_names(&ckpt).map_err(dir_err)? {
                if !keep.contains(&entry) {
                    safefs::remove_tree(&ckpt, &entry, owner.into())
                        .and_then(|r| r.all_gone(&entry))
                        .map_err(dir_err)?;
                }
            }
        }
        Ok(ckpt)
    }

    /// Makes an existing job's tmpfs private to the job user, as [`Self::prepare`] makes it: for a
    /// job an agent recovers already set up, whose tmpfs an older agent may have left open to every
    /// user (blocking). Nothing to do where it is gone.
    pub fn make_private(&self, job_id: JobId, owner: Owner) -> Result<(), SafeFsError> {
        let gone = |e: &SafeFsError| e.errno() == Some(nix::errno::Errno::ENOENT);
        let jobs = match self.jobs_dir() {
            Err(e) if gone(&e) => return Ok(()),
            other => other?,
        };
        let name = job_id.to_string();
        match safefs::open_dir(&jobs, &name) {
            Ok(job) => private(&job, owner, &name),
            Err(e) if gone(&e) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// `<root>/jobs`, the agent's own and 0711 whatever mode it had: the job users traverse it to
    /// their own tmpfs, and nobody but the agent lists it.
    fn jobs_dir(&self) -> Result<OwnedFd, SafeFsError> {
        let agent = Owner {
            uid: nix::unistd::geteuid().as_raw(),
            gid: nix::unistd::getegid().as_raw(),
        };
        let root = safefs::open_root_dir(&self.cfg.root)?;
        let jobs = safefs::ensure_dir(&root, JOBS, Some(agent), 0o711)?;
        nix::sys::stat::fchmod(&jobs, nix::sys::stat::Mode::from_bits_truncate(0o711)).map_err(
            |errno| SafeFsError::Sys {
                op: "fchmod",
                path: JOBS.into(),
                errno,
            },
        )?;
        Ok(jobs)
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

/// Mounts a tmpfs named `source` at `path` with the options `data` (`size=…,mode=…`), `nosuid`,
/// `nodev` and `flags` besides (blocking). The replica area mounts its own too
/// ([`crate::replica_area`]).
pub(crate) fn mount_tmpfs(
    source: &str,
    path: &Path,
    data: &str,
    flags: nix::mount::MsFlags,
) -> Result<(), nix::errno::Errno> {
    use nix::mount::MsFlags;
    nix::mount::mount(
        Some(source),
        path,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | flags,
        Some(data),
    )
}

/// Whether `path` is a mount point (another device than its parent's).
pub(crate) fn is_mount_point(path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let (Ok(here), Some(Ok(up))) = (
        std::fs::symlink_metadata(path),
        path.parent().map(std::fs::symlink_metadata),
    ) else {
        return false;
    };
    here.dev() != up.dev()
}

/// Makes the directory `dir` (`name`) `owner`'s, mode 0700 (blocking).
fn private(dir: &OwnedFd, owner: Owner, name: &str) -> Result<(), SafeFsError> {
    use nix::unistd::{Gid, Uid, fchown};
    fchown(
        dir,
        Some(Uid::from_raw(owner.uid)),
        Some(Gid::from_raw(owner.gid)),
    )
    .map_err(|errno| SafeFsError::Sys {
        op: "fchown",
        path: name.into(),
        errno,
    })?;
    nix::sys::stat::fchmod(dir, nix::sys::stat::Mode::from_bits_truncate(0o700)).map_err(|errno| {
        SafeFsError::Sys {
            op: "fchmod",
            path: name.into(),
            errno,
        }
    })
}

pub(crate) fn unmount(path: &Path) {
    if is_mount_point(path)
        && let Err(e) = nix::mount::umount2(path, nix::mount::MntFlags::MNT_DETACH)
    {
        tracing::warn!("unmounting the RAM tier at {}: {e}", path.display());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_core::testing::me;

    fn tier(root: &Path, mount: bool) -> RamTier {
        RamTier::new(
            FastTierConfig {
                root: root.to_path_buf(),
                capacity: 3 << 20,
                job_share: 1 << 20,
                flush_block: 1 << 20,
                mount,
                replicas: 0,
                max_replicas: 0,
                replica_room: 0,
                topology: None,
            },
            "n1",
        )
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
        r.prepare(2, me(), true, &[]).unwrap();
        std::fs::write(r.ckpt_dir(2).join("x"), b"1").unwrap();
        r.remove(2, me().into()).unwrap();
        assert!(!r.ckpt_dir(2).exists());
        assert_eq!(r.reserved(), 3 << 20);
    }

    fn uid_mode(path: &Path) -> (u32, u32) {
        use std::os::unix::fs::MetadataExt;
        let st = std::fs::symlink_metadata(path).unwrap();
        (st.uid(), st.mode() & 0o7777)
    }

    #[test]
    fn a_jobs_dir_is_private_and_a_requeue_keeps_the_checkpoints_named() {
        use std::os::unix::fs::PermissionsExt;
        let t = tempfile::tempdir().unwrap();
        let r = tier(t.path(), false);
        let ckpt = r.ckpt_dir(5);
        r.prepare(5, me(), true, &[]).unwrap();
        // Users traverse `jobs` to their own job and list nothing; the job's directory is theirs
        // alone.
        assert_eq!(uid_mode(&t.path().join("jobs")), (me().uid, 0o711));
        assert_eq!(uid_mode(&t.path().join("jobs/5")), (me().uid, 0o700));
        assert_eq!(uid_mode(&ckpt).0, me().uid);
        // A requeue keeping s1: the run before's other entries go, s1 stays.
        std::fs::create_dir_all(ckpt.join("s1")).unwrap();
        std::fs::write(ckpt.join("s1/model.pt"), b"w").unwrap();
        std::fs::create_dir_all(ckpt.join("torn")).unwrap();
        std::fs::write(ckpt.join("latest"), b"s1").unwrap();
        r.prepare(5, me(), true, &["s1".into()]).unwrap();
        assert_eq!(std::fs::read(ckpt.join("s1/model.pt")).unwrap(), b"w");
        assert!(!ckpt.join("torn").exists() && !ckpt.join("latest").exists());
        // A directory an older agent left open is closed again, fresh or not.
        for fresh in [false, true] {
            std::fs::set_permissions(
                t.path().join("jobs/5"),
                std::fs::Permissions::from_mode(0o755),
            )
            .unwrap();
            std::fs::set_permissions(
                t.path().join("jobs"),
                std::fs::Permissions::from_mode(0o755),
            )
            .unwrap();
            r.prepare(5, me(), fresh, &[]).unwrap();
            assert_eq!(uid_mode(&t.path().join("jobs/5")).1, 0o700);
            assert_eq!(uid_mode(&t.path().join("jobs")).1, 0o711);
        }
        assert!(!ckpt.join("s1").exists(), "a fresh start keeps nothing");
        // A job recovered already set up is closed too; one whose directory is gone is no error.
        std::fs::set_permissions(
            t.path().join("jobs/5"),
            std::fs::Permissions::from_mode(0o755),
        )
        .unwrap();
        r.make_private(5, me()).unwrap();
        assert_eq!(uid_mode(&t.path().join("jobs/5")).1, 0o700);
        r.make_private(6, me()).unwrap();
        tier(&t.path().join("absent"), false)
            .make_private(5, me())
            .unwrap();
    }

    #[test]
    #[ignore = "needs root, like sluiced (it mounts a tmpfs); run as root with --ignored, as tests/harness/run-e2e.sh does"]
    fn a_job_gets_its_own_tmpfs_of_its_share() {
        sluice_core::testing::assert_root("it mounts a tmpfs");
        let t = tempfile::tempdir().unwrap();
        let r = tier(t.path(), true);
        r.reserve(7, false).unwrap();
        let owner = Owner {
            uid: 65534,
            gid: 65534,
        };
        r.prepare(7, owner, true, &[]).unwrap();
        let (_, size) = r.usage(7);
        assert_eq!(size, 1 << 20);
        let st = std::fs::metadata(r.ckpt_dir(7)).unwrap();
        assert_eq!(std::os::unix::fs::MetadataExt::uid(&st), 65534);
        // The tmpfs's root is the job user's and closed to everyone else.
        let (uid, mode) = uid_mode(&t.path().join("jobs/7"));
        assert_eq!((uid, mode), (65534, 0o700), "the job's tmpfs root");
        assert_eq!(uid_mode(&t.path().join("jobs")), (0, 0o711));
        // A requeue that keeps a checkpoint keeps the tmpfs; a fresh start does not.
        std::fs::create_dir(r.ckpt_dir(7).join("s1")).unwrap();
        r.prepare(7, owner, true, &["s1".into()]).unwrap();
        assert!(r.ckpt_dir(7).join("s1").exists());
        assert_eq!(r.usage(7).1, 1 << 20, "the tmpfs was not kept");
        // The agent restarted with twice the share: the requeue's tmpfs is resized, s1 kept.
        let mut cfg = r.config().clone();
        cfg.job_share = 2 << 20;
        let bigger = RamTier::new(cfg, "n1");
        bigger.prepare(7, owner, true, &["s1".into()]).unwrap();
        assert!(r.ckpt_dir(7).join("s1").exists());
        assert_eq!(
            r.usage(7).1,
            2 << 20,
            "the kept tmpfs was not resized to the new share"
        );
        r.prepare(7, owner, true, &["s1".into()]).unwrap();
        r.prepare(7, owner, true, &[]).unwrap();
        assert!(!r.ckpt_dir(7).join("s1").exists());
        // Past the share: ENOSPC, whatever the node's free memory.
        let e = std::fs::write(r.ckpt_dir(7).join("big"), vec![0u8; 2 << 20]).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(nix::libc::ENOSPC));
        r.remove(7, owner.into()).unwrap();
        assert!(!t.path().join("jobs/7").exists());
    }
}
