-- The one spawn spec (lua/moonbox/sandbox/spawn.lua): every kind of process a
-- sandbox runs carries the sandbox's rules. Each is read back from the
-- outside (/proc/<pid>/status, /proc/<pid>/cgroup, /proc/<pid>/limits of the
-- runtime's view), and a command's from the inside (/proc/self), which is
-- what exec, sessionless commands, backups (mksquashfs, unsquashfs) and
-- in-sandbox git are: commands of a session shell.
local moonbox = require "moonbox"
local tree = require "moonbox.process.tree"
local spawn_rules = require "moonbox.sandbox.spawn"
local run_task = run_task -- helper.lua


local LIMITS = { cpuTime = 3000, fileSizeBytes = 1073741824, openFiles = 512, pids = 2000 }

local function read(path)
  local f = assert(io.open(path), path)
  local text = f:read("*a")
  f:close()
  return assert(text, path)
end

local function field(status, name)
  return status:match("\n" .. name .. ":%s*([^\n]*)")
end

-- the bounding set cap_keep leaves, as /proc shows it
local function cap_mask(numbers)
  local hi, lo = 0, 0
  for _, n in ipairs(numbers) do
    if n < 32 then lo = lo + 2 ^ n else hi = hi + 2 ^ (n - 32) end
  end
  return ("%08x%08x"):format(hi, lo)
end

-- Assert that the process whose /proc texts are given carries sb's rules.
-- what: its kind, for the messages; limits: whether the policy has LIMITS.
local function assert_rules(sb, what, status, limits_text, limits)
  status = "\n" .. status
  assert.equal("2", field(status, "Seccomp"), what .. ": seccomp filter")
  assert.equal("1", field(status, "NoNewPrivs"), what .. ": no_new_privs")
  assert.equal("0000000000000000", field(status, "CapAmb"), what .. ": ambient capabilities")
  local bnd = field(status, "CapBnd")
  if sb.init then
    assert.equal(cap_mask(sb.cap_keep), bnd, what .. ": bounding set")
  else
    -- no namespaces: no capability set of its own, the runtime's at most
    local mine = tonumber(field("\n" .. read("/proc/self/status"), "CapBnd"), 16)
    assert.equal(mine, tonumber(bnd, 16), what .. ": bounding set")
  end
  if limits then
    assert.matches("Max cpu time%s+3000%s+3000%s+seconds", limits_text, nil, false, what .. ": cpuTime")
    assert.matches("Max file size%s+1073741824%s+1073741824%s+bytes", limits_text, nil, false,
      what .. ": fileSizeBytes")
    assert.matches("Max open files%s+512%s+512%s+files", limits_text, nil, false, what .. ": openFiles")
  end
end

-- From the runtime's side: status, limits and cgroup of a host pid.
local function assert_pid(sb, what, pid, limits)
  assert.is_number(pid, what .. ": pid")
  assert_rules(sb, what, read("/proc/" .. pid .. "/status"), read("/proc/" .. pid .. "/limits"), limits)
  if tree.mode() == "cgroup" then
    local cgroup = read("/proc/" .. pid .. "/cgroup"):match("0::([^\n]*)")
    local own = "/" .. sb.cgroup_name
    assert.truthy(cgroup:find(own .. "/", 1, true) or cgroup:sub(-#own) == own,
      what .. ": cgroup " .. tostring(cgroup) .. " is not the sandbox's " .. own)
    for _, dir in ipairs(limits and sb.limits_state.extra_cgroups or {}) do
      -- a v1 hierarchy: /sys/fs/cgroup/<controller>/<path>
      local controller, path = dir:match("^/sys/fs/cgroup/([^/]+)(/.*)$")
      assert.truthy(read("/proc/" .. pid .. "/cgroup"):find(":" .. controller .. ":" .. path .. "\n", 1, true),
        what .. ": v1 cgroup " .. dir)
    end
  end
end

-- From the inside: a command of a session shell reads its own.
local function assert_command(sb, what, run, limits)
  local r = run("cat /proc/self/status; echo '--limits--'; cat /proc/self/limits")
  assert.equal(0, r.exitCode, what .. ": " .. r.stderr)
  local status, limits_text = r.stdout:match("^(.*)%-%-limits%-%-\n(.*)$")
  assert.truthy(status, what .. ": output")
  assert_rules(sb, what, status, limits_text, limits)
end

local function wait_for(check, what)
  for _ = 1, 500 do
    local v = check()
    if v then return v end
    moonbox.sleep(10)
  end
  error("gave up waiting for " .. what)
end

describe("one spawn spec", function()
  for _, limited in ipairs { true, false } do
    local label = limited and "with policy limits" or "without limits"
    it("puts every kind of sandbox process under the sandbox's rules, " .. label, function()
      run_task(function()
        local sb = helper.new_sandbox(limited and { policy = { limits = LIMITS } } or nil)
        local ok, err = pcall(function()
          local s = sb:createSession { id = "rules" }
          -- the spare shell the next session adopts (the default one, below)
          local spare = wait_for(function() return sb.spare and not sb.spare.dead and sb.spare end, "a spare shell")
          assert_pid(sb, "spare shell", spare.pid, limited)
          assert_command(sb, "session command", function(c) return s:exec(c) end, limited)
          assert_command(sb, "sandbox command (default session)", function(c) return sb:exec(c) end, limited)
          assert_pid(sb, "session shell", s.shell.pid, limited)
          local p = s:startProcess("exec sleep 100")
          assert_pid(sb, "background process", p.pid, limited)
          p:kill()
          local ctx = s:createCodeContext { language = "lua" }
          local kernel = sb.contexts[ctx.id].kernel
          assert_pid(sb, "code kernel", kernel.pid, limited)
          local t = s:terminal {}
          assert_pid(sb, "terminal", t.pid, limited)
          t:close()
          s:deleteCodeContext(ctx.id)
        end)
        sb:destroy()
        if not ok then error(err, 0) end
      end)
    end)
  end

  it("gives a pre-built sandbox's shell the same rules", function()
    run_task(function()
      local prewarm = require "moonbox.sandbox.prewarm"
      moonbox.prewarm(true)
      local ok, err = pcall(function()
        if os.getenv("MOONBOX_TEST_ISOLATION") == "none" then
          -- a sandbox without namespaces never takes a pre-built one
          wait_for(prewarm.ready, "a pre-built sandbox")
          local sb = helper.new_sandbox()
          assert.is_true(prewarm.ready())
          assert.is_nil(sb.init)
          sb:destroy()
          return
        end
        wait_for(prewarm.ready, "a pre-built sandbox")
        local sb = helper.new_sandbox()
        local claimed = not prewarm.ready()
        local ok2, err2 = pcall(function()
          assert.is_true(claimed)
          -- its pre-built shell is the sandbox's spare until a session adopts it
          local shell = assert(sb.spare, "the pre-built shell")
          assert_pid(sb, "pre-built shell", shell.pid, false)
          assert_command(sb, "command of the pre-built shell", function(c) return sb:exec(c) end, false)
        end)
        sb:destroy()
        if not ok2 then error(err2, 0) end
      end)
      moonbox.prewarm(false)
      if not ok then error(err, 0) end
    end)
  end)

  it("refuses a call site that sets the sandbox's rules itself", function()
    for _, key in ipairs { "seccomp", "rlimits", "extra_cgroups", "no_new_privs", "cap_keep", "sandbox",
      "pipe_uid", "uid" } do
      local spec = { args = { "true" } }
      spec[key] = false
      local ok, err = pcall(spawn_rules.apply, {}, spec)
      assert.is_false(ok)
      assert.truthy(tostring(err):find(key .. " is the sandbox's", 1, true), tostring(err))
    end
    -- a cgroup outside the sandbox's, or none: never outside
    local ok, err = pcall(spawn_rules.apply, { cgroup_dir = "/sys/fs/cgroup/m/sb-a" },
      { cgroup = "/sys/fs/cgroup/m/sb-ab/x" })
    assert.is_false(ok)
    assert.truthy(tostring(err):find("not below the sandbox's", 1, true))
    assert.equal("/sys/fs/cgroup/m/sb-a", spawn_rules.apply({ cgroup_dir = "/sys/fs/cgroup/m/sb-a" }, {}).cgroup)
    assert.equal("/sys/fs/cgroup/m/sb-a/p-1",
      spawn_rules.apply({ cgroup_dir = "/sys/fs/cgroup/m/sb-a" }, { cgroup = "/sys/fs/cgroup/m/sb-a/p-1" }).cgroup)
  end)
end)
