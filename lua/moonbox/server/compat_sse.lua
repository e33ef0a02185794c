-- The seed container protocol's streams (issue #16), served by compat.lua:
-- the same Lua iterators as /v1's streams, pumped by api_sse, with each
-- event reshaped to what the seed's SandboxClient reads (docs/compat.md):
-- exec (start/stdout/stderr/complete/error with a string in data),
-- process logs (stdout/stderr/exit), file read (metadata, chunks that
-- decode on their own, complete), port readiness (watching, ready,
-- process_exited, error), code (stdout/stderr text, flat result, error
-- with ename/evalue/traceback[], execution_complete) and watch (watching
-- first, then event with eventType).
local moonbox = require "moonbox"
local errors = require "moonbox.errors"
local util = require "moonbox.lib.util"
local V = require "moonbox.lib.validate"
local json = require "moonbox.server.api_json"
local sse = require "moonbox.server.api_sse"
local router_mod = require "moonbox.server.api_router"
local compat = require "moonbox.server.compat"

local M = {}

-- An error in a stream: its message (the client shows event.data or
-- event.error as a string), its code beside it.
local function message_of(err)
  if type(err) == "table" then return tostring(err.message or err.code), err.code end
  return tostring(err), nil
end

-- safe(iter, first?) -> an iterator that never raises: a failure becomes
-- one {type = "error", error} event and ends it. first: events to send
-- before iter's own. A Lua event that becomes several seed events is
-- expanded by expand(ev) -> list.
local function safe(iter, first, expand)
  local queue, done = first or {}, false
  local wrapper = { cancel = function() if type(iter) == "table" and iter.cancel then iter.cancel() end end }
  return setmetatable(wrapper, { __call = function()
    while true do
      if #queue > 0 then return table.remove(queue, 1) end
      if done then return nil end
      local ok, ev = pcall(iter)
      if not ok then
        done = true
        ev = { type = "error", error = ev }
      elseif ev == nil then
        done = true
        return nil
      end
      if expand then
        for _, e in ipairs(expand(ev)) do queue[#queue + 1] = e end
      else
        return ev
      end
    end
  end })
end

-- ---- /api/execute/stream ------------------------------------------------------------

local function exec_event(ev)
  if ev.type == "error" then
    local msg, code = message_of(ev.error)
    return { type = "error", data = msg, error = msg, code = code, timestamp = ev.timestamp or util.timestamp() }
  elseif ev.type == "complete" then
    return { type = "complete", exitCode = ev.exitCode, timedOut = ev.timedOut, timestamp = ev.timestamp }
  elseif ev.type == "start" then
    return { type = "start", command = ev.command, sessionId = ev.sessionId, timestamp = ev.timestamp }
  end
  return { type = ev.type, data = ev.data, timestamp = ev.timestamp }
end

function M.execute_stream(ctx)
  local sid = ctx:take({ sessionId = "string?" }).sessionId
  local s, cleanup = compat.session(ctx, sid, true)
  local ok, iter = pcall(function()
    local f = ctx:take(compat.EXEC_FIELDS)
    compat.finish_body(ctx)
    return s:execStream(f.command, compat.exec_options(f))
  end)
  if not ok then
    cleanup()
    error(iter, 0)
  end
  sse.pump(ctx.res, safe(iter), exec_event)
  cleanup()
end

-- ---- /api/process/{id}/stream ---------------------------------------------------------

local function log_event(ev)
  if ev.type == "error" then
    local msg, code = message_of(ev.error)
    return { type = "error", error = msg, code = code, timestamp = util.timestamp() }
  end
  return { type = ev.type, data = ev.data, exitCode = ev.exitCode, processId = ev.processId,
    timestamp = ev.timestamp }
end

function M.process_stream(ctx)
  local id = router_mod.check_id(ctx.params.processId, "processId")
  local iter = ctx:sandbox():getSession("default"):streamProcessLogs(id)
  sse.pump(ctx.res, safe(iter), log_event)
end

-- ---- /api/read/stream -------------------------------------------------------------------

M.CHUNK = 64 * 1024 -- text bytes or base64 characters per chunk (a multiple of 4)

-- The end of a text chunk that starts at i: at most CHUNK bytes, never
-- inside a UTF-8 sequence, so each chunk decodes on its own.
local function text_cut(s, i)
  local j = math.min(#s, i + M.CHUNK - 1)
  if j == #s then return j end
  local back = j
  while back > i and s:byte(back + 1) >= 0x80 and s:byte(back + 1) < 0xC0 do back = back - 1 end
  return back
end

-- The file is read as /api/read reads it (readFile, bounded by the
-- policy's maxFileBytes), then sent in chunks: base64 for binary content
-- (whole groups of 4 characters, each chunk decodes alone), text cut at
-- character boundaries.
function M.read_stream(ctx)
  local r = compat.in_session(ctx, false, function(s)
    local f = ctx:take { path = "string" }
    compat.finish_body(ctx)
    return s:readFile(f.path)
  end)
  local content, pos, state = r.content, 1, "metadata"
  local iter = setmetatable({}, { __call = function()
    if state == "metadata" then
      state = "chunks"
      return { type = "metadata", mimeType = r.mimeType, size = r.size, isBinary = r.isBinary,
        encoding = r.encoding }
    elseif state == "chunks" and pos <= #content then
      local j = r.encoding == "base64" and math.min(#content, pos + M.CHUNK - 1) or text_cut(content, pos)
      local data = content:sub(pos, j)
      pos = j + 1
      return { type = "chunk", data = data }
    elseif state ~= "done" then
      state = "done"
      return { type = "complete", bytesRead = r.size }
    end
    return nil
  end })
  sse.pump(ctx.res, iter)
end

-- ---- /api/port-watch -----------------------------------------------------------------------

-- watching {port}, then one of ready {port}, process_exited {port,
-- exitCode}, error {port, error}: the process's waitForPort, run while the
-- client listens (the client enforces its timeout by going away).
function M.port_watch(ctx)
  local f = ctx:take { port = "number", mode = "string?", path = "string?", statusMin = "number?",
    statusMax = "number?", processId = "string", interval = "number?" }
  compat.finish_body(ctx)
  local status
  local lo, hi = f.statusMin or 200, f.statusMax or 399
  if lo == hi then
    status = lo
  elseif lo ~= 200 or hi ~= 399 then
    V.fail("statusMin", "a status range other than 200-399 is not supported here: give one status (min = max)")
  end
  local id = router_mod.check_id(f.processId, "processId")
  local p = ctx:sandbox():getSession("default"):getProcess(id)
  if not p then errors.raise("PROCESS_NOT_FOUND", ("process %q does not exist"):format(id), { processId = id }) end
  local opts = { mode = f.mode, path = f.path, status = status, interval = f.interval }
  local res = ctx.res
  local task = moonbox.spawn(function() return p:waitForPort(f.port, opts) end)
  res:onClose(function() task:cancel() end)
  res:start(200, sse.HEADERS)
  if res.closed then task:cancel() end
  res:write(sse.format { type = "watching", port = f.port })
  local ok, err = pcall(task.wait, task)
  if res.closed then return end
  local ev
  if ok then
    ev = { type = "ready", port = f.port }
  elseif errors.is_error(err) and err.code == "PROCESS_EXITED_BEFORE_READY" then
    ev = { type = "process_exited", port = f.port, exitCode = (err.context or {}).exitCode }
  else
    ev = { type = "error", port = f.port, error = (message_of(err)) }
  end
  res:write(sse.format(ev))
  res:finish()
end

-- ---- /api/execute/code -----------------------------------------------------------------------

local RESULT_FIELDS = { "text", "html", "png", "jpeg", "svg", "latex", "markdown", "javascript", "json", "chart",
  "data" }

local function traceback_lines(tb)
  local lines = json.array()
  if type(tb) == "table" then
    for i, l in ipairs(tb) do lines[i] = tostring(l) end
  elseif type(tb) == "string" then
    for l in tb:gmatch("[^\n]+") do lines[#lines + 1] = l end
  end
  return lines
end

local function code_event(ev)
  if ev.type == "stdout" or ev.type == "stderr" then
    return { type = ev.type, text = ev.text, timestamp = ev.timestamp }
  elseif ev.type == "result" then
    local out = { type = "result", timestamp = ev.timestamp }
    for _, k in ipairs(RESULT_FIELDS) do out[k] = ev.result[k] end
    return out
  elseif ev.type == "error" then
    local e = ev.error
    if type(e) == "table" and e.name ~= nil then
      return { type = "error", ename = tostring(e.name), evalue = tostring(e.message or ""),
        traceback = traceback_lines(e.traceback), timestamp = ev.timestamp }
    end
    local msg, code = message_of(e)
    return { type = "error", ename = code or "Error", evalue = msg, traceback = json.array(),
      timestamp = ev.timestamp or util.timestamp() }
  elseif ev.type == "complete" then
    return { type = "execution_complete", execution_count = ev.executionCount, timestamp = ev.timestamp }
  end
  return ev
end

-- Each event is one `data: {json}` line: the client's reader is line based.
function M.execute_code(ctx)
  local f = ctx:take { context_id = "string?", code = "string", language = "string?", timeout_ms = "number?" }
  compat.finish_body(ctx)
  local iter = ctx:sandbox():getSession("default"):runCodeStream(f.code, { context = f.context_id,
    language = f.context_id == nil and f.language or nil, timeout = f.timeout_ms })
  sse.pump(ctx.res, safe(iter), code_event)
end

-- ---- /api/watch ------------------------------------------------------------------------------

local watch_ids = 0

local function watch_events(ev)
  if ev.type == "error" then
    return { { type = "error", error = (message_of(ev.error)), timestamp = util.timestamp() } }
  elseif ev.type == "move" then
    local out = {}
    if ev.oldPath then
      out[1] = { type = "event", eventType = "move_from", path = ev.oldPath, isDirectory = ev.isDirectory,
        timestamp = ev.timestamp }
    end
    out[#out + 1] = { type = "event", eventType = "move_to", path = ev.path, isDirectory = ev.isDirectory,
      timestamp = ev.timestamp }
    return out
  end
  return { { type = "event", eventType = ev.type, path = ev.path, isDirectory = ev.isDirectory,
    timestamp = ev.timestamp } }
end

-- The watch is in place when session:watch returns: `watching` comes
-- first, then the changes.
function M.watch(ctx)
  local iter = compat.in_session(ctx, false, function(s)
    local f = ctx:take { path = "string", recursive = "boolean?", include = "table?", exclude = "table?",
      events = "table?" }
    compat.finish_body(ctx)
    if f.events ~= nil then V.fail("events", "not supported here: every kind of change is reported") end
    -- the seed watches recursively unless told not to
    return s:watch(f.path, { recursive = f.recursive ~= false, include = f.include, exclude = f.exclude })
  end)
  watch_ids = watch_ids + 1
  local first = { { type = "watching", path = iter.path, watchId = ("watch-%d"):format(watch_ids) } }
  sse.pump(ctx.res, safe(iter, first, watch_events))
end

return M
