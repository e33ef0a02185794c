-- What the server admits (issue #14): request smuggling refused, every
-- request routed on the path as the client sent it (pipelined or not), a
-- watch stream whose client hangs up released at once, and the policy that
-- keeps a tenant's gitCheckout off the runtime's own repositories. Raw
-- bytes over TCP (spec/server/client.lua), against moonbox.server.http with
-- the /v1 API on a loopback port. The token of `moonbox serve` is in
-- spec/server/http_spec.lua.
local core = require "moonbox.core"
local cjson = require "cjson"
local http = require "moonbox.server.http"
local api = require "moonbox.server.api"
local sandbox_mod = require "moonbox.sandbox"
local client = require "server.client"

local home = helper.mkdtemp()
local seq = 0

local function port_of(server) return tonumber(server.address:match(":(%d+)$")) end

-- run_task(fn(server, port, new_id)) with the API on a free loopback port;
-- the sandboxes new_id() named are destroyed afterwards.
local function with_api(fn)
  run_task(function()
    api.configure { home = home }
    local server = http.listen({ listen = "127.0.0.1:0" }, api.handle)
    local ids = {}
    local function new_id(name)
      seq = seq + 1
      local id = ("%s-%d-%d"):format(name, core.getpid(), seq)
      ids[#ids + 1] = id
      return id
    end
    local ok, err = pcall(fn, server, port_of(server), new_id)
    for _, id in ipairs(ids) do
      local sb = sandbox_mod.all()[id]
      if sb then sb:destroy() end
    end
    server:close()
    if not ok then error(err, 0) end
  end)
end

-- run_task(fn(server, port, seen)) with a handler that answers each request
-- with its method and raw path, and records them in seen.
local function with_echo(fn)
  run_task(function()
    local seen = {}
    local server = http.listen({ listen = "127.0.0.1:0" }, function(req)
      seen[#seen + 1] = req.method .. " " .. tostring(req.rawPath) .. " " .. req.body
      return { status = 200, body = req.method .. " " .. tostring(req.rawPath) }
    end)
    local ok, err = pcall(fn, server, port_of(server), seen)
    server:close()
    if not ok then error(err, 0) end
  end)
end

-- One request on a connection of its own: status, decoded JSON body.
local function request(port, method, target, body)
  local conn = client.connect(port)
  body = body or ""
  conn:send(("%s %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"):format(method, target, #body, body))
  local status, _, text = conn:response()
  conn:close()
  return status, text ~= "" and cjson.decode(text) or nil
end

local function make_sandbox(port, id)
  local status = request(port, "POST", "/v1/sandboxes/" .. id .. "/exec", '{"command":"echo secret > s.txt"}')
  assert.equal(200, status)
  assert.is_table(sandbox_mod.all()[id])
end

describe("server: request smuggling", function()
  local heads = {
    ["two different Content-Length"] = "Content-Length: 5\r\nContent-Length: 62\r\n",
    ["the same Content-Length twice"] = "Content-Length: 5\r\nContent-Length: 5\r\n",
    ["a Content-Length list"] = "Content-Length: 5, 5\r\n",
    ["Transfer-Encoding with Content-Length"] = "Transfer-Encoding: chunked\r\nContent-Length: 5\r\n",
    ["Content-Length with Transfer-Encoding"] = "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
    ["obsolete line folding"] = "Content-Length: 5\r\nX-Folded: a\r\n b\r\n",
    ["a folded Content-Length"] = "X-A: 1\r\nContent-Length:\r\n 5\r\n",
    ["a blank before the colon"] = "Content-Length : 5\r\n",
  }
  for name, extra in pairs(heads) do
    it("answers " .. name .. " with 400 and closes, and what follows never runs", function()
      with_api(function(_, port, new_id)
        local victim = new_id("smuggled")
        make_sandbox(port, victim)
        local smuggled = "DELETE /v1/sandboxes/" .. victim .. " HTTP/1.1\r\nHost: x\r\n\r\n"
        for _, pipelined in ipairs { false, true } do
          local conn = client.connect(port)
          local first = ""
          if pipelined then -- behind a good request, in the same write
            first = "GET /v1/sandboxes/" .. victim .. "/sessions HTTP/1.1\r\nHost: x\r\n\r\n"
          end
          conn:send(first .. "POST /v1/sandboxes/" .. victim .. "/exec HTTP/1.1\r\nHost: x\r\n" .. extra ..
            "\r\nhello" .. smuggled)
          if pipelined then assert.equal(200, (conn:response())) end
          local status, headers, body = conn:response()
          assert.equal(400, status, name)
          assert.equal("close", headers.connection)
          local json = cjson.decode(body)
          assert.same({ "BAD_REQUEST", 400 }, { json.code, json.httpStatus })
          assert.is_true(conn:wait_eof(), "the connection stayed open")
          assert.is_nil(conn:response(), "a response to the smuggled request")
          conn:close()
          assert.is_table(sandbox_mod.all()[victim], "the smuggled DELETE ran")
        end
        -- the server goes on; the sandbox and its file are there
        local status, r = request(port, "POST", "/v1/sandboxes/" .. victim .. "/exec", '{"command":"cat s.txt"}')
        assert.same({ 200, "secret\n" }, { status, r.stdout })
      end)
    end)
  end

  it("takes one Content-Length, and a body that looks like a request stays a body", function()
    with_echo(function(_, port, seen)
      local conn = client.connect(port)
      local inner = "DELETE /x HTTP/1.1\r\nHost: x\r\n\r\n"
      conn:send(("POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%sGET /b HTTP/1.1\r\nHost: x\r\n\r\n")
        :format(#inner, inner))
      local s1, _, b1 = conn:response()
      local s2, _, b2 = conn:response()
      conn:close()
      assert.same({ 200, "POST /a", 200, "GET /b" }, { s1, b1, s2, b2 })
      assert.same({ "POST /a " .. inner, "GET /b " }, seen)
    end)
  end)
end)

describe("server: routing on the raw path", function()
  it("gives pipelined requests (also after a body, and after empty lines) the paths as sent, in order", function()
    with_echo(function(_, port, seen)
      local conn = client.connect(port)
      conn:send("POST /a%2Fb/c HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc" ..
        "GET /x/%2E%2E/y HTTP/1.1\r\nHost: x\r\n\r\n" ..
        "\r\n\r\nDELETE /s/..%2F..%2Fv HTTP/1.1\r\nHost: x\r\n\r\n" ..
        "GET /plain HTTP/1.1\r\nHost: x\r\n\r\n")
      local bodies = {}
      for i = 1, 4 do
        local status, _, body = conn:response()
        assert.equal(200, status)
        bodies[i] = body
      end
      conn:close()
      assert.same({ "POST /a%2Fb/c", "GET /x/%2E%2E/y", "DELETE /s/..%2F..%2Fv", "GET /plain" }, bodies)
      assert.same({ "POST /a%2Fb/c abc", "GET /x/%2E%2E/y ", "DELETE /s/..%2F..%2Fv ", "GET /plain " }, seen)
    end)
  end)

  it("serves pipelined requests with bodies, also bodies larger than one read, each with its own body", function()
    with_echo(function(_, port, seen)
      local big = ("0123456789abcdef"):rep(4096) -- 64 KiB: many reads
      local conn = client.connect(port)
      conn:send("GET /first HTTP/1.1\r\nHost: x\r\n\r\n" ..
        "POST /second HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc" ..
        ("PUT /big%%2F HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"):format(#big) .. big ..
        "GET /last HTTP/1.1\r\nHost: x\r\n\r\n")
      local bodies = {}
      for i = 1, 4 do
        local status, _, body = conn:response()
        assert.equal(200, status)
        bodies[i] = body
      end
      conn:close()
      assert.same({ "GET /first", "POST /second", "PUT /big%2F", "GET /last" }, bodies)
      assert.same({ "GET /first ", "POST /second abc", "PUT /big%2F " .. big, "GET /last " }, seen)
    end)
  end)

  it("refuses ..%2F in a session id with 400, alone or pipelined: no other sandbox is touched", function()
    with_api(function(_, port, new_id)
      local attacker, victim = new_id("attacker"), new_id("victim")
      make_sandbox(port, attacker)
      make_sandbox(port, victim)
      local evil = "DELETE /v1/sandboxes/" .. attacker .. "/sessions/..%2F..%2F" .. victim .. " HTTP/1.1\r\n" ..
        "Host: x\r\n\r\n"
      -- alone
      local conn = client.connect(port)
      conn:send(evil)
      local status, _, body = conn:response()
      assert.equal(400, status)
      assert.equal("sessionId", cjson.decode(body).context.field)
      conn:close()
      -- pipelined behind another request, in one write and in two
      for _, split in ipairs { false, true } do
        conn = client.connect(port)
        local first = "GET /v1/sandboxes/" .. attacker .. "/sessions HTTP/1.1\r\nHost: x\r\n\r\n"
        if split then
          conn:send(first .. evil:sub(1, 20))
          conn:send(evil:sub(21))
        else
          conn:send(first .. evil)
        end
        assert.equal(200, (conn:response()))
        status, _, body = conn:response()
        assert.equal(400, status)
        local json = cjson.decode(body)
        assert.same({ "VALIDATION_FAILED", "sessionId" }, { json.code, json.context.field })
        conn:close()
      end
      assert.is_table(sandbox_mod.all()[victim], "the victim's sandbox was destroyed")
      local st, r = request(port, "POST", "/v1/sandboxes/" .. victim .. "/exec", '{"command":"cat s.txt"}')
      assert.same({ 200, "secret\n" }, { st, r.stdout })
    end)
  end)
end)

describe("server: watch streams", function()
  -- this process's inotify instances (the server runs in it)
  local function inotify_fds()
    local fs = require "moonbox.lib.fs"
    local n = 0
    for _, entry in ipairs(assert(fs.scandir("/proc/self/fd"))) do
      local name = type(entry) == "table" and entry.name or entry
      if fs.readlink("/proc/self/fd/" .. name) == "anon_inode:inotify" then n = n + 1 end
    end
    return n
  end

  it("releases the watch of a client that hangs up at once: 200 quick disconnects leave nothing", function()
    with_api(function(server, port, new_id)
      local id = new_id("watcher")
      make_sandbox(port, id)
      local before = inotify_fds()
      for _ = 1, 200 do
        local conn = client.connect(port)
        conn:send("GET /v1/sandboxes/" .. id .. "/files/watch?path=/workspace HTTP/1.1\r\nHost: x\r\n\r\n")
        assert.truthy(conn:read_until("^HTTP/1%.1 200 .-\r\n\r\n"))
        conn:close()
      end
      -- each hang-up is noticed on the loop's next turns, not at the idle
      -- timeout (30 s): wait (at most 10 s) for the last ones
      local left, conns
      for _ = 1, 100 do
        left, conns = inotify_fds(), server:connections()
        if left <= before and conns == 0 then break end
        require("moonbox").sleep(100)
      end
      assert.equal(before, left, "inotify instances left behind")
      assert.equal(0, conns, "connections left open")
      -- and watching still works
      local conn = client.connect(port)
      conn:send("GET /v1/sandboxes/" .. id .. "/files/watch?path=/workspace HTTP/1.1\r\nHost: x\r\n\r\n")
      assert.truthy(conn:read_until("^HTTP/1%.1 200 .-\r\n\r\n"))
      assert.equal(200, (request(port, "POST", "/v1/sandboxes/" .. id .. "/files/write",
        '{"path":"/workspace/new.txt","content":"x"}')))
      local ev = conn:read_until("data: [^\n]*new%.txt[^\n]*\n")
      assert.truthy(ev, "no event for the new file")
      conn:close()
    end)
  end)
end)

describe("server: gitCheckout of local repositories", function()
  it("the policy's git.allowLocal is validated, and false refuses paths and file:// URLs with POLICY_DENIED", function()
    local policy = require "moonbox.policy"
    for _, bad in ipairs { { git = { allowLocal = "yes" } }, { git = { other = true } }, { git = true } } do
      local ok, err = pcall(policy.validate, bad)
      assert.is_false(ok)
      assert.equal("VALIDATION_FAILED", err.code)
      assert.matches("policy%.git", err.message)
    end
    assert.is_true(policy.resolve(nil).git.allowLocal) -- a script's sandboxes: its own URLs
    run_task(function()
      seq = seq + 1
      local sb = require("moonbox").getSandbox(("gitpol-%d-%d"):format(core.getpid(), seq),
        { root = home .. "/gitpol-" .. seq, policy = { git = { allowLocal = false } } })
      for _, url in ipairs { "/srv/repo.git", "file:///srv/repo.git", "File:///srv/repo" } do
        local err = helper.error_of(sb.gitCheckout, sb, url)
        assert.equal("POLICY_DENIED", err.code, url)
        assert.equal("git.allowLocal", err.context.policy)
      end
      for _, url in ipairs { "ext::sh -c id", "--upload-pack=id" } do
        assert.equal("INVALID_GIT_URL", helper.error_of(sb.gitCheckout, sb, url).code)
      end
      assert.equal("", sb:exec("ls -A /workspace").stdout)
      sb:destroy()
    end)
  end)
end)
