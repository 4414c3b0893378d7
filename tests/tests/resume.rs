//! Resumed staging (issue 11 item 6) as a user sees it: the agent of the job's node is SIGKILLed
//! while it stages a dataset and started again; the job completes with the whole dataset
//! byte-identical, and only what was not staged whole before the kill is read again.
//! - From S3 (Garage): counted on the origin's side by the relay in front of Garage, which the
//!   agents' `s3://datasets-relayed` store profile points at.
//! - From a POSIX directory, copied by the agent's copy helper as the job user: what an admin sees
//!   on the node — the files staged whole before the kill are still the same files (inode and
//!   ctime) in the job's stage directory, and the agent counts exactly their bytes as resumed.

use crate::common::*;
use nix::sys::signal::Signal;
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const NODE: &str = "n1";
const JOB_TIMEOUT: Duration = Duration::from_secs(300);
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(60);
/// 240 objects of 128 KiB: 30 MiB, about 10 s through the paced relay.
const OBJECTS: u64 = 240;
const OBJECT_SIZE: u64 = 128 << 10;
/// What the origin may send on top of object bytes per object: its listing entry and the
/// response headers of its GET.
const PER_OBJECT_OVERHEAD: u64 = 2048;

/// The restarted agent's record of the job's stage on [`NODE`].
fn restarted_stage(cluster: &Cluster, job: &Job) -> sluice_proto::msg::StageProgress {
    cluster
        .agent_job(NODE, job)
        .ok()
        .and_then(|s| s.stages.first().cloned())
        .unwrap_or_else(|| panic!("the restarted agent has no record of job {}", job.id))
}

/// The dataset to stage: `files` random files of `size` bytes spread over `dirs` directories
/// (`d{i % dirs}/{stem}-{i:03}.bin`) under the test's `train` directory, readable by everyone.
fn random_train_dir(
    cluster: &Cluster,
    test: &str,
    files: u64,
    dirs: u64,
    stem: &str,
    size: u64,
) -> PathBuf {
    let dir = cluster.data_dir(test).join("train");
    for i in 0..files {
        random_file(&dir.join(format!("d{}/{stem}-{i:03}.bin", i % dirs)), size);
    }
    run(Command::new("chmod").args(["-R", "u=rwX,go=rX"]).arg(&dir));
    dir
}

/// The job output says part of the dataset was kept across the restart, and the job left
/// nothing behind.
fn assert_says_resumed_and_cleans_up(cluster: &Cluster, job: &Job) {
    let output = job.output_text();
    assert!(
        output.contains("resumed from before the agent restarted"),
        "the job output does not say that part of the dataset was kept across the restart:\n{output}"
    );
    cluster.assert_job_left_nothing(job, CLEANUP_TIMEOUT);
}

/// A 1-node job stages 240 objects; once about a third are staged its node's agent is SIGKILLed
/// (the origin paced to a crawl first, so that the files staged whole are known and their log
/// lines written) and started again. The restarted agent keeps the files staged whole and reads
/// the rest: the job's data is byte-identical to the dataset, and the origin serves, after the
/// restart, less than the dataset minus what was whole before (with only listing and header
/// overhead on top of the missing files' bytes), so well under twice the dataset in all.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn resume_an_agent_killed_mid_stage_keeps_the_files_it_staged_whole() {
    let cluster = Cluster::for_s3();
    let dir = random_train_dir(&cluster, "resume", OBJECTS, 4, "obj", OBJECT_SIZE);
    let prefix = format!("resume-e2e/{}/train", unique());
    cluster.upload(&dir, "garage", &format!("datasets-relayed/{prefix}"));
    let sums = checksums(&dir);
    let dataset = OBJECTS * OBJECT_SIZE;

    let relay = cluster.origin_relay();
    relay.set_pace(3_000_000);
    let work = cluster.workdir("resume");
    let out = work.join("out");
    let stage_in = format!("--stage-in=ds=s3://datasets-relayed/{prefix}");
    let job = cluster.submit(
        &work,
        &["-N1", "-w", NODE, &stage_in],
        &listing_script(&out, &["ds"]),
    );
    cluster.wait_running(&job, Duration::from_secs(60));
    let files_done = || {
        cluster
            .agent_job(NODE, &job)
            .ok()
            .and_then(|s| s.stages.first().map(|p| p.files_done))
            .unwrap_or(0)
    };
    cluster.wait_for(
        "a third of the objects to be staged",
        Duration::from_secs(120),
        Some(&job),
        || files_done() >= OBJECTS / 3,
    );
    // The origin to a crawl: no file completes any more, and the agent's staging log gets the
    // lines of those that did (written within a second).
    relay.set_pace(1);
    std::thread::sleep(Duration::from_secs(3));
    let whole = files_done();
    assert!(
        whole < OBJECTS,
        "the dataset was staged before the agent could be killed"
    );
    let agent = cluster.kill_agent_and_its_ports(NODE);
    let before = relay.served();
    eprintln!(
        "[resume] killed the agent of {NODE} with {whole} of {OBJECTS} objects staged whole; the \
         origin had served {before} bytes of the {dataset}-byte dataset"
    );
    relay.set_pace(0);
    cluster.start_agent(&agent);
    cluster.assert_completes(
        &job,
        JOB_TIMEOUT,
        "the job whose agent was killed mid-stage",
    );
    let after = relay.served() - before;

    let got = task_file(&out, NODE, "sums-ds");
    let what = "the job whose agent was killed mid-stage got other bytes";
    cluster.assert_same_listing(&job, &sums, &got, what);
    let complete_before = whole * OBJECT_SIZE;
    eprintln!(
        "[resume] after the restart the origin served {after} bytes (the dataset less what was \
         whole before: {}); {} bytes in all ({:.2}x the dataset)",
        dataset - complete_before,
        before + after,
        (before + after) as f64 / dataset as f64
    );
    let overhead = OBJECTS * PER_OBJECT_OVERHEAD;
    assert!(
        after < dataset - complete_before + overhead,
        "after the restart the origin served {after} bytes: more than the {} bytes not staged \
         whole before the kill (and {overhead} bytes of listing and headers) — files staged \
         whole were read again\n{}",
        dataset - complete_before,
        cluster.evidence(&job)
    );
    let p = restarted_stage(&cluster, &job);
    assert_eq!(
        (p.resumed_bytes, p.bytes_done),
        (complete_before, dataset),
        "the restarted agent's count of the bytes it kept: {p:?}"
    );
    assert_says_resumed_and_cleans_up(&cluster, &job);
}

/// 600 files of 256 KiB (150 MiB), a few hundred of them read-only: long enough for the copy
/// helper to be stopped part way.
const POSIX_FILES: u64 = 600;
const POSIX_FILE_SIZE: u64 = 256 << 10;

/// The pid of the copy helper (`sluiced copy-as-user`) writing into `stage_ds`, if one runs.
fn copy_helper_of(stage_ds: &Path) -> Option<u32> {
    let want = stage_ds.as_os_str().as_encoded_bytes();
    fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let argv = fs::read(e.path().join("cmdline")).ok()?;
        let args: Vec<&[u8]> = argv.split(|b| *b == 0).collect();
        let helper = args.iter().any(|a| *a == b"copy-as-user")
            && args.windows(2).any(|w| w[0] == b"--dst" && w[1] == want);
        helper.then_some(pid)
    })
}

/// Signals `pid` at once: no `kill` process in between, whose start on a loaded machine can take
/// long enough for the helper to copy the whole dataset before it is stopped.
fn signal(pid: u32, sig: Signal) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), sig);
}

/// Files below `dir` of `size` bytes: path → (inode, ctime as `stat` prints it).
fn whole_files(dir: &Path, size: u64) -> BTreeMap<String, String> {
    let out = Command::new("find")
        .arg(dir)
        .args([
            "-type",
            "f",
            "-size",
            &format!("{size}c"),
            "-printf",
            "%P %i %C@\n",
        ])
        .output()
        .expect("find");
    identities(&String::from_utf8_lossy(&out.stdout))
}

/// `find -printf '%P %i %C@\n'` lines → path → identity (inode and ctime).
fn identities(listing: &str) -> BTreeMap<String, String> {
    sluice_e2e::split_pairs(listing.lines(), ' ')
}

/// A 1-node job stages a POSIX directory of 600 files; the agent's copy helper is held stopped
/// (SIGSTOP) once about a third are copied, and the agent is SIGKILLed and started again. The job
/// completes with the dataset byte-identical, every file the job user's with its source's mode; the
/// files that were whole before the kill and that the restarted agent kept are the very same
/// files (inode and ctime, as the job's task sees them) and at least one was kept; the agent counts
/// exactly their bytes as resumed and every other byte as read from the source, and the job's
/// output says part of the dataset was kept across the restart.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn resume_an_agent_killed_mid_copy_of_a_posix_dataset_keeps_the_files_copied_whole() {
    let cluster = Cluster::for_sluice();
    let src = random_train_dir(
        &cluster,
        "resume-posix",
        POSIX_FILES,
        6,
        "f",
        POSIX_FILE_SIZE,
    );
    run(Command::new("bash").arg("-c").arg(format!(
        "chmod 0444 '{}'/d0/* '{}'/d3/*",
        src.display(),
        src.display()
    )));
    let sums = checksums(&src);
    let modes = |dir: &Path| {
        run(Command::new("bash").arg("-c").arg(format!(
            "cd '{}' && find . -type f -printf '%m %P\\n' | LC_ALL=C sort",
            dir.display()
        )))
    };
    let src_modes = modes(&src);
    let dataset = POSIX_FILES * POSIX_FILE_SIZE;

    let work = cluster.workdir("resume-posix");
    let out = work.join("out");
    let stage_in = format!("--stage-in=ds={}", src.display());
    // The listing, then what the task sees of each staged file: mode, inode, ctime.
    let script = format!(
        "{}srun --ntasks-per-node=1 /bin/bash -c 'cd \"$SLUICE_STAGE_DIR/ds\" && find . -type f \
         -printf \"%m %P\\n\" | LC_ALL=C sort > \"{out}/$SLURMD_NODENAME/modes\" && find . -type f \
         -printf \"%P %i %C@\\n\" > \"{out}/$SLURMD_NODENAME/identities\"'\n",
        listing_script(&out, &["ds"]),
        out = out.display()
    );
    let job = cluster.submit(&work, &["-N1", "-w", NODE, &stage_in], &script);
    let stage_ds = cluster.job_dir(NODE, &job).join("stage/ds");

    // Catch the helper as it starts, then let it run a few milliseconds at a time until about a
    // third of the files are whole.
    let helper = poll_closely(
        Duration::from_millis(1),
        Duration::from_secs(120),
        || {
            let pid = copy_helper_of(&stage_ds)?;
            signal(pid, Signal::SIGSTOP);
            Some(pid)
        },
        || {
            format!(
                "the copy helper of job {} never started\n{}",
                job.id,
                cluster.evidence(&job)
            )
        },
    );
    let mut whole = whole_files(&stage_ds, POSIX_FILE_SIZE);
    while (whole.len() as u64) < POSIX_FILES / 3 {
        signal(helper, Signal::SIGCONT);
        std::thread::sleep(Duration::from_millis(5));
        signal(helper, Signal::SIGSTOP);
        whole = whole_files(&stage_ds, POSIX_FILE_SIZE);
    }
    assert!(
        (whole.len() as u64) < POSIX_FILES,
        "the dataset was copied before the helper could be stopped"
    );
    // The agent's staging log gets the lines of the files reported whole (written within a
    // second); then the agent dies, and its helper with it.
    std::thread::sleep(Duration::from_secs(3));
    let agent = cluster.kill_agent_and_its_ports(NODE);
    eprintln!(
        "[resume-posix] killed the agent of {NODE} with {} of {POSIX_FILES} files whole",
        whole.len()
    );
    cluster.start_agent(&agent);
    cluster.assert_completes(&job, JOB_TIMEOUT, "the job whose agent was killed mid-copy");

    let got = task_file(&out, NODE, "sums-ds");
    let what = "the job whose agent was killed mid-copy got other bytes";
    cluster.assert_same_listing(&job, &sums, &got, what);
    assert_eq!(
        task_file(&out, NODE, "modes"),
        src_modes,
        "the modes of the staged files"
    );
    cluster.assert_staged_owned_by_user(&out, NODE);
    let after = identities(&task_file(&out, NODE, "identities"));
    let kept: Vec<&String> = whole
        .iter()
        .filter(|(p, id)| after.get(*p) == Some(*id))
        .map(|(p, _)| p)
        .collect();
    eprintln!(
        "[resume-posix] {} of the {} files whole before the kill were kept",
        kept.len(),
        whole.len()
    );
    assert!(
        !kept.is_empty(),
        "none of the {} files copied whole before the kill was kept: every one is another file \
         now (inode or ctime)\n{}",
        whole.len(),
        cluster.evidence(&job)
    );
    let p = restarted_stage(&cluster, &job);
    let kept_bytes = kept.len() as u64 * POSIX_FILE_SIZE;
    assert_eq!(
        (p.bytes_done, p.resumed_bytes, p.origin_bytes),
        (dataset, kept_bytes, dataset - kept_bytes),
        "the restarted agent's counts: it kept exactly the files that are unchanged: {p:?}"
    );
    assert_says_resumed_and_cleans_up(&cluster, &job);
}
