-- Address slots of egress sandboxes: slot n of the range is the /30 at
-- range + 4n (the host's side .1, the sandbox .2). A slot is held by an
-- flock on DIR/slot-<n>.lock for the sandbox's life: host-wide (every
-- runtime on the host shares DIR, whatever its MOONBOX_HOME: they share the
-- kernel's links and tables), and released by the kernel when its runtime
-- dies, which is how a sweep tells a crashed runtime's leftovers from a
-- live sandbox's.
local core = require "moonbox.core"
local rules = require "moonbox.network.rules"

local M = {}

M.DIR = os.getenv("MOONBOX_EGRESS_DIR") or "/run/moonbox/egress"
M.RANGE = os.getenv("MOONBOX_EGRESS_RANGE") or "10.203.0.0/16"
M.LINK_PREFIX = "mbx" -- host side of slot n: mbx<n>

function M.range()
  local r = rules.parse_cidr(M.RANGE)
  if not r or r.len > 29 or r.len < 8 then
    return nil, ("MOONBOX_EGRESS_RANGE %q: expected an IPv4 CIDR from /8 to /29"):format(M.RANGE)
  end
  return r
end

function M.link(n) return M.LINK_PREFIX .. n end
function M.lock_path(n) return ("%s/slot-%d.lock"):format(M.DIR, n) end

local function mkdirs()
  local path = ""
  for part in M.DIR:gmatch("[^/]+") do
    path = path .. "/" .. part
    core.mkdir(path, 448) -- 0700: the lock files are the runtimes' only
  end
end

function M.addresses(range, n)
  local base = range.net + 4 * n
  return rules.format_ipv4(base + 1), rules.format_ipv4(base + 2)
end

local function link_exists(n)
  local f = io.open("/sys/class/net/" .. M.link(n) .. "/ifindex")
  if f then f:close() return true end
  return false
end

-- try(n, owner) -> fd | nil: slot n's lock, when free
function M.try(n, owner)
  mkdirs()
  local fd = core.fs_lock(M.lock_path(n), owner .. "\n")
  return fd
end

-- claim(owner, cleanup) -> {n, fd, host_addr, sb_addr, range} | nil, message
-- A free slot from a random start; one whose lock is free but whose link
-- is still there was a crashed runtime's: cleanup(n) removes its leftovers
-- before it is used.
function M.claim(owner, cleanup)
  local range, why = M.range()
  if not range then return nil, why end
  local count = math.floor(2 ^ (32 - range.len) / 4)
  local start = math.random(0, count - 1)
  for i = 0, count - 1 do
    local n = (start + i) % count
    local fd = M.try(n, owner)
    if fd then
      if link_exists(n) then cleanup(n) end
      if not link_exists(n) then
        local host_addr, sb_addr = M.addresses(range, n)
        return { n = n, fd = fd, host_addr = host_addr, sb_addr = sb_addr, range = range }
      end
      core.close_fd(fd)
    end
  end
  return nil, ("every address slot of %s is in use"):format(M.RANGE)
end

function M.release(slot)
  if slot and slot.fd then
    core.unlink(M.lock_path(slot.n))
    core.close_fd(slot.fd)
    slot.fd = nil
  end
end

return M
