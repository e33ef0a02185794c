-- A bounded log: keeps the newest `limit` bytes of one stream, and remembers
-- whether anything was dropped (and how many bytes in all, so a reader can
-- tell how far the text it saw has shifted).
--
-- The bytes live in one C buffer (core.bytes, outside the Lua heap): the
-- chunks read are garbage at once. The window's start moves forward as new
-- bytes come; the buffer is compacted (the window moved to its front) once
-- the bytes before the window pass a quarter of the limit, so it holds at
-- most 1.25 x limit.
--
-- Kept bytes also count against the runtime-wide budget for buffered output
-- (lua/moonbox/_budget.lua): a log that cannot grow within it keeps the
-- newest bytes that fit, and says truncated. release() gives them back (the
-- record was dropped, the sandbox destroyed); the text stays readable.
local core = require "moonbox.core"
local budget = require "moonbox.session.budget"

local LogBuf = {}
LogBuf.__index = LogBuf

local M = {}

-- new(limit[, budget_ceiling]): budget_ceiling is the policy's
-- limits.maxBufferedBytes (nil: the runtime's)
function M.new(limit, budget_ceiling)
  return setmetatable({ buf = nil, head = 0, size = 0, total = 0, limit = limit, truncated = false, dropped = 0,
    hold = budget.hold(budget_ceiling) }, LogBuf)
end

function LogBuf:append(data)
  local n = #data
  if n == 0 then return end
  self.total = self.total + n
  -- the window may grow by this much, if the budget lets it
  local want = math.min(self.limit, self.size + n) - self.size
  local room = self.size + (want > 0 and self.hold:take(want) or 0)
  if room <= 0 then
    self.dropped = self.total - self.size
    self.truncated = true
    return
  end
  local b = self.buf
  if not b then b = core.bytes() self.buf = b end
  if n >= room then
    -- the chunk alone fills the window: keep its tail
    b:drop(math.huge)
    b:append(n == room and data or data:sub(-room))
    self.head, self.size = 0, room
  else
    b:append(data)
    local excess = self.size + n - room
    self.head = self.head + excess
    self.size = room
    if self.head > 0 and self.head >= self.limit / 4 then
      b:drop(self.head)
      self.head = 0
    end
  end
  self.dropped = self.total - self.size
  self.truncated = self.dropped > 0
end

function LogBuf:text()
  if not self.buf or self.size == 0 then return "" end
  return self.buf:tostring(self.head + 1)
end

-- The record is gone: its bytes no longer count against the budget (the
-- text stays readable for whoever still holds the process).
function LogBuf:release()
  self.hold:release()
end

return M
