-- A sandbox's root directory on the host: which directories may be one, the
-- lock that makes it one runtime's at a time, and its removal (destroy).
--
-- Rules (docs/api.md, "Sandbox roots"): a root is never "/", a system
-- directory (/usr, /etc, /home, ... also when reached through a symlink),
-- the runtime's home or a directory above it, nor a non-empty directory
-- moonbox did not make. moonbox marks the roots it makes with the lock file
-- LOCK_NAME, which also holds the pid of the runtime that has the root (an
-- exclusive flock on it, kept for the sandbox's life). A directory whose
-- only entries are moonbox's own ("workspace", the lock file) counts as
-- moonbox's too, so a workspace prepared beforehand is taken as it is.
local core = require "moonbox.core"
local errors = require "moonbox.errors"
local fs = require "moonbox.lib.fs"
local util = require "moonbox.lib.util"

local M = {}

M.LOCK_NAME = ".moonbox.lock"

local SYSTEM_DIRS = { "/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/libx32",
  "/media", "/mnt", "/opt", "/proc", "/root", "/run", "/sbin", "/snap", "/srv", "/sys", "/tmp", "/usr", "/var",
  "/usr/bin", "/usr/sbin", "/usr/lib", "/usr/lib32", "/usr/lib64", "/usr/libexec", "/usr/include",
  "/usr/local", "/usr/share", "/usr/src", "/usr/local/bin", "/usr/local/lib", "/var/lib", "/var/log",
  "/var/tmp", "/var/cache", "/var/spool", "/var/mail", "/var/www", "/var/opt", "/var/run", "/var/lock" }

-- (image: the upper dir of a root made from an image, sandbox/image.lua)
local OWN_ENTRIES = { workspace = true, image = true, [M.LOCK_NAME] = true }

local function refuse(root, why)
  errors.raise("VALIDATION_FAILED", ("root %q %s"):format(root, why), { field = "root", root = root })
end

-- Where an existing path leads, every symlink followed (nil if it does not
-- exist). Any other failure (EMFILE, EACCES, ...) raises: a root that
-- cannot be checked is not taken.
local function resolved(path, quiet)
  local where, msg, code = fs.where_beneath("/", path, "in_root")
  if where or quiet or code == "ENOENT" or code == "ENOTDIR" then return where end
  errors.raise("FILESYSTEM_ERROR", ("cannot check the sandbox root %q: %s"):format(path, tostring(msg)),
    { root = path, errno = code })
end

-- canonical(path) -> the absolute path with every existing symlink resolved
-- (components that do not exist yet are appended as written).
function M.canonical(path)
  if path:sub(1, 1) ~= "/" then
    local cwd = fs.where_beneath(".", ".")
    if not cwd then refuse(path, "is relative and the working directory cannot be read") end
    path = cwd .. "/" .. path
  end
  path = util.normalize(path)
  local head, rest = path, ""
  while true do
    local where = resolved(head)
    if where then
      return util.normalize(rest == "" and where or (where == "/" and "" or where) .. rest)
    end
    local parent, name = head:match("^(.*)/([^/]+)$")
    if not parent then return path end
    rest = "/" .. name .. rest
    head = parent == "" and "/" or parent
  end
end

local system_set
local function is_system(canon)
  if not system_set then
    system_set = {}
    for _, dir in ipairs(SYSTEM_DIRS) do
      system_set[dir] = true
      local where = resolved(dir, true)
      if where then system_set[where] = true end
    end
  end
  return system_set[canon]
end

-- check(root, home, default_root) -> canonical root; raises VALIDATION_FAILED
-- for a root moonbox must not use (nothing is created).
function M.check(root, home, default_root)
  local canon = M.canonical(root)
  if canon == "/" then refuse(root, "is the host's root directory") end
  if is_system(canon) then refuse(root, ("is a system directory (%s)"):format(canon)) end
  -- a home this user cannot even look into (HOME unset: /root/... for
  -- nobody) is compared as written: the root is checked by itself below
  local function canonical_or_written(path)
    local ok, where = pcall(M.canonical, path)
    return ok and where or util.normalize(path)
  end
  local home_canon = canonical_or_written(home)
  if canon == home_canon or home_canon:sub(1, #canon + 1) == canon .. "/" or canon == home_canon .. "/sandboxes" then
    refuse(root, ("is the runtime's home (%s) or holds it"):format(home_canon))
  end
  local st, msg, code = fs.stat_beneath("/", canon, "in_root")
  if not st and code ~= "ENOENT" then
    errors.raise("FILESYSTEM_ERROR", ("cannot check the sandbox root %q: %s"):format(root, tostring(msg)),
      { root = root, errno = code })
  end
  if st and st.type ~= "directory" then refuse(root, "is not a directory") end
  if st and canon ~= canonical_or_written(default_root) then
    local names = core.readdir(canon)
    if not names then refuse(root, "cannot be read") end
    for _, name in ipairs(names) do
      -- (.moonbox-old-*: a restore's old content a stopped runtime left, files/backup.lua)
      if not OWN_ENTRIES[name] and not name:match("^%.moonbox%-old%-") then
        refuse(root, ("is a non-empty directory moonbox did not make (it has %q and no %s)")
          :format(name, M.LOCK_NAME))
      end
    end
  end
  return canon
end

-- mkdir_p(path, created) -> true | nil, message, CODE; the directories it
-- makes are appended to created (outermost first).
function M.mkdir_p(path, created)
  if util.is_dir(path) then return true end
  local parent = path:match("^(.*)/[^/]+$")
  if parent and parent ~= "" then
    local ok, err, code = M.mkdir_p(parent, created)
    if not ok then return nil, err, code end
  end
  local ok, err, code = core.mkdir(path, 493)
  if not ok and code ~= "EEXIST" then return nil, err, code end
  if ok then created[#created + 1] = path end
  return true
end

-- lock(id, canon) -> {fd, path, made}: the root's lock, ours for the
-- sandbox's life. Raises SANDBOX_IN_USE naming the holder's pid.
function M.lock(id, canon)
  local path = canon .. "/" .. M.LOCK_NAME
  local existed = fs.lstat_beneath("/", path, "in_root") ~= nil
  local fd, msg, code, holder = fs.lock(path, core.getpid() .. "\n")
  if fd then return { fd = fd, path = path, made = not existed } end
  if code == "EAGAIN" then
    local pid = tonumber((holder or ""):match("^%s*(%d+)"))
    local by = pid == core.getpid() and "another sandbox of this runtime"
      or ("another runtime (pid %s)"):format(pid and tostring(pid) or "unknown")
    errors.raise("SANDBOX_IN_USE", ("sandbox %q: its root %s is in use by %s"):format(id, canon, by),
      { id = id, root = canon, pid = pid })
  end
  errors.raise("FILESYSTEM_ERROR", "cannot lock the sandbox root: " .. tostring(msg), { root = canon, errno = code })
end

function M.unlock(lock)
  if lock and lock.fd then
    core.close_fd(lock.fd)
    lock.fd = nil
  end
end

-- undo(lock, created): a failed getSandbox takes back what it made.
function M.undo(lock, created)
  if lock then
    if lock.made then core.unlink(lock.path) end
    M.unlock(lock)
  end
  for i = #created, 1, -1 do core.rmdir(created[i]) end
end

-- identity(canon) -> "dev:ino" of the root directory, or nil.
function M.identity(canon)
  local st = fs.lstat_beneath("/", canon, "in_root")
  return st and st.type == "directory" and (st.dev .. ":" .. st.ino) or nil
end

-- remove(canon, identity[, meanwhile]) -> true | nil, message, CODE: the
-- whole tree of the root, which must still be the directory it was
-- (identity). Awaited. meanwhile() (synchronous) runs on the loop while the
-- thread pool removes the tree (always, exactly once).
function M.remove(canon, identity, meanwhile)
  local now = M.identity(canon)
  if now == nil or now ~= identity then
    if meanwhile then meanwhile() end
    if now == nil then return true end -- already gone
    return nil, ("%s is no longer the sandbox's root directory (it was replaced); not removed"):format(canon),
      "ESTALE"
  end
  local parent, name = canon:match("^(.*)/([^/]+)$")
  local _, msg, code = fs.remove_tree(parent == "" and "/" or parent, name, nil, nil, meanwhile)
  if code and code ~= "ENOENT" then return nil, msg, code end
  return true
end

return M
