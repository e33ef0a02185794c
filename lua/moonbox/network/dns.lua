-- DNS messages (RFC 1035) as the egress forwarder needs them: a query's
-- header and question, an answer's A and CNAME records with their TTLs,
-- and the few messages it writes itself. Pure: bytes in, tables out.
--
-- Both sides may be hostile (the sandbox sends the queries; an upstream
-- could lie), so every read is bounds-checked and returns nil, why on
-- anything off: a name is at most 255 bytes in at most 127 labels of at
-- most 63, a compression pointer must point backwards (so no loop) and at
-- most MAX_POINTERS are followed per name, counts are capped, and a
-- message is at most MAX_MESSAGE bytes.
local bit = require "bit"

local M = {}

M.MAX_MESSAGE = 4096
M.MAX_POINTERS = 16
M.MAX_RECORDS = 64 -- resource records read from one answer
M.MAX_CNAMES = 8   -- CNAME hops followed from the question's name

M.TYPE = { A = 1, NS = 2, CNAME = 5, SOA = 6, PTR = 12, MX = 15, TXT = 16, AAAA = 28, OPT = 41, ANY = 255 }
M.CLASS_IN = 1
M.RCODE = { NOERROR = 0, FORMERR = 1, SERVFAIL = 2, NXDOMAIN = 3, NOTIMP = 4, REFUSED = 5 }

local byte, char, sub = string.byte, string.char, string.sub

local function u16(s, i)
  local a, b = byte(s, i, i + 1)
  return a * 256 + b
end

local function u32(s, i)
  local a, b, c, d = byte(s, i, i + 3)
  return ((a * 256 + b) * 256 + c) * 256 + d
end

local function be16(n) return char(bit.band(bit.rshift(n, 8), 255), bit.band(n, 255)) end
local function be32(n) return be16(math.floor(n / 65536)) .. be16(n % 65536) end
M.be16 = be16

-- A label as text: letters, digits, '-' and '_' as they are (lower case),
-- every other byte as \ddd, so no label can pose as two ("a.b" is a\046b).
local function label_text(raw)
  return (raw:lower():gsub("[^%w%-_]", function(c) return ("\\%03d"):format(byte(c)) end))
end

-- read_name(msg, i) -> name (dotted, lower case, "" for the root), the
-- index after it where it started (pointers not followed for that), the
-- raw labels | nil, why. i is 1-based.
function M.read_name(msg, i)
  local len = #msg
  local labels, raw = {}, {}
  local total, pointers, after = 1, 0, nil
  local pos = i
  while true do
    if pos > len then return nil, "name runs past the message" end
    local n = byte(msg, pos)
    if n == 0 then
      after = after or pos + 1
      break
    elseif n >= 192 then
      if pos + 1 > len then return nil, "pointer runs past the message" end
      local target = u16(msg, pos) - 49152 + 1
      -- backwards only: a pointer can never reach itself again
      if target >= pos then return nil, "compression pointer does not point backwards" end
      pointers = pointers + 1
      if pointers > M.MAX_POINTERS then return nil, "too many compression pointers" end
      after = after or pos + 2
      pos = target
    elseif n >= 64 then
      return nil, "unknown label type"
    else
      if pos + n > len then return nil, "label runs past the message" end
      total = total + n + 1
      if total > 255 or #labels >= 127 then return nil, "name longer than 255 bytes" end
      local l = sub(msg, pos + 1, pos + n)
      labels[#labels + 1] = label_text(l)
      raw[#raw + 1] = l
      pos = pos + n + 1
    end
  end
  return table.concat(labels, "."), after, raw
end

-- encode_name(raw labels) -> wire form (no compression)
function M.encode_name(raw)
  local out = {}
  for _, l in ipairs(raw) do out[#out + 1] = char(#l) .. l end
  out[#out + 1] = "\0"
  return table.concat(out)
end

local function header(msg)
  if type(msg) ~= "string" then return nil, "not a message" end
  if #msg < 12 then return nil, "shorter than a header" end
  if #msg > M.MAX_MESSAGE then return nil, "longer than " .. M.MAX_MESSAGE .. " bytes" end
  local flags = u16(msg, 3)
  return {
    id = u16(msg, 1), qr = bit.band(flags, 0x8000) ~= 0, opcode = bit.band(bit.rshift(flags, 11), 15),
    aa = bit.band(flags, 0x0400) ~= 0, tc = bit.band(flags, 0x0200) ~= 0, rd = bit.band(flags, 0x0100) ~= 0,
    rcode = bit.band(flags, 15),
    qdcount = u16(msg, 5), ancount = u16(msg, 7), nscount = u16(msg, 9), arcount = u16(msg, 11),
  }
end
M.header = header

local function question(msg, h)
  if h.qdcount ~= 1 then return nil, "not exactly one question" end
  local name, i, raw = M.read_name(msg, 13)
  if not name then return nil, i end
  if i + 3 > #msg then return nil, "question runs past the message" end
  h.qname, h.qraw = name, raw
  h.qtype, h.qclass = u16(msg, i), u16(msg, i + 2)
  return i + 4
end

-- parse_query(msg) -> query | nil, why. query: the header's fields (id,
-- opcode, rd, ...) and qname (dotted, lower case), qraw (its labels as
-- sent), qtype, qclass. A query has QR clear, one question, no answer or
-- authority records, at most one additional (an EDNS OPT), nothing after.
function M.parse_query(msg)
  local h, why = header(msg)
  if not h then return nil, why end
  if h.qr then return nil, "a response, not a query" end
  local i
  i, why = question(msg, h)
  if not i then return nil, why end
  if h.ancount ~= 0 or h.nscount ~= 0 or h.arcount > 1 then return nil, "records in a query" end
  if h.arcount == 0 and i <= #msg then return nil, "bytes after the question" end
  return h
end

-- is_hostname(query) -> true when every label is letters, digits, '-' or
-- '_' (what the forwarder sends upstream: no byte a rule could misread)
function M.is_hostname(q)
  if #q.qraw == 0 then return false end
  for _, l in ipairs(q.qraw) do
    if #l == 0 or l:find("[^%w%-_]") then return false end
  end
  return true
end

-- parse_answer(msg) -> answer | nil, why. answer: the header's fields,
-- qname, qtype, qclass, and records = {{name, type, class, ttl,
-- ttl_at (1-based index of the TTL field), address (A: dotted),
-- target (CNAME: a name)}} of the answer section (at most MAX_RECORDS).
function M.parse_answer(msg)
  local h, why = header(msg)
  if not h then return nil, why end
  if not h.qr then return nil, "a query, not a response" end
  local i
  i, why = question(msg, h)
  if not i then return nil, why end
  if h.ancount > M.MAX_RECORDS then return nil, "too many answer records" end
  local records = {}
  for _ = 1, h.ancount do
    local name, after = M.read_name(msg, i)
    if not name then return nil, after end
    if after + 9 > #msg then return nil, "record runs past the message" end
    local rr = { name = name, type = u16(msg, after), class = u16(msg, after + 2), ttl = u32(msg, after + 4),
      ttl_at = after + 4 }
    local rdlen = u16(msg, after + 8)
    local rdata = after + 10
    if rdata + rdlen - 1 > #msg then return nil, "record data runs past the message" end
    -- RFC 2181: a TTL with the top bit set is zero
    if rr.ttl >= 2147483648 then rr.ttl = 0 end
    if rr.type == M.TYPE.A and rr.class == M.CLASS_IN then
      if rdlen ~= 4 then return nil, "an A record that is not 4 bytes" end
      rr.address = ("%d.%d.%d.%d"):format(byte(msg, rdata, rdata + 3))
    elseif rr.type == M.TYPE.CNAME and rr.class == M.CLASS_IN then
      local target, target_end = M.read_name(msg, rdata)
      if not target then return nil, target_end end
      if target_end ~= rdata + rdlen then return nil, "a CNAME whose name is not its data" end
      rr.target = target
    end
    records[#records + 1] = rr
    i = rdata + rdlen
  end
  h.records = records
  return h
end

-- addresses(answer) -> {{address, ttl}}: the A records of the question's
-- name, following CNAMEs within the answer (at most MAX_CNAMES hops); each
-- TTL is the least along its chain.
function M.addresses(a)
  local out = {}
  local name, ttl = a.qname, math.huge
  local seen = {}
  for _ = 0, M.MAX_CNAMES do
    seen[name] = true
    local next_name, next_ttl
    for _, rr in ipairs(a.records) do
      if rr.name == name then
        if rr.address then
          out[#out + 1] = { address = rr.address, ttl = math.min(ttl, rr.ttl) }
        elseif rr.target and not next_name then
          next_name, next_ttl = rr.target, math.min(ttl, rr.ttl)
        end
      end
    end
    if #out > 0 or not next_name or seen[next_name] then break end
    name, ttl = next_name, next_ttl
  end
  return out
end

-- query(id, q) -> a query for q's question (its labels as sent), RD set,
-- nothing else of what the client sent
function M.query(id, q)
  return be16(id) .. "\1\0" .. be16(1) .. be16(0) .. be16(0) .. be16(0) .. M.encode_name(q.qraw) ..
    be16(q.qtype) .. be16(q.qclass)
end

-- reply(q, rcode) -> an answer with no records to query q (its question
-- echoed when it has one), RA set
function M.reply(q, rcode)
  local flags = 0x8000 + bit.lshift(q.opcode or 0, 11) + (q.rd and 0x0100 or 0) + 0x0080 + rcode
  local body = ""
  if q.qraw then body = M.encode_name(q.qraw) .. be16(q.qtype) .. be16(q.qclass) end
  return be16(q.id) .. be16(flags) .. be16(q.qraw and 1 or 0) .. be16(0) .. be16(0) .. be16(0) .. body
end

-- relay(msg, answer, id, max_ttl) -> msg with the client's id, and every
-- answer record's TTL above max_ttl lowered to it (the client asks again
-- before the addresses it was given close)
function M.relay(msg, a, id, max_ttl)
  local parts, last = { be16(id) }, 3
  for _, rr in ipairs(a.records) do
    if rr.ttl > max_ttl then
      parts[#parts + 1] = sub(msg, last, rr.ttl_at - 1)
      parts[#parts + 1] = be32(max_ttl)
      last = rr.ttl_at + 4
    end
  end
  parts[#parts + 1] = sub(msg, last)
  return table.concat(parts)
end

return M
