-- The port proxy of `moonbox serve` (lua/moonbox/server/proxy.lua) against
-- hostile tenants and careless clients (the server-hardening issue,
-- findings 1-5): a service that floods tokenless clients that do not read
-- with 16 MiB WebSocket frames, clients that do not read 16 MiB exec
-- results, the page's cookie and a port's cookie used on other
-- sandboxes' ports, the token in forms the proxy checked but did not strip,
-- an open redirect and upstream cookies tossed onto ours. The tenant's
-- service is spec/server/hostile_app.py, run inside each sandbox.
-- The server runs in this process: its memory is this process's.
local core = require "moonbox.core"
local cjson = require "cjson"
local http = require "moonbox.server.http"
local cli = require "moonbox.server.cli"
local ports = require "moonbox.sandbox.ports"
local client = require "spec.server.client"
local moonbox = require "moonbox"
local send_budget = require "moonbox.server.send_budget"

local TOKEN = "hostile-spec-token-0123456789abcdef"
local APP = assert(io.open(client.SOURCE .. "/spec/server/hostile_app.py")):read("*a")

-- curl(args...) -> status, headers (lowercase names; the last of repeated ones), body
local function curl(...)
  local out, err, code = client.run { "curl", "-sS", "-i", "--max-time", "20", "--path-as-is", "-g", ... }
  assert.equal(0, code, err)
  local head, body = out:match("^(.-)\r\n\r\n(.*)$")
  local status = tonumber(head:match("^HTTP/%S+ (%d+)"))
  local headers = {}
  for name, value in head:gmatch("\r\n([^:\r\n]+):%s*([^\r\n]*)") do headers[name:lower()] = value end
  return status, headers, body
end

-- run_task(fn(url, apps, server)): a server with the token (and a page),
-- n sandboxes each running hostile_app.py on a port of its own
-- (apps[i] = {sb, port, path = the path-form URL, host = a Host header}).
local function with_apps(n, fn)
  run_task(function()
    local page = helper.mkdtemp()
    local f = assert(io.open(page .. "/index.html", "w"))
    f:write("<!doctype html><title>the page</title>\n")
    f:close()
    local server = http.listen({ listen = "127.0.0.1:0" }, cli.app { token = TOKEN, page = page })
    local saved = ports.server
    local sport = tonumber(server.address:match(":(%d+)$"))
    ports.server = { port = sport }
    local url = "http://" .. server.address
    local apps = {}
    local ok, err = pcall(function()
      for i = 1, n do
        local sb = helper.new_sandbox()
        local port = 20000 + (core.getpid() * 7 + i) % 20000 -- (isolation "none" shares the host network)
        apps[i] = { sb = sb, port = port, path = ("%s/v1/sandboxes/%s/ports/%d"):format(url, sb.id, port),
          host = ("Host: %d-%s.localhost:%d"):format(port, sb.id, sport) }
        sb:writeFile("/workspace/app.py", APP)
        sb:writeFile("/workspace/secret.txt", "the secret of " .. sb.id .. "\n")
        local proc = sb:startProcess(("exec python3 app.py %d"):format(port), { cwd = "/workspace" })
        proc:waitForPort(port, { timeout = 20000 })
      end
      fn(url, apps, server)
    end)
    for _, app in ipairs(apps) do app.sb:destroy() end
    ports.server = saved
    server:close()
    if not ok then error(err, 0) end
  end)
end

local function cookie_of(headers)
  return headers["set-cookie"] and headers["set-cookie"]:match("^%s*([^;]+)")
end

local MB = 1024 * 1024

local function status_kb(field)
  local f = assert(io.open("/proc/self/status"))
  local text = f:read("*a")
  f:close()
  return tonumber(text:match(field .. ":%s*(%d+) kB"))
end

-- The peak RSS (VmHWM) is reset to the current RSS ("5" to clear_refs):
-- -> a function that gives the peak above that since, in bytes.
local function watch_peak()
  helper.excuse(collectgarbage, "collect")
  local f = assert(io.open("/proc/self/clear_refs", "w"))
  f:write("5")
  f:close()
  local base = status_kb("VmRSS")
  return function() return (status_kb("VmHWM") - base) * 1024 end
end

-- A client that sends head (and body), reads the response head and then
-- nothing more: what it was sent piles up in the server.
-- -> the connection, the head (nil if the server closed first)
local function stalled(port, request)
  local c = client.connect(port)
  c:send(request)
  local ok, head = pcall(c.read_until, c, "^HTTP/1%.1 %d+.-\r\n\r\n")
  c.stream:read_stop()
  if not ok then
    c:close() -- (no handle left to fail the next test)
    error(head, 0)
  end
  return c, head
end

-- ws_client.js prints binary messages as latin1 strings in JSON: back to bytes
local function latin1(s)
  if not s then return nil end
  return (s:gsub("([\xC2\xC3])([\x80-\xBF])", function(a, b)
    return string.char((a:byte() - 0xC0) * 64 + b:byte() - 0x80)
  end))
end

local function ws_request(path, host)
  return ("GET %s HTTP/1.1\r\nHost: %s\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n" ..
    "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"):format(path, host)
end

local function exec_request(id, command)
  local body = cjson.encode({ command = command })
  return ("POST /v1/sandboxes/%s/exec HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n" ..
    "Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"):format(id, TOKEN, #body, body)
end

-- exec through the API, as a client that reads: -> status, decoded body
local function api_exec(url, id, command)
  local out, err, code = client.run { "curl", "-sS", "--max-time", "60", "-o", "-", "-w", "\n%{http_code}",
    "-H", "Authorization: Bearer " .. TOKEN, "-H", "Content-Type: application/json",
    "--data", cjson.encode({ command = command }), url .. "/v1/sandboxes/" .. id .. "/exec" }
  assert.equal(0, code, err)
  local body, status = out:match("^(.*)\n(%d+)$")
  return tonumber(status), cjson.decode(body)
end

describe("the port proxy against a hostile tenant", function()
  -- finding 1: the proxy assembled each message whole (appending every
  -- read to a growing string) and queued it whole for the client
  it("streams a public port's 16 MiB WebSocket frames to clients that do not read: memory stays bounded, " ..
    "another sandbox's exec answers", function()
    with_apps(2, function(url, apps)
      local a, b = apps[1], apps[2]
      a.sb:exposePort(a.port, { public = true }) -- no token: anyone may open it
      local sport = tonumber(url:match(":(%d+)$"))
      local peak = watch_peak()
      local conns = {}
      local ok, err = pcall(function()
        for i = 1, 6 do
          local path = ("/v1/sandboxes/%s/ports/%d/flood?n=4&size=%d"):format(a.sb.id, a.port, 16 * MB)
          local head
          conns[i], head = stalled(sport, ws_request(path, "127.0.0.1:" .. sport))
          assert.truthy(head and head:match("^HTTP/1%.1 101"), head)
        end
        -- while they stall: another sandbox's commands run and answer
        for _ = 1, 10 do
          local status, r = api_exec(url, b.sb.id, "echo alive")
          assert.same({ 200, 0, "alive\n" }, { status, r.exitCode, r.stdout })
        end
        moonbox.sleep(2000) -- (time for the floods to push what they can)
      end)
      local grown = peak()
      for _, c in ipairs(conns) do c:close() end
      if not ok then error(err, 0) end
      -- 6 x 4 x 16 MiB were sent at the server: what it holds stays near
      -- one slice per connection (the old proxy grew by 350 MB here)
      assert.is_true(grown < 64 * MB, ("the server's RSS grew by %d MB"):format(math.floor(grown / MB)))
      -- a client that reads gets every byte, the message boundaries kept
      local size = MB + 7
      local events = client.ws_client(("ws://127.0.0.1:%d/v1/sandboxes/%s/ports/%d/flood?n=2&size=%d")
        :format(sport, a.sb.id, a.port, size), { { expect = "^[\\s\\S]{" .. (2 * size) .. "}" },
        { close = 1000 } })
      assert.same({ open = true }, events[1])
      for m = 0, 1 do
        local data = events[2 + m] and helper.excuse(latin1, events[2 + m].binary)
        assert.equal(size, data and #data)
        assert.equal(m % 251, data:byte(1))
        assert.equal((size - 1 + m) % 251, data:byte(-1))
      end
    end)
  end)

  -- (also finding 1) a chunked body was de-chunked by cutting the rest of
  -- each read after every chunk: one-byte chunks copied a read per byte
  it("de-chunks a body of 300000 one-byte chunks without holding the loop", function()
    with_apps(1, function(_, apps)
      local a = apps[1]
      a.sb:exposePort(a.port, { public = true })
      local out, err, code = client.run { "curl", "-sS", "--max-time", "60", a.path .. "/chunks?n=300000" }
      assert.equal(0, code, err)
      assert.equal(300000, #out)
      assert.equal(("abcdefghijklmnopqrstuvwxyz"):rep(11538) .. "abcdefghijkl", out)
    end)
  end)

  -- finding 5: each result was encoded whole (up to 6x the output, on the
  -- loop) and queued whole, however slowly its client read
  it("sends exec results to clients that do not read a slice at a time, within --max-buffered-bytes, " ..
    "keeping of their output only what fits it", function()
    with_apps(2, function(url, apps)
      local a, b = apps[1], apps[2]
      local sport = tonumber(url:match(":(%d+)$"))
      local saved = send_budget.limit
      send_budget.limit = 40 * MB
      local conns = {}
      local ok, err = pcall(function()
        local peak = watch_peak()
        -- 16 MiB of control characters: 96 MiB of JSON
        local flood = "head -c 16777216 /dev/zero | tr '\\0' '\\1'"
        local statuses = {}
        for i = 1, 3 do
          local head
          conns[i], head = stalled(sport, exec_request(a.sb.id, flood))
          statuses[#statuses + 1] = head and tonumber(head:match("^HTTP/1%.1 (%d+)"))
        end
        local status, r = api_exec(url, b.sb.id, "echo alive")
        assert.same({ 200, 0, "alive\n" }, { status, r.exitCode, r.stdout })
        local grown = peak()
        -- (the old server grew by more than 600 MB here)
        assert.is_true(grown < 200 * MB, ("the server's RSS grew by %d MB"):format(math.floor(grown / MB)))
        -- the three results share the 40 MiB as their output comes (what
        -- would pass it is dropped, the results are truncated): all are sent
        assert.same({ 200, 200, 200 }, statuses)
        assert.is_true(send_budget.used <= send_budget.limit + 3 * 2 * 64 * 1024,
          ("the server holds %d bytes"):format(send_budget.used))
        -- with the budget spent, another client's big result keeps 64 KiB
        status, r = api_exec(url, b.sb.id, "head -c 10485760 /dev/zero | tr '\\0' '\\1'")
        assert.same({ 200, true, 64 * 1024 }, { status, r.truncated, #r.stdout })
        for _, c in ipairs(conns) do c:close() end
        conns = {}
        -- once they are gone, their bytes are free again
        moonbox.timeout(10000, function()
          while send_budget.used > 0 do moonbox.sleep(20) end
        end)
        status, r = api_exec(url, b.sb.id, "head -c 1048576 /dev/zero | tr '\\0' '\\1'")
        assert.same({ 200, MB }, { status, #r.stdout })
        assert.is_nil(r.stdout:find("[^\1]"))
      end)
      for _, c in ipairs(conns) do c:close() end
      send_budget.limit = saved
      if not ok then error(err, 0) end
    end)
  end)

  it("takes the page's cookie for the page only, and a port's cookie for that port of that sandbox only",
    function()
    with_apps(2, function(url, apps)
      local a, b = apps[1], apps[2]
      a.sb:exposePort(a.port)
      a.sb:exposePort(a.port + 1) -- nothing listens: 502 once past the token check
      b.sb:exposePort(b.port)
      -- the page's cookie (what opening the printed URL sets)
      local status, headers = curl(url .. "/?token=" .. TOKEN)
      assert.equal(200, status)
      local page_cookie = cookie_of(headers)
      assert.truthy(page_cookie and page_cookie:match("^moonbox_token="))
      assert.equal(200, (curl("-H", "Cookie: " .. page_cookie, url .. "/")))
      for _, c in ipairs { page_cookie, "moonbox_token=" .. TOKEN } do
        assert.equal(401, (curl("-H", "Cookie: " .. c, a.path .. "/secret.txt")), c)
        assert.equal(401, (curl("-H", "Cookie: " .. c, "-H", a.host, url .. "/secret.txt")), c)
      end
      -- a port's cookie: not the token, named and scoped for the port
      status, headers = curl(a.path .. "/secret.txt?access_token=" .. TOKEN)
      assert.equal(302, status)
      local set = headers["set-cookie"]
      local port_cookie = cookie_of(headers)
      assert.is_nil(set:find(TOKEN, 1, true), set)
      assert.truthy(set:find(("Path=/v1/sandboxes/%s/ports/%d/;"):format(a.sb.id, a.port), 1, true), set)
      assert.truthy(set:find("HttpOnly", 1, true), set)
      local body
      status, headers, body = curl("-H", "Cookie: " .. port_cookie, a.path .. "/secret.txt")
      assert.same({ 200, "the secret of " .. a.sb.id .. "\n" }, { status, body })
      -- a path-form page gets an origin of its own (a CSP sandbox, no
      -- allow-same-origin): its scripts cannot read other paths of the server
      local csp = headers["content-security-policy"] or ""
      assert.truthy(csp:find("sandbox", 1, true), csp)
      assert.is_nil(csp:find("allow-same-origin", 1, true), csp)
      -- the same cookie on another sandbox's port, another port, another form
      assert.equal(401, (curl("-H", "Cookie: " .. port_cookie, b.path .. "/secret.txt")))
      local renamed = port_cookie:gsub("^[^=]+", ("moonbox_port_%s_%d"):format(b.sb.id, b.port))
      assert.equal(401, (curl("-H", "Cookie: " .. renamed, b.path .. "/secret.txt")))
      assert.equal(401, (curl("-H", "Cookie: " .. port_cookie, a.path:gsub("%d+$", a.port + 1) .. "/")))
      assert.equal(401, (curl("-H", "Cookie: " .. port_cookie, "-H", b.host, url .. "/secret.txt")))
      -- the host form's cookie: that origin's own, not the token either
      status, headers = curl("-H", a.host, url .. "/secret.txt?access_token=" .. TOKEN)
      assert.equal(302, status)
      assert.is_nil(headers["set-cookie"]:find(TOKEN, 1, true))
      local host_cookie = cookie_of(headers)
      assert.equal(200, (curl("-H", "Cookie: " .. host_cookie, "-H", a.host, url .. "/secret.txt")))
      assert.equal(401, (curl("-H", "Cookie: " .. host_cookie, "-H", b.host, url .. "/secret.txt")))
      assert.equal(401, (curl("-H", "Cookie: " .. host_cookie, url .. "/v1/sandboxes")))
    end)
  end)

  it("passes the token on in no form: encoded query names, any-case Authorization, our cookies", function()
    with_apps(1, function(url, apps)
      local a = apps[1]
      a.sb:exposePort(a.port)
      local function seen(status, _, body)
        assert.equal(200, status, body)
        assert.is_nil(body:find(TOKEN, 1, true), body)
        return cjson.decode(body)
      end
      for _, q in ipairs { "access%5Ftoken=" .. TOKEN, "%61ccess_token=" .. TOKEN .. "&q=1",
                           "q=1&access%5ftoken=" .. TOKEN, "q=1&access_token=" .. TOKEN .. "&access%5Ftoken=x" } do
        local s = seen(curl("-X", "POST", "--data", "x", a.path .. "/echo?" .. q))
        assert.is_nil(s.target:lower():find("token", 1, true), s.target)
        seen(curl("-X", "POST", "--data", "x", "-H", a.host, url .. "/echo?" .. q))
      end
      -- the port's cookie authorizes; an Authorization holding the token in
      -- another case is taken out too, as are our cookies of any port
      local _, headers = curl(a.path .. "/?access_token=" .. TOKEN)
      local port_cookie = cookie_of(headers)
      local s = seen(curl("-H", "Authorization: BEARER " .. TOKEN, "-H", "Cookie: a=1; " .. port_cookie ..
        "; moonbox_token=x; moonbox_port_other_1=y; b=2", a.path .. "/echo"))
      assert.same({}, s.authorization)
      assert.equal("a=1; b=2", s.headers.cookie)
      s = seen(curl("-H", "authorization: bearer   " .. TOKEN, a.path .. "/echo")) -- (it authorizes, too)
      assert.same({}, s.authorization)
      -- a header that merely carries it (a Referer with the page's URL)
      seen(curl("-H", "Cookie: " .. port_cookie, "-H", "Referer: " .. url .. "/?token=" .. TOKEN, a.path .. "/echo"))
      -- the tenant's own Authorization goes through
      s = seen(curl("-H", "Cookie: " .. port_cookie, "-H", "Authorization: Basic dGVuYW50OnB3", a.path .. "/echo"))
      assert.same({ "Basic dGVuYW50OnB3" }, s.authorization)
      -- a WebSocket: the upgrade request as the service received it
      local events = client.ws_client(("ws://%s/v1/sandboxes/%s/ports/%d/ws-req?access%%5Ftoken=%s")
        :format(url:match("^http://(.*)$"), a.sb.id, a.port, TOKEN), { { expect = "target" }, { close = 1000 } })
      assert.truthy(events[2] and events[2].text, cjson.encode(events))
      assert.is_nil(events[2].text:find(TOKEN, 1, true), events[2].text)
    end)
  end)

  it("redirects only to a path of the same origin, and forwards no upstream cookie of ours", function()
    with_apps(1, function(url, apps)
      local a = apps[1]
      a.sb:exposePort(a.port)
      for _, target in ipairs { "//evil.example/?access_token=", "///evil.example/x?access_token=",
                                "/\\evil.example/?access_token=" } do
        local status, headers = curl("-H", a.host, url .. target .. TOKEN)
        if status == 302 then
          assert.truthy(headers.location:match("^/[^/\\]") or headers.location == "/", headers.location)
        else
          assert.equal(400, status)
        end
        status, headers = curl(a.path .. target .. TOKEN)
        if status == 302 then
          local prefix = ("/v1/sandboxes/%s/ports/%d/"):format(a.sb.id, a.port)
          assert.equal(prefix, headers.location:sub(1, #prefix))
        end
      end
      local _, headers = curl(a.path .. "/?access_token=" .. TOKEN)
      local port_cookie = "Cookie: " .. cookie_of(headers)
      for _, n in ipairs { "1", "2", "4" } do
        local status
        status, headers = curl("-H", port_cookie, a.path .. "/setcookie/" .. n)
        assert.equal(200, status)
        assert.is_nil(headers["set-cookie"], n)
        status, headers = curl("-H", "Authorization: Bearer " .. TOKEN, "-H", a.host, url .. "/setcookie/" .. n)
        assert.equal(200, status)
        assert.is_nil(headers["set-cookie"], n)
      end
      -- the path form: a tenant's cookie stays within its port's path, on
      -- this host only
      headers = select(2, curl("-H", port_cookie, a.path .. "/setcookie/3"))
      local set = headers["set-cookie"] or ""
      assert.truthy(set:find("^sid=s1;"), set)
      assert.truthy(set:find(("Path=/v1/sandboxes/%s/ports/%d/"):format(a.sb.id, a.port), 1, true), set)
      assert.is_nil(set:lower():find("domain", 1, true), set)
      assert.is_nil(set:find("Path=/;", 1, true), set)
      headers = select(2, curl("-H", "Authorization: Bearer " .. TOKEN, "-H", a.host, url .. "/setcookie/3"))
      set = headers["set-cookie"] or ""
      assert.truthy(set:find("^sid=s1;"), set)
      assert.is_nil(set:lower():find("domain", 1, true), set)
    end)
  end)
end)
