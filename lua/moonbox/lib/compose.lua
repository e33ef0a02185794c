-- How Session and Sandbox are put together from their parts
-- (docs/architecture.md, "Composition"). One module defines each class
-- (session/init.lua, sandbox/init.lua) and installs its parts there,
-- explicitly and in a fixed order; a part never patches a class by being
-- required. A part is a module with
--
--   part.install(class, hooks, owner)
--
-- class is the class table (Session or Sandbox), owner the module that
-- defines it (moonbox.session or moonbox.sandbox: what a part may call
-- back, such as owner.getSandbox). install adds the part's methods with
-- compose.methods and registers what it must do when things end in hooks,
-- a table of lists run in registration order:
--
--   hooks.sandbox_killing  fn(sandbox): at destroy, before the one kill of
--                          the whole sandbox (what is running then ends
--                          as killed, whichever exit is seen first)
--   hooks.session_ending   fn(sandbox, session_id | nil): before a session
--                          (deleteSession) or, with nil, every session
--                          (destroy) is destroyed: its processes end first
--   hooks.session_end      fn(session): inside Session:tear_down, before its
--                          shell is killed
--   hooks.sandbox_end      fn(sandbox): at destroy, once every session is gone
local M = {}

function M.hooks()
  return { sandbox_killing = {}, session_ending = {}, session_end = {}, sandbox_end = {} }
end

-- methods(class, methods, part): copies a part's methods into the class;
-- a name already taken is a programming error, never a silent override.
function M.methods(class, methods, part)
  for name, fn in pairs(methods) do
    if rawget(class, name) ~= nil then
      error(("%s: method %s is already defined"):format(part, name), 2)
    end
    class[name] = fn
  end
end

-- add(hooks, name, fn): registers fn on one of the lists above.
function M.add(hooks, name, fn)
  local list = hooks[name]
  if not list then error("no such hook: " .. tostring(name), 2) end
  list[#list + 1] = fn
end

-- run(hooks, name, ...): calls every fn registered on that list.
function M.run(hooks, name, ...)
  for _, fn in ipairs(hooks[name]) do fn(...) end
end

return M
