-- A test that asserts nothing cannot fail: it passes whatever the code does
-- (a loop over an empty list, an early return where the host lacks
-- something). Loaded by spec/helper.lua, so in every run of busted (CTest's
-- spec.*, the ASan build, unprivileged.*, fresh_root.*): it counts the
-- assertions each `it` block makes (luassert's assert(v) and every
-- assert.<name>(...)) and fails a test that returned with none, naming it.
-- A test that cannot run here says so with pending("why") instead.
local M = {}

local count = 0

local function counting(fn)
  return function(...)
    count = count + 1
    return fn(...) -- a tail call: error levels inside fn stay the caller's
  end
end

-- assert.equal(...), assert.is_true(...), spies' was_called(), ...: each
-- assertion's callback, once per assertion table (aliases share one)
local function wrap_assertions()
  local namespaces = require "luassert.namespaces"
  local seen = {}
  for _, assertion in pairs(namespaces.assertion or {}) do
    if not seen[assertion] and type(assertion.callback) == "function" then
      seen[assertion] = true
      assertion.callback = counting(assertion.callback)
    end
  end
end

-- assert(v, message): luassert's __call
local function wrap_call()
  local mt = getmetatable(require "luassert")
  mt.__call = counting(mt.__call)
end

function M.count() return count end

function M.install(busted)
  wrap_assertions()
  wrap_call()
  busted.subscribe({ "test", "start" }, function(element)
    count = 0
    local run = element.run
    -- busted reads element.run after this event: the check runs inside the
    -- test, so a test that asserted nothing is a failure like any other
    element.run = function(...)
      element.run = run
      run(...)
      if count == 0 then
        local at = element.trace and (element.trace.short_src .. ":" .. element.trace.currentline .. ": ") or ""
        busted.fail(at .. "the test made no assertion: it cannot fail (assert what it checks, or "
          .. "pending(\"why\") where this host cannot run it)", 0)
      end
    end
    return nil, true
  end)
end

return M
