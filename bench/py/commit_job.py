"""bench/run's `commit` case, inside a real `--ckpt-tier=ram --ckpt-archive=URL` job, as the job user:

    python commit_job.py WORK BYTES TAG

Saves a state dict of BYTES (bf16 and fp32 tensors) with sluice_ckpt.save into $SLUICE_CKPT_DIR/TAG
(the job's tmpfs), then runs `sluice ckpt commit TAG` and writes WORK/report.json: the wall clock
(time.time(), the host's clock, which the driver shares) just before the commit, when the CLI
returned, the file's size and the file system type of $SLUICE_CKPT_DIR. Then it waits for the
driver's WORK/go (the job stays alive while the agent flushes and archives), at most 600 s.
The driver copies tests/harness/jobreport.py beside it.
"""

import os
import subprocess
import sys
import time

import torch

import jobreport
import sluice_ckpt

work, total, tag = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ckpt = os.environ["SLUICE_CKPT_DIR"]
report = jobreport.Report(work, ckpt_dir=ckpt)

try:
    report["fs_type"] = jobreport.fs_type(ckpt)
    torch.manual_seed(0)
    half = total // 2
    state = {
        "fp32": torch.randn(half // 4 // 1024, 1024),
        "bf16": torch.randn((total - half) // 2 // 1024, 1024).to(torch.bfloat16),
    }
    path = sluice_ckpt.save(state, tag, commit=False)
    report["size"] = os.path.getsize(path)
    report["t_commit"] = time.time()
    p = subprocess.run([os.environ["SLUICE_CLI"], "ckpt", "commit", tag], capture_output=True, text=True, timeout=300)
    report["t_cli_returned"] = time.time()
    report["commit_output"] = (p.stdout + p.stderr).strip()
    if p.returncode != 0:
        report["errors"].append(f"sluice ckpt commit {tag} exited {p.returncode}: {report['commit_output']}")
except Exception as e:
    report["errors"].append(f"{type(e).__name__}: {e}")
report.write()
deadline = time.monotonic() + 600
while not os.path.exists(os.path.join(work, "go")) and time.monotonic() < deadline:
    time.sleep(0.1)
sys.exit(1 if report["errors"] else 0)
