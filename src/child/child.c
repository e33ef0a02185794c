/* Runs in the child between clone(CLONE_VM|CLONE_VFORK) and execve(): it
 * shares the parent's memory, so it only reads the plan, makes system calls
 * and reports failure; no allocation, no stdio, no Lua. Each step is one
 * short function; the order is the checklist. */
#include "child.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/ioctl.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

static const char *const stage_names[] = {
  [MB_STAGE_NONE] = "none",
  [MB_STAGE_SETSID] = "setsid",
  [MB_STAGE_SETPGID] = "setpgid",
  [MB_STAGE_PDEATHSIG] = "pdeathsig",
  [MB_STAGE_CGROUP] = "cgroup",
  [MB_STAGE_FDS] = "fd setup",
  [MB_STAGE_CTTY] = "controlling tty",
  [MB_STAGE_RLIMIT] = "setrlimit",
  [MB_STAGE_CHDIR] = "chdir",
  [MB_STAGE_SETGID] = "setgid",
  [MB_STAGE_SETUID] = "setuid",
  [MB_STAGE_SIGNALS] = "signal reset",
  [MB_STAGE_CLOSE_FDS] = "close fds",
  [MB_STAGE_CAPS] = "capabilities",
  [MB_STAGE_SECCOMP] = "seccomp",
  [MB_STAGE_EXEC] = "exec",
};

const char *mb_stage_name(int stage) {
  if (stage < 0 || stage > MB_STAGE_EXEC) return "unknown";
  return stage_names[stage];
}

static void fail(const mb_child_plan *p, int stage, int err) {
  mb_child_report r = {stage, err};
  ssize_t n;
  do n = write(p->report_fd, &r, sizeof r);
  while (n < 0 && errno == EINTR);
  _exit(127);
}

static int step_session(const mb_child_plan *p) {
  if (p->setsid && setsid() < 0) return MB_STAGE_SETSID;
  if (!p->setsid && p->setpgid && setpgid(0, 0) < 0) return MB_STAGE_SETPGID;
  return 0;
}

static int step_pdeathsig(const mb_child_plan *p) {
  if (!p->pdeathsig) return 0;
  if (prctl(PR_SET_PDEATHSIG, p->pdeathsig) < 0) return MB_STAGE_PDEATHSIG;
  /* the parent may have died before prctl took effect */
  if (getppid() != p->parent_pid) {
    errno = ESRCH;
    return MB_STAGE_PDEATHSIG;
  }
  return 0;
}

static int step_cgroup(const mb_child_plan *p) {
  if (p->cgroup_procs_fd >= 0 && !p->cgroup_joined && write(p->cgroup_procs_fd, "0", 1) != 1) return MB_STAGE_CGROUP;
  for (int i = 0; i < MB_MAX_EXTRA_CGROUPS; i++)
    if (p->extra_cgroup_fds[i] >= 0 && write(p->extra_cgroup_fds[i], "0", 1) != 1) return MB_STAGE_CGROUP;
  return 0;
}

/* Move every source fd above all targets first, so that placing one target
 * never clobbers a source another target still needs. */
static int step_fds(mb_child_plan *p) {
  int high = 3;
  for (int i = 0; i < p->nfds; i++)
    if (p->fds[i].target >= high) high = p->fds[i].target + 1;
  if (p->report_fd >= high) high = p->report_fd + 1;
  /* the report pipe must survive placement: move it out of the way of targets */
  for (int i = 0; i < p->nfds; i++) {
    if (p->fds[i].target != p->report_fd) continue;
    int moved = fcntl(p->report_fd, F_DUPFD_CLOEXEC, high);
    if (moved < 0) return MB_STAGE_FDS;
    p->report_fd = moved;
    high = moved + 1;
    break;
  }
  for (int i = 0; i < p->nfds; i++) {
    mb_fd_plan *f = &p->fds[i];
    int fd;
    if (f->kind == MB_FD_NULL) {
      fd = open("/dev/null", f->null_flags | O_CLOEXEC);
      if (fd < 0) return MB_STAGE_FDS;
      int moved = fcntl(fd, F_DUPFD_CLOEXEC, high);
      close(fd);
      fd = moved;
    } else if (f->kind == MB_FD_SOURCE) {
      fd = fcntl(f->source, F_DUPFD_CLOEXEC, high);
    } else {
      continue;
    }
    if (fd < 0) return MB_STAGE_FDS;
    f->source = fd;
    f->kind = MB_FD_SOURCE;
  }
  for (int i = 0; i < p->nfds; i++) {
    if (p->fds[i].kind != MB_FD_SOURCE) continue;
    if (dup2(p->fds[i].source, p->fds[i].target) < 0) return MB_STAGE_FDS; /* dup2 clears CLOEXEC */
  }
  return 0;
}

static int step_ctty(const mb_child_plan *p) {
  if (p->ctty < 0) return 0;
  if (ioctl(p->ctty, TIOCSCTTY, 0) < 0) return MB_STAGE_CTTY;
  return 0;
}

static int step_rlimits(const mb_child_plan *p) {
  for (int i = 0; i < p->nrlimits; i++)
    if (setrlimit(p->rlimits[i].resource, &p->rlimits[i].limit) < 0) return MB_STAGE_RLIMIT;
  return 0;
}

static int step_chdir(const mb_child_plan *p) {
  if (p->cwd && chdir(p->cwd) < 0) return MB_STAGE_CHDIR;
  return 0;
}

/* Raw syscalls: glibc's setgroups/setgid/setuid in a process it believes
 * threaded run __nptl_setxid over the thread list, which this CLONE_VM child
 * shares with the runtime (its threads are not ours to signal or wait on). */
static int step_ids(const mb_child_plan *p) {
  if (!p->set_ids) return 0;
  if (p->ngroups > 0) {
    /* asked for: they are set or the process does not start */
    if (syscall(SYS_setgroups, (size_t)p->ngroups, p->groups) < 0) return MB_STAGE_SETGID;
  } else if (syscall(SYS_setgroups, 0, NULL) < 0 && errno != EPERM) {
    return MB_STAGE_SETGID; /* (EPERM: a user namespace with setgroups denied has none to drop) */
  }
  if (syscall(SYS_setgid, p->gid) < 0) return MB_STAGE_SETGID;
  if (syscall(SYS_setuid, p->uid) < 0) return MB_STAGE_SETUID;
  return 0;
}

/* The runtime (and libraries it may be embedded with) ignore SIGPIPE and block
 * signals; a child must start with default dispositions and an empty mask. */
static int step_signals(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = SIG_DFL;
  for (int s = 1; s < NSIG; s++) {
    if (s == SIGKILL || s == SIGSTOP) continue;
    sigaction(s, &sa, NULL); /* fails harmlessly for signals glibc reserves */
  }
  /* the raw call: glibc's sigprocmask leaves its own signals (32, 33) as they
   * were, and the runtime's thread may have had them blocked when it cloned */
  uint64_t none = 0;
  if (syscall(SYS_rt_sigprocmask, SIG_SETMASK, &none, NULL, sizeof none) < 0) return MB_STAGE_SIGNALS;
  return 0;
}

/* Close every fd the plan did not place, except the report pipe (which is
 * close-on-exec and so disappears at execve). */
static int step_close_fds(const mb_child_plan *p) {
  int keep_max = 2;
  for (int i = 0; i < p->nfds; i++)
    if (p->fds[i].target > keep_max) keep_max = p->fds[i].target;
  for (int fd = 0; fd <= keep_max; fd++) {
    int placed = 0;
    for (int i = 0; i < p->nfds; i++) placed |= (p->fds[i].target == fd);
    if (!placed && fd != p->report_fd) close(fd);
  }
  unsigned lo = (unsigned)keep_max + 1, rfd = (unsigned)p->report_fd;
  if (rfd >= lo) {
    if (rfd > lo && syscall(SYS_close_range, lo, rfd - 1, 0) < 0) return MB_STAGE_CLOSE_FDS;
    lo = rfd + 1;
  }
  if (syscall(SYS_close_range, lo, ~0U, 0) < 0) return MB_STAGE_CLOSE_FDS;
  return 0;
}

/* Inside a user namespace the process is root there: what it may do is the
 * bounding set, which also caps what any later execve can gain. Cut before
 * step_ids: dropping from it needs CAP_SETPCAP, which a setuid to another
 * user (an image's User) takes away. */
static int step_caps(const mb_child_plan *p) {
  if (!p->drop_caps) return 0;
  for (int cap = 0; cap < 64; cap++) {
    if (p->cap_keep & (1ULL << cap)) continue;
    if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0) {
      if (errno == EINVAL) break; /* past the last capability this kernel knows */
      return MB_STAGE_CAPS;
    }
  }
  return 0;
}

/* Last before exec: nothing after this needs a call the filter may deny. */
static int step_seccomp(const mb_child_plan *p) {
  if (p->no_new_privs && !p->seccomp && prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) return MB_STAGE_SECCOMP;
  if (!p->seccomp) return 0;
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) return MB_STAGE_SECCOMP;
  if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, p->seccomp) < 0) return MB_STAGE_SECCOMP;
  return 0;
}

static int step_exec(const mb_child_plan *p) {
  int err = ENOENT;
  for (int i = 0; i < p->ncandidates; i++) {
    execve(p->candidates[i], p->argv, p->envp);
    /* keep the most telling error, as execvp does: EACCES beats ENOENT */
    if (errno != ENOENT && errno != ENOTDIR) err = errno;
    if (errno != ENOENT && errno != ENOTDIR && errno != EACCES) break;
  }
  errno = err;
  return MB_STAGE_EXEC;
}

int mb_child_main(void *arg) {
  mb_child_plan *p = (mb_child_plan *)arg;
  int stage;
  /* first: our own fd table, of the runtime's low end only (fd_slots.c) */
  if (mb_unshare_fds_below(p->unshare_below) < 0) fail(p, MB_STAGE_CLOSE_FDS, errno);
  if ((stage = step_session(p)) || (stage = step_pdeathsig(p)) || (stage = step_cgroup(p)) || (stage = step_fds(p)) ||
      (stage = step_ctty(p)) || (stage = step_rlimits(p)) || (stage = step_chdir(p)) || (stage = step_caps(p)) ||
      (stage = step_ids(p)) || (stage = step_signals()) || (stage = step_close_fds(p)) || (stage = step_seccomp(p)) ||
      (stage = step_exec(p)))
    fail(p, stage, errno);
  return 127;
}
