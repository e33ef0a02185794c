-- The JSON a big exec output becomes (server/json_bytes.lua): its length,
-- counted in C, is exactly the bytes its slices send, for every byte value
-- the escapes treat apart (and valid UTF-8 beyond ASCII).
local core = require "moonbox.core"
local json = require "moonbox.server.api_json"
local json_bytes = require "moonbox.server.json_bytes"
local cjson = require "cjson"

local function part_of(text)
  local b = core.bytes()
  b:append(text)
  local t = { stdout = b }
  json_bytes.field(t, "stdout", "stdoutEncoding")
  return t.stdout, t
end

local function sent(part)
  local out = {}
  for piece in part.slices() do out[#out + 1] = piece end
  return table.concat(out)
end

describe("json_bytes", function()
  it("counts the length its slices send: every ASCII byte, quotes, backslashes, DEL, UTF-8", function()
    local ascii = {}
    for b = 0, 127 do ascii[#ascii + 1] = string.char(b) end
    -- (past json.BIG, so it is a part, sent in slices)
    local text = (table.concat(ascii) .. "é€😀"):rep(700)
    assert.is_true(#text > json.BIG)
    local part, t = part_of(text)
    assert.equal(json.PART, getmetatable(part))
    assert.is_nil(t.stdoutEncoding)
    local body = sent(part)
    assert.equal(#body, part.length())
    assert.equal(text, cjson.decode('{"s":' .. body .. "}").s)
    -- in a task the count runs on the thread pool: the same number
    local in_task
    require("moonbox").run(function() in_task = part.length() end)
    assert.equal(#body, in_task)
    part.release()
  end)

  it("sends a big output that is not UTF-8 as base64, with its length", function()
    local text = ("\255\0abc"):rep(30000)
    local part, t = part_of(text)
    assert.equal("base64", t.stdoutEncoding)
    local body = sent(part)
    assert.equal(#body, part.length())
    assert.equal(core.base64_encode(text), body:sub(2, -2))
    part.release()
  end)
end)
