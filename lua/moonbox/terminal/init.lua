-- Terminal: an interactive shell on a pty, in the session's current cwd and
-- exported env, with TERM=xterm-256color. The shell gets its own session and
-- the pty as controlling terminal, so TIOCSTI on it reaches nothing else.
local core = require "moonbox.core"
local async = require "moonbox.async"
local errors = require "moonbox.errors"
local tree = require "moonbox.process.tree"
local cgroup = require "moonbox.process.cgroup"
local util = require "moonbox.lib.util"
local V = require "moonbox.lib.validate"
local compose = require "moonbox.lib.compose"
local Session = {} -- this part's methods, installed by session/init.lua (M.install)

local Terminal = {}
Terminal.__index = Terminal

local MAX_BUFFERED = 1024 * 1024 -- unread output kept for read(); the oldest is dropped
-- readline reads the window size and writes it back at every prompt
-- (rltty.c, set_winsize); a resize() landing between the two is undone.
-- For this long after a resize, output that finds the previous size back on
-- the pty puts the new one back (and the shell gets SIGWINCH again).
local RESIZE_GUARD_MS = 3000

local function check_size(cols, rows)
  for name, v in pairs { cols = cols, rows = rows } do
    if type(v) ~= "number" or v < 1 or v > 65535 or v % 1 ~= 0 then V.fail(name, "expected an integer 1-65535") end
  end
end

local terminal_options = { cols = true, rows = true, shell = true, env = true }

function Session:terminal(opts)
  self:check_live()
  opts = V.options(opts, terminal_options, "terminal options")
  -- the policy's say (a table replaces the options, checked the same way)
  local changed = require("moonbox.policy").call_hook(self.sandbox.policy, "onTerminal", "terminal", nil, self,
    util.copy(opts))
  if changed ~= nil then
    local took, err = pcall(V.options, changed, terminal_options, "onTerminal's options")
    if not took then
      errors.raise("POLICY_ERROR", "policy hook onTerminal returned options terminal cannot take: " ..
        tostring(err.message or err), { hook = "onTerminal" })
    end
    opts = changed
  end
  local cols, rows = opts.cols or 80, opts.rows or 24
  check_size(cols, rows)
  local shell = opts.shell or "bash"
  V.type(shell, "string", "shell")
  local env = util.copy(self:current_env())
  env.TERM = "xterm-256color"
  for k, v in pairs(V.env(opts.env, "env") or {}) do if v == false then env[k] = nil else env[k] = v end end
  local sb = self.sandbox
  -- under namespaces the pty comes from the sandbox's own devpts, so that
  -- tty(1) and ttyname() work inside
  local master, slave = core.openpty(cols, rows, sb.init and (sb.fs_root .. "/dev/ptmx") or nil)
  if not master then errors.raise("FILESYSTEM_ERROR", "cannot open a pty: " .. tostring(slave)) end
  -- devpts gives the pty to whoever opened ptmx (us): root inside reopens it
  -- by name (tty, ssh, script), so it is root inside's
  if sb.init and sb.idmap.count > 1 then
    -- (its owner: who the shell runs as, root inside or the image's User)
    local ok, msg = core.chown(slave, require("moonbox.sandbox.image").host_ids(sb.image, sb.idmap))
    if not ok then
      core.close_fd(master)
      core.close_fd(slave)
      errors.raise("FILESYSTEM_ERROR", "cannot give the pty to the sandbox's root: " .. tostring(msg))
    end
  end
  sb.terminal_seq = (sb.terminal_seq or 0) + 1
  local t = setmetatable({ cols = cols, rows = rows, chunks = {}, buffered = 0, listeners = {}, exited = false,
    sessionId = self.id, _sandbox = sb, _exit_waiters = {} }, Terminal)
  if tree.mode() == "cgroup" then t._cgroup = cgroup.create(sb.cgroup_name .. "/t-" .. sb.terminal_seq) end
  -- the user's host rc files are not the sandbox's business: a predictable shell
  local args = { shell, "-i" }
  if shell:match("bash$") then
    args = { shell, "--noprofile", "--norc", "-i" }
    env.PS1 = env.PS1 or "\\w\\$ "
  end
  local proc, err, code = core.spawn(sb:spawn_spec {
    args = args, env = env, cwd = self.cwd, setsid = true, ctty = 0, pdeathsig = "SIGKILL",
    cgroup = t._cgroup,
    stdio = { [0] = slave, [1] = slave, [2] = slave },
    on_exit = function(exit_code) t:_exited(exit_code) end,
  })
  core.close_fd(slave)
  if not proc then
    core.close_fd(master)
    if t._cgroup then cgroup.remove_cgroup(t._cgroup) end
    errors.raise("VALIDATION_FAILED", ("cannot start shell %q: %s"):format(shell, tostring(err)), { errno = code })
  end
  t.pid, t._proc = proc:pid(), proc
  t.sandboxPid = proc:sandbox_pid() -- (beyond) as a process's
  t._master_fd = master
  t._stream = core.stream_open(master, true)
  t._stream:read_start(function(_, data)
    if data then t:_data(data) else t:_eof() end
  end)
  sb.terminals = sb.terminals or {}
  sb.terminals[t] = true
  return t
end

local function now_ms() return core.hrtime() / 1e6 end

-- A stale write-back of the size before the last resize() is undone.
function Terminal:_keep_size()
  local guard = self._resize_guard
  if now_ms() > guard.until_ms or self.closed then self._resize_guard = nil return end
  local cols, rows = core.pty_size(self._master_fd)
  if cols == guard.cols and rows == guard.rows then core.pty_resize(self._master_fd, self.cols, self.rows) end
end

function Terminal:_data(data)
  if self._resize_guard then self:_keep_size() end
  for _, fn in ipairs(self.listeners) do async.user_callback("onData", fn, data) end
  self.chunks[#self.chunks + 1] = data
  self.buffered = self.buffered + #data
  while self.buffered > MAX_BUFFERED and #self.chunks > 1 do
    self.buffered = self.buffered - #table.remove(self.chunks, 1)
  end
  if self._reader then local r = self._reader self._reader = nil r() end
end

function Terminal:_eof()
  self.eof = true
  if self._reader then local r = self._reader self._reader = nil r() end
  self:_maybe_done()
end

function Terminal:_exited(code)
  self.exited, self.exitCode = true, code
  self:_maybe_done()
end

-- The terminal is over once the shell exited and the pty has drained (or
-- the shell's children hold it, in which case exit alone counts).
function Terminal:_maybe_done()
  if not self.exited then return end
  if not self.eof and self._stream and not self._stream:is_closing() then
    local rest = self._stream:try_read()
    if rest and #rest > 0 then self:_data(rest) end
  end
  local waiters = self._exit_waiters
  self._exit_waiters = {}
  for _, w in ipairs(waiters) do w() end
  if self._reader then local r = self._reader self._reader = nil r() end
  -- exited and drained: nothing more can come, the pty's fd goes now (what
  -- was read is kept for read()); a terminal never closed held it until
  -- its sandbox ended
  if self.eof and self._stream and not self._stream:is_closing() then self._stream:close() end
  -- and its cgroup, once nothing of it runs (a background job it left
  -- keeps it, and dies with close() or the sandbox)
  if self._cgroup and not cgroup.populated(self._cgroup) then
    cgroup.remove_later(self._cgroup)
    self._cgroup = nil
  end
end

function Terminal:write(data)
  V.type(data, "string", "data")
  if self.closed or self.exited then errors.raise("TERMINAL_CLOSED", "the terminal has ended") end
  self._stream:write(data)
  return true
end

-- read() -> the output so far (waits until there is some); nil once the
-- shell has exited and everything was read.
function Terminal:read()
  while #self.chunks == 0 do
    if self.eof or self.closed or (self.exited and self._drained) then return nil end
    if self.exited then self._drained = true end
    async.await(function(resume)
      self._reader = resume
      if self.exited then
        local t = core.timer()
        t:start(20, 0, function() t:close() if self._reader == resume then self._reader = nil resume() end end)
      end
      return function() self._reader = nil end
    end, "terminal:read")
  end
  local out = table.concat(self.chunks)
  self.chunks, self.buffered = {}, 0
  return out
end

function Terminal:onData(fn)
  V.type(fn, "function", "onData")
  self.listeners[#self.listeners + 1] = fn
end

function Terminal:resize(cols, rows)
  check_size(cols, rows)
  if self.closed then errors.raise("TERMINAL_CLOSED", "the terminal was closed") end
  local ok, err = core.pty_resize(self._master_fd, cols, rows)
  if not ok then errors.raise("FILESYSTEM_ERROR", "resize failed: " .. tostring(err)) end
  if cols ~= self.cols or rows ~= self.rows then
    self._resize_guard = { cols = self.cols, rows = self.rows, until_ms = now_ms() + RESIZE_GUARD_MS }
  end
  self.cols, self.rows = cols, rows
  return true
end

-- wait() -> the shell's exit code
function Terminal:wait()
  if not self.exited then
    async.await(function(resume) table.insert(self._exit_waiters, resume) end, "terminal:wait")
  end
  return self.exitCode
end

-- close(): kill the shell and everything it started, release the pty.
function Terminal:close()
  if self.closed then return end
  self.closed = true
  if not self.exited then
    if self._cgroup then
      cgroup.kill_cgroup(self._cgroup)
    else
      -- job control puts background jobs in their own process groups
      tree.signal_pids(tree.descendants(self.pid), "SIGKILL")
    end
    core.kill(-self.pid, "SIGKILL")
    core.kill(self.pid, "SIGKILL")
    self:wait()
  end
  if self._stream and not self._stream:is_closing() then self._stream:close() end
  if self._cgroup then cgroup.remove_when_empty(self._cgroup, async.sleep) self._cgroup = nil end
  self._sandbox.terminals[self] = nil
end

local M = { Terminal = Terminal }

function M.close_all(sb)
  for t in pairs(sb.terminals or {}) do pcall(t.close, t) end
end

-- deleteSession(id): the session's terminals go with everything else it started
function M.close_session(sb, session_id)
  if session_id == nil then return end -- (destroy: close_all, once the sessions are gone)
  for t in pairs(sb.terminals or {}) do
    if t.sessionId == session_id then pcall(t.close, t) end
  end
end

-- A part of Session (lib/compose.lua): session:terminal(); a sandbox's
-- terminals close once its sessions are gone, a session's with it.
function M.install(class, hooks)
  compose.methods(class, Session, "terminal")
  compose.add(hooks, "session_ending", M.close_session)
  compose.add(hooks, "sandbox_end", M.close_all)
end


require("moonbox.lib.arity").guard(Terminal, "Terminal")

return M
