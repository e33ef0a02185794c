#!/bin/sh
# in-chroot.sh DIR... -- CMD...: run CMD (as root) chrooted, not pivoted: its
# / is not its mount namespace's root, so the kernel refuses it user
# namespaces, as in a chroot a user made by hand. The root has the host's
# system directories and each DIR bound at its own path, a fresh /tmp and
# /root. Everything is mounted in a private mount namespace (unshare), so
# the mounts end with CMD; the empty directories and links left in the
# root's place are removed after (never a file: find -delete of empty
# directories and links only).
set -eu
root=$(mktemp -d /tmp/moonbox-chroot-XXXXXX)
trap 'find "$root" -xdev -depth \( -type l -o -type d -empty \) -delete 2>/dev/null || true' EXIT
binds=""
while [ $# -gt 0 ] && [ "$1" != -- ]; do binds="$binds $1"; shift; done
[ $# -gt 0 ] && shift
status=0
# the inner script expands its own variables
# shellcheck disable=SC2016
unshare --mount --propagation private sh -eu -c '
root=$1; binds=$2; shift 2
for d in /usr /etc /proc /dev /sys /var /run; do
  mkdir -p "$root$d"; mount --rbind "$d" "$root$d"
done
for l in /bin /sbin /lib /lib32 /lib64 /libx32; do
  if [ -L "$l" ]; then ln -s "$(readlink "$l")" "$root$l"
  elif [ -d "$l" ]; then mkdir -p "$root$l"; mount --rbind "$l" "$root$l"; fi
done
mkdir -p "$root/tmp" "$root/root"
mount -t tmpfs tmpfs "$root/tmp"; mount -t tmpfs tmpfs "$root/root"
for d in $binds; do mkdir -p "$root$d"; mount --rbind "$d" "$root$d"; done
exec chroot "$root" "$@"' sh "$root" "$binds" "$@" || status=$?
exit $status
