-- Clients for the server specs, all on the loop (a blocking io.popen would
-- stall the server it talks to): programs run with core.spawn, and a raw
-- TCP client for what curl cannot do on purpose (slow, partial, rude).
local core = require "moonbox.core"
local async = require "moonbox.async"
local moonbox = require "moonbox"

local M = {}

M.PATH = "/usr/local/bin:/usr/bin:/bin"
M.SOURCE = os.getenv("MOONBOX_SOURCE_DIR") or "."

-- The environment of programs the specs run (the sanitizer build's moonbox
-- needs its sanitizer options: leak reports at exit are not ours to judge).
function M.env(extra)
  local env = { PATH = M.PATH, HOME = os.getenv("HOME") or "/tmp",
    ASAN_OPTIONS = os.getenv("ASAN_OPTIONS"), UBSAN_OPTIONS = os.getenv("UBSAN_OPTIONS") }
  for k, v in pairs(extra or {}) do env[k] = v end
  return env
end

-- run(argv[, stdin]) -> stdout, stderr, exit code
function M.run(args, stdin)
  local exit = {}
  local proc, pipes = core.spawn {
    args = args, env = M.env(),
    stdio = { [0] = stdin and "pipe" or "null", [1] = "pipe", [2] = "pipe" },
    on_exit = function(code)
      exit.code = code
      if exit.resume then exit.resume() end
    end,
  }
  assert(proc, pipes)
  if stdin then
    pipes[0]:write(stdin)
    pipes[0]:shutdown(function() pipes[0]:close() end)
  end
  local out = moonbox.all(function() return helper.read_all(pipes[1]) end,
    function() return helper.read_all(pipes[2]) end)
  pipes[1]:close()
  pipes[2]:close()
  if exit.code == nil then async.await(function(resume) exit.resume = resume end) end
  return out[1], out[2], exit.code
end

function M.curl(...)
  return M.run { "curl", "-sS", "--max-time", "20", ... }
end

-- node with the built-in WebSocket (a flag on Node 20)
function M.ws_client(url, steps)
  local cjson = require "cjson"
  local out, err, code = M.run { "node", "--no-warnings", "--experimental-websocket",
    M.SOURCE .. "/spec/server/ws_client.js", url, cjson.encode(steps) }
  local events = {}
  for line in out:gmatch("[^\n]+") do events[#events + 1] = cjson.decode(line) end
  return events, err, code
end

-- ---- raw TCP -------------------------------------------------------------------

local Conn = {}
Conn.__index = Conn

function M.connect(port)
  local fd, err = async.await(function(resume)
    assert(core.tcp_connect("127.0.0.1", port, function(e, f) resume(f, e) end))
  end)
  assert(fd, err)
  local c = setmetatable({ buf = "", eof = false, stream = assert(core.stream_open(fd)) }, Conn)
  c.stream:read_start(function(_, data)
    if data then c.buf = c.buf .. data else c.eof = true end
    local w = c.waiter
    if w then c.waiter = nil w() end
  end)
  return c
end

function Conn:send(data) return self.stream:write(data) end

-- Wait until ready(buf) returns something (returned) or the peer closes
-- (nil); fails after 10 s.
function Conn:wait_for(ready)
  return moonbox.timeout(10000, function()
    while true do
      local r = ready(self.buf)
      if r ~= nil then return r end
      if self.eof then return nil end
      async.await(function(resume)
        self.waiter = resume
        return function() self.waiter = nil end
      end)
    end
  end)
end

-- The first match of pattern in what was received (nil if the peer closes first).
function Conn:read_until(pattern)
  return self:wait_for(function(buf)
    local s, e = buf:find(pattern)
    if s then return buf:sub(s, e) end
  end)
end

-- Wait until the peer closes the connection (fails after 10 s).
function Conn:wait_eof()
  self:wait_for(function() return nil end)
  return self.eof
end

-- One whole response: status, headers (lowercase), body (by content-length).
function Conn:response()
  local head = self:read_until("^HTTP/1%.[01] %d+.-\r\n\r\n")
  if not head then return nil end
  self.buf = self.buf:sub(#head + 1)
  local status = tonumber(head:match("^HTTP/1%.[01] (%d+)"))
  local headers = {}
  for k, v in head:gmatch("\r\n([^:\r\n]+):%s*([^\r\n]*)") do headers[k:lower()] = v end
  local len = tonumber(headers["content-length"] or 0)
  self:wait_for(function(buf) return #buf >= len or nil end)
  local body = self.buf:sub(1, len)
  self.buf = self.buf:sub(len + 1)
  return status, headers, body
end

function Conn:close()
  if not self.stream:is_closing() then self.stream:close() end
end

return M
