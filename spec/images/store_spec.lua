-- The image store (lua/moonbox/images/): importing OCI layouts and docker
-- archives, layers unpacked once with the OCI rules (whiteouts, opaque
-- directories, hard links, file capabilities), digests checked, hostile
-- layers refused with nothing written outside the store, list and remove.
local moonbox = require "moonbox"
local images = require "moonbox.images"
local disk = require "moonbox.sandbox.disk"
local fx = require "images.fixtures"

local fails = helper.fails
local tmp
setup(function() tmp = helper.mkdtemp() end)
-- a store of its own per test
local n = 0
before_each(function()
  n = n + 1
  images.store.DIR = tmp .. "/store" .. n
end)
teardown(function()
  images.store.DIR = nil
  helper.sh("rm -rf '" .. tmp .. "'")
end)

local function layer_dir(rec, i) return images.store.layer_path(rec.layers[i], images.default_owner()) end
local function read(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("*a")
  f:close()
  return s
end

describe("images.pull", function()
  it("imports an OCI layout: layers unpacked with whiteouts, opaque dirs, hard links, capabilities", function()
    local digest = fx.oci(tmp .. "/oci", "v1", fx.layered_desc())
    run_task(function()
      local events = {}
      local rec = images.pull("oci:" .. tmp .. "/oci:v1", { onProgress = function(ev) events[#events + 1] = ev end })
      assert.equal(digest, rec.digest)
      assert.equal(2, #rec.layers)
      assert.same({ "PATH=/bin", "IMAGE_GREETING=hello from the image" }, rec.config.Env)
      assert.equal("/srv", rec.config.WorkingDir)
      assert.same({ "/bin/sh" }, rec.config.Cmd)
      -- progress: each layer announced and finished, bytes counted
      local kinds = {}
      for _, ev in ipairs(events) do kinds[#kinds + 1] = ev.type .. ev.index end
      assert.same({ "layer1", "progress1", "layerDone1", "layer2", "progress2", "layerDone2" }, kinds)
      assert.is_true(events[2].bytes >= #read("/bin/busybox"))
      local l1, l2 = layer_dir(rec, 1), layer_dir(rec, 2)
      assert.equal("ID=moonbox-test-image\n", read(l1 .. "/etc/os-release"):match("^[^\n]*\n"))
      assert.equal("busybox", helper.sh("readlink '" .. l1 .. "/bin/sh'"))
      -- the whiteout is an overlayfs whiteout: a 0/0 character device
      assert.equal("character special file 0,0", helper.sh("stat -c '%F %Hr,%Lr' '" .. l2 .. "/etc/doomed'"))
      -- the opaque dir carries overlayfs' userxattr (sandboxes mount in their user namespace)
      local ns = "user"
      local getxattr = "python3 -c 'import os,sys; print(os.getxattr(sys.argv[1], sys.argv[2]).decode())'"
      assert.equal("y", helper.sh(getxattr .. " '" .. l2 .. "/opt' " .. ns .. ".overlay.opaque"))
      assert.is_nil(read(l2 .. "/opt/.wh..wh..opq"))
      -- the hard link shares its inode
      local ino = helper.sh("stat -c %i '" .. l2 .. "/srv/data'")
      assert.equal(ino, helper.sh("stat -c %i '" .. l2 .. "/srv/data-link'"))
      assert.equal("2", helper.sh("stat -c %h '" .. l2 .. "/srv/data'"))
      if disk.host_root() then
        assert.matches("cap_net_raw=ep", helper.sh("getcap '" .. l2 .. "/bin/pinger'"))
      end
      assert.equal("644", helper.sh("stat -c %a '" .. l2 .. "/srv/data'"))
      -- owners: root of the image is root of the sandboxes' id range (as root),
      -- the runtime's user unprivileged; a directory the tar did not list too
      local owner = images.default_owner()
      local want = owner and (owner.uid .. ":" .. owner.gid) or helper.sh("id -u") .. ":" .. helper.sh("id -g")
      assert.equal(want, helper.sh("stat -c %u:%g '" .. l2 .. "/srv/data'"))
      assert.equal(want, helper.sh("stat -c %u:%g '" .. l2 .. "/bin'"))
      assert.equal(want, helper.sh("stat -c %u:%g '" .. l2 .. "'"))
      -- the store is private
      assert.equal("700", helper.sh("stat -c %a '" .. images.store.dir() .. "'"))
      assert.same({ "oci:" .. tmp .. "/oci:v1" }, (function()
        local names = {}
        for _, r in ipairs(images.list()) do names[#names + 1] = r.name end
        return names
      end)())
    end)
  end)

  it("imports a docker archive, sharing layers already in the store", function()
    local desc = { config = { Env = { "A=1" } }, layers = { { entries = fx.busybox_entries() } } }
    local digest = fx.docker(tmp .. "/img.tar", desc)
    run_task(function()
      local rec = images.pull("docker-archive:" .. tmp .. "/img.tar", { name = "bb:1" })
      assert.equal(digest, rec.digest)
      assert.equal("bb:1", rec.name)
      assert.same({ "A=1" }, rec.config.Env)
      assert.equal("ID=moonbox-test-image", read(layer_dir(rec, 1) .. "/etc/os-release"):match("^[^\n]*"))
      -- the same layer again (another name): unpacked once, marked cached
      local cached
      images.pull("docker-archive:" .. tmp .. "/img.tar", { name = "bb:2", onProgress = function(ev)
        if ev.type == "layerDone" then cached = ev.cached end
      end })
      assert.is_true(cached)
      assert.equal(rec.digest, images.get("bb:2").digest)
      assert.equal("bb:1", images.get(rec.digest).name == "bb:1" and "bb:1" or images.get("bb:1").name)
    end)
  end)

  it("imports what skopeo writes: a docker archive and an OCI layout copied from ours", function()
    local digest = fx.oci(tmp .. "/src", "v1", fx.layered_desc())
    fx.run(("skopeo --insecure-policy copy oci:'%s/src:v1' docker-archive:'%s/sk.tar:team/app:1'"):format(tmp, tmp))
    fx.run(("skopeo --insecure-policy copy oci:'%s/src:v1' oci:'%s/sk-oci:copied'"):format(tmp, tmp))
    run_task(function()
      local a = images.pull("docker-archive:" .. tmp .. "/sk.tar", { name = "sk-archive" })
      local b = images.pull("oci:" .. tmp .. "/sk-oci:copied", { name = "sk-oci" })
      assert.equal(digest, a.digest)
      assert.equal(digest, b.digest)
      -- (the archive's layers are the uncompressed tars, the layout's gzipped)
      assert.same({ 2, 2 }, { #a.layers, #b.layers })
      assert.equal("shared inode", read(layer_dir(b, 2) .. "/srv/data"))
      assert.equal("shared inode", read(layer_dir(a, 2) .. "/srv/data"))
    end)
  end)

  it("refuses a docker archive whose manifest points out of it through a symlink", function()
    local d = tmp .. "/evil-archive"
    helper.sh("mkdir -p '" .. d .. "' && ln -s /etc/passwd '" .. d .. "/manifest.json' && tar -C '" .. d
      .. "' -cf '" .. tmp .. "/evil.tar' manifest.json")
    run_task(function()
      local err = fails("IMAGE_INVALID", images.pull, "docker-archive:" .. tmp .. "/evil.tar")
      assert.matches("not a file in the archive", err.message, 1, true)
    end)
  end)

  it("refuses a blob whose content does not match its digest", function()
    fx.oci(tmp .. "/bad", "latest", { layers = { { entries = fx.busybox_entries() } } })
    -- tamper with the layer blob (the largest file) after the manifest named it
    local blob = helper.sh("ls -S '" .. tmp .. "/bad/blobs/sha256/' | head -1")
    helper.sh("printf x >> '" .. tmp .. "/bad/blobs/sha256/" .. blob .. "'")
    run_task(function()
      local err = fails("IMAGE_INVALID", images.pull, "oci:" .. tmp .. "/bad")
      assert.matches("has digest sha256:", err.message)
      assert.is_nil(images.get("oci:" .. tmp .. "/bad"))
    end)
  end)

  it("IMAGE_NOT_FOUND for a missing layout, tag, archive or name", function()
    fx.oci(tmp .. "/one", "latest", { layers = { { entries = fx.busybox_entries() } } })
    run_task(function()
      fails("IMAGE_NOT_FOUND", images.pull, "oci:" .. tmp .. "/nope")
      fails("IMAGE_NOT_FOUND", images.pull, "oci:" .. tmp .. "/one:v9")
      fails("IMAGE_NOT_FOUND", images.pull, "docker-archive:" .. tmp .. "/nope.tar")
      fails("IMAGE_NOT_FOUND", images.remove, "never-pulled:1")
      assert.is_nil(images.get("never-pulled:1"))
      fails("IMAGE_PULL_FAILED", images.pull, "registry.example/x:1")
    end)
  end)
end)

describe("file capabilities", function()
  it("are kept as root; an unprivileged runtime refuses the layer rather than drop them", function()
    fx.oci(tmp .. "/cap", "latest", { layers = { { entries = {
      { path = "pinger", type = "file", content = "x", mode = 493,
        xattrs = { ["security.capability"] = fx.CAP_NET_RAW_EP } } } } } })
    run_task(function()
      if disk.host_root() then
        local rec = images.pull("oci:" .. tmp .. "/cap")
        assert.matches("cap_net_raw=ep", helper.sh("getcap '" .. layer_dir(rec, 1) .. "/pinger'"))
      else
        local err = fails("FILESYSTEM_ERROR", images.pull, "oci:" .. tmp .. "/cap")
        assert.matches("needs a root runtime", err.message, 1, true)
        assert.equal("pinger", err.context.entry)
      end
    end)
  end)
end)

describe("hostile layers", function()
  -- each: one bad entry after a good one; the pull fails naming it, the
  -- victim outside the store is untouched, no layer dir is left behind
  local cases = {
    { "a ../ path", { path = "../escaped", type = "file", content = "x" }, "'..' in path" },
    { "an absolute path", { path = "/tmp/moonbox-abs-escape", type = "file", content = "x" }, "absolute path" },
    { "a device node", { path = "dev-null", type = "chardev" }, "device node" },
    { "a block device", { path = "disk", type = "blockdev" }, "device node" },
    { "a hard link to /etc/shadow", { path = "shadow", type = "hardlink", target = "/etc/shadow" },
      "leaves the layer" },
    { "a hard link through ..", { path = "shadow", type = "hardlink", target = "../../../../etc/shadow" },
      "leaves the layer" },
    { "an overlay xattr", { path = "x", type = "file", content = "", xattrs = { ["user.overlay.redirect"] = "2f" } },
      "overlay namespace" },
  }
  for _, c in ipairs(cases) do
    it("refuses " .. c[1] .. " with IMAGE_INVALID naming the entry", function()
      local dir = tmp .. "/h-" .. c[1]:gsub("%W", "")
      fx.oci(dir, "latest", { layers = { { entries = { { path = "ok", type = "file", content = "fine" }, c[2] } } } })
      run_task(function()
        local err = fails("IMAGE_INVALID", images.pull, "oci:" .. dir)
        assert.matches(c[3], err.message, 1, true)
        assert.equal(c[2].path, err.context.entry)
        local st = images.store.dir()
        assert.equal("", helper.sh("ls -A '" .. st .. "/layers'; ls -A '" .. st .. "/tmp'"))
      end)
      assert.is_nil(read(tmp .. "/escaped"))
      assert.is_nil(read("/tmp/moonbox-abs-escape"))
    end)
  end

  it("refuses a write through a symlink that leaves the layer", function()
    local victim = tmp .. "/victim"
    helper.sh("mkdir '" .. victim .. "'")
    fx.oci(tmp .. "/sym", "latest", { layers = { { entries = {
      { path = "esc", type = "symlink", target = victim },
      { path = "esc/pwned", type = "file", content = "x" },
    } } } })
    run_task(function()
      local err = fails("IMAGE_INVALID", images.pull, "oci:" .. tmp .. "/sym")
      assert.matches("passes through a symlink", err.message, 1, true)
      assert.equal("esc/pwned", err.context.entry)
    end)
    assert.equal("", helper.sh("ls -A '" .. victim .. "'"))
  end)

  it("bounds a layer's size: a sparse 10 GB file is refused over the limit", function()
    local blob = require "moonbox.images.blob"
    -- a GNU sparse tar of a 10 GiB hole, gzipped: a few hundred bytes
    fx.run("cd '" .. tmp .. "' && truncate -s 10G huge && tar --sparse -czf huge.tgz huge && rm huge")
    fx.oci(tmp .. "/big", "latest", { layers = { { gzip = true, blob = tmp .. "/huge.tgz" } } })
    local old = blob.MAX_LAYER_BYTES
    blob.MAX_LAYER_BYTES = 1024 ^ 3
    run_task(function()
      local ok, err = pcall(images.pull, "oci:" .. tmp .. "/big")
      blob.MAX_LAYER_BYTES = old
      assert.is_false(ok)
      assert.equal("IMAGE_INVALID", err.code)
      assert.matches("larger than the limit", err.message, 1, true)
    end)
    assert.equal("", helper.sh("ls -A '" .. images.store.dir() .. "/layers'"))
  end)
end)

describe("a zip-bomb-like layer", function()
  it("costs no disk for its zeros: 64 MiB of them from a gzip of 64 KiB stay a hole", function()
    fx.oci(tmp .. "/bomb", "latest", { layers = { { gzip = true, entries = {
      { path = "zeros", type = "file", size = 64 * 1024 * 1024 } } } } })
    assert.is_true(tonumber(helper.sh("du -sk '" .. tmp .. "/bomb/blobs' | cut -f1")) < 1024)
    run_task(function()
      local rec = images.pull("oci:" .. tmp .. "/bomb")
      local f = layer_dir(rec, 1) .. "/zeros"
      assert.equal(tostring(64 * 1024 * 1024), helper.sh("stat -c %s '" .. f .. "'"))
      assert.is_true(tonumber(helper.sh("du -k '" .. f .. "' | cut -f1")) < 1024)
      assert.equal("0", helper.sh("tr -d '\\000' < '" .. f .. "' | wc -c"))
    end)
  end)
end)

describe("images.remove", function()
  it("removes the name, and layers no other image uses", function()
    fx.oci(tmp .. "/r", "latest", fx.layered_desc())
    run_task(function()
      local a = images.pull("oci:" .. tmp .. "/r", { name = "a" })
      images.pull("oci:" .. tmp .. "/r", { name = "b" })
      local res = images.remove("a")
      assert.same({ success = true, name = "a", removedLayers = 0 }, res)
      assert.is_true(require("moonbox.lib.util").is_dir(layer_dir(a, 1)))
      res = images.remove("b")
      assert.equal(2, res.removedLayers)
      assert.is_false(require("moonbox.lib.util").is_dir(layer_dir(a, 1)))
      assert.same({}, images.list())
      local st = images.store.dir()
      assert.equal("", helper.sh("ls -A '" .. st .. "/layers'; ls -A '" .. st .. "/blobs/sha256'"))
    end)
  end)
end)

describe("two pulls at once", function()
  it("take turns on the store's lock and both land", function()
    fx.oci(tmp .. "/both", "a", { layers = { { gzip = true, entries = fx.busybox_entries() } } })
    fx.oci(tmp .. "/both", "b", { layers = { { entries = { { path = "b", type = "file", content = "b" } } } } })
    run_task(function()
      local r = moonbox.all(function() return images.pull("oci:" .. tmp .. "/both:a", { name = "a" }) end,
        function() return images.pull("oci:" .. tmp .. "/both:b", { name = "b" }) end)
      local a, b = r[1], r[2]
      assert.same({ "a", "b" }, { a.name, b.name })
      assert.equal(2, #images.list())
      assert.equal("", helper.sh("ls -A '" .. images.store.dir() .. "/tmp'"))
    end)
  end)
end)

describe("pulling a name again", function()
  it("over another image drops what only the old one used", function()
    fx.oci(tmp .. "/again", "one", { layers = { { entries = { { path = "a", type = "file", content = "1" } } } } })
    fx.oci(tmp .. "/again", "two", { layers = { { entries = { { path = "a", type = "file", content = "2" } } } } })
    run_task(function()
      local one = images.pull("oci:" .. tmp .. "/again:one", { name = "n" })
      local two = images.pull("oci:" .. tmp .. "/again:two", { name = "n" })
      assert.are_not.equal(one.layers[1], two.layers[1])
      assert.is_false(require("moonbox.lib.util").is_dir(layer_dir(one, 1)))
      assert.equal("2", read(layer_dir(two, 1) .. "/a"))
      local st = images.store.dir()
      assert.equal(two.layers[1], helper.sh("ls '" .. st .. "/layers'"):match("^%x+"))
      assert.equal("", helper.sh("ls '" .. st .. "/blobs/sha256/" .. one.layers[1] .. "' 2>/dev/null"))
    end)
  end)
end)

describe("moonbox.images", function()
  it("is the public module", function() assert.equal(images, moonbox.images) end)
end)
