-- Loaded by busted before every spec file (--helper). Makes the source tree's
-- Lua modules and the build's core.so loadable, and gives specs run_task():
-- run a function as a moonbox task, then fail if it left a handle open, a
-- child running, or a zombie behind.
local build = os.getenv("MOONBOX_BUILD_DIR") or "build"
local source = os.getenv("MOONBOX_SOURCE_DIR") or "."
package.path = source .. "/lua/?.lua;" .. source .. "/lua/?/init.lua;" .. source .. "/spec/?.lua;" .. package.path
package.cpath = build .. "/lib/?.so;" .. package.cpath

local core = require "moonbox.core"
local moonbox = require "moonbox"

-- The sanitizer build preloads libasan into luajit; the shell commands specs
-- run for setup and checks (pgrep, mktemp, ...) must not inherit it (pgrep
-- under a preloaded ASan runtime can hang). Sandbox processes never see it:
-- their environment is exact.
if os.getenv("LD_PRELOAD") then
  local popen, execute = io.popen, os.execute
  io.popen = function(cmd, mode) return popen("unset LD_PRELOAD; " .. cmd, mode) end -- luacheck: ignore 122
  os.execute = function(cmd) return execute(cmd and ("unset LD_PRELOAD; " .. cmd)) end -- luacheck: ignore 122
end

helper = {}

-- pids whose parent is us (running or zombie)
function helper.children()
  local me = core.getpid()
  local kids = {}
  for _, name in ipairs(core.readdir("/proc") or {}) do
    if name:match("^%d+$") then
      local f = io.open("/proc/" .. name .. "/stat")
      local stat = f and f:read("*a")
      if f then f:close() end
      if stat then
        local comm, state, ppid = stat:match("%((.*)%) (%S) (%d+)")
        if tonumber(ppid) == me then kids[#kids + 1] = { pid = tonumber(name), state = state, comm = comm } end
      end
    end
  end
  return kids
end

-- Output of a shell command (stripped of one trailing newline); the pipe is
-- closed at once, so its shell never lingers as our zombie.
function helper.sh(cmd)
  local p = io.popen(cmd)
  local out = p:read("*a")
  p:close()
  return (out:gsub("\n$", ""))
end

-- A new empty temporary directory.
function helper.mkdtemp()
  local dir = helper.sh("mktemp -d")
  assert(dir ~= "", "mktemp -d failed")
  return dir
end

-- Read a stream until EOF (in a task); returns the data, or nil and the
-- error name.
function helper.read_all(stream)
  return require("moonbox.async").await(function(resume)
    local parts = {}
    stream:read_start(function(err, data)
      if err then
        resume(nil, err)
      elseif data == nil then
        resume(table.concat(parts))
      else
        parts[#parts + 1] = data
      end
    end)
    return function() stream:read_stop() end
  end)
end

-- pid_alive(pid[, sb]): with a namespaced sandbox, pid is one its own
-- processes see ($$ inside), looked up in the sandbox's /proc.
function helper.pid_alive(pid, sb)
  local proc = "/proc/"
  if sb and sb.init then
    if sb.init_dead then return false end
    proc = "/proc/" .. sb.init:pid() .. "/root/proc/"
  end
  local f = io.open(proc .. pid .. "/stat")
  if not f then return false end
  local stat = f:read("*a") -- nil when the process went between open and read
  f:close()
  return stat ~= nil and not stat:match("%) Z ")
end

-- Let pending close callbacks and exit notifications run; orphans the
-- runtime adopted (it is a child subreaper) are reaped on the loop too.
function helper.settle()
  for _ = 1, 100 do
    core.run("nowait")
    if core.open_handles() == 0 and core.spawn_stats().running == 0 and #helper.children() == 0 then break end
    local t = core.timer() -- wait 10 ms on the loop, where exits and closes arrive
    local fired = false
    t:start(10, 0, function() fired = true end)
    while not fired do core.run("once") end
    t:close()
    core.run("nowait")
  end
end

function helper.assert_clean()
  helper.settle()
  assert(core.open_handles() == 0, ("%d handle(s) left open"):format(core.open_handles()))
  local running = core.spawn_stats().running
  assert(running == 0, ("%d spawned process(es) still running"):format(running))
  local kids = helper.children()
  -- anything else is a leak
  assert(#kids == 0, ("%d child process(es) left behind, first pid %s (%s) state %s"):format(
    #kids, kids[1] and kids[1].pid, kids[1] and kids[1].comm, kids[1] and kids[1].state))
end

-- A spec that hangs fails with the tracebacks of its waiting tasks instead
-- of running into CTest's timeout with nothing to show.
local WATCHDOG_MS = tonumber(os.getenv("MOONBOX_SPEC_WATCHDOG_MS")) or 240000

function run_task(fn)
  local watchdog = core.timer()
  watchdog:start(WATCHDOG_MS, 0, function()
    io.stderr:write(("\nspec watchdog: still running after %d ms; waiting tasks:\n"):format(WATCHDOG_MS))
    for _, tb in ipairs(require("moonbox.async").dump_tasks()) do io.stderr:write(tb, "\n\n") end
    io.stderr:flush()
    os.exit(3)
  end)
  watchdog:unref()
  local results = { pcall(moonbox.run, fn) }
  watchdog:close()
  if not results[1] then error(results[2], 0) end
  table.remove(results, 1)
  helper.assert_clean()
  return unpack(results)
end

-- A sandbox with a fresh temporary root, unique in this process.
local sandbox_seq = 0
function helper.new_sandbox(opts)
  sandbox_seq = sandbox_seq + 1
  opts = opts or {}
  opts.root = opts.root or helper.mkdtemp()
  -- CTest runs the suites once per isolation mode (cmake/tests.cmake)
  if opts.isolation == nil then opts.isolation = os.getenv("MOONBOX_TEST_ISOLATION") end
  return moonbox.getSandbox(("spec-%d-%d"):format(core.getpid(), sandbox_seq), opts)
end

-- run_task(fn(sandbox)) with a new sandbox that is destroyed afterwards,
-- whether fn fails or not.
function helper.with_sandbox(fn, opts)
  return run_task(function()
    local sb = helper.new_sandbox(opts)
    local ok, err = pcall(fn, sb)
    sb:destroy()
    if not ok then error(err, 0) end
  end)
end

-- The runtime's open fds, counted in-process: a popen'd ls could also see
-- popen's own pipe end that the parent had not closed yet.
function helper.fd_count()
  return #core.readdir("/proc/self/fd")
end

-- Poll check() every 10 ms on the loop until it holds (true) or ms pass
-- (false): for effects that land a moment later (a kill, a close callback),
-- without betting on a fixed sleep that a loaded machine can outlast.
function helper.eventually(check, ms)
  local deadline = core.hrtime() / 1e6 + (ms or 5000)
  repeat
    if check() then return true end
    moonbox.sleep(10)
  until core.hrtime() / 1e6 > deadline
  return check() and true or false
end

-- sample() once it gives the same value twice, 50 ms apart (at most 5 s):
-- a baseline taken after start-up work (a warm spare shell) has settled.
function helper.steady(sample)
  local last = sample()
  for _ = 1, 100 do
    moonbox.sleep(50)
    local now = sample()
    if now == last then return now end
    last = now
  end
  return last
end

-- The error a call raises (it must raise).
function helper.error_of(fn, ...)
  local ok, err = pcall(fn, ...)
  assert(not ok, "expected an error")
  return err
end
