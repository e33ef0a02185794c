-- moonbox.server.terminal_ws: a session's terminal over a WebSocket, with
-- replay on reconnect, driven by a real WebSocket client (node).
local cjson = require "cjson"
local http = require "moonbox.server.http"
local terminal_ws = require "moonbox.server.terminal_ws"
local client = require "server.client"

-- (the client's "expect" steps are JavaScript regular expressions)

-- with_sandbox(fn(sb, base_url)): a server routing /<sessionId> to the session's terminal.
local function with_terminal_server(fn)
  helper.with_sandbox(function(sb)
    local server = http.listen({ listen = "127.0.0.1:0" }, function(req, res)
      return terminal_ws.handle(req, res, sb.id, req.path:sub(2))
    end)
    local ok, err = pcall(fn, sb, "ws://" .. server.address)
    server:close()
    if not ok then error(err, 0) end
  end)
end

local function texts(events)
  local out = {}
  for _, e in ipairs(events) do if e.text then out[#out + 1] = cjson.decode(e.text) end end
  return out
end

local function binary(events)
  local out = {}
  for _, e in ipairs(events) do if e.binary then out[#out + 1] = e.binary end end
  return table.concat(out)
end

describe("terminal over WebSocket", function()
  it("refuses a plain request and an unknown session before upgrading", function()
    with_terminal_server(function(_, url)
      local http_url = url:gsub("^ws:", "http:")
      local out = client.curl("-i", http_url .. "/default")
      assert.matches("^HTTP/1%.1 426", out)
      local events = client.ws_client(url .. "/nope", {})
      assert.matches("non%-101", events[1].error) -- the handshake got a 404
      out = client.curl("-i", "-H", "Upgrade: websocket", "-H", "Connection: Upgrade",
        "-H", "Sec-WebSocket-Version: 13", "-H", "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==", http_url .. "/nope")
      assert.matches("^HTTP/1%.[01] 404", out)
      assert.equal("SESSION_NOT_FOUND", cjson.decode(out:match("\r\n\r\n(.*)$")).code)
    end)
  end)

  it("sends ready, runs typed input (binary frames), applies resize (a text frame)", function()
    with_terminal_server(function(_, url)
      local events = client.ws_client(url .. "/default?cols=100&rows=30", {
        { expect = '"type":"ready"' },
        { binary = "echo hi-$((40+2))\n" }, { expect = "hi-42" },
        { send = cjson.encode { type = "resize", cols = 120, rows = 40 } },
        { binary = "stty size\n" }, { expect = "40 120" },
        { send = cjson.encode { type = "bogus" } }, { expect = "unknown control message" },
        { close = 1000 },
      })
      local ready = texts(events)[1]
      assert.same({ "ready", 100, 30, "default" }, { ready.type, ready.cols, ready.rows, ready.sessionId })
      assert.matches("\rhi%-42\r\n", binary(events))
      assert.matches("\r40 120\r\n", binary(events))
      assert.same({ close = 1000, reason = "" }, events[#events])
    end)
  end)

  it("replays the last output to a client that reconnects, then goes on live", function()
    with_terminal_server(function(_, url)
      client.ws_client(url .. "/default", {
        { expect = '"ready"' }, { binary = "export MARK=first; echo mark-$MARK\n" }, { expect = "mark-first" },
        { close = 1000 },
      })
      assert.equal(1, terminal_ws.count())
      local events = client.ws_client(url .. "/default", {
        { expect = "mark-first" }, { binary = "echo again-$MARK\n" }, { expect = "again-first" }, { close = 1000 },
      })
      local ready = texts(events)[1]
      assert.equal("ready", ready.type)
      assert.is_true(ready.replayBytes > 0)
      assert.matches("mark%-first", events[3].binary) -- the replay is the frame after ready
      assert.matches("\ragain%-first\r\n", binary(events)) -- the shell's state lived on
    end)
  end)

  it("keeps only the last REPLAY_BYTES for replay", function()
    with_terminal_server(function(_, url)
      client.ws_client(url .. "/default", {
        { expect = '"ready"' },
        { binary = "head -c 400000 /dev/zero | tr '\\0' x; echo; echo END-$((1+1))\n" }, { expect = "END-2" },
        { close = 1000 },
      })
      local events = client.ws_client(url .. "/default", { { expect = "END-2" }, { close = 1000 } })
      local replay = events[3].binary
      assert.equal(terminal_ws.REPLAY_BYTES, #replay)
      assert.matches("END%-2", replay)
    end)
  end)

  it("reports the shell's exit code and closes; the next connection gets a new shell", function()
    with_terminal_server(function(sb, url)
      local events = client.ws_client(url .. "/default", {
        { expect = '"ready"' }, { binary = "exit 3\n" }, { expect = '"type":"exit"' },
      })
      local msgs = texts(events)
      assert.same({ type = "exit", code = 3 }, msgs[#msgs])
      assert.same({ close = 1000, reason = "exited" }, events[#events])
      -- the exited terminal is released (pty, cgroup): no longer the sandbox's
      assert.is_true(helper.eventually(function() return next(sb.terminals or {}) == nil end, 5000))
      local first_pid = msgs[1].pid
      events = client.ws_client(url .. "/default", { { expect = '"ready"' }, { close = 1000 } })
      local ready = texts(events)[1]
      assert.are_not.equal(first_pid, ready.pid)
      assert.equal(0, ready.replayBytes)
      -- a shell that exits while no client is connected is released too
      client.ws_client(url .. "/default", { { expect = '"ready"' }, { close = 1000 } })
      local live
      for t in pairs(sb.terminals) do live = t end
      assert.is_false(live.exited)
      live:write("exit 4\n")
      assert.equal(4, live:wait())
      assert.is_true(helper.eventually(function() return live.closed and sb.terminals[live] == nil end, 5000))
    end)
  end)
end)
