-- core.fs_remove_tree and core.fs_lock (src/fs_tree.c) through their
-- moonbox.lib.fs wrappers: a tree of any depth goes without path strings and
-- without following a symlink; a root's lock is one open file's at a time.
local core = require "moonbox.core"
local fs = require "moonbox.lib.fs"

local sh = helper.sh

local function exists(path)
  return fs.lstat_beneath("/", path, "in_root") ~= nil
end

-- A chain of depth directories "d" under dir, a file f in each, made with
-- dirfd-relative calls (the path of the deepest one is far beyond PATH_MAX).
local function deep_tree(dir, depth)
  local fd = assert(core.fs_open_dir(dir))
  for _ = 1, depth do
    assert(fs.mkdir_beneath(fd, "d"))
    local w = assert(core.fs_open_beneath(fd, "d/f", "w", 420, "beneath"))
    core.close_fd(w)
    local next_fd = assert(core.fs_open_beneath(fd, "d", 65536 + 2097152, 0, "beneath")) -- O_DIRECTORY|O_PATH
    core.close_fd(fd)
    fd = next_fd
  end
  return fd
end

describe("core.fs_remove_tree", function()
  it("removes a 2100-level tree and never follows a symlink out of it", function()
    local tmp = helper.mkdtemp()
    local canary = tmp .. "/canary"
    sh("mkdir -p " .. canary .. "/keep && echo precious > " .. canary .. "/keep/file")
    sh("mkdir " .. tmp .. "/t")
    local bottom = deep_tree(tmp .. "/t", 2100)
    -- a symlink at the bottom to a directory outside the tree
    assert(sh(("ln -s %s /proc/%d/fd/%d/link && echo ok"):format(canary, core.getpid(), bottom)) == "ok")
    sh(("ln -s %s/keep /proc/%d/fd/%d/link2"):format(canary, core.getpid(), bottom))
    core.close_fd(bottom)
    run_task(function()
      local n = assert(fs.remove_tree(tmp, "t"))
      assert.are.equal(2100 * 2 + 2 + 1, n) -- dirs, files, two links, t itself
    end)
    assert.is_false(exists(tmp .. "/t"))
    assert.are.equal("precious", sh("cat " .. canary .. "/keep/file"))
    sh("rm -rf " .. tmp)
  end)

  it("removes a file or a symlink itself, and an empty directory", function()
    local tmp = helper.mkdtemp()
    sh(("cd %s && echo x > f && ln -s /etc l && mkdir e"):format(tmp))
    run_task(function()
      assert.are.equal(1, fs.remove_tree(tmp, "f"))
      assert.are.equal(1, fs.remove_tree(tmp, "l"))
      assert.are.equal(1, fs.remove_tree(tmp, "e"))
    end)
    assert.are.equal("", sh("ls -A " .. tmp))
    assert.is_true(exists("/etc/passwd"))
    sh("rm -rf " .. tmp)
  end)

  it("stays under its root: an escaping path is PATH_OUTSIDE_SANDBOX, a missing one ENOENT", function()
    local tmp = helper.mkdtemp()
    sh("mkdir -p " .. tmp .. "/root " .. tmp .. "/outside/x")
    sh("ln -s ../outside " .. tmp .. "/root/esc")
    run_task(function()
      local r, msg, code = fs.remove_tree(tmp .. "/root", "../outside")
      assert.is_nil(r)
      assert.are.equal("PATH_OUTSIDE_SANDBOX", code, msg)
      r, msg, code = fs.remove_tree(tmp .. "/root", "esc/x")
      assert.is_nil(r)
      assert.are.equal("PATH_OUTSIDE_SANDBOX", code, msg)
      r, msg, code = fs.remove_tree(tmp .. "/root", "missing")
      assert.is_nil(r)
      assert.are.equal("ENOENT", code, msg)
    end)
    assert.is_true(exists(tmp .. "/outside/x"))
    sh("rm -rf " .. tmp)
  end)

  it("gives the owner's own locked-up directories back to it, and reports what it cannot remove", function()
    local tmp = helper.mkdtemp()
    sh(("mkdir -p %s/t/x/y %s/t/z && touch %s/t/x/y/f %s/t/z/g && chmod 000 %s/t/x/y %s/t/z && chmod 555 %s/t/x")
      :format(tmp, tmp, tmp, tmp, tmp, tmp, tmp))
    run_task(function()
      assert.are.equal(6, fs.remove_tree(tmp, "t"))
    end)
    assert.is_false(exists(tmp .. "/t"))
    -- a mount point cannot be removed: in a runtime with a mount namespace of
    -- its own (unshare -Urm), so root and unprivileged runs alike
    sh(("mkdir -p %s/t/a/b && echo x > %s/t/a/b/f"):format(tmp, tmp))
    local script = tmp .. "/child.lua"
    local f = assert(io.open(script, "w"))
    f:write(([[
local fs = require "moonbox.lib.fs"
assert(os.execute("mount -t tmpfs tmpfs %s/t/a/b") == 0)
print(fs.remove_tree(%q, "t"))
]]):format(tmp, tmp))
    f:close()
    local out = sh(("unshare -Urm %s %s 2>&1"):format(os.getenv("MOONBOX_BIN") or "build/moonbox", script))
    assert.is_truthy(out:find("^nil\tEBUSY: [^\n]*remove_tree: rmdir 'b' at depth 2[^\n]*\tEBUSY$"), out)
    sh("rm -rf " .. tmp)
  end)
end)

describe("core.fs_remove_tree with creds", function()
  it("walks with the filesystem ids given, and refuses ids the runtime may not take", function()
    local tmp = helper.mkdtemp()
    sh(("mkdir -p %s/mine/x && touch %s/mine/x/f && chmod 755 %s"):format(tmp, tmp, tmp))
    local me = { uid = core.getuid(), gid = core.getgid() }
    run_task(function()
      if me.uid == 0 then
        -- as nobody, root's files are out of reach; nobody's own are not
        sh(("mkdir -p %s/nob/y && touch %s/nob/y/g && chown -R 65534:65534 %s/nob"):format(tmp, tmp, tmp))
        local nobody = { uid = 65534, gid = 65534 }
        local r, msg, code = fs.remove_tree(tmp, "mine", nil, nobody)
        assert.is_nil(r)
        assert.are.equal("EACCES", code, msg)
        assert.are.equal(2, fs.remove_tree(tmp .. "/nob", "y", nil, nobody))
        -- the loop thread kept its own ids
        assert.are.equal(3, fs.remove_tree(tmp, "mine"))
      else
        assert.are.equal(3, fs.remove_tree(tmp, "mine", nil, me))
        sh(("mkdir -p %s/again && touch %s/again/f"):format(tmp, tmp))
        local r, msg, code = fs.remove_tree(tmp, "again", nil, { uid = 0, gid = 0 })
        assert.is_nil(r)
        assert.are.equal("EPERM", code, msg)
        assert.is_true(exists(tmp .. "/again/f"))
      end
    end)
    assert.is_false(exists(tmp .. "/mine"))
    sh("rm -rf " .. tmp)
  end)
end)

describe("core.fs_lock", function()
  it("is one open file's at a time, says its holder's words, and frees on close", function()
    local tmp = helper.mkdtemp()
    local path = tmp .. "/.lock"
    local fd = assert(fs.lock(path, "111\n"))
    assert.are.equal("111", sh("cat " .. path))
    local none, msg, code, holder = fs.lock(path, "222\n")
    assert.is_nil(none, msg)
    assert.are.equal("EAGAIN", code)
    assert.are.equal("111\n", holder)
    core.close_fd(fd)
    fd = assert(fs.lock(path, "333\n"))
    assert.are.equal("333", sh("cat " .. path))
    -- a lock on a file that was removed meanwhile is not "the" lock
    sh("rm " .. path)
    local fd2 = assert(fs.lock(path, "444\n"))
    assert.are.equal("444", sh("cat " .. path))
    core.close_fd(fd)
    core.close_fd(fd2)
    -- never through a final symlink
    sh(("ln -s %s/target %s/link"):format(tmp, tmp))
    none, msg, code = fs.lock(tmp .. "/link", "1")
    assert.is_nil(none)
    assert.are.equal("ELOOP", code, msg)
    assert.is_false(exists(tmp .. "/target"))
    -- shorter words after longer ones leave nothing of the longer
    fd = assert(fs.lock(path, "a longer holder\n"))
    core.close_fd(fd)
    fd = assert(fs.lock(path, "s\n"))
    assert.are.equal("s\n", sh("cat " .. path .. "; echo"))
    core.close_fd(fd)
    sh("rm -rf " .. tmp)
  end)
end)

describe("core.rmdir_tree", function()
  local function rmdir_tree(path)
    return run_task(function()
      local async = require "moonbox.async"
      return async.await(function(resume)
        assert(core.rmdir_tree(path, function(err, n, code) resume({ err = err, n = n, code = code }) end))
      end)
    end)
  end

  it("removes a tree of directories, deepest first, on the thread pool", function()
    local tmp = helper.mkdtemp()
    sh(("mkdir -p %s/t/a/b/c %s/t/d"):format(tmp, tmp))
    local r = rmdir_tree(tmp .. "/t")
    assert.is_nil(r.err)
    assert.are.equal(5, r.n) -- t, a, b, c, d
    assert.is_false(exists(tmp .. "/t"))
    -- already gone: nothing to do
    r = rmdir_tree(tmp .. "/t")
    assert.is_nil(r.err)
    assert.are.equal(0, r.n)
    sh("rm -rf " .. tmp)
  end)

  it("unlinks no file and follows no symlink: their directories stay, with an error", function()
    local tmp = helper.mkdtemp()
    sh(("mkdir -p %s/t/a %s/outside/keep && echo precious > %s/t/a/file && ln -s %s/outside %s/t/link")
      :format(tmp, tmp, tmp, tmp, tmp))
    local r = rmdir_tree(tmp .. "/t")
    assert.are.equal("ENOTEMPTY", r.code, r.err)
    assert.are.equal("precious", sh("cat " .. tmp .. "/t/a/file"))
    assert.are.equal("keep", sh("ls " .. tmp .. "/outside"))
    assert.are.equal("a\nlink", sh("ls " .. tmp .. "/t"))
    sh("rm -rf " .. tmp)
  end)

  it("removes a cgroup tree (cgroup mode) and refuses a relative path", function()
    local tree = require "moonbox.process.tree"
    local cgroup = require "moonbox.process.cgroup"
    if tree.mode() == "cgroup" then
      local dir = cgroup.base() .. "/rmdir-tree-spec"
      assert(core.mkdir(dir))
      assert(core.mkdir(dir .. "/child"))
      assert(core.mkdir(dir .. "/child/grandchild"))
      local r = rmdir_tree(dir)
      assert.is_nil(r.err)
      assert.are.equal(3, r.n)
      assert.is_nil(io.open(dir .. "/cgroup.procs"))
    end
    assert.has_error(function() core.rmdir_tree("relative/path", function() end) end)
  end)
end)
