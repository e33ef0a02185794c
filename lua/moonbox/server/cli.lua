-- `moonbox serve`: one HTTP server on the runtime's loop in front of the
-- process's sandboxes. /v1/... goes to the JSON API (moonbox.server.api),
-- / serves the terminal page, anything else goes to the --handler script.
-- A bearer token guards every path but /healthz and /readyz: generated at
-- start (and printed in the page's URL) unless --token-file gives one.
-- --no-token opts out, on loopback or a unix socket only, and only while no
-- sandbox can reach the listener (no policy with network = "host" or
-- isolation = "none": sandbox code would call the API as its neighbours).
local async = require "moonbox.async"
local errors = require "moonbox.errors"
local api_errors = require "moonbox.server.api_errors"
local http = require "moonbox.server.http"
local fs = require "moonbox.lib.fs"
local cjson = require "cjson.safe"
local token_mod = require "moonbox.server.token"
local bit = require "bit"

local M = {}

M.usage = [[
usage: moonbox serve [--listen 127.0.0.1:8080 | --listen unix:/path.sock]
                     [--policy file.lua] [--handler app.lua] [--token-file F | --no-token]
                     [--max-body BYTES] [--max-connections N] [--idle-timeout-ms MS]
                     [--prewarm on|off|N] (keep N sandboxes built ahead, on: 1; docs/isolation.md)
                     [--max-sandboxes N] [--idle-timeout-s S] [--shutdown-grace-s S]
                     [--access-log FILE | --access-log off]   (default: stderr)
                     [--max-buffered-bytes N] (output kept in memory at once, runtime-wide,
                                           default a quarter of RAM; and bytes held for
                                           clients, server-wide, default 64 MiB: past it
                                           503 BUFFERS_FULL; docs/server.md)
                     [--allow-unisolated] (isolation = "auto" may run without namespaces
                                           where the kernel refuses them; docs/server.md)
]]

-- a command-line mistake: one line (`moonbox serve` prefixes it), exit 2
local function usage_error(message)
  errors.raise("VALIDATION_FAILED", message, { usage = true })
end

-- parse({...}) -> {listen, policy, handler, tokenFile, maxBody, maxConnections, idleTimeoutMs, ...}
function M.parse(argv)
  local opts = { listen = "127.0.0.1:8080" }
  local names = {
    ["--listen"] = "listen", ["--policy"] = "policy", ["--handler"] = "handler", ["--token-file"] = "tokenFile",
    ["--max-body"] = "maxBody", ["--max-connections"] = "maxConnections", ["--idle-timeout-ms"] = "idleTimeoutMs",
    ["--prewarm"] = "prewarm", ["--max-sandboxes"] = "maxSandboxes", ["--idle-timeout-s"] = "idleTimeoutS",
    ["--shutdown-grace-s"] = "shutdownGraceS", ["--access-log"] = "accessLog",
    ["--max-buffered-bytes"] = "maxBufferedBytes",
  }
  local numeric = { maxBody = true, maxConnections = true, idleTimeoutMs = true, maxSandboxes = true,
    idleTimeoutS = true, shutdownGraceS = true, maxBufferedBytes = true }
  local zero_ok = { shutdownGraceS = true } -- --shutdown-grace-s 0: no wait
  local switches = { ["--allow-unisolated"] = "allowUnisolated", ["--no-token"] = "noToken" } -- flags without a value
  local i = 1
  while i <= #argv do
    local flag, value = argv[i], argv[i + 1]
    while switches[flag] do
      opts[switches[flag]] = true
      i = i + 1
      flag, value = argv[i], argv[i + 1]
    end
    if flag == nil then break end
    local inline_flag, inline_value = flag:match("^(%-%-[%w-]+)=(.*)$")
    if inline_flag then flag, value, i = inline_flag, inline_value, i - 1 end
    local key = names[flag]
    if not key then usage_error(("unknown option '%s'"):format(flag)) end
    if value == nil then usage_error(flag .. " needs a value") end
    if numeric[key] then
      value = tonumber(value)
      if not value or value < (zero_ok[key] and 0 or 1) or value % 1 ~= 0 then
        usage_error(flag .. (zero_ok[key] and " needs a whole number of seconds" or " needs a positive integer"))
      end
    end
    if key == "prewarm" and value ~= "on" and value ~= "off" then
      -- a pool size (sandbox/prewarm.lua bounds it)
      local size, max = value:match("^%d+$") and tonumber(value), require("moonbox.sandbox.prewarm").MAX_SPARES
      if not size or size > max then usage_error("--prewarm needs on, off or a pool size 0-" .. max) end
      value = size
    end
    opts[key] = value
    i = i + 2
  end
  if opts.noToken and opts.tokenFile then usage_error("--no-token and --token-file exclude each other") end
  return opts
end

-- Equal strings, in time that depends on the lengths only.
function M.constant_time_equal(a, b)
  local diff = bit.bxor(#a, #b)
  for i = 1, #b do
    diff = bit.bor(diff, bit.bxor(a:byte(i) or 0, b:byte(i)))
  end
  return diff == 0
end

local function json_response(status, code, message, context)
  return { status = status, headers = { ["content-type"] = "application/json" },
    body = cjson.encode(api_errors.envelope(code, message, context, status)) }
end

local function is_page(req)
  return (req.method == "GET" or req.method == "HEAD")
    and (req.path == "/" or req.path == "/index.html" or req.path:match("^/page/") ~= nil)
end

-- The page's cookie: its value is not the token but an HMAC of it that
-- opens the page's files only (moonbox.server.token); the port proxy
-- takes it for nothing and passes it on to no service.
M.COOKIE = token_mod.PAGE_COOKIE

local function cookie_token(req)
  local cookies = req.headers["cookie"]
  if type(cookies) ~= "string" then return nil end
  for name, value in (";" .. cookies):gmatch(";%s*([^=;%s]+)=([^;]*)") do
    if name == M.COOKIE then return value end
  end
end

-- The request's token: "Authorization: Bearer <token>" (the scheme in any
-- case, RFC 9110); or, where a browser cannot set headers (a WebSocket, the
-- page), the query parameter access_token (or token, as in the URL
-- `moonbox serve` prints). The page and its assets also take the cookie the
-- page sets; the API does not (a cookie goes along with requests other
-- sites' pages make: CSRF). -> the tokens, and the page cookie's value
local function presented_tokens(req)
  local auth = req.headers["authorization"]
  if auth then
    local scheme, cred = tostring(auth):match("^%s*(%S+)%s+(%S+)%s*$")
    return { scheme and scheme:lower() == "bearer" and cred or nil }
  end
  if req.websocket or is_page(req) then
    local q = req.query or {}
    return { q.access_token, q.token }, is_page(req) and cookie_token(req) or nil
  end
  return {}
end

-- true when one of the tokens the request presents is the server's (or,
-- for the page's files, its cookie is the page's).
function M.authorized(req, token)
  local ok = false
  local given, cookie = presented_tokens(req)
  for _, v in pairs(given) do
    if type(v) == "string" and M.constant_time_equal(v, token) then ok = true end
  end
  if cookie and M.constant_time_equal(cookie, token_mod.page_cookie(token)) then ok = true end
  return ok
end

M.new_token = token_mod.new

-- 405 for the GET-only routes (/healthz, /readyz, /metrics)
local function get_or_head_only()
  local r = json_response(405, "METHOD_NOT_ALLOWED", "GET or HEAD only", { allow = { "GET", "HEAD" } })
  r.headers.allow = "GET, HEAD"
  return r
end

-- fds a new sandbox needs at least (its init's socket, the root fd, a
-- session's pipe, the spawns' short-lived ones), kept free for /readyz
M.READY_FD_MARGIN = 64

-- Why this server could not make a sandbox now, or nil: it is stopping, the
-- host refuses the namespaces its sandboxes need (server.noSandbox, set at
-- start), it holds --max-sandboxes, or it is about out of fds.
function M.not_ready_reason(server)
  if server and server.draining then return "shutting_down" end
  if server and server.noSandbox then return "isolation_unavailable" end
  local ok, api = pcall(require, "moonbox.server.api")
  if ok then
    local n = 0
    for _ in pairs(require("moonbox.sandbox").all()) do n = n + 1 end
    if n >= api.config.maxSandboxes then return "max_sandboxes" end
  end
  local soft, _, open = require("moonbox.lib.util").fd_limits()
  if soft and open and open + M.READY_FD_MARGIN > soft then return "open_files" end
  return nil
end

-- GET /healthz (the process serves) and GET /readyz (it can make a sandbox
-- now: 503 with the reason when not): answered without a token, they say
-- nothing else.
local function health_route(req, server)
  if req.path ~= "/healthz" and req.path ~= "/readyz" then return nil end
  if req.method ~= "GET" and req.method ~= "HEAD" then return get_or_head_only() end
  local headers = { ["content-type"] = "application/json", ["cache-control"] = "no-store" }
  if req.path == "/healthz" then return { status = 200, headers = headers, body = '{"status":"ok"}\n' } end
  local why = M.not_ready_reason(server)
  if why then
    return { status = 503, headers = headers, body = ('{"status":"not ready","reason":"%s"}\n'):format(why) }
  end
  return { status = 200, headers = headers, body = '{"status":"ready"}\n' }
end

-- ---- the page ---------------------------------------------------------------------

local CONTENT_TYPES = { html = "text/html; charset=utf-8", js = "text/javascript; charset=utf-8",
  css = "text/css; charset=utf-8" }

local function lua_dir()
  local here = package.searchpath("moonbox.server.cli", package.path)
  return here and here:match("^(.*)/moonbox/server/cli%.lua$")
end

local function exists(path)
  return fs.stat(path) ~= nil
end

-- Where the page is: the source tree (through the build tree's lua link) or
-- an installed prefix (share/moonbox/page, beside the Lua modules'
-- share/lua/5.1), found from where the modules are; xterm.js is vendored in
-- its vendor/ (CMakeLists.txt).
function M.find_page()
  local ldir = lua_dir() or "."
  local page
  for _, dir in ipairs { os.getenv("MOONBOX_PAGE_DIR") or false, ldir .. "/../share/page",
                         ldir .. "/../../moonbox/page" } do
    if dir and exists(dir .. "/index.html") then page = dir break end
  end
  local vendor = {}
  if page and exists(page .. "/vendor/lib/xterm.js") then
    vendor["xterm.js"], vendor["xterm.css"] = page .. "/vendor/lib/xterm.js", page .. "/vendor/css/xterm.css"
  end
  return page, vendor
end

local function serve_file(path)
  local data = path and fs.read_file(path)
  if not data then return json_response(404, "NOT_FOUND", "no such page asset") end
  local ext = path:match("%.(%w+)$")
  return { status = 200, body = data, headers = {
    ["content-type"] = CONTENT_TYPES[ext] or "application/octet-stream",
    ["cache-control"] = "no-cache", ["x-content-type-options"] = "nosniff" } }
end

local function page_route(app, req)
  if req.method ~= "GET" and req.method ~= "HEAD" then return nil end
  local path = req.path
  if path == "/" or path == "/index.html" then
    return serve_file(app.page and app.page .. "/index.html")
  end
  local name = path:match("^/page/([%w%-]+%.%w+)$")
  if not name then return nil end
  if app.vendor[name] then return serve_file(app.vendor[name]) end
  return serve_file(app.page and app.page .. "/" .. name)
end

-- ---- the app ---------------------------------------------------------------------------

-- app(opts) -> handler(req, res): token check, then /v1, the page, the
-- user's handler. opts: token (string or nil), userHandler (function or nil).
function M.app(opts)
  local app = { token = opts.token, user = opts.userHandler, service = opts.service, server = opts.server }
  app.page, app.vendor = opts.page, opts.vendor or {}
  local function route(req, res)
    local health = health_route(req, app.server and app.server())
    if health then
      req.route = req.path
      return health
    end
    -- an exposed port (moonbox.server.proxy): its own token rules
    local proxy = require "moonbox.server.proxy"
    local target = proxy.match(req)
    if target then
      req.sandboxId = target.id
      req.route = target.form == "host" and "{port}-{id}.localhost/*" or "/v1/sandboxes/{id}/ports/{port}/*"
      return proxy.handle(req, res, target, { token = app.token, equal = M.constant_time_equal })
    end
    if app.token then
      if not M.authorized(req, app.token) then
        if app.service then app.service:reject("unauthorized") end
        local r = json_response(401, "UNAUTHORIZED", "a valid bearer token is required")
        r.headers["www-authenticate"] = 'Bearer realm="moonbox"'
        return r
      end
    end
    if req.path == "/metrics" and app.service and app.server then
      req.route = "/metrics"
      if req.method ~= "GET" and req.method ~= "HEAD" then return get_or_head_only() end
      return { status = 200, headers = { ["content-type"] = "text/plain; version=0.0.4; charset=utf-8",
        ["cache-control"] = "no-store" }, body = app.service:metrics(app.server()) }
    end
    -- the MCP server's streamable HTTP transport (moonbox.mcp.http)
    if req.path == "/mcp" then return require("moonbox.mcp.http").handle(req, res) end
    if req.path == "/v1" or req.path:sub(1, 4) == "/v1/" then
      local ok, api = pcall(require, "moonbox.server.api")
      if ok then return api.handle(req, res) end
      -- without the JSON API, the page's terminal still works
      local id, sid = req.path:match("^/v1/sandboxes/([^/]+)/sessions/([^/]+)/terminal$")
      if id then return require("moonbox.server.terminal_ws").handle(req, res, id, sid) end
      return json_response(404, "NOT_FOUND", "the HTTP API is not available")
    end
    local page = page_route(app, req)
    if page then
      req.route = req.path:match("^/page/") and "/page/{file}" or "/"
      -- the page's own assets load without the token in their URLs
      if app.token and page.status == 200 and (req.path == "/" or req.path == "/index.html") then
        page.headers["set-cookie"] = ("%s=%s; Path=/; HttpOnly; SameSite=Strict"):format(M.COOKIE,
          token_mod.page_cookie(app.token))
        page.headers["referrer-policy"] = "no-referrer"
      end
      return page
    end
    if app.user then
      req.route = "(handler)"
      return app.user(req, res)
    end
    return json_response(404, "NOT_FOUND", ("no route for %s %s"):format(req.method, req.path))
  end
  if not app.service then return route end
  -- as a service: each request is counted for its sandbox's idle time while it runs
  return function(req, res)
    if req.path == "/healthz" or req.path == "/readyz" then return route(req, res) end
    app.service:begin(req)
    local ok, result = pcall(route, req, res)
    app.service:finish(req)
    if not ok then error(result, 0) end
    return result
  end
end

local function read_token(path)
  local data, msg = fs.read_file(path)
  if not data then
    -- "ENOENT: no such file or directory (open '/x')" -> "no such file or directory"
    local reason = tostring(msg):match("^%u+: (.-) %(") or tostring(msg)
    errors.raise("VALIDATION_FAILED", ("cannot read the token file %q: %s"):format(path, reason))
  end
  local token = data:match("^%s*(%S+)%s*$")
  if not token or #token < 16 then
    errors.raise("VALIDATION_FAILED", ("the token in %q must be one word of at least 16 characters"):format(path))
  end
  return token
end

-- A handler script returns function handle(req, res).
local function load_handler(path)
  local chunk, err = loadfile(path)
  if not chunk then errors.raise("VALIDATION_FAILED", "cannot load the handler: " .. tostring(err)) end
  local fn = chunk()
  if type(fn) ~= "function" then
    errors.raise("VALIDATION_FAILED", ("the handler %q must return a function handle(req, res)"):format(path))
  end
  return fn
end

-- Why sandboxes made with this policy could reach the listener, or nil.
function M.reaches_listener(policy)
  if type(policy) ~= "table" then return nil end
  if policy.network == "host" then return 'the policy gives sandboxes the host\'s network (network = "host")' end
  if policy.isolation == "none" then return 'the policy runs sandboxes unisolated (isolation = "none")' end
end

-- Why no sandbox of this server can be made, or nil: its policy's sandboxes
-- need namespaces ("auto" without --allow-unisolated, or "namespaces") and
-- the kernel refuses them (moonbox.sandbox.userns names the cause); the
-- second result says why sandboxes will run unisolated instead.
function M.no_sandbox_reason(policy, allow_unisolated)
  local isolation = policy.isolation or "auto"
  if isolation == "none" then return nil end
  local why = require("moonbox.sandbox.userns").refused()
  if not why then return nil end
  if isolation == "auto" and allow_unisolated then return nil, why end
  return why
end

-- serve's default policy: the user's (or none) with git.allowLocal off
-- unless the user's policy turns it on (a tenant must not clone the host's
-- repositories).
local function serve_policy(ref)
  local policy_mod = require "moonbox.policy"
  local user = ref and policy_mod.validate(policy_mod.load(ref)) or {}
  local out = {}
  for k, v in pairs(user) do out[k] = v end
  local git = {}
  for k, v in pairs(type(user.git) == "table" and user.git or {}) do git[k] = v end
  if git.allowLocal == nil then git.allowLocal = false end
  out.git = git
  return out
end

-- Start serving; returns the server (main() keeps it running) and the token.
function M.start(opts)
  local addr = http.parse_listen(opts.listen)
  local policy = serve_policy(opts.policy)
  local token
  if opts.noToken then
    if not http.is_local(addr) then
      errors.raise("VALIDATION_FAILED", ("refusing --no-token on %s: only a loopback address or a unix socket " ..
        "may go without a token"):format(opts.listen))
    end
    local why = M.reaches_listener(policy)
      or opts.allowUnisolated and "--allow-unisolated lets sandboxes run without namespaces"
    if why then
      errors.raise("VALIDATION_FAILED", ("refusing --no-token: sandbox code could call the API: %s"):format(why))
    end
  else
    token = opts.tokenFile and read_token(opts.tokenFile) or M.new_token()
  end
  require("moonbox.policy").set_default(policy)
  -- the runtime-wide ceiling for buffered output: no policy goes past it;
  -- and the server-wide bound on bytes held for clients (responses, SSE,
  -- WebSocket messages, the port proxy; moonbox.server.send_budget)
  if opts.maxBufferedBytes then
    require("moonbox.session.budget").ceiling = opts.maxBufferedBytes
    require("moonbox.server.send_budget").limit = opts.maxBufferedBytes
  end
  -- fail closed: no sandbox of this server runs without namespaces because
  -- the kernel refused them, unless asked (a policy with isolation = "none"
  -- asks for itself)
  require("moonbox.sandbox").allow_unisolated = opts.allowUnisolated == true
  if opts.prewarm == "on" then
    require("moonbox").prewarm(true)
  elseif type(opts.prewarm) == "number" then
    require("moonbox").prewarm(opts.prewarm)
  end
  local page, vendor = M.find_page()
  local service = require("moonbox.server.service").new {
    accessLog = opts.accessLog, idleTimeoutS = opts.idleTimeoutS, shutdownGraceS = opts.shutdownGraceS,
  }
  local api_ok, api = pcall(require, "moonbox.server.api")
  if api_ok then
    if opts.maxSandboxes then api.config.maxSandboxes = opts.maxSandboxes end
    api.on_reject = function(reason) service:reject(reason) end
  end
  local server
  if api_ok then api.stopping = function() return server ~= nil and server.draining == true end end
  local handler = M.app {
    token = token, userHandler = opts.handler and load_handler(opts.handler), page = page, vendor = vendor,
    service = service, server = function() return server end,
  }
  server = http.listen({ listen = opts.listen, maxBody = opts.maxBody, maxConnections = opts.maxConnections,
    idleTimeoutMs = opts.idleTimeoutMs }, handler)
  -- a liveness probe answered 503 past --max-connections would restart a busy pod
  server.alwaysAnswer = { ["/healthz"] = true, ["/readyz"] = true, ["/metrics"] = true }
  -- an egress sandbox never reaches this port, even through an allow rule
  -- naming the host (network/nft.lua)
  if addr.port and addr.port > 0 then table.insert(require("moonbox.network").server_ports, addr.port) end
  server.onDone = function(req, res) service:done(req, res) end
  server.onReject = function(reason) service:reject(reason) end
  server.service = service
  server.noSandbox, server.unisolated = M.no_sandbox_reason(policy, opts.allowUnisolated)
  service:start_idle()
  require("moonbox.mcp.http").service = service
  if not addr.unix then
    require("moonbox.sandbox.ports").server = { port = tonumber(server.address:match(":(%d+)$")) }
  end
  return server, token
end

-- main(argv): `moonbox serve ...`. --help/-h: the usage, exit 0. A
-- command-line mistake or a refused setting: one line, exit 2; an
-- operational failure (the address cannot be bound, ...): one line, exit 1.
-- Only a bug in moonbox itself (an error that is no error object) keeps
-- its traceback.
function M.main(argv)
  for _, a in ipairs(argv) do
    if a == "--help" or a == "-h" then
      io.stdout:write(M.usage)
      io.stdout:flush()
      os.exit(0)
    end
  end
  local opts
  local ok, server, token = pcall(function()
    opts = M.parse(argv)
    return M.start(opts)
  end)
  if not ok then
    if not errors.is_error(server) then error(server, 0) end
    io.stderr:write("moonbox serve: ", (tostring(server.message):gsub("\n+$", "")), "\n")
    io.stderr:flush()
    os.exit(server.code == "VALIDATION_FAILED" and 2 or 1)
  end
  local runtime = require "moonbox._runtime"
  -- (the MCP sessions' own sandboxes go with their sessions, before the server closes)
  runtime.at_exit(function()
    pcall(require("moonbox.mcp.http").end_all)
    server:close()
  end)
  -- a crashed runtime's egress leftovers (links, nft tables, resolvers) go
  -- now, not only before this server's first egress sandbox (network/init.lua)
  if require("moonbox.core").getuid() == 0 then
    require("moonbox.async").spawn(function() pcall(require("moonbox.network").sweep) end)
  end
  -- SIGTERM: the graceful stop (docs/server.md); SIGINT and SIGHUP stay immediate
  runtime.on_signal("SIGTERM", function()
    io.stderr:write("moonbox serve: SIGTERM: stopping (grace ", tostring(opts.shutdownGraceS or 10), " s)\n")
    local stopped, err = pcall(server.service.stop, server.service, server)
    pcall(require("moonbox.mcp.http").end_all)
    if not stopped then io.stderr:write("moonbox serve: stop: ", errors.format(err), "\n") end
    -- the sandboxes stop (their files stay) before the server's teardown
    -- starts: the server closes its sockets while the loop runs on, and a file a
    -- destroy opened meanwhile took a closed socket's number, which libuv
    -- still watched (epoll_ctl EPERM: abort, exit 134, 1 in ~10 stops)
    local shut, shut_err = pcall(require("moonbox.sandbox").shutdown)
    if not shut then io.stderr:write("moonbox serve: shutdown: ", errors.format(shut_err), "\n") end
    runtime.run_exit_hooks() -- the server closes
    os.exit(0)
  end)
  local unix = server.address:match("^unix:")
  io.stdout:write("moonbox: listening on ", unix and server.address or ("http://" .. server.address), "\n")
  -- as Jupyter does: the page's URL with the token, to open in a browser
  if token and not opts.tokenFile then
    io.stdout:write("moonbox: open ", unix and "http://localhost" or ("http://" .. server.address),
      "/?token=", token, unix and (" (through " .. server.address .. ")") or "", "\n")
  elseif token then
    io.stdout:write("moonbox: open ", unix and "http://localhost" or ("http://" .. server.address),
      "/ with the token in ", opts.tokenFile, " (/?token=...)\n")
  end
  -- a server that can make no sandbox says so at once (and /readyz answers 503)
  if server.noSandbox then
    io.stdout:write("moonbox: no sandbox can be made here (/readyz: 503 isolation_unavailable): ",
      server.noSandbox, "\n")
  elseif server.unisolated then
    io.stdout:write("moonbox: sandboxes run without isolation here (--allow-unisolated): ", server.unisolated, "\n")
  end
  io.stdout:flush()
  -- serve until a signal stops the runtime (_runtime.lua kills the sandboxes first)
  async.await(function(resume) M._stop = resume end, "moonbox serve")
  server:close()
end

return M
