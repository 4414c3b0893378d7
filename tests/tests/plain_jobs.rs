//! A job that uses no sluice option must run exactly as it would without the plugin: it completes,
//! its output holds only what it printed (no plugin chatter), its tasks see no SLUICE_* variable, and
//! no node gets a job directory for it. These tests also pass on a cluster started without the plugin
//! (SLUICE_NO_PLUGIN=1), which is how the comparison is made.

use crate::common::*;
use std::time::Duration;

const JOB_TIMEOUT: Duration = Duration::from_secs(120);

/// The lines each task prints: its node, its user, and any SLUICE_* variable it sees.
const TASK: &str = r#"echo "task $SLURMD_NODENAME $(id -un)"; env | grep "^SLUICE_" || true"#;

fn expected_lines(cluster: &Cluster) -> Vec<String> {
    cluster
        .nodes
        .iter()
        .map(|n| format!("task {n} {}", cluster.user))
        .collect()
}

fn sorted_lines(text: &str) -> Vec<String> {
    let mut lines: Vec<String> = text.lines().map(String::from).collect();
    lines.sort();
    lines
}

#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn batch_job_without_sluice_options_runs_untouched() {
    let cluster = Cluster::get();
    let work = cluster.workdir("plain-batch");
    let script = format!("#!/bin/bash\nsrun --ntasks-per-node=1 bash -c '{TASK}'\n");
    let job = cluster.submit(&work, &["-N3"], &script);
    assert!(
        job.submit_stderr.is_empty(),
        "sbatch printed something for a plain job: {}",
        job.submit_stderr
    );
    let end = cluster.wait_end(&job, JOB_TIMEOUT);
    assert_eq!(
        (end.state.as_str(), end.exit_code.as_str()),
        ("COMPLETED", "0:0"),
        "a job without sluice options did not complete\n{}",
        cluster.evidence(&job)
    );
    assert_eq!(
        sorted_lines(&job.output_text()),
        expected_lines(&cluster),
        "the output of a job without sluice options must be exactly its tasks' lines\n{}",
        cluster.evidence(&job)
    );
    for node in &cluster.nodes {
        let dir = cluster.job_dir(node, &job);
        assert!(
            !dir.exists(),
            "sluice created {} for a job that did not ask for it",
            dir.display()
        );
    }
    cluster.assert_nodes_return_idle(&job, JOB_TIMEOUT);
}

/// The same through srun alone (an interactive allocation): the local context of the plugin.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn srun_without_sluice_options_runs_untouched() {
    let cluster = Cluster::get();
    let work = cluster.workdir("plain-srun");
    let out = cluster.as_user(
        &work,
        "srun",
        &["-N3", "--ntasks-per-node=1", "bash", "-c", TASK],
        None,
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "srun without sluice options failed:\n{stdout}\n{stderr}\n{}",
        cluster.log_tails()
    );
    assert_eq!(
        sorted_lines(&stdout),
        expected_lines(&cluster),
        "stdout of srun without sluice options"
    );
    assert!(
        stderr.is_empty(),
        "srun printed to stderr for a job without sluice options:\n{stderr}"
    );
}
