-- Start a dev server, wait until it answers, fetch a page, stream its logs,
-- then kill it (and everything it started).
local moonbox = require "moonbox"
local sandbox = moonbox.getSandbox("dev-server", { root = os.tmpname() .. ".d" })
local port = 18000 + (tonumber(tostring({}):match("0x(%x+)"), 16) or 0) % 2000

sandbox:exec('mkdir -p site && echo "<h1>hello from moonbox</h1>" > site/index.html')
local server = sandbox:startProcess(("exec python3 -m http.server %d --bind 127.0.0.1 --directory site"):format(port),
  { processId = "web" })
server:waitForPort(port, { mode = "http", timeout = 15000 })
print("server ready: " .. server.status)

local page = sandbox:exec({ "python3", "-c", ("import urllib.request as u;" ..
  "print(u.urlopen('http://127.0.0.1:%d/').read().decode().strip())"):format(port) })
print("page: " .. page.stdout:gsub("\n$", ""))

local line = server:waitForLog("GET / HTTP", 5000)
print("log line seen: " .. (line.match and "GET /" or "?"))

server:kill()
server:waitForExit(10000)
print(("server %s, exit code %d"):format(server.status, server.exitCode))
for ev in sandbox:streamProcessLogs("web") do
  if ev.type == "exit" then print("stream ended with exit " .. ev.exitCode) end
end
sandbox:destroy()
