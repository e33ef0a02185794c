-- moonbox.core magic binding (src/magic.c): libmagic's MIME type and encoding.
local core = require "moonbox.core"

describe("core.magic_buffer", function()
  it("raises for a non-string and a negative limit", function()
    assert.has_error(function() core.magic_buffer({}) end)
    assert.has_error(function() core.magic_buffer("x", -1) end)
  end)

  it("names MIME type and encoding", function()
    local cases = {
      { '{"a": [1, 2]}\n', "application/json", "us-ascii" },
      { "plain words\n", "text/plain", "us-ascii" },
      { "grüße\n", "text/plain", "utf-8" },
      { "\137PNG\r\n\26\n\0\0\0\rIHDR\0\0\0\1\0\0\0\1\8\6\0\0\0\31\21\196\137", "image/png", "binary" },
      { "%PDF-1.4\n", "application/pdf", nil },
      { "\0\1\2\3", "application/octet-stream", "binary" },
    }
    for _, c in ipairs(cases) do
      local mime, enc = core.magic_buffer(c[1])
      assert.equal(c[2], mime, c[1])
      if c[3] then assert.equal(c[3], enc, c[1]) end
    end
  end)

  it("reads a core.bytes buffer in place", function()
    local b = core.bytes()
    b:append('{"list": [1, 2, 3]}')
    assert.equal("application/json", (core.magic_buffer(b)))
    b:free()
  end)

  it("looks at no more than max_bytes", function()
    local json = '{"a": 1}'
    assert.equal("application/json", (core.magic_buffer(json .. "\n")))
    assert.equal("text/plain", (core.magic_buffer('{"a": 1} trailing words', 8 + 9)))
  end)
end)
