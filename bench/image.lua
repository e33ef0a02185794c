-- Sandbox creation from an image against creation without one (issue #30):
-- getSandbox + a first exec("true"), then destroy, N times each way,
-- interleaved, each under a fresh temp root; the image (busybox and bash
-- with its libraries, two layers) is imported once before, so this is the
-- cost of a cached image: the layer binds, the overlay mount, the upper
-- dir. Then K sandboxes of the image at once: the store's disk use (shared
-- by all) and each sandbox's upper dir after one small write.
-- Run: ./build/moonbox bench/image.lua [N] [K]   (from the source tree)
package.path = "spec/?.lua;" .. package.path
local moonbox = require "moonbox"
local core = require "moonbox.core"

local N = tonumber(arg and arg[1]) or 30
local K = tonumber(arg and arg[2]) or 20
local function ms() return core.hrtime() / 1e6 end
local function q(s, p)
  table.sort(s)
  return s[math.max(1, math.min(#s, math.floor(#s * p + 0.5)))]
end
local function sh(cmd)
  local p = io.popen(cmd)
  local out = p:read("*a")
  p:close()
  return (out:gsub("\n$", ""))
end
helper = { sh = sh } -- luacheck: ignore 111 (the fixtures' one helper)
local fx = require "images.fixtures"

local base = sh("mktemp -d")
moonbox.images.store.DIR = base .. "/store"
fx.oci(base .. "/oci", "v1", { config = { Env = { "PATH=/bin" } }, layers = {
  { gzip = true, entries = fx.shell_entries() },
  { entries = { { path = "etc/extra", type = "file", content = "x" } } } } })
moonbox.run(function()
  local t0 = ms()
  moonbox.images.pull("oci:" .. base .. "/oci:v1", { name = "bench:1" })
  print(("import (2 layers, %s): %.1f ms"):format(sh("du -sh '" .. base .. "/oci' | cut -f1"), ms() - t0))
  local times = { image = { create = {}, destroy = {} }, host = { create = {}, destroy = {} } }
  for i = 1, N do
    for _, way in ipairs { "image", "host" } do
      local t = ms()
      local sb = moonbox.getSandbox(("img-%s-%d"):format(way, i), { root = ("%s/%s-%d"):format(base, way, i),
        image = way == "image" and "bench:1" or nil })
      sb:exec("true")
      local made = ms()
      sb:destroy()
      times[way].create[i] = made - t
      times[way].destroy[i] = ms() - made
    end
  end
  for _, way in ipairs { "image", "host" } do
    local c, d = times[way].create, times[way].destroy
    print(("%-5s creation p50 %.1f ms p90 %.1f ms; destroy p50 %.1f ms p90 %.1f ms (N=%d)")
      :format(way, q(c, 0.5), q(c, 0.9), q(d, 0.5), q(d, 0.9), N))
  end
  print(("creation ratio image/host (p50): %.2f"):format(q(times.image.create, 0.5) / q(times.host.create, 0.5)))
  local sbs = {}
  for i = 1, K do
    sbs[i] = moonbox.getSandbox("many-" .. i, { root = ("%s/many-%d"):format(base, i), image = "bench:1" })
    sbs[i]:exec("echo " .. i .. " > /etc/mine")
  end
  print(("%d sandboxes of the image: store %s (shared), one upper dir %s"):format(K,
    sh("du -sh '" .. base .. "/store/layers' | cut -f1"), sh("du -sh '" .. base .. "/many-1/image/upper' | cut -f1")))
  for _, sb in ipairs(sbs) do sb:destroy() end
end)
os.execute("rm -rf '" .. base .. "'")
