-- Default bounds (issue 29, finding 9: a command wrote 5 GiB into the
-- /workspace of a default-policy sandbox). The default policy bounds the
-- sandbox's disk (limits.diskBytes: its root is an ext4 image of that size,
-- loop-mounted, sandbox/disk.lua), its processes and its memory; info()
-- says each. Writing past diskBytes is ENOSPC inside, and the host's disk
-- holds no more than the image.
local moonbox = require "moonbox"
local core = require "moonbox.core"
local util = require "moonbox.lib.util"

-- (these read the host's state themselves, not through sandbox/disk.lua)
local disk = {}
-- the host's root: uid 0 in the initial user namespace (loop devices, mount)
function disk.host_root()
  return core.getuid() == 0 and (util.read_file("/proc/self/uid_map") or ""):match("^%s*0%s+0%s+4294967295%s") ~= nil
end
-- the source of the mount at path (the last one), or false
function disk.mounted_at(path)
  local source = false
  for line in (util.read_file("/proc/self/mountinfo") or ""):gmatch("[^\n]+") do
    local point, src = line:match("^%d+ %d+ %d+:%d+ %S+ (%S+) .* %- %S+ (%S+)")
    if point and point:gsub("\\(%d%d%d)", function(o) return string.char(tonumber(o, 8)) end) == path then
      source = src
    end
  end
  return source
end

local GiB, MiB = 1024 * 1024 * 1024, 1024 * 1024

-- The image file mounted at root (nil if root is no loop mount).
local function image_of(root)
  local source = disk.mounted_at(root)
  local n = source and source:match("^/dev/loop(%d+)$")
  if not n then return nil end
  return (util.read_file("/sys/block/loop" .. n .. "/loop/backing_file") or ""):gsub("\n$", ""), source
end

-- Whether no loop device is backed by image (autoclear detaches a device
-- once the kernel lets go of its mount: soon after the unmount, not at once).
local function detached(image)
  return helper.eventually(function() return helper.sh("losetup -j '" .. image .. "'") == "" end, 5000)
end

local function allocated_bytes(path)
  return tonumber(helper.sh("stat -c '%b %B' '" .. path .. "' | awk '{print $1 * $2}'"))
end

describe("default bounds (finding 9)", function()
  it("info().limits shows the default memory, pids and disk limits, and each is in force or named", function()
    run_task(function()
      local sb = helper.new_sandbox()
      local ok, err = pcall(function()
        local info = sb:info()
        local defaults = { memoryBytes = 2 * GiB, pids = 2048, diskBytes = 4 * GiB, cpuWeight = 100 }
        for name, value in pairs(defaults) do
          local listed = false
          for _, n in ipairs(info.notEnforced) do listed = listed or n == name end
          if info.enforcement[name] then
            assert.equal(value, info.limits[name], name)
            assert.is_false(listed, name)
          else -- (an unprivileged runtime: no loop devices, no cgroup of its own)
            assert.is_nil(info.limits[name], name)
            assert.is_true(listed, name .. " is neither enforced nor in notEnforced")
          end
        end
        if disk.host_root() then
          for name in pairs(defaults) do assert.is_string(info.enforcement[name], name) end
          assert.equal("ext4 image (loop mount)", info.enforcement.diskBytes)
          assert.is_truthy(image_of(sb.root), "the root is not a loop mount")
        end
      end)
      sb:destroy()
      assert(ok, err)
    end)
  end)

  it("writing past diskBytes is ENOSPC inside; the host holds no more than the image; destroy frees it", function()
    if not disk.host_root() then
      -- not the host's root: no loop device, and info() says so
      run_task(function()
        local sb = helper.new_sandbox { limits = { diskBytes = 32 * MiB } }
        local info = sb:info()
        sb:destroy()
        assert.is_nil(info.limits.diskBytes)
        assert.is_truthy(table.concat(info.notEnforced, ","):find("diskBytes", 1, true))
      end)
      return
    end
    run_task(function()
      local sb = helper.new_sandbox { limits = { diskBytes = 32 * MiB } }
      local root = sb.root
      local image, device = image_of(root)
      local ok, err = pcall(function()
        assert.equal(32 * MiB, sb:info().limits.diskBytes)
        assert.is_string(image)
        -- the tenant sees neither the image nor a loop device
        local r = sb:exec("ls /dev | grep -c '^loop' ; test -e '" .. image .. "' && echo SEEN || echo unseen")
        if sb:info().isolation == "namespaces" then
          assert.equal("0\nunseen\n", r.stdout)
        end
        r = sb:exec("dd if=/dev/zero of=big bs=1M count=64 status=none")
        assert.equal(1, r.exitCode)
        assert.equal("dd: error writing 'big': No space left on device\n", r.stderr)
        local size = tonumber(sb:exec("stat -c %s big").stdout)
        assert.is_true(size > 16 * MiB and size < 32 * MiB, tostring(size))
        -- the file API too
        local e = helper.error_of(sb.writeFile, sb, "more", string.rep("x", 8 * MiB))
        assert.equal("NO_SPACE", e.code)
        -- the host's disk: the sparse image holds what was written, and no more than the limit
        assert.is_true(allocated_bytes(image) <= 32 * MiB, tostring(allocated_bytes(image)))
        -- mounted nosuid,nodev
        local opts = helper.sh("findmnt -no OPTIONS '" .. root .. "'")
        assert.is_truthy(opts:find("nosuid", 1, true) and opts:find("nodev", 1, true), opts)
        -- deleting gives the space back inside
        assert.equal(0, sb:exec("rm -f big more && dd if=/dev/zero of=again bs=1M count=16 status=none").exitCode)
      end)
      sb:destroy()
      assert(ok, err)
      assert.is_false(util.is_dir(root))
      assert.is_false(util.is_file(image), "the image outlived destroy")
      assert.is_true(detached(image), "the image's loop device stayed attached")
      assert.is_false(disk.mounted_at(root))
      -- its loop device is free, or (specs run side by side) another image's;
      -- once the image is unlinked losetup -j no longer finds it, so the
      -- autoclear detach (a moment after the unmount) is awaited here too
      local backing
      helper.eventually(function()
        backing = util.read_file("/sys/block/" .. device:match("loop%d+") .. "/loop/backing_file") or ""
        return not backing:find(image, 1, true)
      end, 5000)
      assert.is_nil(backing:find(image, 1, true), "loop device left attached: " .. backing)
    end)
  end)

  it("keepFiles keeps the data in its mounted image; getSandbox of that root takes it again", function()
    if not disk.host_root() then pending("needs the host's root (loop devices, mount): no disk image here") end
    run_task(function()
      local root = helper.mkdtemp() .. "/root"
      local id = "disk-keep-" .. core.getpid()
      local iso = os.getenv("MOONBOX_TEST_ISOLATION")
      local sb = moonbox.getSandbox(id, { root = root, isolation = iso, limits = { diskBytes = 32 * MiB } })
      sb:writeFile("kept.txt", "kept")
      local image = image_of(root)
      sb:destroy { keepFiles = true }
      assert.equal("kept", util.read_file(root .. "/workspace/kept.txt"))
      -- another size than the image's: refused, never claimed in info()
      local e = helper.error_of(moonbox.getSandbox, id, { root = root, isolation = iso,
        limits = { diskBytes = 64 * MiB } })
      assert.equal("ISOLATION_UNAVAILABLE", e.code)
      assert.is_truthy(e.message:find("diskBytes is 67108864", 1, true), e.message)
      assert.equal("kept", util.read_file(root .. "/workspace/kept.txt")) -- (still there, still mounted)
      sb = moonbox.getSandbox(id, { root = root, isolation = iso, limits = { diskBytes = 32 * MiB } })
      assert.equal(image, image_of(root))
      assert.equal("kept", sb:readFile("kept.txt").content)
      assert.equal(1, sb:exec("dd if=/dev/zero of=big bs=1M count=64 status=none").exitCode)
      sb:destroy()
      assert.is_false(util.is_file(image))
      assert.is_true(detached(image), "the image's loop device stayed attached")
    end)
  end)

  it("a runtime that stops unmounts its image; the next one mounts it again, with its data", function()
    if not disk.host_root() then pending("needs the host's root (loop devices, mount): no disk image here") end
    local tmp = helper.mkdtemp()
    local root = tmp .. "/root"
    local script = tmp .. "/first.lua"
    local iso = os.getenv("MOONBOX_TEST_ISOLATION")
    local iso_arg = iso and ("%q"):format(iso) or "nil"
    local f = assert(io.open(script, "w"))
    f:write(([[
local moonbox = require "moonbox"
local sb = moonbox.getSandbox("disk-restart", { root = %q, isolation = %s, limits = { diskBytes = 33554432 } })
sb:writeFile("data.txt", "from the first runtime")
print(sb:info().enforcement.diskBytes)
local f = io.open(%q, "w")
f:write((io.popen("cat /sys/block/$(basename $(findmnt -no SOURCE " .. %q .. "))/loop/backing_file"):read("*l")))
f:close()
]]):format(root, iso_arg, tmp .. "/image", root))
    f:close()
    -- (stderr apart: the sanitizers' build writes its warnings there)
    local out = helper.sh("'" .. (os.getenv("MOONBOX_BIN") or "build/moonbox") .. "' '" .. script .. "' 2>'"
      .. tmp .. "/stderr'")
    assert.equal("ext4 image (loop mount)", out, util.read_file(tmp .. "/stderr"))
    local image = util.read_file(tmp .. "/image")
    assert.is_truthy(image and image:find("/disks/", 1, true), image)
    -- nothing of the first runtime stays mounted: no mount, no loop device
    assert.is_nil(image_of(root))
    run_task(function() assert.is_true(detached(image), "the image's loop device stayed attached") end)
    assert.is_true(util.is_file(image))
    run_task(function()
      local sb = moonbox.getSandbox("disk-restart", { root = root, isolation = os.getenv("MOONBOX_TEST_ISOLATION"),
        limits = { diskBytes = 32 * MiB } })
      local ok, err = pcall(function()
        assert.equal(image, image_of(root))
        assert.equal("from the first runtime", sb:readFile("data.txt").content)
        assert.equal(1, sb:exec("dd if=/dev/zero of=big bs=1M count=64 status=none").exitCode)
      end)
      sb:destroy()
      assert(ok, err)
    end)
    assert.is_false(util.is_file(image))
    run_task(function() assert.is_true(detached(image), "the image's loop device stayed attached") end)
    helper.sh("rm -rf '" .. tmp .. "'")
  end)

  it("a root that is another mount is refused with ISOLATION_UNAVAILABLE, not used unbounded", function()
    if not disk.host_root() then pending("needs the host's root (loop devices, mount): no disk image here") end
    run_task(function()
      local root = helper.mkdtemp()
      helper.sh("mount -t tmpfs -o size=1m tmpfs '" .. root .. "'")
      local e = helper.error_of(helper.new_sandbox, { root = root, limits = { diskBytes = 32 * MiB } })
      helper.sh("umount '" .. root .. "' && rmdir '" .. root .. "'")
      assert.equal("ISOLATION_UNAVAILABLE", e.code)
      assert.is_truthy(e.message:find("disk image", 1, true), e.message)
    end)
  end)

  -- threads started until the kernel refuses one (pids counts threads)
  local function thread_bomb(sb)
    local r = sb:exec("python3 -c '" .. [[
import threading, time
n = 0
try:
    while True:
        threading.Thread(target=time.sleep, args=(20,), daemon=True).start()
        n += 1
except RuntimeError:
    print(n)
]] .. "'", { timeout = 60000 })
    assert.equal(0, r.exitCode, r.stderr)
    local n = tonumber(r.stdout)
    assert.is_true(n > 1900 and n < 2048, r.stdout)
  end

  it("a pre-built sandbox (moonbox.prewarm) claimed by a default-policy sandbox has its limits and its disk", function()
    local prewarm = require "moonbox.sandbox.prewarm"
    if os.getenv("MOONBOX_TEST_ISOLATION") == "none" then pending("pre-built sandboxes need namespaces") end
    run_task(function()
      moonbox.prewarm(true)
      local ok, err = pcall(function()
        for _ = 1, 300 do
          if prewarm.ready() then break end
          moonbox.sleep(10)
        end
        local sb = helper.new_sandbox()
        local claimed = not prewarm.ready()
        local ok2, err2 = pcall(function()
          local info = sb:info()
          if not claimed then -- (no pre-built sandbox here: v1 limits and no cgroup of its own)
            assert.equal("namespaces", info.isolation)
            return
          end
          if info.enforcement.diskBytes then
            local size = sb:exec("df -B1 --output=size /workspace | tail -1").stdout
            assert.is_true(math.abs(tonumber(size) - 4 * GiB) < 256 * MiB, size)
          end
          if info.enforcement.pids then thread_bomb(sb) end
        end)
        sb:destroy()
        assert(ok2, err2)
      end)
      moonbox.prewarm(false)
      if not ok then error(err, 0) end
    end)
  end)

  it("the default pids limit bounds a thread bomb, the default memory limit a memory bomb", function()
    run_task(function()
      local sb = helper.new_sandbox()
      local ok, err = pcall(function()
        local info = sb:info()
        if info.enforcement.pids then thread_bomb(sb) end
        if info.enforcement.memoryBytes then
          local r = sb:exec("python3 -c 'b = []\nwhile True: b.append(bytearray(64 << 20))'", { timeout = 60000 })
          assert.equal(137, r.exitCode)
          assert.is_true(r.oomKilled)
        end
      end)
      sb:destroy()
      assert(ok, err)
    end)
  end)
end)
