-- moonbox.core.spawn: processes started from a spec table (argv without a
-- shell, exact environment, cwd, stdio placement, sessions and groups,
-- rlimits, pdeathsig), their exits, and how each failure is reported.
local core = require "moonbox.core"
local async = require "moonbox.async"
local moonbox = require "moonbox"

local PATH = "/usr/local/bin:/usr/bin:/bin"
local SIGPIPE_BIT = 0x1000 -- 1 << (13 - 1)

local read_all = helper.read_all

-- Read until at least n lines have arrived (without waiting for EOF).
local function read_lines(stream, n)
  return async.await(function(resume)
    local buf = ""
    stream:read_start(function(err, data)
      buf = buf .. (data or "")
      local lines = {}
      for l in buf:gmatch("([^\n]*)\n") do lines[#lines + 1] = l end
      if err or data == nil or #lines >= n then
        stream:read_stop()
        resume(lines)
      end
    end)
    return function() stream:read_stop() end
  end)
end

-- Spawn with an exit callback; returns proc, pipes, wait() -> code, signal.
local function start(spec)
  local exit = {}
  if spec.env == nil then
    spec.env = { PATH = PATH }
  elseif spec.env == false then
    spec.env = nil
  end
  spec.on_exit = function(code, sig)
    exit.code, exit.sig = code, sig
    if exit.resume then exit.resume() end
  end
  local proc, pipes = assert(core.spawn(spec))
  local function wait()
    if exit.code == nil then
      async.await(function(resume) exit.resume = resume end)
    end
    return exit.code, exit.sig
  end
  return proc, pipes, wait
end

-- Run to completion collecting fd 1; returns output, exit code, signal.
local function run(spec)
  spec.stdio = spec.stdio or {}
  if spec.stdio[1] == nil then spec.stdio[1] = "pipe" end
  local _, pipes, wait = start(spec)
  local out = read_all(pipes[1])
  for _, s in pairs(pipes) do s:close() end
  local code, sig = wait()
  return out, code, sig
end

local function read_file(path)
  local f = io.open(path)
  if not f then return nil end
  local s = f:read("*a")
  f:close()
  return s
end

-- pid state, ppid, pgrp, session from /proc/<pid>/stat
local function stat_of(pid)
  local s = assert(read_file("/proc/" .. pid .. "/stat"))
  local state, ppid, pgrp, session = s:match("%) (%S) (%d+) (%d+) (%d+)")
  return { state = state, ppid = tonumber(ppid), pgrp = tonumber(pgrp), session = tonumber(session) }
end

local function status_field(pid, name)
  return assert(read_file("/proc/" .. pid .. "/status")):match(name .. ":%s*(%x+)")
end

local open_fds = helper.fd_count

local function gone(pid)
  for _ = 1, 200 do
    if not helper.pid_alive(pid) then return true end
    moonbox.sleep(10)
  end
  return false
end

local function tmpdir()
  local p = io.popen("mktemp -d")
  local dir = p:read("*l")
  p:close()
  return dir
end

describe("core.spawn failures", function()
  it("a missing executable: nil, ENOENT message naming argv[0], code; no child left", function()
    run_task(function()
      local proc, msg, code = core.spawn { args = { "nope" } }
      assert.is_nil(proc)
      assert.equals("ENOENT: exec failed (argv[0]): 'nope'", msg)
      assert.equals("ENOENT", code)
      assert.equals(0, core.spawn_stats().running)
      assert.same({}, helper.children())
    end)
  end)

  it("a missing executable given by path", function()
    run_task(function()
      local proc, msg, code = core.spawn { args = { "/nonexistent/bin/nope" } }
      assert.is_nil(proc)
      assert.equals("ENOENT: exec failed (argv[0]): '/nonexistent/bin/nope'", msg)
      assert.equals("ENOENT", code)
    end)
  end)

  it("a missing cwd: ENOENT naming the chdir", function()
    run_task(function()
      local proc, msg, code = core.spawn { args = { "true" }, cwd = "/nonexistent" }
      assert.is_nil(proc)
      assert.equals("ENOENT: chdir failed (cwd): '/nonexistent'", msg)
      assert.equals("ENOENT", code)
    end)
  end)

  it("a file that is not executable: EACCES", function()
    run_task(function()
      local path = os.tmpname()
      local proc, msg, code = core.spawn { args = { path } }
      os.remove(path)
      assert.is_nil(proc)
      assert.equals(("EACCES: exec failed (argv[0]): '%s'"):format(path), msg)
      assert.equals("EACCES", code)
    end)
  end)

  it("a non-executable match on PATH beats a later ENOENT: EACCES", function()
    run_task(function()
      local dir = tmpdir()
      assert(io.open(dir .. "/mbx-tool", "w")):close()
      local proc, msg, code = core.spawn {
        args = { "mbx-tool" }, env = { PATH = dir .. ":/nonexistent" },
      }
      os.execute("rm -rf " .. dir)
      assert.is_nil(proc)
      assert.equals("EACCES: exec failed (argv[0]): 'mbx-tool'", msg)
      assert.equals("EACCES", code)
    end)
  end)

  it("a PATH of many empty entries is searched safely", function()
    run_task(function()
      local proc, msg, code = core.spawn { args = { "z" }, env = { PATH = string.rep(":", 40) } }
      assert.is_nil(proc)
      assert.equals("ENOENT: exec failed (argv[0]): 'z'", msg)
      assert.equals("ENOENT", code)
    end)
  end)

  it("an exec failure is reported even when a stdio target takes the report pipe's fd number", function()
    run_task(function()
      -- the next pipe2() returns these two numbers again: the report pipe
      local r, w = core.pipe()
      core.close_fd(r)
      core.close_fd(w)
      local proc, msg, code = core.spawn { args = { "nope" }, stdio = { [w] = "null", [r] = "null" } }
      assert.is_nil(proc)
      assert.equals("ENOENT: exec failed (argv[0]): 'nope'", msg)
      assert.equals("ENOENT", code)
    end)
  end)

  it("an rlimit that cannot be set: EPERM naming setrlimit", function()
    run_task(function()
      local proc, msg, code = core.spawn { args = { "true" }, rlimits = { nofile = 2 ^ 31 } }
      assert.is_nil(proc)
      assert.equals("EPERM: setrlimit failed: operation not permitted", msg)
      assert.equals("EPERM", code)
    end)
  end)

  it("an integer stdio fd that is not open: EBADF", function()
    run_task(function()
      local r, w = core.pipe()
      core.close_fd(r)
      core.close_fd(w)
      local proc, msg, code = core.spawn { args = { "true" }, stdio = { [1] = w } }
      assert.is_nil(proc)
      assert.equals("EBADF: bad file descriptor (stdio)", msg)
      assert.equals("EBADF", code)
    end)
  end)

  it("raises on a malformed spec, leaking no fd", function()
    run_task(function()
      local before = open_fds()
      local cases = {
        { {}, "spawn: args must be a non-empty array" },
        { { args = {} }, "spawn: args must be a non-empty array" },
        { { args = { "echo", 1 } }, "args[2] must be a string" },
        { { args = { "true" }, env = { A = 1 } }, "env keys and values must be strings" },
        { { args = { "true" }, stdio = { [0] = "pipe", [1] = "bogus" } }, "stdio[1]: unknown kind 'bogus'" },
        { { args = { "true" }, stdio = { [0] = "pipe", [2] = {} } }, "stdio[2] must be a kind or an fd, got table" },
        { { args = { "true" }, stdio = "pipe" }, "spawn: stdio must be a table" },
        { { args = { "true" }, stdio = { [256] = "null" } }, "spawn: stdio keys must be fd numbers 0..255" },
        { { args = { "true" }, stdio = { out = "null" } }, "spawn: stdio keys must be fd numbers 0..255" },
        { { args = { "true" }, stdio = { [-1] = "null" } }, "spawn: stdio keys must be fd numbers 0..255" },
        { { args = { "true" }, rlimits = { nofile = "x" } }, "rlimits.nofile must be a number" },
        { { args = { "true" }, pdeathsig = "SIGNOPE" }, "unknown signal 'SIGNOPE'" },
        { { args = { "true" }, on_exit = 1 }, "function expected, got number" },
      }
      for _, case in ipairs(cases) do
        local ok, err = pcall(core.spawn, case[1])
        assert.is_false(ok)
        assert.matches(case[2], err, 1, true)
      end
      local too_many = { args = { "true" }, stdio = {} }
      for fd = 3, 20 do too_many.stdio[fd] = "pipe" end
      local ok, err = pcall(core.spawn, too_many)
      assert.is_false(ok)
      assert.matches("too many stdio entries (max 16)", err, 1, true)
      assert.equals(before, open_fds())
    end)
  end)

  it("kill of an exited process: nil, ESRCH", function()
    run_task(function()
      local proc, _, wait = start { args = { "true" } }
      assert.same({ 0, 0 }, { wait() })
      local ok, msg, code = proc:kill("SIGTERM")
      assert.is_nil(ok)
      assert.equals("ESRCH: no such process (process has exited)", msg)
      assert.equals("ESRCH", code)
      ok, msg, code = core.kill(proc:pid(), "SIGTERM")
      assert.is_nil(ok)
      assert.equals("ESRCH: no such process (kill)", msg)
      assert.equals("ESRCH", code)
    end)
  end)
end)

describe("core.spawn", function()
  it("passes argv without a shell", function()
    run_task(function()
      local out, code = run { args = { "printf", "%s", "a b" } }
      assert.equals("a b", out)
      assert.equals(0, code)
      out = run { args = { "printf", "[%s]", "$HOME", "*", "'q'", "" } }
      assert.equals("[$HOME][*]['q'][]", out)
    end)
  end)

  it("file overrides the program while args[1] stays argv[0]", function()
    run_task(function()
      assert.equals("custom-name\n", (run { file = "/bin/sh", args = { "custom-name", "-c", "echo $0" } }))
    end)
  end)

  it("gives exactly the environment passed, inheriting nothing", function()
    run_task(function()
      assert.equals("FOO=bar baz\n", (run { args = { "/usr/bin/env" }, env = { FOO = "bar baz" } }))
      assert.equals("A=1\nB=2\n", (run { args = { "/usr/bin/env" }, env = { "A=1", "B=2" } }))
      assert.equals("", (run { args = { "/usr/bin/env" }, env = {} }))
      -- without env at all: still empty; the program is found on a default PATH
      assert.equals("", (run { args = { "env" }, env = false }))
    end)
  end)

  it("runs in cwd", function()
    run_task(function()
      assert.equals("/tmp\n", (run { args = { "pwd" }, cwd = "/tmp" }))
      assert.equals("/\n", (run { args = { "sh", "-c", "pwd" }, cwd = "/" }))
    end)
  end)

  it("starts the child in the cgroup given, its children too", function()
    local tree = require "moonbox.process.tree"
    local cgroup = require "moonbox.process.cgroup"
    if tree.mode() ~= "cgroup" then pending("no writable cgroup v2 here (unprivileged)") end
    run_task(function()
      local dir = assert(cgroup.create("spawn-spec"))
      local ok, err = pcall(function()
        local out = run { args = { "sh", "-c", "grep ^0:: /proc/self/cgroup; sh -c 'grep ^0:: /proc/self/cgroup'" },
          cgroup = dir }
        local rel = dir:match("/sys/fs/cgroup/unified(.*)$") or dir:match("/sys/fs/cgroup(.*)$")
        assert.equals(("0::%s\n"):rep(2):format(rel, rel), out)
      end)
      helper.settle()
      core.rmdir(dir)
      if not ok then error(err, 0) end
    end)
  end)

  it("reports exit codes and signals as (code, signal) with 128+N", function()
    run_task(function()
      assert.same({ "", 0, 0 }, { run { args = { "true" } } })
      assert.same({ "", 3, 0 }, { run { args = { "sh", "-c", "exit 3" } } })
      assert.same({ "", 143, 15 }, { run { args = { "sh", "-c", "kill -TERM $$" } } })
      assert.same({ "", 137, 9 }, { run { args = { "sh", "-c", "kill -KILL $$" } } })
    end)
  end)

  it("process: pid, status while running and after, kill with a default of SIGTERM", function()
    run_task(function()
      local proc, _, wait = start { args = { "sleep", "100" } }
      assert.is_number(proc:pid())
      assert.equals("running", proc:status())
      assert.equals(1, core.spawn_stats().running)
      assert.is_true(helper.pid_alive(proc:pid()))
      assert.is_true(proc:kill())
      assert.same({ 143, 15 }, { wait() })
      assert.same({ "exited", 143, 15 }, { proc:status() })
      assert.equals(0, core.spawn_stats().running)
    end)
  end)

  it("an exit callback that raises fails the run; the process is still reaped", function()
    local ok, err = pcall(moonbox.run, function()
      local done = false
      core.spawn { args = { "true" }, env = {}, on_exit = function()
        done = true
        error("boom in on_exit")
      end }
      while not done do moonbox.sleep(5) end
    end)
    helper.assert_clean()
    assert.is_false(ok)
    assert.matches("boom in on_exit", err, 1, true)
    assert.matches("stack traceback:", err, 1, true)
  end)

  it("stdio 'null' reads EOF and swallows output", function()
    run_task(function()
      local out = run { args = { "sh", "-c", "cat; echo done; echo lost >&2" }, stdio = { [0] = "null", [2] = "null" } }
      assert.equals("done\n", out)
      local _, pipes, wait = start {
        args = { "sh", "-c", "echo lost; echo kept >&2" }, stdio = { [1] = "null", [2] = "pipe" },
      }
      assert.is_nil(pipes[1])
      assert.equals("kept\n", read_all(pipes[2]))
      pipes[2]:close()
      assert.same({ 0, 0 }, { wait() })
    end)
  end)

  it("stdio 'pipe' on 0 is written by us and on 1 and 2 read by us", function()
    run_task(function()
      local _, pipes, wait = start {
        args = { "sh", "-c", "cat; echo err >&2" }, stdio = { [0] = "pipe", [1] = "pipe", [2] = "pipe" },
      }
      pipes[0]:write("through cat\n")
      pipes[0]:shutdown()
      assert.equals("through cat\n", read_all(pipes[1]))
      assert.equals("err\n", read_all(pipes[2]))
      for _, s in pairs(pipes) do s:close() end
      assert.same({ 0, 0 }, { wait() })
    end)
  end)

  it("stdio 'in' and 'out' set the direction on any fd", function()
    run_task(function()
      local _, pipes, wait = start {
        args = { "sh", "-c", "echo three >&3; cat <&4 >&5" },
        stdio = { [3] = "out", [4] = "in", [5] = "out" },
      }
      pipes[4]:write("four to five")
      pipes[4]:shutdown()
      assert.equals("three\n", read_all(pipes[3]))
      assert.equals("four to five", read_all(pipes[5]))
      for _, s in pairs(pipes) do s:close() end
      assert.same({ 0, 0 }, { wait() })
    end)
  end)

  it("places a pipe at a high fd number (stdio[60] = 'in')", function()
    run_task(function()
      local _, pipes, wait = start { args = { "sh", "-c", "cat /dev/fd/60" }, stdio = { [1] = "pipe", [60] = "in" } }
      assert.is_nil(pipes[0])
      pipes[60]:write("to sixty")
      pipes[60]:shutdown()
      assert.equals("to sixty", read_all(pipes[1]))
      for _, s in pairs(pipes) do s:close() end
      assert.same({ 0, 0 }, { wait() })
    end)
  end)

  it("an integer stdio entry places that fd of ours", function()
    run_task(function()
      local r, w = core.pipe()
      local rs = core.stream_open(r)
      local _, _, wait = start { args = { "echo", "via our fd" }, stdio = { [1] = w } }
      core.close_fd(w)
      assert.equals("via our fd\n", read_all(rs))
      rs:close()
      assert.same({ 0, 0 }, { wait() })
    end)
  end)

  it("'inherit' keeps our fd under the same number, /dev/null when we have none there", function()
    run_task(function()
      local r, w = core.pipe()
      local rs = core.stream_open(r)
      local out = run {
        args = { "sh", "-c", ("echo inherited >/dev/fd/%d; readlink /proc/self/fd/200"):format(w) },
        stdio = { [w] = "inherit", [200] = "inherit" }, -- (200: a number we hold nothing at)
      }
      core.close_fd(w)
      assert.equals("/dev/null\n", out)
      assert.equals("inherited\n", read_all(rs))
      rs:close()
    end)
  end)

  it("the child has exactly the fds it was given; unspecified 0-2 are /dev/null", function()
    run_task(function()
      local out = run { args = { "sh", "-c", "ls -1 /proc/$$/fd; readlink /proc/$$/fd/0 /proc/$$/fd/2" } }
      assert.equals("0\n1\n2\n/dev/null\n/dev/null\n", out)
      out = run { args = { "sh", "-c", "ls -1 /proc/$$/fd" }, stdio = { [7] = "null" } }
      assert.equals("0\n1\n2\n7\n", out)
    end)
  end)

  it("a runtime holding many fds keeps every one of them, and the child gets none", function()
    run_task(function()
      -- the child shares our fd table until it unshares its low end, its
      -- fds put in low slots first (src/child/fd_slots.c): none of ours may
      -- leak into it, be closed, or stay duplicated
      local held = {}
      for i = 1, 300 do held[i] = assert(core.fs_open_dir("/")) end
      local before = open_fds()
      local r, w = core.pipe()
      local rs = core.stream_open(r)
      local out = run { args = { "sh", "-c", "ls -1 /proc/$$/fd; echo via >&5" }, stdio = { [5] = w } }
      core.close_fd(w)
      assert.equals("0\n1\n2\n5\n", out)
      assert.equals("via\n", read_all(rs))
      rs:close()
      local failed = core.spawn { args = { "/nonexistent/x" } }
      assert.is_nil(failed)
      assert.equal(before, open_fds())
      for _, fd in ipairs(held) do
        assert.equal("/", core.readlink("/proc/self/fd/" .. fd))
        core.close_fd(fd)
      end
    end)
  end)

  it("starts children with default signal dispositions and an empty mask", function()
    run_task(function()
      -- the runtime itself ignores SIGPIPE (writes to a dead reader fail with EPIPE)
      local ours = tonumber(status_field("self", "SigIgn"), 16)
      assert.equals(SIGPIPE_BIT, bit.band(ours, SIGPIPE_BIT))
      local proc, _, wait = start { args = { "sleep", "100" } }
      local pid = proc:pid()
      assert.equals("0000000000000000", status_field(pid, "SigIgn"))
      assert.equals("0000000000000000", status_field(pid, "SigBlk"))
      assert.equals("0000000000000000", status_field(pid, "SigCgt"))
      proc:kill("KILL")
      assert.same({ 137, 9 }, { wait() })
    end)
  end)

  it("setsid starts a new session led by the child", function()
    run_task(function()
      local ours = stat_of(core.getpid())
      local proc, _, wait = start { args = { "sleep", "100" }, setsid = true }
      local st = stat_of(proc:pid())
      assert.equals(proc:pid(), st.session)
      assert.equals(proc:pid(), st.pgrp)
      assert.are_not.equal(ours.session, st.session)
      proc:kill()
      wait()
    end)
  end)

  it("setpgid starts a new process group in our session", function()
    run_task(function()
      local ours = stat_of(core.getpid())
      local proc, _, wait = start { args = { "sleep", "100" }, setpgid = true }
      local st = stat_of(proc:pid())
      assert.equals(proc:pid(), st.pgrp)
      assert.equals(ours.session, st.session)
      proc:kill()
      wait()
      -- without either: our group, our session
      proc, _, wait = start { args = { "sleep", "100" } }
      st = stat_of(proc:pid())
      assert.equals(ours.pgrp, st.pgrp)
      assert.equals(ours.session, st.session)
      proc:kill()
      wait()
    end)
  end)

  it("core.kill with a negative pid signals the whole process group", function()
    run_task(function()
      local proc, pipes, wait = start {
        args = { "sh", "-c", "sleep 100 & echo $!; sleep 100 & echo $!; wait" },
        setpgid = true, stdio = { [1] = "pipe" },
      }
      local pids = read_lines(pipes[1], 2)
      assert.equals(2, #pids)
      for _, pid in ipairs(pids) do assert.equals(proc:pid(), stat_of(pid).pgrp) end
      assert.is_true(core.kill(-proc:pid(), "SIGTERM"))
      assert.same({ 143, 15 }, { wait() })
      for _, pid in ipairs(pids) do assert.is_true(gone(pid), "pid " .. pid .. " survived") end
      pipes[1]:close()
    end)
  end)

  it("applies rlimits in the child only", function()
    run_task(function()
      local before = run { args = { "sh", "-c", "ulimit -n" } }
      assert.equals("64\n", (run { args = { "sh", "-c", "ulimit -n" }, rlimits = { nofile = 64 } }))
      assert.equals("unlimited\n", (run { args = { "sh", "-c", "ulimit -c" }, rlimits = { core = -1 } }))
      assert.equals(before, (run { args = { "sh", "-c", "ulimit -n" } }))
    end)
  end)

  it("pdeathsig kills the child when the process that spawned it dies", function()
    run_task(function()
      assert.is_true(core.set_child_subreaper(true))
      local build = os.getenv("MOONBOX_BUILD_DIR") or "build"
      local function orphan(extra)
        -- an intermediate luajit spawns `sleep 100` and exits at once
        local code = ([[
          package.cpath = %q .. "/lib/?.so;" .. package.cpath
          local core = require "moonbox.core"
          local p = assert(core.spawn { args = { "sleep", "100" }, env = {}, %s })
          io.write(p:pid(), "\n")
        ]]):format(build, extra)
        -- (a sanitizer build's core.so needs the runtime the tests preload)
        local env = { PATH = PATH, LD_PRELOAD = os.getenv("LD_PRELOAD"), ASAN_OPTIONS = os.getenv("ASAN_OPTIONS") }
        local out, rc = run { args = { "luajit", "-e", code }, env = env }
        assert.equals(0, rc)
        return tonumber(out)
      end
      local reaped = core.spawn_stats().orphans_reaped
      local pid = orphan("pdeathsig = 'SIGKILL'")
      assert.is_true(gone(pid))
      -- without it the orphan lives on (re-parented to us, the subreaper)
      local survivor = orphan("")
      moonbox.sleep(50)
      assert.is_true(helper.pid_alive(survivor))
      assert.equals(core.getpid(), stat_of(survivor).ppid)
      core.kill(survivor, "SIGKILL")
      assert.is_true(gone(survivor))
      while core.spawn_stats().orphans_reaped < reaped + 2 do moonbox.sleep(5) end
      assert.equals(reaped + 2, core.spawn_stats().orphans_reaped)
      assert.is_true(core.set_child_subreaper(false))
    end)
  end)

  it("uid and gid drop privileges", function()
    if core.getuid() ~= 0 then pending("needs root") return end
    run_task(function()
      local out = run { args = { "sh", "-c", "echo $(id -u) $(id -g)" }, uid = 65534, gid = 65534 }
      assert.equals("65534 65534\n", out)
    end)
  end)

  it("many processes at once are all reaped with their own exit codes", function()
    run_task(function()
      local waits = {}
      for i = 1, 20 do
        local _, _, wait = start { args = { "sh", "-c", "exit " .. i } }
        waits[i] = wait
      end
      for i = 1, 20 do assert.same({ i, 0 }, { waits[i]() }) end
      assert.equals(0, core.spawn_stats().running)
    end)
  end)
end)
