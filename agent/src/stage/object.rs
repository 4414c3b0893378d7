//! Stage-in from object stores: pipelined listing, one download task per object, parallel ranged
//! GETs for large objects, every body streamed through a [`Budget`] buffer to its offset.

use super::{Budget, Lease, Progress, StageCtx, StageError, is_no_space};
use futures::StreamExt;
use object_store::path::Path as ObjPath;
use object_store::{GetOptions, ObjectMeta, ObjectStore, ObjectStoreExt};
use sluice_archive::rt::blocking;
use sluice_archive::safefs::{self, Owner};
use sluice_archive::store::{self, StoreErrorKind};
use sluice_proto::msg::StageState;
use sluice_proto::options::StageSpec;
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use tokio::task::JoinSet;

/// Where an object key lands, relative to the dataset directory.
#[derive(Debug, PartialEq, Eq)]
pub enum KeyPath {
    /// A file at these path components.
    File(Vec<String>),
    /// A zero-byte "directory marker" (`dir/`), as consoles create: nothing to write.
    DirMarker,
    /// The key cannot be a file name below the dataset directory.
    Reject,
}

/// Maps `key` (listed under `prefix`) to path components below the dataset directory. Every
/// component must be a plain file name: no `.`/`..`, no empty segments, no NUL, bounded depth.
pub fn map_key(prefix: &str, key: &str) -> KeyPath {
    let rest = if prefix.is_empty() {
        key
    } else {
        match key.strip_prefix(prefix).and_then(|r| r.strip_prefix('/')) {
            Some(r) => r,
            None => return KeyPath::Reject,
        }
    };
    if rest.is_empty() {
        return KeyPath::Reject;
    }
    let (rest, marker) = match rest.strip_suffix('/') {
        Some(r) => (r, true),
        None => (rest, false),
    };
    let parts: Vec<&str> = rest.split('/').collect();
    if parts.len() > safefs::MAX_DEPTH
        || parts
            .iter()
            .any(|p| safefs::check_component(p).is_err() || p.len() > 255)
    {
        return KeyPath::Reject;
    }
    if marker {
        KeyPath::DirMarker
    } else {
        KeyPath::File(parts.into_iter().map(String::from).collect())
    }
}

/// The store's error as the job will show it, decided from its kind (never its text).
fn origin_error(source: &str, e: object_store::Error) -> StageError {
    let dataset = source.to_string();
    // A key with '.' or '..' segments is the dataset's problem, whatever the store says.
    if let object_store::Error::InvalidPath { .. } = e {
        return StageError::UnsafeKeys { dataset };
    }
    match store::classify(&e) {
        // A missing bucket or container is the user's mistake, like a missing prefix.
        StoreErrorKind::NotFound => StageError::NotFound { dataset },
        StoreErrorKind::Denied => StageError::Denied {
            dataset,
            detail: store::describe(&e),
        },
        // No answer, after object_store's retries ([retry] keeps max_retries >= 1).
        StoreErrorKind::Unreachable | StoreErrorKind::TimedOut => {
            StageError::Unreachable { dataset }
        }
        StoreErrorKind::Throttled | StoreErrorKind::Other => StageError::Origin {
            dataset,
            detail: store::describe(&e),
        },
    }
}

/// Downloads objects of one dataset; shared by its download tasks.
struct Fetcher {
    store: Arc<dyn ObjectStore>,
    /// Request slots and buffers, shared with every other download on the node.
    budget: Arc<Budget>,
    source: String,
    node: String,
    part_size: u64,
    owner: Owner,
    progress: Arc<Progress>,
}

impl Fetcher {
    fn hot_error(&self, path: &str, errno: Option<i32>, detail: String) -> StageError {
        if is_no_space(errno) {
            StageError::NoSpace {
                node: self.node.clone(),
                dataset: self.source.clone(),
            }
        } else {
            StageError::HotTier {
                path: path.to_string(),
                detail,
            }
        }
    }

    fn safefs_error(&self, path: &str, e: safefs::SafeFsError) -> StageError {
        self.hot_error(path, e.errno().map(|e| e as i32), e.to_string())
    }

    /// Creates `parts` below `root` and fills it with the object.
    async fn fetch(
        self: Arc<Self>,
        root: Arc<OwnedFd>,
        parts: Vec<String>,
        meta: ObjectMeta,
    ) -> Result<(), StageError> {
        let rel = parts.join("/");
        let owner = self.owner;
        let file = blocking(move || {
            let (file_name, dirs) = parts
                .split_last()
                .expect("map_key yields at least one component");
            let dirs: Vec<&str> = dirs.iter().map(String::as_str).collect();
            let d = safefs::ensure_dirs(&root, &dirs, Some(owner))?;
            safefs::create_file(&d, file_name, Some(owner), 0o644)
        })
        .await
        .map_err(|e| self.safefs_error(&rel, e))?;
        self.fill(Arc::new(file), &rel, meta).await
    }

    /// GETs `range` of the object and writes it at the same offset of `file`, streaming the body
    /// through the lease's buffer. Fails unless exactly `range`'s bytes arrive.
    async fn get_part(
        &self,
        mut lease: Lease,
        file: Arc<std::fs::File>,
        rel: &str,
        location: &ObjPath,
        range: std::ops::Range<u64>,
    ) -> Result<(), StageError> {
        let dataset = || format!("{}: {location}", self.source);
        let wrong_size = |got: u64| StageError::Origin {
            dataset: dataset(),
            detail: format!(
                "expected {} bytes at offset {}, got {got} (object changed while staging?)",
                range.end - range.start,
                range.start
            ),
        };
        let opts = GetOptions {
            range: Some(range.clone().into()),
            ..GetOptions::default()
        };
        let mut body = self
            .store
            .get_opts(location, opts)
            .await
            .map_err(|e| origin_error(&dataset(), e))?
            .into_stream();
        // The buffer's bytes belong at `at`; everything before `at` is written.
        let mut at = range.start;
        let mut buf = std::mem::take(&mut lease.buf);
        let cap = buf.capacity();
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| origin_error(&dataset(), e))?;
            let got = at - range.start + (buf.len() + chunk.len()) as u64;
            if got > range.end - range.start {
                return Err(wrong_size(got));
            }
            let mut rest = &chunk[..];
            while !rest.is_empty() {
                let n = rest.len().min(cap - buf.len());
                buf.extend_from_slice(&rest[..n]);
                rest = &rest[n..];
                if buf.len() == cap {
                    buf = self.write_at(&file, rel, buf, &mut at).await?;
                }
            }
        }
        if !buf.is_empty() {
            buf = self.write_at(&file, rel, buf, &mut at).await?;
        }
        lease.buf = buf;
        if at != range.end {
            return Err(wrong_size(at - range.start));
        }
        Ok(())
    }

    /// Writes `buf` at `*at` of `file` on a blocking thread, advances `*at`, and hands the buffer
    /// back empty.
    async fn write_at(
        &self,
        file: &Arc<std::fs::File>,
        rel: &str,
        buf: Vec<u8>,
        at: &mut u64,
    ) -> Result<Vec<u8>, StageError> {
        let (f, offset) = (file.clone(), *at);
        let (mut buf, written) = blocking(move || {
            let r = f.write_all_at(&buf, offset);
            (buf, r)
        })
        .await;
        written.map_err(|e| self.hot_error(rel, e.raw_os_error(), e.to_string()))?;
        let n = buf.len() as u64;
        *at += n;
        self.progress.bytes_done.fetch_add(n, Ordering::Relaxed);
        buf.clear();
        Ok(buf)
    }

    /// Writes the object's bytes into `file`: one GET for small objects, parallel ranged GETs of
    /// `part_size` for large ones.
    async fn fill(
        self: Arc<Self>,
        file: Arc<std::fs::File>,
        rel: &str,
        meta: ObjectMeta,
    ) -> Result<(), StageError> {
        let size = meta.size;
        if size > self.part_size {
            let f = file.clone();
            blocking(move || f.set_len(size))
                .await
                .map_err(|e| self.hot_error(rel, e.raw_os_error(), e.to_string()))?;
        }
        let mut parts = JoinSet::new();
        let mut offset = 0;
        while offset < size {
            let end = (offset + self.part_size).min(size);
            let lease = self.budget.lease().await;
            let (this, file, location) = (self.clone(), file.clone(), meta.location.clone());
            let rel = rel.to_string();
            parts.spawn(async move {
                this.get_part(lease, file, &rel, &location, offset..end)
                    .await
            });
            offset = end;
            while let Some(done) = parts.try_join_next() {
                done.expect("part task panicked")?;
            }
        }
        while let Some(done) = parts.join_next().await {
            done.expect("part task panicked")?;
        }
        self.progress.files_done.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

pub(super) async fn stage(
    ctx: &StageCtx,
    spec: &StageSpec,
    store: Arc<dyn ObjectStore>,
    prefix: &str,
    progress: Arc<Progress>,
) -> Result<(), StageError> {
    let source = spec.source.to_string();
    let fetcher = Arc::new(Fetcher {
        store: store.clone(),
        budget: ctx.budget.clone(),
        source: source.clone(),
        node: ctx.cfg.node.clone(),
        part_size: ctx.cfg.stage.part_size,
        owner: ctx.owner,
        progress: progress.clone(),
    });
    let (fd, name, owner) = (ctx.stage_fd.clone(), spec.name.clone(), ctx.owner);

    // A prefix may name one object rather than a "directory": then NAME is that file.
    if !prefix.is_empty() {
        match store.head(&ObjPath::from(prefix)).await {
            Ok(meta) => {
                progress.files_total.store(1, Ordering::Relaxed);
                progress.bytes_total.store(meta.size, Ordering::Relaxed);
                progress.set_state(StageState::Copying);
                let file = blocking(move || safefs::create_file(&*fd, &name, Some(owner), 0o644))
                    .await
                    .map_err(|e| fetcher.safefs_error(&spec.name, e))?;
                return fetcher.clone().fill(Arc::new(file), &spec.name, meta).await;
            }
            Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(origin_error(&source, e)),
        }
    }

    let root = blocking(move || safefs::create_dir(&*fd, &name, Some(owner), 0o755))
        .await
        .map(Arc::new)
        .map_err(|e| fetcher.safefs_error(&spec.name, e))?;
    let list_prefix = (!prefix.is_empty()).then(|| ObjPath::from(prefix));
    let mut listing = store.list(list_prefix.as_ref());
    let mut tasks: JoinSet<Result<(), StageError>> = JoinSet::new();
    let (mut files, mut bytes, mut bad, mut example) = (0u64, 0u64, 0u64, String::new());
    // Objects waiting for a download slot; bounds the tasks (and listing read-ahead) in memory.
    let max_pending = ctx.cfg.stage.concurrency * 4;
    while let Some(item) = listing.next().await {
        let meta = item.map_err(|e| origin_error(&source, e))?;
        let parts = match map_key(prefix, meta.location.as_ref()) {
            KeyPath::File(parts) => parts,
            KeyPath::DirMarker => continue,
            KeyPath::Reject => {
                bad += 1;
                if example.is_empty() {
                    example = meta.location.to_string();
                }
                continue;
            }
        };
        files += 1;
        bytes += meta.size;
        if files == 1 {
            progress.set_state(StageState::Copying);
        }
        while tasks.len() >= max_pending {
            if let Some(done) = tasks.join_next().await {
                done.expect("stage task panicked")?;
            }
        }
        while let Some(done) = tasks.try_join_next() {
            done.expect("stage task panicked")?;
        }
        tasks.spawn(fetcher.clone().fetch(root.clone(), parts, meta));
    }
    progress.files_total.store(files, Ordering::Relaxed);
    progress.bytes_total.store(bytes, Ordering::Relaxed);
    while let Some(done) = tasks.join_next().await {
        done.expect("stage task panicked")?;
    }
    if files == 0 && bad == 0 {
        return Err(StageError::NotFound { dataset: source });
    }
    if bad > 0 {
        return Err(StageError::BadKeys {
            dataset: source,
            count: bad,
            example,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fetcher(store: Arc<dyn ObjectStore>, part_size: u64, budget: Arc<Budget>) -> Arc<Fetcher> {
        let spec = StageSpec {
            name: "ds".into(),
            source: sluice_proto::options::parse_stage_entry("ds=s3://b/ds")
                .unwrap()
                .source,
        };
        Arc::new(Fetcher {
            store,
            budget,
            source: "s3://b/ds".into(),
            node: "n1".into(),
            part_size,
            owner: Owner {
                uid: nix::unistd::getuid().as_raw(),
                gid: nix::unistd::getgid().as_raw(),
            },
            progress: Arc::new(Progress::new(&spec)),
        })
    }

    #[tokio::test]
    async fn parts_stream_through_small_buffers_to_their_offsets() {
        let store: Arc<dyn ObjectStore> = Arc::new(object_store::memory::InMemory::new());
        let data: Vec<u8> = (0..300_001u32).map(|i| (i % 253) as u8).collect();
        store
            .put(&ObjPath::from("ds/x.bin"), data.clone().into())
            .await
            .unwrap();
        let meta = store.head(&ObjPath::from("ds/x.bin")).await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        // 64 KiB parts through 4 KiB buffers, 3 requests at a time.
        let budget = Budget::with(3, 4096);
        let f = fetcher(store.clone(), 64 << 10, budget.clone());
        let file = Arc::new(std::fs::File::create(dir.path().join("x.bin")).unwrap());
        f.clone().fill(file, "x.bin", meta.clone()).await.unwrap();
        assert_eq!(std::fs::read(dir.path().join("x.bin")).unwrap(), data);
        let p = f.progress.snapshot();
        assert_eq!((p.files_done, p.bytes_done), (1, 300_001));
        let (slots, buffers) = budget.free();
        assert_eq!(slots, 3);
        assert!(buffers <= 3);

        // The object shrank after it was listed: the short range is an error, not a short file.
        let listed_bigger = ObjectMeta {
            size: 300_001 + 10,
            ..meta
        };
        let file = Arc::new(std::fs::File::create(dir.path().join("y.bin")).unwrap());
        let e = f.fill(file, "y.bin", listed_bigger).await.unwrap_err();
        assert!(
            e.to_string().contains("object changed while staging"),
            "{e}"
        );
    }

    #[test]
    fn hostile_keys_never_leave_the_dataset() {
        let f = |p: &str, k: &str| map_key(p, k);
        assert_eq!(
            f("ds", "ds/a/b.bin"),
            KeyPath::File(vec!["a".into(), "b.bin".into()])
        );
        assert_eq!(f("", "top.bin"), KeyPath::File(vec!["top.bin".into()]));
        assert_eq!(f("ds", "ds/dir/"), KeyPath::DirMarker);
        for bad in [
            "ds/../x",
            "ds/a/../../x",
            "ds/..",
            "ds//x",
            "ds/./x",
            "ds/a\0b",
            "dsx/y",
            "other/x",
            "ds/",
        ] {
            assert_eq!(f("ds", bad), KeyPath::Reject, "{bad:?}");
        }
        assert_eq!(f("", "/etc/passwd"), KeyPath::Reject);
        assert_eq!(f("", "a\0b"), KeyPath::Reject);
        let deep = vec!["d"; safefs::MAX_DEPTH + 1].join("/");
        assert_eq!(f("", &deep), KeyPath::Reject);
    }
}
