-- Code contexts for TypeScript (share/kernels/node_kernel.js
-- --typescript): types removed per cell (node's stripping, else Debian's
-- node-typescript), then the JavaScript kernel's semantics.
describe("typescript code contexts", function()
  it("runs typed cells with state kept between runs, await, enums and generics", function()
    helper.with_sandbox(function(sb)
      local c = sb:createCodeContext { language = "typescript" }
      assert.equal("typescript", c.language)
      local function run(code)
        local r = sb:runCode(code, { context = c.id })
        return r.results[1] and r.results[1].text, r.error, table.concat(r.logs.stdout)
      end
      assert.equal("42", (run("interface P { x: number }\nconst p: P = { x: 41 };\np.x + 1")))
      assert.equal("41", (run("p.x")))
      assert.equal("1", (run("enum Color { Red, Green }\nColor.Green")))
      assert.equal("'hi'", (run("function f<T>(a: T): T { return a }\nf<string>('hi')")))
      assert.equal("10", (run("const q: number = await Promise.resolve(5);\nq * 2")))
      local text, err, out = run("type T = string;\nconsole.log('printed');\n('v' as T)")
      assert.same({ "'v'", "printed\n" }, { text, out })
      assert.is_nil(err)
      -- a syntax error is the cell's error, with where it is; the context goes on
      text, err = run("let z: = 3")
      assert.is_nil(text)
      assert.equal("SyntaxError", err.name)
      assert.truthy(err.message:find("<cell-7>:1:8", 1, true), err.message)
      assert.equal("43", (run("p.x + 2")))
      -- the default context per language
      local r = sb:runCode("const n: number = 2; n ** 10", { language = "typescript" })
      assert.equal("1024", r.results[1].text)
    end)
  end)
end)
