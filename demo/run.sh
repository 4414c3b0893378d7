#!/usr/bin/env bash
# The sluice demo, on one Debian 12 machine as root (README: "Two commands").
#
# Brings up the local test cluster (munge, slurmctld, three slurmd n1-n3, Garage S3, Azurite, one
# sluiced per node), then, as the unprivileged user `sluiceuser`:
#   1. a 3-node training-like job stages a dataset from S3 and one from a POSIX directory, "trains"
#      on it, and writes three checkpoints; the agents archive them to S3 while it runs;
#   2. a second job resumes from the latest archived checkpoint (--ckpt-restore=latest).
# and shows what a user and an admin see: job output, `sluice status`, the archive, the hot tiers.
#
#   demo/run.sh                  run the demo and stop the cluster afterwards
#   SLUICE_KEEP_CLUSTER=1 demo/run.sh   leave the cluster up to explore (tests/harness/cluster.sh down)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$(pwd)
# shellcheck source=../tests/harness/common.sh
source tests/harness/common.sh
[[ $(id -u) -eq 0 ]] || { echo "demo/run.sh must run as root (it installs packages and starts a Slurm cluster)" >&2; exit 1; }

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

say "installing what is missing (Slurm, munge, Garage, Azurite, rclone) and building sluice"
tests/harness/install.sh
cargo build --workspace

finish() {
  local rc=$?
  if [[ ${SLUICE_KEEP_CLUSTER:-0} == 1 ]]; then
    echo "cluster left running; stop it with tests/harness/cluster.sh down"
  else
    tests/harness/cluster.sh down >/dev/null 2>&1 || true
  fi
  exit "$rc"
}
# The test cluster is one per machine: hold its lock while using it (take_cluster_lock, common.sh;
# cluster.sh closes it for the daemons it starts). The trap comes after it, so that a demo stopped
# while it waits never brings down the cluster of the run that holds the lock.
take_cluster_lock
trap finish EXIT
tests/harness/cluster.sh up
# shellcheck disable=SC1091
source /run/sluice-test/env
USER_HOME=$(getent passwd "$SLUICE_TEST_USER" | cut -d: -f6)
SLUICE=$REPO/target/debug/sluice
RCLONE=(env -u AWS_CA_BUNDLE RCLONE_CONFIG=/dev/null RCLONE_CONFIG_S3_TYPE=s3 RCLONE_CONFIG_S3_PROVIDER=Other
        RCLONE_CONFIG_S3_ENDPOINT="$SLUICE_TEST_S3_ENDPOINT" RCLONE_CONFIG_S3_REGION="$SLUICE_TEST_S3_REGION"
        RCLONE_CONFIG_S3_ACCESS_KEY_ID="$SLUICE_TEST_S3_KEY_ID" RCLONE_CONFIG_S3_SECRET_ACCESS_KEY="$SLUICE_TEST_S3_SECRET"
        "$SLUICE_TEST_RCLONE")

say "making a dataset: 200 token shards in s3://datasets/demo-tokens, and a tokenizer in a POSIX directory"
DATA=$SLUICE_TEST_ROOT/demo-src
rm -rf "$DATA"; mkdir -p "$DATA/tokens" "$DATA/tokenizer"
python3 - "$DATA" <<'PY'
import os, random, sys
root = sys.argv[1]
rnd = random.Random(7)
for i in range(200):
    with open(f"{root}/tokens/shard-{i:04d}.bin", "wb") as f:
        f.write(bytes(rnd.getrandbits(8) for _ in range(16384)))
with open(f"{root}/tokenizer/vocab.txt", "w") as f:
    f.write("\n".join(f"tok{i}" for i in range(5000)))
PY
"${RCLONE[@]}" copy --quiet "$DATA/tokens" s3:datasets/demo-tokens
chmod -R a+rX "$DATA"

say "the job script (as $SLUICE_TEST_USER)"
ARCHIVE=s3://ckpt/$SLUICE_TEST_USER/demo-$$
cat >"$USER_HOME/train.sbatch" <<EOF
#!/bin/bash
#SBATCH --job-name=demo-train --nodes=3 --ntasks-per-node=1 --output=$USER_HOME/demo-train-%j.out
#SBATCH --stage-in=tokens=s3://datasets/demo-tokens
#SBATCH --stage-in=$DATA/tokenizer
#SBATCH --ckpt-archive=$ARCHIVE --ckpt-keep=1
echo "job \$SLURM_JOB_ID: \$SLUICE_STAGE_DIR holds \$(ls \$SLUICE_STAGE_DIR | tr '\\n' ' ')"
srun bash -c '
  set -e
  shards=\$(ls \$SLUICE_STAGE_DIR/tokens | wc -l)
  echo "rank \$SLURM_PROCID on \$SLURMD_NODENAME reads \$shards shards from \$SLUICE_STAGE_DIR"
  for step in 1 2 3; do
    sleep 1   # "training"
    d=\$SLUICE_CKPT_DIR/step-\$step; mkdir -p \$d
    python3 -c "import random,struct,sys; r=random.Random(\$step*10+\$SLURM_PROCID); sys.stdout.buffer.write(b\"\".join(struct.pack(\"<e\", r.gauss(0,0.02)) for _ in range(1<<20)))" > \$d/rank\$SLURM_PROCID.weights
    # torch.distributed.checkpoint writes .metadata last: the commit signal sluice watches for
    # (every node has its own node-local directory and agent, so each node writes one)
    echo done > \$d/.metadata
    echo "rank \$SLURM_PROCID wrote step-\$step"
  done
  sleep 4
'
EOF
cat "$USER_HOME/train.sbatch"
chown "$SLUICE_TEST_USER:" "$USER_HOME/train.sbatch"

say "sinfo before"; sinfo
say "sbatch --wait train.sbatch"
JOB=$(su "$SLUICE_TEST_USER" -c "cd ~ && sbatch --parsable --wait train.sbatch") || true
JOB=${JOB%%;*}
cat "$USER_HOME/demo-train-$JOB.out"
scontrol show job "$JOB" | grep -o 'JobState=[A-Z]*'

say "what the agent of n1 says (sluice status, as $SLUICE_TEST_USER)"
su "$SLUICE_TEST_USER" -c "$SLUICE status --socket /run/sluice/n1.sock" || true

say "the archive: $ARCHIVE"
for _ in $(seq 1 30); do
  n=$("${RCLONE[@]}" lsf -R "s3:${ARCHIVE#s3://}" 2>/dev/null | grep -c '/MANIFEST$' || true)
  [[ $n -ge 3 ]] && break
  sleep 1
done
"${RCLONE[@]}" lsl "s3:${ARCHIVE#s3://}" | grep -E 'MANIFEST|parts/' | sort -k4 || true
"$SLUICE" ckpt list "$ARCHIVE" --config /etc/sluice/sluice.toml || true

say "hot tiers after the job: only the newest archived checkpoint is kept (--ckpt-keep=1), no staged data"
for n in $SLUICE_TEST_NODES; do
  echo "$n: $(cd "${SLUICE_TEST_HOT_ROOT//%n/$n}" && find jobs -mindepth 3 -maxdepth 3 | sort | tr '\n' ' ')"
done

say "a second job resumes from the latest checkpoint"
cat >"$USER_HOME/resume.sbatch" <<EOF
#!/bin/bash
#SBATCH --job-name=demo-resume --nodes=1 --output=$USER_HOME/demo-resume-%j.out
#SBATCH --ckpt-archive=$ARCHIVE --ckpt-restore=latest
echo "restored \$SLUICE_RESTORED_TAG: \$(ls \$SLUICE_CKPT_DIR/\$SLUICE_RESTORED_TAG)"
EOF
chown "$SLUICE_TEST_USER:" "$USER_HOME/resume.sbatch"
JOB2=$(su "$SLUICE_TEST_USER" -c "cd ~ && sbatch --parsable --wait resume.sbatch") || true
JOB2=${JOB2%%;*}
cat "$USER_HOME/demo-resume-$JOB2.out"

say "sinfo after (every node idle: nothing drained)"; sinfo
