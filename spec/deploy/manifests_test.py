#!/usr/bin/env python3
"""deploy/: the Kubernetes manifests parse, and hold the fields
docs/scaling.md relies on; the routing ConfigMap is what the shipped
template renders for the StatefulSet; the Dockerfile builds on Debian 12
with cmake --install. Needs python3-yaml."""
import os
import re
import sys

import yaml

SOURCE = os.environ.get("MOONBOX_SOURCE_DIR") or os.path.abspath(os.path.join(os.path.dirname(__file__), "../.."))
K8S = os.path.join(SOURCE, "deploy", "kubernetes")
sys.path.insert(0, os.path.join(SOURCE, "deploy", "routing"))
import make_k8s  # noqa: E402

failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)


def load_all():
    docs = {}
    for name in sorted(os.listdir(K8S)):
        if not name.endswith(".yaml"):
            continue
        with open(os.path.join(K8S, name)) as f:
            for doc in yaml.safe_load_all(f):
                if doc:
                    check("apiVersion" in doc and "kind" in doc, "%s: a document without apiVersion/kind" % name)
                    docs.setdefault(doc["kind"], []).append((name, doc))
    return docs


def one(docs, kind, name):
    found = [d for _, d in docs.get(kind, []) if d["metadata"]["name"] == name]
    check(len(found) == 1, "expected one %s %s, found %d" % (kind, name, len(found)))
    return found[0] if found else {}


def main():
    docs = load_all()
    kust = docs.get("Kustomization", [(None, {})])[0][1]
    listed = set(kust.get("resources", []))
    on_disk = {n for n in os.listdir(K8S) if n.endswith(".yaml") and n != "kustomization.yaml"}
    check(listed == on_disk, "kustomization resources %s != files %s" % (sorted(listed), sorted(on_disk)))

    sts = one(docs, "StatefulSet", "moonbox")
    svc = one(docs, "Service", "moonbox")
    secret = one(docs, "Secret", "moonbox-token")
    ns = sts["metadata"].get("namespace")
    for kind, items in docs.items():
        for fname, d in items:
            if kind not in ("Namespace", "Kustomization"):
                check(d["metadata"].get("namespace") == ns, "%s %s: namespace %r, the StatefulSet's is %r"
                      % (fname, kind, d["metadata"].get("namespace"), ns))

    # headless Service over the StatefulSet's pods
    check(sts["spec"]["serviceName"] == svc["metadata"]["name"], "StatefulSet serviceName is not the Service")
    check(svc["spec"].get("clusterIP") == "None", "the Service is not headless (clusterIP: None)")
    labels = sts["spec"]["template"]["metadata"]["labels"]
    check(all(labels.get(k) == v for k, v in svc["spec"]["selector"].items()), "Service selector misses the pods")
    check(all(labels.get(k) == v for k, v in sts["spec"]["selector"]["matchLabels"].items()),
          "StatefulSet selector misses its template")

    pod = sts["spec"]["template"]["spec"]
    c = [c for c in pod["containers"] if c["name"] == "moonbox"][0]
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    home = env.get("MOONBOX_HOME")
    check(home, "no MOONBOX_HOME in the container's env")
    mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
    claims = [t["metadata"]["name"] for t in sts["spec"].get("volumeClaimTemplates", [])]
    check(mounts.get(home) in claims, "MOONBOX_HOME %s is not on a volumeClaimTemplate (%s)" % (home, claims))

    # the token: a Secret volume, and --token-file inside it
    args = c.get("args", [])
    check("serve" in (c.get("command") or []) or "--listen" in args, "the container does not run moonbox serve")
    check("--token-file" in args, "no --token-file in the args")
    token_path = args[args.index("--token-file") + 1] if "--token-file" in args else ""
    vols = {v["name"]: v for v in pod.get("volumes", [])}
    secret_mounts = [p for p, n in mounts.items() if vols.get(n, {}).get("secret", {}).get("secretName")
                     == secret["metadata"]["name"]]
    check(any(token_path.startswith(p.rstrip("/") + "/") and "stringData" in secret
              and token_path[len(p.rstrip("/")) + 1:] in secret["stringData"] for p in secret_mounts),
          "--token-file %s is not a key of the Secret's volume" % token_path)
    check("0.0.0.0:" in " ".join(args), "the server does not listen on the pod's address")

    # probes on /healthz (alive) and /readyz (ready), on the served port
    port_names = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    listen_port = int(re.search(r":(\d+)", " ".join(args)).group(1))
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = c.get(probe, {}).get("httpGet", {})
        check(get.get("path") == path, "%s path %r, expected %s" % (probe, get.get("path"), path))
        check(port_names.get(get.get("port"), get.get("port")) == listen_port, "%s port is not the served one" % probe)
    svc_ports = [p.get("targetPort") for p in svc["spec"]["ports"]]
    check(all(port_names.get(p, p) == listen_port for p in svc_ports), "Service targets another port")

    # what user namespaces and cgroups need, and resource limits
    sc = c.get("securityContext", {})
    check(sc.get("privileged") is True or ("SYS_ADMIN" in sc.get("capabilities", {}).get("add", [])
          and sc.get("seccompProfile", {}).get("type") == "Unconfined" and sc.get("procMount") == "Unmasked"),
          "the container's securityContext does not allow namespaces, mounts and a writable cgroup")
    limits = c.get("resources", {}).get("limits", {})
    check("memory" in limits and "cpu" in limits, "no cpu/memory limits")

    # the routing tier: the shipped ConfigMap is the template rendered for
    # this StatefulSet, hashing on the sandbox id
    cm = one(docs, "ConfigMap", "moonbox-router")
    conf = cm.get("data", {}).get("default.conf", "")
    check("hash $sandbox consistent;" in conf, "the router does not hash on $sandbox consistently")
    for i in range(sts["spec"]["replicas"]):
        host = "%s-%d.%s.%s.svc.cluster.local:%d" % (sts["metadata"]["name"], i, svc["metadata"]["name"], ns,
                                                    listen_port)
        check(("server %s " % host) in conf, "the router lacks pod %d (%s)" % (i, host))
    check(("%s-%d." % (sts["metadata"]["name"], sts["spec"]["replicas"])) not in conf, "the router names a pod too many")
    with open(os.path.join(K8S, "routing.yaml")) as f:
        check(f.read() == make_k8s.generate(), "routing.yaml is stale: run deploy/routing/make_k8s.py")
    check((make_k8s.NAMESPACE, make_k8s.STATEFULSET, make_k8s.SERVICE, make_k8s.REPLICAS, make_k8s.PORT)
          == (ns, sts["metadata"]["name"], svc["metadata"]["name"], sts["spec"]["replicas"], listen_port),
          "make_k8s.py's StatefulSet parameters differ from statefulset.yaml")
    dep = one(docs, "Deployment", "moonbox-router")
    rc = dep.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [{}])[0]
    check(any(m.get("mountPath") == "/etc/nginx/conf.d/default.conf" for m in rc.get("volumeMounts", [])),
          "the router does not mount the config where nginx reads it")

    with open(os.path.join(SOURCE, "deploy", "Dockerfile")) as f:
        dockerfile = f.read()
    # the base images are arguments (a registry's Debian 12, or one made by
    # mmdebstrap: spec/image-test.sh); their defaults are Debian 12's
    check(re.search(r"^ARG BUILD_BASE=debian:12$", dockerfile, re.M)
          and re.search(r"^ARG BASE=debian:12-slim$", dockerfile, re.M), "the image is not built on Debian 12")
    check("cmake --install" in dockerfile, "the image does not cmake --install")
    check('"moonbox", "serve"' in dockerfile, "the image does not run moonbox serve")

    with open(os.path.join(SOURCE, "docs", "scaling.md")) as f:
        scaling = f.read()
    for path in ("deploy/Dockerfile", "deploy/kubernetes/", "deploy/routing/moonbox-routing.conf.in",
                 "spec/deploy/routing_test.py"):
        check(path in scaling, "docs/scaling.md does not mention %s" % path)

    for f in failures:
        print("FAIL: " + f)
    if failures:
        sys.exit(1)
    print("ok - %d manifests, routing config and Dockerfile consistent" % sum(len(v) for v in docs.values()))


if __name__ == "__main__":
    main()
