-- Pulls over the OCI distribution API (lua/moonbox/images/registry.lua)
-- from a registry on the loopback (spec/images/registry.py): plain and
-- with the bearer token flow, an image index chosen for linux/amd64,
-- digests checked, a missing tag; credentials (images/credentials.lua) for
-- a Basic registry and a token service that wants them.
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

-- runs fn(host) with the registry up (token flow with token = true; a
-- table: registry.py's flags), then stops it
local function with_registry(token, fn)
  run_task(function()
    local port_file = ("%s/port-%d"):format(tmp, n)
    local exited = false
    local args = { "python3", src .. "/spec/images/registry.py", tmp .. "/reg", port_file }
    local flags = type(token) == "table" and token or { token and "--token" or nil }
    for _, a in ipairs(flags) do args[#args + 1] = a end
    local proc = assert(core.spawn { args = args, file = "/usr/bin/python3",
      stdio = { [0] = "null", [1] = "null", [2] = "null" },
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

  describe("with credentials", function()
    local SECRET = "s3cret pass:word"
    local credentials = require "moonbox.images.credentials"
    local real_spawn = core.spawn
    local argvs
    before_each(function()
      credentials.FILE = tmp .. "/auth-" .. n .. ".json"
      argvs = {}
      -- every curl the pull starts, its argv kept to look for the secret (the
      -- test's registry gets it on its own command line)
      core.spawn = function(spec)
        if spec.args[1]:match("curl$") then argvs[#argvs + 1] = table.concat(spec.args, " ") end
        return real_spawn(spec)
      end
    end)
    after_each(function()
      core.spawn = real_spawn
      credentials.FILE = nil
    end)
    local function no_secret_in_argv()
      assert.is_true(#argvs > 0)
      for _, a in ipairs(argvs) do
        assert.is_nil(a:find("s3cret", 1, true))
        assert.is_nil(a:find(core.base64_encode("tester:" .. SECRET), 1, true))
      end
      -- nor left in the store's scratch
      assert.equal("", helper.sh("grep -rlF '" .. core.base64_encode("tester:" .. SECRET) .. "' '" ..
        images.store.DIR .. "' 2>/dev/null; ls -A '" .. images.store.DIR .. "/tmp'"))
    end

    it("a Basic registry: the right ones pull; wrong or none are IMAGE_PULL_FAILED", function()
      with_registry({ "--basic", "tester:" .. SECRET }, function(host)
        local ref = host .. "/team/app:latest"
        local err = fails("IMAGE_PULL_FAILED", images.pull, ref)
        assert.matches("needs credentials (HTTP 401)", err.message, 1, true)
        err = fails("IMAGE_PULL_FAILED", images.pull, ref, { auth = { username = "tester", password = "wrong" } })
        assert.matches("refused the credentials of tester (HTTP 401): wrong username or password", err.message, 1,
          true)
        assert.is_nil(err.message:find("wrong\"", 1, true))
        local rec = images.pull(ref, { auth = { username = "tester", password = SECRET } })
        assert.equal(2, #rec.layers)
        no_secret_in_argv()
        fails("VALIDATION_FAILED", images.pull, ref, { auth = { username = "a:b", password = "x" } })
      end)
    end)

    it("a token service that wants them (the bearer flow with Basic auth)", function()
      with_registry({ "--token", "--token-basic", "tester:" .. SECRET }, function(host)
        local ref = host .. "/team/app:multi"
        local err = fails("IMAGE_PULL_FAILED", images.pull, ref)
        assert.matches("its token service needs credentials", err.message, 1, true)
        err = fails("IMAGE_PULL_FAILED", images.pull, ref, { auth = { username = "tester", password = "nope" } })
        assert.matches("its token service refused the credentials of tester", err.message, 1, true)
        assert.is_nil(err.message:find("nope", 1, true))
        local rec = images.pull(ref, { auth = { username = "tester", password = SECRET } })
        assert.equal(2, #rec.layers)
        no_secret_in_argv()
      end)
    end)

    it("from the auth file (docker's auths format), which must be 0600", function()
      with_registry({ "--basic", "tester:" .. SECRET }, function(host)
        local f = assert(io.open(credentials.FILE, "w"))
        f:write(require("cjson").encode { auths = { [host] = { auth = core.base64_encode("tester:" .. SECRET) } } })
        f:close()
        helper.sh("chmod 644 '" .. credentials.FILE .. "'")
        local err = fails("IMAGE_PULL_FAILED", images.pull, host .. "/team/app:latest")
        assert.matches("may be read by others (mode 644): chmod 600 it", err.message, 1, true)
        helper.sh("chmod 600 '" .. credentials.FILE .. "'")
        assert.equal(2, #images.pull(host .. "/team/app:latest").layers)
        no_secret_in_argv()
        -- the file has nothing for another host: anonymous there
        assert.is_nil(credentials.from_file("127.0.0.2:1"))
      end)
    end)
  end)

  it("with credentials from the CLI (--password-stdin) and POST /v1/images/pull {auth}", function()
    local cjson = require "cjson"
    local bin = os.getenv("MOONBOX_BIN") or "build/moonbox"
    with_registry({ "--basic", "cli:pw of cli" }, function(host)
      local home = tmp .. "/cli-home-" .. n
      local function cli(stdin, args)
        return helper.sh(("printf '%s' | MOONBOX_HOME='%s' %s image pull %s 2>&1; echo \"rc=$?\""):format(stdin, home,
          bin, args))
      end
      local out = cli("wrong\\n", host .. "/team/app:v2 --username cli --password-stdin")
      assert.matches("IMAGE_PULL_FAILED: registry [^\n]* refused the credentials of cli .*rc=1$", out)
      out = cli("pw of cli\\n", host .. "/team/app:v2 --username cli --password-stdin")
      assert.matches("rc=0$", out)
      assert.matches(host .. "/team/app:v2 sha256:", out, 1, true)
      out = cli("", host .. "/team/app:v2 --username cli")
      assert.matches("%-%-username and %-%-password%-stdin go together.*rc=2$", out)

      local api = require "moonbox.server.api"
      api.configure { home = tmp .. "/server-home-" .. n }
      local function pull(body)
        local res = { chunks = {} }
        function res.start(self, status) self.status = status end
        function res.write(self, data) self.chunks[#self.chunks + 1] = data return true end
        function res.finish(self) self.finished = true end
        function res.onClose() end
        local r = api.handle({ method = "POST", path = "/v1/images/pull", query = {}, headers = {},
          body = cjson.encode(body) }, res)
        assert.is_nil(r)
        return table.concat(res.chunks)
      end
      local text = pull { ref = host .. "/team/app:v2", auth = { username = "cli", password = "bad" } }
      assert.matches('"code":"IMAGE_PULL_FAILED"', text, 1, true)
      assert.is_nil(text:find("bad", 1, true))
      text = pull { ref = host .. "/team/app:v2", auth = { username = "cli", password = "pw of cli" } }
      assert.matches('"type":"complete"', text, 1, true)
    end)
  end)

  it("IMAGE_PULL_FAILED when nothing answers", function()
    run_task(function()
      fails("IMAGE_PULL_FAILED", images.pull, "127.0.0.1:9/team/app:latest")
    end)
  end)
end)
