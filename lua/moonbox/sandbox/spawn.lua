-- The one spawn spec: what every process a sandbox runs gets, in one place.
--
-- Every process started for a sandbox (session shell, spare and prewarmed
-- shell, background process, code kernel, terminal; exec, sessionless
-- commands, backups and in-sandbox git run in a session shell) is started by
-- core.spawn(M.apply(rules, spec)). Call sites put in spec only what is
-- theirs: args, file, env, cwd, stdio, setsid, ctty, pdeathsig, on_exit and
-- the cgroup they made below the sandbox's. This function adds the rest:
--   * the sandbox's namespaces: run as a child of its init (spec.sandbox),
--   * capabilities: the bounding set kept (cap_keep) and no_new_privs,
--   * pipe ownership: root inside owns the pipes (a script reopens /dev/stdin),
--   * cgroups: the v1 limit directories (extra_cgroups); in cgroup mode the
--     process starts in a cgroup below the sandbox's, never elsewhere,
--   * rlimits and the seccomp filter of the sandbox's policy (sandbox/limits.lua).
-- A call site that sets any of these itself is a bug: it is refused, so no
-- site can weaken (or forget) the sandbox's rules.
-- The environment stays the call site's: it is the session's (policy env <
-- sandbox env < session env, Sandbox:_session_env and Session:current_env),
-- and core.spawn never passes on the runtime's own (no env = an empty one).
--
-- rules: {init (isolation init or nil), cap_keep, idmap = {count, uid, gid},
--   user = {uid, gid, groups?} (ids inside: an image's User, sandbox/image_user.lua;
--   nil: root inside),
--   cgroup_dir (the sandbox's cgroup v2 directory, cgroup mode), limits =
--   {extra_cgroups, rlimits, seccomp} (a sandbox/limits.lua setup result)}
local M = {}

local RESERVED = { "sandbox", "no_new_privs", "cap_keep", "pipe_uid", "pipe_gid", "extra_cgroups", "rlimits",
  "seccomp", "uid", "gid", "groups" }

function M.apply(rules, spec)
  for _, k in ipairs(RESERVED) do
    if spec[k] ~= nil then error("spawn spec: " .. k .. " is the sandbox's, not a call site's", 2) end
  end
  if rules.cgroup_dir then
    -- a process outside the sandbox's cgroup escapes its kill and its limits
    local c = spec.cgroup
    if c == nil then
      spec.cgroup = rules.cgroup_dir
    elseif c ~= rules.cgroup_dir and c:sub(1, #rules.cgroup_dir + 1) ~= rules.cgroup_dir .. "/" then
      error(("spawn spec: cgroup %s is not below the sandbox's %s"):format(c, rules.cgroup_dir), 2)
    end
  end
  local limits = rules.limits or {}
  spec.extra_cgroups = limits.extra_cgroups
  spec.rlimits = limits.rlimits
  spec.seccomp = limits.seccomp
  if rules.init then
    spec.sandbox = rules.init
    spec.no_new_privs = true
    spec.cap_keep = rules.cap_keep
    local user = rules.user
    if user and (user.uid ~= 0 or user.gid ~= 0) then
      -- set inside the sandbox's user namespace, after the bounding set is cut
      spec.uid, spec.gid = user.uid, user.gid
      if user.groups and #user.groups > 0 then spec.groups = user.groups end
    end
    if rules.idmap and rules.idmap.count > 1 then
      -- who the process is on the host owns its pipes
      spec.pipe_uid, spec.pipe_gid = rules.idmap.uid + (user and user.uid or 0),
        rules.idmap.gid + (user and user.gid or 0)
    end
  end
  return spec
end

return M
