//! `sluiced copy-as-user`: copies a POSIX dataset with the job user's identity.
//!
//! The agent starts this helper as root; before touching any file it takes the job user's groups, gid
//! and uid for good (`initgroups`, `setresgid`, `setresuid`) and checks that root cannot be regained.
//! Credentials are per process here, not per thread, so no async runtime thread ever changes identity.
//! The helper reports progress as lines on stdout (`total F B`, `progress F B`) and its error as the
//! last line on stderr, with an exit code that classifies it.

use nix::unistd::{Gid, Uid, geteuid, initgroups, setresgid, setresuid};
use std::ffi::CString;
use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

/// Exit codes of the helper.
pub const EXIT_NOT_FOUND: i32 = 2;
pub const EXIT_DENIED: i32 = 3;
pub const EXIT_NO_SPACE: i32 = 4;
pub const EXIT_OTHER: i32 = 1;

/// Copy threads in the helper: enough to hide per-file latency on parallel file systems.
const COPY_THREADS: usize = 8;

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

    pub fn apply(
        self,
        files_done: &AtomicU64,
        files_total: &AtomicU64,
        bytes_done: &AtomicU64,
        bytes_total: &AtomicU64,
    ) {
        match self {
            Event::Total { files, bytes } => {
                files_total.store(files, Ordering::Relaxed);
                bytes_total.store(bytes, Ordering::Relaxed);
            }
            Event::Progress { files, bytes } => {
                files_done.store(files, Ordering::Relaxed);
                bytes_done.store(bytes, Ordering::Relaxed);
            }
        }
    }
}

/// Turns the helper's exit into the error the job will show.
pub fn classify(
    source: &str,
    node: &str,
    code: Option<i32>,
    message: String,
) -> crate::stage::StageError {
    use crate::stage::StageError;
    match code {
        Some(EXIT_NOT_FOUND) => StageError::NotFound {
            dataset: source.to_string(),
        },
        Some(EXIT_DENIED) => StageError::Denied {
            dataset: source.to_string(),
            detail: message,
        },
        Some(EXIT_NO_SPACE) => StageError::NoSpace {
            node: node.to_string(),
            dataset: source.to_string(),
        },
        _ => StageError::Origin {
            dataset: source.to_string(),
            detail: message,
        },
    }
}

/// Drops to the user's identity for good. Fails closed: any error ends the helper.
pub fn become_user(uid: u32, gid: u32, user: &str) -> Result<(), String> {
    if geteuid().as_raw() == uid && uid != 0 {
        return die_with_parent(); // already the user (agent running unprivileged, e.g. in unit tests)
    }
    let name = CString::new(user).map_err(|_| format!("bad user name {user:?}"))?;
    initgroups(&name, Gid::from_raw(gid)).map_err(|e| format!("initgroups({user}): {e}"))?;
    setresgid(Gid::from_raw(gid), Gid::from_raw(gid), Gid::from_raw(gid))
        .map_err(|e| format!("setresgid({gid}): {e}"))?;
    setresuid(Uid::from_raw(uid), Uid::from_raw(uid), Uid::from_raw(uid))
        .map_err(|e| format!("setresuid({uid}): {e}"))?;
    if uid != 0
        && (setresuid(Uid::from_raw(0), Uid::from_raw(0), Uid::from_raw(0)).is_ok()
            || geteuid().as_raw() != uid)
    {
        return Err("could not drop root privileges".to_string());
    }
    die_with_parent()
}

/// The helper must not outlive the agent (a `kill -9`ed agent restarts and re-stages): ask for
/// SIGKILL when the parent dies. Set after the identity change, which clears it.
fn die_with_parent() -> Result<(), String> {
    nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
        .map_err(|e| format!("prctl(PR_SET_PDEATHSIG): {e}"))?;
    if nix::unistd::getppid().as_raw() == 1 {
        return Err("the agent exited before the copy started".into());
    }
    Ok(())
}

enum Entry {
    Dir(PathBuf, u32),
    File(PathBuf, u64),
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
            out.push(Entry::File(rel_child, md.len()));
        } else if ft.is_symlink() {
            out.push(Entry::Link(rel_child));
        } // sockets, fifos and devices are not data: skipped
    }
    Ok(())
}

/// Copies `src` (a file or a directory tree) to `dst`, which must not exist. Returns an exit code and
/// message on failure. Symlinks inside the tree are copied as symlinks.
pub fn copy_tree(src: &Path, dst: &Path, out: &mut impl Write) -> Result<(), (i32, String)> {
    let top = fs::metadata(src).map_err(|e| (io_exit(&e), format!("{}: {e}", src.display())))?;
    if top.is_file() {
        writeln!(out, "total 1 {}", top.len()).ok();
        out.flush().ok();
        fs::copy(src, dst).map_err(|e| (io_exit(&e), format!("copying {}: {e}", src.display())))?;
        writeln!(out, "progress 1 {}", top.len()).ok();
        return Ok(());
    }
    if !top.is_dir() {
        return Err((
            EXIT_OTHER,
            format!("{} is neither a file nor a directory", src.display()),
        ));
    }
    let mut entries = Vec::new();
    walk(src, Path::new(""), &mut entries)?;
    let (files, bytes) = entries.iter().fold((0u64, 0u64), |(f, b), e| match e {
        Entry::File(_, n) => (f + 1, b + n),
        _ => (f, b),
    });
    writeln!(out, "total {files} {bytes}").ok();
    out.flush().ok();

    let mkdir = |p: &Path, mode: u32| {
        fs::DirBuilder::new()
            .mode(0o700)
            .create(p)
            .and_then(|_| fs::set_permissions(p, fs::Permissions::from_mode(mode | 0o700)))
            .map_err(|e| (io_exit(&e), format!("creating {}: {e}", p.display())))
    };
    mkdir(dst, top.mode() & 0o7777)?;
    let mut work = Vec::new();
    for e in &entries {
        match e {
            Entry::Dir(rel, mode) => mkdir(&dst.join(rel), *mode)?,
            Entry::Link(rel) => {
                let target = fs::read_link(src.join(rel))
                    .map_err(|e| (io_exit(&e), format!("reading link {}: {e}", rel.display())))?;
                std::os::unix::fs::symlink(target, dst.join(rel))
                    .map_err(|e| (io_exit(&e), format!("creating link {}: {e}", rel.display())))?;
            }
            Entry::File(rel, size) => work.push((rel.as_path(), *size)),
        }
    }

    let next = AtomicUsize::new(0);
    let (files_done, bytes_done) = (AtomicU64::new(0), AtomicU64::new(0));
    let failed = AtomicBool::new(false);
    let first_error: std::sync::Mutex<Option<(i32, String)>> = std::sync::Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..COPY_THREADS.min(work.len().max(1)) {
            s.spawn(|| {
                while !failed.load(Ordering::Relaxed) {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some((rel, size)) = work.get(i) else {
                        break;
                    };
                    if let Err(e) = fs::copy(src.join(rel), dst.join(rel)) {
                        failed.store(true, Ordering::Relaxed);
                        let mut slot = first_error.lock().unwrap_or_else(|p| p.into_inner());
                        slot.get_or_insert((
                            io_exit(&e),
                            format!("copying {}: {e}", rel.display()),
                        ));
                        break;
                    }
                    files_done.fetch_add(1, Ordering::Relaxed);
                    bytes_done.fetch_add(*size, Ordering::Relaxed);
                }
            });
        }
        // Report progress while the copy threads work.
        loop {
            let done = files_done.load(Ordering::Relaxed);
            writeln!(
                out,
                "progress {done} {}",
                bytes_done.load(Ordering::Relaxed)
            )
            .ok();
            out.flush().ok();
            if done as usize >= work.len() || failed.load(Ordering::Relaxed) {
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    });
    if let Some(e) = first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    writeln!(
        out,
        "progress {} {}",
        files_done.load(Ordering::Relaxed),
        bytes_done.load(Ordering::Relaxed)
    )
    .ok();
    Ok(())
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
