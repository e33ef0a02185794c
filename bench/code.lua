-- runCode("1+1") round trip per language and context creation, against
-- starting the bare interpreter, in the same run.
-- Run: ./build/moonbox bench/code.lua [iterations]
local moonbox = require "moonbox"
local core = require "moonbox.core"
local async = require "moonbox.async"

local N = tonumber(arg and arg[1]) or 300
local function ms() return core.hrtime() / 1e6 end
local function p50(t) table.sort(t) return t[math.max(1, math.floor(#t / 2))] end
local function p99(t) table.sort(t) return t[math.max(1, math.floor(#t * 0.99))] end

local bare = { python = { "/usr/bin/python3", "-c", "pass" }, javascript = { "node", "-e", "0" },
  lua = { "luajit", "-e", "" } }

moonbox.run(function()
  local sb = moonbox.getSandbox("bench-code", { root = os.tmpname() .. ".d" })
  print("| language | bare start p50 | createCodeContext p50 | runCode(\"1+1\") p50 | p99 |")
  print("|---|---|---|---|---|")
  for _, lang in ipairs { "python", "javascript", "lua" } do
    local starts, creates, runs = {}, {}, {}
    for i = 1, 10 do
      local t = ms()
      async.await(function(resume)
        assert(core.spawn { args = bare[lang], env = { PATH = "/usr/bin:/bin" },
          stdio = { [0] = "null", [1] = "null", [2] = "null" }, on_exit = function() resume() end })
      end)
      starts[i] = ms() - t
      t = ms()
      local ctx = sb:createCodeContext { language = lang }
      creates[i] = ms() - t
      if i < 10 then sb:deleteCodeContext(ctx.id) end
    end
    local ctx = sb:listCodeContexts()[1]
    for i = 1, N do
      local t = ms()
      sb:runCode("1+1", { context = ctx.id })
      runs[i] = ms() - t
    end
    sb:deleteCodeContext(ctx.id)
    print(("| %s | %.1f ms | %.1f ms | %.3f ms | %.3f ms |"):format(lang, p50(starts), p50(creates), p50(runs),
      p99(runs)))
  end
  sb:destroy()
end)
