-- The container protocol's adapter alone (issue #16): api.handle of
-- POST /v1/sandboxes/b/api/execute against POST /v1/sandboxes/b/exec, both
-- `true` in one warm session, request tables and no socket, taking turns
-- in blocks of 100 so load on the machine weighs on both alike.
-- Run: ./build/moonbox bench/compat_handle.lua [iterations per route]
local moonbox = require "moonbox"
local core = require "moonbox.core"
local api = require "moonbox.server.api"

local N = tonumber(arg and arg[1]) or 5000
local BLOCK = 100

local function ms() return core.hrtime() / 1e6 end
local function quantiles(samples)
  table.sort(samples)
  local function q(p) return samples[math.max(1, math.floor(#samples * p + 0.5))] end
  return q(0.5), q(0.99)
end

moonbox.run(function()
  local home = os.tmpname()
  os.remove(home)
  api.configure { home = home }
  local routes = {
    { "/v1/exec", "/v1/sandboxes/b/exec", '{"command":"true","sessionId":"s"}' },
    { "/api/execute", "/v1/sandboxes/b/api/execute", '{"command":"true","sessionId":"s"}' },
  }
  local samples = { {}, {} }
  local function call(r)
    local res = api.handle({ method = "POST", path = r[2], query = {}, headers = {}, body = r[3] }, {})
    assert(res.status == 200, res.body)
  end
  -- warm: the compat route makes session s on first use, then both are hot
  for i = #routes, 1, -1 do for _ = 1, 200 do call(routes[i]) end end
  for _ = 1, N / BLOCK do
    for i, r in ipairs(routes) do
      for _ = 1, BLOCK do
        local t0 = ms()
        call(r)
        samples[i][#samples[i] + 1] = ms() - t0
      end
    end
  end
  print("| route (`api.handle`, no socket, sequential) | p50 ms | p99 ms |")
  print("|---|---|---|")
  local p50s = {}
  for i, r in ipairs(routes) do
    local p50, p99 = quantiles(samples[i])
    p50s[i] = p50
    print(("| `%s` | %.3f | %.3f |"):format(r[1], p50, p99))
  end
  print(("| adapter cost at p50 | %.3f | - |"):format(p50s[2] - p50s[1]))
  moonbox.getSandbox("b", { root = home .. "/sandboxes/b" }):destroy()
  os.execute("rm -rf '" .. home .. "'")
end)
