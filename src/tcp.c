/* tcp: connect to a host:port and hand the connected socket to Lua as an fd
 * (wrap it with core.stream_open). Used for readiness probes. */
#include "private.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct {
  uv_tcp_t tcp;
  uv_connect_t req;
  mb_core *core;
  int cb_ref;
  int fd; /* dup of the connected socket, or -1 */
  int status;
} tcp_connect;

static void on_closed(uv_handle_t *h) {
  tcp_connect *c = (tcp_connect *)h->data;
  mb_core *core = c->core;
  int ref = c->cb_ref, fd = c->fd, status = c->status;
  free(c);
  if (core->dead) {
    if (fd >= 0) close(fd);
    return;
  }
  lua_State *cbL = core->cbL;
  lua_rawgeti(cbL, LUA_REGISTRYINDEX, ref);
  luaL_unref(cbL, LUA_REGISTRYINDEX, ref);
  if (fd >= 0) {
    lua_pushnil(cbL);
    lua_pushinteger(cbL, fd);
    lua_pushnil(cbL);
  } else {
    lua_pushfstring(cbL, "%s: %s", uv_err_name(status), uv_strerror(status));
    lua_pushnil(cbL);
    lua_pushstring(cbL, uv_err_name(status));
  }
  mb_call(core, cbL, 3);
}

/* A connect to a local port nobody listens on can be answered by the
 * connecting socket itself: when the kernel picks the target port as the
 * source port (it lies in the ephemeral range), the SYN meets its own
 * socket and the connection "succeeds" (TCP simultaneous open). That is no
 * server: report it as refused. */
static int connected_to_itself(uv_tcp_t *tcp) {
  struct sockaddr_storage local, peer;
  int ll = sizeof local, pl = sizeof peer;
  if (uv_tcp_getsockname(tcp, (struct sockaddr *)&local, &ll) != 0) return 0;
  if (uv_tcp_getpeername(tcp, (struct sockaddr *)&peer, &pl) != 0) return 0;
  return ll == pl && memcmp(&local, &peer, (size_t)ll) == 0;
}

static void on_connect(uv_connect_t *req, int status) {
  tcp_connect *c = (tcp_connect *)req->data;
  if (status == 0 && connected_to_itself(&c->tcp)) status = UV_ECONNREFUSED;
  c->status = status;
  if (status == 0) {
    uv_os_fd_t fd;
    if (uv_fileno((uv_handle_t *)&c->tcp, &fd) == 0) {
      c->fd = fcntl(fd, F_DUPFD_CLOEXEC, 3);
      if (c->fd < 0) c->status = uv_translate_sys_error(errno);
    }
  }
  uv_close((uv_handle_t *)&c->tcp, on_closed);
}

/* core.tcp_connect(host, port, callback(err, fd, code)[, socket_fd]) -> true | nil, msg, code
 * socket_fd: an unconnected socket to use, e.g. one made inside a sandbox's
 * network namespace by its init. When the call returns true the connect
 * owns it (it is closed by then; the callback gets a new fd); when it
 * returns nil it is still the caller's, to close. */
static int tcp_connect_start(lua_State *L) {
  const char *host = luaL_checkstring(L, 1);
  int port = (int)luaL_checkinteger(L, 2);
  luaL_checktype(L, 3, LUA_TFUNCTION);
  if (port < 1 || port > 65535) return luaL_argerror(L, 2, "port must be 1-65535");
  /* checked before anything is allocated: a raise below would leak the request */
  int has_sock = !lua_isnoneornil(L, 4);
  int sock = has_sock ? (int)luaL_checkinteger(L, 4) : -1;
  struct sockaddr_storage addr;
  int rc = uv_ip4_addr(host, port, (struct sockaddr_in *)&addr);
  if (rc < 0) rc = uv_ip6_addr(host, port, (struct sockaddr_in6 *)&addr);
  if (rc < 0) return mb_push_error(L, rc, host);
  mb_core *core = mb_core_get(L);
  tcp_connect *c = (tcp_connect *)calloc(1, sizeof *c);
  if (!c) return luaL_error(L, "out of memory");
  c->core = core;
  c->fd = -1;
  c->cb_ref = LUA_NOREF;
  c->tcp.data = c;
  c->req.data = c;
  uv_tcp_init(core->loop, &c->tcp);
  if (has_sock) {
    /* the handle gets a copy: on failure below, closing the handle leaves
     * the caller's socket open */
    int copy = sock >= 0 ? fcntl(sock, F_DUPFD_CLOEXEC, 3) : -1;
    rc = copy < 0 ? (sock < 0 ? UV_EBADF : uv_translate_sys_error(errno)) : uv_tcp_open(&c->tcp, (uv_os_sock_t)copy);
    if (rc < 0) {
      if (copy >= 0) close(copy); /* uv_tcp_open failed: not the handle's */
      uv_close((uv_handle_t *)&c->tcp, (uv_close_cb)free);
      return mb_push_error(L, rc, "socket");
    }
  }
  rc = uv_tcp_connect(&c->req, &c->tcp, (const struct sockaddr *)&addr, on_connect);
  if (rc < 0) {
    uv_close((uv_handle_t *)&c->tcp, (uv_close_cb)free);
    return mb_push_error(L, rc, "connect");
  }
  if (has_sock) close(sock); /* under way on the copy */
  lua_pushvalue(L, 3);
  c->cb_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  lua_pushboolean(L, 1);
  return 1;
}

void mb_open_tcp(lua_State *L) {
  lua_pushcfunction(L, tcp_connect_start);
  lua_setfield(L, -2, "tcp_connect");
}
