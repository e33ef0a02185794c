/* spawn: start a process from a spec table without fork()ing the runtime.
 *
 * clone(CLONE_VM|CLONE_VFORK) runs src/child/child.c on a small private
 * stack; the parent sleeps until the child has exec'd or failed, then reads
 * the close-on-exec report pipe: EOF is success, a (stage, errno) record is a
 * failure, returned as nil, "ENOENT: exec failed (argv[0]): 'nope'", "ENOENT"
 * with the child already reaped. Exits are collected by one SIGCHLD watcher
 * (waitpid(-1)), which also reaps orphans the runtime adopts as a child
 * subreaper. */
#include "private.h"
#include "child/child.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <sys/socket.h>
#include <unistd.h>

#define PROCESS "moonbox.process"
#define CHILD_STACK (64 * 1024)

typedef struct {
  pid_t pid;
  pid_t inside_pid; /* the pid in the sandbox's pid namespace (pid outside one) */
  int exited;
  int exit_code;
  int term_signal;
  int exit_ref; /* on_exit callback */
  int self_ref; /* anchor while running */
  mb_core *core;
} mb_process;

typedef struct {
  uv_signal_t sigchld;
  int procs_ref; /* table pid -> process userdata, for running children */
  int running;
  lua_Number orphans_reaped;
} spawn_state;

static spawn_state *state_of(lua_State *L, mb_core *core);

static void exit_status(int status, int *code, int *sig) {
  if (WIFEXITED(status)) {
    *code = WEXITSTATUS(status);
    *sig = 0;
  } else if (WIFSIGNALED(status)) {
    *sig = WTERMSIG(status);
    *code = 128 + *sig;
  } else {
    *code = -1;
    *sig = 0;
  }
}

/* Hand one exit to its process object (on_exit runs here). Returns 0 for a
 * pid we never started (an orphan we adopted as subreaper). */
int mb_spawn_deliver(mb_core *core, pid_t pid, int status) {
  spawn_state *ss = (spawn_state *)core->spawn_state;
  lua_State *cbL = core->cbL;
  if (!ss) return 0;
  lua_rawgeti(cbL, LUA_REGISTRYINDEX, ss->procs_ref);
  lua_rawgeti(cbL, -1, pid);
  mb_process *p = (mb_process *)lua_touserdata(cbL, -1);
  lua_pop(cbL, 1);
  if (!p) {
    lua_pop(cbL, 1);
    return 0;
  }
  lua_pushnil(cbL);
  lua_rawseti(cbL, -2, pid);
  lua_pop(cbL, 1);
  p->exited = 1;
  exit_status(status, &p->exit_code, &p->term_signal);
  if (--ss->running == 0) uv_unref((uv_handle_t *)&ss->sigchld);
  int exit_ref = p->exit_ref, self_ref = p->self_ref;
  p->exit_ref = p->self_ref = LUA_NOREF;
  if (exit_ref != LUA_NOREF) {
    lua_rawgeti(cbL, LUA_REGISTRYINDEX, exit_ref);
    luaL_unref(cbL, LUA_REGISTRYINDEX, exit_ref);
    lua_pushinteger(cbL, p->exit_code);
    lua_pushinteger(cbL, p->term_signal);
    luaL_unref(cbL, LUA_REGISTRYINDEX, self_ref);
    mb_call(core, cbL, 2);
  } else {
    luaL_unref(cbL, LUA_REGISTRYINDEX, self_ref);
  }
  return 1;
}

static void on_sigchld(uv_signal_t *handle, int signum) {
  (void)signum;
  mb_core *core = (mb_core *)handle->data;
  spawn_state *ss = (spawn_state *)core->spawn_state;
  int status;
  pid_t pid;
  while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
    if (!WIFEXITED(status) && !WIFSIGNALED(status)) continue;
    if (!mb_spawn_deliver(core, pid, status)) ss->orphans_reaped++;
  }
}

static spawn_state *state_of(lua_State *L, mb_core *core) {
  if (core->spawn_state) return (spawn_state *)core->spawn_state;
  spawn_state *ss = (spawn_state *)calloc(1, sizeof *ss);
  if (!ss) luaL_error(L, "out of memory");
  uv_signal_init(core->loop, &ss->sigchld);
  ss->sigchld.data = core;
  uv_signal_start(&ss->sigchld, on_sigchld, SIGCHLD);
  uv_unref((uv_handle_t *)&ss->sigchld);
  lua_newtable(L);
  ss->procs_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  core->spawn_state = ss;
  return ss;
}

static void free_sigchld(uv_handle_t *h) { free(h); }

void mb_spawn_teardown(mb_core *core) {
  spawn_state *ss = (spawn_state *)core->spawn_state;
  if (!ss) return;
  core->spawn_state = NULL;
  /* spawn_state starts with the uv handle, so the close callback frees it */
  if (!uv_is_closing((uv_handle_t *)&ss->sigchld)) uv_close((uv_handle_t *)&ss->sigchld, free_sigchld);
}

/* ---- spec parsing (all before the clone) -------------------------------- */

typedef struct {
  mb_child_plan plan;
  int pipe_parent_end[MB_MAX_FDS]; /* -1 when the entry is not a new pipe */
  int pipe_child_end[MB_MAX_FDS];
  char *path_buf; /* candidate paths, NUL separated */
  int own_pipes;  /* give new pipes to pipe_uid/pipe_gid */
  uid_t pipe_uid;
  gid_t pipe_gid;
} spawn_job;

static void job_cleanup(spawn_job *job) {
  for (int i = 0; i < MB_MAX_FDS; i++) {
    if (job->pipe_parent_end[i] >= 0) close(job->pipe_parent_end[i]);
    if (job->pipe_child_end[i] >= 0) close(job->pipe_child_end[i]);
    job->pipe_parent_end[i] = job->pipe_child_end[i] = -1;
  }
  if (job->plan.cgroup_procs_fd >= 0) close(job->plan.cgroup_procs_fd);
  if (job->plan.cgroup_dir_fd >= 0) close(job->plan.cgroup_dir_fd);
  job->plan.cgroup_procs_fd = job->plan.cgroup_dir_fd = -1;
  for (int i = 0; i < MB_MAX_EXTRA_CGROUPS; i++) {
    if (job->plan.extra_cgroup_fds[i] >= 0) close(job->plan.extra_cgroup_fds[i]);
    job->plan.extra_cgroup_fds[i] = -1;
  }
  free(job->path_buf);
  job->path_buf = NULL;
}

/* Build a NULL-terminated char* array from a Lua array of strings, or from a
 * map {K = V} for env ("K=V"). The strings stay alive on the Lua stack. */
static char **string_array(lua_State *L, int idx, int is_env, const char *what) {
  int n = 0;
  if (!is_env || lua_objlen(L, idx) > 0) {
    n = (int)lua_objlen(L, idx);
    char **arr = (char **)lua_newuserdata(L, sizeof(char *) * (size_t)(n + 1));
    for (int i = 1; i <= n; i++) {
      lua_rawgeti(L, idx, i);
      if (lua_type(L, -1) != LUA_TSTRING) luaL_error(L, "%s[%d] must be a string", what, i);
      arr[i - 1] = (char *)lua_tostring(L, -1);
      lua_pop(L, 1); /* kept alive by the table */
    }
    arr[n] = NULL;
    return arr;
  }
  /* map form: count, then build "K=V" strings kept in a table */
  lua_pushnil(L);
  while (lua_next(L, idx)) {
    n++;
    lua_pop(L, 1);
  }
  lua_newtable(L);
  int keep = lua_gettop(L);
  char **arr = (char **)lua_newuserdata(L, sizeof(char *) * (size_t)(n + 1));
  int i = 0;
  lua_pushnil(L);
  while (lua_next(L, idx)) {
    if (lua_type(L, -2) != LUA_TSTRING || lua_type(L, -1) != LUA_TSTRING)
      luaL_error(L, "%s keys and values must be strings", what);
    lua_pushfstring(L, "%s=%s", lua_tostring(L, -2), lua_tostring(L, -1));
    arr[i++] = (char *)lua_tostring(L, -1);
    lua_rawseti(L, keep, i);
    lua_pop(L, 1);
  }
  arr[i] = NULL;
  return arr;
}

static const char *env_lookup(char *const *envp, const char *name) {
  size_t len = strlen(name);
  for (; envp && *envp; envp++)
    if (strncmp(*envp, name, len) == 0 && (*envp)[len] == '=') return *envp + len + 1;
  return NULL;
}

/* execvp-style search, resolved in the parent so the child needs no malloc. */
static void plan_candidates(lua_State *L, spawn_job *job, const char *file) {
  mb_child_plan *p = &job->plan;
  if (strchr(file, '/')) {
    p->candidates[0] = file;
    p->ncandidates = 1;
    return;
  }
  const char *path = env_lookup(p->envp, "PATH");
  if (!path) path = "/usr/local/bin:/usr/bin:/bin";
  /* each segment becomes "<dir or .>/<file>\0": at most strlen(path) + 1
   * segments, each at most its own length + 1 ("." for an empty one) + flen + 2 */
  size_t flen = strlen(file), cap = (strlen(path) + 1) * (flen + 3) + 1;
  job->path_buf = (char *)malloc(cap);
  if (!job->path_buf) luaL_error(L, "out of memory");
  char *out = job->path_buf;
  const char *seg = path;
  while (p->ncandidates < MB_MAX_CANDIDATES) {
    const char *end = strchr(seg, ':');
    size_t slen = end ? (size_t)(end - seg) : strlen(seg);
    if (slen == 0) {
      memcpy(out, ".", 1);
      slen = 1;
    } else memcpy(out, seg, slen);
    out[slen] = '/';
    memcpy(out + slen + 1, file, flen + 1);
    p->candidates[p->ncandidates++] = out;
    out += slen + flen + 2;
    if (!end) break;
    seg = end + 1;
  }
}

static const struct {
  const char *name;
  int resource;
} rlimit_names[] = {{"nofile", RLIMIT_NOFILE}, {"nproc", RLIMIT_NPROC}, {"as", RLIMIT_AS},
                    {"cpu", RLIMIT_CPU},       {"fsize", RLIMIT_FSIZE}, {"core", RLIMIT_CORE},
                    {"stack", RLIMIT_STACK},   {"data", RLIMIT_DATA},   {NULL, 0}};

static void plan_rlimits(lua_State *L, mb_child_plan *p, int idx) {
  lua_getfield(L, idx, "rlimits");
  if (lua_isnil(L, -1)) {
    lua_pop(L, 1);
    return;
  }
  luaL_checktype(L, -1, LUA_TTABLE);
  for (int i = 0; rlimit_names[i].name; i++) {
    lua_getfield(L, -1, rlimit_names[i].name);
    if (!lua_isnil(L, -1)) {
      if (!lua_isnumber(L, -1)) luaL_error(L, "rlimits.%s must be a number", rlimit_names[i].name);
      lua_Number v = lua_tonumber(L, -1);
      rlim_t r = v < 0 ? RLIM_INFINITY : (rlim_t)v;
      p->rlimits[p->nrlimits].resource = rlimit_names[i].resource;
      p->rlimits[p->nrlimits].limit.rlim_cur = r;
      p->rlimits[p->nrlimits].limit.rlim_max = r;
      p->nrlimits++;
    }
    lua_pop(L, 1);
  }
  lua_pop(L, 1);
}

/* stdio entry: "pipe" (child reads on fd 0, writes otherwise), "in", "out",
 * "socket" (a unix stream socketpair: both ways, and fds can travel on it),
 * "null", "inherit", or an integer fd of ours to place there. Returns an
 * error code (negative uv error), 0, or 1 for misuse with the message pushed
 * (the caller releases what the job holds, then raises). */
static int plan_fd(lua_State *L, spawn_job *job, int target, int vidx) {
  mb_child_plan *p = &job->plan;
  if (p->nfds >= MB_MAX_FDS) {
    lua_pushfstring(L, "too many stdio entries (max %d)", MB_MAX_FDS);
    return 1;
  }
  int slot = p->nfds++;
  mb_fd_plan *f = &p->fds[slot];
  f->target = target;
  if (lua_type(L, vidx) == LUA_TNUMBER) {
    f->kind = MB_FD_SOURCE;
    f->source = (int)lua_tointeger(L, vidx);
    if (fcntl(f->source, F_GETFD) < 0) return uv_translate_sys_error(errno);
    return 0;
  }
  if (lua_type(L, vidx) != LUA_TSTRING) {
    lua_pushfstring(L, "stdio[%d] must be a kind or an fd, got %s", target, luaL_typename(L, vidx));
    return 1;
  }
  const char *v = lua_tostring(L, vidx);
  if (strcmp(v, "null") == 0) {
    f->kind = MB_FD_NULL;
    f->null_flags = target == 0 ? O_RDONLY : O_WRONLY;
  } else if (strcmp(v, "inherit") == 0) {
    f->kind = MB_FD_SOURCE;
    f->source = target;
    if (fcntl(target, F_GETFD) < 0) {
      f->kind = MB_FD_NULL;
      f->null_flags = O_RDWR;
    }
  } else if (strcmp(v, "pipe") == 0 || strcmp(v, "in") == 0 || strcmp(v, "out") == 0) {
    int child_reads = strcmp(v, "in") == 0 || (strcmp(v, "pipe") == 0 && target == 0);
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) < 0) return uv_translate_sys_error(errno);
    /* a child whose ids are not ours reopens it by /dev/fd/N (bash's script) */
    if (job->own_pipes && fchown(fds[0], job->pipe_uid, job->pipe_gid) < 0) {
      int e = errno;
      close(fds[0]);
      close(fds[1]);
      return uv_translate_sys_error(e);
    }
    job->pipe_child_end[slot] = child_reads ? fds[0] : fds[1];
    job->pipe_parent_end[slot] = child_reads ? fds[1] : fds[0];
    f->kind = MB_FD_SOURCE;
    f->source = job->pipe_child_end[slot];
  } else if (strcmp(v, "socket") == 0) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0) return uv_translate_sys_error(errno);
    job->pipe_child_end[slot] = sv[1];
    job->pipe_parent_end[slot] = sv[0];
    f->kind = MB_FD_SOURCE;
    f->source = sv[1];
  } else {
    lua_pushfstring(L, "stdio[%d]: unknown kind '%s'", target, v);
    return 1;
  }
  return 0;
}

static int process_new(lua_State *L, mb_core *core, pid_t pid, int exit_cb_idx) {
  mb_process *pr = (mb_process *)lua_newuserdata(L, sizeof(mb_process));
  memset(pr, 0, sizeof *pr);
  pr->pid = pr->inside_pid = pid;
  pr->core = core;
  pr->exit_ref = LUA_NOREF;
  luaL_getmetatable(L, PROCESS);
  lua_setmetatable(L, -2);
  if (exit_cb_idx) {
    lua_pushvalue(L, exit_cb_idx);
    pr->exit_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  }
  lua_pushvalue(L, -1);
  pr->self_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  return 1;
}

/* The fds of cp put into low slots (a dup each); 0, or -1 when they do
 * not all fit (cp's fds are all valid either way until mb_fd_slots_put). */
static int take_slots(mb_child_plan *cp) {
  if (!mb_fd_slots_below()) return -1;
  for (int i = 0; i < cp->nfds; i++)
    if (cp->fds[i].kind == MB_FD_SOURCE && mb_fd_slot_take(&cp->fds[i].source) < 0) return -1;
  for (int i = 0; i < MB_MAX_EXTRA_CGROUPS; i++)
    if (mb_fd_slot_take(&cp->extra_cgroup_fds[i]) < 0) return -1;
  if (mb_fd_slot_take(&cp->cgroup_procs_fd) < 0 || mb_fd_slot_take(&cp->report_fd) < 0) return -1;
  return 0;
}

/* clone(CLONE_VM|CLONE_VFORK) the child and read its report. Returns an
 * errno for a failure to start at all; *failed when the child reported a
 * failing step (it is reaped already). */
static int clone_child(spawn_job *job, pid_t *pid_out, mb_child_report *r, int *failed) {
  mb_child_plan *p = &job->plan;
  int report[2] = {-1, -1};
  if (pipe2(report, O_CLOEXEC) < 0) return errno;
  p->report_fd = report[1];
  char *stack = (char *)malloc(CHILD_STACK);
  if (!stack) {
    close(report[0]);
    close(report[1]);
    return ENOMEM;
  }
  /* The child's plan names its fds in low slots, and the child shares our
   * fd table instead of copying it (src/child/fd_slots.c); ours keeps
   * its own numbers. */
  mb_child_plan cp = *p;
  int flags = CLONE_VM | CLONE_VFORK;
  if (take_slots(&cp) == 0) {
    cp.unshare_below = mb_fd_slots_below();
    flags |= CLONE_FILES;
  }
  /* No signal handler may run in the child while it shares our memory. */
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  /* born in its cgroup where the kernel can, else cgroup.procs in the child */
  cp.cgroup_joined = cp.cgroup_dir_fd >= 0;
  pid_t pid =
    cp.cgroup_joined ? mb_clone_into_cgroup(mb_child_main, &cp, stack, CHILD_STACK, flags, cp.cgroup_dir_fd) : -1;
  if (pid < 0) {
    cp.cgroup_joined = 0;
    pid = clone(mb_child_main, stack + CHILD_STACK, flags | SIGCHLD, &cp);
  }
  int clone_errno = errno;
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  mb_fd_slots_put();
  p->cgroup_joined = cp.cgroup_joined;
  free(stack);
  close(report[1]);
  p->report_fd = -1;
  if (pid < 0) {
    close(report[0]);
    return clone_errno;
  }
  ssize_t n;
  do n = read(report[0], r, sizeof *r);
  while (n < 0 && errno == EINTR);
  close(report[0]);
  *failed = n == (ssize_t)sizeof *r;
  if (*failed) {
    int status;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
  }
  *pid_out = pid;
  return 0;
}

/* Register a running process we can expect an exit for (ours, or one a
 * sandbox init started); pushes the process object. */
int mb_spawn_track(lua_State *L, mb_core *core, pid_t pid, int exit_cb_idx) {
  spawn_state *ss = state_of(L, core);
  process_new(L, core, pid, exit_cb_idx);
  lua_rawgeti(L, LUA_REGISTRYINDEX, ss->procs_ref);
  lua_pushvalue(L, -2);
  lua_rawseti(L, -2, pid);
  lua_pop(L, 1);
  if (ss->running++ == 0) uv_ref((uv_handle_t *)&ss->sigchld);
  return 1;
}

static void job_init(spawn_job *job) {
  memset(job, 0, sizeof *job);
  for (int i = 0; i < MB_MAX_FDS; i++) job->pipe_parent_end[i] = job->pipe_child_end[i] = -1;
  mb_child_plan *p = &job->plan;
  p->cgroup_procs_fd = p->cgroup_dir_fd = -1;
  for (int i = 0; i < MB_MAX_EXTRA_CGROUPS; i++) p->extra_cgroup_fds[i] = -1;
  p->report_fd = -1;
  p->parent_pid = getpid();
}

/* What spawn keeps of its spec besides the plan. */
typedef struct {
  const char *file; /* what to exec: spec.file or args[1] */
  int sandbox_idx;  /* stack index of spec.sandbox, or 0 */
  int exit_cb_idx;  /* stack index of spec.on_exit, or 0 */
} spawn_opts;

/* The spec's plain options (everything but cgroups and stdio) into the
 * plan; raises on a malformed one, before anything is opened. The values
 * stay on the stack: the plan points into them. */
static void parse_options(lua_State *L, spawn_job *job, spawn_opts *o) {
  mb_child_plan *p = &job->plan;
  lua_getfield(L, 1, "args");
  if (!lua_istable(L, -1) || lua_objlen(L, -1) == 0) luaL_error(L, "spawn: args must be a non-empty array");
  p->argv = string_array(L, lua_gettop(L), 0, "args");
  lua_getfield(L, 1, "env");
  if (lua_isnil(L, -1)) {
    lua_pop(L, 1);
    lua_newtable(L);
  }
  luaL_checktype(L, -1, LUA_TTABLE);
  p->envp = string_array(L, lua_gettop(L), 1, "env");
  lua_getfield(L, 1, "file");
  o->file = lua_isnil(L, -1) ? p->argv[0] : luaL_checkstring(L, -1);
  lua_getfield(L, 1, "cwd");
  p->cwd = lua_isnil(L, -1) ? NULL : luaL_checkstring(L, -1);
  lua_getfield(L, 1, "setsid");
  p->setsid = lua_toboolean(L, -1);
  lua_getfield(L, 1, "setpgid");
  p->setpgid = lua_toboolean(L, -1);
  lua_getfield(L, 1, "seccomp");
  p->seccomp = lua_isnil(L, -1) ? NULL : mb_seccomp_check(L, lua_gettop(L));
  lua_getfield(L, 1, "ctty");
  p->ctty = lua_isnil(L, -1) ? -1 : (int)luaL_checkinteger(L, -1);
  lua_getfield(L, 1, "pdeathsig");
  if (!lua_isnil(L, -1)) p->pdeathsig = mb_check_signal(L, lua_gettop(L));
  lua_getfield(L, 1, "uid");
  lua_getfield(L, 1, "gid");
  if (!lua_isnil(L, -2) || !lua_isnil(L, -1)) {
    p->set_ids = 1;
    p->uid = lua_isnil(L, -2) ? getuid() : (uid_t)luaL_checkinteger(L, -2);
    p->gid = lua_isnil(L, -1) ? getgid() : (gid_t)luaL_checkinteger(L, -1);
    lua_getfield(L, 1, "groups");
    if (!lua_isnil(L, -1)) {
      luaL_checktype(L, -1, LUA_TTABLE);
      int n = (int)lua_objlen(L, -1);
      if (n > MB_MAX_GROUPS) luaL_error(L, "spawn: more than %d groups", MB_MAX_GROUPS);
      for (int i = 0; i < n; i++) {
        lua_rawgeti(L, -1, i + 1);
        p->groups[i] = (gid_t)luaL_checkinteger(L, -1);
        lua_pop(L, 1);
      }
      p->ngroups = n;
    }
    lua_pop(L, 1);
  }
  lua_getfield(L, 1, "no_new_privs");
  p->no_new_privs = lua_toboolean(L, -1);
  lua_getfield(L, 1, "cap_keep");
  if (!lua_isnil(L, -1)) {
    luaL_checktype(L, -1, LUA_TTABLE);
    p->drop_caps = 1;
    for (int i = 1; i <= (int)lua_objlen(L, -1); i++) {
      lua_rawgeti(L, -1, i);
      int cap = (int)luaL_checkinteger(L, -1);
      if (cap >= 0 && cap < 64) p->cap_keep |= 1ULL << cap;
      lua_pop(L, 1);
    }
  }
  lua_getfield(L, 1, "sandbox");
  o->sandbox_idx = lua_isnil(L, -1) ? 0 : lua_gettop(L);
  lua_getfield(L, 1, "on_exit");
  o->exit_cb_idx = 0;
  if (!lua_isnil(L, -1)) {
    luaL_checktype(L, -1, LUA_TFUNCTION);
    o->exit_cb_idx = lua_gettop(L);
  }
  plan_rlimits(L, p, 1);
  lua_getfield(L, 1, "pipe_uid");
  lua_getfield(L, 1, "pipe_gid");
  if (!lua_isnil(L, -2)) {
    job->own_pipes = 1;
    job->pipe_uid = (uid_t)luaL_checknumber(L, -2);
    job->pipe_gid = (gid_t)luaL_checknumber(L, -1);
  }
  lua_pop(L, 2);
}

/* spec.cgroup and spec.extra_cgroups (directories in other, v1,
 * hierarchies: memory, pids): the cgroup.procs fds the child joins by.
 * 0, or a uv error (*detail "cgroup"); raises on a malformed option (with
 * the job cleaned up). */
static int open_cgroups(lua_State *L, spawn_job *job, const char **detail) {
  mb_child_plan *p = &job->plan;
  int rc = 0;
  lua_getfield(L, 1, "cgroup");
  if (!lua_isnil(L, -1)) {
    const char *dir = luaL_checkstring(L, -1);
    lua_pushfstring(L, "%s/cgroup.procs", dir);
    p->cgroup_procs_fd = open(lua_tostring(L, -1), O_WRONLY | O_CLOEXEC);
    if (p->cgroup_procs_fd < 0) {
      rc = uv_translate_sys_error(errno);
      *detail = "cgroup";
    }
    p->cgroup_dir_fd = open(dir, O_PATH | O_DIRECTORY | O_CLOEXEC); /* -1: join by cgroup.procs */
  }
  lua_getfield(L, 1, "extra_cgroups");
  if (!rc && !lua_isnil(L, -1)) {
    luaL_checktype(L, -1, LUA_TTABLE);
    int n = (int)lua_objlen(L, -1);
    if (n > MB_MAX_EXTRA_CGROUPS) {
      job_cleanup(job);
      return luaL_error(L, "too many extra_cgroups");
    }
    for (int i = 0; i < n && !rc; i++) {
      lua_rawgeti(L, -1, i + 1);
      const char *dir = lua_tostring(L, -1);
      if (!dir) {
        job_cleanup(job);
        return luaL_error(L, "extra_cgroups[%d] must be a string", i + 1);
      }
      lua_pushfstring(L, "%s/cgroup.procs", dir);
      p->extra_cgroup_fds[i] = open(lua_tostring(L, -1), O_WRONLY | O_CLOEXEC);
      if (p->extra_cgroup_fds[i] < 0) {
        rc = uv_translate_sys_error(errno);
        *detail = "cgroup";
      }
      lua_pop(L, 2);
    }
  }
  return rc;
}

/* spec.stdio into the fd plan (new pipes, inherited fds, /dev/null), and
 * /dev/null for whichever of fds 0-2 it leaves out. 0, or a uv error
 * (*detail "stdio"); raises on a malformed entry (with the job cleaned up). */
static int plan_stdio(lua_State *L, spawn_job *job, const char **detail) {
  mb_child_plan *p = &job->plan;
  int rc = 0;
  lua_getfield(L, 1, "stdio");
  int stdio_idx = lua_gettop(L);
  if (!lua_isnil(L, stdio_idx)) {
    if (!lua_istable(L, stdio_idx)) {
      job_cleanup(job);
      return luaL_error(L, "spawn: stdio must be a table");
    }
    /* every key an fd number we place, never one silently left out */
    for (lua_pushnil(L); lua_next(L, stdio_idx); lua_pop(L, 1)) {
      lua_Number k = lua_type(L, -2) == LUA_TNUMBER ? lua_tonumber(L, -2) : -1;
      if (k < 0 || k > 255 || k != (lua_Number)(int)k) {
        job_cleanup(job);
        return luaL_error(L, "spawn: stdio keys must be fd numbers 0..255");
      }
    }
    for (int fd = 0; fd < 256 && !rc; fd++) {
      lua_rawgeti(L, stdio_idx, fd);
      if (!lua_isnil(L, -1)) {
        rc = plan_fd(L, job, fd, lua_gettop(L));
        if (rc > 0) {
          job_cleanup(job);
          luaL_where(L, 1);
          lua_insert(L, -2);
          lua_concat(L, 2);
          return lua_error(L);
        }
        if (rc) *detail = "stdio";
      }
      lua_pop(L, 1);
    }
  }
  /* fds 0-2 the spec leaves out are /dev/null, not closed: a closed stdio fd
   * would be taken by the child's next open() and its output land there */
  for (int fd = 0; fd <= 2 && !rc; fd++) {
    int placed = 0;
    for (int i = 0; i < p->nfds; i++) placed |= (p->fds[i].target == fd);
    if (placed) continue;
    if (p->nfds >= MB_MAX_FDS) {
      job_cleanup(job);
      return luaL_error(L, "too many stdio entries (max %d)", MB_MAX_FDS);
    }
    mb_fd_plan *f = &p->fds[p->nfds++];
    f->target = fd;
    f->kind = MB_FD_NULL;
    f->null_flags = fd == 0 ? O_RDONLY : O_WRONLY;
  }
  return rc;
}

/* Starts the planned child, through the sandbox's init or by clone, and
 * closes the child's ends of new pipes. 0 when it runs (*pid, *inside);
 * else the job is cleaned up and the count of what was pushed (nil,
 * message, CODE) is returned. */
static int start_child(lua_State *L, spawn_job *job, const spawn_opts *o, pid_t *pid, pid_t *inside) {
  mb_child_plan *p = &job->plan;
  mb_child_report r = {0, 0};
  int failed = 0;
  if (o->sandbox_idx) {
    int e = mb_nsinit_spawn(L, o->sandbox_idx, p, pid, inside, &r);
    if (e) {
      job_cleanup(job);
      return mb_push_errno(L, e, "spawn in sandbox");
    }
    failed = r.stage != 0 || r.err != 0;
  } else {
    int e = clone_child(job, pid, &r, &failed);
    if (e) {
      job_cleanup(job);
      return mb_push_errno(L, e, e == ENOMEM ? "out of memory" : "clone");
    }
  }
  for (int i = 0; i < MB_MAX_FDS; i++) {
    if (job->pipe_child_end[i] >= 0) close(job->pipe_child_end[i]);
    job->pipe_child_end[i] = -1;
  }
  if (!failed) return 0;
  const char *what = r.stage == MB_STAGE_EXEC ? "argv[0]" : r.stage == MB_STAGE_CHDIR ? "cwd" : NULL;
  const char *arg = r.stage == MB_STAGE_EXEC ? o->file : r.stage == MB_STAGE_CHDIR ? p->cwd : NULL;
  int uverr = uv_translate_sys_error(r.err);
  job_cleanup(job);
  lua_pushnil(L);
  if (what) lua_pushfstring(L, "%s: %s failed (%s): '%s'", uv_err_name(uverr), mb_stage_name(r.stage), what, arg);
  else lua_pushfstring(L, "%s: %s failed: %s", uv_err_name(uverr), mb_stage_name(r.stage), uv_strerror(uverr));
  lua_pushstring(L, uv_err_name(uverr));
  return 3;
}

/* Success: the process object, then a table of our ends of new pipes. */
static int push_started(lua_State *L, mb_core *core, spawn_job *job, const spawn_opts *o, pid_t pid, pid_t inside) {
  mb_child_plan *p = &job->plan;
  mb_spawn_track(L, core, pid, o->exit_cb_idx);
  if (o->sandbox_idx) ((mb_process *)lua_touserdata(L, -1))->inside_pid = inside;
  lua_newtable(L);
  for (int i = 0; i < p->nfds; i++) {
    int fd = job->pipe_parent_end[i];
    if (fd < 0) continue;
    job->pipe_parent_end[i] = -1;
    if (mb_stream_push_fd(L, fd, 0) != 1) {
      lua_pop(L, 3);
      close(fd);
      continue;
    }
    lua_rawseti(L, -2, p->fds[i].target);
  }
  job_cleanup(job);
  return 2;
}

/* core.spawn(spec) -> process, streams | nil, message, CODE
 * spec: args (array, required), file, env (array "K=V" or map; nothing is
 * inherited), cwd, stdio ({[fd] = kind}, fd 0..255), setsid, setpgid, pdeathsig,
 * ctty (child fd to make the controlling terminal; needs setsid), rlimits,
 * uid, gid, groups (supplementary gids with uid/gid; else none), cgroup (path
 * of a cgroup directory to start in), no_new_privs,
 * cap_keep (list of capability numbers to keep in the bounding set; the rest
 * are dropped), sandbox (a core.sandbox_init: the child starts inside it),
 * pipe_uid, pipe_gid (owner of the pipes made for stdio: a child running as
 * other ids, e.g. a sandbox's root, can reopen them by /dev/fd/N),
 * on_exit(exit_code, term_signal). */
static int spawn(lua_State *L) {
  luaL_checktype(L, 1, LUA_TTABLE);
  mb_core *core = mb_core_get(L);
  state_of(L, core); /* the SIGCHLD watcher must be up before a child can exit */
  spawn_job job;
  job_init(&job);
  spawn_opts o;
  parse_options(L, &job, &o);
  const char *fail_detail = NULL;
  int rc = open_cgroups(L, &job, &fail_detail);
  if (!rc) rc = plan_stdio(L, &job, &fail_detail);
  if (!rc) plan_candidates(L, &job, o.file);
  if (rc) {
    job_cleanup(&job);
    return mb_push_error(L, rc, fail_detail);
  }
  pid_t pid, inside = 0;
  int nret = start_child(L, &job, &o, &pid, &inside);
  if (nret) return nret;
  return push_started(L, core, &job, &o, pid, inside);
}

static mb_process *check_process(lua_State *L) { return (mb_process *)luaL_checkudata(L, 1, PROCESS); }

static int process_pid(lua_State *L) {
  lua_pushinteger(L, check_process(L)->pid);
  return 1;
}

/* process:sandbox_pid(): the pid the sandbox's own processes see (a sandbox
 * init's child), else the same as pid() */
static int process_sandbox_pid(lua_State *L) {
  lua_pushinteger(L, check_process(L)->inside_pid);
  return 1;
}

/* process:kill(signal) -> true | nil, "ESRCH: ...", "ESRCH" once it has exited */
static int process_kill(lua_State *L) {
  mb_process *pr = check_process(L);
  int sig = lua_isnoneornil(L, 2) ? SIGTERM : mb_check_signal(L, 2);
  if (pr->exited) return mb_push_error(L, UV_ESRCH, "process has exited");
  if (kill(pr->pid, sig) < 0) return mb_push_errno(L, errno, "kill");
  lua_pushboolean(L, 1);
  return 1;
}

/* process:status() -> "running" | "exited", exit_code, term_signal */
static int process_status(lua_State *L) {
  mb_process *pr = check_process(L);
  if (!pr->exited) {
    lua_pushstring(L, "running");
    return 1;
  }
  lua_pushstring(L, "exited");
  lua_pushinteger(L, pr->exit_code);
  lua_pushinteger(L, pr->term_signal);
  return 3;
}

/* core.kill(pid, signal): a negative pid signals a process group */
static int kill_pid(lua_State *L) {
  pid_t pid = (pid_t)luaL_checkinteger(L, 1);
  int sig = lua_isnoneornil(L, 2) ? SIGTERM : mb_check_signal(L, 2);
  if (pid == 0 || pid == -1) return luaL_argerror(L, 1, "refusing to signal our own group or everything");
  if (kill(pid, sig) < 0) return mb_push_errno(L, errno, "kill");
  lua_pushboolean(L, 1);
  return 1;
}

static int spawn_stats(lua_State *L) {
  spawn_state *ss = state_of(L, mb_core_get(L));
  lua_newtable(L);
  lua_pushinteger(L, ss->running);
  lua_setfield(L, -2, "running");
  lua_pushnumber(L, ss->orphans_reaped);
  lua_setfield(L, -2, "orphans_reaped");
  return 1;
}

static const luaL_Reg process_methods[] = {{"pid", process_pid},
                                           {"sandbox_pid", process_sandbox_pid},
                                           {"kill", process_kill},
                                           {"status", process_status},
                                           {NULL, NULL}};

void mb_open_spawn(lua_State *L) {
  mb_fd_slots_reserve();
  luaL_newmetatable(L, PROCESS);
  lua_newtable(L);
  luaL_register(L, NULL, process_methods);
  lua_setfield(L, -2, "__index");
  lua_pop(L, 1);
  lua_pushcfunction(L, spawn);
  lua_setfield(L, -2, "spawn");
  lua_pushcfunction(L, kill_pid);
  lua_setfield(L, -2, "kill");
  lua_pushcfunction(L, spawn_stats);
  lua_setfield(L, -2, "spawn_stats");
}
