-- Images: a sandbox whose root is an OCI image, not the host's /usr.
-- Builds a tiny image on the spot (busybox, and bash with the libraries it
-- loads, copied from the host) as an OCI image layout with tar and
-- sha256sum, imports it into the image store, runs a sandbox from it,
-- commits what that sandbox changed as a new image and starts a second
-- sandbox from that. The two images are removed from the store at the end.
-- Run: ./build/moonbox examples/image.lua   (needs busybox-static)
local moonbox = require "moonbox"
local cjson = require "cjson"

local function sh(cmd)
  local p = io.popen(cmd)
  local out = p:read("*a")
  p:close()
  return (out:gsub("\n$", ""))
end
local function write(path, text)
  local f = assert(io.open(path, "wb"))
  f:write(text)
  f:close()
end

local dir = os.tmpname() .. ".d"
local rootfs, layout = dir .. "/rootfs", dir .. "/layout"
-- the root filesystem: busybox and its applets, bash and its libraries
os.execute(("mkdir -p '%s/bin' '%s/etc' '%s/blobs/sha256'"):format(rootfs, rootfs, layout))
os.execute(("cp /bin/busybox /bin/bash '%s/bin/'"):format(rootfs))
for _, applet in ipairs { "sh", "cat", "ls", "echo" } do
  os.execute(("ln -s busybox '%s/bin/%s'"):format(rootfs, applet))
end
for lib in sh("ldd /bin/bash | grep -o '/[^ ]*'"):gmatch("[^\n]+") do
  os.execute(("mkdir -p '%s%s' && cp -L '%s' '%s%s'"):format(rootfs, lib:match("^(.*)/"), lib, rootfs, lib))
end
write(rootfs .. "/etc/os-release", 'PRETTY_NAME="moonbox example image"\n')

-- the OCI image layout: one gzipped layer, its config, a manifest, the index
local function blob(path)
  local hex = sh("sha256sum '" .. path .. "' | cut -d' ' -f1")
  os.execute(("cp '%s' '%s/blobs/sha256/%s'"):format(path, layout, hex))
  local size = tonumber(sh("stat -c %s '" .. path .. "'"))
  return "sha256:" .. hex, size
end
os.execute(("tar -C '%s' --numeric-owner --owner=0 --group=0 -cf '%s/layer.tar' ."):format(rootfs, dir))
local diff_id = "sha256:" .. sh("sha256sum '" .. dir .. "/layer.tar' | cut -d' ' -f1")
os.execute(("gzip -n '%s/layer.tar'"):format(dir))
local layer, layer_size = blob(dir .. "/layer.tar.gz")
write(dir .. "/config.json", cjson.encode {
  architecture = "amd64", os = "linux",
  config = { Env = { "PATH=/bin", "GREETING=hello from the image" }, WorkingDir = "/" },
  rootfs = { type = "layers", diff_ids = { diff_id } },
})
local config, config_size = blob(dir .. "/config.json")
write(dir .. "/manifest.json", cjson.encode {
  schemaVersion = 2, mediaType = "application/vnd.oci.image.manifest.v1+json",
  config = { mediaType = "application/vnd.oci.image.config.v1+json", digest = config, size = config_size },
  layers = { { mediaType = "application/vnd.oci.image.layer.v1.tar+gzip", digest = layer, size = layer_size } },
})
local manifest, manifest_size = blob(dir .. "/manifest.json")
write(layout .. "/oci-layout", '{"imageLayoutVersion":"1.0.0"}')
write(layout .. "/index.json", cjson.encode { schemaVersion = 2, manifests = { {
  mediaType = "application/vnd.oci.image.manifest.v1+json", digest = manifest, size = manifest_size,
  annotations = { ["org.opencontainers.image.ref.name"] = "1.0" } } } })

moonbox.run(function()
  local img = moonbox.images.pull("oci:" .. layout .. ":1.0", { name = "moonbox-example:1.0" })
  print(("imported %s: %d layer, config %s"):format(img.name, #img.layers, img.digest:sub(1, 19)))

  local sb = moonbox.getSandbox("image-example", { root = dir .. "/sb1", image = "moonbox-example:1.0" })
  print("os-release: " .. sb:exec("cat /etc/os-release").stdout:gsub("\n$", ""))
  print("env: " .. sb:exec("echo $GREETING").stdout:gsub("\n$", ""))
  print("host python3 visible: " .. sb:exec("test -e /usr/bin/python3 && echo yes || echo no").stdout:gsub("\n$", ""))
  -- the root is writable: changes land in this sandbox's own upper dir
  sb:exec("echo 'made in the first sandbox' > /etc/motd")
  local template = sb:commit { name = "moonbox-example:1.1" }
  print(("committed %s: %d layers"):format(template.name, #template.layers))
  sb:destroy()

  local sb2 = moonbox.getSandbox("image-example-2", { root = dir .. "/sb2", image = "moonbox-example:1.1" })
  print("from the template: " .. sb2:exec("cat /etc/motd").stdout:gsub("\n$", ""))
  print("image in info(): " .. sb2:info().image.name)
  sb2:destroy()

  moonbox.images.remove("moonbox-example:1.1")
  moonbox.images.remove("moonbox-example:1.0")
end)
os.execute("rm -rf '" .. dir .. "'")
