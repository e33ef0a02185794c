#!/bin/sh
# An installed tree works on its own, wherever it is moved:
#   install-test.sh SOURCE_DIR BUILD_DIR
# installs the build to a temporary prefix, moves the prefix, then, with the
# source and build trees hidden (a tmpfs over each in bwrap, where bwrap can
# run; otherwise by checking that no search path names them), runs from the
# moved prefix: the quickstart (its output against examples/expected), the
# embedding example built with `pkg-config --cflags --libs moonbox`, a
# session whose shell must have loaded the spawn builtin (`enable -a`), the
# code-interpreter kernels, the page of `moonbox serve` (with xterm.js), and
# plain `luajit -e 'require "moonbox"'` with LUA_PATH/LUA_CPATH on the prefix
# (and examples/embed/luajit_host.lua, a host loop driving moonbox.step()).
set -eu
src=$(cd "$1" && pwd) build=$(cd "$2" && pwd)
tmp=$(mktemp -d /tmp/moonbox-install-XXXXXX)
cleanup() { rm -rf "$tmp"; }
trap cleanup EXIT
fail() { echo "install-test: $*" >&2; exit 1; }

cmake --install "$build" --prefix "$tmp/first" >/dev/null
mv "$tmp/first" "$tmp/moved"
p=$tmp/moved
mkdir -p "$tmp/work" "$tmp/home"
cp "$src/examples/quickstart.lua" "$src/examples/expected/quickstart.txt" "$src/spec/match-lines.lua" \
  "$src/examples/embed/embed.c" "$src/examples/embed/luajit_host.lua" "$tmp/work/"

# the embedding example, against the moved prefix's moonbox.pc only
PKG_CONFIG_PATH="$p/lib/pkgconfig"
export PKG_CONFIG_PATH
libdir=$(pkg-config --variable=libdir moonbox)
case "$libdir" in "$p"/*) ;; *) fail "moonbox.pc's libdir $libdir is not under the moved prefix" ;; esac
# shellcheck disable=SC2046
cc -o "$tmp/work/embed" "$tmp/work/embed.c" $(pkg-config --cflags --libs moonbox) -Wl,-rpath,"$libdir"

# what runs with the trees hidden
cat >"$tmp/work/run.sh" <<'EOF'
set -eu
p=$1 src=$2 build=$3
cd "$(dirname "$0")"
for dir in "$src/lua" "$build/lua" "$build/lib"; do
  if [ -e "$dir/moonbox/init.lua" ] || [ -e "$dir/moonbox/core.so" ]; then echo "hidden: $dir still visible"; fi
done
"$p/bin/moonbox" quickstart.lua >quickstart.out
"$p/bin/moonbox" match-lines.lua quickstart.txt quickstart.out
echo "quickstart: ok"
./embed
# the Lua modules, the builtin and the kernels all come from the prefix
"$p/bin/moonbox" -e '
  local moonbox = require "moonbox"
  print("module: " .. package.searchpath("moonbox", package.path))
  local sb = moonbox.getSandbox("install-test", { root = arg[1] .. "/sandbox" })
  local r = sb:exec("enable -a | grep -c __mb_run")
  print("builtin: " .. r.stdout:gsub("\n", "") .. " " .. r.exitCode)
  print("kernel: " .. tostring(sb:runCode("return 6 * 7", { language = "lua" }).results[1].text))
  sb:destroy()' "$PWD"
# the page, with its vendored xterm.js
"$p/bin/moonbox" serve --listen 127.0.0.1:0 >serve.out 2>&1 &
spid=$!
i=0
while [ $i -lt 300 ] && ! grep -q "moonbox: open" serve.out; do sleep 0.1; i=$((i + 1)); done
url=$(sed -n 's/.*listening on \(http:[^ ]*\).*/\1/p' serve.out | head -n1)
token=$(sed -n 's/.*moonbox: open http:[^ ]*?token=\([0-9a-f]*\).*/\1/p' serve.out | head -n1)
if command -v curl >/dev/null; then
  curl -sf "$url/?token=$token" | grep -q "<title>moonbox</title>" && echo "page: index"
  curl -sf -o /dev/null "$url/page/xterm.js?token=$token" && echo "page: xterm.js"
fi
kill "$spid"; wait "$spid" || true
if command -v luajit >/dev/null; then
  LUA_PATH="$p/share/lua/5.1/?.lua;$p/share/lua/5.1/?/init.lua;;" LUA_CPATH="$p/lib/lua/5.1/?.so;;" \
    luajit -e '
    local moonbox = require "moonbox"
    moonbox.run(function()
      local sb = moonbox.getSandbox("install-luajit", { root = os.getenv("PWD") .. "/sandbox2" })
      print("luajit: " .. package.searchpath("moonbox.core", package.cpath) .. " " ..
        sb:exec("enable -a | grep -c __mb_run").stdout:gsub("\n", ""))
      sb:destroy()
    end)'
  # a host loop driving the runtime with moonbox.step() and moonbox.backend()
  LUA_PATH="$p/share/lua/5.1/?.lua;$p/share/lua/5.1/?/init.lua;;" LUA_CPATH="$p/lib/lua/5.1/?.so;;" \
    luajit luajit_host.lua
fi
EOF

env_run() {
  env -u LUA_PATH -u LUA_CPATH -u MOONBOX_BUILD_DIR -u MOONBOX_SOURCE_DIR -u MOONBOX_BIN -u MOONBOX_LUA_DIR \
    -u LD_LIBRARY_PATH HOME="$tmp/home" MOONBOX_HOME="$tmp/home/moonbox" "$@"
}
hide=""
for dir in "$src" "$build"; do hide="$hide --tmpfs $dir"; done
# shellcheck disable=SC2086
if command -v bwrap >/dev/null && bwrap --dev-bind / / $hide -- true 2>/dev/null; then
  echo "source and build trees hidden under bwrap"
  # shellcheck disable=SC2086
  out=$(env_run bwrap --dev-bind / / $hide -- sh "$tmp/work/run.sh" "$p" "$src" "$build")
else
  echo "bwrap cannot hide the trees here: checking the search paths instead"
  out=$(env_run sh "$tmp/work/run.sh" "$p" "$src" "$build")
  paths=$(env_run "$p/bin/moonbox" -e 'print(package.path .. ";" .. package.cpath)')
  case "$paths" in *"$src"*|*"$build"*) fail "a search path names the source or build tree: $paths" ;; esac
fi
echo "$out"
expect() {
  printf '%s\n' "$out" | grep -qx -- "$1" || fail "expected a line '$1'"
}
printf '%s\n' "$out" | grep -q '^hidden:' && fail "the trees were not hidden"
expect "quickstart: ok"
expect "hello from a task on the host loop"
expect "pending tasks: 0"
expect "module: $p/share/lua/5.1/moonbox/init.lua"
expect "builtin: 1 0"
expect "kernel: 42"
if command -v curl >/dev/null; then
  expect "page: index"
  expect "page: xterm.js"
fi
if command -v luajit >/dev/null; then
  expect "luajit: $p/lib/lua/5.1/moonbox/core.so 1"
  expect "hello from a task on a LuaJIT host loop"
  expect "host loop turns: some"
fi
echo "install-test: ok"
