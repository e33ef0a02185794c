-- Backups (issue #16, API.md Amendments): squashfs archives of a directory
-- of a sandbox, made and unpacked by Debian's squashfs-tools (mksquashfs,
-- unsquashfs) run INSIDE the sandbox, as its own commands, so they see only
-- what the sandbox sees and the files they restore belong to the sandbox.
--
--   sandbox:createBackup{dir, name?, excludes?, gitignore?, ttl?, compression?} -> {id, dir, ...}
--   sandbox:restoreBackup(backup | id) -> {success, dir, id}
--   moonbox.listBackups() -> array; moonbox.deleteBackup(id) -> {success, id}
--
-- Stored backups live under the runtime's home: <home>/backups/<id>.sqsh
-- and <id>.json (metadata). The archive moves between the sandbox and the
-- home through a file in the sandbox's /workspace, opened confined beneath
-- the sandbox's root (openat2 RESOLVE_BENEATH, O_EXCL on create), never by
-- a host path the sandbox could redirect. M.archive / M.extract (an archive
-- at a path in the sandbox) also serve the seed's /api/backup routes.
local cjson = require "cjson.safe"
local core = require "moonbox.core"
local errors = require "moonbox.errors"
local fs = require "moonbox.lib.fs"
local util = require "moonbox.lib.util"
local V = require "moonbox.lib.validate"
local compose = require "moonbox.lib.compose"
local root_of = require("moonbox.files.paths").root_of
local Sandbox = {} -- this part's methods, installed by sandbox/init.lua (M.install)
local sandbox_mod -- moonbox.sandbox, given to M.install

local M = {}

M.DEFAULT_TTL = 3 * 24 * 3600 -- seconds, as the seed
M.COMPRESSIONS = { gzip = true, lz4 = true, zstd = true, xz = true, lzo = true }
M.DEFAULT_COMPRESSION = "zstd"
M.COPY_CHUNK = 1024 * 1024

-- The runtime's home (getSandbox's default, $MOONBOX_HOME first).
function M.home()
  local home = os.getenv("MOONBOX_HOME")
  if home and home ~= "" then return home end
  local xdg = os.getenv("XDG_DATA_HOME")
  if xdg and xdg ~= "" then return xdg .. "/moonbox" end
  return (os.getenv("HOME") or "/root") .. "/.local/share/moonbox"
end

-- Where backups are stored: M.DIR when set, else <home>/backups.
M.DIR = nil
local function dir_of_backups() return M.DIR or (M.home() .. "/backups") end
M.dir = dir_of_backups

local function random_id() return util.random_hex(8) end

local function check(code, ok, msg, errcode, context)
  if ok == nil or ok == false then
    context = context or {}
    context.errno = errcode
    errors.raise(code, tostring(msg), context)
  end
  return ok
end

-- A command of the sandbox's, without a shell; its stderr on failure.
local function run(session, argv, code, what)
  local r = session:exec(argv)
  if r.exitCode ~= 0 then
    local err = (r.stderr ~= "" and r.stderr or r.stdout):gsub("%s+$", "")
    errors.raise(code, ("%s failed (exit %d): %s"):format(what, r.exitCode, err:sub(-2000)),
      { exitCode = r.exitCode, command = argv[1] })
  end
  return r
end

local function check_dir(dir, field)
  V.path(dir, field)
  if dir:sub(1, 1) ~= "/" then V.fail(field, "must be an absolute path") end
  return dir
end

local function check_list(list, field)
  if list == nil then return {} end
  if type(list) ~= "table" then V.fail(field, "expected an array of strings") end
  for i, v in ipairs(list) do V.type(v, "string", ("%s[%d]"):format(field, i)) end
  return list
end

-- A path of the sandbox's view as its commands name it (the same under
-- namespaces; the host's path under isolation "none").
local function cmd_path(session, view)
  return session.sandbox:host_path(view, session.cwd)
end

-- gitignore: what git ignores under dir (its .gitignore files, the repo's
-- info/exclude, the global excludes), as paths relative to dir escaped for
-- mksquashfs's wildcards; an ignored directory comes as one entry. Not a
-- git work tree: nothing. (Run inside the sandbox, as mksquashfs is.)
local function git_ignored(session, dir)
  local r = session:exec { "git", "-c", "safe.directory=*", "-C", cmd_path(session, dir), "ls-files", "-z",
    "--others", "--ignored", "--exclude-standard", "--directory" }
  if r.exitCode ~= 0 then
    if r.stderr:find("not a git repository", 1, true) then return {} end
    errors.raise("BACKUP_CREATE_FAILED", ("gitignore: git ls-files failed (exit %d): %s")
      :format(r.exitCode, r.stderr:gsub("%s+$", ""):sub(-2000)), { exitCode = r.exitCode, command = "git" })
  end
  local out = {}
  for path in r.stdout:gmatch("([^%z]+)%z") do
    out[#out + 1] = path:gsub("/$", ""):gsub("[%*%?%[%]\\]", "\\%0")
  end
  return out
end

-- A glob with globstars as mksquashfs's wildcards take it (the seed
-- normalizes them too): "**/x" is "... x" (any depth), and "x/**" is x
-- itself (a directory excluded takes its content along).
local function mksquashfs_pattern(glob)
  local any = false
  while glob:sub(1, 3) == "**/" do glob, any = glob:sub(4), true end
  while glob:sub(-3) == "/**" do glob = glob:sub(1, -4) end
  return any and ("... " .. glob) or glob
end
M.mksquashfs_pattern = mksquashfs_pattern

-- archive(session, dir, archive, {excludes?, compression?, gitignore?})
--   -> {sizeBytes, archivePath}: mksquashfs of dir (a path in the sandbox)
-- into archive (a path in the sandbox), in the sandbox.
function M.archive(session, dir, archive, opts)
  opts = opts or {}
  check_dir(dir, "dir")
  check_dir(archive, "archivePath")
  local excludes = check_list(opts.excludes, "excludes")
  local comp = opts.compression or M.DEFAULT_COMPRESSION
  if not M.COMPRESSIONS[comp] then
    errors.raise("INVALID_BACKUP_CONFIG",
      ("compression %q: expected gzip, lz4, zstd, xz or lzo"):format(tostring(comp)), { compression = comp })
  end
  local argv = { "mksquashfs", cmd_path(session, dir), cmd_path(session, archive), "-noappend", "-no-progress",
    "-quiet", "-comp", comp, "-wildcards" }
  -- the archive itself, when it is written inside dir
  local prefix = dir:gsub("/+$", "") .. "/"
  if archive:sub(1, #prefix) == prefix then
    argv[#argv + 1] = "-e"
    argv[#argv + 1] = archive:sub(#prefix + 1)
  end
  local ignored = opts.gitignore and git_ignored(session, dir) or {}
  if #excludes + #ignored > 0 then
    argv[#argv + 1] = "-e"
    for _, e in ipairs(excludes) do argv[#argv + 1] = mksquashfs_pattern(e) end
    for _, e in ipairs(ignored) do argv[#argv + 1] = e end
  end
  run(session, argv, "BACKUP_CREATE_FAILED", "mksquashfs")
  local size = run(session, { "stat", "-c", "%s", cmd_path(session, archive) }, "BACKUP_CREATE_FAILED", "stat").stdout
  return { sizeBytes = tonumber(size), archivePath = archive }
end

-- extract(session, archive, dir): dir's content becomes the archive's (what
-- was in dir is removed first; dir is made if missing). keep: a name in
-- dir to leave alone (the archive itself). cleared: dir's old content is
-- already gone (restoreBackup moved it aside).
function M.extract(session, archive, dir, keep, cleared)
  check_dir(dir, "dir")
  check_dir(archive, "archivePath")
  local st = session:exists(archive)
  if not st.exists then
    errors.raise("BACKUP_NOT_FOUND", ("no archive at %s"):format(archive), { archivePath = archive })
  end
  if not cleared and session:exists(dir).exists then
    local argv = { "find", cmd_path(session, dir), "-mindepth", "1", "-maxdepth", "1" }
    if keep then
      argv[#argv + 1] = "!"
      argv[#argv + 1] = "-name"
      argv[#argv + 1] = keep
    end
    for _, a in ipairs { "-exec", "rm", "-rf", "--", "{}", "+" } do argv[#argv + 1] = a end
    run(session, argv, "BACKUP_RESTORE_FAILED", "clearing " .. dir)
  end
  run(session, { "unsquashfs", "-f", "-no-progress", "-quiet", "-d", cmd_path(session, dir),
    cmd_path(session, archive) }, "BACKUP_RESTORE_FAILED", "unsquashfs")
  return { success = true, dir = dir }
end

-- ---- the home's store ---------------------------------------------------------------

-- Copy src (an open fd) to dst (an open fd), in chunks, on the thread pool;
-- at most limit bytes (src's size when it was checked: a file the sandbox
-- keeps growing is not followed).
local function copy_fd(src, dst, code, limit)
  local offset = 0
  while true do
    if limit and offset >= limit then return offset end
    local want = limit and math.min(M.COPY_CHUNK, limit - offset) or M.COPY_CHUNK
    local data = check(code, fs.read(src, want, offset))
    if data == "" then return offset end
    check(code, fs.write_all(dst, data, offset))
    offset = offset + #data
  end
end

-- The path of a view path of the sandbox relative to its fs root.
local function rel_of(sb, view)
  local host = sb:host_path(view)
  if sb.init then return (host:gsub("^/+", "")) end -- fs_root is the sandbox's own root
  local root = sb.fs_root:gsub("/+$", "")
  if host:sub(1, #root + 1) ~= root .. "/" then
    errors.raise("INTERNAL_ERROR", ("%s is not under the sandbox's root"):format(view), { path = view })
  end
  return host:sub(#root + 2)
end

local function meta_path(id) return dir_of_backups() .. "/" .. id .. ".json" end
local function archive_path(id) return dir_of_backups() .. "/" .. id .. ".sqsh" end

local function check_id(id) return V.backup_id(id, "id") end

local function remove(id)
  fs.unlink(archive_path(id))
  fs.unlink(meta_path(id))
end

-- The metadata of backup id; nil when there is none. An expired backup is
-- removed and reported (expired = true).
local function load(id)
  local text = fs.read_file(meta_path(id))
  if not text then return nil end
  local meta = cjson.decode(text)
  if type(meta) ~= "table" then return nil end
  if meta.expiresAtMs and core.time() * 1000 >= meta.expiresAtMs then
    remove(id)
    return nil, true
  end
  return meta
end

local function public(meta)
  return { id = meta.id, dir = meta.dir, name = meta.name, sandboxId = meta.sandboxId, sizeBytes = meta.sizeBytes,
    compression = meta.compression, createdAt = meta.createdAt, expiresAt = meta.expiresAt }
end

local create_options = { dir = true, name = true, excludes = true, gitignore = true, ttl = true, compression = true }

-- sandbox:createBackup{dir, name?, excludes?, gitignore?, ttl?, compression?}
function Sandbox:createBackup(opts)
  opts = V.options(opts, create_options, "createBackup options")
  local dir = check_dir(opts.dir, "dir")
  V.type(opts.name, "string", "name", true)
  -- (as the seed's: at most 256 characters, no control characters)
  if opts.name and (#opts.name > 256 or opts.name:find("%c")) then
    V.fail("name", "expected at most 256 characters, none of them a control character")
  end
  local ttl = opts.ttl == nil and M.DEFAULT_TTL or opts.ttl
  if type(ttl) ~= "number" or ttl <= 0 or ttl ~= ttl then V.fail("ttl", "expected a number of seconds > 0") end
  V.type(opts.gitignore, "boolean", "gitignore", true)
  local s = self:getSession("default")
  -- (the caller's mistake, before mksquashfs would fail on it as ours)
  if not s:exists(dir).exists then
    errors.raise("FILE_NOT_FOUND", ("createBackup: %s does not exist"):format(dir), { path = dir })
  end
  if s:exec({ "test", "-d", cmd_path(s, dir) }).exitCode ~= 0 then
    errors.raise("NOT_DIRECTORY", ("createBackup: %s is not a directory"):format(dir), { path = dir })
  end
  local id = random_id()
  check("FILESYSTEM_ERROR", sandbox_mod.mkdir_p(dir_of_backups()))
  local tmp = "/workspace/.moonbox-backup-" .. id .. ".sqsh"
  local ok, err = pcall(function()
    local made = M.archive(s, dir, tmp, { excludes = opts.excludes, compression = opts.compression,
      gitignore = opts.gitignore })
    -- out of the sandbox, as the file API reads: confined to its mounts,
    -- with its root's credentials (never the runtime's: mksquashfs and the
    -- name are the sandbox's to replace, with a link to what only host root
    -- may read), a fifo or device refused without blocking, a sparse file
    -- (a few blocks posing as terabytes for the host's disk) refused
    local src = check("BACKUP_CREATE_FAILED", fs.open_beneath(root_of(self), rel_of(self, tmp), "r"))
    local st, smsg, scode = fs.fstat(src)
    local why = not st and smsg or st.type ~= "file" and "it is not a regular file"
      or (st.blocks or 0) * 512 * 2 + 65536 < st.size and "it is sparse, not what mksquashfs writes"
    if why then
      fs.close(src)
      errors.raise("BACKUP_CREATE_FAILED", ("the archive %s cannot be taken out of the sandbox: %s"):format(tmp, why),
        { id = id, errno = scode })
    end
    local part = archive_path(id) .. ".part"
    local dst, msg, code = fs.open(part, "wx", 384)
    if not dst then
      fs.close(src)
      check("BACKUP_CREATE_FAILED", nil, msg, code)
    end
    local copied = pcall(copy_fd, src, dst, "BACKUP_CREATE_FAILED", st.size)
    fs.close(src)
    check("BACKUP_CREATE_FAILED", fs.close(dst))
    if not copied then
      fs.unlink(part)
      errors.raise("BACKUP_CREATE_FAILED", "copying the archive out of the sandbox failed", { id = id })
    end
    check("BACKUP_CREATE_FAILED", fs.rename(part, archive_path(id)))
    local now = core.time() * 1000 -- wall clock: expiry outlives the runtime
    local meta = { id = id, dir = dir, name = opts.name, sandboxId = self.id, sizeBytes = made.sizeBytes,
      compression = opts.compression or M.DEFAULT_COMPRESSION, createdAt = util.timestamp(),
      expiresAtMs = now + ttl * 1000, expiresAt = util.timestamp((now + ttl * 1000) / 1000) }
    check("BACKUP_CREATE_FAILED", fs.write_file(meta_path(id), cjson.encode(meta), 384))
    return meta
  end)
  pcall(s.deleteFile, s, tmp)
  if not ok then
    remove(id)
    error(err, 0)
  end
  return public(err)
end

-- Restoring over the workspace: its old content is first moved aside on the
-- host (renames beneath the sandbox's root directory, RESOLVE_BENEATH: a
-- symlink is moved itself, never followed) into a directory next to the
-- workspace, outside the sandbox's view, and removed on the thread pool
-- after the unsquashfs, without the restore waiting for it
-- (Sandbox:remove_later; destroy waits for it). Clearing 100 MB of files in the sandbox (find -exec rm) took longer
-- than the unsquashfs itself. Not when the policy mounts something at or
-- under /workspace: the old way (rm inside the sandbox) then.
local function move_aside(sb, dir, keep)
  if dir:gsub("/+$", "") ~= "/workspace" then return nil end
  for _, m in ipairs(sb.policy.mounts or {}) do
    local dst = type(m) == "table" and type(m.dst) == "string" and m.dst:gsub("/+$", "") or ""
    if dst == "" or dst == "/workspace" or dst:sub(1, 11) == "/workspace/" then return nil end
  end
  local root = sb.root_canon
  local st = fs.lstat_beneath(root, "workspace", "beneath")
  if not (st and st.type == "directory") then return nil end
  local aside = ".moonbox-old-" .. random_id()
  check("BACKUP_RESTORE_FAILED", fs.mkdir_beneath(root, aside, 448, "beneath"))
  local entries = fs.scandir_beneath(root, "workspace", "beneath")
  local ok, err = pcall(function()
    for _, e in ipairs(check("BACKUP_RESTORE_FAILED", entries)) do
      if e.name ~= keep then
        check("BACKUP_RESTORE_FAILED",
          fs.rename_beneath(root, "workspace/" .. e.name, aside .. "/" .. e.name, "beneath"))
      end
    end
  end)
  if not ok then
    sb:remove_later(aside)
    error(err, 0)
  end
  return aside
end

-- sandbox:restoreBackup(backup | id) -> {success, dir, id}: the backup's dir
-- in this sandbox becomes the backup's content.
function Sandbox:restoreBackup(backup)
  local id = check_id(type(backup) == "table" and backup.id or backup)
  local meta, expired = load(id)
  if expired then errors.raise("BACKUP_EXPIRED", ("backup %s has expired"):format(id), { id = id }) end
  if not meta then errors.raise("BACKUP_NOT_FOUND", ("backup %s does not exist"):format(id), { id = id }) end
  local dir = meta.dir
  if type(backup) == "table" and backup.dir ~= nil then dir = check_dir(backup.dir, "dir") end
  local s = self:getSession("default")
  local name = ".moonbox-restore-" .. random_id() .. ".sqsh"
  local tmp = "/workspace/" .. name
  local ok, err = pcall(function()
    local src = check("BACKUP_RESTORE_FAILED", fs.open(archive_path(id), "r"))
    -- into the sandbox, confined, a new file (O_EXCL: never through a name it
    -- made), made with its root's credentials: the sandbox's root owns it
    local dst, msg, code = fs.open_beneath(root_of(self), rel_of(self, tmp), "wx", 420)
    if not dst then
      fs.close(src)
      check("BACKUP_RESTORE_FAILED", nil, msg, code)
    end
    local copied, cerr = pcall(copy_fd, src, dst, "BACKUP_RESTORE_FAILED")
    fs.close(src)
    check("BACKUP_RESTORE_FAILED", fs.close(dst))
    if not copied then error(cerr, 0) end
    local keep = dir:gsub("/+$", "") == "/workspace" and name or nil
    local aside = move_aside(self, dir, name)
    local extracted, xerr = pcall(M.extract, s, tmp, dir, keep, aside ~= nil)
    if aside then self:remove_later(aside) end
    if not extracted then error(xerr, 0) end
  end)
  pcall(s.deleteFile, s, tmp)
  if not ok then error(err, 0) end
  return { success = true, dir = dir, id = id }
end

-- listBackups() -> array of backups (expired ones are removed on the way)
function M.listBackups()
  local list = {}
  for _, e in ipairs(fs.scandir(dir_of_backups()) or {}) do
    local id = e.name:match("^(%x+)%.json$")
    if id then
      local meta = load(id)
      if meta then list[#list + 1] = public(meta) end
    end
  end
  table.sort(list, function(a, b) return a.createdAt < b.createdAt or (a.createdAt == b.createdAt and a.id < b.id) end)
  return list
end

-- getSandbox(id, {from = backup | backupId, ...}) (moonbox.getSandbox with
-- from): a new sandbox whose files at the backup's dir (its workspace, for a
-- backup of /workspace) are the backup's content: a fork. The other options
-- are getSandbox's. A sandbox already live under id is refused (from makes
-- a new one); a failed restore takes the new sandbox back.
function M.getSandbox(id, opts)
  if type(opts) ~= "table" or opts.from == nil then return sandbox_mod.getSandbox(id, opts) end
  local from = opts.from
  local bid = check_id(type(from) == "table" and from.id or from)
  local meta, expired = load(bid)
  if expired then errors.raise("BACKUP_EXPIRED", ("backup %s has expired"):format(bid), { id = bid }) end
  if not meta then errors.raise("BACKUP_NOT_FOUND", ("backup %s does not exist"):format(bid), { id = bid }) end
  if type(id) == "string" and sandbox_mod.all()[id] then
    V.fail("from", ("sandbox %q already exists: from starts a new sandbox (to restore into it: " ..
      "sandbox:restoreBackup, over HTTP POST /v1/sandboxes/%s/backups/restore)"):format(id, id))
  end
  local rest = {}
  for k, v in pairs(opts) do if k ~= "from" then rest[k] = v end end
  local sb = sandbox_mod.getSandbox(id, rest)
  local ok, err = pcall(sb.restoreBackup, sb, bid)
  if not ok then
    pcall(sb.destroy, sb)
    error(err, 0)
  end
  return sb
end

-- deleteBackup(id) -> {success, id}
function M.deleteBackup(id)
  id = check_id(type(id) == "table" and id.id or id)
  if not fs.stat(meta_path(id)) then
    errors.raise("BACKUP_NOT_FOUND", ("backup %s does not exist"):format(id), { id = id })
  end
  remove(id)
  return { success = true, id = id }
end

-- A part of Sandbox (lib/compose.lua): createBackup, restoreBackup; owner is
-- moonbox.sandbox (getSandbox, all, mkdir_p).
function M.install(class, _, owner)
  compose.methods(class, Sandbox, "backup")
  sandbox_mod = owner
end

return M
