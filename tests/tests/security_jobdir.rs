//! Job directories on the hot tier (docs/SECURITY.md, "Who touches which files"): the agent creates
//! `<hot>/jobs/<id>` with `mkdirat` under `jobs/`, which is root's and mode 0711, and chowns through
//! the opened fd. So another user can neither pre-create a job's directory (or plant a symlink in its
//! place) before the job starts, nor list `jobs/` to learn job ids, nor enter a running job's
//! directory (0700, the job user's). The job itself runs normally.

use crate::common::*;
use crate::security_support::*;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const NODE: &str = "n1";

/// Runs `script` with bash as `user`; returns (exit status 0, stdout + stderr).
fn try_as(cluster: &Cluster, user: &str, script: &str) -> (bool, String) {
    let out = cluster.as_someone(user, Path::new("/"), "/bin/bash", &["-c", script], None);
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// The highest job id Slurm remembers (0 if none).
fn last_job_id() -> u32 {
    let out = run(Command::new("squeue").args(["-h", "-t", "all", "-o", "%i"]));
    out.lines()
        .filter_map(|l| l.trim().split('_').next()?.parse().ok())
        .max()
        .unwrap_or(0)
}

#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn security_other_user_cannot_precreate_or_enter_job_directories() {
    let cluster = Cluster::for_sluice();
    let (a, b) = (cluster.user.clone(), cluster.other_user.clone());
    let jobs = cluster.hot_root(NODE).join("jobs");
    assert_eq!(owner_mode(&jobs), "root 711", "{}", jobs.display());
    let mut failures = Vec::new();

    // Before the job: B tries to take the next job ids' directories, as a directory of its own and
    // as a symlink to somewhere it wants root to write, and to list the existing ones.
    let next = last_job_id() + 1;
    let candidates: Vec<u32> = (next..next + 20).collect();
    for id in &candidates {
        let dir = jobs.join(id.to_string());
        for (what, cmd) in [
            ("mkdir", format!("mkdir '{}'", dir.display())),
            ("symlink", format!("ln -s /etc '{}'", dir.display())),
            ("file", format!("touch '{}'", dir.display())),
        ] {
            let (ok, text) = try_as(&cluster, &b, &cmd);
            if ok || !text.contains("Permission denied") {
                failures.push(format!(
                    "{b}: {what} {} was not denied: {text}",
                    dir.display()
                ));
            }
        }
        if std::fs::symlink_metadata(&dir).is_ok() {
            failures.push(format!("{} exists after {b}'s attempts", dir.display()));
        }
    }
    let (ok, text) = try_as(&cluster, &b, &format!("ls '{}'", jobs.display()));
    if ok || !text.contains("Permission denied") {
        failures.push(format!("{b} may list {}: {text}", jobs.display()));
    }

    // A's job, staged and running.
    let work = cluster.workdir("sec-jobdir");
    let held = HeldJob::staging(
        &cluster,
        &work,
        NODE,
        ("private.txt", b"A's staged data\n"),
        &format!(
            r#"stat -c "%U %a" "$SLUICE_STAGE_DIR/.." > {w}/jobdir
stat -c "%U %a" "$SLUICE_STAGE_DIR" "$SLUICE_CKPT_DIR" > {w}/subdirs
cat "$SLUICE_STAGE_DIR/ds/private.txt" > {w}/staged"#,
            w = work.display()
        ),
        "",
    );
    let job = &held.job;
    if !candidates.contains(&job.id) {
        eprintln!(
            "note: job {} was not among the ids {b} tried ({}..{}); its attempts were all denied anyway",
            job.id,
            candidates[0],
            candidates[candidates.len() - 1]
        );
    }
    let dir = cluster.job_dir(NODE, job);
    // While it runs, B cannot enter, read or add to it.
    for (what, cmd) in [
        ("list the job directory", format!("ls '{}'", dir.display())),
        (
            "read a staged file",
            format!("cat '{}/stage/ds/private.txt'", dir.display()),
        ),
        (
            "create in the checkpoint directory",
            format!("mkdir '{}/ckpt/planted'", dir.display()),
        ),
        (
            "plant a symlink in the job directory",
            format!("ln -s /etc '{}/planted'", dir.display()),
        ),
    ] {
        let (ok, text) = try_as(&cluster, &b, &cmd);
        if ok || !text.contains("Permission denied") {
            failures.push(format!("{b} could {what}: {text}"));
        }
    }
    let end = held.release(&cluster);
    let read = |n: &str| std::fs::read_to_string(work.join(n)).unwrap_or_default();
    assert!(
        failures.is_empty(),
        "{}\n{}",
        failures.join("\n"),
        cluster.evidence(job)
    );
    cluster.assert_ended(job, &end, "COMPLETED", "A's job");
    assert_eq!(
        read("jobdir").trim(),
        format!("{a} 700"),
        "the job directory"
    );
    assert_eq!(
        read("subdirs").trim(),
        format!("{a} 755\n{a} 755"),
        "stage and ckpt directories"
    );
    assert_eq!(read("staged"), "A's staged data\n");
    cluster.assert_job_left_nothing(job, Duration::from_secs(60));
    assert_eq!(owner_mode(&jobs), "root 711", "jobs/ after the job");
}
