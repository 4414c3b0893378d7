//! Step-level staging (issue 11, item 5) as a user sees it: `srun --stage-in=…` inside an
//! allocation stages for that step, on the step's nodes, and the step's tasks find the data under
//! `$SLUICE_STAGE_DIR/NAME`; it is cleaned up at job end. Both shapes: a job submitted without any
//! sluice option (so neither prolog nor epilog calls the agent), and a job with its own
//! `--stage-in` whose step adds another dataset.

use crate::common::*;
use std::path::Path;
use std::time::Duration;

const STAGE_JOB_TIMEOUT: Duration = Duration::from_secs(300);
/// A job the agents learnt of from a step is ended by their housekeeping (every 5 s here,
/// `agent.housekeeping_interval` in tests/harness/cluster.sh).
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(120);

/// The listing script of [`listing_script`], with its one srun given `srun_args` (one task on
/// each of the step's nodes).
fn step_script(out: &Path, names: &[&str], srun_args: &str) -> String {
    listing_script(out, names).replacen(
        "srun --ntasks-per-node=1",
        &format!("srun --ntasks-per-node=1 {srun_args}"),
        1,
    )
}

/// A 3-node job without sluice options whose script runs a 2-node step with `--stage-in`: both
/// step nodes hold the dataset identical to its POSIX source, owned by the user; the third node
/// ran no task and staged nothing; after the job, every node's job directory is gone.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn srun_stage_in_in_a_job_without_options_stages_for_the_step() {
    let cluster = Cluster::for_sluice();
    let src = cluster.dataset("step-staging-alone", false);
    let sums = checksums(&src);
    let work = cluster.workdir("step-staging-alone");
    let out = work.join("out");
    let script = step_script(
        &out,
        &["stepds"],
        &format!("-N2 --nodelist=n1,n2 --stage-in=stepds={}", src.display()),
    );
    let job = cluster.submit(&work, &["-N3"], &script);
    cluster.assert_completes(&job, STAGE_JOB_TIMEOUT, "the job with a staging step");
    for node in ["n1", "n2"] {
        assert!(
            out.join(node).join("done").exists(),
            "no step task ran to the end on {node}\n{}",
            cluster.evidence(&job)
        );
        let got = task_file(&out, node, "sums-stepds");
        let what = format!("the step's dataset on {node} differs from its source");
        cluster.assert_same_listing(&job, &sums, &got, &what);
        cluster.assert_staged_owned_by_user(&out, node);
    }
    assert!(
        !out.join("n3").exists(),
        "a task ran on n3, which is not one of the step's nodes"
    );
    assert!(
        !cluster.job_dir("n3", &job).exists(),
        "n3 staged for a step it is not part of"
    );
    // No epilog tells the agents: they end the job themselves once Slurm no longer runs it.
    cluster.assert_job_left_nothing(&job, CLEANUP_TIMEOUT);
}

/// A 3-node job staging `jobds` whose step adds `stepds` from S3: the step's tasks see both; a
/// second step naming `jobds` from another source is refused by srun with a message that says so,
/// and the job (its script carries on) still completes; job end removes everything.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn srun_stage_in_adds_a_dataset_to_the_jobs_own() {
    let cluster = Cluster::for_s3();
    let jobds = cluster.dataset("step-staging-job", false);
    let stepds = cluster.dataset("step-staging-step", false);
    let prefix = format!("e2e/{}/train", unique());
    cluster.upload(&stepds, "garage", &format!("datasets/{prefix}"));
    let work = cluster.workdir("step-staging-add");
    let out = work.join("out");
    let listing = step_script(
        &out,
        &["jobds", "stepds"],
        &format!("--stage-in=stepds=s3://datasets/{prefix}"),
    );
    let conflict = format!(
        "srun -N1 --stage-in=jobds=s3://datasets/{prefix} true > {} 2>&1 || echo \"refused $?\" >> {}\n",
        work.join("conflict").display(),
        work.join("conflict").display()
    );
    let script = format!("{listing}{conflict}");
    let job = cluster.submit(
        &work,
        &["-N3", &format!("--stage-in=jobds={}", jobds.display())],
        &script,
    );
    cluster.assert_completes(&job, STAGE_JOB_TIMEOUT, "the job whose step adds a dataset");
    let (job_sums, step_sums) = (checksums(&jobds), checksums(&stepds));
    for node in &cluster.nodes {
        for (name, want) in [("jobds", &job_sums), ("stepds", &step_sums)] {
            let got = task_file(&out, node, &format!("sums-{name}"));
            let what = format!("{name} on {node} differs from its source");
            cluster.assert_same_listing(&job, want, &got, &what);
        }
    }
    // srun itself refuses it (it sees the job's --stage-in too), before any task starts.
    let conflict = std::fs::read_to_string(work.join("conflict")).unwrap_or_default();
    assert!(
        conflict.contains("dataset NAME 'jobds' is used twice")
            && conflict.contains(&format!("s3://datasets/{prefix}"))
            && conflict.contains("refused"),
        "a step naming the job's dataset from another source must fail, saying why:\n{conflict}"
    );
    cluster.assert_job_left_nothing(&job, CLEANUP_TIMEOUT);
}
