-- watch (API.md "Files"): inotify watches of a directory tree as an
-- iterator of events, with include/exclude globs. A part of Session
-- (lib/compose.lua); its paths and queue are files/paths.lua's.
local core = require "moonbox.core"
local async = require "moonbox.async"
local errors = require "moonbox.errors"
local fs = require "moonbox.lib.fs"
local afs = fs.awaited
local util = require "moonbox.lib.util"
local V = require "moonbox.lib.validate"
local compose = require "moonbox.lib.compose"
local paths = require "moonbox.files.paths"
local pattern_mod = require "moonbox.lib.pattern"
local fail, check, join, view_of, root_of, target, queued =
  paths.fail, paths.check, paths.join, paths.view_of, paths.root_of, paths.target, paths.queued
local Session = {} -- this part's methods, installed by session/init.lua (M.install)

local M = {}

M.WATCH_QUEUE_MAX = 100000      -- events a watch keeps for a consumer that does not iterate
M.MAX_DIRS_PER_SANDBOX = 8192   -- directories its watches keep watched (see Watch:_track)
M.MOVE_PAIR_MS = 20             -- how long a moved-out entry waits for its moved-in half
local LIST_SLICE_MS = 3         -- work on the loop between two yields (as listFiles)

local function boolean_option(value, field)
  if value ~= nil and type(value) ~= "boolean" then V.fail(field, "expected a boolean, got " .. type(value)) end
  return value == true
end

-- Globs: "*" and "?" within one path segment, "**" across segments, [...]
-- sets. A glob without "/" matches any segment (like .gitignore); one with
-- "/" is anchored at the watched directory. Either way a match on a
-- directory covers everything below it.
--
-- Matched with the classic one-backtrack-point wildcard algorithm, within a
-- segment ("*" over bytes) and across them ("**" over segments): at most
-- (length x tokens) steps. Translated to a Lua pattern, "*a*a*a*a*a*a*a*b"
-- backtracked without bound on every event, on the loop (issue #14).
local STAR = "*"
local ANY_BYTE = pattern_mod.class_set(".")

-- A glob segment as tokens: STAR, or the set of bytes one position matches.
local function segment_tokens(seg)
  local toks, i = {}, 1
  while i <= #seg do
    local c = seg:sub(i, i)
    if c == "*" then
      if toks[#toks] ~= STAR then toks[#toks + 1] = STAR end
    elseif c == "?" then toks[#toks + 1] = ANY_BYTE
    elseif c == "[" and seg:find("]", i + 1, true) then
      local close = seg:find("]", i + 2, true) or seg:find("]", i + 1, true)
      local set = seg:sub(i + 1, close - 1):gsub("^!", "^"):gsub("%%", "%%%%")
      local bytes, msg = pattern_mod.class_set("[" .. set .. "]")
      if not bytes then error(("malformed set %q: %s"):format(seg:sub(i, close), msg), 0) end
      toks[#toks + 1] = bytes
      i = close
    else
      local bytes = pattern_mod.class_set(c:match("%p") and "%" .. c or c)
      if not bytes then error("a glob cannot hold a NUL byte", 0) end
      toks[#toks + 1] = bytes
    end
    i = i + 1
  end
  return toks
end

local function compile_glob(glob)
  local segs = {}
  local anchored = glob:find("/", 1, true) ~= nil
  if not anchored then segs[1] = "**" end
  for seg in glob:gmatch("[^/]+") do
    segs[#segs + 1] = seg == "**" and "**" or segment_tokens(seg)
  end
  segs[#segs + 1] = "**"
  return segs
end

-- wildcard(toks, n, star, one, k): toks[1..#toks] against positions 1..n,
-- where toks[p] == star matches any run and one(tok, k) says whether a
-- single token matches position k.
local function wildcard(toks, n, star, one)
  local p, k, star_p, mark = 1, 1, nil, 0
  while k <= n do
    local t = toks[p]
    if t == star then
      star_p, mark, p = p, k, p + 1
    elseif t ~= nil and one(t, k) then
      p, k = p + 1, k + 1
    elseif star_p then
      p, mark = star_p + 1, mark + 1
      k = mark
    else
      return false
    end
  end
  while toks[p] == star do p = p + 1 end
  return p > #toks
end

local function match_segments(segs, parts)
  return wildcard(segs, #parts, "**", function(toks, k)
    local part = parts[k]
    return wildcard(toks, #part, STAR, function(bytes, j) return bytes[part:byte(j)] end)
  end)
end

local function glob_list(globs, field)
  if globs == nil then return nil end
  if type(globs) == "string" then globs = { globs } end
  if type(globs) ~= "table" then V.fail(field, "expected a list of glob strings") end
  local out = {}
  for i, g in ipairs(globs) do
    if type(g) ~= "string" or g == "" then V.fail(("%s[%d]"):format(field, i), "expected a glob string") end
    local ok, segs = pcall(compile_glob, g)
    if not ok then V.fail(("%s[%d]"):format(field, i), segs) end
    out[#out + 1] = { glob = g, segs = segs }
  end
  return out
end

local function matches_any(list, sub)
  if not list or sub == "" then return false end
  local parts = {}
  for p in sub:gmatch("[^/]+") do parts[#parts + 1] = p end
  for _, g in ipairs(list) do
    if match_segments(g.segs, parts) then return true end
  end
  return false
end
M.glob_matches = function(glob, path) return matches_any({ { segs = compile_glob(glob) } }, path) end

local DEFAULT_EXCLUDES = { ".git", "node_modules" }

local Watch = {}
Watch.__index = Watch

-- path of rel inside the watched directory ("" for the directory itself)
function Watch:_sub(rel)
  if rel == self.rel then return "" end
  if self.rel == "." then return rel end
  return rel:sub(#self.rel + 2)
end

function Watch:_excluded(rel)
  return matches_any(self.exclude, self:_sub(rel))
end

function Watch:_wake()
  local w = self.waiter
  if w then self.waiter = nil w() end
end

function Watch:_push(ev)
  if self.closed then return end
  if self.tail - self.head + 1 >= M.WATCH_QUEUE_MAX then
    if not self.overflowed then
      self.overflowed = true
      self.tail = self.tail + 1
      self.events[self.tail] = { type = "overflow", path = self.view, timestamp = util.timestamp() }
    end
    return
  end
  self.tail = self.tail + 1
  self.events[self.tail] = ev
  self:_wake()
end

function Watch:_emit(kind, rel, isdir, old_rel)
  local sub = self:_sub(rel)
  if sub ~= "" and (matches_any(self.exclude, sub) or (self.include and not matches_any(self.include, sub))) then
    return
  end
  local view = view_of(self.sandbox, rel)
  if kind == "modify" and self.tail >= self.head then
    local last = self.events[self.tail]
    if last.type == "modify" and last.path == view then return end -- not seen yet: one is enough
  end
  self:_push { type = kind, path = view, isDirectory = isdir, timestamp = util.timestamp(),
    oldPath = old_rel and view_of(self.sandbox, old_rel) or nil }
end

-- In a task (watch() setting up a recursive watch), the walk yields to the
-- loop after every LIST_SLICE_MS of work: a big tree never holds the loop
-- (issue #14). slice = {start = ms}; nil outside a task (an event's
-- callback), where the walk cannot yield.
local function walk_slice(slice)
  if slice and util.now_ms() - slice.start >= LIST_SLICE_MS then
    async.sleep(1)
    slice.start = util.now_ms()
  end
end

-- The runtime's inotify watches are the runtime user's (host root's for a
-- root runtime), shared with every process of that user: a sandbox making
-- directories under a recursive watch gets at most MAX_DIRS_PER_SANDBOX of
-- them watched, across its watches (sb.watched_dirs); past that a watch
-- says "overflow" once (changes deeper may be missed) and watches no more
-- of them. _track and _untrack are the only places self.dirs changes size.
function Watch:_track(rel, wd)
  self.wds[wd] = rel
  if not self.dirs[rel] then
    self.sandbox.watched_dirs = (self.sandbox.watched_dirs or 0) + 1
  end
  self.dirs[rel] = wd
end

function Watch:_untrack(rel)
  if self.dirs[rel] then
    self.dirs[rel] = nil
    self.sandbox.watched_dirs = self.sandbox.watched_dirs - 1
  end
end

-- Watch directory rel (already known to be a directory) and, recursively,
-- its subdirectories. With announce, everything found inside is reported as
-- created: it appeared before the new watch was in place.
function Watch:_add_tree(rootfd, rel, announce, slice)
  walk_slice(slice)
  if (self.sandbox.watched_dirs or 0) >= M.MAX_DIRS_PER_SANDBOX then
    if not self.dirs_capped then
      self.dirs_capped = true
      self:_push { type = "overflow", path = self.view, timestamp = util.timestamp() }
    end
    return -1 -- (not an error: the watch goes on with what it has)
  end
  local wd, msg, code = fs.confined(self.handle:add(rootfd, rel))
  if not wd then return nil, msg, code end
  self:_track(rel, wd)
  local entries = fs.scandir_beneath(rootfd, rel) or {}
  for _, e in ipairs(entries) do
    local child = join(rel, e.name)
    local kind = e.type
    if kind == "unknown" then
      local st = afs.lstat_beneath(rootfd, child)
      kind = st and st.type
    end
    if announce then
      self.announced[child] = true
      self:_emit("create", child, kind == "directory")
    end
    if kind == "directory" and not self:_excluded(child) then self:_add_tree(rootfd, child, announce, slice) end
  end
  return wd
end

function Watch:_watch_new_dir(rel)
  if not self.recursive or self:_excluded(rel) then return end
  self:_add_tree(root_of(self.sandbox), rel, true)
end

-- Forget the watches of rel and below; drop stops the kernel's watches too
-- (a directory moved out of the tree is still watched otherwise).
function Watch:_forget_tree(rel, drop)
  for dir, wd in pairs(self.dirs) do
    if dir == rel or dir:sub(1, #rel + 1) == rel .. "/" then
      self:_untrack(dir)
      self.wds[wd] = nil
      if drop then self.handle:remove(wd) end
    end
  end
end

function Watch:_rename_tree(old, new)
  local moved = {}
  for dir, wd in pairs(self.dirs) do
    if dir == old or dir:sub(1, #old + 1) == old .. "/" then moved[#moved + 1] = { dir, wd } end
  end
  for _, m in ipairs(moved) do self.dirs[m[1]] = nil end
  for _, m in ipairs(moved) do
    local dir = new .. m[1]:sub(#old + 1)
    self.dirs[dir] = m[2]
    self.wds[m[2]] = dir
  end
end

-- A moved-out entry whose moved-in half did not come: it left the tree.
function Watch:_flush_pending()
  local p = self.pending
  if not p then return end
  self.pending = nil
  if self.pair_timer then self.pair_timer:stop() end
  if p.isdir then self:_forget_tree(p.rel, true) end
  self:_emit("delete", p.rel, p.isdir)
end

function Watch:_finish(err)
  if self.ended then return end
  self.ended = true
  self.err = err
  self:_release()
  self:_wake()
end

function Watch:_on_event(err, name, ev, errcode)
  if self.ended then return end
  if err then
    return self:_finish(errors.new("FILESYSTEM_ERROR", "watch " .. self.view .. ": " .. tostring(err),
      { path = self.view, errno = errcode }))
  end
  if ev.overflow then
    self:_flush_pending()
    return self:_push { type = "overflow", path = self.view, timestamp = util.timestamp() }
  end
  local dir = self.wds[ev.wd]
  if not dir then return end
  local pend = self.pending
  if pend and pend.isdir and (dir == pend.rel or dir:sub(1, #pend.rel + 1) == pend.rel .. "/") then
    -- from inside a directory whose moved_from came alone: a rename's two
    -- halves are queued together, so it left the tree (and this event
    -- happened out there, not at the path it used to have)
    self:_flush_pending()
    return
  end
  if ev.ignored then
    self.wds[ev.wd] = nil
    if self.dirs[dir] == ev.wd then self:_untrack(dir) end
    return
  end
  if name == nil then
    -- about a watched object itself: its parent reports it, except for the root
    if ev.wd ~= self.root_wd then return end
    if ev.delete_self or ev.move_self or ev.unmount then
      self:_flush_pending()
      self:_push { type = "delete", path = self.view, isDirectory = not self.is_file, timestamp = util.timestamp() }
      return self:_finish()
    end
    if self.is_file and (ev.modify or ev.attrib) then self:_emit("modify", self.rel, false) end
    return
  end
  local rel = join(dir, name)
  local isdir = ev.isdir == true
  if ev.moved_to then
    local p = self.pending
    if p and p.cookie == ev.cookie then
      self.pending = nil
      if self.pair_timer then self.pair_timer:stop() end
      if isdir then self:_rename_tree(p.rel, rel) end
      return self:_emit("move", rel, isdir, p.rel)
    end
    self:_flush_pending()
    self:_emit("create", rel, isdir)
    if isdir then self:_watch_new_dir(rel) end
    return
  end
  self:_flush_pending()
  if ev.moved_from then
    self.pending = { cookie = ev.cookie, rel = rel, isdir = isdir }
    if not self.pair_timer then self.pair_timer = core.timer() end
    self.pair_timer:start(M.MOVE_PAIR_MS, 0, function() self:_flush_pending() end)
  elseif ev.create then
    if self.announced[rel] then
      self.announced[rel] = nil -- already reported by the scan of its new directory
      return
    end
    self:_emit("create", rel, isdir)
    if isdir then self:_watch_new_dir(rel) end
  elseif ev.delete then
    self.announced[rel] = nil
    if isdir then self:_forget_tree(rel, false) end
    self:_emit("delete", rel, isdir)
  elseif ev.modify or ev.attrib then
    self:_emit("modify", rel, isdir)
  end
end

function Watch:_release()
  for dir in pairs(self.dirs) do self:_untrack(dir) end
  if self.handle and not self.handle:is_closing() then self.handle:close() end
  if self.pair_timer and not self.pair_timer:is_closing() then self.pair_timer:close() end
  local set = self.session._watches
  if set then set[self] = nil end
end

-- close(): stop watching now; queued events are dropped.
function Watch:close()
  if not self.ended then
    self.ended = true
    self:_release()
  end
  self.events, self.head, self.tail = {}, 1, 0
  self:_wake()
end

function Watch:_next()
  while self.head > self.tail do
    if self.ended then
      local err = self.err
      self.err = nil
      if err then error(err, 0) end
      return nil
    end
    async.await(function(resume)
      self.waiter = resume
      return function() self.waiter = nil end
    end, "watch iteration")
  end
  local ev = self.events[self.head]
  self.events[self.head] = nil
  self.head = self.head + 1
  if ev.type == "overflow" then self.overflowed = false end
  return ev
end

local watch_options = { recursive = true, include = true, exclude = true }

-- watch(path, {recursive, include, exclude}) -> iterator of
-- {type = "create"|"modify"|"delete"|"move", path, isDirectory, timestamp[, oldPath]}.
-- Returns once the watch is in place. It lives until iterator:close() (or
-- :cancel()), until the iterator is garbage collected, until the watched
-- path itself is deleted (a last "delete" event, then the loop ends), or
-- until the session is deleted or the sandbox destroyed.
local function watch_as(self, path, opts, op)
  self:check_live()
  V.path(path)
  opts = require("moonbox.lib.seed_options").adapt(opts, require("moonbox.lib.seed_options").watch, "watch")
  opts = V.options(opts, watch_options, op .. " options")
  local recursive = boolean_option(opts.recursive, "recursive")
  local include = glob_list(opts.include, "include")
  local exclude = glob_list(opts.exclude, "exclude") or {}
  for _, name in ipairs(DEFAULT_EXCLUDES) do
    local named = false
    for _, g in ipairs(include or {}) do
      if g.glob:find(name, 1, true) then named = true end
    end
    if not named then exclude[#exclude + 1] = { glob = name, segs = compile_glob(name) } end
  end
  local w = queued(self, function()
    local t = target(self, op, path)
    local root = root_of(self.sandbox)
    local st, msg, code = afs.stat_beneath(root, t.rel)
    check(op, t.view, st, msg, code)
    if st.type ~= "directory" and st.type ~= "file" then
      fail(op, t.view, "EINVAL: not a file or directory", "EINVAL")
    end
    local rootfd = root
    local watch = setmetatable({
      session = self, sandbox = self.sandbox, rel = t.rel, view = t.view, is_file = st.type == "file",
      recursive = recursive, include = include, exclude = exclude,
      wds = {}, dirs = {}, announced = {}, events = {}, head = 1, tail = 0,
    }, Watch)
    -- its inotify instance counts against the sandbox's owner id, not host
    -- root's 128 shared with every sandbox (sandbox/isolation.lua owner_uid)
    watch.handle = core.fs_event(self.sandbox.owner_uid)
    local wd
    -- (a path swapped for a symlink since the stat above resolves outside:
    -- PATH_OUTSIDE_SANDBOX, as the stat would have said; file_race_spec)
    wd, msg, code = fs.confined(watch.handle:start(rootfd, t.rel, function(err, name, ev, errcode)
      watch:_on_event(err, name, ev, errcode)
    end))
    if wd and not watch.is_file then
      watch:_track(t.rel, wd)
      if recursive then
        local slice = async.in_task() and { start = util.now_ms() } or nil
        for _, e in ipairs(fs.scandir_beneath(rootfd, t.rel) or {}) do
          local child = join(t.rel, e.name)
          local kind = e.type
          if kind == "unknown" then kind = (afs.lstat_beneath(rootfd, child) or {}).type end
          if kind == "directory" and not watch:_excluded(child) then
            local ok, amsg, acode = watch:_add_tree(rootfd, child, false, slice)
            if not ok and acode ~= "ENOENT" then wd, msg, code = nil, amsg, acode break end
          end
        end
      end
    elseif wd then
      watch.wds[wd] = t.rel
    end
    if not wd then
      watch:_release() -- (the directories it had, uncounted again)
      if code == "ENOSPC" then -- from inotify: out of watches, not of disk space
        errors.raise("FILESYSTEM_ERROR", ("%s %s: the inotify watch limit is reached (fs.inotify.max_user_watches)")
          :format(op, t.view), { path = t.view, errno = code })
      end
      fail(op, t.view, msg, code)
    end
    watch.root_wd = wd
    self._watches = self._watches or {}
    self._watches[watch] = true
    return watch
  end)
  local guard = newproxy(true)
  getmetatable(guard).__gc = function() w:close() end
  local function close() w:close() end
  -- drain() -> how many events were queued (taken without waiting), and
  -- whether the watch is over: checkChanges counts changes with it
  local function drain()
    local n = w.tail - w.head + 1
    w.events, w.head, w.tail, w.overflowed = {}, 1, 0, false
    return n, w.ended == true
  end
  return setmetatable({ path = w.view, close = close, cancel = close, drain = drain, _guard = guard }, {
    __call = function() return w:_next() end,
  })
end

function Session:watch(path, opts) return watch_as(self, path, opts, "watch") end

-- watch_as(session, path, opts, op): the same, its errors and the policy's
-- onFile naming the calling op (checkChanges keeps a watch of its own).
M.watch_as = watch_as

-- A deleted session (or destroyed sandbox) takes its watches with it.
local function end_watches(session)
  if session._watches then
    for w in pairs(session._watches) do w:_finish() end
  end
end

-- A part of Session (lib/compose.lua): watch; a session's watches end with it.
function M.install(class, hooks)
  compose.methods(class, Session, "watch")
  compose.add(hooks, "session_end", end_watches)
end

return M
