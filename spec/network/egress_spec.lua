-- network = "egress" (docs/network.md) against an "internet" the spec
-- builds (spec/network/internet.sh): what an egress sandbox reaches, what
-- it never reaches, run-time changes, limits, and what is left after.
local moonbox = require "moonbox"
local core = require "moonbox.core"
local network = require "moonbox.network"
local nft = require "moonbox.network.nft"
local slots = require "moonbox.network.slots"
local resolver = require "moonbox.network.resolver"
local dns = require "moonbox.network.dns"
local internet = require "network.internet"

local BODY = "hello from the internet\n"

-- curl from inside: {code = exit status, body = stdout}
local function curl(sb, url, extra)
  local r = sb:exec(("curl -s -m 3 %s %s"):format(extra or "", url))
  return { code = r.exitCode, body = r.stdout }
end

local function refused(sb, url)
  local r = curl(sb, url)
  assert.are_not.equal(0, r.code, url .. " answered")
  assert.equal("", r.body, url .. " answered")
end

local function egress_sandbox(egress, extra)
  local opts = { network = "egress", egress = egress,
    policy = { dns = { upstream = { internet.dns } } } }
  for k, v in pairs(extra or {}) do opts[k] = v end
  return helper.new_sandbox(opts)
end

local function with_egress(fn, egress, extra)
  run_task(function()
    local sb = egress_sandbox(egress, extra)
    local ok, err = pcall(fn, sb)
    sb:destroy()
    if not ok then error(err, 0) end
  end)
end

-- a UDP socket on slot n's resolver address, port 53 (/proc/net/udp:
-- the address little-endian on x86 and arm64)
local function resolver_bound(n)
  local host_addr = slots.addresses(assert(slots.range()), n)
  local a, b, c, d = host_addr:match("^(%d+)%.(%d+)%.(%d+)%.(%d+)$")
  local want = ("%02X%02X%02X%02X:0035"):format(tonumber(d), tonumber(c), tonumber(b), tonumber(a))
  return helper.sh("cat /proc/net/udp"):find(want, 1, true) ~= nil
end

-- what the host holds for a sandbox's slot
local function leftovers(n)
  local out = {}
  if io.open("/sys/class/net/" .. slots.link(n) .. "/ifindex") then out[#out + 1] = "link" end
  local tables = helper.sh("nft list tables")
  if tables:find("table inet " .. nft.PREFIX .. n .. "_", 1, true) then out[#out + 1] = "table" end
  if resolver_bound(n) then out[#out + 1] = "resolver" end
  if io.open(slots.lock_path(n)) then out[#out + 1] = "lock file" end
  return out
end

-- the first IPv4 address getent finds for name inside the sandbox
local function lookup(sb, name)
  return sb:exec("getent ahostsv4 " .. name .. " | head -n1").stdout:match("^(%S+)")
end

-- a UDP socket in the sandbox's network namespace, and what it receives
local function dns_client(sb)
  local got = {}
  local client = assert(core.udp_bind("0.0.0.0", 0, { netns_pid = sb:info().initPid }))
  client:recv_start(function(_, data) if data then got[#got + 1] = data end end)
  return client, got
end

local function slot_of(sb) return tonumber(sb:info().network.link:match("%d+")) end

describe("egress rules", function()
  it("are checked before anything is made: VALIDATION_FAILED naming the rule", function()
    run_task(function()
      for rule, why in pairs {
        ["2001:db8::/32"] = "IPv6 is not routed", ["10.0.0.1/8"] = "host bits set", ["1.2.3.4:0"] = "port out of",
        ["not a name"] = "not a CIDR", ["localhost"] = "not a CIDR", ["300.1.1.1"] = "not an IPv4",
      } do
        local err = helper.error_of(helper.new_sandbox, { network = "egress", egress = { allow = { rule } } })
        assert.equal("VALIDATION_FAILED", err.code, rule)
        assert.truthy(err.message:find("egress.allow[1]", 1, true), err.message)
        assert.truthy(err.message:find(why, 1, true), err.message)
      end
      local err = helper.error_of(helper.new_sandbox, { network = "egress", egress = { allowed = {} } })
      assert.same({ "VALIDATION_FAILED", "egress.allowed" }, { err.code, err.context.field })
      err = helper.error_of(helper.new_sandbox, { egress = { allow = { "example.com" } } })
      assert.same({ "VALIDATION_FAILED", "egress" }, { err.code, err.context.field })
      err = helper.error_of(helper.new_sandbox, { network = "egress", isolation = "none" })
      assert.equal("VALIDATION_FAILED", err.code)
      assert.truthy(err.message:find('network = "egress" needs the sandbox\'s own namespaces', 1, true), err.message)
      err = helper.error_of(helper.new_sandbox, { policy = { egress = { deny = { "fc00::/7" } } } })
      assert.same({ "VALIDATION_FAILED", "policy.egress.deny[1]" }, { err.code, err.context.field })
    end)
  end)
end)

-- unprivileged (spec/network/run-unprivileged.sh): pasta and a gateway
-- namespace of the sandbox's own instead of a veth to the host
local ROOT = core.getuid() == 0
local MECHANISM = ROOT and "veth+nftables" or "pasta+nftables"

-- the table as nft lists it, wherever it lives
local function ruleset(sb) return assert(network.ruleset(sb.egress)) end

-- the processes an unprivileged sandbox's egress runs (gateway holder,
-- pasta; the resolver is a socket of the runtime's)
local function egress_pids(state)
  local pids = {}
  for _, pid in pairs(require("moonbox.network.gateway").pids(state.gateway)) do pids[#pids + 1] = pid end
  table.sort(pids)
  return pids
end

local function alive(pids)
  local out = {}
  for _, pid in ipairs(pids) do if helper.pid_alive(pid) then out[#out + 1] = pid end end
  return out
end

local unprivileged_missing = not ROOT and network.refused()
if unprivileged_missing then
  -- (a host without what pasta needs: a container without /dev/net/tun, say)
  describe("egress, unprivileged, without pasta's needs", function()
    it("fails closed with ISOLATION_UNAVAILABLE naming the reason", function()
      run_task(function()
        local err = helper.error_of(helper.new_sandbox, { network = "egress" })
        assert.equal("ISOLATION_UNAVAILABLE", err.code)
        assert.truthy(err.message:find(unprivileged_missing, 1, true), err.message)
      end)
    end)
  end)
  return
end

describe("egress", function()
  setup(internet.up)
  teardown(internet.down)

  it("reaches the public internet by address and by name, with the body the server sent", function()
    with_egress(function(sb)
      local net = sb:info().network
      assert.equal("egress", net.mode)
      assert.equal(MECHANISM, net.mechanism)
      assert.equal(network.DEFAULT_CONNECTIONS, net.limits.connections) -- (the host's conntrack table is shared)
      assert.equal(BODY, curl(sb, "http://203.0.113.10/").body)
      assert.equal(BODY, curl(sb, "http://allowed.test/").body)
      assert.equal("nameserver " .. net.resolver, sb:exec("head -n1 /etc/resolv.conf").stdout:gsub("\n$", ""))
      assert.is_true(sb:info().network.counters.sentPackets > 0)
    end)
  end)

  it("answers every request of a run of new connections (no flow reset at its start)", function()
    -- Unprivileged, Debian 12's pasta sends a segment without flags at
    -- some flows' start (on this link, which delivers in order, more than
    -- half of them): unless the gateway drops it, the gateway's own stack
    -- resets the flow in the sandbox's name and curl waits out its -m 3
    with_egress(function(sb)
      local r = sb:exec("for i in $(seq 1 20); do curl -s -m 3 http://203.0.113.10/ || echo \"failed: $?\"; done")
      assert.equal(BODY:rep(20), r.stdout)
      -- as root the table's input hook is the host's own: nothing of the
      -- host's traffic is dropped for it
      assert.equal(not ROOT, ruleset(sb):find("ct state invalid drop", 1, true) ~= nil)
    end)
  end)

  it("never reaches private ranges, the host, its loopback, link-local or the metadata address", function()
    with_egress(function(sb)
      local net = sb:info().network
      refused(sb, "http://10.77.0.1/")                                      -- private (RFC 1918)
      refused(sb, "http://internal.test/")                                  -- ... by a name
      refused(sb, ("http://127.0.0.1:%d/"):format(internet.loop_port))     -- the host's loopback service
      refused(sb, ("http://%s:%d/"):format(net.gateway, internet.host_port)) -- the host's side of the link
      refused(sb, ("http://198.51.100.1:%d/"):format(internet.host_port))   -- another host address
      local before = sb:info().network.counters.refusedPackets
      refused(sb, "http://169.254.169.254/latest/meta-data/")
      assert.is_true(sb:info().network.counters.refusedPackets > before, "the table refused the metadata address")
      -- IPv6: nothing leaves
      assert.are_not.equal(0, sb:exec("curl -s -m 2 -6 http://[2001:db8::1]/").exitCode)
    end)
  end)

  it("never reaches another sandbox", function()
    run_task(function()
      local a = egress_sandbox()
      local b = egress_sandbox()
      local ok, err = pcall(function()
        local server = b:startProcess("python3 -m http.server 8000 --bind 0.0.0.0 --directory /etc")
        server:waitForPort(8000, { mode = "tcp", timeout = 10000 })
        assert.equal(0, curl(b, "http://127.0.0.1:8000/hostname").code) -- it serves
        refused(a, ("http://%s:8000/hostname"):format(b:info().network.address))
      end)
      a:destroy()
      b:destroy()
      if not ok then error(err, 0) end
    end)
  end)

  it("with an allow list reaches only the names, addresses and ports listed", function()
    with_egress(function(sb)
      refused(sb, "http://203.0.113.10/")            -- not listed (before its name is resolved)
      assert.equal(BODY, curl(sb, "http://203.0.113.20/").body) -- listed with its port
      assert.equal(BODY, curl(sb, "http://allowed.test/").body)
      assert.equal(BODY, curl(sb, "http://sub.allowed.test/").body) -- a subdomain of a listed name
      local r = curl(sb, "http://other.test/")
      assert.equal(6, r.code) -- (curl: could not resolve host) the resolver answers NXDOMAIN
      refused(sb, "http://203.0.113.20:81/") -- listed, but for port 80 only
    end, { allow = { "allowed.test", "203.0.113.20:80" } })
  end)

  it("a deny rule wins over the allow list", function()
    with_egress(function(sb)
      refused(sb, "http://203.0.113.10/")
      assert.equal(BODY, curl(sb, "http://203.0.113.20/").body)
    end, { allow = { "203.0.113.0/24" }, deny = { "203.0.113.10" } })
  end)

  it("an allowed name answering a private address (rebinding) does not open it; a CIDR rule does", function()
    with_egress(function(sb)
      assert.equal(BODY, curl(sb, "http://rebind.test/").body) -- first answer: 203.0.113.10
      -- its TTL (1 s) runs out; the next answer is 10.77.0.1
      moonbox.sleep(1500)
      local addr = sb:exec("getent ahostsv4 rebind.test | head -n1").stdout:match("^(%S+)")
      assert.equal("10.77.0.1", addr)
      refused(sb, "http://rebind.test/")
      sb:setNetwork { egress = { allow = { "rebind.test", "10.77.0.1/32" } } }
      assert.equal(BODY, curl(sb, "http://10.77.0.1/").body)
    end, { allow = { "rebind.test" } })
  end)

  it("asks an upstream on the host's loopback (a systemd-resolved's 127.0.0.53, say)", function()
    with_egress(function(sb)
      assert.equal("203.0.113.20", lookup(sb, "loop.test"))
      assert.equal(BODY, curl(sb, "http://loop.test/").body)
      refused(sb, "http://203.0.113.10/")
    end, { allow = { "loop.test" } }, { policy = { dns = { upstream = { "127.0.0.77" } } } })
  end)

  it("opens an answer's addresses for its TTL (at least MIN_TTL), then closes them without a new lookup", function()
    with_egress(function(sb)
      -- looked up once each, then reached by address only
      assert.equal("203.0.113.10", lookup(sb, "short.test")) -- TTL 2, opened for MIN_TTL
      assert.equal("203.0.113.20", lookup(sb, "long.test"))  -- TTL 300
      local set = ruleset(sb)
      assert.truthy(set:find("203.0.113.10 timeout " .. resolver.MIN_TTL .. "s", 1, true), set)
      assert.truthy(set:find("203.0.113.20 expires 4m", 1, true), set) -- (the set's own 5m: not shown)
      assert.equal(BODY, curl(sb, "http://203.0.113.10/").body)
      assert.equal(BODY, curl(sb, "http://203.0.113.20/").body)
      moonbox.sleep((resolver.MIN_TTL + 2) * 1000)
      refused(sb, "http://203.0.113.10/")
      assert.equal(BODY, curl(sb, "http://203.0.113.20/").body)
      -- a new lookup opens it again
      assert.equal("203.0.113.10", lookup(sb, "short.test"))
      assert.equal(BODY, curl(sb, "http://203.0.113.10/").body)
    end, { allow = { "short.test", "long.test" } })
  end)

  it("answers malformed queries with FORMERR or nothing, and keeps answering", function()
    with_egress(function(sb)
      local client, got = dns_client(sb)
      local to = sb:info().network.resolver
      local function ask(msg)
        for k in pairs(got) do got[k] = nil end
        assert(client:send(msg, to, 53))
        moonbox.sleep(300)
        return got[1], #got
      end
      local q = dns.query(0x1234, { qraw = { "allowed", "test" }, qtype = 1, qclass = 1 })
      local header = q:sub(1, 12)
      -- shorter than a header, a response, longer than any query: no answer
      assert.same({ nil, 0 }, { ask(q:sub(1, 5)) })
      assert.same({ nil, 0 }, { ask("\0\1\128\0" .. q:sub(5)) })
      assert.same({ nil, 0 }, { ask(q .. string.rep("\0", 600)) })
      -- a header, then nonsense: FORMERR, with the query's id
      for what, msg in pairs {
        truncated = q:sub(1, 20),
        pointer_loop = header .. "\192\12\0\1\0\1",
        pointer_forward = header .. "\192\20\0\1\0\1\0\0\0\0",
        no_question = "\18\52\1\0\0\0\0\0\0\0\0\0",
        two_questions = "\18\52\1\0\0\2" .. q:sub(7) .. q:sub(13),
        long_label = header .. "\64" .. string.rep("a", 64) .. "\0\0\1\0\1",
      } do
        local a, n = ask(msg)
        assert.equal(1, n, what)
        local h = dns.header(a)
        assert.same({ 0x1234, true, dns.RCODE.FORMERR }, { h.id, h.qr, h.rcode }, what)
      end
      -- still answering
      local a = dns.parse_answer((ask(q)))
      assert.same({ 0x1234, dns.RCODE.NOERROR, "203.0.113.10" },
        { a.id, a.rcode, a.records[1] and a.records[1].address })
      client:close()
    end, { allow = { "allowed.test" } })
  end)

  it("keeps at most MAX_FORWARDS queries in flight, and drops them all on destroy", function()
    run_task(function()
      local sb = egress_sandbox({ allow = { "silent.test" } })
      local r = sb.egress.resolver
      local client, got = dns_client(sb)
      local ok, err = pcall(function()
        local to = sb:info().network.resolver
        for i = 1, 3 * resolver.MAX_FORWARDS do
          client:send(dns.query(i, { qraw = { "silent", "test" }, qtype = 1, qclass = 1 }), to, 53)
          if i % 16 == 0 then moonbox.sleep(10) end
        end
        helper.eventually(function() return r.queries == 3 * resolver.MAX_FORWARDS end, 5000)
        assert.same({ resolver.MAX_FORWARDS, resolver.MAX_FORWARDS, 2 * resolver.MAX_FORWARDS },
          { r.in_flight, r.max_seen, r.dropped })
        -- the upstream never answers: each gets SERVFAIL after the timeout
        helper.eventually(function() return r.in_flight == 0 end, resolver.UPSTREAM_TIMEOUT_MS + 3000)
        helper.eventually(function() return #got >= resolver.MAX_FORWARDS end, 2000)
        moonbox.sleep(200)
        assert.equal(resolver.MAX_FORWARDS, #got)
        assert.equal(dns.RCODE.SERVFAIL, dns.header(got[1]).rcode)
        -- in flight again, then destroyed: nothing pending, every socket closed
        for i = 1, 8 do client:send(dns.query(i, { qraw = { "silent", "test" }, qtype = 1, qclass = 1 }), to, 53) end
        helper.eventually(function() return r.in_flight == 8 end, 5000)
        local sockets = {}
        for p in pairs(r.pending) do sockets[#sockets + 1] = p.sock end
        client:close()
        sb:destroy()
        assert.same({ 0, {} }, { r.in_flight, r.pending })
        for _, sock in ipairs(sockets) do assert.is_true(sock:is_closing()) end
        assert.is_true(r.sock:is_closing())
      end)
      if not ok then
        client:close()
        sb:destroy()
        error(err, 0)
      end
    end)
  end)

  it("drops queries beyond DNS_RATE a second in the kernel, before the runtime parses them", function()
    with_egress(function(sb)
      local r = sb.egress.resolver
      local client = dns_client(sb)
      local to = sb:info().network.resolver
      local q = dns.query(1, { qraw = { "denied", "test" }, qtype = 1, qclass = 1 }) -- (NXDOMAIN: no upstream)
      -- 50 at a time (the resolver's socket buffer holds a few hundred: it
      -- is not what drops them here), about 5000 a second
      local sent, t0 = 0, core.hrtime()
      for i = 1, 3 * nft.DNS_BURST do
        if client:send(q, to, 53) then sent = sent + 1 end
        if i % 50 == 0 then moonbox.sleep(10) end
      end
      local elapsed = (core.hrtime() - t0) / 1e9
      moonbox.sleep(500)
      client:close()
      assert.truthy(sent > 2 * nft.DNS_BURST, "sent " .. sent)
      -- what got through: the burst, and the rate for the time the flood took
      assert.truthy(r.queries <= nft.DNS_BURST + nft.DNS_RATE * elapsed + 10, ("%d of %d in %.3f s"):format(
        r.queries, sent, elapsed))
      assert.truthy(r.queries >= nft.DNS_BURST / 2, r.queries)
      -- and it answers again at once
      local c2, got = dns_client(sb)
      moonbox.sleep(1100)
      c2:send(q, to, 53)
      helper.eventually(function() return #got == 1 end, 2000)
      c2:close()
      assert.equal(dns.RCODE.NXDOMAIN, dns.header(got[1]).rcode)
    end, { allow = { "allowed.test" } })
  end)

  it("setNetwork changes the rules at once", function()
    with_egress(function(sb)
      assert.equal(BODY, curl(sb, "http://203.0.113.10/").body)
      local net = sb:setNetwork { egress = { allow = { "203.0.113.20" } } }
      assert.same({ "203.0.113.20" }, net.egress.allow)
      refused(sb, "http://203.0.113.10/")
      assert.equal(BODY, curl(sb, "http://203.0.113.20/").body)
      sb:setNetwork { egress = {} }
      assert.equal(BODY, curl(sb, "http://203.0.113.10/").body)
      local err = helper.error_of(sb.setNetwork, sb, { egress = { allow = { "not a rule" } } })
      assert.equal("VALIDATION_FAILED", err.code)
      assert.equal(BODY, curl(sb, "http://203.0.113.10/").body) -- the rules in force stayed
    end)
  end)

  it("an allow rule naming the host opens it, never a port of moonbox serve", function()
    with_egress(function(sb)
      -- (as root the link's host side is the host; unprivileged it is the
      -- gateway namespace, and the host is reached at its own addresses)
      local gw = ROOT and sb:info().network.gateway or "198.51.100.1"
      local url = ("http://%s:%d/"):format(gw, internet.host_port)
      refused(sb, url)
      sb:setNetwork { egress = { allow = { ("%s:%d"):format(gw, internet.host_port) } } }
      assert.equal("host service\n", curl(sb, url).body)
      local saved = network.server_ports
      network.server_ports = { internet.host_port }
      local ok, err = pcall(function()
        sb:setNetwork { egress = { allow = { ("%s:%d"):format(gw, internet.host_port) } } }
        refused(sb, url)
      end)
      network.server_ports = saved
      if not ok then error(err, 0) end
    end)
  end)

  it("never reaches moonbox serve on the host, on any of its addresses", function()
    local bin = os.getenv("MOONBOX_BIN") or ((os.getenv("MOONBOX_BUILD_DIR") or "build") .. "/moonbox")
    local dir = helper.mkdtemp()
    local port = internet.host_port + 1
    local token = dir .. "/token"
    helper.sh(("echo spec-token-0123456789abcdef > %s"):format(token))
    run_task(function()
      local sb = egress_sandbox()
      os.execute(("MOONBOX_HOME=%s/home sh -c 'echo $$ > %s/pid; exec %s serve --listen 0.0.0.0:%d " ..
        "--token-file %s' > %s/out 2>&1 &"):format(dir, dir, bin, port, token, dir))
      local pid = tonumber(helper.sh("sleep 0.2; cat " .. dir .. "/pid"))
      local ok, err = pcall(function()
        local up
        for _ = 1, 100 do
          up = helper.sh(("curl -s -m 1 http://127.0.0.1:%d/healthz"):format(port))
          if up ~= "" then break end
          moonbox.sleep(100)
        end
        assert.truthy(up ~= "", "moonbox serve did not come up: " .. helper.sh("cat " .. dir .. "/out"))
        assert.equal(up, helper.sh(("curl -s -m 1 http://198.51.100.1:%d/healthz"):format(port))) -- from the host
        refused(sb, ("http://%s:%d/healthz"):format(sb:info().network.gateway, port))
        refused(sb, ("http://198.51.100.1:%d/healthz"):format(port))
      end)
      if pid then
        core.kill(pid, "SIGKILL")
        helper.eventually(function() return not helper.pid_alive(pid) end, 5000)
      end
      sb:destroy()
      if not ok then error(err, 0) end
    end)
  end)

  it("holds limits.connections", function()
    with_egress(function(sb)
      local r = sb:exec("exec 3<>/dev/tcp/203.0.113.10/80 && exec 4<>/dev/tcp/203.0.113.10/80 && " ..
        "curl -s -m 3 http://203.0.113.20/; echo \" rc=$?\"; exec 3>&- 4>&-; sleep 0.5; " ..
        "curl -s -m 3 http://203.0.113.20/")
      assert.equal(" rc=7\n" .. BODY, r.stdout) -- the third refused while two were open
      local net = sb:info().network
      assert.equal(2, net.limits.connections)
      assert.equal(1048576, net.limits.egressBytesPerSecond)
      assert.truthy(ruleset(sb):find("limit rate over 1 mbytes/second", 1, true))
    end, nil, { limits = { connections = 2, egressBytesPerSecond = 1048576 } })
  end)

  it("holds limits.egressBytesPerSecond: what it sends past the rate is dropped", function()
    -- 16 MiB through one connection: far more than the socket's send buffer
    -- (so the sender waits for the peer), ~4 min at 64 KiB/s, milliseconds without a limit
    local send = "head -c 16777216 /dev/zero | timeout 5 bash -c 'cat > /dev/tcp/203.0.113.10/9'; echo $?"
    with_egress(function(sb)
      assert.equal("0\n", sb:exec(send).stdout)
    end)
    with_egress(function(sb)
      local before = sb:info().network.counters.refusedPackets
      assert.equal("124\n", sb:exec(send).stdout)
      assert.is_true(sb:info().network.counters.refusedPackets > before)
    end, nil, { limits = { egressBytesPerSecond = 65536 } })
  end)

  it("exposed ports keep working: waitForPort connects inside the namespace", function()
    with_egress(function(sb)
      local p = sb:startProcess("python3 -m http.server 8001 --bind 127.0.0.1 --directory /etc")
      assert.same({ success = true, port = 8001, mode = "http" },
        p:waitForPort(8001, { mode = "http", path = "/hostname", timeout = 10000 }))
    end)
  end)

  it("over HTTP: POST makes an egress sandbox, PATCH /network changes its rules, /metrics counts", function()
    local cjson = require "cjson"
    local api = require "moonbox.server.api"
    local function request(method, path, body)
      local r = api.handle({ method = method, path = path, query = {}, headers = {},
        body = body and cjson.encode(body) }, {})
      if type(r.body) == "table" then r.body = r.body.text() end
      return r.status, cjson.decode(r.body), r.body
    end
    api.configure { home = helper.mkdtemp(), policy = { dns = { upstream = { internet.dns } } } }
    run_task(function()
      local base = ("/v1/sandboxes/http-%d"):format(core.getpid())
      local ok, err = pcall(function()
        local status, r, raw = request("POST", base, { network = "egress", egress = { allow = { "203.0.113.20" } } })
        assert.same({ 200, "egress", { "203.0.113.20" } }, { status, r.network.mode, r.network.egress.allow })
        assert.truthy(raw:find('"deny":[]', 1, true))
        local sb = require("moonbox.sandbox").all()[base:match("[^/]+$")]
        local function fetch(url) return curl(sb, url).body end
        assert.equal("", fetch("http://203.0.113.10/"))
        assert.equal(BODY, fetch("http://203.0.113.20/"))
        status, r = request("PATCH", base .. "/network", { egress = { allow = { "203.0.113.10" } } })
        assert.same({ 200, { "203.0.113.10" } }, { status, r.egress.allow })
        assert.equal(BODY, fetch("http://203.0.113.10/"))
        assert.equal("", fetch("http://203.0.113.20/"))
        status, r = request("PATCH", base .. "/network", { egress = { allow = { "10.0.0.0/33" } } })
        assert.same({ 400, "VALIDATION_FAILED" }, { status, r.code })
        local service = require("moonbox.server.service").new {}
        local text = service:metrics { connections = function() return 0 end, inflight = function() return 0 end,
          refused = function() return 0, 0 end, queued_bytes = function() return 0 end }
        local id = base:match("[^/]+$")
        local sent = tonumber(text:match('moonbox_egress_sent_bytes_total{sandbox="' .. id:gsub("%-", "%%-") ..
          '"} (%d+)'))
        assert.is_true(sent and sent > 0, text)
      end)
      request("DELETE", base)
      if not ok then error(err, 0) end
      -- a sandbox whose network is not egress has no rules to change
      local other = base .. "-none"
      local status, r = request("PATCH", other .. "/network", { egress = {} })
      request("DELETE", other)
      assert.same({ 400, "VALIDATION_FAILED" }, { status, r.code })
    end)
  end)

  it("a sandbox whose init died is rebuilt with its link, rules and resolver", function()
    with_egress(function(sb)
      assert.equal(BODY, curl(sb, "http://allowed.test/").body)
      core.kill(sb:info().initPid, "SIGKILL")
      helper.eventually(function() return sb.init_dead end, 5000)
      local net = sb:info().network -- (rebuilds it)
      assert.equal(1, sb:info().restarts)
      assert.same({ "allowed.test" }, net.egress.allow)
      assert.equal(BODY, curl(sb, "http://allowed.test/").body)
      refused(sb, "http://203.0.113.20/")
    end, { allow = { "allowed.test" } })
  end)

  it("cannot see or change its table from inside: no CAP_NET_ADMIN or CAP_SYS_ADMIN, no_new_privs", function()
    with_egress(function(sb)
      local status = sb:exec("cat /proc/self/status").stdout
      local caps = tonumber(status:match("CapEff:%s*%x*(%x%x%x%x%x%x%x%x)\n"), 16)
      assert.equal(0, bit.band(caps, bit.lshift(1, 12)), "CAP_NET_ADMIN")
      assert.equal(0, bit.band(caps, bit.lshift(1, 21)), "CAP_SYS_ADMIN")
      assert.truthy(status:find("NoNewPrivs:\t1\n", 1, true))
      for _, cmd in ipairs { "nft list ruleset", "nft flush ruleset", "nft add table inet mine",
        "ip link set eth0 down", "ip addr add 10.77.0.9/32 dev eth0" } do
        local r = sb:exec(cmd .. " 2>&1")
        assert.are_not.equal(0, r.exitCode, cmd)
        assert.truthy(r.stdout:find("Operation not permitted", 1, true), cmd .. ": " .. r.stdout)
      end
      -- the table is whole: what it refused, it still refuses
      refused(sb, "http://10.77.0.1/")
      assert.equal(BODY, curl(sb, "http://allowed.test/").body)
    end)
  end)

  if not ROOT then
    it("leaves no process after destroy (gateway, pasta)", function()
      run_task(function()
        local sb = egress_sandbox({ allow = { "allowed.test" } })
        local pids = egress_pids(sb.egress)
        assert.equal(2, #pids)
        assert.same(pids, alive(pids))
        sb:destroy()
        assert.same({}, alive(pids))
      end)
    end)

    it("a killed runtime leaves no process: each had the runtime's death as its signal", function()
      local bin = os.getenv("MOONBOX_BIN") or ((os.getenv("MOONBOX_BUILD_DIR") or "build") .. "/moonbox")
      local root = helper.mkdtemp()
      local script = root .. "/crash.lua"
      local f = assert(io.open(script, "w"))
      f:write(([[
        local sb = require("moonbox").getSandbox("crash-%d", { root = %q, network = "egress",
          egress = { allow = { "allowed.test" } }, policy = { dns = { upstream = { %q } } } })
        local pids = { sb:info().initPid }
        for _, pid in pairs(require("moonbox.network.gateway").pids(sb.egress.gateway)) do pids[#pids + 1] = pid end
        local f = io.open(%q, "w")
        f:write(table.concat(pids, " "), "\n")
        f:close()
        require("moonbox").sleep(60000)
      ]]):format(core.getpid(), root .. "/sb", internet.dns, root .. "/pids"))
      f:close()
      os.execute(("sh -c 'echo $$ > %s/pid; exec %s %s' > %s/out 2>&1 &"):format(root, bin, script, root))
      run_task(function()
      local pids
      helper.eventually(function()
        local text = helper.sh("cat " .. root .. "/pids 2>/dev/null || true")
        pids = {}
        for pid in text:gmatch("%d+") do pids[#pids + 1] = tonumber(pid) end
        return #pids == 3
      end, 20000)
      assert.equal(3, #alive(pids), helper.sh("cat " .. root .. "/out"))
      os.execute("kill -9 " .. helper.sh("cat " .. root .. "/pid"))
      helper.eventually(function() return #alive(pids) == 0 end, 5000)
      assert.same({}, alive(pids))
      end)
    end)
    return
  end

  it("leaves no link, table, resolver or lock after destroy", function()
    run_task(function()
      local sb = egress_sandbox({ allow = { "allowed.test" } })
      local n = slot_of(sb)
      assert.same({ "link", "table", "resolver", "lock file" }, leftovers(n))
      sb:destroy()
      assert.same({}, leftovers(n))
    end)
  end)

  it("the next runtime removes what a killed runtime left", function()
    local bin = os.getenv("MOONBOX_BIN") or ((os.getenv("MOONBOX_BUILD_DIR") or "build") .. "/moonbox")
    local root = helper.mkdtemp()
    local script = helper.mkdtemp() .. "/crash.lua"
    local f = assert(io.open(script, "w"))
    f:write(([[
      local sb = require("moonbox").getSandbox("crash-%d", { root = %q, network = "egress",
        egress = { allow = { "allowed.test" } }, policy = { dns = { upstream = { %q } } } })
      require("moonbox").sleep(60000)
    ]]):format(core.getpid(), root .. "/sb", internet.dns))
    f:close()
    local pidfile = root .. "/pid"
    os.execute(("sh -c 'echo $$ > %s; exec %s %s' > %s/out 2>&1 &"):format(pidfile, bin, script, root))
    -- its slot: its table's name, once its resolver listens too
    local n
    for _ = 1, 200 do
      local tables = helper.sh("nft list tables")
      n = tables:match("table inet " .. nft.PREFIX .. "(%d+)_crash_" .. core.getpid())
      if n and resolver_bound(tonumber(n)) then break end
      os.execute("sleep 0.1")
    end
    assert(n, "the runtime made no egress sandbox")
    n = tonumber(n)
    os.execute("kill -9 " .. helper.sh("cat " .. pidfile))
    os.execute("sleep 0.5")
    -- its init died with it (and the link with the namespace), its
    -- resolver's socket with the runtime; the table stays until the next
    -- runtime sweeps (which may be another runtime on the host, started in
    -- the meantime: so what is left is not asserted here, only that the
    -- resolver went with the runtime and nothing stays after a sweep)
    assert.is_false(resolver_bound(n))
    -- (another runtime on the host may be sweeping it at this moment, its
    -- lock held: then it is gone once that one is done)
    run_task(function()
      helper.eventually(function()
        network.sweep()
        return #leftovers(n) == 0
      end, 5000)
    end)
    assert.same({}, leftovers(n))
  end)
end)
