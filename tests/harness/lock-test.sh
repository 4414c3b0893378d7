#!/usr/bin/env bash
# Tests of the test cluster lock's helpers (common.sh: take_cluster_lock, cluster_lock_processes,
# assert_no_daemon_holds_cluster_lock) and of cluster.sh closing the lock for what it starts (issue 32),
# without the cluster: on a lock file of its own (mktemp), with fake holders — `sleep` renamed (exec -a)
# to look like a daemon of the cluster (sluiced) or like a run (tests/run-all.sh). Takes a few seconds.
# Never touches /tmp/sluice-cluster.lock, never stops a real cluster (the "cluster.sh down" it exercises
# is a stub). Run as root, like the harness (to see every process's descriptors in /proc).
#
#   tests/harness/lock-test.sh        prints one line per check, then "N passed, M failed"
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# Whatever lock descriptor a caller left us (tests/run-all.sh's fd 9) is not ours to use or keep.
exec 9>&-
unset SLUICE_CLUSTER_LOCK_HELD
WORK=$(mktemp -d /tmp/sluice-lock-test.XXXXXX)
export SLUICE_CLUSTER_LOCK=$WORK/cluster.lock
: >"$SLUICE_CLUSTER_LOCK"
LOCK=$SLUICE_CLUSTER_LOCK
export SLUICE_LOCK_REPORT_EVERY=1
# Every waiter started here inherits this: never the real `cluster.sh down`.
DOWN_MARK=$WORK/down-called
export SLUICE_CLUSTER_DOWN_CMD="echo called >>$DOWN_MARK"
# shellcheck source=common.sh
source "$HERE/common.sh"
[[ $CLUSTER_LOCK == "$LOCK" && $CLUSTER_LOCK != /tmp/sluice-cluster.lock ]] || { echo "lock-test: refusing to run on $CLUSTER_LOCK" >&2; exit 2; }

PASSED=0 FAILED=0
PIDS=()
ok() { PASSED=$((PASSED + 1)); printf 'ok    %s\n' "$*"; }
bad() { FAILED=$((FAILED + 1)); printf 'FAIL  %s\n' "$*"; }
check() { local what=$1; shift; if "$@"; then ok "$what"; else bad "$what"; fi; }
cleanup() {
  local p
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done
  wait 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT

# Polls "$@" every 0.1 s for at most $1 seconds.
within() {
  local deadline=$((SECONDS * 10 + $1 * 10)) t=$((SECONDS * 10))
  shift
  until "$@"; do
    ((t < deadline)) || return 1
    sleep 0.1; t=$((t + 1))
  done
}
lock_is_held() { ! flock -n "$LOCK" true; }
lock_is_free() { flock -n "$LOCK" true; }
gone() { ! kill -0 "$1" 2>/dev/null; }
file_has() { grep -qF -- "$2" "$1" 2>/dev/null; }
count_in() { grep -cF -- "$2" "$1" 2>/dev/null || true; }

# Starts `sleep 300` as argv[0] $1, holding the lock (its own open file description); pid in $HOLDER.
start_holder() {
  (exec 9>>"$LOCK"; flock 9; exec -a "$1" sleep 300) &
  HOLDER=$!; PIDS+=("$HOLDER")
  within 5 lock_is_held || { bad "fake holder $1 took the lock"; return 1; }
  within 2 bash -c "tr '\\0' ' ' </proc/$HOLDER/cmdline | grep -q '^$1 '"
}
stop() { kill "$@" 2>/dev/null; local p; for p in "$@"; do within 5 gone "$p"; done; }

# Runs take_cluster_lock "$@" in the background (output in $WOUT), then prints GOT LOCK; pid in $WAITER.
N=0
start_waiter() {
  N=$((N + 1)); WOUT=$WORK/waiter-$N.out
  bash -c 'set -euo pipefail; source "$1"; shift; take_cluster_lock "$@"; echo "GOT LOCK held=$SLUICE_CLUSTER_LOCK_HELD"' \
    _ "$HERE/common.sh" "$@" >"$WOUT" 2>&1 &
  WAITER=$!; PIDS+=("$WAITER")
}

echo "lock-test: lock $LOCK, reports every ${SLUICE_LOCK_REPORT_EVERY} s"

# ------------------------------------------------------------------------------- SLUICE_CLUSTER_LOCK_HELD=1
start_holder tests/run-all.sh
out=$(SLUICE_CLUSTER_LOCK_HELD=1 timeout 5 bash -c 'source "$1"; take_cluster_lock; ls -l /proc/$$/fd/' _ "$HERE/common.sh" 2>&1)
check "SLUICE_CLUSTER_LOCK_HELD=1: returns at once, without opening the lock" \
  bash -c '[[ $1 == *"held by the run that started this one"* && $1 != *"$2"* ]]' _ "$out" "$LOCK"

# ------------------------------------------------------------------------------- (a) a run holds it: wait, say who
start_waiter
within 4 file_has "$WOUT" "pid $HOLDER (run, since "
check "(a) waiting: the report names the holder's pid and that it is a run" file_has "$WOUT" "pid $HOLDER (run, since "
check "(a) waiting: the report names the holder's command line" file_has "$WOUT" "): tests/run-all.sh 300"
check "(a) waiting: the report says what to do (another run, ends by itself)" file_has "$WOUT" "another run is using the test cluster; it ends by itself"
within 4 bash -c '(($(grep -c "held by:" "$1") >= 3))' _ "$WOUT"
check "(a) waiting: it reports again every SLUICE_LOCK_REPORT_EVERY (1 s): $(count_in "$WOUT" 'held by:') reports" \
  bash -c '(($(grep -c "held by:" "$1") >= 3))' _ "$WOUT"
check "(a) waiting: a run holds the lock, so nothing was stopped" test ! -e "$DOWN_MARK"
check "(a) waiting: still waiting while the run holds the lock" kill -0 "$WAITER"
stop "$HOLDER"
within 5 gone "$WAITER"
check "(a) once the run ends, the waiter takes the lock and goes on" file_has "$WOUT" "GOT LOCK held=1"
grep -q '' "$WOUT" && sed 's/^/      | /' "$WOUT" | head -8

# ------------------------------------------------------------------------------- a kept cluster's daemon holds it: restart
start_holder sluiced
KEPT=$HOLDER
SLUICE_CLUSTER_DOWN_CMD="echo called >>$DOWN_MARK; kill $KEPT" start_waiter
within 5 gone "$WAITER"
check "kept cluster: the report names the daemon" file_has "$WOUT" "pid $KEPT (daemon, since "
check "kept cluster: it says it stops the kept cluster" file_has "$WOUT" "only daemons of a test cluster kept with SLUICE_KEEP_CLUSTER=1 hold it"
check "kept cluster: the 'cluster.sh down' command ran" file_has "$DOWN_MARK" called
check "kept cluster: the run took the lock and went on, at once" file_has "$WOUT" "GOT LOCK held=1"
sed 's/^/      | /' "$WOUT"
rm -f "$DOWN_MARK"

# ------------------------------------------------------------------------------- a run and its daemon hold it: wait
# A run (tests/run-all.sh) whose child daemon shares its descriptor: the run uses the cluster, so wait.
(exec 9>>"$LOCK"; flock 9; (exec -a sluiced sleep 300) & exec -a tests/run-all.sh sleep 300) &
RUN=$!; PIDS+=("$RUN")
within 5 lock_is_held
within 2 bash -c "[[ -n \$(ps -o pid= --ppid $RUN) ]]"
CHILD=$(ps -o pid= --ppid "$RUN" | tr -d ' '); PIDS+=("$CHILD")
start_waiter
within 4 bash -c '(($(grep -c "held by:" "$1") >= 2))' _ "$WOUT"
check "run and its daemon: both named" bash -c 'grep -qF "pid $2 (run" "$1" && grep -qF "pid $3 (daemon" "$1"' _ "$WOUT" "$RUN" "$CHILD"
check "run and its daemon: nothing stopped, still waiting" bash -c '[[ ! -e $1 ]] && kill -0 $2' _ "$DOWN_MARK" "$WAITER"
stop "$RUN" "$CHILD"
within 5 gone "$WAITER"
check "run and its daemon: the waiter goes on once they end" file_has "$WOUT" "GOT LOCK"

# ------------------------------------------------------------------------------- --no-restart (bench/run --no-cluster)
start_holder sluiced
start_waiter --no-restart
within 4 bash -c '(($(grep -c "held by:" "$1") >= 2))' _ "$WOUT"
check "--no-restart: a kept cluster's daemon is named, not stopped, and the run waits" \
  bash -c 'grep -qF "does not stop it" "$1" && [[ ! -e $2 ]] && kill -0 $3' _ "$WOUT" "$DOWN_MARK" "$WAITER"
stop "$HOLDER"
within 5 gone "$WAITER"

# ------------------------------------------------------------------------------- (b) assert_no_daemon_holds_cluster_lock
start_holder sluiced
out=$(assert_no_daemon_holds_cluster_lock 2>&1); rc=$?
check "(b) assert fails while a fake sluiced holds the lock" test "$rc" -ne 0
check "(b) assert names the daemon's pid and command" bash -c '[[ $1 == *"pid $2 (daemon, held, since "*"): sluiced 300"* ]]' _ "$out" "$HOLDER"
printf '%s\n' "$out" | sed 's/^/      | /'
stop "$HOLDER"
check "(b) assert passes once the daemon is gone" assert_no_daemon_holds_cluster_lock
check "(b) assert passes in a child of the shell that holds the lock (run-all.sh -> run-e2e.sh)" \
  bash -c 'source "$1"; take_cluster_lock; bash -c "source \"\$1\"; assert_no_daemon_holds_cluster_lock" _ "$1"' _ "$HERE/common.sh"
# This shell holds the lock; a run waiting for it (file open, no lock) does not count, a daemon does.
exec 9>>"$LOCK"; flock -w 10 9
# 9>&-: the fakes must not share this shell's locked descriptor.
(exec 9>&- 8>>"$LOCK"; exec -a tests/run-all.sh flock 8) &
PIDS+=("$!"); WAITING_RUN=$!
within 2 bash -c "[[ -n \$(find /proc/$WAITING_RUN/fd -samefile '$LOCK' 2>/dev/null) ]]"
check "(b) assert ignores another run waiting for the lock" assert_no_daemon_holds_cluster_lock
(exec 9>&- 8>>"$LOCK"; exec -a sluiced flock 8) &
PIDS+=("$!"); WAITING_DAEMON=$!
within 2 bash -c "[[ -n \$(find /proc/$WAITING_DAEMON/fd -samefile '$LOCK' 2>/dev/null) ]]"
out=$(assert_no_daemon_holds_cluster_lock 2>&1); rc=$?
check "(b) assert fails on a daemon that has the lock open, even unlocked" \
  bash -c '[[ $1 -ne 0 && $2 == *"pid $3 (daemon, open"* ]]' _ "$rc" "$out" "$WAITING_DAEMON"
exec 9>&-
within 5 gone "$WAITING_RUN"; within 5 gone "$WAITING_DAEMON"

# ------------------------------------------------------------------------------- (c) cluster.sh closes the lock
# `cluster.sh status` only reads (pid files, sinfo, sockets): run it holding the lock on fd 9 and on fd 7,
# with a stub sinfo first in PATH that records which of its descriptors are open on the lock.
STUB=$WORK/stub; mkdir -p "$STUB"
cat >"$STUB/sinfo" <<EOF
#!/usr/bin/env bash
{ echo ran; for f in /proc/\$\$/fd/*; do [[ \$f -ef $LOCK ]] && echo "fd \${f##*/} open on the lock"; done; } >$WORK/sinfo-saw
echo "stub sinfo"
EOF
chmod +x "$STUB/sinfo"
exec 9>>"$LOCK"; flock -w 10 9; exec 7>>"$LOCK"
PATH=$STUB:$PATH timeout 60 bash "$HERE/cluster.sh" status >"$WORK/status.out" 2>&1
exec 7>&-
check "(c) cluster.sh status ran the stub sinfo" file_has "$WORK/sinfo-saw" ran
check "(c) what cluster.sh starts has no descriptor on the lock (fd 9 nor fd 7)" \
  bash -c '! grep -q "open on the lock" "$1"' _ "$WORK/sinfo-saw"
check "(c) the caller still holds the lock after cluster.sh closed its copy" lock_is_held
exec 9>&-
check "(c) and it is free once the caller closes it" lock_is_free
[[ -s $WORK/sinfo-saw ]] && sed 's/^/      | /' "$WORK/sinfo-saw"

echo "$PASSED passed, $FAILED failed"
((FAILED == 0))
