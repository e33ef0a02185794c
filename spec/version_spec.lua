-- The version is defined once: project(moonbox VERSION x.y.z) in
-- CMakeLists.txt. The C reads it from the generated moonbox_version.h, the
-- Lua half from core.version; the files that cannot read it (the rockspec,
-- whose name luarocks parses, and the commands the docs show) must agree.
local core = require "moonbox.core"
local moonbox = require "moonbox"

local SRC = os.getenv("MOONBOX_SOURCE_DIR") or "."
local BUILD = os.getenv("MOONBOX_BUILD_DIR") or "build"
local BIN = os.getenv("MOONBOX_BIN") or "build/moonbox"

local function slurp(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("*a")
  f:close()
  return s
end

local VERSION = slurp(SRC .. "/CMakeLists.txt"):match("\nproject%(moonbox VERSION (%d+%.%d+%.%d+)[ )]")

describe("the version", function()
  it("is defined in CMakeLists.txt", function()
    assert.is_string(VERSION)
  end)

  it("reaches the C through the generated header, and the library and command report it", function()
    local header = slurp(BUILD .. "/include/moonbox_version.h")
    assert.matches('\n#define MOONBOX_VERSION "' .. VERSION:gsub("%.", "%%.") .. '"\n', header)
    local major, minor, patch = VERSION:match("^(%d+)%.(%d+)%.(%d+)$")
    assert.matches("\n#define MOONBOX_VERSION_MAJOR " .. major .. "\n", header, 1, true)
    assert.matches("\n#define MOONBOX_VERSION_MINOR " .. minor .. "\n", header, 1, true)
    assert.matches("\n#define MOONBOX_VERSION_PATCH " .. patch .. "\n", header, 1, true)
    -- no literal version left in the public header
    assert.is_nil(slurp(SRC .. "/src/moonbox.h"):find("%d+%.%d+%.%d+"))
    assert.equals("moonbox " .. VERSION, helper.sh("'" .. BIN .. "' --version | head -n 1"))
    assert.matches("\nVersion: " .. VERSION:gsub("%.", "%%.") .. "\n", slurp(BUILD .. "/moonbox.pc"))
  end)

  it("reaches the Lua half through the core", function()
    assert.equals(VERSION, core.version)
    assert.equals(VERSION, moonbox.VERSION)
    assert.equals(VERSION, moonbox.versions().moonbox)
    -- no Lua module spells a version of its own
    local hits = helper.sh("grep -rnE 'VERSION *= *\"' '" .. SRC .. "/lua' || true")
    assert.equals("", hits)
  end)

  it("names the one rockspec, whose version field agrees", function()
    local names = helper.sh("cd '" .. SRC .. "' && ls moonbox-*.rockspec")
    assert.equals("moonbox-" .. VERSION .. "-1.rockspec", names)
    local env = {}
    local chunk = assert(loadfile(SRC .. "/" .. names))
    setfenv(chunk, env)
    chunk()
    assert.equals(VERSION .. "-1", env.version)
  end)

  it("is the one the docs and deploy files show", function()
    local seen = 0
    local files = helper.sh("cd '" .. SRC .. "' && ls README.md docs/*.md examples/*.md deploy/Dockerfile "
      .. "deploy/*/*.yaml 2>/dev/null")
    for name in files:gmatch("[^\n]+") do
      local text = slurp(SRC .. "/" .. name)
      -- moonbox:X.Y.Z (images), moonbox_X.Y.Z_ (the .deb), moonbox-X.Y.Z-1 (the rockspec)
      for v in text:gmatch("moonbox[:_%-](%d+%.%d+%.%d+)") do
        seen = seen + 1
        assert.equals(VERSION, v, name .. " shows moonbox " .. v)
      end
    end
    assert.is_true(seen > 0)
  end)
end)
