-- Why the kernel said EPERM to clone(CLONE_NEWUSER), named from what this
-- process can see, so that the isolation warning and `moonbox serve` name
-- the real cause instead of a list of guesses. The kernel refuses a new
-- user namespace to a process that is
--   * chrooted (its / is not its mount namespace's root: create_user_ns()
--     checks current_chrooted()): /proc/self/mountinfo then has no mount at
--     "/", since it lists only mounts under the process's root;
--   * under a seccomp filter that refuses it (a container runtime's default
--     profile does so for a container without CAP_SYS_ADMIN): Seccomp: 2 in
--     /proc/self/status;
--   * unprivileged where kernel.unprivileged_userns_clone = 0 (Debian's
--     kernels before 5.10's default changed) or AppArmor restricts
--     unprivileged user namespaces (kernel.apparmor_restrict_unprivileged_userns).
-- explain(facts) is pure (the spec gives it real files); facts() reads them.
local util = require "moonbox.lib.util"

local M = {}

local CAP_SYS_ADMIN = 21

-- facts() -> what explain() looks at, read from this process's /proc
function M.facts()
  return {
    mountinfo = util.read_file("/proc/self/mountinfo"),
    status = util.read_file("/proc/self/status"),
    unprivileged_userns_clone = util.read_file("/proc/sys/kernel/unprivileged_userns_clone"),
    apparmor_restrict = util.read_file("/proc/sys/kernel/apparmor_restrict_unprivileged_userns"),
  }
end

-- chrooted(mountinfo) -> true when no mount is at "/" (nil when unknown)
function M.chrooted(mountinfo)
  if type(mountinfo) ~= "string" or mountinfo == "" then return nil end
  for line in mountinfo:gmatch("[^\n]+") do
    -- id parent major:minor root mount-point ...
    local point = line:match("^%d+ %d+ %d+:%d+ %S+ (%S+)")
    if point == "/" then return false end
  end
  return true
end

local function status_field(status, name)
  return type(status) == "string" and status:match("\n" .. name .. ":%s*(%S+)") or nil
end

-- has_cap(status, n) -> whether CapEff holds capability n (nil when unknown)
local function has_cap(status, n)
  local eff = status_field(status, "CapEff")
  if not eff then return nil end
  -- 64 bits in hex: the capability's hex digit from the right, then its bit
  local digit = tonumber(eff:sub(-1 - math.floor(n / 4), -1 - math.floor(n / 4)), 16) or 0
  return math.floor(digit / 2 ^ (n % 4)) % 2 == 1
end

local function trimmed(s) return type(s) == "string" and s:match("^%s*(.-)%s*$") or nil end

-- explain(facts) -> the cause of an EPERM in plain words, or nil when
-- none of the known causes shows
function M.explain(f)
  if M.chrooted(f.mountinfo) then
    return "this runtime runs in a chroot (its / is not the root of its mount namespace), and the kernel " ..
      "refuses clone(CLONE_NEWUSER) in a chroot; run moonbox outside the chroot, or in a container " ..
      "(which pivots its root) that allows user namespaces"
  end
  local admin = has_cap(f.status, CAP_SYS_ADMIN)
  if status_field(f.status, "Seccomp") == "2" then
    return "a seccomp filter on this runtime refuses clone(CLONE_NEWUSER)" ..
      (admin == false and " (this process lacks CAP_SYS_ADMIN: a container runtime's default profile " ..
        "refuses new namespaces to such a container; give it CAP_SYS_ADMIN or a profile that allows them)"
        or " (a container runtime's profile, or the program that started moonbox)")
  end
  local uid = tonumber(status_field(f.status, "Uid"))
  if trimmed(f.unprivileged_userns_clone) == "0" and uid ~= 0 then
    return "kernel.unprivileged_userns_clone = 0 forbids user namespaces to unprivileged users " ..
      "(sysctl -w kernel.unprivileged_userns_clone=1, or run moonbox as root)"
  end
  if trimmed(f.apparmor_restrict) == "1" and uid ~= 0 then
    return "AppArmor restricts unprivileged user namespaces (kernel.apparmor_restrict_unprivileged_userns = 1; " ..
      "give moonbox an AppArmor profile that allows userns, or run it as root)"
  end
  if admin == false and uid == 0 then
    return "this runtime is root without CAP_SYS_ADMIN (a container that was not given it), " ..
      "and the kernel or an LSM refuses it user namespaces"
  end
  return nil
end

return M
