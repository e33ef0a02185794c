-- spec/assertion_count.lua (installed by spec/helper.lua): a test that makes
-- no assertion fails, naming itself; one that asserts, or says why it
-- cannot run here with pending(), does not. Checked on a spec file of its
-- own, run by busted as CTest runs every spec.
local function q(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

local PROBE = [[
describe("probe", function()
  it("asserts nothing", function() local _ = 1 + 1 end)
  it("loops over nothing", function()
    for _, v in ipairs { nil, 1, 2 } do assert.equal(v, v) end
  end)
  it("asserts with plain assert", function() assert(true) end)
  it("asserts with luassert", function() assert.is_not.equal(1, 2) end)
  it("asserts in a task", function() run_task(function() assert.is_true(true) end) end)
  it("cannot run here", function() pending("the probe says so") end)
end)
]]

-- busted on a spec file with spec/helper.lua, as cmake/tests.cmake runs it
-- -> its output, and whether it exited 0
local function run_busted(text)
  local dir = helper.mkdtemp()
  local f = assert(io.open(dir .. "/probe_spec.lua", "w"))
  f:write(text)
  f:close()
  -- (the sanitizer build's luajit needs its preload, which helper.sh drops)
  local preload = os.getenv("LD_PRELOAD")
  local out = helper.sh(("%s luajit \"$(command -v busted)\" --helper=spec/helper.lua -o utfTerminal %s 2>&1;"
    .. " echo \"exit=$?\""):format(preload and "LD_PRELOAD=" .. q(preload) or "", q(dir .. "/probe_spec.lua")))
  helper.sh("rm -rf " .. q(dir))
  return out
end

describe("spec/assertion_count.lua", function()
  it("fails each test that made no assertion, by name, and only those; a pending test is pending", function()
    local out = run_busted(PROBE)
    assert.truthy(out:find("3 successes / 2 failures / 0 errors / 1 pending", 1, true), out)
    assert.truthy(out:find("probe asserts nothing\n[^\n]*:2: the test made no assertion", 1), out)
    assert.truthy(out:find("probe loops over nothing\n[^\n]*:3: the test made no assertion", 1), out)
    assert.truthy(out:find("the probe says so", 1, true), out)
    assert.truthy(out:find("exit=[1-9]%d*\n?$"), out) -- (busted's status: the run failed)
  end)
end)
