//! A POSIX dataset staged again after an agent restart, in one process: the real stager, the real
//! `sluiced copy-as-user` helper of this build and the job's staging log in a state directory
//! (`stage::resume`). What a job sees after the restart: its copy is the source's tree (bytes,
//! modes, links); the files staged whole before stay as they were (same inode), and only the rest
//! is read from the source — a file the user changed after it was staged, a file whose source
//! changed, a name the source no longer has are not kept.

use sluice_core::config::Config;
use sluice_core::safefs::{self, Owner};
use sluice_proto::msg::StageProgress;
use sluice_proto::options::parse_stage_entry;
use sluice_stage::resume::JobResume;
use sluice_stage::{self as stage, Budget, Progress, StageCtx};
use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

#[path = "support/small_files.rs"]
mod small_files;
#[path = "support/tree.rs"]
mod tree;
use small_files::{big_file, chmod, small_files};
use tree::tree;

const JOB: u32 = 42;

fn me() -> (Owner, String) {
    let uid = nix::unistd::getuid();
    let name = nix::unistd::User::from_uid(uid)
        .ok()
        .flatten()
        .expect("the test's user has a name")
        .name;
    let gid = nix::unistd::getgid().as_raw();
    (
        Owner {
            uid: uid.as_raw(),
            gid,
        },
        name,
    )
}

/// The source: a big read-only file, small files in nested directories, an empty one, a link.
fn source(dir: &Path) -> u64 {
    let bytes = big_file(dir, (3 << 20) + 777) + small_files(dir, 12);
    chmod(dir, "small/part-001.bin", 0o600);
    std::fs::write(dir.join("empty"), b"").unwrap();
    std::os::unix::fs::symlink("big.bin", dir.join("link")).unwrap();
    bytes
}

/// Stages `src` as `ds` into `stage_dir` with the job's staging log in `state` (`resuming`: as
/// an agent restarted mid-stage does), as the agent's set-up would on its hot tier.
async fn stage_once(src: &Path, stage_dir: &Path, state: &Path, resuming: bool) -> StageProgress {
    let text = format!(
        "[agent]\nsocket='{d}/s'\nstate_dir='{d}/st'\n[hot_tier]\nroot='{d}/hot'\n\
         [stage]\nconcurrency = 4\nmemory = '1MiB'\ntimeout = '60s'\n",
        d = state.display()
    );
    let cfg = Arc::new(Config::parse(&text, "n1", sluice_archive::upload_memory).unwrap());
    let (owner, user) = me();
    let ctx = StageCtx {
        budget: Budget::new(&cfg.stage),
        cfg,
        owner,
        user,
        stage_fd: Arc::new(safefs::open_root_dir(stage_dir).unwrap()),
        stage_path: stage_dir.to_path_buf(),
        helper_exe: env!("CARGO_BIN_EXE_sluiced").into(),
        cancel: CancellationToken::new(),
        shared_tier: None,
        cache: None,
        resume: Some(Arc::new(JobResume::open(state, JOB, resuming))),
    };
    let spec = parse_stage_entry(&format!("ds={}", src.display())).unwrap();
    let progress = Arc::new(Progress::new(&spec));
    let run = stage::stage(&ctx, &spec, progress.clone());
    tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("staging finished")
        .unwrap();
    progress.snapshot()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_stage_keeps_the_files_staged_whole_and_copies_the_rest() {
    let t = tempfile::tempdir().unwrap();
    let (src, stage_dir, state) = (
        t.path().join("src"),
        t.path().join("stage"),
        t.path().join("state"),
    );
    for d in [&src, &stage_dir, &state] {
        std::fs::create_dir(d).unwrap();
    }
    let bytes = source(&src);
    let first = stage_once(&src, &stage_dir, &state, false).await;
    assert_eq!((first.bytes_done, first.resumed_bytes), (bytes, 0));
    let ds = stage_dir.join("ds");
    assert_eq!(tree(&ds, 0o700), tree(&src, 0o700));
    let ino = |rel: &str| std::fs::symlink_metadata(ds.join(rel)).unwrap().ino();
    let before: BTreeMap<&str, u64> =
        ["big.bin", "small/part-002.bin", "small/deeper/part-003.bin"]
            .into_iter()
            .map(|p| (p, ino(p)))
            .collect();

    // What the agent finds after its restart: a file the job's user rewrote in place (same
    // bytes, same size: only its ctime tells), a file whose source changed, one the kill cut
    // short, a name the source no longer has.
    let user_wrote = ds.join("small/part-004.bin");
    let same = std::fs::read(&user_wrote).unwrap();
    std::fs::write(&user_wrote, &same).unwrap();
    let changed_src = src.join("small/part-005.bin");
    let mut newer = std::fs::read(&changed_src).unwrap();
    newer[0] ^= 0xff;
    std::fs::write(&changed_src, &newer).unwrap();
    let cut = std::fs::OpenOptions::new()
        .write(true)
        .open(ds.join("small/deeper/part-006.bin"))
        .unwrap();
    cut.set_len(100).unwrap();
    std::fs::write(ds.join("small/stale.bin"), b"not in the source").unwrap();

    let again = stage_once(&src, &stage_dir, &state, true).await;
    assert_eq!(
        tree(&ds, 0o700),
        tree(&src, 0o700),
        "the job's copy after the restart"
    );
    let copied_again: u64 = [
        "small/part-004.bin",
        "small/part-005.bin",
        "small/deeper/part-006.bin",
    ]
    .iter()
    .map(|p| std::fs::metadata(src.join(p)).unwrap().len())
    .sum();
    assert_eq!(
        (
            again.bytes_done,
            again.resumed_bytes,
            again.origin_bytes,
            again.files_done
        ),
        (
            bytes,
            bytes - copied_again,
            copied_again,
            again.files_total.unwrap()
        ),
        "{again:?}"
    );
    for (p, was) in before {
        assert_eq!(ino(p), was, "{p} was kept as it was");
    }

    // A fresh run of the job id (not a restart) keeps nothing.
    std::fs::remove_dir_all(&ds).unwrap();
    let fresh = stage_once(&src, &stage_dir, &state, false).await;
    assert_eq!((fresh.resumed_bytes, fresh.origin_bytes), (0, bytes));
}
