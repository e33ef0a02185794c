-- Issue #14, "a sandbox comes back from anything done inside it": each
-- reproduction as a spec, each also asserting that a second sandbox kept
-- answering exec("true") while the first was being abused.
local moonbox = require "moonbox"
-- The sleeps a case looks for, per run: without namespaces pgrep sees the
-- host's processes, those of this spec's other runs (root and unprivileged)
-- at the same time too. "sleep 31415.<pid>" sleeps as long, near enough
-- (the pid at a fixed width: no run's is the start of another's).
local RUN = (".%07d"):format(require("moonbox.core").getpid())
local function mark(n) return n .. RUN end

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
        return sb:exec("echo started; sleep " .. mark(31415) .. " ; echo late")
      end)
      assert.is_false(ok)
      assert.equal("TIMEOUT", err.code)
      for i = 1, 3 do
        local r = sb:exec("echo after" .. i .. " $KEEP; pwd")
        assert.equal(0, r.exitCode)
        assert.equal("after" .. i .. " 1\n/tmp\n", r.stdout)
        assert.is_false(r.timedOut)
      end
      assert.is_false(marked_alive(sb, "sleep." .. mark(31415)), "the cancelled command still runs")
    end)
  end)

  it("task:cancel of a command with a timeout kills its tree and keeps the shell's state", function()
    with_bystander(function(sb)
      sb:exec("v=kept; cd /tmp")
      local t = moonbox.spawn(function()
        return sb:exec(("sh -c 'sleep %s' & sleep %s; echo late"):format(mark(27182), mark(27182)), { timeout = 60000 })
      end)
      local look = sb:createSession { id = "look" }
      assert.is_true(helper.eventually(function() return marked_alive(look, "sleep." .. mark(27182)) end, 10000))
      t:cancel()
      assert.equal("CANCELLED", helper.error_of(t.wait, t).code)
      local r = sb:exec("echo $v; pwd")
      assert.equal("kept\n/tmp\n", r.stdout)
      assert.is_true(helper.eventually(function() return not marked_alive(look, "sleep." .. mark(27182)) end, 10000),
        "the cancelled command's tree still runs")
    end)
  end)

  it("a timed-out command's kill spares what the session started beside it: kernel, terminal, process", function()
    with_bystander(function(sb)
      sb:exec("export FOR_ALL=1") -- the session's marker and env reach what it starts
      local ctx = sb:createCodeContext { language = "lua" }
      assert.is_nil(sb:runCode("x = 41", { context = ctx }).error)
      local t = sb:terminal {}
      local p = sb:startProcess("sleep " .. mark(27183))
      -- an orphan of the command (its parent exits at once) goes too
      local r = sb:exec(("(sleep %s &); sleep %s"):format(mark(27184), mark(27184)), { timeout = 300 })
      assert.is_true(r.timedOut)
      assert.is_false(marked_alive(sb, "sleep." .. mark(27184)), "the timed-out command's orphan still runs")
      assert.equal("42", sb:runCode("x + 1", { context = ctx }).results[1].text)
      assert.equal("running", sb:getProcess(p.id).status)
      assert.is_false(t.exited)
      t:write("echo term-$((40 + 2))\n")
      local seen = ""
      while not seen:find("term%-42") do
        local ok, chunk = pcall(moonbox.timeout, 5000, t.read, t)
        assert(ok and chunk, "the terminal stopped answering: " .. seen)
        seen = seen .. chunk
      end
      t:close()
      sb:killProcess(p.id)
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

describe("the status pipe", function()
  it("a command flooding the shell's status fd costs the runtime a bounded buffer, and the session answers", function()
    with_bystander(function(sb)
      sb:exec("true")
      local shell = sb:getSession("default").shell
      -- the report builtin keeps the status pipe at fd 100 (docs/sessions.md)
      sb:exec([[exec 5>&100; (head -c 30000000 /dev/zero | tr '\0' A >&5) >/dev/null 2>&1 & exec 5>&-]])
      local most = 0
      for _ = 1, 40 do
        moonbox.sleep(25)
        local n = 0
        for _, chunk in ipairs(shell.status_buf) do n = n + #chunk end
        if n > most then most = n end
      end
      assert.is_true(most <= 128 * 1024, most .. " bytes kept")
      assert.equal("hi\n", sb:exec("echo hi").stdout)
    end)
  end)
end)

describe("errors are always coded", function()
  local function policy_of(hooks) return { policy = { hooks = hooks } } end

  it("a hook that throws raises POLICY_ERROR naming the hook and its message", function()
    with_bystander(function(sb)
      for _, call in ipairs {
        { "onExec", function() return sb:exec("true") end },
        { "onStartProcess", function() return sb:startProcess("true") end },
        { "onFile", function() return sb:writeFile("f.txt", "x") end },
        { "onEnv", function() return sb:setEnvVars { A = "1" } end },
        { "onCreateSession", function() return sb:createSession { id = "x" } end },
      } do
        local err = helper.error_of(call[2])
        assert.equal("POLICY_ERROR", err.code)
        assert.equal(call[1], err.context.hook)
        assert.truthy(err.message:find(call[1], 1, true), err.message)
        assert.truthy(err.message:find("hook exploded", 1, true), err.message)
      end
      assert.same({}, sb:listProcesses())
    end, policy_of {
      onExec = function() error("hook exploded") end,
      onStartProcess = function() error("hook exploded") end,
      onFile = function() error("hook exploded") end,
      onEnv = function() error("hook exploded") end,
      onCreateSession = function() error({ "hook exploded" }) end,
    })
  end)

  it("a hook returning a wrong type is POLICY_ERROR, never an allow", function()
    local ran = helper.mkdtemp()
    with_bystander(function(sb)
      local bad = {
        { "onExec", function() return sb:exec("touch " .. ran .. "/exec; true") end },
        { "onStartProcess", function() return sb:startProcess("touch " .. ran .. "/proc") end },
        { "onFile", function() return sb:writeFile("f.txt", "x") end },
        { "onEnv", function() return sb:setEnvVars { A = "1" } end },
        { "onCreateSession", function() return sb:createSession { id = "x" } end },
      }
      for _, call in ipairs(bad) do
        local err = helper.error_of(call[2])
        assert.equal("POLICY_ERROR", err.code, call[1] .. ": " .. tostring(err))
        assert.equal(call[1], err.context.hook)
      end
      assert.same({}, sb:listProcesses())
      assert.same({ "default" }, sb:listSessions())
      assert.is_false(sb:exists("f.txt").exists)
    end, policy_of {
      onExec = function(_, cmd) if cmd:find("touch", 1, true) then return 42 end return true end,
      onStartProcess = function() return { "sh", { "-c" } } end, -- a bad argv
      onFile = function(_, op, path) if op == "writeFile" then return 7 end return path end,
      onEnv = function() return "everything" end,
      onCreateSession = function() return 1 end,
    })
    assert.equal("", helper.sh("ls " .. ran))
    os.execute("rm -rf " .. ran)
  end)

  it("onCreateSession options the call cannot take are the hook's POLICY_ERROR, not the caller's mistake", function()
    local replies = { { env = { ["9X"] = "y" } }, { cwd = "/nonexistent" }, { commandTimeoutMs = "soon" },
      { bogus = 1 } }
    local n = 0
    with_bystander(function(sb)
      for i = 1, #replies do
        local err = helper.error_of(function() return sb:createSession { id = "s" .. i } end)
        assert.same({ "POLICY_ERROR", "onCreateSession" }, { err.code, err.context.hook }, tostring(err))
      end
      assert.equal(#replies, n)
      for _, id in ipairs(sb:listSessions()) do assert.equal("default", id) end -- none of them was made
    end, policy_of {
      onCreateSession = function() n = n + 1 return replies[n] end,
    })
  end)

  it("a hook calling its own session from inside the call fails it at once instead of waiting for ever", function()
    with_bystander(function(sb)
      local err = helper.error_of(function()
        return moonbox.timeout(10000, function() return sb:writeFile("f.txt", "x") end)
      end)
      assert.same({ "POLICY_ERROR", "onFile" }, { err.code, err.context.hook }, tostring(err))
      assert.truthy(err.message:find("DEADLOCK", 1, true), err.message)
      assert.equal(0, sb:exec("true").exitCode) -- the session goes on
    end, policy_of {
      onFile = function(s, op) if op == "writeFile" then s:exec("true") end return true end,
    })
  end)

  it("writeFile after the sandbox root vanished says FILE_NOT_FOUND, not PATH_OUTSIDE_SANDBOX", function()
    with_bystander(function(sb)
      sb:writeFile("/workspace/a.txt", "x")
      assert.equal(0, os.execute("rm -rf '" .. sb.root .. "'") and 0 or 1)
      for _, call in ipairs {
        function() return sb:writeFile("/workspace/b.txt", "y") end,
        function() return sb:readFile("/workspace/a.txt") end,
        function() return sb:listFiles("/workspace") end,
      } do
        local err = helper.error_of(call)
        assert.equal("FILE_NOT_FOUND", err.code)
      end
    end)
  end)

  it("moveFile that fails half way rolls back: no partial copy, the source intact", function()
    with_bystander(function(sb)
      -- 8 files of 512 KiB into a 1 MiB /tmp: the copy runs out of space
      -- after two (under isolation none /tmp is the workspace's own
      -- filesystem: the rename cannot fail half way, and moves at once)
      sb:exec("mkdir -p big && for i in 1 2 3 4 5 6 7 8; do head -c 524288 /dev/urandom > big/f$i; done && " ..
        "(cd big && sha256sum f* > ../sums)")
      local err
      if sb.isolation == "namespaces" then
        err = helper.error_of(sb.moveFile, sb, "/workspace/big", "/tmp/big")
        assert.equal("NO_SPACE", err.code)
        assert.is_true(err.context.rolledBack)
        assert.is_false(sb:exists("/tmp/big").exists)
        assert.equal("", sb:exec("ls -A /tmp").stdout) -- no staged copy left
        local r = sb:exec("(cd big && sha256sum -c --quiet ../sums)")
        assert.equal(0, r.exitCode, r.stdout .. r.stderr)
      end
      assert.is_true(sb:moveFile("/workspace/big", "/workspace/moved").success)
      assert.equal(0, sb:exec("(cd moved && sha256sum -c --quiet ../sums)").exitCode)
    end, { limits = { tmpBytes = 1024 * 1024 } })
  end)
end)

describe("a killed sandbox init", function()
  it("is noticed, reported once as SANDBOX_RESTARTED, and rebuilt over the same workspace", function()
    with_bystander(function(sb)
      sb:writeFile("/workspace/keep.txt", "kept")
      local two = sb:createSession { id = "two" }
      two:exec("cd /tmp && export TWO=2 && v=lost && echo tmpfile > /tmp/t")
      assert.is_table(sb:info())
      if not sb.init then
        -- the kernel refused namespaces (auto fell back): no init to lose
        assert.is_nil(sb:info().initPid)
        return
      end
      local old_pid = sb:info().initPid
      local running = moonbox.spawn(function() return sb:exec("sleep 30") end)
      local timed = moonbox.spawn(function() return two:exec("sleep 30", { timeout = 60000 }) end)
      moonbox.sleep(200)
      assert.equal(0, os.execute("kill -9 " .. old_pid) and 0 or 1)
      for _, t in ipairs { running, timed } do
        local err = helper.error_of(t.wait, t)
        assert.equal("SANDBOX_RESTARTED", err.code)
      end
      -- reported once: the next calls run on a rebuilt sandbox
      local r = sb:exec("cat /workspace/keep.txt")
      assert.equal(0, r.exitCode)
      assert.equal("kept", r.stdout)
      assert.equal("kept", sb:readFile("/workspace/keep.txt").content)
      local info = sb:info()
      assert.is_number(info.initPid)
      assert.are_not.equal(old_pid, info.initPid)
      assert.equal(1, info.restarts)
      -- a session keeps its id, last cwd and exported env; the shell's own
      -- state and the content of the private /tmp are gone
      r = two:exec("echo $TWO ${v-unset}; pwd; ls -A /tmp")
      assert.equal("2 unset\n/tmp\n", r.stdout)
      assert.is_true(two:writeFile("/workspace/two.txt", "2").success)
      assert.equal("2", sb:exec("cat /workspace/two.txt").stdout)
      assert.is_false(helper.pid_alive(old_pid))
    end, { isolation = "auto" })
  end)

  it("info() of a sandbox whose init died never raises a raw string", function()
    with_bystander(function(sb)
      if not sb.init then return assert.is_nil(sb:info().initPid) end
      local pid = sb:info().initPid
      assert.equal(0, os.execute("kill -9 " .. pid) and 0 or 1)
      assert.is_true(helper.eventually(function() return sb.init_dead end, 10000))
      local ok, info = pcall(sb.info, sb)
      assert.is_true(ok, tostring(info))
      assert.is_number(info.initPid)
      assert.equal("ok\n", sb:exec("echo ok").stdout)
    end, { isolation = "auto" })
  end)
end)

describe("a command's word for being done", function()
  -- every fd of the shell a command could write a record on; not the
  -- control FIFO (bash's script fd 255, and the writer the report builtin
  -- holds): what is written there would run at the top level (the report
  -- drops it: the next cases)
  local FORGE = [[__mb_ctl=/proc/$$/fd/255
    for fd in 11 100 101 102 200 255; do [ /proc/$$/fd/$fd -ef "$__mb_ctl" ] && continue
      printf '\n%s 42 run\0/etc/forged\0' $__mb_id >&$fd
      printf '\n%s 42 run - 00000000000000000000000000000000 00\0/etc/forged\0' $__mb_id >&$fd
    done 2>/dev/null
    for fd in /proc/$$/fd/*; do [ "${fd##*/}" -gt 2 ] && ! [ "$fd" -ef "$__mb_ctl" ] || continue
      printf '\n%s 42 run\0/etc/forged\0' $__mb_id >"$fd"; done 2>/dev/null
    builtin __mb_rep $__mb_id 42 run /dev/null 2>/dev/null
    __mb_report $__mb_id 42 run 2>/dev/null
    ( builtin __mb_rep $__mb_id 42 run /dev/null ) 2>/dev/null
    ]]

  it("a forged status record neither ends exec early nor changes its exit code", function()
    with_bystander(function(sb)
      local r = sb:exec(FORGE .. "sleep 0.3; echo done; (exit 7)")
      assert.equal(7, r.exitCode)
      assert.equal("done\n", r.stdout)
      assert.is_false(r.timedOut)
      -- the session carries on: the shell's cwd is its own, not the forger's
      r = sb:exec("pwd; echo $((1 + 1))")
      assert.equal(0, r.exitCode)
      assert.equal("2\n", r.stdout:match("\n(.*)$"))
      assert.are_not.equal("/etc/forged", r.stdout:match("^[^\n]*"))
    end)
  end)

  it("a forging command still times out, and its tree is killed", function()
    with_bystander(function(sb)
      -- also commands written into the control FIFO, to report at the top
      -- level once the body ends (the report drops them unread), through
      -- bash's script fd reopened and through the FIFO's writer the shell
      -- holds
      local inject = ([[printf '__mb_report $__mb_id 42 run; sleep SLEEP\n' >/proc/$$/fd/255
        for fd in /proc/$$/fd/*; do [ "$fd" -ef "$__mb_ctl" ] && [ "${fd##*/}" != 255 ] || continue
          printf '__mb_report $__mb_id 42 run; sleep SLEEP\n' >&"${fd##*/}"; done 2>/dev/null
        ]]):gsub("SLEEP", mark(16180))
      local r = sb:exec(FORGE .. inject .. "sleep " .. mark(16180) .. "; echo late", { timeout = 500 })
      assert.is_true(r.timedOut)
      assert.equal(124, r.exitCode)
      assert.is_false(marked_alive(sb, "sleep." .. mark(16180)), "the forging command outlived its timeout")
      assert.equal("ok\n", sb:exec("echo ok").stdout)
    end)
  end)

  -- hardening finding 7: the record written on every fd of the shell above 2,
  -- the control FIFO's writer included (what lands there was refused with
  -- the record, so exec waited for its timeout, or for ever without one),
  -- and a command written there (to run at the top level once the body ends)
  local FORGE_ALL = [[for f in /proc/$$/fd/*; do n=${f##*/}; [ "$n" -gt 2 ] || continue
      printf '\n%s 42 run\0/etc/forged\0' "$__mb_id" >&"$n"
      printf '\n%s 42 run\0/etc/forged\0' "$__mb_id" >"$f"; done 2>/dev/null
    printf 'touch %s/injected-ran\n' "$PWD" >/proc/$$/fd/255
    sleep 1; echo real; (exit 7)]]

  local function forge_all(opts)
    with_bystander(function(sb)
      -- (a moonbox.timeout around the call: a session that never returns
      -- fails the spec instead of hanging it)
      local ok, r = pcall(moonbox.timeout, 20000, function() return sb:exec(FORGE_ALL, opts) end)
      assert.is_true(ok, tostring(r))
      assert.equal(7, r.exitCode)
      assert.equal("real\n", r.stdout)
      assert.is_false(r.timedOut)
      -- the session goes on in its own cwd; what the command wrote into
      -- the control FIFO never ran
      local cwd = sb:exec("pwd").stdout
      r = sb:exec("test -e injected-ran && echo injected-ran || echo clean; pwd")
      assert.equal(0, r.exitCode)
      assert.equal("clean\n" .. cwd, r.stdout)
      assert.are_not.equal("/etc/forged\n", cwd)
    end)
  end

  it("a record forged on every fd above 2, the control FIFO's included, leaves exec its real end", function()
    forge_all { timeout = 8000 }
  end)

  it("... and so without a timeout", function()
    forge_all {}
  end)

  it("the record's fd and nonce reach no command: not in its env, fds or a readable file", function()
    with_bystander(function(sb)
      -- an external command and a forked subshell hold no fd of the status pipe
      -- (an external command has 0-2 and the directory ls reads; a forked
      -- subshell also the directory its glob reads and bash's saved copies of 0-2)
      local r = sb:exec([[echo $(ls /proc/self/fd); ( cd /proc/$BASHPID/fd && echo * )]])
      local ext, sub = r.stdout:match("^([^\n]*)\n([^\n]*)\n$")
      assert.equal("0 1 2 3", ext)
      for fd in sub:gmatch("%d+") do
        assert.truthy(({ ["0"] = 1, ["1"] = 1, ["2"] = 1, ["3"] = 1, ["10"] = 1, ["11"] = 1, ["12"] = 1 })[fd],
          "a forked subshell holds fd " .. fd .. " of the shell (" .. sub .. ")")
      end
      r = sb:exec("env; cat /proc/$$/environ 2>/dev/null | tr '\\0' '\\n'")
      assert.is_nil(r.stdout:find("[0-9a-f]" .. ("[0-9a-f]"):rep(31)), "a nonce-like value is readable")
      -- the shell's memory is not readable by its commands
      assert.equal("denied\n", sb:exec("head -c 1 /proc/$$/mem >/dev/null 2>&1 && echo read || echo denied").stdout)
    end)
  end)
end)
