-- The MCP core (lua/moonbox/mcp/): JSON-RPC framing and errors, the
-- protocol's methods, argument checks, cancellation (against a stand-in
-- sandbox: no real one is made here), and `moonbox mcp`'s line framing.
-- The tools against real sandboxes, through the official SDK: spec/mcp/client.test.mjs.
local cjson = require "cjson"
local moonbox = require "moonbox"
local jsonrpc = require "moonbox.mcp.jsonrpc"
local session_mod = require "moonbox.mcp.session"
local schema = require "moonbox.mcp.schema"

-- A stand-in sandbox: exec waits until cancelled or released, and says so.
local function fake_provider(log)
  local sb = { id = "fake" }
  function sb.exec(_, command)
    log[#log + 1] = "exec " .. command
    local ok, err = pcall(moonbox.sleep, 60000)
    if not ok then log[#log + 1] = "exec cancelled" error(err, 0) end
    return { exitCode = 0, stdout = "", stderr = "", duration = 0 }
  end
  function sb.destroy(self) self.destroyed = true log[#log + 1] = "destroy" end
  return { get = function() return sb end, exists = function(id) return id == "fake" end }, sb
end

local function initialized(log)
  local s = session_mod.new { sandboxes = fake_provider(log or {}) }
  local r = s:handle { jsonrpc = "2.0", id = 0, method = "initialize",
    params = { protocolVersion = "2025-06-18", capabilities = {}, clientInfo = { name = "spec", version = "1" } } }
  assert.equal("2025-06-18", r.result.protocolVersion)
  return s
end

-- a message through encode and back, as a client reads it
local function wire(msg) return cjson.decode(jsonrpc.encode(msg)) end

describe("mcp jsonrpc", function()
  it("answers bad JSON with a parse error -32700 and id null", function()
    local v, err = jsonrpc.decode('{"jsonrpc": "2.0", "id": 1, "method": ')
    assert.is_nil(v)
    local out = wire(err)
    assert.equal(-32700, out.error.code)
    assert.equal(cjson.null, out.id)
    assert.equal("2.0", out.jsonrpc)
    assert.matches("^parse error", out.error.message)
    assert.equal(-32700, select(2, jsonrpc.decode("\255\254")).error.code)
    assert.equal(-32700, select(2, jsonrpc.decode("   ")).error.code)
  end)

  it("refuses what is not a JSON-RPC 2.0 message with -32600", function()
    for _, text in ipairs { '42', '{"id": 1, "method": "ping"}', '{"jsonrpc": "1.0", "id": 1, "method": "ping"}',
                            '{"jsonrpc": "2.0", "id": 1, "method": 7}',
                            '{"jsonrpc": "2.0", "id": 1.5, "method": "ping"}',
                            '{"jsonrpc": "2.0", "id": 1, "method": "ping", "params": 3}' } do
      local v, err = jsonrpc.decode(text)
      if v then _, err = jsonrpc.check(v) end
      assert.equal(-32600, err.error.code, text)
    end
  end)

  it("encodes a message on one line, newlines in strings escaped", function()
    local line = jsonrpc.encode(jsonrpc.result(1, { content = jsonrpc.array { { type = "text", text = "a\nb" } } }))
    assert.is_nil(line:find("\n", 1, true))
    assert.same({ jsonrpc = "2.0", id = 1, result = { content = { { type = "text", text = "a\nb" } } } },
      cjson.decode(line))
  end)
end)

describe("mcp session", function()
  it("answers initialize with the version asked for when it knows it, else its latest", function()
    run_task(function()
      for asked, given in pairs { ["2025-06-18"] = "2025-06-18", ["2025-03-26"] = "2025-03-26",
                                  ["1999-01-01"] = "2025-06-18" } do
        local s = session_mod.new { sandboxes = fake_provider {} }
        local r = wire(s:handle { jsonrpc = "2.0", id = "i", method = "initialize",
          params = { protocolVersion = asked, capabilities = {}, clientInfo = { name = "x", version = "1" } } })
        assert.equal("i", r.id)
        assert.equal(given, r.result.protocolVersion)
        assert.same({ tools = { listChanged = false } }, r.result.capabilities)
        assert.equal("moonbox", r.result.serverInfo.name)
        assert.equal(moonbox.VERSION, r.result.serverInfo.version)
      end
    end)
  end)

  it("answers an unknown method with -32601, and tools before initialize with -32600", function()
    run_task(function()
      local fresh = session_mod.new { sandboxes = fake_provider {} }
      assert.equal(-32600, fresh:handle { jsonrpc = "2.0", id = 1, method = "tools/list" }.error.code)
      assert.same({ jsonrpc = "2.0", id = 2, result = {} },
        wire(fresh:handle { jsonrpc = "2.0", id = 2, method = "ping" }))
      local s = initialized()
      assert.same({ jsonrpc = "2.0", id = 3, error = { code = -32601, message = "method not found: resources/list" } },
        wire(s:handle { jsonrpc = "2.0", id = 3, method = "resources/list" }))
      -- notifications and the client's responses get no answer
      assert.is_nil(s:handle { jsonrpc = "2.0", method = "notifications/initialized" })
      assert.is_nil(s:handle { jsonrpc = "2.0", method = "notifications/whatever" })
      assert.is_nil(s:handle { jsonrpc = "2.0", id = 9, result = {} })
    end)
  end)

  it("lists its tools with JSON Schema inputs", function()
    run_task(function()
      local r = wire(initialized():handle { jsonrpc = "2.0", id = 1, method = "tools/list" })
      local names = {}
      for i, t in ipairs(r.result.tools) do
        names[i] = t.name
        assert.equal("object", t.inputSchema.type)
        assert.is_false(t.inputSchema.additionalProperties)
      end
      table.sort(names)
      assert.same({ "create_code_context", "create_sandbox", "delete_file", "destroy_sandbox", "expose_port",
        "get_process_logs", "kill_process", "list_files", "list_processes", "read_file", "run_code", "run_command",
        "start_process", "write_file" }, names)
    end)
  end)

  it("answers a batch with an array of the requests' responses", function()
    run_task(function()
      local s = initialized()
      local v = jsonrpc.decode('[{"jsonrpc":"2.0","id":1,"method":"ping"},{"jsonrpc":"2.0","method":"n"},' ..
        '{"jsonrpc":"2.0","id":2,"method":"nope"}]')
      local out = wire(s:handle_value(v))
      assert.equal(2, #out)
      assert.same({ jsonrpc = "2.0", id = 1, result = {} }, out[1])
      assert.equal(-32601, out[2].error.code)
      assert.is_nil(s:handle_value(jsonrpc.decode('[{"jsonrpc":"2.0","method":"n"}]')))
    end)
  end)

  it("answers an unknown tool or bad arguments with -32602, before anything runs", function()
    run_task(function()
      local log = {}
      local s = initialized(log)
      local function call(name, args)
        return s:handle { jsonrpc = "2.0", id = 1, method = "tools/call", params = { name = name, arguments = args } }
      end
      assert.equal("unknown tool \"nope\"", call("nope", {}).error.message)
      assert.equal('run_command: missing argument "command"', call("run_command", {}).error.message)
      assert.equal('run_command: unknown argument "bogus"',
        call("run_command", { command = "x", bogus = 1 }).error.message)
      assert.equal('run_command: argument "timeout" must be an integer',
        call("run_command", { command = "x", timeout = 1.5 }).error.message)
      assert.equal('run_command: argument "env" must be an object',
        call("run_command", { command = "x", env = "A=1" }).error.message)
      assert.equal('expose_port: argument "port" must be at most 65535',
        call("expose_port", { port = 70000 }).error.message)
      assert.equal('run_code: argument "language" must be one of python, javascript, typescript, lua',
        call("run_code", { code = "1", language = "cobol" }).error.message)
      assert.equal(-32602, call("run_command", { command = "" }).error.code)
      assert.same({}, log)
    end)
  end)

  it("returns a tool's error as a result with isError and our code", function()
    run_task(function()
      local s = initialized()
      local r = wire(s:handle { jsonrpc = "2.0", id = 1, method = "tools/call",
        params = { name = "read_file", arguments = { path = "x", sandbox = "not-there" } } })
      assert.is_true(r.result.isError)
      assert.equal("SANDBOX_NOT_FOUND", r.result.structuredContent.code)
      assert.same({ { type = "text",
        text = 'SANDBOX_NOT_FOUND: sandbox "not-there" does not exist (create it with create_sandbox)' } },
        r.result.content)
    end)
  end)

  it("cancels a running tools/call on notifications/cancelled: its exec ends, and no response", function()
    run_task(function()
      local log = {}
      local s = initialized(log)
      local reply = "none yet"
      local task = moonbox.spawn(function()
        reply = s:handle { jsonrpc = "2.0", id = "long", method = "tools/call",
          params = { name = "run_command", arguments = { command = "sleep 30" } } }
      end)
      assert.is_true(helper.eventually(function() return log[1] == "exec sleep 30" end))
      assert.is_true(s:busy())
      -- a cancellation for another id changes nothing
      assert.is_nil(s:handle { jsonrpc = "2.0", method = "notifications/cancelled", params = { requestId = "other" } })
      assert.is_nil(s:handle { jsonrpc = "2.0", method = "notifications/cancelled", params = { requestId = "long" } })
      task:wait()
      assert.is_nil(reply)
      assert.same({ "exec sleep 30", "exec cancelled" }, log)
      assert.is_false(s:busy())
    end)
  end)

  it("close cancels what runs and destroys the session's own sandbox, not a named one", function()
    run_task(function()
      local log = {}
      local provider, sb = fake_provider(log)
      local s = session_mod.new { sandboxes = provider }
      s:handle { jsonrpc = "2.0", id = 0, method = "initialize", params = { protocolVersion = "2025-06-18" } }
      local task = moonbox.spawn(function()
        return s:handle { jsonrpc = "2.0", id = 1, method = "tools/call",
          params = { name = "run_command", arguments = { command = "sleep 30" } } }
      end)
      assert.is_true(helper.eventually(function() return #log == 1 end))
      s:close()
      assert.is_nil(task:wait())
      assert.same({ "exec sleep 30", "exec cancelled", "destroy" }, log)
      assert.is_true(sb.destroyed)
      local named_log = {}
      local named = session_mod.new { sandboxes = fake_provider(named_log), sandbox = "fake" }
      named:handle { jsonrpc = "2.0", id = 0, method = "initialize", params = { protocolVersion = "2025-06-18" } }
      named:handle { jsonrpc = "2.0", id = 1, method = "tools/call",
        params = { name = "destroy_sandbox", arguments = { sandbox = "other" } } }
      assert.is_true(named:own_sandbox() ~= nil)
      named:close()
      assert.same({}, named_log)
    end)
  end)
end)

describe("mcp schema", function()
  it("treats null as not given, and refuses a non-object", function()
    local s = { type = "object", properties = { a = { type = "string" } }, required = { "a" } }
    assert.same({ a = "x" }, schema.check(s, { a = "x" }))
    assert.is_nil(schema.check(s, { a = cjson.null }))
    assert.equal("arguments must be an object", select(2, schema.check(s, { "a" })))
  end)
end)

describe("moonbox mcp (stdio)", function()
  local bin = os.getenv("MOONBOX_BIN") or "build/moonbox"

  -- lines written to `moonbox mcp`'s stdin -> its stdout lines, decoded
  local function exchange(input)
    local dir = helper.mkdtemp()
    local f = assert(io.open(dir .. "/in", "w"))
    f:write(input)
    f:close()
    local rc = os.execute(("cat %s/in | MOONBOX_HOME=%s/home %s mcp > %s/out 2> %s/err")
      :format(dir, dir, bin, dir, dir))
    local out = {}
    for line in io.lines(dir .. "/out") do out[#out + 1] = cjson.decode(line) end
    return out, rc, helper.sh("cat " .. dir .. "/err")
  end

  it("reads one message per line: blank lines skipped, bad JSON a parse error, EOF the end", function()
    local init = '{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18"}}'
    local out, rc = exchange(init .. "\n\n{oops\n" .. '{"jsonrpc":"2.0","id":2,"method":"ping"}' .. "\n" ..
      '{"jsonrpc":"2.0","id":3,"method":"nope"}')
    assert.is_true(rc == true or rc == 0)
    assert.equal(4, #out)
    assert.equal("2025-06-18", out[1].result.protocolVersion)
    local by_id = {}
    for _, m in ipairs(out) do by_id[m.id == cjson.null and "null" or tostring(m.id)] = m end
    assert.equal(-32700, by_id["null"].error.code)
    assert.same({ jsonrpc = "2.0", id = 2, result = {} }, by_id["2"])
    assert.equal(-32601, by_id["3"].error.code)
  end)

  it("refuses stdin that is no pipe or socket with one line, exit 1; -h prints the usage", function()
    local dir = helper.mkdtemp()
    local err = helper.sh(("echo > %s/f; %s mcp < %s/f 2>&1; echo \"rc=$?\""):format(dir, bin, dir))
    assert.matches("^moonbox mcp: standard input must be a pipe or a socket: .*\nrc=1$", err)
    assert.matches("^usage: moonbox mcp %[%-%-policy strict|dev|file.lua%] %[%-%-sandbox ID%]",
      helper.sh(bin .. " mcp -h"))
    -- a policy that cannot be loaded is a usage mistake, as for a script and serve
    assert.matches("rc=2$", helper.sh(bin .. " mcp --policy " .. dir .. "/no-such.lua 2>/dev/null; echo rc=$?"))
    assert.matches("rc=2$", helper.sh(bin .. " mcp --sandbox Bad_ID 2>/dev/null; echo rc=$?"))
    assert.matches("mcp %[%-%-sandbox ID%]", helper.sh(bin .. " -h"))
    assert.matches("unknown option '%-%-bogus'", helper.sh(bin .. " mcp --bogus 2>&1; echo rc=$?"))
    assert.matches("rc=2$", helper.sh(bin .. " mcp --bogus 2>/dev/null; echo rc=$?"))
  end)
end)
