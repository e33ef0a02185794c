-- `moonbox mcp`: the MCP server over stdio. Messages are JSON-RPC, one per
-- line on stdin and stdout (newline-delimited, no embedded newlines); logs
-- go to stderr only. Each message is handled in a task of its own, so a
-- long tools/call does not hold up a ping or its own cancellation. At EOF
-- on stdin the session ends: what runs is cancelled and the session's
-- sandbox destroyed, then the process exits 0.
local core = require "moonbox.core"
local async = require "moonbox.async"
local errors = require "moonbox.errors"
local jsonrpc = require "moonbox.mcp.jsonrpc"
local session_mod = require "moonbox.mcp.session"

local M = {}

-- The longest message taken (a write_file's content travels in one); a
-- longer line is answered with a parse error and skipped, unread.
M.MAX_LINE = 16 * 1024 * 1024

M.usage = [[
usage: moonbox mcp [--policy strict|dev|file.lua] [--sandbox ID]
  An MCP server on stdin/stdout (JSON-RPC 2.0, one message per line; logs
  on stderr). Each session gets its own sandbox, destroyed at the end;
  --sandbox ID uses (and keeps) the named sandbox instead. docs/mcp.md
]]

-- The sandboxes of `moonbox mcp`: made as getSandbox makes them; one
-- exists when it is live here or its root is on disk.
M.provider = {
  get = function(id) return require("moonbox").getSandbox(id) end,
  exists = function(id)
    local sandbox_mod = require "moonbox.sandbox"
    if sandbox_mod.all()[id] then return true end
    return require("moonbox.lib.util").is_dir(sandbox_mod.default_home() .. "/sandboxes/" .. id)
  end,
}

-- lines(on_line, on_eof, on_too_long): read stdin through the loop and
-- hand each complete line over; bounded by MAX_LINE.
local function read_lines(on_line, on_eof, on_too_long)
  -- fd 0 itself: a client's stdin may be a socket, which /dev/stdin cannot
  -- reopen; and only what the loop can watch (a file or /dev/null cannot be)
  local what = core.readlink("/proc/self/fd/0") or "closed"
  local stream, err
  if what:match("^pipe:") or what:match("^socket:") or what:match("^/dev/pts/") or what:match("^/dev/tty") then
    stream, err = core.stream_open(0)
  else
    err = what
  end
  if not stream then
    errors.raise("VALIDATION_FAILED", "standard input must be a pipe or a socket: " .. tostring(err))
  end
  local pieces, size, skipping = {}, 0, false
  stream:read_start(function(read_err, data)
    if read_err or data == nil then
      stream:close()
      if size > 0 and not skipping then on_line(table.concat(pieces)) end
      on_eof()
      return
    end
    local at = 1
    while true do
      local nl = data:find("\n", at, true)
      local chunk = data:sub(at, nl and nl - 1 or #data)
      if not skipping then
        if size + #chunk > M.MAX_LINE then
          skipping, pieces, size = true, {}, 0
          on_too_long()
        else
          pieces[#pieces + 1] = chunk
          size = size + #chunk
        end
      end
      if not nl then break end
      if not skipping then on_line(table.concat(pieces)) end
      pieces, size, skipping = {}, 0, false
      at = nl + 1
    end
  end)
  return stream
end

local function send(msg)
  io.stdout:write(jsonrpc.encode(msg), "\n")
  io.stdout:flush()
end

-- serve(opts) -> when stdin ends. opts: sandbox (a named one).
function M.serve(opts)
  local session = session_mod.new { sandboxes = M.provider, sandbox = opts.sandbox }
  local tasks, done = {}, nil
  local function spawn(fn)
    local task, finished
    task = async.spawn(function()
      local ok, err = pcall(fn)
      if not ok then io.stderr:write("moonbox mcp: ", errors.format(err), "\n") end
      finished = true
      if task then tasks[task] = nil end
    end)
    if not finished then tasks[task] = true end
  end
  read_lines(function(line)
    if not line:find("%S") then return end
    spawn(function()
      local v, parse_error = jsonrpc.decode(line)
      local reply = parse_error or session:handle_value(v, send)
      if reply then send(reply) end
    end)
  end, function()
    if done then done() end
    done = true
  end, function()
    send(jsonrpc.error(nil, jsonrpc.PARSE_ERROR, ("message longer than %d bytes"):format(M.MAX_LINE)))
  end)
  if done ~= true then
    async.await(function(resume) done = resume end, "moonbox mcp: stdin")
  end
  session:close()
  for task in pairs(tasks) do task:cancel() end
end

local function parse(argv)
  local opts, i = {}, 1
  while i <= #argv do
    local a = argv[i]
    if a == "--policy" then
      if not argv[i + 1] then errors.raise("VALIDATION_FAILED", "--policy needs a preset or a file") end
      opts.policy = argv[i + 1]
      i = i + 2
    elseif a == "--sandbox" then
      if not argv[i + 1] then errors.raise("VALIDATION_FAILED", "--sandbox needs a sandbox id") end
      require("moonbox.lib.validate").sandbox_id(argv[i + 1], "--sandbox")
      opts.sandbox = argv[i + 1]
      i = i + 2
    else
      errors.raise("VALIDATION_FAILED", ("unknown option '%s'"):format(a))
    end
  end
  return opts
end

-- main(argv): `moonbox mcp ...`
function M.main(argv)
  for _, a in ipairs(argv) do
    if a == "--help" or a == "-h" then
      io.stdout:write(M.usage)
      io.stdout:flush()
      os.exit(0)
    end
  end
  local ok, opts = pcall(function()
    local o = parse(argv)
    -- (as `moonbox --policy P mcp` sets it; a mistake in it is said now)
    if o.policy then require("moonbox.policy").set_default(o.policy) end
    return o
  end)
  if not ok then
    io.stderr:write("moonbox mcp: ", errors.is_error(opts) and opts.message or tostring(opts), "\n", M.usage)
    os.exit(2)
  end
  -- stdout carries the protocol: anything else printed goes to stderr
  _G.print = function(...)
    local parts = {}
    for i = 1, select("#", ...) do parts[i] = tostring((select(i, ...))) end
    io.stderr:write(table.concat(parts, "\t"), "\n")
  end
  local served, err = pcall(M.serve, opts)
  if not served then
    if not errors.is_error(err) then error(err, 0) end
    io.stderr:write("moonbox mcp: ", tostring(err.message), "\n")
    os.exit(1)
  end
end

return M
