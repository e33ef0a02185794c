-- Tasks on coroutines. One primitive, await(register), underlies every
-- waiting call: register(resume) starts an operation whose callback calls
-- resume(...), and may return a cleanup function that undoes the operation
-- if the task is cancelled first. Code in a task reads top to bottom.
local core = require "moonbox.core"
local errors = require "moonbox.errors"

local M = {}

local current = nil          -- the task whose coroutine is running
local live = 0               -- tasks started and not finished
local live_tasks = {}        -- those tasks (a set), to abandon on deadlock
local unobserved = {}        -- failed tasks nobody has waited for, in order
local CANCEL = setmetatable({}, { __tostring = function() return "cancel" end })

local pack = function(...) return { n = select("#", ...), ... } end
local unpack = unpack -- LuaJIT

local Task = {}
Task.__index = Task

-- error value (a table of the script's own) -> where its task raised it,
-- for the CLI's report of an uncaught error; the value stays as raised.
-- A string or number cannot carry it: the last 16 distinct values are kept
-- by value (a value raised again keeps where it was first raised, as a
-- table does).
local tracebacks = setmetatable({}, { __mode = "k" })
local by_value, by_value_order, BY_VALUE_MAX = {}, {}, 16
local function keep_traceback(err, tb)
  if type(err) == "table" then tracebacks[err] = tb return end
  if by_value[err] == nil then
    by_value_order[#by_value_order + 1] = err
    if #by_value_order > BY_VALUE_MAX then by_value[table.remove(by_value_order, 1)] = nil end
  end
  by_value[err] = tb
end
function M.traceback_of(err)
  if type(err) == "table" then return tracebacks[err] end
  return by_value[err]
end

local finished = 0 -- tasks finished so far: the order all() reports errors in

local function finish(task, ok, results)
  task.done, task.ok = true, ok
  finished = finished + 1
  task.finish_seq = finished
  live = live - 1
  live_tasks[task] = nil
  if ok then
    task.results = results
  else
    local err = results[2]
    if errors.is_error(err) then
      -- (debug.traceback returns a nil message as it is: pass "" and drop its "\n")
      if not err.traceback then err.traceback = debug.traceback(task.co, "", 0):sub(2) end
    elseif type(err) == "string" or type(err) == "number" then
      -- re-raised as it was raised (moonbox.run, task:wait, all)
      if M.traceback_of(err) == nil then keep_traceback(err, debug.traceback(task.co, "", 0):sub(2)) end
    elseif type(err) == "table" and not tracebacks[err] then
      keep_traceback(err, debug.traceback(task.co, "", 0):sub(2))
    end -- any other value (a table with its own code, ...) is kept as raised
    task.err = err
    if #task.waiters == 0 and not (errors.is_error(err) and err.code == "CANCELLED") then
      unobserved[#unobserved + 1] = task
    end
  end
  local waiters = task.waiters
  task.waiters = {}
  for _, w in ipairs(waiters) do w(task) end
end

-- (the results packed only when the task has ended: a table per step is
-- garbage on every wait, issue #32)
local function stepped(task, prev, ...)
  current = prev
  if coroutine.status(task.co) == "dead" then
    finish(task, (...), pack(...))
  end
end

local function step(task, ...)
  local prev = current
  current = task
  stepped(task, prev, coroutine.resume(task.co, ...))
end

-- Start fn(...) as a task; it runs at once until its first wait.
function M.spawn(fn, ...)
  if type(fn) ~= "function" then
    errors.raise("VALIDATION_FAILED", "spawn: expected a function, got " .. type(fn), { field = "fn" })
  end
  local task = setmetatable({ co = coroutine.create(fn), waiters = {}, done = false }, Task)
  live = live + 1
  live_tasks[task] = true
  step(task, ...)
  return task
end

local function not_in_task(what)
  errors.raise("NOT_IN_TASK", (what or "this call") ..
    " waits, so it must run inside a task: wrap the code in moonbox.run(function() ... end)")
end

local function woken(state, ...)
  if ... == CANCEL then
    state.done = true
    errors.raise("CANCELLED", "task was cancelled")
  end
  return ...
end

-- await(register[, what[, arg]]) -> whatever the operation passed to
-- resume. register(resume, arg); its cleanup(arg). (arg: what register
-- works on, so a caller on a hot path needs no closure of its own.)
function M.await(register, what, arg)
  local task = current
  if not task or coroutine.running() ~= task.co then not_in_task(what) end
  if task.cancelled then errors.raise("CANCELLED", "task was cancelled") end
  local state = { done = false, waiting = false }
  local function resume(...)
    if state.done then return end
    state.done = true
    task.cleanup = nil
    if state.waiting then step(task, ...) else state.results = pack(...) end
  end
  local cleanup = register(resume, arg)
  if state.done then return unpack(state.results, 1, state.results.n) end
  -- a cleanup that calls resume (cancellation) must not wake the task too
  task.cleanup = cleanup and function()
    state.done = true
    return cleanup(arg)
  end
  state.waiting = true
  return woken(state, coroutine.yield())
end

-- check_task(what): raise NOT_IN_TASK unless called in a task (for calls
-- that must not start anything they cannot wait for).
function M.check_task(what)
  if not (current and coroutine.running() == current.co) then not_in_task(what) end
end

function M.in_task()
  return current ~= nil and coroutine.running() == current.co
end

function M.current() return current end

-- task:wait() -> the task's results, or re-raises its error.
function Task:wait()
  if not self.done then
    M.await(function(resume)
      local function waiter() resume() end
      self.waiters[#self.waiters + 1] = waiter
      return function()
        for i, w in ipairs(self.waiters) do
          if w == waiter then table.remove(self.waiters, i) break end
        end
      end
    end, "task:wait()")
  end
  for i, t in ipairs(unobserved) do
    if t == self then table.remove(unobserved, i) break end
  end
  if not self.ok then error(self.err, 0) end
  return unpack(self.results, 2, self.results.n)
end

-- Cancel a waiting task: its pending operation is cleaned up and the wait
-- raises CANCELLED inside it, so its own cleanup code (pcall) still runs.
function Task:cancel()
  if self.done or self.cancelled then return end
  self.cancelled = true
  if self == current then return end
  local cleanup = self.cleanup
  self.cleanup = nil
  if cleanup then cleanup() end
  step(self, CANCEL)
end

function Task:status()
  if not self.done then return self.cancelled and "cancelling" or "running" end
  return self.ok and "ok" or "error"
end

function M.sleep(ms)
  if type(ms) ~= "number" or ms < 0 or ms ~= ms or ms == math.huge then
    errors.raise("VALIDATION_FAILED", "sleep: ms must be a finite number >= 0", { field = "ms" })
  end
  M.await(function(resume)
    local timer = core.timer()
    timer:start(ms, 0, function() timer:close() resume() end)
    return function() timer:close() end
  end, "moonbox.sleep")
end

-- all(f1, f2, ...) or all{f1, f2}: run concurrently; first results in order;
-- the first error is raised once every function has settled.
function M.all(...)
  local n = select("#", ...)
  local fns = { ... }
  if n == 1 and type(fns[1]) == "table" then
    fns = fns[1]
    n = #fns
  end
  -- every argument checked before any runs (a nil had ended the list)
  for i = 1, n do
    if type(fns[i]) ~= "function" then
      errors.raise("VALIDATION_FAILED", ("all: function %d: expected a function, got %s"):format(i, type(fns[i])),
        { field = "functions[" .. i .. "]" })
    end
  end
  M.check_task("moonbox.all")
  local tasks = {}
  for i = 1, n do tasks[i] = M.spawn(fns[i]) end
  -- (the first error in time, as Promise.all rejects with)
  local results, first_err, first_seq = {}, nil, math.huge
  for i, t in ipairs(tasks) do
    local ok, r = pcall(t.wait, t)
    local seq = t.finish_seq or math.huge
    if ok then results[i] = r elseif first_err == nil or seq < first_seq then first_err, first_seq = r, seq end
    if not ok and not t.done then
      -- the wait itself failed: we were cancelled, and so is the rest
      for _, u in ipairs(tasks) do u:cancel() end
    end
  end
  if first_err ~= nil then error(first_err, 0) end
  return results
end

-- timeout(ms, fn, ...): fn's results, or TIMEOUT after ms (fn is cancelled).
function M.timeout(ms, fn, ...)
  if type(ms) ~= "number" or ms < 0 or ms ~= ms then
    errors.raise("VALIDATION_FAILED", "timeout: ms must be a number >= 0")
  end
  local task = M.spawn(fn, ...)
  if not task.done then
    local timer = core.timer()
    local fired = false
    timer:start(ms, 0, function() fired = true task:cancel() end)
    local ok, err = pcall(task.wait, task)
    timer:close()
    if not ok and not task.done then task:cancel() end -- we were cancelled ourselves
    if fired then -- fn was cancelled: even if it caught that and returned, it is late
      errors.raise("TIMEOUT", ("timed out after %d ms"):format(ms), { timeout = ms })
    end
    if not ok then error(err, 0) end
  end
  return task:wait()
end

function M.pending() return live end

-- Tracebacks of every unfinished task, for diagnosing a hang.
function M.dump_tasks()
  local out = {}
  for t in pairs(live_tasks) do out[#out + 1] = debug.traceback(t.co, "task " .. tostring(t), 0) end
  return out
end

-- Errors raised inside core callbacks (outside any task) are bugs; keep them
-- so the run fails instead of printing from deep inside C.
local callback_errors = {}
core.set_error_handler(function(err)
  io.stderr:write("moonbox: error in callback: ", errors.format(err), "\n")
  callback_errors[#callback_errors + 1] = err
end)

-- user_callback(where, fn, ...) -> ok: a script's callback (onOutput,
-- onExit, onData, ...) run protected, so that what the runtime does after
-- it (keeping the chunk, telling streams) still happens. Its error is
-- printed with where it was raised and, like an uncaught task error,
-- fails the run (moonbox.run raises the first once everything finished).
local function note_traceback(e)
  if not errors.is_error(e) and M.traceback_of(e) == nil and (type(e) == "string" or type(e) == "number"
    or type(e) == "table") then
    keep_traceback(e, debug.traceback("", 2):sub(2))
  end
  return e
end
function M.user_callback(where, fn, ...)
  local ok, err = xpcall(fn, note_traceback, ...)
  if not ok then
    local where_raised = not errors.is_error(err) and M.traceback_of(err)
    io.stderr:write("moonbox: error in ", where, ": ", errors.format(err), where_raised and ("\n" .. where_raised)
      or "", "\n")
    callback_errors[#callback_errors + 1] = err
  end
  return ok
end

-- Nothing can wake the waiting tasks: finish each with a DEADLOCK error
-- (its traceback shows where it waits) after running its pending cleanup,
-- so that the runtime is usable again.
local function abandon_all()
  local stuck = {}
  for t in pairs(live_tasks) do stuck[#stuck + 1] = t end
  for _, t in ipairs(stuck) do
    if not t.done then
      local cleanup = t.cleanup
      t.cleanup = nil
      if cleanup then pcall(cleanup) end
      finish(t, false, { false, errors.new("DEADLOCK", "this task waits for something that can never happen") })
    end
  end
end

-- Drive the loop until every task has finished.
function M.drive()
  while live > 0 do
    local alive = core.run("once")
    if not alive and live > 0 then
      local n = live
      abandon_all()
      errors.raise("DEADLOCK", ("%d task(s) wait for something that can never happen"):format(n))
    end
  end
end

-- run(fn, ...): fn's results, or its error re-raised.
function M.run(fn, ...)
  if type(fn) ~= "function" then
    errors.raise("VALIDATION_FAILED", "run: expected a function, got " .. type(fn), { field = "fn" })
  end
  if M.in_task() then return M.spawn(fn, ...):wait() end
  local task = M.spawn(fn, ...)
  local drove, drive_err = pcall(M.drive)
  -- every task has finished: what is left to report belongs to this run,
  -- and must not leak into the next one
  local failed, cb_errs = unobserved, callback_errors
  unobserved, callback_errors = {}, {}
  local ok, err = pcall(task.wait, task)
  if not ok then error(err, 0) end
  if not drove then error(drive_err, 0) end
  for _, t in ipairs(failed) do
    if t ~= task then error(t.err, 0) end
  end
  if #cb_errs > 0 then error(cb_errs[1], 0) end
  return task:wait()
end

return M
