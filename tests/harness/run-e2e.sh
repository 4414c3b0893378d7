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
# The test cluster lock: tests/run-all.sh holds it already (then this does nothing); on its own,
# this script takes it. The trap comes after it: a run stopped while waiting stops no cluster.
take_cluster_lock
trap finish EXIT

"$HARNESS_DIR/cluster.sh" up
# No daemon of the cluster just started may hold the lock (they would keep it for as long as a kept
# cluster runs, and the next run would wait: issue 32).
assert_no_daemon_holds_cluster_lock || die "a daemon of the test cluster holds $CLUSTER_LOCK (see above)"

log "test: cargo test --workspace --no-fail-fast -- --ignored --test-threads=1 $*"
# Every crate's cluster tests: those are the #[ignore]d ones ("needs the test cluster") — the jobs
# of sluice-e2e and e.g. the agent's archive conformance suite against Garage and Azurite.
# No backtraces: a failed e2e test's message carries the evidence (job output, log tails), and a
# stack of test-helper frames would bury it. --no-fail-fast: report every failing test file.
# 9>&-: tests restart agents (tests/tests/common/agents.rs spawns `setsid sluiced ...`), and a restarted
# agent must not inherit the lock either; this script (and its caller) hold it for the tests.
# Every line of the output gets the time it was written (a test's "ok" line is written when it ends),
# and the slowest tests are listed afterwards: where the suite's minutes go.
TIMES=$(mktemp)
rc=0
(cd "$REPO_ROOT" && RUST_BACKTRACE=0 cargo test --workspace --no-fail-fast -- --ignored --test-threads=1 "$@") 9>&- 2>&1 |
  while IFS= read -r line; do printf '%(%s)T %s\n' -1 "$line" | tee -a "$TIMES" | cut -d' ' -f2-; done || rc=$?
log "the slowest tests (seconds):"
awk '$2 == "running" { prev = $1; next }
     $2 == "test" && $3 != "result:" && prev { print $1 - prev, $3; prev = $1 }' "$TIMES" | sort -rn | head -n 15 >&2
rm -f "$TIMES"
((rc == 0)) || die "end-to-end tests failed (see above)"
assert_no_daemon_holds_cluster_lock || die "after the tests, a daemon holds $CLUSTER_LOCK (see above)"
