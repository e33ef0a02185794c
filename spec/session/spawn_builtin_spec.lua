-- The session shell's spawn builtin (src/bash/spawn_builtin.c): a plain
-- external command runs without forking the shell, and nothing a user can
-- observe differs from bash running it itself.
local moonbox = require "moonbox"
local shell_mod = require "moonbox.session.shell"
local simple = require "moonbox.session.simple_command"

local with_sandbox = helper.with_sandbox

-- exec(command) twice in one session: through the builtin, then with it
-- off (bash forks and execs as usual); pids differ
local function both_ways(s, command, opts)
  local function once(on)
    moonbox.shellBuiltins { spawn = on }
    local ok, r = pcall(s.exec, s, command, opts)
    moonbox.shellBuiltins { spawn = true }
    assert(ok, r)
    local function norm(text)
      return (text:gsub("line 1: +%d+ ", "line 1: PID "))
    end
    return { exitCode = r.exitCode, stdout = r.stdout, stderr = norm(r.stderr) }
  end
  return once(true), once(false)
end

describe("plain command lines", function()
  it("are told from everything else bash would parse", function()
    assert.same({ "/bin/echo", "a", "b=c", "--x=1,2", "%s@:+" }, simple.words("/bin/echo a  b=c\t--x=1,2 %s@:+\n"))
    assert.same({ "ls" }, simple.words("  ls  "))
    for _, body in ipairs { "", " ", "echo hi", "true", "A=1 ls", "ls *", "ls ~", "ls $HOME", "ls 'a'", "ls \"a\"",
      "ls a\\ b", "ls;ls", "ls|cat", "ls >x", "ls &", "ls\nls", "ls {a,b}", "ls # c", "! ls", "%1", "-x",
      "if", "ls `x`", "ls (x)", "ls [a]", "ls ?", "cd /tmp", "exec ls", string.rep("a", 3000) } do
      assert.is_nil(simple.words(body), body)
    end
  end)
end)

describe("the spawn builtin", function()
  it("is loaded by every session shell", function()
    with_sandbox(function(sb)
      assert.equal("enable __mb_run\n", sb:exec("enable -a | grep __mb_run").stdout)
      local s = sb:createSession {}
      assert.equal("enable __mb_run\n", s:exec("enable -a | grep __mb_run").stdout)
    end)
  end)

  it("gives the same exit codes, output and error messages as bash's own fork", function()
    with_sandbox(function(sb)
      local s = sb:createSession {}
      s:writeFile("/workspace/segv.sh", "#!/bin/sh\nkill -SEGV $$\n")
      s:writeFile("/workspace/kill9.sh", "#!/bin/sh\necho before; kill -KILL $$\n")
      s:writeFile("/workspace/term.sh", "#!/bin/sh\nkill -TERM $$\n")
      s:writeFile("/workspace/int.sh", "#!/bin/sh\nkill -INT $$\n")
      s:writeFile("/workspace/exit7.sh", "#!/bin/sh\necho out; echo err >&2; exit 7\n")
      s:writeFile("/workspace/noshebang", "echo from a script without a shebang\n")
      s:writeFile("/workspace/plain", "not executable\n")
      s:exec("chmod +x segv.sh kill9.sh term.sh int.sh exit7.sh noshebang; mkdir -p dir")
      for _, command in ipairs { "/bin/echo hello  world", "printenv _", "./exit7.sh", "./segv.sh", "./kill9.sh",
        "./term.sh", "./int.sh", "./noshebang", "./plain", "./dir", "nosuchcommand", "/no/such/file", "/bin/false",
        "env" } do
        local fast, forked = both_ways(s, command)
        assert.same(forked, fast, command)
      end
      local fast = both_ways(s, "./exit7.sh")
      assert.same({ exitCode = 7, stdout = "out\n", stderr = "err\n" }, fast)
      assert.equal(139, (both_ways(s, "./segv.sh")).exitCode)
      assert.equal("from a script without a shebang\n", (both_ways(s, "./noshebang")).stdout)
      local cat = both_ways(s, "cat", { stdin = "exactly this" })
      assert.equal("exactly this", cat.stdout)
    end)
  end)

  it("leaves aliases, functions and hashed paths to the shell", function()
    with_sandbox(function(sb)
      local s = sb:createSession {}
      s:exec("ls() { echo function; }; alias lsa='echo alias'; hash -p /bin/echo myecho")
      assert.equal("function\n", s:exec("ls").stdout)
      assert.equal("alias\n", s:exec("lsa").stdout)
      assert.equal("hashed\n", s:exec("myecho hashed").stdout)
      s:exec("unset -f ls")
      assert.equal("/tmp\n", s:exec("ls -d /tmp").stdout)
    end)
  end)

  it("leaves commands to bash when a trap or set -x or -v would see them", function()
    with_sandbox(function(sb)
      for _, setup in ipairs { "trap 'echo chld' CHLD", "trap 'echo \"dbg $BASH_COMMAND\"' DEBUG",
        "trap 'echo err' ERR", "trap 'echo ret' RETURN", "set -x", "set -v" } do
        local s = sb:createSession {}
        s:exec(setup)
        for _, command in ipairs { "/bin/echo hi", "/bin/false" } do
          local fast, forked = both_ways(s, command)
          assert.same(forked, fast, setup .. "; " .. command)
        end
        sb:deleteSession(s.id)
      end
    end)
  end)

  it("runs the command with the shell's cwd, PATH, umask, limits and ignored signals", function()
    with_sandbox(function(sb)
      local s = sb:createSession {}
      -- (relative paths: without namespaces /workspace is a host path)
      s:exec("mkdir -p bin sub && export PATH=$PWD/bin:$PATH && cd sub")
      s:writeFile("/workspace/bin/state", "#!/bin/sh\necho \"${PWD##*/} $(umask) $(ulimit -n)\"\n" ..
        "kill -USR2 $$; echo survived USR2\n")
      s:exec("chmod +x ../bin/state; umask 027; ulimit -n 77; trap '' USR2")
      local r = s:exec("state")
      assert.same({ 0, "sub 0027 77\nsurvived USR2\n", "" }, { r.exitCode, r.stdout, r.stderr })
    end)
  end)

  it("ends the shell under set -e as a forked command would, and the session goes on", function()
    with_sandbox(function(sb)
      local s = sb:createSession {}
      s:exec("set -e; cd /tmp; export KEPT=1")
      local r = s:exec("/bin/false")
      assert.equal(1, r.exitCode)
      assert.equal("/tmp 1\n", s:exec("echo $PWD $KEPT").stdout)
    end)
  end)

  it("kills a timed-out command and its tree; the shell keeps its state", function()
    with_sandbox(function(sb)
      local s = sb:createSession {}
      s:writeFile("/workspace/sleeper", "#!/bin/sh\necho $$ >pid\nexec sleep 30\n")
      s:exec("chmod +x sleeper; export KEPT=yes")
      assert.is_table(simple.words("./sleeper"))
      local r = s:exec("./sleeper", { timeout = 200 })
      assert.is_true(r.timedOut)
      assert.equal(124, r.exitCode)
      assert.equal("", r.stderr)
      local pid = tonumber(s:readFile("/workspace/pid").content)
      assert.is_false(helper.pid_alive(pid, sb))
      assert.equal("yes\n", s:exec("echo $KEPT").stdout)
      assert.equal("ok\n", s:exec("/bin/echo ok").stdout)
    end)
  end)

  -- (it opens a command's stdout and stderr on fds 1 and 2 itself, without
  -- bash's redirection: src/bash/outputs.c)
  it("gives each command its own stdout and stderr: what a command did to 1 and 2 ends with it", function()
    with_sandbox(function(sb)
      local s = sb:createSession {}
      local function run(command)
        local r = s:exec(command, { timeout = 10000 })
        return { r.exitCode, r.stdout, r.stderr }
      end
      assert.same({ 0, "", "e\n" }, run("exec >/tmp/kept; echo a; echo e >&2"))
      assert.same({ 0, "b\na\n", "" }, run("echo b; cat /tmp/kept"))
      assert.same({ 0, "x\n", "" }, run("exec 2>&-; exec 2>/dev/null; exec 2>&1; echo x >&2"))
      assert.same({ 0, "o\n", "y\n" }, run("echo o; echo y >&2"))
      assert.same({ 1, "", "bash: line 1: echo: write error: Bad file descriptor\n" }, run("exec 1>&-; echo c"))
      assert.same({ 0, "spawned\n", "" }, run("/bin/echo spawned"))
      assert.same({ 0, "", "" }, run("exec >&- 2>&-"))
      assert.same({ 2, "", "ls: cannot access '/none': No such file or directory\n" }, run("ls /none"))
      local r = s:exec("exec >/dev/null; cat", { stdin = "in\n" })
      assert.same({ 0, "" }, { r.exitCode, r.stdout })
      assert.same({ 0, "next\n", "" }, run("echo next"))
      -- a program the command runs holds nothing of the shell's but 0-2
      -- (3: ls's own directory)
      assert.same({ 0, "0\n1\n2\n3\n", "" }, run("ls /proc/self/fd"))
      assert.same({ 0, "0\n1\n2\n3\n", "" }, run("exec 2>&1; ls /proc/self/fd"))
    end)
  end)

  it("hands a command its outputs as pipes on the status socket: nothing named, fd 0 closed or not", function()
    with_sandbox(function(sb)
      local s = sb:createSession {}
      s:exec("true") -- (the first command goes before the hello, with the output files)
      local r = s:exec("readlink /proc/self/fd/1 /proc/self/fd/2; ls /run/moonbox/sh-*/ 2>/dev/null | grep -c std; :")
      assert.equal(0, r.exitCode)
      local out, err, named = r.stdout:match("^pipe:%[(%d+)%]\npipe:%[(%d+)%]\n(%d+)\n$")
      assert.truthy(out, r.stdout)
      assert.are_not.equal(out, err)
      assert.equal("0", named)
      -- with fd 0 closed the fds arrive on 0 and 1 and are moved into place
      r = s:exec("exec 0<&-; echo o; echo e >&2")
      assert.same({ 0, "o\n", "e\n" }, { r.exitCode, r.stdout, r.stderr })
      assert.same({ 0, "n\n", "" }, { s:exec("echo n").exitCode, s:exec("echo n").stdout, s:exec("echo n").stderr })
      -- a user's EXIT trap at `exit` writes where the command's output goes
      s:exec("trap 'echo bye' EXIT")
      r = s:exec("echo last; exit 5")
      assert.same({ 5, "last\nbye\n" }, { r.exitCode, r.stdout })
    end)
  end)

  it("runs nothing for control lines a command writes into the control FIFO, `@` alone included", function()
    with_sandbox(function(sb)
      local s = sb:createSession {}
      s:exec("true")
      -- the body runs in the shell itself and can reach bash's script fd (a
      -- background job cannot: bash closes it in subshells, and the shell
      -- is not dumpable); what it writes there is dropped at its report
      local r = s:exec("n=0; for f in /proc/$$/fd/*; do [ ${f##*/} -gt 2 ] && [ -p \"$f\" ] &&"
        .. " printf '@\\n@ 1\\n@\\n' >\"$f\" && n=$((n+1)); done; echo $n")
      assert.equal(0, r.exitCode)
      assert.truthy(tonumber(r.stdout) >= 1, r.stdout)
      for i = 1, 3 do
        r = s:exec("echo n" .. i .. "; echo e" .. i .. " >&2")
        assert.same({ 0, "n" .. i .. "\n", "e" .. i .. "\n" }, { r.exitCode, r.stdout, r.stderr })
      end
    end)
  end)

  it("runs each command at the top level, the shell waiting for the runtime's messages in between", function()
    with_sandbox(function(sb)
      local s = sb:createSession {}
      s:exec("true") -- (before the hello)
      s:exec("true") -- (the one control line, `@`: the shell waits for messages from here on)
      -- `$_` is the previous command's last argument, as in a script (it was `@`, the line's)
      s:exec("true last-arg")
      assert.equal("last-arg\n", s:exec("echo $_").stdout)
      -- a timed-out command's interrupt (a trap run between commands) ends
      -- nothing after it, a spawned command's or a sourced loop's
      local r
      for _, cmd in ipairs { "sleep 5", "while :; do :; done" } do
        r = s:exec(cmd, { timeout = 300 })
        assert.same({ 124, true }, { r.exitCode, r.timedOut }, cmd)
        r = s:exec("echo after")
        assert.same({ 0, "after\n", "" }, { r.exitCode, r.stdout, r.stderr }, cmd)
      end
      -- an interrupt that comes while the shell waits for the next command
      -- (the runtime repeats a timeout's until the record) ends nothing
      for _ = 1, 5 do
        s.shell:interrupt()
        moonbox.sleep(5)
      end
      r = s:exec("echo after")
      assert.same({ 0, "after\n", "" }, { r.exitCode, r.stdout, r.stderr })
      -- a user's trap for a signal that comes between commands runs then
      -- (a file of the workspace: without namespaces /tmp is the host's)
      s:exec("rm -f trapped; trap \"echo trapped >>$PWD/trapped\" USR1; (sleep 0.2; kill -USR1 $$) >/dev/null 2>&1 &")
      moonbox.sleep(700)
      assert.same({ 0, "trapped\n" }, { s:exec("cat trapped").exitCode, s:exec("cat trapped").stdout })
      -- a prelude's shape (cwd, env) goes as its byte alone
      r = s:exec("echo $X; pwd", { env = { X = "x" }, cwd = "/tmp" })
      assert.same({ 0, "x\n/tmp\n" }, { r.exitCode, r.stdout })
      assert.same({ 0, "in" }, { s:exec("cat", { stdin = "in" }).exitCode, s:exec("cat", { stdin = "in" }).stdout })
    end)
  end)

  it("sends a command's output pipes again after one that started no process, fresh ones after one that did",
    function()
    with_sandbox(function(sb)
      local s = sb:createSession {}
      s:exec("true")
      s:exec("true")
      -- the shell's word on each record: `k`, the pipes the command came
      -- with are in no other process (it made none)
      local Shell = getmetatable(s.shell).__index
      local record, words = Shell._record, {}
      Shell._record = function(self, id, status, kind, flag, pwd, keep)
        words[#words + 1] = keep
        return record(self, id, status, kind, flag, pwd, keep)
      end
      finally(function() Shell._record = record end)
      local function keep(command)
        words = {}
        s:exec(command)
        return words[1]
      end
      assert.equal("k", keep("true"))
      assert.equal("k", keep("x=1; cd /tmp; echo $x; echo err >&2; exec 7>&1"))
      for _, made in ipairs { "(sleep 0.3; echo late; echo late >&2) &", "x=$(echo hi)", "/bin/true", "true | true",
                              "sh -c 'exit 3'", "cat <(true)" } do
        assert.equal("", keep(made), made)
      end
      -- a process made between commands (a trap's) counts for the next one
      assert.equal("", keep("trap '(exit 0) &' USR1; (sleep 1; kill -USR1 $$) &"))
      assert.equal("k", keep("true"))
      moonbox.sleep(2000)
      assert.equal("", keep("trap - USR1"))
      assert.equal("k", keep("true"))
      -- under namespaces a hot shell's pipes go again: fd 7, the copy of
      -- stdout kept in the shell (a builtin: no process made), is the next
      -- command's stdout; without namespaces every command has new ones
      local same = "[ /proc/$$/fd/1 -ef /proc/$$/fd/7 ] && echo same || echo fresh"
      local reused = sb:info().isolation == "namespaces"
      -- (a command still running after 1 ms has its outputs made streams,
      -- and the next one fresh pipes: on a loaded machine a builtin can take
      -- that long, so the sequence gets a few tries)
      local seen
      for _ = 1, 5 do
        s:exec("exec 7>&1")
        local a = s:exec(same).stdout
        seen = { a }
        if not reused then break end
        if a == "same\n" then
          -- (what the shell writes on its copy is the running command's output)
          local r = s:exec("echo via 7 >&7")
          seen = { a, r.exitCode, r.stdout }
          if r.stdout == "via 7\n" then break end
        end
      end
      if reused then
        assert.same({ "same\n", 0, "via 7\n" }, seen)
      else
        assert.equal("fresh\n", seen[1])
      end
      -- after a command that started a process, new pipes; what that
      -- process writes later lands in no later command's output
      s:exec("(sleep 0.3; echo late; echo late >&2) &")
      assert.equal("fresh\n", s:exec(same).stdout)
      local r = s:exec("sleep 0.6; echo now")
      assert.same({ 0, "now\n", "" }, { r.exitCode, r.stdout, r.stderr })
    end)
  end)
end)

describe("a body sent in the command's message", function()
  -- (src/bash/outputs.c, spawn_builtin.c's source_text: up to 4096 bytes
  -- travel with the command and are sourced from memory; a longer body is
  -- read from its file into memory, up to 1 MiB; a longer one still, or one
  -- bash's own source treats differently, is left to bash's source)
  it("runs as the same body sourced by bash's own source does", function()
    with_sandbox(function(sb)
      local s = sb:createSession {}
      s:exec("x=1")
      local pad = "\n#" .. ("x"):rep(1100 * 1024) -- past 1 MiB: bash's source of the file
      local bodies = { "echo hi; return 3; echo no", "echo $x ${BASH_SOURCE[0]} ${#BASH_SOURCE[@]} $LINENO $#",
        "nosuch", "f() { return 7; }; f; echo $?", "echo a\necho b\nfalse", "/bin/echo spawned",
        "echo ${BASH_ARGC[0]} ${#BASH_ARGV[@]} ${#FUNCNAME[@]}", "(exit 9)", "echo -n no newline" }
      for _, body in ipairs(bodies) do
        local a, b, c = s:exec(body), s:exec(body .. pad), s:exec(body .. "\n#" .. ("x"):rep(5000))
        assert.same({ a.exitCode, a.stdout, a.stderr }, { b.exitCode, b.stdout, b.stderr }, body)
        assert.same({ a.exitCode, a.stdout, a.stderr }, { c.exitCode, c.stdout, c.stderr }, body)
      end
      -- a DEBUG trap is off in a sourced body (bash's source does that):
      -- the body goes to it, from its file, and the trap runs for nothing
      s:exec("trap 'echo dbg' DEBUG")
      local r = s:exec("echo after")
      assert.same({ 0, "after\n" }, { r.exitCode, r.stdout })
      s:exec("trap - DEBUG")
      -- the state a body leaves is the shell's
      s:exec("y=2; cd /tmp")
      assert.equal("2 /tmp\n", s:exec("echo $y $PWD").stdout)
    end)
  end)
end)

describe("shell error messages", function()
  it("name the shell, never the runtime's files, as bash -c would", function()
    with_sandbox(function(sb)
      local s = sb:createSession {}
      for _, on in ipairs { true, false } do
        moonbox.shellBuiltins { spawn = on }
        local ok, err = pcall(function()
          assert.equal("bash: line 1: nosuchcmd: command not found\n", s:exec("nosuchcmd").stderr)
          assert.equal("bash: line 3: nosuch2: command not found\n", s:exec("echo hi\n\nnosuch2 a b").stderr)
          assert.equal("bash: line 1: nosuch3: command not found\n", s:exec("(nosuch3) | cat").stderr)
          assert.equal("bash: line 1: cd: /nonexistent: No such file or directory\n", s:exec("cd /nonexistent").stderr)
          -- a syntax error names the input as bash -c names its own, in a
          -- session's first command too (sent before its shell said hello)
          -- and in a body too long for the command's message
          local syntax = "bash: -c: line 2: syntax error near unexpected token `fi'\nbash: -c: line 2: `fi'\n"
          assert.equal(syntax, s:exec("echo ok\nfi").stderr)
          assert.equal(syntax, s:exec("echo ok\nfi\n#" .. ("x"):rep(5000)).stderr)
          local fresh = sb:createSession {}
          assert.equal(syntax, fresh:exec("echo ok\nfi").stderr)
          sb:deleteSession(fresh.id)
          -- in a function the body defined, in this call or an earlier one
          assert.equal("bash: line 2: nosuchf: command not found\n", s:exec("f() {\n nosuchf; }\nf").stderr)
          assert.equal("bash: line 2: nosuchf: command not found\n", s:exec("f").stderr)
          -- a file the command sources keeps its name, as in any bash
          s:writeFile("x.sh", "\nnosuchx\n")
          assert.equal("./x.sh: line 2: nosuchx: command not found\n", s:exec(". ./x.sh").stderr)
          -- a foreground command killed by SIGKILL is noted as in a terminal
          local r = s:exec("sh -c 'kill -KILL $$'")
          assert.same({ 137, "Killed\n" }, { r.exitCode, r.stderr })
          r = s:exec("sh -c 'kill -KILL $$'; echo after")
          assert.same({ 0, "after\n", "Killed\n" }, { r.exitCode, r.stdout, r.stderr })
        end)
        moonbox.shellBuiltins { spawn = true }
        assert(ok, err)
      end
    end)
  end)
end)

describe("the report builtin", function()
  it("reads both env file formats", function()
    assert.same({ A = "1", B = "x=y\nz", C = "" }, shell_mod.parse_exports("A=1\0B=x=y\nz\0C=\0"))
    assert.same({ A = "1", B = "x\ny" },
      shell_mod.parse_exports("declare -x A=\"1\"\ndeclare -x B=$'x\\ny'\ndeclare -x U\n"))
  end)

  -- a shell that dies is replaced by one with the last reported env
  local function restored_after_death(sb)
    local s = sb:createSession {}
    s:exec("export A=$'two\\nlines' B='x=y z' C=; export U; unset U")
    assert.equal(137, s:exec("kill -9 $$").exitCode)
    local r = s:exec("printf '%s|%s|%s|%s' \"$A\" \"$B\" \"${C-unset}\" \"${U-unset}\"")
    assert.equal("two\nlines|x=y z||unset", r.stdout)
    s:exec("unset A; export B=changed")
    s:exec("kill -9 $$")
    assert.equal("unset|changed", s:exec("printf '%s|%s' \"${A-unset}\" \"$B\"").stdout)
  end

  it("reports the exported environment a new shell is restored to", function()
    with_sandbox(restored_after_death)
  end)

  it("is not needed: a shell without the builtins reports with export -p", function()
    moonbox.shellBuiltins { load = false }
    local ok, err = pcall(with_sandbox, function(sb)
      local s = sb:createSession {}
      assert.equal("", s:exec("enable -a | grep __mb_ || true").stdout)
      restored_after_death(sb)
    end)
    moonbox.shellBuiltins { load = true }
    assert(ok, err)
  end)
end)

describe("moonbox.shellBuiltins", function()
  it("sets and reports the two settings, and refuses anything but those booleans", function()
    assert.same({ spawn = true, load = true }, moonbox.shellBuiltins())
    assert.same({ spawn = false, load = true }, moonbox.shellBuiltins { spawn = false })
    assert.same({ spawn = false, load = false }, moonbox.shellBuiltins { load = false })
    assert.same({ spawn = true, load = true }, moonbox.shellBuiltins { spawn = true, load = true })
    for _, bad in ipairs { "off", { spawn = 0 }, { fork = false } } do
      local ok, err = pcall(moonbox.shellBuiltins, bad)
      assert.is_false(ok)
      assert.equal("VALIDATION_FAILED", err.code)
    end
    assert.same({ spawn = true, load = true }, moonbox.shellBuiltins())
  end)
end)

describe("the session shell's builtins", function()
  it("refuses to disable or delete its builtins with enable", function()
    with_sandbox(function(sb)
      for _, cmd in ipairs { "enable -d __mb_rep", "enable -n __mb_run", "enable -n echo __mb_run" } do
        local r = sb:exec(cmd)
        assert.same({ 1, "" }, { r.exitCode, r.stdout })
        assert.matches("used by the session shell itself", r.stderr, 1, true)
      end
      assert.equal("enable __mb_rep\nenable __mb_run\n", sb:exec("enable -a | grep __mb_ | sort").stdout)
      assert.equal("enable echo\n", sb:exec("enable -a | grep -w echo").stdout)
      assert.equal("x\n", sb:exec("echo x").stdout)
    end)
  end)

  it("still reports, with export -p", function()
    with_sandbox(function(sb)
      local s = sb:createSession {}
      s:exec("builtin enable -d __mb_rep")
      assert.equal("", s:exec("enable -a | grep __mb_rep || true").stdout)
      local r = s:exec("export GONE=1; echo still")
      assert.same({ 0, "still\n" }, { r.exitCode, r.stdout })
      s:exec("kill -9 $$")
      assert.equal("1\n", s:exec("echo $GONE").stdout)
    end)
  end)
end)
