/* Process-wide facts and switches: pid, ids, child subreaper. */
#include "core.h"

#include <errno.h>
#include <sys/prctl.h>
#include <unistd.h>

static int sys_getpid(lua_State *L) { lua_pushinteger(L, getpid()); return 1; }
static int sys_getuid(lua_State *L) { lua_pushinteger(L, getuid()); return 1; }
static int sys_getgid(lua_State *L) { lua_pushinteger(L, getgid()); return 1; }

/* core.set_child_subreaper(on): orphaned descendants are re-parented to us,
 * so a double-forked daemon is still ours to find, kill and reap. */
static int sys_set_child_subreaper(lua_State *L) {
  if (prctl(PR_SET_CHILD_SUBREAPER, lua_toboolean(L, 1) ? 1 : 0) < 0)
    return mb_push_errno(L, errno, "PR_SET_CHILD_SUBREAPER");
  lua_pushboolean(L, 1);
  return 1;
}

static const luaL_Reg sys_funcs[] = {
  {"getpid", sys_getpid}, {"getuid", sys_getuid}, {"getgid", sys_getgid},
  {"set_child_subreaper", sys_set_child_subreaper}, {NULL, NULL}};

void mb_open_sys(lua_State *L) {
  for (const luaL_Reg *f = sys_funcs; f->name; f++) {
    lua_pushcfunction(L, f->func);
    lua_setfield(L, -2, f->name);
  }
}
