#!/usr/bin/env bash
# A rolling upgrade, half done (issue 28): the test cluster with parts of two releases in the
# same jobs. The previous release ($PREVIOUS_RELEASE in common.sh) is built once from git into
# $PREVIOUS_DIR (its sluiced and its plugin); then the cluster runs three times:
#   1. n1's agent upgraded (this tree's sluiced), n2's and n3's not (the previous release's);
#   2. n1's agent not upgraded, n2's and n3's upgraded;
#      (1 and 2 with this tree's plugin: a node whose agent is not upgraded has a newer plugin)
#   3. every agent upgraded, the plugin not (the plugin and the agent are separate packages; and a
#      job that started before its node's upgrade ends, in slurmstepd, with the plugin it started with);
# and each time the end-to-end core ($E2E_CORE_TESTS in common.sh) passes, which covers what agents
# do together in one job: job start (stage-in on 3 nodes), step staging, peers (the origin read once
# per job), a checkpoint committed on 3 nodes and restored, a restore through the peers. In 1 and 2
# every upgraded agent's log must name the previous release's peers it met.
#
#   tests/harness/run-e2e-mixed.sh [TEST FILTER...]    (default: the core above)
#
# Run as root, on this machine's Slurm (run-e2e-slurm.sh is the other-Slurm-release suite).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

[[ $(id -u) -eq 0 ]] || die "run-e2e-mixed.sh must run as root"

"$HARNESS_DIR/install.sh"

# The previous release's agent and plugin: from git (the clone must have the commit: a shallow
# clone needs `git fetch --unshallow`), built once, kept outside the clone.
PREVIOUS_AGENT=$PREVIOUS_DIR/sluiced
PREVIOUS_PLUGIN=$PREVIOUS_DIR/libspank_sluice.so
if [[ -x $PREVIOUS_AGENT && -f $PREVIOUS_PLUGIN ]]; then
  log "previous release: present ($PREVIOUS_DIR)"
else
  # A shallow clone (CI's may be one) fetches that commit from where it was cloned from, once.
  git -C "$REPO_ROOT" cat-file -e "$PREVIOUS_RELEASE^{commit}" 2>/dev/null \
    || { [[ $(git -C "$REPO_ROOT" rev-parse --is-shallow-repository) == true ]] &&
      git -C "$REPO_ROOT" fetch -q --unshallow origin 2>/dev/null &&
      git -C "$REPO_ROOT" cat-file -e "$PREVIOUS_RELEASE^{commit}" 2>/dev/null; } \
    || die "the previous release $PREVIOUS_RELEASE is not in this clone's history: git fetch --unshallow (or a full clone)"
  log "previous release: building ${PREVIOUS_RELEASE:0:12} into $PREVIOUS_DIR (a few minutes, once)"
  rm -rf "$PREVIOUS_DIR/src"
  mkdir -p "$PREVIOUS_DIR/src"
  git -C "$REPO_ROOT" archive "$PREVIOUS_RELEASE" | tar -x -C "$PREVIOUS_DIR/src"
  (cd "$PREVIOUS_DIR/src" && export CARGO_TARGET_DIR=$PREVIOUS_DIR/target &&
    cargo build -p sluice-agent --bin sluiced && cargo build -p sluice-spank)
  # Only the two are kept (the build tree is about 1 GB).
  install -m 0755 "$PREVIOUS_DIR/target/debug/sluiced" "$PREVIOUS_AGENT"
  install -m 0755 "$PREVIOUS_DIR/target/debug/libspank_sluice.so" "$PREVIOUS_PLUGIN"
  rm -rf "$PREVIOUS_DIR/src" "$PREVIOUS_DIR/target"
fi
log "previous release: $("$PREVIOUS_AGENT" --version)"

log "build: cargo build --workspace"
(cd "$REPO_ROOT" && cargo build --workspace)
log "this tree: $("$REPO_ROOT/target/debug/sluiced" --version)"

take_cluster_for_this_run

filters=("$@")
((${#filters[@]})) || filters=(--exact "${E2E_CORE_TESTS[@]}")
core() {
  assert_no_daemon_holds_cluster_lock || die "a daemon of the test cluster holds $CLUSTER_LOCK (see above)"
  (cd "$REPO_ROOT" && RUST_BACKTRACE=0 cargo test --workspace --test e2e -- --ignored --test-threads=1 "${filters[@]}") 9>&- \
    || die "the mixed-release cluster ($1) failed (see above)"
}
for previous_nodes in "n2 n3" "n1"; do
  log "rolling upgrade: the agents of ${previous_nodes} on the previous release, the rest on this tree"
  SLUICE_PREVIOUS_NODES=$previous_nodes SLUICE_PREVIOUS_AGENT=$PREVIOUS_AGENT "$HARNESS_DIR/cluster.sh" up
  core "the agents of ${previous_nodes} previous"
  # What the admin reads: each upgraded agent names the peers of the previous release it met.
  for n in "${NODES[@]}"; do
    [[ " $previous_nodes " == *" $n "* ]] && continue
    for p in $previous_nodes; do
      grep -q "peer $p runs .*the two speak peer protocol" "$SLUICE_LOG_DIR/$n.log" \
        || die "the upgraded agent of $n does not say in its log ($SLUICE_LOG_DIR/$n.log) that peer $p runs the previous release"
    done
  done
done
log "rolling upgrade: every agent on this tree, the plugin on the previous release"
SLUICE_PLUGIN_SO=$PREVIOUS_PLUGIN "$HARNESS_DIR/cluster.sh" up
# The tests expect sbatch to refuse the options this tree added as unrecognized (common/mod.rs).
SLUICE_E2E_PREVIOUS_PLUGIN=1 core "the plugin previous"
log "rolling upgrade: all three passed"
