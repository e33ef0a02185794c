/* Streams over pipes and pty masters: read start/stop, write with completion
 * and backpressure, a non-blocking drain, shutdown, close. */
#include "private.h"
#include "child/wire.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define STREAM "moonbox.stream"
#define READ_BUF 65536
/* A stream's reads per turn of the loop. libuv reads a readable stream
 * again while each read fills the buffer (up to 32 times, 2 MiB here), so a
 * few streams that always have more (a flood of output) made one turn
 * last tens of ms while the CPUs were busy, and every other client's next
 * step waited for the whole turn (issue #29). Past this many bytes the turn
 * ends for this stream (an empty buffer: libuv says UV_ENOBUFS and goes on
 * to the next ready handle); the fd is still readable, so the next turn
 * reads on. */
#define READ_TURN (2 * READ_BUF)

typedef struct {
  int is_pty; /* a pty master reports EIO when the slave side closes: that is EOF */
  int eof;
  size_t turn; /* bytes read in this turn's run of full reads */
  char *buf;   /* the core's shared read buffer: reads are handled one at a time */
} stream_state;

enum { CB_CLOSE = 0, CB_READ = 1 };

static void on_alloc(uv_handle_t *uvh, size_t suggested, uv_buf_t *buf) {
  (void)suggested;
  stream_state *st = (stream_state *)((mb_handle *)uvh->data)->extra;
  if (st->turn >= READ_TURN) {
    *buf = uv_buf_init(NULL, 0); /* this turn's share is read */
    return;
  }
  buf->base = st->buf;
  buf->len = READ_BUF;
}

static void deliver(mb_handle *h, stream_state *st, ssize_t nread);

/* libuv says EOF on POLLHUP after a short read, without reading again. A pty
 * master polls HUP as soon as the slave's last fd closes, which can be
 * before the slave's last writes reached the master's buffer (the kernel
 * moves them in a work item): the child's last line was lost, a few in a
 * thousand under load. read() itself waits for that work: read until it
 * says EIO (bounded; a closed stream stops it). */
static void drain_pty(uv_stream_t *s, mb_handle *h, stream_state *st) {
  uv_os_fd_t fd;
  if (uv_fileno((uv_handle_t *)s, &fd) < 0) return;
  for (int i = 0; i < 64 && !h->closing; i++) {
    ssize_t n = read(fd, st->buf, READ_BUF);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    deliver(h, st, n);
  }
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf) {
  (void)buf;
  mb_handle *h = (mb_handle *)s->data;
  stream_state *st = (stream_state *)h->extra;
  /* a full read means libuv reads again in this turn; anything else ends it */
  st->turn = nread == READ_BUF ? st->turn + READ_BUF : 0;
  if (nread == 0 || nread == UV_ENOBUFS) return;
  if (nread == UV_EOF && st->is_pty) {
    drain_pty(s, h, st);
    if (h->closing) return;
  }
  deliver(h, st, nread);
}

/* nread bytes in st->buf, or an error or EOF, to the read callback */
static void deliver(mb_handle *h, stream_state *st, ssize_t nread) {
  uv_stream_t *s = &h->uv.stream;
  if (nread < 0) {
    uv_read_stop(s);
    if (nread == UV_EOF || (st->is_pty && nread == UV_EIO)) st->eof = 1;
  }
  lua_State *cbL = mb_handle_push_cb(h, CB_READ);
  if (!cbL) return;
  if (nread > 0) {
    lua_pushnil(cbL);
    lua_pushlstring(cbL, st->buf, (size_t)nread);
  } else if (st->eof) {
    lua_pushnil(cbL);
    lua_pushnil(cbL);
  } else {
    lua_pushstring(cbL, uv_err_name((int)nread));
    lua_pushnil(cbL);
  }
  mb_call(h->core, cbL, 2);
}

/* The core's one read buffer, made at its first use. */
static char *shared_read_buf(lua_State *L, mb_core *core) {
  if (!core->read_buf && !(core->read_buf = (char *)malloc(READ_BUF))) luaL_error(L, "out of memory");
  return core->read_buf;
}

int mb_stream_push_fd(lua_State *L, int fd, int is_pty) {
  mb_handle *h = mb_handle_new(L, STREAM, sizeof(stream_state));
  stream_state *st = (stream_state *)h->extra;
  st->is_pty = is_pty;
  st->buf = shared_read_buf(L, h->core);
  int rc = uv_pipe_init(h->core->loop, &h->uv.pipe, 0);
  if (rc == 0) rc = uv_pipe_open(&h->uv.pipe, fd);
  if (rc < 0) {
    mb_handle_close(L, h, 0);
    lua_pop(L, 1);
    return mb_push_error(L, rc, "stream open");
  }
  return 1;
}

/* core.stream_open(fd[, is_pty]) -> stream; takes ownership of fd */
static int stream_open(lua_State *L) {
  int fd = (int)luaL_checkinteger(L, 1);
  if (fd < 0) return luaL_argerror(L, 1, "fd must be >= 0");
  return mb_stream_push_fd(L, fd, lua_toboolean(L, 2));
}

/* core.pipe([uid, gid]) -> read_fd, write_fd (both close-on-exec and
 * blocking). uid and gid own the pipe: a process of those ids inside a user
 * namespace can then open it again by name (/dev/stdout), as the ones our
 * own ids map to can. */
static int make_pipe(lua_State *L) {
  int fds[2];
  int chown_to = !lua_isnoneornil(L, 1);
  uid_t uid = chown_to ? (uid_t)luaL_checkinteger(L, 1) : 0;
  gid_t gid = chown_to ? (gid_t)luaL_checkinteger(L, 2) : 0;
  if (pipe2(fds, O_CLOEXEC) < 0) return mb_push_errno(L, errno, "pipe2");
  if (chown_to && fchown(fds[0], uid, gid) < 0) {
    int e = errno;
    close(fds[0]);
    close(fds[1]);
    return mb_push_errno(L, e, "fchown");
  }
  lua_pushinteger(L, fds[0]);
  lua_pushinteger(L, fds[1]);
  return 2;
}

/* core.close_fd(fd) for fds not (yet) wrapped in a stream */
static int close_fd(lua_State *L) {
  int fd = (int)luaL_checkinteger(L, 1);
  if (close(fd) < 0) return mb_push_errno(L, errno, "close");
  lua_pushboolean(L, 1);
  return 1;
}

/* stream:read_start(callback(err, data)); data nil means EOF */
static int stream_read_start(lua_State *L) {
  mb_handle *h = mb_handle_check(L, 1, STREAM);
  stream_state *st = (stream_state *)h->extra;
  mb_handle_set_cb(L, h, CB_READ, 2);
  if (st->eof) return mb_push_error(L, UV_EOF, NULL);
  int rc = uv_read_start(&h->uv.stream, on_alloc, on_read);
  if (rc < 0 && rc != UV_EALREADY) return mb_push_error(L, rc, NULL);
  lua_pushboolean(L, 1);
  return 1;
}

static int stream_read_stop(lua_State *L) {
  mb_handle *h = mb_handle_check(L, 1, STREAM);
  uv_read_stop(&h->uv.stream);
  return 0;
}

/* Up to limit bytes already in fd (non-blocking) onto the stack: data ("" when
 * nothing is ready) | nil at EOF (*eof set) | nil, msg, code. */
static int read_ready(lua_State *L, int fd, char *buf, size_t limit, int is_pty, int *eof) {
  luaL_Buffer b;
  luaL_buffinit(L, &b);
  size_t total = 0;
  while (total < limit) {
    size_t want = limit - total < READ_BUF ? limit - total : READ_BUF;
    ssize_t n = read(fd, buf, want);
    if (n > 0) {
      luaL_addlstring(&b, buf, (size_t)n);
      total += (size_t)n;
      continue;
    }
    if (n == 0 || (n < 0 && is_pty && errno == EIO)) {
      *eof = 1;
      break;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN) break;
    int e = errno;
    luaL_pushresult(&b);
    lua_pop(L, 1);
    return mb_push_errno(L, e, "read");
  }
  luaL_pushresult(&b);
  if (total == 0 && *eof) {
    lua_pop(L, 1);
    lua_pushnil(L);
  }
  return 1;
}

static size_t read_limit(lua_State *L, int idx) {
  lua_Number max = luaL_optnumber(L, idx, 1 << 20);
  if (!(max >= 0)) luaL_argerror(L, idx, "limit must be >= 0");
  return max > 1e15 ? (size_t)1e15 : (size_t)max;
}

/* stream:try_read([limit = 1 MiB]) -> data ("" when nothing is ready) | nil
 * at EOF. Reads what is already buffered without waiting: used to collect
 * output a process wrote before it signalled completion on another fd. */
static int stream_try_read(lua_State *L) {
  mb_handle *h = mb_handle_check(L, 1, STREAM);
  stream_state *st = (stream_state *)h->extra;
  size_t limit = read_limit(L, 2);
  if (st->eof) {
    lua_pushnil(L);
    return 1;
  }
  uv_os_fd_t fd;
  if (uv_fileno(&h->uv.handle, &fd) < 0) return mb_push_error(L, UV_EBADF, NULL);
  return read_ready(L, fd, st->buf, limit, st->is_pty, &st->eof);
}

/* core.read_pending(fd1[, fd2[, limit = 1 MiB]]) -> data1, data2 ("" when
 * nothing is there; nil, msg, code on an error): what is already in one or
 * two pipes, blocking ones included, without waiting. One poll(2) tells
 * which hold anything, and only those are read, each until a read comes
 * back short (a pipe's read returns all it holds): a short command's empty
 * outputs cost one system call, not an EAGAIN read each, and its pipes need
 * no O_NONBLOCK (issue #32). Only for fds no one else reads. */
static int core_read_pending(lua_State *L) {
  struct pollfd p[2];
  int n = lua_isnoneornil(L, 2) ? 1 : 2;
  for (int i = 0; i < n; i++) {
    p[i].fd = (int)luaL_checkinteger(L, i + 1);
    p[i].events = POLLIN;
    p[i].revents = 0;
    if (p[i].fd < 0) return luaL_argerror(L, i + 1, "fd must be >= 0");
  }
  size_t limit = read_limit(L, 3);
  char *buf = shared_read_buf(L, mb_core_get(L));
  int rc;
  do rc = poll(p, (nfds_t)n, 0);
  while (rc < 0 && errno == EINTR);
  if (rc < 0) return mb_push_errno(L, errno, "poll");
  for (int i = 0; i < n; i++)
    if (p[i].revents & POLLNVAL) return mb_push_errno(L, EBADF, "poll");
  for (int i = 0; i < n; i++) {
    luaL_Buffer b;
    luaL_buffinit(L, &b);
    size_t total = 0;
    short ready = p[i].revents;
    while ((ready & POLLIN) && total < limit) {
      size_t want = limit - total < READ_BUF ? limit - total : READ_BUF;
      ssize_t got = read(p[i].fd, buf, want);
      if (got < 0 && errno == EINTR) continue;
      if (got < 0 && errno != EAGAIN) {
        int e = errno;
        luaL_pushresult(&b);
        return mb_push_errno(L, e, "read");
      }
      if (got <= 0) break;
      luaL_addlstring(&b, buf, (size_t)got);
      total += (size_t)got;
      if ((size_t)got < want) break;
      /* a full read: more may wait (never read an empty blocking pipe) */
      struct pollfd again = {p[i].fd, POLLIN, 0};
      do rc = poll(&again, 1, 0);
      while (rc < 0 && errno == EINTR);
      ready = rc > 0 ? again.revents : 0;
    }
    luaL_pushresult(&b);
  }
  return n;
}

typedef struct {
  uv_write_t req;
  mb_core *core;
  int cb_ref;
  int data_ref; /* keeps the Lua string alive until libuv is done with it */
} write_req;

/* A write's or shutdown's callback (its ref dropped): nil, or the error's name. */
static void call_status(mb_core *core, int ref, int status) {
  lua_State *cbL = core->cbL;
  lua_rawgeti(cbL, LUA_REGISTRYINDEX, ref);
  luaL_unref(cbL, LUA_REGISTRYINDEX, ref);
  if (status < 0) lua_pushstring(cbL, uv_err_name(status));
  else lua_pushnil(cbL);
  mb_call(core, cbL, 1);
}

static void on_write(uv_write_t *req, int status) {
  write_req *wr = (write_req *)req;
  mb_core *core = wr->core;
  int cb_ref = wr->cb_ref;
  lua_State *cbL = core->cbL;
  if (core->dead) {
    free(wr);
    return;
  } /* cancelled while the Lua state closes */
  luaL_unref(cbL, LUA_REGISTRYINDEX, wr->data_ref);
  free(wr);
  if (cb_ref != LUA_NOREF) call_status(core, cb_ref, status);
}

/* stream:write(data[, callback(err)]) -> queued bytes | nil, msg, code */
static int stream_write(lua_State *L) {
  mb_handle *h = mb_handle_check(L, 1, STREAM);
  size_t len;
  const char *data = luaL_checklstring(L, 2, &len);
  write_req *wr = (write_req *)malloc(sizeof(write_req));
  if (!wr) return luaL_error(L, "out of memory");
  wr->core = h->core;
  wr->cb_ref = LUA_NOREF;
  lua_pushvalue(L, 2);
  wr->data_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  if (lua_isfunction(L, 3)) {
    lua_pushvalue(L, 3);
    wr->cb_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  }
  uv_buf_t buf = uv_buf_init((char *)data, (unsigned int)len);
  int rc = uv_write(&wr->req, &h->uv.stream, &buf, 1, on_write);
  if (rc < 0) {
    luaL_unref(L, LUA_REGISTRYINDEX, wr->data_ref);
    luaL_unref(L, LUA_REGISTRYINDEX, wr->cb_ref);
    free(wr);
    return mb_push_error(L, rc, "write");
  }
  lua_pushnumber(L, (lua_Number)h->uv.stream.write_queue_size);
  return 1;
}

static int stream_write_queue_size(lua_State *L) {
  mb_handle *h = mb_handle_check(L, 1, STREAM);
  lua_pushnumber(L, (lua_Number)h->uv.stream.write_queue_size);
  return 1;
}

typedef struct {
  uv_shutdown_t req;
  mb_core *core;
  int cb_ref;
} shutdown_req;

/* shutdown(2) only works on sockets: on the write end of a pipe libuv reports
 * ENOTSOCK and the reader never sees EOF. Once the queued writes are done,
 * swap the pipe end under the fd for /dev/null: the pipe end closes (EOF for
 * the reader) and the handle stays valid until close(). */
static int shutdown_pipe(uv_stream_t *s) {
  mb_handle *h = (mb_handle *)s->data;
  uv_os_fd_t fd;
  struct stat sb;
  if (((stream_state *)h->extra)->is_pty) return UV_ENOTSOCK;
  if (uv_fileno((uv_handle_t *)s, &fd) < 0 || fstat(fd, &sb) < 0 || !S_ISFIFO(sb.st_mode)) return UV_ENOTSOCK;
  int null = open("/dev/null", O_WRONLY | O_CLOEXEC);
  if (null < 0) return uv_translate_sys_error(errno);
  int rc = dup3(null, fd, O_CLOEXEC) < 0 ? uv_translate_sys_error(errno) : 0;
  close(null);
  return rc;
}

static void on_shutdown(uv_shutdown_t *req, int status) {
  shutdown_req *sr = (shutdown_req *)req;
  mb_core *core = sr->core;
  if (status == UV_ENOTSOCK) status = shutdown_pipe(req->handle);
  int ref = sr->cb_ref;
  free(sr);
  if (ref != LUA_NOREF && !core->dead) call_status(core, ref, status);
}

/* stream:shutdown([callback(err)]): EOF for the reader once queued writes are done */
static int stream_shutdown(lua_State *L) {
  mb_handle *h = mb_handle_check(L, 1, STREAM);
  shutdown_req *sr = (shutdown_req *)malloc(sizeof(shutdown_req));
  if (!sr) return luaL_error(L, "out of memory");
  sr->core = h->core;
  sr->cb_ref = LUA_NOREF;
  if (lua_isfunction(L, 2)) {
    lua_pushvalue(L, 2);
    sr->cb_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  }
  int rc = uv_shutdown(&sr->req, &h->uv.stream, on_shutdown);
  if (rc < 0) {
    luaL_unref(L, LUA_REGISTRYINDEX, sr->cb_ref);
    free(sr);
    return mb_push_error(L, rc, "shutdown");
  }
  lua_pushboolean(L, 1);
  return 1;
}

/* stream:set_pipe_size(bytes) -> actual size; larger pipes mean fewer wakeups */
static int stream_set_pipe_size(lua_State *L) {
  mb_handle *h = mb_handle_check(L, 1, STREAM);
  int size = (int)luaL_checkinteger(L, 2);
  uv_os_fd_t fd;
  if (uv_fileno(&h->uv.handle, &fd) < 0) return mb_push_error(L, UV_EBADF, NULL);
  int rc = fcntl(fd, F_SETPIPE_SZ, size);
  if (rc < 0) return mb_push_errno(L, errno, "F_SETPIPE_SZ");
  lua_pushinteger(L, rc);
  return 1;
}

/* stream:send_fds(data, {fd, ...}) -> bytes sent | nil, msg, code: data with
 * the fds attached (SCM_RIGHTS) on a stream over a unix socket, without
 * waiting: for a peer that takes it at once (a session shell's outputs,
 * docs/sessions.md). Our fds stay open; the caller closes them. */
static int stream_send_fds(lua_State *L) {
  mb_handle *h = mb_handle_check(L, 1, STREAM);
  size_t len;
  const char *data = luaL_checklstring(L, 2, &len);
  luaL_checktype(L, 3, LUA_TTABLE);
  int fds[MB_WIRE_MAX_FDS];
  int nfds = (int)lua_objlen(L, 3);
  if (len == 0) return luaL_argerror(L, 2, "data must not be empty");
  if (nfds < 1 || nfds > MB_WIRE_MAX_FDS)
    return luaL_argerror(L, 3, lua_pushfstring(L, "expected 1 to %d fds", MB_WIRE_MAX_FDS));
  for (int i = 0; i < nfds; i++) {
    lua_rawgeti(L, 3, i + 1);
    if (lua_type(L, -1) != LUA_TNUMBER || lua_tointeger(L, -1) < 0)
      return luaL_argerror(L, 3, "fds must be integers >= 0");
    fds[i] = (int)lua_tointeger(L, -1);
    lua_pop(L, 1);
  }
  uv_os_fd_t sock;
  int rc = uv_fileno(&h->uv.handle, &sock);
  if (rc < 0) return mb_push_error(L, rc, "send_fds");
  ssize_t n = mb_wire_send(sock, data, len, fds, nfds, MSG_DONTWAIT);
  if (n < 0) return mb_push_errno(L, errno, "sendmsg");
  lua_pushinteger(L, (lua_Integer)n);
  return 1;
}

static const luaL_Reg stream_methods[] = {{"send_fds", stream_send_fds},
                                          {"read_start", stream_read_start},
                                          {"read_stop", stream_read_stop},
                                          {"try_read", stream_try_read},
                                          {"write", stream_write},
                                          {"write_queue_size", stream_write_queue_size},
                                          {"shutdown", stream_shutdown},
                                          {"set_pipe_size", stream_set_pipe_size},
                                          {NULL, NULL}};

void mb_open_stream(lua_State *L) {
  mb_new_class(L, STREAM, stream_methods);
  lua_pushcfunction(L, stream_open);
  lua_setfield(L, -2, "stream_open");
  lua_pushcfunction(L, make_pipe);
  lua_setfield(L, -2, "pipe");
  lua_pushcfunction(L, close_fd);
  lua_setfield(L, -2, "close_fd");
  lua_pushcfunction(L, core_read_pending);
  lua_setfield(L, -2, "read_pending");
}
