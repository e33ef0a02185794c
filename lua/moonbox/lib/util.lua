-- Small shared helpers: timestamps, shell quoting, file slurping.
local core = require "moonbox.core"
local errors = require "moonbox.errors"

local M = {}

-- ISO-8601 UTC with milliseconds: 2026-11-29T21:05:03.123Z
-- (the date and time to the second made once per second: every exec
-- stamps its result)
local stamped_secs, stamped_prefix
function M.timestamp(t)
  t = t or core.time()
  local secs = math.floor(t)
  local ms = math.floor((t - secs) * 1000)
  if secs ~= stamped_secs then
    stamped_secs, stamped_prefix = secs, os.date("!%Y-%m-%dT%H:%M:%S", secs)
  end
  return ("%s.%03dZ"):format(stamped_prefix, ms)
end

function M.now_ms()
  return core.hrtime() / 1e6
end

-- Single-quote a string for bash: the result is always one literal word.
function M.shell_quote(s)
  return "'" .. tostring(s):gsub("'", "'\\''") .. "'"
end

-- An argv as one shell line that runs it: words bash would read as they
-- are stay bare, the others are single-quoted ({"printf", "%s", "x y"} ->
-- printf %s 'x y'). What results show as an argv call's `command`.
function M.shell_join(argv)
  local words = {}
  for i, w in ipairs(argv) do
    w = tostring(w)
    words[i] = w:match("^[%w%%+,./:=@_-]+$") and w or M.shell_quote(w)
  end
  return table.concat(words, " ")
end

-- Lexically clean an absolute path: "/a/./b/../c" -> "/a/c" (no symlinks
-- are looked at; confinement is the kernel's job, see lib/fs.lua).
function M.normalize(path)
  local parts = {}
  for part in path:gmatch("[^/]+") do
    if part == ".." then
      if #parts > 0 then parts[#parts] = nil end
    elseif part ~= "." then
      parts[#parts + 1] = part
    end
  end
  return "/" .. table.concat(parts, "/")
end

-- fd_limits() -> soft, hard, open: the process's RLIMIT_NOFILE (math.huge
-- for unlimited) and how many fds it has open (nil where /proc is missing).
function M.fd_limits()
  local text = M.read_file("/proc/self/limits") or ""
  local soft, hard = text:match("Max open files%s+(%S+)%s+(%S+)")
  local function num(v) return v == "unlimited" and math.huge or tonumber(v) end
  local list = core.readdir("/proc/self/fd")
  return num(soft), num(hard), type(list) == "table" and #list or nil
end

function M.read_file(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("*a")
  f:close()
  return s
end

-- Write a short string with one write(2); for cgroup control files.
function M.write_file(path, data)
  local f, err = io.open(path, "wb")
  if not f then return nil, err end
  f:setvbuf("no")
  local ok, werr = f:write(data)
  f:close()
  if not ok then return nil, werr end
  return true
end

-- rm -rf without following symlinks: remove() unlinks a symlink itself, so
-- only real directories are ever descended into.
function M.remove_tree(path)
  if os.remove(path) then return end
  if M.is_dir(path) then
    for _, name in ipairs(core.readdir(path) or {}) do M.remove_tree(path .. "/" .. name) end
    os.remove(path)
  end
end

-- Whether path can be opened (and is closed again at once, not by the GC).
function M.is_file(path)
  local f = io.open(path)
  if f then f:close() return true end
  return false
end

-- pid_alive(pid) -> a process with that pid runs (not a zombie)
function M.pid_alive(pid)
  local stat = M.read_file("/proc/" .. pid .. "/stat")
  -- (the state follows the last ")": a command name may hold ") Z ")
  return stat ~= nil and stat:match("^.*%) (%a)") ~= "Z"
end

function M.is_dir(path)
  local f = io.open(path .. "/.")
  if f then f:close() return true end
  return false
end

-- n bytes from the kernel's random source (raises on a short read), and
-- the same as 2n hex digits.
function M.random_bytes(n)
  local f = errors.check("FILESYSTEM_ERROR", io.open("/dev/urandom", "rb"))
  local bytes = f:read(n)
  f:close()
  if not (bytes and #bytes == n) then errors.raise("FILESYSTEM_ERROR", "short read from /dev/urandom") end
  return bytes
end

function M.random_hex(n)
  return (M.random_bytes(n):gsub(".", function(c) return ("%02x"):format(c:byte()) end))
end

function M.copy(t)
  local c = {}
  for k, v in pairs(t or {}) do c[k] = v end
  return c
end

return M
