-- Error objects: {code, message, context} with __tostring. Raised with
-- error(obj, 0) so no position is glued onto the message; compare err.code.
local M = {}

local Error = {}
Error.__index = Error
Error.__tostring = function(e)
  return (e.code or "ERROR") .. ": " .. tostring(e.message)
end

function M.new(code, message, context)
  return setmetatable({ code = code, message = message, context = context or {} }, Error)
end

function M.raise(code, message, context)
  error(M.new(code, message, context), 0)
end

function M.is_error(v)
  return getmetatable(v) == Error
end

-- A readable one-liner for any error value, plus its traceback when known.
function M.format(err)
  if M.is_error(err) then
    local s = tostring(err)
    if err.traceback then s = s .. "\n" .. err.traceback end
    return s
  end
  return tostring(err)
end

-- Turn "nil, message, CODE" from the core into a raised error of our own code.
function M.check(code, ok, message, errcode, context)
  if ok == nil then
    context = context or {}
    context.errno = errcode
    M.raise(code, message, context)
  end
  return ok
end

return M
