-- network/dns.lua: the egress resolver's DNS parsing, against what a
-- hostile sandbox or upstream may send (every malformed input is nil, why;
-- never an error, never a read past the message).
local dns = require "moonbox.network.dns"
local resolver = require "moonbox.network.resolver"

local be16 = dns.be16
local function be32(n) return be16(math.floor(n / 65536)) .. be16(n % 65536) end

local function query(labels, qtype)
  return dns.query(0x4242, { qraw = labels, qtype = qtype or dns.TYPE.A, qclass = dns.CLASS_IN })
end

-- an answer to query(labels): header (QR, RD, RA), the question, then records
local function answer(labels, records, opts)
  opts = opts or {}
  local q = query(labels)
  local flags = 0x8180 + (opts.rcode or 0)
  return be16(opts.id or 0x4242) .. be16(flags) .. be16(1) .. be16(#records) .. be16(0) .. be16(0) .. q:sub(13) ..
    table.concat(records)
end

-- a record: name (wire form), type, ttl, rdata
local function rr(name, rtype, ttl, rdata)
  return name .. be16(rtype) .. be16(dns.CLASS_IN) .. be32(ttl) .. be16(#rdata) .. rdata
end

local QNAME = "\192\12" -- a pointer to the question's name
local function a(addr)
  local o1, o2, o3, o4 = addr:match("^(%d+)%.(%d+)%.(%d+)%.(%d+)$")
  return string.char(tonumber(o1), tonumber(o2), tonumber(o3), tonumber(o4))
end

describe("network.dns", function()
  it("parses a query's header and question", function()
    local q = assert(dns.parse_query(query({ "WWW", "Example", "com" })))
    assert.same({ 0x4242, false, 0, true, "www.example.com", dns.TYPE.A, dns.CLASS_IN },
      { q.id, q.qr, q.opcode, q.rd, q.qname, q.qtype, q.qclass })
    assert.same({ "WWW", "Example", "com" }, q.qraw) -- sent upstream as asked
    assert.is_true(dns.is_hostname(q))
  end)

  it("refuses malformed queries with a reason", function()
    local q = query({ "a", "test" })
    local header = q:sub(1, 12)
    for what, msg in pairs {
      empty = "", short = q:sub(1, 11), truncated_name = q:sub(1, 15), truncated_type = q:sub(1, #q - 1),
      no_question = q:sub(1, 4) .. be16(0) .. q:sub(7, 12),
      two_questions = q:sub(1, 4) .. be16(2) .. q:sub(7) .. q:sub(13),
      pointer_to_itself = header .. "\192\12" .. be16(1) .. be16(1),
      pointer_forward = header .. "\192\16" .. be16(1) .. be16(1) .. "\1a\0",
      label_type = header .. "\64" .. string.rep("a", 64) .. "\0" .. be16(1) .. be16(1),
      extended_label = header .. "\65a\0" .. be16(1) .. be16(1),
      long_name = header .. string.rep("\63" .. string.rep("a", 63), 4) .. "\0" .. be16(1) .. be16(1),
      trailing = q .. "x", response = q:sub(1, 2) .. "\129\0" .. q:sub(5),
      answer_records = q:sub(1, 6) .. be16(1) .. q:sub(9),
      oversized = q:sub(1, 12) .. string.rep("\1a", 2100) .. "\0",
      not_a_string = 42,
    } do
      local r, why = dns.parse_query(msg)
      assert.is_nil(r, what)
      assert.equal("string", type(why), what)
    end
  end)

  it("follows compression pointers backwards only, and at most MAX_POINTERS", function()
    -- a chain of pointers, each to the one before: fine up to the limit
    local function chain(n)
      local msg = query({ "a", "test" })
      local prev = 12 -- the question's name (0-based offset)
      for _ = 1, n do
        local at = #msg
        msg = msg .. string.char(192 + math.floor(prev / 256), prev % 256)
        prev = at
      end
      return msg, prev + 1
    end
    local msg, at = chain(dns.MAX_POINTERS)
    assert.equal("a.test", (dns.read_name(msg, at)))
    msg, at = chain(dns.MAX_POINTERS + 1)
    local name, why = dns.read_name(msg, at)
    assert.is_nil(name)
    assert.truthy(why:find("too many", 1, true))
  end)

  it("keeps a label's dot or odd bytes from posing as a name's parts", function()
    local q = assert(dns.parse_query(query({ "evil.allowed", "test" })))
    assert.equal("evil\\046allowed.test", q.qname)
    assert.is_false(dns.is_hostname(q))
    assert.is_false(dns.is_hostname(assert(dns.parse_query(query({ "a\0b", "test" })))))
    assert.is_false(dns.is_hostname(assert(dns.parse_query(query({})))))
  end)

  it("parses an answer's A and CNAME records with their TTLs, following CNAMEs", function()
    local msg = answer({ "www", "example", "com" }, {
      rr(QNAME, dns.TYPE.CNAME, 600, "\3cdn\3net\0"),
      rr("\3cdn\3net\0", dns.TYPE.A, 30, a("203.0.113.7")),
      rr("\3cdn\3net\0", dns.TYPE.A, 900, a("203.0.113.8")),
      rr("\5other\3net\0", dns.TYPE.A, 900, a("198.51.100.9")), -- not on the chain
    })
    local r = assert(dns.parse_answer(msg))
    assert.same({ "www.example.com", 4, "cdn.net" }, { r.qname, #r.records, r.records[1].target })
    assert.same({ { address = "203.0.113.7", ttl = 30 }, { address = "203.0.113.8", ttl = 600 } }, dns.addresses(r))
  end)

  it("stops at a CNAME loop and at MAX_CNAMES hops", function()
    local loop = answer({ "a", "test" }, {
      rr(QNAME, dns.TYPE.CNAME, 60, "\1b\4test\0"),
      rr("\1b\4test\0", dns.TYPE.CNAME, 60, "\1a\4test\0"),
    })
    assert.same({}, dns.addresses(assert(dns.parse_answer(loop))))
    local records, name = {}, QNAME
    for i = 1, dns.MAX_CNAMES + 1 do
      local target = "\2c" .. i .. "\4test\0"
      if i >= 10 then target = "\3c" .. i .. "\4test\0" end
      records[#records + 1] = rr(name, dns.TYPE.CNAME, 60, target)
      name = target
    end
    records[#records + 1] = rr(name, dns.TYPE.A, 60, a("203.0.113.1"))
    assert.same({}, dns.addresses(assert(dns.parse_answer(answer({ "a", "test" }, records)))))
  end)

  it("refuses malformed answers", function()
    local good = answer({ "a", "test" }, { rr(QNAME, dns.TYPE.A, 60, a("203.0.113.1")) })
    assert.truthy(dns.parse_answer(good))
    for what, msg in pairs {
      a_of_five_bytes = answer({ "a", "test" }, { rr(QNAME, dns.TYPE.A, 60, "12345") }),
      rdata_past_end = good:sub(1, #good - 1),
      record_past_end = good:sub(1, #good - 8),
      count_past_end = good:sub(1, 6) .. be16(2) .. good:sub(9),
      too_many = good:sub(1, 6) .. be16(dns.MAX_RECORDS + 1) .. good:sub(9),
      cname_shorter_than_data = answer({ "a", "test" }, { rr(QNAME, dns.TYPE.CNAME, 60, "\1b\0x") }),
      cname_to_itself = answer({ "a", "test" }, { rr(QNAME, dns.TYPE.CNAME, 60, "\192\36") }), -- (its own offset)
      query = query({ "a", "test" }),
    } do
      local r, why = dns.parse_answer(msg)
      assert.is_nil(r, what)
      assert.equal("string", type(why), what)
    end
  end)

  it("survives random bytes and random corruptions of good messages", function()
    math.randomseed(31)
    local good = answer({ "www", "example", "com" }, {
      rr(QNAME, dns.TYPE.CNAME, 600, "\3cdn\192\16"), rr("\192\45", dns.TYPE.A, 30, a("203.0.113.7")),
    })
    assert.same({ { address = "203.0.113.7", ttl = 30 } }, dns.addresses(assert(dns.parse_answer(good))))
    for _ = 1, 5000 do
      local bytes = {}
      for i = 1, math.random(0, 80) do bytes[i] = string.char(math.random(0, 255)) end
      local junk = table.concat(bytes)
      local m = { good:byte(1, -1) }
      for _ = 1, math.random(1, 4) do m[math.random(1, #m)] = math.random(0, 255) end
      local corrupt = string.char(unpack(m)):sub(1, math.random(1, #good))
      for _, msg in ipairs { junk, corrupt } do
        assert(pcall(dns.parse_query, msg))
        local ok, r = pcall(dns.parse_answer, msg)
        assert(ok, r)
        if r then assert(pcall(dns.addresses, r)) end
      end
    end
  end)

  it("writes replies, upstream queries and relayed answers", function()
    local q = assert(dns.parse_query(query({ "Mixed", "Test" })))
    local r = assert(dns.parse_answer(dns.reply(q, dns.RCODE.NXDOMAIN)))
    assert.same({ 0x4242, dns.RCODE.NXDOMAIN, "mixed.test", 0 }, { r.id, r.rcode, r.qname, #r.records })
    local up = assert(dns.parse_query(dns.query(7, q)))
    assert.same({ 7, { "Mixed", "Test" } }, { up.id, up.qraw })
    -- relayed: the client's id, TTLs above the cap lowered to it
    local msg = answer({ "a", "test" }, { rr(QNAME, dns.TYPE.A, 86400, a("203.0.113.1")),
      rr(QNAME, dns.TYPE.A, 60, a("203.0.113.2")) }, { id = 999 })
    local relayed = assert(dns.parse_answer(dns.relay(msg, assert(dns.parse_answer(msg)), 0x4242, 3600)))
    assert.same({ 0x4242, 3600, 60 }, { relayed.id, relayed.records[1].ttl, relayed.records[2].ttl })
    assert.equal(#msg, #dns.relay(msg, assert(dns.parse_answer(msg)), 1, 3600))
  end)
end)

describe("network.resolver", function()
  local spec = { allow_list = true, rules = {
    allow = { { domain = "allowed.test" }, { domain = "api.allowed.test", port = 443 } },
    deny = { { domain = "bad.allowed.test" } } } }

  it("decides by suffix, deny first, each allow rule adding its set", function()
    assert.same({ "allow", { dns4 = true } }, { resolver.decide(spec, "allowed.test") })
    assert.same({ "allow", { dns4 = true, dns4_p443 = true } }, { resolver.decide(spec, "x.api.allowed.test") })
    assert.equal("deny", (resolver.decide(spec, "bad.allowed.test")))
    assert.equal("deny", (resolver.decide(spec, "notallowed.test")))
    assert.equal("deny", (resolver.decide(spec, "allowed.test.evil")))
  end)

  it("clamps TTLs and writes one transaction per answer", function()
    assert.same({ resolver.MIN_TTL, 60, resolver.MAX_TTL }, { resolver.clamp_ttl(0), resolver.clamp_ttl(60),
      resolver.clamp_ttl(4294967295) })
    assert.equal(table.concat({
      "add element inet t dns4 { 203.0.113.1 timeout 60s }",
      "delete element inet t dns4 { 203.0.113.1 }",
      "add element inet t dns4 { 203.0.113.1 timeout 60s }", "" }, "\n"),
      resolver.elements("t", { dns4 = true }, { { address = "203.0.113.1", ttl = 60 } }))
  end)
end)
