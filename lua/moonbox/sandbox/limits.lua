-- Resource limits from policy.limits, enforced with what this host offers,
-- and reported honestly (sandbox:info()):
--   memoryBytes, pids, cpuWeight -> a cgroup v1 controller directory per
--                        sandbox (memory.limit_in_bytes, pids.max, cpu.shares)
--                        when writable, else cgroup v2 memory.max / pids.max /
--                        cpu.weight when delegated, else not enforced (and
--                        info() says so);
--   cpuTime (s), fileSizeBytes, openFiles -> rlimits on every process.
local core = require "moonbox.core"
local util = require "moonbox.lib.util"
local rules_mod = require "moonbox.sandbox.rules"
local cgroup = require "moonbox.process.cgroup"

local M = {}

local V1 = { memory = "/sys/fs/cgroup/memory", pids = "/sys/fs/cgroup/pids", cpu = "/sys/fs/cgroup/cpu" }
local FILES = {
  memory = { v1 = "memory.limit_in_bytes", v2 = "memory.max" },
  pids = { v1 = "pids.max", v2 = "pids.max" },
  cpu = { v1 = "cpu.shares", v2 = "cpu.weight" },
}
-- cpuWeight is cgroup v2's cpu.weight (1-10000, 100 the default); v1's
-- cpu.shares says the same with 1024 as the default.
local TO_V1 = { cpu = function(weight) return math.max(2, math.floor(weight * 1024 / 100)) end }
local CONTROLLERS = { memoryBytes = "memory", pids = "pids", cpuWeight = "cpu" }
-- The weight of the runtime's group that holds every sandbox (cpu.weight
-- units, a quarter of one runtime thread's 100): under an output flood the
-- tenant's pipeline, woken by every read the loop made, kept preempting
-- the loop, and at an equal weight another sandbox's exec waited 20-90 ms
-- while the flood opened (issue #29, docs/benchmarks.md). Only a share
-- when both want the CPU: sandboxes still get every cycle the runtime
-- leaves, and one runtime thread can busy one core at most.
M.SANDBOXES_WEIGHT = 25
-- the group files that weight was written to: once per runtime, not at every
-- sandbox's creation (forgotten at shutdown, which removes the groups)
local weighted = {}
local function weigh_sandboxes(file, value)
  if not weighted[file] and util.write_file(file, value) then weighted[file] = true end
end

local function mkdir_p(path)
  if util.is_dir(path) then return true end
  local parent = path:match("^(.*)/[^/]+$")
  if parent and parent ~= "" and not mkdir_p(parent) then return false end
  return core.mkdir(path) ~= nil or util.is_dir(path)
end

-- Remove root's per-runtime groups (moonbox-<pid>, and the sandboxes' below
-- it) of runtimes that are gone, and ours too when own. (rmdir only: a
-- group that still holds a process stays.)
local function remove_runtime_dirs(root, own)
  for _, name in ipairs(core.readdir(root) or {}) do
    local pid = tonumber(name:match("^moonbox%-(%d+)$"))
    if pid and (pid == core.getpid() and own or pid ~= core.getpid() and not util.pid_alive(pid)) then
      cgroup.remove_cgroup(root .. "/" .. name)
    end
  end
end

-- The groups of runtimes that died without removing theirs (killed: no
-- shutdown ran), once per hierarchy and runtime, as process/cgroup.lua
-- sweeps the v2 one: they stayed for ever, one set per killed runtime.
-- (What still runs in one was in the dead runtime's v2 group too, killed by
-- that sweep; a group that is not empty yet stays, for the next runtime.)
local swept = {}
local function sweep_stale(root)
  if swept[root] then return end
  swept[root] = true
  remove_runtime_dirs(root, false)
end

-- A v1 directory for this sandbox under controller, with value written.
local function v1_dir(controller, sandbox_id, value)
  local root = V1[controller]
  if not util.read_file(root .. "/cgroup.procs") then return nil end
  sweep_stale(root)
  local dir = ("%s/moonbox-%d/sb-%s"):format(root, core.getpid(), sandbox_id)
  if not mkdir_p(dir) then return nil end
  if TO_V1[controller] then value = TO_V1[controller](value) end
  if not util.write_file(dir .. "/" .. FILES[controller].v1, tostring(math.floor(value))) then
    core.rmdir(dir)
    return nil
  end
  return dir
end

local function v2_limit(controller, sandbox_cgroup, value)
  if not sandbox_cgroup then return nil end
  local file = sandbox_cgroup .. "/" .. FILES[controller].v2
  if not util.read_file(file) then return nil end
  if not util.write_file(file, tostring(math.floor(value))) then return nil end
  return sandbox_cgroup
end

-- setup(sandbox) -> {rlimits, extra_cgroups, enforced = {name = how}, not_enforced = {names}}
function M.setup(sb)
  local limits = sb.policy.limits
  local out = { rlimits = {}, extra_cgroups = {}, enforced = {}, not_enforced = {}, v1_dirs = {} }
  local sandbox_cgroup = rules_mod.cgroup_dir(sb.cgroup_name)
  -- Each sandbox's processes sit in one group per controller, under one
  -- group of the runtime's (moonbox-<pid>/sb-<id>). Under cpu, all
  -- sandboxes together weigh a quarter of one thread of the runtime
  -- (M.SANDBOXES_WEIGHT), so a tenant's many busy processes cannot starve
  -- the loop that serves everyone (issue #29: exec latency under an output
  -- flood), and each sandbox weighs as its cpuWeight says, however many
  -- processes it runs.
  for name, controller in pairs(CONTROLLERS) do
    local value = limits[name]
    if value and value > 0 then -- (0: off)
      local dir = v1_dir(controller, sb.id, value)
      if dir then
        out.extra_cgroups[#out.extra_cgroups + 1] = dir
        out.v1_dirs[controller] = dir
        out.enforced[name] = "cgroup v1 " .. controller
      elseif v2_limit(controller, sandbox_cgroup, value) then
        out.enforced[name] = "cgroup v2 " .. controller
      else
        out.not_enforced[#out.not_enforced + 1] = name
      end
    end
  end
  -- the group of all sandboxes weighs M.SANDBOXES_WEIGHT against the runtime
  -- (a preference, not a protection: where it cannot be written the
  -- sandboxes weigh as one runtime thread, the kernel's default)
  if out.v1_dirs.cpu then
    weigh_sandboxes(out.v1_dirs.cpu:match("^(.*)/[^/]+$") .. "/cpu.shares", tostring(TO_V1.cpu(M.SANDBOXES_WEIGHT)))
  elseif out.enforced.cpuWeight and sandbox_cgroup then
    weigh_sandboxes(sandbox_cgroup:match("^(.*)/[^/]+$") .. "/cpu.weight", tostring(M.SANDBOXES_WEIGHT))
  end
  -- the disk quota is set up before the root is made (sandbox/disk.lua)
  if (limits.diskBytes or 0) > 0 then
    if sb.disk then
      out.enforced.diskBytes = "ext4 image (loop mount)"
    else
      out.not_enforced[#out.not_enforced + 1] = "diskBytes"
    end
  end
  for name, rl in pairs { cpuTime = "cpu", fileSizeBytes = "fsize", openFiles = "nofile" } do
    if limits[name] then
      out.rlimits[rl] = limits[name]
      out.enforced[name] = "rlimit " .. rl
    end
  end
  if not next(out.rlimits) then out.rlimits = nil end
  out.seccomp, out.seccomp_profile = sb.rules.seccomp, sb.rules.seccomp_profile
  if #out.extra_cgroups == 0 then out.extra_cgroups = nil end
  table.sort(out.not_enforced)
  return out
end

-- adopt(state, cgroup_dir): a pre-built sandbox's processes (all of them
-- in cgroup_dir's tree: its init and its shell, idle) join the v1 limit
-- directories setup made, as processes spawned later join them at their
-- start; what they fork from then on is born inside. -> true | nil, message
function M.adopt(state, cgroup_dir)
  if not next(state.v1_dirs) then return true end
  local pids = {}
  local function walk(dir)
    for pid in (util.read_file(dir .. "/cgroup.procs") or ""):gmatch("%d+") do pids[#pids + 1] = pid end
    for _, name in ipairs(core.readdir(dir) or {}) do
      if util.is_dir(dir .. "/" .. name) then walk(dir .. "/" .. name) end
    end
  end
  walk(cgroup_dir)
  if #pids == 0 then return nil, "the pre-built sandbox has no processes in " .. cgroup_dir end
  for _, dir in pairs(state.v1_dirs) do
    for _, pid in ipairs(pids) do
      if not util.write_file(dir .. "/cgroup.procs", pid) and util.read_file("/proc/" .. pid .. "/stat") then
        return nil, ("cannot move process %s into %s"):format(pid, dir)
      end
    end
  end
  return true
end

-- Memory-limit kills so far in this sandbox (cgroup v1 memory.oom_control).
function M.oom_kills(state)
  local dir = state.v1_dirs.memory
  if not dir then return 0 end
  -- (read before every exec: one pread of a file held open while the
  -- sandbox lives, not an open, read and close each time, issue #32)
  local fd = state.oom_fd
  if not fd then
    fd = core.open_fd(dir .. "/memory.oom_control", "r")
    if not fd then return 0 end
    state.oom_fd = fd
  end
  local text = core.pread_all(fd, 4096) or ""
  return tonumber(text:match("oom_kill (%d+)")) or 0
end

function M.cleanup(state, sleep)
  if state.oom_fd then core.close_fd(state.oom_fd) state.oom_fd = nil end
  for _, dir in pairs(state.v1_dirs) do
    for _ = 1, 200 do
      if core.rmdir(dir) or not util.is_dir(dir) then break end
      sleep(10)
    end
  end
end

-- Runtime exit: remove our per-runtime v1 directories, and those of dead
-- runtimes (their processes are gone with their v2 cgroups).
function M.shutdown()
  weighted = {}
  for _, root in pairs(V1) do remove_runtime_dirs(root, true) end
end

return M
