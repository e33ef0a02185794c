-- The file calls of a sandbox: paths are the sandbox's view (/workspace/...),
-- relative ones start at the session's cwd. Run: ./build/moonbox examples/files.lua
local moonbox = require "moonbox"
local sandbox = moonbox.getSandbox("files-example", { root = os.tmpname() .. ".d" })

sandbox:mkdir("/workspace/src/lib", { recursive = true })
sandbox:writeFile("/workspace/src/main.lua", 'print("hello")\n')
sandbox:writeFile("src/config.json", '{"name": "demo", "version": 1}\n')
local file = sandbox:readFile("src/main.lua")
print(("read %s: %d bytes, %s, %s"):format(file.path, file.size, file.mimeType, file.encoding))

-- Binary content travels as base64: a 1x1 PNG
local png = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
sandbox:writeFile("src/dot.png", png, { encoding = "base64" })
local image = sandbox:readFile("src/dot.png")
print(("dot.png: %s, binary=%s, base64 intact=%s"):format(image.mimeType, tostring(image.isBinary),
  tostring(image.content == png)))
print("config.json: " .. sandbox:readFile("src/config.json").mimeType)

-- Rename, list, check, delete
local moved = sandbox:renameFile("src/main.lua", "src/lib/init.lua")
print(("renamed %s -> %s"):format(moved.path, moved.newPath))
for _, f in ipairs(sandbox:listFiles("src", { recursive = true }).files) do
  print(("  %-9s %-10s %s"):format(f.type, f.mode, f.relativePath))
end
sandbox:exec("cd src/lib") -- relative paths follow the session's cwd
print("init.lua exists: " .. tostring(sandbox:exists("init.lua").exists))
sandbox:deleteFile("init.lua")
print("after delete: " .. tostring(sandbox:exists("/workspace/src/lib/init.lua").exists))

-- Leaving the sandbox is refused, by path or by symlink
sandbox:exec("ln -s /etc escape")
local ok, err = pcall(sandbox.readFile, sandbox, "escape/passwd")
print(("escape/passwd: ok=%s %s"):format(tostring(ok), err.code))
sandbox:destroy()
