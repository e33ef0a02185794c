-- Policy: the defaults every sandbox starts from, the merge of a user's
-- policy over them, and validation (unknown keys and wrong types raise
-- VALIDATION_FAILED naming the key). Behaviour changes by supplying a
-- policy -- a table, a module name or a file path -- never by recompiling.
-- Presets are plain data: moonbox.policies.strict, moonbox.policies.dev.
local errors = require "moonbox.errors"
local V = require "moonbox.lib.validate"

local M = {}

M.defaults = {
  limits = {
    commandTimeoutMs = nil,            -- none: commands may run forever
    maxOutputBytes = 16 * 1024 * 1024, -- per stream, per exec / runCode
    maxLogBytes = 1024 * 1024,         -- per stream, per background process
    maxSessions = 64,
    maxProcesses = 256,
    maxCompletedProcesses = 1000,      -- records of ended processes kept (oldest dropped first)
    maxCompletedLogBytes = 64 * 1024 * 1024, -- their logs, in all
    maxBufferedBytes = nil,            -- exec output held at once, runtime-wide (nil: 1/4 of RAM; session/budget.lua)
    killGraceMs = 5000,                -- kill(): SIGTERM, then SIGKILL after this
    timeoutGraceMs = 500,              -- exec timeout: SIGTERM, then SIGKILL after this
    maxFileBytes = 64 * 1024 * 1024,   -- readFile refuses bigger files (FILE_TOO_LARGE)
    tmpBytes = 256 * 1024 * 1024,      -- size of the private /tmp and /root (namespaces)
    -- enforced where the host allows, see sandbox:info(); 0 turns one off:
    memoryBytes = 2 * 1024 * 1024 * 1024, -- the sandbox's processes together (a cgroup)
    pids = 2048,                          -- processes and threads, together (a cgroup)
    diskBytes = 4 * 1024 * 1024 * 1024,   -- its root: /workspace and what it keeps (sandbox/disk.lua)
    cpuWeight = 100,                      -- its share of CPU against other sandboxes (a cgroup, 1-10000)
    cpuTime = nil, fileSizeBytes = nil, openFiles = nil,
  },
  env = {
    PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    LANG = "C.UTF-8",
  },
  shell = "/bin/bash",
  hooks = {},
  git = { allowLocal = true }, -- moonbox serve: false unless its policy says true
}

local LIMIT_KEYS = { "commandTimeoutMs", "maxOutputBytes", "maxLogBytes", "maxSessions", "maxProcesses",
  "maxCompletedProcesses", "maxCompletedLogBytes", "maxBufferedBytes",
  "killGraceMs", "timeoutGraceMs", "maxFileBytes", "tmpBytes", "memoryBytes", "pids", "diskBytes", "cpuWeight",
  "cpuTime", "fileSizeBytes",
  "openFiles", "egressBytesPerSecond", "connections" }
-- Values below which nothing in the sandbox could run, refused rather than
-- left to fail without a word.
local LIMIT_FLOORS = {
  openFiles = { 64, "the session shell's own fds go up to 63" },
  cpuTime = { 1, "0 CPU seconds kills every process at once" },
  memoryBytes = { 1048576, "below 1 MiB the OOM killer ends the session shell before it runs anything" },
  diskBytes = { 16 * 1024 * 1024, "below 16 MiB ext4 has no room for its journal and the workspace" },
  egressBytesPerSecond = { 1024, "below 1 KiB/s not even a TCP handshake with options gets through steadily" },
  connections = { 1, "0 connections is network = \"none\"" },
}
-- Limits a 0 turns off (the default policy sets them); any other 0 is
-- below its floor (openFiles, cpuTime) or taken as it is.
local OFF_BY_ZERO = { memoryBytes = true, pids = true, diskBytes = true, cpuWeight = true }
-- Values above which the kernel refuses the setting.
local LIMIT_CEILINGS = { cpuWeight = 10000 }
local MOUNT_KEYS = { type = true, src = true, dst = true, size = true }
local HOOKS = { onCreateSession = true, onExec = true, onFile = true, onStartProcess = true, onEnv = true,
  onRunCode = true, onTerminal = true }
local MOUNT_TYPES = { bind = true, ro_bind = true, tmpfs = true, proc = true, dev = true }

local function invalid(key, message)
  local field = key == "" and "policy" or "policy." .. key
  errors.raise("VALIDATION_FAILED", ("%s: %s"):format(field, message), { field = field })
end

local function expect(value, kind, key)
  if value ~= nil and type(value) ~= kind then invalid(key, ("expected a %s, got %s"):format(kind, type(value))) end
end

local checks = {
  limits = function(v)
    expect(v, "table", "limits")
    local known = {}
    for _, k in ipairs(LIMIT_KEYS) do known[k] = true end
    for k, n in pairs(v or {}) do
      if not known[k] then invalid("limits." .. tostring(k), "unknown key" .. V.did_you_mean(k, known)) end
      if type(n) ~= "number" or n < 0 or n ~= n or n % 1 ~= 0 then
        invalid("limits." .. k, "expected an integer >= 0")
      end
      local floor = LIMIT_FLOORS[k]
      if floor and not (n == 0 and OFF_BY_ZERO[k]) and n < floor[1] then
        invalid("limits." .. k, ("expected at least %d: %s"):format(floor[1], floor[2]))
      end
      if LIMIT_CEILINGS[k] and n > LIMIT_CEILINGS[k] then
        invalid("limits." .. k, ("expected at most %d"):format(LIMIT_CEILINGS[k]))
      end
    end
  end,
  env = function(v)
    expect(v, "table", "env")
    for k, val in pairs(v or {}) do
      if type(k) ~= "string" or not k:match("^[A-Za-z_][A-Za-z0-9_]*$") then
        invalid("env", ("invalid variable name %q"):format(tostring(k)))
      end
      if val ~= false and type(val) ~= "string" then invalid("env." .. k, "expected a string or false") end
    end
  end,
  shell = function(v) expect(v, "string", "shell") end,
  hooks = function(v)
    expect(v, "table", "hooks")
    for k, fn in pairs(v or {}) do
      if not HOOKS[k] then invalid("hooks." .. tostring(k), "unknown hook" .. V.did_you_mean(k, HOOKS)) end
      if type(fn) ~= "function" then invalid("hooks." .. k, "expected a function") end
    end
  end,
  mounts = function(v)
    expect(v, "table", "mounts")
    local n = 0
    for k in pairs(v or {}) do
      n = n + 1
      if type(k) ~= "number" then invalid("mounts." .. tostring(k), "expected a list of mounts, not a map") end
    end
    if n ~= #(v or {}) then invalid("mounts", "expected a list of mounts without holes") end
    for i, m in ipairs(v or {}) do
      local key = ("mounts[%d]"):format(i)
      if type(m) ~= "table" then invalid(key, "expected a table") end
      for k in pairs(m) do
        if not MOUNT_KEYS[k] then invalid(key .. "." .. tostring(k), "unknown key" .. V.did_you_mean(k, MOUNT_KEYS)) end
      end
      if not MOUNT_TYPES[m.type] then invalid(key .. ".type", "expected bind, ro_bind, tmpfs, proc or dev") end
      if type(m.dst) ~= "string" or m.dst:sub(1, 1) ~= "/" or m.dst:find("\0", 1, true) then
        invalid(key .. ".dst", "expected an absolute path")
      end
      for part in m.dst:gmatch("[^/]+") do
        if part == ".." then invalid(key .. ".dst", "expected a path without ..") end
      end
      if m.type == "bind" or m.type == "ro_bind" then
        if type(m.src) ~= "string" or m.src:sub(1, 1) ~= "/" or m.src:find("\0", 1, true) then
          invalid(key .. ".src", "expected an absolute path")
        end
      elseif m.src ~= nil then
        invalid(key .. ".src", ("a %s mount has no source"):format(m.type))
      end
      if m.size ~= nil then
        if m.type ~= "tmpfs" and m.type ~= "dev" then
          invalid(key .. ".size", "only a tmpfs or dev mount has a size")
        end
        if type(m.size) ~= "number" or m.size < 1 or m.size % 1 ~= 0 then
          invalid(key .. ".size", "expected an integer number of bytes >= 1")
        end
      end
    end
  end,
  network = function(v)
    if v ~= nil and v ~= "none" and v ~= "host" and v ~= "egress" then
      invalid("network", "expected \"none\", \"host\" or \"egress\"")
    end
  end,
  -- egress = {allow = {...}, deny = {...}}: network = "egress"'s rules (network/rules.lua)
  egress = function(v) require("moonbox.network.rules").parse(v, "policy.egress") end,
  -- dns = {upstream = {"192.0.2.53", ...}}: the egress resolver's upstreams
  -- (default: /etc/resolv.conf's nameservers)
  dns = function(v)
    expect(v, "table", "dns")
    for k, x in pairs(v) do
      if k ~= "upstream" then invalid("dns." .. tostring(k), "unknown key") end
      expect(x, "table", "dns.upstream")
      for i, a in ipairs(x) do
        if type(a) ~= "string" or not require("moonbox.network.rules").parse_ipv4(a) then
          invalid(("dns.upstream[%d]"):format(i), "expected an IPv4 address")
        end
      end
    end
  end,
  hostname = function(v)
    expect(v, "string", "hostname")
    if v ~= nil and (#v < 1 or #v > 64 or not v:match("^[%w][%w.-]*$")) then
      invalid("hostname", "expected 1-64 letters, digits, dots and hyphens, starting with a letter or digit")
    end
  end,
  seccomp = function(v) expect(v, "string", "seccomp") end,
  capabilities = function(v)
    expect(v, "table", "capabilities")
    local isolation = require "moonbox.sandbox.isolation"
    for i, c in ipairs(v or {}) do
      if type(c) ~= "string" or not isolation.CAP_NUMBERS[isolation.cap_short_name(c)] then
        invalid(("capabilities[%d]"):format(i), ("unknown capability %q"):format(tostring(c)))
      end
    end
  end,
  isolation = function(v)
    if v ~= nil and v ~= "auto" and v ~= "none" and v ~= "namespaces" then
      invalid("isolation", "expected \"auto\", \"namespaces\" or \"none\"")
    end
  end,
  name = function(v) expect(v, "string", "name") end,
  -- host ids of the sandbox's ids 0..count-1 when the runtime is root
  -- (docs/isolation.md); never host root, never past the last uid
  idmap = function(v)
    expect(v, "table", "idmap")
    if v == nil then return end
    for k in pairs(v) do
      if k ~= "uid" and k ~= "gid" and k ~= "count" and k ~= "user" then
        invalid("idmap." .. tostring(k), "unknown key")
      end
    end
    expect(v.user, "string", "idmap.user")
    local count = v.count
    if count ~= nil and (type(count) ~= "number" or count < 1 or count % 1 ~= 0 or count > 4294967295) then
      invalid("idmap.count", "expected an integer >= 1")
    end
    for _, k in ipairs { "uid", "gid" } do
      local id = v[k]
      if id ~= nil then
        if type(id) ~= "number" or id % 1 ~= 0 or id < 1 then
          invalid("idmap." .. k, "expected an integer >= 1 (0 would make root inside the host's root)")
        end
        if id + (count or 65536) - 1 > 4294967294 then
          invalid("idmap." .. k, "the range ends past the last id (4294967294)")
        end
      end
    end
    if v.gid ~= nil and v.uid == nil then invalid("idmap.uid", "required with idmap.gid") end
  end,
  -- the sandbox user namespace's own /proc/sys/user counters
  userns = function(v)
    expect(v, "table", "userns")
    local known = require("moonbox.sandbox.isolation").DEFAULT_USERNS
    for k, n in pairs(v or {}) do
      if known[k] == nil then invalid("userns." .. tostring(k), "unknown key") end
      if type(n) ~= "number" or n < 0 or n % 1 ~= 0 or n > 2147483647 then
        invalid("userns." .. k, "expected an integer >= 0")
      end
    end
  end,
  -- image = REF: the image a sandbox's root is made of (docs/images.md)
  image = function(v)
    expect(v, "string", "image")
    if v == "" or v:find("%z") then invalid("image", "expected a non-empty image reference") end
  end,
  -- git = {allowLocal}: may gitCheckout clone a local path or file:// URL
  -- (the runtime's repositories)? Allowed for a script's own sandboxes;
  -- `moonbox serve` turns it off unless its --policy turns it on.
  git = function(v)
    expect(v, "table", "git")
    for k, x in pairs(v) do
      if k ~= "allowLocal" then invalid("git." .. tostring(k), "unknown key") end
      expect(x, "boolean", "git.allowLocal")
    end
  end,
}

function M.validate(policy)
  if type(policy) ~= "table" then invalid("", "expected a table") end
  for k, v in pairs(policy) do
    local check = checks[k]
    if not check then invalid(tostring(k), "unknown key" .. V.did_you_mean(k, checks)) end
    check(v)
  end
  return policy
end

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

-- The presets, lua/moonbox/policies/<name>.lua, named by their names.
M.PRESETS = { "dev", "strict" }
local preset_set = {}
for _, name in ipairs(M.PRESETS) do preset_set[name] = true end

-- load(ref): a table as is; "x.lua" or a path with "/" is run as a file
-- that returns a table; a preset's name ("strict") is that preset; anything
-- else is a module name. A name that is none of these lists the presets.
function M.load(ref)
  if type(ref) == "table" then return ref end
  if type(ref) ~= "string" then invalid("", "expected a table, a module name or a file path") end
  if ref:match("%.lua$") or ref:find("/", 1, true) then
    local chunk, err = loadfile(ref)
    if not chunk then invalid("", ("cannot load policy file %q: %s"):format(ref, err)) end
    local ok, value = pcall(chunk)
    if not ok then invalid("", ("policy file %q failed: %s"):format(ref, tostring(value))) end
    if type(value) ~= "table" then invalid("", ("policy file %q must return a table"):format(ref)) end
    return value
  end
  local module = preset_set[ref] and ("moonbox.policies." .. ref) or ref
  if not (package.loaded[module] or package.preload[module] or package.searchpath(module, package.path)
      or package.searchpath(module, package.cpath)) then
    invalid("", ("unknown policy %q: the presets are %s; or give a module name or a path to a .lua file")
      :format(ref, table.concat(M.PRESETS, ", ")))
  end
  local ok, mod = pcall(require, module)
  if not ok then invalid("", ("cannot load policy module %q: %s"):format(ref, tostring(mod))) end
  if type(mod) ~= "table" then invalid("", ("policy module %q must return a table"):format(ref)) end
  return mod
end

-- The policy used when getSandbox gets none (moonbox --policy file.lua).
local default_policy = nil
function M.set_default(ref)
  default_policy = ref and M.validate(M.load(ref)) or nil
end

-- resolve(policy, limits) -> the full policy: user policy (or the default
-- one) merged over the defaults, then the getSandbox limits over that.
function M.resolve(policy, limits)
  policy = policy ~= nil and M.validate(M.load(policy)) or default_policy or {}
  if limits ~= nil then checks.limits(limits) end
  local merged = deep_merge(M.defaults, policy)
  if limits then merged.limits = deep_merge(merged.limits, limits) end
  return merged
end

-- What each hook may return besides `true` (allowed unchanged): a
-- replacement, checked here. Anything else is the hook's bug: POLICY_ERROR.
local function check_command(v)
  if type(v) == "string" then
    if v:find("\0", 1, true) then return false, "a command with a NUL byte" end
    return v:find("%S") ~= nil, "a blank command"
  end
  if type(v) ~= "table" then return false end
  local n = #v
  if n == 0 then return false, next(v) == nil and "an empty argv" or "a table that is not an argv (no word 1)" end
  for k, w in pairs(v) do
    if type(k) ~= "number" or k < 1 or k > n or k % 1 ~= 0 then return false, "an argv with a non-array key" end
    if type(w) ~= "string" and type(w) ~= "number" then return false, "an argv with a " .. type(w) .. " word" end
    if tostring(w):find("\0", 1, true) then return false, "an argv word with a NUL byte" end
  end
  if not tostring(v[1]):find("%S") then return false, "an argv with an empty program" end
  return true
end
local REPLACEMENT = {
  onCreateSession = function(v) return type(v) == "table" end,
  onExec = check_command,
  onStartProcess = check_command,
  onEnv = function(v)
    if type(v) ~= "table" then return false end
    local ok, err = pcall(V.env, v, "env")
    return ok, not ok and err.message or nil
  end,
  onFile = function(v)
    return type(v) == "string" and v ~= "" and not v:find("\0", 1, true), "an empty path or one with a NUL byte"
  end,
  onRunCode = function(v) return type(v) == "string", "a " .. type(v) .. " where code was expected" end,
  onTerminal = function(v) return type(v) == "table" end,
}

-- call_hook(policy, name, what, context, ...) -> the hook's replacement
-- value, or nil when there is no hook or it allowed the call unchanged
-- (returned true). The one place a hook is called: `nil, reason` (or false)
-- raises POLICY_DENIED with the reason; a hook that throws, or returns a
-- value of the wrong type for its kind, raises POLICY_ERROR naming the hook.
-- CANCELLED (the calling task was cancelled while a hook waited) passes.
function M.call_hook(policy, name, what, context, ...)
  local hook = policy.hooks and policy.hooks[name]
  if not hook then return nil end
  context = context or {}
  context.hook = name
  local results = { pcall(hook, ...) }
  if not results[1] then
    local err = results[2]
    if errors.is_error(err) and (err.code == "CANCELLED" or err.code == "POLICY_DENIED") then error(err, 0) end
    local message = type(err) == "table" and not errors.is_error(err) and (err.message or err[1]) or err
    message = tostring(message)
    context.error = message
    errors.raise("POLICY_ERROR", ("policy hook %s failed: %s"):format(name, message), context)
  end
  local value, reason = results[2], results[3]
  if value == nil or value == false then
    context.reason = reason
    errors.raise("POLICY_DENIED", ("%s denied by policy: %s"):format(what, tostring(reason or "no reason given")),
      context)
  end
  if value == true then return nil end
  local ok, why = REPLACEMENT[name](value)
  if not ok then
    context.returned = type(value)
    errors.raise("POLICY_ERROR", ("policy hook %s returned %s, which it may not return (expected true, nil, reason " ..
      "or a replacement)"):format(name, why or ("a " .. type(value))), context)
  end
  return value
end

return M
