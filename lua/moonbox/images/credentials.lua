-- Registry credentials for pulls (docs/images.md, "Credentials"): given
-- with the pull (`auth = {username, password}`), else found in the
-- runtime's auth file (<home>/auth.json, docker's config.json `auths`
-- format). They only ever reach curl as an `Authorization: Basic` header in
-- a 0600 file of the store's scratch (never argv, never a log line).
local core = require "moonbox.core"
local errors = require "moonbox.errors"
local store = require "moonbox.images.store"

local M = {}

M.FILE = nil -- tests and embedders may set it; else <home>/auth.json, beside the store
M.MAX_FILE = 1048576

function M.file()
  if M.FILE then return M.FILE end
  return (store.dir():gsub("/[^/]+/*$", "")) .. "/auth.json"
end

local function invalid(msg) errors.raise("VALIDATION_FAILED", msg, { field = "auth" }) end

-- check(auth) -> {username, password} or nil; what a caller gave
function M.check(auth)
  if auth == nil then return nil end
  if type(auth) ~= "table" then invalid("auth: expected {username, password}") end
  for k in pairs(auth) do
    if k ~= "username" and k ~= "password" then invalid(("auth: unknown field %s"):format(tostring(k))) end
  end
  local u, p = auth.username, auth.password
  if type(u) ~= "string" or u == "" or type(p) ~= "string" then
    invalid("auth: username (a non-empty string) and password (a string) are needed")
  end
  -- a header line of curl's: no line breaks, no NUL; a username has no ':'
  if (u .. p):find("[%z\r\n]") or u:find(":", 1, true) or #u + #p > 8192 then
    invalid("auth: username or password has a character a Basic credential cannot carry")
  end
  return { username = u, password = p }
end

-- The keys docker writes for a registry host (`docker login HOST`; Docker
-- Hub's is its old index URL).
local function keys_for(host)
  local keys = { host, "https://" .. host, "http://" .. host, "https://" .. host .. "/v1/",
    "https://" .. host .. "/v2/" }
  if host == "registry-1.docker.io" then
    for _, k in ipairs { "https://index.docker.io/v1/", "index.docker.io", "docker.io" } do keys[#keys + 1] = k end
  end
  return keys
end

-- from_file(host) -> {username, password} or nil: the auth file's entry
-- for host. A file that is not the runtime's alone (group or others may
-- read it) is refused rather than used.
function M.from_file(host)
  local path = M.file()
  local fs = require "moonbox.lib.fs"
  local fd = fs.open(path, "r")
  if not fd then return nil end
  -- (the file opened is the one checked: fstat, then read)
  local st = fs.fstat(fd)
  local text
  if st and st.mode % 64 == 0 and st.size <= M.MAX_FILE then text = fs.read_all(fd) end
  fs.close(fd)
  if not st then return nil end
  if st.mode % 64 ~= 0 then
    errors.raise("IMAGE_PULL_FAILED", ("auth file %s may be read by others (mode %o): chmod 600 it"):format(path,
      st.mode))
  end
  if st.size > M.MAX_FILE then errors.raise("IMAGE_PULL_FAILED", ("auth file %s is too large"):format(path)) end
  if not text then errors.raise("IMAGE_PULL_FAILED", ("auth file %s cannot be read"):format(path)) end
  local doc = require("cjson.safe").decode(text)
  local auths = type(doc) == "table" and doc.auths
  if type(auths) ~= "table" then
    errors.raise("IMAGE_PULL_FAILED", ("auth file %s: not a JSON object with \"auths\""):format(path))
  end
  for _, k in ipairs(keys_for(host)) do
    local e = auths[k]
    if type(e) == "table" then
      local u, p = e.username, e.password
      if type(e.auth) == "string" and e.auth ~= "" then
        local plain = core.base64_decode(e.auth)
        u, p = (plain or ""):match("^([^:]*):(.*)$")
        if not u then
          errors.raise("IMAGE_PULL_FAILED", ("auth file %s: the \"auth\" of %s is not base64 of user:password")
            :format(path, k))
        end
      end
      if type(u) == "string" and type(p) == "string" then
        local ok, r = pcall(M.check, { username = u, password = p })
        if not ok then
          errors.raise("IMAGE_PULL_FAILED", ("auth file %s: the entry of %s: %s"):format(path, k, r.message))
        end
        return r
      end
    end
  end
  return nil
end

-- header_file(creds, dir) -> path of a 0600 file with the Basic header, for
-- curl's `-H @file`
function M.header_file(creds, dir)
  local path = dir .. "/basic"
  os.remove(path)
  local line = "Authorization: Basic " .. core.base64_encode(creds.username .. ":" .. creds.password) .. "\n"
  local ok, msg = require("moonbox.lib.fs").write_file(path, line, 384)
  if not ok then errors.raise("FILESYSTEM_ERROR", "image store: " .. tostring(msg)) end
  return path
end

return M
