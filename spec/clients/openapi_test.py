#!/usr/bin/env python3
"""docs/openapi.yaml against the server (issue #34):

  1. the document is OpenAPI 3.1 whose every $ref resolves, whose schemas
     are valid JSON Schema 2020-12, with unique operationIds;
  2. routes: every route the server's router registers (read from the
     router itself by spec/clients/routes.lua, run by the moonbox binary)
     is described, and every described route is registered -- or, for the
     few served outside the router (/healthz, /readyz, /metrics, the port
     proxy), answered in the recorded responses;
  3. error codes: every code of the server's status map is in the Error
     schema's x-moonbox-codes with the same status;
  4. responses: every response the Python client's tests recorded against a
     real `moonbox serve` (MOONBOX_CLIENT_RECORD, written by
     spec/clients/python_test.py, CTest's clients.python) validates against
     the schema of its route, method, status and content type (an SSE
     stream: each event against x-event-schema), the request body and
     query parameters of every accepted request are described, and every operation has
     a recorded success but those listed in NOT_RECORDED.

Environment: MOONBOX_BIN, MOONBOX_SOURCE_DIR, MOONBOX_CLIENT_RECORD."""
import json
import os
import re
import subprocess
import sys
import unittest

import jsonschema
import yaml

SOURCE = os.environ.get("MOONBOX_SOURCE_DIR") or os.path.abspath(os.path.join(os.path.dirname(__file__), "../.."))
BIN = os.environ.get("MOONBOX_BIN") or os.path.join(SOURCE, "build", "moonbox")
RECORD = os.environ.get("MOONBOX_CLIENT_RECORD") or os.path.join(SOURCE, "build", "clients-responses.jsonl")
METHODS = ("get", "put", "post", "delete", "patch", "head", "options")

# Served outside the router (moonbox.server.cli, moonbox.server.proxy): they
# must be described and answered in the recorded responses.
OUTSIDE_ROUTER = {"/healthz", "/readyz", "/metrics", "/v1/sandboxes/{id}/ports/{port}/{path}"}

# Operations no recorded success can show, and why.
NOT_RECORDED = {
    ("get", "/v1/sandboxes/{id}/sessions/{sessionId}/terminal"): "a WebSocket (spec/server/terminal_ws_spec.lua)",
    ("post", "/v1/sandboxes/{id}/git/checkout"): "a clone needs the network or git.allowLocal",
    ("post", "/v1/sandboxes/{id}/api/git/checkout"): "the same clone through the seed's protocol",
}
if os.geteuid() != 0:
    # python_test.py's TestNetwork makes an egress sandbox as root only (an
    # unprivileged server refuses "egress", docs/network.md)
    NOT_RECORDED[("patch", "/v1/sandboxes/{id}/network")] = "needs an egress sandbox: a root server"


def load_spec():
    with open(os.path.join(SOURCE, "docs", "openapi.yaml")) as f:
        return yaml.safe_load(f)


def server_tables():
    out = subprocess.run([BIN, os.path.join(SOURCE, "spec", "clients", "routes.lua")], capture_output=True,
                         text=True, check=True, env=dict(os.environ, MOONBOX_HOME="/nonexistent"))
    routes, codes = set(), {}
    for line in out.stdout.splitlines():
        kind, a, b = line.split(" ")
        if kind == "route":
            routes.add((a.lower(), b))
        else:
            codes[a] = int(b)
    return routes, codes


def resolve(spec, node):
    while isinstance(node, dict) and "$ref" in node:
        ref = node["$ref"]
        assert ref.startswith("#/"), ref
        node = spec
        for part in ref[2:].split("/"):
            node = node[part]
    return node


def template_for(spec, path):
    """The described path template a concrete path matches: the one with
    the most literal segments ({path} takes the rest of a proxy path)."""
    segs = path.strip("/").split("/")
    best, best_lit = None, -1
    for tpl in spec["paths"]:
        tsegs = tpl.strip("/").split("/")
        greedy = tsegs[-1] == "{path}"
        if greedy:
            if len(segs) < len(tsegs) - 1:
                continue
        elif len(segs) != len(tsegs):
            continue
        lit, ok = 0, True
        for i, t in enumerate(tsegs):
            if greedy and i == len(tsegs) - 1:
                break
            if t.startswith("{"):
                continue
            if t != segs[i]:
                ok = False
                break
            lit += 1
        if ok and lit > best_lit:
            best, best_lit = tpl, lit
    return best


class OpenAPI(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.spec = load_spec()
        cls.resolver = jsonschema.RefResolver.from_schema(cls.spec)

    def validate(self, schema, value, what):
        v = jsonschema.Draft202012Validator(schema, resolver=self.resolver)
        errs = sorted(v.iter_errors(value), key=lambda e: list(e.path))
        if errs:
            self.fail("%s: %s\n  at %s\n  value: %s" % (what, errs[0].message, list(errs[0].path),
                                                      json.dumps(value)[:800]))

    def operations(self):
        for tpl, item in self.spec["paths"].items():
            for m in METHODS:
                if m in item:
                    yield tpl, m, item[m]

    def check_request(self, tpl, op, r, what):
        """What the client sent and the server accepted: the body validates
        against the requestBody schema; each query parameter is described."""
        if r.get("request") is not None:
            self.assertIn("requestBody", op, what + ": a body was accepted, none is described")
            body = resolve(self.spec, op["requestBody"])
            self.validate(body["content"]["application/json"]["schema"], r["request"], what + " request")
        params = [resolve(self.spec, p) for p in self.spec["paths"][tpl].get("parameters", [])]
        params += [resolve(self.spec, p) for p in op.get("parameters", [])]
        names = {p["name"] for p in params if p["in"] == "query"}
        for k in r.get("query") or {}:
            self.assertIn(k, names, what + ": query parameter %s is not described" % k)

    # 1 -------------------------------------------------------------------------------------
    def test_document(self):
        self.assertTrue(str(self.spec["openapi"]).startswith("3.1."))
        refs = []

        def walk(node):
            if isinstance(node, dict):
                if isinstance(node.get("$ref"), str):
                    refs.append(node["$ref"])
                for v in node.values():
                    walk(v)
            elif isinstance(node, list):
                for v in node:
                    walk(v)
        walk(self.spec)
        self.assertGreater(len(refs), 100)
        for ref in set(refs):
            try:
                resolve(self.spec, {"$ref": ref})
            except (KeyError, AssertionError):
                self.fail("unresolved $ref " + ref)
        for name, schema in self.spec["components"]["schemas"].items():
            try:
                jsonschema.Draft202012Validator.check_schema(schema)
            except jsonschema.SchemaError as e:
                self.fail("components.schemas.%s: %s" % (name, e.message))
        ids = [op["operationId"] for _, _, op in self.operations()]
        self.assertEqual(len(ids), len(set(ids)), "duplicate operationIds")
        for tpl, m, op in self.operations():
            self.assertIn("responses", op, "%s %s" % (m, tpl))
            declared = set(re.findall(r"{(\w+)}", tpl))
            params = [resolve(self.spec, p) for p in self.spec["paths"][tpl].get("parameters", [])]
            params += [resolve(self.spec, p) for p in op.get("parameters", [])]
            self.assertEqual({p["name"] for p in params if p["in"] == "path"}, declared,
                             "%s %s: path parameters" % (m, tpl))

    # 2 -------------------------------------------------------------------------------------
    def test_routes_match_the_router(self):
        routes, _ = server_tables()
        self.assertGreater(len(routes), 40)
        described = {(m, tpl) for tpl, m, _ in self.operations() if tpl not in OUTSIDE_ROUTER}
        self.assertEqual(sorted(routes - described), [], "routes the server registers that openapi.yaml lacks")
        self.assertEqual(sorted(described - routes), [], "described routes the server does not register")
        self.assertTrue(OUTSIDE_ROUTER <= set(self.spec["paths"]))

    # 3 -------------------------------------------------------------------------------------
    def test_error_codes(self):
        _, codes = server_tables()
        documented = self.spec["components"]["schemas"]["Error"]["x-moonbox-codes"]
        for code, status in sorted(codes.items()):
            self.assertEqual(documented.get(code), status, "x-moonbox-codes.%s" % code)

    # 4 -------------------------------------------------------------------------------------
    def test_recorded_responses(self):
        self.assertTrue(os.path.exists(RECORD), "no recorded responses at %s: run CTest's clients.python" % RECORD)
        with open(RECORD) as f:
            records = [json.loads(line) for line in f if line.strip()]
        self.assertGreater(len(records), 100)
        codes = self.spec["components"]["schemas"]["Error"]["x-moonbox-codes"]
        ok = set()
        answered = set()
        for r in records:
            tpl = template_for(self.spec, r["path"])
            what = "%s %s -> %d" % (r["method"], r["path"], r["status"])
            if tpl is None:
                # an unknown route must answer the router's 404 NOT_FOUND
                self.assertEqual((r["status"], r["body"]["code"]), (404, "NOT_FOUND"), what)
                continue
            m = r["method"].lower()
            self.assertIn(m, self.spec["paths"][tpl], what + ": method not described")
            answered.add(tpl)
            if self.spec["paths"][tpl].get("x-moonbox-proxy"):
                continue  # the application's answer, not ours
            op = self.spec["paths"][tpl][m]
            if 200 <= r["status"] < 300:
                self.check_request(tpl, op, r, what)
            resp = op["responses"].get(str(r["status"])) or op["responses"].get("default")
            self.assertIsNotNone(resp, what + ": status not described")
            resp = resolve(self.spec, resp)
            ctype = r["contentType"].split(";")[0].strip()
            content = resp.get("content", {})
            self.assertIn(ctype, content, what + ": content type " + ctype)
            media = content[ctype]
            if "events" in r:
                self.assertIn("x-event-schema", media, what)
                for ev in r["events"]:
                    self.validate(media["x-event-schema"], ev, what + " event")
            elif "body" in r:
                self.validate(media["schema"], r["body"], what)
            elif "text" in r:
                self.validate(media["schema"], r["text"], what)
            if r["status"] >= 400 and ctype == "application/json" and isinstance(r.get("body"), dict) \
                    and "httpStatus" in r["body"]:
                body = r["body"]
                self.assertEqual(body["httpStatus"], r["status"], what)
                # (the seed's protocol keeps the seed's statuses: docs/compat.md, "Errors")
                if body["code"] in codes and "compat" not in op.get("tags", []) and \
                        (body.get("context") or {}).get("errno") not in ("EMFILE", "ENFILE", "ENOMEM", "EAGAIN"):
                    self.assertEqual(codes[body["code"]], r["status"], what + ": x-moonbox-codes." + body["code"])
            if 200 <= r["status"] < 300:
                ok.add((m, tpl))
        for tpl in OUTSIDE_ROUTER:
            self.assertIn(tpl, answered, "%s is described but no recorded response shows it served" % tpl)
        missing = [(m, tpl) for tpl, m, op in self.operations()
                   if tpl != "/v1/sandboxes/{id}/ports/{port}/{path}"
                   and (m, tpl) not in ok and (m, tpl) not in NOT_RECORDED]
        self.assertEqual(missing, [], "operations without a recorded success")


if __name__ == "__main__":
    unittest.main(verbosity=2)
