-- REGISTRY/NAME[:TAG|@sha256:...]: pulled over the OCI distribution API
-- (distribution-spec "pull"): the manifest (an image index or Docker
-- manifest list followed to its linux/amd64 entry), the config and the
-- layers, each checked against its digest as it enters the store. A 401
-- with `WWW-Authenticate: Bearer realm=...,service=...,scope=...` is
-- answered with a token from the realm (anonymous, or asked for with the
-- pull's credentials as Basic auth), and the request repeated with it; a
-- 401 with `Basic` is answered with the credentials themselves
-- (images/credentials.lua). HTTP goes through the host's curl (TLS, redirects to
-- blob storage), a process of the runtime, never of a sandbox; https
-- only, but for a registry on the loopback (localhost, 127.0.0.0/8, [::1]),
-- which may be plain http. Tokens and credentials are handed to curl in a
-- 0600 file, never on its command line.
local cjson = require "cjson.safe"
local core = require "moonbox.core"
local async = require "moonbox.async"
local errors = require "moonbox.errors"
local util = require "moonbox.lib.util"
local store = require "moonbox.images.store"
local blob = require "moonbox.images.blob"

local M = {}

M.CURL = "/usr/bin/curl"
M.TIMEOUT_MS = 30 * 60 * 1000 -- one request (a large layer over a slow link)
M.MAX_MANIFEST = 4 * 1024 * 1024

local ACCEPT = table.concat({
  "application/vnd.oci.image.index.v1+json", "application/vnd.oci.image.manifest.v1+json",
  "application/vnd.docker.distribution.manifest.list.v2+json",
  "application/vnd.docker.distribution.manifest.v2+json" }, ", ")
local INDEX_TYPES = {
  ["application/vnd.oci.image.index.v1+json"] = true,
  ["application/vnd.docker.distribution.manifest.list.v2+json"] = true,
}

local function pull_failed(msg, context) errors.raise("IMAGE_PULL_FAILED", msg, context) end

-- "host[:port]/name[:tag|@digest]" -> {host, name, reference}
function M.parse(ref)
  local host, rest = ref:match("^([^/]+)/(.+)$")
  if not host or not (host:find("[.:]") or host == "localhost") then
    -- Docker Hub's short names (nginx, library/nginx)
    host, rest = "registry-1.docker.io", (ref:find("/") and ref or ("library/" .. ref))
  end
  local name, digest = rest:match("^(.-)@(sha256:%x+)$")
  local tag
  if not name then name, tag = rest:match("^(.*):([%w_][%w_.-]*)$") end
  if not name then name, tag = rest, "latest" end
  if not name:match("^[a-z0-9]+[a-z0-9._/-]*$") or name:find("%.%.") then
    errors.raise("VALIDATION_FAILED", ("image reference %s: %q is not a repository name"):format(ref, name))
  end
  return { host = host, name = name, reference = digest or tag, digest = digest }
end

local function loopback(host)
  local h = host:gsub(":%d+$", "")
  return h == "localhost" or h:match("^127%.%d+%.%d+%.%d+$") ~= nil or h == "[::1]"
end

-- curl argv for url, writing the body to out and the headers to hdr
local function curl(url, out, hdr, opts)
  local http_ok = opts.loopback
  local argv = { M.CURL, "-sS", "-L", "--max-redirs", "5", "--connect-timeout", "30",
    "--proto", http_ok and "=http,https" or "=https", "--proto-redir", http_ok and "=http,https" or "=https",
    "-o", out, "-D", hdr, "-w", "%{http_code}", "-H", "Accept: " .. (opts.accept or "*/*") }
  if opts.max then argv[#argv + 1] = "--max-filesize" argv[#argv + 1] = tostring(opts.max) end
  if opts.auth_file then argv[#argv + 1] = "-H" argv[#argv + 1] = "@" .. opts.auth_file end
  argv[#argv + 1] = "--"
  argv[#argv + 1] = url
  return argv
end

-- Runs argv on the host; -> exit code, stdout (the status), stderr (bounded)
local function run(argv)
  local out, err = {}, {}
  local proc, pipes, code
  local exit_code = async.await(function(resume)
    local pending, status = 3, nil
    local function finish() pending = pending - 1 if pending == 0 then resume(status) end end
    proc, pipes, code = core.spawn { args = argv, file = argv[1], setsid = true, pdeathsig = "SIGKILL",
      env = { PATH = "/usr/bin:/bin", LC_ALL = "C" },
      stdio = { [0] = "null", [1] = "pipe", [2] = "pipe" },
      on_exit = function(c) status = c finish() end }
    if not proc then return resume(nil) end
    local function reader(t)
      return function(_, data)
        if data then
          if #t < 64 then t[#t + 1] = data end
        else finish() end
      end
    end
    pipes[1]:read_start(reader(out))
    pipes[2]:read_start(reader(err))
    local t = core.timer()
    t:start(M.TIMEOUT_MS, 0, function() core.kill(-proc:pid(), "SIGKILL") end)
    local prev = finish
    finish = function() if pending == 1 then t:close() end prev() end
    return function() core.kill(-proc:pid(), "SIGKILL") end
  end, "images.pull")
  if pipes and type(pipes) == "table" then
    for _, p in pairs(pipes) do if not p:is_closing() then p:close() end end
  end
  if not proc then pull_failed("cannot run curl: " .. tostring(pipes) .. " (" .. tostring(code) .. ")") end
  return exit_code, table.concat(out), table.concat(err):sub(1, 2000)
end

-- header name (lower case) -> value, of the last response in a -D file
local function headers_of(path)
  local text = util.read_file(path) or ""
  local last = text:match(".*\r?\n\r?\n(HTTP/.*)$") or text
  local h = {}
  for line in last:gmatch("[^\r\n]+") do
    local k, v = line:match("^([%w-]+):%s*(.-)%s*$")
    if k then h[k:lower()] = v end
  end
  return h
end

local function bearer_challenge(value)
  if not value or not value:match("^[Bb]earer%s") then return nil end
  local p = {}
  for k, v in value:gmatch('(%w+)="([^"]*)"') do p[k] = v end
  return p.realm and p or nil
end

local function urlencode(s)
  return (s:gsub("[^%w%-%._~]", function(c) return ("%%%02X"):format(c:byte()) end))
end

-- One session with a registry: its scratch dir, its token.
local Client = {}
Client.__index = Client

-- creds: {username, password} or nil (anonymous)
function M.client(host, scratch, creds)
  return setmetatable({ host = host, loopback = loopback(host), scratch = scratch, n = 0, creds = creds }, Client)
end

-- A 401 after the credentials (or the lack of them) were tried: said plainly.
function Client:_refused(url, what)
  if self.creds then
    pull_failed(("registry %s: %s refused the credentials of %s (HTTP 401): wrong username or password")
      :format(self.host, what, self.creds.username), { url = url, status = 401 })
  end
  pull_failed(("registry %s: %s needs credentials (HTTP 401): pull with auth = {username, password} or add "
    .. "them to the auth file"):format(self.host, what), { url = url, status = 401 })
end

function Client:_basic_file()
  if not self.basic_file then
    self.basic_file = require("moonbox.images.credentials").header_file(self.creds, self.scratch)
  end
  return self.basic_file
end

function Client:_token(challenge)
  local realm = challenge.realm
  if not (realm:match("^https://") or (self.loopback and realm:match("^http://") and loopback(realm:match(
    "^http://([^/]+)") or ""))) then
    pull_failed(("registry %s: token realm %s is not https"):format(self.host, realm))
  end
  local q = {}
  if challenge.service then q[#q + 1] = "service=" .. urlencode(challenge.service) end
  if challenge.scope then q[#q + 1] = "scope=" .. urlencode(challenge.scope) end
  local url = realm .. (#q > 0 and ((realm:find("?", 1, true) and "&" or "?") .. table.concat(q, "&")) or "")
  local body = self:_get(url, { accept = "application/json", max = 65536, no_auth = true, loopback = self.loopback,
    auth_file = self.creds and self:_basic_file() or nil, what = "its token service" })
  local doc = cjson.decode(util.read_file(body) or "")
  local token = type(doc) == "table" and (doc.token or doc.access_token)
  if type(token) ~= "string" or token == "" or token:find("[%c\r\n]") then
    pull_failed(("registry %s: the token service gave no token"):format(self.host))
  end
  local auth = self.scratch .. "/auth"
  os.remove(auth)
  local ok, msg = require("moonbox.lib.fs").write_file(auth, "Authorization: Bearer " .. token .. "\n", 384)
  if not ok then errors.raise("FILESYSTEM_ERROR", "image store: " .. tostring(msg)) end
  self.auth_file = auth
end

-- GET url into a scratch file; -> its path, headers. 401 with a bearer
-- challenge: token, then once more.
function Client:_get(url, opts, retried)
  self.n = self.n + 1
  local out, hdr = self.scratch .. "/body-" .. self.n, self.scratch .. "/head-" .. self.n
  local argv = curl(url, out, hdr, { accept = opts.accept, max = opts.max, loopback = self.loopback,
    auth_file = opts.auth_file or (not opts.no_auth and self.auth_file) or nil })
  local rc, status, stderr = run(argv)
  status = tonumber(status)
  stderr = tostring(stderr or ""):gsub("%s+$", "") -- (curl's line ends in a newline)
  if rc ~= 0 and not status then pull_failed(("GET %s: curl failed (%s): %s"):format(url, tostring(rc), stderr)) end
  local h = headers_of(hdr)
  if status == 401 and not retried and not opts.no_auth then
    local challenge = bearer_challenge(h["www-authenticate"])
    if challenge then
      self:_token(challenge)
      return self:_get(url, opts, true)
    end
    if tostring(h["www-authenticate"] or ""):match("^[Bb]asic") and self.creds then
      self.auth_file = self:_basic_file()
      return self:_get(url, opts, true)
    end
  end
  if status == 401 then self:_refused(url, opts.what or "it") end
  if status == 404 then
    errors.raise("IMAGE_NOT_FOUND", ("GET %s: 404 not found"):format(url), { url = url })
  end
  if rc ~= 0 or status ~= 200 then
    pull_failed(("GET %s: HTTP %s%s"):format(url, tostring(status), rc ~= 0 and (" (curl " .. rc .. ": " .. stderr
      .. ")") or ""), { url = url, status = status })
  end
  return out, h
end

function Client:base(name) return ("%s://%s/v2/%s"):format(self.loopback and "http" or "https", self.host, name) end

-- The manifest at reference (a tag or digest): checked against the digest
-- asked for, else the registry's Docker-Content-Digest. -> doc, hex, path
function Client:manifest(name, reference, want_digest)
  local path, h = self:_get(self:base(name) .. "/manifests/" .. reference, { accept = ACCEPT, max = M.MAX_MANIFEST })
  local hex = blob.sha256(path)
  local want = want_digest or h["docker-content-digest"]
  if want and want ~= "sha256:" .. hex then
    blob.invalid(("manifest %s of %s: content has digest sha256:%s, not %s"):format(reference, name, hex, want))
  end
  local doc = blob.read_json(path, "manifest")
  return doc, hex, path
end

function Client:blob(name, digest, what)
  local hex = blob.hex_of(digest, what)
  local have = store.blob_path(hex)
  if util.is_file(have) then return have, hex end
  local path = self:_get(self:base(name) .. "/blobs/" .. digest, { max = blob.MAX_LAYER_BYTES })
  return blob.import(path, digest, what), hex
end

-- read(ref[, creds]) -> as oci.read: {manifest, config, config_hex,
-- layers}. creds: {username, password}; without them the auth file's for
-- the registry, if any.
function M.read(ref, creds)
  local r = M.parse(ref)
  creds = creds or require("moonbox.images.credentials").from_file(r.host)
  local scratch = store.tmp_dir()
  local ok, res = pcall(function()
    local c = M.client(r.host, scratch, creds)
    local doc, mhex, mpath = c:manifest(r.name, r.reference, r.digest)
    for _ = 1, 2 do
      if not INDEX_TYPES[doc.mediaType] and not (type(doc.manifests) == "table" and doc.layers == nil) then break end
      local pick
      for _, m in ipairs(type(doc.manifests) == "table" and doc.manifests or {}) do
        local p = type(m) == "table" and m.platform
        if type(p) == "table" and p.os == "linux" and p.architecture == "amd64" then pick = m break end
      end
      if not pick then blob.invalid(("%s: no linux/amd64 manifest in the index"):format(ref)) end
      blob.hex_of(pick.digest, "manifest")
      doc, mhex, mpath = c:manifest(r.name, pick.digest, pick.digest)
    end
    blob.import(mpath, "sha256:" .. mhex, "manifest")
    if type(doc.layers) ~= "table" or type(doc.config) ~= "table" then
      blob.invalid(("%s: manifest sha256:%s is not an image manifest"):format(ref, mhex))
    end
    local cpath, chex = c:blob(r.name, doc.config.digest, "config")
    local config = blob.read_json(cpath, "config")
    local layers = {}
    for i, l in ipairs(doc.layers) do
      if type(l) ~= "table" or not require("moonbox.images.oci").LAYER_TYPES[l.mediaType] then
        blob.invalid(("layer %d: media type %s is not a tar layer"):format(i, tostring(type(l) == "table"
          and l.mediaType)))
      end
      local path, hex = c:blob(r.name, l.digest, "layer " .. i)
      layers[i] = { path = path, hex = hex }
    end
    return { manifest = mhex, config = config, config_hex = chex, layers = layers }
  end)
  store.remove(scratch)
  if not ok then error(res, 0) end
  return res
end

return M
