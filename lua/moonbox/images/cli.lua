-- `moonbox image pull REF [--name NAME] | ls | rm NAME`: the image store
-- from the shell (docs/images.md). Progress and errors go to stderr; ls
-- prints one image a line (name, digest, layers, size) on stdout.
local errors = require "moonbox.errors"
local images = require "moonbox.images"

local M = {}

M.usage = [[
usage: moonbox image pull REF [--name NAME] [--username USER --password-stdin]
         (REF: oci:DIR[:TAG] | docker-archive:FILE | REGISTRY/NAME[:TAG])
       moonbox image ls
       moonbox image rm NAME
]]

local function usage_error(msg)
  errors.raise("VALIDATION_FAILED", msg .. "\n" .. M.usage)
end

local function human(n)
  local units = { "B", "KiB", "MiB", "GiB", "TiB" }
  local i = 1
  while n >= 1024 and i < #units do
    n = n / 1024
    i = i + 1
  end
  return i == 1 and ("%d %s"):format(n, units[i]) or ("%.1f %s"):format(n, units[i])
end

local function pull(argv)
  local ref, name, username, password_stdin = nil, nil, nil, false
  local i = 2
  while argv[i] do
    if argv[i] == "--name" then
      name = argv[i + 1] or usage_error("--name needs a value")
      i = i + 2
    elseif argv[i] == "--username" then
      username = argv[i + 1] or usage_error("--username needs a value")
      i = i + 2
    elseif argv[i] == "--password-stdin" then
      password_stdin = true
      i = i + 1
    elseif ref == nil then
      ref = argv[i]
      i = i + 1
    else
      usage_error("unexpected argument " .. argv[i])
    end
  end
  if not ref then usage_error("pull needs a reference") end
  if (username ~= nil) ~= password_stdin then usage_error("--username and --password-stdin go together") end
  local auth
  if username then
    -- the password never on a command line (ps, /proc/*/cmdline): its first line on stdin
    local password = (io.stdin:read("*l") or ""):gsub("\r$", "")
    auth = { username = username, password = password }
  end
  local rec = images.pull(ref, { name = name, auth = auth, onProgress = function(ev)
    if ev.type == "progress" then
      io.stderr:write(("layer %d/%d: %s, %d entries\n"):format(ev.index, ev.count, human(ev.bytes), ev.entries))
    elseif ev.type == "layerDone" then
      local how = ev.cached and "(cached)" or "done"
      io.stderr:write(("layer %d/%d: %s %s\n"):format(ev.index, ev.count, ev.digest, how))
    end
    io.stderr:flush()
  end })
  io.stdout:write(rec.name, " ", rec.digest, "\n")
end

local function list()
  for _, rec in ipairs(images.list()) do
    io.stdout:write(("%s\t%s\t%d layers\t%s\n"):format(rec.name, rec.digest, #rec.layers, human(rec.size)))
  end
end

function M.main(argv)
  local ok, err = pcall(function()
    local cmd = argv[1]
    if cmd == "-h" or cmd == "--help" then
      io.stdout:write(M.usage)
    elseif cmd == "pull" then
      pull(argv)
    elseif cmd == "ls" or cmd == "list" then
      if argv[2] then usage_error("ls takes no arguments") end
      list()
    elseif cmd == "rm" or cmd == "remove" then
      if not argv[2] or argv[3] then usage_error("rm needs one image name") end
      local res = images.remove(argv[2])
      io.stdout:write(res.name, " removed (", res.removedLayers, " layers freed)\n")
    else
      usage_error(cmd and ("unknown image command " .. cmd) or "an image command is needed")
    end
  end)
  io.stdout:flush()
  if not ok then
    if not errors.is_error(err) then error(err, 0) end
    io.stderr:write("moonbox image: ", err.code, ": ", (tostring(err.message):gsub("\n+$", "")), "\n")
    io.stderr:flush()
    os.exit(err.code == "VALIDATION_FAILED" and 2 or 1)
  end
end

return M
