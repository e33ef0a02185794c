/* udp: a bound UDP socket on the loop (the egress sandboxes' DNS forwarder,
 * lua/moonbox/network/dns_forwarder.lua). Bounded: it reads one datagram
 * at a time into a buffer of its own (512..4096 bytes, fixed at bind); a
 * longer datagram is reported as truncated, never grown into. Sends are
 * tried at once (uv_udp_try_send): a full socket buffer drops the datagram,
 * as the network may, so nothing queues behind a slow peer.
 *
 *   core.udp_bind(host, port[, opts]) -> udp | nil, msg, code
 *     opts.size: the datagram buffer (default 4096, 512..4096)
 *     opts.netns_pid: bind inside that process's network namespace (joining
 *       its user namespace first when it is not ours: a gateway namespace
 *       of an unprivileged runtime); a short-lived child makes the socket
 *       there and passes it back (SCM_RIGHTS)
 *   udp:recv_start(callback(err, data, host, port, truncated))
 *   udp:recv_stop()
 *   udp:send(data, host, port) -> true | nil, msg, code
 *   udp:sockname() -> host, port */
#include "private.h"
#include "child/wire.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define UDP "moonbox.udp"
#define UDP_MIN 512
#define UDP_MAX 4096
#define CHILD_STACK (64 * 1024)

typedef struct {
  size_t size;
  int busy; /* the buffer is lent to libuv */
  char buf[UDP_MAX];
} udp_state;

static int parse_addr(const char *host, int port, struct sockaddr_storage *addr) {
  int rc = uv_ip4_addr(host, port, (struct sockaddr_in *)addr);
  if (rc < 0) rc = uv_ip6_addr(host, port, (struct sockaddr_in6 *)addr);
  return rc;
}

/* ---- a socket made in another network namespace -------------------------- */

typedef struct {
  int user_fd, net_fd; /* namespaces to join (user_fd -1: ours) */
  int sk;              /* our end of the socketpair */
  struct sockaddr_storage addr;
} ns_bind_args;

/* Runs in a clone without CLONE_VM: only system calls, then _exit. Sends
 * the bound socket, or an errno, on the socketpair. */
static int ns_bind_child(void *p) {
  ns_bind_args *a = (ns_bind_args *)p;
  int err = 0, s = -1;
  if (a->user_fd >= 0 && setns(a->user_fd, CLONE_NEWUSER) < 0) err = errno;
  if (!err && setns(a->net_fd, CLONE_NEWNET) < 0) err = errno;
  if (!err) {
    s = socket(a->addr.ss_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s < 0) err = errno;
  }
  socklen_t len = a->addr.ss_family == AF_INET ? sizeof(struct sockaddr_in) : sizeof(struct sockaddr_in6);
  if (!err && bind(s, (struct sockaddr *)&a->addr, len) < 0) err = errno;
  mb_wire_send(a->sk, &err, sizeof err, &s, err ? 0 : 1, 0);
  _exit(0);
}

static int same_ns(int fd, const char *self_path) {
  struct stat a, b;
  return fstat(fd, &a) == 0 && stat(self_path, &b) == 0 && a.st_ino == b.st_ino && a.st_dev == b.st_dev;
}

/* A UDP socket bound to addr in pid's network namespace: its fd, or -errno. */
static int bind_in_netns(int pid, const struct sockaddr_storage *addr) {
  char path[64];
  ns_bind_args a = {.user_fd = -1, .net_fd = -1, .sk = -1};
  a.addr = *addr;
  int sv[2] = {-1, -1}, result = -EINVAL;
  char *stack = NULL;
  snprintf(path, sizeof path, "/proc/%d/ns/net", pid);
  a.net_fd = open(path, O_RDONLY | O_CLOEXEC);
  if (a.net_fd < 0) return -errno;
  snprintf(path, sizeof path, "/proc/%d/ns/user", pid);
  a.user_fd = open(path, O_RDONLY | O_CLOEXEC);
  if (a.user_fd < 0) {
    result = -errno;
    goto out;
  }
  if (same_ns(a.user_fd, "/proc/self/ns/user")) {
    close(a.user_fd);
    a.user_fd = -1;
  }
  if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0) {
    result = -errno;
    goto out;
  }
  a.sk = sv[1];
  stack = (char *)malloc(CHILD_STACK);
  if (!stack) {
    result = -ENOMEM;
    goto out;
  }
  /* no exit signal: the runtime's SIGCHLD reaper (waitpid(-1) without
   * __WALL) never takes it; signals blocked so no handler runs in it */
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  pid_t child = clone(ns_bind_child, stack + CHILD_STACK, 0, &a);
  int clone_err = errno;
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (child < 0) {
    result = -clone_err;
    goto out;
  }
  close(sv[1]);
  sv[1] = -1;
  int err = 0, fd = -1;
  mb_wire_in in;
  ssize_t n = mb_wire_recv(sv[0], &err, sizeof err, &in);
  int recv_err = errno;
  for (int i = 0; n > 0 && i < in.nfds; i++) {
    if (fd < 0) fd = in.fds[i];
    else close(in.fds[i]);
  }
  while (waitpid(child, NULL, __WALL) < 0 && errno == EINTR) {}
  if (n < 0) result = -recv_err;
  else if (n != (ssize_t)sizeof err) result = -EPROTO;
  else if (err) result = -err;
  else if (fd < 0) result = -EPROTO;
  else result = fd;
  if (result < 0 && fd >= 0) close(fd);
out:
  free(stack);
  if (sv[0] >= 0) close(sv[0]);
  if (sv[1] >= 0) close(sv[1]);
  if (a.user_fd >= 0) close(a.user_fd);
  if (a.net_fd >= 0) close(a.net_fd);
  return result;
}

/* ---- the handle ----------------------------------------------------------- */

/* core.udp_bind(host, port[, opts]) */
static int udp_bind(lua_State *L) {
  const char *host = luaL_checkstring(L, 1);
  int port = (int)luaL_checkinteger(L, 2);
  if (port < 0 || port > 65535) return luaL_argerror(L, 2, "port must be 0-65535");
  lua_Integer size = UDP_MAX, netns_pid = 0;
  if (!lua_isnoneornil(L, 3)) {
    luaL_checktype(L, 3, LUA_TTABLE);
    size = mb_opt_intfield(L, 3, "size", UDP_MAX);
    netns_pid = mb_opt_intfield(L, 3, "netns_pid", 0);
  }
  if (size < UDP_MIN || size > UDP_MAX) return luaL_argerror(L, 3, "size must be 512-4096");
  if (netns_pid < 0 || netns_pid > 0x3fffffff) return luaL_argerror(L, 3, "netns_pid out of range");
  struct sockaddr_storage addr;
  int rc = parse_addr(host, port, &addr);
  if (rc < 0) return mb_push_error(L, rc, host);
  int fd = -1;
  if (netns_pid > 0) {
    fd = bind_in_netns((int)netns_pid, &addr);
    if (fd < 0) return mb_push_errno(L, -fd, "bind in the namespace");
  }
  mb_handle *h = mb_handle_new(L, UDP, sizeof(udp_state));
  udp_state *st = (udp_state *)h->extra;
  st->size = (size_t)size;
  uv_udp_init(h->core->loop, &h->uv.udp); /* (makes no socket: cannot fail) */
  if (fd >= 0) {
    rc = uv_udp_open(&h->uv.udp, (uv_os_sock_t)fd);
    if (rc < 0) close(fd); /* not the handle's */
  } else {
    rc = uv_udp_bind(&h->uv.udp, (const struct sockaddr *)&addr, 0);
  }
  if (rc < 0) {
    mb_handle_close(L, h, 0);
    return mb_push_error(L, rc, "bind");
  }
  return 1;
}

static void on_alloc(uv_handle_t *handle, size_t suggested, uv_buf_t *buf) {
  (void)suggested;
  mb_handle *h = (mb_handle *)handle->data;
  udp_state *st = (udp_state *)h->extra;
  if (st->busy) { /* one datagram at a time */
    *buf = uv_buf_init(NULL, 0);
    return;
  }
  st->busy = 1;
  *buf = uv_buf_init(st->buf, (unsigned)st->size);
}

static void on_recv(uv_udp_t *u, ssize_t nread, const uv_buf_t *buf, const struct sockaddr *addr, unsigned flags) {
  mb_handle *h = (mb_handle *)u->data;
  udp_state *st = (udp_state *)h->extra;
  if (buf->base == st->buf) st->busy = 0;
  if (nread == 0 && addr == NULL) return; /* nothing more for now */
  if (h->closing || h->core->dead) return;
  lua_State *cbL = mb_handle_push_cb(h, 1);
  if (!cbL) return;
  if (nread < 0) {
    lua_pushfstring(cbL, "%s: %s", uv_err_name((int)nread), uv_strerror((int)nread));
    mb_call(h->core, cbL, 1);
    return;
  }
  char host[INET6_ADDRSTRLEN] = "";
  int port = 0;
  if (addr && addr->sa_family == AF_INET) {
    uv_ip4_name((const struct sockaddr_in *)addr, host, sizeof host);
    port = ntohs(((const struct sockaddr_in *)addr)->sin_port);
  } else if (addr && addr->sa_family == AF_INET6) {
    uv_ip6_name((const struct sockaddr_in6 *)addr, host, sizeof host);
    port = ntohs(((const struct sockaddr_in6 *)addr)->sin6_port);
  }
  lua_pushnil(cbL);
  lua_pushlstring(cbL, buf->base, (size_t)nread);
  lua_pushstring(cbL, host);
  lua_pushinteger(cbL, port);
  lua_pushboolean(cbL, (flags & UV_UDP_PARTIAL) != 0);
  mb_call(h->core, cbL, 5);
}

static int udp_recv_start(lua_State *L) {
  mb_handle *h = mb_handle_check(L, 1, UDP);
  mb_handle_set_cb(L, h, 1, 2);
  int rc = uv_udp_recv_start(&h->uv.udp, on_alloc, on_recv);
  if (rc < 0) return mb_push_error(L, rc, NULL);
  lua_pushboolean(L, 1);
  return 1;
}

static int udp_recv_stop(lua_State *L) {
  mb_handle *h = mb_handle_check(L, 1, UDP);
  uv_udp_recv_stop(&h->uv.udp);
  return 0;
}

static int udp_send(lua_State *L) {
  mb_handle *h = mb_handle_check(L, 1, UDP);
  size_t len;
  const char *data = luaL_checklstring(L, 2, &len);
  const char *host = luaL_checkstring(L, 3);
  int port = (int)luaL_checkinteger(L, 4);
  if (port < 1 || port > 65535) return luaL_argerror(L, 4, "port must be 1-65535");
  if (len > UDP_MAX) return mb_push_error(L, UV_EMSGSIZE, "datagram over 4096 bytes");
  struct sockaddr_storage addr;
  int rc = parse_addr(host, port, &addr);
  if (rc < 0) return mb_push_error(L, rc, host);
  uv_buf_t buf = uv_buf_init((char *)data, (unsigned)len);
  rc = uv_udp_try_send(&h->uv.udp, &buf, 1, (const struct sockaddr *)&addr);
  if (rc < 0) return mb_push_error(L, rc, "send");
  lua_pushboolean(L, 1);
  return 1;
}

static int udp_sockname(lua_State *L) {
  mb_handle *h = mb_handle_check(L, 1, UDP);
  struct sockaddr_storage addr;
  int len = sizeof addr;
  int rc = uv_udp_getsockname(&h->uv.udp, (struct sockaddr *)&addr, &len);
  if (rc < 0) return mb_push_error(L, rc, NULL);
  char host[INET6_ADDRSTRLEN] = "";
  int port;
  if (addr.ss_family == AF_INET) {
    uv_ip4_name((struct sockaddr_in *)&addr, host, sizeof host);
    port = ntohs(((struct sockaddr_in *)&addr)->sin_port);
  } else {
    uv_ip6_name((struct sockaddr_in6 *)&addr, host, sizeof host);
    port = ntohs(((struct sockaddr_in6 *)&addr)->sin6_port);
  }
  lua_pushstring(L, host);
  lua_pushinteger(L, port);
  return 2;
}

static const luaL_Reg udp_methods[] = {{"recv_start", udp_recv_start},
                                       {"recv_stop", udp_recv_stop},
                                       {"send", udp_send},
                                       {"sockname", udp_sockname},
                                       {NULL, NULL}};

void mb_open_udp(lua_State *L) {
  mb_new_class(L, UDP, udp_methods);
  lua_pushcfunction(L, udp_bind);
  lua_setfield(L, -2, "udp_bind");
}
