-- What the shared objects export (built with -fvisibility=hidden): libmoonbox
-- exactly the functions src/moonbox.h declares with MOONBOX_API, moonbox/core.so
-- only luaopen_moonbox_core. Everything else (src/private.h) stays inside.
local SRC = os.getenv("MOONBOX_SOURCE_DIR") or "."
local BUILD = os.getenv("MOONBOX_BUILD_DIR") or "build"

local function slurp(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("*a")
  f:close()
  return s
end

-- the sorted names of the functions and data an ELF file defines and exports
local function exports(path)
  assert.is_truthy(io.open(path, "rb"), path)
  local out = helper.sh("nm -D --defined-only '" .. path .. "' && echo nm-ok")
  assert.matches("nm%-ok$", out)
  local names = {}
  for kind, name in out:gmatch("%x+ (%a) ([%w_]+)") do
    if kind:match("[TDBRVW]") then names[#names + 1] = name end
  end
  table.sort(names)
  return names
end

describe("exported symbols", function()
  it("libmoonbox exports exactly the moonbox.h API", function()
    local api = {}
    for name in slurp(SRC .. "/src/moonbox.h"):gmatch("\nMOONBOX_API [^(]-%*?(moonbox_[%w_]+)%(") do
      api[#api + 1] = name
    end
    table.sort(api)
    assert.is_true(#api >= 10)
    assert.same(api, exports(BUILD .. "/libmoonbox.so"))
  end)

  it("moonbox/core.so exports only luaopen_moonbox_core", function()
    assert.same({ "luaopen_moonbox_core" }, exports(BUILD .. "/lib/moonbox/core.so"))
  end)
end)
