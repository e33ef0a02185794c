#!/usr/bin/env python3
"""The Python client (clients/python, issue #34) against a real
`moonbox serve`: a token, a free port, a temporary MOONBOX_HOME. Every
method is called and its result checked byte for byte, errors by code and
status, streams by event order. Then the package is installed with pip into
a temporary venv, offline, and imported from there.

Every response the client sees is recorded (the client's on_response hook)
and, when MOONBOX_CLIENT_RECORD names a file, written there as JSON lines:
spec/clients/openapi_test.py validates them against docs/openapi.yaml.

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
import unittest
import unittest.mock

SOURCE = os.environ.get("MOONBOX_SOURCE_DIR") or os.path.abspath(os.path.join(os.path.dirname(__file__), "../.."))
BIN = os.environ.get("MOONBOX_BIN") or os.path.join(SOURCE, "build", "moonbox")
sys.path.insert(0, os.path.join(SOURCE, "clients", "python"))
from moonbox import Client, MoonboxError, Process, Session  # noqa: E402

TOKEN = "client-test-" + base64.b32encode(os.urandom(10)).decode().lower()
RECORDS = []
SERVER = {}


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def release_mounts(tmp):
    """As root a sandbox's root is a loop-mounted disk image that the
    server leaves mounted when it stops: unmount what is under tmp, deepest
    first, so that rmtree removes everything and no loop device stays."""
    try:
        with open("/proc/self/mountinfo") as f:
            points = [line.split()[4] for line in f]
    except OSError:
        return
    points = [p.encode().decode("unicode_escape") for p in points]
    for point in sorted((p for p in points if p.startswith(tmp + "/")), key=len, reverse=True):
        if subprocess.call(["umount", point], stderr=subprocess.DEVNULL) != 0:
            subprocess.call(["umount", "-l", point], stderr=subprocess.DEVNULL)


def setUpModule():
    tmp = tempfile.mkdtemp(prefix="moonbox-client-")
    SERVER["tmp"] = tmp
    token_file = os.path.join(tmp, "token")
    with open(token_file, "w") as f:
        f.write(TOKEN + "\n")
    os.chmod(token_file, 0o600)
    home = os.path.join(tmp, "home")
    os.makedirs(home)
    port = free_port()
    SERVER["url"] = "http://127.0.0.1:%d" % port
    SERVER["log"] = os.path.join(tmp, "serve.log")
    with open(SERVER["log"], "ab") as log:
        SERVER["proc"] = subprocess.Popen(
            [BIN, "serve", "--listen", "127.0.0.1:%d" % port, "--token-file", token_file, "--access-log", "off"],
            env=dict(os.environ, MOONBOX_HOME=home), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 30
    while True:
        if SERVER["proc"].poll() is not None:
            raise RuntimeError("moonbox serve exited: " + open(SERVER["log"]).read())
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.time() > deadline:
                raise RuntimeError("moonbox serve does not listen after 30 s")
            time.sleep(0.05)


def tearDownModule():
    proc = SERVER.get("proc")
    if proc and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    release_mounts(SERVER["tmp"])
    shutil.rmtree(SERVER["tmp"], ignore_errors=True)
    out = os.environ.get("MOONBOX_CLIENT_RECORD")
    if out:
        with open(out, "w") as f:
            for r in RECORDS:
                f.write(json.dumps(r) + "\n")


def client(**kw):
    return Client(SERVER["url"], TOKEN, on_response=RECORDS.append, **kw)


class Base(unittest.TestCase):
    sandbox_id = None

    @classmethod
    def setUpClass(cls):
        cls.client = client()
        cls.sb = cls.client.get_sandbox(cls.sandbox_id)

    @classmethod
    def tearDownClass(cls):
        try:
            cls.sb.destroy()
        except MoonboxError as e:
            if e.code != "SANDBOX_NOT_FOUND":
                raise

    def assertCode(self, code, status, fn, *args, **kw):
        with self.assertRaises(MoonboxError) as cm:
            fn(*args, **kw)
        self.assertEqual((cm.exception.code, cm.exception.status), (code, status), cm.exception.message)
        return cm.exception


class TestExec(Base):
    sandbox_id = "py-exec"

    def test_exec_result(self):
        r = self.sb.exec("echo hi; printf 'no newline' >&2; exit 3")
        self.assertEqual((r["stdout"], r["stderr"], r["exitCode"], r["success"]), ("hi\n", "no newline", 3, False))
        self.assertEqual((r["sessionId"], r["timedOut"], r["truncated"]), ("default", False, False))
        self.assertEqual(r["command"], "echo hi; printf 'no newline' >&2; exit 3")

    def test_argv_env_cwd_stdin(self):
        self.sb.mkdir("/workspace/sub")
        r = self.sb.exec(["printf", "%s|", "a b", "$HOME"])
        self.assertEqual(r["stdout"], "a b|$HOME|")
        r = self.sb.exec("printf '%s %s' \"$GREETING\" \"$(pwd)\"; cat", env={"GREETING": "$(hello)"},
                         cwd="/workspace/sub", stdin="from stdin")
        self.assertEqual(r["stdout"], "$(hello) /workspace/subfrom stdin")
        # per call only: the next call has neither
        self.assertEqual(self.sb.exec("printf '%s' \"${GREETING-unset}\"; pwd")["stdout"], "unset/workspace\n")

    def test_binary_output_is_base64(self):
        r = self.sb.exec("printf '\\377\\000a'")
        self.assertEqual(r["stdoutEncoding"], "base64")
        self.assertEqual(base64.b64decode(r["stdout"]), b"\xff\x00a")

    def test_timeout(self):
        r = self.sb.exec("echo before; sleep 30; echo after", timeout=500)
        self.assertEqual((r["timedOut"], r["exitCode"], r["stdout"], r["stderr"]), (True, 124, "before\n", ""))
        self.assertEqual(self.sb.exec("echo still usable")["stdout"], "still usable\n")

    def test_max_output_bytes(self):
        r = self.sb.exec("head -c 5000 /dev/zero | tr '\\0' x", max_output_bytes=100)
        self.assertEqual((r["stdout"], r["truncated"]), ("x" * 100, True))

    def test_stream_order(self):
        events = list(self.sb.execStream("for i in 1 2 3; do echo $i; sleep 0.05; done; echo e >&2"))
        types = [e["type"] for e in events]
        self.assertEqual(types[0], "start")
        self.assertEqual(types[-1], "complete")
        self.assertEqual(set(types[1:-1]), {"stdout", "stderr"})
        self.assertEqual("".join(e["data"] for e in events if e["type"] == "stdout"), "1\n2\n3\n")
        self.assertEqual("".join(e["data"] for e in events if e["type"] == "stderr"), "e\n")
        self.assertEqual((events[-1]["exitCode"], events[-1]["timedOut"]), (0, False))
        self.assertEqual(events[0]["command"], "for i in 1 2 3; do echo $i; sleep 0.05; done; echo e >&2")

    def test_stream_closed_early_kills_the_command(self):
        stream = self.sb.exec_stream("echo go; sleep 1; touch /workspace/should-not-exist")
        first = next(stream)
        self.assertEqual(first["type"], "start")
        self.assertEqual(next(stream), {"type": "stdout", "data": "go\n", "timestamp": unittest.mock.ANY})
        stream.close()
        time.sleep(1.5)
        self.assertEqual(self.sb.exists("/workspace/should-not-exist")["exists"], False)

    def test_stream_timeouts(self):
        # `timeout` bounds the wait for the stream's head, not its quiet spells
        quick = client(timeout=0.5).get_sandbox(self.sandbox_id)
        events = list(quick.exec_stream("sleep 1.5; echo late"))
        self.assertEqual(("".join(e.get("data", "") for e in events), events[-1]["type"]), ("late\n", "complete"))
        # `stream_timeout` bounds each wait for an event
        impatient = client(stream_timeout=0.5).get_sandbox(self.sandbox_id)
        stream = impatient.exec_stream("echo first; sleep 3; touch /workspace/after-stream-timeout")
        self.assertEqual(next(stream)["type"], "start")
        self.assertEqual(next(stream)["data"], "first\n")
        with self.assertRaises(MoonboxError) as cm:
            next(stream)
        self.assertEqual((cm.exception.code, cm.exception.status), ("CLIENT_TIMEOUT", None))
        # the connection closed with it: the command was killed
        self.sb.exec("true")
        time.sleep(3.5)
        self.assertEqual(self.sb.exists("/workspace/after-stream-timeout")["exists"], False)

    def test_stream_validation_error_raises_before_streaming(self):
        e = self.assertCode("VALIDATION_FAILED", 400, self.sb.exec_stream, "   ")
        self.assertEqual(e.context.get("field"), "command")

    def test_validation_error(self):
        e = self.assertCode("VALIDATION_FAILED", 400, self.sb.exec, 42)
        self.assertEqual(e.message, "command: expected a string or an argv array, got number")
        self.assertEqual(e.context, {"field": "command"})
        e = self.assertCode("VALIDATION_FAILED", 400, self.sb.exec, "true", no_such_option=1)
        self.assertEqual(e.context.get("field"), "noSuchOption")

    def test_client_timeout(self):
        slow = client(timeout=0.5)
        e = self.assertCode("CLIENT_TIMEOUT", None, slow.get_sandbox(self.sandbox_id).exec,
                            "sleep 2; touch /workspace/too-late")
        self.assertIn("no response within 0.5s", e.message)
        # the client hung up, so the server killed the command: the file never comes
        self.assertEqual(self.sb.exec("echo next")["stdout"], "next\n")
        time.sleep(2.5)
        self.assertEqual(self.sb.exists("/workspace/too-late")["exists"], False)


class TestSessions(Base):
    sandbox_id = "py-sessions"

    def test_session_state(self):
        s = self.sb.createSession(id="build", env={"NODE_ENV": "production", "DEBUG": None}, cwd="/workspace")
        self.assertIsInstance(s, Session)
        self.assertEqual((s.id, s.fields["cwd"]), ("build", "/workspace"))
        s.exec("mkdir -p app && cd app && export X=1")
        r = s.exec("pwd; echo $NODE_ENV $X")
        self.assertEqual(r["stdout"], "/workspace/app\nproduction 1\n")
        self.assertEqual(r["sessionId"], "build")
        self.assertEqual(self.sb.get_session("build").fields["cwd"], "/workspace/app")
        self.assertEqual(self.sb.exec("pwd")["stdout"], "/workspace\n")
        listed = self.sb.list_sessions()
        self.assertEqual(listed, sorted(listed))
        self.assertIn("build", listed)
        self.assertIn("default", listed)
        self.assertCode("SESSION_ALREADY_EXISTS", 409, self.sb.create_session, id="build")
        d = self.sb.deleteSession("build")
        self.assertEqual((d["success"], d["sessionId"]), (True, "build"))
        self.assertCode("SESSION_NOT_FOUND", 404, s.exec, "true")
        self.assertCode("SESSION_NOT_FOUND", 404, self.sb.getSession, "build")
        self.assertNotIn("build", self.sb.listSessions())

    def test_env_vars(self):
        s = self.sb.create_session(id="env")
        self.sb.set_env_vars({"LEVEL": "sandbox"})
        s.setEnvVars({"ONLY": "session"})
        fresh = self.sb.create_session(id="env2")
        self.assertEqual(fresh.exec("echo $LEVEL-${ONLY-none}")["stdout"], "sandbox-none\n")
        self.assertEqual(s.exec("echo ${LEVEL-none}-$ONLY")["stdout"], "none-session\n")
        s.set_env_vars({"ONLY": False})
        self.assertEqual(s.exec("echo ${ONLY-unset}")["stdout"], "unset\n")
        self.assertCode("VALIDATION_FAILED", 400, s.set_env_vars, {"1BAD": "x"})

    def test_bad_session_id(self):
        self.assertCode("VALIDATION_FAILED", 400, self.sb.create_session, id="../x")


class TestProcessLifecycle(Base):
    # a sandbox of its own: cleanupCompletedProcesses counts the sandbox's ended processes
    sandbox_id = "py-process-life"

    def test_lifecycle_and_logs(self):
        p = self.sb.startProcess("for i in 1 2 3; do echo $i; done; echo oops >&2", process_id="job")
        self.assertIsInstance(p, Process)
        self.assertEqual((p.id, p.sessionId), ("job", "default"))
        self.assertIn(p.status, ("starting", "running", "completed"))
        self.assertEqual(p.waitForExit(10000), {"exitCode": 0, "status": "completed", "processId": "job"})
        self.assertEqual(p.getStatus(), "completed")
        self.assertEqual(p.exitCode, 0)
        self.assertEqual(self.sb.getProcessLogs("job"),
                         {"stdout": "1\n2\n3\n", "stderr": "oops\n", "processId": "job", "truncated": False})
        events = list(self.sb.streamProcessLogs("job"))
        self.assertEqual(events[-1]["type"], "exit")
        self.assertEqual(events[-1]["exitCode"], 0)
        self.assertEqual("".join(e["data"] for e in events if e["type"] == "stdout"), "1\n2\n3\n")
        self.assertEqual("".join(e["data"] for e in events if e["type"] == "stderr"), "oops\n")
        self.assertIn("job", [q.id for q in self.sb.list_processes()])
        running = self.sb.start_process("sleep 30", processId="busy")
        self.assertCode("PROCESS_ALREADY_EXISTS", 409, self.sb.start_process, "true", processId="busy")
        running.kill("SIGKILL")
        self.assertEqual(running.wait_for_exit(10000)["status"], "killed")
        self.assertEqual(self.sb.cleanup_completed_processes(), 2)
        self.assertIsNone(self.sb.get_process("job"))
        self.assertCode("PROCESS_NOT_FOUND", 404, self.sb.get_process_logs, "job")


class TestProcesses(Base):
    sandbox_id = "py-processes"

    def test_live_stream_and_wait_for_log(self):
        s = self.sb.create_session(id="starter")
        p = s.start_process("echo ready; sleep 0.3; echo later; exit 4", processId="live")
        self.assertEqual(p.sessionId, "starter")
        m = p.wait_for_log("rea(d)y", 10000)
        self.assertEqual((m["line"], m["match"], m["stream"], m["captures"]), ("ready", "ready", "stdout", ["d"]))
        events = list(p.stream_logs())
        self.assertEqual("".join(e["data"] for e in events if e["type"] == "stdout"), "ready\nlater\n")
        self.assertEqual((events[-1]["type"], events[-1]["exitCode"]), ("exit", 4))
        self.assertEqual(self.sb.get_process("live").status, "failed")

    def test_kill_and_wait_for_port(self):
        port = 18000 + os.getpid() % 1000
        web = self.sb.start_process("python3 -u -m http.server %d" % port, processId="web")
        self.assertEqual(web.wait_for_port(port, timeout=20000),
                         {"success": True, "port": port, "mode": "http", "processId": "web"})
        self.assertEqual(self.sb.exec("python3 -c 'import urllib.request as u; "
                                      "print(u.urlopen(\"http://127.0.0.1:%d/\").status)'" % port)["stdout"],
                         "200\n")
        self.assertEqual(web.kill(), {"success": True, "processId": "web", "signal": "SIGTERM"})
        self.assertEqual(self.sb.getProcess("web").status, "killed")
        self.sb.start_process("sleep 60", processId="s1")
        self.sb.start_process("sleep 60", processId="s2")
        self.assertEqual(self.sb.killAllProcesses("SIGKILL"), 2)
        self.assertEqual(self.sb.wait_for_exit("s1", 10000)["status"], "killed")
        self.assertCode("VALIDATION_FAILED", 400, self.sb.kill_process, "s2", "SIGNOPE")
        self.assertCode("PROCESS_NOT_FOUND", 404, self.sb.kill_process, "nope")

    def test_ready_timeout(self):
        p = self.sb.start_process("sleep 30", processId="quiet")
        self.assertCode("PROCESS_READY_TIMEOUT", 408, p.wait_for_log, "never", 300)
        p.kill("SIGKILL")
        self.assertCode("PROCESS_EXITED_BEFORE_READY", 409, p.wait_for_log, "never", 5000)


class TestFiles(Base):
    sandbox_id = "py-files"

    def test_text_and_binary(self):
        self.assertEqual(self.sb.writeFile("/workspace/a.txt", "héllo\n")["path"], "/workspace/a.txt")
        r = self.sb.readFile("/workspace/a.txt")
        self.assertEqual((r["content"], r["encoding"], r["isBinary"], r["mimeType"], r["size"]),
                         ("héllo\n", "utf-8", False, "text/plain", 7))
        png = b"\x89PNG\r\n\x1a\n\x00\xff"
        self.sb.write_file("logo.bin", png)
        r = self.sb.read_file("/workspace/logo.bin")
        self.assertEqual((r["isBinary"], r["encoding"], base64.b64decode(r["content"])), (True, "base64", png))
        self.sb.write_file("b64.bin", base64.b64encode(b"\x00\x01").decode(), encoding="base64")
        self.assertEqual(b"".join(self.sb.readFileStream("/workspace/b64.bin")), b"\x00\x01")
        big = os.urandom(200 * 1024)
        self.sb.write_file("big.bin", big)
        self.assertEqual(b"".join(self.sb.read_file_stream("big.bin")), big)

    def test_directories(self):
        self.assertEqual(self.sb.mkdir("/workspace/d/e", recursive=True)["recursive"], True)
        self.assertCode("FILE_NOT_FOUND", 404, self.sb.mkdir, "/workspace/x/y")
        self.sb.write_file("/workspace/d/e/f.txt", "f")
        self.sb.write_file("/workspace/d/.hidden", "h")
        r = self.sb.listFiles("/workspace/d", recursive=True)
        self.assertEqual(sorted(f["relativePath"] for f in r["files"]), ["e", "e/f.txt"])
        self.assertEqual((r["count"], r["truncated"]), (2, False))
        r = self.sb.list_files("/workspace/d", include_hidden=True)
        self.assertEqual(sorted(f["name"] for f in r["files"]), [".hidden", "e"])
        self.assertEqual(self.sb.exists("/workspace/d/e/f.txt")["exists"], True)
        self.assertEqual(self.sb.renameFile("/workspace/d/e/f.txt", "/workspace/d/e/g.txt")["newPath"],
                         "/workspace/d/e/g.txt")
        self.sb.moveFile("/workspace/d/e/g.txt", "/workspace/d")
        self.assertEqual(self.sb.read_file("/workspace/d/g.txt")["content"], "f")
        self.assertCode("IS_DIRECTORY", 400, self.sb.delete_file, "/workspace/d/e")
        self.assertEqual(self.sb.deleteFile("/workspace/d/g.txt")["success"], True)
        self.assertEqual(self.sb.exists("/workspace/d/g.txt")["exists"], False)
        self.assertCode("FILE_NOT_FOUND", 404, self.sb.read_file, "/workspace/d/g.txt")
        self.assertCode("FILE_NOT_FOUND", 404, lambda: list(self.sb.read_file_stream("/workspace/none")))

    def test_outside(self):
        self.sb.exec("ln -sf / /workspace/escape")
        self.assertCode("PATH_OUTSIDE_SANDBOX", 403, self.sb.read_file, "/workspace/escape/etc/hostname")

    def test_session_relative_paths(self):
        s = self.sb.create_session(id="rel")
        s.exec("mkdir -p /workspace/rel && cd /workspace/rel")
        s.write_file("here.txt", "here")
        self.assertEqual(self.sb.read_file("/workspace/rel/here.txt")["content"], "here")

    def test_watch_and_changes(self):
        self.sb.mkdir("/workspace/w")
        v = self.sb.checkChanges("/workspace/w")
        self.assertEqual(v["status"], "unchanged")
        self.assertEqual(self.sb.check_changes("/workspace/w", since=v["version"])["status"], "unchanged")
        stream = self.sb.watch("/workspace/w", recursive=True, exclude=["*.tmp"])
        self.sb.write_file("/workspace/w/new.txt", "n")
        ev = next(stream)
        stream.close()
        self.assertEqual((ev["type"], ev["path"], ev["isDirectory"]), ("create", "/workspace/w/new.txt", False))
        self.assertEqual(self.sb.check_changes("/workspace/w", since=v["version"])["status"], "changed")

    def test_git_local_denied(self):
        e = self.assertCode("POLICY_DENIED", 403, self.sb.gitCheckout, "/workspace")
        self.assertEqual(e.context.get("policy"), "git.allowLocal")
        self.assertCode("INVALID_GIT_URL", 400, self.sb.git_checkout, "ext::sh -c true")


class TestCode(Base):
    sandbox_id = "py-code"

    def test_context(self):
        ctx = self.sb.createCodeContext(language="python", id="analysis")
        self.assertEqual((ctx["id"], ctx["language"]), ("analysis", "python"))
        r = self.sb.runCode("x = 6 * 7\nprint('side')\nx", context=ctx)
        self.assertEqual(r["results"][0]["text"], "42")
        self.assertEqual(r["logs"]["stdout"], ["side\n"])
        self.assertEqual(self.sb.run_code("x + 1", context="analysis")["results"][0]["text"], "43")
        r = self.sb.run_code("raise ValueError('bad')", context="analysis")
        self.assertEqual((r["error"]["name"], r["error"]["message"]), ("ValueError", "bad"))
        self.assertEqual([c["id"] for c in self.sb.listCodeContexts()], ["analysis"])
        events = list(self.sb.runCodeStream("print(1)\n2", context="analysis"))
        self.assertEqual([e["type"] for e in events if e["type"] != "result"], ["stdout", "complete"])
        self.assertEqual([e["result"]["text"] for e in events if e["type"] == "result"], ["2"])
        self.assertEqual(events[0]["text"], "1\n")
        self.assertEqual(self.sb.deleteCodeContext(ctx), {"success": True, "contextId": "analysis"})
        self.assertCode("CONTEXT_NOT_FOUND", 404, self.sb.run_code, "1", context="analysis")

    def test_default_context_per_language(self):
        r = self.sb.run_code("console.log('js'); 40 + 2", language="javascript")
        self.assertEqual((r["logs"]["stdout"], r["results"][0]["text"]), (["js\n"], "42"))


class TestSandbox(Base):
    sandbox_id = "py-sandbox"

    def test_info_list_destroy(self):
        self.sb.write_file("/workspace/k.txt", "kept")
        info = self.sb.info()
        self.assertEqual(info["id"], "py-sandbox")
        self.assertIn(info["isolation"], ("namespaces", "none"))
        listed = [s for s in self.client.listSandboxes() if s["id"] == "py-sandbox"]
        self.assertEqual(len(listed), 1)
        self.assertEqual(self.sb.destroy(keep_files=True)["success"], True)
        self.assertEqual(self.sb.read_file("/workspace/k.txt")["content"], "kept")
        self.assertEqual(self.sb.destroy()["id"], "py-sandbox")
        self.assertCode("SANDBOX_NOT_FOUND", 404, self.sb.info)
        self.assertNotIn("py-sandbox", [s["id"] for s in self.client.list_sandboxes()])

    def test_unknown_sandbox(self):
        never = self.client.get_sandbox("py-never-made")
        self.assertCode("SANDBOX_NOT_FOUND", 404, never.info)
        self.assertCode("SANDBOX_NOT_FOUND", 404, never.list_sessions)
        with self.assertRaises(MoonboxError) as cm:
            self.client.get_sandbox("Bad/Id")
        self.assertEqual(cm.exception.code, "VALIDATION_FAILED")

    def test_ports(self):
        r = self.sb.exposePort(8000, name="web")
        self.assertEqual((r["port"], r["name"]), (8000, "web"))
        self.assertTrue(r["url"].startswith("http://8000-py-sandbox.localhost:"), r["url"])
        self.assertCode("PORT_ALREADY_EXPOSED", 409, self.sb.expose_port, 8000)
        self.assertEqual([p["port"] for p in self.sb.getExposedPorts()], [8000])
        self.assertEqual(self.sb.unexposePort(8000)["port"], 8000)
        self.assertEqual(self.sb.get_exposed_ports(), [])
        self.assertCode("PORT_NOT_EXPOSED", 404, self.sb.unexpose_port, 8000)

    def test_port_proxy(self):
        port = 19000 + os.getpid() % 1000
        web = self.sb.start_process("cd /workspace && python3 -u -m http.server %d" % port, processId="proxied")
        try:
            web.wait_for_port(port, timeout=20000)
            self.sb.write_file("/workspace/page.txt", "through the proxy\n")
            self.sb.expose_port(port)
            # the proxy is not a client call: a plain request, recorded like the client's
            host, srv_port = SERVER["url"][len("http://"):].split(":")
            conn = http.client.HTTPConnection(host, int(srv_port), timeout=30)
            path = "/v1/sandboxes/%s/ports/%d/page.txt" % (self.sandbox_id, port)
            conn.request("GET", path, headers={"Authorization": "Bearer " + TOKEN})
            resp = conn.getresponse()
            body = resp.read()
            conn.close()
            RECORDS.append({"method": "GET", "path": path, "status": resp.status,
                            "contentType": resp.getheader("Content-Type", "")})
            self.assertEqual((resp.status, body), (200, b"through the proxy\n"))
            self.sb.unexpose_port(port)
        finally:
            web.kill("SIGKILL")

    def test_backups(self):
        self.sb.mkdir("/workspace/proj")
        self.sb.write_file("/workspace/proj/v.txt", "one")
        b = self.sb.createBackup(dir="/workspace/proj", name="first")
        self.assertEqual((b["dir"], b["name"], b["sandboxId"]), ("/workspace/proj", "first", "py-sandbox"))
        self.assertIn(b["id"], [x["id"] for x in self.client.listBackups()])
        self.sb.write_file("/workspace/proj/v.txt", "two")
        self.assertEqual(self.sb.restoreBackup(b)["success"], True)
        self.assertEqual(self.sb.read_file("/workspace/proj/v.txt")["content"], "one")
        fork = self.client.getSandbox("py-fork", from_backup=b)
        try:
            self.assertEqual(fork.read_file("/workspace/proj/v.txt")["content"], "one")
        finally:
            fork.destroy()
        self.assertEqual(self.client.deleteBackup(b)["success"], True)
        self.assertCode("BACKUP_NOT_FOUND", 404, self.client.delete_backup, b["id"])


class TestCompatRecorded(Base):
    """The seed's protocol (/api/..., docs/compat.md; its own client is
    tested by compat.*): each route called once through the client's
    transport, so that its answers are recorded for clients.openapi."""
    sandbox_id = "py-compat"

    def call(self, method, path, body=None):
        return self.client._t.json(method, self.sb._base + "/api" + path, body=body)

    def stream(self, path, body):
        return list(self.client._t.events("POST", self.sb._base + "/api" + path, body=body))

    def test_every_route(self):
        self.assertEqual(self.call("GET", "/ping")["message"], "pong")
        self.assertIn("version", self.call("GET", "/version"))
        self.assertEqual(self.call("POST", "/session/create", {"id": "c1"})["id"], "c1")
        r = self.call("POST", "/execute", {"command": "echo hi", "sessionId": "c1"})
        self.assertEqual((r["stdout"], r["exitCode"]), ("hi\n", 0))
        events = self.stream("/execute/stream", {"command": "echo a; echo b >&2", "sessionId": "c1"})
        self.assertEqual((events[0]["type"], events[-1]["type"], events[-1]["exitCode"]), ("start", "complete", 0))
        self.assertIn("bash", self.call("GET", "/commands")["availableCommands"])
        self.call("POST", "/mkdir", {"path": "/workspace/cd", "recursive": True})
        self.call("POST", "/write", {"path": "/workspace/cd/a.txt", "content": "abc"})
        self.assertEqual(self.call("POST", "/read", {"path": "/workspace/cd/a.txt"})["content"], "abc")
        events = self.stream("/read/stream", {"path": "/workspace/cd/a.txt"})
        self.assertEqual([e["type"] for e in events], ["metadata", "chunk", "complete"])
        self.call("POST", "/rename", {"oldPath": "/workspace/cd/a.txt", "newPath": "/workspace/cd/b.txt"})
        self.call("POST", "/move", {"sourcePath": "/workspace/cd/b.txt", "destinationPath": "/workspace/c.txt"})
        self.assertEqual(self.call("POST", "/exists", {"path": "/workspace/c.txt"})["exists"], True)
        files = self.call("POST", "/list-files", {"path": "/workspace", "options": {"recursive": True}})["files"]
        self.assertIn("c.txt", [f["name"] for f in files])
        self.call("POST", "/delete", {"path": "/workspace/c.txt"})
        with self.assertRaises(MoonboxError) as cm:
            self.call("POST", "/read", {"path": "/workspace/c.txt"})
        self.assertEqual((cm.exception.code, cm.exception.status), ("FILE_NOT_FOUND", 404))
        v = self.call("POST", "/watch/check", {"path": "/workspace/cd"})
        self.assertEqual(v["status"], "unchanged")
        self.assertEqual(self.call("POST", "/process/start", {"command": "echo out", "processId": "cp"})["processId"],
                         "cp")
        events = self.client._t.events("GET", self.sb._base + "/api/process/cp/stream")
        self.assertEqual(list(events)[-1]["type"], "exit")
        self.assertEqual(self.call("GET", "/process/cp")["process"]["status"], "completed")
        self.assertEqual(self.call("GET", "/process/cp/logs")["stdout"], "out\n")
        self.assertIn("cp", [p["id"] for p in self.call("GET", "/process/list")["processes"]])
        port = 20000 + os.getpid() % 1000
        self.call("POST", "/process/start", {"command": "python3 -m http.server %d" % port, "processId": "cw"})
        events = self.stream("/port-watch", {"port": port, "processId": "cw"})
        self.assertEqual([e["type"] for e in events], ["watching", "ready"])
        self.assertEqual(self.call("DELETE", "/process/cw")["processId"], "cw")
        self.call("POST", "/process/start", {"command": "sleep 30", "processId": "cs"})
        self.assertEqual(self.call("DELETE", "/process/kill-all")["killedCount"], 1)
        c = self.call("POST", "/contexts", {"language": "python"})
        events = self.stream("/execute/code", {"context_id": c["contextId"], "code": "print(1)\n2"})
        self.assertEqual(events[-1]["type"], "execution_complete")
        self.assertIn(c["contextId"], [x["id"] for x in self.call("GET", "/contexts")["contexts"]])
        self.assertEqual(self.call("DELETE", "/contexts/" + c["contextId"])["contextId"], c["contextId"])
        with self.assertRaises(MoonboxError) as cm:
            self.call("POST", "/git/checkout", {"repoUrl": "/workspace", "targetDir": "/workspace/g"})
        self.assertEqual(cm.exception.code, "POLICY_DENIED")
        b = self.call("POST", "/backup/create", {"dir": "/workspace/cd", "archivePath": "/tmp/cd.sqfs"})
        self.assertEqual(b["archivePath"], "/tmp/cd.sqfs")
        self.assertEqual(self.call("POST", "/backup/restore", {"dir": "/workspace/cd", "archivePath": "/tmp/cd.sqfs"})
                         ["success"], True)
        stream = self.client._t.events("POST", self.sb._base + "/api/watch", body={"path": "/workspace/cd"})
        first = next(stream)
        self.call("POST", "/write", {"path": "/workspace/cd/new.txt", "content": "n"})
        second = next(stream)
        stream.close()
        self.assertEqual((first["type"], second["type"], second["eventType"]), ("watching", "event", "create"))
        self.assertEqual(self.call("POST", "/session/delete", {"sessionId": "c1"})["sessionId"], "c1")


def image_layout(outdir):
    """An OCI layout of busybox and the host's bash with its libraries (the
    image specs' fixture, spec/images/fixtures.lua), built offline by
    spec/images/make_image.py; its tag "latest"."""
    entries, dirs = [{"path": "bin", "type": "dir"}, {"path": "etc", "type": "dir"},
                     {"path": "bin/busybox", "type": "file", "hostfile": "/bin/busybox", "mode": 0o755},
                     {"path": "etc/os-release", "type": "file", "content": "ID=moonbox-client-image\n"}], {"bin", "etc"}
    for applet in ("sh", "cat", "echo", "id", "true", "ls", "mkdir"):
        entries.append({"path": "bin/" + applet, "type": "symlink", "target": "busybox"})
    files = ["/bin/bash"]
    for line in subprocess.run(["ldd", "/bin/bash"], capture_output=True, text=True, check=True).stdout.splitlines():
        words = line.split()
        path = words[2] if "=>" in words and len(words) > 2 else words[0]
        if path.startswith("/"):
            files.append(path)
    for path in files:
        parts = path[1:].split("/")
        for i in range(1, len(parts)):
            d = "/".join(parts[:i])
            if d not in dirs:
                dirs.add(d)
                entries.append({"path": d, "type": "dir"})
        entries.append({"path": path[1:], "type": "file", "hostfile": os.path.realpath(path), "mode": 0o755})
    desc = os.path.join(os.path.dirname(outdir), "desc.json")
    with open(desc, "w") as f:
        json.dump({"config": {"Env": ["PATH=/bin"], "Cmd": ["/bin/sh"]}, "layers": [{"gzip": True, "entries": entries}]},
                  f)
    subprocess.run([sys.executable, os.path.join(SOURCE, "spec", "images", "make_image.py"), "oci", outdir, "latest",
                    desc], check=True, capture_output=True)


class Registry:
    """spec/images/registry.py on the loopback, serving ROOT's layouts."""

    def __init__(self, root, *flags):
        self.port_file = os.path.join(root, "port-%d" % len(os.listdir(root)))
        self.proc = subprocess.Popen([sys.executable, os.path.join(SOURCE, "spec", "images", "registry.py"), root,
                                      self.port_file] + list(flags), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.time() + 10
        while not os.path.exists(self.port_file):
            if time.time() > deadline or self.proc.poll() is not None:
                raise RuntimeError("the test registry did not start")
            time.sleep(0.05)
        with open(self.port_file) as f:
            self.host = "127.0.0.1:" + f.read().strip()

    def stop(self):
        self.proc.kill()
        self.proc.wait()


class TestImages(unittest.TestCase):
    """Images (docs/images.md) through the client: a pull from a registry
    on the loopback with its progress, with credentials, list, a sandbox
    made from the image, a template committed from it, remove."""

    @classmethod
    def setUpClass(cls):
        cls.client = client()
        cls.root = os.path.join(SERVER["tmp"], "registry")
        os.makedirs(os.path.join(cls.root, "team"))
        image_layout(os.path.join(cls.root, "team", "app"))

    def test_pull_list_sandbox_commit_remove(self):
        reg = Registry(self.root)
        try:
            events = []
            img = self.client.pull_image(reg.host + "/team/app:latest", name="py-app:1", on_progress=events.append)
            with self.assertRaises(MoonboxError) as cm:
                self.client.pullImage(reg.host + "/team/app:nope")
            self.assertEqual(cm.exception.code, "IMAGE_NOT_FOUND")
        finally:
            reg.stop()
        self.assertEqual((img["name"], len(img["layers"]), img["config"]["Cmd"]), ("py-app:1", 1, ["/bin/sh"]))
        self.assertTrue(img["digest"].startswith("sha256:"))
        self.assertEqual([e["type"] for e in events if e["type"] != "progress"], ["layer", "layerDone"])
        self.assertIn("py-app:1", [i["name"] for i in self.client.listImages()])
        sb = self.client.get_sandbox("py-image", image="py-app:1")
        try:
            self.assertEqual(sb.exec("cat /etc/os-release")["stdout"], "ID=moonbox-client-image\n")
            self.assertEqual(sb.info()["image"]["digest"], img["digest"])
            sb.exec("echo made > /etc/made-here")
            tmpl = sb.commit("py-tmpl:1")
            self.assertEqual((tmpl["name"], tmpl["parent"], len(tmpl["layers"])), ("py-tmpl:1", img["digest"], 2))
        finally:
            sb.destroy()
        sb_root = self.client.get_sandbox("py-image-root", image="py-app:1", user="0:0")
        try:
            self.assertEqual(sb_root.exec("id -u")["stdout"], "0\n")
            self.assertEqual(sb_root.info()["image"]["user"], "0:0")
        finally:
            sb_root.destroy()
        with self.assertRaises(MoonboxError) as cm:
            self.client.get_sandbox("py-image2", image="never-pulled")
        self.assertEqual((cm.exception.code, cm.exception.status), ("IMAGE_NOT_FOUND", 404))
        sb2 = self.client.get_sandbox("py-image3", image="py-tmpl:1")
        try:
            self.assertEqual(sb2.exec("cat /etc/made-here")["stdout"], "made\n")
        finally:
            sb2.destroy()
        self.assertEqual(self.client.remove_image("py-tmpl:1")["success"], True)
        self.assertEqual(self.client.removeImage("py-app:1")["name"], "py-app:1")
        self.assertNotIn("py-app:1", [i["name"] for i in self.client.list_images()])

    def test_pull_with_credentials(self):
        reg = Registry(self.root, "--basic", "py:secret pw")
        try:
            with self.assertRaises(MoonboxError) as cm:
                self.client.pull_image(reg.host + "/team/app:latest", name="py-private")
            self.assertEqual(cm.exception.code, "IMAGE_PULL_FAILED")
            self.assertIn("needs credentials", cm.exception.message)
            with self.assertRaises(MoonboxError) as cm:
                self.client.pull_image(reg.host + "/team/app:latest", username="py", password="wrong")
            self.assertIn("refused the credentials of py", cm.exception.message)
            events = list(self.client.pull_image_stream(reg.host + "/team/app:latest", name="py-private",
                                                        username="py", password="secret pw"))
            self.assertEqual((events[0]["type"], events[-1]["type"]), ("layer", "complete"))
            self.assertEqual(self.client.remove_image("py-private")["success"], True)
        finally:
            reg.stop()


class TestNetwork(unittest.TestCase):
    def test_egress_rules_changed_while_running(self):
        c = client()
        if os.geteuid() != 0:
            # fails closed unprivileged (docs/network.md): nothing to change
            with self.assertRaises(MoonboxError) as cm:
                c.get_sandbox("py-egress", network="egress", egress={"allow": ["192.0.2.0/24"]})
            self.assertEqual(cm.exception.code, "ISOLATION_UNAVAILABLE")
            return
        sb = c.get_sandbox("py-egress", network="egress", egress={"allow": ["192.0.2.0/24"]})
        try:
            self.assertEqual(sb.info()["network"]["egress"]["allow"], ["192.0.2.0/24"])
            net = sb.setNetwork(egress={"allow": ["198.51.100.0/24:443"], "deny": ["198.51.100.7"]})
            self.assertEqual((net["mode"], net["egress"]["allow"], net["egress"]["deny"]),
                             ("egress", ["198.51.100.0/24:443"], ["198.51.100.7"]))
            with self.assertRaises(MoonboxError) as cm:
                sb.set_network(egress={"allow": ["not a rule"]})
            self.assertEqual((cm.exception.code, cm.exception.status), ("VALIDATION_FAILED", 400))
            self.assertEqual(sb.info()["network"]["egress"]["allow"], ["198.51.100.0/24:443"])
        finally:
            sb.destroy()


class TestServer(unittest.TestCase):
    def test_health_ready_metrics(self):
        c = client()
        self.assertEqual(c.health(), {"status": "ok"})
        self.assertEqual(c.ready(), {"status": "ready"})
        self.assertIn("moonbox_", c.metrics())

    def test_bad_token(self):
        c = Client(SERVER["url"], "wrong-token-0123456789", on_response=RECORDS.append)
        with self.assertRaises(MoonboxError) as cm:
            c.list_sandboxes()
        self.assertEqual((cm.exception.code, cm.exception.status), ("UNAUTHORIZED", 401))

    def test_malformed_arguments(self):
        for url in ("127.0.0.1:8080", "ftp://h/", "http://h/?q=1"):
            with self.assertRaises(ValueError):
                Client(url, TOKEN)
        for token in ("two words", "line\r\nX-Injected: 1", ""):
            with self.assertRaises(ValueError):
                Client(SERVER["url"], token)
        with self.assertRaises(ValueError):
            client().get_sandbox("py-any").write_file("f", b"x", encoding="base64")

    def test_nothing_listening(self):
        c = Client("http://127.0.0.1:%d" % free_port(), TOKEN, timeout=5)
        with self.assertRaises(MoonboxError) as cm:
            c.health()
        self.assertEqual((cm.exception.code, cm.exception.status), ("CONNECTION_FAILED", None))

    def test_not_json_error(self):
        # a body that is not an error object (here: no route): still a MoonboxError with the status
        c = client()
        with self.assertRaises(MoonboxError) as cm:
            c._t.json("GET", "/v1/nowhere")
        self.assertEqual((cm.exception.code, cm.exception.status), ("NOT_FOUND", 404))


class TestDocExample(unittest.TestCase):
    def test_clients_md_example(self):
        """docs/clients.md's example prints what the document shows."""
        import contextlib
        import io
        import re
        with open(os.path.join(SOURCE, "docs", "clients.md")) as f:
            doc = f.read()
        m = re.search(r"<!-- clients-example:[^\n]*-->\n```python\n(.*?)```\nprints\n```text\n(.*?)```", doc, re.S)
        self.assertIsNotNone(m, "the marked example and its output in docs/clients.md")
        code, expected = m.group(1), m.group(2)
        self.assertIn('"http://127.0.0.1:8080"', code)
        code = code.replace('"http://127.0.0.1:8080"', repr(SERVER["url"]))
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, "docs/clients.md", "exec"), {"TOKEN": TOKEN, "__name__": "example"})
        self.assertEqual(out.getvalue(), expected)


class TestInstall(unittest.TestCase):
    def test_pip_install_offline_into_a_venv(self):
        tmp = tempfile.mkdtemp(prefix="moonbox-client-venv-")
        try:
            # a copy: pip builds in the source directory, which must stay clean
            src = os.path.join(tmp, "src")
            shutil.copytree(os.path.join(SOURCE, "clients", "python"), src,
                            ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
            venv = os.path.join(tmp, "venv")
            subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv], check=True)
            env = dict(os.environ, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1",
                       http_proxy="http://127.0.0.1:9", https_proxy="http://127.0.0.1:9")
            env.pop("PYTHONPATH", None)
            r = subprocess.run([os.path.join(venv, "bin", "pip"), "install", "--no-build-isolation", src],
                               env=env, capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            r = subprocess.run([os.path.join(venv, "bin", "python"), "-c",
                                "import moonbox, os; print(moonbox.__version__); "
                                "print(os.path.exists(os.path.join(os.path.dirname(moonbox.__file__), 'py.typed'))); "
                                "print(moonbox.__file__.startswith(%r))" % venv],
                               env=env, cwd=tmp, capture_output=True, text=True)
            self.assertEqual((r.returncode, r.stdout), (0, "0.1.0\nTrue\nTrue\n"), r.stderr)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    unittest.main(verbosity=2)
