-- match-lines.lua expected actual: line i of actual must match the Lua
-- pattern on line i of expected (anchored), and the counts must agree.
-- Loaded with the argument "--module" (loadfile(path)("--module")) it returns
-- the matcher instead, for spec/doc-blocks.lua: match(want, got, eq) where
-- want holds patterns (or anything eq understands) and M.GAP entries, each
-- matching any run of lines (none too).
local M = { GAP = setmetatable({}, { __tostring = function() return "..." end }) }

local function pattern_eq(w, g) return g:match("^" .. w .. "$") ~= nil end

-- true, or false and a message naming the first line that does not match
function M.match(want, got, eq)
  eq = eq or pattern_eq
  local best = 0 -- the furthest line reached, for the message
  local function at(i, j)
    if i > #want then
      if j > #got then return true end
      best = math.max(best, j)
      return false
    end
    if want[i] == M.GAP then
      for k = j, #got + 1 do
        if at(i + 1, k) then return true end
      end
      return false
    end
    if j <= #got and eq(want[i], got[j]) then return at(i + 1, j + 1) end
    if j > best or best == 0 then best = j end
    return false
  end
  if at(1, 1) then return true end
  local j = math.max(best, 1)
  return false, ("line %d: got %q; expected:\n  %s"):format(j, tostring(got[j]),
    table.concat((function()
      local t = {}
      for k, w in ipairs(want) do t[k] = tostring(w) end
      return t
    end)(), "\n  "))
end

if ... == "--module" then return M end

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
