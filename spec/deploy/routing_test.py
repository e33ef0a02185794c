#!/usr/bin/env python3
"""The shipped routing tier, for real (issue #18): three `moonbox serve` on
loopback ports, each with its own MOONBOX_HOME and one shared token file,
behind nginx running deploy/routing/moonbox-routing.conf.in rendered for
those three upstreams (deploy/routing/render.py).

Checks:
  1. 300 sandbox ids: each one's root appears under exactly one server's
     home (<home>/sandboxes/<id>), and a second round of requests lands on
     the same server for every id;
  2. an SSE stream (exec/stream) and a WebSocket terminal handshake work
     through the proxy;
  3. stopping one server moves only its ids (about a third) to the others,
     every request still answers 200, the other ids stay where they were;
  4. when it comes back (same home, same port), its ids return to it and
     find their workspace files.

Exit 77 (CTest SKIP_RETURN_CODE) only when nginx is not installed.
Environment: MOONBOX_BIN (the moonbox binary), MOONBOX_SOURCE_DIR."""
import base64
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

SOURCE = os.environ.get("MOONBOX_SOURCE_DIR") or os.path.abspath(os.path.join(os.path.dirname(__file__), "../.."))
BIN = os.environ.get("MOONBOX_BIN") or os.path.join(SOURCE, "build", "moonbox")
sys.path.insert(0, os.path.join(SOURCE, "deploy", "routing"))
import render  # noqa: E402

N_IDS = 300
TOKEN = "routing-test-token-" + base64.b32encode(os.urandom(10)).decode().lower()


def fail(msg):
    print("FAIL: " + msg, flush=True)
    sys.exit(1)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_port(port, proc=None, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            fail("process for port %d exited with %s" % (port, proc.returncode))
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    fail("nothing listens on port %d after %ds" % (port, timeout))


def request(port, method, path, body=None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    h = {"Authorization": "Bearer " + TOKEN}
    if body is not None:
        body = json.dumps(body)
        h["Content-Type"] = "application/json"
    h.update(headers or {})
    conn.request(method, path, body=body, headers=h)
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, data


class Server:
    def __init__(self, tmp, name, policy, token_file):
        self.name = name
        self.home = os.path.join(tmp, name)
        os.makedirs(self.home)
        self.port = free_port()
        self.policy = policy
        self.token_file = token_file
        self.log = os.path.join(tmp, name + ".log")
        self.proc = None

    def start(self):
        env = dict(os.environ, MOONBOX_HOME=self.home)
        self.proc = subprocess.Popen(
            [BIN, "serve", "--listen", "127.0.0.1:%d" % self.port, "--token-file", self.token_file,
             "--policy", self.policy],
            env=env, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT)
        wait_port(self.port, self.proc)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def has(self, sid, name=None):
        path = os.path.join(self.home, "sandboxes", sid)
        if name:
            path = os.path.join(path, "workspace", name)
        return os.path.exists(path)


def where(servers, sid, name=None):
    return [s.name for s in servers if s.has(sid, name)]


def write(port, sid, name):
    status, data = request(port, "POST", "/v1/sandboxes/%s/files/write" % sid, {"path": name, "content": sid})
    if status != 200:
        fail("write %s in %s through the proxy: %d %s" % (name, sid, status, data[:300]))


def main():
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if not nginx:
        print("SKIP: nginx is not installed (Debian: apt-get install nginx-light, see scripts/install-deps.sh test)")
        sys.exit(77)
    tmp = tempfile.mkdtemp(prefix="moonbox-routing-")
    servers, ng = [], None
    try:
        token_file = os.path.join(tmp, "token")
        with open(token_file, "w") as f:
            f.write(TOKEN + "\n")
        os.chmod(token_file, 0o600)
        policy = os.path.join(tmp, "policy.lua")
        with open(policy, "w") as f:
            # light sandboxes: 300 of them per run; the routing does not
            # depend on how a sandbox is isolated
            f.write('return { isolation = "none" }\n')
        servers = [Server(tmp, "s%d" % i, policy, token_file) for i in range(3)]
        for s in servers:
            s.start()

        # nginx with the shipped config, rendered for these three upstreams
        # (a short fail_timeout so that the returning server is retried soon)
        proxy_port = free_port()
        conf = render.render(["127.0.0.1:%d" % s.port for s in servers], listen="127.0.0.1:%d" % proxy_port,
                             fail_timeout="1s")
        with open(os.path.join(tmp, "routing.conf"), "w") as f:
            f.write(conf)
        for d in ("body", "proxy", "logs"):
            os.makedirs(os.path.join(tmp, "nginx", d))
        main_conf = os.path.join(tmp, "nginx.conf")
        with open(main_conf, "w") as f:
            f.write("""worker_processes 1;
user root;
daemon off;
pid {t}/nginx/nginx.pid;
error_log {t}/nginx/logs/error.log info;
events {{ worker_connections 1024; }}
http {{
    access_log {t}/nginx/logs/access.log;
    client_body_temp_path {t}/nginx/body;
    proxy_temp_path {t}/nginx/proxy;
    fastcgi_temp_path {t}/nginx/proxy;
    uwsgi_temp_path {t}/nginx/proxy;
    scgi_temp_path {t}/nginx/proxy;
    include {t}/routing.conf;
}}
""".format(t=tmp))
        check = subprocess.run([nginx, "-t", "-p", tmp, "-c", main_conf], capture_output=True, text=True)
        if check.returncode != 0:
            fail("nginx -t refused the rendered config:\n" + check.stderr)
        ng = subprocess.Popen([nginx, "-p", tmp, "-c", main_conf], stdout=subprocess.DEVNULL,
                              stderr=open(os.path.join(tmp, "nginx", "logs", "stderr.log"), "ab"))
        wait_port(proxy_port, ng)

        ids = ["sb-%03d-%s" % (i, base64.b32encode(os.urandom(5)).decode().lower()) for i in range(N_IDS)]

        # 1. each id lands on exactly one server, and again on the same one
        owner = {}
        for sid in ids:
            write(proxy_port, sid, "origin.txt")
        for sid in ids:
            homes = where(servers, sid)
            if len(homes) != 1:
                fail("%s has a root on %s (expected exactly one server)" % (sid, homes))
            owner[sid] = homes[0]
        counts = {s.name: sum(1 for sid in ids if owner[sid] == s.name) for s in servers}
        print("ids per server: %s" % counts, flush=True)
        for name, n in counts.items():
            if n == 0:
                fail("server %s got no ids: the hash does not spread them (%s)" % (name, counts))
        for sid in ids:
            write(proxy_port, sid, "again.txt")
            if where(servers, sid, "again.txt") != [owner[sid]] or where(servers, sid) != [owner[sid]]:
                fail("%s moved from %s to %s" % (sid, owner[sid], where(servers, sid)))
        print("ok 1 - %d ids each always land on the same server" % N_IDS, flush=True)

        # 2. SSE through the proxy: every event arrives, the output byte-exact
        sid = ids[0]
        conn = http.client.HTTPConnection("127.0.0.1", proxy_port, timeout=60)
        conn.request("POST", "/v1/sandboxes/%s/exec/stream" % sid,
                     body=json.dumps({"command": "echo one; echo two >&2; echo three"}),
                     headers={"Authorization": "Bearer " + TOKEN, "Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200 or "text/event-stream" not in (r.getheader("Content-Type") or ""):
            fail("exec/stream through the proxy: %d %s" % (r.status, r.getheader("Content-Type")))
        events = []
        for line in r.read().decode().split("\n"):
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
        conn.close()
        types = [e["type"] for e in events]
        out = "".join(e.get("data", "") for e in events if e["type"] == "stdout")
        err = "".join(e.get("data", "") for e in events if e["type"] == "stderr")
        if types[0] != "start" or types[-1] != "complete" or events[-1].get("exitCode") != 0:
            fail("SSE events through the proxy: %s" % events)
        if out != "one\nthree\n" or err != "two\n":
            fail("SSE output through the proxy: %r %r" % (out, err))
        # a WebSocket terminal: the upgrade passes through and the shell answers
        ws = socket.create_connection(("127.0.0.1", proxy_port), timeout=30)
        key = base64.b64encode(os.urandom(16)).decode()
        ws.sendall(("GET /v1/sandboxes/%s/sessions/default/terminal?access_token=%s HTTP/1.1\r\n"
                    "Host: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                    "Sec-WebSocket-Key: %s\r\nSec-WebSocket-Version: 13\r\n\r\n" % (sid, TOKEN, key)).encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = ws.recv(4096)
            if not chunk:
                break
            head += chunk
        status_line = head.split(b"\r\n", 1)[0]
        if b" 101 " not in status_line + b" ":
            fail("WebSocket terminal through the proxy: %r" % head[:300])
        ws.close()
        print("ok 2 - SSE stream and WebSocket terminal through the proxy", flush=True)

        # 3. one server stops: only its ids move, every request answers
        victim = servers[1]
        victim.stop()
        theirs = [sid for sid in ids if owner[sid] == victim.name]
        moved = 0
        for sid in ids:
            write(proxy_port, sid, "phase3.txt")
            homes = where(servers, sid, "phase3.txt")
            if len(homes) != 1:
                fail("%s: phase3.txt written on %s" % (sid, homes))
            if owner[sid] != victim.name:
                if homes != [owner[sid]]:
                    fail("%s (on %s) moved to %s though its server still runs" % (sid, owner[sid], homes))
            else:
                if homes[0] == victim.name:
                    fail("%s written on the stopped server" % sid)
                moved += 1
        if moved != len(theirs):
            fail("moved %d ids, the stopped server had %d" % (moved, len(theirs)))
        print("ok 3 - stopping %s moved only its %d of %d ids; all requests answered"
              % (victim.name, moved, N_IDS), flush=True)

        # 4. it comes back: its ids return to it, with their workspace files
        victim.start()
        deadline = time.time() + 60
        probe = theirs[0]
        while True:
            status, data = request(proxy_port, "POST", "/v1/sandboxes/%s/files/read" % probe, {"path": "origin.txt"})
            if status == 200:
                break
            if time.time() > deadline:
                fail("the returning server never got %s back: %d %s" % (probe, status, data[:200]))
            time.sleep(0.2)
        for sid in ids:
            status, data = request(proxy_port, "POST", "/v1/sandboxes/%s/files/read" % sid, {"path": "origin.txt"})
            if status != 200 or json.loads(data).get("content") != sid:
                fail("%s (owner %s) after the return: %d %s" % (sid, owner[sid], status, data[:200]))
            write(proxy_port, sid, "phase4.txt")
            if where(servers, sid, "phase4.txt") != [owner[sid]]:
                fail("%s did not return to %s: %s" % (sid, owner[sid], where(servers, sid, "phase4.txt")))
        print("ok 4 - %s is back: its %d ids returned to it with their workspace files"
              % (victim.name, len(theirs)), flush=True)
        print("1..4")
    finally:
        if ng and ng.poll() is None:
            ng.send_signal(signal.SIGQUIT)
            try:
                ng.wait(10)
            except subprocess.TimeoutExpired:
                ng.kill()
                ng.wait()
        for s in servers:
            s.stop()
        release_mounts(tmp)
        shutil.rmtree(tmp, ignore_errors=True)


def release_mounts(tmp):
    """As root a stopped server leaves its sandboxes' disk images mounted
    on their roots (lua/moonbox/sandbox/disk.lua, kept for a restart):
    unmounted here, deepest first, so rmtree removes everything and no
    loop device outlives the test."""
    try:
        with open("/proc/self/mountinfo") as f:
            points = [line.split()[4] for line in f]
    except OSError:
        return
    points = [p.encode().decode("unicode_escape") for p in points]
    for point in sorted((p for p in points if p.startswith(tmp + "/")), key=len, reverse=True):
        if subprocess.call(["umount", point], stderr=subprocess.DEVNULL) != 0:
            subprocess.call(["umount", "-l", point], stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    main()
