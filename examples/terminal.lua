-- Drive an interactive program through a pty terminal: start Python's REPL
-- in a shell, type into it, read its answers, then leave.
local moonbox = require "moonbox"
local sandbox = moonbox.getSandbox("terminal-demo", { root = os.tmpname() .. ".d" })
local term = sandbox:terminal { cols = 100, rows = 30 }

-- read until the output so far matches a pattern
local function expect(pattern)
  local seen = ""
  repeat
    local chunk = term:read()
    seen = seen .. (chunk or "")
  until not chunk or seen:find(pattern)
  return seen
end

term:write("python3 -q\n")
expect(">>> ")
term:write("sum(range(10))\n")
print("python says: " .. expect("\n(%d+)\r\n"):match("\n(%d+)\r\n"))
term:write("exit()\n")
term:write("stty size; exit 5\n")
print("terminal size: " .. expect("(%d+ %d+)"):match("(%d+ %d+)"))
print("shell exit code: " .. term:wait())
term:close()
sandbox:destroy()
