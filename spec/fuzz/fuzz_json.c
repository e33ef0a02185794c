/* libFuzzer target: the HTTP API's JSON codec (lua/moonbox/server/api_json.lua:
 * lua-cjson decoding, strictly, and the runtime's own encoder), the first
 * thing every request body meets.
 *
 * Properties, for every input x given as a request body:
 *   - decode_object(x) returns a table or raises a VALIDATION_FAILED error
 *     table; any other error (a Lua runtime error, a string) is a bug;
 *   - for a table t: encode(t) is valid UTF-8, decode_object takes it back,
 *     and what comes back equals t (numbers to encode's 14 digits; a number
 *     JSON cannot hold is written null, which decodes to an absent field at
 *     the top and to false inside; fields named with a leading '_', private
 *     to the runtime, are left out).
 * The Lua modules are the source tree's own (MOONBOX_LUA_DIR); moonbox.core
 * is stood in for by the two functions api_json uses (and moonbox.async by
 * a task-less stand-in), from src/codec_pure.c
 * (compiled into this target, so under ASan too). lua-cjson is Debian's.
 *
 * No leak check after each input (-detect_leaks=0, cmake/fuzz.cmake):
 * LuaJIT keeps its heap in mmap'd arenas LSan does not scan, so every C
 * buffer a live Lua object owns (lua-cjson's per-instance strbufs) reads as
 * leaked. The check at exit runs after lua_close, when nothing is live. */
#include "codec_pure.h"

#include <lauxlib.h>
#include <lua.h>
#include <lualib.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static lua_State *L;

static int core_utf8_valid(lua_State *L) {
  size_t len;
  const char *s = luaL_checklstring(L, 1, &len);
  size_t bad = mb_utf8_first_bad((const unsigned char *)s, len);
  if (!bad) {
    lua_pushboolean(L, 1);
    return 1;
  }
  lua_pushboolean(L, 0);
  lua_pushinteger(L, (lua_Integer)bad);
  return 2;
}

static int core_base64_encode(lua_State *L) {
  size_t len;
  const char *s = luaL_checklstring(L, 1, &len);
  size_t n = mb_b64_encoded_len(len);
  char *out = malloc(n + 1);
  if (!out) return luaL_error(L, "out of memory");
  mb_b64_encode((const unsigned char *)s, len, out);
  lua_pushlstring(L, out, n);
  free(out);
  return 1;
}

static int open_core(lua_State *L) {
  lua_newtable(L);
  lua_pushcfunction(L, core_utf8_valid);
  lua_setfield(L, -2, "utf8_valid");
  lua_pushcfunction(L, core_base64_encode);
  lua_setfield(L, -2, "base64_encode");
  return 1;
}

/* check(body): raises a string (-> abort) when a property fails. */
static const char check_lua[] =
  "local json = require 'moonbox.server.api_json'\n"
  "local errors = require 'moonbox.errors'\n"
  "local core = require 'moonbox.core'\n"
  "local function same(a, b, path, top)\n"
  "  if type(a) == 'number' and (a ~= a or a == math.huge or a == -math.huge) then\n"
  "    if top then a = nil else a = false end -- null: a field not given, or false inside\n"
  "  end\n"
  "  if type(a) ~= type(b) then error(path .. ': ' .. type(a) .. ' came back as ' .. type(b), 0) end\n"
  "  if type(a) == 'number' then\n"
  "    if a ~= b and math.abs(a - b) > math.abs(a) * 1e-13 then\n"
  "      error(('%s: %.17g came back as %.17g'):format(path, a, b), 0)\n"
  "    end\n"
  "  elseif type(a) == 'table' then\n"
  "    for k, v in pairs(a) do\n"
  "      -- encode leaves out '_' fields (the runtime's private ones)\n"
  "      if type(k) ~= 'string' or k:sub(1, 1) ~= '_' then\n"
  "        same(v, b[k], path .. '.' .. tostring(k), path == 'body')\n"
  "      end\n"
  "    end\n"
  "    for k in pairs(b) do\n"
  "      if a[k] == nil then error(path .. '.' .. tostring(k) .. ': appeared', 0) end\n"
  "    end\n"
  "  elseif a ~= b then\n"
  "    error(path .. ': ' .. tostring(a) .. ' came back as ' .. tostring(b), 0)\n"
  "  end\n"
  "end\n"
  "return function(body)\n"
  "  local ok, t = pcall(json.decode_object, body)\n"
  "  if not ok then\n"
  "    if errors.is_error(t) and t.code == 'VALIDATION_FAILED' then return end\n"
  "    error('decode_object raised ' .. tostring(t), 0)\n"
  "  end\n"
  "  if type(t) ~= 'table' then error('decode_object returned a ' .. type(t), 0) end\n"
  "  local ok2, text = pcall(json.encode, t)\n"
  "  if not ok2 then error('encode raised ' .. tostring(text), 0) end\n"
  "  if not core.utf8_valid(text) then error('encode wrote invalid UTF-8', 0) end\n"
  "  local ok3, back = pcall(json.decode_object, text)\n"
  "  if not ok3 then error('decode_object refused encode\\'s ' .. text .. ': ' .. tostring(back), 0) end\n"
  "  local okc, why = pcall(same, t, back, 'body')\n"
  "  if not okc then\n"
  "    local again = json.encode(back)\n"
  "    error(why .. '\\nencoded: ' .. text .. '\\nre-encoded: ' .. again, 0)\n"
  "  end\n"
  "end\n";

/* At exit every Lua object goes, and with it what its C side holds: LSan's
 * check at exit then sees only what was really lost. */
static void close_lua(void) { lua_close(L); }

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  L = luaL_newstate();
  if (!L) abort();
  luaL_openlibs(L);
  lua_getglobal(L, "package");
  lua_pushstring(L, MOONBOX_LUA_DIR "/?.lua;" MOONBOX_LUA_DIR "/?/init.lua");
  lua_setfield(L, -2, "path");
  lua_getfield(L, -1, "preload");
  lua_pushcfunction(L, open_core);
  lua_setfield(L, -2, "moonbox.core");
  lua_pop(L, 2);
  /* The interpreter only: one JIT-compiled run (of several million, late in
   * a run) saw a round trip lose a field, and the same input alone never
   * did; until that is pinned down (docs/testing.md), the codec's logic is
   * fuzzed deterministically. */
  if (luaL_dostring(L, "require('jit').off()")) abort();
  /* no loop here: api_json's long encodes yield only inside a task */
  if (luaL_dostring(L, "package.preload['moonbox.async'] = function()\n"
                       "  return { in_task = function() return false end, sleep = function() end }\n"
                       "end")) {
    fprintf(stderr, "fuzz_json: %s\n", lua_tostring(L, -1));
    abort();
  }
  if (luaL_loadbuffer(L, check_lua, sizeof check_lua - 1, "=fuzz_json") || lua_pcall(L, 0, 1, 0)) {
    fprintf(stderr, "fuzz_json: %s\n", lua_tostring(L, -1));
    abort();
  }
  lua_setfield(L, LUA_REGISTRYINDEX, "fuzz_json.check");
  atexit(close_lua);
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  lua_getfield(L, LUA_REGISTRYINDEX, "fuzz_json.check");
  lua_pushlstring(L, (const char *)data, size);
  if (lua_pcall(L, 1, 0, 0)) {
    fprintf(stderr, "fuzz_json: %s\n", lua_tostring(L, -1));
    abort();
  }
  /* a full collection now and then keeps the heap flat across runs */
  static unsigned runs;
  if (++runs % 1024 == 0) lua_gc(L, LUA_GCCOLLECT, 0);
  return 0;
}
