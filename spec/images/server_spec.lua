-- POST /v1/sandboxes/{id} {image} (lua/moonbox/server/api_more.lua): a
-- sandbox made from an image in the store; the image codes' statuses; a
-- client may not make the server import from the host's paths.
local cjson = require "cjson"
local core = require "moonbox.core"
local api = require "moonbox.server.api"
local images = require "moonbox.images"
local fx = require "images.fixtures"

local home = helper.mkdtemp()
local seq = 0

local function request(method, path, body)
  if type(body) == "table" then body = cjson.encode(body) end
  -- (exec watches for the client's leaving: a response that never closes)
  local res = { onClose = function() end }
  local r = api.handle({ method = method, path = path, query = {}, headers = {}, body = body }, res)
  if type(r.body) == "table" then r.body = r.body.text() end
  return r.status, cjson.decode(r.body)
end

setup(function() images.store.DIR = home .. "/images" end)
teardown(function()
  images.store.DIR = nil
  helper.sh("rm -rf '" .. home .. "'")
end)

describe("POST /v1/sandboxes/{id} {image}", function()
  it("makes a sandbox of a stored image; 404, 403 and 400 otherwise", function()
    fx.oci(home .. "/oci", "v1", fx.layered_desc())
    api.configure { home = home }
    run_task(function()
      images.pull("oci:" .. home .. "/oci:v1", { name = "layered:1" })
      seq = seq + 1
      local base = ("/v1/sandboxes/img-%d-%d"):format(core.getpid(), seq)
      local ok, err = pcall(function()
        local status, info = request("POST", base, { image = "layered:1" })
        assert.equal(200, status, cjson.encode(info))
        assert.equal("layered:1", info.image.name)
        local s, r = request("POST", base .. "/exec", { command = "head -n 1 /etc/os-release" })
        assert.same({ 200, "ID=moonbox-test-image\n" }, { s, r.stdout })
        -- a template: committed over HTTP, another sandbox made from it
        s, r = request("POST", base .. "/exec", { command = "echo templated > /etc/t" })
        assert.equal(0, r.exitCode)
        assert.equal(200, s)
        s, r = request("POST", base .. "/commit", { name = "tmpl:1" })
        assert.same({ 200, "tmpl:1", 3 }, { s, r.name, #r.layers })
        local other = base .. "-from-tmpl"
        s = request("POST", other, { image = "tmpl:1" })
        assert.equal(200, s)
        s, r = request("POST", other .. "/exec", { command = "cat /etc/t" })
        request("DELETE", other)
        assert.same({ 200, "templated\n" }, { s, r.stdout })
        s, r = request("POST", "/v1/sandboxes/x" .. seq, { image = "nope:1" })
        assert.same({ 404, "IMAGE_NOT_FOUND" }, { s, r.code })
        s, r = request("POST", "/v1/sandboxes/x" .. seq, { image = "oci:" .. home .. "/oci:v1" })
        assert.same({ 403, "POLICY_DENIED" }, { s, r.code })
        s, r = request("POST", "/v1/sandboxes/x" .. seq, {})
        assert.same({ 400, "VALIDATION_FAILED" }, { s, r.code })
      end)
      request("DELETE", base)
      if not ok then error(err, 0) end
    end)
  end)
end)
