-- A FIFO lock: calls on one session run one at a time, in arrival order.
local async = require "moonbox.async"
local errors = require "moonbox.errors"

local Queue = {}
Queue.__index = Queue

local M = {}

function M.new() return setmetatable({ busy = false, waiters = {} }, Queue) end

function Queue:acquire()
  local me = async.current()
  if not self.busy then
    self.busy, self.holder = true, me
    return
  end
  -- the task that holds the lock asking for it again (a policy hook that
  -- runs inside a call, calling its own session) would wait for itself
  if self.holder == me then
    errors.raise("DEADLOCK", "a call on this session from inside one of its own calls (a policy hook calling " ..
      "its session?) would wait for itself for ever; use another session", {})
  end
  async.await(function(resume)
    local entry = { resume = resume }
    table.insert(self.waiters, entry)
    return function()
      for i, e in ipairs(self.waiters) do
        if e == entry then table.remove(self.waiters, i) break end
      end
    end
  end, "session queue")
  self.holder = me -- handed the lock by release()
end

-- Called by the holder (inside Queue:run): keep the lock when run returns;
-- the release is the caller's, later, from another task.
function Queue:hand_off()
  self.handed_off = true
  self.holder = nil -- whoever finishes the work, later, is not known here
end

-- Hand the lock to the next waiter (it stays busy) or free it.
function Queue:release()
  self.holder = nil
  local next_entry = table.remove(self.waiters, 1)
  if next_entry then next_entry.resume() else self.busy = false end
end

-- Run fn(...) holding the lock; the lock is released whatever happens,
-- unless fn handed it off (hand_off) to finish its work in another task.
-- Outside a task nothing is queued: NOT_IN_TASK.
local function ran(self, ok, ...)
  if self.handed_off then self.handed_off = nil else self:release() end
  if not ok then error((...), 0) end
  return ...
end

function Queue:run(fn, ...)
  async.check_task("this call")
  self:acquire()
  return ran(self, pcall(fn, ...))
end

return M
