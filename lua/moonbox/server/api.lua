-- The /v1 HTTP API (issue #7): every call of the Lua API under
-- /v1/sandboxes/{id}, with the Lua calls' names and JSON fields, streams as
-- Server-Sent Events and errors as {code, message, context, httpStatus}.
-- api.handle(req, res) is the request handler for moonbox.server.http; it
-- runs as a task per request. Sandboxes are made on first use, like
-- moonbox.getSandbox, and live as long as the server. Docs: docs/http-api.md.
local core = require "moonbox.core"
local moonbox = require "moonbox"
local sandbox_mod = require "moonbox.sandbox"
local errors = require "moonbox.errors"
local util = require "moonbox.lib.util"
local V = require "moonbox.lib.validate"
local json = require "moonbox.server.api_json"
local json_bytes = require "moonbox.server.json_bytes"
local send_budget = require "moonbox.server.send_budget"
local api_errors = require "moonbox.server.api_errors"
local router_mod = require "moonbox.server.api_router"
local sse = require "moonbox.server.api_sse"

local M = {}

-- configure{home?, policy?, limits?, maxBodyBytes?, maxSandboxes?}: how the
-- server makes its sandboxes (root = <home>/sandboxes/<id>; default
-- $MOONBOX_HOME as in getSandbox), the largest request body it takes, and
-- how many sandboxes requests may bring into being (each is a directory and
-- cgroups: an unbounded number of ids must not exhaust the host).
local DEFAULTS = { maxBodyBytes = 64 * 1024 * 1024, maxSandboxes = 1024 }
M.config = DEFAULTS

function M.configure(opts)
  opts = V.options(opts, { home = true, policy = true, limits = true, maxBodyBytes = true, maxSandboxes = true },
    "api options")
  M.config = {
    home = V.type(opts.home, "string", "home", true),
    policy = opts.policy,
    limits = V.type(opts.limits, "table", "limits", true),
    maxBodyBytes = V.type(opts.maxBodyBytes, "number", "maxBodyBytes", true) or DEFAULTS.maxBodyBytes,
    maxSandboxes = V.type(opts.maxSandboxes, "number", "maxSandboxes", true) or DEFAULTS.maxSandboxes,
  }
end

local function reply(status, value, headers)
  local h = { ["content-type"] = "application/json" }
  for k, v in pairs(headers or {}) do h[k] = v end
  -- (a body holding big strings, an exec's output, goes in slices: api_json.body)
  return { status = status, headers = h, body = json.body(value) }
end

local function fail(code, message, context)
  errors.raise(code, message, context)
end

-- ---- request context ------------------------------------------------------------

-- Each handler gets ctx: req, res, params, query, and these helpers.
local Ctx = {}
Ctx.__index = Ctx

-- When each sandbox the server holds was made and last used (GET /v1/sandboxes).
local seen = {} -- id -> {created, lastUsed}

local function sandbox_root(id)
  return (M.config.home or sandbox_mod.default_home()) .. "/sandboxes/" .. id
end

-- Requests that only read (GET, and DELETE, which never needs a sandbox
-- made first) find an existing sandbox: live in this server, or left on
-- disk by an earlier run. Others make it on first use, like getSandbox.
local function creates(req)
  return req.method ~= "GET" and req.method ~= "HEAD" and req.method ~= "DELETE"
end

-- The request's sandbox is live, or kept on disk (made again on use).
function Ctx:sandbox_exists()
  local id = self.params.id
  return self._sandbox ~= nil or sandbox_mod.all()[id] ~= nil or util.is_dir(sandbox_root(id))
end

function Ctx:sandbox()
  if not self._sandbox then
    local id = self.params.id
    if not self.may_create and not self:sandbox_exists() then
      fail("SANDBOX_NOT_FOUND", ("sandbox %q does not exist"):format(id), { id = id })
    end
    local live = sandbox_mod.all()
    if not live[id] then
      local n = 0
      for _ in pairs(live) do n = n + 1 end
      if n >= M.config.maxSandboxes then
        if M.on_reject then M.on_reject("max_sandboxes") end
        fail("POLICY_DENIED", ("the server already holds %d sandboxes (maxSandboxes)"):format(n),
          { maxSandboxes = M.config.maxSandboxes })
      end
    end
    local opts = {}
    if M.config.home then opts.root = sandbox_root(id) end
    opts.policy, opts.limits = M.config.policy, M.config.limits
    self._sandbox = moonbox.getSandbox(id, opts)
    local now = util.timestamp()
    local t = seen[id]
    if not t or t.sandbox ~= self._sandbox then
      t = { sandbox = self._sandbox, created = now }
      seen[id] = t
    end
    t.lastUsed = now
  end
  return self._sandbox
end

-- sandbox_for(id, create) and sandbox_exists(id): a sandbox as a request
-- for it would find (or, with create, make) it: for /mcp (moonbox.mcp.http).
function M.sandbox_for(id, create)
  V.sandbox_id(id, "sandbox")
  return setmetatable({ params = { id = id }, may_create = create }, Ctx):sandbox()
end

function M.sandbox_exists(id)
  return setmetatable({ params = { id = id } }, Ctx):sandbox_exists()
end

-- The JSON body's fields, decoded once.
function Ctx:body()
  if not self._body then self._body = json.decode_object(self.req.body) end
  return self._body
end

-- take(spec) -> the body's fields named in spec, type-checked and removed
-- from the body; spec values are "string", "number", "boolean", "table",
-- "any", with "?" for optional. What is left is the call's options.
function Ctx:take(spec)
  local body = self:body()
  local out = {}
  for field, kind in pairs(spec) do
    local optional = kind:sub(-1) == "?"
    kind = optional and kind:sub(1, -2) or kind
    local v = body[field]
    body[field] = nil
    if v == nil then
      if not optional then V.fail(field, "missing") end
    elseif kind ~= "any" and type(v) ~= kind then
      V.fail(field, ("expected a %s, got %s"):format(kind, type(v) == "table" and "object or array" or type(v)))
    end
    out[field] = v
  end
  return out
end

-- The rest of the body must be empty (calls without options).
function Ctx:no_more()
  local k = next(self:body())
  if k ~= nil then V.fail(tostring(k), "unknown field") end
end

-- The options left in the body, or nil when none (the Lua calls check them).
function Ctx:rest()
  local body = self:body()
  if next(body) == nil then return nil end
  return body
end

-- Query parameters: only those named in allowed (sessionId always).
local function check_query(ctx, allowed)
  if ctx.req.queryConflict then V.fail(ctx.req.queryConflict, "query parameter given twice, with different values") end
  for k in pairs(ctx.query) do
    if k ~= "sessionId" and not (allowed and allowed[k]) then V.fail(k, "unknown query parameter") end
  end
end

local function query_bool(ctx, name)
  local v = ctx.query[name]
  if v == nil or v == "" then return nil end
  if v == "true" or v == "1" then return true end
  if v == "false" or v == "0" then return false end
  V.fail(name, "expected true or false")
end

local function query_list(ctx, name)
  local v = ctx.query[name]
  if v == nil or v == "" then return nil end
  local list = json.array()
  for item in v:gmatch("[^,]+") do list[#list + 1] = item end
  return list
end

-- The session a call runs in: sessionId from the body (taken out of it) or
-- the query; the default session (made on first use) when absent.
function Ctx:session(from_body)
  if self._session then return self._session end
  local id
  if from_body then id = self:take({ sessionId = "string?" }).sessionId end
  if id ~= nil and self.query.sessionId ~= nil and self.query.sessionId ~= id then
    -- (as for a query parameter given twice with different values)
    fail("VALIDATION_FAILED", ("sessionId: %q in the query and %q in the body"):format(
      self.query.sessionId, id), { field = "sessionId" })
  end
  id = id or self.query.sessionId
  if id == nil then
    self._session = self:sandbox():getSession("default")
  else
    id = router_mod.check_id(id, "sessionId") -- a bad id is a 400 before any sandbox lookup
    self._session = self:sandbox():getSession(id)
  end
  return self._session
end

-- signal from ?signal=: a name or a number
local function query_signal(ctx)
  local s = ctx.query.signal
  if s == nil or s == "" then return nil end
  return tonumber(s) or s
end

-- ---- result shapes ----------------------------------------------------------------

local function session_info(sb, s)
  return { success = true, id = s.id, sessionId = s.id, cwd = sb:view_path(s.cwd), timestamp = util.timestamp() }
end

local function exec_result(r)
  json.binary_field(r, "stdout", "stdoutEncoding")
  json.binary_field(r, "stderr", "stderrEncoding")
  return r
end

-- stream events with raw bytes in data (exec, process logs)
local function data_event(ev)
  return json.binary_field(ev, "data", "encoding")
end

local function text_event(ev)
  return json.binary_field(ev, "text", "encoding")
end

local function process_info(p)
  return { id = p.id, pid = p.pid, sandboxPid = p.sandboxPid, command = p.command, status = p.status,
    startTime = p.startTime, endTime = p.endTime, exitCode = p.exitCode, sessionId = p.sessionId, error = p.error,
    oomKilled = p.oomKilled }
end

-- logs.stdout/stderr are arrays of raw chunks: one that is not UTF-8 puts
-- the whole array in base64, and logs.stdoutEncoding/stderrEncoding say so
local function code_result(r)
  for _, stream in ipairs { "stdout", "stderr" } do
    local list = r.logs[stream]
    local binary = false
    for _, s in ipairs(list) do
      if type(s) == "string" and not core.utf8_valid(s) then binary = true end
    end
    if binary then
      for i, s in ipairs(list) do list[i] = core.base64_encode(s) end
      r.logs[stream .. "Encoding"] = "base64"
    end
  end
  json.array(r.logs.stdout)
  json.array(r.logs.stderr)
  json.array(r.results)
  return r
end

-- ---- handlers -------------------------------------------------------------------------
-- Each returns status, value (a JSON reply) or nothing (it streamed).

local H = {}

function H.info(ctx)
  check_query(ctx)
  local info = ctx:sandbox():info()
  json.array(info.namespaces)
  json.array(info.notEnforced)
  json.network(info.network)
  return 200, info
end

function H.destroy(ctx)
  check_query(ctx, { keepFiles = true })
  local sb = ctx:sandbox()
  local result = sb:destroy { keepFiles = query_bool(ctx, "keepFiles") }
  if seen[sb.id] and seen[sb.id].sandbox == sb then seen[sb.id] = nil end
  return 200, result
end

-- GET /v1/sandboxes: the sandboxes this server holds, by id.
function H.list_sandboxes(ctx)
  check_query(ctx)
  local ids = {}
  for id in pairs(sandbox_mod.all()) do ids[#ids + 1] = id end
  table.sort(ids)
  local list = json.array()
  for _, id in ipairs(ids) do
    local sb = sandbox_mod.all()[id]
    local t = seen[id]
    if not t or t.sandbox ~= sb then
      t = { sandbox = sb, created = util.timestamp() }
      t.lastUsed = t.created
      seen[id] = t
    end
    local running = 0
    for _, p in pairs(sb.processes) do
      if p:is_running() then running = running + 1 end
    end
    list[#list + 1] = { id = id, created = t.created, lastUsed = t.lastUsed, sessions = #sb:listSessions(),
      processes = running, isolation = sb.isolation }
  end
  return 200, list
end

function H.create_session(ctx)
  check_query(ctx)
  local sb = ctx:sandbox()
  local s = sb:createSession(ctx:rest())
  return 200, session_info(sb, s)
end

function H.list_sessions(ctx)
  check_query(ctx)
  return 200, json.array(ctx:sandbox():listSessions())
end

function H.get_session(ctx)
  check_query(ctx)
  local id = router_mod.check_id(ctx.params.sessionId, "sessionId")
  local sb = ctx:sandbox()
  return 200, session_info(sb, sb:getSession(id))
end

function H.delete_session(ctx)
  check_query(ctx)
  local id = router_mod.check_id(ctx.params.sessionId, "sessionId")
  return 200, ctx:sandbox():deleteSession(id)
end

function H.terminal(ctx)
  local sid = router_mod.check_id(ctx.params.sessionId, "sessionId")
  local ok, terminal_ws = pcall(require, "moonbox.server.terminal_ws")
  if not ok then
    fail(api_errors.INTERNAL, "the WebSocket terminal is not available in this build",
      { reason = tostring(terminal_ws) })
  end
  -- refused before anything is made (a plain GET, bad sizes); it starts a
  -- shell, so it makes its sandbox like a write, though a GET, but only
  -- for the default session: a new sandbox has no other (SANDBOX_NOT_FOUND)
  local refused = terminal_ws.precheck(ctx.req)
  if refused then return refused end
  ctx.may_create = sid == "default"
  ctx:sandbox()
  return terminal_ws.handle(ctx.req, ctx.res, ctx.params.id, sid)
end

-- POST /env {envVars, sessionId?}: sandbox level without sessionId.
function H.env(ctx)
  check_query(ctx)
  local f = ctx:take { envVars = "table" }
  local explicit = ctx:body().sessionId ~= nil or ctx.query.sessionId ~= nil
  local s = ctx:session(true)
  ctx:no_more()
  if explicit then return 200, s:setEnvVars(f.envVars) end
  return 200, ctx:sandbox():setEnvVars(f.envVars)
end

-- A script may raise maxOutputBytes for its own calls; a client of the
-- server may not go past the policy's limit (the server's memory).
local function check_output_limit(ctx, s)
  local v, limit = ctx:body().maxOutputBytes, s.sandbox.policy.limits.maxOutputBytes
  if type(v) == "number" and v > limit then
    V.fail("maxOutputBytes", ("at most %d (the policy's limits.maxOutputBytes)"):format(limit))
  end
end

function H.exec(ctx)
  check_query(ctx)
  local s = ctx:session(true)
  local f = ctx:take { command = "any" }
  check_output_limit(ctx, s)
  local opts = ctx:rest()
  -- a client that hangs up cancels it: no stuck session behind a result
  -- nobody reads (docs/server.md). The output stays in C buffers until
  -- sent (json_bytes.lua).
  -- Its output counts in the send budget while it is collected: past the
  -- budget the rest is dropped (truncated = true), never kept only to be
  -- refused at the end. The response takes the hold over (http.lua).
  local hold = send_budget.hold()
  ctx.res.reserved = hold
  local ok, r = pcall(sse.while_connected, ctx.res, function() return s:exec_bytes(f.command, opts, hold) end)
  local err
  if ok then
    ok, err = pcall(function()
      json_bytes.field(r, "stdout", "stdoutEncoding")
      json_bytes.field(r, "stderr", "stderrEncoding")
    end)
    if not ok then json_bytes.release(r, "stdout", "stderr") end
  else
    err = r
  end
  if not ok then hold:release() ctx.res.reserved = nil error(err, 0) end
  return 200, r
end

function H.exec_stream(ctx)
  check_query(ctx)
  local s = ctx:session(true)
  local f = ctx:take { command = "any" }
  check_output_limit(ctx, s)
  sse.pump(ctx.res, s:execStream(f.command, ctx:rest()), data_event)
end

-- ---- processes

function H.start_process(ctx)
  check_query(ctx)
  local s = ctx:session(true)
  local f = ctx:take { command = "any" }
  return 200, process_info(s:startProcess(f.command, ctx:rest()))
end

function H.list_processes(ctx)
  check_query(ctx)
  local list = json.array()
  for i, p in ipairs(ctx:session():listProcesses()) do list[i] = process_info(p) end
  return 200, list
end

-- POST /processes/cleanup {sessionId?} -> {success, count, timestamp}
function H.cleanup_processes(ctx)
  check_query(ctx)
  local s = ctx:session(true)
  ctx:no_more()
  return 200, { success = true, count = s:cleanupCompletedProcesses(), timestamp = util.timestamp() }
end

function H.kill_all(ctx)
  check_query(ctx, { signal = true })
  local n = ctx:session():killAllProcesses(query_signal(ctx))
  return 200, { success = true, count = n, timestamp = util.timestamp() }
end

local function find_process(ctx)
  local id = router_mod.check_id(ctx.params.processId, "processId")
  local p = ctx:session():getProcess(id)
  if not p then fail("PROCESS_NOT_FOUND", ("process %q does not exist"):format(id), { processId = id }) end
  return p
end

function H.get_process(ctx)
  check_query(ctx)
  return 200, process_info(find_process(ctx))
end

function H.kill_process(ctx)
  check_query(ctx, { signal = true })
  local id = router_mod.check_id(ctx.params.processId, "processId")
  local s = ctx:session()
  return 200, s:killProcess(id, query_signal(ctx))
end

function H.process_logs(ctx)
  check_query(ctx)
  local id = router_mod.check_id(ctx.params.processId, "processId")
  local s = ctx:session()
  return 200, exec_result(s:getProcessLogs(id))
end

function H.process_logs_stream(ctx)
  check_query(ctx)
  local id = router_mod.check_id(ctx.params.processId, "processId")
  local s = ctx:session()
  sse.pump(ctx.res, s:streamProcessLogs(id), data_event)
end

-- POST /processes/{id}/wait {exit: true | pattern | port, timeout, ...}
function H.wait_process(ctx)
  check_query(ctx)
  local f = ctx:take { exit = "boolean?", pattern = "string?", port = "number?", timeout = "number?" }
  local kinds = (f.exit and 1 or 0) + (f.pattern and 1 or 0) + (f.port and 1 or 0)
  if kinds ~= 1 then V.fail("body", "give exactly one of exit: true, pattern or port") end
  ctx:session(true)
  local p = find_process(ctx)
  local result
  if f.exit then
    ctx:no_more()
    result = sse.while_connected(ctx.res, function() return p:waitForExit(f.timeout) end)
  elseif f.pattern then
    local o = ctx:take { plain = "boolean?" }
    ctx:no_more()
    result = sse.while_connected(ctx.res, function() return p:waitForLog(f.pattern, f.timeout, { plain = o.plain }) end)
  else
    local o = ctx:take { mode = "string?", path = "string?", status = "number?", interval = "number?" }
    ctx:no_more()
    o.timeout = f.timeout
    result = sse.while_connected(ctx.res, function() return p:waitForPort(f.port, o) end)
  end
  result.processId = p.id
  return 200, result
end

-- ---- files

-- POST /files/{op}: the Lua arguments by name
local file_ops = {
  write = function(s, ctx)
    local f = ctx:take { path = "string", content = "string" }
    return s:writeFile(f.path, f.content, ctx:rest())
  end,
  read = function(s, ctx)
    local f = ctx:take { path = "string" }
    return s:readFile(f.path, ctx:rest())
  end,
  mkdir = function(s, ctx)
    local f = ctx:take { path = "string" }
    return s:mkdir(f.path, ctx:rest())
  end,
  delete = function(s, ctx)
    local f = ctx:take { path = "string" }
    ctx:no_more()
    return s:deleteFile(f.path)
  end,
  rename = function(s, ctx)
    local f = ctx:take { path = "string?", oldPath = "string?", newPath = "string" }
    if (f.path == nil) == (f.oldPath == nil) then V.fail("path", "give path (or oldPath), once") end
    ctx:no_more()
    return s:renameFile(f.path or f.oldPath, f.newPath)
  end,
  move = function(s, ctx)
    local f = ctx:take { path = "string?", sourcePath = "string?", newPath = "string?", destinationPath = "string?" }
    if (f.path == nil) == (f.sourcePath == nil) then V.fail("path", "give path (or sourcePath), once") end
    if (f.newPath == nil) == (f.destinationPath == nil) then
      V.fail("newPath", "give newPath (or destinationPath), once")
    end
    ctx:no_more()
    return s:moveFile(f.path or f.sourcePath, f.newPath or f.destinationPath)
  end,
  list = function(s, ctx)
    local f = ctx:take { path = "string" }
    local r = s:listFiles(f.path, ctx:rest())
    json.array(r.files)
    return r
  end,
  exists = function(s, ctx)
    local f = ctx:take { path = "string" }
    ctx:no_more()
    return s:exists(f.path)
  end,
}

local function file_handler(op)
  return function(ctx)
    check_query(ctx)
    local s = ctx:session(true)
    return 200, file_ops[op](s, ctx)
  end
end

local function query_path(ctx)
  local path = ctx.query.path
  if path == nil then V.fail("path", "missing (?path=)") end
  return path
end

-- GET /files/stream?path=: the file's raw bytes
function H.file_stream(ctx)
  check_query(ctx, { path = true })
  local iter = ctx:session():readFileStream(query_path(ctx))
  local res, gone = ctx.res, false
  res:onClose(function() gone = true end)
  res:start(200, { ["content-type"] = "application/octet-stream" })
  local ok, err = pcall(function()
    for chunk in iter do
      if gone or res.closed or not res:write(chunk) then break end
    end
  end)
  iter.close()
  -- the status is sent: a read error can only cut the body short
  if not ok then io.stderr:write("moonbox api: files/stream: ", errors.format(err), "\n") end
  if not gone and not res.closed then res:finish() end
end

-- PUT /files/raw?path=: the body is the file's content
function H.file_raw(ctx)
  check_query(ctx, { path = true })
  return 200, ctx:session():writeFile(query_path(ctx), ctx.req.body or "")
end

-- GET /files/watch?path=&recursive=&include=&exclude= (SSE)
function H.watch(ctx)
  check_query(ctx, { path = true, recursive = true, include = true, exclude = true })
  local iter = ctx:session():watch(query_path(ctx), {
    recursive = query_bool(ctx, "recursive"), include = query_list(ctx, "include"),
    exclude = query_list(ctx, "exclude") })
  sse.pump(ctx.res, iter)
end

function H.git_checkout(ctx)
  check_query(ctx)
  local s = ctx:session(true)
  local f = ctx:take { repoUrl = "string" }
  return 200, s:gitCheckout(f.repoUrl, ctx:rest())
end

-- ---- code contexts

function H.create_context(ctx)
  check_query(ctx)
  local s = ctx:session(true)
  return 200, s:createCodeContext(ctx:rest())
end

function H.list_contexts(ctx)
  check_query(ctx)
  return 200, json.array(ctx:session():listCodeContexts())
end

function H.delete_context(ctx)
  check_query(ctx)
  local id = router_mod.check_id(ctx.params.contextId, "contextId")
  return 200, ctx:session():deleteCodeContext(id)
end

function H.run_code(ctx)
  check_query(ctx)
  local s = ctx:session(true)
  local f = ctx:take { code = "string" }
  -- (a run whose client hung up finishes in its context, as a code
  -- stream's does: killing it would lose the context's state)
  return 200, code_result(s:runCode(f.code, ctx:rest()))
end

function H.run_code_stream(ctx)
  check_query(ctx)
  local s = ctx:session(true)
  local f = ctx:take { code = "string" }
  sse.pump(ctx.res, s:runCodeStream(f.code, ctx:rest()), text_event)
end

-- ---- routes ------------------------------------------------------------------------------

local router = router_mod.new()
for _, r in ipairs {
  { "GET", "", H.info }, { "DELETE", "", H.destroy },
  { "POST", "/sessions", H.create_session }, { "GET", "/sessions", H.list_sessions },
  { "GET", "/sessions/{sessionId}", H.get_session }, { "DELETE", "/sessions/{sessionId}", H.delete_session },
  { "GET", "/sessions/{sessionId}/terminal", H.terminal },
  { "POST", "/env", H.env },
  { "POST", "/exec", H.exec }, { "POST", "/exec/stream", H.exec_stream },
  { "POST", "/processes", H.start_process }, { "GET", "/processes", H.list_processes },
  { "DELETE", "/processes", H.kill_all }, { "POST", "/processes/cleanup", H.cleanup_processes },
  { "GET", "/processes/{processId}", H.get_process }, { "DELETE", "/processes/{processId}", H.kill_process },
  { "GET", "/processes/{processId}/logs", H.process_logs },
  { "GET", "/processes/{processId}/logs/stream", H.process_logs_stream },
  { "POST", "/processes/{processId}/wait", H.wait_process },
  { "GET", "/files/stream", H.file_stream }, { "PUT", "/files/raw", H.file_raw },
  { "GET", "/files/watch", H.watch },
  { "POST", "/git/checkout", H.git_checkout },
  { "POST", "/contexts", H.create_context }, { "GET", "/contexts", H.list_contexts },
  { "DELETE", "/contexts/{contextId}", H.delete_context },
  { "POST", "/code", H.run_code }, { "POST", "/code/stream", H.run_code_stream },
} do
  router:add(r[1], "/v1/sandboxes/{id}" .. r[2], r[3])
end
for op in pairs(file_ops) do router:add("POST", "/v1/sandboxes/{id}/files/" .. op, file_handler(op)) end
router:add("GET", "/v1/sandboxes", H.list_sandboxes)
-- the seed's container protocol, /v1/sandboxes/{id}/api/... (docs/compat.md)
require("moonbox.server.compat").install(router, require("moonbox.server.compat_sse"))
-- ports, backups, checkChanges (issue #16 part 2)
require("moonbox.server.api_more").install(router, M)
M.router = router

-- The sandbox id in the path: getSandbox's rule, checked before anything runs.
local function check_sandbox_id(id)
  V.sandbox_id(id, "id")
end

local function dispatch(req, res)
  local segs = router_mod.segments(req.path or "/", req.rawPath)
  local route, params, allow = router:match(req.method, segs)
  if not route then
    if params == "method" then
      local status, body = api_errors.body(errors.new("METHOD_NOT_ALLOWED",
        ("%s is not allowed here; allowed: %s"):format(tostring(req.method), table.concat(allow, ", ")),
        { method = req.method, allow = json.array(allow) }))
      return reply(status, body, { allow = table.concat(allow, ", ") })
    end
    -- (the path as sent: routing is on it, "//sessions" included)
    local path = req.rawPath or req.path
    local status, body = api_errors.body(errors.new("NOT_FOUND", ("no route for %s %s"):format(
      tostring(req.method), tostring(path)), { method = req.method, path = path }))
    return reply(status, body)
  end
  req.route = route.pattern -- for the access log and /metrics (moonbox.server.service)
  if params.id then check_sandbox_id(params.id) end -- (/v1/backups is not a sandbox's)
  if req.body and #req.body > M.config.maxBodyBytes then
    fail("REQUEST_TOO_LARGE", ("the request body is larger than %d bytes"):format(M.config.maxBodyBytes),
      { limit = M.config.maxBodyBytes })
  end
  local ctx = setmetatable({ req = req, res = res, params = params, query = req.query or {},
    may_create = creates(req) }, Ctx)
  local status, value = route.handler(ctx)
  if status == nil then return nil end -- streamed, or answered by another module
  if type(status) == "table" then return status end
  return reply(status, value)
end

-- What a call cut short by the server's stop raises (its sandbox, session
-- or task ended under it), when M.stopping() says the server is stopping.
local CUT_BY_STOP = { SANDBOX_DESTROYED = true, SESSION_DESTROYED = true, CANCELLED = true }

-- handle(req, res) -> {status, headers, body}, or nil after streaming on res.
function M.handle(req, res)
  local ok, result = pcall(dispatch, req, res)
  if ok then return result end
  -- a request still running at the end of the shutdown grace: the server
  -- stopped, not the sandbox (its workspace is kept); 503 as for a request
  -- that comes during the stop, not the 409 a destroyed sandbox would be
  if M.stopping and M.stopping() and errors.is_error(result) and CUT_BY_STOP[result.code] then
    return reply(503, api_errors.envelope("SHUTTING_DOWN",
      "the server stopped while the request ran (the sandbox's files are kept); retry later",
      { reason = "shutting_down" }, 503),
      { ["retry-after"] = "1", connection = "close" })
  end
  local status, body = api_errors.body(result)
  return reply(status, body, status == 503 and { ["retry-after"] = "1" } or nil)
end

return M
