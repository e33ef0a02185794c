-- moonbox.lib.pattern: the step-counting Lua pattern matcher. Its results must
-- be string.find's and string.match's, on fixed cases and on random ones.
local P = require "moonbox.lib.pattern"

local function pack(...) return { n = select("#", ...), ... } end

-- string.find's results (or its error) next to ours
local function same_as_find(subject, pattern, init)
  local want = pack(pcall(string.find, subject, pattern, init))
  local got = pack(pcall(P.find, subject, pattern, init))
  assert(want[1], ("string.find raised on %q (which compiled): %s"):format(pattern, tostring(want[2])))
  assert.same(want, got, ("find(%q, %q, %s)"):format(subject, pattern, tostring(init)))
end

local function same_as_match(subject, pattern, init)
  local want = pack(pcall(string.match, subject, pattern, init))
  local got = pack(pcall(P.match, subject, pattern, init))
  assert(want[1], ("string.match raised on %q (which compiled): %s"):format(pattern, tostring(want[2])))
  assert.same(want, got, ("match(%q, %q, %s)"):format(subject, pattern, tostring(init)))
end

-- A seeded generator, so a failure can be reproduced.
local seed = tonumber(os.getenv("MOONBOX_PATTERN_SEED")) or os.time()
local function rng(s)
  local state = s % 2147483647
  if state <= 0 then state = state + 2147483646 end
  return function(k)
    state = (state * 16807) % 2147483647
    return state % k + 1
  end
end

local ITEMS = { "a", "b", "c", ".", "%a", "%d", "%s", "%w", "%x", "%p", "%l", "%u", "%c", "%z", "%A", "%S",
  "%W", "%g", "%G", "%q", "%.", "%%", "%-", "[ab]", "[^a]", "[a-c]", "[%a_]", "[]]", "[^]a]", "[a-]", "[%d%s]",
  "[%z]", " ", "(", ")",
  "()", "%1", "%2", "%bab", "%b()", "%f[%a]", "%f[^a]", "%f[%z]", "-", "*", "?", "+", "$", "^", "]", "1", "\0" }
local QUANTS = { "", "", "", "*", "+", "-", "?" }
local SUBJECT_BYTES = { "a", "b", "c", "a", "b", " ", "(", ")", "1", "A", "_", "-", "\0", "\n", "%", "$" }

local function random_pattern(r)
  local parts = {}
  if r(5) == 1 then parts[1] = "^" end
  for _ = 1, r(7) do
    local item = ITEMS[r(#ITEMS)]
    parts[#parts + 1] = item
    if #item == 1 or item:match("^%%%a$") or item:match("^%[.*%]$") then parts[#parts + 1] = QUANTS[r(#QUANTS)] end
  end
  if r(5) == 1 then parts[#parts + 1] = "$" end
  return table.concat(parts)
end

local function random_subject(r)
  local t = {}
  for i = 1, r(12) - 1 do t[i] = SUBJECT_BYTES[r(#SUBJECT_BYTES)] end
  return table.concat(t)
end

describe("moonbox.lib.pattern", function()
  describe("refuses what string.find could raise on, whatever the subject", function()
    for _, case in ipairs {
      { "([", "missing ']'" }, { "%", "ends with '%'" }, { "[a", "missing ']'" }, { "(()", "unfinished capture" },
      { "a(", "unfinished capture" }, { "a.)", "invalid pattern capture" }, { "%1", "invalid capture index" },
      { "(a%1)", "invalid capture index" }, { "(a)%2", "invalid capture index" }, { "%0.", "invalid capture index" },
      { "%b", "unbalanced pattern" }, { "%ba", "unbalanced pattern" }, { "%f", "missing '['" },
      { "%fa", "missing '['" }, { "%f[a", "missing ']'" }, { "[%", "missing ']'" }, { "[^]", "missing ']'" },
      { ("()"):rep(33), "too many captures" }, { ("a?"):rep(1001), "too complex" },
    } do
      it(("%q: %s"):format(case[1], case[2]), function()
        local cp, msg = P.compile(case[1])
        assert.is_nil(cp)
        assert.truthy(msg:find(case[2], 1, true), msg)
        local err = select(2, pcall(P.find, "x", case[1]))
        assert.equals("VALIDATION_FAILED", err.code)
        assert.equals("pattern", err.context.field)
        -- and string.find does raise it once a match reaches the fault
        -- (the quantifier limit is ours: Lua 5.2 has one too)
        if case[2] ~= "too complex" then
          local subject = ("a"):rep(2)
          local raised = not pcall(string.find, subject, case[1]) or not pcall(string.find, "", case[1])
            or not pcall(string.find, "(a)", case[1])
          assert.is_true(raised, case[1])
        end
      end)
    end
  end)

  it("accepts what string.find accepts, with the same results (fixed cases)", function()
    local cases = {
      { "hello world", "o w" }, { "hello world", "(o)%s*()w" }, { "hello", "()ll()" }, { "xa", "a\0(" },
      { "a\0b", "a\0b" }, { "a\0b", "a\0b." }, { "  key = value", "(%w+)%s*=%s*(%w+)" },
      { "THE (quick) fox", "%((%a+)%)" }, { "THE (quick) fox", "%f[%a]%a+" }, { "f(a(b)c)d", "%b()" },
      { "f(a(b", "%b()" }, { "aa", "()%1" }, { "abab", "(ab)%1" }, { "]", "[]]" }, { "a-b", "[a-]+" },
      { "abc", "^b" }, { "abc", "c$" }, { "a$c", "a$c" }, { "a^c", "a^c" }, { "abc", "" }, { "", "" }, { "", "^$" },
      { "aaa", "a-" }, { "aaa", "a-$" }, { "aaab", "a-b" }, { "x*", "x**" }, { "g", "%g" }, { "a\0", "%z" },
      { "a\0b", "[%z]" }, { "é", "%a" }, { "\255", "[\200-\255]" }, { "word1 word2", "%f[%w]%w+$" },
      { "ab", "%f[%z]" }, { "THE", "%f[%l]" }, { "12ab", "%x+" }, { "-", "-" }, { "a)", "a)" },
      { ("a"):rep(20), ("a*"):rep(4) .. "b" }, { "key=val; k2=v2", "(%w+)=(%w+)$" },
    }
    -- (an explicit count: ipairs stops at the leading nil, and ran nothing)
    local inits = { n = 7, nil, 1, 2, -1, -3, 0, 100 }
    local compared = 0
    for _, c in ipairs(cases) do
      for i = 1, inits.n do
        same_as_find(c[1], c[2], inits[i])
        if P.compile(c[2]) then same_as_match(c[1], c[2], inits[i]) end
        compared = compared + 1
      end
    end
    assert.equal(#cases * inits.n, compared)
  end)

  it("gives string.find's and string.match's results on random patterns and subjects (seed " .. seed .. ")",
    function()
      local r = rng(seed)
      local compared, refused = 0, 0
      for _ = 1, 20000 do
        local pattern, subject = random_pattern(r), random_subject(r)
        local init = ({ nil, 1, 2, -2, 5 })[r(5)]
        if P.compile(pattern) then
          same_as_find(subject, pattern, init)
          same_as_match(subject, pattern, init)
          compared = compared + 1
        else
          refused = refused + 1
          if not P.is_plain(pattern) then
            -- a refused pattern must be one string.find raises on for
            -- some subject (or the quantifier limit)
            local raised = false
            for _, s in ipairs { "", subject, "a", "aa", "ab", "(a)", "a(b)c" } do
              if not pcall(string.find, s, pattern) then raised = true break end
            end
            if not raised then
              -- faults after a part that must match: try subjects made of
              -- the pattern's own literal bytes
              local lit = pattern:gsub("[%%%[%]%^%$%*%+%?%.%(%)%-]", "")
              for _, s in ipairs { lit, lit .. lit, "(" .. lit .. ")" } do
                if not pcall(string.find, s, pattern) then raised = true break end
              end
            end
            if not raised then
              -- string.find's errors are lazy: confirm the static fault
              local _, msg = P.compile(pattern)
              assert.truthy(msg:find("capture") or msg:find("malformed") or msg:find("%%f") or msg:find("unbalanced"),
                pattern .. ": " .. msg)
            end
          end
        end
      end
      assert.is_true(compared > 5000, "too few patterns compiled: " .. compared)
      assert.is_true(refused > 100, "too few malformed patterns generated: " .. refused)
    end)

  it("resumes a search after more text is appended as if it searched everything again", function()
    local r = rng(seed + 1)
    for _ = 1, 20000 do
      local pattern = random_pattern(r)
      -- search is for patterns (a plain one, which may hold a NUL the
      -- matcher stops at, goes to plain_find, as in string.find)
      local cp = not P.is_plain(pattern) and P.compile(pattern)
      if cp then
        local head, tail = random_subject(r), random_subject(r)
        local full = head .. tail
        local s, resume = P.search(cp, head, 1)
        if not s then
          local want = pack(string.find(full, pattern))
          if resume == false then
            assert.is_nil(want[1], ("%q on %q: gave up for good but %q matches"):format(pattern, head, full))
          else
            local s2, e2, caps = P.search(cp, full, resume)
            local got = s2 and pack(s2, e2, unpack(caps, 1, cp.ncap)) or pack(nil)
            assert.same(want, got, ("%q on %q then %q (resume at %d)"):format(pattern, head, full, resume))
          end
        end
      end
    end
  end)

  it("resumes after the front of the text was dropped (also_first retries position 1)", function()
    local r = rng(seed + 2)
    for _ = 1, 20000 do
      local pattern = random_pattern(r)
      -- search is for patterns (a plain one, which may hold a NUL the
      -- matcher stops at, goes to plain_find, as in string.find)
      local cp = not P.is_plain(pattern) and P.compile(pattern)
      if cp then
        local head, tail = random_subject(r), random_subject(r)
        local s, resume = P.search(cp, head, 1)
        if not s and #head > 0 then
          local dropped = r(#head)
          local now = head:sub(dropped + 1) .. tail
          local want = pack(string.find(now, pattern))
          -- an anchored pattern looks at position 1 only, and that changed
          local from = cp.anchor and 1 or math.max(1, resume - dropped)
          local s2, e2, caps = P.search(cp, now, math.min(from, #now + 1), { also_first = true })
          local got = s2 and pack(s2, e2, unpack(caps, 1, cp.ncap)) or pack(nil)
          assert.same(want, got, ("%q on %q, then %d dropped: %q"):format(pattern, head, dropped, now))
        end
      end
    end
  end)

  it("gives up on an expensive pattern once the budget is spent, quickly", function()
    local subject = ("a"):rep(40)
    local pattern = ("a*"):rep(8) .. "b" -- about 10^8 steps for string.find
    local t0 = os.clock()
    local ok, err = pcall(P.find, subject, pattern, 1, false, { budget = 100000 })
    assert.is_false(ok)
    assert.is_true(P.is_too_expensive(err))
    assert.is_true(err.steps >= 100000 and err.steps < 100000 + 5000)
    assert.is_true(os.clock() - t0 < 2) -- a hang would show here, not a timing bound
    -- the same pattern on a short subject stays within the budget
    assert.same({ nil }, { P.find(("a"):rep(5), pattern, 1, false, { budget = 100000 }) })
  end)

  it("calls pause every few thousand steps, with the steps so far", function()
    local seen = {}
    local pause = function(steps) seen[#seen + 1] = steps end
    P.find(("a"):rep(30), ("a*"):rep(4) .. "b", 1, false, { pause = pause })
    assert.is_true(#seen > 3)
    for i = 2, #seen do assert.is_true(seen[i] > seen[i - 1]) end
    -- plain text is searched in windows, pausing between them
    local calls = 0
    local s = P.plain_find(("a"):rep(200000) .. "b", ("a"):rep(1000) .. "b", 1, function() calls = calls + 1 end)
    assert.equals(199001, s)
    assert.is_true(calls > 10)
  end)

  it("plain_find finds text across window boundaries and says where to resume", function()
    local hay = ("x"):rep(10000) .. "needle" .. ("y"):rep(10)
    for _, init in ipairs { 1, 9999, 10001 } do
      assert.same({ 10001, 10006 }, { P.plain_find(hay, "needle", init) })
    end
    local s, resume = P.plain_find("abcnee", "needle", 1)
    assert.is_nil(s)
    assert.equals(2, resume) -- from position 2 on, appended text could complete it
    assert.same({ 4, 9 }, { P.plain_find("abcneedle", "needle", 1) })
  end)
end)
