-- moonbox.core sys (src/sys.c): process facts and switches, and the small
-- synchronous fd and path calls the runtime makes on /proc, cgroupfs and
-- its own files. OS failures return nil, "CODE: message (detail)", "CODE";
-- misuse (a missing or mistyped argument) raises a Lua error.
local core = require "moonbox.core"
local bit = require "bit"

local O_CLOEXEC = 0x80000 -- 02000000

local function slurp(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("*a")
  f:close()
  return s
end

local function spit(path, data)
  local f = assert(io.open(path, "wb"))
  f:write(data)
  f:close()
end

local function cloexec(fd)
  local flags = slurp("/proc/self/fdinfo/" .. fd):match("flags:%s*(%d+)")
  return bit.band(tonumber(flags, 8), O_CLOEXEC) ~= 0
end

local function fd_target(fd)
  return core.readlink("/proc/self/fd/" .. fd)
end

local function stat(path)
  return helper.sh("stat -c '%F %a %u %g' '" .. path .. "'")
end

-- nil, message, code as an OS failure of a sys call returns it
local function assert_fails(code, detail, a, b, c)
  assert.is_nil(a)
  assert.equals(code, c)
  assert.is_string(b)
  assert.equals(code .. ":", b:match("^%u+:"))
  if detail then assert.equals("(" .. detail .. ")", b:match("%(.*%)$")) end
end

local dir
before_each(function() dir = helper.mkdtemp() end)
after_each(function() helper.sh("rm -rf '" .. dir .. "'") end)

describe("core ids and clock", function()
  it("getpid, getuid, getgid, geteuid are this process's", function()
    assert.equals(tostring(core.getpid()), core.readlink("/proc/self"))
    local status = slurp("/proc/self/status")
    local ruid, euid = status:match("\nUid:%s+(%d+)%s+(%d+)")
    local rgid = status:match("\nGid:%s+(%d+)")
    assert.equals(tonumber(ruid), core.getuid())
    assert.equals(tonumber(euid), core.geteuid())
    assert.equals(tonumber(rgid), core.getgid())
  end)

  it("time is the wall clock in seconds", function()
    local t = core.time()
    assert.is_number(t)
    assert.is_true(math.abs(t - os.time()) < 2)
  end)
end)

describe("core.setfsids", function()
  it("returns the previous ids, and files are created with the new ones until they are set back", function()
    local uid, gid = core.geteuid(), core.getgid()
    if uid == 0 then
      helper.sh("chmod 777 '" .. dir .. "'") -- nobody may create in it
      local old_uid, old_gid = core.setfsids(65534, 65534)
      assert.equals(0, old_uid)
      assert.equals(gid, old_gid)
      local fd = core.open_fd(dir .. "/as-nobody", "w")
      assert.equals(65534, core.setfsids(old_uid, old_gid))
      assert.is_number(fd)
      core.close_fd(fd)
      assert.equals("regular empty file 600 65534 65534", stat(dir .. "/as-nobody"))
    else
      -- unprivileged: another uid is refused and the ids stay as they were
      assert_fails("EPERM", "setfsuid", core.setfsids(uid == 65534 and 0 or 65534, gid))
    end
    assert.same({ uid, gid }, { core.setfsids(uid, gid) })
    local fd = assert(core.open_fd(dir .. "/as-self", "w"))
    core.close_fd(fd)
    assert.equals(("regular empty file 600 %d %d"):format(uid, gid), stat(dir .. "/as-self"))
  end)

  it("raises without numbers", function()
    assert.matches("number expected", helper.error_of(core.setfsids, "root", 0))
  end)
end)

describe("core fds: memfd, write_fd, pread_all, rewrite_fd, dup_to, devnull", function()
  it("memfd gives a close-on-exec anonymous file that pread_all reads from offset 0", function()
    local fd = assert(core.memfd("sys-spec"))
    assert.is_true(cloexec(fd))
    assert.equals("/memfd:sys-spec (deleted)", fd_target(fd))
    assert.equals(5, core.write_fd(fd, "hello"))
    assert.equals(6, core.write_fd(fd, " world"))
    assert.equals("hello world", core.pread_all(fd, 1024))
    assert.equals("hello world", core.pread_all(fd, 1024)) -- the offset does not move
    assert.equals("hel", core.pread_all(fd, 3))
    assert.equals("", core.pread_all(fd, 0))
    -- more than one buffer's worth
    local big = ("0123456789abcdef"):rep(4096)
    assert.is_true(core.rewrite_fd(fd, big))
    assert.equals(big, core.pread_all(fd, #big + 100))
    assert.equals(big:sub(1, 10000), core.pread_all(fd, 10000))
    -- rewrite replaces the whole content, shorter too
    assert.is_true(core.rewrite_fd(fd, "ab"))
    assert.equals("ab", core.pread_all(fd, 1024))
    assert.equals("ab", slurp("/proc/self/fd/" .. fd))
    assert.is_true(core.rewrite_fd(fd, ""))
    assert.equals("", core.pread_all(fd, 1024))
    core.close_fd(fd)
  end)

  it("a bad fd is EBADF, a pipe ESPIPE or EINVAL, a reader gone EPIPE: never a signal", function()
    local fd = assert(core.memfd("gone"))
    core.close_fd(fd)
    assert_fails("EBADF", "write", core.write_fd(fd, "x"))
    assert_fails("EBADF", "pread", core.pread_all(fd, 10))
    assert_fails("EBADF", "ftruncate", core.rewrite_fd(fd, "x"))
    assert_fails("EBADF", "write", core.write_fd(-1, "x"))
    local r, w = core.pipe()
    assert_fails("ESPIPE", "pread", core.pread_all(r, 10))
    assert_fails("EINVAL", "ftruncate", core.rewrite_fd(w, "x"))
    core.close_fd(r)
    assert_fails("EPIPE", "write", core.write_fd(w, "x"))
    core.close_fd(w)
  end)

  it("raises on arguments of the wrong type", function()
    assert.matches("number expected", helper.error_of(core.write_fd, "x", "data"))
    assert.matches("string expected", helper.error_of(core.write_fd, 1))
    assert.matches("number expected", helper.error_of(core.pread_all, 0))
    assert.matches("string expected", helper.error_of(core.memfd))
  end)

  it("dup_to places an fd on a given number, close-on-exec", function()
    local fd = assert(core.memfd("dup-src"))
    local target = fd + 100
    assert.is_nil(fd_target(target))
    assert.is_true(core.dup_to(fd, target))
    assert.equals("/memfd:dup-src (deleted)", fd_target(target))
    assert.is_true(cloexec(target))
    core.write_fd(fd, "shared")
    assert.equals("shared", core.pread_all(target, 100))
    assert.is_true(core.dup_to(fd, fd)) -- onto itself: nothing to do
    core.close_fd(fd)
    assert.equals("shared", core.pread_all(target, 100))
    assert_fails("EBADF", "dup3", core.dup_to(fd, target + 1))
    assert.is_nil(fd_target(target + 1))
    assert_fails("EBADF", "dup3", core.dup_to(target, -1))
    core.close_fd(target)
  end)

  it("devnull is /dev/null, read-write and close-on-exec", function()
    local fd = assert(core.devnull())
    assert.equals("/dev/null", fd_target(fd))
    assert.is_true(cloexec(fd))
    assert.equals(3, core.write_fd(fd, "abc"))
    assert.equals("", core.pread_all(fd, 10))
    core.close_fd(fd)
  end)
end)

describe("core paths: readdir, mkdir, rmdir, readlink, unlink", function()
  it("readdir lists the names without . and ..", function()
    spit(dir .. "/a", "")
    spit(dir .. "/b", "")
    assert.is_true(core.mkdir(dir .. "/c"))
    local names = assert(core.readdir(dir))
    table.sort(names)
    assert.same({ "a", "b", "c" }, names)
    assert.same({}, core.readdir(dir .. "/c"))
    assert_fails("ENOENT", dir .. "/missing", core.readdir(dir .. "/missing"))
    assert_fails("ENOTDIR", dir .. "/a", core.readdir(dir .. "/a"))
  end)

  it("mkdir makes a directory with the mode asked (0755 by default), rmdir removes an empty one", function()
    assert.is_true(core.mkdir(dir .. "/d"))
    assert.equals("directory 755", stat(dir .. "/d"):match("^%a+ %d+"))
    assert.is_true(core.mkdir(dir .. "/e", tonumber("700", 8)))
    assert.equals("directory 700", stat(dir .. "/e"):match("^%a+ %d+"))
    assert_fails("EEXIST", dir .. "/d", core.mkdir(dir .. "/d"))
    assert_fails("ENOENT", dir .. "/no/d", core.mkdir(dir .. "/no/d"))
    spit(dir .. "/d/f", "")
    assert_fails("ENOTEMPTY", dir .. "/d", core.rmdir(dir .. "/d"))
    assert.is_true(core.rmdir(dir .. "/e"))
    assert.equals("", helper.sh("ls -A '" .. dir .. "' | grep -x e || true"))
    assert_fails("ENOENT", dir .. "/e", core.rmdir(dir .. "/e"))
    assert_fails("ENOTDIR", dir .. "/d/f", core.rmdir(dir .. "/d/f"))
    assert.matches("string expected", helper.error_of(core.mkdir))
  end)

  it("readlink gives a symlink's target, EINVAL for anything else", function()
    helper.sh("ln -s 'some/where else' '" .. dir .. "/link'")
    assert.equals("some/where else", core.readlink(dir .. "/link"))
    spit(dir .. "/file", "")
    assert_fails("EINVAL", dir .. "/file", core.readlink(dir .. "/file"))
    assert_fails("ENOENT", dir .. "/missing", core.readlink(dir .. "/missing"))
  end)

  it("unlink removes a file or a symlink (not its target), from a dirfd too", function()
    spit(dir .. "/target", "kept")
    helper.sh("ln -s target '" .. dir .. "/link'")
    assert.is_true(core.unlink(dir .. "/link"))
    assert.equals("kept", slurp(dir .. "/target"))
    local dfd = assert(core.dir_fd(dir))
    assert.is_true(core.unlink("target", dfd))
    assert.same({}, core.readdir(dir))
    assert_fails("ENOENT", "target", core.unlink("target", dfd))
    core.mkdir(dir .. "/sub")
    assert_fails("EISDIR", dir .. "/sub", core.unlink(dir .. "/sub"))
    core.close_fd(dfd)
  end)
end)

describe("core.dir_fd", function()
  it("opens a directory as an O_PATH fd, checking its owner when asked", function()
    local me = core.geteuid()
    core.mkdir(dir .. "/d")
    local fd = assert(core.dir_fd(dir .. "/d"))
    assert.equals(dir .. "/d", fd_target(fd))
    assert.is_true(cloexec(fd))
    assert_fails("EBADF", "write", core.write_fd(fd, "x")) -- O_PATH: no I/O
    core.close_fd(fd)
    fd = assert(core.dir_fd(dir .. "/d", me))
    core.close_fd(fd)
    assert_fails("EPERM", dir .. "/d", core.dir_fd(dir .. "/d", me + 1))
    -- a symlink: followed without an owner, refused with one
    helper.sh("ln -s d '" .. dir .. "/link'")
    fd = assert(core.dir_fd(dir .. "/link"))
    assert.equals(dir .. "/d", fd_target(fd))
    core.close_fd(fd)
    assert_fails("ENOTDIR", dir .. "/link", core.dir_fd(dir .. "/link", me))
    spit(dir .. "/file", "")
    assert_fails("ENOTDIR", dir .. "/file", core.dir_fd(dir .. "/file"))
    assert_fails("ENOENT", dir .. "/missing", core.dir_fd(dir .. "/missing"))
  end)
end)

describe("core.open_fd and core.mkfifo", function()
  it("w creates (0600 by default) and truncates, r reads; both close-on-exec", function()
    local w = assert(core.open_fd(dir .. "/f", "w"))
    assert.is_true(cloexec(w))
    assert.equals(5, core.write_fd(w, "hello"))
    core.close_fd(w)
    assert.equals("regular file 600", stat(dir .. "/f"):match("^[%a ]+ %d+"))
    local r = assert(core.open_fd(dir .. "/f", "r"))
    assert.is_true(cloexec(r))
    assert.equals("hello", core.pread_all(r, 100))
    assert_fails("EBADF", "write", core.write_fd(r, "x")) -- read-only
    core.close_fd(r)
    w = assert(core.open_fd(dir .. "/f", "w"))
    core.close_fd(w)
    assert.equals("", slurp(dir .. "/f"))
    w = assert(core.open_fd(dir .. "/g", "w", nil, tonumber("640", 8)))
    core.close_fd(w)
    assert.equals("640", stat(dir .. "/g"):match("(%d+) %d+ %d+$"))
    assert_fails("ENOENT", dir .. "/missing", core.open_fd(dir .. "/missing", "r"))
    assert.matches('expected "r", "w", "fifo" or "fifo_w"', helper.error_of(core.open_fd, dir .. "/f", "rw"))
  end)

  it("with a dirfd: relative, never through a symlink, only a regular file or a FIFO as asked", function()
    local dfd = assert(core.dir_fd(dir))
    spit(dir .. "/file", "data")
    helper.sh("ln -s file '" .. dir .. "/link'")
    local fd = assert(core.open_fd("file", "r", dfd))
    assert.equals("data", core.pread_all(fd, 100))
    core.close_fd(fd)
    assert_fails("ELOOP", "link", core.open_fd("link", "r", dfd))
    assert_fails("ELOOP", "link", core.open_fd("link", "w", dfd))
    assert.equals("data", slurp(dir .. "/file")) -- not truncated through the link
    assert.is_true(core.mkfifo("fifo", nil, dfd))
    assert.equals("fifo 600", stat(dir .. "/fifo"):match("^%a+ %d+"))
    assert_fails("EINVAL", "fifo", core.open_fd("fifo", "r", dfd))
    assert_fails("EINVAL", "file", core.open_fd("file", "fifo", dfd))
    core.mkdir(dir .. "/sub")
    assert_fails("EISDIR", "sub", core.open_fd("sub", "w", dfd))
    -- "fifo": read-write and non-blocking, so its open and reads never wait
    fd = assert(core.open_fd("fifo", "fifo", dfd))
    assert.is_true(cloexec(fd))
    assert.equals(3, core.write_fd(fd, "abc"))
    local s = core.stream_open(fd)
    s:close()
    -- "fifo_w": a writer that never waits: ENXIO while nobody reads, a
    -- FIFO only
    assert_fails("ENXIO", "fifo", core.open_fd("fifo", "fifo_w", dfd))
    assert_fails("EINVAL", "file", core.open_fd("file", "fifo_w", dfd))
    local reader = assert(core.open_fd("fifo", "fifo", dfd))
    local writer = assert(core.open_fd(dir .. "/fifo", "fifo_w"))
    assert.is_true(cloexec(writer))
    assert.equals(2, core.write_fd(writer, "hi"))
    core.close_fd(writer)
    local rs = core.stream_open(reader)
    assert.equals("hi", rs:try_read())
    rs:close()
    core.close_fd(dfd)
  end)

  it("mkfifo makes a FIFO with the mode asked, EEXIST when the name is taken", function()
    assert.is_true(core.mkfifo(dir .. "/p", tonumber("640", 8)))
    assert.equals("fifo 640", stat(dir .. "/p"):match("^%a+ %d+"))
    assert_fails("EEXIST", dir .. "/p", core.mkfifo(dir .. "/p"))
    assert_fails("ENOENT", dir .. "/no/p", core.mkfifo(dir .. "/no/p"))
    assert.matches("string expected", helper.error_of(core.mkfifo))
  end)
end)

describe("core.chown", function()
  it("changes a path's owner without following a final symlink, or an fd's", function()
    local uid, gid = core.geteuid(), core.getgid()
    spit(dir .. "/file", "")
    helper.sh("ln -s file '" .. dir .. "/link'")
    local to_uid, to_gid = uid, gid
    if uid == 0 then to_uid, to_gid = 65534, 65534 end
    assert.is_true(core.chown(dir .. "/link", to_uid, to_gid))
    assert.equals(("%d %d"):format(to_uid, to_gid), helper.sh("stat -c '%u %g' '" .. dir .. "/link'"))
    assert.equals(("%d %d"):format(uid, gid), helper.sh("stat -c '%u %g' '" .. dir .. "/file'"))
    local dfd = assert(core.dir_fd(dir))
    assert.is_true(core.chown("file", to_uid, to_gid, dfd))
    assert.equals(("%d %d"):format(to_uid, to_gid), helper.sh("stat -c '%u %g' '" .. dir .. "/file'"))
    core.close_fd(dfd)
    local fd = assert(core.open_fd(dir .. "/byfd", "w"))
    assert.is_true(core.chown(fd, to_uid, to_gid))
    assert.equals(("%d %d"):format(to_uid, to_gid), helper.sh("stat -c '%u %g' '" .. dir .. "/byfd'"))
    core.close_fd(fd)
    assert_fails("ENOENT", dir .. "/missing", core.chown(dir .. "/missing", uid, gid))
    assert_fails("EBADF", "fchown", core.chown(fd, uid, gid))
    if uid ~= 0 then
      assert_fails("EPERM", dir .. "/file", core.chown(dir .. "/file", 0, 0))
    end
    assert.matches("number expected", helper.error_of(core.chown, dir .. "/file", "root", 0))
  end)
end)

describe("core.set_child_subreaper", function()
  local function gone(pid)
    local f = io.open("/proc/" .. pid .. "/stat")
    if f then f:close() end
    return f == nil
  end

  -- sh starts `sleep` in the background and exits: the orphan's new parent
  local function orphan_parent()
    local exited = false
    local proc, pipes = assert(core.spawn {
      args = { "/bin/sh", "-c", "sleep 30 >/dev/null & echo $!" }, env = { "PATH=/usr/bin:/bin" },
      stdio = { [1] = "pipe" }, on_exit = function() exited = true end })
    local sh = proc:pid()
    local pid = tonumber((helper.read_all(pipes[1])))
    pipes[1]:close()
    assert.is_number(pid)
    assert.is_true(helper.eventually(function() return exited end))
    local ppid
    assert.is_true(helper.eventually(function()
      local f = io.open("/proc/" .. pid .. "/stat")
      if not f then return false end
      ppid = tonumber((f:read("*a") or ""):match("^%d+ %b() %a (%d+)"))
      f:close()
      return ppid ~= nil and ppid ~= sh
    end))
    assert.is_true(core.kill(pid, "SIGKILL"))
    return ppid, pid
  end

  it("makes orphaned descendants this process's children, and stops doing so", function()
    run_task(function()
      assert.is_true(core.set_child_subreaper(true))
      local ppid, pid = orphan_parent()
      assert.equals(core.getpid(), ppid)
      -- ours to reap: it goes once killed
      assert.is_true(helper.eventually(function() return gone(pid) end))
      assert.is_true(core.set_child_subreaper(false))
      ppid = orphan_parent()
      assert.are_not.equal(core.getpid(), ppid)
      -- the runtime keeps it on (lua/moonbox/_tree.lua)
      assert.is_true(core.set_child_subreaper(true))
    end)
  end)
end)
