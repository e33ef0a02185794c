#!/bin/sh
# The egress spec as an unprivileged user (pasta+nftables): root builds the
# spec's "internet" (internet.sh: namespaces, routes, servers on the host),
# the spec runs as nobody through spec/run-unprivileged.sh, and root takes
# the internet down again whatever the spec did.
#   run-unprivileged.sh BUILD_DIR
set -eu
build=$1
here=$(cd "$(dirname "$0")" && pwd)
state=$(mktemp -d /tmp/moonbox-inet.XXXXXX)
tag=$(( $$ % 100000 ))
loop_port=$(( 20000 + $$ % 20000 ))
host_port=$(( loop_port + 1 ))
tun_mode=
restore() {
  sh "$here/internet.sh" down "$state"; rm -rf "$state"
  if [ -n "$tun_mode" ]; then chmod "$tun_mode" /dev/net/tun; fi
}
trap restore EXIT
sh "$here/internet.sh" up "$state" "$tag" "$loop_port" "$host_port"
# pasta opens /dev/net/tun as the runtime's user: Debian's udev makes it
# 0666 (50-udev-default.rules); a machine without udev (a bare VM, some
# containers) keeps the kernel's 0600 (there unprivileged egress fails
# closed): given udev's mode for the spec, put back after
if [ -c /dev/net/tun ] && [ "$(stat -c %a /dev/net/tun)" != 666 ]; then
  tun_mode=$(stat -c %a /dev/net/tun)
  chmod 666 /dev/net/tun
fi
MOONBOX_TEST_INTERNET="$tag $loop_port $host_port" sh "$here/../run-unprivileged.sh" "$build" spec/network/egress_spec.lua
