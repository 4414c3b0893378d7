#!/usr/bin/env bash
# The Debian packages and the wheel, installed the way an admin installs them, into a clean Debian 12
# root (install.sh makes it once: $DEBIAN_ROOT, minbase + python3-venv): packaging/build-debs.sh
# packages this checkout's debug build, `dpkg -i` installs the three .debs in a throwaway overlay of
# that root, and the checks below look at what the admin gets — the files and their modes, the
# conffile, what postinst says and does, `sluiced --check`, `sluice doctor`, the man pages, a
# reinstall that keeps the admin's edit, removal and purge — and a venv there installs the wheel and
# loads its library. No Slurm, no systemd and no agent run there: postinst must cope (it starts
# nothing on a first install anyway), and doctor must say what is missing. About 30 s.
#
#   tests/harness/package-test.sh     (as root) one line per check, then "N passed, M failed"
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=common.sh
source "$HERE/common.sh"
[[ $(id -u) -eq 0 ]] || die "package-test.sh must run as root (it mounts an overlay and chroots)"
[[ -x $DEBIAN_ROOT/usr/bin/dpkg ]] || die "no Debian root at $DEBIAN_ROOT: run tests/harness/install.sh first"

WORK=$(mktemp -d /tmp/sluice-package-test.XXXXXX)
ROOT=$WORK/root
cleanup() {
  umount "$ROOT/proc" 2>/dev/null
  umount "$ROOT" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT

PASSED=0 FAILED=0
ok() { PASSED=$((PASSED + 1)); printf 'ok    %s\n' "$*"; }
bad() { FAILED=$((FAILED + 1)); printf 'FAIL  %s\n' "$*"; }
check() { local what=$1; shift; if "$@"; then ok "$what"; else bad "$what"; fi; }
# in_root CMD...: CMD in the clean root, with a plain environment (no host PATH or SLUICE_*).
in_root() { env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 HOME=/root chroot "$ROOT" "$@"; }
# contains TEXT NEEDLE: TEXT holds NEEDLE (printed when it does not).
not_grep() { [[ -f $2 ]] && ! grep -q -- "$1" "$2"; }
contains() { grep -qF -- "$2" <<<"$1" || { printf '      expected %q in:\n%s\n' "$2" "$1" | sed 's/^/      /' | head -40; return 1; }; }

log "packages: packaging/build-debs.sh --debug --compress none"
WHEEL_PY=${SLUICE_TORCH_VENV:-/opt/sluice-test/torch-venv}/bin/python
[[ -x $WHEEL_PY ]] && export SLUICE_WHEEL_PYTHON=$WHEEL_PY
"$REPO_ROOT/packaging/build-debs.sh" --debug --compress none --out "$WORK/pkgs" \
  || die "packaging/build-debs.sh failed"

mkdir -p "$ROOT" "$WORK/upper" "$WORK/ovl-work"
mount -t overlay overlay -o "lowerdir=$DEBIAN_ROOT,upperdir=$WORK/upper,workdir=$WORK/ovl-work" "$ROOT" \
  || die "cannot mount an overlay of $DEBIAN_ROOT at $ROOT"
mount -t proc proc "$ROOT/proc"
mkdir -p "$ROOT/tmp/pkgs"
cp "$WORK"/pkgs/* "$ROOT/tmp/pkgs/"
# The packages' paths as the clean root sees them.
pkg() { local f; f=$(cd "$ROOT/tmp/pkgs" && ls "$1"*); echo "/tmp/pkgs/$f"; }

# --- install
out=$(in_root dpkg -i "$(pkg sluice-agent_)" "$(pkg sluice-cli_)" "$(pkg slurm-spank-sluice_)" 2>&1)
check "dpkg -i installs the three packages in a clean Debian 12 root (their Depends are met there)" \
  test "$(in_root dpkg-query -W -f='${db:Status-Abbrev}\n' sluice-agent sluice-cli slurm-spank-sluice | tr -d ' ' | sort -u)" = ii
check "postinst of a first install starts nothing and says what to do" \
  contains "$out" "sluice-agent: not started. Edit /etc/sluice/sluice.toml"
check "the binaries: /usr/sbin/sluiced, /usr/bin/sluice, /usr/lib/sluice/spank_sluice.so" \
  test -x "$ROOT/usr/sbin/sluiced" -a -x "$ROOT/usr/bin/sluice" -a -f "$ROOT/usr/lib/sluice/spank_sluice.so"
check "the config is root's, mode 0600, in a root-only directory (it holds store credentials)" \
  test "$(stat -c '%U %a' "$ROOT/etc/sluice/sluice.toml" "$ROOT/etc/sluice" | tr '\n' ' ')" = "root 600 root 700 "
check "the config is a conffile (an upgrade keeps the admin's edits)" \
  contains "$(in_root dpkg-query -W -f='${Conffiles}' sluice-agent)" "/etc/sluice/sluice.toml"
unit=$(cat "$ROOT/lib/systemd/system/sluiced.service" 2>/dev/null)
check "the systemd unit checks the config before it starts the packaged agent, before slurmd" \
  contains "$unit" $'ExecStartPre=/usr/sbin/sluiced --config /etc/sluice/sluice.toml --check\nExecStart=/usr/sbin/sluiced --config /etc/sluice/sluice.toml'
check "... and starts it before slurmd" contains "$unit" "Before=slurmd.service"
check "man pages: sluiced(8), sluice(1) and one per subcommand" \
  test -s "$ROOT/usr/share/man/man8/sluiced.8.gz" -a -s "$ROOT/usr/share/man/man1/sluice.1.gz" -a -s "$ROOT/usr/share/man/man1/sluice-ckpt-restore.1.gz"
check "the man page of sluice ckpt restore is a man page of that command" \
  contains "$(zcat "$ROOT/usr/share/man/man1/sluice-ckpt-restore.1.gz")" ".TH sluice-ckpt-restore 1"
check "bash, zsh and fish completions of both commands" \
  test -s "$ROOT/usr/share/bash-completion/completions/sluice" -a -s "$ROOT/usr/share/bash-completion/completions/sluiced" \
  -a -s "$ROOT/usr/share/zsh/vendor-completions/_sluice" -a -s "$ROOT/usr/share/fish/vendor_completions.d/sluiced.fish"
check "the example plugstack line names the packaged plugin" \
  contains "$(cat "$ROOT/usr/share/doc/slurm-spank-sluice/examples/plugstack.conf")" "required /usr/lib/sluice/spank_sluice.so"
check "the plugin package refuses to sit beside another Slurm release's slurmd" \
  contains "$(in_root dpkg-query -W -f='${Breaks}' slurm-spank-sluice)" "slurmd (>= "

# --- what the admin runs next
out=$(in_root sluiced --config /etc/sluice/sluice.toml --check --node n0 2>&1)
check "sluiced --check accepts the packaged example config" contains "$out" "configuration is valid for node n0"
out=$(in_root timeout 60 sluice doctor --node n0 --timeout 2 2>&1)
rc=$?
check "sluice doctor runs there and fails (no agent, no Slurm): exit 1" test "$rc" = 1
check "doctor passes the packaged config's ownership and mode" \
  contains "$out" "PASS  config: /etc/sluice/sluice.toml: root-owned, mode 0600"
check "doctor says the agent is not running and how to start it" \
  contains "$out" "fix: start sluiced (systemctl start sluiced)"

# --- a reinstall (an upgrade of the same version) keeps the admin's edit and puts the mode back
echo "# edited by the admin" >>"$ROOT/etc/sluice/sluice.toml"
chmod 0644 "$ROOT/etc/sluice/sluice.toml"
out=$(in_root dpkg -i "$(pkg sluice-agent_)" 2>&1)
check "dpkg -i again succeeds without a prompt" test "$(in_root dpkg-query -W -f='${db:Status-Abbrev}' sluice-agent | tr -d ' ')" = ii
check "the admin's edit of the config is kept" grep -qx "# edited by the admin" "$ROOT/etc/sluice/sluice.toml"
check "a config the admin made readable to all is root's alone again" \
  test "$(stat -c %a "$ROOT/etc/sluice/sluice.toml")" = 600

# --- an upgrade under systemd, with a stand-in systemctl (no systemd runs in the clean root): it
# records what postinst asks of it and answers that the agent is active.
mkdir -p "$ROOT/run/systemd/system"
printf '#!/bin/sh\necho "$*" >>/tmp/systemctl-calls\n' >"$ROOT/usr/local/sbin/systemctl"
chmod 0755 "$ROOT/usr/local/sbin/systemctl"
echo "this line is not TOML" >>"$ROOT/etc/sluice/sluice.toml"
out=$(in_root dpkg -i "$(pkg sluice-agent_)" 2>&1)
check "an upgrade with a config the new agent refuses leaves the running agent alone and says why" \
  contains "$out" "the running agent was NOT restarted: the new sluiced refuses /etc/sluice/sluice.toml"
check "... and asks systemd for no restart (only for a daemon-reload)" not_grep "restart" "$ROOT/tmp/systemctl-calls"
sed -i '/^this line is not TOML$/d' "$ROOT/etc/sluice/sluice.toml"
in_root dpkg -i "$(pkg sluice-agent_)" >/dev/null 2>&1
check "an upgrade with a valid config restarts the running agent" \
  grep -qx "try-restart sluiced.service" "$ROOT/tmp/systemctl-calls"
rm -rf "$ROOT/run/systemd/system" "$ROOT/usr/local/sbin/systemctl"

# --- the wheel, in a venv of the clean root
wheel=$(pkg sluice_ckpt-)
check "the wheel is tagged for this platform (it carries a native library)" \
  contains "$wheel" "-py3-none-linux_$(uname -m).whl"
out=$(in_root sh -c "python3 -m venv /opt/trainer && /opt/trainer/bin/pip install -q --no-index $wheel \
  && cd / && /opt/trainer/bin/python -c 'import ctypes, sluice_ckpt._lib as l; p = l.library_path(); ctypes.CDLL(p); print(p)'" 2>&1)
check "pip installs the wheel and sluice_ckpt, without torch, loads the libsluice_writer.so it bundles" \
  contains "$out" "/opt/trainer/lib/python3.11/site-packages/sluice_ckpt/lib/libsluice_writer.so"

# --- removal keeps the config, purge removes it
in_root dpkg -r sluice-agent >/dev/null 2>&1
check "dpkg -r removes the agent and keeps its config" \
  test ! -e "$ROOT/usr/sbin/sluiced" -a ! -e "$ROOT/lib/systemd/system/sluiced.service" -a -f "$ROOT/etc/sluice/sluice.toml"
out=$(in_root dpkg -P sluice-agent 2>&1)
check "dpkg -P removes the config" test ! -e "$ROOT/etc/sluice"
check "... and says the state and hot tier were kept" contains "$out" "state_dir (default /var/lib/sluice) and hot tier were kept"

echo "$PASSED passed, $FAILED failed"
((FAILED == 0))
