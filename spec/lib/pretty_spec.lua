-- moonbox.lib.pretty: what the prompt prints for a value.
local pretty = require "moonbox.lib.pretty"

describe("pretty.format", function()
  it("shows a real command's result as its exit code, stdout and stderr", function()
    run_task(function()
      local sb = helper.new_sandbox()
      local r = sb:exec("printf 'a\\nb\\n'; echo oops >&2; exit 4")
      local quiet = sb:exec("sleep 5", { timeout = 100 })
      sb:destroy()
      assert.equals("exit 4\n--- stdout\na\nb\n--- stderr\noops", pretty.format(r))
      assert.equals("exit 124 (timed out), no output", pretty.format(quiet))
    end)
  end)

  it("prints scalars as tostring does, tables sorted and indented, cycles as references", function()
    assert.equals("text\nas is", pretty.format("text\nas is"))
    assert.equals("42", pretty.format(42))
    assert.equals("nil", pretty.format(nil))
    local t = { "x\ny", 2, b = false, a = { ["end"] = 1, ["not id"] = true } }
    t.self = t
    assert.equals('{\n  "x\\ny",\n  2,\n  a = {\n    ["end"] = 1,\n    ["not id"] = true,\n  },\n' ..
      "  b = false,\n  self = <cycle: " .. tostring(t) .. ">,\n}", pretty.format(t))
    assert.equals("{}", pretty.format({}))
    assert.equals("custom", pretty.format(setmetatable({}, { __tostring = function() return "custom" end })))
  end)

  it("is bounded: depth, entries per table and bytes overall", function()
    assert.equals("{\n  {\n    {\n      {\n        {...},\n      },\n    },\n  },\n}",
      pretty.format({ { { { { 1 } } } } }))
    local many = {}
    for i = 1, pretty.MAX_ENTRIES + 10 do many[i] = i end
    local text = pretty.format(many)
    assert.matches("\n  " .. pretty.MAX_ENTRIES .. ",\n  %-%- %.%.%. 10 more\n}$", text)
    local huge = pretty.format({ ("x"):rep(pretty.MAX_BYTES * 2) })
    assert.is_true(#huge < pretty.MAX_BYTES + 100)
    assert.matches("\n%.%.%. %(output cut at " .. pretty.MAX_BYTES .. " bytes%)$", huge)
  end)
end)
