//! The RAM tier (`--ckpt-tier=ram`, issue 13) in real Slurm jobs, with the harness's PyTorch, as the
//! unprivileged test user. The harness's `[fast_tier]` gives each such job its own tmpfs of
//! 768 MiB (mounted by the node's agent — a real tmpfs, not a stand-in).
//!
//! One job saves a 448 MiB state dict with `torch.save` into `$SLUICE_CKPT_DIR/s1` (on the tmpfs)
//! and commits it. While the agent flushes it to the NVMe hot tier (`.flush-s1` appears there), the
//! test SIGKILLs the agent (it looks every 2 ms: the flush reads nothing back and takes well under a
//! second, so s1 is large enough for the kill to land inside it), checks that the flush was cut short (no `s1` on the hot tier, a partial
//! `.flush-s1`), and starts the agent again: the tmpfs outlived it, and the new agent flushes and
//! archives the checkpoint, byte-identical to what the job saved. Then the job tries to save a
//! second state dict larger than its share: a plain write fails with `ENOSPC` ("No space left on
//! device") and `torch.save` fails too (PyTorch words it "unexpected pos"), as docs/user-guide.md says, and
//! the committed checkpoint is untouched. At the
//! job's end the tmpfs is gone and the checkpoint stays on the hot tier and in the archive.

use crate::common::*;
use serde_json::Value;
use std::fs;
use std::path::Path;
use std::time::Duration;

const NODE: &str = "n1";

const SAVE_PY: &str = r#"
import errno, hashlib, os, subprocess, sys, time
import torch
import jobreport

work = sys.argv[1]
ckpt = os.environ["SLUICE_CKPT_DIR"]
report = jobreport.Report(work, ckpt_dir=ckpt)
put = report.put

try:
    put("fs_type", jobreport.fs_type(ckpt))
    torch.manual_seed(7)
    state = {"w": torch.randn(96, 1 << 20), "b16": torch.randn(32, 1 << 20).to(torch.bfloat16)}
    os.makedirs(os.path.join(ckpt, "s1"))
    path = os.path.join(ckpt, "s1", "model.pt")
    torch.save(state, path)
    put("sha256", hashlib.sha256(open(path, "rb").read()).hexdigest())
    put("size", os.path.getsize(path))
    p = subprocess.run([os.environ["SLUICE_CLI"], "ckpt", "commit", "s1"], capture_output=True, text=True)
    put("commit", p.stdout + p.stderr)
    # Training goes on while the test kills and restarts the agent; it says when to go on.
    deadline = time.monotonic() + 150
    while not os.path.exists(os.path.join(work, "go-on")) and time.monotonic() < deadline:
        time.sleep(0.2)
    big = os.path.join(ckpt, "too-big")
    try:
        torch.save({"w": torch.zeros(200, 1 << 20)}, big)
        put("too_big_torch", "saved")
    except Exception as e:
        put("too_big_torch", f"{type(e).__name__}: {e}")
    if os.path.exists(big):
        os.remove(big)
    try:
        with open(big, "wb") as f:
            for _ in range(800):
                f.write(bytes(1 << 20))
        put("too_big", "written")
    except OSError as e:
        put("too_big", f"OSError errno {e.errno}: {e.strerror}")
    if os.path.exists(big):
        os.remove(big)
    put("s1_after", hashlib.sha256(open(path, "rb").read()).hexdigest())
except Exception as e:
    import traceback
    traceback.print_exc()
    report["errors"].append(f"{type(e).__name__}: {e}")
    report.write()
sys.exit(1 if report["errors"] else 0)
"#;

/// The job's report writer, beside `save.py`, which imports it.
const JOBREPORT_PY: &str = include_str!("../harness/jobreport.py");

fn report(work: &Path) -> Value {
    fs::read(work.join("report.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(Value::Null)
}

/// `sha256sum`'s hash of `path` (the job hashes with Python's hashlib).
fn sha256(path: &Path) -> String {
    let out = std::process::Command::new("sha256sum")
        .arg(path)
        .output()
        .unwrap_or_else(|e| panic!("sha256sum: {e}"));
    assert!(
        out.status.success(),
        "sha256sum {}: {:?}",
        path.display(),
        out
    );
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string()
}

#[test]
#[ignore = "needs the test cluster (tests/harness/run-e2e.sh)"]
fn ram_tier_checkpoint_survives_an_agent_killed_mid_flush_and_a_full_share() {
    let cluster = Cluster::for_sluice();
    let python = cluster.torch_python();
    let work = cluster.workdir("ram-tier");
    fs::write(work.join("save.py"), SAVE_PY).unwrap();
    fs::write(work.join("jobreport.py"), JOBREPORT_PY).unwrap();
    let archive = Archive::new(&cluster, Backend::File, "ram-tier");
    let script = format!(
        "#!/bin/bash\nexport OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 SLUICE_CLI={cli}\n{py} {w}/save.py {w}\n",
        cli = cluster.user_cli().display(),
        py = python.display(),
        w = work.display(),
    );
    let archive_opt = format!("--ckpt-archive={}", archive.url);
    let job = cluster.submit(
        &work,
        &["-w", NODE, "--ckpt-tier=ram", archive_opt.as_str()],
        &script,
    );
    let ev = || cluster.evidence(&job);

    // The job saved and committed s1 on its tmpfs; the agent starts flushing it.
    cluster.wait_for(
        "the job to save and commit s1",
        Duration::from_secs(120),
        Some(&job),
        || report(&work)["commit"].is_string(),
    );
    let saved = report(&work);
    assert_eq!(
        saved["fs_type"].as_str(),
        Some("tmpfs"),
        "$SLUICE_CKPT_DIR: {saved}\n{}",
        ev()
    );
    let hot = cluster.hot_root(NODE).join(format!("jobs/{}/ckpt", job.id));
    // Looked at every few milliseconds, not at the cluster's usual pace: the flush of s1 takes a
    // few tenths of a second (it reads nothing back), and the kill must land inside it.
    poll_closely(
        Duration::from_millis(2),
        Duration::from_secs(30),
        || (hot.join(".flush-s1").exists() || hot.join("s1").exists()).then_some(()),
        || {
            format!(
                "the agent did not start flushing s1 (.flush-s1 on the hot tier) in 30 s\n{}",
                ev()
            )
        },
    );
    let agent = cluster.kill_agent(NODE);
    assert!(
        hot.join(".flush-s1").exists() && !hot.join("s1").exists(),
        "the flush of s1 ({} bytes) finished before the agent was killed: this run did not test a \
         flush cut short\n{}",
        saved["size"],
        ev()
    );
    let flushed = || fs::metadata(hot.join(".flush-s1/model.pt")).map_or(0, |m| m.len());
    eprintln!(
        "killed the agent of {NODE} with {} of {} bytes flushed",
        flushed(),
        saved["size"]
    );

    // The tmpfs outlived the agent; the next one flushes and archives s1.
    cluster.start_agent(&agent);
    cluster.wait_for(
        "s1 to be archived after the restart",
        Duration::from_secs(90),
        Some(&job),
        || {
            cluster
                .agent_ckpt(NODE, &job, "s1")
                .is_some_and(|c| c.state == sluice_proto::msg::CkptState::Archived)
        },
    );
    assert!(
        !hot.join(".flush-s1").exists(),
        "the torn flush is still there\n{}",
        ev()
    );
    assert_eq!(
        sha256(&hot.join("s1/model.pt")),
        saved["sha256"].as_str().unwrap_or_default(),
        "the flushed s1 is not what the job saved\n{}",
        ev()
    );
    archive
        .check_manifest(&cluster, "s1")
        .unwrap_or_else(|e| panic!("{e}\n{}", ev()));

    // Past its share, the job's save fails with ENOSPC; the committed s1 is untouched.
    fs::write(work.join("go-on"), b"").unwrap();
    let end = cluster.wait_end(&job, Duration::from_secs(120));
    let done = report(&work);
    assert_eq!(
        (end.state.as_str(), end.exit_code.as_str()),
        ("COMPLETED", "0:0"),
        "{done}\n{}",
        ev()
    );
    // A plain write gets ENOSPC; torch.save reports it its own way (its zip writer's "unexpected
    // pos"), but fails all the same — nothing is silently short.
    let too_big = done["too_big"].as_str().unwrap_or_default();
    assert!(
        too_big.contains("errno 28") && too_big.contains("No space left on device"),
        "a write past the share gave: {too_big:?}\n{}",
        ev()
    );
    let too_big_torch = done["too_big_torch"].as_str().unwrap_or_default();
    assert!(
        !too_big_torch.is_empty() && too_big_torch != "saved",
        "torch.save past the share gave: {too_big_torch:?}\n{}",
        ev()
    );
    eprintln!("past the share: write: {too_big}; torch.save: {too_big_torch}");
    assert_eq!(done["s1_after"], saved["sha256"], "s1 changed in RAM");
    // The job's end removes its tmpfs; s1 stays on the hot tier (kept, archived).
    let ram_dir = Path::new(saved["ckpt_dir"].as_str().unwrap())
        .parent()
        .unwrap()
        .to_path_buf();
    cluster.wait_for(
        "the job's RAM tier to go after its end",
        Duration::from_secs(60),
        Some(&job),
        || !ram_dir.exists(),
    );
    assert!(
        hot.join("s1/model.pt").exists(),
        "s1 left the hot tier\n{}",
        ev()
    );
}
