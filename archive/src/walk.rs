//! Reading a checkpoint directory as root, inside a tree the job user controls.
//!
//! The agent reads checkpoint files with root's privileges, so a user must not be able to make it
//! read (and upload to a bucket they can read) anything they could not read themselves. Everything is
//! fd-relative from the checkpoint directory: directories are opened with
//! `O_DIRECTORY | O_NOFOLLOW`, files with `O_NOFOLLOW | O_NONBLOCK` (a FIFO cannot block us), and what
//! was opened is checked through its fd:
//!
//! - a file must be a regular file owned by the job user with exactly one link — a hard link to a
//!   root-only file keeps root's uid, and one to another user's file keeps theirs; the link count
//!   catches the rest;
//! - a directory must be owned by the job user;
//! - nothing may sit on another file system than the checkpoint directory;
//! - symlinks, FIFOs, sockets and devices are refused, naming the entry.
//!
//! A writer's temporary file whose finished file stands beside it (`.NAME.PID.SEQ.tmp` next to
//! `NAME`, [`sluice_core::durable::temp_beside`]) is left out: a writer killed mid-save leaves one,
//! and a later save of the same file finished without it. It is no part of the checkpoint, and
//! archiving it would store (and restore) a torn copy under a hidden name.
//!
//! A refusal stops the archive before anything is uploaded. These functions block.

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, openat};
use nix::sys::stat::{FileStat, Mode, SFlag, fstat, fstatat};
use sluice_core::safefs;
use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};

#[derive(Debug, thiserror::Error)]
pub enum WalkError {
    /// The tree holds something that must not be archived.
    #[error("'{path}' {reason}")]
    Refused { path: String, reason: String },
    #[error("'{path}': {errno}")]
    Io { path: String, errno: Errno },
}

impl WalkError {
    pub fn path(&self) -> &str {
        match self {
            WalkError::Refused { path, .. } | WalkError::Io { path, .. } => path,
        }
    }
}

fn refused(path: &str, reason: impl Into<String>) -> WalkError {
    WalkError::Refused {
        path: path.to_string(),
        reason: reason.into(),
    }
}

fn io(path: &str) -> impl FnOnce(Errno) -> WalkError + '_ {
    move |errno| WalkError::Io {
        path: path.to_string(),
        errno,
    }
}

/// A file found by [`walk`].
#[derive(Debug, Clone)]
pub struct TreeFile {
    /// `/`-separated path below the checkpoint directory.
    pub rel: String,
    pub size: u64,
    pub mode: u32,
    pub ino: u64,
    /// Modification and status-change times (ns since the epoch) from the walk's `fstatat`: with
    /// `ino` and `size`, what tells a resumed upload that the file is the one it already stored.
    pub mtime_ns: i64,
    pub ctime_ns: i64,
}

impl TreeFile {
    pub fn parts(&self) -> Vec<&str> {
        self.rel.split('/').collect()
    }
}

/// The files and directories of a checkpoint directory.
#[derive(Debug, Default)]
pub struct Tree {
    /// Sorted by path.
    pub files: Vec<TreeFile>,
    /// Every directory below the root, sorted.
    pub dirs: Vec<String>,
    /// Writers' temporary files left out because their finished file stands beside them (see
    /// the module doc), sorted.
    pub superseded: Vec<String>,
}

/// Whether `name` is a temporary name of `durable::temp_beside` (`.NAME.PID.SEQ.tmp`) whose `NAME`
/// is in `names`.
fn superseded_temp(name: &str, names: &std::collections::BTreeSet<String>) -> bool {
    let Some(inner) = name.strip_prefix('.').and_then(|n| n.strip_suffix(".tmp")) else {
        return false;
    };
    let mut fields = inner.rsplitn(3, '.');
    let (Some(seq), Some(pid), Some(target)) = (fields.next(), fields.next(), fields.next()) else {
        return false;
    };
    let digits = |f: &str| !f.is_empty() && f.bytes().all(|b| b.is_ascii_digit());
    digits(seq) && digits(pid) && names.contains(target)
}

fn kind(st: &FileStat) -> SFlag {
    SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT
}

fn describe(k: SFlag) -> &'static str {
    match k {
        SFlag::S_IFLNK => "is a symbolic link",
        SFlag::S_IFIFO => "is a FIFO",
        SFlag::S_IFSOCK => "is a socket",
        SFlag::S_IFCHR | SFlag::S_IFBLK => "is a device",
        _ => "is not a regular file or directory",
    }
}

const REFUSAL_HINT: &str =
    "checkpoints may only hold regular files and directories of the job user";

/// The checks every file must pass, on the `fstat` of the opened fd.
fn check_file(rel: &str, st: &FileStat, uid: u32, dev: u64) -> Result<(), WalkError> {
    if kind(st) != SFlag::S_IFREG {
        return Err(refused(
            rel,
            format!("{}; {REFUSAL_HINT}", describe(kind(st))),
        ));
    }
    if st.st_uid != uid {
        return Err(refused(
            rel,
            format!(
                "is owned by uid {}, not the job user; {REFUSAL_HINT}",
                st.st_uid
            ),
        ));
    }
    if st.st_nlink != 1 {
        return Err(refused(
            rel,
            format!(
                "has {} hard links; checkpoints may not hold hard-linked files",
                st.st_nlink
            ),
        ));
    }
    if st.st_dev != dev {
        return Err(refused(rel, "is on another file system"));
    }
    Ok(())
}

fn check_dir(rel: &str, st: &FileStat, uid: u32, dev: u64) -> Result<(), WalkError> {
    if kind(st) != SFlag::S_IFDIR {
        return Err(refused(rel, describe(kind(st))));
    }
    if st.st_uid != uid {
        return Err(refused(
            rel,
            format!(
                "is a directory owned by uid {}, not the job user",
                st.st_uid
            ),
        ));
    }
    if st.st_dev != dev {
        return Err(refused(rel, "is on another file system (a mount point)"));
    }
    Ok(())
}

fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}/{name}")
    }
}

/// Lists the tree below `root`, refusing anything that is not a regular file or directory of
/// `uid` (see the module doc). The root itself must be a directory of `uid`.
pub fn walk(root: &OwnedFd, uid: u32) -> Result<Tree, WalkError> {
    let st = fstat(root).map_err(io("."))?;
    check_dir(".", &st, uid, st.st_dev)?;
    let mut tree = Tree::default();
    let dup = root.try_clone().map_err(|e| WalkError::Io {
        path: ".".into(),
        errno: Errno::from_raw(e.raw_os_error().unwrap_or(0)),
    })?;
    walk_dir(dup, "", 1, uid, st.st_dev, &mut tree)?;
    tree.files.sort_by(|a, b| a.rel.cmp(&b.rel));
    tree.dirs.sort();
    tree.superseded.sort();
    Ok(tree)
}

fn walk_dir(
    dirfd: OwnedFd,
    prefix: &str,
    depth: usize,
    uid: u32,
    dev: u64,
    tree: &mut Tree,
) -> Result<(), WalkError> {
    let here = if prefix.is_empty() { "." } else { prefix };
    let mut names = Vec::new();
    {
        let dup = dirfd.try_clone().map_err(|e| WalkError::Io {
            path: here.into(),
            errno: Errno::from_raw(e.raw_os_error().unwrap_or(0)),
        })?;
        let mut d = nix::dir::Dir::from_fd(dup).map_err(io(here))?;
        for e in d.iter() {
            let e = e.map_err(io(here))?;
            let raw = e.file_name();
            if matches!(raw.to_bytes(), b"." | b"..") {
                continue;
            }
            let Ok(name) = raw.to_str() else {
                return Err(refused(
                    &join(prefix, &raw.to_string_lossy()),
                    "has a name that is not UTF-8 and cannot be an object key",
                ));
            };
            names.push(name.to_string());
        }
    }
    let all: std::collections::BTreeSet<String> = names.into_iter().collect();
    for name in &all {
        let name = name.clone();
        let rel = join(prefix, &name);
        if name.len() > 255 {
            return Err(refused(&rel, "has a name longer than 255 bytes"));
        }
        let st = fstatat(&dirfd, name.as_str(), AtFlags::AT_SYMLINK_NOFOLLOW).map_err(io(&rel))?;
        match kind(&st) {
            SFlag::S_IFDIR => {
                if depth >= safefs::MAX_DEPTH {
                    return Err(refused(&rel, "nests too deep"));
                }
                let sub = open_dir(&dirfd, &name, &rel, uid, dev)?;
                tree.dirs.push(rel.clone());
                walk_dir(sub, &rel, depth + 1, uid, dev, tree)?;
            }
            SFlag::S_IFREG if superseded_temp(&name, &all) => tree.superseded.push(rel),
            SFlag::S_IFREG => {
                check_file(&rel, &st, uid, dev)?;
                tree.files.push(TreeFile {
                    rel,
                    size: st.st_size as u64,
                    mode: (st.st_mode & 0o7777) as u32,
                    ino: st.st_ino,
                    mtime_ns: nanos(st.st_mtime as i64, st.st_mtime_nsec as i64),
                    ctime_ns: nanos(st.st_ctime as i64, st.st_ctime_nsec as i64),
                });
            }
            other => {
                return Err(refused(
                    &rel,
                    format!("{}; {REFUSAL_HINT}", describe(other)),
                ));
            }
        }
    }
    Ok(())
}

fn open_dir(
    dir: impl AsFd,
    name: &str,
    rel: &str,
    uid: u32,
    dev: u64,
) -> Result<OwnedFd, WalkError> {
    let fd = safefs::open_dir(dir, name).map_err(|e| match e.errno() {
        Some(Errno::ELOOP | Errno::ENOTDIR) => {
            refused(rel, "is a symbolic link or not a directory")
        }
        Some(errno) => WalkError::Io {
            path: rel.into(),
            errno,
        },
        None => refused(rel, e.to_string()),
    })?;
    let st = fstat(&fd).map_err(io(rel))?;
    check_dir(rel, &st, uid, dev)?;
    Ok(fd)
}

/// The identity and version of an open file, compared before and after reading it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Snapshot {
    pub ino: u64,
    pub size: u64,
    pub mtime: (i64, i64),
    pub ctime: (i64, i64),
}

/// A `stat` time as nanoseconds since the epoch (saturating: past 2262 every time is the same).
fn nanos(sec: i64, nsec: i64) -> i64 {
    sec.saturating_mul(1_000_000_000).saturating_add(nsec)
}

impl Snapshot {
    pub fn mtime_ns(&self) -> i64 {
        nanos(self.mtime.0, self.mtime.1)
    }

    pub fn ctime_ns(&self) -> i64 {
        nanos(self.ctime.0, self.ctime.1)
    }

    pub fn of(file: &File, rel: &str) -> Result<Snapshot, WalkError> {
        let st = fstat(file).map_err(io(rel))?;
        Ok(Snapshot {
            ino: st.st_ino,
            size: st.st_size as u64,
            mtime: (st.st_mtime as i64, st.st_mtime_nsec as i64),
            ctime: (st.st_ctime as i64, st.st_ctime_nsec as i64),
        })
    }
}

/// Opens a file found by [`walk`] for reading, walking its directories again without following
/// links and re-checking everything on the opened fds (the user may have swapped entries since).
pub fn open_file(root: &OwnedFd, f: &TreeFile, uid: u32) -> Result<(File, Snapshot), WalkError> {
    let root_st = fstat(root).map_err(io("."))?;
    let dev = root_st.st_dev;
    let parts = f.parts();
    let (name, dirs) = parts.split_last().expect("a path has a file name");
    let mut cur: Option<OwnedFd> = None;
    let mut rel = String::new();
    for d in dirs {
        rel = join(&rel, d);
        let next = match &cur {
            None => open_dir(root, d, &rel, uid, dev)?,
            Some(c) => open_dir(c, d, &rel, uid, dev)?,
        };
        cur = Some(next);
    }
    let flags = OFlag::O_RDONLY
        | OFlag::O_NOFOLLOW
        | OFlag::O_NONBLOCK
        | OFlag::O_NOCTTY
        | OFlag::O_CLOEXEC;
    let opened = match &cur {
        None => openat(root, *name, flags, Mode::empty()),
        Some(c) => openat(c, *name, flags, Mode::empty()),
    };
    let fd = opened.map_err(|errno| match errno {
        Errno::ELOOP => refused(&f.rel, format!("is a symbolic link; {REFUSAL_HINT}")),
        errno => WalkError::Io {
            path: f.rel.clone(),
            errno,
        },
    })?;
    let st = fstat(&fd).map_err(io(&f.rel))?;
    check_file(&f.rel, &st, uid, dev)?;
    let file = File::from(fd);
    let snap = Snapshot::of(&file, &f.rel)?;
    Ok((file, snap))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::os::unix::fs::{PermissionsExt, symlink};
    use std::path::Path;

    /// The uid the test trees belong to: a non-root user when we are root (so ownership checks are
    /// real), else ourselves.
    pub fn test_uid() -> u32 {
        if nix::unistd::geteuid().is_root() {
            4242
        } else {
            nix::unistd::geteuid().as_raw()
        }
    }

    /// Fails the test, saying why it needs root, unless it runs as root. Such tests are also
    /// `#[ignore]`d, so that a plain `cargo test` reports them ignored; run-e2e.sh runs them as root.
    #[track_caller]
    pub fn assert_root(why: &str) {
        assert!(
            nix::unistd::geteuid().is_root(),
            "this test needs root: {why}"
        );
    }

    pub fn chown_tree(path: &Path, uid: u32) {
        if !nix::unistd::geteuid().is_root() {
            return;
        }
        for e in walk_paths(path) {
            std::os::unix::fs::lchown(&e, Some(uid), Some(uid)).unwrap();
        }
    }

    fn walk_paths(p: &Path) -> Vec<std::path::PathBuf> {
        let mut out = vec![p.to_path_buf()];
        if p.is_dir() && !p.is_symlink() {
            for e in std::fs::read_dir(p).unwrap() {
                out.extend(walk_paths(&e.unwrap().path()));
            }
        }
        out
    }

    fn tree(dir: &Path) -> Result<Tree, WalkError> {
        walk(&safefs::open_root_dir(dir).unwrap(), test_uid())
    }

    #[test]
    fn walks_files_and_dirs_in_order() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        std::fs::create_dir_all(d.join("a/b")).unwrap();
        std::fs::create_dir_all(d.join("empty")).unwrap();
        std::fs::write(d.join("a/b/x"), b"xx").unwrap();
        std::fs::write(d.join("a.txt"), b"1").unwrap();
        std::fs::set_permissions(d.join("a.txt"), std::fs::Permissions::from_mode(0o600)).unwrap();
        chown_tree(d, test_uid());
        let t = tree(d).unwrap();
        let files: Vec<_> = t.files.iter().map(|f| (f.rel.as_str(), f.size)).collect();
        assert_eq!(files, [("a.txt", 1), ("a/b/x", 2)]);
        assert_eq!(t.files[0].mode, 0o600);
        assert_eq!(t.dirs, ["a", "a/b", "empty"]);
        let root = safefs::open_root_dir(d).unwrap();
        let (_, snap) = open_file(&root, &t.files[1], test_uid()).unwrap();
        assert_eq!(snap.size, 2);
    }

    /// A writer killed mid-save left `.model.pt.PID.SEQ.tmp`, and a later save finished
    /// `model.pt`: the temporary file is left out (and said), never archived under its hidden
    /// name. Without its finished file beside it, or with a name that only looks like one, a file
    /// is the job's like any other.
    #[test]
    fn a_writers_temporary_file_beside_its_finished_file_is_left_out() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        std::fs::create_dir_all(d.join("sub")).unwrap();
        for (name, data) in [
            ("model.pt", &b"whole"[..]),
            (".model.pt.4242.0.tmp", b"to"),
            ("sub/optim.pt", b"whole"),
            ("sub/.optim.pt.17.3.tmp", b"t"),
            (".rank1.pt.99.0.tmp", b"only copy"),
            (".model.pt.x.0.tmp", b"a user's"),
            (".model.pt.1.tmp", b"a user's"),
        ] {
            std::fs::write(d.join(name), data).unwrap();
        }
        chown_tree(d, test_uid());
        let t = tree(d).unwrap();
        let files: Vec<&str> = t.files.iter().map(|f| f.rel.as_str()).collect();
        assert_eq!(
            files,
            [
                ".model.pt.1.tmp",
                ".model.pt.x.0.tmp",
                ".rank1.pt.99.0.tmp",
                "model.pt",
                "sub/optim.pt"
            ]
        );
        assert_eq!(
            t.superseded,
            [".model.pt.4242.0.tmp", "sub/.optim.pt.17.3.tmp"]
        );
    }

    /// Each hostile tree is refused naming the entry, and nothing outside the tree is opened.
    #[test]
    #[ignore = "needs root (the trees are another user's, the link targets root's); run as root with --ignored, as tests/harness/run-e2e.sh does"]
    fn hostile_trees_are_refused() {
        assert_root("the trees must belong to another user and the link targets to root");
        let uid = test_uid();
        let outside = tempfile::tempdir().unwrap();
        let secret = outside.path().join("secret");
        std::fs::write(&secret, b"root only").unwrap();
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();

        type Plant<'a> = dyn Fn(&Path) + 'a;
        let cases: Vec<(&str, &str, Box<Plant>)> = vec![
            (
                "symlink to a file outside",
                "d/link",
                Box::new(|d: &Path| symlink(&secret, d.join("d/link")).unwrap()),
            ),
            (
                "symlink to a directory outside",
                "d/dirlink",
                Box::new(|d: &Path| symlink(outside.path(), d.join("d/dirlink")).unwrap()),
            ),
            (
                "hard link to a root-owned file",
                "d/hard",
                Box::new(|d: &Path| {
                    // Same file system as the tree: link a root file created beside it.
                    let rootfile = d.parent().unwrap().join("rootfile");
                    std::fs::write(&rootfile, b"root only").unwrap();
                    std::fs::hard_link(&rootfile, d.join("d/hard")).unwrap();
                }),
            ),
            (
                "hard link to the user's own file",
                "d/twice",
                Box::new(|d: &Path| {
                    let own = d.parent().unwrap().join("own");
                    std::fs::write(&own, b"mine").unwrap();
                    std::os::unix::fs::lchown(&own, Some(4242), Some(4242)).unwrap();
                    std::fs::hard_link(&own, d.join("d/twice")).unwrap();
                }),
            ),
            (
                "file of another user",
                "d/nobody",
                Box::new(|d: &Path| {
                    std::fs::write(d.join("d/nobody"), b"theirs").unwrap();
                    std::os::unix::fs::lchown(d.join("d/nobody"), Some(65534), None).unwrap();
                }),
            ),
            (
                "FIFO",
                "d/fifo",
                Box::new(|d: &Path| {
                    nix::unistd::mkfifo(&d.join("d/fifo"), Mode::from_bits_truncate(0o644)).unwrap()
                }),
            ),
            (
                "directory of another user",
                "d/rootdir",
                Box::new(|d: &Path| {
                    std::fs::create_dir(d.join("d/rootdir")).unwrap();
                    std::os::unix::fs::lchown(d.join("d/rootdir"), Some(0), None).unwrap();
                }),
            ),
        ];
        for (what, entry, plant) in cases {
            let base = tempfile::tempdir().unwrap();
            let d = base.path().join("ckpt");
            std::fs::create_dir_all(d.join("d")).unwrap();
            std::fs::write(d.join("d/ok.bin"), b"fine").unwrap();
            chown_tree(&d, uid);
            plant(&d);
            let e = tree(&d).expect_err(what);
            assert_eq!(e.path(), entry, "{what}: {e}");
            assert!(matches!(e, WalkError::Refused { .. }), "{what}: {e}");
        }
        // A file swapped for a symlink between the walk and the read is refused at open time.
        let base = tempfile::tempdir().unwrap();
        let d = base.path().join("ckpt");
        std::fs::create_dir_all(d.join("sub")).unwrap();
        std::fs::write(d.join("sub/f"), b"fine").unwrap();
        chown_tree(&d, uid);
        let root = safefs::open_root_dir(&d).unwrap();
        let t = walk(&root, uid).unwrap();
        std::fs::remove_file(d.join("sub/f")).unwrap();
        symlink(&secret, d.join("sub/f")).unwrap();
        let e = open_file(&root, &t.files[0], uid).unwrap_err();
        assert!(matches!(e, WalkError::Refused { .. }), "{e}");
        // ... and so is a directory swapped for a symlink to one outside.
        std::fs::rename(d.join("sub"), d.join("old")).unwrap();
        symlink(outside.path(), d.join("sub")).unwrap();
        std::fs::write(outside.path().join("f"), b"outside").unwrap();
        std::os::unix::fs::lchown(outside.path().join("f"), Some(uid), None).unwrap();
        let e = open_file(&root, &t.files[0], uid).unwrap_err();
        assert!(matches!(e, WalkError::Refused { .. }), "{e}");
    }
}
