#!/usr/bin/env bash
# Runs the workspace's unit and in-process test binaries (already built by `cargo test --workspace`)
# as the unprivileged test user, as a developer without root would run `cargo test`: every test
# that needs root must then report itself ignored (`#[ignore = "needs root ..."]`), never pass
# without having run, and every other test must pass. Run as root, after `cargo test --workspace`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

[[ $(id -u) -eq 0 ]] || die "unit-as-user.sh must run as root (it switches to $TEST_USER)"
cd "$REPO_ROOT"
mapfile -t bins < <(cargo test --workspace --no-run --message-format=json 2>/dev/null |
  python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"])' | sort -u)
((${#bins[@]})) || die "no test binaries found (run cargo test --workspace first)"
failed=0
for b in "${bins[@]}"; do
  # From a directory the user owns, with the user's own temp directory.
  if ! out=$(runuser -u "$TEST_USER" -- env -i PATH=/usr/bin:/bin HOME=/tmp TMPDIR=/tmp \
        bash -c 'cd /tmp && "$0"' "$b" 2>&1); then
    printf '%s\n' "$out" | tail -n 30 >&2
    log "FAILED as $TEST_USER: $b"
    failed=1
  fi
  printf '%s\n' "$out" | grep -E '^test result' | sed "s|^|[as $TEST_USER] $(basename "$b"): |" >&2 || true
done
((failed == 0)) || die "tests failed when run without root (see above): a root-only test must be #[ignore]d"
log "every test binary passed as $TEST_USER, root-only tests ignored"
