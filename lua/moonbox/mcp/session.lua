-- One MCP session, whatever carries it (moonbox.mcp.stdio, moonbox.mcp.http):
-- the protocol's methods (initialize, ping, tools/list, tools/call,
-- notifications/initialized and notifications/cancelled) over decoded
-- JSON-RPC messages, and the sandbox the session's tools drive: its own,
-- made on first use and destroyed when the session ends, or a named one.
--
--   local s = session.new { sandboxes = provider }
--   local reply = s:handle(msg, notify) -- in a task; nil: nothing to answer
--   (notify(message), when the transport can send one before the response:
--   progress notifications of a long tools/call that asked for them)
--   s:close()                    -- cancels what runs, destroys its own sandbox
--
-- provider: {get(id) -> Sandbox (made if needed), exists(id) -> bool}, and
-- optionally enter(id) -> token / leave(token) around a call's use of a
-- sandbox (`moonbox serve` counts it as a request for the sandbox: no idle
-- stop under a running call).
local async = require "moonbox.async"
local errors = require "moonbox.errors"
local util = require "moonbox.lib.util"
local jsonrpc = require "moonbox.mcp.jsonrpc"
local schema = require "moonbox.mcp.schema"
local tools = require "moonbox.mcp.tools"

local M = {}

M.LATEST = "2025-06-18"
M.VERSIONS = { ["2025-06-18"] = true, ["2025-03-26"] = true }
M.MAX_INFLIGHT = 64 -- tools/call requests a session runs at once
-- A tools/call with a progressToken (params._meta) is told it still runs
-- after 1 s, 3 s, 7 s, ... (the gaps doubling up to PROGRESS_MAX_MS): a
-- client that resets its request timeout on progress waits for a long
-- command instead of giving up on it.
M.PROGRESS_FIRST_MS = 1000
M.PROGRESS_MAX_MS = 15000

local Session = {}
Session.__index = Session

-- new{sandboxes, sandbox?}: sandbox names a sandbox to use as the
-- session's own (`moonbox mcp --sandbox ID`): it is not destroyed at the end.
function M.new(opts)
  local self = setmetatable({ sandboxes = opts.sandboxes, inflight = {}, ninflight = 0, closed = false }, Session)
  if opts.sandbox then
    self.own_id, self.own_named = opts.sandbox, true
  end
  return self
end

-- ---- the sandboxes a call works on ---------------------------------------------

local Ctx = {}
Ctx.__index = Ctx

function Session:own_sandbox()
  local sb = self.own
  if sb and not sb.destroyed then return sb end
  -- (the id is fixed before the first wait: concurrent first calls make one sandbox)
  self.own_id = self.own_id or ("mcp-" .. util.random_hex(8))
  sb = self.sandboxes.get(self.own_id)
  if self.closed then
    -- the session ended while its sandbox was being made
    if not self.own_named then pcall(sb.destroy, sb) end
    errors.raise("CANCELLED", "the MCP session ended")
  end
  self.own = sb
  return sb
end

-- (the provider's enter, once per sandbox a call uses; left when it ends)
function Ctx:_enter(id)
  local provider = self.session.sandboxes
  if not provider.enter or self.entered[id] then return end
  self.entered[id] = provider.enter(id)
end

function Ctx:_leave_all()
  local provider = self.session.sandboxes
  for id, token in pairs(self.entered) do
    self.entered[id] = nil
    if provider.leave then provider.leave(token) end
  end
end

function Ctx:sandbox(args)
  local id = args.sandbox
  if id == nil then
    self.session.own_id = self.session.own_id or ("mcp-" .. util.random_hex(8))
    self:_enter(self.session.own_id)
    return self.session:own_sandbox()
  end
  require("moonbox.lib.validate").sandbox_id(id, "sandbox")
  self:_enter(id)
  if id == self.session.own_id then return self.session:own_sandbox() end
  if not self.session.sandboxes.exists(id) then
    errors.raise("SANDBOX_NOT_FOUND", ("sandbox %q does not exist (create it with create_sandbox)"):format(id),
      { id = id })
  end
  return self.session.sandboxes.get(id)
end

function Ctx:make_sandbox(id)
  self:_enter(id)
  if id == self.session.own_id then return self.session:own_sandbox() end
  return self.session.sandboxes.get(id)
end

-- destroy_sandbox(id or nil) -> the id destroyed
function Ctx:destroy_sandbox(id)
  local s = self.session
  if id == nil or id == s.own_id then
    local sb = s:own_sandbox()
    s.own = nil
    sb:destroy()
    return sb.id
  end
  local sb = self:sandbox { sandbox = id }
  sb:destroy()
  return id
end

-- ---- methods -------------------------------------------------------------------

local function initialize(self, params)
  local asked = params.protocolVersion
  if type(asked) ~= "string" then
    return nil, jsonrpc.INVALID_PARAMS, "initialize: protocolVersion must be a string"
  end
  self.version = M.VERSIONS[asked] and asked or M.LATEST
  self.client = type(params.clientInfo) == "table" and params.clientInfo or nil
  return {
    protocolVersion = self.version,
    capabilities = { tools = { listChanged = false } },
    serverInfo = { name = "moonbox", title = "moonbox sandboxes", version = require("moonbox").VERSION },
    instructions = "Each MCP session has its own sandbox (a Linux environment with bash, a /workspace " ..
      "directory and code interpreters), made on first use and destroyed when the session ends. " ..
      "Name a sandbox made with create_sandbox in `sandbox` to keep state beyond the session.",
  }
end

-- tools/call: the handler runs as a task of its own, which a
-- notifications/cancelled for this request cancels (what it started is
-- killed: a cancelled exec kills its command's tree); then no response.
-- ticks(token, notify) -> a task sending notifications/progress until cancelled
local function progress_ticks(token, notify)
  return async.spawn(pcall, function()
    local gap, elapsed = M.PROGRESS_FIRST_MS, 0
    while true do
      async.sleep(gap)
      elapsed = elapsed + gap
      notify { jsonrpc = "2.0", method = "notifications/progress", params = { progressToken = token,
        progress = math.floor(elapsed / 1000), message = ("running for %d s"):format(math.floor(elapsed / 1000)) } }
      gap = math.min(gap * 2, M.PROGRESS_MAX_MS)
    end
  end)
end

local function call_tool(self, id, params, notify)
  local name = params.name
  if type(name) ~= "string" then return nil, jsonrpc.INVALID_PARAMS, "tools/call: name must be a string" end
  local tool = tools.by_name[name]
  if not tool then return nil, jsonrpc.INVALID_PARAMS, ("unknown tool %q"):format(name) end
  local args, why = schema.check(tool.inputSchema, params.arguments)
  if not args then return nil, jsonrpc.INVALID_PARAMS, ("%s: %s"):format(name, why) end
  if self.ninflight >= M.MAX_INFLIGHT then
    return nil, jsonrpc.SERVER_BUSY, ("%d tool calls already run in this session"):format(M.MAX_INFLIGHT)
  end
  local ctx = setmetatable({ session = self, entered = {} }, Ctx)
  local task = async.spawn(function()
    local results = { pcall(tool.handler, ctx, args) }
    ctx:_leave_all()
    if not results[1] then error(results[2], 0) end
    return results[2]
  end)
  local key = jsonrpc.id_key(id)
  local entry = { task = task }
  self.inflight[key] = entry
  self.ninflight = self.ninflight + 1
  local meta = type(params._meta) == "table" and params._meta or {}
  local token = meta.progressToken
  local ticks = notify and (type(token) == "string" or type(token) == "number") and not task.done
    and progress_ticks(token, notify)
  local ok, r = pcall(task.wait, task)
  if ticks then ticks:cancel() end
  if self.inflight[key] == entry then self.inflight[key] = nil end
  self.ninflight = self.ninflight - 1
  if not ok and not task.done then task:cancel() end -- we were cancelled ourselves
  if entry.cancelled or self.closed then return nil, "cancelled" end
  if not ok then return tools.error_result(r) end
  return tools.result(r)
end

local function cancelled(self, params)
  if type(params) ~= "table" or params.requestId == nil then return end
  local entry = self.inflight[jsonrpc.id_key(params.requestId)]
  if entry then
    entry.cancelled = true
    entry.task:cancel()
  end
end

-- handle(msg) -> the response to send, or nil (a notification, a response
-- of the client's, a cancelled request). msg is one decoded message.
function Session:handle(msg, notify)
  local kind, invalid = jsonrpc.check(msg)
  if not kind then return invalid end
  if kind == "response" then return nil end -- (we send no requests)
  local params = msg.params or {}
  if kind == "notification" then
    if msg.method == "notifications/cancelled" then cancelled(self, params)
    elseif msg.method == "notifications/initialized" then self.initialized = true end
    return nil
  end
  local id, method = msg.id, msg.method
  local result, code, message
  if method == "initialize" then
    result, code, message = initialize(self, params)
  elseif method == "ping" then
    result = {}
  elseif not self.version then
    code, message = jsonrpc.INVALID_REQUEST, ("%s before initialize"):format(method)
  elseif method == "tools/list" then
    result = { tools = tools.definitions() }
  elseif method == "tools/call" then
    result, code, message = call_tool(self, id, params, notify)
    if code == "cancelled" then return nil end
  else
    code, message = jsonrpc.METHOD_NOT_FOUND, ("method not found: %s"):format(method)
  end
  if result == nil then return jsonrpc.error(id, code, message) end
  return jsonrpc.result(id, result)
end

-- handle_value(v) -> what to send for one decoded value: a response, an
-- array of them (a batch), or nil. Requests of a batch run concurrently.
function Session:handle_value(v, notify)
  if not jsonrpc.is_batch(v) then return self:handle(v, notify) end
  local replies = jsonrpc.array()
  local fns = {}
  for i, msg in ipairs(v) do
    fns[i] = function() return self:handle(msg, notify) or false end
  end
  for _, r in ipairs(async.all(fns)) do
    if r then replies[#replies + 1] = r end
  end
  if #replies == 0 then return nil end
  return replies
end

-- close(): the session ends: what runs is cancelled, its own sandbox is
-- destroyed (a named one stays).
function Session:close()
  if self.closed then return end
  self.closed = true
  for _, entry in pairs(self.inflight) do entry.task:cancel() end
  local sb = self.own
  self.own = nil
  if sb and not self.own_named and not sb.destroyed then
    local ok, err = pcall(sb.destroy, sb)
    if not ok then io.stderr:write("moonbox mcp: destroying sandbox ", sb.id, ": ", errors.format(err), "\n") end
  end
end

function Session:busy()
  return self.ninflight > 0
end

return M
