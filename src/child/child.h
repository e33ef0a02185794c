/* The plan a spawned child carries out between clone() and execve().
 *
 * The parent parses the Lua spawn spec into this plain C struct before the
 * clone; the child only walks it (never touches Lua, never allocates) and
 * reports the first failing step to the parent over a close-on-exec pipe as
 * (stage, errno). EOF on that pipe means execve succeeded. */
#ifndef MOONBOX_CHILD_H
#define MOONBOX_CHILD_H

#include <linux/filter.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#ifndef CLOSE_RANGE_UNSHARE
#define CLOSE_RANGE_UNSHARE (1U << 1)
#endif

#define MB_MAX_FDS 16
#define MB_MAX_RLIMITS 8
#define MB_MAX_CANDIDATES 32
#define MB_MAX_EXTRA_CGROUPS 4
#define MB_MAX_GROUPS 32 /* supplementary groups of a process run as another user */

enum mb_fd_kind { MB_FD_NONE = 0, MB_FD_NULL, MB_FD_SOURCE };

typedef struct {
  int target; /* fd number in the child */
  enum mb_fd_kind kind;
  int source;     /* parent's fd to dup into place (MB_FD_SOURCE) */
  int null_flags; /* O_RDONLY / O_WRONLY for MB_FD_NULL */
} mb_fd_plan;

typedef enum {
  MB_STAGE_NONE = 0,
  MB_STAGE_SETSID,
  MB_STAGE_SETPGID,
  MB_STAGE_PDEATHSIG,
  MB_STAGE_CGROUP,
  MB_STAGE_FDS,
  MB_STAGE_CTTY,
  MB_STAGE_RLIMIT,
  MB_STAGE_CHDIR,
  MB_STAGE_SETGID,
  MB_STAGE_SETUID,
  MB_STAGE_SIGNALS,
  MB_STAGE_CLOSE_FDS,
  MB_STAGE_CAPS,
  MB_STAGE_SECCOMP,
  MB_STAGE_EXEC,
} mb_stage;

typedef struct {
  int stage;
  int err;
} mb_child_report;

typedef struct {
  const char *candidates[MB_MAX_CANDIDATES]; /* executable paths to try, in order */
  int ncandidates;
  char *const *argv;
  char *const *envp;
  const char *cwd; /* NULL: inherit */
  int setsid;
  int setpgid;
  int ctty;      /* child fd to make the controlling tty; -1: none */
  int pdeathsig; /* 0: none */
  pid_t parent_pid;
  int cgroup_procs_fd;                        /* -1: none; else an open cgroup.procs to join */
  int cgroup_dir_fd;                          /* that cgroup's directory, to be born in it (clone_into.c); -1: none */
  int cgroup_joined;                          /* born in it: cgroup_procs_fd is not written */
  int extra_cgroup_fds[MB_MAX_EXTRA_CGROUPS]; /* v1 controllers (memory, pids) to join; -1: none */
  mb_fd_plan fds[MB_MAX_FDS];
  int nfds;
  struct {
    int resource;
    struct rlimit limit;
  } rlimits[MB_MAX_RLIMITS];
  int nrlimits;
  int set_ids;
  uid_t uid;
  gid_t gid;
  int ngroups; /* with set_ids: its supplementary groups (0: none) */
  gid_t groups[MB_MAX_GROUPS];
  int report_fd;                    /* write end of the close-on-exec error pipe */
  const struct sock_fprog *seccomp; /* installed last, with no_new_privs; NULL: none */
  int no_new_privs;                 /* set no_new_privs even without a filter */
  int drop_caps;                    /* drop every capability not in cap_keep from the bounding set */
  unsigned long long cap_keep;      /* bit n keeps capability n */
  int unshare_below;                /* > 0: our fd table is shared (CLONE_FILES): keep the fds below this */
} mb_child_plan;

/* fd_slots.c: the fds a child shares our table for (CLONE_FILES) moved
 * below mb_fd_slots_below(), which it unshares at once (unshare_below). */
void mb_fd_slots_reserve(void);
int mb_fd_slots_below(void);  /* 0: no slots: clone without CLONE_FILES */
int mb_fd_slot_take(int *fd); /* *fd (if >= 0) becomes a slot holding a dup; 0 or -1 */
void mb_fd_slots_put(void);   /* every slot taken back to /dev/null */

/* The first step of a child that shares our fd table (below > 0): a table
 * of its own holding the fds below `below` alone. 0, or -1 with errno. */
static inline int mb_unshare_fds_below(int below) {
  return below > 0 ? (int)syscall(SYS_close_range, (unsigned)below, ~0U, CLOSE_RANGE_UNSHARE) : 0;
}

/* Entry point for clone(); never returns on success. */
int mb_child_main(void *plan);

/* clone3 with CLONE_INTO_CGROUP: fn(arg) runs in the child on [stack,
 * stack + stack_size), exit_signal SIGCHLD. -1 with errno when it cannot be
 * done (no clone3, an older kernel, not x86_64): use clone() then. */
pid_t mb_clone_into_cgroup(int (*fn)(void *), void *arg, void *stack, size_t stack_size, int flags, int cgroup_dir_fd);

/* mount_tree.c: a detached recursive copy of the tree at path (under dirfd,
 * open_tree's at_flags), nosuid, nodev unless devices, read-only if
 * readonly; its fd (close-on-exec), or -1 with errno. */
int mb_detach_tree(int dirfd, const char *path, int at_flags, int readonly, int devices);

const char *mb_stage_name(int stage);

#endif
