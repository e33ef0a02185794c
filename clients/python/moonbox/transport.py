"""HTTP for the client: one connection per call (http.client), the bearer
token on every request, JSON bodies, errors raised as MoonboxError, SSE
streams read as they arrive. Bodies the client reads are bounded."""
from __future__ import annotations

import http.client
import json
import socket
import ssl
import urllib.parse
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple, Union

from . import sse
from .errors import MoonboxError

# The largest response body the client reads into memory (the server's own
# replies are bounded by its limits; this guards against anything else).
MAX_BODY_BYTES = 512 * 1024 * 1024

Query = Optional[Mapping[str, Union[str, int, bool, None]]]
Recorder = Callable[[Dict[str, Any]], None]


def _query_value(v: Union[str, int, bool]) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _close(conn: http.client.HTTPConnection, resp: http.client.HTTPResponse) -> None:
    """Close the connection now, also when the response holds its socket
    (Connection: close hands the socket to the response): the server sees
    the client leave at once, which cancels a stream's command or a wait,
    rather than whenever the garbage collector gets to it."""
    resp.close()
    conn.close()


class Transport:
    def __init__(self, url: str, token: Optional[str], timeout: Optional[float],
                 ssl_context: Optional[ssl.SSLContext] = None, on_response: Optional[Recorder] = None) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("url must be http://host[:port][/prefix] or https://..., got %r" % url)
        self.scheme = parts.scheme
        self.host = parts.hostname
        self.port = parts.port
        self.prefix = parts.path.rstrip("/")
        if parts.query or parts.fragment:
            raise ValueError("url must not have a query or fragment, got %r" % url)
        # (a token is one header value: no spaces or control characters to split it)
        if token is not None and (not token or any(not 0x21 <= ord(c) <= 0x7e for c in token)):
            raise ValueError("token must be printable ASCII without spaces")
        self.token = token
        self.timeout = timeout
        self.ssl_context = ssl_context
        self.on_response = on_response

    def _connect(self, timeout: Optional[float]) -> http.client.HTTPConnection:
        if self.scheme == "https":
            return http.client.HTTPSConnection(self.host, self.port, timeout=timeout, context=self.ssl_context)
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def _target(self, path: str, query: Query) -> str:
        target = self.prefix + path
        if query:
            items = [(k, _query_value(v)) for k, v in query.items() if v is not None]
            if items:
                target += "?" + urllib.parse.urlencode(items)
        return target

    def open(self, method: str, path: str, *, body: Any = None, raw: Optional[bytes] = None, query: Query = None,
             timeout: Optional[float] = None, accept: str = "application/json", stream: bool = False,
             stream_timeout: Optional[float] = None
             ) -> Tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send a request; the response is returned unread (status checked
        by callers). Connecting, sending and the response's head have
        `timeout` (the client's when None); with `stream`, reading the body
        then has `stream_timeout` between reads (None: no limit)."""
        headers = {"Accept": accept}
        if self.token:
            headers["Authorization"] = "Bearer " + self.token
        data: Optional[bytes] = None
        if raw is not None:
            data = raw
            headers["Content-Type"] = "application/octet-stream"
        elif body is not None:
            data = json.dumps(body, ensure_ascii=False).encode("utf-8")
            headers["Content-Type"] = "application/json"
        conn = self._connect(self.timeout if timeout is None else timeout)
        try:
            conn.request(method, self._target(path, query), body=data, headers=headers)
            # (taken before getresponse, which may hand the socket to the response)
            sock = conn.sock
            resp = conn.getresponse()
            if stream and sock is not None:
                sock.settimeout(stream_timeout)
            return conn, resp
        except socket.timeout:
            conn.close()
            raise MoonboxError("CLIENT_TIMEOUT", "%s %s: no response within %ss" % (method, path, conn.timeout)) \
                from None
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise MoonboxError("CONNECTION_FAILED", "%s %s: %s" % (method, path, e)) from None

    def _read(self, method: str, path: str, resp: http.client.HTTPResponse) -> bytes:
        try:
            data = resp.read(MAX_BODY_BYTES + 1)
        except socket.timeout:
            raise MoonboxError("CLIENT_TIMEOUT", "%s %s: the response stalled" % (method, path)) from None
        except (OSError, http.client.HTTPException) as e:
            raise MoonboxError("CONNECTION_FAILED", "%s %s: %s" % (method, path, e)) from None
        if len(data) > MAX_BODY_BYTES:
            raise MoonboxError("BAD_RESPONSE", "%s %s: a body over %d bytes" % (method, path, MAX_BODY_BYTES))
        return data

    def _record(self, method: str, path: str, resp: http.client.HTTPResponse, sent: Dict[str, Any],
                **what: Any) -> None:
        """Hand the on_response hook what was sent and what came back."""
        if self.on_response:
            query = {k: _query_value(v) for k, v in (sent.get("query") or {}).items() if v is not None}
            self.on_response(dict(method=method, path=path, status=resp.status,
                                  contentType=resp.getheader("Content-Type", ""), request=sent.get("body"),
                                  query=query, **what))

    def _error(self, method: str, path: str, resp: http.client.HTTPResponse, data: bytes,
               sent: Dict[str, Any]) -> MoonboxError:
        try:
            body = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            body = None
        self._record(method, path, resp, sent, body=body)
        err = MoonboxError.from_body(resp.status, body)
        if err.code == "HTTP_ERROR":
            err.message = "%s %s: HTTP %d %s" % (method, path, resp.status, resp.reason)
        return err

    def json(self, method: str, path: str, **kw: Any) -> Any:
        """A JSON call: the decoded result, or MoonboxError."""
        conn, resp = self.open(method, path, **kw)
        try:
            data = self._read(method, path, resp)
        finally:
            _close(conn, resp)
        if not 200 <= resp.status < 300:
            raise self._error(method, path, resp, data, kw)
        try:
            value = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise MoonboxError("BAD_RESPONSE", "%s %s: the body is not JSON: %s" % (method, path, e),
                               resp.status) from None
        self._record(method, path, resp, kw, body=value)
        return value

    def obj(self, method: str, path: str, **kw: Any) -> Dict[str, Any]:
        """A JSON call whose result is an object."""
        value = self.json(method, path, **kw)
        if not isinstance(value, dict):
            raise MoonboxError("BAD_RESPONSE", "%s %s: expected a JSON object" % (method, path))
        return value

    def array(self, method: str, path: str, **kw: Any) -> List[Any]:
        """A JSON call whose result is an array."""
        value = self.json(method, path, **kw)
        if not isinstance(value, list):
            raise MoonboxError("BAD_RESPONSE", "%s %s: expected a JSON array" % (method, path))
        return value

    def text(self, method: str, path: str, **kw: Any) -> str:
        conn, resp = self.open(method, path, accept="text/plain", **kw)
        try:
            data = self._read(method, path, resp)
        finally:
            _close(conn, resp)
        if not 200 <= resp.status < 300:
            raise self._error(method, path, resp, data, kw)
        text = data.decode("utf-8", "replace")
        self._record(method, path, resp, kw, text=text)
        return text

    def events(self, method: str, path: str, **kw: Any) -> Iterator[Dict[str, Any]]:
        """An SSE call: a generator of events. The request is sent at once
        (errors before the stream starts raise here); closing the generator
        (or leaving a for loop early and dropping it) closes the connection,
        which cancels the stream on the server."""
        conn, resp = self.open(method, path, accept="text/event-stream", stream=True, **kw)
        if not 200 <= resp.status < 300:
            try:
                data = self._read(method, path, resp)
            finally:
                _close(conn, resp)
            raise self._error(method, path, resp, data, kw)
        ctype = resp.getheader("Content-Type", "")
        if not ctype.startswith("text/event-stream"):
            _close(conn, resp)
            raise MoonboxError("BAD_RESPONSE", "%s %s: expected an event stream, got %r" % (method, path, ctype),
                               resp.status)
        return self._iterate(method, path, conn, resp, kw)

    def _iterate(self, method: str, path: str, conn: http.client.HTTPConnection,
                 resp: http.client.HTTPResponse, sent: Dict[str, Any]) -> Iterator[Dict[str, Any]]:
        seen: List[Dict[str, Any]] = []
        ended = False
        try:
            for ev in sse.events(resp):
                if self.on_response:
                    seen.append(ev)
                yield ev
            ended = True
        except socket.timeout:
            raise MoonboxError("CLIENT_TIMEOUT", "%s %s: no event within the stream timeout" % (method, path)) \
                from None
        except (OSError, http.client.HTTPException) as e:
            raise MoonboxError("CONNECTION_FAILED", "%s %s: %s" % (method, path, e)) from None
        finally:
            _close(conn, resp)
            # (also a stream the caller closed early: what it saw)
            self._record(method, path, resp, sent, events=seen, ended=ended)

    def chunks(self, method: str, path: str, chunk_size: int = 64 * 1024, **kw: Any) -> Iterator[bytes]:
        """A raw byte stream (GET /files/stream), in chunks as they arrive."""
        conn, resp = self.open(method, path, accept="application/octet-stream", stream=True, **kw)
        if not 200 <= resp.status < 300:
            try:
                data = self._read(method, path, resp)
            finally:
                _close(conn, resp)
            raise self._error(method, path, resp, data, kw)
        self._record(method, path, resp, kw)
        return self._chunks(method, path, conn, resp, chunk_size)

    @staticmethod
    def _chunks(method: str, path: str, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse,
                chunk_size: int) -> Iterator[bytes]:
        try:
            while True:
                chunk = resp.read1(chunk_size) if hasattr(resp, "read1") else resp.read(chunk_size)
                if not chunk:
                    break
                yield chunk
        except socket.timeout:
            raise MoonboxError("CLIENT_TIMEOUT", "%s %s: the stream stalled" % (method, path)) from None
        except (OSError, http.client.HTTPException) as e:
            raise MoonboxError("CONNECTION_FAILED", "%s %s: %s" % (method, path, e)) from None
        finally:
            _close(conn, resp)
