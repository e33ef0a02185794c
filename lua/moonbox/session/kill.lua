-- Killing a session's running command (issue #33 point 4: out of
-- Session:_run): where its processes are (a cgroup of its own, or in proc
-- mode the shell's descendants and the session's marked orphans), the
-- timeout state machine (interrupt and TERM, the grace, KILL) and the job
-- notes bash prints for what was killed. docs/sessions.md, "Killing trees"
-- and "After a timeout".
local core = require "moonbox.core"
local async = require "moonbox.async"
local errors = require "moonbox.errors"
local registry = require "moonbox.sandbox.registry"
local tree = require "moonbox.process.tree"
local cgroup = require "moonbox.process.cgroup"
local util = require "moonbox.lib.util"

local M = {}

local function after(ms, fn)
  local t = core.timer()
  t:start(ms, 0, function() t:close() fn() end)
  return t
end

function M.new_cmd_cgroup(session)
  session.cmd_seq = session.cmd_seq + 1
  session.cmd_cgroup = errors.check("ISOLATION_UNAVAILABLE",
    cgroup.create(session.cgroup:sub(#cgroup.base() + 2) .. "/cmd" .. session.cmd_seq))
  return session.cmd_cgroup
end

-- The cgroup a command that may be killed runs in, with the shell in it:
-- every process the command starts is born there. The shell stays there
-- after the command (moving it costs a migration, milliseconds after a
-- quiet spell), so the next such command reuses it unless something else
-- lives on in it (background jobs): then the shell moves to a new one.
function M.cmd_cgroup(session, sh)
  if not session.cgroup then return nil end
  local cg = session.cmd_cgroup
  if cg and sh:in_cgroup(cg) then
    local alone = true
    for _, pid in ipairs(cgroup.cgroup_pids(cg)) do
      if pid ~= sh.pid then alone = false break end
    end
    if alone then return cg end
  end
  cg = M.new_cmd_cgroup(session)
  sh:move_to(cg)
  return cg
end

-- proc mode: orphans the runtime adopted that came from this session;
-- scan: a tree.scan() to use.
local function marked_orphans(session, scan)
  local mine = {}
  for _, pid in ipairs(tree.pids_with_env("MOONBOX_OWNER", tree.owner(session.sandbox.id, session.id), false, scan)) do
    mine[pid] = true
  end
  local out = {}
  for _, pid in ipairs(tree.adopted(registry.known_pids(), scan)) do
    if mine[pid] then out[#out + 1] = pid end
  end
  return out
end

-- proc mode: the processes of the running command, found as the shell's
-- descendants and the session's marked orphans, less those that were there
-- before it started (background jobs of earlier commands); scan: a
-- tree.scan() to use (else one is awaited).
function M.proc_command_pids(session, sh, scan)
  scan = scan or tree.scan()
  local before = session.pids_before_cmd or {}
  local pids = {}
  for _, pid in ipairs(tree.descendants(sh.pid, scan)) do
    if not before[pid] then pids[#pids + 1] = pid end
  end
  for _, pid in ipairs(marked_orphans(session, scan)) do
    if not before[pid] then pids[#pids + 1] = pid end
  end
  return pids
end

-- Signal every process of the running command, but not the shell itself;
-- `seen` (optional) skips pids signalled by an earlier pass. The shell stays
-- in the command's cgroup until it reports, so a command it forks late (the
-- timeout fired first) is still born there and caught by the next pass.
-- Called from timers: in proc mode the /proc pass runs on the thread pool
-- and the signal follows when it is done, if the command is still the one
-- it was for (pids_before_cmd is made anew for every command).
function M.signal_command(session, sig, seen)
  if session.cmd_cgroup then
    local pids = {}
    for _, pid in ipairs(cgroup.cgroup_pids(session.cmd_cgroup)) do
      if pid ~= session.shell.pid and not (seen and seen[pid]) then
        pids[#pids + 1] = pid
        if seen then seen[pid] = true end
      end
    end
    tree.signal_pids(pids, sig)
  else
    local sh, cmd = session.shell, session.pids_before_cmd
    tree.scan_then(function(scan)
      if not scan or session.shell ~= sh or sh.dead or session.pids_before_cmd ~= cmd then return end
      local pids = {}
      for _, pid in ipairs(M.proc_command_pids(session, sh, scan)) do
        if not (seen and seen[pid]) then
          pids[#pids + 1] = pid
          if seen then seen[pid] = true end
        end
      end
      tree.signal_pids(pids, sig)
    end)
  end
end

-- After a timeout: wait out the grace for processes still handling SIGTERM,
-- then SIGKILL whatever is left and wait until it is gone.
function M.finish(session, sh, deadline)
  local cg = session.cmd_cgroup
  if cg then
    while cgroup.populated(cg) and util.now_ms() < deadline do async.sleep(10) end
    cgroup.kill_cgroup(cg)
    cgroup.remove_when_empty(cg, async.sleep)
    session.cmd_cgroup = nil
  elseif sh:alive() then
    local function leftovers() return M.proc_command_pids(session, sh) end
    while #leftovers() > 0 and util.now_ms() < deadline do async.sleep(10) end
    for _ = 1, 50 do
      local pids = leftovers()
      if #pids == 0 then break end
      tree.signal_pids(pids, "SIGKILL")
      async.sleep(10)
    end
  end
end

-- Kill the session's shell and everything it started (its cgroup, or its
-- descendants and marked orphans); the next command starts a fresh shell.
-- (Called from a cancelled task, which cannot wait: in proc mode the
-- shell's process group goes with one kill(2), the live shell pinning its
-- id; its jobs stay in it (no job control), and what left it carries the
-- session's marker for the kill_marked that follows.)
function M.shell(session, sh)
  if session.cgroup then cgroup.kill_cgroup(session.cgroup)
  elseif sh:alive() then core.kill(-sh.pid, "SIGKILL") end
  sh:kill("SIGKILL")
end

-- The timeout state machine of one command: watch(session, sh, timeout_ms
-- or nil) -> w. w:expire() (the timeout's timer, a cancel) interrupts the
-- shell and TERMs the command, again every 20 ms (what it starts late, and
-- a function of the body the shell is in); after the grace it KILLs what
-- is left, and after a second grace the shell itself if it still has not
-- reported (a builtin loop). w.timed_out, w.grace_deadline (set once
-- expired); w:close() stops the timers.
local Watch = {}
Watch.__index = Watch

function M.watch(session, sh, timeout)
  local w = setmetatable({ session = session, sh = sh, timers = {}, timed_out = false }, Watch)
  if timeout then w.timers[1] = after(timeout, function() w:expire() end) end
  return w
end

-- the watch of a command that nothing can time out or cancel (no timeout,
-- no control): shared, never expires
M.UNWATCHED = setmetatable({ timers = {}, timed_out = false }, Watch)

function Watch:expire()
  if self.timed_out or self == M.UNWATCHED then return end
  self.timed_out = true
  local session, sh, timers = self.session, self.sh, self.timers
  local grace = session.sandbox.policy.limits.timeoutGraceMs
  self.grace_deadline = util.now_ms() + grace
  if not sh:alive() then return end
  local termed = {}
  -- the shell first: its trap is pending before the command it waits
  -- for dies, so it returns from the body instead of going on with the
  -- next command (TERM first lost that race 30 times in 100 under load)
  sh:interrupt()
  M.signal_command(session, "SIGTERM", termed)
  -- processes started after this pass get their SIGTERM too, and the
  -- shell leaves a function of the body it was in
  local again = core.timer()
  timers[4] = again
  again:start(20, 20, function()
    if sh:alive() then sh:interrupt() M.signal_command(session, "SIGTERM", termed) end
  end)
  timers[2] = after(grace, function()
    again:stop()
    if not sh:alive() or not sh:busy() then return end
    M.signal_command(session, "SIGKILL")
    -- a shell busy in a builtin loop never reports: end it too
    timers[3] = after(grace, function()
      if sh:alive() and sh:busy() then sh:kill("SIGKILL") end
    end)
  end)
end

function Watch:close()
  for _, t in pairs(self.timers) do if not t:is_closing() then t:close() end end
end

-- After a timeout, bash reports the job it lost ("Terminated", "Killed");
-- that note is ours, not the command's. held_stderr(sink, w) -> on_chunk,
-- held: once w has timed out, stderr is held back (at most HELD_MAX bytes:
-- past that what is held is the command's, bash's note being one short
-- line at the end, and goes on); held:flush() passes it on without the
-- notes.
local HELD_MAX = 64 * 1024

-- held_stderr's h for a command that cannot time out: nothing is held
M.NOTHING_HELD = { flush = function() end }

function M.held_stderr(sink, w)
  local held, held_bytes = {}, 0
  local function on_chunk(stream, data)
    if w.timed_out and stream == "stderr" then
      held[#held + 1] = data
      held_bytes = held_bytes + #data
      if held_bytes > HELD_MAX then
        local text = table.concat(held)
        for i = #held, 1, -1 do held[i] = nil end
        held_bytes = 0
        sink(stream, text)
      end
      return
    end
    sink(stream, data)
  end
  local h = {}
  function h.flush()
    if #held == 0 then return end
    local text = table.concat(held):gsub("[^\n]*%d+ ?[%a ]*%f[%a](Terminated)[^\n]*\n", "")
      :gsub("[^\n]*%d+ ?[%a ]*%f[%a](Killed)[^\n]*\n", ""):gsub("^Terminated\n", ""):gsub("^Killed\n", "")
    if #text > 0 then sink("stderr", text) end
  end
  return on_chunk, h
end

return M
