-- The pool of pre-built sandboxes (lua/moonbox/sandbox/prewarm.lua,
-- moonbox.prewarm(n)): n spares kept, each in namespaces of its own, a
-- burst of n getSandbox calls claims them all, the pool fills again one at
-- a time, and prewarm(0) leaves no spare process, cgroup or mount behind.
local moonbox = require "moonbox"
local core = require "moonbox.core"
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
