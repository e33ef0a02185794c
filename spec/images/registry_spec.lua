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
      env = { PATH = "/usr/bin:/bin" }, -- (not the sanitizer build's LD_PRELOAD)
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

  it("over HTTP: POST /v1/images/pull streams progress as SSE, then GET and DELETE /v1/images", function()
    local cjson = require "cjson"
    local api = require "moonbox.server.api"
    api.configure { home = tmp .. "/server-home" }
    local function call(method, path, body, query)
      local res = { chunks = {}, closed = false }
      function res.start(self, status) self.status = status end
      function res.write(self, data) self.chunks[#self.chunks + 1] = data return true end
      function res.finish(self) self.finished = true end
      function res.onClose() end
      local r = api.handle({ method = method, path = path, query = query or {}, headers = {},
        body = body and cjson.encode(body) or nil }, res)
      if r then
        if type(r.body) == "table" then r.body = r.body.text() end
        return r.status, cjson.decode(r.body)
      end
      return res.status, table.concat(res.chunks)
    end
    with_registry(true, function(host)
      local status, text = call("POST", "/v1/images/pull", { ref = host .. "/team/app:latest", name = "app:1" })
      assert.equal(200, status)
      local events = {}
      for line in text:gmatch("data: ([^\n]+)") do events[#events + 1] = cjson.decode(line) end
      assert.equal("layer", events[1].type)
      assert.equal("complete", events[#events].type)
      assert.equal("app:1", events[#events].image.name)
      local s, list = call("GET", "/v1/images")
      assert.same({ 200, "app:1" }, { s, list[1].name })
      s, list = call("POST", "/v1/images/pull", { ref = "oci:" .. tmp .. "/reg/team/app" })
      assert.same({ 403, "POLICY_DENIED" }, { s, list.code })
      -- a failing pull ends its stream with an error event
      status, text = call("POST", "/v1/images/pull", { ref = host .. "/team/app:nope" })
      assert.equal(200, status)
      assert.matches('"code":"IMAGE_NOT_FOUND"', text, 1, true)
      s, list = call("DELETE", "/v1/images", nil, { name = "app:1" })
      assert.same({ 200, true }, { s, list.success })
      s, list = call("GET", "/v1/images")
      assert.same({ 200 }, { s, list[1] })
    end)
  end)

  it("IMAGE_PULL_FAILED when nothing answers", function()
    run_task(function()
      fails("IMAGE_PULL_FAILED", images.pull, "127.0.0.1:9/team/app:latest")
    end)
  end)
end)
