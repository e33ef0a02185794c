/* fs_tree: removing a whole directory tree, and locking a sandbox root.
 *
 * core.fs_remove_tree(root, relpath, resolve, cb[, creds])
 *   Removes relpath (a file, a symlink or a directory with everything in
 *   it) on libuv's thread pool, so a huge tree never holds the loop. relpath
 *   is resolved under root (a directory fd or path) like the *_beneath
 *   helpers of fs.c: openat2 with RESOLVE_BENEATH ("beneath", the default)
 *   or RESOLVE_IN_ROOT ("in_root"), plus RESOLVE_NO_MAGICLINKS; its final
 *   component is acted on relative to its parent, never followed.
 *   The walk never builds a path string: every step is openat/unlinkat
 *   relative to the directory fd of the level above, with O_NOFOLLOW, so a
 *   tree of any depth (paths far beyond PATH_MAX) goes, and a symlink inside
 *   is removed itself, never followed. The walk is iterative (a heap-allocated
 *   stack of levels, not the C stack); at most MAX_OPEN levels keep their
 *   directory open at once, a deeper walk closes the upper ones and gets back
 *   to them through ".." of the level below, checking that ".." is still the
 *   directory it left (device and inode): a tree moved about while it is
 *   removed fails the call (EAGAIN), it never makes the walk act elsewhere.
 *   A directory in the tree its owner made unreadable or unwritable (chmod
 *   000 by sandbox code) gets u+rwx back (fchmod of its fd, or chmod of
 *   /proc/self/fd/N of an O_PATH|O_NOFOLLOW fd), so the owner's tree always
 *   goes; someone else's directory is left as it is and its error reported.
 *   cb(nil, count) with the number of entries removed, or cb(message, nil,
 *   CODE) at the first removal that fails (nothing is skipped silently).
 *   The call returns true once queued, or nil, message, CODE.
 *   creds = {uid =, gid =}: the walk runs with these filesystem ids (a
 *   sandbox's root), meeting that owner's permissions, not the runtime's;
 *   ids the runtime may not take fail the call with EPERM.
 *   root may be a confinement (core.fs_confine, fs.c): relpath then resolves
 *   its way (resolve nil), the walk takes its credentials (creds nil), and
 *   the parent and every directory the walk opens must lie on one of its
 *   mounts: a mount inside the tree fails the call (EXDEV), nothing on it
 *   is removed.
 *
 * core.fs_lock(path, content) -> fd | nil, message, CODE[, holder]
 *   Opens (creating, mode 0644, never through a final symlink) the lock file
 *   at path and takes an exclusive flock on it without waiting; on success
 *   the file's content is replaced by content (e.g. the holder's pid) and
 *   the O_CLOEXEC fd is returned: the lock lasts until it is closed
 *   (core.close_fd). A lock held by another open file returns nil, message,
 *   "EAGAIN" and the file's content (the holder's words) as a fourth value.
 *   A lock file removed or replaced between open and flock is retried, so two
 *   callers never both hold "the" lock of one path. Synchronous. *
 * core.rmdir_tree(path, cb) -> true | nil, message, CODE
 *   Removes the directory path and every directory under it, deepest first,
 *   with rmdir(2) alone, on the thread pool: for cgroup trees, where a
 *   cgroup goes by rmdir once empty and each rmdir takes the kernel's
 *   cgroup_mutex and takes its controllers offline (a sandbox's few cost
 *   most of a millisecond, too long for the loop and for destroy's caller).
 *   No file is unlinked and no symlink followed (O_NOFOLLOW, entries other
 *   than directories are left, so their directory's rmdir fails); at most
 *   RMDIR_MAX_DEPTH levels. cb(nil, count) with the number of directories
 *   removed, or cb(message, nil, CODE) at the first failure; a path already
 *   gone is count 0.
 */
#include "openat2.h"
#include "private.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/fsuid.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_OPEN 64        /* directory levels kept open at once */
#define MAX_RESTARTS 10000 /* rescans of directories that filled up again */

typedef struct {
  DIR *dir; /* NULL while closed (deep walks) */
  dev_t dev;
  ino_t ino;
  char *name; /* its name in the level above */
} level;

typedef struct {
  uv_work_t work;
  mb_core *core;
  int cb_ref;
  int root, own_root;
  char *path;
  const char *resolve_name;
  unsigned long long resolve;
  int with_creds;
  uid_t uid;
  gid_t gid;
  void *rules; /* a confinement's (fs.c), or NULL */
  /* result */
  long long removed;
  int err;
  const char *op;
  char where[256];
} tree_req;

static int fail(tree_req *tr, int err, const char *op, const char *name, size_t depth) {
  tr->err = err;
  tr->op = op;
  snprintf(tr->where, sizeof tr->where, "'%.200s' at depth %zu", name, depth);
  return -1;
}

/* Open dir name under fd as a level (O_NOFOLLOW: a symlink is not a dir);
 * under rules, only on one of their mounts (a mount point in the tree: EXDEV). */
static int open_level_once(const void *rules, int fd, const char *name, level *lv) {
  int d = openat(fd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (d < 0) return -1;
  struct stat st;
  if ((rules && mb_fs_rules_check(rules, d) < 0) || fstat(d, &st) < 0 || !(lv->dir = fdopendir(d))) {
    int e = errno;
    close(d);
    errno = e;
    return -1;
  }
  lv->dev = st.st_dev;
  lv->ino = st.st_ino;
  return 0;
}

/* Reopen closed level up through ".." of the open level below it. */
static int reopen_up(level *up, level *below) {
  int d = openat(dirfd(below->dir), "..", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (d < 0) return -1;
  struct stat st;
  if (fstat(d, &st) < 0) {
    int e = errno;
    close(d);
    errno = e;
    return -1;
  }
  if (st.st_dev != up->dev || st.st_ino != up->ino) {
    close(d);
    errno = EAGAIN; /* the tree was moved while we walked it */
    return -1;
  }
  if (!(up->dir = fdopendir(d))) {
    int e = errno;
    close(d);
    errno = e;
    return -1;
  }
  return 0;
}

/* A directory its owner made unreadable or unwritable (chmod 000 inside a
 * sandbox) must not make the tree unremovable: the owner gets rwx back on
 * it. Someone else's directory stays as it is (EPERM), and the removal
 * fails with the first error. These return 0 only when they changed a mode. */
static int owner_rwx_fd(int dfd) {
  struct stat st;
  if (fstat(dfd, &st) < 0 || (st.st_mode & S_IRWXU) == S_IRWXU) return -1;
  return fchmod(dfd, (st.st_mode & 07777) | S_IRWXU);
}

static int owner_rwx_at(const void *rules, int fd, const char *name) {
  int p = openat(fd, name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
  if (p < 0) return -1;
  struct stat st;
  int rc = -1;
  if ((!rules || mb_fs_rules_check(rules, p) == 0) && fstat(p, &st) == 0 && S_ISDIR(st.st_mode) &&
      (st.st_mode & S_IRWXU) != S_IRWXU) {
    char proc[64];
    snprintf(proc, sizeof proc, "/proc/self/fd/%d", p); /* the inode itself, never a path */
    rc = chmod(proc, (st.st_mode & 07777) | S_IRWXU);
  }
  close(p);
  return rc;
}

/* unlinkat in directory dfd (a readable dir fd), once more after giving
 * the owner write permission on it. */
static int unlink_in(int dfd, const char *name, int flags) {
  if (unlinkat(dfd, name, flags) == 0) return 0;
  int e = errno;
  if ((e == EACCES || e == EPERM) && owner_rwx_fd(dfd) == 0) return unlinkat(dfd, name, flags);
  errno = e;
  return -1;
}

static int open_level(const void *rules, int fd, const char *name, level *lv) {
  if (open_level_once(rules, fd, name, lv) == 0) return 0;
  int e = errno;
  if (e == EACCES && owner_rwx_at(rules, fd, name) == 0) return open_level_once(rules, fd, name, lv);
  errno = e;
  return -1;
}

static int is_dot(const char *n) { return n[0] == '.' && (n[1] == 0 || (n[1] == '.' && n[2] == 0)); }

/* Remove everything under the directory at lv[0] and then lv[0] itself
 * (named top under parent). Returns 0 or -1 with tr's error set. */
static int remove_walk(tree_req *tr, int parent, const char *top, level *first) {
  size_t cap = 64, depth = 1, open_from = 0; /* levels [open_from, depth) are open */
  level *lv = (level *)calloc(cap, sizeof(level));
  if (!lv) {
    closedir(first->dir);
    return fail(tr, ENOMEM, "walk", top, 0);
  }
  lv[0] = *first;
  long restarts = 0;
  int rc = 0;
  while (depth > 0) {
    level *cur = &lv[depth - 1];
    errno = 0;
    struct dirent *ent = readdir(cur->dir);
    if (!ent) {
      if (errno) {
        rc = fail(tr, errno, "readdir", cur->name ? cur->name : top, depth - 1);
        break;
      }
      /* scanned to the end: remove it from the level above */
      if (depth == 1) {
        closedir(cur->dir);
        cur->dir = NULL;
        if (unlinkat(parent, top, AT_REMOVEDIR) == 0) {
          tr->removed++;
          depth = 0;
          break;
        }
        if (errno == ENOENT) {
          depth = 0;
          break;
        }
        if (errno == ENOTEMPTY && ++restarts < MAX_RESTARTS) {
          /* something was created meanwhile: scan again */
          if (open_level(tr->rules, parent, top, cur) < 0) {
            rc = fail(tr, errno, "open", top, 0);
            depth = 0;
            break;
          }
          continue;
        }
        rc = fail(tr, errno, "rmdir", top, 0);
        depth = 0;
        break;
      }
      level *up = &lv[depth - 2];
      if (!up->dir) {
        if (reopen_up(up, cur) < 0) {
          rc = fail(tr, errno, "reopen ..", cur->name, depth - 1);
          break;
        }
        open_from = depth - 2;
      }
      closedir(cur->dir);
      cur->dir = NULL;
      depth--;
      if (unlink_in(dirfd(up->dir), cur->name, AT_REMOVEDIR) == 0) {
        tr->removed++;
      } else if (errno == ENOTEMPTY && ++restarts < MAX_RESTARTS) {
        rewinddir(up->dir); /* it filled up again: the rescan of up finds it */
      } else if (errno != ENOENT) {
        rc = fail(tr, errno, "rmdir", cur->name, depth);
        free(cur->name);
        cur->name = NULL;
        break;
      }
      free(cur->name);
      cur->name = NULL;
      continue;
    }
    const char *name = ent->d_name;
    if (is_dot(name)) continue;
    int fd = dirfd(cur->dir);
    int isdir = ent->d_type == DT_DIR;
    if (ent->d_type == DT_UNKNOWN) {
      struct stat st;
      if (fstatat(fd, name, &st, AT_SYMLINK_NOFOLLOW) < 0) {
        if (errno == ENOENT) continue;
        rc = fail(tr, errno, "stat", name, depth);
        break;
      }
      isdir = S_ISDIR(st.st_mode);
    }
    if (!isdir) {
      if (unlink_in(fd, name, 0) == 0) {
        tr->removed++;
        continue;
      }
      if (errno == ENOENT) continue;
      if (errno != EISDIR) {
        rc = fail(tr, errno, "unlink", name, depth);
        break;
      }
      /* replaced by a directory meanwhile: take it as one */
    }
    /* an empty directory goes at once; a full one is walked */
    if (unlink_in(fd, name, AT_REMOVEDIR) == 0) {
      tr->removed++;
      continue;
    }
    if (errno == ENOENT) continue;
    if (errno == ENOTDIR) { /* replaced by a file meanwhile */
      if (unlink_in(fd, name, 0) == 0) {
        tr->removed++;
        continue;
      }
      if (errno == ENOENT) continue;
      rc = fail(tr, errno, "unlink", name, depth);
      break;
    }
    if (errno != ENOTEMPTY && errno != EEXIST) {
      rc = fail(tr, errno, "rmdir", name, depth);
      break;
    }
    if (depth == cap) {
      level *grown = (level *)realloc(lv, cap * 2 * sizeof(level));
      if (!grown) {
        rc = fail(tr, ENOMEM, "walk", name, depth);
        break;
      }
      memset(grown + cap, 0, cap * sizeof(level));
      lv = grown;
      cap *= 2;
      cur = &lv[depth - 1];
    }
    level *next = &lv[depth];
    if (!(next->name = strdup(name))) {
      rc = fail(tr, ENOMEM, "walk", name, depth);
      break;
    }
    if (open_level(tr->rules, fd, name, next) < 0) {
      int e = errno;
      free(next->name);
      next->name = NULL;
      if (e == ENOENT) continue;
      if ((e == ENOTDIR || e == ELOOP) && ++restarts < MAX_RESTARTS) {
        rewinddir(cur->dir); /* swapped for a file or symlink meanwhile: rescan */
        continue;
      }
      rc = fail(tr, e, "open", name, depth);
      break;
    }
    depth++;
    if (depth - open_from > MAX_OPEN) { /* keep the fds bounded */
      closedir(lv[open_from].dir);
      lv[open_from].dir = NULL;
      open_from++;
    }
  }
  for (size_t i = 0; i < cap; i++) {
    if (lv[i].dir) closedir(lv[i].dir);
    free(lv[i].name);
  }
  free(lv);
  return rc;
}

static void tree_walk(tree_req *tr);

/* With creds, the walk runs with the filesystem ids given (setfsuid and
 * setfsgid act on the calling thread only: this pool thread, for this
 * request), so it meets the permissions that owner meets. */
static void tree_work(uv_work_t *w) {
  tree_req *tr = (tree_req *)w->data;
  if (!tr->with_creds) {
    tree_walk(tr);
    return;
  }
  int old_gid = setfsgid(tr->gid), old_uid = setfsuid(tr->uid);
  /* setfsuid reports no error: read the ids back */
  if ((uid_t)setfsuid(tr->uid) != tr->uid || (gid_t)setfsgid(tr->gid) != tr->gid) {
    tr->err = EPERM;
    tr->op = "setfsuid";
    snprintf(tr->where, sizeof tr->where, "uid %u gid %u", (unsigned)tr->uid, (unsigned)tr->gid);
  } else {
    tree_walk(tr);
  }
  setfsuid((uid_t)old_uid);
  setfsgid((gid_t)old_gid);
}

static void tree_walk(tree_req *tr) {
  /* the parent of relpath, confined; then its final component */
  char *rel = tr->path;
  size_t len = strlen(rel);
  while (len > 1 && rel[len - 1] == '/') rel[--len] = 0;
  char *slash = strrchr(rel, '/');
  const char *name = slash ? slash + 1 : rel;
  const char *parent_path = ".";
  if (slash) {
    *slash = 0;
    parent_path = slash == rel ? "/" : rel;
  }
  if (!*name || is_dot(name)) {
    fail(tr, EINVAL, "remove", tr->path, 0);
    return;
  }
  int parent = mb_openat2(tr->root, parent_path, O_PATH | O_DIRECTORY | O_CLOEXEC, 0, tr->resolve);
  if (parent >= 0 && tr->rules && mb_fs_rules_check(tr->rules, parent) < 0) {
    int e = errno;
    close(parent);
    parent = -1;
    errno = e;
  }
  if (parent < 0) {
    tr->err = errno;
    tr->op = "resolve";
    snprintf(tr->where, sizeof tr->where, "%.250s", tr->path);
    return;
  }
  level first = {0};
  if (open_level(tr->rules, parent, name, &first) == 0) {
    remove_walk(tr, parent, name, &first);
  } else if (errno == ENOTDIR || errno == ELOOP) {
    if (unlinkat(parent, name, 0) == 0) tr->removed = 1;
    else fail(tr, errno, "unlink", name, 0);
  } else {
    fail(tr, errno, "open", name, 0);
  }
  close(parent);
}

static void tree_after(uv_work_t *w, int status) {
  tree_req *tr = (tree_req *)w->data;
  mb_core *core = tr->core;
  if (tr->own_root) close(tr->root);
  free(tr->rules);
  tr->rules = NULL;
  if (status == UV_ECANCELED) {
    tr->err = ECANCELED;
    tr->op = "remove";
  }
  if (core->dead) {
    free(tr->path);
    free(tr);
    return;
  }
  lua_State *cbL = core->cbL;
  lua_rawgeti(cbL, LUA_REGISTRYINDEX, tr->cb_ref);
  luaL_unref(cbL, LUA_REGISTRYINDEX, tr->cb_ref);
  int nargs;
  if (!tr->err) {
    lua_pushnil(cbL);
    lua_pushnumber(cbL, (lua_Number)tr->removed);
    nargs = 2;
  } else {
    int uverr = uv_translate_sys_error(tr->err);
    if (tr->err == EXDEV && strcmp(tr->op, "resolve") == 0)
      lua_pushfstring(cbL, "EXDEV: path resolves outside the root ('%s', resolve=%s)", tr->where, tr->resolve_name);
    else lua_pushfstring(cbL, "%s: %s (remove_tree: %s %s)", uv_err_name(uverr), uv_strerror(uverr), tr->op, tr->where);
    lua_pushnil(cbL);
    lua_pushstring(cbL, uv_err_name(uverr));
    nargs = 3;
  }
  free(tr->path);
  free(tr);
  mb_call(core, cbL, nargs);
}

/* core.fs_remove_tree(root, relpath, resolve, cb) -> true | nil, message, CODE */
static int fs_remove_tree(lua_State *L) {
  if (lua_type(L, 1) != LUA_TNUMBER && lua_type(L, 1) != LUA_TSTRING && lua_type(L, 1) != LUA_TUSERDATA)
    return luaL_argerror(L, 1, "root must be a directory fd, path or confinement");
  const char *rel = luaL_checkstring(L, 2);
  int which = luaL_checkoption(L, 3, "beneath", mb_resolve_names);
  luaL_checktype(L, 4, LUA_TFUNCTION);
  int with_creds = !lua_isnoneornil(L, 5);
  lua_Integer uid = 0, gid = 0;
  if (with_creds) {
    luaL_checktype(L, 5, LUA_TTABLE);
    uid = mb_opt_intfield(L, 5, "uid", -1);
    gid = mb_opt_intfield(L, 5, "gid", -1);
    if (uid < 0 || gid < 0 || uid > 0xfffffffe || gid > 0xfffffffe)
      return luaL_argerror(L, 5, "creds must have uid and gid");
  }
  mb_core *core = mb_core_get(L);
  int root, owned = 0;
  unsigned long long c_resolve = 0;
  const char *c_resolve_name = NULL;
  int c_creds = 0;
  unsigned c_uid = 0, c_gid = 0;
  void *rules = mb_fs_confine_rules(L, 1, &root, &c_resolve, &c_resolve_name, &c_creds, &c_uid, &c_gid);
  if (root == -2) return mb_push_errno(L, errno, "root: the confinement is closed");
  if (rules) {
    owned = 1;
    if (!with_creds && c_creds) {
      with_creds = 1;
      uid = c_uid;
      gid = c_gid;
    }
  } else if (lua_type(L, 1) == LUA_TUSERDATA) {
    return luaL_argerror(L, 1, "root must be a directory fd, path or confinement");
  } else if (lua_type(L, 1) == LUA_TNUMBER) {
    root = (int)lua_tointeger(L, 1);
  } else {
    root = open(lua_tostring(L, 1), O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (root < 0) {
      lua_pushfstring(L, "root '%s'", lua_tostring(L, 1));
      return mb_push_errno(L, errno, lua_tostring(L, -1));
    }
    owned = 1;
  }
  tree_req *tr = (tree_req *)calloc(1, sizeof(tree_req));
  char *path = strdup(rel);
  if (!tr || !path) {
    free(tr);
    free(path);
    free(rules);
    if (owned) close(root);
    return luaL_error(L, "out of memory");
  }
  tr->work.data = tr;
  tr->core = core;
  tr->root = root;
  tr->own_root = owned;
  tr->path = path;
  tr->resolve_name = mb_resolve_names[which];
  tr->resolve = mb_resolve_bits(which);
  if (rules && lua_isnoneornil(L, 3)) {
    tr->resolve = c_resolve;
    tr->resolve_name = c_resolve_name;
  }
  tr->rules = rules;
  tr->with_creds = with_creds;
  tr->uid = (uid_t)uid;
  tr->gid = (gid_t)gid;
  lua_pushvalue(L, 4);
  tr->cb_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  int rc = uv_queue_work(core->loop, &tr->work, tree_work, tree_after);
  if (rc < 0) {
    luaL_unref(L, LUA_REGISTRYINDEX, tr->cb_ref);
    if (owned) close(root);
    free(tr->rules);
    free(tr->path);
    free(tr);
    return mb_push_error(L, rc, "remove_tree");
  }
  lua_pushboolean(L, 1);
  return 1;
}

/* core.fs_lock(path, content) -> fd | nil, message, CODE[, holder] */
static int fs_lock(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  size_t clen;
  const char *content = luaL_optlstring(L, 2, "", &clen);
  for (int tries = 0; tries < 16; tries++) {
    int fd = open(path, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0) {
      lua_pushfstring(L, "lock '%s'", path);
      return mb_push_errno(L, errno, lua_tostring(L, -1));
    }
    int r;
    do r = flock(fd, LOCK_EX | LOCK_NB);
    while (r < 0 && errno == EINTR);
    if (r < 0) {
      int err = errno;
      char holder[128];
      ssize_t n = err == EWOULDBLOCK ? pread(fd, holder, sizeof holder - 1, 0) : -1;
      close(fd);
      if (err != EWOULDBLOCK) {
        lua_pushfstring(L, "flock '%s'", path);
        return mb_push_errno(L, err, lua_tostring(L, -1));
      }
      lua_pushnil(L);
      lua_pushfstring(L, "EAGAIN: '%s' is locked by another open file", path);
      lua_pushliteral(L, "EAGAIN");
      lua_pushlstring(L, holder, n > 0 ? (size_t)n : 0);
      return 4;
    }
    /* the file we locked must still be the one at path */
    struct stat a, b;
    if (fstat(fd, &a) == 0 && stat(path, &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino && a.st_nlink > 0) {
      /* written first, then cut to its length: on ext4 a truncation to 0
       * makes the file's close flush it to disk (auto_da_alloc), a
       * fraction of a millisecond in every destroy */
      errno = EIO; /* a short write sets nothing */
      if ((clen && pwrite(fd, content, clen, 0) != (ssize_t)clen) || ftruncate(fd, (off_t)clen) < 0) {
        int err = errno;
        close(fd);
        lua_pushfstring(L, "write lock '%s'", path);
        return mb_push_errno(L, err, lua_tostring(L, -1));
      }
      lua_pushinteger(L, fd);
      return 1;
    }
    close(fd); /* removed or replaced meanwhile: take the new one */
  }
  lua_pushfstring(L, "lock '%s' (it keeps being replaced)", path);
  return mb_push_errno(L, EAGAIN, lua_tostring(L, -1));
}

/* ---- core.rmdir_tree ------------------------------------------------------ */

#define RMDIR_MAX_DEPTH 16

typedef struct {
  uv_work_t work;
  mb_core *core;
  int cb_ref;
  char *path;
  long removed;
  int err;
} rmdir_req;

/* Removes every directory under the open directory dfd (closed here), at
 * most depth levels down; 0 or an errno. */
static int rmdir_children(rmdir_req *r, int dfd, int depth) {
  DIR *d = fdopendir(dfd);
  if (!d) {
    int e = errno;
    close(dfd);
    return e;
  }
  int err = 0;
  struct dirent *de;
  /* removing entries while reading: start over until a pass removes nothing */
  for (int again = 1; again && !err;) {
    again = 0;
    rewinddir(d);
    while (!err && (de = readdir(d)) != NULL) {
      if (de->d_type != DT_DIR || strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0) continue;
      if (depth <= 0) {
        err = ELOOP;
        break;
      }
      int child = openat(dirfd(d), de->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (child < 0) err = errno == ENOENT ? 0 : errno;
      else err = rmdir_children(r, child, depth - 1);
      if (!err) {
        if (unlinkat(dirfd(d), de->d_name, AT_REMOVEDIR) == 0) {
          r->removed++;
          again = 1;
        } else if (errno != ENOENT) {
          err = errno;
        }
      }
    }
  }
  closedir(d);
  return err;
}

static void rmdir_work(uv_work_t *w) {
  rmdir_req *r = (rmdir_req *)w->data;
  int dfd = open(r->path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (dfd < 0) {
    r->err = errno == ENOENT ? 0 : errno;
    return;
  }
  r->err = rmdir_children(r, dfd, RMDIR_MAX_DEPTH);
  if (!r->err) {
    if (rmdir(r->path) == 0) r->removed++;
    else if (errno != ENOENT) r->err = errno;
  }
}

static void rmdir_after(uv_work_t *w, int status) {
  rmdir_req *r = (rmdir_req *)w->data;
  mb_core *core = r->core;
  if (status == UV_ECANCELED) r->err = ECANCELED;
  if (core->dead) {
    free(r->path);
    free(r);
    return;
  }
  lua_State *cbL = core->cbL;
  lua_rawgeti(cbL, LUA_REGISTRYINDEX, r->cb_ref);
  luaL_unref(cbL, LUA_REGISTRYINDEX, r->cb_ref);
  int nargs;
  if (!r->err) {
    lua_pushnil(cbL);
    lua_pushnumber(cbL, (lua_Number)r->removed);
    nargs = 2;
  } else {
    int uverr = uv_translate_sys_error(r->err);
    lua_pushfstring(cbL, "%s: %s (rmdir_tree %s)", uv_err_name(uverr), uv_strerror(uverr), r->path);
    lua_pushnil(cbL);
    lua_pushstring(cbL, uv_err_name(uverr));
    nargs = 3;
  }
  free(r->path);
  free(r);
  mb_call(core, cbL, nargs);
}

/* core.rmdir_tree(path, cb) -> true | nil, message, CODE */
static int fs_rmdir_tree(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  luaL_checktype(L, 2, LUA_TFUNCTION);
  if (path[0] != '/') return luaL_argerror(L, 1, "path must be absolute");
  mb_core *core = mb_core_get(L);
  rmdir_req *r = (rmdir_req *)calloc(1, sizeof(rmdir_req));
  char *copy = strdup(path);
  if (!r || !copy) {
    free(r);
    free(copy);
    return luaL_error(L, "out of memory");
  }
  r->work.data = r;
  r->core = core;
  r->path = copy;
  lua_pushvalue(L, 2);
  r->cb_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  int rc = uv_queue_work(core->loop, &r->work, rmdir_work, rmdir_after);
  if (rc < 0) {
    luaL_unref(L, LUA_REGISTRYINDEX, r->cb_ref);
    free(r->path);
    free(r);
    return mb_push_error(L, rc, "rmdir_tree");
  }
  lua_pushboolean(L, 1);
  return 1;
}

void mb_open_fs_tree(lua_State *L) {
  lua_pushcfunction(L, fs_remove_tree);
  lua_setfield(L, -2, "fs_remove_tree");
  lua_pushcfunction(L, fs_lock);
  lua_setfield(L, -2, "fs_lock");
  lua_pushcfunction(L, fs_rmdir_tree);
  lua_setfield(L, -2, "rmdir_tree");
}
