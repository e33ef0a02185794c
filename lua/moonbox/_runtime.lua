-- What the moonbox executable and libmoonbox call: run a main chunk as a task,
-- and at shutdown let registered hooks (sandboxes) kill what they started.
local async = require "moonbox.async"
local errors = require "moonbox.errors"

local M = { last_error = nil }
local exit_hooks = {}

function M.at_exit(fn)
  exit_hooks[#exit_hooks + 1] = fn
end

local function run_hooks()
  local hooks = exit_hooks
  exit_hooks = {}
  for i = #hooks, 1, -1 do
    local hook_ok, hook_err = pcall(hooks[i])
    if not hook_ok then io.stderr:write("moonbox: shutdown: ", errors.format(hook_err), "\n") end
  end
end

-- Called once by the host before the Lua state closes.
function M.shutdown()
  if #exit_hooks == 0 then return end
  local ok, err = pcall(async.run, run_hooks)
  if not ok then io.stderr:write("moonbox: shutdown: ", errors.format(err), "\n") end
end

M.run_exit_hooks = run_hooks

-- on_signal(name, fn): the main chunk takes over one of the signals below
-- (`moonbox serve`'s graceful SIGTERM): fn runs as a task instead of the
-- immediate stop; the other signals still stop at once.
local signal_overrides = {}
function M.on_signal(name, fn)
  signal_overrides[name] = fn
end

-- SIGINT, SIGTERM, SIGHUP to the runtime: kill every sandbox's processes
-- first, then exit 128 + signal. The watchers do not keep the loop alive.
local watchers = {} -- name -> watcher
local function close_watchers()
  for name, w in pairs(watchers) do
    w:close()
    watchers[name] = nil
  end
end
local function watch_signals(names)
  local core = require "moonbox.core"
  for _, name in ipairs(names or { "SIGINT", "SIGTERM", "SIGHUP" }) do
    local w = core.signal()
    w:start(name, function(signum)
      local override = signal_overrides[name]
      if override then
        signal_overrides[name] = nil -- a second one stops at once
        async.spawn(override)
        return
      end
      close_watchers()
      io.stderr:write(("moonbox: %s: stopping every sandbox\n"):format(name))
      async.spawn(function()
        run_hooks()
        os.exit(128 + signum)
      end)
    end)
    w:unref()
    watchers[name] = w
  end
end

-- release_signal(name): the runtime stops handling it (the REPL takes
-- SIGINT to cancel a line instead of ending everything).
function M.release_signal(name)
  local w = watchers[name]
  if w then
    watchers[name] = nil
    w:close()
    return true
  end
  return false
end

-- reclaim_signal(name): handled by the runtime again (after release_signal)
function M.reclaim_signal(name)
  if not watchers[name] then watch_signals { name } end
end

-- main(chunk, drive, ...) -> ok, message. With drive (the runtime owns the
-- loop) run to completion; otherwise start the task and let the host's loop
-- drive it, recording an error in M.last_error.
function M.main(chunk, drive, ...)
  if drive then
    watch_signals()
    local ok, err = xpcall(async.run, function(e)
      if errors.is_error(e) then return e end
      if type(e) == "string" or type(e) == "number" then
        -- a task's: where the task raised it (the runner's own adds nothing)
        local where = async.traceback_of(e)
        if where then return tostring(e) .. "\n" .. where end
      end
      if type(e) ~= "string" then
        -- an error value of the script's own: its text (as __tostring or a
        -- {code, message} table gives it), then where its task raised it
        local where = async.traceback_of(e)
        local mt = getmetatable(e)
        if type(e) == "table" and not (mt and mt.__tostring) and e.message ~= nil then
          e = (e.code ~= nil and tostring(e.code) .. ": " or "") .. tostring(e.message)
        elseif mt and mt.__tostring then
          e = tostring(e)
        else
          e = ("(error object is a %s value)"):format(type(e))
        end
        if where then return e .. "\n" .. where end
      end
      -- a task's error already carries the task's traceback: the runner's own adds nothing
      if e:find("\nstack traceback:\n", 1, true) then return e end
      return debug.traceback(e, 2)
    end, chunk, ...)
    close_watchers()
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
