-- Egress rules: `egress = {allow = {...}, deny = {...}}` read into CIDRs,
-- CIDR:port pairs and domain names (docs/network.md). Pure: no system call.
local errors = require "moonbox.errors"

local M = {}

local function fail(field, message)
  errors.raise("VALIDATION_FAILED", ("%s: %s"):format(field, message), { field = field })
end

-- "a.b.c.d" -> 32-bit number (as a Lua number, 0..2^32-1) | nil
function M.parse_ipv4(s)
  local a, b, c, d = s:match("^(%d+)%.(%d+)%.(%d+)%.(%d+)$")
  if not a then return nil end
  local n = 0
  for _, part in ipairs { a, b, c, d } do
    if #part > 3 or tonumber(part) > 255 then return nil end
    n = n * 256 + tonumber(part)
  end
  return n
end

function M.format_ipv4(n)
  return ("%d.%d.%d.%d"):format(math.floor(n / 16777216) % 256, math.floor(n / 65536) % 256,
    math.floor(n / 256) % 256, n % 256)
end

-- "a.b.c.d/len" or "a.b.c.d" -> {net = number, len = number} | nil, why
function M.parse_cidr(s)
  local addr, len = s:match("^([%d%.]+)/(%d+)$")
  if not addr then addr, len = s, "32" end
  local n = M.parse_ipv4(addr)
  len = tonumber(len)
  if not n then return nil end
  if len > 32 then return nil, "prefix length above 32" end
  local size = 2 ^ (32 - len)
  if n % size ~= 0 then return nil, ("host bits set (did you mean %s/%d?)"):format(M.format_ipv4(n - n % size), len) end
  return { net = n, len = len }
end

function M.cidr_string(c) return ("%s/%d"):format(M.format_ipv4(c.net), c.len) end

-- inner lies wholly inside outer
function M.within(inner, outer)
  if inner.len < outer.len then return false end
  local size = 2 ^ (32 - outer.len)
  return inner.net - inner.net % size == outer.net
end

-- A domain name as a rule: letters, digits, hyphens, dots; at least one
-- dot (a bare word is a mistake more often than a TLD); covers its
-- subdomains (the resolver matches a suffix).
local function parse_domain(s)
  s = s:lower():gsub("%.$", "")
  if #s > 253 or not s:find("%.") or s:find("%.%.") or s:find("^[.-]") then return nil end
  if not s:match("^[a-z0-9.-]+$") or not s:find("[a-z]") then return nil end
  for label in s:gmatch("[^.]+") do
    if #label > 63 or label:find("^%-") or label:find("%-$") then return nil end
  end
  return s
end

-- One rule string -> {cidr = {...}} | {domain = "..."}, with .port when given
function M.parse_rule(s, field)
  if type(s) ~= "string" or s == "" then fail(field, "expected a CIDR, an address, a domain name, each with an " ..
    "optional :port") end
  if s:find(":.*:") or s:find("^%[") then fail(field, ("%q: IPv6 is not routed in egress mode (every IPv6 " ..
    "packet is dropped)"):format(s)) end
  local host, port = s:match("^(.-):(%d+)$")
  if host then
    port = tonumber(port)
    if port < 1 or port > 65535 then fail(field, ("%q: port out of 1-65535"):format(s)) end
  else
    host = s
  end
  if host:match("^[%d%./]+$") then
    local cidr, why = M.parse_cidr(host)
    if not cidr then
      fail(field, ("%q: not an IPv4 address or CIDR%s"):format(s, why and (" (" .. why .. ")") or ""))
    end
    return { cidr = cidr, port = port, text = s }
  end
  local domain = parse_domain(host)
  if not domain then fail(field, ("%q: not a CIDR, address or domain name"):format(s)) end
  return { domain = domain, port = port, text = s }
end

M.MAX_RULES = 256

-- parse{allow = {...}, deny = {...}} -> {allow = {rule...}, deny = {rule...}}
function M.parse(egress, field)
  field = field or "egress"
  if egress == nil then return { allow = {}, deny = {} } end
  if type(egress) ~= "table" then fail(field, "expected a table {allow = {...}, deny = {...}}") end
  local out = {}
  for k in pairs(egress) do
    if k ~= "allow" and k ~= "deny" then fail(field .. "." .. tostring(k), "unknown key (allow, deny)") end
  end
  for _, side in ipairs { "allow", "deny" } do
    local list = egress[side]
    out[side] = {}
    if list ~= nil then
      if type(list) ~= "table" then fail(field .. "." .. side, "expected an array of strings") end
      if #list > M.MAX_RULES then fail(field .. "." .. side, ("at most %d rules"):format(M.MAX_RULES)) end
      for k in pairs(list) do
        if type(k) ~= "number" or k < 1 or k > #list or k % 1 ~= 0 then
          fail(field .. "." .. side, "expected an array of strings")
        end
      end
      for i, s in ipairs(list) do out[side][i] = M.parse_rule(s, ("%s.%s[%d]"):format(field, side, i)) end
    end
  end
  return out
end

-- Always refused unless an allow rule inside them names them: loopback,
-- "this network", link-local (the cloud metadata address), multicast and
-- reserved. The sandboxes' own range and the host's addresses are added
-- by the caller.
M.ALWAYS_DENIED = { "0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "240.0.0.0/4" }
-- Refused by default (RFC 1918, CGNAT), opened by an allow rule inside them.
M.PRIVATE = { "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10" }

return M
