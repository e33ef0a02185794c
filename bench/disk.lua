-- Sandbox creation with and without the disk quota (issue 29, finding 9):
-- getSandbox + a first exec("true"), then destroy, N times each way,
-- interleaved, under a fresh temp root per sandbox.
-- Run (as root, for the loop mounts): ./build/moonbox bench/disk.lua [N]
local moonbox = require "moonbox"
local core = require "moonbox.core"

local N = tonumber(arg and arg[1]) or 30
local function ms() return core.hrtime() / 1e6 end
local function q(s, p)
  table.sort(s)
  return s[math.max(1, math.min(#s, math.floor(#s * p + 0.5)))]
end

local base = io.popen("mktemp -d"):read("*l")
local times = { quota = { create = {}, destroy = {} }, none = { create = {}, destroy = {} } }
for i = 1, N do
  for _, way in ipairs { "quota", "none" } do
    local limits = way == "none" and { diskBytes = 0 } or nil
    local t = ms()
    local sb = moonbox.getSandbox(("disk-%s-%d"):format(way, i), { root = ("%s/%s-%d"):format(base, way, i),
      limits = limits })
    sb:exec("true")
    local made = ms()
    if i == 1 then print(way .. ": enforcement.diskBytes = " .. tostring(sb:info().enforcement.diskBytes)) end
    sb:destroy()
    local gone = ms()
    times[way].create[i] = made - t
    times[way].destroy[i] = gone - made
  end
end
os.execute("rm -rf '" .. base .. "'")
for _, way in ipairs { "quota", "none" } do
  local c, d = times[way].create, times[way].destroy
  print(("%-5s creation p50 %.1f ms p90 %.1f ms; destroy p50 %.1f ms p90 %.1f ms (N=%d)")
    :format(way, q(c, 0.5), q(c, 0.9), q(d, 0.5), q(d, 0.9), N))
end
