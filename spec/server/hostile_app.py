# A tenant's service for spec/server/proxy_hostile_spec.lua, run INSIDE a
# sandbox: what a hostile (or merely careless) service behind an exposed
# port does to the proxy of `moonbox serve`.
#   GET|POST /echo...      -> 200, JSON {target, headers} of the request as received
#   GET  /setcookie/N      -> 200 with one upstream Set-Cookie (COOKIES[N])
#   GET  /ws-req           -> WebSocket: one text message, JSON {target, headers}
#   GET  /flood?n=N&size=S -> WebSocket: N binary messages of S bytes, each one
#                             frame; byte o of message m is (o + m) % 251
#   GET  /wsecho           -> WebSocket: each message back (fragments kept as sent)
#   GET  /chunks?n=N       -> 200, chunked: N chunks of one byte each (a, b, ..., z, a, ...)
#   anything else: static files from the working directory
# usage: python3 hostile_app.py PORT
import base64, hashlib, http.server, json, socketserver, struct, sys, urllib.parse

GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
COOKIES = {
    "1": "moonbox_token=tossed; Path=/",
    "2": "moonbox_port_victim_8000=tossed; Path=/v1/sandboxes/victim/ports/8000/",
    "3": "sid=s1; Path=/; Domain=localhost; HttpOnly",
    "4": "Moonbox_Token=tossed; Path=/",
}


def recv_exact(f, n):
    data = b""
    while len(data) < n:
        part = f.read(n - len(data))
        if not part:
            raise EOFError
        data += part
    return data


def frame(op, data, fin=True):
    head = bytes([(0x80 if fin else 0) | op])
    n = len(data)
    if n < 126:
        head += bytes([n])
    elif n < 65536:
        head += bytes([126]) + struct.pack(">H", n)
    else:
        head += bytes([127]) + struct.pack(">Q", n)
    return head + data


class Handler(http.server.SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def seen(self):
        return json.dumps({"target": self.path, "headers": {k.lower(): v for k, v in self.headers.items()},
                           "authorization": self.headers.get_all("authorization") or []}).encode()

    def reply(self, status, body, extra=()):
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        for k, v in extra:
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        n = int(self.headers.get("content-length", "0"))
        if n:
            recv_exact(self.rfile, n)
        if self.path.startswith("/echo"):
            return self.reply(200, self.seen())
        self.send_error(404)

    def do_GET(self):
        path = self.path.split("?", 1)[0]
        if path.startswith("/echo"):
            return self.reply(200, self.seen())
        if path.startswith("/setcookie/"):
            return self.reply(200, b"{}", [("set-cookie", COOKIES[path.rsplit("/", 1)[1]])])
        if path == "/chunks":
            n = int(urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)["n"][0])
            self.send_response(200)
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            body = b"".join(b"1\r\n" + bytes([97 + i % 26]) + b"\r\n" for i in range(n))
            self.wfile.write(body + b"0\r\n\r\n")
            return
        if path in ("/ws-req", "/flood", "/wsecho"):
            return self.websocket(path)
        return super().do_GET()

    def websocket(self, path):
        key = self.headers.get("sec-websocket-key", "")
        accept = base64.b64encode(hashlib.sha1((key + GUID).encode()).digest()).decode()
        self.send_response(101)
        self.send_header("upgrade", "websocket")
        self.send_header("connection", "Upgrade")
        self.send_header("sec-websocket-accept", accept)
        self.end_headers()
        self.wfile.flush()
        if path == "/ws-req":
            self.wfile.write(frame(1, self.seen()))
        elif path == "/flood":
            q = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
            n, size = int(q["n"][0]), int(q["size"][0])
            base = bytes(range(251)) * (size // 251 + 2)
            for m in range(n):
                msg = frame(2, base[m % 251:m % 251 + size])
                for i in range(0, len(msg), 1 << 20):
                    self.wfile.write(msg[i:i + (1 << 20)])
        self.serve_frames(echo=path == "/wsecho")

    def serve_frames(self, echo):
        f = self.rfile
        while True:
            try:
                b1, b2 = recv_exact(f, 2)
                n = b2 & 0x7F
                if n == 126:
                    n = struct.unpack(">H", recv_exact(f, 2))[0]
                elif n == 127:
                    n = struct.unpack(">Q", recv_exact(f, 8))[0]
                mask = recv_exact(f, 4) if b2 & 0x80 else b"\0\0\0\0"
                data = recv_exact(f, n)
                if b2 & 0x80:
                    m = (mask * (n // 4 + 1))[:n]
                    data = (int.from_bytes(data, "big") ^ int.from_bytes(m, "big")).to_bytes(n, "big")
            except EOFError:
                return
            op = b1 & 0x0F
            if op == 8:
                self.wfile.write(b"\x88\x02\x03\xe8")
                return
            if op == 9:
                self.wfile.write(frame(10, data))
            elif echo and op in (0, 1, 2):
                self.wfile.write(frame(op, data, fin=bool(b1 & 0x80)))


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True


Server(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
