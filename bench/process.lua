-- startProcess + waitForExit of /bin/true against a raw spawn in the same run.
-- Run: ./build/moonbox bench/process.lua [iterations]
local moonbox = require "moonbox"
local core = require "moonbox.core"
local async = require "moonbox.async"

local N = tonumber(arg and arg[1]) or 500
local function ms() return core.hrtime() / 1e6 end

moonbox.run(function()
  local sb = moonbox.getSandbox("bench-process", { root = os.tmpname() .. ".d" })
  sb:exec("true")
  local t = ms()
  for _ = 1, N do
    async.await(function(resume)
      assert(core.spawn { args = { "/bin/true" }, stdio = { [0] = "null", [1] = "pipe", [2] = "pipe" },
        on_exit = function() resume() end })
    end)
  end
  local raw_rate = N / ((ms() - t) / 1000)
  t = ms()
  for _ = 1, N do
    local p = sb:startProcess({ "/bin/true" }, { autoCleanup = true })
    p:waitForExit()
  end
  local rate = N / ((ms() - t) / 1000)
  print(("raw spawn+wait: %.0f/s; startProcess+waitForExit: %.0f/s (%.2fx)"):format(raw_rate, rate, rate / raw_rate))
  sb:destroy()
end)
