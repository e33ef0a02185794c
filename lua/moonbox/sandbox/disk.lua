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
-- pids) where it cannot be: a runtime that is not the host's root (no loop
-- devices and no mount: an unprivileged runtime, or root of a user
-- namespace of its own), and a root that already holds files from before
-- it had an image (its files would be hidden under the mount). Anywhere
-- else a quota that cannot be set up fails getSandbox
-- (ISOLATION_UNAVAILABLE).
--
-- The image's content is written only through the kernel's ext4 (the
-- tenant never sees the image file, under <home>/disks, 0700, nor a loop
-- device: its /dev has none and the mount is nodev,nosuid). The template
-- is made with its inode tables zeroed (lazy_itable_init=0) so no kernel
-- thread fills a new image's tables after the mount, and then dug sparse:
-- a new image costs ~2 MiB of the host's disk. The mount has `discard`: a
-- file the tenant deletes gives its blocks back to the host's disk.
local core = require "moonbox.core"
local async = require "moonbox.async"
local errors = require "moonbox.errors"
local util = require "moonbox.lib.util"
local fs = require "moonbox.lib.fs"
local mount_fd = require "moonbox.sandbox.mount_fd"

local M = {}

M.DEFAULT_BYTES = 4 * 1024 * 1024 * 1024
M.MIN_BYTES = 16 * 1024 * 1024 -- mkfs.ext4's smallest useful size with its journal
M.MKFS = { "mkfs.ext4", "-q", "-F", "-m", "0", "-J", "size=4", "-E",
  "lazy_itable_init=0,lazy_journal_init=0,nodiscard", "-L", "moonbox" }
M.MOUNT_OPTIONS = "loop,nosuid,nodev,noatime,discard"

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

-- The image on a free loop device (autoclear), mounted on target; and the
-- unmount (lazy: detached now, released with its last user). On the thread
-- pool (src/loopmount.c), not mount(8)/umount(8): a process each, twice per
-- sandbox. -> true | nil, message
local function mount_image(image, target)
  local err = async.await(function(resume)
    local ok, msg = core.loop_mount(image, target, "ext4", M.MOUNT_OPTIONS, function(e) resume(e) end)
    if not ok then resume(msg) end
  end, "mount")
  if err then return nil, "mount: " .. tostring(err) end
  return true
end

local function unmount(target, lazy)
  local err = async.await(function(resume)
    local ok, msg = core.umount(target, lazy, function(e) resume(e) end)
    if not ok then resume(msg) end
  end, "umount")
  if err then return nil, tostring(err) end
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

local function unescape(s)
  return (s:gsub("\\(%d%d%d)", function(o) return string.char(tonumber(o, 8)) end))
end

-- Whether path is a mount point in the runtime's mount namespace: its
-- source (the last one mounted there) if so, else false.
local function mounted_at(path)
  local text = util.read_file("/proc/self/mountinfo") or ""
  local source = false
  for line in text:gmatch("[^\n]+") do
    local point = line:match("^%d+ %d+ %d+:%d+ %S+ (%S+)")
    if point and unescape(point) == path then
      source = unescape(line:match(" %- %S+ (%S+)") or "?")
    end
  end
  return source
end
M.mounted_at = mounted_at

-- The image file behind a mount source "/dev/loopN", or nil.
local function backing_file(source)
  local n = type(source) == "string" and source:match("^/dev/loop(%d+)$")
  if not n then return nil end
  return ((util.read_file(("/sys/block/loop%s/loop/backing_file"):format(n)) or ""):gsub("\n$", ""))
end

-- Loop devices and mount(2) are the host root's: uid 0 in the initial user
-- namespace (root of a user namespace of its own, `unshare -Ur`, has neither).
local function host_root()
  if core.getuid() ~= 0 then return false end
  local map = util.read_file("/proc/self/uid_map") or ""
  return map:match("^%s*0%s+0%s+4294967295%s") ~= nil
end
M.host_root = host_root

local function mkdir_p(path, mode)
  if util.is_dir(path) then return true end
  local parent = path:match("^(.*)/[^/]+$")
  if parent and parent ~= "" and not mkdir_p(parent, 493) then return false end
  return core.mkdir(path, mode) ~= nil or util.is_dir(path)
end

local function fail(msg, root)
  errors.raise("ISOLATION_UNAVAILABLE", "cannot set up the sandbox's disk quota: " .. msg,
    { root = root, limit = "diskBytes" })
end

-- The loop device an image file is attached to, "/dev/loopN", or nil.
local function attached_to(image)
  for _, name in ipairs(core.readdir("/sys/block") or {}) do
    if name:match("^loop%d+$") then
      local file = (util.read_file("/sys/block/" .. name .. "/loop/backing_file") or ""):gsub("\n$", "")
      if file == image then return "/dev/" .. name end
    end
  end
  return nil
end

-- An image still attached elsewhere (a runtime that just exited: its
-- sandbox's init, dying of the parent-death signal, holds the mount in its
-- namespace a moment longer; or another runtime's sandbox) must never be
-- mounted a second time through another loop device: two ext4 mounts of one
-- image corrupt it. Waited for up to 5 s (the autoclear detach follows the
-- last user), then refused.
local function await_detached(image, canon)
  local dev = attached_to(image)
  for _ = 1, 250 do
    if not dev or not async.in_task() then break end
    async.sleep(20)
    dev = attached_to(image)
  end
  if dev then
    fail(("the root's disk image %s is still attached to %s (in use by another runtime's sandbox?)")
      :format(image, dev), canon)
  end
end

-- The template image of this size, made once.
local function template(dir, bytes)
  local path = ("%s/template-%d-z.ext4"):format(dir, bytes) -- (z: inode tables zeroed)
  if util.is_file(path) then return path end
  local part = ("%s/.template-%d-%d.part"):format(dir, bytes, core.getpid())
  local ok, msg = run { "truncate", "-s", tostring(bytes), part }
  if ok then
    local argv = util.copy(M.MKFS)
    argv[#argv + 1] = part
    ok, msg = run(argv)
  end
  -- the zeroed inode tables and journal become holes again
  if ok then ok, msg = run { "fallocate", "--dig-holes", part } end
  if ok then ok, msg = os.rename(part, path) end
  if not ok then
    os.remove(part)
    return nil, msg
  end
  return path
end

-- A runtime's spare disks are named spare-<pid>.<start time>-<n>: the
-- start time tells a live runtime from a dead one whose pid came back.
local function start_time(pid)
  local stat = util.read_file("/proc/" .. pid .. "/stat")
  return stat and stat:match("^.*%) %a" .. (" %S+"):rep(18) .. " (%d+)")
end
local my_tag
local function runtime_tag()
  my_tag = my_tag or ("%d.%s"):format(core.getpid(), start_time(core.getpid()) or "0")
  return my_tag
end
local function tag_alive(tag)
  local pid, start = tag:match("^(%d+)%.(%d+)$")
  return pid ~= nil and start_time(pid) == start
end

-- What a runtime that died left of its spare disks: the image files (their
-- mounts were only fds, gone with it; see spare()), and a mount point a
-- spare was being built on, unmounted (the loop device, autoclear, goes
-- with it).
local function sweep_spares(dir, names)
  for _, name in ipairs(names) do
    local tag = name:match("^spare%-([%d.]+)%-%d+%.")
    if tag and not tag_alive(tag) then
      local path = dir .. "/" .. name
      if name:match("%.mnt$") then
        if mounted_at(path) then unmount(path, true) end
        core.rmdir(path)
      else
        pcall(fs.unlink, path)
      end
    end
  end
end

-- Images whose root directory is gone (removed by hand, a kept sandbox's
-- root deleted after a reboot): removed, once per runtime and home. A root
-- being made exists before its image does (attach needs it).
local swept = {}
local function sweep(dir)
  if swept[dir] then return end
  swept[dir] = true
  local names = core.readdir(dir) or {}
  if async.in_task() then sweep_spares(dir, names) else swept[dir] = nil end
  for _, name in ipairs(names) do
    if name:match("%.ext4%.root$") then
      local owner_file = dir .. "/" .. name
      local root = (util.read_file(owner_file) or ""):gsub("\n$", "")
      if root:sub(1, 1) == "/" and not util.is_dir(root) then
        os.remove((owner_file:gsub("%.root$", "")))
        os.remove(owner_file)
      end
    end
  end
end

-- An existing image must be the size the policy asks for: info() says
-- diskBytes, and a bigger image would not hold it (resizing is not done).
local function check_size(image, bytes, canon)
  local st = fs.lstat_beneath("/", image, "in_root")
  if st and st.size ~= bytes then
    fail(("the root's disk image %s is %d bytes, the policy's diskBytes is %d (a sandbox keeps the size it " ..
      "was made with: destroy it, or ask for that size)"):format(image, st.size, bytes), canon)
  end
end

-- A spare's disk (see M.spare) taken as the root's new image: its mount
-- attached at canon, its file renamed to the root's. -> true | nil, message
local function adopt(spare, bytes, image, owner_file, canon)
  if spare.bytes ~= bytes or not spare.fd then return nil, "not a disk of this size" end
  if not util.write_file(owner_file, canon .. "\n") then return nil, "cannot write " .. owner_file end
  local ok, msg = os.rename(spare.image, image)
  if ok then ok, msg = mount_fd.attach(spare.fd, canon) end
  if not ok then
    os.rename(image, spare.image)
    os.remove(owner_file)
    return nil, msg
  end
  spare.image = nil -- (the root's now: M.drop_spare leaves it)
  return true
end

-- attach(canon, home, bytes, made, spare) -> state | nil, why (not enforced)
-- Before anything is made in the root (canon must exist as a directory;
-- made: getSandbox made it just now, so an image left for it is stale).
-- spare: a spare disk (M.spare) to use where a new image would be made;
-- the caller drops it after (M.drop_spare: nothing once used).
-- Raises ISOLATION_UNAVAILABLE when the quota should hold and cannot be set
-- up (fail closed: a sandbox never runs without the quota it was given).
function M.attach(canon, home, bytes, made, spare)
  if not bytes or bytes == 0 then return nil end
  if not host_root() then
    return nil, "needs a runtime that is the host's root (loop devices, mount)"
  end
  local dir = home .. "/disks"
  if not mkdir_p(dir, 448) then fail("cannot create " .. dir, canon) end
  sweep(dir)
  local image = ("%s/%s.ext4"):format(dir, name_of(canon))
  local owner_file = image .. ".root"
  local state = { image = image, owner_file = owner_file, root = canon, bytes = bytes }
  local source = mounted_at(canon)
  if source then
    -- kept mounted by a destroy{keepFiles}, or left by a runtime that
    -- stopped or died: taken again only if it is this root's image
    if backing_file(source) ~= image or util.read_file(owner_file) ~= canon .. "\n" then
      fail(("%s is a mount point (%s) that is not the sandbox's disk image %s"):format(canon, source, image), canon)
    end
    check_size(image, bytes, canon)
    state.mounted = true
    return state
  end
  if util.is_file(image) then
    if util.read_file(owner_file) ~= canon .. "\n" then
      fail(("the image %s belongs to another root (%s)"):format(image, tostring(util.read_file(owner_file))), canon)
    end
    if made then -- the root was removed by hand since: its old image is not its content
      os.remove(image)
      os.remove(owner_file)
    else
      check_size(image, bytes, canon)
    end
  end
  if not util.is_file(image) then
    -- a root that already holds files from before its quota keeps them
    -- visible: not enforced, and said so (info().notEnforced)
    local names = core.readdir(canon) or {}
    if #names > 0 then
      return nil, "the sandbox's root holds files from before it had a disk image"
    end
    -- a spare's disk, made ahead with this size: attached in one system
    -- call (a new image costs a copy, a loop device and a mount); one that
    -- cannot be is left to the caller to drop, and the image made here
    if spare and spare.image then
      if adopt(spare, bytes, image, owner_file, canon) then
        state.fresh, state.mounted = true, true
        return state
      end
    end
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
  if not state.fresh then await_detached(image, canon) end
  local ok, msg = mount_image(image, canon)
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

-- detach(state, remove): unmount (the loop device, autoclear, goes with
-- the file system's last user); with remove, the image goes too. A mount
-- still in use (by a process of the host, never the sandbox's: they are
-- gone) is detached lazily, and the image file unlinked: its blocks are
-- freed when the last user lets go. -> true | nil, message
function M.detach(state, remove)
  if not state then return true end
  if state.mounted and mounted_at(state.root) then
    if not unmount(state.root, false) then
      local ok, msg = unmount(state.root, true)
      if not ok then return nil, msg end
    end
  end
  state.mounted = false
  if remove then -- (on the thread pool: a 4 GiB sparse file takes ~50 ms to unlink)
    pcall(fs.unlink, state.image)
    pcall(fs.unlink, state.owner_file)
  end
  return true
end

-- Spare disks (sandbox/prewarm.lua): a sandbox's new image made ahead,
-- off the caller's time: copied from the template, attached to a loop
-- device and mounted like a cold one (same size, options and checks), then
-- held only as a detached mount (sandbox/mount_fd.lua) while its mount
-- point goes. Claimed, attach() puts it at the root with move_mount and
-- renames the file: the root's image, as a cold attach would have made it.
-- Its file is <home>/disks/spare-<runtime>-<n>.ext4 until then: a runtime
-- that dies leaves only that file (its fd went with it), removed by the
-- next runtime's sweep.
local spare_seq = 0

-- spare(home, bytes) -> spare | nil, why: nil alone without a quota to
-- enforce (bytes 0, not the host's root), or where a disk cannot wait
-- detached (the claim then makes it cold, as without a pool). In a task.
function M.spare(home, bytes)
  if not home or not bytes or bytes == 0 or not host_root() or not mount_fd.available then return nil end
  local dir = home .. "/disks"
  if not mkdir_p(dir, 448) then return nil, "cannot create " .. dir end
  sweep(dir)
  local tpl, msg = template(dir, bytes)
  if not tpl then return nil, msg end
  spare_seq = spare_seq + 1
  local base = ("%s/spare-%s-%d"):format(dir, runtime_tag(), spare_seq)
  local d = { image = base .. ".ext4", bytes = bytes }
  local mnt = base .. ".mnt"
  local ok
  ok, msg = run { "cp", "--sparse=always", tpl, d.image }
  if ok then ok, msg = core.mkdir(mnt, 448) end
  if ok then ok, msg = mount_image(d.image, mnt) end
  if ok then
    core.rmdir(mnt .. "/lost+found") -- (mkfs's, as for a cold root)
    d.fd, msg = mount_fd.clone(mnt)
    ok = d.fd ~= nil
    unmount(mnt, true) -- (the detached copy keeps the file system, and its loop device)
  end
  core.rmdir(mnt)
  if not ok then
    M.drop_spare(d)
    return nil, msg
  end
  return d
end

-- drop_spare(d): its mount closed (unmounted with it, the loop device
-- cleared) and its file removed, unless a root took it. Waited for in a
-- task, else done in one.
function M.drop_spare(d)
  if not d then return end
  local fd, image = d.fd, d.image
  d.fd, d.image = nil, nil
  local function go()
    if fd then async.await(function(resume) core.fs_close(fd, function() resume() end) end, "close") end
    if image then pcall(fs.unlink, image) end
  end
  if async.in_task() then go() else async.spawn(go) end
end

return M
