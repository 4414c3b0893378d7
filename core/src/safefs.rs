//! File operations that are safe for root inside directories a user controls.
//!
//! The agent runs as root and writes staged data into job directories owned by the job user. A user
//! (from another step or job on the node) may race it by planting symlinks or swapping directories. So
//! every operation here is fd-relative: directories are opened one component at a time with
//! `O_NOFOLLOW | O_DIRECTORY`, files are created with `O_CREAT | O_EXCL | O_NOFOLLOW` and chowned
//! through the fd. A symlink anywhere makes the operation fail; nothing outside the starting directory
//! is ever opened, created, chowned or removed. Root removes only what is the tree's user's or its
//! own, on the tree's file system ([`remove_tree`] with [`RemoveAs`]): another user's files that a
//! user moved into their job's tree stay. An existing directory is used only if it is the expected
//! owner's ([`ensure_dir`]).
//!
//! These functions block; call them from blocking threads.

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, openat};
use nix::sys::stat::{Mode, SFlag, fstat, fstatat, mkdirat};
use nix::unistd::{Gid, Uid, UnlinkatFlags, fchown, unlinkat};
use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;

/// Deepest directory nesting the agent creates or removes.
pub const MAX_DEPTH: usize = 256;

#[derive(Debug, thiserror::Error)]
pub enum SafeFsError {
    #[error("{op} '{path}': {errno}")]
    Sys {
        op: &'static str,
        path: String,
        errno: Errno,
    },
    #[error("'{0}' is not a plain relative path")]
    BadPath(String),
    #[error("'{0}' nests deeper than {MAX_DEPTH} directories")]
    TooDeep(String),
    #[error(
        "'{path}' holds {skipped} entries of other users, which sluice does not remove: move them out of it"
    )]
    OthersLeft { path: String, skipped: u64 },
}

impl SafeFsError {
    pub fn errno(&self) -> Option<Errno> {
        match self {
            SafeFsError::Sys { errno, .. } => Some(*errno),
            _ => None,
        }
    }
}

type Result<T> = std::result::Result<T, SafeFsError>;

fn sys(op: &'static str, path: impl AsRef<Path>) -> impl FnOnce(Errno) -> SafeFsError {
    let path = path.as_ref().display().to_string();
    move |errno| SafeFsError::Sys { op, path, errno }
}

const DIR_FLAGS: OFlag = OFlag::O_RDONLY
    .union(OFlag::O_DIRECTORY)
    .union(OFlag::O_NOFOLLOW)
    .union(OFlag::O_CLOEXEC);

/// The owner given to everything created for a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owner {
    pub uid: u32,
    pub gid: u32,
}

impl Owner {
    fn apply(self, fd: impl AsFd, path: &Path) -> Result<()> {
        fchown(
            fd,
            Some(Uid::from_raw(self.uid)),
            Some(Gid::from_raw(self.gid)),
        )
        .map_err(sys("chown", path))
    }
}

/// Opens an absolute directory path that root controls (the hot-tier root, the agent's state dir),
/// refusing symlinks in its last component.
pub fn open_root_dir(path: &Path) -> Result<OwnedFd> {
    openat(nix::fcntl::AT_FDCWD, path, DIR_FLAGS, Mode::empty()).map_err(sys("open", path))
}

/// Checks that a name is one plain path component.
pub fn check_component(name: &str) -> Result<()> {
    if name.is_empty() || name == "." || name == ".." || name.contains('/') || name.contains('\0') {
        return Err(SafeFsError::BadPath(name.to_string()));
    }
    Ok(())
}

/// Opens the directory `name` inside `dir` without following a symlink.
pub fn open_dir(dir: impl AsFd, name: &str) -> Result<OwnedFd> {
    check_component(name)?;
    openat(dir, name, DIR_FLAGS, Mode::empty()).map_err(sys("open", name))
}

/// Creates directory `name` in `dir` (it must not exist), owned by `owner` with `mode`, and opens it.
/// The chown goes through the opened fd, after checking that what we opened is the directory we made
/// (a user cannot have swapped it: `O_NOFOLLOW` refuses a symlink put in its place).
pub fn create_dir(dir: impl AsFd, name: &str, owner: Option<Owner>, mode: u32) -> Result<OwnedFd> {
    check_component(name)?;
    mkdirat(dir.as_fd(), name, Mode::from_bits_truncate(mode)).map_err(sys("mkdir", name))?;
    let fd = open_dir(dir, name)?;
    finish_dir(&fd, name, owner, mode)?;
    Ok(fd)
}

fn finish_dir(fd: &OwnedFd, name: &str, owner: Option<Owner>, mode: u32) -> Result<()> {
    if let Some(owner) = owner {
        owner.apply(fd, Path::new(name))?;
    }
    // mkdir's mode is filtered by the umask; set it exactly.
    nix::sys::stat::fchmod(fd, Mode::from_bits_truncate(mode)).map_err(sys("chmod", name))
}

/// Opens `name` in `dir`, creating it if missing. An existing entry must be a directory we may use:
/// not a symlink (refused by `O_NOFOLLOW`) and owned by `owner` or, without one, by root (or this
/// process's user, when that is not root); anyone else's is refused with `EPERM`.
pub fn ensure_dir(dir: impl AsFd, name: &str, owner: Option<Owner>, mode: u32) -> Result<OwnedFd> {
    check_component(name)?;
    match mkdirat(dir.as_fd(), name, Mode::from_bits_truncate(mode)) {
        Ok(()) => {
            let fd = open_dir(dir, name)?;
            finish_dir(&fd, name, owner, mode)?;
            Ok(fd)
        }
        Err(Errno::EEXIST) => {
            let fd = open_dir(dir, name)?;
            let st = fstat(&fd).map_err(sys("stat", name))?;
            // Without an owner the directory is this process's own: root's, in the agent (a
            // user's `sluice` also takes root's directories on its path).
            let ours = match owner {
                Some(o) => st.st_uid == o.uid,
                None => st.st_uid == 0 || st.st_uid == nix::unistd::geteuid().as_raw(),
            };
            // Root-owned: another of our own tasks made it a moment ago and has not chowned it
            // yet (a user can neither create nor move a root-owned directory into the job tree).
            if st.st_uid == 0 && owner.is_some_and(|o| o.uid != 0) {
                finish_dir(&fd, name, owner, mode)?;
            } else if !ours {
                // Someone else's: a user who made it first, or moved it here, must not get root
                // to write into it (or, for a root-only directory, to trust what is in it).
                return Err(SafeFsError::Sys {
                    op: "use existing directory",
                    path: name.to_string(),
                    errno: Errno::EPERM,
                });
            }
            Ok(fd)
        }
        Err(e) => Err(sys("mkdir", name)(e)),
    }
}

/// Walks `rel` (a relative path of plain components) from `root`, creating missing directories owned
/// by `owner`. Returns the innermost directory.
pub fn ensure_dirs(root: &OwnedFd, rel: &[&str], owner: Option<Owner>) -> Result<OwnedFd> {
    if rel.len() > MAX_DEPTH {
        return Err(SafeFsError::TooDeep(rel.join("/")));
    }
    let mut cur = root
        .try_clone()
        .map_err(|e| sys("dup", "")(Errno::from_raw(e.raw_os_error().unwrap_or(0))))?;
    for name in rel {
        cur = ensure_dir(&cur, name, owner, 0o755)?;
    }
    Ok(cur)
}

/// Creates a new regular file `name` in `dir` (it must not exist), owned by `owner`, opened for writing.
pub fn create_file(dir: impl AsFd, name: &str, owner: Option<Owner>, mode: u32) -> Result<File> {
    check_component(name)?;
    let flags =
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let fd =
        openat(dir, name, flags, Mode::from_bits_truncate(mode)).map_err(sys("create", name))?;
    if let Some(owner) = owner {
        owner.apply(&fd, Path::new(name))?;
    }
    Ok(File::from(fd))
}

/// Outcome of a recursive removal.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Removed {
    pub entries: u64,
    /// Entries that could not be removed (bounded: the walk goes on past them).
    pub failed: u64,
    /// Entries left in place because they are neither the tree's user's nor root's, or directories
    /// on another file system than the top of the removal (a directory counts once: it is not
    /// walked). The directories above them stay too, and are not counted.
    pub skipped: u64,
}

impl Removed {
    /// An error when something of another user's stayed below `name`, for a caller about to
    /// create `name` afresh.
    pub fn all_gone(self, name: &str) -> Result<Removed> {
        match self.skipped {
            0 => Ok(self),
            skipped => Err(SafeFsError::OthersLeft {
                path: name.to_string(),
                skipped,
            }),
        }
    }
}

/// Whose tree a removal walks ([`remove_tree`]): it enters only directories owned by `uid`, root or
/// this process (root in the agent) and unlinks only their files. A user can move a directory holding someone else's files into a
/// tree that root removes (their job's stage directory, a restore destination) wherever that other
/// user's directories let them; root must not delete those files for them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoveAs {
    pub uid: u32,
}

impl RemoveAs {
    /// A tree that only the agent writes (its marks, the cache's fill directory): root's in
    /// production, the test user's where a unit test runs the agent's code unprivileged.
    pub fn agent() -> RemoveAs {
        RemoveAs {
            uid: nix::unistd::geteuid().as_raw(),
        }
    }
}

/// Removes every entry below the open directory `dir` (not `dir` itself) with [`remove_tree`]:
/// what a failed restore left in a destination. `Err` says what stays: entries that could not be
/// removed, and other users' entries moved in there, which are left in place.
pub fn clear_dir(dir: &OwnedFd, who: RemoveAs) -> std::result::Result<(), String> {
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
    let mut d = nix::dir::Dir::openat(dir, ".", flags, Mode::empty()).map_err(|e| e.to_string())?;
    let names: Vec<std::ffi::CString> = d
        .iter()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_owned())
        .filter(|n| n.as_bytes() != b"." && n.as_bytes() != b"..")
        .collect();
    let (mut failed, mut skipped) = (0, 0);
    for name in names {
        match name.to_str().map(|n| remove_tree(dir, n, who)) {
            Ok(Ok(r)) => (failed, skipped) = (failed + r.failed, skipped + r.skipped),
            _ => failed += 1,
        }
    }
    let mut left = Vec::new();
    if failed > 0 {
        left.push(format!("{failed} entries could not be removed"));
    }
    if skipped > 0 {
        left.push(format!(
            "{skipped} entries of other users were left in place"
        ));
    }
    if left.is_empty() {
        Ok(())
    } else {
        Err(left.join(", "))
    }
}

/// [`RemoveAs`] with this process's uid, looked up once per removal.
#[derive(Debug, Clone, Copy)]
struct Judge {
    uid: u32,
    me: u32,
}

impl Judge {
    fn of(who: RemoveAs) -> Judge {
        Judge {
            uid: who.uid,
            me: nix::unistd::geteuid().as_raw(),
        }
    }

    /// Whether an entry may go: `who`'s, root's or this process's and, for a directory, on the file
    /// system `dev` (a mount below the tree is not walked). Files are not held to `dev`: overlayfs
    /// reports its layers' devices for them, and a file mounted over one cannot be unlinked anyway.
    fn may_remove(self, st: &nix::sys::stat::FileStat, dev: u64) -> bool {
        let owner_ok = st.st_uid == self.uid || st.st_uid == 0 || st.st_uid == self.me;
        owner_ok && (!is_dir(st) || st.st_dev == dev)
    }
}

impl From<Owner> for RemoveAs {
    fn from(owner: Owner) -> RemoveAs {
        RemoveAs { uid: owner.uid }
    }
}

fn is_dir(st: &nix::sys::stat::FileStat) -> bool {
    SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFDIR
}

/// Removes `name` inside `dir` and everything below it that is `who`'s or root's, never following
/// a symlink and never leaving `dir`: each level is entered through an fd opened with
/// `O_NOFOLLOW`, checked on that fd (owner, and the device of `name` itself: a mount below is not
/// walked), and entries are removed with `unlinkat` relative to it. What another user owns is left
/// in place and counted in [`Removed::skipped`], with the directories above it (so `name` itself
/// may stay; that is not an error). A missing `name` is not an error.
///
/// A file is judged by an `fstatat` just before its `unlinkat`: a user who can write the directory
/// could swap another user's file in between, but only one they could already move (and so
/// unlink) themselves. Directories are judged on the opened fd, so none is walked by mistake.
pub fn remove_tree(dir: impl AsFd, name: &str, who: RemoveAs) -> Result<Removed> {
    check_component(name)?;
    let who = Judge::of(who);
    let mut removed = Removed::default();
    let st = match fstatat(dir.as_fd(), name, AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(st) => st,
        Err(Errno::ENOENT) => return Ok(removed),
        Err(e) => return Err(sys("stat", name)(e)),
    };
    if is_dir(&st) {
        let sub = open_dir(dir.as_fd(), name)?;
        let st = fstat(&sub).map_err(sys("stat", name))?;
        if !who.may_remove(&st, st.st_dev) {
            removed.skipped += 1;
            return Ok(removed);
        }
        remove_contents(&sub, who, st.st_dev, 1, &mut removed);
        if removed.skipped > 0 {
            return Ok(removed);
        }
        unlinkat(dir, name, UnlinkatFlags::RemoveDir).map_err(sys("rmdir", name))?;
    } else if !who.may_remove(&st, st.st_dev) {
        removed.skipped += 1;
        return Ok(removed);
    } else {
        unlinkat(dir, name, UnlinkatFlags::NoRemoveDir).map_err(sys("unlink", name))?;
    }
    removed.entries += 1;
    Ok(removed)
}

fn remove_contents(dirfd: &OwnedFd, who: Judge, dev: u64, depth: usize, removed: &mut Removed) {
    let names: Vec<std::ffi::CString> = {
        let dup = match dirfd.try_clone() {
            Ok(d) => d,
            Err(_) => {
                removed.failed += 1;
                return;
            }
        };
        let Ok(mut d) = nix::dir::Dir::from_fd(dup) else {
            removed.failed += 1;
            return;
        };
        d.iter()
            .filter_map(|e| e.ok())
            .filter(|e| {
                let n = e.file_name().to_bytes();
                n != b"." && n != b".."
            })
            .map(|e| e.file_name().to_owned())
            .collect()
    };
    for name in names {
        let name = name.as_c_str();
        let st = match fstatat(dirfd, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::ENOENT) => continue, // removed meanwhile (another node, on the shared tier)
            Err(_) => {
                removed.failed += 1;
                continue;
            }
        };
        if !who.may_remove(&st, dev) {
            removed.skipped += 1;
            continue;
        }
        if !is_dir(&st) {
            match unlinkat(dirfd, name, UnlinkatFlags::NoRemoveDir) {
                Ok(()) | Err(Errno::ENOENT) => removed.entries += 1,
                Err(_) => removed.failed += 1,
            }
            continue;
        }
        if depth >= MAX_DEPTH {
            removed.failed += 1;
            continue;
        }
        let sub = match openat(dirfd, name, DIR_FLAGS, Mode::empty()) {
            Ok(sub) => sub,
            Err(Errno::ENOENT) => continue,
            Err(_) => {
                removed.failed += 1;
                continue;
            }
        };
        // What was opened is what gets walked: judge it, not the entry stat'ed a moment ago.
        match fstat(&sub) {
            Ok(st) if who.may_remove(&st, dev) => {}
            Ok(_) => {
                removed.skipped += 1;
                continue;
            }
            Err(_) => {
                removed.failed += 1;
                continue;
            }
        }
        let before = removed.skipped;
        remove_contents(&sub, who, dev, depth + 1, removed);
        if removed.skipped > before {
            continue; // it holds what stays
        }
        match unlinkat(dirfd, name, UnlinkatFlags::RemoveDir) {
            Ok(()) | Err(Errno::ENOENT) => removed.entries += 1,
            Err(_) => removed.failed += 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn creates_nested_dirs_and_refuses_symlinks() {
        let tmp = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let root = open_root_dir(tmp.path()).unwrap();
        let d = ensure_dirs(&root, &["a", "b"], None).unwrap();
        let mut f = create_file(&d, "f", None, 0o644).unwrap();
        std::io::Write::write_all(&mut f, b"x").unwrap();
        assert_eq!(std::fs::read(tmp.path().join("a/b/f")).unwrap(), b"x");

        // A symlink planted where a directory is expected is never followed.
        symlink(outside.path(), tmp.path().join("evil")).unwrap();
        let e = ensure_dirs(&root, &["evil", "x"], None).unwrap_err();
        // Linux answers ENOTDIR for O_DIRECTORY|O_NOFOLLOW on a symlink (ELOOP without O_DIRECTORY).
        assert!(
            matches!(e.errno(), Some(Errno::ELOOP | Errno::ENOTDIR)),
            "{e}"
        );
        assert!(std::fs::read_dir(outside.path()).unwrap().next().is_none());

        // An existing file is never opened for writing (O_EXCL), and a symlink is not created through.
        symlink(outside.path().join("target"), tmp.path().join("a/b/link")).unwrap();
        assert!(create_file(&d, "link", None, 0o644).is_err());
        assert!(!outside.path().join("target").exists());
        assert!(create_file(&d, "f", None, 0o644).is_err());
        assert!(matches!(
            check_component(".."),
            Err(SafeFsError::BadPath(_))
        ));
    }

    #[test]
    #[ignore = "needs root: chown needs root, as in the agent; run as root with --ignored, as tests/harness/run-e2e.sh does"]
    fn a_directory_being_created_by_another_task_is_adopted() {
        let tmp = tempfile::tempdir().unwrap();
        let root = open_root_dir(tmp.path()).unwrap();
        let owner = Owner {
            uid: 65534,
            gid: 65534,
        };
        // The race: task A made `d` as root and has not chowned it yet when task B arrives.
        std::fs::create_dir(tmp.path().join("d")).unwrap();
        let d = ensure_dir(&root, "d", Some(owner), 0o755).unwrap();
        assert_eq!(fstat(&d).unwrap().st_uid, 65534);
        // Another user's directory is still refused.
        std::fs::create_dir(tmp.path().join("e")).unwrap();
        std::os::unix::fs::chown(tmp.path().join("e"), Some(1234), None).unwrap();
        assert_eq!(
            ensure_dir(&root, "e", Some(owner), 0o755)
                .unwrap_err()
                .errno(),
            Some(Errno::EPERM)
        );
    }

    #[test]
    fn remove_tree_stays_inside() {
        let tmp = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("keep"), b"precious").unwrap();
        let job = tmp.path().join("job");
        std::fs::create_dir_all(job.join("d/e")).unwrap();
        std::fs::write(job.join("d/e/f"), b"1").unwrap();
        symlink(outside.path(), job.join("d/link-to-outside")).unwrap();
        symlink(outside.path().join("keep"), job.join("file-link")).unwrap();
        let root = open_root_dir(tmp.path()).unwrap();
        let me = RemoveAs {
            uid: nix::unistd::geteuid().as_raw(),
        };
        let r = remove_tree(&root, "job", me).unwrap();
        assert_eq!((r.failed, r.skipped), (0, 0));
        assert!(!job.exists());
        assert_eq!(
            std::fs::read(outside.path().join("keep")).unwrap(),
            b"precious"
        );
        assert_eq!(remove_tree(&root, "job", me).unwrap(), Removed::default());
    }

    #[test]
    #[ignore = "needs root: chown needs root, as in the agent; run as root with --ignored, as tests/harness/run-e2e.sh does"]
    fn ensure_dir_without_owner_takes_only_roots_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let root = open_root_dir(tmp.path()).unwrap();
        // Root's own half-made directory (another task's) is adopted.
        std::fs::create_dir(tmp.path().join("ours")).unwrap();
        ensure_dir(&root, "ours", None, 0o700).unwrap();
        // A user's directory where root expects its own is refused: root would write its private
        // state (marks, cache entries, a shared-tier job) into a directory the user controls.
        std::fs::create_dir(tmp.path().join("theirs")).unwrap();
        std::os::unix::fs::chown(tmp.path().join("theirs"), Some(4242), Some(4242)).unwrap();
        let e = ensure_dir(&root, "theirs", None, 0o700).unwrap_err();
        assert_eq!(e.errno(), Some(Errno::EPERM), "{e}");
        assert!(e.to_string().contains("theirs"), "{e}");
    }

    fn chown(p: &Path, uid: u32) {
        std::os::unix::fs::lchown(p, Some(uid), Some(uid)).unwrap();
    }

    /// Root's, the job user's and a third user's uids in the removal tests.
    const ROOT: u32 = 0;
    const USER: u32 = 4201;
    const OTHER: u32 = 4202;
    /// What [`plant`] makes a directory.
    const DIR: Option<&str> = None;

    /// Makes each `(path, content, owner)` below `dir`, in order: a directory for [`DIR`], else a
    /// file holding `content`; owned by `owner`, as are the parents it makes for it.
    fn plant(dir: &Path, entries: &[(&str, Option<&str>, u32)]) {
        for &(path, content, owner) in entries {
            let parents: Vec<&Path> = Path::new(path).ancestors().skip(1).collect();
            for parent in parents.into_iter().rev().map(|a| dir.join(a)) {
                if !parent.exists() {
                    std::fs::create_dir(&parent).unwrap();
                    chown(&parent, owner);
                }
            }
            let p = dir.join(path);
            match content {
                None => std::fs::create_dir(&p).unwrap(),
                Some(content) => std::fs::write(&p, content).unwrap(),
            }
            chown(&p, owner);
        }
    }

    /// A failed restore's destination is cleared of the caller's files; another user's entry moved
    /// in stays, and the error says so.
    #[test]
    #[ignore = "needs root: chown needs root, as in the agent; run as root with --ignored, as tests/harness/run-e2e.sh does"]
    fn clear_dir_leaves_other_users_entries_and_says_so() {
        let tmp = tempfile::tempdir().unwrap();
        let dest = tmp.path();
        plant(
            dest,
            &[
                ("part/f", Some("partial"), USER),
                ("theirs", Some("x"), OTHER),
            ],
        );
        let fd = open_root_dir(dest).unwrap();
        let e = clear_dir(&fd, RemoveAs { uid: USER }).unwrap_err();
        assert_eq!(e, "1 entries of other users were left in place");
        assert!(!dest.join("part").exists());
        assert_eq!(std::fs::read(dest.join("theirs")).unwrap(), b"x");
        std::fs::remove_file(dest.join("theirs")).unwrap();
        assert_eq!(clear_dir(&fd, RemoveAs { uid: USER }), Ok(()));
    }

    #[test]
    #[ignore = "needs root: chown needs root, as in the agent; run as root with --ignored, as tests/harness/run-e2e.sh does"]
    fn remove_tree_leaves_other_users_files() {
        let tmp = tempfile::tempdir().unwrap();
        let job = tmp.path().join("job");
        plant(
            tmp.path(),
            &[
                // The job user's own data, and a file root wrote for them (a mark, a manifest).
                ("job/data/sub/f", Some("1"), USER),
                ("job/by-root", Some("2"), ROOT),
                // What the user moved in from where another user let them: a whole directory of
                // that user's, and one of that user's files into a directory of their own.
                ("job/moved/deeper/secret", Some("theirs"), OTHER),
                ("job/mine/own", Some("3"), USER),
                ("job/mine/their-file", Some("theirs too"), OTHER),
            ],
        );

        let root = open_root_dir(tmp.path()).unwrap();
        let r = remove_tree(&root, "job", RemoveAs { uid: USER }).unwrap();
        // The other user's directory counts once (it is not walked), their file once.
        assert_eq!((r.skipped, r.failed), (2, 0), "{r:?}");
        assert_eq!(
            std::fs::read(job.join("moved/deeper/secret")).unwrap(),
            b"theirs"
        );
        assert_eq!(
            std::fs::read(job.join("mine/their-file")).unwrap(),
            b"theirs too"
        );
        // Everything of the job user's and root's went; the directories holding what stays did not.
        for gone in ["data", "by-root", "mine/own"] {
            assert!(!job.join(gone).exists(), "{gone} is left");
        }
        // Removing it again (as a later clean-up would) still leaves them and counts them.
        let again = remove_tree(&root, "job", RemoveAs { uid: USER }).unwrap();
        assert_eq!((again.entries, again.skipped), (0, 2), "{again:?}");

        // The top itself another user's: nothing below it is touched.
        let r = remove_tree(
            open_root_dir(&job).unwrap(),
            "moved",
            RemoveAs { uid: USER },
        )
        .unwrap();
        assert_eq!((r.entries, r.skipped), (0, 1), "{r:?}");
        assert!(job.join("moved/deeper/secret").exists());

        // A tree of the job user's (and root's) alone goes whole.
        plant(
            tmp.path(),
            &[
                ("own/a/b/f", Some("x"), USER),
                ("own/a/root-file", Some("y"), ROOT),
            ],
        );
        let r = remove_tree(&root, "own", RemoveAs { uid: USER }).unwrap();
        assert_eq!(
            r,
            Removed {
                entries: 5,
                failed: 0,
                skipped: 0
            }
        );
        assert!(!tmp.path().join("own").exists());
    }

    #[test]
    #[ignore = "needs root: mounting needs root, as the agent's RAM tier does; run as root with --ignored, as tests/harness/run-e2e.sh does"]
    fn remove_tree_stays_on_its_file_system() {
        /// Unmounts at the end, whatever the test did.
        struct Mounted(std::path::PathBuf);
        impl Drop for Mounted {
            fn drop(&mut self) {
                let _ = nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH);
            }
        }
        let tmp = tempfile::tempdir().unwrap();
        let job = tmp.path().join("job");
        let mnt = job.join("mnt");
        plant(
            tmp.path(),
            &[("job/mnt", DIR, USER), ("job/f", Some("1"), USER)],
        );
        // Another file system below the job's tree, even one of the job user's own.
        nix::mount::mount(
            Some("sluice-test"),
            &mnt,
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            Some(format!("size=1m,uid={USER},gid={USER},mode=0700").as_str()),
        )
        .expect("mounting a tmpfs (the test runs as root)");
        let _guard = Mounted(mnt.clone());
        plant(&mnt, &[("elsewhere", Some("kept"), USER)]);

        let root = open_root_dir(tmp.path()).unwrap();
        let r = remove_tree(&root, "job", RemoveAs { uid: USER }).unwrap();
        assert_eq!((r.entries, r.skipped, r.failed), (1, 1, 0), "{r:?}");
        assert_eq!(std::fs::read(mnt.join("elsewhere")).unwrap(), b"kept");
        assert!(!job.join("f").exists());
    }
}
