-- Isolation benchmark (issue #5): a new namespaced sandbox plus its first
-- exec("true"), against bubblewrap running `true` in an equivalent
-- read-only root (--unshare-all), measured in the same run.
-- Run: ./build/moonbox bench/isolation.lua [iterations]   (needs bwrap)
local moonbox = require "moonbox"
local core = require "moonbox.core"
local async = require "moonbox.async"

local N = tonumber(arg and arg[1]) or 200
local function ms() return core.hrtime() / 1e6 end
local function stats(samples)
  table.sort(samples)
  local function q(p) return samples[math.max(1, math.floor(#samples * p + 0.5))] end
  return q(0.5), q(0.99)
end

local tmp = os.tmpname()
os.remove(tmp)
assert(core.mkdir(tmp))

-- bwrap with what our default root has: read-only /usr and the /bin, /lib
-- symlinks, /etc files, fresh /proc, /dev, tmpfs /tmp, a bound workspace.
local function bwrap_argv()
  local argv = { "bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", "/usr", "/usr" }
  for _, d in ipairs { "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32" } do
    local target = core.readlink(d)
    if target then
      argv[#argv + 1] = "--symlink" argv[#argv + 1] = target argv[#argv + 1] = d
    end
  end
  for _, f in ipairs { "/etc/passwd", "/etc/group", "/etc/hosts", "/etc/ld.so.cache", "/etc/nsswitch.conf" } do
    argv[#argv + 1] = "--ro-bind" argv[#argv + 1] = f argv[#argv + 1] = f
  end
  for _, a in ipairs { "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--bind", tmp, "/workspace",
    "--hostname", "bench", "true" } do argv[#argv + 1] = a end
  return argv
end

local function bwrap_once(argv)
  local t = ms()
  local code = async.await(function(resume)
    assert(core.spawn { args = argv, file = "/usr/bin/bwrap", stdio = { [0] = "null", [1] = "null", [2] = "null" },
      on_exit = function(c) resume(c) end })
  end)
  assert(code == 0, "bwrap failed: " .. tostring(code))
  return ms() - t
end

local function bwrap()
  local argv = bwrap_argv()
  local samples = {}
  for i = 1, N do samples[i] = bwrap_once(argv) end
  return stats(samples)
end

-- warm: with moonbox.prewarm(true) (a pool of one), a sandbox built ahead is claimed (the
-- next one is built between iterations, outside the measured time: each
-- iteration waits for it, then quiet_ms more)
local prewarm = require "moonbox.sandbox.prewarm"
local function await_pool(size)
  for _ = 1, 1000 do
    if prewarm.count() == size then return end
    moonbox.sleep(10)
  end
  error("the pool did not fill")
end

local function moonbox_sandbox(warm, quiet_ms)
  local samples = {}
  moonbox.prewarm(warm)
  for i = 1, N do
    if warm then await_pool(1) end
    if quiet_ms then moonbox.sleep(quiet_ms) end
    local t = ms()
    local sb = moonbox.getSandbox("bench-iso-" .. i, { root = tmp .. "/sb" .. i, isolation = "namespaces" })
    local r = sb:exec("true")
    samples[i] = ms() - t
    assert(r.exitCode == 0)
    sb:destroy()
  end
  moonbox.prewarm(false)
  return stats(samples)
end

-- The pre-built sandbox against bwrap interleaved: each iteration, once
-- the pool is full, one bwrap and one claimed sandbox, 40 ms of quiet
-- before each, so both see the same load on a shared machine; and the
-- claim's stages: getSandbox alone, then its first exec("true").
local function interleaved()
  local argv = bwrap_argv()
  local b, m, g, e = {}, {}, {}, {}
  moonbox.prewarm(true)
  for i = 1, N do
    await_pool(1)
    moonbox.sleep(40)
    b[i] = bwrap_once(argv)
    moonbox.sleep(40)
    local t = ms()
    local sb = moonbox.getSandbox("bench-mix-" .. i, { root = tmp .. "/mix" .. i, isolation = "namespaces" })
    g[i] = ms() - t
    local r = sb:exec("true")
    m[i] = ms() - t
    e[i] = m[i] - g[i]
    assert(r.exitCode == 0)
    sb:destroy()
  end
  moonbox.prewarm(false)
  local b50, b99 = stats(b)
  local m50, m99 = stats(m)
  local g50, g99 = stats(g)
  local e50, e99 = stats(e)
  return b50, b99, m50, m99, g50, g99, e50, e99
end

-- pool: moonbox.prewarm(size) keeps size spares; bursts of size sandboxes
-- back to back, each burst after the pool has filled again (its refill is
-- outside the measured time, as a server's between bursts of requests).
local POOL = 4
local function moonbox_pool()
  local samples = {}
  moonbox.prewarm(POOL)
  local i = 0
  while i < N do
    await_pool(POOL)
    local burst = {}
    for _ = 1, math.min(POOL, N - i) do
      i = i + 1
      local t = ms()
      local sb = moonbox.getSandbox("bench-pool-" .. i, { root = tmp .. "/pool" .. i, isolation = "namespaces" })
      local r = sb:exec("true")
      samples[i] = ms() - t
      assert(r.exitCode == 0)
      burst[#burst + 1] = sb
    end
    for _, sb in ipairs(burst) do sb:destroy() end
  end
  moonbox.prewarm(false)
  return stats(samples)
end

moonbox.run(function()
  local b50, b99 = bwrap()
  local m50, m99 = moonbox_sandbox(false)
  -- as a program that makes a sandbox now and then sees it: the kernel
  -- work a quiet spell makes dearer (cgroup migrations) shows here
  local q50, q99 = moonbox_sandbox(false, 80)
  local w50, w99 = moonbox_sandbox(true, 40)
  local p50, p99 = moonbox_pool()
  local ib50, ib99, im50, im99, ig50, ig99, ie50, ie99 = interleaved()
  local disk = require "moonbox.sandbox.disk"
  print(("machine: %s, %d iterations, as %s (disk quota %s), load average %s"):format(
    io.popen("uname -r"):read("*l"), N, core.getuid() == 0 and "root" or "an unprivileged user",
    disk.host_root() and "enforced: a loop-mounted image per sandbox" or "not enforced",
    (io.open("/proc/loadavg"):read("*l"):match("^(%S+ %S+ %S+)"))))
  print("| what | p50 ms | p99 ms |")
  print("|---|---|---|")
  print(("| bwrap --unshare-all, ro root, `true` | %.2f | %.2f |"):format(b50, b99))
  print(("| getSandbox (namespaces) + first exec(\"true\") | %.2f | %.2f |"):format(m50, m99))
  print(("| ratio (moonbox / bwrap) | %.2fx | %.2fx |"):format(m50 / b50, m99 / b99))
  print(("| same, 80 ms of quiet before each | %.2f | %.2f |"):format(q50, q99))
  print(("| ratio, 80 ms of quiet (moonbox / bwrap) | %.2fx | %.2fx |"):format(q50 / b50, q99 / b99))
  print(("| same, pre-built (`moonbox.prewarm(true)`, pool full, 40 ms between) | %.2f | %.2f |"):format(w50, w99))
  print(("| ratio, pre-built (moonbox / bwrap) | %.2fx | %.2fx |"):format(w50 / b50, w99 / b99))
  print(("| same, a pool of %d (`moonbox.prewarm(%d)`), bursts of %d back to back | %.2f | %.2f |")
    :format(POOL, POOL, POOL, p50, p99))
  print(("| ratio, pool of %d (moonbox / bwrap) | %.2fx | %.2fx |"):format(POOL, p50 / b50, p99 / b99))
  print(("| interleaved: bwrap, 40 ms of quiet before each | %.2f | %.2f |"):format(ib50, ib99))
  print(("| interleaved: pre-built getSandbox + first exec(\"true\") | %.2f | %.2f |"):format(im50, im99))
  print(("| ratio, pre-built interleaved (moonbox / bwrap) | %.2fx | %.2fx |"):format(im50 / ib50, im99 / ib99))
  print(("| stage: getSandbox (claim) | %.2f | %.2f |"):format(ig50, ig99))
  print(("| stage: first exec(\"true\") on the claimed spare | %.2f | %.2f |"):format(ie50, ie99))
  os.execute("rm -rf " .. tmp)
end)
