#!/usr/bin/env python3
"""A token service for docker-registry's `auth: token` (the distribution
token spec), on the loopback, for spec/images/docker_registry_spec.lua.

  token_server.py KEY.pem CERT.pem ISSUER SERVICE USER:PASS PORT_FILE

GET /token?service=SERVICE&scope=repository:NAME:ACTIONS with Basic auth
USER:PASS answers {"token": JWT}: RS256, signed with KEY (by openssl), its
header's x5c the self-signed CERT (the registry's rootcertbundle), granting
the scopes asked for. Wrong or no credentials: 401. The port it bound is
written to PORT_FILE once it listens.
"""
import base64, http.server, json, os, subprocess, sys, time, urllib.parse

KEY, CERT, ISSUER, SERVICE, CREDS, PORT_FILE = sys.argv[1:7]
USER = CREDS.split(":", 1)[0]
GOOD = "Basic " + base64.b64encode(CREDS.encode()).decode()
with open(CERT) as f:
    X5C = "".join(l.strip() for l in f if not l.startswith("-----"))  # the DER, base64


def b64url(data):
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def jwt(scopes):
    now = int(time.time())
    access = []
    for s in scopes:
        kind, name, actions = s.split(":")[0], ":".join(s.split(":")[1:-1]), s.split(":")[-1]
        access.append({"type": kind, "name": name, "actions": actions.split(",")})
    header = {"alg": "RS256", "typ": "JWT", "x5c": [X5C]}
    claims = {"iss": ISSUER, "sub": USER, "aud": SERVICE, "iat": now, "nbf": now - 60, "exp": now + 300,
              "jti": b64url(os.urandom(12)), "access": access}
    signing_input = b64url(json.dumps(header).encode()) + "." + b64url(json.dumps(claims).encode())
    sig = subprocess.run(["openssl", "dgst", "-sha256", "-sign", KEY], input=signing_input.encode(),
                         capture_output=True, check=True).stdout
    return signing_input + "." + b64url(sig)


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def send(self, status, body):
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if status == 401:
            self.send_header("WWW-Authenticate", 'Basic realm="moonbox-test-token"')
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        u = urllib.parse.urlparse(self.path)
        q = urllib.parse.parse_qs(u.query)
        if u.path != "/token" or q.get("service") != [SERVICE]:
            return self.send(404, b'{"error":"not found"}')
        if self.headers.get("Authorization") != GOOD:
            return self.send(401, b'{"error":"wrong username or password"}')
        token = jwt(q.get("scope", []))
        self.send(200, json.dumps({"token": token, "expires_in": 300}).encode())


server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
with open(PORT_FILE + ".tmp", "w") as f:
    f.write(str(server.server_address[1]))
os.rename(PORT_FILE + ".tmp", PORT_FILE)
server.serve_forever()
