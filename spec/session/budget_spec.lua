-- The runtime-wide budget for buffered exec output (issue #18,
-- limits.maxBufferedBytes, lua/moonbox/session/budget.lua): a call that would pass
-- it keeps what fits and says truncated = true; the bytes are given back
-- when the result is handed over.
local moonbox = require "moonbox"

local with_sandbox = helper.with_sandbox

local function policy(n) return { limits = { maxBufferedBytes = n } } end

describe("buffered output budget", function()
  it("truncates an exec past limits.maxBufferedBytes and gives the bytes back afterwards", function()
    with_sandbox(function(sb)
      local r = sb:exec("head -c 5000 /dev/zero | tr '\\0' a; echo done >&2")
      -- 5000 bytes of stdout fit nowhere but the first 1000; stderr finds no room
      assert.is_true(r.truncated)
      assert.equal(("a"):rep(1000), r.stdout)
      assert.equal("", r.stderr)
      assert.equal(0, r.exitCode)
      -- handed over: the whole budget is free again
      local again = sb:exec("head -c 1000 /dev/zero | tr '\\0' b")
      assert.is_false(again.truncated)
      assert.equal(("b"):rep(1000), again.stdout)
      local timed = sb:exec("head -c 700 /dev/zero | tr '\\0' c; sleep 30", { timeout = 300 })
      assert.is_true(timed.timedOut)
      assert.equal(("c"):rep(700), timed.stdout)
      assert.equal(("d"):rep(1000), sb:exec("head -c 1000 /dev/zero | tr '\\0' d").stdout)
    end, { policy = policy(1000) })
  end)

  it("is shared by concurrent calls: the second gets only what the first left", function()
    with_sandbox(function(sb)
      sb:createSession { id = "other" }
      local held = 0
      local second
      local first = moonbox.spawn(function()
        return sb:exec("head -c 2000 /dev/zero | tr '\\0' a; while [ ! -e go ]; do sleep 0.01; done", {
          onOutput = function(_, data)
            held = held + #data
            -- the first holds its 2000 bytes: now the second runs, and ends it
            if held == 2000 then
              second = moonbox.spawn(function()
                return sb:getSession("other"):exec("head -c 2000 /dev/zero | tr '\\0' b; touch go")
              end)
            end
          end,
        })
      end)
      local r1 = first:wait()
      local r2 = second:wait()
      assert.is_false(r1.truncated)
      assert.equal(("a"):rep(2000), r1.stdout)
      assert.is_true(r2.truncated)
      assert.equal(("b"):rep(1000), r2.stdout)
      -- both handed over: the budget is whole again
      local r3 = sb:exec("head -c 3000 /dev/zero | tr '\\0' c")
      assert.is_false(r3.truncated)
      assert.equal(3000, #r3.stdout)
    end, { policy = policy(3000) })
  end)

  it("rejects a negative maxBufferedBytes with VALIDATION_FAILED", function()
    local ok, err = pcall(moonbox.run, function()
      moonbox.getSandbox("budget-bad", { root = helper.mkdtemp(), policy = policy(-1) })
    end)
    assert.is_false(ok)
    assert.equal("VALIDATION_FAILED", err.code)
  end)
end)
