-- lua/moonbox/types.lua (the lua-language-server annotations of the public
-- API) cannot drift from docs/api.md or from the implementation: every call
-- docs/api.md names is annotated on the class it belongs to, and every public
-- method the runtime's objects really have is annotated too.
local moonbox = require "moonbox"

local source_dir = os.getenv("MOONBOX_SOURCE_DIR") or "."

local function read(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("*a")
  f:close()
  return s
end

-- types.lua: classes, their parents and their annotated functions
local function parse_types(text)
  local classes = {} -- name -> { parent = name?, methods = {name = true}, fields = {name = true} }
  local current
  for line in (text .. "\n"):gmatch("(.-)\n") do
    local name, parent = line:match("^%-%-%-@class%s+([%w_]+)%s*:?%s*([%w_]*)")
    if name then
      classes[name] = classes[name] or { methods = {}, fields = {} }
      if parent ~= "" then classes[name].parent = parent end
      current = name
    end
    local field = line:match("^%-%-%-@field%s+([%w_]+)")
    if field and current then classes[current].fields[field] = true end
    local cls, method = line:match("^function ([%w_]+)[:.]([%w_]+)%(")
    if cls then
      classes[cls] = classes[cls] or { methods = {}, fields = {} }
      classes[cls].methods[method] = true
    end
  end
  -- `local moonbox = {}` under `---@class moonbox`: its functions are moonbox.*
  return classes
end

local function has_method(classes, cls, name)
  while cls do
    local c = classes[cls]
    if not c then return false end
    if c.methods[name] then return true end
    cls = c.parent
  end
  return false
end

local types_text = read(source_dir .. "/lua/moonbox/types.lua")
local classes = parse_types(types_text)

describe("lua/moonbox/types.lua", function()
  it("is a definition file lua-language-server reads, and loads as plain Lua", function()
    assert.truthy(types_text:match("^%-%-%-@meta\n"))
    local chunk = assert(loadstring(types_text, "types.lua"))
    assert.equals("table", type(chunk())) -- no side effects: a table of empty functions
    for _, name in ipairs { "Sandbox", "Session", "SessionMethods", "Process", "Terminal", "Task",
                             "ExecOptions", "ExecResult", "ExecEvent", "SandboxOptions", "SessionOptions",
                             "ProcessOptions", "ReadFileResult", "FileInfo", "RunCodeResult", "Policy",
                             "Limits", "MoonboxError" } do
      assert.is_table(classes[name], name)
    end
  end)

  it("annotates every option and result field the contract names for exec", function()
    for _, f in ipairs { "timeout", "env", "cwd", "stdin", "onOutput", "maxOutputBytes" } do
      assert.is_true(classes.ExecOptions.fields[f] == true, "ExecOptions." .. f)
    end
    for _, f in ipairs { "success", "exitCode", "stdout", "stderr", "command", "duration", "timestamp",
                         "sessionId", "timedOut", "truncated" } do
      assert.is_true(classes.ExecResult.fields[f] == true, "ExecResult." .. f)
    end
  end)

  it("annotates every call docs/api.md names, on its class", function()
    local api = read(source_dir .. "/docs/api.md")
    local receivers = { moonbox = "moonbox", sandbox = "Sandbox", session = "Session", t = "Terminal",
                        task = "Task", process = "Process" }
    local wanted = {} -- "Class.name" -> true
    local function want(cls, name) wanted[cls .. "." .. name] = { cls, name } end
    -- receiver:name( / receiver.name( / receiver:name{
    for recv, sep, name in api:gmatch("`([%w_]+)([:.])([%a_][%w_]*)[%(%{]") do
      if receivers[recv] and not (recv == "moonbox" and sep == ":") then want(receivers[recv], name) end
    end
    -- the first column of a call table: | `name(...)` | (sandbox and session calls)
    for line in api:gmatch("[^\n]+") do
      local name = line:match("^| `([%a_][%w_]*)%(")
      if name then want("Session", name) end
    end
    -- "Process fields: ... Methods: `kill(signal?)`, ..." up to the paragraph's end
    local methods = api:match("Process fields:.-Methods:(.-)\n\n")
    assert.is_string(methods, "docs/api.md: the process paragraph")
    for name in methods:gmatch("`([%a_][%w_]*)%(") do want("Process", name) end
    -- "## Files\n`writeFile`, `readFile`, ... on every session"
    local files = api:match("\n## Files\n(.-) on\nevery session") or api:match("\n## Files\n(.-) on every session")
    assert.is_string(files, "docs/api.md: the file calls' paragraph")
    for name in files:gmatch("`([%a_][%w_]*)`") do want("Session", name) end

    local count, missing = 0, {}
    for key, w in pairs(wanted) do
      count = count + 1
      if not has_method(classes, w[1], w[2]) then missing[#missing + 1] = key end
    end
    table.sort(missing)
    assert.same({}, missing)
    assert.is_true(count >= 60, "only " .. count .. " calls found in docs/api.md")
  end)

  it("annotates every public method the runtime's objects have", function()
    run_task(function()
      local sb = helper.new_sandbox { isolation = "none" }
      local ok, err = pcall(function()
        local missing = {}
        local function check(obj, cls)
          local mt = getmetatable(obj)
          local index = mt and mt.__index
          assert.is_table(index, cls .. ": a metatable with an __index table")
          for name, v in pairs(index) do
            -- (snake_case and _private names are the runtime's own helpers)
            if type(v) == "function" and not name:find("_") and not has_method(classes, cls, name) then
              missing[#missing + 1] = cls .. ":" .. name
            end
          end
        end
        check(sb, "Sandbox")
        local session = sb:createSession { id = "types" }
        check(session, "Session")
        local p = session:startProcess("true")
        p:waitForExit(10000)
        check(p, "Process")
        local t = session:terminal {}
        check(t, "Terminal")
        t:close()
        for name, v in pairs(moonbox) do
          if type(v) == "function" and not has_method(classes, "moonbox", name) then
            missing[#missing + 1] = "moonbox." .. name
          end
        end
        table.sort(missing)
        assert.same({}, missing)
      end)
      sb:destroy()
      if not ok then error(err, 0) end
    end)
  end)
  it("lists for every public method the parameters lib/arity.lua checks calls against", function()
    local declared = {} -- "Class.name" -> "a, b"
    for cls, name, params in types_text:gmatch("\nfunction ([%w_]+):([%w_]+)%(([^)]*)%)") do
      if cls == "SessionMethods" then cls = "Session" end
      declared[cls .. "." .. name] = params
    end
    local arity = require "moonbox.lib.arity"
    local count = 0
    for kind, methods in pairs(arity.params) do
      for name, params in pairs(methods) do
        count = count + 1
        assert.equal(declared[kind .. "." .. name], table.concat(params, ", "), kind .. "." .. name)
      end
    end
    for key in pairs(declared) do
      local kind, name = key:match("^(%w+)%.(%w+)$")
      if arity.params[kind] then assert.truthy(arity.params[kind][name], "lib/arity.lua lacks " .. key) end
    end
    assert.is_true(count >= 50)
    -- and a call past them is refused, naming the argument
    run_task(function()
      local sb = helper.new_sandbox { isolation = "none" }
      local ok, err = pcall(function()
        sb:writeFile("f", "x")
        local e = helper.error_of(sb.exists, sb, "f", "other-session")
        assert.equal("VALIDATION_FAILED", e.code)
        assert.equal("exists argument 2", e.context.field)
        assert.is_true(sb:exists("f", nil).exists) -- a trailing nil is no argument
      end)
      sb:destroy()
      if not ok then error(err, 0) end
    end)
  end)
end)
