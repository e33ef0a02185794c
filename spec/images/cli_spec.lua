-- `moonbox image pull | ls | rm` (lua/moonbox/images/cli.lua): exit codes,
-- stdout, progress on stderr.
local fx = require "images.fixtures"

local bin = os.getenv("MOONBOX_BIN") or "build/moonbox"
local tmp
setup(function() tmp = helper.mkdtemp() end)
teardown(function() helper.sh("rm -rf '" .. tmp .. "'") end)

-- runs the command with its home under tmp; returns stdout, stderr, exit code
local function image(args)
  local out = helper.sh(("MOONBOX_HOME='%s/home' %s image %s >'%s/out' 2>'%s/err'; echo $?"):format(
    tmp, bin, args, tmp, tmp))
  return helper.sh("cat '" .. tmp .. "/out'"), helper.sh("cat '" .. tmp .. "/err'"), tonumber(out)
end

describe("moonbox image", function()
  it("pulls, lists and removes, with progress on stderr", function()
    local digest = fx.oci(tmp .. "/oci", "v1", { layers = { { gzip = true, entries = fx.busybox_entries() } } })
    local out, err, rc = image("pull oci:" .. tmp .. "/oci:v1 --name bb:1")
    assert.equal(0, rc, err)
    assert.equal("bb:1 " .. digest, out)
    assert.matches("layer 1/1: sha256:%x+ done", err)
    out, err, rc = image("ls")
    assert.equal("", err)
    assert.equal(0, rc)
    assert.matches("^bb:1\t" .. digest .. "\t1 layers\t", out)
    out, err, rc = image("rm bb:1")
    assert.equal("", err)
    assert.equal(0, rc)
    assert.equal("bb:1 removed (1 layers freed)", out)
    out, err, rc = image("ls")
    assert.equal("", err)
    assert.equal(0, rc)
    assert.equal("", out)
  end)

  it("exits 1 with the error's code on stderr, 2 on a usage error", function()
    local out, err, rc = image("rm nope:1")
    assert.equal("", out)
    assert.equal(1, rc)
    assert.matches("^moonbox image: IMAGE_NOT_FOUND: ", err)
    out, err, rc = image("frobnicate")
    assert.equal("", out)
    assert.equal(2, rc)
    assert.matches("unknown image command frobnicate", err, 1, true)
  end)
end)
