-- Sessions and exec (issue #3): one `it` per guarantee, observable results.
local moonbox = require "moonbox"
local core = require "moonbox.core"

local with_sandbox = helper.with_sandbox

local function alive(pid, sb) return helper.pid_alive(pid, sb) end

describe("session validation", function()
  it("rejects empty commands, bad env names and missing cwds with VALIDATION_FAILED", function()
    with_sandbox(function(sb)
      for _, call in ipairs {
        function() sb:exec("") end,
        function() sb:exec("   ") end,
        function() sb:exec("echo a\0b > /workspace/nul-ran") end, -- bash would run "echo ab"
        function() sb:startProcess("echo a\0b > /workspace/nul-ran") end,
        function() sb:exec("true", { env = { ["1BAD"] = "x" } }) end,
        function() sb:exec("true", { cwd = "/workspace/nope" }) end,
        function() sb:exec("true", { bogus = 1 }) end,
        function() sb:createSession { cwd = "/workspace/missing" } end,
        function() sb:setEnvVars { ["A-B"] = "x" } end,
      } do
        local ok, err = pcall(call)
        assert.is_false(ok)
        assert.equal("VALIDATION_FAILED", err.code)
      end
      assert.is_false(sb:exists("/workspace/nul-ran").exists) -- nothing ran
      -- an array where a map was meant is named as such
      local _, err = pcall(sb.exec, sb, "true", { env = { "A=1" } })
      assert.equal("env: expected a table of NAME = value, got an array", err.message)
    end)
  end)

  it("makes one default session when several tasks use a sandbox first at once", function()
    with_sandbox(function(sb)
      sb:createSession { id = "warm" } -- from now on a spare shell waits: adopting it yields
      moonbox.sleep(50)
      local fns = {}
      for i = 1, 5 do fns[i] = function() return sb:exec("echo $$").stdout end end
      local pids = moonbox.all(fns)
      for i = 2, 5 do assert.equal(pids[1], pids[i]) end
      assert.same({ "default", "warm" }, sb:listSessions())
    end)
  end)

  it("raises SESSION_NOT_FOUND and SESSION_ALREADY_EXISTS", function()
    with_sandbox(function(sb)
      assert.equal("SESSION_NOT_FOUND", select(2, pcall(sb.getSession, sb, "nope")).code)
      assert.equal("SESSION_NOT_FOUND", select(2, pcall(sb.deleteSession, sb, "nope")).code)
      sb:createSession { id = "a" }
      assert.equal("SESSION_ALREADY_EXISTS", select(2, pcall(sb.createSession, sb, { id = "a" })).code)
    end)
  end)

  it("deleteSession ends the session's terminals and code contexts with everything else it started", function()
    with_sandbox(function(sb)
      local s = sb:createSession { id = "gone" }
      local keep = sb:createSession { id = "kept" }
      local t, other = s:terminal {}, keep:terminal {}
      t:write("sleep 1001 & echo $! > t.pid\n")
      local ctx = s:createCodeContext { language = "lua" }
      local kept_ctx = keep:createCodeContext { language = "lua" }
      assert.is_nil(s:runCode("x = 1", { context = ctx }).error)
      assert.is_true(helper.eventually(function() return sb:exists("t.pid").exists end))
      local job = tonumber(sb:readFile("t.pid").content)
      sb:deleteSession("gone")
      assert.equal(137, t:wait())
      assert.is_false(helper.pid_alive(job, sb))
      assert.equal("CONTEXT_NOT_FOUND", helper.error_of(keep.runCode, keep, "x", { context = ctx.id }).code)
      -- the other session's are untouched
      assert.equal("2", keep:runCode("1 + 1", { context = kept_ctx }).results[1].text)
      other:write("echo still-$((6*7))\n")
      local seen = ""
      assert.is_true(helper.eventually(function()
        seen = seen .. (other:read() or "")
        return seen:find("still%-42")
      end))
      other:close()
    end)
  end)

  it("deleteSession('default') resets it: its shell, jobs and processes die, the next call gets a fresh one", function()
    with_sandbox(function(sb)
      -- never used: nothing to kill, and nothing is created by it
      assert.is_true(sb:deleteSession("default").success)
      assert.same({}, sb:listSessions())
      sb:setEnvVars { LEVEL = "sandbox" }
      local old = sb:getSession("default")
      local r = sb:exec("export MINE=1; sleep 1000 & echo $! > job.pid; cd /tmp; echo $$")
      local shell_pid = tonumber(r.stdout)
      local job = tonumber(sb:readFile("/workspace/job.pid").content)
      local p = sb:startProcess("sleep 1000")
      assert.is_true(helper.pid_alive(job, sb))
      local res = sb:deleteSession("default")
      assert.same({ true, "default" }, { res.success, res.sessionId })
      assert.is_false(helper.pid_alive(job, sb))
      assert.is_false(helper.pid_alive(shell_pid, sb))
      assert.equal("killed", p.status)
      assert.equal("SESSION_NOT_FOUND", select(2, pcall(old.exec, old, "true")).code)
      -- fresh: the sandbox's env, the home directory, none of the old shell's state
      r = sb:exec('echo "$LEVEL:${MINE-unset}:$PWD:$$"')
      assert.equal(0, r.exitCode)
      local level, mine, cwd, pid = r.stdout:match("^(.-):(.-):(.-):(%d+)\n$")
      assert.same({ "sandbox", "unset" }, { level, mine })
      assert.equal(sb:host_path("/workspace"), cwd)
      assert.not_equal(shell_pid, tonumber(pid))
      assert.same({ "default" }, sb:listSessions())
    end)
  end)
end)

describe("session state", function()
  it("keeps cd, export, variables, functions, aliases and set -o between calls", function()
    with_sandbox(function(sb)
      local s = sb:createSession { id = "st" }
      s:exec("mkdir -p d && cd d && export E=1 && v=2 && f() { echo fn; } && alias al='echo alias' && set -o noglob")
      local r = s:exec("basename $PWD; echo $E $v; f; al; echo *; [[ $- == *f* ]] && echo noglob")
      assert.equal("d\n1 2\nfn\nalias\n*\nnoglob\n", r.stdout)
    end)
  end)

  it("keeps sessions apart and applies createSession env and cwd, skipping false values", function()
    with_sandbox(function(sb)
      sb:exec("mkdir -p sub")
      local a = sb:createSession { id = "a", env = { A = "1", GONE = false }, cwd = "/workspace/sub" }
      local b = sb:createSession { id = "b" }
      a:exec("x=only-a; export Y=only-a")
      assert.equal("sub 1 unset\n", a:exec("echo $(basename $PWD) $A ${GONE-unset}").stdout)
      assert.equal("[][][]\n", b:exec("echo [$x][$Y][$A]").stdout)
    end)
  end)

  it("applies per-call env and cwd to that call only, also when it fails or times out", function()
    with_sandbox(function(sb)
      sb:exec("mkdir -p other; export KEEP=k")
      local r = sb:exec("echo $(basename $PWD) $X $KEEP; cd /; exit 3",
        { env = { X = "$(not expanded)", KEEP = false }, cwd = "other" })
      assert.equal("other $(not expanded)\n", r.stdout)
      assert.equal(3, r.exitCode)
      r = sb:exec("sleep 5", { env = { X = "t" }, cwd = "other", timeout = 200 })
      assert.is_true(r.timedOut)
      local after = sb:exec("echo $(basename $PWD) [$X] $KEEP")
      assert.equal("workspace [] k\n", after.stdout)
    end)
  end)

  it("gives env precedence sandbox < session < call, and empty strings stay set", function()
    with_sandbox(function(sb)
      sb:setEnvVars { L = "sandbox", M = "sandbox" }
      local s = sb:createSession { id = "p", env = { M = "session", EMPTY = "" } }
      assert.equal("sandbox session call [set]\n",
        s:exec("echo $L $M $N [${EMPTY+set}]", { env = { N = "call" } }).stdout)
    end)
  end)

  it("keeps the order for the default session too: a later sandbox-level value leaves its own names", function()
    with_sandbox(function(sb)
      sb:getSession("default"):setEnvVars { D = "session", U = false }
      sb:setEnvVars { D = "sandbox", E = "sandbox", U = "sandbox" }
      assert.equal("session sandbox unset\n", sb:exec("echo $D $E ${U-unset}").stdout)
      -- sessions made later, and the default session made again, get the sandbox's
      assert.equal("sandbox sandbox sandbox\n", sb:createSession {}:exec("echo $D $E $U").stdout)
      sb:deleteSession("default")
      assert.equal("sandbox sandbox sandbox\n", sb:exec("echo $D $E $U").stdout)
    end)
  end)
end)

describe("exec output", function()
  it("returns stdout and stderr separately and byte-exact", function()
    with_sandbox(function(sb)
      local r = sb:exec([[printf 'a\0b\377\376'; printf 'e\0rr' >&2; printf 'no newline']])
      assert.equal("a\0b\255\254no newline", r.stdout)
      assert.equal("e\0rr", r.stderr)
    end)
  end)

  it("is not fooled by output that looks like the internal protocol", function()
    with_sandbox(function(sb)
      local fake = "1 0 run\0/tmp\0declare -x A=\"b\"\0__mb_report 1 0 run\n"
      local r = sb:exec("printf '1 0 run\\0/tmp\\0declare -x A=\"b\"\\0__mb_report 1 0 run\\n'; " ..
        "printf '1 0 run\\0' >&2")
      assert.equal(fake, r.stdout)
      assert.equal("1 0 run\0", r.stderr)
      assert.equal(0, r.exitCode)
    end)
  end)

  it("carries 50 MB of output intact", function()
    helper.allow_lag(5000, "a 50 MB result is joined into one string, and searched here, on the loop")
    with_sandbox(function(sb)
      local r = sb:exec("head -c 52428800 /dev/zero | tr '\\0' 'x'", { maxOutputBytes = 64 * 1024 * 1024 })
      assert.equal(52428800, #r.stdout)
      assert.is_nil(r.stdout:find("[^x]"))
      assert.is_false(r.truncated)
    end)
  end)

  it("truncates beyond maxOutputBytes, counts the rest and keeps memory bounded", function()
    helper.allow_lag(3000, "this spec's full collectgarbage() of 16 MB results runs on the loop")
    with_sandbox(function(sb)
      local r = sb:exec("head -c 2000000 /dev/zero", { maxOutputBytes = 1000 })
      assert.equal(1000, #r.stdout)
      assert.is_true(r.truncated)
      r = sb:exec("head -c 2147483648 /dev/zero")
      assert.is_true(r.truncated)
      assert.equal(16 * 1024 * 1024, #r.stdout)
      r = nil -- luacheck: ignore 311
      collectgarbage()
      collectgarbage()
      local rss_pages = tonumber(io.open("/proc/self/statm"):read("*a"):match("^%d+ (%d+)"))
      assert.is_true(rss_pages * 4096 < 100 * 1024 * 1024, "RSS " .. rss_pages * 4096)
    end)
  end)

  it("passes every kept byte to onOutput, in order", function()
    with_sandbox(function(sb)
      local seen = {}
      local r = sb:exec("for i in $(seq 1 2000); do echo line$i; echo err$i >&2; done",
        { onOutput = function(stream, data) seen[stream] = (seen[stream] or "") .. data end })
      assert.equal(r.stdout, seen.stdout)
      assert.equal(r.stderr, seen.stderr)
    end)
  end)

  it("runs an argv table without a shell in the session's cwd and env", function()
    with_sandbox(function(sb)
      sb:exec("mkdir -p w && cd w && export Q=q")
      local r = sb:exec({ "sh", "-c", 'printf "%s|" "$(basename $PWD)" "$Q" "$1"', "x", "a b;$HOME" })
      assert.equal("w|q|a b;$HOME|", r.stdout)
      -- the result's command is a shell line that would run the same argv
      assert.equal([[sh -c 'printf "%s|" "$(basename $PWD)" "$Q" "$1"' x 'a b;$HOME']], r.command)
      assert.equal("w|q|a b;$HOME|", sb:exec(r.command).stdout)
      assert.equal(127, sb:exec({ "definitely-not-a-command" }).exitCode)
    end)
  end)
end)

describe("command framing", function()
  it("runs heredocs and reports syntax errors without breaking the session", function()
    with_sandbox(function(sb)
      assert.equal("line $x\n", sb:exec("cat <<'EOF'\nline $x\nEOF\n").stdout)
      local r = sb:exec("echo 'unbalanced")
      assert.is_true(r.exitCode ~= 0)
      assert.truthy(r.stderr:find("unexpected EOF"))
      r = sb:exec("{ echo brace")
      assert.is_true(r.exitCode ~= 0)
      assert.equal("ok\n", sb:exec("echo ok").stdout)
    end)
  end)

  it("returns exit N and continues with the last cwd and exported env", function()
    with_sandbox(function(sb)
      local r = sb:exec("mkdir -p z; cd z; export KEPT=yes; exit 7")
      assert.equal(7, r.exitCode)
      assert.equal("z yes\n", sb:exec("echo $(basename $PWD) $KEPT").stdout)
    end)
  end)

  it("ends a set -n (noexec) with the command that set it", function()
    with_sandbox(function(sb)
      local r = sb:exec("echo a; set -n; echo b; touch never", { timeout = 5000 })
      assert.same({ 0, "a\n", false }, { r.exitCode, r.stdout, r.timedOut })
      assert.is_false(sb:exists("never").exists)
      assert.equal("runs hB\n", sb:exec("echo runs $-", { timeout = 5000 }).stdout)
      sb:exec("set -o noexec", { timeout = 5000 })
      assert.equal("off\n", sb:exec("set -o | awk '/^noexec/ { print $2 }'", { timeout = 5000 }).stdout)
    end)
  end)

  it("survives exec bash, kill $$ and commands that close fds 0-2", function()
    with_sandbox(function(sb)
      sb:exec("export S=1")
      sb:exec("exec bash")
      assert.equal("1\n", sb:exec("echo $S").stdout)
      assert.equal(143, sb:exec("kill $$").exitCode)
      assert.equal("1\n", sb:exec("echo $S").stdout)
      sb:exec("exec 0<&- 1>&- 2>&-")
      assert.equal("still\n", sb:exec("echo still").stdout)
      sb:exec("exec 1>/dev/null")
      assert.equal("again\n", sb:exec("echo again").stdout)
    end)
  end)

  it("gives commands EOF on stdin unless stdin is given", function()
    with_sandbox(function(sb)
      local r = sb:exec("cat; echo done")
      assert.equal("done\n", r.stdout)
      assert.equal("exact\0data", sb:exec("cat", { stdin = "exact\0data" }).stdout)
      assert.equal("next\n", sb:exec("echo next").stdout)
    end)
  end)

  it("returns when the foreground ends although a background job holds the output pipe", function()
    with_sandbox(function(sb)
      local r = sb:exec("sleep 100 & echo started")
      assert.equal("started\n", r.stdout)
      assert.is_true(r.duration < 5000)
    end)
  end)

  it("gives every command without stdin a read-only /dev/null, whatever an earlier one did to fd 0", function()
    with_sandbox(function(sb)
      assert.equal("hi\n", sb:exec("echo hi > f; exec 0<f; cat").stdout)
      assert.equal("", sb:exec("cat").stdout)
      assert.equal("", sb:exec("/bin/cat").stdout)
      sb:exec("exec 0<&-")
      assert.equal("/dev/null\n", sb:exec("readlink /proc/self/fd/0").stdout)
      sb:exec("exec 0<>/dev/null")
      -- (read-only again: a write to fd 0 fails)
      assert.equal("1\n", sb:exec("{ echo x >&0; } 2>/dev/null; echo $?").stdout)
      assert.equal("in", sb:exec("cat", { stdin = "in" }).stdout)
      assert.equal("", sb:exec("cat").stdout)
    end)
  end)

  it("reports 128 + signal for a command killed by a signal", function()
    with_sandbox(function(sb)
      assert.equal(137, sb:exec("sh -c 'kill -KILL $$'").exitCode)
      assert.equal(143, sb:exec("sh -c 'kill -TERM $$'").exitCode)
    end)
  end)
end)

describe("timeouts", function()
  it("kills the whole tree, setsid, orphaned and TERM-ignoring descendants included, and keeps the session", function()
    with_sandbox(function(sb)
      local s = sb:createSession { id = "t", commandTimeoutMs = 1000 }
      s:exec("export KEEP=1; v=2")
      -- d3's parent exits at once: it is re-parented to the sandbox's init
      -- (or to the runtime without namespaces), out of the shell's tree
      local r = s:exec([[echo before; setsid sh -c 'trap "" TERM; echo $$ > d1; exec sleep 100' &
        (trap "" TERM; sh -c 'echo $$ > d2; exec sleep 100') &
        (trap "" TERM; sh -c 'echo $$ > d3; exec sleep 100' &)
        until [ -s d1 ] && [ -s d2 ] && [ -s d3 ]; do sleep 0.01; done; sleep 100]])
      assert.is_true(r.timedOut)
      assert.equal(124, r.exitCode)
      assert.equal("before\n", r.stdout)
      assert.equal("", r.stderr)
      for _, f in ipairs { "d1", "d2", "d3" } do
        local pid = tonumber(s:exec("cat " .. f).stdout)
        assert.is_number(pid)
        assert.is_false(alive(pid, sb), f .. " survived the timeout")
      end
      assert.equal("1 2\n", s:exec("echo $KEEP $v").stdout)
    end)
  end)

  it("passes on stderr a timed-out command writes in its grace, past what is held to filter bash's note", function()
    with_sandbox(function(sb)
      -- 200000 bytes written on SIGTERM: more than the 64 KiB held back
      -- (bash builtins only: a process started after the timeout is killed by its passes)
      -- (the trap resets itself: a second SIGTERM, which proc mode's passes
      -- sent before, would end it mid-write)
      sb:writeFile("grace.sh", "trap 'trap - TERM; s=xxxxxxxxxx; for i in {1..15}; do s=$s$s; done; " ..
        "printf %s \"${s:0:200000}\" >&2; echo end >&2; exit 3' TERM\nsleep 30 & wait\n")
      local r = sb:exec("bash grace.sh", { timeout = 1000 })
      assert.is_true(r.timedOut)
      -- (compared in parts: a failure prints them, not 200 kB)
      assert.equal(200004, #r.stderr)
      assert.equal("end\n", r.stderr:sub(-4))
      assert.is_nil(r.stderr:sub(1, -5):find("[^x]"))
      assert.equal("ok\n", sb:exec("echo ok").stdout)
    end)
  end)

  it("kills only the timed-out command's tree, not background jobs earlier commands left", function()
    with_sandbox(function(sb)
      local s = sb:createSession { id = "bg" }
      -- one job from a command with a timeout, one from a command without
      local timed = tonumber(s:exec("sleep 60 >/dev/null 2>&1 & echo $!", { timeout = 5000 }).stdout)
      local untimed = tonumber(s:exec("sleep 60 >/dev/null 2>&1 & echo $!").stdout)
      for _ = 1, 3 do
        -- (1 s: under load a shorter timeout can end sh before it writes victim)
        local r = s:exec("sh -c 'echo $$ > victim; exec sleep 30'", { timeout = 1000 })
        assert.is_true(r.timedOut)
        assert.is_false(alive(tonumber(s:exec("cat victim").stdout), sb), "the timed-out command survived")
        assert.equal("ok\n", s:exec("echo ok", { timeout = 5000 }).stdout)
      end
      assert.is_true(alive(timed, sb), "a background job of an earlier command was killed")
      assert.is_true(alive(untimed, sb), "a background job of an earlier command was killed")
      s:exec("kill " .. timed .. " " .. untimed)
    end)
  end)

  it("kills a command that starts after its timeout already fired (regression: it ran to the end)", function()
    with_sandbox(function(sb)
      sb:exec("export KEEP=1")
      for i = 1, 30 do
        local r = sb:exec(i % 2 == 0 and { "sleep", "5" } or "sleep 5", { timeout = 1 + i % 3 })
        assert.is_true(r.timedOut)
        -- not a timing bound: the regression ran the 5 s sleep to its end
        assert.is_true(r.duration < 4500, "took " .. r.duration .. " ms")
      end
      assert.equal("1\n", sb:exec("echo $KEEP").stdout)
    end)
  end)

  it("runs nothing after a timeout in a function or a nested source, and keeps the shell's state", function()
    with_sandbox(function(sb)
      sb:exec("v=kept; printf 'sleep 10; touch x3\\n' > inner.sh")
      local r = sb:exec("f() { g; touch x1; }; g() { sleep 10; touch x2; }; f; touch x0", { timeout = 300 })
      assert.same({ true, 124 }, { r.timedOut, r.exitCode })
      r = sb:exec(". ./inner.sh; touch x4", { timeout = 300 })
      assert.is_true(r.timedOut)
      assert.equal("", sb:exec("ls x* 2>/dev/null").stdout)
      -- the trap that ended the callers is gone with the command
      assert.equal("kept\n\n", sb:exec("echo $v; trap -p DEBUG; type -t g").stdout:gsub("function\n$", "\n"))
      assert.equal("yes\n", sb:exec("g() { echo yes; }; f() { g; }; f").stdout)
    end)
  end)

  it("lets a per-call timeout override the session's commandTimeoutMs", function()
    with_sandbox(function(sb)
      local s = sb:createSession { commandTimeoutMs = 5000 }
      local t0 = core.hrtime()
      local r = s:exec("sleep 10", { timeout = 200 })
      assert.is_true(r.timedOut)
      assert.is_true((core.hrtime() - t0) / 1e6 < 4000)
    end)
  end)

  it("ends a shell stuck in a builtin loop and restores its state", function()
    with_sandbox(function(sb)
      sb:exec("cd / 2>/dev/null; mkdir -p /tmp; export W=w")
      local r = sb:exec("while :; do :; done", { timeout = 200 })
      assert.is_true(r.timedOut)
      assert.equal("w\n", sb:exec("echo $W").stdout)
    end)
  end)
end)

describe("concurrency", function()
  it("runs calls on one session in order and sessions in parallel", function()
    with_sandbox(function(sb)
      local s = sb:createSession { id = "q" }
      local order = {}
      moonbox.all(
        function() s:exec("sleep 0.2; echo 1 >> log") order[#order + 1] = 1 end,
        function() s:exec("echo 2 >> log") order[#order + 1] = 2 end)
      assert.same({ 1, 2 }, order)
      assert.equal("1\n2\n", s:exec("cat log").stdout)
      local a, b = sb:createSession {}, sb:createSession {}
      local t0 = core.hrtime()
      moonbox.all(function() a:exec("sleep 1") end, function() b:exec("sleep 1") end)
      assert.is_true((core.hrtime() - t0) / 1e6 < 1800)
    end)
  end)

  it("holds one fd of the runtime per idle namespaced session past the hot set, and returns a command's after it",
    function()
    local shell_mod = require "moonbox.session.shell"
    local hot_was = shell_mod.hot_size(0)
    finally(function() shell_mod.hot_size(hot_was) end)
    with_sandbox(function(sb)
      -- (after a first created session: the spare shell that replaces it
      -- is counted in before)
      sb:exec("true")
      sb:createSession({ id = "fd-0" }):exec("true")
      local fds = helper.fd_count
      local before = helper.steady(fds)
      local sessions = {}
      for i = 1, 20 do
        sessions[i] = sb:createSession { id = "fd-" .. i }
        assert.equal("ok\n", sessions[i]:exec("echo ok").stdout)
      end
      local with_sessions = helper.steady(fds)
      if sb:info().isolation == "namespaces" then
        -- its status pipe; the control FIFO, the run directory, the body
        -- and the env file are opened only while a command runs
        assert.equal(before + 20, with_sessions)
      else
        assert.is_true(with_sessions - before <= 20 * 10, tostring(with_sessions - before))
      end
      for _, s in ipairs(sessions) do s:exec("echo x; echo y >&2", { stdin = "in" }) end
      assert.equal(with_sessions, helper.steady(fds))
      if sb:info().isolation == "namespaces" then
        -- the hot set (issue #32): the 4 shells that ran last keep their run
        -- directory and body file open, and the next command's two output
        -- pipes (4 fds), no more (and no control FIFO writer: their `@`
        -- waits for the runtime's messages, no line is sent)
        shell_mod.hot_size(4)
        for _, s in ipairs(sessions) do assert.equal("x\n", s:exec("echo x").stdout) end
        assert.equal(with_sessions + 4 * (2 + 4), helper.steady(fds))
        shell_mod.hot_size(0)
        assert.equal(with_sessions, helper.steady(fds))
      end
      for i = 1, 20 do sb:deleteSession("fd-" .. i) end
      assert.equal(before, helper.steady(fds))
    end)
  end)

  it("lets exactly one of two concurrent createSession calls on one id win", function()
    with_sandbox(function(sb)
      local results = moonbox.all(
        function() return (pcall(sb.createSession, sb, { id = "dup" })) end,
        function() return (pcall(sb.createSession, sb, { id = "dup" })) end)
      assert.is_true(results[1] ~= results[2])
    end)
  end)
end)

describe("deleteSession", function()
  it("kills the shell and everything it started, even mid-command", function()
    with_sandbox(function(sb)
      local s = sb:createSession { id = "victim" }
      s:exec("setsid sh -c 'echo $$ > bg; exec sleep 100' & until [ -s bg ]; do sleep 0.01; done")
      local bg = tonumber(s:exec("cat bg").stdout)
      local shell_pid = s.shell.pid
      local task = moonbox.spawn(function() return s:exec("sleep 100") end)
      moonbox.sleep(100)
      local r = sb:deleteSession("victim")
      assert.is_true(r.success)
      assert.equal("victim", r.sessionId)
      local ok, err = pcall(task.wait, task)
      assert.is_false(ok)
      assert.equal("SESSION_DESTROYED", err.code)
      assert.is_false(alive(bg, sb))
      assert.is_false(alive(shell_pid))
      assert.equal("SESSION_NOT_FOUND", select(2, pcall(s.exec, s, "true")).code)
      local again = sb:createSession { id = "victim" }
      assert.equal("[]\n", again:exec("echo [$x]").stdout)
    end)
  end)

  it("restores a shell that died from outside to its last cwd and env", function()
    with_sandbox(function(sb)
      sb:exec("mkdir -p k && cd k && export R=r")
      local shell = sb:getSession("default").shell
      core.kill(shell.pid, "SIGKILL")
      shell:wait_exit()
      assert.equal("k r\n", sb:exec("echo $(basename $PWD) $R").stdout)
    end)
  end)
end)

describe("execStream", function()
  it("streams start, chunks as produced, then exactly one complete", function()
    with_sandbox(function(sb)
      local t0 = core.hrtime()
      local events = {}
      for ev in sb:execStream("echo one; sleep 1; echo two; export AFTER=1; exit 5") do
        ev.at = (core.hrtime() - t0) / 1e6
        events[#events + 1] = ev
      end
      assert.equal("start", events[1].type)
      assert.equal("stdout", events[2].type)
      assert.equal("one\n", events[2].data)
      assert.is_true(events[2].at < 800, "first chunk arrived after " .. events[2].at .. " ms")
      local completes = 0
      for _, ev in ipairs(events) do if ev.type == "complete" then completes = completes + 1 end end
      assert.equal(1, completes)
      assert.equal("complete", events[#events].type)
      assert.equal(5, events[#events].exitCode)
    end)
  end)

  it("sends start when its command starts, not while it waits behind the session's running one", function()
    with_sandbox(function(sb)
      -- (first-done: in the cwd, the workspace)
      local first = moonbox.spawn(function() return sb:exec("sleep 0.3; echo done > first-done") end)
      moonbox.sleep(50) -- the first is running
      local first_done_at_start, types = nil, {}
      for ev in sb:execStream("echo second") do
        types[#types + 1] = ev.type
        if ev.type == "start" then
          local f = io.open(sb.root .. "/workspace/first-done")
          first_done_at_start = f ~= nil
          if f then f:close() end
        end
      end
      assert.equal(0, first:wait().exitCode)
      assert.same({ "start", "stdout", "complete" }, types)
      assert.is_true(first_done_at_start)
    end)
  end)

  it("a reader cancelled while it waits (moonbox.timeout) ends the command, setsid'd children too", function()
    with_sandbox(function(sb)
      sb:exec("export KEEP=k")
      -- (a mark of this run's own: without namespaces pgrep sees the host,
      -- where the namespaced run of this spec may run at the same time)
      local mark = tostring(core.getpid() % 100000)
      local ok, err = pcall(moonbox.timeout, 300, function()
        for _ in sb:execStream(("echo x; setsid sleep 9042.%s & sleep 9044.%s"):format(mark, mark)) do end
      end)
      assert.is_false(ok)
      assert.equal("TIMEOUT", err.code)
      -- the session is not held by the command nobody reads any more
      local r = moonbox.timeout(10000, function()
        return sb:exec(("pgrep -f 'sleep 904[24][.]%s$' || echo none; echo $KEEP"):format(mark))
      end)
      assert.equal("none\nk\n", r.stdout)
    end)
  end)

  it("past maxOutputBytes keeps the part that fits and nothing after: a prefix, never a stream with holes", function()
    with_sandbox(function(sb)
      local out, last = "", nil
      for ev in sb:execStream("head -c 3000 /dev/zero | tr '\\0' a; sleep 0.2; echo END", { maxOutputBytes = 1000 }) do
        if ev.type == "stdout" then out = out .. ev.data end
        last = ev
      end
      assert.equal(("a"):rep(1000), out)
      assert.same({ "complete", 0, true }, { last.type, last.exitCode, last.truncated })
    end)
  end)

  it("cancel() kills the command's whole tree, reports cancelled, and keeps the session", function()
    with_sandbox(function(sb)
      sb:exec("export KEEP=k")
      local iter = sb:execStream("sleep 300 & echo $!; setsid sleep 300 & echo $!; sleep 300")
      local pids, last = {}, nil
      for ev in iter do
        if ev.type == "stdout" then
          for pid in ev.data:gmatch("%d+") do pids[#pids + 1] = tonumber(pid) end
          if #pids == 2 then iter.cancel() end
        end
        last = ev
      end
      assert.same({ "complete", true, false }, { last.type, last.cancelled, last.timedOut })
      assert.equal(2, #pids)
      for _, pid in ipairs(pids) do assert.is_false(alive(pid, sb)) end
      assert.equal("k\n", sb:exec("echo $KEEP").stdout)
    end)
  end)

  it("cancel() of a stream still waiting in the queue means its command never runs", function()
    with_sandbox(function(sb)
      local first = moonbox.spawn(function() return sb:exec("sleep 0.2; echo first") end)
      local iter = sb:execStream("touch never-ran")
      iter.cancel()
      local events = {}
      for ev in iter do events[#events + 1] = ev end
      assert.equal("CANCELLED", events[#events].error.code)
      assert.equal("first\n", first:wait().stdout)
      assert.is_false(sb:exists("never-ran").exists)
    end)
  end)

  it("does not leave the session stuck when the loop breaks early", function()
    with_sandbox(function(sb)
      for ev in sb:execStream("for i in $(seq 1 100000); do echo $i; done") do
        if ev.type == "stdout" then break end
      end
      assert.equal("fine\n", sb:exec("echo fine").stdout)
    end)
  end)
end)

describe("runtime exit", function()
  it("leaves no process behind when a script ends with sessions still running", function()
    local marker = "mbmark" .. core.getpid()
    local script = os.tmpname()
    local f = io.open(script, "w")
    f:write(([[
      local moonbox = require "moonbox"
      local sb = moonbox.getSandbox("exit-%s", { root = %q })
      for i = 1, 2 do
        local s = sb:createSession {}
        s:exec("(exec -a %s sleep 1000) & setsid bash -c 'exec -a %s sleep 1000' &")
      end
    ]]):format(marker, helper.mkdtemp() .. "/root", marker, marker))
    f:close()
    local bin = os.getenv("MOONBOX_BIN") or "build/moonbox"
    assert.is_true(os.execute(bin .. " " .. script) == 0)
    os.remove(script)
    local found = helper.sh("pgrep -f '[m]" .. marker:sub(2) .. "' | wc -l")
    assert.equal("0", found)
  end)

  it("kills every sandbox's processes when the runtime gets SIGTERM, then exits 143", function()
    local marker = "mbterm" .. core.getpid()
    local script = os.tmpname()
    local f = io.open(script, "w")
    f:write(([[
      local moonbox = require "moonbox"
      local sb = moonbox.getSandbox("term-%s", { root = %q })
      sb:createSession {}:exec("setsid bash -c 'exec -a %s sleep 1000' &")
      sb:startProcess("exec -a %s sleep 1000")
      print("ready")
      io.stdout:flush()
      moonbox.sleep(60000)
    ]]):format(marker, helper.mkdtemp() .. "/root", marker, marker))
    f:close()
    local bin = os.getenv("MOONBOX_BIN") or "build/moonbox"
    local rc = os.execute(("%s %s > %s.out 2>/dev/null & pid=$!; " ..
      "for i in $(seq 1 100); do grep -q ready %s.out && break; sleep 0.05; done; " ..
      "kill -TERM $pid; wait $pid; exit $?"):format(bin, script, script, script))
    os.remove(script)
    os.remove(script .. ".out")
    assert.equal(143, rc / 256 >= 1 and rc / 256 or rc)
    local found = helper.sh("pgrep -f '[m]" .. marker:sub(2) .. "' | wc -l")
    assert.equal("0", found)
  end)
end)
