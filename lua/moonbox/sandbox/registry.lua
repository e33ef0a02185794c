-- The runtime's sandboxes and the pids it owns. It requires nothing, so
-- what must ask "which sandboxes live, which pids are ours" (process trees,
-- the image store, the server) can, without requiring moonbox.sandbox,
-- which requires them back.
local M = {}

-- id -> sandbox: the live ones (sandbox/init.lua adds and removes them)
M.live = {}
-- sandboxes being destroyed, out of M.live: their processes are still the
-- runtime's own while the parts collect them (M.known_pids)
M.dying = setmetatable({}, { __mode = "k" })
-- pid -> true of the session shells that live (session/shell.lua's M.live,
-- handed in by sandbox/init.lua when it loads)
M.shell_pids = {}

function M.all() return M.live end

-- pids spawned by the runtime itself (shells, background processes, code
-- kernels, terminals), which are not orphans though their parent is the
-- runtime or a sandbox's init
function M.known_pids()
  local known = {}
  for pid in pairs(M.shell_pids) do known[pid] = true end
  local function add(sb)
    for _, p in pairs(sb.processes or {}) do
      if p.pid and p.status == "running" then known[p.pid] = true end
    end
    for _, ctx in pairs(sb.contexts or {}) do
      if ctx.kernel and not ctx.kernel.dead then known[ctx.kernel.pid] = true end
    end
    for t in pairs(sb.terminals or {}) do
      if t.pid and not t.exited then known[t.pid] = true end
    end
  end
  for _, sb in pairs(M.live) do add(sb) end
  for sb in pairs(M.dying) do add(sb) end
  return known
end

return M
