-- Argument checks (lua/moonbox/lib/validate.lua): what a caller's mistake reads as.
local V = require "moonbox.lib.validate"

local function refused(fn, ...)
  local ok, err = pcall(fn, ...)
  assert.is_false(ok)
  assert.equals("VALIDATION_FAILED", err.code)
  return err.message, err.context
end

describe("unknown options", function()
  local exec_options = { timeout = true, env = true, cwd = true, stdin = true, onOutput = true, maxOutputBytes = true }

  it("name the nearest known option when one is within two edits", function()
    assert.equals("exec options.timout: unknown option (did you mean timeout?)",
      refused(V.options, { timout = 1 }, exec_options, "exec options"))
    assert.equals("exec options.tiemout: unknown option (did you mean timeout?)",
      refused(V.options, { tiemout = 1 }, exec_options, "exec options"))
    assert.equals("exec options.cdw: unknown option (did you mean cwd?)",
      refused(V.options, { cdw = "/" }, exec_options, "exec options"))
    assert.equals("exec options.onoutput: unknown option (did you mean onOutput?)",
      refused(V.options, { onoutput = print }, exec_options, "exec options"))
    local _, context = refused(V.options, { timout = 1 }, exec_options, "exec options")
    assert.same({ field = "timout", options = "exec options" }, context)
  end)

  it("suggest nothing when no known option is near", function()
    assert.equals("exec options.zzzzzz: unknown option",
      refused(V.options, { zzzzzz = 1 }, exec_options, "exec options"))
    assert.equals("exec options.tmo: unknown option", refused(V.options, { tmo = 1 }, exec_options, "exec options"))
    assert.equals("exec options.1: unknown option", refused(V.options, { 1 }, exec_options, "exec options"))
    assert.equals("o.x: unknown option", refused(V.options, { x = 1 }, {}, "o"))
  end)

  it("let known options through", function()
    local opts = { timeout = 5, env = {} }
    assert.equals(opts, V.options(opts, exec_options, "exec options"))
    assert.same({}, V.options(nil, exec_options, "exec options"))
  end)
end)

describe("env values", function()
  it("are strings or false; a number or anything else is refused, naming the entry", function()
    assert.same({ A = "1", B = false, C = "" }, V.env({ A = "1", B = false, C = "" }, "env"))
    assert.equals("env.A: expected a string or false, got number", refused(V.env, { A = 1 }, "env"))
    assert.equals("env.A: expected a string or false, got boolean", refused(V.env, { A = true }, "env"))
    assert.equals("env.A: expected a string or false, got table", refused(V.env, { A = {} }, "env"))
  end)

  it("are refused by exec and setEnvVars before anything runs", function()
    helper.with_sandbox(function(sb)
      local ok, err = pcall(sb.exec, sb, "echo ran > ran.txt", { env = { A = 1 } })
      assert.is_false(ok)
      assert.equals("VALIDATION_FAILED", err.code)
      ok, err = pcall(sb.setEnvVars, sb, { N = 2 })
      assert.is_false(ok)
      assert.equals("VALIDATION_FAILED", err.code)
      assert.is_false(sb:exists("ran.txt").exists)
      assert.equals("", sb:exec("echo ${N-}").stdout:gsub("\n", ""))
    end)
  end)
end)

describe("commands", function()
  it("say what is wrong with a table that is no argv array", function()
    assert.equals("command: argv is empty", refused(V.command, {}))
    assert.equals("command: expected an argv array (1-based, no other keys)", refused(V.command, { ["1"] = "echo" }))
    assert.equals("command[2]: expected a string", refused(V.command, { "echo", true }))
  end)
end)

