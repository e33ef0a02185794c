/* The runtime's side of a sandbox init (nsinit.h): start it in new
 * namespaces (cloned from the zygote's mount namespace where there is one,
 * src/zygote.c, with its bind sources detached here), map its ids, wait
 * for its root filesystem, then ask it to spawn children
 * (core.spawn{sandbox = init}) and collect their exits.
 *
 *   core.sandbox_init(spec) -> init | nil, message, CODE
 *   spec: namespaces = {"user", "mnt", "pid", "ipc", "uts", "net"}, hostname,
 *         loopback, mounts = {{type, src, dst, data, size, optional}, ...},
 *         uid_map, gid_map (required: the lines written to
 *         /proc/<init>/uid_map and gid_map, as the caller derives them,
 *         lua/moonbox/sandbox/isolation.lua; a malformed one is nil,
 *         message, "EINVAL" before anything starts),
 *         setgroups (required: "deny": written before gid_map, as an
 *         unprivileged user must; "allow": left, and the init drops the
 *         supplementary groups it inherited),
 *         cgroups = {dir, ...} (joined by the init before anything else),
 *         on_exit(exit_code, term_signal) (the init itself ended)
 *   init:pid()           host pid of the init
 *   init:socket(kind)    "tcp4" | "tcp6": an unconnected socket in the sandbox's network namespace
 *   init:kill(signal)    signal the init (SIGKILL ends the whole sandbox)
 *   init:close()         stop serving: the init exits, and the pid namespace with it
 *   init:finish(hostname, src, dst)
 *                        an init started with spec.defer_pivot (a spare, built
 *                        before it is known whose it is): set the hostname,
 *                        bind src (host) at dst, and enter the new root */
#include "private.h"
#include "nsinit.h"
#include "child/wire.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/capability.h>
#include <poll.h>
#include <sched.h>
#include <stddef.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#define NSINIT "moonbox.nsinit"
#define INIT_STACK (64 * 1024)
#define REPLY_TIMEOUT_MS 30000

/* an exit read while waiting for a reply, delivered from the loop */
typedef struct {
  pid_t host;
  int status;
} pending_exit;

typedef struct {
  pid_t pid;
  int sock_fd;   /* our end of the init's socket */
  int shut;      /* we shut our side down (close): the init is ending */
  int pids_ref;  /* Lua table: pid inside -> host pid, for children still running */
  int gone;      /* the socket reported EOF: the init is dead */
  int want_send; /* the poll also waits for writable: pending exits to deliver */
  pending_exit *pending;
  int npending, cap;
} nsinit_state;

static const struct {
  const char *name;
  int flag;
} ns_names[] = {{"user", CLONE_NEWUSER}, {"mnt", CLONE_NEWNS},  {"pid", CLONE_NEWPID},       {"ipc", CLONE_NEWIPC},
                {"uts", CLONE_NEWUTS},   {"net", CLONE_NEWNET}, {"cgroup", CLONE_NEWCGROUP}, {NULL, 0}};

static const char *const mount_types[] = {"bind", "ro_bind",  "tmpfs", "proc",   "dev",     "symlink", "file",
                                          "dir",  "readonly", "mask",  "sysctl", "overlay", NULL};

static const char *stage_name(int stage) {
  switch (stage) {
  case MB_NSINIT_GO: return "start";
  case MB_NSINIT_PDEATHSIG: return "pdeathsig";
  case MB_NSINIT_CGROUP: return "cgroup join";
  case MB_NSINIT_HOSTNAME: return "sethostname";
  case MB_NSINIT_LOOPBACK: return "loopback up";
  case MB_NSINIT_MOUNT: return "mount";
  case MB_NSINIT_PIVOT: return "entering the new root";
  case MB_NSINIT_SIGNALS: return "signal setup";
  case MB_NSINIT_IDS: return "setresuid/setgroups";
  case MB_NSINIT_EXEC: return "exec moonbox-init";
  default: return "set-up";
  }
}

static void parse_mounts(lua_State *L, int idx, mb_nsinit_plan *p) {
  lua_getfield(L, idx, "mounts");
  if (lua_isnil(L, -1)) {
    lua_pop(L, 1);
    return;
  }
  luaL_checktype(L, -1, LUA_TTABLE);
  int t = lua_gettop(L);
  int n = (int)lua_objlen(L, t);
  if (n > MB_NSINIT_MAX_MOUNTS) luaL_error(L, "sandbox_init: too many mounts (max %d)", MB_NSINIT_MAX_MOUNTS);
  for (int i = 0; i < n; i++) {
    lua_rawgeti(L, t, i + 1);
    int m = lua_gettop(L);
    luaL_checktype(L, m, LUA_TTABLE);
    mb_mount *mt = &p->mounts[i];
    lua_getfield(L, m, "type");
    const char *type = lua_tostring(L, -1);
    mt->type = -1;
    for (int k = 0; type && mount_types[k]; k++)
      if (strcmp(type, mount_types[k]) == 0) mt->type = k;
    if (mt->type < 0) luaL_error(L, "sandbox_init: mounts[%d]: unknown type '%s'", i + 1, type ? type : "nil");
    lua_getfield(L, m, "dst");
    mt->dst = lua_tostring(L, -1);
    if (!mt->dst || mt->dst[0] != '/') luaL_error(L, "sandbox_init: mounts[%d]: dst must be an absolute path", i + 1);
    lua_getfield(L, m, "src");
    mt->src = lua_tostring(L, -1);
    if (!mt->src && (mt->type == MB_MOUNT_BIND || mt->type == MB_MOUNT_RO_BIND || mt->type == MB_MOUNT_SYMLINK))
      luaL_error(L, "sandbox_init: mounts[%d]: src is required for %s", i + 1, type);
    lua_getfield(L, m, "data");
    mt->data = lua_tolstring(L, -1, &mt->data_len);
    if (!mt->data) mt->data = "";
    if (mt->type == MB_MOUNT_OVERLAY && strcmp(mt->dst, "/") != 0)
      luaL_error(L, "sandbox_init: mounts[%d]: an overlay is the root: dst must be /", i + 1);
    lua_getfield(L, m, "size");
    mt->size = (uint64_t)luaL_optnumber(L, -1, 0);
    lua_getfield(L, m, "optional");
    mt->optional = lua_toboolean(L, -1);
    /* the strings stay referenced from the spec table for the whole call */
    lua_settop(L, t);
  }
  p->nmounts = n;
  lua_pop(L, 1);
}

static int write_proc(pid_t pid, const char *file, const char *text) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/%s", (int)pid, file);
  int fd = open(path, O_WRONLY | O_CLOEXEC);
  if (fd < 0) return errno;
  ssize_t n = write(fd, text, strlen(text));
  int e = n == (ssize_t)strlen(text) ? 0 : (n < 0 ? errno : EIO);
  close(fd);
  return e;
}

static void close_fd(int *fd) {
  if (*fd >= 0) close(*fd);
  *fd = -1;
}

/* ---- the init binary -------------------------------------------------- */

/* moonbox-init, found relative to the object this code is in, as the bash
 * builtin is (src/core.c), so an installed tree works wherever it is moved,
 * and copied once, when the module loads, into two sealed memfds that the
 * init is exec'd from:
 *   - a runtime keeps exec'ing the binary of its own version even when a
 *     newer one replaces it on disk;
 *   - /proc/1/exe inside is a sealed memfd, never the host's file, which a
 *     root inside that maps to its owner could otherwise write to;
 *   - "private" (mode 0111): the exec cannot read the file, so the kernel
 *     keeps the init's memory in the host's user namespace and makes it
 *     non-dumpable (fs/exec.c would_dump): nothing inside, whatever
 *     capabilities a policy keeps, can read or write the init's memory or
 *     take its fds through /proc/1/mem, ptrace or pidfd_getfd. Used when
 *     the init changes ids at setresuid(0) (root inside is another host id
 *     than the runtime), as the copy-on-write init did: then the runtime
 *     reaches /proc/<init> with the privilege that mapping took;
 *   - "readable" (0555) otherwise (root inside is the runtime's own id, an
 *     unprivileged runtime's "0 <uid> 1"): the init stays dumpable, as it
 *     was, so that the runtime can write its id maps and reach
 *     /proc/<init>/root without privilege. */
static int init_exe_private = -1, init_exe_readable = -1;
static int init_exe_err = ENOENT;
static char init_exe_path[PATH_MAX] = "moonbox-init";
static int cap_last = -1;

#ifndef MFD_EXEC
#define MFD_EXEC 0x0010U
#endif

static int exe_memfd(int src, mode_t mode) {
  int fd = memfd_create("moonbox-init", MFD_CLOEXEC | MFD_ALLOW_SEALING | MFD_EXEC);
  if (fd < 0 && errno == EINVAL) fd = memfd_create("moonbox-init", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return -1;
  char buf[65536];
  off_t off = 0;
  for (;;) {
    ssize_t n = pread(src, buf, sizeof buf, off);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) goto fail;
    if (n == 0) break;
    for (ssize_t done = 0; done < n;) {
      ssize_t w = write(fd, buf + done, (size_t)(n - done));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        if (w == 0) errno = EIO;
        goto fail;
      }
      done += w;
    }
    off += n;
  }
  if (fchmod(fd, mode) < 0 || fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) < 0)
    goto fail;
  return fd;
fail:;
  int e = errno;
  close(fd);
  errno = e;
  return -1;
}

static void find_init(void) {
  static const char *const rels[] = {
#ifdef MOONBOX_INIT_REL
    MOONBOX_INIT_REL, /* from an installed libmoonbox.so */
#endif
    "moonbox-init",             /* from moonbox/core.so, installed or in the build tree */
    "lib/moonbox/moonbox-init", /* from the build tree's libmoonbox.so */
  };
  char dir[PATH_MAX], path[PATH_MAX + 64];
  if (init_exe_private >= 0) return;
  if (mb_self_dir(dir, sizeof dir)) {
    for (size_t i = 0; i < sizeof rels / sizeof *rels && init_exe_private < 0; i++) {
      snprintf(path, sizeof path, "%s/%s", dir, rels[i]);
      size_t len = strlen(path);
      if (i == 0 && len < sizeof init_exe_path) memcpy(init_exe_path, path, len + 1); /* named if none is found */
      int fd = open(path, O_RDONLY | O_CLOEXEC);
      if (fd < 0 || len >= sizeof init_exe_path) {
        if (fd >= 0) close(fd);
        continue;
      }
      memcpy(init_exe_path, path, len + 1);
      struct stat st;
      if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode) || access(path, X_OK) < 0) {
        init_exe_err = errno ? errno : EACCES;
      } else if ((init_exe_private = exe_memfd(fd, 0111)) < 0 || (init_exe_readable = exe_memfd(fd, 0555)) < 0) {
        init_exe_err = errno;
        if (init_exe_private >= 0) close(init_exe_private);
        init_exe_private = -1;
      }
      close(fd);
    }
  }
  /* the capabilities to carry across that exec: 0..cap_last */
  int fd = open("/proc/sys/kernel/cap_last_cap", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    char buf[16] = {0};
    if (read(fd, buf, sizeof buf - 1) > 0) cap_last = atoi(buf);
    close(fd);
  }
  if (cap_last <= 0 || cap_last > 63) cap_last = CAP_LAST_CAP;
}

/* Whether root inside is another host id than ours (maps: "0 <host> <n>"
 * first): then the init changes ids and is exec'd private (above). */
static int changes_ids(const char *uid_map, const char *gid_map) {
  unsigned in_u, host_u, in_g, host_g;
  if (sscanf(uid_map, "%u %u", &in_u, &host_u) != 2 || sscanf(gid_map, "%u %u", &in_g, &host_g) != 2) return 1;
  return in_u != 0 || in_g != 0 || host_u != (unsigned)geteuid() || host_g != (unsigned)getegid();
}

/* The plan as bytes (nsinit.h: mb_nsinit_wire) in a memfd. */
typedef struct {
  char *buf;
  size_t len;
} wire_buf;

static int64_t wire_put(wire_buf *b, const char *s, size_t n) {
  if (!s) return -1;
  int64_t at = (int64_t)b->len;
  memcpy(b->buf + b->len, s, n);
  b->buf[b->len + n] = 0;
  b->len += n + 1;
  return at;
}

static int pack_plan(const mb_nsinit_plan *p, int ncgroups, int *out) {
  size_t total = sizeof(mb_nsinit_wire);
  if (p->hostname) total += strlen(p->hostname) + 1;
  for (int i = 0; i < p->nmounts; i++) {
    const mb_mount *m = &p->mounts[i];
    total += (m->src ? strlen(m->src) + 1 : 0) + strlen(m->dst) + 1 + m->data_len + 1;
  }
  wire_buf b = {calloc(1, total), sizeof(mb_nsinit_wire)};
  if (!b.buf) return ENOMEM;
  mb_nsinit_wire *w = (mb_nsinit_wire *)b.buf;
  w->magic = MB_NSINIT_WIRE_MAGIC;
  w->header_size = sizeof *w;
  w->size = total;
  w->clone_flags = p->clone_flags;
  w->loopback = p->loopback;
  w->defer_pivot = p->defer_pivot;
  w->zygote = p->zygote;
  w->trees_passed = p->trees_passed;
  w->drop_groups = p->drop_groups;
  w->ncgroups = ncgroups;
  w->hostname_off = p->hostname ? wire_put(&b, p->hostname, strlen(p->hostname)) : -1;
  w->nmounts = p->nmounts;
  for (int i = 0; i < p->nmounts; i++) {
    const mb_mount *m = &p->mounts[i];
    w->mounts[i].type = m->type;
    w->mounts[i].optional = m->optional;
    w->mounts[i].size = m->size;
    w->mounts[i].src_off = m->src ? wire_put(&b, m->src, strlen(m->src)) : -1;
    w->mounts[i].dst_off = wire_put(&b, m->dst, strlen(m->dst));
    w->mounts[i].data_off = wire_put(&b, m->data, m->data_len);
    w->mounts[i].data_len = m->data_len;
  }
  int e = 0;
  int fd = memfd_create("moonbox-init-plan", MFD_CLOEXEC);
  if (fd < 0) e = errno;
  for (size_t done = 0; !e && done < b.len;) {
    ssize_t n = write(fd, b.buf + done, b.len - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) e = n < 0 ? errno : EIO;
    else done += (size_t)n;
  }
  free(b.buf);
  if (e) {
    if (fd >= 0) close(fd);
    return e;
  }
  *out = fd;
  return 0;
}

/* What the pre-exec child needs, all prepared before the clone: it shares
 * our memory (CLONE_VM) while we sleep (CLONE_VFORK), and only makes
 * system calls. */
typedef struct {
  int fds[MB_NSINIT_FD_CGROUP + MB_NSINIT_MAX_CGROUPS]; /* fds[k]: what goes to fd k (k >= 3) */
  int nfds;                                             /* fds 3 .. nfds - 1 */
  int joined;                                           /* set before each clone attempt: born in the first cgroup */
  int report_fd;
  int exe_fd;    /* init_exe_private or init_exe_readable */
  int fds_below; /* > 0: our fd table is shared (CLONE_FILES); keep only the fds below this */
} init_exec_args;

/* Moves a's fds (and exe) into low slots (src/child/fd_slots.c), for a
 * child that shares our fd table; 0, or -1 (a's fds are all valid either
 * way until mb_fd_slots_put: the clone then copies the table). */
static int take_slots(init_exec_args *a) {
  if (!mb_fd_slots_below()) return -1;
  for (int k = 3; k < a->nfds; k++)
    if (mb_fd_slot_take(&a->fds[k]) < 0) return -1;
  if (mb_fd_slot_take(&a->exe_fd) < 0) return -1;
  a->report_fd = a->fds[MB_NSINIT_FD_REPORT];
  a->fds_below = mb_fd_slots_below();
  return 0;
}

static char *const init_argv[] = {"moonbox-init", NULL};
static char *const init_envp[] = {NULL};

static void exec_fail(int report_fd, int err) {
  mb_nsinit_report r = {MB_NSINIT_EXEC, err, -1};
  ssize_t n;
  do n = write(report_fd, &r, sizeof r);
  while (n < 0 && errno == EINTR);
  _exit(127);
}

/* Runs in the clone, in the new namespaces: put the plan's fds at 3.., close
 * every other fd of the runtime (our fd table is a copy: the runtime's is
 * untouched), carry our capabilities in the new user namespace across the
 * exec (the namespace maps no id of ours yet, so an exec would drop them:
 * they go through the ambient set, which moonbox-init clears first thing),
 * and exec moonbox-init with an empty environment. */
static int init_exec_child(void *arg) {
  init_exec_args *a = (init_exec_args *)arg;
  int report = a->report_fd;
  /* first, while nothing else is done: our own table, of its low end only */
  if (mb_unshare_fds_below(a->fds_below) < 0)
    exec_fail(report, errno); /* (the table is still shared: report is the runtime's, as it should be) */
  prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
  if (pwrite(a->fds[MB_NSINIT_FD_PLAN], &a->joined, sizeof a->joined, offsetof(mb_nsinit_wire, first_cgroup_joined)) !=
      (ssize_t)sizeof a->joined)
    exec_fail(report, errno ? errno : EIO);
  /* above every target first, then into place (dup2 clears close-on-exec);
   * the first free fds above the targets, so that a low RLIMIT_NOFILE holds */
  const int HIGH = a->nfds + 1;
  int high[MB_NSINIT_FD_CGROUP + MB_NSINIT_MAX_CGROUPS + 1];
  for (int k = 3; k < a->nfds; k++)
    if ((high[k] = fcntl(a->fds[k], F_DUPFD_CLOEXEC, HIGH)) < 0) exec_fail(report, errno);
  report = high[MB_NSINIT_FD_REPORT];
  int exe = fcntl(a->exe_fd, F_DUPFD_CLOEXEC, HIGH);
  if (exe < 0) exec_fail(report, errno);
  for (int k = 3; k < a->nfds; k++)
    if (dup2(high[k], k) < 0) exec_fail(report, errno);
  report = MB_NSINIT_FD_REPORT;
  if (dup3(exe, a->nfds, O_CLOEXEC) < 0) exec_fail(report, errno);
  exe = a->nfds;
  if (syscall(SYS_close_range, (unsigned)a->nfds + 1, ~0U, 0) < 0) exec_fail(report, errno);
  struct __user_cap_header_struct hdr = {_LINUX_CAPABILITY_VERSION_3, 0};
  struct __user_cap_data_struct data[2];
  if (syscall(SYS_capget, &hdr, data) < 0) exec_fail(report, errno);
  data[0].inheritable = data[0].permitted;
  data[1].inheritable = data[1].permitted;
  if (syscall(SYS_capset, &hdr, data) < 0) exec_fail(report, errno);
  for (int c = 0; c <= cap_last; c++)
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, c, 0, 0) < 0) exec_fail(report, errno);
  syscall(SYS_execveat, exe, "", init_argv, init_envp, AT_EMPTY_PATH);
  exec_fail(report, errno);
  return 127;
}

/* A report already waiting (the child failed before or right after its
 * exec), without blocking; 0 when there is none. */
static int early_report(int rep_fd, mb_nsinit_report *r) {
  struct pollfd pf = {rep_fd, POLLIN, 0};
  if (poll(&pf, 1, 0) <= 0 || !(pf.revents & POLLIN)) return 0;
  ssize_t n;
  do n = read(rep_fd, r, sizeof *r);
  while (n < 0 && errno == EINTR);
  return n == (ssize_t)sizeof *r && r->stage != MB_NSINIT_READY;
}

/* ---- the zygote's inits ------------------------------------------------ */

/* One message of len bytes, with nfds fds (SCM_RIGHTS), on the init's socket. */
static int send_msg(int sock_fd, void *buf, size_t len, const int *fds, int nfds) {
  return mb_wire_send(sock_fd, buf, len, fds, nfds, 0) < 0 ? errno : 0;
}

static int tree_send(int sock_fd, int index, int fd) {
  mb_nsinit_tree t = {MB_NSINIT_TREE, index};
  return send_msg(sock_fd, &t, sizeof t, &fd, fd >= 0 ? 1 : 0);
}

/* An init cloned from the zygote cannot see the host's paths, and one
 * born with an owner uid's credentials cannot search a 0700 home
 * (plan.trees_passed): the sources of its binds and its device nodes, detached here as moonbox-init's
 * detach_sources would, sent one at a time (one fd held, whatever the
 * number of mounts). 0, or an errno and *failed the index of the mount
 * whose source could not be detached. */
static int trees_send(int sock_fd, const mb_nsinit_plan *p, int *failed) {
  int need_dev = 0, e;
  for (int i = 0; i < p->nmounts; i++) {
    const mb_mount *m = &p->mounts[i];
    if (m->type == MB_MOUNT_DEV) need_dev = 1;
    if (m->type != MB_MOUNT_BIND && m->type != MB_MOUNT_RO_BIND) continue;
    int fd = mb_detach_tree(AT_FDCWD, m->src, 0, m->type == MB_MOUNT_RO_BIND, 0);
    if (fd < 0 && m->optional && errno == ENOENT) continue;
    if (fd < 0) {
      *failed = i;
      return errno;
    }
    e = tree_send(sock_fd, i, fd);
    close(fd);
    if (e) return e;
  }
  for (int i = 0; need_dev && i < MB_NSINIT_NDEV; i++) {
    char path[32];
    snprintf(path, sizeof path, "/dev/%s", mb_nsinit_dev_nodes[i]);
    int fd = mb_detach_tree(AT_FDCWD, path, 0, 0, 1);
    if (fd < 0) continue; /* a node the host lacks: the sandbox lacks it too */
    e = tree_send(sock_fd, MB_NSINIT_MAX_MOUNTS + i, fd);
    close(fd);
    if (e) return e;
  }
  return tree_send(sock_fd, -1, -1);
}

/* The clone of an init, on the loop's thread or the zygote's. */
typedef struct {
  init_exec_args *args;
  char *stack;
  int flags, cgroup_dir;
  uid_t owner; /* the host uid to own the new user namespace; 0: ours */
  pid_t pid;
  int err;
} init_clone;

static void clone_init(void *arg) {
  init_clone *c = (init_clone *)arg;
  /* the user namespace's owner is who the kernel charges the sandbox's
   * per-user counters to, beside host root (src/owner.c) */
  if (mb_owner_enter(c->owner) < 0) {
    c->pid = -1;
    c->err = errno;
    return;
  }
  /* born in its cgroup where the kernel can: no migration to wait for */
  c->args->joined = c->cgroup_dir >= 0;
  c->pid = c->args->joined
             ? mb_clone_into_cgroup(init_exec_child, c->args, c->stack, INIT_STACK, c->flags, c->cgroup_dir)
             : -1;
  if (c->pid < 0) {
    c->args->joined = 0;
    c->pid = clone(init_exec_child, c->stack + INIT_STACK, c->flags | SIGCHLD, c->args);
  }
  c->err = c->pid < 0 ? errno : 0;
  mb_owner_leave(c->owner);
}

/* The zygote's namespace has no ld.so: only a static moonbox-init (not the
 * sanitizers' build) can be exec'd from it. */
#ifdef MOONBOX_INIT_STATIC
#define ZYGOTE_USABLE 1
#else
#define ZYGOTE_USABLE 0
#endif

/* What sandbox_init keeps of its spec besides the plan. */
typedef struct {
  char uid_map[4096], gid_map[4096]; /* the kernel takes less than a page */
  int deny_setgroups;
  uid_t owner;     /* the host uid to own the user namespace; 0: ours */
  int exit_cb_idx; /* stack index of spec.on_exit, or 0 */
} init_opts;

/* The fds of one init's start: ours and the ends it inherits. */
typedef struct {
  int sk[2], go[2], rep[2], plan_fd;
  int cgroup_dir; /* the first cgroup's directory, to clone the init into */
  int ncgroups;
} init_fds;

/* The spec's options (everything but cgroups) into the plan; raises on a
 * malformed one, before anything is opened. The strings stay on the stack:
 * the plan points into them. */
static void parse_init_options(lua_State *L, mb_nsinit_plan *p, init_opts *o) {
  memset(p, 0, sizeof *p);
  for (int i = 0; i < MB_NSINIT_MAX_CGROUPS; i++) p->cgroup_fds[i] = -1;
  lua_getfield(L, 1, "namespaces");
  luaL_checktype(L, -1, LUA_TTABLE);
  for (int i = 1; i <= (int)lua_objlen(L, -1); i++) {
    lua_rawgeti(L, -1, i);
    const char *name = lua_tostring(L, -1);
    int flag = 0;
    for (int k = 0; name && ns_names[k].name; k++)
      if (strcmp(name, ns_names[k].name) == 0) flag = ns_names[k].flag;
    if (!flag) luaL_error(L, "sandbox_init: unknown namespace '%s'", name ? name : "?");
    p->clone_flags |= flag;
    lua_pop(L, 1);
  }
  if (!(p->clone_flags & CLONE_NEWUSER) || !(p->clone_flags & CLONE_NEWNS) || !(p->clone_flags & CLONE_NEWPID))
    luaL_error(L, "sandbox_init: the user, mnt and pid namespaces are required");
  lua_getfield(L, 1, "hostname");
  p->hostname = lua_tostring(L, -1);
  lua_getfield(L, 1, "loopback");
  p->loopback = lua_toboolean(L, -1);
  lua_getfield(L, 1, "defer_pivot");
  p->defer_pivot = lua_toboolean(L, -1);
  lua_getfield(L, 1, "setgroups");
  const char *setgroups = lua_tostring(L, -1);
  if (!setgroups || (strcmp(setgroups, "allow") != 0 && strcmp(setgroups, "deny") != 0))
    luaL_error(L, "sandbox_init: setgroups: expected \"allow\" or \"deny\"");
  o->deny_setgroups = strcmp(setgroups, "deny") == 0;
  p->drop_groups = !o->deny_setgroups;
  parse_mounts(L, 1, p);
  lua_getfield(L, 1, "owner_uid");
  lua_Integer owner = luaL_optinteger(L, -1, 0);
  if (owner < 0 || owner >= (lua_Integer)UINT32_MAX || (owner && geteuid() != 0))
    luaL_error(L, "sandbox_init: owner_uid needs a runtime that is root and an id below 2^32-1");
  o->owner = (uid_t)owner;
  lua_getfield(L, 1, "on_exit");
  o->exit_cb_idx = lua_isfunction(L, -1) ? lua_gettop(L) : 0;
}

/* spec[field], an id map, into buf (size bytes). 0, or nil, message,
 * "EINVAL" pushed and 3: the map is the caller's (no default here), and
 * checked before it is written. */
static int read_id_map(lua_State *L, const char *field, char *buf, size_t size) {
  lua_getfield(L, 1, field);
  size_t len = 0;
  const char *text = lua_type(L, -1) == LUA_TSTRING ? lua_tolstring(L, -1, &len) : NULL;
  const char *why = !text ? "is required (a string)" : len >= size ? "is too long" : mb_id_map_check(text, len);
  if (!why) memcpy(buf, text, len + 1);
  lua_pop(L, 1);
  if (!why) return 0;
  char detail[128];
  snprintf(detail, sizeof detail, "sandbox_init: %s %s", field, why);
  return mb_push_errno(L, EINVAL, detail);
}

/* spec.cgroups: the cgroup.procs fds the init joins by (p->cgroup_fds) and
 * the first one's directory. 0, or an errno (*what "cgroup"). */
static int open_init_cgroups(lua_State *L, mb_nsinit_plan *p, init_fds *f, const char **what) {
  int err = 0;
  lua_getfield(L, 1, "cgroups");
  if (lua_istable(L, -1)) {
    if ((int)lua_objlen(L, -1) > MB_NSINIT_MAX_CGROUPS)
      return luaL_error(L, "sandbox_init: too many cgroups (max %d)", MB_NSINIT_MAX_CGROUPS);
    for (int i = 1; i <= (int)lua_objlen(L, -1) && !err; i++) {
      lua_rawgeti(L, -1, i);
      lua_pushfstring(L, "%s/cgroup.procs", luaL_checkstring(L, -1));
      p->cgroup_fds[i - 1] = open(lua_tostring(L, -1), O_WRONLY | O_CLOEXEC);
      if (p->cgroup_fds[i - 1] < 0) {
        err = errno;
        *what = "cgroup";
      } else f->ncgroups = i;
      if (i == 1) f->cgroup_dir = open(lua_tostring(L, -2), O_PATH | O_DIRECTORY | O_CLOEXEC);
      lua_pop(L, 2);
    }
  }
  lua_pop(L, 1);
  return err;
}

/* Clones the init (from the zygote where it can) with its plan in a memfd
 * and, where the runtime passes them, sends it its bind sources. 0 with
 * *pid, or an errno with *what (and *tree_failed: the mount whose source
 * could not be detached); *pid is the init's even when only sending its
 * trees failed, for the caller to kill. */
static int clone_init_process(mb_nsinit_plan *p, const init_opts *o, init_fds *f, pid_t *pid, int *tree_failed,
                              const char **what) {
  if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, f->sk) < 0 || pipe2(f->go, O_CLOEXEC) < 0 ||
      pipe2(f->rep, O_CLOEXEC) < 0) {
    *what = "socketpair";
    return errno;
  }
  p->zygote = ZYGOTE_USABLE && mb_zygote_available();
  p->trees_passed = p->zygote || o->owner != 0;
  int err = pack_plan(p, f->ncgroups, &f->plan_fd);
  if (err) {
    *what = "sandbox plan";
    return err;
  }
  int one = 1;
  setsockopt(f->sk[0], SOL_SOCKET, SO_PASSCRED, &one, sizeof one);
  static init_exec_args args;
  memset(&args, 0, sizeof args);
  args.fds[MB_NSINIT_FD_PLAN] = f->plan_fd;
  args.fds[MB_NSINIT_FD_SOCK] = f->sk[1];
  args.fds[MB_NSINIT_FD_GO] = f->go[0];
  args.fds[MB_NSINIT_FD_REPORT] = f->rep[1];
  for (int i = 0; i < f->ncgroups; i++) args.fds[MB_NSINIT_FD_CGROUP + i] = p->cgroup_fds[i];
  args.nfds = MB_NSINIT_FD_CGROUP + f->ncgroups;
  args.report_fd = f->rep[1];
  args.exe_fd = changes_ids(o->uid_map, o->gid_map) ? init_exe_private : init_exe_readable;
  int shared = take_slots(&args) == 0;
  /* the child only runs until its exec: a small stack of ours will do */
  static char stack[INIT_STACK] __attribute__((aligned(16)));
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  init_clone c = {.args = &args, .stack = stack, .cgroup_dir = f->cgroup_dir, .owner = o->owner, .pid = -1};
  c.flags = p->clone_flags | CLONE_VM | CLONE_VFORK | (shared ? CLONE_FILES : 0);
  if (!p->zygote) clone_init(&c);
  else if ((c.err = mb_zygote_run(clone_init, &c)) != 0) c.pid = -1;
  *pid = c.pid;
  if (c.pid < 0) {
    err = c.err;
    *what = "clone";
  }
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  mb_fd_slots_put();
  if (c.pid > 0 && p->trees_passed && (err = trees_send(f->sk[0], p, tree_failed)) != 0) *what = "sandbox mounts";
  return err;
}

/* The ends the init inherited (it has them now, or never will) and the
 * cgroup fds it joined by. */
static void close_inherited(mb_nsinit_plan *p, init_fds *f) {
  close_fd(&f->sk[1]);
  close_fd(&f->go[0]);
  close_fd(&f->rep[1]);
  close_fd(&f->plan_fd);
  for (int i = 0; i < MB_NSINIT_MAX_CGROUPS; i++) close_fd(&p->cgroup_fds[i]);
  close_fd(&f->cgroup_dir);
}

/* The init's user namespace: setgroups, then its id maps. 0 or an errno. */
static int write_id_maps(pid_t pid, const init_opts *o) {
  int err = 0;
  if (o->deny_setgroups) err = write_proc(pid, "setgroups", "deny");
  if (!err) err = write_proc(pid, "uid_map", o->uid_map);
  if (!err) err = write_proc(pid, "gid_map", o->gid_map);
  return err;
}

/* Lets the init go (unless *err) and reads how its set-up ended. An exec
 * that failed, or a moonbox-init that could not start, is that report, not
 * the id map that then could not be written (*err cleared). */
static mb_nsinit_report await_ready(init_fds *f, pid_t pid, int *err) {
  mb_nsinit_report r = {MB_NSINIT_GO, EPIPE, -1};
  if (pid > 0 && early_report(f->rep[0], &r)) *err = 0;
  else if (!*err) {
    ssize_t n;
    do n = write(f->go[1], "g", 1);
    while (n < 0 && errno == EINTR);
    do n = read(f->rep[0], &r, sizeof r);
    while (n < 0 && errno == EINTR);
    if (n != (ssize_t)sizeof r) r = (mb_nsinit_report){MB_NSINIT_GO, EPIPE, -1};
  }
  close_fd(&f->go[1]);
  close_fd(&f->rep[0]);
  return r;
}

/* A start that failed: the init killed and reaped, nil, message, CODE
 * pushed (the set-up stage, and the mount it failed at). */
static int start_failed(lua_State *L, const mb_nsinit_plan *p, init_fds *f, pid_t pid, int err, const char *what,
                        int tree_failed, mb_nsinit_report r) {
  if (pid > 0) {
    kill(pid, SIGKILL);
    while (waitpid(pid, NULL, 0) < 0 && errno == EINTR) {}
  }
  close_fd(&f->sk[0]);
  if (err && tree_failed >= 0) r = (mb_nsinit_report){MB_NSINIT_MOUNT, err, tree_failed};
  else if (err) return mb_push_errno(L, err, what);
  char detail[512];
  if (r.stage == MB_NSINIT_MOUNT && r.index >= 0 && r.index < p->nmounts) {
    const mb_mount *m = &p->mounts[r.index];
    snprintf(detail, sizeof detail, "sandbox set-up: mount #%d (%s %s -> %s)", r.index + 1, mount_types[m->type],
             m->src ? m->src : "-", m->dst);
  } else if (r.stage == MB_NSINIT_EXEC) {
    snprintf(detail, sizeof detail, "sandbox set-up: exec moonbox-init (%.400s)", init_exe_path);
  } else {
    snprintf(detail, sizeof detail, "sandbox set-up: %s", stage_name(r.stage));
  }
  return mb_push_errno(L, r.err, detail);
}

/* A started init: its handle, holding our end of its socket. */
static int push_init(lua_State *L, mb_core *core, pid_t pid, int sock_fd, int exit_cb_idx) {
  mb_handle *h = mb_handle_new(L, NSINIT, sizeof(nsinit_state));
  nsinit_state *st = (nsinit_state *)h->extra;
  st->pid = pid;
  st->sock_fd = sock_fd;
  lua_newtable(L);
  st->pids_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  int hidx = lua_gettop(L);
  /* the init is our child: its exit arrives through SIGCHLD like any other */
  mb_spawn_track(L, core, pid, exit_cb_idx);
  lua_pop(L, 1);
  lua_pushvalue(L, hidx);
  return 1;
}

static int nsinit_start(lua_State *L) {
  luaL_checktype(L, 1, LUA_TTABLE);
  mb_core *core = mb_core_get(L);
  static mb_nsinit_plan plan; /* packed into a memfd before the clone */
  mb_nsinit_plan *p = &plan;
  init_opts o;
  parse_init_options(L, p, &o);
  if (read_id_map(L, "uid_map", o.uid_map, sizeof o.uid_map) || read_id_map(L, "gid_map", o.gid_map, sizeof o.gid_map))
    return 3;
  if (init_exe_private < 0) {
    char detail[PATH_MAX + 96];
    snprintf(detail, sizeof detail, "sandbox set-up: moonbox-init (%s, or beside moonbox/core.so)", init_exe_path);
    return mb_push_errno(L, init_exe_err, detail);
  }
  init_fds f = {.sk = {-1, -1}, .go = {-1, -1}, .rep = {-1, -1}, .plan_fd = -1, .cgroup_dir = -1, .ncgroups = 0};
  const char *what = NULL;
  int tree_failed = -1;
  pid_t pid = -1;
  int err = open_init_cgroups(L, p, &f, &what);
  if (!err) err = clone_init_process(p, &o, &f, &pid, &tree_failed, &what);
  close_inherited(p, &f);
  if (!err && (err = write_id_maps(pid, &o)) != 0) what = "id map";
  mb_nsinit_report r = await_ready(&f, pid, &err);
  if (err || r.stage != MB_NSINIT_READY) return start_failed(L, p, &f, pid, err, what, tree_failed, r);
  return push_init(L, core, pid, f.sk[0], o.exit_cb_idx);
}

static nsinit_state *check_live(lua_State *L, int idx, mb_handle **hp) {
  mb_handle *h = mb_handle_check(L, idx, NSINIT);
  nsinit_state *st = (nsinit_state *)h->extra;
  if (hp) *hp = h;
  return st;
}

static void release(lua_State *L, nsinit_state *st) {
  close_fd(&st->sock_fd);
  if (st->pids_ref != LUA_NOREF) {
    luaL_unref(L, LUA_REGISTRYINDEX, st->pids_ref);
    st->pids_ref = LUA_NOREF;
  }
}

/* The host pid of the init's child pid (inside), forgotten; 0 if unknown. */
static pid_t take_host_pid(lua_State *L, nsinit_state *st, pid_t inside) {
  lua_rawgeti(L, LUA_REGISTRYINDEX, st->pids_ref);
  lua_rawgeti(L, -1, inside);
  pid_t host = (pid_t)lua_tointeger(L, -1);
  lua_pop(L, 1);
  lua_pushnil(L);
  lua_rawseti(L, -2, inside);
  lua_pop(L, 1);
  return host;
}

static void on_event(uv_poll_t *poll, int status, int events);

/* The poll waits for writable too while exits are pending: the socket
 * is writable at once, so they are delivered on the loop's next turn. */
static void want_send(mb_handle *h, nsinit_state *st, int on) {
  if (st->want_send == on || h->closing) return;
  st->want_send = on;
  uv_poll_start(&h->uv.poll, on ? UV_READABLE | UV_WRITABLE : UV_READABLE, on_event);
}

/* An exit read while waiting for a reply: kept for the loop (its callback
 * must not run inside the call that waits). The pid is resolved now, before
 * a reply can name the same pid inside for a new child. */
static void keep_exit(lua_State *L, mb_handle *h, nsinit_state *st, const mb_nsinit_event *ev) {
  pid_t host = take_host_pid(L, st, ev->pid);
  if (host <= 0) return;
  if (st->npending == st->cap) {
    int cap = st->cap ? st->cap * 2 : 16;
    pending_exit *p = (pending_exit *)realloc(st->pending, sizeof *p * (size_t)cap);
    if (!p) { /* out of memory: delivered now rather than lost */
      mb_spawn_deliver(h->core, host, ev->status);
      return;
    }
    st->pending = p;
    st->cap = cap;
  }
  st->pending[st->npending++] = (pending_exit){host, ev->status};
  want_send(h, st, 1);
}

static void deliver_pending(mb_handle *h, nsinit_state *st) {
  while (st->npending) {
    /* taken whole: the callbacks may spawn, and so keep new ones */
    pending_exit *p = st->pending;
    int n = st->npending;
    st->pending = NULL;
    st->npending = st->cap = 0;
    for (int i = 0; i < n; i++) mb_spawn_deliver(h->core, p[i].host, p[i].status);
    free(p);
  }
}

/* Deliver every exit the init reported; EOF means the init is gone, and with
 * it every process of its pid namespace. */
static void on_event(uv_poll_t *poll, int status, int events) {
  (void)status;
  (void)events;
  mb_handle *h = (mb_handle *)poll->data;
  nsinit_state *st = (nsinit_state *)h->extra;
  lua_State *cbL = h->core->cbL;
  deliver_pending(h, st);
  want_send(h, st, 0);
  for (;;) {
    mb_nsinit_event ev;
    ssize_t n = recv(st->sock_fd, &ev, sizeof ev, MSG_DONTWAIT | MSG_TRUNC);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n == (ssize_t)sizeof ev && ev.kind == MB_NSINIT_EVENT) {
      pid_t host = take_host_pid(cbL, st, ev.pid);
      if (host > 0) mb_spawn_deliver(h->core, host, ev.status);
      continue;
    }
    if (n > 0) continue; /* a reply no call waits for any more (it timed out) */
    /* EOF or error: the init has died */
    st->gone = 1;
    uv_poll_stop(poll);
    /* collect first: the exit callbacks may spawn (and so touch the table) */
    lua_rawgeti(cbL, LUA_REGISTRYINDEX, st->pids_ref);
    int t = lua_gettop(cbL), count = 0, cap = 0;
    lua_pushnil(cbL);
    while (lua_next(cbL, t)) {
      cap++;
      lua_pop(cbL, 1);
    }
    pid_t *hosts = (pid_t *)malloc(sizeof(pid_t) * (size_t)(cap + 1));
    lua_pushnil(cbL);
    while (lua_next(cbL, t)) {
      if (hosts && count < cap) hosts[count++] = (pid_t)lua_tointeger(cbL, -1);
      lua_pop(cbL, 1);
    }
    lua_settop(cbL, t - 1);
    release(cbL, st);
    mb_handle_close(cbL, h, 0);
    for (int i = 0; i < count; i++)
      if (hosts[i] > 0) mb_spawn_deliver(h->core, hosts[i], SIGKILL);
    free(hosts);
    return;
  }
}

/* Waits for the reply to the request just sent; the exits read meanwhile
 * are kept (keep_exit). */
static int recv_reply(lua_State *L, mb_handle *h, nsinit_state *st, mb_nsinit_reply *r, pid_t *cred_pid, int *fd) {
  union {
    mb_nsinit_reply reply;
    mb_nsinit_event event;
  } in;
  if (cred_pid) *cred_pid = 0;
  if (fd) *fd = -1;
  int64_t deadline = (int64_t)uv_hrtime() + REPLY_TIMEOUT_MS * 1000000LL; /* a wedged init must not hang us */
  for (;;) {
    mb_wire_in got;
    ssize_t n = mb_wire_recv(st->sock_fd, &in, sizeof in, &got);
    if (n < 0 && errno == EAGAIN) {
      /* non-blocking (the loop polls it): wait here, but not forever */
      struct pollfd pf = {st->sock_fd, POLLIN, 0};
      int left = (int)((deadline - (int64_t)uv_hrtime()) / 1000000);
      if (left <= 0) return ETIMEDOUT;
      if (poll(&pf, 1, left) < 0 && errno != EINTR) return errno;
      continue;
    }
    if (n < 0) return errno;
    int is_reply = n == (ssize_t)sizeof in.reply && in.reply.kind == MB_NSINIT_REPLY && !(got.flags & MSG_TRUNC);
    if (cred_pid && is_reply) *cred_pid = got.cred_pid;
    for (int i = 0; i < got.nfds; i++) {
      if (is_reply && fd && *fd < 0) *fd = got.fds[i];
      else close(got.fds[i]);
    }
    if (is_reply) {
      memcpy(r, &in.reply, sizeof *r);
      return 0;
    }
    if (n == (ssize_t)sizeof in.event && in.event.kind == MB_NSINIT_EVENT) {
      keep_exit(L, h, st, &in.event);
      continue;
    }
    return EPIPE; /* EOF (the init died) or a message we do not know */
  }
}

static int send_request(nsinit_state *st, mb_nsinit_request req, const int *fds, int nfds) {
  return send_msg(st->sock_fd, &req, sizeof req, fds, nfds);
}

/* Requests can still be sent: not closing, not shut down, not dead. */
static int usable(const mb_handle *h, const nsinit_state *st) { return !h->closing && !st->gone && !st->shut; }

/* A request whose reply says only done or (stage, errno), with at most an
 * fd attached (*fd when fd is given, else closed): 0 or an errno. */
static int ask(lua_State *L, mb_handle *h, nsinit_state *st, mb_nsinit_request req, const int *fds, int nfds, int *fd) {
  mb_nsinit_reply r;
  int e = send_request(st, req, fds, nfds);
  if (!e) e = recv_reply(L, h, st, &r, NULL, fd);
  if (!e && (r.stage || r.err)) e = r.err ? r.err : EIO;
  if (e && fd && *fd >= 0) {
    close(*fd);
    *fd = -1;
  }
  return e;
}

/* Called by core.spawn for spec.sandbox: the init forks and runs the plan.
 * Returns 0 with *host_pid and *inside_pid (the pid the sandbox sees), or 0
 * with fail filled in (the child's set-up failed and is already reaped), or
 * an errno for a transport failure. */
int mb_nsinit_spawn(lua_State *L, int idx, const mb_child_plan *plan, pid_t *host_pid, pid_t *inside_pid,
                    mb_child_report *fail) {
  mb_handle *h;
  nsinit_state *st = check_live(L, idx, &h);
  if (!usable(h, st)) return ESRCH;
  int fds[MB_WIRE_MAX_FDS], nfds = 0;
  int e = mb_wire_pack(plan, fds, &nfds);
  if (e) return e;
  e = send_request(st, (mb_nsinit_request){MB_NSINIT_SPAWN, 0, 0}, fds, nfds);
  close(fds[0]);
  if (e) return e == EPIPE || e == ECONNRESET ? ESRCH : e;
  mb_nsinit_reply r;
  pid_t host = 0;
  e = recv_reply(L, h, st, &r, &host, NULL);
  if (e) return e == EPIPE || e == ECONNRESET ? ESRCH : e;
  fail->stage = r.stage;
  fail->err = r.err;
  if (r.stage || r.err) return 0;
  if (host <= 0) return EPROTO;
  *host_pid = host;
  *inside_pid = r.pid;
  lua_rawgeti(L, LUA_REGISTRYINDEX, st->pids_ref);
  lua_pushinteger(L, host);
  lua_rawseti(L, -2, r.pid);
  lua_pop(L, 1);
  return 0;
}

static int nsinit_pid(lua_State *L) {
  lua_pushinteger(L, check_live(L, 1, NULL)->pid);
  return 1;
}

static int nsinit_socket(lua_State *L) {
  mb_handle *h;
  nsinit_state *st = check_live(L, 1, &h);
  const char *kind = luaL_optstring(L, 2, "tcp4");
  int domain = strcmp(kind, "tcp6") == 0 ? AF_INET6 : AF_INET;
  if (strcmp(kind, "tcp4") != 0 && strcmp(kind, "tcp6") != 0)
    return luaL_argerror(L, 2, "expected \"tcp4\" or \"tcp6\"");
  if (!usable(h, st)) return mb_push_errno(L, ESRCH, "sandbox init is gone");
  int fd = -1;
  int e = ask(L, h, st, (mb_nsinit_request){MB_NSINIT_SOCKET, domain, SOCK_STREAM}, NULL, 0, &fd);
  if (!e && fd < 0) e = EPROTO;
  if (e) return mb_push_errno(L, e, "socket in sandbox");
  lua_pushinteger(L, fd);
  return 1;
}

static int nsinit_finish(lua_State *L) {
  mb_handle *h;
  nsinit_state *st = check_live(L, 1, &h);
  size_t hl, sl, dl;
  const char *hostname = luaL_checklstring(L, 2, &hl);
  const char *src = luaL_checklstring(L, 3, &sl);
  const char *dst = luaL_checklstring(L, 4, &dl);
  static mb_nsinit_finish f;
  if (hl >= sizeof f.hostname || sl >= sizeof f.src || dl >= sizeof f.dst)
    return luaL_error(L, "finish: name too long");
  if (!usable(h, st)) return mb_push_errno(L, ESRCH, "sandbox init is gone");
  memset(&f, 0, sizeof f);
  f.type = MB_NSINIT_FINISH;
  memcpy(f.hostname, hostname, hl);
  memcpy(f.src, src, sl);
  memcpy(f.dst, dst, dl);
  /* Detach the source here where we can (our path permissions, not the
   * sandbox's ids'); an unprivileged runtime cannot, and the init opens it. */
  int tree = sl ? mb_detach_tree(AT_FDCWD, src, 0, 0, 0) : -1;
  if (tree < 0 && sl && errno != EPERM) return mb_push_errno(L, errno, src);
  int e = send_msg(st->sock_fd, &f, sizeof f, &tree, tree >= 0 ? 1 : 0);
  if (tree >= 0) close(tree);
  if (e) return mb_push_errno(L, e, "finish");
  mb_nsinit_reply r;
  e = recv_reply(L, h, st, &r, NULL, NULL);
  if (e) return mb_push_errno(L, e, "finish");
  if (r.stage || r.err) {
    lua_pushfstring(L, "sandbox set-up: %s (%s -> %s)", stage_name(r.stage), src, dst);
    return mb_push_errno(L, r.err ? r.err : EIO, lua_tostring(L, -1));
  }
  lua_pushboolean(L, 1);
  return 1;
}

static int nsinit_kill(lua_State *L) {
  nsinit_state *st = check_live(L, 1, NULL);
  int sig = lua_isnoneornil(L, 2) ? SIGKILL : mb_check_signal(L, 2);
  if (kill(st->pid, sig) < 0) return mb_push_errno(L, errno, "kill init");
  lua_pushboolean(L, 1);
  return 1;
}

/* init:hold(fd) -> true: the init keeps a dup of fd (close yours) until
 * init:give() or its death; nothing it starts gets it. */
static int nsinit_hold(lua_State *L) {
  mb_handle *h;
  nsinit_state *st = check_live(L, 1, &h);
  lua_Integer fd = luaL_checkinteger(L, 2);
  if (fd < 0 || fd > 0x7fffffff) return luaL_argerror(L, 2, "expected an fd");
  if (!usable(h, st)) return mb_push_errno(L, ESRCH, "sandbox init is gone");
  int pass = (int)fd;
  int e = ask(L, h, st, (mb_nsinit_request){MB_NSINIT_HOLD, 0, 0}, &pass, 1, NULL);
  if (e) return mb_push_errno(L, e == EPIPE || e == ECONNRESET ? ESRCH : e, "hold fd in sandbox init");
  lua_pushboolean(L, 1);
  return 1;
}

/* init:give() -> fd: the fd init:hold() gave it, back (ENOENT: none). */
static int nsinit_give(lua_State *L) {
  mb_handle *h;
  nsinit_state *st = check_live(L, 1, &h);
  if (!usable(h, st)) return mb_push_errno(L, ESRCH, "sandbox init is gone");
  int fd = -1;
  int e = ask(L, h, st, (mb_nsinit_request){MB_NSINIT_GIVE, 0, 0}, NULL, 0, &fd);
  if (!e && fd < 0) e = EPROTO;
  if (e) return mb_push_errno(L, e == EPIPE || e == ECONNRESET ? ESRCH : e, "fd held by sandbox init");
  lua_pushinteger(L, fd);
  return 1;
}

/* Shutting our side of the socket down makes the init exit, which ends its
 * pid namespace; the handle goes away once the socket reports that
 * (on_event), the exits it sent before included. */
static int nsinit_close(lua_State *L) {
  mb_handle **ud = (mb_handle **)luaL_checkudata(L, 1, NSINIT);
  mb_handle *h = *ud;
  if (!h || h->closing) return 0;
  nsinit_state *st = (nsinit_state *)h->extra;
  if (!st->shut && st->sock_fd >= 0) shutdown(st->sock_fd, SHUT_WR);
  st->shut = 1;
  return 0;
}

static int nsinit_new(lua_State *L) {
  int n = nsinit_start(L);
  if (n != 1) return n;
  mb_handle **ud = (mb_handle **)lua_touserdata(L, -1);
  mb_handle *h = *ud;
  nsinit_state *st = (nsinit_state *)h->extra;
  uv_poll_init(h->core->loop, &h->uv.poll, st->sock_fd);
  h->uv.poll.data = h;
  uv_poll_start(&h->uv.poll, UV_READABLE, on_event);
  uv_unref(&h->uv.handle); /* children keep the loop alive, not the init's socket */
  return 1;
}

static const luaL_Reg nsinit_methods[] = {
  {"pid", nsinit_pid},       {"socket", nsinit_socket}, {"kill", nsinit_kill}, {"close", nsinit_close},
  {"finish", nsinit_finish}, {"hold", nsinit_hold},     {"give", nsinit_give}, {NULL, NULL}};

void mb_open_nsinit(lua_State *L) {
  find_init();
  mb_fd_slots_reserve();
  mb_new_class(L, NSINIT, nsinit_methods);
  lua_pushcfunction(L, nsinit_new);
  lua_setfield(L, -2, "sandbox_init");
}
