-- Pulls over the OCI distribution API (lua/moonbox/images/registry.lua)
-- from a registry on the loopback (spec/images/registry.py): plain and
-- with the bearer token flow, an image index chosen for linux/amd64,
-- digests checked, a missing tag.
local core = require "moonbox.core"
local async = require "moonbox.async"
local images = require "moonbox.images"
local fx = require "images.fixtures"

local fails = helper.fails
local src = os.getenv("MOONBOX_SOURCE_DIR") or "."
local tmp
local n = 0
setup(function()
  tmp = helper.mkdtemp()
  helper.sh("mkdir -p '" .. tmp .. "/reg/team'")
  fx.oci(tmp .. "/reg/team/app", "latest", fx.layered_desc())
  fx.oci(tmp .. "/reg/team/app", "v2", { layers = { { entries = fx.busybox_entries() } } })
end)
teardown(function() helper.sh("rm -rf '" .. tmp .. "'") end)
before_each(function()
  n = n + 1
  images.store.DIR = tmp .. "/store" .. n
end)
after_each(function() images.store.DIR = nil end)

-- runs fn(host) with the registry up (token flow with token = true), then stops it
local function with_registry(token, fn)
  run_task(function()
    local port_file = ("%s/port-%d"):format(tmp, n)
    local exited = false
    local proc = assert(core.spawn { args = { "python3", src .. "/spec/images/registry.py", tmp .. "/reg", port_file,
      token and "--token" or nil }, file = "/usr/bin/python3", stdio = { [0] = "null", [1] = "null", [2] = "null" },
      on_exit = function() exited = true end })
    local ok, err = pcall(function()
      assert(helper.eventually(function() return helper.sh("cat '" .. port_file .. "' 2>/dev/null") ~= "" end, 10000),
        "the registry did not start")
      fn("127.0.0.1:" .. helper.sh("cat '" .. port_file .. "'"))
    end)
    core.kill(proc:pid(), "SIGKILL")
    while not exited do async.sleep(10) end
    if not ok then error(err, 0) end
  end)
end

describe("pulls from a registry", function()
  it("by tag, with the image's layers and config", function()
    with_registry(false, function(host)
      local rec = images.pull(host .. "/team/app:latest")
      assert.equal(2, #rec.layers)
      assert.equal("hello from the image", rec.config.Env[2]:match("=(.*)"))
      local digest = rec.digest
      local l1 = images.store.layer_path(rec.layers[1], images.default_owner())
      assert.matches("^ID=moonbox%-test%-image", helper.sh("cat '" .. l1 .. "/etc/os-release'"))
      -- by digest (of its manifest) too
      local by_digest = images.pull(host .. "/team/app@" .. rec.manifest)
      assert.equal(digest, by_digest.digest)
    end)
  end)

  it("through the bearer token flow, and an image index to its linux/amd64 manifest", function()
    with_registry(true, function(host)
      local rec = images.pull(host .. "/team/app:multi", { name = "app:multi" })
      assert.equal(2, #rec.layers)
      assert.equal("app:multi", images.list()[1].name)
    end)
  end)

  it("IMAGE_NOT_FOUND for a missing tag; IMAGE_INVALID when a digest does not match", function()
    with_registry(false, function(host)
      fails("IMAGE_NOT_FOUND", images.pull, host .. "/team/app:nope")
      fails("IMAGE_NOT_FOUND", images.pull, host .. "/team/other:latest")
      fails("IMAGE_NOT_FOUND", images.pull, host .. "/team/app@sha256:" .. ("1"):rep(64))
      local err = fails("IMAGE_INVALID", images.pull, host .. "/team/app:tampered")
      assert.matches("has digest sha256:", err.message, 1, true)
    end)
  end)

  it("IMAGE_PULL_FAILED when nothing answers", function()
    run_task(function()
      fails("IMAGE_PULL_FAILED", images.pull, "127.0.0.1:9/team/app:latest")
    end)
  end)
end)
