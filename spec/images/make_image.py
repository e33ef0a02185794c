#!/usr/bin/env python3
"""Builds small test images with no network: an OCI image layout or a
docker-archive tar, from a JSON description of layers.

  make_image.py oci OUTDIR TAG DESC.json
  make_image.py docker OUTFILE DESC.json
  make_image.py tar OUTFILE DESC.json        (one layer tar alone: desc = [entries])

DESC = {"layers": [{"gzip": bool, "entries": [ENTRY...]}], "config": {...}}
ENTRY = {"path", "type": file|dir|symlink|hardlink|chardev|blockdev|fifo,
         "content"?, "hostfile"?, "mode"?, "uid"?, "gid"?, "target"?,
         "xattrs"? {name: hex}, "size"? (a sparse file of that size)}
"hostdir" entries ({"type": "hostdir", "src", "path"}) add a host tree.
"""
import gzip, hashlib, io, json, os, sys, tarfile


def layer_bytes(entries):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            t = e["type"]
            if t == "hostdir":
                tar.add(e["src"], arcname=e["path"], recursive=True)
                continue
            ti = tarfile.TarInfo(e["path"])
            ti.mode = e.get("mode", 0o755 if t == "dir" else 0o644)
            ti.uid, ti.gid = e.get("uid", 0), e.get("gid", 0)
            ti.mtime = e.get("mtime", 1700000000)
            if "xattrs" in e:
                ti.pax_headers = {"SCHILY.xattr." + k: bytes.fromhex(v).decode("latin-1")
                                  for k, v in e["xattrs"].items()}
            data = None
            if t == "file":
                if "hostfile" in e:
                    with open(e["hostfile"], "rb") as f:
                        data = f.read()
                elif "size" in e:
                    ti.size = e["size"]
                    ti.type = tarfile.GNUTYPE_SPARSE if False else tarfile.REGTYPE
                    tar.addfile(ti, ZeroReader(e["size"]))
                    continue
                else:
                    data = e.get("content", "").encode()
                ti.size = len(data)
            elif t == "dir":
                ti.type = tarfile.DIRTYPE
            elif t == "symlink":
                ti.type, ti.linkname = tarfile.SYMTYPE, e["target"]
            elif t == "hardlink":
                ti.type, ti.linkname = tarfile.LNKTYPE, e["target"]
            elif t == "chardev":
                ti.type, ti.devmajor, ti.devminor = tarfile.CHRTYPE, e.get("major", 1), e.get("minor", 3)
            elif t == "blockdev":
                ti.type, ti.devmajor, ti.devminor = tarfile.BLKTYPE, 7, 0
            elif t == "fifo":
                ti.type = tarfile.FIFOTYPE
            tar.addfile(ti, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


class ZeroReader:
    def __init__(self, n):
        self.n = n

    def read(self, k=-1):
        k = self.n if k < 0 else min(k, self.n)
        self.n -= k
        return b"\0" * k


def sha(b):
    return hashlib.sha256(b).hexdigest()


def build(desc):
    layers = []  # (blob bytes, diff_id hex, gzip?)
    for l in desc["layers"]:
        if "blob" in l:  # a layer made elsewhere (tar --sparse): taken as it is
            with open(l["blob"], "rb") as f:
                blob = f.read()
            layers.append((blob, sha(gzip.decompress(blob) if l.get("gzip") else blob), l.get("gzip", False)))
            continue
        raw = layer_bytes(l["entries"])
        blob = gzip.compress(raw, mtime=0) if l.get("gzip") else raw
        layers.append((blob, sha(raw), l.get("gzip", False)))
    config = {
        "architecture": "amd64", "os": "linux", "created": "2026-01-01T00:00:00Z",
        "config": desc.get("config", {}),
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + d for _, d, _ in layers]},
    }
    return layers, json.dumps(config).encode()


def write_blob(outdir, b):
    d = sha(b)
    os.makedirs(os.path.join(outdir, "blobs", "sha256"), exist_ok=True)
    with open(os.path.join(outdir, "blobs", "sha256", d), "wb") as f:
        f.write(b)
    return d


def oci(outdir, tag, desc):
    layers, config = build(desc)
    os.makedirs(outdir, exist_ok=True)
    with open(os.path.join(outdir, "oci-layout"), "w") as f:
        json.dump({"imageLayoutVersion": "1.0.0"}, f)
    cd = write_blob(outdir, config)
    manifest = {
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": "sha256:" + cd,
                   "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar" + ("+gzip" if gz else ""),
                    "digest": "sha256:" + write_blob(outdir, b), "size": len(b)} for b, _, gz in layers],
    }
    mb = json.dumps(manifest).encode()
    md = write_blob(outdir, mb)
    index_path = os.path.join(outdir, "index.json")
    index = {"schemaVersion": 2, "manifests": []}
    if os.path.exists(index_path):
        with open(index_path) as f:
            index = json.load(f)
    index["manifests"] = [m for m in index["manifests"]
                          if m.get("annotations", {}).get("org.opencontainers.image.ref.name") != tag]
    index["manifests"].append({"mediaType": manifest["mediaType"], "digest": "sha256:" + md, "size": len(mb),
                               "annotations": {"org.opencontainers.image.ref.name": tag}})
    with open(index_path, "w") as f:
        json.dump(index, f)
    print("sha256:" + cd)


def docker(outfile, desc):
    layers, config = build(desc)
    cd = sha(config)
    with tarfile.open(outfile, "w") as tar:
        def add(name, b):
            ti = tarfile.TarInfo(name)
            ti.size = len(b)
            tar.addfile(ti, io.BytesIO(b))
        names = []
        for b, d, _ in layers:
            add(d + "/layer.tar", b)
            names.append(d + "/layer.tar")
        add(cd + ".json", config)
        add("manifest.json", json.dumps([{"Config": cd + ".json", "RepoTags": ["test:latest"],
                                          "Layers": names}]).encode())
    print("sha256:" + cd)


if __name__ == "__main__":
    kind = sys.argv[1]
    with open(sys.argv[-1]) as f:
        desc = json.load(f)
    if kind == "oci":
        oci(sys.argv[2], sys.argv[3], desc)
    elif kind == "docker":
        docker(sys.argv[2], desc)
    elif kind == "tar":
        with open(sys.argv[2], "wb") as f:
            f.write(layer_bytes(desc))
