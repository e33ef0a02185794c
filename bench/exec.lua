-- Exec benchmark (issue #3): moonbox exec against raw floors measured in the
-- same run. Run: ./build/moonbox bench/exec.lua [iterations [isolation]]
-- (isolation: "auto", the default, "namespaces" or "none")
local moonbox = require "moonbox"
local core = require "moonbox.core"
local async = require "moonbox.async"

local N = tonumber(arg and arg[1]) or 2000
local function ms() return core.hrtime() / 1e6 end
local function stats(samples)
  table.sort(samples)
  local function q(p) return samples[math.max(1, math.floor(#samples * p + 0.5))] end
  return q(0.5), q(0.99)
end
local rows = {}
local function row(name, p50, p99, note)
  rows[#rows + 1] = ("| %-44s | %9.3f | %9.3f | %s |"):format(name, p50, p99, note or "")
end

-- Floor 1: a persistent bash over pipes answering a marker (after running
-- `command`, a builtin or an external program). interleave(from, to):
-- called after every BLOCK of the floor's own commands, numbered from..to (a
-- measurement taken in turns with the floor's, so that both see the same
-- machine: on a shared VM the cost of a wake-up drifts by half within a
-- minute, and a ratio of two measurements made one after the other moved
-- with it).
local BLOCK = 50
local function raw_bash_floor(command, interleave)
  local proc, pipes = assert(core.spawn { args = { "bash", "--noprofile", "--norc" }, file = "/bin/bash",
    env = { PATH = "/usr/bin:/bin" }, stdio = { [0] = "pipe", [1] = "pipe", [2] = "null" } })
  local waiting, buf = nil, ""
  pipes[1]:read_start(function(_, data)
    if not data then return end
    buf = buf .. data
    if buf:find("m\n", 1, true) and waiting then buf = "" local w = waiting waiting = nil w() end
  end)
  local samples = {}
  for i = 1, N do
    local t = ms()
    async.await(function(resume) waiting = resume pipes[0]:write(command .. "; echo m\n") end)
    samples[i] = ms() - t
    if interleave and (i % BLOCK == 0 or i == N) then interleave(i - (i - 1) % BLOCK, i) end
  end
  pipes[0]:close() pipes[1]:close()
  async.await(function(resume) if proc:status() == "exited" then return resume() end
    local timer = core.timer()
    timer:start(0, 5, function() if proc:status() == "exited" then timer:close() resume() end end)
  end)
  return stats(samples)
end

-- Floor 2: spawn /bin/true directly and wait for its exit.
local function raw_spawn_floor()
  local samples = {}
  for i = 1, N do
    local t = ms()
    async.await(function(resume)
      assert(core.spawn { args = { "/bin/true" }, stdio = { [0] = "null", [1] = "null", [2] = "null" },
        on_exit = function() resume() end })
    end)
    samples[i] = ms() - t
  end
  return stats(samples)
end

-- Floor 3: bytes per second read from a raw pipe.
local function raw_pipe_throughput(bytes)
  local t = ms()
  local total = 0
  async.await(function(resume)
    local _, pipes = assert(core.spawn { args = { "head", "-c", tostring(bytes), "/dev/zero" },
      env = { PATH = "/usr/bin:/bin" }, stdio = { [0] = "null", [1] = "pipe", [2] = "null" } })
    pipes[1]:read_start(function(_, data)
      if data then total = total + #data else pipes[1]:close() resume() end
    end)
  end)
  assert(total == bytes)
  return bytes / ((ms() - t) / 1000)
end

moonbox.run(function()
  local root = os.tmpname() .. ".d"
  local sb = moonbox.getSandbox("bench-exec", { root = root, isolation = arg and arg[2] or "auto" })
  print("isolation: " .. sb:info().isolation)
  local s = sb:createSession { id = "b" }
  s:exec("true")
  -- exec("true") in turns with its floor, BLOCK commands each
  local exec_samples = {}
  local bash50, bash99 = raw_bash_floor("true", function(from, to)
    for i = from, to do local t = ms() s:exec("true") exec_samples[i] = ms() - t end
  end)
  row("raw floor: bash over pipes, `true; echo m`", bash50, bash99)
  local b50, b99 = stats(exec_samples)
  row("exec(\"true\") (builtin)", b50, b99, ("+%.3f ms over the floor at p50; %.2fx the floor at p50, %.2fx at p99"
    .. " (issue #32: 1.5x, 3x)"):format(b50 - bash50, b50 / bash50, b99 / bash99))
  local sp50, sp99 = raw_spawn_floor()
  row("raw floor: spawn /bin/true + wait", sp50, sp99)
  local e50, e99 = (function()
    local samples = {}
    for i = 1, N do local t = ms() s:exec("/bin/true") samples[i] = ms() - t end
    return stats(samples)
  end)()
  -- the same with the shell's spawn builtin off: bash forks for it
  moonbox.shellBuiltins { spawn = false }
  local f50, f99 = (function()
    local samples = {}
    for i = 1, N do local t = ms() s:exec("/bin/true") samples[i] = ms() - t end
    return stats(samples)
  end)()
  moonbox.shellBuiltins { spawn = true }
  local bt50, bt99 = raw_bash_floor("/bin/true")
  row("raw floor: bash over pipes, `/bin/true; echo m`", bt50, bt99)
  row("exec(\"/bin/true\")", e50, e99, ("%.2fx the spawn floor, %.2fx the bash floor at p50"):format(
    e50 / sp50, e50 / bt50))
  row("exec(\"/bin/true\"), spawn builtin off", f50, f99, ("%.2fx the spawn floor"):format(f50 / sp50))
  local created = {}
  for i = 1, 200 do
    local t = ms()
    local x = sb:createSession {}
    x:exec("true")
    created[i] = ms() - t
    sb:deleteSession(x.id)
    moonbox.sleep(10) -- sessions are not created back to back: the spare shell gets warm
  end
  local c50, c99 = stats(created)
  row("createSession + first exec(\"true\")", c50, c99)
  -- the runtime's side of it: 4 sessions at once, commands per second and
  -- the runtime's CPU per command (/proc/self/stat, utime + stime)
  local function own_cpu_ms()
    local f = assert(io.open("/proc/self/stat"))
    local fields = {}
    for x in f:read("*a"):match("%) (.*)"):gmatch("%S+") do fields[#fields + 1] = x end
    f:close()
    return (tonumber(fields[12]) + tonumber(fields[13])) * 10 -- (USER_HZ 100)
  end
  local many = {}
  for i = 1, 4 do many[i] = sb:createSession {} many[i]:exec("true") end
  local cpu0, wall0 = own_cpu_ms(), ms()
  local runs = {}
  for i = 1, 4 do runs[i] = function() for _ = 1, N do many[i]:exec("true") end end end
  moonbox.all(unpack(runs))
  local cpu_per, wall_all = (own_cpu_ms() - cpu0) / (4 * N) * 1000, ms() - wall0
  local concurrent = ("4 sessions at once, %d exec(\"true\") each: %.0f commands/s; the runtime's CPU %.1f us"
    .. " per command"):format(N, 4 * N / (wall_all / 1000), cpu_per)
  local bytes = 1024 * 1024 * 1024
  local raw_bps = raw_pipe_throughput(bytes)
  local t = ms()
  local seen = 0
  s:exec("head -c " .. bytes .. " /dev/zero", { onOutput = function(_, d) seen = seen + #d end, maxOutputBytes = 0 })
  local exec_bps = bytes / ((ms() - t) / 1000)
  assert(seen == 0 or seen == bytes)
  print(("\n%d iterations; times in ms\n"):format(N))
  print("| measurement                                  |       p50 |       p99 | note |")
  print("|----------------------------------------------|-----------|-----------|------|")
  for _, r in ipairs(rows) do print(r) end
  print("\n" .. concurrent)
  print(("\nthroughput, 1 GiB: raw pipe %.0f MB/s; exec with onOutput %.0f MB/s (%.2fx)"):format(
    raw_bps / 1e6, exec_bps / 1e6, exec_bps / raw_bps))
  sb:destroy()
end)
