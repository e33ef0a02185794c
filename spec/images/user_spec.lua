-- The image config's User (sandbox/image_user.lua): processes of an image
-- sandbox run as that user, mapped inside the sandbox's id range; names
-- come from the image's /etc/passwd and /etc/group, never the host's; the
-- workspace and what the file API writes are that user's; an id the
-- sandbox's range lacks fails closed (an unprivileged runtime maps only
-- root inside).
local images = require "moonbox.images"
local fx = require "images.fixtures"
local core = require "moonbox.core"

local fails = helper.fails
local as_root = core.getuid() == 0
local tmp

local PASSWD = "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000::/home/app:/bin/sh\n" ..
  "svc:x:1001:1002:service:/var/svc:/bin/sh\n"
local GROUP = "root:x:0:\napp:x:1000:\nsvcgrp:x:1002:\nextra:x:1003:svc,app\nmore:x:1004: app \n"

-- oci:DIR of an image whose config says User = user
local function image(tag, user, extra_env, with_luajit)
  local entries = fx.shell_entries()
  if with_luajit then fx.luajit_entries(entries) end
  for _, e in ipairs {
    { path = "etc/passwd", type = "file", content = PASSWD },
    { path = "etc/group", type = "file", content = GROUP },
    { path = "home", type = "dir" }, { path = "home/app", type = "dir", uid = 1000, gid = 1000 },
    { path = "var", type = "dir" }, { path = "var/svc", type = "dir", uid = 1001, gid = 1002 },
  } do entries[#entries + 1] = e end
  local env = { "PATH=/bin" }
  for _, kv in ipairs(extra_env or {}) do env[#env + 1] = kv end
  local dir = tmp .. "/" .. tag
  fx.oci(dir, "latest", { config = { Env = env, User = user }, layers = { { entries = entries } } })
  return "oci:" .. dir
end

setup(function()
  tmp = helper.mkdtemp()
  images.store.DIR = tmp .. "/store"
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

local function with_sandbox(ref, fn)
  return run_task(function()
    local sb = helper.new_sandbox { image = ref, isolation = "namespaces" }
    local ok, err = pcall(fn, sb)
    sb:destroy()
    if not ok then error(err, 0) end
  end)
end

describe("an image's User", function()
  it("runs every process as uid:gid and gives it the workspace (as root)", function()
    local ref = image("numeric", "1000:1000", nil, true)
    if not as_root then
      -- one id mapped: uid 1000 has no place inside, so no sandbox at all
      run_task(function()
        local err = fails("ISOLATION_UNAVAILABLE", helper.new_sandbox, { image = ref, isolation = "namespaces" })
        assert.matches("uid 1000 is outside the sandbox's id range", err.message, 1, true)
      end)
      return
    end
    with_sandbox(ref, function(sb)
      assert.equal("1000\n1000", sh(sb, "id -u; id -g"))
      -- its supplementary groups: the image's /etc/group's, none of root's
      assert.equal("1000 1003 1004", sh(sb, "id -G"))
      assert.same({ 1000, 1003, 1004 }, sb:info().image.groups)
      -- a uid the image's passwd has: its HOME
      assert.equal("/home/app", sh(sb, "echo $HOME"))
      local info = sb:info().image
      assert.equal("1000:1000", info.user)
      assert.equal(1000, info.uid)
      assert.equal(1000, info.gid)
      -- the workspace is the user's: its writes there work, and what the
      -- file API writes is the user's too
      sh(sb, "echo from-shell > /workspace/a && mkdir /workspace/d")
      sb:writeFile("/workspace/b", "from-api\n")
      assert.equal("1000:1000 1000:1000", sh(sb, "echo $(stat -c %u:%g /workspace/a /workspace/b)"))
      sh(sb, "echo more >> /workspace/b")
      assert.equal("from-api\nmore\n", sb:readFile("/workspace/b").content)
      -- on the host: the range's uid 1000
      local idmap = sb:info().idmap
      assert.equal(("%d:%d"):format(idmap.uid + 1000, idmap.gid + 1000),
        helper.sh("stat -c %u:%g '" .. sb.workspace .. "/b'"))
      -- not root: the image's root-owned files stay out of reach
      local r = sb:exec("echo x > /etc/passwd")
      assert.is_not.equal(0, r.exitCode)
      fails("PERMISSION_DENIED", sb.writeFile, sb, "/etc/passwd", "x")
      assert.equal(PASSWD, sb:readFile("/etc/passwd").content)
      -- background processes and terminals too
      local p = sb:startProcess("sh -c 'id -u > /workspace/p-id'")
      assert.equal(0, p:waitForExit(10000).exitCode)
      assert.equal("1000\n", sb:readFile("/workspace/p-id").content)
      local t = sb:terminal {}
      -- the pty is the user's: the shell reopens it by name
      t:write("echo $(id -u):$(stat -L -c %u /proc/self/fd/0) > /workspace/t-id; exit 4\n")
      assert.equal(4, t:wait())
      assert.equal("1000:1000\n", sb:readFile("/workspace/t-id").content)
      -- and code contexts (the image's luajit)
      local c = sb:createCodeContext { language = "lua" }
      assert.equal("1000 1000", sb:runCode("return io.popen('echo $(id -u) $(id -g)'):read('*l')",
        { context = c }).results[1].text)
    end)
  end)

  it("resolves names from the image's passwd and group, never the host's", function()
    if not as_root then
      run_task(function()
        local err = fails("ISOLATION_UNAVAILABLE", helper.new_sandbox,
          { image = image("named", "svc"), isolation = "namespaces" })
        assert.matches("uid 1001", err.message, 1, true)
        -- root by name is the one id an unprivileged runtime maps
        local sb = helper.new_sandbox { image = image("rootname", "root"), isolation = "namespaces" }
        local ok, err2 = pcall(function() assert.equal("0 0", sh(sb, "echo $(id -u) $(id -g)")) end)
        sb:destroy()
        assert(ok, err2)
      end)
      return
    end
    with_sandbox(image("named", "svc"), function(sb)
      assert.equal("1001 1002 /var/svc", sh(sb, "echo $(id -u) $(id -g) $HOME"))
      assert.equal("1002 1003", sh(sb, "id -G"))
      assert.equal("svc", sh(sb, "id -un"))
    end)
    with_sandbox(image("namegroup", "app:svcgrp"), function(sb)
      assert.equal("1000 1002", sh(sb, "echo $(id -u) $(id -g)"))
    end)
    -- the image's Env HOME wins over passwd's
    with_sandbox(image("envhome", "svc", { "HOME=/tmp" }), function(sb)
      assert.equal("/tmp", sh(sb, "echo $HOME"))
    end)
  end)

  it("is overridden by getSandbox's user option", function()
    local ref = image("override", "1000:1000")
    run_task(function()
      -- root by name: the one id every runtime maps
      local sb = helper.new_sandbox { image = ref, isolation = "namespaces", user = "root" }
      local ok, err = pcall(function()
        assert.equal("0 0 /root", sh(sb, "echo $(id -u) $(id -g) $HOME"))
        assert.equal("root", sb:info().image.user)
      end)
      sb:destroy()
      assert(ok, err)
      fails("VALIDATION_FAILED", helper.new_sandbox, { isolation = "namespaces", user = "root" })
      fails("VALIDATION_FAILED", helper.new_sandbox, { image = ref, isolation = "namespaces", user = "" })
      if as_root then
        sb = helper.new_sandbox { image = ref, isolation = "namespaces", user = "svc" }
        ok, err = pcall(function() assert.equal("1001 1002", sh(sb, "echo $(id -u) $(id -g)")) end)
        sb:destroy()
        assert(ok, err)
        -- a uid the image's passwd lacks: group 0, HOME /
        sb = helper.new_sandbox { image = ref, isolation = "namespaces", user = "4242" }
        ok, err = pcall(function() assert.equal("4242 0 /", sh(sb, "echo $(id -u) $(id -g) $HOME")) end)
        sb:destroy()
        assert(ok, err)
      end
    end)
  end)

  it("fails closed: a name the image lacks, an id outside the range", function()
    run_task(function()
      local err = fails("IMAGE_INVALID", helper.new_sandbox, { image = image("nouser", "nobody-here"),
        isolation = "namespaces" })
      assert.matches("not in the image's /etc/passwd", err.message, 1, true)
      err = fails("IMAGE_INVALID", helper.new_sandbox, { image = image("nogroup", "app:nogroup"),
        isolation = "namespaces" })
      assert.matches("not in the image's /etc/group", err.message, 1, true)
      err = fails("ISOLATION_UNAVAILABLE", helper.new_sandbox, { image = image("far", "99999999:0"),
        isolation = "namespaces" })
      assert.matches("outside the sandbox's id range", err.message, 1, true)
    end)
  end)
end)
