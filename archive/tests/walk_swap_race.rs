//! A directory of a checkpoint swapped for a symlink while the agent archives it (docs/SECURITY.md,
//! "checkpoint files, read for archiving"): the archive engine, on a `file://` store, archives the
//! same checkpoint over and over while another thread exchanges its subdirectory `sub` with a
//! symlink to a root-only directory holding files of the same names and sizes — atomically, with
//! `renameat2(RENAME_EXCHANGE)`, as a hostile job would, so `sub` always exists as one or the other.
//!
//! Asserted on every attempt: it either uploads the real files (published and restored, byte for
//! byte) or is refused naming `sub` (or an entry below it). And no byte of the root-only files ever
//! reaches the store, checked by searching every stored object for slices of them (the files are
//! random, so zstd stores them verbatim — the same search finds the real files, which proves it).
//!
//! Needs root, like the agent: the checkpoint belongs to another uid, the secret to root.

use nix::fcntl::{RenameFlags, renameat2};
use sluice_archive::{ArchiveConfig, ArchiveError, ArchiveProgress, JobMeta, open_archive_with};
use sluice_core::config::Config;
use sluice_core::safefs::{self, Owner};
use std::collections::{BTreeMap, HashSet};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The checkpoint's owner (a job user): `nobody`.
const UID: u32 = 65534;
/// At least this many archive attempts, and for at least this long.
const ATTEMPTS: usize = 60;
const MIN_TIME: Duration = Duration::from_secs(8);
/// Each file: random, so incompressible.
const FILE_SIZE: usize = 96 << 10;
/// The files of `sub/` (the same names below the root-only directory).
const SUB_FILES: [&str; 3] = ["a.bin", "b.bin", "deeper/c.bin"];

fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut s = seed;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Writes `files` (relative path → bytes) below `dir`, all owned by `uid`, directories included.
fn write_files(dir: &Path, files: &BTreeMap<String, Vec<u8>>, uid: u32) {
    for (rel, bytes) in files {
        let p = dir.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, bytes).unwrap();
    }
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        std::os::unix::fs::chown(&d, Some(uid), Some(uid)).unwrap();
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            } else {
                std::os::unix::fs::chown(e.path(), Some(uid), Some(uid)).unwrap();
            }
        }
    }
}

/// Every regular file below `dir`, read whole.
fn all_files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let ft = e.file_type().unwrap();
            if ft.is_dir() {
                stack.push(e.path());
            } else if ft.is_file() {
                let rel = e.path().strip_prefix(dir).unwrap().display().to_string();
                out.push((rel, std::fs::read(e.path()).unwrap()));
            }
        }
    }
    out
}

/// Every 16-byte window of `files`, at every offset.
fn windows(files: &BTreeMap<String, Vec<u8>>) -> HashSet<[u8; 16]> {
    files
        .values()
        .flat_map(|b| b.windows(16).map(|w| <[u8; 16]>::try_from(w).unwrap()))
        .collect()
}

/// Whether `object` holds a run of at least 31 bytes of one of the files `windows` was made of:
/// such a run covers a 16-byte window at an offset divisible by 16 in `object`.
fn holds_any(object: &[u8], windows: &HashSet<[u8; 16]>) -> bool {
    object
        .chunks_exact(16)
        .any(|c| windows.contains(<&[u8; 16]>::try_from(c).unwrap()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (the checkpoint is another user's, the secret root's); run as root with --ignored, as tests/harness/run-e2e.sh does"]
async fn a_directory_swapped_for_a_symlink_during_the_walk_never_leaks_root_files() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test needs root: the checkpoint must belong to another user and the secret to root"
    );
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path();
    std::fs::set_permissions(base, std::fs::Permissions::from_mode(0o755)).unwrap();

    // The checkpoint: a top-level file and `sub/` with SUB_FILES, all the job user's.
    let ckpt = base.join("ckpt");
    let mut real: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    real.insert("top.bin".into(), random_bytes(1, FILE_SIZE));
    for (i, f) in SUB_FILES.iter().enumerate() {
        real.insert(format!("sub/{f}"), random_bytes(10 + i as u64, FILE_SIZE));
    }
    write_files(&ckpt, &real, UID);
    // The root-only directory: the same names and sizes, secret bytes, mode 0700.
    let secret_dir = base.join("rootonly");
    let mut secret: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    for (i, f) in SUB_FILES.iter().enumerate() {
        secret.insert(f.to_string(), random_bytes(100 + i as u64, FILE_SIZE));
    }
    write_files(&secret_dir, &secret, 0);
    std::fs::set_permissions(&secret_dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    // The user's symlink to it, parked outside the checkpoint until it is exchanged with `sub`.
    let parking = base.join("parking");
    std::fs::create_dir(&parking).unwrap();
    std::os::unix::fs::symlink(&secret_dir, parking.join("sub")).unwrap();
    std::os::unix::fs::lchown(parking.join("sub"), Some(UID), Some(UID)).unwrap();

    // The archive: a file:// store below a root-only directory.
    let store_dir = base.join("archive");
    std::fs::create_dir(&store_dir).unwrap();
    std::fs::set_permissions(&store_dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    let cfg = Config::parse(
        "[agent]\nsocket='/s'\nstate_dir='/st'\n[hot_tier]\nroot='/h'\n",
        "n1",
        sluice_archive::upload_memory,
    )
    .unwrap();
    let url = format!("file://{}/run", store_dir.display());
    let archive_cfg = ArchiveConfig {
        part_size: 5 << 20,
        concurrency: 4,
        zstd_level: 1,
        chunk_size: 64 << 10,
        compress_threads: 2,
        bandwidth_limit: None,
    };
    let archiver = open_archive_with(&cfg, &url, archive_cfg).unwrap();

    // The swapper: exchanges `ckpt/sub` (the real directory) and `parking/sub` (the symlink) as
    // fast as it can, until told to stop.
    let stop = Arc::new(AtomicBool::new(false));
    let swaps = Arc::new(AtomicU64::new(0));
    let swapper = {
        let (stop, swaps) = (stop.clone(), swaps.clone());
        let (a, b) = (
            std::fs::File::open(&ckpt).unwrap(),
            std::fs::File::open(&parking).unwrap(),
        );
        std::thread::spawn(move || {
            let mut n: u64 = 0;
            while !stop.load(Ordering::Relaxed) {
                renameat2(&a, "sub", &b, "sub", RenameFlags::RENAME_EXCHANGE)
                    .expect("renameat2(RENAME_EXCHANGE)");
                n += 1;
                swaps.store(n, Ordering::Relaxed);
                // Bursts of swaps, then a pause in whichever state the burst ended: longer with the
                // real directory in place (even count), so that some walks see only it.
                if n.is_multiple_of(37) {
                    let pause = if n.is_multiple_of(2) { 15 } else { 2 };
                    std::thread::sleep(Duration::from_millis(pause));
                }
            }
        })
    };

    let owner = Owner { uid: UID, gid: UID };
    let job = JobMeta {
        job_id: 1,
        user: "nobody".into(),
        job_name: "race".into(),
    };
    let started = Instant::now();
    let mut outcomes: BTreeMap<&str, usize> = BTreeMap::new();
    let mut failures = Vec::new();
    let mut attempt = 0;
    while attempt < ATTEMPTS || started.elapsed() < MIN_TIME {
        attempt += 1;
        let tag = format!("a{attempt}");
        let fd = Arc::new(safefs::open_root_dir(&ckpt).unwrap());
        let result = archiver
            .upload_part(&tag, "n1", fd, UID, &ArchiveProgress::default(), None)
            .await;
        match result {
            Ok(part) => {
                let paths: Vec<&str> = part.files.iter().map(|f| f.path.as_str()).collect();
                let want: Vec<&str> = real.keys().map(String::as_str).collect();
                if paths != want {
                    failures.push(format!("{tag}: uploaded {paths:?}, expected {want:?}"));
                    continue;
                }
                archiver
                    .try_publish(&tag, &["n1".to_string()], job.clone())
                    .await
                    .unwrap()
                    .into_manifest()
                    .expect("the only part is there");
                let dest = base.join(format!("restore-{tag}"));
                std::fs::create_dir(&dest).unwrap();
                let dest_fd = Arc::new(safefs::open_root_dir(&dest).unwrap());
                archiver
                    .restore(&tag, dest_fd, owner, &ArchiveProgress::default())
                    .await
                    .unwrap_or_else(|e| panic!("restoring {tag}: {e}"));
                let restored: BTreeMap<String, Vec<u8>> = all_files(&dest).into_iter().collect();
                if restored != real {
                    failures.push(format!(
                        "{tag}: archived, but the restored files differ from the real ones: {:?}",
                        restored.keys().collect::<Vec<_>>()
                    ));
                }
                std::fs::remove_dir_all(&dest).unwrap();
                *outcomes.entry("archived").or_default() += 1;
            }
            Err(ArchiveError::Refused { path, reason, .. })
                if path == "sub" || path.starts_with("sub/") =>
            {
                assert!(
                    reason.contains("symbolic link"),
                    "{tag}: refused {path}: {reason}"
                );
                *outcomes.entry("refused naming sub").or_default() += 1;
            }
            Err(e) => failures.push(format!("{tag}: {e}")),
        }
    }
    stop.store(true, Ordering::Relaxed);
    swapper.join().unwrap();
    let swaps = swaps.load(Ordering::Relaxed);
    eprintln!(
        "{attempt} archive attempts in {:.1} s with {swaps} swaps: {outcomes:?}",
        started.elapsed().as_secs_f64()
    );

    // No byte of the root-only files in any stored object; the real ones are found the same way.
    let stored = all_files(&store_dir);
    let secret_windows = windows(&secret);
    let leaked: Vec<&String> = stored
        .iter()
        .filter(|(_, object)| holds_any(object, &secret_windows))
        .map(|(key, _)| key)
        .collect();
    assert!(
        leaked.is_empty(),
        "root-only bytes reached the store, in {leaked:?}"
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(
        swaps > attempt as u64,
        "the swapper hardly ran: {swaps} swaps"
    );
    // The race really went both ways, and the search finds archived bytes (so it is not blind).
    assert!(
        outcomes.get("refused naming sub").copied().unwrap_or(0) > 0,
        "no attempt met the symlink: {outcomes:?}"
    );
    assert!(
        outcomes.get("archived").copied().unwrap_or(0) > 0,
        "no attempt archived the real directory: {outcomes:?}"
    );
    let real_windows = windows(&real);
    assert!(
        stored.iter().any(|(_, o)| holds_any(o, &real_windows)),
        "archived files' bytes are not found verbatim in the store: the leak search is blind"
    );
}
