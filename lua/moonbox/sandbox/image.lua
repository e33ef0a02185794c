-- A sandbox made from an image (docs/images.md): which image, its layer
-- directories for the sandbox's id range, the sandbox's own upper dir, and
-- what the image's config asks of its processes.
local core = require "moonbox.core"
local errors = require "moonbox.errors"
local util = require "moonbox.lib.util"
local images = require "moonbox.images"
local image_user = require "moonbox.sandbox.image_user"

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

-- check_user(user): getSandbox's `user` option, in the config's User syntax
function M.check_user(user)
  if user == nil then return end
  if type(user) ~= "string" or user == "" or #user > 256 or user:find("[%z\r\n]") then
    errors.raise("VALIDATION_FAILED", "user: expected name, uid, uid:gid or name:group (a string)",
      { field = "user" })
  end
end

-- prepare(rec, root, idmap[, user]) -> mounts {lowers, upper}, info (user:
-- getSandbox's `user`, over the config's User). The upper dir
-- lives at <root>/image/upper (work: <root>/image/work), kept with the
-- root: a sandbox got again over the same root finds its writes; a root
-- made from another image is refused.
function M.prepare(rec, root, idmap, user)
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
    user = (user or c.User) ~= "" and (user or c.User) or nil, entrypoint = c.Entrypoint, cmd = c.Cmd,
  }
  -- who its processes run as: the image's /etc/passwd and /etc/group as
  -- the sandbox will see them (its own upper dir over the layers, top first)
  local dirs = { base .. "/upper" }
  for i = #lowers, 1, -1 do dirs[#dirs + 1] = lowers[i] end
  local who = image_user.resolve(info.user, dirs, rec.name)
  image_user.check(who, idmap, rec.name)
  info.uid, info.gid, info.groups, info.home = who.uid, who.gid, who.groups, who.home
  -- HOME from the image's passwd entry when its Env has none; "/" for a
  -- user it does not list (as Docker does: root's /root is not theirs)
  if info.user and info.env.HOME == nil then
    info.env.HOME = who.home or (who.uid ~= 0 and "/" or nil)
  end
  return { lowers = lowers, upper = base }, info
end

-- The host ids the sandbox's processes run as (sb.idmap shifted by the
-- image's User): the owner of what the runtime makes for them.
function M.host_ids(info, idmap)
  local uid, gid = (info and info.uid) or 0, (info and info.gid) or 0
  if idmap.count <= 1 then return idmap.uid, idmap.gid end
  return idmap.uid + uid, idmap.gid + gid
end

-- give(path, info, idmap): path (the workspace; the run directory of the
-- shells, a fresh tmpfs of the init's, before anything of the sandbox
-- runs) to the image's User, so its processes can make their files there.
-- Root inside (no User) keeps what it has.
function M.give(path, info, idmap)
  if not info or (info.uid == 0 and info.gid == 0) or idmap.count <= 1 then return end
  local uid, gid = M.host_ids(info, idmap)
  local ok, msg, code = core.chown(path, uid, gid)
  if not ok then
    errors.raise("FILESYSTEM_ERROR", ("cannot give %s to the image's user: %s"):format(path, tostring(msg)),
      { errno = code })
  end
end

-- info().image: {name, digest, source, layers, env, workingDir, user, uid,
-- gid, groups, home, entrypoint, cmd}
function M.info(info)
  return {
    name = info.name, digest = info.digest, source = info.source, layers = info.layers,
    env = util.copy(info.envList), workingDir = info.workingDir, user = info.user,
    uid = info.uid, gid = info.gid, groups = util.copy(info.groups or {}), home = info.home,
    entrypoint = info.entrypoint and util.copy(info.entrypoint) or nil, cmd = info.cmd and util.copy(info.cmd) or nil,
  }
end

return M
