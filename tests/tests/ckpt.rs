//! Checkpoints as a user sees them (issue 3): a job writes checkpoints of bf16- and fp32-like tensors
//! into `$SLUICE_CKPT_DIR/TAG/`, commits them (with `sluice ckpt commit`, with a DeepSpeed `latest`
//! file, with a `torch.distributed.checkpoint` `.metadata` file), and the agents archive them to
//! Garage (S3), Azurite (Azure Blob) or a `file://` directory, trim the hot tier to `--ckpt-keep`,
//! and restore them for later jobs with `--ckpt-restore`.
//!
//! What the tests check is what a user would check: the archive holds complete checkpoints with
//! MANIFESTs whose every object is there with the recorded size, restored files are byte-identical to
//! what the job wrote (sha256 recorded by the job itself), the hot tier holds exactly the newest
//! `--ckpt-keep` checkpoints, a damaged archive makes `latest` fall back with a `note:` in the job
//! output, an agent killed with SIGKILL mid-archive finishes after its restart, and an object store
//! outage delays archives but never the job.
//!
//! The "training" is `train.py` below (Python standard library only: the test user has no numpy).
//! Sizes are modest for the 2-core test machine: about 10.6 MiB per node and checkpoint, ~95 MiB for
//! the three checkpoints of a 3-node job (the issue says "a few hundred MiB"; the code paths are the
//! same: several files per node, one of them stored above the 5 MiB part size, i.e. multipart).

use crate::common::*;
use serde_json::{Value, json};
use sluice_proto::msg::CkptState;
use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A writer job: generating, archiving (3 nodes × 3 checkpoints) and waiting for the archive.
const WRITER_TIMEOUT: Duration = Duration::from_secs(300);
/// A restore job: a whole checkpoint (~32 MiB) from the archive onto each node, then checksums.
const RESTORE_TIMEOUT: Duration = Duration::from_secs(180);
/// Until a checkpoint committed (or resumed) reaches its MANIFEST.
const ARCHIVE_TIMEOUT: Duration = Duration::from_secs(150);
/// Finalisation on the hot tier after the job left COMPLETING.
const HOT_TIMEOUT: Duration = Duration::from_secs(30);
/// The agents' part size in the test cluster (`[ckpt] part_size`): larger objects go multipart.
const PART_SIZE: u64 = 5 << 20;
const MIB: u64 = 1 << 20;

// ------------------------------------------------------------------------------------ the job

/// The job's "training": every task (one per node) writes its shard of each checkpoint of the plan,
/// meets the other tasks at a file barrier in the shared work directory, and rank 0 commits the
/// checkpoint as the plan says. Records, under `out/<node>/`: `sums-TAG` (sha256 of the files this
/// task wrote, `.metadata` included), `commit-TAG` (rank 0, CLI commits: seconds `sluice ckpt
/// commit` took and what it said), `train` (the time of every training step), `events`, `env`, and
/// `done` at the end. Inside the job, `sluice ckpt list --json` tells when everything is archived.
const TRAIN_PY: &str = r#"
import hashlib, json, os, subprocess, sys, time

W = sys.argv[1]
with open(sys.argv[2]) as f:
    PLAN = json.load(f)
RANK = int(os.environ["SLURM_PROCID"])
NTASKS = int(os.environ["SLURM_NTASKS"])
NODE = os.environ["SLURMD_NODENAME"]
JOB = int(os.environ["SLURM_JOB_ID"])
CKPT = os.environ["SLUICE_CKPT_DIR"]
OUT = os.path.join(W, "out", NODE)
os.makedirs(OUT, exist_ok=True)
DEADLINE = time.monotonic() + PLAN["deadline_s"]
CLI = PLAN["cli"]
TRAIN = open(os.path.join(OUT, "train"), "a", buffering=1)

with open(os.path.join(OUT, "env"), "w") as f:
    for k in sorted(os.environ):
        if k.startswith("SLUICE_"):
            f.write(f"{k}={os.environ[k]}\n")


WHO = f"train.py rank {RANK}"
# sluice-e2e: log, fail


def train_step():
    """One step of "training": the job's own work, which archiving must never hold up."""
    if time.monotonic() > DEADLINE:
        fail("deadline passed")
    time.sleep(0.1)
    TRAIN.write(f"{time.time():.3f}\n")


# The high byte of N(0, 0.02)-like weights: random sign, biased exponent mostly 117..122. The other
# bytes (mantissa) are random, so the data compresses like real tensors do: a little.
EXPS = [115] * 4 + [116] * 8 + [117] * 14 + [118] * 20 + [119] * 24 + [120] * 24 + [121] * 18 + [122] * 10 + [123] * 6
HI = bytes(((i & 1) << 7) | (EXPS[i >> 1] >> 1) for i in range(256))


def tensor(kind, size):
    buf = bytearray(os.urandom(size))
    stride = {"bf16": 2, "fp32": 4}.get(kind)
    if stride:
        n = len(range(stride - 1, size, stride))
        buf[stride - 1 :: stride] = os.urandom(n).translate(HI)
    elif kind == "json":
        buf = json.dumps({"rank": RANK, "node": NODE, "world": NTASKS, "pad": "x" * size}).encode()
    return bytes(buf)


def cli(*args):
    """The sluice CLI, as a user runs it inside the job; returns (seconds, stdout)."""
    t0 = time.monotonic()
    p = subprocess.run([CLI, *args], capture_output=True, text=True, timeout=120)
    dt = time.monotonic() - t0
    if p.returncode != 0:
        fail(f"sluice {' '.join(args)} exited {p.returncode}: {p.stdout}{p.stderr}")
    return dt, p.stdout


def wait_file(name):
    while not os.path.exists(os.path.join(W, name)):
        train_step()


def barrier(name):
    d = os.path.join(W, "barrier", name)
    os.makedirs(d, exist_ok=True)
    open(os.path.join(d, str(RANK)), "w").close()
    while len(os.listdir(d)) < NTASKS:
        train_step()


def write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


for step in PLAN["steps"]:
    tag = step["tag"]
    if step.get("after"):
        wait_file(step["after"])
    d = os.path.join(CKPT, tag)
    sums = []
    for name, kind, size in step["files"]:
        rel = name.format(r=RANK)
        data = tensor(kind, size)
        write(os.path.join(d, rel), data)
        sums.append((rel, hashlib.sha256(data).hexdigest()))
    log(f"wrote {tag}")
    barrier(tag)
    if RANK == 0:
        how = step["commit"]
        if how == "cli":
            dt, said = cli("ckpt", "commit", tag)
            with open(os.path.join(OUT, f"commit-{tag}"), "w") as f:
                f.write(f"{dt:.3f} {said}")
        elif how == "deepspeed":
            # DeepSpeed's rank 0 names the newest complete checkpoint in `latest`.
            write(os.path.join(CKPT, "latest"), tag.encode())
        elif how == "dcp":
            # torch.distributed.checkpoint's coordinator writes TAG/.metadata last.
            meta = json.dumps({"planner": "sluice-e2e", "world": NTASKS, "tag": tag}).encode()
            write(os.path.join(d, ".metadata"), meta)
            sums.append((".metadata", hashlib.sha256(meta).hexdigest()))
        else:
            fail(f"unknown commit method {how}")
        log(f"committed {tag} ({how})")
    with open(os.path.join(OUT, f"sums-{tag}"), "w") as f:
        for rel, h in sorted(sums):
            f.write(f"{h}  ./{rel}\n")

if PLAN.get("wait_archived"):
    # Keep training until this node's agent reports every checkpoint archived (MANIFEST published).
    tags = [s["tag"] for s in PLAN["steps"]]
    while True:
        reply = json.loads(cli("ckpt", "list", "--json")[1])
        states = {c["tag"]: c["state"] for c in reply.get("ckpts", [])}
        if all(states.get(t) == "archived" for t in tags):
            break
        if time.monotonic() > DEADLINE - 5:
            fail(f"checkpoints not archived in time: {reply}")
        for _ in range(5):
            train_step()
    log(f"all archived: {json.dumps(reply)}")

if PLAN.get("train_until"):
    wait_file(PLAN["train_until"])
log("done")
open(os.path.join(OUT, "done"), "w").close()
"#;

/// One checkpoint of a plan: its tag, how rank 0 commits it, the files each rank writes (`{r}` in
/// a name is the rank), and a file in the work directory to wait for first (the test's go-ahead).
struct Step {
    tag: &'static str,
    commit: &'static str,
    files: Vec<(String, &'static str, u64)>,
    after: Option<&'static str>,
}

impl Step {
    /// A checkpoint written as soon as the one before is committed.
    fn new(
        tag: &'static str,
        commit: &'static str,
        files: Vec<(String, &'static str, u64)>,
    ) -> Step {
        Step {
            tag,
            commit,
            files,
            after: None,
        }
    }

    /// The same checkpoint, written once the test creates `go` in the work directory.
    fn after(self, go: &'static str) -> Step {
        Step {
            after: Some(go),
            ..self
        }
    }
}

/// What the job's trainer does: its checkpoints, then either training on until every one is
/// archived (`wait_archived`) or until the test creates `train_until`, or ending at once; it fails
/// after `deadline`.
struct Plan {
    steps: Vec<Step>,
    wait_archived: bool,
    train_until: Option<&'static str>,
    deadline: Duration,
}

impl Plan {
    /// Trains on until the agent reports every checkpoint archived.
    fn until_archived(steps: Vec<Step>, deadline: Duration) -> Plan {
        Plan {
            steps,
            wait_archived: true,
            train_until: None,
            deadline,
        }
    }

    /// Trains on until the test creates `stop`.
    fn until_stopped(steps: Vec<Step>, deadline: Duration) -> Plan {
        Plan {
            steps,
            wait_archived: false,
            train_until: Some("stop"),
            deadline,
        }
    }

    /// Ends right after its last commit.
    fn ending_after_commit(steps: Vec<Step>, deadline: Duration) -> Plan {
        Plan {
            steps,
            wait_archived: false,
            train_until: None,
            deadline,
        }
    }

    /// Writes `train.py` and the plan into the work directory and submits a `nodes`-node job that
    /// runs one trainer per node, archiving to `archive` with `--ckpt-keep=1`.
    fn submit(
        &self,
        cluster: &Cluster,
        work: &Path,
        archive: &Archive,
        nodes: usize,
        name: &str,
    ) -> Job {
        let plan = json!({
            "cli": cluster.user_cli(),
            "deadline_s": self.deadline.as_secs(),
            "wait_archived": self.wait_archived,
            "train_until": self.train_until,
            "steps": self.steps.iter().map(|s| json!({
                "tag": s.tag,
                "commit": s.commit,
                "after": s.after,
                "files": s.files.iter().map(|(n, k, z)| json!([n, k, z])).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
        });
        fs::write(work.join("train.py"), with_py_helpers(TRAIN_PY)).unwrap();
        fs::write(work.join("plan.json"), plan.to_string()).unwrap();
        let script = format!(
            "#!/bin/bash\nsrun --ntasks-per-node=1 python3 {w}/train.py {w} {w}/plan.json\n",
            w = work.display()
        );
        cluster.submit(
            work,
            &[
                &format!("-N{nodes}"),
                "--ckpt-keep=1",
                &format!("--ckpt-archive={}", archive.url),
                &format!("--job-name={name}"),
            ],
            &script,
        )
    }
}

/// The shard of one rank in the round-trip test: a bf16 model shard, an fp32 optimizer shard stored
/// above the part size (multipart; not a multiple of it either), two small layer files in a
/// subdirectory and a small JSON file: ~10.6 MiB per rank.
fn shard_files() -> Vec<(String, &'static str, u64)> {
    vec![
        ("mp_rank_{r:02d}_model_states.pt".into(), "bf16", 2 * MIB),
        (
            "zero/bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt".into(),
            "fp32",
            8 * MIB + 12_344,
        ),
        ("layers/layer_{r:02d}_0.bf16".into(), "bf16", 256 << 10),
        ("layers/layer_{r:02d}_1.bf16".into(), "bf16", 256 << 10),
        ("rank_{r}.json".into(), "json", 100),
    ]
}

/// A job that restores a checkpoint and records what it sees: from the first lines of the batch
/// script, before any step, `out/batch-first` (`SLUICE_RESTORED_TAG`, `SLUICE_CKPT_DIR`, its
/// entries) and `out/batch-sums` (sha256 of the restored files); then `out/<node>/{tag,ls,sums}`
/// from one task per node.
fn restore_script(work: &Path) -> String {
    format!(
        r#"#!/bin/bash
{{ echo "tag=${{SLUICE_RESTORED_TAG-<unset>}}"; echo "dir=${{SLUICE_CKPT_DIR-<unset>}}"; ls -A "$SLUICE_CKPT_DIR"; }} > {w}/out/batch-first 2>&1
(cd "$SLUICE_CKPT_DIR/$SLUICE_RESTORED_TAG" && {SUMS_CMD}) > {w}/out/batch-sums 2>&1
srun --ntasks-per-node=1 /bin/bash -c '
o={w}/out/$SLURMD_NODENAME
mkdir -p "$o"
echo "${{SLUICE_RESTORED_TAG-<unset>}}" > "$o/tag"
ls -A "$SLUICE_CKPT_DIR" > "$o/ls" 2>&1
(cd "$SLUICE_CKPT_DIR/$SLUICE_RESTORED_TAG" && {SUMS_CMD}) > "$o/sums" 2>&1
'
"#,
        w = work.display()
    )
}

/// What the writer job recorded: per tag, per node, path → sha256 of the files that node wrote.
struct Written {
    by_node: BTreeMap<String, BTreeMap<String, BTreeMap<String, String>>>,
}

impl Written {
    fn read(out: &Path, nodes: &[String], tags: &[&str]) -> Written {
        let mut by_node = BTreeMap::new();
        for tag in tags {
            let per: BTreeMap<_, _> = nodes
                .iter()
                .map(|n| {
                    (
                        n.clone(),
                        parse_sums(&task_file(out, n, &format!("sums-{tag}"))),
                    )
                })
                .collect();
            by_node.insert(tag.to_string(), per);
        }
        Written { by_node }
    }

    /// The whole checkpoint: every node's files.
    fn union(&self, tag: &str) -> BTreeMap<String, String> {
        self.by_node[tag]
            .values()
            .flat_map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())))
            .collect()
    }

    fn node(&self, tag: &str, node: &str) -> &BTreeMap<String, String> {
        &self.by_node[tag][node]
    }
}

/// The entries of a job's checkpoint directory on one node's hot tier (empty if it is gone).
fn hot_entries(cluster: &Cluster, node: &str, job: &Job) -> BTreeSet<String> {
    entries(&cluster.job_dir(node, job).join("ckpt"))
}

/// Waits until the job's checkpoint directory on `node` holds exactly `tag`.
fn wait_hot_tier_holds(cluster: &Cluster, node: &str, job: &Job, tag: &str) {
    cluster.wait_for(
        &format!("job {}'s hot tier on {node} to hold exactly {tag}", job.id),
        HOT_TIMEOUT,
        Some(job),
        || hot_entries(cluster, node, job) == BTreeSet::from([tag.to_string()]),
    );
}

fn agent_ckpts(cluster: &Cluster, node: &str, job: &Job) -> Vec<sluice_proto::msg::CkptStatus> {
    cluster
        .agent_ckpts(node, job)
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Waits until one checkpoint is being archived on `node`.
fn wait_archiving(cluster: &Cluster, node: &str, job: &Job, tag: &str) {
    cluster.wait_for(
        &format!("{tag} to be archiving on {node}"),
        Duration::from_secs(90),
        Some(job),
        || {
            cluster
                .agent_ckpt(node, job, tag)
                .is_some_and(|c| c.state == CkptState::Archiving)
        },
    );
}

// ------------------------------------------------------------------------------- the archives

/// path → (raw size, node) of a manifest's files.
fn manifest_files(m: &Value) -> BTreeMap<String, (u64, String)> {
    m["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            (
                f["path"].as_str().unwrap().to_string(),
                (
                    f["size"].as_u64().unwrap(),
                    f["node"].as_str().unwrap().to_string(),
                ),
            )
        })
        .collect()
}

fn wait_manifests(cluster: &Cluster, archive: &Archive, tags: &[&str], job: &Job) {
    cluster.wait_for(
        &format!("MANIFESTs of {tags:?} in {}", archive.url),
        ARCHIVE_TIMEOUT,
        Some(job),
        || {
            let have = archive.manifests(cluster);
            tags.iter().all(|t| have.contains(*t))
        },
    );
}

/// Waits for the MANIFESTs of `tags` and checks them (see [`check_manifests`]).
fn wait_complete_manifests(
    cluster: &Cluster,
    archive: &Archive,
    tags: &[&str],
    job: &Job,
) -> Vec<Value> {
    wait_manifests(cluster, archive, tags, job);
    check_manifests(cluster, archive, tags, job)
}

/// Checks that each MANIFEST of `tags` names only objects that are there, whole; returns them
/// parsed.
fn check_manifests(cluster: &Cluster, archive: &Archive, tags: &[&str], job: &Job) -> Vec<Value> {
    tags.iter()
        .map(|tag| {
            archive
                .check_manifest(cluster, tag)
                .unwrap_or_else(|e| panic!("{e}\n{}", cluster.evidence(job)))
        })
        .collect()
}

// ----------------------------------------------------------------- retention watcher (safety)

/// Watches a job's archive and hot tiers while a test runs, for the two safety rules:
/// - whenever a checkpoint directory disappears from a node's hot tier, the archive must already
///   hold its MANIFEST ("retention never removes an unarchived checkpoint"). Polls every 200 ms; the
///   check runs right after the disappearance is seen (a MANIFEST written later than the trim but
///   within that window would slip through, which no plausible bug does: an early trim happens long
///   before the upload ends);
/// - every MANIFEST, checked within about a second of its appearance, names only data objects that
///   exist with their recorded sizes ("no manifest ever points at a missing or partial object").
struct SafetyWatch {
    stop: Arc<AtomicBool>,
    violations: Arc<Mutex<Vec<String>>>,
    removed: Arc<Mutex<Vec<(String, String)>>>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl SafetyWatch {
    fn start(cluster: &Cluster, nodes: &[String], job: &Job, archive: &Archive) -> SafetyWatch {
        let dirs: Vec<(String, PathBuf)> = nodes
            .iter()
            .map(|n| (n.clone(), cluster.job_dir(n, job).join("ckpt")))
            .collect();
        let stop = Arc::new(AtomicBool::new(false));
        let violations = Arc::new(Mutex::new(Vec::new()));
        let removed = Arc::new(Mutex::new(Vec::new()));
        let (s, v, r) = (stop.clone(), violations.clone(), removed.clone());
        // The thread needs its own view of the cluster and the archive.
        let cluster = Cluster::get();
        let archive = archive.clone();
        let handle = std::thread::spawn(move || {
            let list = |d: &Path| -> BTreeSet<String> {
                fs::read_dir(d)
                    .map(|rd| {
                        rd.filter_map(|e| e.ok())
                            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                            .map(|e| e.file_name().to_string_lossy().into_owned())
                            .collect()
                    })
                    .unwrap_or_default()
            };
            let mut seen: BTreeMap<String, BTreeSet<String>> =
                dirs.iter().map(|(n, d)| (n.clone(), list(d))).collect();
            let mut checked: BTreeSet<String> = BTreeSet::new();
            let mut round = 0u64;
            while !s.load(Ordering::Relaxed) {
                // About once a second: every MANIFEST that appeared since must name only objects
                // that are there, whole ("no manifest ever points at a missing or partial object").
                if round % 5 == 0 {
                    let objects = archive.objects(&cluster);
                    for tag in manifests_in(&objects).difference(&checked.clone()) {
                        let bytes = archive.read(&cluster, &format!("{tag}/MANIFEST"));
                        if let Err(e) = check_manifest(&objects, tag, &bytes) {
                            v.lock().unwrap().push(e);
                        }
                        checked.insert(tag.clone());
                    }
                }
                round += 1;
                for (node, d) in &dirs {
                    let now = list(d);
                    let gone: Vec<String> = seen[node].difference(&now).cloned().collect();
                    if !gone.is_empty() {
                        let manifests = archive.manifests(&cluster);
                        for tag in gone {
                            r.lock().unwrap().push((node.clone(), tag.clone()));
                            if !manifests.contains(&tag) {
                                v.lock().unwrap().push(format!(
                                    "{tag} left the hot tier of {node} at {:.3} without a MANIFEST in {}",
                                    now_s(),
                                    archive.url
                                ));
                            }
                        }
                    }
                    seen.insert(node.clone(), now);
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        });
        SafetyWatch {
            stop,
            violations,
            removed,
            handle: Some(handle),
        }
    }

    /// Stops watching; the (node, tag) pairs trimmed meanwhile. Panics on a violation.
    fn finish(mut self, cluster: &Cluster, job: &Job) -> Vec<(String, String)> {
        self.stop.store(true, Ordering::Relaxed);
        self.handle
            .take()
            .unwrap()
            .join()
            .expect("retention watcher");
        let v = self.violations.lock().unwrap().clone();
        assert!(
            v.is_empty(),
            "retention removed unarchived checkpoints: {v:?}\n{}",
            cluster.evidence(job)
        );
        self.removed.lock().unwrap().clone()
    }
}

impl Drop for SafetyWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// What every test here starts with: the cluster, a fresh archive on `backend` and a fresh work
/// directory (`ckpt-<name>`) whose `out/` the job's tasks write to.
fn start(backend: Backend, name: &str) -> (Cluster, Archive, PathBuf, PathBuf) {
    let cluster = Cluster::for_sluice();
    let archive = Archive::new(&cluster, backend, name);
    let work = cluster.workdir(&format!("ckpt-{name}"));
    let out = work.join("out");
    (cluster, archive, work, out)
}

// ----------------------------------------------------------------------- 1 + 2: round trips

/// A 3-node job writes three checkpoints and commits them three ways; then the archive, the hot
/// tiers and three restore jobs (latest, an explicit tag, latest after damage) are checked.
fn round_trip(backend: Backend) {
    let name = format!("{backend:?}").to_lowercase();
    let (cluster, archive, work, out) = start(backend, &format!("rt-{name}"));
    let tags = ["step-1", "step-2", "step-3"];
    let steps = [
        ("step-1", "cli"),
        ("step-2", "deepspeed"),
        ("step-3", "dcp"),
    ]
    .map(|(tag, commit)| Step::new(tag, commit, shard_files()));
    // The job trains on until its checkpoints are archived (bounded), then ends.
    let plan = Plan::until_archived(steps.into(), WRITER_TIMEOUT - Duration::from_secs(20));
    let job = plan.submit(&cluster, &work, &archive, 3, "ckpt-writer");
    cluster.assert_completes(&job, WRITER_TIMEOUT, "the checkpoint-writing job");
    let nodes = cluster.job_nodes(&job);
    assert_eq!(nodes.len(), 3, "{nodes:?}");
    // The job's output ends with one summary, from the batch step's node: all three archived.
    let output = job.output_text();
    let summaries: Vec<&str> = output
        .lines()
        .filter(|l| l.starts_with(&format!("sluice: job {} on ", job.id)))
        .collect();
    assert!(
        summaries.len() == 1
            && summaries[0].contains("3 of 3 checkpoint(s) archived (newest step-3: ")
            && summaries[0].ends_with(&format!(" in {}", archive.url)),
        "the job's checkpoint summary: {summaries:#?}\n{}",
        cluster.evidence(&job)
    );
    let written = Written::read(&out, &nodes, &tags);
    for tag in tags {
        for n in &nodes {
            assert!(
                written.node(tag, n).len() >= 5,
                "the task on {n} recorded no files for {tag}\n{}",
                cluster.evidence(&job)
            );
        }
    }

    // The archive: exactly the three checkpoints, each complete with its MANIFEST, holding every
    // node's files with their sizes; the large file went multipart, and bf16 compressed.
    let objects = archive.objects(&cluster);
    assert_eq!(
        tags_in(&objects),
        tags.iter().copied().collect(),
        "tags in {}: {objects:?}",
        archive.url
    );
    assert_eq!(
        manifests_in(&objects),
        tags.iter().map(|t| t.to_string()).collect()
    );
    for tag in tags {
        let bytes = archive.read(&cluster, &format!("{tag}/MANIFEST"));
        let m = check_manifest(&objects, tag, &bytes)
            .unwrap_or_else(|e| panic!("{e}\n{}", cluster.evidence(&job)));
        assert_eq!(
            m["job"]["job_id"].as_u64(),
            Some(job.id as u64),
            "{tag} MANIFEST job"
        );
        assert_eq!(
            m["job"]["user"],
            cluster.user.as_str(),
            "{tag} MANIFEST user"
        );
        let mnodes: Vec<&str> = m["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_str().unwrap())
            .collect();
        let mut sorted = nodes.clone();
        sorted.sort();
        assert_eq!(mnodes, sorted, "{tag} MANIFEST nodes");
        let files = manifest_files(&m);
        let union = written.union(tag);
        assert_eq!(
            files.keys().collect::<Vec<_>>(),
            union.keys().collect::<Vec<_>>(),
            "{tag}: the MANIFEST's files are not the files the job wrote"
        );
        for (node, per) in &written.by_node[tag] {
            for path in per.keys() {
                assert_eq!(
                    &files[path].1, node,
                    "{tag}: MANIFEST says {path} came from another node"
                );
            }
        }
        let stored: Vec<u64> = m["files"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f["stored_size"].as_u64().unwrap())
            .collect();
        assert!(
            stored.iter().filter(|s| **s > PART_SIZE).count() >= 3,
            "{tag}: no data object above the {PART_SIZE}-byte part size (multipart path untested): {stored:?}"
        );
        let bf16 = m["files"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["path"].as_str().unwrap().ends_with("model_states.pt"))
            .unwrap();
        assert!(
            bf16["stored_size"].as_u64() < bf16["size"].as_u64(),
            "{tag}: a bf16 shard was not compressed: {bf16}"
        );
    }

    // Each node's hot tier keeps exactly the newest --ckpt-keep=1 checkpoint, as written there.
    for n in &nodes {
        wait_hot_tier_holds(&cluster, n, &job, "step-3");
        let sums = parse_sums(&checksums(&cluster.job_dir(n, &job).join("ckpt/step-3")));
        assert!(
            &sums == written.node("step-3", n),
            "step-3 on the hot tier of {n} differs from what the job wrote there: {}",
            diff_trees(written.node("step-3", n), &sums)
        );
    }

    // An explicit tag restores that checkpoint (from the archive: no node keeps step-1 any more).
    assert_restores(
        &cluster,
        &archive,
        ("step-1", &nodes[..1]),
        "step-1",
        &written,
    );

    // A second job with --ckpt-restore=latest finds the newest checkpoint, whole and identical,
    // before its first line runs, on every node. (Two of the three nodes: the restore leaves its
    // verified copy on their hot tiers, which later restores there would take instead of the
    // archive; the third node is kept for the damaged-archive case below.)
    assert_restores(
        &cluster,
        &archive,
        ("latest", &nodes[..2]),
        "step-3",
        &written,
    );

    // Damage one archived object of the newest checkpoint (same size, one byte flipped, so only
    // the checksums can tell): on a node without a verified copy, `latest` says so in the job
    // output and falls back to step-2, whole and identical.
    let victim = damage_object(&cluster, &archive, "step-3", "zero/");
    let restored = assert_restores(
        &cluster,
        &archive,
        ("latest", &nodes[2..]),
        "step-2",
        &written,
    );
    restored.assert_note(&cluster, &["step-3", &victim_file(&victim)]);
}

/// Flips one byte in the middle of the first data object of `tag` below `data/<under>` (keeping
/// its size, so only checksums can tell) and returns its key.
fn damage_object(cluster: &Cluster, archive: &Archive, tag: &str, under: &str) -> String {
    let objects = archive.objects(cluster);
    let prefix = format!("{tag}/data/{under}");
    let victim = objects
        .keys()
        .find(|k| k.starts_with(&prefix))
        .unwrap_or_else(|| panic!("no object {prefix}* in {}: {objects:?}", archive.url))
        .clone();
    let mut bytes = archive.read(cluster, &victim);
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x5a;
    archive.overwrite(cluster, &victim, &bytes);
    assert_eq!(
        archive.objects(cluster).get(&victim),
        objects.get(&victim),
        "overwriting {victim} changed its size"
    );
    victim
}

/// The checkpoint-relative path of a data object key (`TAG/data/<path>`).
fn victim_file(key: &str) -> String {
    key.splitn(3, '/').nth(2).unwrap_or(key).to_string()
}

/// A finished restore job and what it recorded.
struct Restored {
    job: Job,
    out: PathBuf,
    nodes: Vec<String>,
}

/// Runs a `--ckpt-restore=WHICH` job on exactly `nodes`, waits for it to complete and checks that
/// it restored `tag` as the writer job recorded it (see [`Restored::assert_restored`]).
fn assert_restores(
    cluster: &Cluster,
    archive: &Archive,
    (which, nodes): (&str, &[String]),
    tag: &str,
    written: &Written,
) -> Restored {
    let restored = restore_job(cluster, archive, which, nodes);
    restored.assert_restored(cluster, tag, &written.union(tag));
    restored
}

/// Runs a `--ckpt-restore=WHICH` job on exactly `nodes` and waits for it to complete.
fn restore_job(cluster: &Cluster, archive: &Archive, which: &str, nodes: &[String]) -> Restored {
    let work = cluster.workdir(&format!("ckpt-restore-{which}"));
    let out = work.join("out");
    fs::create_dir_all(&out).unwrap();
    run(Command::new("chown")
        .arg(format!("{}:", cluster.user))
        .arg(&out));
    let job = cluster.submit(
        &work,
        &[
            &format!("-N{}", nodes.len()),
            &format!("--nodelist={}", nodes.join(",")),
            &format!("--ckpt-archive={}", archive.url),
            &format!("--ckpt-restore={which}"),
            "--job-name=ckpt-restore",
        ],
        &restore_script(&work),
    );
    cluster.assert_completes(
        &job,
        RESTORE_TIMEOUT,
        &format!("the --ckpt-restore={which} job"),
    );
    let nodes = cluster.job_nodes(&job);
    Restored { job, out, nodes }
}

impl Restored {
    /// A `note:` line in the job output that names all of `words`.
    fn assert_note(&self, cluster: &Cluster, words: &[&str]) {
        let text = self.job.output_text();
        assert!(
            text.lines()
                .any(|l| l.contains("note:") && words.iter().all(|w| l.contains(w))),
            "no note in the job output names {words:?}\n{}",
            cluster.evidence(&self.job)
        );
    }

    fn assert_restored(&self, cluster: &Cluster, tag: &str, expected: &BTreeMap<String, String>) {
        let ev = || cluster.evidence(&self.job);
        let first = fs::read_to_string(self.out.join("batch-first")).unwrap_or_default();
        let mut lines = first.lines();
        assert_eq!(
            lines.next(),
            Some(format!("tag={tag}").as_str()),
            "SLUICE_RESTORED_TAG in the batch script:\n{first}\n{}",
            ev()
        );
        let dir = lines.next().unwrap_or_default();
        assert!(
            dir.ends_with(&format!("/jobs/{}/ckpt", self.job.id)),
            "SLUICE_CKPT_DIR: {dir}\n{}",
            ev()
        );
        assert_eq!(
            lines.collect::<Vec<_>>(),
            vec![tag],
            "entries of $SLUICE_CKPT_DIR before the first step\n{}",
            ev()
        );
        let sums = parse_sums(&fs::read_to_string(self.out.join("batch-sums")).unwrap_or_default());
        assert!(
            &sums == expected,
            "restored {tag} seen by the batch script differs from what was written: {}\n{}",
            diff_trees(expected, &sums),
            ev()
        );
        for n in &self.nodes {
            assert_eq!(
                task_file(&self.out, n, "tag").trim(),
                tag,
                "SLUICE_RESTORED_TAG on {n}\n{}",
                ev()
            );
            assert_eq!(
                task_file(&self.out, n, "ls").trim(),
                tag,
                "$SLUICE_CKPT_DIR on {n}\n{}",
                ev()
            );
            let sums = parse_sums(&task_file(&self.out, n, "sums"));
            assert!(
                &sums == expected,
                "restored {tag} on {n} differs from what was written: {}\n{}",
                diff_trees(expected, &sums),
                ev()
            );
        }
    }
}

#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn ckpt_round_trip_three_nodes_garage() {
    round_trip(Backend::Garage);
}

#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn ckpt_round_trip_three_nodes_azurite() {
    round_trip(Backend::Azurite);
}

#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn ckpt_round_trip_three_nodes_file() {
    round_trip(Backend::File);
}

// ------------------------------------------------------------- 3: agent killed mid-archive

/// The agent of the job's first node is SIGKILLed while it uploads its part of step-2, then started
/// again as the harness starts it: the archive completes from the journal, no MANIFEST ever names a
/// missing or partial object, retention never removes an unarchived checkpoint, and the job, which
/// trains on meanwhile, ends normally with its newest archived checkpoint kept on every node.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn ckpt_agent_killed_mid_archive_resumes_after_restart() {
    let (cluster, archive, work, out) = start(Backend::Garage, "kill");
    // step-2 is large and in many files so that its upload takes a while: ~60 MiB per node.
    let mut big: Vec<(String, &str, u64)> = (0..16)
        .map(|i| (format!("shard_{{r}}_{i:02}.fp32"), "fp32", 3 * MIB))
        .collect();
    big.push(("model_{r}.bf16".into(), "bf16", 12 * MIB));
    let steps = vec![
        Step::new(
            "step-1",
            "cli",
            vec![("model_{r}.bf16".into(), "bf16", MIB)],
        ),
        Step::new("step-2", "cli", big).after("go-2"),
    ];
    let plan = Plan::until_stopped(steps, Duration::from_secs(280));
    let job = plan.submit(&cluster, &work, &archive, 2, "ckpt-kill");
    wait_manifests(&cluster, &archive, &["step-1"], &job);
    let nodes = cluster.job_nodes(&job);
    let first = nodes[0].clone();
    let watch = SafetyWatch::start(&cluster, &nodes, &job, &archive);

    fs::write(work.join("go-2"), "").unwrap();
    wait_archiving(&cluster, &first, &job, "step-2");
    // Kill it once a few of its step-2 objects are in the store (or after 2 s at the latest): the
    // committing node starts first (the other learns of the commit from the archive a scan later).
    let archiving = Instant::now();
    while archiving.elapsed() < Duration::from_secs(2)
        && archive
            .objects(&cluster)
            .keys()
            .filter(|k| k.starts_with("step-2/data/"))
            .count()
            < 3
    {}
    let agent = cluster.kill_agent(&first);
    let killed_at = now_s();
    let at_kill = archive.objects(&cluster);
    assert!(
        !at_kill.contains_key(&format!("step-2/parts/{first}.json"))
            && !at_kill.contains_key("step-2/MANIFEST"),
        "step-2's part from {first} was already complete when its agent was killed: the upload was too \
         fast to test a kill in the middle (objects: {:?})",
        at_kill.keys().collect::<Vec<_>>()
    );
    let data_at_kill = at_kill
        .keys()
        .filter(|k| k.starts_with("step-2/data/"))
        .count();

    // While the agent is down: the job trains on, nothing of step-2 is published, and step-1 (the
    // newest archived checkpoint) and step-2 (unarchived) are both still on the hot tier.
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        !archive.manifests(&cluster).contains("step-2"),
        "step-2 published with its node's agent dead"
    );
    for n in &nodes {
        let hot = hot_entries(&cluster, n, &job);
        assert!(
            hot.contains("step-1") && hot.contains("step-2"),
            "hot tier of {n} while {first}'s agent is down: {hot:?}\n{}",
            cluster.evidence(&job)
        );
    }
    let multipart_after_kill = archive.multipart_uploads(&cluster);

    let pid = cluster.start_agent(&agent);
    eprintln!(
        "killed the agent of {first} (pid {}) at {killed_at:.3} with {data_at_kill} data objects of step-2 \
         in the archive; restarted as pid {pid}",
        agent.pid
    );
    wait_complete_manifests(&cluster, &archive, &["step-1", "step-2"], &job);
    // The restarted agent resumed step-2 per object (issue 10, defect 8): the objects the killed
    // one had stored are not uploaded again.
    let log = fs::read_to_string(cluster.agent_log(&first)).unwrap_or_default();
    let resumed = log
        .lines()
        .rev()
        .filter(|l| l.contains("resuming the checkpoint's upload") && l.contains("tag=\"step-2\""))
        .filter_map(|l| {
            let field = |name: &str| -> Option<u64> {
                let v = l.split(&format!(" {name}=")).nth(1)?;
                v.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
            };
            Some((field("files")?, field("to_upload")?))
        })
        .next();
    match resumed {
        Some((files, to_upload)) if files >= 1 && files + to_upload == 17 => eprintln!(
            "restarted agent of {first}: {files} of step-2's 17 files resumed, {to_upload} uploaded"
        ),
        other => panic!(
            "the restarted agent of {first} did not resume step-2 per object ({other:?}; {data_at_kill} \
             step-2 objects were in the archive at the kill)\n{}",
            cluster.evidence(&job)
        ),
    }
    // Retention trims step-1 on every node once step-2 is archived; the job still runs.
    for n in &nodes {
        cluster.wait_for(
            &format!("step-1 to be trimmed from {n}"),
            HOT_TIMEOUT,
            Some(&job),
            || {
                let hot = hot_entries(&cluster, n, &job);
                hot.iter()
                    .filter(|e| e.starts_with("step-"))
                    .map(String::as_str)
                    .collect::<Vec<_>>()
                    == ["step-2"]
            },
        );
    }
    fs::write(work.join("stop"), "").unwrap();
    cluster.assert_completes(
        &job,
        Duration::from_secs(90),
        "the job whose agent was killed",
    );
    let trimmed = watch.finish(&cluster, &job);
    // Not asserted (the issue's "done when" does not ask for it), but reported: multipart uploads
    // the killed agent left open, and which of them are still open now that the archive is done.
    eprintln!(
        "trimmed: {trimmed:?}; multipart uploads open right after the kill: {multipart_after_kill:?}; \
         still open after the archive completed: {:?}",
        archive.multipart_uploads(&cluster)
    );
    for n in &nodes {
        wait_hot_tier_holds(&cluster, n, &job, "step-2");
    }
    // Every byte made it: a restore of step-2 is identical to what the job wrote.
    let written = Written::read(&out, &nodes, &["step-2"]);
    let restored = assert_restores(
        &cluster,
        &archive,
        ("step-2", &nodes[..1]),
        "step-2",
        &written,
    );
    cluster.assert_nodes_return_idle(&restored.job, Duration::from_secs(30));
}

// --------------------------------------------------------------- 4: object store outage

/// The object store goes away (connections refused and reset) in the middle of an archive, for
/// 35 s: the job trains on at its own pace, commits another checkpoint promptly, and ends normally
/// while the store is still down; both checkpoints stay on the hot tier; once the store is back they
/// are archived (within a bounded wait), and retention then keeps the newest.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn ckpt_object_store_outage_delays_archive_not_training() {
    // Long enough for the job to end inside it: the epilog waits up to 20 s for pending archives.
    const OUTAGE: Duration = Duration::from_secs(35);
    let (cluster, archive, work, out) = start(Backend::FaultyGarage, "outage");
    // Slow replies (1 s each) make step-1's archive take a few seconds, so the outage starts in
    // the middle of it.
    let proxy = FaultProxy::start(&cluster);
    proxy.set("slow=1");
    let files = vec![
        ("model_{r}.bf16".to_string(), "bf16", 4 * MIB),
        ("optim_{r}.fp32".to_string(), "fp32", 8 * MIB),
        ("extra/layer_{r}.bf16".to_string(), "bf16", MIB),
    ];
    let steps = vec![
        Step::new("step-1", "cli", files.clone()),
        Step::new("step-2", "cli", files).after("go-2"),
    ];
    let plan = Plan::until_stopped(steps, Duration::from_secs(200));
    let job = plan.submit(&cluster, &work, &archive, 1, "ckpt-outage");
    cluster.wait_running(&job, Duration::from_secs(60));
    let node = cluster.job_nodes(&job).remove(0);
    wait_archiving(&cluster, &node, &job, "step-1");
    std::thread::sleep(Duration::from_millis(1500));
    let watch = SafetyWatch::start(&cluster, std::slice::from_ref(&node), &job, &archive);

    // The store goes away.
    proxy.set("refuse");
    let down_at = now_s();
    let down = Instant::now();
    assert!(
        archive.manifests(&cluster).is_empty(),
        "step-1 was archived before the outage began: nothing to test\n{}",
        cluster.evidence(&job)
    );
    // The job commits its next checkpoint while the store is down: the commit returns at once.
    fs::write(work.join("go-2"), "").unwrap();
    let commit = out.join(&node).join("commit-step-2");
    cluster.wait_for(
        "the job to commit step-2",
        Duration::from_secs(30),
        Some(&job),
        || commit.exists(),
    );
    let commit_text = fs::read_to_string(&commit).unwrap();
    let secs: f64 = commit_text
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        secs < 2.0,
        "committing during the outage took {secs} s: {commit_text}"
    );
    std::thread::sleep(Duration::from_secs(2));
    let during = agent_ckpts(&cluster, &node, &job);
    assert!(
        during.iter().all(|c| c.state != CkptState::Archived),
        "archived while the store was down? {during:?}"
    );

    // The job ends normally while the store is still down.
    fs::write(work.join("stop"), "").unwrap();
    let stopped_at = now_s();
    cluster.assert_completes(
        &job,
        Duration::from_secs(60),
        "the job (during the store outage)",
    );
    assert!(
        down.elapsed() < OUTAGE,
        "the job took until after the outage to end ({:?}); the test proves nothing about ending during one",
        down.elapsed()
    );
    let hot = hot_entries(&cluster, &node, &job);
    assert!(
        hot.contains("step-1") && hot.contains("step-2"),
        "the unarchived checkpoints must stay on the hot tier after the job: {hot:?}\n{}",
        cluster.evidence(&job)
    );
    assert!(
        archive.manifests(&cluster).is_empty(),
        "published while the store was down?"
    );
    // What `sluice ckpt list` shows meanwhile: the checkpoints are retried, with the store's error.
    cluster.wait_for(
        "the agent to report the unreachable store",
        OUTAGE.saturating_sub(down.elapsed()),
        Some(&job),
        || {
            agent_ckpts(&cluster, &node, &job)
                .iter()
                .any(|c| c.state == CkptState::Retrying && c.error.is_some())
        },
    );

    // Training was unaffected: steps every ~0.1 s all through the outage until the job was told to
    // stop, with no stall.
    let times: Vec<f64> = task_file(&out, &node, "train")
        .lines()
        .filter_map(|l| l.parse().ok())
        .filter(|t| *t >= down_at && *t <= stopped_at)
        .collect();
    let max_gap = times.windows(2).map(|w| w[1] - w[0]).fold(0.0, f64::max);
    assert!(
        times.len() as f64 > (stopped_at - down_at) * 3.0 && max_gap < 1.5,
        "training stalled during the outage: {} steps in {:.1} s, longest pause {max_gap:.2} s",
        times.len(),
        stopped_at - down_at
    );

    // The store comes back: both checkpoints are archived, complete, and retention keeps step-2.
    std::thread::sleep(OUTAGE.saturating_sub(down.elapsed()));
    proxy.set("pass");
    let back = Instant::now();
    wait_manifests(&cluster, &archive, &["step-1", "step-2"], &job);
    let recovered_in = back.elapsed();
    check_manifests(&cluster, &archive, &["step-1", "step-2"], &job);
    // Once both are archived, retention keeps only step-2.
    wait_hot_tier_holds(&cluster, &node, &job, "step-2");
    watch.finish(&cluster, &job);
    eprintln!(
        "archived {recovered_in:?} after the store came back; proxy stats: {}",
        proxy.stats()
    );
    let written = Written::read(&out, std::slice::from_ref(&node), &["step-1", "step-2"]);
    let on_node = std::slice::from_ref(&node);
    assert_restores(&cluster, &archive, ("step-1", on_node), "step-1", &written);
}

// ------------------------------------------------ a damaged archive and the copy on the hot tier

/// The archive's copy of one file of the newest checkpoint is damaged; the node that wrote that
/// file still holds it, intact, on its hot tier (`--ckpt-keep`). A restore job on that node falls
/// back to the previous checkpoint — and must leave that intact copy where it is: it is the last
/// good copy of those bytes ("never delete the last good one").
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn ckpt_restore_from_a_damaged_archive_keeps_the_intact_hot_copy() {
    let (cluster, archive, work, out) = start(Backend::Garage, "hotcopy");
    let steps = ["step-1", "step-2"].map(|tag| Step::new(tag, "cli", shard_files()));
    let plan = Plan::until_archived(steps.into(), Duration::from_secs(200));
    let job = plan.submit(&cluster, &work, &archive, 2, "ckpt-hotcopy");
    cluster.assert_completes(&job, WRITER_TIMEOUT, "the checkpoint-writing job");
    let nodes = cluster.job_nodes(&job);
    let written = Written::read(&out, &nodes, &["step-1", "step-2"]);
    let holder = nodes[1].clone();
    wait_hot_tier_holds(&cluster, &holder, &job, "step-2");

    let victim = damage_object(&cluster, &archive, "step-2", "zero/bf16_zero_pp_rank_1_");
    let file = victim_file(&victim);
    let intact = written.node("step-2", &holder)[&file].clone();
    let on_holder = std::slice::from_ref(&holder);
    let restored = assert_restores(
        &cluster,
        &archive,
        ("latest", on_holder),
        "step-1",
        &written,
    );
    restored.assert_note(&cluster, &["step-2"]);

    // Wherever the agent keeps it now, the intact file must still be on the holder's hot tier.
    let jobs = cluster.hot_root(&holder).join("jobs");
    let copies: Vec<(PathBuf, String)> = fs::read_dir(&jobs)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.path())
                .collect::<Vec<_>>()
        })
        .unwrap_or_default()
        .into_iter()
        .map(|j| j.join("ckpt/step-2").join(&file))
        .filter(|p| p.is_file())
        .map(|p| {
            let sum = run(Command::new("sha256sum").arg(&p));
            let sum = sum
                .split_whitespace()
                .next()
                .unwrap_or_default()
                .to_string();
            (p, sum)
        })
        .collect();
    assert!(
        copies.iter().any(|(_, sum)| *sum == intact),
        "the only intact copy of step-2's {file} (the archive's is damaged) is gone from the hot \
         tier of {holder}; copies found: {copies:?}; step-2 dirs there: {:?}\n{}",
        fs::read_dir(&jobs)
            .map(|d| d
                .filter_map(|e| e.ok())
                .map(|e| e.path().join("ckpt"))
                .map(|p| (
                    p.display().to_string(),
                    fs::read_dir(&p).map(|r| r.count()).unwrap_or(0)
                ))
                .collect::<Vec<_>>())
            .unwrap_or_default(),
        cluster.evidence(&restored.job)
    );
}

// ----------------------------------------------- a commit right before the job ends (multi-node)

/// The most common checkpoint of all: the final one, committed on rank 0 right before the job
/// ends. The other node holds its shard but learns of the commit only through the archive; the
/// checkpoint must still be archived whole, and no node may delete its shard before that.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn ckpt_committed_just_before_the_job_ends_is_archived_from_every_node() {
    let (cluster, archive, work, out) = start(Backend::Garage, "final");
    let plan = Plan::ending_after_commit(
        vec![Step::new("final", "cli", shard_files())],
        Duration::from_secs(120),
    );
    let job = plan.submit(&cluster, &work, &archive, 2, "ckpt-final");
    cluster.assert_completes(&job, Duration::from_secs(180), "the job");
    let nodes = cluster.job_nodes(&job);
    let written = Written::read(&out, &nodes, &["final"]);
    let manifests = wait_complete_manifests(&cluster, &archive, &["final"], &job);
    assert_eq!(
        manifest_files(&manifests[0])
            .keys()
            .cloned()
            .collect::<BTreeSet<_>>(),
        written
            .union("final")
            .keys()
            .cloned()
            .collect::<BTreeSet<_>>(),
        "the archived checkpoint lacks files the job wrote"
    );
    for n in &nodes {
        wait_hot_tier_holds(&cluster, n, &job, "final");
    }
}
