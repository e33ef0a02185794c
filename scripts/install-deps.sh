#!/bin/sh
# Install the Debian 12 packages moonbox needs to build and test.
# Non-interactive, and a no-op when everything is already present.
set -eu
PACKAGES="build-essential cmake pkg-config git
libluajit-5.1-dev luajit libuv1-dev lua-cjson libseccomp-dev libmagic-dev
libwebsockets-dev libwebsockets-evlib-uv
lua-busted lua-check python3 python3-yaml nginx-light procps curl git
python3-ipython python3-matplotlib bubblewrap bash-builtins squashfs-tools
chromium"
# node and npm (the page's xterm.js, its browser test): Debian's unless present
command -v npm >/dev/null 2>&1 || PACKAGES="$PACKAGES nodejs npm"
missing=""
for p in $PACKAGES; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
echo "install-deps: installing$missing" >&2
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# shellcheck disable=SC2086
$SUDO apt-get install -y -qq --no-install-recommends $missing >/dev/null
