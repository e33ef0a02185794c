-- Expose a port of a sandbox and reach it through the proxy of a server
-- (what `moonbox serve` does), by its host name and by its path. The sandbox
-- keeps its network closed: the proxy connects from inside it.
local moonbox = require "moonbox"
local http = require "moonbox.server.http"
local cli = require "moonbox.server.cli"
local ports = require "moonbox.ports"

-- the server of `moonbox serve`, in this script (loopback, no token)
local server = http.listen({ listen = "127.0.0.1:0" }, cli.app {})
ports.server = { port = tonumber(server.address:match(":(%d+)$")) }

local box = moonbox.getSandbox("ports-example", { root = os.tmpname() .. ".d" })
local port = 18000 + (tonumber(tostring({}):match("0x(%x+)"), 16) or 0) % 2000
box:exec('mkdir -p site && echo "<h1>hello through the proxy</h1>" > site/index.html')
local web = box:startProcess(("exec python3 -m http.server %d --bind 127.0.0.1 --directory site"):format(port))
web:waitForPort(port, { mode = "http", timeout = 15000 })

local exposed = box:exposePort(port, { name = "web" })
print(("exposed %s as %s"):format(exposed.name, exposed.url:gsub("%d+%-", "PORT-", 1):gsub(":%d+/$", ":SERVER/")))
print("exposed ports: " .. #box:getExposedPorts())

-- a client on the host's network: a sandbox without namespaces
local client = moonbox.getSandbox("ports-example-client", { root = os.tmpname() .. ".d", isolation = "none" })
local by_name = client:exec({ "curl", "-sS", exposed.url })
print("by host name: " .. by_name.stdout:gsub("\n$", ""))
local path_url = ("http://%s/v1/sandboxes/%s/ports/%d/"):format(server.address, box.id, port)
local by_path = client:exec({ "curl", "-sS", path_url })
print("by path: " .. by_path.stdout:gsub("\n$", ""))

box:unexposePort(port)
local gone = client:exec({ "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", exposed.url })
print("after unexposePort: " .. gone.stdout)

client:destroy()
box:destroy()
server:close()
