/* codec: byte buffers and the conversions the file API needs at disk speed.
 *
 *   core.base64_encode(s) -> string        standard alphabet, '=' padding
 *   core.base64_decode(s) -> string | nil  nil for anything that is not base64
 *   core.utf8_valid(s)    -> true | false, position (1-based) of the first bad sequence
 *   core.text_info(s)     -> utf8_valid, has_nul, has_control, first_bad_position|nil
 *                            (the scan stops at the first invalid sequence)
 *                            (controls: bytes below 0x20 other than \b \t \n \v \f \r ESC, and DEL)
 *
 *   core.bytes([capacity]) -> bytes: a growable buffer in C memory, outside
 *   the Lua heap. A whole file passes through it without intermediate Lua
 *   strings: read into it, classify it, turn it into one string (or its
 *   base64) at the end; or decode base64 into it and write it out.
 *     bytes:size()                         -> n
 *     bytes:append(s)
 *     bytes:tostring([i[, j]])             -> string (i, j as for string.sub)
 *     bytes:base64_encode([cb])            -> string (with cb: on the thread pool, cb(nil, string))
 *     bytes:base64_decode(s)               -> true | nil (not base64; content unchanged)
 *     bytes:utf8_valid()                   -> true | false, position
 *     bytes:text_info([cb])                -> as core.text_info (with cb: on the thread pool,
 *                                          cb(nil, results...))
 *     bytes:json_length([cb])              -> n: the length of the bytes as the server's
 *                                          JSON escapes them (server/api_json.lua: `"` `\`
 *                                          \b \f \n \r \t two bytes, other controls and
 *                                          DEL six, the rest one; quotes not counted; with
 *                                          cb: on the thread pool, cb(nil, n))
 *     bytes:read(fd, max, offset, cb)      appends up to max bytes read from fd at
 *                                          offset (nil: current position): cb(nil, nread)
 *     bytes:write(fd, from, offset, cb)    writes the bytes after the first `from`:
 *                                          cb(nil, nwritten) (may be short)
 *     bytes:drop(n)                        removes the first n bytes (all if n >= size):
 *                                          the rest moves to the front (a log's window)
 *     bytes:free()                         release the memory now (also done by gc)
 *   read and write run on libuv's thread pool; they return true once queued,
 *   or nil, message, CODE, and call cb(message, nil, CODE) on failure. While
 *   one is in flight the buffer may not be changed or freed (that raises).
 *
 * Why: a fresh 100 MB allocation costs more than copying 100 MB (page
 * faults), so big buffers are mmap'd with MADV_HUGEPAGE, and each byte of a
 * file lands in Lua memory once, in the result string. */
#include "private.h"
#include "codec_pure.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

/* ---- memory ---------------------------------------------------------------- */

#define HUGE_MIN ((size_t)2 << 20) /* from here on: mmap with transparent huge pages */

typedef struct {
  char *data;
  size_t cap;
  int mapped;
} mem_block;

static int mem_alloc(mem_block *m, size_t cap) {
  if (cap == 0) cap = 1;
  if (cap >= HUGE_MIN) {
    void *p = mmap(NULL, cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return -1;
    madvise(p, cap, MADV_HUGEPAGE); /* best effort: fewer, cheaper page faults */
    m->data = (char *)p;
    m->mapped = 1;
  } else {
    m->data = (char *)malloc(cap);
    if (!m->data) return -1;
    m->mapped = 0;
  }
  m->cap = cap;
  return 0;
}

static void mem_free(mem_block *m) {
  if (!m->data) return;
  if (m->mapped) munmap(m->data, m->cap);
  else free(m->data);
  m->data = NULL;
  m->cap = 0;
}

/* Grow to at least need bytes, keeping the first used bytes. */
static int mem_grow(mem_block *m, size_t used, size_t need) {
  if (need <= m->cap) return 0;
  size_t cap = m->cap * 2 > need ? m->cap * 2 : need;
  if (m->mapped) {
    void *p = mremap(m->data, m->cap, cap, MREMAP_MAYMOVE);
    if (p == MAP_FAILED) return -1;
    madvise(p, cap, MADV_HUGEPAGE);
    m->data = (char *)p;
    m->cap = cap;
    return 0;
  }
  mem_block n;
  if (mem_alloc(&n, cap) < 0) return -1;
  if (used) memcpy(n.data, m->data, used);
  mem_free(m);
  *m = n;
  return 0;
}

/* ---- base64 (src/codec_pure.c) --------------------------------------------- */

static int push_base64(lua_State *L, const unsigned char *in, size_t len) {
  if (len > ((size_t)-1 / 4) * 3 - 3) return luaL_error(L, "base64_encode: input too large");
  size_t out_len = mb_b64_encoded_len(len);
  mem_block m;
  if (mem_alloc(&m, out_len) < 0) return luaL_error(L, "base64_encode: out of memory");
  mb_b64_encode(in, len, m.data);
  lua_pushlstring(L, m.data, out_len);
  mem_free(&m);
  return 1;
}

static int base64_encode(lua_State *L) {
  size_t len;
  const char *in = luaL_checklstring(L, 1, &len);
  return push_base64(L, (const unsigned char *)in, len);
}

static int base64_decode(lua_State *L) {
  size_t len;
  const unsigned char *in = (const unsigned char *)luaL_checklstring(L, 1, &len);
  long long out_len = mb_b64_decoded_len(in, len);
  if (out_len < 0) {
    lua_pushnil(L);
    return 1;
  }
  mem_block m;
  if (mem_alloc(&m, (size_t)out_len) < 0) return luaL_error(L, "base64_decode: out of memory");
  if (mb_b64_decode(in, len, (unsigned char *)m.data) < 0) lua_pushnil(L);
  else lua_pushlstring(L, m.data, (size_t)out_len);
  mem_free(&m);
  return 1;
}

/* ---- UTF-8 and text (src/codec_pure.c) ------------------------------------- */

static int push_text_info_result(lua_State *L, int nul, int control, size_t bad) {
  lua_pushboolean(L, bad == 0);
  lua_pushboolean(L, nul);
  lua_pushboolean(L, control);
  if (bad) lua_pushinteger(L, (lua_Integer)bad);
  else lua_pushnil(L);
  return 4;
}

static int push_text_info(lua_State *L, const unsigned char *s, size_t len) {
  int nul, control;
  size_t bad;
  mb_text_info_scan(s, len, &nul, &control, &bad);
  return push_text_info_result(L, nul, control, bad);
}

static int push_utf8_valid(lua_State *L, const unsigned char *s, size_t len) {
  size_t bad = mb_utf8_first_bad(s, len);
  if (bad) {
    lua_pushboolean(L, 0);
    lua_pushinteger(L, (lua_Integer)bad);
    return 2;
  }
  lua_pushboolean(L, 1);
  return 1;
}

static int utf8_valid(lua_State *L) {
  size_t len;
  const char *s = luaL_checklstring(L, 1, &len);
  return push_utf8_valid(L, (const unsigned char *)s, len);
}

static int text_info(lua_State *L) {
  size_t len;
  const char *s = luaL_checklstring(L, 1, &len);
  return push_text_info(L, (const unsigned char *)s, len);
}

/* ---- bytes ------------------------------------------------------------------ */

#define BYTES "moonbox.bytes"

/* The userdata at idx if it is a bytes buffer (luaL_testudata is Lua 5.2). */
static void *bytes_test(lua_State *L, int idx) {
  void *p = lua_touserdata(L, idx);
  if (!p || !lua_getmetatable(L, idx)) return NULL;
  luaL_getmetatable(L, BYTES);
  int same = lua_rawequal(L, -1, -2);
  lua_pop(L, 2);
  return same ? p : NULL;
}

typedef struct {
  mem_block mem;
  size_t len;
  int busy;   /* a read or write on the thread pool uses mem */
  int orphan; /* collected while busy (the state is closing): the request frees it */
} mb_bytes;

/* For other families (magic.c): the content of a bytes buffer at idx, or 0
 * if the value there is not one. */
int mb_bytes_view(lua_State *L, int idx, const char **data, size_t *len) {
  mb_bytes **ud = (mb_bytes **)bytes_test(L, idx);
  if (!ud || !*ud || (*ud)->busy) return 0;
  *data = (*ud)->mem.data;
  *len = (*ud)->len;
  return 1;
}

static mb_bytes *bytes_check(lua_State *L, int idx) {
  mb_bytes **ud = (mb_bytes **)luaL_checkudata(L, idx, BYTES);
  if (!*ud) luaL_error(L, "bytes buffer is freed");
  return *ud;
}

static mb_bytes *bytes_check_idle(lua_State *L, int idx) {
  mb_bytes *b = bytes_check(L, idx);
  if (b->busy) luaL_error(L, "bytes buffer is in use by a read or write");
  return b;
}

static void bytes_destroy(mb_bytes *b) {
  mem_free(&b->mem);
  free(b);
}

/* core.bytes([capacity]) */
static int bytes_new(lua_State *L) {
  lua_Number cap = luaL_optnumber(L, 1, 0);
  if (cap < 0 || cap > 1e15) return luaL_argerror(L, 1, "capacity must be >= 0");
  mb_bytes **ud = (mb_bytes **)lua_newuserdata(L, sizeof(mb_bytes *));
  *ud = NULL;
  luaL_getmetatable(L, BYTES);
  lua_setmetatable(L, -2);
  mb_bytes *b = (mb_bytes *)calloc(1, sizeof(mb_bytes));
  if (!b || mem_alloc(&b->mem, (size_t)cap) < 0) {
    free(b);
    return luaL_error(L, "bytes: out of memory (%f bytes)", (double)cap);
  }
  *ud = b;
  return 1;
}

static int bytes_gc(lua_State *L) {
  mb_bytes **ud = (mb_bytes **)lua_touserdata(L, 1);
  if (ud && *ud) {
    if ((*ud)->busy) (*ud)->orphan = 1;
    else bytes_destroy(*ud);
    *ud = NULL;
  }
  return 0;
}

static int bytes_free(lua_State *L) {
  mb_bytes **ud = (mb_bytes **)luaL_checkudata(L, 1, BYTES);
  if (*ud && (*ud)->busy) return luaL_error(L, "bytes buffer is in use by a read or write");
  return bytes_gc(L);
}

static int bytes_size(lua_State *L) {
  lua_pushnumber(L, (lua_Number)bytes_check(L, 1)->len);
  return 1;
}

static int bytes_append(lua_State *L) {
  mb_bytes *b = bytes_check_idle(L, 1);
  size_t len;
  const char *s = luaL_checklstring(L, 2, &len);
  if (mem_grow(&b->mem, b->len, b->len + len) < 0) return luaL_error(L, "bytes: out of memory");
  memcpy(b->mem.data + b->len, s, len);
  b->len += len;
  return 0;
}

static int bytes_drop(lua_State *L) {
  mb_bytes *b = bytes_check_idle(L, 1);
  lua_Number n = luaL_checknumber(L, 2);
  if (n != n || n < 0) return luaL_argerror(L, 2, "must be >= 0");
  size_t k = n >= (lua_Number)b->len ? b->len : (size_t)n;
  if (k < b->len) memmove(b->mem.data, b->mem.data + k, b->len - k);
  b->len -= k;
  return 0;
}

static int bytes_tostring(lua_State *L) {
  mb_bytes *b = bytes_check_idle(L, 1);
  lua_Number len = (lua_Number)b->len;
  lua_Number i = luaL_optnumber(L, 2, 1), j = luaL_optnumber(L, 3, -1);
  if (i < 0) i = len + i + 1;
  if (j < 0) j = len + j + 1;
  if (i < 1) i = 1;
  if (j > len) j = len;
  if (i > j) lua_pushliteral(L, "");
  else lua_pushlstring(L, b->mem.data + (size_t)i - 1, (size_t)(j - i + 1));
  return 1;
}

/* bytes:base64_encode([cb]) and bytes:text_info([cb]): with cb, the work
 * runs on the thread pool (the buffer is busy meanwhile) and cb gets
 * (nil, results...), or (message, nil, CODE); the call returns true once
 * queued. A 100 MB file then costs the loop one copy into a Lua string
 * instead of a scan and an encode on top. */
enum { WORK_BASE64, WORK_TEXT_INFO, WORK_JSON_LENGTH };

static const char *work_name(int op) {
  return op == WORK_BASE64 ? "base64_encode" : op == WORK_TEXT_INFO ? "text_info" : "json_length";
}

/* The escaped length of s (api_json.lua's ESC_LEN, byte for byte); the
 * table is filled when the module opens, before any thread reads it. */
static unsigned char json_len_of[256];

static void json_len_init(void) {
  for (int b = 0; b < 256; b++) {
    if (b == '"' || b == '\\' || b == '\b' || b == '\f' || b == '\n' || b == '\r' || b == '\t') json_len_of[b] = 2;
    else if (b < 0x20 || b == 0x7f) json_len_of[b] = 6;
    else json_len_of[b] = 1;
  }
}

static size_t json_escaped_length(const unsigned char *s, size_t n) {
  size_t total = 0;
  for (size_t i = 0; i < n; i++) total += json_len_of[s[i]];
  return total;
}

typedef struct {
  uv_work_t work;
  mb_core *core;
  mb_bytes *b;
  int cb_ref, self_ref, op, failed;
  mem_block out;
  size_t out_len, bad;
  int nul, control;
} bytes_work;

static void bytes_work_run(uv_work_t *w) {
  bytes_work *bw = (bytes_work *)w->data;
  const unsigned char *in = (const unsigned char *)bw->b->mem.data;
  size_t len = bw->b->len;
  if (bw->op == WORK_TEXT_INFO) {
    mb_text_info_scan(in, len, &bw->nul, &bw->control, &bw->bad);
    return;
  }
  if (bw->op == WORK_JSON_LENGTH) {
    bw->out_len = json_escaped_length(in, len);
    return;
  }
  bw->out_len = mb_b64_encoded_len(len);
  if (mem_alloc(&bw->out, bw->out_len) < 0) {
    bw->failed = 1;
    return;
  }
  mb_b64_encode(in, len, bw->out.data);
}

static void bytes_work_done(uv_work_t *w, int status) {
  bytes_work *bw = (bytes_work *)w->data;
  mb_bytes *b = bw->b;
  mb_core *core = bw->core;
  b->busy = 0;
  if (b->orphan) bytes_destroy(b);
  if (core->dead) {
    mem_free(&bw->out);
    free(bw);
    return;
  }
  lua_State *cbL = core->cbL;
  lua_rawgeti(cbL, LUA_REGISTRYINDEX, bw->cb_ref);
  luaL_unref(cbL, LUA_REGISTRYINDEX, bw->cb_ref);
  luaL_unref(cbL, LUA_REGISTRYINDEX, bw->self_ref);
  int nargs;
  if (status < 0 || bw->failed) {
    int err = status < 0 ? status : UV_ENOMEM;
    lua_pushfstring(cbL, "%s: %s (%s)", uv_err_name(err), uv_strerror(err), work_name(bw->op));
    lua_pushnil(cbL);
    lua_pushstring(cbL, uv_err_name(err));
    nargs = 3;
  } else if (bw->op == WORK_BASE64) {
    lua_pushnil(cbL);
    lua_pushlstring(cbL, bw->out.data, bw->out_len);
    nargs = 2;
  } else if (bw->op == WORK_JSON_LENGTH) {
    lua_pushnil(cbL);
    lua_pushnumber(cbL, (lua_Number)bw->out_len);
    nargs = 2;
  } else {
    lua_pushnil(cbL);
    nargs = 1 + push_text_info_result(cbL, bw->nul, bw->control, bw->bad);
  }
  mem_free(&bw->out);
  free(bw);
  mb_call(core, cbL, nargs);
}

static int bytes_work_submit(lua_State *L, mb_bytes *b, int op) {
  luaL_checktype(L, 2, LUA_TFUNCTION);
  if (op == WORK_BASE64 && b->len > ((size_t)-1 / 4) * 3 - 3) return luaL_error(L, "base64_encode: input too large");
  bytes_work *bw = (bytes_work *)calloc(1, sizeof(bytes_work));
  if (!bw) return luaL_error(L, "out of memory");
  bw->core = mb_core_get(L);
  bw->b = b;
  bw->op = op;
  bw->work.data = bw;
  lua_pushvalue(L, 2);
  bw->cb_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  lua_pushvalue(L, 1); /* the buffer stays alive while the thread pool uses it */
  bw->self_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  int rc = uv_queue_work(bw->core->loop, &bw->work, bytes_work_run, bytes_work_done);
  if (rc < 0) {
    luaL_unref(L, LUA_REGISTRYINDEX, bw->cb_ref);
    luaL_unref(L, LUA_REGISTRYINDEX, bw->self_ref);
    free(bw);
    return mb_push_error(L, rc, work_name(op));
  }
  b->busy = 1;
  lua_pushboolean(L, 1);
  return 1;
}

static int bytes_base64_encode(lua_State *L) {
  mb_bytes *b = bytes_check_idle(L, 1);
  if (!lua_isnoneornil(L, 2)) return bytes_work_submit(L, b, WORK_BASE64);
  return push_base64(L, (const unsigned char *)b->mem.data, b->len);
}

static int bytes_base64_decode(lua_State *L) {
  mb_bytes *b = bytes_check_idle(L, 1);
  size_t len;
  const unsigned char *in = (const unsigned char *)luaL_checklstring(L, 2, &len);
  long long out_len = mb_b64_decoded_len(in, len);
  if (out_len < 0) {
    lua_pushnil(L);
    return 1;
  }
  mem_block m;
  if (mem_alloc(&m, (size_t)out_len) < 0) return luaL_error(L, "bytes: out of memory");
  if (mb_b64_decode(in, len, (unsigned char *)m.data) < 0) {
    mem_free(&m);
    lua_pushnil(L);
    return 1;
  }
  mem_free(&b->mem);
  b->mem = m;
  b->len = (size_t)out_len;
  lua_pushboolean(L, 1);
  return 1;
}

static int bytes_utf8_valid(lua_State *L) {
  mb_bytes *b = bytes_check_idle(L, 1);
  return push_utf8_valid(L, (const unsigned char *)b->mem.data, b->len);
}

static int bytes_text_info(lua_State *L) {
  mb_bytes *b = bytes_check_idle(L, 1);
  if (!lua_isnoneornil(L, 2)) return bytes_work_submit(L, b, WORK_TEXT_INFO);
  return push_text_info(L, (const unsigned char *)b->mem.data, b->len);
}

static int bytes_json_length(lua_State *L) {
  mb_bytes *b = bytes_check_idle(L, 1);
  if (!lua_isnoneornil(L, 2)) return bytes_work_submit(L, b, WORK_JSON_LENGTH);
  lua_pushnumber(L, (lua_Number)json_escaped_length((const unsigned char *)b->mem.data, b->len));
  return 1;
}

/* ---- bytes: reads and writes on the thread pool ---------------------------- */

typedef struct {
  uv_fs_t req;
  mb_core *core;
  mb_bytes *b;
  int cb_ref, self_ref, is_read, fd;
} bytes_req;

static void on_bytes_fs(uv_fs_t *req) {
  bytes_req *br = (bytes_req *)req->data;
  mb_bytes *b = br->b;
  mb_core *core = br->core;
  ssize_t result = req->result;
  uv_fs_req_cleanup(req);
  b->busy = 0;
  if (br->is_read && result > 0) b->len += (size_t)result;
  if (b->orphan) bytes_destroy(b);
  if (core->dead) {
    free(br);
    return;
  }
  lua_State *cbL = core->cbL;
  lua_rawgeti(cbL, LUA_REGISTRYINDEX, br->cb_ref);
  luaL_unref(cbL, LUA_REGISTRYINDEX, br->cb_ref);
  luaL_unref(cbL, LUA_REGISTRYINDEX, br->self_ref);
  int nargs;
  if (result < 0) {
    lua_pushfstring(cbL, "%s: %s (%s fd %d)", uv_err_name((int)result), uv_strerror((int)result),
                    br->is_read ? "read" : "write", br->fd);
    lua_pushnil(cbL);
    lua_pushstring(cbL, uv_err_name((int)result));
    nargs = 3;
  } else {
    lua_pushnil(cbL);
    lua_pushnumber(cbL, (lua_Number)result);
    nargs = 2;
  }
  free(br);
  mb_call(core, cbL, nargs);
}

static int bytes_submit(lua_State *L, mb_bytes *b, int is_read, int fd, char *base, size_t len, int64_t offset,
                        int cb_idx) {
  luaL_checktype(L, cb_idx, LUA_TFUNCTION);
  if (len > 0x7ffff000) len = 0x7ffff000; /* what one read/write moves at most */
  bytes_req *br = (bytes_req *)calloc(1, sizeof(bytes_req));
  if (!br) return luaL_error(L, "out of memory");
  br->core = mb_core_get(L);
  br->b = b;
  br->is_read = is_read;
  br->fd = fd;
  br->req.data = br;
  lua_pushvalue(L, cb_idx);
  br->cb_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  lua_pushvalue(L, 1); /* the buffer stays alive while the thread pool uses it */
  br->self_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  uv_buf_t buf = uv_buf_init(base, (unsigned int)len);
  int rc = is_read ? uv_fs_read(br->core->loop, &br->req, fd, &buf, 1, offset, on_bytes_fs)
                   : uv_fs_write(br->core->loop, &br->req, fd, &buf, 1, offset, on_bytes_fs);
  if (rc < 0) {
    luaL_unref(L, LUA_REGISTRYINDEX, br->cb_ref);
    luaL_unref(L, LUA_REGISTRYINDEX, br->self_ref);
    free(br);
    return mb_push_error(L, rc, is_read ? "read" : "write");
  }
  b->busy = 1;
  lua_pushboolean(L, 1);
  return 1;
}

static int check_fd_arg(lua_State *L, int idx) {
  lua_Integer fd = luaL_checkinteger(L, idx);
  if (fd < 0 || fd > 0x7fffffff) luaL_argerror(L, idx, "fd must be >= 0");
  return (int)fd;
}

static int64_t check_offset(lua_State *L, int idx) {
  if (lua_isnoneornil(L, idx)) return -1;
  lua_Number off = luaL_checknumber(L, idx);
  if (off < 0) luaL_argerror(L, idx, "offset must be >= 0");
  return (int64_t)off;
}

/* bytes:read(fd, max, offset, cb) */
static int bytes_read(lua_State *L) {
  mb_bytes *b = bytes_check_idle(L, 1);
  int fd = check_fd_arg(L, 2);
  lua_Number max = luaL_checknumber(L, 3);
  if (max < 1 || max > 0x7ffff000) return luaL_argerror(L, 3, "max must be between 1 and 0x7ffff000");
  int64_t offset = check_offset(L, 4);
  if (mem_grow(&b->mem, b->len, b->len + (size_t)max) < 0) return luaL_error(L, "bytes: out of memory");
  return bytes_submit(L, b, 1, fd, b->mem.data + b->len, (size_t)max, offset, 5);
}

/* bytes:write(fd, from, offset, cb) */
static int bytes_write(lua_State *L) {
  mb_bytes *b = bytes_check_idle(L, 1);
  int fd = check_fd_arg(L, 2);
  lua_Number from = luaL_checknumber(L, 3);
  if (from < 0 || from > (lua_Number)b->len) return luaL_argerror(L, 3, "from must be between 0 and size");
  int64_t offset = check_offset(L, 4);
  return bytes_submit(L, b, 0, fd, b->mem.data + (size_t)from, b->len - (size_t)from, offset, 5);
}

static int bytes_tostring_meta(lua_State *L) {
  mb_bytes **ud = (mb_bytes **)lua_touserdata(L, 1);
  if (ud && *ud) lua_pushfstring(L, BYTES ": %p (%d bytes)", (void *)*ud, (int)(*ud)->len);
  else lua_pushfstring(L, BYTES ": %p (freed)", (void *)ud);
  return 1;
}

static const luaL_Reg bytes_methods[] = {{"size", bytes_size},
                                         {"append", bytes_append},
                                         {"tostring", bytes_tostring},
                                         {"base64_encode", bytes_base64_encode},
                                         {"base64_decode", bytes_base64_decode},
                                         {"utf8_valid", bytes_utf8_valid},
                                         {"text_info", bytes_text_info},
                                         {"json_length", bytes_json_length},
                                         {"read", bytes_read},
                                         {"write", bytes_write},
                                         {"free", bytes_free},
                                         {"drop", bytes_drop},
                                         {NULL, NULL}};

static const luaL_Reg codec_funcs[] = {{"base64_encode", base64_encode},
                                       {"base64_decode", base64_decode},
                                       {"utf8_valid", utf8_valid},
                                       {"text_info", text_info},
                                       {"bytes", bytes_new},
                                       {NULL, NULL}};

void mb_open_codec(lua_State *L) {
  json_len_init();
  luaL_newmetatable(L, BYTES);
  lua_newtable(L);
  luaL_register(L, NULL, bytes_methods);
  lua_setfield(L, -2, "__index");
  lua_pushcfunction(L, bytes_gc);
  lua_setfield(L, -2, "__gc");
  lua_pushcfunction(L, bytes_tostring_meta);
  lua_setfield(L, -2, "__tostring");
  lua_pop(L, 1);
  for (const luaL_Reg *f = codec_funcs; f->name; f++) {
    lua_pushcfunction(L, f->func);
    lua_setfield(L, -2, f->name);
  }
}
