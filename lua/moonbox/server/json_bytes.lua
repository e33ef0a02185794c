-- Response fields made from core.bytes buffers (an exec's output), sent in
-- slices without ever becoming one Lua string: a fresh 16 MiB string costs
-- the loop ~90 ms of page faults on this kind of VM, and every other client
-- waits for it (issue #29, bench/flood.lua). Each slice is copied out of the
-- buffer, escaped (or base64-encoded) and sent as the client takes it; the
-- buffer is freed when the body is sent or refused.
local core = require "moonbox.core"
local async = require "moonbox.async"
local errors = require "moonbox.errors"
local json = require "moonbox.server.api_json"

local M = {}

-- base64 slices: a multiple of 3 bytes, so the encodings join up
local B64_SLICE = 3 * 4096

-- The buffer's bytes from..to as a string (for json.quoted_length/slices).
local function slicer(b)
  return function(from, to) return b:tostring(from, to), 1, to - from + 1 end
end

-- The JSON length of b's bytes, quotes included: counted in C (on the
-- thread pool in a task), never by copying the buffer into Lua strings a
-- slice at a time (under an exec flood that copying, its fresh pages and
-- its loop were a fifth of the server's time, issue #29).
local function json_length(b)
  if async.in_task() then
    local n = async.await(function(resume)
      -- (refused only when the thread pool cannot take the work)
      errors.check("INTERNAL_ERROR", b:json_length(function(err, len) resume(not err and len or false) end))
    end, "JSON length")
    if n then return 2 + n end
  end
  return 2 + b:json_length()
end

local function text_part(b)
  local n = b:size()
  return setmetatable({
    held = n,
    length = function() return json_length(b) end,
    slices = function() return json.quoted_slices(n, slicer(b)) end,
    whole = function() return json.encode(b:tostring()) end,
    release = function() b:free() end,
  }, json.PART)
end

local function base64_part(b)
  local n = b:size()
  return setmetatable({
    held = n,
    length = function() return 2 + 4 * math.ceil(n / 3) end,
    slices = function()
      local at = 1
      return function()
        if at > n + 1 then return nil end
        local piece = core.base64_encode(b:tostring(at, math.min(n, at + B64_SLICE - 1)))
        if at == 1 then piece = '"' .. piece end
        at = at + B64_SLICE
        if at > n then piece = piece .. '"' at = n + 2 end
        return piece
      end
    end,
    whole = function() return '"' .. b:base64_encode() .. '"' end,
    release = function() b:free() end,
  }, json.PART)
end

-- Whether b is valid UTF-8, checked on the thread pool in a task (16 MiB
-- takes ~15 ms: not on the loop).
local function is_utf8(b)
  if not async.in_task() then return (b:utf8_valid()) end
  local valid = async.await(function(resume)
    -- (refused only when the thread pool cannot take the work)
    errors.check("INTERNAL_ERROR", b:text_info(function(err, ok) resume(not err and ok) end))
  end, "utf8 check")
  return valid
end

-- field(t, name, encoding_name): t[name], a core.bytes buffer, becomes what
-- the API sends: a string when small (the buffer is freed), else a part
-- that sends it in slices; invalid UTF-8 goes as base64 and t[encoding_name]
-- says so (json.binary_field's rule).
function M.field(t, name, encoding_name)
  local b = t[name]
  if b:size() <= json.BIG then
    t[name] = b:tostring()
    b:free()
    return json.binary_field(t, name, encoding_name)
  end
  if is_utf8(b) then
    t[name] = text_part(b)
  else
    t[name] = base64_part(b)
    t[encoding_name] = "base64"
  end
  return t
end

-- Frees what field() left in t (a call that fails before its body is made).
function M.release(t, ...)
  for _, name in ipairs { ... } do
    local v = t[name]
    -- (a buffer still being checked on the thread pool cannot be freed
    -- now: its gc frees it once the check is back)
    if getmetatable(v) == json.PART then pcall(v.release) elseif type(v) == "userdata" then pcall(v.free, v) end
  end
end

return M
