-- Sandboxes made from an image (getSandbox{image = REF}, sandbox/image.lua,
-- the overlay root of src/nsinit.c): the image's files, not the host's;
-- writes in the sandbox's own upper dir only; the OCI layer rules seen
-- from inside; the image's config applied; an image without bash, and
-- symlinks planted where the runtime builds the root, fail closed.
local images = require "moonbox.images"
local fx = require "images.fixtures"

local fails = helper.fails
local tmp, ref
setup(function()
  tmp = helper.mkdtemp()
  images.store.DIR = tmp .. "/store"
  fx.oci(tmp .. "/oci", "v1", fx.layered_desc())
  ref = "oci:" .. tmp .. "/oci:v1"
end)
teardown(function()
  images.store.DIR = nil
  helper.sh("rm -rf '" .. tmp .. "'")
end)

local function sh(sb, cmd)
  local r = sb:exec(cmd)
  assert.equal(0, r.exitCode, r.stderr)
  return (r.stdout:gsub("\n$", ""))
end

local function image_sandbox(fn, image)
  return run_task(function()
    local sb = helper.new_sandbox { image = image or ref, isolation = "namespaces" }
    local ok, err = pcall(fn, sb)
    sb:destroy()
    if not ok then error(err, 0) end
  end)
end

describe("a sandbox from an image", function()
  it("runs the image's files with the image's Env and WorkingDir", function()
    image_sandbox(function(sb)
      assert.equal("ID=moonbox-test-image", sh(sb, "head -n 1 /etc/os-release"))
      assert.equal("hello from the image", sh(sb, "echo $IMAGE_GREETING"))
      assert.equal("/srv", sh(sb, "pwd"))
      -- the host's /usr is not there
      assert.equal("no", sh(sb, "test -e /usr/bin/python3 && echo yes || echo no"))
      local info = sb:info().image
      assert.equal(ref, info.name)
      assert.equal(images.get(ref).digest, info.digest)
      assert.equal(2, info.layers)
      assert.same({ "/bin/sh" }, info.cmd)
      assert.equal("/srv", info.workingDir)
      -- the file API reads the same root
      assert.equal("ID=moonbox-test-image", sb:readFile("/etc/os-release").content:match("^[^\n]*"))
    end)
  end)

  it("applies whiteouts, opaque dirs and hard links", function()
    image_sandbox(function(sb)
      assert.equal("gone", sh(sb, "test -e /etc/doomed && echo there || echo gone"))
      assert.equal("new", sh(sb, "ls /opt | grep -v moonbox"))
      local a, b = sh(sb, "stat -c %i /srv/data"), sh(sb, "stat -c %i /srv/data-link")
      assert.equal(a, b)
      assert.equal("shared inode", sh(sb, "cat /srv/data-link"))
      -- root of the image is root inside
      assert.equal("0:0", sh(sb, "stat -c %u:%g /bin/busybox"))
    end)
  end)

  it("writes land in the sandbox's upper dir only", function()
    local root1
    run_task(function()
      local sb1 = helper.new_sandbox { image = ref, isolation = "namespaces" }
      local sb2 = helper.new_sandbox { image = ref, isolation = "namespaces" }
      local ok, err = pcall(function()
      root1 = sb1.root
      sh(sb1, "echo mine > /etc/added && echo changed > /srv/data && rm /etc/os-release")
      assert.equal("mine", sh(sb1, "cat /etc/added"))
      assert.equal("changed", sh(sb1, "cat /srv/data"))
      sb1:writeFile("/etc/by-api", "api")
      -- its layers stay while a sandbox stands on them
      local e = fails("VALIDATION_FAILED", images.remove, ref)
      assert.matches("in use by sandbox", e.message, 1, true)
      -- the other sandbox of the image sees the image as it was
      assert.equal("absent", sh(sb2, "cat /etc/added 2>/dev/null || echo absent"))
      assert.equal("shared inode", sh(sb2, "cat /srv/data"))
      assert.equal("ID=moonbox-test-image", sh(sb2, "head -n 1 /etc/os-release"))
      -- on the host: in sb1's upper dir, not in any layer
      assert.equal("mine\n", helper.sh("cat '" .. root1 .. "/image/upper/etc/added'") .. "\n")
      assert.equal("api", helper.sh("cat '" .. root1 .. "/image/upper/etc/by-api'"))
      for _, hex in ipairs(images.get(ref).layers) do
        local dir = images.store.layer_path(hex, images.default_owner())
        assert.equal("", helper.sh("ls '" .. dir .. "/etc/added' '" .. dir .. "/etc/by-api' 2>/dev/null"))
      end
      local l2 = images.store.layer_path(images.get(ref).layers[2], images.default_owner())
      assert.equal("shared inode", helper.sh("cat '" .. l2 .. "/srv/data'"))
      local l1 = images.store.layer_path(images.get(ref).layers[1], images.default_owner())
      assert.matches("^ID=moonbox%-test%-image", helper.sh("cat '" .. l1 .. "/etc/os-release'"))
      end)
      sb1:destroy()
      sb2:destroy()
      if not ok then error(err, 0) end
    end)
  end)

  it("is rebuilt over the same image and upper dir when its init dies", function()
    image_sandbox(function(sb)
      sh(sb, "echo survived > /etc/kept")
      assert.equal(0, os.execute("kill -9 " .. sb:info().initPid) and 0 or 1)
      assert.is_true(helper.eventually(function() return sb.init_dead end, 10000))
      pcall(sb.exec, sb, "true") -- SANDBOX_RESTARTED, reported once
      assert.equal("survived", sh(sb, "cat /etc/kept"))
      assert.equal("ID=moonbox-test-image", sh(sb, "head -n 1 /etc/os-release"))
      assert.equal(1, sb:info().restarts)
    end)
  end)

  it("keeps its upper dir with its root: got again, from the same image", function()
    run_task(function()
      local root = helper.mkdtemp()
      local sb = helper.new_sandbox { image = ref, isolation = "namespaces", root = root }
      local id = sb.id
      sh(sb, "echo kept > /etc/kept")
      sb:destroy { keepFiles = true }
      -- without naming the image: the root says which
      sb = require("moonbox").getSandbox(id, { root = root, isolation = "namespaces" })
      local ok, err = pcall(function()
        assert.equal("kept", sh(sb, "cat /etc/kept"))
        assert.equal(images.get(ref).digest, sb:info().image.digest)
      end)
      sb:destroy { keepFiles = true }
      if not ok then error(err, 0) end
      -- another image over it is refused
      fx.oci(tmp .. "/other", "latest", { layers = { { entries = fx.shell_entries() } } })
      local e = fails("VALIDATION_FAILED", require("moonbox").getSandbox, id,
        { root = root, isolation = "namespaces", image = "oci:" .. tmp .. "/other" })
      assert.matches("was made from image", e.message, 1, true)
    end)
  end)

  it("commits its changes as a new image another sandbox starts from", function()
    run_task(function()
      local sb = helper.new_sandbox { image = ref, isolation = "namespaces" }
      local rec
      local ok, err = pcall(function()
        -- (a directory removed and made again: opaque in the upper dir)
        sh(sb, "echo added > /etc/added && rm /etc/os-release && rm -r /srv && mkdir /srv"
          .. " && echo one > /srv/x && ln /srv/x /srv/y && ln -s /etc/added /srv/link")
        rec = sb:commit { name = "myenv:1" }
      end)
      sb:destroy()
      if not ok then error(err, 0) end
      assert.equal("myenv:1", rec.name)
      assert.equal(3, #rec.layers)
      assert.same(images.get(ref).config.Env, rec.config.Env)
      assert.equal(rec.digest, images.get("myenv:1").digest)
    end)
    image_sandbox(function(sb)
      assert.equal("added", sh(sb, "cat /etc/added"))
      assert.equal("gone", sh(sb, "test -e /etc/os-release && echo there || echo gone"))
      assert.equal("link x y", (sh(sb, "ls /srv"):gsub("%s+", " ")))
      assert.equal(sh(sb, "stat -c %i /srv/x"), sh(sb, "stat -c %i /srv/y"))
      assert.equal("/etc/added", sh(sb, "readlink /srv/link"))
      assert.equal("0:0", sh(sb, "stat -c %u:%g /etc/added"))
      assert.equal("myenv:1", sb:info().image.name)
    end, "myenv:1")
    -- the image it came from is as it was
    image_sandbox(function(sb)
      assert.equal("ID=moonbox-test-image", sh(sb, "head -n 1 /etc/os-release"))
      assert.equal("gone", sh(sb, "test -e /etc/added && echo there || echo gone"))
    end)
    run_task(function()
      local sb = helper.new_sandbox { isolation = "namespaces" }
      local ok, err = pcall(fails, "VALIDATION_FAILED", sb.commit, sb, { name = "x:1" })
      sb:destroy()
      if not ok then error(err, 0) end
    end)
  end)

  it("runs the image's Entrypoint and Cmd when startProcess has no command", function()
    fx.oci(tmp .. "/entry", "latest", { config = { Entrypoint = { "/bin/echo", "from" }, Cmd = { "the", "image" } },
      layers = { { entries = fx.shell_entries() } } })
    image_sandbox(function(sb)
      local p = sb:startProcess()
      local code = p:waitForExit(10000).exitCode
      assert.equal(0, code, p:getLogs().stderr)
      assert.equal("from the image\n", p:getLogs().stdout)
      -- a command given wins
      p = sb:startProcess({ "/bin/echo", "mine" })
      p:waitForExit(10000)
      assert.equal("mine\n", p:getLogs().stdout)
    end, "oci:" .. tmp .. "/entry")
    -- without an image, a command is needed as ever
    run_task(function()
      local sb = helper.new_sandbox { isolation = "namespaces" }
      local ok, err = pcall(fails, "VALIDATION_FAILED", sb.startProcess, sb)
      sb:destroy()
      if not ok then error(err, 0) end
    end)
  end)

  it("says the image has no bash when a session cannot start", function()
    fx.oci(tmp .. "/nobash", "latest", { layers = { { entries = fx.busybox_entries() } } })
    image_sandbox(function(sb)
      local err = fails("SHELL_START_FAILED", sb.exec, sb, "true")
      assert.matches("has no /bin/bash", err.message, 1, true)
    end, "oci:" .. tmp .. "/nobash")
  end)

  it("IMAGE_NOT_FOUND for a name not in the store; VALIDATION_FAILED without namespaces", function()
    run_task(function()
      fails("IMAGE_NOT_FOUND", helper.new_sandbox, { image = "never-pulled", isolation = "namespaces" })
      fails("IMAGE_NOT_FOUND", helper.new_sandbox, { image = "oci:" .. tmp .. "/missing", isolation = "namespaces" })
      fails("VALIDATION_FAILED", helper.new_sandbox, { image = ref, isolation = "none" })
    end)
  end)

  it("resolves an image's absolute symlinks inside the sandbox, never on the host", function()
    local entries = fx.shell_entries()
    entries[#entries + 1] = { path = "etc/evil", type = "symlink", target = "/etc/shadow" }
    entries[#entries + 1] = { path = "etc/up", type = "symlink", target = "../../../../../etc/shadow" }
    fx.oci(tmp .. "/abs", "latest", { layers = { { entries = entries } } })
    image_sandbox(function(sb)
      -- the image has no /etc/shadow: both links dangle inside, the host's is not reached
      assert.equal("absent absent", sh(sb, "for f in /etc/evil /etc/up; do test -e $f && r=\"$r there\" ||"
        .. " r=\"$r absent\"; done; echo $r"))
      local ok, err = pcall(sb.readFile, sb, "/etc/evil")
      assert.is_false(ok)
      assert.equal("FILE_NOT_FOUND", err.code)
    end, "oci:" .. tmp .. "/abs")
  end)

  it("refuses to build the root through a symlink the image planted", function()
    local victim = tmp .. "/victim"
    helper.sh("mkdir '" .. victim .. "' && echo untouched > '" .. victim .. "/hostname'")
    local entries = fx.shell_entries()
    entries[#entries + 1] = { path = "etc/hostname", type = "symlink", target = victim .. "/hostname" }
    entries[#entries + 1] = { path = "workspace", type = "symlink", target = victim }
    fx.oci(tmp .. "/evil", "latest", { layers = { { entries = entries } } })
    run_task(function()
      local err = fails("ISOLATION_UNAVAILABLE", helper.new_sandbox,
        { image = "oci:" .. tmp .. "/evil", isolation = "namespaces" })
      assert.matches("ELOOP", err.message, 1, true)
    end)
    assert.equal("untouched", helper.sh("cat '" .. victim .. "/hostname'"))
    assert.equal("hostname", helper.sh("ls -A '" .. victim .. "'"))
  end)
end)
