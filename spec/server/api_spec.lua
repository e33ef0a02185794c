-- The /v1 HTTP API (lua/moonbox/server/api.lua) driven with request and
-- response tables of the shape moonbox.server.http passes, without a socket:
-- routing, the request checks, each family of endpoints, streams, and what a
-- client that goes away mid-stream leaves behind (nothing).
local cjson = require "cjson"
local core = require "moonbox.core"
local moonbox = require "moonbox"
local api = require "moonbox.server.api"
local api_errors = require "moonbox.server.api_errors"

local home = helper.mkdtemp()
local seq = 0

-- A response object as the transport gives handlers. on_write(res, data)
-- sees each chunk; disconnect() is the client going away.
local function fake_res(on_write)
  local res = { chunks = {}, closed = false, close_fns = {} }
  function res.start(self, status, headers) self.status, self.headers = status, headers end
  function res.write(self, data)
    if self.closed then return false end
    self.chunks[#self.chunks + 1] = data
    if on_write then on_write(self, data) end
    return not self.closed
  end
  function res.finish(self) self.finished = true end
  function res.onClose(self, fn) self.close_fns[#self.close_fns + 1] = fn end
  function res.disconnect(self)
    if self.closed then return end
    self.closed = true
    for _, fn in ipairs(self.close_fns) do fn() end
  end
  return res
end

local function sse_events(res)
  local events = {}
  for record in table.concat(res.chunks):gmatch("(.-)\n\n") do
    local data = record:match("^data: (.*)$")
    assert(data, "not an SSE data record: " .. record)
    events[#events + 1] = cjson.decode(data)
  end
  return events
end

-- request(method, path, {body = table|string, query, rawPath, on_write, res})
-- -> status, decoded body (or SSE events), headers, res
local function request(method, path, opts)
  opts = opts or {}
  local body = opts.body
  if type(body) == "table" then body = cjson.encode(body) end
  local res = opts.res or fake_res(opts.on_write)
  local r = api.handle({ method = method, path = path, query = opts.query or {}, headers = {}, body = body,
    rawPath = opts.rawPath, websocket = opts.websocket }, res)
  if r then
    if type(r.body) == "table" then r.body = r.body.text() end -- a body in slices (api_json.body)
    if r.headers["content-type"] ~= "application/json" then return r.status, r.body, r.headers end
    return r.status, cjson.decode(r.body), r.headers, r.body
  end
  if res.headers and res.headers["content-type"]:match("^text/event%-stream") then
    return res.status, sse_events(res), res.headers, res
  end
  return res.status, table.concat(res.chunks), res.headers, res
end

-- run_task(fn(call, base)) against a fresh sandbox id, destroyed at the end;
-- call(method, subpath, opts) requests /v1/sandboxes/<id><subpath>.
local function with_api(fn, config)
  seq = seq + 1
  local id = ("api-%d-%d"):format(core.getpid(), seq)
  local base = "/v1/sandboxes/" .. id
  api.configure(config or { home = home })
  return run_task(function()
    local function call(method, sub, opts) return request(method, base .. sub, opts) end
    -- reads never make a sandbox (a write would): made here as api.lua would make it
    local cfg = config or { home = home }
    moonbox.getSandbox(id, { root = cfg.home .. "/sandboxes/" .. id, policy = cfg.policy, limits = cfg.limits })
    local ok, err = pcall(fn, call, base, id)
    local status = call("DELETE", "")
    api.configure { home = home }
    if not ok then error(err, 0) end
    assert.equal(200, status)
  end)
end

local function assert_error(status, code, got_status, body)
  assert.equal(code, body.code, body.message)
  assert.equal(status, got_status)
  assert.equal(status, body.httpStatus)
  assert.is_string(body.message)
  assert.is_table(body.context)
end

describe("api routing", function()
  it("answers an unknown route 404 NOT_FOUND and a wrong method 405 with Allow", function()
    with_api(function(call, base)
      assert_error(404, "NOT_FOUND", request("GET", "/v2/nothing"))
      assert_error(404, "NOT_FOUND", call("GET", "/no-such-thing"))
      assert_error(404, "NOT_FOUND", call("POST", "/files/chmod", { body = { path = "x" } }))
      local status, body, headers = call("GET", "/exec")
      assert_error(405, "METHOD_NOT_ALLOWED", status, body)
      assert.equal("POST", headers.allow)
      status, body, headers = call("PUT", "/processes")
      assert_error(405, "METHOD_NOT_ALLOWED", status, body)
      assert.equal("DELETE, GET, POST", headers.allow)
      assert.same({ "DELETE", "GET", "POST" }, body.context.allow)
      assert.equal(200, (request("GET", base)))
    end)
  end)

  it("has a route for every endpoint docs/http-api.md documents, and documents every route", function()
    local router_mod = require "moonbox.server.api_router"
    local src = os.getenv("MOONBOX_SOURCE_DIR") or "."
    local doc = assert(io.open(src .. "/docs/http-api.md")):read("*a")
    local documented = {}
    for method, path in doc:gmatch("\n### `(%u+) ([^`?]+)[^`]*`") do
      if path:sub(1, 4) ~= "/v1/" then path = "/v1/sandboxes/{id}" .. path end
      documented[method .. " " .. path] = true
      local concrete = path:gsub("{%w+}", "x1")
      local route = api.router:match(method, router_mod.segments(concrete))
      assert.is_table(route, "no route for the documented " .. method .. " " .. path)
      assert.equal(path, route.pattern)
    end
    -- the seed's container protocol (/api/...) is documented in docs/compat.md
    local compat_doc = assert(io.open(src .. "/docs/compat.md")):read("*a"):gsub("{%w+}", "{}")
    local n = 0
    for _, route in ipairs(api.router.routes) do
      n = n + 1
      local seed_path = route.pattern:match("^/v1/sandboxes/{id}(/api/.*)$")
      if seed_path then
        local row = "| `" .. route.method .. " " .. seed_path:gsub("{%w+}", "{}")
        assert.is_truthy(compat_doc:find(row .. "`", 1, true) or compat_doc:find(row .. " ", 1, true),
          route.method .. " " .. route.pattern .. " is not in docs/compat.md")
      else
        assert.is_true(documented[route.method .. " " .. route.pattern], route.method .. " " .. route.pattern ..
          " is not in docs/http-api.md")
      end
    end
    assert.is_true(n >= 35)
  end)

  it("refuses ids holding '/' or '..' and bad sandbox ids with 400 VALIDATION_FAILED", function()
    with_api(function(call, base)
      assert_error(400, "VALIDATION_FAILED", call("GET", "/sessions/.."))
      assert_error(400, "VALIDATION_FAILED", call("DELETE", "/processes/.."))
      assert_error(400, "VALIDATION_FAILED", call("GET", "/sessions/a%2F..%2Fb",
        { rawPath = base .. "/sessions/a%2F..%2Fb" }))
      assert_error(400, "VALIDATION_FAILED", call("POST", "/exec", { body = { command = "true", sessionId = "../x" } }))
      assert_error(400, "VALIDATION_FAILED", call("GET", "/processes", { query = { sessionId = "a/b" } }))
      -- a sessionId in the query and another in the body: refused, not the body's silently
      local st, b = call("POST", "/exec",
        { query = { sessionId = "s1" }, body = { command = "true", sessionId = "s2" } })
      assert_error(400, "VALIDATION_FAILED", st, b)
      assert.equal("sessionId", b.context.field)
      assert_error(400, "VALIDATION_FAILED", request("GET", "/v1/sandboxes/Not-Valid!"))
      assert_error(400, "VALIDATION_FAILED", request("GET", "/v1/sandboxes/..", { rawPath = "/v1/sandboxes/%2E%2E" }))
    end)
  end)
end)

describe("api request checks", function()
  it("answers malformed JSON, non-objects, wrong types and unknown fields with 400", function()
    with_api(function(call)
      for _, case in ipairs {
        { "/exec", "{\"command\": " },
        { "/exec", "[\"true\"]" },
        { "/exec", "\"true\"" },
        { "/exec", "{\"command\": \"true\"} trailing" },
        { "/exec", "{\"command\": \"true\", \"env\": " .. ("["):rep(100) .. ("]"):rep(100) .. "}" },
        { "/exec", "{\"command\": NaN}" },
        { "/exec", "{\"command\": \"sleep 1\", \"timeout\": 1e400}" }, -- (a double's infinity)
        { "/exec", "{\"command\": \"true\", \"env\": {\"A\": [-1e999]}}" },
        { "/exec", { command = 5 } },
        { "/exec", { command = "true", timeout = "soon" } },
        { "/exec", { command = "true", bogus = 1 } },
        { "/exec", { command = "true", env = { ["1BAD"] = "x" } } },
        { "/exec", { command = "true", sessionId = 7 } },
        { "/exec", { command = "true", maxOutputBytes = 1e12 } }, -- past the policy's limit
        { "/exec/stream", { command = "true", maxOutputBytes = 1e12 } },
        { "/exec", {} },
        { "/files/delete", { path = "a", extra = true } },
        { "/files/read", { path = { "a" } } },
        { "/processes/none/wait", { exit = true, pattern = "x" } },
        { "/env", { envVars = "A=1" } },
        { "/sessions", { id = "bad id" } },
      } do
        local status, body = call("POST", case[1], { body = case[2] })
        assert_error(400, "VALIDATION_FAILED", status, body)
      end
    end)
  end)

  it("refuses bodies that are not valid UTF-8, also through escapes, and oversized bodies with 413", function()
    with_api(function(call)
      assert_error(400, "VALIDATION_FAILED", call("POST", "/exec", { body = "{\"command\": \"echo \255\"}" }))
      assert_error(400, "VALIDATION_FAILED", call("POST", "/exec", { body = "{\"command\": \"echo \\ud800\"}" }))
      assert_error(400, "VALIDATION_FAILED", call("POST", "/exec", { body = "{\"\192\": 1}" }))
      assert_error(400, "VALIDATION_FAILED", call("POST", "/files/write",
        { body = { path = "nul", content = "x", encoding = "base64!" } }))
      assert_error(400, "VALIDATION_FAILED", call("POST", "/files/write", { body = { path = "a\0b", content = "x" } }))
    end)
    with_api(function(call)
      local status, body = call("POST", "/exec", { body = { command = "echo " .. ("x"):rep(2000) } })
      assert_error(413, "REQUEST_TOO_LARGE", status, body)
      assert.equal(1024, body.context.limit)
      assert.equal(200, (call("POST", "/exec", { body = { command = "true" } })))
    end, { home = home, maxBodyBytes = 1024 })
  end)

  it("gives every error code the Lua layer raises a status, 500 only for runtime failures", function()
    -- every code the Lua layer raises: errors.raise/new/check("CODE", ...),
    -- the errno table of files/paths.lua and git's mapped codes (files/git.lua)
    local codes = {}
    local src = os.getenv("MOONBOX_SOURCE_DIR") or "."
    local listing = helper.sh("grep -rhoE '(raise|errors\\.new|errors\\.check)\\(\"[A-Z][A-Z_]+\"' " .. src ..
      "/lua/moonbox --include=*.lua --exclude-dir=server; " ..
      "grep -hoE 'return \"[A-Z][A-Z_]+\"' " .. src .. "/lua/moonbox/files/git.lua")
    for code in listing:gmatch('"([A-Z_]+)"') do codes[code] = true end
    for _, code in pairs(require("moonbox.files").code_for_errno) do codes[code] = true end
    local runtime_failures = { INTERNAL_ERROR = true, FILESYSTEM_ERROR = true, SHELL_START_FAILED = true,
      GIT_CLONE_FAILED = true, DEADLOCK = true, NOT_IN_TASK = true, BACKUP_CREATE_FAILED = true,
      BACKUP_RESTORE_FAILED = true, POLICY_ERROR = true }
    local n = 0
    for code in pairs(codes) do
      n = n + 1
      assert.is_number(api_errors.STATUS[code], "no HTTP status for " .. code)
      if api_errors.STATUS[code] == 500 then assert.is_true(runtime_failures[code], code .. " maps to 500") end
    end
    assert.is_true(n >= 25, "found only " .. n .. " codes")
    assert.equal(404, api_errors.status("SESSION_NOT_FOUND"))
    assert.equal(409, api_errors.status("SESSION_ALREADY_EXISTS"))
    assert.equal(403, api_errors.status("POLICY_DENIED"))
    assert.equal(413, api_errors.status("FILE_TOO_LARGE"))
    -- the codes of issue #14: a hook that throws is the server's failure, a
    -- missing sandbox is not found, a held one conflicts, isolation the host
    -- lacks is lasting (not 503), a rebuilt sandbox can be retried (503)
    assert.equal(500, api_errors.status("POLICY_ERROR"))
    assert.equal(404, api_errors.status("SANDBOX_NOT_FOUND"))
    assert.equal(409, api_errors.status("SANDBOX_IN_USE"))
    assert.equal(501, api_errors.status("ISOLATION_UNAVAILABLE"))
    assert.equal(503, api_errors.status("SANDBOX_RESTARTED"))
    -- the same codes from a failure of the moment (out of fds) can be retried
    local tstatus, tbody = api_errors.body(require("moonbox.errors").new("ISOLATION_UNAVAILABLE",
      "cannot create the sandbox's namespaces: too many open files", { errno = "EMFILE" }))
    assert.same({ 503, 503, "ISOLATION_UNAVAILABLE" }, { tstatus, tbody.httpStatus, tbody.code })
    assert.equal(501, (api_errors.body(require("moonbox.errors").new("ISOLATION_UNAVAILABLE", "no userns",
      { errno = "EPERM" }))))
    local pstatus, pbody = api_errors.body(require("moonbox.errors").new("POLICY_ERROR",
      "policy hook onExec failed: boom", { hook = "onExec" }))
    assert.same({ 500, "POLICY_ERROR", 500, "onExec" }, { pstatus, pbody.code, pbody.httpStatus, pbody.context.hook })
    -- anything that is not one of our error tables is a bug: 500 without details
    local status, body = api_errors.body("attempt to index a nil value")
    assert.equal(500, status)
    assert.same({ code = "INTERNAL_ERROR", message = "internal error", context = {}, httpStatus = 500 }, body)
  end)

  it("refuses to bring more than maxSandboxes sandboxes into being (403), and serves those it has", function()
    local live = 0
    for _ in pairs(require("moonbox.sandbox").all()) do live = live + 1 end
    with_api(function(call, _, id)
      assert.equal(200, (call("GET", "")))
      local status, body = request("POST", "/v1/sandboxes/" .. id .. "-other/exec", { body = { command = "true" } })
      assert_error(403, "POLICY_DENIED", status, body)
      assert.is_nil(require("moonbox.sandbox").all()[id .. "-other"])
      assert.equal(200, (call("POST", "/exec", { body = { command = "true" } })))
    end, { home = home, maxSandboxes = live + 1 })
  end)

  it("answers POLICY_DENIED with 403", function()
    with_api(function(call)
      assert_error(403, "POLICY_DENIED", call("POST", "/exec", { body = { command = "rm -rf /" } }))
      assert.equal(200, (call("POST", "/exec", { body = { command = "true" } })))
    end, { home = home, policy = { hooks = { onExec = function(_, command)
      if command:match("rm") then return nil, "no rm" end
      return command
    end } } })
  end)

  it("answers a hook that throws or returns a wrong type with 500 POLICY_ERROR naming the hook", function()
    local ran = helper.mkdtemp()
    with_api(function(call)
      local status, body = call("POST", "/exec", { body = { command = "explode" } })
      assert_error(500, "POLICY_ERROR", status, body)
      assert.equal("onExec", body.context.hook)
      assert.truthy(body.message:find("onExec", 1, true), body.message)
      assert.truthy(body.message:find("hook exploded", 1, true), body.message)
      -- a wrong type is the hook's bug, never an allow: the command never runs
      status, body = call("POST", "/exec", { body = { command = "touch " .. ran .. "/ran" } })
      assert_error(500, "POLICY_ERROR", status, body)
      assert.equal("onExec", body.context.hook)
      assert.truthy(body.message:find("onExec", 1, true), body.message)
      status, body = call("POST", "/files/write", { body = { path = "f.txt", content = "x" } })
      assert_error(500, "POLICY_ERROR", status, body)
      assert.equal("onFile", body.context.hook)
      assert.truthy(body.message:find("onFile", 1, true), body.message)
      assert.equal(200, (call("POST", "/exec", { body = { command = "true" } })))
    end, { home = home, policy = { hooks = {
      onExec = function(_, command)
        if command == "explode" then error("hook exploded") end
        if command:find("touch", 1, true) then return 42 end
        return true
      end,
      onFile = function(_, op, path) if op == "writeFile" then error({ "hook exploded" }) end return path end,
    } } })
    assert.equal("", helper.sh("ls -A " .. ran))
    os.execute("rm -rf " .. ran)
  end)
end)

describe("api sessions", function()
  it("resumes a session across two requests, like the seed's getSession example", function()
    with_api(function(call)
      local status, body = call("POST", "/sessions",
        { body = { id = "build", env = { MODE = "prod", GONE = cjson.null } } })
      assert.equal(200, status)
      assert.same({ "build", "build", true }, { body.id, body.sessionId, body.success })
      assert.equal(200, (call("POST", "/exec", { body = { sessionId = "build",
        command = "mkdir -p repo && cd repo && export BUILT=yes" } })))
      -- second request
      status, body = call("GET", "/sessions/build")
      assert.equal(200, status)
      assert.equal("/workspace/repo", body.cwd)
      status, body = call("POST", "/exec", { body = { sessionId = "build",
        command = "basename $PWD; echo $MODE $BUILT ${GONE-unset}" } })
      assert.equal(200, status)
      assert.equal("repo\nprod yes unset\n", body.stdout)
      assert.equal(0, body.exitCode)
      assert.is_true(body.success)
      assert.equal("build", body.sessionId)
    end)
  end)

  it("lists sessions as an array (also when empty), and answers 404, 409 and 400 as the Lua calls raise", function()
    with_api(function(call)
      local status, _, _, raw = call("GET", "/sessions")
      assert.equal(200, status)
      assert.equal("[]\n", raw)
      assert_error(404, "SESSION_NOT_FOUND", call("GET", "/sessions/nope"))
      assert_error(404, "SESSION_NOT_FOUND", call("DELETE", "/sessions/nope"))
      assert_error(404, "SESSION_NOT_FOUND", call("POST", "/exec", { body = { command = "true", sessionId = "nope" } }))
      assert.equal(200, (call("POST", "/sessions", { body = { id = "a" } })))
      assert_error(409, "SESSION_ALREADY_EXISTS", call("POST", "/sessions", { body = { id = "a" } }))
      assert_error(400, "VALIDATION_FAILED", call("POST", "/sessions", { body = { cwd = "/workspace/missing" } }))
      -- deleting the default session resets it (none made yet: nothing to kill, nothing created)
      status = call("DELETE", "/sessions/default")
      assert.equal(200, status)
      assert.same({ "a" }, select(2, call("GET", "/sessions")))
      local body
      status, body = call("DELETE", "/sessions/a")
      assert.equal(200, status)
      assert.same({ true, "a" }, { body.success, body.sessionId })
      assert_error(404, "SESSION_NOT_FOUND", call("GET", "/sessions/a"))
    end)
  end)

  it("sets env at sandbox level, or in one session with sessionId; null unsets", function()
    with_api(function(call)
      call("POST", "/sessions", { body = { id = "s" } })
      assert.equal(200, (call("POST", "/env", { body = { envVars = { A = "sb", B = "b" } } })))
      local status, body = call("POST", "/env",
        { body = { envVars = { A = "session", B = cjson.null }, sessionId = "s" } })
      assert.equal(200, status)
      assert.equal("s", body.sessionId)
      assert.equal("sb b\n", select(2, call("POST", "/exec", { body = { command = "echo $A $B" } })).stdout)
      assert.equal("session unset\n", select(2, call("POST", "/exec",
        { body = { command = "echo $A ${B-unset}", sessionId = "s" } })).stdout)
      -- a session created later gets the sandbox level
      call("POST", "/sessions", { body = { id = "later" } })
      local _, r = call("POST", "/exec", { body = { command = "echo $A", sessionId = "later" } })
      assert.equal("sb\n", r.stdout)
    end)
  end)
end)

describe("api exec", function()
  it("runs strings and argv arrays with env, cwd, stdin and timeout, and base64-encodes non-UTF-8 output", function()
    with_api(function(call)
      call("POST", "/files/mkdir", { body = { path = "/workspace/sub" } })
      local _, r = call("POST", "/exec", { body = { command = "cat; echo $X; basename $PWD", stdin = "in\n",
        env = { X = "x" }, cwd = "sub" } })
      assert.equal("in\nx\nsub\n", r.stdout)
      assert.is_nil(r.stdoutEncoding)
      _, r = call("POST", "/exec", { body = { command = { "printf", "%s", "a b" } } })
      assert.equal("a b", r.stdout)
      _, r = call("POST", "/exec", { body = { command = "printf '\\377\\000x'; echo err >&2; exit 3" } })
      assert.equal("base64", r.stdoutEncoding)
      assert.equal("\255\0x", core.base64_decode(r.stdout))
      assert.equal("err\n", r.stderr)
      assert.same({ 3, false }, { r.exitCode, r.success })
      _, r = call("POST", "/exec", { body = { command = "sleep 5", timeout = 100 } })
      assert.same({ true, 124 }, { r.timedOut, r.exitCode })
      _, r = call("POST", "/exec", { body = { command = "printf 12345678", maxOutputBytes = 4 } })
      assert.same({ "1234", true }, { r.stdout, r.truncated })
    end)
  end)

  it("sends big output from the runtime's buffers in slices: exact bytes, escaped or base64, length exact", function()
    with_api(function(_, base)
      local function sliced(command)
        local r = api.handle({ method = "POST", path = base .. "/exec", query = {}, headers = {},
          body = cjson.encode { command = command } }, fake_res())
        assert.equal(200, r.status)
        assert.equal("table", type(r.body), "a body in slices")
        local length = r.body.measure() -- (as the sender does: before the pieces)
        local pieces = {}
        for piece in r.body.pieces do pieces[#pieces + 1] = piece end
        local text = table.concat(pieces)
        r.body.release()
        assert.equal(length, #text)
        return cjson.decode(text)
      end
      -- 300 KiB of text that needs escapes, stderr small
      local r = sliced([[for i in $(seq 1 30720); do printf 'a\001"\\\n\t'; done; echo e >&2]])
      assert.equal(("a\1\"\\\n\t"):rep(30720), r.stdout)
      assert.same({ "e\n", 0 }, { r.stderr, r.exitCode })
      assert.is_nil(r.stdoutEncoding)
      -- 200 001 bytes that are not UTF-8 (not a multiple of 3: the base64 tail)
      r = sliced("head -c 200001 /dev/zero | tr '\\0' '\\377'")
      assert.equal("base64", r.stdoutEncoding)
      assert.equal(("\255"):rep(200001), core.base64_decode(r.stdout))
    end)
  end)

  it("streams execStream events as SSE: start, chunks, one complete", function()
    with_api(function(call)
      local status, events, headers, res = call("POST", "/exec/stream",
        { body = { command = "echo one; echo two >&2; printf '\\377'; exit 4" } })
      assert.equal(200, status)
      assert.equal("text/event-stream; charset=utf-8", headers["content-type"])
      assert.is_true(res.finished)
      assert.equal("start", events[1].type)
      assert.equal("default", events[1].sessionId)
      local out, err, completes = {}, {}, 0
      for _, ev in ipairs(events) do
        if ev.type == "stdout" then
          out[#out + 1] = ev.encoding == "base64" and core.base64_decode(ev.data) or ev.data
        elseif ev.type == "stderr" then
          err[#err + 1] = ev.data
        elseif ev.type == "complete" then
          completes = completes + 1
        end
      end
      assert.equal("one\n\255", table.concat(out))
      assert.equal("two\n", table.concat(err))
      assert.equal(1, completes)
      local last = events[#events]
      assert.same({ "complete", 4, false }, { last.type, last.exitCode, last.timedOut })
    end)
  end)

  it("answers a bad streamed command with a JSON error before any stream starts", function()
    with_api(function(call)
      local status, body = call("POST", "/exec/stream", { body = { command = "  " } })
      assert_error(400, "VALIDATION_FAILED", status, body)
    end)
  end)

  it("kills a streamed command's whole tree when its client goes away, and the session goes on", function()
    with_api(function(call, _, id)
      call("POST", "/sessions", { body = { id = "s", env = { KEEP = "kept" } } })
      local seen = {}
      local status, events, _, res = call("POST", "/exec/stream", {
        body = { sessionId = "s", command = "sleep 300 & echo bg=$!; setsid sleep 300 & echo sid=$!; sleep 300" },
        on_write = function(res, data)
          seen[#seen + 1] = data
          if table.concat(seen):find("sid=%d+") then res:disconnect() end
        end,
      })
      assert.equal(200, status)
      assert.is_nil(res.finished)
      local text = table.concat(seen)
      local bg, sid = tonumber(text:match("bg=(%d+)")), tonumber(text:match("sid=(%d+)"))
      assert.is_number(bg)
      assert.is_number(sid)
      -- the handler returned only once the command's processes were gone
      -- (pids as the sandbox sees them: look in its /proc)
      local sb = moonbox.getSandbox(id)
      assert.is_false(helper.pid_alive(bg, sb))
      assert.is_false(helper.pid_alive(sid, sb))
      for _, ev in ipairs(events) do assert.are_not.equal("complete", ev.type) end
      local _, r = call("POST", "/exec", { body = { sessionId = "s", command = "echo $KEEP" } })
      assert.equal("kept\n", r.stdout)
    end)
  end)

  it("drops a streamed command whose client went away before it started", function()
    with_api(function(call)
      local first = moonbox.spawn(function()
        return select(2, call("POST", "/exec", { body = { command = "sleep 0.3; echo first" } }))
      end)
      local res = fake_res()
      res.closed = true -- gone before the stream could start
      local status = call("POST", "/exec/stream", { body = { command = "touch never-ran" }, res = res })
      assert.equal(200, status)
      assert.equal("first\n", first:wait().stdout)
      local _, r = call("POST", "/files/exists", { body = { path = "never-ran" } })
      assert.is_false(r.exists)
    end)
  end)
end)

describe("api processes", function()
  it("starts, lists, reads logs, waits for a log line and the exit, and answers 404 for unknown ids", function()
    with_api(function(call)
      local status, p = call("POST", "/processes", { body = {
        command = "echo ready; read line; echo got $line; exit 2", processId = "job", stdin = "x\n" } })
      assert.equal(200, status)
      assert.same({ "job", "running", "default" }, { p.id, p.status, p.sessionId })
      assert.is_number(p.pid)
      local _, w = call("POST", "/processes/job/wait", { body = { pattern = "got %w+", timeout = 5000 } })
      assert.same({ "got x", "got x", "job" }, { w.line, w.match, w.processId })
      _, w = call("POST", "/processes/job/wait", { body = { exit = true, timeout = 5000 } })
      assert.same({ 2, "failed" }, { w.exitCode, w.status })
      local _, list = call("GET", "/processes")
      assert.equal(1, #list)
      assert.same({ "job", "failed", 2 }, { list[1].id, list[1].status, list[1].exitCode })
      assert.is_nil(list[1]._logs)
      local _, logs = call("GET", "/processes/job/logs")
      assert.same({ "ready\ngot x\n", "", "job" }, { logs.stdout, logs.stderr, logs.processId })
      assert_error(404, "PROCESS_NOT_FOUND", call("GET", "/processes/nope"))
      assert_error(404, "PROCESS_NOT_FOUND", call("DELETE", "/processes/nope"))
      assert_error(404, "PROCESS_NOT_FOUND", call("GET", "/processes/nope/logs"))
      assert_error(404, "PROCESS_NOT_FOUND", call("GET", "/processes/nope/logs/stream"))
      assert_error(404, "PROCESS_NOT_FOUND", call("POST", "/processes/nope/wait", { body = { exit = true } }))
      assert_error(409, "PROCESS_EXITED_BEFORE_READY", call("POST", "/processes/job/wait",
        { body = { pattern = "never" } }))
    end)
  end)

  it("answers a malformed log pattern 400 at once and an expensive one 400, and returns captures", function()
    with_api(function(call)
      call("POST", "/processes", { body = { command = "echo port=8080; printf '%040d' 0 | tr 0 a; exec sleep 300",
        processId = "srv" } })
      local status, w = call("POST", "/processes/srv/wait", { body = { pattern = "port=(%d+)", timeout = 5000 } })
      assert.equal(200, status)
      assert.same({ "port=8080", { "8080" } }, { w.match, w.captures })
      -- no timeout: only the up-front check keeps this from waiting forever
      local _, body = call("POST", "/processes/srv/wait", { body = { pattern = "([" } })
      assert_error(400, "VALIDATION_FAILED", call("POST", "/processes/srv/wait", { body = { pattern = "([" } }))
      assert.truthy(body.message:find("malformed pattern", 1, true), body.message)
      status, body = call("POST", "/processes/srv/wait", { body = { pattern = ("a*"):rep(8) .. "b", timeout = 60000 } })
      assert_error(400, "VALIDATION_FAILED", status, body)
      assert.truthy(body.message:find("too expensive", 1, true), body.message)
      -- the sandbox answers as before
      status, w = call("POST", "/exec", { body = { command = "true" } })
      assert.same({ 200, 0 }, { status, w.exitCode })
    end)
  end)

  it("kills one process with ?signal= and all with DELETE /processes", function()
    with_api(function(call)
      call("POST", "/processes", { body = { command = "sleep 300", processId = "a" } })
      call("POST", "/processes", { body = { command = "sleep 300", processId = "b" } })
      call("POST", "/processes", { body = { command = "sleep 300", processId = "c" } })
      local status, k = call("DELETE", "/processes/a", { query = { signal = "SIGKILL" } })
      assert.equal(200, status)
      assert.same({ true, "a", "SIGKILL" }, { k.success, k.processId, k.signal })
      local _, w = call("POST", "/processes/a/wait", { body = { exit = true, timeout = 5000 } })
      assert.same({ 137, "killed" }, { w.exitCode, w.status })
      assert_error(400, "VALIDATION_FAILED", call("DELETE", "/processes/b", { query = { signal = "SIGNOPE" } }))
      local _, all = call("DELETE", "/processes", { query = { signal = "9" } })
      assert.equal(2, all.count)
      _, w = call("POST", "/processes/c/wait", { body = { exit = true, timeout = 5000 } })
      assert.equal("killed", w.status)
      call("POST", "/processes/b/wait", { body = { exit = true, timeout = 5000 } })
      -- the three ended: their records go
      call("POST", "/processes", { body = { command = "sleep 300", processId = "d" } })
      local c
      status, c = call("POST", "/processes/cleanup")
      assert.equal(200, status)
      assert.same({ true, 3 }, { c.success, c.count })
      local _, list = call("GET", "/processes")
      assert.same({ "d" }, { list[1].id, list[2] })
      assert_error(404, "PROCESS_NOT_FOUND", call("GET", "/processes/a"))
      assert_error(400, "VALIDATION_FAILED", call("POST", "/processes/cleanup", { body = { nope = 1 } }))
    end)
  end)

  it("streams logs as SSE (replay, then live, then exit); a client that leaves stops only its stream", function()
    with_api(function(call)
      call("POST", "/processes", { body = { command = "echo one; sleep 0.2; echo two", processId = "p" } })
      local status, events = call("GET", "/processes/p/logs/stream")
      assert.equal(200, status)
      local text = {}
      for _, ev in ipairs(events) do if ev.type == "stdout" then text[#text + 1] = ev.data end end
      assert.equal("one\ntwo\n", table.concat(text))
      assert.same({ "exit", 0, "p" }, { events[#events].type, events[#events].exitCode, events[#events].processId })

      call("POST", "/processes", { body = { command = "echo started; exec sleep 300", processId = "long" } })
      call("POST", "/processes/long/wait", { body = { pattern = "started" } })
      local res, _
      status, events, _, res = call("GET", "/processes/long/logs/stream", {
        on_write = function(r) r:disconnect() end })
      assert.equal(200, status)
      assert.is_nil(res.finished)
      assert.equal(1, #events)
      local _, p = call("GET", "/processes/long")
      assert.equal("running", p.status)
    end)
  end)

  it("gives up a wait whose client went away", function()
    with_api(function(call)
      call("POST", "/processes", { body = { command = "exec sleep 300", processId = "p" } })
      local res = fake_res()
      local waiting = moonbox.spawn(function()
        return call("POST", "/processes/p/wait", { body = { pattern = "never printed" }, res = res })
      end)
      moonbox.sleep(50)
      assert.equal("running", waiting:status())
      res:disconnect()
      local status, body = waiting:wait()
      assert.equal(499, status) -- nobody reads it: the wait was cancelled
      assert.equal("CANCELLED", body.code)
    end)
  end)
end)

describe("api files", function()
  it("writes, reads, lists, renames, moves, checks and deletes with the Lua results", function()
    with_api(function(call)
      local status, r = call("POST", "/files/mkdir", { body = { path = "/workspace/d/e", recursive = true } })
      assert.equal(200, status)
      assert.same({ true, "/workspace/d/e", true }, { r.success, r.path, r.recursive })
      local _, empty, _, raw = call("POST", "/files/list", { body = { path = "/workspace/d/e" } })
      assert.equal(0, empty.count)
      assert.truthy(raw:find('"files":[]', 1, true))
      _, r = call("POST", "/files/write", { body = { path = "d/a.txt", content = "hello" } })
      assert.same({ true, "/workspace/d/a.txt" }, { r.success, r.path })
      _, r = call("POST", "/files/read", { body = { path = "/workspace/d/a.txt" } })
      assert.same({ "hello", "utf-8", false, 5 }, { r.content, r.encoding, r.isBinary, r.size })
      call("POST", "/files/write", { body = { path = "d/bin", content = core.base64_encode("\0\1\255"),
        encoding = "base64" } })
      _, r = call("POST", "/files/read", { body = { path = "d/bin" } })
      assert.same({ "base64", true, "\0\1\255" }, { r.encoding, r.isBinary, core.base64_decode(r.content) })
      _, r = call("POST", "/files/rename", { body = { path = "d/a.txt", newPath = "d/b.txt" } })
      assert.same({ "/workspace/d/a.txt", "/workspace/d/b.txt" }, { r.path, r.newPath })
      _, r = call("POST", "/files/move", { body = { sourcePath = "d/b.txt", destinationPath = "d/e" } })
      assert.equal("/workspace/d/e/b.txt", r.newPath)
      _, r = call("POST", "/files/list", { body = { path = "d", recursive = true } })
      local names = {}
      for _, f in ipairs(r.files) do names[#names + 1] = f.relativePath .. ":" .. f.type end
      assert.same({ "bin:file", "e:directory", "e/b.txt:file" }, names)
      assert.is_false(r.truncated)
      _, r = call("POST", "/files/list", { body = { path = "d", recursive = true, limit = 2 } })
      assert.same({ 2, true, "e" }, { r.count, r.truncated, r.files[2].name })
      assert_error(400, "VALIDATION_FAILED", call("POST", "/files/list", { body = { path = "d", limit = 0 } }))
      _, r = call("POST", "/files/exists", { body = { path = "d/e/b.txt" } })
      assert.is_true(r.exists)
      _, r = call("POST", "/files/delete", { body = { path = "d/e/b.txt" } })
      assert.is_true(r.success)
      _, r = call("POST", "/files/exists", { body = { path = "d/e/b.txt" } })
      assert.is_false(r.exists)
    end)
  end)

  it("answers FILE_NOT_FOUND 404, IS_DIRECTORY 400, FILE_EXISTS 409, PATH_OUTSIDE_SANDBOX 403, " ..
    "FILE_TOO_LARGE 413", function()
    with_api(function(call)
      assert_error(404, "FILE_NOT_FOUND", call("POST", "/files/read", { body = { path = "missing" } }))
      assert_error(404, "FILE_NOT_FOUND", call("GET", "/files/stream", { query = { path = "missing" } }))
      call("POST", "/files/mkdir", { body = { path = "dir" } })
      assert_error(400, "IS_DIRECTORY", call("POST", "/files/delete", { body = { path = "dir" } }))
      assert_error(409, "FILE_EXISTS", call("POST", "/files/mkdir", { body = { path = "dir" } }))
      assert_error(403, "PATH_OUTSIDE_SANDBOX",
        call("POST", "/files/read", { body = { path = "../../../etc/passwd" } }))
      call("POST", "/files/write", { body = { path = "big", content = ("x"):rep(4096) } })
      assert_error(413, "FILE_TOO_LARGE", call("POST", "/files/read", { body = { path = "big" } }))
      assert_error(400, "VALIDATION_FAILED", call("GET", "/files/stream"))
      assert_error(400, "VALIDATION_FAILED",
        call("GET", "/files/watch", { query = { path = "dir", recursive = "maybe" } }))
    end, { home = home, limits = { maxFileBytes = 1024 } })
  end)

  it("takes a raw body with PUT /files/raw and streams raw bytes with GET /files/stream", function()
    with_api(function(call)
      local bytes = {}
      for i = 0, 255 do bytes[#bytes + 1] = string.char(i) end
      local content = table.concat(bytes):rep(1024) -- 256 KiB: several chunks
      local status, r = call("PUT", "/files/raw", { query = { path = "raw.bin" }, body = content })
      assert.equal(200, status)
      assert.equal("/workspace/raw.bin", r.path)
      local got, headers
      status, got, headers = call("GET", "/files/stream", { query = { path = "raw.bin" } })
      assert.equal(200, status)
      assert.equal("application/octet-stream", headers["content-type"])
      assert.equal(#content, #got)
      assert.is_true(got == content)
      -- a client that leaves mid-file: the file is closed, nothing else written
      local res, _
      status, got, _, res = call("GET", "/files/stream", { query = { path = "raw.bin" },
        on_write = function(rs) rs:disconnect() end })
      assert.equal(200, status)
      assert.equal(64 * 1024, #got)
      assert.is_nil(res.finished)
    end)
  end)

  it("streams watch events as SSE and stops watching when the client goes away", function()
    with_api(function(call)
      call("POST", "/files/mkdir", { body = { path = "w" } })
      local res = fake_res(function(r, data)
        if data:find("seen.txt", 1, true) then r:disconnect() end
      end)
      local watcher = moonbox.spawn(function()
        return call("GET", "/files/watch", { query = { path = "w", recursive = "true" }, res = res })
      end)
      -- the watch is in place once the stream has started
      while not res.status do moonbox.sleep(5) end
      assert.equal(200, res.status)
      call("POST", "/files/write", { body = { path = "w/seen.txt", content = "x" } })
      local status, events = watcher:wait()
      assert.equal(200, status)
      local ev = events[1]
      assert.same({ "create", "/workspace/w/seen.txt", false }, { ev.type, ev.path, ev.isDirectory })
    end)
  end)
end)

describe("api code contexts", function()
  it("creates, lists, runs in and deletes a context; CONTEXT_NOT_FOUND is 404", function()
    with_api(function(call)
      local _, _, _, raw = call("GET", "/contexts")
      assert.equal("[]\n", raw)
      local status, c = call("POST", "/contexts", { body = { language = "lua", id = "calc" } })
      assert.equal(200, status)
      assert.same({ "calc", "lua" }, { c.id, c.language })
      local _, list = call("GET", "/contexts")
      assert.equal("calc", list[1].id)
      local _, r = call("POST", "/code", { body = { code = "x = 20\nprint('hi')", context = "calc" } })
      assert.same({ "hi\n" }, r.logs.stdout)
      _, r, _, raw = call("POST", "/code", { body = { code = "x + 1", context = "calc" } })
      assert.equal("21", r.results[1].text)
      assert.truthy(raw:find('"stderr":[]', 1, true))
      -- output that is not UTF-8: the array in base64, and a sibling says so
      _, r = call("POST", "/code", { body = { code = "io.write('\\255ok')", context = "calc" } })
      assert.equal("base64", r.logs.stdoutEncoding)
      assert.equal("\255ok", core.base64_decode(r.logs.stdout[1]))
      assert.is_nil(r.logs.stderrEncoding)
      local events
      status, events = call("POST", "/code/stream", { body = { code = "print('a')\nx", context = "calc" } })
      assert.equal(200, status)
      -- output and results come on separate pipes: their order may differ
      local by_type = {}
      for _, ev in ipairs(events) do by_type[ev.type] = ev end
      assert.equal(3, #events)
      assert.equal("complete", events[3].type)
      assert.equal("a\n", by_type.stdout.text)
      assert.equal("20", by_type.result.result.text)
      status, r = call("DELETE", "/contexts/calc")
      assert.same({ 200, true, "calc" }, { status, r.success, r.contextId })
      assert_error(404, "CONTEXT_NOT_FOUND", call("DELETE", "/contexts/calc"))
      assert_error(404, "CONTEXT_NOT_FOUND", call("POST", "/code", { body = { code = "1", context = "calc" } }))
    end)
  end)
end)

describe("api sandbox", function()
  it("reports info and destroys the sandbox with everything in it", function()
    with_api(function(call, _, id)
      local status, info, _, raw = call("GET", "")
      assert.equal(200, status)
      assert.equal(id, info.id)
      assert.truthy(raw:find('"namespaces":[', 1, true)) -- an array, even when empty
      local _, p = call("POST", "/processes", { body = { command = "exec sleep 300" } })
      local r
      status, r = call("DELETE", "")
      assert.same({ 200, true }, { status, r.success })
      assert.is_false(helper.pid_alive(p.pid))
      -- a read does not bring it back; the next write makes a fresh sandbox
      assert_error(404, "SANDBOX_NOT_FOUND", call("GET", "/processes"))
      assert_error(404, "SANDBOX_NOT_FOUND", call("GET", ""))
      assert_error(404, "SANDBOX_NOT_FOUND", call("DELETE", ""))
      assert.is_nil(require("moonbox.sandbox").all()[id])
      assert.equal(200, (call("POST", "/exec", { body = { command = "true" } })))
      local _, list = call("GET", "/processes")
      assert.same({}, list)
    end)
  end)

  it("lists the sandboxes it holds; reads and DELETE of an unknown one are 404 and create nothing", function()
    with_api(function(call, base, id)
      local ghost = id .. "-ghost"
      for _, r in ipairs { { "GET", "" }, { "GET", "/sessions" }, { "GET", "/processes" }, { "GET", "/contexts" },
          { "GET", "/files/stream?path=/x" }, { "GET", "/processes/p1/logs" }, { "DELETE", "" },
          { "DELETE", "/sessions/s1" }, { "DELETE", "/processes" } } do
        local path, q = r[2]:match("^([^?]*)%??(.*)$")
        local query = {}
        for k, v in q:gmatch("(%w+)=([^&]*)") do query[k] = v end
        assert_error(404, "SANDBOX_NOT_FOUND", request(r[1], "/v1/sandboxes/" .. ghost .. path, { query = query }))
      end
      assert.is_nil(require("moonbox.sandbox").all()[ghost])
      assert.is_nil(io.open(home .. "/sandboxes/" .. ghost), "a read made the sandbox's directory")
      local _, p = call("POST", "/processes", { body = { command = "exec sleep 300" } })
      assert.equal(200, (call("POST", "/sessions", { body = { id = "two" } })))
      local status, list, _, raw = request("GET", "/v1/sandboxes")
      assert.equal(200, status)
      assert.equal("[", raw:sub(1, 1))
      local mine
      for _, sb in ipairs(list) do if sb.id == id then mine = sb end end
      assert.is_table(mine, "the sandbox is not listed")
      assert.same({ 2, 1 }, { mine.sessions, mine.processes }) -- default (made by startProcess) and two
      assert.matches("^%d%d%d%d%-%d%d%-%d%dT%d%d:%d%d:%d%d%.%d%d%dZ$", mine.created)
      assert.is_true(mine.lastUsed >= mine.created)
      assert.equal(require("moonbox.sandbox").all()[id].isolation, mine.isolation)
      assert.equal(200, (call("DELETE", "/processes/" .. p.id, { query = { signal = "SIGKILL" } })))
      assert.equal(base, "/v1/sandboxes/" .. id)
    end)
  end)

  it("hands the terminal route to moonbox.server.terminal_ws with the sandbox and session ids", function()
    local saved = package.loaded["moonbox.server.terminal_ws"]
    local got
    package.loaded["moonbox.server.terminal_ws"] = {
      precheck = function() return nil end,
      handle = function(req, _, id, session_id)
        got = { req.method, id, session_id }
        return { status = 426, headers = {}, body = "" }
      end,
    }
    local ok, err = pcall(with_api, function(call, _, id)
      local status = call("GET", "/sessions/build/terminal")
      assert.equal(426, status)
      assert.same({ "GET", id, "build" }, got)
      assert_error(400, "VALIDATION_FAILED", call("GET", "/sessions/../terminal"))
    end)
    package.loaded["moonbox.server.terminal_ws"] = saved
    if not ok then error(err, 0) end
  end)

  it("makes no sandbox for a read or DELETE of the seed's protocol: the empty sandbox's answer", function()
    run_task(function()
      local base = ("/v1/sandboxes/api-seedread-%d"):format(core.getpid())
      local status, body = request("GET", base .. "/api/process/list")
      assert.same({ 200, 0 }, { status, body.count })
      status, body = request("GET", base .. "/api/contexts")
      assert.same({ 200, 0 }, { status, #body.contexts })
      status, body = request("DELETE", base .. "/api/process/kill-all")
      assert.same({ 200, 0 }, { status, body.killedCount })
      assert.equal(404, (request("GET", base .. "/api/process/p1")))
      assert.equal(404, (request("DELETE", base .. "/api/process/p1")))
      assert.equal(404, (request("GET", base .. "/api/process/p1/logs")))
      assert.equal(404, (request("DELETE", base .. "/api/contexts/c1")))
      assert.equal(200, (request("GET", base .. "/api/ping")))
      -- the one read only the sandbox's shell could answer
      assert_error(404, "SANDBOX_NOT_FOUND", request("GET", base .. "/api/commands"))
      assert_error(404, "SANDBOX_NOT_FOUND", request("GET", base)) -- none was made
    end)
  end)

  it("makes no sandbox for a terminal request it refuses, nor for a session a new sandbox cannot have", function()
    run_task(function()
      local base = ("/v1/sandboxes/api-term-%d"):format(core.getpid())
      local status, body = request("GET", base .. "/sessions/default/terminal") -- no upgrade
      assert.equal(426, status)
      assert.is_table(body.context)
      status = request("GET", base .. "/sessions/default/terminal", { websocket = true, query = { cols = "0" } })
      assert.equal(400, status)
      -- an unknown query parameter, as on every other route
      local _, refused = request("GET", base .. "/sessions/default/terminal",
        { websocket = true, query = { bogus = "1" } })
      assert.same({ "VALIDATION_FAILED", "bogus" }, { refused.code, refused.context.field })
      assert_error(404, "SANDBOX_NOT_FOUND", request("GET", base .. "/sessions/build/terminal", { websocket = true }))
      assert_error(404, "SANDBOX_NOT_FOUND", request("GET", base))
    end)
  end)
end)
