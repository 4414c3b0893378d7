//! File operations that are safe for root inside directories a user controls.
//!
//! The agent runs as root and writes staged data into job directories owned by the job user. A user
//! (from another step or job on the node) may race it by planting symlinks or swapping directories. So
//! every operation here is fd-relative: directories are opened one component at a time with
//! `O_NOFOLLOW | O_DIRECTORY`, files are created with `O_CREAT | O_EXCL | O_NOFOLLOW` and chowned
//! through the fd. A symlink anywhere makes the operation fail; nothing outside the starting directory
//! is ever opened, created, chowned or removed.
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
}

/// Removes `name` inside `dir` and everything below it, never following a symlink and never leaving
/// `dir`: each level is entered through an fd opened with `O_NOFOLLOW`, and entries are removed with
/// `unlinkat` relative to that fd. A missing `name` is not an error.
pub fn remove_tree(dir: impl AsFd, name: &str) -> Result<Removed> {
    check_component(name)?;
    let mut removed = Removed::default();
    let st = match fstatat(dir.as_fd(), name, AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(st) => st,
        Err(Errno::ENOENT) => return Ok(removed),
        Err(e) => return Err(sys("stat", name)(e)),
    };
    if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFDIR {
        let sub = open_dir(dir.as_fd(), name)?;
        remove_contents(sub, 1, &mut removed);
        unlinkat(dir, name, UnlinkatFlags::RemoveDir).map_err(sys("rmdir", name))?;
    } else {
        unlinkat(dir, name, UnlinkatFlags::NoRemoveDir).map_err(sys("unlink", name))?;
    }
    removed.entries += 1;
    Ok(removed)
}

fn remove_contents(dirfd: OwnedFd, depth: usize, removed: &mut Removed) {
    let names: Vec<(std::ffi::CString, bool)> = {
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
            .map(|e| {
                (
                    e.file_name().to_owned(),
                    e.file_type() == Some(nix::dir::Type::Directory),
                )
            })
            .collect()
    };
    for (name, is_dir) in names {
        let name = name.as_c_str();
        if is_dir {
            if depth >= MAX_DEPTH {
                removed.failed += 1;
                continue;
            }
            match openat(&dirfd, name, DIR_FLAGS, Mode::empty()) {
                Ok(sub) => remove_contents(sub, depth + 1, removed),
                Err(_) => {
                    removed.failed += 1;
                    continue;
                }
            }
            match unlinkat(&dirfd, name, UnlinkatFlags::RemoveDir) {
                Ok(()) => removed.entries += 1,
                Err(_) => removed.failed += 1,
            }
        } else {
            match unlinkat(&dirfd, name, UnlinkatFlags::NoRemoveDir) {
                Ok(()) => removed.entries += 1,
                // A directory whose d_type was unknown: retry as a directory.
                Err(Errno::EISDIR) => match openat(&dirfd, name, DIR_FLAGS, Mode::empty()) {
                    Ok(sub) => {
                        remove_contents(sub, depth + 1, removed);
                        match unlinkat(&dirfd, name, UnlinkatFlags::RemoveDir) {
                            Ok(()) => removed.entries += 1,
                            Err(_) => removed.failed += 1,
                        }
                    }
                    Err(_) => removed.failed += 1,
                },
                Err(_) => removed.failed += 1,
            }
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
    fn a_directory_being_created_by_another_task_is_adopted() {
        if !nix::unistd::geteuid().is_root() {
            return; // chown needs root, as in the agent
        }
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
        let r = remove_tree(&root, "job").unwrap();
        assert_eq!(r.failed, 0);
        assert!(!job.exists());
        assert_eq!(
            std::fs::read(outside.path().join("keep")).unwrap(),
            b"precious"
        );
        assert_eq!(remove_tree(&root, "job").unwrap(), Removed::default());
    }

    #[test]
    fn ensure_dir_without_owner_takes_only_roots_directory() {
        if !nix::unistd::geteuid().is_root() {
            return; // chown needs root, as in the agent
        }
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
}
