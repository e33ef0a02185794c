-- Scale benchmark (issue #18): many sessions in one sandbox, many sandboxes
-- with one session each, and destroy one at a time.
--
-- Run: ./build/moonbox bench/scale.lua [sessions N] [sandboxes M] [destroy K]
--      [isolation auto|namespaces|none] [rr R]
-- (defaults: sessions 1000 sandboxes 300 destroy 100; rr: how many round-robin
-- exec("true") calls, default 2 per item). bench/scale.sh runs it at the
-- issue's sizes under a 1024 soft fd limit (raising the hard limit and the
-- host's namespace counts where it can): the runtime raises its soft limit
-- to the hard one at start, so the counts are bound by memory and pids, not
-- by the 1024. Roots go to a fresh temp directory that is removed at the
-- end; leftovers (processes, cgroups, mounts, directories) are counted after
-- every phase and must be 0.
local moonbox = require "moonbox"
local core = require "moonbox.core"
local tree = require "moonbox.process.tree"
local cgroup = require "moonbox.process.cgroup"
local util = require "moonbox.lib.util"

local args = { sessions = 1000, sandboxes = 300, destroy = 100, isolation = "auto" }
do
  local i = 1
  while arg and arg[i] do
    local k, v = arg[i], arg[i + 1]
    if args[k] == nil and k ~= "rr" then error("unknown argument " .. tostring(k)) end
    args[k] = tonumber(v) or v
    i = i + 2
  end
end

local function ms() return core.hrtime() / 1e6 end
local function q(samples, p)
  local s = {}
  for i, v in ipairs(samples) do s[i] = v end
  table.sort(s)
  if #s == 0 then return 0 / 0 end
  return s[math.max(1, math.min(#s, math.floor(#s * p + 0.5)))]
end
-- PSS (proportional set size: shared pages split between their users, so
-- that a sum over processes is what they cost together), RSS where
-- smaps_rollup is missing
local function rss_kb(pid)
  local rollup = util.read_file("/proc/" .. (pid or "self") .. "/smaps_rollup")
  local pss = rollup and tonumber(rollup:match("\nPss:%s*(%d+)"))
  if pss then return pss end
  local status = util.read_file("/proc/" .. (pid or "self") .. "/status") or ""
  return tonumber(status:match("VmRSS:%s*(%d+)")) or 0
end
-- memory of the runtime plus every process under its cgroup (or, without
-- cgroups, its descendants): what the items really cost the host.
local function total_rss_kb()
  local total = rss_kb()
  local pids
  if tree.mode() == "cgroup" then pids = cgroup.cgroup_pids(cgroup.base())
  else pids = tree.descendants(core.getpid()) end
  for _, pid in ipairs(pids) do total = total + rss_kb(pid) end
  return total, #pids
end
local function fds()
  return #(core.readdir("/proc/self/fd") or {})
end
local function mount_count()
  local n = 0
  for _ in (util.read_file("/proc/self/mountinfo") or ""):gmatch("\n") do n = n + 1 end
  return n
end
local mounts0 = mount_count()
-- what is left of destroyed items: processes, cgroups, mounts (beyond those
-- at the start), directories under the bench's root
local function leftovers(root)
  -- a destroyed sandbox's cgroups go on the thread pool (cgroup.remove_later):
  -- what is still being removed is not left over, what is never removed is
  local removals_done = cgroup.await_removals(moonbox.sleep, 60000)
  local procs, cgroups = #tree.descendants(core.getpid()), 0
  if tree.mode() == "cgroup" then
    procs = math.max(procs, #cgroup.cgroup_pids(cgroup.base()))
    for _, name in ipairs(core.readdir(cgroup.base()) or {}) do
      if util.is_dir(cgroup.base() .. "/" .. name) then cgroups = cgroups + 1 end
    end
  end
  local roots = 0
  for _ in ipairs(core.readdir(root) or {}) do roots = roots + 1 end
  return ("%d processes, %d cgroups, %d mounts, %d dirs%s"):format(procs, cgroups, mount_count() - mounts0, roots,
    removals_done and "" or " (cgroup removals still under way after 60 s)")
end

local function fd_limit()
  local text = util.read_file("/proc/self/limits") or ""
  local soft, hard = text:match("Max open files%s+(%S+)%s+(%S+)")
  return { soft = soft, hard = hard }
end
local limit = fd_limit()
local out = {}
local function say(fmt, ...)
  local line = fmt:format(...)
  print(line)
  io.stdout:flush()
  out[#out + 1] = line
end

-- creation time per item, p50 per slice of 1000 items (of a tenth of the
-- run below 2000): flat means the cost of the n-th item does not grow with n
local function buckets(times)
  local n = #times
  local step = n >= 2000 and 1000 or math.max(1, math.floor(n / 10))
  local parts = {}
  for i = 1, n, step do
    local slice = {}
    for j = i, math.min(n, i + step - 1) do slice[#slice + 1] = times[j] end
    parts[#parts + 1] = ("%.2f"):format(q(slice, 0.5))
  end
  return table.concat(parts, " ")
end

-- CPU time (ms) the runtime (all its threads) and everything in its cgroup
-- (inits, shells, their commands, exited ones too) have used: the work the
-- items cost, whatever else the host runs meanwhile. /proc/<pid>/stat
-- counts in USER_HZ (100 on Linux).
local function stat_cpu_ms(pid)
  local rest = (util.read_file("/proc/" .. pid .. "/stat") or ""):match("%) (.*)$") or ""
  local f = {}
  for x in rest:gmatch("%S+") do f[#f + 1] = x end
  return ((tonumber(f[12]) or 0) + (tonumber(f[13]) or 0)) * 10 -- utime, stime (fields 14, 15)
end
local function work_cpu_ms()
  local cg = 0
  if tree.mode() == "cgroup" then
    cg = (tonumber((util.read_file(cgroup.base() .. "/cpu.stat") or ""):match("usage_usec (%d+)")) or 0) / 1000
  end
  return stat_cpu_ms("self") + cg
end
-- the host's DAMON threads, whose rmap walks grow with the processes that
-- map the same file pages (every shell maps bash and libc)
local kdamonds = {}
for _, name in ipairs(core.readdir("/proc") or {}) do
  if name:match("^%d+$") and (util.read_file("/proc/" .. name .. "/comm") or ""):match("^kdamond") then
    kdamonds[#kdamonds + 1] = name
  end
end
local function kdamond_cpu_ms()
  local t = 0
  for _, pid in ipairs(kdamonds) do t = t + stat_cpu_ms(pid) end
  return t
end

local function round_robin(items, count)
  local lat = {}
  for i = 1, count do
    local item = items[(i - 1) % #items + 1]
    local t = ms()
    local r = item:exec("true")
    lat[#lat + 1] = ms() - t
    assert(r.exitCode == 0, "exec true failed")
  end
  return q(lat, 0.5), q(lat, 0.99)
end

local function policy(n)
  return { limits = { maxSessions = n + 8, maxProcesses = 64 } }
end

moonbox.run(function()
  local base = os.tmpname()
  os.remove(base)
  assert(core.mkdir(base))
  say("fd limit at start of the script: soft %s hard %s; fds open %d; isolation %s; tree mode %s",
    limit and limit.soft or "?", limit and limit.hard or "?", fds(), args.isolation, tree.mode())

  local rss0 = total_rss_kb()

  -- 1. N sessions in one sandbox
  if args.sessions > 0 then
    local N = args.sessions
    local sb = moonbox.getSandbox("scale-sessions", { root = base .. "/sessions", isolation = args.isolation,
      policy = policy(N) })
    sb:exec("true")
    local before = total_rss_kb()
    local sessions, times = {}, {}
    local t0 = ms()
    for i = 1, N do
      local t = ms()
      local ok, s = pcall(sb.createSession, sb, { id = "s" .. i })
      if not ok then
        say("sessions: stopped at %d: %s %s", i, tostring(s.code), tostring(s.message))
        break
      end
      s:exec("true") -- a session is ready once its shell answered
      times[#times + 1] = ms() - t
      sessions[#sessions + 1] = s
    end
    local wall = ms() - t0
    local after, nprocs = total_rss_kb()
    say("sessions: %d created in %.1f s (%.2f ms each); creation p50 per slice: %s ms",
      #sessions, wall / 1000, wall / math.max(1, #sessions), buckets(times))
    say("sessions: memory (PSS) +%.1f MB (%.3f MB per session; %d processes); fds open %d",
      (after - before) / 1024, (after - before) / 1024 / math.max(1, #sessions), nprocs, fds())
    local p50, p99 = round_robin(sessions, args.rr or 2 * #sessions)
    say("sessions: exec(\"true\") round-robin over %d: p50 %.3f ms p99 %.3f ms", #sessions, p50, p99)
    local t = ms()
    sb:destroy({ keepFiles = false })
    say("sessions: destroy of the sandbox with %d sessions: %.1f ms", #sessions, ms() - t)
    say("sessions: leftovers: %s", leftovers(base))
  end

  -- 2. M sandboxes with one session each
  if args.sandboxes > 0 then
    local M = args.sandboxes
    local before = total_rss_kb()
    local sandboxes, times, gets = {}, {}, {}
    -- per slice (as buckets): CPU ms per creation, and the host's kdamond
    local step = M >= 2000 and 1000 or math.max(1, math.floor(M / 10))
    local cpu, damon = {}, {}
    local cpu0, damon0, wall0 = work_cpu_ms(), kdamond_cpu_ms(), ms()
    local t0 = ms()
    for i = 1, M do
      if i > 1 and (i - 1) % step == 0 then
        local c, d, w = work_cpu_ms(), kdamond_cpu_ms(), ms()
        cpu[#cpu + 1] = ("%.1f"):format((c - cpu0) / step)
        damon[#damon + 1] = ("%.0f%%"):format(100 * (d - damon0) / (w - wall0))
        cpu0, damon0, wall0 = c, d, w
      end
      local t = ms()
      local ok, err = pcall(function()
        local sb = moonbox.getSandbox("scale-sb-" .. i, { root = base .. "/sb-" .. i, isolation = args.isolation,
          policy = policy(1) })
        gets[#gets + 1] = ms() - t
        sb:exec("true")
        sandboxes[#sandboxes + 1] = sb
      end)
      if not ok then
        say("sandboxes: stopped at %d: %s %s", i, tostring(err.code or err), tostring(err.message))
        break
      end
      times[#times + 1] = ms() - t
    end
    if #times % step == 0 and #times > 0 then
      local c, d, w = work_cpu_ms(), kdamond_cpu_ms(), ms()
      cpu[#cpu + 1] = ("%.1f"):format((c - cpu0) / step)
      damon[#damon + 1] = ("%.0f%%"):format(100 * (d - damon0) / (w - wall0))
    end
    local wall = ms() - t0
    local after, nprocs = total_rss_kb()
    say("sandboxes: %d created in %.1f s (%.2f ms each); creation p50 per slice: %s ms",
      #sandboxes, wall / 1000, wall / math.max(1, #sandboxes), buckets(times))
    say("sandboxes: of which getSandbox (p50 per slice): %s ms; the rest is the first exec, which starts the "
      .. "session's shell", buckets(gets))
    say("sandboxes: CPU per creation per slice (runtime and the sandboxes' processes): %s ms; host kdamond: %s of "
      .. "a CPU", table.concat(cpu, " "), table.concat(damon, " "))
    say("sandboxes: memory (PSS) +%.1f MB (%.3f MB per sandbox; %d processes); fds open %d",
      (after - before) / 1024, (after - before) / 1024 / math.max(1, #sandboxes), nprocs, fds())
    local p50, p99 = round_robin(sandboxes, args.rr or 2 * #sandboxes)
    say("sandboxes: exec(\"true\") round-robin over %d: p50 %.3f ms p99 %.3f ms", #sandboxes, p50, p99)
    local lat = {}
    local t = ms()
    for _, sb in ipairs(sandboxes) do
      local s = ms()
      sb:destroy({ keepFiles = false })
      lat[#lat + 1] = ms() - s
    end
    say("sandboxes: destroy one at a time: p50 %.2f ms p99 %.2f ms (%.1f s in all)",
      q(lat, 0.5), q(lat, 0.99), (ms() - t) / 1000)
    say("sandboxes: leftovers: %s", leftovers(base))
  end

  -- 3. destroy alone: K fresh sandboxes, each destroyed on its own
  if args.destroy > 0 then
    local lat, keep = {}, {}
    for i = 1, args.destroy do
      local sb = moonbox.getSandbox("scale-d-" .. i, { root = base .. "/d-" .. i, isolation = args.isolation })
      sb:exec("true")
      keep[i] = sb
    end
    for _, sb in ipairs(keep) do
      local s = ms()
      sb:destroy({ keepFiles = true })
      lat[#lat + 1] = ms() - s
    end
    say("destroy: %d sandboxes (one session each, files kept) one at a time: p50 %.2f ms p99 %.2f ms",
      #lat, q(lat, 0.5), q(lat, 0.99))
    -- (kept files are a kept disk, still mounted: taken again and removed,
    -- else each left its image in the home and its root in /tmp)
    for i = 1, args.destroy do
      moonbox.getSandbox("scale-d-" .. i, { root = base .. "/d-" .. i, isolation = args.isolation })
        :destroy({ keepFiles = false })
      util.remove_tree(base .. "/d-" .. i)
    end
  end

  say("memory (PSS) of the runtime and its processes at the end %.1f MB (%.1f at start)",
    total_rss_kb() / 1024, rss0 / 1024)
  util.remove_tree(base)
end)
