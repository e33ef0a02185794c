-- moonbox code-interpreter kernel protocol (shared by the python, node and lua kernels):
--   stdin: one JSON request per line: {"id": n, "code": "<source>"}
--   fd 3:  one JSON message per line, flushed at once: {"type":"ready","language","version"} at start; per request
--          0+ {"id","type":"result","data":{"text","json"?,"html"?,"png"?,...}} / {"id","type":"error","error":
--          {"name","message","traceback"}}, then one {"id","type":"done","executionCount"}. fd 1/2: raw user output
--   fd 1/2: the user code's own stdout/stderr, raw (not JSON); flushed before each result and before "done"
--
-- Lua kernel for moonbox code-interpreter contexts; runs under the `luajit` executable (needs ffi and lua-cjson).
-- User code runs in one persistent environment table (globals persist; _G is reachable through __index).
-- A cell is compiled as `return <code>` if that parses, else as a chunk whose last line(s) may be an expression.

local ffi = require "ffi"
local cjson_mod = require "cjson"

local KERNEL_SOURCE = debug.getinfo(1, "S").source -- "@path/lua_kernel.lua", to cut kernel frames from tracebacks
local KERNEL_PATH = KERNEL_SOURCE:sub(1, 1) == "@" and KERNEL_SOURCE:sub(2) or KERNEL_SOURCE

ffi.cdef [[
typedef long ssize_t;
typedef void (*moonbox_sighandler_t)(int);
ssize_t read(int fd, void *buf, size_t count);
ssize_t write(int fd, const void *buf, size_t count);
int open(const char *path, int flags, ...);
int close(int fd);
int dup2(int oldfd, int newfd);
int fcntl(int fd, int cmd, ...);
moonbox_sighandler_t signal(int signum, moonbox_sighandler_t handler);
struct moonbox_pollfd { int fd; short events; short revents; };
int poll(struct moonbox_pollfd *fds, unsigned long nfds, int timeout);
]]

local C = ffi.C
local EINTR, EAGAIN = 4, 11
local F_GETFL, F_SETFL, F_DUPFD_CLOEXEC = 3, 4, 1030
local O_NONBLOCK = 2048
local SIGINT = 2

-- protocol encoder: a private cjson instance, so user changes to cjson's settings do not affect it
local json = cjson_mod.new()
json.encode_sparse_array(true)
json.encode_invalid_numbers(false)

-- ------------------------------------------------------------------ fds

local function set_blocking(fd)
  local fl = C.fcntl(fd, F_GETFL)
  if fl >= 0 and bit.band(fl, O_NONBLOCK) ~= 0 then
    C.fcntl(fd, F_SETFL, ffi.new("int", bit.band(fl, bit.bnot(O_NONBLOCK))))
  end
end

-- Private close-on-exec copies of the request (0) and message (3) fds: user code (io.read, os.execute,
-- io.popen) can then neither consume requests nor write protocol messages. fd 0 becomes /dev/null.
local MSG_FD = C.fcntl(3, F_DUPFD_CLOEXEC, ffi.new("int", 10))
if MSG_FD < 0 then
  io.stderr:write("lua_kernel: fd 3 (protocol channel) is not open\n")
  os.exit(2)
end
C.close(3)
local REQ_FD = C.fcntl(0, F_DUPFD_CLOEXEC, ffi.new("int", 10))
do
  local null = C.open("/dev/null", 0)
  if null >= 0 then C.dup2(null, 0); C.close(null) end
end
for _, fd in ipairs { 1, 2, MSG_FD, REQ_FD } do set_blocking(fd) end
io.stdout:setvbuf("line") -- the runtime streams fd 1: let complete lines through at once

local function write_all(fd, s)
  local buf, len, off = ffi.cast("const char *", s), #s, 0
  while off < len do
    local n = tonumber(C.write(fd, buf + off, len - off))
    if n < 0 then
      local e = ffi.errno()
      if e == EAGAIN then
        local p = ffi.new("struct moonbox_pollfd[1]")
        p[0].fd, p[0].events = fd, 4 -- POLLOUT
        C.poll(p, 1, 100)
      elseif e ~= EINTR then
        return false
      end
    else
      off = off + n
    end
  end
  return true
end

local function send_raw(line)
  if not write_all(MSG_FD, line .. "\n") then os.exit(0) end -- runtime gone
end

local function send(msg) send_raw(json.encode(msg)) end

local readbuf = ffi.new("char[65536]")
local pending = ""
local function read_line()
  while true do
    local nl = pending:find("\n", 1, true)
    if nl then
      local line = pending:sub(1, nl - 1)
      pending = pending:sub(nl + 1)
      return line
    end
    local n = tonumber(C.read(REQ_FD, readbuf, 65536))
    if n == 0 then
      if pending ~= "" then local line = pending; pending = ""; return line end
      return nil
    elseif n < 0 then
      if ffi.errno() ~= EINTR then return nil end
    else
      pending = pending .. ffi.string(readbuf, n)
    end
  end
end

local function flush_user_output()
  pcall(io.stdout.flush, io.stdout)
  pcall(io.stderr.flush, io.stderr)
end

-- SIGINT: ignored while idle; during a run luajit's own handler turns it into an "interrupted!" error
-- (interpreted code only: JIT-compiled loops do not see it; a second SIGINT then kills the kernel).
local SIG_IGN = ffi.cast("moonbox_sighandler_t", 1)
local lj_sigint = C.signal(SIGINT, SIG_IGN)

-- ------------------------------------------------------------------ formatting

local serialize

local function key_order(a, b)
  local ta, tb = type(a), type(b)
  if ta ~= tb then return ta < tb end
  if ta == "number" or ta == "string" then return a < b end
  return tostring(a) < tostring(b)
end

local function is_identifier(s)
  return type(s) == "string" and s:match("^[%a_][%w_]*$") ~= nil
end

local MAX_ITEMS, MAX_DEPTH = 200, 8

local function ser(v, depth, seen, indent, out)
  local t = type(v)
  if t == "string" then
    out[#out + 1] = string.format("%q", v):gsub("\\\n", "\\n")
    return
  elseif t ~= "table" then
    out[#out + 1] = tostring(v)
    return
  end
  local mt = getmetatable(v)
  if mt and rawget(mt, "__tostring") then out[#out + 1] = tostring(v); return end
  if seen[v] then out[#out + 1] = "<cycle>"; return end
  if depth >= MAX_DEPTH then out[#out + 1] = "{...}"; return end
  seen[v] = true
  local items = {}
  local n = #v
  for i = 1, n do
    if #items >= MAX_ITEMS then break end
    local o = {}
    ser(v[i], depth + 1, seen, indent .. "  ", o)
    items[#items + 1] = table.concat(o)
  end
  local keys = {}
  for k in pairs(v) do
    if not (type(k) == "number" and k >= 1 and k <= n and k % 1 == 0) then keys[#keys + 1] = k end
  end
  table.sort(keys, key_order)
  for _, k in ipairs(keys) do
    if #items >= MAX_ITEMS then break end
    local o = {}
    if is_identifier(k) then
      o[1] = k
    else
      o[1] = "["; ser(k, depth + 1, seen, indent .. "  ", o); o[#o + 1] = "]"
    end
    o[#o + 1] = " = "
    ser(v[k], depth + 1, seen, indent .. "  ", o)
    items[#items + 1] = table.concat(o)
  end
  local total = n + #keys
  if total > #items then items[#items + 1] = "... (" .. (total - #items) .. " more)" end
  seen[v] = nil
  if #items == 0 then out[#out + 1] = "{}"; return end
  local one = "{" .. table.concat(items, ", ") .. "}"
  if #one + #indent <= 80 and not one:find("\n", 1, true) then
    out[#out + 1] = one
  else
    local inner = indent .. "  "
    out[#out + 1] = "{\n" .. inner .. table.concat(items, ",\n" .. inner) .. "\n" .. indent .. "}"
  end
end

serialize = function(v)
  local out = {}
  ser(v, 0, {}, "", out)
  return table.concat(out)
end

local function text_of(v)
  if type(v) == "string" then return v end -- like the Lua REPL: strings are shown raw
  local ok, s = pcall(serialize, v)
  if ok then return s end
  return "<" .. type(v) .. ": " .. tostring(s) .. ">"
end

-- returns the JSON text of the result's `data` object
local function format_values(n, ...)
  local first = (...)
  local texts = {}
  for i = 1, n do texts[i] = text_of((select(i, ...))) end
  local parts = { '"text":' .. json.encode(table.concat(texts, "\t")) }
  if n == 1 and type(first) == "table" and getmetatable(first) == nil then
    local ok, j = pcall(json.encode, first)
    if ok then parts[#parts + 1] = '"json":' .. j end
  end
  return "{" .. table.concat(parts, ",") .. "}"
end

-- ------------------------------------------------------------------ state

local current_id = nil
local execution_count = 0
local last_value = nil -- what `_` was last set to by the kernel

local function id_json() return current_id == nil and "null" or json.encode(current_id) end

local function emit_data_json(data_json)
  flush_user_output()
  send_raw('{"id":' .. id_json() .. ',"type":"result","data":' .. data_json .. '}')
end

local function emit_data(data)
  if data.text == nil then
    local kinds = {}
    for k in pairs(data) do kinds[#kinds + 1] = k end
    table.sort(kinds)
    data.text = "[" .. table.concat(kinds, ", ") .. "]"
  end
  flush_user_output()
  send { id = current_id, type = "result", data = data }
end

local b64chars = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
local function base64(s)
  return ((s:gsub(".", function(x)
    local r, b = "", x:byte()
    for i = 8, 1, -1 do r = r .. (b % 2 ^ i - b % 2 ^ (i - 1) > 0 and "1" or "0") end
    return r
  end) .. "0000"):gsub("%d%d%d?%d?%d?%d?", function(x)
    if #x < 6 then return "" end
    local c = 0
    for i = 1, 6 do c = c + (x:sub(i, i) == "1" and 2 ^ (6 - i) or 0) end
    return b64chars:sub(c + 1, c + 1)
  end) .. ({ "", "==", "=" })[#s % 3 + 1])
end

-- display(v, ...) shows values as results now;
-- display.html(s), .markdown, .latex, .svg, .png(bytes), .jpeg(bytes), .json(t), .raw(data) show rich output
local display = setmetatable({
  html = function(s) emit_data { html = tostring(s) } end,
  markdown = function(s) emit_data { text = tostring(s), markdown = tostring(s) } end,
  latex = function(s) emit_data { text = tostring(s), latex = tostring(s) } end,
  svg = function(s) emit_data { svg = tostring(s) } end,
  png = function(bytes) emit_data { png = base64(bytes) } end,
  jpeg = function(bytes) emit_data { jpeg = base64(bytes) } end,
  json = function(v) emit_data_json(format_values(1, v)) end,
  raw = function(data) local d = {}; for k, v in pairs(data) do d[k] = v end; emit_data(d) end,
}, {
  __call = function(_, ...)
    for i = 1, select("#", ...) do emit_data_json(format_values(1, (select(i, ...)))) end
  end,
})

-- env -> base -> _G: `base` holds the kernel's helper for final values, out of sight of pairs(env)
local function values(...) return select("#", ...), { ... } end
local base = setmetatable({ __moonbox_values = values }, { __index = _G })
local env = setmetatable({ display = display }, { __index = base })

-- ------------------------------------------------------------------ execution

local function clean_traceback(tb)
  local out = {}
  for line in (tb .. "\n"):gmatch("(.-)\n") do
    if line:find(KERNEL_PATH, 1, true) or line:find("[C]: in function 'xpcall'", 1, true) then break end
    out[#out + 1] = line
  end
  while #out > 0 and out[#out]:match("^%s*$") do out[#out] = nil end
  if out[#out] == "stack traceback:" then out[#out] = nil end
  return table.concat(out, "\n")
end

local function error_text(e)
  if type(e) == "string" then return e end
  return text_of(e)
end

local function send_error(name, message, traceback)
  flush_user_output()
  send { id = current_id, type = "error", error = { name = name, message = message, traceback = traceback } }
end

local MAX_TAIL_LINES = 50

-- Compile a cell: `return <code>`; else split off the last line(s) as `return <tail>` when the head is a
-- complete chunk; else the code as a plain chunk. Mode "t": precompiled bytecode is refused.
-- Returns f, wrapped: a wrapped f returns (n, {values}) of the final expression. The expression is an argument
-- of __moonbox_values rather than returned directly, so a final call is no tail call: error positions and
-- tracebacks keep the cell's frame.
local function compile_cell(code, chunkname)
  if load("return " .. code, chunkname, "t", env) then
    local f = load("return __moonbox_values(" .. code .. "\n)", chunkname, "t", env)
    if f then return f, true end
  end
  local chunk, chunk_err = load(code, chunkname, "t", env)
  local starts = {}
  for pos in code:gmatch("()\n") do starts[#starts + 1] = pos end
  for i = #starts, math.max(1, #starts - MAX_TAIL_LINES + 1), -1 do
    local p = starts[i]
    local head, tail = code:sub(1, p - 1), code:sub(p + 1)
    if tail:match("%S") and load(head, chunkname, "t", env) and load("return " .. tail, chunkname, "t", env)
      -- a chunk that compiles as written is only re-split at a statement (a call), never mid-expression
      and (not chunk or load(tail, chunkname, "t", env)) then
      local g = load(head .. "\nreturn __moonbox_values(" .. tail .. "\n)", chunkname, "t", env)
      if g then return g, true end
    end
  end
  if chunk then return chunk, false end
  return nil, chunk_err
end

local function pack(...) return select("#", ...), { ... } end

local function traceback_handler(e)
  return { err = e, tb = debug.traceback(error_text(e), 2) }
end

local function execute(code)
  execution_count = execution_count + 1
  local chunkname = "=<cell-" .. execution_count .. ">"
  local f, wrapped = compile_cell(code, chunkname)
  if not f then
    send_error("SyntaxError", tostring(wrapped), tostring(wrapped))
    return
  end
  C.signal(SIGINT, lj_sigint)
  local rn, res = pack(xpcall(f, traceback_handler))
  C.signal(SIGINT, SIG_IGN)
  if not res[1] then
    local info = res[2]
    local e = type(info) == "table" and info.err or info
    local tb = type(info) == "table" and clean_traceback(info.tb) or error_text(info)
    send_error("LuaError", error_text(e), tb)
    return
  end
  local n, vals
  if wrapped then
    n, vals = res[2], res[3]
  else
    n, vals = rn - 1, { unpack(res, 2, rn) }
  end
  local any = false
  for i = 1, n do if vals[i] ~= nil then any = true end end
  if any then
    if rawget(env, "_") == last_value then -- never clobber a user's own `_`
      rawset(env, "_", vals[1])
      last_value = vals[1]
    end
    emit_data_json(format_values(n, unpack(vals, 1, n)))
  end
end

local function handle_line(line)
  local ok, req = pcall(cjson_mod.decode, line)
  if not ok or type(req) ~= "table" then
    current_id = nil
    local e = { name = "ProtocolError", message = "bad request: " .. tostring(req), traceback = "" }
    send_raw('{"id":null,"type":"error","error":' .. json.encode(e) .. "}")
    send_raw('{"id":null,"type":"done","executionCount":' .. execution_count .. "}")
    return
  end
  current_id = req.id
  if current_id == cjson_mod.null then current_id = nil end
  local okx, perr = pcall(function()
    if type(req.code) ~= "string" then
      send_error("ProtocolError", 'request has no string "code"', "")
    else
      execute(req.code)
    end
  end)
  C.signal(SIGINT, SIG_IGN)
  if not okx then send_error("KernelError", error_text(perr), error_text(perr)) end
  flush_user_output()
  send_raw('{"id":' .. id_json() .. ',"type":"done","executionCount":' .. execution_count .. "}")
end

send { type = "ready", language = "lua", version = jit and jit.version or _VERSION,
  implementation = jit and "luajit" or "lua" }
while true do
  local line = read_line()
  if not line then break end
  if line:match("%S") then
    local ok, err = pcall(handle_line, line)
    if not ok then io.stderr:write("lua_kernel: ", tostring(err), "\n") end
  end
end
flush_user_output()
os.exit(0)
