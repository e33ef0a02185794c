-- match-lines.lua expected actual: line i of actual must match the Lua
-- pattern on line i of expected (anchored), and the counts must agree.
local function lines(path)
  local t = {}
  for l in io.lines(path) do t[#t + 1] = l end
  return t
end
local want, got = lines(arg[1]), lines(arg[2])
for i = 1, math.max(#want, #got) do
  local w, g = want[i], got[i]
  if not w or not g or not g:match("^" .. w .. "$") then
    io.stderr:write(("line %d: expected pattern %q, got %q\n"):format(i, tostring(w), tostring(g)))
    os.exit(1)
  end
end
