-- Waiting for a pattern in a process's log (Process:waitForLog): a search
-- of both streams that resumes where it could still match, run in slices
-- so it never holds the loop, and the wait for new output between searches.
-- The process is seen through a `source` table (its logs, its listeners,
-- whether it still runs), not through its fields.
local core = require "moonbox.core"
local async = require "moonbox.async"
local errors = require "moonbox.errors"
local util = require "moonbox.lib.util"
local pattern_mod = require "moonbox.lib.pattern"

local M = {}

-- One search of the log may take baseSteps plus stepsPerByte per byte it
-- covers; a pattern that needs more (nested backtracking such as
-- "a*a*a*a*a*a*a*a*b") fails the wait with VALIDATION_FAILED ("too
-- expensive") instead of stalling every sandbox for minutes.
M.LOG_SEARCH = {
  maxPatternBytes = 4096,
  baseSteps = 10000000, -- about a quarter second of matching, in slices
  stepsPerByte = 100,   -- a linear pattern takes a few steps per byte
  sliceMs = 3,
}

local STREAMS = { "stdout", "stderr" }

-- The line around text[s..e] (a match may span lines; the line runs from the
-- start of its first to the end of its last).
local function line_around(text, s, e)
  local line_start = 1
  local hi = s - 1
  while hi >= 1 do -- the last "\n" before s, looked for backwards in windows
    local lo = math.max(1, hi - 4095)
    local at = text:sub(lo, hi):match("^.*()\n") -- anchored: one pass
    if at then line_start = lo + at break end
    hi = lo - 1
  end
  local line_end = text:find("\n", e, true) or (#text + 1)
  return text:sub(line_start, line_end - 1)
end

-- pause() for the matcher: past a slice, the task sleeps a moment, so the
-- loop runs everything else that is due (a 0 ms timer would run again
-- before any I/O); past the deadline it calls timed_out. start() begins a
-- new slice.
local function slicer(deadline, timed_out)
  local in_task = async.in_task()
  local slice_start = util.now_ms()
  local s = {}
  function s.start() slice_start = util.now_ms() end
  function s.pause()
    local now = util.now_ms()
    if now - slice_start < M.LOG_SEARCH.sliceMs then return end
    if deadline and now >= deadline then timed_out() end
    if in_task then async.sleep(1) end
    slice_start = util.now_ms()
  end
  return s
end

-- search() -> {line, match, stream, captures?} or nil: each call searches
-- what the logs gained since the last, per stream from where the last
-- search could still match (adjusted for bytes the log dropped from its
-- front meanwhile).
local function searcher(logs, q, slices)
  local state = {}
  for _, stream in ipairs(STREAMS) do state[stream] = { from = 1, dropped = logs[stream].dropped } end

  local function find(text, from, stream, shift)
    if q.plain then
      local s, e = pattern_mod.plain_find(text, q.pattern, from, slices.pause)
      return s, e
    end
    local budget = M.LOG_SEARCH.baseSteps + M.LOG_SEARCH.stepsPerByte * (#text - from + 1)
    local ok, a, b, c = pcall(pattern_mod.search, q.cp, text, from,
      { budget = budget, pause = slices.pause, also_first = shift > 0 })
    if not ok then
      if not pattern_mod.is_too_expensive(a) then error(a, 0) end
      errors.raise("VALIDATION_FAILED", ("pattern: %s is too expensive: searching %d bytes of %s took more " ..
        "than %d steps (nested repetitions backtrack without end); simplify it or use plain = true"):format(
        q.what, #text - from + 1, stream, budget), { field = "pattern", steps = a.steps, budget = budget })
    end
    return a, b, c
  end

  return function()
    slices.start()
    for _, stream in ipairs(STREAMS) do
      local buf, st = logs[stream], state[stream]
      local text = buf:text()
      local shift = buf.dropped - st.dropped
      st.dropped = buf.dropped
      local from = st.from
      if shift > 0 then
        from = (from == false or (q.cp and q.cp.anchor)) and 1 or math.max(1, from - shift)
      end
      if from then
        from = math.min(from, #text + 1)
        local s, e, caps = find(text, from, stream, shift)
        if s then
          local r = { line = line_around(text, s, e), match = text:sub(s, e), stream = stream }
          if caps and #caps > 0 then r.captures = caps end
          return r
        end
        st.from = e -- (where a later search starts; false: nothing more can match)
      end
    end
  end
end

-- Wait (in the calling task) until new output arrives (false) or the
-- deadline passes (true).
local function next_change(deadline, what, waker)
  local timer
  local expired = async.await(function(resume)
    waker.wake = resume
    if deadline then
      timer = core.timer()
      timer:start(math.max(0, deadline - util.now_ms()), 0, function() timer:close() resume(true) end)
    end
    return function()
      waker.wake = nil
      if timer and not timer:is_closing() then timer:close() end
    end
  end, what)
  waker.wake = nil
  if timer and not timer:is_closing() then timer:close() end
  return expired
end

-- for_log(source, q, timeout_ms) -> {line, match, stream, captures?}
-- source: {id, logs = {stdout, stderr}, listeners (a list notified on
--   output), check_running(what) (raises once the process ended)}
-- q: {pattern, plain, cp (the compiled pattern unless plain), what}
function M.for_log(source, q, timeout_ms)
  local deadline = timeout_ms and util.now_ms() + timeout_ms
  local function timed_out()
    errors.raise("PROCESS_READY_TIMEOUT", ("process %q: %s not seen within %d ms"):format(source.id, q.what,
      timeout_ms), { processId = source.id, timeout = timeout_ms })
  end
  local search = searcher(source.logs, q, slicer(deadline, timed_out))
  local changed = true
  local waker = {}
  local function listener()
    changed = true
    if waker.wake then local w = waker.wake waker.wake = nil w() end
  end
  table.insert(source.listeners, listener)
  local ok, result = pcall(function()
    while true do
      changed = false
      local found = search()
      if found then return found end
      source.check_running(q.what)
      if deadline and util.now_ms() >= deadline then timed_out() end
      if not changed and next_change(deadline, q.what, waker) then timed_out() end
    end
  end)
  for i, l in ipairs(source.listeners) do if l == listener then table.remove(source.listeners, i) break end end
  if not ok then error(result, 0) end
  return result
end

return M
