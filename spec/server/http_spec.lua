-- moonbox.server.http over src/http/ (our connection layer on the runtime's loop):
-- requests as tasks, bounded input, streaming, WebSockets, unix sockets,
-- the token of `moonbox serve`, and nothing left open afterwards.
local moonbox = require "moonbox"
local core = require "moonbox.core"
local async = require "moonbox.async"
local cjson = require "cjson"
local http = require "moonbox.server.http"
local cli = require "moonbox.server.cli"
local client = require "server.client"

local curl = client.curl

-- run_task(fn(server, url)) with a server on a free loopback port, closed afterwards.
local function with_server(opts, handler, fn)
  run_task(function()
    opts.listen = opts.listen or "127.0.0.1:0"
    local server = http.listen(opts, handler)
    local ok, err = pcall(fn, server, "http://" .. server.address)
    server:close()
    if not ok then error(err, 0) end
  end)
end

local function port_of(server) return tonumber(server.address:match(":(%d+)$")) end

describe("moonbox.server.http", function()
  it("rejects a bad listen address before listening", function()
    run_task(function()
      for _, listen in ipairs { "nowhere", "127.0.0.1:99999", "example.com:80", "[::1]:80" } do
        local err = helper.error_of(http.listen, { listen = listen }, function() end)
        assert.equal("VALIDATION_FAILED", err.code)
      end
      local err = helper.error_of(http.listen, { listen = "127.0.0.1:0", maxBody = -1 }, function() end)
      assert.equal("VALIDATION_FAILED", err.code)
    end)
  end)

  it("reports a port in use as LISTEN_FAILED", function()
    with_server({}, function() end, function(server)
      local err = helper.error_of(http.listen, { listen = server.address }, function() end)
      assert.equal("LISTEN_FAILED", err.code)
    end)
  end)

  it("answers a plain request: method, decoded path and query, lowercase headers, body", function()
    local seen, user
    with_server({}, function(req)
      seen = req
      user = req.headers["x-user"] -- any header, lowercase
      return { status = 201, headers = { ["X-Answer"] = "42", ["Content-Type"] = "text/plain" },
        body = req.method .. " " .. req.path .. " " .. req.body }
    end, function(_, url)
      local out, _, code = curl("-i", "-X", "PUT", "-H", "X-User: alice", "--data-binary", "payload",
        url .. "/a%20b/c?name=J%C3%BCrgen&flag&x=1+2")
      assert.equal(0, code)
      assert.matches("^HTTP/1%.1 201", out)
      assert.matches("\r\nx%-answer: 42\r\n", out)
      assert.matches("\r\ncontent%-type: text/plain\r\n", out)
      assert.matches("\r\n\r\nPUT /a b/c payload$", out)
      assert.equal("PUT", seen.method)
      assert.equal("/a b/c", seen.path)
      assert.same({ name = "Jürgen", flag = "", x = "1 2" }, seen.query)
      assert.is_nil(seen.queryConflict)
      assert.equal("alice", user)
      assert.equal("7", seen.headers["content-length"])
      -- a name given twice: the first value, and the conflict named (the API refuses it)
      curl(url .. "/q?a=1&b=2&a=1&b=3")
      assert.same({ a = "1", b = "2" }, seen.query)
      assert.equal("b", seen.queryConflict)
    end)
  end)

  it("keeps a connection alive across requests", function()
    local count = 0
    with_server({}, function(req)
      count = count + 1
      return { status = 200, body = "n=" .. count .. " " .. req.path }
    end, function(server)
      local conn = client.connect(port_of(server))
      conn:send("GET /one HTTP/1.1\r\nHost: x\r\n\r\n")
      local status, _, body = conn:response()
      assert.equal(200, status)
      assert.equal("n=1 /one", body)
      conn:send("GET /two HTTP/1.1\r\nHost: x\r\n\r\n")
      status, _, body = conn:response()
      assert.equal(200, status)
      assert.equal("n=2 /two", body)
      assert.equal(1, server:connections())
      conn:close()
    end)
  end)

  it("receives a 1 MB body whole", function()
    local body = ("0123456789abcdef"):rep(65536)
    local file = helper.mkdtemp() .. "/body"
    local f = assert(io.open(file, "wb"))
    f:write(body)
    f:close()
    with_server({ maxBody = 2 * 1024 * 1024 }, function(req)
      return { status = 200, body = ("%d %s"):format(#req.body, tostring(req.body == body)) }
    end, function(_, url)
      local out, _, code = curl("--data-binary", "@" .. file, url .. "/upload")
      assert.equal(0, code)
      assert.equal("1048576 true", out)
    end)
    os.remove(file)
  end)

  it("answers 413 to a body over maxBody without running the handler, and keeps serving", function()
    local ran = 0
    with_server({ maxBody = 1000 }, function()
      ran = ran + 1
      return { status = 200, body = "ok" }
    end, function(_, url)
      local out, _, code = curl("-i", "--data-binary", ("x"):rep(5000), url .. "/big")
      assert.equal(0, code)
      assert.matches("^HTTP/1%.1 413", out)
      local json = cjson.decode(out:match("\r\n\r\n(.*)$"))
      assert.equal("REQUEST_TOO_LARGE", json.code)
      assert.same({ 413, { maxBodyBytes = 1000 } }, { json.httpStatus, json.context })
      assert.equal(0, ran)
      out = curl("--data-binary", ("x"):rep(1000), url .. "/fits")
      assert.equal("ok", out)
    end)
  end)

  it("answers 411 to a chunked request body (not decoded: one framing rule) and keeps serving", function()
    with_server({}, function() return { status = 200, body = "ok" } end, function(_, url)
      local out = curl("-i", "-H", "Transfer-Encoding: chunked", "--data-binary", "abc", url .. "/chunked")
      assert.matches("^HTTP/1%.1 411", out)
      local json = cjson.decode(out:match("\r\n\r\n(.*)$"))
      assert.same({ "LENGTH_REQUIRED", 411, {} }, { json.code, json.httpStatus, json.context })
      assert.equal("ok", (curl(url .. "/")))
    end)
  end)

  it("answers 431 to headers over the limit, also on a kept-alive connection, and keeps serving", function()
    with_server({}, function() return { status = 200, body = "ok" } end, function(server, url)
      local big = "X-Big: " .. ("y"):rep(20000) .. "\r\n"
      local conn = client.connect(port_of(server))
      conn:send("GET / HTTP/1.1\r\nHost: x\r\n" .. big .. "\r\n")
      local status, headers, body = conn:response()
      assert.equal(431, status)
      assert.equal("application/json", headers["content-type"])
      local err = cjson.decode(body)
      assert.equal("REQUEST_HEADER_FIELDS_TOO_LARGE", err.code)
      assert.equal(431, err.httpStatus)
      assert.is_true(conn:wait_eof())
      conn:close()
      assert.equal("ok", (curl(url .. "/")))
      -- the second request of a connection
      conn = client.connect(port_of(server))
      conn:send("GET / HTTP/1.1\r\nHost: x\r\n\r\n")
      assert.equal(200, (conn:response()))
      conn:send("GET / HTTP/1.1\r\nHost: x\r\n" .. big .. "\r\n")
      assert.equal(431, (conn:response()))
      conn:close()
      -- curl's own oversized header
      local out = curl("-o", "/dev/null", "-w", "%{http_code}", "-H", "X-Big: " .. ("z"):rep(9000), url .. "/")
      assert.equal("431", out)
      assert.equal("ok", (curl(url .. "/")))
    end)
  end)

  it("closes after the response when the client asks (Connection: close), also a POST without a body", function()
    with_server({}, function() return { status = 200, body = "ok" } end, function(server)
      for _, head in ipairs { "POST / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                              "POST / HTTP/1.1\r\nHost: x\r\nConnection: Close\r\nContent-Length: 0\r\n\r\n",
                              "GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" } do
        local conn = client.connect(port_of(server))
        conn:send(head)
        assert.equal(200, (conn:response()))
        assert.is_true(conn:wait_eof(), head) -- (the idle timeout is 30 s, the wait 10)
        conn:close()
      end
    end)
  end)

  it("answers 500 and closes when a body in pieces fails before its head, never leaving the client waiting", function()
    with_server({}, function(req)
      if req.path == "/fine" then return { status = 200, body = "ok" } end
      -- (a body in pieces whose length cannot be counted: docs/server.md)
      return { status = 200, body = { held = 100000, measure = function() error("no length") end,
        pieces = function() return nil end, text = function() return "" end } }
    end, function(server)
      local conn = client.connect(port_of(server))
      conn:send("GET /broken HTTP/1.1\r\nHost: x\r\n\r\n")
      local status, _, body = conn:response()
      assert.equal(500, status)
      assert.equal("INTERNAL_ERROR", cjson.decode(body).code)
      assert.is_true(conn:wait_eof())
      conn:close()
      -- and the server goes on
      local again = client.connect(port_of(server))
      again:send("GET /fine HTTP/1.1\r\nHost: x\r\n\r\n")
      assert.equal(200, (again:response()))
      again:close()
    end)
  end)

  it("gives the handler the path as sent (req.rawPath): %2F and dot segments kept, also when kept alive", function()
    local seen = {}
    with_server({}, function(req)
      seen[#seen + 1] = { path = req.path, raw = req.rawPath }
      return { status = 200, body = "ok" }
    end, function(server)
      local conn = client.connect(port_of(server))
      for _, target in ipairs { "/a%2Fb/c", "/x/%2E%2E/y?q=1", "/x/../y", "/plain" } do
        conn:send("GET " .. target .. " HTTP/1.1\r\nHost: x\r\n\r\n")
        assert.equal(200, (conn:response()))
      end
      conn:close()
      assert.same({ { path = "/a/b/c", raw = "/a%2Fb/c" }, { path = "/y", raw = "/x/%2E%2E/y" },
        { path = "/y", raw = "/x/../y" }, { path = "/plain", raw = "/plain" } }, seen)
    end)
  end)

  it("lets the API refuse ids with %2F or .. in a path segment with 400, not 404 or another route", function()
    local api = require "moonbox.server.api"
    api.configure { home = helper.mkdtemp() }
    with_server({}, api.handle, function(server)
      local conn = client.connect(port_of(server))
      local function req(method, target)
        conn:send(method .. " " .. target .. " HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        local status, _, body = conn:response()
        return status, cjson.decode(body)
      end
      assert.equal(200, (req("POST", "/v1/sandboxes/rawids/sessions")))
      for _, case in ipairs {
        { "GET", "/v1/sandboxes/rawids/sessions/a%2Fb", "sessionId" },
        { "GET", "/v1/sandboxes/rawids/sessions/..", "sessionId" },
        { "DELETE", "/v1/sandboxes/rawids/sessions/%2E%2E", "sessionId" }, -- decoded alone: DELETE the sandbox
        { "GET", "/v1/sandboxes/rawids/sessions/a%2Fterminal", "sessionId" },
        { "GET", "/v1/sandboxes/rawids/processes/a%2Fb/logs", "processId" },
        { "DELETE", "/v1/sandboxes/rawids/processes/..", "processId" },
        { "DELETE", "/v1/sandboxes/rawids/contexts/%2e%2e", "contextId" },
        { "GET", "/v1/sandboxes/a%2Fb/sessions", "id" },
        { "GET", "/v1/sandboxes/..", "id" },
        { "GET", "/v1/sandboxes//sessions", "id" },
        { "GET", "/v1/sandboxes/UPPER/sessions", "id" },
        { "GET", "/v1/sandboxes/-dash/sessions", "id" },
        { "GET", "/v1/sandboxes/" .. ("a"):rep(64), "id" },
      } do
        local status, body = req(case[1], case[2])
        assert.equal(400, status, case[1] .. " " .. case[2])
        assert.equal("VALIDATION_FAILED", body.code, case[2])
        assert.equal(400, body.httpStatus)
        assert.equal(case[3], body.context.field, case[2])
        assert.is_string(body.message)
      end
      -- still serving, the sandbox and its session still there (a refused
      -- request made nothing, not even the default session)
      local status, body = req("GET", "/v1/sandboxes/rawids/sessions")
      assert.equal(200, status)
      assert.same({ "session-1" }, body)
      assert.equal(200, (req("DELETE", "/v1/sandboxes/rawids")))
      conn:close()
    end)
  end)

  it("streams Server-Sent Events: the first event arrives while the handler still runs", function()
    local release, finished
    with_server({}, function(_, res)
      res:start(200, { ["content-type"] = "text/event-stream" })
      res:write("data: first\n\n")
      moonbox.timeout(10000, function()
        require("moonbox.async").await(function(resume) release = resume end)
      end)
      res:write("data: second\n\n")
      finished = true
    end, function(server)
      local conn = client.connect(port_of(server))
      conn:send("GET /events HTTP/1.1\r\nHost: x\r\n\r\n")
      assert.truthy(conn:read_until("data: first\n\n"))
      assert.is_nil(finished)
      assert.truthy(conn:read_until("\r\ncontent%-type: text/event%-stream\r\n"))
      release()
      assert.truthy(conn:read_until("data: second\n\n"))
      assert.is_true(conn:wait_eof()) -- a stream without a length ends with the connection
      assert.is_true(finished)
      conn:close()
    end)
  end)

  it("a client that disconnects mid-stream: write returns false, res.closed, onClose runs", function()
    local result = {}
    local done
    with_server({}, function(_, res)
      res:onClose(function() result.on_close = true end)
      res:start(200, { ["content-type"] = "text/event-stream" })
      local n = 0
      while true do
        n = n + 1
        if not res:write(("data: %d\n\n"):format(n)) then break end
        moonbox.sleep(5)
      end
      result.closed = res.closed
      done()
    end, function(server)
      local conn = client.connect(port_of(server))
      conn:send("GET /events HTTP/1.1\r\nHost: x\r\n\r\n")
      assert.truthy(conn:read_until("data: 2\n\n"))
      conn:close()
      moonbox.timeout(10000, function()
        require("moonbox.async").await(function(resume) done = resume end)
      end)
      assert.same({ on_close = true, closed = true }, result)
    end)
  end)

  it("a slow reader makes write yield instead of buffering without bound", function()
    local max_queued = 0
    local done
    with_server({}, function(_, res)
      res:start(200, { ["content-type"] = "application/octet-stream" })
      local chunk = ("z"):rep(64 * 1024)
      for _ = 1, 200 do -- 12.5 MiB, far more than the socket buffers hold
        if not res:write(chunk) then break end
        max_queued = math.max(max_queued, res._server._core:queued(res._id) or 0)
      end
      done()
    end, function(server)
      local conn = client.connect(port_of(server))
      conn.stream:read_stop() -- read nothing for now
      conn:send("GET /flood HTTP/1.1\r\nHost: x\r\n\r\n")
      local wait = moonbox.spawn(function()
        require("moonbox.async").await(function(resume) done = resume end)
      end)
      moonbox.sleep(200)
      assert.is_true(wait:status() == "running", "the handler finished although nobody read")
      assert.is_true(max_queued <= http.HIGH_WATER + 64 * 1024, "queued " .. max_queued)
      conn:close()
      moonbox.timeout(10000, function() wait:wait() end)
    end)
  end)

  it("turns a raised error into a 500 INTERNAL_ERROR JSON response", function()
    local stderr = io.stderr
    io.stderr = { write = function() end } -- luacheck: ignore 122 (the expected log line)
    with_server({}, function() error("kaputt") end, function(_, url)
      local out = curl("-i", url .. "/boom")
      io.stderr = stderr -- luacheck: ignore 122
      assert.matches("^HTTP/1%.1 500", out)
      local json = cjson.decode(out:match("\r\n\r\n(.*)$"))
      assert.equal("INTERNAL_ERROR", json.code)
      assert.matches("kaputt", json.message)
      assert.same({ {}, 500 }, { json.context, json.httpStatus })
    end)
    io.stderr = stderr -- luacheck: ignore 122
  end)

  it("echoes WebSocket text and binary messages on any path without a subprotocol", function()
    local path
    with_server({}, function(req, res)
      path = req.path
      local ws = res:upgrade()
      ws:send("hello")
      for data, is_binary in ws:messages() do ws:send((is_binary and "bin:" or "text:") .. data, is_binary) end
    end, function(server)
      local events = client.ws_client("ws://" .. server.address .. "/any/path/here?x=1", {
        { expect = "hello" }, { send = "abc" }, { expect = "text:abc" },
        { binary = "\0\1\127" }, { expect = "bin:\0\1\127" }, { close = 1000 },
      })
      assert.equal("/any/path/here", path)
      assert.same({ open = true }, events[1])
      assert.same({ text = "hello" }, events[2])
      assert.same({ text = "text:abc" }, events[3])
      assert.same({ binary = "bin:\0\1\127" }, events[4])
      assert.same({ close = 1000, reason = "" }, events[5])
    end)
  end)

  it("sends a large WebSocket message as fragments that arrive as one, and builds one with ws:sendFragment",
    function()
    local big = ("0123456789abcdef"):rep(20000) -- 320000 bytes: five slices
    with_server({}, function(_, res)
      local ws = res:upgrade()
      ws:send(big)
      ws:sendFragment("one,", false, true)
      ws:sendFragment("two,", true, true) -- (isBinary of a continuation is ignored)
      ws:sendFragment("three", false, false)
      for _ in ws:messages() do end
    end, function(server)
      local events = client.ws_client("ws://" .. server.address .. "/", {
        { expect = "one,two,three" }, { close = 1000 },
      })
      assert.same({ open = true }, events[1])
      assert.equal(#big, events[2].text and #events[2].text)
      assert.is_true(events[2].text == big)
      assert.same({ text = "one,two,three" }, events[3])
    end)
  end)

  it("closes a WebSocket with 1008 once more than 4 MiB of its messages wait untaken", function()
    with_server({ maxBody = 2 * 1024 * 1024 }, function(_, res)
      local ws = res:upgrade()
      ws:send("ready")
      -- takes nothing (a proxied service that does not read)
      while not ws.closed do moonbox.sleep(50) end
    end, function(server)
      local steps = { { expect = "ready" } }
      for _ = 1, 6 do steps[#steps + 1] = { fill = 1024 * 1024 } end
      steps[#steps + 1] = { expect = "never" }
      local events = client.ws_client("ws://" .. server.address .. "/", steps)
      assert.same({ close = 1008, reason = "messages arrive faster than the service takes them" }, events[3])
    end)
  end)

  it("keeps a quiet WebSocket open past the idle timeout", function()
    with_server({ idleTimeoutMs = 1000 }, function(_, res)
      local ws = res:upgrade()
      for data in ws:messages() do ws:send("echo " .. data) end
    end, function(server)
      local events = client.ws_client("ws://" .. server.address .. "/", {
        { send = "a" }, { expect = "echo a" }, { sleep = 2500 },
        { send = "b" }, { expect = "echo b" }, { close = 1000 },
      })
      assert.same({ text = "echo b" }, events[3])
      assert.same({ close = 1000, reason = "" }, events[4])
    end)
  end)

  it("closes a WebSocket whose message is over maxBody with 1009", function()
    with_server({ maxBody = 1000 }, function(_, res)
      local ws = res:upgrade()
      for data in ws:messages() do ws:send("got " .. #data) end
    end, function(server)
      local events = client.ws_client("ws://" .. server.address .. "/", {
        { send = ("a"):rep(1000) }, { expect = "got 1000" }, { send = ("b"):rep(1001) }, { expect = "never" },
      })
      assert.same({ text = "got 1000" }, events[2])
      assert.same({ close = 1009, reason = "message too large" }, events[3])
    end)
  end)

  it("a WebSocket request answered with a plain response gets that HTTP response", function()
    with_server({}, function(req)
      assert.is_true(req.websocket)
      return { status = 404, body = "no terminal here" }
    end, function(server)
      local conn = client.connect(port_of(server))
      conn:send("GET /nope HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n" ..
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
      local status, _, body = conn:response()
      assert.equal(404, status)
      assert.equal("no terminal here", body)
      conn:close()
    end)
  end)

  it("the server closes a WebSocket with its code and reason", function()
    with_server({}, function(_, res)
      local ws = res:upgrade()
      ws:send("bye")
      ws:close(4001, "done here")
    end, function(server)
      local events = client.ws_client("ws://" .. server.address .. "/", { { expect = "bye" } })
      assert.same({ close = 4001, reason = "done here" }, events[#events])
    end)
  end)

  it("listens on a unix socket", function()
    local sock = helper.mkdtemp() .. "/moonbox.sock"
    run_task(function()
      local server = http.listen({ listen = "unix:" .. sock }, function(req)
        return { status = 200, body = "over unix " .. req.path }
      end)
      assert.equal("unix:" .. sock, server.address)
      assert.is_true(server.isLocal)
      local out = curl("--unix-socket", sock, "http://localhost/here")
      server:close()
      assert.equal("over unix /here", out)
    end)
    assert.is_nil(io.open(sock), "the socket file outlived the server")
  end)

  it("bounds connections: one over maxConnections is answered 503 and closed, a freed slot is reused", function()
    with_server({ maxConnections = 2 }, function() return { status = 200, body = "ok" } end, function(server)
      local port = port_of(server)
      local a, b = client.connect(port), client.connect(port)
      a:send("GET / HTTP/1.1\r\nHost: x\r\n\r\n")
      b:send("GET / HTTP/1.1\r\nHost: x\r\n\r\n")
      assert.equal(200, (a:response()))
      assert.equal(200, (b:response()))
      local c = client.connect(port)
      c:send("GET / HTTP/1.1\r\nHost: x\r\n\r\n")
      local status, headers, body = c:response()
      assert.equal(503, status)
      assert.equal("1", headers["retry-after"])
      assert.equal("TOO_MANY_CONNECTIONS", cjson.decode(body).code)
      assert.is_true(c:wait_eof())
      c:close()
      a:close()
      moonbox.timeout(10000, function() while server:connections() > 1 do moonbox.sleep(10) end end)
      local d = client.connect(port)
      d:send("GET / HTTP/1.1\r\nHost: x\r\n\r\n")
      assert.equal(200, (d:response()))
      b:close()
      d:close()
    end)
  end)

  it("drops a client that sends half a request and goes quiet", function()
    with_server({ idleTimeoutMs = 1000 }, function() return { status = 200, body = "ok" } end, function(server)
      local conn = client.connect(port_of(server))
      conn:send("GET / HTTP/1.1\r\nHost:")
      assert.is_true(conn:wait_eof())
      conn:close()
    end)
  end)

  -- Slowloris: idle 300 ms, a byte every 150 ms (never a pause of a whole
  -- idle period). A deadline that restarted on every read kept such a body
  -- open until it reached its Content-Length; the head has one deadline
  -- for the whole of it. Both are closed without a response, well before
  -- four idle periods (a generous bound: the rule cuts at about one).
  local IDLE = 300
  local function trickle(conn, data)
    local started = core.hrtime() / 1e6
    for i = 1, #data do
      if conn.eof then break end
      conn:send(data:sub(i, i))
      moonbox.sleep(IDLE / 2)
    end
    assert.is_true(conn:wait_eof())
    return core.hrtime() / 1e6 - started
  end

  it("drops a client trickling its body a byte per half idle period, and serves one sending steadily", function()
    with_server({ idleTimeoutMs = IDLE }, function(req)
      return { status = 200, body = "got " .. #req.body }
    end, function(server)
      local slow = client.connect(port_of(server))
      slow:send("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
      local took = trickle(slow, ("x"):rep(1000))
      slow:close()
      assert.equal("", slow.buf) -- closed, as a head that stops arriving is: no response
      assert.is_true(took < IDLE * 4, ("dropped after %d ms"):format(took))
      -- 64 KiB in 4 KiB pieces 20 ms apart (about 200 KiB/s, longer than an idle period): served
      local steady = client.connect(port_of(server))
      steady:send("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 65536\r\n\r\n")
      for _ = 1, 16 do
        steady:send(("y"):rep(4096))
        moonbox.sleep(20)
      end
      local status, _, body = steady:response()
      assert.equal(200, status)
      assert.equal("got 65536", body)
      steady:close()
    end)
  end)

  it("drops a client trickling its head a byte per half idle period", function()
    with_server({ idleTimeoutMs = IDLE }, function() return { status = 200, body = "ok" } end, function(server)
      local conn = client.connect(port_of(server))
      local took = trickle(conn, "GET / HTTP/1.1\r\nHost: x\r\nX-Padding: " .. ("p"):rep(40) .. "\r\n\r\n")
      conn:close()
      assert.equal("", conn.buf)
      assert.is_true(took < IDLE * 4, ("dropped after %d ms"):format(took))
    end)
  end)

  it("closing the server ends open streams and sockets, and leaves nothing open", function()
    local stream_closed
    run_task(function()
      local server = http.listen({ listen = "127.0.0.1:0" }, function(_, res)
        res:start(200, { ["content-type"] = "text/event-stream" })
        while res:write("data: tick\n\n") do moonbox.sleep(10) end
        stream_closed = res.closed
      end)
      local conn = client.connect(port_of(server))
      conn:send("GET / HTTP/1.1\r\nHost: x\r\n\r\n")
      assert.truthy(conn:read_until("data: tick"))
      server:close()
      assert.is_true(conn:wait_eof())
      conn:close()
    end)
    assert.is_true(stream_closed)
  end)

  it("closing the server closes its listening socket once: a number freed meanwhile is not closed again", function()
    -- (lws 4.1 on a uv loop closed its event pipe twice, the second time
    -- in a uv close callback: a file opened in between by the thread pool
    -- lost its number.) The listening socket is closed once, in its poll's
    -- close callback; a timer due with the server's close runs before it
    -- and takes the number if it is free by then.
    local function sockets()
      local set = {}
      for fd = 0, 1023 do
        if (core.readlink("/proc/self/fd/" .. fd) or ""):match("^socket:") then set[fd] = true end
      end
      return set
    end
    run_task(function()
      local before = sockets()
      local srv = assert(core.http_listen({ host = "127.0.0.1", port = 0 }, function() end))
      local listener
      for fd in pairs(sockets()) do
        if not before[fd] then
          assert.is_nil(listener, "the server made more than one socket")
          listener = fd
        end
      end
      assert.is_number(listener)
      local held, t = {}, core.timer()
      async.await(function(resume)
        srv:close(resume)
        t:start(0, 0, function()
          if core.readlink("/proc/self/fd/" .. listener) then return end -- not closed yet
          repeat
            held[#held + 1] = assert(core.fs_open_dir("/"))
          until held[#held] >= listener or #held == 64
        end)
      end)
      t:close()
      for _, fd in ipairs(held) do
        assert.are.equal("/", core.readlink("/proc/self/fd/" .. fd), "fd " .. fd .. " was closed from under us")
        core.close_fd(fd)
      end
      -- and the listening socket is not left open
      assert.is_nil((core.readlink("/proc/self/fd/" .. listener) or ""):match("^socket:"))
    end)
  end)

  it("closing the server ends a WebSocket's messages() loop", function()
    local ended, connected
    run_task(function()
      local server = http.listen({ listen = "127.0.0.1:0" }, function(_, res)
        local ws = res:upgrade()
        ws:receive() -- the client is there
        connected()
        for _ in ws:messages() do end
        ended = ws.closed
      end)
      local wait_connected = moonbox.spawn(function()
        require("moonbox.async").await(function(resume) connected = resume end)
      end)
      local peer = moonbox.spawn(client.ws_client, "ws://" .. server.address .. "/",
        { { send = "here" }, { expect = "never" } })
      moonbox.timeout(10000, function() wait_connected:wait() end)
      server:close()
      local events = moonbox.timeout(15000, function() return peer:wait() end)
      assert.same({ close = 1006, reason = "" }, events[2]) -- no close frame: the server went away
    end)
    assert.is_true(ended)
  end)

  it("processes started after the server listens have default signal dispositions and an empty mask", function()
    with_server({}, function() return { status = 200 } end, function()
      local sb = helper.new_sandbox()
      local r = sb:exec("grep -E '^Sig(Ign|Blk):' /proc/self/status")
      sb:destroy()
      local ign = tonumber(r.stdout:match("SigIgn:%s*(%x+)"), 16)
      local blk = tonumber(r.stdout:match("SigBlk:%s*(%x+)"), 16)
      assert.equal(0, bit.band(ign, 0x1000), "SIGPIPE (bit 13) is ignored: " .. r.stdout)
      assert.equal(0, blk, r.stdout)
      -- and the runtime itself does ignore it (the core asks for that)
      local f = io.open("/proc/self/status")
      local own = tonumber(f:read("*a"):match("SigIgn:%s*(%x+)"), 16)
      f:close()
      assert.equal(0x1000, bit.band(own, 0x1000))
    end)
  end)
end)

describe("moonbox serve", function()
  local TOKEN = "s3cret-token-0123456789"

  it("parses its flags, --prewarm on|off|N among them, and names a bad one", function()
    local opts = cli.parse { "--listen", "127.0.0.1:0", "--prewarm", "on", "--max-body=2048" }
    assert.same({ listen = "127.0.0.1:0", prewarm = "on", maxBody = 2048 }, opts)
    assert.equal(4, cli.parse({ "--prewarm", "4" }).prewarm)
    assert.equal(0, cli.parse({ "--prewarm", "0" }).prewarm)
    for _, bad in ipairs { "maybe", "17", "-1", "1.5", "" } do
      local ok, err = pcall(cli.parse, { "--prewarm", bad })
      assert.is_false(ok)
      assert.equal("VALIDATION_FAILED", err.code)
      assert.matches("%-%-prewarm needs on, off or a pool size 0%-16", err.message)
    end
  end)

  it("requires the bearer token on every path when one is configured (compared in constant time)", function()
    with_server({}, cli.app { token = TOKEN, userHandler = function() return { status = 200, body = "mine" } end },
      function(server, url)
        local _, _, code = curl("-f", url .. "/app")
        assert.equal(22, code) -- curl -f: HTTP error
        local out = curl("-i", url .. "/v1/sandboxes")
        assert.matches("^HTTP/1%.1 401", out)
        assert.matches("\r\nwww%-authenticate: Bearer", out)
        local body = cjson.decode(out:match("\r\n\r\n(.*)$"))
        assert.same({ "UNAUTHORIZED", 401, {} }, { body.code, body.httpStatus, body.context })
        out = curl("-i", "-H", "Authorization: Bearer wrong-token-0123456789", url .. "/app")
        assert.matches("^HTTP/1%.1 401", out)
        out = curl("-H", "Authorization: Bearer " .. TOKEN, url .. "/app")
        assert.equal("mine", out)
        -- a WebSocket may carry it as access_token (browsers cannot set the header)
        local conn = client.connect(port_of(server))
        conn:send("GET /app HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n" ..
          "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
        local wstatus, wheaders = conn:response()
        assert.equal(401, wstatus)
        assert.equal('Bearer realm="moonbox"', wheaders["www-authenticate"]) -- as on every 401
        conn:close()
      end)
    assert.is_true(cli.constant_time_equal(TOKEN, TOKEN))
    assert.is_false(cli.constant_time_equal(TOKEN, TOKEN .. "x"))
    assert.is_false(cli.constant_time_equal("", TOKEN))
  end)

  it("refuses --no-token on a non-loopback address, and when sandboxes could reach the listener", function()
    run_task(function()
      local bin = os.getenv("MOONBOX_BIN") or "build/moonbox"
      local out, err, code = client.run { bin, "serve", "--listen", "0.0.0.0:0", "--no-token" }
      assert.equal(2, code)
      assert.equal("", out)
      assert.equal("moonbox serve: refusing --no-token on 0.0.0.0:0: only a loopback address or a unix socket " ..
        "may go without a token\n", err)
      local dir = helper.mkdtemp()
      for _, p in ipairs { { 'network = "host"', 'network = "host"' },
          { 'isolation = "none"', 'isolation = "none"' } } do
        local f = assert(io.open(dir .. "/policy.lua", "w"))
        f:write("return { " .. p[1] .. " }\n")
        f:close()
        out, err, code = client.run { bin, "serve", "--listen", "127.0.0.1:0", "--no-token", "--policy",
          dir .. "/policy.lua" }
        assert.equal(2, code)
        assert.equal("", out)
        assert.matches("^moonbox serve: refusing %-%-no%-token: sandbox code could call the API: [^\n]*" ..
          p[2]:gsub("%p", "%%%0") .. "%)\n$", err)
      end
      local _, perr, pcode = client.run { bin, "serve", "--no-token", "--token-file", dir .. "/t" }
      assert.equal(2, pcode)
      assert.matches("exclude each other", perr)
      helper.sh("rm -rf " .. dir)
    end)
  end)

  -- Start `moonbox serve args...`; returns the address line's address,
  -- stop() -> exit code, and the token of the page URL it prints (nil with
  -- --no-token or --token-file).
  local function serve(args)
    local bin = os.getenv("MOONBOX_BIN") or "build/moonbox"
    local home = helper.mkdtemp()
    local exit = {}
    local argv = { bin, "serve" }
    for _, a in ipairs(args) do argv[#argv + 1] = a end
    local proc, pipes = assert(core.spawn {
      args = argv, env = client.env { HOME = home, MOONBOX_HOME = home },
      stdio = { [0] = "null", [1] = "pipe", [2] = "pipe" },
      on_exit = function(c) exit.code = c if exit.resume then exit.resume() end end,
    })
    local quiet = false
    for _, a in ipairs(args) do if a == "--no-token" or a == "--token-file" then quiet = true end end
    local text = moonbox.timeout(10000, function()
      local buf = ""
      return require("moonbox.async").await(function(resume)
        pipes[1]:read_start(function(_, data)
          buf = buf .. (data or "")
          local done = buf:match("listening on [^\n]*\n") and (quiet or buf:match("moonbox: open [^\n]*\n"))
          if done or not data then pipes[1]:read_stop() resume(buf) end
        end)
      end)
    end)
    local function stop()
      proc:kill("SIGTERM")
      if exit.code == nil then require("moonbox.async").await(function(resume) exit.resume = resume end) end
      pipes[1]:close()
      pipes[2]:close()
      return exit.code
    end
    return text:match("listening on (%S+)"), stop, text:match("moonbox: open %S+/%?token=(%x+)")
  end

  it("serves /, a --handler script and /v1 side by side, and prints its address", function()
    run_task(function()
      local url, stop, token = serve { "--listen", "127.0.0.1:0", "--handler",
        client.SOURCE .. "/examples/handler.lua" }
      assert.truthy(url and url:match("^http://127%.0%.0%.1:%d+$"), "no address printed: " .. tostring(url))
      assert.truthy(token and #token == 32, "no token printed")
      local auth = "Authorization: Bearer " .. token
      local page = curl("-i", url .. "/?token=" .. token)
      local run = curl("-H", auth, "-H", "Content-Type: application/json", "--data-binary",
        '{"code":"echo $((6*7))"}', url .. "/run/alice")
      local api_status = curl("-H", auth, "-o", "/dev/null", "-w", "%{http_code}", url .. "/v1/nope")
      assert.equal(0, stop())
      assert.matches("^HTTP/1%.1 200", page)
      assert.matches("<title>moonbox</title>", page)
      assert.equal("42\n", cjson.decode(run).stdout)
      assert.equal("404", api_status)
    end)
  end)

  it("requires a token by default: generated, printed in the page's URL; the page works from that URL", function()
    run_task(function()
      local url, stop, token = serve { "--listen", "127.0.0.1:0" }
      assert.truthy(token, "no page URL with a token printed")
      -- no token, a wrong one, the cookie on the API: 401
      local codes = {}
      local function status(...)
        return curl("-o", "/dev/null", "-w", "%{http_code}", ...)
      end
      codes[#codes + 1] = status(url .. "/v1/sandboxes")
      codes[#codes + 1] = status(url .. "/")
      codes[#codes + 1] = status(url .. "/page/app.js")
      codes[#codes + 1] = status("-H", "Authorization: Bearer " .. ("0"):rep(32), url .. "/v1/sandboxes")
      codes[#codes + 1] = status("-H", "Cookie: moonbox_token=" .. token, url .. "/v1/sandboxes")
      codes[#codes + 1] = status(url .. "/v1/sandboxes?token=" .. token) -- the query is for the page only
      -- the printed URL: the page, and a cookie its assets load with
      local page = curl("-i", url .. "/?token=" .. token)
      local cookie = page:match("\r\nset%-cookie: (moonbox_token=%x+)")
      local asset = status("-H", "Cookie: " .. tostring(cookie), url .. "/page/app.js")
      local api = curl("-H", "Authorization: Bearer " .. token, url .. "/v1/sandboxes")
      -- health answers without a token, and says nothing else
      local healthz = curl("-i", url .. "/healthz")
      local readyz = curl(url .. "/readyz")
      local post = curl("-X", "POST", url .. "/healthz")
      local double = curl("-H", "Authorization: Bearer " .. token, url .. "/v1/sandboxes/x//sessions")
      assert.equal(0, stop())
      assert.same({ "401", "401", "401", "401", "401", "401" }, codes)
      assert.matches("^HTTP/1%.1 200", page)
      assert.matches("<title>moonbox</title>", page)
      assert.matches("HttpOnly; SameSite=Strict", page)
      -- (not the token: an HMAC of it that opens the page's files only)
      assert.equal("moonbox_token=" .. require("moonbox.server.token").page_cookie(token), cookie)
      assert.equal("200", asset)
      assert.equal("[]\n", api)
      assert.matches("^HTTP/1%.1 200", healthz)
      assert.equal('{"status":"ok"}\n', healthz:match("\r\n\r\n(.*)$"))
      assert.equal('{"status":"ready"}\n', readyz)
      assert.same({ "GET", "HEAD" }, cjson.decode(post).context.allow)
      assert.equal("/v1/sandboxes/x//sessions", cjson.decode(double).context.path) -- as sent
    end)
  end)

  it("takes the token from --token-file, and goes without one only with --no-token", function()
    run_task(function()
      local dir = helper.mkdtemp()
      local f = assert(io.open(dir .. "/token", "w"))
      f:write(TOKEN .. "\n")
      f:close()
      local url, stop, printed = serve { "--listen", "127.0.0.1:0", "--token-file", dir .. "/token" }
      local without = curl("-o", "/dev/null", "-w", "%{http_code}", url .. "/v1/sandboxes")
      local with = curl("-H", "Authorization: Bearer " .. TOKEN, url .. "/v1/sandboxes")
      assert.equal(0, stop())
      assert.is_nil(printed)
      assert.same({ "401", "[]\n" }, { without, with })
      local url2, stop2 = serve { "--listen", "127.0.0.1:0", "--no-token" }
      local open = curl(url2 .. "/v1/sandboxes")
      assert.equal(0, stop2())
      assert.equal("[]\n", open)
      helper.sh("rm -rf " .. dir)
    end)
  end)

  it("refuses a tenant's gitCheckout of a host repository (git.allowLocal is off in serve)", function()
    run_task(function()
      local dir = helper.mkdtemp()
      helper.sh("git init -q -b main " .. dir .. "/repo && cd " .. dir .. "/repo && echo secret > s.txt && " ..
        "git add s.txt && git -c user.name=t -c user.email=t@t commit -qm c")
      local url, stop, token = serve { "--listen", "127.0.0.1:0" }
      local auth = "Authorization: Bearer " .. token
      local results = {}
      for _, repo in ipairs { dir .. "/repo", "file://" .. dir .. "/repo", "FILE://" .. dir .. "/repo/" } do
        results[#results + 1] = cjson.decode((curl("-H", auth, "--data-binary", cjson.encode { repoUrl = repo },
          url .. "/v1/sandboxes/gitlocal/git/checkout")))
      end
      local ext = cjson.decode((curl("-H", auth, "--data-binary", '{"repoUrl":"ext::sh -c touch% /tmp/x"}',
        url .. "/v1/sandboxes/gitlocal/git/checkout")))
      local dash = cjson.decode((curl("-H", auth, "--data-binary", '{"repoUrl":"--upload-pack=touch /tmp/x"}',
        url .. "/v1/sandboxes/gitlocal/git/checkout")))
      local ls = cjson.decode((curl("-H", auth, "--data-binary", '{"command":"ls /workspace"}',
        url .. "/v1/sandboxes/gitlocal/exec")))
      assert.equal(0, stop())
      for _, r in ipairs(results) do
        assert.same({ "POLICY_DENIED", 403 }, { r.code, r.httpStatus })
        assert.matches("allowLocal", r.message)
      end
      assert.same({ "INVALID_GIT_URL", "INVALID_GIT_URL" }, { ext.code, dash.code })
      assert.equal("", ls.stdout)
      helper.sh("rm -rf " .. dir)
    end)
  end)

  it("on a unix socket: answers there, and SIGTERM leaves no socket file", function()
    run_task(function()
      local sock = helper.mkdtemp() .. "/serve.sock"
      local addr, stop, token = serve { "--listen", "unix:" .. sock }
      assert.equal("unix:" .. sock, addr)
      local status = curl("-o", "/dev/null", "-w", "%{http_code}", "--unix-socket", sock,
        "http://localhost/?token=" .. token)
      assert.equal(0, stop())
      assert.equal("200", status)
      assert.is_nil(io.open(sock), "the socket file outlived the server")
    end)
  end)
end)
