/* image_pack: a sandbox's overlay upper dir written as an OCI layer tar
 * (sandbox:commit, lua/moonbox/images/commit.lua).
 *
 * core.image_layer_pack(dir, out, opts, cb)
 *   On libuv's thread pool: walks dir (never following a symlink, every
 *   step openat/fdopendir relative to the level above) and writes out, a
 *   new file (O_EXCL, 0600), as a pax tar: directories, files (hard links
 *   kept as links), symlinks, FIFOs; an overlayfs whiteout (a 0/0
 *   character device) becomes ".wh.NAME", a directory with
 *   user.overlay.opaque=y gets a ".wh..wh..opq" entry (the OCI forms);
 *   sockets and other devices are left out. Owners are shifted back from
 *   the sandbox's id range: opts = {uid_base =, gid_base =, id_count =}
 *   (an id outside it becomes 65534); xattrs kept: user.* (but
 *   user.overlay.*) and security.capability. At most opts.max_entries
 *   entries and MAX_DEPTH levels, paths of at most PATH_MAX.
 *   cb(nil, bytes, entries) or cb(message, nil, CODE); a partial out is
 *   unlinked. Returns true once queued, or nil, message, CODE.
 */
#include "private.h"

#include <archive.h>
#include <archive_entry.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

#define MAX_DEPTH 256
#define XATTR_LIST_MAX_BYTES 65536

typedef struct {
  mb_core *core;
  uv_work_t work;
  int cb_ref;
  char *dir, *out;
  long long uid_base, gid_base, id_count, max_entries;
  long long bytes, entries;
  int err;
  char msg[512];
  struct archive *ar;
  struct archive_entry_linkresolver *lr;
} pack_job;

static int pack_fail(pack_job *j, int err, const char *what, const char *path) {
  if (!j->err) {
    j->err = err ? err : EIO;
    snprintf(j->msg, sizeof j->msg, "%s: %s (%s '%.300s')", uv_err_name(-j->err), strerror(j->err), what, path);
  }
  return -1;
}

static int archive_fail(pack_job *j, const char *path) {
  if (!j->err) {
    j->err = EIO;
    snprintf(j->msg, sizeof j->msg, "EIO: writing the layer: %s ('%.300s')",
             archive_error_string(j->ar) ? archive_error_string(j->ar) : "?", path);
  }
  return -1;
}

static la_int64_t unshift(long long id, long long base, long long count) {
  return id >= base && id < base + count ? id - base : 65534;
}

/* user.* (not user.overlay.*) and security.capability of fd into e */
static int copy_xattrs(pack_job *j, int fd, struct archive_entry *e, const char *path, int *opaque) {
  static __thread char names[XATTR_LIST_MAX_BYTES];
  static __thread char value[XATTR_LIST_MAX_BYTES];
  ssize_t n = flistxattr(fd, names, sizeof names);
  if (n < 0) return errno == ENOTSUP ? 0 : pack_fail(j, errno, "listxattr", path);
  for (char *k = names; k < names + n; k += strlen(k) + 1) {
    int overlay = strncmp(k, "user.overlay.", 13) == 0;
    if (!overlay && strncmp(k, "user.", 5) != 0 && strcmp(k, "security.capability") != 0) continue;
    ssize_t v = fgetxattr(fd, k, value, sizeof value);
    if (v < 0) {
      if (errno == ENODATA) continue;
      return pack_fail(j, errno, "getxattr", path);
    }
    if (overlay) {
      if (strcmp(k, "user.overlay.opaque") == 0 && v == 1 && value[0] == 'y') *opaque = 1;
      continue;
    }
    archive_entry_xattr_add_entry(e, k, value, (size_t)v);
  }
  return 0;
}

static int write_entry(pack_job *j, struct archive_entry *e, int fd, const char *path) {
  if (++j->entries > j->max_entries) return pack_fail(j, E2BIG, "more entries than the limit", path);
  struct archive_entry *sparse = NULL;
  archive_entry_linkify(j->lr, &e, &sparse);
  if (!e) return 0;
  if (archive_write_header(j->ar, e) < ARCHIVE_WARN) return archive_fail(j, path);
  if (fd >= 0 && archive_entry_size(e) > 0) {
    static __thread char buf[1 << 16];
    for (;;) {
      ssize_t n = read(fd, buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return pack_fail(j, errno, "read", path);
      if (n == 0) break;
      if (archive_write_data(j->ar, buf, (size_t)n) < 0) return archive_fail(j, path);
      j->bytes += n;
    }
  }
  return 0;
}

static struct archive_entry *entry_of(pack_job *j, const char *path, const struct stat *st) {
  struct archive_entry *e = archive_entry_new();
  if (!e) return NULL;
  archive_entry_set_pathname(e, path);
  archive_entry_copy_stat(e, st);
  archive_entry_set_uid(e, unshift(st->st_uid, j->uid_base, j->id_count));
  archive_entry_set_gid(e, unshift(st->st_gid, j->gid_base, j->id_count));
  archive_entry_set_uname(e, NULL);
  archive_entry_set_gname(e, NULL);
  return e;
}

/* One entry name in directory dfd, path its layer-relative name. Returns
 * the directory's fd when it is one to descend into (>= 0), -2 when done
 * with it, -1 on failure. */
static int pack_one(pack_job *j, int dfd, const char *name, const char *path) {
  struct stat st;
  if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) < 0) return pack_fail(j, errno, "stat", path);
  char wh[PATH_MAX];
  if (S_ISCHR(st.st_mode) && st.st_rdev == 0) { /* an overlayfs whiteout */
    const char *slash = strrchr(path, '/');
    int plen = slash ? (int)(slash - path + 1) : 0;
    if (snprintf(wh, sizeof wh, "%.*s.wh.%s", plen, path, name) >= (int)sizeof wh)
      return pack_fail(j, ENAMETOOLONG, "path", path);
    struct stat ws = st;
    ws.st_mode = S_IFREG | 0600;
    ws.st_size = 0;
    ws.st_nlink = 1;
    struct archive_entry *e = entry_of(j, wh, &ws);
    if (!e) return pack_fail(j, ENOMEM, "entry", path);
    int rc = write_entry(j, e, -1, path);
    archive_entry_free(e);
    return rc < 0 ? -1 : -2;
  }
  if (!S_ISDIR(st.st_mode) && !S_ISREG(st.st_mode) && !S_ISLNK(st.st_mode) && !S_ISFIFO(st.st_mode))
    return -2; /* sockets, devices: not part of a layer */
  struct archive_entry *e = entry_of(j, path, &st);
  if (!e) return pack_fail(j, ENOMEM, "entry", path);
  int fd = -1, rc = 0, opaque = 0;
  if (S_ISLNK(st.st_mode)) {
    char target[PATH_MAX];
    ssize_t n = readlinkat(dfd, name, target, sizeof target - 1);
    if (n < 0) rc = pack_fail(j, errno, "readlink", path);
    else {
      target[n] = 0;
      archive_entry_set_symlink(e, target);
    }
  } else if (S_ISREG(st.st_mode) || S_ISDIR(st.st_mode)) {
    fd = openat(dfd, name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | (S_ISDIR(st.st_mode) ? O_DIRECTORY : O_NOCTTY));
    if (fd < 0) rc = pack_fail(j, errno, "open", path);
    else rc = copy_xattrs(j, fd, e, path, &opaque);
  }
  if (rc == 0) rc = write_entry(j, e, S_ISREG(st.st_mode) ? fd : -1, path);
  archive_entry_free(e);
  if (rc == 0 && opaque) {
    if (snprintf(wh, sizeof wh, "%s/.wh..wh..opq", path) >= (int)sizeof wh)
      rc = pack_fail(j, ENAMETOOLONG, "path", path);
    else {
      struct stat os = st;
      os.st_mode = S_IFREG | 0600;
      os.st_size = 0;
      os.st_nlink = 1;
      struct archive_entry *oe = entry_of(j, wh, &os);
      if (!oe) rc = pack_fail(j, ENOMEM, "entry", path);
      else {
        rc = write_entry(j, oe, -1, path);
        archive_entry_free(oe);
      }
    }
  }
  if (rc < 0 || !S_ISDIR(st.st_mode)) {
    if (fd >= 0) close(fd);
    return rc < 0 ? -1 : -2;
  }
  return fd;
}

typedef struct {
  DIR *d;
  size_t plen; /* the level's path length in the shared path buffer */
} level;

static void pack_run(uv_work_t *w) {
  pack_job *j = (pack_job *)w->data;
  int outfd = open(j->out, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (outfd < 0) {
    pack_fail(j, errno, "create", j->out);
    return;
  }
  j->ar = archive_write_new();
  j->lr = archive_entry_linkresolver_new();
  if (!j->ar || !j->lr) {
    pack_fail(j, ENOMEM, "archive", j->out);
    close(outfd);
    unlink(j->out);
    return;
  }
  archive_entry_linkresolver_set_strategy(j->lr, ARCHIVE_FORMAT_TAR_PAX_RESTRICTED);
  archive_write_set_format_pax_restricted(j->ar);
  archive_write_set_bytes_in_last_block(j->ar, 1);
  if (archive_write_open_fd(j->ar, outfd) != ARCHIVE_OK) archive_fail(j, j->out);
  static __thread char path[PATH_MAX];
  level stack[MAX_DEPTH];
  int depth = 0;
  int top = j->err ? -1 : open(j->dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (top < 0 && !j->err) pack_fail(j, errno, "open", j->dir);
  if (top >= 0) {
    stack[0].d = fdopendir(top);
    stack[0].plen = 0;
    if (!stack[0].d) {
      pack_fail(j, errno, "opendir", j->dir);
      close(top);
    } else depth = 1;
  }
  while (depth > 0 && !j->err) {
    level *lv = &stack[depth - 1];
    errno = 0;
    struct dirent *de = readdir(lv->d);
    if (!de) {
      if (errno) pack_fail(j, errno, "readdir", path);
      closedir(lv->d);
      depth--;
      continue;
    }
    if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0) continue;
    size_t nlen = strlen(de->d_name);
    size_t at = lv->plen ? lv->plen + 1 : 0;
    if (at + nlen + 1 > sizeof path) {
      pack_fail(j, ENAMETOOLONG, "path", path);
      break;
    }
    if (lv->plen) path[lv->plen] = '/';
    memcpy(path + at, de->d_name, nlen + 1);
    int sub = pack_one(j, dirfd(lv->d), de->d_name, path);
    if (sub >= 0) {
      if (depth == MAX_DEPTH) {
        close(sub);
        pack_fail(j, ELOOP, "deeper than the limit", path);
        break;
      }
      DIR *d = fdopendir(sub);
      if (!d) {
        close(sub);
        pack_fail(j, errno, "opendir", path);
        break;
      }
      stack[depth].d = d;
      stack[depth].plen = at + nlen;
      depth++;
    }
    /* the level's own path back for its next entry */
    path[stack[depth - 1].plen] = 0;
  }
  while (depth > 0) closedir(stack[--depth].d);
  if (!j->err) {
    /* links whose other names never came (hard links out of the dir): none in tar's strategy */
    if (archive_write_close(j->ar) != ARCHIVE_OK) archive_fail(j, j->out);
  }
  archive_write_free(j->ar);
  j->ar = NULL;
  archive_entry_linkresolver_free(j->lr);
  j->lr = NULL;
  if (close(outfd) < 0 && !j->err) pack_fail(j, errno, "close", j->out);
  if (j->err) unlink(j->out);
}

static void pack_done(uv_work_t *w, int status) {
  pack_job *j = (pack_job *)w->data;
  mb_core *core = j->core;
  if (!core->dead) {
    lua_State *L = core->cbL;
    lua_rawgeti(L, LUA_REGISTRYINDEX, j->cb_ref);
    luaL_unref(L, LUA_REGISTRYINDEX, j->cb_ref);
    if (status < 0) {
      lua_pushfstring(L, "%s: %s (image layer pack)", uv_err_name(status), uv_strerror(status));
      lua_pushnil(L);
      lua_pushstring(L, uv_err_name(status));
    } else if (j->err) {
      lua_pushstring(L, j->msg);
      lua_pushnil(L);
      lua_pushstring(L, uv_err_name(-j->err));
    } else {
      lua_pushnil(L);
      lua_pushnumber(L, (lua_Number)j->bytes);
      lua_pushnumber(L, (lua_Number)j->entries);
    }
    mb_call(core, L, 3);
  }
  free(j->dir);
  free(j->out);
  free(j);
}

static int image_layer_pack(lua_State *L) {
  const char *dir = luaL_checkstring(L, 1);
  const char *out = luaL_checkstring(L, 2);
  luaL_checktype(L, 3, LUA_TTABLE);
  luaL_checktype(L, 4, LUA_TFUNCTION);
  pack_job *j = (pack_job *)calloc(1, sizeof *j);
  if (!j) return luaL_error(L, "out of memory");
  j->uid_base = (long long)mb_opt_intfield(L, 3, "uid_base", 0);
  j->gid_base = (long long)mb_opt_intfield(L, 3, "gid_base", 0);
  j->id_count = (long long)mb_opt_intfield(L, 3, "id_count", 1);
  j->max_entries = (long long)mb_opt_intfield(L, 3, "max_entries", 1000000);
  j->dir = strdup(dir);
  j->out = strdup(out);
  if (!j->dir || !j->out) {
    free(j->dir);
    free(j->out);
    free(j);
    return luaL_error(L, "out of memory");
  }
  j->core = mb_core_get(L);
  j->work.data = j;
  lua_pushvalue(L, 4);
  j->cb_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  int rc = uv_queue_work(j->core->loop, &j->work, pack_run, pack_done);
  if (rc < 0) {
    luaL_unref(L, LUA_REGISTRYINDEX, j->cb_ref);
    free(j->dir);
    free(j->out);
    free(j);
    return mb_push_error(L, rc, "image layer pack");
  }
  lua_pushboolean(L, 1);
  return 1;
}

void mb_open_image_pack(lua_State *L) {
  lua_pushcfunction(L, image_layer_pack);
  lua_setfield(L, -2, "image_layer_pack");
}
