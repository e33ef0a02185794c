-- Where a code context's interpreter is: found along PATH in the sandbox's
-- own view, so an image sandbox runs the image's interpreter (or is told
-- clearly that the image has none). A namespaced sandbox is looked into
-- through its root with RESOLVE_IN_ROOT (lib/fs.lua stat_beneath): its
-- symlinks resolve inside it, never out onto the host. A sandbox without
-- namespaces sees the host, and is looked up there.
local bit = require "bit"
local fs = require "moonbox.lib.fs"
local util = require "moonbox.lib.util"

local M = {}

M.DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"

-- an executable regular file at view path `path`?
-- (on the host: a readable file, as before images, exec says the rest)
local function executable(sb, path)
  if not (sb and sb.init) then return util.is_file(path) end
  local ok, st = pcall(fs.stat_beneath, sb.fs_root, (path:gsub("^/+", "")), "in_root")
  return ok and type(st) == "table" and st.type == "file" and bit.band(st.mode or 0, 73) ~= 0 -- 0111
end
M.executable = executable

-- find(sb, name, path_var) -> the view's absolute path of name, or nil.
-- Only absolute PATH entries count: a relative one would depend on the
-- runtime's own cwd, not the context's.
function M.find(sb, name, path_var)
  if name:find("/", 1, true) then return executable(sb, name) and name or nil end
  for dir in (path_var or M.DEFAULT_PATH):gmatch("[^:]+") do
    if dir:sub(1, 1) == "/" then
      local candidate = dir:gsub("/+$", "") .. "/" .. name
      if executable(sb, candidate) then return candidate end
    end
  end
  return nil
end

return M
