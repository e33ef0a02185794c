/* moonbox.core, the Lua module: luaopen_moonbox_core creates the core
 * (core.c) and registers every primitive family into the module table. The
 * list below is the only place that names them all: core.c, the plumbing,
 * calls no family, so registration makes no circle (src/private.h). */
#include "private.h"
#include "moonbox_version.h"

#include <limits.h>

/* Every family, in the order they fill the module table. */
static void (*const families[])(lua_State *L) = {
  mb_open_loop,    mb_open_timer,      mb_open_signal,    mb_open_stream,      mb_open_fs,     mb_open_fs_tree,
  mb_open_userns,  mb_open_spawn,      mb_open_pty,       mb_open_sys,         mb_open_codec,  mb_open_magic,
  mb_open_fsevent, mb_open_tcp,        mb_open_udp,       mb_open_seccomp,     mb_open_nsinit, mb_open_http,
  mb_open_image,   mb_open_image_pack, mb_open_loopmount, mb_open_close_later,
};

/* When the Lua state closes: the families' own teardown, before the core
 * closes the handles still open (spawn's SIGCHLD watcher and children, then
 * the HTTP servers' sockets, whose handles the core closes after, then the
 * fds queued by close_later). */
static void teardown(mb_core *core) {
  mb_spawn_teardown(core);
  mb_http_teardown(core);
  mb_close_later_teardown(core);
}

#ifdef MOONBOX_BASH_BUILTIN_REL
/* core.bash_builtin_paths: where the session shells' spawn builtin may be,
 * relative to the object this code is in (libmoonbox.so, or moonbox/core.so),
 * in the install tree or the build tree, so that an installed tree works
 * wherever it is moved; no path from the build is baked in. */
static void bash_builtin_paths(lua_State *L) {
  static const char *const rels[] = {
    MOONBOX_BASH_BUILTIN_REL,    /* from an installed libmoonbox.so */
    "bash_spawn.so",             /* from moonbox/core.so, installed or in the build tree */
    "lib/moonbox/bash_spawn.so", /* from the build tree's libmoonbox.so */
  };
  char dir[PATH_MAX];
  lua_createtable(L, (int)(sizeof rels / sizeof *rels), 0);
  if (mb_self_dir(dir, sizeof dir)) {
    for (size_t i = 0; i < sizeof rels / sizeof *rels; i++) {
      lua_pushfstring(L, "%s/%s", dir, rels[i]);
      lua_rawseti(L, -2, (int)i + 1);
    }
  }
  lua_setfield(L, -2, "bash_builtin_paths");
}
#endif

/* Exported from moonbox/core.so (plain LuaJIT's require "moonbox.core");
 * libmoonbox preloads it (runtime.c) and exports only src/moonbox.h. */
#ifdef MOONBOX_EXPORT_LUAOPEN
__attribute__((visibility("default")))
#endif
int luaopen_moonbox_core(lua_State *L) {
  mb_core_open(L, teardown);
  lua_newtable(L);
  for (size_t i = 0; i < sizeof families / sizeof *families; i++) families[i](L);
  /* the version of the build (CMake's project version, src/moonbox_version.h.in) */
  lua_pushstring(L, MOONBOX_VERSION);
  lua_setfield(L, -2, "version");
#ifdef MOONBOX_BASH_BUILTIN_REL
  bash_builtin_paths(L);
#endif
  return 1;
}
