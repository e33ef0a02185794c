-- The /v1 API over real HTTP: moonbox.server.http listening on a loopback
-- port with api.handle, driven by curl. curl runs as a child on the loop
-- (not through a blocking popen): the server answers on this same loop.
local core = require "moonbox.core"
local async = require "moonbox.async"
local moonbox = require "moonbox"
local cjson = require "cjson"
local http = require "moonbox.server.http"
local api = require "moonbox.server.api"

local home = helper.mkdtemp()
local PATH = "/usr/local/bin:/usr/bin:/bin"
local seq = 0

-- Start curl; returns proc, its stdout stream, and wait() -> exit code.
local function start_curl(args)
  local exit = {}
  local argv = { "curl", "-sS", "--path-as-is" }
  for _, a in ipairs(args) do argv[#argv + 1] = a end
  local proc, pipes = core.spawn {
    args = argv, env = { PATH = PATH }, stdio = { [0] = "null", [1] = "pipe", [2] = "null" },
    on_exit = function(code)
      exit.code = code
      if exit.resume then exit.resume() end
    end,
  }
  assert(proc, pipes)
  local function wait()
    if exit.code == nil then
      async.await(function(resume) exit.resume = resume end)
    end
    return exit.code
  end
  return proc, pipes[1], wait
end

-- curl(args...) -> status, headers, body (headers with lowercase names)
local function curl(...)
  local _, out, wait = start_curl { "-i", ... }
  local text = helper.read_all(out)
  out:close()
  local code = wait()
  local head, body = text:match("^(.-)\r\n\r\n(.*)$")
  local status = head and tonumber(head:match("^HTTP/%S+ (%d+)"))
  -- (55, "failed sending data": a server that refuses a body too large
  -- answers and closes before curl has sent it all; the answer is there)
  assert(code == 0 or (code == 55 and status == 413), "curl exited " .. tostring(code))
  local headers = {}
  for name, value in head:gmatch("\r\n([^:\r\n]+):%s*([^\r\n]*)") do headers[name:lower()] = value end
  return status, headers, body
end

local function json_of(status, headers, body)
  assert.truthy(headers["content-type"]:find("application/json", 1, true), body)
  return status, cjson.decode(body), headers
end

-- run_task(fn(url, base)) with a server on a free loopback port and a fresh
-- sandbox id; the sandbox is destroyed and the server closed afterwards.
local function with_server(fn, listen_opts)
  seq = seq + 1
  local id = ("e2e-%d-%d"):format(core.getpid(), seq)
  api.configure { home = home }
  run_task(function()
    local opts = { listen = "127.0.0.1:0" }
    for k, v in pairs(listen_opts or {}) do opts[k] = v end
    local server = http.listen(opts, api.handle)
    local url = "http://" .. server.address
    local base = url .. "/v1/sandboxes/" .. id
    local ok, err = pcall(fn, base, url)
    local status = curl("-X", "DELETE", base)
    server:close()
    if not ok then error(err, 0) end
    assert.equal(200, status)
  end)
end

local function post(url, body)
  return json_of(curl("-X", "POST", "-H", "content-type: application/json", "--data-binary", body, url))
end

describe("http api end to end", function()
  it("resumes a session across two requests, as in the seed's getSession example", function()
    with_server(function(base)
      -- first request
      local status, s = post(base .. "/sessions", '{"id": "build"}')
      assert.equal(200, status)
      assert.equal("build", s.id)
      local r
      status, r = post(base .. "/exec",
        '{"sessionId": "build", "command": "mkdir -p repo && cd repo && export STAGE=installed"}')
      assert.same({ 200, 0 }, { status, r.exitCode })
      -- second request
      status, s = json_of(curl(base .. "/sessions/build"))
      assert.same({ 200, "/workspace/repo" }, { status, s.cwd })
      status, r = post(base .. "/exec", '{"sessionId": "build", "command": "basename $PWD; echo $STAGE"}')
      assert.same({ 200, "repo\ninstalled\n", "build" }, { status, r.stdout, r.sessionId })
    end)
  end)

  it("answers bad requests with the right 4xx and keeps serving", function()
    local big = helper.mkdtemp() .. "/big.json"
    local f = assert(io.open(big, "wb"))
    f:write('{"command": "echo ', ("x"):rep(100 * 1024), '"}')
    f:close()
    local latin1 = big .. ".latin1"
    f = assert(io.open(latin1, "wb"))
    f:write('{"command": "echo caf\233"}')
    f:close()
    with_server(function(base, url)
      local cases = {
        { 400, "VALIDATION_FAILED", "-X", "POST", "--data-binary", '{"command": ', base .. "/exec" },
        { 400, "VALIDATION_FAILED", "-X", "POST", "--data-binary", '["true"]', base .. "/exec" },
        { 400, "VALIDATION_FAILED", "-X", "POST", "--data-binary", '{"command": 42}', base .. "/exec" },
        { 400, "VALIDATION_FAILED", "-X", "POST", "--data-binary", '{"command": "true", "colour": "red"}',
          base .. "/exec" },
        { 400, "VALIDATION_FAILED", "-X", "POST", "--data-binary", "@" .. latin1, base .. "/exec" },
        { 400, "VALIDATION_FAILED", "-X", "POST", "--data-binary", '{"command": "\\udc00"}', base .. "/exec" },
        { 400, "VALIDATION_FAILED", "-X", "POST", "--data-binary", '{"command": "true", "sessionId": "../x"}',
          base .. "/exec" },
        { 400, "VALIDATION_FAILED", "-X", "POST", "--data-binary", '{"id": ".."}', base .. "/sessions" },
        { 400, "VALIDATION_FAILED", "-X", "POST", "--data-binary", '{"command": "true", "processId": "a/b"}',
          base .. "/processes" },
        { 400, "VALIDATION_FAILED", url .. "/v1/sandboxes/No_Such..Id!" },
        { 400, "VALIDATION_FAILED", base .. "/sessions/a%2Fb" }, -- routed on the raw path: the id "a/b"
        { 400, "VALIDATION_FAILED", "-X", "DELETE", base .. "/sessions/%2E%2E" }, -- not DELETE of the sandbox
        { 404, "NOT_FOUND", url .. "/v2/anything" },
        { 404, "SESSION_NOT_FOUND", base .. "/sessions/nobody" },
        { 405, "METHOD_NOT_ALLOWED", "-X", "PATCH", base .. "/sessions" },
        { 405, "METHOD_NOT_ALLOWED", base .. "/exec" },
        { 413, "REQUEST_TOO_LARGE", "-X", "POST", "--data-binary", "@" .. big, base .. "/exec" },
      }
      for _, case in ipairs(cases) do
        local status, body, headers = json_of(curl(unpack(case, 3)))
        assert.equal(case[2], body.code, body.message)
        assert.equal(case[1], status)
        assert.equal(case[1], body.httpStatus)
        assert.is_table(body.context) -- every error body: {code, message, context, httpStatus}
        if status == 405 then assert.truthy(headers.allow) end
      end
      local status, r = post(base .. "/exec", '{"command": "echo still serving"}')
      assert.same({ 200, "still serving\n" }, { status, r.stdout })
    end, { maxBody = 64 * 1024 })
    os.remove(latin1)
    os.remove(big)
  end)

  it("streams an exec as SSE events", function()
    with_server(function(base)
      local status, headers, body = curl("-N", "-X", "POST", "--data-binary",
        '{"command": "echo one; echo two >&2; exit 3"}', base .. "/exec/stream")
      assert.equal(200, status)
      assert.truthy(headers["content-type"]:find("text/event-stream", 1, true))
      local types, last = {}, nil
      for data in body:gmatch("data: ([^\n]*)\n\n") do
        last = cjson.decode(data)
        types[#types + 1] = last.type
      end
      assert.equal("start", types[1])
      assert.equal("complete", types[#types])
      assert.equal(3, last.exitCode)
    end)
  end)

  it("kills a streamed command's whole tree when the client disconnects, and keeps the session", function()
    with_server(function(base)
      post(base .. "/sessions", '{"id": "s"}')
      local proc, out, wait = start_curl { "-N", "-X", "POST", "--data-binary",
        '{"sessionId": "s", "command": "sleep 300 & echo bg=$!; setsid sleep 300 & echo sid=$!; sleep 300"}',
        base .. "/exec/stream" }
      local text = async.await(function(resume)
        local buf = ""
        out:read_start(function(_, data)
          buf = buf .. (data or "")
          if data == nil or buf:find("sid=%d+") then
            out:read_stop()
            resume(buf)
          end
        end)
      end)
      local bg, sid = tonumber(text:match("bg=(%d+)")), tonumber(text:match("sid=(%d+)"))
      assert.is_number(bg)
      assert.is_number(sid)
      core.kill(proc:pid(), "SIGTERM") -- the client goes away
      out:close()
      wait()
      -- the kill runs on the server's side of the closed connection: wait for it (bounded)
      -- (pids as the sandbox sees them: look in its /proc)
      local sb = moonbox.getSandbox(base:match("([^/]+)$"))
      for _ = 1, 500 do
        if not helper.pid_alive(bg, sb) and not helper.pid_alive(sid, sb) then break end
        moonbox.sleep(10)
      end
      assert.is_false(helper.pid_alive(bg, sb))
      assert.is_false(helper.pid_alive(sid, sb))
      local status, r = post(base .. "/exec", '{"sessionId": "s", "command": "echo after"}')
      assert.same({ 200, "after\n" }, { status, r.stdout })
    end)
  end)

  it("moves raw bytes both ways", function()
    with_server(function(base)
      local src = helper.mkdtemp() .. "/bytes"
      local f = assert(io.open(src, "wb"))
      for i = 0, 255 do f:write(string.char(i):rep(512)) end
      f:close()
      local status, r = json_of(curl("-X", "PUT", "--data-binary", "@" .. src, base .. "/files/raw?path=bytes"))
      assert.same({ 200, "/workspace/bytes" }, { status, r.path })
      local _, body
      status, _, body = curl(base .. "/files/stream?path=bytes")
      assert.equal(200, status)
      local want = assert(io.open(src, "rb")):read("*a")
      assert.equal(#want, #body)
      assert.is_true(want == body)
      os.remove(src)
    end, { maxBody = 1024 * 1024 })
  end)
end)
