-- The veth pair of an egress sandbox: mbx<n> on the host, eth0 in the
-- sandbox's network namespace (the init's), a /30 between them, the
-- default route through the host. IPv6 is off on both ends (not routed).
local host = require "moonbox.network.host"

local M = {}

local function write(path, value)
  local f = io.open(path, "w")
  if not f then return nil, "cannot open " .. path end
  local ok, err = f:write(value)
  f:close()
  if not ok then return nil, ("cannot write %s: %s"):format(path, tostring(err)) end
  return true
end

-- Forwarding is a host global: turned on when off, never turned off again
-- (other users of the host may rely on it from then on; docs/network.md).
function M.enable_forwarding()
  local f = io.open("/proc/sys/net/ipv4/ip_forward")
  local v = f and f:read("*l")
  if f then f:close() end
  if v == "1" then return true end
  return write("/proc/sys/net/ipv4/ip_forward", "1\n")
end

-- up(pid, link, host_addr, sb_addr) -> true | nil, message
function M.up(pid, link, host_addr, sb_addr)
  local ok, err = host.run { "ip", "link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", tostring(pid) }
  if not ok then return nil, err end
  write("/proc/sys/net/ipv6/conf/" .. link .. "/disable_ipv6", "1\n")
  ok, err = host.run({ "ip", "-batch", "-" }, ("addr add %s/30 dev %s\nlink set %s up\n"):format(host_addr, link, link))
  if not ok then return nil, err end
  ok, err = host.run_in(pid, { "sh", "-c", "echo 1 > /proc/sys/net/ipv6/conf/eth0/disable_ipv6; " ..
    ("ip addr add %s/30 dev eth0 && ip link set eth0 up && ip route add default via %s"):format(sb_addr, host_addr) })
  if not ok then return nil, err end
  return true
end

function M.down(link)
  local f = io.open("/sys/class/net/" .. link .. "/ifindex")
  if not f then return true end
  f:close()
  return host.run { "ip", "link", "del", link }
end

-- the host's own IPv4 addresses (refused to the sandbox unless named)
function M.host_addresses()
  local out = host.run { "ip", "-4", "-o", "addr", "show" }
  local list = {}
  for addr in (out or ""):gmatch("inet (%d+%.%d+%.%d+%.%d+)") do list[#list + 1] = addr end
  return list
end

return M
