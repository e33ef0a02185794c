-- Policy: the defaults every sandbox starts from, and the merge of a user's
-- policy over them. Behaviour changes by supplying a policy, never by
-- recompiling. (Validation of every field and the hooks grow with #5.)
local errors = require "moonbox.errors"

local M = {}

M.defaults = {
  limits = {
    commandTimeoutMs = nil,          -- none: commands may run forever
    maxOutputBytes = 16 * 1024 * 1024, -- per stream, per exec
    maxLogBytes = 1024 * 1024,       -- per stream, per background process
    maxSessions = 64,
    maxProcesses = 256,
    killGraceMs = 5000,              -- kill(): SIGTERM, then SIGKILL after this
    timeoutGraceMs = 500,            -- exec timeout: SIGTERM, then SIGKILL after this
    maxFileBytes = 64 * 1024 * 1024, -- readFile refuses bigger files (FILE_TOO_LARGE)
  },
  env = {
    PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    LANG = "C.UTF-8",
  },
  shell = "/bin/bash",
  hooks = {},
}

local known_limits = {}
for k in pairs(M.defaults.limits) do known_limits[k] = true end
for _, k in ipairs { "commandTimeoutMs", "memoryBytes", "pids", "cpuTime", "fileSizeBytes", "openFiles" } do
  known_limits[k] = true
end

local known_top = { limits = true, env = true, shell = true, hooks = true, mounts = true, network = true,
  hostname = true, seccomp = true, isolation = true }

local function deep_merge(base, over)
  local out = {}
  for k, v in pairs(base) do out[k] = type(v) == "table" and deep_merge(v, {}) or v end
  for k, v in pairs(over or {}) do
    if type(v) == "table" and type(out[k]) == "table" and #v == 0 then
      out[k] = deep_merge(out[k], v)
    else
      out[k] = v
    end
  end
  return out
end

local function invalid(key, message)
  errors.raise("VALIDATION_FAILED", ("policy.%s: %s"):format(key, message), { field = "policy." .. key })
end

-- resolve(policy) -> a full policy table: a module name is required, a table
-- is merged over the defaults; unknown keys and wrong types are refused.
function M.resolve(policy, limits)
  if type(policy) == "string" then
    local ok, mod = pcall(require, policy)
    if not ok then invalid("", ("cannot load policy module %q: %s"):format(policy, tostring(mod))) end
    policy = mod
  end
  if policy ~= nil and type(policy) ~= "table" then invalid("", "expected a table or a module name") end
  policy = policy or {}
  for k in pairs(policy) do
    if not known_top[k] then invalid(tostring(k), "unknown key") end
  end
  for k, v in pairs(policy.limits or {}) do
    if not known_limits[k] then invalid("limits." .. tostring(k), "unknown key") end
    if type(v) ~= "number" or v < 0 then invalid("limits." .. k, "expected a number >= 0") end
  end
  local merged = deep_merge(M.defaults, policy)
  if limits then merged.limits = deep_merge(merged.limits, limits) end
  return merged
end

return M
