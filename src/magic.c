/* magic: content type detection through libmagic.
 *
 *   core.magic_buffer(data[, max_bytes]) -> mime_type, mime_encoding
 *       data: a string or a core.bytes buffer
 *       e.g. "application/json", "utf-8"; "image/png", "binary";
 *       "text/plain", "us-ascii". At most max_bytes of data are examined
 *       (default: libmagic's own limit). Failure: nil, message, "EMAGIC".
 *
 * The cookie (with the compiled magic database loaded) is opened once per
 * Lua state, lazily on first use, and closed when the state closes. A cookie
 * is not thread safe; it is only used from the state's own thread. */
#include "private.h"

#include <magic.h>
#include <string.h>

#define MAGIC_KEY "moonbox.magic.cookie"

typedef struct {
  magic_t cookie;
  int load_failed;
} magic_state;

static int magic_state_gc(lua_State *L) {
  magic_state *ms = (magic_state *)lua_touserdata(L, 1);
  if (ms && ms->cookie) {
    magic_close(ms->cookie);
    ms->cookie = NULL;
  }
  return 0;
}

static magic_state *magic_get(lua_State *L) {
  lua_getfield(L, LUA_REGISTRYINDEX, MAGIC_KEY);
  magic_state *ms = (magic_state *)lua_touserdata(L, -1);
  lua_pop(L, 1);
  if (ms) return ms;
  ms = (magic_state *)lua_newuserdata(L, sizeof(magic_state));
  memset(ms, 0, sizeof(*ms));
  lua_newtable(L);
  lua_pushcfunction(L, magic_state_gc);
  lua_setfield(L, -2, "__gc");
  lua_setmetatable(L, -2);
  lua_setfield(L, LUA_REGISTRYINDEX, MAGIC_KEY);
  ms->cookie = magic_open(MAGIC_MIME_TYPE | MAGIC_MIME_ENCODING);
  if (ms->cookie && magic_load(ms->cookie, NULL) != 0) ms->load_failed = 1;
  return ms;
}

static int push_magic_error(lua_State *L, magic_state *ms, const char *what) {
  const char *msg = ms->cookie ? magic_error(ms->cookie) : NULL;
  lua_pushnil(L);
  lua_pushfstring(L, "EMAGIC: %s (%s)", msg ? msg : "libmagic is unavailable", what);
  lua_pushliteral(L, "EMAGIC");
  return 3;
}

static int magic_buffer_l(lua_State *L) {
  size_t len;
  const char *data;
  if (!mb_bytes_view(L, 1, &data, &len)) data = luaL_checklstring(L, 1, &len);
  if (!lua_isnoneornil(L, 2)) {
    lua_Number max = luaL_checknumber(L, 2);
    if (max < 0) return luaL_argerror(L, 2, "max_bytes must be >= 0");
    if ((lua_Number)len > max) len = (size_t)max;
  }
  magic_state *ms = magic_get(L);
  if (!ms->cookie || ms->load_failed) return push_magic_error(L, ms, "loading the magic database");
  const char *r = magic_buffer(ms->cookie, data, len);
  if (!r) return push_magic_error(L, ms, "magic_buffer");
  /* "type/subtype; charset=encoding" */
  const char *semi = strchr(r, ';');
  if (!semi) {
    lua_pushstring(L, r);
    lua_pushnil(L);
    return 2;
  }
  lua_pushlstring(L, r, (size_t)(semi - r));
  const char *cs = strstr(semi, "charset=");
  if (cs) lua_pushstring(L, cs + 8);
  else lua_pushnil(L);
  return 2;
}

void mb_open_magic(lua_State *L) {
  lua_pushcfunction(L, magic_buffer_l);
  lua_setfield(L, -2, "magic_buffer");
}
