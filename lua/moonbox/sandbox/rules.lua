-- A sandbox's rules, derived once from its policy and getSandbox's choices:
-- the capabilities its processes keep, its seccomp filter, who root inside
-- is on the host, its network, hostname and mounts, and its cgroup. Used by
-- the sandbox (making it, rebuilding its init, spawning, info) and by the
-- spare (sandbox/prewarm.lua), which must build what a sandbox of the same
-- rules would, and is claimed only by one whose rules match (key).
local core = require "moonbox.core"
local isolation_mod = require "moonbox.sandbox.isolation"
local seccomp = require "moonbox.sandbox.seccomp"
local tree = require "moonbox.process.tree"
local cgroup = require "moonbox.process.cgroup"
local kernels = require "moonbox.code.kernels"

local M = {}

-- The cgroup directory of a sandbox (or spare) whose cgroup is name, or
-- nil when trees are not killed through cgroups.
function M.cgroup_dir(name)
  if not name or tree.mode() ~= "cgroup" then return nil end
  return cgroup.base() .. "/" .. name
end

-- derive(policy, choice) -> rules. choice: {network, hostname, isolated}:
-- the network and hostname the sandbox gets, and whether it has its own
-- namespaces (without them root inside is the runtime itself).
function M.derive(policy, choice)
  local capabilities = policy.capabilities or isolation_mod.DEFAULT_CAPABILITIES
  local filter = seccomp.filter(policy.seccomp)
  return {
    network = choice.network,
    hostname = choice.hostname,
    capabilities = capabilities,                      -- as the policy names them
    cap_keep = isolation_mod.cap_numbers(capabilities), -- the bounding set of its processes
    seccomp = filter,                                 -- nil: the profile "none"
    seccomp_profile = filter and (policy.seccomp or "default") or "none",
    idmap = choice.isolated and isolation_mod.idmap(policy)
      or { uid = core.getuid(), gid = core.getgid(), count = 1 },
    mounts = policy.mounts,
    userns = policy.userns,
    tmpBytes = policy.limits.tmpBytes,
  }
end

-- The options isolation.start takes for an init built by these rules;
-- extra adds what is the sandbox's own (its owner uid, image, resolv.conf,
-- on_exit, deferred) and cgroup_name places the init in that cgroup.
function M.init_options(rules, cgroup_name, extra)
  local dir = M.cgroup_dir(cgroup_name)
  local opts = {
    network = rules.network,
    hostname = rules.hostname,
    tmpBytes = rules.tmpBytes,
    kernels = kernels.dir(),
    extra = rules.mounts,
    idmap = rules.idmap,
    userns = rules.userns,
    cgroups = dir and { dir } or nil,
  }
  for k, v in pairs(extra) do opts[k] = v end
  return opts
end

-- What a pre-built root and shell depend on: a sandbox may claim a spare
-- only when all of it matches (the hostname is set at the claim).
function M.key(rules, policy)
  local mounts = {}
  for i, m in ipairs(rules.mounts or {}) do
    mounts[i] = table.concat({ m.type, m.src or "", m.dst, tostring(m.size or "") }, "\1")
  end
  local l = policy.limits
  local idmap = rules.idmap
  local userns = {}
  for k, v in pairs(rules.userns or {}) do userns[#userns + 1] = k .. "=" .. tostring(v) end
  table.sort(userns)
  return table.concat({ rules.network, table.concat(mounts, "\2"), table.concat(rules.capabilities, ","),
    tostring(policy.seccomp or "default"), tostring(policy.shell), tostring(l.tmpBytes),
    tostring(l.cpuTime), tostring(l.fileSizeBytes), tostring(l.openFiles), tostring(l.memoryBytes),
    tostring(l.pids), ("%d:%d:%d"):format(idmap.uid, idmap.gid, idmap.count), table.concat(userns, ",") }, "\3")
end

return M
