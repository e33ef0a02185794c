#!/bin/sh
# moonbox-<version>-1.rockspec: rockspec-test.sh SOURCE_DIR WORK_DIR
# loads it as luarocks does (Lua syntax, in an empty environment), checks its
# fields against the project (name, version, build type), then builds it:
# with `luarocks make` into a private tree where luarocks is installed, else
# the way luarocks' cmake back-end does (its build.variables, with PREFIX,
# LUADIR and LIBDIR substituted). Either way plain luajit must then
# `require "moonbox"` from that tree alone and a session shell must load the
# spawn builtin.
set -eu
src=$(cd "$1" && pwd)
mkdir -p "$2"
work=$(cd "$2" && pwd)
# the project version, defined once in CMakeLists.txt
version=$(sed -n 's/^project(moonbox VERSION \([0-9.]*\) .*/\1/p' "$src/CMakeLists.txt")
[ -n "$version" ] || { echo "$0: no project version in $src/CMakeLists.txt" >&2; exit 1; }
rockspec=$src/moonbox-$version-1.rockspec
[ -f "$rockspec" ] || { echo "rockspec-test: no $rockspec" >&2; exit 1; }
tree=$work/tree
# a fresh tree and build each time: an incremental build of an earlier
# checkout's configuration failed to link once its source lists changed
rm -rf "$tree" "$work/build"
# prints the -D arguments of luarocks' cmake back-end
args=$(luajit - "$rockspec" "$version-1" "$tree" <<'LUA'
local path, want_version, tree = arg[1], arg[2], arg[3]
local env = {}
local chunk = assert(loadfile(path))
setfenv(chunk, env)
chunk()
local function check(cond, what) if not cond then io.stderr:write("rockspec: " .. what .. "\n") os.exit(1) end end
check(env.package == "moonbox", "package is not moonbox")
check(env.version == want_version, "version " .. tostring(env.version) .. ", want " .. want_version)
check(type(env.source) == "table" and type(env.source.url) == "string", "source.url missing")
check(type(env.description) == "table" and env.description.license == "MIT", "description.license is not MIT")
check(type(env.build) == "table" and env.build.type == "cmake", "build.type is not cmake")
local vars = { PREFIX = tree .. "/rocks/moonbox", LUADIR = tree .. "/rocks/moonbox/lua",
  LIBDIR = tree .. "/rocks/moonbox/lib" }
local out = {}
for k, v in pairs(env.build.variables or {}) do
  v = v:gsub("%$%((%w+)%)", function(name) return check(vars[name], "unknown variable " .. name) or vars[name] end)
  out[#out + 1] = ("-D%s=%s"):format(k, v)
end
table.sort(out)
print(table.concat(out, "\n"))
LUA
)
echo "rockspec: $(basename "$rockspec") ok"
if command -v luarocks >/dev/null; then
  (cd "$src" && luarocks make --tree "$tree" "$rockspec")
  luadir=$(luarocks --tree "$tree" config deploy_lua_dir 2>/dev/null || echo "$tree/share/lua/5.1")
  libdir=$(luarocks --tree "$tree" config deploy_lib_dir 2>/dev/null || echo "$tree/lib/lua/5.1")
else
  echo "luarocks not installed: building as its cmake back-end does"
  # shellcheck disable=SC2086
  set -- $args
  cmake -S "$src" -B "$work/build" "$@" >/dev/null
  cmake --build "$work/build" -j2 >/dev/null
  cmake --build "$work/build" --target install >/dev/null
  luadir=$tree/rocks/moonbox/lua libdir=$tree/rocks/moonbox/lib
  # the Lua module only: no command, library or page in the rock
  for f in bin/moonbox lib/libmoonbox.so share; do
    [ ! -e "$tree/rocks/moonbox/$f" ] || { echo "rockspec-test: the rock installs $f" >&2; exit 1; }
  done
fi
home=$(mktemp -d /tmp/moonbox-rock-XXXXXX)
trap 'rm -rf "$home"' EXIT
cd "$home"
out=$(env -u MOONBOX_LUA_DIR -u MOONBOX_BUILD_DIR -u MOONBOX_SOURCE_DIR HOME="$home" MOONBOX_HOME="$home/mb" \
  LUA_PATH="$luadir/?.lua;$luadir/?/init.lua;;" LUA_CPATH="$libdir/?.so;;" luajit -e '
  local moonbox = require "moonbox"
  moonbox.run(function()
    local sb = moonbox.getSandbox("rock", { root = os.getenv("HOME") .. "/sandbox" })
    print("module: " .. package.searchpath("moonbox", package.path))
    print("core: " .. package.searchpath("moonbox.core", package.cpath))
    print("builtin: " .. sb:exec("enable -a | grep -c __mb_run").stdout:gsub("\n", ""))
    sb:destroy()
  end)')
echo "$out"
printf '%s\n' "$out" | grep -qx "module: $luadir/moonbox/init.lua" || { echo "rockspec-test: modules not from the rock" >&2; exit 1; }
printf '%s\n' "$out" | grep -qx "core: $libdir/moonbox/core.so" || { echo "rockspec-test: core.so not from the rock" >&2; exit 1; }
printf '%s\n' "$out" | grep -qx "builtin: 1" || { echo "rockspec-test: no spawn builtin" >&2; exit 1; }
echo "rockspec-test: ok"
