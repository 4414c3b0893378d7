#!/usr/bin/env bash
# The end-to-end suite in one command: install what is missing, build, bring the test cluster up,
# run the workspace's cluster tests (the #[ignore]d ones) one at a time, and always bring the
# cluster down again.
#
#   tests/harness/run-e2e.sh [TEST FILTER...]     e.g. run-e2e.sh stage_in
#
# SLUICE_KEEP_CLUSTER=1 leaves the cluster running afterwards for inspection (cluster.sh down stops it).
# Run as root (it installs packages, starts daemons and submits jobs as the test user).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

[[ $(id -u) -eq 0 ]] || die "run-e2e.sh must run as root"

"$HARNESS_DIR/install.sh"

log "build: cargo build --workspace"
(cd "$REPO_ROOT" && cargo build --workspace)

finish() {
  local rc=$?
  if [[ ${SLUICE_KEEP_CLUSTER:-0} == 1 ]]; then
    log "cluster left running (SLUICE_KEEP_CLUSTER=1); stop it with $HARNESS_DIR/cluster.sh down"
  else
    "$HARNESS_DIR/cluster.sh" down || true
  fi
  exit "$rc"
}
trap finish EXIT

"$HARNESS_DIR/cluster.sh" up

log "test: cargo test --workspace --no-fail-fast -- --ignored --test-threads=1 $*"
# Every crate's cluster tests: those are the #[ignore]d ones ("needs the test cluster") — the jobs
# of sluice-e2e and e.g. the agent's archive conformance suite against Garage and Azurite.
# No backtraces: a failed e2e test's message carries the evidence (job output, log tails), and a
# stack of test-helper frames would bury it. --no-fail-fast: report every failing test file.
(cd "$REPO_ROOT" && RUST_BACKTRACE=0 cargo test --workspace --no-fail-fast -- --ignored --test-threads=1 "$@")
