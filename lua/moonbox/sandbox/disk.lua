-- The sandbox's disk quota (policy limits.diskBytes, default 4 GiB): as
-- root, the sandbox's root directory (its /workspace, its lock, a restore's
-- old content) is the mount point of an ext4 file system of that size, in a
-- sparse image file under the runtime's home (<home>/disks/). Writing past
-- it is ENOSPC inside; the host's disk holds only what was written.
--
-- Why a loop-mounted image: the host's file system has no project quota
-- here (ext4 without the `project` feature, which cannot be turned on while
-- mounted), overlayfs caps nothing, and a tmpfs would lose the workspace
-- when the runtime stops. An image keeps the workspace across runs like the
-- plain directory did, and renames within the root (backup restore) stay on
-- one file system. A fresh image is a sparse copy of a template made once
-- per runtime home (mkfs.ext4 takes ~40 ms, the copy ~10 ms).
--
-- Not enforced (info().notEnforced lists diskBytes, as for memory and
-- pids) where it cannot be: a runtime that is not root (no loop devices),
-- and a root that already holds files from before it had an image (its
-- files would be hidden under the mount).
local core = require "moonbox.core"
local async = require "moonbox.async"
local errors = require "moonbox.errors"
local util = require "moonbox.lib.util"

local M = {}

M.DEFAULT_BYTES = 4 * 1024 * 1024 * 1024
M.MIN_BYTES = 16 * 1024 * 1024 -- mkfs.ext4's smallest useful size with its journal
M.MKFS = { "mkfs.ext4", "-q", "-F", "-m", "0", "-J", "size=4", "-E",
  "lazy_itable_init=1,lazy_journal_init=1,nodiscard", "-L", "moonbox" }

-- run(argv) -> true | nil, message: a host command, waited for on the loop
local function run(argv)
  local result = {}
  local proc, pipes, code = core.spawn {
    args = argv,
    env = { PATH = "/usr/sbin:/usr/bin:/sbin:/bin", LANG = "C" },
    stdio = { [0] = "null", [1] = "null", [2] = "pipe" },
    on_exit = function(status)
      result.status = status
      if result.resume then result.resume() end
    end,
  }
  if not proc then return nil, ("%s: %s"):format(argv[1], tostring(pipes or code)) end
  local err = {}
  pipes[2]:read_start(function(_, data)
    if data and #err < 64 then err[#err + 1] = data end
  end)
  if result.status == nil then
    async.await(function(resume) result.resume = resume end, argv[1])
  end
  pipes[2]:close()
  if result.status ~= 0 then
    local text = table.concat(err):gsub("%s+$", "")
    return nil, ("%s exited %s%s"):format(argv[1], tostring(result.status), text ~= "" and (": " .. text) or "")
  end
  return true
end

-- FNV-1a (32 bits, twice with different seeds): the image's name. The root
-- an image belongs to is written beside it and checked, so a collision is
-- refused, never mounted.
local function name_of(path)
  local bit = require "bit"
  local function fnv(seed)
    local h = seed
    for i = 1, #path do h = bit.tobit(bit.bxor(h, path:byte(i)) * 16777619) end
    return bit.tohex(h)
  end
  return fnv(-2128831035) .. fnv(0x5bd1e995)
end

-- The mount point of path in the runtime's mount namespace, if path is one.
local function mounted_at(path)
  local text = util.read_file("/proc/self/mountinfo") or ""
  for line in text:gmatch("[^\n]+") do
    local point = line:match("^%d+ %d+ %d+:%d+ %S+ (%S+)")
    if point then
      point = point:gsub("\\(%d%d%d)", function(o) return string.char(tonumber(o, 8)) end)
      if point == path then return true end
    end
  end
  return false
end
M.mounted_at = mounted_at

local function fail(msg, root)
  errors.raise("ISOLATION_UNAVAILABLE", "cannot set up the sandbox's disk quota: " .. msg,
    { root = root, limit = "diskBytes" })
end

-- The template image of this size, made once.
local function template(dir, bytes)
  local path = ("%s/template-%d.ext4"):format(dir, bytes)
  if util.is_file(path) then return path end
  local part = ("%s/.template-%d-%d.part"):format(dir, bytes, core.getpid())
  local ok, msg = run { "truncate", "-s", tostring(bytes), part }
  if ok then
    local argv = util.copy(M.MKFS)
    argv[#argv + 1] = part
    ok, msg = run(argv)
  end
  if ok then ok, msg = os.rename(part, path) end
  if not ok then
    os.remove(part)
    return nil, msg
  end
  return path
end

-- attach(canon, home, bytes) -> state | nil, why (not enforced)
-- Before anything is made in the root (canon must exist as a directory).
-- Raises ISOLATION_UNAVAILABLE when the quota should hold and cannot be set
-- up (fail closed: a sandbox never runs without the quota it was given).
function M.attach(canon, home, bytes)
  if not bytes or bytes == 0 then return nil end
  if core.getuid() ~= 0 then return nil, "needs a runtime that is root (loop devices)" end
  local dir = home .. "/disks"
  if not util.is_dir(dir) and not core.mkdir(dir, 448) and not util.is_dir(dir) then
    fail("cannot create " .. dir, canon)
  end
  local image = ("%s/%s.ext4"):format(dir, name_of(canon))
  local owner_file = image .. ".root"
  local state = { image = image, owner_file = owner_file, root = canon, bytes = bytes }
  if util.is_file(image) then
    if util.read_file(owner_file) ~= canon .. "\n" then
      fail(("the image %s belongs to another root (%s)"):format(image, tostring(util.read_file(owner_file))), canon)
    end
  else
    -- a root that already holds files from before its quota keeps them
    -- visible: not enforced, and said so
    local names = core.readdir(canon) or {}
    if #names > 0 and not mounted_at(canon) then
      return nil, "the sandbox's root holds files from before it had a disk image"
    end
  end
  if mounted_at(canon) then -- another runtime, or one that died, left it mounted
    state.mounted = true
    return state
  end
  if not util.is_file(image) then
    local tpl, msg = template(dir, bytes)
    if not tpl then fail(tostring(msg), canon) end
    local part = image .. ".part"
    local ok
    ok, msg = run { "cp", "--sparse=always", tpl, part }
    if ok and not util.write_file(owner_file, canon .. "\n") then ok, msg = nil, "cannot write " .. owner_file end
    if ok then ok, msg = os.rename(part, image) end
    if not ok then
      os.remove(part)
      os.remove(owner_file)
      fail(tostring(msg), canon)
    end
    state.fresh = true
  end
  local ok, msg = run { "mount", "-t", "ext4", "-o", "loop,nosuid,nodev,noatime", image, canon }
  if not ok then
    if state.fresh then
      os.remove(image)
      os.remove(owner_file)
    end
    fail(tostring(msg), canon)
  end
  state.mounted = true
  return state
end

-- detach(state, remove): unmount (lazily: what still holds the file system
-- lets go of it on its own, and the loop device clears itself); with
-- remove, the image goes too. -> true | nil, message
function M.detach(state, remove)
  if not state then return true end
  if state.mounted and mounted_at(state.root) then
    local ok, msg = run { "umount", "-l", state.root }
    if not ok then return nil, msg end
  end
  state.mounted = false
  if remove then
    os.remove(state.image)
    os.remove(state.owner_file)
  end
  return true
end

return M
