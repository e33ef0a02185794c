-- JSON-RPC 2.0 messages for the MCP server: decoding one message (or a
-- batch) from text, classifying it, and the response and error objects.
-- Encoding goes through moonbox.server.api_json (empty arrays stay arrays,
-- invalid UTF-8 becomes U+FFFD, and a string's newlines are escaped, so a
-- message is always one line on stdio).
local cjson = require "cjson.safe"
local core = require "moonbox.core"
local json = require "moonbox.server.api_json"

local M = {}

M.PARSE_ERROR = -32700
M.INVALID_REQUEST = -32600
M.METHOD_NOT_FOUND = -32601
M.INVALID_PARAMS = -32602
M.INTERNAL_ERROR = -32603
M.SERVER_BUSY = -32000 -- (implementation-defined range) too many requests in flight

M.null = cjson.null
M.array = json.array

local decoder = cjson.new()
decoder.decode_max_depth(json.MAX_DEPTH)
decoder.decode_invalid_numbers(false)

function M.error(id, code, message, data)
  local err = { code = code, message = message, data = data }
  return { jsonrpc = "2.0", id = id == nil and M.null or id, error = err }
end

function M.result(id, result)
  return { jsonrpc = "2.0", id = id, result = result }
end

function M.encode(msg)
  return json.encode(msg)
end

local function valid_id(id)
  return type(id) == "string" or (type(id) == "number" and id % 1 == 0)
end

-- check(v) -> kind ("request" | "notification" | "response"), or nil and
-- an Invalid Request error to answer with.
function M.check(v)
  if type(v) ~= "table" or v.jsonrpc ~= "2.0" then
    local id = type(v) == "table" and valid_id(v.id) and v.id or nil
    return nil, M.error(id, M.INVALID_REQUEST, 'expected a JSON-RPC 2.0 object ("jsonrpc": "2.0")')
  end
  if v.method == nil then
    if (v.result ~= nil or v.error ~= nil) and (valid_id(v.id) or v.id == M.null) then return "response" end
    return nil, M.error(valid_id(v.id) and v.id or nil, M.INVALID_REQUEST, "expected a method, or a result or error")
  end
  if type(v.method) ~= "string" then
    return nil, M.error(valid_id(v.id) and v.id or nil, M.INVALID_REQUEST, "method must be a string")
  end
  if v.params ~= nil and type(v.params) ~= "table" then
    return nil, M.error(valid_id(v.id) and v.id or nil, M.INVALID_REQUEST, "params must be an object")
  end
  if v.id == nil then return "notification" end
  if not valid_id(v.id) then
    return nil, M.error(nil, M.INVALID_REQUEST, "id must be a string or an integer")
  end
  return "request"
end

-- decode(text) -> value (a message table, or an array of them for a batch),
-- or nil and a Parse error to answer with.
function M.decode(text)
  if type(text) ~= "string" or not text:find("%S") then
    return nil, M.error(nil, M.PARSE_ERROR, "parse error: empty message")
  end
  if not core.utf8_valid(text) then return nil, M.error(nil, M.PARSE_ERROR, "parse error: not valid UTF-8") end
  local v, err = decoder.decode(text)
  if v == nil then return nil, M.error(nil, M.PARSE_ERROR, "parse error: " .. tostring(err)) end
  if type(v) ~= "table" then
    return nil, M.error(nil, M.INVALID_REQUEST, "expected a JSON-RPC object or an array of them")
  end
  return v
end

-- is_batch(v): an array of messages (JSON-RPC 2.0 batches, which MCP
-- 2025-03-26 allowed)
function M.is_batch(v)
  return type(v) == "table" and v.jsonrpc == nil and v[1] ~= nil
end

-- A key for a request id in tables (1 and "1" are different ids).
function M.id_key(id)
  return type(id) .. ":" .. tostring(id)
end

return M
