-- network = "egress" (docs/network.md): the sandbox keeps its own network
-- namespace and reaches out through a veth pair to the host, NATed, with
-- one nftables table of its own deciding what it may reach, and a resolver
-- of its own for domain rules. As root the veth's far end is the host
-- (veth+nftables); unprivileged it is a gateway namespace of the sandbox's
-- own, led out by pasta (pasta+nftables, network/gateway.lua), with the
-- same table and resolver there. Without what either needs getSandbox
-- fails closed.
local core = require "moonbox.core"
local errors = require "moonbox.errors"
local gateway = require "moonbox.network.gateway"
local host = require "moonbox.network.host"
local link = require "moonbox.network.link"
local nft = require "moonbox.network.nft"
local resolver = require "moonbox.network.resolver"
local rules_mod = require "moonbox.network.rules"
local slots = require "moonbox.network.slots"

local M = {}

M.MECHANISM = "veth+nftables"          -- as root
M.UNPRIVILEGED_MECHANISM = "pasta+nftables"
-- the name sets' default timeout: the resolver gives each address its own
-- (the answer's TTL, network/resolver.lua), this is only what nft declares
M.DNS_TIMEOUT = 300
M.server_ports = {}  -- moonbox serve's listening ports: refused even to an allow rule naming the host
-- connections open at once when limits.connections does not say: every one
-- is an entry in the host's one conntrack table (nf_conntrack_max, shared
-- by the whole host), which no sandbox may fill
M.DEFAULT_CONNECTIONS = 4096

local function unavailable(message, context)
  errors.raise("ISOLATION_UNAVAILABLE", 'network = "egress": ' .. message, context)
end

-- What egress needs of the host, or why it cannot have it (fail closed).
function M.refused()
  if core.getuid() ~= 0 then
    local why = gateway.missing()
    if why then return "an unprivileged runtime needs pasta (pasta+nftables): " .. why end
    return nil
  end
  for _, bin in ipairs { "ip", "nft", "nsenter" } do
    local found = false
    for _, dir in ipairs { "/usr/sbin", "/usr/bin", "/sbin", "/bin" } do
      local f = io.open(dir .. "/" .. bin)
      if f then f:close() found = true break end
    end
    if not found then return ("%s is not installed (Debian packages iproute2, nftables, util-linux)"):format(bin) end
  end
end

-- Remove what slot n left behind (its link, its tables; its resolver was
-- a socket of the runtime, gone with it): only called with the slot's lock
-- held, so its owner is gone.
local function remove_leftovers(n)
  link.down(slots.link(n))
  local out = host.run { "nft", "list", "tables" } or ""
  for name in out:gmatch("table inet (" .. nft.PREFIX .. "%d+_[%w_]+)") do
    if tonumber(name:match("^" .. nft.PREFIX .. "(%d+)_")) == n then
      host.run { "nft", "delete", "table", "inet", name }
    end
  end
end

local swept = false
-- sweep(): a crashed runtime's leftovers (links mbx<n>, tables mbx_<n>_*)
-- whose slot lock no runtime holds are removed. Run once per
-- runtime, before its first egress sandbox, and by moonbox serve at start.
function M.sweep()
  swept = true
  if core.getuid() ~= 0 then return 0 end
  local found = {}
  for _, name in ipairs(core.readdir("/sys/class/net") or {}) do
    local n = name:match("^" .. slots.LINK_PREFIX .. "(%d+)$")
    if n then found[tonumber(n)] = true end
  end
  local out = host.run { "nft", "list", "tables" } or ""
  for n in out:gmatch("table inet " .. nft.PREFIX .. "(%d+)_") do found[tonumber(n)] = true end
  for _, name in ipairs(core.readdir(slots.DIR) or {}) do
    local n = name:match("^slot%-(%d+)%.")
    if n then found[tonumber(n)] = true end
  end
  local removed = 0
  for n in pairs(found) do
    local fd = slots.try(n, "sweep " .. core.getpid())
    if fd then
      remove_leftovers(n)
      core.unlink(slots.lock_path(n))
      core.close_fd(fd)
      removed = removed + 1
    end
  end
  return removed
end

-- prepare(sb, egress, limits, dns) -> state: checks and claims an address
-- (before the init starts: its /etc/resolv.conf names the resolver)
function M.prepare(sb, egress, limits, dns)
  local why = M.refused()
  if why then unavailable(why, { network = "egress" }) end
  local rules = rules_mod.parse(egress)
  local slot, err, gw
  if core.getuid() ~= 0 then
    -- every sandbox has a gateway namespace of its own: the first slot's
    -- addresses, never seen by another sandbox, need no host-wide lock
    local range, bad = slots.range()
    if not range then unavailable(bad, { network = "egress" }) end
    local host_addr, sb_addr = slots.addresses(range, 0)
    slot = { n = 0, host_addr = host_addr, sb_addr = sb_addr, range = range }
    gw = {}
  else
    if not swept then M.sweep() end
    slot, err = slots.claim(("%d %s"):format(core.getpid(), sb.id), remove_leftovers)
    if not slot then unavailable(err, { network = "egress" }) end
  end
  return {
    id = sb.id, slot = slot, gateway = gw, link = gw and gateway.LINK or slots.link(slot.n), rules = rules,
    egress = egress, mechanism = gw and M.UNPRIVILEGED_MECHANISM or M.MECHANISM,
    connections = limits and limits.connections or M.DEFAULT_CONNECTIONS,
    bytes_per_second = limits and limits.egressBytesPerSecond or nil,
    upstreams = resolver.upstreams(dns),
    table = nft.table_name(slot.n, sb.id),
  }
end

function M.resolv_conf(state)
  return ("nameserver %s\noptions timeout:2 attempts:2\n"):format(state.slot.host_addr)
end

local function spec_of(state)
  return {
    slot = state.slot.n, id = state.id, link = state.link, sb_addr = state.slot.sb_addr,
    host_addr = state.slot.host_addr, range = state.slot.range, host_addrs = state.host_addrs,
    rules = state.rules, connections = state.connections, bytes_per_second = state.bytes_per_second,
    dns_timeout = M.DNS_TIMEOUT, server_ports = M.server_ports,
    upstreams = state.upstreams, gateway = state.gateway,
    allow_list = nft.allow_list_mode(state.rules, { range = state.slot.range, host_addrs = state.host_addrs }),
  }
end

-- run(state, argv, stdin?): where the table lives (the host, or the gateway)
local function run(state, argv, stdin)
  if state.gateway then return gateway.run(state.gateway, argv, stdin) end
  return host.run(argv, stdin)
end

local function resolver_spec(state)
  local spec = spec_of(state)
  spec.run_nft = function(argv, stdin) return run(state, argv, stdin) end
  spec.netns_pid = state.gateway and state.gateway.holder and state.gateway.holder.pid or nil
  return spec
end

local function start_resolver(state)
  local r, why = resolver.start(resolver_spec(state))
  if not r then return nil, why end
  state.resolver = r
  return true
end

-- attach(state, pid) -> raises ISOLATION_UNAVAILABLE: the link into the
-- init's namespace, the table, the resolver
function M.attach(state, pid)
  local ok, err
  if state.gateway then
    state.host_addrs = link.host_addresses()
    resolver.stop(state.resolver)
    state.resolver = nil
    gateway.down(state.gateway) -- (an earlier init's, on a rebuild)
    ok, err = gateway.up(state.gateway, pid, state.slot.host_addr, state.slot.sb_addr)
  else
    ok, err = link.enable_forwarding()
    if ok then
      state.host_addrs = link.host_addresses()
      link.down(state.link) -- (an earlier init's, on a rebuild)
      ok, err = link.up(pid, state.link, state.slot.host_addr, state.slot.sb_addr)
    end
  end
  if ok then ok, err = run(state, { "nft", "-f", "-" }, nft.script(spec_of(state))) end
  if ok then
    resolver.stop(state.resolver)
    ok, err = start_resolver(state)
  end
  if not ok then
    M.detach(state, true)
    unavailable(tostring(err), { network = "egress" })
  end
  state.pid = pid
end

-- update(state, egress): the rules changed in one nft transaction, and
-- the resolver's names with them (for the next query); the old rules stay
-- on failure
function M.update(state, egress)
  local rules = rules_mod.parse(egress, "egress")
  local old_rules, old_egress = state.rules, state.egress
  state.rules, state.egress = rules, egress
  local ok, err = run(state, { "nft", "-f", "-" }, nft.script(spec_of(state)))
  if not ok then
    state.rules, state.egress = old_rules, old_egress
    errors.raise("ISOLATION_UNAVAILABLE", "cannot change the sandbox's network rules: " .. tostring(err), {})
  end
  if state.resolver then state.resolver.spec = resolver_spec(state) end
end

-- detach(state): resolver, table, link, slot; each tried whatever failed before
function M.detach(state, keep_slot)
  if not state then return true end
  resolver.stop(state.resolver)
  state.resolver = nil
  if state.gateway then
    -- (the table, the link and the namespace go with the gateway's processes)
    gateway.down(state.gateway)
    return true
  end
  host.run { "nft", "delete", "table", "inet", state.table }
  local ok, err = link.down(state.link)
  if not keep_slot then slots.release(state.slot) end
  return ok, err
end

-- ruleset(state) -> the table as nft lists it (where it lives)
function M.ruleset(state)
  return run(state, { "nft", "list", "table", "inet", state.table })
end

-- counters(state) -> {sentBytes, sentPackets, receivedBytes, receivedPackets, refusedPackets}
function M.counters(state)
  local out = (state.gateway and not state.gateway.holder) and "" or
    run(state, { "nft", "list", "counters", "table", "inet", state.table }) or ""
  local c = {}
  for name, packets, bytes in out:gmatch("counter (%w+) {%s*packets (%d+) bytes (%d+)") do
    c[name] = { packets = tonumber(packets), bytes = tonumber(bytes) }
  end
  local function get(name, field) return c[name] and c[name][field] or 0 end
  return { sentBytes = get("sent", "bytes"), sentPackets = get("sent", "packets"),
    receivedBytes = get("received", "bytes"), receivedPackets = get("received", "packets"),
    refusedPackets = get("refused", "packets") }
end

-- info(state) -> info().network's table
function M.info(state)
  local allow, deny = {}, {}
  for i, r in ipairs(state.rules.allow) do allow[i] = r.text end
  for i, r in ipairs(state.rules.deny) do deny[i] = r.text end
  return {
    mode = "egress", mechanism = state.mechanism, address = state.slot.sb_addr, gateway = state.slot.host_addr,
    resolver = state.slot.host_addr, link = state.link, table = "inet " .. state.table,
    egress = { allow = allow, deny = deny }, ipv6 = "dropped",
    limits = { connections = state.connections, egressBytesPerSecond = state.bytes_per_second },
    counters = M.counters(state),
  }
end

return M
