-- Routing for the HTTP API: a route is a method and a path of literal
-- segments and {params}; match() finds the handler, or says why not: no
-- route has this path (404 NOT_FOUND), or none takes this method (405,
-- with the methods that it does take). Params are path segments; split on
-- the raw path, an id may hold a decoded "/" (from %2F) or be "." or "..":
-- check_id refuses those.
local V = require "moonbox.lib.validate"

local M = {}

local Router = {}
Router.__index = Router

function M.new() return setmetatable({ routes = {} }, Router) end

-- add(method, "/sessions/{sessionId}", handler)
function Router:add(method, pattern, handler)
  local segs = {}
  for seg in pattern:gmatch("[^/]+") do
    local param = seg:match("^{(.+)}$")
    segs[#segs + 1] = param and { param = param } or seg
  end
  self.routes[#self.routes + 1] = { method = method, segs = segs, handler = handler, pattern = pattern }
end

local function percent_decode(s)
  return (s:gsub("%%(%x%x)", function(h) return string.char(tonumber(h, 16)) end))
end

-- segments(path, raw) -> array of decoded segments. With the raw
-- (undecoded) path a %2F inside a segment stays in that segment, "." and
-- ".." stay segments (to be refused as ids), and an empty segment ("//")
-- stays one; a single trailing "/" is ignored.
function M.segments(path, raw)
  local segs = {}
  if raw then
    raw = raw:gsub("^/", ""):gsub("/$", "")
    if raw == "" then return segs end
    for seg in (raw .. "/"):gmatch("([^/]*)/") do segs[#segs + 1] = percent_decode(seg) end
  else
    for seg in path:gmatch("[^/]+") do segs[#segs + 1] = seg end
  end
  return segs
end

-- An id taken from a path segment (sessionId, processId, contextId).
function M.check_id(value, field)
  if type(value) ~= "string" then V.fail(field, "expected a string, got " .. type(value)) end
  return V.id(value, field)
end

-- match(method, segs) -> route, params | nil, "not_found" | nil, "method", allow
function Router:match(method, segs)
  local allow, seen = {}, {}
  for _, route in ipairs(self.routes) do
    if #route.segs == #segs then
      local params, ok = {}, true
      for i, s in ipairs(route.segs) do
        if type(s) == "table" then
          params[s.param] = segs[i]
        elseif s ~= segs[i] then
          ok = false
          break
        end
      end
      if ok then
        if route.method == method then
          return route, params
        end
        if not seen[route.method] then
          seen[route.method] = true
          allow[#allow + 1] = route.method
        end
      end
    end
  end
  if #allow > 0 then
    table.sort(allow)
    return nil, "method", allow
  end
  return nil, "not_found"
end

return M
