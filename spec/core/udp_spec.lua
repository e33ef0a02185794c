-- moonbox.core udp (src/udp.c): core.udp_bind(host, port[, {size, netns_pid}])
-- -> a handle that reads one datagram at a time into a buffer of `size`
-- bytes (512..4096; a longer datagram arrives cut, flagged truncated) and
-- sends at once (nothing queues). Failures are nil, message, CODE; misuse
-- raises.
local core = require "moonbox.core"

-- a socket and what it receives: {data, host, port, truncated}
local function socket(host, opts)
  local s = assert(core.udp_bind(host or "127.0.0.1", 0, opts))
  local got = {}
  s:recv_start(function(err, data, from, port, truncated)
    got[#got + 1] = { err = err, data = data, host = from, port = port, truncated = truncated }
  end)
  return s, got
end

describe("core.udp", function()
  it("sends and receives datagrams with their exact bytes and sender", function()
    run_task(function()
      local a, got_a = socket()
      local b, got_b = socket()
      local host_a, port_a = a:sockname()
      local host_b, port_b = b:sockname()
      assert.same({ "127.0.0.1", "127.0.0.1" }, { host_a, host_b })
      assert.truthy(port_a > 0 and port_b > 0 and port_a ~= port_b)
      local payload = "\0\1\2 binary \255" .. string.rep("x", 400)
      assert.is_true(a:send(payload, host_b, port_b))
      assert.is_true(b:send("back", host_a, port_a))
      helper.eventually(function() return #got_a == 1 and #got_b == 1 end, 2000)
      assert.same({ data = payload, host = "127.0.0.1", port = port_a, truncated = false }, got_b[1])
      assert.same({ data = "back", host = "127.0.0.1", port = port_b, truncated = false }, got_a[1])
      a:close()
      b:close()
    end)
  end)

  it("cuts a datagram longer than its buffer and says so", function()
    run_task(function()
      local small, got = socket("127.0.0.1", { size = 512 })
      local sender = assert(core.udp_bind("127.0.0.1", 0))
      local _, port = small:sockname()
      local big = string.rep("a", 512) .. string.rep("b", 100)
      assert.is_true(sender:send(big, "127.0.0.1", port))
      assert.is_true(sender:send("after", "127.0.0.1", port))
      helper.eventually(function() return #got == 2 end, 2000)
      assert.same({ string.rep("a", 512), true }, { got[1].data, got[1].truncated })
      assert.same({ "after", false }, { got[2].data, got[2].truncated })
      small:close()
      sender:close()
    end)
  end)

  it("fails with nil, message, CODE, and raises on misuse", function()
    run_task(function()
      local s = assert(core.udp_bind("127.0.0.1", 0))
      local _, port = s:sockname()
      local ok, msg, code = s:send(string.rep("x", 4097), "127.0.0.1", port)
      assert.same({ nil, "EMSGSIZE" }, { ok, code })
      assert.truthy(msg:find("4096", 1, true))
      assert.same({ nil, "EINVAL" }, { select(1, s:send("x", "not an address", port)), select(3, s:send("x",
        "not an address", port)) })
      local taken = { core.udp_bind("127.0.0.1", port) }
      assert.same({ nil, "EADDRINUSE" }, { taken[1], taken[3] })
      assert.equal("EINVAL", select(3, core.udp_bind("nowhere", 0)))
      assert.equal("ENOENT", select(3, core.udp_bind("127.0.0.1", 0, { netns_pid = 0x3fffffff })))
      assert.has_error(function() core.udp_bind("127.0.0.1", 0, { size = 511 }) end)
      assert.has_error(function() core.udp_bind("127.0.0.1", 0, { size = 4097 }) end)
      assert.has_error(function() core.udp_bind("127.0.0.1", 70000) end)
      assert.has_error(function() s:send("x", "127.0.0.1", 0) end)
      s:close()
      assert.has_error(function() s:send("x", "127.0.0.1", port) end)
      assert.is_true(s:is_closing())
    end)
  end)

  it("binds inside another process's network namespace (netns_pid)", function()
    run_task(function()
      -- a process in a network namespace of its own (unprivileged: in a
      -- user namespace of its own too, which udp_bind joins first)
      local args = core.getuid() == 0 and { "unshare", "--net", "sleep", "30" } or
        { "unshare", "--user", "--map-root-user", "--net", "sleep", "30" }
      local exited
      local proc = assert(core.spawn { args = args, stdio = { [0] = "null", [1] = "null", [2] = "null" },
        pdeathsig = "SIGKILL", on_exit = function(status) exited = status end })
      local pid = proc:pid()
      local fs = require "moonbox.lib.fs"
      local function netns(of) return select(2, pcall(fs.readlink, "/proc/" .. of .. "/ns/net")) end
      helper.eventually(function() return exited ~= nil or netns(pid) ~= netns("self") end, 5000)
      if exited ~= nil then
        pending("unshare could not make a network namespace here (exit " .. tostring(exited) .. ")")
        return
      end
      local inside = assert(core.udp_bind("0.0.0.0", 0, { netns_pid = pid }))
      local _, port = inside:sockname()
      -- in that namespace's socket table, not in ours
      local function bound(of)
        local f = assert(io.open("/proc/" .. of .. "/net/udp"))
        local text = f:read("*a")
        f:close()
        return text:find((":%04X 00000000:0000"):format(port), 1, true) ~= nil
      end
      assert.same({ true, false }, { bound(pid), bound("self") })
      inside:close()
      helper.eventually(function() return not bound(pid) end, 2000)
      assert.is_false(bound(pid))
      proc:kill("SIGKILL")
      helper.eventually(function() return exited ~= nil end, 5000)
    end)
  end)
end)
