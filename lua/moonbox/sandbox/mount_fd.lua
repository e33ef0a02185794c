-- A mount held as a file descriptor, not at a path (the kernel's mount
-- API, Linux 5.2+): open_tree(OPEN_TREE_CLONE) copies a mount into a
-- detached one that only its fd holds, and move_mount attaches it at a
-- path later (core.mount_detach_copy, core.mount_attach: src/loopmount.c).
-- A spare sandbox's disk (sandbox/disk.lua) waits this way: no mount of it
-- is in the host's table until a sandbox claims it, and a runtime that
-- dies drops it with its fds (the kernel unmounts a detached mount at the
-- last close, and the loop device, autoclear, follows). Where the kernel
-- lacks the calls, the caller does without (a cold disk, never a weaker one).
local core = require "moonbox.core"

local M = {}

M.available = core.mount_detach_copy ~= nil

-- clone(path) -> fd | nil, message, code: a detached copy of the mount at path
function M.clone(path)
  return core.mount_detach_copy(path)
end

-- attach(fd, target) -> true | nil, message, code: the detached mount at
-- target (an existing directory). The fd stays the caller's to close.
function M.attach(fd, target)
  return core.mount_attach(fd, target)
end

return M
