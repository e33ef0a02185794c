-- The seed's container protocol (issue #16): the `/api/...` routes that the
-- published @cloudflare/sandbox 0.12.10 SandboxClient calls, served under
-- each sandbox's URL /v1/sandboxes/{id}/api/... . This is an adapter only:
-- every route calls the same Lua call as its /v1 twin (sessions, exec,
-- files, processes, git, code contexts, watch) and reshapes the request
-- and the answer to the seed's field names. Streams are in compat_sse.lua.
-- Errors carry the seed's body {code, message, context, httpStatus,
-- timestamp} and the seed's status for each code. Docs: docs/compat.md.
local moonbox = require "moonbox"
local errors = require "moonbox.errors"
local util = require "moonbox.lib.util"
local V = require "moonbox.lib.validate"
local json = require "moonbox.server.api_json"
local api_errors = require "moonbox.server.api_errors"
local router_mod = require "moonbox.server.api_router"
local sse = require "moonbox.server.api_sse"

local M = {}

-- The seed's reserved session id: run outside any session.
M.NO_SESSION = "__DISABLE_SESSION__"

-- Where the seed's status for a code differs from /v1's. No code is ever
-- answered 503: the client retries a 503 for two minutes.
M.STATUS = { SESSION_DESTROYED = 410, SESSION_TERMINATED = 410 }

function M.status(code)
  local status = M.STATUS[code] or api_errors.status(code)
  if status == 503 then status = 500 end
  return status
end

-- error_body(err) -> status, the seed's error body
function M.error_body(err)
  local _, body = api_errors.body(err)
  local status = M.status(body.code)
  body.httpStatus = status
  body.timestamp = util.timestamp()
  if type(body.context) ~= "table" then body.context = {} end
  return status, body
end

function M.reply(status, value)
  -- (a body holding big strings, an exec's output, goes in slices: api_json.body)
  return { status = status, headers = { ["content-type"] = "application/json" }, body = json.body(value) }
end

-- ---- requests ---------------------------------------------------------------------

-- The body's fields (api's Ctx:take); a field the seed's client sends for
-- nothing here (origin) is dropped; anything else left over is refused.
local IGNORED = { origin = true }

local function finish_body(ctx)
  local body = ctx:body()
  for k in pairs(IGNORED) do body[k] = nil end
  ctx:no_more()
end
M.finish_body = finish_body

-- The session a call runs in, from the body's sessionId: absent -> the
-- default session; an id not seen yet -> made on first use (the seed's
-- container does the same); __DISABLE_SESSION__ -> a fresh session for this
-- call when fresh is set (commands), else the default session.
-- Returns session, cleanup (a function to call when the call is over).
local function noop() end

function M.session(ctx, id, fresh)
  local sb = ctx:sandbox()
  if id == nil then return sb:getSession("default"), noop end
  if type(id) ~= "string" then V.fail("sessionId", "expected a string, got " .. type(id)) end
  if id == M.NO_SESSION then
    if not fresh then return sb:getSession("default"), noop end
    local s = sb:createSession {}
    return s, function() pcall(sb.deleteSession, sb, s.id) end
  end
  router_mod.check_id(id, "sessionId")
  local ok, s = pcall(sb.getSession, sb, id)
  if ok then return s, noop end
  if not (errors.is_error(s) and s.code == "SESSION_NOT_FOUND") then error(s, 0) end
  local made, s2 = pcall(sb.createSession, sb, { id = id })
  if made then return s2, noop end
  if errors.is_error(s2) and s2.code == "SESSION_ALREADY_EXISTS" then return sb:getSession(id), noop end
  error(s2, 0)
end

-- Run fn(session) in the body's session and clean up after it.
local function in_session(ctx, fresh, fn)
  local sid = ctx:take({ sessionId = "string?" }).sessionId
  local s, cleanup = M.session(ctx, sid, fresh)
  local ok, a, b = pcall(fn, s)
  cleanup()
  if not ok then error(a, 0) end
  return a, b
end
M.in_session = in_session

-- The seed's timeoutMs is moonbox's timeout. Its request type also has
-- `background`: false is what a plain execute is; a command that goes on
-- after the reply is /api/process/start's.
local function exec_options(f)
  if f.background then V.fail("background", "a background command is started with /api/process/start") end
  return { timeout = f.timeoutMs, env = f.env, cwd = f.cwd }
end
M.exec_options = exec_options

local EXEC_FIELDS = { command = "string", timeoutMs = "number?", env = "table?", cwd = "string?",
  background = "boolean?" }
M.EXEC_FIELDS = EXEC_FIELDS

local function now() return util.timestamp() end

-- (the seed's pid is the container's: the sandbox's own view)
local function process_info(p)
  return { id = p.id, pid = p.sandboxPid, command = p.command, status = p.status, startTime = p.startTime,
    endTime = p.endTime, exitCode = p.exitCode, sessionId = p.sessionId }
end

-- ---- handlers --------------------------------------------------------------------

local H = {}

-- commands

function H.execute(ctx)
  return in_session(ctx, true, function(s)
    local f = ctx:take(EXEC_FIELDS)
    finish_body(ctx)
    local opts = exec_options(f)
    local r = sse.while_connected(ctx.res, function() return s:exec(f.command, opts) end) -- (see api.lua H.exec)
    return 200, { success = r.success, exitCode = r.exitCode, stdout = r.stdout, stderr = r.stderr,
      command = r.command, duration = r.duration, timestamp = r.timestamp, sessionId = r.sessionId,
      timedOut = r.timedOut, truncated = r.truncated }
  end)
end

-- sessions

function H.session_create(ctx)
  local f = ctx:take { id = "string", env = "table?", cwd = "string?", commandTimeoutMs = "number?" }
  finish_body(ctx)
  if f.id == M.NO_SESSION then V.fail("id", M.NO_SESSION .. " is reserved (no session)") end
  local s = ctx:sandbox():createSession(f)
  return 200, { success = true, id = s.id, message = ("session %s created"):format(s.id), timestamp = now() }
end

function H.session_delete(ctx)
  local f = ctx:take { sessionId = "string" }
  finish_body(ctx)
  local r = ctx:sandbox():deleteSession(router_mod.check_id(f.sessionId, "sessionId"))
  return 200, { success = true, sessionId = r.sessionId or f.sessionId, timestamp = r.timestamp or now() }
end

-- utilities

function H.ping()
  return 200, { success = true, message = "pong", timestamp = now() }
end

function H.version()
  return 200, { success = true, version = moonbox.VERSION, timestamp = now() }
end

-- The commands on the sandbox's PATH, as its default session sees them.
function H.commands(ctx)
  local r = ctx:sandbox():getSession("default"):exec({ "bash", "-c", "compgen -c | sort -u" })
  local list = json.array()
  for name in r.stdout:gmatch("[^\n]+") do list[#list + 1] = name end
  return 200, { success = true, availableCommands = list, count = #list, timestamp = now() }
end

-- files

local FILE_OPS = {
  write = function(s, ctx)
    local f = ctx:take { path = "string", content = "string", encoding = "string?" }
    finish_body(ctx)
    return s:writeFile(f.path, f.content, { encoding = f.encoding })
  end,
  read = function(s, ctx)
    local f = ctx:take { path = "string", encoding = "string?" }
    finish_body(ctx)
    return s:readFile(f.path, { encoding = f.encoding })
  end,
  mkdir = function(s, ctx)
    local f = ctx:take { path = "string", recursive = "boolean?" }
    finish_body(ctx)
    return s:mkdir(f.path, { recursive = f.recursive })
  end,
  delete = function(s, ctx)
    local f = ctx:take { path = "string" }
    finish_body(ctx)
    return s:deleteFile(f.path)
  end,
  rename = function(s, ctx)
    local f = ctx:take { oldPath = "string", newPath = "string" }
    finish_body(ctx)
    return s:renameFile(f.oldPath, f.newPath)
  end,
  move = function(s, ctx)
    local f = ctx:take { sourcePath = "string", destinationPath = "string" }
    finish_body(ctx)
    return s:moveFile(f.sourcePath, f.destinationPath)
  end,
  ["list-files"] = function(s, ctx)
    local f = ctx:take { path = "string", options = "table?" }
    finish_body(ctx)
    local o = f.options or {}
    o.sessionId = nil -- the client repeats the session here
    local r = s:listFiles(f.path, o)
    json.array(r.files)
    return r
  end,
  exists = function(s, ctx)
    local f = ctx:take { path = "string" }
    finish_body(ctx)
    return s:exists(f.path)
  end,
}

local function file_handler(op)
  return function(ctx)
    return in_session(ctx, false, function(s) return 200, FILE_OPS[op](s, ctx) end)
  end
end

-- processes (sandbox-wide: they run in the default session's view)

local function default_session(ctx) return ctx:sandbox():getSession("default") end

local function process_id(ctx) return router_mod.check_id(ctx.params.processId, "processId") end

function H.process_start(ctx)
  return in_session(ctx, false, function(s)
    local f = ctx:take { command = "string", processId = "string?", timeoutMs = "number?", env = "table?",
      cwd = "string?", encoding = "string?", autoCleanup = "boolean?" }
    finish_body(ctx)
    if f.encoding ~= nil and f.encoding ~= "utf-8" and f.encoding ~= "utf8" then
      V.fail("encoding", "only \"utf-8\" logs are served here")
    end
    local o = exec_options(f)
    o.processId, o.autoCleanup = f.processId, f.autoCleanup
    local p = s:startProcess(f.command, o)
    return 200, { success = true, processId = p.id, pid = p.sandboxPid, command = p.command, timestamp = now() }
  end)
end

-- A read or DELETE of a sandbox that does not exist makes none (API.md:
-- reads never create a sandbox); it answers as the empty sandbox would.
local function absent(ctx) return not ctx.may_create and not ctx:sandbox_exists() end

local function no_process(id)
  errors.raise("PROCESS_NOT_FOUND", ("process %q does not exist"):format(id), { processId = id })
end

function H.process_list(ctx)
  if absent(ctx) then return 200, { success = true, processes = json.array(), count = 0, timestamp = now() } end
  local list = json.array()
  for i, p in ipairs(default_session(ctx):listProcesses()) do list[i] = process_info(p) end
  return 200, { success = true, processes = list, count = #list, timestamp = now() }
end

function H.process_get(ctx)
  local id = process_id(ctx)
  if absent(ctx) then no_process(id) end
  local p = default_session(ctx):getProcess(id)
  if not p then errors.raise("PROCESS_NOT_FOUND", ("process %q does not exist"):format(id), { processId = id }) end
  return 200, { success = true, process = process_info(p), timestamp = now() }
end

function H.process_kill(ctx)
  local id = process_id(ctx)
  if absent(ctx) then no_process(id) end
  local r = default_session(ctx):killProcess(id)
  return 200, { success = r.success ~= false, processId = id, signal = r.signal, timestamp = now() }
end

function H.process_kill_all(ctx)
  local n = absent(ctx) and 0 or default_session(ctx):killAllProcesses()
  return 200, { success = true, cleanedCount = n, killedCount = n, timestamp = now() }
end

function H.process_logs(ctx)
  local id = process_id(ctx)
  if absent(ctx) then no_process(id) end
  local r = default_session(ctx):getProcessLogs(id)
  return 200, { success = true, processId = id, stdout = r.stdout, stderr = r.stderr, truncated = r.truncated,
    timestamp = now() }
end

-- git

function H.git_checkout(ctx)
  return in_session(ctx, false, function(s)
    local f = ctx:take { repoUrl = "string", branch = "string?", targetDir = "string?", depth = "number?",
      timeoutMs = "number?" }
    finish_body(ctx)
    return 200, s:gitCheckout(f.repoUrl, { branch = f.branch, targetDir = f.targetDir, depth = f.depth,
      timeout = f.timeoutMs })
  end)
end

-- code contexts (the default session's, as the seed has no session here)

function H.context_create(ctx)
  local f = ctx:take { language = "string?", cwd = "string?", env_vars = "table?" }
  finish_body(ctx)
  local c = default_session(ctx):createCodeContext { language = f.language, cwd = f.cwd, envVars = f.env_vars }
  return 200, { success = true, contextId = c.id, language = c.language, cwd = c.cwd, timestamp = now() }
end

function H.context_list(ctx)
  local list = json.array()
  if absent(ctx) then return 200, { success = true, contexts = list, timestamp = now() } end
  for i, c in ipairs(default_session(ctx):listCodeContexts()) do
    list[i] = { id = c.id, language = c.language, cwd = c.cwd }
  end
  return 200, { success = true, contexts = list, timestamp = now() }
end

function H.context_delete(ctx)
  local id = router_mod.check_id(ctx.params.contextId, "contextId")
  if absent(ctx) then
    errors.raise("CONTEXT_NOT_FOUND", ("code context %q does not exist"):format(id), { contextId = id })
  end
  default_session(ctx):deleteCodeContext(id)
  return 200, { success = true, contextId = id, timestamp = now() }
end

-- watch/check

function H.watch_check(ctx)
  return in_session(ctx, false, function(s)
    local f = ctx:take { path = "string", recursive = "boolean?", include = "table?", exclude = "table?",
      since = "string?" }
    finish_body(ctx)
    -- the seed watches recursively unless told not to
    local r = s:checkChanges(f.path, { since = f.since, recursive = f.recursive ~= false, include = f.include,
      exclude = f.exclude })
    return 200, { success = true, status = r.status, version = r.version, reason = r.reason, timestamp = now() }
  end)
end

-- backups: squashfs archives at paths in the sandbox (lua/moonbox/files/backup.lua)

function H.backup_create(ctx)
  return in_session(ctx, false, function(s)
    local f = ctx:take { dir = "string", archivePath = "string", gitignore = "boolean?", excludes = "table?",
      compression = "string?", compressThreads = "number?" }
    finish_body(ctx)
    local r = require("moonbox.files.backup").archive(s, f.dir, f.archivePath,
      { excludes = f.excludes, compression = f.compression, gitignore = f.gitignore })
    return 200, { success = true, sizeBytes = r.sizeBytes, archivePath = r.archivePath, timestamp = now() }
  end)
end

function H.backup_restore(ctx)
  return in_session(ctx, false, function(s)
    local f = ctx:take { dir = "string", archivePath = "string" }
    finish_body(ctx)
    local keep
    local prefix = f.dir:gsub("/+$", "") .. "/"
    if f.archivePath:sub(1, #prefix) == prefix and not f.archivePath:sub(#prefix + 1):find("/", 1, true) then
      keep = f.archivePath:sub(#prefix + 1) -- the archive sits in dir: it stays while it is read
    end
    local r = require("moonbox.files.backup").extract(s, f.archivePath, f.dir, keep)
    return 200, { success = true, dir = r.dir, timestamp = now() }
  end)
end

-- ---- routes ------------------------------------------------------------------------

-- install(router, streams): add the routes to /v1's router (kill-all
-- before {processId}); streams is compat_sse.lua's module (it requires this
-- one: api.lua hands it in). Handlers get api's request context; what they
-- return or raise is answered in the seed's shapes.
function M.install(router, streams)
  local function wrap(fn)
    return function(ctx)
      -- writes make the sandbox on first use; reads and DELETEs never do
      -- (they answer as the empty sandbox would, absent() above; /commands,
      -- which must ask the sandbox's own shell, is 404 SANDBOX_NOT_FOUND)
      local ok, status, value = pcall(fn, ctx)
      if not ok then return M.reply(M.error_body(status)) end
      if status == nil then return nil end -- streamed
      return M.reply(status, value)
    end
  end
  local routes = {
    { "POST", "/execute", H.execute }, { "POST", "/execute/stream", streams.execute_stream },
    { "POST", "/session/create", H.session_create }, { "POST", "/session/delete", H.session_delete },
    { "GET", "/ping", H.ping }, { "GET", "/version", H.version }, { "GET", "/commands", H.commands },
    { "POST", "/read/stream", streams.read_stream },
    { "POST", "/process/start", H.process_start }, { "GET", "/process/list", H.process_list },
    { "DELETE", "/process/kill-all", H.process_kill_all },
    { "GET", "/process/{processId}", H.process_get }, { "DELETE", "/process/{processId}", H.process_kill },
    { "GET", "/process/{processId}/logs", H.process_logs },
    { "GET", "/process/{processId}/stream", streams.process_stream },
    { "POST", "/port-watch", streams.port_watch },
    { "POST", "/git/checkout", H.git_checkout },
    { "POST", "/contexts", H.context_create }, { "GET", "/contexts", H.context_list },
    { "DELETE", "/contexts/{contextId}", H.context_delete },
    { "POST", "/execute/code", streams.execute_code },
    { "POST", "/watch", streams.watch }, { "POST", "/watch/check", H.watch_check },
    { "POST", "/backup/create", H.backup_create }, { "POST", "/backup/restore", H.backup_restore },
  }
  for op in pairs(FILE_OPS) do routes[#routes + 1] = { "POST", "/" .. op, file_handler(op) } end
  for _, r in ipairs(routes) do router:add(r[1], "/v1/sandboxes/{id}/api" .. r[2], wrap(r[3])) end
end

return M
