-- The runtime-wide budget for buffered output (issue #18,
-- limits.maxBufferedBytes, lua/moonbox/session/budget.lua): exec, execStream,
-- runCode and process logs count what they keep against it; a call that
-- would pass it keeps what fits and says truncated = true; the bytes are
-- given back when the result is handed over (a log's, when its record goes).
local moonbox = require "moonbox"
local budget = require "moonbox.session.budget"

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

  it("execStream keeps the prefix that fits, says truncated and gives the bytes back as they are read", function()
    with_sandbox(function(sb)
      local it = sb:execStream("head -c 3000 /dev/zero | tr '\\0' a; head -c 10 /dev/zero | tr '\\0' e >&2")
      it.task:wait() -- nothing read yet: every kept chunk is still queued
      assert.equal(1000, budget.used)
      local out, err, complete = {}, {}, nil
      for ev in it do
        if ev.type == "stdout" then out[#out + 1] = ev.data
        elseif ev.type == "stderr" then err[#err + 1] = ev.data
        elseif ev.type == "complete" then complete = ev end
      end
      assert.equal(("a"):rep(1000), table.concat(out))
      assert.equal("", table.concat(err))
      assert.is_true(complete.truncated)
      assert.equal(0, complete.exitCode)
      assert.equal(0, budget.used)
      -- read as it comes, the same output fits whole
      local whole = {}
      for ev in sb:execStream("head -c 600 /dev/zero | tr '\\0' b") do
        if ev.type == "stdout" then whole[#whole + 1] = ev.data end
        if ev.type == "complete" then assert.is_false(ev.truncated) end
      end
      assert.equal(("b"):rep(600), table.concat(whole))
      assert.equal(0, budget.used)
    end, { policy = policy(1000) })
  end)

  it("an execStream dropped unread gives its queued bytes back when collected", function()
    with_sandbox(function(sb)
      -- (in a function of its own: no stack slot of this one keeps the iterator)
      local function start_unread()
        local it = sb:execStream("head -c 800 /dev/zero | tr '\\0' a")
        it.task:wait()
        return budget.used
      end
      assert.equal(800, start_unread())
      collectgarbage("collect")
      collectgarbage("collect")
      assert.equal(0, budget.used)
      assert.equal(("c"):rep(1000), sb:exec("head -c 1000 /dev/zero | tr '\\0' c").stdout)
    end, { policy = policy(1000) })
  end)

  it("process logs count against it: a log keeps the newest bytes that fit until its record goes", function()
    with_sandbox(function(sb)
      local p = sb:startProcess("seq 1 2000")
      p:waitForExit()
      local all = {}
      for i = 1, 2000 do all[i] = i .. "\n" end
      all = table.concat(all)
      local logs = p:getLogs()
      assert.is_true(logs.truncated)
      assert.equal(all:sub(-1000), logs.stdout)
      assert.equal("", logs.stderr)
      -- the record holds the whole budget: an exec finds no room
      assert.equal(1000, budget.used)
      local r = sb:exec("echo hi")
      assert.is_true(r.truncated)
      assert.equal("", r.stdout)
      -- the record goes: its bytes are free again
      assert.equal(1, sb:cleanupCompletedProcesses())
      assert.equal(0, budget.used)
      r = sb:exec("echo hi")
      assert.is_false(r.truncated)
      assert.equal("hi\n", r.stdout)
      -- an exited record kept to the end gives its bytes back at destroy
      sb:startProcess("head -c 300 /dev/zero | tr '\\0' z"):waitForExit()
      assert.equal(300, budget.used)
    end, { policy = policy(1000) })
    assert.equal(0, budget.used)
  end)

  it("a streamProcessLogs reader's queue counts against it until read, and is given back", function()
    with_sandbox(function(sb)
      local p = sb:startProcess("head -c 400 /dev/zero | tr '\\0' s")
      p:waitForExit()
      assert.equal(400, budget.used) -- the log
      -- the replay fits (400 + 400 <= 1000): queued, counted until read
      local it = sb:streamProcessLogs(p.id)
      assert.equal(800, budget.used)
      local ev = it()
      assert.same({ "stdout", ("s"):rep(400) }, { ev.type, ev.data })
      assert.equal(400, budget.used)
      ev = it()
      assert.same({ "exit", false }, { ev.type, ev.truncated })
      assert.is_nil(it())
      -- two readers: the second's replay does not fit, it is dropped and the exit says so
      local a = sb:streamProcessLogs(p.id)
      local b = sb:streamProcessLogs(p.id)
      assert.equal(800, budget.used)
      ev = b()
      assert.same({ "exit", true }, { ev.type, ev.truncated })
      a:close()
      assert.equal(400, budget.used)
      -- an iterator dropped unread gives its bytes back when collected
      sb:streamProcessLogs(p.id) -- luacheck: ignore 511
      assert.equal(800, budget.used)
      collectgarbage("collect")
      collectgarbage("collect")
      assert.equal(400, budget.used)
    end, { policy = policy(1000) })
    assert.equal(0, budget.used)
  end)

  it("runCode keeps the prefix that fits, says truncated and gives the bytes back", function()
    with_sandbox(function(sb)
      -- (a statement: a final expression's value, io.write's file, would be a
      -- result whose bytes share the budget, ahead of the output or not)
      local r = sb:runCode("local _ = io.write(string.rep('a', 3000))", { language = "lua" })
      assert.is_true(r.truncated)
      assert.equal(("a"):rep(1000), table.concat(r.logs.stdout))
      assert.equal(0, budget.used)
      r = sb:runCode("local _ = io.write(string.rep('b', 900))", { language = "lua" })
      assert.is_false(r.truncated)
      assert.equal(("b"):rep(900), table.concat(r.logs.stdout))
      assert.equal(0, budget.used)
    end, { policy = policy(1000) })
  end)

  it("concurrent execs each keep an exact prefix; all of it comes back", function()
    with_sandbox(function(sb)
      local tasks = {}
      for i = 1, 4 do
        local s = sb:createSession { id = "c" .. i }
        tasks[i] = moonbox.spawn(function()
          return s:exec(("head -c 2000 /dev/zero | tr '\\0' %s"):format(string.char(96 + i)))
        end)
      end
      local total = 0
      for i, t in ipairs(tasks) do
        local r = t:wait()
        local c = string.char(96 + i)
        assert.equal(c:rep(#r.stdout), r.stdout)
        assert.equal(#r.stdout < 2000, r.truncated)
        total = total + #r.stdout
      end
      -- (how much each kept depends on how their runs overlapped; the
      -- test above pins down the sharing itself)
      assert.is_true(total >= 3000, tostring(total))
      assert.equal(0, budget.used)
    end, { policy = policy(3000) })
  end)

  it("a runtime-wide ceiling (moonbox serve --max-buffered-bytes) caps every policy", function()
    budget.ceiling = 500
    local ok, err = pcall(with_sandbox, function(sb)
      local r = sb:exec("head -c 1000 /dev/zero | tr '\\0' a")
      assert.is_true(r.truncated)
      assert.equal(("a"):rep(500), r.stdout)
    end, { policy = policy(100000) })
    local capped, below, default = budget.limit(100000), budget.limit(100), budget.limit(nil)
    budget.ceiling = nil
    assert(ok, err)
    assert.same({ 500, 100, 500 }, { capped, below, default })
    assert.equal(0, budget.used)
  end)

  it("rejects a negative maxBufferedBytes with VALIDATION_FAILED", function()
    local ok, err = pcall(moonbox.run, function()
      moonbox.getSandbox("budget-bad", { root = helper.mkdtemp(), policy = policy(-1) })
    end)
    assert.is_false(ok)
    assert.equal("VALIDATION_FAILED", err.code)
  end)
end)
