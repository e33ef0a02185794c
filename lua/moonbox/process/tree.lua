-- Killing a process tree, in one of two modes (see docs/processes.md):
--
-- "cgroup": every session gets a cgroup v2 directory; each command runs in
--   a child cgroup of it. cgroup.kill reaches every process in it, including
--   descendants that called setsid or double-forked: membership cannot be
--   left without write access to the hierarchy.
-- "proc": without a writable cgroup v2 tree, the runtime is a child
--   subreaper; a tree is the descendants of a pid found in /proc, plus the
--   orphans re-parented to the runtime. Best effort: a process that escapes
--   to another subreaper or is started between scan and kill can survive.
local core = require "moonbox.core"
local util = require "moonbox.lib.util"
local registry = require "moonbox.sandbox.registry"

local M = {}

local base_dir      -- <cgroup2 mount>/moonbox-<runtime pid>, or false
local mode

-- pid_alive(pid) -> a process with that pid runs (not a zombie)
local function pid_alive(pid)
  local stat = util.read_file("/proc/" .. pid .. "/stat")
  -- (the state follows the last ")": a command name may hold ") Z ")
  return stat ~= nil and stat:match("^.*%) (%a)") ~= "Z"
end
M.pid_alive = pid_alive

-- All pids in a cgroup and its descendants.
function M.cgroup_pids(dir, out)
  out = out or {}
  local procs = util.read_file(dir .. "/cgroup.procs") or ""
  for pid in procs:gmatch("%d+") do out[#out + 1] = tonumber(pid) end
  local names = core.readdir(dir) or {}
  for _, name in ipairs(names) do
    if util.is_dir(dir .. "/" .. name) then M.cgroup_pids(dir .. "/" .. name, out) end
  end
  return out
end

function M.populated(dir)
  local events = util.read_file(dir .. "/cgroup.events")
  return events ~= nil and events:match("populated 1") ~= nil
end

-- cgroup trees being removed on the thread pool (M.remove_later): dir ->
-- true until the removal ends
local removing = {}
local removing_count = 0

-- dir, or a directory above it, is being removed on the thread pool: its
-- own removal is that job's
local function under_removal(dir)
  if removing_count == 0 then return false end
  for top in pairs(removing) do
    if dir == top or dir:sub(1, #top + 1) == top .. "/" then return true end
  end
  return false
end

-- Remove a cgroup directory and its children (they must be empty).
function M.remove_cgroup(dir)
  if under_removal(dir) then return true end
  for _, name in ipairs(core.readdir(dir) or {}) do
    if util.is_dir(dir .. "/" .. name) then M.remove_cgroup(dir .. "/" .. name) end
  end
  return core.rmdir(dir)
end

local function try_base(mount)
  if not util.read_file(mount .. "/cgroup.procs") then return nil end
  local f = io.open(mount .. "/cgroup.kill")
  if f then f:close() end
  -- cgroup.kill exists only in non-root cgroups: probe with our own dir
  local dir = mount .. "/moonbox-" .. core.getpid()
  if not util.is_dir(dir) and not core.mkdir(dir) then return nil end
  local kill = io.open(dir .. "/cgroup.kill")
  if not kill then core.rmdir(dir) return nil end
  kill:close() -- (left to the GC, it closed at a random time: fd-counting specs flaked)
  return dir, mount
end

-- Stale directories of runtimes that died without cleaning up.
local function sweep_stale(mount)
  for _, name in ipairs(core.readdir(mount) or {}) do
    local pid = tonumber(name:match("^moonbox%-(%d+)$"))
    if pid and pid ~= core.getpid() and not pid_alive(pid) then
      util.write_file(mount .. "/" .. name .. "/cgroup.kill", "1")
      M.remove_cgroup(mount .. "/" .. name)
    end
  end
end

function M.mode()
  if mode then return mode end
  core.set_child_subreaper(true)
  for _, mount in ipairs { "/sys/fs/cgroup/unified", "/sys/fs/cgroup" } do
    local dir, m = try_base(mount)
    if dir then
      base_dir = dir
      sweep_stale(m)
      mode = "cgroup"
      return mode
    end
  end
  base_dir = false
  mode = "proc"
  return mode
end

function M.base() M.mode() return base_dir end

-- New cgroup below ours; nil in proc mode.
function M.create(name)
  if M.mode() ~= "cgroup" then return nil end
  local dir = base_dir .. "/" .. name
  if not util.is_dir(dir) then
    local ok, err = core.mkdir(dir)
    if not ok then return nil, err end
  end
  return dir
end

function M.move(dir, pid)
  return util.write_file(dir .. "/cgroup.procs", tostring(pid))
end

function M.kill_cgroup(dir)
  return util.write_file(dir .. "/cgroup.kill", "1")
end

-- ---- /proc passes (proc mode) --------------------------------------------
--
-- Every question proc mode asks (a tree's pids, the marked processes, the
-- orphans we adopted) is answered from one pass over /proc:
-- core.proc_scan walks it on the thread pool (stat, and the MOONBOX_OWNER
-- value of every process whose value starts with this runtime's pid), so
-- the loop only turns the result into tables (a pass took 5 ms on the loop
-- on a quiet machine, 50-70 ms on a busy one). Callers that ask in the same
-- tick share one pass, started after all of them asked: whatever they did
-- before (a kill) is already in it. A caller outside a task (a timer's
-- callback) takes the result in a callback (scan_then); M.scan() outside a
-- task makes the pass at once, holding the loop (rare paths only).
local OWNER_ENV = "MOONBOX_OWNER"
local pending -- {waiters = {cb...}}: the pass callers of this tick wait for

-- known: what the runtime started itself (shells, processes, kernels,
-- terminals), never waited for as if caught mid-exec: a session shell is
-- non-dumpable (src/bash/report_builtin.c), so an unprivileged runtime
-- without namespaces is refused its environment for good.
local function scan_opts()
  local known = {}
  for pid in pairs(registry.known_pids()) do
    if #known == 65536 then break end -- core.proc_scan's ceiling (the rest are only waited for)
    known[#known + 1] = pid
  end
  return { env = OWNER_ENV, prefixes = { core.getpid() .. "/" }, known = known }
end

-- The live entries (zombies and dead tasks left out) of a pass.
local function live(entries)
  local out = {}
  for _, e in ipairs(entries) do
    if e.state ~= "Z" and e.state ~= "X" then out[#out + 1] = e end
  end
  return out
end

local function deliver(pass, entries, msg, code)
  local result = entries and live(entries)
  for _, cb in ipairs(pass.waiters) do
    if not pass.dropped[cb] then
      local ok, err = pcall(cb, result, msg, code)
      if not ok then io.stderr:write("moonbox: /proc scan callback: ", tostring(err), "\n") end
    end
  end
end

local inflight -- the pass on the thread pool, if any

local function start_pass(pass)
  inflight = pass
  local function done(entries, msg, code)
    inflight = nil
    deliver(pass, entries, msg, code)
    -- the callers that asked meanwhile: their pass starts now
    if pending and pending.due then
      local nxt = pending
      pending = nil
      start_pass(nxt)
    end
  end
  local ok, msg, code = core.proc_scan(scan_opts(), function(err, entries, ecode)
    if err then done(nil, err, ecode) else done(entries) end
  end)
  if not ok then done(nil, msg, code) end
end

-- scan_then(cb) -> cancel: cb(entries) after the next pass, or cb(nil,
-- message, CODE) if it failed; cancel() drops the callback. One pass at a
-- time is on the pool: callers that ask while one runs share the next,
-- which starts when it ends (a pass takes 5-250 ms under load; the exec
-- timeout's 20 ms SIGTERM repeats queued one behind another before).
function M.scan_then(cb)
  local pass = pending
  if not pass then
    pass = { waiters = {}, dropped = {} }
    pending = pass
    local t = core.timer()
    t:start(0, 0, function()
      t:close()
      if pending ~= pass then return end
      if inflight then
        pass.due = true -- started by the running pass's end
      else
        pending = nil
        start_pass(pass)
      end
    end)
  end
  pass.waiters[#pass.waiters + 1] = cb
  return function() pass.dropped[cb] = true end
end

-- scan() -> the live processes, an array of {pid, ppid, pgid, sid, state,
-- start, owner = MOONBOX_OWNER value or nil}: awaited in a task, at once
-- outside one. A pass that fails raises INTERNAL_ERROR.
function M.scan()
  local async = require "moonbox.async"
  local entries, msg, code
  if async.in_task() then
    entries, msg, code = async.await(function(resume) return M.scan_then(resume) end, "/proc scan")
  else
    entries, msg, code = core.proc_scan(scan_opts())
    entries = entries and live(entries)
  end
  if not entries then
    require("moonbox.errors").raise("INTERNAL_ERROR", "cannot scan /proc: " .. tostring(msg), { errno = code })
  end
  return entries
end

local function children_of(scan)
  local children = {}
  for _, e in ipairs(scan) do
    local list = children[e.ppid]
    if not list then list = {} children[e.ppid] = list end
    list[#list + 1] = e.pid
  end
  return children
end

-- Descendants of pid (not pid itself), parents before children; scan: a
-- M.scan() to reuse.
function M.descendants(root_pid, scan)
  local children = children_of(scan or M.scan())
  local out, queue, head = {}, { root_pid }, 1
  while queue[head] do
    local p = queue[head]
    head = head + 1
    for _, c in ipairs(children[p] or {}) do
      out[#out + 1] = c
      queue[#queue + 1] = c
    end
  end
  return out
end

-- In proc mode a process that left its tree (setsid and double fork) is
-- attributed by the marker every sandbox process inherits in its
-- environment: MOONBOX_OWNER=<runtime pid>/<sandbox>/<session>, unique on
-- the machine. Best effort: a process that cleared its environment is not
-- found this way.
function M.owner(sandbox_id, session_id)
  return ("%d/%s/%s"):format(core.getpid(), sandbox_id, session_id or "")
end

-- pids whose MOONBOX_OWNER is value (prefix: starts with value); scan: a
-- M.scan() to reuse.
function M.pids_with_env(name, value, prefix, scan)
  assert(name == OWNER_ENV, "only MOONBOX_OWNER is scanned")
  local me, out = core.getpid(), {}
  for _, e in ipairs(scan or M.scan()) do
    local owner = e.owner
    if owner and e.pid ~= me and (owner == value or (prefix and owner:sub(1, #value) == value)) then
      out[#out + 1] = e.pid
    end
  end
  return out
end

-- The processes that re-parenting gives to the runtime or a sandbox's init
-- (pid 1 of its namespace): where an orphan of any tree goes.
local function adopters()
  local set = { [core.getpid()] = true }
  for _, sb in pairs(registry.all()) do
    if sb.init and not sb.init_dead then set[sb.init:pid()] = true end
  end
  return set
end

-- Where an orphan of sb's processes goes: the runtime (a subreaper), or
-- the sandbox's init when it has one. (An orphan of another sandbox's init
-- is that sandbox's.)
function M.adopters_of(sb)
  local set = { [core.getpid()] = true }
  -- (init_pid, not init:pid(): a destroy closes the init before the
  -- exits of its processes are all handled)
  if sb.init and not sb.init_dead and sb.init_pid then set[sb.init_pid] = true end
  return set
end

-- Orphans: children of the runtime (a subreaper) or of a sandbox's init
-- (pid 1 of its namespace, where an orphan inside goes) that the runtime
-- did not spawn itself (known: a set of pids).
function M.adopted(known, scan)
  local adopted, out = adopters(), {}
  for _, e in ipairs(scan or M.scan()) do
    if adopted[e.ppid] and not known[e.pid] then out[#out + 1] = e.pid end
  end
  return out
end

-- Whether a pass holds an orphan whose marker could not be read yet (caught
-- in execve past core.proc_scan's waits: "unsettled"): it may be anyone's.
local function unsettled_orphan(scan, adopted)
  for _, e in ipairs(scan) do
    if e.unsettled and adopted[e.ppid] then return true end
  end
  return false
end

-- Kill (SIGKILL) every process carrying the marker, a pass every 10 ms so
-- that children forked meanwhile are caught too, until a pass finds none
-- and no orphan whose marker is not readable yet (at most 20 passes); proc
-- mode only, in a task.
function M.kill_marked(name, value, sleep, prefix)
  for _ = 1, 20 do
    local scan = M.scan()
    local pids = M.pids_with_env(name, value, prefix, scan)
    if #pids == 0 and not unsettled_orphan(scan, adopters()) then return end
    M.signal_pids(pids, "SIGKILL")
    sleep(10)
  end
end

-- ---- proc mode: a background process's tree ------------------------------
--
-- Every background process starts in a session of its own (setsid), so its
-- pid is also its process group and session id, and its descendants keep
-- both unless they call setsid/setpgid. The kernel does not reuse a pid
-- while a process group or session of that id lives, so while the leader
-- runs, or while a member of its group lives, those ids name its tree
-- only. The leader's exit unpins them the moment the last member dies, so
-- after the exit a member found by its ids must also carry the process's
-- marker (MOONBOX_OWNER=<session marker>/p<n>, inherited through fork and
-- exec); one that left both the group and the session (setsid, double
-- fork) is found by the marker alone. Best effort: a process that cleared
-- its environment is lost once it has left the group and the leader is
-- gone (under namespaces it still dies with the sandbox).

-- One pass over /proc (M.scan): the live processes, reused for every
-- process a call looks at.
function M.proc_table()
  return M.scan()
end

-- The live pids of the tree of leader (its pid), marked with marker (the
-- value of MOONBOX_OWNER), as a set {pid = true}; whether one of them is
-- in the leader's process group; and whether the tree may hold more that
-- cannot be told yet: a process caught in execve (no marker to read, see
-- core.proc_scan's "unsettled") in the leader's group or session, under a
-- member, or adopted as an orphan. running: whether the leader has not been
-- reaped yet. table_: a proc_table() to reuse. adopted: the pids whose
-- orphans may be the tree's (default: the runtime and every sandbox's init).
function M.proc_tree(leader, marker, running, table_, adopted)
  table_ = table_ or M.proc_table()
  local me = core.getpid()
  local set, children, pgid_of = {}, {}, {}
  local unsettled, ids_reused = {}, false
  for _, e in ipairs(table_) do
    if e.unsettled then unsettled[#unsettled + 1] = e end
    pgid_of[e.pid] = e.pgid
    if e.pid == leader and not running and e.owner ~= marker then ids_reused = true end
    if e.pid ~= me then
      children[e.ppid] = children[e.ppid] or {}
      table.insert(children[e.ppid], e.pid)
      if e.pid == leader then
        if running then set[e.pid] = true end
      elseif e.pgid == leader or e.sid == leader then
        if running or e.owner == marker then set[e.pid] = true end
      elseif e.owner == marker then
        set[e.pid] = true
      end
    end
  end
  -- and the descendants of all these (a child that changed its ids and its
  -- environment is still a child)
  local queue = {}
  for pid in pairs(set) do queue[#queue + 1] = pid end
  while #queue > 0 do
    local pid = table.remove(queue)
    for _, c in ipairs(children[pid] or {}) do
      if not set[c] then set[c] = true queue[#queue + 1] = c end
    end
  end
  local group = false
  for pid in pairs(set) do if pgid_of[pid] == leader then group = true break end end
  -- ids_reused: the reaped leader's pid is held by a live process without
  -- its marker (not the leader itself, seen by a pass taken before its
  -- reaping), so no group or session of that id was left (the kernel frees
  -- the number only then): what has that pgid or sid now is someone
  -- else's. (pid_max is 32768 here; a bomb's chains wrap it, and another
  -- sandbox's command caught mid-exit with the old number was taken for
  -- the tree's.)
  local maybe = false
  if #unsettled > 0 then
    adopted = adopted or adopters()
    for _, e in ipairs(unsettled) do
      if adopted[e.ppid] or set[e.ppid] or (not ids_reused and (e.pgid == leader or e.sid == leader)) then
        maybe = true
        break
      end
    end
  end
  return set, group, maybe
end

-- Signal a proc-mode tree: the process group first (one kill(2) reaches
-- every member, also one forking at that instant: the kernel delivers a
-- group signal to a child being forked), then each pid found. Returns how
-- many pids were found, and whether the tree may hold more (proc_tree).
-- table_, adopted: as for proc_tree.
function M.signal_proc_tree(leader, marker, running, sig, table_, adopted)
  local set, group, maybe = M.proc_tree(leader, marker, running, table_, adopted)
  local n = 0
  for _ in pairs(set) do n = n + 1 end
  if n == 0 then return 0, maybe end
  -- the group outlives its leader while a member lives (that pins the id)
  if group then core.kill(-leader, sig) end
  for pid in pairs(set) do core.kill(pid, sig) end
  return n, maybe
end

function M.signal_pids(pids, sig)
  local n = 0
  for _, pid in ipairs(pids) do
    if core.kill(pid, sig) then n = n + 1 end
  end
  return n
end

-- ---- waiting for a cgroup to empty --------------------------------------
--
-- A SIGKILLed process leaves its cgroup when it exits, a moment after
-- cgroup.kill. The kernel reports the change of "populated" in
-- cgroup.events as a modification (inotify IN_MODIFY), so one inotify
-- instance for the whole runtime wakes every waiter as soon as its cgroup
-- is empty: no polling (destroy used to wait ~10 ms per cgroup in sleep
-- steps). Several waiters on one cgroup share its watch (inotify gives the
-- same wd for the same inode); the instance is closed with the last waiter,
-- so no handle is left active between teardowns (an idle loop still ends,
-- and a deadlock is still reported).
local watcher          -- core.fs_event() while someone waits, else nil
local waiting = {}     -- wd -> { [callback] = true }

local function wake(set)
  local cbs = {}
  for cb in pairs(set) do cbs[#cbs + 1] = cb end
  for _, cb in ipairs(cbs) do cb() end
end

local function on_watch_event(err, _, ev)
  if err then
    -- reading failed: wake everyone (each re-checks; the timeout still holds)
    for _, set in pairs(waiting) do wake(set) end
    return
  end
  local set = ev and waiting[ev.wd]
  if set then wake(set) end
end

local function watch(path)
  if not watcher then
    local w = core.fs_event()
    local wd = w:start(path, on_watch_event)
    if not wd then w:close() return nil end
    watcher = w
    return wd
  end
  return (watcher:add(path))
end

local function unwatch(wd, set)
  if waiting[wd] ~= set or next(set) ~= nil then return end
  waiting[wd] = nil
  if next(waiting) == nil then
    watcher:close()
    watcher = nil
  else
    watcher:remove(wd) -- fails harmlessly when the directory is already gone
  end
end

-- Wait (in a task) until the cgroup at dir is empty or timeout_ms passed;
-- true when it is empty. Outside a task, or when inotify cannot watch it,
-- it polls in 10 ms steps with sleep.
function M.wait_empty(dir, timeout_ms, sleep)
  if not M.populated(dir) then return true end
  local async = require "moonbox.async"
  local wd = async.in_task() and watch(dir .. "/cgroup.events")
  if not wd then
    for _ = 1, math.ceil(timeout_ms / 10) do
      sleep(10)
      if not M.populated(dir) then return true end
    end
    return false
  end
  local set = waiting[wd]
  if not set then set = {} waiting[wd] = set end
  local cb
  local ok, err = pcall(async.await, function(resume)
    local timer = core.timer()
    local done = false
    local function stop()
      done = true
      set[cb] = nil
      if not timer:is_closing() then timer:close() end
    end
    local function finish()
      if done then return end
      stop()
      resume()
    end
    cb = function() if not M.populated(dir) then finish() end end
    set[cb] = true
    timer:start(timeout_ms, 0, finish)
    -- it may have emptied between the first look and the watch
    if not M.populated(dir) then finish() end
    return stop
  end, "cgroup empty")
  set[cb] = nil
  unwatch(wd, set)
  if not ok then error(err, 0) end
  return not M.populated(dir)
end

-- Remove a killed cgroup once its last process is gone (waited for through
-- inotify, at most ~2 s), only on teardown paths, never for a result.
function M.remove_when_empty(dir, sleep)
  if under_removal(dir) then return true end
  M.wait_empty(dir, 2000, sleep)
  return M.remove_cgroup(dir)
end

-- Remove an empty cgroup tree (its processes are gone) on the thread pool:
-- each rmdir takes the kernel's cgroup_mutex and takes the cgroup's
-- controllers offline, most of a millisecond for a sandbox's few, which
-- destroy's caller need not wait for. Until it ends, removals of the
-- cgroups under dir are this job's (no-ops), and M.fresh_name never hands
-- out dir's name again. A job that fails (a process got in after all) falls
-- back to the synchronous removal.
function M.remove_later(dir)
  if M.mode() ~= "cgroup" or under_removal(dir) then return end
  removing[dir] = true
  removing_count = removing_count + 1
  local function done(err)
    removing[dir] = nil
    removing_count = removing_count - 1
    if err then M.remove_cgroup(dir) end
  end
  if not core.rmdir_tree(dir, done) then done(true) end
end

-- A cgroup name under the base for `name` that no removal still holds:
-- name itself, or name.<n> (a sandbox id never holds a dot) while an
-- earlier cgroup of that name is being removed.
local fresh_seq = 0
function M.fresh_name(name)
  if M.mode() ~= "cgroup" then return name end
  local candidate = name
  while removing[base_dir .. "/" .. candidate] do
    fresh_seq = fresh_seq + 1
    candidate = name .. "." .. fresh_seq
  end
  return candidate
end

-- Wait (up to limit_ms) for the thread-pool removals to end (in a task:
-- their callbacks come from the loop).
function M.await_removals(sleep, limit_ms)
  if removing_count > 0 and not require("moonbox.async").in_task() then return false end
  for _ = 1, math.ceil((limit_ms or 2000) / 5) do
    if removing_count == 0 then return true end
    sleep(5)
  end
  return removing_count == 0
end

-- A runtime ended by SIGKILL (or a crash) runs no cleanup. A namespaced
-- sandbox dies with its init (PR_SET_PDEATHSIG); an unisolated one's
-- commands that left their shell's session would live on. So while an
-- unisolated sandbox exists, a guard runs: a shell outside our cgroups
-- reading a pipe only the runtime holds. At its EOF without a line (the
-- runtime gone, however) it kills everything under our base cgroup. When
-- the last such sandbox is destroyed, the runtime writes it a line (stand
-- down: the namespaced sandboxes under the base live on), closes the pipe
-- and awaits it.
local guard, guard_users = nil, 0
function M.guard_base()
  if M.mode() ~= "cgroup" then return true end
  if not guard then
    local g = { waiters = {} }
    local proc, pipes, code = core.spawn {
      args = { "moonbox-guard", "-c", 'read -r _ || echo 1 > "$0/cgroup.kill"', base_dir },
      file = "/bin/sh", env = { "PATH=/usr/bin:/bin" }, cwd = "/",
      stdio = { [0] = "in" }, setsid = true,
      on_exit = function()
        g.exited = true
        if guard == g then guard = nil end
        for _, w in ipairs(g.waiters) do w() end
      end,
    }
    if not proc then return nil, pipes, code end
    g.pipe = pipes[0]
    guard = g
  end
  guard_users = guard_users + 1
  return true
end

local function close_guard(g)
  if g.pipe then
    local pipe = g.pipe
    g.pipe = nil
    -- (closed once the line is out: a close drops queued writes)
    pipe:write("stand down\n", function() if not pipe:is_closing() then pipe:close() end end)
  end
end

-- unguard(): one unisolated sandbox fewer; after the last, the guard is
-- closed and (in a task) awaited, so that no process of ours outlives it.
function M.unguard()
  if guard_users == 0 then return end
  guard_users = guard_users - 1
  local g = guard
  if guard_users > 0 or not g then return end
  guard = nil
  close_guard(g)
  local async = require "moonbox.async"
  if g.exited or not async.in_task() then return end
  async.await(function(resume)
    local t = core.timer()
    local function stop() if not t:is_closing() then t:close() end end
    g.waiters[#g.waiters + 1] = function() stop() resume() end
    t:start(2000, 0, function() stop() resume() end)
    return stop
  end, "runtime exit guard")
end

-- Shutdown: kill and remove everything under our base cgroup. The wait
-- ends when it empties (at most 10 s, for a slow machine); what still runs
-- then is named on stderr, never left silently.
function M.cleanup(sleep)
  if guard then close_guard(guard) end
  if mode == "cgroup" and base_dir then
    M.await_removals(sleep)
    M.kill_cgroup(base_dir)
    if not M.wait_empty(base_dir, 2000, sleep) then
      M.kill_cgroup(base_dir) -- (one started into it after the kill)
      if not M.wait_empty(base_dir, 8000, sleep) then
        local pids = M.cgroup_pids(base_dir)
        if #pids > 0 then
          io.stderr:write(("moonbox: exit: processes of its sandboxes (pid %s) still run 10 s after SIGKILL\n")
            :format(table.concat(pids, ", ")))
        end
      end
    end
    M.remove_cgroup(base_dir)
  end
end

return M
