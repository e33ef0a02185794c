-- Exposed ports (issue #16, API.md Amendments; the seed's exposePort):
--
--   sandbox:exposePort(port, {name?, public?}) -> {url, port, name, public}
--   sandbox:unexposePort(port) -> {success, port}
--   sandbox:getExposedPorts() -> array of {url, port, name, public}
--
-- Exposing records that `moonbox serve` may proxy HTTP and WebSocket
-- requests to the port inside the sandbox (moonbox.server.proxy): at
-- /v1/sandboxes/{id}/ports/{port}/... and at host {port}-{id}.localhost.
-- The sandbox keeps its network: the proxy connects from inside the
-- sandbox's network namespace. Nothing listens on the host for a port.
local errors = require "moonbox.errors"
local V = require "moonbox.lib.validate"
local util = require "moonbox.lib.util"
local compose = require "moonbox.lib.compose"
local Sandbox = {} -- this part's methods, installed by sandbox/init.lua (M.install)

local M = {}

-- The address of the `moonbox serve` of this process ({port = n}), set by
-- moonbox.server.cli; URLs name it, or serve's default port 8080 when no
-- server runs here.
M.server = nil
M.DEFAULT_SERVER_PORT = 8080

local function check_port(port)
  if type(port) ~= "number" or port % 1 ~= 0 or port < 1 or port > 65535 then
    V.fail("port", ("expected an integer port 1-65535, got %s"):format(tostring(port)))
  end
  return port
end

-- The URL of an exposed port by host name (what the seed calls a preview URL).
function M.url(sandbox, port)
  local server_port = M.server and M.server.port or M.DEFAULT_SERVER_PORT
  return ("http://%d-%s.localhost:%d/"):format(port, sandbox.id, server_port)
end

local function entry_table(sandbox, e)
  return { url = M.url(sandbox, e.port), port = e.port, name = e.name, public = e.public,
    exposedAt = e.exposedAt }
end

-- The record of an exposed port, or nil (used by the proxy).
function M.get(sandbox, port)
  local ports = rawget(sandbox, "_ports")
  return ports and ports[port] or nil
end

function Sandbox:exposePort(port, opts)
  self:check_live()
  check_port(port)
  opts = opts or {}
  if type(opts) == "table" and opts.hostname ~= nil then
    V.fail("hostname", "moonbox has no custom host names: `moonbox serve` answers for an exposed port at " ..
      "{port}-{id}.localhost:<serve port> and at /v1/sandboxes/{id}/ports/{port}/ (the url returned)")
  end
  if type(opts) == "table" and opts.token ~= nil then
    V.fail("token", "moonbox has no per-port tokens: the proxy takes the server's token " ..
      "(or none with public = true)")
  end
  opts = V.options(opts, { name = true, public = true }, "exposePort options")
  V.type(opts.name, "string", "name", true)
  V.type(opts.public, "boolean", "public", true)
  self._ports = self._ports or {}
  if self._ports[port] then
    errors.raise("PORT_ALREADY_EXPOSED", ("port %d of sandbox %q is already exposed"):format(port, self.id),
      { port = port, id = self.id })
  end
  local e = { port = port, name = opts.name, public = opts.public == true, exposedAt = util.timestamp() }
  self._ports[port] = e
  return entry_table(self, e)
end

function Sandbox:unexposePort(port)
  self:check_live()
  check_port(port)
  local ports = self._ports
  if not (ports and ports[port]) then
    errors.raise("PORT_NOT_EXPOSED", ("port %d of sandbox %q is not exposed"):format(port, self.id),
      { port = port, id = self.id })
  end
  ports[port] = nil
  return { success = true, port = port }
end

function Sandbox:getExposedPorts()
  self:check_live()
  local out = {}
  for _, e in pairs(self._ports or {}) do out[#out + 1] = entry_table(self, e) end
  table.sort(out, function(a, b) return a.port < b.port end)
  return out
end

-- A part of Sandbox (lib/compose.lua): exposePort, unexposePort,
-- getExposedPorts.
function M.install(class)
  compose.methods(class, Sandbox, "ports")
end

return M
