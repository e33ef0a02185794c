-- moonbox.core signals: names and numbers, and watchers on the loop.
local core = require "moonbox.core"
local async = require "moonbox.async"
local moonbox = require "moonbox"

-- Send ourselves sig and wait until the watcher callback has seen it.
local function wait_signal(watcher, sig)
  return async.await(function(resume)
    assert.is_true(watcher:start(sig, function(signum) resume(signum) end))
    assert.is_true(core.kill(core.getpid(), sig))
  end)
end

describe("core.signum / core.signame", function()
  it("raises on an unknown signal name", function()
    local ok, err = pcall(function() local n = core.signum("SIGFOO") return n end)
    assert.is_false(ok)
    assert.matches("bad argument #1 to 'signum' (unknown signal 'SIGFOO')", err, 1, true)
    ok, err = pcall(core.signum, "")
    assert.is_false(ok)
    assert.matches("unknown signal ''", err, 1, true)
  end)

  it("raises on a signal number out of range, or not a whole one", function()
    for _, n in ipairs { -1, 65, 1000, 1.5, 0 / 0, math.huge, -0.5 } do
      local ok, err = pcall(core.signum, n)
      assert.is_false(ok)
      assert.matches("signal number out of range", err, 1, true)
    end
  end)

  it("raises on a value that is neither a name nor a number", function()
    local ok, err = pcall(core.signum, {})
    assert.is_false(ok)
    assert.matches("string expected, got table", err, 1, true)
  end)

  it("signame returns nil for a number without a name", function()
    assert.is_nil(core.signame(0))
    assert.is_nil(core.signame(32)) -- (glibc's own, below SIGRTMIN)
    assert.is_nil(core.signame(65))
  end)

  it("names the real-time signals as bash and kill(1) do, from SIGRTMIN (34 with glibc)", function()
    assert.equals(34, core.signum("SIGRTMIN"))
    assert.equals(37, core.signum("SIGRTMIN+3"))
    assert.equals(37, core.signum("rtmin+3"))
    assert.equals(63, core.signum("SIGRTMAX-1"))
    assert.equals("SIGRTMIN+3", core.signame(37))
    assert.equals("SIGRTMIN+29", core.signame(63))
    for _, bad in ipairs { "SIGRTMIN+", "SIGRTMIN+31", "SIGRTMIN-1", "RTMAX+1", "SIGRTMIN+x", "SIGRTMIN+003" } do
      assert.is_false(pcall(core.signum, bad), bad)
    end
  end)

  it("maps names with or without the SIG prefix, in any case, to numbers", function()
    assert.equals(15, core.signum("SIGTERM"))
    assert.equals(15, core.signum("TERM"))
    assert.equals(15, core.signum("sigterm"))
    assert.equals(15, core.signum("term"))
    assert.equals(9, core.signum("KILL"))
    assert.equals(10, core.signum("SIGUSR1"))
    assert.equals(12, core.signum("usr2"))
    assert.equals(17, core.signum("SIGCHLD"))
    assert.equals(28, core.signum("WINCH"))
    assert.equals(9, core.signum(9))
    assert.equals(0, core.signum(0))
  end)

  it("maps numbers to canonical names, and back", function()
    local expect = {
      [1] = "SIGHUP", [2] = "SIGINT", [3] = "SIGQUIT", [6] = "SIGABRT", [9] = "SIGKILL",
      [10] = "SIGUSR1", [11] = "SIGSEGV", [12] = "SIGUSR2", [13] = "SIGPIPE", [14] = "SIGALRM",
      [15] = "SIGTERM", [17] = "SIGCHLD", [18] = "SIGCONT", [19] = "SIGSTOP", [28] = "SIGWINCH",
    }
    for n, name in pairs(expect) do
      assert.equals(name, core.signame(n))
      assert.equals(n, core.signum(name))
    end
  end)
end)

describe("core.signal", function()
  it("start raises on an unknown signal", function()
    run_task(function()
      local s = core.signal()
      local ok, err = pcall(function() s:start("SIGNOPE", function() end) end)
      assert.is_false(ok)
      assert.matches("unknown signal 'SIGNOPE'", err, 1, true)
      assert.is_false(s:is_active())
      s:close()
    end)
  end)

  it("start requires a callback", function()
    run_task(function()
      local s = core.signal()
      local ok, err = pcall(function() s:start("SIGUSR1") end)
      assert.is_false(ok)
      assert.matches("function expected, got no value", err, 1, true)
      s:close()
    end)
  end)

  it("raises when used after close", function()
    run_task(function()
      local s = core.signal()
      s:close()
      local ok, err = pcall(function() s:start("SIGUSR1", function() end) end)
      assert.is_false(ok)
      assert.matches("moonbox.signal is closed", err, 1, true)
    end)
  end)

  it("core.kill refuses pid 0 and -1", function()
    for _, pid in ipairs { 0, -1 } do
      local ok, err = pcall(core.kill, pid, "SIGUSR1")
      assert.is_false(ok)
      assert.matches("refusing to signal our own group or everything", err, 1, true)
    end
  end)

  it("receives SIGUSR1 sent to ourselves, with its number", function()
    run_task(function()
      local s = core.signal()
      assert.equals(10, wait_signal(s, "SIGUSR1"))
      assert.is_true(s:is_active())
      s:stop()
      assert.is_false(s:is_active())
      s:close()
    end)
  end)

  it("accepts a signal number and delivers every signal sent", function()
    run_task(function()
      local s = core.signal()
      local seen = {}
      async.await(function(resume)
        s:start(12, function(signum)
          seen[#seen + 1] = signum
          if #seen == 3 then resume() return end
          core.kill(core.getpid(), 12)
        end)
        core.kill(core.getpid(), "USR2")
      end)
      assert.same({ 12, 12, 12 }, seen)
      s:close()
    end)
  end)

  it("two watchers on one signal both see it; a stopped one does not", function()
    run_task(function()
      local a, b = core.signal(), core.signal()
      local seen_a = 0
      a:start("SIGUSR1", function() seen_a = seen_a + 1 end)
      assert.equals(10, wait_signal(b, "SIGUSR1"))
      moonbox.sleep(5)
      assert.equals(1, seen_a)
      a:stop()
      assert.equals(10, wait_signal(b, "SIGUSR1"))
      moonbox.sleep(5)
      assert.equals(1, seen_a)
      a:close()
      b:close()
    end)
  end)
end)
