-- Code-interpreter contexts (issue #6).
local moonbox = require "moonbox"
local core = require "moonbox.core"

local with_sandbox = helper.with_sandbox

local function code_of(fn, ...)
  local ok, err = pcall(fn, ...)
  assert.is_false(ok)
  return err.code
end

describe("code contexts", function()
  it("kills the code of a cancelled run; the next run goes ahead in a fresh interpreter", function()
    with_sandbox(function(sb)
      for _, language in ipairs { "lua", "python" } do
        local c = sb:createCodeContext { language = language }
        local spin = language == "lua" and "while true do end" or "while True: pass"
        local ok, err = pcall(moonbox.timeout, 300, function() return sb:runCode(spin, { context = c }) end)
        assert.same({ false, "TIMEOUT" }, { ok, err.code })
        local r = moonbox.timeout(20000, function() return sb:runCode("print(6*7)", { context = c }) end)
        assert.same({ "42\n" }, r.logs.stdout)
        assert.equal(1, r.executionCount) -- a fresh interpreter
      end
    end)
  end)

  it("bounds what code writing to the kernel's own message fd can make the runtime keep", function()
    with_sandbox(function(sb)
      -- one endless line: the interpreter is ended, the context's next run is fresh
      local r = sb:runCode("import os\nfor i in range(10**6): os.write(4, b'A' * 65536)", { language = "python" })
      assert.equal("InterpreterDied", r.error.name)
      assert.matches("protocol message longer than", r.error.message)
      -- many forged results: together no more than maxOutputBytes
      r = sb:runCode("import os, json\nfor i in range(50): os.write(4, (json.dumps({'type': 'result', " ..
        "'data': {'text': 'x' * 30000}}) + '\\n').encode())", { language = "python" })
      local total = 0
      for _, res in ipairs(r.results) do total = total + #(res.text or "") end
      assert.is_true(total <= 100000, total)
      assert.is_true(r.truncated)
      assert.equal("42", sb:runCode("40 + 2", { language = "python" }).results[1].text)
    end, { limits = { maxOutputBytes = 100000 } })
  end)

  it("validates and reports unknown contexts", function()
    with_sandbox(function(sb)
      assert.equal("VALIDATION_FAILED", code_of(sb.createCodeContext, sb, { language = "cobol" }))
      assert.equal("CONTEXT_NOT_FOUND", code_of(sb.runCode, sb, "1", { context = "nope" }))
      assert.equal("CONTEXT_NOT_FOUND", code_of(sb.deleteCodeContext, sb, "nope"))
      -- a context runs its own language: another one named with it is a mistake
      local c = sb:createCodeContext { language = "lua" }
      assert.equal("VALIDATION_FAILED", code_of(sb.runCode, sb, "1", { context = c, language = "python" }))
      assert.equal("1", sb:runCode("1", { context = c, language = "lua" }).results[1].text)
    end)
  end)

  it("raises INTERPRETER_NOT_AVAILABLE with the path it looked for", function()
    with_sandbox(function(sb)
      local ok, err = pcall(sb.createCodeContext, sb, { language = "javascript", envVars = { PATH = "/nonexistent" } })
      assert.is_false(ok)
      assert.equal("INTERPRETER_NOT_AVAILABLE", err.code)
      assert.equal("node", err.context.path)
    end)
  end)

  for _, case in ipairs {
    { lang = "python", set = "x = 40", expr = "x + 2", err = "1/0", errname = "ZeroDivisionError",
      syntax = "def (", out = "print('out')" },
    { lang = "javascript", set = "const x = 40", expr = "x + 2", err = "undefinedThing", errname = "ReferenceError",
      syntax = "function (", out = "console.log('out')" },
    { lang = "lua", set = "x = 40", expr = "x + 2", err = "error('boom')", errname = "LuaError",
      syntax = "local = ", out = "print('out')" },
  } do
    describe(case.lang, function()
      it("keeps state across runs, returns the final expression, keeps state after errors", function()
        with_sandbox(function(sb)
          local ctx = sb:createCodeContext { language = case.lang }
          assert.equal(case.lang, ctx.language)
          assert.is_string(ctx.id)
          assert.is_nil(sb:runCode(case.set, { context = ctx }).error)
          local r = sb:runCode(case.expr, { context = ctx })
          assert.equal("42", r.results[1].text)
          r = sb:runCode(case.err, { context = ctx })
          assert.equal(case.errname, r.error.name)
          assert.is_string(r.error.message)
          r = sb:runCode(case.syntax, { context = ctx })
          assert.is_table(r.error)
          assert.equal("42", sb:runCode(case.expr, { context = ctx.id }).results[1].text)
          r = sb:runCode(case.out, { context = ctx })
          assert.equal("out\n", table.concat(r.logs.stdout))
        end)
      end)

      it("keeps contexts apart", function()
        with_sandbox(function(sb)
          local a = sb:createCodeContext { language = case.lang }
          local b = sb:createCodeContext { language = case.lang }
          sb:runCode(case.set, { context = a })
          assert.is_table(sb:runCode(case.expr, { context = b }).error)
          assert.equal(2, #sb:listCodeContexts())
          assert.same({ success = true, contextId = b.id }, sb:deleteCodeContext(b.id))
          assert.equal(1, #sb:listCodeContexts())
        end)
      end)
    end)
  end

  it("returns json for dicts and rich representations", function()
    with_sandbox(function(sb)
      local r = sb:runCode("{'a': 1, 'b': [1, 2]}", { language = "python" })
      assert.same({ a = 1, b = { 1, 2 } }, r.results[1].json)
      r = sb:runCode("class H:\n    def _repr_html_(self): return '<b>hi</b>'\nH()", { language = "python" })
      assert.equal("<b>hi</b>", r.results[1].html)
    end)
  end)

  it("starts one default context for concurrent first runs of a language", function()
    with_sandbox(function(sb)
      local results = moonbox.all(function() return sb:runCode("1 + 1", { language = "python" }) end,
        function() return sb:runCode("2 + 2", { language = "python" }) end)
      assert.equal("2", results[1].results[1].text)
      assert.equal("4", results[2].results[1].text)
      local ids = {}
      for i, c in ipairs(sb:listCodeContexts()) do ids[i] = c.id end
      assert.same({ "default-python" }, ids)
    end)
  end)

  it("honours the context's cwd and envVars", function()
    with_sandbox(function(sb)
      sb:exec("mkdir -p data")
      local ctx = sb:createCodeContext { language = "python", cwd = "/workspace/data", envVars = { MODE = "test" } }
      local r = sb:runCode("import os\n(os.path.basename(os.getcwd()), os.environ['MODE'])", { context = ctx })
      assert.equal("('data', 'test')", r.results[1].text)
    end)
  end)

  it("streams output while the code runs", function()
    with_sandbox(function(sb)
      local t0 = core.hrtime()
      local first_at, events = nil, {}
      for ev in sb:runCodeStream("import time\nprint('first', flush=True)\ntime.sleep(1)\nprint('second')",
        { language = "python" }) do
        events[#events + 1] = ev.type
        if ev.type == "stdout" and not first_at and ev.text:find("first") then first_at = (core.hrtime() - t0) / 1e6 end
      end
      assert.is_true(first_at ~= nil and first_at < 900, "first line after " .. tostring(first_at) .. " ms")
      assert.equal("complete", events[#events])
    end)
  end)

  it("kills and restarts a context on timeout and after a crash", function()
    with_sandbox(function(sb)
      local ctx = sb:createCodeContext { language = "python" }
      sb:runCode("kept = 1", { context = ctx })
      local r = sb:runCode("import time\ntime.sleep(30)", { context = ctx, timeout = 300 })
      assert.equal("TimeoutError", r.error.name)
      assert.is_true(r.contextRestarted)
      assert.equal("NameError", sb:runCode("kept", { context = ctx }).error.name)
      r = sb:runCode("import os\nos._exit(3)", { context = ctx })
      assert.is_table(r.error)
      assert.is_true(r.contextRestarted)
      assert.equal("2", sb:runCode("1 + 1", { context = ctx }).results[1].text)
    end)
  end)

  it("serialises runs in one context and runs contexts in parallel", function()
    with_sandbox(function(sb)
      local a = sb:createCodeContext { language = "python" }
      local b = sb:createCodeContext { language = "python" }
      local t0 = core.hrtime()
      moonbox.all(
        function() sb:runCode("import time; time.sleep(0.6)", { context = a }) end,
        function() sb:runCode("import time; time.sleep(0.6)", { context = b }) end)
      assert.is_true((core.hrtime() - t0) / 1e6 < 1100)
    end)
  end)

  it("bounds output and results by maxOutputBytes, with a truncated mark", function()
    with_sandbox(function(sb)
      local r = sb:runCode("print('x' * 5000)\n'y' * 5000", { language = "python" })
      assert.is_true(r.truncated)
      assert.equal(1000, #table.concat(r.logs.stdout))
      assert.is_true(r.results[1].truncated)
      assert.equal(1000, #r.results[1].text)
    end, { limits = { maxOutputBytes = 1000 } })
  end)
end)
