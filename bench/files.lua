-- writeFile/readFile of 100 MB against cp of the same file, in the same run.
-- Run: ./build/moonbox bench/files.lua [runs]
local moonbox = require "moonbox"
local core = require "moonbox.core"
local root = io.popen("mktemp -d"):read("*l")
local sb = moonbox.getSandbox("fbench", { root = root, limits = { maxFileBytes = 256 * 1024 * 1024 } })
local N = tonumber(arg and arg[1]) or 5
local function ms() return core.hrtime() / 1e6 end
local b = {} for i = 0, 255 do b[#b + 1] = string.char(i) end
local data = table.concat(b):rep(100 * 1024 * 1024 / 256)
local line = "0123456789abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,;:!?-=+()[]{}<>/|~'\"\n"
local text = line:rep(math.ceil(100 * 1024 * 1024 / #line)):sub(1, 100 * 1024 * 1024)
local b64 = core.base64_encode(data)
local ws = root .. "/workspace/"
local results = {}
local function time(name, fn)
  local s = {}
  for i = 1, N do collectgarbage() collectgarbage() local t = ms() fn() s[i] = ms() - t end
  table.sort(s)
  results[#results + 1] = ("| %-40s | %8.1f | %8.1f |"):format(name, s[math.ceil(N / 2)], s[1])
end
sb:writeFile("raw.bin", data)
time("cp 100 MB (os.execute cp)", function() os.execute("cp " .. ws .. "raw.bin " .. ws .. "cp.bin") end)
time("cp 100 MB (cp inside exec)", function() sb:exec("cp raw.bin cp2.bin") end)
time("writeFile utf-8, text", function() sb:writeFile("text.txt", text) end)
time("writeFile utf-8, all byte values", function() sb:writeFile("raw.bin", data) end)
time("writeFile base64, all byte values", function() sb:writeFile("b64.bin", b64, { encoding = "base64" }) end)
time("readFile text (utf-8 auto)", function() local r = sb:readFile("text.txt") assert(#r.content == #text) end)
time("readFile binary, encoding utf-8", function()
  local r = sb:readFile("raw.bin", { encoding = "utf-8" }) assert(#r.content == #data) end)
time("readFile binary (base64 auto)", function()
  local r = sb:readFile("b64.bin") assert(r.encoding == "base64" and #r.content == #b64) end)
time("readFileStream 100 MB", function() local n = 0 for c in sb:readFileStream("raw.bin") do n = n + #c end end)
print(("| %-40s | %8s | %8s |"):format("100 MB, " .. N .. " runs", "median ms", "min ms"))
for _, r in ipairs(results) do print(r) end
sb:destroy()
