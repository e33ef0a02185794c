-- Values derived from the server's token (docs/server.md, Security and
-- Exposed ports): a cookie never holds the token itself, only an HMAC of
-- it that authorizes one thing. The page's cookie opens the page's files;
-- a port's cookie opens that port of that sandbox, under its own name.
--   token.page_cookie(token)         -> value of moonbox_token
--   token.port_cookie(token, id, n)  -> name, value
--   token.hmac_sha256(key, msg)      -> 64 hex digits
--   token.new()                      -> a new token
local bit = require "bit"
local util = require "moonbox.lib.util"

local M = {}

local band, bor, bxor, bnot = bit.band, bit.bor, bit.bxor, bit.bnot
local rshift, lshift, ror, tobit = bit.rshift, bit.lshift, bit.ror, bit.tobit

local K = {
  0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
  0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
  0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
  0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
  0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
  0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
  0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
  0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
}
for i = 1, 64 do K[i] = tobit(K[i]) end

-- SHA-256 (FIPS 180-4) of a string -> 32 bytes
function M.sha256(msg)
  local len = #msg
  msg = msg .. "\128" .. ("\0"):rep((55 - len) % 64)
  local bits = len * 8
  local tail = {}
  for i = 8, 1, -1 do
    tail[i] = string.char(bits % 256)
    bits = math.floor(bits / 256)
  end
  msg = msg .. table.concat(tail)
  local h = { tobit(0x6a09e667), tobit(0xbb67ae85), tobit(0x3c6ef372), tobit(0xa54ff53a),
              tobit(0x510e527f), tobit(0x9b05688c), tobit(0x1f83d9ab), tobit(0x5be0cd19) }
  local w = {}
  for chunk = 1, #msg, 64 do
    for i = 0, 15 do
      local a, b, c, d = msg:byte(chunk + i * 4, chunk + i * 4 + 3)
      w[i] = bor(lshift(a, 24), lshift(b, 16), lshift(c, 8), d)
    end
    for i = 16, 63 do
      local x, y = w[i - 15], w[i - 2]
      local s0 = bxor(ror(x, 7), ror(x, 18), rshift(x, 3))
      local s1 = bxor(ror(y, 17), ror(y, 19), rshift(y, 10))
      w[i] = tobit(w[i - 16] + s0 + w[i - 7] + s1)
    end
    local a, b, c, d, e, f, g, hh = h[1], h[2], h[3], h[4], h[5], h[6], h[7], h[8]
    for i = 0, 63 do
      local S1 = bxor(ror(e, 6), ror(e, 11), ror(e, 25))
      local ch = bxor(band(e, f), band(bnot(e), g))
      local t1 = tobit(hh + S1 + ch + K[i + 1] + w[i])
      local S0 = bxor(ror(a, 2), ror(a, 13), ror(a, 22))
      local maj = bxor(band(a, b), band(a, c), band(b, c))
      local t2 = tobit(S0 + maj)
      hh, g, f, e, d, c, b, a = g, f, e, tobit(d + t1), c, b, a, tobit(t1 + t2)
    end
    h[1], h[2], h[3], h[4] = tobit(h[1] + a), tobit(h[2] + b), tobit(h[3] + c), tobit(h[4] + d)
    h[5], h[6], h[7], h[8] = tobit(h[5] + e), tobit(h[6] + f), tobit(h[7] + g), tobit(h[8] + hh)
  end
  local out = {}
  for i = 1, 8 do
    local v = h[i]
    out[i] = string.char(band(rshift(v, 24), 255), band(rshift(v, 16), 255), band(rshift(v, 8), 255), band(v, 255))
  end
  return table.concat(out)
end

local function hex(s)
  return (s:gsub(".", function(ch) return ("%02x"):format(ch:byte()) end))
end

-- HMAC-SHA256 (RFC 2104) -> hex
function M.hmac_sha256(key, msg)
  if #key > 64 then key = M.sha256(key) end
  key = key .. ("\0"):rep(64 - #key)
  local ipad = key:gsub(".", function(ch) return string.char(bxor(ch:byte(), 0x36)) end)
  local opad = key:gsub(".", function(ch) return string.char(bxor(ch:byte(), 0x5c)) end)
  return hex(M.sha256(opad .. M.sha256(ipad .. msg)))
end

-- derived values are asked for on every request: kept per token and purpose
local cache, cached = {}, 0
local function derive(token, purpose)
  local key = token .. "\0" .. purpose
  local v = cache[key]
  if not v then
    if cached >= 4096 then cache, cached = {}, 0 end
    v = M.hmac_sha256(token, "moonbox\0" .. purpose)
    cache[key], cached = v, cached + 1
  end
  return v
end

M.PAGE_COOKIE = "moonbox_token"
M.PORT_COOKIE_PREFIX = "moonbox_port_"

function M.page_cookie(token)
  return derive(token, "page")
end

function M.port_cookie(token, id, port)
  return M.PORT_COOKIE_PREFIX .. id .. "_" .. port, derive(token, ("port\0%s\0%d"):format(id, port))
end

-- A new token: 32 hex digits from the kernel's random source.
function M.new() return util.random_hex(16) end

return M
