-- The runtime's cgroup v2 primitives (docs/processes.md): its base
-- directory (<cgroup2 mount>/moonbox-<runtime pid>), cgroups made, moved
-- into, killed, waited empty (one inotify instance) and removed (on the
-- thread pool), the guard that kills the base when the runtime dies
-- without cleaning up, and the shutdown sweep. Without a writable v2 tree
-- mode() is "proc" and process/tree.lua tracks trees through /proc.
local core = require "moonbox.core"
local util = require "moonbox.lib.util"

local M = {}

local base_dir      -- <cgroup2 mount>/moonbox-<runtime pid>, or false
local mode
local pid_alive = util.pid_alive

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
    local ok, err, code = core.mkdir(dir)
    if not ok then return nil, err, code end
  end
  return dir
end

function M.move(dir, pid)
  return util.write_file(dir .. "/cgroup.procs", tostring(pid))
end

function M.kill_cgroup(dir)
  return util.write_file(dir .. "/cgroup.kill", "1")
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
