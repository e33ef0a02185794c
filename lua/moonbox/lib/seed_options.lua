-- Option names of the seed's SDK (@cloudflare/sandbox) that a porting user
-- passes (issue #16): accepted where they mean something here, translated to
-- the moonbox option; refused where they do not, with VALIDATION_FAILED and
-- a message naming what to use instead. adapt() runs before each call's own
-- option check (V.options), so unknown names still fail there.
--   rules[name] = "ok"                       accepted as is (the call reads it)
--               = {to = "timeout"}           renamed (both given: refused)
--               = {drop = true, check = fn}  accepted, checked, then removed
--               = "message"                  refused with this message
local V = require "moonbox.lib.validate"

local M = {}

local function bool(v, field)
  if v ~= nil and type(v) ~= "boolean" then V.fail(field, "expected true or false") end
end

local UTF8 = { ["utf-8"] = true, utf8 = true }

M.exec = {
  -- exec's onOutput is called whenever it is given: stream = true asks for nothing more
  stream = { drop = true, check = bool },
  encoding = { drop = true, check = function(v, field)
    if v ~= nil and not UTF8[v] then
      V.fail(field, "exec's output is the command's raw bytes (a Lua string); over HTTP a non-UTF-8 stdout "
        .. "comes base64-encoded with stdoutEncoding = \"base64\": only \"utf-8\" is accepted here")
    end
  end },
  onComplete = "not supported: exec returns the result (execStream ends with a complete event)",
  onError = "not supported: exec raises its error (catch it with pcall)",
  signal = "not supported: run the call in a task (moonbox.spawn) and task:cancel() it, or pass timeout",
  origin = "not supported: every exec is the user's",
  sessionId = "not supported here: call exec on sandbox:getSession(id)",
}

M.startProcess = {
  encoding = { drop = true, keep_as = "_encoding", check = function(v, field)
    if v ~= nil and not UTF8[v] and v ~= "base64" then
      V.fail(field, "expected \"utf-8\" or \"base64\" (how getProcessLogs returns the logs)")
    end
  end },
  onError = "not supported: startProcess raises its error (catch it with pcall)",
  sessionId = "not supported here: call startProcess on sandbox:getSession(id)",
}

M.gitCheckout = {
  cloneTimeoutMs = { to = "timeout" },
}

M.createSession = {
  name = "not supported: a session is named by its id",
  isolation = "not supported: sessions of a sandbox share it; isolation is getSandbox's option "
    .. "(isolation = \"auto\"|\"namespaces\"|\"none\") and each sandbox has its own",
}

M.runCode = {
  envVars = "not supported on runCode: give envVars to createCodeContext and run in that context",
  signal = "not supported: run the call in a task (moonbox.spawn) and task:cancel() it, or pass timeout",
}

M.watch = {
  signal = "not supported: close the iterator (iter.close()) to stop watching",
  onEvent = "not supported: watch returns an iterator of events (for ev in sandbox:watch(path) do ... end)",
  onError = "not supported: the watch iterator raises its error",
}

-- adapt(opts, rules, what) -> opts translated (a copy when anything changed)
function M.adapt(opts, rules, what)
  if type(opts) ~= "table" then return opts end
  local out
  for name, rule in pairs(rules) do
    local v = opts[name]
    if v ~= nil then
      local field = what .. " options." .. name
      if type(rule) == "string" then
        V.fail(field, rule)
      end
      out = out or {}
      if rule.check then rule.check(v, field) end
      if rule.to then
        if opts[rule.to] ~= nil then
          V.fail(field, ("give %s or %s, not both (%s is the seed's name for %s)"):format(name, rule.to, name, rule.to))
        end
        out[rule.to] = v
      end
      if rule.keep_as then out[rule.keep_as] = v end
      out[name] = false -- marks removal
    end
  end
  if not out then return opts end
  local copy = {}
  for k, v in pairs(opts) do copy[k] = v end
  for k, v in pairs(out) do
    if v == false and rules[k] then copy[k] = nil else copy[k] = v end
  end
  return copy
end

return M
