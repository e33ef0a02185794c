-- What `moonbox serve` prints reaches a reader while it runs when its
-- output is a pipe (systemd, `docker logs`, `| tee`): hardening finding 6.
-- stdout and stderr go into one FIFO, as `2>&1 | tee` makes them, and the
-- spec reads it line by line while the server serves.
local moonbox = require "moonbox"
local core = require "moonbox.core"
local async = require "moonbox.async"
local client = require "server.client"

describe("moonbox serve's output on a pipe", function()
  it("prints the token URL, each access-log line and the stop line as they happen", function()
    run_task(function()
      local bin = os.getenv("MOONBOX_BIN") or "build/moonbox"
      local dir = helper.mkdtemp()
      -- the server writes into a FIFO that cat copies to our pipe; the
      -- first line is the server's pid, so SIGTERM reaches it, not sh
      local script = [[mkfifo "$1/out" && { "$0" serve --listen 127.0.0.1:0 >"$1/out" 2>&1 & echo "pid $!"; }
        exec cat "$1/out"]]
      local exit = {}
      local proc, pipes = assert(core.spawn {
        args = { "sh", "-c", script, bin, dir },
        env = client.env { HOME = dir, MOONBOX_HOME = dir .. "/home" },
        stdio = { [0] = "null", [1] = "pipe", [2] = "inherit" },
        on_exit = function(c) exit.code = c if exit.resume then exit.resume() end end,
      })
      local buf, waiting = "", nil
      pipes[1]:read_start(function(_, data)
        buf = buf .. (data or "\0eof")
        if waiting then
          local w = waiting
          waiting = nil
          w()
        end
      end)
      -- the output so far, once it holds a line matching pattern (the pipe
      -- is not closed meanwhile: the server is still running)
      local function line(pattern)
        return moonbox.timeout(15000, function()
          while true do
            local got = buf:match(pattern)
            if got then return got end
            assert(not buf:find("\0eof", 1, true), "output ended without " .. pattern .. ":\n" .. buf)
            async.await(function(resume) waiting = resume end)
          end
        end)
      end
      local pid = tonumber(line("^pid (%d+)\n"))
      -- a failed assertion still stops the server (else cat never ends)
      local ok, err = pcall(function()
        local url = line("moonbox: open (http://[%d.:]+)/%?token=%x+\n")
        local token = line("moonbox: open http://[%d.:]+/%?token=(%x+)\n")
        assert.truthy(token and #token >= 16)
        -- the token printed is the one the server wants
        local out = client.curl("-s", "-o", "/dev/null", "-w", "%{http_code}",
          "-H", "Authorization: Bearer " .. token, url .. "/v1/sandboxes")
        assert.equal("200", out)
        -- its access-log line arrives while the server still runs
        assert.truthy(line('("route":"[^"]*sandboxes[^"]*")'))
        assert.truthy(line('"status":200'))
        core.kill(pid, "SIGTERM")
        assert.truthy(line("moonbox serve: SIGTERM: stopping"))
        if exit.code == nil then async.await(function(resume) exit.resume = resume end) end
        assert.equal(0, exit.code)
        pipes[1]:close()
        assert.truthy(proc)
      end)
      if not ok then
        core.kill(pid, "SIGKILL")
        pipes[1]:close()
        helper.sh("rm -rf '" .. dir .. "'")
        error(err, 0)
      end
      helper.sh("rm -rf '" .. dir .. "'")
    end)
  end)
end)
