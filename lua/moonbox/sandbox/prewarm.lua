-- Pre-built sandboxes (opt-in: moonbox.prewarm(n), a pool of up to n
-- spares, MAX_SPARES at most; true is 1): each a sandbox init with
-- its namespaces and root filesystem made ahead, entering it deferred, a
-- session shell already started inside it, and (where the disk quota is
-- enforced) its disk image made, attached and mounted, held as a detached
-- mount (sandbox/disk.lua). The next getSandbox whose policy builds the
-- same root takes it (take) while it makes its root: the disk is put at
-- the root in one system call; then the init binds that sandbox's
-- workspace, takes its hostname and enters the root (finish); the shell
-- becomes the sandbox's warm spare, adopted by its first session. A spare
-- taken is replaced a moment later, outside the caller's time, one spare
-- at a time (a burst of builds would compete with the caller for the CPU).
local core = require "moonbox.core"
local async = require "moonbox.async"
local policy_mod = require "moonbox.policy"
local isolation_mod = require "moonbox.sandbox.isolation"
local shell_mod = require "moonbox.session.shell"
local spawn_rules = require "moonbox.sandbox.spawn"
local tree = require "moonbox.process.tree"
local cgroup = require "moonbox.process.cgroup"
local rules_mod = require "moonbox.sandbox.rules"
local errors = require "moonbox.errors"
local disk = require "moonbox.sandbox.disk"

local M = { enabled = false, size = 0 }

M.MAX_SPARES = 16 -- each holds an init, a shell, a root, a cgroup and a disk image
-- (after the getSandbox that took one and its first exec, in the usual case)
local REFILL_DELAY_MS = 50
local spares = {}  -- {init, shell, key, namespaces, owner, cgroup_name, disk}, oldest first
local building = false -- a make() under way (it waits on the file system)
local refill_timer
local seq = 0

-- In cgroup mode a spare is built in a cgroup of its own, pre-<n>, with its
-- shell in pre-<n>/s-default/cmd0, and the sandbox that claims it keeps that
-- cgroup as its own: no process migrates (moving the init cost 4-15 ms, a
-- migration waits out an RCU grace period when none happened lately), and
-- the default session finds its shell already in place.
local SHELL_CGROUP = "s-default"

-- The home directory spares' disks are made under: sandbox/init.lua's
-- default_home (set there: it requires this module).
M.home = nil

-- What a pre-built root, shell and disk depend on: a sandbox may take a
-- spare only when all of it matches (the hostname is set at the claim).
function M.key(rules, policy)
  return rules_mod.key(rules, policy) .. "\3" .. tostring(policy.limits.diskBytes)
end

-- drop(s, wait): everything the spare holds goes: its processes, its
-- cgroup, its disk (waited for with wait, in a task). Once only: a spare a
-- sandbox finished is the sandbox's, and not dropped here.
local function drop(s, wait)
  if not s or s.dropped or s.finished then return end
  s.dropped = true
  if s.disk then
    local d = s.disk
    s.disk = nil
    if wait then disk.drop_spare(d) else async.spawn(function() disk.drop_spare(d) end) end
  end
  if s.shell and s.shell:alive() then s.shell:kill("SIGKILL") end
  if s.init then s.init:close() end
  if s.cgroup_name then
    local dir = rules_mod.cgroup_dir(s.cgroup_name)
    cgroup.kill_cgroup(dir)
    async.spawn(function() cgroup.remove_when_empty(dir, async.sleep) end)
  end
end

local function build(s)
  local policy = policy_mod.resolve(nil, nil)
  if policy.limits.cpuTime or policy.limits.fileSizeBytes or policy.limits.openFiles then
    return nil -- rlimits: not pre-built (memory and pids are put on at claim: limits.adopt)
  end
  local network = policy.network or "none"
  if network == "egress" then return nil end -- (its resolv.conf and link are its own: never pre-built)
  -- the rules a sandbox of the default policy gets (its hostname is set at the claim)
  local rules = rules_mod.derive(policy, { network = network, hostname = "moonbox", isolated = true })
  s.key = M.key(rules, policy)
  -- its disk first (the most work, on the thread pool and a cp): one that
  -- should be enforced and cannot be made means no spare (fail closed: a
  -- claim then makes the disk cold, with its own error if it fails too)
  local why
  s.disk, why = disk.spare(M.home and M.home(), policy.limits.diskBytes)
  if not s.disk and why then
    io.stderr:write("moonbox: a spare sandbox's disk: " .. tostring(why) .. "\n")
    return nil
  end
  local shell_cgroup, session_cgroup
  if tree.mode() == "cgroup" then
    seq = seq + 1
    s.cgroup_name = "pre-" .. seq
    local dir = cgroup.create(s.cgroup_name)
    session_cgroup = dir and cgroup.create(s.cgroup_name .. "/" .. SHELL_CGROUP)
    shell_cgroup = session_cgroup and cgroup.create(s.cgroup_name .. "/" .. SHELL_CGROUP .. "/cmd0")
    if not shell_cgroup then drop(s, true) return nil end
  end
  s.idmap = rules.idmap
  s.owner_uid = isolation_mod.owner_uid(s.idmap)
  local init, namespaces = isolation_mod.start({}, rules_mod.init_options(rules, s.cgroup_name, {
    owner_uid = s.owner_uid, deferred = true,
    on_exit = function() if s.owner then s.owner() end end,
  }))
  if not init then drop(s, true) return nil end
  s.init, s.namespaces = init, namespaces
  local env = { PATH = policy.env.PATH or nil, LANG = policy.env.LANG or nil, HOME = "/root" }
  s.shell = shell_mod.spawn {
    env = env, shell = policy.shell, deferred = true,
    cgroup = shell_cgroup, session_cgroup = session_cgroup,
    -- the sandbox's rules as spawn_spec gives them (no limits: never pre-built)
    spawn_spec = function(spec)
      return spawn_rules.apply({ init = init, cap_keep = rules.cap_keep, idmap = s.idmap,
        limits = { seccomp = rules.seccomp }, cgroup_dir = rules_mod.cgroup_dir(s.cgroup_name) }, spec)
    end,
  }
  if not s.shell then drop(s, true) return nil end
  return s
end

-- A spare, or nil (nothing to build for this policy, or it failed: what
-- was made is dropped).
local function make()
  local s = {}
  local ok, made = pcall(build, s)
  if not ok then
    drop(s, true)
    error(made, 0)
  end
  return made
end

local function wanted() return M.enabled and #spares < M.size end

local function schedule_refill()
  if not wanted() or building or refill_timer then return end
  refill_timer = core.timer()
  refill_timer:start(REFILL_DELAY_MS, 0, function()
    refill_timer:close()
    refill_timer = nil
    if not wanted() or building then return end
    building = true
    -- a task: finding the kernels' directory waits on the file system
    async.spawn(function()
      local ok, s = pcall(make)
      building = false
      if ok and s and wanted() then
        spares[#spares + 1] = s
        schedule_refill()
      elseif ok then
        drop(s, true) -- disabled or shrunk meanwhile, or nothing to build (no refill: it would fail again)
      else
        io.stderr:write("moonbox: building a spare sandbox failed: " .. tostring(s) .. "\n")
      end
    end)
  end)
end

-- Every spare dropped; in a task, waited for until their disks are gone,
-- and a build under way (it drops what it made: not wanted) with them.
local function drop_all()
  if refill_timer then refill_timer:close() refill_timer = nil end
  local all = spares
  spares = {}
  local wait = async.in_task()
  for _, s in ipairs(all) do drop(s, wait) end
  for _ = 1, wait and 500 or 0 do -- (10 s: a build's own waits are bounded)
    if not building then break end
    async.sleep(20)
  end
end

-- enable(n | true | false): keep up to n pre-built sandboxes ready (true:
-- 1; false or 0: none, every spare dropped). A smaller n drops the newest
-- spares beyond it.
function M.enable(n)
  if n == true then n = 1 elseif n == false or n == nil then n = 0 end
  if type(n) ~= "number" or n ~= math.floor(n) or n < 0 or n > M.MAX_SPARES then
    errors.raise("VALIDATION_FAILED", ("prewarm takes true, false or a whole number 0-%d, got %s")
      :format(M.MAX_SPARES, tostring(n)), { field = "prewarm" })
  end
  M.size = n
  M.enabled = n > 0
  if not M.enabled then
    drop_all()
    return
  end
  while #spares > n do drop(table.remove(spares)) end
  schedule_refill()
end

-- Whether a pre-built sandbox is ready now; count(): how many.
function M.ready() return #spares > 0 end
function M.count() return #spares end

-- take(key) -> spare | nil (key: M.key of the taking sandbox's rules and
-- policy): the oldest live spare of that key, out of the pool (replaced a
-- moment later). Its disk (spare.disk, nil without a quota) is for
-- disk.attach; the rest is finish's. What is not finished, drop(spare).
function M.take(key)
  local s
  for i = 1, #spares do
    local c = spares[i]
    if c.key == key and c.shell:alive() then
      s = table.remove(spares, i)
      break
    end
  end
  -- spares whose shell died are of no use: dropped, and replaced
  for i = #spares, 1, -1 do
    if not spares[i].shell:alive() then drop(table.remove(spares, i)) end
  end
  schedule_refill()
  return s
end

-- finish(spare, hostname, workspace, on_exit) -> {init, shell, namespaces,
-- cgroup_name, idmap, owner_uid} | nil: the init binds the workspace, takes
-- the hostname and enters its root; the spare is the sandbox's from then.
-- cgroup_name (cgroup mode): the spare's cgroup, which becomes the
-- sandbox's (cgroup v2 cannot rename one). Its disk, if left, is dropped.
function M.finish(s, hostname, workspace, on_exit)
  if not s or s.dropped or s.finished then return nil end
  if s.disk then
    local d = s.disk
    s.disk = nil
    async.spawn(function() disk.drop_spare(d) end)
  end
  local ok = s.shell:alive() and s.init:finish(hostname, workspace, "/workspace")
  if not ok then drop(s) return nil end
  s.finished = true
  s.owner = on_exit
  return s
end

M.drop = drop

return M
