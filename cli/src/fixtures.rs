//! Canned agent answers shared by the unit tests (`render`) and the end-to-end tests (`tests/cli.rs`,
//! which includes this file by path), so both check the same node.

use sluice_archive::{CheckpointInfo, CheckpointState, JobMeta};
use sluice_proto::msg::{
    CacheEntry, CacheEvicted, CacheListing, CacheWarmed, CkptState, CkptStatus, JobDirs, JobState,
    JobStatus, NodeStatus, ReplicaStatus, StageProgress, StageState, WorkerStatus,
};

/// 2026-05-01T10:00:00Z.
pub const STARTED_AT: u64 = 1_777_629_600;
const GIB: u64 = 1 << 30;

fn job(
    job_id: u32,
    user: &str,
    uid: u32,
    state: JobState,
    stages: Vec<StageProgress>,
) -> JobStatus {
    let dir = format!("/var/lib/sluice/gpu07/hot/jobs/{job_id}");
    JobStatus {
        job_id,
        user: user.into(),
        uid,
        node: "gpu07".into(),
        nodes: vec!["gpu07".into(), "gpu08".into()],
        state,
        dirs: JobDirs {
            stage_dir: format!("{dir}/stage"),
            ckpt_dir: format!("{dir}/ckpt"),
            restored_tag: None,
            notes: Vec::new(),
            env: Vec::new(),
        },
        stages,
        started_at: STARTED_AT,
        error: None,
        ckpts: Vec::new(),
    }
}

fn stage(name: &str, source: &str, state: StageState) -> StageProgress {
    StageProgress {
        name: name.into(),
        source: source.into(),
        state,
        files_done: 0,
        files_total: None,
        bytes_done: 0,
        bytes_total: None,
        origin_bytes: 0,
        peer_bytes: 0,
        cache_bytes: 0,
        resumed_bytes: 0,
        elapsed_ms: 0,
        error: None,
    }
}

/// Two datasets on the way: one copying with known totals, one still listing.
pub fn staging_job() -> JobStatus {
    let imagenet = StageProgress {
        files_done: 812,
        files_total: Some(1000),
        bytes_done: 8_500_000_000,
        bytes_total: Some(10 * GIB),
        elapsed_ms: 16_000,
        ..stage("imagenet", "s3://datasets/imagenet", StageState::Copying)
    };
    let weights = StageProgress {
        files_done: 1,
        bytes_done: 28_600_000_000,
        elapsed_ms: 16_000,
        ..stage("weights", "/lustre/models/llama-8b", StageState::Listing)
    };
    job(
        4242,
        "alice",
        1000,
        JobState::Staging,
        vec![imagenet, weights],
    )
}

/// A user mistake: the dataset does not exist.
pub fn failed_job() -> JobStatus {
    let corpus = StageProgress {
        files_total: Some(0),
        bytes_total: Some(0),
        elapsed_ms: 1_200,
        error: Some("s3://corpus/v2 not found — check the path; the job was not started".into()),
        ..stage("corpus", "s3://corpus/v2", StageState::Failed)
    };
    job(4250, "bob", 1001, JobState::Failed, vec![corpus])
}

/// The agent's workers on [`node_status`]'s node: housekeeping, job 4242's checkpoint worker
/// archiving, and job 4260's failing to reach its archive.
pub fn workers() -> Vec<WorkerStatus> {
    let worker = |name: &str, job_id, state: &str, since, turns| WorkerStatus {
        name: name.into(),
        job_id,
        state: state.into(),
        since: STARTED_AT + since,
        turns,
        last_error: None,
    };
    vec![
        worker("housekeeping", None, "idle", 180, 3),
        worker("ckpt job 4242", Some(4242), "archiving", 100, 40),
        WorkerStatus {
            last_error: Some(
                "step-900: the archive store is unreachable; retrying (connecting to s3.example.org:443 timed out)"
                    .into(),
            ),
            ..worker("ckpt job 4260", Some(4260), "idle", 60, 61)
        },
    ]
}

/// A node with four jobs: staging, failed, one without datasets, one fully staged; and its
/// [`workers`].
pub fn node_status() -> NodeStatus {
    let done = StageProgress {
        files_done: 1200,
        files_total: Some(1200),
        bytes_done: 10 * GIB,
        bytes_total: Some(10 * GIB),
        elapsed_ms: 10_000,
        ..stage("ckpt", "s3://ckpt/dave/run1/step-900", StageState::Done)
    };
    NodeStatus {
        node: "gpu07".into(),
        agent_version: "0.1.0".into(),
        hot_root: "/var/lib/sluice/gpu07/hot".into(),
        hot_total_bytes: 1_920_383_410_176,
        hot_free_bytes: 1_310_000_000_000,
        hot_used_bytes: 47_800_000_000,
        cache: None,
        workers: workers(),
        jobs: vec![
            staging_job(),
            failed_job(),
            job(4251, "carol", 1002, JobState::Ready, vec![]),
            job(4260, "dave", 1003, JobState::Ready, vec![done]),
        ],
    }
}

/// The archive of [`job_ckpts`]'s checkpoints.
pub const CKPT_URL: &str = "s3://ckpt/alice/train";
/// The job whose checkpoints [`job_ckpts`] lists.
pub const CKPT_JOB: u32 = 4242;

fn ckpt(tag: &str, state: CkptState, minutes: u64) -> CkptStatus {
    CkptStatus {
        action_needed: false,
        tag: tag.into(),
        state,
        on_hot_tier: true,
        in_ram: false,
        archive_url: CKPT_URL.into(),
        files: 0,
        raw_bytes: 0,
        stored_bytes: 0,
        bytes_done: 0,
        committed_at: STARTED_AT + minutes * 60,
        archived_at: None,
        error: None,
        replicas: None,
    }
}

/// One job's checkpoints on gpu07, in every interesting state.
pub fn job_ckpts() -> Vec<CkptStatus> {
    let archived = |tag, minutes, on_hot_tier| CkptStatus {
        on_hot_tier,
        files: 12,
        raw_bytes: 3 * GIB,
        stored_bytes: 2_200_000_000,
        archived_at: Some(STARTED_AT + minutes * 60 + 70),
        ..ckpt(tag, CkptState::Archived, minutes)
    };
    vec![
        archived("step100", 10, false),
        archived("step200", 20, true),
        CkptStatus {
            files: 6,
            raw_bytes: 1536 << 20,
            stored_bytes: 1_100_000_000,
            ..ckpt("step300", CkptState::WaitingForNodes, 30)
        },
        CkptStatus {
            error: Some(
                "s3://ckpt/alice/train: put 'alice/train/step400/data/model.bin': connection refused"
                    .into(),
            ),
            ..ckpt("step400", CkptState::Retrying, 40)
        },
        // A --ckpt-tier=ram job's: flushed and being archived (its RAM copy is the newest's), and
        // committed in RAM, not flushed yet.
        // Replicated to gpu08 (`[fast_tier] replicas = 1`), and one gpu08 had no room for.
        CkptStatus {
            in_ram: true,
            replicas: Some(ReplicaStatus {
                wanted: 1,
                held_by: vec!["gpu08".into()],
                protected: true,
                ..ReplicaStatus::default()
            }),
            ..ckpt("step500", CkptState::Archiving, 50)
        },
        CkptStatus {
            in_ram: true,
            replicas: Some(ReplicaStatus {
                wanted: 1,
                short: Some("gpu08 has no room for replicas: 8.0 GiB asked, 1.0 GiB free".into()),
                ..ReplicaStatus::default()
            }),
            ..ckpt("step550", CkptState::Archiving, 55)
        },
        CkptStatus {
            in_ram: true,
            on_hot_tier: false,
            ..ckpt("step600", CkptState::Committed, 60)
        },
    ]
}

/// An archive holding one complete checkpoint (its data in STANDARD_IA), one still being archived,
/// one with a broken MANIFEST.
pub fn archive_listing() -> Vec<CheckpointInfo> {
    let ms = |minutes: u64| (STARTED_AT + minutes * 60) * 1000 + 250;
    vec![
        CheckpointInfo {
            tag: "step100".into(),
            state: CheckpointState::Complete,
            files: 24,
            raw_bytes: 6 * GIB,
            stored_bytes: 4_400_000_000,
            ratio: Some(6.0 * GIB as f64 / 4_400_000_000.0),
            created_unix_ms: ms(11),
            job: Some(JobMeta {
                job_id: CKPT_JOB,
                user: "alice".into(),
                job_name: "train".into(),
            }),
            nodes: vec!["gpu07".into(), "gpu08".into()],
            data_classes: vec!["STANDARD_IA".into()],
            poison: None,
        },
        CheckpointInfo {
            tag: "step200".into(),
            state: CheckpointState::Partial,
            files: 9,
            raw_bytes: 3 * GIB,
            stored_bytes: 1_000_000_000,
            ratio: None,
            created_unix_ms: ms(21),
            job: None,
            nodes: vec!["gpu07".into()],
            data_classes: vec!["default".into()],
            poison: None,
        },
        CheckpointInfo::invalid("step150".into(), "unsupported version 9".into()),
    ]
}

pub use sluice_proto::testing::cache_stats;

/// Its entries, least recently used first; the newest one a job is reading.
pub fn cache_listing() -> CacheListing {
    let entry = |url: &str, size: u64, minutes: u64, in_use: bool| CacheEntry {
        url: url.into(),
        etag: Some("\"5d41402abc4b2a76\"".into()),
        version: None,
        size,
        last_use: STARTED_AT + minutes * 60,
        in_use,
    };
    CacheListing {
        node: "gpu07".into(),
        stats: cache_stats(),
        entries: vec![
            entry("s3://datasets/corpus/v1.tar", 2 * GIB, 5, false),
            entry("s3://datasets/imagenet/train.tar", 30 * GIB, 20, false),
            entry("az://models/llama-8b/model.safetensors", GIB, 42, true),
        ],
        left_out: 0,
    }
}

/// A warm of a dataset half of which was cached, one object too large for the cache.
pub fn cache_warmed() -> CacheWarmed {
    CacheWarmed {
        node: "gpu07".into(),
        url: "s3://datasets/imagenet/".into(),
        files: 1000,
        bytes: 10 * GIB,
        cached_files: 500,
        cached_bytes: 4 * GIB,
        filled_files: 499,
        filled_bytes: 6 * GIB,
        skipped: vec![
            "s3://datasets/imagenet/all.tar: 120.0 GiB is larger than the cache (100.0 GiB)".into(),
        ],
    }
}

/// An eviction under a prefix that left one entry a job reads.
pub fn cache_evicted(dry_run: bool) -> CacheEvicted {
    CacheEvicted {
        node: "gpu07".into(),
        entries: 2,
        bytes: 32 * GIB,
        in_use: 1,
        dry_run,
    }
}
