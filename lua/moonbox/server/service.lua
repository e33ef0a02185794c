-- `moonbox serve` as a service (issue #18): what an operator needs around
-- the API. GET /metrics (Prometheus text), the access log (one JSON line
-- per request), idle expiry of sandboxes (--idle-timeout-s: stopped with
-- their workspace kept, back on the next request) and the graceful stop
-- (SIGTERM: drain, let requests finish for --shutdown-grace-s, end streams
-- with a final event, stop the sandboxes keeping their files, exit 0).
-- Docs: docs/server.md ("Running it as a service").
local core = require "moonbox.core"
local async = require "moonbox.async"
local errors = require "moonbox.errors"
local util = require "moonbox.lib.util"
local token = require "moonbox.server.token"
local cjson = require "cjson.safe"

local M = {}

-- exec latency buckets, seconds
M.BUCKETS = { 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300 }

-- Routes whose duration is an exec's (the /v1 API's and the seed protocol's).
local EXEC_ROUTES = {
  ["/v1/sandboxes/{id}/exec"] = true, ["/v1/sandboxes/{id}/exec/stream"] = true,
  ["/v1/sandboxes/{id}/api/execute"] = true, ["/v1/sandboxes/{id}/api/execute/stream"] = true,
}

local function sandboxes() return require("moonbox.sandbox").all() end

-- The sandbox id a request is about, from its path (before any routing).
function M.path_sandbox(path)
  return type(path) == "string" and path:match("^/v1/sandboxes/([a-z0-9_-]+)") or nil
end

-- new(opts) -> service. opts: accessLog ("-" / nil: stderr, "off", or a
-- file path), idleTimeoutS, shutdownGraceS.
function M.new(opts)
  local self = {
    opts = opts or {},
    -- reason -> count; every reason from the start (a counter reads 0 before it first moves)
    rejections = { max_connections = 0, shutting_down = 0, max_sandboxes = 0, unauthorized = 0 },
    requests = {},          -- status class ("2xx") -> count
    exec = { count = 0, sum = 0, buckets = {} },
    active = {},            -- sandbox id -> requests running for it
    lastActive = {},        -- sandbox id -> loop ms of its last request
    stopping = {},          -- sandbox id -> list of waiters while it is being stopped
    idleStopped = 0,
    nextId = 0,
    prefix = token.new():sub(1, 8), -- request ids: <prefix>-<n>
  }
  for i = 1, #M.BUCKETS do self.exec.buckets[i] = 0 end
  local log = self.opts.accessLog
  if log == "off" then
    self.log = nil
  elseif log == nil or log == "-" then
    self.log = io.stderr
  else
    local f, err = io.open(log, "a")
    if not f then
      errors.raise("VALIDATION_FAILED", ("cannot open the access log %q: %s"):format(log, tostring(err)))
    end
    f:setvbuf("line")
    self.log = f
  end
  return setmetatable(self, { __index = M })
end

function M:reject(reason)
  self.rejections[reason] = (self.rejections[reason] or 0) + 1
end

-- ---- per request ---------------------------------------------------------------------

-- begin(req): a request arrives (before routing). Waits while its sandbox
-- is being stopped for idleness, so it finds it stopped, not half-stopped.
function M:begin(req)
  self.nextId = self.nextId + 1
  req.id = ("%s-%d"):format(self.prefix, self.nextId)
  local id = M.path_sandbox(req.path)
  req.sandboxId = id
  if id then
    req._activeId = id
    self.active[id] = (self.active[id] or 0) + 1
    if sandboxes()[id] then self.lastActive[id] = core.now() end
    while self.stopping[id] and async.in_task() do
      local list = self.stopping[id]
      async.await(function(resume) list[#list + 1] = resume end, "sandbox idle stop")
    end
  end
end

-- finish(req): its handler has returned (a stream's handler runs as long
-- as the stream).
function M:finish(req)
  local id = req._activeId
  if not id then return end
  req._activeId = nil
  self.active[id] = (self.active[id] or 1) - 1
  if self.active[id] <= 0 then self.active[id] = nil end
  -- only sandboxes held are tracked (a request for an unknown or deleted id leaves nothing)
  self.lastActive[id] = sandboxes()[id] and core.now() or nil
end

-- done(req, res): the response is out (or the client is gone).
function M:done(req, res)
  if not req.id then -- answered before any handler (503 past --max-connections, 400, 413, ...)
    self.nextId = self.nextId + 1
    req.id = ("%s-%d"):format(self.prefix, self.nextId)
  end
  if req.sandboxId and self.lastActive[req.sandboxId] then self.lastActive[req.sandboxId] = core.now() end
  local status = res.status or ((res.closed or res.clientGone) and 499) or 0
  local class = ("%dxx"):format(math.floor(status / 100))
  self.requests[class] = (self.requests[class] or 0) + 1
  local ms = res.durationMs or 0
  if req.route and EXEC_ROUTES[req.route] and req.method == "POST" and status >= 200 and status < 300 then
    local e = self.exec
    e.count, e.sum = e.count + 1, e.sum + ms / 1000
    for i, le in ipairs(M.BUCKETS) do
      if ms / 1000 <= le then e.buckets[i] = e.buckets[i] + 1 end
    end
  end
  if self.log then
    local fields = {
      { "time", util.timestamp() }, { "requestId", req.id }, { "method", req.method }, { "route", req.route },
      { "sandboxId", req.sandboxId }, { "status", status },
      { "durationMs", math.floor(ms * 1000 + 0.5) / 1000 }, { "bytes", res.bytes or 0 },
    }
    local parts = {}
    for i, f in ipairs(fields) do
      local v = f[2] == nil and "null" or (cjson.encode(f[2]) or "null"):gsub("\\/", "/")
      parts[i] = ('"%s":%s'):format(f[1], v)
    end
    local line = "{" .. table.concat(parts, ",") .. "}"
    if line then pcall(self.log.write, self.log, line, "\n") end
  end
end

-- ---- /metrics ------------------------------------------------------------------------

-- text(server) -> the Prometheus text exposition (version 0.0.4).

-- A terminal whose shell has not exited (one that exited but was not
-- closed yet holds nothing running).
local function live_terminal(t) return not t.exited and not t.closed end

-- A live terminal running something: its pty's foreground process group
-- is not its shell's (the shell at its prompt is idle; a socket attached
-- to it is a request running, counted on its own).
local function terminal_busy(t)
  if not live_terminal(t) then return false end
  local stat = t.pid and util.read_file("/proc/" .. t.pid .. "/stat")
  -- (after the last ")": the command name, which the tenant sets, may hold one)
  local tpgid = stat and tonumber(stat:match("^.*%) %S %d+ %d+ %d+ %-?%d+ (%-?%d+)"))
  return tpgid == nil or (tpgid > 0 and tpgid ~= t.pid)
end

function M:metrics(server)
  local out = {}
  local function metric(name, kind, help, samples)
    out[#out + 1] = ("# HELP %s %s\n# TYPE %s %s\n"):format(name, help, name, kind)
    for _, s in ipairs(samples) do
      out[#out + 1] = ("%s%s %s\n"):format(name, s[1] or "", s[2])
    end
  end
  local nsb, nsess, nproc, nterm, nctx = 0, 0, 0, 0, 0
  for _, sb in pairs(sandboxes()) do
    nsb = nsb + 1
    for _ in pairs(sb.sessions or {}) do nsess = nsess + 1 end
    for _, p in pairs(sb.processes or {}) do
      if p.is_running and p:is_running() then nproc = nproc + 1 end
    end
    for t in pairs(sb.terminals or {}) do if live_terminal(t) then nterm = nterm + 1 end end
    for _ in pairs(sb.contexts or {}) do nctx = nctx + 1 end
  end
  metric("moonbox_sandboxes", "gauge", "Sandboxes this server holds (running).", { { nil, nsb } })
  metric("moonbox_sandboxes_idle_stopped_total", "counter",
    "Sandboxes stopped for idleness (--idle-timeout-s), workspace kept.", { { nil, self.idleStopped } })
  metric("moonbox_sessions", "gauge", "Sessions of those sandboxes.", { { nil, nsess } })
  metric("moonbox_processes", "gauge", "Running background processes.", { { nil, nproc } })
  metric("moonbox_terminals", "gauge", "Open terminals.", { { nil, nterm } })
  metric("moonbox_code_contexts", "gauge", "Code interpreter contexts.", { { nil, nctx } })
  -- egress sandboxes' counters, read from their nftables tables (network/init.lua)
  local egress = {}
  if require("moonbox.async").in_task() then
    local ids = {}
    for id, sb in pairs(sandboxes()) do if sb.egress and not sb.destroyed then ids[#ids + 1] = id end end
    table.sort(ids)
    for _, id in ipairs(ids) do
      local sb = sandboxes()[id]
      local ok, c = pcall(require("moonbox.network").counters, sb and sb.egress)
      if ok and c then egress[#egress + 1] = { ('{sandbox="%s"}'):format(id), c } end
    end
  end
  for _, m in ipairs {
    { "moonbox_egress_sent_bytes_total", "sentBytes", "Bytes egress sandboxes sent out (accepted by their table)." },
    { "moonbox_egress_received_bytes_total", "receivedBytes", "Bytes of replies to egress sandboxes." },
    { "moonbox_egress_refused_packets_total", "refusedPackets", "Packets egress sandboxes' tables refused." },
  } do
    local samples = {}
    for i, e in ipairs(egress) do samples[i] = { e[1], e[2][m[2]] } end
    metric(m[1], "counter", m[3], samples)
  end
  local e = self.exec
  local hist = {}
  for i, le in ipairs(M.BUCKETS) do hist[i] = { ('_bucket{le="%s"}'):format(tostring(le)), e.buckets[i] } end
  hist[#hist + 1] = { '_bucket{le="+Inf"}', e.count }
  hist[#hist + 1] = { "_sum", ("%.6f"):format(e.sum) }
  hist[#hist + 1] = { "_count", e.count }
  metric("moonbox_exec_duration_seconds", "histogram",
    "Time from an exec request (plain or streamed, answered 2xx) to the end of its response.", hist)
  metric("moonbox_exec_total", "counter", "Exec requests answered 2xx (the command ran).", { { nil, e.count } })
  local buffered = server:queued_bytes()
  metric("moonbox_http_buffered_bytes", "gauge", "Response bytes queued for clients.", { { nil, buffered } })
  local budget = require "moonbox.session.budget"
  metric("moonbox_buffered_bytes", "gauge", "Output kept in memory now, runtime-wide (exec, streams, process " ..
    "logs, runCode).", { { nil, budget.used } })
  metric("moonbox_buffered_bytes_limit", "gauge", "The ceiling for that (--max-buffered-bytes, or the " ..
    "default policy's limits.maxBufferedBytes, or a quarter of RAM).",
    { { nil, budget.limit(require("moonbox.policy").resolve(nil).limits.maxBufferedBytes) } })
  local send_budget = require "moonbox.server.send_budget"
  metric("moonbox_client_buffered_bytes", "gauge", "Bytes the HTTP server holds for its clients (queued " ..
    "responses, SSE, WebSocket messages, the port proxy's reads, bodies being sent).", { { nil, send_budget.used } })
  metric("moonbox_client_buffered_bytes_limit", "gauge", "The ceiling for that (--max-buffered-bytes, or 64 MiB); " ..
    "a body that would pass it is answered 503 BUFFERS_FULL.", { { nil, send_budget.limit } })
  local soft, _, fds = util.fd_limits()
  if fds then metric("moonbox_open_fds", "gauge", "Open file descriptors of the runtime.", { { nil, fds } }) end
  if soft and soft < math.huge then
    metric("moonbox_open_fds_limit", "gauge", "The runtime's RLIMIT_NOFILE (soft; raised to the hard limit at start).",
      { { nil, soft } })
  end
  metric("moonbox_http_connections", "gauge", "Open client connections.", { { nil, server:connections() } })
  metric("moonbox_http_requests_in_flight", "gauge", "Requests being answered.", { { nil, server:inflight() } })
  local classes = {}
  for class, n in pairs(self.requests) do classes[#classes + 1] = { ('{code="%s"}'):format(class), n } end
  table.sort(classes, function(a, b) return a[1] < b[1] end)
  metric("moonbox_http_requests_total", "counter", "Requests answered, by status class.", classes)
  local hung_up, accept_failed = server:refused()
  local rej = { { '{reason="accept"}', hung_up }, { '{reason="accept_failed"}', accept_failed } }
  local reasons = {}
  for reason in pairs(self.rejections) do reasons[#reasons + 1] = reason end
  table.sort(reasons)
  for _, reason in ipairs(reasons) do
    rej[#rej + 1] = { ('{reason="%s"}'):format(reason), self.rejections[reason] }
  end
  metric("moonbox_http_rejections_total", "counter",
    "Requests and connections refused, by reason (accept: hung up at accept, past --max-connections " ..
    "and its overflow or while stopping; accept_failed: accepts the kernel refused, out of fds).", rej)
  return table.concat(out)
end

-- ---- idle expiry ---------------------------------------------------------------------

-- Is the sandbox doing anything: a request for it, a running process, an
-- open terminal?
local function busy(self, id, sb)
  if self.active[id] then return true end
  for _, p in pairs(sb.processes or {}) do
    if p.is_running and p:is_running() then return true end
  end
  for t in pairs(sb.terminals or {}) do if terminal_busy(t) then return true end end
  return false
end

-- One sweep: stop every sandbox idle for idleTimeoutS, keeping its files.
function M:sweep()
  local limit = (self.opts.idleTimeoutS or 0) * 1000
  if limit <= 0 then return end
  local now = core.now()
  for id, sb in pairs(sandboxes()) do
    if not self.lastActive[id] then self.lastActive[id] = now end
    if not self.stopping[id] and not busy(self, id, sb) and now - self.lastActive[id] >= limit then
      self.stopping[id] = {}
      async.spawn(function()
        local ok, err = pcall(sb.destroy, sb, { keepFiles = true })
        if ok then
          self.idleStopped = self.idleStopped + 1
        else
          io.stderr:write("moonbox serve: idle stop of ", id, ": ", errors.format(err), "\n")
        end
        local waiters = self.stopping[id]
        self.stopping[id] = nil
        self.lastActive[id] = nil
        for _, w in ipairs(waiters) do w() end
      end)
    end
  end
end

-- Start the idle sweeps (every second at most, a tenth of the timeout).
function M:start_idle()
  local secs = self.opts.idleTimeoutS
  if not secs then return end
  local every = math.max(100, math.min(1000, secs * 100))
  local t = core.timer()
  t:start(every, every, function() self:sweep() end)
  t:unref()
  self.idleTimer = t
end

-- ---- graceful stop -------------------------------------------------------------------

-- stop(server): no new connections; requests in flight get shutdownGraceS
-- to finish; streams still open then get a final event and end, sockets
-- close with 1001. (The caller then stops the sandboxes, keeping their
-- files, closes the server and exits 0.)
function M:stop(server)
  if self.idleTimer and not self.idleTimer:is_closing() then self.idleTimer:close() end
  server:drain()
  local grace = (self.opts.shutdownGraceS or 10) * 1000
  local deadline = core.now() + grace
  while server:inflight() > 0 and core.now() < deadline do async.sleep(50) end
  local final = "data: " .. cjson.encode({ type = "error", error = { code = "SHUTTING_DOWN", httpStatus = 503,
    message = "the server is stopping", context = {} } }) .. "\n\n"
  server:end_streams(final)
  -- let the last bytes out (bounded: a client that does not read is dropped by close)
  local until_ms = core.now() + 2000
  while server:inflight() > 0 and core.now() < until_ms do async.sleep(20) end
end

return M
