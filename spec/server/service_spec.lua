-- `moonbox serve` as a service (issue #18): GET /metrics, the access log,
-- 503 past --max-connections, --max-sandboxes, idle expiry and the graceful
-- SIGTERM, each against the real binary.
local moonbox = require "moonbox"
local core = require "moonbox.core"
local cjson = require "cjson"
local client = require "server.client"

local curl = client.curl

-- serve(args[, wrapper]) -> {url, port, token, home, stop() -> exit code, stderr()}
-- (wrapper: a command the server runs under, e.g. {"prlimit", "--nofile=64"})
local function serve(args, wrapper)
  local bin = os.getenv("MOONBOX_BIN") or "build/moonbox"
  local home = helper.mkdtemp()
  local exit, err = {}, { buf = "" }
  local argv = {}
  for _, a in ipairs(wrapper or {}) do argv[#argv + 1] = a end
  for _, a in ipairs { bin, "serve", "--listen", "127.0.0.1:0" } do argv[#argv + 1] = a end
  for _, a in ipairs(args or {}) do argv[#argv + 1] = a end
  local proc, pipes = assert(core.spawn {
    args = argv, env = client.env { HOME = home, MOONBOX_HOME = home },
    stdio = { [0] = "null", [1] = "pipe", [2] = "pipe" },
    on_exit = function(c) exit.code = c if exit.resume then exit.resume() end end,
  })
  pipes[2]:read_start(function(_, data) if data then err.buf = err.buf .. data end end)
  local text = moonbox.timeout(10000, function()
    local buf = ""
    return require("moonbox.async").await(function(resume)
      pipes[1]:read_start(function(_, data)
        buf = buf .. (data or "")
        if buf:match("moonbox: open [^\n]*\n") or not data then pipes[1]:read_stop() resume(buf) end
      end)
    end)
  end)
  local s = { url = text:match("listening on (%S+)"), token = text:match("/%?token=(%x+)"), home = home, proc = proc }
  assert(s.url and s.token, "the server printed no address and token: " .. text .. err.buf)
  s.port = tonumber(s.url:match(":(%d+)$"))
  s.auth = "Authorization: Bearer " .. s.token
  function s.stop(signal)
    if exit.code == nil then proc:kill(signal or "SIGTERM") end
    if exit.code == nil then require("moonbox.async").await(function(resume) exit.resume = resume end) end
    pipes[1]:close()
    pipes[2]:close()
    helper.sh("rm -rf '" .. home .. "'")
    return exit.code
  end
  function s.wait_exit()
    if exit.code == nil then
      moonbox.timeout(30000, function()
        require("moonbox.async").await(function(resume) exit.resume = resume end)
      end)
    end
    return exit.code
  end
  function s.stderr() return err.buf end
  -- the /metrics text, once the server answers it (after a flood of connections)
  function s.metrics()
    local body
    assert.is_true(helper.eventually(function()
      local code, t = s.call("GET", "/metrics")
      body = t
      return code == 200
    end))
    return body
  end
  -- status, body of a request with the token
  function s.call(method, path, body)
    local argv2 = { "-o", "-", "-w", "\n%{http_code}", "-H", s.auth, "-X", method }
    if body then
      argv2[#argv2 + 1] = "--data-binary"
      argv2[#argv2 + 1] = body
    end
    argv2[#argv2 + 1] = s.url .. path
    local out = curl(unpack(argv2))
    local b, code = out:match("^(.*)\n(%d+)$")
    return tonumber(code), b
  end
  return s
end

-- The value of one sample line of the Prometheus text.
-- A kept file of a stopped server's sandbox, read through a runtime of its
-- own: the server's exit unmounted the sandbox's disk image (as root), and
-- getSandbox of the same root in the same home mounts it again.
local function kept_file(s, id, path)
  local bin = os.getenv("MOONBOX_BIN") or "build/moonbox"
  local script = s.home .. "/read-kept.lua"
  local f = assert(io.open(script, "w"))
  f:write(("io.write(require('moonbox').getSandbox(%q, { root = %q }):readFile(%q).content)")
    :format(id, s.home .. "/sandboxes/" .. id, path))
  f:close()
  -- (stderr apart: the sanitizers' build writes its warnings there). The
  -- runtime that kept it has exited, but its sandbox's init dies of that a
  -- moment later (parent-death signal) and holds the root's lock until then:
  -- a read that finds it still locked is tried again, for up to 5 s.
  local cmd = ("MOONBOX_HOME='%s' HOME='%s' '%s' '%s'"):format(s.home, s.home, bin, script)
  local out
  helper.eventually(function()
    out = helper.sh(cmd .. " 2>/dev/null || true")
    return out ~= ""
  end, 5000)
  if out == "" then return helper.sh(cmd .. " 2>&1 || true") end
  return out
end

local function sample(text, name)
  for line in text:gmatch("[^\n]+") do
    local n, v = line:match("^(%S+) (%S+)$")
    if n == name then return tonumber(v) end
  end
end

-- A client of s that asks sandbox id's /exec for 16 MiB of output and reads
-- none of it, once the server holds at least min_used bytes for clients
-- (/metrics): its stream, for the caller to close.
local function hold_unread_result(s, id, min_used)
  local fd = require("moonbox.async").await(function(resume)
    assert(core.tcp_connect("127.0.0.1", s.port, function(e, f) resume(f, e) end))
  end)
  local stream = assert(core.stream_open(fd))
  local body = cjson.encode { command = "head -c 16777216 /dev/zero | tr '\\0' a" }
  stream:write(("POST /v1/sandboxes/%s/exec HTTP/1.1\r\nHost: x\r\n%s\r\nContent-Type: application/json\r\n" ..
    "Content-Length: %d\r\n\r\n%s"):format(id, s.auth, #body, body))
  local used
  assert.is_true(helper.eventually(function()
    local _, t = s.call("GET", "/metrics")
    used = sample(t, "moonbox_client_buffered_bytes")
    return (used or 0) >= min_used
  end, 20000), "the unread result is not held: " .. tostring(used))
  return stream
end

-- The processes running cmd (pgrep -f ^cmd$), with what ps says of each: ""
-- when none. (The specs name their commands after their server's port:
-- another run of this spec beside this one, as in CI, runs its own.)
local function survivors(cmd)
  local pids = helper.sh("pgrep -f '^" .. cmd .. "$' || true")
  if pids == "" then return "" end
  return pids .. "\n" .. helper.sh("ps -o pid,ppid,stat,etime,args -p '" .. pids:gsub("%s+", ",") .. "' 2>&1 || true")
end

-- A raw request with the token on a new connection.
local function raw_request(s, method, path, body)
  local c = client.connect(s.port)
  c:send(("%s %s HTTP/1.1\r\nHost: x\r\n%s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s")
    :format(method, path, s.auth, #(body or ""), body or ""))
  return c
end

describe("moonbox serve as a service", function()
  it("serves GET /metrics behind the token, in Prometheus text", function()
    run_task(function()
      local s = serve {}
      local ok, err = pcall(function()
        local no = curl("-o", "/dev/null", "-w", "%{http_code}", s.url .. "/metrics")
        assert.equal("401", no)
        assert.equal(200, (s.call("POST", "/v1/sandboxes/m1/exec", '{"command":"echo hi"}')))
        assert.equal(200, (s.call("POST", "/v1/sandboxes/m1/exec", '{"command":"true"}')))
        assert.equal(200, (s.call("POST", "/v1/sandboxes/m1/processes", '{"command":"sleep 600"}')))
        assert.equal(200, (s.call("POST", "/v1/sandboxes/m1/sessions", '{"id":"second"}')))
        local out = curl("-i", "-H", s.auth, s.url .. "/metrics")
        local head, text = out:match("^(.-)\r\n\r\n(.*)$")
        assert.matches("\r\ncontent%-type: text/plain; version=0%.0%.4", head)
        assert.matches("# TYPE moonbox_exec_duration_seconds histogram\n", text)
        assert.equal(1, sample(text, "moonbox_sandboxes"))
        assert.equal(2, sample(text, "moonbox_sessions"))
        assert.equal(1, sample(text, "moonbox_processes"))
        assert.equal(0, sample(text, "moonbox_terminals"))
        assert.equal(0, sample(text, "moonbox_code_contexts"))
        assert.equal(2, sample(text, "moonbox_exec_total"))
        assert.equal(2, sample(text, "moonbox_exec_duration_seconds_count"))
        assert.equal(2, sample(text, 'moonbox_exec_duration_seconds_bucket{le="+Inf"}'))
        assert.truthy(sample(text, "moonbox_open_fds") > 3)
        assert.equal(1, sample(text, "moonbox_http_connections"))
        assert.equal(1, sample(text, "moonbox_http_requests_in_flight")) -- this one
        assert.truthy(sample(text, 'moonbox_http_rejections_total{reason="unauthorized"}') >= 1)
        assert.equal(0, sample(text, 'moonbox_http_rejections_total{reason="accept"}'))
        -- every reason reads 0 before it first moves (a series that appears
        -- later reads as a counter reset)
        for _, reason in ipairs { "accept_failed", "max_connections", "shutting_down", "max_sandboxes" } do
          assert.equal(0, sample(text, ('moonbox_http_rejections_total{reason="%s"}'):format(reason)), reason)
        end
        assert.truthy(sample(text, "moonbox_open_fds_limit") >= sample(text, "moonbox_open_fds"))
        local post = curl("-s", "-X", "POST", "-H", s.auth, s.url .. "/metrics")
        assert.matches("GET or HEAD only", post)
        assert.truthy(sample(text, "moonbox_http_buffered_bytes"))
        -- every sample line is "name{labels} number"
        for line in text:gmatch("[^\n]+") do
          if not line:match("^#") then assert.matches("^[%w_]+[^ ]* %-?[%d%.e%+]+$", line) end
        end
      end)
      s.stop()
      assert(ok, err)
    end)
  end)

  it("cancels a plain exec whose client hung up: its command is killed, the session answers, the log says 499",
    function()
      run_task(function()
        local s = serve {}
        local ok, err = pcall(function()
          assert.equal(200, (s.call("POST", "/v1/sandboxes/gone-box/exec", '{"command":"true"}')))
          local c = raw_request(s, "POST", "/v1/sandboxes/gone-box/exec",
            '{"command":"sleep 31; echo ran > /workspace/after"}')
          assert.is_true(helper.eventually(function()
            return s.stderr():match('"status":') ~= nil -- (the first exec's line: the log is live)
          end))
          moonbox.sleep(300) -- the command runs
          c:close()
          -- no session stuck behind the result nobody reads: the next call
          -- runs at once, and nothing of the first command is left
          local status, body = s.call("POST", "/v1/sandboxes/gone-box/exec",
            '{"command":"pgrep -x sleep || echo none; ls /workspace"}')
          assert.equal(200, status)
          assert.equal("none\n", cjson.decode(body).stdout)
          assert.is_true(helper.eventually(function() return s.stderr():match('"status":499') ~= nil end))
        end)
        s.stop()
        assert(ok, err)
      end)
    end)

  it("lets a plain runCode whose client hung up finish in its context: the context's state is kept", function()
    run_task(function()
      local s = serve {}
      local ok, err = pcall(function()
        local function code(text) return cjson.encode { context = "kept", code = text } end
        assert.equal(200, (s.call("POST", "/v1/sandboxes/code-gone/contexts", '{"id":"kept","language":"python"}')))
        assert.equal(200, (s.call("POST", "/v1/sandboxes/code-gone/code", code("base = 1"))))
        local c = raw_request(s, "POST", "/v1/sandboxes/code-gone/code",
          code("import time\nopen('/workspace/started', 'w').close()\ntime.sleep(0.5)\nlater = 7"))
        assert.is_true(helper.eventually(function()
          local _, b = s.call("POST", "/v1/sandboxes/code-gone/files/exists", '{"path":"/workspace/started"}')
          return b and cjson.decode(b).exists
        end))
        c:close()
        -- the next run waits for that one, then sees both variables
        local status, body = s.call("POST", "/v1/sandboxes/code-gone/code", code("base + later"))
        assert.equal(200, status)
        assert.equal("8", cjson.decode(body).results[1].text)
      end)
      s.stop()
      assert(ok, err)
    end)
  end)

  it("writes one JSON line per request to stderr, or to --access-log FILE, or nowhere with off", function()
    run_task(function()
      local s = serve {}
      local dir = helper.mkdtemp()
      local f = serve { "--access-log", dir .. "/access.log" }
      local off = serve { "--access-log", "off" }
      local ok, err = pcall(function()
        local _, body = s.call("POST", "/v1/sandboxes/log-box/exec", '{"command":"echo hi"}')
        s.call("GET", "/v1/sandboxes/log-box/sessions/nope")
        f.call("GET", "/v1/sandboxes/other/processes")
        off.call("GET", "/v1/sandboxes")
        local lines = {}
        assert.is_true(helper.eventually(function()
          lines = {}
          for line in s.stderr():gmatch("[^\n]+") do
            if line:match("^{") then lines[#lines + 1] = cjson.decode(line) end
          end
          return #lines >= 2
        end))
        local a, b = lines[1], lines[2]
        assert.equal("POST", a.method)
        assert.equal("/v1/sandboxes/{id}/exec", a.route)
        assert.equal("log-box", a.sandboxId)
        assert.equal(200, a.status)
        assert.equal(#body, a.bytes)
        assert.equal("number", type(a.durationMs))
        assert.matches("^%d%d%d%d%-%d%d%-%d%dT%d%d:%d%d:%d%d%.%d%d%dZ$", a.time)
        assert.equal("string", type(a.requestId))
        assert.are_not.equal(a.requestId, b.requestId)
        assert.equal("/v1/sandboxes/{id}/sessions/{sessionId}", b.route) -- the template, not "nope"
        assert.equal(404, b.status)
        local file = ""
        assert.is_true(helper.eventually(function()
          file = helper.sh("cat '" .. dir .. "/access.log'")
          return file ~= ""
        end))
        local c = cjson.decode(file)
        assert.equal("/v1/sandboxes/{id}/processes", c.route)
        assert.equal(404, c.status) -- a read never creates the sandbox
        assert.not_matches('"route"', f.stderr())
        -- heads the server answers itself, before any request is made of
        -- them (a smuggling-shaped head, one too large), are logged too
        local c1 = client.connect(s.port)
        c1:send("GET /v1/sandboxes HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\nx")
        assert.equal(400, (c1:response()))
        c1:close()
        local c2 = client.connect(s.port)
        c2:send("GET /v1/sandboxes HTTP/1.1\r\nHost: x\r\nX-Big: " .. ("a"):rep(9000) .. "\r\n\r\n")
        assert.equal(431, (c2:response()))
        c2:close()
        local refused = {}
        assert.is_true(helper.eventually(function()
          refused = {}
          for line in s.stderr():gmatch("[^\n]+") do
            if line:match('^{.*"status":4[03]') then
              local l = cjson.decode(line)
              if l.status == 400 or l.status == 431 then refused[#refused + 1] = l end
            end
          end
          return #refused >= 2
        end))
        assert.same({ 400, 431 }, { refused[1].status, refused[2].status })
        assert.equal(cjson.null, refused[1].route)
        assert.equal("string", type(refused[1].requestId))
      end)
      s.stop()
      f.stop()
      off.stop()
      assert.not_matches('"route"', off.stderr())
      helper.sh("rm -rf '" .. dir .. "'")
      assert(ok, err)
    end)
  end)

  it("answers 503 with Retry-After past --max-connections, and counts it", function()
    run_task(function()
      local s = serve { "--max-connections", "2" }
      local ok, err = pcall(function()
        local held = { client.connect(s.port), client.connect(s.port) }
        -- both are the server's before the third comes
        local c
        local status, headers, body
        assert.is_true(helper.eventually(function()
          if c then c:close() end
          c = raw_request(s, "GET", "/v1/sandboxes")
          status, headers, body = c:response()
          return status == 503
        end))
        assert.equal("1", headers["retry-after"])
        assert.equal("close", headers["connection"])
        local e = cjson.decode(body)
        assert.equal("TOO_MANY_CONNECTIONS", e.code)
        assert.equal("max_connections", e.context.reason)
        assert.is_true(c:wait_eof())
        c:close()
        -- the probes are still answered (a liveness probe's 503 would restart
        -- a busy pod), each on a connection that then closes
        for _, path in ipairs { "/healthz", "/readyz" } do
          c = client.connect(s.port)
          c:send(("GET %s HTTP/1.1\r\nHost: x\r\n\r\n"):format(path))
          assert.equal(200, (c:response()), path)
          assert.is_true(c:wait_eof())
          c:close()
        end
        for _, h in ipairs(held) do h:close() end
        local text = s.metrics()
        assert.truthy(sample(text, 'moonbox_http_rejections_total{reason="max_connections"}') >= 1)
      end)
      s.stop()
      assert(ok, err)
    end)
  end)

  it("out of fds, pauses accepting instead of spinning on it: counted, one line on stderr, serving once fds free",
    function()
      run_task(function()
        -- (a plain accept loop would retry the failed accept at once, for ever: a full
        -- CPU and a line on stderr each time)
        local s = serve({ "--prewarm", "off", "--access-log", "off" }, { "prlimit", "--nofile=64", "--" })
        local ok, err = pcall(function()
          local held = {}
          for i = 1, 80 do held[i] = client.connect(s.port) end
          moonbox.sleep(1500)
          for _, h in ipairs(held) do h:close() end
          local text = s.metrics()
          assert.truthy(sample(text, 'moonbox_http_rejections_total{reason="accept_failed"}') >= 1, text)
          local _, lines = s.stderr():gsub("accept: ", "")
          assert.truthy(lines >= 1 and lines <= 3, s.stderr():sub(1, 2000))
          assert.matches("not accepting for 100 ms at a time", s.stderr())
        end)
        s.stop()
        assert(ok, err)
      end)
    end)

  it("refuses a write that would make sandbox N+1 past --max-sandboxes with 403 POLICY_DENIED", function()
    run_task(function()
      local s = serve { "--max-sandboxes", "1" }
      local ok, err = pcall(function()
        assert.equal('200 {"status":"ready"}\n', curl("-s", "-w", "%{http_code}", "-o", "/dev/null", s.url .. "/readyz")
          .. " " .. curl("-s", s.url .. "/readyz"))
        assert.equal(200, (s.call("POST", "/v1/sandboxes/one/exec", '{"command":"true"}')))
        -- full: not ready to make a sandbox (the one it holds still answers)
        local rbody = curl("-s", "-w", "\n%{http_code}", s.url .. "/readyz")
        assert.equal('{"status":"not ready","reason":"max_sandboxes"}\n\n503', rbody)
        assert.equal('{"status":"ok"}\n', curl("-s", s.url .. "/healthz"))
        local code, body = s.call("POST", "/v1/sandboxes/two/exec", '{"command":"true"}')
        assert.equal(403, code)
        local e = cjson.decode(body)
        assert.equal("POLICY_DENIED", e.code)
        assert.equal(1, e.context.maxSandboxes)
        assert.equal(200, (s.call("POST", "/v1/sandboxes/one/exec", '{"command":"true"}'))) -- the one it holds
        local _, text = s.call("GET", "/metrics")
        assert.equal(1, sample(text, 'moonbox_http_rejections_total{reason="max_sandboxes"}'))
      end)
      s.stop()
      assert(ok, err)
      local bin = os.getenv("MOONBOX_BIN") or "build/moonbox"
      local _, stderr, code = client.run { bin, "serve", "--max-sandboxes", "0" }
      assert.equal(2, code)
      assert.matches("%-%-max%-sandboxes needs a positive integer", stderr)
    end)
  end)

  it("--max-buffered-bytes sets the runtime-wide ceiling for kept output and for bytes held for clients, " ..
    "reported in /metrics", function()
    run_task(function()
      local s = serve { "--max-buffered-bytes", "1000" }
      local ok, err = pcall(function()
        local code, body = s.call("POST", "/v1/sandboxes/b1/exec",
          cjson.encode { command = "head -c 3000 /dev/zero | tr '\\0' a" })
        assert.equal(200, code)
        local r = cjson.decode(body)
        assert.is_true(r.truncated)
        assert.equal(("a"):rep(1000), r.stdout)
        local _, text = s.call("GET", "/metrics")
        assert.equal(1000, sample(text, "moonbox_buffered_bytes_limit"))
        assert.equal(0, sample(text, "moonbox_buffered_bytes")) -- handed over: all of it back
        -- an exited process's log holds its bytes while its record lives
        assert.equal(200, (s.call("POST", "/v1/sandboxes/b1/processes",
          cjson.encode { command = "head -c 300 /dev/zero | tr '\\0' z" })))
        assert.is_true(helper.eventually(function()
          local _, t = s.call("GET", "/metrics")
          return sample(t, "moonbox_buffered_bytes") == 300
        end, 10000))
        code, body = s.call("POST", "/v1/sandboxes/b1/exec",
          cjson.encode { command = "head -c 1000 /dev/zero | tr '\\0' b" })
        assert.equal(200, code)
        assert.equal(("b"):rep(700), cjson.decode(body).stdout)
        -- a response body larger than the whole ceiling of bytes held for
        -- clients goes out when nothing else is held (refused, it could
        -- never be sent: "retry later" for ever); past the ceiling with
        -- other bytes held it is refused, below
        assert.equal(1000, sample(text, "moonbox_client_buffered_bytes_limit"))
        local big = ("c"):rep(80 * 1024)
        assert.equal(200, (s.call("POST", "/v1/sandboxes/b1/files/write",
          cjson.encode { path = "/workspace/big.txt", content = big })))
        code, body = s.call("POST", "/v1/sandboxes/b1/files/read", cjson.encode { path = "/workspace/big.txt" })
        assert.equal(200, code)
        assert.equal(big, cjson.decode(body).content)
        _, text = s.call("GET", "/metrics")
        assert.equal(0, sample(text, "moonbox_client_buffered_bytes"))
      end)
      s.stop()
      assert(ok, err)
      local bin = os.getenv("MOONBOX_BIN") or "build/moonbox"
      local _, stderr, code = client.run { bin, "serve", "--max-buffered-bytes", "0" }
      assert.equal(2, code)
      assert.matches("%-%-max%-buffered%-bytes needs a positive integer", stderr)
    end)
  end)

  it("past --max-buffered-bytes, a big body is refused (503 BUFFERS_FULL, Retry-After), an /exec keeps 64 KiB " ..
    "of output", function()
    run_task(function()
      local MB = 1024 * 1024
      -- (16 MiB: more than the kernel's socket buffers take off the server)
      local s = serve { "--max-buffered-bytes", tostring(16 * MB + 4096) }
      local hold
      local ok, err = pcall(function()
        assert.equal(200, (s.call("POST", "/v1/sandboxes/bf/exec", '{"command":"true"}')))
        -- a client that asks for 16 MiB of output and reads none of it: the
        -- server holds the result (and a queue) for it, past the limit
        hold = hold_unread_result(s, "bf", 16 * MB + 4096)
        -- the budget spent: a command still runs and its small result is
        -- whole; of a big one only the first 64 KiB are kept
        local code, text = s.call("POST", "/v1/sandboxes/bf/exec", '{"command":"touch /workspace/ran; echo ok"}')
        assert.equal(200, code)
        assert.same({ "ok\n", false }, { cjson.decode(text).stdout, cjson.decode(text).truncated })
        code, text = s.call("POST", "/v1/sandboxes/bf/exec",
          cjson.encode { command = "head -c 1048576 /dev/zero | tr '\\0' d" })
        assert.equal(200, code)
        local e = cjson.decode(text)
        assert.same({ 64 * 1024, true }, { #e.stdout, e.truncated })
        -- a response body the budget cannot take while another client's
        -- bytes are held is refused, with its code and the budget's numbers
        assert.equal(200, (s.call("POST", "/v1/sandboxes/bf/files/write",
          cjson.encode { path = "/workspace/big.txt", content = ("c"):rep(80 * 1024) })))
        local head = curl("-D", "-", "-H", s.auth, "-H", "Content-Type: application/json",
          "-d", '{"path":"/workspace/big.txt"}', s.url .. "/v1/sandboxes/bf/files/read")
        assert.matches("^HTTP/1.1 503", head)
        assert.matches("\n[Rr]etry%-[Aa]fter: 1\r", head)
        local refused = cjson.decode(head:match("\r\n\r\n(.*)$"))
        assert.same({ "BUFFERS_FULL", 503, 16 * MB + 4096 },
          { refused.code, refused.httpStatus, refused.context.limit })
        assert.is_true(refused.context.used > 0)
        hold:close()
        hold = nil
        assert.is_true(helper.eventually(function()
          local _, t = s.call("GET", "/metrics")
          return sample(t, "moonbox_client_buffered_bytes") == 0
        end, 20000), "the closed client's bytes were not given back")
      end)
      if hold then hold:close() end
      s.stop()
      assert(ok, err)
    end)
  end)

  it("keeps an /exec's output only while it fits the bytes held for clients: past them it is truncated, " ..
    "never collected only to be refused", function()
    run_task(function()
      local MB = 1024 * 1024
      local LIMIT = 20 * MB
      local s = serve { "--max-buffered-bytes", tostring(LIMIT) }
      local hold
      local ok, err = pcall(function()
        assert.equal(200, (s.call("POST", "/v1/sandboxes/bk/exec", '{"command":"true"}')))
        -- a client that reads none of a 16 MiB result holds its bytes
        hold = hold_unread_result(s, "bk", 16 * MB)
        -- 8 MiB more would pass the limit: what fits is kept, the rest
        -- dropped, and the answer is the result (it ran once), not a 503
        local code, text = s.call("POST", "/v1/sandboxes/bk/exec",
          cjson.encode { command = "head -c 8388608 /dev/zero | tr '\\0' b; exit 4" })
        assert.equal(200, code, text)
        local r = cjson.decode(text)
        assert.same({ 4, true }, { r.exitCode, r.truncated })
        assert.is_true(#r.stdout > 0 and #r.stdout <= LIMIT - 16 * MB + 64 * 1024, "kept " .. #r.stdout)
        assert.equal(("b"):rep(#r.stdout), r.stdout)
      end)
      if hold then hold:close() end
      s.stop()
      assert(ok, err)
    end)
  end)

  it("stops an idle sandbox keeping its workspace; it comes back on the next request; a busy one stays", function()
    run_task(function()
      local s = serve { "--idle-timeout-s", "1" }
      local ok, err = pcall(function()
        -- busy: a background process keeps it (made first, so it is the older)
        assert.equal(200, (s.call("POST", "/v1/sandboxes/busy/processes", '{"command":"sleep 600"}')))
        assert.equal(200, (s.call("POST", "/v1/sandboxes/idle/exec", '{"command":"echo kept > note"}')))
        local list
        assert.is_true(helper.eventually(function()
          local _, body = s.call("GET", "/v1/sandboxes")
          list = cjson.decode(body)
          return #list == 1
        end, 20000), "the idle sandbox was not stopped")
        assert.equal("busy", list[1].id)
        local _, text = s.call("GET", "/metrics")
        assert.equal(1, sample(text, "moonbox_sandboxes_idle_stopped_total"))
        -- its files stay on disk, and the next request brings it back with them
        assert.equal("kept", helper.sh("cat '" .. s.home .. "/sandboxes/idle/workspace/note'"))
        local code, body = s.call("POST", "/v1/sandboxes/idle/exec", '{"command":"cat note"}')
        assert.equal(200, code)
        assert.equal("kept\n", cjson.decode(body).stdout)
        -- a read of a stopped sandbox on disk brings it back too
        assert.is_true(helper.eventually(function()
          local _, b = s.call("GET", "/v1/sandboxes")
          return #cjson.decode(b) == 1
        end, 20000))
        assert.equal(200, (s.call("GET", "/v1/sandboxes/idle/sessions")))
      end)
      s.stop()
      assert(ok, err)
    end)
  end)

  it("idle expiry: a terminal at its prompt with no socket does not keep its sandbox, one running a command does",
    function()
      run_task(function()
        local s = serve { "--idle-timeout-s", "1" }
        local ok, err = pcall(function()
          local ws = s.url:gsub("^http:", "ws:")
          local function term(id, steps)
            client.ws_client(("%s/v1/sandboxes/%s/sessions/default/terminal?access_token=%s"):format(ws, id, s.token),
              steps)
          end
          term("t-busy", { { expect = '"type":"ready"' }, { binary = "sleep 600\n" }, { close = 1000 } })
          -- (its shell names itself to look, in /proc/<pid>/stat, as if another group held the pty)
          term("t-idle", { { expect = '"type":"ready"' },
            { binary = "printf ') S 1 1 1 1 1' > /proc/$$/comm; echo hi\n" }, { expect = "hi" }, { close = 1000 } })
          local list
          assert.is_true(helper.eventually(function()
            local _, body = s.call("GET", "/v1/sandboxes")
            list = cjson.decode(body)
            return #list == 1
          end, 20000), "the sandbox with an idle terminal was not stopped" .. s.stderr():sub(-1500))
          assert.equal("t-busy", list[1].id)
        end)
        s.stop()
        assert(ok, err)
      end)
    end)

  it("SIGTERM: lets a running stream finish, refuses new requests, keeps workspaces, exits 0", function()
    run_task(function()
      local s = serve { "--shutdown-grace-s", "60" }
      local root = s.home .. "/sandboxes/graceful/workspace"
      local ok, err = pcall(function()
        assert.equal(200, (s.call("POST", "/v1/sandboxes/graceful/exec", '{"command":"echo kept > note"}')))
        helper.sh("mkfifo '" .. root .. "/gate'")
        local c = raw_request(s, "POST", "/v1/sandboxes/graceful/exec/stream",
          '{"command":"read line < gate; echo finished $line"}')
        assert.truthy(c:read_until('"type":"start"'))
        s.proc:kill("SIGTERM")
        -- the server takes no new request now
        assert.is_true(helper.eventually(function()
          local out = curl("-o", "/dev/null", "-w", "%{http_code}", "-H", s.auth, s.url .. "/v1/sandboxes")
          return out ~= "200"
        end))
        -- the running command still finishes
        helper.sh("timeout 10 sh -c 'echo go > \"$0\"' '" .. root .. "/gate'")
        assert.truthy(c:read_until('"type":"complete"'))
        assert.matches('"data":"finished go\\n"', c.buf)
        assert.is_true(c:wait_eof())
        c:close()
        assert.equal(0, s.wait_exit())
        assert.equal("kept", kept_file(s, "graceful", "note"))
      end)
      s.stop()
      assert(ok, err)
    end)
  end)

  it("SIGTERM: a stream still open after --shutdown-grace-s ends with a final event, its command killed", function()
    run_task(function()
      local s = serve { "--shutdown-grace-s", "1" }
      local cmd = "sleep 7321." .. s.port -- (the port: this run's, not another's running beside it)
      local ok, err = pcall(function()
        local c = raw_request(s, "POST", "/v1/sandboxes/late/exec/stream",
          '{"command":"echo $$ > pid; exec ' .. cmd .. '"}')
        assert.truthy(c:read_until('"type":"start"'))
        local pidfile = s.home .. "/sandboxes/late/workspace/pid"
        assert.is_true(helper.eventually(function() return helper.sh("cat '" .. pidfile .. "' 2>/dev/null") ~= "" end))
        s.proc:kill("SIGTERM")
        assert.truthy(c:read_until('"code":"SHUTTING_DOWN"'))
        assert.is_true(c:wait_eof())
        c:close()
        assert.equal(0, s.wait_exit())
        assert.equal("", survivors(cmd)) -- its command is gone
        local pid = kept_file(s, "late", "pid")
        assert.truthy(pid:match("^%d+$"), pid) -- the workspace stays
      end)
      s.stop()
      assert(ok, err)
    end)
  end)

  it("SIGTERM: a plain request still running after --shutdown-grace-s gets 503 SHUTTING_DOWN, not a 409", function()
    run_task(function()
      local s = serve { "--shutdown-grace-s", "1" }
      local cmd = "sleep 7321." .. s.port
      local ok, err = pcall(function()
        assert.equal(200, (s.call("POST", "/v1/sandboxes/slow/exec", '{"command":"true"}')))
        local c = raw_request(s, "POST", "/v1/sandboxes/slow/exec", '{"command":"' .. cmd .. '"}')
        assert.is_true(helper.eventually(function()
          return helper.sh("pgrep -f '^" .. cmd .. "$' || true") ~= ""
        end))
        s.proc:kill("SIGTERM")
        local status, headers, body = c:response()
        assert.same({ 503, "1" }, { status, headers["retry-after"] })
        local e = cjson.decode(body)
        assert.same({ "SHUTTING_DOWN", "shutting_down" }, { e.code, e.context.reason })
        c:close()
        assert.equal(0, s.wait_exit())
        assert.equal("", survivors(cmd))
      end)
      s.stop()
      assert(ok, err)
    end)
  end)
end)
