-- The proxy to exposed ports (issue #16; lua/moonbox/sandbox/ports.lua): HTTP and
-- WebSocket requests to
--   /v1/sandboxes/{id}/ports/{port}/...   (the path form), and
--   http://{port}-{id}.localhost:<serve port>/...   (the host-name form)
-- go to the port inside the sandbox, connected from inside the sandbox's
-- network namespace (a socket its init makes there, as waitForPort's probe):
-- the sandbox keeps network = "none" and nothing listens on the host for it.
--
-- Both ways stream with bounded buffers (issue 29, finding 1): the
-- upstream is read at most READ_HIGH bytes ahead of what the client took
-- (reading stops until res:write or ws:sendFragment has passed it on; the
-- unread bytes count in the server-wide send budget), into a list of
-- chunks taken at an offset, never a growing string. A WebSocket frame's
-- payload goes to the client as fragments of SLICE bytes as it arrives, so
-- no message is ever whole here. A request body (already bounded by the
-- server's maxBody) or a client's WebSocket message is written upstream a
-- slice at a time, each once the last drained below HIGH_WATER. One
-- upstream connection per request ("Connection: close"); a chunked upstream
-- response is de-chunked and sent on without a length (the client
-- connection then closes at its end).
--
-- Token: as the rest of the server (docs/server.md): Authorization: Bearer,
-- or (for a browser) ?access_token= once, which sets a cookie scoped to that
-- port's URL and redirects to the URL without it. A port exposed with
-- public = true takes no token. The token and its cookie are not passed on.
local core = require "moonbox.core"
local async = require "moonbox.async"
local errors = require "moonbox.errors"
local api_errors = require "moonbox.server.api_errors"
local util = require "moonbox.lib.util"
local sandbox_mod = require "moonbox.sandbox"
local ports = require "moonbox.sandbox.ports"
local probe = require "moonbox.process.probe"
local token_mod = require "moonbox.server.token"
local send_budget = require "moonbox.server.send_budget"
local cjson = require "cjson.safe"
local bit = require "bit"
local ffi = require "ffi"

local M = {}

M.READ_HIGH = 256 * 1024        -- upstream bytes read ahead of the client
M.HIGH_WATER = 256 * 1024       -- upstream write queue before the writer waits
M.MAX_HEADER = 64 * 1024        -- the upstream's response head
M.SLICE = 64 * 1024            -- a WebSocket fragment passed on, either way
M.HEAD_TIMEOUT_MS = 120000      -- for the service's response head (504 PORT_TIMEOUT after)

local HOP = { connection = true, ["keep-alive"] = true, ["proxy-connection"] = true, te = true,
  trailer = true, ["transfer-encoding"] = true, upgrade = true, ["proxy-authorization"] = true,
  ["proxy-authenticate"] = true, ["content-length"] = true, host = true,
  -- the body is read whole before it is passed on: a 100 Continue was ours to send
  expect = true,
  -- the WebSocket handshake is made anew upstream
  ["sec-websocket-key"] = true, ["sec-websocket-version"] = true, ["sec-websocket-extensions"] = true,
  ["sec-websocket-accept"] = true }

local function json(status, code, message, extra)
  local h = { ["content-type"] = "application/json" }
  for k, v in pairs(extra or {}) do h[k] = v end
  return { status = status, headers = h,
    body = cjson.encode(api_errors.envelope(code, message, {}, status)) .. "\n" }
end

-- ---- which requests ----------------------------------------------------------------

-- match(req) -> {id, port, target, form, prefix} | nil. target: what to
-- request upstream (path and query as sent by the client).
function M.match(req)
  local raw = req.rawTarget or (req.path .. (req.rawQuery ~= "" and req.rawQuery and ("?" .. req.rawQuery) or ""))
  local host = req.headers and req.headers["host"]
  if host then
    local port, id = host:lower():match("^(%d+)%-([a-z0-9_-]+)%.localhost:?%d*$")
    if port then
      return { id = id, port = tonumber(port), target = raw, form = "host", prefix = "/" }
    end
  end
  local id, port, rest = raw:match("^/v1/sandboxes/([a-z0-9_-]+)/ports/(%d+)(.*)$")
  if not id then return nil end
  if rest == "" or rest:sub(1, 1) == "?" then
    -- /ports/{port} itself: DELETE unexposes (the JSON API); a browser is
    -- sent on to the directory URL so that relative links resolve
    if req.method ~= "GET" and req.method ~= "HEAD" then return nil end
    return { id = id, port = tonumber(port), redirect = "/v1/sandboxes/" .. id .. "/ports/" .. port .. "/" .. rest }
  end
  if rest:sub(1, 1) ~= "/" then return nil end
  local prefix = "/v1/sandboxes/" .. id .. "/ports/" .. port .. "/"
  return { id = id, port = tonumber(port), target = rest, form = "path", prefix = prefix }
end

-- ---- tokens ----------------------------------------------------------------------------
-- What authorizes a request is what is taken out of it before it is passed
-- on, read the same way both times: the query is split on '&' and each
-- name percent-decoded once (as the service will), the Authorization
-- scheme is compared without case (RFC 9110), and no cookie of ours
-- (moonbox_*) goes on. A port's cookie is not the token: it is
-- HMAC(token, sandbox and port) under a name of its own
-- (moonbox.server.token), so it opens that one port of that one sandbox;
-- the page's cookie (moonbox_token) opens no port at all.

local function pct_decode(s)
  return (s:gsub("+", " "):gsub("%%(%x%x)", function(h) return string.char(tonumber(h, 16)) end))
end

-- The credential of an Authorization header with the Bearer scheme (any case), or nil.
local function bearer(req)
  local auth = req.headers["authorization"]
  if type(auth) ~= "string" then return nil end
  local scheme, cred = auth:match("^%s*(%S+)%s+(%S+)%s*$")
  if scheme and scheme:lower() == "bearer" then return cred end
  return nil
end

-- The request's cookies: a list of {name, value, raw}.
local function cookies(req)
  local out = {}
  local c = req.headers["cookie"]
  if type(c) ~= "string" then return out end
  for part in c:gmatch("[^;]+") do
    local raw = part:match("^%s*(.-)%s*$")
    local name, value = raw:match("^([^=]*)=(.*)$")
    if raw ~= "" then out[#out + 1] = { name = name or raw, value = value or "", raw = raw } end
  end
  return out
end

local function ours(name)
  return name:lower():sub(1, 8) == "moonbox_"
end

-- split_query(target, token) -> path-and-kept-query, {access_token values}:
-- every parameter whose decoded name is access_token is taken out (its
-- value kept for the check), and so is any that holds the token at all.
local function split_query(target, token)
  local path, query = target:match("^([^?]*)%??(.*)$")
  local kept, given = {}, {}
  for part in query:gmatch("[^&]+") do
    local name, value = part:match("^([^=]*)=?(.*)$")
    if pct_decode(name) == "access_token" then
      given[#given + 1] = pct_decode(value)
    elseif not (token and pct_decode(part):find(token, 1, true)) then
      kept[#kept + 1] = part
    end
  end
  if #kept == 0 then return path, given end
  return path .. "?" .. table.concat(kept, "&"), given
end

-- Does the request carry the server's token (or this port's cookie)?
-- -> true | false, and whether it came by the query (a browser to redirect).
local function authorize(req, target, token, equal, given_query)
  if not token then return true, false end
  local b = bearer(req)
  if b and equal(b, token) then return true, false end
  for _, v in ipairs(given_query) do
    if equal(v, token) then return true, true end
  end
  local name, value = token_mod.port_cookie(token, target.id, target.port)
  for _, c in ipairs(cookies(req)) do
    if c.name == name and equal(c.value, value) then return true, false end
  end
  return false, false
end

-- The request's headers to pass on: all but hop-by-hop ones, without our
-- credentials: an Authorization that holds the token (in any scheme or
-- case), our cookies, and any header whose value holds the token.
-- Every request header is in req.headers' keys; these common ones are
-- also looked up by name (req.headers' __index), as before.
M.EXTRA_HEADERS = { "x-requested-with", "x-csrf-token", "x-xsrf-token", "x-request-id", "x-api-key",
  "sec-fetch-site", "sec-fetch-mode", "sec-fetch-dest", "sec-fetch-user", "priority" }

local function holds(v, token)
  if not token then return false end
  v = tostring(v)
  if v:find(token, 1, true) then return true end
  -- Basic credentials hold it base64-encoded
  local b64 = v:match("^%s*[Bb][Aa][Ss][Ii][Cc]%s+(%S+)")
  local plain = b64 and core.base64_decode and core.base64_decode(b64)
  return type(plain) == "string" and plain:find(token, 1, true) ~= nil
end

local function forward_headers(req, token)
  local out = {}
  for k, v in pairs(req.headers) do
    if not HOP[k] then out[k] = v end
  end
  for _, k in ipairs(M.EXTRA_HEADERS) do
    if out[k] == nil then out[k] = req.headers[k] end
  end
  if out["authorization"] and token and (bearer(req) == token or holds(out["authorization"], token)) then
    out["authorization"] = nil
  end
  if out["cookie"] then
    local kept = {}
    for _, c in ipairs(cookies(req)) do
      if not ours(c.name) and not holds(c.raw, token) then kept[#kept + 1] = c.raw end
    end
    out["cookie"] = #kept > 0 and table.concat(kept, "; ") or nil
  end
  for k, v in pairs(out) do
    if holds(v, token) then out[k] = nil end
  end
  out["x-forwarded-host"] = req.headers["host"]
  out["x-forwarded-proto"] = "http"
  if req.peer and req.peer ~= "" then out["x-forwarded-for"] = req.peer end
  return out
end

-- An upstream Set-Cookie as the client may get it, or nil: none of ours
-- (moonbox_*) and no Domain (host-only: no other sandbox's host-name origin
-- shares it); in the path form its Path mapped under the port's prefix
-- (Path=/ is the port's root), so it goes to no other port's path.
local function client_set_cookie(v, target)
  local name = v:match("^%s*([^=;]*)")
  if not name or name:match("^%s*$") or ours(name:match("^%s*(.-)%s*$")) then return nil end
  local parts, path = {}, nil
  for attr in v:gmatch("[^;]+") do
    attr = attr:match("^%s*(.-)%s*$")
    if #parts == 0 then
      parts[1] = attr
    else
      local key, value = attr:match("^([^=]*)=?(.*)$")
      key = key:match("^%s*(.-)%s*$"):lower()
      if key == "path" then
        path = value:match("^%s*(.-)%s*$")
      elseif key ~= "domain" and attr ~= "" then
        parts[#parts + 1] = attr
      end
    end
  end
  if target.form == "path" then
    if not path or path:sub(1, 1) ~= "/" then path = "/" end
    path = target.prefix .. path:gsub("^/+", "")
  end
  if path then parts[#parts + 1] = "Path=" .. path end
  return table.concat(parts, "; ")
end

-- The path form shares the server's origin with /v1, the page and every
-- other sandbox's ports: its responses are given an opaque origin (a CSP
-- sandbox without allow-same-origin), so a tenant's page there cannot
-- read other paths of the server with the operator's cookies.
M.PATH_FORM_CSP = "sandbox allow-scripts allow-forms allow-popups allow-popups-to-escape-sandbox " ..
  "allow-modals allow-downloads allow-pointer-lock allow-presentation"

-- ---- upstream ------------------------------------------------------------------------

-- connect(sandbox, port) -> stream | nil, message: from inside the
-- sandbox's network namespace when it has one of its own.
local function connect(sb, port)
  local fd, err = probe.connect("127.0.0.1", port, { sandbox = sb }, "proxy connect")
  if not fd then return nil, tostring(err) end
  local stream, msg = core.stream_open(fd)
  if not stream then
    core.close_fd(fd)
    return nil, tostring(msg)
  end
  return stream
end

-- A reader over a stream. The chunks read wait in a queue, the first one
-- taken from at an offset: nothing read is ever joined to what came before
-- (a growing string would copy it all again at every read).
--   r.take(n) -> up to n bytes (a chunk or part of one) | nil at EOF
--   r.read()  -> the rest of the next chunk | nil at EOF
--   r.exact(n) -> n bytes | nil at EOF (small n: a frame head)
-- At most READ_HIGH bytes wait unread (none past one chunk while the
-- server-wide send budget is spent); past that, reading stops until they
-- are taken. Unread bytes count in the send budget (send_budget.lua).
local function reader(stream)
  local r = { queue = {}, head = 1, tail = 0, off = 0, bytes = 0, eof = false, reading = false }
  local function wake()
    local w = r.waiter
    if w then r.waiter = nil w() end
  end
  local function high()
    return send_budget.full() and 1 or M.READ_HIGH
  end
  local function count(n)
    r.bytes = r.bytes + n
    send_budget.add(n)
  end
  local function on_read(err, data)
    if r.closed then return end
    if data then
      r.tail = r.tail + 1
      r.queue[r.tail] = data
      count(#data)
      if r.bytes >= high() then
        stream:read_stop()
        r.reading = false
      end
    else
      r.eof, r.err, r.reading = true, err, false
    end
    wake()
  end
  local function start()
    if r.reading or r.eof or r.closed then return end
    r.reading = true
    if not stream:read_start(on_read) then r.eof, r.reading = true, false end
  end
  function r.take(n)
    while r.head > r.tail do
      if r.eof or r.closed then return nil, r.err end
      start()
      async.await(function(resume)
        r.waiter = resume
        return function() if r.waiter == resume then r.waiter = nil end end
      end, "proxy read")
    end
    local d, off = r.queue[r.head], r.off
    local k = math.min(n, #d - off)
    local piece = (off == 0 and k == #d) and d or d:sub(off + 1, off + k)
    if off + k == #d then
      r.queue[r.head], r.head, r.off = nil, r.head + 1, 0
    else
      r.off = off + k
    end
    count(-k)
    if r.bytes < high() then start() end
    return piece
  end
  function r.read() return r.take(math.huge) end
  function r.exact(n)
    local parts, got = {}, 0
    while got < n do
      local piece = r.take(n - got)
      if not piece then return nil end
      parts[#parts + 1], got = piece, got + #piece
    end
    return table.concat(parts)
  end
  -- r.line(max) -> the next line without its CRLF | nil at EOF or past
  -- max bytes: found in each chunk from the offset, nothing copied twice
  function r.line(max)
    local parts, got = {}, 0
    while true do
      if r.head > r.tail and not r.take(0) then return nil end
      local d, off = r.queue[r.head], r.off
      local nl = d:find("\n", off + 1, true)
      local piece = r.take((nl or #d) - off)
      parts[#parts + 1], got = piece, got + #piece
      if nl then return (table.concat(parts):gsub("\r?\n$", "")) end
      if got > max then return nil end
    end
  end
  -- whether bytes wait unread (a take would not wait)
  function r.ready() return r.head <= r.tail end
  -- push back what was read past a boundary (the rest of a chunk r.read gave)
  function r.unread(d)
    if d == "" then return end
    r.head = r.head - 1
    r.queue[r.head] = d
    count(#d)
  end
  function r.stop()
    if r.closed then return end
    r.closed = true
    count(-r.bytes) -- what waits unread is dropped
    r.queue, r.head, r.tail, r.off = {}, 1, 0, 0
    wake()
  end
  start()
  return r
end

-- write(stream, data) -> true | false: waits (in the task) while more
-- than HIGH_WATER bytes are queued for the upstream.
local function write(stream, data)
  local state = {}
  local queued = stream:write(data, function(err)
    state.done = err and "error" or "ok"
    if state.resume then state.resume(state.done) end
  end)
  if not queued then return false end
  if queued <= M.HIGH_WATER then return true end
  if state.done then return state.done == "ok" end
  return async.await(function(resume)
    state.resume = resume
    return function() state.resume = nil end
  end, "proxy write") == "ok"
end

-- ---- the response head --------------------------------------------------------------

-- read_head(r) -> status, headers (lowercase name -> value) | nil, message
-- The head's chunks are kept in a list and only the last three bytes of
-- what came before are looked at again (a service that sends its head a
-- byte at a time costs no more than one that sends it at once).
local function read_head(r)
  local parts, size, tail = {}, 0, ""
  while true do
    local chunk = r.read()
    if not chunk then return nil, "the service closed the connection before a response" end
    local joined = tail .. chunk
    local e = joined:find("\r\n\r\n", 1, true)
    if e then
      local cut = e + 3 - #tail -- the head's last byte, in chunk
      r.unread(chunk:sub(cut + 1))
      parts[#parts + 1] = chunk:sub(1, cut)
      local head = table.concat(parts):sub(1, -3)
      local status = tonumber(head:match("^HTTP/%d%.%d (%d%d%d)"))
      if not status then return nil, "the service did not answer HTTP" end
      local headers, set_cookies = {}, {}
      for name, value in head:gmatch("\r\n([^:\r\n]+):[ \t]*([^\r\n]*)") do
        name = name:lower()
        if name == "set-cookie" then
          set_cookies[#set_cookies + 1] = value
        elseif headers[name] then
          headers[name] = headers[name] .. ", " .. value
        else
          headers[name] = value
        end
      end
      return status, headers, set_cookies
    end
    parts[#parts + 1], size, tail = chunk, size + #chunk, joined:sub(-3)
    if size > M.MAX_HEADER then return nil, "the service's response head is too large" end
  end
end

-- ---- HTTP ---------------------------------------------------------------------------

local function request_head(req, target, token)
  local lines = { ("%s %s HTTP/1.1"):format(req.method, target) }
  local headers = forward_headers(req, token)
  lines[#lines + 1] = "Host: " .. (req.headers["host"] or "localhost")
  for k, v in pairs(headers) do
    if not k:find("[\r\n:]") and not tostring(v):find("[\r\n]") then lines[#lines + 1] = k .. ": " .. v end
  end
  return lines
end

-- A chunked body de-chunked: the chunks' data is gathered up to a slice
-- and written when a slice is full or nothing more waits unread (a service
-- sending one-byte chunks costs a write per slice, not per chunk).
local function pass_chunked(r, res)
  local out, size = {}, 0
  local function flush()
    if size == 0 then return true end
    local data = table.concat(out)
    out, size = {}, 0
    return res:write(data)
  end
  while true do
    if not r.ready() and not flush() then return false end
    local line = r.line(4096)
    local chunk = line and tonumber(line:match("^%s*(%x+)"), 16)
    if not chunk then return false end
    if chunk == 0 then return flush() end -- (trailers are dropped)
    local left = chunk
    while left > 0 do
      if not r.ready() and not flush() then return false end
      local piece = r.take(math.min(left, M.SLICE))
      if not piece then return false end
      out[#out + 1], size, left = piece, size + #piece, left - #piece
      if size >= M.SLICE and not flush() then return false end
    end
    if r.exact(2) ~= "\r\n" then return false end -- the CRLF after the chunk
  end
end

-- Pass the body on: length bytes, or until EOF (nil), or chunked.
local function pass_body(r, res, length, chunked)
  if chunked then return pass_chunked(r, res) end
  local left = length
  while left == nil or left > 0 do
    local d = r.take(left or math.huge)
    if not d then return left == nil end
    if left then left = left - #d end
    if not res:write(d) then return false end
  end
  return true
end

local function proxy_http(req, res, sb, target, token)
  local stream, msg = connect(sb, target.port)
  if not stream then
    return json(502, "PORT_UNREACHABLE", ("nothing accepted a connection on port %d of sandbox %q: %s")
      :format(target.port, sb.id, msg))
  end
  local r = reader(stream)
  local ok, result = pcall(function()
    res:onClose(function() r.stop() end)
    local lines = request_head(req, target.path, token)
    local body = req.body or ""
    if #body > 0 or (req.method ~= "GET" and req.method ~= "HEAD") then
      lines[#lines + 1] = "Content-Length: " .. #body
    end
    lines[#lines + 1] = "Connection: close"
    if not write(stream, table.concat(lines, "\r\n") .. "\r\n\r\n") then return nil end
    if #body > 0 and not write(stream, body) then return nil end
    local timed_out, status, headers, set_cookies = pcall(async.timeout, M.HEAD_TIMEOUT_MS, function()
      local st, h, sc = read_head(r)
      while st and st >= 100 and st < 200 do st, h, sc = read_head(r) end -- 100 Continue
      return st, h, sc
    end)
    if not timed_out then
      if errors.is_error(status) and status.code == "TIMEOUT" then
        return json(504, "PORT_TIMEOUT", ("port %d sent no response within %d ms"):format(target.port,
          M.HEAD_TIMEOUT_MS))
      end
      error(status, 0)
    end
    if not status then return json(502, "PORT_BAD_RESPONSE", headers) end
    local chunked = (headers["transfer-encoding"] or ""):lower():find("chunked", 1, true) ~= nil
    local length = not chunked and tonumber(headers["content-length"]) or nil
    local out = {}
    for k, v in pairs(headers) do
      if not HOP[k] and k ~= "content-type" and not k:find("[%s:]") then out[k] = v end
    end
    if headers["content-type"] then out["content-type"] = headers["content-type"] end
    -- of several Set-Cookie headers, the last one the client may have (a known limit)
    for i = #set_cookies, 1, -1 do
      local c = client_set_cookie(set_cookies[i], target)
      if c then out["set-cookie"] = c break end
    end
    if target.form == "path" then
      out["service-worker-allowed"] = nil
      local csp = out["content-security-policy"]
      out["content-security-policy"] = (csp and csp ~= "") and (csp .. ", " .. M.PATH_FORM_CSP) or M.PATH_FORM_CSP
    end
    if req.method == "HEAD" or status == 204 or status == 304 then
      return { status = status, headers = out, body = "" }
    end
    if length then out["content-length"] = tostring(length) end
    if not res:start(status, out) then return nil end
    pass_body(r, res, length, chunked)
    res:finish()
    return nil
  end)
  r.stop()
  stream:close()
  if not ok then error(result, 0) end
  return result
end

-- ---- WebSocket ---------------------------------------------------------------------------

local random_bytes = util.random_bytes

-- data masked (or unmasked) with key, data's first byte being byte `offset`
-- of the payload (a payload is masked piece by piece as it streams)
local function mask(data, key, offset)
  local n = #data
  if n == 0 then return data end
  local buf = ffi.new("uint8_t[?]", n)
  ffi.copy(buf, data, n)
  local k = { key:byte(1, 4) }
  offset = offset or 0
  for i = 0, n - 1 do buf[i] = bit.bxor(buf[i], k[(i + offset) % 4 + 1]) end
  return ffi.string(buf, n)
end

-- The head of a client frame of n bytes masked with key (RFC 6455 wants
-- a client's frames masked).
local function client_head(opcode, n, key)
  local b1 = 0x80 + opcode
  local head
  if n < 126 then
    head = string.char(b1, 0x80 + n)
  elseif n < 65536 then
    head = string.char(b1, 0x80 + 126, bit.rshift(n, 8), bit.band(n, 255))
  else
    local b = {}
    local v = n
    for i = 8, 1, -1 do b[i] = v % 256 v = math.floor(v / 256) end
    head = string.char(b1, 0x80 + 127) .. string.char(unpack(b))
  end
  return head .. key
end

-- A small client frame (control frames).
local function frame(opcode, data)
  local key = random_bytes(4)
  return client_head(opcode, #data, key) .. mask(data, key)
end

-- A message from the client goes upstream as one frame (some services
-- take no fragments), masked and written a slice at a time, each slice
-- once the upstream took the last ones: never copied whole.
local function send_upstream(stream, data, is_binary)
  local key = random_bytes(4)
  if not write(stream, client_head(is_binary and 2 or 1, #data, key)) then return false end
  for at = 1, #data, M.SLICE do
    if not write(stream, mask(data:sub(at, at + M.SLICE - 1), key, at - 1)) then return false end
  end
  return true
end

-- frame_head(r) -> fin, opcode, payload length, mask key (nil: unmasked) | nil
local function frame_head(r)
  local h = r.exact(2)
  if not h then return nil end
  local b1, b2 = h:byte(1, 2)
  local len = bit.band(b2, 0x7f)
  if len == 126 then
    local e = r.exact(2)
    if not e then return nil end
    len = e:byte(1) * 256 + e:byte(2)
  elseif len == 127 then
    local e = r.exact(8)
    if not e or e:byte(1) >= 0x20 then return nil end -- (2^61 and more: nobody's payload)
    len = 0
    for i = 1, 8 do len = len * 256 + e:byte(i) end
  end
  local key
  if bit.band(b2, 0x80) ~= 0 then
    key = r.exact(4)
    if not key then return nil end
  end
  return bit.band(b1, 0x80) ~= 0, bit.band(b1, 0x0f), len, key
end

-- Pass a data frame's payload to the client as fragments of at most SLICE
-- bytes as it arrives, each sent once the client took enough of the last
-- (ws:sendFragment waits): the upstream is read no faster than the client
-- reads, and no message is ever whole in memory. Fragment boundaries are
-- the proxy's own (RFC 6455 5.4 lets an intermediary refragment).
local function pass_payload(r, ws, len, key, is_binary, last)
  if len == 0 then return ws:sendFragment("", is_binary, not last) end
  local left, offset = len, 0
  while left > 0 do
    local piece = r.take(math.min(left, M.SLICE))
    if not piece then return false end
    if key then piece = mask(piece, key, offset) end
    offset, left = offset + #piece, left - #piece
    if not ws:sendFragment(piece, is_binary, not (last and left == 0)) then return false end
  end
  return true
end

-- Read a control frame's payload (at most 125 bytes).
local function control_payload(r, len, key)
  if len > 125 then return nil end
  local payload = len > 0 and r.exact(len) or ""
  if payload and key then payload = mask(payload, key) end
  return payload
end

-- Copy the upstream's frames to the client until either side closes.
local function pass_frames(r, ws, stream)
  local open -- the opcode of the message being passed on (nil: none)
  while true do
    local fin, opcode, len, key = frame_head(r)
    if fin == nil then return end
    if opcode >= 8 then
      local payload = control_payload(r, len, key)
      if not payload then return ws:close(1002, "bad control frame from the service") end
      if opcode == 8 then
        local code = #payload >= 2 and payload:byte(1) * 256 + payload:byte(2) or 1000
        return ws:close(code, payload:sub(3, 122))
      elseif opcode == 9 then
        write(stream, frame(10, payload))
      end
    elseif opcode <= 2 then
      if (opcode == 0) ~= (open ~= nil) then return ws:close(1002, "bad fragment from the service") end
      open = open or opcode
      if not pass_payload(r, ws, len, key, open == 2, fin) then return end
      if fin then open = nil end
    else
      return ws:close(1002, "unknown opcode from the service")
    end
  end
end

local function proxy_ws(req, res, sb, target, token)
  local ws = res:upgrade() -- at once: messages that arrive before it would be lost
  local stream, msg = connect(sb, target.port)
  if not stream then
    ws:close(1011, ("port %d: %s"):format(target.port, msg):sub(1, 120))
    return
  end
  local r = reader(stream)
  local pump
  local ok, err = pcall(function()
    local lines = request_head(req, target.path, token)
    lines[#lines + 1] = "Connection: Upgrade"
    lines[#lines + 1] = "Upgrade: websocket"
    lines[#lines + 1] = "Sec-WebSocket-Version: 13"
    lines[#lines + 1] = "Sec-WebSocket-Key: " .. core.base64_encode(random_bytes(16))
    if not write(stream, table.concat(lines, "\r\n") .. "\r\n\r\n") then return end
    local status, headers = read_head(r)
    if status ~= 101 then
      ws:close(1011, ("the service refused the WebSocket (%s)"):format(tostring(status or headers)):sub(1, 120))
      return
    end
    -- the client's messages go upstream in a task of their own (each
    -- written once the upstream took the last: a client that sends faster
    -- than the service reads fills the socket's inbox, which is bounded)
    pump = async.spawn(function()
      pcall(function()
        for data, is_binary in ws:messages() do
          if not send_upstream(stream, data, is_binary) then break end
        end
        write(stream, frame(8, string.char(0x03, 0xe8)))
      end)
      r.stop()
    end)
    pass_frames(r, ws, stream)
    ws:close(1000, "")
  end)
  r.stop()
  if pump then pump:cancel() end
  stream:close()
  if not ok and not (errors.is_error(err) and err.code == "CANCELLED") then error(err, 0) end
end

-- ---- entry ---------------------------------------------------------------------------

-- handle(req, res, target, opts) with opts.token (the server's, or nil)
-- and opts.equal (a constant-time comparison).
function M.handle(req, res, target, opts)
  local token = opts.token
  local sb = sandbox_mod.all()[target.id]
  local entry = sb and not sb.destroyed and ports.get(sb, target.port) or nil
  if target.redirect then
    return { status = 308, headers = { location = target.redirect, ["content-type"] = "text/plain" }, body = "" }
  end
  local path, given = split_query(target.target, token)
  local authorized, by_query = authorize(req, target, token, opts.equal, given)
  if not authorized and not (entry and entry.public) then
    return json(401, "UNAUTHORIZED", "a valid token is required: Authorization: Bearer, or ?access_token= once",
      { ["www-authenticate"] = 'Bearer realm="moonbox"' })
  end
  if not entry then
    if not sb then return json(404, "SANDBOX_NOT_FOUND", ("no sandbox %q"):format(target.id)) end
    return json(404, "PORT_NOT_EXPOSED", ("port %d of sandbox %q is not exposed"):format(target.port, target.id))
  end
  if by_query and not req.websocket and (req.method == "GET" or req.method == "HEAD") then
    -- a browser: keep this port's cookie for its URLs, and go on without
    -- the token in the URL, to a path of this origin only (a target
    -- "//evil.example/" is the path "/evil.example/", not another host)
    local location = target.form == "path" and (target.prefix:sub(1, -2) .. path)
      or ("/" .. path:gsub("^[/\\%s%c]+", ""))
    local name, value = token_mod.port_cookie(token, target.id, target.port)
    return { status = 302, body = "", headers = { location = location, ["content-type"] = "text/plain",
      ["set-cookie"] = ("%s=%s; Path=%s; HttpOnly; SameSite=Lax"):format(name, value, target.prefix),
      ["cache-control"] = "no-store" } }
  end
  target.path = path
  if req.websocket then return proxy_ws(req, res, sb, target, token) end
  return proxy_http(req, res, sb, target, token)
end

return M
