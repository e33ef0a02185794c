/* Process-wide facts and switches: pid, ids, child subreaper. */
#include "private.h"

#include <dirent.h>
#include <errno.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/fsuid.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

static int sys_getpid(lua_State *L) { lua_pushinteger(L, getpid()); return 1; }
static int sys_getuid(lua_State *L) { lua_pushinteger(L, getuid()); return 1; }
static int sys_getgid(lua_State *L) { lua_pushinteger(L, getgid()); return 1; }

/* core.set_child_subreaper(on): orphaned descendants are re-parented to us,
 * so a double-forked daemon is still ours to find, kill and reap. */
static int sys_set_child_subreaper(lua_State *L) {
  if (prctl(PR_SET_CHILD_SUBREAPER, lua_toboolean(L, 1) ? 1 : 0) < 0)
    return mb_push_errno(L, errno, "PR_SET_CHILD_SUBREAPER");
  lua_pushboolean(L, 1);
  return 1;
}

/* core.time() -> wall-clock seconds with microseconds, for timestamps */
static int sys_time(lua_State *L) {
  uv_timeval64_t tv;
  int rc = uv_gettimeofday(&tv);
  if (rc < 0) return mb_push_error(L, rc, "gettimeofday");
  lua_pushnumber(L, (lua_Number)tv.tv_sec + (lua_Number)tv.tv_usec / 1e6);
  return 1;
}

/* core.readdir(path) -> array of names (no "." or ".."). Synchronous: for
 * /proc and cgroupfs, which answer from memory. Files go through fs. */
static int sys_readdir(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  DIR *d = opendir(path);
  if (!d) return mb_push_errno(L, errno, path);
  lua_newtable(L);
  int i = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (e->d_name[0] == '.' && (e->d_name[1] == 0 || (e->d_name[1] == '.' && e->d_name[2] == 0))) continue;
    lua_pushstring(L, e->d_name);
    lua_rawseti(L, -2, ++i);
  }
  closedir(d);
  return 1;
}

/* core.mkdir(path[, mode]) / core.rmdir(path): synchronous, for cgroupfs. */
static int sys_mkdir(lua_State *L) {
  if (mkdir(luaL_checkstring(L, 1), (mode_t)luaL_optinteger(L, 2, 0755)) < 0)
    return mb_push_errno(L, errno, lua_tostring(L, 1));
  lua_pushboolean(L, 1);
  return 1;
}

static int sys_rmdir(lua_State *L) {
  if (rmdir(luaL_checkstring(L, 1)) < 0) return mb_push_errno(L, errno, lua_tostring(L, 1));
  lua_pushboolean(L, 1);
  return 1;
}

/* core.dup_to(fd, target): place fd on target (close-on-exec), as dup3.
 * Sessions keep fixed fd slots whose /proc paths never change. */
static int sys_dup_to(lua_State *L) {
  int fd = (int)luaL_checkinteger(L, 1), target = (int)luaL_checkinteger(L, 2);
  if (fd == target) { lua_pushboolean(L, 1); return 1; }
  if (dup3(fd, target, O_CLOEXEC) < 0) return mb_push_errno(L, errno, "dup3");
  lua_pushboolean(L, 1);
  return 1;
}

/* core.devnull() -> fd open on /dev/null (read-write, close-on-exec) */
static int sys_devnull(lua_State *L) {
  int fd = open("/dev/null", O_RDWR | O_CLOEXEC);
  if (fd < 0) return mb_push_errno(L, errno, "/dev/null");
  lua_pushinteger(L, fd);
  return 1;
}

/* core.write_fd(fd, data) -> bytes written | nil, msg, code. One write(2):
 * for small data into a fresh pipe, which takes 64 KiB without blocking. */
static int sys_write_fd(lua_State *L) {
  int fd = (int)luaL_checkinteger(L, 1);
  size_t len;
  const char *data = luaL_checklstring(L, 2, &len);
  ssize_t n;
  do n = write(fd, data, len); while (n < 0 && errno == EINTR);
  if (n < 0) return mb_push_errno(L, errno, "write");
  lua_pushinteger(L, (lua_Integer)n);
  return 1;
}

/* core.memfd(name) -> fd (close-on-exec) | nil, msg, code: an anonymous
 * file whose /proc/<pid>/fd path another process may open and rewrite */
static int sys_memfd(lua_State *L) {
  int fd = memfd_create(luaL_checkstring(L, 1), MFD_CLOEXEC);
  if (fd < 0) return mb_push_errno(L, errno, "memfd_create");
  lua_pushinteger(L, fd);
  return 1;
}

/* core.pread_all(fd, max) -> string | nil, msg, code: the file's content
 * from offset 0 (at most max bytes), however often it was rewritten */
static int sys_pread_all(lua_State *L) {
  int fd = (int)luaL_checkinteger(L, 1);
  lua_Integer max = luaL_checkinteger(L, 2);
  luaL_Buffer b;
  luaL_buffinit(L, &b);
  off_t off = 0;
  while (off < max) {
    char *p = luaL_prepbuffer(&b);
    size_t want = (size_t)(max - off) < LUAL_BUFFERSIZE ? (size_t)(max - off) : LUAL_BUFFERSIZE;
    ssize_t n;
    do n = pread(fd, p, want, off); while (n < 0 && errno == EINTR);
    if (n < 0) return mb_push_errno(L, errno, "pread");
    if (n == 0) break;
    luaL_addsize(&b, (size_t)n);
    off += n;
    if ((size_t)n < want) break; /* a regular file's end: no second call for its 0 */
  }
  luaL_pushresult(&b);
  return 1;
}

/* core.rewrite_fd(fd, data) -> true | nil, msg, code: the file (a memfd,
 * a regular file) holds exactly data from now on; whoever opens it next
 * (by /proc/<pid>/fd path or name) reads that from offset 0 */
static int sys_rewrite_fd(lua_State *L) {
  int fd = (int)luaL_checkinteger(L, 1);
  size_t len;
  const char *data = luaL_checklstring(L, 2, &len);
  if (ftruncate(fd, 0) < 0) return mb_push_errno(L, errno, "ftruncate");
  for (size_t done = 0; done < len;) {
    ssize_t n = pwrite(fd, data + done, len - done, (off_t)done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return mb_push_errno(L, errno, "pwrite");
    done += (size_t)n;
  }
  lua_pushboolean(L, 1);
  return 1;
}

static int opt_dirfd(lua_State *L, int idx) {
  return lua_isnoneornil(L, idx) ? AT_FDCWD : (int)luaL_checkinteger(L, idx);
}

/* core.mkfifo(path[, mode = 0600[, dirfd]]) -> true | nil, msg, code; a
 * relative path is taken from dirfd (core.dir_fd), as in mkfifoat */
static int sys_mkfifo(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  if (mkfifoat(opt_dirfd(L, 3), path, (mode_t)luaL_optinteger(L, 2, 0600)) < 0) return mb_push_errno(L, errno, path);
  lua_pushboolean(L, 1);
  return 1;
}

/* core.open_fd(path, how[, dirfd[, mode]]) -> fd (close-on-exec) | nil, msg, code. how: "r",
 * "w" (create/truncate, mode default 0600, less the umask), or "fifo" (read-write and
 * non-blocking: a FIFO reader that is never at EOF and never blocks its writers' open).
 * With a dirfd (a directory others may write in) the open never follows a symlink,
 * never blocks, and gives only a regular file ("r", "w") or a FIFO ("fifo"): EINVAL. */
static int sys_open_fd(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  const char *how = luaL_checkstring(L, 2);
  int flags;
  if (strcmp(how, "r") == 0) flags = O_RDONLY;
  else if (strcmp(how, "w") == 0) flags = O_WRONLY | O_CREAT | O_TRUNC;
  else if (strcmp(how, "fifo") == 0) flags = O_RDWR | O_NONBLOCK;
  else return luaL_argerror(L, 2, "expected \"r\", \"w\" or \"fifo\"");
  int dirfd = opt_dirfd(L, 3);
  if (dirfd != AT_FDCWD) flags |= O_NOFOLLOW | O_NONBLOCK;
  int fd = openat(dirfd, path, flags | O_CLOEXEC, (mode_t)luaL_optinteger(L, 4, 0600));
  if (fd < 0) return mb_push_errno(L, errno, path);
  struct stat st;
  if (dirfd != AT_FDCWD) {
    int want = strcmp(how, "fifo") == 0 ? S_IFIFO : S_IFREG;
    if (fstat(fd, &st) < 0 || (st.st_mode & S_IFMT) != (mode_t)want) {
      close(fd);
      return mb_push_errno(L, EINVAL, path);
    }
    /* blocking again for a regular file's reads and writes */
    if (want == S_IFREG) fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  }
  lua_pushinteger(L, fd);
  return 1;
}

/* core.dir_fd(path[, owner]) -> an O_PATH directory fd for the *at calls here.
 * With owner (a uid): the last component is not followed, and a directory
 * not owned by that uid is refused (EPERM): one that someone else put there. */
static int sys_dir_fd(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  int check = !lua_isnoneornil(L, 2);
  int fd = open(path, O_PATH | O_DIRECTORY | O_CLOEXEC | (check ? O_NOFOLLOW : 0));
  if (fd < 0) return mb_push_errno(L, errno, path);
  struct stat st;
  if (check && (fstat(fd, &st) < 0 || st.st_uid != (uid_t)luaL_checkinteger(L, 2))) {
    close(fd);
    return mb_push_errno(L, EPERM, path);
  }
  lua_pushinteger(L, fd);
  return 1;
}

/* core.chown(path | fd, uid, gid[, dirfd]) -> true | nil, msg, code. A path
 * is taken from dirfd and never followed if it is a symlink (fchownat with
 * AT_SYMLINK_NOFOLLOW); a number is an open fd (fchown). */
static int sys_chown(lua_State *L) {
  uid_t uid = (uid_t)luaL_checknumber(L, 2);
  gid_t gid = (gid_t)luaL_checknumber(L, 3);
  if (lua_type(L, 1) == LUA_TNUMBER) {
    if (fchown((int)lua_tointeger(L, 1), uid, gid) < 0) return mb_push_errno(L, errno, "fchown");
  } else {
    const char *path = luaL_checkstring(L, 1);
    if (fchownat(opt_dirfd(L, 4), path, uid, gid, AT_SYMLINK_NOFOLLOW) < 0) return mb_push_errno(L, errno, path);
  }
  lua_pushboolean(L, 1);
  return 1;
}

/* core.setfsids(uid, gid) -> previous uid, gid: the ids this thread's file
 * system calls act with (setfsgid, setfsuid), e.g. a sandbox's root's while
 * the runtime creates files in that sandbox's own tmpfs. Set them back. */
static int sys_setfsids(lua_State *L) {
  uid_t uid = (uid_t)luaL_checknumber(L, 1);
  gid_t gid = (gid_t)luaL_checknumber(L, 2);
  gid_t old_gid = (gid_t)setfsgid(gid);
  uid_t old_uid = (uid_t)setfsuid(uid);
  if ((uid_t)setfsuid((uid_t)-1) != uid || (gid_t)setfsgid((gid_t)-1) != gid) {
    setfsuid(old_uid);
    setfsgid(old_gid);
    return mb_push_errno(L, EPERM, "setfsuid");
  }
  lua_pushinteger(L, (lua_Integer)old_uid);
  lua_pushinteger(L, (lua_Integer)old_gid);
  return 2;
}

/* core.geteuid() -> the effective uid (0: we may map other ids) */
static int sys_geteuid(lua_State *L) { lua_pushinteger(L, geteuid()); return 1; }

/* core.unlink(path[, dirfd]) -> true | nil, msg, code */
static int sys_unlink(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  if (unlinkat(opt_dirfd(L, 2), path, 0) < 0) return mb_push_errno(L, errno, path);
  lua_pushboolean(L, 1);
  return 1;
}

/* core.readlink(path) -> target | nil, msg, code (EINVAL: not a symlink) */
static int sys_readlink(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  char buf[4096];
  ssize_t n = readlink(path, buf, sizeof buf);
  if (n < 0) return mb_push_errno(L, errno, path);
  lua_pushlstring(L, buf, (size_t)n);
  return 1;
}

static const luaL_Reg sys_funcs[] = {
  {"mkfifo", sys_mkfifo}, {"open_fd", sys_open_fd}, {"readlink", sys_readlink},
  {"dir_fd", sys_dir_fd}, {"unlink", sys_unlink}, {"chown", sys_chown}, {"geteuid", sys_geteuid},
  {"setfsids", sys_setfsids},
  {"write_fd", sys_write_fd}, {"memfd", sys_memfd}, {"pread_all", sys_pread_all},
  {"rewrite_fd", sys_rewrite_fd},
  {"dup_to", sys_dup_to}, {"devnull", sys_devnull},
  {"readdir", sys_readdir}, {"mkdir", sys_mkdir}, {"rmdir", sys_rmdir},
  {"time", sys_time},
  {"getpid", sys_getpid}, {"getuid", sys_getuid}, {"getgid", sys_getgid},
  {"set_child_subreaper", sys_set_child_subreaper}, {NULL, NULL}};

void mb_open_sys(lua_State *L) {
  for (const luaL_Reg *f = sys_funcs; f->name; f++) {
    lua_pushcfunction(L, f->func);
    lua_setfield(L, -2, f->name);
  }
}
