-- The unprivileged egress gateway (mechanism "pasta+nftables"): a second
-- network namespace made inside the sandbox's own user namespace, between
-- the sandbox and pasta (Debian's passt):
--
--   sandbox netns (eth0 .2) --veth-- gateway netns (mbx0 .1, nft table,
--   resolver) --tap-- pasta (the runtime's user, host sockets) -- internet
--
-- The sandbox's traffic is forwarded through the gateway, so the same
-- nftables table as root's (network/nft.lua) decides on it there, on the
-- forward hook; the sandbox's processes are not in that namespace and have
-- no capability anywhere, so they can neither see nor change it. The
-- runtime acts in the gateway as the owner of the sandbox's user namespace
-- (nsenter --user --net), which gives it CAP_NET_ADMIN there and nowhere
-- else. The resolver is the runtime's own socket, made in the gateway's
-- namespace (network/resolver.lua). Every process here (the holder, pasta)
-- is the runtime's child with a parent-death signal: a runtime that dies
-- takes them with it, and the namespaces go with their last process.
local core = require "moonbox.core"
local async = require "moonbox.async"
local fs = require "moonbox.lib.fs"
local host = require "moonbox.network.host"

local M = {}

M.LINK = "mbx0"       -- the gateway's end of the veth (the sandbox's is eth0)
M.START_WAIT_MS = 5000
M.STOP_WAIT_MS = 2000
M.TUN = "/dev/net/tun"
M.MTU = 65520 -- pasta's (its default: the largest 802.3 frame less its header)

-- the commands the gateway needs; nil when all are there
function M.missing()
  for _, bin in ipairs { "pasta", "nft", "nsenter", "unshare", "ip", "sleep" } do
    if not host.find(bin) then
      return ("%s is not installed (Debian packages passt, nftables, iproute2, util-linux)"):format(bin)
    end
  end
  -- pasta opens the tun device as the runtime's user (Debian's udev makes it 0666)
  local f = io.open(M.TUN, "r+")
  if not f then return M.TUN .. " cannot be opened by the runtime's user (pasta needs it; udev's default is 0666)" end
  f:close()
end

-- argv prefixed to enter pid's user and network namespaces as their owner
function M.enter(pid)
  return { "nsenter", "--preserve-credentials", "--user=/proc/" .. pid .. "/ns/user",
    "--net=/proc/" .. pid .. "/ns/net", "--" }
end

local function join(prefix, argv)
  local full = {}
  for _, a in ipairs(prefix) do full[#full + 1] = a end
  for _, a in ipairs(argv) do full[#full + 1] = a end
  return full
end

-- run(gw, argv, stdin?) -> stdout | nil, message: inside the gateway
function M.run(gw, argv, stdin)
  return host.run(join(M.enter(gw.holder.pid), argv), stdin)
end

-- spawn(argv) -> {proc, pid, state}: a long-lived child, killed should the runtime die
local function spawn(argv)
  local state = {}
  local proc, err, code = core.spawn {
    args = argv, env = host.ENV, pdeathsig = "SIGKILL", no_new_privs = true,
    stdio = { [0] = "null", [1] = "null", [2] = "null" },
    on_exit = function(status) state.status = status end,
  }
  if not proc then return nil, ("%s: %s"):format(argv[1], tostring(err or code)) end
  return { proc = proc, pid = proc:pid(), state = state }
end

-- stop(child): SIGKILL and waited for
function M.stop(child)
  if not child then return end
  if child.state.status == nil then
    pcall(child.proc.kill, child.proc, "SIGKILL")
    local waited = 0
    while child.state.status == nil and waited < M.STOP_WAIT_MS and async.in_task() do
      async.sleep(10)
      waited = waited + 10
    end
  end
end

local function wait_for(what, child, ready)
  for _ = 1, M.START_WAIT_MS / 10 do
    if child.state.status ~= nil then return nil, ("%s exited (%s)"):format(what, tostring(child.state.status)) end
    if ready() then return true end
    async.sleep(10)
  end
  return nil, what .. " did not start"
end

local function ns_id(pid, ns)
  local ok, id = pcall(fs.readlink, "/proc/" .. pid .. "/ns/" .. ns)
  return ok and id or nil
end

-- up(gw, pid, host_addr, sb_addr) -> true | nil, message. gw: {} filled
-- with holder and pasta; pid: the sandbox's init.
function M.up(gw, pid, host_addr, sb_addr)
  -- the gateway namespace, owned by the sandbox's user namespace, held by
  -- a process that only sleeps
  local holder, err = spawn { "nsenter", "--preserve-credentials", "--user=/proc/" .. pid .. "/ns/user", "--",
    "unshare", "--net", "--", "sleep", "infinity" }
  if not holder then return nil, err end
  gw.holder = holder
  -- ready once it is in the sandbox's user namespace (nsenter) and then in
  -- a network namespace neither the host's nor the sandbox's (unshare)
  local sandbox_net, own_net = ns_id(pid, "net"), ns_id("self", "net")
  local ok
  ok, err = wait_for("the gateway namespace", holder, function()
    local net = ns_id(holder.pid, "net")
    local user = ns_id(holder.pid, "user")
    return net and user and net ~= sandbox_net and net ~= own_net and user == ns_id(pid, "user")
  end)
  if not ok then return nil, err end
  -- pasta: the gateway's way out, with the host's address and default
  -- route copied in; IPv4 only; no port forwarded either way (-t/-u/-T/-U
  -- none: nothing of the host's loopback is offered to the namespace);
  -- the gateway address is the real gateway, not the host (--no-map-gw)
  local pasta
  pasta, err = spawn { "pasta", "--foreground", "--quiet", "--config-net", "--no-map-gw", "--ipv4-only",
    "--mtu", tostring(M.MTU),
    "--tcp-ports", "none", "--udp-ports", "none", "--tcp-ns", "none", "--udp-ns", "none",
    "--no-dhcp", "--no-ndp", "--no-dhcpv6", "--no-ra",
    "--userns", "/proc/" .. holder.pid .. "/ns/user", "--netns", "/proc/" .. holder.pid .. "/ns/net" }
  if not pasta then return nil, err end
  gw.pasta = pasta
  ok, err = wait_for("pasta", pasta, function()
    local out = M.run(gw, { "ip", "-4", "route", "show", "default" })
    return out and out:find("default", 1, true) ~= nil
  end)
  if not ok then return nil, err end
  -- the veth at pasta's MTU: at 1500 a bulk upload through pasta (Debian
  -- 12's) stalls after some MiB; at 65520 it runs at pasta's own speed
  local mtu = tostring(M.MTU)
  ok, err = M.run(gw, { "ip", "link", "add", M.LINK, "mtu", mtu, "type", "veth", "peer", "name", "eth0", "mtu", mtu,
    "netns", tostring(pid) })
  if not ok then return nil, err end
  ok, err = M.run(gw, { "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward && " ..
    "echo 1 > /proc/sys/net/ipv6/conf/" .. M.LINK .. "/disable_ipv6 && " ..
    ("ip addr add %s/30 dev %s && ip link set %s up"):format(host_addr, M.LINK, M.LINK) })
  if not ok then return nil, err end
  ok, err = host.run(join(M.enter(pid), { "sh", "-c", "echo 1 > /proc/sys/net/ipv6/conf/eth0/disable_ipv6; " ..
    ("ip addr add %s/30 dev eth0 && ip link set eth0 up && ip route add default via %s"):format(sb_addr, host_addr) }))
  if not ok then return nil, err end
  return true
end

-- down(gw): pasta and the holder killed; the gateway namespace, its veth
-- and table go with them (the resolver's socket is the runtime's to close)
function M.down(gw)
  if not gw then return end
  M.stop(gw.pasta)
  M.stop(gw.holder)
  gw.pasta, gw.holder = nil, nil
end

-- pids(gw) -> the gateway's live processes (for specs and info)
function M.pids(gw)
  local out = {}
  for _, name in ipairs { "holder", "pasta" } do
    if gw[name] and gw[name].state.status == nil then out[name] = gw[name].pid end
  end
  return out
end

return M
