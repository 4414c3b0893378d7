//! Stage-in as a user sees it: a 3-node batch job names a dataset with `--stage-in`, and every task
//! on every node finds an exact copy under `$SLUICE_STAGE_DIR/NAME`, owned by the job user, in a job
//! directory nobody else can enter; when the job ends, the copies are gone from every node.
//!
//! The same dataset (nested directories, an empty file, a file over 64 MiB, a few hundred small
//! files, awkward names) is staged from each kind of origin: a POSIX directory, Garage (S3) and
//! Azurite (Azure Blob).

use crate::common::*;
use std::path::Path;
use std::sync::OnceLock;
use std::time::Duration;

/// Staging 3 × (64 MiB + 300 files) on a 2-core machine: generous, but bounded.
const STAGE_JOB_TIMEOUT: Duration = Duration::from_secs(300);
/// The plugin's epilog_timeout is 30 s; cleanup may finish in the background after it.
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(60);

impl Dataset {
    /// The harness's test dataset (see [`make_dataset`]), with its file over 64 MiB if `big`.
    fn standard(cluster: &Cluster, test: &str, big: bool) -> Dataset {
        Dataset::of(cluster.dataset(test, big))
    }

    /// Uploads it to `datasets/e2e/<unique>/train` of each remote (`garage`, `azurite`), the
    /// prefix the harness's `[[stage.allow]]` rules open; returns that prefix.
    fn upload_to(&self, cluster: &Cluster, remotes: &[&str]) -> String {
        let prefix = format!("e2e/{}/train", unique());
        for remote in remotes {
            cluster.upload(&self.dir, remote, &format!("datasets/{prefix}"));
        }
        prefix
    }
}

/// The large dataset, generated once per test binary and shared by the three origin tests.
fn big_dataset(cluster: &Cluster) -> &'static Dataset {
    static DS: OnceLock<Dataset> = OnceLock::new();
    DS.get_or_init(|| Dataset::standard(cluster, "stage-big", true))
}

/// Checks what each task recorded (see [`listing_script`]) against the datasets, then that the job
/// left nothing behind and no node out of service.
fn assert_staged(cluster: &Cluster, job: &Job, out: &Path, datasets: &[(&str, &Dataset)]) {
    cluster.assert_completes(job, STAGE_JOB_TIMEOUT, "the staging job");
    // One summary of what was staged, once per job (from the batch step), with every dataset.
    let output = job.output_text();
    let summaries: Vec<&str> = output
        .lines()
        .filter(|l| l.starts_with("sluice: staged "))
        .collect();
    let files: usize = datasets.iter().map(|(_, ds)| ds.sums.lines().count()).sum();
    assert!(
        summaries.len() == 1
            && summaries[0]
                .starts_with(&format!("sluice: staged {} dataset(s) on ", datasets.len()))
            && summaries[0].contains(&format!(", {files} file(s) in ")),
        "the job's staging summary: {summaries:#?}\n{}",
        cluster.evidence(job)
    );
    for node in &cluster.nodes {
        let file = |name: &str| task_file(out, node, name);
        cluster.assert_task_done(job, out, node);

        let expected_stage = cluster.job_dir(node, job).join("stage");
        assert_eq!(
            file("stage_dir").trim(),
            expected_stage.to_str().unwrap(),
            "SLUICE_STAGE_DIR on {node}; the task's SLUICE_* variables:\n{}",
            file("env")
        );
        for (name, ds) in datasets {
            cluster.assert_dataset_listed(job, out, node, name, &ds.sums, &ds.dirs);
        }
        cluster.assert_staged_owned_by_user(out, node);
        cluster.assert_job_dir_private(out, node);
    }
    cluster.assert_job_left_nothing(job, CLEANUP_TIMEOUT);
}

/// Runs a job (`directives` in its script, `args` to sbatch) whose tasks list what they see of each
/// dataset of `datasets` (see [`listing_script`]), and checks that with [`assert_staged`].
fn stage(
    cluster: &Cluster,
    test: &str,
    directives: &str,
    args: &[&str],
    datasets: &[(&str, &Dataset)],
) {
    let work = cluster.workdir(test);
    let out = work.join("out");
    let names: Vec<&str> = datasets.iter().map(|(name, _)| *name).collect();
    let script = listing_script(&out, &names).replacen(
        "#!/bin/bash\n",
        &format!("#!/bin/bash\n{directives}"),
        1,
    );
    let job = cluster.submit(&work, args, &script);
    assert_staged(cluster, &job, &out, datasets);
}

/// Where the large dataset is staged from.
#[derive(Clone, Copy)]
enum Origin {
    Posix,
    Garage,
    Azurite,
}

/// The large dataset staged to three nodes from one kind of origin; the tasks must find it under
/// `$SLUICE_STAGE_DIR/NAME`.
fn stage_big_dataset_from(origin: Origin, name: &str) {
    let cluster = Cluster::for_sluice();
    let ds = big_dataset(&cluster);
    let (test, source) = match origin {
        Origin::Posix => ("stage-posix", format!("{name}={}", ds.dir.display())),
        Origin::Garage => {
            cluster.require_s3();
            // No NAME=: the dataset is named after the last component of the prefix, `train`.
            let prefix = ds.upload_to(&cluster, &["garage"]);
            ("stage-s3", format!("s3://datasets/{prefix}"))
        }
        Origin::Azurite => {
            let prefix = ds.upload_to(&cluster, &["azurite"]);
            ("stage-az", format!("{name}=az://datasets/{prefix}"))
        }
    };
    let stage_in = format!("--stage-in={source}");
    stage(&cluster, test, "", &["-N3", &stage_in], &[(name, ds)]);
}

/// From a POSIX directory, read as the job user.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn stage_posix_directory_to_three_nodes() {
    stage_big_dataset_from(Origin::Posix, "train");
}

/// From a Garage (S3) prefix, the dataset named after its last component.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn stage_s3_prefix_to_three_nodes() {
    stage_big_dataset_from(Origin::Garage, "train");
}

/// From an Azurite (Azure Blob) prefix, under the NAME the option gives.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn stage_azure_prefix_to_three_nodes() {
    stage_big_dataset_from(Origin::Azurite, "imagenet");
}

/// `--stage-in` is repeatable and comma-separated (README, "Job options"): every source given
/// either way lands under its own NAME, and the `azure://` spelling means the same as `az://`.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn several_sources_from_repeated_and_comma_separated_options() {
    let cluster = Cluster::for_s3();
    let ds = Dataset::standard(&cluster, "stage-several", false);
    let prefix = ds.upload_to(&cluster, &["garage", "azurite"]);
    let first = format!(
        "--stage-in=local={},objects=s3://datasets/{prefix}",
        ds.dir.display()
    );
    let second = format!("--stage-in=blobs=azure://datasets/{prefix}");
    stage(
        &cluster,
        "stage-several",
        "",
        &["-N3", &first, &second],
        &[("local", &ds), ("objects", &ds), ("blobs", &ds)],
    );
}

/// `#SBATCH --stage-in=...` in the job script works like the command-line option.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn stage_in_from_an_sbatch_directive() {
    let cluster = Cluster::for_sluice();
    let ds = Dataset::standard(&cluster, "stage-directive", false);
    let directives = format!(
        "#SBATCH -N3\n#SBATCH --stage-in=data={}\n",
        ds.dir.display()
    );
    stage(
        &cluster,
        "stage-directive",
        &directives,
        &[],
        &[("data", &ds)],
    );
}

/// `sbatch --export=NONE` drops the submitter's environment, and with it the copy of the options
/// Slurm 22.05 hands to slurmstepd; the tasks must still wait for their data and see it.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn stage_in_with_export_none() {
    let cluster = Cluster::for_sluice();
    let ds = Dataset::standard(&cluster, "stage-export-none", false);
    let stage_in = format!("--stage-in=data={}", ds.dir.display());
    let args = ["-N3", "--export=NONE", &stage_in];
    stage(&cluster, "stage-export-none", "", &args, &[("data", &ds)]);
}
