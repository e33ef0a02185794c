-- The egress specs' "internet" (internet.sh) from Lua: up() once per spec
-- file, down() in its teardown (and again at exit, should the teardown not
-- run), so no namespace, link, route or server outlives the spec.
local core = require "moonbox.core"

local M = {}

local here = (os.getenv("MOONBOX_SOURCE_DIR") or ".") .. "/spec/network"
local state

function M.up()
  -- unprivileged (run-unprivileged.sh): root made it before, and takes it down after
  local given = os.getenv("MOONBOX_TEST_INTERNET")
  if given then
    local tag, loop_port, host_port = given:match("^(%d+) (%d+) (%d+)$")
    M.tag, M.loop_port, M.host_port = tag, tonumber(loop_port), tonumber(host_port)
    M.dns = "198.51.100.10"
    return
  end
  local pid = core.getpid()
  M.tag = tostring(pid % 100000)
  M.loop_port = 20000 + pid % 20000
  M.host_port = M.loop_port + 1
  state = helper.mkdtemp()
  M.state = state
  local ok = os.execute(("sh %s/internet.sh up %s %s %d %d"):format(here, state, M.tag, M.loop_port, M.host_port))
  assert(ok == 0 or ok == true, "internet.sh up failed")
  M.dns = "198.51.100.10"
end

function M.down()
  if state then os.execute(("sh %s/internet.sh down %s"):format(here, state)) end
end

M._sentinel = newproxy(true)
getmetatable(M._sentinel).__gc = function() pcall(M.down) end

return M
