-- Containment (issue #5): each attack is stopped by its limit while a second
-- sandbox keeps answering exec("true") (its p99 stays under 10x its idle p99).
local moonbox = require "moonbox"
local core = require "moonbox.core"

local function ms() return core.hrtime() / 1e6 end

local function p99(samples)
  table.sort(samples)
  return samples[math.max(1, math.ceil(#samples * 0.99))]
end

-- p99 of exec("true") in `probe` while attack() runs (at least 20 samples)
local function responsiveness(probe, attack)
  local samples, done = {}, false
  local results = moonbox.all(
    function() local r = attack() done = true return r end,
    function()
      while not done or #samples < 20 do
        local t = ms()
        probe:exec("true")
        samples[#samples + 1] = ms() - t
        moonbox.sleep(5)
      end
    end)
  return results[1], p99(samples)
end

local function idle_p99(probe)
  local samples = {}
  for i = 1, 50 do
    local t = ms()
    probe:exec("true")
    samples[i] = ms() - t
  end
  return math.max(p99(samples), 2) -- a floor: timer resolution on a busy 2-core machine
end

local function with_pair(limits, fn)
  return run_task(function()
    local attacked = helper.new_sandbox { limits = limits }
    local probe = helper.new_sandbox()
    local ok, err = pcall(fn, attacked, probe)
    attacked:destroy()
    probe:destroy()
    if not ok then error(err, 0) end
  end)
end

describe("containment", function()
  it("stops a fork bomb at the pids limit", function()
    with_pair({ pids = 64 }, function(sb, probe)
      local info = sb:info()
      if not info.enforcement.pids then
        -- never run a real fork bomb without a limit; the host must say so
        assert.is_truthy(table.concat(info.notEnforced, ","):find("pids", 1, true))
        return
      end
      local idle = idle_p99(probe)
      local r, busy = responsiveness(probe, function()
        return sb:exec("bomb() { bomb | bomb & }; bomb; sleep 2", { timeout = 2000 })
      end)
      assert.is_true(r.timedOut)
      assert.is_true(busy < 10 * idle, ("p99 %.1f ms under attack, idle %.1f ms"):format(busy, idle))
      assert.equal("alive\n", sb:exec("echo alive").stdout)
    end)
  end)

  it("weighs a sandbox's processes together for CPU, as its cpuWeight says", function()
    with_pair({ cpuWeight = 50 }, function(sb)
      local info = sb:info()
      if not info.enforcement.cpuWeight then
        assert.is_truthy(table.concat(info.notEnforced, ","):find("cpuWeight", 1, true))
        return
      end
      assert.equal(50, info.limits.cpuWeight)
      -- every process of the sandbox, the busy ones too, in one group of
      -- its own whose weight is half the default (cgroup v1: 512 of 1024)
      local r = sb:exec("for i in 1 2 3 4; do (while :; do :; done) & done; " ..
        "for p in $(jobs -p) $$; do grep -E '^[0-9]+:([^:]*,)?cpu(,[^:]*)?:' /proc/$p/cgroup | cut -d: -f3; done; " ..
        "kill $(jobs -p)")
      assert.equal(0, r.exitCode, r.stderr)
      local groups = {}
      for line in r.stdout:gmatch("[^\n]+") do groups[line] = (groups[line] or 0) + 1 end
      local name, count = next(groups)
      assert.is_nil(next(groups, name), "more than one cpu group: " .. r.stdout)
      assert.equal(5, count)
      assert.equal(("/moonbox-%d/sb-%s"):format(core.getpid(), sb.id), name)
      assert.equal("512", helper.sh("cat /sys/fs/cgroup/cpu" .. name .. "/cpu.shares"))
      -- and all sandboxes together a quarter of one runtime thread (issue #29)
      assert.equal("256", helper.sh(("cat /sys/fs/cgroup/cpu/moonbox-%d/cpu.shares"):format(core.getpid())))
    end)
  end)

  it("removes the cgroup v1 groups a killed runtime left behind", function()
    -- (a runtime killed outright removes nothing; the next one that makes
    -- a group in the same hierarchy does)
    local dead = helper.sh("sh -c 'echo $$'")
    local left = "/sys/fs/cgroup/pids/moonbox-" .. dead
    -- (only root makes groups in a v1 hierarchy; unprivileged the runtime
    -- enforces pids where a v2 group was delegated to it, or says it does not)
    local root = core.getuid() == 0
    local v1 = root and helper.sh("test -f /sys/fs/cgroup/pids/cgroup.procs && echo yes") == "yes"
    if v1 then helper.sh("mkdir -p " .. left .. "/sb-gone") end
    local script = os.tmpname()
    local f = assert(io.open(script, "w"))
    f:write([[
local moonbox = require "moonbox"
moonbox.run(function()
  local sb = moonbox.getSandbox("sweep", { root = os.tmpname() .. ".d", limits = { pids = 64 } })
  io.write(sb:info().enforcement.pids or "none", "\n")
  sb:destroy()
end)
]])
    f:close()
    -- (stdout alone: a sanitizer build warns on stderr)
    local out = helper.sh((os.getenv("MOONBOX_BIN") or "build/moonbox") .. " " .. script .. " 2>/dev/null")
    os.remove(script)
    if v1 then
      assert.equal("cgroup v1 pids", out)
      assert.equal("gone", helper.sh("test -e " .. left .. " && echo there || echo gone"))
    elseif root then
      assert.equal("cgroup v2 pids", out)
    else
      assert.is_truthy(out == "none" or out == "cgroup v2 pids", out)
    end
  end)

  it("kills a memory bomb with 137 and says so", function()
    with_pair({ memoryBytes = 128 * 1024 * 1024 }, function(sb, probe)
      if not sb:info().enforcement.memoryBytes then
        assert.is_truthy(table.concat(sb:info().notEnforced, ","):find("memoryBytes", 1, true))
        return
      end
      local idle = idle_p99(probe)
      local r, busy = responsiveness(probe, function()
        return sb:exec("python3 -c 'b = []\nwhile True: b.append(bytearray(16 << 20))'")
      end)
      assert.equal(137, r.exitCode)
      assert.is_true(r.oomKilled)
      assert.is_true(busy < 10 * idle, ("p99 %.1f ms under attack, idle %.1f ms"):format(busy, idle))
    end)
  end)

  it("bounds a yes flood", function()
    with_pair({ maxOutputBytes = 1024 * 1024 }, function(sb, probe)
      local idle = idle_p99(probe)
      local r, busy = responsiveness(probe, function() return sb:exec("yes", { timeout = 1500 }) end)
      assert.is_true(r.timedOut)
      assert.is_true(r.truncated)
      assert.equal(1024 * 1024, #r.stdout)
      assert.is_true(busy < 10 * idle, ("p99 %.1f ms under attack, idle %.1f ms"):format(busy, idle))
    end)
  end)

  it("fills only its own /tmp: ENOSPC inside, the host's disk untouched", function()
    with_pair({ tmpBytes = 8 * 1024 * 1024 }, function(sb, probe)
      if sb:info().isolation ~= "namespaces" then
        -- without namespaces /tmp is the host's: never fill it; info must not claim a limit
        assert.is_nil(sb:info().limits.tmpBytes)
        return
      end
      local idle = idle_p99(probe)
      local name = "/tmp/moonbox-fill-" .. core.getpid()
      local r, busy = responsiveness(probe, function()
        return sb:exec("dd if=/dev/zero of=" .. name .. " bs=1M count=64 2>&1; df -k /tmp | tail -1")
      end)
      assert.matches("No space left on device", r.stdout)
      assert.matches("%s8192%s+8192%s+0%s+100%%", r.stdout)
      assert.is_nil(io.open(name), "the host's /tmp got the file")
      assert.is_true(busy < 10 * idle, ("p99 %.1f ms under attack, idle %.1f ms"):format(busy, idle))
    end)
  end)

  it("stops a CPU hog at its CPU time limit", function()
    with_pair({ cpuTime = 1 }, function(sb, probe)
      local idle = idle_p99(probe)
      local r, busy = responsiveness(probe, function() return sb:exec("bash -c 'while :; do :; done'") end)
      -- SIGXCPU at the soft limit; SIGKILL if the hard limit (the same) comes first
      assert.is_true(r.exitCode == 128 + 24 or r.exitCode == 137, "exit " .. r.exitCode)
      assert.is_true(busy < 10 * idle, ("p99 %.1f ms under attack, idle %.1f ms"):format(busy, idle))
    end)
  end)

  it("removes 10 nested setsid double-forked daemons on destroy", function()
    run_task(function()
      local sb = helper.new_sandbox()
      local marker = "mbdaemon" .. core.getpid()
      local script = ("d() { if [ $1 -gt 0 ]; then (setsid bash -c \"exec -a %s-$1 sleep 1000\" & " ..
        "(setsid bash -c 'd() { :; }; sleep 1000' &) ; d $(($1 - 1))) & fi; }; d 10; sleep 0.5"):format(marker)
      sb:exec(script)
      sb:startProcess(script)
      -- (started in the background: on a loaded machine they take a while)
      local before = 0
      helper.eventually(function()
        before = tonumber(helper.sh("pgrep -f '[m]" .. marker:sub(2) .. "' | wc -l"))
        return before >= 10
      end, 10000)
      assert.is_true(before >= 10, "daemons running: " .. before)
      sb:destroy()
      local after = helper.sh("pgrep -f '[m]" .. marker:sub(2) .. "' | wc -l")
      assert.equal("0", after)
    end)
  end)
end)
