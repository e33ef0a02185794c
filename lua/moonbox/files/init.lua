-- Files API (API.md "Files"): the file calls of an ExecutionSession (a part
-- of Session, lib/compose.lua; watch and gitCheckout are files/watch.lua and
-- files/git.lua, the paths files/paths.lua).
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
local fs = require "moonbox.lib.fs"
-- the sandbox file API makes its confined calls on the thread pool: a task
-- making many of them never holds the loop (issue #14)
local afs = fs.awaited
local util = require "moonbox.lib.util"
local V = require "moonbox.lib.validate"
local compose = require "moonbox.lib.compose"
local Session = {} -- this part's methods, installed by session/init.lua (M.install)

local M = {}

M.STREAM_CHUNK = 64 * 1024      -- readFileStream's read size

local paths = require "moonbox.files.paths"
local fail, check, join, basename, view_of, root_of, target, queued = paths.fail, paths.check,
  paths.join, paths.basename, paths.view_of, paths.root_of, paths.target, paths.queued
M.code_for_errno = paths.code_for_errno

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
  return self:request(function(cb)
    self.fd = nil -- only once queued: a cancelled task raises before this, and discard still has the fd
    return core.fs_close(fd, cb)
  end)
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

-- Run fn(file) and close the file if it raises. The close is waited for
-- when no request is running (a write that failed with ENOSPC): the error
-- reaches the caller only once the fd is gone, so an unmount right after
-- does not find the mount busy. A request still running (the task was
-- cancelled mid-read) leaves it to discard.
local function using(file, fn)
  local ok, a, b = pcall(fn, file)
  if not ok then
    if not file.inflight and file.fd then pcall(file.close, file) end
    file:discard() -- what the close left (a cancelled task cannot wait)
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
  self:check_live()
  V.path(path)
  V.type(content, "string", "content")
  opts = V.options(opts, write_options, "writeFile options")
  local data = content
  if encoding_option(opts.encoding) == "base64" then
    -- decoded into C memory, written from there: no 100 MB Lua string
    data = core.bytes()
    -- (base64 as `base64` and most encoders print it, in lines, is taken
    -- as atob and Node take it: its ASCII whitespace skipped; only then is
    -- a copy made)
    if not data:base64_decode(content) and not (content:find("[ \t\r\n\f]")
      and data:base64_decode((content:gsub("[ \t\r\n\f]+", "")))) then
      data:free()
      V.fail("content", "invalid base64")
    end
  end
  -- the policy's fileSizeBytes binds the file API as it binds the
  -- sandbox's processes (RLIMIT_FSIZE): nothing of a bigger file is written
  local size_limit = self.sandbox.policy.limits.fileSizeBytes
  local size = type(data) == "string" and #data or data:size()
  if size_limit and size > size_limit then
    if type(data) ~= "string" then data:free() end
    errors.raise("FILE_TOO_LARGE", ("writeFile %s: %d bytes, larger than limits.fileSizeBytes (%d bytes)")
      :format(path, size, size_limit), { path = path, size = size, limit = size_limit })
  end
  local ok, result = pcall(queued, self, function()
    local timestamp = util.timestamp()
    local t = target(self, "writeFile", path)
    local root = root_of(self.sandbox)
    -- made by this call, or there before: a write that fails (NO_SPACE,
    -- a cancel) takes back a file it made, and leaves no part of its own
    local fd, msg, code = fs.open_beneath(root, t.rel, "wx")
    local made = fd ~= nil
    if code == "EEXIST" then fd, msg, code = fs.open_beneath(root, t.rel, "w") end
    check("writeFile", t.view, fd, msg, code)
    local file = setmetatable({ fd = fd, op = "writeFile", view = t.view }, File)
    local wrote, err = pcall(using, file, function() file:write_all(data) end)
    if not wrote then
      if made then pcall(afs.unlink_beneath, root, t.rel) end
      error(err, 0)
    end
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
  self:check_live()
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
  self:check_live()
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
  self:check_live()
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
  self:check_live()
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
  self:check_live()
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
    elseif not ok and code == "ENOENT" and afs.lstat_beneath(root, src.rel) then
      -- the source is there: what is missing is the destination's directory
      check(op, dst.view, ok, msg, code, { newPath = dst.view })
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

-- A directory's O_PATH fd (confined) and its entries (read_dir) -> fd,
-- dirlist; nil when a directory below the listed one went meanwhile; any
-- other failure fails the listing.
local function open_listing(root, sb, dir_rel, top_rel)
  local fd, msg, code = fs.open_beneath(root, dir_rel, O_PATH)
  local dirlist
  if fd then
    local ok, res, rmsg, rcode = pcall(read_dir, fd)
    if not ok then fs.close_dir(fd) error(res, 0) end
    dirlist, msg, code = res, rmsg, rcode
  end
  if not dirlist then
    if fd then fs.close_dir(fd) end
    if dir_rel ~= top_rel and (code == "ENOENT" or code == "ENOTDIR") then return nil end -- changed meanwhile
    msg = msg and msg:gsub(" %(scandir '/proc/self/fd/%d+'%)", "")
    fail("listFiles", view_of(sb, dir_rel), msg, code)
  end
  return fd, dirlist
end

-- The entries of dirlist one by one, taken in batches; past LIST_SLICE_MS
-- of work (listing.slice_start) the loop runs a moment before the next.
local function entries(dirlist, listing)
  local batch, i = {}, 0
  return function()
    i = i + 1
    local e = batch[i]
    if not e then
      if util.now_ms() - listing.slice_start >= LIST_SLICE_MS then
        async.sleep(1) -- a 0 ms timer could run again before any I/O
        listing.slice_start = util.now_ms()
      end
      batch, i = dirlist:next(64), 1
      if not batch then return nil end
      e = batch[1]
    end
    return e
  end
end

-- One entry of the listing, as listFiles returns it.
local function file_record(sb, name, rel, relative, st)
  return {
    name = name, absolutePath = view_of(sb, rel), relativePath = relative,
    type = st.type, size = st.size, modifiedAt = util.timestamp(st.mtime),
    mode = mode_string(st.mode), permissions = permissions(st),
  }
end

-- Add the entries of dir_rel (and, recursive, of its subdirectories) to
-- listing.files, until listing.limit.
local function walk(listing, dir_rel, prefix)
  local sb = listing.sb
  local fd, dirlist = open_listing(listing.root, sb, dir_rel, listing.top_rel)
  if not fd then return end
  local ok, err = pcall(function()
    for e in entries(dirlist, listing) do
      if listing.hidden or e.name:sub(1, 1) ~= "." then
        local rel = join(dir_rel, e.name)
        local st, smsg, scode = afs.lstat_beneath(fd, e.name)
        if st then
          if #listing.files == listing.limit then listing.truncated = true return end
          local relative = prefix == "" and e.name or prefix .. "/" .. e.name
          listing.files[#listing.files + 1] = file_record(sb, e.name, rel, relative, st)
          if listing.recursive and st.type == "directory" then
            -- one directory fd at a time, whatever the depth (a chain of
            -- 2,000 directories held 2,000 of the runtime's fds): this
            -- one is opened again after its subdirectory (its sorted
            -- entries are in memory already); gone meanwhile, it ends here
            fs.close_dir(fd)
            fd = nil
            walk(listing, rel, relative)
            fd = fs.open_beneath(listing.root, dir_rel, O_PATH)
            if not fd or listing.truncated then return end
          end
        elseif scode ~= "ENOENT" then
          fail("listFiles", view_of(sb, rel), smsg, scode)
        end
      end
    end
  end)
  dirlist:close()
  if fd then fs.close_dir(fd) end
  if not ok then error(err, 0) end
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
  self:check_live()
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
    local listing = { root = root_of(self.sandbox), sb = self.sandbox, top_rel = t.rel, files = {},
      truncated = false, limit = limit, hidden = hidden, recursive = recursive, slice_start = util.now_ms() }
    walk(listing, t.rel, "")
    return { success = true, path = t.view, files = listing.files, count = #listing.files,
      truncated = listing.truncated, timestamp = timestamp }
  end)
end

-- exists(path) -> {success, path, exists, timestamp}; a dangling symlink does
-- not exist; a path leading outside the sandbox raises PATH_OUTSIDE_SANDBOX.
function Session:exists(path)
  self:check_live()
  V.path(path)
  return queued(self, function()
    local timestamp = util.timestamp()
    local t = target(self, "exists", path)
    if t.not_there then return { success = true, path = t.view, exists = false, timestamp = timestamp } end
    local st, msg, code = afs.stat_beneath(root_of(self.sandbox), t.rel)
    if not st and code ~= "ENOENT" and code ~= "ENOTDIR" and code ~= "ELOOP" then
      fail("exists", t.view, msg, code)
    end
    return { success = true, path = t.view, exists = st ~= nil, timestamp = timestamp }
  end)
end

-- A part of Session (lib/compose.lua): the file calls.
function M.install(class)
  compose.methods(class, Session, "files")
end

return M
