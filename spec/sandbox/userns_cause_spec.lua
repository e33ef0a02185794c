-- Why the kernel refuses user namespaces, named from what the process sees
-- (moonbox.sandbox.userns_cause), and what `moonbox serve` does about it:
-- checked with real inputs, a real chroot (spec/in-chroot.sh, as root) and a
-- real seccomp-filtered process (a sandbox's own).
local core = require "moonbox.core"
local cause = require "moonbox.sandbox.userns_cause"
local util = require "moonbox.lib.util"

local BIN = os.getenv("MOONBOX_BIN") or "build/moonbox"

local function abs(path)
  return helper.sh("readlink -f '" .. path .. "'")
end

-- runs `moonbox ARGS` chrooted, with the source and build trees bound:
-- -> stdout and stderr together, exit status
local function in_chroot(args)
  local bin = abs(BIN)
  local build = bin:match("^(.*)/[^/]+$")
  local out = helper.sh(("sh spec/in-chroot.sh %s %s -- env HOME=/root %s %s 2>&1; echo \"exit $?\""):format(
    abs("."), build, bin, args))
  local text, status = out:match("^(.-)\n?exit (%d+)$")
  return text, tonumber(status)
end

describe("userns_cause", function()
  it("sees no chroot in this process's own mountinfo", function()
    local facts = cause.facts()
    assert.is_string(facts.mountinfo)
    assert.is_false(cause.chrooted(facts.mountinfo))
  end)

  it("names a seccomp filter from a filtered process's real /proc/self/status", function()
    run_task(function()
      local sb = helper.new_sandbox { isolation = "none" }
      local status = sb:exec("cat /proc/self/status").stdout
      sb:destroy()
      assert.matches("\nSeccomp:%s*2\n", status)
      local why = cause.explain { mountinfo = util.read_file("/proc/self/mountinfo"), status = status }
      assert.matches("^a seccomp filter on this runtime refuses clone%(CLONE_NEWUSER%)", why)
    end)
  end)

  it("names the sysctl and AppArmor knobs only for an unprivileged process", function()
    local facts = cause.facts()
    local root_status = facts.status:gsub("\nSeccomp:%s*%d", "\nSeccomp:\t0")
    local user_status = root_status:gsub("\nUid:[^\n]*", "\nUid:\t1000\t1000\t1000\t1000")
    local knob = { mountinfo = facts.mountinfo, status = user_status, unprivileged_userns_clone = "0\n" }
    assert.matches("^kernel%.unprivileged_userns_clone = 0 forbids", cause.explain(knob))
    knob.status = root_status:gsub("\nUid:[^\n]*", "\nUid:\t0\t0\t0\t0")
    knob.status = knob.status:gsub("\nCapEff:%s*%x+", "\nCapEff:\t000001ffffffffff")
    assert.is_nil(cause.explain(knob))
    local apparmor = { mountinfo = facts.mountinfo, status = user_status, apparmor_restrict = "1\n" }
    assert.matches("^AppArmor restricts unprivileged user namespaces", cause.explain(apparmor))
  end)

  describe("in a real chroot", function()
    local root = core.getuid() == 0

    it("the refusal names the chroot, and a script's sandbox warns with it", function()
      if not root then pending("needs root (chroot, unshare)") return end
      local out, status = in_chroot("-e " .. util.shell_quote([[
        local c = require "moonbox.sandbox.userns_cause"
        print("chrooted: " .. tostring(c.chrooted(c.facts().mountinfo)))
        local sb = require("moonbox").getSandbox("chroot-spec", { root = "/tmp/sb" })
        print("isolation: " .. sb:info().isolation)
        sb:destroy()]]))
      assert.equals(0, status, out)
      assert.matches("chrooted: true\n", out, 1, true)
      assert.matches('moonbox: warning: sandboxes with isolation = "auto" run without isolation ("none") ' ..
        "on this host: this runtime runs in a chroot (its / is not the root of its mount namespace), and the " ..
        "kernel refuses clone(CLONE_NEWUSER) in a chroot", out, 1, true)
      assert.matches("isolation: none", out, 1, true)
      assert.is_nil(out:find("AppArmor", 1, true))
    end)

    -- `moonbox serve [extra]` chrooted, in the background; curl from outside
    -- asks /readyz and an exec; -> serve's output, then the answers
    local function serve_in_chroot(extra)
      local bin = abs(BIN)
      return helper.sh(([[
out=$(mktemp)
sh spec/in-chroot.sh %s %s -- env HOME=/root %s serve --listen 127.0.0.1:0 %s >"$out" 2>&1 &
pid=$!
i=0
while [ $i -lt 200 ] && ! grep -q "^moonbox: open" "$out"; do sleep 0.05; i=$((i + 1)); done
sleep 0.2
url=$(sed -n 's/.*listening on \(http:[^ ]*\).*/\1/p' "$out")
token=$(sed -n 's/.*?token=\([0-9a-f]*\).*/\1/p' "$out")
ready=$(curl -sS -w ' %%{http_code}' "$url/readyz")
exec=$(curl -sS -w ' %%{http_code}' -H "authorization: Bearer $token" -X POST \
  "$url/v1/sandboxes/chroot-spec/exec" -d '{"command": "true"}')
kill -TERM $(pgrep -P "$pid") 2>/dev/null
wait "$pid"
cat "$out"
echo "readyz: $ready"
echo "exec: $exec"
rm -f "$out"]]):format(abs("."), bin:match("^(.*)/[^/]+$"), bin, extra))
    end

    it("serve says no sandbox can be made; /readyz is 503 and an exec 501, naming the chroot", function()
      if not root then pending("needs root (chroot, unshare)") return end
      local out = serve_in_chroot("")
      assert.matches("\nmoonbox: no sandbox can be made here %(/readyz: 503 isolation_unavailable%): this runtime " ..
        "runs in a chroot", out)
      assert.matches('readyz: {"status":"not ready","reason":"isolation_unavailable"}\n 503\n', out, 1, true)
      local exec = out:match("\nexec: ([^\n]*}%s* %d+)")
      assert.matches('"code":"ISOLATION_UNAVAILABLE"', exec, 1, true)
      assert.matches("cannot isolate the sandbox: this runtime runs in a chroot", exec, 1, true)
      assert.matches("} 501$", (exec:gsub("%s+", " ")))
    end)

    it("serve --allow-unisolated is ready and says its sandboxes run without isolation", function()
      if not root then pending("needs root (chroot, unshare)") return end
      local out = serve_in_chroot("--allow-unisolated")
      assert.matches("\nmoonbox: sandboxes run without isolation here %(%-%-allow%-unisolated%): this runtime " ..
        "runs in a chroot", out)
      assert.matches('readyz: {"status":"ready"}\n 200\n', out, 1, true)
      assert.matches('\nexec: {[^\n]*"exitCode":0[^\n]*}%s* 200', out)
    end)
  end)
end)
