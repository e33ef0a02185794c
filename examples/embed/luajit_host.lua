-- moonbox from plain LuaJIT in a program with a loop of its own (here a
-- bare poll() through the FFI): tasks started with moonbox.spawn advance
-- while the host calls moonbox.step(), and between two steps the host waits
-- on moonbox.backend()'s fd and timeout together with its own fds.
-- Run: luajit examples/embed/luajit_host.lua (moonbox on LUA_PATH/LUA_CPATH,
-- docs/embedding.md)
local ffi = require "ffi"
ffi.cdef [[
struct pollfd { int fd; short events; short revents; };
int poll(struct pollfd *fds, unsigned long nfds, int timeout);
]]
local moonbox = require "moonbox"

local sandbox
local task = moonbox.spawn(function()
  sandbox = moonbox.getSandbox("luajit-host", { root = os.tmpname() .. ".d" })
  return sandbox:exec("sleep 0.2; echo hello from a task on a LuaJIT host loop").stdout
end)

local POLLIN = 1
local fds = ffi.new("struct pollfd[1]")
local turns = 0
while moonbox.step() > 0 do
  local fd, timeout = moonbox.backend()
  fds[0].fd, fds[0].events = fd, POLLIN
  ffi.C.poll(fds, 1, timeout) -- a real host adds its own fds here
  turns = turns + 1
end
io.write(task:wait())
print(("host loop turns: %s"):format(turns > 0 and "some" or "none"))
moonbox.run(function() sandbox:destroy() end)
