-- The image config's User (docs/images.md, "The image's user"): `name`,
-- `uid`, `uid:gid`, `name:group` (either half a name or a number), resolved
-- against the IMAGE's /etc/passwd and /etc/group, never the host's, and
-- checked against the sandbox's id range.
--
-- The files are read from the image's own directories, top first: the
-- sandbox's upper dir (its changes, kept with its root), then the layers.
-- Each is opened beneath its directory (openat2 RESOLVE_BENEATH), a regular
-- file only, at most MAX_BYTES: a hostile layer or a sandbox's own writes
-- can make the lookup fail, never read outside the image nor without bound.
local fs = require "moonbox.lib.fs"
local errors = require "moonbox.errors"

local M = {}

M.MAX_BYTES = 1048576

local function read_bounded(dir, rel)
  local fd, msg, code = fs.open_beneath(dir, rel, "r", nil, "beneath")
  if not fd then return nil, msg, code end
  local chunks, n = {}, 0
  while true do
    local data, rmsg, rcode = fs.read(fd, 65536)
    if data == nil then
      fs.close(fd)
      return nil, rmsg, rcode
    end
    if data == "" then break end
    n = n + #data
    if n > M.MAX_BYTES then
      fs.close(fd)
      return nil, ("larger than %d bytes"):format(M.MAX_BYTES), "EFBIG"
    end
    chunks[#chunks + 1] = data
  end
  fs.close(fd)
  return table.concat(chunks)
end

-- image_file(dirs, rel, name) -> the content of rel in the merged image (dirs
-- top first), or nil when no layer has it or a whiteout hides it.
function M.image_file(dirs, rel, name)
  for _, dir in ipairs(dirs) do
    local st, msg, code = fs.lstat_beneath(dir, rel, "beneath")
    if st then
      if st.type ~= "file" then
        -- a whiteout (a 0/0 character device) hides the lower layers' file
        if st.type == "other" then return nil end
        errors.raise("IMAGE_INVALID", ("image %s: /%s is a %s, not a file: its User cannot be looked up")
          :format(name, rel, st.type), { path = "/" .. rel })
      end
      local data, rmsg = read_bounded(dir, rel)
      if not data then
        errors.raise("IMAGE_INVALID", ("image %s: cannot read /%s to look up its User: %s")
          :format(name, rel, tostring(rmsg)), { path = "/" .. rel })
      end
      return data
    elseif code ~= "ENOENT" and code ~= "ENOTDIR" then
      errors.raise("IMAGE_INVALID", ("image %s: cannot look up /%s for its User: %s")
        :format(name, rel, tostring(msg)), { path = "/" .. rel })
    end
  end
  return nil
end

-- rows of a colon-separated file (passwd: name:x:uid:gid:gecos:home:shell,
-- group: name:x:gid:members)
local function rows(text)
  local out = {}
  for line in (text or ""):gmatch("[^\n]+") do
    if not line:match("^%s*#") then
      local f = {}
      for field in (line .. ":"):gmatch("([^:]*):") do f[#f + 1] = field end
      out[#out + 1] = f
    end
  end
  return out
end

local function number(s)
  return s:match("^%d+$") and tonumber(s) or nil
end

M.MAX_GROUPS = 32 -- the spawn plan's (src/child/child.h MB_MAX_GROUPS)

-- resolve(user, dirs, name) -> {uid, gid, groups = {gid, ...}, home?, name?}
-- for the image's User string (nil or "" -> root). dirs: the image's
-- directories, top first.
function M.resolve(user, dirs, name)
  if user == nil or user == "" then return { uid = 0, gid = 0, groups = {} } end
  local u, g = user:match("^([^:]+):([^:]+)$")
  if not u then u = user:match("^([^:]+)$") end
  if not u then
    errors.raise("IMAGE_INVALID", ("image %s: User %q is not name, uid, uid:gid or name:group"):format(name, user),
      { user = user })
  end
  local passwd = rows(M.image_file(dirs, "etc/passwd", name))
  local entry
  for _, f in ipairs(passwd) do
    if (number(u) and tonumber(f[3]) == number(u)) or f[1] == u then
      entry = f
      if f[1] == u then break end -- a name beats a uid that looks like it
    end
  end
  local r = { groups = {} }
  if number(u) then
    r.uid = number(u)
  elseif entry and number(entry[3] or "") then
    r.uid = number(entry[3])
  else
    errors.raise("IMAGE_INVALID", ("image %s: User %q is not in the image's /etc/passwd"):format(name, u),
      { user = user })
  end
  if entry then
    r.name = entry[1]
    r.home = entry[6] ~= "" and entry[6] or nil
  end
  local group = rows(M.image_file(dirs, "etc/group", name))
  if g and number(g) then
    r.gid = number(g)
  elseif g then
    for _, f in ipairs(group) do
      if f[1] == g and number(f[3] or "") then r.gid = number(f[3]) break end
    end
    if not r.gid then
      errors.raise("IMAGE_INVALID", ("image %s: group %q of User %q is not in the image's /etc/group")
        :format(name, g, user), { user = user })
    end
  else
    -- the passwd entry's group; a uid the image does not list gets group 0, as Docker does
    r.gid = entry and number(entry[4] or "") or 0
  end
  -- supplementary groups: those of the image's /etc/group that list the
  -- user's name among their members (as login(1) and Docker do)
  local seen = { [r.gid] = true }
  for _, f in ipairs(r.name and group or {}) do
    local gid = number(f[3] or "")
    for member in (f[4] or ""):gmatch("[^,%s]+") do
      if member == r.name and gid and not seen[gid] then
        seen[gid] = true
        r.groups[#r.groups + 1] = gid
      end
    end
  end
  if #r.groups > M.MAX_GROUPS then
    errors.raise("IMAGE_INVALID", ("image %s: User %q is in %d groups, more than %d"):format(name, user, #r.groups,
      M.MAX_GROUPS), { user = user })
  end
  if #r.groups > 0 then table.insert(r.groups, 1, r.gid) end -- (the primary group stays one of them)
  return r
end

-- check(r, idmap, name): every id must lie in the sandbox's id range, or
-- the sandbox is not made (fail closed: no process runs as another id).
function M.check(r, idmap, name)
  local ids = { { "uid", r.uid }, { "gid", r.gid } }
  for _, g in ipairs(r.groups or {}) do ids[#ids + 1] = { "gid", g } end
  for _, id in ipairs(ids) do
    local kind, value = id[1], id[2]
    if value >= idmap.count then
      errors.raise("ISOLATION_UNAVAILABLE", ("image %s: its User's %s %d is outside the sandbox's id range " ..
        "(%d id%s: %s)"):format(name, kind, value, idmap.count, idmap.count == 1 and "" or "s",
        idmap.count == 1 and "a runtime that is not root maps only root inside"
          or "set the policy's idmap.count"), { user = r.name, [kind] = value })
    end
  end
end

return M
