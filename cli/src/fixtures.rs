//! Canned agent answers shared by the unit tests (`render`) and the end-to-end tests (`tests/cli.rs`,
//! which includes this file by path), so both check the same node.

use sluice_proto::msg::{JobDirs, JobState, JobStatus, NodeStatus, StageProgress, StageState};

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

/// A node with four jobs: staging, failed, one without datasets, one fully staged.
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
        jobs: vec![
            staging_job(),
            failed_job(),
            job(4251, "carol", 1002, JobState::Ready, vec![]),
            job(4260, "dave", 1003, JobState::Ready, vec![done]),
        ],
    }
}
