//! A job requeued with the same job id (issue 4: "a job requeued with the same id → staging and
//! archiving are idempotent"), as a user of `sbatch --requeue` sees it.
//!
//! One 2-node job is submitted with `--requeue`, a dataset from Garage (`--stage-in`), an archive
//! (`--ckpt-archive`), `--ckpt-keep=1` and `--ckpt-restore=latest`; its output file is opened in
//! append mode so that it shows both runs. A small seed job archives `s0` first, so that run 1 has a
//! checkpoint to restore (on an empty archive `latest` starts the job fresh with a note), and a
//! requeued job keeps the options of its first run.
//!
//! Run 1 checks its staged dataset (sha256) and that `s0` was restored, writes checkpoint `s1` on each
//! node, commits it, waits until its node's agent reports it archived, then leaves what a run killed
//! mid-way leaves: a modified staged file, an extra file in the stage directory and a torn,
//! uncommitted checkpoint directory. The test requeues it (`scontrol requeue`) and lets it start
//! again at once (Slurm gives a requeued job a begin time in the future).
//!
//! Run 2 (same job id, `SLURM_RESTART_COUNT=1`) must find the dataset staged again, whole and
//! identical (nothing of run 1 left), `SLUICE_RESTORED_TAG=s1` with `s1` byte-identical to what run 1
//! wrote and nothing else in `$SLUICE_CKPT_DIR`; it writes and commits `s2` and ends.
//!
//! Then: the job COMPLETED after one restart; the archive holds each checkpoint's objects exactly
//! once (`s1` untouched by run 2, `s2` shaped like `s1`, no open multipart upload); `sluice ckpt
//! restore` of `s1` and `s2` gives what was written; each node's hot tier holds exactly `s2` (what
//! `--ckpt-keep=1` keeps) as that node wrote it, and the agents' journals say so; every node is idle.

use crate::common::*;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Seed job: one small checkpoint, archived.
const SEED_TIMEOUT: Duration = Duration::from_secs(120);
/// Run 1 until its checkpoint is archived and it waits to be requeued.
const RUN1_TIMEOUT: Duration = Duration::from_secs(180);
/// From `scontrol requeue` until run 2 runs: the epilogs (the agents wait up to `epilog_wait`,
/// 20 s here) and Slurm's own requeue steps.
const REQUEUE_TIMEOUT: Duration = Duration::from_secs(200);
/// Run 2 from its start to its end (stage, restore, one checkpoint archived).
const RUN2_TIMEOUT: Duration = Duration::from_secs(180);
/// Finalisation on the hot tiers after the job left COMPLETING.
const HOT_TIMEOUT: Duration = Duration::from_secs(60);

/// One task per node, for the seed job (`seed`) and both runs of the requeued job (`1`, `2`). It
/// records under `<work>/out/<run>/<node>/`: `env`, `restored` (SLUICE_RESTORED_TAG), `ckpt-ls`
/// (entries of $SLUICE_CKPT_DIR at start), `restored-sums` (sha256 of the restored checkpoint),
/// `stage-ls`, `sums-ds`, `dirs-ds` (the staged dataset), `sums-TAG` (what it wrote), `leftovers`
/// (run 1: what it left behind for run 2), `events`, and `ready` (run 1: waiting to be requeued) or
/// `done`.
const TASK_PY: &str = r#"
import hashlib, json, os, subprocess, sys, time

W, RUN, CLI = sys.argv[1], sys.argv[2], sys.argv[3]
RANK = int(os.environ["SLURM_PROCID"])
NTASKS = int(os.environ["SLURM_NTASKS"])
NODE = os.environ["SLURMD_NODENAME"]
CKPT = os.environ["SLUICE_CKPT_DIR"]
STAGE = os.environ.get("SLUICE_STAGE_DIR", "")
OUT = os.path.join(W, "out", RUN, NODE)
os.makedirs(OUT, exist_ok=True)
DEADLINE = time.monotonic() + 150
SUMS = "find . -type f -print0 | LC_ALL=C sort -z | xargs -0 -r sha256sum"
DIRS = "find . -mindepth 1 -type d | LC_ALL=C sort"


WHO = f"task.py run {RUN} rank {RANK}"
# sluice-e2e: log, fail


def record(name, text):
    with open(os.path.join(OUT, name), "w") as f:
        f.write(text)


def sh(cmd, cwd):
    try:
        p = subprocess.run(["bash", "-c", cmd], cwd=cwd, capture_output=True, text=True)
    except OSError as e:
        return f"{cwd}: {e}\n"
    return p.stdout + p.stderr


def cli(*args):
    p = subprocess.run([CLI, *args], capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        fail(f"sluice {' '.join(args)} exited {p.returncode}: {p.stdout}{p.stderr}")
    return p.stdout


def barrier(name):
    d = os.path.join(W, "barrier", RUN, name)
    os.makedirs(d, exist_ok=True)
    open(os.path.join(d, str(RANK)), "w").close()
    while len(os.listdir(d)) < NTASKS:
        if time.monotonic() > DEADLINE:
            fail(f"barrier {name}: the other tasks did not come")
        time.sleep(0.1)


def write_ckpt(tag, files):
    sums = []
    for rel, size in files:
        path = os.path.join(CKPT, tag, rel.format(r=RANK))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = os.urandom(size)
        with open(path, "wb") as f:
            f.write(data)
        sums.append((rel.format(r=RANK), hashlib.sha256(data).hexdigest()))
    record(f"sums-{tag}", "".join(f"{h}  ./{p}\n" for p, h in sorted(sums)))
    log(f"wrote {tag}")
    barrier(tag)
    if RANK == 0:
        cli("ckpt", "commit", tag)
        log(f"committed {tag}")


def wait_archived(tag):
    while True:
        reply = json.loads(cli("ckpt", "list", "--json"))
        states = {c["tag"]: c["state"] for c in reply.get("ckpts", [])}
        if states.get(tag) == "archived":
            log(f"{tag} archived: {json.dumps(states)}")
            return
        if time.monotonic() > DEADLINE:
            fail(f"{tag} not archived in time: {reply}")
        time.sleep(0.3)


env = "".join(f"{k}={v}\n" for k, v in sorted(os.environ.items()) if k.startswith(("SLUICE_", "SLURM_RESTART")))
record("env", env)
restored = os.environ.get("SLUICE_RESTORED_TAG", "<unset>")
record("restored", restored + "\n")
record("ckpt-ls", "".join(e + "\n" for e in sorted(os.listdir(CKPT))))
if restored != "<unset>":
    record("restored-sums", sh(SUMS, os.path.join(CKPT, restored)))
if RUN != "seed":
    record("stage-ls", "".join(e + "\n" for e in sorted(os.listdir(STAGE))))
    record("sums-ds", sh(SUMS, os.path.join(STAGE, "ds")))
    record("dirs-ds", sh(DIRS, os.path.join(STAGE, "ds")))
log(f"started; restored {restored}")

SHARD = [("model/rank_{r}.bin", 6 * 1024 * 1024 + 4321), ("meta/rank_{r}.json", 300)]
if RUN == "seed":
    write_ckpt("s0", [("seed_{r}.bin", 64 * 1024)])
    wait_archived("s0")
elif RUN == "1":
    write_ckpt("s1", SHARD)
    wait_archived("s1")
    # What a run killed mid-way leaves behind: a staged file it changed, a file of its own in the
    # stage directory, a torn save that was never committed.
    left = []
    try:
        with open(os.path.join(STAGE, "ds", "nested", "a", "sibling.bin"), "ab") as f:
            f.write(b"changed by run 1")
        left.append("stage/ds/nested/a/sibling.bin (appended to)")
    except OSError as e:
        log(f"could not change a staged file: {e}")
    try:
        os.makedirs(os.path.join(STAGE, "run1-extra"), exist_ok=True)
        with open(os.path.join(STAGE, "run1-extra", f"from-{NODE}"), "w") as f:
            f.write("run 1")
        left.append("stage/run1-extra")
    except OSError as e:
        log(f"could not write into the stage directory: {e}")
    torn = os.path.join(CKPT, "s2-torn", "model")
    os.makedirs(torn, exist_ok=True)
    with open(os.path.join(torn, f"rank_{RANK}.bin.partial"), "wb") as f:
        f.write(os.urandom(100 * 1024))
    left.append("ckpt/s2-torn")
    record("leftovers", "".join(x + "\n" for x in left))
    record("ready", "")
    log("ready to be requeued")
    time.sleep(900)
    fail("run 1 was not requeued")
elif RUN == "2":
    write_ckpt("s2", SHARD)
    wait_archived("s2")
else:
    fail(f"unknown run {RUN}")
log("done")
record("done", "")
"#;

/// The batch script: says which run this is in the job output, records what the batch step sees
/// (before any step), then runs one task per node.
fn batch_script(work: &Path, task: &Path, cli: &Path, run: Option<&str>) -> String {
    let run = run.map_or_else(
        || "$(( ${SLURM_RESTART_COUNT:-0} + 1 ))".to_string(),
        String::from,
    );
    format!(
        r#"#!/bin/bash
run={run}
echo "run $run of job $SLURM_JOB_ID: start $(date +%s.%N) restart_count=${{SLURM_RESTART_COUNT-<unset>}} restored=${{SLUICE_RESTORED_TAG-<unset>}}"
mkdir -p {w}/out/$run
{{ echo "tag=${{SLUICE_RESTORED_TAG-<unset>}}"; ls -A "$SLUICE_CKPT_DIR"; }} > {w}/out/$run/batch-first 2>&1
srun --ntasks-per-node=1 python3 {task} {w} $run {cli}
rc=$?
echo "run $run of job $SLURM_JOB_ID: end $(date +%s.%N) rc=$rc"
exit $rc
"#,
        w = work.display(),
        task = task.display(),
        cli = cli.display()
    )
}

/// What each run's tasks must find when they start (see [`TASK_PY`]): the dataset staged whole,
/// alone in the stage directory, and one checkpoint restored as it was written, alone in
/// `$SLUICE_CKPT_DIR`.
struct AtStart<'a> {
    ds_sums: &'a str,
    ds_dirs: &'a str,
    restored: &'a str,
    written: &'a BTreeMap<String, String>,
}

impl AtStart<'_> {
    /// Checks what run `run`'s task on `node` recorded below `out`; `left` says what the run before
    /// left behind, for the messages.
    fn assert_seen(&self, out: &Path, run: &str, node: &str, left: &str, ev: &dyn Fn() -> String) {
        let dir = out.join(run);
        let file = |name: &str| task_file(&dir, node, name);
        let (tag, what) = (self.restored, format!("run {run} on {node} ({left})"));
        assert_eq!(
            file("restored").trim(),
            tag,
            "SLUICE_RESTORED_TAG in {what}\n{}",
            ev()
        );
        assert_eq!(
            file("ckpt-ls"),
            format!("{tag}\n"),
            "$SLUICE_CKPT_DIR at the start of {what}\n{}",
            ev()
        );
        let restored = parse_sums(&file("restored-sums"));
        assert!(
            &restored == self.written,
            "{tag} as {what} found it differs from what was written: {}\n{}",
            diff_trees(self.written, &restored),
            ev()
        );
        assert_eq!(file("stage-ls"), "ds\n", "the stage dir of {what}");
        let sums = file("sums-ds");
        assert!(
            sums == self.ds_sums,
            "the staged dataset of {what} differs from its source: {}\n{}",
            diff_listings(self.ds_sums, &sums),
            ev()
        );
        assert_eq!(file("dirs-ds"), self.ds_dirs, "the directories of {what}");
    }
}

/// Every node's record `sums-TAG` of one run, merged: the whole checkpoint as written.
fn written_by(out: &Path, nodes: &[String], tag: &str) -> BTreeMap<String, String> {
    nodes
        .iter()
        .flat_map(|n| parse_sums(&task_file(out, n, &format!("sums-{tag}"))))
        .collect()
}

/// The archive holds exactly the checkpoints `tags`, and `tag`'s MANIFEST is complete and names
/// the job; returns the MANIFEST's bytes.
fn assert_archived(
    cluster: &Cluster,
    archive: &Archive,
    objects: &BTreeMap<String, u64>,
    tags: &[&str],
    job: &Job,
) -> Vec<u8> {
    assert_eq!(
        tags_in(objects),
        tags.iter().copied().collect(),
        "{}: {objects:?}",
        archive.url
    );
    let tag = tags[tags.len() - 1];
    let bytes = archive.read(cluster, &format!("{tag}/MANIFEST"));
    let m = check_manifest(objects, tag, &bytes).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        m["job"]["job_id"].as_u64(),
        Some(job.id as u64),
        "{tag} MANIFEST job"
    );
    bytes
}

#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn requeued_job_stages_again_and_resumes_from_its_archived_checkpoint() {
    let cluster = Cluster::for_s3();
    let t0 = Instant::now();
    let at = |t: Instant| t.duration_since(t0).as_secs_f64();

    // The dataset, in Garage under the prefix the harness's [[stage.allow]] opens (s3://datasets/).
    let ds_dir = cluster.data_dir("requeue").join("ds");
    make_dataset(&ds_dir, false);
    let (ds_sums, ds_dirs) = (checksums(&ds_dir), directories(&ds_dir));
    let prefix = format!("e2e/{}/ds", unique());
    cluster.upload(&ds_dir, "garage", &format!("datasets/{prefix}"));

    let archive = Archive::new(&cluster, Backend::Garage, "requeue");
    let work = cluster.workdir("requeue");
    let out = work.join("out");
    let job_cli = cluster.user_cli();
    let task = work.join("task.py");
    fs::write(&task, with_py_helpers(TASK_PY)).unwrap();
    let archive_opt = format!("--ckpt-archive={}", archive.url);

    // Seed: `--ckpt-restore=latest` needs a checkpoint in the archive for the first run.
    let seed = cluster.submit(
        &work,
        &["-N1", &archive_opt, "--job-name=requeue-seed"],
        &batch_script(&work, &task, &job_cli, Some("seed")),
    );
    cluster.assert_completes(&seed, SEED_TIMEOUT, "the seed job");
    let seed_node = cluster.job_nodes(&seed).remove(0);
    let s0 = parse_sums(&task_file(&out.join("seed"), &seed_node, "sums-s0"));
    assert_eq!(s0.len(), 1, "the seed job recorded no s0 files");
    let t_seeded = Instant::now();

    // The job, with everything a requeued job must handle, on the same two nodes in both runs (so
    // that run 2 meets what run 1 left on their hot tiers).
    let stage_opt = format!("--stage-in=ds=s3://datasets/{prefix}");
    let nodelist = format!("--nodelist={}", cluster.nodes[..2].join(","));
    let job = cluster.submit(
        &work,
        &[
            "-N2",
            &nodelist,
            "--requeue",
            "--open-mode=append",
            &stage_opt,
            &archive_opt,
            "--ckpt-keep=1",
            "--ckpt-restore=latest",
            "--job-name=requeue",
        ],
        &batch_script(&work, &task, &job_cli, None),
    );
    cluster.wait_for(
        &format!("job {} to run", job.id),
        RUN1_TIMEOUT,
        Some(&job),
        || {
            let state = cluster.job_state(&job).map(|s| s.state).unwrap_or_default();
            assert!(
                matches!(state.as_str(), "PENDING" | "CONFIGURING" | "RUNNING"),
                "run 1 of job {} is {state}\n{}",
                job.id,
                cluster.evidence(&job)
            );
            state == "RUNNING"
        },
    );
    let nodes = cluster.job_nodes(&job);
    assert_eq!(nodes.len(), 2, "{nodes:?}");
    let run1 = out.join("1");
    cluster.wait_for(
        "run 1 to archive s1 and wait to be requeued on every node",
        RUN1_TIMEOUT,
        Some(&job),
        || {
            let failed = nodes
                .iter()
                .any(|n| task_file(&run1, n, "events").contains("FAILED"));
            assert!(
                !failed,
                "a task of run 1 failed\n{}",
                cluster.evidence(&job)
            );
            nodes.iter().all(|n| run1.join(n).join("ready").exists())
        },
    );
    let t_ready = Instant::now();

    // Run 1 saw its dataset whole and s0 restored.
    let ev = || cluster.evidence(&job);
    let run1_start = AtStart {
        ds_sums: &ds_sums,
        ds_dirs: &ds_dirs,
        restored: "s0",
        written: &s0,
    };
    for n in &nodes {
        run1_start.assert_seen(&out, "1", n, "the first run", &ev);
    }
    let s1_written = written_by(&run1, &nodes, "s1");
    assert_eq!(s1_written.len(), 4, "run 1 recorded s1: {s1_written:?}");

    // s1 is in the archive, once, complete.
    let before = archive.objects(&cluster);
    let s1_manifest = assert_archived(&cluster, &archive, &before, &["s0", "s1"], &job);
    let s0_objects = of_tag(&before, "s0");
    let s1_objects = of_tag(&before, "s1");
    let leftovers: BTreeMap<&String, String> = nodes
        .iter()
        .map(|n| (n, task_file(&run1, n, "leftovers")))
        .collect();

    // Requeue it, and let run 2 start at once.
    let requeued = cluster.requeue_and_release(&job, REQUEUE_TIMEOUT);
    let (t_requeue, run2_state) = (requeued.at, &requeued.started_in);
    let t_run2 = Instant::now();

    let end = cluster.assert_completes(
        &job,
        RUN2_TIMEOUT,
        &format!("the requeued job (run 2 started in state {run2_state})"),
    );
    let t_end = Instant::now();
    assert_eq!(
        end.field("Restarts").as_deref(),
        Some("1"),
        "restart count of the job\n{}",
        ev()
    );
    let output = job.output_text();
    for line in [
        format!("run 1 of job {}: start", job.id),
        format!("run 2 of job {}: start", job.id),
        format!("run 2 of job {}: end", job.id),
    ] {
        assert!(
            output.contains(&line),
            "the job output lacks {line:?}\n{}",
            ev()
        );
    }
    let nodes2 = cluster.job_nodes(&job);
    assert_eq!(nodes2, nodes, "run 2's nodes\n{}", ev());

    // Run 2: the dataset staged again, whole, with nothing of run 1; s1 restored, alone.
    let run2 = out.join("2");
    let batch_first = fs::read_to_string(run2.join("batch-first")).unwrap_or_default();
    assert_eq!(
        batch_first,
        "tag=s1\ns1\n",
        "what run 2's batch script saw first ($SLUICE_RESTORED_TAG, then $SLUICE_CKPT_DIR)\n{}",
        ev()
    );
    let run2_start = AtStart {
        restored: "s1",
        written: &s1_written,
        ..run1_start
    };
    let left = format!("run 1 left {leftovers:?}");
    for n in &nodes2 {
        assert!(
            run2.join(n).join("done").exists(),
            "run 2 did not finish on {n}\n{}",
            ev()
        );
        assert!(
            task_file(&run2, n, "env").contains("SLURM_RESTART_COUNT=1"),
            "run 2 on {n} does not know it is a restart: {}",
            task_file(&run2, n, "env")
        );
        run2_start.assert_seen(&out, "2", n, &left, &ev);
    }
    let s2_written = written_by(&run2, &nodes2, "s2");
    assert_eq!(s2_written.len(), 4, "run 2 recorded s2: {s2_written:?}");

    // The archive: s0 and s1 exactly as before the requeue (s1's MANIFEST not published again),
    // s2 made of the same objects as s1 (same files), nothing else, no upload left open.
    let after = archive.objects(&cluster);
    assert_archived(&cluster, &archive, &after, &["s0", "s1", "s2"], &job);
    assert_eq!(of_tag(&after, "s0"), s0_objects, "s0's objects changed");
    assert_eq!(
        of_tag(&after, "s1"),
        s1_objects,
        "s1's objects changed after the requeue"
    );
    assert!(
        archive.read(&cluster, "s1/MANIFEST") == s1_manifest,
        "s1's MANIFEST was rewritten after the requeue"
    );
    let s2_objects = of_tag(&after, "s2");
    assert_eq!(
        s2_objects.keys().collect::<Vec<_>>(),
        s1_objects.keys().collect::<Vec<_>>(),
        "s2 (one archive by run 2) and s1 (one archive by run 1) hold the same files, so the same keys"
    );
    let manifest_count = after.keys().filter(|k| k.ends_with("MANIFEST")).count();
    assert_eq!(manifest_count, 3, "MANIFESTs in {}: {after:?}", archive.url);
    assert_eq!(
        archive.multipart_uploads(&cluster),
        Vec::new(),
        "open multipart uploads"
    );

    // Both checkpoints restore (checksums checked by sluice) to what was written.
    for (tag, written) in [("s1", &s1_written), ("s2", &s2_written)] {
        let got = cluster.restore_with_cli(&archive.url, tag);
        assert!(
            &got == written,
            "sluice ckpt restore {} {tag} differs from what the job wrote: {}",
            archive.url,
            diff_trees(written, &got)
        );
    }

    // Each node's hot tier keeps exactly s2 (--ckpt-keep=1), as that node wrote it; the agents'
    // journals record the job as ended with s2 kept.
    for n in &nodes2 {
        let dir = cluster.job_dir(n, &job);
        let want: BTreeMap<String, String> = parse_sums(&task_file(&run2, n, "sums-s2"))
            .into_iter()
            .map(|(p, h)| (format!("ckpt/s2/{p}"), h))
            .collect();
        cluster.wait_for(
            &format!("the hot tier of {n} ({}) to hold exactly s2", dir.display()),
            HOT_TIMEOUT,
            Some(&job),
            || {
                entries(&dir) == BTreeSet::from(["ckpt".to_string()])
                    && entries(&dir.join("ckpt")) == BTreeSet::from(["s2".to_string()])
                    && hash_tree(&dir) == want
            },
        );
        let journal = PathBuf::from(cluster.var("SLUICE_TEST_ROOT"))
            .join(n)
            .join("state/jobs")
            .join(format!("{}.json", job.id));
        let record: Value = serde_json::from_slice(&fs::read(&journal).unwrap_or_default())
            .unwrap_or_else(|e| panic!("the journal record {} of {n}: {e}", journal.display()));
        let kept: Vec<&str> = record["ckpts"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter(|c| c["on_hot"] == true)
                    .filter_map(|c| c["tag"].as_str())
                    .collect()
            })
            .unwrap_or_default();
        assert!(
            record["ended"] == true && kept == ["s2"],
            "the journal of {n} after the job should record it ended with s2 kept: {record}"
        );
    }
    cluster.assert_nodes_return_idle(&job, HOT_TIMEOUT);

    eprintln!(
        "requeue timeline (s since start): seeded {:.1}, run 1 ready {:.1}, requeued {:.1}, \
         pending {} [{}], released by {:?} (refused: {:?}), run 2 {:.1}, ended {:.1}",
        at(t_seeded),
        at(t_ready),
        at(t_requeue),
        requeued
            .pending_at
            .map_or("never seen".into(), |t| format!("{:.1}", at(t))),
        requeued.pending,
        requeued.released,
        requeued.refusals,
        at(t_run2),
        at(t_end)
    );
}
