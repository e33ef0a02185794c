-- execStream's event queue (issue #33 point 4: out of Session:execStream):
-- output chunks queued up to a bound per stream and against the
-- runtime-wide budget (session/budget.lua) until the reader takes them, so
-- a slow or absent reader never stalls the session nor grows the runtime.
local async = require "moonbox.async"
local budget = require "moonbox.session.budget"
local util = require "moonbox.lib.util"

local M = {}

-- events(limit, ceiling, on_output) -> q:
--   q.push(ev)            an event for the reader (false: the end)
--   q.sink(stream, data)  a chunk of the command's output: onOutput gets
--                         it; the queue keeps what fits (a stream cut by
--                         the bound or the budget keeps its prefix, never
--                         a stream with holes in it)
--   q.seal()              the command is done: later chunks (the shell
--                         may keep the last command's sink until its next
--                         one) go to onOutput only, never to the queue
--   q.truncated()         whether anything was dropped
--   q.take(what)          (in a task) the next event, waiting for one;
--                         nil after the end, whose bytes go back to the
--                         budget
--   q.hold                the budget hold (a queue collected undrained
--                         gives its bytes back through it)
function M.events(limit, ceiling, on_output)
  local events, head, tail, waiter = {}, 1, 0, nil
  local queued = { stdout = 0, stderr = 0 }
  local truncated, cut = false, {}
  local hold = budget.hold(ceiling, true)
  local q = { hold = hold }

  local function push(ev)
    tail = tail + 1
    events[tail] = ev
    if waiter then local w = waiter waiter = nil w() end
  end
  q.push = push

  -- (the shell may keep the last command's sink until its next one: sealed,
  -- the sink holds neither the queue nor the hold, so an iterator dropped
  -- unread is collected and its bytes go back to the budget)
  local live = { hold = hold, push = push }
  function q.sink(stream, data)
    if on_output then async.user_callback("onOutput", on_output, stream, data) end
    local l = live
    if not l then return end
    if cut[stream] then truncated = true return end
    -- past the bound: the part that fits, then nothing more of this stream
    local room = limit - queued[stream]
    if #data > room then
      truncated, cut[stream] = true, true
      if room <= 0 then return end
      data = data:sub(1, room)
    end
    local granted = l.hold:take(#data)
    if granted < #data then
      truncated, cut[stream] = true, true
      if granted == 0 then return end
      data = data:sub(1, granted)
    end
    queued[stream] = queued[stream] + #data
    l.push { type = stream, data = data, timestamp = util.timestamp(), _size = #data }
  end

  function q.seal() live = nil end

  function q.truncated() return truncated end

  -- (a cancelled wait raises: the caller ends the command)
  function q.take(what)
    while head > tail do
      async.await(function(resume)
        waiter = resume
        return function() waiter = nil end
      end, what)
    end
    local ev = events[head]
    events[head] = nil
    head = head + 1
    if not ev then
      hold:release()
      return nil
    end
    if ev._size then
      queued[ev.type] = queued[ev.type] - ev._size
      hold:give(ev._size)
      ev._size = nil
    end
    return ev
  end

  return q
end

return M
