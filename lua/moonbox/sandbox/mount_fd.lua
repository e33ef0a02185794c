-- A mount held as a file descriptor, not at a path (the kernel's mount
-- API, Linux 5.2+): open_tree(OPEN_TREE_CLONE) copies a mount into a
-- detached one that only its fd holds, and move_mount attaches it at a
-- path later. A spare sandbox's disk (sandbox/disk.lua) waits this way: no
-- mount of it is in the host's table until a sandbox claims it, and a
-- runtime that dies drops it with its fds (the kernel unmounts a detached
-- mount at the last close, and the loop device, autoclear, follows).
--
-- Through the FFI: src/ has these calls (child/mount_tree.c) but only on
-- the init's side; they are two system calls that never block for long.
-- Where the architecture's numbers are not known here, available is false
-- and the caller does without (a cold disk, never a weaker one).
local ffi = require "ffi"

local M = {}

for _, decl in ipairs { "long syscall(long number, ...);", "char *strerror(int errnum);" } do
  pcall(ffi.cdef, decl) -- (declared once per process: another module may have it)
end

-- open_tree and move_mount have one number on every architecture (the
-- unified table, from 424 on); only these two are checked here
local SYS_OPEN_TREE, SYS_MOVE_MOUNT = 428, 429
M.available = ffi.os == "Linux" and (ffi.arch == "x64" or ffi.arch == "arm64")

local AT_FDCWD = -100
local OPEN_TREE_CLONE = 1
local O_CLOEXEC = 0x80000 -- (the fd is never a child's)
local MOVE_MOUNT_F_EMPTY_PATH = 4

local function long(n) return ffi.cast("long", n) end

local function failed(what)
  local e = ffi.errno()
  return nil, ("%s: %s"):format(what, ffi.string(ffi.C.strerror(e))), e
end

-- clone(path) -> fd | nil, message, errno: a detached copy of the mount at path
function M.clone(path)
  if not M.available then return nil, "open_tree: not available on " .. ffi.arch end
  local fd = tonumber(ffi.C.syscall(long(SYS_OPEN_TREE), long(AT_FDCWD), path, long(OPEN_TREE_CLONE + O_CLOEXEC)))
  if fd < 0 then return failed("open_tree " .. path) end
  return fd
end

-- attach(fd, target) -> true | nil, message, errno: the detached mount at
-- target (an existing directory). The fd stays the caller's to close.
function M.attach(fd, target)
  if not M.available then return nil, "move_mount: not available on " .. ffi.arch end
  local rc = tonumber(ffi.C.syscall(long(SYS_MOVE_MOUNT), long(fd), "", long(AT_FDCWD), target,
    long(MOVE_MOUNT_F_EMPTY_PATH)))
  if rc ~= 0 then return failed("move_mount " .. target) end
  return true
end

return M
