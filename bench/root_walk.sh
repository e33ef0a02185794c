#!/bin/sh
# What a full host costs a new sandbox: bench/isolation.lua (getSandbox and
# its first exec, against bwrap in the same run) with the host idle, then
# with THREADS idle threads on it, each both with the inits cloned from the
# zygote (the default as root, src/zygote.c) and from the runtime's own
# namespace with pivot_root (MOONBOX_ZYGOTE=0). pivot_root walks every task
# on the host (chroot_fs_refs); bwrap pivots too. As root:
#   sh bench/root_walk.sh [THREADS=10000] [ITERATIONS=100]
set -eu
cd "$(dirname "$0")/.."
THREADS=${1:-10000}
N=${2:-100}
BIN=${MOONBOX_BIN:-./build/moonbox}

run() { # label, then env for moonbox
  label=$1
  shift
  echo "## $label"
  env "$@" "$BIN" bench/isolation.lua "$N" | grep -E '^\| (bwrap|getSandbox|ratio \(moonbox)'
}

run "idle host, zygote" MOONBOX_ZYGOTE=1
run "idle host, pivot_root" MOONBOX_ZYGOTE=0

fifo=$(mktemp -u)
mkfifo "$fifo"
python3 - "$THREADS" > "$fifo" <<'PY' &
import sys, threading, time
threading.stack_size(64 * 1024)
stop = threading.Event()
for _ in range(int(sys.argv[1])):
    threading.Thread(target=stop.wait, daemon=True).start()
print("ready", flush=True)
time.sleep(3600)
PY
holder=$!
trap 'kill $holder 2>/dev/null; rm -f "$fifo"' EXIT INT TERM
read -r _ < "$fifo"
echo "(host: $(find /proc/$holder/task -mindepth 1 -maxdepth 1 | wc -l) threads held by pid $holder, $(ps -eLf | wc -l) tasks in all)"
run "$THREADS idle threads, zygote" MOONBOX_ZYGOTE=1
run "$THREADS idle threads, pivot_root" MOONBOX_ZYGOTE=0
