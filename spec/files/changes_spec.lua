-- checkChanges (lua/moonbox/files/changes.lua): a kept watch per path and options,
-- versions that say whether anything changed since, resync when the state
-- that made a version is gone.
local changes = require "moonbox.files.changes"

local with_sandbox = helper.with_sandbox

local fails = helper.fails

describe("checkChanges", function()
  it("refuses bad arguments: a version it never made, unknown options, a missing path", function()
    with_sandbox(function(sb)
      sb:mkdir("/workspace/d")
      fails("VALIDATION_FAILED", sb.checkChanges, sb, "/workspace/d", { since = "nonsense" })
      fails("VALIDATION_FAILED", sb.checkChanges, sb, "/workspace/d", { bogus = true })
      fails("VALIDATION_FAILED", sb.checkChanges, sb, "/workspace/d", { include = 5 })
      assert.equal("unchanged", sb:checkChanges("/workspace/d", { include = "*.c" }).status) -- (as watch takes it)
      assert.matches("^checkChanges /workspace/missing: ", fails("FILE_NOT_FOUND", sb.checkChanges, sb,
        "/workspace/missing").message)
      local v = sb:checkChanges("/workspace/d").version
      local id = v:match("^(.*):%d+$")
      fails("VALIDATION_FAILED", sb.checkChanges, sb, "/workspace/d", { since = id .. ":99" })
    end)
  end)

  it("unchanged, then changed after a write, then unchanged again from the new version", function()
    with_sandbox(function(sb)
      sb:mkdir("/workspace/d")
      local first = sb:checkChanges("/workspace/d")
      assert.equal("unchanged", first.status)
      assert.is_true(first.success)
      local same = sb:checkChanges("/workspace/d", { since = first.version })
      assert.equal("unchanged", same.status)
      assert.equal(first.version, same.version)
      sb:writeFile("/workspace/d/a.txt", "x")
      local changed = sb:checkChanges("/workspace/d", { since = first.version })
      assert.equal("changed", changed.status)
      assert.are_not.equal(first.version, changed.version)
      assert.equal("unchanged", sb:checkChanges("/workspace/d", { since = changed.version }).status)
      -- the old version still says changed
      assert.equal("changed", sb:checkChanges("/workspace/d", { since = first.version }).status)
    end)
  end)

  it("recursive sees a change in a subdirectory; the non-recursive state is separate", function()
    with_sandbox(function(sb)
      sb:mkdir("/workspace/d/sub", { recursive = true })
      local deep = sb:checkChanges("/workspace/d", { recursive = true })
      local flat = sb:checkChanges("/workspace/d")
      sb:writeFile("/workspace/d/sub/f", "1")
      assert.equal("changed", sb:checkChanges("/workspace/d", { recursive = true, since = deep.version }).status)
      assert.equal("unchanged", sb:checkChanges("/workspace/d", { since = flat.version }).status)
    end)
  end)

  it("exclude leaves matching names out", function()
    with_sandbox(function(sb)
      sb:mkdir("/workspace/d")
      local v = sb:checkChanges("/workspace/d", { exclude = { "*.log" } }).version
      sb:writeFile("/workspace/d/x.log", "1")
      assert.equal("unchanged", sb:checkChanges("/workspace/d", { exclude = { "*.log" }, since = v }).status)
      sb:writeFile("/workspace/d/x.txt", "1")
      assert.equal("changed", sb:checkChanges("/workspace/d", { exclude = { "*.log" }, since = v }).status)
    end)
  end)

  it("keeps at most MAX_STATES states: the least recently used one is dropped", function()
    with_sandbox(function(sb)
      local max = changes.MAX_STATES
      changes.MAX_STATES = 2
      local ok, err = pcall(function()
        for _, d in ipairs { "a", "b", "c" } do sb:mkdir("/workspace/" .. d) end
        local va = sb:checkChanges("/workspace/a").version
        local vb = sb:checkChanges("/workspace/b").version
        sb:checkChanges("/workspace/c") -- a goes
        assert.equal("unchanged", sb:checkChanges("/workspace/b", { since = vb }).status)
        local r = sb:checkChanges("/workspace/a", { since = va })
        assert.equal("resync", r.status)
        assert.equal("expired", r.reason)
      end)
      changes.MAX_STATES = max
      assert(ok, err)
    end)
  end)

  it("resync when the state expired or its session was deleted", function()
    with_sandbox(function(sb)
      sb:mkdir("/workspace/d")
      local s = sb:createSession { id = "w" }
      local v = s:checkChanges("/workspace/d").version
      sb:deleteSession("w")
      s = sb:createSession { id = "w" }
      local r = s:checkChanges("/workspace/d", { since = v })
      assert.equal("resync", r.status)
      assert.equal("expired", r.reason)
      local ttl = changes.IDLE_TTL_MS
      changes.IDLE_TTL_MS = 0
      require("moonbox").sleep(5)
      local ok, r2 = pcall(s.checkChanges, s, "/workspace/d", { since = r.version })
      changes.IDLE_TTL_MS = ttl
      assert.is_true(ok, tostring(r2))
      assert.equal("resync", r2.status)
      assert.equal("expired", r2.reason)
      -- a version this runtime never made: restarted, with a state or without
      for _, path in ipairs { "/workspace/d", "/workspace" } do
        local r3 = s:checkChanges(path, { since = "changes-999999-1:0" })
        assert.equal("resync", r3.status)
        assert.equal("restarted", r3.reason)
      end
      -- options are checked also where a state exists already
      assert.equal("VALIDATION_FAILED", helper.error_of(s.checkChanges, s, "/workspace/d", { recursive = "yes" }).code)
    end)
  end)

  it("is named checkChanges to the policy's onFile, not watch", function()
    local ops = {}
    with_sandbox(function(sb)
      sb:mkdir("/workspace/d")
      sb:checkChanges("/workspace/d")
      assert.same({ "mkdir", "checkChanges" }, ops)
    end, { policy = { hooks = { onFile = function(_, op, path) ops[#ops + 1] = op return path end } } })
  end)
end)
