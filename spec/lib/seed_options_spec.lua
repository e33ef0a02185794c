-- The seed SDK's option names (lua/moonbox/lib/seed_options.lua): accepted
-- where they mean something here, refused naming the moonbox equivalent
-- where they do not.
local core = require "moonbox.core"

local function refused(fn, ...)
  local err = helper.error_of(fn, ...)
  assert.equal("VALIDATION_FAILED", err.code)
  return err.message
end

describe("seed option names", function()
  it("exec: stream = true is accepted and onOutput is called; encoding utf-8 accepted; the rest refused", function()
    helper.with_sandbox(function(sb)
      local seen = {}
      local r = sb:exec("printf 'a\\nb\\n'", { stream = true, encoding = "utf-8",
        onOutput = function(stream, data) seen[#seen + 1] = data assert.equal("stdout", stream) end })
      assert.same({ 0, "a\nb\n" }, { r.exitCode, r.stdout })
      assert.equal("a\nb\n", table.concat(seen))
      assert.equal(0, sb:exec("true", { stream = false }).exitCode)
      assert.truthy(refused(sb.exec, sb, "true", { stream = "yes" }):find("true or false", 1, true))
      assert.truthy(refused(sb.exec, sb, "true", { encoding = "base64" }):find("stdoutEncoding", 1, true))
      assert.truthy(refused(sb.exec, sb, "true", { onComplete = function() end }):find("exec returns", 1, true))
      assert.truthy(refused(sb.exec, sb, "true", { signal = {} }):find("task:cancel()", 1, true))
      assert.truthy(refused(sb.exec, sb, "true", { sessionId = "x" }):find("getSession", 1, true))
      -- an unknown name is still an unknown option
      assert.truthy(refused(sb.exec, sb, "true", { strem = true }):find("unknown option", 1, true))
    end)
  end)

  it("startProcess: encoding = base64 gives base64 logs, utf-8 raw ones; onError refused", function()
    helper.with_sandbox(function(sb)
      local p = sb:startProcess("printf 'caf\\303\\251'; printf err >&2", { encoding = "base64" })
      p:waitForExit(10000)
      local logs = sb:getProcessLogs(p.id)
      assert.same({ "base64", core.base64_encode("caf\195\169"), core.base64_encode("err") },
        { logs.encoding, logs.stdout, logs.stderr })
      local q = sb:startProcess("printf plain", { encoding = "utf-8" })
      q:waitForExit(10000)
      logs = sb:getProcessLogs(q.id)
      assert.same({ "plain" }, { logs.stdout, logs.encoding })
      assert.truthy(refused(sb.startProcess, sb, "true", { encoding = "latin1" }):find("base64", 1, true))
      assert.truthy(refused(sb.startProcess, sb, "true", { onError = function() end }):find("pcall", 1, true))
    end)
  end)

  it("gitCheckout: cloneTimeoutMs is the timeout; both at once refused", function()
    helper.with_sandbox(function(sb)
      -- a URL that fails validation after the options were taken: the options are accepted
      local err = helper.error_of(sb.gitCheckout, sb, "not a url", { cloneTimeoutMs = 1000 })
      assert.equal("INVALID_GIT_URL", err.code)
      assert.truthy(refused(sb.gitCheckout, sb, "https://example.com/r.git", { cloneTimeoutMs = -1 })
        :find("milliseconds", 1, true))
      assert.truthy(refused(sb.gitCheckout, sb, "https://example.com/r.git", { cloneTimeoutMs = 1, timeout = 2 })
        :find("not both", 1, true))
    end)
  end)

  it("createSession, runCode and watch refuse the seed's names they have no use for, naming the equivalent", function()
    helper.with_sandbox(function(sb)
      assert.truthy(refused(sb.createSession, sb, { name = "x" }):find("id", 1, true))
      assert.truthy(refused(sb.createSession, sb, { isolation = true }):find("getSandbox", 1, true))
      assert.truthy(refused(sb.runCode, sb, "1", { envVars = { A = "1" } }):find("createCodeContext", 1, true))
      assert.truthy(refused(sb.watch, sb, "/workspace", { onEvent = function() end }):find("iterator", 1, true))
    end)
  end)
end)
