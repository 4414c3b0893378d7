//! Object keys are not file paths: a bucket may hold `ds/../../x`, keys with
//! backslashes or `.` segments. Whoever can write to a bucket a job stages from must not be able to
//! make the agent — which runs as root — write outside that dataset's directory. The agent may refuse
//! such a dataset (the job fails with a message) or skip or rename the bad keys (the job runs);
//! either way nothing lands outside `$SLUICE_STAGE_DIR/NAME`.

use crate::common::*;
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

const JOB_TIMEOUT: Duration = Duration::from_secs(180);
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(60);
/// `..` segments tried: from the dataset dir up past the stage dir, the job dir, the hot tier, to /.
const MAX_DEPTH: usize = 12;

/// Resolves `..` lexically (the paths involved hold no symlinks).
fn normalize(p: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

/// Puts `ok.txt` and, for each depth, a hostile key made by `hostile(depth, name)` under a fresh
/// prefix, stages that prefix in a 3-node job, and checks that the job either completed with
/// everything inside `stage/ds` or failed naming the dataset — and that no file reached any place
/// a hostile key points to.
fn assert_keys_stay_inside(test: &str, hostile: impl Fn(usize, &str) -> String) {
    let cluster = Cluster::for_s3();
    let u = unique();
    let prefix = format!("e2e/{u}/ds");
    let mut escape_names = Vec::new();
    cluster.put_object(
        "datasets",
        &format!("{prefix}/ok.txt"),
        b"a file with a plain key\n",
    );
    for depth in 1..=MAX_DEPTH {
        let name = format!("escape-{depth}-{u}");
        let key = format!("{prefix}/{}", hostile(depth, &name));
        cluster.put_object("datasets", &key, b"written through a hostile key\n");
        escape_names.push(name);
    }

    let work = cluster.workdir(test);
    let out = work.join("out");
    // Each task records every file of the whole job directory, not only of the dataset.
    let script = format!(
        "#!/bin/bash\nsrun --ntasks-per-node=1 bash -c 'mkdir -p {out}/$SLURMD_NODENAME; \
         cd \"$SLUICE_STAGE_DIR/..\" && find . -type f > {out}/$SLURMD_NODENAME/files; \
         cat \"$SLUICE_STAGE_DIR/ds/ok.txt\" > {out}/$SLURMD_NODENAME/ok'\n",
        out = out.display()
    );
    let job = cluster.submit(
        &work,
        &["-N3", &format!("--stage-in=ds=s3://datasets/{prefix}")],
        &script,
    );
    let end = cluster.wait_end(&job, JOB_TIMEOUT);

    match end.state.as_str() {
        "COMPLETED" => {
            for node in &cluster.nodes {
                assert_eq!(
                    task_file(&out, node, "ok"),
                    "a file with a plain key\n",
                    "the plain key next to the hostile ones, on {node}"
                );
                let files = task_file(&out, node, "files");
                let outside: Vec<&str> = files
                    .lines()
                    .filter(|f| !f.starts_with("./stage/ds/"))
                    .collect();
                assert!(
                    outside.is_empty(),
                    "files in job {}'s directory on {node} outside stage/ds: {outside:?}",
                    job.id
                );
            }
        }
        "FAILED" => {
            let output = job.output_text();
            assert!(
                output.contains(&format!("s3://datasets/{prefix}")),
                "a dataset refused for its keys must be named in the job output:\n{output}"
            );
        }
        other => panic!(
            "staging hostile keys ended {other}\n{}",
            cluster.evidence(&job)
        ),
    }

    // Wherever a hostile key could have led from any node's dataset directory, nothing is there.
    let mut escaped = Vec::new();
    for node in &cluster.nodes {
        let ds_dir = cluster.job_dir(node, &job).join("stage").join("ds");
        for depth in 1..=MAX_DEPTH {
            for name in &escape_names {
                let mut p = ds_dir.clone();
                for _ in 0..depth {
                    p.push("..");
                }
                let candidate = normalize(&p.join(name));
                if candidate.exists() {
                    escaped.push(candidate);
                }
            }
        }
    }
    for p in &escaped {
        let _ = std::fs::remove_file(p); // do not leave the escaped files behind
    }
    assert!(
        escaped.is_empty(),
        "hostile object keys made the agent write outside the dataset directory: {escaped:?}\n{}",
        cluster.evidence(&job)
    );
    cluster.assert_job_left_nothing(&job, CLEANUP_TIMEOUT);
}

/// `ds/../../x` and `ds/./x`: object_store refuses to list such keys, so the agent must at least
/// fail the job cleanly.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn dot_dot_keys_never_escape_the_dataset_directory() {
    assert_keys_stay_inside("hostile-dotdot", |depth, name| {
        format!("./{}{name}", "../".repeat(depth))
    });
}

/// `b\..\..\x` (a path on Windows, a plain name on Linux) and `c%2F..%2Fx` (a path once
/// percent-decoded): legal object_store paths, so these reach the agent's key-to-file mapping.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn backslash_and_percent_keys_never_escape_the_dataset_directory() {
    assert_keys_stay_inside("hostile-backslash", |depth, name| {
        format!("b{}\\{name}", "\\..".repeat(depth))
    });
    assert_keys_stay_inside("hostile-percent", |depth, name| {
        format!("c{}%2F{name}", "%2F..".repeat(depth))
    });
}
