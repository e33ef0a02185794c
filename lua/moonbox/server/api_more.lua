-- /v1 routes of issue #16 part 2 (docs/http-api.md): exposed ports,
-- backups and checkChanges, over the same Lua calls, with api.lua's request
-- context (ctx:sandbox(), ctx:session(), ctx:take(), ctx:rest()).
--   POST   /v1/sandboxes/{id}/ports            {port, name?, public?} -> exposePort
--   GET    /v1/sandboxes/{id}/ports            -> getExposedPorts
--   DELETE /v1/sandboxes/{id}/ports/{port}     -> unexposePort
--   POST   /v1/sandboxes/{id}/backups          {dir, name?, excludes?, gitignore?, ttl?} -> createBackup
--   POST   /v1/sandboxes/{id}/backups/restore  {id, dir?} -> restoreBackup
--   GET    /v1/backups                         -> listBackups
--   DELETE /v1/backups/{backupId}              -> deleteBackup
--   POST   /v1/sandboxes/{id}/commit           {name} -> sandbox:commit{name}
--   GET    /v1/images                          -> images.list
--   POST   /v1/images/pull                     {ref, name?, auth?} -> images.pull, progress as SSE (registries only)
--   DELETE /v1/images?name=                    -> images.remove
--   POST   /v1/sandboxes/{id}/files/changes    {path, since?, recursive?, include?, exclude?, sessionId?}
--   POST   /v1/sandboxes/{id}                  {from?, network?, egress?, image?} -> getSandbox(id, {from = backup,
--                                              network, egress, image}): a new sandbox (a fork, an egress one, or
--                                              one made from a stored image)
--   PATCH  /v1/sandboxes/{id}/network          {egress = {allow, deny}} -> setNetwork
local moonbox = require "moonbox"
local V = require "moonbox.lib.validate"
local json = require "moonbox.server.api_json"
local router_mod = require "moonbox.server.api_router"

local M = {}

-- api.lua's module (its config and on_reject, read per request), handed in
-- by install: a route module does not require api.lua, which installs it
local api

local function no_query(ctx, allowed)
  for k in pairs(ctx.query) do
    if not (allowed and allowed[k]) then V.fail(k, "unknown query parameter") end
  end
end

local function port_param(ctx)
  local p = ctx.params.port
  local n = tonumber(p)
  if not p:match("^%d+$") or not n then V.fail("port", ("expected an integer port, got %q"):format(p)) end
  return n
end

local H = {}

function H.expose(ctx)
  no_query(ctx)
  local f = ctx:take { port = "number" }
  return 200, ctx:sandbox():exposePort(f.port, ctx:rest())
end

function H.list_ports(ctx)
  no_query(ctx)
  return 200, json.array(ctx:sandbox():getExposedPorts())
end

function H.unexpose(ctx)
  no_query(ctx)
  return 200, ctx:sandbox():unexposePort(port_param(ctx))
end

function H.create_backup(ctx)
  no_query(ctx)
  return 200, ctx:sandbox():createBackup(ctx:body())
end

function H.restore_backup(ctx)
  no_query(ctx)
  local f = ctx:take { id = "string", dir = "string?" }
  ctx:no_more()
  return 200, ctx:sandbox():restoreBackup { id = f.id, dir = f.dir }
end

function H.list_backups(ctx)
  no_query(ctx)
  return 200, json.array(moonbox.listBackups())
end

function H.delete_backup(ctx)
  no_query(ctx)
  return 200, moonbox.deleteBackup(router_mod.check_id(ctx.params.backupId, "backupId"))
end

function H.check_changes(ctx)
  no_query(ctx, { sessionId = true })
  local s = ctx:session(true)
  local f = ctx:take { path = "string" }
  return 200, s:checkChanges(f.path, ctx:rest())
end

function H.list_images(ctx)
  no_query(ctx)
  return 200, json.array(moonbox.images.list())
end

function H.remove_image(ctx)
  no_query(ctx, { name = true })
  local name = ctx.query.name
  if type(name) ~= "string" or name == "" then V.fail("name", "missing (?name=)") end
  return 200, moonbox.images.remove(name)
end

-- POST /v1/images/pull {ref, name?, auth?}: the pull's progress events
-- ({type = "layer"|"progress"|"layerDone"}) then {type = "complete",
-- image} or {type = "error", error}, as SSE; a client that goes away
-- cancels the pull. A registry reference only: a client never makes the
-- server read a layout or an archive of the host's paths.
function H.pull_image(ctx)
  no_query(ctx)
  local f = ctx:take { ref = "string", name = "string?", auth = "table?" }
  ctx:no_more()
  if f.ref:match("^oci:") or f.ref:match("^docker%-archive:") then
    require("moonbox.errors").raise("POLICY_DENIED", ("image %s: over HTTP only registry references are pulled "
      .. "(moonbox image pull reads the host's files)"):format(f.ref), { ref = f.ref })
  end
  local async = require "moonbox.async"
  local api_errors = require "moonbox.server.api_errors"
  local queue, waiter, done = {}, nil, false
  local function wake()
    local w = waiter
    waiter = nil
    if w then w() end
  end
  local function push(ev)
    queue[#queue + 1] = ev
    wake()
  end
  local task = moonbox.spawn(function()
    local ok, rec = pcall(moonbox.images.pull, f.ref, { name = f.name, auth = f.auth, onProgress = push })
    if ok then
      json.array(rec.layers)
      push { type = "complete", image = rec }
    else
      local _, body = api_errors.body(rec)
      push { type = "error", error = body }
    end
    done = true
    wake()
  end)
  local iter = setmetatable({ cancel = function() task:cancel() end }, { __call = function()
    while #queue == 0 do
      if done then return nil end
      async.await(function(resume) waiter = resume end, "images pull stream")
    end
    return table.remove(queue, 1)
  end })
  require("moonbox.server.api_sse").pump(ctx.res, iter)
end

-- POST /v1/sandboxes/{id}/commit {name}: the sandbox's changes as a new
-- image in the server's store (docs/images.md, "Templates")
function H.commit(ctx)
  no_query(ctx)
  local f = ctx:take { name = "string" }
  ctx:no_more()
  return 200, ctx:sandbox():commit { name = f.name }
end

-- POST /v1/sandboxes/{id} {from?, network?, egress?, image?, user?}: made as
-- api.lua's Ctx:sandbox() makes sandboxes (the server's home, policy,
-- limits and maxSandboxes), from a backup, with a network of its own and/or
-- from an image. An image must be in the store already (a name or digest,
-- `moonbox image pull`): a client never makes the server read a layout or
-- an archive of the host's paths.
function H.create_from(ctx)
  no_query(ctx)
  local f = ctx:take { from = "string?", network = "string?", egress = "table?", image = "string?",
    user = "string?" }
  ctx:no_more()
  if f.from == nil and f.network == nil and f.image == nil then
    V.fail("from", "missing (or give network or image)")
  end
  if f.image ~= nil then
    if f.image:match("^oci:") or f.image:match("^docker%-archive:") then
      require("moonbox.errors").raise("POLICY_DENIED", ("image %s: the server makes sandboxes only from images in "
        .. "its store (moonbox image pull)"):format(f.image), { image = f.image })
    end
    if not moonbox.images.get(f.image) then
      require("moonbox.errors").raise("IMAGE_NOT_FOUND", ("no image named %s in the store"):format(f.image),
        { image = f.image })
    end
  end
  local id = ctx.params.id
  local live, n = require("moonbox.sandbox").all(), 0
  for _ in pairs(live) do n = n + 1 end
  if not live[id] and n >= api.config.maxSandboxes then
    if api.on_reject then api.on_reject("max_sandboxes") end
    require("moonbox.errors").raise("POLICY_DENIED",
      ("the server already holds %d sandboxes (maxSandboxes)"):format(n), { maxSandboxes = api.config.maxSandboxes })
  end
  local opts = { from = f.from, network = f.network, egress = f.egress, image = f.image, user = f.user,
    policy = api.config.policy,
    limits = api.config.limits }
  if api.config.home then opts.root = api.config.home .. "/sandboxes/" .. id end
  local sb = moonbox.getSandbox(id, opts)
  ctx._sandbox = sb
  local info = sb:info()
  json.array(info.namespaces)
  json.array(info.notEnforced)
  json.network(info.network)
  return 200, info
end

function H.set_network(ctx)
  no_query(ctx)
  return 200, json.network(ctx:sandbox():setNetwork(ctx:body()))
end

-- install(router, api_module): add the routes to /v1's router.
function M.install(router, api_module)
  api = api_module
  for _, r in ipairs {
    { "POST", "/ports", H.expose }, { "GET", "/ports", H.list_ports },
    { "DELETE", "/ports/{port}", H.unexpose },
    { "POST", "/backups", H.create_backup }, { "POST", "/backups/restore", H.restore_backup },
    { "POST", "/files/changes", H.check_changes }, { "POST", "", H.create_from },
    { "POST", "/commit", H.commit },
    { "PATCH", "/network", H.set_network },
  } do
    router:add(r[1], "/v1/sandboxes/{id}" .. r[2], r[3])
  end
  router:add("GET", "/v1/backups", H.list_backups)
  router:add("GET", "/v1/images", H.list_images)
  router:add("POST", "/v1/images/pull", H.pull_image)
  router:add("DELETE", "/v1/images", H.remove_image)
  router:add("DELETE", "/v1/backups/{backupId}", H.delete_backup)
end

return M
