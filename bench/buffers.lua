-- What kept output costs the runtime (issue #18): N concurrent calls each
-- keep SIZE bytes of distinct output; the runtime's peak RSS above its
-- baseline (VmHWM, reset just before) is divided by the bytes kept, and the
-- RSS left once the results are dropped and collected is reported too.
-- Run: ./build/moonbox bench/buffers.lua [exec|stream|process|code|all] [N] [SIZE]
local moonbox = require "moonbox"

local which = arg and arg[1] or "all"
local N = tonumber(arg and arg[2]) or 100
local SIZE = tonumber(arg and arg[3]) or 10000000
local MB = 1024 * 1024

local function status(field)
  local f = assert(io.open("/proc/self/status"))
  local s = f:read("*a")
  f:close()
  return tonumber(s:match(field .. ":%s*(%d+) kB")) * 1024
end
local function reset_peak()
  -- "5" resets VmHWM to the current RSS (Linux >= 4.0)
  local f = io.open("/proc/self/clear_refs", "w")
  if f then f:write("5") f:close() end
end

-- distinct printable bytes: base64 of random data, SIZE bytes on one line
local function producer(size)
  return ("head -c %d /dev/urandom | base64 -w0 | head -c %d"):format(math.ceil(size * 3 / 4) + 3, size)
end

local scenarios = {}

-- N execs at once, one per session
function scenarios.exec(sb)
  local tasks = {}
  for i = 1, N do
    local s = sb:getSession("s" .. i)
    tasks[i] = moonbox.spawn(function() return s:exec(producer(SIZE)) end)
  end
  local results, kept = {}, 0
  for i, t in ipairs(tasks) do
    local r = t:wait()
    assert(not r.truncated and r.exitCode == 0, "exec failed or was truncated")
    results[i] = r
    kept = kept + #r.stdout + #r.stderr
  end
  return results, kept
end

-- N execStreams at once whose events are read only once each has ended
function scenarios.stream(sb)
  local iters = {}
  for i = 1, N do iters[i] = sb:getSession("s" .. i):execStream(producer(SIZE)) end
  local kept = 0
  for _, it in ipairs(iters) do it.task:wait() end
  for _, it in ipairs(iters) do
    for ev in it do
      if ev.type == "stdout" or ev.type == "stderr" then kept = kept + #ev.data end
      if ev.type == "complete" then assert(not ev.truncated, "execStream was truncated") end
    end
  end
  return nil, kept
end

-- N background processes whose logs hold SIZE bytes (maxLogBytes = SIZE):
-- the peak is taken once all have ended (the logs are what the runtime
-- keeps; each getLogs() is a copy handed over), then they are read
function scenarios.process(sb)
  local procs = {}
  for i = 1, N do procs[i] = sb:getSession("s" .. i):startProcess(producer(SIZE)) end
  for _, p in ipairs(procs) do p:waitForExit() end
  local peak = status("VmHWM")
  local kept = 0
  for _, p in ipairs(procs) do kept = kept + #p:getLogs().stdout end
  return nil, kept, peak
end

-- N runCode calls at once, one context each
function scenarios.code(sb)
  local tasks = {}
  for i = 1, N do
    local s = sb:getSession("s" .. i)
    local ctx = s:createCodeContext { language = "lua" }
    tasks[i] = moonbox.spawn(function()
      return s:runCode(("local f = io.popen(%q) io.write(f:read('*a')) f:close()"):format(producer(SIZE)),
        { context = ctx.id })
    end)
  end
  local results, kept = {}, 0
  for i, t in ipairs(tasks) do
    local r = t:wait()
    results[i] = r
    for _, chunk in ipairs(r.logs.stdout) do kept = kept + #chunk end
  end
  return results, kept
end

moonbox.run(function()
  local sb = moonbox.getSandbox("bench-buffers", { root = os.tmpname() .. ".d", policy = { limits = {
    maxSessions = N + 4, maxProcesses = N + 4, maxOutputBytes = SIZE, maxLogBytes = SIZE,
    maxBufferedBytes = 2 * N * SIZE + 64 * MB, maxCompletedLogBytes = 4 * N * SIZE } } })
  for i = 1, N do sb:createSession { id = "s" .. i }:exec("true") end
  print(("%d concurrent calls, %d bytes of distinct output each"):format(N, SIZE))
  print("| kept by | bytes kept | peak RSS above baseline | peak / kept | RSS left after drop + collect |")
  print("|---|---|---|---|---|")
  if which == "all" then
    -- each in a runtime of its own: one's leftovers are not the next one's baseline
    sb:destroy()
    local self_exe = io.popen("readlink /proc/$PPID/exe") -- the shell's parent: this runtime
    local exe = self_exe:read("*l")
    self_exe:close()
    for _, name in ipairs { "exec", "stream", "process", "code" } do
      local p = assert(io.popen(("%s %s %s %d %d"):format(exe, arg[0], name, N, SIZE)))
      io.write((p:read("*a"):match("\n(| " .. name .. " [^\n]*\n)") or ("| " .. name .. " | failed |\n")))
      p:close()
    end
    return
  end
  for _, name in ipairs { which } do
    collectgarbage("collect")
    collectgarbage("collect")
    local base = status("VmRSS")
    reset_peak()
    local kept, peak = select(2, scenarios[name](sb)) -- the results are dropped once counted
    peak = (peak or status("VmHWM")) - base
    if name == "process" then
      sb:getSession("s1"):cleanupCompletedProcesses()
    end
    collectgarbage("collect")
    collectgarbage("collect")
    local left = status("VmRSS") - base
    if os.getenv("BENCH_HEAP") then print("lua heap MB", collectgarbage("count") / 1024) end
    print(("| %s | %.0f MB | %.0f MB | %.2f | %.0f MB |"):format(name, kept / MB, peak / MB, peak / kept, left / MB))
  end
  sb:destroy()
  print(("budget in use after: %d bytes"):format(require("moonbox.session.budget").used))
end)
