-- The Lua module for LuaJIT: `luarocks make` in a checkout builds it with
-- CMake (cmake build type) and installs moonbox/core.so with the bash
-- builtin beside it (LIBDIR) and the Lua modules with the code-interpreter
-- kernels (LUADIR). The `moonbox` command, libmoonbox and the page come with
-- `cmake --install` or the .deb (README.md). The build needs Debian's
-- development packages: scripts/install-deps.sh installs them.
rockspec_format = "3.0"
package = "moonbox"
version = "0.1.0-1"
source = {
  -- no public repository yet: `luarocks make` builds the checkout it runs in
  url = ".",
}
description = {
  summary = "Lua-scriptable sandbox runtime (libuv + LuaJIT)",
  detailed = [[
Sandboxes with persistent shell sessions, background processes, files and
code-interpreter contexts, isolated with namespaces, cgroups and seccomp,
driven from Lua scripts on a libuv loop.]],
  license = "MIT",
  labels = { "sandbox", "luajit", "libuv" },
}
supported_platforms = { "linux" }
dependencies = {
  "lua == 5.1", -- LuaJIT
  "lua-cjson >= 2.1", -- moonbox serve and the Lua kernel
}
external_dependencies = {
  LIBUV = { header = "uv.h" },
  LIBSECCOMP = { header = "seccomp.h" },
  LIBWSLAY = { header = "wslay/wslay.h" },
  LIBMAGIC = { header = "magic.h" },
}
build = {
  type = "cmake",
  variables = {
    CMAKE_BUILD_TYPE = "RelWithDebInfo",
    CMAKE_INSTALL_PREFIX = "$(PREFIX)",
    MOONBOX_LUAROCKS = "ON",
    MOONBOX_INSTALL_LUA_DIR = "$(LUADIR)",
    MOONBOX_INSTALL_LUA_CDIR = "$(LIBDIR)",
  },
}
