#!/usr/bin/env python3
"""A tiny OCI distribution registry for the image specs (no network):
serves the OCI layouts under ROOT (ROOT/<name>/ is a layout; tags from its
index.json annotations) on 127.0.0.1, an ephemeral port written to
PORT_FILE.

  registry.py ROOT PORT_FILE [--token] [--basic USER:PASS] [--token-basic USER:PASS]

With --token every /v2/ request needs `Authorization: Bearer good-token`,
else 401 with a WWW-Authenticate bearer challenge whose realm is /token
here (which answers {"token": "good-token"} for service=test-registry).
--basic: every /v2/ request needs `Authorization: Basic` of USER:PASS, else
401 with `WWW-Authenticate: Basic realm="test-registry"` (a registry behind
htpasswd). --token-basic: the token service (with --token) gives a token
only to those credentials, else 401.
A tag "multi" of a layout answers an image index: an arm64 entry (absent
from the layout) then the amd64 manifest of its tag "latest"; "tampered"
the manifest of "latest" with a byte added, under its digest.
"""
import base64, hashlib, json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse, parse_qs

ROOT, PORT_FILE = sys.argv[1], sys.argv[2]
TOKEN = "--token" in sys.argv


def basic_of(flag):
    if flag not in sys.argv:
        return None
    return "Basic " + base64.b64encode(sys.argv[sys.argv.index(flag) + 1].encode()).decode()


BASIC, TOKEN_BASIC = basic_of("--basic"), basic_of("--token-basic")
INDEX = "application/vnd.oci.image.index.v1+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def layout_tag(name, tag):
    with open(os.path.join(ROOT, name, "index.json")) as f:
        index = json.load(f)
    for m in index["manifests"]:
        if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag:
            return m["digest"]
    return None


def blob(name, digest):
    path = os.path.join(ROOT, name, "blobs", "sha256", digest.split(":", 1)[1])
    with open(path, "rb") as f:
        return f.read()


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def send(self, status, body=b"", ctype="application/octet-stream", headers=()):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        u = urlparse(self.path)
        port = self.server.server_address[1]
        if u.path == "/token":
            if TOKEN_BASIC and self.headers.get("Authorization") != TOKEN_BASIC:
                return self.send(401, b'{"errors":[]}', "application/json",
                                 [("WWW-Authenticate", 'Basic realm="test-registry"')])
            q = parse_qs(u.query)
            if q.get("service") != ["test-registry"] or not q.get("scope", [""])[0].startswith("repository:"):
                return self.send(400, b"{}", "application/json")
            return self.send(200, json.dumps({"token": "good-token"}).encode(), "application/json")
        if TOKEN and self.headers.get("Authorization") != "Bearer good-token":
            name = u.path[4:].rsplit("/", 2)[0] if u.path.startswith("/v2/") else ""
            challenge = 'Bearer realm="http://127.0.0.1:%d/token",service="test-registry",' \
                        'scope="repository:%s:pull"' % (port, name)
            return self.send(401, b'{"errors":[]}', "application/json", [("WWW-Authenticate", challenge)])
        if BASIC and self.headers.get("Authorization") != BASIC:
            return self.send(401, b'{"errors":[]}', "application/json",
                             [("WWW-Authenticate", 'Basic realm="test-registry"')])
        if u.path == "/v2/":
            return self.send(200, b"{}", "application/json")
        parts = u.path[4:].rsplit("/", 2)
        if len(parts) != 3 or parts[1] not in ("manifests", "blobs"):
            return self.send(404)
        name, kind, ref = parts
        try:
            if kind == "blobs":
                return self.send(200, blob(name, ref))
            if ref == "multi":
                latest = layout_tag(name, "latest")
                m = blob(name, latest)
                body = json.dumps({"schemaVersion": 2, "mediaType": INDEX, "manifests": [
                    {"mediaType": MANIFEST, "digest": "sha256:" + "0" * 64, "size": 1,
                     "platform": {"os": "linux", "architecture": "arm64"}},
                    {"mediaType": MANIFEST, "digest": latest, "size": len(m),
                     "platform": {"os": "linux", "architecture": "amd64"}}]}).encode()
                return self.send(200, body, INDEX, [("Docker-Content-Digest", "sha256:" + hashlib.sha256(body).hexdigest())])
            if ref == "tampered":  # the manifest of "latest" with one byte more than its digest says
                latest = layout_tag(name, "latest")
                return self.send(200, blob(name, latest) + b" ", MANIFEST, [("Docker-Content-Digest", latest)])
            digest = ref if ref.startswith("sha256:") else layout_tag(name, ref)
            if not digest:
                return self.send(404)
            body = blob(name, digest)
            return self.send(200, body, MANIFEST, [("Docker-Content-Digest", digest)])
        except (FileNotFoundError, NotADirectoryError):
            return self.send(404)


server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
with open(PORT_FILE + ".tmp", "w") as f:
    f.write(str(server.server_address[1]))
os.rename(PORT_FILE + ".tmp", PORT_FILE)
server.serve_forever()
