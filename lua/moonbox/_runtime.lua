-- What the moonbox executable and libmoonbox call: run a main chunk as a task,
-- and at shutdown let registered hooks (sandboxes) kill what they started.
local async = require "moonbox.async"
local errors = require "moonbox.errors"

local M = { last_error = nil }
local exit_hooks = {}

function M.at_exit(fn)
  exit_hooks[#exit_hooks + 1] = fn
end

-- Called once by the host before the Lua state closes.
function M.shutdown()
  local hooks = exit_hooks
  exit_hooks = {}
  if #hooks == 0 then return end
  local ok, err = pcall(async.run, function()
    for i = #hooks, 1, -1 do
      local hook_ok, hook_err = pcall(hooks[i])
      if not hook_ok then io.stderr:write("moonbox: shutdown: ", errors.format(hook_err), "\n") end
    end
  end)
  if not ok then io.stderr:write("moonbox: shutdown: ", errors.format(err), "\n") end
end

-- main(chunk, drive, ...) -> ok, message. With drive (the runtime owns the
-- loop) run to completion; otherwise start the task and let the host's loop
-- drive it, recording an error in M.last_error.
function M.main(chunk, drive, ...)
  if drive then
    local ok, err = xpcall(async.run, function(e)
      if errors.is_error(e) or type(e) ~= "string" then return e end
      -- a task's error already carries the task's traceback: the runner's own adds nothing
      if e:find("\nstack traceback:\n", 1, true) then return e end
      return debug.traceback(e, 2)
    end, chunk, ...)
    if ok then return true end
    return false, errors.format(err)
  end
  local task = async.spawn(chunk, ...)
  async.spawn(function()
    local ok, err = pcall(task.wait, task)
    if not ok then M.last_error = errors.format(err) end
  end)
  return true
end

return M
