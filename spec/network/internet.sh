#!/bin/sh
# The egress specs' "internet" (no real one in CI): a network namespace
# behind a veth from the host, routed like the outside world, with
#   198.51.100.10  its own address: an HTTP server (port 80), a DNS server
#                  (port 53, spec/network/dns_server.py) for the test names,
#                  and a TCP sink (port 9, on every address: reads, discards)
#   203.0.113.10, 203.0.113.20  more public-looking addresses (same HTTP server)
#   10.77.0.1      a "private" address (an internal service, same HTTP server)
# and on the host: an HTTP server on 127.0.0.1:LOOP_PORT (a loopback-only
# service), one on 0.0.0.0:HOST_PORT (a service on the host's addresses),
# and a DNS server on 127.0.0.77 (an upstream on the host's loopback, as
# systemd-resolved's 127.0.0.53 is) answering loop.test.
#   internet.sh up STATE_DIR TAG LOOP_PORT HOST_PORT   (prints nothing; fails loudly)
#   internet.sh down STATE_DIR                          (idempotent; everything goes)
set -eu
cmd=$1
state=$2
here=$(cd "$(dirname "$0")" && pwd)
py=/usr/bin/python3

down() {
  [ -f "$state/names" ] || return 0
  # shellcheck disable=SC1091
  . "$state/names"
  for f in "$state"/*.pid; do
    if [ -f "$f" ]; then kill -9 "$(cat "$f")" 2>/dev/null || true; fi
  done
  # (the routes named by their device: never another internet's)
  ip route del 203.0.113.0/24 via 198.51.100.10 dev "$LINK" 2>/dev/null || true
  ip route del 10.77.0.0/24 via 198.51.100.10 dev "$LINK" 2>/dev/null || true
  ip link del "$LINK" 2>/dev/null || true
  ip netns del "$NS" 2>/dev/null || true
  rm -f "$state/names" "$state"/*.pid
}

if [ "$cmd" = down ]; then down; exit 0; fi

tag=$3
loop_port=$4
host_port=$5
NS="mbt-inet-$tag"
LINK="mbtv$tag"
mkdir -p "$state/www"
printf 'NS=%s\nLINK=%s\n' "$NS" "$LINK" > "$state/names"
# an up that fails half way takes down what it made
# shellcheck disable=SC2317 # (called by the trap)
down_on_failure() {
  status=$?
  if [ "$status" -ne 0 ]; then down; fi
}
trap down_on_failure EXIT
printf 'hello from the internet\n' > "$state/www/index.html"
mkdir -p "$state/host-www"
printf 'host service\n' > "$state/host-www/index.html"

ip netns add "$NS"
ip link add "$LINK" type veth peer name eth0 netns "$NS"
ip addr add 198.51.100.1/24 dev "$LINK"
ip link set "$LINK" up
ip netns exec "$NS" sh -c '
  ip link set lo up && ip link set eth0 up &&
  ip addr add 198.51.100.10/24 dev eth0 &&
  ip addr add 203.0.113.10/32 dev eth0 && ip addr add 203.0.113.20/32 dev eth0 &&
  ip addr add 10.77.0.1/32 dev eth0 &&
  ip route add default via 198.51.100.1'
ip route add 203.0.113.0/24 via 198.51.100.10
ip route add 10.77.0.0/24 via 198.51.100.10
# the link delivers a flow in order, as a NIC's queue does: a veth queues
# each packet on the sending CPU, so without RPS one flow's packets arrive
# reordered and with timings no real link has. In order, Debian 12's pasta
# sends segments without flags at a flow's start (the gateway's table must
# drop them: lua/moonbox/network/nft.lua); the specs see what users see.
cpus=$(awk '/^Cpus_allowed:/ {print $2}' /proc/self/status)
# (a kernel built without RPS has no rps_cpus: the link stays as it is)
for q in /sys/class/net/"$LINK"/queues/rx-*/rps_cpus; do if [ -e "$q" ]; then echo "$cpus" > "$q"; fi; done
# shellcheck disable=SC2016
ip netns exec "$NS" sh -c 'for q in /sys/class/net/eth0/queues/rx-*/rps_cpus; do
  if [ -e "$q" ]; then echo "$1" > "$q"; fi; done' sh "$cpus"

start() { # name, then the command; its pid in STATE/name.pid
  name=$1; shift
  setsid "$@" >"$state/$name.log" 2>&1 < /dev/null &
  echo $! > "$state/$name.pid"
}
start http ip netns exec "$NS" $py -m http.server 80 --bind 0.0.0.0 --directory "$state/www"
start dns ip netns exec "$NS" $py "$here/dns_server.py" 198.51.100.10 \
  allowed.test=203.0.113.10 other.test=203.0.113.20 internal.test=10.77.0.1 \
  rebind.test=203.0.113.10/10.77.0.1 sub.allowed.test=203.0.113.10 \
  short.test=203.0.113.10@2 long.test=203.0.113.20@300 silent.test=silent
start sink ip netns exec "$NS" $py -c '
import socketserver
class Sink(socketserver.BaseRequestHandler):
    def handle(self):
        while self.request.recv(65536):
            pass
socketserver.ThreadingTCPServer.allow_reuse_address = True
socketserver.ThreadingTCPServer(("0.0.0.0", 9), Sink).serve_forever()'
start loopdns $py "$here/dns_server.py" 127.0.0.77 loop.test=203.0.113.20
start loop $py -m http.server "$loop_port" --bind 127.0.0.1 --directory "$state/host-www"
start hostwide $py -m http.server "$host_port" --bind 0.0.0.0 --directory "$state/host-www"

# ready when every server answers from the host
for _ in $(seq 1 100); do
  if curl -sf -m 1 http://203.0.113.10/ >/dev/null && curl -sf -m 1 http://10.77.0.1/ >/dev/null &&
     curl -sf -m 1 "http://127.0.0.1:$loop_port/" >/dev/null &&
     curl -sf -m 1 "http://127.0.0.1:$host_port/" >/dev/null && grep -q ready "$state/dns.log" &&
     grep -q ready "$state/loopdns.log"; then
    exit 0
  fi
  sleep 0.1
done
echo "internet.sh: the servers did not come up" >&2
cat "$state"/*.log >&2
exit 1
