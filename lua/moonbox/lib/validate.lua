-- Argument checks shared by the public calls. Every failure raises
-- VALIDATION_FAILED naming the field, before anything runs.
local errors = require "moonbox.errors"

local M = {}

local function fail(field, message)
  errors.raise("VALIDATION_FAILED", field .. ": " .. message, { field = field })
end
M.fail = fail

function M.type(value, expected, field, optional)
  if value == nil and optional then return value end
  if type(value) ~= expected then
    fail(field, ("expected %s, got %s"):format(expected, type(value)))
  end
  return value
end

-- Edit distance (insertions, deletions, substitutions and swaps of two
-- neighbours), giving up past `limit`.
local function distance(a, b, limit)
  if math.abs(#a - #b) > limit then return limit + 1 end
  local prev2, prev = {}, {}
  for j = 0, #b do prev[j] = j end
  for i = 1, #a do
    local cur = { [0] = i }
    local row_min = i
    for j = 1, #b do
      local cost = a:byte(i) == b:byte(j) and 0 or 1
      local d = math.min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
      if i > 1 and j > 1 and a:byte(i) == b:byte(j - 1) and a:byte(i - 1) == b:byte(j) then
        d = math.min(d, prev2[j - 2] + 1)
      end
      cur[j] = d
      if d < row_min then row_min = d end
    end
    if row_min > limit then return limit + 1 end
    prev2, prev = prev, cur
  end
  return prev[#b]
end

-- The allowed key nearest to a mistyped one (at most 2 edits, case aside),
-- or nil.
function M.suggest(key, allowed)
  if type(key) ~= "string" then return nil end
  local best, best_d
  for name in pairs(allowed) do
    if type(name) == "string" then
      local d = distance(key:lower(), name:lower(), 2)
      if d <= 2 and (not best_d or d < best_d or (d == best_d and name < best)) then best, best_d = name, d end
    end
  end
  return best
end

-- " (did you mean NAME?)" for a mistyped key, else "".
function M.did_you_mean(key, allowed)
  local near = M.suggest(key, allowed)
  return near and (" (did you mean " .. near .. "?)") or ""
end

-- opts must be nil or a table whose keys are all in `allowed`.
function M.options(opts, allowed, field)
  field = field or "options"
  if opts == nil then return {} end
  if type(opts) ~= "table" then fail(field, "expected a table, got " .. type(opts)) end
  for k in pairs(opts) do
    if not allowed[k] then
      -- (context.field is the key itself, as the caller wrote it; the
      -- message says whose option it is)
      local message = ("%s.%s: unknown option%s"):format(field, tostring(k), M.did_you_mean(k, allowed))
      errors.raise("VALIDATION_FAILED", message, { field = tostring(k), options = field })
    end
  end
  return opts
end

function M.env_name(name, field)
  if type(name) == "number" then -- an array where a map of NAME = value was meant
    fail(field or "env", "expected a table of NAME = value, got an array")
  end
  if type(name) ~= "string" or not name:match("^[A-Za-z_][A-Za-z0-9_]*$") then
    fail(field or "env", ("invalid environment variable name %q"):format(tostring(name)))
  end
end

-- An env table: names valid, values strings (or false = unset); anything
-- else, a number too, is refused (the contract's type rules: no silent
-- conversions).
function M.env(env, field)
  if env == nil then return nil end
  if type(env) ~= "table" then fail(field, "expected a table") end
  local out = {}
  for k, v in pairs(env) do
    M.env_name(k, field)
    if v == false then
      out[k] = false
    elseif type(v) == "string" then
      if v:find("\0", 1, true) then fail(field .. "." .. k, "value contains a NUL byte") end
      out[k] = v
    else
      fail(field .. "." .. k, "expected a string or false, got " .. type(v))
    end
  end
  return out
end

-- The one id rule, for every id a caller names and the runtime uses as a
-- key, a path segment or a cgroup/file name: session ids, process ids, code
-- context ids (and any of them taken from an HTTP path): 1-128 characters
-- [A-Za-z0-9_.-], not "." or "..". what names the kind in the message.
function M.id(id, field, what)
  if type(id) ~= "string" then fail(field, ("invalid %s: expected a string, got %s"):format(what or "id", type(id))) end
  if #id < 1 or #id > 128 or not id:match("^[%w_.-]+$") or id == "." or id == ".." then
    fail(field, ("invalid %s %q: 1-128 characters [A-Za-z0-9_.-], not . or .."):format(what or "id", tostring(id)))
  end
  return id
end

-- A sandbox id is also its hostname and a DNS label in the proxy's host
-- names: 1-63 characters [a-z0-9_-], not starting or ending with '-'.
function M.sandbox_id(id, field)
  if type(id) ~= "string" or #id < 1 or #id > 63 or not id:match("^[a-z0-9_-]+$")
    or id:match("^%-") or id:match("%-$") then
    fail(field or "id", ("invalid sandbox id %q: 1-63 characters [a-z0-9_-], not starting or ending with '-'")
      :format(tostring(id)))
  end
  return id
end

-- A backup id is the runtime's own (random hex); a caller only names one.
function M.backup_id(id, field)
  if type(id) ~= "string" or not id:match("^%x+$") or #id > 64 then
    fail(field or "id", ("invalid backup id %q"):format(tostring(id)))
  end
  return id
end

function M.timeout(v, field)
  if v == nil then return nil end
  if type(v) ~= "number" or v < 0 or v ~= v then fail(field, "expected a number of milliseconds >= 0") end
  return v
end

function M.command(cmd, field)
  field = field or "command"
  if type(cmd) == "string" then
    if not cmd:find("%S") then fail(field, "command is empty") end
    -- (bash would drop it and run something else than was written)
    if cmd:find("\0", 1, true) then fail(field, "contains a NUL byte") end
    return cmd
  elseif type(cmd) == "table" then
    if #cmd == 0 then
      fail(field, next(cmd) == nil and "argv is empty" or "expected an argv array (1-based, no other keys)")
    end
    for i = 1, #cmd do
      if type(cmd[i]) ~= "string" and type(cmd[i]) ~= "number" then
        fail(("%s[%d]"):format(field, i), "expected a string")
      end
      if tostring(cmd[i]):find("\0", 1, true) then fail(("%s[%d]"):format(field, i), "contains a NUL byte") end
    end
    if not tostring(cmd[1]):find("%S") then fail(field .. "[1]", "program is empty") end
    return cmd
  end
  fail(field, "expected a string or an argv array, got " .. type(cmd))
end

function M.path(p, field)
  field = field or "path"
  if type(p) ~= "string" then fail(field, "expected a string, got " .. type(p)) end
  if p == "" then fail(field, "path is empty") end
  if p:find("\0", 1, true) then fail(field, "path contains a NUL byte") end
  return p
end

return M
