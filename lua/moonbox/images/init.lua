-- moonbox.images: pull (import) images into the store, list and remove
-- them, and find the one a sandbox names (docs/images.md).
--   pull(ref, {name?, onProgress?, auth? = {username, password}}) -> image record
--   list() -> {records}, remove(ref) -> {success, name, removedLayers}
--   get(ref) -> record | nil   (a name, or a digest "sha256:...")
-- REF: oci:DIR[:TAG], docker-archive:FILE or REGISTRY/NAME[:TAG|@DIGEST]
-- (images/registry.lua); the record's name is the ref as given unless
-- opts.name says otherwise.
local errors = require "moonbox.errors"
local util = require "moonbox.lib.util"
local store = require "moonbox.images.store"
local blob = require "moonbox.images.blob"
local registry = require "moonbox.sandbox.registry"

local M = {}

M.store = store

local function parse(ref)
  if type(ref) ~= "string" or ref == "" or ref:find("%z") then
    errors.raise("VALIDATION_FAILED", "image reference must be a non-empty string")
  end
  local rest = ref:match("^oci:(.+)$")
  if rest then
    local dir, tag = rest:match("^(.*):([^:/]+)$")
    if not dir or dir == "" then dir, tag = rest, nil end
    return { kind = "oci", dir = dir, tag = tag }
  end
  rest = ref:match("^docker%-archive:(.+)$")
  if rest then return { kind = "docker-archive", file = rest } end
  return { kind = "registry", ref = ref }
end
M.parse = parse

-- The image config fields a sandbox honours (image-spec config.md).
local function runtime_config(config)
  local c = type(config.config) == "table" and config.config or {}
  local function strings(t)
    if type(t) ~= "table" then return nil end
    local out = {}
    for i, v in ipairs(t) do
      if type(v) ~= "string" then blob.invalid("image config: a non-string in a list") end
      out[i] = v
    end
    return out
  end
  return {
    Env = strings(c.Env) or {}, Entrypoint = strings(c.Entrypoint), Cmd = strings(c.Cmd),
    WorkingDir = type(c.WorkingDir) == "string" and c.WorkingDir or nil,
    User = type(c.User) == "string" and c.User or nil,
  }
end
M.runtime_config = runtime_config

local function record_of(name, ref, read, sizes)
  local layers, size = {}, 0
  for i, l in ipairs(read.layers) do
    layers[i] = l.hex
    size = size + (sizes[i] or 0)
  end
  return {
    name = name, source = ref, digest = "sha256:" .. read.config_hex,
    manifest = read.manifest and ("sha256:" .. read.manifest) or nil,
    layers = layers, size = size, config = runtime_config(read.config),
    created = type(read.config.created) == "string" and read.config.created or nil,
    os = read.config.os, architecture = read.config.architecture, pulledAt = util.timestamp(),
  }
end

-- Whose ids a layer's files get (store.layer_name): a root runtime's
-- default sandbox id range, so pull prepares what getSandbox will use;
-- nothing (the runtime's own) unprivileged.
function M.default_owner()
  if not require("moonbox.sandbox.disk").host_root() then return nil end
  local policy = require "moonbox.policy"
  return require("moonbox.sandbox.isolation").idmap(policy.resolve(nil))
end

-- Removes scratch left by a runtime that died mid-pull (under the lock,
-- nobody else's work is in tmp/).
local function sweep_tmp()
  for _, name in ipairs(require("moonbox.core").readdir(store.dir() .. "/tmp") or {}) do
    store.remove(store.dir() .. "/tmp/" .. name)
  end
end

-- The blobs (layers, configs, manifests) the records of refs but `except`
-- name, as a set of hex digests.
local function used_blobs(refs, except)
  local used = {}
  for name, r in pairs(refs.images) do
    if name ~= except then
      for _, l in ipairs(r.layers) do used[l] = true end
      used[(r.digest:gsub("^sha256:", ""))] = true
      if r.manifest then used[(r.manifest:gsub("^sha256:", ""))] = true end
    end
  end
  return used
end

-- Removes rec's blobs and layer dirs that used does not name; -> how many layers went.
local function drop_unused(rec, used)
  local removed = 0
  local dirs = require("moonbox.core").readdir(store.dir() .. "/layers") or {}
  for _, l in ipairs(rec.layers) do
    if not used[l] then
      for _, name in ipairs(dirs) do -- each id range's copy
        if name == l or name:sub(1, #l + 1) == l .. "-" then store.remove(store.dir() .. "/layers/" .. name) end
      end
      os.remove(store.blob_path(l))
      removed = removed + 1
    end
  end
  for _, d in ipairs { rec.digest, rec.manifest } do
    local hex = d and d:gsub("^sha256:", "")
    if hex and not used[hex] then os.remove(store.blob_path(hex)) end
  end
  return removed
end

function M.pull(ref, opts)
  opts = opts or {}
  local p = parse(ref)
  local creds = require("moonbox.images.credentials").check(opts.auth)
  if creds and p.kind ~= "registry" then
    errors.raise("VALIDATION_FAILED", "auth: credentials are for registry references", { field = "auth" })
  end
  local name = opts.name or ref
  if type(name) ~= "string" or name == "" or #name > 512 or name:find("[%z\n]") then
    errors.raise("VALIDATION_FAILED", "image name must be a non-empty string without NUL or newline")
  end
  local progress = opts.onProgress
  local owner = M.default_owner()
  return store.with_lock(function()
    sweep_tmp()
    local read
    if p.kind == "oci" then
      if not util.is_dir(p.dir) then errors.raise("IMAGE_NOT_FOUND", "no OCI layout at " .. p.dir, { ref = ref }) end
      read = require("moonbox.images.oci").read(p.dir, p.tag)
    elseif p.kind == "docker-archive" then
      read = require("moonbox.images.docker_archive").read(p.file)
    else
      read = require("moonbox.images.registry").read(ref, creds)
    end
    local sizes = {}
    for i, l in ipairs(read.layers) do
      local f = io.open(l.path, "rb")
      sizes[i] = f and f:seek("end") or 0
      if f then f:close() end
      if progress then progress { type = "layer", index = i, count = #read.layers, digest = "sha256:" .. l.hex } end
      local _, cached = blob.unpack(l.path, l.hex, progress and function(bytes, entries)
        progress { type = "progress", index = i, count = #read.layers, bytes = bytes, entries = entries }
      end, owner)
      if progress then
        progress { type = "layerDone", index = i, count = #read.layers, digest = "sha256:" .. l.hex, cached = cached }
      end
    end
    local rec = record_of(name, ref, read, sizes)
    local refs = store.read_refs()
    local old = refs.images[name]
    refs.images[name] = rec
    store.write_refs(refs)
    -- the name pulled again over another image: what only the old one used goes
    -- (unless a live sandbox of this runtime stands on it)
    if old and old.digest ~= rec.digest then
      local used = used_blobs(refs)
      for _, sb in pairs(registry.all()) do
        for _, dir in ipairs(not sb.destroyed and sb.image_mounts and sb.image_mounts.lowers or {}) do
          local hex = dir:match("/layers/(%x+)[^/]*$")
          if hex then used[hex] = true end
        end
      end
      drop_unused(old, used)
    end
    return rec
  end)
end

-- The layer directories of an image for a sandbox whose ids are owner
-- (bottom first), unpacking the ones this id range has not got yet.
function M.layer_dirs(rec, owner)
  local dirs, missing = {}, false
  for i, hex in ipairs(rec.layers) do
    dirs[i] = store.layer_path(hex, owner)
    if not util.is_dir(dirs[i]) then missing = true end
  end
  if not missing then return dirs end
  return store.with_lock(function()
    for i, hex in ipairs(rec.layers) do
      local path = store.blob_path(hex)
      if not util.is_file(path) then
        errors.raise("IMAGE_NOT_FOUND", ("image %s: layer blob sha256:%s is gone from the store"):format(rec.name, hex))
      end
      dirs[i] = blob.unpack(path, hex, nil, owner)
    end
    return dirs
  end)
end

function M.get(ref)
  if type(ref) ~= "string" then return nil end
  local refs = store.read_refs()
  if refs.images[ref] then return refs.images[ref] end
  if ref:match("^sha256:%x+$") then
    for _, rec in pairs(refs.images) do
      if rec.digest == ref then return rec end
    end
  end
  return nil
end

function M.list()
  local out = {}
  for _, rec in pairs(store.read_refs().images) do out[#out + 1] = rec end
  table.sort(out, function(a, b) return a.name < b.name end)
  return out
end

-- Layers and blobs no remaining image names are removed with the name.
-- (Sandboxes using a removed image keep their mounted layers; a layer dir
-- is removed only when no record names it.)

function M.remove(ref)
  return store.with_lock(function()
    local refs = store.read_refs()
    local rec = refs.images[ref]
    if not rec then
      errors.raise("IMAGE_NOT_FOUND", "no image named " .. tostring(ref) .. " in the store", { ref = ref })
    end
    local used = used_blobs(refs, ref)
    -- a layer a live sandbox of this runtime stands on stays, and so does
    -- the name (other runtimes' sandboxes are not seen: docs/images.md)
    for id, sb in pairs(registry.all()) do
      for _, dir in ipairs(not sb.destroyed and sb.image_mounts and sb.image_mounts.lowers or {}) do
        local hex = dir:match("/layers/(%x+)[^/]*$")
        if hex and not used[hex] then
          for _, l in ipairs(rec.layers) do
            if l == hex then
              errors.raise("VALIDATION_FAILED", ("image %s is in use by sandbox %s"):format(ref, id),
                { ref = ref, sandbox = id })
            end
          end
        end
      end
    end
    refs.images[ref] = nil
    store.write_refs(refs)
    return { success = true, name = ref, removedLayers = drop_unused(rec, used) }
  end)
end

return M
