-- tree.proc_tree (lua/moonbox/process/tree.lua) on hand-made /proc passes:
-- which processes caught mid-exec or mid-exit ("unsettled", no marker to
-- read) may still be a proc-mode tree's, so that its kill goes on looking.
local core = require "moonbox.core"
local tree = require "moonbox.process.tree"

local LEADER, MARKER = 30500, "1/sb/s/p1"

local function entry(pid, ppid, pgid, sid, fields)
  local e = { pid = pid, ppid = ppid, pgid = pgid, sid = sid, state = "R", start = 1 }
  for k, v in pairs(fields or {}) do e[k] = v end
  return e
end

local function maybe(table_, running, adopted)
  local _, _, m = tree.proc_tree(LEADER, MARKER, running, table_, adopted or { [core.getpid()] = true })
  return m
end

describe("proc_tree's unsettled processes", function()
  it("a member of the leader's group or session caught mid-exec may be the tree's", function()
    assert.is_true(maybe({ entry(30600, 1, LEADER, LEADER, { unsettled = true }) }, false))
    assert.is_true(maybe({ entry(30600, 1, 30600, LEADER, { unsettled = true }) }, false))
    -- while the leader runs, its pid is its own
    local member = entry(30600, LEADER, LEADER, LEADER, { unsettled = true })
    assert.is_true(maybe({ entry(LEADER, 2, LEADER, LEADER), member }, true))
  end)

  it("once the reaped leader's pid is someone else's, that pid's group and session are not the tree's", function()
    -- (pid_max wraps: another sandbox's command got the number and was
    -- caught exiting; a pid is given out again only once no group or
    -- session holds it)
    assert.is_false(maybe({ entry(LEADER, 2, LEADER, LEADER, { unsettled = true }) }, false))
    assert.is_false(maybe({ entry(LEADER, 2, LEADER, 2), entry(30601, LEADER, LEADER, 2, { unsettled = true }) },
      false))
    -- the leader itself, in a pass taken before it was reaped, is no reuse
    local leader = entry(LEADER, 2, LEADER, LEADER, { owner = MARKER })
    assert.is_true(maybe({ leader, entry(30602, LEADER, LEADER, LEADER, { unsettled = true }) }, false))
    -- its descendants by parentage still count when one is the tree's
    local marked = entry(30700, 1, 30700, 30700, { owner = MARKER })
    assert.is_true(maybe({ entry(LEADER, 2, LEADER, LEADER), marked, entry(30701, 30700, 30700, 30700,
      { unsettled = true }) }, false))
  end)

  it("an unsettled orphan counts only where the tree's orphans go", function()
    local other_init = 4242
    local orphan = entry(30800, other_init, 30800, 30800, { unsettled = true })
    assert.is_false(maybe({ orphan }, false))
    assert.is_true(maybe({ orphan }, false, { [core.getpid()] = true, [other_init] = true }))
    assert.is_true(maybe({ entry(30801, core.getpid(), 30801, 30801, { unsettled = true }) }, false))
  end)
end)
