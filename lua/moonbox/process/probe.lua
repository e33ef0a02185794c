-- Readiness probes for waitForPort: a TCP connect, or an HTTP GET whose
-- status must be 200-399 (or opts.status). Each probe gives up after 2 s.
local core = require "moonbox.core"
local async = require "moonbox.async"
local util = require "moonbox.lib.util"

local M = {}
local PROBE_TIMEOUT_MS = 2000

-- connect(host, port, opts[, what]) -> fd | nil, message. opts.sandbox: a
-- sandbox with its own network namespace is reached from inside it,
-- through a socket its init creates there (waitForPort's probes, the port
-- proxy). A cancelled wait (e.g. an HTTP client that went away) leaves
-- nothing behind: a connection that completes later is closed at once.
function M.connect(host, port, opts, what)
  local sb = opts and opts.sandbox
  local sock
  if sb and sb.init and (sb.network == "none" or sb.network == "egress") then
    -- (an init a destroy closed meanwhile raises: the probe fails, and the
    -- wait sees its process gone)
    local made, s, msg = pcall(sb.init.socket, sb.init, host:find(":", 1, true) and "tcp6" or "tcp4")
    if not made then s, msg = nil, "the sandbox's init is gone" end
    if not s then return nil, "cannot make a socket in the sandbox: " .. tostring(msg) end
    sock = s
  end
  return async.await(function(resume)
    local abandoned = false
    local ok, msg = core.tcp_connect(host, port, function(err, fd)
      if abandoned then
        if fd then core.close_fd(fd) end
        return
      end
      resume(fd, err)
    end, sock)
    if not ok then
      if sock then core.close_fd(sock) end
      resume(nil, msg)
    end
    return function() abandoned = true end
  end, what or "waitForPort")
end
local connect = M.connect

-- The inodes of the sockets listening on port, in the network namespace
-- the probe connects in (the sandbox's own, or ours); nil if unreadable.
local function listeners(port, opts)
  local sb = opts and opts.sandbox
  local net = "/proc/self/net/"
  if sb and sb.init and (sb.network == "none" or sb.network == "egress") then
    net = "/proc/" .. sb.init:pid() .. "/net/"
  end
  local found, readable = {}, false
  for _, file in ipairs { "tcp", "tcp6" } do
    local text = util.read_file(net .. file)
    if text then
      readable = true
      -- "sl local_address rem_address st ... uid timeout inode"
      for lport, st, inode in text:gmatch("\n%s*%d+: %x+:(%x+) %x+:%x+ (%x%x) %S+ %S+ %S+ +%d+ +%d+ +(%d+)") do
        if st == "0A" and tonumber(lport, 16) == port then found[#found + 1] = inode end
      end
    end
  end
  return readable and found or nil
end

-- How long a member of the tree whose fds cannot be read must stay so
-- before it is given the benefit of the doubt: a process in the middle of
-- an execve is unreadable for a moment (its new image not yet dumpable),
-- one that made itself non-dumpable for good.
M.UNREADABLE_GRACE_MS = 1000

-- Whether a connection to port was accepted by a listener of the process
-- being waited for (opts.owner_pids(): the pids of its tree), and not by
-- one of another process (a server of an earlier run still going away, a
-- stranger on the host's network): false when the listener is someone
-- else's or gone; true when it is the tree's, or when a member's fds have
-- been unreadable for UNREADABLE_GRACE_MS (opts keeps since when, per wait).
local function accepted_by_owner(port, opts)
  if not (opts and opts.owner_pids) then return true end
  local inodes = listeners(port, opts)
  if not inodes then return true end
  if #inodes == 0 then return false end -- (it went away since)
  local wanted = {}
  for _, inode in ipairs(inodes) do wanted["socket:[" .. inode .. "]"] = true end
  local unreadable = false
  for _, pid in ipairs(opts.owner_pids()) do
    local dir = "/proc/" .. pid .. "/fd"
    local fds = core.readdir(dir)
    if not fds then
      unreadable = unreadable or util.read_file("/proc/" .. pid .. "/stat") ~= nil
    else
      for _, fd in ipairs(fds) do
        if wanted[core.readlink(dir .. "/" .. fd) or ""] then return true end
      end
    end
  end
  if not unreadable then
    opts.unreadable_since = nil
    return false
  end
  local now = core.hrtime() / 1e6
  opts.unreadable_since = opts.unreadable_since or now
  return now - opts.unreadable_since >= M.UNREADABLE_GRACE_MS
end

function M.tcp(host, port, opts)
  local fd = connect(host, port, opts)
  if not fd then return false end
  -- (checked while our connection is still open)
  local ok = accepted_by_owner(port, opts)
  core.close_fd(fd)
  return ok
end

function M.http(host, port, opts)
  local fd = connect(host, port, opts)
  if not fd then return false end
  if not accepted_by_owner(port, opts) then
    core.close_fd(fd)
    return false
  end
  local stream = core.stream_open(fd)
  local path = opts.path or "/"
  local request = ("GET %s HTTP/1.0\r\nHost: %s:%d\r\nConnection: close\r\n\r\n"):format(path, host, port)
  local ok, status = pcall(async.await, function(resume)
    local buf, timer = "", core.timer()
    local function stop()
      if timer then timer:close() timer = nil end
      stream:read_stop()
    end
    local function finish(code)
      stop()
      resume(code)
    end
    timer:start(PROBE_TIMEOUT_MS, 0, function() timer:close() timer = nil finish(nil) end)
    stream:write(request)
    stream:read_start(function(_, data)
      if not data then return finish(tonumber(buf:match("^HTTP/%d[%.%d]* (%d%d%d)"))) end
      buf = buf .. data
      local code = buf:match("^HTTP/%d[%.%d]* (%d%d%d)")
      if code or #buf > 4096 then finish(tonumber(code)) end
    end)
    return stop
  end, "waitForPort")
  stream:close()
  if not ok then error(status, 0) end
  if not status then return false end
  if opts.status then return status == opts.status end
  return status >= 200 and status < 400
end

return M
