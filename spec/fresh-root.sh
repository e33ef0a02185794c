#!/bin/sh
# fresh-root.sh SOURCE_DIR BUILD_DIR SPEC...: run specs (their no-namespaces
# variant) inside bwrap over a clean minimal tree, as on a fresh Debian
# machine that has nothing but the system and the repository: /usr, /etc and
# the /bin, /sbin, /lib* links read-only from the host; /tmp, /home, /root,
# /var, /srv, /opt, /mnt, /media and /run empty tmpfs; no /workspace; the
# source tree read-only and the build tree bound; a clean environment with
# HOME=/root and no MOONBOX_HOME (so the default one, under the fresh HOME).
# A spec that needs a host directory, user or file beyond these, or leftovers
# of an earlier run, fails here (CTest fresh_root.*; docs/testing.md).
set -eu
src=$(cd "$1" && pwd)
build=$(cd "$2" && pwd)
shift 2
bwrap=$(command -v bwrap) || { echo "fresh-root: bwrap is not installed (apt-get install bubblewrap)" >&2; exit 1; }
luajit=$(command -v luajit)
busted=$(command -v busted)

set -- "$@"
args="--die-with-parent --dev-bind /dev /dev --bind /proc /proc --bind /sys /sys"
for d in /usr /etc /bin /sbin /lib /lib32 /lib64 /libx32; do
  if [ -L "$d" ]; then
    args="$args --symlink $(readlink "$d") $d"
  elif [ -d "$d" ]; then
    args="$args --ro-bind $d $d"
  fi
done
for d in /tmp /home /root /var /srv /opt /mnt /media /run; do
  args="$args --tmpfs $d"
done
args="$args --ro-bind $src $src --bind $build $build --chdir $src"

# what the bound trees put in the fresh /tmp (a clone under /tmp, as CI's)
keep=""
for p in "$src" "$build"; do
  case "$p" in /tmp/*) first=${p#/tmp/}; keep="$keep ${first%%/*}" ;; esac
done

status=0
for spec in "$@"; do
  echo "fresh-root: $spec"
  # shellcheck disable=SC2086,SC2016
  env -i PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin HOME=/root LANG=C.UTF-8 TERM=dumb \
    MOONBOX_BUILD_DIR="$build" MOONBOX_SOURCE_DIR="$src" MOONBOX_BIN="$build/moonbox" \
    MOONBOX_TEST_ISOLATION=none FRESH_ROOT_KEEP="$keep" \
    "$bwrap" $args -- sh -c '
      # the tree is what it should be: nothing of the host beyond the system
      for d in /home /root /srv /opt /mnt /var /tmp; do
        for e in $(ls -A "$d"); do
          [ "$d" = /tmp ] && case " $FRESH_ROOT_KEEP " in *" $e "*) continue ;; esac
          echo "fresh-root: $d is not empty ($e)" >&2; exit 1
        done
      done
      unset FRESH_ROOT_KEEP
      [ ! -e /workspace ] || { echo "fresh-root: /workspace exists" >&2; exit 1; }
      exec "$0" "$@"' "$luajit" "$busted" --helper=spec/helper.lua -o utfTerminal ${FRESH_ROOT_BUSTED_ARGS:-} "$spec" || status=1
done
[ "$status" -eq 0 ] && echo "fresh-root: ok"
exit "$status"
