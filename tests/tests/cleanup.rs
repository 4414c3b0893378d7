//! While a job runs, its staged data sits in a directory only the job user can enter; when the job
//! ends — here by `scancel`, the path a normal end does not take — it is removed from every node's hot
//! tier. (Normal ends are checked by every staging test.)

use crate::common::*;
use std::os::unix::fs::MetadataExt;
use std::time::Duration;

const STAGE_TIMEOUT: Duration = Duration::from_secs(180);
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(60);

#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn cancelled_job_leaves_no_data_and_running_job_data_is_private() {
    let cluster = Cluster::for_sluice();
    let data = cluster.dataset("cancel", false);
    let work = cluster.workdir("cancel");
    let out = work.join("out");
    // Record what the tasks see, then keep the allocation until the test cancels it.
    let script = format!("{}sleep 600\n", listing_script(&out, &["train"]));
    let job = cluster.submit(
        &work,
        &["-N3", &format!("--stage-in=train={}", data.display())],
        &script,
    );
    cluster.wait_for(
        "every node's task to list its staged data",
        STAGE_TIMEOUT,
        Some(&job),
        || {
            cluster
                .nodes
                .iter()
                .all(|n| out.join(n).join("done").exists())
        },
    );
    assert_eq!(
        cluster.job_state(&job).map(|s| s.state).as_deref(),
        Some("RUNNING"),
        "{}",
        cluster.evidence(&job)
    );

    let uid: u32 = run(std::process::Command::new("id").args(["-u", &cluster.user]))
        .trim()
        .parse()
        .unwrap();
    let expected = checksums(&data);
    for node in &cluster.nodes {
        assert_eq!(
            task_file(&out, node, "sums-train"),
            expected,
            "staged data on {node}"
        );
        let dir = cluster.job_dir(node, &job);
        let meta = std::fs::metadata(&dir)
            .unwrap_or_else(|e| panic!("{} while the job runs: {e}", dir.display()));
        assert_eq!(
            (meta.uid(), meta.mode() & 0o7777),
            (uid, 0o700),
            "owner and mode of {}",
            dir.display()
        );
        // Another user on the same node cannot look into it.
        let stage = dir.join("stage").join("train");
        let peek = cluster.as_someone(
            &cluster.other_user,
            &work,
            "ls",
            &[stage.to_str().unwrap()],
            None,
        );
        assert!(
            !peek.status.success(),
            "{} could list {} of {}'s running job",
            cluster.other_user,
            stage.display(),
            cluster.user
        );
    }

    let cancel = cluster.as_user(&work, "scancel", &[&job.id.to_string()], None);
    assert!(
        cancel.status.success(),
        "scancel: {}",
        String::from_utf8_lossy(&cancel.stderr)
    );
    let end = cluster.wait_end(&job, CLEANUP_TIMEOUT);
    cluster.assert_ended(&job, &end, "CANCELLED", "the cancelled job");
    cluster.assert_job_left_nothing(&job, CLEANUP_TIMEOUT);
}
