//! A hot tier that fills up during stage-in (issue 4, "Fault behaviour"): the job fails with a
//! message that names the full hot tier and the node, the partial files are removed, and no node is
//! drained.
//!
//! One node's hot tier is replaced, while the agents run, by a 32 MiB tmpfs mounted over it (the agent
//! opens the hot-tier root by path for every job), and a 3-node job stages a dataset of about 66 MiB.

use crate::common::*;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const SMALL_TIER: &str = "32m";
const FULL_NODE: &str = "n2";
const JOB_TIMEOUT: Duration = Duration::from_secs(300);
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(60);

/// A size-limited tmpfs over one node's hot tier; unmounted when dropped, also when the test fails.
struct SmallHotTier {
    path: PathBuf,
}

fn mounted_at(path: &Path) -> bool {
    let target = path.to_str().unwrap();
    fs::read_to_string("/proc/self/mounts")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split_whitespace().nth(1) == Some(target))
}

fn unmount(path: &Path) {
    for _ in 0..20 {
        if !mounted_at(path) {
            return;
        }
        let _ = Command::new("umount").arg(path).status();
        std::thread::sleep(Duration::from_millis(250));
    }
    // Something still holds it open (an agent mid-operation): detach it rather than leave it.
    let _ = Command::new("umount").arg("-l").arg(path).status();
}

impl SmallHotTier {
    fn mount(cluster: &Cluster, node: &str, size: &str) -> SmallHotTier {
        let path = cluster.hot_root(node);
        // A tier left mounted by an interrupted run would make this test meaningless.
        unmount(&path);
        run(Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size},mode=0755")])
            .arg("tmpfs")
            .arg(&path));
        let guard = SmallHotTier { path };
        // What the agent creates at start: `<hot>/jobs`, root's, 0711.
        run(Command::new("mkdir")
            .args(["-m", "0711"])
            .arg(guard.path.join("jobs")));
        guard
    }

    /// Everything on the small tier, relative to it (`jobs` itself aside).
    fn contents(&self) -> Vec<String> {
        run(Command::new("find")
            .arg(&self.path)
            .args(["-mindepth", "1", "-printf", "%P %s\n"]))
        .lines()
        .filter(|l| l.rsplit_once(' ').map(|(p, _)| p) != Some("jobs"))
        .map(String::from)
        .collect()
    }
}

impl Drop for SmallHotTier {
    fn drop(&mut self) {
        unmount(&self.path);
        if mounted_at(&self.path) {
            eprintln!("WARNING: could not unmount {}", self.path.display());
        }
    }
}

/// Stages `source` (about 66 MiB) with a 3-node job while FULL_NODE's hot tier holds 32 MiB.
fn full_hot_tier_fails_the_job(test: &str, source: &str) {
    let cluster = Cluster::for_sluice();
    let tier = SmallHotTier::mount(&cluster, FULL_NODE, SMALL_TIER);
    let work = cluster.workdir(test);
    let started = Instant::now();
    let job = cluster.submit(
        &work,
        &["-N3", &format!("--stage-in=train={source}")],
        "#!/bin/bash\nsrun true\n",
    );
    let (end, output) =
        cluster.wait_end_and_report(test, &job, JOB_TIMEOUT, ("its submission", started));
    let why = format!("{FULL_NODE}'s hot tier cannot hold the dataset");
    cluster.assert_ended(&job, &end, "FAILED", &why);
    let lower = output.to_lowercase();
    assert!(
        lower.contains("full")
            && output.contains(&format!("node {FULL_NODE}"))
            && lower.contains("hot tier"),
        "the job output must say that the hot tier of {FULL_NODE} is full:\n{output}\n{}",
        cluster.evidence(&job)
    );
    cluster.assert_nodes_return_idle(&job, CLEANUP_TIMEOUT);
    // The partial copy goes, on the full node as on the others.
    cluster.assert_hot_tier_cleaned(&job, CLEANUP_TIMEOUT);
    let left = tier.contents();
    assert!(
        left.is_empty(),
        "files left on {FULL_NODE}'s hot tier after job {} ended: {left:?}",
        job.id
    );
    drop(tier);
    assert!(
        !mounted_at(&cluster.hot_root(FULL_NODE)),
        "the small hot tier is still mounted"
    );
}

#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn faults_hot_tier_full_while_staging_from_s3() {
    let cluster = Cluster::get();
    cluster.require_s3();
    let dir = cluster.dataset("faults-full-s3", true);
    let prefix = format!("e2e/faults-full-{}/train", unique());
    cluster.upload(&dir, "garage", &format!("datasets/{prefix}"));
    full_hot_tier_fails_the_job("faults-full-s3", &format!("s3://datasets/{prefix}"));
}

#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn faults_hot_tier_full_while_staging_from_posix() {
    let cluster = Cluster::get();
    let dir = cluster.dataset("faults-full-posix", true);
    full_hot_tier_fails_the_job("faults-full-posix", dir.to_str().unwrap());
}
