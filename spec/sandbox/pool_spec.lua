-- The pool of pre-built sandboxes (lua/moonbox/sandbox/prewarm.lua,
-- moonbox.prewarm(n)): n spares kept, each in namespaces of its own, a
-- burst of n getSandbox calls claims them all, the pool fills again one at
-- a time, and prewarm(0) leaves no spare process, cgroup or mount behind.
-- As the host's root a spare also holds its disk image, made, attached and
-- mounted ahead: a claimed spare's root is that disk (its quota holds), its
-- first exec runs in the shell started with it, and disabling the pool, the
-- runtime's exit, or the next runtime after a crash leaves no image, loop
-- device or mount of it.
local moonbox = require "moonbox"
local core = require "moonbox.core"
local util = require "moonbox.lib.util"
local policy_mod = require "moonbox.policy"
local prewarm = require "moonbox.sandbox.prewarm"
local tree = require "moonbox.process.tree"
local cgroup = require "moonbox.process.cgroup"

local POOL = 3

local function pid_ns(pid) return core.readlink("/proc/" .. pid .. "/ns/pid") end

-- pid namespace -> our child processes in it, for every namespace but ours:
-- a spare is its init (our child) with its shell under it, in a pid
-- namespace of their own.
local function foreign_namespaces()
  local mine = pid_ns(core.getpid())
  local namespaces, n = {}, 0
  for _, kid in ipairs(helper.children()) do
    local ns = pid_ns(kid.pid)
    if ns and ns ~= mine then
      if not namespaces[ns] then n = n + 1 namespaces[ns] = {} end
      table.insert(namespaces[ns], kid.pid)
    end
  end
  return namespaces, n
end

local function children_of(pid)
  local f = io.open(("/proc/%d/task/%d/children"):format(pid, pid))
  local text = f and f:read("*a") or ""
  if f then f:close() end
  local pids = {}
  for child in text:gmatch("%d+") do pids[#pids + 1] = tonumber(child) end
  return pids
end

local function comm(pid)
  local f = io.open("/proc/" .. pid .. "/comm")
  local text = f and f:read("*l")
  if f then f:close() end
  return text
end

local function namespace_count() return select(2, foreign_namespaces()) end

local function pre_cgroups()
  if tree.mode() ~= "cgroup" then return {} end
  local found = {}
  for _, name in ipairs(core.readdir(cgroup.base()) or {}) do
    if name:match("^pre%-%d+$") then found[#found + 1] = name end
  end
  return found
end

local function mountinfo()
  local f = assert(io.open("/proc/self/mountinfo"))
  local text = f:read("*a")
  f:close()
  return text
end

local function with_pool(size, fn)
  run_task(function()
    moonbox.prewarm(size)
    local ok, err = pcall(fn)
    moonbox.prewarm(false)
    if not ok then error(err, 0) end
  end)
end

describe("moonbox.prewarm(n): a pool of pre-built sandboxes", function()
  if os.getenv("MOONBOX_TEST_ISOLATION") == "none" then return end

  it("takes true, false or a whole number up to MAX_SPARES, and names anything else", function()
    for _, bad in ipairs { -1, 1.5, prewarm.MAX_SPARES + 1, "2", {} } do
      local ok, err = pcall(moonbox.prewarm, bad)
      assert.is_false(ok)
      assert.equal("VALIDATION_FAILED", err.code)
      assert.equal("prewarm", err.context.field)
    end
    assert.equal(0, prewarm.size)
    assert.equal(16, prewarm.MAX_SPARES)
  end)

  it("keeps n spares in namespaces of their own, hands a burst of n getSandbox all of them, refills, and drops them",
    function()
      local roots = {}
      local first_spares, spares_left
      with_pool(POOL, function()
        assert.is_true(helper.eventually(function() return prewarm.count() == POOL end, 10000),
          "pool of " .. POOL .. " not full: " .. prewarm.count())
        -- each spare: an init with its shell, in one pid namespace of its own
        local namespaces, n = foreign_namespaces()
        assert.equal(POOL, n)
        first_spares = {}
        for ns, pids in pairs(namespaces) do
          assert.equal(1, #pids, ns)
          assert.equal("moonbox-init", comm(pids[1]))
          local shells = children_of(pids[1])
          assert.equal(1, #shells)
          assert.equal("bash", comm(shells[1]))
          assert.equal(ns, pid_ns(shells[1]))
          first_spares[#first_spares + 1] = pids[1]
          first_spares[#first_spares + 1] = shells[1]
        end
        local ours = pid_ns(core.getpid())

        -- a burst: every one claims a spare, none waits for a build
        local was_spare = {}
        for _, pid in ipairs(first_spares) do was_spare[pid] = true end
        local burst, seen = {}, {}
        for i = 1, POOL do
          local sb = helper.new_sandbox { isolation = "namespaces" }
          burst[i] = sb
          roots[i] = sb.root
          -- the oldest spares are claimed first: this burst takes the
          -- ones counted above, refills or not
          assert.is_true(was_spare[sb:info().initPid], "sandbox " .. i .. " built its own init")
          if tree.mode() == "cgroup" then
            assert.matches("^pre%-%d+$", sb.cgroup_name) -- a spare's cgroup: it was claimed
          end
        end
        for i, sb in ipairs(burst) do
          local r = sb:exec("echo $MOONBOX_SANDBOX; hostname")
          assert.equal(sb.id .. "\n" .. sb.id .. "\n", r.stdout)
          local init_ns = pid_ns(sb:info().initPid)
          assert.are_not.equal(ours, init_ns)
          local shell = sb.sessions.default.shell.pid
          assert.equal(init_ns, pid_ns(shell)) -- its shell is in its init's namespace
          assert.is_true(was_spare[shell], "sandbox " .. i .. " started its own shell") -- the spare's, adopted
          assert.is_nil(seen[init_ns], "sandbox " .. i .. " shares a pid namespace")
          seen[init_ns] = true
        end

        -- the pool fills again behind the burst
        assert.is_true(helper.eventually(function() return prewarm.count() == POOL end, 10000),
          "pool not refilled: " .. prewarm.count())
        for _, sb in ipairs(burst) do sb:destroy() end
        assert.equal(POOL, namespace_count()) -- only the spares are left

        -- a smaller pool drops the spares beyond it at once
        moonbox.prewarm(1)
        assert.equal(1, prewarm.count())
        assert.is_true(helper.eventually(function() return namespace_count() == 1 end, 2000))
        for _, pids in pairs(foreign_namespaces()) do
          spares_left = { pids[1], children_of(pids[1])[1] }
        end
      end)
      -- disabled: no spare process, cgroup or mount left
      assert.equal(0, prewarm.count())
      run_task(function()
        assert.is_true(helper.eventually(function() return namespace_count() == 0 end, 2000),
          namespace_count() .. " spare namespace(s) left")
        assert.is_true(helper.eventually(function() return #pre_cgroups() == 0 end, 3000),
          table.concat(pre_cgroups(), " "))
      end)
      assert.equal(0, #helper.children())
      -- every spare's init and shell is gone: the claimed ones with their
      -- sandboxes, the rest with the pool
      for _, pid in ipairs(first_spares) do assert.is_false(helper.pid_alive(pid), pid) end
      assert.equal(2, #spares_left)
      for _, pid in ipairs(spares_left) do assert.is_false(helper.pid_alive(pid), pid) end
      -- (the machine is shared: only the mounts of this spec's sandboxes are looked for)
      local mounts = mountinfo()
      for _, root in ipairs(roots) do assert.is_nil(mounts:find(root, 1, true), root) end
    end)
end)

-- (read from the host's state here, not through sandbox/disk.lua)
local MiB = 1024 * 1024
local function host_root()
  return core.getuid() == 0 and (util.read_file("/proc/self/uid_map") or ""):match("^%s*0%s+0%s+4294967295%s") ~= nil
end

local function disks_dir() return require("moonbox.sandbox").default_home() .. "/disks" end

-- the mount source at path (the last one), or false
local function mounted_at(path, mountinfo_path)
  local source = false
  for line in (util.read_file(mountinfo_path or "/proc/self/mountinfo") or ""):gmatch("[^\n]+") do
    local point, src = line:match("^%d+ %d+ %d+:%d+ %S+ (%S+) .* %- %S+ (%S+)")
    if point == path then source = src end
  end
  return source
end

local function backing_file(device)
  return (util.read_file("/sys/block/" .. device:match("loop%d+") .. "/loop/backing_file") or ""):gsub("\n$", "")
end

-- a runtime's spare disk files (spare-<pid>.<start>-<n>.*) in the disks directory
local function spare_files(pid)
  local found = {}
  for _, name in ipairs(core.readdir(disks_dir()) or {}) do
    if name:find("spare-" .. pid .. ".", 1, true) == 1 then found[#found + 1] = name end
  end
  return found
end

-- loop devices (losetup -a lines) and mounts (in ours and the host's
-- mount table) that name a spare disk of runtime pid
local function spare_traces(pid)
  local traces = {}
  local mark = "/spare-" .. pid .. "."
  for line in helper.sh("losetup -a"):gmatch("[^\n]+") do
    if line:find(mark, 1, true) then traces[#traces + 1] = line end
  end
  for _, info in ipairs { "/proc/self/mountinfo", "/proc/1/mountinfo" } do
    for line in (util.read_file(info) or ""):gmatch("[^\n]+") do
      if line:find(mark, 1, true) then traces[#traces + 1] = info .. ": " .. line end
    end
  end
  return traces
end

describe("moonbox.prewarm(n): a spare is ready to run", function()
  if os.getenv("MOONBOX_TEST_ISOLATION") == "none" then return end

  it("a claimed spare's root is the disk made ahead, its first exec runs in the shell started with it, its quota holds",
    function()
      if not host_root() then pending("needs the host's root (loop devices, mount): no disk image here") end
      policy_mod.set_default { limits = { diskBytes = 32 * MiB } }
      local ok, err = pcall(with_pool, 1, function()
        assert.is_true(helper.eventually(function() return prewarm.count() == 1 end, 10000), "no spare")
        -- the spare before the claim: its init and the one bash under it,
        -- and its disk, attached to a loop device and mounted nowhere
        local namespaces = foreign_namespaces()
        local init_pid = select(2, next(namespaces))[1]
        local shells = children_of(init_pid)
        assert.equal(1, #shells)
        assert.equal("bash", comm(shells[1]))
        local files = spare_files(core.getpid())
        assert.equal(1, #files)
        local spare_image = disks_dir() .. "/" .. files[1]
        local device = helper.sh("losetup -j '" .. spare_image .. "' | cut -d: -f1")
        assert.matches("^/dev/loop%d+$", device)
        assert.is_nil(util.read_file("/proc/self/mountinfo"):find(device .. " ", 1, true),
          "the spare's disk is mounted somewhere")

        local sb = helper.new_sandbox()
        local root = sb.root
        local done, failure = pcall(function()
          assert.equal(init_pid, sb:info().initPid)
          -- the root is the spare's disk: the same loop device, its file now the root's image
          assert.equal(device, mounted_at(root))
          local image = backing_file(device)
          assert.is_nil(image:find("/spare-", 1, true), image)
          assert.equal(root .. "\n", util.read_file(image .. ".root"))
          assert.is_false(util.is_file(spare_image))
          local opts = helper.sh("findmnt -no OPTIONS '" .. root .. "'")
          assert.is_truthy(opts:find("nosuid", 1, true) and opts:find("nodev", 1, true), opts)
          -- the first exec: in the bash started with the spare, no other one
          local r = sb:exec("echo $BASHPID; ls -A /workspace")
          assert.equal(0, r.exitCode)
          assert.equal(shells[1], sb.sessions.default.shell.pid)
          assert.same({ shells[1] }, children_of(init_pid))
          assert.equal(shells[1], tonumber(helper.sh("awk '/^NSpid/ {print $2}' /proc/" .. shells[1] .. "/status")))
          -- the quota: 32 MiB, as for a cold sandbox
          assert.equal(32 * MiB, sb:info().limits.diskBytes)
          r = sb:exec("dd if=/dev/zero of=big bs=1M count=64 status=none")
          assert.equal(1, r.exitCode)
          assert.equal("dd: error writing 'big': No space left on device\n", r.stderr)
          local size = tonumber(sb:exec("stat -c %s big").stdout)
          assert.is_true(size > 16 * MiB and size < 32 * MiB, tostring(size))
          assert.equal("NO_SPACE", helper.error_of(sb.writeFile, sb, "more", string.rep("x", 8 * MiB)).code)
          -- (the host's disk: the sparse image holds no more than the limit)
          assert.is_true(tonumber(helper.sh("stat -c '%b %B' '" .. image .. "' | awk '{print $1 * $2}'")) <= 32 * MiB)
          return image
        end)
        sb:destroy()
        assert(done, failure)
        local image = failure
        assert.is_false(util.is_dir(root))
        assert.is_false(util.is_file(image), "the image outlived destroy")
        assert.is_false(mounted_at(root))
        assert.is_true(helper.eventually(function() return not backing_file(device):find(image, 1, true) end, 5000),
          "loop device left attached")
      end)
      policy_mod.set_default(nil)
      assert(ok, err)
    end)

  it("a spare's disk that cannot be put at the root is dropped, and the root gets a disk made at once", function()
    if not host_root() then pending("needs the host's root (loop devices, mount): no disk image here") end
    local mount_fd = require "moonbox.sandbox.mount_fd"
    local attach = mount_fd.attach
    policy_mod.set_default { limits = { diskBytes = 32 * MiB } }
    local ok, err = pcall(with_pool, 1, function()
      assert.is_true(helper.eventually(function() return prewarm.count() == 1 end, 10000), "no spare")
      local spare_image = disks_dir() .. "/" .. spare_files(core.getpid())[1]
      local spare_device = helper.sh("losetup -j '" .. spare_image .. "' | cut -d: -f1")
      assert.matches("^/dev/loop%d+$", spare_device)
      local tried = 0
      mount_fd.attach = function()
        tried = tried + 1
        return nil, "move_mount: refused by the spec", 1
      end
      local sb = helper.new_sandbox()
      mount_fd.attach = attach
      assert.equal(1, tried) -- (the spare's disk was offered to the root)
      local done, failure = pcall(function()
        -- a disk of its own, of the size asked, on another loop device
        local device = mounted_at(sb.root)
        assert.matches("^/dev/loop%d+$", device)
        assert.are_not.equal(spare_device, device)
        assert.equal(sb.root .. "\n", util.read_file(backing_file(device) .. ".root"))
        local r = sb:exec("dd if=/dev/zero of=big bs=1M count=64 status=none")
        assert.equal("dd: error writing 'big': No space left on device\n", r.stderr)
      end)
      sb:destroy()
      assert(done, failure)
      -- the spare's disk is gone: its file, and its loop device with its mount
      assert.is_true(helper.eventually(function() return not util.is_file(spare_image) end, 5000), spare_image)
      assert.is_true(helper.eventually(function() return not backing_file(spare_device):find(spare_image, 1, true) end,
        5000), "the spare's loop device stayed attached")
    end)
    mount_fd.attach = attach
    policy_mod.set_default(nil)
    assert(ok, err)
  end)

  it("disabling the pool and the runtime's exit leave no spare disk, loop device, mount or process", function()
    if not host_root() then pending("needs the host's root (loop devices, mount): no disk image here") end
    with_pool(2, function()
      assert.is_true(helper.eventually(function() return prewarm.count() == 2 end, 10000), "pool not full")
      assert.equal(2, #spare_files(core.getpid()))
      local traces = spare_traces(core.getpid())
      assert.equal(2, #traces, table.concat(traces, "\n")) -- two loop devices, no mount
      moonbox.prewarm(false)
      -- (waited for: prewarm(false) in a task returns once they are gone)
      assert.same({}, spare_files(core.getpid()))
      assert.is_true(helper.eventually(function() return #spare_traces(core.getpid()) == 0 end, 5000),
        table.concat(spare_traces(core.getpid()), "\n"))
      assert.is_true(helper.eventually(function() return namespace_count() == 0 end, 2000))
    end)
    assert.equal(0, #helper.children())

    -- another runtime: its spares go with its exit; one killed leaves its
    -- image files only, which the next runtime's pool sweeps
    local bin = os.getenv("MOONBOX_BIN") or "build/moonbox"
    local dir = helper.mkdtemp()
    local script = dir .. "/pool.lua"
    util.write_file(script, table.concat({
      'local moonbox = require "moonbox"',
      'local prewarm = require "moonbox.sandbox.prewarm"',
      'moonbox.run(function()',
      '  moonbox.prewarm(2)',
      '  for _ = 1, 1000 do if prewarm.count() == 2 then break end moonbox.sleep(10) end',
      '  io.write(prewarm.count(), "\\n") io.stdout:flush()',
      '  if arg[1] == "hang" then moonbox.sleep(60000) end',
      'end)' }, "\n") .. "\n")
    local function start(mode)
      local out = dir .. "/out-" .. mode
      local pid = tonumber(helper.sh(("'%s' '%s' %s > '%s' 2>&1 & echo $!"):format(bin, script, mode, out)))
      return pid, out
    end
    run_task(function()
      local pid, out = start("exit")
      assert.is_true(helper.eventually(function() return not helper.pid_alive(pid) end, 20000), "runtime did not exit")
      assert.equal("2\n", util.read_file(out))
      assert.same({}, spare_files(pid))
      assert.same({}, spare_traces(pid))

      pid, out = start("hang")
      assert.is_true(helper.eventually(function() return util.read_file(out) == "2\n" end, 20000), util.read_file(out))
      assert.equal(2, #spare_files(pid))
      helper.sh("kill -KILL " .. pid)
      assert.is_true(helper.eventually(function() return not helper.pid_alive(pid) end, 5000))
      -- its disks were held as fds only: no mount of them, and their loop devices go with the kernel's unmount
      assert.is_true(helper.eventually(function() return #spare_traces(pid) == 0 end, 5000),
        table.concat(spare_traces(pid), "\n"))
      assert.equal(2, #spare_files(pid)) -- (the files stay: nobody removed them)
      local next_pid = start("exit")
      assert.is_true(helper.eventually(function() return not helper.pid_alive(next_pid) end, 20000))
      assert.same({}, spare_files(pid))
      assert.same({}, spare_files(next_pid))
    end)
  end)
end)
