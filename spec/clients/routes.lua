-- What the /v1 API serves, for spec/clients/openapi_test.py, read from the
-- server's own tables (not from its docs): "route METHOD PATTERN" for each
-- route of the router moonbox.server.api dispatches with, and "code CODE
-- STATUS" for each error code's HTTP status (moonbox.server.api_errors).
-- Run: moonbox spec/clients/routes.lua
local api = require "moonbox.server.api"
local api_errors = require "moonbox.server.api_errors"
for _, r in ipairs(api.router.routes) do
  print("route " .. r.method .. " " .. r.pattern)
end
for code, status in pairs(api_errors.STATUS) do
  print("code " .. code .. " " .. status)
end
