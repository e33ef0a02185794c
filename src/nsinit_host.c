/* The runtime's side of a sandbox init (nsinit.h): start it in new
 * namespaces, map its ids, wait for its root filesystem, then ask it to
 * spawn children (core.spawn{sandbox = init}) and collect their exits.
 *
 *   core.sandbox_init(spec) -> init | nil, message, CODE
 *   spec: namespaces = {"user", "mnt", "pid", "ipc", "uts", "net"}, hostname,
 *         loopback, mounts = {{type, src, dst, data, size, optional}, ...},
 *         uid_map, gid_map (the lines written to /proc/<init>/uid_map and
 *         gid_map; default "0 <our uid> 1" and "0 <our gid> 1"),
 *         setgroups ("deny": written before gid_map, as an unprivileged
 *         user must; "allow": left, and the init drops the supplementary
 *         groups it inherited; default "deny" unless we are root),
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

#ifndef OPEN_TREE_CLONE
#define OPEN_TREE_CLONE 1
#endif
#ifndef AT_RECURSIVE
#define AT_RECURSIVE 0x8000
#endif

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#define NSINIT "moonbox.nsinit"
#define INIT_STACK (256 * 1024)

typedef struct {
  pid_t pid;
  int ctl_fd, event_fd;
  int pids_ref;   /* Lua table: pid inside -> host pid, for children still running */
  int gone;       /* the event socket reported EOF */
} nsinit_state;

static const struct { const char *name; int flag; } ns_names[] = {
  {"user", CLONE_NEWUSER}, {"mnt", CLONE_NEWNS}, {"pid", CLONE_NEWPID}, {"ipc", CLONE_NEWIPC},
  {"uts", CLONE_NEWUTS}, {"net", CLONE_NEWNET}, {"cgroup", CLONE_NEWCGROUP}, {NULL, 0}};

static const char *const mount_types[] = {"bind", "ro_bind", "tmpfs", "proc", "dev", "symlink", "file", "dir",
                                          "readonly", "mask", "sysctl", NULL};

static const char *stage_name(int stage) {
  switch (stage) {
  case MB_NSINIT_GO: return "start";
  case MB_NSINIT_PDEATHSIG: return "pdeathsig";
  case MB_NSINIT_CGROUP: return "cgroup join";
  case MB_NSINIT_HOSTNAME: return "sethostname";
  case MB_NSINIT_LOOPBACK: return "loopback up";
  case MB_NSINIT_MOUNT: return "mount";
  case MB_NSINIT_PIVOT: return "pivot_root";
  case MB_NSINIT_SIGNALS: return "signal setup";
  case MB_NSINIT_IDS: return "setresuid/setgroups";
  default: return "set-up";
  }
}

static void parse_mounts(lua_State *L, int idx, mb_nsinit_plan *p) {
  lua_getfield(L, idx, "mounts");
  if (lua_isnil(L, -1)) { lua_pop(L, 1); return; }
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
    for (int k = 0; type && mount_types[k]; k++) if (strcmp(type, mount_types[k]) == 0) mt->type = k;
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

static void close_fd(int *fd) { if (*fd >= 0) close(*fd); *fd = -1; }

static int nsinit_start(lua_State *L) {
  luaL_checktype(L, 1, LUA_TTABLE);
  mb_core *core = mb_core_get(L);
  static mb_nsinit_plan plan;  /* the child gets a copy; we only need it until clone returns */
  mb_nsinit_plan *p = &plan;
  memset(p, 0, sizeof *p);
  for (int i = 0; i < 8; i++) p->cgroup_fds[i] = -1;
  lua_getfield(L, 1, "namespaces");
  luaL_checktype(L, -1, LUA_TTABLE);
  for (int i = 1; i <= (int)lua_objlen(L, -1); i++) {
    lua_rawgeti(L, -1, i);
    const char *name = lua_tostring(L, -1);
    int flag = 0;
    for (int k = 0; name && ns_names[k].name; k++) if (strcmp(name, ns_names[k].name) == 0) flag = ns_names[k].flag;
    if (!flag) return luaL_error(L, "sandbox_init: unknown namespace '%s'", name ? name : "?");
    p->clone_flags |= flag;
    lua_pop(L, 1);
  }
  if (!(p->clone_flags & CLONE_NEWUSER) || !(p->clone_flags & CLONE_NEWNS) || !(p->clone_flags & CLONE_NEWPID))
    return luaL_error(L, "sandbox_init: the user, mnt and pid namespaces are required");
  lua_getfield(L, 1, "hostname");
  p->hostname = lua_tostring(L, -1);
  lua_getfield(L, 1, "loopback");
  p->loopback = lua_toboolean(L, -1);
  lua_getfield(L, 1, "defer_pivot");
  p->defer_pivot = lua_toboolean(L, -1);
  char uid_map[1024], gid_map[1024];
  lua_getfield(L, 1, "uid_map");
  if (lua_isnil(L, -1)) snprintf(uid_map, sizeof uid_map, "0 %u 1\n", (unsigned)getuid());
  else if (lua_objlen(L, -1) >= sizeof uid_map) return luaL_error(L, "sandbox_init: uid_map too long");
  else snprintf(uid_map, sizeof uid_map, "%s", luaL_checkstring(L, -1));
  lua_getfield(L, 1, "gid_map");
  if (lua_isnil(L, -1)) snprintf(gid_map, sizeof gid_map, "0 %u 1\n", (unsigned)getgid());
  else if (lua_objlen(L, -1) >= sizeof gid_map) return luaL_error(L, "sandbox_init: gid_map too long");
  else snprintf(gid_map, sizeof gid_map, "%s", luaL_checkstring(L, -1));
  lua_getfield(L, 1, "setgroups");
  const char *setgroups = luaL_optstring(L, -1, getuid() == 0 ? "allow" : "deny");
  if (strcmp(setgroups, "allow") != 0 && strcmp(setgroups, "deny") != 0)
    return luaL_error(L, "sandbox_init: setgroups: expected \"allow\" or \"deny\"");
  int deny_setgroups = strcmp(setgroups, "deny") == 0;
  p->drop_groups = !deny_setgroups;
  parse_mounts(L, 1, p);
  lua_getfield(L, 1, "on_exit");
  int exit_cb_idx = lua_isfunction(L, -1) ? lua_gettop(L) : 0;

  int ctl[2] = {-1, -1}, ev[2] = {-1, -1}, go[2] = {-1, -1}, rep[2] = {-1, -1};
  int err = 0;
  const char *what = NULL;
  int cgroup_dir = -1; /* the first cgroup's directory, to clone the init into */
  lua_getfield(L, 1, "cgroups");
  if (lua_istable(L, -1)) {
    for (int i = 1; i <= (int)lua_objlen(L, -1) && i <= 8 && !err; i++) {
      lua_rawgeti(L, -1, i);
      lua_pushfstring(L, "%s/cgroup.procs", luaL_checkstring(L, -1));
      p->cgroup_fds[i - 1] = open(lua_tostring(L, -1), O_WRONLY | O_CLOEXEC);
      if (p->cgroup_fds[i - 1] < 0) { err = errno; what = "cgroup"; }
      if (i == 1) cgroup_dir = open(lua_tostring(L, -2), O_PATH | O_DIRECTORY | O_CLOEXEC);
      lua_pop(L, 2);
    }
  }
  if (!err && (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, ctl) < 0 ||
               socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, ev) < 0 ||
               pipe2(go, O_CLOEXEC) < 0 || pipe2(rep, O_CLOEXEC) < 0)) { err = errno; what = "socketpair"; }
  pid_t pid = -1;
  if (!err) {
    int one = 1;
    struct timeval tv = {30, 0}; /* a wedged init must not hang the runtime forever */
    setsockopt(ctl[0], SOL_SOCKET, SO_PASSCRED, &one, sizeof one);
    setsockopt(ctl[0], SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    p->ctl_fd = ctl[1];
    p->event_fd = ev[1];
    p->go_fd = go[0];
    p->report_fd = rep[1];
    char *stack = (char *)malloc(INIT_STACK);
    if (!stack) return luaL_error(L, "out of memory");
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    /* born in its cgroup where the kernel can: no migration to wait for */
    p->first_cgroup_joined = cgroup_dir >= 0;
    pid = p->first_cgroup_joined ? mb_clone_into_cgroup(mb_nsinit_main, p, stack, INIT_STACK, p->clone_flags,
                                                        cgroup_dir) : -1;
    if (pid < 0) {
      p->first_cgroup_joined = 0;
      pid = clone(mb_nsinit_main, stack + INIT_STACK, p->clone_flags | SIGCHLD, p);
    }
    if (pid < 0) { err = errno; what = "clone"; }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    free(stack);
  }
  close_fd(&ctl[1]); close_fd(&ev[1]); close_fd(&go[0]); close_fd(&rep[1]);
  for (int i = 0; i < 8; i++) close_fd(&p->cgroup_fds[i]);
  close_fd(&cgroup_dir);
  if (!err) {
    if (deny_setgroups) err = write_proc(pid, "setgroups", "deny");
    if (!err) err = write_proc(pid, "uid_map", uid_map);
    if (!err) err = write_proc(pid, "gid_map", gid_map);
    if (err) what = "id map";
  }
  mb_nsinit_report r = {MB_NSINIT_GO, EPIPE, -1};
  if (!err) {
    ssize_t n;
    do n = write(go[1], "g", 1); while (n < 0 && errno == EINTR);
    do n = read(rep[0], &r, sizeof r); while (n < 0 && errno == EINTR);
    if (n != (ssize_t)sizeof r) r = (mb_nsinit_report){MB_NSINIT_GO, EPIPE, -1};
  }
  close_fd(&go[1]);
  close_fd(&rep[0]);
  if (err || r.stage != MB_NSINIT_READY) {
    if (pid > 0) {
      kill(pid, SIGKILL);
      while (waitpid(pid, NULL, 0) < 0 && errno == EINTR) {}
    }
    close_fd(&ctl[0]);
    close_fd(&ev[0]);
    if (err) return mb_push_errno(L, err, what);
    char detail[512];
    if (r.stage == MB_NSINIT_MOUNT && r.index >= 0 && r.index < p->nmounts) {
      const mb_mount *m = &p->mounts[r.index];
      snprintf(detail, sizeof detail, "sandbox set-up: mount #%d (%s %s -> %s)", r.index + 1,
               mount_types[m->type], m->src ? m->src : "-", m->dst);
    } else {
      snprintf(detail, sizeof detail, "sandbox set-up: %s", stage_name(r.stage));
    }
    return mb_push_errno(L, r.err, detail);
  }

  mb_handle *h = mb_handle_new(L, NSINIT, sizeof(nsinit_state));
  nsinit_state *st = (nsinit_state *)h->extra;
  st->pid = pid;
  st->ctl_fd = ctl[0];
  st->event_fd = ev[0];
  lua_newtable(L);
  st->pids_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  int hidx = lua_gettop(L);
  /* the init is our child: its exit arrives through SIGCHLD like any other */
  mb_spawn_track(L, core, pid, exit_cb_idx);
  lua_pop(L, 1);
  lua_pushvalue(L, hidx);
  return 1;
}

static nsinit_state *check_live(lua_State *L, int idx, mb_handle **hp) {
  mb_handle *h = mb_handle_check(L, idx, NSINIT);
  nsinit_state *st = (nsinit_state *)h->extra;
  if (hp) *hp = h;
  return st;
}

static void release(lua_State *L, nsinit_state *st) {
  close_fd(&st->ctl_fd);
  close_fd(&st->event_fd);
  if (st->pids_ref != LUA_NOREF) {
    luaL_unref(L, LUA_REGISTRYINDEX, st->pids_ref);
    st->pids_ref = LUA_NOREF;
  }
}

/* Deliver every exit the init reported; EOF means the init is gone, and with
 * it every process of its pid namespace. */
static void on_event(uv_poll_t *poll, int status, int events) {
  (void)status; (void)events;
  mb_handle *h = (mb_handle *)poll->data;
  nsinit_state *st = (nsinit_state *)h->extra;
  lua_State *cbL = h->core->cbL;
  for (;;) {
    mb_nsinit_event ev;
    ssize_t n = recv(st->event_fd, &ev, sizeof ev, MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n == (ssize_t)sizeof ev) {
      lua_rawgeti(cbL, LUA_REGISTRYINDEX, st->pids_ref);
      lua_rawgeti(cbL, -1, ev.pid);
      pid_t host = (pid_t)lua_tointeger(cbL, -1);
      lua_pop(cbL, 1);
      lua_pushnil(cbL);
      lua_rawseti(cbL, -2, ev.pid);
      lua_pop(cbL, 1);
      if (host > 0) mb_spawn_deliver(h->core, host, ev.status);
      continue;
    }
    /* EOF or error: the init has died */
    st->gone = 1;
    uv_poll_stop(poll);
    /* collect first: the exit callbacks may spawn (and so touch the table) */
    lua_rawgeti(cbL, LUA_REGISTRYINDEX, st->pids_ref);
    int t = lua_gettop(cbL), count = 0, cap = 0;
    lua_pushnil(cbL);
    while (lua_next(cbL, t)) { cap++; lua_pop(cbL, 1); }
    pid_t *hosts = (pid_t *)malloc(sizeof(pid_t) * (size_t)(cap + 1));
    lua_pushnil(cbL);
    while (lua_next(cbL, t)) {
      if (hosts && count < cap) hosts[count++] = (pid_t)lua_tointeger(cbL, -1);
      lua_pop(cbL, 1);
    }
    lua_settop(cbL, t - 1);
    release(cbL, st);
    mb_handle_close(cbL, h, 0);
    for (int i = 0; i < count; i++) if (hosts[i] > 0) mb_spawn_deliver(h->core, hosts[i], SIGKILL);
    free(hosts);
    return;
  }
}

static int recv_reply(nsinit_state *st, mb_nsinit_reply *r, pid_t *cred_pid, int *fd) {
  union { char buf[CMSG_SPACE(sizeof(struct ucred)) + CMSG_SPACE(sizeof(int) * 4)]; struct cmsghdr align; } u;
  struct iovec iov = {r, sizeof *r};
  struct msghdr msg;
  memset(&msg, 0, sizeof msg);
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = u.buf;
  msg.msg_controllen = sizeof u.buf;
  ssize_t n;
  do n = recvmsg(st->ctl_fd, &msg, MSG_CMSG_CLOEXEC); while (n < 0 && errno == EINTR);
  if (n < 0) return errno == EAGAIN ? ETIMEDOUT : errno;
  if (n != (ssize_t)sizeof *r) return EPIPE;
  if (cred_pid) *cred_pid = 0;
  if (fd) *fd = -1;
  for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET) continue;
    if (c->cmsg_type == SCM_CREDENTIALS && cred_pid) {
      struct ucred cred;
      memcpy(&cred, CMSG_DATA(c), sizeof cred);
      *cred_pid = cred.pid;
    } else if (c->cmsg_type == SCM_RIGHTS) {
      int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
      for (int i = 0; i < k; i++) {
        int got;
        memcpy(&got, CMSG_DATA(c) + i * sizeof(int), sizeof got);
        if (fd && *fd < 0) *fd = got; else close(got);
      }
    }
  }
  return 0;
}

static int send_msg(nsinit_state *st, void *buf, size_t len, const int *fds, int nfds) {
  union { char buf[CMSG_SPACE(sizeof(int) * MB_WIRE_MAX_FDS)]; struct cmsghdr align; } u;
  struct iovec iov = {buf, len};
  struct msghdr msg;
  memset(&msg, 0, sizeof msg);
  memset(&u, 0, sizeof u);
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (nfds > 0) {
    msg.msg_control = u.buf;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
    memcpy(CMSG_DATA(c), fds, sizeof(int) * (size_t)nfds);
  }
  ssize_t n;
  do n = sendmsg(st->ctl_fd, &msg, MSG_NOSIGNAL); while (n < 0 && errno == EINTR);
  return n < 0 ? errno : 0;
}

static int send_request(nsinit_state *st, mb_nsinit_request req, const int *fds, int nfds) {
  return send_msg(st, &req, sizeof req, fds, nfds);
}

/* Called by core.spawn for spec.sandbox: the init forks and runs the plan.
 * Returns 0 with *host_pid, or 0 with fail filled in (the child's set-up
 * failed and is already reaped), or an errno for a transport failure. */
int mb_nsinit_spawn(lua_State *L, int idx, const mb_child_plan *plan, pid_t *host_pid, mb_child_report *fail) {
  mb_handle *h;
  nsinit_state *st = check_live(L, idx, &h);
  if (h->closing || st->gone || st->ctl_fd < 0) return ESRCH;
  int fds[MB_WIRE_MAX_FDS], nfds = 0;
  int e = mb_wire_pack(plan, fds, &nfds);
  if (e) return e;
  e = send_request(st, (mb_nsinit_request){MB_NSINIT_SPAWN, 0, 0}, fds, nfds);
  close(fds[0]);
  if (e) return e == EPIPE || e == ECONNRESET ? ESRCH : e;
  mb_nsinit_reply r;
  pid_t host = 0;
  e = recv_reply(st, &r, &host, NULL);
  if (e) return e == EPIPE || e == ECONNRESET ? ESRCH : e;
  fail->stage = r.stage;
  fail->err = r.err;
  if (r.stage || r.err) return 0;
  if (host <= 0) return EPROTO;
  *host_pid = host;
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
  if (strcmp(kind, "tcp4") != 0 && strcmp(kind, "tcp6") != 0) return luaL_argerror(L, 2, "expected \"tcp4\" or \"tcp6\"");
  if (h->closing || st->gone || st->ctl_fd < 0) return mb_push_errno(L, ESRCH, "sandbox init is gone");
  int e = send_request(st, (mb_nsinit_request){MB_NSINIT_SOCKET, domain, SOCK_STREAM}, NULL, 0);
  mb_nsinit_reply r;
  int fd = -1;
  if (!e) e = recv_reply(st, &r, NULL, &fd);
  if (!e && (r.stage || r.err)) e = r.err ? r.err : EIO;
  if (e) { if (fd >= 0) close(fd); return mb_push_errno(L, e, "socket in sandbox"); }
  if (fd < 0) return mb_push_errno(L, EPROTO, "socket in sandbox");
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
  if (hl >= sizeof f.hostname || sl >= sizeof f.src || dl >= sizeof f.dst) return luaL_error(L, "finish: name too long");
  if (h->closing || st->gone || st->ctl_fd < 0) return mb_push_errno(L, ESRCH, "sandbox init is gone");
  memset(&f, 0, sizeof f);
  f.type = MB_NSINIT_FINISH;
  memcpy(f.hostname, hostname, hl);
  memcpy(f.src, src, sl);
  memcpy(f.dst, dst, dl);
  /* Detach the source here where we can (our path permissions, not the
   * sandbox's ids'); an unprivileged runtime cannot, and the init opens it. */
  int tree = sl ? (int)syscall(SYS_open_tree, AT_FDCWD, src, OPEN_TREE_CLONE | O_CLOEXEC | AT_RECURSIVE) : -1;
  if (tree >= 0) {
    struct { uint64_t attr_set, attr_clr, propagation, userns_fd; } attr = {0x2 | 0x4, 0, 0, 0}; /* nosuid, nodev */
    if (syscall(SYS_mount_setattr, tree, "", AT_EMPTY_PATH | AT_RECURSIVE, &attr, sizeof attr) < 0) {
      int e = errno;
      close(tree);
      return mb_push_errno(L, e, "finish: mount_setattr");
    }
  } else if (errno != EPERM) {
    return mb_push_errno(L, errno, src);
  }
  int e = send_msg(st, &f, sizeof f, &tree, tree >= 0 ? 1 : 0);
  if (tree >= 0) close(tree);
  if (e) return mb_push_errno(L, e, "finish");
  mb_nsinit_reply r;
  e = recv_reply(st, &r, NULL, NULL);
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


/* Closing the ctl socket makes the init exit, which ends its pid namespace;
 * the handle goes away once the event socket reports that (on_event). */
static int nsinit_close(lua_State *L) {
  mb_handle **ud = (mb_handle **)luaL_checkudata(L, 1, NSINIT);
  mb_handle *h = *ud;
  if (!h || h->closing) return 0;
  nsinit_state *st = (nsinit_state *)h->extra;
  close_fd(&st->ctl_fd);
  return 0;
}

static int nsinit_new(lua_State *L) {
  int n = nsinit_start(L);
  if (n != 1) return n;
  mb_handle **ud = (mb_handle **)lua_touserdata(L, -1);
  mb_handle *h = *ud;
  nsinit_state *st = (nsinit_state *)h->extra;
  uv_poll_init(h->core->loop, &h->uv.poll, st->event_fd);
  h->uv.poll.data = h;
  uv_poll_start(&h->uv.poll, UV_READABLE, on_event);
  uv_unref(&h->uv.handle); /* children keep the loop alive, not the init's event socket */
  return 1;
}

static const luaL_Reg nsinit_methods[] = {
  {"pid", nsinit_pid}, {"socket", nsinit_socket}, {"kill", nsinit_kill}, {"close", nsinit_close},
  {"finish", nsinit_finish}, {NULL, NULL}};

void mb_open_nsinit(lua_State *L) {
  mb_new_class(L, NSINIT, nsinit_methods);
  lua_pushcfunction(L, nsinit_new);
  lua_setfield(L, -2, "sandbox_init");
}
