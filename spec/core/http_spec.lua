-- core.http_listen (src/http/): what the connection layer promises below
-- lua/moonbox/server/http.lua, seen from a raw socket.
local core = require "moonbox.core"
local async = require "moonbox.async"
local moonbox = require "moonbox"
local client = require "server.client"

-- run_task(fn(srv, port, events)) with a server whose handler is on_request(srv, id, req, body);
-- events lists every event as "kind id".
local function with_core_server(on_request, fn)
  run_task(function()
    local events = {}
    local srv
    srv = assert(core.http_listen({ host = "127.0.0.1", port = 0, max_body = 1000 }, function(kind, id, a, b)
      events[#events + 1] = kind .. " " .. tostring(id)
      if kind == "request" then on_request(srv, id, a, b) end
    end))
    local ok, err = pcall(fn, srv, srv:port(), events)
    async.await(function(resume) srv:close(resume) end)
    if not ok then error(err, 0) end
  end)
end

-- A client's frame: masked, as RFC 6455 requires.
local function frame(opcode, payload, fin)
  local mask = { 0x12, 0x34, 0x56, 0x78 }
  local out = { string.char((fin == false and 0 or 0x80) + opcode, 0x80 + #payload) }
  for i = 1, 4 do out[#out + 1] = string.char(mask[i]) end
  for i = 1, #payload do out[#out + 1] = string.char(bit.bxor(payload:byte(i), mask[(i - 1) % 4 + 1])) end
  return table.concat(out)
end

-- The next server frame in conn's buffer: fin, opcode, payload (short frames only).
local function next_frame(conn)
  local f = conn:wait_for(function(buf)
    if #buf < 2 then return nil end
    local len = bit.band(buf:byte(2), 0x7f)
    if #buf < 2 + len then return nil end
    return { bit.band(buf:byte(1), 0x80) ~= 0, bit.band(buf:byte(1), 0x0f), buf:sub(3, 2 + len) }
  end)
  assert(f, "no frame")
  conn.buf = conn.buf:sub(3 + #f[3])
  return f[1], f[2], f[3]
end

local UPGRADE = "GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n" ..
  "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"

describe("core.http_listen", function()
  it("answers the handshake with RFC 6455's accept key, sends fragments, pongs pings, echoes the close", function()
    with_core_server(function(srv, id)
      assert(srv:write(id, "ab", false, true)) -- a fragment: the message goes on
      assert(srv:write(id, "cd"))
    end, function(_, port, events)
      local conn = client.connect(port)
      conn:send(UPGRADE)
      local head = conn:read_until("^HTTP/1%.1 101 .-\r\n\r\n")
      assert.matches("\r\nsec%-websocket%-accept: s3pPLMBiTxaQ9kYGzzhZRbK%+xOo=\r\n", head)
      conn.buf = conn.buf:sub(#head + 1)
      assert.same({ false, 1, "ab" }, { next_frame(conn) })
      assert.same({ true, 0, "cd" }, { next_frame(conn) })
      conn:send(frame(9, "are you there"))
      assert.same({ true, 10, "are you there" }, { next_frame(conn) })
      conn:send(frame(8, "\3\232bye")) -- 1000
      assert.same({ true, 8, "\3\232" }, { next_frame(conn) })
      assert.is_true(conn:wait_eof())
      conn:close()
      moonbox.timeout(5000, function() while events[#events] ~= "closed 1" do moonbox.sleep(10) end end)
    end)
  end)

  it("closes with 1002 on an unmasked frame and 1009 on a message over max_body", function()
    with_core_server(function() end, function(_, port)
      local too_long = frame(1, ("x"):rep(100), false) .. frame(0, ("y"):rep(100), false)
        .. frame(0, ("z"):rep(120), false):rep(8) -- 1160 bytes, in fragments
      for _, case in ipairs { { "\129\5hello", 1002 }, { too_long, 1009 } } do
        local conn = client.connect(port)
        conn:send(UPGRADE)
        local head = conn:read_until("^HTTP/1%.1 101 .-\r\n\r\n")
        conn.buf = conn.buf:sub(#head + 1)
        conn:send(case[1])
        local _, opcode, payload = next_frame(conn)
        assert.equal(8, opcode)
        assert.equal(case[2], payload:byte(1) * 256 + payload:byte(2))
        assert.is_true(conn:wait_eof())
        conn:close()
      end
    end)
  end)

  it("reads one request at a time: a client that pipelines and never reads is not read on", function()
    local answered = 0
    local big = ("x"):rep(100 * 1024)
    with_core_server(function(srv, id)
      answered = answered + 1
      srv:respond(id, 200, "text/plain", nil, nil, big)
    end, function(srv, port)
      local conn = client.connect(port)
      conn.stream:read_stop()
      conn:send(("GET / HTTP/1.1\r\nHost: x\r\n\r\n"):rep(500))
      moonbox.sleep(500)
      -- what the socket buffers hold, not 500 responses (50 MB) in memory
      assert.is_true(answered > 0 and answered < 200, "answered " .. answered)
      assert.equal(1, srv:connections())
      conn:close()
    end)
  end)

  it("drops a WebSocket peer that takes none of our frames for an idle period, even while it keeps sending", function()
    local big = ("w"):rep(32 * 1024 * 1024) -- more than the sockets' buffers hold
    run_task(function()
      local closed = {}
      local srv
      srv = assert(core.http_listen({ host = "127.0.0.1", port = 0, idle_timeout_ms = 300 }, function(kind, id)
        if kind == "request" then assert(srv:write(id, big))
        elseif kind == "closed" then closed[#closed + 1] = id end
      end))
      local ok, err = pcall(function()
        local conn = client.connect(srv:port())
        conn:send(UPGRADE)
        conn:read_until("^HTTP/1%.1 101 .-\r\n\r\n")
        conn.stream:read_stop() -- and never reads again
        local t0 = core.hrtime() / 1e6
        moonbox.timeout(10000, function()
          while #closed < 1 do
            conn:send(frame(1, "still here")) -- (what a quiet peer's hang-up timer would count)
            moonbox.sleep(50)
          end
        end)
        local took = core.hrtime() / 1e6 - t0
        assert.equal(0, srv:connections())
        assert.is_true(took >= 250, ("dropped after %d ms"):format(took))
        conn:close()
      end)
      async.await(function(resume) srv:close(resume) end)
      if not ok then error(err, 0) end
    end)
  end)

  it("sends a large body from the Lua string itself: intact after the caller dropped it, collected", function()
    -- 4 MiB in 64 blocks of 64 KiB, each its own bytes, made afresh in the
    -- handler: respond's body and write's data are anchored, not copied,
    -- until the socket took them. (The client checks block by block and
    -- never makes the whole string: LuaJIT interns strings, and an equal
    -- one held here would keep the server's alive.)
    local function block(tag, j) return (tag .. string.char(48 + j)):rep(32768) end
    local function body(tag)
      local blocks = {}
      for j = 1, 64 do blocks[j] = block(tag, j) end
      return table.concat(blocks)
    end
    with_core_server(function(srv, id, req)
      if req.path == "/whole" then
        srv:respond(id, 200, "text/plain", nil, nil, body("r"))
      else
        srv:respond(id, 200, "text/plain", nil, 2 * 4194304)
        srv:write(id, body("a"))
        srv:write(id, body("b"))
        srv:finish(id)
      end
      collectgarbage()
      collectgarbage()
    end, function(_, port)
      for _, case in ipairs { { "/whole", { "r" } }, { "/streamed", { "a", "b" } } } do
        local conn = client.connect(port)
        conn:send("GET " .. case[1] .. " HTTP/1.1\r\nHost: x\r\n\r\n")
        local status, _, got = conn:response()
        assert.equal(200, status)
        assert.equal(#case[2] * 4194304, #got)
        for b, tag in ipairs(case[2]) do
          for j = 1, 64 do
            local at = (b - 1) * 4194304 + (j - 1) * 65536
            assert.is_true(got:sub(at + 1, at + 65536) == block(tag, j),
              ("%s: block %s%d differs"):format(case[1], tag, j))
          end
        end
        conn:close()
      end
    end)
  end)

  it("does not cut off a slow reader of one large write while bytes move; drops one that reads nothing", function()
    -- idle 300 ms; one 32 MiB write (more than the sockets' buffers hold),
    -- read 1 MiB at a time with 50 ms pauses: the write completes only at
    -- the end, long after an idle period, but the client takes bytes all
    -- along. A client that reads nothing is dropped at the idle timeout.
    local big = ("z"):rep(32 * 1024 * 1024)
    run_task(function()
      local closed = {} -- ids closed before their response ended
      local srv
      srv = assert(core.http_listen({ host = "127.0.0.1", port = 0, idle_timeout_ms = 300 }, function(kind, id)
        if kind == "request" then srv:respond(id, 200, "text/plain", nil, nil, big)
        elseif kind == "closed" then closed[#closed + 1] = id end
      end))
      local function open()
        local fd, err = async.await(function(resume)
          assert(core.tcp_connect("127.0.0.1", srv:port(), function(e, f) resume(f, e) end))
        end)
        local stream = assert(core.stream_open(assert(fd, err)))
        stream:write("GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return stream
      end
      local ok, err = pcall(function()
        local slow = open()
        local got, since, eof, wake = 0, 0, false, nil
        local function on_read(_, data)
          if not data then eof = true
          else
            got, since = got + #data, since + #data
            if since >= 1024 * 1024 then slow:read_stop() end
          end
          if wake and (eof or since >= 1024 * 1024) then
            local w = wake
            wake = nil
            w()
          end
        end
        moonbox.timeout(60000, function()
          slow:read_start(on_read)
          while not eof do
            if since >= 1024 * 1024 then
              moonbox.sleep(50)
              since = 0
              slow:read_start(on_read)
            end
            async.await(function(resume)
              if eof or since >= 1024 * 1024 then return resume() end
              wake = resume
              return function() wake = nil end
            end)
          end
        end)
        slow:close()
        assert.is_true(got > #big, ("the slow reader got %d bytes of %d"):format(got, #big))
        moonbox.timeout(10000, function()
          while srv:connections() > 0 do moonbox.sleep(20) end
        end)
        local deaf = open() -- never read
        local t0 = core.hrtime() / 1e6
        moonbox.timeout(10000, function()
          while #closed < 1 do moonbox.sleep(20) end -- (its response was under way: "closed" names it)
        end)
        assert.equal(0, srv:connections())
        deaf:close()
        local took = core.hrtime() / 1e6 - t0
        assert.is_true(took >= 250 and took < 300 * 8, ("dropped after %d ms"):format(took))
      end)
      async.await(function(resume) srv:close(resume) end)
      if not ok then error(err, 0) end
    end)
  end)

  it("sends 100 Continue before a body the client holds back, and no body to HEAD", function()
    with_core_server(function(srv, id, req, body)
      srv:respond(id, 200, "text/plain", nil, nil, req.method .. " " .. body)
    end, function(_, port)
      local conn = client.connect(port)
      conn:send("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
      assert.truthy(conn:read_until("^HTTP/1%.1 100 Continue\r\n\r\n"))
      conn.buf = ""
      conn:send("hello")
      local status, _, body = conn:response()
      assert.same({ 200, "POST hello" }, { status, body })
      conn:send("HEAD / HTTP/1.1\r\nHost: x\r\n\r\n")
      local head = conn:read_until("^HTTP/1%.1 200 .-\r\n\r\n")
      assert.matches("\r\ncontent%-length: 5\r\n", head)
      conn:send("GET / HTTP/1.1\r\nHost: x\r\n\r\n")
      assert.truthy(conn:read_until("\r\n\r\nGET $"))
      assert.is_nil(conn.buf:sub(#head + 1):match("^HEAD"), "a body followed the HEAD response")
      conn:close()
    end)
  end)
end)
