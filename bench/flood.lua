-- Floods against `moonbox serve` (issue #29, findings 1 and 5): another
-- sandbox's exec("true") through the HTTP API, p50/p99, and the server's
-- RSS, first with no flood (the baseline) and then in the same run with
-- both floods opening and then holding:
--   ws:   W clients with no token open a public port's WebSocket service
--         that sends 16 MiB frames (spec/server/hostile_app.py), read the
--         101 and nothing more;
--   exec: E clients ask /exec for 16 MiB of control characters (96 MiB of
--         JSON), read the response head and nothing more.
-- The server is `moonbox serve` in a child process, so its RSS is its own;
-- the clients run on this loop.
-- Run: ./build/moonbox bench/flood.lua [execs per phase] [W] [E] [extra serve args...]
-- (FLOOD_WHOLE_OPENING=1: the opening phase goes on until every flood is in place)
-- (MOONBOX_LUA_DIR=/other/tree/lua runs the server on that tree's Lua.)
local moonbox = require "moonbox"
io.stdout:setvbuf("line")
local core = require "moonbox.core"
local async = require "moonbox.async"
local cjson = require "cjson"

local N = tonumber(arg and arg[1]) or 300
local WS_CLIENTS = tonumber(arg and arg[2]) or 6
local EXEC_CLIENTS = tonumber(arg and arg[3]) or 11
local EXTRA = {}
for i = 4, #(arg or {}) do EXTRA[#EXTRA + 1] = arg[i] end
local MB = 1024 * 1024
local TOKEN = "flood-bench-token-0123456789abcdef"
local SOURCE = os.getenv("MOONBOX_SOURCE_DIR") or "."

local function ms() return core.hrtime() / 1e6 end

local function quantiles(samples)
  local s = {}
  for i, v in ipairs(samples) do s[i] = v end
  table.sort(s)
  local function q(p) return s[math.max(1, math.floor(#s * p + 0.5))] end
  return q(0.5), q(0.99), s[#s]
end

local function status_mb(pid, field)
  local f = io.open("/proc/" .. pid .. "/status")
  if not f then return 0 end
  local text = f:read("*a")
  f:close()
  return (tonumber(text:match(field .. ":%s*(%d+) kB")) or 0) / 1024
end

-- ---- a small HTTP/1.1 client on the loop ------------------------------------------

local Conn = {}
Conn.__index = Conn

local function connect(port)
  local fd, err = async.await(function(resume)
    assert(core.tcp_connect("127.0.0.1", port, function(e, f) resume(f, e) end))
  end)
  if not fd then return nil, err end
  local c = setmetatable({ parts = {}, size = 0, eof = false, stream = assert(core.stream_open(fd)) }, Conn)
  c.stream:read_start(function(_, data)
    if data then
      c.parts[#c.parts + 1] = data
      c.size = c.size + #data
    else
      c.eof = true
    end
    local w = c.waiter
    if w then c.waiter = nil w() end
  end)
  return c
end

-- Wait until ready(buffered text) returns something, or EOF (nil).
function Conn:wait(ready)
  while true do
    if #self.parts > 1 then self.parts = { table.concat(self.parts) } end
    local r = ready(self.parts[1] or "")
    if r ~= nil or self.eof then return r end
    async.await(function(resume)
      self.waiter = resume
      return function() self.waiter = nil end
    end)
  end
end

-- One response: status, body (by content-length).
function Conn:response()
  local r = self:wait(function(buf)
    local e = buf:find("\r\n\r\n", 1, true)
    if not e then return nil end
    local head = buf:sub(1, e + 3)
    local len = tonumber(head:lower():match("\r\ncontent%-length:%s*(%d+)")) or 0
    if #buf < e + 3 + len then return nil end
    self.parts = { buf:sub(e + 4 + len) }
    return { tonumber(head:match("^HTTP/1%.1 (%d+)")), buf:sub(e + 4, e + 3 + len) }
  end)
  if not r then return nil end
  return r[1], r[2]
end

-- Read up to the end of the response head, then stop reading for good.
function Conn:stall()
  local head = self:wait(function(buf) return buf:match("^(HTTP/1%.1 %d+.-\r\n\r\n)") end)
  self.stream:read_stop()
  return head
end

function Conn:close()
  if not self.stream:is_closing() then self.stream:close() end
end

local function request(method, path, body, extra)
  body = body and (type(body) == "string" and body or cjson.encode(body)) or ""
  return ("%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\n" ..
    "Content-Length: %d\r\n%s\r\n%s"):format(method, path, TOKEN, #body, extra or "", body)
end

-- call(port, method, path, body) -> status, decoded body (a connection each)
local function call(port, method, path, body)
  local c = assert(connect(port))
  c.stream:write(request(method, path, body, "Connection: close\r\n"))
  local status, text = c:response()
  c:close()
  return status, text and text ~= "" and cjson.decode(text) or nil
end

-- ---- the server ----------------------------------------------------------------------

local function moonbox_bin()
  local f = assert(io.open("/proc/self/exe"))
  f:close()
  local p = io.popen("readlink /proc/" .. core.getpid() .. "/exe")
  local path = p:read("*l")
  p:close()
  return path
end

local function start_server(port, home)
  local token_file = home .. "/token"
  local f = assert(io.open(token_file, "w"))
  f:write(TOKEN, "\n")
  f:close()
  local args = { moonbox_bin(), "serve", "--listen", "127.0.0.1:" .. port, "--token-file", token_file,
    "--access-log", "off" }
  for _, a in ipairs(EXTRA) do args[#args + 1] = a end
  -- (MOONBOX_LUA_DIR passed on: the same bench against another tree's Lua)
  local env = { PATH = "/usr/local/bin:/usr/bin:/bin", MOONBOX_HOME = home, HOME = home,
    MOONBOX_LUA_DIR = os.getenv("MOONBOX_LUA_DIR") }
  local proc = assert(core.spawn { args = args, env = env, stdio = { [0] = "null", [1] = "null", [2] = "inherit" } })
  for _ = 1, 500 do
    local c = connect(port)
    if c then c:close() return proc end
    moonbox.sleep(20)
  end
  error("the server did not start")
end

-- ---- phases ---------------------------------------------------------------------------

-- N execs of `true` in the victim sandbox on one keep-alive connection:
-- latencies (ms) and the server's RSS after each. A call that fails (the
-- connection closed under it) counts with the time it took, and the next
-- goes on a new connection.
local function victim_run(port, pid, more)
  local c = assert(connect(port))
  local lat, rss, failed = {}, {}, 0
  local i = 0
  while i < N or (more and more()) do
    i = i + 1
    local t0 = ms()
    c.stream:write(request("POST", "/v1/sandboxes/victim/exec", { command = "true" }))
    local status = c:response()
    lat[i] = ms() - t0
    if status ~= 200 then
      failed = failed + 1
      c:close()
      c = assert(connect(port))
    end
    rss[i] = status_mb(pid, "VmRSS")
  end
  c:close()
  return lat, rss, failed
end

local function report(name, lat, rss, failed, pid)
  local p50, p99, max = quantiles(lat)
  local _, _, rss_max = quantiles(rss)
  print(("| %s | %d | %d | %.1f | %.1f | %.0f | %.0f | %.0f |"):format(name, #lat, failed, p50, p99, max, rss_max,
    status_mb(pid, "VmHWM")))
  io.stdout:flush()
end

local function setup_flooder(port)
  local app = assert(io.open(SOURCE .. "/spec/server/hostile_app.py")):read("*a")
  local status = call(port, "PUT", "/v1/sandboxes/flooder/files/raw?path=/workspace/app.py", app)
  assert(status == 200, "write app: " .. tostring(status))
  local r
  status, r = call(port, "POST", "/v1/sandboxes/flooder/processes", { command = "exec python3 /workspace/app.py 8000" })
  assert(status == 200, "start app: " .. tostring(status))
  status = call(port, "POST", "/v1/sandboxes/flooder/processes/" .. r.id .. "/wait", { port = 8000, timeout = 20000 })
  assert(status == 200, "wait app: " .. tostring(status))
  status = call(port, "POST", "/v1/sandboxes/flooder/ports", { port = 8000, public = true })
  assert(status == 200, "expose: " .. tostring(status))
  for i = 1, EXEC_CLIENTS do -- a session each: the floods' commands run side by side
    status = call(port, "POST", "/v1/sandboxes/flooder/sessions", { id = "f" .. i })
    assert(status == 200, "session: " .. tostring(status))
  end
end

-- Open the floods; each client stalls once its head is in. -> the clients, statuses seen
local function start_floods(port)
  local clients, seen = {}, {}
  local function note(head)
    local s = head and head:match("^HTTP/1%.1 (%d+)") or "closed"
    seen[s] = (seen[s] or 0) + 1
  end
  local tasks = {}
  for i = 1, WS_CLIENTS do
    tasks[#tasks + 1] = moonbox.spawn(function()
      local c = assert(connect(port))
      clients[#clients + 1] = c
      c.stream:write(("GET /v1/sandboxes/flooder/ports/8000/flood?n=64&size=%d HTTP/1.1\r\nHost: x\r\n" ..
        "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n" ..
        "Sec-WebSocket-Version: 13\r\n\r\n"):format(16 * MB))
      note(c:stall())
    end)
    local _ = i
  end
  for i = 1, EXEC_CLIENTS do
    tasks[#tasks + 1] = moonbox.spawn(function()
      local c = assert(connect(port))
      clients[#clients + 1] = c
      c.stream:write(request("POST", "/v1/sandboxes/flooder/exec",
        { command = "head -c 16777216 /dev/zero | tr '\\0' '\\1'", sessionId = "f" .. i }))
      note(c:stall())
    end)
  end
  for _, t in ipairs(tasks) do t:wait() end
  return clients, seen
end

moonbox.run(function()
  local home = os.tmpname() .. ".d"
  assert(os.execute("mkdir -p " .. home))
  local port = 20000 + core.getpid() % 20000
  local server = start_server(port, home)
  local pid = server:pid()
  local ok, err = pcall(function()
    -- (a victim that cannot run says why: e.g. ISOLATION_UNAVAILABLE)
    local status, body = call(port, "POST", "/v1/sandboxes/victim/exec", { command = "true" })
    assert(status == 200, "victim exec: " .. tostring(status) .. " " .. tostring(body and cjson.encode(body)))
    setup_flooder(port)
    print(("another sandbox's exec(\"true\") over HTTP, %d per phase; floods: %d WebSocket clients of a " ..
      "public port sending 16 MiB frames, %d exec clients of 16 MiB control-character output; none reads")
      :format(N, WS_CLIENTS, EXEC_CLIENTS))
    print("| phase | execs | failed | p50 ms | p99 ms | max ms | server RSS max MB | server VmHWM MB |")
    print("|---|---|---|---|---|---|---|---|")
    local lat, rss, failed = victim_run(port, pid)
    report("baseline", lat, rss, failed, pid)
    -- while the floods open (their commands run, their output is kept and
    -- encoded), then while they hold
    local t0, opened = ms(), nil
    local floods = moonbox.spawn(function()
      local clients, seen = start_floods(port)
      opened = ms() - t0
      return { clients, seen }
    end)
    -- (FLOOD_WHOLE_OPENING=1: on past N execs until every flood is in place,
    -- so the phase covers the whole opening however fast the victim is)
    lat, rss, failed = victim_run(port, pid, os.getenv("FLOOD_WHOLE_OPENING") == "1" and function()
      return opened == nil
    end)
    report("while the floods open", lat, rss, failed, pid)
    local clients, seen = unpack(floods:wait())
    lat, rss, failed = victim_run(port, pid)
    report("while the floods hold", lat, rss, failed, pid)
    local parts = {}
    for s, n in pairs(seen) do parts[#parts + 1] = s .. " x" .. n end
    table.sort(parts)
    print(("flood heads: %s (all in place after %.0f ms)"):format(table.concat(parts, ", "), opened))
    for _, c in ipairs(clients) do c:close() end
  end)
  call(port, "DELETE", "/v1/sandboxes/flooder")
  call(port, "DELETE", "/v1/sandboxes/victim")
  server:kill("SIGTERM")
  while server:status() ~= "exited" do moonbox.sleep(20) end
  os.execute("rm -rf " .. home)
  if not ok then error(err, 0) end
end)
