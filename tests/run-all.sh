#!/usr/bin/env bash
# Every test of sluice, in one command, on a fresh Debian 12 machine as root (README: "Two commands").
# Installs what is missing (apt, npm, pip, cargo; Garage is built once into $CARGO_HOME/bin and
# reused), then runs, in order, stopping at the first failure:
#   1. cargo fmt --check, cargo clippy -D warnings          (the gates, for the whole workspace,
#                                                            bench/ included)
#   2. cargo build, cargo test --workspace                  (unit tests, in-process agent tests),
#      then the same binaries as the test user               (root-only tests must say "ignored"),
#      then python/tests: sluice_ckpt with the harness's PyTorch,
#      then tests/harness/package-test.sh                   (the .debs and the wheel in a clean Debian root)
#   3. tests/harness/lock-test.sh                           (the cluster lock's helpers, no cluster: seconds)
#      SLUICE_KEEP_CLUSTER=1 demo/run.sh                    (the demo, leaving its cluster up: then no
#                                                            daemon may hold the lock, and the next step
#                                                            takes it at once)
#      tests/harness/run-e2e.sh                             (real Slurm cluster + Garage + Azurite:
#                                                            end-to-end jobs, archive conformance)
#   4. bench/run --smoke --no-cluster                       (the benchmark harness on tiny data, on
#                                                            the cluster the end-to-end suite kept)
#   5. tests/harness/run-e2e-slurm.sh                       (the end-to-end core on Slurm 24.11)
#      tests/harness/run-e2e-mixed.sh                       (a rolling upgrade: two releases in a job)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=harness/common.sh
source tests/harness/common.sh
export CARGO_TERM_COLOR=never

# Each step says how long the one before it took, and the run's total at the end: where CI's
# minutes go (issue 25 kept steps 1-4 under 25 minutes with installs cached; issue 28 adds step 5
# and keeps the whole under 60).
RUN_START=$SECONDS STEP_START=$SECONDS STEP_NAME=""
step() {
  [[ -z $STEP_NAME ]] || printf '==> took %ds: %s\n' $((SECONDS - STEP_START)) "$STEP_NAME" >&2
  STEP_NAME=$* STEP_START=$SECONDS
  printf '\n==> %s\n' "$*" >&2
}

[[ $(id -u) -eq 0 ]] || { echo "tests/run-all.sh must run as root (it installs packages and starts a Slurm cluster)" >&2; exit 1; }

step "install prerequisites"
tests/harness/install.sh
if command -v rustup >/dev/null 2>&1; then
  rustup component list --installed 2>/dev/null | grep -q '^rustfmt' || rustup component add rustfmt
  rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy
fi
# Installed: the scripts started below (the demo, run-e2e.sh, bench/run) skip install.sh's checks.
export SLUICE_INSTALL_DONE=1

step "cargo fmt --all --check"
cargo fmt --all --check

step "cargo clippy --workspace --all-targets -- -D warnings"
cargo clippy --workspace --all-targets -- -D warnings

# `cargo test` builds libraries as rlibs only: the writer's cdylib (libsluice_writer.so, which the C
# ABI test and python/tests load) and the binaries come from a build first, as on a clean clone.
step "cargo build --workspace"
cargo build --workspace

step "cargo test --workspace"
cargo test --workspace

step "the same test binaries as the unprivileged test user (root-only tests must report ignored)"
tests/harness/unit-as-user.sh

# The checkpoint writer's Python package (python/) with the harness's PyTorch, over the
# target/debug/libsluice_writer.so that cargo test just built (about 15 s).
step "sluice_ckpt (python/tests) with PyTorch from ${SLUICE_TORCH_VENV:-/opt/sluice-test/torch-venv}"
"${SLUICE_TORCH_VENV:-/opt/sluice-test/torch-venv}/bin/python" -m unittest discover -s python/tests -v
# bench/run --cases gpu's script on host tensors (--device cpu): its logic, on machines without a GPU.
PYTHONPATH=python "${SLUICE_TORCH_VENV:-/opt/sluice-test/torch-venv}/bin/python" bench/py/gpu_bench.py \
  --device cpu --dir /var/tmp --gib 0.125 --reps 1

# The Debian packages and the wheel (packaging/build-debs.sh, of the debug build) installed into a clean
# Debian 12 root made once by install.sh, through a throwaway overlay (about 25 s; no cluster).
step "the packages in a clean Debian root (tests/harness/package-test.sh)"
tests/harness/package-test.sh

# The cluster lock's helpers on a lock file of the test's own, with fake holders (about 12 s): that a
# waiting run says who holds the lock, stops a kept cluster nobody uses, and that cluster.sh passes the
# lock to nothing it starts (issue 32). Before the lock: it neither needs nor touches the cluster.
step "the test cluster lock's helpers (tests/harness/lock-test.sh)"
tests/harness/lock-test.sh

# The demo as a newcomer runs it to explore, leaving its cluster up (issue 32): afterwards no process
# may hold the cluster lock, and the lock step below takes it at once; run-e2e then brings up its
# own cluster over the kept one. (About 80 s; its output goes to a file, shown when it fails.)
step "SLUICE_KEEP_CLUSTER=1 demo/run.sh, then the cluster-using steps without a step in between"
demo_log=$(mktemp /tmp/sluice-demo-kept.XXXXXX.log)
SLUICE_KEEP_CLUSTER=1 demo/run.sh >"$demo_log" 2>&1 || { tail -n 60 "$demo_log" >&2; echo "the demo failed (whole output: $demo_log)" >&2; exit 1; }
grep -q "cluster left running" "$demo_log" || { echo "the demo did not leave its cluster up ($demo_log)" >&2; exit 1; }
assert_no_daemon_holds_cluster_lock || { echo "the demo's kept cluster holds the test cluster lock (see above): the next run would wait for ever" >&2; exit 1; }

# The test cluster is one per machine (fixed ports, /etc/slurm): hold its lock while using it. Tools
# that take the lock themselves (bench/run) see SLUICE_CLUSTER_LOCK_HELD and do not wait for it.
# take_cluster_lock (common.sh) says who holds it while it waits, and stops a kept cluster nobody uses.
step "the test cluster lock ($CLUSTER_LOCK)"
lock_wait_from=$SECONDS
take_cluster_lock
((SECONDS - lock_wait_from < 5)) || { echo "the test cluster lock took $((SECONDS - lock_wait_from)) s behind the demo's kept cluster: nothing else holds it, so it must be free at once" >&2; exit 1; }

# The end-to-end suite keeps its cluster for the benchmark smoke run (--no-cluster: a second
# `cluster.sh up` would cost about 25 s and test nothing new); it goes down after the smoke run, or
# when either fails.
step "end-to-end on the local Slurm cluster"
trap 'tests/harness/cluster.sh down >/dev/null 2>&1 9>&- || true' EXIT
SLUICE_KEEP_CLUSTER=1 tests/harness/run-e2e.sh

step "benchmark harness smoke run on the end-to-end suite's cluster (tiny data; targets are not judged here)"
bench/run --smoke --no-cluster --out /tmp/sluice-bench-smoke.json
tests/harness/cluster.sh down 9>&-
trap - EXIT

# Sites as they are (issue 28), each on a cluster of its own under the lock held above: the
# end-to-end core on Slurm 24.11 (a Debian 13 root made by install.sh; the plugin built against its
# headers), then a rolling upgrade half done (agents and plugin of the previous release beside this
# tree's, three ways; the previous release is built once from git, outside the clone).
step "the end-to-end core on Slurm 24.11 (tests/harness/run-e2e-slurm.sh)"
tests/harness/run-e2e-slurm.sh

step "a rolling upgrade: agents of two releases in one job (tests/harness/run-e2e-mixed.sh)"
tests/harness/run-e2e-mixed.sh
step "done: every step passed in $((SECONDS - RUN_START))s"
