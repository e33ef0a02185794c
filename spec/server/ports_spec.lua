-- Exposed ports (lua/moonbox/sandbox/ports.lua) and the proxy of `moonbox serve`
-- to them (lua/moonbox/server/proxy.lua): a dev server started with
-- startProcess inside a sandbox (network "none" under isolation) reached
-- through both URL forms, over HTTP (static files, a request body, a chunked
-- response, a large file) and WebSocket, with the server's token rules.
local core = require "moonbox.core"
local cjson = require "cjson"
local http = require "moonbox.server.http"
local cli = require "moonbox.server.cli"
local ports = require "moonbox.sandbox.ports"
local client = require "spec.server.client"

local TOKEN = "ports-spec-token-0123456789"
local APP = assert(io.open(client.SOURCE .. "/spec/server/port_app.py")):read("*a")

-- curl(args...) -> status, headers (lowercase names), body
local function curl(...)
  local out, err, code = client.run { "curl", "-sS", "-i", "--max-time", "20", "--path-as-is", ... }
  assert.equal(0, code, err)
  local head, body = out:match("^(.-)\r\n\r\n(.*)$")
  local status = tonumber(head:match("^HTTP/%S+ (%d+)"))
  local headers = {}
  for name, value in head:gmatch("\r\n([^:\r\n]+):%s*([^\r\n]*)") do headers[name:lower()] = value end
  return status, headers, body
end

-- run_task(fn(sb, url, port)): a server with the token, a sandbox running
-- port_app.py on a port, exposed; everything torn down afterwards.
local function with_app(fn)
  run_task(function()
    local server = http.listen({ listen = "127.0.0.1:0" }, cli.app { token = TOKEN })
    local saved = ports.server
    ports.server = { port = tonumber(server.address:match(":(%d+)$")) }
    local sb = helper.new_sandbox()
    local ok, err = pcall(function()
      sb:writeFile("/workspace/app.py", APP)
      sb:writeFile("/workspace/index.html", "<!doctype html><title>hi</title><p id=x>from the sandbox</p>\n")
      local port = 20000 + core.getpid() % 20000 -- (isolation "none" shares the host network)
      local proc = sb:startProcess(("exec python3 app.py %d"):format(port), { cwd = "/workspace" })
      proc:waitForPort(port, { timeout = 20000 })
      fn(sb, "http://" .. server.address, port)
    end)
    sb:destroy()
    ports.server = saved
    server:close()
    if not ok then error(err, 0) end
  end)
end

describe("sandbox:exposePort", function()
  it("records ports, refuses bad and repeated ones with coded errors", function()
    helper.with_sandbox(function(sb)
      local saved = ports.server
      ports.server = { port = 9999 }
      local e = sb:exposePort(3000, { name = "web" })
      assert.same({ 3000, "web", ("http://3000-%s.localhost:9999/"):format(sb.id) }, { e.port, e.name, e.url })
      assert.matches("^%d%d%d%d%-%d%d%-%d%dT%d%d:%d%d:%d%d%.%d%d%dZ$", e.exposedAt)
      sb:exposePort(80)
      local list = sb:getExposedPorts()
      assert.same({ 80, 3000 }, { list[1].port, list[2].port })
      assert.equal("PORT_ALREADY_EXPOSED", helper.error_of(sb.exposePort, sb, 3000).code)
      for _, bad in ipairs { 0, 65536, 1.5, "80", -1 } do
        assert.equal("VALIDATION_FAILED", helper.error_of(sb.exposePort, sb, bad).code)
      end
      local err = helper.error_of(sb.exposePort, sb, 81, { hostname = "example.com" })
      assert.equal("VALIDATION_FAILED", err.code)
      assert.truthy(err.message:find("localhost", 1, true))
      assert.equal("VALIDATION_FAILED", helper.error_of(sb.exposePort, sb, 81, { nmae = "x" }).code)
      assert.same({ success = true, port = 3000 }, sb:unexposePort(3000))
      assert.equal("PORT_NOT_EXPOSED", helper.error_of(sb.unexposePort, sb, 3000).code)
      assert.same({ 80 }, { sb:getExposedPorts()[1].port, sb:getExposedPorts()[2] })
      ports.server = saved
    end)
  end)
end)

describe("the port proxy of moonbox serve", function()
  it("serves a sandbox's dev server at the path and host-name URLs, HTTP and WebSocket", function()
    with_app(function(sb, url, port)
      local auth = "Authorization: Bearer " .. TOKEN
      local base = ("%s/v1/sandboxes/%s/ports/%d"):format(url, sb.id, port)
      local host = ("Host: %d-%s.localhost:%s"):format(port, sb.id, url:match(":(%d+)$"))
      local index = "<!doctype html><title>hi</title><p id=x>from the sandbox</p>\n"

      -- not exposed yet: 404 with the code, after the token check
      local status, _, body = curl("-H", auth, base .. "/index.html")
      assert.equal(404, status)
      assert.equal("PORT_NOT_EXPOSED", cjson.decode(body).code)
      sb:exposePort(port, { name = "app" })

      -- the path form and the host-name form give the file, byte for byte
      status, _, body = curl("-H", auth, base .. "/index.html")
      assert.same({ 200, index }, { status, body })
      status, _, body = curl("-H", auth, "-H", host, url .. "/index.html")
      assert.same({ 200, index }, { status, body })
      -- /ports/{port} without the slash goes to the directory URL
      local headers
      status, headers = curl("-H", auth, base)
      assert.same({ 308, ("/v1/sandboxes/%s/ports/%d/"):format(sb.id, port) }, { status, headers.location })

      -- no token: 401 on both forms; the token is not passed on
      assert.equal(401, (curl(base .. "/index.html")))
      assert.equal(401, (curl("-H", host, url .. "/index.html")))
      local payload = ("\0\1binary\255"):rep(1000)
      local tmp = helper.mkdtemp() .. "/payload"
      local f = assert(io.open(tmp, "wb"))
      f:write(payload)
      f:close()
      status, headers, body = curl("-H", auth, "-H", "Cookie: a=1; moonbox_token=" .. TOKEN .. "; b=2",
        "-H", "X-Requested-With: kept", "--data-binary", "@" .. tmp, base .. "/echo")
      assert.same({ 201, payload }, { status, body })
      local seen = cjson.decode(headers["x-seen"])
      assert.is_nil(seen.authorization)
      assert.equal("a=1; b=2", seen.cookie)
      assert.equal(url:match("^http://(.*)$"), seen["x-forwarded-host"])
      assert.equal("kept", seen["x-requested-with"])

      -- a browser: ?access_token= once gives a cookie for the port's URLs
      status, headers = curl("-H", host, url .. "/index.html?access_token=" .. TOKEN .. "&q=1")
      assert.same({ 302, "/index.html?q=1" }, { status, headers.location })
      -- (the port's own cookie, not the token: proxy_hostile_spec.lua)
      local name, value = require("moonbox.server.token").port_cookie(TOKEN, sb.id, port)
      assert.truthy(headers["set-cookie"]:find(name .. "=" .. value .. "; Path=/;", 1, true))
      status, _, body = curl("-H", host, "-H", "Cookie: " .. name .. "=" .. value, url .. "/index.html")
      assert.same({ 200, index }, { status, body })

      -- a chunked response arrives de-chunked; a large file whole
      status, _, body = curl("-H", auth, base .. "/chunked")
      assert.same({ 200, "first," .. ("second,"):rep(1000) .. "third" }, { status, body })
      local big = {}
      for i = 1, 60000 do big[i] = ("%07d\n"):format(i) end
      big = table.concat(big):rep(10) -- 4.8 MB
      sb:writeFile("/workspace/big.txt", big)
      status, _, body = curl("-H", auth, base .. "/big.txt")
      assert.equal(200, status)
      assert.equal(#big, #body)
      assert.is_true(big == body)

      -- WebSocket echo through the path form (token in the query)
      local events = client.ws_client(("ws://%s/v1/sandboxes/%s/ports/%d/ws?access_token=%s")
        :format(url:match("^http://(.*)$"), sb.id, port, TOKEN),
        { { send = "hello" }, { expect = "echo:hello" }, { binary = "\0\1\2" }, { expect = "\0\1\2" },
          { send = ("x"):rep(70000) }, { expect = "echo:" .. ("x"):rep(100) }, { close = 1000 } })
      assert.same({ open = true }, events[1])
      assert.same({ text = "echo:hello" }, events[2])
      assert.same({ binary = "\0\1\2" }, events[3])
      assert.same({ text = "echo:" .. ("x"):rep(70000) }, events[4])
      assert.equal(1000, events[5].close)

      -- a service that never answers: 504 after the head timeout; a port nobody listens on: 502
      local proxy = require "moonbox.server.proxy"
      local saved = proxy.HEAD_TIMEOUT_MS
      proxy.HEAD_TIMEOUT_MS = 300
      status, _, body = curl("-H", auth, base .. "/hang")
      proxy.HEAD_TIMEOUT_MS = saved
      assert.same({ 504, "PORT_TIMEOUT" }, { status, cjson.decode(body).code })
      sb:exposePort(port + 1)
      status, _, body = curl("-H", auth, ("%s/v1/sandboxes/%s/ports/%d/"):format(url, sb.id, port + 1))
      assert.same({ 502, "PORT_UNREACHABLE" }, { status, cjson.decode(body).code })

      -- a public port takes no token; an unexposed one is gone
      sb:unexposePort(port)
      status, _, body = curl("-H", auth, base .. "/index.html")
      assert.same({ 404, "PORT_NOT_EXPOSED" }, { status, cjson.decode(body).code })
      sb:exposePort(port, { public = true })
      status, _, body = curl(base .. "/index.html")
      assert.same({ 200, index }, { status, body })
      -- the sandbox's own network stays closed: nothing on the host listens on the port
      local out = client.run { "curl", "-sS", "--max-time", "5", ("http://127.0.0.1:%d/index.html"):format(port) }
      if sb.network == "none" then assert.are_not.equal(index, out) end
    end)
  end)
end)
