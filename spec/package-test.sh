#!/bin/sh
# The Debian packages: package-test.sh SOURCE_DIR WORK_DIR [PAGE_DEPS]
# configures and builds the source for /usr in WORK_DIR (kept between runs
# so that a rebuild is incremental), runs `cpack -G DEB`, and checks the
# packages (moonbox, moonbox-dev, moonbox-dbgsym): lintian finds no error
# in them (its warnings are printed; docs/packaging.md explains each), the
# binaries are stripped and their debug info is in -dbgsym by build id, the
# runtime package has no development files, the systemd unit passes
# `systemd-analyze verify`, then the package's name, control fields and
# files (dpkg-deb -I/-c), that apt would install it here (apt-get -s), that every
# library its binaries link comes from a package in Depends, that Debian's
# luajit finds the Lua module where it is, and, unpacked with `dpkg -x` into
# a throwaway root, that the quickstart runs from there (with the source
# and work trees hidden under bwrap where bwrap can run) and its session
# shells load the spawn builtin; the quickstart is the package's own
# (/usr/share/doc/moonbox/examples). Then, as root, `apt-get install` of
# moonbox and moonbox-dev on this machine, the same run from /usr,
# `systemd-analyze verify` of the installed unit, and `apt-get remove`
# (skipped, saying why, when not root or when the package's files or an
# installed moonbox are there already).
set -eu
src=$(cd "$1" && pwd)
mkdir -p "$2"
work=$(cd "$2" && pwd)
deps=${3:-$src/.deps/page}
fail() { echo "package-test: $*" >&2; exit 1; }

cmake -S "$src" -B "$work/build" -DCMAKE_INSTALL_PREFIX=/usr -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DMOONBOX_PAGE_DEPS="$deps" >/dev/null
cmake --build "$work/build" -j2 >/dev/null
rm -f "$work"/build/moonbox*.deb "$work"/build/moonbox*.ddeb
(cd "$work/build" && cpack -G DEB >"$work/cpack.log" 2>&1) || fail "cpack: $(tail -n 20 "$work/cpack.log")"

# the project version, defined once in CMakeLists.txt
version=$(sed -n 's/^project(moonbox VERSION \([0-9.]*\) .*/\1/p' "$src/CMakeLists.txt")
[ -n "$version" ] || { echo "$0: no project version in $src/CMakeLists.txt" >&2; exit 1; }
arch=$(dpkg --print-architecture)
triplet=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || gcc -print-multiarch)
deb=$work/build/moonbox_${version}-1_${arch}.deb
dev=$work/build/moonbox-dev_${version}-1_${arch}.deb
dbgsym=$work/build/moonbox-dbgsym_${version}-1_${arch}.ddeb
for f in "$deb" "$dev" "$dbgsym"; do
  [ -f "$f" ] || fail "no $f: $(ls "$work/build"/*deb 2>/dev/null)"
  echo "package: $(basename "$f")"
done

# lintian: no errors (tags E:); its warnings printed (docs/packaging.md)
command -v lintian >/dev/null || fail "no lintian (apt-get install lintian; scripts/install-deps.sh test does)"
lintian --allow-root --fail-on none "$deb" "$dev" "$dbgsym" >"$work/lintian.txt" 2>&1 ||
  fail "lintian did not run: $(tail -n 3 "$work/lintian.txt")"
sed -n 's/^\([EW]\): /lintian \1: /p' "$work/lintian.txt"
if grep -q '^E: ' "$work/lintian.txt"; then fail "lintian reports errors (above)"; fi
echo "lintian: no errors"

field() { dpkg-deb -f "$deb" "$1"; }
[ "$(field Package)" = moonbox ] || fail "Package is $(field Package)"
[ "$(field Version)" = "$version-1" ] || fail "Version is $(field Version)"
[ "$(field Architecture)" = "$arch" ] || fail "Architecture is $(field Architecture)"
depends=$(field Depends)
echo "Depends: $depends"
has_dep() { printf '%s\n' "$depends" | tr ',' '\n' | sed 's/^ *//; s/ .*//' | grep -qx "$1"; }
for p in libluajit-5.1-2 libuv1 libseccomp2 libwslay1 libmagic1 lua-cjson bash; do
  has_dep "$p" || fail "Depends lacks $p"
done
dpkg-deb -I "$deb" >/dev/null

files=$(dpkg-deb -c "$deb" | awk '{print $6}')
for f in ./usr/bin/moonbox "./usr/lib/$triplet/libmoonbox.so.0" \
         "./usr/lib/$triplet/lua/5.1/moonbox/core.so" "./usr/lib/$triplet/lua/5.1/moonbox/bash_spawn.so" \
         "./usr/lib/$triplet/lua/5.1/moonbox/moonbox-init" \
         ./usr/share/lua/5.1/moonbox/init.lua ./usr/share/moonbox/kernels/lua_kernel.lua \
         ./usr/share/moonbox/page/index.html ./usr/share/moonbox/page/vendor/lib/xterm.js \
         ./usr/share/moonbox/page/vendor/css/xterm.css ./usr/share/moonbox/shell/prelude.bash \
         ./usr/share/doc/moonbox/copyright ./usr/share/doc/moonbox/changelog.Debian.gz \
         ./usr/share/doc/moonbox/examples/quickstart.lua ./usr/share/man/man1/moonbox.1.gz \
         ./usr/share/bash-completion/completions/moonbox ./lib/systemd/system/moonbox.service \
         ./usr/share/lintian/overrides/moonbox; do
  printf '%s\n' "$files" | grep -qx -- "$f" || fail "the package has no $f"
done
# development files are moonbox-dev's
for f in "./usr/lib/$triplet/libmoonbox.so" "./usr/lib/$triplet/pkgconfig/moonbox.pc" ./usr/include/moonbox.h; do
  if printf '%s\n' "$files" | grep -qx -- "$f"; then fail "the runtime package has $f"; fi
done
dev_files=$(dpkg-deb -c "$dev" | awk '{print $6}')
for f in "./usr/lib/$triplet/libmoonbox.so" "./usr/lib/$triplet/pkgconfig/moonbox.pc" ./usr/include/moonbox.h \
         ./usr/include/moonbox_version.h ./usr/share/doc/moonbox-dev/copyright; do
  printf '%s\n' "$dev_files" | grep -qx -- "$f" || fail "moonbox-dev has no $f"
done
[ "$(dpkg-deb -f "$dev" Depends)" = "moonbox (= $version-1)" ] || fail "moonbox-dev Depends: $(dpkg-deb -f "$dev" Depends)"
if printf '%s\n' "$files" "$dev_files" | grep -q "$src\|$work"; then fail "the package names the build's trees"; fi

# apt accepts it and can satisfy its Depends here (a simulation: nothing is installed)
if command -v apt-get >/dev/null; then
  apt-get -s install "$deb" 2>&1 | grep -q "^Inst moonbox " || fail "apt-get -s install $deb: $(apt-get -s install "$deb" 2>&1 | tail -n 3)"
  echo "apt-get -s install: ok"
fi

root=$(mktemp -d /tmp/moonbox-deb-XXXXXX)
cleanup() { rm -rf "$root"; }
trap cleanup EXIT
dpkg -x "$deb" "$root/fs"
dpkg -x "$dbgsym" "$root/dbg"

# every ELF file is stripped, and -dbgsym has its debug info by build id
# the package's own paths: no blanks in them
# shellcheck disable=SC2044
for elf in $(find "$root/fs" -type f -name '*.so*' -o -type f -path '*/bin/*' -o -type f -name moonbox-init); do
  if readelf -S "$elf" | grep -q '\.debug_info\|\.symtab'; then fail "$elf is not stripped"; fi
  id=$(readelf -n "$elf" | sed -n 's/.*Build ID: *\([0-9a-f]*\).*/\1/p')
  [ -n "$id" ] || fail "$elf has no build id"
  dbg="$root/dbg/usr/lib/debug/.build-id/$(printf %s "$id" | cut -c1-2)/$(printf %s "$id" | cut -c3-).debug"
  readelf -S "$dbg" 2>/dev/null | grep -q '\.debug_info' || fail "moonbox-dbgsym has no debug info for $elf"
done
echo "binaries: stripped, debug info in moonbox-dbgsym"

# the systemd unit: systemd-analyze verify says nothing of it (it exits 0 on
# unknown keys, only printing them), with ExecStart pointed at the unpacked binary
unit_check() { # unit-file: fails on anything systemd-analyze says of it
  said=$(systemd-analyze verify --man=no "$1" 2>&1 | grep -F "moonbox.service" || true)
  [ -z "$said" ] || fail "systemd-analyze verify $1: $said"
}
command -v systemd-analyze >/dev/null ||
  fail "no systemd-analyze (apt-get install systemd; scripts/install-deps.sh test does)"
mkdir -p "$root/unit"
sed "s,/usr/bin/moonbox ,$root/fs/usr/bin/moonbox ," "$root/fs/lib/systemd/system/moonbox.service" \
  >"$root/unit/moonbox.service"
grep -q "^ExecStart=$root/fs/usr/bin/moonbox serve " "$root/unit/moonbox.service" || fail "the unit's ExecStart"
unit_check "$root/unit/moonbox.service"
echo "systemd-analyze verify: ok"

# every NEEDED library of the package's ELF files comes from itself or from
# a package in Depends
# the package's own paths: no blanks in them
# shellcheck disable=SC2044
for elf in $(find "$root/fs" -type f -name '*.so*' -o -type f -path '*/bin/*'); do
  for lib in $(readelf -d "$elf" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
    [ -e "$root/fs/usr/lib/$triplet/$lib" ] && continue
    path=$(ldconfig -p | awk -v l="$lib" '$1 == l && /x86-64|x86_64|64bit/ { print $NF; exit }')
    [ -n "$path" ] || path=$(ldconfig -p | awk -v l="$lib" '$1 == l { print $NF; exit }')
    [ -n "$path" ] || fail "$elf needs $lib, which this machine does not have"
    pkg=$(dpkg -S "$path" 2>/dev/null || dpkg -S "$(readlink -f "$path")" 2>/dev/null ||
          dpkg -S "/usr$path" 2>/dev/null || dpkg -S "${path#/usr}" 2>/dev/null || true)
    pkg=$(printf '%s\n' "$pkg" | head -n1 | cut -d: -f1)
    [ -n "$pkg" ] || fail "no package owns $path ($lib)"
    [ "$pkg" = libc6 ] || has_dep "$pkg" || fail "$(basename "$elf") needs $lib from $pkg, not in Depends"
  done
done
echo "linked libraries: all from Depends"

# Debian's luajit finds the module where the package puts it
if command -v luajit >/dev/null; then
  luajit -e 'print(package.path) print(package.cpath)' | tr ';' '\n' >"$root/paths"
  grep -qx "/usr/lib/$triplet/lua/5.1/?.so" "$root/paths" || fail "luajit's cpath has no /usr/lib/$triplet/lua/5.1"
  grep -qx "/usr/share/lua/5.1/?/init.lua" "$root/paths" || fail "luajit's path has no /usr/share/lua/5.1"
fi

# the quickstart from the unpacked package
mkdir -p "$root/work" "$root/home"
cp "$src/examples/expected/quickstart.txt" "$src/spec/match-lines.lua" "$root/work/"
cat >"$root/work/run.sh" <<'EOF'
set -eu
bin=$1
cd "$(dirname "$0")"
"$bin" "$(dirname "$bin")/../share/doc/moonbox/examples/quickstart.lua" >quickstart.out
"$bin" match-lines.lua quickstart.txt quickstart.out
"$bin" -e '
  local moonbox = require "moonbox"
  print("module: " .. package.searchpath("moonbox", package.path))
  local sb = moonbox.getSandbox("package-test", { root = os.getenv("PWD") .. "/sandbox" })
  print("builtin: " .. sb:exec("enable -a | grep -c __mb_run").stdout:gsub("\n", ""))
  sb:destroy()'
echo "quickstart: ok"
EOF
run() {
  env -u LUA_PATH -u LUA_CPATH -u MOONBOX_BUILD_DIR -u MOONBOX_SOURCE_DIR -u MOONBOX_BIN -u MOONBOX_LUA_DIR \
    -u LD_LIBRARY_PATH HOME="$root/home" MOONBOX_HOME="$root/home/moonbox" "$@"
}
if command -v bwrap >/dev/null && bwrap --dev-bind / / --tmpfs "$src" --tmpfs "$work" -- true 2>/dev/null; then
  out=$(run bwrap --dev-bind / / --tmpfs "$src" --tmpfs "$work" -- sh "$root/work/run.sh" "$root/fs/usr/bin/moonbox")
else
  out=$(run sh "$root/work/run.sh" "$root/fs/usr/bin/moonbox")
fi
echo "$out"
printf '%s\n' "$out" | grep -qx "module: $root/fs/usr/share/lua/5.1/moonbox/init.lua" || fail "modules not from the package"
printf '%s\n' "$out" | grep -qx "builtin: 1" || fail "the session shell did not load the spawn builtin"
printf '%s\n' "$out" | grep -qx "quickstart: ok" || fail "quickstart"

# Installed for real with apt-get, the quickstart run from /usr, then removed.
# Only as root, and only where it cannot touch anything of the machine's
# own: not when moonbox is installed already, nor when a file of the package
# exists on this machine (owned by another package or by no package, e.g. a
# `cmake --install` to /usr); then it says why and leaves the machine alone.
installed_for_real=""
skip_install() { echo "apt-get install: not run: $*"; }
if [ "$(id -u)" -ne 0 ]; then
  skip_install "needs root (this test runs as $(id -un))"
elif ! command -v apt-get >/dev/null; then
  skip_install "no apt-get"
elif dpkg-query -W -f='${Status}' moonbox 2>/dev/null | grep -q "installed"; then
  skip_install "a moonbox package is installed on this machine already: $(dpkg-query -W -f='${Version}' moonbox)"
else
  clash=""
  for f in $( (dpkg-deb -c "$deb"; dpkg-deb -c "$dev") | awk '$1 !~ /^d/ {print $6}' | sed 's,^\.,,'); do
    if [ -e "$f" ] || [ -L "$f" ]; then clash="$clash $f"; fi
  done
  if [ -n "$clash" ]; then
    skip_install "these files of the package exist on this machine:$clash"
  else
    installed_for_real=1
  fi
fi
if [ -n "$installed_for_real" ]; then
  remove_pkg() { apt-get remove -y -qq -o DPkg::Lock::Timeout=300 moonbox moonbox-dev >/dev/null 2>&1 || true; }
  trap 'remove_pkg; cleanup' EXIT
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=300 "$deb" "$dev" >"$root/apt.log" 2>&1 ||
    fail "apt-get install $deb: $(tail -n 5 "$root/apt.log")"
  [ "$(dpkg-query -W -f='${Status} ${Version}' moonbox)" = "install ok installed $version-1" ] ||
    fail "dpkg does not list moonbox $version as installed"
  [ -x /usr/bin/moonbox ] || fail "no /usr/bin/moonbox after apt-get install"
  [ "$(pkg-config --modversion moonbox 2>/dev/null)" = "$version" ] || fail "installed: pkg-config does not find moonbox"
  echo "apt-get install: ok"
  unit_check /lib/systemd/system/moonbox.service
  echo "installed: systemd-analyze verify: ok"
  rm -rf "${root:?}/home"; mkdir -p "$root/home"
  if command -v bwrap >/dev/null && bwrap --dev-bind / / --tmpfs "$src" --tmpfs "$work" -- true 2>/dev/null; then
    out=$(run bwrap --dev-bind / / --tmpfs "$src" --tmpfs "$work" -- sh "$root/work/run.sh" /usr/bin/moonbox)
  else
    out=$(run sh "$root/work/run.sh" /usr/bin/moonbox)
  fi
  echo "$out"
  printf '%s\n' "$out" | grep -qx "module: /usr/share/lua/5.1/moonbox/init.lua" || fail "installed: modules not from /usr"
  printf '%s\n' "$out" | grep -qx "builtin: 1" || fail "installed: the session shell did not load the spawn builtin"
  printf '%s\n' "$out" | grep -qx "quickstart: ok" || fail "installed: quickstart"
  # plain luajit finds the installed module on its standard paths
  [ "$(cd / && env -u LUA_PATH -u LUA_CPATH luajit -e 'print(package.searchpath("moonbox", package.path))')" = \
    /usr/share/lua/5.1/moonbox/init.lua ] || fail "installed: luajit does not find moonbox on its standard path"
  DEBIAN_FRONTEND=noninteractive apt-get remove -y -qq -o DPkg::Lock::Timeout=300 moonbox moonbox-dev >"$root/apt.log" 2>&1 ||
    fail "apt-get remove moonbox: $(tail -n 5 "$root/apt.log")"
  trap cleanup EXIT
  ! dpkg-query -W -f='${Status}' moonbox 2>/dev/null | grep -q "ok installed" || fail "moonbox still installed after apt-get remove"
  for f in $( (dpkg-deb -c "$deb"; dpkg-deb -c "$dev") | awk '$1 !~ /^d/ {print $6}' | sed 's,^\.,,'); do
    if [ -e "$f" ] || [ -L "$f" ]; then fail "$f is left after apt-get remove"; fi
  done
  echo "apt-get remove: ok, every file of the package gone"
fi
echo "package-test: ok"
