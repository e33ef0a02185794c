-- Paths of the file API (API.md "Files"): a path as the sandbox sees it
-- ("/workspace/...", or relative to the session's cwd) turned into a path
-- relative to the sandbox root that every call then opens through the
-- sandbox's confinement (lib/fs.lua, Sandbox:_confine), the policy's onFile
-- hook asked on the way; the API errors an OS failure maps to; and the
-- session queue every file call holds. Used by files/init.lua (the calls),
-- files/watch.lua and files/git.lua.
local errors = require "moonbox.errors"
local policy_mod = require "moonbox.policy"
local fs = require "moonbox.lib.fs"
local afs = fs.awaited
local util = require "moonbox.lib.util"
local V = require "moonbox.lib.validate"

local M = {}

-- ---- errors ---------------------------------------------------------------

local code_for_errno = {
  ENOENT = "FILE_NOT_FOUND",
  EEXIST = "FILE_EXISTS", ENOTEMPTY = "FILE_EXISTS",
  EISDIR = "IS_DIRECTORY",
  ENOTDIR = "NOT_DIRECTORY",
  EACCES = "PERMISSION_DENIED", EPERM = "PERMISSION_DENIED",
  EFBIG = "FILE_TOO_LARGE",
  ENOSPC = "NO_SPACE", EDQUOT = "NO_SPACE",
  PATH_OUTSIDE_SANDBOX = "PATH_OUTSIDE_SANDBOX",
}
M.code_for_errno = code_for_errno

-- Raise the API error for a failed OS call: op and the view path name it,
-- context carries path and errno.
local function fail(op, view, msg, code, context)
  local api = code_for_errno[code] or "FILESYSTEM_ERROR"
  local reason = type(msg) == "string" and msg:gsub(" %(.*$", "") or tostring(msg)
  context = context or {}
  context.path = context.path or view
  context.errno = code
  if api == "PATH_OUTSIDE_SANDBOX" then
    reason = "the path leads outside the sandbox"
  end
  errors.raise(api, ("%s %s: %s"):format(op, view, reason), context)
end

local function check(op, view, ok, msg, code, context)
  if ok == nil then fail(op, view, msg, code, context) end
  return ok
end

-- ---- paths ----------------------------------------------------------------

local normalize = util.normalize

local function absolute(path)
  if path:sub(1, 1) == "/" then return normalize(path) end
  return normalize((os.getenv("PWD") or "/") .. "/" .. path)
end

-- The root as given and as the kernel names it (they differ when the given
-- path runs through a symlink, and a shell's $PWD keeps the given form).
local root_forms_cache = setmetatable({}, { __mode = "k" })
local function root_forms(sb)
  local forms = root_forms_cache[sb]
  if forms and forms.root == sb.root then return forms end
  forms = { root = sb.root, absolute(sb.root) }
  local real = fs.realpath(sb.root)
  if real and real ~= forms[1] then forms[2] = real end
  root_forms_cache[sb] = forms
  return forms
end

local function join(dir, name)
  if dir == "." or dir == "" then return name end
  return dir .. "/" .. name
end

local function basename(rel)
  return rel:match("([^/]+)/*$") or rel
end

-- The sandbox's name for a path relative to the root.
local function view_of(sb, rel)
  -- under namespaces rel is relative to the sandbox's own root: /tmp, /root
  if sb.init then return rel == "." and "/" or "/" .. rel end
  if rel == "workspace" then return "/workspace" end
  if rel:sub(1, 10) == "workspace/" then return "/workspace/" .. rel:sub(11) end
  if rel == "." then return sb:view_path(absolute(sb.root)) end
  return sb:view_path(absolute(sb.root) .. "/" .. rel)
end

-- resolve(session, path) -> {rel, view, host}: rel is relative to the sandbox
-- root ("." for the root itself). A path that is outside the root as a
-- string raises PATH_OUTSIDE_SANDBOX; symlinks are judged by the kernel later.
-- Under namespaces the file API reaches the sandbox's own storage: the
-- workspace, its private /tmp and /root, and the policy's mounts; not the
-- system directories bound in read-only from the host (/usr, /etc, ...).
-- A sandbox made from an image reaches its whole root (in_reach).
local OWN_STORAGE = { "/workspace", "/tmp", "/root" }
local reach_cache = setmetatable({}, { __mode = "k" })
local function reach_of(sb)
  local reach = reach_cache[sb]
  if not reach then
    reach = util.copy(OWN_STORAGE)
    for _, m in ipairs(sb.policy.mounts or {}) do
      if m.dst and m.dst ~= "/" then reach[#reach + 1] = normalize(m.dst) end
    end
    reach_cache[sb] = reach
  end
  return reach
end

local function in_reach(sb, p)
  -- an image's root is the sandbox's own (its upper dir): all of it, but
  -- for the mounts on it the confinement refuses (/proc, /dev, /run/moonbox)
  if sb.image then return true end
  for _, dir in ipairs(reach_of(sb)) do
    if p == dir or p:sub(1, #dir + 1) == dir .. "/" then return true end
  end
  return false
end

-- Under namespaces a symlink means what it means to the sandbox's own
-- processes (an absolute one names a path inside it): the parent, and the
-- final component for calls that follow it, are resolved in the sandbox's
-- root, and where they lead must be in reach too. The call then works on
-- that path, still confined beneath the root (a symlink swapped in after
-- this point cannot lead out of the sandbox).
local function root_of(sb)
  return sb.fs_conf or sb.fs_root
end

local function sandbox_where(sb, p, follow)
  local root = root_of(sb)
  if follow then
    local where = afs.where_beneath(root, p:sub(2), "in_root")
    if where then return where end
  end
  local parent, last = p:match("^(.*)/([^/]+)$")
  if not parent or parent == "" then return p end
  local where = afs.where_beneath(root, parent:sub(2), "in_root")
  if not where then return p end -- a missing parent: the call says FILE_NOT_FOUND
  return (where == "/" and "" or where) .. "/" .. last
end

-- follow: whether the call follows a final symlink (deleteFile and rename
-- act on the link itself)
local function resolve(self, path, follow)
  local sb = self.sandbox
  if sb.init then
    local p = sb:host_path(path, self.cwd)
    if in_reach(sb, p) then
      local where = sandbox_where(sb, p, follow ~= false)
      if where == p or in_reach(sb, where) then
        return { rel = where:sub(2), view = p, host = p }
      end
    end
    sb:check_storage(path)
    errors.raise("PATH_OUTSIDE_SANDBOX", ("%s is outside the sandbox"):format(path), { path = path })
  end
  local host = absolute(sb:host_path(path, self.cwd))
  for _, root in ipairs(root_forms(sb)) do
    if host == root then
      return { rel = ".", view = view_of(sb, "."), host = host }
    end
    if host:sub(1, #root + 1) == root .. "/" then
      local rel = host:sub(#root + 2)
      return { rel = rel, view = view_of(sb, rel), host = host }
    end
  end
  sb:check_storage(path)
  errors.raise("PATH_OUTSIDE_SANDBOX", ("%s is outside the sandbox"):format(path), { path = path })
end

-- Inside the queue: resolve, then ask the policy's onFile hook, which may
-- refuse (nil, reason) or name another path.
local ACTS_ON_LINK = { deleteFile = true, renameFile = true, moveFile = true }
local function target(self, op, path)
  local follow = not ACTS_ON_LINK[op]
  local t = resolve(self, path, follow)
  local changed = policy_mod.call_hook(self.sandbox.policy, "onFile", op, { op = op, path = t.view }, self, op, t.view)
  if changed ~= nil and changed ~= t.view then
    path = V.path(changed, "path")
    t = resolve(self, path, follow)
  end
  -- A trailing slash names a directory, as it does to the kernel (whose
  -- open of "f/" is ENOTDIR): resolution drops it, so it is judged here.
  if path:find("[^/]/+$") and t.rel ~= "." then
    local st = afs.stat_beneath(root_of(self.sandbox), t.rel)
    if st and st.type ~= "directory" then
      if op == "exists" then t.not_there = true return t end
      errors.raise("NOT_DIRECTORY", ("%s %s: not a directory"):format(op, path), { path = t.view, errno = "ENOTDIR" })
    end
    if not st and op == "writeFile" then
      errors.raise("IS_DIRECTORY", ("writeFile %s: a path ending in / names a directory"):format(path),
        { path = t.view, errno = "EISDIR" })
    end
  end
  return t
end

-- Run body() holding the session's queue (after the running command).
local function queued(self, body)
  self:check_live()
  return self.queue:run(function()
    if self.destroyed then
      errors.raise("SESSION_DESTROYED", ("session %q was deleted"):format(self.id), { sessionId = self.id })
    end
    return body()
  end)
end

M.fail, M.check, M.absolute, M.join, M.basename = fail, check, absolute, join, basename
M.view_of, M.root_of, M.resolve, M.target, M.queued = view_of, root_of, resolve, target, queued

return M
