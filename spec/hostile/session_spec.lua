-- Issue #14, "a sandbox comes back from anything done inside it": each
-- reproduction as a spec, each also asserting that a second sandbox kept
-- answering exec("true") while the first was being abused.
local moonbox = require "moonbox"

local with_sandbox = helper.with_sandbox

-- Run fn(sb) while a bystander sandbox runs exec("true") in a loop; after fn,
-- the bystander must have answered every call, at least once meanwhile.
local function with_bystander(fn, opts)
  with_sandbox(function(sb)
    local other = helper.new_sandbox()
    local stop, answered, failures = false, 0, {}
    local loop = moonbox.spawn(function()
      while not stop do
        local ok, r = pcall(other.exec, other, "true")
        if ok and r.exitCode == 0 then answered = answered + 1
        else failures[#failures + 1] = ok and ("exit " .. r.exitCode) or tostring(r) end
        moonbox.sleep(5)
      end
    end)
    local ok, err = pcall(fn, sb)
    -- one more answer after the abuse, whatever it left behind
    local before = answered
    helper.eventually(function() return answered > before end, 10000)
    stop = true
    loop:wait()
    other:destroy()
    if not ok then error(err, 0) end
    assert.same({}, failures)
    assert.is_true(answered > before, "the bystander sandbox stopped answering")
  end, opts)
end

-- a process of the sandbox, by a marker in its command line, alive?
local function marked_alive(s, marker)
  local r = s:exec("pgrep -f " .. marker .. " || true", { timeout = 10000 })
  return r.stdout ~= ""
end

describe("cancelling an exec", function()
  it("moonbox.timeout kills the command and the session's next command runs cleanly", function()
    with_bystander(function(sb)
      sb:exec("cd /tmp && export KEEP=1")
      local ok, err = pcall(moonbox.timeout, 200, function()
        return sb:exec("echo started; sleep 31415 ; echo late")
      end)
      assert.is_false(ok)
      assert.equal("TIMEOUT", err.code)
      for i = 1, 3 do
        local r = sb:exec("echo after" .. i .. " $KEEP; pwd")
        assert.equal(0, r.exitCode)
        assert.equal("after" .. i .. " 1\n/tmp\n", r.stdout)
        assert.is_false(r.timedOut)
      end
      assert.is_false(marked_alive(sb, "sleep.31415"), "the cancelled command still runs")
    end)
  end)

  it("task:cancel of a command with a timeout kills its tree and keeps the shell's state", function()
    with_bystander(function(sb)
      sb:exec("v=kept; cd /tmp")
      local t = moonbox.spawn(function()
        return sb:exec("(sleep 27182 &) ; sleep 27182; echo late", { timeout = 60000 })
      end)
      local look = sb:createSession { id = "look" }
      assert.is_true(helper.eventually(function() return marked_alive(look, "sleep.27182") end, 10000))
      t:cancel()
      assert.equal("CANCELLED", helper.error_of(t.wait, t).code)
      local r = sb:exec("echo $v; pwd")
      assert.equal("kept\n/tmp\n", r.stdout)
      assert.is_true(helper.eventually(function() return not marked_alive(look, "sleep.27182") end, 10000),
        "the cancelled command's tree still runs")
    end)
  end)

  it("a cancel while the shell is stopped (SIGSTOP) still leaves a working session", function()
    with_bystander(function(sb)
      local ok, err = pcall(moonbox.timeout, 300, function() return sb:exec("kill -STOP $$; echo late") end)
      assert.is_false(ok)
      assert.equal("TIMEOUT", err.code)
      local r = sb:exec("echo fine")
      assert.equal(0, r.exitCode)
      assert.equal("fine\n", r.stdout)
      -- and with a timeout set (the shell keeps its state when it can)
      ok, err = pcall(moonbox.timeout, 300, function() return sb:exec("kill -STOP $$", { timeout = 60000 }) end)
      assert.is_false(ok)
      assert.equal("TIMEOUT", err.code)
      assert.equal("fine again\n", sb:exec("echo fine again").stdout)
    end)
  end)

  it("exec outside a task raises NOT_IN_TASK and changes nothing", function()
    with_bystander(function(sb)
      sb:exec("echo 1 > count")
      local co = coroutine.create(function() return sb:exec("echo 2 > count; echo ran") end)
      local ok, err = coroutine.resume(co)
      assert.is_false(ok)
      assert.equal("NOT_IN_TASK", err.code)
      local r = sb:exec("cat count", { timeout = 10000 })
      assert.equal(0, r.exitCode)
      assert.equal("1\n", r.stdout)
      assert.is_false(r.timedOut)
      -- setEnvVars too
      co = coroutine.create(function() return sb:setEnvVars { X = "1" } end)
      ok, err = coroutine.resume(co)
      assert.is_false(ok)
      assert.equal("NOT_IN_TASK", err.code)
      assert.equal("\n", sb:exec("echo $X").stdout)
    end)
  end)
end)
