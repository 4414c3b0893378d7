#!/usr/bin/env bash
# The sluice test cluster on one machine: munge, slurmctld and three virtual nodes
# n1-n3 (one slurmd each), Garage (S3), Azurite (Azure Blob), one sluice agent per node, and a
# Prometheus server that scrapes the agents' metrics every second.
#
#   cluster.sh up       stop whatever an earlier run left, wipe job state, start everything fresh
#   cluster.sh down     stop everything `up` started (also after a failed `up`); safe to call twice
#   cluster.sh status   what runs, sinfo, the agent sockets
#
# Switches for `up` (environment):
#   SLUICE_NO_PLUGIN=1  empty plugstack.conf: Slurm without sluice, for comparison
#   SLUICE_NO_AGENTS=1  do not start sluiced
#   SLUICE_NO_GARAGE=1  do not start Garage (no s3:// store in the agent config)
#   SLUICE_STAGE_CONCURRENCY=N  the agents' [stage] concurrency (default 16)
#   SLUICE_PREVIOUS_NODES="n2 n3" SLUICE_PREVIOUS_AGENT=PATH  those nodes run that sluiced (a rolling
#                       upgrade half done; tests/harness/run-e2e-mixed.sh)
#   SLUICE_SLURM_ROOT=DIR  Slurm, munge and the agents in DIR, another Slurm release (see below)
#
# `up` writes $ENV_FILE (/run/sluice-test/env), which the end-to-end tests read. Run as root.
set -euo pipefail
# Nothing this script starts may hold the test cluster lock (fd 9 of tests/run-all.sh, demo/run.sh,
# bench/run): a daemon that inherited it would keep it held for as long as a kept cluster runs, and
# every later run would wait (issue 32). Closing it here does not release the caller's lock (a flock
# belongs to the open file description, which the caller still has). close_cluster_lock_fds closes it
# on any other descriptor too.
exec 9>&-
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
close_cluster_lock_fds

PLUGIN_SO=/usr/local/lib/sluice/spank_sluice.so
BUILT_PLUGIN=${SLUICE_PLUGIN_SO:-$REPO_ROOT/target/debug/libspank_sluice.so}
SLUICED=${SLUICED:-$REPO_ROOT/target/debug/sluiced}
AGENT_CONFIG=/etc/sluice/sluice.toml
GARAGE_DIR=$TEST_ROOT/garage
GARAGE_CONF=$GARAGE_DIR/garage.toml
AZURITE_DIR=$TEST_ROOT/azurite
PROMETHEUS_DIR=$TEST_ROOT/prometheus
PROMETHEUS_PORT=9470
# Each agent's [metrics] port: n1 9471, n2 9472, n3 9473 (three agents on one host).
metrics_port() { echo $((PROMETHEUS_PORT + ${1#n})); }
# ckpt-faulty is reached through tests' fault-injecting proxy on 127.0.0.1:$FAULT_PROXY_PORT, and
# datasets-relayed through a test's byte-counting relay on 127.0.0.1:$ORIGIN_RELAY_PORT (what the
# origin served, counted on its side).
S3_BUCKETS=(datasets ckpt ckpt-faulty datasets-relayed)
FAULT_PROXY_PORT=3911
ORIGIN_RELAY_PORT=3912
# Peer transfers between the agents: the cluster secret (root's, 0600, like munge.key), and each
# agent's peer port: n1 7071, n2 7072, n3 7073 (three agents on one host).
PEER_SECRET=/etc/sluice/peer.key
# The shared tier's stand-in (see write_agent_config).
SHARED_TIER_ROOT=$TEST_ROOT/shared
peer_port() { echo $((7070 + ${1#n})); }
S3_ENDPOINT=http://127.0.0.1:3900
AZ_CONTAINERS=(datasets ckpt)
# The Azurite account every Azure SDK knows (public, documented by Microsoft; not a secret).
AZ_ACCOUNT=devstoreaccount1
AZ_KEY='Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=='
AZ_ENDPOINT=http://127.0.0.1:10000/$AZ_ACCOUNT
AZ_CONN="DefaultEndpointsProtocol=http;AccountName=$AZ_ACCOUNT;AccountKey=$AZ_KEY;BlobEndpoint=$AZ_ENDPOINT;"
# Daemons start with this environment only, as a service manager would start them: nothing from the
# caller's shell (AWS_CA_BUNDLE, RUST_LOG, a user's PATH) leaks into Slurm, the agents or the jobs.
CLEAN_ENV=(env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 NO_COLOR=1)

# Another Slurm release (issue 28). SLUICE_SLURM_ROOT=DIR, a Debian root holding that release's Slurm
# and munge ($SLURM_NEXT_ROOT, made by install.sh): munge, slurmctld, the slurmd and the agents run
# in DIR (chroot), as the functions named in `slurm_side` calls below; the stores and Prometheus run
# here. DIR sees these paths of this machine at the same place: what the tests, the jobs and the
# agents share. The root in use is recorded in $RUN_DIR/slurm-root, so that `down` (and an `up`
# without the variable) stops it.
SLURM_ROOT=${SLUICE_SLURM_ROOT:-}
SLURM_ROOT_RECORD=$RUN_DIR/slurm-root
SLURM_ROOT_MOUNTS=(/proc /sys /dev /tmp /home "$REPO_ROOT" "$TEST_ROOT" /etc/sluice /run/sluice "$RUN_DIR"
  "$SLUICE_LOG_DIR" "$SLURM_LOG_DIR" "$VENV")

need_root() { [[ $(id -u) -eq 0 ]] || die "cluster.sh must run as root"; }

# ---------------------------------------------------------------------------------------------- processes

# Is process $1 alive? `kill -0` plus a look at its state, so that a child of ours that exited and
# was not reaped yet (a zombie) counts as gone.
pid_running() {
  local pid=$1 stat
  kill -0 "$pid" 2>/dev/null || return 1
  stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
  stat=${stat##*) }
  [[ ${stat:0:1} != Z ]]
}

# Is the process in pid file $1 alive, and does its command line contain $2? (Guards against pid
# reuse.) A process spawned a moment ago may still be between the execs of setsid → env → its
# program, when /proc/PID/cmdline names an earlier program (or nothing, during an exec): while it
# lives, its command line is read again for up to 2 s before it counts as another program.
pid_alive() {
  local pidfile=$1 needle=$2 pid tries=10
  [[ -f $pidfile ]] || return 1
  pid=$(tr -dc '0-9' <"$pidfile")
  [[ -n $pid ]] || return 1
  while pid_running "$pid"; do
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q -- "$needle" && return 0
    ((--tries > 0)) || return 1
    sleep 0.2
  done
  return 1
}

# Stops the process of one pid file: SIGTERM, up to 15 s, then SIGKILL. Only that pid, nothing by name.
stop_pidfile() {
  local pidfile=$1 needle=$2 what=$3 pid
  if pid_alive "$pidfile" "$needle"; then
    pid=$(tr -dc '0-9' <"$pidfile")
    log "stopping $what (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    if ! WAIT_SECONDS=15 wait_until bash -c "! kill -0 $pid"; then
      log "$what (pid $pid) ignored SIGTERM for 15 s; SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
      WAIT_SECONDS=5 wait_until bash -c "! kill -0 $pid" || log "WARNING: $what (pid $pid) survives SIGKILL"
    fi
  fi
  rm -f "$pidfile"
}

# Starts "$@" in its own session in the background, logging to $2's file, and records its pid.
# setsid does not fork here (a script's background child leads no process group), so the pid
# recorded is the one that ends up running the program, after the execs of setsid and env.
#   spawn PIDFILE LOGFILE CMD...
spawn() {
  local pidfile=$1 logfile=$2
  shift 2
  setsid "${CLEAN_ENV[@]}" "$@" >>"$logfile" 2>&1 </dev/null &
  echo $! >"$pidfile"
}

pid_gone() { ! pid_running "$1"; }

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# Refuses to start when something else already listens on a port we need, naming the process.
require_port_free() {
  local port=$1 what=$2
  if port_open "$port"; then
    die "port $port (for $what) is already in use: $(ss -Hltnp "sport = :$port" 2>/dev/null | head -1)"
  fi
}

# ---------------------------------------------------------------------------------------------- the Slurm side

# Runs the function "$@" of this script where Slurm runs: here, or in $SLURM_ROOT through chroot
# (this script again, with the switches the function reads).
slurm_side() {
  if [[ -z $SLURM_ROOT || ${SLUICE_IN_SLURM_ROOT:-0} == 1 ]]; then
    "$@"
    return
  fi
  chroot "$SLURM_ROOT" "${CLEAN_ENV[@]}" HOME=/root SLUICE_IN_SLURM_ROOT=1 SLUICE_SLURM_ROOT="$SLURM_ROOT" \
    SLUICE_NO_PLUGIN="${SLUICE_NO_PLUGIN:-0}" SLUICE_AGENT_LOG="${SLUICE_AGENT_LOG:-info}" \
    SLUICED="$SLUICED" SLUICE_PLUGIN_SO="$BUILT_PLUGIN" SLUICE_TEST_ROOT="$TEST_ROOT" \
    SLUICE_RAM_TIER_ROOT="$RAM_TIER_ROOT" SLUICE_PREVIOUS_NODES="${SLUICE_PREVIOUS_NODES:-}" \
    SLUICE_PREVIOUS_AGENT="${SLUICE_PREVIOUS_AGENT:-}" "$HARNESS_DIR/cluster.sh" side "$@"
}

# Makes $SLURM_ROOT see what it shares with this machine, and the test users as they are here.
enter_slurm_root() {
  [[ -x $SLURM_ROOT/usr/sbin/slurmctld && -x $SLURM_ROOT/usr/sbin/munged ]] \
    || die "no Slurm and munge in $SLURM_ROOT: run tests/harness/install.sh"
  local d u f
  for d in "${SLURM_ROOT_MOUNTS[@]}"; do
    mkdir -p "$d" "$SLURM_ROOT$d"
    mountpoint -q "$SLURM_ROOT$d" || mount --rbind "$d" "$SLURM_ROOT$d"
  done
  cp /etc/hosts "$SLURM_ROOT/etc/hosts"
  for u in "$TEST_USER" "$OTHER_USER"; do
    for f in passwd group shadow; do
      grep -q "^$u:" "$SLURM_ROOT/etc/$f" || getent "$f" "$u" >>"$SLURM_ROOT/etc/$f"
    done
  done
  echo "$SLURM_ROOT" >"$SLURM_ROOT_RECORD"
  log "slurm root: $SLURM_ROOT ($(chroot "$SLURM_ROOT" slurmctld -V))"
}

# Stops what runs in the recorded root, then takes its shared paths away (deepest first).
leave_slurm_root() {
  local root i
  root=$(cat "$SLURM_ROOT_RECORD" 2>/dev/null) || return 0
  if [[ -x $root$HARNESS_DIR/cluster.sh ]]; then
    SLURM_ROOT=$root slurm_side stop_slurm || log "WARNING: stopping Slurm in $root failed"
    SLURM_ROOT=$root slurm_side stop_munge || log "WARNING: stopping munge in $root failed"
    SLURM_ROOT=$root slurm_side wipe_slurm_state || true
  fi
  rm -f "$SLURM_ROOT_RECORD"
  for ((i = ${#SLURM_ROOT_MOUNTS[@]} - 1; i >= 0; i--)); do
    if mountpoint -q "$root${SLURM_ROOT_MOUNTS[i]}"; then
      umount -R "$root${SLURM_ROOT_MOUNTS[i]}" 2>/dev/null || umount -R -l "$root${SLURM_ROOT_MOUNTS[i]}"
    fi
  done
  log "slurm root: left $root"
}

# ---------------------------------------------------------------------------------------------- munge

start_munge() {
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  if [[ ! -s /etc/munge/munge.key ]]; then
    log "munge: creating /etc/munge/munge.key"
    mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
  fi
  log "munge: starting munged"
  "${CLEAN_ENV[@]}" runuser -u munge -- /usr/sbin/munged
  WAIT_SECONDS=10 wait_until bash -c 'munge -n | unmunge' \
    || { tail_logs /var/log/munge/munged.log; die "munge does not work: 'munge -n | unmunge' fails"; }
}

stop_munge() { stop_pidfile /run/munge/munged.pid munged munged; }

# ---------------------------------------------------------------------------------------------- slurm

write_slurm_conf() {
  local host
  host=$(hostname)
  mkdir -p /etc/slurm /var/spool/slurmctld "$SLURM_LOG_DIR"
  cat >/etc/slurm/slurm.conf <<EOF
# Written by sluice's tests/harness/cluster.sh — three virtual nodes on one host.
ClusterName=sluicetest
SlurmctldHost=$host(127.0.0.1)
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SlurmUser=root
SlurmdUser=root
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile=$SLURM_LOG_DIR/slurmctld.log
SlurmdLogFile=$SLURM_LOG_DIR/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig=/etc/slurm/plugstack.conf
PrologFlags=Alloc
# A node that stopped responding (e.g. slurmd restarted by this script) returns to service by itself.
ReturnToService=2
# Finished jobs stay visible to 'scontrol show job' for 10 minutes: the tests read their end state there.
MinJobAge=600
NodeName=n[1-3] NodeHostname=$host NodeAddr=127.0.0.1 Port=17001-17003 CPUs=2 RealMemory=6000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

write_plugstack() {
  if [[ ${SLUICE_NO_PLUGIN:-0} == 1 ]]; then
    log "plugstack: empty (SLUICE_NO_PLUGIN=1)"
    echo "# sluice test cluster: started without the sluice plugin (SLUICE_NO_PLUGIN=1)" >/etc/slurm/plugstack.conf
    return
  fi
  [[ -f $BUILT_PLUGIN ]] || die "no plugin at $BUILT_PLUGIN: run 'cargo build --workspace' first (or SLUICE_NO_PLUGIN=1)"
  mkdir -p "$(dirname "$PLUGIN_SO")"
  # Copy then rename: a running sbatch may have the old file mapped.
  install -m 0755 "$BUILT_PLUGIN" "$PLUGIN_SO.new"
  mv -f "$PLUGIN_SO.new" "$PLUGIN_SO"
  cat >/etc/slurm/plugstack.conf <<EOF
# Written by sluice's tests/harness/cluster.sh.
required $PLUGIN_SO socket=/run/sluice/%n.sock stage_timeout=120 connect_timeout=10 epilog_timeout=30
EOF
  log "plugstack: $PLUGIN_SO (from $BUILT_PLUGIN)"
}

node_states() { sinfo -h -N -o '%N %T' 2>/dev/null | sort -u; }

all_nodes_idle() {
  local states
  states=$(node_states)
  [[ $(grep -c ' idle$' <<<"$states") -eq ${#NODES[@]} ]]
}

start_slurm() {
  log "slurm: starting slurmctld"
  "${CLEAN_ENV[@]}" /usr/sbin/slurmctld -i \
    || { tail_logs "$SLURM_LOG_DIR/slurmctld.log"; die "slurmctld did not start"; }
  WAIT_SECONDS=30 wait_until bash -c 'scontrol ping | grep -q UP' \
    || { tail_logs "$SLURM_LOG_DIR/slurmctld.log"; die "slurmctld does not answer 'scontrol ping' after 30 s"; }
  local n
  for n in "${NODES[@]}"; do
    mkdir -p "/var/spool/slurmd/$n"
    log "slurm: starting slurmd -N $n"
    "${CLEAN_ENV[@]}" /usr/sbin/slurmd -N "$n" \
      || { tail_logs "$SLURM_LOG_DIR/slurmd-$n.log"; die "slurmd -N $n did not start"; }
  done
  local deadline=$((SECONDS + 60)) resumed=0 states
  until all_nodes_idle; do
    states=$(node_states)
    # Nodes left down/drained by an earlier run (state files survive in odd cases): resume them once.
    if ((!resumed)) && grep -Eq ' (down|drain|drained|draining|fail)' <<<"$states"; then
      log "slurm: resuming nodes: $(tr '\n' ' ' <<<"$states")"
      scontrol update nodename=n[1-3] state=resume || true
      resumed=1
    fi
    if ((SECONDS >= deadline)); then
      sinfo >&2 || true
      tail_logs "$SLURM_LOG_DIR/slurmctld.log" "$SLURM_LOG_DIR"/slurmd-n[1-3].log
      die "nodes not idle after 60 s: $(tr '\n' ' ' <<<"$states")"
    fi
    sleep 0.5
  done
  log "slurm: $(sinfo -h | tr -s ' ')"
}

stop_slurm() {
  # Cancel what still runs so slurmstepd processes end with their jobs, not orphaned.
  if pid_alive /run/slurmctld.pid slurmctld; then
    local jobs
    jobs=$(squeue -h -o %i 2>/dev/null || true)
    if [[ -n $jobs ]]; then
      log "slurm: cancelling jobs $(tr '\n' ' ' <<<"$jobs")"
      # shellcheck disable=SC2086
      scancel $jobs 2>/dev/null || true
      WAIT_SECONDS=30 wait_until bash -c '[[ -z $(squeue -h -o %i) ]]' || log "WARNING: jobs still listed after 30 s"
    fi
  fi
  local n
  for n in "${NODES[@]}"; do stop_pidfile "/run/slurmd-$n.pid" slurmd "slurmd $n"; done
  stop_pidfile /run/slurmctld.pid slurmctld slurmctld
}

# Job state: the next `up` starts with job id 1.
wipe_slurm_state() { rm -rf /var/spool/slurmctld/* /var/spool/slurmd/n[1-3]; }

# ---------------------------------------------------------------------------------------------- azurite

start_azurite() {
  require_port_free 10000 Azurite
  mkdir -p "$AZURITE_DIR"
  log "azurite: starting on 127.0.0.1:10000"
  spawn "$RUN_DIR/azurite.pid" "$SLUICE_LOG_DIR/azurite.log" \
    "$(command -v azurite-blob)" --blobHost 127.0.0.1 --blobPort 10000 --location "$AZURITE_DIR" \
    --disableTelemetry --skipApiVersionCheck --loose
  WAIT_SECONDS=30 wait_until port_open 10000 \
    || { tail_logs "$SLUICE_LOG_DIR/azurite.log"; die "Azurite does not listen on 10000 after 30 s"; }
  "$(harness_python)" "$HARNESS_DIR/azurite_containers.py" "$AZ_CONN" "${AZ_CONTAINERS[@]}" >&2 \
    || { tail_logs "$SLUICE_LOG_DIR/azurite.log"; die "cannot create the Azurite containers"; }
}

# ---------------------------------------------------------------------------------------------- garage

garage() { "$GARAGE_BIN" -c "$GARAGE_CONF" "$@"; }

start_garage() {
  [[ -x $GARAGE_BIN ]] || die "no Garage at $GARAGE_BIN: run tests/harness/install.sh (or SLUICE_NO_GARAGE=1)"
  local port
  for port in 3900 3901 3903; do require_port_free "$port" Garage; done
  mkdir -p "$GARAGE_DIR/meta" "$GARAGE_DIR/data"
  chmod 0700 "$GARAGE_DIR"
  cat >"$GARAGE_CONF" <<EOF
# Written by sluice's tests/harness/cluster.sh — single-node Garage for the tests.
metadata_dir = "$GARAGE_DIR/meta"
data_dir = "$GARAGE_DIR/data"
db_engine = "sqlite"
replication_factor = 1
rpc_bind_addr = "127.0.0.1:3901"
rpc_public_addr = "127.0.0.1:3901"
rpc_secret = "$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')"

[s3_api]
s3_region = "garage"
api_bind_addr = "127.0.0.1:3900"
root_domain = ".s3.garage.localhost"

[admin]
api_bind_addr = "127.0.0.1:3903"
admin_token = "$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')"
EOF
  chmod 0600 "$GARAGE_CONF"
  log "garage: starting on 127.0.0.1:3900"
  spawn "$RUN_DIR/garage.pid" "$SLUICE_LOG_DIR/garage.log" "$GARAGE_BIN" -c "$GARAGE_CONF" server
  WAIT_SECONDS=30 wait_until garage status \
    || { tail_logs "$SLUICE_LOG_DIR/garage.log"; die "Garage does not answer 'garage status' after 30 s"; }
  local node_id
  node_id=$(garage node id -q 2>/dev/null | cut -d@ -f1)
  [[ -n $node_id ]] || die "cannot read Garage's node id"
  garage layout assign -z dc1 -c 10G "$node_id" >/dev/null
  garage layout apply --version 1 >/dev/null
  # The new layout takes a moment to become active; key and bucket creation retry until then.
  WAIT_SECONDS=30 wait_until garage key create sluice-test \
    || { tail_logs "$SLUICE_LOG_DIR/garage.log"; die "garage key create failed for 30 s"; }
  local info
  info=$(garage key info --show-secret sluice-test)
  S3_KEY_ID=$(awk -F': *' '/^Key ID/ {print $2; exit}' <<<"$info")
  S3_SECRET=$(awk -F': *' '/^Secret key/ {print $2; exit}' <<<"$info")
  [[ $S3_KEY_ID == GK* && -n $S3_SECRET ]] || die "cannot parse 'garage key info' output:"$'\n'"$info"
  local b
  for b in "${S3_BUCKETS[@]}"; do
    WAIT_SECONDS=30 wait_until garage bucket create "$b" || die "garage bucket create $b failed for 30 s"
    garage bucket allow --read --write --owner "$b" --key sluice-test >/dev/null
  done
  log "garage: key $S3_KEY_ID, buckets ${S3_BUCKETS[*]}"
}

# ---------------------------------------------------------------------------------------------- agents

# One [[SECTION.allow]] table per prefix, for the agent config.
allow_rules() {
  local section=$1 prefix
  shift
  for prefix in "$@"; do printf '\n[[%s.allow]]\nprefix = "%s"\n' "$section" "$prefix"; done
}

# One [[store]] table for Garage at ENDPOINT, for URLs starting with PREFIX.
s3_store() {
  local prefix=$1 endpoint=$2
  cat <<EOF

[[store]]
prefix = "$prefix"
endpoint = "$endpoint"
region = "garage"
access_key_id = "$S3_KEY_ID"
secret_access_key = "$S3_SECRET"
allow_http = true
EOF
}

# The cluster secret of peer transfers, fresh for each `up`: 32 random bytes, root's, mode 0600 (the
# agents refuse anything others could read).
write_peer_secret() {
  mkdir -p "$(dirname "$PEER_SECRET")"
  (umask 077 && head -c 32 /dev/urandom >"$PEER_SECRET.new")
  chown root:root "$PEER_SECRET.new"
  chmod 0600 "$PEER_SECRET.new"
  mv -f "$PEER_SECRET.new" "$PEER_SECRET"
}

write_agent_config() {
  mkdir -p "$(dirname "$AGENT_CONFIG")"
  write_peer_secret
  {
    cat <<EOF
# Written by sluice's tests/harness/cluster.sh — one file for the three virtual nodes (%n = node name).
[agent]
socket = "/run/sluice/%n.sock"
state_dir = "$TEST_ROOT/%n/state"
# Jobs learnt of from a step end within seconds of Slurm's (a minute by default): the step-staging
# tests wait for it.
housekeeping_interval = "5s"

[hot_tier]
root = "$TEST_ROOT/%n/hot"

[stage]
concurrency = ${SLUICE_STAGE_CONCURRENCY:-16}
part_size = "16MiB"
# A little shorter than the plugin's stage_timeout=120, so the agent's error reaches the job first.
timeout = "110s"

[ckpt]
# Jobs without --ckpt-archive archive here; users may only use their own prefix (plus file:// for tests).
default_archive = "s3://ckpt/{user}/default"
keep = 2
scan_interval = "1s"
epilog_wait = "20s"
part_size = "5MiB"
concurrency = 8
EOF
    # The outage tests wait for the archive to come back: a pause that doubled to 2 min through an
    # outage would be most of their time. A key the previous release refuses (see replicas below).
    if [[ -z ${SLUICE_PREVIOUS_NODES:-} ]]; then
      printf 'retry_pause_max = "8s"\n'
    fi
    allow_rules ckpt "s3://ckpt/{user}/" "s3://ckpt-faulty/{user}/" "az://ckpt/{user}/" \
      "file://$TEST_ROOT/archive/{user}/" "s3://datasets-relayed/{user}/"
    # Deliberately shared by every user (no {user}): the weak configuration of docs/SECURITY.md F2,
    # kept so a test can show that restore still gives a job only its own user's checkpoints.
    allow_rules ckpt "file://$TEST_ROOT/archive/shared/"
    # Object-store datasets users may stage (the agent reads them with its own credentials).
    allow_rules stage "s3://datasets/" "az://datasets/" "s3://ckpt/{user}/" "az://ckpt/{user}/" \
      "s3://ckpt-faulty/" "s3://datasets-relayed/"
    if [[ -n ${S3_KEY_ID:-} ]]; then
      s3_store "s3://" "$S3_ENDPOINT"
      # The same Garage behind the tests' fault-injecting proxy (503/429/outages on demand).
      s3_store "s3://ckpt-faulty" "http://127.0.0.1:$FAULT_PROXY_PORT"
      # ... and behind a test's byte-counting relay.
      s3_store "s3://datasets-relayed" "http://127.0.0.1:$ORIGIN_RELAY_PORT"
    fi
    cat <<EOF

[[store]]
prefix = "az://"
use_emulator = true

# Prometheus (cluster.sh's own, on 127.0.0.1:$PROMETHEUS_PORT) scrapes each agent on its own port.
[metrics]
listen = "127.0.0.1:9464"

[metrics.nodes]
EOF
    local n
    for n in "${NODES[@]}"; do printf '%s = "127.0.0.1:%s"\n' "$n" "$(metrics_port "$n")"; done
    cat <<EOF

# Peer transfers: the nodes of a job share its object-store datasets (each unit read from the
# origin once per job). 16 MiB units, so a test's 200 MiB object spreads over the three nodes.
[peer]
secret_file = "$PEER_SECRET"
unit_size = "16MiB"

[peer.nodes]
EOF
    for n in "${NODES[@]}"; do printf '%s = "127.0.0.1:%s"\n' "$n" "$(peer_port "$n")"; done
    cat <<EOF

# STAND-IN for a shared fast tier (Lustre or BeeOND, which cannot run here): one local directory
# that the three virtual nodes see, since they share this host. No stripe classes (not Lustre).
[shared_tier]
job_dir = "$SHARED_TIER_ROOT/sluice-%j"

# The RAM tier for --ckpt-tier=ram: each such job gets its own tmpfs of job_share, mounted by its
# node's agent (a real tmpfs, not a stand-in).
[fast_tier]
root = "$RAM_TIER_ROOT/%n"
capacity = "2GiB"
job_share = "768MiB"
EOF
    # Replicas of RAM-tier checkpoints on the job's other nodes (issue 26), in little room, so that
    # a test can fill it. A key the previous release refuses: not while some nodes run it (a
    # rolling upgrade adds new keys after its last node).
    # Slurm's topology.conf as a site with two racks writes it: n1 and n2 on leaf switch s1, n3 on
    # s2 (Slurm itself does not read it: slurm.conf names no TopologyPlugin). Replicas of n1's and
    # n2's parts go to n3 first.
    if [[ -z ${SLUICE_PREVIOUS_NODES:-} ]]; then
      printf 'replicas = 1\nreplica_room = "64MiB"\ntopology = "%s"\n' "$TEST_ROOT/topology.conf"
    fi
  } >"$AGENT_CONFIG.new"
  printf '# sluice test cluster: two racks\nSwitchName=s1 Nodes=n[1-2]\nSwitchName=s2 Nodes=n3\nSwitchName=spine Switches=s[1-2]\n' \
    >"$TEST_ROOT/topology.conf"
  chmod 0600 "$AGENT_CONFIG.new"
  mv -f "$AGENT_CONFIG.new" "$AGENT_CONFIG"
}

prepare_node_dirs() {
  local n
  # Job users must traverse down to their own job directory; the agent makes that one 0700.
  mkdir -p "$TEST_ROOT"
  chmod 0755 "$TEST_ROOT"
  for n in "${NODES[@]}"; do
    mkdir -p "$TEST_ROOT/$n/hot" "$TEST_ROOT/$n/state"
    chmod 0755 "$TEST_ROOT/$n" "$TEST_ROOT/$n/hot"
    chmod 0700 "$TEST_ROOT/$n/state"
  done
  mkdir -p /run/sluice "$SHARED_TIER_ROOT"
  chmod 0755 /run/sluice "$SHARED_TIER_ROOT"
  # RAM-tier mounts an earlier cluster's agents left (jobs cut off by a teardown).
  local m
  while read -r m; do
    [[ $m == "$RAM_TIER_ROOT"/* ]] && umount -l "$m"
  done < <(findmnt -rn -o TARGET 2>/dev/null || true)
  mkdir -p "$RAM_TIER_ROOT"
  chmod 0755 "$RAM_TIER_ROOT"
}

start_agents() {
  [[ -x $SLUICED ]] || die "no agent at $SLUICED: run 'cargo build --workspace' first (or SLUICE_NO_AGENTS=1)"
  local n
  # An agent whose peer port is taken stages without peers (logged); here that is a broken cluster.
  for n in "${NODES[@]}"; do require_port_free "$(peer_port "$n")" "the peer port of sluiced $n"; done
  local agent
  for n in "${NODES[@]}"; do
    agent=$SLUICED
    # A rolling upgrade's half-way point (run-e2e-mixed.sh): these nodes run the previous release.
    [[ " ${SLUICE_PREVIOUS_NODES:-} " == *" $n "* ]] && agent=$SLUICE_PREVIOUS_AGENT
    [[ -x $agent ]] || die "no agent at $agent"
    log "agent: starting sluiced --node $n ($agent)"
    spawn "$RUN_DIR/sluiced-$n.pid" "$SLUICE_LOG_DIR/$n.log" \
      env RUST_LOG="${SLUICE_AGENT_LOG:-info}" RUST_BACKTRACE=1 MALLOC_MMAP_THRESHOLD_=1048576 "$agent" --config "$AGENT_CONFIG" --node "$n"
  done
  # Wait for each socket while its process lives. Liveness is `kill -0`, not the command line: right
  # after the spawn the process may still be setsid or env, on its way to exec sluiced.
  for n in "${NODES[@]}"; do
    local deadline=$((SECONDS + 30)) pid
    pid=$(tr -dc '0-9' <"$RUN_DIR/sluiced-$n.pid")
    until [[ -S /run/sluice/$n.sock ]]; do
      if ! pid_running "$pid"; then
        tail_logs "$SLUICE_LOG_DIR/$n.log"
        die "sluiced --node $n (pid $pid) exited before creating /run/sluice/$n.sock"
      fi
      ((SECONDS < deadline)) || { tail_logs "$SLUICE_LOG_DIR/$n.log"; die "no /run/sluice/$n.sock after 30 s"; }
      sleep 0.2
    done
  done
  log "agent: sockets $(ls /run/sluice/*.sock | tr '\n' ' ')"
}

# ---------------------------------------------------------------------------------------------- prometheus

start_prometheus() {
  [[ -x /usr/bin/prometheus ]] || die "no Prometheus at /usr/bin/prometheus: run tests/harness/install.sh"
  local n
  require_port_free "$PROMETHEUS_PORT" Prometheus
  mkdir -p "$PROMETHEUS_DIR/data"
  {
    cat <<EOF
# Written by sluice's tests/harness/cluster.sh — scrapes the three agents' [metrics] every second.
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: sluice
    static_configs:
EOF
    for n in "${NODES[@]}"; do
      printf '      - targets: ["127.0.0.1:%s"]\n        labels: {node: %s}\n' "$(metrics_port "$n")" "$n"
    done
  } >"$PROMETHEUS_DIR/prometheus.yml"
  /usr/bin/promtool check config "$PROMETHEUS_DIR/prometheus.yml" >/dev/null \
    || die "promtool rejects $PROMETHEUS_DIR/prometheus.yml"
  log "prometheus: starting on 127.0.0.1:$PROMETHEUS_PORT"
  spawn "$RUN_DIR/prometheus.pid" "$SLUICE_LOG_DIR/prometheus.log" /usr/bin/prometheus \
    --config.file="$PROMETHEUS_DIR/prometheus.yml" --storage.tsdb.path="$PROMETHEUS_DIR/data" \
    --storage.tsdb.retention.time=1d --web.listen-address="127.0.0.1:$PROMETHEUS_PORT"
  WAIT_SECONDS=30 wait_until curl -fsS "http://127.0.0.1:$PROMETHEUS_PORT/-/ready" \
    || { tail_logs "$SLUICE_LOG_DIR/prometheus.log"; die "Prometheus is not ready on $PROMETHEUS_PORT after 30 s"; }
}

stop_agents() {
  local n
  for n in "${NODES[@]}"; do stop_pidfile "$RUN_DIR/sluiced-$n.pid" sluiced "sluiced $n"; done
  rm -f /run/sluice/*.sock
}

# ---------------------------------------------------------------------------------------------- agent fleets

# What an agent fleet (tests/src/fleet.rs: N agents without Slurm, for the scale bench and test) left
# behind when its driver died before dropping it (SIGKILL, or a Ctrl-C, which its agents obey but the
# driver then cleans nothing): its agents (pid files under ROOT/run whose processes' command lines
# name ROOT/config/), its tmpfs (ROOT/hot, mounted from source "sluice-fleet") and the nodes' own
# addresses on lo (127.0.213.i/32, fleet.rs NODE_NET). A fleet dropped as usual leaves none of these.
stop_fleets() {
  local hot root f pid addr
  while read -r hot; do
    root=$(dirname "$hot")
    for f in "$root"/run/*.pid; do
      [[ -f $f ]] || continue
      pid=$(tr -dc '0-9' <"$f")
      if [[ -n $pid ]] && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$root/config/"; then
        log "fleet: stopping agent pid $pid of the fleet in $root (its driver died)"
        kill -KILL "$pid" 2>/dev/null || true
        # pid_running, not kill -0: an orphan's zombie may wait long for its reaper (init).
        WAIT_SECONDS=10 wait_until pid_gone "$pid" || log "WARNING: fleet agent pid $pid survives SIGKILL"
      fi
      rm -f "$f"
    done
    umount "$hot" 2>/dev/null || umount -l "$hot"
    log "fleet: unmounted $hot"
  done < <(findmnt -rn -S sluice-fleet -o TARGET 2>/dev/null || true)
  while read -r addr; do
    ip addr del "$addr" dev lo && log "fleet: removed $addr from lo"
  done < <(ip -4 -o addr show dev lo 2>/dev/null | awk '{print $4}' | grep -E '^127\.0\.213\.[0-9]+/32$' || true)
}

# ---------------------------------------------------------------------------------------------- env file

write_env_file() {
  local plugin=1 agents=1
  [[ ${SLUICE_NO_PLUGIN:-0} == 1 ]] && plugin=0
  [[ ${SLUICE_NO_AGENTS:-0} == 1 ]] && agents=0
  cat >"$ENV_FILE.new" <<EOF
# Written by tests/harness/cluster.sh up; read by the end-to-end tests (tests/tests/common/cluster.rs).
SLUICE_TEST_PLUGIN='$plugin'
SLUICE_TEST_AGENTS='$agents'
SLUICE_TEST_PREVIOUS_NODES='${SLUICE_PREVIOUS_NODES:-}'
SLUICE_TEST_NODES='${NODES[*]}'
SLUICE_TEST_USER='$TEST_USER'
SLUICE_TEST_OTHER_USER='$OTHER_USER'
SLUICE_TEST_ROOT='$TEST_ROOT'
SLUICE_TEST_HOT_ROOT='$TEST_ROOT/%n/hot'
SLUICE_TEST_SOCKET='/run/sluice/%n.sock'
SLUICE_TEST_PROMETHEUS_URL='http://127.0.0.1:$PROMETHEUS_PORT'
SLUICE_TEST_METRICS_ADDRS='$(for n in "${NODES[@]}"; do printf '%s=127.0.0.1:%s ' "$n" "$(metrics_port "$n")"; done)'
SLUICE_TEST_SLURM_LOG_DIR='$SLURM_LOG_DIR'
SLUICE_TEST_SLUICE_LOG_DIR='$SLUICE_LOG_DIR'
SLUICE_TEST_RCLONE='$(harness_rclone)'
SLUICE_TEST_S3='$([[ -n ${S3_KEY_ID:-} ]] && echo 1 || echo 0)'
SLUICE_TEST_S3_ENDPOINT='$S3_ENDPOINT'
SLUICE_TEST_S3_REGION='garage'
SLUICE_TEST_S3_KEY_ID='${S3_KEY_ID:-}'
SLUICE_TEST_S3_SECRET='${S3_SECRET:-}'
SLUICE_TEST_S3_BUCKETS='${S3_BUCKETS[*]}'
SLUICE_TEST_FAULT_PROXY_PORT='$FAULT_PROXY_PORT'
SLUICE_TEST_ORIGIN_RELAY_PORT='$ORIGIN_RELAY_PORT'
SLUICE_TEST_PEER_ADDRS='$(for n in "${NODES[@]}"; do printf '%s=127.0.0.1:%s ' "$n" "$(peer_port "$n")"; done)'
SLUICE_TEST_ARCHIVE_ROOT='$TEST_ROOT/archive'
SLUICE_TEST_SHARED_TIER='$SHARED_TIER_ROOT/sluice-%j'
SLUICE_TEST_RAM_TIER_ROOT='$RAM_TIER_ROOT'
SLUICE_TEST_AZ_ACCOUNT='$AZ_ACCOUNT'
SLUICE_TEST_AZ_KEY='$AZ_KEY'
SLUICE_TEST_AZ_ENDPOINT='$AZ_ENDPOINT'
SLUICE_TEST_AZ_CONNECTION_STRING='$AZ_CONN'
SLUICE_TEST_AZ_CONTAINERS='${AZ_CONTAINERS[*]}'
EOF
  chmod 0600 "$ENV_FILE.new"
  mv -f "$ENV_FILE.new" "$ENV_FILE"
  log "env file: $ENV_FILE"
}

# ---------------------------------------------------------------------------------------------- commands

cmd_down() {
  need_root
  stop_pidfile "$RUN_DIR/prometheus.pid" prometheus Prometheus
  stop_fleets
  stop_agents
  stop_slurm
  leave_slurm_root
  stop_pidfile "$RUN_DIR/garage.pid" garage Garage
  stop_pidfile "$RUN_DIR/azurite.pid" azurite Azurite
  stop_munge
  # Job state: the next `up` starts with job id 1, empty hot tiers and fresh stores.
  wipe_slurm_state
  rm -f "$ENV_FILE"
  local n
  for n in "${NODES[@]}"; do rm -rf "${TEST_ROOT:?}/$n"; done
  rm -rf "${TEST_ROOT:?}/garage" "${TEST_ROOT:?}/azurite" "${TEST_ROOT:?}/e2e" "${TEST_ROOT:?}/prometheus"
  log "down: done"
}

cmd_up() {
  need_root
  trap 'log "up failed; logs: $SLURM_LOG_DIR, $SLUICE_LOG_DIR; \"$0 status\" shows what runs, \"$0 down\" stops it"' ERR
  mkdir -p "$RUN_DIR" "$SLUICE_LOG_DIR" "$SLURM_LOG_DIR"
  chmod 0700 "$RUN_DIR"
  cmd_down
  # Each run's logs start empty; the previous run's stay next to them as *.prev for comparison.
  local f
  for f in "$SLURM_LOG_DIR"/*.log "$SLUICE_LOG_DIR"/*.log; do [[ -f $f ]] && mv -f "$f" "$f.prev"; done
  id "$TEST_USER" >/dev/null 2>&1 || die "no user $TEST_USER: run tests/harness/install.sh"
  # The previous run's job outputs stay for post-mortems until now.
  rm -rf "/home/$TEST_USER/e2e"

  [[ -z $SLURM_ROOT ]] || enter_slurm_root
  slurm_side write_slurm_conf
  slurm_side write_plugstack
  slurm_side start_munge
  start_azurite
  S3_KEY_ID="" S3_SECRET=""
  if [[ ${SLUICE_NO_GARAGE:-0} == 1 ]]; then log "garage: skipped (SLUICE_NO_GARAGE=1)"; else start_garage; fi
  prepare_node_dirs
  write_agent_config
  if [[ ${SLUICE_NO_AGENTS:-0} == 1 ]]; then log "agent: skipped (SLUICE_NO_AGENTS=1)"; else slurm_side start_agents; fi
  start_prometheus
  slurm_side start_slurm
  write_env_file
  log "up: done"
}

cmd_status() {
  local rc=0 n root
  root=$(cat "$SLURM_ROOT_RECORD" 2>/dev/null || true)
  check() { if pid_alive "$1" "$2"; then printf '  %-16s running (pid %s)\n' "$3" "$(cat "$1")"; else printf '  %-16s not running\n' "$3"; rc=1; fi; }
  [[ -z $root ]] || echo "slurm root: $root"
  echo "processes:"
  check "$root/run/munge/munged.pid" munged munged
  check "$root/run/slurmctld.pid" slurmctld slurmctld
  for n in "${NODES[@]}"; do check "$root/run/slurmd-$n.pid" slurmd "slurmd $n"; done
  check "$RUN_DIR/garage.pid" garage garage
  check "$RUN_DIR/azurite.pid" azurite azurite
  for n in "${NODES[@]}"; do check "$RUN_DIR/sluiced-$n.pid" sluiced "sluiced $n"; done
  check "$RUN_DIR/prometheus.pid" prometheus prometheus
  echo "sinfo:"
  if [[ -n $root ]]; then chroot "$root" sinfo; else sinfo; fi 2>&1 | sed 's/^/  /' || rc=1
  echo "agent sockets:"
  ls -l /run/sluice/*.sock 2>/dev/null | sed 's/^/  /' || echo "  none"
  echo "plugstack.conf:"
  if [[ -f $root/etc/slurm/plugstack.conf ]]; then
    grep -v '^#' "$root/etc/slurm/plugstack.conf" | sed 's/^/  /' || echo "  (empty: no plugin)"
  else
    echo "  missing"
  fi
  echo "env file: $([[ -f $ENV_FILE ]] && echo "$ENV_FILE" || echo missing)"
  return $rc
}

case ${1:-} in
  # Internal: a function of `up` or `down` run in the Slurm root (see slurm_side).
  side)
    case ${2:-} in
      write_slurm_conf | write_plugstack | start_munge | start_slurm | start_agents | stop_slurm | stop_munge | wipe_slurm_state) "$2" ;;
      *) die "cluster.sh side: not a Slurm-side step: ${2:-}" ;;
    esac
    ;;
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  *) echo "usage: $0 up|down|status   (see the header of this script)" >&2; exit 2 ;;
esac
