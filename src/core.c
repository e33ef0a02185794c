/* moonbox.core's plumbing: the core (one per Lua state), the loop it runs
 * on, and the handle, callback and error helpers every family shares. It
 * calls no family: module.c creates the module table and registers them. */
#include "private.h"

#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CORE_KEY "moonbox.core.state"
#define LOOP_KEY "moonbox.loop" /* light userdata set by an embedding host */

mb_core *mb_core_get(lua_State *L) {
  lua_getfield(L, LUA_REGISTRYINDEX, CORE_KEY);
  mb_core **ud = (mb_core **)lua_touserdata(L, -1);
  mb_core *core = ud ? *ud : NULL;
  lua_pop(L, 1);
  if (!core) luaL_error(L, "moonbox.core is not initialised");
  return core;
}

int mb_push_error(lua_State *L, int uv_err, const char *detail) {
  const char *name = uv_err_name(uv_err);
  lua_pushnil(L);
  if (detail) lua_pushfstring(L, "%s: %s (%s)", name, uv_strerror(uv_err), detail);
  else lua_pushfstring(L, "%s: %s", name, uv_strerror(uv_err));
  lua_pushstring(L, name);
  return 3;
}

int mb_push_errno(lua_State *L, int errnum, const char *detail) {
  return mb_push_error(L, uv_translate_sys_error(errnum), detail);
}

lua_Integer mb_opt_intfield(lua_State *L, int idx, const char *key, lua_Integer def) {
  lua_getfield(L, idx, key);
  lua_Integer v = def;
  if (!lua_isnil(L, -1)) {
    if (!lua_isnumber(L, -1)) luaL_error(L, "field '%s' must be a number", key);
    v = lua_tointeger(L, -1);
  }
  lua_pop(L, 1);
  return v;
}

/* ---- callbacks ---------------------------------------------------------- */

static int traceback(lua_State *L) {
  if (!lua_isstring(L, 1) || lua_type(L, 1) == LUA_TNUMBER) return 1; /* keep error objects */
  luaL_traceback(L, L, lua_tostring(L, 1), 1);
  return 1;
}

void mb_call(mb_core *core, lua_State *cbL, int nargs) {
  int base = lua_gettop(cbL) - nargs; /* function index */
  lua_pushcfunction(cbL, traceback);
  lua_insert(cbL, base);
  if (lua_pcall(cbL, nargs, 0, base) != 0) {
    if (core->error_handler_ref != LUA_NOREF) {
      lua_rawgeti(cbL, LUA_REGISTRYINDEX, core->error_handler_ref);
      lua_insert(cbL, -2);
      if (lua_pcall(cbL, 1, 0, 0) != 0) {
        fprintf(stderr, "moonbox: error in error handler: %s\n", lua_tostring(cbL, -1));
        lua_pop(cbL, 1);
      }
    } else {
      const char *msg = lua_tostring(cbL, -1);
      fprintf(stderr, "moonbox: error in callback: %s\n", msg ? msg : "(error object)");
      lua_pop(cbL, 1);
    }
  }
  lua_settop(cbL, base - 1);
}

/* ---- handles ------------------------------------------------------------ */

mb_handle *mb_handle_new(lua_State *L, const char *type_name, size_t extra_size) {
  mb_core *core = mb_core_get(L);
  mb_handle **ud = (mb_handle **)lua_newuserdata(L, sizeof(mb_handle *));
  mb_handle *h = (mb_handle *)calloc(1, sizeof(mb_handle) + extra_size);
  if (!h) luaL_error(L, "out of memory");
  *ud = h;
  h->core = core;
  h->type_name = type_name;
  h->uv.handle.data = h;
  for (int i = 0; i < MB_MAX_CALLBACKS; i++) h->cb_ref[i] = LUA_NOREF;
  h->extra = extra_size ? (void *)(h + 1) : NULL;
  luaL_getmetatable(L, type_name);
  lua_setmetatable(L, -2);
  lua_pushvalue(L, -1);
  h->self_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  core->open_handles++;
  h->next = core->handles;
  if (h->next) h->next->prev = h;
  core->handles = h;
  return h;
}

mb_handle *mb_handle_check(lua_State *L, int idx, const char *type_name) {
  mb_handle **ud = (mb_handle **)luaL_checkudata(L, idx, type_name);
  if (!*ud || (*ud)->closing) luaL_error(L, "%s is closed", type_name);
  return *ud;
}

static mb_handle *handle_any(lua_State *L, int idx) {
  mb_handle **ud = (mb_handle **)lua_touserdata(L, idx);
  if (!ud || !lua_getmetatable(L, idx)) luaL_argerror(L, idx, "expected a moonbox handle");
  lua_getfield(L, -1, "__moonbox_handle");
  int ok = lua_toboolean(L, -1);
  lua_pop(L, 2);
  if (!ok) luaL_argerror(L, idx, "expected a moonbox handle");
  return *ud;
}

void mb_handle_set_cb(lua_State *L, mb_handle *h, int slot, int idx) {
  luaL_checktype(L, idx, LUA_TFUNCTION);
  luaL_unref(L, LUA_REGISTRYINDEX, h->cb_ref[slot]);
  lua_pushvalue(L, idx);
  h->cb_ref[slot] = luaL_ref(L, LUA_REGISTRYINDEX);
}

void mb_handle_unset_cb(lua_State *L, mb_handle *h, int slot) {
  luaL_unref(L, LUA_REGISTRYINDEX, h->cb_ref[slot]);
  h->cb_ref[slot] = LUA_NOREF;
}

lua_State *mb_handle_push_cb(mb_handle *h, int slot) {
  if (h->cb_ref[slot] == LUA_NOREF || h->cb_ref[slot] == LUA_REFNIL) return NULL;
  lua_State *cbL = h->core->cbL;
  lua_rawgeti(cbL, LUA_REGISTRYINDEX, h->cb_ref[slot]);
  return cbL;
}

static void unlink_handle(mb_handle *h) {
  mb_core *core = h->core;
  if (h->prev) h->prev->next = h->next;
  else core->handles = h->next;
  if (h->next) h->next->prev = h->prev;
  core->open_handles--;
}

static void on_close(uv_handle_t *uvh) {
  mb_handle *h = (mb_handle *)uvh->data;
  mb_core *core = h->core;
  lua_State *cbL = core->cbL;
  if (core->dead) {
    unlink_handle(h);
    free(h);
    return;
  }
  /* slot 0 is reused for the close callback, see mb_handle_close */
  int close_ref = h->cb_ref[0];
  for (int i = 1; i < MB_MAX_CALLBACKS; i++) luaL_unref(cbL, LUA_REGISTRYINDEX, h->cb_ref[i]);
  /* detach the userdata from the C memory */
  lua_rawgeti(cbL, LUA_REGISTRYINDEX, h->self_ref);
  mb_handle **ud = (mb_handle **)lua_touserdata(cbL, -1);
  if (ud) *ud = NULL;
  lua_pop(cbL, 1);
  luaL_unref(cbL, LUA_REGISTRYINDEX, h->self_ref);
  unlink_handle(h);
  free(h);
  if (close_ref != LUA_NOREF && close_ref != LUA_REFNIL) {
    lua_rawgeti(cbL, LUA_REGISTRYINDEX, close_ref);
    luaL_unref(cbL, LUA_REGISTRYINDEX, close_ref);
    mb_call(core, cbL, 0);
  }
}

void mb_handle_close(lua_State *L, mb_handle *h, int cb_idx) {
  if (h->closing) return;
  h->closing = 1;
  luaL_unref(L, LUA_REGISTRYINDEX, h->cb_ref[0]);
  h->cb_ref[0] = LUA_NOREF;
  if (cb_idx && lua_isfunction(L, cb_idx)) {
    lua_pushvalue(L, cb_idx);
    h->cb_ref[0] = luaL_ref(L, LUA_REGISTRYINDEX);
  }
  uv_close(&h->uv.handle, on_close);
}

static int handle_close(lua_State *L) {
  mb_handle **ud = (mb_handle **)lua_touserdata(L, 1);
  if (!ud) return luaL_argerror(L, 1, "expected a moonbox handle");
  handle_any(L, 1);
  if (*ud && !(*ud)->closing) mb_handle_close(L, *ud, lua_isfunction(L, 2) ? 2 : 0);
  return 0;
}

static int handle_is_closing(lua_State *L) {
  mb_handle *h = handle_any(L, 1);
  lua_pushboolean(L, h == NULL || h->closing);
  return 1;
}

static int handle_is_active(lua_State *L) {
  mb_handle *h = handle_any(L, 1);
  lua_pushboolean(L, h && !h->closing && uv_is_active(&h->uv.handle));
  return 1;
}

static int handle_ref(lua_State *L) {
  mb_handle *h = handle_any(L, 1);
  if (h && !h->closing) uv_ref(&h->uv.handle);
  return 0;
}

static int handle_unref(lua_State *L) {
  mb_handle *h = handle_any(L, 1);
  if (h && !h->closing) uv_unref(&h->uv.handle);
  return 0;
}

static int handle_fileno(lua_State *L) {
  mb_handle *h = handle_any(L, 1);
  uv_os_fd_t fd;
  if (!h || h->closing) return mb_push_error(L, UV_EBADF, NULL);
  int rc = uv_fileno(&h->uv.handle, &fd);
  if (rc < 0) return mb_push_error(L, rc, NULL);
  lua_pushinteger(L, fd);
  return 1;
}

static int handle_tostring(lua_State *L) {
  mb_handle **ud = (mb_handle **)lua_touserdata(L, 1);
  lua_getfield(L, lua_upvalueindex(1), "__name");
  lua_pushfstring(L, "%s: %p%s", lua_tostring(L, -1), (void *)ud, (ud && *ud) ? "" : " (closed)");
  return 1;
}

void mb_new_class(lua_State *L, const char *type_name, const luaL_Reg *methods) {
  static const luaL_Reg common[] = {{"close", handle_close},
                                    {"is_closing", handle_is_closing},
                                    {"is_active", handle_is_active},
                                    {"ref", handle_ref},
                                    {"unref", handle_unref},
                                    {"fileno", handle_fileno},
                                    {NULL, NULL}};
  luaL_newmetatable(L, type_name);
  lua_pushstring(L, type_name);
  lua_setfield(L, -2, "__name");
  lua_pushboolean(L, 1);
  lua_setfield(L, -2, "__moonbox_handle");
  lua_newtable(L);
  luaL_register(L, NULL, common);
  if (methods) luaL_register(L, NULL, methods);
  lua_setfield(L, -2, "__index");
  lua_pushvalue(L, -1);
  lua_pushcclosure(L, handle_tostring, 1);
  lua_setfield(L, -2, "__tostring");
  lua_pop(L, 1);
}

/* ---- loop --------------------------------------------------------------- */

static int core_run(lua_State *L) {
  static const char *const modes[] = {"default", "once", "nowait", NULL};
  static const uv_run_mode values[] = {UV_RUN_DEFAULT, UV_RUN_ONCE, UV_RUN_NOWAIT};
  mb_core *core = mb_core_get(L);
  int mode = luaL_checkoption(L, 1, "default", modes);
  int alive = uv_run(core->loop, values[mode]);
  lua_pushboolean(L, alive);
  return 1;
}

/* For a host with a loop of its own (docs/embedding.md): the fd that becomes
 * readable when the runtime's loop has work, and the ms until its next timer
 * (-1: none), the two things to wait on between two run("nowait"). */
static int core_backend_fd(lua_State *L) {
  lua_pushinteger(L, uv_backend_fd(mb_core_get(L)->loop));
  return 1;
}

static int core_backend_timeout(lua_State *L) {
  lua_pushinteger(L, uv_backend_timeout(mb_core_get(L)->loop));
  return 1;
}

static int core_stop(lua_State *L) {
  uv_stop(mb_core_get(L)->loop);
  return 0;
}

static int core_loop_alive(lua_State *L) {
  lua_pushboolean(L, uv_loop_alive(mb_core_get(L)->loop));
  return 1;
}

static int core_now(lua_State *L) {
  lua_pushnumber(L, (lua_Number)uv_now(mb_core_get(L)->loop));
  return 1;
}

static int core_hrtime(lua_State *L) {
  lua_pushnumber(L, (lua_Number)uv_hrtime());
  return 1;
}

static int core_update_time(lua_State *L) {
  uv_update_time(mb_core_get(L)->loop);
  return 0;
}

/* core.open_handles() -> count, {type name, ...}: every handle not yet
 * released, then the type names of those not closing (what is live) */
static int core_open_handles(lua_State *L) {
  mb_core *core = mb_core_get(L);
  lua_pushinteger(L, core->open_handles);
  lua_newtable(L);
  int i = 0;
  for (mb_handle *h = core->handles; h; h = h->next) {
    if (h->closing) continue;
    lua_pushstring(L, h->type_name);
    lua_rawseti(L, -2, ++i);
  }
  return 2;
}

static int core_set_error_handler(lua_State *L) {
  mb_core *core = mb_core_get(L);
  luaL_unref(L, LUA_REGISTRYINDEX, core->error_handler_ref);
  core->error_handler_ref = LUA_NOREF;
  if (!lua_isnoneornil(L, 1)) {
    luaL_checktype(L, 1, LUA_TFUNCTION);
    lua_pushvalue(L, 1);
    core->error_handler_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  }
  return 0;
}

static int core_versions(lua_State *L) {
  lua_newtable(L);
  lua_pushstring(L, uv_version_string());
  lua_setfield(L, -2, "libuv");
  return 1;
}

/* The Lua state is closing: close our handles without calling into Lua and
 * let the loop (ours or the host's) run their close callbacks. */
static int core_gc(lua_State *L) {
  mb_core *core = *(mb_core **)lua_touserdata(L, 1);
  core->dead = 1;
  if (!core->loop) { /* uv_loop_init failed in mb_core_open */
    free(core);
    return 0;
  }
  if (core->teardown) core->teardown(core);
  for (mb_handle *h = core->handles; h; h = h->next)
    if (!uv_is_closing(&h->uv.handle)) uv_close(&h->uv.handle, on_close);
  while (core->handles) uv_run(core->loop, UV_RUN_NOWAIT);
  uv_run(core->loop, UV_RUN_NOWAIT); /* the SIGCHLD watcher's close callback */
  /* Requests still on the thread pool (a file call, a /proc scan) call
   * back with this struct: it must outlive them (their callbacks see dead
   * and touch no Lua). A host's loop is not ours to run to its end, but
   * every request ends: run it until none is left. */
  while (!core->own_loop && core->loop->active_reqs.count > 0) uv_run(core->loop, UV_RUN_ONCE);
  if (core->own_loop) {
    uv_run(core->loop, UV_RUN_DEFAULT);
    uv_loop_close(core->loop);
    free(core->loop);
  }
  free(core->read_buf);
  free(core);
  return 0;
}

static const luaL_Reg loop_funcs[] = {{"run", core_run},
                                      {"stop", core_stop},
                                      {"loop_alive", core_loop_alive},
                                      {"backend_fd", core_backend_fd},
                                      {"backend_timeout", core_backend_timeout},
                                      {"now", core_now},
                                      {"hrtime", core_hrtime},
                                      {"update_time", core_update_time},
                                      {"open_handles", core_open_handles},
                                      {"set_error_handler", core_set_error_handler},
                                      {"versions", core_versions},
                                      {NULL, NULL}};

void mb_open_loop(lua_State *L) { luaL_register(L, NULL, loop_funcs); }

/* The directory of the shared object this code is linked into
 * (libmoonbox.so or moonbox/core.so), resolved through dladdr: what the
 * runtime finds its installed files from. 0 when it cannot be told. */
int mb_self_dir(char *out, size_t size) {
  Dl_info info;
  if (!dladdr((void *)&mb_self_dir, &info) || !info.dli_fname || !info.dli_fname[0]) return 0;
  char *real = realpath(info.dli_fname, NULL);
  if (!real) return 0;
  char *slash = strrchr(real, '/');
  if (slash) *slash = 0;
  int ok = slash && real[0] && strlen(real) < size;
  if (ok) memcpy(out, real, strlen(real) + 1);
  free(real);
  return ok;
}

mb_core *mb_core_open(lua_State *L, void (*teardown)(mb_core *core)) {
  lua_getfield(L, LUA_REGISTRYINDEX, CORE_KEY);
  mb_core **found = (mb_core **)lua_touserdata(L, -1);
  lua_pop(L, 1);
  if (found && *found) return *found;
  mb_core **ud = (mb_core **)lua_newuserdata(L, sizeof(mb_core *));
  mb_core *core = *ud = (mb_core *)calloc(1, sizeof(mb_core));
  if (!core) {
    luaL_error(L, "out of memory");
    return NULL;
  }
  core->error_handler_ref = LUA_NOREF;
  core->teardown = teardown;
  lua_newtable(L);
  lua_pushcfunction(L, core_gc);
  lua_setfield(L, -2, "__gc");
  lua_setmetatable(L, -2);
  lua_setfield(L, LUA_REGISTRYINDEX, CORE_KEY);

  lua_getfield(L, LUA_REGISTRYINDEX, LOOP_KEY);
  core->loop = (uv_loop_t *)lua_touserdata(L, -1);
  lua_pop(L, 1);
  if (!core->loop) {
    core->loop = (uv_loop_t *)malloc(sizeof(uv_loop_t));
    if (!core->loop || uv_loop_init(core->loop) != 0) {
      free(core->loop);
      core->loop = NULL; /* core_gc frees the core alone */
      luaL_error(L, "cannot create a uv loop");
      return NULL;
    }
    core->own_loop = 1;
  }
  core->cbL = lua_newthread(L);
  core->cbL_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  /* A write to a pipe whose reader has gone (a child that exited) must
   * fail with EPIPE, not kill the runtime. Children get SIG_DFL back. */
  struct sigaction sa;
  if (sigaction(SIGPIPE, NULL, &sa) == 0 && sa.sa_handler == SIG_DFL) signal(SIGPIPE, SIG_IGN);
  return core;
}
