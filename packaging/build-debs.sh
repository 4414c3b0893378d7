#!/usr/bin/env bash
# Builds sluice's Debian packages and the Python writer's wheel from this checkout:
#
#   packaging/build-debs.sh [--debug] [--out DIR] [--compress xz|none]
#
#   sluice-agent_V_ARCH.deb        /usr/sbin/sluiced, its systemd unit, sluiced(8), completions, and
#                                  /etc/sluice/sluice.toml (a conffile, mode 0600: it holds store keys)
#   sluice-cli_V_ARCH.deb          /usr/bin/sluice, its man pages and completions
#   slurm-spank-sluice_V_ARCH.deb  /usr/lib/sluice/spank_sluice.so and an example plugstack.conf line;
#                                  it Breaks every slurmd but the major release it was built against
#                                  (a SPANK plugin runs only in the Slurm it was built for)
#   sluice_ckpt-V-py3-none-ARCH.whl  the Python writer with libsluice_writer.so and the cuFile probe
#
# Default: a release build (`cargo build --release`), xz-compressed packages in target/debian.
# --debug packages the debug build instead (the README's test command does, to test the packaging
# without a release build); --compress none skips compression (faster, larger).
# Needs dpkg-deb and python3 with pip (Debian 12: dpkg-dev is not needed). Run from anywhere.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PROFILE=release
OUT=$REPO/target/debian
COMPRESS=xz
while (($#)); do
  case $1 in
    --debug) PROFILE=debug ;;
    --out) OUT=$2; shift ;;
    --compress) COMPRESS=$2; shift ;;
    -h|--help) sed -n '2,18p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "build-debs.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
say() { echo "[build-debs] $*" >&2; }

VERSION=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' "$REPO/Cargo.toml")
ARCH=$(dpkg --print-architecture)
# The Slurm the plugin is built against: slurm_version.h's SLURM_VERSION_NUMBER, 0xMMmmpp (22.05.8 = 0x160508).
SLURM_HEX=$(sed -n 's/^#define SLURM_VERSION_NUMBER 0x\([0-9a-fA-F]\{6\}\).*/\1/p' /usr/include/slurm/slurm_version.h 2>/dev/null)
SLURM_VERSION=${SLURM_HEX:+$((16#${SLURM_HEX:0:2})).$(printf %02d $((16#${SLURM_HEX:2:2}))).$((16#${SLURM_HEX:4:2}))}
[[ -n $VERSION && -n $SLURM_VERSION ]] \
  || { echo "build-debs.sh: no version in Cargo.toml, or no SLURM_VERSION_NUMBER in /usr/include/slurm/slurm_version.h (install libslurm-dev)" >&2; exit 1; }
SLURM_MAJOR=${SLURM_VERSION%.*}              # 22.05.8 -> 22.05
SLURM_NEXT=$(awk -F. '{ printf "%s.%02d", $1, $2 + 1 }' <<<"$SLURM_MAJOR")

CARGO_FLAGS=(-q -p sluice-agent -p sluice-cli -p sluice-spank -p sluice-writer)
[[ $PROFILE == release ]] && CARGO_FLAGS+=(--release)
say "cargo build ($PROFILE) of the agent, the CLI, the plugin and the writer"
(cd "$REPO" && cargo build "${CARGO_FLAGS[@]}")
BIN=$REPO/target/$PROFILE

STAGING=$(mktemp -d)
trap 'rm -rf "$STAGING"' EXIT
mkdir -p "$OUT"

# control PKG DESCRIPTION [FIELD...]: the DEBIAN/control of package PKG.
control() {
  local pkg=$1 desc=$2 size
  shift 2
  size=$(du -sk --exclude=DEBIAN "$STAGING/$pkg" | cut -f1)
  {
    echo "Package: $pkg"
    echo "Version: $VERSION"
    echo "Architecture: $ARCH"
    echo "Maintainer: sluice developers <sluice@localhost>"
    echo "Section: admin"
    echo "Priority: optional"
    echo "Installed-Size: $size"
    printf '%s\n' "$@"
    echo "Description: $desc"
  } >"$STAGING/$pkg/DEBIAN/control"
}

# depends PKG: the shared libraries PKG's binaries need, as a Depends: value (dpkg-shlibdeps, from
# dpkg-dev, when it is there; otherwise what the Rust binaries link on Debian 12).
mkdir -p "$STAGING/debian"
printf 'Source: sluice\n\nPackage: sluice\nArchitecture: any\n' >"$STAGING/debian/control"
depends() {
  local files
  mapfile -t files < <(find "$STAGING/$1" -path "$STAGING/$1/DEBIAN" -prune -o -type f -perm -u+x -print)
  if command -v dpkg-shlibdeps >/dev/null; then
    (cd "$STAGING" && dpkg-shlibdeps -O "${files[@]/#/-e}" 2>/dev/null) | sed -n 's/^shlibs:Depends=//p'
  else
    echo "libc6 (>= 2.34), libgcc-s1"
  fi
}

# build PKG: the .deb of the tree under $STAGING/PKG.
build() {
  local deb=$OUT/${1}_${VERSION}_${ARCH}.deb
  dpkg-deb --root-owner-group -Z"$COMPRESS" --build "$STAGING/$1" "$deb" >/dev/null
  say "$deb ($(du -h "$deb" | cut -f1))"
}

# --- sluice-agent
P=$STAGING/sluice-agent
install -D -m 0755 "$BIN/sluiced" "$P/usr/sbin/sluiced"
install -d -m 0700 "$P/etc/sluice"
install -m 0600 "$REPO/slurm-conf/sluice.toml" "$P/etc/sluice/sluice.toml"
# One unit file: the repository's, with the package's path of the binary.
install -d "$P/lib/systemd/system"
sed 's#/usr/local/sbin/sluiced#/usr/sbin/sluiced#g; s#^\# /etc/systemd/system/sluiced.service#\# /lib/systemd/system/sluiced.service (package sluice-agent)#' \
  "$REPO/slurm-conf/sluiced.service" >"$P/lib/systemd/system/sluiced.service"
"$BIN/sluiced" generate man "$P/usr/share/man/man8" >/dev/null
install -d "$P/usr/share/bash-completion/completions" "$P/usr/share/zsh/vendor-completions" \
  "$P/usr/share/fish/vendor_completions.d"
"$BIN/sluiced" generate completions bash >"$P/usr/share/bash-completion/completions/sluiced"
"$BIN/sluiced" generate completions zsh >"$P/usr/share/zsh/vendor-completions/_sluiced"
"$BIN/sluiced" generate completions fish >"$P/usr/share/fish/vendor_completions.d/sluiced.fish"
gzip -9n "$P"/usr/share/man/man8/*
install -d "$P/DEBIAN"
echo /etc/sluice/sluice.toml >"$P/DEBIAN/conffiles"
install -m 0755 "$REPO/packaging/sluice-agent.postinst" "$P/DEBIAN/postinst"
install -m 0755 "$REPO/packaging/sluice-agent.prerm" "$P/DEBIAN/prerm"
install -m 0755 "$REPO/packaging/sluice-agent.postrm" "$P/DEBIAN/postrm"
control sluice-agent "sluice agent: dataset stage-in and checkpoint archive for Slurm jobs
 sluiced runs on every compute node, as root, started before slurmd: it stages datasets onto the
 node's hot tier for the SPANK plugin (slurm-spank-sluice) and archives committed checkpoints to
 object storage. The package never starts it with a configuration that 'sluiced --check' refuses;
 on a first install it is not started at all: edit /etc/sluice/sluice.toml, then
 'systemctl enable --now sluiced'." \
  "Depends: $(depends sluice-agent)" "Recommends: sluice-cli (= $VERSION), slurm-spank-sluice (= $VERSION)"
build sluice-agent

# --- sluice-cli
P=$STAGING/sluice-cli
install -D -m 0755 "$BIN/sluice" "$P/usr/bin/sluice"
"$BIN/sluice" generate man "$P/usr/share/man/man1" >/dev/null
gzip -9n "$P"/usr/share/man/man1/*
install -d "$P/usr/share/bash-completion/completions" "$P/usr/share/zsh/vendor-completions" \
  "$P/usr/share/fish/vendor_completions.d" "$P/DEBIAN"
"$BIN/sluice" generate completions bash >"$P/usr/share/bash-completion/completions/sluice"
"$BIN/sluice" generate completions zsh >"$P/usr/share/zsh/vendor-completions/_sluice"
"$BIN/sluice" generate completions fish >"$P/usr/share/fish/vendor_completions.d/sluice.fish"
control sluice-cli "sluice command: status, checkpoints, cache, doctor
 The sluice command talks to this node's sluice agent for users and admins (status, jobs, checkpoint
 commit/list/verify/restore, the cache) and checks a node's set-up (sluice doctor)." \
  "Depends: $(depends sluice-cli)"
build sluice-cli

# --- slurm-spank-sluice
P=$STAGING/slurm-spank-sluice
install -D -m 0755 "$BIN/libspank_sluice.so" "$P/usr/lib/sluice/spank_sluice.so"
install -d "$P/usr/share/doc/slurm-spank-sluice/examples" "$P/DEBIAN"
sed 's#/usr/local/lib/sluice/spank_sluice.so#/usr/lib/sluice/spank_sluice.so#' \
  "$REPO/slurm-conf/plugstack.conf" >"$P/usr/share/doc/slurm-spank-sluice/examples/plugstack.conf"
install -m 0644 "$REPO/slurm-conf/slurm.conf.snippet" "$P/usr/share/doc/slurm-spank-sluice/examples/"
control slurm-spank-sluice "SPANK plugin for sluice (sbatch/srun --stage-in, --ckpt-*), Slurm $SLURM_MAJOR
 Adds sluice's options to sbatch, salloc and srun and hands jobs to the node's sluice agent. Built
 for Slurm $SLURM_VERSION: a SPANK plugin loads only into the Slurm release it was built against,
 hence the Breaks on every other slurmd. Enable it with the line in
 /usr/share/doc/slurm-spank-sluice/examples/plugstack.conf (in /etc/slurm/plugstack.conf)." \
  "Depends: $(depends slurm-spank-sluice)" "Recommends: sluice-agent (= $VERSION)" \
  "Breaks: slurmd (<< $SLURM_MAJOR), slurmd (>= $SLURM_NEXT~)"
build slurm-spank-sluice

# --- the Python writer, with its library (python/setup.py bundles it from SLUICE_WRITER_LIB_DIR).
# SLUICE_WHEEL_PYTHON: a Python with setuptools and wheel to build it offline (the test command uses
# its PyTorch venv's); otherwise pip builds it in an isolated environment (setuptools from PyPI).
WHEEL_TMP=$STAGING/wheel
cp -r "$REPO/python" "$WHEEL_TMP"
rm -rf "$WHEEL_TMP/build" "$WHEEL_TMP"/*.egg-info
if [[ -n ${SLUICE_WHEEL_PYTHON:-} ]]; then
  WHEEL_CMD=("$SLUICE_WHEEL_PYTHON" -m pip wheel --no-build-isolation)
elif python3 -m pip --version >/dev/null 2>&1; then
  WHEEL_CMD=(python3 -m pip wheel)
else
  python3 -m venv "$STAGING/venv"
  WHEEL_CMD=("$STAGING/venv/bin/python" -m pip wheel)
fi
(cd "$WHEEL_TMP" && SLUICE_WRITER_LIB_DIR=$BIN "${WHEEL_CMD[@]}" -q --no-deps --disable-pip-version-check \
  --wheel-dir "$OUT" . >&2)
say "$(ls "$OUT"/sluice_ckpt-*.whl)"
