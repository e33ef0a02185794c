-- Values as a person reads them at the prompt (moonbox.repl): a command's
-- result (exitCode with stdout and stderr) as its exit code and its output,
-- other tables as sorted, indented Lua-like literals. Bounded: nesting past
-- MAX_DEPTH, entries past MAX_ENTRIES per table and text past MAX_BYTES
-- overall are cut with a note, and a table met again prints as a reference.
local M = {}

M.MAX_DEPTH = 4
M.MAX_ENTRIES = 50
M.MAX_BYTES = 64 * 1024

local IDENT = "^[%a_][%w_]*$"
local KEYWORDS = {}
for w in ([[and break do else elseif end false for function if in local nil not or repeat return then true
  until while]]):gmatch("%a+") do KEYWORDS[w] = true end

local function is_command_result(v)
  return type(v.exitCode) == "number" and type(v.stdout) == "string" and type(v.stderr) == "string"
end

-- keys in a stable order: the array part first, then numbers, then strings
local function sorted_keys(t)
  local n, keys = #t, {}
  for k in pairs(t) do
    if not (type(k) == "number" and k >= 1 and k <= n and k % 1 == 0) then keys[#keys + 1] = k end
  end
  table.sort(keys, function(a, b)
    local ta, tb = type(a), type(b)
    if ta ~= tb then return ta < tb end
    if ta == "number" or ta == "string" then return a < b end
    return tostring(a) < tostring(b)
  end)
  return n, keys
end

local function scalar(v)
  if type(v) == "string" then return (("%q"):format(v):gsub("\\\n", "\\n")) end
  return tostring(v)
end

local function key_text(k)
  if type(k) == "string" and k:match(IDENT) and not KEYWORDS[k] then return k end
  return "[" .. scalar(k) .. "]"
end

-- A writer that stops keeping text past MAX_BYTES.
local function writer()
  local parts, size, cut = {}, 0, false
  local w = {}
  function w.put(s)
    if cut then return end
    if size + #s > M.MAX_BYTES then
      parts[#parts + 1] = s:sub(1, M.MAX_BYTES - size)
      parts[#parts + 1] = "\n... (output cut at " .. M.MAX_BYTES .. " bytes)"
      cut = true
      return
    end
    parts[#parts + 1] = s
    size = size + #s
  end
  function w.text() return table.concat(parts) end
  return w
end

local function table_text(w, t, indent, seen, depth)
  if seen[t] then w.put("<cycle: " .. tostring(t) .. ">") return end
  local mt = getmetatable(t)
  if mt and mt.__tostring then w.put(tostring(t)) return end
  if depth > M.MAX_DEPTH then w.put("{...}") return end
  local n, keys = sorted_keys(t)
  if n == 0 and #keys == 0 then w.put("{}") return end
  seen[t] = true
  local inner = indent .. "  "
  w.put("{\n")
  local shown = 0
  local function entry(k, v, with_key)
    shown = shown + 1
    if shown > M.MAX_ENTRIES then return false end
    w.put(inner)
    if with_key then w.put(key_text(k) .. " = ") end
    if type(v) == "table" then table_text(w, v, inner, seen, depth + 1) else w.put(scalar(v)) end
    w.put(",\n")
    return true
  end
  local total = n + #keys
  local stopped = false
  for i = 1, n do
    if not entry(i, t[i], false) then stopped = true break end
  end
  if not stopped then
    for _, k in ipairs(keys) do
      if not entry(k, t[k], true) then break end
    end
  end
  if total > M.MAX_ENTRIES then w.put(inner .. ("-- ... %d more\n"):format(total - M.MAX_ENTRIES)) end
  w.put(indent .. "}")
  seen[t] = nil
end

-- A command's result: "exit N" (and how it ended when not plainly), then
-- its standard output and error, each under a header, when not empty.
local function command_text(w, r)
  local notes = {}
  if r.timedOut then notes[#notes + 1] = "timed out" end
  if r.cancelled then notes[#notes + 1] = "cancelled" end
  if r.oomKilled then notes[#notes + 1] = "killed: out of memory" end
  if r.truncated then notes[#notes + 1] = "output truncated" end
  w.put("exit " .. tostring(r.exitCode))
  if #notes > 0 then w.put(" (" .. table.concat(notes, ", ") .. ")") end
  for _, name in ipairs { "stdout", "stderr" } do
    local text = r[name]
    if text ~= "" then
      w.put("\n--- " .. name .. "\n")
      w.put(text:sub(-1) == "\n" and text:sub(1, -2) or text)
    end
  end
  if r.stdout == "" and r.stderr == "" then w.put(", no output") end
end

-- format(value) -> text. Strings, numbers and the rest print as tostring
-- does (as `luajit -i` prints them); tables as above.
function M.format(v)
  if type(v) ~= "table" then return tostring(v) end
  local w = writer()
  if is_command_result(v) then command_text(w, v) else table_text(w, v, "", {}, 1) end
  return w.text()
end

return M
