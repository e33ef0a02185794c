-- The pty terminal (issue #6).
local moonbox = require "moonbox"
local core = require "moonbox.core"
local util = require "moonbox.lib.util"

local with_sandbox = helper.with_sandbox

-- Read until the accumulated output matches pattern (or fail after 5 s).
local function expect(t, pattern)
  local acc = ""
  local deadline = core.hrtime() / 1e6 + 5000
  while core.hrtime() / 1e6 < deadline do
    local ok, chunk = pcall(moonbox.timeout, math.max(1, deadline - core.hrtime() / 1e6), t.read, t)
    if not ok or not chunk then break end
    acc = acc .. chunk
    if acc:find(pattern) then break end
  end
  assert.truthy(acc:find(pattern), ("pattern %q not seen in %q"):format(pattern, acc))
  return acc
end

-- Wait until a process named comm is the terminal's foreground job: only
-- then does ^C reach it (and not readline, which would discard the line).
local function wait_foreground(t, comm)
  local deadline = core.hrtime() / 1e6 + 5000
  local found = false
  while not found and core.hrtime() / 1e6 < deadline do
    local stat = util.read_file("/proc/" .. t.pid .. "/stat") or ""
    local tpgid = tonumber(stat:match("%) %S %d+ %d+ %d+ %-?%d+ (%-?%d+)"))
    local fg = tpgid and tpgid ~= t.pid and util.read_file("/proc/" .. tpgid .. "/comm")
    found = fg == comm .. "\n"
    if not found then moonbox.sleep(10) end
  end
  assert.is_true(found, comm .. " never became the foreground job")
end

describe("terminal", function()
  it("lets go of the pty of a shell that exited, closed or not; what it printed can still be read", function()
    with_sandbox(function(sb)
      local function ptys()
        local n = 0
        for _, fd in ipairs(core.readdir("/proc/self/fd") or {}) do
          local l = core.readlink("/proc/self/fd/" .. fd) or ""
          if l:find("ptmx", 1, true) or l:find("/pts/", 1, true) then n = n + 1 end
        end
        return n
      end
      local before = ptys()
      local last
      for _ = 1, 5 do
        last = sb:terminal {}
        last:write("echo bye-$((6*7)); exit 3\n")
        assert.equal(3, last:wait())
      end
      assert.is_true(helper.eventually(function() return ptys() == before end, 5000), "ptys held: " .. ptys())
      local out, chunk = "", last:read()
      while chunk do out = out .. chunk chunk = last:read() end
      assert.matches("bye%-42", out)
    end)
  end)

  it("rejects bad sizes", function()
    with_sandbox(function(sb)
      local ok, err = pcall(sb.terminal, sb, { cols = 0 })
      assert.is_false(ok)
      assert.equal("VALIDATION_FAILED", err.code)
    end)
  end)

  it("runs an interactive shell in the session's cwd and env with TERM=xterm-256color", function()
    with_sandbox(function(sb)
      sb:exec("mkdir -p here && cd here && export GREETING=hello")
      local t = sb:terminal { cols = 80, rows = 24 }
      assert.is_number(t.pid)
      t:write('echo "[$GREETING $TERM $(basename $PWD)]"\n')
      expect(t, "%[hello xterm%-256color here%]")
      t:close()
    end)
  end)

  it("is the shell's controlling terminal, named in the sandbox's own /dev/pts", function()
    with_sandbox(function(sb)
      local t = sb:terminal {}
      t:write('echo "[$(tty)] [$(ps -o tty= -p $$)]"; test -e "$(tty)" && echo vis""ible\n')
      local out = expect(t, "\nvisible")
      local name = out:match("%[/dev/(pts/%d+)%] %[pts/%d+%]")
      assert.is_string(name, out)
      t:close()
    end)
  end)

  it("echoes typed input and shows a resize in stty size", function()
    with_sandbox(function(sb)
      local t = sb:terminal {}
      t:write("echo hi\n")
      -- up to the next prompt: readline has done its size write-back
      expect(t, "\rhi\r\n.*[#$] $")
      t:resize(100, 40)
      t:write("stty size\n")
      expect(t, "40 100")
      t:close()
    end)
  end)

  it("keeps a resize that the shell's stale size write-back would undo", function()
    with_sandbox(function(sb)
      local t = sb:terminal {}
      expect(t, "[#$] $")
      t:resize(100, 40)
      -- what readline does when a resize lands inside its read-then-write
      t:write("stty rows 24 cols 80; echo put-\"back\"\n")
      expect(t, "put%-back")
      t:write("stty size\n")
      expect(t, "40 100")
      -- any other size a program sets is its own and stays
      t:write("stty rows 30 cols 90; stty size\n")
      expect(t, "30 90")
      t:close()
    end)
  end)

  it("interrupts a running command with ^C and the shell lives on", function()
    with_sandbox(function(sb)
      local t = sb:terminal {}
      t:write("sleep 100\n")
      wait_foreground(t, "sleep")
      t:write("\3")
      t:write("echo alive-$((40 + 2))\n")
      expect(t, "alive%-42")
      t:close()
    end)
  end)

  it("ends with the shell's exit code and read returns nil afterwards", function()
    with_sandbox(function(sb)
      local t = sb:terminal {}
      local cgroup = t._cgroup -- (cgroup mode)
      local seen = {}
      t:onData(function(d) seen[#seen + 1] = d end)
      t:write("exit 3\n")
      assert.equal(3, t:wait())
      while t:read() do end
      assert.is_nil(t:read())
      assert.is_true(#seen > 0)
      -- its cgroup goes with it, not only at close() or the sandbox's end
      if cgroup then
        assert.is_true(helper.eventually(function() return not util.is_dir(cgroup) end), cgroup)
      end
      t:close()
    end)
  end)

  it("close() kills the shell and everything it started", function()
    with_sandbox(function(sb)
      local t = sb:terminal {}
      t:write("sleep 100 & echo bg=$!\n")
      local out = expect(t, "bg=%d+")
      local bg = tonumber(out:match("bg=(%d+)"))
      t:close()
      assert.is_true(helper.eventually(function() return not helper.pid_alive(bg, sb) end), "the job survived")
      assert.is_false(helper.pid_alive(t.pid))
    end)
  end)

  it("runs a full-screen program", function()
    with_sandbox(function(sb)
      local t = sb:terminal { cols = 120, rows = 30 }
      t:write("top -b -n 1 | head -5; echo top-done\n")
      expect(t, "top%-done")
      t:close()
    end)
  end)
end)
