//! `--stage-tier=shared`: a job's datasets staged once into a directory every node of the job sees
//! (`[shared_tier] job_dir`, on Lustre or BeeOND), each file written by its owner node alone.
//!
//! The job's directory, `job_dir` with `%j` replaced, is made by whichever node comes first
//! (root's, 0755) in the admin's directory, which must exist:
//!
//! ```text
//! <job_dir>/stage/          $SLUICE_STAGE_DIR on every node: the datasets, the job user's
//! <job_dir>/.sluice/NODE    root's, 0700: NODE finished its share ("ok") or why it could not
//! ```
//!
//! Which node writes which file is `--stage-mode=shard`'s ownership ([`ShardPlan`]) whatever the
//! mode: a file is written once, by its owner, and every node sees all of them, so no manifest is
//! written. A node that wrote its share marks it; a node's tasks start only once every node of the
//! job marked its share "ok" (else the job fails with the node's reason, or at the stage timeout
//! with the names of the nodes still writing). A restarted agent finds its own "ok" mark and does
//! not write its share again under the feet of tasks already reading it. At job end every node
//! removes the job's directory; the first one to get there does the work.
//!
//! Limits, said where they apply: a node that dies while writing its share is not routed around
//! (the job fails at the stage timeout, naming it); a requeued job whose previous run's job end ran
//! on no node at all may find that run's marks of the other nodes.

use super::{ShardPlan, StageError};
use sluice_archive::config::{SharedTierConfig, StripeClass};
use sluice_archive::safefs::{self, Owner, SafeFsError};
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const STAGE: &str = "stage";
const MARKS: &str = ".sluice";
const OK: &str = "ok";

/// `$SLUICE_STAGE_DIR` of a shared-tier job.
pub fn stage_dir(cfg: &SharedTierConfig, job_id: u32) -> PathBuf {
    cfg.job_dir_for(job_id).join(STAGE)
}

/// How staged files are laid out in the job's shared directory: on Lustre, the stripe layout of
/// each file's size class (`[[shared_tier.stripe]]`, set with `lfs setstripe` as the job user
/// before the file's bytes are written); elsewhere the directory's default.
#[derive(Debug, Clone, Default)]
pub struct Layout {
    pub lfs: PathBuf,
    /// Empty off Lustre, or when no class is configured.
    pub stripes: Vec<StripeClass>,
}

impl Layout {
    /// The stripe class of a file of `size` bytes, if it gets one.
    pub fn for_size(&self, size: u64) -> Option<&StripeClass> {
        StripeClass::for_size(&self.stripes, size)
    }

    /// The helper's `--lfs`/`--stripe MIN:COUNT:SIZE` arguments for a POSIX copy.
    pub fn helper_args(&self) -> Vec<String> {
        if self.stripes.is_empty() {
            return Vec::new();
        }
        let mut args = vec!["--lfs".to_string(), self.lfs.display().to_string()];
        for c in &self.stripes {
            args.push("--stripe".into());
            args.push(format!("{}:{}:{}", c.min_size, c.count, c.size));
        }
        args
    }
}

/// Creates the staged file `name` in the job user's directory `dir` on the shared tier: with the
/// stripe layout of its size class (`lfs` as the job user, see [`super::lustre`]), then opened
/// without following links and only if it is a regular file of the user with one link; else
/// plainly, as on the hot tier. Blocking.
pub fn create_file(
    dir: &OwnedFd,
    name: &str,
    size: u64,
    owner: Owner,
    layout: &Layout,
) -> Result<std::fs::File, String> {
    let Some(class) = layout.for_size(size) else {
        return safefs::create_file(dir, name, Some(owner), 0o644).map_err(|e| e.to_string());
    };
    super::lustre::create_striped(&layout.lfs, dir, name, class, owner.uid, owner.gid)
        .map_err(|e| e.to_string())?;
    use nix::fcntl::{OFlag, openat};
    use nix::sys::stat::{Mode, SFlag, fstat};
    let flags = OFlag::O_WRONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC;
    let fd = openat(dir, name, flags, Mode::empty()).map_err(|e| format!("open '{name}': {e}"))?;
    let st = fstat(&fd).map_err(|e| format!("stat '{name}': {e}"))?;
    let regular = SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFREG;
    if !regular || st.st_uid != owner.uid || st.st_nlink != 1 {
        return Err(format!(
            "'{name}' is not the file lfs setstripe created (replaced while staging?)"
        ));
    }
    Ok(std::fs::File::from(fd))
}

/// One job's directory on the shared tier, as this node holds it open.
pub struct SharedJob {
    pub stage: OwnedFd,
    marks: OwnedFd,
    /// This node's share is already written (a restarted agent found its "ok" mark).
    pub done: bool,
    pub layout: Layout,
}

impl SharedJob {
    /// Creates or joins the job's directory (see the module header). `fresh` (a job starting, not
    /// a recovered one) drops this node's mark of an earlier run of the job id. Blocking.
    pub fn open(
        cfg: &SharedTierConfig,
        job_id: u32,
        node: &str,
        owner: Owner,
        fresh: bool,
    ) -> Result<SharedJob, SafeFsError> {
        let root = safefs::open_root_dir(cfg.root())?;
        let job = safefs::ensure_dir(&root, &cfg.job_dir_name(job_id), None, 0o755)?;
        let stage = safefs::ensure_dir(&job, STAGE, Some(owner), 0o755)?;
        let marks = safefs::ensure_dir(&job, MARKS, None, 0o700)?;
        if fresh {
            safefs::remove_tree(&marks, node)?;
        }
        let done = read_mark(&marks, node).as_deref() == Some(OK);
        let lustre = super::lustre::is_lustre(&stage).unwrap_or(false);
        if !lustre && !cfg.stripes.is_empty() {
            tracing::info!(
                job_id,
                "the shared tier is not Lustre here: [[shared_tier.stripe]] layouts are not applied"
            );
        }
        let layout = Layout {
            lfs: cfg.lfs.clone(),
            stripes: if lustre {
                cfg.stripes.clone()
            } else {
                Vec::new()
            },
        };
        Ok(SharedJob {
            stage,
            marks,
            done,
            layout,
        })
    }

    /// Marks this node's share written (`Ok`) or failed, for the job's other nodes. Blocking.
    pub fn mark(&self, node: &str, result: Result<(), &StageError>) -> Result<(), SafeFsError> {
        let text = match result {
            Ok(()) => OK.to_string(),
            Err(e) => e.to_string(),
        };
        let tmp = format!(".{node}.tmp");
        safefs::remove_tree(&self.marks, &tmp)?;
        let mut f = safefs::create_file(&self.marks, &tmp, None, 0o600)?;
        std::io::Write::write_all(&mut f, text.as_bytes()).map_err(|e| SafeFsError::Sys {
            op: "write",
            path: tmp.clone(),
            errno: nix::errno::Errno::from_raw(e.raw_os_error().unwrap_or(libc_eio())),
        })?;
        nix::fcntl::renameat(&self.marks, tmp.as_str(), &self.marks, node).map_err(|errno| {
            SafeFsError::Sys {
                op: "rename",
                path: node.to_string(),
                errno,
            }
        })
    }

    /// Waits until every node of `plan` marked its share: `Ok` when all wrote theirs, the first
    /// failure's reason otherwise. Polls the marks (a shared file system has no portable change
    /// notification across nodes); the caller's stage timeout bounds the wait.
    pub async fn wait_for_all(
        self: &std::sync::Arc<Self>,
        plan: &ShardPlan,
        cancel: &CancellationToken,
    ) -> Result<(), StageError> {
        let mut pause = Duration::from_millis(100);
        loop {
            let this = self.clone();
            let nodes = plan.nodes().to_vec();
            let marks = sluice_archive::rt::blocking(move || {
                nodes
                    .into_iter()
                    .map(|n| {
                        let m = read_mark(&this.marks, &n);
                        (n, m)
                    })
                    .collect::<Vec<_>>()
            })
            .await;
            if let Some((node, why)) = marks
                .iter()
                .find_map(|(n, m)| m.as_ref().filter(|m| *m != OK).map(|m| (n, m)))
            {
                return Err(StageError::SharedPeer {
                    node: node.clone(),
                    detail: why.clone(),
                });
            }
            let waiting: Vec<&String> = marks
                .iter()
                .filter(|(_, m)| m.is_none())
                .map(|(n, _)| n)
                .collect();
            if waiting.is_empty() {
                return Ok(());
            }
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = cancel.cancelled() => return Err(StageError::Cancelled {
                    dataset: format!("the shared tier's share of node(s) {}", join(&waiting)),
                }),
            }
            pause = (pause * 2).min(Duration::from_secs(2));
        }
    }
}

fn join(nodes: &[&String]) -> String {
    nodes
        .iter()
        .map(|n| n.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

fn libc_eio() -> i32 {
    nix::errno::Errno::EIO as i32
}

/// What node `node` marked, if it did.
fn read_mark(marks: &OwnedFd, node: &str) -> Option<String> {
    use nix::fcntl::{OFlag, openat};
    use nix::sys::stat::Mode;
    safefs::check_component(node).ok()?;
    let flags = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let fd = openat(marks, node, flags, Mode::empty()).ok()?;
    let mut text = String::new();
    std::io::Read::read_to_string(
        &mut std::io::Read::take(std::fs::File::from(fd), 4096),
        &mut text,
    )
    .ok()?;
    Some(text)
}

/// Removes the job's directory from the shared tier (every node of the job calls it at job end;
/// what another node removed meanwhile counts as removed). Blocking.
pub fn remove(cfg: &SharedTierConfig, job_id: u32) -> Result<safefs::Removed, SafeFsError> {
    let root = safefs::open_root_dir(cfg.root())?;
    let name = cfg.job_dir_name(job_id);
    let mut last = None;
    for _ in 0..3 {
        match safefs::remove_tree(&root, &name) {
            Ok(r) => return Ok(r),
            // Another node removed entries while this one walked: walk again.
            Err(e)
                if matches!(
                    e.errno(),
                    Some(nix::errno::Errno::ENOENT | nix::errno::Errno::ENOTEMPTY)
                ) =>
            {
                last = Some(e)
            }
            Err(e) => return Err(e),
        }
    }
    Err(last.expect("three attempts failed"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn cfg(root: &std::path::Path) -> SharedTierConfig {
        SharedTierConfig {
            job_dir: format!("{}/job-%j", root.display()),
            lfs: "lfs".into(),
            stripes: Vec::new(),
        }
    }

    fn me() -> Owner {
        Owner {
            uid: nix::unistd::getuid().as_raw(),
            gid: nix::unistd::getgid().as_raw(),
        }
    }

    /// The real `lfs` and Lustre are not exercised here: a fake `lfs` records its arguments and
    /// creates the file, as `lfs setstripe` does.
    #[test]
    fn files_of_a_striped_class_are_created_by_lfs_then_opened_checked() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let (lfs, record) = (tmp.path().join("lfs"), tmp.path().join("args"));
        std::fs::write(
            &lfs,
            format!(
                "#!/bin/sh\nprintf '%s ' \"$@\" > '{}'\nfor a; do last=$a; done\n: > \"$last\"\n",
                record.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&lfs, std::fs::Permissions::from_mode(0o755)).unwrap();
        let dir_path = tmp.path().join("d");
        std::fs::create_dir(&dir_path).unwrap();
        let dir = safefs::open_root_dir(&dir_path).unwrap();
        let layout = Layout {
            lfs: lfs.clone(),
            stripes: vec![StripeClass {
                min_size: 1 << 20,
                count: -1,
                size: 4 << 20,
            }],
        };
        // Below every class: a plain file, lfs not run.
        create_file(&dir, "small", 10, me(), &layout).unwrap();
        assert!(!record.exists());
        // In the class: lfs makes it, then it is written through the checked open.
        let mut f = (0..50)
            .find_map(|_| match create_file(&dir, "big", 2 << 20, me(), &layout) {
                Err(e) if e.contains("Text file busy") => {
                    std::thread::sleep(Duration::from_millis(20));
                    None
                }
                other => Some(other),
            })
            .unwrap()
            .unwrap();
        std::io::Write::write_all(&mut f, b"bytes").unwrap();
        assert_eq!(std::fs::read(dir_path.join("big")).unwrap(), b"bytes");
        assert_eq!(
            std::fs::read_to_string(&record).unwrap(),
            "setstripe -c -1 -S 4194304 /proc/self/fd/0/big "
        );
        assert_eq!(
            layout.helper_args(),
            [
                "--lfs",
                &lfs.display().to_string(),
                "--stripe",
                "1048576:-1:4194304"
            ]
        );
        // A name lfs did not leave as a plain file of the user is refused, not written through.
        std::os::unix::fs::symlink("/etc/passwd", dir_path.join("link")).unwrap();
        let lying = tmp.path().join("lying-lfs");
        std::fs::write(&lying, "#!/bin/sh\nexit 0\n").unwrap();
        std::fs::set_permissions(&lying, std::fs::Permissions::from_mode(0o755)).unwrap();
        let liar = Layout {
            lfs: lying,
            ..layout
        };
        let e = (0..50)
            .find_map(|_| match create_file(&dir, "link", 2 << 20, me(), &liar) {
                Err(e) if e.contains("Text file busy") => {
                    std::thread::sleep(Duration::from_millis(20));
                    None
                }
                other => Some(other),
            })
            .unwrap()
            .unwrap_err();
        assert!(e.contains("open 'link'"), "{e}");
    }

    #[tokio::test]
    async fn nodes_wait_for_every_share_and_learn_why_one_failed() {
        let root = tempfile::tempdir().unwrap();
        let cfg = cfg(root.path());
        let nodes: Vec<String> = ["n1", "n2"].map(String::from).into();
        let plan = ShardPlan::new(&nodes, "n1").unwrap();
        let n1 = Arc::new(SharedJob::open(&cfg, 5, "n1", me(), true).unwrap());
        let n2 = Arc::new(SharedJob::open(&cfg, 5, "n2", me(), true).unwrap());
        assert_eq!(stage_dir(&cfg, 5), root.path().join("job-5/stage"));
        assert!(root.path().join("job-5/stage").is_dir());
        n1.mark("n1", Ok(())).unwrap();
        let cancel = CancellationToken::new();
        // n2 has not marked: n1 waits.
        let wait =
            tokio::time::timeout(Duration::from_millis(400), n1.wait_for_all(&plan, &cancel));
        assert!(wait.await.is_err(), "n1 went on before n2 wrote its share");
        n2.mark("n2", Ok(())).unwrap();
        n1.wait_for_all(&plan, &cancel).await.unwrap();

        // A restarted agent finds its share written; a fresh run of the job id does not.
        assert!(SharedJob::open(&cfg, 5, "n2", me(), false).unwrap().done);
        let again = SharedJob::open(&cfg, 5, "n2", me(), true).unwrap();
        assert!(!again.done);
        let e = StageError::NotFound {
            dataset: "s3://b/x".into(),
        };
        again.mark("n2", Err(&e)).unwrap();
        let e = n1.wait_for_all(&plan, &cancel).await.unwrap_err();
        assert!(
            e.to_string().contains("node n2") && e.to_string().contains("s3://b/x not found"),
            "{e}"
        );

        // Job end on both nodes: the directory goes, the second removal finds nothing.
        remove(&cfg, 5).unwrap();
        remove(&cfg, 5).unwrap();
        assert!(!root.path().join("job-5").exists());
    }
}
