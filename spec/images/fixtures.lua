-- Test images built on the spot (spec/images/make_image.py), no network:
-- a busybox-static rootfs, and layers described entry by entry.
local cjson = require "cjson"

local M = {}

local src = os.getenv("MOONBOX_SOURCE_DIR") or "."
local MAKE = "python3 " .. src .. "/spec/images/make_image.py"

local function run(cmd)
  local out = helper.sh(cmd .. " 2>&1; echo \"rc=$?\"")
  local rc = out:match("rc=(%d+)$")
  assert(rc == "0", cmd .. " failed: " .. out)
  return (out:gsub("\n?rc=%d+$", ""))
end
M.run = run

local function desc_file(dir, desc)
  local path = dir .. "/desc-" .. tostring(math.random(1e9)) .. ".json"
  local f = assert(io.open(path, "w"))
  f:write(cjson.encode(desc))
  f:close()
  return path
end

-- oci(dir, tag, desc) -> config digest; docker(file, desc) -> config digest
function M.oci(dir, tag, desc)
  return run(("%s oci '%s' '%s' '%s'"):format(MAKE, dir, tag, desc_file(dir:match("^(.*)/"), desc)))
end
function M.docker(file, desc)
  return run(("%s docker '%s' '%s'"):format(MAKE, file, desc_file(file:match("^(.*)/"), desc)))
end

-- The entries of a busybox rootfs: /bin/busybox and its applets as
-- symlinks, an /etc/os-release that is not the host's.
function M.busybox_entries()
  local entries = {
    { path = "bin", type = "dir" }, { path = "etc", type = "dir" },
    { path = "bin/busybox", type = "file", hostfile = "/bin/busybox", mode = 493 },
    { path = "etc/os-release", type = "file", content = "ID=moonbox-test-image\nNAME=\"moonbox test\"\n" },
  }
  for _, applet in ipairs { "sh", "ls", "cat", "echo", "stat", "id", "touch", "mkdir", "rm", "env", "pwd", "head",
    "grep", "ln", "cp", "mv", "wc", "true", "false", "sleep", "test", "readlink" } do
    entries[#entries + 1] = { path = "bin/" .. applet, type = "symlink", target = "busybox" }
  end
  return entries
end

-- bash and the libraries it loads (ldd), copied from the host: the
-- session shell comes from the image. Paths as the loader names them
-- (/lib/x86_64-linux-gnu/..., /lib64/ld-linux-x86-64.so.2).
function M.bash_entries()
  local entries, dirs = {}, {}
  local function add_dirs(path)
    local acc = ""
    for part in path:gmatch("([^/]+)/") do
      acc = acc .. part
      if not dirs[acc] then
        dirs[acc] = true
        entries[#entries + 1] = { path = acc, type = "dir" }
      end
      acc = acc .. "/"
    end
  end
  local files = { "/bin/bash" }
  for line in helper.sh("ldd /bin/bash"):gmatch("[^\n]+") do
    local path = line:match("=> (/%S+)") or line:match("^%s*(/%S+)")
    if path then files[#files + 1] = path end
  end
  for _, path in ipairs(files) do
    local rel = path:sub(2)
    add_dirs(rel)
    entries[#entries + 1] = { path = rel, type = "file", hostfile = helper.sh("realpath '" .. path .. "'"), mode = 493 }
  end
  return entries
end

-- luajit and lua-cjson from the host, for a Lua code context (its kernel):
-- the binary at bin (default bin/luajit), its libraries where ldd says.
function M.luajit_entries(entries, bin)
  local have = {}
  for _, e in ipairs(entries) do have[e.path] = true end
  local function add(path)
    local acc = ""
    for part in path:gmatch("([^/]+)/") do
      acc = acc .. part
      if not have[acc] then
        have[acc] = true
        entries[#entries + 1] = { path = acc, type = "dir" }
      end
      acc = acc .. "/"
    end
    if not have[path] then
      have[path] = true
      entries[#entries + 1] = { path = path, type = "file",
        hostfile = helper.sh("realpath '" .. (path == bin and "/usr/bin/luajit" or "/" .. path) .. "'"), mode = 493 }
    end
  end
  bin = bin or "bin/luajit"
  add(bin)
  for _, host in ipairs { "/usr/bin/luajit", "/usr/lib/x86_64-linux-gnu/lua/5.1/cjson.so" } do
    for line in helper.sh("ldd " .. host):gmatch("[^\n]+") do
      local path = line:match("=> (/%S+)") or line:match("^%s*(/%S+)")
      if path then add(path:sub(2)) end
    end
  end
  add("usr/lib/x86_64-linux-gnu/lua/5.1/cjson.so")
end

-- busybox with bash: a rootfs sessions can use
function M.shell_entries()
  local e = M.busybox_entries()
  for _, x in ipairs(M.bash_entries()) do
    if x.path ~= "bin" then e[#e + 1] = x end
  end
  return e
end

-- The multi-layer image: busybox below; a second layer that deletes a file
-- (whiteout), replaces a directory's content (opaque), hard-links a file
-- and gives one a file capability (cap_net_raw+ep, VFS_CAP_REVISION_2) when
-- the runtime is root (an unprivileged one cannot keep it: store_spec).
M.CAP_NET_RAW_EP = "0100000200200000000000000000000000000000"
function M.layered_desc()
  return {
    config = { Env = { "PATH=/bin", "IMAGE_GREETING=hello from the image" }, WorkingDir = "/srv",
      Cmd = { "/bin/sh" } },
    layers = {
      { gzip = true, entries = (function()
        local e = M.shell_entries()
        e[#e + 1] = { path = "etc/doomed", type = "file", content = "delete me" }
        e[#e + 1] = { path = "opt", type = "dir" }
        e[#e + 1] = { path = "opt/old1", type = "file", content = "old" }
        e[#e + 1] = { path = "opt/old2", type = "file", content = "old" }
        e[#e + 1] = { path = "srv", type = "dir" }
        return e
      end)() },
      { entries = {
        { path = "etc", type = "dir" }, { path = "etc/.wh.doomed", type = "file" },
        { path = "opt", type = "dir" }, { path = "opt/.wh..wh..opq", type = "file" },
        { path = "opt/new", type = "file", content = "new" },
        { path = "srv", type = "dir" },
        { path = "srv/data", type = "file", content = "shared inode", mode = 420 },
        { path = "srv/data-link", type = "hardlink", target = "srv/data" },
        { path = "bin/pinger", type = "file", hostfile = "/bin/busybox", mode = 493,
          xattrs = require("moonbox.sandbox.disk").host_root() and { ["security.capability"] = M.CAP_NET_RAW_EP }
            or nil },
      } },
    },
  }
end

return M
