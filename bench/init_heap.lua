-- Sandbox creation with a big Lua heap (issue #14, loop lag): how long
-- getSandbox holds the event loop, and how late the loop runs afterwards
-- while the runtime writes to its heap with the sandbox alive. Before the
-- init exec'd moonbox-init it was a copy-on-write clone of the runtime: the
-- clone copied the page tables of the whole heap on the loop, and every
-- later write to a shared page faulted and copied it.
-- Run: ./build/moonbox bench/init_heap.lua [heap MB] [rounds]
local moonbox = require "moonbox"
local core = require "moonbox.core"

local HEAP_MB = tonumber(arg and arg[1]) or 500
local ROUNDS = tonumber(arg and arg[2]) or 5
local function ms() return core.hrtime() / 1e6 end

-- the time core.sandbox_init itself takes (clone, id maps, the init's set-up)
local init_ms = 0
local sandbox_init = core.sandbox_init
core.sandbox_init = function(...)
  local t = ms()
  local a, b, c = sandbox_init(...)
  init_ms = ms() - t
  return a, b, c
end

local tmp = os.tmpname()
os.remove(tmp)
assert(core.mkdir(tmp))

-- a loop-lag probe: a 1 ms repeating timer, its worst lateness
local probe = { worst = 0 }
local function probe_start()
  probe.worst, probe.last = 0, ms()
  probe.timer = core.timer()
  probe.timer:start(1, 1, function()
    local now = ms()
    local late = now - probe.last - 1
    if late > probe.worst then probe.worst = late end
    probe.last = now
  end)
end
local function probe_stop()
  probe.timer:stop()
  probe.timer:close()
  return probe.worst
end

local heap, nums = {}, {}
local function fill()
  -- HEAP_MB of distinct strings (1 KiB each), and a table of numbers to write into
  local pad = ("x"):rep(1000)
  for i = 1, HEAP_MB * 1024 do heap[i] = pad .. i end
  for i = 1, 4 * 1024 * 1024 do nums[i] = i end -- 32 MiB
end

-- one write per page of the numbers table, in 50 slices with the loop
-- turning between them: the time spent writing, and the longest slice
local function write_heap()
  local step, slices = 512, 50 -- 512: one 8-byte number per 4 KiB page
  local per = math.ceil(#nums / slices)
  local total, longest = 0, 0
  for s = 0, slices - 1 do
    local t = ms()
    for i = s * per + 1, math.min(#nums, (s + 1) * per), step do nums[i] = nums[i] + 1 end
    local d = ms() - t
    total, longest = total + d, math.max(longest, d)
    moonbox.sleep(1)
  end
  return total, longest
end

local function timed_gc()
  local t = ms()
  collectgarbage("collect")
  return ms() - t
end

-- create: the getSandbox call; held: the loop's worst lateness over it;
-- writes/slice: write_heap with the sandbox alive; gc_alive, gc_alone: a
-- full collection (it marks every object: a write to every page of the
-- heap) with the sandbox alive, and after it is destroyed
local function round(i)
  timed_gc()
  probe_start()
  local t = ms()
  local sb = moonbox.getSandbox("bench-heap-" .. i, { root = tmp .. "/sb" .. i, isolation = "namespaces" })
  local create, init = ms() - t, init_ms
  moonbox.sleep(5) -- the probe's late tick arrives
  local held = probe_stop()
  assert(sb:exec("true").exitCode == 0)
  local writes, slice = write_heap()
  local gc_alive = timed_gc()
  sb:destroy()
  moonbox.sleep(20)
  write_heap()
  local gc_alone = timed_gc()
  return create, init, held, writes, slice, gc_alive, gc_alone
end

local function median(v)
  table.sort(v)
  return v[math.floor((#v + 1) / 2)]
end

moonbox.run(function()
  local rows = {}
  for _, phase in ipairs { "small", "big" } do
    if phase == "big" then fill() end
    local c, n, h, w, s, ga, g0 = {}, {}, {}, {}, {}, {}, {}
    round(0) -- warm
    for i = 1, ROUNDS do
      c[i], n[i], h[i], w[i], s[i], ga[i], g0[i] = round(i)
    end
    local kb = collectgarbage("count")
    rows[#rows + 1] = ("| %d MiB | %.1f | %.1f | %.1f | %.1f | %.2f | %.0f | %.0f |"):format(kb / 1024, median(c),
      median(n), median(h), median(w), median(s), median(ga), median(g0))
  end
  print(("machine: %s, %d rounds, medians"):format(io.popen("uname -r"):read("*l"), ROUNDS))
  print("| Lua heap | getSandbox | core.sandbox_init | loop's worst lateness over getSandbox | " ..
    "page writes, sandbox alive | longest slice | full GC, sandbox alive | full GC, none alive |")
  print("|---|---|---|---|---|---|---|---|")
  for _, r in ipairs(rows) do print(r) end
  print(("(%d strings kept)"):format(#heap))
  os.execute("rm -rf " .. tmp)
end)
