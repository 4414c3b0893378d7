//! The one durable-write helper: every piece of persisted state (the agent's journal, and what
//! comes after it) is written through [`write_durable`], never truncated in place.

use std::io::Write;
use std::path::Path;

/// Writes `data` to `path` so that after a crash the file holds either the old or the new content.
pub fn write_durable(path: &Path, data: &[u8]) -> std::io::Result<()> {
    let dir = path
        .parent()
        .ok_or_else(|| std::io::Error::other("path has no parent directory"))?;
    let name = path
        .file_name()
        .ok_or_else(|| std::io::Error::other("path has no file name"))?;
    // A name of its own per write: two writers of the same record (a requeued job's new run and the
    // run it replaced) must not rename each other's temporary file away.
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(
        ".{}.{}.{seq}.tmp",
        name.to_string_lossy(),
        std::process::id()
    ));
    {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)?;
        f.write_all(data)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    std::fs::File::open(dir)?.sync_all()
}
