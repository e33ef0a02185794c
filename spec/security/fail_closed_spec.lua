-- Fail closed (issues #13, #14): when a protection cannot be set up the call
-- fails with a clear error, it never quietly runs with less.
--   * isolation = "auto" falls back to "none" only where the kernel refuses
--     user namespaces, says so once, and moonbox serve refuses the fallback
--     unless --allow-unisolated; EMFILE and friends are ISOLATION_UNAVAILABLE;
--   * a root that is /, a system directory, the runtime's home or a
--     non-empty directory moonbox did not make is refused; a failed
--     getSandbox takes back what it made;
--   * destroy removes the whole tree at any depth, or says it could not;
--   * two runtimes never share a root (SANDBOX_IN_USE names the holder).
local moonbox = require "moonbox"
local core = require "moonbox.core"
local fs = require "moonbox.lib.fs"
local userns = require "moonbox.sandbox.userns"

local sh = helper.sh
local BIN = os.getenv("MOONBOX_BIN") or "build/moonbox"

local function q(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

local function exists(path)
  return fs.lstat_beneath("/", path, "in_root") ~= nil
end

local function write(path, data)
  local f = assert(io.open(path, "w"))
  f:write(data)
  f:close()
end

-- run_child(dir, script[, wrap]) -> stdout, stderr of a second runtime
-- running script (a file in dir). wrap(cmd) makes the shell command around
-- it (a lower fd limit, a user namespace). The script prints DONE at its end.
local function run_child(dir, script, wrap)
  local path = dir .. "/child.lua"
  write(path, script .. "\nprint('DONE')\n")
  local cmd = ("%s %s"):format(q(BIN), q(path))
  if wrap then cmd = wrap(cmd) end
  local out = sh(("sh -c %s 2>%s"):format(q(cmd), q(dir .. "/stderr")))
  local f = io.open(dir .. "/stderr")
  local err = f and f:read("*a") or ""
  if f then f:close() end
  return out, err
end

-- The kernel's answer, as the runtime sees it (nil: user namespaces work).
local refused = userns.refused()

describe("fail closed: isolation = \"auto\"", function()
  it("under a low fd limit fails with ISOLATION_UNAVAILABLE naming the cause, never gives isolation none", function()
    local dir = helper.mkdtemp()
    local out, err = run_child(dir, ([[
local moonbox = require "moonbox"
for i = 1, 200 do
  local ok, sb = pcall(moonbox.getSandbox, "emfile-" .. i, { root = %q .. "/r" .. i, isolation = "auto" })
  if not ok then
    print("FAIL " .. i .. " " .. tostring(sb.code) .. " " .. tostring(sb.message))
    break
  end
  print("OK " .. i .. " " .. sb:info().isolation)
end
-- (before the exit, which unmounts a root's disk image)
print("R1 " .. tostring(os.execute("test -d " .. %q .. "/r1/workspace") == 0))
]]):format(dir, dir), function(cmd) return "ulimit -n 64; exec " .. cmd end)
    assert.is_truthy(out:find("\nDONE$") or out:find("^DONE$"), out .. err)
    local made = 0
    for isolation in out:gmatch("OK %d+ (%S+)") do
      made = made + 1
      -- "none" only where the kernel itself refuses user namespaces
      assert.are.equal(refused and "none" or "namespaces", isolation, out)
    end
    local n, code, message = out:match("FAIL (%d+) (%S+) ([^\n]*)")
    if refused then
      -- nothing else runs out: an unisolated sandbox needs no fds of its own
      assert.is_truthy(made > 0, out)
      return
    end
    assert.is_truthy(n, "no sandbox failed under a 64 fd limit:\n" .. out)
    assert.is_truthy(code == "ISOLATION_UNAVAILABLE" or code == "FILESYSTEM_ERROR", out)
    assert.is_truthy(message:find("too many open files", 1, true), message)
    assert.is_truthy(message:find("RLIMIT_NOFILE", 1, true) or message:find("EMFILE", 1, true), message)
    -- the failed call left no directory behind
    assert.is_false(exists(dir .. "/r" .. n))
    assert.is_truthy(out:find("\nR1 true\n", 1, true), out)
    sh("rm -rf " .. q(dir))
  end)

  it("with every fd of the runtime in use, getSandbox fails with a coded error and makes nothing", function()
    local tmp = helper.mkdtemp()
    run_task(function()
      moonbox.getSandbox("fd-warm", { root = tmp .. "/warm", isolation = "auto" }):destroy() -- probed before
      local fds = {}
      while true do
        local fd = core.fs_open_dir("/")
        if not fd then break end
        fds[#fds + 1] = fd
        assert(#fds < 1000000, "no fd limit")
      end
      -- one fd free: it must still not be enough for a sandbox
      core.close_fd(table.remove(fds))
      local ok, err = pcall(moonbox.getSandbox, "fd-starved", { root = tmp .. "/starved", isolation = "auto" })
      for _, fd in ipairs(fds) do core.close_fd(fd) end
      if ok then
        -- the fd was enough after all: then it must be isolated like any other
        assert.are.equal(refused and "none" or "namespaces", err:info().isolation)
        err:destroy()
      else
        assert.is_truthy(err.code == "ISOLATION_UNAVAILABLE" or err.code == "FILESYSTEM_ERROR", tostring(err))
        assert.is_truthy(tostring(err.message):find("too many open files", 1, true), tostring(err))
        assert.is_false(exists(tmp .. "/starved"))
      end
    end)
    sh("rm -rf " .. q(tmp))
  end)

  it("falls back only where the kernel refuses user namespaces, says so once, and serve refuses it", function()
    local dir = helper.mkdtemp()
    -- a user namespace of our own whose user.max_user_namespaces is 0: the
    -- kernel then refuses every user namespace to the runtime inside
    local wrap = not refused and function(cmd)
      return "exec unshare -Ur sh -c " .. q("echo 0 > /proc/sys/user/max_user_namespaces && exec " .. cmd)
    end or nil
    local script = ([[
local moonbox = require "moonbox"
local dir = %q
local a = moonbox.getSandbox("fb-a", { root = dir .. "/a", isolation = "auto" })
local b = moonbox.getSandbox("fb-b", { root = dir .. "/b" })
print("A " .. a:info().isolation .. " " .. a:exec("echo ran").stdout)
print("B " .. b:info().isolation)
print("WHY " .. tostring(a:info().isolationError))
local ok, e = pcall(moonbox.getSandbox, "fb-c", { root = dir .. "/c", isolation = "namespaces" })
print("C " .. tostring(ok) .. " " .. tostring(e.code) .. " " .. tostring(e.message))
local cli = require "moonbox.server.cli"
local argv = { "--listen", "unix:" .. dir .. "/s" .. #arg .. ".sock" }
for _, extra in ipairs(arg) do argv[#argv + 1] = extra end
local server = cli.start(cli.parse(argv))
ok, e = pcall(moonbox.getSandbox, "fb-d", { root = dir .. "/d" })
print("D " .. tostring(ok) .. " " .. (ok and e:info().isolation or tostring(e.code) .. " " .. tostring(e.message)))
print("E " .. moonbox.getSandbox("fb-e", { root = dir .. "/e", isolation = "none" }):info().isolation)
server:close()
for _, sb in ipairs { a, b } do sb:destroy() end
]]):format(dir)
    local out, err = run_child(dir, script, wrap)
    assert.is_truthy(out:find("DONE", 1, true), out .. err)
    assert.is_truthy(out:find("A none ran", 1, true), out)
    assert.is_truthy(out:find("B none", 1, true), out)
    if not refused then
      assert.is_truthy(out:find("WHY user namespaces are limited on this host (user.max_user_namespaces)", 1, true),
        out)
    end
    -- asking for namespaces never falls back
    assert.is_truthy(out:find("C false ISOLATION_UNAVAILABLE ", 1, true), out)
    -- the server refuses what the library allows
    assert.is_truthy(out:find("D false ISOLATION_UNAVAILABLE ", 1, true), out)
    assert.is_truthy(out:find("--allow-unisolated", 1, true), out)
    assert.is_truthy(out:find("E none", 1, true), out)
    assert.is_false(exists(dir .. "/c"))
    assert.is_false(exists(dir .. "/d"))
    -- said once on stderr, however many sandboxes fell back
    local _, warnings = err:gsub("run without isolation", "")
    assert.are.equal(1, warnings, err)

    -- started with --allow-unisolated, the server takes the fallback
    local path = dir .. "/child.lua"
    local cmd = ("%s %s --allow-unisolated"):format(q(BIN), q(path))
    out = sh(("sh -c %s 2>/dev/null"):format(q(wrap and wrap(cmd) or cmd)))
    assert.is_truthy(out:find("D true none", 1, true), out)
    sh("rm -rf " .. q(dir))
  end)
end)

describe("fail closed: sandbox roots", function()
  it("refuses /, system directories (through symlinks too), the home and foreign non-empty directories", function()
    local tmp = helper.mkdtemp()
    sh(("mkdir -p %s/full/sub && echo mine > %s/full/sub/f && ln -s /usr %s/usr-link && ln -s / %s/slash")
      :format(tmp, tmp, tmp, tmp))
    local refused_roots = { "/", "/usr", "/etc", "/bin", "/home", "/var", "/root", "/boot", "/proc", "/sys", "/dev",
      "/usr/../etc", tmp .. "/usr-link", tmp .. "/usr-link/", tmp .. "/slash", tmp .. "/full", tmp }
    local had_workspace = exists("/workspace") -- some hosts have one; then it stays as it was
    run_task(function()
      for i, root in ipairs(refused_roots) do
        local ok, err = pcall(moonbox.getSandbox, "badroot-" .. i, { root = root, isolation = "none" })
        assert.is_false(ok, root)
        assert.are.equal("VALIDATION_FAILED", err.code, root .. ": " .. tostring(err))
        assert.is_truthy(err.message:find(root, 1, true), err.message)
      end
    end)
    -- nothing was made in any of them
    assert.is_false(exists("/.moonbox.lock"))
    assert.are.equal(had_workspace, exists("/workspace"))
    assert.is_false(exists("/usr/.moonbox.lock"))
    assert.is_false(exists(tmp .. "/full/workspace"))
    assert.is_false(exists(tmp .. "/full/.moonbox.lock"))
    assert.are.equal("mine", sh("cat " .. tmp .. "/full/sub/f"))
    sh("rm -rf " .. q(tmp))
  end)

  it("refuses the runtime's home and what holds it", function()
    local tmp = helper.mkdtemp()
    local home = tmp .. "/h/moonbox"
    local dir = helper.mkdtemp()
    local out, err = run_child(dir, ([[
local moonbox = require "moonbox"
for _, root in ipairs { %q, %q, %q } do
  local ok, e = pcall(moonbox.getSandbox, "home-root", { root = root, isolation = "none" })
  print(tostring(ok) .. " " .. tostring(e.code) .. " " .. tostring(e.message))
end
]]):format(home, home .. "/sandboxes", tmp .. "/h"), function(cmd)
      return "MOONBOX_HOME=" .. q(home) .. " exec " .. cmd
    end)
    assert.is_truthy(out:find("DONE", 1, true), out .. err)
    local _, n = out:gsub("false VALIDATION_FAILED [^\n]*runtime's home", "")
    assert.are.equal(3, n, out)
    sh("rm -rf " .. q(tmp) .. " " .. q(dir))
  end)

  it("takes a root it made again, and a root holding only a prepared workspace", function()
    local tmp = helper.mkdtemp()
    sh(("mkdir -p %s/prepared/workspace && echo ready > %s/prepared/workspace/f"):format(tmp, tmp))
    run_task(function()
      local sb = helper.new_sandbox { root = tmp .. "/prepared" }
      assert.are.equal("ready\n", sb:exec("cat f").stdout)
      sb:writeFile("/workspace/g", "kept")
      local id = sb.id
      sb:destroy { keepFiles = true }
      assert.is_true(exists(tmp .. "/prepared/.moonbox.lock"))
      -- reopened over its own old root
      sb = moonbox.getSandbox(id, { root = tmp .. "/prepared", isolation = os.getenv("MOONBOX_TEST_ISOLATION") })
      assert.are.equal("kept", sb:readFile("/workspace/g").content)
      sb:destroy()
      assert.is_false(exists(tmp .. "/prepared"))
    end)
    sh("rm -rf " .. q(tmp))
  end)

  it("refuses, never drops, what only namespaces give when the sandbox has none", function()
    run_task(function()
      for _, case in ipairs {
        { { network = "none" }, "network" },
        { { policy = { mounts = { { type = "tmpfs", dst = "/mnt/t" } } } }, "policy.mounts" },
        { { policy = { hostname = "box" } }, "policy.hostname" },
        { { policy = { network = "none" } }, "policy.network" },
        { { policy = { isolation = "none", network = "none" } }, "policy.network" },
        { { policy = "strict" }, "policy.network" },
      } do
        local opts = case[1]
        opts.isolation = "none"
        local ok, err = pcall(moonbox.getSandbox, "needs-ns", opts)
        assert.is_false(ok)
        assert.same({ "VALIDATION_FAILED", case[2] }, { err.code, err.context.field })
      end
      local sb = moonbox.getSandbox("needs-ns", { isolation = "none", network = "host" })
      assert.same({ "none", "host" }, { sb:info().isolation, sb:info().network })
      sb:destroy()
      -- the caller's network = "host" over a policy's "none" asks for nothing namespaces alone give
      sb = moonbox.getSandbox("needs-ns", { isolation = "none", network = "host", policy = { network = "none" } })
      assert.same({ "none", "host" }, { sb:info().isolation, sb:info().network })
      sb:destroy()
    end)
  end)

  it("a failed getSandbox removes the directories it made", function()
    local tmp = helper.mkdtemp()
    run_task(function()
      -- a policy mount that cannot be made fails the call
      local ok, err = pcall(moonbox.getSandbox, "failed-make", { root = tmp .. "/a/b/c", isolation = "namespaces",
        policy = { mounts = { { type = "bind", src = tmp .. "/missing", dst = "/x" } } } })
      assert.is_false(ok)
      assert.are.equal("ISOLATION_UNAVAILABLE", err.code, tostring(err))
    end)
    assert.is_false(exists(tmp .. "/a"))
    assert.are.equal("", sh("ls -A " .. q(tmp)))
    sh("rm -rf " .. q(tmp))
  end)

  it("a getSandbox failed past its root takes back its cgroup and the root's lock: the root is taken again", function()
    local tmp = helper.mkdtemp()
    local tree = require "moonbox.process.tree"
    local cgroup = require "moonbox.process.cgroup"
    local function own_cgroups()
      local out = {}
      for _, name in ipairs(tree.mode() == "cgroup" and core.readdir(cgroup.base()) or {}) do
        if name:match("^sb%-undo") then out[#out + 1] = name end
      end
      return out
    end
    run_task(function()
      -- the init's mounts fail: after the root, its lock, the cgroup and the limits were made
      local ok, err = pcall(moonbox.getSandbox, "undo", { root = tmp .. "/root", isolation = "namespaces",
        policy = { mounts = { { type = "bind", src = tmp .. "/missing", dst = "/x" } } } })
      assert.is_false(ok)
      assert.are.equal("ISOLATION_UNAVAILABLE", err.code, tostring(err))
      assert.same({}, own_cgroups())
      assert.is_false(exists(tmp .. "/root"))
      local sb = moonbox.getSandbox("undo", { root = tmp .. "/root", isolation = "namespaces" })
      assert.are.equal("hi\n", sb:exec("echo hi").stdout)
      sb:destroy()
    end)
    sh("rm -rf " .. q(tmp))
  end)
end)

describe("fail closed: destroy", function()
  it("removes a 2100-level tree (path > 4096), follows no symlink, and the next sandbox starts empty", function()
    local tmp = helper.mkdtemp()
    local canary = tmp .. "/canary"
    sh("mkdir -p " .. canary .. " && echo precious > " .. canary .. "/file")
    local root = tmp .. "/root"
    run_task(function()
      local sb = helper.new_sandbox { root = root }
      local id = sb.id
      -- two steps of paths under PATH_MAX each (a cd per level is quadratic in bash)
      local r = sb:exec(([[
a=$(printf 'd/%%.0s' $(seq 1000)); b=$(printf 'd/%%.0s' $(seq 1100))
mkdir -p "$a" && cd "$a" && mkdir -p "$b" && cd "$b" || exit 1
echo x > f && ln -s %s link && ln -s %s/file flink && pwd | wc -c]]):format(canary, canary))
      assert.are.equal(0, r.exitCode, r.stderr)
      assert.is_truthy(tonumber(r.stdout) > 4096, r.stdout)
      sb:destroy()
      assert.is_false(exists(root))
      assert.are.equal("precious", sh("cat " .. canary .. "/file"))
      sb = moonbox.getSandbox(id, { root = root, isolation = os.getenv("MOONBOX_TEST_ISOLATION") })
      assert.are.equal("", sb:exec("ls -A").stdout) -- a session starts in the workspace
      sb:destroy()
    end)
    sh("rm -rf " .. q(tmp))
  end)

  it("a removal that fails is an error, not silence", function()
    -- a mount point cannot be removed: made in a mount namespace of a second
    -- runtime's own (unshare -Urm), so root and unprivileged runs alike
    local dir = helper.mkdtemp()
    local out, err = run_child(dir, ([[
local moonbox = require "moonbox"
local root = %q
local sb = moonbox.getSandbox("busy", { root = root, isolation = "none" })
assert(sb:exec("mkdir -p a/b && echo x > a/b/f").exitCode == 0)
assert(os.execute("mount -t tmpfs tmpfs " .. root .. "/workspace/a/b") == 0)
local ok, e = pcall(sb.destroy, sb)
print("DESTROY " .. tostring(ok) .. " " .. tostring(e.code) .. " " .. tostring(e.context.errno) .. " " ..
  tostring(e.message))
print("DESTROYED " .. tostring(sb.destroyed))
]]):format(dir .. "/root"), function(cmd) return "exec unshare -Urm " .. cmd end)
    assert.is_truthy(out:find("DONE", 1, true), out .. err)
    assert.is_truthy(out:find("DESTROY false FILESYSTEM_ERROR EBUSY destroy could not remove the sandbox's files: ",
      1, true), out)
    assert.is_truthy(out:find("DESTROYED true", 1, true), out)
    sh("rm -rf " .. q(dir))
  end)

  it("a sandbox's unreadable or unwritable directories do not stop destroy", function()
    local tmp = helper.mkdtemp()
    local root = tmp .. "/root"
    run_task(function()
      local sb = helper.new_sandbox { root = root }
      local r = sb:exec("mkdir -p x/y z && touch x/y/f z/g && chmod 000 x/y && chmod 555 x && chmod 000 z")
      assert.are.equal(0, r.exitCode, r.stderr)
      sb:destroy()
      assert.is_false(exists(root))
    end)
    sh("rm -rf " .. q(tmp))
  end)

  it("a root replaced meanwhile is not removed, and destroy says so", function()
    local tmp = helper.mkdtemp()
    local root = tmp .. "/root"
    run_task(function()
      -- a plain directory (no disk image: an unprivileged runtime's, or
      -- diskBytes = 0); a root that is its image's mount cannot be renamed
      -- (EBUSY), and its replacement by another mount is the next test
      local sb = helper.new_sandbox { root = root, limits = { diskBytes = 0 } }
      sb:writeFile("/workspace/f", "old")
      sh(("mv %s %s.old && mkdir -p %s/workspace && echo new > %s/workspace/f"):format(root, root, root, root))
      local err = helper.error_of(sb.destroy, sb)
      assert.are.equal("FILESYSTEM_ERROR", err.code)
      assert.is_truthy(err.message:find("replaced", 1, true), err.message)
    end)
    assert.are.equal("new", sh("cat " .. q(root .. "/workspace/f")))
    assert.are.equal("old", sh("cat " .. q(root .. ".old/workspace/f")))
    sh("rm -rf " .. q(tmp))
  end)

  it("a root whose disk image is covered by another mount meanwhile is not removed, and destroy says so", function()
    if not require("moonbox.sandbox.disk").host_root() then
      pending("needs the host's root (loop devices, mount): no disk image here")
    end
    local tmp = helper.mkdtemp()
    local root = tmp .. "/root"
    local image
    run_task(function()
      local sb = helper.new_sandbox { root = root, limits = { diskBytes = 32 * 1024 * 1024 } }
      assert.equal("ext4 image (loop mount)", sb:info().enforcement.diskBytes)
      sb:writeFile("/workspace/f", "old")
      image = sh("cat /sys/block/$(basename \"$(findmnt -no SOURCE " .. q(root) .. ")\")/loop/backing_file")
      assert.is_truthy(image:find("/disks/", 1, true), image)
      sh(("mkdir -p %s/new/workspace && echo new > %s/new/workspace/f && mount --bind %s/new %s")
        :format(q(tmp), q(tmp), q(tmp), q(root)))
      local err = helper.error_of(sb.destroy, sb)
      assert.are.equal("FILESYSTEM_ERROR", err.code)
      assert.is_truthy(err.message:find("replaced", 1, true), err.message)
    end)
    assert.are.equal("new", sh("cat " .. q(root .. "/workspace/f")))
    sh("umount " .. q(root))
    assert.are.equal("old", sh("cat " .. q(root .. "/workspace/f"))) -- the image, untouched
    sh("umount " .. q(root) .. " && rm -rf " .. q(tmp))
    assert.are.equal("", sh("losetup -j " .. q(image)))
  end)
end)

describe("fail closed: one runtime per root", function()
  it("a second runtime's getSandbox of a held root raises SANDBOX_IN_USE naming the holder's pid", function()
    local tmp = helper.mkdtemp()
    local root = tmp .. "/root"
    local script = ([[
local moonbox = require "moonbox"
local ok, e = pcall(moonbox.getSandbox, "shared", { root = %q, isolation = "none" })
if ok then
  print("GOT " .. e:exec("cat mine || echo none").stdout)
  e:destroy()
else
  print("ERR " .. tostring(e.code) .. " " .. tostring(e.context.pid) .. " " .. tostring(e.message))
end
]]):format(root)
    run_task(function()
      local sb = helper.new_sandbox { root = root }
      sb:writeFile("/workspace/mine", "held")
      local out, err = run_child(tmp, script)
      assert.is_truthy(out:find("ERR SANDBOX_IN_USE " .. core.getpid() .. " ", 1, true), out .. err)
      assert.is_truthy(out:find("pid " .. core.getpid(), 1, true), out)
      -- the other runtime's failure touched nothing of ours
      assert.are.equal("held", sb:readFile("/workspace/mine").content)
      sb:destroy { keepFiles = true }
      -- released at destroy: the other runtime may have it now
      out, err = run_child(tmp, script)
      assert.is_truthy(out:find("GOT held", 1, true), out .. err)
    end)
    assert.is_false(exists(root))
    sh("rm -rf " .. q(tmp))
  end)

  -- Under namespaces the sandbox's init holds the lock (no fd of the
  -- runtime's); its death releases it.
  local function held_script(root, go)
    return ([[
local moonbox = require "moonbox"
local ok, e = pcall(moonbox.getSandbox, "shared", { root = %q, isolation = "none" })
if not ok then print("ERR " .. tostring(e.code)) return end
print("HELD") io.stdout:flush()
while not io.open(%q) do moonbox.sleep(20) end
e:writeFile("/workspace/theirs", "theirs")
-- (seen from the host now: at its exit this runtime unmounts the root's disk image)
local f = io.open(%q .. "/workspace/theirs")
print(f and "THEIRS " .. f:read("*a") or "NONE") io.stdout:flush()
e:destroy { keepFiles = true }
]]):format(root, go, root)
  end

  it("stays held across a killed and rebuilt init", function()
    local tmp = helper.mkdtemp()
    local root = tmp .. "/root"
    local script = ([[
local moonbox = require "moonbox"
local ok, e = pcall(moonbox.getSandbox, "shared", { root = %q, isolation = "none" })
print(ok and "GOT" or ("ERR " .. tostring(e.code)))
if ok then e:destroy { keepFiles = true } end
]]):format(root)
    run_task(function()
      local sb = helper.new_sandbox { root = root }
      if not sb.init then sb:destroy() pending("no init without namespaces") end
      sb:writeFile("/workspace/mine", "held")
      local out, err = run_child(tmp, script)
      assert.is_truthy(out:find("ERR SANDBOX_IN_USE", 1, true), out .. err)
      assert.equal(0, os.execute("kill -9 " .. sb:info().initPid) and 0 or 1)
      assert.is_true(helper.eventually(function() return sb.init_dead end, 10000))
      pcall(sb.exec, sb, "true") -- SANDBOX_RESTARTED, reported once
      assert.equal("held", sb:exec("cat mine").stdout)
      -- the rebuilt sandbox took the lock again
      out, err = run_child(tmp, script)
      assert.is_truthy(out:find("ERR SANDBOX_IN_USE", 1, true), out .. err)
      sb:destroy { keepFiles = true }
      out, err = run_child(tmp, script)
      assert.is_truthy(out:find("GOT", 1, true), out .. err)
    end)
    sh("rm -rf " .. q(tmp))
  end)

  it("taken by another runtime while our init was dead: no rebuild, and destroy keeps its files", function()
    local tmp = helper.mkdtemp()
    local root = tmp .. "/root"
    local go = tmp .. "/go"
    run_task(function()
      local sb = helper.new_sandbox { root = root }
      if not sb.init then sb:destroy() pending("no init without namespaces") end
      sb:writeFile("/workspace/mine", "held")
      assert.equal(0, os.execute("kill -9 " .. sb:info().initPid) and 0 or 1)
      assert.is_true(helper.eventually(function() return sb.init_dead end, 10000))
      -- the root is free: another runtime takes it and holds it
      write(tmp .. "/held.lua", held_script(root, go))
      sh(("(%s %s > %s 2>&1 &)"):format(q(BIN), q(tmp .. "/held.lua"), q(tmp .. "/held.out")))
      assert.is_true(helper.eventually(function()
        local f = io.open(tmp .. "/held.out")
        local got = f and f:read("*a") or ""
        if f then f:close() end
        return got:find("HELD", 1, true) ~= nil
      end, 10000))
      pcall(sb.exec, sb, "true") -- SANDBOX_RESTARTED, reported once
      local err = helper.error_of(sb.exec, sb, "true")
      assert.equal("SANDBOX_IN_USE", err.code)
      err = helper.error_of(sb.destroy, sb, { keepFiles = false })
      assert.equal("SANDBOX_IN_USE", err.code)
      -- the other runtime's files are untouched, and it goes on
      assert.is_true(exists(root .. "/workspace/mine"))
      write(go, "")
      assert.is_true(helper.eventually(function()
        local f = io.open(tmp .. "/held.out")
        local got = f and f:read("*a") or ""
        if f then f:close() end
        return got:find("THEIRS theirs", 1, true) ~= nil
      end, 10000))
    end)
    sh("rm -rf " .. q(tmp))
  end)
end)
