/* Process-wide facts and switches: pid, ids, child subreaper. */
#include "private.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/fsuid.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static int sys_getpid(lua_State *L) {
  lua_pushinteger(L, getpid());
  return 1;
}
static int sys_getuid(lua_State *L) {
  lua_pushinteger(L, getuid());
  return 1;
}
static int sys_getgid(lua_State *L) {
  lua_pushinteger(L, getgid());
  return 1;
}

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
  if (fd == target) {
    lua_pushboolean(L, 1);
    return 1;
  }
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
  do n = write(fd, data, len);
  while (n < 0 && errno == EINTR);
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
    do n = pread(fd, p, want, off);
    while (n < 0 && errno == EINTR);
    if (n < 0) return mb_push_errno(L, errno, "pread");
    if (n == 0) break;
    luaL_addsize(&b, (size_t)n);
    off += n;
    if ((size_t)n < want) break; /* a regular file's end: no second call for its 0 */
  }
  luaL_pushresult(&b);
  return 1;
}

/* core.rewrite_fd(fd, data[, old_size]) -> true | nil, msg, code: the file
 * (a memfd, a regular file) holds exactly data from now on; whoever opens it
 * next (by /proc/<pid>/fd path or name) reads that from offset 0. old_size,
 * when the caller knows it (it wrote the file last), spares the truncation
 * unless the file shrinks: one system call per command (issue #32). */
static int sys_rewrite_fd(lua_State *L) {
  int fd = (int)luaL_checkinteger(L, 1);
  size_t len;
  const char *data = luaL_checklstring(L, 2, &len);
  lua_Number old = luaL_optnumber(L, 3, -1);
  int shrink_after = old >= 0 && old <= 1e15;
  if (!shrink_after && ftruncate(fd, 0) < 0) return mb_push_errno(L, errno, "ftruncate");
  for (size_t done = 0; done < len;) {
    ssize_t n = pwrite(fd, data + done, len - done, (off_t)done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return mb_push_errno(L, errno, "pwrite");
    done += (size_t)n;
  }
  if (shrink_after && (size_t)old > len && ftruncate(fd, (off_t)len) < 0) return mb_push_errno(L, errno, "ftruncate");
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
 * "w" (create/truncate, mode default 0600, less the umask), "fifo" (read-write and
 * non-blocking: a FIFO reader that is never at EOF and never blocks its writers' open),
 * or "fifo_w" (a FIFO's writer, non-blocking: ENXIO when it has no reader).
 * With a dirfd (a directory others may write in) the open never follows a symlink,
 * never blocks, and gives only a regular file ("r", "w") or a FIFO ("fifo", "fifo_w"):
 * EINVAL. */
static int sys_open_fd(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  const char *how = luaL_checkstring(L, 2);
  int flags;
  if (strcmp(how, "r") == 0) flags = O_RDONLY;
  else if (strcmp(how, "w") == 0) flags = O_WRONLY | O_CREAT | O_TRUNC;
  else if (strcmp(how, "fifo") == 0) flags = O_RDWR | O_NONBLOCK;
  else if (strcmp(how, "fifo_w") == 0) flags = O_WRONLY | O_NONBLOCK; /* ENXIO when nobody reads */
  else return luaL_argerror(L, 2, "expected \"r\", \"w\", \"fifo\" or \"fifo_w\"");
  int dirfd = opt_dirfd(L, 3);
  if (dirfd != AT_FDCWD) flags |= O_NOFOLLOW | O_NONBLOCK;
  int fd = openat(dirfd, path, flags | O_CLOEXEC, (mode_t)luaL_optinteger(L, 4, 0600));
  if (fd < 0) return mb_push_errno(L, errno, path);
  struct stat st;
  if (dirfd != AT_FDCWD) {
    int want = strncmp(how, "fifo", 4) == 0 ? S_IFIFO : S_IFREG;
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
static int sys_geteuid(lua_State *L) {
  lua_pushinteger(L, geteuid());
  return 1;
}

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

/* ---- core.proc_scan: one pass over /proc ---------------------------------
 *
 * core.proc_scan([opts][, cb]) -> true | nil, message, CODE (with cb)
 * core.proc_scan([opts]) -> entries | nil, message, CODE (without: inline)
 *
 * Every process in proc (opts.proc, default "/proc") as an array of
 * {pid, ppid, pgid, sid, state, start[, owner]}: state is stat's letter
 * ("R", "S", "Z", ...), start the start time in clock ticks after boot (a
 * pid and its start name one process: a reused pid has another start).
 * opts.env names an environment variable and opts.prefixes lists value
 * prefixes: an entry whose environment holds env=<value> with value
 * starting with one of them gets owner = value (the first occurrence, as
 * getenv; zombies have no environment; one the caller may not read, or
 * longer than MAX_OWNER bytes, or further than MAX_ENVIRON bytes in,
 * gives none). A process that vanished during the pass is left out.
 * opts.known lists pids the caller started itself (it knows what they
 * are): one whose environment is refused is not waited for as if caught
 * mid-exec (a shell that made itself non-dumpable would use up every
 * pass's waits), it is reported without owner and never unsettled.
 * With cb, the pass runs on the thread pool and cb(nil, entries) or
 * cb(message, nil, CODE) follows on the loop; without, it runs at once on
 * the calling thread (for callers that cannot wait: it holds the loop, and
 * does not wait for a process caught mid-exec, see scan_settle). An entry
 * whose environment could not be read yet has unsettled = true. */

#define SCAN_MAX_PREFIXES 64
#define SCAN_MAX_OWNER 1024
#define SCAN_MAX_ENVIRON (1024 * 1024)
#define SCAN_MAX_ENTRIES (1 << 22) /* pid_max's ceiling on 64-bit */
#define SCAN_MAX_KNOWN 65536

typedef struct {
  int pid, ppid, pgid, sid;
  char state;
  char unsettled; /* caught in execve or exit: no environment to read yet */
  unsigned long long start;
  char *owner;
} scan_entry;

typedef struct {
  uv_work_t work;
  mb_core *core;
  int cb_ref;
  char *proc;
  char *env; /* "NAME=", or NULL */
  size_t env_len;
  char *prefixes[SCAN_MAX_PREFIXES];
  int nprefixes;
  int *known; /* sorted */
  size_t nknown;
  scan_entry *e;
  size_t n, cap;
  int settle_left; /* waits for processes caught mid-exec, for the whole pass */
  int err;
  const char *op;
} scan_req;

static void scan_free(scan_req *r) {
  for (size_t i = 0; i < r->n; i++) free(r->e[i].owner);
  free(r->e);
  for (int i = 0; i < r->nprefixes; i++) free(r->prefixes[i]);
  free(r->known);
  free(r->env);
  free(r->proc);
  free(r);
}

/* Read all of a small file at dirfd/path into buf (NUL-terminated); bytes
 * read or -1. */
static ssize_t scan_read(int dirfd, const char *path, char *buf, size_t size) {
  int fd = openat(dirfd, path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  size_t got = 0;
  while (got < size - 1) {
    ssize_t n = read(fd, buf + got, size - 1 - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += (size_t)n;
  }
  close(fd);
  buf[got] = 0;
  return (ssize_t)got;
}

/* The value of r->env in pid's environ, streamed in chunks (a fixed
 * buffer, however big the environment); a malloc'd copy or NULL. */
static char *scan_owner(scan_req *r, int dirfd, const char *pid, size_t *nread, int *denied) {
  char path[300];
  snprintf(path, sizeof path, "%s/environ", pid);
  *nread = 0;
  *denied = 0;
  int fd = openat(dirfd, path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    *denied = errno == EACCES || errno == EPERM;
    return NULL;
  }
  char buf[8192], value[SCAN_MAX_OWNER + 1];
  size_t matched = 0, vlen = 0, total = 0;
  int state = 0; /* 0: matching the name, 1: in the value, 2: skipping to the next entry */
  char *found = NULL;
  for (;;) {
    ssize_t n = read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && total == 0) *denied = errno == EACCES || errno == EPERM;
    if (n <= 0) break;
    total += (size_t)n;
    for (ssize_t i = 0; i < n && !found; i++) {
      char c = buf[i];
      if (state == 0) {
        if (c == r->env[matched]) {
          if (++matched == r->env_len) {
            state = 1;
            vlen = 0;
          }
        } else {
          state = c == 0 ? 0 : 2;
          matched = 0;
        }
      } else if (state == 1) {
        if (c == 0) {
          value[vlen] = 0;
          for (int p = 0; p < r->nprefixes && !found; p++)
            if (strncmp(value, r->prefixes[p], strlen(r->prefixes[p])) == 0) found = strdup(value);
          if (!found) goto done; /* the first occurrence is the value */
        } else if (vlen == SCAN_MAX_OWNER) {
          goto done;
        } else {
          value[vlen++] = c;
        }
      } else if (c == 0) {
        state = 0;
        matched = 0;
      }
    }
    if (found || total >= SCAN_MAX_ENVIRON) break;
  }
  *nread = total;
  /* an environment that ends without its last NUL (it was rewritten) */
  if (!found && state == 1 && vlen > 0 && total < SCAN_MAX_ENVIRON) {
    value[vlen] = 0;
    for (int p = 0; p < r->nprefixes && !found; p++)
      if (strncmp(value, r->prefixes[p], strlen(r->prefixes[p])) == 0) found = strdup(value);
  }
done:
  if (!*nread) *nread = total;
  close(fd);
  return found;
}

#define PF_KTHREAD_FLAG 0x00200000 /* include/linux/sched.h */
#define SCAN_SETTLE_ROUNDS 25
#define SCAN_SETTLE_NS 4000000L /* 25 x 4 ms: 100 ms at most per pass */

/* Parse <pid>/stat into e (state, ppid, pgid, sid, start) and the task
 * flags; 0 if the process is gone. After "(comm) ": state ppid pgrp
 * session tty_nr tpgid flags minflt cminflt majflt cmajflt utime stime
 * cutime cstime priority nice num_threads itrealvalue starttime (the comm
 * may hold ")"). */
static int scan_stat(int dirfd, const char *name, scan_entry *e, unsigned long *flags) {
  char buf[1024], path[300];
  snprintf(path, sizeof path, "%s/stat", name);
  if (scan_read(dirfd, path, buf, sizeof buf) <= 0) return 0;
  char *p = strrchr(buf, ')');
  if (!p || p[1] != ' ' || !p[2]) return 0;
  e->state = p[2];
  p += 3;
  long long f[19];
  int k = 0;
  while (k < 19) {
    char *q;
    errno = 0;
    f[k] = strtoll(p, &q, 10);
    if (q == p || errno) break;
    k++;
    p = q;
  }
  if (k < 19) return 0;
  e->ppid = (int)f[0];
  e->pgid = (int)f[1];
  e->sid = (int)f[2];
  *flags = (unsigned long)f[5];
  e->start = (unsigned long long)f[18];
  return 1;
}

/* Whether pid's real uid is ours (status is readable whatever its
 * dumpable flag). */
static int scan_same_uid(int dirfd, const char *name) {
  char path[300], buf[2048];
  snprintf(path, sizeof path, "%s/status", name);
  if (scan_read(dirfd, path, buf, sizeof buf) <= 0) return 0;
  const char *u = strstr(buf, "\nUid:");
  return u && strtoul(u + 5, NULL, 10) == (unsigned long)getuid();
}

static int cmp_int(const void *a, const void *b) {
  int x = *(const int *)a, y = *(const int *)b;
  return (x > y) - (x < y);
}

/* Read e's marker. A process in the middle of execve has no environment
 * to read (the kernel sets the new one's bounds at the end of the exec),
 * nor a command line; neither has one that is exiting (its memory gone).
 * Such a process is read again a few ms later (SCAN_SETTLE_ROUNDS waits
 * at most for the whole pass), on this (pool) thread: a marked process caught mid-exec would
 * otherwise look unmarked (on a loaded machine the window spans passes).
 * Still unreadable after that: e->unsettled. Kernel threads have neither
 * and are not waited for; a process that cleared its environment still
 * has a command line. */
static void scan_settle(scan_req *r, int dirfd, const char *name, scan_entry *e, unsigned long flags) {
  char path[300], one[2];
  int empty_looks = 3;
  int known = r->nknown && bsearch(&e->pid, r->known, r->nknown, sizeof *r->known, cmp_int);
  for (;;) {
    size_t n;
    int denied;
    long wait_ns = SCAN_SETTLE_NS;
    e->owner = scan_owner(r, dirfd, name, &n, &denied);
    e->unsettled = 0;
    if (e->owner || n > 0 || (flags & PF_KTHREAD_FLAG) || known) return;
    /* our own process refused for a moment: mid-exec its new memory is not
     * yet dumpable, so without CAP_SYS_PTRACE its environ is EACCES */
    int ours_refused = denied && scan_same_uid(dirfd, name);
    snprintf(path, sizeof path, "%s/cmdline", name);
    if (!ours_refused && scan_read(dirfd, path, one, sizeof one) > 0) {
      /* a command line and no environment: the end of an exec sets the
       * command line's bounds a moment before the environment's
       * (create_elf_tables), or the process cleared its environment. A
       * few more looks, 1 ms apart, tell them apart (a process that execs
       * in a loop can be caught there twice); with the pass's waits used
       * up, it is unsettled (below), never taken for unmarked. */
      if (denied || empty_looks-- <= 0) return; /* (denied: another user's, not ours to read) */
      wait_ns = 1000000L;
    }
    e->unsettled = 1;
    if (r->settle_left <= 0) return;
    r->settle_left--;
    struct timespec ts = {0, wait_ns};
    nanosleep(&ts, NULL);
    scan_entry again = *e;
    if (!scan_stat(dirfd, name, &again, &flags) || again.start != e->start) {
      e->state = 'X'; /* gone (or its pid reused): not reported */
      e->unsettled = 0;
      return;
    }
    *e = again;
    if (e->state == 'Z' || e->state == 'X') {
      e->unsettled = 0;
      return;
    }
  }
}

static void scan_work(uv_work_t *w) {
  scan_req *r = (scan_req *)w->data;
  int dirfd = open(r->proc, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dirfd < 0) {
    r->err = errno;
    r->op = "open";
    return;
  }
  DIR *d = fdopendir(dirfd);
  if (!d) {
    r->err = errno;
    r->op = "opendir";
    close(dirfd);
    return;
  }
  struct dirent *de;
  while ((de = readdir(d)) != NULL) {
    const char *name = de->d_name;
    char *end;
    long pid = strtol(name, &end, 10);
    if (*name < '1' || *name > '9' || *end || pid <= 0 || pid > 0x7fffffff) continue;
    scan_entry e = {0};
    e.pid = (int)pid;
    unsigned long flags;
    if (!scan_stat(dirfd, name, &e, &flags)) continue; /* gone */
    if (r->env && e.state != 'Z' && e.state != 'X') scan_settle(r, dirfd, name, &e, flags);
    if (r->n == r->cap) {
      size_t cap = r->cap ? r->cap * 2 : 512;
      scan_entry *ne = cap <= SCAN_MAX_ENTRIES ? realloc(r->e, cap * sizeof *ne) : NULL;
      if (!ne) {
        free(e.owner);
        r->err = ENOMEM;
        r->op = "scan";
        break;
      }
      r->e = ne;
      r->cap = cap;
    }
    if (e.state == 'X' && !e.owner) continue; /* went while it was read */
    r->e[r->n++] = e;
  }
  closedir(d);
}

static int scan_push(lua_State *L, scan_req *r) {
  if (r->err) {
    char detail[512];
    snprintf(detail, sizeof detail, "proc_scan: %s %s", r->op, r->proc);
    return mb_push_errno(L, r->err, detail);
  }
  lua_createtable(L, (int)r->n, 0);
  char st[2] = {0, 0};
  for (size_t i = 0; i < r->n; i++) {
    scan_entry *e = &r->e[i];
    lua_createtable(L, 0, 7);
    lua_pushinteger(L, e->pid);
    lua_setfield(L, -2, "pid");
    lua_pushinteger(L, e->ppid);
    lua_setfield(L, -2, "ppid");
    lua_pushinteger(L, e->pgid);
    lua_setfield(L, -2, "pgid");
    lua_pushinteger(L, e->sid);
    lua_setfield(L, -2, "sid");
    st[0] = e->state;
    lua_pushstring(L, st);
    lua_setfield(L, -2, "state");
    lua_pushnumber(L, (lua_Number)e->start);
    lua_setfield(L, -2, "start");
    if (e->owner) {
      lua_pushstring(L, e->owner);
      lua_setfield(L, -2, "owner");
    }
    if (e->unsettled) {
      lua_pushboolean(L, 1);
      lua_setfield(L, -2, "unsettled");
    }
    lua_rawseti(L, -2, (int)i + 1);
  }
  return 1;
}

static void scan_after(uv_work_t *w, int status) {
  scan_req *r = (scan_req *)w->data;
  mb_core *core = r->core;
  if (status == UV_ECANCELED) {
    r->err = ECANCELED;
    r->op = "scan";
  }
  if (core->dead) {
    scan_free(r);
    return;
  }
  lua_State *cbL = core->cbL;
  lua_rawgeti(cbL, LUA_REGISTRYINDEX, r->cb_ref);
  luaL_unref(cbL, LUA_REGISTRYINDEX, r->cb_ref);
  int nargs;
  if (r->err) {
    scan_push(cbL, r); /* nil, message, CODE */
    lua_remove(cbL, -3);
    lua_pushnil(cbL);
    lua_insert(cbL, -2); /* message, nil, CODE */
    nargs = 3;
  } else {
    lua_pushnil(cbL);
    scan_push(cbL, r);
    nargs = 2;
  }
  scan_free(r);
  mb_call(core, cbL, nargs);
}

static int sys_proc_scan(lua_State *L) {
  int has_opts = !lua_isnoneornil(L, 1);
  if (has_opts) luaL_checktype(L, 1, LUA_TTABLE);
  int async = !lua_isnoneornil(L, 2);
  if (async) luaL_checktype(L, 2, LUA_TFUNCTION);
  scan_req *r = (scan_req *)calloc(1, sizeof *r);
  if (!r) return luaL_error(L, "out of memory");
  const char *proc = "/proc";
  if (has_opts) {
    lua_getfield(L, 1, "proc");
    if (!lua_isnil(L, -1)) {
      if (lua_type(L, -1) != LUA_TSTRING) {
        free(r);
        return luaL_argerror(L, 1, "proc must be a string");
      }
      proc = lua_tostring(L, -1);
    }
    lua_pop(L, 1);
  }
  r->proc = strdup(proc);
  if (!r->proc) {
    scan_free(r);
    return luaL_error(L, "out of memory");
  }
  if (has_opts) {
    lua_getfield(L, 1, "env");
    if (!lua_isnil(L, -1)) {
      size_t len;
      const char *env = lua_type(L, -1) == LUA_TSTRING ? lua_tolstring(L, -1, &len) : NULL;
      if (!env || len == 0 || len > 255 || strchr(env, '=') || memchr(env, 0, len)) {
        scan_free(r);
        return luaL_argerror(L, 1, "env must be a variable name");
      }
      r->env = (char *)malloc(len + 2);
      if (!r->env) {
        scan_free(r);
        return luaL_error(L, "out of memory");
      }
      memcpy(r->env, env, len);
      r->env[len] = '=';
      r->env[len + 1] = 0;
      r->env_len = len + 1;
    }
    lua_pop(L, 1);
    lua_getfield(L, 1, "prefixes");
    if (!lua_isnil(L, -1)) {
      if (!lua_istable(L, -1) || !r->env) {
        scan_free(r);
        return luaL_argerror(L, 1, "prefixes must be an array of strings, with env");
      }
      int n = (int)lua_objlen(L, -1);
      if (n > SCAN_MAX_PREFIXES) {
        scan_free(r);
        return luaL_argerror(L, 1, "too many prefixes");
      }
      for (int i = 1; i <= n; i++) {
        lua_rawgeti(L, -1, i);
        if (lua_type(L, -1) != LUA_TSTRING || lua_objlen(L, -1) > SCAN_MAX_OWNER) {
          scan_free(r);
          return luaL_argerror(L, 1, "prefixes must be an array of strings");
        }
        r->prefixes[r->nprefixes] = strdup(lua_tostring(L, -1));
        if (!r->prefixes[r->nprefixes]) {
          scan_free(r);
          return luaL_error(L, "out of memory");
        }
        r->nprefixes++;
        lua_pop(L, 1);
      }
    } else if (r->env) {
      r->prefixes[0] = strdup(""); /* every value */
      if (!r->prefixes[0]) {
        scan_free(r);
        return luaL_error(L, "out of memory");
      }
      r->nprefixes = 1;
    }
    lua_pop(L, 1);
    lua_getfield(L, 1, "known");
    if (!lua_isnil(L, -1)) {
      size_t n = lua_istable(L, -1) ? lua_objlen(L, -1) : 0;
      if (!lua_istable(L, -1) || n > SCAN_MAX_KNOWN) {
        scan_free(r);
        return luaL_argerror(L, 1, "known must be an array of at most 65536 pids");
      }
      r->known = n ? (int *)malloc(n * sizeof *r->known) : NULL;
      if (n && !r->known) {
        scan_free(r);
        return luaL_error(L, "out of memory");
      }
      for (size_t i = 0; i < n; i++) {
        lua_rawgeti(L, -1, (int)i + 1);
        lua_Number v = lua_tonumber(L, -1);
        lua_pop(L, 1);
        if (!(v >= 1 && v <= 0x7fffffff) || v != (lua_Number)(int)v) {
          scan_free(r);
          return luaL_argerror(L, 1, "known must be an array of pids");
        }
        r->known[i] = (int)v;
      }
      r->nknown = n;
      if (n > 1) qsort(r->known, n, sizeof *r->known, cmp_int);
    }
    lua_pop(L, 1);
  }
  r->settle_left = async ? SCAN_SETTLE_ROUNDS : 0; /* inline, the loop waits for nothing */
  r->work.data = r;
  if (!async) {
    scan_work(&r->work);
    int n = scan_push(L, r);
    scan_free(r);
    return n;
  }
  mb_core *core = mb_core_get(L);
  r->core = core;
  lua_pushvalue(L, 2);
  r->cb_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  int rc = uv_queue_work(core->loop, &r->work, scan_work, scan_after);
  if (rc < 0) {
    luaL_unref(L, LUA_REGISTRYINDEX, r->cb_ref);
    scan_free(r);
    return mb_push_error(L, rc, "proc_scan");
  }
  lua_pushboolean(L, 1);
  return 1;
}

static const luaL_Reg sys_funcs[] = {{"proc_scan", sys_proc_scan},
                                     {"mkfifo", sys_mkfifo},
                                     {"open_fd", sys_open_fd},
                                     {"readlink", sys_readlink},
                                     {"dir_fd", sys_dir_fd},
                                     {"unlink", sys_unlink},
                                     {"chown", sys_chown},
                                     {"geteuid", sys_geteuid},
                                     {"setfsids", sys_setfsids},
                                     {"write_fd", sys_write_fd},
                                     {"memfd", sys_memfd},
                                     {"pread_all", sys_pread_all},
                                     {"rewrite_fd", sys_rewrite_fd},
                                     {"dup_to", sys_dup_to},
                                     {"devnull", sys_devnull},
                                     {"readdir", sys_readdir},
                                     {"mkdir", sys_mkdir},
                                     {"rmdir", sys_rmdir},
                                     {"time", sys_time},
                                     {"getpid", sys_getpid},
                                     {"getuid", sys_getuid},
                                     {"getgid", sys_getgid},
                                     {"set_child_subreaper", sys_set_child_subreaper},
                                     {NULL, NULL}};

void mb_open_sys(lua_State *L) {
  for (const luaL_Reg *f = sys_funcs; f->name; f++) {
    lua_pushcfunction(L, f->func);
    lua_setfield(L, -2, f->name);
  }
}
