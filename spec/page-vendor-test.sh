#!/bin/sh
# The page's vendored xterm.js: page-vendor-test.sh SOURCE_DIR NPM_CACHE
# share/page/vendor/ holds @xterm/xterm's lib/xterm.js, css/xterm.css and
# LICENSE byte for byte as the npm package at the version
# share/page/package-lock.json pins (the cache scripts/install-deps.sh fills
# with `npm ci` from that lock file).
set -eu
src=$1
pkg=$2/node_modules/@xterm/xterm
fail() { echo "page-vendor-test: $*" >&2; exit 1; }
pinned=$(node -e 'const l = require(process.argv[1]); console.log(l.packages["node_modules/@xterm/xterm"].version)' \
  "$src/share/page/package-lock.json")
cached=$(node -e 'console.log(require(process.argv[1]).version)' "$pkg/package.json")
[ "$pinned" = "$cached" ] || fail "the npm cache has @xterm/xterm $cached, the lock file pins $pinned (run scripts/install-deps.sh test)"
for f in lib/xterm.js css/xterm.css LICENSE; do
  cmp -s "$pkg/$f" "$src/share/page/vendor/$f" ||
    fail "share/page/vendor/$f differs from @xterm/xterm $pinned's $f (copy it from $pkg)"
done
echo "page-vendor-test: ok (@xterm/xterm $pinned)"
