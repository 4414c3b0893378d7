//! The one durable-write helper: every piece of persisted state (the agent's journal, and what
//! comes after it) is written through [`write_durable`], never truncated in place.

use std::io::Write;
use std::path::{Path, PathBuf};

/// Writes `data` to `path` so that after a crash the file holds either the old or the new content.
pub fn write_durable(path: &Path, data: &[u8]) -> std::io::Result<()> {
    let tmp = temp_beside(path)?;
    {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)?;
        f.write_all(data)?;
        f.sync_all()?;
    }
    publish(&tmp, path)
}

/// A hidden name of its own beside `path` (same directory, so a rename publishes it):
/// `.NAME.PID.SEQ.tmp`. Two writers of the same file (a requeued job's new run and the run it
/// replaced, two threads of one process) must not rename each other's temporary file away.
pub fn temp_beside(path: &Path) -> std::io::Result<PathBuf> {
    let dir = path
        .parent()
        .ok_or_else(|| std::io::Error::other("path has no parent directory"))?;
    let name = path
        .file_name()
        .ok_or_else(|| std::io::Error::other("path has no file name"))?;
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    Ok(dir.join(format!(
        ".{}.{}.{seq}.tmp",
        name.to_string_lossy(),
        std::process::id()
    )))
}

/// Gives the fsynced file `tmp` its name `path` (replacing what was there in one step) and fsyncs
/// the directory, so that the name survives a crash.
pub fn publish(tmp: &Path, path: &Path) -> std::io::Result<()> {
    std::fs::rename(tmp, path)?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    std::fs::File::open(dir)?.sync_all()
}
