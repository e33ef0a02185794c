-- A small data analysis in Python across several runs (state is kept), a
-- chart returned as PNG and saved, JavaScript and Lua contexts side by side,
-- and an error reported without losing state.
local moonbox = require "moonbox"
local sandbox = moonbox.getSandbox("code-demo", { root = os.tmpname() .. ".d" })
local py = sandbox:createCodeContext { language = "python" }

sandbox:runCode("sales = {'jan': 120, 'feb': 90, 'mar': 150}", { context = py })
local total = sandbox:runCode("sum(sales.values())", { context = py })
print("total sales: " .. total.results[1].text)

local chart = sandbox:runCode([[
import matplotlib.pyplot as plt
fig, ax = plt.subplots()
ax.bar(list(sales), list(sales.values()))
fig]], { context = py })
local png = chart.results[1] and chart.results[1].png
if png then
  local bytes = require("moonbox.core").base64_decode(png)
  local f = assert(io.open(sandbox.root .. "/workspace/chart.png", "wb"))
  f:write(bytes)
  f:close()
  print("chart: " .. (bytes:sub(2, 4) == "PNG" and "png" or "?") .. " saved to /workspace/chart.png")
end

local err = sandbox:runCode("sales['apr'] / 0", { context = py })
print("error: " .. err.error.name)
print("state kept: " .. sandbox:runCode("len(sales)", { context = py }).results[1].text .. " months")

local js = sandbox:createCodeContext { language = "javascript" }
sandbox:runCode("const double = (x) => x * 2", { context = js })
print("javascript: " .. sandbox:runCode("await Promise.resolve(double(21))", { context = js }).results[1].text)
local lua = sandbox:createCodeContext { language = "lua" }
print("lua: " .. sandbox:runCode("local t = {} for i = 1, 5 do t[i] = i * i end return t[5]",
  { context = lua }).results[1].text)
sandbox:destroy()
