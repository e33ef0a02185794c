-- The public module: local moonbox = require "moonbox"
local async = require "moonbox.async"
local core = require "moonbox.core"
local errors = require "moonbox.errors"

local moonbox = {
  VERSION = core.version, -- the project version (CMakeLists.txt), compiled into the core
  run = async.run,
  spawn = async.spawn,
  all = async.all,
  sleep = async.sleep,
  timeout = async.timeout,
  errors = errors,
}

-- Sandbox and Session are complete once moonbox.sandbox is loaded: each is
-- defined in one module that installs its parts (lib/compose.lua).
local sandbox = require "moonbox.sandbox"
local backup = require "moonbox.files.backup"
require("moonbox._runtime").at_exit(sandbox.shutdown)

-- getSandbox(id, opts) -> Sandbox; the same id returns the same object.
-- With {from = backup} it starts a new sandbox from a backup (files/backup.lua).
moonbox.getSandbox = backup.getSandbox

-- prewarm(n | true | false) (beyond): keep a pool of up to n (at most 16;
-- true: 1) sandboxes with namespaces built ahead, each claimed by a
-- getSandbox with the default policy; false or 0 drops them.
moonbox.prewarm = sandbox.prewarm

-- shellBuiltins{spawn = bool, load = bool} (beyond): whether session shells
-- use their loadable builtins (docs/sessions.md); returns the settings.
moonbox.shellBuiltins = require("moonbox.session.shell").builtins

-- listBackups(), deleteBackup(id) (beyond the seed's Lua surface): the
-- backups stored under the runtime's home (lua/moonbox/files/backup.lua)
moonbox.listBackups = backup.listBackups
moonbox.deleteBackup = backup.deleteBackup

-- images.pull/list/remove/get (beyond): the image store under the
-- runtime's home (lua/moonbox/images/, docs/images.md)
moonbox.images = require "moonbox.images"

-- Policy presets as data: moonbox.policies.strict, moonbox.policies.dev
moonbox.policies = setmetatable({}, {
  __index = function(_, name) return require("moonbox.policies." .. name) end,
})

-- For a program with a loop of its own that requires moonbox from plain
-- LuaJIT (docs/embedding.md). Tasks started with moonbox.spawn make progress
-- only while the runtime's loop runs: moonbox.run(fn) runs it until fn is
-- done; step() runs it once without blocking and returns the number of tasks
-- still running; backend() gives what to wait on between two steps: the
-- loop's fd (readable when there is work) and the ms until its next timer
-- (-1: none). step() is for the outside of tasks (a task already runs on
-- the loop) and not for libmoonbox hosts, whose own uv_run drives the loop.
function moonbox.step()
  if async.in_task() then
    errors.raise("VALIDATION_FAILED", "moonbox.step() runs the loop: call it from outside tasks")
  end
  core.run("nowait")
  return async.pending()
end

function moonbox.backend()
  return core.backend_fd(), core.backend_timeout()
end

moonbox.pending = async.pending

function moonbox.versions()
  local v = core.versions()
  v.moonbox = moonbox.VERSION
  v.luajit = jit and jit.version or _VERSION
  return v
end

return moonbox
