//! Users reach their own archives without root (issue 14, item 6): outside any job, the test user
//! lists, verifies and restores a checkpoint their job archived, with `sluice ckpt … URL` run as
//! them — the agent's configuration (and the archive directory) are root's, so the CLI asks the
//! node's agent — and the other test user, asking the agent about the same URL, sees none of it
//! and restores none of it.

use crate::common::*;
use serde_json::Value;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Output;
use std::time::Duration;

const JOB_TIMEOUT: Duration = Duration::from_secs(180);
const NODE: &str = "n1";

/// A user's job archives a checkpoint into the harness's shared prefix (an allow rule without
/// `{user}`, so the other user may name the same URL); then, as that user and not root, `sluice
/// ckpt list URL` shows it, `verify` passes and `restore` gives back byte-identical files owned by
/// the user; the other user's list shows none of it, and their verify and restore are refused
/// (as if it were not there), leaving their directory as it was.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn user_archive_a_user_reaches_their_own_checkpoints_and_not_anothers() {
    let cluster = Cluster::for_sluice();
    let (a, b) = (cluster.user.clone(), cluster.other_user.clone());
    let (a_uid, _) = cluster.ids_of(&a);
    let u = unique();
    let root = cluster.var("SLUICE_TEST_ARCHIVE_ROOT").to_string();
    let url = format!("file://{root}/shared/ua-{u}");
    let work = cluster.workdir("user-archive");
    let sluice = cluster.user_cli();
    let socket = cluster.agent_socket(NODE);

    // What the checkpoint holds: a file in a subdirectory, a larger one, an empty one.
    let src = work.join("src");
    std::fs::create_dir_all(src.join("opt")).unwrap();
    let big: Vec<u8> = (0..3_000_000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let files: Vec<(&str, Vec<u8>)> = vec![
        ("model.bin", big),
        (
            "opt/state.json",
            format!("{{\"step\": 7, \"run\": \"{u}\"}}").into_bytes(),
        ),
        ("empty", Vec::new()),
    ];
    for (name, data) in &files {
        std::fs::write(src.join(name), data).unwrap();
    }
    run(std::process::Command::new("chown")
        .args(["-R", &a])
        .arg(&src));

    let go = work.join("go");
    let script = format!(
        "#!/bin/bash\nset -e\nmkdir -p \"$SLUICE_CKPT_DIR/s1\"\n\
         cp -r {src}/. \"$SLUICE_CKPT_DIR/s1/\"\n{cli} ckpt commit s1\n\
         for i in $(seq 600); do [ -e {go} ] && break; sleep 0.2; done\n",
        src = src.display(),
        cli = sluice.display(),
        go = go.display(),
    );
    let job = cluster.submit(
        &work,
        &[
            "-N1",
            &format!("--nodelist={NODE}"),
            &format!("--ckpt-archive={url}"),
        ],
        &script,
    );
    cluster.wait_for(
        "the checkpoint to be archived",
        JOB_TIMEOUT,
        Some(&job),
        || {
            cluster
                .agent_ckpt(NODE, &job, "s1")
                .is_some_and(|c| c.state == sluice_proto::msg::CkptState::Archived)
        },
    );
    std::fs::write(&go, b"").unwrap();
    cluster.assert_completes(&job, JOB_TIMEOUT, "the archiving job");

    let sock = socket.to_str().unwrap().to_string();
    let cli_as = |user: &str, cwd: &Path, args: &[&str]| -> Output {
        let mut all = vec!["--socket", sock.as_str()];
        all.extend_from_slice(args);
        cluster.as_someone(user, cwd, sluice.to_str().unwrap(), &all, None)
    };

    // The archive is root's and so is the configuration: only the agent can read them for A.
    let denied = cluster.as_user(&work, "cat", &["/etc/sluice/sluice.toml"], None);
    assert!(
        !denied.status.success(),
        "the test user can read the agent's configuration: this test would prove nothing"
    );

    // A lists the archive: s1, theirs, complete.
    let out = cli_as(&a, &work, &["ckpt", "list", &url]);
    let shown = printed(&out);
    assert!(out.status.success(), "{a}'s list of {url}:\n{shown}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("s1") && !shown.contains("Permission denied"),
        "{a}'s list of {url} must show s1:\n{shown}"
    );
    let out = cli_as(&a, &work, &["ckpt", "list", &url, "--json"]);
    assert!(out.status.success(), "{}", printed(&out));
    let listing: Value = serde_json::from_slice(&out.stdout).unwrap();
    let ckpts = listing["ckpts"].as_array().unwrap();
    assert_eq!(ckpts.len(), 1, "{listing:#}");
    assert_eq!(ckpts[0]["tag"], "s1", "{listing:#}");
    assert_eq!(ckpts[0]["state"], "complete", "{listing:#}");
    assert_eq!(ckpts[0]["job"]["user"], a.as_str(), "{listing:#}");
    assert_eq!(ckpts[0]["job"]["job_id"], job.id, "{listing:#}");
    assert_eq!(ckpts[0]["files"], files.len() as u64, "{listing:#}");

    // A verifies it (by tag and as `latest`).
    for tag in ["s1", "latest"] {
        let out = cli_as(&a, &work, &["ckpt", "verify", &url, tag]);
        let shown = printed(&out);
        assert!(
            out.status.success() && shown.contains("checkpoint s1 at") && shown.contains(": OK"),
            "{a}'s verify {tag}:\n{shown}"
        );
    }

    // A restores it into a new directory of theirs: the same bytes, every file A's.
    let dest = work.join("restored");
    let out = cli_as(
        &a,
        &work,
        &["ckpt", "restore", &url, "s1", dest.to_str().unwrap()],
    );
    let shown = printed(&out);
    assert!(
        out.status.success() && shown.contains("restored s1 from"),
        "{a}'s restore:\n{shown}"
    );
    for (name, data) in &files {
        let p = dest.join(name);
        let got = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}\n{shown}", p.display()));
        assert!(
            got == *data,
            "{} differs from what the job archived",
            p.display()
        );
        let owner = std::fs::symlink_metadata(&p).unwrap().uid();
        assert_eq!(owner, a_uid, "{} is not owned by {a}", p.display());
    }
    let sub = std::fs::metadata(dest.join("opt")).unwrap();
    assert_eq!(sub.uid(), a_uid, "the restored subdirectory is not {a}'s");
    // A non-empty destination is refused, and left as it was.
    let out = cli_as(
        &a,
        &work,
        &["ckpt", "restore", &url, "s1", dest.to_str().unwrap()],
    );
    assert!(
        !out.status.success() && printed(&out).contains("is not empty"),
        "{}",
        printed(&out)
    );
    assert_eq!(std::fs::read(dest.join("model.bin")).unwrap(), files[0].1);

    // B names the same URL: it is allowed to (a shared prefix), but A's checkpoint is not B's.
    let b_work = std::path::PathBuf::from(format!("/tmp/sluice-ua-{u}-b"));
    let mkdir = cluster.as_someone(
        &b,
        Path::new("/tmp"),
        "mkdir",
        &[b_work.to_str().unwrap()],
        None,
    );
    assert!(mkdir.status.success(), "{}", printed(&mkdir));
    let out = cli_as(&b, &b_work, &["ckpt", "list", &url, "--json"]);
    assert!(
        out.status.success(),
        "{b}'s list of {url}:\n{}",
        printed(&out)
    );
    let listing: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        listing["ckpts"].as_array().map(Vec::len),
        Some(0),
        "{b} sees {a}'s checkpoint: {listing:#}"
    );
    let out = cli_as(&b, &b_work, &["ckpt", "list", &url]);
    assert!(
        out.status.success() && !String::from_utf8_lossy(&out.stdout).contains("s1"),
        "{b}'s list of {url}:\n{}",
        printed(&out)
    );
    for tag in ["s1", "latest"] {
        let out = cli_as(&b, &b_work, &["ckpt", "verify", &url, tag]);
        let shown = printed(&out);
        assert!(
            !out.status.success() && shown.contains("of yours") && !shown.contains(": OK"),
            "{b}'s verify {tag} of {a}'s checkpoint:\n{shown}"
        );
        let b_dest = b_work.join(format!("got-{tag}"));
        let out = cli_as(
            &b,
            &b_work,
            &["ckpt", "restore", &url, tag, b_dest.to_str().unwrap()],
        );
        let shown = printed(&out);
        assert!(
            !out.status.success() && shown.contains("of yours"),
            "{b}'s restore {tag} of {a}'s checkpoint:\n{shown}"
        );
        assert!(
            !b_dest.exists(),
            "{b}'s refused restore left {} behind:\n{shown}",
            b_dest.display()
        );
    }
    // And A's own prefix is not B's to name at all (the allow rules, `{user}` for B).
    let a_private = format!("file://{root}/{a}/ua-{u}");
    let out = cli_as(&b, &b_work, &["ckpt", "list", &a_private]);
    let shown = printed(&out);
    assert!(
        !out.status.success()
            && shown.contains("not an archive location")
            && shown.contains(&format!("/{b}/")),
        "{b}'s list of {a}'s prefix:\n{shown}"
    );

    let _ = std::fs::remove_dir_all(&b_work);
    cluster.assert_nodes_return_idle(&job, Duration::from_secs(60));
}
