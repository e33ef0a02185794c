-- The MCP streamable HTTP transport at /mcp under `moonbox serve` (behind
-- the server's token, checked before this is reached: server/cli.lua).
--   POST   one JSON-RPC message (or a batch). An initialize request starts a
--          session (its id in the Mcp-Session-Id response header); every other
--          POST names its session in that header (unknown or ended: 404).
--          Only notifications or responses: 202, no body. Requests: the
--          responses as an SSE stream when the client accepts one (one
--          `event: message` each; a cancelled request's stream ends without
--          one), else as application/json.
--   DELETE ends the session: what runs is cancelled, its sandbox destroyed.
--   GET    405: the server sends no messages of its own.
-- Sessions are bounded in number, and end after IDLE_TIMEOUT_S without a
-- request.
local core = require "moonbox.core"
local async = require "moonbox.async"
local util = require "moonbox.lib.util"
local jsonrpc = require "moonbox.mcp.jsonrpc"
local session_mod = require "moonbox.mcp.session"
local json = require "moonbox.server.api_json"
local api_errors = require "moonbox.server.api_errors"

local M = {}

M.MAX_SESSIONS = 256
M.IDLE_TIMEOUT_S = 1800
M.KEEPALIVE_MS = 15000

local sessions = {} -- id -> {session, lastUsed (core.now() ms)}
local count = 0
local sweeper

-- The sandboxes a request for them over /v1 would find or make (the
-- server's home, policy and --max-sandboxes).
-- A call's use of a sandbox counts as a request for it in the server's
-- service (M.service, set by server/cli.lua): it is not stopped for
-- idleness under a running call, and its idle time starts after it.
M.service = nil
M.provider = {
  get = function(id) return require("moonbox.server.api").sandbox_for(id, true) end,
  exists = function(id) return require("moonbox.server.api").sandbox_exists(id) end,
  enter = function(id)
    if not M.service then return nil end
    local req = { path = "/v1/sandboxes/" .. id }
    M.service:begin(req)
    return req
  end,
  leave = function(req)
    if req and M.service then M.service:finish(req) end
  end,
}

local function plain(status, code, message, extra)
  local headers = { ["content-type"] = "application/json", ["cache-control"] = "no-store" }
  for k, v in pairs(extra or {}) do headers[k] = v end
  return { status = status, headers = headers,
    body = json.encode(api_errors.envelope(code, message, {}, status)) .. "\n" }
end

local function rpc_error(status, code, message, extra)
  local headers = { ["content-type"] = "application/json" }
  for k, v in pairs(extra or {}) do headers[k] = v end
  return { status = status, headers = headers, body = jsonrpc.encode(jsonrpc.error(nil, code, message)) .. "\n" }
end

local function end_session(id)
  local entry = sessions[id]
  if not entry then return end
  sessions[id] = nil
  count = count - 1
  entry.session:close()
end

-- Sessions idle past IDLE_TIMEOUT_S end (checked every minute; the timer
-- does not keep the loop alive).
local function start_sweeper()
  if sweeper then return end
  sweeper = core.timer()
  sweeper:start(60000, 60000, function()
    local now = core.now()
    for id, entry in pairs(sessions) do
      if not entry.session:busy() and now - entry.lastUsed > M.IDLE_TIMEOUT_S * 1000 then
        async.spawn(end_session, id)
      end
    end
  end)
  sweeper:unref()
end

-- A browser page on another site must not reach a local server through DNS
-- rebinding: an Origin that is not this host is refused (MCP transport spec).
local function origin_ok(req)
  local origin = req.headers["origin"]
  if origin == nil then return true end
  local host = tostring(origin):match("^https?://([^/]+)$")
  return host ~= nil and host:lower() == tostring(req.headers["host"] or ""):lower()
end

local function accepts(req, mime)
  local accept = tostring(req.headers["accept"] or "")
  return accept:find(mime, 1, true) ~= nil or accept:find("*/*", 1, true) ~= nil
end

local function has_request(v)
  local list = jsonrpc.is_batch(v) and v or { v }
  for _, msg in ipairs(list) do
    if type(msg) == "table" and type(msg.method) == "string" and msg.id ~= nil then return true end
  end
  return false
end

local function is_initialize(v)
  return type(v) == "table" and v.method == "initialize" and v.id ~= nil
end

local function post(req, res)
  local ctype = tostring(req.headers["content-type"] or ""):lower()
  if not ctype:find("application/json", 1, true) then
    return plain(415, "UNSUPPORTED_MEDIA_TYPE", "POST /mcp takes application/json")
  end
  local v, parse_error = jsonrpc.decode(req.body)
  if not v then return { status = 400, headers = { ["content-type"] = "application/json" },
    body = jsonrpc.encode(parse_error) .. "\n" } end
  local id, entry = req.headers["mcp-session-id"]
  if is_initialize(v) then
    if count >= M.MAX_SESSIONS then
      return rpc_error(503, jsonrpc.SERVER_BUSY, ("the server holds %d MCP sessions; end one (DELETE /mcp) " ..
        "or retry later"):format(count), { ["retry-after"] = "10" })
    end
    id = util.random_hex(16)
    entry = { session = session_mod.new { sandboxes = M.provider } }
    sessions[id] = entry
    count = count + 1
    start_sweeper()
  else
    if id == nil then
      return rpc_error(400, jsonrpc.INVALID_REQUEST, "missing Mcp-Session-Id header (send initialize first)")
    end
    entry = sessions[id]
    if not entry then return rpc_error(404, jsonrpc.INVALID_REQUEST, "unknown or ended MCP session") end
    local version = req.headers["mcp-protocol-version"]
    if version ~= nil and not session_mod.VERSIONS[version] then
      return rpc_error(400, jsonrpc.INVALID_REQUEST, ("unsupported MCP-Protocol-Version %q"):format(version))
    end
  end
  entry.lastUsed = core.now()
  local session = entry.session
  local headers = { ["mcp-session-id"] = id }
  if is_initialize(v) then
    -- (an initialize that fails leaves no session behind)
    local reply = session:handle(v)
    if reply.error then
      end_session(id)
      return { status = 200, headers = { ["content-type"] = "application/json" }, body = jsonrpc.encode(reply) }
    end
    if not accepts(req, "text/event-stream") then
      headers["content-type"] = "application/json"
      return { status = 200, headers = headers, body = jsonrpc.encode(reply) .. "\n" }
    end
    headers["content-type"] = "text/event-stream"
    headers["cache-control"] = "no-cache"
    res:start(200, headers)
    res:write("event: message\ndata: " .. jsonrpc.encode(reply) .. "\n\n")
    res:finish()
    return
  end
  if not has_request(v) then
    -- (what is no notification or response either is answered 400 with its error)
    local invalid = session:handle_value(v)
    if invalid ~= nil then
      headers["content-type"] = "application/json"
      return { status = 400, headers = headers, body = jsonrpc.encode(invalid) .. "\n" }
    end
    return { status = 202, headers = headers, body = "" }
  end
  if not accepts(req, "text/event-stream") then
    local reply = session:handle_value(v)
    entry.lastUsed = core.now()
    if reply == nil then return { status = 202, headers = headers, body = "" } end
    headers["content-type"] = "application/json"
    return { status = 200, headers = headers, body = json.body(reply) }
  end
  headers["content-type"] = "text/event-stream"
  headers["cache-control"] = "no-cache"
  headers["x-accel-buffering"] = "no"
  res:start(200, headers)
  -- a comment every KEEPALIVE_MS while the call runs: clients and proxies
  -- drop a stream silent for minutes (fetch's body timeout is 300 s)
  local keepalive = async.spawn(pcall, function()
    while not res.closed do
      async.sleep(M.KEEPALIVE_MS)
      res:write(": keep-alive\n\n")
    end
  end)
  local function notify(msg)
    res:write("event: message\ndata: " .. jsonrpc.encode(msg) .. "\n\n")
  end
  local ok, reply = pcall(session.handle_value, session, v, notify)
  keepalive:cancel()
  if not ok then error(reply, 0) end
  entry.lastUsed = core.now()
  -- (a batch's responses go one event each)
  for _, msg in ipairs(reply == nil and {} or jsonrpc.is_batch(reply) and reply or { reply }) do
    if not res:write("event: message\ndata: " .. jsonrpc.encode(msg) .. "\n\n") then break end
  end
  res:finish()
end

-- handle(req, res): a request for /mcp (the token already checked).
function M.handle(req, res)
  req.route = "/mcp"
  if not origin_ok(req) then return plain(403, "FORBIDDEN", "the Origin header names another site") end
  if req.method == "POST" then return post(req, res) end
  if req.method == "DELETE" then
    local id = req.headers["mcp-session-id"]
    if id == nil then return plain(400, "VALIDATION_FAILED", "missing Mcp-Session-Id header") end
    if not sessions[id] then return plain(404, "NOT_FOUND", "unknown or ended MCP session") end
    end_session(id)
    return { status = 200, headers = { ["content-type"] = "application/json" }, body = "{}\n" }
  end
  return plain(405, "METHOD_NOT_ALLOWED", "POST or DELETE (this server sends no messages of its own)",
    { allow = "POST, DELETE" })
end

-- The number of live MCP sessions (for tests and /metrics).
function M.count() return count end

-- end_all(): the server stops: every session ends.
function M.end_all()
  for id in pairs(sessions) do end_session(id) end
end

return M
