"""bench/run's `replicas` case: one task per node of a real 3-node `--ckpt-tier=ram` job, as the job user:

    python replicas_job.py WORK BYTES

Run 1 (SLURM_RESTART_COUNT 0): writes WORK/ready-NODE and waits for the driver's WORK/go (the driver
takes the archive down first, where the case asks for that). Builds this rank's state dict of BYTES
(bf16 and fp32 tensors, seeded by the rank); times a plain copy of it into preallocated tensors
(the floor a save's stall is compared with); saves `s1` with sluice_ckpt.save(async_=True) (its
first save allocates the kept buffers), and rank 0 commits it once every node's file is written;
then every rank saves `s2` the same way at once (timed: the stall while the node flushes, replicates
and archives `s1`), and rank 0 commits `s2` once every node's file is written. Writes
WORK/save/NODE/report.json: the copy's and the saves' stalls, the wall clock (time.time(), the host's
clock, which the driver shares) just before `s2`'s commit, and the file's size. Then it waits for
WORK/end (the driver ends the job) or to be requeued, at most 900 s.

Run 2 (requeued): loads `s2`, which --ckpt-restore=latest restored, and compares it with the state
dict rebuilt from the seed: WORK/load/NODE/report.json says whether every tensor is equal.

The driver copies tests/harness/jobreport.py beside it.
"""

import os
import subprocess
import sys
import time

import torch

import jobreport
import sluice_ckpt

work, total = sys.argv[1], int(sys.argv[2])
rank = int(os.environ["SLURM_PROCID"])
ranks = int(os.environ["SLURM_NTASKS"])
node = os.environ["SLURMD_NODENAME"]
run = int(os.environ.get("SLURM_RESTART_COUNT") or 0) + 1
filename = f"rank{rank}.pt"


def state_dict():
    torch.manual_seed(rank)
    half = total // 2
    return {
        "fp32": torch.randn(half // 4 // 1024, 1024),
        "bf16": torch.randn((total - half) // 2 // 1024, 1024).to(torch.bfloat16),
    }


def wait_for(path, what, limit=300):
    deadline = time.monotonic() + limit
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} ({path}) after {limit} s")
        time.sleep(0.05)


def all_ranks(prefix):
    """Waits until every rank wrote WORK/PREFIX-RANK."""
    for r in range(ranks):
        wait_for(os.path.join(work, f"{prefix}-{r}"), f"{prefix} of rank {r}")


def touch(name):
    with open(os.path.join(work, name), "w"):
        pass


def commit(tag):
    p = subprocess.run([os.environ["SLUICE_CLI"], "ckpt", "commit", tag], capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        raise RuntimeError(f"sluice ckpt commit {tag} exited {p.returncode}: {(p.stdout + p.stderr).strip()}")


def timed_save(state, tag):
    """The stall of an asynchronous save (until it returns); waits for its write untimed."""
    t0 = time.perf_counter()
    fut = sluice_ckpt.save(state, tag, filename=filename, commit=False, async_=True)
    stall = time.perf_counter() - t0
    path = fut.result()
    return stall, path


def save_run(report):
    touch(f"ready-{node}")
    wait_for(os.path.join(work, "go"), "go from the driver", limit=600)
    state = state_dict()
    dst = {k: torch.empty_like(v) for k, v in state.items()}
    copies = []
    for _ in range(3):
        t0 = time.perf_counter()
        for k, v in state.items():
            dst[k].copy_(v)
        copies.append(time.perf_counter() - t0)
    del dst
    report["memcpy_s"] = sorted(copies)[1]
    report["stall_s1"], _ = timed_save(state, "s1")
    touch(f"saved-s1-{rank}")
    if rank == 0:
        all_ranks("saved-s1")
        commit("s1")
        touch("committed-s1")
    else:
        wait_for(os.path.join(work, "committed-s1"), "s1's commit")
    report["stall_s2"], path = timed_save(state, "s2")
    report["size"] = os.path.getsize(path)
    touch(f"saved-s2-{rank}")
    if rank == 0:
        all_ranks("saved-s2")
        report["t_commit"] = time.time()
        commit("s2")
        report["t_committed"] = time.time()


def load_run(report):
    loaded = sluice_ckpt.load("s2", filename=filename)
    want = state_dict()
    report["equal"] = sorted(loaded) == sorted(want) and all(torch.equal(loaded[k], want[k]) for k in want)
    report["tensors"] = len(loaded)


phase = "save" if run == 1 else "load"
os.makedirs(os.path.join(work, phase, node), exist_ok=True)
report = jobreport.Report(os.path.join(work, phase, node), rank=rank, node=node, run=run)
try:
    save_run(report) if run == 1 else load_run(report)
except Exception as e:
    report["errors"].append(f"{type(e).__name__}: {e}")
report.write()
if run == 1:
    deadline = time.monotonic() + 900
    while not os.path.exists(os.path.join(work, "end")) and time.monotonic() < deadline:
        time.sleep(0.2)
sys.exit(1 if report["errors"] else 0)
