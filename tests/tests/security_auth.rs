//! Authorisation on the agent socket (docs/SECURITY.md, "Authorisation"): user B (`sluiceother`)
//! asking the agent about, committing, ending or announcing user A's (`sluiceuser`) running job is
//! refused — through the `sluice` CLI and through hand-made frames on the raw socket — and none of
//! it changes A's job. The agent decides from the connection's `SO_PEERCRED`, never from a uid, user
//! or path inside the message, so a frame that claims to be root or A is refused too.

use crate::common::*;
use crate::security_support::*;
use serde_json::{Value, json};
use sluice_proto::msg::CkptState;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const JOB_TIMEOUT: Duration = Duration::from_secs(180);
const NODE: &str = "n1";

/// Every request a user might send about someone else's job, each as a raw frame.
fn requests_about(job_id: u32, a_uid: u32, a_user: &str) -> Value {
    let start = |uid: u32, user: &str| {
        json!({
            "op": "job_start", "job_id": job_id + 1000, "uid": uid, "gid": uid, "user": user,
            "node": NODE, "nodes": [NODE], "job_name": "forged",
            "options": [["stage-in", "/etc"]]
        })
    };
    json!([
        {"name": "job", "request": {"op": "job", "job_id": job_id}},
        {"name": "wait_staged", "request": {"op": "wait_staged", "job_id": job_id, "timeout_ms": 1000}},
        {"name": "ckpt_commit", "request": {"op": "ckpt_commit", "job_id": job_id, "tag": "t1"}},
        {"name": "ckpt_list", "request": {"op": "ckpt_list", "job_id": job_id}},
        {"name": "job_end", "request": {"op": "job_end", "job_id": job_id}},
        {"name": "job_start claiming A", "request": start(a_uid, a_user)},
        {"name": "job_start claiming root's job", "request": start(0, "root")},
        // Identity fields in the envelope or the request are not authority.
        {"name": "job with uid 0 in the body", "request": {"op": "job", "job_id": job_id, "uid": 0, "user": "root"}},
    ])
}

/// Runs a job of B's (the other user, who has no work directory) to its end: the job, its end, and
/// its output (whose file is removed).
fn run_as_other(
    cluster: &Cluster,
    test: &str,
    args: &[&str],
    script: &str,
) -> (Job, JobEnd, String) {
    let job = cluster.submit_as(&cluster.other_user, test, args, script);
    let end = cluster.wait_end(&job, JOB_TIMEOUT);
    let text = job.output_text();
    let _ = std::fs::remove_file(&job.output);
    (job, end, text)
}

#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn security_other_user_is_refused_everything_about_a_running_job() {
    let cluster = Cluster::for_sluice();
    let u = unique();
    let marker = format!("STAGED-FOR-A-{u}");
    let work = cluster.workdir("sec-auth");
    // A's job: stage a dataset, write an (uncommitted) checkpoint, wait for the test's "go", then
    // show that the staged data is still there and the checkpoint was not committed by anyone.
    let held = HeldJob::staging(
        &cluster,
        &work,
        NODE,
        ("hello.txt", marker.as_bytes()),
        r#"mkdir -p "$SLUICE_CKPT_DIR/t1" && echo weights > "$SLUICE_CKPT_DIR/t1/model.bin""#,
        r#"echo "staged: $(cat "$SLUICE_STAGE_DIR/ds/hello.txt")""#,
    );
    let job = &held.job;

    let (a, b) = (cluster.user.clone(), cluster.other_user.clone());
    let a_uid = cluster.ids_of(&a).0;
    let socket = cluster.agent_socket(NODE);
    let mut failures = Vec::new();

    // 1. The CLI, as B: refused with the agent's message, exit status non-zero.
    let sluice = cluster.user_cli();
    let sluice = sluice.to_str().unwrap();
    let sock = socket.to_str().unwrap();
    let id = job.id.to_string();
    for args in [
        vec!["job", id.as_str(), "--socket", sock],
        vec!["--socket", sock, "job", id.as_str(), "--json"],
        vec!["--socket", sock, "ckpt", "list", "--job", id.as_str()],
        vec![
            "--socket",
            sock,
            "ckpt",
            "commit",
            "t1",
            "--job",
            id.as_str(),
        ],
    ] {
        let out = cluster.as_someone(&b, Path::new("/"), sluice, &args, None);
        let stderr = String::from_utf8_lossy(&out.stderr);
        if out.status.success() || !stderr.contains("belongs to another user") {
            failures.push(format!(
                "CLI as {b}: sluice {args:?} was not refused: exit {:?}\nstdout: {}\nstderr: {stderr}",
                out.status.code(),
                String::from_utf8_lossy(&out.stdout)
            ));
        }
    }
    // `status` as B succeeds but shows none of A's jobs.
    let out = cluster.as_someone(
        &b,
        Path::new("/"),
        sluice,
        &["--socket", sock, "status", "--json"],
        None,
    );
    let status: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    let jobs = status["jobs"].as_array().cloned().unwrap_or_default();
    if !out.status.success()
        || jobs
            .iter()
            .any(|j| j["uid"] == a_uid || j["job_id"] == job.id)
    {
        failures.push(format!(
            "CLI as {b}: 'sluice status' shows A's jobs or failed (exit {:?}): {status}",
            out.status.code()
        ));
    }

    // 2. Raw frames, as B: every request about A's job is Forbidden.
    for r in raw_requests(&cluster, &b, &socket, requests_about(job.id, a_uid, &a)) {
        match r.error() {
            Some((code, _)) if code == "forbidden" => {}
            _ => failures.push(format!(
                "raw '{}' as {b} was not refused as forbidden: {}",
                r.name, r.value
            )),
        }
    }
    let status = raw_requests(
        &cluster,
        &b,
        &socket,
        json!([{"name": "status", "request": {"op": "status"}}]),
    );
    let reply = &status[0].value["reply"];
    let jobs = reply["jobs"].as_array().cloned().unwrap_or_default();
    if reply["result"] != "status" || jobs.iter().any(|j| j["uid"] == a_uid) {
        failures.push(format!("raw 'status' as {b} shows A's jobs: {reply}"));
    }
    // A frame of another protocol version is refused before anything else, with a clear message.
    let v2 = raw_requests(
        &cluster,
        &b,
        &socket,
        json!([{"name": "v2", "version": 2, "request": {"op": "job", "job_id": job.id}}]),
    );
    match v2[0].error() {
        Some((code, m)) if code == "bad_request" && m.contains("version 2 is not supported") => {}
        _ => failures.push(format!(
            "a version-2 frame was not refused as such: {}",
            v2[0].value
        )),
    }

    // 3. The same requests as A are answered (the refusals above are about B, not a broken agent),
    // and none of B's attempts changed A's job: still staged, checkpoint t1 not committed.
    let own = raw_requests(
        &cluster,
        &a,
        &socket,
        json!([
            {"name": "job", "request": {"op": "job", "job_id": job.id}},
            {"name": "ckpt_list", "request": {"op": "ckpt_list", "job_id": job.id}},
            {"name": "job_end as A", "request": {"op": "job_end", "job_id": job.id}},
        ]),
    );
    if own[0].result() != Some("job") || own[0].value["reply"]["state"] != "ready" {
        failures.push(format!("A's own 'job' request: {}", own[0].value));
    }
    match own[1].value["reply"]["ckpts"].as_array() {
        Some(c) if c.is_empty() => {}
        _ => failures.push(format!(
            "A's checkpoints after B's commit attempt (expected none): {}",
            own[1].value
        )),
    }
    // Ending a job is root's (the epilog's) alone, even for the job's owner.
    if own[2].error().map(|e| e.0) != Some("forbidden".into()) {
        failures.push(format!(
            "job_end as the job's owner was not refused: {}",
            own[2].value
        ));
    }

    let end = held.release(&cluster);
    let output = job.output_text();
    assert!(
        failures.is_empty(),
        "user {b} got further than it should with {a}'s job {}:\n{}\n{}",
        job.id,
        failures.join("\n"),
        cluster.evidence(job)
    );
    cluster.assert_ended(job, &end, "COMPLETED", "A's job");
    assert!(
        output.contains(&format!("staged: {marker}")),
        "A's staged data must survive B's job_end attempts:\n{}",
        cluster.evidence(job)
    );
    cluster.assert_job_left_nothing(job, Duration::from_secs(60));
}

/// The archive allow-list (`[[ckpt.allow]] prefix = "s3://ckpt/{user}/"`) is what keeps B out of A's
/// archive: archiving into it and restoring from it are refused at job start, the job fails with
/// the policy's message, nothing of A's reaches B's checkpoint directory, and no node drains.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn security_other_user_cannot_archive_into_or_restore_from_anothers_prefix() {
    let cluster = Cluster::for_s3();
    // sbatch accepts it: the refusal belongs to the agent, at job start.
    let victim = format!("s3://ckpt/{}/victim-{}", cluster.user, unique());
    let (job, end, text) = run_as_other(
        &cluster,
        "sec-restore",
        &[
            "-N1",
            &format!("--ckpt-archive={victim}"),
            "--ckpt-restore=latest",
        ],
        "#!/bin/bash\nls -la \"$SLUICE_CKPT_DIR\"\n",
    );
    cluster.assert_ended(&job, &end, "FAILED", "B's job into A's archive");
    assert!(
        text.contains("not allowed by the site's policy")
            && text.contains(&format!("s3://ckpt/{}/", cluster.other_user)),
        "the job output must say the archive is not allowed and what is:\n{text}"
    );
    cluster.assert_job_left_nothing(&job, Duration::from_secs(60));
}

/// Open finding F1 (docs/SECURITY.md): object-store stage-in is not authorised per user. The agent
/// reads `--stage-in` URLs with its own store credentials, and those also reach the checkpoint
/// archives of every user, so B can stage A's archived checkpoint objects into B's job. Asserts
/// the behaviour we want: B's job is refused and never sees A's bytes.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn security_other_user_cannot_stage_in_anothers_archive() {
    let cluster = Cluster::for_s3();
    let (a, b) = (cluster.user.clone(), cluster.other_user.clone());
    let u = unique();
    // Where A's checkpoints go under the site's policy (s3://ckpt/{user}/...): an object of A's.
    let secret = format!("A-PRIVATE-CHECKPOINT-BYTES-{u}");
    let key = format!("{a}/f1-{u}/step-1/data/model.bin");
    cluster.put_object("ckpt", &key, secret.as_bytes());
    let (job, end, text) = run_as_other(
        &cluster,
        "sec-f1",
        &["-N1", &format!("--stage-in=loot=s3://ckpt/{a}/f1-{u}")],
        "#!/bin/bash\nsrun -n1 bash -c 'find \"$SLUICE_STAGE_DIR\" -type f -exec cat {} +'\n",
    );
    assert!(
        !text.contains(&secret),
        "user {b} staged user {a}'s archive object s3://ckpt/{key} (job {} ended {}):\n{text}",
        job.id,
        end.state
    );
    cluster.assert_ended(&job, &end, "FAILED", "B's stage-in of A's archive");
    cluster.assert_nodes_return_idle(&job, Duration::from_secs(60));
}

/// F2 (docs/SECURITY.md): restore gives a job only its own user's checkpoints. Under an allow rule
/// without `{user}` — the harness's `file:///var/lib/sluice-test/archive/shared/` — A and B archive
/// into one prefix. B's `--ckpt-restore=latest` and B's request for A's tag both fail B's job with the
/// reason, never with A's bytes; B's attempt to commit a checkpoint under A's tag is refused (A's
/// stays intact); and A's `latest` restores A's own checkpoint, not the newer one B published there.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn security_other_user_cannot_restore_anothers_checkpoint_from_a_shared_prefix() {
    let cluster = Cluster::for_sluice();
    let (a, b) = (cluster.user.clone(), cluster.other_user.clone());
    let u = unique();
    let url = format!(
        "file://{}/shared/f2-{u}",
        cluster.var("SLUICE_TEST_ARCHIVE_ROOT")
    );
    let secret = format!("A-CHECKPOINT-{u}");
    let b_secret = format!("B-CHECKPOINT-{u}");
    let sluice = cluster.user_cli();
    let work = cluster.workdir("sec-f2");
    let archived = |job: &Job, tag: &str| {
        cluster
            .agent_ckpt(NODE, job, tag)
            .is_some_and(|c| c.state == CkptState::Archived)
    };
    let archive_opt = format!("--ckpt-archive={url}");
    let a_job = HeldJob::start(
        &cluster,
        &work,
        NODE,
        &[&archive_opt],
        &format!(
            "mkdir -p \"$SLUICE_CKPT_DIR/s1\" && echo {secret} > \"$SLUICE_CKPT_DIR/s1/model.bin\"\n\
             {} ckpt commit s1",
            sluice.display()
        ),
        "",
    );
    cluster.wait_for(
        "A's checkpoint to be archived",
        JOB_TIMEOUT,
        Some(&a_job.job),
        || archived(&a_job.job, "s1"),
    );
    a_job.release(&cluster);

    // B's jobs, on the same node, into the same archive.
    let nodelist = format!("--nodelist={NODE}");
    let b_args = ["-N1", nodelist.as_str(), archive_opt.as_str()];
    let cat = "#!/bin/bash\nsrun -n1 bash -c 'cat \"$SLUICE_CKPT_DIR\"/*/model.bin'\n";

    // B asks for the newest checkpoint of the shared prefix, then for A's by its tag.
    let cases = [
        (
            "--ckpt-restore=latest",
            format!("--ckpt-restore=latest: no checkpoint of yours in {url}"),
            "archived by other users (s1)".to_string(),
        ),
        (
            "--ckpt-restore=s1",
            format!("checkpoint s1 in {url} was archived by user {a}, not by {b}"),
            "sluice restores only your own checkpoints".to_string(),
        ),
    ];
    for (option, reason, detail) in cases {
        let (b_job, end, text) =
            run_as_other(&cluster, "sec-f2", &[&b_args[..], &[option]].concat(), cat);
        assert!(
            !text.contains(&secret),
            "user {b} restored user {a}'s checkpoint from {url} with {option} (job {} ended {}):\n{text}",
            b_job.id,
            end.state
        );
        cluster.assert_ended(&b_job, &end, "FAILED", option);
        assert!(
            text.contains(&reason) && text.contains(&detail),
            "{option}: the job output must say whose checkpoint it is and what to do:\n{text}"
        );
        cluster.assert_hot_tier_cleaned(&b_job, Duration::from_secs(60));
    }

    // B archives into the same prefix: its newer s2 is published; its own s1 would overwrite A's
    // and is refused.
    let b_go = format!("/tmp/sluice-sec-f2-{u}.go");
    let b_script = format!(
        r#"#!/bin/bash
srun -N1 -n1 bash -c '
for t in s1 s2; do mkdir -p "$SLUICE_CKPT_DIR/$t" && echo {b_secret} > "$SLUICE_CKPT_DIR/$t/model.bin"; done
{sluice} ckpt commit s1
{sluice} ckpt commit s2
for i in $(seq 600); do [ -e {b_go} ] && break; sleep 0.2; done
'
"#,
        sluice = sluice.display(),
    );
    let b_job = cluster.submit_as(&b, "sec-f2", &b_args, &b_script);
    cluster.wait_for("B's s2 to be archived", JOB_TIMEOUT, Some(&b_job), || {
        archived(&b_job, "s2")
    });
    let b_s1 = cluster.agent_ckpt(NODE, &b_job, "s1").expect("B's s1");
    assert!(
        b_s1.state != CkptState::Archived
            && b_s1.error.as_deref().is_some_and(|e| e.contains(&format!(
                "was archived by user {a}; sluice does not overwrite another user's checkpoint"
            ))),
        "B's s1 over A's: {b_s1:?}"
    );
    std::fs::write(&b_go, b"").unwrap();
    cluster.wait_end(&b_job, JOB_TIMEOUT);
    let _ = std::fs::remove_file(&b_go);
    let _ = std::fs::remove_file(&b_job.output);

    // A's `latest` restores A's s1, intact, not B's newer s2, and says it skipped it.
    let a_restore = cluster.submit(
        &work,
        &[
            "-N1",
            &format!("--ckpt-archive={url}"),
            "--ckpt-restore=latest",
        ],
        "#!/bin/bash\nsrun -n1 bash -c 'echo \"tag=$SLUICE_RESTORED_TAG\"; cat \"$SLUICE_CKPT_DIR\"/*/model.bin'\n",
    );
    cluster.assert_completes(&a_restore, JOB_TIMEOUT, "A's restore job");
    let text = a_restore.output_text();
    assert!(
        text.contains("tag=s1") && text.contains(&secret) && !text.contains(&b_secret),
        "A's latest must restore A's own s1:\n{text}"
    );
    assert!(
        text.contains(&format!(
            "skipped 1 checkpoint(s) in {url} archived by other users (s2)"
        )),
        "A's job output must say which checkpoint of another user it skipped:\n{text}"
    );
}

/// Issue 24, findings 1 and 8: a step's frame cannot make the agent act as another user, nor stage
/// for a job that does not run. B (`sluiceother`) holds n1 with a job that has no sluice options,
/// so the agent learns of it only from a step; B's hand-made step frame claims to be A with A's
/// group, to stage a directory only A's group may read. The agent stages as B — Slurm's uid and
/// gid, NSS's name — so the step is refused with a permission error and nothing of A's reaches B's
/// job. Before, the copy helper ran `initgroups(A)`/`setresgid(A's gid)` from the frame and staged
/// A's file into B's job. B's held (pending) job gets nothing staged at all.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn security_a_step_stages_only_as_its_job_user_and_only_for_a_running_job() {
    use std::os::unix::fs::PermissionsExt;
    let cluster = Cluster::for_sluice();
    let (a, b) = (cluster.user.clone(), cluster.other_user.clone());
    let (a_uid, a_gid) = cluster.ids_of(&a);
    let (b_uid, _) = cluster.ids_of(&b);
    let marker = format!("A-GROUP-ONLY-{}", unique());
    let private = cluster.data_dir("sec-step-identity").join("private");
    std::fs::create_dir(&private).unwrap();
    std::fs::write(private.join("secret"), &marker).unwrap();
    for (p, mode) in [(&private, 0o750), (&private.join("secret"), 0o640)] {
        std::os::unix::fs::chown(p, Some(a_uid), Some(a_gid)).unwrap();
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    let running = cluster.submit_as(
        &b,
        "sec-step-id",
        &["-N1", &format!("--nodelist={NODE}")],
        "#!/bin/bash\nsleep 300\n",
    );
    cluster.wait_running(&running, JOB_TIMEOUT);
    let held = cluster.submit_as(
        &b,
        "sec-step-id-held",
        &["-N1", "--hold"],
        "#!/bin/bash\ntrue\n",
    );
    let step = |job_id: u32| {
        json!({
            "op": "wait_staged", "job_id": job_id, "timeout_ms": 60000,
            "step": {"step_id": 0, "start": {
                "job_id": job_id, "uid": b_uid, "gid": a_gid, "user": a, "node": NODE,
                "nodes": [NODE], "job_name": "forged",
                "options": [["stage-in", format!("ds={}", private.display())]]
            }}
        })
    };
    let replies = raw_requests(
        &cluster,
        &b,
        &cluster.agent_socket(NODE),
        json!([
            {"name": "a step claiming A's identity", "request": step(running.id), "timeout": 90},
            {"name": "a step of a held job", "request": step(held.id), "timeout": 90},
        ]),
    );
    let leaked = files_containing(&cluster.job_dir(NODE, &running), marker.as_bytes());
    for id in [running.id, held.id] {
        let _ = Command::new("scancel").arg(id.to_string()).status();
    }
    assert!(
        leaked.is_empty(),
        "A's group-only file was staged into B's job: {leaked:?}"
    );
    match replies[0].error() {
        Some((_, m)) if m.contains("ermission denied") => {}
        _ => panic!(
            "the step claiming A's identity was not refused for want of B's own permission: {}",
            replies[0].value
        ),
    }
    match replies[1].error() {
        Some((code, m)) if code == "forbidden" && m.contains("PENDING") => {}
        _ => panic!(
            "a step of B's held job was not refused as not running: {}",
            replies[1].value
        ),
    }
    assert!(
        !cluster.job_dir(NODE, &held).exists(),
        "a job directory was made for B's held job"
    );
    // The agent ends the job it learnt of from the step once Slurm no longer runs it.
    cluster.wait_end(&running, JOB_TIMEOUT);
    cluster.assert_hot_tier_cleaned(&running, Duration::from_secs(120));
}
