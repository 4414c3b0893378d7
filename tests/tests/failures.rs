//! A user's mistake in a dataset that passes the submit-time check — a path or prefix that does not
//! exist, a bucket that does not exist, a directory the user may not read — must fail that job with a
//! message in its output that names the source, before the job script runs, quickly, and without
//! draining a node or leaving data on a hot tier (DESIGN.md, "User mistakes fail the job, never the
//! node").

use crate::common::*;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

/// Longer than the plugin's stage_timeout=120, so a hang shows up as the plugin's own timeout.
const JOB_TIMEOUT: Duration = Duration::from_secs(180);
/// A missing dataset is known after one listing; the user must not wait for the stage timeout.
const FAIL_FAST: Duration = Duration::from_secs(60);
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(60);

/// Submits a 3-node job staging `source`, and checks it fails as described above. `explanations`:
/// phrases of which the job output must contain at least one (lower case).
fn assert_job_fails_cleanly(cluster: &Cluster, test: &str, source: &str, explanations: &[&str]) {
    cluster.require_sluice();
    let work = cluster.workdir(test);
    let (script, ran) = marker_script(&work);
    let started = Instant::now();
    let job = cluster.submit(&work, &["-N3", &format!("--stage-in=ds={source}")], &script);
    let end = cluster.wait_end(&job, JOB_TIMEOUT);
    let took = started.elapsed();
    let why = format!("staging {source} cannot have succeeded");
    cluster.assert_ended(&job, &end, "FAILED", &why);
    cluster.assert_script_did_not_run(&job, &ran, &format!("staging {source} failed"));

    let output = job.output_text();
    let lower = output.to_lowercase();
    assert!(
        output.contains(source) && explanations.iter().any(|e| lower.contains(e)),
        "the job output must name {source} and say what is wrong (one of {explanations:?}); it is:\n{output}\n{}",
        cluster.evidence(&job)
    );
    // The user reads this: words, not a store's raw reply.
    assert!(
        !output.contains("<?xml") && !output.contains("<Error>"),
        "the job output passes on a raw object-store response instead of explaining it:\n{output}"
    );
    assert!(
        took < FAIL_FAST,
        "staging a bad source took {took:?} to fail; expected under {FAIL_FAST:?}"
    );

    cluster.assert_nodes_return_idle(&job, CLEANUP_TIMEOUT);
    cluster.assert_hot_tier_cleaned(&job, CLEANUP_TIMEOUT);
}

const NOT_FOUND: &[&str] = &[
    "not found",
    "does not exist",
    "no such",
    "no object",
    "empty",
];

/// Object-store sources that do not exist.
#[derive(Clone, Copy)]
enum Missing {
    S3Prefix,
    S3Bucket,
    AzurePrefix,
}

impl Missing {
    /// [`assert_job_fails_cleanly`] for this missing source.
    fn fails_the_job_cleanly(self) {
        let cluster = Cluster::get();
        let u = unique();
        let (test, source, explanations) = match self {
            Missing::S3Prefix => (
                "missing-s3",
                format!("s3://datasets/e2e/{u}/no-such-dataset"),
                NOT_FOUND.to_vec(),
            ),
            Missing::S3Bucket => (
                "missing-bucket",
                format!("s3://no-such-bucket-{}/data", std::process::id()),
                [NOT_FOUND, &["bucket"]].concat(),
            ),
            Missing::AzurePrefix => (
                "missing-az",
                format!("az://datasets/e2e/{u}/no-such-dataset"),
                NOT_FOUND.to_vec(),
            ),
        };
        if source.starts_with("s3://") {
            cluster.require_s3();
        }
        assert_job_fails_cleanly(&cluster, test, &source, &explanations);
    }
}

#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn missing_posix_directory_fails_the_job_not_the_node() {
    let cluster = Cluster::get();
    let missing = cluster.data_dir("missing-posix").join("no-such-dataset");
    assert_job_fails_cleanly(
        &cluster,
        "missing-posix",
        missing.to_str().unwrap(),
        NOT_FOUND,
    );
}

#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn missing_s3_prefix_fails_the_job_not_the_node() {
    Missing::S3Prefix.fails_the_job_cleanly();
}

#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn missing_s3_bucket_fails_the_job_not_the_node() {
    Missing::S3Bucket.fails_the_job_cleanly();
}

#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn missing_azure_prefix_fails_the_job_not_the_node() {
    Missing::AzurePrefix.fails_the_job_cleanly();
}

/// The agent runs as root but must read POSIX sources as the job user: a directory only root may
/// read fails the job, and none of its content reaches the user's stage directory.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn posix_directory_the_user_may_not_read_fails_the_job() {
    let cluster = Cluster::get();
    let secret = cluster.data_dir("unreadable").join("root-only");
    fs::create_dir_all(&secret).unwrap();
    fs::write(secret.join("secret.txt"), "root's data\n").unwrap();
    fs::set_permissions(&secret, fs::Permissions::from_mode(0o700)).unwrap();
    assert_job_fails_cleanly(
        &cluster,
        "unreadable",
        secret.to_str().unwrap(),
        &[
            "permission denied",
            "not permitted",
            "may not read",
            "cannot read",
            "access",
        ],
    );
}
