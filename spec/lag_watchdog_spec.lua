-- The loop-lag watchdog of spec/helper.lua (issue #14): run_task fails a run
-- in which the event loop was held past the bound, and the watchdog itself
-- neither keeps the loop alive nor leaves a handle behind.
local moonbox = require "moonbox"
local core = require "moonbox.core"
local async = require "moonbox.async"

-- hold the loop: burn CPU for ms
local function busy(ms)
  local t0 = os.clock()
  while (os.clock() - t0) * 1000 < ms do end -- luacheck: ignore 563
end

local BOUND = helper.LAG_BOUND_MS

describe("loop-lag watchdog", function()
  it("fails a run that holds the loop past the bound, naming how long", function()
    local ok, err = pcall(run_task, function()
      moonbox.sleep(20) -- the loop is turning when the stall starts
      busy(BOUND + 300)
    end)
    helper.settle() -- the failed run did not check for leftovers itself
    assert.is_false(ok)
    assert.matches("loop%-lag watchdog: the event loop was held %d+ ms %(bound " .. BOUND .. " ms%)", err)
    assert.equal(0, core.open_handles())
  end)

  it("lets a run marked with allow_lag hold the loop that long, once", function()
    helper.allow_lag(BOUND + 2000, "the spec stalls on purpose")
    run_task(function()
      moonbox.sleep(20)
      busy(BOUND + 300)
    end)
    local ok = pcall(run_task, function()
      moonbox.sleep(20)
      busy(BOUND + 300)
    end)
    helper.settle()
    assert.is_false(ok)
  end)

  it("does not count waiting, or the spec's own shell commands", function()
    local ok, err = pcall(run_task, function()
      moonbox.sleep(BOUND + 100)
      helper.sh("sleep 0.4")
      os.execute("sleep 0.4")
    end)
    assert.is_true(ok, err)
    assert.is_true(helper.lag.last_ms < BOUND, helper.lag.last_ms .. " ms counted")
  end)

  it("does not keep the loop alive: a task that can never wake is still a DEADLOCK", function()
    local ok, err = pcall(run_task, function()
      async.await(function() end, "nothing")
    end)
    assert.is_false(ok)
    assert.equal("DEADLOCK", err.code)
    helper.settle()
  end)
end)
