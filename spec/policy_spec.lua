-- Policy (issue #5, policy half): validation, presets, hooks, limits, and
-- behaviour changed by a policy file written at test time.
local moonbox = require "moonbox"
local core = require "moonbox.core"
local policy = require "moonbox.policy"

local function with_sandbox(opts, fn) return helper.with_sandbox(fn, opts) end

local function err_of(fn, ...)
  local ok, err = pcall(fn, ...)
  assert.is_false(ok, "expected an error")
  return err
end

describe("policy validation", function()
  it("names unknown keys and wrong types", function()
    for _, case in ipairs {
      { { limitz = {} }, "policy.limitz" },
      { { limits = { memoryByte = 1 } }, "policy.limits.memoryByte" },
      { { limits = { pids = "many" } }, "policy.limits.pids" },
      { { hooks = { onExecute = function() end } }, "policy.hooks.onExecute" },
      { { hooks = { onExec = "yes" } }, "policy.hooks.onExec" },
      { { network = "internet" }, "policy.network" },
      { { mounts = { { type = "overlay", dst = "/x" } } }, "policy.mounts[1].type" },
      -- a key a mount does not take (a read-only bind is ro_bind), a map, a climb
      { { mounts = { { type = "bind", src = "/tmp", dst = "/x", readonly = true } } }, "policy.mounts[1].readonly" },
      { { mounts = { a = { type = "tmpfs", dst = "/x" } } }, "policy.mounts.a" },
      { { mounts = { { type = "tmpfs", dst = "/a/../../x" } } }, "policy.mounts[1].dst" },
      { { mounts = { { type = "proc", src = "/proc", dst = "/x" } } }, "policy.mounts[1].src" },
      { { hostname = ("h"):rep(65) }, "policy.hostname" },
      { { hostname = "a b" }, "policy.hostname" },
      -- limits are integers; below these floors nothing could run
      { { limits = { maxSessions = 1.5 } }, "policy.limits.maxSessions" },
      { { limits = { openFiles = 5 } }, "policy.limits.openFiles" },
      { { limits = { cpuTime = 0 } }, "policy.limits.cpuTime" },
      { { limits = { memoryBytes = 1000 } }, "policy.limits.memoryBytes" },
      { { limits = { diskBytes = 1024 * 1024 } }, "policy.limits.diskBytes" },
      { { limits = { cpuWeight = 10001 } }, "policy.limits.cpuWeight" }, -- (cgroup v2's ceiling)
      -- (0 turns off memoryBytes, pids, diskBytes and cpuWeight only)
      { { limits = { openFiles = 0 } }, "policy.limits.openFiles" },
      { { env = { ["1X"] = "y" } }, "policy.env" },
    } do
      local err = err_of(policy.validate, case[1])
      assert.equal("VALIDATION_FAILED", err.code)
      assert.equal(case[2], err.context.field)
    end
  end)

  it("says which key a mistyped one probably is", function()
    assert.equal("policy.limits.memoryByte: unknown key (did you mean memoryBytes?)",
      err_of(policy.validate, { limits = { memoryByte = 1 } }).message)
    assert.equal("policy.limts: unknown key (did you mean limits?)", err_of(policy.validate, { limts = {} }).message)
    assert.equal("policy.zzzz: unknown key", err_of(policy.validate, { zzzz = 1 }).message)
    assert.equal("policy.hooks.onExek: unknown hook (did you mean onExec?)",
      err_of(policy.validate, { hooks = { onExek = function() end } }).message)
  end)

  it("names the presets by their names; an unknown name lists them", function()
    assert.equal(moonbox.policies.strict, policy.load("strict"))
    assert.equal(moonbox.policies.dev, policy.load("dev"))
    assert.equal(moonbox.policies.strict, policy.load("moonbox.policies.strict"))
    local err = err_of(policy.load, "stirct")
    assert.same({ "VALIDATION_FAILED", "policy" }, { err.code, err.context.field })
    assert.equal('policy: unknown policy "stirct": the presets are dev, strict; ' ..
      "or give a module name or a path to a .lua file", err.message)
    if os.getenv("MOONBOX_TEST_ISOLATION") == "none" then
      -- its network = "none" needs namespaces: refused, never quietly the host's
      run_task(function()
        local e = err_of(helper.new_sandbox, { policy = "strict" })
        assert.same({ "VALIDATION_FAILED", "policy.network" }, { e.code, e.context.field })
      end)
    else
      with_sandbox({ policy = "strict" }, function(sb)
        assert.equal(moonbox.policies.strict.limits.maxSessions, sb:info().limits.maxSessions)
      end)
    end
  end)

  it("offers presets as plain data", function()
    assert.equal("strict", moonbox.policies.strict.name)
    assert.equal(30000, moonbox.policies.strict.limits.commandTimeoutMs)
    assert.equal("host", moonbox.policies.dev.network)
    assert.same(moonbox.policies.strict, policy.validate(moonbox.policies.strict))
  end)
end)

describe("policy hooks", function()
  it("asks onRunCode before code runs (before a default context starts) and onTerminal before a shell", function()
    local asked = {}
    with_sandbox({ policy = { hooks = {
      onRunCode = function(_, code, o)
        asked[#asked + 1] = o.language
        if code:find("forbidden", 1, true) then return nil, "no such code" end
        if code == "print('asked')" then return "print('rewritten')" end
        return true
      end,
      onTerminal = function(_, o)
        if o.shell == "sh" then return nil, "bash only" end
        o.cols = 100
        return o
      end,
    } } }, function(sb)
      local err = err_of(sb.runCode, sb, "print('forbidden')", { language = "lua" })
      assert.same({ "POLICY_DENIED", "onRunCode" }, { err.code, err.context.hook })
      assert.same({}, sb:listCodeContexts()) -- denied before any interpreter started
      local r = sb:runCode("print('asked')", { language = "lua" })
      assert.same({ "rewritten\n" }, r.logs.stdout)
      assert.equal("POLICY_DENIED", err_of(sb.runCodeStream, sb, "print('forbidden')", { language = "lua" }).code)
      assert.same({ "lua", "lua", "lua" }, asked)
      assert.same({ "POLICY_DENIED", "onTerminal" }, { err_of(sb.terminal, sb, { shell = "sh" }).code,
        err_of(sb.terminal, sb, { shell = "sh" }).context.hook })
      local t = sb:terminal {}
      assert.equal(100, t.cols)
      t:close()
    end)
  end)

  it("a hook's wrong replacement is POLICY_ERROR saying what is wrong with it", function()
    for _, case in ipairs {
      { "echo a\0b", "a command with a NUL byte" }, { "  ", "a blank command" }, { {}, "an empty argv" },
      { { x = 1 }, "a table that is not an argv" }, { { "ls", {} }, "an argv with a table word" },
    } do
      local err = err_of(policy.call_hook, { hooks = { onExec = function() return case[1] end } }, "onExec", "exec", {})
      assert.equal("POLICY_ERROR", err.code)
      assert.truthy(err.message:find(case[2], 1, true), err.message)
    end
  end)

  it("env false removes a default from every shell, the prewarmed one too", function()
    with_sandbox({ policy = { env = { LANG = false, EXTRA = "e" } } }, function(sb)
      assert.equal("unset e\n", sb:exec("echo ${LANG-unset} $EXTRA").stdout)
      local s = sb:createSession { id = "other" }
      assert.equal("unset e\n", s:exec("echo ${LANG-unset} $EXTRA").stdout)
    end)
  end)

  it("deny with a reason, or rewrite, for sessions, exec, processes and env", function()
    with_sandbox({ policy = { hooks = {
      onCreateSession = function(_, opts) if opts.id == "forbidden" then return nil, "not that one" end return opts end,
      onExec = function(_, cmd)
        if type(cmd) == "string" and cmd:find("curl") then return nil, "no network tools" end
        if cmd == "whoami-please" then return "echo rewritten" end
        return cmd
      end,
      onStartProcess = function(_, cmd) if cmd:find("nc ") then return nil, "no listeners" end return cmd end,
      onEnv = function(_, map) map.INJECTED = "by-policy" return map end,
    } } }, function(sb)
      local err = err_of(sb.createSession, sb, { id = "forbidden" })
      assert.equal("POLICY_DENIED", err.code)
      assert.truthy(err.message:find("not that one", 1, true))
      assert.equal("POLICY_DENIED", err_of(sb.exec, sb, "curl http://example.com").code)
      assert.equal("rewritten\n", sb:exec("whoami-please").stdout)
      assert.equal("POLICY_DENIED", err_of(sb.startProcess, sb, "nc -l 9999").code)
      local s = sb:createSession { id = "ok" }
      s:setEnvVars { A = "1" }
      assert.equal("1 by-policy\n", s:exec("echo $A $INJECTED").stdout)
    end)
  end)
end)

describe("policy limits", function()
  it("enforces openFiles, fileSizeBytes and the memory limit, and reports what is in force", function()
    with_sandbox({ limits = { openFiles = 64, fileSizeBytes = 1024 * 1024, memoryBytes = 64 * 1024 * 1024 } },
      function(sb)
        local info = sb:info()
        assert.equal(64, info.limits.openFiles)
        assert.truthy(info.enforcement.openFiles)
        assert.equal("64\n", sb:exec("ulimit -n").stdout)
        local r = sb:exec("head -c 2000000 /dev/zero > big; echo $?")
        assert.equal("153\n", r.stdout) -- 128 + SIGXFSZ
        if info.enforcement.memoryBytes then
          r = sb:exec("python3 -c 'x = bytearray(300 * 1024 * 1024)'")
          assert.equal(137, r.exitCode)
          assert.is_true(r.oomKilled)
        else
          assert.truthy(("," .. table.concat(info.notEnforced, ",") .. ","):find(",memoryBytes,", 1, true))
        end
      end)
  end)

  it("applies commandTimeoutMs from the policy", function()
    with_sandbox({ policy = { limits = { commandTimeoutMs = 200 } } }, function(sb)
      local r = sb:exec("sleep 5")
      assert.is_true(r.timedOut)
      assert.equal(124, r.exitCode)
    end)
  end)
end)

describe("policy files", function()
  it("change behaviour without a rebuild: moonbox --policy file.lua script.lua", function()
    local dir = helper.sh("mktemp -d")
    local pf = io.open(dir .. "/policy.lua", "w")
    pf:write([[return { hooks = { onExec = function(_, cmd) return nil, "read-only hour" end } }]])
    pf:close()
    local sf = io.open(dir .. "/script.lua", "w")
    sf:write(([[
      local moonbox = require "moonbox"
      local sb = moonbox.getSandbox("polfile-%d", { root = %q })
      local ok, err = pcall(sb.exec, sb, "true")
      print(ok, err.code)
      sb:destroy()
    ]]):format(core.getpid(), dir .. "/root"))
    sf:close()
    local bin = os.getenv("MOONBOX_BIN") or "build/moonbox"
    local out = (helper.sh(bin .. " " .. dir .. "/script.lua") .. "\n")
    assert.equal("true\tnil\n", out) -- without the policy the command runs
    out = (helper.sh(bin .. " --policy " .. dir .. "/policy.lua " .. dir .. "/script.lua") .. "\n")
    assert.equal("false\tPOLICY_DENIED\n", out)
    os.execute("rm -rf " .. dir)
  end)

  it("loads a policy file path given to getSandbox", function()
    local path = os.tmpname() .. ".lua"
    local f = io.open(path, "w")
    f:write("return { limits = { maxSessions = 1 } }")
    f:close()
    with_sandbox({ policy = path }, function(sb)
      sb:createSession {}
      assert.equal("POLICY_DENIED", err_of(sb.createSession, sb, {}).code)
      -- the default session counts too (limits.maxSessions)
      local err = err_of(sb.exec, sb, "true")
      assert.same({ "POLICY_DENIED", "maxSessions" }, { err.code, err.context.limit })
      assert.equal(1, #sb:listSessions())
    end)
    os.remove(path)
  end)
end)
