/* fs: files and directories.
 *
 * Two groups of functions, registered on the module table as fs_*:
 *
 * 1. Asynchronous operations on libuv's thread pool (uv_fs_*). Each takes a
 *    final callback, called exactly once on the core's callback thread:
 *      success: cb(nil, result)
 *      failure: cb("CODE: message (op 'path')", nil, "CODE")
 *    The call itself returns true once the request is queued; if libuv
 *    refuses it outright it returns nil, message, CODE and the callback is
 *    never called. Misuse (wrong argument types, bad flag strings) raises.
 *
 * 2. Root-confined resolution through openat2(2) (Linux >= 5.6): paths are
 *    resolved relative to a root directory (an fd from fs_open_dir, or a
 *    path) with RESOLVE_BENEATH ("beneath": any escape fails with EXDEV) or
 *    RESOLVE_IN_ROOT ("in_root": "/" and ".." are clamped to the root, like
 *    chroot), always plus RESOLVE_NO_MAGICLINKS. An escape is reported as
 *    nil, "EXDEV: path resolves outside the root (...)", "EXDEV".
 *    fs_open_beneath, fs_mkdir/unlink/rmdir/rename/stat/where_beneath are
 *    asynchronous (uv_queue_work) when given a callback and synchronous
 *    otherwise (result | nil, message, CODE); fs_scandir_beneath and
 *    fs_open_dir are synchronous.
 *    The mutating helpers open the PARENT directory confined (O_PATH) and act
 *    on the final component with mkdirat/unlinkat/renameat, which never
 *    follow a final symlink, so nothing outside the root is touched.
 *    In place of a root, a confinement (core.fs_confine, below) adds a rule
 *    the kernel's answer must meet: every fd on one of a set of mounts, and
 *    the calls made with given credentials (the sandbox file API's).
 */
#include "openat2.h"
#include "private.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/fsuid.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#ifndef STATX_MNT_ID
#define STATX_MNT_ID 0x00001000U
#endif
#ifndef STATX_MNT_ID_UNIQUE
#define STATX_MNT_ID_UNIQUE 0x00004000U
#endif

/* ---- shared helpers ------------------------------------------------------ */

/* "r" "r+" "w" "w+" "a" "a+", each optionally with "x" (O_EXCL), or an
 * integer of O_* flags. O_CLOEXEC is always added. */
static int check_flags(lua_State *L, int idx) {
  if (lua_isnoneornil(L, idx)) return O_RDONLY | O_CLOEXEC;
  if (lua_type(L, idx) == LUA_TNUMBER) return (int)lua_tointeger(L, idx) | O_CLOEXEC;
  const char *s = luaL_checkstring(L, idx);
  int flags;
  switch (s[0]) {
  case 'r': flags = O_RDONLY; break;
  case 'w': flags = O_WRONLY | O_CREAT | O_TRUNC; break;
  case 'a': flags = O_WRONLY | O_CREAT | O_APPEND; break;
  default: return luaL_argerror(L, idx, "flags must be r, r+, w, w+, a, a+ (optionally with x) or an integer");
  }
  int plus = 0, excl = 0;
  for (const char *p = s + 1; *p; p++) {
    if (*p == '+' && !plus) plus = 1;
    else if (*p == 'x' && !excl && s[0] != 'r') excl = 1;
    else return luaL_argerror(L, idx, "flags must be r, r+, w, w+, a, a+ (optionally with x) or an integer");
  }
  if (plus) flags = (flags & ~O_WRONLY) | O_RDWR;
  if (excl) flags |= O_EXCL;
  return flags | O_CLOEXEC;
}

static int check_mode(lua_State *L, int idx, int def) {
  if (lua_isnoneornil(L, idx)) return def;
  lua_Integer m = luaL_checkinteger(L, idx);
  if (m < 0 || m > 07777) luaL_argerror(L, idx, "mode must be between 0 and 07777");
  return (int)m;
}

static int check_fd(lua_State *L, int idx) {
  lua_Integer fd = luaL_checkinteger(L, idx);
  if (fd < 0 || fd > 0x7fffffff) luaL_argerror(L, idx, "fd must be >= 0");
  return (int)fd;
}

static const char *type_name(unsigned long mode) {
  switch (mode & S_IFMT) {
  case S_IFREG: return "file";
  case S_IFDIR: return "directory";
  case S_IFLNK: return "symlink";
  default: return "other";
  }
}

#define SET_NUM(L, key, v) (lua_pushnumber(L, (lua_Number)(v)), lua_setfield(L, -2, key))
#define TIMESPEC(ts) ((double)(ts).tv_sec + (double)(ts).tv_nsec / 1e9)

/* The stat table of a uv_stat_t or a struct stat (the same field names). */
#define PUSH_STAT(L, st)                                                                                               \
  do {                                                                                                                 \
    lua_createtable(L, 0, 11);                                                                                         \
    lua_pushstring(L, type_name((unsigned long)(st)->st_mode));                                                        \
    lua_setfield(L, -2, "type");                                                                                       \
    SET_NUM(L, "size", (st)->st_size);                                                                                 \
    SET_NUM(L, "mode", (st)->st_mode & 07777);                                                                         \
    SET_NUM(L, "uid", (st)->st_uid);                                                                                   \
    SET_NUM(L, "gid", (st)->st_gid);                                                                                   \
    SET_NUM(L, "mtime", TIMESPEC((st)->st_mtim));                                                                      \
    SET_NUM(L, "atime", TIMESPEC((st)->st_atim));                                                                      \
    SET_NUM(L, "ctime", TIMESPEC((st)->st_ctim));                                                                      \
    SET_NUM(L, "ino", (st)->st_ino);                                                                                   \
    SET_NUM(L, "dev", (st)->st_dev);                                                                                   \
    SET_NUM(L, "nlink", (st)->st_nlink);                                                                               \
    SET_NUM(L, "blocks", (st)->st_blocks); /* 512-byte units allocated: what a sparse file really holds */             \
  } while (0)

static void push_uv_stat(lua_State *L, const uv_stat_t *st) { PUSH_STAT(L, st); }

static void push_sys_stat(lua_State *L, const struct stat *st) { PUSH_STAT(L, st); }

static void push_entry(lua_State *L, int i, const char *name, const char *type) {
  lua_createtable(L, 0, 2);
  lua_pushstring(L, name);
  lua_setfield(L, -2, "name");
  lua_pushstring(L, type);
  lua_setfield(L, -2, "type");
  lua_rawseti(L, -2, i);
}

/* ---- asynchronous operations (uv_fs_*) ----------------------------------- */

typedef struct fs_req fs_req;
typedef void (*push_fn)(lua_State *L, fs_req *fr);

struct fs_req {
  uv_fs_t req;
  mb_core *core;
  int cb_ref;
  int data_ref; /* the string being written, alive until completion */
  char *buf;    /* read buffer */
  push_fn push; /* pushes the one result value on success */
  const char *op;
  int fd; /* for error messages of fd operations, -1 otherwise */
};

static void push_result_int(lua_State *L, fs_req *fr) { lua_pushinteger(L, (lua_Integer)fr->req.result); }

static void push_result_true(lua_State *L, fs_req *fr) {
  (void)fr;
  lua_pushboolean(L, 1);
}

static void push_result_read(lua_State *L, fs_req *fr) { lua_pushlstring(L, fr->buf, (size_t)fr->req.result); }

static void push_result_stat(lua_State *L, fs_req *fr) { push_uv_stat(L, &fr->req.statbuf); }

static void push_result_ptr(lua_State *L, fs_req *fr) { lua_pushstring(L, (const char *)fr->req.ptr); }

static const char *dirent_type(uv_dirent_type_t t) {
  switch (t) {
  case UV_DIRENT_FILE: return "file";
  case UV_DIRENT_DIR: return "directory";
  case UV_DIRENT_LINK: return "symlink";
  case UV_DIRENT_UNKNOWN: return "unknown";
  default: return "other";
  }
}

static void push_result_scandir(lua_State *L, fs_req *fr) {
  uv_dirent_t ent;
  int i = 0;
  lua_newtable(L);
  while (uv_fs_scandir_next(&fr->req, &ent) != UV_EOF) push_entry(L, ++i, ent.name, dirent_type(ent.type));
}

/* The error message for a failed request: "CODE: strerror (op 'path')". */
static void push_req_errmsg(lua_State *L, fs_req *fr, int err) {
  const char *name = uv_err_name(err), *msg = uv_strerror(err);
  const char *path = fr->req.path, *new_path = fr->req.new_path;
  if (path && new_path) lua_pushfstring(L, "%s: %s (%s '%s' -> '%s')", name, msg, fr->op, path, new_path);
  else if (path) lua_pushfstring(L, "%s: %s (%s '%s')", name, msg, fr->op, path);
  else lua_pushfstring(L, "%s: %s (%s fd %d)", name, msg, fr->op, fr->fd);
}

static void fs_req_free(fs_req *fr) {
  uv_fs_req_cleanup(&fr->req);
  free(fr->buf);
  free(fr);
}

static void on_fs(uv_fs_t *req) {
  fs_req *fr = (fs_req *)req->data;
  mb_core *core = fr->core;
  if (core->dead) { /* the Lua state is going away: no callbacks, no leaks */
    if (req->fs_type == UV_FS_OPEN && req->result >= 0) close((int)req->result);
    fs_req_free(fr);
    return;
  }
  lua_State *cbL = core->cbL;
  lua_rawgeti(cbL, LUA_REGISTRYINDEX, fr->cb_ref);
  luaL_unref(cbL, LUA_REGISTRYINDEX, fr->cb_ref);
  luaL_unref(cbL, LUA_REGISTRYINDEX, fr->data_ref);
  int nargs;
  if (req->result < 0) {
    int err = (int)req->result;
    push_req_errmsg(cbL, fr, err);
    lua_pushnil(cbL);
    lua_pushstring(cbL, uv_err_name(err));
    nargs = 3;
  } else {
    lua_pushnil(cbL);
    fr->push(cbL, fr);
    nargs = 2;
  }
  fs_req_free(fr);
  mb_call(core, cbL, nargs);
}

/* Allocate a request for an operation whose callback is at cb_idx. All
 * argument checks must be done before this (they may raise). */
static fs_req *req_new(lua_State *L, int cb_idx, const char *op, push_fn push) {
  mb_core *core = mb_core_get(L);
  luaL_checktype(L, cb_idx, LUA_TFUNCTION);
  fs_req *fr = (fs_req *)calloc(1, sizeof(fs_req));
  if (!fr) {
    luaL_error(L, "out of memory");
    return NULL;
  }
  fr->core = core;
  fr->req.data = fr;
  fr->push = push;
  fr->op = op;
  fr->fd = -1;
  fr->data_ref = LUA_NOREF;
  lua_pushvalue(L, cb_idx);
  fr->cb_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  return fr;
}

/* After uv_fs_*: true when queued, else undo and return nil, message, CODE. */
static int req_submitted(lua_State *L, fs_req *fr, int rc) {
  if (rc < 0) {
    luaL_unref(L, LUA_REGISTRYINDEX, fr->cb_ref);
    luaL_unref(L, LUA_REGISTRYINDEX, fr->data_ref);
    fs_req_free(fr);
    return mb_push_error(L, rc, NULL);
  }
  lua_pushboolean(L, 1);
  return 1;
}

#define LOOP(fr) ((fr)->core->loop)

/* Queues uv_fs_<func>(loop, &fr->req, args..., on_fs) and returns what the
 * binding returns: true, or nil, message, CODE (after luv's FS_CALL). */
#define FS_CALL(L, fr, func, ...) req_submitted(L, fr, uv_fs_##func(LOOP(fr), &(fr)->req, __VA_ARGS__, on_fs))

/* core.fs_<func>(path, cb): a request on a path alone, named func. */
#define FS_PATH_OP(func, push)                                                                                         \
  static int fs_##func(lua_State *L) {                                                                                 \
    const char *path = luaL_checkstring(L, 1);                                                                         \
    fs_req *fr = req_new(L, 2, #func, push);                                                                           \
    return FS_CALL(L, fr, func, path);                                                                                 \
  }

/* core.fs_<func>(fd, cb): a request on an fd alone, named func. */
#define FS_FD_OP(func, push)                                                                                           \
  static int fs_##func(lua_State *L) {                                                                                 \
    int fd = check_fd(L, 1);                                                                                           \
    fs_req *fr = req_new(L, 2, #func, push);                                                                           \
    fr->fd = fd;                                                                                                       \
    return FS_CALL(L, fr, func, fd);                                                                                   \
  }

/* core.fs_open(path, flags, mode, cb) -> cb(nil, fd) */
static int fs_open(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  int flags = check_flags(L, 2);
  int mode = check_mode(L, 3, 0666);
  fs_req *fr = req_new(L, 4, "open", push_result_int);
  return FS_CALL(L, fr, open, path, flags, mode);
}

/* core.fs_read(fd, size, offset, cb) -> cb(nil, data); "" at EOF; offset nil/-1: current position */
static int fs_read(lua_State *L) {
  int fd = check_fd(L, 1);
  lua_Integer size = luaL_checkinteger(L, 2);
  int64_t offset = (int64_t)luaL_optinteger(L, 3, -1);
  if (size < 0 || size > 0x7fffffff) return luaL_argerror(L, 2, "size must be between 0 and 2^31-1");
  if (offset < -1) return luaL_argerror(L, 3, "offset must be >= 0 (or -1 for the current position)");
  fs_req *fr = req_new(L, 4, "read", push_result_read);
  fr->fd = fd;
  fr->buf = (char *)malloc(size ? (size_t)size : 1);
  if (!fr->buf) {
    luaL_unref(L, LUA_REGISTRYINDEX, fr->cb_ref);
    fs_req_free(fr);
    return mb_push_error(L, UV_ENOMEM, "read buffer");
  }
  uv_buf_t buf = uv_buf_init(fr->buf, (unsigned int)size);
  return FS_CALL(L, fr, read, fd, &buf, 1, offset);
}

/* core.fs_write(fd, data, offset, cb) -> cb(nil, bytes_written) */
static int fs_write(lua_State *L) {
  int fd = check_fd(L, 1);
  size_t len;
  const char *data = luaL_checklstring(L, 2, &len);
  int64_t offset = (int64_t)luaL_optinteger(L, 3, -1);
  if (offset < -1) return luaL_argerror(L, 3, "offset must be >= 0 (or -1 for the current position)");
  if (len > 0x7fffffff) return luaL_argerror(L, 2, "data is too large for one write");
  fs_req *fr = req_new(L, 4, "write", push_result_int);
  fr->fd = fd;
  lua_pushvalue(L, 2);
  fr->data_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  uv_buf_t buf = uv_buf_init((char *)data, (unsigned int)len);
  return FS_CALL(L, fr, write, fd, &buf, 1, offset);
}

/* core.fs_close(fd, cb) -> cb(nil, true) */
FS_FD_OP(close, push_result_true)

/* core.fs_stat(path, cb) / fs_lstat(path, cb) / fs_fstat(fd, cb) -> cb(nil, stat table) */
FS_PATH_OP(stat, push_result_stat)
FS_PATH_OP(lstat, push_result_stat)
FS_FD_OP(fstat, push_result_stat)

/* core.fs_mkdir(path, mode, cb) -> cb(nil, true); mode nil: 0777 (before umask) */
static int fs_mkdir(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  int mode = check_mode(L, 2, 0777);
  fs_req *fr = req_new(L, 3, "mkdir", push_result_true);
  return FS_CALL(L, fr, mkdir, path, mode);
}

/* core.fs_rmdir(path, cb) / fs_unlink(path, cb) -> cb(nil, true) */
FS_PATH_OP(rmdir, push_result_true)
FS_PATH_OP(unlink, push_result_true)

/* core.fs_rename(old, new, cb) -> cb(nil, true) */
static int fs_rename(lua_State *L) {
  const char *from = luaL_checkstring(L, 1);
  const char *to = luaL_checkstring(L, 2);
  fs_req *fr = req_new(L, 3, "rename", push_result_true);
  return FS_CALL(L, fr, rename, from, to);
}

/* core.fs_scandir(path, cb) -> cb(nil, {{name=, type=}, ...}) unsorted, without . and ..;
 * type is file|directory|symlink|other, or unknown when the filesystem does not say */
static int fs_scandir(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  fs_req *fr = req_new(L, 2, "scandir", push_result_scandir);
  return FS_CALL(L, fr, scandir, path, 0);
}

/* core.fs_scandir_batched(path, cb) -> cb(nil, dirlist): the same listing
 * (read, and in libuv sorted, on the thread pool), handed over without
 * building a table per entry at once: dirlist:next(n) returns the next n or
 * fewer entries as {{name=, type=}, ...}, or nil once all were returned;
 * dirlist:close() (or collection) frees the rest. A directory of 300k entries
 * then costs the loop a bounded slice per call instead of one long stall. */
#define DIRLIST "moonbox.dirlist"

typedef struct {
  uv_fs_t req; /* a completed scandir request; its entries are ours */
  int open;
} dirlist;

static void dirlist_drain(dirlist *dl) {
  uv_dirent_t ent;
  if (!dl->open) return;
  dl->open = 0;
  while (uv_fs_scandir_next(&dl->req, &ent) != UV_EOF) {} /* frees as it goes */
}

static void push_result_dirlist(lua_State *L, fs_req *fr) {
  dirlist *dl = (dirlist *)lua_newuserdata(L, sizeof *dl);
  memcpy(&dl->req, &fr->req, sizeof dl->req);
  dl->req.path = NULL; /* the path stays fr's, freed with it */
  fr->req.ptr = NULL;  /* the entries move to dl: fr's cleanup leaves them */
  dl->open = 1;
  luaL_getmetatable(L, DIRLIST);
  lua_setmetatable(L, -2);
}

static int fs_scandir_batched(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  fs_req *fr = req_new(L, 2, "scandir", push_result_dirlist);
  return FS_CALL(L, fr, scandir, path, 0);
}

static int dirlist_next(lua_State *L) {
  dirlist *dl = (dirlist *)luaL_checkudata(L, 1, DIRLIST);
  lua_Integer n = luaL_checkinteger(L, 2);
  if (n < 1) return luaL_argerror(L, 2, "count must be >= 1");
  if (!dl->open) return 0;
  uv_dirent_t ent;
  int i = 0;
  lua_newtable(L);
  while (i < n) {
    if (uv_fs_scandir_next(&dl->req, &ent) == UV_EOF) {
      dl->open = 0;
      break;
    }
    push_entry(L, ++i, ent.name, dirent_type(ent.type));
  }
  if (i == 0) return 0;
  return 1;
}

static int dirlist_close(lua_State *L) {
  dirlist_drain((dirlist *)luaL_checkudata(L, 1, DIRLIST));
  return 0;
}

/* core.fs_readlink(path, cb) -> cb(nil, target) */
FS_PATH_OP(readlink, push_result_ptr)

/* core.fs_realpath(path, cb) -> cb(nil, absolute canonical path) */
FS_PATH_OP(realpath, push_result_ptr)

/* core.fs_chmod(path, mode, cb) -> cb(nil, true) */
static int fs_chmod(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  luaL_checkinteger(L, 2);
  int mode = check_mode(L, 2, 0);
  fs_req *fr = req_new(L, 3, "chmod", push_result_true);
  return FS_CALL(L, fr, chmod, path, mode);
}

/* core.fs_utime(path, atime, mtime, cb) -> cb(nil, true); times in seconds (float) */
static int fs_utime(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  double atime = (double)luaL_checknumber(L, 2);
  double mtime = (double)luaL_checknumber(L, 3);
  fs_req *fr = req_new(L, 4, "utime", push_result_true);
  return FS_CALL(L, fr, utime, path, atime, mtime);
}

/* ---- root-confined resolution (openat2) ---------------------------------- */

static unsigned long long check_resolve(lua_State *L, int idx, const char **name) {
  int which = luaL_checkoption(L, idx, "beneath", mb_resolve_names);
  *name = mb_resolve_names[which];
  return mb_resolve_bits(which);
}

/* ---- confinement ---------------------------------------------------------
 *
 * core.fs_confine(root, allowed, creds, resolve) -> confinement (userdata): the root
 * (a directory path or fd) held open as an O_PATH fd for the confinement's
 * life, and what every fd obtained through it must satisfy:
 *   allowed  nil, or a list of paths relative to the root (resolved in the
 *            root now, once): the mounts they lie on are the only ones an fd
 *            may end up on. Their mount ids (statx STATX_MNT_ID_UNIQUE, or
 *            STATX_MNT_ID before Linux 6.8) are recorded. A unique id is
 *            never given to another mount; with the older, reusable ids an
 *            O_PATH fd of each mount is kept, so an id cannot be freed and
 *            given to a new mount while the confinement lives (fds a
 *            runtime of thousands of sandboxes is short of). A path on the root's own mount, or
 *            one that cannot be opened, allows nothing; "." itself allows
 *            the root's own mount (an image's writable root). After every openat2
 *            the resulting fd's mount id is checked: any other mount (/proc,
 *            /dev, a mount made later inside) closes it and fails with EXDEV
 *            ("path resolves outside the root"), like an escape.
 *   creds    nil, or {uid =, gid =}: the opens, mkdirat, unlinkat and
 *            renameat run with that fsuid/fsgid (setfsuid/setfsgid, per
 *            thread, restored afterwards), so objects are created owned by
 *            them and permission checks are theirs (a non-zero fsuid drops
 *            the fs capabilities). A switch the kernel refuses fails the
 *            call with EPERM.
 *   resolve  the default resolve mode of the *_beneath helpers given this
 *            confinement ("beneath" unless the fourth argument says "in_root").
 * Every *_beneath helper and fs_event's add/start accept a confinement where
 * they take a root. confinement:close() releases the fds (also on GC). */

#define FS_CONFINE "moonbox.fs_confine"
#define CONFINE_MAX 256

/* A root fd two confinements hold (core.fs_confine given a confinement):
 * closed by the last of them. */
typedef struct {
  int fd;
  int refs;
} shared_root;

typedef struct {
  int root;            /* O_PATH fd of the root; -1 once closed */
  shared_root *shared; /* NULL: root is this confinement's own */
  unsigned mnt_mask;   /* STATX_MNT_ID(_UNIQUE); 0: no mount check */
  int nallowed;
  int allowed_fd[CONFINE_MAX];
  unsigned long long mnt[CONFINE_MAX];
  int creds;
  uid_t uid;
  gid_t gid;
  unsigned long long resolve;
  const char *resolve_name;
} fs_confine;

/* What a check needs, copied (a request on the thread pool must not depend
 * on the userdata staying alive). */
typedef struct {
  unsigned mnt_mask;
  int nallowed;
  unsigned long long mnt[CONFINE_MAX];
  int creds;
  uid_t uid;
  gid_t gid;
} confine_rules;

static void rules_of(const fs_confine *c, confine_rules *r) {
  memset(r, 0, sizeof *r);
  if (!c) return;
  r->mnt_mask = c->mnt_mask;
  r->nallowed = c->nallowed;
  memcpy(r->mnt, c->mnt, sizeof r->mnt);
  r->creds = c->creds;
  r->uid = c->uid;
  r->gid = c->gid;
}

static int fd_mnt_id(int fd, unsigned mask, unsigned long long *id) {
  struct statx stx;
  if (statx(fd, "", AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW, mask, &stx) < 0) return -1;
  if (!(stx.stx_mask & mask)) {
    errno = EOPNOTSUPP;
    return -1;
  }
  *id = (unsigned long long)stx.stx_mnt_id;
  return 0;
}

/* 0 when fd lies on an allowed mount (or there is no mount rule), else -1
 * with errno EXDEV (or statx's error: fail closed). */
static int rules_check(const confine_rules *r, int fd) {
  if (!r || !r->mnt_mask) return 0;
  unsigned long long id;
  if (fd_mnt_id(fd, r->mnt_mask, &id) < 0) return -1;
  for (int i = 0; i < r->nallowed; i++)
    if (r->mnt[i] == id) return 0;
  errno = EXDEV;
  return -1;
}

typedef struct {
  int active;
  uid_t uid;
  gid_t gid;
} saved_creds;

/* Switch this thread's fsuid/fsgid to the rules' ids. -1 with EPERM when the
 * kernel does not take them (setfsuid reports failure only by not changing,
 * and returns the id before the call: each id costs a set and a read-back,
 * four system calls in all, as this runs around every confined file
 * operation of the exec path). */
static int creds_enter(const confine_rules *r, saved_creds *s) {
  s->active = 0;
  if (!r || !r->creds) return 0;
  s->gid = (gid_t)setfsgid(r->gid);
  if ((gid_t)setfsgid((gid_t)-1) != r->gid) {
    setfsgid(s->gid);
    errno = EPERM;
    return -1;
  }
  s->uid = (uid_t)setfsuid(r->uid);
  if ((uid_t)setfsuid((uid_t)-1) != r->uid) {
    setfsuid(s->uid);
    setfsgid(s->gid);
    errno = EPERM;
    return -1;
  }
  s->active = 1;
  return 0;
}

static void creds_leave(saved_creds *s) {
  if (!s->active) return;
  int err = errno;
  setfsuid(s->uid);
  setfsgid(s->gid);
  errno = err;
  s->active = 0;
}

#ifndef PROC_SUPER_MAGIC
#define PROC_SUPER_MAGIC 0x9fa0
#endif

/* Whether resolving path from dirfd (as openat2 with resolve would) meets a
 * symlink that lives on procfs: a magic link (/proc/<pid>/root, fd/N, ...),
 * which resolve refuses with ELOOP, as it refuses a symlink loop. It tells
 * the two apart for the caller's error (a jump out of the tree is outside
 * the sandbox). Only O_PATH opens of the link chain's prefixes, under the
 * same resolve flags; symlinks are followed by hand, at most 40 hops. */
static int meets_proc_link(int dirfd, const char *path, unsigned long long resolve) {
  char cur[PATH_MAX], prefix[PATH_MAX], target[PATH_MAX], next[PATH_MAX];
  size_t len = strlen(path);
  if (len >= sizeof cur) return 0;
  memcpy(cur, path, len + 1);
  for (int hop = 0; hop < 40; hop++) {
    len = strlen(cur);
    int link_at = -1; /* the end of the first prefix that is a symlink */
    for (size_t end = 1; end <= len && link_at < 0; end++) {
      if (end < len && cur[end] != '/') continue;
      if (cur[end - 1] == '/') continue;
      memcpy(prefix, cur, end);
      prefix[end] = 0;
      int fd = mb_openat2(dirfd, prefix, O_PATH | O_NOFOLLOW | O_CLOEXEC, 0, resolve);
      if (fd < 0) return 0;
      struct stat st;
      struct statfs sfs;
      int is_link = fstatat(fd, "", &st, AT_EMPTY_PATH) == 0 && S_ISLNK(st.st_mode);
      if (is_link && fstatfs(fd, &sfs) == 0 && sfs.f_type == PROC_SUPER_MAGIC) {
        close(fd);
        return 1;
      }
      ssize_t n = is_link ? readlinkat(fd, "", target, sizeof target - 1) : -1;
      close(fd);
      if (!is_link) continue;
      if (n <= 0) return 0;
      target[n] = 0;
      link_at = (int)end;
    }
    if (link_at < 0) return 0; /* no symlink on the way: the ELOOP was something else */
    /* the link's target in its place: from the top if absolute, else next to it */
    const char *rest = cur + link_at;
    size_t dir_len = (size_t)link_at;
    while (dir_len > 0 && cur[dir_len - 1] != '/') dir_len--;
    int w = target[0] == '/' ? snprintf(next, sizeof next, "%s%s", target, rest)
                             : snprintf(next, sizeof next, "%.*s%s%s", (int)dir_len, cur, target, rest);
    if (w < 0 || (size_t)w >= sizeof next) return 0;
    memcpy(cur, next, (size_t)w + 1);
  }
  return 0;
}

/* openat2 under the rules: with their credentials, and the fd kept only when
 * it lies on an allowed mount. Under any rules, a non-O_PATH open is made
 * O_NONBLOCK | O_NOCTTY (a fifo or a tty swapped in must not block the
 * thread or become the runtime's terminal: an unisolated sandbox's too),
 * and O_NONBLOCK is cleared again afterwards unless asked for. */
static int rules_openat2(const confine_rules *r, int dirfd, const char *path, unsigned long long flags,
                         unsigned long long mode, unsigned long long resolve) {
  unsigned long long extra = 0;
  if (r && !(flags & O_PATH)) extra = (O_NONBLOCK | O_NOCTTY) & ~flags;
  saved_creds s;
  if (creds_enter(r, &s) < 0) return -1;
  int fd = mb_openat2(dirfd, path, flags | extra, mode, resolve);
  if (fd < 0 && r && r->mnt_mask && !(flags & O_PATH) && (errno == EACCES || errno == EPERM || errno == EROFS)) {
    /* Refused where it leads: if that is outside the allowed mounts, say
     * so (EXDEV), as a path that opens would; a permission error would
     * tell the caller what exists out there. An O_PATH open needs no
     * permission on the file itself and is only looked at. */
    int err = errno;
    int probe = mb_openat2(dirfd, path, O_PATH | O_CLOEXEC | (flags & O_NOFOLLOW), 0, resolve);
    if (probe >= 0) {
      if (rules_check(r, probe) < 0 && errno == EXDEV) err = EXDEV;
      close(probe);
    }
    errno = err;
  }
  if (fd < 0 && errno == ELOOP && r && r->mnt_mask && !(resolve & RESOLVE_NO_SYMLINKS) &&
      meets_proc_link(dirfd, path, resolve))
    errno = EXDEV; /* through a magic link: out of the tree, never followed */
  creds_leave(&s);
  if (fd < 0) return -1;
  if (rules_check(r, fd) < 0) {
    int err = errno;
    close(fd);
    errno = err;
    return -1;
  }
  if ((extra & O_NONBLOCK) && fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) < 0) {
    int err = errno;
    close(fd);
    errno = err;
    return -1;
  }
  return fd;
}

/* rules_openat2 for an open that may change what it opens (O_CREAT,
 * O_TRUNC), with no effect on any mount but an allowed one: an existing
 * file is opened without O_CREAT/O_TRUNC, checked, and only then truncated
 * (ftruncate); a missing one is created by an openat2 of the final name
 * relative to the checked parent that may neither cross a mount nor follow
 * a symlink. A final symlink met there is followed by hand (readlinkat; at
 * most 8 hops), each hop checked the same way. Without a mount rule this is
 * rules_openat2. */
static int rules_open_file(const confine_rules *r, int root, const char *rel, unsigned long long flags,
                           unsigned long long mode, unsigned long long resolve) {
  if (!r || !r->mnt_mask || !(flags & (O_CREAT | O_TRUNC))) return rules_openat2(r, root, rel, flags, mode, resolve);
  unsigned long long base = flags & ~(unsigned long long)(O_CREAT | O_TRUNC | O_EXCL);
  int excl = (flags & O_EXCL) != 0, creat = (flags & O_CREAT) != 0;
  char path[PATH_MAX], link[PATH_MAX];
  size_t len = strlen(rel);
  if (len >= sizeof path) {
    errno = ENAMETOOLONG;
    return -1;
  }
  memcpy(path, rel, len + 1);
  for (int hop = 0; hop < 8; hop++) {
    int fd;
    if (!excl) {
      fd = rules_openat2(r, root, path, base, 0, resolve);
      if (fd >= 0) {
        if ((flags & O_TRUNC) && ftruncate(fd, 0) < 0) {
          int err = errno;
          close(fd);
          errno = err;
          return -1;
        }
        return fd;
      }
      if (errno != ENOENT || !creat) return -1;
    }
    /* split into parent and final name (trailing slashes dropped) */
    len = strlen(path);
    while (len > 1 && path[len - 1] == '/') path[--len] = 0;
    char *slash = strrchr(path, '/');
    const char *parent = ".", *name = path;
    if (slash) {
      *slash = 0;
      parent = slash == path ? "/" : path;
      name = slash + 1;
    }
    if (!*name || !strcmp(name, ".") || !strcmp(name, "..")) {
      errno = *name ? EISDIR : ENOENT;
      return -1;
    }
    int pfd = rules_openat2(r, root, parent, O_PATH | O_DIRECTORY | O_CLOEXEC, 0, resolve);
    if (pfd < 0) return -1;
    fd = rules_openat2(r, pfd, name, flags, mode,
                       RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV | RESOLVE_NO_SYMLINKS);
    if (fd >= 0 || errno != ELOOP) {
      int err = errno;
      close(pfd);
      errno = err;
      return fd;
    }
    if (excl) {
      close(pfd);
      errno = EEXIST;
      return -1;
    }
    ssize_t n = readlinkat(pfd, name, link, sizeof link - 1);
    int err = errno;
    close(pfd);
    if (n < 0) {
      errno = err;
      return -1;
    }
    link[n] = 0;
    /* the link's target: from the root if absolute (in_root), else next to it */
    char next[PATH_MAX];
    int w = link[0] == '/' ? snprintf(next, sizeof next, "%s", link)
                           : snprintf(next, sizeof next, "%s/%s", slash ? parent : ".", link);
    if (w < 0 || (size_t)w >= sizeof next) {
      errno = ENAMETOOLONG;
      return -1;
    }
    memcpy(path, next, (size_t)w + 1);
  }
  errno = ELOOP;
  return -1;
}

static fs_confine *confine_test(lua_State *L, int idx) {
  void *p = lua_touserdata(L, idx);
  if (!p || !lua_getmetatable(L, idx)) return NULL;
  luaL_getmetatable(L, FS_CONFINE);
  int same = lua_rawequal(L, -1, -2);
  lua_pop(L, 2);
  return same ? (fs_confine *)p : NULL;
}

static void confine_release(fs_confine *c) {
  if (c->shared) {
    if (--c->shared->refs == 0) {
      close(c->shared->fd);
      free(c->shared);
    }
    c->shared = NULL;
  } else if (c->root >= 0) {
    close(c->root);
  }
  c->root = -1;
  for (int i = 0; i < c->nallowed; i++)
    if (c->allowed_fd[i] >= 0) close(c->allowed_fd[i]);
  c->nallowed = 0;
}

static int confine_gc(lua_State *L) {
  fs_confine *c = confine_test(L, 1);
  if (c) confine_release(c);
  return 0;
}

/* confinement:close() -> true */
static int confine_close(lua_State *L) {
  fs_confine *c = (fs_confine *)luaL_checkudata(L, 1, FS_CONFINE);
  confine_release(c);
  lua_pushboolean(L, 1);
  return 1;
}

/* confinement:mounts() -> number of allowed mounts (nil without a mount rule) */
static int confine_mounts(lua_State *L) {
  fs_confine *c = (fs_confine *)luaL_checkudata(L, 1, FS_CONFINE);
  if (!c->mnt_mask) return 0;
  lua_pushinteger(L, c->nallowed);
  return 1;
}

static int return_root_error(lua_State *L, int err, int idx);

/* Shares from's root fd with c (a runtime of thousands of sandboxes keeps
 * one root fd for each sandbox's two confinements). 0 or an errno. */
static int share_root(fs_confine *c, fs_confine *from) {
  if (from->root < 0) return EBADF;
  if (!from->shared) {
    from->shared = (shared_root *)malloc(sizeof *from->shared);
    if (!from->shared) return ENOMEM;
    from->shared->fd = from->root;
    from->shared->refs = 1;
  }
  from->shared->refs++;
  c->shared = from->shared;
  c->root = from->root;
  return 0;
}

/* core.fs_confine(root, allowed, creds, resolve) -> confinement | nil, message, CODE
 * root: a directory path or fd, or a confinement whose root fd is shared */
static int fs_confine_new(lua_State *L) {
  fs_confine *from = confine_test(L, 1);
  if (lua_type(L, 1) != LUA_TNUMBER && lua_type(L, 1) != LUA_TSTRING && !from)
    return luaL_argerror(L, 1, "root must be a directory fd, path or confinement");
  if (!lua_isnoneornil(L, 2)) luaL_checktype(L, 2, LUA_TTABLE);
  int nallow = lua_isnoneornil(L, 2) ? -1 : (int)lua_objlen(L, 2);
  if (nallow > CONFINE_MAX) return mb_push_errno(L, E2BIG, "fs_confine: more than 256 allowed paths");
  for (int i = 1; i <= nallow; i++) {
    lua_rawgeti(L, 2, i);
    if (lua_type(L, -1) != LUA_TSTRING) return luaL_argerror(L, 2, "allowed must be a list of relative paths");
    lua_pop(L, 1);
  }
  int creds = 0;
  lua_Integer uid = 0, gid = 0;
  if (!lua_isnoneornil(L, 3)) {
    luaL_checktype(L, 3, LUA_TTABLE);
    lua_getfield(L, 3, "uid");
    lua_getfield(L, 3, "gid");
    if (!lua_isnumber(L, -2) || !lua_isnumber(L, -1)) return luaL_argerror(L, 3, "creds must be {uid =, gid =}");
    uid = lua_tointeger(L, -2);
    gid = lua_tointeger(L, -1);
    lua_pop(L, 2);
    if (uid < 0 || uid >= 0xffffffffLL || gid < 0 || gid >= 0xffffffffLL)
      return luaL_argerror(L, 3, "uid and gid must be between 0 and 2^32-2");
    creds = 1;
  }
  int which = luaL_checkoption(L, 4, "beneath", mb_resolve_names);

  fs_confine *c = (fs_confine *)lua_newuserdata(L, sizeof(fs_confine));
  memset(c, 0, sizeof *c);
  c->root = -1;
  luaL_getmetatable(L, FS_CONFINE);
  lua_setmetatable(L, -2);
  c->creds = creds;
  c->uid = (uid_t)uid;
  c->gid = (gid_t)gid;
  c->resolve = mb_resolve_bits(which);
  c->resolve_name = mb_resolve_names[which];
  if (from) {
    int err = share_root(c, from);
    if (err) return return_root_error(L, err, 1);
  } else if (lua_type(L, 1) == LUA_TNUMBER) {
    c->root = fcntl(check_fd(L, 1), F_DUPFD_CLOEXEC, 0);
  } else {
    c->root = open(lua_tostring(L, 1), O_PATH | O_DIRECTORY | O_CLOEXEC);
  }
  if (c->root < 0) return return_root_error(L, errno, 1);
  if (nallow < 0) return 1;

  unsigned long long root_id;
  c->mnt_mask = STATX_MNT_ID_UNIQUE;
  if (fd_mnt_id(c->root, c->mnt_mask, &root_id) < 0) {
    c->mnt_mask = STATX_MNT_ID;
    if (fd_mnt_id(c->root, c->mnt_mask, &root_id) < 0) {
      int err = errno;
      confine_release(c);
      return mb_push_errno(L, err, "statx mount id (needs Linux 5.8)");
    }
  }
  for (int i = 1; i <= nallow; i++) {
    lua_rawgeti(L, 2, i);
    const char *rel = lua_tostring(L, -1);
    int fd = mb_openat2(c->root, rel, O_PATH | O_CLOEXEC, 0, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS);
    unsigned long long id;
    /* the root's own mount only when named as "." (an image's root, whose
     * overlay is the sandbox's storage); else a path on it allows nothing */
    if (fd >= 0 && fd_mnt_id(fd, c->mnt_mask, &id) == 0 && (id != root_id || strcmp(rel, ".") == 0)) {
      int known = 0;
      for (int j = 0; j < c->nallowed; j++) known |= c->mnt[j] == id;
      if (!known) {
        c->allowed_fd[c->nallowed] = -1;
        if (c->mnt_mask != STATX_MNT_ID_UNIQUE) { /* a reusable id: pinned by the fd */
          c->allowed_fd[c->nallowed] = fd;
          fd = -1;
        }
        c->mnt[c->nallowed++] = id;
      }
    }
    if (fd >= 0) close(fd);
    lua_pop(L, 1);
  }
  return 1;
}

static const luaL_Reg confine_methods[] = {{"close", confine_close}, {"mounts", confine_mounts}, {NULL, NULL}};

/* For fs_tree.c: when the value at idx is a confinement, a malloc'd copy of
 * its rules (free it), its root dup'd into *root, its resolve mode and its
 * credentials (*has_creds, *uid, *gid); NULL with *root = -1 when idx is no
 * confinement, NULL with errno (EBADF: closed) and *root = -2 on failure. */
void *mb_fs_confine_rules(lua_State *L, int idx, int *root, unsigned long long *resolve, const char **resolve_name,
                          int *has_creds, unsigned *uid, unsigned *gid) {
  fs_confine *c = confine_test(L, idx);
  *root = -1;
  if (!c) return NULL;
  *root = -2;
  if (c->root < 0) {
    errno = EBADF;
    return NULL;
  }
  confine_rules *r = (confine_rules *)malloc(sizeof *r);
  if (!r) {
    errno = ENOMEM;
    return NULL;
  }
  int fd = fcntl(c->root, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) {
    free(r);
    return NULL;
  }
  rules_of(c, r);
  *root = fd;
  *resolve = c->resolve;
  *resolve_name = c->resolve_name;
  *has_creds = c->creds;
  *uid = (unsigned)c->uid;
  *gid = (unsigned)c->gid;
  return r;
}

/* For fs_tree.c: 0 when fd lies on one of the rules' mounts, else -1 with
 * errno (EXDEV). */
int mb_fs_rules_check(const void *rules, int fd) { return rules_check((const confine_rules *)rules, fd); }

/* For fs_event (fsevent.c): open rel O_PATH under the root at idx, a
 * confinement (its rules apply, resolved its way) or a plain directory fd
 * (RESOLVE_BENEATH). Returns the fd, or -1 with errno (EXDEV for an escape). */
int mb_fs_root_open_path(lua_State *L, int idx, const char *rel) {
  fs_confine *c = confine_test(L, idx);
  if (c) {
    if (c->root < 0) {
      errno = EBADF;
      return -1;
    }
    confine_rules r;
    rules_of(c, &r);
    return rules_openat2(&r, c->root, rel, O_PATH | O_CLOEXEC, 0, c->resolve);
  }
  lua_Integer dirfd = luaL_checkinteger(L, idx);
  if (dirfd < 0 || dirfd > 0x7fffffff) luaL_argerror(L, idx, "dirfd must be >= 0");
  return mb_openat2((int)dirfd, rel, O_PATH | O_CLOEXEC, 0, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS);
}

/* The error message for a failed openat2 of path (errno value err). */
static void push_openat2_errmsg(lua_State *L, int err, const char *path, const char *resolve) {
  if (err == ENOSYS) lua_pushliteral(L, MB_OPENAT2_ENOSYS_MSG);
  else if (err == EXDEV) lua_pushfstring(L, "EXDEV: path resolves outside the root ('%s', resolve=%s)", path, resolve);
  else {
    int uverr = uv_translate_sys_error(err);
    lua_pushfstring(L, "%s: %s (openat2 '%s', resolve=%s)", uv_err_name(uverr), uv_strerror(uverr), path, resolve);
  }
}

static const char *errno_code(int err) { return uv_err_name(uv_translate_sys_error(err)); }

static int return_openat2_error(lua_State *L, int err, const char *path, const char *resolve) {
  lua_pushnil(L);
  push_openat2_errmsg(L, err, path, resolve);
  lua_pushstring(L, errno_code(err));
  return 3;
}

/* The root at idx: an fd (borrowed), a confinement (its root fd, borrowed;
 * *conf set) or a directory path (opened O_PATH, *owned set). Returns -1
 * with errno on failure. */
static int get_root(lua_State *L, int idx, int *owned, fs_confine **conf) {
  *owned = 0;
  *conf = NULL;
  if (lua_type(L, idx) == LUA_TNUMBER) return check_fd(L, idx);
  if (lua_type(L, idx) == LUA_TUSERDATA && (*conf = confine_test(L, idx)) != NULL) {
    if ((*conf)->root < 0) errno = EBADF;
    return (*conf)->root;
  }
  if (lua_type(L, idx) != LUA_TSTRING) luaL_argerror(L, idx, "root must be a directory fd, path or confinement");
  int fd = open(lua_tostring(L, idx), O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) *owned = 1;
  return fd;
}

static int return_root_error(lua_State *L, int err, int idx) {
  if (lua_type(L, idx) == LUA_TUSERDATA) return mb_push_errno(L, err, "root: the confinement is closed");
  lua_pushfstring(L, "root '%s'", lua_tostring(L, idx));
  return mb_push_errno(L, err, lua_tostring(L, -1));
}

/* core.fs_open_dir(path) -> fd: an O_PATH|O_DIRECTORY|O_CLOEXEC fd to use as
 * a root. Synchronous. Close it with core.close_fd or core.fs_close. */
static int fs_open_dir(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  int fd = open(path, O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    lua_pushfstring(L, "open_dir '%s'", path);
    return mb_push_errno(L, errno, lua_tostring(L, -1));
  }
  lua_pushinteger(L, fd);
  return 1;
}

typedef struct {
  uv_work_t work;
  mb_core *core;
  int cb_ref;
  int root, own_root;
  char *path;
  const char *resolve_name;
  unsigned long long flags, mode, resolve;
  confine_rules rules;
  int fd, err;
} beneath_req;

static void beneath_work(uv_work_t *w) {
  beneath_req *br = (beneath_req *)w->data;
  br->fd = rules_open_file(&br->rules, br->root, br->path, br->flags, br->mode, br->resolve);
  br->err = br->fd < 0 ? errno : 0;
}

static void beneath_after(uv_work_t *w, int status) {
  beneath_req *br = (beneath_req *)w->data;
  mb_core *core = br->core;
  if (br->own_root) close(br->root);
  if (status == UV_ECANCELED) {
    br->fd = -1;
    br->err = ECANCELED;
  }
  if (core->dead) {
    if (br->fd >= 0) close(br->fd);
    free(br->path);
    free(br);
    return;
  }
  lua_State *cbL = core->cbL;
  lua_rawgeti(cbL, LUA_REGISTRYINDEX, br->cb_ref);
  luaL_unref(cbL, LUA_REGISTRYINDEX, br->cb_ref);
  int nargs;
  if (br->fd >= 0) {
    lua_pushnil(cbL);
    lua_pushinteger(cbL, br->fd);
    nargs = 2;
  } else {
    push_openat2_errmsg(cbL, br->err, br->path, br->resolve_name);
    lua_pushnil(cbL);
    lua_pushstring(cbL, errno_code(br->err));
    nargs = 3;
  }
  free(br->path);
  free(br);
  mb_call(core, cbL, nargs);
}

/* core.fs_open_beneath(root, relpath, flags, mode, resolve[, cb])
 *   root: directory fd or path; flags/mode as for fs_open; resolve "beneath"
 *   (default) or "in_root".
 *   With cb: runs on the thread pool, returns true, then cb(nil, fd) or
 *   cb(message, nil, CODE). Without cb: synchronous, returns fd | nil, message, CODE. */
static int fs_open_beneath(lua_State *L) {
  const char *rel = luaL_checkstring(L, 2);
  int flags = check_flags(L, 3);
  int mode = check_mode(L, 4, 0666);
  int async = !lua_isnoneornil(L, 6);
  if (async) luaL_checktype(L, 6, LUA_TFUNCTION);
  if (lua_type(L, 1) != LUA_TNUMBER && lua_type(L, 1) != LUA_TSTRING && lua_type(L, 1) != LUA_TUSERDATA)
    return luaL_argerror(L, 1, "root must be a directory fd, path or confinement");
  mb_core *core = mb_core_get(L);
  const char *resolve_name;
  unsigned long long resolve = check_resolve(L, 5, &resolve_name); /* may raise: before any open */
  int owned;
  fs_confine *conf;
  int root = get_root(L, 1, &owned, &conf);
  if (conf && lua_isnoneornil(L, 5)) {
    resolve = conf->resolve;
    resolve_name = conf->resolve_name;
  }
  if (root < 0) return return_root_error(L, errno, 1);
  confine_rules rules;
  rules_of(conf, &rules);
  if (!async) {
    int fd = rules_open_file(&rules, root, rel, (unsigned)flags, (unsigned)mode, resolve);
    int err = errno;
    if (owned) close(root);
    if (fd < 0) return return_openat2_error(L, err, rel, resolve_name);
    lua_pushinteger(L, fd);
    return 1;
  }
  beneath_req *br = (beneath_req *)calloc(1, sizeof(beneath_req));
  char *path = strdup(rel);
  if (!br || !path) {
    free(br);
    free(path);
    if (owned) close(root);
    return luaL_error(L, "out of memory");
  }
  if (conf) {
    /* the request keeps its own root: the confinement may be closed meanwhile */
    root = fcntl(root, F_DUPFD_CLOEXEC, 0);
    if (root < 0) {
      int err = errno;
      free(br);
      free(path);
      return return_root_error(L, err, 1);
    }
    owned = 1;
  }
  br->work.data = br;
  br->core = core;
  br->root = root;
  br->own_root = owned;
  br->rules = rules;
  br->path = path;
  br->resolve_name = resolve_name;
  br->flags = (unsigned)flags;
  br->mode = (unsigned)mode;
  br->resolve = resolve;
  lua_pushvalue(L, 6);
  br->cb_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  int rc = uv_queue_work(core->loop, &br->work, beneath_work, beneath_after);
  if (rc < 0) {
    luaL_unref(L, LUA_REGISTRYINDEX, br->cb_ref);
    if (owned) close(root);
    free(br->path);
    free(br);
    return mb_push_error(L, rc, "openat2");
  }
  lua_pushboolean(L, 1);
  return 1;
}

/* ---- mkdir, unlink, rmdir, rename, stat, where beneath a root -------------
 *
 * Each runs synchronously when called without a callback (result | nil,
 * message, CODE) and on the thread pool when given one as its last argument
 * (returns true, then cb(nil, result) or cb(message, nil, CODE), as
 * fs_open_beneath). A handful of syscalls each, but a sandbox's file calls
 * are many and user-driven, and a confined lookup can be retried under a
 * rename race or meet a slow filesystem (an unlink of a huge file): in a
 * task they go to the pool so the loop keeps turning (issue #14). */

enum { AT_MKDIR, AT_UNLINK, AT_RMDIR, AT_RENAME, AT_STAT, AT_WHERE };
enum { AT_OK, AT_ESPLIT, AT_EOPENAT2, AT_EAT, AT_ERENAME };

typedef struct {
  uv_work_t work;
  mb_core *core;
  int cb_ref;
  int op;
  int root, own_root;
  confine_rules rules;
  unsigned long long resolve;
  const char *resolve_name;
  char *a, *b; /* relpath (rename: old, new) */
  int mode;    /* mkdir */
  int follow;  /* stat */
  /* outcome */
  int kind, err;
  const char *err_path; /* a or b */
  const char *at_op;
  struct stat st;
  size_t where_len;
  char where[4096];
} at_req;

/* The parent of rel opened confined (O_PATH directory fd) and its final
 * component in name (trailing slashes ignored). -1 with q's outcome set. */
static int at_open_parent(at_req *q, const char *rel, char *name, size_t name_size) {
  size_t len = strlen(rel);
  if (len == 0 || len >= PATH_MAX) {
    q->kind = AT_ESPLIT;
    q->err = len ? ENAMETOOLONG : ENOENT;
    q->err_path = rel;
    return -1;
  }
  while (len > 1 && rel[len - 1] == '/') len--;
  size_t slash = len;
  while (slash > 0 && rel[slash - 1] != '/') slash--;
  const char *nm = rel + slash;
  size_t name_len = len - slash;
  if (name_len == 0 || (name_len == 1 && nm[0] == '.') || (name_len == 2 && nm[0] == '.' && nm[1] == '.') ||
      name_len >= name_size) {
    q->kind = AT_ESPLIT;
    q->err = name_len >= name_size ? ENAMETOOLONG : EINVAL;
    q->err_path = rel;
    return -1;
  }
  memcpy(name, nm, name_len);
  name[name_len] = 0;
  char parent[PATH_MAX];
  if (slash == 0) {
    strcpy(parent, ".");
  } else {
    size_t plen = slash;
    while (plen > 1 && rel[plen - 1] == '/') plen--;
    memcpy(parent, rel, plen);
    parent[plen] = 0;
  }
  int pfd = rules_openat2(&q->rules, q->root, parent, O_PATH | O_DIRECTORY | O_CLOEXEC, 0, q->resolve);
  if (pfd < 0) {
    q->kind = AT_EOPENAT2; /* reported for the whole path, not just its parent */
    q->err = errno;
    q->err_path = rel;
  }
  return pfd;
}

/* An *at call on a verified directory fd, with the confinement's credentials. */
#define AT_WITH_CREDS(q, expr)                                                                                         \
  do {                                                                                                                 \
    saved_creds sc_;                                                                                                   \
    if (creds_enter(&(q)->rules, &sc_) < 0) {                                                                          \
      r = -1;                                                                                                          \
      break;                                                                                                           \
    }                                                                                                                  \
    r = (expr);                                                                                                        \
    creds_leave(&sc_);                                                                                                 \
  } while (0)

static void at_run(at_req *q) {
  char name[NAME_MAX + 1], name2[NAME_MAX + 1];
  int r;
  q->kind = AT_OK;
  switch (q->op) {
  case AT_MKDIR:
  case AT_UNLINK:
  case AT_RMDIR: {
    int pfd = at_open_parent(q, q->a, name, sizeof name);
    if (pfd < 0) return;
    if (q->op == AT_MKDIR) {
      AT_WITH_CREDS(q, mkdirat(pfd, name, (mode_t)q->mode));
      q->at_op = "mkdir";
    } else {
      AT_WITH_CREDS(q, unlinkat(pfd, name, q->op == AT_RMDIR ? AT_REMOVEDIR : 0));
      q->at_op = q->op == AT_RMDIR ? "rmdir" : "unlink";
    }
    q->err = errno;
    close(pfd);
    if (r < 0) {
      q->kind = AT_EAT;
      q->err_path = q->a;
    }
    return;
  }
  case AT_RENAME: {
    int from_fd = at_open_parent(q, q->a, name, sizeof name);
    if (from_fd < 0) return;
    int to_fd = at_open_parent(q, q->b, name2, sizeof name2);
    if (to_fd < 0) {
      close(from_fd);
      return;
    }
    AT_WITH_CREDS(q, renameat(from_fd, name, to_fd, name2));
    q->err = errno;
    close(from_fd);
    close(to_fd);
    if (r < 0) q->kind = AT_ERENAME;
    return;
  }
  case AT_STAT:
  case AT_WHERE: {
    int fd = rules_openat2(&q->rules, q->root, q->a,
                           O_PATH | O_CLOEXEC | (q->op == AT_STAT && !q->follow ? O_NOFOLLOW : 0), 0, q->resolve);
    if (fd < 0) {
      q->kind = AT_EOPENAT2;
      q->err = errno;
      q->err_path = q->a;
      return;
    }
    q->err_path = q->a;
    if (q->op == AT_STAT) {
      r = fstat(fd, &q->st);
      q->err = errno;
      q->at_op = "fstat";
    } else {
      char link[64];
      snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
      ssize_t len = readlink(link, q->where, sizeof q->where);
      q->err = len < 0 ? errno : ENAMETOOLONG;
      r = len < 0 || (size_t)len >= sizeof q->where ? -1 : 0;
      q->where_len = r < 0 ? 0 : (size_t)len;
      q->at_op = "readlink";
    }
    close(fd);
    if (r < 0) q->kind = AT_EAT;
    return;
  }
  }
}

/* Push q's outcome: the result (1 value), or nil, message, CODE (3). */
static int at_push(lua_State *L, at_req *q) {
  char detail[2 * PATH_MAX + 32];
  switch (q->kind) {
  case AT_OK:
    if (q->op == AT_STAT) push_sys_stat(L, &q->st);
    else if (q->op == AT_WHERE) lua_pushlstring(L, q->where, q->where_len);
    else lua_pushboolean(L, 1);
    return 1;
  case AT_ESPLIT:
    lua_pushnil(L);
    if (q->err == EINVAL)
      lua_pushfstring(L, "EINVAL: invalid argument (path '%s' has no usable final component)", q->err_path);
    else if (q->err == ENOENT)
      lua_pushfstring(L, "%s: %s (empty path)", errno_code(q->err), uv_strerror(uv_translate_sys_error(q->err)));
    else
      lua_pushfstring(L, "%s: %s (path '%s')", errno_code(q->err), uv_strerror(uv_translate_sys_error(q->err)),
                      q->err_path);
    lua_pushstring(L, errno_code(q->err));
    return 3;
  case AT_EOPENAT2: return return_openat2_error(L, q->err, q->err_path, q->resolve_name);
  case AT_EAT:
    snprintf(detail, sizeof detail, "%s '%s'", q->at_op, q->err_path);
    return mb_push_errno(L, q->err, detail);
  default: /* AT_ERENAME */
    snprintf(detail, sizeof detail, "rename '%s' -> '%s'", q->a, q->b);
    return mb_push_errno(L, q->err, detail);
  }
}

static void at_free(at_req *q) {
  if (q->own_root && q->root >= 0) close(q->root);
  free(q->a);
  free(q->b);
  free(q);
}

static void at_work(uv_work_t *w) { at_run((at_req *)w->data); }

static void at_after(uv_work_t *w, int status) {
  at_req *q = (at_req *)w->data;
  mb_core *core = q->core;
  if (status == UV_ECANCELED) {
    q->kind = AT_EAT;
    q->err = ECANCELED;
    q->at_op = "queue";
    q->err_path = q->a;
  }
  if (core->dead) {
    at_free(q);
    return;
  }
  lua_State *cbL = core->cbL;
  lua_rawgeti(cbL, LUA_REGISTRYINDEX, q->cb_ref);
  luaL_unref(cbL, LUA_REGISTRYINDEX, q->cb_ref);
  int n = at_push(cbL, q);
  if (n == 1) {
    lua_pushnil(cbL);
    lua_insert(cbL, -2); /* cb(nil, result) */
    n = 2;
  } else {
    /* nil, message, CODE -> message, nil, CODE */
    lua_pushvalue(cbL, -2);
    lua_replace(cbL, -4);
    lua_pushnil(cbL);
    lua_replace(cbL, -3);
  }
  at_free(q);
  mb_call(core, cbL, n);
}

/* Common body: root at index 1, relpath(s) already checked; resolve at
 * resolve_idx; an optional callback at cb_idx. */
static int at_call(lua_State *L, int op, const char *a, const char *b, int mode, int follow, int resolve_idx,
                   int cb_idx) {
  if (lua_type(L, 1) != LUA_TNUMBER && lua_type(L, 1) != LUA_TSTRING && lua_type(L, 1) != LUA_TUSERDATA)
    luaL_argerror(L, 1, "root must be a directory fd, path or confinement");
  int async = !lua_isnoneornil(L, cb_idx);
  if (async) luaL_checktype(L, cb_idx, LUA_TFUNCTION);
  const char *resolve_name;
  unsigned long long resolve = check_resolve(L, resolve_idx, &resolve_name); /* may raise: before any allocation */
  if (lua_type(L, 1) == LUA_TNUMBER) check_fd(L, 1);                         /* likewise */
  at_req *q = (at_req *)calloc(1, sizeof(at_req));
  if (!q) return luaL_error(L, "out of memory");
  q->op = op;
  q->mode = mode;
  q->follow = follow;
  q->root = -1;
  q->resolve = resolve;
  q->resolve_name = resolve_name;
  q->a = strdup(a);
  q->b = b ? strdup(b) : NULL;
  if (!q->a || (b && !q->b)) {
    at_free(q);
    return luaL_error(L, "out of memory");
  }
  fs_confine *conf;
  int root = get_root(L, 1, &q->own_root, &conf);
  if (conf && lua_isnoneornil(L, resolve_idx)) {
    q->resolve = conf->resolve;
    q->resolve_name = conf->resolve_name;
  }
  rules_of(conf, &q->rules);
  if (root < 0) {
    int err = errno;
    at_free(q);
    return return_root_error(L, err, 1);
  }
  q->root = root;
  if (!async) {
    at_run(q);
    int n = at_push(L, q);
    at_free(q);
    return n;
  }
  if (!q->own_root) {
    /* the request keeps its own root: the caller's fd or the confinement
     * may be closed meanwhile */
    q->root = fcntl(root, F_DUPFD_CLOEXEC, 0);
    if (q->root < 0) {
      int err = errno;
      at_free(q);
      return return_root_error(L, err, 1);
    }
    q->own_root = 1;
  }
  mb_core *core = mb_core_get(L);
  q->core = core;
  q->work.data = q;
  lua_pushvalue(L, cb_idx);
  q->cb_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  int rc = uv_queue_work(core->loop, &q->work, at_work, at_after);
  if (rc < 0) {
    luaL_unref(L, LUA_REGISTRYINDEX, q->cb_ref);
    at_free(q);
    return mb_push_error(L, rc, "uv_queue_work");
  }
  lua_pushboolean(L, 1);
  return 1;
}

/* core.fs_mkdir_beneath(root, relpath, mode, resolve[, cb]) -> true */
static int fs_mkdir_beneath(lua_State *L) {
  const char *rel = luaL_checkstring(L, 2);
  int mode = check_mode(L, 3, 0777);
  return at_call(L, AT_MKDIR, rel, NULL, mode, 0, 4, 5);
}

/* core.fs_unlink_beneath(root, relpath, resolve[, cb]) -> true; a final
 * symlink is removed itself, never followed. */
static int fs_unlink_beneath(lua_State *L) { return at_call(L, AT_UNLINK, luaL_checkstring(L, 2), NULL, 0, 0, 3, 4); }

/* core.fs_rmdir_beneath(root, relpath, resolve[, cb]) -> true */
static int fs_rmdir_beneath(lua_State *L) { return at_call(L, AT_RMDIR, luaL_checkstring(L, 2), NULL, 0, 0, 3, 4); }

/* core.fs_rename_beneath(root, old, new, resolve[, cb]) -> true; both paths
 * are confined to the same root. */
static int fs_rename_beneath(lua_State *L) {
  const char *from = luaL_checkstring(L, 2);
  const char *to = luaL_checkstring(L, 3);
  return at_call(L, AT_RENAME, from, to, 0, 0, 4, 5);
}

/* core.fs_stat_beneath(root, relpath, resolve, follow[, cb]) -> stat table.
 * The whole path is opened O_PATH through openat2 (with O_NOFOLLOW when
 * follow == false, giving the symlink itself) and fstat'ed, so a final
 * symlink is also resolved inside the root; follow defaults to true. */
static int fs_stat_beneath(lua_State *L) {
  const char *rel = luaL_checkstring(L, 2);
  int follow = lua_isnoneornil(L, 4) ? 1 : lua_toboolean(L, 4);
  return at_call(L, AT_STAT, rel, NULL, 0, follow, 3, 5);
}

/* core.fs_where_beneath(root, relpath, resolve[, cb]) -> path | nil, message,
 * CODE: where relpath leads, every symlink followed (a final one too), as
 * the kernel names the object it reached (readlink of /proc/self/fd/<n>):
 * for a root seen through /proc/<pid>/root, the path inside that process's view. */
static int fs_where_beneath(lua_State *L) { return at_call(L, AT_WHERE, luaL_checkstring(L, 2), NULL, 0, 0, 3, 4); }

/* Common prologue of fs_scandir_beneath. */
typedef struct {
  int root, owned;
  const char *resolve_name;
  unsigned long long resolve;
  confine_rules rules;
} root_ctx;

/* Returns 0, or the number of error values already pushed. A confinement's
 * own resolve mode applies when the call names none. */
static int root_begin(lua_State *L, root_ctx *rc, int resolve_idx) {
  if (lua_type(L, 1) != LUA_TNUMBER && lua_type(L, 1) != LUA_TSTRING && lua_type(L, 1) != LUA_TUSERDATA)
    luaL_argerror(L, 1, "root must be a directory fd, path or confinement");
  rc->resolve = check_resolve(L, resolve_idx, &rc->resolve_name); /* may raise: before any open */
  fs_confine *conf;
  rc->root = get_root(L, 1, &rc->owned, &conf);
  if (conf && lua_isnoneornil(L, resolve_idx)) {
    rc->resolve = conf->resolve;
    rc->resolve_name = conf->resolve_name;
  }
  rules_of(conf, &rc->rules);
  if (rc->root < 0) return return_root_error(L, errno, 1);
  return 0;
}

static void root_end(root_ctx *rc) {
  if (rc->owned) close(rc->root);
}

static int return_at_error(lua_State *L, int err, const char *op, const char *rel) {
  lua_pushfstring(L, "%s '%s'", op, rel);
  return mb_push_errno(L, err, lua_tostring(L, -1));
}

/* core.fs_scandir_beneath(root, relpath, resolve) -> {{name=, type=}, ...}
 * unsorted, without . and ... Synchronous. */
static int fs_scandir_beneath(lua_State *L) {
  const char *rel = luaL_checkstring(L, 2);
  root_ctx rc;
  int n = root_begin(L, &rc, 3);
  if (n) return n;
  int fd = rules_openat2(&rc.rules, rc.root, rel, O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0, rc.resolve);
  int err = errno;
  root_end(&rc);
  if (fd < 0) return return_openat2_error(L, err, rel, rc.resolve_name);
  DIR *d = fdopendir(fd);
  if (!d) {
    err = errno;
    close(fd);
    return return_at_error(L, err, "fdopendir", rel);
  }
  lua_newtable(L);
  int i = 0;
  struct dirent *ent;
  for (;;) {
    errno = 0;
    ent = readdir(d);
    if (!ent) break;
    const char *nm = ent->d_name;
    if (nm[0] == '.' && (nm[1] == 0 || (nm[1] == '.' && nm[2] == 0))) continue;
    const char *type;
    switch (ent->d_type) {
    case DT_REG: type = "file"; break;
    case DT_DIR: type = "directory"; break;
    case DT_LNK: type = "symlink"; break;
    case DT_UNKNOWN: {
      struct stat st;
      type = fstatat(dirfd(d), nm, &st, AT_SYMLINK_NOFOLLOW) == 0 ? type_name(st.st_mode) : "unknown";
      break;
    }
    default: type = "other";
    }
    push_entry(L, ++i, nm, type);
  }
  err = errno;
  closedir(d);
  if (err) {
    lua_pop(L, 1);
    return return_at_error(L, err, "readdir", rel);
  }
  return 1;
}

static const luaL_Reg fs_funcs[] = {{"fs_open", fs_open},
                                    {"fs_read", fs_read},
                                    {"fs_write", fs_write},
                                    {"fs_close", fs_close},
                                    {"fs_stat", fs_stat},
                                    {"fs_lstat", fs_lstat},
                                    {"fs_fstat", fs_fstat},
                                    {"fs_mkdir", fs_mkdir},
                                    {"fs_rmdir", fs_rmdir},
                                    {"fs_unlink", fs_unlink},
                                    {"fs_rename", fs_rename},
                                    {"fs_scandir", fs_scandir},
                                    {"fs_scandir_batched", fs_scandir_batched},
                                    {"fs_readlink", fs_readlink},
                                    {"fs_realpath", fs_realpath},
                                    {"fs_chmod", fs_chmod},
                                    {"fs_utime", fs_utime},
                                    {"fs_open_dir", fs_open_dir},
                                    {"fs_open_beneath", fs_open_beneath},
                                    {"fs_mkdir_beneath", fs_mkdir_beneath},
                                    {"fs_unlink_beneath", fs_unlink_beneath},
                                    {"fs_rmdir_beneath", fs_rmdir_beneath},
                                    {"fs_rename_beneath", fs_rename_beneath},
                                    {"fs_stat_beneath", fs_stat_beneath},
                                    {"fs_scandir_beneath", fs_scandir_beneath},
                                    {"fs_where_beneath", fs_where_beneath},
                                    {"fs_confine", fs_confine_new},
                                    {NULL, NULL}};

void mb_open_fs(lua_State *L) {
  luaL_newmetatable(L, FS_CONFINE);
  lua_pushcfunction(L, confine_gc);
  lua_setfield(L, -2, "__gc");
  lua_newtable(L);
  for (const luaL_Reg *m = confine_methods; m->name; m++) {
    lua_pushcfunction(L, m->func);
    lua_setfield(L, -2, m->name);
  }
  lua_setfield(L, -2, "__index");
  lua_pop(L, 1);
  static const luaL_Reg dirlist_methods[] = {{"next", dirlist_next}, {"close", dirlist_close}, {NULL, NULL}};
  luaL_newmetatable(L, DIRLIST);
  lua_newtable(L);
  luaL_register(L, NULL, dirlist_methods);
  lua_setfield(L, -2, "__index");
  lua_pushcfunction(L, dirlist_close);
  lua_setfield(L, -2, "__gc");
  lua_pop(L, 1);
  for (const luaL_Reg *f = fs_funcs; f->name; f++) {
    lua_pushcfunction(L, f->func);
    lua_setfield(L, -2, f->name);
  }
}
