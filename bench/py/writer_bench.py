"""bench/run's `writer` case: the training-visible stall of saving one state dict, in this process.

    python writer_bench.py --bytes N --reps R --ram DIR --hot DIR --shm DIR

Every repetition times, in a rotating order, with time.perf_counter around the call only:
  memcpy       copying every tensor into preallocated tensors of the same shapes (dst.copy_(src))
  sluice       dcp.save(state, storage_writer=sluice_ckpt.SluiceWriter(tag, ckpt_dir=RAM, commit=False))
  sluice-async dcp.async_save(...) with the same writer: the call's return (its blocking part: the
               copy into the staging buffers kept from save to save); the future is then waited
               for, untimed
  sluice-save  sluice_ckpt.save(state, tag, ckpt_dir=RAM, commit=False) (torch.save through the writer)
  sluice-save-async  the same with async_=True (its own sluice_ckpt.Stager): until it returns
  sluice-save-reserved  the same with a Stager whose buffers were reserved (Stager.reserve, at
               set-up, untimed and finished) before the first save
  dcp-hot      dcp.save with DCP's stock FileSystemWriter into HOT (the NVMe hot tier)
  dcp-shm      the same into SHM (/dev/shm)
  dcp-async-shm  dcp.async_save with the stock FileSystemWriter into SHM: its blocking part
The asynchronous tools' buffers are kept from save to save: their first save (which allocates and
faults them in) is timed once before the repetitions, as `TOOL-first`; the repetitions are the
2nd and later saves of the same state dict, what a training loop sees. Between two saves the
tensors change in place (untimed), as training changes them. Each save goes to a fresh tag
directory, removed after the measurement (untimed). Prints one JSON object: {"bytes": ...,
"tensors": ..., "seconds": {tool: [s, ...]}, "errors": {tool: "..."}, ...}.
"""

import argparse
import json
import os
import shutil
import sys
import time

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

import sluice_ckpt

MIB = 1 << 20


def state_dict(total):
    """bf16 and fp32 tensors, half the bytes each: 64 MiB blocks (a transformer layer's weights)
    and a few 1 MiB ones (norms, biases), `total` bytes in all."""
    torch.manual_seed(0)
    out, left, i = {}, total, 0
    small = 4 * MIB if total >= 64 * MIB else 0
    for dtype in (torch.float32, torch.bfloat16):
        part = total // 2
        esz = torch.tensor([], dtype=dtype).element_size()
        for _ in range(small // MIB):
            out[f"layer{i}.norm.{str(dtype)[6:]}"] = torch.randn(MIB // esz).to(dtype)
            i += 1
        part -= small
        while part > 0:
            n = min(part, 64 * MIB)
            out[f"layer{i}.weight.{str(dtype)[6:]}"] = torch.randn(n // esz // 1024, 1024).to(dtype)
            part -= n
            i += 1
    got = sum(t.numel() * t.element_size() for t in out.values())
    assert got == total, (got, total)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bytes", type=int, required=True)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--ram", required=True)
    p.add_argument("--hot", required=True)
    p.add_argument("--shm", required=True)
    a = p.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    state = state_dict(a.bytes)
    dst = {k: torch.empty_like(v) for k, v in state.items()}
    for v in dst.values():
        v.zero_()  # faulted in: a plain copy into memory the process already has

    def memcpy(_):
        for k, v in state.items():
            dst[k].copy_(v)

    def sluice(d):
        dcp.save(state, storage_writer=sluice_ckpt.SluiceWriter(os.path.basename(d), ckpt_dir=a.ram, commit=False))

    pending = []

    def sluice_async(d):
        w = sluice_ckpt.SluiceWriter(os.path.basename(d), ckpt_dir=a.ram, commit=False)
        pending.append(dcp.async_save(state, storage_writer=w))

    def sluice_save(d):
        sluice_ckpt.save(state, os.path.basename(d), ckpt_dir=a.ram, commit=False)

    save_stager = sluice_ckpt.Stager()

    def sluice_save_async(d):
        pending.append(
            sluice_ckpt.save(state, os.path.basename(d), ckpt_dir=a.ram, commit=False, async_=True, stager=save_stager)
        )

    reserved_stager = sluice_ckpt.Stager()
    reserved_stager.reserve(state, wait=True)  # at set-up: the reserve had the time it needs

    def sluice_save_reserved(d):
        pending.append(
            sluice_ckpt.save(
                state, os.path.basename(d), ckpt_dir=a.ram, commit=False, async_=True, stager=reserved_stager
            )
        )

    def dcp_to(root):
        return lambda d: dcp.save(state, storage_writer=FileSystemWriter(d))

    def dcp_async(d):
        pending.append(dcp.async_save(state, storage_writer=FileSystemWriter(d)))

    tools = [
        ("memcpy", memcpy, None),
        ("sluice", sluice, a.ram),
        ("sluice-async", sluice_async, a.ram),
        ("sluice-save", sluice_save, a.ram),
        ("sluice-save-async", sluice_save_async, a.ram),
        ("sluice-save-reserved", sluice_save_reserved, a.ram),
        ("dcp-hot", dcp_to(a.hot), a.hot),
        ("dcp-shm", dcp_to(a.shm), a.shm),
        ("dcp-async-shm", dcp_async, a.shm),
    ]
    kept = ("sluice-async", "sluice-save-async", "sluice-save-reserved")  # buffers outlive a save
    seconds = {name: [] for name, _, _ in tools}
    seconds.update({f"{name}-first": [] for name in kept})
    errors = {}
    written = {}

    def measure(name, key, fn, d):
        try:
            t = time.perf_counter()
            fn(d)
            seconds[key].append(time.perf_counter() - t)
            while pending:
                pending.pop().result()
            if d:
                written[name] = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)
        except BaseException as e:  # one tool failing must not hide the others' numbers
            if not isinstance(e, Exception) and type(e).__name__ != "CheckpointException":
                raise
            errors[name] = f"{type(e).__name__}: {e}"
            pending.clear()
        finally:
            if d:
                shutil.rmtree(d, ignore_errors=True)

    def train_step():
        # Training changes the tensors between two saves (in place, as an optimizer step does).
        for v in state.values():
            v.add_(1)

    for name, fn, root in tools:
        if name in kept:
            measure(name, f"{name}-first", fn, os.path.join(root, f"{name}-first"))
            train_step()
    for rep in range(a.reps):
        k = rep % len(tools)
        for name, fn, root in tools[k:] + tools[:k]:
            if name in errors:
                continue
            measure(name, name, fn, os.path.join(root, f"{name}-{rep}") if root else None)
            train_step()
    print(json.dumps({
        "bytes": a.bytes,
        "tensors": len(state),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "seconds": seconds,
        "written": written,
        "errors": errors,
    }))


if __name__ == "__main__":
    sys.exit(main())
