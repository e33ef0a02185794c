-- Code-interpreter contexts: one interpreter process per context (kernels in
-- share/kernels/), speaking newline-delimited JSON: requests on its
-- stdin, protocol messages on its fd 3; the user code's own stdout/stderr
-- are its fds 1 and 2, streamed as they arrive. Docs: docs/code-interpreter.md.
local cjson = require "cjson.safe"
local core = require "moonbox.core"
local async = require "moonbox.async"
local budget = require "moonbox.session.budget"
local errors = require "moonbox.errors"
local queue_mod = require "moonbox.session.queue"
local tree = require "moonbox.process.tree"
local cgroup = require "moonbox.process.cgroup"
local util = require "moonbox.lib.util"
local V = require "moonbox.lib.validate"
local compose = require "moonbox.lib.compose"
local kernels_mod = require "moonbox.code.kernels"
local lookup = require "moonbox.code.lookup"

local Session = {} -- this part's methods, installed by session/init.lua (M.install)

local M = {}

local READY_TIMEOUT_MS = 30000
local LANGUAGES = { python = true, javascript = true, typescript = true, lua = true }

M.kernel_dir = kernels_mod.dir

-- argv of the interpreter for a language, or raise INTERPRETER_NOT_AVAILABLE
local function interpreter(language, env, sb)
  local spec = ({
    python = { "python3", "python_kernel.py", { "-u" } },
    javascript = { "node", "node_kernel.js", {} },
    -- types removed per cell: node's own stripping, else Debian's node-typescript (docs/code-interpreter.md)
    typescript = { "node", "node_kernel.js", {}, { "--typescript" } },
    lua = { "luajit", "lua_kernel.lua", {} },
  })[language]
  -- looked up in the sandbox's view: an image sandbox runs the image's own
  local path = lookup.find(sb, spec[1], env and env.PATH)
  if language == "python" and not path and lookup.executable(sb, "/usr/bin/python3") then path = "/usr/bin/python3" end
  if not path then
    local image = sb and sb.image and (sb.image.name or sb.image.digest)
    errors.raise("INTERPRETER_NOT_AVAILABLE", ("%s interpreter %q not found in PATH (%s)%s"):format(
      language, spec[1], tostring(env and env.PATH), image and (" of image " .. image) or ""),
      { language = language, path = spec[1], image = image })
  end
  local argv = { path }
  for _, a in ipairs(spec[3]) do argv[#argv + 1] = a end
  -- inside namespaces the kernels are bound read-only at a fixed place
  local dir = sb and sb.init and require("moonbox.sandbox.isolation").KERNEL_DIR or kernels_mod.dir()
  argv[#argv + 1] = dir .. "/" .. spec[2]
  for _, a in ipairs(spec[4] or {}) do argv[#argv + 1] = a end
  return argv
end

-- ---- one kernel process --------------------------------------------------

local Kernel = {}
Kernel.__index = Kernel

local function start_kernel(ctx)
  -- the longest protocol line taken: a result's representations are cut
  -- at maxOutputBytes each, so a bigger line is no kernel's (user code can
  -- write to the kernel's message fd: it is in the same process)
  local max_line = 4 * (ctx.sandbox.policy.limits.maxOutputBytes or 0) + 1048576
  local k = setmetatable({ buf = {}, buffered = 0, max_line = max_line, waiting = nil, dead = false,
    ready = false }, Kernel)
  local argv = interpreter(ctx.language, ctx.env, ctx.sandbox)
  if tree.mode() == "cgroup" then
    k.cgroup = cgroup.create(ctx.sandbox.cgroup_name .. "/c-" .. ctx.id .. "-" .. ctx.generation)
  end
  local proc, pipes, code = core.spawn(ctx.sandbox:spawn_spec {
    args = argv, env = ctx.env, cwd = ctx.host_cwd, setsid = true, pdeathsig = "SIGKILL", cgroup = k.cgroup,
    stdio = { [0] = "pipe", [1] = "pipe", [2] = "pipe", [3] = "out" },
    on_exit = function(exit_code, signal) k:_exited(exit_code, signal) end,
  })
  if not proc then
    if k.cgroup then cgroup.remove_cgroup(k.cgroup) end
    errors.raise("INTERPRETER_NOT_AVAILABLE", ("cannot start %s: %s"):format(argv[1], tostring(pipes)),
      { language = ctx.language, path = argv[1], errno = code })
  end
  k.proc, k.pid = proc, proc:pid()
  k.requests, k.messages = pipes[0], pipes[3]
  k.out = { stdout = pipes[1], stderr = pipes[2] }
  k.messages:read_start(function(_, data) k:_message_data(data) end)
  for name, s in pairs(k.out) do
    s:read_start(function(_, data)
      if data and k.sink then k.sink(name, data) end
    end)
  end
  return k
end

function Kernel:_deliver(msg)
  if msg.type == "ready" then
    self.ready = true
    if self.on_ready then local f = self.on_ready self.on_ready = nil f(true) end
  elseif self.on_message then
    self.on_message(msg)
  end
end

-- Protocol lines, one JSON message each. Kept as a chunk list until a
-- newline comes; a line past max_line ends the interpreter (its run reports
-- InterpreterDied with the reason) rather than the runtime's memory.
function Kernel:_message_data(data)
  if not data or self.protocol_error then return end
  self.buf[#self.buf + 1] = data
  self.buffered = self.buffered + #data
  if data:find("\n", 1, true) then
    local text = table.concat(self.buf)
    local from = 1
    while true do
      local nl = text:find("\n", from, true)
      if not nl then break end
      local ok, msg = pcall(cjson.decode, text:sub(from, nl - 1))
      from = nl + 1
      if ok and type(msg) == "table" then self:_deliver(msg) end
    end
    local rest = text:sub(from)
    self.buf, self.buffered = { rest }, #rest
  end
  if self.buffered > self.max_line then
    self.buf, self.buffered = {}, 0
    self.protocol_error = ("a protocol message longer than %d bytes (code wrote to the kernel's message fd?)")
      :format(self.max_line)
    if self.cgroup then cgroup.kill_cgroup(self.cgroup) end
    core.kill(self.pid, "SIGKILL")
  end
end

function Kernel:_exited(code, signal)
  self.dead, self.exit_code, self.exit_signal = true, code, signal
  local rest = self.messages and not self.messages:is_closing() and self.messages:try_read()
  if rest and #rest > 0 then self:_message_data(rest) end
  self:_drain_output()
  for _, s in pairs { self.requests, self.messages, self.out.stdout, self.out.stderr } do
    if not s:is_closing() then s:close() end
  end
  if self.cgroup and not cgroup.populated(self.cgroup) then cgroup.remove_cgroup(self.cgroup) self.cgroup = nil end
  if self.on_ready then local f = self.on_ready self.on_ready = nil f(false) end
  if self.on_death then self.on_death(code, signal) end
end

function Kernel:_drain_output()
  for name, s in pairs(self.out) do
    if not s:is_closing() then
      local rest = s:try_read()
      if rest and #rest > 0 and self.sink then self.sink(name, rest) end
    end
  end
end

function Kernel:wait_ready()
  if self.ready then return true end
  if self.dead then return false end
  return async.await(function(resume)
    local timer = core.timer()
    self.on_ready = function(ok) if not timer:is_closing() then timer:close() end resume(ok) end
    timer:start(READY_TIMEOUT_MS, 0, function() timer:close() self.on_ready = nil resume(false) end)
  end, "code context start")
end

-- Kill the interpreter and everything it started; wait until it is gone.
function Kernel:kill()
  if self.dead then return end
  if self.cgroup then cgroup.kill_cgroup(self.cgroup) end
  core.kill(self.pid, "SIGKILL")
  async.await(function(resume)
    if self.dead then return resume() end
    local prev = self.on_death
    self.on_death = function(...) if prev then prev(...) end resume() end
  end, "code context stop")
  if self.cgroup then cgroup.remove_when_empty(self.cgroup, async.sleep) self.cgroup = nil end
end

-- ---- contexts ------------------------------------------------------------

local function public(ctx)
  return { id = ctx.id, language = ctx.language, cwd = ctx.cwd, createdAt = ctx.createdAt, lastUsed = ctx.lastUsed,
    sessionId = ctx.sessionId }
end

-- ctx is gone from its sandbox (CONTEXT_NOT_FOUND from now on), its interpreter killed
local function drop_context(sb, ctx)
  sb.contexts[ctx.id] = nil
  if sb.default_contexts and sb.default_contexts[ctx.language] == ctx.id then
    sb.default_contexts[ctx.language] = nil
  end
  ctx.deleted = true
  if ctx.kernel then ctx.kernel:kill() end
end

local function ensure_kernel(ctx)
  if ctx.kernel and not ctx.kernel.dead then return ctx.kernel end
  ctx.generation = ctx.generation + 1
  local k = start_kernel(ctx)
  if not k:wait_ready() then
    k:kill()
    errors.raise("INTERPRETER_NOT_AVAILABLE", ("%s interpreter did not start (exit code %s)"):format(
      ctx.language, tostring(k.exit_code)), { language = ctx.language })
  end
  ctx.kernel = k
  return k
end

local context_options = { language = true, cwd = true, envVars = true, timeout = true, id = true }

function Session:createCodeContext(opts)
  self:check_live()
  opts = V.options(opts, context_options, "createCodeContext options")
  local sb = self.sandbox
  local language = opts.language or "python"
  if not LANGUAGES[language] then
    V.fail("language", "expected \"python\", \"javascript\", \"typescript\" or \"lua\"")
  end
  local env = util.copy(self:current_env())
  for k, v in pairs(V.env(opts.envVars, "envVars") or {}) do if v == false then env[k] = nil else env[k] = v end end
  V.timeout(opts.timeout, "timeout")
  local host_cwd = self.cwd
  if opts.cwd ~= nil then
    host_cwd = sb:host_path(V.path(opts.cwd, "cwd"), self.cwd)
    if not sb:dir_exists(host_cwd) then V.fail("cwd", ("directory %q does not exist"):format(opts.cwd)) end
  end
  local id = opts.id
  if id == nil then
    sb.context_seq = (sb.context_seq or 0) + 1
    id = ("ctx-%d"):format(sb.context_seq)
  else
    V.id(id, "id", "code context id")
  end
  sb.contexts = sb.contexts or {}
  if sb.contexts[id] then
    errors.raise("CONTEXT_ALREADY_EXISTS", ("context %q exists"):format(id), { contextId = id })
  end
  local now = util.timestamp()
  local ctx = { id = id, language = language, cwd = sb:view_path(host_cwd), host_cwd = host_cwd, env = env,
    timeout = opts.timeout, createdAt = now, lastUsed = now, sandbox = sb, sessionId = self.id,
    queue = queue_mod.new(), generation = 0, executionCount = 0 }
  sb.contexts[id] = ctx
  local ok, err = pcall(ensure_kernel, ctx)
  if not ok then
    if sb.contexts[id] == ctx then sb.contexts[id] = nil end
    -- (a destroy that killed the interpreter is said as such, not as "did not start")
    self:check_ended("createCodeContext")
    error(err, 0)
  end
  return public(ctx)
end

function Session:listCodeContexts()
  self:check_live()
  local list = {}
  for _, ctx in pairs(self.sandbox.contexts or {}) do list[#list + 1] = public(ctx) end
  table.sort(list, function(a, b) return a.id < b.id end)
  return list
end

local function find_context(sb, ref)
  local id = type(ref) == "table" and ref.id or ref
  if type(id) ~= "string" then V.fail("context", "expected a context or its id") end
  local ctx = (sb.contexts or {})[id]
  if not ctx then
    errors.raise("CONTEXT_NOT_FOUND", ("code context %q does not exist"):format(id), { contextId = id })
  end
  return ctx
end

function Session:deleteCodeContext(ref)
  self:check_live()
  local ctx = find_context(self.sandbox, ref)
  drop_context(self.sandbox, ctx)
  return { success = true, contextId = ctx.id }
end

-- ---- running code --------------------------------------------------------

local run_options = { context = true, language = true, timeout = true, onStdout = true, onStderr = true,
  onResult = true, onError = true }

local function default_context(session, language)
  local sb = session.sandbox
  sb.default_contexts = sb.default_contexts or {}
  sb.default_starting = sb.default_starting or {}
  local id = sb.default_contexts[language]
  if id and sb.contexts and sb.contexts[id] then return sb.contexts[id] end
  -- one start at a time: a concurrent first runCode of the language waits
  -- for it (two would both create "default-<language>": CONTEXT_ALREADY_EXISTS)
  local starting = sb.default_starting[language]
  if not starting then
    starting = async.spawn(function()
      local ok, c = pcall(session.createCodeContext, session, { language = language, id = "default-" .. language })
      sb.default_starting[language] = nil
      if not ok then error(c, 0) end
      sb.default_contexts[language] = c.id
      return c
    end)
    if not starting.done then sb.default_starting[language] = starting end
  end
  local c = starting:wait()
  local ctx = sb.contexts and sb.contexts[c.id]
  if not ctx then -- (deleted while its interpreter started)
    session:check_ended("runCode")
    errors.raise("CONTEXT_NOT_FOUND", ("context %q was deleted while it started"):format(c.id), { contextId = c.id })
  end
  return ctx
end

-- One run: send the request, collect output/results until "done", the
-- timeout, or the interpreter's death. `emit(event)` sees every event.
-- Output chunks are kept as they were read (the result's logs are lists of
-- them) and count against the runtime-wide budget for buffered output
-- (lua/moonbox/_budget.lua, budget_ceiling: the policy's maxBufferedBytes)
-- until the run ends; a stream the budget cut keeps its prefix.
local function run_in(ctx, code, timeout, limit, emit, budget_ceiling)
  local k = ensure_kernel(ctx)
  ctx.lastUsed = util.timestamp()
  local id = ctx.executionCount + 1
  local exec = { code = code, logs = { stdout = {}, stderr = {} }, results = {}, executionCount = id }
  local sizes, truncated = { stdout = 0, stderr = 0, results = 0 }, false
  local hold, cut = budget.hold(budget_ceiling), {}
  k.sink = function(stream, data)
    if cut[stream] then truncated = true return end
    if sizes[stream] + #data > limit then
      truncated = true
      data = data:sub(1, math.max(0, limit - sizes[stream]))
      if #data == 0 then return end
    end
    local granted = hold:take(#data)
    if granted < #data then
      truncated, cut[stream] = true, true
      if granted == 0 then return end
      data = data:sub(1, granted)
    end
    sizes[stream] = sizes[stream] + #data
    table.insert(exec.logs[stream], data)
    emit { type = stream, text = data, timestamp = util.timestamp() }
  end
  local awaited, outcome = pcall(async.await, function(resume)
    local timer
    k.on_message = function(msg)
      if msg.id ~= id and msg.id ~= nil and msg.id ~= cjson.null then return end
      if msg.type == "result" and type(msg.data) == "table" then
        local r = msg.data
        if r.json == cjson.null then r.json = nil end
        -- results are bounded like output: a representation past the limit
        -- is cut (json, which cannot be cut, is dropped) and marked
        for key, value in pairs(r) do
          if type(value) == "string" and #value > limit then
            r[key] = value:sub(1, limit)
            r.truncated, truncated = true, true
          end
        end
        local json_size = r.json ~= nil and #(cjson.encode(r.json) or "") or 0
        if json_size > limit then
          r.json, r.truncated, truncated, json_size = nil, true, true, 0
        end
        -- all of a run's results together are bounded like one stream of
        -- output (limit), and held against the runtime-wide budget
        local size = json_size
        for _, value in pairs(r) do if type(value) == "string" then size = size + #value end end
        local granted = sizes.results + size <= limit and hold:take(size) or 0
        if granted < size then
          hold:give(granted)
          truncated = true
          return
        end
        sizes.results = sizes.results + size
        table.insert(exec.results, r)
        emit { type = "result", result = r, timestamp = util.timestamp() }
      elseif msg.type == "error" and type(msg.error) == "table" then
        exec.error = msg.error
        emit { type = "error", error = msg.error, timestamp = util.timestamp() }
      elseif msg.type == "done" then
        exec.executionCount = tonumber(msg.executionCount) or id
        if timer then timer:close() end
        resume("done")
      end
    end
    k.on_death = function() if timer and not timer:is_closing() then timer:close() end resume("died") end
    if timeout then
      timer = core.timer()
      timer:start(timeout, 0, function() timer:close() timer = nil resume("timeout") end)
    end
    k.requests:write(cjson.encode { id = id, code = code } .. "\n")
    return function() if timer and not timer:is_closing() then timer:close() end end
  end, "runCode")
  if not awaited then
    -- the caller's task was cancelled (moonbox.timeout, task:cancel): its
    -- output no longer counts, and its code must not go on holding the
    -- context: the interpreter and what it started are killed (on a task
    -- of their own: this one is cancelled) and the next run starts a fresh
    -- one, as after a timeout
    k.sink, k.on_message = nil, nil
    if ctx.kernel == k then
      ctx.kernel = nil
      ctx.executionCount = 0
    end
    async.spawn(function() pcall(k.kill, k) end)
    hold:release()
    error(outcome, 0)
  end
  k.on_message, k.on_death = nil, nil
  if outcome == "done" then
    k:_drain_output()
    ctx.executionCount = exec.executionCount
  elseif outcome == "timeout" then
    k:kill()
    ctx.kernel = nil
    ctx.executionCount = 0
    exec.error = { name = "TimeoutError", message = ("execution timed out after %d ms; the context was restarted " ..
      "and its state lost"):format(timeout), traceback = "" }
    exec.contextRestarted = true
    emit { type = "error", error = exec.error, timestamp = util.timestamp() }
  else
    ctx.kernel = nil
    ctx.executionCount = 0
    exec.error = { name = "InterpreterDied", message = ("the %s interpreter exited (code %s) while running%s; the " ..
      "next run starts a fresh one"):format(ctx.language, tostring(k.exit_code),
      k.protocol_error and (": it sent " .. k.protocol_error) or ""), traceback = "",
      exitCode = k.exit_code }
    exec.contextRestarted = true
    emit { type = "error", error = exec.error, timestamp = util.timestamp() }
  end
  k.sink = nil
  hold:release() -- handed over with the result
  exec.truncated = truncated
  return exec
end

local function prepare(session, code, opts)
  session:check_live()
  V.type(code, "string", "code")
  opts = require("moonbox.lib.seed_options").adapt(opts, require("moonbox.lib.seed_options").runCode, "runCode")
  opts = V.options(opts, run_options, "runCode options")
  V.timeout(opts.timeout, "timeout")
  for _, cb in ipairs { "onStdout", "onStderr", "onResult", "onError" } do V.type(opts[cb], "function", cb, true) end
  local ctx
  if opts.context ~= nil then ctx = find_context(session.sandbox, opts.context) end
  V.type(opts.language, "string", "language", true)
  if ctx and opts.language ~= nil and opts.language ~= ctx.language then
    V.fail("language", ("context %s runs %s, not %s"):format(ctx.id, ctx.language, opts.language))
  end
  local language = ctx and ctx.language or opts.language or "python"
  if not LANGUAGES[language] then
    V.fail("language", "expected \"python\", \"javascript\", \"typescript\" or \"lua\"")
  end
  -- the policy's say, before a default context (an interpreter) is started
  local changed = require("moonbox.policy").call_hook(session.sandbox.policy, "onRunCode", "runCode",
    { language = language }, session, code, { language = language, context = ctx and ctx.id })
  if changed ~= nil then code = changed end
  ctx = ctx or default_context(session, language)
  return ctx, opts, code
end

-- What onStdout/onStderr get: the seed's OutputMessage, {text, timestamp};
-- it also reads as its text (tostring, ..), for a callback written for a
-- string.
local OutputMessage = {
  __tostring = function(m) return m.text end,
  __concat = function(a, b) return tostring(a) .. tostring(b) end,
}
local CALLBACK_OF = { stdout = "onStdout", stderr = "onStderr", result = "onResult", error = "onError" }

function Session:runCode(code, opts)
  local ctx
  ctx, opts, code = prepare(self, code, opts)
  local limit = self.sandbox.policy.limits.maxOutputBytes
  local function emit(ev)
    local name = CALLBACK_OF[ev.type]
    local cb = name and opts[name]
    if not cb then return end
    local arg
    if ev.type == "result" then arg = ev.result
    elseif ev.type == "error" then arg = ev.error
    else arg = setmetatable({ text = ev.text, timestamp = ev.timestamp }, OutputMessage) end
    async.user_callback(name, cb, arg)
  end
  local ok, result = pcall(ctx.queue.run, ctx.queue, run_in, ctx, code, opts.timeout or ctx.timeout, limit, emit,
    self.sandbox.policy.limits.maxBufferedBytes)
  self:check_ended("runCode")
  if not ok then error(result, 0) end
  return result
end

-- runCodeStream(code, opts) -> iterator of stdout/stderr/result/error events
-- then one complete, delivered as they happen.
function Session:runCodeStream(code, opts)
  local ctx
  ctx, opts, code = prepare(self, code, opts)
  local limit = self.sandbox.policy.limits.maxOutputBytes
  local events, head, tail, waiter = {}, 1, 0, nil
  local function push(ev)
    tail = tail + 1
    events[tail] = ev
    if waiter then local w = waiter waiter = nil w() end
  end
  local task = async.spawn(function()
    local ok, exec = pcall(ctx.queue.run, ctx.queue, run_in, ctx, code, opts.timeout or ctx.timeout, limit, push,
      self.sandbox.policy.limits.maxBufferedBytes)
    local ended_ok, ended_err = pcall(self.check_ended, self, "runCodeStream")
    if not ended_ok then ok, exec = false, ended_err end
    if ok then
      push { type = "complete", executionCount = exec.executionCount, error = exec.error,
        contextRestarted = exec.contextRestarted, timestamp = util.timestamp() }
    else
      push { type = "error", error = exec, timestamp = util.timestamp() }
    end
    push(false)
  end)
  local ended = false
  return setmetatable({ task = task }, { __call = function()
    if ended then return nil end -- (called again after the end: nil again, never a wait)
    while head > tail do
      async.await(function(resume) waiter = resume return function() waiter = nil end end, "runCodeStream")
    end
    local ev = events[head]
    events[head] = nil
    head = head + 1
    if not ev then ended = true end
    return ev or nil
  end })
end

-- Stop every interpreter of a sandbox (destroy, shutdown).
function M.kill_all(sb)
  for id, ctx in pairs(sb.contexts or {}) do
    sb.contexts[id] = nil
    if ctx.kernel then ctx.kernel:kill() end
  end
end

-- deleteSession(id): the interpreters of the contexts the session made go
-- with everything else it started (their ids are CONTEXT_NOT_FOUND after)
function M.kill_session(sb, session_id)
  if session_id == nil then return end -- (destroy: kill_all, once the sessions are gone)
  local mine = {}
  for _, ctx in pairs(sb.contexts or {}) do
    if ctx.sessionId == session_id then mine[#mine + 1] = ctx end
  end
  for _, ctx in ipairs(mine) do drop_context(sb, ctx) end
end

-- A part of Session (lib/compose.lua): the code calls; a sandbox's
-- interpreters stop once its sessions are gone, a session's with it.
function M.install(class, hooks)
  compose.methods(class, Session, "code")
  compose.add(hooks, "session_ending", M.kill_session)
  compose.add(hooks, "sandbox_end", M.kill_all)
end

return M
