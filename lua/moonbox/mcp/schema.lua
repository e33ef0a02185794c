-- Checks a tool call's arguments against the tool's inputSchema: the subset
-- of JSON Schema the tools use (an object of named properties of type
-- string, integer, number, boolean, or an object of strings; enum,
-- minimum/maximum, minLength; required; no other properties). A mismatch
-- is the caller's mistake: the MCP server answers it with Invalid params.
local cjson = require "cjson.safe"

local M = {}

local function kind_ok(value, prop)
  local t = prop.type
  if t == "string" then return type(value) == "string" end
  if t == "boolean" then return type(value) == "boolean" end
  if t == "number" then return type(value) == "number" end
  if t == "integer" then return type(value) == "number" and value % 1 == 0 end
  if t == "object" then
    if type(value) ~= "table" or (next(value) ~= nil and value[1] ~= nil) then return false end
    local of = prop.additionalProperties
    for k, v in pairs(value) do
      if type(k) ~= "string" then return false end
      if type(of) == "table" and of.type == "string" and type(v) ~= "string" then return false end
    end
    return true
  end
  return false
end

-- check(schema, args) -> args (a table), or nil and what is wrong
function M.check(schema, args)
  if args == nil or args == cjson.null then args = {} end
  if type(args) ~= "table" or (next(args) ~= nil and args[1] ~= nil) then
    return nil, "arguments must be an object"
  end
  for k in pairs(args) do
    if type(k) ~= "string" or not schema.properties[k] then
      return nil, ("unknown argument %q"):format(tostring(k))
    end
  end
  for _, name in ipairs(schema.required or {}) do
    if args[name] == nil or args[name] == cjson.null then return nil, ("missing argument %q"):format(name) end
  end
  for name, value in pairs(args) do
    local prop = schema.properties[name]
    if value == cjson.null then
      args[name] = nil -- (null: not given)
    else
      if not kind_ok(value, prop) then return nil, ("argument %q must be a%s %s"):format(name,
        prop.type:match("^[aeiou]") and "n" or "", prop.type) end
      if prop.enum then
        local found = false
        for _, e in ipairs(prop.enum) do if e == value then found = true end end
        if not found then return nil, ("argument %q must be one of %s"):format(name, table.concat(prop.enum, ", ")) end
      end
      if prop.minimum and value < prop.minimum then
        return nil, ("argument %q must be at least %s"):format(name, tostring(prop.minimum))
      end
      if prop.maximum and value > prop.maximum then
        return nil, ("argument %q must be at most %s"):format(name, tostring(prop.maximum))
      end
      if prop.minLength and #value < prop.minLength then
        return nil, ("argument %q must not be empty"):format(name)
      end
    end
  end
  return args
end

return M
