-- Background processes: started from a session (its exported env and cwd),
-- owned by the sandbox, each in its own cgroup so kill reaches the whole
-- tree, with bounded logs that can be read, streamed and waited on.
-- Docs: docs/processes.md.
local core = require "moonbox.core"
local async = require "moonbox.async"
local errors = require "moonbox.errors"
local policy_mod = require "moonbox.policy"
local logbuf = require "moonbox.process.logbuf"
local tree = require "moonbox.process.tree"
local cgroup = require "moonbox.process.cgroup"
local util = require "moonbox.lib.util"
local limits = require "moonbox.sandbox.limits"
local V = require "moonbox.lib.validate"
local pattern_mod = require "moonbox.lib.pattern"
local log_wait = require "moonbox.process.wait"
local compose = require "moonbox.lib.compose"
local output_budget = require "moonbox.session.budget"
local Session = {} -- this part's methods, installed by session/init.lua (M.install)

local M = {}

local Process = {}
Process.__index = Process
M.Process = Process

local function after(ms, fn)
  local t = core.timer()
  t:start(ms, 0, function() t:close() fn() end)
  return t
end

-- Over a copy: a listener may detach itself (or another) while called, and
-- removing from the list being walked skipped the next one (a second log
-- reader never saw its exit event and never ended). One detached meanwhile
-- is not called.
local function notify(list, ...)
  local copy = {}
  for i, fn in ipairs(list) do copy[i] = fn end
  for _, fn in ipairs(copy) do
    for _, f in ipairs(list) do
      if f == fn then fn(...) break end
    end
  end
end

-- Public fields are plain: id, pid, command, status, startTime, endTime,
-- exitCode, sessionId (and error for status "error").
local function new_process(sandbox, session, id, command)
  local limit, ceiling = sandbox.policy.limits.maxLogBytes, sandbox.policy.limits.maxBufferedBytes
  return setmetatable({
    id = id, pid = nil, command = command, status = "starting", sessionId = session.id,
    startTime = util.timestamp(), endTime = nil, exitCode = nil,
    _sandbox = sandbox, _logs = { stdout = logbuf.new(limit, ceiling), stderr = logbuf.new(limit, ceiling) },
    _listeners = {}, _exit_waiters = {}, _signalled = false,
  }, Process)
end

-- ---- lifecycle -----------------------------------------------------------

function Process:_output(stream, data)
  self._logs[stream]:append(data)
  if self._on_output then async.user_callback("onOutput", self._on_output, stream, data) end
  notify(self._listeners, stream, data)
end

-- A callback (a timer's, an exit's) that needs a proc-mode /proc pass runs
-- fn in a task of its own: the pass is awaited off the loop (_tree.scan).
local function run_in_task(what, fn)
  async.spawn(function()
    local ok, err = pcall(fn)
    if not ok and not (errors.is_error(err) and err.code == "CANCELLED") then
      io.stderr:write("moonbox: ", what, ": ", errors.format(err), "\n")
    end
  end)
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
  -- output written before the exit is in the pipes: take it before reporting
  for stream, s in pairs(self._pipes) do
    local rest = s:try_read()
    if rest and #rest > 0 then self:_output(stream, rest) end
  end
  -- forgotten before anyone is told, so a waiter that wakes sees it gone
  if self._auto_cleanup and self._sandbox.processes[self.id] == self then
    self._sandbox.processes[self.id] = nil
    self:_release_logs()
  end
  -- proc mode: what follows may need a /proc pass (pending timers, the
  -- records' bounds); it is awaited in a task before anyone is told
  if not self._cgroup and (next(self._timers) or M.completion_needs_scan(self)) then
    run_in_task("process exit", function()
      local ok, scan = pcall(tree.proc_table)
      -- (a failed pass keeps the timers, and the bounds wait for the next exit)
      self:_exit_told(code, ok and scan or false)
    end)
  else
    self:_exit_told(code)
  end
end

function Process:_exit_told(code, scan)
  -- descendants that outlive the process are still its tree: a pending
  -- timeout or kill grace goes on for them
  if scan ~= false and not (next(self._timers) and self:_alive(scan)) then self:_close_timers() end
  if self._cgroup then self:_alive() end -- an empty cgroup is removed now
  M.completed(self, scan) -- (before anyone is told: a waiter sees the bounds applied)
  if self._on_exit then async.user_callback("onExit", self._on_exit, code) end
  notify(self._listeners, "exit", code)
  local waiters = self._exit_waiters
  self._exit_waiters = {}
  notify(waiters)
end

-- The timeout, kill grace and kill passes: nothing is left for them to do.
function Process:_close_timers()
  for name, t in pairs(self._timers) do
    if not t:is_closing() then t:close() end
    self._timers[name] = nil
  end
end

-- The record is gone (dropped, removed, its sandbox destroyed): its logs
-- no longer count against the runtime-wide budget for buffered output.
function Process:_release_logs()
  self._logs.stdout:release()
  self._logs.stderr:release()
end

function Process:_close_pipes()
  for stream, s in pairs(self._pipes or {}) do
    s:close()
    self._pipes[stream] = nil
  end
end

function Process:is_running()
  return self.status == "running" or self.status == "starting"
end

-- Whether anything of the process's tree lives: the process itself, or
-- descendants that outlived it (a daemon, a fork bomb's children). In
-- cgroup mode the tree is everything in its cgroup; in proc mode see
-- tree.proc_tree. A tree found empty once stays empty: its cgroup is
-- removed, and in proc mode its ids are no longer looked for.
-- -> alive, known: known is false when the only sign of life is a process
-- that may be the tree's (proc mode: caught in execve, its marker not
-- readable yet: as likely a process just started by another record)
function Process:_alive(proc_table)
  if self:is_running() then return self.pid ~= nil, true end
  if not self.pid or self._tree_gone then return false end
  if self._cgroup then
    if not self._cgroup_removed and cgroup.populated(self._cgroup) then return true, true end
    if not self._cgroup_removed then cgroup.remove_cgroup(self._cgroup) end
    self._cgroup_removed = true
  else
    -- (maybe: a process that may be the tree's was caught in execve, its
    -- marker not readable yet; the tree is not known gone)
    local set, _, maybe = tree.proc_tree(self.pid, self._marker, false, proc_table, tree.adopters_of(self._sandbox))
    if next(set) then return true, true end
    if maybe then return true, false end
  end
  self._tree_gone = true
  return false
end

-- The pids of the process's tree (the process, its descendants, and in
-- cgroup mode anything that setsid'd or double-forked away from it).
function Process:_tree_pids()
  if not self.pid or self._tree_gone then return {} end
  if self._cgroup then
    return self._cgroup_removed and {} or cgroup.cgroup_pids(self._cgroup)
  end
  local pids = {}
  local set = tree.proc_tree(self.pid, self._marker, self:is_running(), nil, tree.adopters_of(self._sandbox))
  for pid in pairs(set) do pids[#pids + 1] = pid end
  return pids
end

-- SIGKILL in proc mode is repeated every 10 ms (about 2 s at most) until
-- nothing of the tree is left: a process forked between a scan and its
-- kill is found by the next pass.
local KILL_PASSES, KILL_PASS_MS = 200, 10

-- scan: a tree.proc_table() to reuse for the first signal.
function Process:_signal_tree(sig, scan)
  if not self.pid or self._tree_gone then return end
  if self._cgroup then
    if self._cgroup_removed then return end
    if sig == core.signum("SIGKILL") then cgroup.kill_cgroup(self._cgroup) return end
    tree.signal_pids(cgroup.cgroup_pids(self._cgroup), sig)
    return
  end
  local found, maybe = tree.signal_proc_tree(self.pid, self._marker, self:is_running(), sig, scan,
    tree.adopters_of(self._sandbox))
  if sig ~= core.signum("SIGKILL") or (found == 0 and not maybe) or self._timers.passes then return end
  -- the passes: a task, closed like the timers (_close_timers)
  local passes = { closed = false }
  function passes.close() passes.closed = true end
  function passes.is_closing() return passes.closed end
  self._timers.passes = passes
  run_in_task("kill passes", function()
    for _ = 1, KILL_PASSES do
      async.sleep(KILL_PASS_MS)
      if passes.closed then break end
      local table_ = tree.proc_table()
      if passes.closed or not self:_alive(table_) then break end
      tree.signal_proc_tree(self.pid, self._marker, self:is_running(), sig, table_, tree.adopters_of(self._sandbox))
    end
    passes.closed = true
    if self._timers.passes == passes then self._timers.passes = nil end
  end)
end

-- Wait (in a task) until nothing of the tree is left or deadline
-- (util.now_ms(); default ~2 s from now: SIGKILLed processes take a moment
-- to exit): the cgroup's "populated 0" where there is one, else a /proc
-- pass every KILL_PASS_MS.
function Process:_wait_tree_gone(deadline)
  deadline = deadline or util.now_ms() + KILL_PASSES * KILL_PASS_MS
  while self:_alive() do
    local left = math.floor(deadline - util.now_ms())
    if left <= 0 then return false end
    if self._cgroup and not self._cgroup_removed then
      if not pcall(cgroup.wait_empty, self._cgroup, left, async.sleep) then return false end
    else
      async.sleep(math.min(left, KILL_PASS_MS))
    end
  end
  return true
end

-- kill(signal?): an explicit signal is sent to the whole tree, and that is
-- all; without one, SIGTERM now and SIGKILL to whatever is left after
-- limits.killGraceMs, and it returns once the process has ended, so its
-- status reads "killed" at once, as after the seed's killProcess.
function Process:kill(signal)
  local r = self:_kill(signal)
  if signal == nil and r.success then M.await_ended({ self }, self._sandbox) end
  return r
end

-- Wait until procs have ended, each with its whole tree (descendants that
-- ignore SIGTERM go at the grace's SIGKILL): at most the kill grace and 2 s
-- more for the SIGKILL; outside a task, not at all.
function M.await_ended(procs, sb)
  if not async.in_task() then return end
  local deadline = util.now_ms() + sb.policy.limits.killGraceMs + 2000
  for _, p in ipairs(procs) do
    local left = math.floor(deadline - util.now_ms())
    if left <= 0 then break end
    if p:is_running() then pcall(p.waitForExit, p, left) end
    p:_wait_tree_gone(deadline)
  end
end

-- A proc-mode process that ended but is not yet known to have left nothing
-- needs a /proc pass to tell: calls that look at many take one, shared.
local function needs_scan(p)
  return not p:is_running() and p.pid and not p._cgroup and not p._tree_gone
end

-- A proc-mode process whose tree is not known gone: its kill looks at a pass.
local function in_proc_tree(p)
  return p.pid ~= nil and not p._cgroup and not p._tree_gone
end

-- One pass for every proc-mode process of sb (of session_id), taken before
-- looking at them (no wait inside a walk of sb.processes); nil if none.
local function proc_pass(sb, session_id)
  for _, p in pairs(sb.processes) do
    if (session_id == nil or p.sessionId == session_id) and in_proc_tree(p) then return tree.proc_table() end
  end
  return nil
end

-- kill(signal); scan: a tree.proc_table() to reuse.
-- signal name or number -> its number; anything else is VALIDATION_FAILED
-- ("9" is 9, as a query string gives it; 0 sends nothing and is refused)
local function check_signal(signal)
  if signal ~= nil and type(signal) ~= "string" and type(signal) ~= "number" then
    V.fail("signal", "expected a signal name or number")
  end
  if type(signal) == "string" and signal:match("^%d+$") then signal = tonumber(signal) end
  local ok, signum = pcall(core.signum, signal or "SIGTERM")
  if not ok or signum == 0 then V.fail("signal", ("unknown signal %s"):format(tostring(signal))) end
  return signum
end

-- Signals whose default action does not end a process: sending one does
-- not make the process's end a kill (status "killed").
local NOT_ENDING = {}
for _, name in ipairs { "SIGCHLD", "SIGCONT", "SIGSTOP", "SIGTSTP", "SIGTTIN", "SIGTTOU", "SIGURG", "SIGWINCH" } do
  NOT_ENDING[core.signum(name)] = true
end

function Process:_kill(signal, scan)
  local signum = check_signal(signal)
  -- one /proc pass (proc mode) for the check and the signal
  if not scan and in_proc_tree(self) then scan = tree.proc_table() end
  if not self:_alive(scan) then return { success = false, processId = self.id, status = self.status } end
  -- (a process that already ended keeps its status; its leftovers die)
  if self:is_running() and not NOT_ENDING[signum] then self._signalled = true end
  self:_signal_tree(signum, scan)
  if signal == nil and not self._timers.kill then
    local grace = self._sandbox.policy.limits.killGraceMs
    self._timers.kill = after(grace, function()
      self._timers.kill = nil
      run_in_task("kill grace", function()
        local table_ = needs_scan(self) and tree.proc_table() or nil
        if self:_alive(table_) then self:_signal_tree(core.signum("SIGKILL"), table_) end
      end)
    end)
  end
  return { success = true, processId = self.id, signal = core.signame(signum) }
end

function Process:getStatus() return self.status end

-- "exited (code 3)", or for one that never started "could not start (...)"
function Process:_how_ended()
  if self.status == "error" then return ("could not start (%s)"):format(tostring(self.error)) end
  return ("exited (code %s)"):format(tostring(self.exitCode))
end

function Process:getLogs()
  local r = { stdout = self._logs.stdout:text(), stderr = self._logs.stderr:text(),
    truncated = self._logs.stdout.truncated or self._logs.stderr.truncated }
  if self._encoding == "base64" then -- startProcess{encoding = "base64"} (the seed's option)
    r.stdout, r.stderr, r.encoding = core.base64_encode(r.stdout), core.base64_encode(r.stderr), "base64"
  end
  return r
end

-- waitForExit(timeoutMs?) -> {exitCode}; PROCESS_READY_TIMEOUT on timeout.
function Process:waitForExit(timeout_ms)
  V.timeout(timeout_ms, "timeoutMs")
  if self:is_running() then
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

-- waitForLog(pattern, timeoutMs?, {plain?}) -> {line, match, stream,
-- captures?}: searches what is buffered first, then each new chunk, across
-- chunk boundaries, with the step-counting matcher (moonbox.lib.pattern)
-- in slices that never hold the loop (process/wait.lua, which also holds
-- the budget: M.LOG_SEARCH).
M.LOG_SEARCH = log_wait.LOG_SEARCH

function Process:waitForLog(pattern, timeout_ms, opts)
  V.type(pattern, "string", "pattern")
  if pattern == "" then V.fail("pattern", "pattern is empty") end
  V.timeout(timeout_ms, "timeoutMs")
  opts = V.options(opts, { plain = true }, "waitForLog options")
  V.type(opts.plain, "boolean", "plain", true)
  if #pattern > M.LOG_SEARCH.maxPatternBytes then
    V.fail("pattern", ("pattern is longer than %d bytes"):format(M.LOG_SEARCH.maxPatternBytes))
  end
  local plain = opts.plain or pattern_mod.is_plain(pattern)
  local q = { pattern = pattern, plain = plain, cp = not plain and pattern_mod.check(pattern, "pattern"),
    what = ("log pattern %q"):format(pattern) }
  return log_wait.for_log({
    id = self.id, logs = self._logs, listeners = self._listeners,
    check_running = function(what)
      if self:is_running() then return end
      errors.raise("PROCESS_EXITED_BEFORE_READY", ("process %q %s before %s"):format(self.id, self:_how_ended(),
        what), { processId = self.id, exitCode = self.exitCode, status = self.status })
    end,
  }, q, timeout_ms)
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
  local probe = require("moonbox.process.probe")
  local host = opts.host or "127.0.0.1"
  interval = interval or 100
  local deadline = opts.timeout and util.now_ms() + opts.timeout
  -- A port gives no event to wait for: probe, then sleep an interval (or
  -- until the process exits, whichever comes first).
  -- only a listener of this process's tree makes it ready
  local probe_opts = { path = opts.path, status = opts.status, sandbox = self._sandbox,
    owner_pids = function() return self:_tree_pids() end }
  while true do
    if probe[mode](host, port, probe_opts) then return { success = true, port = port, mode = mode } end
    if not self:is_running() then
      errors.raise("PROCESS_EXITED_BEFORE_READY", ("process %q %s before port %d was ready"):format(self.id,
        self:_how_ended(), port), { processId = self.id, exitCode = self.exitCode, status = self.status, port = port })
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
  onExit = true, onStart = true, autoCleanup = true, _encoding = true } -- (_encoding: the seed's encoding)

-- The command and options of startProcess, checked (and passed through the
-- onStartProcess hook) -> command, opts, env, cwd (host path).
local function checked_start(session, command, opts)
  local sb = session.sandbox
  -- no command in a sandbox made from an image: the image's Entrypoint
  -- followed by its Cmd, as an argv (docs/images.md)
  if command == nil and sb.image then command = sb:image_command() end
  V.command(command)
  local seed_options = require "moonbox.lib.seed_options"
  opts = seed_options.adapt(opts, seed_options.startProcess, "startProcess")
  opts = V.options(opts, start_options, "startProcess options")
  local env = V.env(opts.env, "env")
  V.timeout(opts.timeout, "timeout")
  V.type(opts.stdin, "string", "stdin", true)
  V.type(opts.processId, "string", "processId", true)
  V.type(opts.autoCleanup, "boolean", "autoCleanup", true)
  for _, cb in ipairs { "onOutput", "onExit", "onStart" } do V.type(opts[cb], "function", cb, true) end
  local cwd = session.cwd
  if opts.cwd ~= nil then
    cwd = sb:host_path(V.path(opts.cwd, "cwd"), session.cwd)
    if not sb:dir_exists(cwd) then V.fail("cwd", ("directory %q does not exist"):format(opts.cwd)) end
  end
  local changed = policy_mod.call_hook(sb.policy, "onStartProcess", "startProcess", { command = command },
    session, command, opts)
  if changed ~= nil then command = changed end
  return command, opts, env, cwd
end

-- The new process's id (the one asked for, unless such a process runs, or
-- the next proc-N), within limits.maxProcesses.
local function claim_id(sb, id)
  if id ~= nil then
    V.id(id, "processId", "process id")
    local existing = sb.processes[id]
    if existing and existing:is_running() then
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
  for _, p in pairs(sb.processes) do if p:is_running() then running = running + 1 end end
  if running >= sb.policy.limits.maxProcesses then
    errors.raise("POLICY_DENIED", ("sandbox %q already runs %d processes (limits.maxProcesses)"):format(sb.id, running),
      { limit = "maxProcesses", maxProcesses = sb.policy.limits.maxProcesses })
  end
  return id
end

-- A process that could not be spawned: its record says why (status "error").
local function spawn_failed(p, message, code)
  p.status, p.error, p.errorCode = "error", message, code
  p.endTime = util.timestamp()
  if p._cgroup then cgroup.remove_cgroup(p._cgroup) p._cgroup = nil end
  notify(p._exit_waiters)
  p._exit_waiters = {}
  M.completed(p)
  return p
end

-- The spawned process's pipes and timeout: stdin written then closed,
-- stdout and stderr read into its log until EOF.
local function attach(p, proc, pipes, opts)
  p.pid = proc:pid()
  -- (beyond) the pid the sandbox's own processes see (`kill`, `ps` inside);
  -- pid is the host's, as the runtime and a host-side script use it
  p.sandboxPid = proc:sandbox_pid()
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
      p._timers.timeout = nil
      run_in_task("process timeout", function() if p:_alive() then p:kill() end end)
    end)
  end
end

function Session:startProcess(command, opts)
  self:check_live()
  local sb = self.sandbox
  local env, cwd
  command, opts, env, cwd = checked_start(self, command, opts)
  local id = claim_id(sb, opts.processId)

  local shown = type(command) == "table" and util.shell_join(command) or command
  local p = new_process(sb, self, id, shown)
  p._on_output, p._on_exit, p._auto_cleanup = opts.onOutput, opts.onExit, opts.autoCleanup
  p._encoding = opts._encoding == "base64" and "base64" or nil
  p._timers, p._pipes = {}, {}
  p._oom_before = limits.oom_kills(sb.limits_state)
  sb.processes[id] = p
  -- proc mode finds what left the tree by this (tree.proc_tree)
  sb.process_spawns = (sb.process_spawns or 0) + 1
  p._marker = tree.owner(sb.id, self.id) .. "/p" .. sb.process_spawns

  local full_env = util.copy(self:current_env())
  for k, v in pairs(env or {}) do if v == false then full_env[k] = nil else full_env[k] = v end end
  full_env.MOONBOX_OWNER = p._marker
  local args = type(command) == "table" and command or { "bash", "-c", command }
  for i, a in ipairs(args) do args[i] = tostring(a) end
  if tree.mode() == "cgroup" then
    p._cgroup = cgroup.create(sb.cgroup_name .. "/p-" .. id)
  end
  local proc, pipes, code = core.spawn(sb:spawn_spec {
    args = args,
    file = type(command) ~= "table" and "/bin/bash" or nil,
    env = full_env,
    cwd = cwd,
    stdio = { [0] = opts.stdin and "pipe" or "null", [1] = "pipe", [2] = "pipe" },
    setsid = true,
    pdeathsig = "SIGKILL",
    cgroup = p._cgroup,
    on_exit = function(exit_code, signal) p:_exited(exit_code, signal) end,
  })
  if not proc then return spawn_failed(p, pipes, code) end
  attach(p, proc, pipes, opts)
  if opts.onStart then
    async.user_callback("onStart", opts.onStart, p)
  end
  return p
end

-- ---- completed records: bounded, and removable ---------------------------
--
-- A sandbox keeps the record (status, exit code, logs) of a process that
-- ended until cleanupCompletedProcesses() or autoCleanup removes it, but no
-- more than limits.maxCompletedProcesses of them, holding no more than
-- limits.maxCompletedLogBytes of logs in all: past either bound the oldest
-- completed records are dropped first. A record whose tree still lives
-- (descendants that outlived the process) is kept: it is how they are
-- found and killed.

local function sandbox_records(sb)
  sb.completed_records = sb.completed_records or {}
  return sb.completed_records
end

local function log_bytes(p)
  return p._logs.stdout.size + p._logs.stderr.size
end

-- Remove the records that are done (ended, and nothing of their tree
-- lives), oldest first, while pick(count, bytes) (of the records left)
-- says so; returns how many.
local function remove_done(sb, pick, scan)
  -- one /proc pass for every proc-mode record checked, taken first: the
  -- rest runs without waiting, so records completing meanwhile are kept
  if not scan then
    for _, p in ipairs(sandbox_records(sb)) do
      if sb.processes[p.id] == p and needs_scan(p) then scan = tree.proc_table() break end
    end
  end
  local list = sandbox_records(sb)
  local kept, removed, bytes, count = {}, 0, 0, 0
  for _, p in ipairs(list) do
    if sb.processes[p.id] == p then
      count = count + 1
      bytes = bytes + log_bytes(p)
    end
  end
  for _, p in ipairs(list) do
    if sb.processes[p.id] == p then
      local drop = false
      if pick(count, bytes) then drop = not p:_alive(scan) end
      if drop then
        sb.processes[p.id] = nil
        removed, count, bytes = removed + 1, count - 1, bytes - log_bytes(p)
        p:_close_pipes()
        p:_release_logs()
      else
        kept[#kept + 1] = p
      end
    end
  end
  sb.completed_records = kept
  return removed
end

-- Whether the completed records of sb are over their bounds (then a pick
-- for remove_done), with p (just completed) counted in.
local function over_bounds(sb, p)
  local list = sandbox_records(sb)
  local extra = (sb.processes[p.id] == p and list[#list] ~= p) and 1 or 0
  local limits_ = sb.policy.limits
  local max_count, max_bytes = limits_.maxCompletedProcesses, limits_.maxCompletedLogBytes
  local function pick(count, bytes) return count > max_count or bytes > max_bytes end
  if #list + extra > max_count then return pick end
  local bytes = extra == 1 and log_bytes(p) or 0
  for _, q in ipairs(list) do bytes = bytes + log_bytes(q) if bytes > max_bytes then return pick end end
  if bytes > max_bytes then return pick end
  return nil
end

-- Whether completing p makes remove_done look at a proc-mode record
-- (a /proc pass): the exit path takes one before it tells anyone.
function M.completion_needs_scan(p)
  local sb = p._sandbox
  if sb.processes[p.id] ~= p or not over_bounds(sb, p) then return false end
  if needs_scan(p) then return true end
  for _, q in ipairs(sandbox_records(sb)) do
    if sb.processes[q.id] == q and needs_scan(q) then return true end
  end
  return false
end

-- Called when a record completes: remember it, and enforce the bounds.
-- scan: a tree.proc_table() to reuse (the exit path's; without one,
-- remove_done takes a pass if it needs one; false: the pass failed, the
-- bounds wait for the next completion).
function M.completed(p, scan)
  local sb = p._sandbox
  if sb.processes[p.id] ~= p then return end -- autoCleanup took it
  local pick = over_bounds(sb, p)
  local list = sandbox_records(sb)
  list[#list + 1] = p
  if pick and scan ~= false then remove_done(sb, pick, scan or nil) end
end

-- cleanupCompletedProcesses() -> number of records removed: every process
-- that ended (completed, failed, killed, error) and left nothing running.
function Session:cleanupCompletedProcesses()
  self:check_live()
  return remove_done(self.sandbox, function() return true end)
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
  self:check_live()
  local list = {}
  for _, p in pairs(self.sandbox.processes) do list[#list + 1] = p end
  table.sort(list, function(a, b) return a.startTime < b.startTime or (a.startTime == b.startTime and a.id < b.id) end)
  return list
end

function Session:getProcess(id)
  self:check_live()
  V.type(id, "string", "processId")
  return self.sandbox.processes[id]
end

function Session:killProcess(id, signal)
  self:check_live()
  return find(self.sandbox, id):kill(signal)
end

function Session:killAllProcesses(signal)
  self:check_live()
  check_signal(signal) -- (also when nothing runs to send it to)
  -- a process whose own pid ended counts while its tree lives (known to:
  -- one only maybe its own is signalled, not counted: under load a process
  -- another record just started looked like an ended one's, counted twice)
  local n, scan, signalled = 0, proc_pass(self.sandbox), {}
  for _, p in pairs(self.sandbox.processes) do
    local alive, known = p:_alive(scan)
    if alive then
      p:_kill(signal, scan)
      if known then n = n + 1 end
      signalled[#signalled + 1] = p
    end
  end
  if signal == nil then M.await_ended(signalled, self.sandbox) end
  return n
end

function Session:getProcessLogs(id)
  self:check_live()
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
  self:check_live()
  local p = find(self.sandbox, id)
  local events, head, tail, waiter = {}, 1, 0, nil
  local limit = self.sandbox.policy.limits.maxLogBytes
  local queued, dropped = 0, false
  -- queued bytes also count against the runtime-wide budget until read
  -- (guarded: an iterator dropped unread gives them back when collected)
  local hold = output_budget.hold(self.sandbox.policy.limits.maxBufferedBytes, true)
  local function push(ev)
    tail = tail + 1
    events[tail] = ev
    if waiter then local w = waiter waiter = nil w() end
  end
  -- queue(kind, data): a chunk for the reader, unless it would pass the
  -- reader's bound or the budget (then dropped, and the exit event says truncated)
  local function queue(kind, data)
    if queued + #data > 2 * limit then
      dropped = true -- a reader that stopped reading cannot grow memory without bound
      return
    end
    local granted = hold:take(#data)
    if granted < #data then
      hold:give(granted)
      dropped = true
      return
    end
    queued = queued + #data
    push { type = kind, data = data, processId = id, timestamp = util.timestamp(), _size = #data }
  end
  for _, stream in ipairs { "stdout", "stderr" } do
    local text = p._logs[stream]:text()
    if #text > 0 then queue(stream, text) end
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
    else
      queue(kind, data)
    end
  end
  if p:is_running() then
    table.insert(p._listeners, listener)
  else
    push { type = "exit", exitCode = p.exitCode, processId = id, timestamp = util.timestamp(), truncated = dropped }
    push(false)
  end
  -- close(): stop following; a loop waiting for the next event ends (nil)
  local function close()
    if closed then return end
    closed = true
    detach()
    events, head, tail = {}, 1, 0
    hold:release()
    push(false)
  end
  local ended = false
  return setmetatable({ close = close, cancel = close }, {
    __call = function()
      if ended then return nil end -- (called again after the end: nil again, never a wait)
      while head > tail do
        async.await(function(resume)
          waiter = resume
          return function() waiter = nil end
        end, "streamProcessLogs iteration")
      end
      local ev = events[head]
      events[head] = nil
      head = head + 1
      if not ev then
        ended = true
        hold:release()
        return nil
      end
      if ev._size then
        queued = queued - ev._size
        hold:give(ev._size)
        ev._size = nil
      end
      return ev
    end,
  })
end

-- Kill the processes a session started (deleteSession) or all of a
-- sandbox's (destroy), and wait until they are gone.
-- gone: the caller (Sandbox:destroy) already saw every process of the
-- sandbox dead (its cgroup empty, or its init and pid namespace reaped):
-- no signal and no scan, only the exit reports and the cgroups' removal.
function M.kill_all(sb, session_id, gone)
  local victims, scan = {}, (not gone) and proc_pass(sb, session_id) or nil
  for _, p in pairs(sb.processes) do
    local mine = session_id == nil or p.sessionId == session_id
    if mine and gone then
      if p:is_running() then p._signalled = true end
      if not p._cgroup then p._tree_gone = true end -- (an empty cgroup is found so and removed below)
      victims[#victims + 1] = p
    elseif mine and p:_alive(scan) then
      if p:is_running() then p._signalled = true end
      p:_signal_tree(core.signum("SIGKILL"), scan)
      victims[#victims + 1] = p
    elseif mine and not p:is_running() then
      p:_close_timers() -- a grace or timeout kept for leftovers that are gone now
    end
  end
  for _, p in ipairs(victims) do
    if p:is_running() then p:waitForExit(5000) end
    p:_wait_tree_gone()
    if p._cgroup and not p._cgroup_removed then
      cgroup.remove_when_empty(p._cgroup, async.sleep)
      p._cgroup_removed = true
    end
    if not p:is_running() then p:_close_timers() end
    p:_close_pipes()
  end
  if session_id == nil then
    -- destroy: no record outlives it, nor its hold on the budget
    for _, p in pairs(sb.processes) do p:_release_logs() end
  end
  return #victims
end

-- A part of Session (lib/compose.lua): the process calls; a session's (or,
-- at destroy, every session's) processes end, as "killed", before its shell.
-- Destroy kills the whole sandbox at once: a process's exit can be read
-- before kill_all runs, so what runs now is marked killed first.
function M.mark_killed(sb)
  for _, p in pairs(sb.processes) do
    if p:is_running() then p._signalled = true end
  end
end

function M.install(class, hooks)
  compose.methods(class, Session, "process")
  compose.add(hooks, "sandbox_killing", M.mark_killed)
  compose.add(hooks, "session_ending", M.kill_all)
end

require("moonbox.lib.arity").guard(Process, "Process")

return M
