#!/usr/bin/env bash
# The end-to-end core on another Slurm release (issue 28): Debian 13's Slurm 24.11, beside the
# Debian 12 Slurm 22.05 that run-e2e.sh uses. The plugin is built against that release's headers
# (so it announces its plugin_version), then the test cluster comes up with munge, slurmctld, the
# three slurmd and the agents in the release's root ($SLURM_NEXT_ROOT, made by install.sh; see
# cluster.sh, SLUICE_SLURM_ROOT), the stores on this machine; the core tests ($E2E_CORE_TESTS in
# common.sh) run in that root, so that their sbatch, srun, squeue and scontrol are the release's
# own. The first, the options in sbatch --help, also shows that the release loaded the plugin
# (Slurm refuses one built for another major.minor).
#
#   tests/harness/run-e2e-slurm.sh [TEST FILTER...]    (default: the core above)
#
# SLUICE_KEEP_CLUSTER=1 leaves the cluster running afterwards (cluster.sh down stops it). Run as root.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

[[ $(id -u) -eq 0 ]] || die "run-e2e-slurm.sh must run as root"

"$HARNESS_DIR/install.sh"
ROOT=${SLUICE_SLURM_ROOT:-$SLURM_NEXT_ROOT}
[[ -x $ROOT/usr/sbin/slurmctld ]] || die "no Slurm in $ROOT (tests/harness/install.sh makes $SLURM_NEXT_ROOT)"
release=$(chroot "$ROOT" slurmctld -V)
# The plugin of that release: its own target directory, so that the workspace's plugin (this
# machine's Slurm) stays as it is.
PLUGIN_TARGET=$REPO_ROOT/target/slurm-${release##* }
log "build: the plugin against $release's headers ($ROOT/usr/include) into $PLUGIN_TARGET"
(cd "$REPO_ROOT" && SLURM_INCLUDE_DIR=$ROOT/usr/include CARGO_TARGET_DIR=$PLUGIN_TARGET cargo build -p sluice-spank)
PLUGIN=$PLUGIN_TARGET/debug/libspank_sluice.so
log "build: cargo build --workspace; the e2e test binary"
E2E=$(cd "$REPO_ROOT" && cargo build --workspace >&2 &&
  cargo test --workspace --test e2e --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "e2e":
        print(m["executable"])')
[[ -x $E2E ]] || die "cannot find the e2e test binary"

take_cluster_for_this_run

SLUICE_SLURM_ROOT=$ROOT SLUICE_PLUGIN_SO=$PLUGIN "$HARNESS_DIR/cluster.sh" up
assert_no_daemon_holds_cluster_lock || die "a daemon of the test cluster holds $CLUSTER_LOCK (see above)"
filters=("$@")
((${#filters[@]})) || filters=(--exact "${E2E_CORE_TESTS[@]}")
log "test ($release): ${filters[*]}"
# 9>&-: a test that restarts an agent must not pass the lock to it (see run-e2e.sh).
chroot "$ROOT" env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
  LANG=C.UTF-8 RUST_BACKTRACE=0 "$E2E" --ignored --test-threads=1 "${filters[@]}" 9>&- \
  || die "end-to-end tests on $release failed (see above)"
assert_no_daemon_holds_cluster_lock || die "after the tests, a daemon holds $CLUSTER_LOCK (see above)"
log "end-to-end core on $release: passed"
