-- moonbox.core timers: one-shot and repeating timers on the loop.
local core = require "moonbox.core"
local async = require "moonbox.async"
local moonbox = require "moonbox"

describe("core.timer", function()
  it("rejects negative and NaN durations", function()
    run_task(function()
      local t = core.timer()
      for _, d in ipairs { { -1, 0 }, { 10, -5 }, { 0 / 0, 0 }, { 10, 0 / 0 } } do
        local ok, err = pcall(t.start, t, d[1], d[2], function() end)
        assert.is_false(ok)
        assert.matches("timer durations must be >= 0", err, 1, true)
      end
      assert.is_false(t:is_active())
      t:close()
    end)
  end)

  it("accepts math.huge as a timeout that never comes", function()
    run_task(function()
      local t = core.timer()
      local fired = false
      assert.is_true(t:start(math.huge, 0, function() fired = true end))
      assert.equals(2 ^ 53, t:get_due_in())
      moonbox.sleep(5)
      assert.is_false(fired)
      t:close()
    end)
  end)

  it("requires a callback", function()
    run_task(function()
      local t = core.timer()
      local ok, err = pcall(function() t:start(10, 0) end)
      assert.is_false(ok)
      assert.matches("bad argument #3 to 'start' (function expected, got no value)", err, 1, true)
      assert.is_false(t:is_active())
      t:close()
    end)
  end)

  it("again() on a timer that was never started returns EINVAL", function()
    run_task(function()
      local t = core.timer()
      local ok, msg, code = t:again()
      assert.is_nil(ok)
      assert.equals("EINVAL: invalid argument", msg)
      assert.equals("EINVAL", code)
      t:close()
    end)
  end)

  it("raises on any method once closed", function()
    run_task(function()
      local t = core.timer()
      t:close()
      for _, m in ipairs { "start", "stop", "again", "get_due_in" } do
        local ok, err = pcall(t[m], t, 10, 0, function() end)
        assert.is_false(ok)
        assert.equals("moonbox.timer is closed", err:match("moonbox%.timer is closed"))
      end
    end)
  end)

  it("a one-shot timer fires exactly once", function()
    local fired = 0
    run_task(function()
      local t = core.timer()
      local started = core.now()
      async.await(function(resume)
        t:start(20, 0, function()
          fired = fired + 1
          resume()
        end)
      end)
      assert.is_true(core.now() - started >= 20)
      moonbox.sleep(60)
      assert.equals(1, fired)
      assert.is_false(t:is_active())
      t:close()
    end)
    assert.equals(1, fired)
  end)

  it("counts from when it is started, not from the loop's cached time", function()
    run_task(function()
      moonbox.sleep(1) -- a fresh loop turn, whose cached time then goes stale
      local spin_until = core.hrtime() + 30e6
      while core.hrtime() < spin_until do end
      local t = core.timer()
      local started = core.hrtime()
      async.await(function(resume) t:start(50, 0, resume) end)
      t:close()
      assert.is_true((core.hrtime() - started) / 1e6 >= 50)
    end)
  end)

  it("a repeating timer fires until stopped", function()
    local fired = 0
    run_task(function()
      local t = core.timer()
      async.await(function(resume)
        t:start(5, 5, function()
          fired = fired + 1
          if fired == 4 then
            t:stop()
            resume()
          end
        end)
      end)
      assert.equals(4, fired)
      assert.is_false(t:is_active())
      moonbox.sleep(40)
      assert.equals(4, fired)
      t:close()
    end)
  end)

  it("again() restarts a repeating timer with its repeat interval", function()
    local fired = 0
    run_task(function()
      local t = core.timer()
      async.await(function(resume)
        t:start(1000, 10, function()
          fired = fired + 1
          t:stop()
          resume()
        end)
        assert.is_true(t:again())
        assert.equals(10, t:get_due_in())
      end)
      assert.equals(1, fired)
      t:close()
    end)
  end)

  it("stopped before it is due never fires", function()
    local fired = 0
    run_task(function()
      local t = core.timer()
      t:start(20, 0, function() fired = fired + 1 end)
      assert.is_true(t:is_active())
      t:stop()
      assert.is_false(t:is_active())
      moonbox.sleep(60)
      t:close()
    end)
    assert.equals(0, fired)
  end)

  it("closing a pending timer cancels it and runs the close callback once", function()
    local fired, closed = 0, 0
    run_task(function()
      local t = core.timer()
      t:start(10, 0, function() fired = fired + 1 end)
      async.await(function(resume)
        t:close(function()
          closed = closed + 1
          resume()
        end)
        assert.is_true(t:is_closing())
        assert.is_false(t:is_active())
        t:close() -- idempotent
      end)
      assert.equals(1, closed)
      assert.matches("^moonbox%.timer: 0x%x+ %(closed%)$", tostring(t))
      moonbox.sleep(30)
    end)
    assert.equals(0, fired)
    assert.equals(1, closed)
  end)

  it("closing from inside its own callback is safe", function()
    local fired = 0
    run_task(function()
      local t = core.timer()
      async.await(function(resume)
        t:start(1, 1, function()
          fired = fired + 1
          t:close()
          resume()
        end)
      end)
      moonbox.sleep(20)
    end)
    assert.equals(1, fired)
  end)

  it("get_due_in counts down and is 0 once stopped", function()
    run_task(function()
      local t = core.timer()
      assert.equals(0, t:get_due_in())
      t:start(1000, 0, function() end)
      -- start() adds the millisecond the loop's truncated clock may lose
      assert.equals(1001, t:get_due_in())
      moonbox.sleep(30)
      local due = t:get_due_in()
      -- at least 30 ms passed; how much more depends on the machine's load
      assert.is_true(due <= 970 and due >= 0, "due in " .. due)
      t:stop()
      assert.equals(0, t:get_due_in())
      t:close()
    end)
  end)

  it("an unref'd timer does not keep the loop alive", function()
    run_task(function()
      local baseline = core.loop_alive() -- other work of the run may be pending
      local t = core.timer()
      t:start(10000, 0, function() end)
      t:unref()
      assert.equals(baseline, core.loop_alive())
      t:ref()
      assert.is_true(core.loop_alive())
      t:close()
    end)
  end)
end)
