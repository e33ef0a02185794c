-- JSON for the HTTP API. Requests are decoded with lua-cjson (strictly: an
-- object, valid UTF-8, bounded depth); responses are encoded here, because
-- the lua-cjson of Debian 12 (2.1.0) cannot tell an empty array from an
-- empty object and lets invalid UTF-8 through into its output.
local cjson = require "cjson.safe"
local core = require "moonbox.core"
local async = require "moonbox.async"
local ffi = require "ffi"
local errors = require "moonbox.errors"
local V = require "moonbox.lib.validate"

local M = {}

M.MAX_DEPTH = 32

-- A table marked with array() is encoded as a JSON array, also when empty.
local ARRAY = { __name = "json array" }
function M.array(t) return setmetatable(t or {}, ARRAY) end

-- info().network of an egress sandbox: its rule lists are arrays, empty too
function M.network(net)
  if type(net) == "table" and net.egress then
    M.array(net.egress.allow)
    M.array(net.egress.deny)
  end
  return net
end

-- ---- decoding ----------------------------------------------------------------

local decoder = cjson.new()
decoder.decode_max_depth(M.MAX_DEPTH)
decoder.decode_invalid_numbers(false) -- no NaN, Infinity or hex numbers

-- null inside a value becomes false (the Lua API's "unset", as in env maps);
-- strings (keys too) must be valid UTF-8 (a lone surrogate escape is not).
local function clean(v, field)
  if v == cjson.null then return false end
  if type(v) == "string" then
    if not core.utf8_valid(v) then V.fail(field, "not valid UTF-8") end
  elseif type(v) == "number" then
    -- 1e400 is valid JSON that no double holds: cjson makes it inf
    if v ~= v or v == math.huge or v == -math.huge then V.fail(field, "a number out of range") end
  elseif type(v) == "table" then
    for k, x in pairs(v) do
      local name = type(k) == "number" and ("%s[%d]"):format(field, k) or field .. "." .. tostring(k)
      if type(k) == "string" and not core.utf8_valid(k) then V.fail(field, "a key is not valid UTF-8") end
      v[k] = clean(x, name)
    end
  end
  return v
end

-- decode_object(body) -> table: the fields of a JSON object body. An empty
-- body is an empty object; a null field is dropped (= not given).
function M.decode_object(body)
  if body == nil or not body:find("%S") then return {} end
  if not core.utf8_valid(body) then V.fail("body", "not valid UTF-8") end
  if not body:match("^%s*{") then V.fail("body", "expected a JSON object") end
  local value, err = decoder.decode(body)
  if value == nil then V.fail("body", "malformed JSON: " .. tostring(err)) end
  for k, x in pairs(value) do
    if not core.utf8_valid(k) then V.fail("body", "a key is not valid UTF-8") end
    if x == cjson.null then value[k] = nil else value[k] = clean(x, k) end
  end
  return value
end

-- ---- encoding ----------------------------------------------------------------

-- every character quote() escapes, to its escape (a table: gsub makes no
-- Lua call per character, which a megabyte of control characters would pay)
local escapes = { ['"'] = '\\"', ["\\"] = "\\\\", ["\b"] = "\\b", ["\f"] = "\\f", ["\n"] = "\\n",
  ["\r"] = "\\r", ["\t"] = "\\t" }
for b = 0, 127 do
  local c = string.char(b)
  if c:find("%c") and not escapes[c] then escapes[c] = ("\\u%04x"):format(b) end
end
local ESCAPED = '[%c"\\]'

-- The same escapes as a byte table for the big strings body() sends: a
-- JIT-compiled loop counts and escapes 16 MiB of control characters in
-- tens of milliseconds, where gsub takes seconds of the loop's time.
local ESC_LEN = ffi.new("uint8_t[256]")
local ESC_BYTES = ffi.new("uint8_t[?]", 256 * 6)
for b = 0, 255 do
  local e = escapes[string.char(b)]
  ESC_LEN[b] = e and #e or 1
  if e then ffi.copy(ESC_BYTES + b * 6, e, #e) end
end

-- The escaped length of s's bytes from..to (1-based, inclusive).
local function escaped_length(s, from, to)
  local p = ffi.cast("const uint8_t *", s)
  local n = 0
  for i = from - 1, to - 1 do n = n + ESC_LEN[p[i]] end
  return n
end

-- s's bytes from..to, escaped (s valid UTF-8: bytes >= 0x80 pass as they are)
local function escape_range(s, from, to)
  local len = escaped_length(s, from, to)
  if len == to - from + 1 then return s:sub(from, to) end
  local out = ffi.new("uint8_t[?]", len)
  local p = ffi.cast("const uint8_t *", s)
  local o = 0
  for i = from - 1, to - 1 do
    local b = p[i]
    local l = ESC_LEN[b]
    if l == 1 then
      out[o] = b
    else
      for k = 0, l - 1 do out[o + k] = ESC_BYTES[b * 6 + k] end
    end
    o = o + l
  end
  return ffi.string(out, len)
end

-- Invalid UTF-8 sequences become U+FFFD. Fields that carry raw bytes are
-- base64-encoded by the API before they get here (see binary_field).
function M.valid_utf8(s)
  local ok, pos = core.utf8_valid(s)
  if ok then return s end
  local out = {}
  while not ok do
    out[#out + 1] = s:sub(1, pos - 1)
    out[#out + 1] = "\239\191\189"
    s = s:sub(pos + 1)
    ok, pos = core.utf8_valid(s)
  end
  out[#out + 1] = s
  return table.concat(out)
end

local function quote(s)
  return '"' .. M.valid_utf8(s):gsub(ESCAPED, escapes) .. '"'
end

-- Strings longer than this are quoted slice by slice by body() (never as
-- one string up to six times their size).
M.BIG = 64 * 1024
M.RAW_SLICE = 16 * 1024
M.YIELD_EVERY = 1024 * 1024

-- A big field of a response body, sent in slices by body(): a table with
-- the PART metatable and
--   length()  its JSON length, quotes included (may yield: a task's loop runs on)
--   slices()  an iterator over its JSON text, a slice at a time
--   whole()   its JSON text as one string (a WebSocket reply; encode())
--   held      the bytes it keeps in memory until sent
--   release() lets go of them (the body is sent, or refused)
-- A string longer than BIG becomes one (string_part); server/json_bytes.lua
-- makes them from core.bytes buffers (an exec's output).
M.PART = { __name = "json body part" }

-- #quote(slice) summed over slices from(at, to) of n bytes, 1-based; in a
-- task it lets the loop run every YIELD_EVERY bytes (other clients do not
-- wait for a 100 MB count)
function M.quoted_length(n, slice)
  local total = 2
  local in_task = async.in_task()
  local step = math.min(M.RAW_SLICE * 4, M.YIELD_EVERY)
  for at = 1, n, step do
    if in_task and at > 1 and (at - 1) % M.YIELD_EVERY < step then async.sleep(0) end
    local s, from, to = slice(at, math.min(n, at + step - 1))
    total = total + escaped_length(s, from, to)
  end
  return total
end

-- The quoted slices of n bytes, one per call, then nil; slice(at, to) ->
-- string, from, to (the bytes at..to are the string's from..to).
function M.quoted_slices(n, slice)
  local at = 1
  return function()
    if at > n + 1 then return nil end
    local piece = ""
    if n > 0 then piece = escape_range(slice(at, math.min(n, at + M.RAW_SLICE - 1))) end
    if at == 1 then piece = '"' .. piece end
    at = at + M.RAW_SLICE
    if at > n then piece = piece .. '"' at = n + 2 end
    return piece
  end
end

-- A big valid UTF-8 string as a part.
local function string_part(text)
  local function slice(from, to) return text, from, to end
  return setmetatable({
    held = #text,
    length = function() return M.quoted_length(#text, slice) end,
    slices = function() return M.quoted_slices(#text, slice) end,
    whole = function() return quote(text) end,
    release = function() end,
  }, M.PART)
end

local function is_sequence(t)
  local n = #t
  if n == 0 then return false end
  local count = 0
  for _ in pairs(t) do count = count + 1 end
  return count == n
end

local encode_value

local function encode_table(t, buf, depth)
  if depth > M.MAX_DEPTH then error("JSON encode: nesting deeper than " .. M.MAX_DEPTH, 0) end
  if errors.is_error(t) then
    -- an error value: its public fields only (no traceback)
    t = { code = t.code, message = t.message, context = t.context }
  end
  if getmetatable(t) == ARRAY or is_sequence(t) then
    buf[#buf + 1] = "["
    for i = 1, #t do
      if i > 1 then buf[#buf + 1] = "," end
      encode_value(t[i], buf, depth + 1)
    end
    buf[#buf + 1] = "]"
    return
  end
  buf[#buf + 1] = "{"
  local first = true
  for k, v in pairs(t) do
    local kt, vt = type(k), type(v)
    -- "_" marks fields private to the runtime; functions and handles have no JSON form
    if (kt == "string" and k:sub(1, 1) ~= "_" or kt == "number")
      and vt ~= "function" and vt ~= "thread" and (vt ~= "userdata" or v == cjson.null) then
      if not first then buf[#buf + 1] = "," end
      first = false
      buf[#buf + 1] = quote(tostring(k))
      buf[#buf + 1] = ":"
      encode_value(v, buf, depth + 1)
    end
  end
  buf[#buf + 1] = "}"
end

function encode_value(v, buf, depth)
  local t = type(v)
  if t == "string" and buf.sliced and #v > M.BIG then
    buf[#buf + 1] = string_part(M.valid_utf8(v)) -- quoted later, in slices (body())
  elseif t == "string" then
    buf[#buf + 1] = quote(v)
  elseif t == "number" then
    if v ~= v or v == math.huge or v == -math.huge then
      buf[#buf + 1] = "null"
    elseif v % 1 == 0 and v > -2 ^ 53 and v < 2 ^ 53 then
      buf[#buf + 1] = ("%d"):format(v)
    else
      buf[#buf + 1] = ("%.14g"):format(v)
    end
  elseif t == "boolean" then
    buf[#buf + 1] = v and "true" or "false"
  elseif getmetatable(v) == M.PART then
    buf[#buf + 1] = buf.sliced and v or v.whole()
  elseif t == "table" then
    encode_table(v, buf, depth)
  else
    buf[#buf + 1] = "null"
  end
end

-- The table walk runs interpreted: LuaJIT 2.1.0-beta3 (Debian 12's)
-- compiled it wrong now and then, and an object came out as {} (in about one
-- process in three, a few results in 100,000 lost their fields: an MCP
-- result's content item, the fuzz target's "lost a nested field").
-- spec/server/api_json_jit_spec.lua. The big strings' escaping (escape_range)
-- stays compiled.
jit.off(encode_table)
jit.off(encode_value)

-- encode(value) -> JSON text
function M.encode(v)
  local buf = {}
  encode_value(v, buf, 0)
  return table.concat(buf)
end

-- body(value) -> the JSON text of value and a newline, as an HTTP response
-- body: a string; or, when value holds strings longer than BIG (an exec's
-- output), a body in pieces for moonbox.server.http: {measure() (its exact
-- length, counted once; may yield), pieces (an iterator, once), held (bytes
-- it keeps until sent), text(), release(), summary}.
-- The escaped form of a big string (up to six times its size for control
-- characters) is never in memory whole: each slice is escaped as sent.
function M.body(v)
  local buf = { sliced = true }
  encode_value(v, buf, 0)
  buf.sliced = nil
  buf[#buf + 1] = "\n"
  local parts, run, length, held = {}, {}, 0, 0
  local function flush()
    if #run == 0 then return end
    local text = table.concat(run)
    parts[#parts + 1], run = text, {}
    length, held = length + #text, held + #text
  end
  local big = {}
  for _, p in ipairs(buf) do
    if type(p) == "table" then
      flush()
      parts[#parts + 1] = p
      big[#big + 1] = p
    else
      run[#run + 1] = p
    end
  end
  flush()
  if #parts == 1 then return parts[1] end
  local function release()
    for _, p in ipairs(big) do p.release() end
  end
  for _, p in ipairs(big) do held = held + p.held end
  -- The exact length counts every escape of the big parts (tens of ms for
  -- 16 MiB): done by the sender once the body is sure to be sent, never for
  -- a body the send budget refuses.
  local measured
  local function measure()
    if measured then return measured end
    local n = length
    for _, p in ipairs(big) do n = n + p.length() end
    measured = n
    return n
  end
  local i, slices = 0, nil
  local function pieces()
    while true do
      if slices then
        local piece = slices()
        if piece then return piece end
        slices = nil
      end
      i = i + 1
      local p = parts[i]
      if p == nil then return nil end
      if type(p) == "string" then return p end
      slices = p.slices()
    end
  end
  local function text()
    local out = {}
    for k, p in ipairs(parts) do out[k] = type(p) == "string" and p or p.whole() end
    return table.concat(out)
  end
  return { measure = measure, pieces = pieces, held = held, text = text, release = release, summary = M.summary(v) }
end

-- The small scalar fields of a result (exitCode, success, duration, ...):
-- what a refused body's 503 still tells (the command ran; its output could
-- not be held for the client).
function M.summary(v)
  if type(v) ~= "table" or getmetatable(v) then return nil end
  local out
  for k, x in pairs(v) do
    local t = type(x)
    if type(k) == "string" and k:sub(1, 1) ~= "_"
      and (t == "number" or t == "boolean" or (t == "string" and #x <= 256)) then
      out = out or {}
      out[k] = x
    end
  end
  return out
end

-- A field of raw bytes (command output, log data): kept as text when it is
-- valid UTF-8, else replaced by its base64 and marked in encoding_field
-- (t.stdout -> t.stdoutEncoding = "base64"; event data -> encoding).
function M.binary_field(t, field, encoding_field)
  local s = t[field]
  if type(s) == "string" and not core.utf8_valid(s) then
    t[field] = core.base64_encode(s)
    t[encoding_field] = "base64"
  end
  return t
end

return M
