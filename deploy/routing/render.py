#!/usr/bin/env python3
"""Render the moonbox routing tier config (moonbox-routing.conf.in) for a
set of upstream servers.

  render.py [--listen 8080] [--fail-timeout 5s] HOST:PORT [HOST:PORT ...]
  render.py --statefulset moonbox --service moonbox --namespace moonbox \\
            --replicas 3 --port 8080

The second form names the pods of a StatefulSet through its headless
Service (moonbox-0.moonbox.moonbox.svc.cluster.local:8080, ...)."""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def servers_for_statefulset(name, service, namespace, replicas, port):
    return ["%s-%d.%s.%s.svc.cluster.local:%d" % (name, i, service, namespace, port)
            for i in range(replicas)]


def render(servers, listen="8080", fail_timeout="5s", template=None):
    if not servers:
        raise ValueError("at least one server")
    if template is None:
        with open(os.path.join(HERE, "moonbox-routing.conf.in")) as f:
            template = f.read()
    lines = "\n".join("    server %s max_fails=1 fail_timeout=%s;" % (s, fail_timeout) for s in servers)
    return template.replace("@SERVERS@", lines).replace("@LISTEN@", str(listen))


def main(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--listen", default="8080")
    p.add_argument("--fail-timeout", default="5s")
    p.add_argument("--statefulset")
    p.add_argument("--service")
    p.add_argument("--namespace", default="moonbox")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("servers", nargs="*")
    a = p.parse_args(argv)
    servers = list(a.servers)
    if a.statefulset:
        servers += servers_for_statefulset(a.statefulset, a.service or a.statefulset, a.namespace,
                                           a.replicas, a.port)
    if not servers:
        p.error("name servers (HOST:PORT) or --statefulset")
    sys.stdout.write(render(servers, a.listen, a.fail_timeout))


if __name__ == "__main__":
    main(sys.argv[1:])
