-- The DNS resolver an egress sandbox uses: a dnsmasq (Debian's
-- dnsmasq-base) of its own, listening on the host's side of its veth (UDP
-- and TCP 53), forwarding to the upstream resolvers. With an allow list it
-- answers only the allowed names (the others NXDOMAIN) and puts their A
-- answers into the sandbox's nft sets (nftset), which the table opens;
-- denied names are NXDOMAIN always. Answers and the cache live at most half
-- the set's timeout, so a client asks again (and the set is refreshed)
-- before an address it uses is closed.
local core = require "moonbox.core"
local async = require "moonbox.async"
local host = require "moonbox.network.host"
local nft = require "moonbox.network.nft"
local slots = require "moonbox.network.slots"
local gateway = require "moonbox.network.gateway"
local rules_mod = require "moonbox.network.rules"

-- an address as /proc/net/udp shows it (little-endian on x86 and arm64)
local function ip_le(addr)
  local n = rules_mod.parse_ipv4(addr)
  local a, b, c, d = math.floor(n / 16777216) % 256, math.floor(n / 65536) % 256, math.floor(n / 256) % 256, n % 256
  return ((d * 256 + c) * 256 + b) * 256 + a
end

local M = {}

M.BINARY = "dnsmasq"
M.MAX_FORWARDS = 64 -- queries in flight upstream, per sandbox
M.CACHE = 1000
M.START_WAIT_MS = 3000
M.STOP_WAIT_MS = 2000
-- setgid, setuid, net_bind_service, net_admin (linux/capability.h)
M.CAPABILITIES = { 6, 7, 10, 12 }

-- upstream resolvers: the policy's dns.upstream, else /etc/resolv.conf's
function M.upstreams(dns)
  if dns and dns.upstream then return dns.upstream end
  local list = {}
  local f = io.open("/etc/resolv.conf")
  if f then
    for line in f:lines() do
      local a = line:match("^%s*nameserver%s+(%d+%.%d+%.%d+%.%d+)%s*$")
      if a then list[#list + 1] = a end
    end
    f:close()
  end
  return list
end

local function find_binary()
  for _, dir in ipairs { "/usr/sbin", "/usr/bin", "/sbin", "/bin" } do
    local f = io.open(dir .. "/" .. M.BINARY)
    if f then f:close() return dir .. "/" .. M.BINARY end
  end
end

-- argv(spec) -> argv. spec: slot (n), id, host_addr, rules, upstreams,
-- allow_list (bool), dns_timeout
function M.argv(spec)
  local bin = find_binary()
  if not bin then return nil, "dnsmasq is not installed (Debian package dnsmasq-base)" end
  local ttl = math.max(1, math.floor((spec.dns_timeout or 300) / 2))
  local a = {}
  if spec.gateway then
    -- unprivileged (network/gateway.lua): in the gateway's namespaces, where
    -- the runtime's user is root with every capability; it keeps only the
    -- two it needs there (its port, the table's sets) and gains none by exec
    for _, v in ipairs(gateway.enter(spec.gateway.holder.pid)) do a[#a + 1] = v end
    for _, v in ipairs { "setpriv", "--no-new-privs", "--inh-caps=-all",
      "--bounding-set=-all,+net_admin,+net_bind_service", "--" } do a[#a + 1] = v end
  end
  for _, v in ipairs { bin, "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv", "--no-hosts", "--no-poll",
    "--bind-interfaces", "--listen-address=" .. spec.host_addr, "--except-interface=lo", "--port=53",
    "--cache-size=" .. M.CACHE, "--dns-forward-max=" .. M.MAX_FORWARDS,
    "--max-ttl=" .. ttl, "--max-cache-ttl=" .. ttl, "--filter-AAAA", "--log-facility=/dev/null" } do a[#a + 1] = v end
  if spec.gateway then
    -- (no other user is mapped in that namespace, and it may not set its groups:
    -- it stays as it is; no pid file: ready is its socket, below)
    for _, v in ipairs { "--user=root", "--group=", "--pid-file=" } do a[#a + 1] = v end
  else
    for _, v in ipairs { "--pid-file=" .. slots.pid_path(spec.slot), "--user=nobody", "--group=nogroup" } do
      a[#a + 1] = v
    end
  end
  local table_name = nft.table_name(spec.slot, spec.id)
  if spec.allow_list then
    a[#a + 1] = "--address=/#/" -- every name not allowed: NXDOMAIN
    for _, r in ipairs(spec.rules.allow) do
      if r.domain then
        for _, up in ipairs(spec.upstreams) do a[#a + 1] = ("--server=/%s/%s"):format(r.domain, up) end
        a[#a + 1] = ("--nftset=/%s/4#inet#%s#%s"):format(r.domain, table_name, nft.dns_set(r.port))
      end
    end
  else
    for _, up in ipairs(spec.upstreams) do a[#a + 1] = "--server=" .. up end
  end
  for _, r in ipairs(spec.rules.deny) do
    if r.domain and not r.port then a[#a + 1] = ("--address=/%s/"):format(r.domain) end
  end
  return a
end

-- start(spec) -> process | nil, message: waits until it answers on its port
function M.start(spec)
  local argv, why = M.argv(spec)
  if not argv then return nil, why end
  local state = {}
  -- it reads what the sandbox sends: it starts with only what it needs (to
  -- bind port 53, become nobody, and keep net_admin for its nft sets) and
  -- can never gain more (no_new_privs: no setuid program helps it)
  local proc, pipes, code = core.spawn {
    args = argv, env = host.ENV,
    cap_keep = not spec.gateway and M.CAPABILITIES or nil, no_new_privs = not spec.gateway or nil,
    pdeathsig = spec.gateway and "SIGKILL" or nil,
    stdio = { [0] = "null", [1] = "null", [2] = "pipe" },
    on_exit = function(status) state.status = status if state.on_exit then state.on_exit(status) end end,
  }
  if not proc then return nil, ("dnsmasq: %s"):format(tostring(pipes or code)) end
  local err = {}
  pipes[2]:read_start(function(_, data) if data and #err < 16 then err[#err + 1] = data end end)
  local r = { proc = proc, state = state, stderr = pipes[2], err = err, pid = proc:pid(), slot = spec.slot,
    gateway = spec.gateway ~= nil }
  -- its pid file is written once its sockets are bound (in a gateway: its
  -- UDP socket on the address, in its namespace's table)
  local udp = spec.gateway and (":%04X 00000000:0000"):format(53)
  local want = spec.gateway and ("%08X"):format(ip_le(spec.host_addr)) .. udp
  for _ = 1, M.START_WAIT_MS / 10 do
    if state.status ~= nil then break end
    if want then
      local t = io.open("/proc/" .. r.pid .. "/net/udp")
      local text = t and t:read("*a") or ""
      if t then t:close() end
      if text:find(want, 1, true) then return r end
    end
    local f = not want and io.open(slots.pid_path(spec.slot))
    if f then
      local pid = f:read("*l")
      f:close()
      if pid and pid ~= "" then return r end
    end
    async.sleep(10)
  end
  M.stop(r)
  return nil, ("dnsmasq did not start%s: %s"):format(state.status and (" (exit " .. tostring(state.status) .. ")")
    or "", (table.concat(err):gsub("%s+$", "")))
end

-- stop(r): killed and waited for (up to STOP_WAIT_MS), so a resolver
-- started next on its address finds the port free
function M.stop(r)
  if not r then return end
  if r.state.status == nil then
    pcall(r.proc.kill, r.proc, "SIGKILL")
    local waited = 0
    while r.state.status == nil and waited < M.STOP_WAIT_MS and async.in_task() do
      async.sleep(10)
      waited = waited + 10
    end
  end
  pcall(r.stderr.close, r.stderr)
  if not r.gateway then core.unlink(slots.pid_path(r.slot or -1)) end
end

-- a crashed runtime's resolver of slot n (its pid file names it; only a
-- dnsmasq whose command line names that pid file is killed)
function M.kill_leftover(n)
  local path = slots.pid_path(n)
  local f = io.open(path)
  local pid = f and tonumber(f:read("*l") or "")
  if f then f:close() end
  if pid then
    local c = io.open("/proc/" .. pid .. "/cmdline", "rb")
    local cmdline = c and c:read("*a") or ""
    if c then c:close() end
    if cmdline:find("--pid-file=" .. path, 1, true) then core.kill(pid, "SIGKILL") end
  end
  core.unlink(path)
end

return M
