-- The /v1 API under load (issue #7's robustness spec): 200 concurrent
-- clients mixing exec and file calls across 20 sandboxes (curl --parallel,
-- 200 connections, in batches) while stream clients (curl) check every event
-- of their exec and log streams, for MOONBOX_LOAD_SECONDS (60 by default),
-- on loopback.
-- Then: no 5xx, no other non-2xx, no lost stream event, and the server's
-- file descriptors and memory back where they were before the load.
local core = require "moonbox.core"
local async = require "moonbox.async"
local moonbox = require "moonbox"
local cjson = require "cjson"
local http = require "moonbox.server.http"
local api = require "moonbox.server.api"
local fs = require "moonbox.lib.fs"
local shell = require "moonbox.session.shell"

local SECONDS = tonumber(os.getenv("MOONBOX_LOAD_SECONDS")) or 60
local SANDBOXES, CONNECTIONS, STREAM_CLIENTS, LINES = 20, 200, 8, 200
local PATH = "/usr/local/bin:/usr/bin:/bin"

-- open fds -> count, and what they are ("pipe=12 socket=1 ...") for a failure message;
-- counted with the shells' hot set (session/shell.lua: up to 3 fds for each
-- of the shells that ran last, a bounded cache) emptied, so that only a leak
-- can differ
local function fds()
  local hot = shell.hot_size(0)
  shell.hot_size(hot)
  local kinds, names = {}, assert(core.readdir("/proc/self/fd"))
  for _, fd in ipairs(names) do
    local target = (fs.readlink("/proc/self/fd/" .. fd) or "?"):gsub("%[.*", "")
    kinds[target] = (kinds[target] or 0) + 1
  end
  local parts = {}
  for k, v in pairs(kinds) do parts[#parts + 1] = k .. "=" .. v end
  table.sort(parts)
  return #names, table.concat(parts, " ")
end

local function rss_bytes()
  local f = assert(io.open("/proc/self/statm"))
  local pages = tonumber(f:read("*a"):match("^%d+ (%d+)"))
  f:close()
  return pages * 4096
end

-- run(argv) -> stdout, exit code; on the loop (the server answers on it too)
local function run(args)
  local exit = {}
  local proc, pipes = core.spawn {
    args = args, env = { PATH = PATH }, stdio = { [0] = "null", [1] = "pipe", [2] = "null" },
    on_exit = function(code)
      exit.code = code
      if exit.resume then exit.resume() end
    end,
  }
  assert(proc, pipes)
  local out = helper.read_all(pipes[1])
  pipes[1]:close()
  if exit.code == nil then async.await(function(resume) exit.resume = resume end) end
  return out, exit.code
end

-- A curl config of `count` requests cycling over sandboxes and kinds (exec
-- in either session, file writes, lists and checks), each printing its status.
local function batch_config(ids, url, first, count)
  local out = {}
  for n = first, first + count - 1 do
    local base = url .. "/v1/sandboxes/" .. ids[n % #ids + 1]
    local kind = math.floor(n / #ids) % 5
    local path, body = "/exec", { command = "true" }
    if kind == 1 then
      body = { command = "echo hi", sessionId = "s" }
    elseif kind == 2 then
      path, body = "/files/write", { path = "f" .. (n % 40) .. ".txt", content = "payload " .. n }
    elseif kind == 3 then
      path, body = "/files/list", { path = "/workspace" }
    elseif kind == 4 then
      path, body = "/files/exists", { path = "f1.txt", sessionId = "s" }
    end
    out[#out + 1] = ('url = "%s%s"\nrequest = "POST"\ndata = %q\noutput = "/dev/null"\n' ..
      'write-out = "%%{http_code}\\n"\n'):format(base, path, cjson.encode(body))
  end
  local file = os.tmpname()
  local f = assert(io.open(file, "w"))
  f:write(table.concat(out, "next\n"))
  f:close()
  return file
end

-- CONNECTIONS clients at once: curl --parallel in batches until the deadline.
local function request_clients(ids, url, deadline, tally)
  local n = 0
  while core.hrtime() / 1e6 < deadline do
    local config = batch_config(ids, url, n, 4 * CONNECTIONS)
    n = n + 4 * CONNECTIONS
    local out = run { "curl", "-sS", "--parallel", "--parallel-immediate", "--parallel-max", tostring(CONNECTIONS),
      "--max-time", "60", "-K", config }
    os.remove(config)
    for code in out:gmatch("(%d+)\n") do
      code = tonumber(code)
      if code >= 200 and code < 300 then tally.ok = tally.ok + 1
      elseif code >= 500 then tally.fivexx = tally.fivexx + 1
      else tally.other = tally.other + 1 tally.codes[code] = true end -- 000: no response at all
    end
  end
end

-- One stream client: until the deadline, alternate an exec stream and a
-- log stream of a process printing LINES lines; every event must arrive.
local function stream_client(url, index, deadline, tally)
  local base = url .. "/v1/sandboxes/" .. ("load-%d-%d"):format(core.getpid(), index % SANDBOXES + 1)
  local cmd = ("for i in $(seq 1 %d); do echo line$i; done"):format(LINES)
  local round = 0
  while core.hrtime() / 1e6 < deadline do
    round = round + 1
    local out
    if round % 2 == 1 then
      out = run { "curl", "-sS", "-N", "--max-time", "120", "-X", "POST", "--data-binary",
        cjson.encode { command = cmd }, base .. "/exec/stream" }
    else
      local pid = "logs-" .. index
      run { "curl", "-sS", "--max-time", "120", "-X", "POST", "--data-binary",
        cjson.encode { command = cmd, processId = pid }, base .. "/processes" }
      out = run { "curl", "-sS", "-N", "--max-time", "120", base .. "/processes/" .. pid .. "/logs/stream" }
    end
    local text, ends = {}, 0
    for data in out:gmatch("data: ([^\n]*)\n\n") do
      local ev = cjson.decode(data)
      if ev.type == "stdout" then text[#text + 1] = ev.data end
      if (ev.type == "complete" or ev.type == "exit") and ev.exitCode == 0 then ends = ends + 1 end
    end
    local lines = 0
    for line in table.concat(text):gmatch("([^\n]*)\n") do
      if line == "line" .. (lines + 1) then lines = lines + 1 end
    end
    tally.streams = tally.streams + 1
    if lines ~= LINES or ends ~= 1 then
      tally.broken = tally.broken + 1
      tally.sample = tally.sample or out:sub(1, 600)
    end
  end
end

describe("http api under load", function()
  it(("serves %d clients across %d sandboxes for %d s without a 5xx, a lost event or a leak"):format(
    CONNECTIONS, SANDBOXES, SECONDS), function()
    local home = helper.mkdtemp()
    api.configure { home = home }
    run_task(function()
      local server = http.listen({ listen = "127.0.0.1:0", maxConnections = CONNECTIONS + STREAM_CLIENTS + 16 },
        api.handle)
      local url = "http://" .. server.address
      local ids = {}
      for i = 1, SANDBOXES do
        ids[i] = ("load-%d-%d"):format(core.getpid(), i)
        -- both sessions the load uses exist before the baseline is taken
        local _, code = run { "curl", "-sS", "-f", "-X", "POST", "--data-binary", '{"id":"s"}',
          url .. "/v1/sandboxes/" .. ids[i] .. "/sessions" }
        assert.equal(0, code)
        _, code = run { "curl", "-sS", "-f", "-X", "POST", "--data-binary", '{"command":"true"}',
          url .. "/v1/sandboxes/" .. ids[i] .. "/exec" }
        assert.equal(0, code)
      end
      moonbox.sleep(300) -- spare shells and lazily opened things settle first
      collectgarbage()
      collectgarbage()
      local fds_before, fd_kinds_before = fds()
      local rss_before, heap_before = rss_bytes(), collectgarbage("count")

      local deadline = core.hrtime() / 1e6 + SECONDS * 1000
      local tally = { streams = 0, broken = 0, ok = 0, fivexx = 0, other = 0, codes = {} }
      local peak = 0
      local clients = {
        function() request_clients(ids, url, deadline, tally) end,
        function() -- how many connections were open at once
          while core.hrtime() / 1e6 < deadline do
            peak = math.max(peak, server:connections())
            moonbox.sleep(20)
          end
        end,
      }
      for i = 1, STREAM_CLIENTS do
        clients[#clients + 1] = function() stream_client(url, i, deadline, tally) end
      end
      moonbox.all(clients)
      local codes = {}
      for code in pairs(tally.codes) do codes[#codes + 1] = code end
      assert.equal(0, tally.fivexx)
      assert.equal(0, tally.other, "statuses: " .. table.concat(codes, ", "))
      assert.is_true(tally.ok > 0)
      assert.is_true(peak >= CONNECTIONS / 2, "at most " .. peak .. " connections at once")
      assert.is_true(tally.streams >= STREAM_CLIENTS)
      assert.equal(0, tally.broken, tally.sample)

      -- after: every connection closed, every request task done
      for _ = 1, 500 do
        if server:connections() == 0 and async.pending() == 1 then break end
        moonbox.sleep(10)
      end
      assert.equal(0, server:connections())
      moonbox.sleep(300)
      collectgarbage()
      collectgarbage()
      local fds_after, fd_kinds_after = fds()
      local rss_after, heap_after = rss_bytes(), collectgarbage("count")
      io.stderr:write(("\nload: %d requests, %d streams, peak %d connections; fds %d -> %d, " ..
        "RSS %.1f -> %.1f MB, Lua heap %.1f -> %.1f MB\n")
        :format(tally.ok, tally.streams, peak, fds_before, fds_after, rss_before / 2 ^ 20, rss_after / 2 ^ 20,
          heap_before / 1024, heap_after / 1024))
      assert.equal(fds_before, fds_after, fd_kinds_before .. "\n" .. fd_kinds_after)
      assert.is_true(heap_after - heap_before < 16 * 1024, "Lua heap grew by " .. (heap_after - heap_before) .. " KB")
      assert.is_true(rss_after - rss_before < 64 * 2 ^ 20, "RSS grew by " .. (rss_after - rss_before) .. " bytes")

      for _, id in ipairs(ids) do moonbox.getSandbox(id):destroy() end
      server:close()
    end)
  end)
end)
