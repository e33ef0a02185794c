-- Who root inside a sandbox is on the host (issue #13): as root the runtime
-- maps a sandbox's ids to an unprivileged range, so root inside passes no
-- permission check on the host's files and sysctls; /proc is masked, every
-- writable tmpfs is sized, the user namespace's own counters cap what the
-- sandbox takes from the runtime user's kernel quotas, io_uring is denied.
-- Run as root and (spec/run-unprivileged.sh) as nobody: each assertion says
-- what holds in that mode.
local moonbox = require "moonbox"
local core = require "moonbox.core"
local ffi = require "ffi"
local isolation = require "moonbox.sandbox.isolation"

pcall(ffi.cdef, "int inotify_init1(int flags); int close(int fd);")

local ROOT = core.getuid() == 0

local function with_ns(fn, opts)
  opts = opts or {}
  opts.isolation = "namespaces"
  return helper.with_sandbox(fn, opts)
end

local function words(s) return (s:gsub("%s+", " "):gsub("^ ", ""):gsub(" $", "")) end

local function read_file(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("*a")
  f:close()
  return s
end

local function write_file(path, data)
  local f = assert(io.open(path, "wb"))
  f:write(data)
  f:close()
end

describe("root identity", function()
  it("maps root inside to an unprivileged host range as root, to the invoking user otherwise", function()
    with_ns(function(sb)
      local r = sb:exec("id -u; id -g; cat /proc/self/uid_map /proc/self/gid_map")
      assert.equal(0, r.exitCode)
      local uid, gid, u_in, u_out, u_count, g_in, g_out, g_count = r.stdout:match(
        "^(%d+)\n(%d+)\n%s*(%d+)%s+(%d+)%s+(%d+)\n%s*(%d+)%s+(%d+)%s+(%d+)\n$")
      assert.equal("0", uid)
      assert.equal("0", gid)
      assert.equal("0", u_in)
      assert.equal("0", g_in)
      local info = sb:info()
      assert.same(sb.idmap, info.idmap)
      assert.equal(sb.idmap.uid, tonumber(u_out))
      assert.equal(sb.idmap.gid, tonumber(g_out))
      if ROOT then
        assert.is_true(tonumber(u_out) > 0 and tonumber(g_out) > 0)
        assert.equal(65536, tonumber(u_count))
        assert.equal(65536, tonumber(g_count))
        assert.same({ uid = tonumber(u_out), gid = tonumber(g_out), count = 65536 }, sb.idmap)
      else
        assert.same({ core.getuid(), core.getgid(), 1, 1 },
          { tonumber(u_out), tonumber(g_out), tonumber(u_count), tonumber(g_count) })
        assert.same({ uid = core.getuid(), gid = core.getgid(), count = 1 }, sb.idmap)
      end
      -- the runtime's supplementary groups stay outside
      local groups = sb:exec("grep '^Groups:' /proc/self/status").stdout
      if ROOT then assert.equal("Groups:", (groups:gsub("%s+$", ""))) end
      -- the capability set is the policy's (default: Docker's), and shown
      assert.same(isolation.DEFAULT_CAPABILITIES, info.capabilities)
      local bnd = sb:exec("grep '^CapBnd:' /proc/self/status").stdout:match("CapBnd:%s+(%x+)")
      local want = 0ULL
      for _, n in ipairs(isolation.cap_numbers(isolation.DEFAULT_CAPABILITIES)) do
        want = bit.bor(want, bit.lshift(1ULL, n))
      end
      assert.equal(tonumber(want), tonumber(bnd, 16))
    end)
  end)

  it("takes a policy's idmap, and refuses one that would map host root", function()
    if ROOT then
      with_ns(function(sb)
        assert.equal("0 3000000000 70000", words(sb:exec("cat /proc/self/uid_map").stdout))
        assert.same({ uid = 3000000000, gid = 3000100000, count = 70000 }, sb:info().idmap)
        assert.equal("0 3000100000 70000", words(sb:exec("cat /proc/self/gid_map").stdout))
      end, { policy = { idmap = { uid = 3000000000, gid = 3000100000, count = 70000 } } })
    end
    run_task(function()
      for _, bad in ipairs { { uid = 0 }, { uid = -5 }, { uid = 4294967000 }, { uid = 5, count = 0 }, { gid = 7 },
        { uid = 1.5 }, { colour = 1 } } do
        local err = helper.error_of(moonbox.getSandbox, "idmap-bad", { isolation = "namespaces", root = "/nonexistent",
          policy = { idmap = bad } })
        assert.equal("VALIDATION_FAILED", err.code)
        assert.matches("policy%.idmap", err.message)
      end
    end)
  end)

  it("takes the range from /etc/subuid and /etc/subgid for the configured user, as root", function()
    local dir = helper.mkdtemp()
    local files = { isolation.SUBUID_FILE, isolation.SUBGID_FILE }
    local ok, err = pcall(function()
      write_file(dir .. "/subuid", "# comment\nalice:100000:65536\nmoonbox:300000:1000\nmoonbox:400000:131072\n")
      write_file(dir .. "/subgid", "moonbox:500000:65536\nbob:600000:65536\n")
      isolation.SUBUID_FILE, isolation.SUBGID_FILE = dir .. "/subuid", dir .. "/subgid"
      if ROOT then
        -- the first range of the user with 65536 ids or more; count: what both give
        assert.same({ uid = 400000, gid = 500000, count = 65536 }, isolation.idmap({}))
        -- alice has no subgid range: the fixed one
        assert.same(isolation.DEFAULT_IDMAP, isolation.idmap({ idmap = { user = "alice" } }))
        assert.same({ uid = 7, gid = 7, count = 65536 }, isolation.idmap({ idmap = { uid = 7 } }))
      else
        assert.same({ uid = core.getuid(), gid = core.getgid(), count = 1 }, isolation.idmap({}))
      end
    end)
    isolation.SUBUID_FILE, isolation.SUBGID_FILE = files[1], files[2]
    os.execute("rm -rf '" .. dir .. "'")
    if not ok then error(err, 0) end
  end)

  it("gives root inside the workspace and everything the runtime makes for its shells", function()
    with_ns(function(sb)
      local r = sb:exec("touch /workspace/mine && ls -lnd /workspace /workspace/mine | awk '{print $3, $4}'; " ..
        "find /run/moonbox -mindepth 1 -printf '%U %G\\n' | sort -u")
      assert.equal(0, r.exitCode)
      assert.equal("0 0\n0 0\n0 0\n", r.stdout)
      -- on the host the same files belong to the mapped ids
      assert.equal(("%d %d"):format(sb.idmap.uid, sb.idmap.gid),
        helper.sh("stat -c '%u %g' '" .. sb.workspace .. "/mine'"))
      -- /dev cannot be rearranged for the runtime's open of /dev/ptmx (terminals)
      local dev = sb:exec("ln -sf /etc/passwd /dev/ptmx; touch /dev/x; ls -l /dev/ptmx")
      assert.matches("/dev/ptmx'?: Read%-only file system", dev.stderr)
      assert.matches("/dev/x.*Read%-only file system", dev.stderr)
      assert.matches("/dev/ptmx %-> pts/ptmx\n$", dev.stdout)
      assert.equal("shm-ok\n", sb:exec("echo shm-ok > /dev/shm/f && cat /dev/shm/f").stdout)
      -- stdio the runtime made is reopenable by name inside
      assert.equal("via-dev\n", sb:exec("echo via-dev > /dev/stdout").stdout)
      local p = sb:startProcess("echo from-bg > /dev/stderr")
      p:waitForExit(10000)
      assert.equal("from-bg\n", p:getLogs().stderr)
      -- a shell keeps working when something inside takes the names it uses next
      local passwd = read_file("/etc/passwd")
      sb:exec("for d in /run/moonbox/sh-*; do for n in stdout stderr stdin prelude; do " ..
        "ln -sf /etc/passwd $d/$n; done; done; true")
      assert.equal("still\n", sb:exec("echo still").stdout)
      assert.equal(passwd, read_file("/etc/passwd"))
      -- (from outside the shell, so the names are there when its next command starts)
      local planter = sb:startProcess("for d in /run/moonbox/sh-*; do for n in stdout stderr stdin prelude; do " ..
        "rm -f $d/$n; ln -s /etc/passwd $d/$n; done; done; ls -l /run/moonbox/sh-*/stdin")
      planter:waitForExit(10000)
      assert.matches("stdin %-> /etc/passwd", planter:getLogs().stdout)
      local r2 = sb:exec("cat; echo err >&2", { stdin = "from stdin\n" })
      assert.same({ 0, "from stdin\n", "err\n" }, { r2.exitCode, r2.stdout, r2.stderr })
      assert.equal(passwd, read_file("/etc/passwd"))
    end)
  end)

  it("passes no permission check on the host's files as root: a bound host directory stays the host's", function()
    local dir = helper.mkdtemp()
    write_file(dir .. "/f", "host\n")
    os.execute("chmod 0755 '" .. dir .. "' && chmod 0644 '" .. dir .. "/f'")
    local ok, err = pcall(with_ns, function(sb)
      local r = sb:exec("ls -ln /hostdir | awk 'NR > 1 {print $3, $4}'; echo x >> /hostdir/f; echo rc=$?; " ..
        "touch /hostdir/new; echo rc=$?; chmod 0666 /hostdir/f; echo rc=$?")
      if ROOT then
        -- host root's files are nobody's inside, and root inside gets only "other" permissions on them
        assert.equal("65534 65534\nrc=1\nrc=1\nrc=1\n", r.stdout)
        assert.matches("/hostdir/f: Permission denied", r.stderr)
        assert.equal("host\n", read_file(dir .. "/f"))
        assert.is_nil(read_file(dir .. "/new"))
      else
        -- root inside is the invoking user: its own files are root inside's
        assert.equal("0 0\nrc=0\nrc=0\nrc=0\n", r.stdout)
      end
    end, { policy = { mounts = { { type = "bind", src = dir, dst = "/hostdir" } } } })
    os.execute("rm -rf '" .. dir .. "'")
    if not ok then error(err, 0) end
  end)

  it("stops the core_pattern attack: the write fails and nothing runs on the host", function()
    local saved = read_file("/proc/sys/kernel/core_pattern")
    local marker_dir = helper.mkdtemp()
    local ok, err = pcall(with_ns, function(sb)
      local script = "#!/bin/sh\ntouch " .. marker_dir .. "/ran /workspace/ran\n"
      local r = sb:exec("printf '%s' '" .. script .. "' > /workspace/pwn.sh && chmod +x /workspace/pwn.sh && " ..
        "echo '|/proc/%P/root/workspace/pwn.sh' > /proc/sys/kernel/core_pattern; echo rc=$?; " ..
        "(ulimit -c unlimited; sh -c 'kill -SEGV $$'); true")
      assert.matches("rc=1\n", r.stdout)
      assert.matches("core_pattern: Read%-only file system", r.stderr)
      assert.equal(saved, read_file("/proc/sys/kernel/core_pattern"))
      -- whatever the host's core_pattern runs, give it time to have run
      moonbox.sleep(200)
      assert.is_nil(read_file(marker_dir .. "/ran"))
      assert.is_nil(read_file(sb.workspace .. "/ran"))
    end)
    if ROOT and read_file("/proc/sys/kernel/core_pattern") ~= saved then
      write_file("/proc/sys/kernel/core_pattern", saved)
    end
    os.execute("rm -rf '" .. marker_dir .. "'")
    if not ok then error(err, 0) end
  end)

  it("makes the global parts of /proc read-only and hides the kernel's internals; /sys is absent", function()
    with_ns(function(sb)
      -- each read-only path is a mount of its own, read-only, and refuses writes
      local mountinfo = sb:exec("cat /proc/self/mountinfo").stdout
      for _, name in ipairs(isolation.PROC_READONLY) do
        if sb:exec("test -e /proc/" .. name).exitCode == 0 then
          local opts = mountinfo:match("%S+ %S+ %S+ %S+ /proc/" .. name:gsub("%-", "%%-") .. " (%S+)")
          assert.is_string(opts, name)
          assert.matches("^ro,", opts, name)
        end
      end
      for _, path in ipairs { "/proc/sys/kernel/core_pattern", "/proc/sys/kernel/hostname", "/proc/sys/vm/drop_caches",
        "/proc/sys/fs/file-max", "/proc/sys/user/max_inotify_instances", "/proc/sysrq-trigger",
        "/proc/irq/default_smp_affinity" } do
        local r = sb:exec("test -e " .. path .. " || exit 77; echo 1 > " .. path)
        if r.exitCode ~= 77 then
          assert.equal(1, r.exitCode, path)
          assert.matches("Read%-only file system", r.stderr, path)
        end
      end
      assert.equal(1, sb:exec("touch /proc/bus/x /proc/fs/x 2>/dev/null").exitCode)
      -- hidden ones read empty and refuse writes
      local seen = 0
      for _, name in ipairs(isolation.PROC_MASKED) do
        local path = "/proc/" .. name
        local r = sb:exec(("test -e %s || exit 77; if test -d %s; then ls -A %s; else cat %s; fi"):format(
          path, path, path, path))
        if r.exitCode ~= 77 then
          seen = seen + 1
          assert.same({ 0, "" }, { r.exitCode, r.stdout }, path)
          assert.are_not.equal(0, sb:exec("echo x > " .. path .. " || touch " .. path .. "/x").exitCode, path)
        end
      end
      assert.is_true(seen >= 3) -- keys, timer_list, kallsyms exist on every kernel moonbox runs on
      assert.are_not.equal(0, sb:exec("ls /sys").exitCode)
    end)
  end)

  it("sizes every writable tmpfs by tmpBytes: /dev/shm, /tmp, /root, /run/moonbox", function()
    with_ns(function(sb)
      for _, dir in ipairs { "/dev/shm", "/tmp", "/root", "/run/moonbox" } do
        local r = sb:exec("head -c 1073741824 /dev/zero > " .. dir .. "/fill; echo rc=$?; " ..
          "wc -c < " .. dir .. "/fill; rm -f " .. dir .. "/fill")
        assert.matches("No space left on device", r.stderr, dir)
        local rc, size = r.stdout:match("^rc=(%d+)\n(%d+)\n$")
        assert.equal("1", rc, dir)
        assert.is_true(tonumber(size) <= 16 * 1024 * 1024, dir)
      end
      assert.equal("ok\n", sb:exec("echo ok").stdout) -- its shell still works
    end, { limits = { tmpBytes = 16 * 1024 * 1024 } })
  end)

  it("caps the inotify instances a sandbox takes: the host can still inotify_init", function()
    local hold = "import ctypes, time\nlibc = ctypes.CDLL(None, use_errno=True)\nfds = []\n" ..
      "while len(fds) < 100000:\n    fd = libc.inotify_init1(0)\n    if fd < 0: break\n    fds.append(fd)\n" ..
      "print(len(fds), ctypes.get_errno(), flush=True)\ntime.sleep(120)\n"
    with_ns(function(sb)
      sb:exec("cat > /tmp/hold.py <<'EOF'\n" .. hold .. "EOF")
      local p = sb:startProcess("python3 /tmp/hold.py")
      assert.is_true(helper.eventually(function() return p:getLogs().stdout:match("\n") ~= nil end, 20000))
      local count, errno = p:getLogs().stdout:match("^(%d+) (%d+)\n$")
      assert.equal(4, tonumber(count)) -- the policy's max_inotify_instances
      assert.equal(24, tonumber(errno)) -- EMFILE
      local fd = ffi.C.inotify_init1(0)
      assert.is_true(fd >= 0)
      ffi.C.close(fd)
      p:kill("SIGKILL")
      p:waitForExit(10000)
    end, { policy = { userns = { max_inotify_instances = 4 } } })
    with_ns(function(sb)
      sb:exec("cat > /tmp/hold.py <<'EOF'\n" .. hold .. "EOF")
      local p = sb:startProcess("python3 /tmp/hold.py")
      assert.is_true(helper.eventually(function() return p:getLogs().stdout:match("\n") ~= nil end, 20000))
      local count = tonumber(p:getLogs().stdout:match("^(%d+)"))
      assert.is_true(count >= 1 and count <= isolation.DEFAULT_USERNS.max_inotify_instances)
      assert.equal(isolation.DEFAULT_USERNS.max_inotify_instances .. "\n",
        sb:exec("cat /proc/sys/user/max_inotify_instances").stdout)
      local fd = ffi.C.inotify_init1(0)
      assert.is_true(fd >= 0)
      ffi.C.close(fd)
      p:kill("SIGKILL")
      p:waitForExit(10000)
    end)
    run_task(function()
      local err = helper.error_of(moonbox.getSandbox, "userns-bad", { isolation = "namespaces", root = "/nonexistent",
        policy = { userns = { max_inotify_instances = -1 } } })
      assert.equal("VALIDATION_FAILED", err.code)
      err = helper.error_of(moonbox.getSandbox, "userns-bad", { isolation = "namespaces", root = "/nonexistent",
        policy = { userns = { max_everything = 1 } } })
      assert.equal("VALIDATION_FAILED", err.code)
    end)
  end)

  -- hardening finding 8: each sandbox's user namespace was owned by host
  -- root, so what it used counted against root's 128 instances: four
  -- sandboxes at their cap of 32 left host root and every other sandbox
  -- none (watch() makes its instance in the runtime). As root each sandbox
  -- now has an owner id of its own (isolation.owner_uid). An unprivileged
  -- runtime can only be charged as itself: its sandboxes share its user's
  -- quota (docs/isolation.md), which this case does not claim.
  it("four sandboxes at their inotify cap leave host root and a fifth sandbox their instances", function()
    if not ROOT then
      assert.is_nil(isolation.owner_uid({ uid = core.getuid(), gid = core.getgid(), count = 1 }))
      return
    end
    local hold = "import ctypes, time\nlibc = ctypes.CDLL(None, use_errno=True)\nfds = []\n" ..
      "while len(fds) < 100000:\n    fd = libc.inotify_init1(0)\n    if fd < 0: break\n    fds.append(fd)\n" ..
      "print(len(fds), ctypes.get_errno(), flush=True)\ntime.sleep(120)\n"
    run_task(function()
      local boxes, procs, owners = {}, {}, {}
      local ok, err = pcall(function()
        for i = 1, 4 do
          local sb = helper.new_sandbox { isolation = "namespaces" }
          boxes[i] = sb
          owners[sb.owner_uid or 0] = true
          sb:exec("cat > /tmp/hold.py <<'EOF'\n" .. hold .. "EOF")
          procs[i] = sb:startProcess("python3 /tmp/hold.py")
          assert.is_true(helper.eventually(function() return procs[i]:getLogs().stdout:match("\n") ~= nil end, 20000))
          local count, errno = procs[i]:getLogs().stdout:match("^(%d+) (%d+)\n$")
          -- each got to its own cap (less what its shell holds), then EMFILE
          assert.is_true(tonumber(count) >= isolation.DEFAULT_USERNS.max_inotify_instances - 4, count)
          assert.equal(24, tonumber(errno))
        end
        -- host root can still make instances: more than the four took together
        local fds = {}
        for i = 1, 8 do
          fds[i] = ffi.C.inotify_init1(0)
          assert.is_true(fds[i] >= 0, "host root's inotify_init1 failed at " .. i)
        end
        for _, fd in ipairs(fds) do ffi.C.close(fd) end
        -- and a calm fifth sandbox watches
        local sb = helper.new_sandbox { isolation = "namespaces" }
        boxes[5] = sb
        sb:mkdir("w")
        local it = sb:watch("w")
        sb:exec("touch w/seen")
        local ev = it()
        assert.equal("create", ev.type)
        assert.equal("/workspace/w/seen", ev.path)
        it:close()
        local n = 0
        for uid in pairs(owners) do
          n = n + 1
          local ids = isolation.OWNER_IDS
          assert.is_true(uid >= ids.first and uid < ids.first + ids.count)
        end
        assert.equal(4, n) -- an owner each
      end)
      for _, p in ipairs(procs) do pcall(p.kill, p, "SIGKILL") end
      for _, sb in ipairs(boxes) do sb:destroy() end
      if not ok then error(err, 0) end
    end)
  end)

  it("denies io_uring under the default seccomp profile", function()
    with_ns(function(sb)
      local r = sb:exec("python3 -c '" ..
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nbuf = ctypes.create_string_buffer(120)\n" ..
        "for nr in (425, 426, 427):\n" ..
        "    rc = libc.syscall(nr, 4, buf) if nr == 425 else libc.syscall(nr, 0, 0, 0, 0, 0)\n" ..
        "    print(nr, rc, ctypes.get_errno())'")
      assert.equal("425 -1 1\n426 -1 1\n427 -1 1\n", r.stdout) -- EPERM, the profile's deny action
    end)
  end)
end)
