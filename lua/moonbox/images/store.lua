-- The image store under <home>/images (docs/images.md "Store layout"):
--   blobs/sha256/<hex>   manifests, configs and layer blobs, by digest
--   layers/<hex>[-U-G]/  a layer blob unpacked once (named by its blob digest;
--                        -U-G: its owners shifted to a sandbox id range)
--   refs.json            name -> image record {digest, layers, config, ...}
--   tmp/                 work in progress, renamed into place when whole
--   lock                 one pull or remove at a time (flock)
-- Everything is 0700: layers hold files of any owner and mode (setuid
-- included) that only sandboxes may see.
local cjson = require "cjson.safe"
local core = require "moonbox.core"
local async = require "moonbox.async"
local errors = require "moonbox.errors"
local fs = require "moonbox.lib.fs"
local util = require "moonbox.lib.util"

local M = {}

M.DIR = nil -- tests and embedders may set it; else <home>/images
M.LOCK_WAIT_MS = 60000

function M.dir()
  if M.DIR then return M.DIR end
  return require("moonbox.files.backup").home() .. "/images"
end

local function mkdir_p(path)
  if util.is_dir(path) then return true end
  local parent = path:match("^(.*)/[^/]+$")
  if parent and parent ~= "" then mkdir_p(parent) end
  local ok, msg, code = core.mkdir(path, 448)
  if not ok and code ~= "EEXIST" then
    errors.raise("FILESYSTEM_ERROR", "image store: " .. tostring(msg), { errno = code, path = path })
  end
  return true
end

-- The store's directories, made on first use.
function M.open()
  local dir = M.dir()
  for _, sub in ipairs { "", "/blobs/sha256", "/layers", "/tmp" } do mkdir_p(dir .. sub) end
  return dir
end

function M.blob_path(hex) return M.dir() .. "/blobs/sha256/" .. hex end
-- owner = {uid, gid, count}: the layer's owners shifted into that id range
-- (a root runtime's sandboxes, sandbox/isolation.lua idmap), one directory
-- per range; nil: owned by the runtime, as unpacked unprivileged.
function M.layer_name(hex, owner)
  if not owner then return hex end
  return ("%s-%d-%d"):format(hex, owner.uid, owner.gid)
end
function M.layer_path(hex, owner) return M.dir() .. "/layers/" .. M.layer_name(hex, owner) end

-- A fresh directory under tmp/ (removed by the caller, or by the next
-- pull's sweep when a runtime died mid-pull).
function M.tmp_dir()
  local path = M.open() .. "/tmp/" .. util.random_hex(8)
  local ok, msg, code = core.mkdir(path, 448)
  if not ok then errors.raise("FILESYSTEM_ERROR", "image store: " .. tostring(msg), { errno = code }) end
  return path
end

function M.remove(path)
  local parent, name = path:match("^(.*)/([^/]+)$")
  if not util.is_dir(path) and not util.is_file(path) then return end
  local ok, msg, code = fs.remove_tree(parent, name, "beneath")
  if not ok and code ~= "ENOENT" then
    errors.raise("FILESYSTEM_ERROR", "image store: cannot remove " .. path .. ": " .. tostring(msg), { errno = code })
  end
end

-- with_lock(fn): fn runs holding the store's lock (waits for another
-- runtime's pull up to LOCK_WAIT_MS); one holder per runtime at a time too.
local holder = nil
function M.with_lock(fn)
  local dir = M.open()
  local waited = 0
  local fd, msg, code
  while true do
    if not holder then
      fd, msg, code = fs.lock(dir .. "/lock", tostring(core.getpid()))
      if fd then break end
      if code ~= "EAGAIN" then
        errors.raise("FILESYSTEM_ERROR", "image store: cannot lock: " .. tostring(msg), { errno = code })
      end
    end
    if waited >= M.LOCK_WAIT_MS then
      errors.raise("TIMEOUT", "image store: another pull or remove holds " .. dir .. "/lock")
    end
    async.sleep(50)
    waited = waited + 50
  end
  holder = fd
  local ok, err = pcall(fn)
  holder = nil
  core.close_fd(fd)
  if not ok then error(err, 0) end
  return err
end

-- refs.json: {images = {[name] = record}}
function M.read_refs()
  local text = util.read_file(M.dir() .. "/refs.json")
  if not text then return { images = {} } end
  local refs = cjson.decode(text)
  if type(refs) ~= "table" or type(refs.images) ~= "table" then
    errors.raise("FILESYSTEM_ERROR", "image store: refs.json is damaged: " .. M.dir() .. "/refs.json")
  end
  return refs
end

-- Written to a new file and renamed over the old one: a crash leaves the
-- old index or the new, never half of one.
function M.write_refs(refs)
  local path = M.open() .. "/refs.json"
  local tmp = path .. ".new"
  os.remove(tmp)
  local text = cjson.encode(refs)
  local ok, msg, code = fs.write_file(tmp, text, 384)
  if not ok then errors.raise("FILESYSTEM_ERROR", "image store: " .. tostring(msg), { errno = code }) end
  local rok, rmsg, rcode = fs.rename(tmp, path)
  if not rok then errors.raise("FILESYSTEM_ERROR", "image store: " .. tostring(rmsg), { errno = rcode }) end
end

return M
