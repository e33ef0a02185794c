/* image_unpack: one OCI image layer (a tar, plain or compressed) unpacked
 * into a directory of its own, and the sha256 of a blob.
 *
 * core.image_layer_open(blob, dir, opts) -> job | nil, message, CODE
 *   blob: the layer's file (read through libarchive: tar, gzip, zstd, xz,
 *   bzip2, or plain); dir: an existing empty directory the layer goes into.
 *   opts = {max_bytes =, max_entries =, xattr_ns = "trusted"|"user",
 *   chown = bool, uid_base =, gid_base =, id_count =}: with chown, an
 *   entry's owner u:g becomes uid_base+u:gid_base+g (a sandbox's id range,
 *   so root in the image is root inside), and an owner >= id_count is
 *   refused. Nothing is read until the first step.
 * job:step(cb)
 *   Unpacks up to STEP_BYTES of file data on libuv's thread pool, then
 *   cb(nil, done, bytes, entries): done is true once the layer is whole;
 *   bytes and entries count what the job has written so far. On the first
 *   entry refused: cb(message, "REFUSED", entry); on an I/O failure:
 *   cb(message, "ERRNO_NAME", entry). After done or a failure the job is
 *   spent. The step returns true once queued, or nil, message, CODE.
 * job:close() frees the reader (also done by the GC when idle).
 *
 * Why not archive_write_disk: every entry is created here with *at calls
 * relative to a directory fd that openat2 reached beneath the layer with
 * RESOLVE_NO_SYMLINKS, a single final component, O_EXCL/O_NOFOLLOW; so a
 * hostile tar (../, absolute names, a symlink then a write through it, a
 * hard link to a host file) cannot make a write land outside dir.
 * The OCI rules: ".wh.NAME" becomes an overlayfs whiteout (a 0/0 character
 * device, which Linux >= 5.8 lets an unprivileged user create), and
 * ".wh..wh..opq" an opaque directory (xattr <xattr_ns>.overlay.opaque=y;
 * the store asks for "user": sandboxes mount their overlay with userxattr).
 * Refused: device nodes, sockets, absolute or ".." names, a path through a
 * symlink, a hard link whose target is not in this layer, an xattr in the
 * overlay namespaces (a layer may not forge overlay metadata), a layer over
 * max_bytes (the sum of file sizes, sparse holes included) or max_entries,
 * or directories whose paths pass DIR_BYTES_MAX (kept for their final modes).
 * Kept: regular files (sparse holes stay holes, and so do blocks of zeros),
 * directories, symlinks
 * (their targets are never followed here, and resolve inside the sandbox's
 * root at run time), hard links, FIFOs, modes (setuid included), mtimes,
 * owners (chown = true), user.* xattrs and security.capability. Other
 * xattrs (ACLs, SELinux labels) are dropped.
 *
 * core.sha256_file(path, cb[, copy_to])
 *   On the thread pool: cb(nil, hex, size) with the file's sha256; with
 *   copy_to, the bytes are also written to that new file (O_EXCL, 0600), so
 *   a blob is hashed as it enters the store. cb(message, nil, CODE) on a
 *   failure (a partial copy is unlinked).
 */
#include "openat2.h"
#include "private.h"

#include <archive.h>
#include <archive_entry.h>
#include <errno.h>
#include <fcntl.h>
#include <nettle/sha2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

#define JOB_META "moonbox.image_layer"
#define STEP_BYTES (16 << 20) /* file data per thread-pool step */
#define MSG_MAX 512
#define ENTRY_MAX 4096
#define WHITEOUT ".wh."
#define OPAQUE ".wh..wh..opq"

typedef struct {
  char *path; /* layer-relative */
  mode_t mode;
  struct timespec mtime;
} dir_fixup;

typedef struct {
  mb_core *core;
  struct archive *ar;
  int dirfd;
  long long max_bytes, max_entries;
  int chown;
  long long uid_base, gid_base, id_count; /* owners shifted into a sandbox's id range */
  char xattr_ns[16];
  int busy, spent, orphan; /* orphan: collected by Lua while a step ran */
  uv_work_t work;
  int cb_ref, self_ref;
  /* progress */
  long long bytes, entries, declared;
  int done;
  /* directories get their final mode and mtime last (a 0555 one must take
   * its entries first) */
  dir_fixup *dirs;
  size_t ndirs, capdirs, dir_bytes;
  /* the failure of a step */
  int err; /* errno, or -1: refused */
  char msg[MSG_MAX];
  char entry[ENTRY_MAX];
} layer_job;

/* beneath the layer only: no symlink, no magic link, no other mount */
static int openat2_fd(int dirfd, const char *path, int flags) {
  return mb_openat2(dirfd, path, (unsigned long long)(flags | O_CLOEXEC), 0,
                    RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV);
}

static int refuse(layer_job *j, const char *entry, const char *why) {
  j->err = -1;
  snprintf(j->entry, sizeof j->entry, "%s", entry ? entry : "");
  snprintf(j->msg, sizeof j->msg, "layer entry '%.200s' refused: %s", j->entry, why);
  return -1;
}

static int fail(layer_job *j, const char *entry, int err, const char *what) {
  j->err = err ? err : EIO;
  snprintf(j->entry, sizeof j->entry, "%s", entry ? entry : "");
  snprintf(j->msg, sizeof j->msg, "%s: %s (%s '%.200s')", uv_err_name(-j->err), strerror(j->err), what, j->entry);
  return -1;
}

/* The entry's name made layer-relative into out ("./a//b/" -> "a/b"); a
 * name that is absolute, has a ".." component or is too long is refused.
 * Returns 0, 1 for the layer's root itself (skipped), -1 refused. */
static int clean_path(layer_job *j, const char *name, char *out, size_t size) {
  if (!name || !*name) return refuse(j, "", "empty name");
  if (name[0] == '/') return refuse(j, name, "absolute path");
  size_t o = 0;
  const char *p = name;
  while (*p) {
    while (*p == '/') p++;
    const char *s = p;
    while (*p && *p != '/') p++;
    size_t n = (size_t)(p - s);
    if (n == 0 || (n == 1 && s[0] == '.')) continue;
    if (n == 2 && s[0] == '.' && s[1] == '.') return refuse(j, name, "'..' in path");
    if (n > 255) return refuse(j, name, "name component longer than 255 bytes");
    if (o + n + 2 > size) return refuse(j, name, "path too long");
    if (o) out[o++] = '/';
    memcpy(out + o, s, n);
    o += n;
  }
  out[o] = 0;
  return o == 0 ? 1 : 0;
}

/* Opens the directory holding rel's last component (its O_PATH fd) and
 * points *base at that component. With create, missing directories on the
 * way are made (0755). A symlink on the way is refused. */
static int open_parent(layer_job *j, const char *entry, char *rel, const char **base, int create) {
  char *slash = strrchr(rel, '/');
  if (!slash) {
    *base = rel;
    int fd = dup(j->dirfd);
    if (fd < 0) return fail(j, entry, errno, "dup");
    return fd;
  }
  *slash = 0;
  *base = slash + 1;
  int fd = openat2_fd(j->dirfd, rel, O_PATH | O_DIRECTORY);
  if (fd >= 0 || errno != ENOENT || !create) {
    int e = errno;
    *slash = '/';
    if (fd >= 0) return fd;
    if (e == ELOOP || e == EXDEV) return refuse(j, entry, "path passes through a symlink");
    if (e == ENOTDIR) return refuse(j, entry, "a parent is not a directory");
    if (e == ENOENT) return refuse(j, entry, "link target is not in this layer");
    return fail(j, entry, e, "open parent");
  }
  /* walk from the top, making what is missing */
  int cur = dup(j->dirfd);
  if (cur < 0) {
    *slash = '/';
    return fail(j, entry, errno, "dup");
  }
  char *s = rel;
  for (;;) {
    char *e = strchr(s, '/');
    if (e) *e = 0;
    int next = openat2_fd(cur, s, O_PATH | O_DIRECTORY);
    if (next < 0 && errno == ENOENT) {
      if (mkdirat(cur, s, 0755) < 0 && errno != EEXIST) {
        int er = errno;
        close(cur);
        if (e) *e = '/';
        *slash = '/';
        return fail(j, entry, er, "mkdir");
      }
      /* a directory the tar did not list: root's in the sandbox */
      if (j->chown && fchownat(cur, s, (uid_t)j->uid_base, (gid_t)j->gid_base, AT_SYMLINK_NOFOLLOW) < 0) {
        int er = errno;
        close(cur);
        if (e) *e = '/';
        *slash = '/';
        return fail(j, entry, er, "chown");
      }
      next = openat2_fd(cur, s, O_PATH | O_DIRECTORY);
    }
    int er = errno;
    close(cur);
    if (e) *e = '/';
    if (next < 0) {
      *slash = '/';
      if (er == ELOOP || er == EXDEV) return refuse(j, entry, "path passes through a symlink");
      if (er == ENOTDIR) return refuse(j, entry, "a parent is not a directory");
      return fail(j, entry, er, "open parent");
    }
    cur = next;
    if (!e) break;
    s = e + 1;
  }
  *slash = '/';
  return cur;
}

/* Removes what is at name in pfd unless it is a directory and keep_dir. */
static int clear_name(layer_job *j, const char *entry, int pfd, const char *name, int keep_dir, int *is_dir) {
  struct stat st;
  *is_dir = 0;
  if (fstatat(pfd, name, &st, AT_SYMLINK_NOFOLLOW) < 0) {
    if (errno == ENOENT) return 0;
    return fail(j, entry, errno, "stat");
  }
  if (S_ISDIR(st.st_mode)) {
    if (keep_dir) {
      *is_dir = 1;
      return 0;
    }
    if (unlinkat(pfd, name, AT_REMOVEDIR) < 0) {
      if (errno == ENOTEMPTY || errno == EEXIST) return refuse(j, entry, "replaces a non-empty directory");
      return fail(j, entry, errno, "rmdir");
    }
    return 0;
  }
  if (unlinkat(pfd, name, 0) < 0) return fail(j, entry, errno, "unlink");
  return 0;
}

static int is_overlay_xattr(const char *name) {
  return strncmp(name, "trusted.overlay.", 16) == 0 || strncmp(name, "user.overlay.", 13) == 0;
}

/* Owner, mode, xattrs and mtime of what was made at name (fd: an open fd
 * of it, or -1 for a symlink). chown first: it clears setuid bits and
 * file capabilities, which are set after it. */
static int chown_entry(layer_job *j, const char *entry, struct archive_entry *e, int pfd, const char *name) {
  if (!j->chown) return 0;
  la_int64_t uid = archive_entry_uid(e), gid = archive_entry_gid(e);
  if (uid < 0 || gid < 0 || uid >= j->id_count || gid >= j->id_count)
    return refuse(j, entry, "owner outside the sandbox's id range");
  if (fchownat(pfd, name, (uid_t)(j->uid_base + uid), (gid_t)(j->gid_base + gid), AT_SYMLINK_NOFOLLOW) < 0)
    return fail(j, entry, errno, "chown");
  return 0;
}

static int apply_meta(layer_job *j, const char *entry, struct archive_entry *e, int pfd, const char *name, int fd) {
  if (chown_entry(j, entry, e, pfd, name) < 0) return -1;
  if (fd < 0) return 0; /* a symlink: no mode, no xattrs */
  if (fchmod(fd, archive_entry_mode(e) & 07777) < 0) return fail(j, entry, errno, "chmod");
  const char *xname;
  const void *value;
  size_t size;
  archive_entry_xattr_reset(e);
  while (archive_entry_xattr_next(e, &xname, &value, &size) == ARCHIVE_OK) {
    if (is_overlay_xattr(xname)) return refuse(j, entry, "xattr in the overlay namespace");
    if (strncmp(xname, "user.", 5) != 0 && strcmp(xname, "security.capability") != 0) continue;
    if (fsetxattr(fd, xname, value, size, 0) < 0) {
      if (errno == EPERM && strcmp(xname, "security.capability") == 0)
        return fail(j, entry, EPERM, "setting its file capability needs a root runtime: setxattr");
      return fail(j, entry, errno, "setxattr");
    }
  }
  struct timespec ts[2] = {{archive_entry_mtime(e), archive_entry_mtime_nsec(e)},
                           {archive_entry_mtime(e), archive_entry_mtime_nsec(e)}};
  futimens(fd, ts);
  return 0;
}

static int write_data(layer_job *j, const char *entry, struct archive_entry *e, int fd, long long *budget) {
  const void *buf;
  size_t len;
  la_int64_t off;
  for (;;) {
    int r = archive_read_data_block(j->ar, &buf, &len, &off);
    if (r == ARCHIVE_EOF) break;
    if (r < ARCHIVE_WARN) {
      snprintf(j->msg, sizeof j->msg, "EIO: layer data unreadable at '%.200s': %s", entry,
               archive_error_string(j->ar) ? archive_error_string(j->ar) : "?");
      j->err = EIO;
      snprintf(j->entry, sizeof j->entry, "%s", entry);
      return -1;
    }
    if (off < 0 || off + (la_int64_t)len > archive_entry_size(e)) return refuse(j, entry, "data beyond its size");
    const char *p = (const char *)buf;
    /* a block of zeros stays a hole (the final ftruncate gives the size):
     * a layer of compressed zeros costs no disk */
    if (len > 0 && p[0] == 0 && memcmp(p, p + 1, len - 1) == 0) {
      j->bytes += (long long)len;
      *budget -= (long long)len;
      continue;
    }
    while (len) {
      ssize_t w = pwrite(fd, p, len, (off_t)off);
      if (w < 0) {
        if (errno == EINTR) continue;
        return fail(j, entry, errno, "write");
      }
      p += w;
      off += w;
      len -= (size_t)w;
      j->bytes += w;
      *budget -= w;
    }
  }
  if (ftruncate(fd, (off_t)archive_entry_size(e)) < 0) return fail(j, entry, errno, "truncate");
  return 0;
}

#define DIR_BYTES_MAX (64 << 20) /* the remembered directories' paths, at most */

static int remember_dir(layer_job *j, const char *rel, struct archive_entry *e) {
  j->dir_bytes += strlen(rel) + 1 + sizeof(dir_fixup);
  if (j->dir_bytes > DIR_BYTES_MAX) return refuse(j, rel, "more directories than the limit");
  if (j->ndirs == j->capdirs) {
    size_t cap = j->capdirs ? j->capdirs * 2 : 64;
    dir_fixup *n = (dir_fixup *)realloc(j->dirs, cap * sizeof *n);
    if (!n) return fail(j, rel, ENOMEM, "remember directory");
    j->dirs = n;
    j->capdirs = cap;
  }
  char *copy = strdup(rel);
  if (!copy) return fail(j, rel, ENOMEM, "remember directory");
  dir_fixup *d = &j->dirs[j->ndirs++];
  d->path = copy;
  d->mode = archive_entry_mode(e) & 07777;
  d->mtime.tv_sec = archive_entry_mtime(e);
  d->mtime.tv_nsec = archive_entry_mtime_nsec(e);
  return 0;
}

/* Deepest first, so a directory's mtime is set after its entries change it. */
static int fix_dirs(layer_job *j) {
  for (size_t i = j->ndirs; i-- > 0;) {
    dir_fixup *d = &j->dirs[i];
    int fd = openat2_fd(j->dirfd, d->path, O_RDONLY | O_DIRECTORY);
    if (fd < 0) return fail(j, d->path, errno, "open directory");
    int rc = fchmod(fd, d->mode);
    struct timespec ts[2] = {d->mtime, d->mtime};
    if (rc == 0) futimens(fd, ts);
    int e = errno;
    close(fd);
    if (rc < 0) return fail(j, d->path, e, "chmod");
  }
  return 0;
}

static int whiteout(layer_job *j, const char *entry, int pfd, const char *base) {
  if (strcmp(base, OPAQUE) == 0) {
    /* the directory holding it: pfd is O_PATH, setxattr needs a real fd */
    int fd = openat(pfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return fail(j, entry, errno, "open directory");
    char name[40];
    snprintf(name, sizeof name, "%s.overlay.opaque", j->xattr_ns);
    int rc = fsetxattr(fd, name, "y", 1, 0);
    int e = errno;
    close(fd);
    return rc < 0 ? fail(j, entry, e, "setxattr") : 0;
  }
  const char *target = base + strlen(WHITEOUT);
  if (!*target || strcmp(target, ".") == 0 || strcmp(target, "..") == 0) return refuse(j, entry, "whiteout of nothing");
  if (strncmp(target, WHITEOUT, strlen(WHITEOUT)) == 0) return refuse(j, entry, "whiteout of a whiteout");
  int is_dir;
  if (clear_name(j, entry, pfd, target, 0, &is_dir) < 0) return -1;
  if (mknodat(pfd, target, S_IFCHR | 0, makedev(0, 0)) < 0) return fail(j, entry, errno, "mknod whiteout");
  return 0;
}

/* One entry. Returns 0, or -1 with the job's failure set. */
static int unpack_entry(layer_job *j, struct archive_entry *e, long long *budget) {
  const char *name = archive_entry_pathname(e);
  char rel[ENTRY_MAX];
  int c = clean_path(j, name, rel, sizeof rel);
  if (c < 0) return -1;
  if (c == 1) return 0; /* "./": the layer's root */
  if (++j->entries > j->max_entries) return refuse(j, name, "more entries than the limit");
  mode_t type = archive_entry_filetype(e);
  const char *hardlink = archive_entry_hardlink(e);
  if (!hardlink) {
    if (type == AE_IFCHR || type == AE_IFBLK) return refuse(j, name, "device node");
    if (type == AE_IFSOCK) return refuse(j, name, "socket");
    if (type != AE_IFREG && type != AE_IFDIR && type != AE_IFLNK && type != AE_IFIFO)
      return refuse(j, name, "unknown entry type");
  }
  if (type == AE_IFREG && !hardlink) {
    long long size = archive_entry_size(e);
    if (size < 0 || size > j->max_bytes - j->declared) return refuse(j, name, "layer larger than the limit");
    j->declared += size;
  }
  const char *base;
  int pfd = open_parent(j, name, rel, &base, 1);
  if (pfd < 0) return -1;
  int rc = -1, fd = -1, is_dir = 0;
  if (strncmp(base, WHITEOUT, strlen(WHITEOUT)) == 0) {
    rc = whiteout(j, name, pfd, base);
    goto out;
  }
  if (hardlink) {
    char trel[ENTRY_MAX];
    int tc = clean_path(j, hardlink, trel, sizeof trel);
    if (tc != 0) {
      if (tc == 1) refuse(j, name, "hard link to the layer's root");
      else {
        snprintf(j->entry, sizeof j->entry, "%s", name);
        snprintf(j->msg, sizeof j->msg, "layer entry '%.200s' refused: hard link target '%.200s' leaves the layer",
                 name, hardlink);
      }
      goto out;
    }
    const char *tbase;
    int tfd = open_parent(j, name, trel, &tbase, 0);
    if (tfd < 0) goto out;
    struct stat st;
    if (fstatat(tfd, tbase, &st, AT_SYMLINK_NOFOLLOW) < 0) {
      close(tfd);
      refuse(j, name, "hard link target is not in this layer");
      goto out;
    }
    if (!S_ISREG(st.st_mode) && !S_ISLNK(st.st_mode) && !S_ISFIFO(st.st_mode)) {
      close(tfd);
      refuse(j, name, "hard link to something not a file");
      goto out;
    }
    if (clear_name(j, name, pfd, base, 0, &is_dir) < 0) {
      close(tfd);
      goto out;
    }
    if (linkat(tfd, tbase, pfd, base, 0) < 0) {
      int er = errno;
      close(tfd);
      fail(j, name, er, "link");
      goto out;
    }
    close(tfd);
    rc = 0;
    goto out;
  }
  if (clear_name(j, name, pfd, base, type == AE_IFDIR, &is_dir) < 0) goto out;
  switch (type) {
  case AE_IFDIR:
    if (!is_dir && mkdirat(pfd, base, 0700) < 0) {
      fail(j, name, errno, "mkdir");
      goto out;
    }
    fd = openat2_fd(pfd, base, O_RDONLY | O_DIRECTORY);
    if (fd < 0) {
      fail(j, name, errno, "open directory");
      goto out;
    }
    if (apply_meta(j, name, e, pfd, base, fd) < 0) goto out;
    /* owner-writable until the end (the entries below still come) */
    if (fchmod(fd, (archive_entry_mode(e) & 07777) | 0700) < 0) {
      fail(j, name, errno, "chmod");
      goto out;
    }
    rc = remember_dir(j, rel, e);
    break;
  case AE_IFREG:
    fd = openat(pfd, base, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) {
      fail(j, name, errno, "create");
      goto out;
    }
    if (write_data(j, name, e, fd, budget) < 0) goto out;
    rc = apply_meta(j, name, e, pfd, base, fd);
    break;
  case AE_IFLNK: {
    const char *target = archive_entry_symlink(e);
    if (!target || !*target) {
      refuse(j, name, "symlink without a target");
      goto out;
    }
    if (symlinkat(target, pfd, base) < 0) {
      fail(j, name, errno, "symlink");
      goto out;
    }
    rc = apply_meta(j, name, e, pfd, base, -1);
    break;
  }
  case AE_IFIFO:
    if (mkfifoat(pfd, base, 0600) < 0) {
      fail(j, name, errno, "mkfifo");
      goto out;
    }
    fd = openat(pfd, base, O_PATH | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
      fail(j, name, errno, "open fifo");
      goto out;
    }
    {
      /* fchmod and fsetxattr refuse O_PATH fds: go through /proc/self/fd */
      char p[64];
      snprintf(p, sizeof p, "/proc/self/fd/%d", fd);
      if (chown_entry(j, name, e, pfd, base) < 0) goto out;
      if (chmod(p, archive_entry_mode(e) & 07777) < 0) {
        fail(j, name, errno, "chmod");
        goto out;
      }
    }
    rc = 0;
    break;
  }
out:
  if (fd >= 0) close(fd);
  close(pfd);
  if (rc < 0 && j->err == 0) j->err = -1;
  return rc;
}

static void step_run(uv_work_t *w) {
  layer_job *j = (layer_job *)w->data;
  long long budget = STEP_BYTES;
  while (budget > 0) {
    struct archive_entry *e;
    int r = archive_read_next_header(j->ar, &e);
    if (r == ARCHIVE_EOF) {
      if (fix_dirs(j) == 0) j->done = 1;
      return;
    }
    if (r < ARCHIVE_WARN) {
      j->err = EIO;
      snprintf(j->msg, sizeof j->msg, "EIO: layer unreadable: %s",
               archive_error_string(j->ar) ? archive_error_string(j->ar) : "?");
      return;
    }
    if (unpack_entry(j, e, &budget) < 0) return;
  }
}

static void job_free_reader(layer_job *j) {
  if (j->ar) archive_read_free(j->ar);
  j->ar = NULL;
  if (j->dirfd >= 0) close(j->dirfd);
  j->dirfd = -1;
  for (size_t i = 0; i < j->ndirs; i++) free(j->dirs[i].path);
  free(j->dirs);
  j->dirs = NULL;
  j->ndirs = j->capdirs = 0;
}

static void step_done(uv_work_t *w, int status) {
  layer_job *j = (layer_job *)w->data;
  j->busy = 0;
  mb_core *core = j->core;
  if (j->orphan || core->dead) {
    /* Lua let go of the job while it ran (or is closing): its refs went with it */
    job_free_reader(j);
    if (j->orphan) free(j);
    else j->spent = 1;
    return;
  }
  lua_State *L = core->cbL;
  lua_rawgeti(L, LUA_REGISTRYINDEX, j->cb_ref);
  luaL_unref(L, LUA_REGISTRYINDEX, j->cb_ref);
  luaL_unref(L, LUA_REGISTRYINDEX, j->self_ref);
  int nargs;
  if (status < 0) {
    j->spent = 1;
    lua_pushfstring(L, "%s: %s (image layer)", uv_err_name(status), uv_strerror(status));
    lua_pushstring(L, uv_err_name(status));
    nargs = 2;
  } else if (j->err) {
    j->spent = 1;
    lua_pushstring(L, j->msg);
    lua_pushstring(L, j->err < 0 ? "REFUSED" : uv_err_name(-j->err));
    lua_pushstring(L, j->entry);
    nargs = 3;
  } else {
    lua_pushnil(L);
    lua_pushboolean(L, j->done);
    lua_pushnumber(L, (lua_Number)j->bytes);
    lua_pushnumber(L, (lua_Number)j->entries);
    nargs = 4;
    if (j->done) j->spent = 1;
  }
  if (j->spent) job_free_reader(j);
  mb_call(core, L, nargs);
}

/* The userdata holds a pointer: a step in flight keeps using the job after
 * Lua collected the userdata (state closing), and frees it at its end. */
static layer_job *job_check(lua_State *L) {
  layer_job **box = (layer_job **)luaL_checkudata(L, 1, JOB_META);
  if (!*box) luaL_error(L, "image layer: job is closed");
  return *box;
}

static int job_step(lua_State *L) {
  layer_job *j = job_check(L);
  luaL_checktype(L, 2, LUA_TFUNCTION);
  if (j->busy) return luaL_error(L, "image layer: a step is already running");
  if (j->spent || !j->ar) return mb_push_errno(L, EINVAL, "image layer: job is spent");
  lua_pushvalue(L, 2);
  j->cb_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  lua_pushvalue(L, 1);
  j->self_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  j->work.data = j;
  int rc = uv_queue_work(j->core->loop, &j->work, step_run, step_done);
  if (rc < 0) {
    luaL_unref(L, LUA_REGISTRYINDEX, j->cb_ref);
    luaL_unref(L, LUA_REGISTRYINDEX, j->self_ref);
    return mb_push_error(L, rc, "image layer step");
  }
  j->busy = 1;
  lua_pushboolean(L, 1);
  return 1;
}

static int job_close(lua_State *L) {
  layer_job *j = job_check(L);
  if (!j->busy) {
    job_free_reader(j);
    j->spent = 1;
  }
  return 0;
}

static int job_gc(lua_State *L) {
  layer_job **box = (layer_job **)luaL_checkudata(L, 1, JOB_META);
  layer_job *j = *box;
  *box = NULL;
  if (!j) return 0;
  if (j->busy) {
    j->orphan = 1;
    return 0;
  }
  job_free_reader(j);
  free(j);
  return 0;
}

static int image_layer_open(lua_State *L) {
  const char *blob = luaL_checkstring(L, 1);
  const char *dir = luaL_checkstring(L, 2);
  luaL_checktype(L, 3, LUA_TTABLE);
  long long max_bytes = (long long)mb_opt_intfield(L, 3, "max_bytes", (lua_Integer)32 << 30);
  long long max_entries = (long long)mb_opt_intfield(L, 3, "max_entries", 1000000);
  lua_getfield(L, 3, "chown");
  int do_chown = lua_toboolean(L, -1);
  long long uid_base = (long long)mb_opt_intfield(L, 3, "uid_base", 0);
  long long gid_base = (long long)mb_opt_intfield(L, 3, "gid_base", 0);
  long long id_count = (long long)mb_opt_intfield(L, 3, "id_count", 65536);
  lua_getfield(L, 3, "xattr_ns");
  const char *ns = lua_isnil(L, -1) ? "trusted" : lua_tostring(L, -1);
  if (!ns || (strcmp(ns, "trusted") != 0 && strcmp(ns, "user") != 0))
    return luaL_error(L, "image_layer_open: xattr_ns must be \"trusted\" or \"user\"");
  int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (dfd < 0) return mb_push_errno(L, errno, dir);
  struct archive *ar = archive_read_new();
  if (!ar) {
    close(dfd);
    return mb_push_errno(L, ENOMEM, "archive_read_new");
  }
  /* layers are tars, compressed or not: nothing else (no zip, no cpio) */
  archive_read_support_filter_all(ar);
  archive_read_support_format_tar(ar);
  archive_read_support_format_gnutar(ar);
  if (archive_read_open_filename(ar, blob, 1 << 16) != ARCHIVE_OK) {
    int e = archive_errno(ar) > 0 ? archive_errno(ar) : EIO;
    lua_pushnil(L);
    lua_pushfstring(L, "%s: %s (%s)", uv_err_name(-e), archive_error_string(ar) ? archive_error_string(ar) : "?", blob);
    lua_pushstring(L, uv_err_name(-e));
    archive_read_free(ar);
    close(dfd);
    return 3;
  }
  layer_job **box = (layer_job **)lua_newuserdata(L, sizeof *box);
  *box = NULL;
  luaL_getmetatable(L, JOB_META);
  lua_setmetatable(L, -2);
  layer_job *j = (layer_job *)calloc(1, sizeof *j);
  if (!j) {
    archive_read_free(ar);
    close(dfd);
    return luaL_error(L, "out of memory");
  }
  *box = j;
  j->core = mb_core_get(L);
  j->ar = ar;
  j->dirfd = dfd;
  j->max_bytes = max_bytes;
  j->max_entries = max_entries;
  j->chown = do_chown;
  j->uid_base = uid_base;
  j->gid_base = gid_base;
  j->id_count = id_count;
  snprintf(j->xattr_ns, sizeof j->xattr_ns, "%s", ns);
  return 1;
}

/* ---- sha256 of a file, optionally copied ----------------------------------- */

typedef struct {
  mb_core *core;
  uv_work_t work;
  int cb_ref;
  char *path, *copy_to;
  int err;
  char what[32];
  char hex[SHA256_DIGEST_SIZE * 2 + 1];
  long long size;
} hash_job;

static void hash_run(uv_work_t *w) {
  hash_job *h = (hash_job *)w->data;
  int in = open(h->path, O_RDONLY | O_CLOEXEC);
  if (in < 0) {
    h->err = errno;
    snprintf(h->what, sizeof h->what, "open");
    return;
  }
  int out = -1;
  if (h->copy_to) {
    out = open(h->copy_to, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (out < 0) {
      h->err = errno;
      snprintf(h->what, sizeof h->what, "create copy");
      close(in);
      return;
    }
  }
  struct sha256_ctx ctx;
  sha256_init(&ctx);
  static __thread char buf[1 << 16];
  for (;;) {
    ssize_t n = read(in, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      h->err = errno;
      snprintf(h->what, sizeof h->what, "read");
      break;
    }
    if (n == 0) break;
    sha256_update(&ctx, (size_t)n, (const uint8_t *)buf);
    h->size += n;
    for (ssize_t off = 0; out >= 0 && off < n;) {
      ssize_t wr = write(out, buf + off, (size_t)(n - off));
      if (wr < 0 && errno == EINTR) continue;
      if (wr < 0) {
        h->err = errno;
        snprintf(h->what, sizeof h->what, "write copy");
        break;
      }
      off += wr;
    }
    if (h->err) break;
  }
  close(in);
  if (out >= 0 && close(out) < 0 && !h->err) {
    h->err = errno;
    snprintf(h->what, sizeof h->what, "close copy");
  }
  if (h->err && out >= 0) unlink(h->copy_to);
  if (h->err) return;
  uint8_t d[SHA256_DIGEST_SIZE];
  sha256_digest(&ctx, sizeof d, d);
  for (int i = 0; i < SHA256_DIGEST_SIZE; i++) snprintf(h->hex + 2 * i, 3, "%02x", d[i]);
}

static void hash_done(uv_work_t *w, int status) {
  hash_job *h = (hash_job *)w->data;
  mb_core *core = h->core;
  if (!core->dead) {
    lua_State *L = core->cbL;
    lua_rawgeti(L, LUA_REGISTRYINDEX, h->cb_ref);
    luaL_unref(L, LUA_REGISTRYINDEX, h->cb_ref);
    int err = status < 0 ? status : -h->err;
    if (err) {
      lua_pushfstring(L, "%s: %s (%s '%s')", uv_err_name(err), uv_strerror(err), status < 0 ? "sha256" : h->what,
                      h->path);
      lua_pushnil(L);
      lua_pushstring(L, uv_err_name(err));
    } else {
      lua_pushnil(L);
      lua_pushstring(L, h->hex);
      lua_pushnumber(L, (lua_Number)h->size);
    }
    mb_call(core, L, 3);
  }
  free(h->path);
  free(h->copy_to);
  free(h);
}

static int sha256_file(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  luaL_checktype(L, 2, LUA_TFUNCTION);
  const char *copy_to = luaL_optstring(L, 3, NULL);
  hash_job *h = (hash_job *)calloc(1, sizeof *h);
  if (!h) return luaL_error(L, "out of memory");
  h->path = strdup(path);
  h->copy_to = copy_to ? strdup(copy_to) : NULL;
  if (!h->path || (copy_to && !h->copy_to)) {
    free(h->path);
    free(h->copy_to);
    free(h);
    return luaL_error(L, "out of memory");
  }
  h->core = mb_core_get(L);
  h->work.data = h;
  lua_pushvalue(L, 2);
  h->cb_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  int rc = uv_queue_work(h->core->loop, &h->work, hash_run, hash_done);
  if (rc < 0) {
    luaL_unref(L, LUA_REGISTRYINDEX, h->cb_ref);
    free(h->path);
    free(h->copy_to);
    free(h);
    return mb_push_error(L, rc, "sha256");
  }
  lua_pushboolean(L, 1);
  return 1;
}

void mb_open_image(lua_State *L) {
  static const luaL_Reg job_methods[] = {{"step", job_step}, {"close", job_close}, {NULL, NULL}};
  luaL_newmetatable(L, JOB_META);
  lua_newtable(L);
  luaL_register(L, NULL, job_methods);
  lua_setfield(L, -2, "__index");
  lua_pushcfunction(L, job_gc);
  lua_setfield(L, -2, "__gc");
  lua_pop(L, 1);
  lua_pushcfunction(L, image_layer_open);
  lua_setfield(L, -2, "image_layer_open");
  lua_pushcfunction(L, sha256_file);
  lua_setfield(L, -2, "sha256_file");
}
