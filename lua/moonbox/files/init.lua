-- Files API (API.md "Files"): the file calls of an ExecutionSession, installed
-- on the Session class so the sandbox forwards them to its default session.
--
-- Paths are the sandbox's view: "/workspace/..." is the workspace directory,
-- a relative path starts at the session's current cwd. Every call turns its
-- path into a path relative to the sandbox root and does its I/O with the
-- openat2-confined helpers of lib/fs.lua through the sandbox's confinement
-- (sb.fs_conf, see Sandbox:_confine): "..", symlinks and a symlink swapped in
-- during the call cannot leave the root, and under namespaces every fd must
-- lie on one of the sandbox's own storage mounts (checked on the fd, after
-- the kernel resolved it), so nothing reached through /proc, /dev or the
-- host's read-only directories is ever read or written. The string checks
-- done first only give a clear error early; the kernel enforces the rule.
-- Every call waits its turn in the session's queue, like exec. Docs: docs/files.md.
local core = require "moonbox.core"
local async = require "moonbox.async"
local errors = require "moonbox.errors"
local policy_mod = require "moonbox.policy"
local fs = require "moonbox.lib.fs"
-- the sandbox file API makes its confined calls on the thread pool: a task
-- making many of them never holds the loop (issue #14)
local afs = fs.awaited
local util = require "moonbox.lib.util"
local V = require "moonbox.lib.validate"
local pattern_mod = require "moonbox.lib.pattern"
local compose = require "moonbox.lib.compose"
local Session = {} -- this part's methods, installed by session/init.lua (M.install)

local M = {}

M.STREAM_CHUNK = 64 * 1024      -- readFileStream's read size
M.WATCH_QUEUE_MAX = 100000      -- events a watch keeps for a consumer that does not iterate
M.MOVE_PAIR_MS = 20             -- how long a moved-out entry waits for its moved-in half

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
    sb:_check_storage(path)
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
  sb:_check_storage(path)
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
    t = resolve(self, V.path(changed, "path"), follow)
  end
  return t
end

-- Run body() holding the session's queue (after the running command).
local function queued(self, body)
  self:_check_live()
  return self.queue:run(function()
    if self.destroyed then
      errors.raise("SESSION_DESTROYED", ("session %q was deleted"):format(self.id), { sessionId = self.id })
    end
    return body()
  end)
end

-- ---- options --------------------------------------------------------------

local encodings = { ["utf-8"] = "utf-8", utf8 = "utf-8", base64 = "base64" }

local function encoding_option(value)
  if value == nil then return nil end
  local enc = encodings[value]
  if not enc then V.fail("encoding", "expected \"utf-8\" or \"base64\", got " .. tostring(value)) end
  return enc
end

local function boolean_option(value, field)
  if value ~= nil and type(value) ~= "boolean" then V.fail(field, "expected a boolean, got " .. type(value)) end
  return value == true
end

-- ---- open files -------------------------------------------------------------

-- An open fd whose close waits for the read or write running on it: if the
-- task is cancelled mid-request, the fd is closed only when the request has
-- finished, so a file opened meanwhile can never take over its number while
-- the thread pool still uses it.
local File = {}
File.__index = File

local MAX_IO = 0x7ffff000 -- the most one read(2) or write(2) moves

local function open_beneath(op, view, root, rel, flags, mode)
  local fd, msg, code = fs.open_beneath(root, rel, flags, mode)
  check(op, view, fd, msg, code)
  return setmetatable({ fd = fd, op = op, view = view }, File)
end

-- start(cb) queues a request whose callback is cb(err, result, code).
function File:request(start)
  local ok, result, msg, code = pcall(async.await, function(resume)
    local queued_ok, qmsg, qcode = start(function(err, result, ecode)
      self.inflight = false
      if self.close_later then self:discard() end
      if err ~= nil then resume(nil, err, ecode) else resume(result) end
    end)
    if queued_ok then self.inflight = true else resume(nil, qmsg, qcode) end
  end, "files " .. self.op)
  if not ok then error(result, 0) end
  return check(self.op, self.view, result, msg, code)
end

function File:fstat()
  return self:request(function(cb) return core.fs_fstat(self.fd, cb) end)
end

-- Read until end of file into bytes; want is the first read's size.
function File:read_all(bytes, want, limit)
  while true do
    if limit then want = math.min(want, limit + 1 - bytes:size()) end
    want = math.max(1, math.min(want, MAX_IO))
    local n = self:request(function(cb) return bytes:read(self.fd, want, nil, cb) end)
    if n == 0 then return bytes end
    if limit and bytes:size() > limit then
      errors.raise("FILE_TOO_LARGE", ("%s %s: larger than limits.maxFileBytes (%d bytes)")
        :format(self.op, self.view, limit), { path = self.view, limit = limit })
    end
    want = M.STREAM_CHUNK
  end
end

function File:read(size)
  return self:request(function(cb) return core.fs_read(self.fd, size, nil, cb) end)
end

-- Write all of data (a string or bytes), retrying short writes.
function File:write_all(data)
  local total = type(data) == "string" and #data or data:size()
  local done = 0
  while done < total do
    local n
    if type(data) == "string" then
      local rest = (done == 0 and total <= MAX_IO) and data or data:sub(done + 1, math.min(total, done + MAX_IO))
      n = self:request(function(cb) return core.fs_write(self.fd, rest, nil, cb) end)
    else
      n = self:request(function(cb) return data:write(self.fd, done, nil, cb) end)
    end
    if n == 0 then fail(self.op, self.view, "EIO: write made no progress", "EIO") end
    done = done + n
  end
end

-- close(): waits and reports the close's own error (a write can fail there).
function File:close()
  local fd = self.fd
  self.fd = nil
  return self:request(function(cb) return core.fs_close(fd, cb) end)
end

-- discard(): close without waiting, now or once the running request ends.
function File:discard()
  if self.inflight then
    self.close_later = true
  elseif self.fd then
    local fd = self.fd
    self.fd = nil
    core.fs_close(fd, function() end)
  end
end

-- Run fn(file) and discard the file if it raises.
local function using(file, fn)
  local ok, a, b = pcall(fn, file)
  if not ok then
    file:discard()
    error(a, 0)
  end
  return a, b
end

-- ---- content ------------------------------------------------------------------

M.MAGIC_BYTES = 7 * 1024 * 1024 -- what libmagic looks at (its own default)

-- mimeType and isBinary of bytes. Binary: not valid UTF-8 (it could not
-- come back as text), or a NUL byte, or control characters that libmagic
-- also calls binary. libmagic names the type; text it cannot place (a
-- one-byte file) is text/plain.
-- bytes:text_info / bytes:base64_encode, on the thread pool past
-- M.POOL_BYTES (issue #14: scanning and encoding 100 MB held the loop for
-- a few hundred ms), at once below it (a thread-pool round trip costs more).
M.POOL_BYTES = 1024 * 1024
local function bytes_op(bytes, method)
  if bytes:size() < M.POOL_BYTES then return bytes[method](bytes) end
  local res = async.await(function(resume)
    local ok, msg, code = bytes[method](bytes, function(err, ...)
      if err ~= nil then resume({ err = err }) else resume({ ... }) end
    end)
    if not ok then resume({ err = msg, code = code }) end
  end, "readFile")
  if res.err then errors.raise("FILESYSTEM_ERROR", ("readFile: %s"):format(res.err), { errno = res.code }) end
  return unpack(res, 1, 4)
end

local function classify(bytes)
  local mime, charset = core.magic_buffer(bytes, M.MAGIC_BYTES)
  local utf8, nul, control = bytes_op(bytes, "text_info")
  local binary = bytes:size() > 0 and (not utf8 or nul or (control and charset == "binary"))
  if not mime or (not binary and mime == "application/octet-stream") then
    mime = binary and "application/octet-stream" or "text/plain"
  end
  return mime, binary
end

-- Open a regular file for reading, confined. Directories raise IS_DIRECTORY;
-- other non-files (fifos, sockets, devices) are refused before open, which
-- could block on a fifo.
local function open_file(self, op, t)
  local root = root_of(self.sandbox)
  local st, msg, code = afs.stat_beneath(root, t.rel)
  check(op, t.view, st, msg, code)
  if st.type == "directory" then fail(op, t.view, "EISDIR: is a directory", "EISDIR") end
  if st.type ~= "file" then fail(op, t.view, "EINVAL: not a regular file", "EINVAL") end
  local file = open_beneath(op, t.view, root, t.rel, "r")
  st = using(file, file.fstat)
  if st.type ~= "file" then
    file:discard()
    fail(op, t.view, "EINVAL: not a regular file", "EINVAL")
  end
  return file, st
end

-- ---- writeFile / readFile / readFileStream -----------------------------------

local write_options = { encoding = true }

-- writeFile(path, content, {encoding}) -> {success, path, timestamp}
function Session:writeFile(path, content, opts)
  self:_check_live()
  V.path(path)
  V.type(content, "string", "content")
  opts = V.options(opts, write_options, "writeFile options")
  local data = content
  if encoding_option(opts.encoding) == "base64" then
    -- decoded into C memory, written from there: no 100 MB Lua string
    data = core.bytes()
    if not data:base64_decode(content) then
      data:free()
      V.fail("content", "invalid base64")
    end
  end
  local ok, result = pcall(queued, self, function()
    local timestamp = util.timestamp()
    local t = target(self, "writeFile", path)
    local file = open_beneath("writeFile", t.view, root_of(self.sandbox), t.rel, "w")
    using(file, function() file:write_all(data) end)
    file:close()
    return { success = true, path = t.view, timestamp = timestamp }
  end)
  if type(data) ~= "string" then pcall(data.free, data) end
  if not ok then error(result, 0) end
  return result
end

local read_options = { encoding = true }

-- readFile(path, {encoding}) -> {success, path, content, encoding, isBinary, mimeType, size, timestamp}
function Session:readFile(path, opts)
  self:_check_live()
  V.path(path)
  opts = V.options(opts, read_options, "readFile options")
  local encoding = encoding_option(opts.encoding)
  return queued(self, function()
    local timestamp = util.timestamp()
    local t = target(self, "readFile", path)
    local limit = self.sandbox.policy.limits.maxFileBytes
    local file, st = open_file(self, "readFile", t)
    if limit and st.size > limit then
      file:discard()
      errors.raise("FILE_TOO_LARGE", ("readFile %s: %d bytes, larger than limits.maxFileBytes (%d bytes)")
        :format(t.view, st.size, limit), { path = t.view, size = st.size, limit = limit })
    end
    -- the file goes into C memory and becomes one Lua string at the end
    local bytes = core.bytes(st.size + 1)
    using(file, function() file:read_all(bytes, st.size + 1, limit) end)
    file:close()
    local mime, binary = classify(bytes)
    local enc = encoding or (binary and "base64" or "utf-8")
    local content = enc == "base64" and bytes_op(bytes, "base64_encode") or bytes:tostring()
    local size = bytes:size()
    bytes:free()
    return {
      success = true, path = t.view, content = content, encoding = enc, isBinary = binary,
      mimeType = mime, size = size, timestamp = timestamp,
    }
  end)
end

-- readFileStream(path) -> iterator of byte chunks (M.STREAM_CHUNK bytes each,
-- the last one shorter), read as the loop asks for them. The file is opened
-- by the call (its errors raise there); it is closed at end of file, by
-- iterator:close(), or when the iterator is garbage collected.
function Session:readFileStream(path, opts)
  self:_check_live()
  V.path(path)
  V.options(opts, {}, "readFileStream options")
  local file, view = queued(self, function()
    local t = target(self, "readFileStream", path)
    return open_file(self, "readFileStream", t), t.view
  end)
  local done = false
  local function release()
    done = true
    file:discard()
  end
  local guard = newproxy(true)
  getmetatable(guard).__gc = release
  return setmetatable({ path = view, close = release, cancel = release, _guard = guard }, {
    __call = function()
      if done then return nil end
      local data = using(file, function() return file:read(M.STREAM_CHUNK) end)
      if data == "" then
        release()
        return nil
      end
      return data
    end,
  })
end

-- ---- directories and names ---------------------------------------------------

local mkdir_options = { recursive = true }

-- mkdir(path, {recursive}) -> {success, path, recursive, timestamp}
function Session:mkdir(path, opts)
  self:_check_live()
  V.path(path)
  opts = V.options(opts, mkdir_options, "mkdir options")
  local recursive = boolean_option(opts.recursive, "recursive")
  return queued(self, function()
    local timestamp = util.timestamp()
    local t = target(self, "mkdir", path)
    local root = root_of(self.sandbox)
    if t.rel == "." then
      if not recursive then fail("mkdir", t.view, "EEXIST: file already exists", "EEXIST") end
    elseif not recursive then
      -- an existing one (the workspace itself: its parent is no place to write)
      if afs.lstat_beneath(root, t.rel) then fail("mkdir", t.view, "EEXIST: file already exists", "EEXIST") end
      check("mkdir", t.view, afs.mkdir_beneath(root, t.rel, 511))
    else
      local prefix = "."
      local parts = {}
      for part in t.rel:gmatch("[^/]+") do parts[#parts + 1] = part end
      for i, part in ipairs(parts) do
        prefix = join(prefix, part)
        -- an existing directory is not made again (the sandbox root itself
        -- is not a place the file API may write in, /workspace is)
        local existing = afs.stat_beneath(root, prefix)
        local ok, msg, code = true, nil, nil
        if not (existing and existing.type == "directory") then ok, msg, code = afs.mkdir_beneath(root, prefix, 511) end
        if not ok and code == "EEXIST" then
          local st, smsg, scode = afs.stat_beneath(root, prefix)
          check("mkdir", t.view, st, smsg, scode)
          if st.type ~= "directory" then
            if i == #parts then fail("mkdir", t.view, "EEXIST: file already exists", "EEXIST") end
            fail("mkdir", t.view, "ENOTDIR: not a directory", "ENOTDIR")
          end
        else
          check("mkdir", t.view, ok, msg, code)
        end
      end
    end
    return { success = true, path = t.view, recursive = recursive, timestamp = timestamp }
  end)
end

-- deleteFile(path) -> {success, path, timestamp}. A symlink is removed itself;
-- a directory raises IS_DIRECTORY.
function Session:deleteFile(path)
  self:_check_live()
  V.path(path)
  return queued(self, function()
    local timestamp = util.timestamp()
    local t = target(self, "deleteFile", path)
    if t.view == "/workspace" then fail("deleteFile", t.view, "EISDIR: the workspace is a directory", "EISDIR") end
    if t.rel == "." then fail("deleteFile", t.view, "EISDIR: is a directory", "EISDIR") end
    check("deleteFile", t.view, afs.unlink_beneath(root_of(self.sandbox), t.rel))
    return { success = true, path = t.view, timestamp = timestamp }
  end)
end

-- rename(2) across filesystems (EXDEV: /workspace and the private /tmp or
-- /root are different mounts under namespaces) does what mv does: copy,
-- then remove the source. Regular files and directories of them; a tree
-- holding anything else (a symlink, a fifo) keeps the EXDEV error, checked
-- before anything is copied. The destination follows rename(2): a file
-- replaces a file, a directory only an empty directory.
local function movable_tree(root, rel)
  local st = afs.lstat_beneath(root, rel)
  if not st then return false end
  if st.type == "file" then return true end
  if st.type ~= "directory" then return false end
  local entries = fs.scandir_beneath(root, rel)
  if not entries then return false end
  for _, e in ipairs(entries) do
    if not movable_tree(root, join(rel, e.name)) then return false end
  end
  return true
end

local function copy_tree(op, view, root, from, to)
  local st = check(op, view, afs.lstat_beneath(root, from))
  local mode = st.mode % 4096
  if st.type == "directory" then
    check(op, view, afs.mkdir_beneath(root, to, mode))
    for _, e in ipairs(check(op, view, fs.scandir_beneath(root, from))) do
      copy_tree(op, view, root, join(from, e.name), join(to, e.name))
    end
    return
  end
  local src = open_beneath(op, view, root, from, "r")
  local ok, err = pcall(function()
    local dst = open_beneath(op, view, root, to, "wx", mode)
    using(dst, function()
      while true do
        local data = src:read(M.STREAM_CHUNK)
        if data == "" then break end
        dst:write_all(data)
      end
    end)
    dst:close()
  end)
  src:discard()
  if not ok then error(err, 0) end
end

-- The whole tree on the thread pool (src/fs_tree.c): dirfd-relative, any
-- depth, symlinks removed and never followed, the first failure an error.
local function remove_tree(op, view, root, rel)
  check(op, view, fs.remove_tree(root, rel))
end

-- Copy what `to` lacks of the tree at `from` (a rollback that puts back
-- the part of a source already removed).
local function restore_tree(op, view, root, from, to)
  local st = check(op, view, afs.lstat_beneath(root, from))
  local have = afs.lstat_beneath(root, to)
  if not have then return copy_tree(op, view, root, from, to) end
  if st.type == "directory" and have.type == "directory" then
    for _, e in ipairs(check(op, view, fs.scandir_beneath(root, from))) do
      restore_tree(op, view, root, join(from, e.name), join(to, e.name))
    end
  end
end

-- A move that fails half way is undone: the tree is copied to a hidden
-- name beside the destination, the source removed, and only then the copy
-- renamed onto the destination (replacing a file or an empty directory as
-- rename(2) does, in one step). A failed copy removes the partial copy; a
-- failed removal of the source, or a failed final rename, puts back what
-- was removed from the source and removes the copy. The error raised is the
-- original one (context.rolledBack says whether the rollback completed).
local move_seq = 0
local function move_across(op, src, dst, root)
  local view = src.view
  local ctx = { newPath = dst.view }
  if not movable_tree(root, src.rel) then
    fail(op, view, "EXDEV: cross-device move of a symlink or special file", "EXDEV", ctx)
  end
  local st = afs.lstat_beneath(root, src.rel)
  local existing = afs.lstat_beneath(root, dst.rel)
  if existing then
    if st.type == "directory" then
      if existing.type ~= "directory" then fail(op, view, "ENOTDIR: not a directory", "ENOTDIR", ctx) end
      local entries = check(op, view, fs.scandir_beneath(root, dst.rel))
      if #entries > 0 then fail(op, view, "ENOTEMPTY: directory not empty", "ENOTEMPTY", ctx) end
    elseif existing.type == "directory" then
      fail(op, view, "EISDIR: is a directory", "EISDIR", ctx)
    end
  end
  move_seq = move_seq + 1
  local parent = dst.rel:match("^(.*)/[^/]+$") or "."
  local staged = join(parent, (".moonbox-move-%d-%d"):format(core.getpid(), move_seq))
  local function undo(err, source_touched)
    local ok = pcall(function()
      if source_touched then restore_tree(op, view, root, staged, src.rel) end
      if afs.lstat_beneath(root, staged) then remove_tree(op, view, root, staged) end
    end)
    if errors.is_error(err) then
      err.context = err.context or {}
      err.context.rolledBack = ok
    end
    error(err, 0)
  end
  local ok, err = pcall(copy_tree, op, view, root, src.rel, staged)
  if not ok then undo(err, false) end
  ok, err = pcall(remove_tree, op, view, root, src.rel)
  if not ok then undo(err, true) end
  ok, err = pcall(function() check(op, view, afs.rename_beneath(root, staged, dst.rel)) end)
  if not ok then undo(err, true) end
end

local function rename(self, op, from, to, into_directory)
  self:_check_live()
  V.path(from, op == "moveFile" and "sourcePath" or "oldPath")
  V.path(to, op == "moveFile" and "destinationPath" or "newPath")
  return queued(self, function()
    local timestamp = util.timestamp()
    local src = target(self, op, from)
    local dst = target(self, op, to)
    local root = root_of(self.sandbox)
    if into_directory and dst.rel ~= src.rel then
      -- like mv: an existing directory as the destination receives the source
      local st = afs.stat_beneath(root, dst.rel)
      if st and st.type == "directory" and src.rel ~= "." then
        local name = basename(src.rel)
        dst = { rel = join(dst.rel, name), view = (dst.view == "/" and "" or dst.view) .. "/" .. name }
      end
    end
    if src.rel == "." or dst.rel == "." then
      fail(op, src.view, "EBUSY: the sandbox root cannot be renamed", "EBUSY", { newPath = dst.view })
    end
    local ok, msg, code = afs.rename_beneath(root, src.rel, dst.rel)
    if not ok and code == "EXDEV" then
      move_across(op, src, dst, root)
    else
      check(op, src.view, ok, msg, code)
    end
    return { success = true, path = src.view, newPath = dst.view, timestamp = timestamp }
  end)
end

-- renameFile(oldPath, newPath) -> {success, path, newPath, timestamp}
function Session:renameFile(old_path, new_path)
  return rename(self, "renameFile", old_path, new_path, false)
end

-- moveFile(sourcePath, destinationPath) -> {success, path, newPath, timestamp};
-- an existing directory as destination receives the source (like mv).
function Session:moveFile(source, destination)
  return rename(self, "moveFile", source, destination, true)
end

-- ---- listFiles / exists ---------------------------------------------------------

-- "rwxr-xr-x", as ls shows the permission bits (s/S, t/T for the special ones)
local function mode_string(mode)
  local out = {}
  local specials = { 2048, 1024, 512 } -- setuid, setgid, sticky
  for who = 0, 2 do
    local shift = (2 - who) * 3
    local bits = math.floor(mode / 2 ^ shift) % 8
    out[#out + 1] = bits >= 4 and "r" or "-"
    out[#out + 1] = bits % 4 >= 2 and "w" or "-"
    local x = bits % 2 == 1
    if math.floor(mode / specials[who + 1]) % 2 == 1 then
      out[#out + 1] = who == 2 and (x and "t" or "T") or (x and "s" or "S")
    else
      out[#out + 1] = x and "x" or "-"
    end
  end
  return table.concat(out)
end
M.mode_string = mode_string

-- What the runtime's user may do with the entry, from its mode bits
-- (owner, group or other; root may read and write anything).
local function permissions(st)
  local uid, gid = core.getuid(), core.getgid()
  local mode = st.mode
  if uid == 0 then
    return { readable = true, writable = true,
      executable = st.type == "directory" or math.floor(mode / 64) % 2 == 1 or math.floor(mode / 8) % 2 == 1
        or mode % 2 == 1 }
  end
  local bits
  if st.uid == uid then bits = math.floor(mode / 64) % 8
  elseif st.gid == gid then bits = math.floor(mode / 8) % 8
  else bits = mode % 8 end
  return { readable = bits >= 4, writable = bits % 4 >= 2, executable = bits % 2 == 1 }
end

local list_options = { recursive = true, includeHidden = true, limit = true }
M.LIST_LIMIT = 10000      -- entries listFiles returns unless asked for another limit
M.LIST_MAX_LIMIT = 100000 -- the most it returns at all: each entry is a table of ten fields
local LIST_SLICE_MS = 3   -- work on the loop between two yields
local O_PATH = 2097152    -- 010000000: Linux, every architecture LuaJIT runs on but sparc/alpha/parisc

-- The entries of a directory (fd from open_beneath), read and sorted by
-- libuv on its thread pool (strcmp order, the order Lua's < gives), handed
-- over in batches (dirlist:next(n)) so a huge directory is never turned
-- into Lua tables in one go.
local function read_dir(fd)
  return async.await(function(resume)
    local ok, msg, code = core.fs_scandir_batched("/proc/self/fd/" .. fd, function(err, dirlist, code2)
      if err ~= nil then resume(nil, err, code2) else resume(dirlist) end
    end)
    if not ok then resume(nil, msg, code) end
  end, "listFiles")
end

-- listFiles(path, {recursive, includeHidden, limit}) -> {success, path, files,
-- count, truncated, timestamp}. Entries sorted by name, a directory's
-- contents right after it; symlinks are listed as "symlink" and never
-- followed. At most `limit` entries (default LIST_LIMIT); truncated says
-- some were left out.
--
-- Nothing here holds the loop for long (issue #14: 300k entries stalled it
-- 4.3 s): a directory is opened (O_PATH, confined) and read and sorted on the
-- thread pool, and its entries are stat'ed relative to that fd in slices of
-- LIST_SLICE_MS with the loop running between them.
function Session:listFiles(path, opts)
  self:_check_live()
  V.path(path)
  opts = V.options(opts, list_options, "listFiles options")
  local recursive = boolean_option(opts.recursive, "recursive")
  local hidden = boolean_option(opts.includeHidden, "includeHidden")
  local limit = opts.limit
  if limit == nil then
    limit = M.LIST_LIMIT
  elseif type(limit) ~= "number" or limit % 1 ~= 0 or limit < 1 or limit > M.LIST_MAX_LIMIT then
    V.fail("limit", ("expected an integer from 1 to %d"):format(M.LIST_MAX_LIMIT))
  end
  return queued(self, function()
    local timestamp = util.timestamp()
    local t = target(self, "listFiles", path)
    local root, sb = root_of(self.sandbox), self.sandbox
    local files, truncated = {}, false
    local slice_start = util.now_ms()
    local function walk(dir_rel, prefix)
      local fd, msg, code = fs.open_beneath(root, dir_rel, O_PATH)
      local dirlist
      if fd then
        local ok, res, rmsg, rcode = pcall(read_dir, fd)
        if not ok then fs.close_dir(fd) error(res, 0) end
        dirlist, msg, code = res, rmsg, rcode
      end
      if not dirlist then
        if fd then fs.close_dir(fd) end
        if dir_rel ~= t.rel and (code == "ENOENT" or code == "ENOTDIR") then return end -- changed meanwhile
        msg = msg and msg:gsub(" %(scandir '/proc/self/fd/%d+'%)", "")
        fail("listFiles", view_of(sb, dir_rel), msg, code)
      end
      local ok, err = pcall(function()
        local batch, i = {}, 0
        while not truncated do
          i = i + 1
          local e = batch[i]
          if not e then
            if util.now_ms() - slice_start >= LIST_SLICE_MS then
              async.sleep(1) -- a 0 ms timer could run again before any I/O
              slice_start = util.now_ms()
            end
            batch, i = dirlist:next(64), 1
            if not batch then return end
            e = batch[1]
          end
          if hidden or e.name:sub(1, 1) ~= "." then
            local rel = join(dir_rel, e.name)
            local st, smsg, scode = afs.lstat_beneath(fd, e.name)
            if st then
              if #files == limit then truncated = true return end
              local relative = prefix == "" and e.name or prefix .. "/" .. e.name
              files[#files + 1] = {
                name = e.name, absolutePath = view_of(sb, rel), relativePath = relative,
                type = st.type, size = st.size, modifiedAt = util.timestamp(st.mtime),
                mode = mode_string(st.mode), permissions = permissions(st),
              }
              if recursive and st.type == "directory" then walk(rel, relative) end
            elseif scode ~= "ENOENT" then
              fail("listFiles", view_of(sb, rel), smsg, scode)
            end
          end
        end
      end)
      dirlist:close()
      fs.close_dir(fd)
      if not ok then error(err, 0) end
    end
    walk(t.rel, "")
    return { success = true, path = t.view, files = files, count = #files, truncated = truncated,
      timestamp = timestamp }
  end)
end

-- exists(path) -> {success, path, exists, timestamp}; a dangling symlink does
-- not exist; a path leading outside the sandbox raises PATH_OUTSIDE_SANDBOX.
function Session:exists(path)
  self:_check_live()
  V.path(path)
  return queued(self, function()
    local timestamp = util.timestamp()
    local t = target(self, "exists", path)
    local st, msg, code = afs.stat_beneath(root_of(self.sandbox), t.rel)
    if not st and code ~= "ENOENT" and code ~= "ENOTDIR" and code ~= "ELOOP" then
      fail("exists", t.view, msg, code)
    end
    return { success = true, path = t.view, exists = st ~= nil, timestamp = timestamp }
  end)
end

-- ---- watch ----------------------------------------------------------------------

-- Globs: "*" and "?" within one path segment, "**" across segments, [...]
-- sets. A glob without "/" matches any segment (like .gitignore); one with
-- "/" is anchored at the watched directory. Either way a match on a
-- directory covers everything below it.
--
-- Matched with the classic one-backtrack-point wildcard algorithm, within a
-- segment ("*" over bytes) and across them ("**" over segments): at most
-- (length x tokens) steps. Translated to a Lua pattern, "*a*a*a*a*a*a*a*b"
-- backtracked without bound on every event, on the loop (issue #14).
local STAR = "*"
local ANY_BYTE = pattern_mod.class_set(".")

-- A glob segment as tokens: STAR, or the set of bytes one position matches.
local function segment_tokens(seg)
  local toks, i = {}, 1
  while i <= #seg do
    local c = seg:sub(i, i)
    if c == "*" then
      if toks[#toks] ~= STAR then toks[#toks + 1] = STAR end
    elseif c == "?" then toks[#toks + 1] = ANY_BYTE
    elseif c == "[" and seg:find("]", i + 1, true) then
      local close = seg:find("]", i + 2, true) or seg:find("]", i + 1, true)
      local set = seg:sub(i + 1, close - 1):gsub("^!", "^"):gsub("%%", "%%%%")
      local bytes, msg = pattern_mod.class_set("[" .. set .. "]")
      if not bytes then error(("malformed set %q: %s"):format(seg:sub(i, close), msg), 0) end
      toks[#toks + 1] = bytes
      i = close
    else
      local bytes = pattern_mod.class_set(c:match("%p") and "%" .. c or c)
      if not bytes then error("a glob cannot hold a NUL byte", 0) end
      toks[#toks + 1] = bytes
    end
    i = i + 1
  end
  return toks
end

local function compile_glob(glob)
  local segs = {}
  local anchored = glob:find("/", 1, true) ~= nil
  if not anchored then segs[1] = "**" end
  for seg in glob:gmatch("[^/]+") do
    segs[#segs + 1] = seg == "**" and "**" or segment_tokens(seg)
  end
  segs[#segs + 1] = "**"
  return segs
end

-- wildcard(toks, n, star, one, k): toks[1..#toks] against positions 1..n,
-- where toks[p] == star matches any run and one(tok, k) says whether a
-- single token matches position k.
local function wildcard(toks, n, star, one)
  local p, k, star_p, mark = 1, 1, nil, 0
  while k <= n do
    local t = toks[p]
    if t == star then
      star_p, mark, p = p, k, p + 1
    elseif t ~= nil and one(t, k) then
      p, k = p + 1, k + 1
    elseif star_p then
      p, mark = star_p + 1, mark + 1
      k = mark
    else
      return false
    end
  end
  while toks[p] == star do p = p + 1 end
  return p > #toks
end

local function match_segments(segs, parts)
  return wildcard(segs, #parts, "**", function(toks, k)
    local part = parts[k]
    return wildcard(toks, #part, STAR, function(bytes, j) return bytes[part:byte(j)] end)
  end)
end

local function glob_list(globs, field)
  if globs == nil then return nil end
  if type(globs) == "string" then globs = { globs } end
  if type(globs) ~= "table" then V.fail(field, "expected a list of glob strings") end
  local out = {}
  for i, g in ipairs(globs) do
    if type(g) ~= "string" or g == "" then V.fail(("%s[%d]"):format(field, i), "expected a glob string") end
    local ok, segs = pcall(compile_glob, g)
    if not ok then V.fail(("%s[%d]"):format(field, i), segs) end
    out[#out + 1] = { glob = g, segs = segs }
  end
  return out
end

local function matches_any(list, sub)
  if not list or sub == "" then return false end
  local parts = {}
  for p in sub:gmatch("[^/]+") do parts[#parts + 1] = p end
  for _, g in ipairs(list) do
    if match_segments(g.segs, parts) then return true end
  end
  return false
end
M.glob_matches = function(glob, path) return matches_any({ { segs = compile_glob(glob) } }, path) end

local DEFAULT_EXCLUDES = { ".git", "node_modules" }

local Watch = {}
Watch.__index = Watch

-- path of rel inside the watched directory ("" for the directory itself)
function Watch:_sub(rel)
  if rel == self.rel then return "" end
  if self.rel == "." then return rel end
  return rel:sub(#self.rel + 2)
end

function Watch:_excluded(rel)
  return matches_any(self.exclude, self:_sub(rel))
end

function Watch:_wake()
  local w = self.waiter
  if w then self.waiter = nil w() end
end

function Watch:_push(ev)
  if self.closed then return end
  if self.tail - self.head + 1 >= M.WATCH_QUEUE_MAX then
    if not self.overflowed then
      self.overflowed = true
      self.tail = self.tail + 1
      self.events[self.tail] = { type = "overflow", path = self.view, timestamp = util.timestamp() }
    end
    return
  end
  self.tail = self.tail + 1
  self.events[self.tail] = ev
  self:_wake()
end

function Watch:_emit(kind, rel, isdir, old_rel)
  local sub = self:_sub(rel)
  if sub ~= "" and (matches_any(self.exclude, sub) or (self.include and not matches_any(self.include, sub))) then
    return
  end
  local view = view_of(self.sandbox, rel)
  if kind == "modify" and self.tail >= self.head then
    local last = self.events[self.tail]
    if last.type == "modify" and last.path == view then return end -- not seen yet: one is enough
  end
  self:_push { type = kind, path = view, isDirectory = isdir, timestamp = util.timestamp(),
    oldPath = old_rel and view_of(self.sandbox, old_rel) or nil }
end

-- In a task (watch() setting up a recursive watch), the walk yields to the
-- loop after every LIST_SLICE_MS of work: a big tree never holds the loop
-- (issue #14). slice = {start = ms}; nil outside a task (an event's
-- callback), where the walk cannot yield.
local function walk_slice(slice)
  if slice and util.now_ms() - slice.start >= LIST_SLICE_MS then
    async.sleep(1)
    slice.start = util.now_ms()
  end
end

-- Watch directory rel (already known to be a directory) and, recursively,
-- its subdirectories. With announce, everything found inside is reported as
-- created: it appeared before the new watch was in place.
function Watch:_add_tree(rootfd, rel, announce, slice)
  walk_slice(slice)
  local wd, msg, code = self.handle:add(rootfd, rel)
  if not wd then return nil, msg, code end
  self.wds[wd] = rel
  self.dirs[rel] = wd
  local entries = fs.scandir_beneath(rootfd, rel) or {}
  for _, e in ipairs(entries) do
    local child = join(rel, e.name)
    local kind = e.type
    if kind == "unknown" then
      local st = afs.lstat_beneath(rootfd, child)
      kind = st and st.type
    end
    if announce then
      self.announced[child] = true
      self:_emit("create", child, kind == "directory")
    end
    if kind == "directory" and not self:_excluded(child) then self:_add_tree(rootfd, child, announce, slice) end
  end
  return wd
end

function Watch:_watch_new_dir(rel)
  if not self.recursive or self:_excluded(rel) then return end
  self:_add_tree(root_of(self.sandbox), rel, true)
end

-- Forget the watches of rel and below; drop stops the kernel's watches too
-- (a directory moved out of the tree is still watched otherwise).
function Watch:_forget_tree(rel, drop)
  for dir, wd in pairs(self.dirs) do
    if dir == rel or dir:sub(1, #rel + 1) == rel .. "/" then
      self.dirs[dir] = nil
      self.wds[wd] = nil
      if drop then self.handle:remove(wd) end
    end
  end
end

function Watch:_rename_tree(old, new)
  local moved = {}
  for dir, wd in pairs(self.dirs) do
    if dir == old or dir:sub(1, #old + 1) == old .. "/" then moved[#moved + 1] = { dir, wd } end
  end
  for _, m in ipairs(moved) do self.dirs[m[1]] = nil end
  for _, m in ipairs(moved) do
    local dir = new .. m[1]:sub(#old + 1)
    self.dirs[dir] = m[2]
    self.wds[m[2]] = dir
  end
end

-- A moved-out entry whose moved-in half did not come: it left the tree.
function Watch:_flush_pending()
  local p = self.pending
  if not p then return end
  self.pending = nil
  if self.pair_timer then self.pair_timer:stop() end
  if p.isdir then self:_forget_tree(p.rel, true) end
  self:_emit("delete", p.rel, p.isdir)
end

function Watch:_finish(err)
  if self.ended then return end
  self.ended = true
  self.err = err
  self:_release()
  self:_wake()
end

function Watch:_on_event(err, name, ev, errcode)
  if self.ended then return end
  if err then
    return self:_finish(errors.new("FILESYSTEM_ERROR", "watch " .. self.view .. ": " .. tostring(err),
      { path = self.view, errno = errcode }))
  end
  if ev.overflow then
    self:_flush_pending()
    return self:_push { type = "overflow", path = self.view, timestamp = util.timestamp() }
  end
  local dir = self.wds[ev.wd]
  if not dir then return end
  if ev.ignored then
    self.wds[ev.wd] = nil
    if self.dirs[dir] == ev.wd then self.dirs[dir] = nil end
    return
  end
  if name == nil then
    -- about a watched object itself: its parent reports it, except for the root
    if ev.wd ~= self.root_wd then return end
    if ev.delete_self or ev.move_self or ev.unmount then
      self:_flush_pending()
      self:_push { type = "delete", path = self.view, isDirectory = not self.is_file, timestamp = util.timestamp() }
      return self:_finish()
    end
    if self.is_file and (ev.modify or ev.attrib) then self:_emit("modify", self.rel, false) end
    return
  end
  local rel = join(dir, name)
  local isdir = ev.isdir == true
  if ev.moved_to then
    local p = self.pending
    if p and p.cookie == ev.cookie then
      self.pending = nil
      if self.pair_timer then self.pair_timer:stop() end
      if isdir then self:_rename_tree(p.rel, rel) end
      return self:_emit("move", rel, isdir, p.rel)
    end
    self:_flush_pending()
    self:_emit("create", rel, isdir)
    if isdir then self:_watch_new_dir(rel) end
    return
  end
  self:_flush_pending()
  if ev.moved_from then
    self.pending = { cookie = ev.cookie, rel = rel, isdir = isdir }
    if not self.pair_timer then self.pair_timer = core.timer() end
    self.pair_timer:start(M.MOVE_PAIR_MS, 0, function() self:_flush_pending() end)
  elseif ev.create then
    if self.announced[rel] then
      self.announced[rel] = nil -- already reported by the scan of its new directory
      return
    end
    self:_emit("create", rel, isdir)
    if isdir then self:_watch_new_dir(rel) end
  elseif ev.delete then
    self.announced[rel] = nil
    if isdir then self:_forget_tree(rel, false) end
    self:_emit("delete", rel, isdir)
  elseif ev.modify or ev.attrib then
    self:_emit("modify", rel, isdir)
  end
end

function Watch:_release()
  if self.handle and not self.handle:is_closing() then self.handle:close() end
  if self.pair_timer and not self.pair_timer:is_closing() then self.pair_timer:close() end
  local set = self.session._watches
  if set then set[self] = nil end
end

-- close(): stop watching now; queued events are dropped.
function Watch:close()
  if not self.ended then
    self.ended = true
    self:_release()
  end
  self.events, self.head, self.tail = {}, 1, 0
  self:_wake()
end

function Watch:_next()
  while self.head > self.tail do
    if self.ended then
      local err = self.err
      self.err = nil
      if err then error(err, 0) end
      return nil
    end
    async.await(function(resume)
      self.waiter = resume
      return function() self.waiter = nil end
    end, "watch iteration")
  end
  local ev = self.events[self.head]
  self.events[self.head] = nil
  self.head = self.head + 1
  if ev.type == "overflow" then self.overflowed = false end
  return ev
end

local watch_options = { recursive = true, include = true, exclude = true }

-- watch(path, {recursive, include, exclude}) -> iterator of
-- {type = "create"|"modify"|"delete"|"move", path, isDirectory, timestamp[, oldPath]}.
-- Returns once the watch is in place. It lives until iterator:close() (or
-- :cancel()), until the iterator is garbage collected, until the watched
-- path itself is deleted (a last "delete" event, then the loop ends), or
-- until the session is deleted or the sandbox destroyed.
function Session:watch(path, opts)
  self:_check_live()
  V.path(path)
  opts = require("moonbox.lib.seed_options").adapt(opts, require("moonbox.lib.seed_options").watch, "watch")
  opts = V.options(opts, watch_options, "watch options")
  local recursive = boolean_option(opts.recursive, "recursive")
  local include = glob_list(opts.include, "include")
  local exclude = glob_list(opts.exclude, "exclude") or {}
  for _, name in ipairs(DEFAULT_EXCLUDES) do
    local named = false
    for _, g in ipairs(include or {}) do
      if g.glob:find(name, 1, true) then named = true end
    end
    if not named then exclude[#exclude + 1] = { glob = name, segs = compile_glob(name) } end
  end
  local w = queued(self, function()
    local t = target(self, "watch", path)
    local root = root_of(self.sandbox)
    local st, msg, code = afs.stat_beneath(root, t.rel)
    check("watch", t.view, st, msg, code)
    if st.type ~= "directory" and st.type ~= "file" then
      fail("watch", t.view, "EINVAL: not a file or directory", "EINVAL")
    end
    local rootfd = root
    local watch = setmetatable({
      session = self, sandbox = self.sandbox, rel = t.rel, view = t.view, is_file = st.type == "file",
      recursive = recursive, include = include, exclude = exclude,
      wds = {}, dirs = {}, announced = {}, events = {}, head = 1, tail = 0,
    }, Watch)
    watch.handle = core.fs_event()
    local wd
    wd, msg, code = watch.handle:start(rootfd, t.rel, function(err, name, ev, errcode)
      watch:_on_event(err, name, ev, errcode)
    end)
    if wd and not watch.is_file then
      watch.wds[wd] = t.rel
      watch.dirs[t.rel] = wd
      if recursive then
        local slice = async.in_task() and { start = util.now_ms() } or nil
        for _, e in ipairs(fs.scandir_beneath(rootfd, t.rel) or {}) do
          local child = join(t.rel, e.name)
          local kind = e.type
          if kind == "unknown" then kind = (afs.lstat_beneath(rootfd, child) or {}).type end
          if kind == "directory" and not watch:_excluded(child) then
            local ok, amsg, acode = watch:_add_tree(rootfd, child, false, slice)
            if not ok and acode ~= "ENOENT" then wd, msg, code = nil, amsg, acode break end
          end
        end
      end
    elseif wd then
      watch.wds[wd] = t.rel
    end
    if not wd then
      watch.handle:close()
      if code == "ENOSPC" then -- from inotify: out of watches, not of disk space
        errors.raise("FILESYSTEM_ERROR", ("watch %s: the inotify watch limit is reached (fs.inotify.max_user_watches)")
          :format(t.view), { path = t.view, errno = code })
      end
      fail("watch", t.view, msg, code)
    end
    watch.root_wd = wd
    self._watches = self._watches or {}
    self._watches[watch] = true
    return watch
  end)
  local guard = newproxy(true)
  getmetatable(guard).__gc = function() w:close() end
  local function close() w:close() end
  -- drain() -> how many events were queued (taken without waiting), and
  -- whether the watch is over: checkChanges counts changes with it
  local function drain()
    local n = w.tail - w.head + 1
    w.events, w.head, w.tail, w.overflowed = {}, 1, 0, false
    return n, w.ended == true
  end
  return setmetatable({ path = w.view, close = close, cancel = close, drain = drain, _guard = guard }, {
    __call = function() return w:_next() end,
  })
end

-- A deleted session (or destroyed sandbox) takes its watches with it.
local function end_watches(session)
  if session._watches then
    for w in pairs(session._watches) do w:_finish() end
  end
end

-- ---- gitCheckout ------------------------------------------------------------------

local git_schemes = { http = true, https = true, git = true, ssh = true, file = true,
  ["git+ssh"] = true, ["ssh+git"] = true }

local function invalid_url(url, why)
  errors.raise("INVALID_GIT_URL", ("invalid git URL %q: %s"):format(url, why), { repoUrl = url })
end

-- Accepts scheme://... for the schemes git speaks natively, user@host:path
-- (scp-like ssh) and absolute paths; returns the repository's name.
local function check_git_url(url)
  if url:find("[%c%s]") then invalid_url(url, "contains whitespace or control characters") end
  if url:sub(1, 1) == "-" then invalid_url(url, "starts with '-'") end
  local scheme, rest = url:match("^([%a][%w+.-]*)://(.*)$")
  if scheme then
    if not git_schemes[scheme:lower()] then invalid_url(url, "unsupported scheme " .. scheme) end
    if scheme:lower() ~= "file" and not rest:match("^[^/]+") then invalid_url(url, "no host") end
    if not rest:find("[^/]") then invalid_url(url, "no repository path") end
  elseif not (url:match("^[%w._-]+@[%w._-]+:.") or url:sub(1, 1) == "/") then
    invalid_url(url, "expected scheme://host/path, user@host:path or an absolute path")
  end
  local name = url:gsub("[/\\]+$", ""):gsub("%.git$", ""):match("([^/:]+)$")
  if not name or name == "." or name == ".." then invalid_url(url, "no repository name in it") end
  return name
end
M.check_git_url = check_git_url

-- Map git clone's stderr to an error code.
local function git_error_code(stderr)
  local s = stderr:lower()
  local function has(...)
    for i = 1, select("#", ...) do
      if s:find((select(i, ...))) then return true end
    end
    return false
  end
  if has("remote branch .- not found", "couldn't find remote ref", "could not find remote branch") then
    return "GIT_BRANCH_NOT_FOUND"
  elseif has("authentication failed", "could not read username", "could not read password",
      "permission denied %(publickey", "terminal prompts disabled", "returned error: 401",
      "returned error: 403", "access denied", "invalid username or password", "host key verification failed") then
    return "GIT_AUTH_FAILED"
  elseif has("repository not found", "does not appear to be a git repository", "returned error: 404",
      "repository '.-' does not exist", "not a git repository", "no such repository") then
    return "GIT_REPOSITORY_NOT_FOUND"
  elseif has("could not resolve host", "could not resolve hostname", "failed to connect", "connection refused",
      "connection timed out", "network is unreachable", "no route to host", "operation timed out",
      "connection reset", "unable to access", "ssl", "tls", "early eof", "remote end hung up",
      "name or service not known", "temporary failure in name resolution") then
    return "GIT_NETWORK_ERROR"
  elseif has("unsupported protocol", "remote helper", "is not a git command", "invalid url",
      "malformed", "transport .- not allowed") then
    return "INVALID_GIT_URL"
  end
  return "GIT_CLONE_FAILED"
end
M.git_error_code = git_error_code

local git_options = { branch = true, targetDir = true, depth = true, timeout = true }
local git_env = { GIT_TERMINAL_PROMPT = "0", LC_ALL = "C", LANGUAGE = false }

local function trim(s) return (s:gsub("^%s+", ""):gsub("%s+$", "")) end

-- The repository path of a local URL (file:///x or /x), else nil.
local function local_repo_path(url)
  local path = url:match("^[Ff][Ii][Ll][Ee]://(/.*)$") or (url:sub(1, 1) == "/" and url) or nil
  return path and util.normalize(path)
end

-- Under namespaces a local repository the caller names may exist only on
-- the host (the Lua caller is trusted, the sandbox's commands are not):
-- true when the path is missing inside the sandbox but present outside.
local function host_only_repo(sb, url)
  local path = sb.init and local_repo_path(url)
  if not path then return false end
  return not sb:_dir_exists(path) and util.is_dir(path)
end

-- git (or another program, argv[1]) on the host; -> {exitCode, stderr, timedOut}
local function host_git(argv, timeout_ms)
  local env = { PATH = "/usr/local/bin:/usr/bin:/bin", HOME = os.getenv("HOME") or "/", GIT_TERMINAL_PROMPT = "0",
    LC_ALL = "C" }
  local err_parts, timed_out = {}, false
  local proc, pipes, code
  local result = async.await(function(resume)
    local done = 0
    local exit_code
    local function finish() done = done + 1 if done == 2 then resume(exit_code) end end
    proc, pipes, code = core.spawn { args = argv, file = argv[1], env = env, setsid = true, pdeathsig = "SIGKILL",
      stdio = { [0] = "null", [1] = "null", [2] = "pipe" },
      on_exit = function(c) exit_code = c finish() end }
    if not proc then return resume(nil) end
    pipes[2]:read_start(function(_, data)
      if data then err_parts[#err_parts + 1] = data else pipes[2]:close() finish() end
    end)
    if timeout_ms then
      local t = core.timer()
      t:start(timeout_ms, 0, function() t:close() timed_out = true core.kill(-proc:pid(), "SIGKILL") end)
      local prev = finish
      finish = function() if done == 1 and not t:is_closing() then t:close() end prev() end
    end
  end, "gitCheckout")
  if not proc then return { exitCode = 127, stderr = tostring(pipes) .. " (" .. tostring(code) .. ")" } end
  return { exitCode = result or 1, stderr = table.concat(err_parts), timedOut = timed_out }
end

-- gitCheckout(repoUrl, {branch, targetDir, depth, timeout}) ->
-- {success, repoUrl, branch, targetDir, timestamp}: git clone, run by the
-- session (its env, its cwd) as an argv without a shell.
function Session:gitCheckout(repo_url, opts)
  self:_check_live()
  if type(repo_url) ~= "string" then V.fail("repoUrl", "expected a string, got " .. type(repo_url)) end
  if not repo_url:find("%S") then V.fail("repoUrl", "repository URL is empty") end
  opts = require("moonbox.lib.seed_options").adapt(opts, require("moonbox.lib.seed_options").gitCheckout, "gitCheckout")
  opts = V.options(opts, git_options, "gitCheckout options")
  local branch = V.type(opts.branch, "string", "branch", true)
  if branch and (branch == "" or branch:find("[%c%s]") or branch:sub(1, 1) == "-") then
    V.fail("branch", ("invalid branch name %q"):format(branch))
  end
  local depth = opts.depth
  if depth ~= nil and (type(depth) ~= "number" or depth < 1 or depth % 1 ~= 0) then
    V.fail("depth", "expected an integer >= 1")
  end
  V.timeout(opts.timeout, "timeout")
  if opts.targetDir ~= nil then V.path(opts.targetDir, "targetDir") end
  local url = trim(repo_url)
  local name = check_git_url(url)
  -- a local path or file:// URL clones a repository of the runtime's own
  -- filesystem: only where the policy allows it (git.allowLocal; off in
  -- moonbox serve, where the URL comes from a tenant)
  local git_policy = self.sandbox.policy.git
  if local_repo_path(url) and not (type(git_policy) == "table" and git_policy.allowLocal == true) then
    errors.raise("POLICY_DENIED", ("git clone %s: local repositories (a path or file:// URL) are not allowed " ..
      "by the policy (git = {allowLocal = true} allows them)"):format(url),
      { repoUrl = repo_url, policy = "git.allowLocal" })
  end
  local timestamp = util.timestamp()
  local t, existed = queued(self, function()
    local dest = target(self, "gitCheckout", opts.targetDir or ("/workspace/" .. name))
    if dest.rel == "." then fail("gitCheckout", dest.view, "EEXIST: the sandbox root", "EEXIST") end
    -- the destination, or what exists of it, must resolve inside the root
    local st, msg, code = afs.stat_beneath(root_of(self.sandbox), dest.rel)
    if not st and code ~= "ENOENT" then fail("gitCheckout", dest.view, msg, code) end
    return dest, st ~= nil
  end)
  local argv = { "git", "clone" }
  if depth then argv[#argv + 1] = "--depth" argv[#argv + 1] = tostring(depth) end
  if branch then argv[#argv + 1] = "--branch" argv[#argv + 1] = branch end
  argv[#argv + 1] = "--"
  argv[#argv + 1] = url
  argv[#argv + 1] = t.host
  local r
  local sb = self.sandbox
  local host_only = host_only_repo(sb, url)
  if host_only and t.rel ~= "workspace" and t.rel:sub(1, 10) ~= "workspace/" then
    -- the rename below moves a host directory into the workspace's host
    -- directory; the sandbox's private /tmp or /root lie in its own tmpfs
    errors.raise("GIT_CLONE_FAILED", ("git clone %s: a repository only the host has can be checked out into " ..
      "/workspace only, not %s"):format(url, t.view), { repoUrl = repo_url, targetDir = t.view })
  end
  if host_only then
    -- clone next to the workspace on the host (not inside it, where the
    -- sandbox could plant a symlink), then move it in with a confined rename
    sb.clone_seq = (sb.clone_seq or 0) + 1
    local tmp = (".clone-%d"):format(sb.clone_seq)
    -- a leftover (or, below, a failed clone) is removed on the thread pool:
    -- a whole repository is too much to walk on the loop
    fs.remove_tree(sb.root, tmp)
    assert(core.mkdir(sb.root .. "/" .. tmp, 448))
    argv[#argv] = sb.root .. "/" .. tmp .. "/repo"
    r = host_git(argv, opts.timeout)
    local creds = sb:_fs_creds()
    if r.exitCode == 0 and not r.timedOut and creds then
      -- the sandbox's root owns what it gets; the clone lies in a directory
      -- only the runtime reaches, where a plain chown -R cannot be raced
      local c = host_git({ "chown", "-R", "-h", "--", ("%d:%d"):format(creds.uid, creds.gid),
        sb.root .. "/" .. tmp .. "/repo" })
      if c.exitCode ~= 0 then
        r = { exitCode = 128, stderr = "fatal: cannot give the clone to the sandbox's user: " .. c.stderr }
      end
    end
    if r.exitCode == 0 and not r.timedOut then
      -- leading directories, as git clone would make them: confined like
      -- mkdir (the sandbox's mounts, its credentials)
      local parent = ""
      for part in t.rel:gmatch("[^/]+/") do
        parent = parent .. part
        pcall(afs.mkdir_beneath, root_of(sb), parent:sub(1, -2), 493)
      end
      local ok, done, msg, code = pcall(afs.rename_beneath, sb.root, tmp .. "/repo", t.rel)
      if not ok or not done then
        local exists = code == "ENOTEMPTY" or code == "EEXIST" or code == "ENOTDIR"
        r = { exitCode = 128, stderr = exists and
          ("fatal: destination path '%s' already exists and is not an empty directory.\n"):format(t.view)
          or ("fatal: %s\n"):format(tostring(ok and msg or done)) }
      end
    end
    fs.remove_tree(sb.root, tmp)
  else
    r = self:exec(argv, { timeout = opts.timeout, env = git_env })
  end
  local context = { repoUrl = repo_url, branch = branch, targetDir = t.view, exitCode = r.exitCode,
    stderr = r.stderr }
  if r.timedOut then
    context.timedOut = true
    if not existed then self:exec({ "rm", "-rf", "--", t.host }) end
    errors.raise("GIT_CLONE_FAILED", ("git clone %s timed out after %s ms"):format(url, tostring(opts.timeout)),
      context)
  end
  if r.exitCode ~= 0 then
    local code = git_error_code(r.stderr)
    local detail = r.stderr:match("fatal: ([^\n]+)") or trim(r.stderr)
    errors.raise(code, ("git clone %s: %s"):format(url, detail), context)
  end
  local head = self:exec({ "git", "-C", t.host, "symbolic-ref", "--short", "-q", "HEAD" }, { env = git_env })
  local checked_out = head.exitCode == 0 and trim(head.stdout) or ""
  if checked_out == "" then
    head = self:exec({ "git", "-C", t.host, "rev-parse", "--abbrev-ref", "HEAD" }, { env = git_env })
    checked_out = trim(head.stdout)
    if checked_out == "HEAD" or checked_out == "" then checked_out = branch or "HEAD" end
  end
  return { success = true, repoUrl = repo_url, branch = checked_out, targetDir = t.view, timestamp = timestamp }
end

-- A part of Session (lib/compose.lua): the file calls, watch and
-- gitCheckout; a session's watches end with it.
function M.install(class, hooks)
  compose.methods(class, Session, "files")
  compose.add(hooks, "session_end", end_watches)
end

return M
