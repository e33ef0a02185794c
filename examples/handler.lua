-- A handler for `moonbox serve --handler examples/handler.lua`: a tiny
-- "run this code for user X" service. Each user gets a persistent sandbox,
-- so files and shell state survive between requests:
--   curl -H "Authorization: Bearer $T" -d '{"code":"echo hi > note; cat note"}' localhost:8080/run/alice
-- ($T: the token moonbox serve prints in the page's URL, /?token=..., or the
-- one in --token-file)
local moonbox = require "moonbox"
local cjson = require "cjson.safe"

local function reply(status, t)
  return { status = status, headers = { ["content-type"] = "application/json" }, body = cjson.encode(t) }
end

local function handle(req)
  local user = req.path:match("^/run/([a-z0-9_-]+)$")
  if not user or #user > 32 then return reply(404, { code = "NOT_FOUND", message = "POST /run/<user>" }) end
  if req.method ~= "POST" then return reply(405, { code = "METHOD_NOT_ALLOWED", message = "use POST" }) end
  local body = cjson.decode(req.body)
  if type(body) ~= "table" or type(body.code) ~= "string" then
    return reply(400, { code = "VALIDATION_FAILED", message = 'send {"code": "shell commands"}' })
  end
  local sandbox = moonbox.getSandbox("user-" .. user)
  local r = sandbox:exec(body.code, { timeout = 10000, env = { USER_ID = user } })
  return reply(200, { exitCode = r.exitCode, stdout = r.stdout, stderr = r.stderr, timedOut = r.timedOut })
end

-- Run as a script (`moonbox examples/handler.lua`), it answers two requests
-- in-process, no server needed: state persists between them.
if arg and arg[0] and arg[0]:match("handler%.lua$") then
  local request = function(code) return { method = "POST", path = "/run/demo", body = cjson.encode { code = code } } end
  for _, code in ipairs { "echo hello from $USER_ID > note", "cat note; exit 3" } do
    local r = cjson.decode(handle(request(code)).body)
    print(("exitCode=%d stdout=%s"):format(r.exitCode, (r.stdout:gsub("\n", "\\n"))))
  end
  moonbox.getSandbox("user-demo"):destroy()
end

return handle
