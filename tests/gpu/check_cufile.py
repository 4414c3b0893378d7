"""CUDA tensors -> file through sluice_ckpt.Writer's cuFile path and its pinned bounce-buffer path,
verified byte for byte, timed against torch .cpu() + os.pwrite + fsync. Run by check_cufile.sh
(see there); exits 77 when it cannot check (no GPU; cuFile unavailable after the bounce check)."""

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

SKIP = 77


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--mib", type=int, default=1024)
    args = ap.parse_args()

    import torch

    import sluice_ckpt

    if not torch.cuda.is_available():
        print("SKIP: torch sees no CUDA device: the cuFile check needs a GPU", file=sys.stderr)
        return SKIP
    available, why = sluice_ckpt.probe_cufile(timeout=30.0)
    print(f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; "
          f"libsluice_writer {sluice_ckpt.library_path()}; cuFile ({sluice_ckpt.cufile_library()}): {why}")

    # bf16 and fp32 tensors of whole 4 KiB pages (GDS writes them without bounce buffers), then one
    # odd-sized tensor: the file's unaligned tail.
    total = args.mib << 20
    g = torch.Generator(device="cuda").manual_seed(0)
    tensors, left = [], total
    while left > (64 << 20):
        n = 64 << 20
        dtype = torch.bfloat16 if len(tensors) % 2 else torch.float32
        tensors.append(torch.randn(n // torch.tensor([], dtype=dtype).element_size(), generator=g, device="cuda", dtype=dtype))
        left -= n
    tensors.append(torch.randn(max(1, left // 4) - 3, generator=g, device="cuda"))
    torch.cuda.synchronize()
    nbytes = sum(t.numel() * t.element_size() for t in tensors)

    d = tempfile.mkdtemp(prefix="sluice-gpu-check-", dir=args.dir)
    results, failures = {}, []

    def verify(path, label):
        with open(path, "rb") as f:
            for i, t in enumerate(tensors):
                want = t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
                got = f.read(len(want))
                if got != want:
                    at = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                    failures.append(f"{label}: tensor {i} differs at byte {at} of {len(want)}")
                    return
            if f.read(1):
                failures.append(f"{label}: the file is longer than the tensors")

    def through_writer(mode):
        path = os.path.join(d, f"{mode}.bin")
        torch.cuda.synchronize()
        start = time.perf_counter()
        with sluice_ckpt.Writer(path) as w:
            direct = w.is_direct
            took = {w.write_tensor(t, cuda_path=mode) for t in tensors}
        secs = time.perf_counter() - start
        verify(path, mode)
        results[mode] = (secs, f"paths taken {sorted(took)}, O_DIRECT {direct}")
        os.unlink(path)

    def baseline():
        path = os.path.join(d, "baseline.bin")
        torch.cuda.synchronize()
        start = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        off = 0
        for t in tensors:
            host = t.reshape(-1).view(torch.uint8).cpu().numpy()  # cudaMemcpy to pageable memory
            mv = memoryview(host)
            while mv:
                n = os.pwrite(fd, mv, off)
                off += n
                mv = mv[n:]
        os.fsync(fd)
        os.close(fd)
        secs = time.perf_counter() - start
        verify(path, "baseline")
        results["baseline"] = (secs, "torch .cpu() + os.pwrite + fsync")
        os.unlink(path)

    try:
        baseline()
        through_writer("bounce")
        if available:
            through_writer("cufile")
    finally:
        try:
            os.rmdir(d)
        except OSError:
            pass

    base = results["baseline"][0]
    print(f"{nbytes / 2**30:.2f} GiB of CUDA tensors ({len(tensors)}) to {args.dir}:")
    for label in ("baseline", "bounce", "cufile"):
        if label in results:
            secs, note = results[label]
            print(f"  {label:9} {nbytes / secs / 2**30:7.2f} GiB/s  {secs:7.3f} s  {base / secs:5.2f}x baseline  ({note})")
    if failures:
        for f in failures:
            print("MISMATCH:", f, file=sys.stderr)
        return 1
    print("verified: every file byte-identical to the tensors")
    if not available:
        print(f"SKIP (cuFile path): {why}", file=sys.stderr)
        return SKIP
    return 0


if __name__ == "__main__":
    sys.exit(main())
