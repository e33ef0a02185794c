-- The /v1 routes of lua/moonbox/server/api_more.lua (ports, backups,
-- checkChanges), driven through api.handle with request tables as
-- moonbox.server.http makes them.
local cjson = require "cjson"
local core = require "moonbox.core"
local api = require "moonbox.server.api"
local backup = require "moonbox.files.backup"

local home = helper.mkdtemp()
local seq = 0

local function request(method, path, body)
  if type(body) == "table" then body = cjson.encode(body) end
  local r = api.handle({ method = method, path = path, query = {}, headers = {}, body = body }, {})
  if type(r.body) == "table" then r.body = r.body.text() end -- a body in slices (api_json.body)
  return r.status, cjson.decode(r.body), r.body
end

local function with_api(fn)
  seq = seq + 1
  local id = ("more-%d-%d"):format(core.getpid(), seq)
  api.configure { home = home }
  backup.DIR = home .. "/backups"
  run_task(function()
    local base = "/v1/sandboxes/" .. id
    local ok, err = pcall(fn, base, function(method, sub, body) return request(method, base .. sub, body) end)
    request("DELETE", base)
    backup.DIR = nil
    if not ok then error(err, 0) end
  end)
end

describe("/v1 ports, backups and checkChanges", function()
  it("exposes, lists and unexposes ports with the Lua calls' results and codes", function()
    with_api(function(_, call)
      local status, r = call("POST", "/ports", { port = 3000, name = "web" })
      assert.same({ 200, 3000, "web" }, { status, r.port, r.name })
      assert.truthy(r.url:match("^http://3000%-more%-%d+%-%d+%.localhost:%d+/$"))
      status, r = call("POST", "/ports", { port = 3000 })
      assert.same({ 409, "PORT_ALREADY_EXPOSED" }, { status, r.code })
      status, r = call("POST", "/ports", { port = 70000 })
      assert.same({ 400, "VALIDATION_FAILED" }, { status, r.code })
      local raw
      status, r, raw = call("GET", "/ports")
      assert.same({ 200, 1, 3000 }, { status, #r, r[1].port })
      assert.equal("[", raw:sub(1, 1))
      status, r = call("DELETE", "/ports/3000")
      assert.same({ 200, true, 3000 }, { status, r.success, r.port })
      status, r = call("DELETE", "/ports/3000")
      assert.same({ 404, "PORT_NOT_EXPOSED" }, { status, r.code })
      status, _, raw = call("GET", "/ports")
      assert.same({ 200, "[]" }, { status, raw:match("^(%S+)") })
    end)
  end)

  it("creates, lists, restores and deletes backups, and forks a new sandbox from one", function()
    with_api(function(base, call)
      assert.equal(200, (call("POST", "/files/write", { path = "/workspace/a.txt", content = "one" })))
      local status, b = call("POST", "/backups", { dir = "/workspace", name = "snap" })
      assert.same({ 200, "/workspace" }, { status, b.dir })
      local r
      status, r = request("GET", "/v1/backups")
      local found
      for _, e in ipairs(r) do if e.id == b.id then found = e end end
      assert.same({ 200, "snap" }, { status, found and found.name })
      call("POST", "/files/write", { path = "/workspace/a.txt", content = "two" })
      status, r = call("POST", "/backups/restore", { id = b.id })
      assert.same({ 200, true, b.id }, { status, r.success, r.id })
      status, r = call("POST", "/files/read", { path = "/workspace/a.txt" })
      assert.same({ 200, "one" }, { status, r.content })
      -- a new sandbox from the backup (a fork); an existing one is refused
      local fork = base .. "-fork"
      status, r = request("POST", fork, { from = b.id })
      assert.same({ 200, fork:match("[^/]+$") }, { status, r.id })
      status, r = request("POST", fork .. "/files/read", { path = "/workspace/a.txt" })
      assert.same({ 200, "one" }, { status, r.content })
      status, r = request("POST", fork, { from = b.id })
      assert.same({ 400, "VALIDATION_FAILED" }, { status, r.code })
      assert.equal(200, (request("DELETE", fork)))
      status, r = request("DELETE", "/v1/backups/" .. b.id)
      assert.same({ 200, true }, { status, r.success })
      status, r = request("DELETE", "/v1/backups/" .. b.id)
      assert.same({ 404, "BACKUP_NOT_FOUND" }, { status, r.code })
      status, r = call("POST", "/backups/restore", { id = b.id })
      assert.same({ 404, "BACKUP_NOT_FOUND" }, { status, r.code })
      status, r = call("POST", "/backups", { name = "no dir" })
      assert.same({ 400, "VALIDATION_FAILED" }, { status, r.code })
    end)
  end)

  it("checkChanges: a version, then changed after a write, unchanged after none", function()
    with_api(function(_, call)
      call("POST", "/files/mkdir", { path = "/workspace/src" })
      local status, r = call("POST", "/files/changes", { path = "/workspace/src", recursive = true })
      assert.same({ 200, "unchanged" }, { status, r.status })
      local v1 = r.version
      status, r = call("POST", "/files/changes", { path = "/workspace/src", recursive = true, since = v1 })
      assert.same({ 200, "unchanged", v1 }, { status, r.status, r.version })
      call("POST", "/files/write", { path = "/workspace/src/x", content = "x" })
      status, r = call("POST", "/files/changes", { path = "/workspace/src", recursive = true, since = v1 })
      assert.same({ 200, "changed" }, { status, r.status })
      status, r = call("POST", "/files/changes", { path = "/workspace/src", sinse = v1 })
      assert.same({ 400, "VALIDATION_FAILED" }, { status, r.code })
    end)
  end)
end)
