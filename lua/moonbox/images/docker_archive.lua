-- docker-archive:FILE: what `docker save` / `podman save` write: a tar of
-- manifest.json ([{Config, RepoTags, Layers}]), the config and the layer
-- tars. It is unpacked (by the same refusing unpacker as layers) into a
-- scratch directory of the store; the config's digest must match its
-- name when the name carries one, each layer's must match the config's
-- rootfs.diff_ids (or its blobs/sha256/<hex> name in newer archives).
local blob = require "moonbox.images.blob"
local store = require "moonbox.images.store"
local core = require "moonbox.core"
local async = require "moonbox.async"
local fs = require "moonbox.lib.fs"
local errors = require "moonbox.errors"

local M = {}

local invalid = blob.invalid

-- A member named by manifest.json: a regular file inside the scratch dir
-- (members may be symlinks, as skopeo writes <id>/layer.tar -> ../<id>.tar,
-- but never to anything outside the archive).
local function member(scratch, name, what)
  if type(name) ~= "string" or name == "" or name:sub(1, 1) == "/" or name:find("%.%.") then
    invalid(("docker archive: %s names %s, not a file in the archive"):format(what, tostring(name)))
  end
  local real = fs.realpath(scratch .. "/" .. name)
  local base = fs.realpath(scratch)
  local st = real and fs.stat(real)
  if not real or not base or real:sub(1, #base + 1) ~= base .. "/" or not st or st.type ~= "file" then
    invalid(("docker archive: %s names %s, not a file in the archive"):format(what, name), { entry = name })
  end
  return real
end

local function unpack_outer(file, scratch)
  local job, msg, code = core.image_layer_open(file, scratch, {
    max_bytes = blob.MAX_LAYER_BYTES, max_entries = 100000, chown = false, xattr_ns = "user",
  })
  if not job then
    if code == "ENOENT" then errors.raise("IMAGE_NOT_FOUND", "docker archive not found: " .. file, { path = file }) end
    invalid("docker archive " .. file .. " cannot be read: " .. tostring(msg))
  end
  local ok, err = pcall(function()
    repeat
      local e, done, entry = async.await(function(resume)
        local q, qm, qc = job:step(function(...) resume(...) end)
        if not q then resume(qm, qc) end
      end, "images.docker_archive")
      if e then
        if done == "REFUSED" or done == "EIO" then
          invalid("docker archive " .. file .. ": " .. e, { entry = entry })
        end
        errors.raise("FILESYSTEM_ERROR", e, { errno = done })
      end
    until done
  end)
  job:close()
  if not ok then error(err, 0) end
end

function M.read(file)
  local scratch = store.tmp_dir()
  local ok, res = pcall(function()
    unpack_outer(file, scratch)
    local manifest = blob.read_json(member(scratch, "manifest.json", "the manifest"), "manifest.json")
    local entry = manifest[1]
    if type(entry) ~= "table" or type(entry.Layers) ~= "table" then
      invalid("docker archive " .. file .. ": manifest.json names no image")
    end
    local cpath = member(scratch, entry.Config, "Config")
    local chex = blob.sha256(cpath)
    local named = entry.Config:match("(%x+)%.json$") or entry.Config:match("sha256/(%x+)$")
    if named and #named == 64 and named ~= chex then
      invalid(("docker archive: config %s has digest sha256:%s"):format(entry.Config, chex), { entry = entry.Config })
    end
    local cblob = blob.import(cpath, "sha256:" .. chex, "config")
    local config = blob.read_json(cblob, "config")
    local rootfs = type(config.rootfs) == "table" and config.rootfs or {}
    local diff_ids = type(rootfs.diff_ids) == "table" and rootfs.diff_ids
    if not diff_ids or #diff_ids ~= #entry.Layers then
      invalid("docker archive: the config's rootfs.diff_ids do not match manifest.json's Layers")
    end
    local layers = {}
    for i, name in ipairs(entry.Layers) do
      local lpath = member(scratch, name, "layer " .. i)
      local hex = name:match("sha256/(%x+)$")
      local digest = (hex and #hex == 64) and ("sha256:" .. hex) or diff_ids[i]
      local path = blob.import(lpath, digest, "layer " .. i)
      layers[i] = { path = path, hex = blob.hex_of(digest, "layer " .. i) }
    end
    return { config = config, config_hex = chex, layers = layers, tags = entry.RepoTags }
  end)
  store.remove(scratch)
  if not ok then error(res, 0) end
  return res
end

return M
