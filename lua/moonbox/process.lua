-- Background processes: started from a session (its exported env and cwd),
-- owned by the sandbox, each in its own cgroup so kill reaches the whole
-- tree, with bounded logs that can be read, streamed and waited on.
-- Docs: docs/processes.md.
local core = require "moonbox.core"
local async = require "moonbox.async"
local errors = require "moonbox.errors"
local policy_mod = require "moonbox.policy"
local logbuf = require "moonbox._logbuf"
local tree = require "moonbox._tree"
local util = require "moonbox._util"
local limits = require "moonbox._limits"
local V = require "moonbox._validate"
local Session = require("moonbox.session").Session

local M = {}

local Process = {}
Process.__index = Process
M.Process = Process

local function after(ms, fn)
  local t = core.timer()
  t:start(ms, 0, function() t:close() fn() end)
  return t
end

local function notify(list, ...)
  for _, fn in ipairs(list) do fn(...) end
end

-- Public fields are plain: id, pid, command, status, startTime, endTime,
-- exitCode, sessionId (and error for status "error").
local function new_process(sandbox, session, id, command)
  local limit = sandbox.policy.limits.maxLogBytes
  return setmetatable({
    id = id, pid = nil, command = command, status = "starting", sessionId = session.id,
    startTime = util.timestamp(), endTime = nil, exitCode = nil,
    _sandbox = sandbox, _logs = { stdout = logbuf.new(limit), stderr = logbuf.new(limit) },
    _listeners = {}, _exit_waiters = {}, _signalled = false,
  }, Process)
end

-- ---- lifecycle -----------------------------------------------------------

function Process:_output(stream, data)
  self._logs[stream]:append(data)
  if self._on_output then self._on_output(stream, data) end
  notify(self._listeners, stream, data)
end

function Process:_exited(code, signal)
  self.exitCode = code
  if code == 137 and limits.oom_kills(self._sandbox.limits_state) > (self._oom_before or 0) then
    self.oomKilled = true
  end
  self.endTime = util.timestamp()
  if self._signalled then self.status = "killed"
  elseif code == 0 then self.status = "completed"
  else self.status = "failed" end
  self._term_signal = signal
  for _, t in pairs(self._timers) do if not t:is_closing() then t:close() end end
  -- output written before the exit is in the pipes: take it before reporting
  for stream, s in pairs(self._pipes) do
    local rest = s:try_read()
    if rest and #rest > 0 then self:_output(stream, rest) end
  end
  -- forgotten before anyone is told, so a waiter that wakes sees it gone
  if self._auto_cleanup and self._sandbox.processes[self.id] == self then self._sandbox.processes[self.id] = nil end
  if self._on_exit then
    local ok, err = pcall(self._on_exit, code)
    if not ok then io.stderr:write("moonbox: onExit: ", errors.format(err), "\n") end
  end
  notify(self._listeners, "exit", code)
  local waiters = self._exit_waiters
  self._exit_waiters = {}
  notify(waiters)
  if self._cgroup and not tree.populated(self._cgroup) then
    tree.remove_cgroup(self._cgroup)
    self._cgroup_removed = true
  end
end

function Process:_close_pipes()
  for stream, s in pairs(self._pipes or {}) do
    s:close()
    self._pipes[stream] = nil
  end
end

function Process:_running()
  return self.status == "running" or self.status == "starting"
end

-- The pids of the process's tree (the process, its descendants, and in
-- cgroup mode anything that setsid'd or double-forked away from it).
function Process:_tree_pids()
  if self._cgroup then return tree.cgroup_pids(self._cgroup) end
  local pids = tree.descendants(self.pid)
  table.insert(pids, 1, self.pid)
  return pids
end

function Process:_signal_tree(sig)
  if sig == core.signum("SIGKILL") and self._cgroup then
    tree.kill_cgroup(self._cgroup)
    return
  end
  tree.signal_pids(self:_tree_pids(), sig)
end

-- kill(signal?): an explicit signal is sent to the whole tree; without one,
-- SIGTERM now and SIGKILL to whatever is left after limits.killGraceMs.
function Process:kill(signal)
  if signal ~= nil and type(signal) ~= "string" and type(signal) ~= "number" then
    V.fail("signal", "expected a signal name or number")
  end
  local ok, signum = pcall(core.signum, signal or "SIGTERM")
  if not ok then V.fail("signal", ("unknown signal %s"):format(tostring(signal))) end
  if not self:_running() or not self.pid then return { success = false, processId = self.id, status = self.status } end
  self._signalled = true
  self:_signal_tree(signum)
  if signal == nil then
    local grace = self._sandbox.policy.limits.killGraceMs
    self._timers.kill = after(grace, function()
      if self:_running() then self:_signal_tree(core.signum("SIGKILL")) end
    end)
  end
  return { success = true, processId = self.id, signal = core.signame(signum) }
end

function Process:getStatus() return self.status end

function Process:getLogs()
  return { stdout = self._logs.stdout:text(), stderr = self._logs.stderr:text(),
    truncated = self._logs.stdout.truncated or self._logs.stderr.truncated }
end

-- waitForExit(timeoutMs?) -> {exitCode}; PROCESS_READY_TIMEOUT on timeout.
function Process:waitForExit(timeout_ms)
  V.timeout(timeout_ms, "timeoutMs")
  if self:_running() then
    local done
    local function forget()
      for i, w in ipairs(self._exit_waiters) do
        if w == done then table.remove(self._exit_waiters, i) break end
      end
    end
    local timed_out = async.await(function(resume)
      local timer
      done = function()
        if timer and not timer:is_closing() then timer:close() end
        resume(false)
      end
      table.insert(self._exit_waiters, done)
      if timeout_ms then timer = after(timeout_ms, function() forget() resume(true) end) end
      return function()
        if timer and not timer:is_closing() then timer:close() end
        forget()
      end
    end, "waitForExit")
    if timed_out then
      errors.raise("PROCESS_READY_TIMEOUT", ("process %q did not exit within %d ms"):format(self.id, timeout_ms),
        { processId = self.id, timeout = timeout_ms })
    end
  end
  return { exitCode = self.exitCode, status = self.status }
end

-- Wait until check() returns a value, re-checking after every output chunk;
-- PROCESS_EXITED_BEFORE_READY if the process ends first.
function Process:_wait_until(check, timeout_ms, what)
  local found = check()
  if found then return found end
  if not self:_running() then
    errors.raise("PROCESS_EXITED_BEFORE_READY", ("process %q exited (code %s) before %s"):format(
      self.id, tostring(self.exitCode), what), { processId = self.id, exitCode = self.exitCode })
  end
  local result, reason = async.await(function(resume)
    local timers, listener = {}, nil
    local function teardown()
      for _, t in pairs(timers) do if not t:is_closing() then t:close() end end
      for i, l in ipairs(self._listeners) do if l == listener then table.remove(self._listeners, i) break end end
    end
    local function finish(...)
      teardown()
      resume(...)
    end
    listener = function(kind)
      local r = check()
      if r then finish(r) elseif kind == "exit" then finish(nil, "exited") end
    end
    table.insert(self._listeners, listener)
    if timeout_ms then timers.timeout = after(timeout_ms, function() finish(nil, "timeout") end) end
    -- cancelled: undo only (resuming here would wake the task twice)
    return teardown
  end, what)
  if result then return result end
  if reason == "timeout" then
    errors.raise("PROCESS_READY_TIMEOUT", ("process %q: %s not seen within %d ms"):format(self.id, what, timeout_ms),
      { processId = self.id, timeout = timeout_ms })
  end
  errors.raise("PROCESS_EXITED_BEFORE_READY", ("process %q exited (code %s) before %s"):format(
    self.id, tostring(self.exitCode), what), { processId = self.id, exitCode = self.exitCode })
end

-- waitForLog(pattern, timeoutMs?, {plain?}) -> {line, match}: searches what
-- is buffered first, then each new chunk, across chunk boundaries.
function Process:waitForLog(pattern, timeout_ms, opts)
  V.type(pattern, "string", "pattern")
  if pattern == "" then V.fail("pattern", "pattern is empty") end
  V.timeout(timeout_ms, "timeoutMs")
  opts = V.options(opts, { plain = true }, "waitForLog options")
  local function check()
    for _, stream in ipairs { "stdout", "stderr" } do
      local text = self._logs[stream]:text()
      local s, e = text:find(pattern, 1, opts.plain)
      if s then
        local line_start = s
        while line_start > 1 and text:sub(line_start - 1, line_start - 1) ~= "\n" do line_start = line_start - 1 end
        local line_end = text:find("\n", e, true) or (#text + 1)
        if line_end == e and e >= s and text:sub(e, e) == "\n" then line_end = e end
        return { line = text:sub(line_start, line_end - 1), match = text:sub(s, e), stream = stream }
      end
    end
  end
  return self:_wait_until(check, timeout_ms, ("log pattern %q"):format(pattern))
end

-- waitForPort(port, {mode = "http"|"tcp", path, status, timeout, interval})
function Process:waitForPort(port, opts)
  if type(port) ~= "number" or port < 1 or port > 65535 or port % 1 ~= 0 then
    V.fail("port", "expected an integer 1-65535")
  end
  opts = V.options(opts, { mode = true, path = true, status = true, timeout = true, interval = true,
    host = true }, "waitForPort options")
  local mode = opts.mode or "http"
  if mode ~= "http" and mode ~= "tcp" then V.fail("mode", "expected \"http\" or \"tcp\"") end
  V.timeout(opts.timeout, "timeout")
  local interval = opts.interval
  if interval ~= nil and (type(interval) ~= "number" or interval ~= interval or interval < 1) then
    V.fail("interval", "expected a number of milliseconds >= 1") -- 0 would probe without pause
  end
  V.type(opts.path, "string", "path", true)
  V.type(opts.host, "string", "host", true)
  if opts.status ~= nil and (type(opts.status) ~= "number" or opts.status < 100 or opts.status > 599) then
    V.fail("status", "expected an HTTP status 100-599")
  end
  local probe = require("moonbox._probe")
  local host = opts.host or "127.0.0.1"
  interval = interval or 100
  local deadline = opts.timeout and util.now_ms() + opts.timeout
  -- A port gives no event to wait for: probe, then sleep an interval (or
  -- until the process exits, whichever comes first).
  local probe_opts = { path = opts.path, status = opts.status, sandbox = self._sandbox }
  while true do
    if probe[mode](host, port, probe_opts) then return { success = true, port = port, mode = mode } end
    if not self:_running() then
      errors.raise("PROCESS_EXITED_BEFORE_READY", ("process %q exited (code %s) before port %d was ready"):format(
        self.id, tostring(self.exitCode), port), { processId = self.id, exitCode = self.exitCode, port = port })
    end
    if deadline and util.now_ms() >= deadline then
      errors.raise("PROCESS_READY_TIMEOUT", ("process %q: port %d (%s) not ready within %d ms"):format(
        self.id, port, mode, opts.timeout), { processId = self.id, port = port, timeout = opts.timeout })
    end
    local wait = interval
    if deadline then wait = math.max(0, math.min(wait, deadline - util.now_ms())) end
    pcall(self.waitForExit, self, wait)
  end
end

-- ---- starting --------------------------------------------------------------

local start_options = { processId = true, env = true, cwd = true, timeout = true, stdin = true, onOutput = true,
  onExit = true, onStart = true, autoCleanup = true }

function Session:startProcess(command, opts)
  self:_check_live()
  local sb = self.sandbox
  V.command(command)
  opts = V.options(opts, start_options, "startProcess options")
  local env = V.env(opts.env, "env")
  V.timeout(opts.timeout, "timeout")
  V.type(opts.stdin, "string", "stdin", true)
  V.type(opts.processId, "string", "processId", true)
  for _, cb in ipairs { "onOutput", "onExit", "onStart" } do V.type(opts[cb], "function", cb, true) end
  local cwd = self.cwd
  if opts.cwd ~= nil then
    cwd = sb:host_path(V.path(opts.cwd, "cwd"), self.cwd)
    if not sb:_dir_exists(cwd) then V.fail("cwd", ("directory %q does not exist"):format(opts.cwd)) end
  end
  local changed = policy_mod.call_hook(sb.policy, "onStartProcess", "startProcess", { command = command },
    self, command, opts)
  if changed ~= nil then command = changed end
  local id = opts.processId
  if id ~= nil then
    if not id:match("^[%w_.-]+$") or #id > 128 then
      V.fail("processId", "1-128 characters [A-Za-z0-9_.-]")
    end
    local existing = sb.processes[id]
    if existing and existing:_running() then
      errors.raise("PROCESS_ALREADY_EXISTS", ("a process with id %q is already running"):format(id),
        { processId = id })
    end
  else
    repeat
      sb.process_seq = sb.process_seq + 1
      id = "proc-" .. sb.process_seq
    until not sb.processes[id]
  end
  local running = 0
  for _, p in pairs(sb.processes) do if p:_running() then running = running + 1 end end
  if running >= sb.policy.limits.maxProcesses then
    errors.raise("POLICY_DENIED", ("sandbox %q already runs %d processes (limits.maxProcesses)"):format(sb.id, running))
  end

  local shown = type(command) == "table" and table.concat(command, " ") or command
  local p = new_process(sb, self, id, shown)
  p._on_output, p._on_exit, p._auto_cleanup = opts.onOutput, opts.onExit, opts.autoCleanup
  p._timers, p._pipes = {}, {}
  p._oom_before = limits.oom_kills(sb.limits_state)
  sb.processes[id] = p

  local full_env = util.copy(self:current_env())
  for k, v in pairs(env or {}) do if v == false then full_env[k] = nil else full_env[k] = v end end
  local args = type(command) == "table" and command or { "bash", "-c", command }
  for i, a in ipairs(args) do args[i] = tostring(a) end
  if tree.mode() == "cgroup" then
    p._cgroup = tree.create(sb.cgroup_name .. "/p-" .. id)
  end
  local proc, pipes, code = core.spawn(sb:_spawn_spec {
    args = args,
    file = type(command) ~= "table" and "/bin/bash" or nil,
    env = full_env,
    cwd = cwd,
    stdio = { [0] = opts.stdin and "pipe" or "null", [1] = "pipe", [2] = "pipe" },
    setsid = true,
    pdeathsig = "SIGKILL",
    cgroup = p._cgroup,
    extra_cgroups = sb.limits_state.extra_cgroups,
    rlimits = sb.limits_state.rlimits,
    seccomp = sb.limits_state.seccomp,
    on_exit = function(exit_code, signal) p:_exited(exit_code, signal) end,
  })
  if not proc then
    p.status, p.error, p.errorCode = "error", pipes, code
    p.endTime = util.timestamp()
    if p._cgroup then tree.remove_cgroup(p._cgroup) p._cgroup = nil end
    notify(p._exit_waiters)
    p._exit_waiters = {}
    return p
  end
  p.pid = proc:pid()
  p._proc = proc
  p.status = "running"
  if opts.stdin then
    local s = pipes[0]
    s:write(opts.stdin, function() s:close() end)
  end
  for fd, stream in pairs { [1] = "stdout", [2] = "stderr" } do
    local s = pipes[fd]
    p._pipes[stream] = s
    s:read_start(function(_, data)
      if data then p:_output(stream, data)
      else
        s:close()
        p._pipes[stream] = nil
      end
    end)
  end
  if opts.timeout and opts.timeout > 0 then
    p._timers.timeout = after(opts.timeout, function()
      if p:_running() then p:kill() end
    end)
  end
  if opts.onStart then
    local ok, err = pcall(opts.onStart, p)
    if not ok then io.stderr:write("moonbox: onStart: ", errors.format(err), "\n") end
  end
  return p
end

-- ---- sandbox-wide calls (any session sees every process) -------------------

local function find(sb, id)
  V.type(id, "string", "processId")
  local p = sb.processes[id]
  if not p then
    errors.raise("PROCESS_NOT_FOUND", ("process %q does not exist"):format(id), { processId = id })
  end
  return p
end

function Session:listProcesses()
  self:_check_live()
  local list = {}
  for _, p in pairs(self.sandbox.processes) do list[#list + 1] = p end
  table.sort(list, function(a, b) return a.startTime < b.startTime or (a.startTime == b.startTime and a.id < b.id) end)
  return list
end

function Session:getProcess(id)
  self:_check_live()
  V.type(id, "string", "processId")
  return self.sandbox.processes[id]
end

function Session:killProcess(id, signal)
  self:_check_live()
  return find(self.sandbox, id):kill(signal)
end

function Session:killAllProcesses(signal)
  self:_check_live()
  local n = 0
  for _, p in pairs(self.sandbox.processes) do
    if p:_running() and p.pid then
      p:kill(signal)
      n = n + 1
    end
  end
  return n
end

function Session:getProcessLogs(id)
  self:_check_live()
  local p = find(self.sandbox, id)
  local logs = p:getLogs()
  logs.processId = id
  return logs
end

-- streamProcessLogs(id) -> iterator of {type = "stdout"|"stderr"|"exit",
-- data, exitCode, processId, timestamp}: the buffer is replayed and live
-- output follows from the same instant, so nothing is lost or repeated.
-- iterator:close() stops following (the process runs on).
function Session:streamProcessLogs(id)
  self:_check_live()
  local p = find(self.sandbox, id)
  local events, head, tail, waiter = {}, 1, 0, nil
  local limit = self.sandbox.policy.limits.maxLogBytes
  local queued, dropped = 0, false
  local function push(ev)
    tail = tail + 1
    events[tail] = ev
    if waiter then local w = waiter waiter = nil w() end
  end
  for _, stream in ipairs { "stdout", "stderr" } do
    local text = p._logs[stream]:text()
    if #text > 0 then push { type = stream, data = text, processId = id, timestamp = util.timestamp() } end
  end
  local listener, closed = nil, false
  local function detach()
    for i, l in ipairs(p._listeners) do if l == listener then table.remove(p._listeners, i) break end end
  end
  listener = function(kind, data)
    if kind == "exit" then
      detach()
      push { type = "exit", exitCode = data, processId = id, timestamp = util.timestamp(), truncated = dropped }
      push(false)
    elseif queued + #data > 2 * limit then
      dropped = true -- a reader that stopped reading cannot grow memory without bound
    else
      queued = queued + #data
      push { type = kind, data = data, processId = id, timestamp = util.timestamp(), _size = #data }
    end
  end
  if p:_running() then
    table.insert(p._listeners, listener)
  else
    push { type = "exit", exitCode = p.exitCode, processId = id, timestamp = util.timestamp() }
    push(false)
  end
  -- close(): stop following; a loop waiting for the next event ends (nil)
  local function close()
    if closed then return end
    closed = true
    detach()
    events, head, tail = {}, 1, 0
    push(false)
  end
  return setmetatable({ close = close, cancel = close }, {
    __call = function()
      while head > tail do
        async.await(function(resume)
          waiter = resume
          return function() waiter = nil end
        end, "streamProcessLogs iteration")
      end
      local ev = events[head]
      events[head] = nil
      head = head + 1
      if not ev then return nil end
      if ev._size then queued = queued - ev._size ev._size = nil end
      return ev
    end,
  })
end

-- Kill the processes a session started (deleteSession) or all of a
-- sandbox's (destroy), and wait until they are gone.
function M.kill_all(sb, session_id)
  local victims = {}
  for _, p in pairs(sb.processes) do
    if (session_id == nil or p.sessionId == session_id) and p:_running() and p.pid then
      p._signalled = true
      p:_signal_tree(core.signum("SIGKILL"))
      victims[#victims + 1] = p
    end
  end
  for _, p in ipairs(victims) do
    if p:_running() then p:waitForExit(5000) end
    if p._cgroup and not p._cgroup_removed then
      tree.remove_when_empty(p._cgroup, async.sleep)
      p._cgroup_removed = true
    end
    p:_close_pipes()
  end
  return #victims
end

return M
