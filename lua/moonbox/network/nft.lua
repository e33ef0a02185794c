-- The nftables script of one egress sandbox: one table (inet family) named
-- after the sandbox's slot and id, written as one transaction for `nft -f -`
-- (first set-up and every change alike: the chains are flushed and filled
-- again in the same transaction, the sets of addresses the resolver
-- learned and the counters stay). Pure: text in, text out.
local rules_mod = require "moonbox.network.rules"

local M = {}

M.PREFIX = "mbx_" -- every table of ours: mbx_<slot>_<id>
M.PRIORITY = -5   -- before the filter hooks of a host's other tables
-- queries a sandbox may send its resolver (the runtime's own loop parses
-- each): per second, and at once; the rest is dropped in the kernel
M.DNS_RATE = 1000
M.DNS_BURST = 1000

function M.table_name(slot, id) return ("%s%d_%s"):format(M.PREFIX, slot, (id:gsub("[^%w]", "_"))) end

-- the resolver adds answers for allowed names to one set per port (nil: any port)
function M.dns_set(port) return port and ("dns4_p%d"):format(port) or "dns4" end

local function cidr_list(list)
  local out = {}
  for _, c in ipairs(list) do out[#out + 1] = rules_mod.cidr_string(c) end
  return "{ " .. table.concat(out, ", ") .. " }"
end

-- "ip daddr X [meta l4proto { tcp, udp } th dport P]"
local function match(rule)
  local m = "ip daddr " .. rules_mod.cidr_string(rule.cidr)
  if rule.port then m = m .. (" meta l4proto { tcp, udp } th dport %d"):format(rule.port) end
  return m
end

-- The parsed ranges refused unless named: ALWAYS_DENIED, the sandboxes'
-- range, the host's own addresses (spec.host_addrs), and the private ones.
local function protected(spec)
  local out = {}
  for _, s in ipairs(rules_mod.ALWAYS_DENIED) do out[#out + 1] = rules_mod.parse_cidr(s) end
  for _, s in ipairs(rules_mod.PRIVATE) do out[#out + 1] = rules_mod.parse_cidr(s) end
  out[#out + 1] = spec.range
  for _, a in ipairs(spec.host_addrs or {}) do out[#out + 1] = rules_mod.parse_cidr(a) end
  return out
end

local function inside_any(cidr, list)
  for _, r in ipairs(list) do if rules_mod.within(cidr, r) then return true end end
  return false
end

-- Which domain sets a rule set needs (dns4, dns4_p443, ...): name -> port|false
function M.dns_sets(rules)
  local sets = { dns4 = false }
  for _, r in ipairs(rules.allow) do if r.domain then sets[M.dns_set(r.port)] = r.port or false end end
  return sets
end

-- Allow-list mode: an allow list with any entry that is not inside a
-- protected range (only those reach the internet); otherwise everything
-- public is open.
function M.allow_list_mode(rules, spec)
  local prot = protected(spec)
  for _, r in ipairs(rules.allow) do
    if r.domain or not inside_any(r.cidr, prot) then return true end
  end
  return false
end

-- script(spec) -> text. spec: slot, id, link (host side), sb_addr,
-- host_addr (dotted), range (parsed CIDR of every sandbox), host_addrs
-- (the host's IPv4 addresses), rules (rules.parse), connections,
-- bytes_per_second, dns_timeout (s), server_ports (refused on the host even
-- when an allow rule names the host).
function M.script(spec)
  local t = "inet " .. M.table_name(spec.slot, spec.id)
  local link = ('"%s"'):format(spec.link)
  local L = {}
  local function add(fmt, ...) L[#L + 1] = fmt:format(...) end
  add("add table %s", t)
  add("add chain %s forward { type filter hook forward priority %d; policy accept; }", t, M.PRIORITY)
  add("add chain %s egress", t)
  add("add chain %s input { type filter hook input priority %d; policy accept; }", t, M.PRIORITY)
  add("add chain %s to_host", t)
  add("add chain %s postrouting { type nat hook postrouting priority srcnat; policy accept; }", t)
  for _, name in ipairs { "sent", "received", "refused" } do add("add counter %s %s", t, name) end
  local sets = M.dns_sets(spec.rules)
  local names = {}
  for name in pairs(sets) do names[#names + 1] = name end
  table.sort(names)
  for _, name in ipairs(names) do
    add("add set %s %s { type ipv4_addr; flags timeout; timeout %ds; }", t, name, spec.dns_timeout or 300)
  end
  for _, chain in ipairs { "forward", "egress", "input", "to_host", "postrouting" } do
    add("flush chain %s %s", t, chain)
  end
  -- forward: what the sandbox sends goes through egress; toward it, only
  -- replies (no other sandbox, no host, no internet opens a connection in)
  add("add rule %s forward iifname %s jump egress", t, link)
  add("add rule %s forward oifname %s ct state established,related counter name received accept", t, link)
  add("add rule %s forward oifname %s counter name refused drop", t, link)
  -- egress: IPv6 and a forged source never; then limits, then rules
  local e = "add rule " .. t .. " egress "
  add("%smeta nfproto ipv6 counter name refused drop", e)
  add("%sip saddr != %s counter name refused drop", e, spec.sb_addr)
  if spec.bytes_per_second then
    add("%slimit rate over %d bytes/second burst %d bytes counter name refused drop", e, spec.bytes_per_second,
      math.max(spec.bytes_per_second, 65536))
  end
  add("%sct state established,related counter name sent accept", e)
  add("%sct state != new counter name refused drop", e)
  if spec.connections then
    add("%sct count over %d counter name refused reject with icmpx admin-prohibited", e, spec.connections)
  end
  local rules = spec.rules
  -- deny wins over every allow
  for _, r in ipairs(rules.deny) do
    if r.cidr then add("%s%s counter name refused reject with icmpx admin-prohibited", e, match(r)) end
  end
  -- moonbox serve's ports on the host's addresses, whatever the allow
  -- rules (unprivileged, the host is reached through pasta, so on this
  -- hook; as root through the input hook, to_host below)
  local server_ports = {}
  for _, p in ipairs(spec.server_ports or {}) do server_ports[#server_ports + 1] = tostring(p) end
  if #server_ports > 0 and spec.host_addrs and #spec.host_addrs > 0 then
    local addrs = {}
    for _, a in ipairs(spec.host_addrs) do addrs[#addrs + 1] = rules_mod.parse_cidr(a) end
    add("%sip daddr %s tcp dport { %s } counter name refused reject with icmpx admin-prohibited", e, cidr_list(addrs),
      table.concat(server_ports, ", "))
  end
  -- an allow rule inside a protected range opens just that
  local prot = protected(spec)
  for _, r in ipairs(rules.allow) do
    if r.cidr and inside_any(r.cidr, prot) then add("%s%s counter name sent accept", e, match(r)) end
  end
  add("%sip daddr %s counter name refused reject with icmpx admin-prohibited", e, cidr_list(prot))
  if M.allow_list_mode(rules, spec) then
    for _, r in ipairs(rules.allow) do
      if r.cidr and not inside_any(r.cidr, prot) then add("%s%s counter name sent accept", e, match(r)) end
    end
    for _, name in ipairs(names) do
      local port = sets[name]
      if port then
        add("%sip daddr @%s meta l4proto { tcp, udp } th dport %d counter name sent accept", e, name, port)
      else
        add("%sip daddr @%s counter name sent accept", e, name)
      end
    end
    add("%scounter name refused reject with icmpx admin-prohibited", e)
  else
    add("%scounter name sent accept", e)
  end
  -- to the host itself: the resolver, and an address an allow rule names
  -- (never a server port of the runtime's)
  add("add rule %s input iifname %s jump to_host", t, link)
  -- the resolver answers its sandbox only (never the host's LAN: no open resolver)
  add("add rule %s input ip daddr %s iifname != %s counter name refused drop", t, spec.host_addr, link)
  if spec.gateway then
    -- (the gateway namespace only: as root this hook is the host's own)
    -- a segment from pasta that conntrack cannot place is dropped, as
    -- the sandbox's TCP stack would drop it. Left alone it is not
    -- translated back, reaches the gateway's own stack, and that answers
    -- with a reset in the sandbox's name: pasta then drops the flow and
    -- the sandbox's connection hangs. Debian 12's pasta sends such
    -- segments (no flags at all, a window update) at a flow's start.
    add("add rule %s input iifname != %s ct state invalid drop", t, link)
  end
  local h = "add rule " .. t .. " to_host "
  -- (before the established flows: a flood from one socket is one flow)
  add("%sip saddr %s ip daddr %s meta l4proto { tcp, udp } th dport 53 limit rate over %d/second burst %d packets " ..
    "counter name refused drop", h, spec.sb_addr, spec.host_addr, M.DNS_RATE, M.DNS_BURST)
  add("%sct state established,related accept", h)
  add("%sip saddr %s ip daddr %s meta l4proto { tcp, udp } th dport 53 accept", h, spec.sb_addr, spec.host_addr)
  if #server_ports > 0 then
    add("%stcp dport { %s } counter name refused reject with icmpx admin-prohibited", h,
      table.concat(server_ports, ", "))
  end
  for _, r in ipairs(rules.deny) do
    if r.cidr then add("%s%s counter name refused reject with icmpx admin-prohibited", h, match(r)) end
  end
  for _, r in ipairs(rules.allow) do
    if r.cidr and inside_any(r.cidr, prot) then add("%s%s accept", h, match(r)) end
  end
  add("%scounter name refused reject with icmpx admin-prohibited", h)
  add("add rule %s postrouting ip saddr %s oifname != %s masquerade", t, spec.sb_addr, link)
  return table.concat(L, "\n") .. "\n"
end

return M
