//! `sluiced copy-as-user`: copies a POSIX dataset with the job user's identity. This is the helper
//! process; the agent's side (starting it, reading its progress, classifying its exit) is
//! [`super::posix`].
//!
//! The agent starts this helper as root; before touching any file it takes the job user's groups, gid
//! and uid for good (`initgroups`, `setresgid`, `setresuid`) and checks that root cannot be regained.
//! Credentials are per process here, not per thread, so no async runtime thread ever changes identity.
//! The helper reports progress as lines on stdout (`total F B`, `progress F B`) and its error as the
//! last line on stderr, with an exit code that classifies it.

use super::shard::{ShardManifest, ShardPlan};
use nix::unistd::{Gid, Uid, geteuid, initgroups, setresgid, setresuid};
use sluice_archive::config::StripeClass;
use std::ffi::CString;
use std::fs;
use std::io::{self, Read, Seek, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
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
/// copy thread.
const PIECE: u64 = 64 << 20;

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
}

/// A byte range of one file, the unit a copy thread takes. Files up to [`PIECE`] are one piece;
/// the last piece of a file copies to its end, so a file that grew since the walk is copied whole.
struct Piece {
    file: usize,
    offset: u64,
    /// `None`: to the end of the file.
    len: Option<u64>,
    /// One of several pieces of its file, which [`copy_files`] created.
    shared: bool,
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
        let plan = ShardPlan::new(&nodes, &node)
            .ok_or_else(|| format!("node {node} is not one of the job's nodes {nodes:?}"))?;
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
        Ok(Some(Shard {
            plan,
            dataset,
            source,
            shared_tier: self.shared_tier,
            stripes,
        }))
    }
}

/// Copies `src` (a file or a directory tree) to `dst`, which must not exist. Returns an exit code and
/// message on failure. Symlinks inside the tree are copied as symlinks. Nothing is fsynced: staged
/// data can be fetched again from its origin, and job end deletes it.
pub fn copy_tree(src: &Path, dst: &Path, out: &mut impl Write) -> Result<(), (i32, String)> {
    copy_tree_in_pieces(src, dst, PIECE, None, out)
}

/// [`copy_tree`] of this node's share of the files only, with the manifest of all of them
/// written next to `dst` (`NAME.shard.json`).
pub fn copy_shard(
    src: &Path,
    dst: &Path,
    shard: &Shard,
    out: &mut impl Write,
) -> Result<(), (i32, String)> {
    copy_tree_in_pieces(src, dst, PIECE, Some(shard), out)
}

/// [`copy_tree`], with files larger than `piece` bytes copied as several pieces; with `shard`, only
/// the files this node owns.
fn copy_tree_in_pieces(
    src: &Path,
    dst: &Path,
    piece: u64,
    shard: Option<&Shard>,
    out: &mut impl Write,
) -> Result<(), (i32, String)> {
    let top = fs::metadata(src).map_err(|e| (io_exit(&e), format!("{}: {e}", src.display())))?;
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
    let mut files = Vec::new();
    if top.is_file() {
        if mine(Path::new(""), top.len()) {
            files.push(FileJob {
                src: src.to_path_buf(),
                dst: dst.to_path_buf(),
                size: top.len(),
                mode: top.mode() & 0o7777,
                stripe: stripe_for(shard, top.len()),
            });
        }
        let bytes: u64 = files.iter().map(|f| f.size).sum();
        writeln!(out, "total {} {bytes}", files.len()).ok();
        out.flush().ok();
    } else if top.is_dir() {
        let mut entries = Vec::new();
        walk(src, Path::new(""), &mut entries)?;
        entries.retain(|e| match e {
            Entry::File(rel, size, _) => mine(rel, *size),
            _ => true,
        });
        let (count, bytes) = entries.iter().fold((0u64, 0u64), |(f, b), e| match e {
            Entry::File(_, n, _) => (f + 1, b + n),
            _ => (f, b),
        });
        writeln!(out, "total {count} {bytes}").ok();
        out.flush().ok();

        // Directories are created owner-writable (the copy needs to write into them), with their
        // final mode at once; chmod only where the umask strips bits.
        let shared_tier = shard.is_some_and(|s| s.shared_tier);
        let mkdir = |p: &Path, mode: u32| {
            let mode = mode | 0o700;
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
        mkdir(dst, top.mode() & 0o7777)?;
        for e in entries {
            match e {
                Entry::Dir(rel, mode) => mkdir(&dst.join(rel), mode)?,
                Entry::Link(rel) => {
                    let target = fs::read_link(src.join(&rel)).map_err(|e| {
                        (io_exit(&e), format!("reading link {}: {e}", rel.display()))
                    })?;
                    std::os::unix::fs::symlink(target, dst.join(&rel)).map_err(|e| {
                        (io_exit(&e), format!("creating link {}: {e}", rel.display()))
                    })?;
                }
                Entry::File(rel, size, mode) => files.push(FileJob {
                    src: src.join(&rel),
                    dst: dst.join(&rel),
                    size,
                    mode,
                    stripe: stripe_for(shard, size),
                }),
            }
        }
        files = interleave_directories(files);
    } else {
        return Err((
            EXIT_OTHER,
            format!("{} is neither a file nor a directory", src.display()),
        ));
    }
    if shard.is_some_and(|s| s.shared_tier) {
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
    Ok((src, dst))
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

/// Copies one piece: whole small files from scratch; pieces of a big file (created by
/// [`copy_files`]) through their own descriptors, at their offset.
fn copy_piece(job: &FileJob, p: &Piece, umask: u32) -> Result<u64, (i32, String)> {
    let copy_err = |e: io::Error| job_error("copying", &job.src, e);
    if !p.shared {
        let (src, dst) = create_pair(job, job.mode, umask)?;
        return copy_range(&src, &dst, p.len).map_err(copy_err);
    }
    let src = fs::File::open(&job.src).map_err(|e| job_error("opening", &job.src, e))?;
    let dst = fs::OpenOptions::new()
        .write(true)
        .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
        .open(&job.dst)
        .map_err(|e| job_error("opening", &job.dst, e))?;
    (&src)
        .seek(io::SeekFrom::Start(p.offset))
        .map_err(copy_err)?;
    (&dst)
        .seek(io::SeekFrom::Start(p.offset))
        .map_err(copy_err)?;
    copy_range(&src, &dst, p.len).map_err(copy_err)
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
    let mut pieces_left = Vec::with_capacity(files.len());
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
            });
        }
        pieces_left.push(AtomicU64::new(n));
    }

    let next = AtomicUsize::new(0);
    let (files_done, bytes_done) = (AtomicU64::new(0), AtomicU64::new(0));
    let failed = AtomicBool::new(false);
    let first_error: std::sync::Mutex<Option<(i32, String)>> = std::sync::Mutex::new(None);
    let run_piece = |p: &Piece| -> Result<u64, (i32, String)> {
        let job = &files[p.file];
        let n = copy_piece(job, p, umask)?;
        if pieces_left[p.file].fetch_sub(1, Ordering::AcqRel) == 1 {
            if p.shared && job.mode & 0o200 == 0 {
                fs::set_permissions(&job.dst, fs::Permissions::from_mode(job.mode))
                    .map_err(|e| job_error("setting the mode of", &job.dst, e))?;
            }
            files_done.fetch_add(1, Ordering::Relaxed);
        }
        Ok(n)
    };
    std::thread::scope(|s| {
        // Every copy thread holds a sender; the channel closes when the last one ends, which wakes
        // the progress loop at once rather than at its next tick.
        let (alive, finished) = std::sync::mpsc::channel::<()>();
        for _ in 0..copy_threads().min(pieces.len()) {
            let alive = alive.clone();
            let run_piece = &run_piece;
            let (next, pieces) = (&next, &pieces);
            let (bytes_done, failed, first_error) = (&bytes_done, &failed, &first_error);
            s.spawn(move || {
                let _alive = alive;
                while !failed.load(Ordering::Relaxed) {
                    let Some(p) = pieces.get(next.fetch_add(1, Ordering::Relaxed)) else {
                        break;
                    };
                    match run_piece(p) {
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
        drop(alive);
        // Report progress while the copy threads work.
        while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
            finished.recv_timeout(Duration::from_millis(200))
        {
            report_progress(out, &files_done, &bytes_done);
        }
    });
    if let Some(e) = first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    report_progress(out, &files_done, &bytes_done);
    Ok(())
}

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
        copy_tree_in_pieces(src.path(), &dst.path().join("ds"), 4096, None, &mut out).unwrap();
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
        };
        assert!(bad.shard().unwrap_err().contains("MIN_SIZE:COUNT:SIZE"));
    }

    #[test]
    fn copy_threads_take_files_from_each_directory_in_turn() {
        let job = |p: &str| FileJob {
            src: PathBuf::from(p),
            dst: PathBuf::from("/d").join(p),
            size: 1,
            mode: 0o644,
            stripe: None,
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
