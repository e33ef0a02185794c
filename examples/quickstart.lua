-- Every example of the seed's session document, with commands that exist on
-- a bare machine. Run: ./build/moonbox examples/quickstart.lua
local moonbox = require "moonbox"
local sandbox = moonbox.getSandbox("quickstart", { root = os.tmpname() .. ".d" })
sandbox:exec("mkdir -p prod test") -- the default session starts in /workspace

-- Separate workflow environments
local prod = sandbox:createSession { id = "prod", cwd = "/workspace/prod",
  env = { NODE_ENV = "production", API_URL = "https://api.example.com" } }
local test = sandbox:createSession { id = "test", cwd = "/workspace/test",
  env = { NODE_ENV = "test", API_URL = "http://localhost:3000", DEBUG_MODE = false } }

-- Run in parallel
local build = 'sleep 0.2; echo "built for $NODE_ENV against $API_URL in $(basename "$PWD")' ..
  ' debug=${DEBUG_MODE-unset}"'
local results = moonbox.all(function() return prod:exec(build) end, function() return test:exec(build) end)
io.write(results[1].stdout, results[2].stdout)

-- Session with a default command timeout; a per-command timeout overrides it
local session = sandbox:createSession { commandTimeoutMs = 500 }
local r = session:exec("sleep 10")
print(("session timeout: timedOut=%s exitCode=%d"):format(tostring(r.timedOut), r.exitCode))
r = session:exec("sleep 10", { timeout = 300 })
print(("per-command timeout: timedOut=%s after %s ms"):format(tostring(r.timedOut),
  r.duration >= 300 and ">=300" or "?"))

-- First request: create a task-specific session; second request: resume it
local first = sandbox:createSession { id = "build" }
first:exec("mkdir -p repo && printf 'hello\\n' > repo/README")
first:exec("cd repo && export BUILD_ID=42")
local resumed = sandbox:getSession("build")
print("resumed: " .. resumed:exec('echo "$(pwd | sed s,.*/,,) build $BUILD_ID: $(cat README)"').stdout:gsub("\n$", ""))

-- A temporary session, deleted whatever happens
sandbox:createSession { id = "temp-task" }
local ok, err = pcall(function()
  local s = sandbox:getSession("temp-task")
  s:exec("false")
  error({ code = "TASK_FAILED", message = "heavy task failed" })
end)
sandbox:deleteSession("temp-task")
print(("temp task: ok=%s %s, sessions now: %s"):format(tostring(ok), err.code,
  table.concat(sandbox:listSessions(), ",")))

-- Sandbox-level environment variables, with an unset
sandbox:setEnvVars { API_KEY = "sk-test", NODE_ENV = "production", OLD_TOKEN = "x" }
sandbox:setEnvVars { OLD_TOKEN = false }
io.write(sandbox:exec('echo "$NODE_ENV key=$API_KEY old=${OLD_TOKEN-unset}"').stdout)
sandbox:destroy()
