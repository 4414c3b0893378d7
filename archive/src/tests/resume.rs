//! Per-object resume of an interrupted upload (issue 10, defect 8): what a rerun uploads again,
//! seen from the store's side, and that the checkpoint it publishes is the one a fresh upload
//! publishes.

use super::*;
use crate::testing::{Request, Watch, Watched, Write};
use object_store::Attributes;
use std::collections::BTreeSet;
use std::sync::Mutex;

/// A watch on an in-memory store that records the data objects it stored (a PUT or a multipart
/// upload that completed) and fails the PUT of one file while told to.
#[derive(Debug, Default)]
struct Counting {
    stored: Mutex<Vec<String>>,
    /// Fail PUTs of the data object of this file.
    fail: Mutex<Option<String>>,
}

type CountingStore = Watched<Counting, InMemory>;

fn counting_store() -> CountingStore {
    Watched::new(InMemory::new(), Counting::default())
}

impl Counting {
    /// The files (paths below `data/`) whose objects were stored since the last call.
    fn take_stored(&self) -> BTreeSet<String> {
        std::mem::take(&mut *sluice_core::rt::lock(&self.stored))
            .into_iter()
            .collect()
    }

    fn fail_on(&self, rel: Option<&str>) {
        *sluice_core::rt::lock(&self.fail) = rel.map(String::from);
    }
}

/// The file a data key holds, or `None` for other objects (parts, MANIFEST).
fn data_file(key: &str) -> Option<String> {
    key.split_once("/data/").map(|(_, rel)| rel.to_string())
}

impl Watch for Counting {
    fn before(
        &self,
        location: &ObjPath,
        request: Request,
        _: &Attributes,
    ) -> object_store::Result<()> {
        let file = data_file(location.as_ref());
        if request == Request::Put && file.is_some() && file == *sluice_core::rt::lock(&self.fail) {
            return Err(object_store::Error::Generic {
                store: "Counting",
                source: "injected PUT failure".into(),
            });
        }
        Ok(())
    }

    /// A copy, as a real store keeps: InMemory would hold on to the upload's part buffer.
    fn payload(&self, payload: PutPayload) -> PutPayload {
        PutPayload::from(payload.iter().flatten().copied().collect::<Vec<u8>>())
    }

    fn wrote(&self, write: Write) {
        if let Write::Put(key) | Write::Multipart(key) = write
            && let Some(f) = data_file(&key)
        {
            sluice_core::rt::lock(&self.stored).push(f);
        }
    }
}

/// One request at a time, so the files before the failing one are stored, and noted, before it
/// fails.
fn one_at_a_time() -> ArchiveConfig {
    ArchiveConfig {
        concurrency: 1,
        ..small_cfg()
    }
}

/// `write_tree`'s files and a shard large enough to go multipart (parts are 1 MiB at least).
const FILES: [&str; 5] = [
    "empty",
    "model/shard.bf16",
    "model/weights.bf16",
    "nested/a/b/latest",
    "optim.fp32",
];

fn all(files: &[&str]) -> BTreeSet<String> {
    files.iter().map(|f| f.to_string()).collect()
}

/// The source tree, a counting store, a resume directory (not created yet) and an archiver on
/// them that keeps resume logs.
struct Setup {
    src: tempfile::TempDir,
    _state: tempfile::TempDir,
    resume: std::path::PathBuf,
    store: Arc<CountingStore>,
    a: Archiver,
}

fn setup(cfg: ArchiveConfig) -> Setup {
    let src = tempfile::tempdir().unwrap();
    write_tree(src.path());
    std::fs::write(
        src.path().join("model/shard.bf16"),
        bf16_weights(1 << 20, 3),
    )
    .unwrap();
    chown_tree(src.path(), test_uid());
    let state = tempfile::tempdir().unwrap();
    let resume = state.path().join("agent/resume");
    let store = Arc::new(counting_store());
    let a = Archiver::new(store.clone(), "alice/run1", cfg)
        .unwrap()
        .with_resume_dir(resume.clone());
    Setup {
        src,
        _state: state,
        resume,
        store,
        a,
    }
}

impl Setup {
    /// A first upload of `tag` that fails at the PUT of `fail`; returns the files it stored.
    async fn interrupted(&self, tag: &str, fail: &str) -> BTreeSet<String> {
        self.store.watch.fail_on(Some(fail));
        let e = upload(&self.a, tag, "n1", self.src.path())
            .await
            .unwrap_err();
        self.store.watch.fail_on(None);
        assert!(e.to_string().contains("injected PUT failure"), "{e}");
        let stored = self.store.watch.take_stored();
        assert!(!stored.contains(fail), "{stored:?}");
        assert!(
            !keys(&self.store.inner)
                .await
                .iter()
                .any(|k| k.contains(&format!("/{tag}/parts/"))),
            "no part manifest after a failed upload"
        );
        stored
    }

    /// The one resume log, and the files its entries name (in order).
    fn log(&self) -> (std::path::PathBuf, Vec<String>) {
        let logs: Vec<_> = std::fs::read_dir(&self.resume)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(logs.len(), 1, "{logs:?}");
        let text = std::fs::read_to_string(&logs[0]).unwrap();
        let mut lines = text.lines();
        let header: serde_json::Value = serde_json::from_str(lines.next().unwrap()).unwrap();
        assert_eq!(header["format"], "sluice-upload-resume");
        let paths = lines
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                v["entry"]["path"].as_str().unwrap().to_string()
            })
            .collect();
        (logs[0].clone(), paths)
    }

    fn logs_left(&self) -> usize {
        std::fs::read_dir(&self.resume).map_or(0, |d| d.count())
    }
}

/// The part a fresh upload of `dir` writes, without resume, into a store of its own.
async fn fresh_part(cfg: ArchiveConfig, dir: &Path) -> PartManifest {
    let a = Archiver::new(Arc::new(counting_store()), "alice/run1", cfg).unwrap();
    upload(&a, "fresh", "n1", dir).await.unwrap()
}

/// What restore and verify see of a part: everything but its tag and time.
fn same_files(resumed: &PartManifest, fresh: &PartManifest) {
    assert_eq!(resumed.files, fresh.files);
    assert_eq!(resumed.dirs, fresh.dirs);
    assert_eq!(resumed.chunk_size, fresh.chunk_size);
}

/// Publishes `tag` (n1 alone), restores it into a fresh directory and compares every file with
/// `src`; verify reads every chunk back too.
async fn publish_and_restore(a: &Archiver, tag: &str, src: &Path) {
    let m = publish_alone(a, tag, src).await;
    let dest = tempfile::tempdir().unwrap();
    let owner = Owner {
        uid: test_uid(),
        gid: test_uid(),
    };
    let fd = Arc::new(safefs::open_root_dir(dest.path()).unwrap());
    a.restore(tag, fd, owner, &ArchiveProgress::default())
        .await
        .unwrap();
    for f in &m.files {
        assert_eq!(
            std::fs::read(src.join(&f.path)).unwrap(),
            std::fs::read(dest.path().join(&f.path)).unwrap(),
            "{tag}: {}",
            f.path
        );
    }
    assert_eq!(a.verify(tag).await.unwrap().files, m.files.len() as u64);
}

/// An upload stopped by a failed PUT, rerun: the rerun stores only the objects the first run did
/// not (the multipart shard is not sent again), its progress counts the resumed files as done,
/// and the checkpoint it publishes is the one a fresh upload publishes, restoring byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_upload_resumes_with_the_objects_it_did_not_store() {
    let s = setup(one_at_a_time());
    let first = s.interrupted("s1", "optim.fp32").await;
    assert!(
        first.contains("model/shard.bf16") && first.contains("model/weights.bf16"),
        "{first:?}"
    );
    let mode = std::fs::metadata(&s.resume).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o700, "the resume directory is root's alone");
    let (_, logged) = s.log();
    assert_eq!(logged.iter().cloned().collect::<BTreeSet<_>>(), first);

    let progress = ArchiveProgress::default();
    let fd = Arc::new(safefs::open_root_dir(s.src.path()).unwrap());
    let part =
        s.a.upload_part("s1", "n1", fd, test_uid(), &progress, None)
            .await
            .unwrap();
    let second = s.store.watch.take_stored();
    assert!(second.contains("optim.fp32"), "{second:?}");
    assert!(
        first.is_disjoint(&second),
        "stored again: {:?}",
        first.intersection(&second).collect::<Vec<_>>()
    );
    assert_eq!(&first | &second, all(&FILES), "every file stored once");
    let p = progress.snapshot();
    assert_eq!((p.files_done, p.files_total), (5, 5));
    assert_eq!(p.bytes_done, p.bytes_total);
    let resent: u64 = part
        .files
        .iter()
        .filter(|f| second.contains(&f.path))
        .map(|f| f.stored_size)
        .sum();
    assert_eq!(
        p.stored_bytes, resent,
        "only the re-uploaded bytes were sent"
    );
    assert!(
        resent < part.stored_bytes() / 4,
        "{resent} of {}",
        part.stored_bytes()
    );
    assert_eq!(
        s.logs_left(),
        0,
        "the log is removed once the part is written"
    );
    let shard = part.files.iter().find(|f| f.path == "model/shard.bf16");
    assert!(
        shard.unwrap().stored_size > 1 << 20,
        "the shard went multipart"
    );

    same_files(&part, &fresh_part(one_at_a_time(), s.src.path()).await);
    publish_and_restore(&s.a, "s1", s.src.path()).await;
}

/// Between the two runs a file is rewritten (same size), another touched, one object deleted
/// from the store and another overwritten there with other bytes of the same size: each of them
/// is uploaded again, and only the file nothing happened to is reused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_upload_uploads_again_what_changed_since() {
    let s = setup(one_at_a_time());
    let d = s.src.path();
    std::fs::write(d.join("touched"), b"a file that is only touched").unwrap();
    std::fs::write(d.join("zz-last"), b"the file whose PUT fails").unwrap();
    chown_tree(d, test_uid());
    let files = [&FILES[..], &["touched", "zz-last"]].concat();
    s.interrupted("s1", "zz-last").await;
    let (_, logged) = s.log();
    let logged: BTreeSet<String> = logged.into_iter().collect();
    assert!(logged.contains("model/shard.bf16"), "{logged:?}");

    // Rewritten in place, same size.
    std::fs::write(d.join("nested/a/b/latest"), b"step99\n").unwrap();
    // Touched: the same bytes, a new mtime (and ctime).
    std::fs::File::options()
        .write(true)
        .open(d.join("touched"))
        .unwrap()
        .set_modified(std::time::UNIX_EPOCH + std::time::Duration::from_secs(1 << 30))
        .unwrap();
    // Its object deleted from the store.
    let key = |rel: &str| s.a.data_key("s1", rel);
    s.store.inner.delete(&key("empty")).await.unwrap();
    // Its object replaced by other bytes of the same size.
    let len = s.store.inner.head(&key("optim.fp32")).await.unwrap().size;
    s.store
        .inner
        .put(&key("optim.fp32"), vec![0u8; len as usize].into())
        .await
        .unwrap();

    let part = upload(&s.a, "s1", "n1", d).await.unwrap();
    let second = s.store.watch.take_stored();
    let changed = all(&["nested/a/b/latest", "touched", "empty", "optim.fp32"]);
    let expected: BTreeSet<String> = all(&files)
        .into_iter()
        .filter(|f| !logged.contains(f) || changed.contains(f))
        .collect();
    assert_eq!(second, expected);
    assert!(!second.contains("model/shard.bf16"));

    same_files(&part, &fresh_part(one_at_a_time(), d).await);
    publish_and_restore(&s.a, "s1", d).await;
}

/// A log whose last line was torn (the agent died writing it) resumes from the lines before it;
/// a log written with another chunk size is discarded, and everything is uploaded again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_torn_or_foreign_resume_log_is_ignored() {
    let s = setup(one_at_a_time());
    s.interrupted("s1", "optim.fp32").await;
    let (path, logged) = s.log();
    assert!(logged.len() >= 2, "{logged:?}");
    let text = std::fs::read(&path).unwrap();
    let last = text[..text.len() - 1]
        .iter()
        .rposition(|&b| b == b'\n')
        .unwrap()
        + 1;
    let torn = last + (text.len() - last) / 2;
    std::fs::write(&path, &text[..torn]).unwrap();
    upload(&s.a, "s1", "n1", s.src.path()).await.unwrap();
    let torn_file = logged.last().unwrap();
    let expected: BTreeSet<String> = all(&FILES)
        .into_iter()
        .filter(|f| !logged.contains(f) || f == torn_file)
        .collect();
    assert_eq!(
        s.store.watch.take_stored(),
        expected,
        "{torn_file} was torn"
    );
    publish_and_restore(&s.a, "s1", s.src.path()).await;
    s.store.watch.take_stored();

    s.interrupted("s2", "optim.fp32").await;
    let (_, logged) = s.log();
    assert!(!logged.is_empty());
    let cfg = ArchiveConfig {
        chunk_size: 128 << 10,
        ..one_at_a_time()
    };
    let other = Archiver::new(s.store.clone(), "alice/run1", cfg.clone())
        .unwrap()
        .with_resume_dir(s.resume.clone());
    let part = upload(&other, "s2", "n1", s.src.path()).await.unwrap();
    assert_eq!(s.store.watch.take_stored(), all(&FILES), "nothing reused");
    assert_eq!(part.chunk_size, 128 << 10);
    same_files(&part, &fresh_part(cfg, s.src.path()).await);
    publish_and_restore(&other, "s2", s.src.path()).await;
    assert_eq!(s.logs_left(), 0);
}

/// Without a resume directory a rerun uploads every file again, as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_resume_dir_a_rerun_uploads_everything() {
    let s = setup(one_at_a_time());
    let plain = Archiver::new(s.store.clone(), "alice/run1", one_at_a_time()).unwrap();
    assert!(plain.resume_log("s1", "n1").is_none());
    s.store.watch.fail_on(Some("optim.fp32"));
    upload(&plain, "s1", "n1", s.src.path()).await.unwrap_err();
    s.store.watch.fail_on(None);
    assert!(!s.store.watch.take_stored().is_empty());
    upload(&plain, "s1", "n1", s.src.path()).await.unwrap();
    assert_eq!(s.store.watch.take_stored(), all(&FILES));
    assert_eq!(s.logs_left(), 0, "the resume directory was never created");
}

/// A tag published meanwhile (by another run) answers with its part and drops the stale log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_published_tag_removes_its_stale_resume_log() {
    let s = setup(one_at_a_time());
    s.interrupted("s1", "optim.fp32").await;
    assert_eq!(s.logs_left(), 1);
    let plain = Archiver::new(s.store.clone(), "alice/run1", one_at_a_time()).unwrap();
    let m = publish_alone(&plain, "s1", s.src.path()).await;
    s.store.watch.take_stored();
    let part = upload(&s.a, "s1", "n1", s.src.path()).await.unwrap();
    assert_eq!(part.files, m.files);
    assert!(
        s.store.watch.take_stored().is_empty(),
        "a published tag is not uploaded"
    );
    assert_eq!(s.logs_left(), 0);
}
