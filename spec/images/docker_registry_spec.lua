-- Pulls from a real registry: Debian's docker-registry (the CNCF
-- distribution server) started here on the loopback, plain http, images
-- pushed into it by skopeo. The stand-in of registry_spec.lua
-- (registry.py) cannot show that we speak the protocol as the reference
-- server does; this spec does: open, with htpasswd (Basic) auth, and with
-- token auth (spec/images/token_server.py issues RS256 JWTs whose x5c is
-- the self-signed cert the registry trusts).
local core = require "moonbox.core"
local async = require "moonbox.async"
local images = require "moonbox.images"
local fx = require "images.fixtures"

local fails = helper.fails
local REGISTRY = "/usr/bin/docker-registry"
local GREETING = "pushed by skopeo, pulled by moonbox"
local USER, SECRET = "tester", "s3cret pass:word"
local ISSUER, SERVICE = "moonbox-test-issuer", "moonbox-test-registry"
local src = os.getenv("MOONBOX_SOURCE_DIR") or "."
local tmp, config_digest
local n = 0

local function write(path, text)
  local f = assert(io.open(path, "w"))
  f:write(text)
  f:close()
end

setup(function()
  tmp = helper.mkdtemp()
  local desc = fx.layered_desc()
  desc.layers[#desc.layers + 1] = { entries = {
    { path = "etc", type = "dir" }, { path = "etc/greeting", type = "file", content = GREETING .. "\n" } } }
  config_digest = fx.oci(tmp .. "/oci", "v1", desc)
  -- a bcrypt entry (docker-registry's htpasswd takes bcrypt only)
  fx.run(("htpasswd -Bbn '%s' '%s' > '%s/htpasswd'"):format(USER, SECRET, tmp))
  -- the token service's signing key, its self-signed cert the registry's rootcertbundle
  fx.run(("openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=moonbox-test-token " ..
    "-keyout '%s/token-key.pem' -out '%s/token-cert.pem'"):format(tmp, tmp))
end)
teardown(function() helper.sh("rm -rf '" .. tmp .. "'") end)
before_each(function()
  n = n + 1
  images.store.DIR = tmp .. "/store" .. n
end)
after_each(function() images.store.DIR = nil end)

local function free_port()
  return helper.sh([[python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); ]] ..
    [[print(s.getsockname()[1])']])
end

-- a process of the test (docker-registry, the token service) -> state {proc, exited}
local function spawn(args)
  local state = { exited = false }
  state.proc = assert(core.spawn { args = args, file = args[1],
    stdio = { [0] = "null", [1] = "null", [2] = "null" },
    env = { PATH = "/usr/bin:/bin" }, -- (not the sanitizer build's LD_PRELOAD)
    on_exit = function() state.exited = true end })
  return state
end

-- docker-registry on 127.0.0.1:port with its own storage; auth_yaml: the
-- config's auth section, or nil -> state {proc, exited, host}, whether
-- it answers /v2/
local function start_registry(auth_yaml)
  local dir = ("%s/registry-%d"):format(tmp, n)
  helper.sh("mkdir -p '" .. dir .. "/data'")
  local port = free_port()
  write(dir .. "/config.yml", table.concat {
    "version: 0.1\n",
    "log:\n  level: error\n  accesslog:\n    disabled: true\n",
    "storage:\n  filesystem:\n    rootdirectory: ", dir, "/data\n",
    "http:\n  addr: 127.0.0.1:", port, "\n",
    auth_yaml or "" })
  local state = spawn { REGISTRY, "serve", dir .. "/config.yml" }
  state.host = "127.0.0.1:" .. port
  -- up once /v2/ answers at all (200 open, 401 with auth)
  local up = helper.eventually(function()
    return state.exited or helper.sh("curl -s -o /dev/null -w '%{http_code}' http://" .. state.host .. "/v2/") ~= "000"
  end, 15000)
  return state, up and not state.exited
end

-- kills what spawn or start_registry started and waits for it to be gone
local function stop(state)
  local pid = state.proc:pid()
  if not state.exited then core.kill(pid, "SIGKILL") end
  while not state.exited do async.sleep(10) end
  assert.is_false(helper.pid_alive(pid))
end

-- the token service (spec/images/token_server.py) for user USER -> state,
-- its auth section for the registry's config
local function start_token_service()
  local port_file = ("%s/token-port-%d"):format(tmp, n)
  local state = spawn { "/usr/bin/python3", src .. "/spec/images/token_server.py", tmp .. "/token-key.pem",
    tmp .. "/token-cert.pem", ISSUER, SERVICE, USER .. ":" .. SECRET, port_file }
  local up = helper.eventually(function()
    return state.exited or helper.sh("cat '" .. port_file .. "' 2>/dev/null") ~= ""
  end, 10000)
  if not up or state.exited then
    stop(state)
    error("the token service did not start")
  end
  local realm = "http://127.0.0.1:" .. helper.sh("cat '" .. port_file .. "'") .. "/token"
  return state, ("auth:\n  token:\n    realm: %s\n    service: %s\n    issuer: %s\n    rootcertbundle: %s\n"):format(
    realm, SERVICE, ISSUER, tmp .. "/token-cert.pem")
end

-- runs fn(host) with the registry up (retried on another port if the free
-- one was taken meanwhile; auth: "htpasswd", "token" or nil), then kills
-- it (and the token service) and waits for them to be gone
local function with_registry(auth, fn)
  run_task(function()
    local token, auth_yaml
    if auth == "token" then
      token, auth_yaml = start_token_service()
    elseif auth == "htpasswd" then
      auth_yaml = ("auth:\n  htpasswd:\n    realm: moonbox-test\n    path: %s/htpasswd\n"):format(tmp)
    end
    local state, up
    local ok, err = pcall(function()
      for _ = 1, 3 do
        state, up = start_registry(auth_yaml)
        if up then break end
        stop(state)
      end
      assert(up, "docker-registry did not start")
      fn(state.host)
    end)
    if state then stop(state) end
    if token then stop(token) end
    if not ok then error(err, 0) end
  end)
end

-- skopeo copies the OCI layout to the registry -> the manifest digest the
-- registry holds (skopeo's own word, and skopeo inspect's)
local function push(ref, creds)
  local digest_file = ("%s/digest-%d"):format(tmp, n)
  local cred_flag = creds and ("--dest-creds '%s' "):format(creds) or ""
  fx.run(("skopeo copy -q --dest-tls-verify=false %s--digestfile '%s' 'oci:%s/oci:v1' 'docker://%s'"):format(cred_flag,
    digest_file, tmp, ref))
  local pushed = helper.sh("cat '" .. digest_file .. "'")
  local inspected = fx.run(("skopeo inspect --tls-verify=false %s--format '{{.Digest}}' 'docker://%s'"):format(
    creds and ("--creds '%s' "):format(creds) or "", ref))
  assert.equal(pushed, inspected)
  assert.matches("^sha256:%x+$", pushed)
  return pushed
end

-- a sandbox from the pulled image shows the image's own file
local function greeting_of(ref)
  local sb = helper.new_sandbox { image = ref, isolation = "namespaces" }
  local ok, r = pcall(sb.exec, sb, "cat /etc/greeting")
  sb:destroy()
  if not ok then error(r, 0) end
  assert.equal(0, r.exitCode, r.stderr)
  return r.stdout
end

describe("pulls from docker-registry", function()
  it("open, over plain http on the loopback: the digest skopeo pushed, a sandbox runs from it", function()
    with_registry(nil, function(host)
      local ref = host .. "/team/app:v1"
      local manifest = push(ref)
      local rec = images.pull(ref)
      assert.equal(manifest, rec.manifest)
      assert.equal(config_digest, rec.digest)
      assert.equal(3, #rec.layers)
      assert.equal(GREETING .. "\n", greeting_of(ref))
      -- by digest too: the same image
      assert.equal(config_digest, images.pull(host .. "/team/app@" .. manifest).digest)
      fails("IMAGE_NOT_FOUND", images.pull, host .. "/team/app:nope")
      fails("IMAGE_NOT_FOUND", images.pull, host .. "/team/other:v1")
    end)
  end)

  it("with htpasswd auth: the right credentials pull; wrong or none are IMAGE_PULL_FAILED", function()
    with_registry("htpasswd", function(host)
      local ref = host .. "/team/app:v1"
      local manifest = push(ref, USER .. ":" .. SECRET)
      local err = fails("IMAGE_PULL_FAILED", images.pull, ref)
      assert.matches("needs credentials (HTTP 401)", err.message, 1, true)
      err = fails("IMAGE_PULL_FAILED", images.pull, ref, { auth = { username = USER, password = "wrong" } })
      assert.matches("refused the credentials of tester (HTTP 401)", err.message, 1, true)
      fails("IMAGE_PULL_FAILED", images.pull, ref, { auth = { username = "nobody", password = SECRET } })
      assert.same({}, images.list())
      local rec = images.pull(ref, { auth = { username = USER, password = SECRET } })
      assert.equal(manifest, rec.manifest)
      assert.equal(config_digest, rec.digest)
      assert.equal(GREETING .. "\n", greeting_of(ref))
    end)
  end)

  it("with token auth: its token service's JWTs for the right credentials; wrong or none are IMAGE_PULL_FAILED",
    function()
      with_registry("token", function(host)
        local ref = host .. "/team/app:v1"
        local manifest = push(ref, USER .. ":" .. SECRET)
        local err = fails("IMAGE_PULL_FAILED", images.pull, ref)
        assert.matches("its token service needs credentials", err.message, 1, true)
        err = fails("IMAGE_PULL_FAILED", images.pull, ref, { auth = { username = USER, password = "wrong" } })
        assert.matches("its token service refused the credentials of tester", err.message, 1, true)
        assert.same({}, images.list())
        local rec = images.pull(ref, { auth = { username = USER, password = SECRET } })
        assert.equal(manifest, rec.manifest)
        assert.equal(config_digest, rec.digest)
        assert.equal(GREETING .. "\n", greeting_of(ref))
      end)
    end)
end)
