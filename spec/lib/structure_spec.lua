-- The shape of lua/moonbox (docs/architecture.md, "Composition"): the
-- modules form no cycle, counting every require (a require inside a
-- function is an edge too: it only hides the cycle until a call), and a
-- file uses another file's underscore names (its privates) never: what one
-- part may use of another is a public method, listed in the docs.
local ROOT = "lua/moonbox"

-- Every .lua file under dir, as paths relative to the repository.
local function lua_files(dir)
  local out = {}
  local p = assert(io.popen("find " .. dir .. " -name '*.lua' | LC_ALL=C sort"))
  for line in p:lines() do out[#out + 1] = line end
  p:close()
  return out
end

local function read(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("*a")
  f:close()
  return s
end

-- The source with comments removed and each string literal replaced by
-- @N@ (its index in the returned list), so what is left is code only.
local function lex(src)
  local code, strings, i, n = {}, {}, 1, #src
  local function long_bracket(at)
    local eq = src:match("^%[(=*)%[", at)
    if not eq then return nil end
    local close = "]" .. eq .. "]"
    local s, e = src:find(close, at + #eq + 2, true)
    assert(s, "unterminated long bracket")
    return src:sub(at + #eq + 2, s - 1), e + 1
  end
  while i <= n do
    local c = src:sub(i, i)
    if src:sub(i, i + 1) == "--" then
      local _, after = long_bracket(i + 2)
      if after then
        i = after
      else
        local nl = src:find("\n", i, true) or n + 1
        i = nl
      end
    elseif c == '"' or c == "'" then
      local j, buf = i + 1, {}
      while j <= n do
        local d = src:sub(j, j)
        if d == "\\" then
          buf[#buf + 1] = src:sub(j, j + 1)
          j = j + 2
        elseif d == c then
          break
        else
          buf[#buf + 1] = d
          j = j + 1
        end
      end
      strings[#strings + 1] = table.concat(buf)
      code[#code + 1] = "@" .. #strings .. "@"
      i = j + 1
    elseif c == "[" and src:match("^%[=*%[", i) then
      local body, after = long_bracket(i)
      strings[#strings + 1] = body
      code[#code + 1] = "@" .. #strings .. "@"
      i = after
    else
      code[#code + 1] = c
      i = i + 1
    end
  end
  return table.concat(code), strings
end

local function module_of(path)
  local m = path:gsub("%.lua$", ""):gsub("/init$", ""):gsub("^lua/", ""):gsub("/", ".")
  return m
end

local files = lua_files(ROOT)
local code_of, strings_of, by_module = {}, {}, {}
for _, path in ipairs(files) do
  code_of[path], strings_of[path] = lex(read(path))
  by_module[module_of(path)] = path
end

-- module -> sorted list of moonbox modules it requires (anywhere in it).
local function require_graph()
  local graph = {}
  for _, path in ipairs(files) do
    local seen, deps = {}, {}
    for idx in code_of[path]:gmatch("%f[%w_]require%s*%(?%s*@(%d+)@") do
      local name = strings_of[path][tonumber(idx)]
      if by_module[name] and not seen[name] and name ~= module_of(path) then
        seen[name] = true
        deps[#deps + 1] = name
      end
    end
    table.sort(deps)
    graph[module_of(path)] = deps
  end
  return graph
end

-- Every cycle's members, one list per strongly connected component of more
-- than one module (Tarjan), each printed as a path that closes.
local function cycles(graph)
  local index, low, on, stack, out, counter = {}, {}, {}, {}, {}, 0
  local function visit(v)
    counter = counter + 1
    index[v], low[v] = counter, counter
    stack[#stack + 1] = v
    on[v] = true
    for _, w in ipairs(graph[v] or {}) do
      if not index[w] then
        visit(w)
        low[v] = math.min(low[v], low[w])
      elseif on[w] then
        low[v] = math.min(low[v], index[w])
      end
    end
    if low[v] == index[v] then
      local comp = {}
      repeat
        local w = table.remove(stack)
        on[w] = nil
        comp[#comp + 1] = w
      until w == v
      if #comp > 1 then
        table.sort(comp)
        out[#out + 1] = comp
      end
    end
  end
  local names = {}
  for m in pairs(graph) do names[#names + 1] = m end
  table.sort(names)
  for _, m in ipairs(names) do
    if not index[m] then visit(m) end
  end
  return out
end

-- One concrete cycle through comp's first module, for the message.
local function one_cycle(graph, comp)
  local member = {}
  for _, m in ipairs(comp) do member[m] = true end
  local start = comp[1]
  local prev, queue, head = { [start] = false }, { start }, 1
  while head <= #queue do
    local v = queue[head]
    head = head + 1
    for _, w in ipairs(graph[v]) do
      if w == start then
        local path = { start }
        local x = v
        while x ~= start do
          table.insert(path, 2, x)
          x = prev[x]
        end
        path[#path + 1] = start
        return table.concat(path, " -> ")
      end
      if member[w] and prev[w] == nil then
        prev[w] = v
        queue[#queue + 1] = w
      end
    end
  end
end

-- The underscore names a file defines: `function X:_n`, `function X._n`,
-- `X._n =` / `self._n =` (also in a list, `a._n, b._m = ...`), and `_n =`
-- as a field of a table constructor.
local function defined_privates(code)
  local defs = {}
  for line in code:gmatch("[^\n]+") do
    local lhs = line:match("^%s*([%w_.,%s%[%]@]-)%s*=[^=]")
    if lhs then
      for name in lhs:gmatch("[.](_[%a_][%w_]*)") do defs[name] = true end
    end
  end
  for name in code:gmatch("function%s+[%w_.]+[.:](_[%a_][%w_]*)%s*%(") do defs[name] = true end
  for name in code:gmatch("[%w_%]][.](_[%a_][%w_]*)%s*=[^=]") do defs[name] = true end
  for name in code:gmatch("[{,;]%s*(_[%a_][%w_]*)%s*=[^=]") do defs[name] = true end
  return defs
end

-- Where a file reads or calls an underscore field: `x._n`, `x:_n(`.
-- (By name, not by class: a few names, _sandbox or _exited, are each
-- defined by several files for their own objects, and a file that defines
-- one may still read another class's field of that name unseen.)
-- Double-underscore names are the language's metamethods, not privates.
local function used_privates(code)
  local uses = {}
  for name in code:gmatch("[%w_%]%)][.:](_[%a][%w_]*)") do uses[name] = true end
  return uses
end

-- Underscore names that are not moonbox's privates.
local ALLOWED = {
  _meta = true, -- MCP's wire field (params._meta of a tools/call), read by mcp/session.lua
}

describe("lua/moonbox structure", function()
  it("finds the modules and their requires", function()
    local graph = require_graph()
    assert.is_truthy(by_module["moonbox.sandbox"])
    assert.is_truthy(by_module["moonbox.session"])
    -- an edge inside a function counts: sandbox/init.lua requires
    -- moonbox.session only where it is needed
    local found = false
    for _, d in ipairs(graph["moonbox.sandbox"]) do
      if d == "moonbox.session" then found = true end
    end
    assert.is_true(found)
  end)

  it("the lexer sees requires in every form and skips comments", function()
    local code, strings = lex([[
local a = require "x.a"
local b = require("x.b")
-- require "x.c"
--[==[ require "x.d" ]==]
local function f() return require('x.e').g end
local s = "require 'x.f'"
]])
    local got = {}
    for idx in code:gmatch("%f[%w_]require%s*%(?%s*@(%d+)@") do got[#got + 1] = strings[tonumber(idx)] end
    assert.same({ "x.a", "x.b", "x.e" }, got)
  end)

  it("has no require cycle", function()
    local graph = require_graph()
    local found = {}
    for _, comp in ipairs(cycles(graph)) do
      found[#found + 1] = table.concat(comp, ", ") .. "\n    e.g. " .. one_cycle(graph, comp)
    end
    assert(#found == 0, "require cycles:\n  " .. table.concat(found, "\n  "))
  end)

  it("uses no underscore name outside the file that defines it", function()
    local defs_of, owners = {}, {}
    for _, path in ipairs(files) do
      defs_of[path] = defined_privates(code_of[path])
      for name in pairs(defs_of[path]) do owners[name] = owners[name] or {}; owners[name][#owners[name] + 1] = path end
    end
    local bad = {}
    for _, path in ipairs(files) do
      for name in pairs(used_privates(code_of[path])) do
        if not defs_of[path][name] and not ALLOWED[name] then
          bad[#bad + 1] = ("%s uses %s (defined in %s)"):format(path, name,
            owners[name] and table.concat(owners[name], ", ") or "no file")
        end
      end
    end
    table.sort(bad)
    assert(#bad == 0, #bad .. " underscore names used outside their file:\n  " .. table.concat(bad, "\n  "))
  end)
end)
