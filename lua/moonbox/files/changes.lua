-- checkChanges (API.md Amendments; the seed's sandbox.checkChanges): has a
-- path changed since a version an earlier call returned? The first call for
-- a path and its options puts a watch in place (session:watch) and keeps it;
-- each later call counts what that watch saw. A version is
-- "<state id>:<count>"; a version of a state that no longer exists (it
-- expired after IDLE_TTL_MS without a call, or its session was deleted)
-- gives status "resync". At most MAX_STATES states per sandbox are kept
-- (the least recently used goes first).
local async = require "moonbox.async"
local errors = require "moonbox.errors"
local util = require "moonbox.lib.util"
local V = require "moonbox.lib.validate"
local compose = require "moonbox.lib.compose"
local Session = {} -- this part's methods, installed by session/init.lua (M.install)

local M = {}

M.IDLE_TTL_MS = 10 * 60 * 1000
M.MAX_STATES = 64 -- kept watches per sandbox; past it the least recently used goes

local states = setmetatable({}, { __mode = "k" }) -- sandbox -> key -> state
local made = 0
local loaded_ms = util.now_ms() -- every state id this runtime makes is stamped at or after it

local function key_of(session, path, recursive, include, exclude)
  local abs = path
  if path:sub(1, 1) ~= "/" then abs = session.sandbox:view_path(session.cwd) .. "/" .. path end
  return table.concat({ session.id, abs, tostring(recursive), table.concat(include or {}, "\0"),
    table.concat(exclude or {}, "\0") }, "\1")
end

local function list_option(v, field)
  if v == nil then return nil end
  if type(v) == "string" then v = { v } end -- (as watch takes it)
  if type(v) ~= "table" then V.fail(field, "expected an array of glob strings") end
  for i, g in ipairs(v) do V.type(g, "string", ("%s[%d]"):format(field, i)) end
  return v
end

local function parse_version(since)
  local id, count = since:match("^(.+):(%d+)$")
  if not id then V.fail("since", "must be a version returned by checkChanges()") end
  return id, tonumber(count)
end

-- session:checkChanges(path, {since?, recursive?, include?, exclude?})
--   -> {success, status = "unchanged"|"changed"|"resync", version, reason?, timestamp}
function Session:checkChanges(path, opts)
  self:check_live()
  V.path(path)
  opts = V.options(opts, { since = true, recursive = true, include = true, exclude = true }, "checkChanges options")
  V.type(opts.since, "string", "since", true)
  V.type(opts.recursive, "boolean", "recursive", true)
  local since_id, since_count
  if opts.since ~= nil then since_id, since_count = parse_version(opts.since) end
  local include, exclude = list_option(opts.include, "include"), list_option(opts.exclude, "exclude")
  local sb, now = self.sandbox, util.now_ms()
  states[sb] = states[sb] or {}
  local all = states[sb]
  -- states idle past their time are dropped (a lazy expiry: no timer keeps
  -- the runtime alive for them)
  for k, st in pairs(all) do
    if now - st.used > M.IDLE_TTL_MS then
      st.iter.close()
      all[k] = nil
    end
  end
  local key = key_of(self, path, opts.recursive == true, include, exclude)
  local st = all[key]
  if st then
    async.sleep(0) -- one turn of the loop: changes already made are queued
    local n, ended = st.iter.drain()
    st.count = st.count + n
    if ended then
      all[key], st = nil, nil
    end
  end
  if not st then
    local n, oldest_key = 0, nil
    for k, other in pairs(all) do
      n = n + 1
      if not oldest_key or other.used < all[oldest_key].used then oldest_key = k end
    end
    if n >= M.MAX_STATES then
      all[oldest_key].iter.close()
      all[oldest_key] = nil
    end
    -- (its errors, and the policy's onFile, name this call)
    local iter = require("moonbox.files.watch").watch_as(self, path,
      { recursive = opts.recursive, include = include, exclude = exclude }, "checkChanges")
    made = made + 1
    st = { id = ("changes-%d-%d"):format(made, now), count = 0, iter = iter }
    all[key] = st
  end
  st.used = now
  local version = ("%s:%d"):format(st.id, st.count)
  local r = { success = true, version = version, timestamp = util.timestamp() }
  if opts.since == nil then
    r.status = "unchanged"
    return r
  end
  local id, count = since_id, since_count
  if id ~= st.id then
    -- expired: a state this runtime made, gone since; restarted: not ours
    local n, stamp = id:match("^changes%-(%d+)%-(%d+)$")
    local ours = n and tonumber(n) <= made and tonumber(stamp) >= loaded_ms
    r.status, r.reason = "resync", ours and "expired" or "restarted"
  elseif count > st.count then
    errors.raise("VALIDATION_FAILED", "since refers to a newer version than the current state",
      { since = opts.since, version = version })
  else
    r.status = count == st.count and "unchanged" or "changed"
  end
  return r
end

-- A part of Session (lib/compose.lua): checkChanges, over the files part's
-- watch.
function M.install(class)
  compose.methods(class, Session, "changes")
end

return M
