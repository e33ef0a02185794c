-- HTTP/1.1, SSE and WebSocket server on the runtime's loop. The protocol
-- work is the core's (src/http/); here each request becomes a task:
--
--   local server = http.listen({ listen = "127.0.0.1:8080" }, function(req, res)
--     return { status = 200, headers = { ["content-type"] = "text/plain" }, body = "hi" }
--   end)
--
-- handler(req, res) returns {status, headers, body} (body a string, or a
-- body in pieces {measure, pieces, held, text} as api_json.body makes; one
-- over SLICE goes out a slice at a time as the client reads), or streams with
-- res:start / res:write / res:finish, or turns a WebSocket request into a
-- socket with res:upgrade(). An error raised by the handler becomes a 500
-- JSON response {code = "INTERNAL_ERROR", message, context, httpStatus = 500}.
local core = require "moonbox.core"
local async = require "moonbox.async"
local send_budget = require "moonbox.server.send_budget"
local errors = require "moonbox.errors"
local api_errors = require "moonbox.server.api_errors"
local V = require "moonbox.lib.validate"
local cjson = require "cjson.safe"

local M = {}

local function now_ms() return core.hrtime() / 1e6 end

M.HIGH_WATER = 256 * 1024 -- res:write / ws:send wait while more than this is queued
M.SLICE = 64 * 1024       -- a body or message larger than this goes in slices of it
M.MAX_INBOX = 4 * 1024 * 1024 -- WebSocket messages received and not yet taken
M.MAX_PENDING = 1024      -- writes queued at once (each costs a chunk, however small)

local Server, Response, WebSocket = {}, {}, {}
local account -- (below)
Server.__index, Response.__index, WebSocket.__index = Server, Response, WebSocket

-- ---- listen addresses -----------------------------------------------------------

-- "127.0.0.1:8080", "localhost:0", "0.0.0.0:80" or "unix:/path.sock"
function M.parse_listen(listen)
  V.type(listen, "string", "listen")
  local path = listen:match("^unix:(.+)$")
  if path then return { unix = path } end
  local host, port = listen:match("^([%w%.%-]+):(%d+)$")
  port = tonumber(port)
  if not host or port > 65535 then
    V.fail("listen", ("expected host:port or unix:/path, got %q"):format(listen))
  end
  if host == "localhost" then host = "127.0.0.1" end
  if not host:match("^%d+%.%d+%.%d+%.%d+$") then
    V.fail("listen", ("expected an IPv4 address, got %q"):format(host))
  end
  for octet in host:gmatch("%d+") do
    if tonumber(octet) > 255 then
      V.fail("listen", ("%q is not an IPv4 address: each of its four numbers is 0 to 255"):format(host))
    end
  end
  return { host = host, port = port }
end

-- Loopback and unix-socket addresses need no token (cli.lua).
function M.is_local(addr)
  return addr.unix ~= nil or (addr.host or ""):match("^127%.") ~= nil
end

-- ---- requests ---------------------------------------------------------------------

local function url_decode(s)
  return (s:gsub("+", " "):gsub("%%(%x%x)", function(h) return string.char(tonumber(h, 16)) end))
end
M.url_decode = url_decode

-- The core hands the query as decoded "name=value" fragments.
-- -> query (name -> the first value), the raw query, and the first name
-- given twice with different values (the API refuses such a request)
local function parse_args(args)
  local query, raw, conflict = {}, {}, nil
  for i, frag in ipairs(args) do
    raw[i] = frag
    local k, v = frag:match("^([^=]*)=(.*)$")
    if not k then k, v = frag, "" end
    if query[k] == nil then query[k] = v elseif query[k] ~= v then conflict = conflict or k end
  end
  return query, table.concat(raw, "&"), conflict
end

-- The path the core makes of a request target (req.path): percent-decoded
-- as a whole, then empty, "." and ".." segments removed (a trailing "/" is
-- ignored by the comparison below).
local function decoded_path(raw)
  local decoded = raw:gsub("%%(%x%x)", function(h) return string.char(tonumber(h, 16)) end)
  local out = {}
  for seg in decoded:gmatch("[^/]+") do
    if seg == ".." then out[#out] = nil elseif seg ~= "." then out[#out + 1] = seg end
  end
  return "/" .. table.concat(out, "/")
end

-- The raw path (undecoded, without the query) of the request line as sent
-- (req.raw_line), if it is this request's: the same method, and the path
-- decoded from it; nil otherwise (the request is refused).
-- Second result: the raw request target (path and query, undecoded), for a
-- proxy that passes it on as sent.
function M.raw_path(raw_line, method, path)
  if type(raw_line) ~= "string" then return nil end
  local m, target = raw_line:match("^(%u+) (%S+) HTTP/%d%.%d$")
  if m ~= method or not target or target:sub(1, 1) ~= "/" then return nil end
  local raw = target:match("^[^?#]*")
  local got, want = decoded_path(raw):gsub("/+$", ""), (path or "/"):gsub("/+$", "")
  -- (a decoded %00 ends the comparison)
  local cut = want:find("\0", 1, true)
  if cut then
    want = want:sub(1, cut - 1)
    got = got:sub(1, #want)
  end
  if got ~= want then return nil end
  return raw, target
end

local function lower_keys(t)
  local out = {}
  for k, v in pairs(t or {}) do
    V.type(k, "string", "headers")
    out[k:lower()] = tostring(v)
  end
  return out
end

-- ---- responses -------------------------------------------------------------------

-- The bytes a response has counted in the send budget follow its queue.
function account(self, queued)
  queued = queued or 0
  send_budget.add(queued - (self._counted or 0))
  self._counted = queued
end

-- res.reserved: a send_budget.hold() its handler filled while it made the
-- body (an /exec's output); given back as the response is sent (the body
-- then counts what it holds) or its client goes
local function end_reservation(self)
  local reserved = self.reserved
  self.reserved = nil
  if not reserved then return false end
  reserved:release()
  return true
end

-- The response is done or its client gone: nothing of it is held any more.
local function release(self)
  account(self, 0)
  end_reservation(self)
  if self._held then send_budget.add(-self._held) self._held = nil end
end

local function wake(self)
  local w = self._waiter
  if w then self._waiter = nil w() end
end

local function set_closed(self)
  if self.closed then return end
  self.closed = true
  wake(self)
  if self._ws then self._ws:_closed() end
  local listeners = self._on_close
  self._on_close = {}
  for _, fn in ipairs(listeners) do
    local ok, err = pcall(fn)
    if not ok then io.stderr:write("moonbox: http: onClose: ", errors.format(err), "\n") end
  end
end

local function split_headers(headers)
  local h = lower_keys(headers)
  local ctype, length = h["content-type"], tonumber(h["content-length"])
  h["content-type"], h["content-length"] = nil, nil
  return h, ctype, length
end

local function json_error(code, message)
  return cjson.encode(api_errors.envelope(code, message, {}, 500))
    or cjson.encode(api_errors.envelope(code, "(a message JSON cannot hold)", {}, 500))
end

-- Send a complete response (also used for a WebSocket request refused).
function Response:_send(status, headers, body)
  V.type(status, "number", "status")
  body = body == nil and "" or body
  -- a body in pieces: {measure(), pieces = iterator, held, text()} (api_json.body)
  local sliced = type(body) == "table" and body or nil
  if sliced and self.req.websocket then
    body = sliced.text()
    if sliced.release then sliced.release() end
    sliced = nil
  end
  if not sliced then V.type(body, "string", "body") end
  if self._started then errors.raise("VALIDATION_FAILED", "response already started") end
  self._started = true
  self._reserved = end_reservation(self)
  self.status, self.bytes = status, sliced and 0 or #body -- (a sliced body's, once measured)
  local h, ctype = split_headers(headers)
  ctype = ctype or "text/plain; charset=utf-8"
  if self.req.websocket then
    if self._handshake then
      self._server._core:ws_reject(self._id, status, ctype, body, h)
    else -- already upgraded: the nearest thing to a status is a close code
      local code = (status >= 100 and status <= 999) and 4000 + status or 1011
      self._server._core:ws_close(self._id, code, body:sub(1, 120))
    end
    return
  end
  if self.closed then
    if sliced and sliced.release then sliced.release() end
    return
  end
  if sliced then
    local ok, err = pcall(self._send_sliced, self, status, h, ctype, sliced)
    if sliced.release then sliced.release() end
    if not ok then
      -- never a silence: before the head, a 500 on a connection that then
      -- closes; past it (a body cut short of its Content-Length), the close
      local srv = self._server._core
      if not self.closed then
        srv:hangup(self._id)
        if not self._streaming then
          self.status = 500
          if not srv:respond(self._id, 500, "application/json", {}, nil,
            json_error(api_errors.INTERNAL, "the response body could not be made")) then set_closed(self) end
        else
          pcall(self.finish, self)
        end
      end
      io.stderr:write("moonbox: http: ", self.req.method or "?", " ", self.req.path or "?", ": the body failed: ",
        errors.format(err), "\n")
    end
    return
  end
  if #body > M.SLICE and async.in_task() then
    return self:_send_sliced(status, h, ctype, { length = #body, pieces = M.slices(body), held = #body })
  end
  local srv = self._server._core
  local ok = srv:respond(self._id, status, ctype, h, nil, body)
  if not ok then set_closed(self) return end
  account(self, srv:queued(self._id))
end

-- A body larger than a slice goes out as the client takes it (never queued
-- whole): its held bytes (what it keeps in memory until sent) count in the
-- server-wide send budget until the response is done; a body that would
-- not fit is answered 503 BUFFERS_FULL instead, unless nothing else is held
-- (send_budget.lua).
function Response:_send_sliced(status, h, ctype, body)
  local srv = self._server._core
  local pieces, held = body.pieces, body.held
  -- (a body its handler reserved while it made it was admitted then)
  local reserved = self._reserved
  self._reserved = nil
  if not reserved and not send_budget.admits(held) then
    self:reject("buffers_full")
    local ok = srv:respond(self._id, 503, "application/json", { ["retry-after"] = "1" }, nil,
      M.buffers_full_body(body.summary))
    if not ok then set_closed(self) end
    self.status, self.bytes = 503, 0
    return
  end
  self._held = held
  send_budget.add(held)
  local length = body.length or body.measure()
  if self.closed then return end -- (gone while the length was counted)
  if not srv:respond(self._id, status, ctype, h, length) then set_closed(self) return end
  self._streaming, self.bytes = true, 0
  for piece in pieces do
    if not self:write(piece) then return end
  end
  self:finish()
end

-- The 503 past the send budget (docs/http-api.md). A refused result's
-- small fields (summary: exitCode, success, ...) go in context.result: the
-- command ran, only its output could not be held.
function M.buffers_full_body(summary)
  return cjson.encode(api_errors.envelope("BUFFERS_FULL",
    ("the server holds %d bytes for its clients, its limit (--max-buffered-bytes) is %d; %sretry later")
      :format(send_budget.used, send_budget.limit,
        summary and "the request ran, its result is in context.result without its output; " or ""),
    { limit = send_budget.limit, used = send_budget.used, result = summary }, 503)) .. "\n"
end

-- res:reject(reason): a request refused (past a limit), counted by the
-- server's owner (moonbox serve's metrics).
function Response:reject(reason)
  if self._server.onReject then pcall(self._server.onReject, reason, self.req) end
end

-- slices(s) -> an iterator over s in pieces of at most SLICE bytes
function M.slices(s, size)
  size = size or M.SLICE
  local at = 1
  return function()
    if at > #s then return nil end
    local piece = s:sub(at, at + size - 1)
    at = at + size
    return piece
  end
end

-- res:start(status, headers): begin a streamed response. Without a
-- content-length header the connection closes at the end (as SSE expects).
function Response:start(status, headers)
  V.type(status, "number", "status")
  if self.req.websocket then errors.raise("VALIDATION_FAILED", "a WebSocket request is answered with upgrade()") end
  if self._started then errors.raise("VALIDATION_FAILED", "response already started") end
  self._started, self._streaming = true, true
  self.status = status
  if self.closed then return false end
  local h, ctype, length = split_headers(headers)
  self.contentType = ctype
  local ok = self._server._core:respond(self._id, status, ctype or "application/octet-stream", h, length)
  if not ok then set_closed(self) return false end
  return true
end

-- Wait (in a task) while more than HIGH_WATER bytes are queued, or, while
-- the server-wide send budget is spent, until this connection's queue is
-- empty: the slow side waits, the others go on (send_budget.lua).
local function wait_queue(self, queued)
  account(self, queued)
  local function over()
    local high = send_budget.full() and 0 or M.HIGH_WATER
    return queued and (queued > high or (self._pending or 0) > M.MAX_PENDING)
  end
  while over() and not self.closed and async.in_task() do
    async.await(function(resume)
      self._waiter = resume
      return function() if self._waiter == resume then self._waiter = nil end end
    end, "res:write")
    if self.closed then return end
    queued = self._server._core:queued(self._id)
    account(self, queued)
  end
end

-- ok = res:write(data): false once the client is gone. Yields while the
-- client reads slower than we write.
function Response:write(data)
  V.type(data, "string", "data")
  if not self._streaming then errors.raise("VALIDATION_FAILED", "res:write before res:start") end
  if #data > M.SLICE then
    for piece in M.slices(data) do
      if not self:write(piece) then return false end
    end
    return not self.closed
  end
  if self.closed or self._finished then return false end
  local queued = self._server._core:write(self._id, data)
  if not queued then set_closed(self) return false end
  self._pending = (self._pending or 0) + 1
  self.bytes = (self.bytes or 0) + #data
  wait_queue(self, queued)
  return not self.closed
end

function Response:finish()
  if not self._streaming or self._finished then return end
  self._finished = true
  if not self.closed then self._server._core:finish(self._id) end
end

function Response:onClose(fn)
  V.type(fn, "function", "onClose")
  if self.closed then pcall(fn) return end
  self._on_close[#self._on_close + 1] = fn
end

-- ---- WebSocket -------------------------------------------------------------------

-- ws = res:upgrade(): the request's WebSocket.
function Response:upgrade()
  if not self.req.websocket then errors.raise("VALIDATION_FAILED", "not a WebSocket request") end
  if self._started then errors.raise("VALIDATION_FAILED", "response already started") end
  self._started = true
  self.status = 101
  self._ws = setmetatable({ _res = self, _inbox = {}, _head = 1, _tail = 0, closed = self.closed }, WebSocket)
  return self._ws
end

-- A peer that sends faster than the handler takes its messages is closed
-- (1008) once more than MAX_INBOX bytes wait: the C layer has no way to
-- stop reading one socket, so the bound is kept here.
function WebSocket:_push(data, is_binary)
  if self._closing then return end
  self._inbox_bytes = (self._inbox_bytes or 0) + #data
  if self._inbox_bytes > M.MAX_INBOX and self._head <= self._tail then
    self:close(1008, "messages arrive faster than the service takes them")
    self._inbox, self._head, self._tail, self._inbox_bytes = {}, 1, 0, 0
    self:_closed()
    return
  end
  self._tail = self._tail + 1
  self._inbox[self._tail] = { data, is_binary }
  local w = self._reader
  if w then self._reader = nil w() end
end

function WebSocket:_closed()
  self.closed = true
  local w = self._reader
  if w then self._reader = nil w() end
end

-- ok = ws:send(data, isBinary): false once the socket is closed. In a task
-- it waits while the peer is slow. A message larger than a slice goes as
-- fragments of one (never queued whole).
function WebSocket:send(data, is_binary)
  V.type(data, "string", "data")
  if #data <= M.SLICE then return self:sendFragment(data, is_binary, false) end
  local at, n = 1, #data
  while at <= n do
    local piece = data:sub(at, at + M.SLICE - 1)
    at = at + M.SLICE
    if not self:sendFragment(piece, is_binary, at <= n) then return false end
  end
  return true
end

-- ok = ws:sendFragment(data, isBinary, more): a piece of a message; with
-- more, the message goes on with the next call (whose isBinary is
-- ignored) and ends with the first call without it. One writer at a time:
-- nothing else may be sent on the socket while a message is open.
function WebSocket:sendFragment(data, is_binary, more)
  V.type(data, "string", "data")
  local res = self._res
  if self.closed or self._closing then return false end
  local queued = res._server._core:write(res._id, data, is_binary and true or false, more and true or false)
  if not queued then set_closed(res) return false end
  res._pending = (res._pending or 0) + 1
  res.bytes = (res.bytes or 0) + #data
  wait_queue(res, queued)
  return not self.closed
end

-- data, isBinary = ws:receive(): the next message, nil once closed.
function WebSocket:receive()
  while true do
    local box = self._inbox
    local m = box[self._head]
    if m then
      box[self._head] = nil
      self._head = self._head + 1
      self._inbox_bytes = (self._inbox_bytes or 0) - #m[1]
      return m[1], m[2]
    end
    if self.closed then return nil end
    async.await(function(resume)
      self._reader = resume
      return function() if self._reader == resume then self._reader = nil end end
    end, "ws:receive")
  end
end

-- for data, isBinary in ws:messages() do ... end (ends when the peer closes)
function WebSocket:messages()
  return function() return self:receive() end
end

function WebSocket:close(code, reason)
  if self.closed or self._closing then return end
  self._closing = true
  local res = self._res
  res._server._core:ws_close(res._id, code or 1000, reason or "")
end

-- ---- the server -----------------------------------------------------------------------

local function run_handler(self, req, res)
  local ok, result = xpcall(self.handler, function(e)
    if errors.is_error(e) then return e end
    return debug.traceback(tostring(e), 2)
  end, req, res)
  if not ok then
    if errors.is_error(result) and result.code == "CANCELLED" and res.closed then return end
    io.stderr:write("moonbox: http: ", req.method, " ", req.path, ": ", errors.format(result), "\n")
    local message = errors.is_error(result) and result.message or tostring(result):match("^[^\n]*")
    if not res._started then
      res:_send(500, { ["content-type"] = "application/json" }, json_error(api_errors.INTERNAL, message))
    elseif res._ws then
      res._ws:close(1011, "internal error")
    else
      res:finish()
    end
    return
  end
  if res._ws then
    res._ws:close()
  elseif res._streaming then
    res:finish()
  elseif not res._started then
    if type(result) ~= "table" then
      res:_send(500, { ["content-type"] = "application/json" },
        json_error(api_errors.INTERNAL, "the handler returned no response"))
    else
      res:_send(result.status or 200, result.headers, result.body)
    end
  end
end

function Server:_on_event(kind, id, a, b)
  if kind == "request" then
    local query, raw, conflict = parse_args(a.args)
    local srv = self._core
    local raw_path, raw_target = M.raw_path(a.raw_line, a.method, a.path)
    local req = {
      method = a.method, path = a.path, query = query, rawQuery = raw, queryConflict = conflict,
      rawPath = raw_path, rawTarget = raw_target,
      headers = setmetatable(a.headers, { __index = function(_, name)
        return type(name) == "string" and srv:header(id, name:lower()) or nil
      end }),
      body = b or "", websocket = a.websocket, peer = a.peer, tooLarge = a.too_large,
    }
    local res = setmetatable({ req = req, closed = false, _server = self, _id = id, _on_close = {},
      startedMs = now_ms() }, Response)
    self._live[id] = res
    self._inflight = self._inflight + 1
    -- past maxConnections (src/http/conn.c takes a few more connections to say
    -- so), and while the server drains for a stop: 503, and the connection
    -- closes; but for the paths in alwaysAnswer (health probes, which a
    -- full server must still answer), answered as usual on a connection that
    -- then closes
    local probe = a.over_limit and not self.draining and not a.websocket and self.alwaysAnswer
      and self.alwaysAnswer[a.path] and (a.method == "GET" or a.method == "HEAD")
    if probe then srv:hangup(id) end
    if (a.over_limit or self.draining) and not probe then
      local reason = a.over_limit and "max_connections" or "shutting_down"
      if self.onReject then pcall(self.onReject, reason, req) end
      if not a.websocket then srv:hangup(id) end
      res._handshake = a.websocket
      res:_send(503, { ["content-type"] = "application/json", connection = "close",
        ["retry-after"] = tostring(self.retryAfter or 1) }, cjson.encode(api_errors.envelope(
        a.over_limit and "TOO_MANY_CONNECTIONS" or "SHUTTING_DOWN",
        a.over_limit and ("the server has %d connections open (--max-connections); retry later")
          :format(self.maxConnections) or "the server is shutting down; retry on another server or later",
        { reason = reason }, 503)))
      res._handshake = false
      return
    end
    -- every request is routed on what the client sent (src/http/head.c
    -- refuses smuggling heads itself): one whose request line cannot be told
    -- (it does not decode to req.path) is a 400, and the connection
    -- closes (what follows on it cannot be trusted)
    if not req.rawPath then
      if not a.websocket then srv:hangup(id) end
      res._handshake = a.websocket
      res:_send(400, { ["content-type"] = "application/json", connection = "close" },
        cjson.encode(api_errors.envelope("BAD_REQUEST",
          "refused request head: the request line as sent could not be told from the stream", {}, 400)))
      res._handshake = false
      return
    end
    if a.length_required then
      res:_send(411, { ["content-type"] = "application/json" }, cjson.encode(api_errors.envelope("LENGTH_REQUIRED",
        "send the request body with a Content-Length (chunked bodies are not accepted)", {}, 411)))
      return
    end
    if a.too_large then
      res:_send(413, { ["content-type"] = "application/json" }, cjson.encode(api_errors.envelope("REQUEST_TOO_LARGE",
        ("the request body is larger than %d bytes"):format(self.maxBody), { maxBodyBytes = self.maxBody }, 413)))
      return
    end
    res._handshake = a.websocket -- until the handler first waits, a refusal is a plain response
    async.spawn(run_handler, self, req, res)
    res._handshake = false
  elseif kind == "message" then
    local res = self._live[id]
    if res and res._ws then res._ws:_push(a, b) end
  elseif kind == "drain" then
    local res = self._live[id]
    if res then
      -- a WebSocket's drain follows each message or fragment written, a
      -- response's an empty queue
      local queued = self._core:queued(id)
      res._pending = (queued == nil or queued == 0 or not res._ws) and 0 or math.max(0, (res._pending or 1) - 1)
      account(res, queued)
      wake(res)
    end
  elseif kind == "refused" then
    -- a head src/http/conn.c answered itself (400 smuggling-shaped, 431 too
    -- large; id is the status): no request was made of it, but it is counted
    -- and logged like one
    if self.onDone then
      local ok, err = pcall(self.onDone, {}, { status = id, bytes = 0, durationMs = 0 })
      if not ok then io.stderr:write("moonbox: http: onDone: ", errors.format(err), "\n") end
    end
  elseif kind == "done" or kind == "closed" then
    local res = self._live[id]
    self._live[id] = nil
    if res then release(res) end
    if res and not res._logged then
      res._logged = true
      self._inflight = self._inflight - 1
      res.durationMs = now_ms() - res.startedMs
      res.clientGone = kind == "closed" -- (set_closed follows: onDone sees it first)
      if self.onDone then
        local ok, err = pcall(self.onDone, res.req, res)
        if not ok then io.stderr:write("moonbox: http: onDone: ", errors.format(err), "\n") end
      end
    end
    if res and (kind == "closed" or res.req.websocket) then set_closed(res) end
  end
end

-- http.listen(opts, handler) -> server
function M.listen(opts, handler)
  opts = V.options(opts, { listen = true, maxBody = true, maxConnections = true, idleTimeoutMs = true },
    "listen options")
  V.type(handler, "function", "handler")
  local addr = M.parse_listen(opts.listen or "127.0.0.1:8080")
  local function positive(name, default)
    local v = opts[name]
    if v == nil then return default end
    if type(v) ~= "number" or v < 1 or v % 1 ~= 0 then V.fail(name, "expected a positive integer") end
    return v
  end
  local self = setmetatable({
    handler = handler, maxBody = positive("maxBody", 1024 * 1024),
    maxConnections = positive("maxConnections", 256), idleTimeoutMs = positive("idleTimeoutMs", 30000),
    _live = {}, _inflight = 0,
  }, Server)
  local srv, msg, code = core.http_listen({
    host = addr.host, port = addr.port, unix = addr.unix, max_body = self.maxBody,
    max_connections = self.maxConnections, idle_timeout_ms = self.idleTimeoutMs,
  }, function(kind, id, a, b) self:_on_event(kind, id, a, b) end)
  if not srv then
    -- "EADDRINUSE: address already in use (127.0.0.1)": the errno name
    -- goes to context, the message reads as a sentence
    local text = tostring(msg):gsub("^E[%u%d]+: ", ""):gsub(" %([^()]*%)$", "")
    errors.raise("LISTEN_FAILED", ("cannot listen on %s: %s"):format(opts.listen or "127.0.0.1:8080", text),
      { errno = code })
  end
  self._core = srv
  self.address = addr.unix and ("unix:" .. addr.unix) or ("%s:%d"):format(addr.host, srv:port())
  self.isLocal = M.is_local(addr)
  return self
end

-- Stop listening and drop every connection: streams see res.closed, sockets end.
function Server:close()
  if self.closed then return end
  self.closed = true
  self._core:close()
  for _, res in pairs(self._live) do release(res) end
end

-- Stop taking connections (they are hung up at accept) and answer any
-- further request on an open one 503 SHUTTING_DOWN; what runs goes on.
function Server:drain()
  if self.closed or self.draining then return end
  self.draining = true
  self._core:drain()
end

-- Requests being answered now (their handler runs or their response is being sent).
function Server:inflight() return self._inflight end

-- Connections hung up at accept so far, and accepts the kernel refused (out of fds).
function Server:refused()
  if self.closed then return 0, 0 end
  return self._core:refused()
end

function Server:connections()
  return self.closed and 0 or self._core:connections()
end

-- Response bytes queued for clients now (the metrics' gauge).
function Server:queued_bytes()
  local buffered = 0
  for id, res in pairs(self._live) do
    local q = not self.closed and self._core:queued(id)
    if q and not res.closed then buffered = buffered + q end
  end
  return buffered
end

-- At shutdown: every WebSocket closes with 1001; every streamed response
-- still open ends, an SSE one after final_sse (the bytes of a last event).
function Server:end_streams(final_sse)
  for _, res in pairs(self._live) do
    if res._ws then
      res._ws:close(1001, "server shutting down")
    elseif res._streaming and not res._finished and not res.closed then
      if tostring(res.contentType or ""):match("^text/event%-stream") then
        self._core:write(res._id, final_sse)
        res.bytes = (res.bytes or 0) + #final_sse
      end
      res:finish()
    end
  end
end

return M
