-- moonbox.core codec family (src/codec.c): base64, UTF-8 checks and the
-- bytes buffer the file API moves big files through.
local core = require "moonbox.core"
local async = require "moonbox.async"
local fs = require "moonbox.lib.fs"

local mkdtemp = helper.mkdtemp

local every_byte = (function()
  local t = {}
  for i = 0, 255 do t[#t + 1] = string.char(i) end
  return table.concat(t)
end)()

describe("core.base64", function()
  it("returns nil for anything that is not standard, padded-at-the-end base64", function()
    for _, bad in ipairs { "Y", "YQ=", "Y===", "YW=j", "YWJj ", " YWJj", "YW\nJj", "YW-_", "YWJj=", "====", "é" } do
      assert.is_nil(core.base64_decode(bad), bad)
    end
  end)

  it("round-trips every length and byte value, with or without padding", function()
    for n = 0, 300 do
      local s = every_byte:rep(2):sub(1, n)
      local e = core.base64_encode(s)
      assert.equal(0, #e % 4)
      assert.equal(s, core.base64_decode(e))
      assert.equal(s, core.base64_decode((e:gsub("=+$", ""))))
    end
    assert.equal("YWJj", core.base64_encode("abc"))
    assert.equal("YQ==", core.base64_encode("a"))
    assert.equal("", core.base64_decode(""))
  end)
end)

describe("core.utf8_valid and core.text_info", function()
  it("rejects overlongs, surrogates, code points above U+10FFFF and cut sequences", function()
    for _, bad in ipairs { "\192\128", "\224\128\128", "\237\160\128", "\244\144\128\128", "\226\130", "ab\255" } do
      assert.is_false(core.utf8_valid(bad), ("%q"):format(bad))
    end
    local ok, pos = core.utf8_valid(("x"):rep(20) .. "\255")
    assert.is_false(ok)
    assert.equal(21, pos)
  end)

  it("accepts UTF-8 and tells NUL and control bytes apart from text controls", function()
    assert.is_true(core.utf8_valid("grüße, 世界 \240\159\152\128"))
    assert.same({ true, false, false }, { core.text_info("tab\tline\r\n\27[0m\b\f\v") })
    assert.same({ true, true, false }, { core.text_info(("x"):rep(17) .. "\0") })
    assert.same({ true, false, true }, { core.text_info("\1") })
    assert.same({ true, false, true }, { core.text_info("del\127") })
    assert.same({ false, false, false, 2 }, { core.text_info("a\255") })
    assert.same({ false, false, false, 2 }, { core.text_info("a\255\0") }) -- stops at the first bad byte
  end)

  it("classifies a byte wherever it sits in a block, word or tail of ASCII", function()
    -- the scan reads 16-byte blocks, then 8-byte words, then single bytes
    local cases = { ["\0"] = { true, true, false }, ["\1"] = { true, false, true }, ["\127"] = { true, false, true },
      ["\31"] = { true, false, true }, ["\n"] = { true, false, false }, ["\27"] = { true, false, false },
      ["\8"] = { true, false, false }, ["\13"] = { true, false, false }, ["\14"] = { true, false, true },
      ["\7"] = { true, false, true }, ["~"] = { true, false, false } }
    for byte, want in pairs(cases) do
      for pos = 1, 40 do
        local s = ("a"):rep(pos - 1) .. byte .. ("b"):rep(40 - pos)
        assert.same(want, { core.text_info(s) }, ("byte %d at %d"):format(byte:byte(), pos))
        -- after a multi-byte character the scan restarts mid-string
        assert.same(want, { core.text_info("é" .. s) }, ("byte %d at %d after é"):format(byte:byte(), pos))
      end
    end
  end)
end)

describe("core.bytes", function()
  it("raises when used after free or while a read is in flight", function()
    run_task(function()
      local b = core.bytes()
      b:free()
      assert.has_error(function() b:size() end)
      local dir = mkdtemp()
      local f = io.open(dir .. "/f", "wb") f:write("data") f:close()
      local fd = assert(fs.open(dir .. "/f", "r"))
      local busy = core.bytes(16)
      local n = async.await(function(resume)
        assert.is_true(busy:read(fd, 16, 0, function(err, got) resume(err or got) end))
        assert.has_error(function() busy:append("x") end)
        assert.has_error(function() busy:free() end)
      end)
      assert.equal(4, n)
      assert.equal("data", busy:tostring())
      fs.close(fd)
      os.execute("rm -rf " .. dir)
    end)
  end)

  it("drops its first bytes, moving the rest to the front", function()
    local b = core.bytes()
    b:append("0123456789")
    b:drop(3)
    assert.equal("3456789", b:tostring())
    b:append("ab")
    assert.equal(9, b:size())
    b:drop(0)
    assert.equal("3456789ab", b:tostring())
    b:drop(100)
    assert.equal(0, b:size())
    assert.equal("", b:tostring())
    b:append("x")
    assert.equal("x", b:tostring())
    assert.has_error(function() b:drop(-1) end)
    b:free()
    assert.has_error(function() b:drop(1) end)
  end)

  it("appends, slices, encodes and decodes without Lua strings in between", function()
    local b = core.bytes(2)
    b:append("hello ")
    b:append("world")
    assert.equal(11, b:size())
    assert.equal("hello world", b:tostring())
    assert.equal("world", b:tostring(7))
    assert.equal("ell", b:tostring(2, 4))
    assert.equal("", b:tostring(5, 4))
    assert.equal("aGVsbG8gd29ybGQ=", b:base64_encode())
    assert.is_nil(b:base64_decode("!!"))
    assert.equal("hello world", b:tostring())
    assert.is_true(b:base64_decode(core.base64_encode(every_byte)))
    assert.equal(every_byte, b:tostring())
    assert.is_false((b:utf8_valid()))
    local big = core.bytes()
    big:append(("z"):rep(5 * 1024 * 1024)) -- past the huge-page threshold, grown by mremap
    big:append("!")
    assert.equal(5 * 1024 * 1024 + 1, big:size())
    assert.equal("zz!", big:tostring(-3))
    big:free()
  end)

  it("reads a file into itself and writes itself out on the thread pool", function()
    run_task(function()
      local dir = mkdtemp()
      local src = every_byte:rep(1000)
      local f = io.open(dir .. "/src", "wb") f:write(src) f:close()
      local function await(start)
        return async.await(function(resume)
          assert.is_true(start(function(err, n, code) resume(err, n, code) end))
        end)
      end
      local b = core.bytes()
      local fd = assert(fs.open(dir .. "/src", "r"))
      local total = 0
      repeat
        local err, n = await(function(cb) return b:read(fd, 7000, nil, cb) end)
        assert.is_nil(err)
        total = total + n
      until n == 0
      fs.close(fd)
      assert.equal(#src, total)
      assert.equal(src, b:tostring())
      local out = assert(fs.open(dir .. "/out", "w"))
      local err, n = await(function(cb) return b:write(out, 0, nil, cb) end)
      assert.is_nil(err)
      assert.equal(#src, n)
      fs.close(out)
      local g = io.open(dir .. "/out", "rb") assert.equal(src, g:read("*a")) g:close()
      local bad_err, _, code = await(function(cb) return b:read(987654, 10, nil, cb) end)
      assert.equal("EBADF", code)
      assert.matches("^EBADF: ", bad_err)
      os.execute("rm -rf " .. dir)
    end)
  end)

  it("scans and encodes on the thread pool with a callback, the same as without, busy meanwhile", function()
    run_task(function()
      local function pool(b, method)
        return async.await(function(resume)
          assert.is_true(b[method](b, function(...) resume({ n = select("#", ...), ... }) end))
          assert.has_error(function() b:tostring() end, "bytes buffer is in use by a read or write")
          assert.has_error(function() b:free() end)
        end)
      end
      for _, content in ipairs { "", "plain text\n", every_byte:rep(3000), ("\0é"):rep(100000), "ok\255" } do
        local b = core.bytes()
        b:append(content)
        local r = pool(b, "base64_encode")
        assert.same({ n = 2, nil, core.base64_encode(content) }, r)
        r = pool(b, "text_info")
        assert.same({ n = 5, nil, core.text_info(content) }, { n = r.n, nil, r[2], r[3], r[4], r[5] })
        assert.equal(content, b:tostring()) -- unchanged
        b:free()
      end
      -- collected while the pool works on it: freed when the work is done
      local b = core.bytes()
      b:append(("x"):rep(3000000))
      local done
      b:base64_encode(function(err, s) done = { err, #s } end)
      b = nil -- luacheck: ignore 311
      collectgarbage()
      helper.eventually(function() return done ~= nil end)
      assert.same({ nil, 4000000 }, done)
    end)
  end)
end)
