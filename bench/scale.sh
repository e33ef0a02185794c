#!/bin/sh
# Launcher of bench/scale.lua at the sizes of issue #18 (10,000 sessions in
# one sandbox, 5,000 sandboxes with one session each), as root:
#   sh bench/scale.sh [arguments of bench/scale.lua]
# (default: sessions 10000 sandboxes 5000 destroy 200).
#
# - The hard fd limit is raised to 1,048,576 (systemd's usual hard limit)
#   where the kernel lets us (CAP_SYS_RESOURCE, fs.nr_open); where it does
#   not, the run goes on with the hard limit there is and says so.
# - The bench then runs under a soft limit of 1024, so that it proves the
#   runtime raises its soft limit itself (src/main.c).
# - Host sysctls that could stop it first are raised for the run and
#   restored at the end (only those found lower than needed): the user,
#   mount, pid, net, ipc, uts and cgroup namespace counts, inotify instances.
set -eu
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || set -- sessions 10000 sandboxes 5000 destroy 200
BIN=${MOONBOX_BIN:-./build/moonbox}

restore=""
raise() { # raise SYSCTL_FILE MIN
  f=/proc/sys/$1
  [ -w "$f" ] || return 0
  cur=$(cat "$f")
  if [ "$cur" -lt "$2" ]; then
    echo "$2" > "$f" && restore="$restore $1=$cur" && echo "scale.sh: $1 $cur -> $2 for the run"
  fi
}
cleanup() {
  for kv in $restore; do
    echo "${kv#*=}" > "/proc/sys/${kv%%=*}" && echo "scale.sh: $kv restored"
  done
}
trap cleanup EXIT INT TERM
for ns in user mnt pid net ipc uts cgroup; do raise user/max_${ns}_namespaces 20000; done
raise fs/inotify/max_user_instances 1024

want=1048576
hard=$(ulimit -H -n)
if [ "$hard" != unlimited ] && [ "$hard" -lt "$want" ]; then
  if prlimit --pid $$ --nofile="$want:$want" 2>/dev/null; then
    echo "scale.sh: hard fd limit $hard -> $want"
  else
    echo "scale.sh: the hard fd limit stays $hard: raising it was refused" \
      "($(grep CapEff /proc/self/status | tr -s '\t' ' '); CAP_SYS_RESOURCE is bit 24)"
  fi
fi
ulimit -S -n 1024
echo "scale.sh: running with soft $(ulimit -S -n) hard $(ulimit -H -n)"
"$BIN" bench/scale.lua "$@"
