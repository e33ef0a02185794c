-- Files API (lua/moonbox/files/init.lua): one `it` per behaviour, failure modes
-- first. Every test runs as a task in a sandbox with a fresh root, destroyed
-- at the end; run_task fails a test that leaves a handle or process behind.
local moonbox = require "moonbox"
local core = require "moonbox.core"
local files = require "moonbox.files"
local watch_mod = require "moonbox.files.watch"
local git_mod = require "moonbox.files.git"

local seq = 0
local mkdtemp = helper.mkdtemp

local function new_sandbox(opts)
  seq = seq + 1
  return helper.new_sandbox(opts)
end

-- handles open and not closing (a close callback may still be pending)
local function live_handles()
  return #select(2, core.open_handles())
end

local function with_sandbox(fn, opts)
  return run_task(function()
    local sb = new_sandbox(opts)
    local ok, err = pcall(fn, sb, sb.root .. "/workspace")
    sb:destroy()
    if not ok then error(err, 0) end
  end)
end

local fails = helper.fails

local function succeeds(cmd)
  local r = os.execute(cmd)
  return r == 0 or r == true
end

local function sh(cmd)
  assert(succeeds(cmd), "command failed: " .. cmd)
end

local function slurp(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("*a")
  f:close()
  return s
end

local fd_count = helper.fd_count

local ISO = "^%d%d%d%d%-%d%d%-%d%dT%d%d:%d%d:%d%d%.%d%d%dZ$"
local PNG_1x1 = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="

-- The next event of a watch iterator, or nil after ms.
local function next_event(it, ms)
  local ok, ev = pcall(moonbox.timeout, ms or 3000, function() return it() end)
  if ok then return ev end
  if type(ev) == "table" and ev.code == "TIMEOUT" then return nil end
  error(ev, 0)
end

-- Events until one satisfies pred (included); fails after ms without one.
local function events_until(it, pred, ms)
  local seen = {}
  while true do
    local ev = next_event(it, ms)
    assert(ev, "no matching event; saw: " .. table.concat((function()
      local t = {}
      for _, e in ipairs(seen) do t[#t + 1] = e.type .. " " .. e.path end
      return t
    end)(), ", "))
    seen[#seen + 1] = ev
    if pred(ev) then return seen end
  end
end

local function is(kind, path)
  return function(ev) return ev.type == kind and ev.path == path end
end

describe("files: validation", function()
  it("rejects an empty path or one with a NUL byte in every call, before anything runs", function()
    with_sandbox(function(sb)
      for _, bad in ipairs { "", "a\0b" } do
        fails("VALIDATION_FAILED", sb.writeFile, sb, bad, "x")
        fails("VALIDATION_FAILED", sb.readFile, sb, bad)
        fails("VALIDATION_FAILED", sb.readFileStream, sb, bad)
        fails("VALIDATION_FAILED", sb.mkdir, sb, bad)
        fails("VALIDATION_FAILED", sb.deleteFile, sb, bad)
        fails("VALIDATION_FAILED", sb.renameFile, sb, bad, "b")
        fails("VALIDATION_FAILED", sb.renameFile, sb, "a", bad)
        fails("VALIDATION_FAILED", sb.moveFile, sb, bad, "b")
        fails("VALIDATION_FAILED", sb.listFiles, sb, bad)
        fails("VALIDATION_FAILED", sb.exists, sb, bad)
        fails("VALIDATION_FAILED", sb.watch, sb, bad)
        fails("VALIDATION_FAILED", sb.gitCheckout, sb, "file:///x.git", { targetDir = bad })
      end
      fails("VALIDATION_FAILED", sb.readFile, sb, nil)
    end)
  end)

  it("rejects invalid base64 without creating the file", function()
    with_sandbox(function(sb, ws)
      for _, bad in ipairs { "not base64!", "YQ=", "Y", "YW=j", "YWJj\nZ", "YW\0Jj" } do
        local err = fails("VALIDATION_FAILED", sb.writeFile, sb, "b.bin", bad, { encoding = "base64" })
        assert.equal("content", err.context.field)
      end
      assert.is_nil(slurp(ws .. "/b.bin"))
    end)
  end)

  it("takes base64 in lines, as `base64` prints it: ASCII whitespace is skipped, as atob does", function()
    with_sandbox(function(sb, ws)
      for _, text in ipairs { "YWJjZA==\n", "YWJj\nZA==", " YWJj ZA== ", "YWJj\r\nZA==\r\n", "\tYWJjZA" } do
        sb:writeFile("w.bin", text, { encoding = "base64" })
        assert.equal("abcd", slurp(ws .. "/w.bin"), text)
      end
      local data = ("\0\1\2\255"):rep(5000)
      sb:writeFile("lines.bin", (core.base64_encode(data):gsub(("."):rep(76), "%0\n")), { encoding = "base64" })
      assert.is_true(slurp(ws .. "/lines.bin") == data)
    end)
  end)

  it("rejects unknown options, bad encodings, non-string content and an empty repo URL", function()
    with_sandbox(function(sb)
      fails("VALIDATION_FAILED", sb.writeFile, sb, "a", "x", { encoding = "latin1" })
      fails("VALIDATION_FAILED", sb.writeFile, sb, "a", "x", { mode = 420 })
      fails("VALIDATION_FAILED", sb.writeFile, sb, "a", 42)
      fails("VALIDATION_FAILED", sb.readFile, sb, "a", { encoding = "hex" })
      fails("VALIDATION_FAILED", sb.mkdir, sb, "d", { recursive = "yes" })
      fails("VALIDATION_FAILED", sb.listFiles, sb, ".", { deep = true })
      fails("VALIDATION_FAILED", sb.watch, sb, ".", { exclude = { 1 } })
      fails("VALIDATION_FAILED", sb.gitCheckout, sb, "")
      fails("VALIDATION_FAILED", sb.gitCheckout, sb, "   ")
      fails("VALIDATION_FAILED", sb.gitCheckout, sb, "file:///x.git", { depth = 0 })
      fails("VALIDATION_FAILED", sb.gitCheckout, sb, "file:///x.git", { branch = "--upload-pack=x" })
    end)
  end)

  it("raises SESSION_NOT_FOUND on a deleted session and POLICY_DENIED when onFile refuses", function()
    run_task(function()
      local seen = {}
      local sb = new_sandbox { policy = { hooks = { onFile = function(_, op, path)
        seen[#seen + 1] = op .. " " .. path
        if path:find("secret", 1, true) then return nil, "no secrets" end
        return true
      end } } }
      local s = sb:createSession { id = "gone" }
      sb:deleteSession("gone")
      fails("SESSION_NOT_FOUND", s.writeFile, s, "a", "x")
      local err = fails("POLICY_DENIED", sb.readFile, sb, "secret.txt")
      assert.matches("no secrets", err.message, 1, true)
      sb:writeFile("ok.txt", "fine")
      assert.same({ "readFile /workspace/secret.txt", "writeFile /workspace/ok.txt" }, seen)
      sb:destroy()
    end)
  end)
end)

describe("files: errors", function()
  it("raises FILE_NOT_FOUND for missing files, missing parents and missing sources", function()
    with_sandbox(function(sb)
      local err = fails("FILE_NOT_FOUND", sb.readFile, sb, "missing.txt")
      assert.equal("/workspace/missing.txt", err.context.path)
      assert.equal("ENOENT", err.context.errno)
      fails("FILE_NOT_FOUND", sb.readFileStream, sb, "missing.txt")
      fails("FILE_NOT_FOUND", sb.writeFile, sb, "no/parent.txt", "x")
      fails("FILE_NOT_FOUND", sb.mkdir, sb, "no/parent")
      fails("FILE_NOT_FOUND", sb.deleteFile, sb, "missing.txt")
      fails("FILE_NOT_FOUND", sb.renameFile, sb, "missing.txt", "b.txt")
      fails("FILE_NOT_FOUND", sb.moveFile, sb, "missing.txt", "b.txt")
      -- a source that exists and a destination whose directory does not:
      -- the error names the destination
      sb:writeFile("src.txt", "s")
      for _, op in ipairs { "renameFile", "moveFile" } do
        err = fails("FILE_NOT_FOUND", sb[op], sb, "src.txt", "no/b.txt")
        assert.equal("/workspace/no/b.txt", err.context.path)
        assert.matches("^" .. op .. " /workspace/no/b.txt: ENOENT", err.message)
      end
      fails("FILE_NOT_FOUND", sb.listFiles, sb, "missing")
      fails("FILE_NOT_FOUND", sb.watch, sb, "missing")
    end)
  end)

  it("raises FILE_EXISTS for mkdir of an existing directory without recursive, or over a file", function()
    with_sandbox(function(sb)
      sb:mkdir("d")
      fails("FILE_EXISTS", sb.mkdir, sb, "d")
      fails("FILE_EXISTS", sb.mkdir, sb, "/workspace")
      sb:writeFile("f", "x")
      fails("FILE_EXISTS", sb.mkdir, sb, "f")
      fails("FILE_EXISTS", sb.mkdir, sb, "f", { recursive = true })
    end)
  end)

  it("raises IS_DIRECTORY for deleting, reading or writing a directory", function()
    with_sandbox(function(sb)
      sb:mkdir("d")
      fails("IS_DIRECTORY", sb.deleteFile, sb, "d")
      fails("IS_DIRECTORY", sb.deleteFile, sb, "/workspace")
      fails("IS_DIRECTORY", sb.readFile, sb, "d")
      fails("IS_DIRECTORY", sb.readFileStream, sb, "d")
      fails("IS_DIRECTORY", sb.writeFile, sb, "d", "x")
      assert.is_true(sb:exists("d").exists)
    end)
  end)

  it("raises NOT_DIRECTORY when a file stands where a directory is needed", function()
    with_sandbox(function(sb)
      sb:writeFile("f", "x")
      fails("NOT_DIRECTORY", sb.listFiles, sb, "f")
      fails("NOT_DIRECTORY", sb.writeFile, sb, "f/x", "y")
      fails("NOT_DIRECTORY", sb.mkdir, sb, "f/x", { recursive = true })
      fails("NOT_DIRECTORY", sb.readFile, sb, "f/x")
    end)
  end)

  it("takes a trailing slash to name a directory, as the kernel does", function()
    with_sandbox(function(sb, ws)
      sb:writeFile("f", "x")
      sb:mkdir("d")
      fails("NOT_DIRECTORY", sb.readFile, sb, "f/")
      fails("NOT_DIRECTORY", sb.readFileStream, sb, "/workspace/f//")
      fails("NOT_DIRECTORY", sb.writeFile, sb, "f/", "y")
      fails("NOT_DIRECTORY", sb.deleteFile, sb, "f/")
      fails("NOT_DIRECTORY", sb.renameFile, sb, "f/", "g")
      fails("IS_DIRECTORY", sb.writeFile, sb, "new/", "y")
      assert.is_false(sb:exists("f/").exists)
      assert.is_false(sb:exists("new/").exists)
      assert.is_true(sb:exists("d/").exists)
      assert.is_true(sb:exists("f").exists)
      assert.equal("x", sb:readFile("f").content)
      assert.is_nil(io.open(ws .. "/new"))
      sb:writeFile("d/x", "1")
      assert.equal(1, #sb:listFiles("d/").files)
      sb:deleteFile("d/x")
      assert.is_true(sb:mkdir("e/").success)
      assert.is_true(sb:exists("e").exists)
    end)
  end)

  it("raises PERMISSION_DENIED when the OS refuses", function()
    with_sandbox(function(sb, ws)
      sb:writeFile("locked.txt", "x")
      if core.getuid() == 0 then
        -- root passes mode bits: an immutable file refuses even root
        if not succeeds("chattr +i " .. ws .. "/locked.txt 2>/dev/null") then
          return pending("chattr +i is not supported here")
        end
      else
        sh("chmod 000 " .. ws .. "/locked.txt")
      end
      local ok, err = pcall(function()
        fails("PERMISSION_DENIED", sb.writeFile, sb, "locked.txt", "y")
        if core.getuid() == 0 then fails("PERMISSION_DENIED", sb.deleteFile, sb, "locked.txt") end
      end)
      os.execute("chattr -i " .. ws .. "/locked.txt 2>/dev/null; chmod 644 " .. ws .. "/locked.txt")
      if not ok then error(err, 0) end
    end)
  end)

  it("raises NO_SPACE when the filesystem is full", function()
    -- the small filesystem is mounted before the sandbox exists, so that a
    -- sandbox with its own mount namespace sees it too
    local root = mkdtemp()
    sh("mkdir -p " .. root .. "/workspace/small")
    local small = root .. "/workspace/small"
    if core.getuid() ~= 0 or not succeeds("mount -t tmpfs -o size=16k tmpfs " .. small .. " 2>/dev/null") then
      return pending("needs root and mount to make a full filesystem")
    end
    local ok, err = pcall(with_sandbox, function(sb)
      fails("NO_SPACE", sb.writeFile, sb, "small/big.bin", ("x"):rep(1024 * 1024))
      -- the file the failed write made is gone; one that was there stays
      assert.is_false(sb:exists("small/big.bin").exists)
      sb:writeFile("small/old.txt", "old")
      fails("NO_SPACE", sb.writeFile, sb, "small/old.txt", ("x"):rep(1024 * 1024))
      assert.is_true(sb:exists("small/old.txt").exists)
      -- destroy removes the whole tree, and a mount point in it cannot go
      os.execute("umount " .. root .. "/workspace/small")
    end, { root = root })
    os.execute("umount " .. root .. "/workspace/small 2>/dev/null")
    if not ok then error(err, 0) end
  end)
end)

describe("files: confinement", function()
  it("refuses .. and absolute host paths that leave the sandbox", function()
    with_sandbox(function(sb)
      for _, p in ipairs { "../../etc/passwd", "/etc/passwd", "/workspace/../../etc/passwd", "/" } do
        local err = fails("PATH_OUTSIDE_SANDBOX", sb.readFile, sb, p)
        assert.equal(p, err.context.path)
      end
      fails("PATH_OUTSIDE_SANDBOX", sb.listFiles, sb, "/etc")
      fails("PATH_OUTSIDE_SANDBOX", sb.exists, sb, "/etc/passwd")
      if sb:info().isolation == "namespaces" then
        -- /tmp is the sandbox's own (a private tmpfs): reached, and not the host's
        sb:writeFile("/tmp/moonbox-escape", "x")
        assert.equal("x", sb:exec("cat /tmp/moonbox-escape").stdout)
      else
        fails("PATH_OUTSIDE_SANDBOX", sb.writeFile, sb, "/tmp/moonbox-escape", "x")
        fails("PATH_OUTSIDE_SANDBOX", sb.gitCheckout, sb, "file:///x.git", { targetDir = "/tmp/escape" })
      end
      assert.is_nil(slurp("/tmp/moonbox-escape"))
    end)
  end)

  it("makes files and directories as the sandbox's root (sb.idmap on the host, 0:0 inside)", function()
    with_sandbox(function(sb)
      local ids = sb:info().idmap
      sb:writeFile("/workspace/own.txt", "x")
      sb:mkdir("/workspace/own/deeper", { recursive = true })
      sb:renameFile("/workspace/own.txt", "/workspace/own/moved.txt")
      for _, rel in ipairs { "own", "own/deeper", "own/moved.txt" } do
        local st = assert(core.fs_stat_beneath(sb.workspace, rel))
        assert.equal(ids.uid, st.uid)
        assert.equal(ids.gid, st.gid)
      end
      if sb:info().isolation == "namespaces" then
        sb:writeFile("/tmp/own.txt", "x")
        sb:moveFile("/workspace/own/moved.txt", "/root/moved.txt") -- copied across mounts
        assert.equal("0:0 0:0 0:0", sb:exec("stat -c %u:%g /workspace/own/deeper /tmp/own.txt /root/moved.txt")
          .stdout:gsub("\n", " "):gsub(" $", ""))
      end
    end)
  end)

  it("reaches the sandbox's own /tmp and /root under namespaces, not its system directories", function()
    with_sandbox(function(sb)
      if sb:info().isolation ~= "namespaces" then
        -- there /tmp and /root are the host's: out of reach, nothing written
        local name = "/tmp/moonbox-files-" .. core.getpid() .. ".txt"
        fails("PATH_OUTSIDE_SANDBOX", sb.writeFile, sb, name, "tmp")
        fails("PATH_OUTSIDE_SANDBOX", sb.mkdir, sb, "/root/moonbox-files-" .. core.getpid())
        fails("PATH_OUTSIDE_SANDBOX", sb.listFiles, sb, "/tmp")
        assert.is_nil(io.open(name))
        return
      end
      sb:writeFile("/tmp/t.txt", "tmp")
      sb:mkdir("/root/d")
      sb:writeFile("/root/d/r.txt", "home")
      assert.equal("tmp|home", sb:exec("printf '%s|%s' \"$(cat /tmp/t.txt)\" \"$(cat /root/d/r.txt)\"").stdout)
      assert.equal("home", sb:readFile("/root/d/r.txt").content)
      sb:exec("echo made > /tmp/made")
      assert.equal("made\n", sb:readFile("/tmp/made").content)
      local names = {}
      for _, f in ipairs(sb:listFiles("/tmp").files) do names[f.name] = true end
      assert.is_true(names["t.txt"] and names.made)
      assert.is_nil(slurp("/tmp/t.txt")) -- the host's /tmp never saw it
      for _, p in ipairs { "/usr/bin/env", "/etc/passwd", "/proc/1/environ", "/dev/null", "/run/moonbox" } do
        fails("PATH_OUTSIDE_SANDBOX", sb.readFile, sb, p)
      end
    end)
  end)

  it("never follows a symlink out of the sandbox", function()
    with_sandbox(function(sb)
      sb:exec("ln -s /etc link && ln -s /etc/passwd pw && ln -s ../.. up")
      fails("PATH_OUTSIDE_SANDBOX", sb.readFile, sb, "link/passwd")
      fails("PATH_OUTSIDE_SANDBOX", sb.readFile, sb, "pw")
      fails("PATH_OUTSIDE_SANDBOX", sb.readFileStream, sb, "up/etc/passwd")
      fails("PATH_OUTSIDE_SANDBOX", sb.writeFile, sb, "link/moonbox-escape", "x")
      -- an existing file out there that we may not write: outside, never
      -- PERMISSION_DENIED (which would tell what exists there)
      fails("PATH_OUTSIDE_SANDBOX", sb.writeFile, sb, "pw", "x")
      fails("PATH_OUTSIDE_SANDBOX", sb.writeFile, sb, "link/passwd", "x")
      -- through a magic link (/proc/<pid>/root, never followed): outside too,
      -- while a symlink loop stays what it is
      sb:exec("ln -s /proc/1/root/etc/passwd magic && ln -s /proc/1/root rootlink && ln -s loopa loopb && " ..
        "ln -s loopb loopa")
      fails("PATH_OUTSIDE_SANDBOX", sb.readFile, sb, "magic")
      fails("PATH_OUTSIDE_SANDBOX", sb.writeFile, sb, "magic", "x")
      fails("PATH_OUTSIDE_SANDBOX", sb.readFile, sb, "rootlink/etc/passwd")
      fails("PATH_OUTSIDE_SANDBOX", sb.writeFile, sb, "rootlink/workspace/via-proc", "x")
      assert.equal("ELOOP", fails("FILESYSTEM_ERROR", sb.readFile, sb, "loopa").context.errno)
      assert.is_false(sb:exists("via-proc").exists)
      fails("PATH_OUTSIDE_SANDBOX", sb.listFiles, sb, "link")
      fails("PATH_OUTSIDE_SANDBOX", sb.mkdir, sb, "link/x")
      fails("PATH_OUTSIDE_SANDBOX", sb.renameFile, sb, "link/passwd", "stolen")
      fails("PATH_OUTSIDE_SANDBOX", sb.watch, sb, "link")
      -- a path swapped for such a symlink after watch's stat (the race
      -- file_race_spec runs): the watch itself finds it outside
      local afs = require("moonbox.lib.fs").awaited
      local stat = afs.stat_beneath
      afs.stat_beneath = function() return { type = "directory" } end
      local ok, err = pcall(sb.watch, sb, "link")
      afs.stat_beneath = stat
      assert.is_false(ok)
      assert.equal("PATH_OUTSIDE_SANDBOX", type(err) == "table" and err.code or tostring(err))
      assert.is_nil(slurp("/etc/moonbox-escape"))
      -- the symlink itself lives in the sandbox: it can be listed and removed
      local types = {}
      for _, f in ipairs(sb:listFiles(".").files) do types[f.name] = f.type end
      assert.equal("symlink", types.link)
      sb:deleteFile("link")
      assert.is_false(sb:exists("link").exists)
    end)
  end)

  it("follows symlinks that stay inside the sandbox", function()
    with_sandbox(function(sb)
      sb:exec("mkdir real && echo inside > real/f && ln -s real rel && ln -s .. up")
      assert.equal("inside\n", sb:readFile("rel/f").content)
      assert.equal("inside\n", sb:readFile("up/workspace/real/f").content)
    end)
  end)

  it("follows absolute symlinks as the sandbox's processes do, under namespaces", function()
    with_sandbox(function(sb)
      if sb:info().isolation ~= "namespaces" then
        -- there an absolute link names a host path: refused, even one that
        -- leads back into the workspace by its host path
        sb:exec("mkdir d && echo hi > d/t.txt && ln -s /workspace/d/t.txt alink && ln -s /etc/passwd pw" ..
          " && ln -s \"$PWD/d/t.txt\" hostlink")
        fails("PATH_OUTSIDE_SANDBOX", sb.readFile, sb, "alink")
        fails("PATH_OUTSIDE_SANDBOX", sb.readFile, sb, "pw")
        fails("PATH_OUTSIDE_SANDBOX", sb.readFile, sb, "hostlink")
        assert.equal("hi\n", sb:readFile("d/t.txt").content)
        return
      end
      sb:exec("mkdir d && echo hi > d/t.txt && echo tt > /tmp/x && ln -s /workspace/d/t.txt alink" ..
        " && ln -s /workspace/d adir && ln -s /tmp tmpl && ln -s /etc/passwd pw && ln -s /usr/bin ub")
      assert.equal("hi\n", sb:readFile("alink").content)
      assert.equal("hi\n", sb:readFile("adir/t.txt").content)
      assert.equal("tt\n", sb:readFile("tmpl/x").content)
      sb:writeFile("adir/new.txt", "n")
      assert.equal("n", sb:exec("cat d/new.txt").stdout)
      assert.equal(2, sb:listFiles("adir").count)
      assert.is_true(sb:exists("alink").exists)
      -- where a link leads must be in reach too
      fails("PATH_OUTSIDE_SANDBOX", sb.readFile, sb, "pw")
      fails("PATH_OUTSIDE_SANDBOX", sb.listFiles, sb, "ub")
      -- deleteFile and renameFile act on the link itself
      sb:renameFile("alink", "blink")
      assert.equal("symlink", sb:exec("stat -c %F blink").stdout:match("symbolic link") and "symlink")
      sb:deleteFile("blink")
      assert.is_false(sb:exists("blink").exists)
      assert.equal("hi\n", sb:readFile("d/t.txt").content)
    end)
  end)

  it("is not fooled by a symlink swapped in after the path was checked", function()
    local root_dir
    run_task(function()
      -- onFile runs after the path string was resolved and checked, right
      -- before the I/O: it swaps a directory for a symlink to /etc there
      local sb = new_sandbox { policy = { hooks = { onFile = function(_, op, path)
        if op == "readFile" and path == "/workspace/d/passwd" then
          sh("rm -rf " .. root_dir .. "/workspace/d && ln -s /etc " .. root_dir .. "/workspace/d")
        end
        return true
      end } } }
      root_dir = sb.root
      sb:exec("mkdir d && echo decoy > d/passwd")
      fails("PATH_OUTSIDE_SANDBOX", sb.readFile, sb, "d/passwd")
      sb:destroy()
    end)
  end)
end)

describe("files: writeFile and readFile", function()
  it("writes and reads text with every result field", function()
    with_sandbox(function(sb, ws)
      local w = sb:writeFile("/workspace/hello.txt", "hello\n")
      assert.is_true(w.success)
      assert.equal("/workspace/hello.txt", w.path)
      assert.matches(ISO, w.timestamp)
      assert.equal("hello\n", slurp(ws .. "/hello.txt"))
      local r = sb:readFile("hello.txt")
      assert.is_true(r.success)
      assert.equal("/workspace/hello.txt", r.path)
      assert.equal("hello\n", r.content)
      assert.equal("utf-8", r.encoding)
      assert.is_false(r.isBinary)
      assert.equal("text/plain", r.mimeType)
      assert.equal(6, r.size)
      assert.matches(ISO, r.timestamp)
      sb:writeFile("hello.txt", "short")
      assert.equal("short", sb:readFile("hello.txt").content)
    end)
  end)

  it("returns binary content as base64 unless asked otherwise; isBinary describes the content", function()
    with_sandbox(function(sb, ws)
      local w = sb:writeFile("dot.png", PNG_1x1, { encoding = "base64" })
      assert.equal("/workspace/dot.png", w.path)
      local bytes = slurp(ws .. "/dot.png")
      assert.equal("\137PNG", bytes:sub(1, 4))
      local r = sb:readFile("dot.png")
      assert.equal("base64", r.encoding)
      assert.is_true(r.isBinary)
      assert.equal("image/png", r.mimeType)
      assert.equal(PNG_1x1, r.content)
      assert.equal(#bytes, r.size)
      local raw = sb:readFile("dot.png", { encoding = "utf-8" })
      assert.equal(bytes, raw.content)
      assert.equal("utf-8", raw.encoding)
      assert.is_true(raw.isBinary)
      local text64 = sb:readFile((sb:writeFile("t.txt", "abc")).path, { encoding = "base64" })
      assert.equal("YWJj", text64.content)
      assert.is_false(text64.isBinary)
    end)
  end)

  it("names MIME types with libmagic: JSON, PNG, plain text, UTF-8 text and an empty file", function()
    with_sandbox(function(sb)
      sb:writeFile("data.json", '{"name": "moonbox", "list": [1, 2, 3]}\n')
      assert.equal("application/json", sb:readFile("data.json").mimeType)
      sb:writeFile("p.png", PNG_1x1, { encoding = "base64" })
      assert.equal("image/png", sb:readFile("p.png").mimeType)
      sb:writeFile("plain.txt", "just some words\n")
      assert.equal("text/plain", sb:readFile("plain.txt").mimeType)
      local u = sb:readFile((sb:writeFile("u.txt", "grüße, 世界\n")).path)
      assert.equal("text/plain", u.mimeType)
      assert.is_false(u.isBinary)
      assert.equal("grüße, 世界\n", u.content)
      local one = sb:readFile((sb:writeFile("one.txt", "A")).path)
      assert.equal("text/plain", one.mimeType)
      assert.is_false(one.isBinary)
      assert.equal("A", one.content)
      local controls = sb:readFile((sb:writeFile("ctl", "\1\2\3\4")).path)
      assert.is_true(controls.isBinary)
      local nul = sb:readFile((sb:writeFile("nul", "text\0more text")).path)
      assert.is_true(nul.isBinary)
      assert.equal("text\0more text", core.base64_decode(nul.content))
      local empty = sb:readFile((sb:writeFile("empty", "")).path)
      assert.equal("", empty.content)
      assert.is_false(empty.isBinary)
      assert.equal(0, empty.size)
    end)
  end)

  it("treats content that is not valid UTF-8 as binary", function()
    with_sandbox(function(sb)
      sb:writeFile("latin1.txt", "caf\233 cr\232me\n")
      local r = sb:readFile("latin1.txt")
      assert.is_true(r.isBinary)
      assert.equal("base64", r.encoding)
      assert.equal("caf\233 cr\232me\n", core.base64_decode(r.content))
    end)
  end)

  it("resolves relative paths against the session's current cwd, also after exec('cd sub')", function()
    with_sandbox(function(sb, ws)
      sb:exec("mkdir -p sub/deeper && cd sub")
      assert.equal("/workspace/sub/a.txt", sb:writeFile("a.txt", "A").path)
      assert.equal("A", slurp(ws .. "/sub/a.txt"))
      assert.equal("A", sb:exec("cat a.txt").stdout)
      sb:exec("cd deeper")
      assert.equal("A", sb:readFile("../a.txt").content)
      assert.equal("/workspace/sub/deeper", sb:mkdir("x").path:match("^(.*)/x$"))
      local s = sb:createSession { id = "other", cwd = "/workspace/sub" }
      assert.equal("A", s:readFile("a.txt").content)
      assert.is_false(s:exists("x").exists)
    end)
  end)

  it("waits behind the session's running command, like exec", function()
    with_sandbox(function(sb, ws)
      sb:exec("mkdir later")
      local r = moonbox.all(
        function() return sb:exec("sleep 0.2; cd later") end,
        function() return sb:writeFile("where.txt", "here") end)
      assert.equal("/workspace/later/where.txt", r[2].path)
      assert.equal("here", slurp(ws .. "/later/where.txt"))
    end)
  end)

  it("round-trips 100 MB of every byte value through base64 and readFileStream", function()
    helper.allow_lag(10000, "this spec builds and encodes 100 MB in Lua, and writeFile and readFile decode, " ..
      "classify and encode 100 MB in one call each on the loop")
    with_sandbox(function(sb)
      -- an independent copy, made by the shell
      sb:exec([[printf "$(printf '\\%03o' $(seq 0 255))" > one && for i in $(seq 14); do cat one one > two && ]] ..
        [[mv two one; done && for i in $(seq 25); do cat one; done > ref.bin && rm one]])
      local all = {}
      for i = 0, 255 do all[#all + 1] = string.char(i) end
      local data = table.concat(all):rep(100 * 1024 * 1024 / 256)
      sb:writeFile("big.bin", core.base64_encode(data), { encoding = "base64" })
      local cmp = sb:exec("cmp big.bin ref.bin && stat -c %s big.bin")
      assert.equal(0, cmp.exitCode, cmp.stderr)
      assert.equal("104857600\n", cmp.stdout)
      local r = sb:readFile("ref.bin")
      assert.is_true(r.isBinary)
      assert.equal("base64", r.encoding)
      assert.equal(104857600, r.size)
      assert.is_true(core.base64_decode(r.content) == data)
      r = nil -- luacheck: ignore 311
      local chunks, largest = {}, 0
      for chunk in sb:readFileStream("ref.bin") do
        chunks[#chunks + 1] = chunk
        if #chunk > largest then largest = #chunk end
      end
      assert.is_true(largest <= 64 * 1024)
      assert.is_true(table.concat(chunks) == data)
    end, { limits = { maxFileBytes = 200 * 1024 * 1024 } })
  end)

  it("refuses readFile of a file over the default 64 MiB limit", function()
    with_sandbox(function(sb)
      sb:exec("head -c 70000000 /dev/zero > z.bin")
      fails("FILE_TOO_LARGE", sb.readFile, sb, "z.bin")
    end)
  end)

  it("holds writeFile to limits.fileSizeBytes, as the sandbox's processes are: nothing of a bigger file is written",
    function()
    with_sandbox(function(sb)
      fails("FILE_TOO_LARGE", sb.writeFile, sb, "big.txt", ("x"):rep(1001))
      fails("FILE_TOO_LARGE", sb.writeFile, sb, "big.bin", core.base64_encode(("y"):rep(1001)), { encoding = "base64" })
      assert.is_false(sb:exists("big.txt").exists)
      assert.is_false(sb:exists("big.bin").exists)
      sb:writeFile("ok.txt", "old")
      fails("FILE_TOO_LARGE", sb.writeFile, sb, "ok.txt", ("x"):rep(2000))
      assert.equal("old", sb:readFile("ok.txt").content) -- (a file there before keeps its content)
      assert.is_true(sb:writeFile("edge.txt", ("z"):rep(1000)).success)
      assert.equal(1000, sb:readFile("edge.txt").size)
      -- as a command is held
      assert.equal(153, sb:exec("head -c 1001 /dev/zero > cmd.bin").exitCode) -- (SIGXFSZ: 128 + 25)
    end, { limits = { fileSizeBytes = 1000 } })
  end)
end)

describe("files: readFileStream", function()
  it("reads lazily in 64 KiB chunks and closes at the end or on close()", function()
    with_sandbox(function(sb)
      sb:exec("head -c 200000 /dev/zero | tr '\\0' 'q' > q.txt")
      local it = sb:readFileStream("q.txt")
      assert.equal("/workspace/q.txt", it.path)
      local first = it()
      assert.equal(65536, #first)
      sb:exec("truncate -s 70000 q.txt") -- read as asked: the rest is what is there now
      local rest = 0
      for chunk in it do rest = rest + #chunk end
      assert.equal(70000 - 65536, rest)
      assert.is_nil(it())
      local early = sb:readFileStream("q.txt")
      early()
      early:close()
      assert.is_nil(early())
    end)
  end)
end)

describe("files: cancellation and garbage collection", function()
  it("closes its file when the task is cancelled in the middle of a read or write", function()
    helper.allow_lag(3000, "this spec builds a 30 MB string and readFile returns 30 MB, classified on the loop")
    with_sandbox(function(sb)
      sb:exec("head -c 30000000 /dev/zero > z.bin")
      local data = ("w"):rep(30000000)
      local before = helper.steady(fd_count)
      for i = 1, 6 do
        pcall(moonbox.timeout, i % 3, function()
          if i % 2 == 0 then return sb:readFile("z.bin") end
          return sb:writeFile("w.bin", data)
        end)
      end
      -- requests still on the thread pool finish, then close
      helper.eventually(function() return fd_count() == before end, 10000)
      assert.equal(before, fd_count())
      assert.equal(30000000, sb:readFile("z.bin").size)
    end)
  end)

  it("releases a stream and a watch whose iterator is garbage collected", function()
    with_sandbox(function(sb)
      sb:writeFile("s.txt", ("s"):rep(100000))
      local handles, fds = helper.steady(core.open_handles), helper.steady(fd_count)
      local function abandon()
        local it = sb:readFileStream("s.txt")
        it()
        local open = core.open_handles()
        local w = sb:watch(".", { recursive = true })
        assert.is_true(core.open_handles() == open + 1 and w ~= nil)
      end
      abandon()
      collectgarbage()
      collectgarbage()
      helper.eventually(function() return core.open_handles() == handles and fd_count() == fds end)
      assert.equal(handles, core.open_handles())
      assert.equal(fds, fd_count())
    end)
  end)
end)

describe("files: mkdir, deleteFile, renameFile, moveFile", function()
  it("creates directories, recursively when asked, and accepts existing ones with recursive", function()
    with_sandbox(function(sb)
      local r = sb:mkdir("one")
      assert.is_true(r.success)
      assert.equal("/workspace/one", r.path)
      assert.is_false(r.recursive)
      assert.matches(ISO, r.timestamp)
      r = sb:mkdir("a/b/c", { recursive = true })
      assert.is_true(r.recursive)
      assert.equal("/workspace/a/b/c", r.path)
      assert.is_true(sb:mkdir("a/b", { recursive = true }).success)
      assert.is_true(sb:mkdir("/workspace", { recursive = true }).success)
      assert.equal(0, sb:exec("test -d a/b/c").exitCode)
    end)
  end)

  it("deletes files and symlinks (not their targets)", function()
    with_sandbox(function(sb)
      sb:writeFile("t.txt", "target")
      sb:exec("ln -s t.txt l")
      local r = sb:deleteFile("l")
      assert.is_true(r.success)
      assert.equal("/workspace/l", r.path)
      assert.matches(ISO, r.timestamp)
      assert.is_true(sb:exists("t.txt").exists)
      sb:deleteFile("/workspace/t.txt")
      assert.is_false(sb:exists("t.txt").exists)
    end)
  end)

  it("renames and moves, replacing a file and moving into an existing directory", function()
    with_sandbox(function(sb)
      sb:writeFile("a.txt", "A")
      local r = sb:renameFile("a.txt", "b.txt")
      assert.is_true(r.success)
      assert.equal("/workspace/a.txt", r.path)
      assert.equal("/workspace/b.txt", r.newPath)
      assert.matches(ISO, r.timestamp)
      sb:writeFile("c.txt", "C")
      sb:renameFile("c.txt", "b.txt")
      assert.equal("C", sb:readFile("b.txt").content)
      sb:mkdir("dir")
      r = sb:moveFile("b.txt", "dir")
      assert.equal("/workspace/b.txt", r.path)
      assert.equal("/workspace/dir/b.txt", r.newPath)
      r = sb:moveFile("/workspace/dir/b.txt", "/workspace/moved.txt")
      assert.equal("/workspace/moved.txt", r.newPath)
      assert.equal("C", sb:readFile("moved.txt").content)
      sb:renameFile("dir", "dir2")
      assert.is_true(sb:exists("dir2").exists)
    end)
  end)
end)

describe("files: listFiles and exists", function()
  it("lists entries with every FileInfo field, hiding dot-files unless includeHidden", function()
    with_sandbox(function(sb)
      sb:exec("mkdir -p sub && printf abc > sub/b.txt && printf 12345 > a.txt && chmod 640 a.txt && " ..
        "echo h > .hidden && ln -s a.txt link && chmod 750 sub")
      local r = sb:listFiles("/workspace")
      assert.is_true(r.success)
      assert.equal("/workspace", r.path)
      assert.matches(ISO, r.timestamp)
      assert.equal(3, r.count)
      assert.equal(#r.files, r.count)
      local a, link, sub = r.files[1], r.files[2], r.files[3]
      assert.equal("a.txt", a.name)
      assert.equal("/workspace/a.txt", a.absolutePath)
      assert.equal("a.txt", a.relativePath)
      assert.equal("file", a.type)
      assert.equal(5, a.size)
      assert.matches(ISO, a.modifiedAt)
      assert.equal("rw-r-----", a.mode)
      assert.is_true(a.permissions.readable)
      assert.is_true(a.permissions.writable)
      assert.is_false(a.permissions.executable)
      assert.equal("symlink", link.type)
      assert.equal("directory", sub.type)
      assert.equal("rwxr-x---", sub.mode)
      assert.is_true(sub.permissions.executable)
      local names = {}
      for _, f in ipairs(sb:listFiles(".", { includeHidden = true }).files) do names[#names + 1] = f.name end
      assert.same({ ".hidden", "a.txt", "link", "sub" }, names)
    end)
  end)

  it("lists recursively with paths relative to the listed directory", function()
    with_sandbox(function(sb)
      sb:exec("mkdir -p top/sub/.git top/.dot && touch top/a top/sub/b top/sub/.git/c top/.dot/d")
      local rel = {}
      for _, f in ipairs(sb:listFiles("top", { recursive = true }).files) do rel[#rel + 1] = f.relativePath end
      assert.same({ "a", "sub", "sub/b" }, rel)
      rel = {}
      for _, f in ipairs(sb:listFiles("top", { recursive = true, includeHidden = true }).files) do
        rel[#rel + 1] = f.relativePath
      end
      assert.same({ ".dot", ".dot/d", "a", "sub", "sub/.git", "sub/.git/c", "sub/b" }, rel)
      assert.equal("/workspace/top/sub/b", sb:listFiles("top", { recursive = true }).files[3].absolutePath)
    end)
  end)

  it("walks a deep tree holding one directory fd at a time, in the same order", function()
    with_sandbox(function(sb)
      -- 400 nested directories, a file and a sibling at the bottom
      local r = sb:exec("d=deep; for i in $(seq 400); do d=$d/a; done; mkdir -p $d && touch $d/f deep/z")
      assert.equal(0, r.exitCode, r.stderr)
      local base = helper.fd_count()
      local peak, done = base, false
      local res = moonbox.all(function()
        local ok, l = pcall(sb.listFiles, sb, "deep", { recursive = true })
        done = true
        if not ok then error(l, 0) end
        return l
      end, function()
        while not done do peak = math.max(peak, helper.fd_count()) moonbox.sleep(1) end
      end)[1]
      assert.equal(402, res.count)
      assert.equal("a", res.files[1].relativePath)
      assert.equal(("a/"):rep(399) .. "a", res.files[400].relativePath)
      assert.equal(("a/"):rep(400) .. "f", res.files[401].relativePath)
      assert.equal("z", res.files[402].relativePath) -- the top directory's next entry, after the subtree
      assert.is_true(peak - base < 16, ("%d fds open during the walk, %d before"):format(peak, base))
    end)
  end)

  it("caps the entries at limit and says so with truncated; refuses a bad limit", function()
    with_sandbox(function(sb)
      sb:exec("mkdir -p d/sub && touch d/a d/b d/c d/sub/x d/sub/y d/.h")
      local r = sb:listFiles("d")
      assert.same({ 4, false }, { r.count, r.truncated })
      r = sb:listFiles("d", { limit = 4 })
      assert.same({ 4, false }, { r.count, r.truncated }) -- exactly as many as there are
      r = sb:listFiles("d", { limit = 2 })
      assert.same({ 2, true, "a", "b" }, { r.count, r.truncated, r.files[1].name, r.files[2].name })
      local rel = {}
      r = sb:listFiles("d", { recursive = true, includeHidden = true, limit = 5 })
      for _, f in ipairs(r.files) do rel[#rel + 1] = f.relativePath end
      assert.same({ ".h", "a", "b", "c", "sub" }, rel)
      assert.is_true(r.truncated)
      r = sb:listFiles("d", { recursive = true, limit = 6 })
      assert.same({ 6, false, "sub/y" }, { r.count, r.truncated, r.files[6].relativePath })
      for _, bad in ipairs { 0, -1, 1.5, "10", files.LIST_MAX_LIMIT + 1 } do
        fails("VALIDATION_FAILED", sb.listFiles, sb, "d", { limit = bad })
      end
      fails("NOT_DIRECTORY", sb.listFiles, sb, "d/a")
      fails("FILE_NOT_FOUND", sb.listFiles, sb, "d/none")
    end)
  end)

  it("lists a directory of 50000 entries while the loop keeps turning", function()
    with_sandbox(function(sb, ws)
      -- made from the host side: a command in the sandbox would take longer
      helper.sh(("cd %q && mkdir big && cd big && seq -w 1 50000 | xargs touch"):format(ws))
      local ok, worst = pcall(helper.loop_stall, function()
        local r = sb:listFiles("big", { limit = 20000 })
        assert.same({ 20000, true, "00001", "20000" }, { r.count, r.truncated, r.files[1].name, r.files[20000].name })
        r = sb:listFiles("big", { limit = files.LIST_MAX_LIMIT })
        assert.same({ 50000, false, "50000" }, { r.count, r.truncated, r.files[50000].name })
        r = sb:listFiles("big")
        assert.same({ files.LIST_LIMIT, true }, { r.count, r.truncated })
      end)
      -- removed from the host side too: destroy's remove_tree is synchronous
      helper.sh(("rm -rf %q/big"):format(ws))
      if not ok then error(worst, 0) end
      -- read synchronously, 300k entries held every sandbox for 4.3 s
      assert.is_true(worst < 250, ("the loop stalled %.0f ms"):format(worst))
    end)
  end)

  it("says whether a file or directory exists; a dangling symlink does not", function()
    with_sandbox(function(sb)
      sb:exec("mkdir d && touch f && ln -s nowhere dangling")
      local r = sb:exists("f")
      assert.is_true(r.success)
      assert.is_true(r.exists)
      assert.equal("/workspace/f", r.path)
      assert.matches(ISO, r.timestamp)
      assert.is_true(sb:exists("/workspace/d").exists)
      assert.is_true(sb:exists("/workspace").exists)
      assert.is_false(sb:exists("nope").exists)
      assert.is_false(sb:exists("f/below").exists)
      assert.is_false(sb:exists("dangling").exists)
    end)
  end)
end)

describe("files: watch", function()
  it("reports create, modify, move and delete in order, with isDirectory", function()
    with_sandbox(function(sb)
      sb:mkdir("w")
      local it = sb:watch("w")
      assert.equal("/workspace/w", it.path)
      sb:exec("cd w && echo a > a.txt && echo b >> a.txt && mv a.txt b.txt && mkdir d && rm b.txt && rmdir d")
      local evs = events_until(it, is("delete", "/workspace/w/d"))
      local kinds = {}
      for _, ev in ipairs(evs) do
        kinds[#kinds + 1] = ev.type .. " " .. ev.path:gsub("^/workspace/w/", "")
        assert.matches(ISO, ev.timestamp)
        assert.is_boolean(ev.isDirectory)
      end
      local text = table.concat(kinds, ", ")
      assert.matches("^create a.txt, modify a.txt, .*move b.txt, create d, delete b.txt, delete d$", text)
      assert.equal("/workspace/w/a.txt", evs[#evs - 3].oldPath)
      assert.is_true(evs[#evs].isDirectory)
      assert.is_false(evs[1].isDirectory)
      it:close()
      assert.is_nil(it())
    end)
  end)

  it("keeps at most MAX_DIRS_PER_SANDBOX directories watched per sandbox, then says overflow once", function()
    local watch = require "moonbox.files.watch"
    local max = watch.MAX_DIRS_PER_SANDBOX
    watch.MAX_DIRS_PER_SANDBOX = 5
    local ok, err = pcall(with_sandbox, function(sb)
      sb:exec("mkdir -p w/a w/b")
      local it = sb:watch("/workspace/w", { recursive = true })
      local other = sb:watch("/workspace/w", { recursive = true })
      assert.equal(5, sb.watched_dirs) -- 3, then 2 of the second's 3
      sb:exec("mkdir w/c w/d && touch w/c/f")
      local evs = events_until(it, is("overflow", "/workspace/w"))
      assert.equal("overflow", evs[#evs].type)
      it:close()
      other:close()
      assert.equal(0, sb.watched_dirs)
    end)
    watch.MAX_DIRS_PER_SANDBOX = max
    assert(ok, err)
  end)

  it("reports nothing at the old path of a directory moved out of the tree, whatever happens in it next", function()
    with_sandbox(function(sb)
      sb:exec("mkdir -p w/d out")
      local it = sb:watch("/workspace/w", { recursive = true })
      -- at once after the move: within the wait for a moved-in half
      sb:exec("mv w/d out/d && echo x > out/d/x.txt && touch w/END")
      local kinds = {}
      for _, ev in ipairs(events_until(it, is("create", "/workspace/w/END"))) do
        kinds[#kinds + 1] = ev.type .. " " .. ev.path
      end
      assert.same({ "delete /workspace/w/d", "create /workspace/w/END" }, kinds)
      it:close()
    end)
  end)

  it("follows new subdirectories when recursive, also ones filled before their watch is in place", function()
    with_sandbox(function(sb)
      sb:mkdir("w")
      local it = sb:watch("/workspace/w", { recursive = true })
      sb:exec("mkdir w/sub")
      events_until(it, is("create", "/workspace/w/sub"))
      sb:writeFile("w/sub/f.txt", "x")
      events_until(it, is("create", "/workspace/w/sub/f.txt"))
      sb:exec("mkdir -p w/a/b/c && echo deep > w/a/b/c/g.txt")
      events_until(it, is("create", "/workspace/w/a/b/c/g.txt"))
      sb:exec("echo more >> w/a/b/c/g.txt")
      events_until(it, is("modify", "/workspace/w/a/b/c/g.txt"))
      sb:exec("mv w/a w/z && echo z > w/z/b/c/h.txt")
      local evs = events_until(it, is("create", "/workspace/w/z/b/c/h.txt"))
      -- the append above may still have a second modify queued before the move
      local move
      for _, ev in ipairs(evs) do if ev.type ~= "modify" then move = ev break end end
      assert.equal("move", move.type)
      assert.equal("/workspace/w/z", move.path)
      assert.equal("/workspace/w/a", move.oldPath)
      it:close()
    end)
  end)

  it("sets up a recursive watch on a big tree in slices, every directory watched (issue #14)", function()
    with_sandbox(function(sb)
      -- 80 x 50 directories: walked in one piece they held the loop ~0.4 s
      -- here; in slices the loop runs between them (the lag watchdog holds
      -- the bound)
      sb:exec("mkdir -p big && (cd big && for i in $(seq 80); do mkdir -p d$i && (cd d$i && mkdir $(seq 50)); done)")
      local it = sb:watch("big", { recursive = true })
      sb:exec("echo a > big/d1/1/first.txt && echo z > big/d80/50/last.txt && mkdir big/d20/25/new")
      events_until(it, is("create", "/workspace/big/d1/1/first.txt"))
      events_until(it, is("create", "/workspace/big/d80/50/last.txt"))
      events_until(it, is("create", "/workspace/big/d20/25/new"))
      sb:exec("echo n > big/d20/25/new/inside.txt")
      events_until(it, is("create", "/workspace/big/d20/25/new/inside.txt"))
      it:close()
    end)
  end)

  it("does not report subdirectories without recursive", function()
    with_sandbox(function(sb)
      sb:exec("mkdir -p w/sub")
      local it = sb:watch("w")
      sb:exec("echo x > w/sub/hidden.txt && echo y > w/top.txt")
      local evs = events_until(it, is("create", "/workspace/w/top.txt"))
      for _, ev in ipairs(evs) do assert.is_nil(ev.path:find("hidden", 1, true)) end
      it:close()
    end)
  end)

  it("excludes .git and node_modules unless include names them, and applies exclude globs", function()
    with_sandbox(function(sb)
      sb:exec("mkdir -p w/.git w/node_modules/pkg w/build")
      local it = sb:watch("w", { recursive = true, exclude = { "*.log", "build/**" } })
      sb:exec("(cd w && echo 1 > .git/HEAD && echo 2 > node_modules/pkg/i.js && echo 3 > x.log && " ..
        "echo 4 > build/out && mkdir .git/objects && echo 5 > keep.txt)")
      local evs = events_until(it, is("create", "/workspace/w/keep.txt"))
      for _, ev in ipairs(evs) do
        assert.is_nil(ev.path:find("%.git"), ev.path)
        assert.is_nil(ev.path:find("node_modules", 1, true), ev.path)
        assert.is_nil(ev.path:find("%.log$"), ev.path)
        assert.is_nil(ev.path:find("/build", 1, true), ev.path)
      end
      it:close()
      local git = sb:watch("w", { recursive = true, include = { ".git" } })
      sb:exec("echo 6 > w/.git/ORIG_HEAD && echo 7 > w/ignored.txt && echo 8 > w/.git/objects/o")
      local seen = events_until(git, is("create", "/workspace/w/.git/objects/o"))
      assert.equal("create", seen[1].type)
      assert.equal("/workspace/w/.git/ORIG_HEAD", seen[1].path)
      for _, ev in ipairs(seen) do assert.is_nil(ev.path:find("ignored", 1, true)) end
      git:close()
    end)
  end)

  it("ends with a delete when the watched directory goes, and close releases everything", function()
    with_sandbox(function(sb)
      sb:mkdir("gone")
      sb:exec("true") -- the default session and its warm spare are up
      local before = helper.steady(live_handles)
      local it = sb:watch("gone", { recursive = true })
      assert.is_true(live_handles() > before)
      sb:exec("rm -rf gone")
      local evs = events_until(it, is("delete", "/workspace/gone"))
      assert.is_true(evs[#evs].isDirectory)
      assert.is_nil(next_event(it, 1000))
      helper.eventually(function() return live_handles() == before end)
      assert.equal(before, live_handles())
      local again = sb:watch(".")
      again:close()
      helper.eventually(function() return live_handles() == before end)
      assert.equal(before, live_handles())
    end)
  end)

  it("watches a single file for modify and delete", function()
    with_sandbox(function(sb)
      sb:writeFile("one.txt", "1")
      local it = sb:watch("one.txt")
      sb:writeFile("one.txt", "2")
      events_until(it, is("modify", "/workspace/one.txt"))
      sb:deleteFile("one.txt")
      events_until(it, is("delete", "/workspace/one.txt"))
      assert.is_nil(next_event(it, 500))
    end)
  end)

  it("is released by deleteSession", function()
    with_sandbox(function(sb)
      local s = sb:createSession { id = "watcher" }
      local it = s:watch(".")
      local task = moonbox.spawn(function() return it() end)
      sb:deleteSession("watcher")
      assert.is_nil(task:wait())
    end)
  end)

  it("matches globs segment by segment", function()
    local cases = {
      { "*.log", "a.log", true }, { "*.log", "deep/dir/a.log", true }, { "*.log", "a.log.txt", false },
      { "build/**", "build", true }, { "build/**", "build/x/y", true }, { "build/**", "src/build/x", false },
      { "src/*.c", "src/a.c", true }, { "src/*.c", "src/sub/a.c", false }, { "**/*.c", "a/b/c.c", true },
      { "?.txt", "a.txt", true }, { "?.txt", "ab.txt", false }, { ".git", "x/.git/HEAD", true },
      { "[ab].md", "b.md", true }, { "[!ab].md", "b.md", false }, { "a.b", "axb", false },
    }
    for _, c in ipairs(cases) do
      assert.equal(c[3], watch_mod.glob_matches(c[1], c[2]), c[1] .. " vs " .. c[2])
    end
  end)

  it("matches globs without backtracking blow-up, and refuses a malformed one (issue #14)", function()
    -- as Lua patterns these took (length ^ stars) steps on every event
    local t0 = os.clock()
    assert.is_false(watch_mod.glob_matches(("*a"):rep(12) .. "*b", ("a"):rep(250)))
    assert.is_true(watch_mod.glob_matches(("*a"):rep(12) .. "*b", ("a"):rep(250) .. "b"))
    local deep = ("d/"):rep(200) .. "y"
    assert.is_false(watch_mod.glob_matches(("**/"):rep(12) .. "x", deep))
    assert.is_true(watch_mod.glob_matches(("**/"):rep(12) .. "y", deep))
    assert.is_true(watch_mod.glob_matches("*[%]*", "50%"))
    assert.is_true(os.clock() - t0 < 5) -- minutes without the fix
    with_sandbox(function(sb)
      fails("VALIDATION_FAILED", sb.watch, sb, ".", { include = { "[]" } })
    end)
  end)
end)

describe("files: gitCheckout", function()
  local G = "git -c user.name=moonbox -c user.email=moonbox@example.invalid -c init.defaultBranch=main "

  -- A bare repository with branches main (2 commits) and dev (3 commits).
  local function make_origin(sb, dir)
    local r = sb:exec("(" .. table.concat({
      G .. "init -q --bare " .. dir .. "/origin.git",
      G .. "init -q " .. dir .. "/src", "cd " .. dir .. "/src",
      "echo one > f", G .. "add f", G .. "commit -qm one", "echo two > f", G .. "commit -qam two",
      G .. "push -q ../origin.git HEAD:main", "git checkout -qb dev", "echo three > f", G .. "commit -qam three",
      G .. "push -q ../origin.git dev",
    }, " && ") .. ")")
    assert.equal(0, r.exitCode, r.stderr)
    return "file://" .. dir .. "/origin.git"
  end

  local function with_origin(fn)
    with_sandbox(function(sb)
      local dir = mkdtemp()
      local ok, err = pcall(function() fn(sb, make_origin(sb, dir)) end)
      os.execute("rm -rf " .. dir)
      if not ok then error(err, 0) end
    end)
  end

  it("clones a local repository that exists only on the host (file://), into nested directories", function()
    with_sandbox(function(sb)
      local dir = mkdtemp()
      sh("cd " .. dir .. " && " .. G .. "init -q --bare origin.git && " .. G .. "init -q src && cd src && " ..
        "echo host > f && " .. G .. "add f && " .. G .. "commit -qm one && " .. G .. "push -q ../origin.git HEAD:main")
      local url = "file://" .. dir .. "/origin.git"
      local r = sb:gitCheckout(url, { branch = "main", targetDir = "deep/er/repo" })
      assert.is_true(r.success)
      assert.equal("main", r.branch)
      assert.equal("/workspace/deep/er/repo", r.targetDir)
      assert.equal("host\n", sb:exec("cat deep/er/repo/f").stdout)
      fails("GIT_CLONE_FAILED", sb.gitCheckout, sb, url, { branch = "main", targetDir = "deep/er/repo" })
      if sb:info().isolation == "namespaces" then
        -- the clone and the directories made for it belong to root inside
        local r2 = sb:exec("find deep \\( ! -uid 0 -o ! -gid 0 \\) -print")
        assert.equal(0, r2.exitCode, r2.stderr)
        assert.equal("", r2.stdout)
        -- the host's clone is moved into the workspace's host directory: the
        -- private /tmp is refused, never reported done with nothing there
        fails("GIT_CLONE_FAILED", sb.gitCheckout, sb, url, { branch = "main", targetDir = "/tmp/repo" })
        assert.is_false(sb:exists("/tmp/repo").exists)
      end
      os.execute("rm -rf " .. dir)
    end)
  end)

  it("asks onExec before cloning a repository only the host has, and leaves nothing when it denies", function()
    local asked = {}
    with_sandbox(function(sb)
      local dir = mkdtemp()
      sh("cd " .. dir .. " && " .. G .. "init -q --bare origin.git && " .. G .. "init -q src && cd src && " ..
        "echo host > f && " .. G .. "add f && " .. G .. "commit -qm one && " .. G .. "push -q ../origin.git HEAD:main")
      local err = fails("POLICY_DENIED", sb.gitCheckout, sb, dir .. "/origin.git", { targetDir = "denied" })
      assert.truthy(err.message:find("no clones", 1, true))
      assert.is_false(sb:exists("denied").exists)
      assert.same({ "git", "clone" }, { asked[1][1], asked[1][2] })
      os.execute("rm -rf " .. dir)
    end, { policy = { hooks = { onExec = function(_, cmd)
      asked[#asked + 1] = cmd
      if type(cmd) == "table" and cmd[2] == "clone" then return nil, "no clones" end
      return cmd
    end } } })
  end)

  it("raises GIT_REPOSITORY_NOT_FOUND, GIT_BRANCH_NOT_FOUND and INVALID_GIT_URL", function()
    with_origin(function(sb, url)
      local err = fails("GIT_REPOSITORY_NOT_FOUND", sb.gitCheckout, sb, url .. "-missing")
      assert.is_string(err.context.stderr)
      fails("GIT_BRANCH_NOT_FOUND", sb.gitCheckout, sb, url, { branch = "nope", targetDir = "nb" })
      assert.is_false(sb:exists("nb").exists)
      for _, bad in ipairs { "not a url", "ftp://host/x.git", "-oProxyCommand=x", "relative/path", "https://" } do
        fails("INVALID_GIT_URL", sb.gitCheckout, sb, bad)
      end
    end)
  end)

  it("names the directory as git does: repo/.git, repo.git and repo/ are repo", function()
    local git = require "moonbox.files.git"
    for _, url in ipairs { "/workspace/repo/.git", "file:///w/repo/.git/", "https://h/x/repo.git", "/w/repo/",
                           "git@h:o/repo.git" } do
      assert.equal("repo", git.check_git_url(url), url)
    end
  end)

  it("maps git's messages to error codes", function()
    local cases = {
      { "fatal: Remote branch x not found in upstream origin", "GIT_BRANCH_NOT_FOUND" },
      { "fatal: could not read Username for 'https://github.com': terminal prompts disabled", "GIT_AUTH_FAILED" },
      { "fatal: Authentication failed for 'https://example.com/r.git/'", "GIT_AUTH_FAILED" },
      { "git@github.com: Permission denied (publickey).", "GIT_AUTH_FAILED" },
      { "remote: Repository not found.\nfatal: repository 'https://github.com/a/b.git/' not found",
        "GIT_REPOSITORY_NOT_FOUND" },
      { "fatal: '/x.git' does not appear to be a git repository", "GIT_REPOSITORY_NOT_FOUND" },
      { "fatal: unable to access 'https://x.invalid/r.git/': Could not resolve host: x.invalid",
        "GIT_NETWORK_ERROR" },
      { "fatal: unable to access 'https://h/r.git/': Failed to connect to h port 443", "GIT_NETWORK_ERROR" },
      { "fatal: destination path 'r' already exists and is not an empty directory.", "GIT_CLONE_FAILED" },
    }
    for _, c in ipairs(cases) do assert.equal(c[2], git_mod.git_error_code(c[1]), c[1]) end
  end)

  it("clones the default branch into /workspace/<repo name> and reports the branch checked out", function()
    with_origin(function(sb, url)
      local r = sb:gitCheckout(url)
      assert.is_true(r.success)
      assert.equal(url, r.repoUrl)
      assert.equal("main", r.branch)
      assert.equal("/workspace/origin", r.targetDir)
      assert.matches(ISO, r.timestamp)
      assert.equal("two\n", sb:readFile("/workspace/origin/f").content)
      assert.equal("2\n", sb:exec("git -C origin rev-list --count HEAD").stdout)
    end)
  end)

  it("clones a branch into targetDir, relative to the session's cwd, with depth", function()
    with_origin(function(sb, url)
      sb:exec("mkdir -p clones && cd clones")
      local r = sb:gitCheckout(url, { branch = "dev", targetDir = "dev-copy", depth = 1, timeout = 60000 })
      assert.equal("dev", r.branch)
      assert.equal("/workspace/clones/dev-copy", r.targetDir)
      assert.equal("three\n", sb:readFile("dev-copy/f").content)
      assert.equal("1\n", sb:exec("git -C dev-copy rev-list --count HEAD").stdout)
      fails("GIT_CLONE_FAILED", sb.gitCheckout, sb, url, { targetDir = "dev-copy" })
      -- the same as a plain path (git itself ignores --depth there)
      sb:gitCheckout(url:gsub("^file://", ""), { branch = "dev", targetDir = "plain", depth = 1 })
      assert.equal("1\n", sb:exec("git -C plain rev-list --count HEAD").stdout)
    end)
  end)

  it("a destroy or deleteSession ends a clone under way, the host-side one too: coded error, no git left", function()
    run_task(function()
      local dir = mkdtemp()
      -- big enough to be still cloning when the destroy comes
      sh("cd " .. dir .. " && " .. G .. "init -q src && cd src && head -c 60000000 /dev/urandom > big && " ..
        G .. "add big && " .. G .. "commit -qm big")
      local url = "file://" .. dir .. "/src"
      local function gits() return helper.sh("pgrep -f '[g]it.* clone .*" .. dir .. "/src' || true") end
      for _, how in ipairs { "destroy", "deleteSession" } do
        local sb = new_sandbox()
        local s = sb:createSession { id = "cloner" }
        local r = moonbox.all(function() return { pcall(s.gitCheckout, s, url, { targetDir = "r" }) } end,
          function()
            assert.is_true(helper.eventually(function() return gits() ~= "" end))
            if how == "destroy" then sb:destroy() else sb:deleteSession("cloner") end
            return gits()
          end)
        assert.is_false(r[1][1], how)
        assert.is_table(r[1][2], how .. ": " .. tostring(r[1][2]))
        local want = how == "destroy" and "SANDBOX_DESTROYED" or "SESSION_DESTROYED"
        assert.equal(want, r[1][2].code, how .. ": " .. tostring(r[1][2].message))
        assert.equal("", r[2], how .. ": git still running when the call returned")
        if how == "destroy" then
          assert.is_nil(io.open(sb.root), "the root is not made again")
        else
          assert.is_false(sb:exists("r").exists)
          assert.equal("", sb:exec("ls -A /workspace").stdout)
          sb:destroy()
        end
      end
      os.execute("rm -rf " .. dir)
    end)
  end)

  it("raises GIT_CLONE_FAILED after a timeout and removes the partial clone", function()
    with_origin(function(sb, url)
      local err = fails("GIT_CLONE_FAILED", sb.gitCheckout, sb, url, { targetDir = "slow", timeout = 1 })
      assert.is_true(err.context.timedOut)
      assert.is_false(sb:exists("slow").exists)
    end)
  end)
end)
