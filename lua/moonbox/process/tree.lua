-- Killing a process tree, in one of two modes (see docs/processes.md):
--
-- "cgroup": every session gets a cgroup v2 directory; each command runs in
--   a child cgroup of it. cgroup.kill reaches every process in it, including
--   descendants that called setsid or double-forked: membership cannot be
--   left without write access to the hierarchy. The cgroup primitives are
--   process/cgroup.lua's.
-- "proc": without a writable cgroup v2 tree, the runtime is a child
--   subreaper; a tree is the descendants of a pid found in /proc, plus the
--   orphans re-parented to the runtime. Best effort: a process that escapes
--   to another subreaper or is started between scan and kill can survive.
local core = require "moonbox.core"
local util = require "moonbox.lib.util"
local registry = require "moonbox.sandbox.registry"
local cgroup = require "moonbox.process.cgroup"

local M = {}

-- which of the two modes: "cgroup" where a writable cgroup v2 base exists
M.mode = cgroup.mode

M.pid_alive = util.pid_alive

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

return M
