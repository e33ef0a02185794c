-- Whether isolation = "auto" may fall back to "none", and what a failure to
-- build a sandbox's namespaces means in plain words.
--
-- The fallback happens only when the kernel refuses user namespaces, which
-- is probed once (core.userns_probe: a clone(CLONE_NEWUSER) child that exits
-- at once): EPERM (forbidden by a sysctl, an LSM or a seccomp filter),
-- EINVAL (no user namespace support), EUSERS (nested too deep), ENOSPC with
-- user.max_user_namespaces = 0. Anything else (EMFILE, ENFILE, ENOMEM,
-- EAGAIN, ENOSPC from a limit that is merely reached, ...) is a failure of
-- this call, never a reason to run a sandbox with less (docs/isolation.md).
local core = require "moonbox.core"
local util = require "moonbox.lib.util"
local cause_mod = require "moonbox.sandbox.userns_cause"

local M = {}

local PLAIN = {
  EMFILE = "the runtime has too many open files (RLIMIT_NOFILE, see ulimit -n)",
  ENFILE = "the host has too many open files (fs.file-max)",
  ENOMEM = "there is not enough memory",
  EAGAIN = "the runtime may not start another process (RLIMIT_NPROC, a pids cgroup or kernel.threads-max)",
  EPERM = "the kernel does not let this runtime create user namespaces " ..
    "(kernel.unprivileged_userns_clone, an LSM such as AppArmor, or a seccomp filter)",
  EACCES = "the kernel does not let this runtime create user namespaces (permission denied)",
  EINVAL = "this kernel has no user namespace support",
  EUSERS = "user namespaces are nested too deeply on this host",
  ENOSPC = "user namespaces are limited on this host (user.max_user_namespaces)",
}

-- plain(code, message) -> the cause in plain words, the raw message after it.
function M.plain(code, message)
  local words = PLAIN[code]
  if code == "ENOSPC" and not tostring(message):find("CLONE_NEWUSER", 1, true) then
    -- the sandbox's clone asks for several namespaces: any of their limits
    words = "user namespaces are limited on this host (user.max_user_namespaces, " ..
      "or another user.max_*_namespaces)"
  end
  if not words then return tostring(message) end
  return ("%s (%s)"):format(words, tostring(message))
end

local REFUSALS = { EPERM = true, EACCES = true, EINVAL = true, EUSERS = true }

local refused -- nil: not probed yet; false: user namespaces work; string: why they are refused

-- refused() -> nil when user namespaces work, or the reason they are refused
-- (in plain words). A transient failure of the probe is returned as
-- nil, message, CODE and probed again next time.
function M.refused()
  if refused ~= nil then return refused or nil end
  local ok, msg, code = core.userns_probe()
  if ok then
    refused = false
    return nil
  end
  local limit = tonumber(util.read_file("/proc/sys/user/max_user_namespaces") or "")
  if REFUSALS[code] or (code == "ENOSPC" and limit == 0) then
    -- EPERM has several causes: name the one this process shows
    local cause = (code == "EPERM" or code == "EACCES") and cause_mod.explain(cause_mod.facts())
    refused = cause and ("%s (%s)"):format(cause, tostring(msg)) or M.plain(code, msg)
    return refused
  end
  return nil, M.plain(code, msg), code
end

local warned = false
-- warn_once(reason): the fallback is said once per runtime, on stderr.
function M.warn_once(reason)
  if warned then return end
  warned = true
  io.stderr:write("moonbox: warning: sandboxes with isolation = \"auto\" run without isolation (\"none\") ",
    "on this host: ", reason, "\n")
  io.stderr:flush()
end

return M
