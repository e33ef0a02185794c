-- The runtime-wide budget for buffered output (issue #18): what exec keeps
-- of its commands' output until the result is handed over, summed over
-- every call in flight in the runtime. A call takes bytes from it as chunks
-- arrive and gives them all back when its result is built; a call that
-- would pass the budget keeps only what fits and reports truncated = true,
-- so many concurrent calls producing output can never grow the runtime
-- past the budget (per call, maxOutputBytes still applies).
--
-- The ceiling is limits.maxBufferedBytes of the policy of the sandbox whose
-- call takes the bytes, compared against the runtime-wide total: with one
-- policy for every sandbox (as `moonbox serve --policy` gives) it is
-- exactly a runtime-wide budget. Unset, it is a quarter of the machine's
-- memory (MemTotal), at least 64 MiB.
local util = require "moonbox.lib.util"

local M = { used = 0 }

local default
function M.default()
  if not default then
    local meminfo = util.read_file("/proc/meminfo") or ""
    local kb = tonumber(meminfo:match("MemTotal:%s*(%d+)")) or (4 * 1024 * 1024)
    default = math.max(64 * 1024 * 1024, math.floor(kb * 1024 / 4))
  end
  return default
end

-- take(n, ceiling) -> how many of the n bytes fit (0..n), now counted as used
function M.take(n, ceiling)
  local room = (ceiling or M.default()) - M.used
  if room <= 0 then return 0 end
  local granted = n < room and n or room
  M.used = M.used + granted
  return granted
end

-- give(n): bytes taken earlier are free again
function M.give(n)
  M.used = M.used - n
  if M.used < 0 then M.used = 0 end
end

return M
