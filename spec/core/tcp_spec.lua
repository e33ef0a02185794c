-- moonbox.core tcp (src/tcp.c): core.tcp_connect(host, port, cb[, socket_fd])
-- connects on the loop and hands the connected socket to cb as a
-- close-on-exec fd; failures come back as cb(message, nil, CODE), or at once
-- as nil, message, CODE when the address cannot be used. Misuse raises.
local core = require "moonbox.core"
local async = require "moonbox.async"
local bit = require "bit"

local function slurp(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("*a")
  f:close()
  return s
end

local function cloexec(fd)
  local flags = slurp("/proc/self/fdinfo/" .. fd):match("flags:%s*(%d+)")
  return bit.band(tonumber(flags, 8), 0x80000) ~= 0
end

-- connect and wait for the callback: err, fd, code
local function connect(host, port, sock)
  return async.await(function(resume)
    local ok, msg, code = core.tcp_connect(host, port, function(err, fd, code)
      resume(err, fd, code)
    end, sock)
    if not ok then resume("returned", msg, code) end
  end)
end

-- an HTTP server on the loop answering every request with "hello <path>"
local function listener(host)
  local srv
  srv = assert(core.http_listen({ host = host or "127.0.0.1", port = 0 }, function(kind, id, req)
    if kind == "request" then srv:respond(id, 200, "text/plain", {}, nil, "hello " .. req.path) end
  end))
  return srv, srv:port()
end

local function request(fd, path)
  local s = core.stream_open(fd)
  s:write("GET " .. path .. " HTTP/1.0\r\nHost: x\r\n\r\n")
  local out = helper.read_all(s)
  s:close()
  return out
end

describe("core.tcp_connect", function()
  it("hands over a connected, close-on-exec socket", function()
    run_task(function()
      local srv, port = listener()
      local err, fd, code = connect("127.0.0.1", port)
      assert.is_nil(err)
      assert.is_nil(code)
      assert.is_number(fd)
      assert.is_true(fd > 2)
      assert.matches("^socket:%[%d+%]$", core.readlink("/proc/self/fd/" .. fd))
      assert.is_true(cloexec(fd))
      local out = request(fd, "/probe")
      assert.matches("^HTTP/1%.[01] 200", out)
      assert.matches("\r\n\r\nhello /probe$", out)
      srv:close()
    end)
  end)

  it("takes an IPv6 literal", function()
    run_task(function()
      -- http_listen is IPv4 only: nothing of ours listens on ::1
      local has_lo6 = slurp("/proc/net/if_inet6"):find("^0+1 ") or slurp("/proc/net/if_inet6"):find("\n0+1 ")
      local srv, port = listener()
      local err, fd, code = connect("::1", port)
      srv:close()
      assert.is_nil(fd)
      if has_lo6 then
        assert.equals("ECONNREFUSED", code)
      else
        assert.is_string(code)
        assert.are_not.equal("EINVAL", code)
      end
      assert.equals(code .. ":", err:match("^%u+:"))
    end)
  end)

  it("a port nobody listens on: cb(message, nil, ECONNREFUSED)", function()
    run_task(function()
      local srv, port = listener()
      srv:close()
      helper.settle()
      local err, fd, code = connect("127.0.0.1", port)
      assert.equals("ECONNREFUSED", code)
      assert.equals("ECONNREFUSED: connection refused", err)
      assert.is_nil(fd)
    end)
  end)

  it("an address that is not an IP literal: nil, message, EINVAL at once, no callback", function()
    run_task(function()
      local called = false
      local ok, msg, code = core.tcp_connect("localhost", 80, function() called = true end)
      assert.is_nil(ok)
      assert.equals("EINVAL", code)
      assert.equals("EINVAL: invalid argument (localhost)", msg)
      ok, msg, code = core.tcp_connect("", 80, function() called = true end)
      assert.is_nil(ok)
      assert.equals("EINVAL", code)
      assert.is_string(msg)
      helper.settle()
      assert.is_false(called)
    end)
  end)

  it("a socket_fd it cannot use: nil, message, code, and the fd is still the caller's", function()
    run_task(function()
      local called = false
      local cb = function() called = true end
      local before = helper.fd_count()
      local ok, msg, code = core.tcp_connect("127.0.0.1", 80, cb, -1)
      assert.is_nil(ok)
      assert.equals("EBADF", code)
      assert.equals("EBADF: bad file descriptor (socket)", msg)
      local r, w = core.pipe()
      ok, msg, code = core.tcp_connect("127.0.0.1", 80, cb, r)
      assert.is_nil(ok)
      assert.equals("ENOTSOCK", code)
      assert.equals("ENOTSOCK: socket operation on non-socket (connect)", msg)
      assert.is_true(core.close_fd(r))
      assert.is_true(core.close_fd(w))
      helper.settle()
      assert.is_false(called)
      assert.equals(before, helper.fd_count())
    end)
  end)

  it("raises on misuse, before anything is started", function()
    run_task(function()
      local before = helper.fd_count()
      local cb = function() end
      assert.matches("port must be 1%-65535", helper.error_of(core.tcp_connect, "127.0.0.1", 0, cb))
      assert.matches("port must be 1%-65535", helper.error_of(core.tcp_connect, "127.0.0.1", 65536, cb))
      assert.matches("function expected", helper.error_of(core.tcp_connect, "127.0.0.1", 80))
      assert.matches("number expected", helper.error_of(core.tcp_connect, "127.0.0.1", "http", cb))
      assert.matches("string expected", helper.error_of(core.tcp_connect, nil, 80, cb))
      assert.matches("number expected", helper.error_of(core.tcp_connect, "127.0.0.1", 80, cb, "fd"))
      helper.settle()
      assert.equals(before, helper.fd_count())
    end)
  end)
end)
