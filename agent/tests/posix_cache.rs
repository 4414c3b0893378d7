//! POSIX datasets and the node's cache (`[cache]`), in one process: the real stager and the real
//! `sluiced copy-as-user` helper of this build. A user's second stage of an unchanged tree is
//! placed from the cache (identical bytes and modes, nothing read from the source); a file
//! rewritten, replaced by a rename or grown is read from the source again; another user never
//! hits a user's entries; a user who can no longer read a file fails as without a cache and gets
//! nothing from it. The last two run the helper as other users, so they need root.

use sluice_core::config::Config;
use sluice_core::safefs::{self, Owner};
use sluice_proto::msg::StageProgress;
use sluice_proto::options::{StageSpec, parse_stage_entry};
use sluice_stage::cache::Cache;
use sluice_stage::{self as stage, Budget, Progress, StageCtx, StageError};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

#[path = "support/small_files.rs"]
mod small_files;
#[path = "support/tree.rs"]
mod tree;
use small_files::{big_file, chmod, small_file, small_files};
use tree::tree;

/// A user the helper runs as: uid, gid, name.
#[derive(Clone)]
struct User {
    owner: Owner,
    name: String,
}

fn me() -> User {
    let uid = nix::unistd::getuid();
    let user = nix::unistd::User::from_uid(uid)
        .ok()
        .flatten()
        .expect("the test's user has a name");
    User {
        owner: Owner {
            uid: uid.as_raw(),
            gid: nix::unistd::getgid().as_raw(),
        },
        name: user.name,
    }
}

fn user(name: &str) -> User {
    let u = nix::unistd::User::from_name(name)
        .ok()
        .flatten()
        .unwrap_or_else(|| panic!("no user {name} on this machine"));
    User {
        owner: Owner {
            uid: u.uid.as_raw(),
            gid: u.gid.as_raw(),
        },
        name: u.name,
    }
}

/// The source: a file of several helper pieces (a big one, read-only), small files in nested
/// directories, one of mode 0600, an empty one, a link.
fn source(dir: &Path) -> u64 {
    let bytes = big_file(dir, (5 << 20) + 777) + small_files(dir, 20);
    std::fs::write(dir.join("empty"), b"").unwrap();
    std::os::unix::fs::symlink("big.bin", dir.join("link")).unwrap();
    // Readable to everyone (a dataset on a shared file system), one file the owner's alone.
    for d in ["", "small", "small/deeper"] {
        chmod(dir, d, 0o755);
    }
    for i in 0..20 {
        chmod(dir, &small_file(i), 0o644);
    }
    chmod(dir, "small/part-001.bin", 0o600);
    chmod(dir, "empty", 0o644);
    bytes
}

/// A node with a cache below `dir` (`min_free = 0`: how full the build machine's disk is decides
/// nothing here).
fn cache_config(dir: &Path) -> Arc<Config> {
    let text = format!(
        "[agent]\nsocket='{d}/s'\nstate_dir='{d}/st'\n[hot_tier]\nroot='{d}/hot'\n\
         [stage]\nconcurrency = 4\nmemory = '1MiB'\ntimeout = '60s'\n\
         [cache]\nsize = '64MiB'\nmin_free = 0\n",
        d = dir.display()
    );
    std::fs::create_dir_all(dir.join("hot")).unwrap();
    Arc::new(Config::parse(&text, "n1", sluice_archive::upload_memory).unwrap())
}

struct Node {
    cfg: Arc<Config>,
    cache: Arc<Cache>,
    budget: Arc<Budget>,
    /// Where the stage directories are made (traversable by the job users).
    dir: PathBuf,
    runs: std::sync::atomic::AtomicU32,
    /// The node's own temp directory (traversable by the job users), holding all of the above.
    _home: tempfile::TempDir,
}

impl Node {
    /// A node of its own: config, cache and stage directories in a new temp directory.
    fn new() -> Node {
        let home = tempfile::tempdir().unwrap();
        std::fs::set_permissions(home.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let dir = home.path();
        let cfg = cache_config(dir);
        let cache = Cache::open(&cfg).unwrap().expect("[cache] is configured");
        let stages = dir.join("stages");
        std::fs::create_dir_all(&stages).unwrap();
        std::fs::set_permissions(&stages, std::fs::Permissions::from_mode(0o755)).unwrap();
        Node {
            budget: Budget::new(&cfg.stage),
            cfg,
            cache,
            dir: stages,
            runs: Default::default(),
            _home: home,
        }
    }

    /// Stages `src` as `ds` for `who` into a fresh stage directory of theirs: its path, and the
    /// progress as the job would see it.
    async fn stage(&self, who: &User, src: &Path) -> (PathBuf, Result<StageProgress, StageError>) {
        let n = self.runs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let stage_path = self.dir.join(format!("job-{n}"));
        std::fs::create_dir(&stage_path).unwrap();
        std::os::unix::fs::chown(&stage_path, Some(who.owner.uid), Some(who.owner.gid)).unwrap();
        let ctx = StageCtx {
            cfg: self.cfg.clone(),
            owner: who.owner,
            user: who.name.clone(),
            stage_fd: Arc::new(safefs::open_root_dir(&stage_path).unwrap()),
            stage_path: stage_path.clone(),
            helper_exe: env!("CARGO_BIN_EXE_sluiced").into(),
            cancel: CancellationToken::new(),
            budget: self.budget.clone(),
            shared_tier: None,
            cache: Some(self.cache.clone()),
            resume: None,
        };
        let spec = spec(src);
        let progress = Arc::new(Progress::new(&spec));
        let run = stage::stage(&ctx, &spec, progress.clone());
        let r = tokio::time::timeout(Duration::from_secs(120), run)
            .await
            .expect("staging finished");
        (stage_path.join("ds"), r.map(|()| progress.snapshot()))
    }
}

fn spec(src: &Path) -> StageSpec {
    parse_stage_entry(&format!("ds={}", src.display())).unwrap()
}

/// A source directory readable by every user (below a 0755 temp directory).
fn source_dir() -> (tempfile::TempDir, PathBuf, u64) {
    let t = tempfile::tempdir().unwrap();
    std::fs::set_permissions(t.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let src = t.path().join("src");
    std::fs::create_dir(&src).unwrap();
    let bytes = source(&src);
    (t, src, bytes)
}

fn assert_copy(src: &Path, staged: &Path, what: &str) {
    let (want, got) = (tree(src, 0o700), tree(staged, 0o700));
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "{what}: the entries staged"
    );
    for (k, (data, mode)) in &want {
        assert!(got[k].0 == *data, "{what}: {k} differs from the source");
        assert_eq!(got[k].1, *mode, "{what}: the mode of {k}");
    }
}

/// Files of the source: 22 with bytes, one empty.
const FILES: u64 = 22;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_users_second_stage_of_an_unchanged_tree_comes_from_the_cache() {
    let (_t, src, bytes) = source_dir();
    let node = Node::new();
    let me = me();

    let (first, p) = node.stage(&me, &src).await;
    let p = p.unwrap();
    assert_copy(&src, &first, "the first stage");
    assert_eq!(
        (p.bytes_done, p.origin_bytes, p.cache_bytes, p.files_done),
        (bytes, bytes, 0, FILES),
        "the first stage reads everything from the source: {p:?}"
    );
    let s = node.cache.stats();
    assert_eq!(
        (s.entries, s.used_bytes, s.hits),
        (FILES - 1, bytes, 0),
        "every non-empty file is kept: {s:?}"
    );

    let (second, p) = node.stage(&me, &src).await;
    let p = p.unwrap();
    assert_copy(&src, &second, "the second stage");
    assert_eq!(
        (p.bytes_done, p.origin_bytes, p.cache_bytes, p.files_done),
        (bytes, 0, bytes, FILES),
        "the second stage is all from the cache: {p:?}"
    );
    assert_eq!(node.cache.stats().hit_bytes, bytes);
    // The job's copy is its own: writing into it changes nothing in the cache.
    chmod(&second, "small/part-002.bin", 0o644);
    std::fs::write(second.join("small/part-002.bin"), b"JOB WROTE THIS").unwrap();
    let (third, p) = node.stage(&me, &src).await;
    assert_eq!(p.unwrap().cache_bytes, bytes);
    assert_copy(
        &src,
        &third,
        "the third stage, after the second wrote into its copy",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rewritten_replaced_or_grown_file_is_read_from_the_source_again() {
    let (_t, src, bytes) = source_dir();
    let node = Node::new();
    let me = me();
    node.stage(&me, &src).await.1.unwrap();

    // Same size, other bytes, and an mtime that differs only in nanoseconds from the old one.
    let rewritten = src.join("small/part-004.bin");
    let old = std::fs::metadata(&rewritten).unwrap();
    let len = old.len() as usize;
    std::fs::write(&rewritten, vec![b'r'; len]).unwrap();
    set_mtime(
        &rewritten,
        old.mtime(),
        (old.mtime_nsec() + 1) % 1_000_000_000,
    );
    // Replaced by a rename: same path, size and mtime, another inode.
    let replaced = src.join("small/deeper/part-006.bin");
    let m = std::fs::metadata(&replaced).unwrap();
    let new = src.join("small/deeper/.new");
    std::fs::write(&new, vec![b'n'; m.len() as usize]).unwrap();
    std::fs::set_permissions(&new, std::fs::Permissions::from_mode(0o644)).unwrap();
    set_mtime(&new, m.mtime(), m.mtime_nsec());
    std::fs::rename(&new, &replaced).unwrap();
    // Grown.
    let grown = src.join("small/part-008.bin");
    let mut g = std::fs::read(&grown).unwrap();
    g.extend_from_slice(b"more");
    std::fs::write(&grown, &g).unwrap();

    let changed: u64 = [&rewritten, &replaced, &grown]
        .iter()
        .map(|p| std::fs::metadata(p).unwrap().len())
        .sum();
    let (staged, p) = node.stage(&me, &src).await;
    let p = p.unwrap();
    assert_copy(&src, &staged, "the stage after the changes");
    assert_eq!(
        (p.bytes_done, p.origin_bytes, p.cache_bytes),
        (bytes + 4, changed, bytes + 4 - changed),
        "exactly the three changed files come from the source: {p:?}"
    );
    // Those are kept anew: a third stage is all from the cache.
    let (staged, p) = node.stage(&me, &src).await;
    assert_copy(&src, &staged, "the stage after that");
    assert_eq!(p.unwrap().origin_bytes, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dataset_that_is_one_file_is_cached_too() {
    let (_t, src, _) = source_dir();
    let node = Node::new();
    let me = me();
    let file = src.join("big.bin");
    let size = std::fs::metadata(&file).unwrap().len();
    let (first, p) = node.stage(&me, &file).await;
    assert_eq!(p.unwrap().origin_bytes, size);
    let (second, p) = node.stage(&me, &file).await;
    let p = p.unwrap();
    assert_eq!((p.cache_bytes, p.origin_bytes), (size, 0), "{p:?}");
    assert_eq!(
        std::fs::read(&second).unwrap(),
        std::fs::read(&file).unwrap()
    );
    assert_eq!(
        std::fs::read(&first).unwrap(),
        std::fs::read(&file).unwrap()
    );
    assert_eq!(
        std::fs::metadata(&second).unwrap().mode() & 0o7777,
        0o444,
        "the source's mode"
    );
}

fn assert_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test needs root: it runs the copy helper as other users"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs root, like sluiced (the helper runs as other users); run as root with --ignored, as tests/harness/run-e2e.sh does"]
async fn another_user_never_hits_a_users_entries() {
    assert_root();
    let (_t, src, bytes) = source_dir();
    // Both users may read every file (the 0600 one is opened to them).
    chmod(&src, "small/part-001.bin", 0o644);
    let node = Node::new();
    let (a, b) = (user("nobody"), user("daemon"));
    let (staged, p) = node.stage(&a, &src).await;
    assert_copy(&src, &staged, "nobody's stage");
    assert_eq!(p.unwrap().origin_bytes, bytes);
    let (staged, p) = node.stage(&b, &src).await;
    let p = p.unwrap();
    assert_copy(&src, &staged, "daemon's stage");
    assert_eq!(
        (p.origin_bytes, p.cache_bytes),
        (bytes, 0),
        "another user reads the source, never the first user's entries: {p:?}"
    );
    let owner = std::fs::metadata(staged.join("big.bin")).unwrap().uid();
    assert_eq!(owner, b.owner.uid);
    // Each user hits their own.
    for who in [&a, &b] {
        let (_, p) = node.stage(who, &src).await;
        assert_eq!(p.unwrap().cache_bytes, bytes, "{}'s second stage", who.name);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs root, like sluiced (the helper runs as another user); run as root with --ignored, as tests/harness/run-e2e.sh does"]
async fn a_user_who_can_no_longer_read_a_file_gets_nothing_from_the_cache() {
    assert_root();
    let (_t, src, bytes) = source_dir();
    let node = Node::new();
    let who = user("nobody");
    // The user's own dataset (the 0600 file is theirs).
    for e in walk(&src) {
        nix::unistd::chown(&e, Some(who.owner.uid.into()), Some(who.owner.gid.into())).unwrap();
    }
    let (_, p) = node.stage(&who, &src).await;
    assert_eq!(p.unwrap().origin_bytes, bytes);
    let hits = node.cache.stats().hits;

    // The file becomes root's and closed to them (the rest they may still read).
    let closed = src.join("small/part-001.bin");
    nix::unistd::chown(&closed, Some(0.into()), Some(0.into())).unwrap();
    let (staged, r) = node.stage(&who, &src).await;
    let e = r.expect_err("a stage of a file the user cannot read fails");
    assert!(matches!(e, StageError::Denied { .. }), "{e}");
    assert!(e.to_string().contains("part-001.bin"), "{e}");
    assert!(
        !staged.exists(),
        "nothing is staged when a file cannot be read: {:?}",
        tree(&staged, 0o700)
    );
    assert_eq!(node.cache.stats().hits, hits, "no lookup was a hit");

    // A directory closed to them: the same.
    nix::unistd::chown(&closed, Some(who.owner.uid.into()), None).unwrap();
    std::fs::set_permissions(src.join("small"), std::fs::Permissions::from_mode(0o700)).unwrap();
    nix::unistd::chown(&src.join("small"), Some(0.into()), None).unwrap();
    let (staged, r) = node.stage(&who, &src).await;
    let e = r.expect_err("a stage of a directory the user cannot list fails");
    assert!(matches!(e, StageError::Denied { .. }), "{e}");
    assert!(!staged.exists());
    assert_eq!(node.cache.stats().hits, hits, "no lookup was a hit");
}

fn set_mtime(path: &Path, secs: i64, nsec: i64) {
    let when = std::time::UNIX_EPOCH + Duration::new(secs as u64, nsec as u32);
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.set_modified(when).unwrap();
}

fn walk(root: &Path) -> Vec<PathBuf> {
    let mut out = vec![root.to_path_buf()];
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if std::fs::symlink_metadata(&p).unwrap().is_dir() {
                stack.push(p.clone());
            }
            out.push(p);
        }
    }
    out
}
