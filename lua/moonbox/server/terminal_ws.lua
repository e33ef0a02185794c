-- A session's terminal over a WebSocket, as xterm.js expects it: binary
-- frames carry raw pty bytes both ways; text frames carry JSON control
-- messages ({"type":"resize","cols":..,"rows":..} from the client;
-- {"type":"ready"}, {"type":"exit","code":n}, {"type":"error","message":..}
-- from the server). A text frame that is not a control message is typed
-- input (what xterm.js's attach addon sends).
--
-- One terminal per (sandbox, session) outlives its socket: a client that
-- reconnects gets the last REPLAY_BYTES of output replayed, then the live
-- stream. A newer connection replaces an older one. The terminal ends when
-- its shell exits or its session or sandbox goes away.
local moonbox = require "moonbox"
local async = require "moonbox.async"
local errors = require "moonbox.errors"
local api_errors = require "moonbox.server.api_errors"
local cjson = require "cjson.safe"

local M = {}

M.REPLAY_BYTES = 256 * 1024

local terminals = {} -- "sandbox\0session" -> entry {t, replay, replay_len, ws}

local function record(entry, data)
  local replay = entry.replay
  replay[#replay + 1] = data
  entry.replay_len = entry.replay_len + #data
  local excess = entry.replay_len - M.REPLAY_BYTES
  while excess > 0 do
    local first = replay[1]
    if #first <= excess then
      table.remove(replay, 1)
      excess = excess - #first
      entry.replay_len = entry.replay_len - #first
    else
      replay[1] = first:sub(excess + 1)
      entry.replay_len = entry.replay_len - excess
      excess = 0
    end
  end
end

local function send_json(ws, t)
  return ws:send(cjson.encode(t), false)
end

local STATUS = { VALIDATION_FAILED = 400, SESSION_NOT_FOUND = 404, SANDBOX_DESTROYED = 404,
  SESSION_DESTROYED = 404 }

local function fail_response(status, code, message, context)
  return { status = status, headers = { ["content-type"] = "application/json" },
    body = cjson.encode(api_errors.envelope(code, message, context, status)) }
end

local function size_param(req, name, default)
  local v = req.query[name]
  if v == nil or v == "" then return default end
  v = tonumber(v)
  if not v or v < 1 or v > 65535 or v % 1 ~= 0 then return nil end
  return v
end

-- The entry for this session's terminal: the live one, or a new one.
local function terminal_for(key, session, cols, rows)
  local entry = terminals[key]
  if entry and not entry.t.exited and not entry.t.closed then
    pcall(entry.t.resize, entry.t, cols, rows)
    return entry
  end
  local t = session:terminal { cols = cols, rows = rows }
  entry = { t = t, replay = {}, replay_len = 0, key = key }
  terminals[key] = entry
  t:onData(function(data) record(entry, data) end)
  async.spawn(function()
    t:wait()
    if terminals[key] == entry then terminals[key] = nil end
    -- no client to drain it to: released now (with one, handle() releases
    -- it once its pump has sent the exit)
    if not entry.ws then pcall(t.close, t) end
  end)
  return entry
end

-- Pty output to the socket until the shell has exited and drained.
local function pump(entry, ws)
  local t = entry.t
  while true do
    local data = t:read()
    if data == nil then break end
    if not ws:send(data, true) then return end
  end
  send_json(ws, { type = "exit", code = t:wait() })
  ws:close(1000, "exited")
end

local function control(entry, ws, text)
  local msg = text:sub(1, 1) == "{" and cjson.decode(text)
  if type(msg) ~= "table" or type(msg.type) ~= "string" then
    entry.t:write(text) -- typed input from an attach-style client
    return
  end
  if msg.type == "resize" then
    local ok, err = pcall(entry.t.resize, entry.t, msg.cols, msg.rows)
    if not ok then send_json(ws, { type = "error", code = err.code, message = err.message or tostring(err) }) end
  elseif msg.type == "input" and type(msg.data) == "string" then
    entry.t:write(msg.data)
  else
    send_json(ws, { type = "error", code = "VALIDATION_FAILED",
      message = ("unknown control message %q"):format(msg.type) })
  end
end

-- precheck(req) -> the refusal of a request that can be refused before
-- anything is looked up or made (no WebSocket upgrade, bad sizes), or nil.
local TERMINAL_QUERY = { cols = true, rows = true, access_token = true, token = true }

function M.precheck(req)
  if not req.websocket then
    return fail_response(426, "VALIDATION_FAILED", "this endpoint speaks WebSocket: send Upgrade: websocket")
  end
  if not size_param(req, "cols", 80) or not size_param(req, "rows", 24) then
    return fail_response(400, "VALIDATION_FAILED", "cols and rows must be integers 1-65535")
  end
  if req.queryConflict then
    return fail_response(400, "VALIDATION_FAILED",
      req.queryConflict .. ": query parameter given twice, with different values", { field = req.queryConflict })
  end
  for k in pairs(req.query or {}) do
    -- (access_token, token: a browser's WebSocket cannot send Authorization)
    if not TERMINAL_QUERY[k] then
      return fail_response(400, "VALIDATION_FAILED", k .. ": unknown query parameter", { field = k })
    end
  end
  return nil
end

-- handle(req, res, sandboxId, sessionId): the terminal endpoint
-- GET /v1/sandboxes/{id}/sessions/{sessionId}/terminal?cols=&rows=
function M.handle(req, res, sandboxId, sessionId)
  local refused = M.precheck(req)
  if refused then return refused end
  local cols, rows = size_param(req, "cols", 80), size_param(req, "rows", 24)
  local key = sandboxId .. "\0" .. sessionId
  local ok, entry = pcall(function()
    local session = moonbox.getSandbox(sandboxId):getSession(sessionId)
    return terminal_for(key, session, cols, rows)
  end)
  if not ok then
    local err = entry
    if errors.is_error(err) and STATUS[err.code] then
      return fail_response(STATUS[err.code], err.code, err.message, err.context)
    end
    error(err, 0)
  end
  local ws = res:upgrade()
  if entry.ws then entry.ws:close(1000, "replaced by a newer connection") end
  entry.ws = ws
  local t = entry.t
  -- what is unread is also in the replay: drop it, then replay, then go live
  if #t.chunks > 0 then t:read() end
  send_json(ws, { type = "ready", cols = t.cols, rows = t.rows, pid = t.pid, sandboxPid = t.sandboxPid,
    sessionId = sessionId, replayBytes = entry.replay_len })
  if entry.replay_len > 0 then ws:send(table.concat(entry.replay), true) end
  local pump_task = async.spawn(pump, entry, ws)
  for data, is_binary in ws:messages() do
    local wrote, err = pcall(function()
      if is_binary then t:write(data) else control(entry, ws, data) end
    end)
    if not wrote then
      send_json(ws, { type = "error", code = errors.is_error(err) and err.code or api_errors.INTERNAL,
        message = errors.is_error(err) and err.message or tostring(err) })
      if t.exited or t.closed then break end
    end
  end
  pump_task:cancel()
  if entry.ws == ws then entry.ws = nil end
  ws:close()
  -- an exited shell's pty and cgroup: nothing more will come
  if t.exited and not entry.ws then pcall(t.close, t) end
end

-- Terminals held for reconnection (for tests and diagnostics).
function M.count()
  local n = 0
  for _ in pairs(terminals) do n = n + 1 end
  return n
end

return M
