-- Contract details of /work/shared/API.md found to deviate in an audit, one
-- `it` per fixed deviation, observable results only.
local core = require "moonbox.core"
local with_sandbox = helper.with_sandbox
local error_of = helper.error_of

describe("contract: background processes", function()
  it("forgets an autoCleanup process before a waiter of its exit wakes", function()
    with_sandbox(function(sb)
      local p = sb:startProcess("echo done", { autoCleanup = true })
      assert.equal(0, p:waitForExit(10000).exitCode)
      assert.is_nil(sb:getProcess(p.id))
      assert.equal("PROCESS_NOT_FOUND", error_of(sb.getProcessLogs, sb, p.id).code)
      -- without it the record stays
      local kept = sb:startProcess("true")
      kept:waitForExit(10000)
      assert.equal(kept, sb:getProcess(kept.id))
    end)
  end)
end)

describe("contract: policy hooks", function()
  it("let onCreateSession rewrite the options and give the reason in POLICY_DENIED", function()
    with_sandbox(function(sb)
      local s = sb:createSession { id = "rewritten", env = { ASKED = "yes" } }
      assert.equal("from-policy|\n", s:exec('echo "$INJECTED|${ASKED-}"').stdout)
      local err = error_of(sb.createSession, sb, { id = "refused" })
      assert.equal("POLICY_DENIED", err.code)
      assert.truthy(err.message:find("not this one", 1, true))
      assert.equal("not this one", err.context.reason)
    end, { policy = { hooks = {
      onCreateSession = function(_, opts)
        if opts.id == "refused" then return nil, "not this one" end
        opts.env = { INJECTED = "from-policy" }
        return opts
      end,
    } } })
  end)

  it("apply onEnv to sandbox-level setEnvVars, also before the default session exists", function()
    with_sandbox(function(sb)
      -- the first call: no default session yet
      local err = error_of(sb.setEnvVars, sb, { DENY = "1" })
      assert.equal("POLICY_DENIED", err.code)
      assert.equal("no DENY", err.context.reason)
      sb:setEnvVars { SECRET = "s", KEPT = "k" }
      assert.equal("|k\n", sb:exec('echo "${SECRET-}|$KEPT"').stdout)
      assert.equal("|k\n", sb:createSession():exec('echo "${SECRET-}|$KEPT"').stdout)
      assert.equal("POLICY_DENIED", error_of(sb.setEnvVars, sb, { DENY = "1" }).code)
    end, { policy = { hooks = {
      onEnv = function(_, map)
        if map.DENY then return nil, "no DENY" end
        map.SECRET = nil
        return map
      end,
    } } })
  end)

  it("treat a non-table value from onEnv as allowing the map unchanged", function()
    with_sandbox(function(sb)
      assert.is_true(sb:setEnvVars({ ALLOWED = "1" }).success)
      assert.equal("1\n", sb:exec("echo $ALLOWED").stdout)
      local s = sb:createSession()
      assert.is_true(s:setEnvVars({ ALSO = "2" }).success)
      assert.equal("1 2\n", s:exec("echo $ALLOWED $ALSO").stdout)
    end, { policy = { hooks = { onEnv = function() return true end } } })
  end)

  it("put the reason into the context of POLICY_DENIED for exec, startProcess and files", function()
    with_sandbox(function(sb)
      assert.equal("no exec", error_of(sb.exec, sb, "echo forbidden").context.reason)
      assert.equal("no process", error_of(sb.startProcess, sb, "sleep 1").context.reason)
      assert.equal("no secrets", error_of(sb.writeFile, sb, "secret.txt", "x").context.reason)
    end, { policy = { hooks = {
      onExec = function(_, cmd) if cmd == "echo forbidden" then return nil, "no exec" end return cmd end,
      onStartProcess = function() return nil, "no process" end,
      onFile = function(_, _, path) if path:find("secret", 1, true) then return nil, "no secrets" end return path end,
    } } })
  end)
end)

describe("contract: commands", function()
  it("rejects a negative maxOutputBytes with VALIDATION_FAILED", function()
    with_sandbox(function(sb)
      local err = error_of(sb.exec, sb, "echo hi", { maxOutputBytes = -1 })
      assert.equal("VALIDATION_FAILED", err.code)
      assert.equal("maxOutputBytes", err.context.field)
      assert.equal("VALIDATION_FAILED", error_of(sb.execStream, sb, "echo hi", { maxOutputBytes = -5 }).code)
      local r = sb:exec("echo hi", { maxOutputBytes = 0 })
      assert.equal("", r.stdout)
      assert.is_true(r.truncated)
    end)
  end)

  it("refuses a boolean option of another type, and a bad signal with nothing to send it to", function()
    with_sandbox(function(sb)
      local err = error_of(sb.startProcess, sb, "true", { autoCleanup = "false" })
      assert.equal("VALIDATION_FAILED", err.code)
      assert.equal("autoCleanup", err.context.field)
      assert.same({}, sb:listProcesses()) -- nothing ran
      local p = sb:startProcess("echo a.b")
      p:waitForExit(10000)
      assert.equal("plain", error_of(p.waitForLog, p, "a.", 1000, { plain = "no" }).context.field)
      assert.equal("keepFiles", error_of(sb.destroy, sb, { keepFiles = "no" }).context.field)
      sb:cleanupCompletedProcesses()
      assert.equal("signal", error_of(sb.killAllProcesses, sb, "NOPE").context.field)
      -- a live sandbox's root: the same one, or a mistake
      local moonbox = require "moonbox"
      assert.equal(sb, moonbox.getSandbox(sb.id, { root = sb:info().root }))
      assert.equal("root", error_of(moonbox.getSandbox, sb.id, { root = "/" }).context.field)
    end)
  end)

  it("keeps the session working after a user's ERR or DEBUG trap", function()
    with_sandbox(function(sb)
      sb:exec("V=kept; trap 'echo ERR' ERR")
      local r = sb:exec("false", { timeout = 10000 })
      assert.is_false(r.timedOut)
      assert.equal(1, r.exitCode)
      assert.equal("ERR\n", r.stdout)
      sb:exec("trap - ERR; trap 'printf 5' DEBUG")
      r = sb:exec("echo a", { timeout = 10000 })
      assert.is_false(r.timedOut)
      assert.equal(0, r.exitCode)
      sb:exec("trap - DEBUG")
      assert.equal("kept\n", sb:exec("echo $V").stdout)
    end)
  end)

  it("runs a user's EXIT trap at exit, and the exit still keeps the cwd and exports", function()
    with_sandbox(function(sb)
      sb:exec("mkdir -p sub")
      local r = sb:exec("trap 'echo bye $?; echo err >&2' EXIT; trap 'echo int' INT; trap -p INT")
      assert.equal("trap -- 'echo int' SIGINT\n", r.stdout)
      r = sb:exec("cd sub; export LATE=2; exit 3")
      assert.same({ 3, "bye 3\n", "err\n" }, { r.exitCode, r.stdout, r.stderr })
      assert.equal("sub 2\n", sb:exec("echo ${PWD##*/} $LATE").stdout)
      -- reset, set with 0, reset with a lone sigspec: nothing runs at exit
      r = sb:exec("trap 'echo a' EXIT; trap - EXIT; trap 'echo b' 0; trap EXIT; exit 4")
      assert.same({ 4, "" }, { r.exitCode, r.stdout })
    end)
  end)

  it("runs nothing of a command after its timeout and keeps the shell's state", function()
    with_sandbox(function(sb)
      sb:exec("V=kept; f() { echo fn; }")
      local r = sb:exec("echo before; sleep 10; echo after; touch after-timeout", { timeout = 300 })
      assert.is_true(r.timedOut)
      assert.equal(124, r.exitCode)
      assert.equal("before\n", r.stdout)
      r = sb:exec("while :; do :; done; echo after", { timeout = 300 })
      assert.is_true(r.timedOut)
      assert.equal("", r.stdout)
      assert.is_false(sb:exists("after-timeout").exists)
      assert.equal("kept\nfn\n", sb:exec("echo $V; f").stdout)
      local s = sb:createSession { commandTimeoutMs = 300 }
      r = s:exec("sleep 10; echo after")
      assert.is_true(r.timedOut)
      assert.equal("", r.stdout)
    end)
  end)
end)

describe("contract: a script's own traps", function()
  it("trap lists only the user's traps, the kept EXIT one included", function()
    with_sandbox(function(sb)
      assert.equal("", sb:exec("trap -p").stdout)
      assert.equal("", sb:exec("trap").stdout)
      local r = sb:exec("trap 'echo it'\\''s mine' EXIT; trap 'echo int' INT; trap -p EXIT; echo --; trap")
      assert.equal("trap -- 'echo it'\\''s mine' EXIT\n--\ntrap -- 'echo it'\\''s mine' EXIT\n" ..
        "trap -- 'echo int' SIGINT\n", r.stdout)
      -- the session's interrupt signal is refused, also as a number a reset takes
      for _, cmd in ipairs { "trap 'echo x' RTMIN+3", "trap - SIGRTMIN+3", "trap 37 TERM" } do
        r = sb:exec(cmd)
        assert.equal(1, r.exitCode, cmd)
        assert.truthy(r.stderr:find("used by the session shell itself", 1, true), cmd)
      end
    end)
  end)

  it("a USR1 trap or kill -USR1 $$ is the script's own: a timeout still ends the command, USR1 kills", function()
    with_sandbox(function(sb)
      local s = sb:createSession {}
      s:exec("V=keep; trap 'echo got-usr1' USR1")
      local r = s:exec("sleep 10; touch after-timeout; echo after", { timeout = 300 })
      assert.same({ 124, true, "" }, { r.exitCode, r.timedOut, r.stdout })
      assert.equal("keep\n", s:exec("echo $V").stdout)
      assert.equal("got-usr1\nstill\n", s:exec("kill -USR1 $$; echo still").stdout)
      local s2 = sb:createSession {}
      r = s2:exec("kill -USR1 $$; echo after")
      assert.same({ 138, false, "" }, { r.exitCode, r.timedOut, r.stdout })
      assert.is_false(sb:exists("after-timeout").exists)
    end)
  end)
end)

describe("contract: set -x", function()
  it("traces the command's own lines as bash -c does, never the session's plumbing", function()
    with_sandbox(function(sb)
      for _, first in ipairs { true, false } do
        local s = sb:createSession {}
        if not first then s:exec("true") end -- (a first command goes before the shell's hello)
        local r = s:exec("set -x; echo hi; f() { echo in; }; f; x=$(echo sub)")
        assert.same({ "hi\nin\n", "+ echo hi\n+ f\n+ echo in\n++ echo sub\n+ x=sub\n" }, { r.stdout, r.stderr })
        -- it stays on, in every shape of command: stdin, cwd, env
        assert.equal("+ echo again\n", s:exec("echo again").stderr)
        assert.equal("+ cat\n", s:exec("cat", { stdin = "in" }).stderr)
        assert.equal("+ cat\n+ pwd\n", s:exec("cat; pwd", { stdin = "in", cwd = "/tmp" }).stderr)
        assert.equal("+ echo z\n", s:exec("echo $Q", { env = { Q = "z" } }).stderr)
        -- a timeout adds nothing of its own, and leaves it on
        r = s:exec("f() { sleep 5; }; f", { timeout = 300 })
        assert.same({ 124, "+ f\n+ sleep 5\n" }, { r.exitCode, r.stderr })
        r = s:exec("sleep 5", { timeout = 300, stdin = "x" })
        assert.same({ 124, "+ sleep 5\n" }, { r.exitCode, r.stderr })
        assert.equal("+ echo still\n", s:exec("echo still").stderr)
        -- until the user turns it off
        assert.equal("+ set +x\n", s:exec("set +x; echo off").stderr)
        assert.equal("", s:exec("echo quiet", { stdin = "x", cwd = "/tmp" }).stderr)
        -- an exit under it adds nothing of the shell's own exit
        r = s:exec("set -x; trap 'echo bye' EXIT; exit 3")
        assert.same({ 3, "bye\n", "+ trap 'echo bye' EXIT\n+ exit 3\n" }, { r.exitCode, r.stdout, r.stderr })
        sb:deleteSession(s.id)
      end
    end)
  end)
end)

describe("contract: a timeout inside a function", function()
  it("leaves nothing behind: the next commands, of every shape, run as before it", function()
    with_sandbox(function(sb)
      local s = sb:createSession {}
      local shapes = { {}, { stdin = "in" }, { cwd = "/tmp" }, { env = { Q = "z" } } }
      local cmd = "echo ok $LINENO ${#BASH_SOURCE[@]} ${#FUNCNAME[@]} $-"
      local before = {}
      for i, opts in ipairs(shapes) do before[i] = s:exec(cmd, opts) end
      local r = s:exec("f() { sleep 5; }; g() { f; echo no; }; g; echo no", { timeout = 300 })
      assert.same({ 124, true, "", "" }, { r.exitCode, r.timedOut, r.stdout, r.stderr })
      for i, opts in ipairs(shapes) do
        r = s:exec(cmd, opts)
        assert.same({ 0, before[i].stdout, "" }, { r.exitCode, r.stdout, r.stderr })
      end
    end)
  end)
end)

describe("contract: the session shell's own descriptors", function()
  it("ulimit refuses an open-files limit the shell could not run commands under; a subshell may", function()
    with_sandbox(function(sb)
      local s = sb:createSession {}
      local before = s:exec("ulimit -Sn").stdout
      -- (1 and 2: below the fds bash restores its redirections to, which
      -- the trial in a subshell once used, so that it saw no limit at all)
      for _, cmd in ipairs { "ulimit -n 1", "ulimit -Sn 2", "ulimit -n 3", "ulimit -Sn 8", "ulimit -n 12",
        "set -e; ulimit -n4", "ulimit -n 1 2>/dev/null" } do
        local r = s:exec(cmd)
        assert.same({ 1, "" }, { r.exitCode, r.stdout }, cmd)
        if not cmd:find("2>/dev/null", 1, true) then
          assert.truthy(r.stderr:find("would leave the session shell unable to run commands", 1, true), cmd)
        end
        assert.equal("alive\n", s:exec("echo alive", { timeout = 10000 }).stdout, cmd)
      end
      assert.equal(before, s:exec("ulimit -n").stdout) -- a query prints the limit alone
      local after = s:exec("echo after")
      assert.same({ 0, "after\n" }, { after.exitCode, after.stdout })
      assert.equal(before, s:exec("ulimit -Sn").stdout)
      assert.equal("5\nsub\n", s:exec("(ulimit -n 5; ulimit -n); echo sub").stdout)
      assert.equal("40\n", s:exec("ulimit -Sn 40 && ulimit -Sn").stdout)
      assert.equal("v\n", s:exec("ulimit -v unlimited; echo v").stdout)
      assert.equal("ok\n", s:exec("echo ok").stdout)
    end)
  end)
end)

describe("contract: the session's exported environment", function()
  it("past execve's 2 MiB it is not kept: after an exit the shell comes back with the last one that fit", function()
    with_sandbox(function(sb)
      local s = sb:createSession {}
      s:exec("export SMALL=kept")
      local r = s:exec("export BIG=$(head -c 3000000 /dev/zero | tr '\\0' a); echo ${#BIG}")
      assert.equal("3000000\n", r.stdout)
      s:exec("exit 0")
      r = s:exec("echo $SMALL ${#BIG}")
      assert.same({ 0, "kept 0\n" }, { r.exitCode, r.stdout })
    end)
  end)
end)

describe("contract: the names the session shell's protocol calls", function()
  it("an alias or function named eval, builtin or __mb_run does not take later commands' place", function()
    with_sandbox(function(sb)
      for _, def in ipairs { "alias eval='echo ev'", "eval() { :; }", "alias builtin='echo nope'", "builtin() { :; }",
        "__mb_run() { :; }", "alias __mb_report=true", "alias @='echo nope'", "@() { :; }", "builtin enable -n @" } do
        local s = sb:createSession {}
        local r = s:exec(def, { timeout = 10000 })
        assert.same({ 0, false }, { r.exitCode, r.timedOut }, def)
        r = s:exec("echo alive; type -t eval builtin", { timeout = 10000 })
        assert.same({ 0, "alive\nbuiltin\nbuiltin\n" }, { r.exitCode, r.stdout }, def)
      end
    end)
  end)

  it("a session's own cd, export, unset or exit (a function, an alias) leaves a call's cwd and env to bash's",
    function()
    with_sandbox(function(sb)
      for _, def in ipairs { "cd() { builtin cd \"$@\" && echo \"entered $PWD\"; }", "alias cd='echo HIJACK'",
        "cd() { echo HIJACK; }", "alias export='echo HIJACK'", "export() { echo HIJACK; }",
        "alias unset='echo HIJACK'", "unset() { echo HIJACK; }", "exit() { echo HIJACK; }" } do
        local s = sb:createSession {}
        assert.equal(0, s:exec(def).exitCode, def)
        local r = s:exec("echo \"$PWD [${QQ-}] [${HOME-none}]\"", { cwd = "/tmp", env = { QQ = "z", HOME = false } })
        assert.same({ 0, "/tmp [z] [none]\n", "" }, { r.exitCode, r.stdout, r.stderr }, def)
        -- and the definition is still the session's
        local name = def:match("^alias (%a+)") or def:match("^(%a+)%(")
        assert.equal(def:match("^alias") and "alias\n" or "function\n", s:exec("type -t " .. name).stdout, def)
        sb:deleteSession(s.id)
      end
    end)
  end)

  it("the control line's builtin `@` runs only as the control line: a command calling it gets 3", function()
    with_sandbox(function(sb)
      local s = sb:createSession {}
      local r = s:exec("@ 1; echo $?; f() { @ 2; }; f; echo $?; X=$(@ 1; echo $?); echo $X", { timeout = 10000 })
      assert.same({ 0, "3\n3\n3\n", false }, { r.exitCode, r.stdout, r.timedOut })
      -- `@` alone (the shape sent with the outputs) too, and it takes no message meant for the next command
      r = s:exec("@; echo $?; f() { @; }; f; echo $?", { timeout = 10000 })
      assert.same({ 0, "3\n3\n", false }, { r.exitCode, r.stdout, r.timedOut })
      assert.same({ 0, "next\n" }, { s:exec("echo next").exitCode, s:exec("echo next").stdout })
      -- the shapes still run in the shell itself: declare makes a global, local is refused
      r = s:exec("declare KEPT=1; local L=2", { timeout = 10000 })
      assert.same({ 1, "bash: line 1: local: can only be used in a function\n" }, { r.exitCode, r.stderr })
      assert.equal("1\n", s:exec("echo $KEPT").stdout)
    end)
  end)
end)

describe("contract: sandboxes", function()
  local moonbox = require "moonbox"
  local iso = os.getenv("MOONBOX_TEST_ISOLATION")

  it("two first getSandbox calls for one id, at once, get the same sandbox", function()
    run_task(function()
      local root = helper.mkdtemp()
      local id = ("spec-twice-%d"):format(core.getpid())
      local r = moonbox.all(function() return moonbox.getSandbox(id, { root = root, isolation = iso }) end,
        function() return moonbox.getSandbox(id, { root = root, isolation = iso }) end)
      assert.equal(r[1], r[2])
      assert.equal("x\n", r[1]:exec("echo x").stdout)
      r[1]:destroy({ keepFiles = false })
    end)
  end)

  it("getSandbox while that id's sandbox is being destroyed waits for the destroy, then makes it anew", function()
    run_task(function()
      local root = helper.mkdtemp()
      local id = ("spec-redo-%d"):format(core.getpid())
      local sb = moonbox.getSandbox(id, { root = root, isolation = iso })
      sb:writeFile("kept.txt", "k")
      local r = moonbox.all(function() return sb:destroy({ keepFiles = true }) end,
        function() return moonbox.getSandbox(id, { root = root, isolation = iso }) end)
      local again = r[2]
      assert.is_true(r[1].success)
      assert.are_not.equal(sb, again)
      assert.equal("k", again:readFile("kept.txt").content) -- destroy kept the files
      assert.equal(again, moonbox.getSandbox(id))
      again:destroy({ keepFiles = false })
    end)
  end)

  it("calls that a destroy cuts short raise coded errors, never a raw string", function()
    run_task(function()
      local function raised(what, fn, ...)
        local ok, err = pcall(fn, ...)
        assert(not ok, what .. ": expected an error")
        return err
      end
      local function coded(err, what)
        assert.is_table(err, what .. ": " .. tostring(err))
        assert.is_string(err.code, what)
        return err.code
      end
      -- runCode whose default context is still starting
      local sb = helper.new_sandbox()
      local r = moonbox.all(function() return raised("runCode", sb.runCode, sb, "1+1", { language = "python" }) end,
        function() moonbox.sleep(20) sb:destroy() end)
      assert.equal("SANDBOX_DESTROYED", coded(r[1], "runCode"))
      -- runCode running
      sb = helper.new_sandbox()
      sb:runCode("0", { language = "python" })
      r = moonbox.all(function() return raised("runCode running", sb.runCode, sb, "import time\ntime.sleep(5)") end,
        function() moonbox.sleep(200) sb:destroy() end)
      assert.equal("SANDBOX_DESTROYED", coded(r[1], "runCode running"))
      -- createSession, with a warm spare shell or not
      sb = helper.new_sandbox()
      sb:createSession {}
      r = moonbox.all(function() return { pcall(sb.createSession, sb, { id = "x" }) } end,
        function() sb:destroy() end)
      -- (made before the destroy took it, or refused)
      if not r[1][1] then assert.equal("SANDBOX_DESTROYED", coded(r[1][2], "createSession")) end
      -- waitForPort of a process the destroy kills
      sb = helper.new_sandbox()
      local p = sb:startProcess("sleep 30")
      r = moonbox.all(function() return raised("waitForPort", p.waitForPort, p, 1, { timeout = 5000 }) end,
        function() moonbox.sleep(50) sb:destroy() end)
      assert.equal("PROCESS_EXITED_BEFORE_READY", coded(r[1], "waitForPort"))
      -- runCode whose default context is deleted while it starts
      sb = helper.new_sandbox()
      r = moonbox.all(
        function() return raised("runCode, context deleted", sb.runCode, sb, "1+1", { language = "python" }) end,
        function() moonbox.sleep(5) sb:deleteCodeContext("default-python") end)
      assert.equal("CONTEXT_NOT_FOUND", coded(r[1], "runCode, context deleted"))
      sb:destroy()
    end)
  end)
end)

describe("contract: sessions", function()
  it("a sandbox setEnvVars that comes while the default session starts reaches it", function()
    with_sandbox(function(sb)
      sb:createSession { id = "a" } -- (the sandbox keeps a warm spare: the default session adopts it)
      require("moonbox").sleep(50) -- (the spare's start)
      local t = require("moonbox").spawn(function() return sb:exec("true") end)
      sb:setEnvVars { SQ = "set" }
      t:wait()
      assert.equal("set\n", sb:exec("echo ${SQ-unset}").stdout)
      assert.equal("set\n", sb:createSession {}:exec("echo ${SQ-unset}").stdout)
    end)
  end)

  it("deleteSession of a session still being made deletes it once made, not SESSION_NOT_FOUND", function()
    with_sandbox(function(sb)
      local moonbox = require "moonbox"
      sb:createSession {}
      -- a warm spare shell: the next createSession adopts it, and waits meanwhile
      assert.is_true(helper.eventually(function() return sb.spare ~= nil end))
      local seen
      local r = moonbox.all(function() return { pcall(sb.createSession, sb, { id = "late" }) } end,
        function()
          seen = type(sb.sessions.late)
          return { pcall(sb.deleteSession, sb, "late") }
        end)
      assert.equal("boolean", seen, "the delete came while the session was being made") -- (reserved: true)
      assert.is_true(r[1][1], tostring(r[1][2]))
      assert.is_true(r[2][1], tostring(r[2][2] and r[2][2].code))
      assert.same({ true, "late" }, { r[2][2].success, r[2][2].sessionId })
      assert.equal("SESSION_NOT_FOUND", helper.error_of(sb.getSession, sb, "late").code)
      assert.is_table(helper.error_of(r[1][2].exec, r[1][2], "true")) -- the session made is gone
      assert.equal("x\n", sb:createSession({ id = "late" }):exec("echo x").stdout) -- the id is free
    end)
  end)
end)

describe("contract: streams", function()
  it("every stream iterator called again after its end returns nil again, never waits", function()
    with_sandbox(function(sb)
      local function drained(it)
        for _ in it do end
        return it()
      end
      assert.is_nil(drained(sb:execStream("echo once")))
      local p = sb:startProcess("echo x")
      p:waitForExit(10000)
      assert.is_nil(drained(sb:streamProcessLogs(p.id)))
      assert.is_nil(drained(sb:runCodeStream("1 + 1", { language = "lua" })))
      sb:writeFile("f", "abc")
      assert.is_nil(drained(sb:readFileStream("f")))
    end)
  end)
end)

describe("contract: files", function()
  it("moves files and directories between /workspace and the private /tmp", function()
    with_sandbox(function(sb)
      sb:exec("mkdir -p tree/a && echo 1 > tree/a/f && echo run > script && chmod 755 script")
      if sb:info().isolation ~= "namespaces" then
        -- /tmp is the host's there: out of the file API's reach, both ways
        local name = "/tmp/moonbox-contract-" .. core.getpid()
        assert.equal("PATH_OUTSIDE_SANDBOX", error_of(sb.moveFile, sb, "/workspace/script", name).code)
        assert.equal("PATH_OUTSIDE_SANDBOX", error_of(sb.moveFile, sb, "/workspace/tree", "/tmp").code)
        assert.is_nil(io.open(name))
        assert.is_true(sb:exists("/workspace/script").exists)
        assert.equal("1\n", sb:readFile("/workspace/tree/a/f").content)
        return
      end
      local r = sb:moveFile("/workspace/script", "/tmp/script")
      assert.equal("/tmp/script", r.newPath)
      assert.equal("run\n", sb:exec("/tmp/script >/dev/null; cat /tmp/script").stdout)
      assert.is_false(sb:exists("/workspace/script").exists)
      -- into an existing directory, like mv
      r = sb:moveFile("/workspace/tree", "/tmp")
      assert.equal("/tmp/tree", r.newPath)
      assert.equal("1\n", sb:readFile("/tmp/tree/a/f").content)
      assert.is_false(sb:exists("/workspace/tree").exists)
      sb:writeFile("/workspace/old", "old")
      assert.equal("/workspace/old", sb:renameFile("/tmp/script", "/workspace/old").newPath)
      assert.equal("run\n", sb:readFile("/workspace/old").content)
      assert.is_false(sb:exists("/tmp/script").exists)
    end)
  end)

  it("names entries under /tmp by their sandbox paths", function()
    with_sandbox(function(sb)
      if sb:info().isolation ~= "namespaces" then
        -- /tmp is the host's there: the file API does not list or name it
        assert.equal("PATH_OUTSIDE_SANDBOX", error_of(sb.listFiles, sb, "/tmp").code)
        assert.equal("PATH_OUTSIDE_SANDBOX", error_of(sb.mkdir, sb, "/tmp/moonbox-into-" .. core.getpid()).code)
        return
      end
      sb:exec("mkdir -p /tmp/lv/sub && touch /tmp/lv/sub/b")
      local r = sb:listFiles("/tmp/lv", { recursive = true })
      assert.equal("/tmp/lv", r.path)
      assert.same({ "/tmp/lv/sub", "/tmp/lv/sub/b" }, { r.files[1].absolutePath, r.files[2].absolutePath })
      sb:mkdir("/tmp/into")
      assert.equal("/tmp/into/sub", sb:moveFile("/tmp/lv/sub", "/tmp/into").newPath)
    end)
  end)
end)

describe("contract: code interpreter", function()
  it("logs each python print as one stdout entry", function()
    with_sandbox(function(sb)
      assert.same({ "hello\n" }, sb:runCode("print('hello')", { language = "python" }).logs.stdout)
      assert.same({ "a b\n" }, sb:runCode("print('a', 'b')", { language = "python" }).logs.stdout)
    end)
  end)

  it("gives onStdout and onStderr the seed's OutputMessage {text, timestamp}, which also reads as its text", function()
    with_sandbox(function(sb)
      local texts, joined, stamps, errs = {}, "", {}, {}
      sb:runCode("print('out'); import sys; print('err', file=sys.stderr)", { language = "python",
        onStdout = function(m)
          texts[#texts + 1] = m.text
          joined = joined .. m
          stamps[#stamps + 1] = m.timestamp
        end,
        onStderr = function(m) errs[#errs + 1] = tostring(m) end })
      assert.same({ "out\n" }, texts)
      assert.equal("out\n", joined)
      assert.matches("^%d%d%d%d%-%d%d%-%d%dT%d%d:%d%d:%d%d%.%d%d%dZ$", stamps[1])
      assert.same({ "err\n" }, errs)
    end)
  end)
end)
