/* libmoonbox: a Lua state with moonbox.core preloaded on a uv loop (ours or
 * the caller's), and the Lua modules found relative to the library itself
 * (install tree or build tree), or in $MOONBOX_LUA_DIR. */
#include "moonbox.h"
#include "private.h"

#include <lua.h>
#include <lauxlib.h>
#include <lualib.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct moonbox {
  lua_State *L;
  uv_loop_t *loop;
  int own_loop;
  char *error;
};

const char *moonbox_version(void) { return MOONBOX_VERSION; }

static int is_file(const char *path) { return access(path, R_OK) == 0; }

/* Where the Lua half lives: $MOONBOX_LUA_DIR, else relative to this
 * library (dladdr): <libdir>/../share/lua/5.1 when installed (the relative
 * path is the one between the configured libdir and datadir, so a moved
 * prefix still works), <build>/lua (a link to the source tree's lua/) in
 * the build tree. Empty when none holds moonbox/init.lua: then only the
 * default package.path is searched. */
static void lua_dir(char *out, size_t size) {
  static const char *const rels[] = {MOONBOX_LUA_REL_DIR, "lua"};
  char self[PATH_MAX], probe[PATH_MAX + 64], real[PATH_MAX];
  out[0] = 0;
  const char *env = getenv("MOONBOX_LUA_DIR");
  if (env && env[0]) {
    snprintf(out, size, "%s", env);
    return;
  }
  if (!mb_self_dir(self, sizeof self)) return;
  for (size_t i = 0; i < sizeof rels / sizeof *rels; i++) {
    snprintf(probe, sizeof probe, "%s/%s/moonbox/init.lua", self, rels[i]);
    if (is_file(probe) && realpath(probe, real)) {
      /* the resolved .../moonbox/init.lua, less "/moonbox/init.lua" */
      for (int cuts = 0; cuts < 2; cuts++) {
        char *cut = strrchr(real, '/');
        if (cut) *cut = 0;
      }
      snprintf(out, size, "%s", real);
      return;
    }
  }
}

static void set_error(moonbox *mb, const char *msg) {
  free(mb->error);
  mb->error = msg ? strdup(msg) : NULL;
}

moonbox *moonbox_new(uv_loop_t *loop) {
  moonbox *mb = (moonbox *)calloc(1, sizeof *mb);
  if (!mb) return NULL;
  if (!loop) {
    loop = (uv_loop_t *)malloc(sizeof *loop);
    if (!loop || uv_loop_init(loop) != 0) {
      free(loop);
      free(mb);
      return NULL;
    }
    mb->own_loop = 1;
  }
  mb->loop = loop;
  lua_State *L = mb->L = luaL_newstate();
  if (!L) {
    moonbox_close(mb);
    return NULL;
  }
  luaL_openlibs(L);
  lua_pushlightuserdata(L, loop);
  lua_setfield(L, LUA_REGISTRYINDEX, "moonbox.loop");
  /* package.preload["moonbox.core"] and the module path */
  lua_getglobal(L, "package");
  lua_getfield(L, -1, "preload");
  lua_pushcfunction(L, luaopen_moonbox_core);
  lua_setfield(L, -2, "moonbox.core");
  lua_pop(L, 1);
  char dir[PATH_MAX];
  lua_dir(dir, sizeof dir);
  if (dir[0]) {
    lua_getfield(L, -1, "path");
    lua_pushfstring(L, "%s/?.lua;%s/?/init.lua;%s", dir, dir, lua_tostring(L, -1));
    lua_setfield(L, -3, "path");
    lua_pop(L, 1);
  }
  lua_pop(L, 1);
  return mb;
}

/* Calls require("moonbox._runtime").<fn>(chunk, drive, args...) */
static int start(moonbox *mb, int load_status, int argc, char **argv) {
  lua_State *L = mb->L;
  if (load_status != 0) {
    set_error(mb, lua_tostring(L, -1));
    lua_pop(L, 1);
    return 1;
  }
  int chunk = lua_gettop(L);
  lua_getglobal(L, "require");
  lua_pushstring(L, "moonbox._runtime");
  if (lua_pcall(L, 1, 1, 0) != 0) {
    set_error(mb, lua_tostring(L, -1));
    lua_settop(L, chunk - 1);
    return 1;
  }
  lua_getfield(L, -1, "main");
  lua_pushvalue(L, chunk);
  lua_pushboolean(L, mb->own_loop);
  for (int i = 0; i < argc; i++) lua_pushstring(L, argv[i]);
  if (lua_pcall(L, 2 + argc, 2, 0) != 0) {
    set_error(mb, lua_tostring(L, -1));
    lua_settop(L, chunk - 1);
    return 1;
  }
  int ok = lua_toboolean(L, -2);
  set_error(mb, ok ? NULL : lua_tostring(L, -1));
  lua_settop(L, chunk - 1);
  return ok ? 0 : 1;
}

int moonbox_run_file(moonbox *mb, const char *path, int argc, char **argv) {
  lua_State *L = mb->L;
  /* the script's `arg` table: arg[0] = script, arg[1..] = its arguments */
  lua_createtable(L, argc, 1);
  lua_pushstring(L, path);
  lua_rawseti(L, -2, 0);
  for (int i = 0; i < argc; i++) {
    lua_pushstring(L, argv[i]);
    lua_rawseti(L, -2, i + 1);
  }
  lua_setglobal(L, "arg");
  return start(mb, luaL_loadfile(L, path), argc, argv);
}

int moonbox_run_string(moonbox *mb, const char *code, const char *chunkname) {
  return start(mb, luaL_loadbuffer(mb->L, code, strlen(code), chunkname ? chunkname : "=(string)"), 0, NULL);
}

int moonbox_run_string_args(moonbox *mb, const char *code, const char *chunkname, const char *arg0, int argc,
                            char **argv) {
  lua_State *L = mb->L;
  lua_createtable(L, argc, 1);
  lua_pushstring(L, arg0 ? arg0 : "");
  lua_rawseti(L, -2, 0);
  for (int i = 0; i < argc; i++) {
    lua_pushstring(L, argv[i]);
    lua_rawseti(L, -2, i + 1);
  }
  lua_setglobal(L, "arg");
  return start(mb, luaL_loadbuffer(L, code, strlen(code), chunkname ? chunkname : "=(string)"), argc, argv);
}

int moonbox_set_policy(moonbox *mb, const char *policy) {
  lua_State *L = mb->L;
  lua_getglobal(L, "require");
  lua_pushstring(L, "moonbox.policy");
  if (lua_pcall(L, 1, 1, 0) != 0) {
    set_error(mb, lua_tostring(L, -1));
    lua_pop(L, 1);
    return 1;
  }
  lua_getfield(L, -1, "set_default");
  lua_pushstring(L, policy);
  if (lua_pcall(L, 1, 0, 0) != 0) {
    /* error objects are tables with __tostring */
    lua_getglobal(L, "tostring");
    lua_insert(L, -2);
    lua_pcall(L, 1, 1, 0);
    set_error(mb, lua_tostring(L, -1));
    lua_pop(L, 2);
    return 1;
  }
  lua_pop(L, 1);
  return 0;
}

int moonbox_pending(moonbox *mb) {
  lua_State *L = mb->L;
  lua_getglobal(L, "require");
  lua_pushstring(L, "moonbox.async");
  if (lua_pcall(L, 1, 1, 0) != 0) {
    lua_pop(L, 1);
    return 0;
  }
  lua_getfield(L, -1, "pending");
  int n = 0;
  if (lua_pcall(L, 0, 1, 0) == 0) n = (int)lua_tointeger(L, -1);
  lua_pop(L, 2);
  return n;
}

const char *moonbox_error(moonbox *mb) {
  if (mb->error) return mb->error;
  /* an error from a task started on the caller's loop */
  lua_State *L = mb->L;
  lua_getglobal(L, "require");
  lua_pushstring(L, "moonbox._runtime");
  if (lua_pcall(L, 1, 1, 0) != 0) {
    lua_pop(L, 1);
    return NULL;
  }
  lua_getfield(L, -1, "last_error");
  if (lua_isstring(L, -1)) set_error(mb, lua_tostring(L, -1));
  lua_pop(L, 2);
  return mb->error;
}

uv_loop_t *moonbox_loop(moonbox *mb) { return mb->loop; }
struct lua_State *moonbox_lua(moonbox *mb) {
  return mb->L;
}

void moonbox_close(moonbox *mb) {
  if (!mb) return;
  if (mb->L) {
    lua_State *L = mb->L;
    lua_getglobal(L, "require");
    lua_pushstring(L, "moonbox._runtime");
    if (lua_pcall(L, 1, 1, 0) == 0) {
      lua_getfield(L, -1, "shutdown");
      if (lua_pcall(L, 0, 0, 0) != 0) lua_pop(L, 1);
    }
    lua_pop(L, 1);
    lua_close(L);
  }
  if (mb->own_loop && mb->loop) {
    uv_run(mb->loop, UV_RUN_DEFAULT);
    uv_loop_close(mb->loop);
    free(mb->loop);
  }
  free(mb->error);
  free(mb);
}
