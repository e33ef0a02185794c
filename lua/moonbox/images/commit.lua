-- sandbox:commit{name}: the sandbox's upper dir (what it changed over its
-- image) becomes a new layer on top of the image's, and a new image in
-- the store (docs/images.md "Templates"); getSandbox{image = name} starts
-- from it. The upper dir is read while the sandbox runs: what a process
-- writes meanwhile may or may not be in it.
local cjson = require "cjson"
local core = require "moonbox.core"
local async = require "moonbox.async"
local errors = require "moonbox.errors"
local util = require "moonbox.lib.util"
local store = require "moonbox.images.store"
local blob = require "moonbox.images.blob"
local images = require "moonbox.images"

local M = {}

local function pack(dir, out, idmap)
  local err, bytes, code = async.await(function(resume)
    local ok, msg, ecode = core.image_layer_pack(dir, out, {
      uid_base = idmap.uid, gid_base = idmap.gid, id_count = idmap.count,
    }, function(e, b, c) resume(e, b, c) end)
    if not ok then resume(msg, nil, ecode) end
  end, "sandbox:commit")
  if err then
    if code == "ENOSPC" or code == "EDQUOT" then errors.raise("NO_SPACE", err) end
    errors.raise("FILESYSTEM_ERROR", "commit: " .. tostring(err), { errno = code })
  end
  return bytes
end

function M.commit(sb, opts)
  if type(opts) ~= "table" or type(opts.name) ~= "string" or opts.name == "" or #opts.name > 512
    or opts.name:find("[%z\n]") then
    errors.raise("VALIDATION_FAILED", "commit needs {name = \"NAME[:TAG]\"}", { field = "name" })
  end
  for k in pairs(opts) do
    if k ~= "name" then errors.raise("VALIDATION_FAILED", "commit: unknown option " .. tostring(k), { field = k }) end
  end
  if not sb.image then
    errors.raise("VALIDATION_FAILED", ("sandbox %q is not made from an image: commit writes what it changed over "
      .. "one"):format(sb.id), { field = "image" })
  end
  local parent = images.get(sb.image.digest)
  if not parent then
    errors.raise("IMAGE_NOT_FOUND", ("the sandbox's image %s is no longer in the store"):format(sb.image.digest))
  end
  local upper = sb.image_mounts.upper .. "/upper"
  -- all under the store's lock: a pull's sweep of tmp/ must not take our scratch
  return store.with_lock(function()
  local tmp = store.tmp_dir()
  local ok, rec = pcall(function()
    local tar = tmp .. "/layer.tar"
    pack(upper, tar, sb.idmap)
    local hex = blob.sha256(tar)
    local path, size = blob.import(tar, "sha256:" .. hex, "committed layer")
    -- the parent's config with one more layer (its diff_id: an uncompressed tar's is its digest)
    local config = blob.read_json(store.blob_path(blob.hex_of(parent.digest, "image")), "config")
    config.rootfs = type(config.rootfs) == "table" and config.rootfs or { type = "layers", diff_ids = {} }
    config.rootfs.diff_ids = config.rootfs.diff_ids or {}
    config.rootfs.diff_ids[#config.rootfs.diff_ids + 1] = "sha256:" .. hex
    config.created = os.date("!%Y-%m-%dT%H:%M:%SZ")
    config.history = type(config.history) == "table" and config.history or {}
    config.history[#config.history + 1] = { created = config.created, created_by = "moonbox commit " .. sb.id }
    local cpath = tmp .. "/config.json"
    errors.check("FILESYSTEM_ERROR", util.write_file(cpath, cjson.encode(config)))
    local chex = blob.sha256(cpath)
    blob.import(cpath, "sha256:" .. chex, "committed config")
    local layers = {}
    for i, l in ipairs(parent.layers) do layers[i] = { hex = l } end
    layers[#layers + 1] = { hex = hex, path = path }
    do
      blob.unpack(path, hex, nil, images.default_owner())
      local r = {
        name = opts.name, source = "commit:" .. sb.id, digest = "sha256:" .. chex, parent = parent.digest,
        layers = {}, size = (parent.size or 0) + size, config = images.runtime_config(config),
        created = config.created, os = config.os, architecture = config.architecture, pulledAt = util.timestamp(),
      }
      for i, l in ipairs(layers) do r.layers[i] = l.hex end
      local refs = store.read_refs()
      refs.images[opts.name] = r
      store.write_refs(refs)
      return r
    end
  end)
  store.remove(tmp)
  if not ok then error(rec, 0) end
  return rec
  end)
end

return M
