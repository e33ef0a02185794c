-- Backup benchmark (issue #16): sandbox:createBackup and restoreBackup of a
-- 100 MB workspace against mksquashfs / unsquashfs run by hand, on the host,
-- with the same options, in the same run (turns alternate, median of runs).
--
-- Run: ./build/moonbox bench/backup.lua [runs] [MB] [isolation]
-- (defaults: 5 runs, 100 MB, auto). The workspace is a mix: many small
-- source-like files (compressible), a few large text files (compressible),
-- random data in files of 4 KiB to 8 MiB (not compressible).
local moonbox = require "moonbox"
local core = require "moonbox.core"
local backup = require "moonbox.backup"
local util = require "moonbox.lib.util"

local RUNS = tonumber(arg and arg[1]) or 5
local MB = tonumber(arg and arg[2]) or 100
local ISOLATION = arg and arg[3] or "auto"

local function ms() return core.hrtime() / 1e6 end
local function median(t)
  local s = {}
  for i, v in ipairs(t) do s[i] = v end
  table.sort(s)
  return s[math.floor((#s + 1) / 2)]
end
local function sh(cmd)
  local ok = os.execute(cmd)
  assert(ok == 0 or ok == true, "failed: " .. cmd)
end

-- deterministic pseudo-random bytes (xorshift), so every run is the same data
local seed = 88172645
local function rnd()
  seed = bit.bxor(seed, bit.lshift(seed, 13))
  seed = bit.bxor(seed, bit.rshift(seed, 17))
  seed = bit.bxor(seed, bit.lshift(seed, 5))
  return seed
end
local words = {}
for w in ("local function return end if then else for in pairs ipairs table string nil true false "
  .. "sandbox session exec process file write read backup restore moonbox core util error code"):gmatch("%S+") do
  words[#words + 1] = w
end
local function text(n)
  local parts, size = {}, 0
  while size < n do
    local line = {}
    for i = 1, 4 + rnd() % 8 do line[i] = words[rnd() % #words + 1] end
    local l = string.rep("  ", rnd() % 4) .. table.concat(line, " ") .. " -- " .. (rnd() % 100000) .. "\n"
    parts[#parts + 1] = l
    size = size + #l
  end
  return table.concat(parts):sub(1, n)
end
local urandom = assert(io.open("/dev/urandom", "rb"))
local function write(path, data) assert(util.write_file(path, data)) end

-- ~MB of files under dir: 30% small text files, 30% large text, 40% random
local function populate(dir)
  local total = MB * 1024 * 1024
  local budget = { small = total * 0.3, large = total * 0.3, random = total * 0.4 }
  local n = 0
  sh(("mkdir -p %s/src %s/data %s/blobs"):format(dir, dir, dir))
  local made = 0
  while made < budget.small do
    local size = 1024 + rnd() % (16 * 1024)
    local sub = ("%s/src/m%02d"):format(dir, n % 40)
    if n < 40 then sh("mkdir -p " .. sub) end
    write(("%s/f%05d.lua"):format(sub, n), text(size))
    made, n = made + size, n + 1
  end
  made = 0
  local i = 0
  while made < budget.large do
    local size = math.min(budget.large - made, 4 * 1024 * 1024 + rnd() % (8 * 1024 * 1024))
    write(("%s/data/log%02d.txt"):format(dir, i), text(size))
    made, i = made + size, i + 1
  end
  made, i = 0, 0
  while made < budget.random do
    local size = math.min(budget.random - made, 4096 * (1 + rnd() % 2048))
    write(("%s/blobs/b%03d.bin"):format(dir, i), urandom:read(size))
    made, i = made + size, i + 1
  end
  return n + i
end

moonbox.run(function()
  local base = os.tmpname()
  os.remove(base)
  assert(core.mkdir(base))
  backup.DIR = base .. "/store"
  local sb = moonbox.getSandbox("bench-backup", { root = base .. "/root", isolation = ISOLATION })
  local ws = sb.workspace -- the host's path of /workspace
  local t = ms()
  local files = populate(ws)
  sh(("chown -R --reference=%s %s"):format(ws, ws)) -- root inside's, as the sandbox's own files are
  local du = io.popen("du -sm " .. ws):read("*l")
  print(("workspace: %d files, %s MB on disk, made in %.1f s; isolation %s; %d runs"):format(
    files, du:match("^(%d+)"), (ms() - t) / 1000, sb.isolation or ISOLATION, RUNS))
  local hand_dir = base .. "/hand"
  local opts = "-noappend -no-progress -quiet -comp " .. backup.DEFAULT_COMPRESSION
  local rows = { hand_create = {}, create = {}, hand_restore = {}, restore = {}, restore_empty = {} }
  local size_hand, size_backup
  sh("sync")
  for run = 1, RUNS do
    -- by hand: the same mksquashfs of the same directory, on the host
    t = ms()
    sh(("mksquashfs %s %s/hand.sqsh %s"):format(ws, base, opts))
    rows.hand_create[run] = ms() - t
    size_hand = tonumber(io.popen("stat -c %s " .. base .. "/hand.sqsh"):read("*l"))
    -- createBackup of /workspace
    t = ms()
    local b = sb:createBackup({ dir = "/workspace" })
    rows.create[run] = ms() - t
    size_backup = b.sizeBytes
    -- by hand: unsquashfs into a fresh directory
    sh("rm -rf " .. hand_dir)
    t = ms()
    sh(("unsquashfs -f -no-progress -quiet -d %s %s/hand.sqsh >/dev/null"):format(hand_dir, base))
    rows.hand_restore[run] = ms() - t
    -- restoreBackup into a directory that does not exist yet (what the hand run does)
    t = ms()
    sb:restoreBackup({ id = b.id, dir = "/tmp/restored" })
    rows.restore_empty[run] = ms() - t
    sb:exec("rm -rf /tmp/restored")
    -- restoreBackup over the workspace itself (its old content removed first)
    t = ms()
    sb:restoreBackup(b)
    rows.restore[run] = ms() - t
    moonbox.deleteBackup(b.id)
  end
  -- ratio of the medians, and the median of each run's own ratio (the two
  -- sides of a run ran back to back: steadier when the host's load drifts)
  local function row(name, key, against)
    local m = median(rows[key])
    local ratio, per_run = "-", "-"
    if against then
      ratio = ("%.2fx"):format(m / median(rows[against]))
      local r = {}
      for i, v in ipairs(rows[key]) do r[i] = v / rows[against][i] end
      per_run = ("%.2fx"):format(median(r))
    end
    print(("| %s | %.0f | %s | %s |"):format(name, m, ratio, per_run))
  end
  print(("archive: by hand %d bytes, createBackup %d bytes"):format(size_hand or -1, size_backup or -1))
  print("| measurement (median of " .. RUNS .. ") | ms | ratio of medians | median of per-run ratios |")
  print("|---|---|---|---|")
  row("`mksquashfs` by hand", "hand_create")
  row("`createBackup{dir = \"/workspace\"}`", "create", "hand_create")
  row("`unsquashfs` by hand into a new directory", "hand_restore")
  row("`restoreBackup` into a new directory", "restore_empty", "hand_restore")
  row("`restoreBackup` over the workspace (old content removed first)", "restore", "hand_restore")
  for _, k in ipairs { "hand_create", "create", "hand_restore", "restore_empty", "restore" } do
    local parts = {}
    for i, v in ipairs(rows[k]) do parts[i] = ("%.0f"):format(v) end
    print(("  %s: %s"):format(k, table.concat(parts, " ")))
  end
  sb:destroy({ keepFiles = false })
  util.remove_tree(base)
end)
