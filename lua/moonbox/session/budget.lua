-- The runtime-wide budget for buffered output (issue #18): what exec,
-- execStream and runCode keep of their output until it is handed over, and
-- what background processes keep in their logs (until their record goes),
-- summed over the whole runtime. A call takes bytes from it as chunks
-- arrive and gives them all back when its result is built; a call that
-- would pass the budget keeps only what fits and reports truncated = true,
-- so many concurrent calls producing output can never grow the runtime
-- past the budget (per call, maxOutputBytes still applies).
--
-- The ceiling is limits.maxBufferedBytes of the policy of the sandbox whose
-- call takes the bytes, compared against the runtime-wide total: with one
-- policy for every sandbox (as `moonbox serve --policy` gives) it is
-- exactly a runtime-wide budget. Unset, it is a quarter of the machine's
-- memory (MemTotal), at least 64 MiB. M.ceiling (`moonbox serve
-- --max-buffered-bytes N`) is a runtime-wide ceiling no policy goes past: it
-- replaces the default, and a policy's value only counts below it.
local util = require "moonbox.lib.util"

local M = { used = 0, ceiling = nil }

local default
function M.default()
  if not default then
    local meminfo = util.read_file("/proc/meminfo") or ""
    local kb = tonumber(meminfo:match("MemTotal:%s*(%d+)")) or (4 * 1024 * 1024)
    default = math.max(64 * 1024 * 1024, math.floor(kb * 1024 / 4))
  end
  return default
end

-- limit(policy_value) -> the ceiling a call with that policy value meets
function M.limit(policy_value)
  local c = policy_value or M.ceiling or M.default()
  if M.ceiling and M.ceiling < c then c = M.ceiling end
  return c
end

-- take(n, ceiling) -> how many of the n bytes fit (0..n), now counted as
-- used; ceiling: the caller's policy value (limits.maxBufferedBytes) or nil
function M.take(n, ceiling)
  local room = M.limit(ceiling) - M.used
  if room <= 0 then return 0 end
  local granted = n < room and n or room
  M.used = M.used + granted
  return granted
end

-- force(n): bytes already in memory that must be counted, past the ceiling
-- if need be
function M.force(n)
  M.used = M.used + n
  return n
end

-- give(n): bytes taken earlier are free again
function M.give(n)
  M.used = M.used - n
  if M.used < 0 then M.used = 0 end
end

-- hold(ceiling[, guarded]) -> h: the bytes one holder (a call, a log) keeps.
--   h:take(n) -> granted (0..n)   h:give(n)   h:release() gives back all
-- A guarded holder collected without release() gives its bytes back from a
-- finalizer (an execStream iterator dropped undrained), and takes no more.
-- Only for holders whose owner may drop them; exec, runCode and process
-- logs release theirs on every path (no finalizer per call).
local Hold = {}
Hold.__index = Hold

function M.hold(ceiling, guarded)
  local h = setmetatable({ held = 0, ceiling = ceiling, released = false }, Hold)
  if guarded then
    local guard = newproxy(true)
    getmetatable(guard).__gc = function() h:release() end
    h._guard = guard
  end
  return h
end

function Hold:take(n)
  if self.released or n <= 0 then return 0 end
  local granted = M.take(n, self.ceiling)
  self.held = self.held + granted
  return granted
end

function Hold:give(n)
  if n > self.held then n = self.held end
  if n <= 0 then return end
  self.held = self.held - n
  M.give(n)
end

function Hold:release()
  self.released = true
  M.give(self.held)
  self.held = 0
end

return M
