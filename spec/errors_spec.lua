-- moonbox.errors: error objects {code, message, context}.
local errors = require "moonbox.errors"

describe("moonbox.errors", function()
  it("new builds an error object without raising", function()
    local e = errors.new("E_CODE", "something failed", { path = "/x" })
    assert.equals("E_CODE", e.code)
    assert.equals("something failed", e.message)
    assert.same({ path = "/x" }, e.context)
    assert.is_nil(e.traceback)
    assert.is_true(errors.is_error(e))
  end)

  it("new gives an empty context by default", function()
    assert.same({}, errors.new("E", "m").context)
  end)

  it("is_error is false for anything that is not an error object", function()
    for _, v in ipairs { "E_CODE: msg", 42, true, { code = "E", message = "m" }, print } do
      assert.is_false(errors.is_error(v))
    end
    assert.is_false(errors.is_error(nil))
  end)

  it("raise throws the object itself, with no position glued on", function()
    local ok, err = pcall(errors.raise, "E_RAISED", "went wrong", { n = 2 })
    assert.is_false(ok)
    assert.is_true(errors.is_error(err))
    assert.equals("E_RAISED", err.code)
    assert.equals("went wrong", err.message)
    assert.same({ n = 2 }, err.context)
  end)

  it("tostring is CODE: message", function()
    assert.equals("E_CODE: something failed", tostring(errors.new("E_CODE", "something failed")))
    assert.equals("ERROR: no code", tostring(errors.new(nil, "no code")))
    assert.equals("E: nil", tostring(errors.new("E")))
    assert.equals("E: 42", tostring(errors.new("E", 42)))
  end)

  it("format is tostring plus the traceback when there is one", function()
    local e = errors.new("E_CODE", "msg")
    assert.equals("E_CODE: msg", errors.format(e))
    e.traceback = "stack traceback:\n\tsomewhere"
    assert.equals("E_CODE: msg\nstack traceback:\n\tsomewhere", errors.format(e))
  end)

  it("format turns any other value into a string", function()
    assert.equals("plain message", errors.format("plain message"))
    assert.equals("42", errors.format(42))
    assert.equals("nil", errors.format(nil))
    assert.matches("^table: ", errors.format({}))
  end)

  it("check passes a success value through", function()
    assert.equals(5, errors.check("E_IO", 5, nil, nil))
    assert.equals(false, errors.check("E_IO", false))
  end)

  it("check raises nil, message, CODE as its own code with the errno in context", function()
    local ok, err = pcall(errors.check, "E_IO", nil, "ENOENT: no such file or directory (open)", "ENOENT",
      { path = "/nope" })
    assert.is_false(ok)
    assert.is_true(errors.is_error(err))
    assert.equals("E_IO", err.code)
    assert.equals("ENOENT: no such file or directory (open)", err.message)
    assert.same({ path = "/nope", errno = "ENOENT" }, err.context)
  end)
end)
