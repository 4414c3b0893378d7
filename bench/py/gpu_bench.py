"""bench/run --cases gpu: the GPU checkpoint path of one rank, in one process, on this node (issue 31).

    python gpu_bench.py --dir DIR [--gib 4] [--reps 3] [--out FILE.json]

A bf16/fp32 state dict of --gib GiB on the GPU (64 MiB tensors and an odd-sized one), and, in this
run, the stall a training loop sees against the floor the hardware sets:

  floor           one device-to-host copy into pinned buffers allocated beforehand (non_blocking,
                  then synchronize): the least any asynchronous save can stall
  first           sluice_ckpt.save(async_=True)'s stall at the first save of a fresh Stager (it
                  allocates and pins the buffers: about a second per GiB)
  first-reserved  the same after Stager.reserve(state) had the time it needs (issue 31, item 2)
  later           the 2nd and later saves (the kept buffers)
  dcp-sluice      dcp.async_save(..., storage_writer=SluiceWriter) until it returns, 2nd+ save
  dcp-stock       dcp.async_save(..., storage_writer=FileSystemWriter) until it returns (DCP's own
                  staging: a fresh copy at every save), 2nd+ save
and GPU -> file on DIR: tests/gpu/check_cufile.py (bounce path, and cuFile where the probe says it
is available, each verified byte for byte, against torch .cpu() + pwrite + fsync), beside
`dd oflag=direct` of the same size on DIR.

Without a CUDA device it prints why and writes {"skipped": ...}: a visible skip, exit status 0.
--device cpu runs the stall rows on host tensors instead (no pinning, no GPU -> file rows): a check
of the benchmark's own logic on machines without a GPU, not a measurement of the GPU path.
Prints one line per row and writes the JSON to --out. Takes 1-5 minutes for 4 GiB.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "python"))

MIB = 1 << 20


def device_state(gib, torch, device):
    """bf16 and fp32 tensors of 64 MiB on `device`, and one odd-sized fp32 tensor, `gib` GiB in all."""
    g = torch.Generator(device=device).manual_seed(0)
    out, left, i = {}, int(gib * (1 << 30)), 0
    while left > 64 * MIB:
        dtype = torch.bfloat16 if i % 2 else torch.float32
        n = 64 * MIB // torch.tensor([], dtype=dtype).element_size()
        out[f"layer{i}.{str(dtype)[6:]}"] = torch.randn(n, generator=g, device=device, dtype=dtype)
        left -= 64 * MIB
        i += 1
    out["tail.float32"] = torch.randn(max(1, left // 4) - 3, generator=g, device=device)
    return out


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def gpu_to_file(a, report, nbytes):
    """GPU -> file on a.dir: the writer's check (verified byte for byte), and dd with O_DIRECT of
    the same size."""
    mib = max(64, nbytes >> 20)
    check = subprocess.run(
        [sys.executable, os.path.join(REPO, "tests/gpu/check_cufile.py"), "--dir", a.dir, "--mib", str(mib)],
        capture_output=True, text=True,
    )
    report["gpu_to_file"] = check.stdout.strip().splitlines()
    report["gpu_to_file_status"] = check.returncode
    report["gpu_to_file_error"] = check.stderr[-4000:]
    ddfile = os.path.join(a.dir, f".sluice-gpu-bench-dd-{os.getpid()}")
    count = max(1, mib // 8)
    try:
        dd = ["dd", "if=/dev/zero", f"of={ddfile}", "bs=8M", f"count={count}", "oflag=direct", "conv=fsync", "status=none"]
        report["dd_direct_gib_s"] = count * 8 * MIB / timed(lambda: subprocess.run(dd, check=True)) / (1 << 30)
    except (OSError, subprocess.CalledProcessError) as e:
        report["dd_direct_error"] = str(e)
    finally:
        if os.path.exists(ddfile):
            os.unlink(ddfile)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True, help="where the files go: the node's checkpoint tier")
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    a = ap.parse_args()
    gpu = a.device == "cuda"

    def finish(report):
        if a.out:
            with open(a.out, "w") as f:
                json.dump(report, f, indent=1)
            print(f"[gpu] JSON: {a.out}")
        return 0

    import torch

    if gpu and not torch.cuda.is_available():
        why = f"no CUDA device (torch {torch.__version__}: torch.cuda.is_available() is False)"
        print(f"[gpu] SKIPPED: {why}; the gpu case needs an NVIDIA GPU")
        return finish({"skipped": why})

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    import sluice_ckpt

    sync = torch.cuda.synchronize if gpu else (lambda: None)
    state = device_state(a.gib, torch, a.device)
    sync()
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    work = tempfile.mkdtemp(prefix="sluice-gpu-bench-", dir=a.dir)
    report = {
        "gpu": torch.cuda.get_device_name(0) if gpu else "none (--device cpu: a check of the logic)",
        "torch": torch.__version__,
        "bytes": nbytes,
        "tensors": len(state),
        "dir": a.dir,
        "cufile_probe": sluice_ckpt.probe_cufile(timeout=30.0)[1],
        "seconds": {},
    }
    secs = report["seconds"]

    def train_step():
        for v in state.values():
            v.add_(1)
        sync()

    # The floor: one device-to-host copy into pinned buffers that exist already.
    pinned = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=gpu) for k, v in state.items()}

    def copy_to_pinned():
        for k, v in state.items():
            pinned[k].copy_(v, non_blocking=gpu)
        sync()

    copy_to_pinned()
    secs["floor"] = [timed(copy_to_pinned) for _ in range(a.reps)]
    del pinned

    def stall(stager):
        lease = []
        t = timed(lambda: lease.append(stager.stage(state)[1]))
        lease[0].release()
        return t

    fresh = sluice_ckpt.Stager()
    secs["first"] = [stall(fresh)]
    secs["later"] = []
    for _ in range(a.reps):
        train_step()
        secs["later"].append(stall(fresh))
    fresh.close()
    del fresh
    reserved = sluice_ckpt.Stager()
    reserved.reserve(state, wait=True)
    secs["first-reserved"] = [stall(reserved)]
    reserved.close()
    del reserved

    def async_saves(name, writer):
        times = []
        for rep in range(a.reps + 1):  # the first save (buffers allocated) is not counted
            train_step()
            d = os.path.join(work, f"{name}-{rep}")
            start = time.perf_counter()
            fut = dcp.async_save(state, storage_writer=writer(d))
            times.append(time.perf_counter() - start)
            fut.result()
            shutil.rmtree(d, ignore_errors=True)
        secs[name] = times[1:]

    async_saves("dcp-sluice", lambda d: sluice_ckpt.SluiceWriter(os.path.basename(d), ckpt_dir=work, commit=False))
    async_saves("dcp-stock", lambda d: FileSystemWriter(d))
    shutil.rmtree(work, ignore_errors=True)
    del state
    if gpu:
        torch.cuda.empty_cache()
        gpu_to_file(a, report, nbytes)

    floor = statistics.median(secs["floor"])
    print(f"[gpu] {report['gpu']}, torch {report['torch']}, {nbytes / 2**30:.2f} GiB in {report['tensors']} "
          f"tensors, files on {a.dir}; cuFile: {report['cufile_probe']}")
    for name, what in (
        ("floor", "device -> pinned host copy (the floor)"),
        ("first", "sluice_ckpt.save(async_=True), 1st save, no reserve"),
        ("first-reserved", "sluice_ckpt.save(async_=True), 1st save after Stager.reserve"),
        ("later", "sluice_ckpt.save(async_=True), 2nd+ save"),
        ("dcp-sluice", "dcp.async_save(SluiceWriter), 2nd+ save"),
        ("dcp-stock", "dcp.async_save(FileSystemWriter), 2nd+ save"),
    ):
        s = statistics.median(secs[name])
        print(f"[gpu] stall  {what:58} {s:8.3f} s  {s / floor:6.2f}x the floor")
    for line in report.get("gpu_to_file", []):
        print(f"[gpu] file   {line}")
    if "dd_direct_gib_s" in report:
        print(f"[gpu] file   dd if=/dev/zero oflag=direct bs=8M on {a.dir}: {report['dd_direct_gib_s']:.2f} GiB/s")
    finish(report)
    if report.get("gpu_to_file_status", 0) not in (0, 77):
        print(f"[gpu] GPU -> file check FAILED ({report['gpu_to_file_status']}):\n{report['gpu_to_file_error']}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
