//! `sluiced copy-as-user`: copies a POSIX dataset with the job user's identity. This is the helper
//! process; the agent's side (starting it, reading its progress, classifying its exit) is
//! [`super::posix`].
//!
//! The agent starts this helper as root; before touching any file it takes the job user's groups, gid
//! and uid for good (`initgroups`, `setresgid`, `setresuid`) and checks that root cannot be regained.
//! Credentials are per process here, not per thread, so no async runtime thread ever changes identity.
//! The helper reports progress as lines on stdout (`total F B`, `progress F B`) and its error as the
//! last line on stderr, with an exit code that classifies it.

use super::local_fs::{is_local_fs, preallocate};
use super::shard::{ShardManifest, ShardPlan};
use crate::peer::{Unit, units_of};
use nix::unistd::{Gid, Uid, geteuid, initgroups, setresgid, setresuid};
use sluice_core::config::StripeClass;
use std::collections::HashMap;
use std::ffi::CString;
use std::fs;
use std::io::{self, Read, Seek, Write};
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Duration;

/// Exit codes of the helper.
pub const EXIT_NOT_FOUND: i32 = 2;
pub const EXIT_DENIED: i32 = 3;
pub const EXIT_NO_SPACE: i32 = 4;
pub const EXIT_OTHER: i32 = 1;

/// Copy threads in the helper: one per core, at least 2 and at most 8. Copying through the page
/// cache is CPU-bound on local disks, so threads beyond the cores only contend; 8 is enough to hide
/// per-file latency on parallel file systems.
fn copy_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .clamp(2, 8)
}

/// Files larger than this are copied as several pieces in parallel, so one big file uses every
/// copy thread, where that is faster ([`piece_for`]).
const PIECE: u64 = 64 << 20;

/// The piece size for copying `src` to `dst`: [`PIECE`], unless both are on local file systems,
/// where each file is copied whole by one thread. Local file systems (ext4, XFS, btrfs, tmpfs)
/// serialize buffered writes to one inode on its lock, so a second thread on the same file gains
/// at most a few percent and, on a busy node, spends a core spinning on that lock: one file of
/// 1 GiB on ext4 took 0.28 s with one thread and 0.29–0.35 s with two while another process kept
/// one of two cores busy (`cp -a`: 0.29–0.31 s). A network or parallel file system (Lustre,
/// BeeGFS, NFS, GPFS) on either side is limited by each stream's latency instead, which parallel
/// pieces hide. A side whose file system cannot be told counts as not local.
fn piece_for(src: &Path, dst: &Path) -> u64 {
    // `dst` does not exist yet: its nearest existing ancestor tells where it will be.
    let local = |p: &Path| {
        p.ancestors()
            .find_map(|a| nix::sys::statfs::statfs(a).ok())
            .is_some_and(|st| is_local_fs(st.filesystem_type()))
    };
    if local(src) && local(dst) {
        u64::MAX
    } else {
        PIECE
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    Total { files: u64, bytes: u64 },
    Progress { files: u64, bytes: u64 },
}

impl Event {
    pub fn parse(line: &str) -> Option<Event> {
        let mut it = line.split_whitespace();
        let kind = it.next()?;
        let files = it.next()?.parse().ok()?;
        let bytes = it.next()?.parse().ok()?;
        match kind {
            "total" => Some(Event::Total { files, bytes }),
            "progress" => Some(Event::Progress { files, bytes }),
            _ => None,
        }
    }
}

/// The identity the helper takes: `--uid --gid --user`, as the agent passes them (and as the
/// benchmark's driver takes them for the same work).
#[derive(Debug, Clone, clap::Args)]
pub struct JobUser {
    #[arg(long)]
    pub uid: u32,
    #[arg(long)]
    pub gid: u32,
    #[arg(long)]
    pub user: String,
}

/// Why the helper could not take the job user's identity; it exits before touching a file.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("bad user name {0:?}")]
    BadName(String),
    #[error("{call}: {errno}")]
    Call {
        call: String,
        errno: nix::errno::Errno,
    },
    #[error("could not drop root privileges")]
    StillRoot,
    #[error("the agent exited before the copy started")]
    Orphaned,
}

fn call(call: String) -> impl FnOnce(nix::errno::Errno) -> IdentityError {
    move |errno| IdentityError::Call { call, errno }
}

/// Drops to the user's identity for good. Fails closed: any error ends the helper.
pub fn become_user(uid: u32, gid: u32, user: &str) -> Result<(), IdentityError> {
    if geteuid().as_raw() == uid && uid != 0 {
        return die_with_parent(); // already the user (agent running unprivileged, e.g. in unit tests)
    }
    let name = CString::new(user).map_err(|_| IdentityError::BadName(user.into()))?;
    initgroups(&name, Gid::from_raw(gid)).map_err(call(format!("initgroups({user})")))?;
    setresgid(Gid::from_raw(gid), Gid::from_raw(gid), Gid::from_raw(gid))
        .map_err(call(format!("setresgid({gid})")))?;
    setresuid(Uid::from_raw(uid), Uid::from_raw(uid), Uid::from_raw(uid))
        .map_err(call(format!("setresuid({uid})")))?;
    if uid != 0
        && (setresuid(Uid::from_raw(0), Uid::from_raw(0), Uid::from_raw(0)).is_ok()
            || geteuid().as_raw() != uid)
    {
        return Err(IdentityError::StillRoot);
    }
    die_with_parent()
}

/// The helper must not outlive the agent (a `kill -9`ed agent restarts and re-stages): ask for
/// SIGKILL when the parent dies. Set after the identity change, which clears it.
fn die_with_parent() -> Result<(), IdentityError> {
    nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
        .map_err(call("prctl(PR_SET_PDEATHSIG)".into()))?;
    if nix::unistd::getppid().as_raw() == 1 {
        return Err(IdentityError::Orphaned);
    }
    Ok(())
}

enum Entry {
    Dir(PathBuf, u32),
    File(PathBuf, u64, u32),
    Link(PathBuf),
}

fn io_exit(e: &io::Error) -> i32 {
    match e.kind() {
        io::ErrorKind::NotFound => EXIT_NOT_FOUND,
        io::ErrorKind::PermissionDenied => EXIT_DENIED,
        _ if matches!(e.raw_os_error(), Some(c) if c == libc_enospc() || c == libc_edquot()) => {
            EXIT_NO_SPACE
        }
        _ => EXIT_OTHER,
    }
}

fn libc_enospc() -> i32 {
    nix::errno::Errno::ENOSPC as i32
}
fn libc_edquot() -> i32 {
    nix::errno::Errno::EDQUOT as i32
}

fn walk(root: &Path, rel: &Path, out: &mut Vec<Entry>) -> Result<(), (i32, String)> {
    let dir = root.join(rel);
    let rd = fs::read_dir(&dir)
        .map_err(|e| (io_exit(&e), format!("cannot list {}: {e}", dir.display())))?;
    let mut names: Vec<_> = rd.filter_map(|e| e.ok()).collect();
    names.sort_by_key(|e| e.file_name());
    for e in names {
        let rel_child = rel.join(e.file_name());
        let path = root.join(&rel_child);
        let md = fs::symlink_metadata(&path)
            .map_err(|e| (io_exit(&e), format!("cannot stat {}: {e}", path.display())))?;
        let ft = md.file_type();
        if ft.is_dir() {
            out.push(Entry::Dir(rel_child.clone(), md.mode() & 0o7777));
            walk(root, &rel_child, out)?;
        } else if ft.is_file() {
            out.push(Entry::File(rel_child, md.len(), md.mode() & 0o7777));
        } else if ft.is_symlink() {
            out.push(Entry::Link(rel_child));
        } // sockets, fifos and devices are not data: skipped
    }
    Ok(())
}

/// One regular file to copy: where from, where to, its size when listed and its permission bits.
struct FileJob {
    src: PathBuf,
    dst: PathBuf,
    size: u64,
    mode: u32,
    /// On a Lustre shared tier: `lfs` and the stripe layout the file is created with.
    stripe: Option<(Arc<PathBuf>, StripeClass)>,
    /// A replica's file with units this node does not copy: made before its pieces, and given its
    /// mode by the agent once it wrote the other units (see [`copy_replica`]).
    partial: bool,
    /// A file the node's cache may keep ([`copy_tree_cached`]): the identity it had when this
    /// helper opened it, which every piece's descriptor must still have before and after its copy.
    cache: Option<Identified>,
    /// A resumable copy ([`copy_tree_resumable`]): the file's path below the dataset, reported in
    /// a `whole` line with its source's identity once it is copied whole.
    whole: Option<String>,
}

/// A byte range of one file, the unit a copy thread takes. Files up to [`PIECE`] are one piece;
/// the last piece of a file copies to its end, so a file that grew since the walk is copied whole.
struct Piece {
    file: usize,
    offset: u64,
    /// `None`: to the end of the file.
    len: Option<u64>,
    /// Of a file made before its pieces are copied ([`copy_files`] makes those of several pieces).
    shared: bool,
    /// A peer unit of the file listed as this: copied through a buffer, hashed, and reported.
    unit: Option<usize>,
}

/// The process' umask, so that files and directories are created with their final mode and need no
/// `chmod` afterwards unless the umask strips bits they need.
fn umask() -> u32 {
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Umask:"))
                .and_then(|v| u32::from_str_radix(v.trim(), 8).ok())
        })
        .unwrap_or(0o777) // unknown: always chmod
}

/// `--stage-mode=shard` for the helper: copy only the files this node owns, and write the
/// manifest of the whole dataset next to it (see [`super::shard`]).
#[derive(Debug, Clone)]
pub struct Shard {
    pub plan: ShardPlan,
    /// The dataset's NAME (the first component of every manifest path).
    pub dataset: String,
    /// The source as the job gave it, for the manifest.
    pub source: String,
    /// Into the job's directory on the shared tier, which the job's other nodes write into too:
    /// directories may exist, a file left by an earlier run is replaced, and no manifest is
    /// written (every node sees every file).
    pub shared_tier: bool,
    /// On a Lustre shared tier: `lfs`, and the stripe classes files are created with.
    pub stripes: Option<(Arc<PathBuf>, Vec<StripeClass>)>,
    /// `Some`: not a shard but `--stage-mode=replicate` through the job's peers (see
    /// [`copy_replica`]): every file is made here, and of its bytes this node copies the
    /// `peer.unit_size` units it owns among `plan`'s nodes.
    pub peers: Option<PeerCopy>,
}

/// How the helper takes part in a dataset the job's nodes share through their peers.
#[derive(Debug, Clone, Copy)]
pub struct PeerCopy {
    pub unit_size: u64,
    /// Copy the units the agent names on stdin into the files an earlier run made (the units of
    /// a peer that was routed around), rather than the dataset.
    pub repair: bool,
    /// The node has a cache: report every file's identity and take the agent's answers on stdin
    /// first (see [`copy_replica`]).
    pub cached: bool,
}

/// The stripe layout a copied file of `size` bytes is created with, if any.
fn stripe_for(shard: Option<&Shard>, size: u64) -> Option<(Arc<PathBuf>, StripeClass)> {
    let (lfs, classes) = shard?.stripes.as_ref()?;
    StripeClass::for_size(classes, size).map(|c| (lfs.clone(), *c))
}

/// The helper's `--shard-nodes`/`--shard-node`/`--dataset`/`--source`, as the agent passes them.
#[derive(Debug, Clone, clap::Args)]
pub struct ShardArgs {
    /// The job's nodes, comma-separated: copy only this node's share.
    #[arg(long, requires_all = ["shard_node", "dataset", "source"])]
    pub shard_nodes: Option<String>,
    #[arg(long)]
    pub shard_node: Option<String>,
    #[arg(long)]
    pub dataset: Option<String>,
    #[arg(long)]
    pub source: Option<String>,
    /// `--dst` is on the shared tier (with the shard arguments).
    #[arg(long, requires = "shard_nodes")]
    pub shared_tier: bool,
    /// `lfs`, for `--stripe` (a Lustre shared tier).
    #[arg(long, requires = "shared_tier")]
    pub lfs: Option<PathBuf>,
    /// A stripe class, `MIN_SIZE:COUNT:SIZE` in bytes: files of at least MIN_SIZE bytes (and below
    /// the next class's) are created with `lfs setstripe -c COUNT -S SIZE`.
    #[arg(long, requires = "lfs")]
    pub stripe: Vec<String>,
    /// Not a shard: every file of the dataset is made here, and of its bytes only the units of
    /// this many bytes that this node owns among `--shard-nodes` are copied (replicate through
    /// the job's peers; the agent fetches the rest from their owners).
    #[arg(long, requires = "shard_nodes", conflicts_with = "shared_tier")]
    pub peer_unit_size: Option<u64>,
    /// With `--peer-unit-size`: copy the units named on stdin (`IDX OFFSET LEN "PATH"` lines)
    /// into the files an earlier run made.
    #[arg(long, requires = "peer_unit_size")]
    pub peer_repair: bool,
    /// With `--peer-unit-size`, on a node with a cache: report each file's identity, then read
    /// the agent's `hit IDX` answers on stdin; hits are only made, for the agent to write.
    #[arg(long, requires = "peer_unit_size", conflicts_with = "peer_repair")]
    pub peer_cached: bool,
    /// A takeover on the shared tier: of the files this node of `--takeover-nodes` (the job's
    /// whole node list) owned, copy those this node owns among `--shard-nodes` (the survivors).
    #[arg(long, requires_all = ["shared_tier", "takeover_nodes"])]
    pub takeover_of: Option<String>,
    #[arg(long, requires = "takeover_of")]
    pub takeover_nodes: Option<String>,
}

impl ShardArgs {
    /// The shard to copy, `None` for the whole dataset; an error when this node is not one of the
    /// nodes given.
    pub fn shard(self) -> Result<Option<Shard>, String> {
        let (Some(nodes), Some(node), Some(dataset), Some(source)) =
            (self.shard_nodes, self.shard_node, self.dataset, self.source)
        else {
            return Ok(None);
        };
        let nodes: Vec<String> = nodes.split(',').map(String::from).collect();
        let mut plan = ShardPlan::new(&nodes, &node)
            .ok_or_else(|| format!("node {node} is not one of the job's nodes {nodes:?}"))?;
        if let (Some(lost), Some(all)) = (&self.takeover_of, &self.takeover_nodes) {
            let all: Vec<String> = all.split(',').map(String::from).collect();
            plan = ShardPlan::new(&all, &node)
                .and_then(|p| p.takeover(lost, &nodes))
                .ok_or_else(|| {
                    format!("no takeover of node {lost} of {all:?} by {node} among {nodes:?}")
                })?;
        }
        let mut classes = Vec::new();
        for c in &self.stripe {
            let bad = || format!("--stripe {c}: expected MIN_SIZE:COUNT:SIZE in bytes");
            let mut it = c.split(':');
            let (Some(min), Some(count), Some(size), None) =
                (it.next(), it.next(), it.next(), it.next())
            else {
                return Err(bad());
            };
            classes.push(StripeClass {
                min_size: min.parse().map_err(|_| bad())?,
                count: count.parse().map_err(|_| bad())?,
                size: size.parse().map_err(|_| bad())?,
            });
        }
        let stripes = self
            .lfs
            .filter(|_| !classes.is_empty())
            .map(|lfs| (Arc::new(lfs), classes));
        if self.peer_unit_size == Some(0) {
            return Err("--peer-unit-size must be at least 1".into());
        }
        let peers = self.peer_unit_size.map(|unit_size| PeerCopy {
            unit_size,
            repair: self.peer_repair,
            cached: self.peer_cached,
        });
        Ok(Some(Shard {
            plan,
            dataset,
            source,
            shared_tier: self.shared_tier,
            stripes,
            peers,
        }))
    }
}

/// Copies `src` (a file or a directory tree) to `dst`, which must not exist. Returns an exit code and
/// message on failure. Symlinks inside the tree are copied as symlinks. Nothing is fsynced: staged
/// data can be fetched again from its origin, and job end deletes it.
pub fn copy_tree(src: &Path, dst: &Path, out: &mut impl Write) -> Result<(), (i32, String)> {
    copy_tree_in_pieces(src, dst, piece_for(src, dst), None, None, out)
}

/// [`copy_tree`] of this node's share of the files only, with the manifest of all of them
/// written next to `dst` (`NAME.shard.json`); or, with [`Shard::peers`], this node's part of a
/// replica shared through the job's peers ([`copy_replica`], [`copy_repair`]).
pub fn copy_shard(
    src: &Path,
    dst: &Path,
    shard: &Shard,
    out: &mut impl Write,
) -> Result<(), (i32, String)> {
    match shard.peers {
        Some(PeerCopy { repair: true, .. }) => copy_repair(src, dst, io::stdin().lock(), out),
        Some(PeerCopy {
            unit_size, cached, ..
        }) => {
            let answers = cached.then(|| io::stdin().lock());
            copy_replica(src, dst, shard, unit_size, answers, out)
        }
        None => copy_tree_in_pieces(src, dst, piece_for(src, dst), Some(shard), None, out),
    }
}

/// `src` as the walk found it: a directory (its mode, and every entry below it) or one file
/// (a single [`Entry::File`] at the empty path).
struct Tree {
    dir: Option<u32>,
    entries: Vec<Entry>,
}

impl Tree {
    fn read(src: &Path) -> Result<Tree, (i32, String)> {
        let top =
            fs::metadata(src).map_err(|e| (io_exit(&e), format!("{}: {e}", src.display())))?;
        if top.is_file() {
            let file = Entry::File(PathBuf::new(), top.len(), top.mode() & 0o7777);
            Ok(Tree {
                dir: None,
                entries: vec![file],
            })
        } else if top.is_dir() {
            let mut entries = Vec::new();
            walk(src, Path::new(""), &mut entries)?;
            Ok(Tree {
                dir: Some(top.mode() & 0o7777),
                entries,
            })
        } else {
            Err((
                EXIT_OTHER,
                format!("{} is neither a file nor a directory", src.display()),
            ))
        }
    }

    /// The regular files: path below the source, size, mode.
    fn files(&self) -> impl Iterator<Item = (&Path, u64, u32)> {
        self.entries.iter().filter_map(|e| match e {
            Entry::File(rel, size, mode) => Some((rel.as_path(), *size, *mode)),
            _ => None,
        })
    }

    /// Creates the directories and symbolic links of a directory tree below `dst` (nothing for a
    /// file). Directories are created owner-writable (the copy needs to write into them), with
    /// their final mode at once; chmod only where the umask strips bits. With `replace`, `dst`
    /// holds what an earlier run left: a directory there is used (given its mode), anything
    /// else where a directory or link goes is replaced.
    fn make(
        &self,
        src: &Path,
        dst: &Path,
        umask: u32,
        shared_tier: bool,
        replace: bool,
    ) -> Result<(), (i32, String)> {
        let Some(top_mode) = self.dir else {
            return Ok(());
        };
        let mkdir = |p: &Path, mode: u32| {
            let mode = mode | 0o700;
            if replace {
                match fs::symlink_metadata(p) {
                    Ok(m) if m.is_dir() => {
                        return fs::set_permissions(p, fs::Permissions::from_mode(mode))
                            .map_err(|e| job_error("setting the mode of", p, e));
                    }
                    Ok(_) => remove_any(p).map_err(|e| job_error("replacing", p, e))?,
                    Err(_) => {}
                }
            }
            let made = fs::DirBuilder::new().mode(mode).create(p);
            // On the shared tier another node of the job may have made it (a directory of the
            // job user's: this process is the job user and creates nothing through a link).
            if shared_tier
                && matches!(&made, Err(e) if e.kind() == io::ErrorKind::AlreadyExists)
                && fs::symlink_metadata(p).is_ok_and(|m| m.is_dir())
            {
                return Ok(());
            }
            made.and_then(|_| {
                if mode & umask != 0 {
                    fs::set_permissions(p, fs::Permissions::from_mode(mode))
                } else {
                    Ok(())
                }
            })
            .map_err(|e| (io_exit(&e), format!("creating {}: {e}", p.display())))
        };
        mkdir(dst, top_mode)?;
        for e in &self.entries {
            match e {
                Entry::Dir(rel, mode) => mkdir(&dst.join(rel), *mode)?,
                Entry::Link(rel) => {
                    let target = fs::read_link(src.join(rel)).map_err(|e| {
                        (io_exit(&e), format!("reading link {}: {e}", rel.display()))
                    })?;
                    if replace {
                        remove_any(&dst.join(rel))
                            .map_err(|e| job_error("replacing", &dst.join(rel), e))?;
                    }
                    std::os::unix::fs::symlink(target, dst.join(rel)).map_err(|e| {
                        (io_exit(&e), format!("creating link {}: {e}", rel.display()))
                    })?;
                }
                Entry::File(..) => {}
            }
        }
        Ok(())
    }
}

/// `root/rel`, or `root` itself for the empty path (a dataset that is one file).
fn below(root: &Path, rel: &Path) -> PathBuf {
    if rel.as_os_str().is_empty() {
        root.to_path_buf()
    } else {
        root.join(rel)
    }
}

/// [`copy_tree`], with files larger than `piece` bytes copied as several pieces; with `shard`, only
/// the files this node owns.
///
/// With `resume` (a resumable copy, [`copy_tree_resumable`]): `dst` may hold what an earlier run
/// left; the files `resume` names whose source is still the version named are kept, everything
/// else there that is not part of the tree goes, and every file copied whole is reported.
fn copy_tree_in_pieces(
    src: &Path,
    dst: &Path,
    piece: u64,
    shard: Option<&Shard>,
    resume: Option<&HashMap<String, FileIdent>>,
    out: &mut impl Write,
) -> Result<(), (i32, String)> {
    let tree = Tree::read(src)?;
    let umask = umask();
    let mut manifest = shard.map(|s| ShardManifest::new(&s.plan, &s.dataset, &s.source));
    // Whether this node copies the file at `rel` below the dataset ("" for a dataset that is one
    // file), listing it in the manifest.
    let mut mine = |rel: &Path, size: u64| match (shard, manifest.as_mut()) {
        (Some(s), Some(m)) => {
            let path = if rel.as_os_str().is_empty() {
                s.dataset.clone()
            } else {
                format!("{}/{}", s.dataset, rel.to_string_lossy())
            };
            let owned = s.plan.owns(&path);
            m.add(&s.plan, path, size);
            owned
        }
        _ => true,
    };
    let mut files: Vec<FileJob> = Vec::new();
    for (rel, size, mode) in tree.files() {
        if mine(rel, size) {
            files.push(FileJob {
                src: below(src, rel),
                dst: below(dst, rel),
                size,
                mode,
                stripe: stripe_for(shard, size),
                partial: false,
                cache: None,
                // A name that is not UTF-8 cannot be noted: copied again after a restart.
                whole: resume.and(rel.to_str()).map(String::from),
            });
        }
    }
    let bytes: u64 = files.iter().map(|f| f.size).sum();
    writeln!(out, "total {} {bytes}", files.len()).ok();
    out.flush().ok();
    let shared_tier = shard.is_some_and(|s| s.shared_tier);
    if let Some(keep) = resume {
        let kept;
        (kept, files) = keep_unchanged(files, keep);
        let kept_bytes: u64 = kept.iter().map(|f| f.size).sum();
        writeln!(out, "kept {} {kept_bytes}", kept.len()).ok();
        out.flush().ok();
        clear_leftovers(dst, &tree, &kept)?;
    }
    tree.make(src, dst, umask, shared_tier, resume.is_some())?;
    if tree.dir.is_some() {
        files = interleave_directories(files);
    }
    if shared_tier {
        // This node owns these names now: what an earlier run of the job id left goes.
        for f in &files {
            match fs::remove_file(&f.dst) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => {
                    return Err(job_error("replacing", &f.dst, e));
                }
                _ => {}
            }
        }
    }
    copy_files(&files, umask, piece, out)?;
    match (shard, manifest) {
        (Some(s), Some(m)) if !s.shared_tier => write_manifest(dst, &s.dataset, m),
        _ => Ok(()),
    }
}

// ----------------------------------------------------------- resumed after an agent restart

/// [`copy_tree`] (or, with `shard`, [`copy_shard`]'s share of the files) that a restarted agent
/// can resume (`--resume`, see [`super::resume`]). `dst` may hold what an earlier run of this
/// copy left. First the helper reads the agent's offers on `input` to their end: `keep SIZE DEV
/// INO MTIME MTIME_NS CTIME CTIME_NS "PATH"` for each file the agent noted as copied whole from
/// the source at PATH (below the dataset, JSON-quoted, `""` for a dataset that is one file) while
/// it had that identity, and whose staged copy the agent found unchanged since. After `total`, it keeps each
/// offered file whose source it opens now, as the job user, with exactly that identity, and
/// reports `kept F B`; everything else below `dst` that is not one of the tree's directories goes,
/// and the rest of the tree is made and copied as by [`copy_tree`]. Each file it copies whole, from
/// a source whose identity was the same before and after every piece, is reported as `whole SIZE
/// DEV INO MTIME MTIME_NS CTIME CTIME_NS "PATH"` (with its mode set), for the agent to note.
pub fn copy_tree_resumable(
    src: &Path,
    dst: &Path,
    shard: Option<&Shard>,
    input: impl io::BufRead,
    out: &mut impl Write,
) -> Result<(), (i32, String)> {
    let mut keep = HashMap::new();
    for line in input.lines() {
        let line = line.map_err(|e| (EXIT_OTHER, format!("reading the agent's offers: {e}")))?;
        let offer = line.strip_prefix("keep ").and_then(parse_ident_fields);
        let Some((file, path)) = offer else {
            return Err((EXIT_OTHER, format!("bad offer from the agent: {line:?}")));
        };
        keep.insert(path, file);
    }
    copy_tree_in_pieces(src, dst, piece_for(src, dst), shard, Some(&keep), out)
}

/// A file and its source's identity, as `keep` and `whole` lines carry them.
fn ident_fields(file: &FileIdent, path: &str) -> String {
    let quoted = serde_json::to_string(path).expect("a string serializes");
    format!("{} {quoted}", file.fields())
}

fn parse_ident_fields(text: &str) -> Option<(FileIdent, String)> {
    let mut it = text.splitn(FileIdent::FIELDS + 1, ' ');
    let file = FileIdent::parse_fields(&mut it)?;
    let path = serde_json::from_str(it.next()?).ok()?;
    Some((file, path))
}

/// What the agent offers a resumable copy to keep (see [`copy_tree_resumable`]): one line.
pub fn keep_line(file: &FileIdent, path: &str) -> String {
    format!("keep {}\n", ident_fields(file, path))
}

/// The lines of a resumable copy beyond [`Event`]'s (see [`copy_tree_resumable`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResumeLine {
    /// Of the files offered, these were kept: their source is the version they were copied from.
    Kept { files: u64, bytes: u64 },
    /// The file at `path` (below the dataset) is copied whole, with its mode, from a source whose
    /// identity was `file` before and after every piece of the copy.
    Whole { file: FileIdent, path: String },
}

impl ResumeLine {
    pub fn parse(line: &str) -> Option<ResumeLine> {
        let (kind, rest) = line.split_once(' ')?;
        match kind {
            "kept" => {
                let (files, bytes) = rest.split_once(' ')?;
                Some(ResumeLine::Kept {
                    files: files.parse().ok()?,
                    bytes: bytes.parse().ok()?,
                })
            }
            "whole" => {
                parse_ident_fields(rest).map(|(file, path)| ResumeLine::Whole { file, path })
            }
            _ => None,
        }
    }
}

/// Splits `files` into those `keep` offers whose source, opened now, is the version offered
/// (kept), and the rest (to copy). A source that cannot be opened is copied, and fails as it does.
fn keep_unchanged(
    files: Vec<FileJob>,
    keep: &HashMap<String, FileIdent>,
) -> (Vec<FileJob>, Vec<FileJob>) {
    files.into_iter().partition(|f| {
        let offered = f.whole.as_ref().and_then(|path| keep.get(path));
        offered.is_some_and(|want| {
            open_source(&f.src)
                .ok()
                .and_then(|opened| FileIdent::of(&opened).ok().flatten())
                == Some(*want)
        })
    })
}

/// Removes what an earlier run left at `dst` besides the `kept` files and the tree's directories:
/// files cut short or to be copied again, links (made again), names no longer in the source.
/// This process is the job user and removes nothing through a link.
fn clear_leftovers(dst: &Path, tree: &Tree, kept: &[FileJob]) -> Result<(), (i32, String)> {
    let fail = |p: &Path, e: io::Error| job_error("removing", p, e);
    if tree.dir.is_none() {
        // A dataset that is one file: it is `dst`, kept or copied again.
        return match kept.is_empty() {
            true => remove_any(dst).map_err(|e| fail(dst, e)),
            false => Ok(()),
        };
    }
    match fs::symlink_metadata(dst) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return remove_any(dst).map_err(|e| fail(dst, e)),
        Err(_) => return Ok(()),
    }
    let mut stays: std::collections::HashSet<PathBuf> =
        kept.iter().map(|f| f.dst.clone()).collect();
    for e in &tree.entries {
        if let Entry::Dir(rel, _) = e {
            stays.insert(dst.join(rel));
        }
    }
    let mut dirs = vec![dst.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        let listed = fs::read_dir(&dir).map_err(|e| fail(&dir, e))?;
        for e in listed {
            let path = e.map_err(|e| fail(&dir, e))?.path();
            let is_dir = fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir());
            if !stays.contains(&path) {
                remove_any(&path).map_err(|e| fail(&path, e))?;
            } else if is_dir {
                dirs.push(path);
            }
        }
    }
    Ok(())
}

/// Removes `path`, a directory with everything below it, never following a link; what is not
/// there counts as removed.
fn remove_any(path: &Path) -> io::Result<()> {
    let removed = match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
        Err(e) => Err(e),
    };
    match removed {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

// ------------------------------------------------------------------------- with the node's cache

/// The identity of a source file as `fstat` of a descriptor opened for reading gives it: what a
/// cache entry of a POSIX file is keyed by (with its path and the user), see [`crate::cache`].
///
/// The ctime is part of it: a user can rewrite a file and set its mtime back (`touch -d`,
/// `utimensat`), but any change to a file sets its ctime to now, and nobody can set that back.
/// (Staging logs written before it was kept name no ctime, which then matches no file: those files
/// are copied again.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FileIdent {
    pub dev: u64,
    pub ino: u64,
    pub size: u64,
    pub mtime: i64,
    pub mtime_ns: i64,
    /// `st_ctime` and `st_ctime_nsec`.
    #[serde(default)]
    pub ctime: i64,
    #[serde(default)]
    pub ctime_ns: i64,
}

impl FileIdent {
    /// How many fields `ident` and `keep`/`whole` lines carry ([`FileIdent::fields`]).
    const FIELDS: usize = 7;

    /// The fields `ident` and `keep`/`whole` lines carry, in order: size, dev, ino, mtime,
    /// mtime_ns, ctime, ctime_ns.
    fn fields(&self) -> String {
        format!(
            "{} {} {} {} {} {} {}",
            self.size, self.dev, self.ino, self.mtime, self.mtime_ns, self.ctime, self.ctime_ns
        )
    }

    /// Parses [`FileIdent::fields`].
    fn parse_fields<'a>(it: &mut impl Iterator<Item = &'a str>) -> Option<FileIdent> {
        Some(FileIdent {
            size: it.next()?.parse().ok()?,
            dev: it.next()?.parse().ok()?,
            ino: it.next()?.parse().ok()?,
            mtime: it.next()?.parse().ok()?,
            mtime_ns: it.next()?.parse().ok()?,
            ctime: it.next()?.parse().ok()?,
            ctime_ns: it.next()?.parse().ok()?,
        })
    }

    /// The identity of the file open as `f`; `None` for anything but a regular file.
    pub(crate) fn of(f: &fs::File) -> io::Result<Option<FileIdent>> {
        let m = f.metadata()?;
        Ok(m.is_file().then(|| FileIdent {
            dev: m.dev(),
            ino: m.ino(),
            size: m.len(),
            mtime: m.mtime(),
            mtime_ns: m.mtime_nsec(),
            ctime: m.ctime(),
            ctime_ns: m.ctime_nsec(),
        }))
    }
}

/// A file of a cached copy: its number in the `ident` lines, its identity then, and the piece
/// size its hash is taken in.
#[derive(Debug, Clone, Copy)]
struct Identified {
    idx: usize,
    file: FileIdent,
    piece: u64,
}

/// The hash a cached copy reports for a file (`copied IDX PIECE HASH`): the BLAKE3 of the BLAKE3
/// hashes of its `PIECE`-byte ranges, in order. The helper's copy threads hash the pieces they
/// copy; the agent hashes the staged file the same way before it keeps it.
pub fn piece_hashes_hash(pieces: &[blake3::Hash]) -> blake3::Hash {
    let mut h = blake3::Hasher::new();
    for p in pieces {
        h.update(p.as_bytes());
    }
    h.finalize()
}

/// The lines of a cached copy beyond [`Event`]'s (see [`copy_tree_cached`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheLine {
    /// A regular, non-empty file of the dataset, opened for reading as the job user, with the
    /// identity and mode `fstat` gave on that descriptor; `path` below the dataset (`""` for a
    /// dataset that is one file).
    Ident {
        idx: usize,
        file: FileIdent,
        mode: u32,
        path: String,
    },
    /// Every file is identified: the helper now reads the agent's answers.
    Idents { count: usize },
    /// File `idx` is made, owner-writable and empty, for the agent to write from its cache.
    Cached { idx: usize },
    /// File `idx` was copied from a descriptor whose identity stayed the one reported, before
    /// and after each piece; its hash ([`piece_hashes_hash`]) in pieces of `piece` bytes.
    Copied {
        idx: usize,
        piece: u64,
        hash: blake3::Hash,
    },
}

impl CacheLine {
    pub fn parse(line: &str) -> Option<CacheLine> {
        // kind, idx, the identity's fields, mode, path.
        let mut it = line.splitn(FileIdent::FIELDS + 4, ' ');
        let kind = it.next()?;
        let line = match kind {
            "ident" => {
                let idx = it.next()?.parse().ok()?;
                let file = FileIdent::parse_fields(&mut it)?;
                let mode = u32::from_str_radix(it.next()?, 8).ok()?;
                let path = serde_json::from_str(it.next()?).ok()?;
                return Some(CacheLine::Ident {
                    idx,
                    file,
                    mode,
                    path,
                });
            }
            "idents" => CacheLine::Idents {
                count: it.next()?.parse().ok()?,
            },
            "cached" => CacheLine::Cached {
                idx: it.next()?.parse().ok()?,
            },
            "copied" => CacheLine::Copied {
                idx: it.next()?.parse().ok()?,
                piece: it.next()?.parse().ok()?,
                hash: blake3::Hash::from_hex(it.next()?).ok()?,
            },
            _ => return None,
        };
        it.next().is_none().then_some(line)
    }
}

/// [`copy_tree`] on a node with a cache (`--cached`), which the agent asks about every file. The
/// helper opens each regular, non-empty file of the source for reading, as the job user, and
/// reports its identity from `fstat` on that descriptor (`ident IDX SIZE DEV INO MTIME MTIME_NS
/// CTIME CTIME_NS MODE "PATH"`, after `total`), then `idents N`; a file it cannot open fails the copy before
/// anything is made (a user who cannot read a file gets nothing of it, from the cache or else).
/// It then reads the agent's answers on `input` to their end: `hit IDX` for each file the agent
/// holds in its cache for this user and this identity. It makes the tree; each hit as an empty
/// owner-writable file (`cached IDX`), which the agent writes from its cache and gives its mode;
/// and copies every other file, hashing each identified one as it copies it: `copied IDX PIECE
/// HASH` when every piece's descriptor had the reported identity before and after its copy and
/// gave exactly its size (a file that changed meanwhile is staged as read, but not cached).
pub fn copy_tree_cached(
    src: &Path,
    dst: &Path,
    input: impl io::BufRead,
    out: &mut impl Write,
) -> Result<(), (i32, String)> {
    copy_cached_in_pieces(src, dst, PIECE, input, out)
}

fn copy_cached_in_pieces(
    src: &Path,
    dst: &Path,
    piece: u64,
    input: impl io::BufRead,
    out: &mut impl Write,
) -> Result<(), (i32, String)> {
    let tree = Tree::read(src)?;
    let umask = umask();
    let mut files: Vec<FileJob> = tree
        .files()
        .map(|(rel, size, mode)| FileJob {
            src: below(src, rel),
            dst: below(dst, rel),
            size,
            mode,
            stripe: None,
            partial: false,
            cache: None,
            whole: None,
        })
        .collect();
    let bytes: u64 = files.iter().map(|f| f.size).sum();
    writeln!(out, "total {} {bytes}", files.len()).ok();
    out.flush().ok();
    let mut listed = 0;
    for f in files.iter_mut() {
        let opened = open_source(&f.src)?;
        let Some(file) = FileIdent::of(&opened).map_err(|e| job_error("reading", &f.src, e))?
        else {
            continue; // no longer a regular file: copied as today (and failing as it does)
        };
        let rel = f.src.strip_prefix(src).ok().and_then(Path::to_str);
        let (Some(rel), true) = (rel, file.size > 0) else {
            continue;
        };
        let mode = opened.metadata().map_or(f.mode, |m| m.mode() & 0o7777);
        f.size = file.size;
        f.cache = Some(Identified {
            idx: listed,
            file,
            piece,
        });
        let quoted = serde_json::to_string(rel).expect("a string serializes");
        writeln!(out, "ident {listed} {} {mode:o} {quoted}", file.fields()).ok();
        listed += 1;
    }
    writeln!(out, "idents {listed}").ok();
    out.flush().ok();
    let mut hit = vec![false; listed];
    for line in input.lines() {
        let line = line.map_err(|e| (EXIT_OTHER, format!("reading the agent's answers: {e}")))?;
        match line
            .strip_prefix("hit ")
            .and_then(|i| i.parse::<usize>().ok())
        {
            Some(idx) if idx < listed && !hit[idx] => hit[idx] = true,
            _ => {
                return Err((
                    EXIT_OTHER,
                    format!("bad cache answer from the agent: {line:?}"),
                ));
            }
        }
    }
    tree.make(src, dst, umask, false, false)?;
    let mut rest = Vec::with_capacity(files.len());
    for f in files {
        match f.cache {
            Some(c) if hit[c.idx] => {
                create_dst(&f, f.mode | 0o200, umask)?;
                writeln!(out, "cached {}", c.idx).ok();
            }
            _ => rest.push(f),
        }
    }
    out.flush().ok();
    if tree.dir.is_some() {
        rest = interleave_directories(rest);
    }
    copy_files(&rest, umask, piece, out)
}

/// Opens a source file for reading, never through a link (the walk found a regular file there).
fn open_source(path: &Path) -> Result<fs::File, (i32, String)> {
    fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
        .open(path)
        .map_err(|e| job_error("opening", path, e))
}

/// The unit file name of the file at `rel` below a dataset named `dataset` (`NAME/rel`, or
/// `NAME` for a dataset that is one file), as the agents of the job name its units to each other.
pub fn peer_unit_file(dataset: &str, rel: &str) -> String {
    if rel.is_empty() {
        dataset.to_string()
    } else {
        format!("{dataset}/{rel}")
    }
}

/// Whether this node's helper copies `unit` from the origin: the units this node owns among
/// `plan`'s nodes, and every empty one (nothing to read, so every node makes its own). The
/// agent decides with this too which units it must fetch from the job's other nodes.
pub fn copies_unit(plan: &ShardPlan, unit: &Unit) -> bool {
    unit.len == 0 || plan.owns(&unit.key())
}

/// `--stage-mode=replicate` through the job's peers, the helper's part. It makes the whole tree
/// as the job user: every directory and link, and every file, each opened for reading first, so
/// the user's own permission on every file gates the dataset on every node. Of the bytes, it
/// copies the `unit_size` units this node owns ([`copies_unit`]), hashing each as it copies it.
/// The files with units it does not copy are made owner-writable and left to the agent, which
/// writes the other units into them (fetched from their owners) and gives them their mode.
///
/// On `out`, after `total F B` (the whole dataset): `file IDX SIZE MODE "PATH"` for every file
/// (MODE octal, PATH JSON-quoted, below the dataset), once the files the agent writes into are
/// made; then `unit IDX OFFSET HASH` for each unit copied (BLAKE3, hex) as it is done, and the
/// usual `progress F B` (F counting the files written whole here). A file whose name is not UTF-8
/// cannot be a unit's name: it is copied whole here, as on every node, and not listed.
///
/// With `answers` (`--peer-cached`, a node with a cache), the helper first opens every listed,
/// regular, non-empty file for reading and reports its identity from `fstat` on that descriptor
/// (`ident IDX SIZE DEV INO MTIME MTIME_NS CTIME CTIME_NS MODE "PATH"`, IDX as in its `file`
/// line; a file it cannot open fails the run as without a cache), then `idents N`, and reads the
/// agent's `hit IDX` answers to their end. A hit is made empty and owner-writable and none of its units is copied:
/// the agent writes it whole from its cache. Of every other identified file, a unit whose
/// descriptor did not have the reported identity before and after its copy is followed by
/// `changed IDX` (the agent does not cache that file).
fn copy_replica(
    src: &Path,
    dst: &Path,
    shard: &Shard,
    unit_size: u64,
    answers: Option<impl io::BufRead>,
    out: &mut impl Write,
) -> Result<(), (i32, String)> {
    let tree = Tree::read(src)?;
    let umask = umask();
    let mut files: Vec<FileJob> = Vec::new();
    for (rel, size, mode) in tree.files() {
        files.push(FileJob {
            src: below(src, rel),
            dst: below(dst, rel),
            size,
            mode,
            stripe: None,
            partial: false,
            cache: None,
            whole: None,
        });
    }
    let bytes: u64 = files.iter().map(|f| f.size).sum();
    writeln!(out, "total {} {bytes}", files.len()).ok();
    out.flush().ok();
    tree.make(src, dst, umask, false, false)?;
    if tree.dir.is_some() {
        files = interleave_directories(files);
    }
    let mut pieces = Vec::new();
    let mut listed = Vec::new();
    // Each file's number in the `file` lines (`None`: not listed, copied whole here).
    let numbers: Vec<Option<usize>> = {
        let mut n = 0;
        files
            .iter()
            .map(|f| {
                let rel = f.src.strip_prefix(src).unwrap_or(Path::new(""));
                rel.to_str().map(|_| {
                    n += 1;
                    n - 1
                })
            })
            .collect()
    };
    let hits = match answers {
        Some(input) => identify_replica(src, &mut files, &numbers, unit_size, input, out)?,
        None => Vec::new(),
    };
    for (i, f) in files.iter_mut().enumerate() {
        let rel = f.src.strip_prefix(src).unwrap_or(Path::new(""));
        let Some(rel) = rel.to_str() else {
            pieces.push(Piece {
                file: i,
                offset: 0,
                len: None,
                shared: false,
                unit: None,
            });
            continue;
        };
        if f.cache.is_some_and(|c| hits.get(c.idx) == Some(&true)) {
            // Written whole by the agent, from its cache.
            f.partial = true;
            create_dst(f, f.mode | 0o200, umask)?;
            listed.push((f.size, f.mode, rel.to_string()));
            continue;
        }
        let units = units_of(&peer_unit_file(&shard.dataset, rel), f.size, unit_size);
        let here: Vec<&Unit> = units
            .iter()
            .filter(|u| copies_unit(&shard.plan, u))
            .collect();
        f.partial = here.len() < units.len();
        // Made now: the files the agent writes into (before it hears of them), and those of
        // several units (each unit opens the file).
        let made = f.partial || here.len() > 1;
        if made {
            create_pair(f, f.mode | 0o200, umask)?;
        }
        let idx = listed.len();
        for u in here {
            pieces.push(Piece {
                file: i,
                offset: u.offset,
                len: Some(u.len),
                shared: made,
                unit: Some(idx),
            });
        }
        listed.push((f.size, f.mode, rel.to_string()));
    }
    for (idx, (size, mode, rel)) in listed.iter().enumerate() {
        let quoted = serde_json::to_string(rel).expect("a string serializes");
        writeln!(out, "file {idx} {size} {mode:o} {quoted}").ok();
    }
    out.flush().ok();
    run_pieces(&files, &pieces, umask, out)
}

/// The cached part of [`copy_replica`]: identifies the listed files (`numbers`), reports them and
/// reads the agent's answers; returns which listed files are hits.
fn identify_replica(
    src: &Path,
    files: &mut [FileJob],
    numbers: &[Option<usize>],
    unit_size: u64,
    input: impl io::BufRead,
    out: &mut impl Write,
) -> Result<Vec<bool>, (i32, String)> {
    let mut identified = 0;
    let listed = numbers.iter().flatten().count();
    for (f, idx) in files.iter_mut().zip(numbers) {
        let Some(idx) = *idx else { continue };
        let opened = open_source(&f.src)?;
        let Some(file) = FileIdent::of(&opened).map_err(|e| job_error("reading", &f.src, e))?
        else {
            continue; // no longer a regular file: copied as without a cache (and failing so)
        };
        if file.size == 0 {
            continue;
        }
        let rel = f.src.strip_prefix(src).ok().and_then(Path::to_str);
        let rel = rel.unwrap_or("");
        f.size = file.size;
        f.cache = Some(Identified {
            idx,
            file,
            piece: unit_size,
        });
        let quoted = serde_json::to_string(rel).expect("a string serializes");
        writeln!(out, "ident {idx} {} {:o} {quoted}", file.fields(), f.mode).ok();
        identified += 1;
    }
    writeln!(out, "idents {identified}").ok();
    out.flush().ok();
    let ok: Vec<bool> = {
        let mut ok = vec![false; listed];
        for f in files.iter() {
            if let Some(c) = f.cache {
                ok[c.idx] = true;
            }
        }
        ok
    };
    let mut hit = vec![false; listed];
    for line in input.lines() {
        let line = line.map_err(|e| (EXIT_OTHER, format!("reading the agent's answers: {e}")))?;
        match line
            .strip_prefix("hit ")
            .and_then(|i| i.parse::<usize>().ok())
        {
            Some(idx) if idx < listed && ok[idx] && !hit[idx] => hit[idx] = true,
            _ => {
                return Err((
                    EXIT_OTHER,
                    format!("bad cache answer from the agent: {line:?}"),
                ));
            }
        }
    }
    Ok(hit)
}

/// The repair run of a replica: copies, as the job user, the units the agent names on `input`
/// (`IDX OFFSET LEN "PATH"` lines; PATH JSON-quoted, below the dataset, "" for a dataset that
/// is one file) into the files the first run made, hashing each; reports `total`, then
/// `unit IDX OFFSET HASH` per unit as [`copy_replica`] does. The agent asks for these when the
/// node that owns them was routed around.
fn copy_repair(
    src: &Path,
    dst: &Path,
    input: impl io::BufRead,
    out: &mut impl Write,
) -> Result<(), (i32, String)> {
    let bad = |line: &str| {
        (
            EXIT_OTHER,
            format!("bad unit request from the agent: {line:?}"),
        )
    };
    let (mut files, mut pieces) = (Vec::new(), Vec::new());
    for line in input.lines() {
        let line = line.map_err(|e| (EXIT_OTHER, format!("reading the agent's requests: {e}")))?;
        let mut it = line.splitn(4, ' ');
        let (Some(idx), Some(offset), Some(len), Some(quoted)) =
            (it.next(), it.next(), it.next(), it.next())
        else {
            return Err(bad(&line));
        };
        let (Ok(idx), Ok(offset), Ok(len), Ok(rel)) = (
            idx.parse::<usize>(),
            offset.parse::<u64>(),
            len.parse::<u64>(),
            serde_json::from_str::<String>(quoted),
        ) else {
            return Err(bad(&line));
        };
        let rel = Path::new(&rel);
        if rel
            .components()
            .any(|c| !matches!(c, std::path::Component::Normal(_)))
        {
            return Err(bad(&line));
        }
        pieces.push(Piece {
            file: files.len(),
            offset,
            len: Some(len),
            shared: true,
            unit: Some(idx),
        });
        files.push(FileJob {
            src: below(src, rel),
            dst: below(dst, rel),
            size: len,
            mode: 0,
            stripe: None,
            partial: true,
            cache: None,
            whole: None,
        });
    }
    let bytes: u64 = files.iter().map(|f| f.size).sum();
    writeln!(out, "total {} {bytes}", files.len()).ok();
    out.flush().ok();
    run_pieces(&files, &pieces, umask(), out)
}

/// A line of a replica run beyond [`Event`]'s (see [`copy_replica`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerLine {
    /// A file of the dataset, made (if the agent writes into it) and listed as `idx`.
    File {
        idx: usize,
        size: u64,
        mode: u32,
        path: String,
    },
    /// A unit of file `idx` (or, in a repair run, of request `idx`) is copied, with its hash.
    Unit {
        idx: usize,
        offset: u64,
        hash: blake3::Hash,
    },
    /// An identified file (`--peer-cached`) was not the one identified while a unit of it was
    /// copied: staged as read, but not to be cached.
    Changed { idx: usize },
}

impl PeerLine {
    pub fn parse(line: &str) -> Option<PeerLine> {
        let mut it = line.splitn(5, ' ');
        match it.next()? {
            "file" => Some(PeerLine::File {
                idx: it.next()?.parse().ok()?,
                size: it.next()?.parse().ok()?,
                mode: u32::from_str_radix(it.next()?, 8).ok()?,
                path: serde_json::from_str(it.next()?).ok()?,
            }),
            "unit" => {
                let line = PeerLine::Unit {
                    idx: it.next()?.parse().ok()?,
                    offset: it.next()?.parse().ok()?,
                    hash: blake3::Hash::from_hex(it.next()?).ok()?,
                };
                it.next().is_none().then_some(line)
            }
            "changed" => {
                let line = PeerLine::Changed {
                    idx: it.next()?.parse().ok()?,
                };
                it.next().is_none().then_some(line)
            }
            _ => None,
        }
    }
}

/// Writes a shard's manifest next to the dataset at `dst`, as the job user, never through a link.
fn write_manifest(
    dst: &Path,
    dataset: &str,
    mut manifest: ShardManifest,
) -> Result<(), (i32, String)> {
    let path = dst
        .parent()
        .unwrap_or(Path::new("/"))
        .join(super::shard::manifest_name(dataset));
    fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
        .open(&path)
        .and_then(|mut f| f.write_all(&manifest.to_json()))
        .map_err(|e| job_error("writing", &path, e))
}

/// Reorders `files` to take one file from each directory in turn, so that copy threads mostly
/// create files in different directories: creating a file locks its directory.
fn interleave_directories(files: Vec<FileJob>) -> Vec<FileJob> {
    let mut seen: std::collections::HashMap<&Path, u64> = std::collections::HashMap::new();
    let mut rounds: Vec<u64> = Vec::with_capacity(files.len());
    for f in &files {
        let n = seen.entry(f.dst.parent().unwrap_or(&f.dst)).or_default();
        rounds.push(*n);
        *n += 1;
    }
    let mut keyed: Vec<(u64, FileJob)> = rounds.into_iter().zip(files).collect();
    keyed.sort_by_key(|(round, _)| *round); // stable: the walk's order within a round
    keyed.into_iter().map(|(_, f)| f).collect()
}

/// Opens `job`'s source and creates its destination (which must not exist) with `mode`.
fn create_pair(
    job: &FileJob,
    mode: u32,
    umask: u32,
) -> Result<(fs::File, fs::File), (i32, String)> {
    let src = fs::File::open(&job.src).map_err(|e| job_error("opening", &job.src, e))?;
    if let Some((lfs, class)) = &job.stripe {
        // `lfs setstripe` creates the empty file with its layout (this process is the job user:
        // it can do nothing through the path that the user could not do themselves).
        let out = std::process::Command::new(lfs.as_path())
            .args(super::lustre::setstripe_args(class, job.dst.as_os_str()))
            .stdin(std::process::Stdio::null())
            .output()
            .map_err(|e| (EXIT_OTHER, format!("running {}: {e}", lfs.display())))?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            return Err((
                EXIT_OTHER,
                format!(
                    "{} setstripe for {} failed: {}",
                    lfs.display(),
                    job.dst.display(),
                    err.lines().last().unwrap_or("").trim()
                ),
            ));
        }
        let dst = fs::OpenOptions::new()
            .write(true)
            .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
            .open(&job.dst)
            .map_err(|e| job_error("opening", &job.dst, e))?;
        set_mode(&dst, job, mode)?;
        return Ok((src, dst));
    }
    Ok((src, create_dst(job, mode, umask)?))
}

/// Creates `job`'s destination (which must not exist) with `mode`, never through a link.
fn create_dst(job: &FileJob, mode: u32, umask: u32) -> Result<fs::File, (i32, String)> {
    let dst = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
        .open(&job.dst)
        .map_err(|e| job_error("creating", &job.dst, e))?;
    if mode & umask != 0 {
        set_mode(&dst, job, mode)?;
    }
    preallocate(&dst, job.size).map_err(|e| job_error("allocating space for", &job.dst, e))?;
    Ok(dst)
}

/// After the last piece of a file (copied to the source's end) ended at `end`: the file is cut
/// there, so that a source that shrank since it was listed leaves no preallocated tail.
fn trim_to(dst: &fs::File, job: &FileJob, p: &Piece, end: u64) -> Result<(), (i32, String)> {
    if p.len.is_none() && end < job.size {
        dst.set_len(end)
            .map_err(|e| job_error("truncating", &job.dst, e))?;
    }
    Ok(())
}

fn set_mode(dst: &fs::File, job: &FileJob, mode: u32) -> Result<(), (i32, String)> {
    dst.set_permissions(fs::Permissions::from_mode(mode))
        .map_err(|e| job_error("setting the mode of", &job.dst, e))
}

fn job_error(what: &str, path: &Path, e: io::Error) -> (i32, String) {
    (io_exit(&e), format!("{what} {}: {e}", path.display()))
}

/// Copies `len` bytes (`None`: to the end of the file) from `src` to `dst`, each at its current
/// offset. `std::io::copy` copies file to file in the kernel (`copy_file_range`) and falls back to
/// read/write where the file systems do not support that.
fn copy_range(mut src: &fs::File, mut dst: &fs::File, len: Option<u64>) -> io::Result<u64> {
    match len {
        Some(n) => io::copy(&mut src.take(n), &mut dst),
        None => io::copy(&mut src, &mut dst),
    }
}

/// What [`copy_piece`] did.
#[derive(Debug, PartialEq, Eq)]
struct PieceCopied {
    bytes: u64,
    /// A peer unit's hash, or an identified file's piece's when it stayed the file identified.
    hash: Option<blake3::Hash>,
    /// A peer unit of an identified file: whether it stayed the file identified.
    same: bool,
    /// Of a resumable copy's file ([`FileJob::whole`]): the source descriptor's identity, when it
    /// was the same before and after the copy.
    source: Option<FileIdent>,
}

/// Copies one piece: whole small files from scratch; pieces of a file made before (by
/// [`copy_files`], or the first run of a replica) through their own descriptors, at their offset.
/// A peer unit goes through `buf` and is hashed on the way.
fn copy_piece(
    job: &FileJob,
    p: &Piece,
    umask: u32,
    buf: &mut Vec<u8>,
) -> Result<PieceCopied, (i32, String)> {
    let copy_err = |e: io::Error| job_error("copying", &job.src, e);
    let (src, dst) = if p.shared {
        let src = fs::File::open(&job.src).map_err(|e| job_error("opening", &job.src, e))?;
        let dst = fs::OpenOptions::new()
            .write(true)
            .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
            .open(&job.dst)
            .map_err(|e| job_error("opening", &job.dst, e))?;
        (src, dst)
    } else {
        create_pair(job, job.mode, umask)?
    };
    if p.unit.is_some() {
        let len = p.len.expect("a unit has a length");
        if buf.is_empty() {
            buf.resize(UNIT_BUF, 0);
        }
        // Of an identified file, whether this descriptor is the file identified, before and
        // after the copy: `changed` otherwise.
        let same = |f: &fs::File| {
            job.cache
                .is_none_or(|c| FileIdent::of(f).ok().flatten() == Some(c.file))
        };
        let before = same(&src);
        let hash = copy_hashed(&src, &dst, p.offset, len, buf).map_err(copy_err)?;
        return Ok(PieceCopied {
            bytes: len,
            hash: Some(hash),
            same: before && same(&src),
            source: None,
        });
    }
    if let Some(c) = job.cache {
        // Cacheable only if this descriptor is the file identified, before and after the copy,
        // and gave exactly the bytes of the piece.
        let same = |f: &fs::File| FileIdent::of(f).ok().flatten() == Some(c.file);
        let before = same(&src);
        if buf.is_empty() {
            buf.resize(UNIT_BUF, 0);
        }
        let (n, hash) = copy_to_end_hashed(&src, &dst, p.offset, p.len, buf).map_err(copy_err)?;
        let want = p.len.unwrap_or(c.file.size.saturating_sub(p.offset));
        let kept = before && n == want && same(&src);
        trim_to(&dst, job, p, p.offset + n)?;
        return Ok(PieceCopied {
            bytes: n,
            hash: kept.then_some(hash),
            same: true,
            source: None,
        });
    }
    if p.shared {
        (&src)
            .seek(io::SeekFrom::Start(p.offset))
            .map_err(copy_err)?;
        (&dst)
            .seek(io::SeekFrom::Start(p.offset))
            .map_err(copy_err)?;
    }
    let identity = |f: &fs::File| match &job.whole {
        Some(_) => FileIdent::of(f).ok().flatten(),
        None => None,
    };
    let before = identity(&src);
    let bytes = copy_range(&src, &dst, p.len).map_err(copy_err)?;
    trim_to(&dst, job, p, p.offset + bytes)?;
    let after = identity(&src);
    Ok(PieceCopied {
        bytes,
        hash: None,
        same: true,
        source: before.filter(|_| before == after),
    })
}

/// The buffer a copy thread reads peer units through.
const UNIT_BUF: usize = 1 << 20;

/// Copies `len` bytes at `offset` from `src` to the same offset of `dst` through `buf`, and
/// returns their BLAKE3 hash. A source shorter than that is an error: the unit's length is what
/// every node of the job expects.
fn copy_hashed(
    src: &fs::File,
    dst: &fs::File,
    offset: u64,
    len: u64,
    buf: &mut [u8],
) -> io::Result<blake3::Hash> {
    let mut hasher = blake3::Hasher::new();
    let (mut at, end) = (offset, offset + len);
    while at < end {
        let n = ((end - at) as usize).min(buf.len());
        let got = src.read_at(&mut buf[..n], at)?;
        if got == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("the file ends at {at} bytes, shorter than when it was listed"),
            ));
        }
        hasher.update(&buf[..got]);
        sluice_core::pagecache::write_all_at(dst, &buf[..got], at)?;
        at += got as u64;
    }
    Ok(hasher.finalize())
}

/// Copies from `offset` of `src` to the same offset of `dst` through `buf`, `len` bytes or (`None`)
/// to the end of `src`, whichever comes first; returns the bytes copied and their BLAKE3 hash.
fn copy_to_end_hashed(
    src: &fs::File,
    dst: &fs::File,
    offset: u64,
    len: Option<u64>,
    buf: &mut [u8],
) -> io::Result<(u64, blake3::Hash)> {
    let mut hasher = blake3::Hasher::new();
    let end = len.map_or(u64::MAX, |n| offset + n);
    let mut at = offset;
    while at < end {
        let n = (end - at).min(buf.len() as u64) as usize;
        let got = src.read_at(&mut buf[..n], at)?;
        if got == 0 {
            break;
        }
        hasher.update(&buf[..got]);
        sluice_core::pagecache::write_all_at(dst, &buf[..got], at)?;
        at += got as u64;
    }
    Ok((at - offset, hasher.finalize()))
}

/// Copies `files` with [`copy_threads`] threads, reporting progress on `out` every 200 ms and once
/// more when the last file is done.
fn copy_files(
    files: &[FileJob],
    umask: u32,
    piece: u64,
    out: &mut impl Write,
) -> Result<(), (i32, String)> {
    // Files of several pieces are created here, owner-writable so that every piece can open them;
    // the thread that finishes a file's last piece gives it its final mode.
    let mut pieces = Vec::with_capacity(files.len());
    for (i, f) in files.iter().enumerate() {
        let n = f.size.div_ceil(piece).max(1);
        if n > 1 {
            create_pair(f, f.mode | 0o200, umask)?;
        }
        for k in 0..n {
            pieces.push(Piece {
                file: i,
                offset: k * piece,
                len: (k + 1 < n).then_some(piece),
                shared: n > 1,
                unit: None,
            });
        }
    }
    run_pieces(files, &pieces, umask, out)
}

/// Copies `pieces` of `files` with [`copy_threads`] threads, reporting progress on `out` every
/// 200 ms and once more when the last piece is done, and each peer unit's hash as it is done.
fn run_pieces(
    files: &[FileJob],
    pieces: &[Piece],
    umask: u32,
    out: &mut impl Write,
) -> Result<(), (i32, String)> {
    let pieces_left: Vec<AtomicU64> = {
        let mut n = vec![0u64; files.len()];
        for p in pieces {
            n[p.file] += 1;
        }
        n.into_iter().map(AtomicU64::new).collect()
    };
    // Of an identified file: each piece's offset and hash (`None`: not cacheable).
    type PieceHashes = std::sync::Mutex<Vec<(u64, Option<blake3::Hash>)>>;
    let piece_hashes: Vec<PieceHashes> = files.iter().map(|_| Default::default()).collect();
    // Of a resumable copy's file: the bytes its pieces copied, and its source's identity while
    // they did (`Err`: it changed, or some piece could not tell).
    type Source = std::sync::Mutex<(u64, Result<Option<FileIdent>, ()>)>;
    let sources: Vec<Source> = files
        .iter()
        .map(|_| std::sync::Mutex::new((0, Ok(None))))
        .collect();
    let next = AtomicUsize::new(0);
    let (files_done, bytes_done) = (AtomicU64::new(0), AtomicU64::new(0));
    let failed = AtomicBool::new(false);
    let first_error: std::sync::Mutex<Option<(i32, String)>> = std::sync::Mutex::new(None);
    let run_piece = |p: &Piece, buf: &mut Vec<u8>, lines: &mpsc::Sender<String>| {
        let job = &files[p.file];
        let PieceCopied {
            bytes: n,
            hash,
            same,
            source,
        } = copy_piece(job, p, umask, buf)?;
        if job.whole.is_some() {
            let mut slot = sources[p.file].lock().unwrap_or_else(|p| p.into_inner());
            slot.0 += n;
            slot.1 = match (slot.1, source) {
                (Ok(None), Some(id)) => Ok(Some(id)),
                (Ok(Some(was)), Some(id)) if was == id => Ok(Some(id)),
                _ => Err(()),
            };
        }
        if let (Some(idx), Some(hash)) = (p.unit, hash) {
            // Before its unit, so that the agent never caches the file from its last unit in.
            if !same {
                lines.send(format!("changed {idx}")).ok();
            }
            lines.send(format!("unit {idx} {} {hash}", p.offset)).ok();
        } else if job.cache.is_some() {
            let mut h = piece_hashes[p.file]
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            h.push((p.offset, hash));
        }
        // The agent finishes a partial file: it writes the rest and gives it its mode.
        if pieces_left[p.file].fetch_sub(1, Ordering::AcqRel) == 1 && !job.partial {
            if p.shared && job.mode & 0o200 == 0 {
                fs::set_permissions(&job.dst, fs::Permissions::from_mode(job.mode))
                    .map_err(|e| job_error("setting the mode of", &job.dst, e))?;
            }
            files_done.fetch_add(1, Ordering::Relaxed);
            // (A replica's identified file reports its units instead.)
            if let (Some(c), None) = (job.cache, p.unit) {
                let mut h = std::mem::take(
                    &mut *piece_hashes[p.file]
                        .lock()
                        .unwrap_or_else(|p| p.into_inner()),
                );
                h.sort_by_key(|(offset, _)| *offset);
                let hashes: Option<Vec<blake3::Hash>> = h.into_iter().map(|(_, h)| h).collect();
                if let Some(hashes) = hashes {
                    let hash = piece_hashes_hash(&hashes);
                    lines
                        .send(format!("copied {} {} {hash}", c.idx, c.piece))
                        .ok();
                }
            }
            // Whole, with its mode, from one unchanged version of the source: the agent may
            // note it for a restart ([`copy_tree_resumable`]).
            if let Some(path) = &job.whole {
                let slot = sources[p.file].lock().unwrap_or_else(|p| p.into_inner());
                if let (bytes, Ok(Some(id))) = *slot
                    && bytes == id.size
                {
                    lines
                        .send(format!("whole {}", ident_fields(&id, path)))
                        .ok();
                }
            }
        }
        Ok::<u64, (i32, String)>(n)
    };
    std::thread::scope(|s| {
        // Every copy thread holds a sender; the channel closes when the last one ends, which wakes
        // the reporting loop at once rather than at its next tick.
        let (lines, finished) = mpsc::channel::<String>();
        for _ in 0..copy_threads().min(pieces.len()) {
            let lines = lines.clone();
            let run_piece = &run_piece;
            let next = &next;
            let (bytes_done, failed, first_error) = (&bytes_done, &failed, &first_error);
            s.spawn(move || {
                let mut buf = Vec::new();
                while !failed.load(Ordering::Relaxed) {
                    let Some(p) = pieces.get(next.fetch_add(1, Ordering::Relaxed)) else {
                        break;
                    };
                    match run_piece(p, &mut buf, &lines) {
                        Ok(n) => {
                            bytes_done.fetch_add(n, Ordering::Relaxed);
                        }
                        Err(e) => {
                            failed.store(true, Ordering::Relaxed);
                            let mut slot = first_error.lock().unwrap_or_else(|p| p.into_inner());
                            slot.get_or_insert(e);
                            break;
                        }
                    }
                }
            });
        }
        drop(lines);
        // Pass on the units done and report progress while the copy threads work.
        let mut last = std::time::Instant::now();
        loop {
            let wait = TICK
                .saturating_sub(last.elapsed())
                .max(Duration::from_millis(1));
            match finished.recv_timeout(wait) {
                Ok(line) => {
                    writeln!(out, "{line}").ok();
                    while let Ok(line) = finished.try_recv() {
                        writeln!(out, "{line}").ok();
                    }
                    out.flush().ok();
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
            if last.elapsed() >= TICK {
                report_progress(out, &files_done, &bytes_done);
                last = std::time::Instant::now();
            }
        }
    });
    if let Some(e) = first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    report_progress(out, &files_done, &bytes_done);
    Ok(())
}

/// How often the helper reports progress.
const TICK: Duration = Duration::from_millis(200);

/// One `progress F B` line for the agent (a reader that went away is not the copy's problem).
fn report_progress(out: &mut impl Write, files_done: &AtomicU64, bytes_done: &AtomicU64) {
    writeln!(
        out,
        "progress {} {}",
        files_done.load(Ordering::Relaxed),
        bytes_done.load(Ordering::Relaxed)
    )
    .ok();
    out.flush().ok();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_a_tree_and_reports_progress() {
        let src = tempfile::tempdir().unwrap();
        let dst = tempfile::tempdir().unwrap();
        fs::create_dir_all(src.path().join("a/b")).unwrap();
        fs::write(src.path().join("a/b/x"), vec![7u8; 100_000]).unwrap();
        fs::write(src.path().join("empty"), b"").unwrap();
        std::os::unix::fs::symlink("a/b/x", src.path().join("link")).unwrap();
        let mut out = Vec::new();
        copy_tree(src.path(), &dst.path().join("ds"), &mut out).unwrap();
        assert_eq!(
            fs::read(dst.path().join("ds/a/b/x")).unwrap(),
            vec![7u8; 100_000]
        );
        assert_eq!(fs::read(dst.path().join("ds/empty")).unwrap(), b"");
        assert_eq!(
            fs::read_link(dst.path().join("ds/link")).unwrap(),
            Path::new("a/b/x")
        );
        let text = String::from_utf8(out).unwrap();
        assert_eq!(
            Event::parse(text.lines().next().unwrap()),
            Some(Event::Total {
                files: 2,
                bytes: 100_000
            })
        );
        assert_eq!(
            Event::parse(text.lines().last().unwrap()),
            Some(Event::Progress {
                files: 2,
                bytes: 100_000
            })
        );
    }

    /// The lines of a resumable copy: `kept`, and each `whole` file by its path.
    fn resume_lines(out: Vec<u8>) -> (Option<(u64, u64)>, HashMap<String, FileIdent>) {
        let (mut kept, mut whole) = (None, HashMap::new());
        for line in String::from_utf8(out).unwrap().lines() {
            match ResumeLine::parse(line) {
                Some(ResumeLine::Kept { files, bytes }) => kept = Some((files, bytes)),
                Some(ResumeLine::Whole { file, path }) => {
                    assert!(whole.insert(path, file).is_none(), "reported twice: {line}");
                }
                None => {}
            }
        }
        (kept, whole)
    }

    /// A resumable copy reports every file it copied whole, with its source's identity (big files
    /// in pieces too, once their last piece and mode are in). Run again over what it left, as a
    /// restarted agent runs it: an offered file whose source is unchanged is kept as it is (same
    /// inode); one whose source changed is copied again, and so is what was cut short; names no
    /// longer in the source go; the result is the source's tree.
    #[test]
    fn a_resumable_copy_keeps_the_files_offered_whose_source_is_unchanged() {
        let src = tempfile::tempdir().unwrap();
        let dst = tempfile::tempdir().unwrap();
        let ds = dst.path().join("ds");
        fs::create_dir_all(src.path().join("d")).unwrap();
        let big: Vec<u8> = (0..20_000u32).map(|i| (i % 251) as u8).collect();
        fs::write(src.path().join("big"), &big).unwrap();
        fs::set_permissions(src.path().join("big"), fs::Permissions::from_mode(0o444)).unwrap();
        fs::write(src.path().join("d/same"), b"same bytes").unwrap();
        fs::write(src.path().join("d/changes"), b"old bytes").unwrap();
        fs::write(src.path().join("d/cut"), b"cut short by the kill").unwrap();
        std::os::unix::fs::symlink("d/same", src.path().join("link")).unwrap();
        let none = HashMap::new();
        let mut out = Vec::new();
        copy_tree_in_pieces(src.path(), &ds, 4096, None, Some(&none), &mut out).unwrap();
        let (kept, whole) = resume_lines(out);
        assert_eq!(kept, Some((0, 0)));
        let mut names: Vec<&str> = whole.keys().map(String::as_str).collect();
        names.sort();
        assert_eq!(names, ["big", "d/changes", "d/cut", "d/same"]);
        let ident = |rel: &str| FileIdent::of(&fs::File::open(src.path().join(rel)).unwrap());
        assert_eq!(Some(whole["big"]), ident("big").unwrap());
        assert_eq!(fs::read(ds.join("big")).unwrap(), big);

        // What a kill leaves: a file cut short, a name the source no longer has; meanwhile the
        // source of another changed.
        fs::write(ds.join("d/cut"), b"cut").unwrap();
        fs::write(ds.join("d/gone"), b"stale").unwrap();
        fs::write(src.path().join("d/changes"), b"new bytes, longer").unwrap();
        let ino = |rel: &str| fs::symlink_metadata(ds.join(rel)).unwrap().ino();
        let (same_ino, big_ino) = (ino("d/same"), ino("big"));
        let offers: String = ["big", "d/same", "d/changes"]
            .iter()
            .map(|p| keep_line(&whole[*p], p))
            .collect();
        let mut out = Vec::new();
        let keep: HashMap<String, FileIdent> = offers
            .lines()
            .map(|l| parse_ident_fields(l.strip_prefix("keep ").unwrap()).unwrap())
            .map(|(f, p)| (p, f))
            .collect();
        copy_tree_in_pieces(src.path(), &ds, 4096, None, Some(&keep), &mut out).unwrap();
        let (kept, whole) = resume_lines(out);
        assert_eq!(
            kept,
            Some((2, big.len() as u64 + 10)),
            "big and d/same kept"
        );
        let mut copied: Vec<&str> = whole.keys().map(String::as_str).collect();
        copied.sort();
        assert_eq!(copied, ["d/changes", "d/cut"], "copied again");
        assert_eq!((ino("d/same"), ino("big")), (same_ino, big_ino));
        assert_eq!(
            fs::read(ds.join("d/changes")).unwrap(),
            b"new bytes, longer"
        );
        assert_eq!(
            fs::read(ds.join("d/cut")).unwrap(),
            b"cut short by the kill"
        );
        assert!(!ds.join("d/gone").exists());
        assert_eq!(fs::read_link(ds.join("link")).unwrap(), Path::new("d/same"));
        assert_eq!(
            fs::metadata(ds.join("big")).unwrap().mode() & 0o777,
            0o444,
            "kept with its mode"
        );
        // Offers are read as the agent writes them; anything else fails the copy.
        let mut out = Vec::new();
        let bad = copy_tree_resumable(src.path(), &ds, None, &b"keep nonsense\n"[..], &mut out);
        assert!(bad.unwrap_err().1.contains("bad offer"));
    }

    /// A dataset that is one file resumes too: kept when its source is unchanged, else copied.
    #[test]
    fn a_resumable_copy_of_one_file_keeps_it_or_copies_it_again() {
        let src = tempfile::tempdir().unwrap();
        let dst = tempfile::tempdir().unwrap();
        let (from, to) = (src.path().join("one.bin"), dst.path().join("one"));
        fs::write(&from, b"one file").unwrap();
        let mut out = Vec::new();
        copy_tree_resumable(&from, &to, None, &b""[..], &mut out).unwrap();
        let (_, whole) = resume_lines(out);
        let offer = keep_line(&whole[""], "");
        let ino = fs::metadata(&to).unwrap().ino();
        let mut out = Vec::new();
        copy_tree_resumable(&from, &to, None, offer.as_bytes(), &mut out).unwrap();
        assert_eq!(resume_lines(out), (Some((1, 8)), HashMap::new()));
        assert_eq!(fs::metadata(&to).unwrap().ino(), ino, "kept");
        fs::write(&from, b"another file").unwrap();
        let mut out = Vec::new();
        copy_tree_resumable(&from, &to, None, offer.as_bytes(), &mut out).unwrap();
        assert_eq!(resume_lines(out).0, Some((0, 0)));
        assert_eq!(fs::read(&to).unwrap(), b"another file");
    }

    #[test]
    fn big_files_are_copied_in_pieces_with_their_mode() {
        let src = tempfile::tempdir().unwrap();
        let dst = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..100_003u32).map(|i| (i % 251) as u8).collect();
        fs::write(src.path().join("big"), &data).unwrap();
        fs::set_permissions(src.path().join("big"), fs::Permissions::from_mode(0o444)).unwrap();
        fs::write(src.path().join("small"), b"abc").unwrap();
        fs::set_permissions(src.path().join("small"), fs::Permissions::from_mode(0o640)).unwrap();
        let mut out = Vec::new();
        // 4 KiB pieces: the big file is 25 pieces, copied by several threads.
        copy_tree_in_pieces(
            src.path(),
            &dst.path().join("ds"),
            4096,
            None,
            None,
            &mut out,
        )
        .unwrap();
        let big = dst.path().join("ds/big");
        assert_eq!(fs::read(&big).unwrap(), data);
        assert_eq!(fs::metadata(&big).unwrap().mode() & 0o7777, 0o444);
        let small = dst.path().join("ds/small");
        assert_eq!(fs::read(&small).unwrap(), b"abc");
        assert_eq!(fs::metadata(&small).unwrap().mode() & 0o7777, 0o640);
        let text = String::from_utf8(out).unwrap();
        assert_eq!(
            Event::parse(text.lines().last().unwrap()),
            Some(Event::Progress {
                files: 2,
                bytes: 100_006
            })
        );

        // One file as the source: NAME is that file.
        copy_tree_in_pieces(
            &src.path().join("big"),
            &dst.path().join("one"),
            4096,
            None,
            None,
            &mut Vec::new(),
        )
        .unwrap();
        assert_eq!(fs::read(dst.path().join("one")).unwrap(), data);
    }

    #[test]
    fn a_shard_copies_the_nodes_own_files_and_the_whole_manifest() {
        let src = tempfile::tempdir().unwrap();
        for i in 0..30 {
            let d = src.path().join(format!("d{}", i % 3));
            fs::create_dir_all(&d).unwrap();
            fs::write(d.join(format!("f{i}")), vec![i as u8; 100 + i]).unwrap();
        }
        let nodes: Vec<String> = ["n1", "n2"].map(String::from).into();
        let mut union = std::collections::BTreeSet::new();
        let mut manifests = Vec::new();
        for node in &nodes {
            let stage = tempfile::tempdir().unwrap();
            let shard = ShardArgs {
                shard_nodes: Some(nodes.join(",")),
                shard_node: Some(node.clone()),
                dataset: Some("ds".into()),
                source: Some(src.path().display().to_string()),
                shared_tier: false,
                lfs: None,
                stripe: Vec::new(),
                peer_unit_size: None,
                peer_repair: false,
                peer_cached: false,
                takeover_of: None,
                takeover_nodes: None,
            }
            .shard()
            .unwrap()
            .unwrap();
            let mut out = Vec::new();
            copy_shard(src.path(), &stage.path().join("ds"), &shard, &mut out).unwrap();
            let manifest = fs::read(stage.path().join("ds.shard.json")).unwrap();
            let parsed: ShardManifest = serde_json::from_slice(&manifest).unwrap();
            assert_eq!(parsed.files.len(), 30);
            let mine: Vec<_> = parsed.files.iter().filter(|f| &f.node == node).collect();
            // Every directory is there; of the files, exactly the ones the manifest gives this node.
            for d in 0..3 {
                assert!(stage.path().join(format!("ds/d{d}")).is_dir());
            }
            let mut held = 0;
            for f in &parsed.files {
                let here = stage.path().join(&f.path);
                assert_eq!(here.exists(), &f.node == node, "{}", f.path);
                if here.exists() {
                    assert_eq!(fs::metadata(&here).unwrap().len(), f.size);
                    assert!(union.insert(f.path.clone()), "{} twice", f.path);
                    held += 1;
                }
            }
            assert_eq!(held, mine.len());
            let bytes: u64 = mine.iter().map(|f| f.size).sum();
            let text = String::from_utf8(out).unwrap();
            assert_eq!(
                Event::parse(text.lines().next().unwrap()),
                Some(Event::Total {
                    files: mine.len() as u64,
                    bytes
                }),
                "{node} reports its own share"
            );
            manifests.push(manifest);
        }
        assert_eq!(union.len(), 30);
        assert_eq!(manifests[0], manifests[1]);
        let outside = ShardArgs {
            shard_nodes: Some("n1,n2".into()),
            shard_node: Some("n9".into()),
            dataset: Some("ds".into()),
            source: Some("/x".into()),
            shared_tier: false,
            lfs: None,
            stripe: Vec::new(),
            peer_unit_size: None,
            peer_repair: false,
            peer_cached: false,
            takeover_of: None,
            takeover_nodes: None,
        };
        assert!(outside.shard().unwrap_err().contains("n9 is not one of"));
    }

    /// The shared tier: directories another node made are used, a file an earlier run left is
    /// replaced, no manifest is written, and on Lustre a file of a striped class is created by
    /// `lfs setstripe` (a fake `lfs` here: neither Lustre nor the real `lfs` exist where this runs).
    #[test]
    fn a_shared_tier_copy_joins_other_nodes_and_stripes_big_files() {
        let src = tempfile::tempdir().unwrap();
        fs::create_dir_all(src.path().join("d")).unwrap();
        fs::write(src.path().join("d/big"), vec![3u8; 5000]).unwrap();
        fs::set_permissions(src.path().join("d/big"), fs::Permissions::from_mode(0o640)).unwrap();
        fs::write(src.path().join("d/small"), b"tiny").unwrap();
        let stage = tempfile::tempdir().unwrap();
        let dst = stage.path().join("ds");
        // Another node made the directories; an earlier run left a stale copy of the big file.
        fs::create_dir_all(dst.join("d")).unwrap();
        fs::write(dst.join("d/big"), b"stale").unwrap();
        let bin = tempfile::tempdir().unwrap();
        let (lfs, record) = (bin.path().join("lfs"), bin.path().join("args"));
        fs::write(
            &lfs,
            format!(
                "#!/bin/sh\nprintf '%s ' \"$@\" >> '{}'\nfor a; do last=$a; done\n: > \"$last\"\n",
                record.display()
            ),
        )
        .unwrap();
        fs::set_permissions(&lfs, fs::Permissions::from_mode(0o755)).unwrap();
        let shard = ShardArgs {
            shard_nodes: Some("n1".into()),
            shard_node: Some("n1".into()),
            dataset: Some("ds".into()),
            source: Some(src.path().display().to_string()),
            shared_tier: true,
            lfs: Some(lfs),
            stripe: vec!["4096:2:1048576".into()],
            peer_unit_size: None,
            peer_repair: false,
            peer_cached: false,
            takeover_of: None,
            takeover_nodes: None,
        }
        .shard()
        .unwrap()
        .unwrap();
        let mut copied = Err((0, String::new()));
        for _ in 0..50 {
            // A fork elsewhere in the test binary may briefly hold the fresh script open.
            let _ = fs::remove_file(dst.join("d/small"));
            copied = copy_shard(src.path(), &dst, &shard, &mut Vec::new());
            if !matches!(&copied, Err((_, m)) if m.contains("Text file busy")) {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        copied.unwrap();
        assert_eq!(fs::read(dst.join("d/big")).unwrap(), vec![3u8; 5000]);
        assert_eq!(
            fs::metadata(dst.join("d/big")).unwrap().mode() & 0o7777,
            0o640
        );
        assert_eq!(fs::read(dst.join("d/small")).unwrap(), b"tiny");
        assert_eq!(
            fs::read_to_string(&record).unwrap(),
            format!("setstripe -c 2 -S 1048576 {} ", dst.join("d/big").display()),
            "only the file of the striped class goes through lfs"
        );
        assert!(!stage.path().join("ds.shard.json").exists());
        let bad = ShardArgs {
            shard_nodes: Some("n1".into()),
            shard_node: Some("n1".into()),
            dataset: Some("ds".into()),
            source: Some("/x".into()),
            shared_tier: true,
            lfs: Some("/bin/lfs".into()),
            stripe: vec!["1:2".into()],
            peer_unit_size: None,
            peer_repair: false,
            peer_cached: false,
            takeover_of: None,
            takeover_nodes: None,
        };
        assert!(bad.shard().unwrap_err().contains("MIN_SIZE:COUNT:SIZE"));
    }

    /// What one node's helper did for a replica: its lines, parsed.
    struct ReplicaRun {
        total: Option<Event>,
        files: Vec<(usize, u64, u32, String)>,
        units: Vec<(usize, u64, blake3::Hash)>,
        last: Option<Event>,
    }

    fn parse_run(out: Vec<u8>) -> ReplicaRun {
        let text = String::from_utf8(out).unwrap();
        let mut run = ReplicaRun {
            total: None,
            files: Vec::new(),
            units: Vec::new(),
            last: None,
        };
        for line in text.lines() {
            match (Event::parse(line), PeerLine::parse(line)) {
                (Some(e @ Event::Total { .. }), _) => run.total = Some(e),
                (Some(e), _) => run.last = Some(e),
                (
                    None,
                    Some(PeerLine::File {
                        idx,
                        size,
                        mode,
                        path,
                    }),
                ) => {
                    assert!(run.units.is_empty(), "every file is listed before a unit");
                    run.files.push((idx, size, mode, path))
                }
                (None, Some(PeerLine::Unit { idx, offset, hash })) => {
                    run.units.push((idx, offset, hash))
                }
                (None, Some(PeerLine::Changed { idx })) => {
                    panic!("file {idx} reported changed, but no file of these tests changes")
                }
                (None, None) => panic!("a line the agent cannot read: {line:?}"),
            }
        }
        run
    }

    fn replica_args(nodes: &[&str], node: &str, src: &Path, repair: bool) -> Shard {
        ShardArgs {
            shard_nodes: Some(nodes.join(",")),
            shard_node: Some(node.into()),
            dataset: Some("ds".into()),
            source: Some(src.display().to_string()),
            shared_tier: false,
            lfs: None,
            stripe: Vec::new(),
            peer_unit_size: Some(4096),
            peer_repair: repair,
            peer_cached: false,
            takeover_of: None,
            takeover_nodes: None,
        }
        .shard()
        .unwrap()
        .unwrap()
    }

    /// A replica on 3 nodes: each node makes the whole tree and copies exactly the units it owns
    /// (every empty file on every node), reporting each with the hash of the source's bytes; the
    /// three together copy every unit once. The files with others' units are owner-writable for
    /// the agent; the others have their mode. A repair run then copies named units into them.
    #[test]
    fn a_replica_copies_the_nodes_units_hashed_and_makes_every_file() {
        let src = tempfile::tempdir().unwrap();
        fs::create_dir_all(src.path().join("d/e")).unwrap();
        let big: Vec<u8> = (0..3 * 4096 + 123u32).map(|i| (i % 249) as u8).collect();
        fs::write(src.path().join("d/big"), &big).unwrap();
        fs::set_permissions(src.path().join("d/big"), fs::Permissions::from_mode(0o444)).unwrap();
        for i in 0..12 {
            fs::write(src.path().join(format!("d/e/s{i}")), vec![i as u8; 100 + i]).unwrap();
        }
        fs::set_permissions(src.path().join("d/e/s1"), fs::Permissions::from_mode(0o600)).unwrap();
        fs::write(src.path().join("empty"), b"").unwrap();
        std::os::unix::fs::symlink("d/big", src.path().join("link")).unwrap();
        let nodes = ["n1", "n2", "n3"];
        let mut copied = std::collections::BTreeMap::new();
        let mut stages = Vec::new();
        for node in nodes {
            let stage = tempfile::tempdir().unwrap();
            let dst = stage.path().join("ds");
            let shard = replica_args(&nodes, node, src.path(), false);
            let mut out = Vec::new();
            copy_shard(src.path(), &dst, &shard, &mut out).unwrap();
            let run = parse_run(out);
            assert_eq!(
                run.total,
                Some(Event::Total {
                    files: 14,
                    bytes: big.len() as u64 + (0..12).map(|i| 100 + i).sum::<u64>()
                }),
                "{node}: the whole dataset"
            );
            assert_eq!(run.files.len(), 14);
            assert_eq!(fs::read_link(dst.join("link")).unwrap(), Path::new("d/big"));
            for (idx, size, mode, path) in &run.files {
                let here = dst.join(path);
                let want_mode = fs::metadata(src.path().join(path)).unwrap().mode() & 0o7777;
                assert_eq!(*mode, want_mode, "{path}");
                let units = units_of(&peer_unit_file("ds", path), *size, 4096);
                let mine: Vec<&Unit> = units
                    .iter()
                    .filter(|u| copies_unit(&shard.plan, u))
                    .collect();
                // Reported as each is done: the copy threads finish them in any order.
                let mut reported: Vec<u64> = run
                    .units
                    .iter()
                    .filter(|u| u.0 == *idx)
                    .map(|u| u.1)
                    .collect();
                reported.sort_unstable();
                assert_eq!(
                    reported,
                    mine.iter().map(|u| u.offset).collect::<Vec<_>>(),
                    "{node}: {path}"
                );
                let source = fs::read(src.path().join(path)).unwrap();
                if mine.is_empty() {
                    assert!(here.is_file(), "{node}: {path} made for the agent");
                } else {
                    let copy = fs::read(&here).unwrap();
                    for u in &mine {
                        let r = u.offset as usize..(u.offset + u.len) as usize;
                        assert_eq!(copy[r.clone()], source[r.clone()], "{node}: {path}");
                        let (_, _, hash) = run
                            .units
                            .iter()
                            .find(|x| x.0 == *idx && x.1 == u.offset)
                            .unwrap();
                        assert_eq!(*hash, blake3::hash(&source[r]), "{node}: {path}");
                        copied
                            .entry((path.clone(), u.offset))
                            .or_insert_with(Vec::new)
                            .push(node);
                    }
                }
                let mode_here = fs::metadata(&here).unwrap().mode() & 0o7777;
                if mine.len() < units.len() {
                    assert_eq!(
                        mode_here,
                        want_mode | 0o200,
                        "{node}: {path} is the agent's"
                    );
                } else {
                    assert_eq!(mode_here, want_mode, "{node}: {path}");
                }
            }
            stages.push((stage, shard));
        }
        // Every unit copied once in the job, the empty file's by every node.
        let all: usize = 4 + 12 + 1;
        assert_eq!(copied.len(), all);
        for ((path, offset), by) in &copied {
            let want = if path == "empty" { 3 } else { 1 };
            assert_eq!(by.len(), want, "{path}@{offset}: {by:?}");
        }

        // n1 repairs the units of d/big it did not copy (their owner was routed around).
        let (stage, shard) = &stages[0];
        let dst = stage.path().join("ds");
        let missing: Vec<Unit> = units_of("ds/d/big", big.len() as u64, 4096)
            .into_iter()
            .filter(|u| !copies_unit(&shard.plan, u))
            .collect();
        assert!(
            !missing.is_empty(),
            "n1 owns some of d/big's units but not all"
        );
        let requests: String = missing
            .iter()
            .enumerate()
            .map(|(i, u)| format!("{} {} {} \"d/big\"\n", i + 7, u.offset, u.len))
            .collect();
        let mut out = Vec::new();
        copy_repair(src.path(), &dst, requests.as_bytes(), &mut out).unwrap();
        let run = parse_run(out);
        assert_eq!(run.units.len(), missing.len());
        for (i, u) in missing.iter().enumerate() {
            let r = u.offset as usize..(u.offset + u.len) as usize;
            assert!(
                run.units
                    .contains(&(i + 7, u.offset, blake3::hash(&big[r]))),
                "unit {u:?}: {:?}",
                run.units
            );
        }
        let copy = fs::read(dst.join("d/big")).unwrap();
        for u in &missing {
            let r = u.offset as usize..(u.offset + u.len) as usize;
            assert_eq!(copy[r.clone()], big[r]);
        }
        let bad = copy_repair(src.path(), &dst, &b"0 0 1 \"../x\"\n"[..], &mut Vec::new());
        assert!(bad.unwrap_err().1.contains("bad unit request"));
        let e = copy_repair(
            src.path(),
            &dst,
            &b"0 0 9999 \"d/e/s2\"\n"[..],
            &mut Vec::new(),
        );
        assert!(e.unwrap_err().1.contains("shorter than when it was listed"));
    }

    /// A cached copy: every non-empty file identified from its descriptor, a hit only made (empty,
    /// owner-writable) for the agent, the others copied with the hash of their pieces in order,
    /// which the agent can compute from the staged copy; an answer naming no file is refused.
    #[test]
    fn a_cached_copy_identifies_files_makes_hits_and_hashes_the_rest_by_piece() {
        let src = tempfile::tempdir().unwrap();
        let big: Vec<u8> = (0..5 * 4096 + 99u32).map(|i| (i % 253) as u8).collect();
        fs::write(src.path().join("big"), &big).unwrap();
        fs::set_permissions(src.path().join("big"), fs::Permissions::from_mode(0o444)).unwrap();
        fs::create_dir(src.path().join("d")).unwrap();
        fs::write(src.path().join("d/small"), b"small").unwrap();
        fs::write(src.path().join("empty"), b"").unwrap();
        let dst = tempfile::tempdir().unwrap();
        let run = |answers: &str, to: &str| {
            let mut out = Vec::new();
            let r = copy_cached_in_pieces(
                src.path(),
                &dst.path().join(to),
                4096,
                answers.as_bytes(),
                &mut out,
            );
            (r, String::from_utf8(out).unwrap())
        };
        let (r, text) = run("", "miss");
        r.unwrap();
        let lines: Vec<CacheLine> = text.lines().filter_map(CacheLine::parse).collect();
        let idents: Vec<(usize, FileIdent, String)> = lines
            .iter()
            .filter_map(|l| match l {
                CacheLine::Ident {
                    idx, file, path, ..
                } => Some((*idx, *file, path.clone())),
                _ => None,
            })
            .collect();
        assert_eq!(
            idents.iter().map(|i| i.2.as_str()).collect::<Vec<_>>(),
            ["big", "d/small"],
            "the non-empty files"
        );
        let md = fs::metadata(src.path().join("big")).unwrap();
        assert_eq!((idents[0].1.ino, idents[0].1.size), (md.ino(), md.len()));
        assert!(lines.contains(&CacheLine::Idents { count: 2 }));
        let pieces: Vec<blake3::Hash> = big.chunks(4096).map(blake3::hash).collect();
        assert!(
            lines.contains(&CacheLine::Copied {
                idx: 0,
                piece: 4096,
                hash: piece_hashes_hash(&pieces)
            }),
            "{text}"
        );
        assert!(lines.contains(&CacheLine::Copied {
            idx: 1,
            piece: 4096,
            hash: piece_hashes_hash(&[blake3::hash(b"small")])
        }));
        assert_eq!(fs::read(dst.path().join("miss/big")).unwrap(), big);

        // The big file a hit: made empty for the agent, not copied.
        let (r, text) = run("hit 0\n", "hit");
        r.unwrap();
        assert!(text.lines().any(|l| l == "cached 0"), "{text}");
        assert!(!text.contains("copied 0 "), "{text}");
        let made = fs::metadata(dst.path().join("hit/big")).unwrap();
        assert_eq!((made.len(), made.mode() & 0o7777), (0, 0o644));
        assert_eq!(fs::read(dst.path().join("hit/d/small")).unwrap(), b"small");
        assert_eq!(
            Event::parse(text.lines().last().unwrap()),
            Some(Event::Progress { files: 2, bytes: 5 }),
            "the helper counts what it copied"
        );
        let (r, _) = run("hit 2\n", "bad");
        assert!(r.unwrap_err().1.contains("bad cache answer"));
        assert!(
            !dst.path().join("bad").exists(),
            "nothing made on a bad answer"
        );
    }

    /// A file whose descriptor no longer has the identity the helper reported (rewritten,
    /// replaced or grown after it was identified) is copied as it is now, but gives no hash: the
    /// agent is told nothing it could keep.
    #[test]
    fn a_file_changed_after_it_was_identified_is_copied_but_not_hashed() {
        let src = tempfile::tempdir().unwrap();
        let dst = tempfile::tempdir().unwrap();
        fs::write(src.path().join("f"), b"the bytes now").unwrap();
        let f = fs::File::open(src.path().join("f")).unwrap();
        let now = FileIdent::of(&f).unwrap().unwrap();
        let piece = Piece {
            file: 0,
            offset: 0,
            len: None,
            shared: false,
            unit: None,
        };
        let job = |file: FileIdent, to: &str| FileJob {
            src: src.path().join("f"),
            dst: dst.path().join(to),
            size: file.size,
            mode: 0o644,
            stripe: None,
            partial: false,
            cache: Some(Identified {
                idx: 0,
                file,
                piece: PIECE,
            }),
            whole: None,
        };
        let mut buf = Vec::new();
        let same = copy_piece(&job(now, "same"), &piece, 0o022, &mut buf).unwrap();
        assert_eq!(
            (same.bytes, same.hash, same.same),
            (13, Some(blake3::hash(b"the bytes now")), true)
        );
        for (what, then) in [
            (
                "mtime",
                FileIdent {
                    mtime_ns: now.mtime_ns ^ 1,
                    ..now
                },
            ),
            (
                "inode",
                FileIdent {
                    ino: now.ino + 1,
                    ..now
                },
            ),
            ("size", FileIdent { size: 9, ..now }),
        ] {
            let PieceCopied { bytes: n, hash, .. } =
                copy_piece(&job(then, what), &piece, 0o022, &mut buf).unwrap();
            assert_eq!((n, hash), (13, None), "{what} changed");
            assert_eq!(fs::read(dst.path().join(what)).unwrap(), b"the bytes now");
        }
    }

    #[test]
    fn big_files_are_split_into_pieces_only_where_a_side_is_not_a_local_file_system() {
        use nix::sys::statfs::{EXT4_SUPER_MAGIC, NFS_SUPER_MAGIC, PROC_SUPER_MAGIC};
        assert!(is_local_fs(EXT4_SUPER_MAGIC));
        assert!(!is_local_fs(NFS_SUPER_MAGIC));
        assert!(!is_local_fs(nix::sys::statfs::FsType(
            crate::stage::lustre::LL_SUPER_MAGIC as _
        )));
        let dir = tempfile::tempdir().unwrap();
        // A destination that does not exist yet is judged by its nearest existing ancestor.
        let dst = dir.path().join("job/ds");
        let here = nix::sys::statfs::statfs(dir.path())
            .unwrap()
            .filesystem_type();
        let want = if is_local_fs(here) { u64::MAX } else { PIECE };
        assert_eq!(piece_for(dir.path(), &dst), want);
        // /proc stands in for a file system that is not local: pieces.
        assert!(!is_local_fs(PROC_SUPER_MAGIC));
        assert_eq!(piece_for(Path::new("/proc/self"), &dst), PIECE);
        assert_eq!(piece_for(dir.path(), Path::new("/proc/self/x")), PIECE);
    }

    #[test]
    fn copy_threads_take_files_from_each_directory_in_turn() {
        let job = |p: &str| FileJob {
            src: PathBuf::from(p),
            dst: PathBuf::from("/d").join(p),
            size: 1,
            mode: 0o644,
            stripe: None,
            partial: false,
            cache: None,
            whole: None,
        };
        let files = ["a/1", "a/2", "a/3", "b/1", "b/2", "top"].map(job).into();
        let order: Vec<PathBuf> = interleave_directories(files)
            .into_iter()
            .map(|f| f.src)
            .collect();
        assert_eq!(
            order,
            ["a/1", "b/1", "top", "a/2", "b/2", "a/3"].map(PathBuf::from)
        );
    }

    #[test]
    fn a_file_that_shrank_since_it_was_listed_leaves_no_preallocated_tail() {
        let dir = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..3u32 << 20).map(|i| (i % 251) as u8).collect();
        fs::write(dir.path().join("src"), &data).unwrap();
        // Listed at 4 MiB (preallocated where the tier is ext4), 3 MiB when copied: whole, and in
        // 1 MiB pieces whose last one copies to the end.
        for (name, piece) in [("whole", u64::MAX), ("pieces", 1 << 20)] {
            let job = FileJob {
                src: dir.path().join("src"),
                dst: dir.path().join(name),
                size: 4 << 20,
                mode: 0o644,
                stripe: None,
                partial: false,
                cache: None,
                whole: None,
            };
            copy_files(std::slice::from_ref(&job), 0o022, piece, &mut Vec::new()).unwrap();
            assert_eq!(fs::read(&job.dst).unwrap(), data, "{name}");
        }
    }

    #[test]
    fn missing_source_is_not_found() {
        let dst = tempfile::tempdir().unwrap();
        let e = copy_tree(
            Path::new("/nonexistent/sluice"),
            &dst.path().join("x"),
            &mut Vec::new(),
        )
        .unwrap_err();
        assert_eq!(e.0, EXIT_NOT_FOUND);
    }
}
