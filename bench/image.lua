-- Sandbox creation from an image against creation without one (issue #30):
-- getSandbox + a first exec("true"), then destroy, N times each way,
-- interleaved, each under a fresh temp root; the image (busybox and bash
-- with its libraries, two layers) is imported once before, so this is the
-- cost of a cached image: the layer binds, the overlay mount, the upper
-- dir. Then K sandboxes at once, of the image and of the host's root: disk
-- and memory per sandbox, and the store's disk use (shared by all).
-- Run: ./build/moonbox bench/image.lua [N] [K]   (from the source tree)
package.path = "spec/?.lua;" .. package.path
local moonbox = require "moonbox"
local core = require "moonbox.core"

local N = tonumber(arg and arg[1]) or 30
local K = tonumber(arg and arg[2]) or 100
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
  -- K sandboxes at once, of the image then of the host's root: what each
  -- one costs in disk (its root dir: workspace, upper dir) and memory (its
  -- cgroup's memory.current: its processes, the page cache and kernel
  -- memory charged to it; and the host's MemAvailable drop, which also sees
  -- the mounts and superblocks charged to nobody), each with its session
  -- shell up after one small write.
  local tree = require "moonbox.process.tree"
  local cgroup = require "moonbox.process.cgroup"
  local function mem_available()
    return tonumber(sh("awk '/^MemAvailable:/ {print $2}' /proc/meminfo")) * 1024
  end
  local function kib(n) return ("%.0f KiB"):format(n / 1024) end
  for _, way in ipairs { "image", "host" } do
    local sbs = {}
    sh("sync")
    local avail0 = mem_available()
    local t = ms()
    for i = 1, K do
      sbs[i] = moonbox.getSandbox(("many-%s-%d"):format(way, i), { root = ("%s/many-%s-%d"):format(base, way, i),
        image = way == "image" and "bench:1" or nil })
      sbs[i]:exec("echo " .. i .. " > /tmp/mine && echo " .. i .. " > /workspace/mine")
    end
    local elapsed = ms() - t
    local drop = avail0 - mem_available()
    local cg, n = 0, 0
    for _, sb in ipairs(sbs) do
      -- cgroup v2's memory.current, else the v1 memory controller's usage
      local files = { tree.mode() == "cgroup" and (cgroup.base() .. "/" .. sb.cgroup_name .. "/memory.current") or nil }
      for _, dir in ipairs(sb.limits_state and sb.limits_state.extra_cgroups or {}) do
        if dir:find("/memory/", 1, true) then files[#files + 1] = dir .. "/memory.usage_in_bytes" end
      end
      for _, f in ipairs(files) do
        local cur = tonumber(sh("cat '" .. f .. "' 2>/dev/null"))
        if cur then cg, n = cg + cur, n + 1 break end
      end
    end
    -- (du of a root: with the disk quota, the ext4 image's allocated blocks)
    local disk = tonumber(sh("du -sk " .. base .. "/many-" .. way .. "-* | awk '{s += $1} END {print s}'")) * 1024
    print(("%d sandboxes %-5s: made in %.0f ms (%.1f ms each); per sandbox: disk %s, cgroup memory %s, " ..
      "MemAvailable drop %s"):format(K, way, elapsed, elapsed / K, kib(disk / K), n > 0 and kib(cg / n) or "n/a",
      kib(drop / K)))
    if way == "image" then
      print(("  the image's layers in the store (shared by all %d): %s"):format(K,
        sh("du -sh '" .. base .. "/store/layers' | cut -f1")))
    end
    for _, sb in ipairs(sbs) do sb:destroy() end
  end
end)
os.execute("rm -rf '" .. base .. "'")
