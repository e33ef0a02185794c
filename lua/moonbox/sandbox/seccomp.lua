-- seccomp profiles, as data. A policy names one (`seccomp = "default"`);
-- "none" installs no filter. Every sandbox process gets the filter and
-- no_new_privs; calls denied here fail with EPERM, `enosys` ones with ENOSYS
-- (so libc falls back, as with clone3), and a foreign syscall ABI (i386,
-- x32) kills the caller. Add a profile by adding a table to M.profiles.
local core = require "moonbox.core"
local errors = require "moonbox.errors"

local M = {}

local NAMESPACE_FLAGS = {
  0x00020000, -- CLONE_NEWNS
  0x02000000, -- CLONE_NEWCGROUP
  0x04000000, -- CLONE_NEWUTS
  0x08000000, -- CLONE_NEWIPC
  0x10000000, -- CLONE_NEWUSER
  0x20000000, -- CLONE_NEWPID
  0x40000000, -- CLONE_NEWNET
  0x00000080, -- CLONE_NEWTIME
}

M.profiles = {
  default = {
    deny = {
      -- the filesystem view is the sandbox's own
      "mount", "umount2", "pivot_root", "move_mount", "open_tree", "fsopen", "fsmount", "fsconfig", "fspick",
      "chroot", "setns", "swapon", "swapoff",
      -- the kernel itself
      "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "acct",
      "bpf", "perf_event_open", "userfaultfd", "iopl", "ioperm", "quotactl", "lookup_dcookie",
      -- keys, handles and other processes' memory
      "keyctl", "add_key", "request_key", "open_by_handle_at", "name_to_handle_at",
      "ptrace", "process_vm_readv", "process_vm_writev", "kcmp",
      -- the clock
      "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
      -- io_uring: its requests bypass this filter, and it has been a rich
      -- source of kernel bugs (Docker's and ChromeOS's profiles deny it too)
      "io_uring_setup", "io_uring_enter", "io_uring_register",
    },
    deny_ioctls = {
      0x5412, -- TIOCSTI: push input into a terminal
      0x541C, -- TIOCLINUX
    },
    deny_clone_flags = NAMESPACE_FLAGS,
    deny_unshare_flags = NAMESPACE_FLAGS,
    enosys = { "clone3" }, -- its flags cannot be inspected; libc falls back to clone
  },
  none = false,
}

local compiled = {}

-- filter(name) -> compiled filter, or nil for "none"
function M.filter(name)
  name = name or "default"
  if compiled[name] ~= nil then return compiled[name] or nil end
  local profile = M.profiles[name]
  if profile == nil then
    errors.raise("VALIDATION_FAILED", ("policy.seccomp: unknown profile %q"):format(name), { field = "policy.seccomp" })
  end
  if profile == false then compiled[name] = false return nil end
  local f, err = core.seccomp_compile(profile)
  if not f then
    errors.raise("SECCOMP_UNAVAILABLE", "cannot compile seccomp profile " .. name .. ": " .. tostring(err))
  end
  compiled[name] = f
  return f
end

return M
