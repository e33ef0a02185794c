-- The Sandbox itself (lua/moonbox/sandbox/init.lua): getSandbox's identity
-- and checks, what info() reports, the default session behind the
-- sandbox's own calls, and destroy: every part's resources end with it
-- (processes, terminals, watches: the hooks of lib/compose.lua).
local core = require "moonbox.core"
local moonbox = require "moonbox"
local util = require "moonbox.lib.util"

local with_sandbox = helper.with_sandbox
local error_of = helper.error_of
local ISOLATION = os.getenv("MOONBOX_TEST_ISOLATION")

local function exists(path) return util.is_dir(path) end
local function read(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local text = f:read("*a")
  f:close()
  return text
end

describe("getSandbox", function()
  it("returns the same object for the same id, another for another id", function()
    run_task(function()
      local root = helper.mkdtemp()
      local a = helper.new_sandbox { root = root }
      assert.equal(a, moonbox.getSandbox(a.id))
      assert.equal(a, moonbox.getSandbox(a.id, { root = root }))
      -- options for a live id are still checked: a typo is not dropped
      local ok, err = pcall(moonbox.getSandbox, a.id, { policy = { limits = { maxSesions = 1 } } })
      assert.is_false(ok)
      assert.same({ "VALIDATION_FAILED", "policy.limits.maxSesions" }, { err.code, err.context.field })
      assert.is_false((pcall(moonbox.getSandbox, a.id, { bogus = true })))
      local b = helper.new_sandbox()
      assert.are_not.equal(a, b)
      assert.are_not.equal(a.id, b.id)
      a:destroy()
      b:destroy()
      assert.is_false(exists(root))
    end)
  end)

  it("destroy: the running call and those queued behind it raise SANDBOX_DESTROYED; none of the queued runs", function()
    run_task(function()
      local sb = helper.new_sandbox()
      local s = sb:createSession { id = "a" }
      local running = moonbox.spawn(function() return pcall(s.exec, s, "sleep 30") end)
      local queued = {}
      for i = 1, 3 do
        queued[i] = moonbox.spawn(function() return pcall(s.exec, s, "echo ran" .. i .. " >> ranlog") end)
      end
      moonbox.sleep(300) -- the first runs, the others wait for it
      sb:destroy { keepFiles = true }
      for _, t in ipairs { running, queued[1], queued[2], queued[3] } do
        local ok, err = t:wait()
        assert.is_false(ok)
        assert.equal("SANDBOX_DESTROYED", err.code, tostring(err))
      end
      assert.is_false(exists(sb.root .. "/workspace/ranlog"))
      helper.sh("rm -rf '" .. sb.root .. "'")
    end)
  end)

  it("destroying the last unisolated sandbox leaves every other sandbox's processes running", function()
    -- (its exit guard stands down: it kills the runtime's cgroups only
    -- when the runtime dies, process/tree.lua)
    with_sandbox(function(sb)
      local p = sb:startProcess("sleep 600")
      local loose = helper.new_sandbox { isolation = "none" }
      assert.equal(0, loose:exec("true").exitCode)
      loose:destroy()
      moonbox.sleep(100)
      assert.equal("running", p:getStatus())
      assert.equal("ok\n", sb:exec("echo ok").stdout)
      p:kill("SIGKILL")
    end)
  end)

  it("refuses an id outside the rule with VALIDATION_FAILED, making nothing", function()
    run_task(function()
      for _, id in ipairs { "", "-x", "x-", "UPPER", "a/b", ("a"):rep(64), 42 } do
        local root = helper.mkdtemp() .. "/r"
        local err = error_of(moonbox.getSandbox, id, { root = root })
        assert.equal("VALIDATION_FAILED", err.code, tostring(id))
        assert.is_false(exists(root), tostring(id))
      end
    end)
  end)

  it("makes the root with its workspace, where the default session starts", function()
    with_sandbox(function(sb)
      assert.is_true(util.is_dir(sb.root .. "/workspace"))
      sb:exec("echo from-the-shell > here.txt")
      assert.equal("from-the-shell\n", read(sb.root .. "/workspace/here.txt"))
      assert.equal("from-the-shell\n", sb:readFile("/workspace/here.txt").content)
    end)
  end)
end)

describe("sandbox:info()", function()
  it("reports what is in force", function()
    with_sandbox(function(sb)
      local info = sb:info()
      assert.equal(sb.id, info.id)
      assert.equal(sb.root, info.root)
      assert.is_true(info.isolation == "namespaces" or info.isolation == "none", info.isolation)
      if ISOLATION == "none" or ISOLATION == "namespaces" then assert.equal(ISOLATION, info.isolation) end
      assert.is_table(info.namespaces)
      if info.isolation == "namespaces" then
        -- the namespaces listed are the shell's own, not the runtime's
        assert.is_true(#info.namespaces > 0)
        for _, ns in ipairs(info.namespaces) do
          assert.are_not.equal(core.readlink("/proc/self/ns/" .. ns) .. "\n",
            sb:exec("readlink /proc/self/ns/" .. ns).stdout, ns)
        end
        assert.is_number(info.initPid)
      else
        assert.same({}, info.namespaces)
        assert.is_nil(info.initPid)
      end
      assert.is_true(info.cgroup == "v2" or info.cgroup == "v1" or info.cgroup == "none", info.cgroup)
      assert.is_table(info.limits)
      assert.equal(sb.policy.limits.commandTimeoutMs, info.limits.commandTimeoutMs)
      assert.equal(sb.policy.limits.maxSessions, info.limits.maxSessions)
      assert.is_table(info.enforcement)
      assert.is_table(info.notEnforced)
    end)
  end)
end)

describe("the sandbox's own calls", function()
  it("run in the default session: one shell, one environment", function()
    with_sandbox(function(sb)
      sb:exec("export FROM_SANDBOX=1; cd /tmp")
      local s = sb:getSession("default")
      assert.equal("1 /tmp\n", s:exec('echo "$FROM_SANDBOX $PWD"').stdout)
      assert.equal(sb:exec("echo $$").stdout, s:exec("echo $$").stdout)
    end)
  end)

  it("include every public session call", function()
    local Session = require("moonbox.session").Session
    local Sandbox = require("moonbox.sandbox").Sandbox
    -- (but what the sandbox asks of a session, docs/architecture.md)
    local session_only = require("moonbox.sandbox").SESSION_ONLY
    local n = 0
    for name, fn in pairs(Session) do
      if type(fn) == "function" and not name:match("^_") and not session_only[name] then
        n = n + 1
        assert.is_function(Sandbox[name], name)
      end
    end
    assert.is_true(n >= 30, "only " .. n .. " session calls")
    for name in pairs(session_only) do
      assert.is_function(Session[name], name)
      assert.is_nil(Sandbox[name], name)
    end
  end)
end)

describe("sandbox:destroy()", function()
  it("ends every part's resources, and later calls raise SANDBOX_DESTROYED", function()
    run_task(function()
      local sb = helper.new_sandbox()
      local p = sb:startProcess("sleep 600")
      local t = sb:terminal {}
      local other = sb:createSession { id = "other" }
      local it = other:watch(".")
      local watching = moonbox.spawn(function() return it() end)
      assert.same({ success = true, id = sb.id }, (function()
        local r = sb:destroy()
        return { success = r.success, id = r.id }
      end)())
      assert.equal("killed", p.status)
      assert.is_false(helper.pid_alive(p.pid))
      assert.is_true(t.exited)
      assert.is_false(helper.pid_alive(t.pid))
      assert.is_nil(watching:wait())
      for _, call in ipairs {
        function() return sb:exec("true") end,
        function() return sb:createSession {} end,
        function() return sb:writeFile("x", "y") end,
      } do
        assert.equal("SANDBOX_DESTROYED", error_of(call).code)
      end
      -- its sessions are gone with it
      assert.equal("SESSION_NOT_FOUND", error_of(other.exec, other, "true").code)
      -- twice is fine; the files are gone; the id is free again
      assert.is_true(sb:destroy().success)
      assert.is_false(exists(sb.root))
      assert.is_nil(require("moonbox.sandbox").all()[sb.id])
      local again = moonbox.getSandbox(sb.id, { root = helper.mkdtemp(), isolation = ISOLATION })
      assert.are_not.equal(sb, again)
      assert.equal("ok\n", again:exec("echo ok").stdout)
      again:destroy()
    end)
  end)

  it("{keepFiles = true} keeps the workspace on disk", function()
    run_task(function()
      local sb = helper.new_sandbox()
      sb:writeFile("kept.txt", "still here")
      local root = sb.root
      sb:destroy { keepFiles = true }
      local f = assert(io.open(root .. "/workspace/kept.txt"))
      assert.equal("still here", f:read("*a"))
      f:close()
      os.execute("rm -rf '" .. root .. "'")
    end)
  end)
end)
