-- Server-Sent Events for the HTTP API: one `data: {json}` record per event,
-- the same event tables the Lua iterators yield. pump() copies an iterator
-- to the client until it ends or the client goes away; a client that goes
-- away calls the iterator's cancel (what that means is the iterator's:
-- watch and log streams stop, execStream kills the command's tree).
local moonbox = require "moonbox"
local json = require "moonbox.server.api_json"
local api_errors = require "moonbox.server.api_errors"

local M = {}

M.HEADERS = {
  ["content-type"] = "text/event-stream; charset=utf-8",
  ["cache-control"] = "no-cache",
  ["x-accel-buffering"] = "no",
}

function M.format(ev)
  return "data: " .. json.encode(ev) .. "\n\n"
end

-- pump(res, iter, shape?) -> true if the stream ran to its end, false if the
-- client went away. shape(ev) may rewrite each event before it is sent.
-- After a cancel the iterator is drained to its end (so an execStream's
-- command is gone before this returns), without writing.
function M.pump(res, iter, shape)
  local gone = false
  local function cancel()
    if gone then return end
    gone = true
    if iter.cancel then iter.cancel() end
  end
  res:onClose(cancel)
  res:start(200, M.HEADERS)
  if res.closed then cancel() end
  while true do
    local ok, ev = pcall(iter)
    if not ok then
      -- an iterator that fails ends the stream with an error event
      if not gone then
        local _, body = api_errors.body(ev)
        res:write(M.format { type = "error", error = body })
      end
      break
    end
    if ev == nil then break end
    if not gone then
      if ev.type == "error" and type(ev.error) ~= "table" then
        -- a bug's message (a string with our file paths) is not the client's
        local _, body = api_errors.body(ev.error)
        ev.error = body
      end
      if shape then ev = shape(ev) end
      if not res:write(M.format(ev)) then cancel() end
    end
  end
  if not gone then res:finish() end
  return not gone
end

-- while_connected(res, fn) -> fn's results: fn runs as a task of its own,
-- cancelled if the client goes away (a wait nobody waits for any more; an
-- exec whose result nobody will read: its command's tree is killed and the
-- session takes its next call, as after any cancelled exec).
function M.while_connected(res, fn)
  local task = moonbox.spawn(fn)
  res:onClose(function() task:cancel() end)
  if res.closed then task:cancel() end
  return task:wait()
end

return M
