-- oci:DIR[:TAG]: an OCI image layout (image-spec "image-layout.md"): the
-- manifest the tag names in index.json (through an image index, the
-- linux/amd64 one), its config and layers. Every blob read is checked
-- against its digest before its content is believed.
local blob = require "moonbox.images.blob"

local M = {}

local INDEX_TYPES = {
  ["application/vnd.oci.image.index.v1+json"] = true,
  ["application/vnd.docker.distribution.manifest.list.v2+json"] = true,
}
M.LAYER_TYPES = {
  ["application/vnd.oci.image.layer.v1.tar"] = true,
  ["application/vnd.oci.image.layer.v1.tar+gzip"] = true,
  ["application/vnd.oci.image.layer.v1.tar+zstd"] = true,
  ["application/vnd.docker.image.rootfs.diff.tar.gzip"] = true,
  ["application/vnd.docker.image.rootfs.diff.tar"] = true,
}
local REF_NAME = "org.opencontainers.image.ref.name"

local invalid = blob.invalid

-- A descriptor's blob, checked, copied into the store; its JSON if asked.
local function fetch(dir, desc, what, json)
  if type(desc) ~= "table" then invalid(what .. ": descriptor missing") end
  local hex = blob.hex_of(desc.digest, what)
  local path = blob.import(dir .. "/blobs/sha256/" .. hex, desc.digest, what)
  if json then return blob.read_json(path, what), hex end
  return path, hex
end

local function pick_platform(index, what)
  for _, m in ipairs(type(index.manifests) == "table" and index.manifests or {}) do
    local p = type(m) == "table" and m.platform
    if type(p) == "table" and p.os == "linux" and p.architecture == "amd64" then return m end
  end
  invalid(what .. ": no linux/amd64 manifest in the image index")
end

-- Returns {manifest = hex, config = doc, config_hex, layers = {{path, hex, mediaType}}}.
function M.read(dir, tag)
  local layout = blob.read_json(dir .. "/oci-layout", "oci-layout")
  if type(layout.imageLayoutVersion) ~= "string" then invalid(dir .. ": oci-layout has no imageLayoutVersion") end
  local index = blob.read_json(dir .. "/index.json", "index.json")
  local list = type(index.manifests) == "table" and index.manifests or {}
  local desc
  if tag then
    for _, m in ipairs(list) do
      local ann = type(m) == "table" and type(m.annotations) == "table" and m.annotations
      if ann and ann[REF_NAME] == tag then desc = m end
    end
    if not desc then
      require("moonbox.errors").raise("IMAGE_NOT_FOUND", ("no tag %q in %s/index.json"):format(tag, dir), { tag = tag })
    end
  elseif #list == 1 then
    desc = list[1]
  else
    return M.read(dir, "latest")
  end
  local manifest, mhex = fetch(dir, desc, "manifest", true)
  for _ = 1, 2 do -- an index names the manifest of each platform
    if not INDEX_TYPES[manifest.mediaType or desc.mediaType] then break end
    desc = pick_platform(manifest, "index")
    manifest, mhex = fetch(dir, desc, "manifest", true)
  end
  if type(manifest.layers) ~= "table" then invalid("manifest sha256:" .. mhex .. " has no layers") end
  local config, chex = fetch(dir, manifest.config, "config", true)
  local layers = {}
  for i, l in ipairs(manifest.layers) do
    if type(l) ~= "table" or not M.LAYER_TYPES[l.mediaType] then
      invalid(("layer %d: media type %s is not a tar layer"):format(i, tostring(type(l) == "table" and l.mediaType)))
    end
    local path, hex = fetch(dir, l, "layer " .. i, false)
    layers[i] = { path = path, hex = hex }
  end
  return { manifest = mhex, config = config, config_hex = chex, layers = layers }
end

return M
