//! Checkpoints are read by root (docs/SECURITY.md, "Who touches which files"): a job that plants
//! symbolic links and hard links in a checkpoint directory, pointing at a root-only file, and then
//! commits it, must not get that file's bytes into its archive. The agent walks the checkpoint
//! fd-relative with `O_NOFOLLOW`, checks every opened inode (regular file, the job user's, one link,
//! same file system) and refuses the whole checkpoint naming the entry; no MANIFEST is published.
//! A clean checkpoint of the same job is archived normally, so "nothing was uploaded" is not an
//! archive that never works. A refusal is final (F3): each refused checkpoint is walked once, never
//! retried, and goes from the hot tier at job end, while the archived one stays as retention says.

use crate::common::*;
use crate::security_support::*;
use sluice_proto::msg::{CkptState, CkptStatus};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};

const NODE: &str = "n3";

fn ckpts(cluster: &Cluster, job: &Job) -> Result<BTreeMap<String, CkptStatus>, String> {
    let list = cluster.agent_ckpts(NODE, job)?;
    Ok(list.into_iter().map(|c| (c.tag.clone(), c)).collect())
}

#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn security_symlinks_and_hardlinks_in_a_checkpoint_never_reach_the_archive() {
    let cluster = Cluster::for_s3();
    let (secret, secret_text) = root_secret(&cluster, "ckpt");
    let protected_hardlinks = std::fs::read_to_string("/proc/sys/fs/protected_hardlinks")
        .unwrap_or_default()
        .trim()
        == "1";
    let u = unique();
    let a = cluster.user.clone();
    let prefix = format!("{a}/sec-links-{u}");
    let archive = format!("s3://ckpt/{prefix}");
    let work = cluster.workdir("sec-ckpt-links");
    let out = work.join("out");
    let sluice = cluster.user_cli();
    let good_marker = format!("GOOD-CHECKPOINT-{u}");
    // t1: a symlink to the secret (and, where the kernel allows it, a hard link to it);
    // t2: a hard link to the user's own file (two links: refused, it could be anyone's);
    // t3: a symlink to a directory outside; t4: the checkpoint directory itself a symlink;
    // good: plain files only.
    let commits = format!(
        r#"set -u
o={out}; mkdir -p $o; c="$SLUICE_CKPT_DIR"
mkdir -p "$c/t1" && head -c 8192 /dev/urandom > "$c/t1/model.bin"
ln -s {secret} "$c/t1/link"
if ln {secret} "$c/t1/hard" 2>$o/hardlink-error; then echo made > $o/hardlink; else echo refused > $o/hardlink; fi
mkdir -p "$c/t2" && echo mine > "$c/own" && ln "$c/own" "$c/t2/own-link" && echo data > "$c/t2/a.bin"
mkdir -p "$c/t3" && ln -s {secret_dir} "$c/t3/dirlink"
ln -s {secret_dir} "$c/t4"
mkdir -p "$c/good/sub" && echo {good} > "$c/good/model.bin" && echo {good} > "$c/good/sub/opt.bin"
for t in t1 t2 t3 t4 good; do
  {sluice} ckpt commit $t > $o/commit-$t 2>&1; echo "exit $?" >> $o/commit-$t
done"#,
        out = out.display(),
        secret = secret.display(),
        secret_dir = secret.parent().unwrap().display(),
        good = good_marker,
        sluice = sluice.display(),
    );
    // Once its task has committed them all, the job waits until the test has looked.
    let archive_opt = format!("--ckpt-archive={archive}");
    let held = HeldJob::start(&cluster, &work, NODE, &[&archive_opt], &commits, "");
    let job = &held.job;

    // Wait until the clean checkpoint is archived and each hostile one has been refused.
    let deadline = Instant::now() + Duration::from_secs(120);
    let list = loop {
        let list = ckpts(&cluster, job);
        let settled = list.as_ref().is_ok_and(|l| {
            l.get("good")
                .is_some_and(|g| g.state == CkptState::Archived)
                && ["t1", "t2", "t3"]
                    .iter()
                    .all(|t| l.get(*t).is_some_and(|c| c.error.is_some()))
        });
        if settled || Instant::now() > deadline {
            break list;
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    // What the job's user sees: `sluice ckpt list` names the refused entries (asked again a few
    // times: between two attempts a retried checkpoint shows no error for a moment).
    let mut user_view = String::new();
    for _ in 0..10 {
        let out = cluster.as_user(
            &work,
            sluice.to_str().unwrap(),
            &[
                "--socket",
                cluster.agent_socket(NODE).to_str().unwrap(),
                "ckpt",
                "list",
                "--job",
                &job.id.to_string(),
            ],
            None,
        );
        user_view = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if ["link'", "own-link", "dirlink"]
            .iter()
            .all(|n| user_view.contains(n))
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(700));
    }
    let end = held.release(&cluster);

    let shown = format!("{list:#?}");
    let evidence = || {
        format!(
            "checkpoints: {shown}\nsluice ckpt list as {a}:\n{user_view}\n{}",
            cluster.evidence(job)
        )
    };
    let list = list.unwrap_or_else(|e| panic!("CkptList: {e}\n{}", evidence()));
    let mut failures = Vec::new();
    let expect_error = |tag: &str, needles: &[&str], failures: &mut Vec<String>| match list
        .get(tag)
        .and_then(|c| c.error.clone())
    {
        Some(e) if needles.iter().all(|n| e.contains(n)) => eprintln!("{tag}: {e}"),
        other => failures.push(format!(
            "{tag}: expected an error with {needles:?}, got {other:?}"
        )),
    };
    // The walk goes in name order: 'hard' (if the kernel let the job make it) before 'link'.
    let hardlink_made = std::fs::read_to_string(out.join("hardlink"))
        .unwrap_or_default()
        .trim()
        == "made";
    if hardlink_made {
        expect_error(
            "t1",
            &["'hard'", "owned by uid 0", "nothing was archived"],
            &mut failures,
        );
    } else {
        expect_error(
            "t1",
            &["'link'", "symbolic link", "nothing was archived"],
            &mut failures,
        );
    }
    expect_error("t2", &["own-link", "2 hard links"], &mut failures);
    expect_error("t3", &["dirlink", "symbolic link"], &mut failures);
    for t in ["t1", "t2", "t3"] {
        if list.get(t).is_some_and(|c| c.state == CkptState::Archived) {
            failures.push(format!("{t} is reported archived"));
        }
    }
    if list.get("good").map(|g| g.state) != Some(CkptState::Archived) {
        failures.push(format!(
            "the clean checkpoint was not archived: {:?}",
            list.get("good")
        ));
    }
    let commit_t4 = std::fs::read_to_string(out.join("commit-t4")).unwrap_or_default();
    if !commit_t4.contains("symlinks are not followed") || commit_t4.contains("exit 0") {
        failures.push(format!(
            "committing a symlinked checkpoint directory: {commit_t4}"
        ));
    }
    if list.contains_key("t4") {
        failures.push("t4 (a symlink) was recorded as a checkpoint".into());
    }
    for needle in ["link'", "own-link", "dirlink"] {
        if !user_view.contains(needle) {
            failures.push(format!("'sluice ckpt list' as {a} does not name {needle}"));
        }
    }
    // The kernel's protected_hardlinks stops the hard link to root's file before sluice sees it.
    let hardlink = std::fs::read_to_string(out.join("hardlink")).unwrap_or_default();
    if protected_hardlinks && hardlink.trim() != "refused" {
        failures.push(format!(
            "with fs.protected_hardlinks=1 the job still hard-linked the secret: {hardlink}"
        ));
    }

    // The bucket: only the clean checkpoint, with its MANIFEST; nothing of t1-t4; no secret bytes.
    let keys = cluster.list_objects("garage", &format!("ckpt/{prefix}"));
    let foreign: Vec<&String> = keys.iter().filter(|k| !k.starts_with("good/")).collect();
    if !foreign.is_empty() {
        failures.push(format!(
            "objects of refused checkpoints in {archive}: {foreign:?}"
        ));
    }
    if !keys.iter().any(|k| k == "good/MANIFEST") {
        failures.push(format!(
            "no MANIFEST for the clean checkpoint in {archive}: {keys:?}"
        ));
    }
    let download = tempdir_under(&cluster, "sec-ckpt-download");
    cluster.rclone_ok(&[
        "copy",
        &format!("garage:ckpt/{prefix}"),
        download.to_str().unwrap(),
    ]);
    let leaked = files_containing(&download, secret_text.trim().as_bytes());
    if !leaked.is_empty() {
        failures.push(format!(
            "the root-only secret's bytes are in the archive: {leaked:?}"
        ));
    }
    let manifest = std::fs::read_to_string(download.join("good/MANIFEST")).unwrap_or_default();
    if manifest.contains("link") || manifest.contains("secret") {
        failures.push(format!(
            "the clean checkpoint's MANIFEST names a link or the secret: {manifest}"
        ));
    }
    let _ = std::fs::remove_dir_all(&download);
    assert_secret_intact(&secret, &secret_text);
    // The job's output says what was refused and why, without the user asking (issue 10: every
    // refusal reaches the job's output): the batch step's end prints the node's summary once,
    // one line per refused checkpoint.
    let output = job.output_text();
    let summary: Vec<&str> = output
        .lines()
        .filter(|l| l.starts_with("sluice: "))
        .collect();
    let heads: Vec<&&str> = summary
        .iter()
        .filter(|l| l.contains(&format!("job {} on {NODE}: ", job.id)))
        .collect();
    if heads.len() != 1 || !heads[0].contains("1 of 4 checkpoint(s) archived") {
        failures.push(format!(
            "the job's output must hold one summary saying 1 of 4 checkpoints archived: {summary:#?}"
        ));
    }
    for (t, why) in [("t2", "own-link"), ("t3", "dirlink")] {
        let line = format!("sluice: checkpoint {t} is NOT archived: ");
        if !summary
            .iter()
            .any(|l| l.starts_with(&line) && l.contains(why))
        {
            failures.push(format!(
                "the job's output does not say that {t} is not archived ({why}): {summary:#?}"
            ));
        }
    }
    if !summary
        .iter()
        .any(|l| l.starts_with("sluice: checkpoint t1 is NOT archived: "))
    {
        failures.push(format!(
            "the job's output does not say that t1 is not archived: {summary:#?}"
        ));
    }

    assert!(
        failures.is_empty(),
        "{}\n{}",
        failures.join("\n"),
        evidence()
    );
    assert_eq!(end.state, "COMPLETED", "{}", evidence());
    cluster.assert_nodes_return_idle(job, Duration::from_secs(60));
    // F3: a refusal is final for that commit. After the job, the refused checkpoints are gone from
    // the hot tier with everything else that was not archived; the archived `good` checkpoint is
    // what retention keeps (--ckpt-keep defaults to 2, and it is the only archived one), exactly as
    // written; and each refused tag was walked once, never retried.
    let ckpt_dir = cluster.job_dir(NODE, job).join("ckpt");
    let kept_only = BTreeSet::from(["good".to_string()]);
    let deadline = Instant::now() + Duration::from_secs(90);
    while entries(&ckpt_dir) != kept_only && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_eq!(
        entries(&ckpt_dir),
        kept_only,
        "{}: after the job only the archived checkpoint retention keeps may stay\n{}",
        ckpt_dir.display(),
        evidence()
    );
    let kept = ckpt_dir.join("good");
    let kept_files = files_below(&kept);
    let expected = [
        ("model.bin".to_string(), format!("{good_marker}\n")),
        ("sub/opt.bin".to_string(), format!("{good_marker}\n")),
    ];
    assert_eq!(
        kept_files,
        expected.iter().cloned().collect::<BTreeMap<_, _>>(),
        "the kept checkpoint {} is not exactly what the job wrote\n{}",
        kept.display(),
        evidence()
    );
    // A retried refusal would show within a few seconds (the old backoff started at 2 s).
    std::thread::sleep(Duration::from_secs(5));
    let log = cluster.agent_log(NODE);
    let log_text = std::fs::read_to_string(&log).unwrap_or_default();
    for t in ["t1", "t2", "t3"] {
        let attempts: Vec<&str> = log_text
            .lines()
            .filter(|l| {
                // The checkpoint worker's lines (its tracing target is the module's path).
                l.contains("sluice_agent::ckpt")
                    && l.ends_with(&format!("job_id={} tag=\"{t}\"", job.id))
                    && (l.contains("nothing was archived") || l.contains("archive attempt failed"))
            })
            .collect();
        assert_eq!(
            attempts.len(),
            1,
            "{t} must be walked once and refused for good; {} shows: {attempts:#?}",
            log.display()
        );
    }
    let _ = std::fs::remove_file(&secret);
}

/// Every regular file below `dir`: relative path → content.
fn files_below(dir: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            let md = std::fs::symlink_metadata(&p).unwrap();
            if md.is_dir() {
                stack.push(p);
            } else {
                let rel = p.strip_prefix(dir).unwrap().to_string_lossy().into_owned();
                let text = if md.is_file() {
                    std::fs::read_to_string(&p).unwrap_or_else(|e| format!("<{e}>"))
                } else {
                    format!("<not a regular file: {:?}>", md.file_type())
                };
                out.insert(rel, text);
            }
        }
    }
    out
}

fn tempdir_under(cluster: &Cluster, name: &str) -> std::path::PathBuf {
    let d = Path::new(cluster.var("SLUICE_TEST_ROOT")).join(format!("{name}-{}", unique()));
    std::fs::create_dir_all(&d).unwrap();
    d
}
