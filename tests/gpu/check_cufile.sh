#!/usr/bin/env bash
# The GPU check of the checkpoint writer (issue 13 item 4), for a machine with an NVIDIA GPU:
# saves CUDA tensors through the cuFile (GPUDirect Storage) path and through the pinned
# bounce-buffer path of sluice_ckpt.Writer, verifies both files byte for byte against the tensors,
# and prints each path's throughput against a plain cudaMemcpy + pwrite baseline (torch .cpu(),
# then os.pwrite and fsync) on the same file system.
#
#   tests/gpu/check_cufile.sh [DIR] [MIB]      DIR: where the files go (default: $SLUICE_CKPT_DIR,
#                                              else /var/tmp); MIB: bytes of tensors (default 1024)
#
# Uses $PYTHON, else the harness's PyTorch venv ($SLUICE_TORCH_VENV or /opt/sluice-test/torch-venv),
# and libsluice_writer.so from $SLUICE_WRITER_LIB or target/release (built here if missing).
# Exits 0 when both paths were checked, 1 on a mismatch or error, 77 (skipped) when there is no
# GPU, and 77 after checking the bounce path when cuFile is unavailable (the probe says why).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "SKIP: no NVIDIA GPU here (nvidia-smi missing or lists no GPU): the cuFile check needs one" >&2
  exit 77
fi
PY=${PYTHON:-${SLUICE_TORCH_VENV:-/opt/sluice-test/torch-venv}/bin/python}
if [[ -z ${SLUICE_WRITER_LIB:-} ]]; then
  if [[ ! -f target/release/libsluice_writer.so || ! -f target/release/sluice-cufile-probe ]]; then
    echo "building libsluice_writer.so: cargo build --release -p sluice-writer" >&2
    cargo build --release -p sluice-writer >&2
  fi
  export SLUICE_WRITER_LIB=$PWD/target/release/libsluice_writer.so
fi
exec "$PY" tests/gpu/check_cufile.py --dir "${1:-${SLUICE_CKPT_DIR:-/var/tmp}}" --mib "${2:-1024}"
