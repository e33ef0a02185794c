-- Host commands the egress network runs (ip, nft, nsenter): waited for on
-- the loop, stdin given whole, stdout and stderr kept up to a bound.
local core = require "moonbox.core"
local async = require "moonbox.async"

local M = {}

M.ENV = { PATH = "/usr/sbin:/usr/bin:/sbin:/bin", LANG = "C" }
M.MAX_OUTPUT = 4 * 1024 * 1024

-- find(name) -> its path in the system's directories | nil
function M.find(name)
  for _, dir in ipairs { "/usr/sbin", "/usr/bin", "/sbin", "/bin" } do
    local f = io.open(dir .. "/" .. name)
    if f then f:close() return dir .. "/" .. name end
  end
end

-- run(argv, stdin?) -> stdout | nil, message
function M.run(argv, stdin)
  local result = { out = {}, err = {}, size = 0, open = 2 }
  local proc, pipes, code = core.spawn {
    args = argv, env = M.ENV,
    stdio = { [0] = stdin and "pipe" or "null", [1] = "pipe", [2] = "pipe" },
    pdeathsig = "SIGKILL",
    on_exit = function(status)
      result.status = status
      if result.resume then result.resume() end
    end,
  }
  if not proc then return nil, ("%s: %s"):format(argv[1], tostring(pipes or code)) end
  local function reader(into)
    return function(_, data)
      if data then
        if result.size < M.MAX_OUTPUT then into[#into + 1] = data end
        result.size = result.size + #data
      else
        result.open = result.open - 1
        if result.resume then result.resume() end
      end
    end
  end
  pipes[1]:read_start(reader(result.out))
  pipes[2]:read_start(reader(result.err))
  if stdin then
    pipes[0]:write(stdin)
    pipes[0]:shutdown(function() pipes[0]:close() end)
  end
  while result.status == nil or result.open > 0 do
    async.await(function(resume) result.resume = resume end, argv[1])
    result.resume = nil
  end
  pipes[1]:close()
  pipes[2]:close()
  if result.status ~= 0 then
    local text = table.concat(result.err):gsub("%s+$", "")
    return nil, ("%s exited %s%s"):format(table.concat(argv, " "), tostring(result.status),
      text ~= "" and (": " .. text:sub(1, 2000)) or "")
  end
  return table.concat(result.out)
end

-- the same, inside the network namespace of pid
function M.run_in(pid, argv)
  local full = { "nsenter", "--net=/proc/" .. pid .. "/ns/net", "--" }
  for _, a in ipairs(argv) do full[#full + 1] = a end
  return M.run(full)
end

return M
