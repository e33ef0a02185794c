#!/bin/sh
# Install the Debian 12 packages moonbox needs to build and test.
# Non-interactive, and a no-op when everything is already present.
set -eu
PACKAGES="build-essential cmake pkg-config git
libluajit-5.1-dev luajit libuv1-dev lua-cjson libseccomp-dev libmagic-dev
libwslay-dev
lua-busted lua-check python3 python3-yaml nginx-light procps curl jq git
python3-ipython python3-matplotlib bubblewrap bash-builtins squashfs-tools
chromium node-typescript shellcheck clang-format"
# the disk quota (sandbox/disk.lua): mkfs.ext4; mount, umount, fallocate
PACKAGES="$PACKAGES e2fsprogs util-linux mount"
# network = "egress" (lua/moonbox/network/): veth pairs (ip), one nftables
# table per sandbox (nft), a dnsmasq resolver per sandbox (nftset); nsenter
# is util-linux's
PACKAGES="$PACKAGES iproute2 nftables dnsmasq-base"
# the Python client's tests (spec/clients/): pip install into a venv, offline
# (setuptools and wheel build it without build isolation), and the OpenAPI
# description's schemas checked with jsonschema; the client's types with mypy
PACKAGES="$PACKAGES python3-venv python3-pip python3-setuptools python3-wheel python3-jsonschema python3-mypy"
# images (src/image_unpack.c): libarchive and nettle; the image specs build
# their rootfs from busybox-static, make file capabilities with setcap, and
# check archives skopeo writes
PACKAGES="$PACKAGES libarchive-dev nettle-dev busybox-static libcap2-bin skopeo"
# the fuzz build (cmake/fuzz.cmake): clang, and libclang-rt-14-dev for the libFuzzer runtime
PACKAGES="$PACKAGES clang libclang-rt-14-dev"
# node and npm (the page's xterm.js, its browser test): Debian's unless present
command -v npm >/dev/null 2>&1 || PACKAGES="$PACKAGES nodejs npm"
missing=""
for p in $PACKAGES; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  echo "install-deps: installing$missing" >&2
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  # shellcheck disable=SC2086
  $SUDO apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi

# The page's npm packages (xterm.js; playwright-core for its browser test),
# pinned by share/page/package-lock.json, into a cache in the source tree
# that the build copies from (the build itself never reaches the network).
# MOONBOX_PAGE_DEPS overrides the cache's place (pass the same directory to
# cmake as -DMOONBOX_PAGE_DEPS=DIR).
root="$(cd "$(dirname "$0")/.." && pwd)"
cache="${MOONBOX_PAGE_DEPS:-$root/.deps/page}"
if ! cmp -s "$root/share/page/package-lock.json" "$cache/package-lock.json" ||
   [ ! -e "$cache/node_modules/@xterm/xterm/lib/xterm.js" ]; then
  echo "install-deps: npm ci into $cache" >&2
  mkdir -p "$cache"
  cp "$root/share/page/package.json" "$root/share/page/package-lock.json" "$cache/"
  # without it everything builds and works but the page's terminal
  if ! command -v npm >/dev/null 2>&1 || ! npm ci --no-audit --no-fund --loglevel=error --prefix "$cache"; then
    echo "install-deps: could not fetch the page's npm packages: the page will say the terminal is unavailable" >&2
  fi
fi
