-- A policy changes behaviour without recompiling: limits, and hooks that
-- allow, rewrite or deny. The same table could live in a file given to
-- `moonbox --policy file.lua script.lua`.
local moonbox = require "moonbox"

local policy = {
  limits = { commandTimeoutMs = 2000, openFiles = 128, maxSessions = 2 },
  hooks = {
    onExec = function(_, command)
      if type(command) == "string" and command:match("^%s*sudo") then return nil, "sudo is not allowed" end
      return command
    end,
    onEnv = function(_, env) env.AUDITED = "yes" return env end,
    onFile = function(_, op, path)
      if op ~= "readFile" and path:match("%.lock$") then return nil, "lock files are read-only" end
      return path
    end,
  },
}

local sandbox = moonbox.getSandbox("policy-demo", { root = os.tmpname() .. ".d", policy = policy })
local ok, err = pcall(sandbox.exec, sandbox, "sudo id")
print("sudo: " .. (ok and "ran" or err.code))
print("timeout: " .. tostring(sandbox:exec("sleep 5").timedOut))
print("open files: " .. sandbox:exec("ulimit -n").stdout:gsub("%s+$", ""))
sandbox:setEnvVars { TEAM = "core" }
print("env: " .. sandbox:exec("echo $TEAM $AUDITED").stdout:gsub("%s+$", ""))
ok, err = pcall(sandbox.writeFile, sandbox, "deps.lock", "x")
print("write lock file: " .. (ok and "written" or err.code))
sandbox:createSession {}
ok, err = pcall(sandbox.createSession, sandbox, {})
print("third session: " .. (ok and "created" or err.code))
print("in force: openFiles=" .. sandbox:info().limits.openFiles)
sandbox:destroy()
