/* HTTP/1.1, Server-Sent Events and WebSocket server on the runtime's own uv
 * loop: the Lua API. Mechanism only: requests go to one Lua callback as
 * events, responses come back as queued writes; what a path means is Lua's
 * business (lua/moonbox/server/http.lua). The connections are conn.c's.
 *
 *   core.http_listen(opts, on_event(kind, id, ...)) -> server | nil, msg, CODE
 *     opts: host, port | unix (path), max_body, max_connections, idle_timeout_ms
 *   events: "request", id, req, body   (req.too_large, req.length_required:
 *                                       the body was not read; req.raw_line:
 *                                       the request line as sent)
 *           "message", id, data, is_binary   (a whole WebSocket message)
 *           "drain", id                      (every queued byte was written)
 *           "done", id                       (the response is complete)
 *           "closed", id                     (the client is gone)
 *           "refused", status                (a head answered 400 or 431 here)
 *
 * Each request gets a new id (a keep-alive connection carries several);
 * methods given an id that is no longer current return nil, "closed".
 * A server is one handle for core.open_handles(); close() drops every
 * connection and the handle closes once their sockets have. */
#include "http/http.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static mbh_server *live_servers; /* for teardown */

/* ---- events -------------------------------------------------------------------- */

static lua_State *event_begin(mbh_server *s, const char *kind, lua_Integer id) {
  if (s->h->core->dead) return NULL;
  lua_State *cbL = mb_handle_push_cb(s->h, MBH_CB_EVENT);
  if (!cbL) return NULL;
  lua_pushstring(cbL, kind);
  lua_pushinteger(cbL, id);
  return cbL;
}

void mbh_emit(mbh_server *s, const char *kind, lua_Integer id) {
  lua_State *cbL = event_begin(s, kind, id);
  if (cbL) mb_call(s->h->core, cbL, 2);
}

void mbh_emit_message(mbh_conn *c, const uint8_t *data, size_t len, int binary) {
  lua_State *cbL = event_begin(c->srv, "message", c->id);
  if (!cbL) return;
  lua_pushlstring(cbL, (const char *)data, len);
  lua_pushboolean(cbL, binary);
  mb_call(c->srv->h->core, cbL, 4);
}

static void push_lower(lua_State *L, const char *s, size_t len) {
  luaL_Buffer b;
  luaL_buffinit(L, &b);
  for (size_t i = 0; i < len; i++) luaL_addchar(&b, (char)(s[i] >= 'A' && s[i] <= 'Z' ? s[i] + 32 : s[i]));
  luaL_pushresult(&b);
}

/* {name = value}, names lowercase; a repeated header's values joined as
 * RFC 9110 5.3 allows (cookies with "; ", RFC 6265 5.4) */
static void push_headers(lua_State *L, const mbh_head *h) {
  lua_createtable(L, 0, (int)h->nfields);
  for (size_t i = 0; i < h->nfields; i++) {
    const mbh_field *f = &h->fields[i];
    push_lower(L, f->name, f->name_len);
    lua_pushvalue(L, -1);
    lua_rawget(L, -3);
    if (lua_isnil(L, -1)) {
      lua_pop(L, 1);
      lua_pushlstring(L, f->value, f->value_len);
    } else {
      int cookie = f->name_len == 6 && strcmp(lua_tostring(L, -2), "cookie") == 0;
      lua_pushstring(L, cookie ? "; " : ", ");
      lua_pushlstring(L, f->value, f->value_len);
      lua_concat(L, 3);
    }
    lua_rawset(L, -3);
  }
}

/* {method, path, args = {fragments}, headers, websocket, peer, raw_line} */
static void push_request(lua_State *L, mbh_conn *c) {
  const mbh_head *h = &c->parser.head;
  lua_createtable(L, 0, 9);
  lua_pushlstring(L, h->method, h->method_len);
  lua_setfield(L, -2, "method");
  char *scratch = malloc(h->target_len + 2);
  if (scratch) {
    lua_pushlstring(L, scratch, mbh_decode_path(h->target, h->target_len, scratch));
    lua_setfield(L, -2, "path");
    lua_newtable(L);
    size_t pos = 0;
    long n;
    for (int i = 1; (n = mbh_next_arg(h->target, h->target_len, &pos, scratch)) >= 0; i++) {
      lua_pushlstring(L, scratch, (size_t)n);
      lua_rawseti(L, -2, i);
    }
    lua_setfield(L, -2, "args");
    free(scratch);
  }
  push_headers(L, h);
  lua_setfield(L, -2, "headers");
  lua_pushboolean(L, c->is_ws);
  lua_setfield(L, -2, "websocket");
  lua_pushstring(L, c->peer);
  lua_setfield(L, -2, "peer");
  lua_pushlstring(L, h->line, h->line_len);
  lua_setfield(L, -2, "raw_line");
  if (c->over) {
    lua_pushboolean(L, 1);
    lua_setfield(L, -2, "over_limit");
  }
  if (c->too_large) {
    lua_pushboolean(L, 1);
    lua_setfield(L, -2, c->too_large == 2 ? "length_required" : "too_large");
  }
}

void mbh_emit_request(mbh_conn *c) {
  lua_State *cbL = event_begin(c->srv, "request", c->id);
  if (!cbL) return;
  push_request(cbL, c);
  if (c->too_large) lua_pushnil(cbL);
  else lua_pushlstring(cbL, c->body ? c->body : "", c->body_len);
  free(c->body);
  c->body = NULL;
  c->body_len = 0;
  mb_call(c->srv->h->core, cbL, 4);
}

/* ---- the server's lifetime ------------------------------------------------------ */

static void unlink_server(mbh_server *s) {
  for (mbh_server **p = &live_servers; *p; p = &(*p)->next_server)
    if (*p == s) {
      *p = s->next_server;
      break;
    }
}

void mbh_server_closed(mbh_server *s) {
  mb_handle *h = s->h;
  mb_core *core = h->core;
  unlink_server(s);
  if (h->closing || core->dead) return;
  /* mb_handle_close takes the close callback from a stack slot */
  lua_State *cbL = core->cbL;
  int top = lua_gettop(cbL);
  if (h->cb_ref[MBH_CB_CLOSE] != LUA_NOREF) lua_rawgeti(cbL, LUA_REGISTRYINDEX, h->cb_ref[MBH_CB_CLOSE]);
  mb_handle_close(cbL, h, lua_gettop(cbL) > top ? lua_gettop(cbL) : 0);
  lua_settop(cbL, top);
}

/* From core teardown, the Lua state closing: every socket closed before
 * the core closes the servers' handles. */
void mb_http_teardown(mb_core *core) {
  for (mbh_server *s = live_servers, *next; s; s = next) {
    next = s->next_server;
    if (s->h->core != core) continue;
    mbh_server_stop(s);
    for (int i = 0; s->aux_open > 0 && i < 1000; i++) uv_run(core->loop, UV_RUN_NOWAIT);
    unlink_server(s);
  }
}

/* ---- methods ---------------------------------------------------------------------- */

static mbh_server *check_server(lua_State *L, int idx) {
  mb_handle **ud = (mb_handle **)luaL_checkudata(L, idx, MBH_SERVER);
  if (!*ud || (*ud)->closing) return NULL;
  mbh_server *s = (mbh_server *)(*ud)->extra;
  return s->close_requested ? NULL : s;
}

static mbh_conn *check_conn(lua_State *L, mbh_server **sp) {
  mbh_server *s = check_server(L, 1);
  lua_Integer id = luaL_checkinteger(L, 2);
  if (sp) *sp = s;
  return s ? mbh_conn_by_id(s, id) : NULL;
}

static int push_closed(lua_State *L) {
  lua_pushnil(L);
  lua_pushliteral(L, "ECONNRESET: the client or the server has gone");
  lua_pushliteral(L, "ECONNRESET");
  return 3;
}

/* core.http_listen({host, port | unix, max_body, max_connections, idle_timeout_ms}, on_event) */
static int http_listen(lua_State *L) {
  luaL_checktype(L, 1, LUA_TTABLE);
  luaL_checktype(L, 2, LUA_TFUNCTION);
  lua_getfield(L, 1, "host");
  const char *host = lua_tostring(L, -1);
  lua_getfield(L, 1, "unix");
  const char *unix_path = lua_tostring(L, -1);
  lua_pop(L, 2);
  lua_Integer port = mb_opt_intfield(L, 1, "port", 0);
  lua_Integer max_body = mb_opt_intfield(L, 1, "max_body", 1 << 20);
  lua_Integer max_conns = mb_opt_intfield(L, 1, "max_connections", 256);
  lua_Integer idle_ms = mb_opt_intfield(L, 1, "idle_timeout_ms", 30000);
  if (!host == !unix_path) return luaL_argerror(L, 1, "give exactly one of host or unix");
  if (port < 0 || port > 65535) return luaL_argerror(L, 1, "port must be 0-65535");
  if (max_body < 0 || max_conns < 1 || idle_ms < 1) return luaL_argerror(L, 1, "limits must be positive");
  if (unix_path && strlen(unix_path) >= sizeof(((mbh_server *)0)->unix_path))
    return luaL_argerror(L, 1, "unix socket path too long");
  if (unix_path) {
    struct stat sb;
    /* a socket file left by an earlier run would make bind fail */
    if (lstat(unix_path, &sb) == 0 && S_ISSOCK(sb.st_mode)) unlink(unix_path);
  }
  int bound_port;
  int fd = mbh_listen_socket(host, (int)port, unix_path, &bound_port);
  if (fd < 0) return mb_push_errno(L, -fd, unix_path ? unix_path : host);

  mb_handle *h = mb_handle_new(L, MBH_SERVER, sizeof(mbh_server));
  mbh_server *s = (mbh_server *)h->extra;
  s->h = h;
  s->fd = fd;
  s->port = bound_port;
  s->max_body = (size_t)max_body;
  s->max_conns = (int)max_conns;
  s->overflow = max_conns / 4 > 16 ? (int)(max_conns / 4) : 16;
  s->idle_ms = (uint64_t)idle_ms;
  s->is_unix = unix_path != NULL;
  if (unix_path) snprintf(s->unix_path, sizeof s->unix_path, "%s", unix_path);
  mb_handle_set_cb(L, h, MBH_CB_EVENT, 2);
  mbh_server_start(s);
  s->next_server = live_servers;
  live_servers = s;
  return 1;
}

/* server:port() -> the port listened on (0 for a unix socket) */
static int server_port(lua_State *L) {
  mbh_server *s = check_server(L, 1);
  if (!s) return push_closed(L);
  lua_pushinteger(L, s->port);
  return 1;
}

static const char *reason_phrase(int status) {
  switch (status) {
  case 100: return "Continue";
  case 101: return "Switching Protocols";
  case 200: return "OK";
  case 201: return "Created";
  case 202: return "Accepted";
  case 204: return "No Content";
  case 206: return "Partial Content";
  case 301: return "Moved Permanently";
  case 302: return "Found";
  case 303: return "See Other";
  case 304: return "Not Modified";
  case 307: return "Temporary Redirect";
  case 308: return "Permanent Redirect";
  case 400: return "Bad Request";
  case 401: return "Unauthorized";
  case 403: return "Forbidden";
  case 404: return "Not Found";
  case 405: return "Method Not Allowed";
  case 408: return "Request Timeout";
  case 409: return "Conflict";
  case 410: return "Gone";
  case 411: return "Length Required";
  case 412: return "Precondition Failed";
  case 413: return "Content Too Large";
  case 415: return "Unsupported Media Type";
  case 422: return "Unprocessable Content";
  case 429: return "Too Many Requests";
  case 431: return "Request Header Fields Too Large";
  case 500: return "Internal Server Error";
  case 501: return "Not Implemented";
  case 502: return "Bad Gateway";
  case 503: return "Service Unavailable";
  case 504: return "Gateway Timeout";
  default: return status < 400 ? "OK" : "Error";
  }
}

static int valid_header(const char *k, size_t klen, const char *v, size_t vlen) {
  return klen > 0 && klen <= 200 && strcspn(k, ": \t\r\n") == klen && !memchr(v, '\r', vlen) && !memchr(v, '\n', vlen);
}

/* The response head (room for extra bytes after it): status line, content
 * type and length, the headers of the table at idx (0: none; checked by
 * headers_ok), and "connection: close" when the connection ends after it
 * (closing > 0), "connection: keep-alive" for an HTTP/1.0 client when not
 * (closing < 0).
 * NULL when out of memory. */
static char *build_head(lua_State *L, int status, const char *ctype, lua_Integer length, int idx, int closing,
                        size_t extra, size_t *len) {
  size_t cap = 256 + strlen(ctype) + extra;
  for (lua_pushnil(L); idx && lua_next(L, idx); lua_pop(L, 1)) cap += lua_objlen(L, -2) + lua_objlen(L, -1) + 4;
  char *buf = malloc(cap);
  if (!buf) return NULL;
  size_t n = (size_t)snprintf(buf, cap, "HTTP/1.1 %d %s\r\ncontent-type: %s\r\n", status, reason_phrase(status), ctype);
  if (length >= 0) n += (size_t)snprintf(buf + n, cap - n, "content-length: %lld\r\n", (long long)length);
  int has_connection = 0;
  for (lua_pushnil(L); idx && lua_next(L, idx); lua_pop(L, 1)) {
    size_t klen, vlen;
    const char *k = lua_tolstring(L, -2, &klen);
    const char *v = lua_tolstring(L, -1, &vlen);
    has_connection |= klen == 10 && strncasecmp(k, "connection", 10) == 0;
    memcpy(buf + n, k, klen);
    memcpy(buf + n + klen, ": ", 2);
    memcpy(buf + n + klen + 2, v, vlen);
    memcpy(buf + n + klen + 2 + vlen, "\r\n", 2);
    n += klen + vlen + 4;
  }
  if (closing < 0 && !has_connection) { /* an HTTP/1.0 client kept alive must be told */
    memcpy(buf + n, "connection: keep-alive\r\n", 24);
    n += 24;
  } else if (closing > 0 && !has_connection) {
    memcpy(buf + n, "connection: close\r\n", 19);
    n += 19;
  }
  memcpy(buf + n, "\r\n", 2);
  *len = n + 2;
  return buf;
}

/* Headers at idx are a table of one-line strings: 1, else 0. */
static int headers_ok(lua_State *L, int idx) {
  for (lua_pushnil(L); lua_next(L, idx); lua_pop(L, 1)) {
    size_t klen, vlen;
    if (lua_type(L, -2) != LUA_TSTRING || lua_type(L, -1) != LUA_TSTRING) goto bad;
    const char *k = lua_tolstring(L, -2, &klen);
    const char *v = lua_tolstring(L, -1, &vlen);
    if (!valid_header(k, klen, v, vlen) || vlen > 1000) goto bad;
  }
  return 1;
bad:
  lua_pop(L, 2);
  return 0;
}

/* server:respond(id, status, content_type, headers, length|nil, body|nil)
 * -> true | nil, msg, code. With a body the response is complete; without
 * one, write() and finish() follow (length: the content length, if known;
 * unknown means the connection closes at the end). */
static int server_respond(lua_State *L) {
  mbh_conn *c = check_conn(L, NULL);
  int status = (int)luaL_checkinteger(L, 3);
  const char *ctype = luaL_optstring(L, 4, "text/plain");
  int has_headers = !lua_isnoneornil(L, 5);
  if (has_headers) luaL_checktype(L, 5, LUA_TTABLE);
  size_t blen = 0;
  const char *body = lua_isnoneornil(L, 7) ? NULL : luaL_checklstring(L, 7, &blen);
  lua_Integer length = body ? (lua_Integer)blen : (lua_isnoneornil(L, 6) ? -1 : luaL_checkinteger(L, 6));
  if (status < 100 || status > 999) return luaL_argerror(L, 3, "status must be 100-999");
  if (strpbrk(ctype, "\r\n")) return luaL_argerror(L, 4, "content type must be one line");
  if (has_headers && !headers_ok(L, 5))
    return luaL_argerror(L, 5, "header names and values must be strings without CR, LF or ':'");
  if (!c || c->is_ws) return push_closed(L);
  if (c->responding) return luaL_error(L, "response already started");
  if (length < 0) c->close_after = 1; /* the end of the body is the end of the connection */
  size_t hlen;
  int closing = c->close_after ? 1 : c->parser.head.minor == 0 ? -1 : 0;
  char *head = build_head(L, status, ctype, length, has_headers ? 5 : 0, closing, 0, &hlen);
  if (!head) return luaL_error(L, "out of memory");
  c->responding = 1;
  int rc = mbh_send(c, head, hlen);
  free(head);
  if (rc < 0) return push_closed(L);
  if (body) {
    if (!c->head_only && mbh_send_string(c, L, 7) < 0) return push_closed(L);
    mbh_finish(c);
  }
  lua_pushboolean(L, 1);
  return 1;
}

/* server:write(id, data[, is_binary[, more]]) -> queued bytes | nil, msg, code
 * Body bytes of a started response, or a WebSocket message (text unless
 * is_binary). With more, a WebSocket write is a fragment: the message goes
 * on with the next write (whose is_binary is ignored) and ends with the
 * first write without more, so a large message never sits whole in memory.
 * "drain" follows once everything queued is written. */
static int server_write(lua_State *L) {
  mbh_conn *c = check_conn(L, NULL);
  size_t len;
  const char *data = luaL_checklstring(L, 3, &len);
  int binary = lua_toboolean(L, 4);
  int more = lua_toboolean(L, 5);
  if (!c || c->finishing || c->ws_close_sent) return push_closed(L);
  if (c->is_ws) {
    int opcode = c->ws_out_open ? 0 : (binary ? 2 : 1);
    if (mbh_send_frame(c, opcode, !more, data, len) < 0) return push_closed(L);
    c->ws_out_open = more;
  } else {
    if (!c->responding) return luaL_error(L, "write before respond");
    if (!c->head_only && mbh_send_string(c, L, 3) < 0) return push_closed(L);
  }
  lua_pushnumber(L, (lua_Number)c->queued);
  return 1;
}

/* server:finish(id): end a streamed response once the queue is written */
static int server_finish(lua_State *L) {
  mbh_conn *c = check_conn(L, NULL);
  if (!c || c->is_ws) return push_closed(L);
  if (!c->responding) return luaL_error(L, "finish before respond");
  if (!c->finishing) mbh_finish(c);
  lua_pushboolean(L, 1);
  return 1;
}

/* server:ws_close(id[, code[, reason]]): close a WebSocket after its queue */
static int server_ws_close(lua_State *L) {
  mbh_conn *c = check_conn(L, NULL);
  int code = (int)luaL_optinteger(L, 3, 1000);
  size_t rlen = 0;
  const char *reason = luaL_optlstring(L, 4, "", &rlen);
  if (code < 1000 || code > 4999) return luaL_argerror(L, 3, "close code must be 1000-4999");
  if (!c || !c->is_ws) return push_closed(L);
  mbh_ws_send_close(c, code, reason, rlen);
  lua_pushboolean(L, 1);
  return 1;
}

/* server:ws_reject(id, status, content_type, body[, headers]): refuse a
 * WebSocket upgrade with a plain response. Only while the "request" event
 * for it is being delivered; afterwards the upgrade has happened (returns
 * false). */
static int server_ws_reject(lua_State *L) {
  mbh_conn *c = check_conn(L, NULL);
  int status = (int)luaL_checkinteger(L, 3);
  const char *ctype = luaL_optstring(L, 4, "text/plain");
  size_t blen;
  const char *body = luaL_optlstring(L, 5, "", &blen);
  if (status < 100 || status > 999) return luaL_argerror(L, 3, "status must be 100-999");
  if (strpbrk(ctype, "\r\n")) return luaL_argerror(L, 4, "content type must be one line");
  int has_headers = !lua_isnoneornil(L, 6);
  if (has_headers) luaL_checktype(L, 6, LUA_TTABLE);
  if (has_headers && !headers_ok(L, 6)) return luaL_argerror(L, 6, "headers must map names to one-line values");
  if (!c || !c->is_ws || c->established || c->phase != PH_HANDLER) {
    lua_pushboolean(L, 0);
    return 1;
  }
  size_t len;
  char *resp = build_head(L, status, ctype, (lua_Integer)blen, has_headers ? 6 : 0, 1, blen, &len);
  if (!resp) return luaL_error(L, "out of memory");
  memcpy(resp + len, body, blen);
  free(c->reject);
  c->reject = resp;
  c->reject_len = len + blen;
  lua_pushboolean(L, 1);
  return 1;
}

/* server:header(id, name) -> value | nil: a request header by name, while
 * the request is current. */
static int server_header(lua_State *L) {
  mbh_conn *c = check_conn(L, NULL);
  size_t nlen;
  const char *name = luaL_checklstring(L, 3, &nlen);
  char lname[256];
  if (!c || nlen == 0 || nlen >= sizeof lname) return 0;
  for (size_t i = 0; i <= nlen; i++) lname[i] = (char)(name[i] >= 'A' && name[i] <= 'Z' ? name[i] + 32 : name[i]);
  size_t vlen;
  const char *v = mbh_head_get(&c->parser.head, lname, &vlen);
  if (!v) return 0;
  lua_pushlstring(L, v, vlen);
  return 1;
}

/* server:hangup(id): close the connection once this response is out */
static int server_hangup(lua_State *L) {
  mbh_conn *c = check_conn(L, NULL);
  if (!c) return push_closed(L);
  c->close_after = 1;
  lua_pushboolean(L, 1);
  return 1;
}

/* server:queued(id) -> bytes waiting to be written | nil when gone */
static int server_queued(lua_State *L) {
  mbh_conn *c = check_conn(L, NULL);
  if (!c) return push_closed(L);
  lua_pushnumber(L, (lua_Number)c->queued);
  return 1;
}

/* server:connections() -> open connections */
static int server_connections(lua_State *L) {
  mbh_server *s = check_server(L, 1);
  lua_pushinteger(L, s ? s->nconns : 0);
  return 1;
}

/* server:drain(): refuse new connections at accept (graceful stop) */
static int server_drain(lua_State *L) {
  mbh_server *s = check_server(L, 1);
  if (s) s->draining = 1;
  return 0;
}

/* server:refused() -> connections hung up at accept so far, accepts the
 * kernel refused (each pauses accepting for MBH_ACCEPT_PAUSE_MS) */
static int server_refused(lua_State *L) {
  mbh_server *s = check_server(L, 1);
  lua_pushinteger(L, s ? s->refused : 0);
  lua_pushinteger(L, s ? s->accept_failed : 0);
  return 2;
}

/* server:close([callback]): stop listening, drop every connection; the
 * handle closes once their sockets have. */
static int server_close(lua_State *L) {
  mb_handle **ud = (mb_handle **)luaL_checkudata(L, 1, MBH_SERVER);
  mb_handle *h = *ud;
  if (!h || h->closing) return 0;
  mbh_server *s = (mbh_server *)h->extra;
  if (s->close_requested) return 0;
  if (lua_isfunction(L, 2)) mb_handle_set_cb(L, h, MBH_CB_CLOSE, 2);
  uv_ref(&h->uv.handle);
  mbh_server_stop(s); /* the sockets close asynchronously; mbh_server_closed follows */
  return 0;
}

static const luaL_Reg server_methods[] = {{"port", server_port},         {"respond", server_respond},
                                          {"write", server_write},       {"finish", server_finish},
                                          {"ws_close", server_ws_close}, {"ws_reject", server_ws_reject},
                                          {"header", server_header},     {"hangup", server_hangup},
                                          {"queued", server_queued},     {"connections", server_connections},
                                          {"drain", server_drain},       {"refused", server_refused},
                                          {"close", server_close},       {NULL, NULL}};

void mb_open_http(lua_State *L) {
  mb_new_class(L, MBH_SERVER, server_methods);
  lua_pushcfunction(L, http_listen);
  lua_setfield(L, -2, "http_listen");
}
