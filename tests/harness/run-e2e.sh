#!/usr/bin/env bash
# The end-to-end suite in one command: install what is missing, build, bring the test cluster up,
# run the workspace's #[ignore]d tests (sluice-e2e's jobs one at a time), and always bring the
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

# tests/run-all.sh holds the lock already (then this takes nothing); on its own, this script takes it.
take_cluster_for_this_run

"$HARNESS_DIR/cluster.sh" up
# No daemon of the cluster just started may hold the lock (they would keep it for as long as a kept
# cluster runs, and the next run would wait: issue 32).
assert_no_daemon_holds_cluster_lock || die "a daemon of the test cluster holds $CLUSTER_LOCK (see above)"

log "test: cargo test --workspace --exclude sluice-e2e --no-fail-fast -- --ignored $*"
log "test: cargo test --workspace --test e2e --no-fail-fast -- --ignored --test-threads=1 $*"
# The #[ignore]d tests of every crate: the root-only ones of the agent, the stage crate and the CLI
# (in-process agents, no cluster: they run side by side, on as many threads as there are cores) and
# the cluster's (the archive conformance suite against Garage and Azurite, then sluice-e2e's jobs,
# one at a time: they share the three nodes and assert what is left on them). `--workspace --test
# e2e`, not `-p sluice-e2e`: the workspace's features, so nothing is compiled again.
# No backtraces: a failed e2e test's message carries the evidence (job output, log tails), and a
# stack of test-helper frames would bury it. --no-fail-fast: report every failing test file.
# 9>&-: tests restart agents (tests/tests/common/agents.rs spawns `setsid sluiced ...`), and a restarted
# agent must not inherit the lock either; this script (and its caller) hold it for the tests.
# Every line of the output gets the time it was written (a test's "ok" line is written when it ends),
# and the slowest tests of sluice-e2e are listed afterwards: where the suite's minutes go (sed, not
# head: head's early exit could end sort with SIGPIPE, which pipefail and set -e made a silent
# failure of the whole run after every test had passed).
TIMES=$(mktemp)
rc=0
ignored_tests() {
  cd "$REPO_ROOT" || return 1
  local r=0
  RUST_BACKTRACE=0 cargo test --workspace --exclude sluice-e2e --no-fail-fast -- --ignored "$@" || r=1
  RUST_BACKTRACE=0 cargo test --workspace --test e2e --no-fail-fast -- --ignored --test-threads=1 "$@" || r=1
  return "$r"
}
(ignored_tests "$@") 9>&- 2>&1 |
  while IFS= read -r line; do printf '%(%s)T %s\n' -1 "$line" | tee -a "$TIMES" | cut -d' ' -f2-; done || rc=$?
log "the slowest tests (seconds):"
awk '$2 == "Running" { e2e = ($3 == "tests/e2e.rs") }
     $2 == "running" { prev = e2e ? $1 : 0; next }
     $2 == "test" && $3 != "result:" && prev { print $1 - prev, $3; prev = $1 }' "$TIMES" | sort -rn | sed -n 1,15p >&2
rm -f "$TIMES"
((rc == 0)) || die "end-to-end tests failed (see above)"
assert_no_daemon_holds_cluster_lock || die "after the tests, a daemon holds $CLUSTER_LOCK (see above)"
