-- The server-wide budget for bytes held for clients (issue #29, findings 1
-- and 5): what the HTTP server has queued for its clients (responses, SSE,
-- WebSocket messages, the port proxy) plus what a response body still holds
-- in memory to send, summed over every connection of every server of this
-- runtime. `moonbox serve --max-buffered-bytes N` sets the limit (it also
-- caps moonbox.session.budget); unset, DEFAULT.
--
-- How it binds (moonbox.server.http):
--   * every connection's queue stays under HIGH_WATER plus one slice, and a
--     body larger than a slice is sent in slices as the client takes them;
--   * past the limit, a stream writes its next slice only once its own
--     queue is empty (the slow side waits; the others go on), so the total
--     passes the limit by at most one slice per connection;
--   * a response body larger than a slice that would not fit is not sent:
--     the request is answered 503 BUFFERS_FULL with Retry-After instead
--     (one larger than the whole limit goes out when nothing else is held:
--     M.admits).
local M = { used = 0, DEFAULT = 64 * 1024 * 1024 }

M.limit = M.DEFAULT

-- admits(n) -> whether a response body holding n bytes may go out now: n
-- more bytes keep the total within the limit, or nothing else is held. (A body larger than the whole limit, a
-- 60 MB file read under the 64 MiB default, was refused with "retry later"
-- for ever, however idle the server: it goes out alone. Its size is bounded
-- by the policy's own limits, maxFileBytes and maxOutputBytes.)
function M.admits(n)
  return M.used == 0 or M.used + n <= M.limit
end

function M.full()
  return M.used >= M.limit
end

-- add(n): n more bytes held (n < 0: given back)
function M.add(n)
  M.used = M.used + n
  if M.used < 0 then M.used = 0 end
end

-- hold() -> h: bytes one call reserves while it collects what it will send
-- (an /exec's kept output: moonbox.session's exec_bytes), so the output
-- kept for clients stays within the limit however many commands run at
-- once (issue #29, finding 5). Its first FREE bytes are not counted: like
-- a small reply (at most a slice per connection), they never wait for the
-- budget, so a client that fills it cannot empty everyone else's results.
--   h:take(n) -> granted (0..n)   h:release() gives back all (h.granted:
--   how many were counted)
M.FREE = 64 * 1024

local Hold = {}
Hold.__index = Hold

function M.hold()
  return setmetatable({ held = 0, free = M.FREE }, Hold)
end

function Hold:take(n)
  if n <= 0 then return 0 end
  local free = n < self.free and n or self.free
  self.free = self.free - free
  n = n - free
  local room = M.limit - M.used
  local granted = (room <= 0 and 0) or (n < room and n) or room
  M.used = M.used + granted
  self.held = self.held + granted
  return free + granted
end

function Hold:release()
  M.add(-self.held)
  self.granted, self.held = self.held, 0
end

return M
