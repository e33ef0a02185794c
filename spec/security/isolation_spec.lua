-- Isolation (issue #5): a sandbox with isolation = "namespaces" is its own
-- world. Each attempt to reach outside must fail, with the reason asserted.
local moonbox = require "moonbox"
local core = require "moonbox.core"

local function ns_sandbox(opts)
  opts = opts or {}
  opts.isolation = "namespaces"
  return helper.new_sandbox(opts)
end

local function with_ns(fn, opts)
  opts = opts or {}
  opts.isolation = "namespaces"
  return helper.with_sandbox(fn, opts)
end

describe("isolation: namespaces", function()
  it("reports what is in force", function()
    with_ns(function(sb)
      local info = sb:info()
      assert.equal("namespaces", info.isolation)
      assert.equal("none", info.network)
      assert.same({ "user", "mnt", "pid", "ipc", "uts", "net" }, info.namespaces)
      assert.is_number(info.initPid)
      assert.equal(256 * 1024 * 1024, info.limits.tmpBytes)
    end)
  end)

  it("caps the inodes of every writable tmpfs by its size (one per 8 KiB), not only its bytes", function()
    with_ns(function(sb)
      -- (empty files cost no bytes but host kernel memory each)
      local r = sb:exec("for d in /tmp /root /dev/shm; do stat -f -c %c $d; done")
      assert.equal(("%d\n"):rep(3):format(2048, 2048, 2048), r.stdout)
    end, { limits = { tmpBytes = 16 * 1024 * 1024 } })
  end)

  it("says no_new_privs is set as it is, also without a seccomp filter", function()
    with_ns(function(sb)
      local nnp = sb:exec("grep NoNewPrivs /proc/self/status").stdout
      assert.equal("NoNewPrivs:\t1\n", nnp)
      assert.same({ "none", true }, { sb:info().seccomp, sb:info().noNewPrivs })
    end, { policy = { seccomp = "none" } })
  end)

  it("gives a policy's dev mount a devfs of its own, leaving /dev whole", function()
    with_ns(function(sb)
      -- (the detached host nodes were moved, not copied: /dev/null went to
      -- the second devfs and no shell could start)
      local r = sb:exec("echo a > /dev/null && echo b > /mnt/dev/null && ls /dev/null /mnt/dev/zero && " ..
        "head -c 3 /mnt/dev/zero | od -An -tx1")
      assert.same({ 0, "/dev/null\n/mnt/dev/zero\n 00 00 00\n", "" }, { r.exitCode, r.stdout, r.stderr })
    end, { policy = { mounts = { { type = "dev", dst = "/mnt/dev" } } } })
  end)

  it("gives a second devfs over /dev real device nodes, and a third elsewhere too", function()
    with_ns(function(sb)
      -- (as root the nodes come from the runtime: once bound from the path
      -- of the first devfs, which the second then covered, they were empty
      -- files, and /dev/urandom read nothing)
      local r = sb:exec("stat -c %F /dev/null /dev/urandom /dev2/null /dev2/zero && echo a > /dev/null && " ..
        "head -c 8 /dev/urandom | wc -c && head -c 3 /dev2/zero | od -An -tx1 && cat /dev/null | wc -c")
      assert.same({ 0, "character special file\ncharacter special file\ncharacter special file\n" ..
        "character special file\n8\n 00 00 00\n0\n", "" }, { r.exitCode, r.stdout, r.stderr })
    end, { policy = { mounts = { { type = "dev", dst = "/dev" }, { type = "dev", dst = "/dev2" } } } })
  end)

  it("shares one pid namespace and one filesystem between sessions, and shows nothing else", function()
    with_ns(function(sb)
      local a, b = sb:createSession { id = "a" }, sb:createSession { id = "b" }
      local p = b:startProcess("exec sleep 100")
      a:exec("echo from-a > /tmp/shared")
      assert.equal("from-a\n", b:exec("cat /tmp/shared").stdout)
      -- (the process is bash until it has exec'd sleep: under load, a while)
      local ps, saw_sleep = "", false
      helper.eventually(function()
        ps = a:exec("ps -e -o pid=,comm=").stdout
        saw_sleep = ps:find(" sleep\n") ~= nil
        return saw_sleep
      end, 10000)
      for pid, comm in ps:gmatch("(%d+) ([^\n]+)") do
        assert.truthy(({ ["moonbox-init"] = true, bash = true, ps = true, sleep = true })[comm],
          "a process from outside the sandbox is visible: " .. pid .. " " .. comm)
      end
      assert.matches("^%s*1 moonbox%-init\n", ps)
      assert.is_true(saw_sleep, "b's process is not visible from a: " .. ps)
      p:kill("SIGKILL")
      p:waitForExit(5000)
    end)
  end)

  it("is root inside, mapped to an unprivileged host range (as root) or the invoking user, with its hostname",
    function()
    with_ns(function(sb)
      local r = sb:exec("id -u; cat /proc/self/uid_map; hostname; cat /etc/hostname")
      local uid = core.getuid()
      if uid == 0 then
        local outer, count = r.stdout:match("^0\n%s+0%s+(%d+)%s+(%d+)\n")
        assert.equal(sb.idmap.uid, tonumber(outer))
        assert.is_true(tonumber(outer) > 0)
        assert.equal(65536, tonumber(count))
      else
        assert.matches(("^0\n%%s+0%%s+%d%%s+1\n"):format(uid), r.stdout)
      end
      local tail = "\n" .. sb.id .. "\n" .. sb.id .. "\n"
      assert.equal(tail, r.stdout:sub(-#tail))
    end)
    with_ns(function(sb)
      assert.equal("box\n", sb:exec("hostname").stdout)
    end, { policy = { hostname = "box" } })
  end)

  it("cannot see host files outside the mounts, nor write to the system directories", function()
    local host_secret = helper.mkdtemp() .. "/secret"
    local f = assert(io.open(host_secret, "w"))
    f:write("host only")
    f:close()
    with_ns(function(sb)
      local r = sb:exec("cat " .. host_secret)
      assert.equal(1, r.exitCode)
      assert.matches("No such file or directory", r.stderr)
      r = sb:exec("ls /home /var /etc/shadow")
      assert.equal(2, r.exitCode)
      assert.matches("cannot access '/home'", r.stderr)
      assert.matches("cannot access '/etc/shadow'", r.stderr)
      r = sb:exec("touch /usr/evil; echo x > /etc/passwd; mkdir /newdir")
      assert.matches("touch: cannot touch '/usr/evil': Read%-only file system", r.stderr)
      assert.matches("/etc/passwd: Read%-only file system", r.stderr)
      assert.matches("mkdir: cannot create directory .-/newdir.-: Read%-only file system", r.stderr)
      assert.is_nil(io.open("/usr/evil"))
      -- the private /tmp is not the host's
      sb:exec("echo inside > /tmp/moonbox-isolation-probe")
      assert.is_nil(io.open("/tmp/moonbox-isolation-probe"))
    end)
  end)

  it("refuses mount, ptrace of the runtime, and escapes through /proc", function()
    with_ns(function(sb)
      local r = sb:exec("mkdir -p /tmp/m && mount -t tmpfs x /tmp/m")
      assert.is_true(r.exitCode ~= 0)
      assert.matches("[Pp]ermission denied", r.stderr) -- seccomp: EPERM, whatever mount(8) calls it
      -- the runtime has no pid in here: it cannot be signalled or traced
      r = sb:exec("kill -0 " .. core.getpid() .. " 2>&1; ls /proc/" .. core.getpid() .. " 2>&1 | head -1")
      assert.matches("No such process", r.stdout)
      -- pid 1 is the init (moonbox-init): it reveals nothing of the runtime
      r = sb:exec("ls /proc/1/root/ 2>&1; cat /proc/1/environ 2>&1; tr '\\0' ' ' < /proc/1/cmdline")
      assert.matches("ls: cannot access '/proc/1/root/': Permission denied", r.stdout)
      assert.matches("cat: /proc/1/environ: Permission denied", r.stdout)
      assert.matches("moonbox%-init%s*$", r.stdout)
      assert.is_nil(r.stdout:find("busted", 1, true))
    end)
  end)

  -- As root the init is cloned from the zygote's namespace and enters its
  -- root by a move over that namespace's empty root and chroot, not
  -- pivot_root (src/zygote.c): the classic chroot escape (chroot deeper,
  -- climb "..", chroot ".") must still end in the sandbox's own root, also
  -- from a user namespace of its own, with every capability there.
  it("keeps a chroot escape in its own root, with seccomp off and CAP_SYS_CHROOT", function()
    with_ns(function(sb)
      local escape = "python3 -c \"" .. table.concat({
        "import os",
        "before = sorted(os.listdir('/'))",
        "os.makedirs('/tmp/jail', exist_ok=True)",
        "os.chroot('/tmp/jail')",
        "[os.chdir('..') for _ in range(40)]",
        "os.chroot('.')",
        "after = sorted(os.listdir('/'))",
        "print('same' if after == before else 'escaped: ' + ' '.join(after))",
      }, "; ") .. "\""
      local r = sb:exec(escape)
      assert.same({ 0, "same\n", "" }, { r.exitCode, r.stdout, r.stderr })
      r = sb:exec("unshare -Ur " .. escape)
      assert.same({ 0, "same\n", "" }, { r.exitCode, r.stdout, r.stderr })
      -- nor can a nested user, mount and pid namespace mount a proc without
      -- the masks (as root the namespace holds the zygote's proc, under the
      -- root; while a fully visible proc, it let any namespace below mount
      -- a fresh one: /proc/kallsyms, a writable /proc/sys)
      r = sb:exec("unshare -Urmpf --mount-proc cat /proc/self/stat")
      assert.equal(1, r.exitCode)
      assert.equal("unshare: mount /proc failed: Operation not permitted\n", r.stderr)
      -- and the root stays read-only and mounted where it is
      r = sb:exec("umount -l / 2>&1; touch /x 2>&1; ls /workspace >/dev/null && echo ok")
      assert.matches("Read%-only file system", r.stdout)
      assert.matches("ok\n$", r.stdout)
    end, { policy = { seccomp = "none" } })
  end)

  it("runs pid 1 as moonbox-init, a binary of its own: none of the runtime's memory, environment or fds", function()
    with_ns(function(sb)
      local pid = sb:info().initPid
      local function read(name)
        local f = assert(io.open(("/proc/%d/%s"):format(pid, name), "rb"))
        local s = f:read("*a")
        f:close()
        return s
      end
      -- exec'd (from a sealed memfd copy): no page of the runtime's heap or
      -- libraries is shared copy-on-write with it
      local maps = read("maps")
      assert.truthy(maps:find("/memfd:moonbox-init", 1, true), maps)
      for _, lib in ipairs { "luajit", "libuv", "moonbox/core.so", "libmoonbox", "libwslay", "libseccomp" } do
        assert.is_nil(maps:find(lib, 1, true), lib .. " in\n" .. maps)
      end
      assert.equal("", read("environ"))
      assert.equal("moonbox-init\0", read("cmdline"))
      assert.equal("moonbox-init\n", read("comm"))
      -- stdio, its signalfd, its one socket and the root's lock, which it
      -- holds for the runtime: nothing else of ours
      local fds = {}
      for name in helper.sh("ls /proc/" .. pid .. "/fd"):gmatch("%d+") do fds[#fds + 1] = tonumber(name) end
      table.sort(fds)
      assert.same({ 0, 1, 2, 3, 4, 5 }, fds)
      assert.equal("anon_inode:[signalfd]", helper.sh("readlink /proc/" .. pid .. "/fd/3"))
      assert.truthy(helper.sh("readlink /proc/" .. pid .. "/fd/4"):find("^socket:%["))
      assert.equal(sb.root_canon .. "/.moonbox.lock", helper.sh("readlink /proc/" .. pid .. "/fd/5"))
    end)
  end)

  it("leaks no fd of the runtime into a command", function()
    with_ns(function(sb)
      -- what an external command has open: its stdio, and ls's own dirfd
      local r = sb:exec("ls /proc/self/fd; readlink /proc/self/fd/0")
      assert.equal("0\n1\n2\n3\n/dev/null\n", r.stdout)
      r = sb:startProcess("ls /proc/self/fd")
      r:waitForExit(5000)
      assert.equal("0\n1\n2\n3\n", r:getLogs().stdout)
    end)
  end)

  it("with network = none reaches only its own loopback", function()
    run_task(function()
      -- a listener on the host's loopback
      local port = 10000 + core.getpid() % 20000 -- below the ephemeral range (32768-)
      local server, server_pipes = assert(core.spawn {
        args = { "python3", "-c", ([[
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", %d)); s.listen(5); print("up", flush=True)
while True:
    c, _ = s.accept(); c.sendall(b"host\n"); c.close()]]):format(port) },
        file = "/usr/bin/python3", stdio = { [1] = "pipe" },
      })
      local sb = ns_sandbox()
      local ok, err = pcall(function()
        local connect = ("python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", %d))'"):format(port)
        assert.equal("up", helper.sh("for i in $(seq 100); do " .. connect ..
          " 2>/dev/null && echo up && exit 0; sleep 0.05; done"))
        local r = sb:exec(("python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", %d), 2)'"):format(port))
        assert.equal(1, r.exitCode)
        assert.matches("ConnectionRefusedError", r.stderr)
        local links = sb:exec("ip -o link | cut -d: -f2 | tr -d ' '").stdout
        assert.equal("lo\n", links)
        -- its own loopback works
        local p = sb:startProcess("python3 -m http.server 8765 --bind 127.0.0.1", { cwd = "/tmp" })
        p:waitForPort(8765, { timeout = 10000 })
        assert.equal(0, sb:exec("curl -sf -o /dev/null http://127.0.0.1:8765/").exitCode)
        p:kill("SIGKILL")
        p:waitForExit(5000)
      end)
      sb:destroy()
      server:kill("SIGKILL")
      server_pipes[1]:close()
      if not ok then error(err, 0) end
    end)
  end)

  it("drops capabilities to the policy's bounding set, with no_new_privs", function()
    with_ns(function(sb)
      local r = sb:exec("grep -E '^(CapBnd|CapEff|NoNewPrivs)' /proc/self/status")
      -- Docker's default set: chown dac_override fowner fsetid kill setgid setuid setpcap
      -- net_bind_service net_raw sys_chroot mknod audit_write setfcap
      assert.matches("CapEff:%s+00000000a80425fb\n", r.stdout)
      assert.matches("CapBnd:%s+00000000a80425fb\n", r.stdout)
      assert.matches("NoNewPrivs:%s+1\n", r.stdout)
    end)
    with_ns(function(sb)
      local r = sb:exec("grep CapBnd /proc/self/status")
      assert.matches("CapBnd:%s+0000000000000021\n", r.stdout)
      r = sb:exec("hostname other")
      assert.is_true(r.exitCode ~= 0, "sys_admin is gone: hostname must fail")
      -- info() names them as the default set does, whatever spelling the policy used
      assert.same({ "chown", "kill" }, sb:info().capabilities)
    end, { policy = { capabilities = { "CAP_CHOWN", "kill", "chown" } } })
  end)

  it("reports every exit with its status while other spawns wait on the init's one socket", function()
    with_ns(function(sb)
      -- started back to back: the init sends the first ones' exits while
      -- the runtime waits for later replies on the same socket
      local procs = {}
      for i = 1, 60 do procs[i] = sb:startProcess("exit " .. (i % 50)) end
      for i, p in ipairs(procs) do
        local exit = p:waitForExit(10000)
        assert.equal(i % 50, exit.exitCode)
      end
    end)
  end)

  it("reaps orphans inside: no zombie survives its parent", function()
    with_ns(function(sb)
      sb:exec("( (sleep 0.1; exit 3) & ) ; sleep 0.4")
      assert.equal("0\n", sb:exec("ps -eo stat= | grep -c '^Z' || true").stdout)
    end)
  end)

  it("dies with the runtime: kill -9 of the runtime leaves no process of the sandbox", function()
    run_task(function()
      local root = helper.mkdtemp()
      local script = root .. "/victim.lua"
      local f = assert(io.open(script, "w"))
      f:write(([[
local moonbox = require "moonbox"
local sb = moonbox.getSandbox("victim", { root = %q, isolation = "namespaces" })
local p = sb:startProcess("exec sleep 1000")
sb:createSession { id = "s" }:exec("true")
io.write(sb:info().initPid, " ", p.pid, "\n") io.flush()
moonbox.sleep(100000)
]]):format(root .. "/sb"))
      f:close()
      local proc, pipes = assert(core.spawn {
        args = { os.getenv("MOONBOX_BIN") or "build/moonbox", script }, stdio = { [1] = "pipe" },
        env = { PATH = os.getenv("PATH") },
      })
      local line = require("moonbox.async").await(function(resume)
        local buf = ""
        pipes[1]:read_start(function(_, data)
          buf = buf .. (data or "")
          if not data or buf:find("\n") then pipes[1]:read_stop() resume(buf) end
        end)
      end)
      local init_pid, sleep_pid = line:match("^(%d+) (%d+)")
      assert.is_string(init_pid, "no pids from the script: " .. tostring(line))
      assert.is_true(helper.pid_alive(tonumber(sleep_pid)))
      proc:kill("SIGKILL")
      for _ = 1, 200 do
        if not helper.pid_alive(tonumber(init_pid)) and not helper.pid_alive(tonumber(sleep_pid)) then break end
        moonbox.sleep(10)
      end
      assert.is_false(helper.pid_alive(tonumber(init_pid)))
      assert.is_false(helper.pid_alive(tonumber(sleep_pid)))
      pipes[1]:close()
    end)
  end)

  it("raises ISOLATION_UNAVAILABLE naming the step that failed, and auto does not hide a bad policy", function()
    run_task(function()
      local bad = { mounts = { { type = "bind", src = "/nonexistent/moonbox", dst = "/x" } } }
      local err = helper.error_of(ns_sandbox, { policy = bad })
      assert.equal("ISOLATION_UNAVAILABLE", err.code)
      assert.matches("mount #%d+ %(bind /nonexistent/moonbox %-> /x%)", err.message)
      assert.matches("ENOENT", err.message)
      err = helper.error_of(helper.new_sandbox, { policy = bad })
      assert.equal("ISOLATION_UNAVAILABLE", err.code)
    end)
  end)
end)

describe("isolation: pre-built sandboxes (moonbox.prewarm)", function()
  local prewarm = require "moonbox.sandbox.prewarm"
  local function wait_ready()
    for _ = 1, 300 do
      if prewarm.ready() then return end
      moonbox.sleep(10)
    end
    error("no pre-built sandbox after 3 s")
  end

  it("hands a claimed sandbox its own workspace, hostname and shell, and leaves nothing behind", function()
    run_task(function()
      moonbox.prewarm(true)
      local ok, err = pcall(function()
        wait_ready()
        local sb = ns_sandbox()
        assert.is_false(prewarm.ready()) -- claimed
        local f = assert(io.open(sb.root .. "/workspace/from-host.txt", "w"))
        f:write("host side")
        f:close()
        local r = sb:exec("hostname; pwd; cat from-host.txt; echo; echo $MOONBOX_SANDBOX; ls /tmp | wc -l")
        assert.equal(sb.id .. "\n/workspace\nhost side\n" .. sb.id .. "\n0\n", r.stdout)
        assert.equal("namespaces", sb:info().isolation)
        local s = sb:createSession { id = "second", env = { X = "x" } }
        assert.equal("x /workspace\n", s:exec("echo $X $PWD").stdout)
        local p = sb:startProcess("exec sleep 100")
        local init = sb:info().initPid
        local tree = require "moonbox.process.tree"
        local cgroup = require "moonbox.process.cgroup"
        local cgroup_dir = tree.mode() == "cgroup" and cgroup.base() .. "/" .. sb.cgroup_name
        if cgroup_dir then
          -- the sandbox kept the spare's cgroup: the init and the default
          -- session's shell were born where they belong
          local function cgroup_of(pid)
            local file = assert(io.open("/proc/" .. pid .. "/cgroup"))
            local text = file:read("*a")
            file:close()
            return text:match("0::([^\n]*)")
          end
          local function ends(str, suffix) return str:sub(-#suffix) == suffix end
          assert.is_true(ends(cgroup_of(init), "/" .. sb.cgroup_name))
          local shell_cgroup = cgroup_of(sb.sessions.default.shell.pid)
          assert.truthy(shell_cgroup:find("/" .. sb.cgroup_name .. "/s-default/", 1, true), shell_cgroup)
        end
        sb:destroy()
        assert.equal("killed", p.status)
        assert.is_false(helper.pid_alive(init))
        -- its cgroups go on the thread pool, a moment after destroy returns
        if cgroup_dir then
          assert.is_true(helper.eventually(function()
            local procs = io.open(cgroup_dir .. "/cgroup.procs")
            if procs then procs:close() end
            return procs == nil
          end, 2000))
        end
        -- a policy the pre-built root does not match builds its own
        wait_ready()
        local other = ns_sandbox { policy = { hostname = "h" }, limits = { pids = 100 } }
        assert.is_true(prewarm.ready())
        assert.equal("h\n", other:exec("hostname").stdout)
        other:destroy()
      end)
      moonbox.prewarm(false)
      if not ok then error(err, 0) end
    end)
  end)
end)
