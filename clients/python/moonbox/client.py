"""The client: Client -> Sandbox / Session -> calls, each one HTTP request to
`moonbox serve`'s /v1 API (docs/http-api.md). Method names are the Lua
API's (camelCase) with snake_case aliases; options are keyword arguments,
camelCase or snake_case (``max_output_bytes`` is sent as ``maxOutputBytes``);
results are the server's JSON (dicts and lists), processes are Process
objects. Every failure raises MoonboxError."""
from __future__ import annotations

import json
import os
import re
import ssl
import urllib.parse
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Union

from .errors import MoonboxError
from .transport import Recorder, Transport

JSON = Dict[str, Any]
Event = Dict[str, Any]
EnvMap = Mapping[str, Optional[Union[str, bool]]]

DEFAULT_URL = "http://127.0.0.1:8080"
DEFAULT_TIMEOUT = 300.0
# a call that waits on the server for `timeout` ms gets this much longer
# before the client gives up on the response
WAIT_MARGIN_S = 30.0


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(w[:1].upper() + w[1:] for w in rest)


def _options(opts: Mapping[str, Any]) -> JSON:
    """Keyword options as the API's camelCase fields; None means not given."""
    return {_camel(k): v for k, v in opts.items() if v is not None}


def _env(env: EnvMap) -> JSON:
    # the Lua API's `false` (unset) is JSON null on the wire
    return {k: (None if v is False else v) for k, v in env.items()}


def _seg(value: Union[str, int]) -> str:
    return urllib.parse.quote(str(value), safe="")


class Client:
    """``Client(url, token)``: a `moonbox serve` at url (default
    $MOONBOX_URL or http://127.0.0.1:8080) with its bearer token (default
    $MOONBOX_TOKEN). ``timeout`` (seconds) bounds how long a call waits for
    its response, and a stream for each event (``stream_timeout``, None =
    as long as the stream lasts)."""

    def __init__(self, url: Optional[str] = None, token: Optional[str] = None, *,
                 timeout: Optional[float] = DEFAULT_TIMEOUT, stream_timeout: Optional[float] = None,
                 ssl_context: Optional[ssl.SSLContext] = None, on_response: Optional[Recorder] = None) -> None:
        url = url or os.environ.get("MOONBOX_URL") or DEFAULT_URL
        token = token if token is not None else os.environ.get("MOONBOX_TOKEN")
        self.timeout = timeout
        self.stream_timeout = stream_timeout
        self._t = Transport(url, token, timeout, ssl_context, on_response)

    # ---- server ---------------------------------------------------------------------
    def get_sandbox(self, id: str, *, from_backup: Union[str, JSON, None] = None,
                    image: Optional[str] = None, user: Optional[str] = None, network: Optional[str] = None,
                    egress: Optional[JSON] = None) -> "Sandbox":
        """The sandbox `id` (made by the server on its first write, like the
        Lua getSandbox). With ``from_backup`` (a backup or its id) and/or
        ``image`` (the name or digest of an image in the server's store,
        docs/images.md) a new sandbox is made now, whose files are the
        backup's, whose root is the image's (POST /v1/sandboxes/{id}), run
        as ``user`` (over the image's User) when given;
        ``network`` ("none", "host", "egress") with ``egress`` ({allow,
        deny}, docs/network.md) gives it that network."""
        sb = Sandbox(self, id)
        body: JSON = {}
        if network is not None:
            body["network"] = network
        if egress is not None:
            body["egress"] = egress
        if from_backup is not None:
            body["from"] = from_backup["id"] if isinstance(from_backup, dict) else from_backup
        if image is not None:
            body["image"] = image
        if user is not None:
            body["user"] = user
        if body:
            self._t.json("POST", sb._base, body=body)
        return sb

    # ---- images (docs/images.md)
    def pull_image_stream(self, ref: str, *, name: Optional[str] = None, username: Optional[str] = None,
                          password: Optional[str] = None) -> Iterator[Event]:
        """POST /v1/images/pull: a registry reference pulled into the
        server's store, as events: layer, progress ({bytes, entries}),
        layerDone, then complete ({image}) or error ({error}). ``username``
        and ``password``: the registry's credentials (sent in the body)."""
        body: JSON = {"ref": ref}
        if name is not None:
            body["name"] = name
        if username is not None or password is not None:
            body["auth"] = {"username": username, "password": password}
        return self._t.events("POST", "/v1/images/pull", body=body, stream_timeout=self.stream_timeout)

    def pull_image(self, ref: str, *, on_progress: Optional[Callable[[Event], None]] = None,
                   **opts: Any) -> JSON:
        """The pull of pull_image_stream, waited for: the image record
        {name, digest, layers, size, config, ...}; each event before the
        end goes to ``on_progress``; an error event raises MoonboxError."""
        for ev in self.pull_image_stream(ref, **opts):
            kind = ev.get("type")
            if kind == "complete":
                image: JSON = ev["image"]
                return image
            if kind == "error":
                err = ev.get("error") or {}
                raise MoonboxError.from_body(200, err)
            if on_progress is not None:
                on_progress(ev)
        raise MoonboxError("BAD_RESPONSE", "POST /v1/images/pull: the stream ended without complete or error")

    def list_images(self) -> List[JSON]:
        """The images in the server's store, by name."""
        return self._t.array("GET", "/v1/images")

    def remove_image(self, name: str) -> JSON:
        """{success, name, removedLayers}: the image and the layers no other image uses."""
        return self._t.obj("DELETE", "/v1/images", query={"name": name})

    def list_sandboxes(self) -> List[JSON]:
        """The sandboxes the server holds: [{id, created, lastUsed, sessions, processes, isolation}]."""
        return self._t.array("GET", "/v1/sandboxes")

    def list_backups(self) -> List[JSON]:
        return self._t.array("GET", "/v1/backups")

    def delete_backup(self, id: Union[str, JSON]) -> JSON:
        bid = id["id"] if isinstance(id, dict) else id
        return self._t.obj("DELETE", "/v1/backups/" + _seg(bid))

    def health(self) -> JSON:
        """GET /healthz: {status: "ok"} while the server serves."""
        return self._t.obj("GET", "/healthz")

    def ready(self) -> JSON:
        """GET /readyz: {status: "ready"}; MoonboxError(status=503) with the reason when not."""
        conn, resp = self._t.open("GET", "/readyz")
        try:
            data = resp.read(64 * 1024)
        finally:
            resp.close()
            conn.close()
        try:
            body = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            body = None
        if not isinstance(body, dict):
            raise MoonboxError("BAD_RESPONSE", "GET /readyz: the body is not a JSON object", resp.status)
        self._t._record("GET", "/readyz", resp, {}, body=body)
        if resp.status == 200:
            return body
        if "code" in body:  # an error of the server's (TOO_MANY_CONNECTIONS, ...)
            raise MoonboxError.from_body(resp.status, body)
        raise MoonboxError("NOT_READY", str(body.get("reason", "not ready")), resp.status, body)

    def metrics(self) -> str:
        """GET /metrics: the Prometheus text."""
        return self._t.text("GET", "/metrics")

    getSandbox = get_sandbox
    listSandboxes = list_sandboxes
    pullImage = pull_image
    pullImageStream = pull_image_stream
    listImages = list_images
    removeImage = remove_image
    listBackups = list_backups
    deleteBackup = delete_backup

    # (calls that wait on the server for `timeout` ms wait that long here too)
    def _wait_timeout(self, ms: Any) -> Optional[float]:
        if self.timeout is None:
            return None
        if isinstance(ms, (int, float)) and not isinstance(ms, bool) and ms > 0:
            return max(self.timeout, ms / 1000.0 + WAIT_MARGIN_S)
        return self.timeout


class _Calls:
    """The calls a sandbox and a session share; a session's run in its shell
    (``sessionId``), a sandbox's in its default session."""

    _client: Client
    _base: str
    _session_id: Optional[str] = None

    def _body(self, fields: JSON) -> JSON:
        if self._session_id is not None:
            fields["sessionId"] = self._session_id
        return fields

    def _query(self, **q: Any) -> JSON:
        if self._session_id is not None:
            q["sessionId"] = self._session_id
        return q

    def _json(self, method: str, path: str, **kw: Any) -> JSON:
        return self._client._t.obj(method, self._base + path, **kw)

    def _array(self, method: str, path: str, **kw: Any) -> List[Any]:
        return self._client._t.array(method, self._base + path, **kw)

    def _events(self, method: str, path: str, **kw: Any) -> Iterator[Event]:
        return self._client._t.events(method, self._base + path, stream_timeout=self._client.stream_timeout, **kw)

    # ---- commands
    def exec(self, command: Union[str, List[str]], *, request_timeout: Optional[float] = None,
             **opts: Any) -> JSON:
        """Run a command (a shell string, or an argv list run without a shell):
        {success, exitCode, stdout, stderr, command, duration, timestamp,
        sessionId, timedOut, truncated}. Options: timeout (ms), env, cwd,
        stdin, maxOutputBytes. Output that is not UTF-8 comes base64 with
        ``stdoutEncoding``/``stderrEncoding: "base64"``."""
        body = self._body(_options(opts))
        if "env" in body:
            body["env"] = _env(body["env"])
        body["command"] = command
        t = request_timeout if request_timeout is not None else self._client._wait_timeout(body.get("timeout"))
        return self._json("POST", "/exec", body=body, timeout=t)

    def exec_stream(self, command: Union[str, List[str]], **opts: Any) -> Iterator[Event]:
        """Events as they happen: start, stdout/stderr ({data}), then complete
        (or error). Closing the iterator early kills the command's tree."""
        body = self._body(_options(opts))
        if "env" in body:
            body["env"] = _env(body["env"])
        body["command"] = command
        return self._events("POST", "/exec/stream", body=body)

    def set_env_vars(self, env: EnvMap) -> JSON:
        """Sandbox level on a sandbox, that shell only on a session; None or
        False unsets."""
        return self._json("POST", "/env", body=self._body({"envVars": _env(env)}))

    # ---- processes
    def start_process(self, command: Union[str, List[str]], **opts: Any) -> "Process":
        """Start a background process. Options: processId, env, cwd, timeout, stdin, autoCleanup."""
        body = self._body(_options(opts))
        if "env" in body:
            body["env"] = _env(body["env"])
        body["command"] = command
        return Process(self, self._json("POST", "/processes", body=body))

    def list_processes(self) -> List["Process"]:
        return [Process(self, p) for p in self._array("GET", "/processes", query=self._query())]

    def get_process(self, id: str) -> Optional["Process"]:
        """The process, or None if there is none with this id."""
        try:
            return Process(self, self._json("GET", "/processes/" + _seg(id), query=self._query()))
        except MoonboxError as e:
            if e.code == "PROCESS_NOT_FOUND":
                return None
            raise

    def kill_process(self, id: str, signal: Union[str, int, None] = None) -> JSON:
        """{success, processId, signal}. Without a signal: SIGTERM to the
        tree, SIGKILL after the grace; the reply comes once it has ended."""
        return self._json("DELETE", "/processes/" + _seg(id), query=self._query(signal=signal))

    def kill_all_processes(self, signal: Union[str, int, None] = None) -> int:
        """How many processes were signalled."""
        return int(self._json("DELETE", "/processes", query=self._query(signal=signal))["count"])

    def cleanup_completed_processes(self) -> int:
        """How many records of ended processes were removed."""
        return int(self._json("POST", "/processes/cleanup", body=self._body({}))["count"])

    def get_process_logs(self, id: str) -> JSON:
        """{stdout, stderr, processId, truncated}."""
        return self._json("GET", "/processes/%s/logs" % _seg(id), query=self._query())

    def stream_process_logs(self, id: str) -> Iterator[Event]:
        """The buffered output, then live output, then {type: "exit", exitCode}."""
        return self._events("GET", "/processes/%s/logs/stream" % _seg(id), query=self._query())

    def _wait(self, id: str, fields: JSON) -> JSON:
        fields = {k: v for k, v in fields.items() if v is not None}
        return self._json("POST", "/processes/%s/wait" % _seg(id), body=self._body(fields),
                          timeout=self._client._wait_timeout(fields.get("timeout")))

    def wait_for_exit(self, id: str, timeout: Optional[int] = None) -> JSON:
        """{exitCode, status, processId}; timeout in ms."""
        return self._wait(id, {"exit": True, "timeout": timeout})

    def wait_for_log(self, id: str, pattern: str, timeout: Optional[int] = None, *,
                     plain: Optional[bool] = None) -> JSON:
        """{line, match, stream, captures?, processId}: a Lua pattern unless plain."""
        return self._wait(id, {"pattern": pattern, "timeout": timeout, "plain": plain})

    def wait_for_port(self, id: str, port: int, **opts: Any) -> JSON:
        """{success, port, mode, processId}. Options: mode ("http"|"tcp"), path, status, timeout, interval."""
        fields = _options(opts)
        fields["port"] = port
        return self._wait(id, fields)

    # ---- files
    def write_file(self, path: str, content: Union[str, bytes], *, encoding: Optional[str] = None) -> JSON:
        """{success, path, timestamp}. bytes are written exactly (sent raw,
        PUT /files/raw); a str is sent as is, or as base64 with encoding="base64"."""
        if isinstance(content, (bytes, bytearray)):
            if encoding is not None:
                raise ValueError("encoding applies to str content only")
            return self._json("PUT", "/files/raw", raw=bytes(content), query=self._query(path=path))
        return self._json("POST", "/files/write", body=self._body(_options(
            {"path": path, "content": content, "encoding": encoding})))

    def read_file(self, path: str, *, encoding: Optional[str] = None) -> JSON:
        """{success, path, content, encoding, isBinary, mimeType, size, timestamp}."""
        return self._json("POST", "/files/read", body=self._body(_options({"path": path, "encoding": encoding})))

    def read_file_stream(self, path: str) -> Iterator[bytes]:
        """The file's raw bytes, in chunks."""
        return self._client._t.chunks("GET", self._base + "/files/stream", query=self._query(path=path),
                                      stream_timeout=self._client.stream_timeout)

    def mkdir(self, path: str, *, recursive: Optional[bool] = None) -> JSON:
        return self._json("POST", "/files/mkdir", body=self._body(_options({"path": path, "recursive": recursive})))

    def delete_file(self, path: str) -> JSON:
        return self._json("POST", "/files/delete", body=self._body({"path": path}))

    def rename_file(self, old_path: str, new_path: str) -> JSON:
        return self._json("POST", "/files/rename", body=self._body({"path": old_path, "newPath": new_path}))

    def move_file(self, source_path: str, destination_path: str) -> JSON:
        return self._json("POST", "/files/move", body=self._body({"path": source_path, "newPath": destination_path}))

    def list_files(self, path: str, **opts: Any) -> JSON:
        """{success, path, files, count, truncated, timestamp}. Options: recursive, includeHidden, limit."""
        body = _options(opts)
        body["path"] = path
        return self._json("POST", "/files/list", body=self._body(body))

    def exists(self, path: str) -> JSON:
        return self._json("POST", "/files/exists", body=self._body({"path": path}))

    def watch(self, path: str, *, recursive: Optional[bool] = None, include: Optional[List[str]] = None,
              exclude: Optional[List[str]] = None) -> Iterator[Event]:
        """Events {type: create|modify|delete|move, path, isDirectory, timestamp}
        once the watch is in place; close the iterator to stop it."""
        return self._events("GET", "/files/watch", query=self._query(
            path=path, recursive=recursive, include=",".join(include) if include else None,
            exclude=",".join(exclude) if exclude else None))

    def check_changes(self, path: str, **opts: Any) -> JSON:
        """{success, status: unchanged|changed|resync, version, timestamp}. Options: since, recursive, include, exclude."""
        body = _options(opts)
        body["path"] = path
        return self._json("POST", "/files/changes", body=self._body(body))

    def git_checkout(self, repo_url: str, **opts: Any) -> JSON:
        """{success, repoUrl, branch, targetDir, timestamp}. Options: branch, targetDir, depth, timeout."""
        body = _options(opts)
        body["repoUrl"] = repo_url
        return self._json("POST", "/git/checkout", body=self._body(body),
                          timeout=self._client._wait_timeout(body.get("timeout")))

    # ---- code interpreter
    def create_code_context(self, **opts: Any) -> JSON:
        """{id, language, cwd, createdAt, lastUsed, sessionId}. Options: language, id, cwd, envVars, timeout."""
        body = _options(opts)
        if "envVars" in body:
            body["envVars"] = _env(body["envVars"])
        return self._json("POST", "/contexts", body=self._body(body))

    def list_code_contexts(self) -> List[JSON]:
        return self._array("GET", "/contexts", query=self._query())

    def delete_code_context(self, id: Union[str, JSON]) -> JSON:
        cid = id["id"] if isinstance(id, dict) else id
        return self._json("DELETE", "/contexts/" + _seg(cid), query=self._query())

    def _code_body(self, code: str, opts: Mapping[str, Any]) -> JSON:
        body = _options(opts)
        ctx = body.get("context")
        if isinstance(ctx, dict):
            body["context"] = ctx["id"]
        body["code"] = code
        return self._body(body)

    def run_code(self, code: str, **opts: Any) -> JSON:
        """{code, logs: {stdout, stderr}, results, error?, executionCount, ...}.
        Options: context (a context or its id), language, timeout. A user
        error is in ``error``, not raised."""
        body = self._code_body(code, opts)
        return self._json("POST", "/code", body=body, timeout=self._client._wait_timeout(body.get("timeout")))

    def run_code_stream(self, code: str, **opts: Any) -> Iterator[Event]:
        """Events stdout/stderr ({text}), result, error, then complete."""
        return self._events("POST", "/code/stream", body=self._code_body(code, opts))

    # Lua API names
    execStream = exec_stream
    setEnvVars = set_env_vars
    startProcess = start_process
    listProcesses = list_processes
    getProcess = get_process
    killProcess = kill_process
    killAllProcesses = kill_all_processes
    cleanupCompletedProcesses = cleanup_completed_processes
    getProcessLogs = get_process_logs
    streamProcessLogs = stream_process_logs
    waitForExit = wait_for_exit
    waitForLog = wait_for_log
    waitForPort = wait_for_port
    writeFile = write_file
    readFile = read_file
    readFileStream = read_file_stream
    deleteFile = delete_file
    renameFile = rename_file
    moveFile = move_file
    listFiles = list_files
    checkChanges = check_changes
    gitCheckout = git_checkout
    createCodeContext = create_code_context
    listCodeContexts = list_code_contexts
    deleteCodeContext = delete_code_context
    runCode = run_code
    runCodeStream = run_code_stream


_ID = re.compile(r"^[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?$")


class Sandbox(_Calls):
    """A sandbox of the server; its own calls run in its default session."""

    def __init__(self, client: Client, id: str) -> None:
        if not isinstance(id, str) or not _ID.match(id):
            raise MoonboxError("VALIDATION_FAILED",
                               "id: 1-63 of [a-z0-9_-], not starting or ending with '-', got %r" % (id,),
                               None, {"field": "id"})
        self.id = id
        self._client = client
        self._base = "/v1/sandboxes/" + id

    def __repr__(self) -> str:
        return "Sandbox(%r)" % self.id

    def info(self) -> JSON:
        """What is in force: {id, root, isolation, network, namespaces, cgroup, limits, ...}."""
        return self._json("GET", "")

    def destroy(self, *, keep_files: Optional[bool] = None) -> JSON:
        """Kill every process, forget sessions and contexts, remove the root unless keep_files."""
        return self._json("DELETE", "", query={"keepFiles": keep_files})

    def create_session(self, **opts: Any) -> "Session":
        """A new session. Options: id, env, cwd, commandTimeoutMs."""
        body = _options(opts)
        if "env" in body:
            body["env"] = _env(body["env"])
        r = self._json("POST", "/sessions", body=body)
        return Session(self, r["id"], r)

    def get_session(self, id: str) -> "Session":
        """The live session (SESSION_NOT_FOUND otherwise)."""
        r = self._json("GET", "/sessions/" + _seg(id))
        return Session(self, r["id"], r)

    def list_sessions(self) -> List[str]:
        return self._array("GET", "/sessions")

    def delete_session(self, id: Union[str, "Session"]) -> JSON:
        sid = id.id if isinstance(id, Session) else id
        return self._json("DELETE", "/sessions/" + _seg(sid))

    def expose_port(self, port: int, **opts: Any) -> JSON:
        """{url, port, name, public, ...}. Options: name, public."""
        body = _options(opts)
        body["port"] = port
        return self._json("POST", "/ports", body=body)

    def unexpose_port(self, port: int) -> JSON:
        return self._json("DELETE", "/ports/%d" % int(port))

    def get_exposed_ports(self) -> List[JSON]:
        return self._array("GET", "/ports")

    def create_backup(self, **opts: Any) -> JSON:
        """{id, dir, name, sandboxId, sizeBytes, compression, createdAt, expiresAt}.
        Options: dir, name, excludes, gitignore, ttl, compression."""
        return self._json("POST", "/backups", body=_options(opts))

    def restore_backup(self, backup: Union[str, JSON], *, dir: Optional[str] = None) -> JSON:
        bid = backup["id"] if isinstance(backup, dict) else backup
        return self._json("POST", "/backups/restore", body=_options({"id": bid, "dir": dir}))

    def set_network(self, *, egress: JSON) -> JSON:
        """An egress sandbox's rules, changed while it runs ({allow, deny},
        PATCH /network): its network as info() shows it."""
        return self._json("PATCH", "/network", body={"egress": egress})

    def commit(self, name: str) -> JSON:
        """The sandbox's changes over its image as a new image ``name`` in
        the server's store (a template): its record."""
        return self._json("POST", "/commit", body={"name": name})

    createSession = create_session
    getSession = get_session
    listSessions = list_sessions
    deleteSession = delete_session
    exposePort = expose_port
    unexposePort = unexpose_port
    getExposedPorts = get_exposed_ports
    createBackup = create_backup
    restoreBackup = restore_backup
    setNetwork = set_network


class Session(_Calls):
    """A persistent shell of a sandbox; ``id`` is its session id, ``fields``
    what the server said of it when this object was made ({cwd, ...})."""

    def __init__(self, sandbox: Sandbox, id: str, fields: Optional[JSON] = None) -> None:
        self.id = id
        self.sandbox = sandbox
        self.fields = fields or {}
        self._client = sandbox._client
        self._base = sandbox._base
        self._session_id = id

    def __repr__(self) -> str:
        return "Session(%r, %r)" % (self.sandbox.id, self.id)


class Process:
    """A background process: the fields the server sent (id, pid, command,
    status, startTime, endTime, exitCode, sessionId, ...) as attributes and
    in ``fields``, and the Lua Process methods. Fields are as of the last
    call that returned them; ``get_status()`` refreshes."""

    id: str
    pid: Optional[int]
    command: Any
    status: str
    exitCode: Optional[int]
    sessionId: Optional[str]

    def __init__(self, owner: _Calls, fields: JSON) -> None:
        self._owner = owner
        self._set(fields)

    def _set(self, fields: JSON) -> None:
        self.fields = fields
        for k in ("id", "pid", "sandboxPid", "command", "status", "startTime", "endTime", "exitCode",
                  "sessionId", "error", "oomKilled"):
            setattr(self, k, fields.get(k))

    def __repr__(self) -> str:
        return "Process(%r, status=%r)" % (self.id, self.status)

    def get_status(self) -> str:
        p = self._owner._json("GET", "/processes/" + _seg(self.id), query=self._owner._query())
        self._set(p)
        return str(self.status)

    def kill(self, signal: Union[str, int, None] = None) -> JSON:
        return self._owner.kill_process(self.id, signal)

    def get_logs(self) -> JSON:
        return self._owner.get_process_logs(self.id)

    def stream_logs(self) -> Iterator[Event]:
        return self._owner.stream_process_logs(self.id)

    def wait_for_exit(self, timeout: Optional[int] = None) -> JSON:
        r = self._owner.wait_for_exit(self.id, timeout)
        self.status, self.exitCode = r.get("status", self.status), r.get("exitCode")
        return r

    def wait_for_log(self, pattern: str, timeout: Optional[int] = None, *, plain: Optional[bool] = None) -> JSON:
        return self._owner.wait_for_log(self.id, pattern, timeout, plain=plain)

    def wait_for_port(self, port: int, **opts: Any) -> JSON:
        return self._owner.wait_for_port(self.id, port, **opts)

    getStatus = get_status
    getLogs = get_logs
    streamLogs = stream_logs
    waitForExit = wait_for_exit
    waitForLog = wait_for_log
    waitForPort = wait_for_port
