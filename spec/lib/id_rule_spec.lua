-- The one id rule (lua/moonbox/lib/validate.lua, V.id): session, process and
-- code context ids, and ids taken from an HTTP path, are 1-128 characters
-- [A-Za-z0-9_.-], not "." or "..". The cases below are where the copies had
-- drifted apart: code contexts took any length, process ids took "." and
-- ".." (and a non-string failed with a Lua error, not VALIDATION_FAILED).
local V = require "moonbox.lib.validate"
local router = require "moonbox.server.api_router"
local run_task = run_task -- helper.lua

local LONG = ("a"):rep(129)
local MAX = ("b"):rep(128)

local function refused(fn, ...)
  local ok, err = pcall(fn, ...)
  assert.is_false(ok)
  assert.is_table(err, tostring(err))
  assert.equal("VALIDATION_FAILED", err.code, err.message)
  return err
end

describe("one id rule", function()
  it("is the same rule for every kind of id", function()
    for _, bad in ipairs { "", ".", "..", LONG, "a/b", "a b", "é", 5, false } do
      for _, what in ipairs { "session id", "process id", "code context id" } do
        local err = refused(V.id, bad, "field", what)
        assert.equal("field", err.context.field)
        assert.truthy(err.message:find("invalid " .. what, 1, true), err.message)
      end
      if type(bad) == "string" then refused(router.check_id, bad, "sessionId") end
    end
    assert.truthy(refused(V.id, 5, "id", "session id").message:find("expected a string, got number", 1, true))
    for _, good in ipairs { "a", "A-b_c.1", "...", ".a", MAX } do
      assert.equal(good, V.id(good, "field", "session id"))
      assert.equal(good, router.check_id(good, "processId"))
    end
  end)

  it("holds for code context ids (which took any length) and process ids (which took . and ..)", function()
    run_task(function()
      local sb = helper.new_sandbox()
      local ok, err = pcall(function()
        local s = sb:createSession { id = "ids" }
        assert.equal("id", refused(s.createCodeContext, s, { language = "lua", id = LONG }).context.field)
        assert.is_nil(sb.contexts and sb.contexts[LONG])
        for _, bad in ipairs { ".", "..", LONG, 7 } do
          assert.equal("processId", refused(s.startProcess, s, "true", { processId = bad }).context.field)
          assert.is_nil(sb.processes[bad])
        end
        for _, bad in ipairs { ".", "..", LONG } do
          assert.equal("id", refused(sb.createSession, sb, { id = bad }).context.field)
        end
        -- the longest id is taken everywhere
        local ctx = s:createCodeContext { language = "lua", id = MAX }
        assert.equal(MAX, ctx.id)
        s:deleteCodeContext(MAX)
        local p = s:startProcess("true", { processId = MAX })
        assert.equal(MAX, p.id)
        p:waitForExit()
        assert.equal(MAX, sb:createSession { id = MAX }.id)
      end)
      sb:destroy()
      if not ok then error(err, 0) end
    end)
  end)

  it("keeps the sandbox id's own rule (a hostname) and the backup id's (hex)", function()
    for _, bad in ipairs { "", "-a", "a-", "A", "a.b", ("a"):rep(64), 1 } do refused(V.sandbox_id, bad, "id") end
    assert.equal(("a"):rep(63), V.sandbox_id(("a"):rep(63), "id"))
    for _, bad in ipairs { "", "xyz", ("a"):rep(65), ".." } do refused(V.backup_id, bad, "id") end
    assert.equal("deadbeef", V.backup_id("deadbeef", "id"))
  end)
end)
