//! The walk of the source as the job user (sorted, never through a link; sockets, fifos and
//! devices skipped), and making its directories and links below the destination.

use super::error::HelperError;
use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

pub(super) enum Entry {
    Dir(PathBuf, u32),
    File(PathBuf, u64, u32),
    Link(PathBuf),
}

fn walk(root: &Path, rel: &Path, out: &mut Vec<Entry>) -> Result<(), HelperError> {
    let dir = root.join(rel);
    let rd = fs::read_dir(&dir).map_err(HelperError::io("cannot list", &dir))?;
    let mut names: Vec<_> = rd.filter_map(|e| e.ok()).collect();
    names.sort_by_key(|e| e.file_name());
    for e in names {
        let rel_child = rel.join(e.file_name());
        let path = root.join(&rel_child);
        let md = fs::symlink_metadata(&path).map_err(HelperError::io("cannot stat", &path))?;
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

/// The process' umask, so that files and directories are created with their final mode and need no
/// `chmod` afterwards unless the umask strips bits they need.
pub(super) fn umask() -> u32 {
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Umask:"))
                .and_then(|v| u32::from_str_radix(v.trim(), 8).ok())
        })
        .unwrap_or(0o777) // unknown: always chmod
}

/// `src` as the walk found it: a directory (its mode, and every entry below it) or one file
/// (a single [`Entry::File`] at the empty path).
pub(super) struct Tree {
    pub(super) dir: Option<u32>,
    pub(super) entries: Vec<Entry>,
}

impl Tree {
    pub(super) fn read(src: &Path) -> Result<Tree, HelperError> {
        let top = fs::metadata(src).map_err(|source| HelperError::Source {
            path: src.to_path_buf(),
            source,
        })?;
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
            Err(HelperError::NotFileOrDirectory(src.to_path_buf()))
        }
    }

    /// The regular files: path below the source, size, mode.
    pub(super) fn files(&self) -> impl Iterator<Item = (&Path, u64, u32)> {
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
    pub(super) fn make(
        &self,
        src: &Path,
        dst: &Path,
        umask: u32,
        shared_tier: bool,
        replace: bool,
    ) -> Result<(), HelperError> {
        let Some(top_mode) = self.dir else {
            return Ok(());
        };
        let mkdir = |p: &Path, mode: u32| {
            let mode = mode | 0o700;
            if replace {
                match fs::symlink_metadata(p) {
                    Ok(m) if m.is_dir() => {
                        return fs::set_permissions(p, fs::Permissions::from_mode(mode))
                            .map_err(HelperError::io("setting the mode of", p));
                    }
                    Ok(_) => remove_any(p).map_err(HelperError::io("replacing", p))?,
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
            .map_err(HelperError::io("creating", p))
        };
        mkdir(dst, top_mode)?;
        for e in &self.entries {
            match e {
                Entry::Dir(rel, mode) => mkdir(&dst.join(rel), *mode)?,
                Entry::Link(rel) => {
                    let target = fs::read_link(src.join(rel))
                        .map_err(HelperError::io("reading link", rel))?;
                    if replace {
                        remove_any(&dst.join(rel))
                            .map_err(HelperError::io("replacing", &dst.join(rel)))?;
                    }
                    std::os::unix::fs::symlink(target, dst.join(rel))
                        .map_err(HelperError::io("creating link", rel))?;
                }
                Entry::File(..) => {}
            }
        }
        Ok(())
    }
}

/// `root/rel`, or `root` itself for the empty path (a dataset that is one file).
pub(super) fn below(root: &Path, rel: &Path) -> PathBuf {
    if rel.as_os_str().is_empty() {
        root.to_path_buf()
    } else {
        root.join(rel)
    }
}

/// Removes `path`, a directory with everything below it, never following a link; what is not
/// there counts as removed.
pub(super) fn remove_any(path: &Path) -> io::Result<()> {
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
