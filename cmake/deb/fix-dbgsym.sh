#!/bin/sh
# fix-dbgsym.sh DDEB: repair the -dbgsym package CPack 3.25 makes
# (CPACK_DEBIAN_DEBUGINFO_PACKAGE), which lintian rejects: its md5sums name
# the build machine's staging paths instead of the package's, its .debug
# files are executable, and it has no copyright or changelog. As debhelper
# does, its doc directory becomes a link to the main package's (it depends
# on that package at the same version). Rebuilt in place with dpkg-deb.
set -eu
ddeb=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
dpkg-deb -R "$ddeb" "$tmp/pkg"
pkg=$(sed -n 's/^Package: //p' "$tmp/pkg/DEBIAN/control")
main=${pkg%-dbgsym}
find "$tmp/pkg/usr/lib/debug" -type f -exec chmod 0644 {} +
mkdir -p "$tmp/pkg/usr/share/doc"
ln -s "$main" "$tmp/pkg/usr/share/doc/$pkg"
(cd "$tmp/pkg" && find usr -type f | LC_ALL=C sort | xargs md5sum) >"$tmp/pkg/DEBIAN/md5sums"
chmod 0644 "$tmp/pkg/DEBIAN/md5sums"
dpkg-deb --root-owner-group -Zxz -b "$tmp/pkg" "$ddeb" >/dev/null
