-- The moonbox command, run as a user would: through a shell.
local core = require "moonbox.core"
local moonbox = require "moonbox"

local BIN = os.getenv("MOONBOX_BIN") or "build/moonbox"

local function slurp(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("*a")
  f:close()
  return s
end

local function quote(s)
  return "'" .. s:gsub("'", "'\\''") .. "'"
end

-- Run the binary with args; returns stdout, stderr, exit status, milliseconds.
local function moonbox_cmd(...)
  local words = { quote(BIN) }
  for i = 1, select("#", ...) do words[#words + 1] = quote((select(i, ...))) end
  local out, err = os.tmpname(), os.tmpname()
  local t0 = core.hrtime()
  local p = io.popen(("%s >%s 2>%s </dev/null; echo $?"):format(table.concat(words, " "), out, err))
  local status = tonumber(p:read("*a"))
  p:close()
  local ms = (core.hrtime() - t0) / 1e6
  local o, e = slurp(out), slurp(err)
  os.remove(out)
  os.remove(err)
  return o, e, status, ms
end

local function script(text)
  local path = os.tmpname() .. ".lua"
  local f = assert(io.open(path, "w"))
  f:write(text)
  f:close()
  return path
end

describe("moonbox (the command)", function()
  it("without arguments prints the usage to stderr and exits 2", function()
    local out, err, status = moonbox_cmd()
    assert.equals("", out)
    assert.matches("^usage: moonbox %[%-%-policy file%.lua%] script%.lua %[args%.%.%.%]\n", err)
    assert.equals(2, status)
  end)

  it("-e without code prints the usage to stderr and exits 2", function()
    local out, err, status = moonbox_cmd("-e")
    assert.equals("", out)
    assert.matches("^usage: moonbox", err)
    assert.equals(2, status)
  end)

  it("a script that does not exist: a message and exit 1", function()
    local out, err, status = moonbox_cmd("/nonexistent/script.lua")
    assert.equals("", out)
    assert.equals("moonbox: cannot open /nonexistent/script.lua: No such file or directory\n", err)
    assert.equals(1, status)
  end)

  it("a script with a syntax error: the parser's message and exit 1", function()
    local path = script("local x = = 1\n")
    local out, err, status = moonbox_cmd(path)
    os.remove(path)
    assert.equals("", out)
    assert.equals(("moonbox: %s:1: unexpected symbol near '='\n"):format(path), err)
    assert.equals(1, status)
  end)

  it("an uncaught error prints the message and one traceback to stderr, exit 1", function()
    local out, err, status = moonbox_cmd("-e", "print('before')\nrequire('moonbox').sleep(1)\nerror('boom')")
    assert.equals("before\n", out)
    assert.matches("^moonbox: %(command line%):3: boom\nstack traceback:\n", err)
    assert.matches("%(command line%):3: in main chunk", err)
    local _, n = err:gsub("stack traceback:", "")
    assert.equals(1, n)
    assert.equals(1, status)
  end)

  it("an uncaught error object prints CODE: message and its traceback, exit 1", function()
    local out, err, status = moonbox_cmd("-e", "require('moonbox.errors').raise('E_X', 'bad thing')")
    assert.equals("", out)
    assert.matches("^moonbox: E_X: bad thing\nstack traceback:\n", err)
    assert.equals(1, status)
  end)

  it("an uncaught error value of the script's own prints its text and where it was raised, exit 1", function()
    for code, text in pairs {
      ["error({code = 'X', message = 'boom'})"] = "X: boom",
      ["error(setmetatable({}, {__tostring = function() return 'custom' end}))"] = "custom",
      ["error({1, 2})"] = "(error object is a table value)",
      ["require('moonbox').spawn(function() error({message = 'in a task'}) end):wait()"] = "in a task",
    } do
      local out, err, status = moonbox_cmd("-e", code)
      assert.equals("", out)
      assert.equals("moonbox: " .. text .. "\nstack traceback:\n", err:match("^.-\n.-\n"), code)
      assert.matches("(command line):1:", err, 1, true)
      assert.equals(1, status)
    end
  end)

  it("a failing task nobody waited for fails the run", function()
    local out, err, status = moonbox_cmd("-e", [[
      local m = require "moonbox"
      m.spawn(function() m.sleep(5) error("background failure") end)
      print("main done")
    ]])
    assert.equals("main done\n", out)
    assert.matches("background failure", err, 1, true)
    assert.equals(1, status)
  end)

  it("a deadlock is reported, exit 1", function()
    local out, err, status = moonbox_cmd("-e", "require('moonbox.async').await(function() end)")
    assert.equals("", out)
    assert.matches("^moonbox: DEADLOCK: ", err)
    assert.equals(1, status)
  end)

  it("--version prints the moonbox, LuaJIT and libuv versions", function()
    local out, err, status = moonbox_cmd("--version")
    local head = ("moonbox %s\n%s\nlibuv %s\n"):format(moonbox.VERSION, jit.version, core.versions().libuv)
    assert.equals(head, out:sub(1, #head))
    assert.matches("^moonbox %d+%.%d+%.%d+\nLuaJIT 2%.%d+%.%d+[^\n]*\nlibuv %d+%.%d+%.%d+\n" ..
      "open files: soft %d+, hard %d+\n$", out)
    assert.equals("", err)
    assert.equals(0, status)
  end)

  it("--help and -h print the usage to stdout and exit 0", function()
    for _, flag in ipairs { "--help", "-h" } do
      local out, err, status = moonbox_cmd(flag)
      assert.matches("^usage: moonbox %[%-%-policy file%.lua%] script%.lua %[args%.%.%.%]\n" ..
        "       moonbox %[%-%-policy file%.lua%] %-e 'lua code' %[args%.%.%.%]\n", out)
      assert.matches("exits when it and every\ntask it started are done", out, 1, true)
      assert.equals("", err)
      assert.equals(0, status)
    end
  end)

  it("raises its soft open-files limit to the hard limit and reports both", function()
    local p = io.popen(("ulimit -S -n 256; ulimit -H -n 2048; %s --version"):format(quote(BIN)))
    local out = p:read("*a")
    p:close()
    assert.matches("\nopen files: soft 2048, hard 2048\n$", out)
  end)

  it("an unknown option: one line naming it, the usage, exit 2", function()
    for _, args in ipairs { { "-x" }, { "--nope", "script.lua" }, { "--policy", "dev", "-q" } } do
      local out, err, status = moonbox_cmd(unpack(args))
      assert.equals("", out)
      assert.equals(("moonbox: unknown option '%s'\n"):format(args[#args == 3 and 3 or 1]), err:match("^[^\n]*\n"))
      assert.equals(2, status)
    end
  end)

  it("--policy takes a preset's name; an unknown name: one line listing the presets, exit 2", function()
    local out, err, status = moonbox_cmd("--policy", "strict", "-e",
      "print(require('moonbox.policy').resolve(nil).limits.maxSessions)")
    assert.same({ "8\n", "", 0 }, { out, err, status })
    out, err, status = moonbox_cmd("--policy", "nosuchpreset", "-e", "print(1)")
    assert.same({ "", 2 }, { out, status })
    assert.equals('moonbox: VALIDATION_FAILED: policy: unknown policy "nosuchpreset": the presets are dev, strict; ' ..
      "or give a module name or a path to a .lua file\n", err)
  end)

  it("--policy without a value says so, exit 2", function()
    for _, args in ipairs { { "--policy" }, { "--policy", "-e", "print(1)" }, { "--policy", "--help" } } do
      local out, err, status = moonbox_cmd(unpack(args))
      assert.same({ "", "moonbox: --policy needs a value: a preset (strict, dev) or a file.lua\n", 2 },
        { out, err, status })
    end
  end)

  it("a policy that cannot be used is exit 2 for a script and for serve alike", function()
    local bad = script("return { bogus = 1 }")
    for _, args in ipairs { { "--policy", bad, "-e", "print(1)" }, { "--policy", bad, "serve" },
                            { "serve", "--policy", bad, "--listen", "127.0.0.1:0" } } do
      local out, err, status = moonbox_cmd(unpack(args))
      assert.same({ "", 2 }, { out, status }, table.concat(args, " "))
      assert.matches("^moonbox[^\n]*: [^\n]*policy%.bogus: unknown key\n$", err)
    end
    local out, err, status = moonbox_cmd("--policy", "/nonexistent/policy.lua", "-e", "print(1)")
    assert.same({ "", 2 }, { out, status })
    assert.matches("/nonexistent/policy.lua", err, 1, true)
    os.remove(bad)
  end)

  it("-h names the presets and MOONBOX_HOME", function()
    local out, _, status = moonbox_cmd("-h")
    assert.equals(0, status)
    assert.matches("\n  %-%-policy P     every sandbox's default policy: a preset %(strict, dev%) or a\n", out)
    assert.matches("\n  MOONBOX_HOME   where sandboxes live %(MOONBOX_HOME/sandboxes/ID%); default\n" ..
      "                 ~/%.local/share/moonbox\n", out)
  end)

  it("serve: an address that is not one, and a token file that cannot be read, say why, exit 2", function()
    local out, err, status = moonbox_cmd("serve", "--listen", "999.1.1.1:80")
    assert.same({ "", 'moonbox serve: listen: "999.1.1.1" is not an IPv4 address: each of its four numbers ' ..
      "is 0 to 255\n", 2 }, { out, err, status })
    out, err, status = moonbox_cmd("serve", "--listen", "127.0.0.1:0", "--token-file", "/nonexistent/token")
    assert.same({ "", 'moonbox serve: cannot read the token file "/nonexistent/token": no such file or directory\n',
      2 }, { out, err, status })
  end)

  it("serve --help and -h print the serve usage to stdout and exit 0", function()
    for _, flag in ipairs { "--help", "-h" } do
      local out, err, status = moonbox_cmd("serve", "--listen", "127.0.0.1:0", flag)
      assert.matches("^usage: moonbox serve %[%-%-listen 127%.0%.0%.1:8080 | %-%-listen unix:/path%.sock%]\n", out)
      assert.same({ "", 0 }, { err, status })
    end
  end)

  it("serve: an unknown option or a missing value is one line, exit 2", function()
    local out, err, status = moonbox_cmd("serve", "-x")
    assert.same({ "", "moonbox serve: unknown option '-x'\n", 2 }, { out, err, status })
    out, err, status = moonbox_cmd("serve", "--listen")
    assert.same({ "", "moonbox serve: --listen needs a value\n", 2 }, { out, err, status })
  end)

  it("serve: an address in use is one line without a traceback, exit 1", function()
    moonbox.run(function()
      local server = require("moonbox.server.http").listen({ listen = "127.0.0.1:0" }, function() end)
      local ok, out, err, status = pcall(moonbox_cmd, "serve", "--listen", server.address, "--no-token")
      server:close()
      assert(ok, out)
      assert.same({ "", ("moonbox serve: cannot listen on %s: address already in use\n"):format(server.address), 1 },
        { out, err, status })
    end)
  end)

  -- `moonbox` on a fresh pty (TERM as given); fn(write, expect, home, wait_exit)
  -- where expect(text) returns the output up to and including text
  local function on_a_terminal(term, fn)
    moonbox.run(function()
      local master, slave = assert(core.openpty(80, 24))
      local home = helper.mkdtemp()
      local exit = {}
      local proc = assert(core.spawn {
        args = { BIN }, setsid = true, ctty = 0,
        env = { PATH = os.getenv("PATH"), HOME = home, MOONBOX_HOME = home, TERM = term,
          ASAN_OPTIONS = os.getenv("ASAN_OPTIONS"), LUA_PATH = os.getenv("LUA_PATH"),
          LUA_CPATH = os.getenv("LUA_CPATH") },
        stdio = { [0] = slave, [1] = slave, [2] = slave },
        on_exit = function(code) exit.code = code if exit.resume then exit.resume() end end,
      })
      core.close_fd(slave)
      local stream = core.stream_open(master, true)
      local buf, wake = "", nil
      stream:read_start(function(_, data)
        buf = buf .. (data or "")
        if wake then wake() end
      end)
      local function expect(text)
        return moonbox.timeout(20000, function()
          while not buf:find(text, 1, true) do
            require("moonbox.async").await(function(resume) wake = resume return function() wake = nil end end)
            wake = nil
          end
          local _, j = buf:find(text, 1, true)
          local seen = buf:sub(1, j)
          buf = buf:sub(j + 1)
          return seen
        end)
      end
      local function wait_exit()
        if exit.code == nil then require("moonbox.async").await(function(resume) exit.resume = resume end) end
        return exit.code
      end
      local ok, err = pcall(fn, function(data) stream:write(data) end, expect, home, wait_exit)
      if exit.code == nil then proc:kill("SIGKILL") end
      stream:close()
      helper.sh("rm -rf " .. home)
      assert(ok, err)
    end)
  end

  it("with no script on a terminal: a prompt; lines run as tasks, Ctrl-C cancels one, Ctrl-D ends", function()
    on_a_terminal("dumb", function(write, expect, home, wait_exit)
      expect("> ")
      write("x = 6 * 7\n")
      expect("> ")
      write("x, 'two'\n")
      assert.equals("x, 'two'\r\n42\ttwo\r\n> ", expect("> "))
      write("for i = 1, 2 do\n")
      expect(">> ")
      write("io.write(i, ' ') end\n")
      assert.equals("io.write(i, ' ') end\r\n1 2 > ", expect("> "))
      write("sb = require('moonbox').getSandbox('repl-spec', {root = '" .. home .. "/sb'})\n")
      expect("> ")
      write("sb:exec('echo from the sandbox').stdout\n")
      assert.matches("from the sandbox\r\n\r\n> $", expect("> "))
      write("error('boom')\n")
      assert.matches("stdin:1: boom", expect("> "), 1, true)
      -- Ctrl-C cancels the running line; the prompt goes on
      write("sb:exec('sleep 1000')\n")
      moonbox.sleep(300)
      write("\3")
      assert.matches("interrupted\r\n> $", expect("> "))
      write("sb:exec('echo $((1+2))').stdout\n")
      assert.matches("3\r\n\r\n> $", expect("> "))
      -- Ctrl-C at the prompt drops what was typed
      write("half a line\3")
      expect("> ")
      write("'after'\n")
      assert.matches("after\r\n> $", expect("> "))
      write("sb:destroy()\n")
      expect("> ")
      write("\4")
      assert.equals(0, wait_exit())
    end)
  end)

  it("the prompt shows a command's result as exit code, stdout and stderr, and tables pretty-printed", function()
    on_a_terminal("dumb", function(write, expect, home, wait_exit)
      expect("> ")
      write("sb = require('moonbox').getSandbox('repl-pretty', {root = '" .. home .. "/sb'})\n")
      expect("> ")
      write("sb:exec('echo out; echo err >&2; exit 3')\n")
      assert.equals("sb:exec('echo out; echo err >&2; exit 3')\r\nexit 3\r\n--- stdout\r\nout\r\n" ..
        "--- stderr\r\nerr\r\n> ", expect("> "))
      write("sb:exec('true')\n")
      assert.equals("sb:exec('true')\r\nexit 0, no output\r\n> ", expect("> "))
      write("{ 1, 'two', nested = { ok = true } }\n")
      assert.equals("{ 1, 'two', nested = { ok = true } }\r\n{\r\n  1,\r\n  \"two\",\r\n" ..
        "  nested = {\r\n    ok = true,\r\n  },\r\n}\r\n> ", expect("> "))
      write("sb:destroy()\n")
      expect("> ")
      write("\4")
      assert.equals(0, wait_exit())
    end)
  end)

  it("on a real terminal: line editing and history through libedit when it is there", function()
    local has_libedit = pcall(require("ffi").load, "edit.so.2")
    on_a_terminal("xterm", function(write, expect, _, wait_exit)
      expect("> ")
      write("'first' .. 1\n")
      expect("first1\r\n> ")
      if has_libedit then
        -- Up recalls the line; Left and an insert edit it
        write("\27[A\27[D2\n")
        expect("first21\r\n> ")
      end
      write("'typed' .. 'again'\n")
      expect("typedagain\r\n> ")
      write("\3")
      expect("> ")
      write("\4")
      assert.equals(0, wait_exit())
    end)
  end)

  it("-i with a script is a usage mistake; without a terminal and arguments, the usage", function()
    local _, err, status = moonbox_cmd("-i", "x.lua")
    assert.same({ 2, "usage: moonbox" }, { status, err:sub(1, 14) })
  end)

  it("- reads the script from standard input and passes the arguments", function()
    local p = io.popen(("printf '%%s' 'print(arg[0], #arg, ...)' | %s - a 'b c'"):format(quote(BIN)))
    local out = p:read("*a")
    p:close()
    assert.equals("-\t2\ta\tb c\n", out)
  end)

  it("-e CODE args: arg and ... carry the arguments", function()
    local out, err, status = moonbox_cmd("-e", "print(arg[0], #arg, ...)", "x", "y z")
    assert.equals("-e\t2\tx\ty z\n", out)
    assert.equals("", err)
    assert.equals(0, status)
  end)

  it("-e runs the code as a task", function()
    local out, err, status = moonbox_cmd("-e", [[
      local m = require "moonbox"
      m.sleep(5)
      print(1 + 1, require("moonbox.async").in_task())
    ]])
    assert.equals("2\ttrue\n", out)
    assert.equals("", err)
    assert.equals(0, status)
  end)

  it("a script gets arg (arg[0] is the script) and its arguments as ...", function()
    local path = script([[
      print(arg[0] == ... and "same" or arg[0])
      print(#arg, arg[1], arg[2])
      print(select("#", ...), ...)
    ]])
    local out, err, status = moonbox_cmd(path, "a", "b c")
    os.remove(path)
    assert.equals(("%s\n2\ta\tb c\n2\ta\tb c\n"):format(path), out)
    assert.equals("", err)
    assert.equals(0, status)
  end)

  it("exits only when every task it spawned is done", function()
    local out, err, status, ms = moonbox_cmd("-e", [[
      local m = require "moonbox"
      m.spawn(function()
        m.sleep(200)
        print("late task")
      end)
      print("main chunk done")
    ]])
    assert.equals("main chunk done\nlate task\n", out)
    assert.equals("", err)
    assert.equals(0, status)
    assert.is_true(ms >= 200, "exited after " .. ms .. " ms")
  end)

  it("an unisolated sandbox's processes die with a runtime killed by SIGKILL, setsid or not", function()
    local dir = helper.mkdtemp()
    local root = dir .. "/root"
    local path = script(([[
      local m = require "moonbox"
      local sb = m.getSandbox("guard-box", { isolation = "none", root = %q })
      sb:exec("setsid sh -c 'echo $$ > pid; exec sleep 4321.%d' </dev/null >/dev/null 2>&1 &")
      while not sb:exists("pid").exists do m.sleep(10) end
      print("ready " .. require("moonbox.process.tree").mode())
      io.stdout:flush()
      m.sleep(600000)
    ]]):format(root, core.getpid())) -- (this run's sleep: another run of this spec beside it has its own)
    local out = dir .. "/out"
    -- (started through a shell that exits: the runtime and what it leaves
    -- are not this process's to reap)
    local runtime = tonumber(helper.sh(("%s %s > %s 2>&1 & echo $!"):format(quote(BIN), quote(path), quote(out))))
    run_task(function()
      assert.is_true(helper.eventually(function() return helper.sh("cat " .. quote(out)):match("^ready") end, 20000),
        helper.sh("cat " .. quote(out)))
      local pid = tonumber(helper.sh("cat " .. quote(root .. "/workspace/pid")))
      assert.is_true(helper.pid_alive(pid))
      helper.sh("kill -KILL " .. runtime)
      if helper.sh("cat " .. quote(out)) == "ready cgroup" then
        assert.is_true(helper.eventually(function() return not helper.pid_alive(pid) end))
        assert.equal("", helper.sh("pgrep -f '^sleep 4321[.]" .. core.getpid() .. "$' || true"))
      else
        -- proc mode (docs/processes.md): without a cgroup tree nothing
        -- reaches a process that left its shell's session
        helper.sh("kill -KILL " .. pid)
      end
    end)
    os.remove(path)
    helper.sh("rm -rf " .. quote(dir))
  end)

  it("moonbox.versions() inside agrees with --version", function()
    local out, _, status = moonbox_cmd("-e", [[
      local v = require("moonbox").versions()
      print(v.moonbox, v.luajit, v.libuv)
    ]])
    assert.equals(("%s\t%s\t%s\n"):format(moonbox.VERSION, jit.version, core.versions().libuv), out)
    assert.equals(0, status)
  end)
end)
