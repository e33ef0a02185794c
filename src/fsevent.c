/* fs_event: filesystem change notification through inotify.
 *
 *   core.fs_event() -> handle ("moonbox.fs_event")
 *   handle:start(path, callback)            -> wd | nil, message, CODE
 *   handle:start(dirfd, relpath, callback)  -> wd (confined, see below)
 *   handle:add(path) / handle:add(dirfd, relpath) -> wd   another watch on the same handle
 *   handle:remove(wd) -> true
 *   handle:stop()      stop reading events (close releases every watch)
 *   close, is_closing, is_active, ...: the common handle methods
 *
 *   callback(nil, name, event) for each event, in the kernel's order:
 *     name  the entry's name inside the watched directory (nil for an event
 *           on the watched object itself)
 *     event {wd, cookie, create, delete, modify, attrib, moved_from,
 *            moved_to, delete_self, move_self, unmount, ignored, overflow,
 *            isdir} (flags true when set; cookie pairs moved_from/moved_to)
 *   callback(message, nil, nil, CODE) when reading fails.
 *
 * Why not uv_fs_event: on Linux it reports only "rename" or "change", so a
 * create, a delete and a move cannot be told apart, renames cannot be paired,
 * and every directory needs its own handle. Here one handle is one inotify
 * instance holding any number of watches (one per directory for a recursive
 * watch), read through a libuv pipe that owns the inotify fd, so closing the
 * handle (or tearing the core down) releases every watch.
 *
 * Confinement: with (dirfd, relpath) the target is opened with openat2
 * RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS relative to dirfd and the watch is
 * placed on exactly that inode (through /proc/self/fd), so neither ".." nor
 * a symlink can put a watch outside dirfd; an escape is
 * nil, "EXDEV: path resolves outside the root (...)", "EXDEV". In place of
 * dirfd a confinement (core.fs_confine, src/fs.c) may be given: the target
 * is then opened under its rules (its resolve mode, its credentials, only
 * on its allowed mounts). */
#include "private.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/inotify.h>
#include <unistd.h>

#define FS_EVENT "moonbox.fs_event"
#define EVENT_BUF 65536

#define WATCH_MASK                                                                                                     \
  (IN_CREATE | IN_DELETE | IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_DELETE_SELF | IN_MOVE_SELF |       \
   IN_EXCL_UNLINK)

enum { CB_CLOSE = 0, CB_EVENT = 1 };

typedef struct {
  int ifd;     /* the inotify fd once created (owned by the pipe), else -1 */
  uid_t owner; /* whose fs.inotify limits the instance counts against (0: ours) */
  char buf[EVENT_BUF] __attribute__((aligned(8)));
} fsev_state;

static void on_alloc(uv_handle_t *uvh, size_t suggested, uv_buf_t *buf) {
  (void)suggested;
  fsev_state *st = (fsev_state *)((mb_handle *)uvh->data)->extra;
  buf->base = st->buf;
  buf->len = EVENT_BUF;
}

#define FLAG(L, name, cond) ((cond) ? (lua_pushboolean(L, 1), lua_setfield(L, -2, name)) : (void)0)

static void push_event(lua_State *L, const struct inotify_event *ev) {
  if (ev->len > 0) lua_pushstring(L, ev->name);
  else lua_pushnil(L);
  lua_createtable(L, 0, 4);
  lua_pushinteger(L, ev->wd);
  lua_setfield(L, -2, "wd");
  if (ev->cookie) {
    lua_pushnumber(L, (lua_Number)ev->cookie);
    lua_setfield(L, -2, "cookie");
  }
  uint32_t m = ev->mask;
  FLAG(L, "create", m & IN_CREATE);
  FLAG(L, "delete", m & IN_DELETE);
  FLAG(L, "modify", m & IN_MODIFY);
  FLAG(L, "attrib", m & IN_ATTRIB);
  FLAG(L, "moved_from", m & IN_MOVED_FROM);
  FLAG(L, "moved_to", m & IN_MOVED_TO);
  FLAG(L, "delete_self", m & IN_DELETE_SELF);
  FLAG(L, "move_self", m & IN_MOVE_SELF);
  FLAG(L, "unmount", m & IN_UNMOUNT);
  FLAG(L, "ignored", m & IN_IGNORED);
  FLAG(L, "overflow", m & IN_Q_OVERFLOW);
  FLAG(L, "isdir", m & IN_ISDIR);
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf) {
  mb_handle *h = (mb_handle *)s->data;
  if (nread == 0) return;
  if (nread < 0) {
    uv_read_stop(s);
    lua_State *cbL = mb_handle_push_cb(h, CB_EVENT);
    if (!cbL) return;
    lua_pushfstring(cbL, "%s: %s (reading inotify events)", uv_err_name((int)nread), uv_strerror((int)nread));
    lua_pushnil(cbL);
    lua_pushnil(cbL);
    lua_pushstring(cbL, uv_err_name((int)nread));
    mb_call(h->core, cbL, 4);
    return;
  }
  /* the kernel only ever returns whole events */
  for (const char *p = buf->base; p < buf->base + nread && !h->closing;) {
    const struct inotify_event *ev = (const struct inotify_event *)(const void *)p;
    p += sizeof(struct inotify_event) + ev->len;
    lua_State *cbL = mb_handle_push_cb(h, CB_EVENT);
    if (!cbL) return;
    lua_pushnil(cbL);
    push_event(cbL, ev);
    mb_call(h->core, cbL, 3);
  }
}

/* core.fs_event([owner_uid]) -> handle. With owner_uid (a root runtime
 * only), the inotify instance and its watches count against that uid's
 * fs.inotify limits instead of the runtime's. */
static int fs_event_new(lua_State *L) {
  lua_Integer owner = luaL_optinteger(L, 1, 0);
  if (owner < 0 || owner >= (lua_Integer)UINT32_MAX || (owner && geteuid() != 0))
    return luaL_error(L, "fs_event: owner_uid needs a runtime that is root and an id below 2^32-1");
  mb_handle *h = mb_handle_new(L, FS_EVENT, sizeof(fsev_state));
  ((fsev_state *)h->extra)->ifd = -1;
  ((fsev_state *)h->extra)->owner = (uid_t)owner;
  uv_pipe_init(h->core->loop, &h->uv.pipe, 0);
  return 1;
}

/* Create the inotify instance on first use. Returns 0 or pushes an error (3). */
static int ensure_inotify(lua_State *L, mb_handle *h) {
  fsev_state *st = (fsev_state *)h->extra;
  if (st->ifd >= 0) return 0;
  /* charged to the sandbox's owner id, not the runtime's user (owner.c) */
  if (mb_owner_enter(st->owner) < 0) return mb_push_errno(L, errno, "inotify_init1 as the sandbox's owner id");
  int ifd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
  int err = errno;
  mb_owner_leave(st->owner);
  if (ifd < 0) return mb_push_errno(L, err, "inotify_init1");
  int rc = uv_pipe_open(&h->uv.pipe, ifd);
  if (rc < 0) {
    close(ifd);
    return mb_push_error(L, rc, "inotify fd");
  }
  st->ifd = ifd;
  return 0;
}

/* Add a watch for the target at idx: a path, or a directory fd at idx and a
 * relative path at idx + 1 (confined). Pushes wd (1) or an error (3); *used
 * is the number of arguments the target took. */
static int add_watch(lua_State *L, mb_handle *h, int idx, int *used) {
  int n = ensure_inotify(L, h);
  if (n) return n;
  fsev_state *st = (fsev_state *)h->extra;
  int wd, err;
  if (lua_type(L, idx) == LUA_TNUMBER || lua_type(L, idx) == LUA_TUSERDATA) {
    const char *rel = luaL_checkstring(L, idx + 1);
    *used = 2;
    long fd = mb_fs_root_open_path(L, idx, rel);
    if (fd < 0) {
      err = errno;
      lua_pushnil(L);
      if (err == EXDEV) lua_pushfstring(L, "EXDEV: path resolves outside the root ('%s', resolve=beneath)", rel);
      else
        lua_pushfstring(L, "%s: %s (openat2 '%s')", uv_err_name(uv_translate_sys_error(err)),
                        uv_strerror(uv_translate_sys_error(err)), rel);
      lua_pushstring(L, uv_err_name(uv_translate_sys_error(err)));
      return 3;
    }
    char proc[64];
    snprintf(proc, sizeof(proc), "/proc/self/fd/%ld", fd);
    wd = inotify_add_watch(st->ifd, proc, WATCH_MASK);
    err = errno;
    close((int)fd);
    if (wd < 0) {
      lua_pushfstring(L, "inotify_add_watch '%s'", rel);
      return mb_push_errno(L, err, lua_tostring(L, -1));
    }
  } else {
    const char *path = luaL_checkstring(L, idx);
    *used = 1;
    wd = inotify_add_watch(st->ifd, path, WATCH_MASK);
    if (wd < 0) {
      err = errno;
      lua_pushfstring(L, "inotify_add_watch '%s'", path);
      return mb_push_errno(L, err, lua_tostring(L, -1));
    }
  }
  lua_pushinteger(L, wd);
  return 1;
}

/* handle:start(path, callback) or handle:start(dirfd, relpath, callback) -> wd */
static int fs_event_start(lua_State *L) {
  mb_handle *h = mb_handle_check(L, 1, FS_EVENT);
  int cb_idx = lua_type(L, 2) == LUA_TNUMBER || lua_type(L, 2) == LUA_TUSERDATA ? 4 : 3;
  luaL_checktype(L, cb_idx, LUA_TFUNCTION);
  if (uv_is_active(&h->uv.handle)) return luaL_error(L, "fs_event is already started (use add for more paths)");
  int used;
  int n = add_watch(L, h, 2, &used);
  if (n != 1) return n;
  mb_handle_set_cb(L, h, CB_EVENT, cb_idx);
  int rc = uv_read_start(&h->uv.stream, on_alloc, on_read);
  if (rc < 0) return mb_push_error(L, rc, "inotify read");
  return 1;
}

/* handle:add(path) or handle:add(dirfd, relpath) -> wd */
static int fs_event_add(lua_State *L) {
  mb_handle *h = mb_handle_check(L, 1, FS_EVENT);
  int used;
  return add_watch(L, h, 2, &used);
}

/* handle:remove(wd) -> true */
static int fs_event_remove(lua_State *L) {
  mb_handle *h = mb_handle_check(L, 1, FS_EVENT);
  int wd = (int)luaL_checkinteger(L, 2);
  fsev_state *st = (fsev_state *)h->extra;
  if (st->ifd < 0 || inotify_rm_watch(st->ifd, wd) < 0)
    return mb_push_errno(L, st->ifd < 0 ? EINVAL : errno, "inotify_rm_watch");
  lua_pushboolean(L, 1);
  return 1;
}

static int fs_event_stop(lua_State *L) {
  mb_handle *h = mb_handle_check(L, 1, FS_EVENT);
  uv_read_stop(&h->uv.stream);
  return 0;
}

static const luaL_Reg fs_event_methods[] = {
  {"start", fs_event_start}, {"add", fs_event_add}, {"remove", fs_event_remove}, {"stop", fs_event_stop}, {NULL, NULL}};

void mb_open_fsevent(lua_State *L) {
  mb_new_class(L, FS_EVENT, fs_event_methods);
  lua_pushcfunction(L, fs_event_new);
  lua_setfield(L, -2, "fs_event");
}
