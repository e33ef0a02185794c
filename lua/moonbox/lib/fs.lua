-- Awaited wrappers over the core fs family, so task code reads top to bottom:
--
--   local fd, err = fs.open(path, "w")
--   if not fd then return nil, err end
--
-- Every function returns its result, or nil, message, CODE; none of them
-- raises for an OS failure. The asynchronous ones wait through async.await
-- and so must run inside a task (calling them outside one raises
-- NOT_IN_TASK); the *_beneath helpers other than open_beneath, and
-- open_dir/close_dir, are synchronous and work anywhere (M.awaited has
-- awaited versions of most, see there).
--
-- Root confinement: a path that resolves outside the root is reported by the
-- core as EXDEV; here it becomes nil, "PATH_OUTSIDE_SANDBOX: ...",
-- "PATH_OUTSIDE_SANDBOX". (An EXDEV from renaming across mounts stays EXDEV.)
local core = require "moonbox.core"
local async = require "moonbox.async"

local unpack = unpack -- LuaJIT

local M = {}

M.CHUNK = 256 * 1024 -- read_all's read size

-- Run core function fn(args[1..n], cb) and wait for cb(err, result, code).
-- If the task is cancelled meanwhile, a late result is passed to release
-- (used to close fds nobody will see).
local function await_op(what, fn, n, args, release)
  return async.await(function(resume)
    local cancelled = false
    args[n + 1] = function(err, result, code)
      if cancelled then
        if release and result ~= nil then release(result) end
        return
      end
      if err ~= nil then resume(nil, err, code) else resume(result) end
    end
    local ok, msg, code = fn(unpack(args, 1, n + 1))
    if not ok then resume(nil, msg, code) end
    return function() cancelled = true end
  end, what)
end

local function release_fd(fd)
  core.fs_close(fd, function() end)
end

local function confined(ok, msg, code)
  if ok == nil and code == "EXDEV" and type(msg) == "string" and msg:find("outside the root", 1, true) then
    return nil, "PATH_OUTSIDE_SANDBOX: " .. msg, "PATH_OUTSIDE_SANDBOX"
  end
  return ok, msg, code
end
-- confined(core call's results): the same, for a core call made directly
-- (files/watch.lua's fs_event start/add, which resolve through a confinement)
M.confined = confined

local function by_name(a, b) return a.name < b.name end

local function sorted(entries, msg, code)
  if entries then table.sort(entries, by_name) end
  return entries, msg, code
end

-- open(path[, flags = "r"[, mode = 0666]]) -> fd. flags: "r" "r+" "w" "w+"
-- "a" "a+" (with "x" for exclusive create) or an integer; always O_CLOEXEC.
function M.open(path, flags, mode)
  return await_op("_fs.open", core.fs_open, 3, { path, flags, mode }, release_fd)
end

-- read(fd, size[, offset]) -> data ("" at end of file). No offset: the current position.
function M.read(fd, size, offset)
  return await_op("_fs.read", core.fs_read, 3, { fd, size, offset })
end

-- write(fd, data[, offset]) -> bytes written (may be fewer than #data; see write_all).
function M.write(fd, data, offset)
  return await_op("_fs.write", core.fs_write, 3, { fd, data, offset })
end

-- close(fd) -> true
function M.close(fd)
  return await_op("_fs.close", core.fs_close, 1, { fd })
end

-- stat(path), lstat(path), fstat(fd) -> {type = "file"|"directory"|"symlink"|"other",
-- size, mode (permission bits), uid, gid, mtime, atime, ctime (seconds), ino, dev, nlink}
function M.stat(path)
  return await_op("_fs.stat", core.fs_stat, 1, { path })
end

function M.lstat(path)
  return await_op("_fs.lstat", core.fs_lstat, 1, { path })
end

function M.fstat(fd)
  return await_op("_fs.fstat", core.fs_fstat, 1, { fd })
end

-- mkdir(path[, mode = 0777]) -> true
function M.mkdir(path, mode)
  return await_op("_fs.mkdir", core.fs_mkdir, 2, { path, mode })
end

function M.rmdir(path)
  return await_op("_fs.rmdir", core.fs_rmdir, 1, { path })
end

function M.unlink(path)
  return await_op("_fs.unlink", core.fs_unlink, 1, { path })
end

-- rename(old, new) -> true
function M.rename(old, new)
  return await_op("_fs.rename", core.fs_rename, 2, { old, new })
end

-- scandir(path) -> {{name =, type =}, ...} sorted by name, without "." and "..".
function M.scandir(path)
  return sorted(await_op("_fs.scandir", core.fs_scandir, 1, { path }))
end

function M.readlink(path)
  return await_op("_fs.readlink", core.fs_readlink, 1, { path })
end

function M.realpath(path)
  return await_op("_fs.realpath", core.fs_realpath, 1, { path })
end

-- chmod(path, mode) -> true
function M.chmod(path, mode)
  return await_op("_fs.chmod", core.fs_chmod, 2, { path, mode })
end

-- utime(path, atime, mtime) -> true (seconds, fractions allowed)
function M.utime(path, atime, mtime)
  return await_op("_fs.utime", core.fs_utime, 3, { path, atime, mtime })
end

-- read_all(fd[, offset]) -> everything from offset (or the current position) to end of file.
function M.read_all(fd, offset)
  local chunks, n = {}, 0
  while true do
    local data, msg, code = M.read(fd, M.CHUNK, offset)
    if data == nil then return nil, msg, code end
    if data == "" then break end
    n = n + 1
    chunks[n] = data
    if offset then offset = offset + #data end
  end
  return table.concat(chunks, "", 1, n)
end

-- write_all(fd, data[, offset]) -> #data, retrying short writes.
function M.write_all(fd, data, offset)
  local total, pos = #data, 0
  while pos < total do
    local chunk = pos == 0 and data or data:sub(pos + 1)
    local written, msg, code = M.write(fd, chunk, offset)
    if written == nil then return nil, msg, code end
    if written == 0 then return nil, "EIO: write made no progress", "EIO" end
    pos = pos + written
    if offset then offset = offset + written end
  end
  return total
end

-- read_file(path) -> contents
function M.read_file(path)
  local fd, msg, code = M.open(path, "r")
  if not fd then return nil, msg, code end
  local data
  data, msg, code = M.read_all(fd)
  M.close(fd)
  if data == nil then return nil, msg, code end
  return data
end

-- write_file(path, data[, mode = 0666]) -> #data; creates or truncates.
function M.write_file(path, data, mode)
  local fd, msg, code = M.open(path, "w", mode)
  if not fd then return nil, msg, code end
  local n
  n, msg, code = M.write_all(fd, data)
  local closed, cmsg, ccode = M.close(fd)
  if n == nil then return nil, msg, code end
  if not closed then return nil, cmsg, ccode end
  return n
end

-- ---- root-confined helpers (openat2) -------------------------------------
-- root: a directory fd from open_dir, or a directory path. resolve: "beneath"
-- (default; any escape is PATH_OUTSIDE_SANDBOX) or "in_root" ("/" and ".."
-- stay inside the root, as under chroot). Magic links (/proc/*/fd) never resolve.

-- open_dir(path) -> fd (O_PATH directory fd to use as a root). Synchronous.
function M.open_dir(path)
  return core.fs_open_dir(path)
end

-- close_dir(fd) -> true. Synchronous.
function M.close_dir(fd)
  return core.close_fd(fd)
end

-- confine(root, allowed, creds, resolve) -> confinement, a root for every
-- *_beneath helper (and fs_event): root held open; with allowed (paths
-- relative to the root, resolved now) every fd obtained through it must lie
-- on one of their mounts, else PATH_OUTSIDE_SANDBOX; with creds ({uid, gid})
-- the calls run with that fsuid/fsgid; resolve is its default mode.
-- confinement:close() releases it. Synchronous. See src/fs.c.
function M.confine(root, allowed, creds, resolve)
  return core.fs_confine(root, allowed, creds, resolve)
end

-- open_beneath(root, relpath[, flags = "r"[, mode = 0666[, resolve = "beneath"]]]) -> fd. Awaited.
function M.open_beneath(root, relpath, flags, mode, resolve)
  return confined(await_op("_fs.open_beneath", core.fs_open_beneath, 5,
    { root, relpath, flags, mode, resolve }, release_fd))
end

-- mkdir_beneath(root, relpath[, mode = 0777[, resolve]]) -> true. Synchronous.
function M.mkdir_beneath(root, relpath, mode, resolve)
  return confined(core.fs_mkdir_beneath(root, relpath, mode, resolve))
end

-- unlink_beneath(root, relpath[, resolve]) -> true. Synchronous.
function M.unlink_beneath(root, relpath, resolve)
  return confined(core.fs_unlink_beneath(root, relpath, resolve))
end

-- rmdir_beneath(root, relpath[, resolve]) -> true. Synchronous.
function M.rmdir_beneath(root, relpath, resolve)
  return confined(core.fs_rmdir_beneath(root, relpath, resolve))
end

-- rename_beneath(root, old, new[, resolve]) -> true. Synchronous.
function M.rename_beneath(root, old, new, resolve)
  return confined(core.fs_rename_beneath(root, old, new, resolve))
end

-- stat_beneath(root, relpath[, resolve[, follow = true]]) -> stat table. Synchronous.
function M.stat_beneath(root, relpath, resolve, follow)
  return confined(core.fs_stat_beneath(root, relpath, resolve, follow))
end

-- lstat_beneath(root, relpath[, resolve]) -> stat table of a final symlink itself.
function M.lstat_beneath(root, relpath, resolve)
  return confined(core.fs_stat_beneath(root, relpath, resolve, false))
end

-- where_beneath(root, relpath[, resolve]) -> where relpath leads, every
-- symlink followed, as the kernel names it (inside a /proc/<pid>/root: that
-- process's view). Synchronous.
function M.where_beneath(root, relpath, resolve)
  return confined(core.fs_where_beneath(root, relpath, resolve))
end

-- M.awaited: the same seven helpers, run on the thread pool and awaited
-- when called in a task (synchronous outside one), for code that makes many
-- file calls (the sandbox file API): a task making them back to back then
-- never holds the loop (issue #14). Awaiting lets other tasks run meanwhile,
-- so a caller whose order against other tasks matters (checks made before a
-- call takes its place in a session's queue) keeps the synchronous ones.
local function beneath(what, fn, n, ...)
  if async.in_task() then return confined(await_op(what, fn, n, { ... })) end
  return confined(fn(...))
end

M.awaited = {
  mkdir_beneath = function(root, relpath, mode, resolve)
    return beneath("_fs.mkdir_beneath", core.fs_mkdir_beneath, 4, root, relpath, mode, resolve)
  end,
  unlink_beneath = function(root, relpath, resolve)
    return beneath("_fs.unlink_beneath", core.fs_unlink_beneath, 3, root, relpath, resolve)
  end,
  rmdir_beneath = function(root, relpath, resolve)
    return beneath("_fs.rmdir_beneath", core.fs_rmdir_beneath, 3, root, relpath, resolve)
  end,
  rename_beneath = function(root, old, new, resolve)
    return beneath("_fs.rename_beneath", core.fs_rename_beneath, 4, root, old, new, resolve)
  end,
  stat_beneath = function(root, relpath, resolve, follow)
    if follow == nil then follow = true end
    return beneath("_fs.stat_beneath", core.fs_stat_beneath, 4, root, relpath, resolve, follow)
  end,
  lstat_beneath = function(root, relpath, resolve)
    return beneath("_fs.lstat_beneath", core.fs_stat_beneath, 4, root, relpath, resolve, false)
  end,
  where_beneath = function(root, relpath, resolve)
    return beneath("_fs.where_beneath", core.fs_where_beneath, 3, root, relpath, resolve)
  end,
}

-- scandir_beneath(root, relpath[, resolve]) -> entries sorted by name. Synchronous.
function M.scandir_beneath(root, relpath, resolve)
  return sorted(confined(core.fs_scandir_beneath(root, relpath, resolve)))
end

-- remove_tree(root, relpath[, resolve[, creds]]) -> number of entries
-- removed. Awaited (the thread pool walks the tree, src/fs_tree.c): relpath
-- and all under it, at any depth, symlinks removed and never followed; the
-- first removal that fails is the error. creds = {uid, gid}: walk with
-- those filesystem ids (e.g. a sandbox's root) instead of the runtime's.
-- meanwhile(): called (synchronous, it must not yield) once the walk is
-- under way, to do other work on the loop while the thread pool works.
function M.remove_tree(root, relpath, resolve, creds, meanwhile)
  return confined(async.await(function(resume)
    local cancelled = false
    local ok, msg, code = core.fs_remove_tree(root, relpath, resolve, function(err, n, ecode)
      if cancelled then return end
      if err ~= nil then resume(nil, err, ecode) else resume(n) end
    end, creds)
    if meanwhile then meanwhile() end
    if not ok then resume(nil, msg, code) end
    return function() cancelled = true end
  end, "_fs.remove_tree"))
end

-- lock(path[, content]) -> fd | nil, message, CODE[, holder]: an exclusive
-- flock on the file at path (created), content written into it; "EAGAIN"
-- with the file's content when another open file holds it. Synchronous;
-- close_dir(fd) (core.close_fd) releases it.
function M.lock(path, content)
  return core.fs_lock(path, content)
end

return M
