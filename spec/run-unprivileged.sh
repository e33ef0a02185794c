#!/bin/sh
# Run one spec file as the unprivileged user nobody. The checkout may live
# where nobody cannot read it (under /root, say), so the runtime is installed
# into a temporary prefix and the Lua sources and specs are copied next to it.
set -eu
build=$1 spec=$2
src=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d /tmp/moonbox-unpriv.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
mkdir -p "$tmp/build/lib/moonbox" "$tmp/src"
# the spawn builtin (src/module.c) and the sandbox init (src/nsinit_host.c) are found beside core.so
cp "$build/lib/moonbox/core.so" "$build/lib/moonbox/bash_spawn.so" "$build/lib/moonbox/moonbox-init" "$tmp/build/lib/moonbox/"
cp -r "$src/lua" "$src/spec" "$src/.luacheckrc" "$tmp/src/"
# the session shell's start-up script and the code-interpreter kernels, found
# from the modules (lua/moonbox/session/shell.lua, lua/moonbox/code/init.lua)
mkdir -p "$tmp/src/share" && cp -r "$src/share/shell" "$src/share/kernels" "$tmp/src/share/"
chmod -R a+rX "$tmp"
cd "$tmp/src"
# MOONBOX_TEST_ISOLATION=none (the unprivileged.*.no-namespaces tests): a
# host without user namespaces, where an unprivileged runtime has neither
# namespaces nor cgroups and tracks every tree through /proc alone
set -- HOME=/tmp
if [ -n "${MOONBOX_TEST_ISOLATION:-}" ]; then set -- "$@" MOONBOX_TEST_ISOLATION="$MOONBOX_TEST_ISOLATION"; fi
# the egress spec's "internet", made by root (spec/network/run-unprivileged.sh)
if [ -n "${MOONBOX_TEST_INTERNET:-}" ]; then set -- "$@" MOONBOX_TEST_INTERNET="$MOONBOX_TEST_INTERNET"; fi
runuser -u nobody -- env "$@" PATH="$PATH" MOONBOX_BUILD_DIR="$tmp/build" MOONBOX_SOURCE_DIR="$tmp/src" \
  MOONBOX_BIN="$tmp/prefix/bin/moonbox" luajit /usr/bin/busted --helper=spec/helper.lua -o utfTerminal "$spec"
