-- core.sandbox_init's id maps (src/nsinit_host.c, src/id_map.c): the caller
-- (lua/moonbox/sandbox/isolation.lua) derives them and the core has no
-- default of its own; a missing or malformed map is refused with EINVAL
-- before anything is opened or started, so these cases need no namespaces.
local core = require "moonbox.core"

local function start(uid_map, gid_map)
  return core.sandbox_init {
    namespaces = { "user", "mnt", "pid" },
    uid_map = uid_map,
    gid_map = gid_map,
    setgroups = "deny",
  }
end

describe("core.sandbox_init id maps", function()
  local good = "0 100000 65536\n"

  it("refuses a missing map: the caller derives it", function()
    local init, msg, code = start(nil, good)
    assert.is_nil(init)
    assert.equal("EINVAL", code)
    assert.equal("EINVAL: invalid argument (sandbox_init: uid_map is required (a string))", msg)
    init, msg, code = start(good, nil)
    assert.is_nil(init)
    assert.equal("EINVAL", code)
    assert.equal("EINVAL: invalid argument (sandbox_init: gid_map is required (a string))", msg)
  end)

  it("refuses a map that is not a string", function()
    local init, msg, code = start(good, 0)
    assert.is_nil(init)
    assert.equal("EINVAL", code)
    assert.matches("gid_map is required", msg, 1, true)
  end)

  local bad = {
    ["is empty"] = "",
    ["has a NUL byte"] = "0 100000 1\0\n",
    ['has a line that is not "inside outside count"'] = { "0 100000\n", "0 100000 1 7\n", "x 1 1\n",
      "0 -1 1\n", "0 1 1\n\n", "0 4294967296 1\n" },
    ["has a line with a count of 0"] = "0 100000 0\n",
    ["has a range past 2^32"] = { "0 4294967295 2\n", "4294967295 0 2\n" },
    ["has more than 340 lines"] = ("0 1 1\n"):rep(341),
    ["is too long"] = ("0 100000 1\n"):rep(400),
  }
  for why, maps in pairs(bad) do
    if type(maps) == "string" then maps = { maps } end
    it("refuses a map that " .. why, function()
      for _, map in ipairs(maps) do
        local init, msg, code = start(map, good)
        assert.is_nil(init)
        assert.equal("EINVAL", code)
        assert.equal("EINVAL: invalid argument (sandbox_init: uid_map " .. why .. ")", msg)
      end
    end)
  end

  it("refuses a missing setgroups: the caller decides it", function()
    assert.has_error(function()
      core.sandbox_init { namespaces = { "user", "mnt", "pid" }, uid_map = good, gid_map = good }
    end, 'sandbox_init: setgroups: expected "allow" or "deny"')
  end)
end)
