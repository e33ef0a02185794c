-- The DNS resolver an egress sandbox uses: a forwarder in the runtime
-- itself (no process), a UDP socket on the host's side of the sandbox's
-- veth, port 53 (unprivileged: on the gateway namespace's side, the socket
-- made there and handed back, network/gateway.lua). For each query:
--
-- * malformed (network/dns.lua says why): FORMERR, or nothing when not
--   even a query header; not a plain query: NOTIMP; not class IN: REFUSED;
-- * a denied name, or with an allow list a name no rule allows: NXDOMAIN;
-- * AAAA of an allowed name: an empty answer (IPv6 is not routed: a
--   program falls back to IPv4 at once);
-- * the rest is forwarded upstream (the policy's dns.upstream, else
--   /etc/resolv.conf's nameservers, from the runtime's own network
--   namespace, so 127.0.0.53 works) with a fresh random id from a fresh
--   socket (a random source port), matched on source, id and question.
--   With an allow list the answer's A addresses (CNAMEs followed) go into
--   the sandbox's nft sets with the answer's own TTL (clamped to MIN_TTL ..
--   MAX_TTL), in one `nft -f` per answer, and only then is the answer sent
--   to the sandbox: the first connect after it finds the address open.
--   TTLs above MAX_TTL are lowered to it in what the sandbox gets.
--
-- Bounded: at most MAX_FORWARDS queries in flight per sandbox (more are
-- dropped: the client's resolver asks again), each given up after
-- UPSTREAM_TIMEOUT_MS per upstream (SERVFAIL after the last). UDP only.
local core = require "moonbox.core"
local async = require "moonbox.async"
local dns = require "moonbox.network.dns"
local nft = require "moonbox.network.nft"
local util = require "moonbox.lib.util"

local M = {}

M.MAX_FORWARDS = 64 -- queries in flight upstream, per sandbox
M.UPSTREAM_TIMEOUT_MS = 2000
M.MIN_TTL = 5       -- s an answered address stays open at least
M.MAX_TTL = 3600    -- s at most (and the most a sandbox is told to cache)
M.PORT = 53

-- upstream resolvers: the policy's dns.upstream, else /etc/resolv.conf's
function M.upstreams(dns_policy)
  if dns_policy and dns_policy.upstream then return dns_policy.upstream end
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

function M.clamp_ttl(ttl) return math.max(M.MIN_TTL, math.min(M.MAX_TTL, math.floor(ttl))) end

-- a name is a rule's domain or below it
local function under(name, domain)
  return name == domain or (#name > #domain and name:sub(-#domain - 1) == "." .. domain)
end

-- decide(spec, name) -> "deny" | "allow", {set names that take its addresses}
function M.decide(spec, name)
  for _, r in ipairs(spec.rules.deny) do
    if r.domain and not r.port and under(name, r.domain) then return "deny" end
  end
  local sets, allowed = {}, false
  for _, r in ipairs(spec.rules.allow) do
    if r.domain and under(name, r.domain) then
      allowed = true
      sets[nft.dns_set(r.port)] = true
    end
  end
  if spec.allow_list and not allowed then return "deny" end
  return "allow", sets
end

-- elements(table, sets, addresses) -> an nft script: each address into
-- each set with its TTL (added, removed and added again in the one
-- transaction, so an address already there gets the new timeout, and is
-- never out of the set in between)
function M.elements(table_name, sets, addrs)
  local L = {}
  local names = {}
  for name in pairs(sets) do names[#names + 1] = name end
  table.sort(names)
  for _, set in ipairs(names) do
    local t = ("inet %s %s"):format(table_name, set)
    for _, a in ipairs(addrs) do
      local e = ("{ %s timeout %ds }"):format(a.address, M.clamp_ttl(a.ttl))
      L[#L + 1] = ("add element %s %s"):format(t, e)
      L[#L + 1] = ("delete element %s { %s }"):format(t, a.address)
      L[#L + 1] = ("add element %s %s"):format(t, e)
    end
  end
  return table.concat(L, "\n") .. "\n"
end

local function random_id()
  local b = util.random_bytes(2)
  return b:byte(1) * 256 + b:byte(2)
end

local function send(r, data, host, port)
  if not r.closed then r.sock:send(data, host, port) end
end

-- drop(r, p): a pending query finished (its socket and timer closed)
local function drop(r, p)
  if p.done then return end
  p.done = true
  r.pending[p] = nil
  r.in_flight = r.in_flight - 1
  pcall(p.sock.close, p.sock)
  pcall(p.timer.close, p.timer)
end

local function answered(r, p, msg, a)
  local addrs = a.rcode == dns.RCODE.NOERROR and next(p.sets) and dns.addresses(a) or {}
  local out = dns.relay(msg, a, p.client_id, M.MAX_TTL)
  if #addrs == 0 then
    drop(r, p)
    return send(r, out, p.host, p.port)
  end
  -- the addresses open before the sandbox learns them: nft first (a
  -- task: it waits for the process), the answer after; the pending entry
  -- is held until then, so nft runs stay within MAX_FORWARDS too
  p.timer:stop()
  pcall(p.sock.recv_stop, p.sock)
  async.spawn(function()
    local ok, err = pcall(r.run_nft, { "nft", "-f", "-" }, M.elements(r.table, p.sets, addrs))
    drop(r, p)
    if ok and err then
      send(r, out, p.host, p.port)
    else
      r.errors = r.errors + 1 -- (closed: a name that cannot be opened is not answered)
      send(r, dns.reply({ id = p.client_id, opcode = 0, rd = p.q.rd, qraw = p.q.qraw, qtype = p.q.qtype,
        qclass = p.q.qclass }, dns.RCODE.SERVFAIL), p.host, p.port)
    end
  end)
end

local function ask(r, p)
  local upstream = r.upstreams[p.try]
  -- (no random id, say with no fd left for /dev/urandom: that query fails, never a guessable id)
  local got_id, id = pcall(random_id)
  local ok = got_id and p.sock:send(dns.query(id, p.q), upstream, M.PORT)
  p.id = got_id and id or -1
  p.upstream = upstream
  p.timer:start(M.UPSTREAM_TIMEOUT_MS, 0, function()
    if p.done then return end
    if ok and p.try < #r.upstreams then
      p.try = p.try + 1
      return ask(r, p)
    end
    drop(r, p)
    send(r, dns.reply(p.reply_to, dns.RCODE.SERVFAIL), p.host, p.port)
  end)
  if not ok then p.try = #r.upstreams end -- (the timer answers SERVFAIL)
end

local function forward(r, q, sets, host, port)
  if r.in_flight >= M.MAX_FORWARDS then r.dropped = r.dropped + 1 return end
  if #r.upstreams == 0 then return send(r, dns.reply(q, dns.RCODE.SERVFAIL), host, port) end
  local sock = core.udp_bind("0.0.0.0", 0, { size = 4096 })
  if not sock then r.errors = r.errors + 1 return send(r, dns.reply(q, dns.RCODE.SERVFAIL), host, port) end
  local p = { q = q, sets = sets, host = host, port = port, client_id = q.id, reply_to = q, sock = sock,
    timer = core.timer(), try = 1 }
  r.pending[p] = true
  r.in_flight = r.in_flight + 1
  if r.in_flight > r.max_seen then r.max_seen = r.in_flight end
  sock:recv_start(function(rerr, data, from, from_port, truncated)
    if rerr or p.done or truncated or from ~= p.upstream or from_port ~= M.PORT then return end
    local a = dns.parse_answer(data)
    -- the answer to this question, or nothing (a forged one is ignored)
    if not a or a.id ~= p.id or a.qtype ~= q.qtype or a.qclass ~= q.qclass or a.qname ~= q.qname then return end
    answered(r, p, data, a)
  end)
  ask(r, p)
end

-- on_query(r, data, host, port): one datagram from the sandbox
function M.on_query(r, data, host, port, truncated)
  r.queries = r.queries + 1
  if truncated then return end -- (longer than any query: no answer)
  local h = dns.header(data)
  if not h or h.qr then return end -- not a query at all: never answered (no reflection)
  local q = dns.parse_query(data)
  if not q then
    h.qraw = nil
    return send(r, dns.reply(h, dns.RCODE.FORMERR), host, port)
  end
  if q.opcode ~= 0 then
    q.qraw = nil
    return send(r, dns.reply(q, dns.RCODE.NOTIMP), host, port)
  end
  if q.qclass ~= dns.CLASS_IN or not dns.is_hostname(q) then
    return send(r, dns.reply(q, dns.RCODE.REFUSED), host, port)
  end
  local verdict, sets = M.decide(r.spec, q.qname)
  if verdict == "deny" then return send(r, dns.reply(q, dns.RCODE.NXDOMAIN), host, port) end
  if q.qtype == dns.TYPE.AAAA then return send(r, dns.reply(q, dns.RCODE.NOERROR), host, port) end
  forward(r, q, sets, host, port)
end

-- start(spec) -> resolver | nil, message. spec: host_addr (where it
-- listens), rules, allow_list, upstreams, slot, id (the table), run_nft
-- (function(argv, stdin) -> out | nil, why: where the table lives),
-- netns_pid (unprivileged: the gateway's holder)
function M.start(spec)
  local sock, err = core.udp_bind(spec.host_addr, M.PORT, { size = 512, netns_pid = spec.netns_pid })
  if not sock then return nil, ("cannot listen on %s:%d: %s"):format(spec.host_addr, M.PORT, tostring(err)) end
  local r = { sock = sock, spec = spec, upstreams = spec.upstreams, table = nft.table_name(spec.slot, spec.id),
    run_nft = spec.run_nft, pending = {}, in_flight = 0, max_seen = 0, queries = 0, dropped = 0, errors = 0 }
  sock:recv_start(function(rerr, data, host, port, truncated)
    if rerr or r.closed then return end
    local ok, why = pcall(M.on_query, r, data, host, port, truncated)
    if not ok then r.errors = r.errors + 1 r.last_error = why end
  end)
  sock:unref() -- (a script ends when its work does, whatever its sandboxes)
  return r
end

-- stop(r): the socket closed, every pending upstream query dropped
function M.stop(r)
  if not r or r.closed then return end
  r.closed = true
  pcall(r.sock.close, r.sock)
  for p in pairs(r.pending) do drop(r, p) end
end

-- stats(r) -> {inFlight, maxInFlight, queries, dropped, errors}
function M.stats(r)
  return { inFlight = r.in_flight, maxInFlight = r.max_seen, queries = r.queries, dropped = r.dropped,
    errors = r.errors }
end

return M
