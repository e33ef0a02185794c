-- Lua 5.1 patterns, matched by code that counts its steps.
--
-- string.find backtracks without limit: ("a*"):rep(8) .. "b" against 40 a's
-- takes seconds, and a search on the event loop holds every sandbox that long.
-- This is a matcher of our own for the same language with the same results
-- (the differential spec spec/lib/pattern_spec.lua compares it with string.find
-- and string.match on fixed and random patterns), which
--   * checks a pattern up front: anything string.find could raise on
--     ("([", "%", "[a", "(()", "%1" before capture 1 closed) is refused at
--     compile time, whatever the subject;
--   * counts its steps and calls opts.pause(steps) every PAUSE_EVERY of
--     them, so a caller in a task can yield to the loop between slices;
--   * gives up once opts.budget steps are spent (error "too expensive").
--
-- The language is LuaJIT's (Lua 5.1 plus %g, as LuaJIT 2.1 has it): classes
-- %a %c %d %g %l %p %s %u %w %x %z (upper case negates; any other escaped
-- character is itself, so "%q" is "q"), sets [...] with ranges, classes and ^, ".", anchors ^ and $,
-- quantifiers * + - ?, captures with position captures "()", back-references
-- %1-%9, %bxy and %f[set]. A pattern ends at its first NUL byte, as in C.
-- A pattern without any of ^$*+?.([%- is searched as plain text, like
-- string.find does.
--
-- Because pattern items cannot be grouped, the capture structure is static:
-- the capture a "(" opens, the one a ")" closes and whether a back-reference
-- names a closed capture are all known from the pattern alone. That is what
-- makes an exact up-front check possible, and lets the matcher recurse only
-- at quantifiers (its depth is bounded by MAX_QUANTIFIERS).
local M = {}

local byte, char, sub, find = string.byte, string.char, string.sub, string.find

M.MAX_CAPTURES = 32       -- LUA_MAXCAPTURES: string.find raises "too many captures" beyond
M.MAX_QUANTIFIERS = 1000  -- recursion depth; far below what the Lua stack takes
local PAUSE_EVERY = 4096  -- steps between calls of opts.pause

-- ---- classes and sets --------------------------------------------------------

-- C-locale ctype, which is what LuaJIT uses (bytes >= 128 are in no class)
local function range_set(t, a, b, v) for c = a, b do t[c] = v end return t end
local function new_set(v) return range_set({}, 0, 255, v or false) end

local CLASSES = {}
do
  local function class(f) local t = new_set() for c = 0, 255 do t[c] = f(c) and true or false end return t end
  local function alpha(c) return (c >= 65 and c <= 90) or (c >= 97 and c <= 122) end
  local function digit(c) return c >= 48 and c <= 57 end
  local function space(c) return c == 32 or (c >= 9 and c <= 13) end
  local function cntrl(c) return c < 32 or c == 127 end
  CLASSES.a = class(alpha)
  CLASSES.c = class(cntrl)
  CLASSES.d = class(digit)
  CLASSES.g = class(function(c) return c > 32 and c < 127 end)
  CLASSES.l = class(function(c) return c >= 97 and c <= 122 end)
  CLASSES.p = class(function(c) return c > 32 and c < 127 and not alpha(c) and not digit(c) end)
  CLASSES.s = class(space)
  CLASSES.u = class(function(c) return c >= 65 and c <= 90 end)
  CLASSES.w = class(function(c) return alpha(c) or digit(c) end)
  CLASSES.x = class(function(c) return digit(c) or (c >= 65 and c <= 70) or (c >= 97 and c <= 102) end)
  CLASSES.z = class(function(c) return c == 0 end)
end

-- match_class(c, cl) of lstrlib: cl is the byte after "%"
local function class_has(c, cl)
  local lower = cl >= 65 and cl <= 90 and cl + 32 or cl
  local t = CLASSES[char(lower)]
  if not t then return c == cl end
  if cl == lower then return t[c] end
  return not t[c]
end

-- The bytes a bracket class p[i..close] ("[" at i, "]" at close) matches,
-- following matchbracketclass.
local function bracket_set(p, i, close)
  local t = new_set()
  local sig = true
  local j = i
  if byte(p, j + 1) == 94 then sig = false j = j + 1 end -- ^
  j = j + 1
  while j < close do
    local c = byte(p, j)
    if c == 37 then -- %
      j = j + 1
      local cl = byte(p, j)
      for x = 0, 255 do if class_has(x, cl) then t[x] = true end end
    elseif byte(p, j + 1) == 45 and j + 2 < close then -- a-z
      for x = c, byte(p, j + 2) do t[x] = true end
      j = j + 2
    else
      t[c] = true
    end
    j = j + 1
  end
  if not sig then for x = 0, 255 do t[x] = not t[x] end end
  return t
end

-- classEnd: the index after the single-character class starting at i
local function class_end(p, i, plen)
  local c = byte(p, i)
  i = i + 1
  if c == 37 then -- %
    if i > plen then error("malformed pattern (ends with '%')", 0) end
    return i + 1
  elseif c == 91 then -- [
    if byte(p, i) == 94 then i = i + 1 end
    repeat
      if i > plen then error("malformed pattern (missing ']')", 0) end
      local d = byte(p, i)
      i = i + 1
      if d == 37 and i <= plen then i = i + 1 end
    until byte(p, i) == 93
    return i + 1
  end
  return i
end

-- The set of the single-character class p[i..ep-1]
local ANY = new_set(true)
local function item_set(p, i, ep)
  local c = byte(p, i)
  if c == 46 then return ANY end -- .
  if c == 37 then -- %x
    local cl = byte(p, i + 1)
    local t = new_set()
    for x = 0, 255 do t[x] = class_has(x, cl) end
    return t
  end
  if c == 91 then return bracket_set(p, i, ep - 1) end
  local t = new_set()
  t[c] = true
  return t
end

-- ---- compiling -----------------------------------------------------------------

-- node kinds
local END, SINGLE, OPEN, CLOSE, BALANCE, FRONTIER, BACKREF, EOS = 0, 1, 2, 3, 4, 5, 6, 7
-- quantifiers of SINGLE
local ONE, OPT, STAR, PLUS, MIN = 0, 1, 2, 3, 4
local QUANT = { [63] = OPT, [42] = STAR, [43] = PLUS, [45] = MIN } -- ? * + -

local CAP_UNFINISHED, CAP_POSITION = -1, -2

-- lj_str_haspattern: any of ^$*+?.([%- anywhere (even after a NUL)
function M.is_plain(pattern)
  return not find(pattern, "[%^%$%*%+%?%.%(%[%%%-]")
end

-- compile(pattern) -> compiled, or nil and the message string.find would
-- raise (or would raise once a match reached the fault).
local cache = setmetatable({}, { __mode = "v" })

local function compile(pattern)
  local nul = find(pattern, "\0", 1, true)
  local p = nul and sub(pattern, 1, nul - 1) or pattern
  local plen = #p
  local cp = { pattern = pattern, kind = {}, set = {}, quant = {}, a = {}, b = {}, ncap = 0 }
  local kind, set, quant, a, b = cp.kind, cp.set, cp.quant, cp.a, cp.b
  local n = 0
  local open = {}   -- indexes of captures opened and not closed, innermost last
  local closed = {} -- capture index -> true once closed (position captures at once)
  local quantifiers = 0
  local i = 1
  if byte(p, 1) == 94 then cp.anchor = true i = 2 end
  while i <= plen do
    local c = byte(p, i)
    n = n + 1
    if c == 40 then -- (
      cp.ncap = cp.ncap + 1
      if cp.ncap > M.MAX_CAPTURES then error("too many captures", 0) end
      kind[n], a[n] = OPEN, cp.ncap
      if byte(p, i + 1) == 41 then
        b[n] = CAP_POSITION
        closed[cp.ncap] = true
        i = i + 2
      else
        b[n] = CAP_UNFINISHED
        open[#open + 1] = cp.ncap
        i = i + 1
      end
    elseif c == 41 then -- )
      local l = table.remove(open)
      if not l then error("invalid pattern capture", 0) end
      closed[l] = true
      kind[n], a[n] = CLOSE, l
      i = i + 1
    elseif c == 36 and i == plen then -- $ at the end
      kind[n] = EOS
      i = i + 1
    elseif c == 37 and byte(p, i + 1) == 98 then -- %b
      if i + 3 > plen then error("unbalanced pattern", 0) end
      kind[n], a[n], b[n] = BALANCE, byte(p, i + 2), byte(p, i + 3)
      i = i + 4
    elseif c == 37 and byte(p, i + 1) == 102 then -- %f
      i = i + 2
      if byte(p, i) ~= 91 then error("missing '[' after '%f' in pattern", 0) end
      local ep = class_end(p, i, plen)
      kind[n], set[n] = FRONTIER, bracket_set(p, i, ep - 1)
      i = ep
    elseif c == 37 and byte(p, i + 1) and byte(p, i + 1) >= 48 and byte(p, i + 1) <= 57 then -- %0-%9
      local l = byte(p, i + 1) - 48
      if l < 1 or l > cp.ncap or not closed[l] then error("invalid capture index", 0) end
      kind[n], a[n] = BACKREF, l
      i = i + 2
    else
      local ep = class_end(p, i, plen)
      kind[n], set[n] = SINGLE, item_set(p, i, ep)
      local q = QUANT[byte(p, ep) or 0]
      if q then
        quant[n] = q
        quantifiers = quantifiers + 1
        if quantifiers > M.MAX_QUANTIFIERS then
          error(("pattern too complex (more than %d quantifiers)"):format(M.MAX_QUANTIFIERS), 0)
        end
        i = ep + 1
      else
        quant[n] = ONE
        i = ep
      end
      -- a literal byte: searches can jump to it with a plain find
      if n == 1 and (q == nil or q == PLUS) then
        local count, only = 0, nil
        for x = 0, 255 do if set[n][x] then count = count + 1 only = x end end
        if count == 1 then cp.first = char(only) end
      end
    end
  end
  if #open > 0 then error("unfinished capture", 0) end
  kind[n + 1] = END
  return cp
end

function M.compile(pattern)
  local cp = cache[pattern]
  if cp then return cp end
  local ok, res = pcall(compile, pattern)
  if not ok then return nil, res end
  cache[pattern] = res
  return res
end

-- class_set(item) -> the set of bytes a single-character class ("[a-z]",
-- "%d", ".", "x") matches, as a table indexed by byte (0-255), or nil and
-- why it is malformed.
function M.class_set(item)
  local cp, msg = M.compile(item)
  if not cp then return nil, msg end
  if cp.anchor or cp.kind[1] ~= SINGLE or cp.quant[1] ~= ONE or cp.kind[2] ~= END then
    return nil, "not a single-character class"
  end
  return cp.set[1]
end

-- ---- matching ------------------------------------------------------------------

local function too_expensive(steps)
  error({ too_expensive = true, steps = steps }, 0)
end
M.is_too_expensive = function(err) return type(err) == "table" and err.too_expensive == true end

-- search(cp, subject, init, opts) -> start, end, captures (array), or nil
-- and resume: the first start position that could still match once more
-- text is appended (every earlier one failed without looking at the end of
-- the subject, so it fails whatever follows), or false when none can
-- (an anchored pattern that failed for good). opts: budget (steps; default
-- unlimited), pause(steps) called every PAUSE_EVERY steps, also_first
-- (try position 1 before init: after the front of a log was dropped, what
-- a position-1 attempt sees changed).
function M.search(cp, S, init, opts)
  opts = opts or {}
  local n = #S
  local kind, set, quant, A, B = cp.kind, cp.set, cp.quant, cp.a, cp.b
  local budget = opts.budget or math.huge
  local pause = opts.pause
  local steps, next_check = 0, PAUSE_EVERY
  local touched = false
  local cap_init, cap_len = {}, {}

  local function tick()
    if steps > budget then too_expensive(steps) end
    next_check = steps + PAUSE_EVERY
    if pause then pause(steps) end
  end

  local do_match
  -- max_expand: the most repetitions first
  local function expand(s, e, i)
    while true do
      local r = do_match(e, i + 1)
      if r then return r end
      if e == s then return nil end
      e = e - 1
    end
  end

  -- do_match(s, i) -> the index after the match, or nil
  do_match = function(s, i)
    while true do
      steps = steps + 1
      if steps >= next_check then tick() end
      local k = kind[i]
      if k == SINGLE then
        local st, q = set[i], quant[i]
        local m = s <= n and st[byte(S, s)]
        if s > n then touched = true end
        if q == ONE then
          if not m then return nil end
          s = s + 1
          i = i + 1
        elseif q == OPT then
          if m then
            local r = do_match(s + 1, i + 1)
            if r then return r end
          end
          i = i + 1
        elseif q == MIN then
          while true do
            local r = do_match(s, i + 1)
            if r then return r end
            if s <= n and st[byte(S, s)] then
              s = s + 1
              steps = steps + 1
            else
              if s > n then touched = true end
              return nil
            end
          end
        else -- STAR, PLUS
          local from = s
          if q == PLUS then
            if not m then return nil end
            from = s + 1
          end
          local e = from
          while e <= n and st[byte(S, e)] do e = e + 1 end
          if e > n then touched = true end
          steps = steps + (e - from)
          return expand(from, e, i)
        end
      elseif k == END then
        return s
      elseif k == OPEN then
        local l = A[i]
        cap_init[l], cap_len[l] = s, B[i]
        i = i + 1
      elseif k == CLOSE then
        local l = A[i]
        cap_len[l] = s - cap_init[l]
        i = i + 1
      elseif k == EOS then
        if s ~= n + 1 then return nil end
        i = i + 1
      elseif k == BALANCE then
        if s > n then touched = true return nil end
        local open_c, close_c = A[i], B[i]
        if byte(S, s) ~= open_c then return nil end
        local depth, j = 1, s + 1
        while true do
          if j > n then
            steps = steps + (j - s)
            touched = true
            return nil
          end
          local c = byte(S, j)
          if c == close_c then
            depth = depth - 1
            if depth == 0 then break end
          elseif c == open_c then
            depth = depth + 1
          end
          j = j + 1
        end
        steps = steps + (j - s)
        s = j + 1
        i = i + 1
      elseif k == FRONTIER then
        local st = set[i]
        local prev = s == 1 and 0 or byte(S, s - 1)
        local cur = 0
        if s <= n then cur = byte(S, s) else touched = true end
        if st[prev] or not st[cur] then return nil end
        i = i + 1
      else -- BACKREF
        local l = A[i]
        local len = cap_len[l]
        if len == CAP_POSITION then return nil end -- string.find: (size_t)-2 never fits
        if n - s + 1 < len then touched = true return nil end
        local from = cap_init[l]
        if sub(S, from, from + len - 1) ~= sub(S, s, s + len - 1) then return nil end
        steps = steps + len
        s = s + len
        i = i + 1
      end
    end
  end

  local function captures(st, e)
    local caps = {}
    for l = 1, cp.ncap do
      local len = cap_len[l]
      if len == CAP_POSITION then caps[l] = cap_init[l]
      else caps[l] = sub(S, cap_init[l], cap_init[l] + len - 1) end
    end
    return caps, st, e
  end

  local resume = false
  local function attempt(st)
    touched = false
    local r = do_match(st, 1)
    if r then return r end
    if touched and not resume then resume = st end
  end

  if opts.also_first and init > 1 and not cp.anchor then
    local r = attempt(1)
    if r then return 1, r - 1, (captures(1, r - 1)) end
  end
  if cp.anchor then
    local r = attempt(init)
    if r then return init, r - 1, (captures(init, r - 1)) end
    return nil, resume
  end
  local first = cp.first
  local st = init
  while st <= n + 1 do
    if first then
      st = find(S, first, st, true)
      if not st then break end
    end
    steps = steps + 1
    local r = attempt(st)
    if r then return st, r - 1, (captures(st, r - 1)) end
    st = st + 1
  end
  -- position n+1 always looks at the end (when first skipped it, it fails
  -- there for want of a byte)
  if not resume then resume = n + 1 end
  return nil, resume
end

-- ---- string.find / string.match work-alikes --------------------------------------

-- string.find's init: negative from the end, clamped to 1..#s+1 (5.1)
local function norm_init(init, len)
  init = init or 1
  if init < 0 then init = len + init + 1 end
  if init < 1 then init = 1 end
  if init > len + 1 then init = len + 1 end
  return init
end
M.norm_init = norm_init

-- Plain search in windows, so no single string.find call compares more
-- than about 4M bytes (its memcmp at each candidate is O(#needle)).
local PLAIN_WORK = 4 * 1024 * 1024
function M.plain_find(S, needle, init, pause)
  local m = #needle
  if m == 0 then return init, init - 1 end
  local window = math.max(1, math.floor(PLAIN_WORK / m))
  local n = #S
  local st = init
  while st + m - 1 <= n do
    local stop = math.min(n, st + window + m - 2)
    local s = find(sub(S, st, stop), needle, 1, true)
    if s then return st + s - 1, st + s + m - 2 end
    st = stop - m + 2
    if pause then pause() end
  end
  return nil, math.max(init, n - m + 2)
end

-- check(pattern) -> compiled, or raises VALIDATION_FAILED (field "pattern")
function M.check(pattern, field)
  local cp, msg = M.compile(pattern)
  if not cp then
    require("moonbox.lib.validate").fail(field or "pattern", ("malformed pattern %q: %s"):format(pattern, msg))
  end
  return cp
end

-- find(s, pattern, init, plain, opts) -> as string.find (start, end,
-- captures...), within opts.budget steps.
function M.find(S, pattern, init, plain, opts)
  init = norm_init(init, #S)
  if plain or M.is_plain(pattern) then
    local s, e = M.plain_find(S, pattern, init, opts and opts.pause)
    if s then return s, e end
    return nil
  end
  local cp = M.check(pattern)
  local s, e, caps = M.search(cp, S, init, opts)
  if not s then return nil end
  return s, e, unpack(caps, 1, cp.ncap)
end

-- match(s, pattern, init, opts) -> as string.match
function M.match(S, pattern, init, opts)
  init = norm_init(init, #S)
  local cp = M.check(pattern)
  local s, e, caps = M.search(cp, S, init, opts)
  if not s then return nil end
  if cp.ncap == 0 then return sub(S, s, e) end
  return unpack(caps, 1, cp.ncap)
end

return M
