#!/bin/sh
# The routing tier's entrypoint in Kubernetes (deploy/kubernetes/routing.yaml):
# nginx resolves upstream names once, at start, so this waits until every
# StatefulSet pod named in the config resolves, starts nginx, and reloads it
# whenever a pod's address changes (a pod rescheduled on another node).
set -u
CONF=${CONF:-/etc/nginx/conf.d/default.conf}
hosts=$(sed -n 's/^ *server \([^: ]*\):.*/\1/p' "$CONF")
addrs() { for h in $hosts; do getent hosts "$h" | awk '{print $1}'; done; }
for h in $hosts; do
  until getent hosts "$h" >/dev/null; do echo "router: waiting for $h" >&2; sleep 2; done
done
nginx -g 'daemon off;' &
pid=$!
trap 'nginx -s quit; wait $pid; exit 0' TERM INT
last=$(addrs)
while kill -0 "$pid" 2>/dev/null; do
  sleep 10 & wait $!
  now=$(addrs)
  if [ "$now" != "$last" ]; then
    echo "router: upstream addresses changed, reloading" >&2
    nginx -s reload
    last=$now
  fi
done
wait "$pid"
