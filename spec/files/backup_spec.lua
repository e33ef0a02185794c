-- Backups (lua/moonbox/files/backup.lua): squashfs archives of a sandbox
-- directory, stored under the runtime's home, restored exactly; expiry,
-- listing, deletion, and the failure modes.
local moonbox = require "moonbox"
local backup = require "moonbox.files.backup"

-- a private store for this spec, removed at the end
local store
setup(function()
  store = helper.mkdtemp()
  backup.DIR = store .. "/backups"
end)
teardown(function()
  backup.DIR = nil
  helper.sh("rm -rf '" .. store .. "'")
end)

local function with_sandbox(fn)
  return run_task(function()
    local sb = helper.new_sandbox()
    local made = {}
    local ok, err = pcall(fn, sb, made)
    for _, id in ipairs(made) do pcall(moonbox.deleteBackup, id) end
    sb:destroy()
    if not ok then error(err, 0) end
  end)
end

local fails = helper.fails

-- commands run in the workspace and name paths relative to it (they hold
-- under isolation "none" too, where commands see the host)
local function sh(sb, cmd)
  local r = sb:exec(cmd, { cwd = "/workspace" })
  assert.equal(0, r.exitCode, r.stderr)
  return r.stdout
end

local TREE = "cd p && find . -printf '%p %y %m %s\\n' | sort && cat a.txt && readlink ln"

describe("backups", function()
  it("refuses bad options before anything runs", function()
    with_sandbox(function(sb)
      fails("VALIDATION_FAILED", sb.createBackup, sb, {})
      fails("VALIDATION_FAILED", sb.createBackup, sb, { dir = "relative" })
      fails("VALIDATION_FAILED", sb.createBackup, sb, { dir = "/workspace", bogus = 1 })
      fails("VALIDATION_FAILED", sb.createBackup, sb, { dir = "/workspace", ttl = 0 })
      fails("VALIDATION_FAILED", sb.createBackup, sb, { dir = "/workspace", gitignore = "yes" })
      fails("VALIDATION_FAILED", sb.createBackup, sb, { dir = "/workspace", name = ("n"):rep(257) })
      fails("VALIDATION_FAILED", sb.createBackup, sb, { dir = "/workspace", name = "a\nb" })
      fails("VALIDATION_FAILED", sb.createBackup, sb, { dir = "/workspace", excludes = "x" })
      fails("INVALID_BACKUP_CONFIG", sb.createBackup, sb, { dir = "/workspace", compression = "brotli" })
      fails("VALIDATION_FAILED", sb.restoreBackup, sb, "../x")
      fails("BACKUP_NOT_FOUND", sb.restoreBackup, sb, "00aa")
      fails("BACKUP_NOT_FOUND", moonbox.deleteBackup, "00aa")
    end)
  end)

  it("a missing directory fails FILE_NOT_FOUND and leaves nothing stored", function()
    with_sandbox(function(sb)
      local before = #moonbox.listBackups()
      fails("FILE_NOT_FOUND", sb.createBackup, sb, { dir = "/workspace/none" })
      sb:writeFile("/workspace/plain.txt", "x")
      fails("NOT_DIRECTORY", sb.createBackup, sb, { dir = "/workspace/plain.txt" })
      sb:deleteFile("/workspace/plain.txt")
      assert.equal(before, #moonbox.listBackups())
      assert.equal("", sh(sb, "ls -A"))
    end)
  end)

  it("takes out only a regular file the sandbox itself may read, whatever it puts at the archive's name", function()
    with_sandbox(function(sb)
      -- mksquashfs is the sandbox's own to replace (its PATH): the archive's
      -- name becomes a link out, a fifo (which would block the copy), or a
      -- sparse file posing as 10 GB for the host's disk
      sh(sb, "mkdir -p bin d && echo x > d/f")
      sb:setEnvVars { PATH = sb:host_path("/workspace") .. "/bin:/usr/bin:/bin" }
      for _, make in ipairs { 'ln -sf /proc/vmallocinfo "$2"', 'ln -sf ../../proc/vmallocinfo "$2"',
                              'mkfifo "$2"', 'truncate -s 10G "$2"' } do
        sb:writeFile("bin/mksquashfs", "#!/bin/sh\n" .. make .. "\n")
        sh(sb, "chmod +x bin/mksquashfs")
        local before = #moonbox.listBackups()
        local err = helper.error_of(sb.createBackup, sb, { dir = "/workspace/d" })
        assert.is_table(err, make)
        assert.equal("BACKUP_CREATE_FAILED", err.code, make)
        assert.equal(before, #moonbox.listBackups())
      end
    end)
  end)

  it("takes the seed's globstars in excludes: **/x at any depth, x/** as x", function()
    with_sandbox(function(sb)
      sh(sb, "mkdir -p g/sub/deep g/node_modules/x g/build && touch g/a.log g/sub/b.log g/sub/deep/c.log"
        .. " g/node_modules/x/m.js g/build/o g/keep")
      local b = sb:createBackup { dir = "/workspace/g", excludes = { "**/*.log", "**/node_modules/**", "build/**" } }
      sh(sb, "rm -rf g")
      sb:restoreBackup(b)
      assert.equal("./keep\n./sub\n./sub/deep\n", sh(sb, "cd g && find . -mindepth 1 | sort"))
      moonbox.deleteBackup(b.id)
    end)
  end)

  it("gitignore = true leaves out what git ignores there; outside a git work tree nothing", function()
    with_sandbox(function(sb)
      sh(sb, "mkdir -p r/build r/src && cd r && git init -q && printf 'build/\\n*.log\\nweird*\\n' > .gitignore"
        .. " && echo x > build/out && echo y > src/a.c && echo z > src/debug.log && echo w > 'weird[1]'"
        .. " && echo k > keep.txt && mkdir -p ../plain && echo 1 > ../plain/f.log")
      local b = sb:createBackup { dir = "/workspace/r", gitignore = true }
      local p = sb:createBackup { dir = "/workspace/plain", gitignore = true }
      sh(sb, "rm -rf r/* plain")
      sb:restoreBackup(b)
      sb:restoreBackup(p)
      assert.equal("./.gitignore\n./keep.txt\n./src\n./src/a.c\n",
        sh(sb, "cd r && find . -mindepth 1 -path ./.git -prune -o -print | sort"))
      assert.equal("1\n", sh(sb, "cat plain/f.log"))
      moonbox.deleteBackup(b.id)
      moonbox.deleteBackup(p.id)
    end)
  end)

  it("restores the directory exactly: content, modes, symlinks; later changes undone", function()
    with_sandbox(function(sb, made)
      sh(sb, "mkdir -p p/sub && printf 'hello\\n' > p/a.txt && chmod 640 p/a.txt"
        .. " && head -c 300000 /dev/urandom > p/sub/r.bin && ln -s a.txt p/ln"
        .. " && printf x > p/skip.log")
      local sum = sh(sb, "md5sum p/sub/r.bin")
      local b = sb:createBackup { dir = "/workspace/p", name = "first", excludes = { "*.log" }, ttl = 60 }
      made[#made + 1] = b.id
      assert.equal("/workspace/p", b.dir)
      assert.equal("first", b.name)
      assert.matches("^%x+$", b.id)
      -- stored under the home, and nothing left in the sandbox
      local f = assert(io.open(store .. "/backups/" .. b.id .. ".sqsh", "rb"))
      assert.equal("hsqs", f:read(4)) -- squashfs magic
      f:close()
      assert.equal("p\n", sh(sb, "ls -A"))
      local want = sh(sb, "rm p/skip.log && " .. TREE)
      sh(sb, "rm -rf p/sub && echo changed > p/a.txt && echo junk > p/junk")
      local r = sb:restoreBackup(b)
      assert.same({ success = true, dir = "/workspace/p", id = b.id }, r)
      assert.equal(want, sh(sb, TREE))
      assert.equal(sum, sh(sb, "md5sum p/sub/r.bin"))
      assert.equal("p\n", sh(sb, "ls -A"))
    end)
  end)

  it("a backup of one sandbox restores into another; the whole workspace too", function()
    with_sandbox(function(sb, made)
      sh(sb, "mkdir -p p && echo from-a > p/f")
      local b = sb:createBackup { dir = "/workspace" }
      made[#made + 1] = b.id
      local other = helper.new_sandbox()
      local ok, err = pcall(function()
        sh(other, "echo mine > own")
        other:restoreBackup(b.id)
        assert.equal("p\n", sh(other, "ls -A"))
        assert.equal("from-a\n", sh(other, "cat p/f"))
      end)
      other:destroy()
      assert(ok, err)
    end)
  end)

  it("restoring over the workspace removes its old content (symlinks not followed), nothing left beside", function()
    run_task(function()
      local root, outside = helper.mkdtemp(), helper.mkdtemp()
      helper.sh("echo keep > '" .. outside .. "/target'")
      local sb = helper.new_sandbox({ root = root })
      local ok, err = pcall(function()
        sh(sb, "echo new > n.txt")
        local b = sb:createBackup { dir = "/workspace" }
        sh(sb, "rm n.txt && mkdir -p old/deep && echo x > old/deep/f && chmod 000 old/deep"
          .. " && ln -s " .. outside .. " esc && ln -s " .. outside .. "/target esc2 && echo y > .hidden")
        sb:restoreBackup(b)
        moonbox.deleteBackup(b.id)
        assert.equal("n.txt\n", sh(sb, "ls -A"))
        assert.equal("new\n", sh(sb, "cat n.txt"))
      end)
      sb:destroy({ keepFiles = true }) -- (waits for the old content's removal)
      local left = helper.sh("ls -A '" .. root .. "'")
      local target = helper.sh("cat '" .. outside .. "/target'")
      helper.sh("rm -rf '" .. root .. "' '" .. outside .. "'")
      assert(ok, err)
      assert.equal("keep", target)
      assert.is_nil(left:find("moonbox-old", 1, true), left)
      assert.is_truthy(left:find("workspace", 1, true), left)
    end)
  end)

  it("removes a restore's old content a stopped runtime left beside the workspace, when the sandbox is back", function()
    run_task(function()
      local root = helper.mkdtemp()
      helper.new_sandbox({ root = root }):destroy({ keepFiles = true })
      -- what a runtime stopped during a restore's background removal leaves
      helper.sh("mkdir -p '" .. root .. "/.moonbox-old-abc/d' && echo x > '" .. root .. "/.moonbox-old-abc/d/f'")
      local sb = helper.new_sandbox({ root = root })
      local ok, err = pcall(function()
        assert.equal("ok\n", sb:exec("echo ok").stdout)
      end)
      sb:destroy({ keepFiles = true }) -- (waits for the removal)
      local left = helper.sh("ls -A '" .. root .. "'")
      helper.sh("rm -rf '" .. root .. "'")
      assert(ok, err)
      assert.is_nil(left:find("moonbox-old", 1, true), left)
      assert.is_truthy(left:find("workspace", 1, true), left)
    end)
  end)

  it("lists, deletes and expires backups", function()
    with_sandbox(function(sb, made)
      sh(sb, "mkdir q && echo 1 > q/f")
      local b1 = sb:createBackup { dir = "/workspace/q", name = "one" }
      local b2 = sb:createBackup { dir = "/workspace/q", ttl = 0.001 }
      made[#made + 1], made[#made + 2] = b1.id, b2.id
      moonbox.sleep(20)
      local ids = {}
      for _, b in ipairs(moonbox.listBackups()) do ids[b.id] = b end
      assert.is_truthy(ids[b1.id])
      assert.equal("one", ids[b1.id].name)
      assert.is_nil(ids[b2.id]) -- expired: gone from the list and from the disk
      fails("BACKUP_NOT_FOUND", sb.restoreBackup, sb, b2.id)
      assert.same({ success = true, id = b1.id }, moonbox.deleteBackup(b1.id))
      fails("BACKUP_NOT_FOUND", sb.restoreBackup, sb, b1)
      assert.is_nil(io.open(backup.dir() .. "/" .. b1.id .. ".sqsh", "rb"))
    end)
  end)

  it("getSandbox(id, {from = backup}) starts a new sandbox with the backup's content (a fork)", function()
    with_sandbox(function(sb, made)
      sh(sb, "mkdir -p p && echo original > p/f && printf x > top")
      local b = sb:createBackup { dir = "/workspace" }
      made[#made + 1] = b.id
      sh(sb, "echo changed-later > p/f")
      local root = helper.mkdtemp()
      local fork = moonbox.getSandbox(sb.id .. "-fork", { root = root, from = b,
        isolation = os.getenv("MOONBOX_TEST_ISOLATION") })
      local ok, err = pcall(function()
        assert.equal("original\n", sh(fork, "cat p/f"))
        assert.equal("x", sh(fork, "cat top"))
        sh(fork, "echo fork-only > p/f")
        assert.equal("changed-later\n", sh(sb, "cat p/f"))
        -- from makes a new sandbox: a live id is refused, as is a missing backup
        fails("VALIDATION_FAILED", moonbox.getSandbox, fork.id, { from = b })
        fails("BACKUP_NOT_FOUND", moonbox.getSandbox, sb.id .. "-fork2", { from = "00000000deadbeef" })
        assert.is_nil(require("moonbox.sandbox").all()[sb.id .. "-fork2"])
      end)
      fork:destroy()
      assert(ok, err)
    end)
  end)
end)
