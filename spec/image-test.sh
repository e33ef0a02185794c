#!/bin/sh
# The container image without a registry: image-test.sh SOURCE_DIR WORK_DIR BUILD_DIR
# makes a Debian 12 base with mmdebstrap (from Debian's apt mirror), imports
# it into buildah's storage under WORK_DIR (vfs driver: no overlay mounts),
# builds deploy/Dockerfile on it (--isolation chroot: no user namespaces or
# runtime needed), and runs the quickstart from the image's own examples
# (/usr/share/doc/moonbox/examples), its output matched against
# examples/expected/quickstart.txt, and moonbox saying why its sandboxes
# run unisolated there. As root only (buildah's chroot isolation
# and mmdebstrap's root mode); the storage is removed at the end, the base
# tarball kept in WORK_DIR for the next run (made again after a week).
set -eu
src=$(cd "$1" && pwd)
mkdir -p "$2"
work=$(cd "$2" && pwd)
build=$(cd "$3" && pwd)
fail() { echo "image-test: $*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || fail "needs root (mmdebstrap and buildah as root)"
for tool in mmdebstrap buildah; do
  command -v "$tool" >/dev/null || fail "no $tool (apt-get install $tool; scripts/install-deps.sh test does)"
done

base=$work/bookworm.tar
if [ ! -s "$base" ] || [ -n "$(find "$base" -mtime +7)" ]; then
  rm -f "$base"
  mmdebstrap --quiet --variant=minbase --format=tar --aptopt="Acquire::Retries \"5\"" bookworm "$base.new" \
    "deb http://deb.debian.org/debian bookworm main" \
    "deb http://deb.debian.org/debian bookworm-updates main" \
    "deb http://deb.debian.org/debian-security bookworm-security main" >"$work/mmdebstrap.log" 2>&1 ||
    fail "mmdebstrap: $(tail -n 5 "$work/mmdebstrap.log")"
  mv "$base.new" "$base"
fi
echo "base: $(basename "$base") ($(du -m "$base" | cut -f1) MiB, mmdebstrap --variant=minbase bookworm)"

storage=$work/storage
cleanup() {
  buildah --root "$storage" --runroot "$work/run" --storage-driver vfs rm --all >/dev/null 2>&1 || true
  buildah --root "$storage" --runroot "$work/run" --storage-driver vfs rmi --all --force >/dev/null 2>&1 || true
  rm -rf "$storage" "$work/run"
}
trap cleanup EXIT
cleanup
bah() { buildah --root "$storage" --runroot "$work/run" --storage-driver vfs "$@"; }

ctr=$(bah from scratch)
bah add "$ctr" "$base" / >/dev/null
bah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$ctr"
bah commit -q "$ctr" localhost/moonbox-base:bookworm >/dev/null
bah rm "$ctr" >/dev/null

bah build --isolation chroot --build-arg BASE=localhost/moonbox-base:bookworm \
  --build-arg BUILD_BASE=localhost/moonbox-base:bookworm -f "$src/deploy/Dockerfile" \
  -t localhost/moonbox:test "$src" >"$work/build.log" 2>&1 || fail "buildah build: $(tail -n 20 "$work/build.log")"
echo "buildah build: ok"

ctr=$(bah from localhost/moonbox:test)
bah run --isolation chroot "$ctr" -- moonbox --version >"$work/version.out" 2>&1 ||
  fail "moonbox --version in the image: $(cat "$work/version.out")"
head -n 1 "$work/version.out"
# as the image runs in production (docs/scaling.md: privileged): root with
# CAP_SYS_ADMIN mounts each sandbox's disk image; buildah's seccomp profile
# and its chroot keep user namespaces from it, so sandboxes run unisolated
# and moonbox says why
bah run --isolation chroot --cap-add CAP_SYS_ADMIN "$ctr" -- moonbox /usr/share/doc/moonbox/examples/quickstart.lua \
  >"$work/quickstart.out" 2>"$work/quickstart.err" ||
  fail "the quickstart in the image: $(tail -n 20 "$work/quickstart.err")"
"$build/moonbox" "$src/spec/match-lines.lua" "$src/examples/expected/quickstart.txt" "$work/quickstart.out" ||
  fail "the quickstart's output in the image differs from examples/expected/quickstart.txt"
sed 's/^/quickstart stderr: /' "$work/quickstart.err"
grep -q 'run without isolation ("none") on this host: ' "$work/quickstart.err" ||
  fail "moonbox in the image did not say why its sandboxes run unisolated"
echo "quickstart in the image: ok"
echo "image-test: ok"
