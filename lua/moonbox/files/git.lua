-- gitCheckout (API.md "Files"): git clone into the sandbox, run by the
-- session's shell, or on the host for a local repository only the host has
-- (policy git.allowLocal). A part of Session (lib/compose.lua).
local core = require "moonbox.core"
local async = require "moonbox.async"
local errors = require "moonbox.errors"
local fs = require "moonbox.lib.fs"
local afs = fs.awaited
local util = require "moonbox.lib.util"
local V = require "moonbox.lib.validate"
local compose = require "moonbox.lib.compose"
local paths = require "moonbox.files.paths"
local policy_mod = require "moonbox.policy"
local fail, root_of, target, queued = paths.fail, paths.root_of, paths.target, paths.queued
local Session = {} -- this part's methods, installed by session/init.lua (M.install)

local M = {}

local git_schemes = { http = true, https = true, git = true, ssh = true, file = true,
  ["git+ssh"] = true, ["ssh+git"] = true }

local function invalid_url(url, why)
  errors.raise("INVALID_GIT_URL", ("invalid git URL %q: %s"):format(url, why), { repoUrl = url })
end

-- Accepts scheme://... for the schemes git speaks natively, user@host:path
-- (scp-like ssh) and absolute paths; returns the repository's name.
local function check_git_url(url)
  if url:find("[%c%s]") then invalid_url(url, "contains whitespace or control characters") end
  if url:sub(1, 1) == "-" then invalid_url(url, "starts with '-'") end
  local scheme, rest = url:match("^([%a][%w+.-]*)://(.*)$")
  if scheme then
    if not git_schemes[scheme:lower()] then invalid_url(url, "unsupported scheme " .. scheme) end
    if scheme:lower() ~= "file" and not rest:match("^[^/]+") then invalid_url(url, "no host") end
    if not rest:find("[^/]") then invalid_url(url, "no repository path") end
  elseif not (url:match("^[%w._-]+@[%w._-]+:.") or url:sub(1, 1) == "/") then
    invalid_url(url, "expected scheme://host/path, user@host:path or an absolute path")
  end
  -- (as git names the directory: "repo/.git", "repo.git" and "repo/" are "repo")
  local name = url:gsub("[/\\]+$", ""):gsub("/%.git$", ""):gsub("[/\\]+$", ""):gsub("%.git$", "")
    :match("([^/:]+)$")
  if not name or name == "." or name == ".." then invalid_url(url, "no repository name in it") end
  return name
end
M.check_git_url = check_git_url

-- Map git clone's stderr to an error code.
local function git_error_code(stderr)
  local s = stderr:lower()
  local function has(...)
    for i = 1, select("#", ...) do
      if s:find((select(i, ...))) then return true end
    end
    return false
  end
  if has("remote branch .- not found", "couldn't find remote ref", "could not find remote branch") then
    return "GIT_BRANCH_NOT_FOUND"
  elseif has("authentication failed", "could not read username", "could not read password",
      "permission denied %(publickey", "terminal prompts disabled", "returned error: 401",
      "returned error: 403", "access denied", "invalid username or password", "host key verification failed") then
    return "GIT_AUTH_FAILED"
  elseif has("repository not found", "does not appear to be a git repository", "returned error: 404",
      "repository '.-' does not exist", "not a git repository", "no such repository") then
    return "GIT_REPOSITORY_NOT_FOUND"
  elseif has("could not resolve host", "could not resolve hostname", "failed to connect", "connection refused",
      "connection timed out", "network is unreachable", "no route to host", "operation timed out",
      "connection reset", "unable to access", "ssl", "tls", "early eof", "remote end hung up",
      "name or service not known", "temporary failure in name resolution") then
    return "GIT_NETWORK_ERROR"
  elseif has("unsupported protocol", "remote helper", "is not a git command", "invalid url",
      "malformed", "transport .- not allowed") then
    return "INVALID_GIT_URL"
  end
  return "GIT_CLONE_FAILED"
end
M.git_error_code = git_error_code

local git_options = { branch = true, targetDir = true, depth = true, timeout = true }
local git_env = { GIT_TERMINAL_PROMPT = "0", LC_ALL = "C", LANGUAGE = false }

local function trim(s) return (s:gsub("^%s+", ""):gsub("%s+$", "")) end

-- The repository path of a local URL (file:///x or /x), else nil.
local function local_repo_path(url)
  local path = url:match("^[Ff][Ii][Ll][Ee]://(/.*)$") or (url:sub(1, 1) == "/" and url) or nil
  return path and util.normalize(path)
end

-- Under namespaces a local repository the caller names may exist only on
-- the host (the Lua caller is trusted, the sandbox's commands are not):
-- true when the path is missing inside the sandbox but present outside.
local function host_only_repo(sb, url)
  local path = sb.init and local_repo_path(url)
  if not path then return false end
  return not sb:dir_exists(path) and util.is_dir(path)
end

-- Host-side clones running now: proc -> {sb, session_id, exited}. A
-- destroy or deleteSession kills theirs (they run outside the sandbox, so
-- its kill does not reach them) and waits for them to be gone before the
-- root can be removed.
local host_running = {}

-- git (or another program, argv[1]) on the host, for session; ->
-- {exitCode, stderr, timedOut}
local function host_git(argv, timeout_ms, session)
  local env = { PATH = "/usr/local/bin:/usr/bin:/bin", HOME = os.getenv("HOME") or "/", GIT_TERMINAL_PROMPT = "0",
    LC_ALL = "C" }
  local err_parts, timed_out = {}, false
  local proc, pipes, code
  local result = async.await(function(resume)
    local done = 0
    local exit_code
    local function finish() done = done + 1 if done == 2 then resume(exit_code) end end
    local entry = { sb = session.sandbox, session_id = session.id, waiters = {} }
    proc, pipes, code = core.spawn { args = argv, file = argv[1], env = env, setsid = true, pdeathsig = "SIGKILL",
      stdio = { [0] = "null", [1] = "null", [2] = "pipe" },
      on_exit = function(c)
        exit_code = c
        if proc then host_running[proc] = nil end
        entry.exited = true
        for _, w in ipairs(entry.waiters) do w() end
        finish()
      end }
    if not proc then return resume(nil) end
    if not entry.exited then host_running[proc] = entry end
    pipes[2]:read_start(function(_, data)
      if data then err_parts[#err_parts + 1] = data else pipes[2]:close() finish() end
    end)
    if timeout_ms then
      local t = core.timer()
      t:start(timeout_ms, 0, function() t:close() timed_out = true core.kill(-proc:pid(), "SIGKILL") end)
      local prev = finish
      finish = function() if done == 1 and not t:is_closing() then t:close() end prev() end
    end
  end, "gitCheckout")
  if not proc then return { exitCode = 127, stderr = tostring(pipes) .. " (" .. tostring(code) .. ")" } end
  return { exitCode = result or 1, stderr = table.concat(err_parts), timedOut = timed_out }
end

-- gitCheckout(repoUrl, {branch, targetDir, depth, timeout}) ->
-- {success, repoUrl, branch, targetDir, timestamp}: git clone, run by the
-- session (its env, its cwd) as an argv without a shell.
function Session:gitCheckout(repo_url, opts)
  self:check_live()
  if type(repo_url) ~= "string" then V.fail("repoUrl", "expected a string, got " .. type(repo_url)) end
  if not repo_url:find("%S") then V.fail("repoUrl", "repository URL is empty") end
  opts = require("moonbox.lib.seed_options").adapt(opts, require("moonbox.lib.seed_options").gitCheckout, "gitCheckout")
  opts = V.options(opts, git_options, "gitCheckout options")
  local branch = V.type(opts.branch, "string", "branch", true)
  if branch and (branch == "" or branch:find("[%c%s]") or branch:sub(1, 1) == "-") then
    V.fail("branch", ("invalid branch name %q"):format(branch))
  end
  local depth = opts.depth
  if depth ~= nil and (type(depth) ~= "number" or depth < 1 or depth % 1 ~= 0) then
    V.fail("depth", "expected an integer >= 1")
  end
  V.timeout(opts.timeout, "timeout")
  if opts.targetDir ~= nil then V.path(opts.targetDir, "targetDir") end
  local url = trim(repo_url)
  local name = check_git_url(url)
  -- a local path or file:// URL clones a repository of the runtime's own
  -- filesystem: only where the policy allows it (git.allowLocal; off in
  -- moonbox serve, where the URL comes from a tenant)
  local git_policy = self.sandbox.policy.git
  if local_repo_path(url) and not (type(git_policy) == "table" and git_policy.allowLocal == true) then
    errors.raise("POLICY_DENIED", ("git clone %s: local repositories (a path or file:// URL) are not allowed " ..
      "by the policy (git = {allowLocal = true} allows them)"):format(url),
      { repoUrl = repo_url, policy = "git.allowLocal" })
  end
  local timestamp = util.timestamp()
  local t, existed = queued(self, function()
    local dest = target(self, "gitCheckout", opts.targetDir or ("/workspace/" .. name))
    if dest.rel == "." then fail("gitCheckout", dest.view, "EEXIST: the sandbox root", "EEXIST") end
    -- the destination, or what exists of it, must resolve inside the root
    local st, msg, code = afs.stat_beneath(root_of(self.sandbox), dest.rel)
    if not st and code ~= "ENOENT" then fail("gitCheckout", dest.view, msg, code) end
    return dest, st ~= nil
  end)
  local argv = { "git", "clone" }
  if depth then argv[#argv + 1] = "--depth" argv[#argv + 1] = tostring(depth) end
  if branch then argv[#argv + 1] = "--branch" argv[#argv + 1] = branch end
  argv[#argv + 1] = "--"
  -- git ignores --depth for a plain path ("use file:// instead")
  local plain_path = url:sub(1, 1) == "/" and url:match("^[%w/._+-]+$")
  argv[#argv + 1] = (depth and plain_path) and ("file://" .. url) or url
  argv[#argv + 1] = t.host
  local r
  local sb = self.sandbox
  local host_only = host_only_repo(sb, url)
  if host_only and t.rel ~= "workspace" and t.rel:sub(1, 10) ~= "workspace/" then
    -- the rename below moves a host directory into the workspace's host
    -- directory; the sandbox's private /tmp or /root lie in its own tmpfs
    errors.raise("GIT_CLONE_FAILED", ("git clone %s: a repository only the host has can be checked out into " ..
      "/workspace only, not %s"):format(url, t.view), { repoUrl = repo_url, targetDir = t.view })
  end
  if host_only then
    -- the policy's onExec is asked as for a clone the session runs; the
    -- clone runs on the host, so a rewrite cannot be honoured: refused
    local changed = policy_mod.call_hook(sb.policy, "onExec", "gitCheckout", { command = argv }, self, argv,
      { timeout = opts.timeout, env = git_env })
    if changed ~= nil and changed ~= argv then
      errors.raise("POLICY_DENIED", ("git clone %s: the onExec hook rewrote a clone of a repository only the host " ..
        "has, which runs on the host and cannot be rewritten"):format(url), { repoUrl = repo_url, hook = "onExec" })
    end
    -- clone next to the workspace on the host (not inside it, where the
    -- sandbox could plant a symlink), then move it in with a confined rename
    sb.clone_seq = (sb.clone_seq or 0) + 1
    local tmp = (".clone-%d"):format(sb.clone_seq)
    -- a leftover (or, below, a failed clone) is removed on the thread pool:
    -- a whole repository is too much to walk on the loop
    fs.remove_tree(sb.root, tmp)
    assert(core.mkdir(sb.root .. "/" .. tmp, 448))
    argv[#argv] = sb.root .. "/" .. tmp .. "/repo"
    r = host_git(argv, opts.timeout, self)
    if sb.destroyed or self.destroyed then
      -- killed by the destroy or deleteSession (kill_host_clones): the
      -- partial clone goes, nothing else is made in a root that may be gone
      fs.remove_tree(sb.root, tmp)
      self:check_ended("gitCheckout")
    end
    local creds = sb:fs_creds()
    if r.exitCode == 0 and not r.timedOut and creds then
      -- the sandbox's root owns what it gets; the clone lies in a directory
      -- only the runtime reaches, where a plain chown -R cannot be raced
      local c = host_git({ "chown", "-R", "-h", "--", ("%d:%d"):format(creds.uid, creds.gid),
        sb.root .. "/" .. tmp .. "/repo" }, nil, self)
      if c.exitCode ~= 0 then
        r = { exitCode = 128, stderr = "fatal: cannot give the clone to the sandbox's user: " .. c.stderr }
      end
    end
    if r.exitCode == 0 and not r.timedOut then
      -- leading directories, as git clone would make them: confined like
      -- mkdir (the sandbox's mounts, its credentials)
      local parent = ""
      for part in t.rel:gmatch("[^/]+/") do
        parent = parent .. part
        pcall(afs.mkdir_beneath, root_of(sb), parent:sub(1, -2), 493)
      end
      local ok, done, msg, code = pcall(afs.rename_beneath, sb.root, tmp .. "/repo", t.rel)
      if not ok or not done then
        local exists = code == "ENOTEMPTY" or code == "EEXIST" or code == "ENOTDIR"
        r = { exitCode = 128, stderr = exists and
          ("fatal: destination path '%s' already exists and is not an empty directory.\n"):format(t.view)
          or ("fatal: %s\n"):format(tostring(ok and msg or done)) }
      end
    end
    fs.remove_tree(sb.root, tmp)
  else
    local ran, res = pcall(self.exec, self, argv, { timeout = opts.timeout, env = git_env })
    if not ran then
      -- cut short (deleteSession, a cancel): no partial clone is left in a
      -- sandbox that lives on (a destroyed one's root is not touched)
      if not existed and not sb.destroyed then pcall(fs.remove_tree, root_of(sb), t.rel, "in_root") end
      error(res, 0)
    end
    r = res
  end
  local context = { repoUrl = repo_url, branch = branch, targetDir = t.view, exitCode = r.exitCode,
    stderr = r.stderr }
  if r.timedOut then
    context.timedOut = true
    if not existed then self:exec({ "rm", "-rf", "--", t.host }) end
    errors.raise("GIT_CLONE_FAILED", ("git clone %s timed out after %s ms"):format(url, tostring(opts.timeout)),
      context)
  end
  if r.exitCode ~= 0 then
    local code = git_error_code(r.stderr)
    local detail = r.stderr:match("fatal: ([^\n]+)") or trim(r.stderr)
    errors.raise(code, ("git clone %s: %s"):format(url, detail), context)
  end
  local head = self:exec({ "git", "-C", t.host, "symbolic-ref", "--short", "-q", "HEAD" }, { env = git_env })
  local checked_out = head.exitCode == 0 and trim(head.stdout) or ""
  if checked_out == "" then
    head = self:exec({ "git", "-C", t.host, "rev-parse", "--abbrev-ref", "HEAD" }, { env = git_env })
    checked_out = trim(head.stdout)
    if checked_out == "HEAD" or checked_out == "" then checked_out = branch or "HEAD" end
  end
  return { success = true, repoUrl = repo_url, branch = checked_out, targetDir = t.view, timestamp = timestamp }
end

-- deleteSession (session_id) or destroy (nil): its host-side clones are
-- killed, and gone when this returns (at most 2 s)
function M.kill_host_clones(sb, session_id)
  local mine = {}
  for proc, e in pairs(host_running) do
    if e.sb == sb and (session_id == nil or e.session_id == session_id) then mine[#mine + 1] = { proc, e } end
  end
  for _, pe in ipairs(mine) do pcall(core.kill, -pe[1]:pid(), "SIGKILL") end
  for _, pe in ipairs(mine) do
    local e = pe[2]
    if not e.exited and async.in_task() then
      async.await(function(resume)
        local t = core.timer()
        local function done() if not t:is_closing() then t:close() end resume() end
        e.waiters[#e.waiters + 1] = done
        t:start(2000, 0, done)
      end, "gitCheckout's end")
    end
  end
end

-- A part of Session (lib/compose.lua): gitCheckout; its host-side clones
-- end with the session and the sandbox.
function M.install(class, hooks)
  compose.methods(class, Session, "git")
  compose.add(hooks, "session_ending", M.kill_host_clones)
end

return M
