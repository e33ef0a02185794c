-- Code contexts in an image sandbox (issue #30): the interpreter is looked
-- up along the image's PATH in the sandbox's own view, never on the host;
-- an image without it fails with INTERPRETER_NOT_AVAILABLE naming the
-- language and the image, and the image's symlinks resolve inside it.
local images = require "moonbox.images"
local fx = require "images.fixtures"

local fails = helper.fails
local tmp

-- oci:DIR of a busybox+bash image with PATH=path and extra entries
local function image(tag, path, add)
  local entries = fx.shell_entries()
  if add then add(entries) end
  local dir = tmp .. "/" .. tag
  fx.oci(dir, "latest", { config = { Env = { "PATH=" .. path } }, layers = { { entries = entries } } })
  return "oci:" .. dir
end

setup(function()
  tmp = helper.mkdtemp()
  images.store.DIR = tmp .. "/store"
end)
teardown(function()
  images.store.DIR = nil
  helper.sh("rm -rf '" .. tmp .. "'")
end)

local function with_sandbox(ref, fn)
  return run_task(function()
    local sb = helper.new_sandbox { image = ref, isolation = "namespaces" }
    local ok, err = pcall(fn, sb)
    sb:destroy()
    if not ok then error(err, 0) end
  end)
end

-- the name the error gives the image: info().image's name, else its digest
local function image_name(sb)
  local info = sb:info().image
  return info.name or info.digest
end

describe("code contexts in an image sandbox", function()
  it("fail with INTERPRETER_NOT_AVAILABLE naming the language and image when the image lacks it", function()
    -- the host has python3 (the kernels' own tests use it); the image does not
    assert.is_true(helper.sh("test -x /usr/bin/python3 && echo yes") == "yes")
    with_sandbox(image("nopython", "/usr/local/bin:/usr/bin:/bin"), function(sb)
      local err = fails("INTERPRETER_NOT_AVAILABLE", sb.createCodeContext, sb, { language = "python" })
      assert.matches("python interpreter \"python3\" not found", err.message, 1, true)
      assert.matches("of image " .. image_name(sb), err.message, 1, true)
      assert.equal("python", err.context.language)
      assert.equal(image_name(sb), err.context.image)
      -- a default context fails alike, and no context is left behind
      err = fails("INTERPRETER_NOT_AVAILABLE", sb.runCode, sb, "1 + 1", { language = "python" })
      assert.matches("of image " .. image_name(sb), err.message, 1, true)
      assert.same({}, sb:listCodeContexts())
    end)
  end)

  it("run the image's interpreter, found along the image's PATH", function()
    -- a place the host has no luajit at: only the image's can be run
    assert.equal("no", helper.sh("test -e /opt/lj/bin/luajit && echo yes || echo no"))
    local ref = image("luajit", "/opt/lj/bin:/bin", function(e) fx.luajit_entries(e, "opt/lj/bin/luajit") end)
    with_sandbox(ref, function(sb)
      local c = sb:createCodeContext { language = "lua" }
      local r = sb:runCode("return 6 * 7", { context = c })
      assert.is_nil(r.error)
      assert.equal("42", r.results[1].text)
      -- the kernel process's executable, as the sandbox sees it
      r = sb:runCode([[
        local ffi = require "ffi"
        ffi.cdef "long readlink(const char *path, char *buf, size_t size);"
        local buf = ffi.new("char[256]")
        local n = ffi.C.readlink("/proc/self/exe", buf, 256)
        return ffi.string(buf, n)]], { context = c })
      assert.is_nil(r.error)
      assert.equal("/opt/lj/bin/luajit", r.results[1].text)
      -- a default context too
      r = sb:runCode("return _VERSION", { language = "lua" })
      assert.equal("Lua 5.1", r.results[1].text)
    end)
  end)

  it("resolve the image's symlinks inside the image, never on the host", function()
    -- /opt/evil/luajit -> /usr/bin/luajit, and a relative one climbing out:
    -- both name the host's luajit if followed on the host; the image has none
    assert.equal("yes", helper.sh("test -x /usr/bin/luajit && echo yes"))
    for _, target in ipairs { "/usr/bin/luajit", "../../../../../../usr/bin/luajit" } do
      local ref = image("evil" .. #target, "/opt/evil:/bin", function(e)
        e[#e + 1] = { path = "opt", type = "dir" }
        e[#e + 1] = { path = "opt/evil", type = "dir" }
        e[#e + 1] = { path = "opt/evil/luajit", type = "symlink", target = target }
      end)
      with_sandbox(ref, function(sb)
        local err = fails("INTERPRETER_NOT_AVAILABLE", sb.createCodeContext, sb, { language = "lua" })
        assert.matches("lua interpreter \"luajit\" not found in PATH (/opt/evil:/bin) of image", err.message, 1,
          true)
      end)
    end
  end)

  it("follow a symlink that stays inside the image", function()
    local ref = image("linked", "/usr/local/bin:/bin", function(e)
      fx.luajit_entries(e, "opt/lj/bin/luajit")
      e[#e + 1] = { path = "usr/local", type = "dir" }
      e[#e + 1] = { path = "usr/local/bin", type = "dir" }
      e[#e + 1] = { path = "usr/local/bin/luajit", type = "symlink", target = "/opt/lj/bin/luajit" }
    end)
    with_sandbox(ref, function(sb)
      local r = sb:runCode("return 1 + 1", { language = "lua" })
      assert.is_nil(r.error)
      assert.equal("2", r.results[1].text)
    end)
  end)
end)
