-- Where the code-interpreter kernels are on the host. They are data, not Lua
-- modules: share/kernels/ in the source tree, installed as
-- <datadir>/moonbox/kernels/, or beside the modules (moonbox/kernels/) when
-- luarocks installs only the Lua module. Found from where the modules are,
-- like the shell's prelude (session/shell.lua) and the page (server/cli.lua);
-- realpath resolves the build tree's symlinked lua/. Inside namespaces they
-- are bound read-only at sandbox/isolation.lua's KERNEL_DIR.
local fs = require "moonbox.lib.fs"

local M = {}

local kernel_dir
-- dir() -> absolute path (waits on the file system: call it in a task)
function M.dir()
  if not kernel_dir then
    local init = package.searchpath("moonbox", package.path)
    local mdir = init:match("^(.*)/[^/]*$")
    -- interpreters run in other directories: the path must be absolute
    for _, dir in ipairs { mdir .. "/kernels", mdir .. "/../../share/kernels", mdir .. "/../../../moonbox/kernels" } do
      local real = fs.realpath(dir)
      if real then kernel_dir = real break end
    end
    kernel_dir = kernel_dir or mdir .. "/kernels"
  end
  return kernel_dir
end

return M
