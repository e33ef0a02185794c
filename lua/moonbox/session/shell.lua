-- One session shell: a bash process that reads one short control line per
-- command (`@ N`, or `eval "$__mb_cN"` without the builtins) and sources the command's body from a file of
-- its own, reporting on a nonce-authenticated status pipe. The protocol, its
-- two transports (fd slots under /proc/<rt>/fd, or a run directory under
-- namespaces) and the hot set are described in docs/sessions.md, "The
-- shell's protocol, file by file".
local core = require "moonbox.core"
local async = require "moonbox.async"
local fs = require "moonbox.lib.fs"
local util = require "moonbox.lib.util"
local tree = require "moonbox.process.tree"
local cgroup = require "moonbox.process.cgroup"
local errors = require "moonbox.errors"

local M = {}

-- pids of the shells that live (not yet reaped): the runtime's own, never
-- taken for orphans (registry.known_pids, a shell of a session being
-- deleted included)
M.live = {}

local CONTROL_FD, STATUS_FD, PRELUDE_FD, BUILTIN_FD = 60, 1, 62, 63
-- The exported environment kept per session (what a restarted shell gets
-- back): at most what execve passes to a program (ARG_MAX with the usual
-- 8 MiB stack: 2 MiB for arguments and environment together). Past it every
-- program the shell starts fails with E2BIG anyway, and the runtime would
-- hold megabytes per session and restore a shell that could not start.
local MAX_ENV_BYTES = 2 * 1024 * 1024
local PIPE_CAPACITY = 4096 -- a pipe always holds one page, even past pipe-user-pages-soft
local SLOTS = { body = 1, stdin = 2, stdout = 3, stderr = 4, prelude = 5 }
local SLOT_NAMES = {}
for name, i in pairs(SLOTS) do SLOT_NAMES[i] = name end

-- all of data to fd (a file, a FIFO that has room), or an error
local function write_whole(fd, data)
  local done = 0
  while done < #data do
    local n, msg = core.write_fd(fd, done == 0 and data or data:sub(done + 1))
    if not n then error(msg, 0) end
    done = done + n
  end
end

-- false: every command is sourced (and every external command forked by
-- bash), as without the builtin
M.spawn_builtin = true
-- false: shells start without the builtins at all (they report with
-- export -p, and bash names errors after the body's path)
M.load_builtins = true

-- moonbox.shellBuiltins([{spawn = bool, load = bool}]) -> {spawn, load}
-- (beyond, docs/sessions.md): the public knob for the two settings above.
-- `spawn` applies from the next exec; `load` to shells started after it.
-- Returns the settings in force after the call.
function M.builtins(opts)
  if opts ~= nil then
    if type(opts) ~= "table" then
      errors.raise("VALIDATION_FAILED", "shellBuiltins: expected a table {spawn = bool, load = bool}, got "
        .. type(opts))
    end
    for k, v in pairs(opts) do
      if k ~= "spawn" and k ~= "load" then
        errors.raise("VALIDATION_FAILED", ("shellBuiltins: unknown option %q (spawn, load)"):format(tostring(k)))
      end
      if type(v) ~= "boolean" then
        errors.raise("VALIDATION_FAILED", ("shellBuiltins: %s must be a boolean, got %s"):format(k, type(v)))
      end
    end
    if opts.spawn ~= nil then M.spawn_builtin = opts.spawn end
    if opts.load ~= nil then M.load_builtins = opts.load end
  end
  return { spawn = M.spawn_builtin, load = M.load_builtins }
end

local rt_pid = core.getpid()

-- The runtime's private directory of control FIFOs: made on first use
-- under $TMPDIR (or /tmp), mode 0700, named after this runtime's pid;
-- those of runtimes that died are removed then.
local ctl_dir, ctl_seq = nil, 0

-- Remove a control directory: only a real directory of ours (never through
-- a symlink someone put in /tmp under such a name), emptied through its fd.
local function remove_control_dir(dir)
  local dfd = core.dir_fd(dir, core.geteuid())
  if not dfd then return end
  for _, entry in ipairs(core.readdir("/proc/self/fd/" .. dfd) or {}) do core.unlink(entry, dfd) end
  core.close_fd(dfd)
  core.rmdir(dir)
end

local function control_dir()
  if ctl_dir then return ctl_dir end
  local base = os.getenv("TMPDIR") or "/tmp"
  for _, name in ipairs(core.readdir(base) or {}) do
    local pid = tonumber(name:match("^moonbox%-ctl%-(%d+)%-%x+$"))
    if pid and pid ~= rt_pid and not tree.pid_alive(pid) then remove_control_dir(base .. "/" .. name) end
  end
  local ok, hex = pcall(util.random_hex, 8)
  if not ok then return nil, hex, "EIO" end
  local dir = ("%s/moonbox-ctl-%d-%s"):format(base, rt_pid, hex)
  local err, code
  ok, err, code = core.mkdir(dir, 448)
  if not ok then return nil, err, code end
  ctl_dir = dir
  return dir
end

-- Runtime exit: the directory goes (its FIFOs went with their shells).
function M.cleanup()
  if ctl_dir then
    remove_control_dir(ctl_dir)
    ctl_dir = nil
  end
end

-- A new control FIFO: its path and a read-write fd (the child's fd 60,
-- and the runtime's writer until the hello), owned by uid/gid when given
-- (a shell that runs as another host id reopens it through /dev/fd/60).
local function new_control_fifo(uid, gid)
  local dir, err, code = control_dir()
  if not dir then return nil, "control FIFO directory: " .. tostring(err), code end
  ctl_seq = ctl_seq + 1
  local path = dir .. "/sh-" .. ctl_seq
  local ok
  ok, err, code = core.mkfifo(path, 384)
  if not ok then return nil, err, code end
  local fd
  fd, err, code = core.open_fd(path, "fifo")
  if fd and uid then ok, err, code = core.chown(fd, uid, gid) end
  if not fd or not ok then
    if fd then core.close_fd(fd) end
    core.unlink(path)
    return nil, err, code
  end
  return path, fd
end

-- The spawn builtin, opened once (false: there is none).
local builtin_fd
local function spawn_builtin_fd()
  if builtin_fd == nil then
    builtin_fd = false
    for _, path in ipairs(core.bash_builtin_paths or {}) do
      local fd = core.open_fd(path, "r")
      if fd then builtin_fd = fd break end
    end
  end
  return builtin_fd or nil
end
local function fd_path(fd) return "/proc/" .. rt_pid .. "/fd/" .. fd end

-- The shell's start-up script (report function, EXIT trap, command shapes)
-- is a real file, share/shell/prelude.bash in the source tree (bash -n and
-- shellcheck run on it: the prelude_bash test), installed as
-- <datadir>/moonbox/shell/prelude.bash, or beside the modules (moonbox/shell/)
-- when luarocks installs only the Lua module. It is found from where the
-- modules are, like the page (server/cli.lua) and the kernels (code.lua), and
-- read once, when this module loads. Its comment lines are dropped (what bash
-- gets is the script alone) and its @SLOT@ names become the shell's paths.
local SCRIPT_NAME = "share/shell/prelude.bash"
local script_text, script_error
do
  local init = package.searchpath("moonbox", package.path)
  local mdir = init and init:match("^(.*)/[^/]*$") or "."
  local tried = {}
  -- (open() resolves .. physically: a symlinked lua/ in the build tree leads
  -- to the source tree's share/)
  for _, path in ipairs { mdir .. "/shell/prelude.bash", mdir .. "/../../share/shell/prelude.bash",
                          mdir .. "/../../../moonbox/shell/prelude.bash" } do
    tried[#tried + 1] = path
    local f = io.open(path, "rb")
    local text = f and f:read("*a")
    if f then f:close() end
    if text then
      local lines = {}
      for line in text:gmatch("([^\n]*)\n") do
        if not line:match("^%s*#") and line:match("%S") then lines[#lines + 1] = line end
      end
      script_text = table.concat(lines, "\n") .. "\n"
      break
    end
  end
  if not script_text then
    script_error = ("cannot find the session shell's start-up script (%s); looked at %s")
      :format(SCRIPT_NAME, table.concat(tried, ", "))
  end
end

local function prelude(slots, rundir, env_fd, outputs_sent)
  local paths = {}
  for name, i in pairs(SLOTS) do
    paths[name:upper()] = rundir and (rundir.inside .. "/" .. name) or fd_path(slots[i])
  end
  paths.ENV = rundir and (rundir.inside .. "/env") or fd_path(env_fd)
  -- the builtin's outputs: files by path, or `- -` (pipes sent on the status socket)
  local words = { OUTS = outputs_sent and "- -" or (paths.STDOUT .. " " .. paths.STDERR),
    FDO = outputs_sent and "1" or "" }
  return (script_text:gsub("@(%u+)@", function(name)
    if words[name] then return words[name] end
    local path = paths[name]
    -- the paths go into the script unquoted: the runtime's own, never a caller's
    assert(path and path:match("^[%w/._-]+$"), "prelude.bash: bad slot @" .. name .. "@")
    return path
  end))
end

-- Parse `export -p` output into a map. Bash prints declare -x NAME="v" with
-- \ " $ ` escaped, declare -x NAME=$'v' for control characters, and
-- declare -x NAME for exported-but-unset names (skipped).
local ansi = { n = "\n", t = "\t", r = "\r", a = "\a", b = "\b", f = "\f", v = "\v", e = "\27",
  E = "\27", ["\\"] = "\\", ["'"] = "'", ['"'] = '"', ["?"] = "?" }
function M.parse_exports(text)
  if text:sub(1, 9) ~= "declare -" then
    -- __mb_rep's format: NAME=VALUE entries, each NUL-terminated
    local env = {}
    for name, value in text:gmatch("([^%z=]+)=([^%z]*)%z") do env[name] = value end
    return env
  end
  local env, i, n = {}, 1, #text
  while i <= n do
    local s, e, name = text:find("^declare %-[%-%a]* ([%w_]+)", i)
    if not s then
      local nl = text:find("\n", i, true)
      if not nl then break end
      i = nl + 1
    else
      i = e + 1
      local c = text:sub(i, i)
      if c == "=" and text:sub(i + 1, i + 1) == '"' then
        local j, buf = i + 2, {}
        while j <= n do
          local ch = text:sub(j, j)
          if ch == "\\" then buf[#buf + 1] = text:sub(j + 1, j + 1) j = j + 2
          elseif ch == '"' then break
          else buf[#buf + 1] = ch j = j + 1 end
        end
        env[name] = table.concat(buf)
        i = j + 1
      elseif c == "=" and text:sub(i + 1, i + 2) == "$'" then
        local j, buf = i + 3, {}
        while j <= n do
          local ch = text:sub(j, j)
          if ch == "\\" then
            local nx = text:sub(j + 1, j + 1)
            if nx == "x" then
              local hex = text:match("^%x%x?", j + 2)
              buf[#buf + 1] = string.char(tonumber(hex, 16)) j = j + 2 + #hex
            elseif nx:match("%d") then
              local oct = text:match("^[0-7][0-7]?[0-7]?", j + 1)
              buf[#buf + 1] = string.char(tonumber(oct, 8) % 256) j = j + 1 + #oct
            else
              buf[#buf + 1] = ansi[nx] or ("\\" .. nx) j = j + 2
            end
          elseif ch == "'" then break
          else buf[#buf + 1] = ch j = j + 1 end
        end
        env[name] = table.concat(buf)
        i = j + 1
      end
    end
  end
  return env
end

local Shell = {}
Shell.__index = Shell

-- The run directory of a namespaced shell; per-command entries are made
-- relative to its fd (no path walk through /proc/<init>/root each time).
--
-- Under a root runtime the sandbox's tmpfs takes only inodes of ids mapped
-- inside: the runtime makes the directory and its entries with root
-- inside's ids (rundir.uid, rundir.gid; setfsuid around the calls). So the
-- sandbox may put anything there: every open by the runtime is relative to
-- the directory's fd, never follows a symlink, never blocks, and takes only
-- a regular file or a FIFO (core.open_fd with a dirfd), FIFOs come from
-- mkfifo (EEXIST if a name was taken), and whatever is there is the
-- sandbox's own tmpfs (nodev).
local NOTHING = {}

-- mark(cmd, slot) -> the slot's entry name, to be unlinked after the command
local function mark(cmd, slot)
  local used = cmd.used or {}
  cmd.used = used
  used[#used + 1] = slot
  return SLOT_NAMES[slot]
end

local outputs_to_streams -- (defined with the outputs, below)

local function pack(...) return { n = select("#", ...), ... } end

-- (Nested calls run under the ids already in force: a command's entries are
-- all made in one switch, four system calls instead of four per entry. fn
-- must not yield: every task would run with these ids meanwhile.)
function Shell:_as_root_inside(fn, ...)
  local ids = self.rundir_ids
  if not ids or self.as_root_inside then return fn(...) end
  local ou, og = core.setfsids(ids.uid, ids.gid)
  if not ou then return nil, og end
  self.as_root_inside = true
  local res = pack(pcall(fn, ...))
  self.as_root_inside = false
  core.setfsids(ou, og)
  if not res[1] then error(res[2], 0) end
  return unpack(res, 2, res.n)
end

-- Make entry name (fn(name, ...) as root inside). Something left under the
-- name (a symlink, a FIFO, a file where a FIFO goes) is removed and the
-- call made once more: the leftover is the sandbox's, never followed.
function Shell:_make_entry(fn, name, ...)
  local res, err, code = self:_as_root_inside(fn, name, ...)
  if res or (code ~= "ELOOP" and code ~= "EEXIST" and code ~= "EINVAL" and code ~= "ENXIO") then
    return res, err, code
  end
  core.unlink(name, self.rundir_fd)
  return self:_as_root_inside(fn, name, ...)
end

-- The run directory's fd, opened when the runtime works in it and closed by
-- _release_dir between commands. Reopened the way it was first opened:
-- through the sandbox's confinement (on the /run/moonbox tmpfs, never
-- following a symlink), or refusing a directory someone else owns.
function Shell:_dir()
  if not self.rundir_fd then
    local rundir = self.rundir
    local fd, err, code
    if rundir.conf then
      fd, err, code = core.fs_open_beneath(rundir.conf, rundir.inside:sub(2), "r")
    else
      fd, err, code = core.dir_fd(rundir.host, rundir.uid)
    end
    if not fd then return nil, err, code end
    self.rundir_fd = fd
  end
  return self.rundir_fd
end

-- The hot set (issue #32): the HOT_MAX shells that ran a command last keep
-- their run directory's fd, their control FIFO's writer and their body file
-- open between commands, so a command costs no opens and closes for them
-- (about a third of a namespaced exec's system calls). An idle session
-- outside the set still costs its status pipe alone (issue #18): the set
-- costs the runtime at most 3 * HOT_MAX fds, whatever the session count.
local HOT_MAX = 32
local hot, hot_count, hot_tick = {}, 0, 0

-- Drop a shell from the hot set: what it held goes (its body file when no
-- command of it runs; a running one drops it when it ends, Shell:start).
function Shell:_cool()
  if not hot[self] then return end
  hot[self] = nil
  hot_count = hot_count - 1
  if self.hot_ctl then core.close_fd(self.hot_ctl) self.hot_ctl = nil end
  self:_drop_spare_outputs()
  if not self.running then
    self:_drop_body()
    self:_release_dir()
  end
end

function Shell:_drop_body()
  if not self.hot_body then return end
  core.close_fd(self.hot_body)
  self.hot_body, self.body_size = nil, nil
  if self.rundir_fd then core.unlink("body", self.rundir_fd) end
end

-- This shell runs a command now: it joins the hot set, in place of the one
-- that has waited longest (never one whose command runs: its body is in use).
function Shell:_warm()
  hot_tick = hot_tick + 1
  if not hot[self] then
    if hot_count >= HOT_MAX then
      local oldest, tick = nil, math.huge
      for sh, t in pairs(hot) do
        if t < tick and not sh.running then oldest, tick = sh, t end
      end
      if not oldest then return end
      oldest:_cool()
    end
    hot_count = hot_count + 1
  end
  hot[self] = hot_tick
end

-- hot_size([n]) -> the size in force before: how many shells the hot set
-- keeps (n = 0: none, every command opens and closes what it uses).
function M.hot_size(n)
  local was = HOT_MAX
  if n ~= nil then
    assert(type(n) == "number" and n >= 0 and n % 1 == 0, "hot_size: expected an integer >= 0")
    HOT_MAX = n
    while hot_count > HOT_MAX do
      local oldest, tick = nil, math.huge
      for sh, t in pairs(hot) do
        if t < tick then oldest, tick = sh, t end
      end
      oldest:_cool()
    end
  end
  return was
end

function Shell:_release_dir()
  if self.rundir_fd and not self.running and not self.starting and not hot[self] then
    core.close_fd(self.rundir_fd)
    self.rundir_fd = nil
  end
end

-- The body file of a namespaced shell: written whole before each command
-- (bash reads a sourced file whole before it runs any of it). A hot shell
-- keeps it open and rewrites it in place; else it is made per command and
-- unlinked after it (marked in cmd.used, Shell:start).
function Shell:_write_body(body, cmd)
  if self.hot_body then
    -- (the size it was written with: truncated only when it shrinks)
    local ok, err = core.rewrite_fd(self.hot_body, body, self.body_size)
    self.body_size = ok and #body or nil
    if not ok then error(err, 0) end
    return
  end
  local fd = errors.check("FILESYSTEM_ERROR", self:_make_entry(core.open_fd, "body", "w", self.rundir_fd))
  local ok, err = pcall(write_whole, fd, body)
  if ok and hot[self] then
    self.hot_body, self.body_size = fd, #body
    return
  end
  core.close_fd(fd)
  mark(cmd, SLOTS.body) -- unlinked after the command
  if not ok then error(err, 0) end
end

function Shell:_remove_rundir()
  local rundir = self.rundir
  if rundir.conf then fs.rmdir_beneath(rundir.conf, rundir.inside:sub(2)) else core.rmdir(rundir.host) end
end

function Shell:_open_rundir(rundir)
  -- a runtime that is not root maps only itself: nothing to switch
  self.rundir_ids = rundir.uid and core.getuid() == 0 and rundir.uid ~= 0 and { uid = rundir.uid, gid = rundir.gid }
    or nil
  local ok, err, code, fd
  if rundir.conf then
    -- rundir.conf (sb.run_conf, with root inside's ids): made and opened by
    -- openat2 from the sandbox's root fd, on the /run/moonbox tmpfs only,
    -- so not even a symlink put in place of /run/moonbox leads the runtime
    -- out (a path through /proc/<init>/root would be walked from the host's root)
    local rel = rundir.inside:sub(2)
    ok, err, code = fs.mkdir_beneath(rundir.conf, rel, 448)
    if not ok then return nil, err, code end
    fd, err, code = core.fs_open_beneath(rundir.conf, rel, "r")
  else
    ok, err, code = self:_as_root_inside(core.mkdir, rundir.host, 448)
    if not ok then return nil, err, code end
    fd, err, code = core.dir_fd(rundir.host, rundir.uid)
  end
  if not fd then return nil, err, code end
  self.rundir, self.rundir_fd = rundir, fd
  return true
end

-- The env file the shell's `export -p` rewrites before each report: a
-- memfd held open for reading (its /proc/<rt>/fd path), or a file in the
-- run directory under namespaces, read by name when a record says it
-- changed (Shell:_read_env).
function Shell:_open_env_file()
  if not self.rundir then
    self.env_fd = errors.check("FILESYSTEM_ERROR", core.memfd("moonbox-env"))
    return
  end
  local w = errors.check("FILESYSTEM_ERROR", self:_make_entry(core.open_fd, "env", "w", self.rundir_fd))
  core.close_fd(w)
end

-- The env file's content ("" when it cannot be read: what the sandbox put
-- in its place is not followed, nor waited for); nil when it is larger than
-- MAX_ENV_BYTES (the exports known before are kept).
function Shell:_read_env()
  local text
  if self.env_fd then
    text = core.pread_all(self.env_fd, MAX_ENV_BYTES + 1) or ""
  elseif self.rundir then
    local dir = self:_dir()
    local fd = dir and core.open_fd("env", "r", dir)
    text = fd and core.pread_all(fd, MAX_ENV_BYTES + 1) or ""
    if fd then core.close_fd(fd) end
  else
    return ""
  end
  if #text > MAX_ENV_BYTES then return nil end
  return text
end

-- The body slot is one file rewritten per command (bash reads a sourced
-- file whole before it runs any of it): a memfd on the body slot; in the
-- run directory, `body` is written per command like stdin (Shell:start).
-- The spawn builtin reads it too, and may then source it all the same.
function Shell:_open_body_file()
  if not self.rundir then
    self.body_fd = errors.check("FILESYSTEM_ERROR", core.memfd("moonbox-body"))
    self.slots[SLOTS.body] = self.body_fd
  end
end

-- spawn{env = map, cwd, cgroup, session_cgroup, shell, on_exit(code, signal), rundir =
-- {host, inside, uid, gid} (namespaces), spawn_spec(spec) -> spec (the sandbox's),
-- deferred (bash starts now, its start-up script comes with :begin(rundir):
-- a shell made ahead inside a sandbox init that is not finished yet)}
function M.spawn(opts)
  if not script_text then return nil, script_error, "ENOENT" end
  local self = setmetatable({ seq = 0, status_buf = {}, waiting = nil, dead = false,
    on_exit = opts.on_exit, spawn_env = opts.env }, Shell)
  if opts.rundir then
    local ok, err, code = self:_open_rundir(opts.rundir)
    if not ok then return nil, err, code end
  end
  -- the sandbox's rules (sandbox/spawn.lua): a shell without them is never started
  local spec_of = assert(opts.spawn_spec, "shell spawn: no spawn_spec")
  local stdio = { [0] = "null", [STATUS_FD] = "out", [2] = "null", [PRELUDE_FD] = "in" }
  -- (not into an image's bash: the builtin is built against the host's)
  if M.load_builtins and not opts.no_builtins then
    stdio[BUILTIN_FD] = spawn_builtin_fd()
    -- the status channel a socket: each command's output pipes travel on it
    -- (the builtin receives them), no FIFO or slot per command (issue #32)
    stdio[STATUS_FD] = "socket"
    self.outputs_sent = true
  end
  local spec = spec_of {
    args = { "bash", "--noprofile", "--norc", "/dev/fd/" .. CONTROL_FD },
    file = opts.shell or "/bin/bash",
    env = opts.env,
    cwd = opts.cwd,
    stdio = stdio,
    setsid = true,
    pdeathsig = "SIGKILL",
    cgroup = opts.cgroup,
    on_exit = function(exit_code, signal) self:_exited(exit_code, signal) end,
  }
  local proc, pipes_or_err, code
  if opts.rundir or opts.deferred then
    -- under namespaces: the control FIFO
    self.ctl_path, self.ctl_fd, code = new_control_fifo(spec.pipe_uid, spec.pipe_gid)
    if self.ctl_path then
      spec.stdio[CONTROL_FD] = self.ctl_fd
      proc, pipes_or_err, code = core.spawn(spec)
    else
      pipes_or_err = self.ctl_fd
    end
  else
    -- without: a pipe the runtime holds, as a host path in a directory of
    -- the runtime's uid would be open to every unisolated sandbox's commands
    spec.stdio[CONTROL_FD] = "in"
    proc, pipes_or_err, code = core.spawn(spec)
  end
  if not proc then
    self:_drop_control()
    if self.rundir then
      if self.rundir_fd then core.close_fd(self.rundir_fd) self.rundir_fd = nil end
      self:_remove_rundir()
    end
    return nil, pipes_or_err, code
  end
  self.slots = {}
  self.proc, self.pid = proc, proc:pid()
  M.live[self.pid] = true
  -- where it was born, and the cgroup meant as its session's (a spare's
  -- cmd cgroup sits inside one): a session that adopts it keeps both
  self.cgroup, self.session_cgroup = opts.cgroup, opts.session_cgroup
  self.control = pipes_or_err[CONTROL_FD]
  self.status = pipes_or_err[STATUS_FD]
  self.status:read_start(function(_, data) self:_status_data(data) end)
  -- the one timer of its commands' outputs (Shell:_send_outputs), made with
  -- the shell and closed with its pipes: a handle per command was made and
  -- closed each time (issue #32)
  self.output_timer = core.timer()
  self.outputs_due = function()
    local due = self.streaming
    self.streaming = nil
    if due then outputs_to_streams(due) end
  end
  self.prelude_pipe = pipes_or_err[PRELUDE_FD]
  if not opts.deferred then self:begin() end
  return self
end

-- Send the start-up script (bash waits for it on the control pipe).
function Shell:begin(rundir)
  if rundir then
    local ok, err, code = self:_open_rundir(rundir)
    if not ok then return nil, err, code end
  end
  self:_open_body_file()
  if not self.rundir then
    for i = 1, 5 do self.slots[i] = self.slots[i] or core.devnull() end
  end
  -- bash reads a script from a pipe one byte per read(2), but sources a
  -- file in blocks: the start-up script comes through its own pipe, sourced
  self:_open_env_file()
  -- (the run directory stays open until the hello: _status_data)
  self.starting = self.rundir ~= nil
  local p = self.prelude_pipe
  self.prelude_pipe = nil
  p:write(prelude(self.slots, self.rundir, self.env_fd, self.outputs_sent), function() p:close() end)
  local sent, err, code = self:_send(". /dev/fd/62; exec 62<&-\n")
  if not sent then return nil, err, code end
  return true
end

-- One line to bash: on the control pipe of an unisolated shell, else on the
-- control FIFO, through the runtime's own writer while it holds one, else
-- opened for this line (ENXIO when bash is gone).
function Shell:_send(line)
  if self.control then
    self.control:write(line)
    return true
  end
  local fd, opened = self.ctl_fd or self.hot_ctl, false
  local err, code
  if not fd then
    if not self.ctl_path then return nil, "the session shell's control FIFO is gone", "EPIPE" end
    fd, err, code = core.open_fd(self.ctl_path, "fifo_w")
    if not fd then return nil, err, code end
    opened = true
  end
  local n
  n, err, code = core.write_fd(fd, line)
  if opened then
    -- a hot shell keeps the writer for its next line (one whose `@` now
    -- waits for messages sends none)
    if hot[self] and n == #line and not self.ctl_fd and not self.looping then self.hot_ctl = fd
    else core.close_fd(fd) end
  end
  if n ~= #line then return nil, err or "short write on the control FIFO", code end
  return true
end

-- The runtime's end of the control FIFO: its writer closed, the FIFO
-- unlinked (bash keeps what it opened).
function Shell:_drop_control()
  self:_cool()
  if self.control then self.control:close() self.control = nil end
  if self.ctl_fd then core.close_fd(self.ctl_fd) self.ctl_fd = nil end
  if self.ctl_path then core.unlink(self.ctl_path) self.ctl_path = nil end
end

-- Status records arrive in pieces; a record is complete after two NULs.
-- The env file then holds that report's `export -p`.
--
-- The first record is the shell's hello, written by its start-up script
-- before any command runs: with the report builtin it names the nonce the
-- next record must carry (self.nonce), and each record names the one after
-- it. Anything else on the status pipe (bytes a command wrote there: it
-- runs in the shell and can reach the pipe's fd) is not taken as a record,
-- and is dropped; only a bounded tail is kept while looking for the next
-- record. A shell without the builtin says hello without a nonce
-- (self.nonce = false): its records are taken as they come.
local MAX_STATUS_BUF = 64 * 1024
-- "\n<ID> <STATUS> <KIND> <e|-><k?> <NONCE> <NEXT>\0<PWD>\0" (k: the
-- command's output pipes are in no process but the shell, which made none)
local RECORD = "\n(%d+) (%d+) (%a+) ([e-])(k?) (%x+) (%x+)%z([^%z]*)%z"
local KEEP_STATUS_TAIL = 8192 -- past a record's head and the longest PWD (4096)

function Shell:_record(id, status, kind, flag, pwd, keep)
  if flag ~= "-" or not self.exports then self.exports = self:_read_env() or self.exports or "" end
  self:_release_dir()
  local record = { id = tonumber(id), status = tonumber(status), exiting = kind == "exit",
    pwd = pwd, exports = self.exports, outputs_private = keep == "k" }
  if record.exiting then self.exiting = true end
  -- (with nonces the record is this command's whatever id the shell's
  -- counter says: a command can change __mb_id, never the nonce)
  if self.waiting and (self.nonce or record.id == self.waiting.id) then self:_deliver(record) end
end

function Shell:_status_data(data)
  if data == nil then return end
  local buf = self.status_buf
  buf[#buf + 1] = data
  if not data:find("\0", 1, true) then
    -- nothing but short records belongs here; a command that writes to the
    -- status fd (it can dup it) gets its flood cut to the tail, never kept
    self.status_len = (self.status_len or 0) + #data
    if self.status_len > MAX_STATUS_BUF then
      local tail = table.concat(buf):sub(-KEEP_STATUS_TAIL)
      self.status_buf, self.status_len = { tail }, #tail
    end
    return
  end
  self.status_len = 0
  local text = #buf == 1 and buf[1] or table.concat(buf)
  if self.nonce == nil then
    -- the hello comes first; nothing of a command can precede it
    local e, nonce = select(2, text:find("\n0 0 hello %- H (%x+)%z[^%z]*%z"))
    if e then
      self.nonce, text = nonce, text:sub(e + 1)
    else
      e = select(2, text:find("\n0 0 hello%z[^%z]*%z"))
      if not e then self.status_buf = { text } return end
      self.nonce, text = false, text:sub(e + 1)
    end
    if self.starting then
      self.starting = false
      self:_release_dir()
    end
    -- with the builtin the shell holds the FIFO's writer: ours can go
    if self.nonce and self.ctl_fd then core.close_fd(self.ctl_fd) self.ctl_fd = nil end
  end
  if self.nonce then
    -- (usually one record and nothing after it: no second find, and no
    -- loop for LuaJIT to record per call. The pattern is a constant and
    -- the nonce compared after: a pattern made per record, with the nonce
    -- in it, made LuaJIT compile a trace per pattern string, 7 us a record
    -- against 1, issue #32.)
    local at = 1
    repeat
      local s, e, id, status, kind, flag, keep, nonce, next_nonce, pwd = text:find(RECORD, at)
      if not s then break end
      if nonce == self.nonce then
        text = e == #text and "" or text:sub(e + 1)
        at = 1
        self.nonce = next_nonce
        self:_record(id, status, kind, flag, pwd, keep)
      else
        at = s + 1 -- a record not ours (the command wrote it): looked past
      end
    until text == "" or not text:find("\0", at, true)
    if #text > MAX_STATUS_BUF then text = text:sub(-KEEP_STATUS_TAIL) end
    -- (the same table: one less per record)
    for i = #buf, 2, -1 do buf[i] = nil end
    buf[1] = text ~= "" and text or nil
    return
  end
  while true do
    local a = text:find("\0", 1, true)
    local b = a and text:find("\0", a + 1, true)
    if not b then break end
    -- a user's DEBUG or ERR trap also runs at the shell's top level, between
    -- commands, where its output lands here: whatever comes before the
    -- record's newline is dropped
    -- (the flag: "-" the env file is as at the last report, "e" or none
    -- it was rewritten)
    local id, status, kind, flag = text:sub(1, a - 1):match("\n(%d+) (%d+) (%a+) ?([e-]?)$")
    local pwd = text:sub(a + 1, b - 1)
    text = text:sub(b + 1)
    if id then self:_record(id, status, kind, flag, pwd) end
  end
  self.status_buf = { text }
end

function Shell:_exited(code, signal)
  self.dead = true
  M.live[self.pid] = nil
  self.exit_code, self.exit_signal = code, signal
  -- the EXIT trap's record may still sit in the pipe: read it first
  if self.status and not self.status:is_closing() then
    local rest = self.status:try_read()
    if rest and #rest > 0 then self:_status_data(rest) end
  end
  self:_close_pipes()
  if self.waiting then self:_deliver({ id = self.waiting.id, status = code, died = true, signal = signal }) end
  if self.on_exit then self.on_exit(code, signal) end
end

-- The running command's record has come: its job keeps it (the task that
-- waited for it may be gone, cancelled: another one then waits, Job:wait).
function Shell:_deliver(record)
  local job = self.waiting
  self.waiting = nil
  job.record = record
  local resume = job.resume
  job.resume = nil
  if resume then resume(record) end
end

function Shell:_close_pipes()
  if self.output_timer then self.output_timer:close() self.output_timer, self.streaming = nil, nil end
  if self.prelude_pipe then self.prelude_pipe:close() self.prelude_pipe = nil end
  self:_drop_control()
  if self.status then self.status:close() self.status = nil end
  if not self.running then self:_close_slots() end
end

function Shell:_close_slots()
  if not self.slots then return end
  self:_cool()
  self:_drop_body()
  for _, fd in ipairs(self.slots) do core.close_fd(fd) end
  self.slots = nil
  if self.env_fd then core.close_fd(self.env_fd) self.env_fd = nil end
  self.body_fd = nil
  if self.rundir then
    self.starting = false
    local dir = self:_dir()
    if dir then
      for name in pairs(SLOTS) do core.unlink(name, dir) end
      core.unlink("env", dir)
      core.close_fd(dir)
    end
    self.rundir_fd = nil
    self:_remove_rundir()
  end
end

function Shell:usable()
  return not self.dead and not self.exiting
end

-- What a session asks of its shell (Session never reads or writes the
-- shell's fields; pid is the one read-only field it uses, for signals and
-- process trees).
-- alive() -> false once the shell process has exited.
function Shell:alive() return not self.dead end
-- busy() -> true while a command sent with start() has not reported.
function Shell:busy() return self.waiting ~= nil end
-- in_cgroup(cg) -> whether the shell is (as far as we moved it) in cg.
function Shell:in_cgroup(cg) return self.cgroup == cg end
-- move_to(cg): the shell process moves into cgroup cg (a path under
-- cgroup.base()); what it starts from now on is born there.
function Shell:move_to(cg)
  cgroup.move(cg, self.pid)
  self.cgroup = cg
end
-- spawn_env_of(k) -> the value of k in the environment the shell started with.
function Shell:spawn_env_of(k) return self.spawn_env[k] end
-- spawn_env_names() -> the names of that environment.
function Shell:spawn_env_names()
  local names = {}
  for k in pairs(self.spawn_env) do names[#names + 1] = k end
  return names
end
-- exit_status(status) -> status, or 128+N for a shell that ended by signal N
-- (kill $$); call after wait_exit.
function Shell:exit_status(status)
  if self.exit_signal and self.exit_signal > 0 then return 128 + self.exit_signal end
  return status
end

-- A command sent to the shell. wait() (in a task) -> its record; a wait
-- that is cancelled leaves the job as it is, and another task can wait for
-- it again (Session:_run's cancel: the command is killed, its record still
-- comes). The slots are cleaned up once, by the wait that gets the record.
local Job = {}
Job.__index = Job

local function forget_resume(job) job.resume = nil end
local function await_record(resume, job)
  job.resume = resume
  return forget_resume
end

function Job:wait()
  if not self.record then async.await(await_record, "exec", self) end
  if not self.cleaned then
    self.cleaned = true
    self.shell:_cleanup(self, self.req, self.record)
  end
  return self.record
end

-- run{body, stdin, prelude, words, on_chunk(stream, data)} -> record, where
-- record is {status, pwd, exports, exiting} or {died = true, status, signal}.
-- prelude (per-call cwd/env) makes the command run in a subshell, so its
-- effects end with the call. words (the body's, when it is a plain external
-- command line, without a prelude) let the shell spawn it without forking.
function Shell:run(req)
  return self:start(req):wait()
end

-- How a command's files reach the shell: one table per transport, each
--   open(sh)                   before the command's entries are made
--   body(sh, cmd, text)        the body file holds text
--   feed(sh, cmd, slot, data)  stdin, prelude: data the shell reads
--   drain(sh, cmd, slot)       stdout, stderr -> a stream of what it writes
--   finish(sh, cmd)            after the record: what the command used goes
-- cmd = {transport, readers = {name = stream} or nil, used = {slots} or nil,
-- feeders = {streams} or nil, pipes = {r, w, r, w} and output_ends = {w, w}
-- when the outputs are sent} (used and feeders made when first needed).

-- Without namespaces: the runtime's fixed fd slots, which the shell opens
-- as /proc/<rt>/fd/<slot>; per command fresh pipes are dup3()ed onto them,
-- and the body memfd is rewritten.
local fd_slots = {}

local function pipe()
  local r, w = core.pipe()
  if not r then error(w, 0) end
  return r, w
end

local function place(sh, cmd, slot, fd)
  core.dup_to(fd, sh.slots[slot])
  core.close_fd(fd)
  mark(cmd, slot)
end

function fd_slots.open() end

function fd_slots.body(sh, _, text)
  local ok, err = core.rewrite_fd(sh.body_fd, text, sh.body_size)
  sh.body_size = ok and #text or nil
  if not ok then error(err, 0) end
end

-- a pipe the shell reads: we write data and close our end
function fd_slots.feed(sh, cmd, slot, data)
  local r, w = pipe()
  place(sh, cmd, slot, r)
  if #data <= PIPE_CAPACITY then
    -- an empty pipe takes this much without blocking: no stream needed
    local n = core.write_fd(w, data)
    core.close_fd(w)
    if n ~= #data then error("short write to a fresh pipe", 0) end
    return
  end
  local s = core.stream_open(w)
  local feeders = cmd.feeders or {}
  cmd.feeders = feeders
  feeders[#feeders + 1] = s
  s:write(data, function() s:close() end)
end

function fd_slots.drain(sh, cmd, slot)
  local r, w = pipe()
  place(sh, cmd, slot, w)
  return core.stream_open(r)
end

-- (a slot keeps the last command's pipe end until the next dup3 over it:
-- our ends are closed, so that pipe is dead either way)
function fd_slots.finish(sh)
  if sh.dead then sh:_close_slots() end
end

-- Under namespaces: entries of the shell's run directory, made as root
-- inside (Shell:_make_entry); stdin and prelude files, stdout and stderr
-- fresh FIFOs, unlinked after the command; the body (Shell:_write_body).
local run_dir = {}

function run_dir.open(sh)
  sh:_warm()
  errors.check("FILESYSTEM_ERROR", sh:_dir())
end

function run_dir.body(sh, cmd, text) sh:_write_body(text, cmd) end

function run_dir.feed(sh, cmd, slot, data)
  local fd = errors.check("FILESYSTEM_ERROR", sh:_make_entry(core.open_fd, mark(cmd, slot), "w", sh.rundir_fd))
  local ok, err = pcall(write_whole, fd, data)
  core.close_fd(fd)
  if not ok then error(err, 0) end
end

function run_dir.drain(sh, cmd, slot)
  local fifo = mark(cmd, slot)
  errors.check("FILESYSTEM_ERROR", sh:_make_entry(core.mkfifo, fifo, 384, sh.rundir_fd))
  return core.stream_open(errors.check("FILESYSTEM_ERROR", core.open_fd(fifo, "fifo", sh.rundir_fd)))
end

function run_dir.finish(sh, cmd)
  if sh.rundir_fd then
    for _, slot in ipairs(cmd.used or NOTHING) do core.unlink(SLOT_NAMES[slot], sh.rundir_fd) end
  end
  if sh.dead then sh:_close_slots()
  elseif not hot[sh] then
    sh:_drop_body() -- (cooled while the command ran)
    sh:_release_dir()
  end
end

-- The control line per command shape: `@ N` where the shell has loaded the
-- builtins (it said hello with a nonce: src/bash/line_builtin.c), else
-- `eval "$__mb_cN"`. bash reads it one byte per read(2), so its length is
-- the shell's system calls: 4 instead of 16 (issue #32).
-- Before the hello (self.nonce == nil) a shell that may have loaded them
-- gets `eval "$__mb_pN"`: shape N with output files, whether or not it did.
local SHORT_LINES, EVAL_LINES, EARLY_LINES, SHAPE_BYTES = {}, {}, {}, {}
-- With the outputs sent on the status socket the shape travels as the one
-- byte sent with them, and the line is `@` alone: 2 bytes, 2 reads (issue
-- #32). That `@` then waits in the shell for the runtime's next messages
-- (self.looping): every later command is its message alone, a prelude's
-- shape (3, 4) its byte without fds; no line, no FIFO write.
local SENT_LINE = "@\n"
-- Shapes 1 and 5 (a body sourced, or run by the spawn builtin) carry the
-- body itself, up to INLINE_MAX bytes: the shape's byte in upper case, two
-- bytes of length, the body (src/bash/outputs.c). The shell then sources
-- the text it has instead of opening, reading and closing the body file,
-- 6-8 us on this VM (issue #32); the file still holds the body, for what
-- the shell leaves to bash's own source (a DEBUG trap, extdebug, NULs).
local INLINE_SHAPES = { [1] = "A", [5] = "E" }
local INLINE_MAX = 4096
for shape = 1, 6 do
  SHAPE_BYTES[shape] = tostring(shape)
  SHORT_LINES[shape] = ("@ %d\n"):format(shape)
  EVAL_LINES[shape] = ("eval \"$__mb_c%d\"\n"):format(shape)
  EARLY_LINES[shape] = (shape == 3 or shape == 4) and EVAL_LINES[shape] or ("eval \"$__mb_p%d\"\n"):format(shape)
end

-- A command's stdout and stderr as two fresh pipes whose write ends go to
-- the shell on its status socket (one byte, SCM_RIGHTS; src/bash/outputs.c
-- receives them onto fds 1 and 2): no FIFO to make, open and unlink per
-- command, nothing named in the sandbox (issue #32).
-- The write ends stay ours too until the command's cleanup
-- (cmd.output_ends), so the shell's closing its copies is no EOF to wake
-- up for (the end of a command is its record, as with the FIFOs), and the
-- last close of a pipe end, which frees it, is ours, not the shell's.
-- The read ends become streams (read as output comes) only when the command
-- is still running OUTPUT_STREAM_MS after it was sent; a command that ends
-- before has its output read once, at its record (core.read_pending, one
-- poll for both): a pipe holds 64 KiB, so a writer waits at most that long,
-- and a short command costs no stream setup and no epoll registration. The
-- read ends are made blocking (no fcntl per pipe): read_pending reads only
-- what poll found, and a stream sets O_NONBLOCK itself.
local OUTPUT_NAMES = { "stdout", "stderr" }
local OUTPUT_STREAM_MS = 1

-- A command's two output pipes (read, write, read, write), owned by root
-- inside, as the FIFOs were: `>/dev/stdout` reopens them.
function Shell:_new_outputs()
  local ids = self.rundir_ids
  local r1, w1 = core.pipe(ids and ids.uid, ids and ids.gid)
  if not r1 then return nil, w1 end
  local r2, w2 = core.pipe(ids and ids.uid, ids and ids.gid)
  if not r2 then
    core.close_fd(r1) core.close_fd(w1)
    return nil, w2
  end
  return { r1, w1, r2, w2 }
end

function Shell:_drop_spare_outputs()
  local spare = self.spare_outputs
  if not spare then return end
  self.spare_outputs = nil
  for i = 1, 4 do core.close_fd(spare[i]) end
end

-- The outputs made into streams once the command has run OUTPUT_STREAM_MS
-- (its timer's callback).
function outputs_to_streams(cmd)
  local readers = cmd.readers or {}
  cmd.readers = readers
  local raw, on_chunk = cmd.output_raw, cmd.on_chunk
  for _, name in ipairs(OUTPUT_NAMES) do
    local r = raw[name]
    raw[name] = nil
    local s, open_err = core.stream_open(r)
    if s then
      readers[name] = s
      s:read_start(function(_, data)
        if data then on_chunk(name, data) end
      end)
    else
      -- (no stream: what the command writes past a pipe's worth waits
      -- for its end, when it is read as a short command's is)
      raw[name] = r
      io.stderr:write(("moonbox: %s of a command read at its end only: %s\n"):format(name, tostring(open_err)))
    end
  end
end

-- Sends the command's outputs. What does not have to come before the send
-- is done after it, while the shell runs the command on another CPU (issue
-- #32): the next command's pipes are made then (a hot shell keeps one
-- spare set), unless the last command's pipes were in no other process
-- than the shell (its record's `k`: it made none) and are sent again
-- (Shell.reusing, cleanup in Shell:start).
function Shell:_send_outputs(cmd, on_chunk, shape, body)
  local pipes = self.spare_outputs
  self.spare_outputs = nil
  if not pipes then
    local err
    pipes, err = self:_new_outputs()
    if not pipes then error(err, 0) end
  end
  cmd.pipes = pipes
  cmd.output_raw = { stdout = pipes[1], stderr = pipes[3] }
  cmd.on_chunk = on_chunk
  cmd.output_ends = { pipes[2], pipes[4] }
  local message = SHAPE_BYTES[shape]
  local inline = INLINE_SHAPES[shape]
  if inline and #body <= INLINE_MAX then
    message = inline .. string.char(math.floor(#body / 256), #body % 256) .. body
  end
  local n, send_err = self.status:send_fds(message, cmd.output_ends)
  if n ~= #message then error("cannot send the command's outputs to its shell: " .. tostring(send_err), 0) end
  self.streaming = cmd
  self.output_timer:start(OUTPUT_STREAM_MS, 0, self.outputs_due)
  if hot[self] and not self.reusing then self.spare_outputs = self:_new_outputs() end
end

-- The outputs of a command that ended before they became streams (both,
-- usually: one poll for the two, core.read_pending), read, and closed at
-- the end of the loop's turn (core.close_later: usually after the next
-- command was sent, while the shell runs it).
-- keep: both are to be sent again, and no process but this one can write
-- them any more: read to their end, they stay open (returns true).
local function read_raw_outputs(raw, on_chunk, keep)
  local out, err = raw.stdout, raw.stderr
  local a, b = core.read_pending(out or err, out and err or nil)
  raw.stdout, raw.stderr = nil, nil
  if a then
    local first = out and "stdout" or "stderr"
    if #a > 0 then on_chunk(first, a) end
    if out and err and #b > 0 then on_chunk("stderr", b) end
    -- (what a pipe holds, at most 64 KiB, comes in one call: it is empty now)
    if keep and out and err then return true end
  end
  if out and err then core.close_later(out, err)
  else core.close_later(out or err) end
end

-- A command's output FIFO, read as the command writes it (a shell whose
-- outputs are not sent on its socket).
local function drain(sh, transport, cmd, req, slot, name)
  local s = transport.drain(sh, cmd, slot)
  cmd.readers = cmd.readers or {}
  cmd.readers[name] = s
  s:read_start(function(_, data)
    if data then req.on_chunk(name, data) end
  end)
end

-- The command's entries: body, stdin, prelude, and the output FIFOs where
-- the outputs are not sent.
local function make_entries(sh, transport, cmd, req, send_outputs)
  transport.body(sh, cmd, req.body)
  if req.stdin then transport.feed(sh, cmd, SLOTS.stdin, req.stdin) end
  if not send_outputs then
    drain(sh, transport, cmd, req, SLOTS.stdout, "stdout")
    drain(sh, transport, cmd, req, SLOTS.stderr, "stderr")
  end
  if req.prelude then transport.feed(sh, cmd, SLOTS.prelude, req.prelude) end
  return true
end

local function send_command(sh, transport, cmd, req, send_outputs)
  transport.open(sh)
  local shape = (req.prelude and 2 or 0) + (req.stdin and 2 or 1)
  if req.words and not req.prelude and M.spawn_builtin then shape = shape + 4 end
  -- the command's entries, made without a yield (as root inside: one
  -- switch, and none when no entry is made: a hot body, outputs sent)
  if send_outputs and not req.stdin and sh.hot_body then
    make_entries(sh, transport, cmd, req, send_outputs)
  else
    errors.check("FILESYSTEM_ERROR", sh:_as_root_inside(make_entries, sh, transport, cmd, req, send_outputs))
  end
  local line
  if send_outputs then
    sh:_send_outputs(cmd, req.on_chunk, shape, req.body)
    -- the first `@` stays in the shell, waiting for the next messages
    if not sh.looping then line, sh.looping = SENT_LINE, true end
  elseif sh.looping then
    -- a prelude's shape: its byte alone on the socket
    local sent, send_err = sh.status:write(SHAPE_BYTES[shape])
    if not sent then error("cannot send the command to its shell: " .. tostring(send_err), 0) end
  else
    local lines = sh.nonce and SHORT_LINES or (sh.nonce == nil and sh.outputs_sent and EARLY_LINES)
      or EVAL_LINES
    line = lines[shape]
  end
  if line then
    local sent, send_err = sh:_send(line)
    if not sent then error(send_err, 0) end
  end
end

-- start(req) -> Job: the command is sent; Job:wait() waits for its end.
-- (No closure per command: the exec path's garbage is the runtime's
-- collector's work, issue #32.)
function Shell:start(req)
  self.seq = self.seq + 1
  local id = self.seq
  local transport = self.rundir and run_dir or fd_slots
  -- the job is the command's state too (cmd, for the transports)
  local job = setmetatable({ id = id, shell = self, req = req, transport = transport }, Job)
  self.running = true
  -- the outputs as pipes sent on the status socket: every shape the builtin
  -- runs (not a prelude's subshell), in a shell that loaded it
  local send_outputs = self.outputs_sent and self.nonce and not req.prelude
  local ok, err = pcall(send_command, self, transport, job, req, send_outputs)
  if not ok then
    job.record = { died = true, status = 1, error = tostring(err) }
    return job
  end
  self.waiting = job
  return job
end

-- After the command's record (once, Job:wait): its outputs read to their
-- end, its entries removed, its pipes kept for the next command or closed.
function Shell:_cleanup(cmd, req, record)
  if self.streaming == cmd then
    self.streaming = nil
    if self.output_timer then self.output_timer:stop() end
  end
  -- what the command wrote before it reported is in the pipes already
  local readers = cmd.readers or NOTHING
  for _, name in ipairs(OUTPUT_NAMES) do
    local s = readers[name]
    if s then
      local rest = s:try_read()
      if rest and #rest > 0 then req.on_chunk(name, rest) end
      s:close()
    end
  end
  local raw = cmd.output_raw
  local ends = cmd.output_ends
  -- The pipes again for the next command (a hot shell's): only the shell
  -- had them (the record's `k`), and both were read at the record, all
  -- they held (less than a pipe's 64 KiB, no writer left to add more).
  local keep = ends and raw and raw.stdout and raw.stderr and record and record.outputs_private
    and not record.exiting and not self.dead and hot[self] and true
  local again
  if raw and (raw.stdout or raw.stderr) then again = read_raw_outputs(raw, req.on_chunk, keep) end
  if cmd.feeders then
    for _, s in ipairs(cmd.feeders) do s:close() end
  end
  if again then
    self:_drop_spare_outputs()
    self.spare_outputs = cmd.pipes -- (the same four: read, write, read, write)
  elseif ends then
    core.close_later(ends[1], ends[2])
  end
  self.reusing = again and true or false
  self.running = false
  cmd.transport.finish(self, cmd)
end

-- Wait (in a task) until the shell process has exited and been reaped. A
-- shell that said it was exiting gets limit_ms to do so, then SIGKILL.
function Shell:wait_exit(limit_ms)
  if self.dead then return end
  async.await(function(resume)
    local timer
    local prev = self.on_exit
    self.on_exit = function(...)
      if timer and not timer:is_closing() then timer:close() end
      if prev then prev(...) end
      resume()
    end
    if limit_ms then
      timer = core.timer()
      timer:start(limit_ms, 0, function() timer:close() self:kill("SIGKILL") end)
    end
  end, "shell exit")
end

-- A command that timed out runs in the shell itself (a sourced body): its
-- processes are killed, but bash would go on with the body's next command.
-- SIGRTMIN+3 makes the shell's trap return from the body (a builtin loop
-- too), so nothing of the command runs after its timeout and the shell
-- keeps its state. Outside a body (a subshell's, or the report) the trap
-- does nothing. (Not SIGUSR1: a script's own USR1 trap would replace it.)
local INTERRUPT_SIGNAL = "SIGRTMIN+3"
function Shell:interrupt()
  if self.dead then return end
  core.kill(self.pid, INTERRUPT_SIGNAL)
end

function Shell:kill(sig)
  if self.dead then return end
  core.kill(self.pid, sig or "SIGKILL")
end

return M
