-- ExecutionSession: a persistent shell (see session/shell.lua) with its own env and
-- cwd, a FIFO of calls, timeouts that kill the command's whole tree, and a
-- fresh shell restored to the last known cwd and exported env whenever the
-- old one died. Docs: docs/sessions.md.
local core = require "moonbox.core"
local async = require "moonbox.async"
local errors = require "moonbox.errors"
local shell_mod = require "moonbox.session.shell"
local simple_command = require "moonbox.session.simple_command"
local tree = require "moonbox.process.tree"
local cgroup = require "moonbox.process.cgroup"
local queue_mod = require "moonbox.session.queue"
local util = require "moonbox.lib.util"
local budget = require "moonbox.session.budget"
local kill = require "moonbox.session.kill"
local stream_events = require "moonbox.session.stream"
local limits = require "moonbox.sandbox.limits"
local V = require "moonbox.lib.validate"
local policy_mod = require "moonbox.policy"
local compose = require "moonbox.lib.compose"
local seed_options = require "moonbox.lib.seed_options"

local M = {}

local Session = {}
Session.__index = Session
M.Session = Session

-- new(sandbox, id, {env, cwd (host path), commandTimeoutMs}) -> session.
-- The shell starts at once, so a bad setup fails here, not on first use.
function M.new(sandbox, id, opts)
  local self = setmetatable({
    id = id,
    sandbox = sandbox,
    env = opts.env,            -- the exported env the next shell starts with
    cwd = opts.cwd,            -- host path of the last known cwd
    commandTimeoutMs = opts.commandTimeoutMs,
    queue = queue_mod.new(),
    destroyed = false,
    cmd_seq = 0,
  }, Session)
  -- spares serve createSession: a sandbox driven through its default
  -- session alone never starts one (it would compete with the first
  -- command), but adopts the shell a pre-built sandbox came with
  local spare = async.in_task() and (id ~= "default" or sandbox.spare) and sandbox:take_spare(id == "default")
  local function own_cgroup()
    if tree.mode() == "cgroup" then
      self.cgroup = errors.check("ISOLATION_UNAVAILABLE",
        cgroup.create(sandbox.cgroup_name .. "/s-" .. (id:gsub("[^%w_-]", "_"))))
    end
  end
  -- an adopted spare brings the cgroups it was born in: no migration
  local borrowed = spare and spare.session_cgroup
  if borrowed then self.cgroup, self.cmd_cgroup = borrowed, spare.cgroup else own_cgroup() end
  if not (spare and self:_adopt(spare)) then
    if borrowed then self.cmd_cgroup = nil own_cgroup() end
    self:_start_shell()
  end
  return self
end

-- What the runtime has the shell run for a call's cwd and env, and to set
-- up an adopted shell: bash's own cd, export, unset and exit, never a
-- function or alias of the session's of those names (rvm and nvm define a
-- `cd`: its output landed in the command's, or the cwd was not changed).
-- (`\builtin`: no alias expands a quoted word. The cwd is absolute by
-- then, so CDPATH is not searched.)
local CD, EXIT = "\\builtin cd -- ", " || \\builtin exit 1"
local UNSET, EXPORT = "\\builtin unset -v ", "\\builtin export %s=%s"

-- Take over a sandbox's warm spare shell (started ahead, so a new session
-- costs one command instead of a bash start-up): move it into our cgroup,
-- then set our cwd and env in it. false if it could not be set up.
function Session:_adopt(sh)
  if self.cgroup and not sh:in_cgroup(self.cgroup) and not sh:in_cgroup(self.cmd_cgroup) then
    sh:move_to(self.cgroup)
  end
  local want = util.copy(self.env)
  want.MOONBOX_OWNER = tree.owner(self.sandbox.id, self.id)
  local lines = { CD .. util.shell_quote(self.cwd) .. EXIT }
  for _, k in ipairs(sh:spawn_env_names()) do
    if want[k] == nil then lines[#lines + 1] = UNSET .. k end
  end
  for k, v in pairs(want) do
    if sh:spawn_env_of(k) ~= v then lines[#lines + 1] = EXPORT:format(k, util.shell_quote(v)) end
  end
  local record = sh:run { body = table.concat(lines, "\n") .. "\n", on_chunk = function() end }
  if record.died or record.exiting or record.status ~= 0 then
    sh:kill("SIGKILL")
    return false
  end
  self.shell, self.cwd, self.exports_text = sh, record.pwd, record.exports
  return true
end

function Session:_start_shell()
  local env = self:current_env()
  -- proc mode: processes that leave the tree stay attributable (process/tree.lua)
  env.MOONBOX_OWNER = tree.owner(self.sandbox.id, self.id)
  local sh, err, code = self.sandbox:spawn_shell {
    env = env,
    cwd = self.sandbox:dir_exists(self.cwd) and self.cwd or self.sandbox.home,
    -- born where its commands run (kill.cmd_cgroup): no migration for the first
    cgroup = self.cgroup and kill.new_cmd_cgroup(self),
    shell = self.sandbox.policy.shell,
  }
  if not sh then
    local image = self.sandbox.image
    if image and code == "ENOENT" then -- (the shell comes from the image: docs/images.md)
      errors.raise("SHELL_START_FAILED", ("cannot start the session shell: image %s has no %s (a session needs bash "
        .. "from the image): %s"):format(image.name, self.sandbox.policy.shell or "/bin/bash", tostring(err)),
        { sessionId = self.id, errno = code, image = image.name })
    end
    errors.raise("SHELL_START_FAILED", "cannot start the session shell: " .. tostring(err),
      { sessionId = self.id, errno = code })
  end
  self.shell = sh
end

function Session:check_live()
  if self.destroyed then
    errors.raise("SESSION_NOT_FOUND", ("session %q does not exist (deleted)"):format(self.id),
      { sessionId = self.id })
  end
  if self.sandbox.init_dead then self.sandbox:revive_init() end
end

-- A call whose sandbox was destroyed, or whose session was deleted, while
-- it ran says so (SANDBOX_DESTROYED, SESSION_DESTROYED), whatever its own
-- end looked like from here; what: "the command", "runCode", ...
function Session:check_ended(what)
  local sb = self.sandbox
  if sb.destroyed then
    errors.raise("SANDBOX_DESTROYED", ("sandbox %q was destroyed while %s ran"):format(sb.id, what),
      { id = sb.id, sessionId = self.id })
  end
  if self.destroyed then
    errors.raise("SESSION_DESTROYED", ("session %q was deleted while %s ran"):format(self.id, what),
      { sessionId = self.id })
  end
end

-- Last known exported env as a map (parsed lazily from `export -p`).
function Session:current_env()
  if self.exports_text then
    self.env = shell_mod.parse_exports(self.exports_text)
    self.exports_text = nil
  end
  return self.env
end

-- ---- exec ---------------------------------------------------------------

local exec_options = { timeout = true, env = true, cwd = true, stdin = true, onOutput = true,
  maxOutputBytes = true }

local function env_prelude(env)
  local lines = {}
  for k, v in pairs(env) do
    if v == false then lines[#lines + 1] = UNSET .. k
    else lines[#lines + 1] = EXPORT:format(k, util.shell_quote(v)) end
  end
  table.sort(lines)
  return table.concat(lines, "\n")
end

-- What the shell is sent for a command (Shell:start's request).
local function request(command, opts, on_chunk)
  local req = { on_chunk = on_chunk }
  if type(command) == "table" then
    local words = {}
    for i, w in ipairs(command) do words[i] = util.shell_quote(w) end
    -- argv runs in a subshell with exec: no word splitting, no expansion
    req.body = "exec -- " .. table.concat(words, " ")
    req.prelude = ":"
  else
    req.body = command
    req.words = simple_command.words(command)
  end
  if opts.stdin ~= nil then req.stdin = opts.stdin end
  if opts.env or opts.cwd then
    local parts = {}
    if opts.cwd then parts[#parts + 1] = CD .. util.shell_quote(opts.cwd) .. EXIT end
    if opts.env then parts[#parts + 1] = env_prelude(opts.env) end
    req.prelude = table.concat(parts, "\n") .. "\n"
  end
  return req
end

-- The shell a command runs in: a new one when the last exited (or said
-- it would). A call that waited in the queue while its sandbox was being
-- destroyed never starts (nor a new shell for it: destroy is killing
-- everything).
function Session:_ready_shell()
  local sb = self.sandbox
  if sb.destroyed then
    errors.raise("SANDBOX_DESTROYED", ("sandbox %q was destroyed"):format(sb.id), { id = sb.id, sessionId = self.id })
  end
  if self.destroyed then
    errors.raise("SESSION_DESTROYED", ("session %q was deleted"):format(self.id), { sessionId = self.id })
  end
  if not self.shell or not self.shell:usable() then
    if self.shell then self.shell:wait_exit(2000) end -- it reported its own exit
    self:_start_shell()
  end
  return self.shell
end

-- Only a command that can be killed (timeout, cancel) needs a cgroup of
-- its own (kill.cmd_cgroup); deleteSession kills the session's whole
-- cgroup. In proc mode what lives already is not this command's to kill.
function Session:_killable(sh)
  local cmd_cg = kill.cmd_cgroup(self, sh)
  self.pids_before_cmd = nil
  if not cmd_cg then
    local before = {}
    for _, pid in ipairs(kill.proc_command_pids(self, sh)) do before[pid] = true end
    self.pids_before_cmd = before
  end
  return cmd_cg
end

-- The caller's task was cancelled (moonbox.timeout, task:cancel) while the
-- command ran: the command is killed, and a task of our own waits for its
-- record holding the queue, so the next command finds the shell back at
-- its prompt.
function Session:_abandon(sh, job, w, held, cmd_cg, killable)
  if killable then
    -- set up to be killed: as a timeout, the shell keeps its state
    w:expire()
  else
    -- nothing tells this command's processes from earlier background
    -- jobs without a per-command cost: the shell and all it runs go,
    -- and the next command gets a fresh shell (last cwd, exported env)
    kill.shell(self, sh)
  end
  self.queue:hand_off()
  async.spawn(function()
    pcall(function()
      self:_finish_run(sh, job:wait(), w, held, cmd_cg)
      if not killable and self.cgroup then
        -- the killed tree is gone (not just dying) before the next command
        -- runs: the queue is ours until then, so nothing new is in the cgroup
        cgroup.wait_empty(self.cgroup, 2000, async.sleep)
      elseif not killable then
        -- proc mode: also what left the shell's tree (it carries our
        -- marker), before a new shell (which carries it too) starts
        tree.kill_marked("MOONBOX_OWNER", tree.owner(self.sandbox.id, self.id), async.sleep)
      end
    end)
    self.queue:release()
  end)
end

-- Runs one command holding the queue. Returns the ExecResult table.
function Session:_run(command, opts, sink)
  local sb = self.sandbox
  local started, timestamp = util.now_ms(), util.timestamp()
  local generation = sb.init_generation -- moves on when the sandbox's init dies
  local sh = self:_ready_shell()
  local timeout = opts.timeout or self.commandTimeoutMs or sb.policy.limits.commandTimeoutMs
  if timeout == 0 then timeout = nil end
  local control = opts.control -- execStream's: cancel() kills this command as a timeout would
  if control and control.cancelled then
    errors.raise("CANCELLED", "the command was cancelled before it started", { sessionId = self.id })
  end
  local killable = (timeout or control) and true or false
  local cmd_cg = killable and self:_killable(sh)
  if not killable then self.pids_before_cmd = nil end
  local w, on_chunk, held
  if killable then
    w = kill.watch(self, sh, timeout)
    on_chunk, held = kill.held_stderr(sink, w)
  else
    -- nothing can time this command out or cancel it: no timer, and no
    -- note of bash's about a killed job to hold back
    w, on_chunk, held = kill.UNWATCHED, sink, kill.NOTHING_HELD
  end
  local cancelled = false
  if control then
    control.abort = function()
      cancelled = not w.timed_out
      w:expire()
    end
  end
  local oom_before = limits.oom_kills(sb.limits_state)
  local job = sh:start(request(command, opts, on_chunk))
  local waited, record = pcall(job.wait, job)
  if control then control.abort = nil end
  if not waited then
    self:_abandon(sh, job, w, held, cmd_cg, killable)
    error(record, 0)
  end
  return self:_finish_run(sh, record, w, held, cmd_cg, {
    started = started, timestamp = timestamp, cancelled = cancelled, oom_before = oom_before,
    generation = generation })
end

-- The rest of a command once its record came: what is left of a timed-out
-- command is killed, the shell's cwd and exports are kept. info is nil
-- when nobody waits for the result (a cancelled call).
function Session:_finish_run(sh, record, w, held, cmd_cg, info)
  w:close()
  local timed_out = w.timed_out

  if cmd_cg and timed_out and sh:alive() then
    -- the shell leaves, what is left of the command is killed with the cgroup
    sh:move_to(self.cgroup)
  end
  held.flush()
  if timed_out then
    -- What survived SIGTERM gets the rest of the grace, then SIGKILL; the
    -- call returns only when no process of the command is left.
    kill.finish(self, sh, w.grace_deadline)
  end

  local sb = self.sandbox
  -- (first: a destroy also ends every session, and its init died because
  -- destroy killed it: no rebuild follows)
  self:check_ended("the command")
  if info and sb.init and (sb.init_generation ~= info.generation or (record.died and not sb:init_alive())) then
    -- the sandbox's init died under the command (and every process with
    -- it): said once, to the calls that were running; the next call
    -- rebuilds the sandbox (Sandbox:revive_init)
    errors.raise("SANDBOX_RESTARTED", ("sandbox %q lost its init process while the command ran; it is rebuilt " ..
      "over the same workspace on the next call"):format(sb.id), { id = sb.id, sessionId = self.id })
  end
  if record.pwd then
    self.cwd = record.pwd
    self.exports_text = record.exports
  end
  local exit_code = record.status
  if record.exiting and not self.destroyed then
    -- the EXIT trap ran; a shell killed by a signal (kill $$) reports 128+N
    sh:wait_exit(2000)
    exit_code = sh:exit_status(exit_code)
  end
  if not info then return end
  local cancelled = info.cancelled
  if timed_out and not cancelled then exit_code = 124 end
  return {
    oomKilled = exit_code == 137 and limits.oom_kills(self.sandbox.limits_state) > info.oom_before or nil,
    exitCode = exit_code,
    timedOut = timed_out and not cancelled,
    cancelled = cancelled or nil,
    duration = util.now_ms() - info.started,
    timestamp = info.timestamp,
  }
end

-- Collects output into a bounded result; every kept byte also goes to
-- onOutput, in order. Kept bytes live in C buffers (core.bytes: outside the
-- Lua heap, one growable block per stream; the chunks read are garbage at
-- once) and count against the runtime-wide budget (lua/moonbox/session/budget.lua,
-- limits.maxBufferedBytes) until c:text() hands them over or c:release().
-- A stream the budget cut keeps its prefix: nothing after the cut is kept.
-- extra_hold: a second holder the kept bytes must also fit (the HTTP
-- server's send budget, for /exec: what it keeps must be sendable), or
-- nil; its owner releases it.
-- (One table and one closure per call, c.sink: the exec path's garbage is
-- the runtime's collector's work, issue #32.)
local Collector = {}
Collector.__index = Collector
local BUF = { stdout = "stdout_buf", stderr = "stderr_buf" }
local SIZE = { stdout = "stdout_size", stderr = "stderr_size" }
local CUT = { stdout = "stdout_cut", stderr = "stderr_cut" }

local function collector(limit, on_output, budget_ceiling, extra_hold)
  local c = setmetatable({ limit = limit, on_output = on_output, extra_hold = extra_hold, truncated = false,
    stdout_size = 0, stderr_size = 0, hold = budget.hold(budget_ceiling) }, Collector)
  c.sink = function(stream, data) return c:keep(stream, data) end
  return c
end

function Collector:release()
  local out, err = self.stdout_buf, self.stderr_buf
  if out then out:free() self.stdout_buf = nil end
  if err then err:free() self.stderr_buf = nil end
  self.hold:release()
end

-- the kept bytes of a stream as one string, made once; its buffer is freed
function Collector:text(stream)
  local key = BUF[stream]
  local b = self[key]
  if not b then return "" end
  local s = b:tostring()
  b:free()
  self[key] = nil
  return s
end

-- the kept bytes of a stream as its buffer, handed over (the taker frees it)
function Collector:take(stream)
  local key = BUF[stream]
  local b = self[key] or core.bytes()
  self[key] = nil
  return b
end

function Collector:keep(stream, data)
  local size_key = SIZE[stream]
  local room = self[CUT[stream]] and 0 or math.min(self.limit - self[size_key], #data)
  if room > 0 then room = self.hold:take(room) end
  local extra_hold = self.extra_hold
  if room > 0 and extra_hold then
    local fits = extra_hold:take(room)
    if fits < room then self.hold:give(room - fits) end
    room = fits
  end
  if room < #data then
    self.truncated = true
    self[CUT[stream]] = true
    data = room > 0 and data:sub(1, room) or nil
  end
  if data then
    local key = BUF[stream]
    local b = self[key]
    if not b then b = core.bytes() self[key] = b end
    b:append(data)
    self[size_key] = self[size_key] + #data
    if self.on_output then async.user_callback("onOutput", self.on_output, stream, data) end
  end
end

local NO_OPTIONS = setmetatable({}, { __newindex = function() error("NO_OPTIONS is read-only", 2) end })

function Session:_prepare(command, opts, what)
  self:check_live()
  V.command(command)
  if opts == nil then
    opts = NO_OPTIONS -- (read only below: no table per call)
  else
    opts = seed_options.adapt(opts, seed_options.exec, what)
    opts = V.options(opts, exec_options, what .. " options")
  end
  V.timeout(opts.timeout, "timeout")
  V.type(opts.onOutput, "function", "onOutput", true)
  V.type(opts.stdin, "string", "stdin", true)
  V.type(opts.maxOutputBytes, "number", "maxOutputBytes", true)
  local max_out = opts.maxOutputBytes
  if max_out and (max_out < 0 or max_out ~= max_out) then V.fail("maxOutputBytes", "expected a number >= 0") end
  local env = V.env(opts.env, "env")
  local cwd
  if opts.cwd ~= nil then
    V.path(opts.cwd, "cwd")
    cwd = self.sandbox:host_path(opts.cwd, self.cwd)
    if not self.sandbox:dir_exists(cwd) then V.fail("cwd", ("directory %q does not exist"):format(opts.cwd)) end
  end
  local policy = self.sandbox.policy
  local hook = policy.hooks and policy.hooks.onExec
  -- (no options and no hook to change them: the shared empty table)
  if opts == NO_OPTIONS and not hook then return command, NO_OPTIONS end
  local o = { timeout = opts.timeout, env = env, cwd = cwd, stdin = opts.stdin,
    onOutput = opts.onOutput, maxOutputBytes = opts.maxOutputBytes }
  if hook then
    local changed = policy_mod.call_hook(policy, "onExec", "exec", { command = command }, self, command, o)
    if changed ~= nil then command = changed end
  end
  return command, o
end

-- Runs command as exec does; output(collector, stream) turns each stream's
-- kept bytes into the result's field; extra_hold as for collector.
local function run_collected(self, command, opts, output, extra_hold)
  async.check_task("exec") -- before anything is queued or sent
  local o
  command, o = self:_prepare(command, opts, "exec")
  local limit = o.maxOutputBytes or self.sandbox.policy.limits.maxOutputBytes
  local out = collector(limit, o.onOutput, self.sandbox.policy.limits.maxBufferedBytes, extra_hold)
  local ok, r = pcall(self.queue.run, self.queue, self._run, self, command, o, out.sink)
  if not ok then out:release() error(r, 0) end
  r.stdout = output(out, "stdout")
  r.stderr = output(out, "stderr")
  out:release() -- handed over: the budget has the bytes back
  r.success = r.exitCode == 0
  r.command = type(command) == "table" and util.shell_join(command) or command
  r.sessionId = self.id
  r.truncated = out.truncated
  r.oomKilled = r.oomKilled or false
  return r
end

local function output_text(out, stream) return out:text(stream) end
local function output_bytes(out, stream) return out:take(stream) end

-- exec(command, opts) -> ExecResult
function Session:exec(command, opts)
  return run_collected(self, command, opts, output_text)
end

-- exec_bytes(command, opts[, hold]) -> ExecResult whose stdout and stderr
-- are core.bytes buffers (the caller frees them), for the HTTP server: a
-- 16 MiB output made into one Lua string costs the loop ~90 ms of page
-- faults on a fresh allocation, which every other client waits for (issue
-- #29). hold (the server's send budget, send_budget.hold()): the output is
-- kept only while it also fits there, else truncated as past the runtime's
-- budget; the caller releases it.
function Session:exec_bytes(command, opts, hold)
  return run_collected(self, command, opts, output_bytes, hold)
end

-- execStream(command, opts) -> iterator of events (a callable table with
-- task and cancel()). Output is queued up to maxOutputBytes per stream;
-- beyond that chunks are dropped and the complete event says truncated =
-- true, so a slow or absent reader can never stall the session.
-- cancel() (a consumer that went away, e.g. an HTTP client) kills the
-- command's whole tree as a timeout does (complete has cancelled = true), or
-- takes it out of the session's queue if it has not started; iterating on
-- after it drains the events up to the end, by when nothing of it is left.
function Session:execStream(command, opts)
  local o
  command, o = self:_prepare(command, opts, "execStream")
  if o == NO_OPTIONS then o = {} end -- (control goes in it)
  local control = {}
  o.control = control
  local limits_ = self.sandbox.policy.limits
  local q = stream_events.events(o.maxOutputBytes or limits_.maxOutputBytes, limits_.maxBufferedBytes, o.onOutput)
  local task = async.spawn(function()
    local ok, r = pcall(self.queue.run, self.queue, function(...)
      control.started = true
      -- when it starts, not when it was asked for: a call queued behind
      -- another of the session's waits for it (and one that will not
      -- start, its session or sandbox gone meanwhile, has none)
      if not (self.destroyed or self.sandbox.destroyed) then
        q.push { type = "start", command = type(command) == "table" and util.shell_join(command) or command,
          timestamp = util.timestamp(), sessionId = self.id }
      end
      return self._run(...)
    end, self, command, o, q.sink)
    q.seal()
    control.finished = true
    if ok then
      q.push { type = "complete", exitCode = r.exitCode, timedOut = r.timedOut, truncated = q.truncated(),
        timestamp = util.timestamp(), sessionId = self.id, duration = r.duration, cancelled = r.cancelled }
    else
      q.push { type = "error", error = r, timestamp = util.timestamp() }
    end
    q.push(false)
  end)
  local function cancel()
    if control.finished or control.cancelled then return end
    control.cancelled = true
    if control.abort then control.abort()
    elseif not control.started then task:cancel() end -- still queued: it never runs
    -- (started but not yet running: _run sees control.cancelled and stops)
  end
  local ended = false
  local iter = setmetatable({ task = task, cancel = cancel }, {
    __call = function()
      if ended then return nil end -- (called again after the end: nil again, never a wait)
      local ok, ev = pcall(q.take, "execStream iteration")
      if not ok then
        -- the reading task was cancelled (moonbox.timeout, task:cancel):
        -- the command is ended as iterator.cancel() would end it
        cancel()
        error(ev, 0)
      end
      if not ev then ended = true end
      return ev
    end,
  })
  iter._hold = q.hold -- collected undrained: the queued bytes go back to the budget
  return iter
end

-- setEnvVars(map): export (or, for false, unset) in this session's shell.
function Session:setEnvVars(map)
  async.check_task("setEnvVars")
  self:check_live()
  local env = M.env_hook(self.sandbox, self, V.env(V.type(map, "table", "envVars"), "envVars"))
  -- (names this session set itself: a sandbox-level setEnvVars, which
  -- ranks below, leaves them as they are in the default session)
  self.own_env = self.own_env or {}
  for k in pairs(env) do self.own_env[k] = true end
  return self:apply_env(env)
end

-- The policy's onEnv hook: the map to apply, or POLICY_DENIED.
function M.env_hook(sandbox, caller, env)
  local changed = policy_mod.call_hook(sandbox.policy, "onEnv", "setEnvVars", nil, caller, env)
  if changed ~= nil then env = V.env(changed, "envVars") end
  return env
end

-- Export / unset an already validated (and hooked) map in the shell.
function Session:apply_env(env)
  self:check_live()
  if next(env) == nil then return { success = true, sessionId = self.id, timestamp = util.timestamp() } end
  local body = env_prelude(env)
  local r = self.queue:run(self._run, self, body, {}, function() end)
  if r.exitCode ~= 0 then
    errors.raise("FILESYSTEM_ERROR", "setEnvVars failed in the session shell", { exitCode = r.exitCode })
  end
  return { success = true, sessionId = self.id, timestamp = util.timestamp() }
end

-- Kill the shell and everything it started; wake every waiter. Waits until
-- no process of the session is left. gone: the caller (Sandbox:destroy)
-- already saw every process of the sandbox dead (its cgroup empty, or its
-- init, and so its pid namespace, reaped): nothing is left to kill or look
-- for, only the shell's exit report and the cgroup's removal.
function Session:tear_down(gone)
  if self.destroyed then return end
  self.destroyed = true
  compose.run(M.hooks, "session_end", self)
  local sh = self.shell
  if self.cgroup and not gone then
    cgroup.kill_cgroup(self.cgroup)
  elseif not gone then
    if sh and sh:alive() then
      -- the shell's process group first: its background jobs stay in it
      -- (no job control), and one kill(2) reaches a fork bomb's every member
      -- (the live shell pins the group id)
      core.kill(-sh.pid, "SIGKILL")
      tree.signal_pids(tree.descendants(sh.pid), "SIGKILL")
    end
    -- also what left the shell's tree (setsid, double fork): it carries our marker
    tree.kill_marked("MOONBOX_OWNER", tree.owner(self.sandbox.id, self.id), async.sleep)
  end
  if sh and sh:alive() then
    if not gone then sh:kill("SIGKILL") end
    sh:wait_exit()
  end
  if self.cgroup then cgroup.remove_when_empty(self.cgroup, async.sleep) end
  -- queued callers see the destroyed flag
  local waiters = self.queue.waiters
  self.queue.waiters = {}
  for _, w in ipairs(waiters) do w.resume() end
end

-- Session's parts (lib/compose.lua), installed here and nowhere else: each
-- adds its methods and registers its hooks, which Session:tear_down and the
-- sandbox (deleteSession, destroy) run.
M.hooks = compose.hooks()
for _, part in ipairs {
  require "moonbox.process",       -- startProcess, listProcesses, ...
  require "moonbox.files",         -- readFile, writeFile, listFiles, moveFile, ...
  require "moonbox.files.watch",   -- watch
  require "moonbox.files.git",     -- gitCheckout
  require "moonbox.files.changes", -- checkChanges (a kept watch)
  require "moonbox.code",          -- createCodeContext, runCode, ...
  require "moonbox.terminal",      -- terminal()
} do
  part.install(Session, M.hooks, M)
end

return M
