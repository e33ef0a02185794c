-- Blobs: digests checked, JSON read with a bound, layers unpacked.
local cjson = require "cjson.safe"
local core = require "moonbox.core"
local async = require "moonbox.async"
local errors = require "moonbox.errors"
local store = require "moonbox.images.store"

local M = {}

M.MAX_JSON = 4 * 1024 * 1024 -- a manifest, index or config larger than this is refused
M.MAX_LAYER_BYTES = 32 * 1024 ^ 3 -- the sum of a layer's file sizes
M.MAX_LAYER_ENTRIES = 1000000

local function invalid(message, context) errors.raise("IMAGE_INVALID", message, context) end
M.invalid = invalid

-- "sha256:<64 hex>" -> hex; anything else is refused.
function M.hex_of(digest, what)
  local hex = type(digest) == "string" and digest:match("^sha256:(%x+)$")
  if not hex or #hex ~= 64 or hex:lower() ~= hex then
    invalid(("%s: digest %s is not sha256:<64 lowercase hex>"):format(what, tostring(digest)))
  end
  return hex
end

-- sha256 of a file on the thread pool; with copy_to also copied there.
function M.sha256(path, copy_to)
  local err, hex, size = async.await(function(resume)
    local ok, msg, code = core.sha256_file(path, function(e, h, s) resume(e, h, s) end, copy_to)
    if not ok then resume(msg, nil, code) end
  end, "images.sha256")
  if err then
    local code = size -- on failure the third value is the errno name
    if code == "ENOENT" then errors.raise("IMAGE_NOT_FOUND", "image blob missing: " .. path, { path = path }) end
    errors.raise("FILESYSTEM_ERROR", err, { errno = code, path = path })
  end
  return hex, size
end

local function read_bounded(path)
  local f = io.open(path, "rb")
  if not f then errors.raise("IMAGE_NOT_FOUND", "cannot read " .. path, { path = path }) end
  local text = f:read(M.MAX_JSON + 1)
  f:close()
  if text and #text > M.MAX_JSON then invalid(path .. ": larger than " .. M.MAX_JSON .. " bytes") end
  return text or ""
end

function M.read_json(path, what)
  local doc = cjson.decode(read_bounded(path))
  if type(doc) ~= "table" then invalid(("%s: %s is not a JSON object"):format(what, path)) end
  return doc
end

-- Copies the file at src into the store as the blob of digest, checking
-- the digest on the way; returns the blob's path and size. A blob already
-- there is kept (it was checked when it came in).
function M.import(src, digest, what)
  local hex = M.hex_of(digest, what)
  local path = store.blob_path(hex)
  local f = io.open(path, "rb")
  if f then
    local size = f:seek("end")
    f:close()
    return path, size
  end
  local tmp = store.open() .. "/tmp/blob-" .. hex .. "-" .. require("moonbox.lib.util").random_hex(4)
  local got, size = M.sha256(src, tmp)
  if got ~= hex then
    os.remove(tmp)
    invalid(("%s: content of %s has digest sha256:%s, not %s"):format(what, src, got, digest), { entry = src })
  end
  errors.check("FILESYSTEM_ERROR", os.rename(tmp, path))
  return path, size
end

-- Unpacks the blob at path into layers/<hex>[-U-G] once; progress(bytes,
-- entries) after each step; owner as store.layer_name. Returns the
-- layer's directory and whether it was there already. Opaque dirs get
-- user.overlay.opaque: sandboxes mount their overlay inside their user
-- namespace, with userxattr (src/nsinit.c).
function M.unpack(path, hex, progress, owner)
  local final = store.layer_path(hex, owner)
  if require("moonbox.lib.util").is_dir(final) then return final, true end
  local dir = store.tmp_dir()
  local job, msg, code = core.image_layer_open(path, dir, {
    max_bytes = M.MAX_LAYER_BYTES, max_entries = M.MAX_LAYER_ENTRIES, xattr_ns = "user",
    chown = owner ~= nil, uid_base = owner and owner.uid, gid_base = owner and owner.gid,
    id_count = owner and owner.count,
  })
  if not job then
    store.remove(dir)
    invalid("layer " .. hex .. " cannot be read: " .. tostring(msg), { errno = code })
  end
  local ok, err = pcall(function()
    while true do
      local e, done, bytes, entries = async.await(function(resume)
        local queued, qmsg, qcode = job:step(function(...) resume(...) end)
        if not queued then resume(qmsg, qcode) end
      end, "images.unpack")
      if e then
        local ecode, entry = done, bytes
        if ecode == "REFUSED" then invalid(e, { entry = entry, layer = "sha256:" .. hex }) end
        if ecode == "EIO" then invalid("layer sha256:" .. hex .. ": " .. e, { entry = entry }) end
        if ecode == "ENOSPC" or ecode == "EDQUOT" then errors.raise("NO_SPACE", e, { entry = entry }) end
        errors.raise("FILESYSTEM_ERROR", e, { errno = ecode, entry = entry })
      end
      if progress then progress(bytes, entries) end
      if done then return end
    end
  end)
  job:close()
  if ok then
    -- the layer's top is "/" of the sandboxes: their root's, 0755
    ok, err = pcall(function()
      local cok, cmsg = require("moonbox.lib.fs").chmod(dir, 493)
      if cok and owner then cok, cmsg = core.chown(dir, owner.uid, owner.gid) end
      if not cok then errors.raise("FILESYSTEM_ERROR", "image store: " .. tostring(cmsg)) end
    end)
  end
  if not ok then
    store.remove(dir)
    error(err, 0)
  end
  local rok, rmsg = os.rename(dir, final)
  if not rok then
    store.remove(dir)
    if not require("moonbox.lib.util").is_dir(final) then
      errors.raise("FILESYSTEM_ERROR", "image store: " .. tostring(rmsg))
    end
  end
  return final, false
end

return M
