-- The public methods' parameters, as lua/moonbox/types.lua declares them
-- (spec/types_spec.lua checks that the two agree). A call with a non-nil
-- argument past them is an argument mistake (API.md: VALIDATION_FAILED
-- naming the field), not something to drop: seed-style code such as
-- `exists(path, sessionId)` would otherwise run, silently, in another
-- session than the one meant.
local errors = require "moonbox.errors"

local M = {}

M.params = {
  Sandbox = {
    info = {}, destroy = { "opts" }, setNetwork = { "opts" }, createSession = { "opts" }, getSession = { "id" },
    deleteSession = { "id" }, listSessions = {}, setEnvVars = { "map" }, createBackup = { "opts" },
    restoreBackup = { "backup" }, exposePort = { "port", "opts" }, unexposePort = { "port" },
    getExposedPorts = {}, commit = { "opts" },
  },
  Session = {
    exec = { "command", "opts" }, execStream = { "command", "opts" }, setEnvVars = { "map" },
    startProcess = { "command", "opts" }, listProcesses = {}, getProcess = { "id" },
    killProcess = { "id", "signal" }, killAllProcesses = { "signal" }, cleanupCompletedProcesses = {},
    getProcessLogs = { "id" }, streamProcessLogs = { "id" },
    writeFile = { "path", "content", "opts" }, readFile = { "path", "opts" }, readFileStream = { "path" },
    mkdir = { "path", "opts" }, deleteFile = { "path" }, renameFile = { "oldPath", "newPath" },
    moveFile = { "sourcePath", "destinationPath" }, listFiles = { "path", "opts" }, exists = { "path" },
    watch = { "path", "opts" }, gitCheckout = { "repoUrl", "opts" }, checkChanges = { "path", "opts" },
    createCodeContext = { "opts" }, runCode = { "code", "opts" }, runCodeStream = { "code", "opts" },
    listCodeContexts = {}, deleteCodeContext = { "id" }, terminal = { "opts" },
  },
  Process = {
    kill = { "signal" }, getStatus = {}, getLogs = {}, waitForExit = { "timeoutMs" },
    waitForLog = { "pattern", "timeoutMs", "opts" }, waitForPort = { "port", "opts" },
  },
  Terminal = {
    write = { "data" }, read = {}, onData = { "fn" }, resize = { "cols", "rows" }, close = {}, wait = {},
  },
}

local function signature(name, params)
  return ("%s(%s)"):format(name, table.concat(params, ", "))
end

-- guard(class, kind): each method of M.params[kind] that class defines
-- refuses arguments past its parameters.
function M.guard(class, kind)
  for name, params in pairs(M.params[kind]) do
    local method = rawget(class, name)
    if method then
      local max = #params
      class[name] = function(self, ...)
        local n = select("#", ...)
        if n > max then
          for i = max + 1, n do
            local extra = select(i, ...)
            if extra ~= nil then
              local field = ("%s argument %d"):format(name, i)
              errors.raise("VALIDATION_FAILED", ("%s takes %d argument%s, got a %s as argument %d"):format(
                signature(name, params), max, max == 1 and "" or "s", type(extra), i), { field = field })
            end
          end
        end
        return method(self, ...)
      end
    end
  end
end

return M
