-- How long proc mode's kill paths hold the event loop: the worst and the
-- total stall of the loop during an exec with a timeout (one that ends in
-- time, one the timeout kills) and a killProcess (a running tree; the
-- leftovers of a process that ended). A 1 ms timer measures each tick's
-- stall as spec/helper.lua's watchdog does: its lateness, but at most the
-- CPU time the loop's thread used meanwhile (a loop descheduled on a busy
-- machine is not held; work on the thread pool is another thread's).
-- Proc mode is the unprivileged runtime's: run as a user without cgroup
-- delegation, e.g. (from a copy nobody can read, see spec/run-unprivileged.sh)
--   runuser -u nobody -- luajit bench/procmode.lua [rounds]
local moonbox = require "moonbox"
local core = require "moonbox.core"
local tree = require "moonbox.process.tree"
local ffi = require "ffi"

ffi.cdef [[
  typedef struct { long tv_sec; long tv_nsec; } mb_bench_timespec;
  int clock_gettime(int clockid, mb_bench_timespec *tp);
]]
local ts = ffi.new("mb_bench_timespec")
local function thread_cpu_ms()
  ffi.C.clock_gettime(3, ts) -- CLOCK_THREAD_CPUTIME_ID
  return tonumber(ts.tv_sec) * 1000 + tonumber(ts.tv_nsec) / 1e6
end

local ROUNDS = tonumber(arg and arg[1]) or 10

-- Worst and total stall (ms) of the loop while fn runs in this task.
local function stall(fn)
  local worst, total = 0, 0
  local last, last_cpu = core.hrtime(), thread_cpu_ms()
  local function tick()
    local now, cpu = core.hrtime(), thread_cpu_ms()
    local s = math.min((now - last) / 1e6 - 1, cpu - last_cpu)
    if s > 0 then
      total = total + s
      if s > worst then worst = s end
    end
    last, last_cpu = now, cpu
  end
  local t = core.timer()
  t:start(1, 1, tick)
  fn()
  tick()
  t:close()
  return worst, total
end

local results = {}
local function record(name, w, tot)
  local r = results[name] or { worst = {}, total = {} }
  results[name] = r
  r.worst[#r.worst + 1], r.total[#r.total + 1] = w, tot
end

local function median(list)
  table.sort(list)
  return list[math.ceil(#list / 2)]
end

moonbox.run(function()
  assert(tree.mode() == "proc", "run this as a user without cgroup delegation (proc mode)")
  local sb = moonbox.getSandbox("bench-procmode", { root = os.tmpname() .. ".d" })
  sb:exec("true")
  for _ = 1, ROUNDS do
    record("exec true, timeout 5 s", stall(function()
      assert(sb:exec("true", { timeout = 5000 }).exitCode == 0)
    end))
    record("exec sleep 5, timeout 200 ms (killed)", stall(function()
      sb:exec("sleep 5 & sleep 5", { timeout = 200 })
    end))
    local p = sb:startProcess("sleep 300 & sleep 300")
    moonbox.sleep(20)
    record("killProcess (running tree) until exit", stall(function()
      sb:killProcess(p.id, "SIGKILL")
      p:waitForExit(5000)
      p:_wait_tree_gone()
    end))
    local q = sb:startProcess("setsid sleep 300 & sleep 300 & exit 0")
    q:waitForExit(5000)
    moonbox.sleep(20)
    record("killProcess (leftovers of an ended one) until gone", stall(function()
      sb:killProcess(q.id, "SIGKILL")
      q:_wait_tree_gone()
    end))
    sb:cleanupCompletedProcesses()
  end
  sb:destroy()
  local names = {}
  for name in pairs(results) do names[#names + 1] = name end
  table.sort(names)
  print(("%d rounds; loop stall in ms (median over rounds): worst tick / total during the call"):format(ROUNDS))
  for _, name in ipairs(names) do
    local r = results[name]
    print(("%-52s %6.2f / %6.2f"):format(name, median(r.worst), median(r.total)))
  end
end)
