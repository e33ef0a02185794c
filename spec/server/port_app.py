# A dev server for the ports spec, run INSIDE a sandbox: static files from
# the working directory (python's http.server), plus
#   POST /echo     -> the request body back, with the request's headers as JSON in x-seen
#   GET  /chunked  -> a chunked response (three chunks)
#   GET  /ws       -> a WebSocket echo (text and binary), standard library only
#   GET  /hang     -> no response
# usage: python3 port_app.py PORT
import base64, hashlib, http.server, json, socketserver, struct, sys

GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def recv_exact(f, n):
    data = b""
    while len(data) < n:
        part = f.read(n - len(data))
        if not part:
            raise EOFError
        data += part
    return data


class Handler(http.server.SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_POST(self):
        if self.path != "/echo":
            self.send_error(404)
            return
        body = recv_exact(self.rfile, int(self.headers.get("content-length", "0")))
        seen = {k.lower(): v for k, v in self.headers.items()}
        self.send_response(201)
        self.send_header("content-type", "application/octet-stream")
        self.send_header("content-length", str(len(body)))
        self.send_header("x-seen", json.dumps(seen))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/chunked":
            self.send_response(200)
            self.send_header("content-type", "text/plain")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            for part in (b"first,", b"second," * 1000, b"third"):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\n\r\n")
            return
        if self.path == "/hang":  # no response at all (until the client goes away)
            self.rfile.read(1)
            return
        if self.path == "/ws":
            return self.websocket()
        return super().do_GET()

    def websocket(self):
        key = self.headers.get("sec-websocket-key", "")
        accept = base64.b64encode(hashlib.sha1((key + GUID).encode()).digest()).decode()
        self.send_response(101)
        self.send_header("upgrade", "websocket")
        self.send_header("connection", "Upgrade")
        self.send_header("sec-websocket-accept", accept)
        self.end_headers()
        self.wfile.flush()
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
                data = bytes(c ^ mask[i % 4] for i, c in enumerate(recv_exact(f, n)))
            except EOFError:
                return
            op = b1 & 0x0F
            if op == 8:
                self.wfile.write(b"\x88\x02\x03\xe8")
                return
            if op in (1, 2):
                reply = (b"echo:" + data) if op == 1 else data
                head = bytes([0x80 | op])
                if len(reply) < 126:
                    head += bytes([len(reply)])
                elif len(reply) < 65536:
                    head += bytes([126]) + struct.pack(">H", len(reply))
                else:
                    head += bytes([127]) + struct.pack(">Q", len(reply))
                self.wfile.write(head + reply)
                self.wfile.flush()


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True


Server(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
