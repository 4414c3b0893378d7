//! A bad checkpoint is never restored again (issue 27, item 3): a job saves step-1 and step-2 and
//! poisons step-2 with `sluice ckpt poison` right after committing it (archived yet or not: the
//! mark must hold either way); the next job, started with `--ckpt-restore=latest`, gets step-1,
//! and its output has the `note:` naming step-2, who poisoned it and why. The other test user
//! cannot poison the first user's checkpoint, and nothing is written when they try.

use crate::common::*;
use serde_json::Value;
use std::path::Path;
use std::time::Duration;

/// Each job: one node, a few small files, a `file://` archive.
const JOB_TIMEOUT: Duration = Duration::from_secs(180);

#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn poison_latest_passes_over_a_poisoned_checkpoint_and_says_why() {
    let cluster = Cluster::for_sluice();
    let node = "n1";
    let work = cluster.workdir("poison");
    let cli = cluster.user_cli();
    // A's checkpoints under the shared prefix (an allow rule without `{user}`): B may name the URL.
    let (a, b) = (cluster.user.clone(), cluster.other_user.clone());
    let a_uid = cluster.ids_of(&a).0;
    let u = unique();
    let archive = Path::new(cluster.var("SLUICE_TEST_ARCHIVE_ROOT")).join(format!("shared/po-{u}"));
    let url = format!("file://{}", archive.display());
    let args = [
        "-N1".to_string(),
        format!("--nodelist={node}"),
        format!("--ckpt-archive={url}"),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();

    // The training job: two saves, and step-2 is found bad at once.
    let save = format!(
        "#!/bin/bash\nset -e\nfor t in step-1 step-2; do\n  mkdir -p \"$SLUICE_CKPT_DIR/$t\"\n  \
         echo \"weights of $t {u}\" > \"$SLUICE_CKPT_DIR/$t/model.txt\"\n  {cli} ckpt commit $t\ndone\n\
         {cli} ckpt poison step-2 --reason 'loss is NaN at step 2'\n",
        cli = cli.display(),
    );
    let job = cluster.submit(&work, &args, &save);
    cluster.assert_completes(&job, JOB_TIMEOUT, "the job that saves and poisons");
    let said = job.output_text();
    assert!(
        said.contains(&format!(
            "poisoned step-2 in {url}: marked bad by {a} (uid {a_uid})"
        )),
        "the job's poison:\n{said}"
    );
    cluster.wait_for("both checkpoints' MANIFESTs", JOB_TIMEOUT, None, || {
        ["step-1", "step-2"]
            .iter()
            .all(|t| archive.join(t).join("MANIFEST").exists())
    });
    let mark: Value =
        serde_json::from_slice(&std::fs::read(archive.join("step-2/POISON")).unwrap()).unwrap();
    assert_eq!(
        (&mark["user"], &mark["uid"], &mark["reason"]),
        (
            &Value::from(a.as_str()),
            &Value::from(a_uid),
            &Value::from("loss is NaN at step 2")
        ),
        "{mark:#}"
    );

    // The other user, outside any job, through the agent: refused as not theirs, nothing written.
    let socket = cluster.agent_socket(node);
    let out = cluster.as_someone(
        &b,
        Path::new("/tmp"),
        cli.to_str().unwrap(),
        &[
            "--socket",
            socket.to_str().unwrap(),
            "ckpt",
            "poison",
            &url,
            "step-1",
            "--reason",
            "not yours",
        ],
        None,
    );
    assert!(
        out.status.code() == Some(1)
            && printed(&out).contains("no archived checkpoint step-1 of yours"),
        "{b} poisoning {a}'s step-1:\n{}",
        printed(&out)
    );
    assert!(
        !archive.join("step-1/POISON").exists(),
        "{b}'s refused poison wrote a mark"
    );

    // The next job: `latest` is step-1, and its output says why not step-2.
    let mut restore_args = args.clone();
    restore_args.push("--ckpt-restore=latest");
    let restore = "#!/bin/bash\nset -e\necho \"restored=$SLUICE_RESTORED_TAG\"\n\
                   cat \"$SLUICE_CKPT_DIR/$SLUICE_RESTORED_TAG/model.txt\"\n";
    let next = cluster.submit(&work, &restore_args, restore);
    cluster.assert_completes(&next, JOB_TIMEOUT, "the job restoring latest");
    let output = next.output_text();
    for part in [
        "restored=step-1\n".to_string(),
        format!("weights of step-1 {u}\n"),
        format!(
            "note: checkpoint step-2 in {url} is poisoned (marked bad by {a} (uid {a_uid}) at "
        ),
        ": loss is NaN at step 2); skipped it for the next newest".to_string(),
    ] {
        assert!(
            output.contains(&part),
            "{part:?} is not in the job's output:\n{output}"
        );
    }
    cluster.assert_nodes_return_idle(&next, Duration::from_secs(60));
}
