-- A sandbox made from an image (docs/images.md): which image, its layer
-- directories for the sandbox's id range, the sandbox's own upper dir, and
-- what the image's config asks of its processes.
local core = require "moonbox.core"
local errors = require "moonbox.errors"
local util = require "moonbox.lib.util"
local images = require "moonbox.images"

local M = {}

-- The store's record of ref: by name or digest, else imported now when ref
-- names a layout or an archive (registry references: IMAGE_PULL_FAILED).
function M.resolve(ref)
  local rec = images.get(ref)
  if rec then return rec end
  local kind = images.parse(ref).kind
  if kind == "registry" and (not ref:find("[/:@]") or ref:match("^sha256:")) then
    errors.raise("IMAGE_NOT_FOUND", ("no image named %s in the store"):format(ref), { ref = ref })
  end
  return images.pull(ref)
end

local function env_map(list, name)
  local env = {}
  for _, kv in ipairs(list or {}) do
    local k, v = kv:match("^([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
    if not k then errors.raise("IMAGE_INVALID", ("image %s: Env entry %q is not NAME=value"):format(name, kv)) end
    env[k] = v
  end
  return env
end

local function mkdir_owned(path, mode, idmap)
  local ok, msg, code = core.mkdir(path, mode)
  if not ok and code ~= "EEXIST" then
    errors.raise("FILESYSTEM_ERROR", "cannot make the sandbox's upper dir: " .. tostring(msg), { errno = code })
  end
  if idmap.count > 1 then
    local cok, cmsg, ccode = core.chown(path, idmap.uid, idmap.gid)
    if not cok then
      errors.raise("FILESYSTEM_ERROR", "cannot give the upper dir to the sandbox's root: " .. tostring(cmsg),
        { errno = ccode })
    end
  end
end

-- The digest of the image a sandbox root was made from, or nil.
function M.made_by(root)
  return util.read_file(root .. "/image/digest")
end

-- prepare(rec, root, idmap) -> mounts {lowers, upper}, info. The upper dir
-- lives at <root>/image/upper (work: <root>/image/work), kept with the
-- root: a sandbox got again over the same root finds its writes; a root
-- made from another image is refused.
function M.prepare(rec, root, idmap)
  local owner = idmap.count > 1 and idmap or nil
  local lowers = images.layer_dirs(rec, owner)
  local base = root .. "/image"
  local made_by = M.made_by(root)
  if made_by and made_by ~= rec.digest then
    errors.raise("VALIDATION_FAILED", ("the sandbox's root was made from image %s, not %s (%s)")
      :format(made_by, rec.digest, rec.name), { field = "image" })
  end
  -- (searchable: the sandbox's root reaches upper/ and work/ through it)
  local ok, msg, code = core.mkdir(base, 493)
  if not ok and code ~= "EEXIST" then
    errors.raise("FILESYSTEM_ERROR", "cannot make the sandbox's image dir: " .. tostring(msg), { errno = code })
  end
  if not made_by then
    local wok, wmsg = util.write_file(base .. "/digest", rec.digest)
    if not wok then errors.raise("FILESYSTEM_ERROR", "cannot record the sandbox's image: " .. tostring(wmsg)) end
  end
  mkdir_owned(base .. "/upper", 493, idmap)
  mkdir_owned(base .. "/work", 448, idmap)
  local c = rec.config or {}
  local info = {
    name = rec.name, source = rec.source, digest = rec.digest, layers = #rec.layers,
    env = env_map(c.Env, rec.name), envList = c.Env or {}, workingDir = c.WorkingDir ~= "" and c.WorkingDir or nil,
    user = c.User ~= "" and c.User or nil, entrypoint = c.Entrypoint, cmd = c.Cmd,
  }
  return { lowers = lowers, upper = base }, info
end

-- info().image: {name, digest, source, layers, env, workingDir, user, entrypoint, cmd}
function M.info(info)
  return {
    name = info.name, digest = info.digest, source = info.source, layers = info.layers,
    env = util.copy(info.envList), workingDir = info.workingDir, user = info.user,
    entrypoint = info.entrypoint and util.copy(info.entrypoint) or nil, cmd = info.cmd and util.copy(info.cmd) or nil,
  }
end

return M
