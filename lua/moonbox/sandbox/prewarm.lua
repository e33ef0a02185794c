-- Pre-built sandboxes (opt-in: moonbox.prewarm(true)): a sandbox init with
-- its namespaces and root filesystem made ahead, entering it deferred, and a
-- session shell already started inside it. The next getSandbox whose policy
-- builds the same root claims it: the init binds that sandbox's workspace,
-- takes its hostname and enters the root (init:finish); the shell becomes
-- the sandbox's warm spare, adopted by its first session. A claim is
-- replaced a moment later, outside the caller's time.
local core = require "moonbox.core"
local async = require "moonbox.async"
local policy_mod = require "moonbox.policy"
local isolation_mod = require "moonbox.sandbox.isolation"
local shell_mod = require "moonbox.session.shell"
local kernels = require "moonbox.code.kernels"
local seccomp = require "moonbox.sandbox.seccomp"
local spawn_rules = require "moonbox.sandbox.spawn"
local tree = require "moonbox.process.tree"

local M = { enabled = false }

local REFILL_DELAY_MS = 10
local spare        -- {init, shell, key, namespaces, owner, cgroup_name}
local refill_timer
local seq = 0

-- In cgroup mode a spare is built in a cgroup of its own, pre-<n>, with its
-- shell in pre-<n>/s-default/cmd0, and the sandbox that claims it keeps that
-- cgroup as its own: no process migrates (moving the init cost 4-15 ms, a
-- migration waits out an RCU grace period when none happened lately), and
-- the default session finds its shell already in place.
local SHELL_CGROUP = "s-default"

-- What the pre-built root and shell depend on: a sandbox may claim a spare
-- only when all of it matches.
local function key_of(policy, network)
  local mounts = {}
  for i, m in ipairs(policy.mounts or {}) do
    mounts[i] = table.concat({ m.type, m.src or "", m.dst, tostring(m.size or "") }, "\1")
  end
  local caps = policy.capabilities or isolation_mod.DEFAULT_CAPABILITIES
  local l = policy.limits
  local idmap = isolation_mod.idmap(policy)
  local userns = {}
  for k, v in pairs(policy.userns or {}) do userns[#userns + 1] = k .. "=" .. tostring(v) end
  table.sort(userns)
  return table.concat({ network, table.concat(mounts, "\2"), table.concat(caps, ","),
    tostring(policy.seccomp or "default"), tostring(policy.shell), tostring(l.tmpBytes),
    tostring(l.cpuTime), tostring(l.fileSizeBytes), tostring(l.openFiles), tostring(l.memoryBytes),
    tostring(l.pids), ("%d:%d:%d"):format(idmap.uid, idmap.gid, idmap.count), table.concat(userns, ",") }, "\3")
end
M.key_of = key_of

local function drop(s)
  if not s then return end
  if s.shell and s.shell:alive() then s.shell:kill("SIGKILL") end
  if s.init then s.init:close() end
  if s.cgroup_name then
    local dir = tree.base() .. "/" .. s.cgroup_name
    tree.kill_cgroup(dir)
    async.spawn(function() tree.remove_when_empty(dir, async.sleep) end)
  end
end

local function make()
  local policy = policy_mod.resolve(nil, nil)
  if policy.limits.cpuTime or policy.limits.fileSizeBytes or policy.limits.openFiles then
    return nil -- rlimits: not pre-built (memory and pids are put on at claim: limits.adopt)
  end
  local network = policy.network or "none"
  if network == "egress" then return nil end -- (its resolv.conf and link are its own: never pre-built)
  local s = { key = key_of(policy, network) }
  local cgroups, shell_cgroup, session_cgroup
  if tree.mode() == "cgroup" then
    seq = seq + 1
    s.cgroup_name = "pre-" .. seq
    local dir = tree.create(s.cgroup_name)
    session_cgroup = dir and tree.create(s.cgroup_name .. "/" .. SHELL_CGROUP)
    shell_cgroup = session_cgroup and tree.create(s.cgroup_name .. "/" .. SHELL_CGROUP .. "/cmd0")
    if not shell_cgroup then drop(s) return nil end
    cgroups = { dir }
  end
  s.idmap = isolation_mod.idmap(policy)
  s.owner_uid = isolation_mod.owner_uid(s.idmap)
  local init, namespaces = isolation_mod.start({}, {
    network = network, hostname = "moonbox", tmpBytes = policy.limits.tmpBytes,
    idmap = s.idmap, owner_uid = s.owner_uid, userns = policy.userns,
    kernels = kernels.dir(), extra = policy.mounts, deferred = true,
    cgroups = cgroups, on_exit = function() if s.owner then s.owner() end end,
  })
  if not init then drop(s) return nil end
  s.init, s.namespaces = init, namespaces
  local caps = isolation_mod.cap_numbers(policy.capabilities or isolation_mod.DEFAULT_CAPABILITIES)
  local env = { PATH = policy.env.PATH or nil, LANG = policy.env.LANG or nil, HOME = "/root" }
  s.shell = shell_mod.spawn {
    env = env, shell = policy.shell, deferred = true,
    cgroup = shell_cgroup, session_cgroup = session_cgroup,
    -- the sandbox's rules as spawn_spec gives them (no limits: never pre-built)
    spawn_spec = function(spec)
      return spawn_rules.apply({ init = init, cap_keep = caps, idmap = s.idmap,
        limits = { seccomp = seccomp.filter(policy.seccomp) },
        cgroup_dir = s.cgroup_name and (tree.base() .. "/" .. s.cgroup_name) or nil }, spec)
    end,
  }
  if not s.shell then drop(s) return nil end
  return s
end

local function schedule_refill()
  if not M.enabled or spare or refill_timer then return end
  refill_timer = core.timer()
  refill_timer:start(REFILL_DELAY_MS, 0, function()
    refill_timer:close()
    refill_timer = nil
    -- a task: finding the kernels' directory waits on the file system
    async.spawn(function()
      local s = M.enabled and not spare and make() or nil
      if s and M.enabled and not spare then spare = s else drop(s) end
    end)
  end)
end

-- enable(true | false): keep one pre-built sandbox ready, or drop it.
function M.enable(on)
  M.enabled = on and true or false
  if M.enabled then
    schedule_refill()
  else
    if refill_timer then refill_timer:close() refill_timer = nil end
    local s = spare
    spare = nil
    drop(s)
  end
end

-- Whether a pre-built sandbox is ready now.
function M.ready() return spare ~= nil end

-- claim(key, hostname, workspace, on_exit) -> {init, shell, namespaces,
-- cgroup_name, idmap} | nil. cgroup_name (cgroup mode): the spare's cgroup, which
-- becomes the sandbox's (cgroup v2 cannot rename one).
function M.claim(key, hostname, workspace, on_exit)
  local s = spare
  if not s or s.key ~= key or not s.shell:alive() then return nil end
  spare = nil
  schedule_refill()
  local ok = s.init:finish(hostname, workspace, "/workspace")
  if not ok then drop(s) return nil end
  s.owner = on_exit
  return s
end

return M
