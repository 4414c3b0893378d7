//! Resumed staging (issue 11 item 6) as a user sees it: the agent of the job's node is SIGKILLed
//! while it stages a dataset of many objects from S3 (Garage) and started again; the job completes
//! with the whole dataset byte-identical, and the origin serves only what was not staged whole
//! before the kill — counted on the origin's side by the relay in front of Garage, which the
//! agents' `s3://datasets-relayed` store profile points at.

mod common;

use common::*;
use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const NODE: &str = "n1";
const JOB_TIMEOUT: Duration = Duration::from_secs(300);
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(60);
/// 240 objects of 128 KiB: 30 MiB, about 10 s through the paced relay.
const OBJECTS: u64 = 240;
const OBJECT_SIZE: u64 = 128 << 10;
/// What the origin may send on top of object bytes per object: its listing entry and the
/// response headers of its GET.
const PER_OBJECT_OVERHEAD: u64 = 2048;

fn random_file(path: &Path, len: u64) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    run(Command::new("bash")
        .arg("-c")
        .arg(format!("head -c {len} /dev/urandom > '{}'", path.display())));
}

/// A 1-node job stages 240 objects; once about a third are staged its node's agent is SIGKILLed
/// (the origin paced to a crawl first, so that the files staged whole are known and their log
/// lines written) and started again. The restarted agent keeps the files staged whole and reads
/// the rest: the job's data is byte-identical to the dataset, and the origin serves, after the
/// restart, less than the dataset minus what was whole before (with only listing and header
/// overhead on top of the missing files' bytes), so well under twice the dataset in all.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn resume_an_agent_killed_mid_stage_keeps_the_files_it_staged_whole() {
    let cluster = Cluster::for_sluice();
    cluster.require_s3();
    let dir = cluster.data_dir("resume").join("train");
    for i in 0..OBJECTS {
        random_file(&dir.join(format!("d{}/obj-{i:03}.bin", i % 4)), OBJECT_SIZE);
    }
    run(Command::new("chmod").args(["-R", "u=rwX,go=rX"]).arg(&dir));
    let prefix = format!("resume-e2e/{}/train", unique());
    cluster.upload(&dir, "garage", &format!("datasets-relayed/{prefix}"));
    let sums = checksums(&dir);
    let dataset = OBJECTS * OBJECT_SIZE;

    let relay = cluster.origin_relay();
    relay.set_pace(3_000_000);
    let work = cluster.workdir("resume");
    let out = work.join("out");
    let stage_in = format!("--stage-in=ds=s3://datasets-relayed/{prefix}");
    let job = cluster.submit(
        &work,
        &["-N1", "-w", NODE, &stage_in],
        &listing_script(&out, &["ds"]),
    );
    cluster.wait_running(&job, Duration::from_secs(60));
    let files_done = || {
        cluster
            .agent_job(NODE, &job)
            .ok()
            .and_then(|s| s.stages.first().map(|p| p.files_done))
            .unwrap_or(0)
    };
    cluster.wait_for(
        "a third of the objects to be staged",
        Duration::from_secs(120),
        Some(&job),
        || files_done() >= OBJECTS / 3,
    );
    // The origin to a crawl: no file completes any more, and the agent's staging log gets the
    // lines of those that did (written within a second).
    relay.set_pace(1);
    std::thread::sleep(Duration::from_secs(3));
    let whole = files_done();
    assert!(
        whole < OBJECTS,
        "the dataset was staged before the agent could be killed"
    );
    let agent = cluster.kill_agent_and_its_ports(NODE);
    let before = relay.served();
    eprintln!(
        "[resume] killed the agent of {NODE} with {whole} of {OBJECTS} objects staged whole; the \
         origin had served {before} bytes of the {dataset}-byte dataset"
    );
    relay.set_pace(0);
    cluster.start_agent(&agent);
    cluster.assert_completes(
        &job,
        JOB_TIMEOUT,
        "the job whose agent was killed mid-stage",
    );
    let after = relay.served() - before;

    let got = task_file(&out, NODE, "sums-ds");
    assert!(
        got == sums,
        "the job whose agent was killed mid-stage got other bytes: {}\n{}",
        diff_listings(&sums, &got),
        cluster.evidence(&job)
    );
    let complete_before = whole * OBJECT_SIZE;
    eprintln!(
        "[resume] after the restart the origin served {after} bytes (the dataset less what was \
         whole before: {}); {} bytes in all ({:.2}x the dataset)",
        dataset - complete_before,
        before + after,
        (before + after) as f64 / dataset as f64
    );
    let overhead = OBJECTS * PER_OBJECT_OVERHEAD;
    assert!(
        after < dataset - complete_before + overhead,
        "after the restart the origin served {after} bytes: more than the {} bytes not staged \
         whole before the kill (and {overhead} bytes of listing and headers) — files staged \
         whole were read again\n{}",
        dataset - complete_before,
        cluster.evidence(&job)
    );
    let p = cluster
        .agent_job(NODE, &job)
        .ok()
        .and_then(|s| s.stages.first().cloned())
        .unwrap_or_else(|| panic!("the restarted agent has no record of job {}", job.id));
    assert_eq!(
        (p.resumed_bytes, p.bytes_done),
        (complete_before, dataset),
        "the restarted agent's count of the bytes it kept: {p:?}"
    );
    let output = job.output_text();
    assert!(
        output.contains("resumed from before the agent restarted"),
        "the job output does not say that part of the dataset was kept across the restart:\n{output}"
    );
    cluster.assert_hot_tier_cleaned(&job, CLEANUP_TIMEOUT);
    cluster.assert_nodes_return_idle(&job, CLEANUP_TIMEOUT);
}
