-- The default seccomp profile: each attempt fails, with the reason asserted.
local moonbox = require "moonbox"

local with_sandbox = helper.with_sandbox

local py = function(code) return { "python3", "-c", code } end

describe("seccomp default profile", function()
  it("is in force with no_new_privs, and says so", function()
    with_sandbox(function(sb)
      local info = sb:info()
      assert.equal("default", info.seccomp)
      assert.is_true(info.noNewPrivs)
      local status = sb:exec("grep -E '^(Seccomp|NoNewPrivs):' /proc/self/status").stdout
      assert.truthy(status:find("NoNewPrivs:\t1", 1, true))
      assert.truthy(status:find("Seccomp:\t2", 1, true))
    end)
  end)

  it("denies mount, namespaces, ptrace, kernel modules, bpf and keyrings with EPERM", function()
    with_sandbox(function(sb)
      local r = sb:exec(py([[
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
def attempt(name, fn):
    rc = fn()
    print(name, "ok" if rc == 0 else errno.errorcode.get(ctypes.get_errno(), "?"))
attempt("mount", lambda: libc.mount(b"none", b"/mnt", b"tmpfs", 0, None))
attempt("unshare", lambda: libc.unshare(0x10000000))
attempt("ptrace", lambda: libc.ptrace(16, 1, None, None))
attempt("init_module", lambda: libc.syscall(175, None, 0, b""))
attempt("bpf", lambda: libc.syscall(321, 0, None, 0))
attempt("keyctl", lambda: libc.syscall(250, 0, 0, 0, 0, 0))
attempt("userfaultfd", lambda: libc.syscall(323, 0))
attempt("perf_event_open", lambda: libc.syscall(298, None, 0, -1, -1, 0))
]]))
      assert.equal("", r.stderr)
      assert.equal(table.concat({
        "mount EPERM", "unshare EPERM", "ptrace EPERM", "init_module EPERM", "bpf EPERM", "keyctl EPERM",
        "userfaultfd EPERM", "perf_event_open EPERM", "" }, "\n"), r.stdout)
    end)
  end)

  it("denies TIOCSTI even when the request has high bits set (CVE-2019-10063)", function()
    with_sandbox(function(sb)
      local t = sb:terminal {}
      t:write([[python3 -c 'import fcntl,termios,errno
for req in (termios.TIOCSTI, termios.TIOCSTI | (1 << 32)):
    try: fcntl.ioctl(0, req, b"x"); print("injected")
    except OSError as e: print("denied", errno.errorcode[e.errno])'; echo done-$((6*7))]] .. "\n")
      local out = ""
      while not out:find("done%-42") do
        local chunk = moonbox.timeout(5000, t.read, t)
        if not chunk then break end
        out = out .. chunk
      end
      t:close()
      local denied = select(2, out:gsub("denied EPERM", ""))
      assert.equal(2, denied, out)
      assert.is_nil(out:find("injected\r", 1, true))
    end)
  end)

  it("leaves ordinary work alone: fork, exec, pipes, python and git", function()
    with_sandbox(function(sb)
      local r = sb:exec("echo a | tr a b; " ..
        "python3 -c 'import subprocess; print(subprocess.run([\"true\"]).returncode)'; " ..
        "git init -q repo && echo git-ok")
      assert.equal("b\n0\ngit-ok\n", r.stdout)
    end)
  end)

  it("can be switched off by policy", function()
    with_sandbox(function(sb)
      assert.equal("none", sb:info().seccomp)
      assert.truthy(sb:exec("grep Seccomp: /proc/self/status").stdout:find("Seccomp:\t0", 1, true))
    end, { policy = { seccomp = "none" } })
  end)
end)
