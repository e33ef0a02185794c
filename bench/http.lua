-- HTTP API benchmark (issue #7): wrk on loopback against
-- POST /v1/sandboxes/b/exec of `true`, in one warm session and across 50
-- sessions, with the same exec called from Lua in the same run as the
-- baseline. The server runs in this process, on this loop; wrk is a child.
-- Needs wrk (Debian package `wrk`).
-- Run: ./build/moonbox bench/http.lua [seconds per wrk run] [Lua iterations]
local moonbox = require "moonbox"
local core = require "moonbox.core"
local async = require "moonbox.async"
local http = require "moonbox.server.http"
local api = require "moonbox.server.api"

local SECONDS = tonumber(arg and arg[1]) or 10
local N = tonumber(arg and arg[2]) or 5000
local SESSIONS = 50

local function ms() return core.hrtime() / 1e6 end
local function quantiles(samples)
  table.sort(samples)
  local function q(p) return samples[math.max(1, math.floor(#samples * p + 0.5))] end
  return q(0.5), q(0.99)
end

-- A wrk script: POST exec of `true`, sessionId chosen round robin over
-- `sessions` (none: the default session).
local function wrk_script(sessions)
  local path = os.tmpname()
  local f = assert(io.open(path, "w"))
  f:write([[
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local sessions, n = ]], tostring(sessions or 0), [[, 0
request = function()
  n = n + 1
  local body = '{"command":"true"}'
  if sessions > 0 then
    body = '{"command":"true","sessionId":"s' .. (n % sessions + 1) .. '"}'
  end
  return wrk.format(nil, nil, nil, body)
end
]])
  f:close()
  return path
end

-- Run wrk as a child (the loop keeps serving meanwhile); its report.
local function wrk(url, connections, threads, script)
  local proc, pipes = assert(core.spawn {
    args = { "wrk", "-t" .. threads, "-c" .. connections, "-d" .. SECONDS .. "s", "--latency", "-s", script, url },
    env = { PATH = "/usr/bin:/bin" }, stdio = { [0] = "null", [1] = "pipe", [2] = "pipe" },
  })
  local out = async.await(function(resume)
    local parts = {}
    pipes[1]:read_start(function(_, data)
      if data then parts[#parts + 1] = data else resume(table.concat(parts)) end
    end)
  end)
  pipes[1]:close()
  pipes[2]:close()
  while proc:status() ~= "exited" do moonbox.sleep(5) end
  local function latency(p)
    local v, unit = out:match("%s" .. p .. "%%%s+([%d%.]+)(%a+)")
    v = tonumber(v)
    if not v then return nil end
    return unit == "us" and v / 1000 or unit == "s" and v * 1000 or v
  end
  return {
    rps = tonumber(out:match("Requests/sec:%s+([%d%.]+)")),
    p50 = latency(50), p99 = latency(99),
    non2xx = tonumber(out:match("Non%-2xx or 3xx responses:%s+(%d+)")) or 0,
    errors = out:match("Socket errors:[^\n]*"),
    raw = out,
  }
end

moonbox.run(function()
  local home = os.tmpname() .. ".d"
  api.configure { home = home }
  local server = http.listen({ listen = "127.0.0.1:0" }, api.handle)
  local url = "http://" .. server.address .. "/v1/sandboxes/b/exec"
  local sb = moonbox.getSandbox("b", { root = home .. "/sandboxes/b" }) -- the server's sandbox "b"
  for i = 1, SESSIONS do sb:createSession { id = "s" .. i } end
  local default = sb:getSession("default")

  -- baseline: the same exec from Lua, one warm session, sequential
  for _ = 1, 200 do default:exec("true") end
  local samples = {}
  for i = 1, N do
    local t = ms()
    default:exec("true")
    samples[i] = ms() - t
  end
  local lua50, lua99 = quantiles(samples)
  local t = ms()
  for _ = 1, N do default:exec("true") end
  local lua_rps = N / ((ms() - t) / 1000)

  -- the API layer alone: api.handle with a request table, no socket
  local function handle()
    return api.handle({ method = "POST", path = "/v1/sandboxes/b/exec", query = {}, headers = {},
      body = '{"command":"true"}' }, {})
  end
  for i = 1, N do
    local t0 = ms()
    assert(handle().status == 200)
    samples[i] = ms() - t0
  end
  local api50, api99 = quantiles(samples)

  -- Lua, 50 sessions at once: the throughput ceiling HTTP is held against
  t = ms()
  local per = math.floor(N / SESSIONS)
  local fns = {}
  for i = 1, SESSIONS do
    local s = sb:getSession("s" .. i)
    fns[i] = function() for _ = 1, per do s:exec("true") end end
  end
  moonbox.all(fns)
  local lua_multi_rps = per * SESSIONS / ((ms() - t) / 1000)

  local one = wrk_script(nil)
  local many = wrk_script(SESSIONS)
  wrk(url, 1, 1, one) -- warm-up
  local seq = wrk(url, 1, 1, one)
  local conc = wrk(url, SESSIONS, 2, many)
  os.remove(one)
  os.remove(many)

  print(("wrk %d s per run; Lua baseline over %d calls; %d sessions"):format(SECONDS, N, SESSIONS))
  print("| measurement | req/s | p50 ms | p99 ms | non-2xx |")
  print("|---|---|---|---|---|")
  print(("| Lua `exec(\"true\")`, one session, sequential | %.0f | %.3f | %.3f | - |"):format(lua_rps, lua50, lua99))
  print(("| `api.handle` of the request, no socket, sequential | - | %.3f | %.3f | - |"):format(api50, api99))
  print(("| HTTP, one warm session, 1 connection (`wrk -c1`) | %.0f | %.3f | %.3f | %d |"):format(
    seq.rps, seq.p50, seq.p99, seq.non2xx))
  print(("| Lua, %d sessions concurrently (`moonbox.all`) | %.0f | - | - | - |"):format(SESSIONS, lua_multi_rps))
  print(("| HTTP, %d sessions, %d connections (`wrk -t2 -c%d`) | %.0f | %.3f | %.3f | %d |"):format(
    SESSIONS, SESSIONS, SESSIONS, conc.rps, conc.p50, conc.p99, conc.non2xx))
  print(("HTTP overhead at p50 (one session): %.3f ms, of which the API layer %.3f ms"):format(
    seq.p50 - lua50, api50 - lua50))
  if seq.errors or conc.errors then print("wrk socket errors:", seq.errors, conc.errors) end

  server:close()
  sb:destroy()
  os.remove(home)
end)
