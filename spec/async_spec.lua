-- moonbox.async: tasks on coroutines over the core loop.
local core = require "moonbox.core"
local async = require "moonbox.async"
local errors = require "moonbox.errors"
local moonbox = require "moonbox"

-- Run fn expecting the run to fail; returns the error after checking that
-- nothing (handle, process) was left behind.
local function run_fail(fn)
  local ok, err = pcall(moonbox.run, fn)
  helper.assert_clean()
  assert.is_false(ok, "the run did not fail")
  return err
end

local function elapsed_since(t0)
  core.update_time()
  return core.now() - t0
end

describe("moonbox.run", function()
  it("re-raises a string error as it was raised, its traceback kept aside for the report of an uncaught one", function()
    local err = run_fail(function()
      moonbox.sleep(1)
      error("boom")
    end)
    assert.matches("^spec/async_spec%.lua:%d+: boom$", err)
    assert.matches("^stack traceback:\n.*async_spec%.lua", require("moonbox.async").traceback_of(err))
    assert.equal("x", run_fail(function() error("x", 0) end))
    assert.equal("y", run_fail(function()
      local t = moonbox.spawn(function() moonbox.sleep(1) error("y", 0) end)
      t:wait()
    end))
  end)

  it("re-raises an error object with its code, context and a traceback", function()
    local err = run_fail(function()
      moonbox.sleep(1)
      errors.raise("E_TEST", "it broke", { n = 1 })
    end)
    assert.is_true(errors.is_error(err))
    assert.equals("E_TEST", err.code)
    assert.equals("it broke", err.message)
    assert.same({ n = 1 }, err.context)
    assert.matches("^stack traceback:\n", err.traceback)
    assert.matches("async_spec%.lua", err.traceback)
  end)

  it("re-raises any other error value as it was raised", function()
    local raised = { code = "PLAIN", detail = "x" }
    local err = run_fail(function()
      moonbox.sleep(1)
      error(raised)
    end)
    assert.equals(raised, err)
    assert.equals("PLAIN", err.code)
  end)

  it("fails when a task nobody waited for failed", function()
    local later = false
    local err = run_fail(function()
      moonbox.spawn(function()
        moonbox.sleep(5)
        error("lost task")
      end)
      moonbox.sleep(20)
      later = true
    end)
    assert.is_true(later)
    assert.matches("lost task", err, 1, true)
  end)

  it("fails when a core callback raised", function()
    local err = run_fail(function()
      local t = core.timer()
      t:start(1, 0, function()
        t:close()
        error("in a timer callback")
      end)
      moonbox.sleep(10)
    end)
    assert.matches("in a timer callback", err, 1, true)
  end)

  it("does not carry a failure over to the next run", function()
    run_fail(function()
      moonbox.spawn(function() error("first") end)
      moonbox.spawn(function() error("second") end)
    end)
    assert.same({ "fine" }, { run_task(function() return "fine" end) })
  end)

  it("returns the function's results, holes included", function()
    local function pack(...) return { n = select("#", ...), ... } end
    local r = pack(moonbox.run(function(a, b)
      moonbox.sleep(1)
      return a + b, nil, "x"
    end, 1, 2))
    helper.assert_clean()
    assert.same({ n = 3, 3, nil, "x" }, r)
  end)

  it("inside a task, runs fn as a subtask and waits for it", function()
    run_task(function()
      assert.equals(7, moonbox.run(function()
        moonbox.sleep(1)
        return 7
      end))
    end)
  end)

  it("waits for every task started, not only the main one", function()
    local done = false
    run_task(function()
      moonbox.spawn(function()
        moonbox.sleep(20)
        done = true
      end)
    end)
    assert.is_true(done)
  end)
end)

describe("a task", function()
  it("spawn rejects a non-function", function()
    local ok, err = pcall(moonbox.spawn, 42)
    assert.is_false(ok)
    assert.equals("VALIDATION_FAILED", err.code)
    assert.equals("spawn: expected a function, got number", err.message)
  end)

  it("runs at once until its first wait", function()
    run_task(function()
      local log = {}
      local t = moonbox.spawn(function()
        log[#log + 1] = "task start"
        moonbox.sleep(1)
        log[#log + 1] = "task end"
      end)
      log[#log + 1] = "spawned"
      t:wait()
      assert.same({ "task start", "spawned", "task end" }, log)
    end)
  end)

  it("wait returns the results, every time; status goes running -> ok", function()
    run_task(function()
      local t = moonbox.spawn(function(a)
        moonbox.sleep(1)
        return a, "two"
      end, "one")
      assert.equals("running", t:status())
      assert.same({ "one", "two" }, { t:wait() })
      assert.equals("ok", t:status())
      assert.same({ "one", "two" }, { t:wait() })
    end)
  end)

  it("wait re-raises the task's error; status is error", function()
    run_task(function()
      local t = moonbox.spawn(function()
        moonbox.sleep(1)
        errors.raise("E_TASK", "task failed")
      end)
      local ok, err = pcall(t.wait, t)
      assert.is_false(ok)
      assert.equals("E_TASK", err.code)
      assert.equals("error", t:status())
    end)
  end)

  it("waiting outside a task raises NOT_IN_TASK pointing at moonbox.run", function()
    local ok, err = pcall(moonbox.sleep, 10)
    assert.is_false(ok)
    assert.equals("NOT_IN_TASK", err.code)
    assert.equals("moonbox.sleep waits, so it must run inside a task: "
      .. "wrap the code in moonbox.run(function() ... end)", err.message)
    ok, err = pcall(async.await, function() end)
    assert.is_false(ok)
    assert.equals("NOT_IN_TASK", err.code)
    assert.matches("moonbox.run(function() ... end)", err.message, 1, true)
    assert.is_false(async.in_task())
    helper.assert_clean()
  end)

  it("await returns at once what an operation resumed synchronously", function()
    run_task(function()
      assert.same({ 1, nil, 3 }, { async.await(function(resume) resume(1, nil, 3) end) })
      assert.is_true(async.in_task())
    end)
  end)

  it("pending counts unfinished tasks", function()
    assert.equals(0, async.pending())
    run_task(function()
      assert.equals(1, async.pending())
      local t = moonbox.spawn(function() moonbox.sleep(5) end)
      assert.equals(2, async.pending())
      t:wait()
      assert.equals(1, async.pending())
    end)
    assert.equals(0, async.pending())
  end)
end)

describe("moonbox.sleep", function()
  it("rejects a negative, NaN or non-number duration", function()
    run_task(function()
      for _, ms in ipairs { -1, 0 / 0, "10", math.huge } do
        local ok, err = pcall(moonbox.sleep, ms)
        assert.is_false(ok)
        assert.equals("VALIDATION_FAILED", err.code)
        assert.equals("sleep: ms must be a finite number >= 0", err.message)
      end
    end)
  end)

  it("waits at least the time asked, and 0 yields once", function()
    run_task(function()
      core.update_time()
      local t0 = core.now()
      moonbox.sleep(30)
      assert.is_true(elapsed_since(t0) >= 30)
      moonbox.sleep(0)
    end)
  end)
end)

describe("argument checks", function()
  it("all refuses a nil or a non-function in any place before running any; run and sleep check theirs", function()
    local ran = false
    run_task(function()
      local moon = require "moonbox"
      for _, args in ipairs { { function() ran = true end, 42 }, { function() ran = true end, nil, function() end } } do
        local ok, err = pcall(moon.all, args[1], args[2], args[3])
        assert.is_false(ok)
        assert.equal("VALIDATION_FAILED", err.code)
        assert.matches("all: function 2", err.message)
      end
      assert.is_false(ran)
      local ok, err = pcall(moon.sleep, math.huge)
      assert.same({ false, "VALIDATION_FAILED" }, { ok, err.code })
    end)
    local ok, err = pcall(moonbox.run, "x")
    assert.same({ false, "VALIDATION_FAILED" }, { ok, err.code })
    assert.matches("^run:", err.message)
    ok, err = pcall(moonbox.all, function() end)
    assert.same({ false, "NOT_IN_TASK" }, { ok, err.code })
    assert.matches("moonbox.all", err.message, 1, true)
    ok, err = pcall(moonbox.getSandbox, "never-made")
    assert.same({ false, "NOT_IN_TASK" }, { ok, err.code })
    assert.matches("moonbox.getSandbox", err.message, 1, true)
  end)
end)

describe("moonbox.all", function()
  it("returns the first result of each function in argument order", function()
    run_task(function()
      local r = moonbox.all(
        function() moonbox.sleep(30) return "a" end,
        function() moonbox.sleep(10) return "b" end,
        function() moonbox.sleep(20) return "c", "ignored" end)
      assert.same({ "a", "b", "c" }, r)
      assert.same({ 1, 2 }, moonbox.all { function() return 1 end, function() return 2 end })
      assert.same({}, moonbox.all {})
    end)
  end)

  it("raises the first error only after every function has settled", function()
    local finished = {}
    run_task(function()
      local ok, err = pcall(moonbox.all,
        function() moonbox.sleep(30) finished[1] = true end,
        function() moonbox.sleep(5) errors.raise("E_ONE", "one failed") end,
        function() moonbox.sleep(20) finished[3] = true end)
      assert.is_false(ok)
      assert.equals("E_ONE", err.code)
      assert.same({ true, nil, true }, finished)
    end)
  end)

  it("with several failures raises the first in time, as Promise.all rejects with", function()
    run_task(function()
      local ok, err = pcall(moonbox.all,
        function() moonbox.sleep(50) errors.raise("E_FIRST", "listed first, fails last") end,
        function() moonbox.sleep(1) errors.raise("E_SECOND", "fails first") end)
      assert.is_false(ok)
      assert.equals("E_SECOND", err.code)
      -- one that fails at once, before its turn to be waited for
      ok, err = pcall(moonbox.all,
        function() moonbox.sleep(5) error("late") end,
        function() error("at once") end)
      assert.is_false(ok)
      assert.matches("at once", err)
    end)
  end)

  it("cancelled while waiting, cancels every function", function()
    local cleaned = 0
    run_task(function()
      local outer = moonbox.spawn(function()
        moonbox.all(
          function() local ok = pcall(moonbox.sleep, 1000) cleaned = cleaned + (ok and 0 or 1) end,
          function() local ok = pcall(moonbox.sleep, 1000) cleaned = cleaned + (ok and 0 or 1) end)
      end)
      moonbox.sleep(5)
      outer:cancel()
      local ok, err = pcall(outer.wait, outer)
      assert.is_false(ok)
      assert.equals("CANCELLED", err.code)
    end)
    assert.equals(2, cleaned)
  end)
end)

describe("moonbox.timeout", function()
  it("rejects a bad duration before starting anything", function()
    run_task(function()
      local started = false
      local ok, err = pcall(moonbox.timeout, -5, function() started = true end)
      assert.is_false(ok)
      assert.equals("VALIDATION_FAILED", err.code)
      assert.is_false(started)
    end)
  end)

  it("returns fn's results when it finishes in time", function()
    run_task(function()
      assert.same({ "fast", 2 }, { moonbox.timeout(200, function(x)
        moonbox.sleep(1)
        return "fast", x
      end, 2) })
      assert.same({ "sync" }, { moonbox.timeout(200, function() return "sync" end) })
    end)
  end)

  it("raises TIMEOUT and cancels fn, whose cleanup runs", function()
    local saw
    run_task(function()
      core.update_time()
      local t0 = core.now()
      local ok, err = pcall(moonbox.timeout, 20, function()
        local slept, e = pcall(moonbox.sleep, 5000)
        saw = slept and "woke" or e.code
      end)
      assert.is_false(ok)
      assert.equals("TIMEOUT", err.code)
      assert.equals("timed out after 20 ms", err.message)
      assert.same({ timeout = 20 }, err.context)
      local took = elapsed_since(t0)
      assert.is_true(took >= 20 and took < 1000, "took " .. took)
    end)
    assert.equals("CANCELLED", saw)
  end)

  it("passes fn's own error through", function()
    run_task(function()
      local ok, err = pcall(moonbox.timeout, 1000, function()
        moonbox.sleep(1)
        errors.raise("E_OWN", "own error")
      end)
      assert.is_false(ok)
      assert.equals("E_OWN", err.code)
    end)
  end)

  it("cancelled itself, cancels fn too", function()
    local inner
    run_task(function()
      local outer = moonbox.spawn(function()
        moonbox.timeout(5000, function()
          local ok, e = pcall(moonbox.sleep, 5000)
          inner = ok and "woke" or e.code
        end)
      end)
      moonbox.sleep(5)
      outer:cancel()
      assert.equals("error", outer:status())
    end)
    assert.equals("CANCELLED", inner)
  end)
end)

describe("task:cancel", function()
  it("closes the pending sleep's timer at once and raises CANCELLED in the task", function()
    local t0 = core.hrtime()
    run_task(function()
      local caught
      local baseline = core.open_handles() -- run_task's own watchdog timer
      local t = moonbox.spawn(function()
        local ok, err = pcall(moonbox.sleep, 10000)
        caught = not ok and err.code
        errors.raise("CANCELLED", "passing it on")
      end)
      assert.equals(baseline + 1, core.open_handles()) -- the sleep's timer
      t:cancel()
      assert.equals("CANCELLED", caught)
      assert.equals("error", t:status())
      local ok, err = pcall(t.wait, t)
      assert.is_false(ok)
      assert.equals("CANCELLED", err.code)
    end)
    -- run_task found no handle open: the 10 s timer was closed, not waited for
    assert.is_true((core.hrtime() - t0) / 1e6 < 1000)
  end)

  it("of a finished task does nothing", function()
    run_task(function()
      local t = moonbox.spawn(function() return 1 end)
      t:cancel()
      assert.equals("ok", t:status())
      assert.equals(1, t:wait())
    end)
  end)

  it("of the running task makes its next wait raise CANCELLED", function()
    run_task(function()
      local status
      local t = moonbox.spawn(function()
        local me = async.current()
        me:cancel()
        status = me:status()
        moonbox.sleep(1)
        return "not reached"
      end)
      local ok, err = pcall(t.wait, t)
      assert.is_false(ok)
      assert.equals("CANCELLED", err.code)
      assert.equals("cancelling", status)
    end)
  end)

  it("a cancelled task that nobody waits for does not fail the run", function()
    local t
    local results = { run_task(function()
      t = moonbox.spawn(function() moonbox.sleep(10000) end)
      t:cancel()
      return "finished"
    end) }
    assert.same({ "finished" }, results)
    assert.equals("error", t:status()) -- (it ended with CANCELLED, which nobody saw)
  end)
end)

describe("deadlock detection", function()
  it("raises DEADLOCK with the waiting task's traceback", function()
    local err = run_fail(function()
      async.await(function() end) -- nothing will ever resume this
    end)
    assert.is_true(errors.is_error(err))
    assert.equals("DEADLOCK", err.code)
    assert.matches("async_spec%.lua", err.traceback)
  end)

  it("runs the stuck operation's cleanup and leaves the runtime usable", function()
    local cleaned = false
    local err = run_fail(function()
      moonbox.spawn(function()
        async.await(function()
          local t = core.timer()
          t:start(60000, 0, function() end)
          t:unref() -- does not keep the loop alive: nothing can fire
          return function()
            cleaned = true
            t:close()
          end
        end)
      end)
    end)
    assert.equals("DEADLOCK", err.code)
    assert.equals("1 task(s) wait for something that can never happen", err.message)
    assert.is_true(cleaned)
    assert.equals(0, async.pending())
    assert.equals(3, run_task(function() moonbox.sleep(1) return 3 end))
  end)

  it("fails tasks waiting on a deadlocked task too", function()
    local err = run_fail(function()
      local stuck = moonbox.spawn(function() async.await(function() end) end)
      stuck:wait()
    end)
    assert.equals("DEADLOCK", err.code)
    assert.equals(0, async.pending())
  end)
end)
