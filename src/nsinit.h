/* The sandbox init: pid 1 of a sandbox's namespaces.
 *
 * The runtime clone()s it with CLONE_VM|CLONE_VFORK and new user, mount,
 * pid, ipc, uts and optionally net namespaces; the child at once execs the
 * small moonbox-init binary (src/nsinit.c), so the runtime never keeps a
 * copy-on-write twin of its heap (see nsinit_host.c). The plan arrives as
 * bytes in a memfd (mb_nsinit_wire below) on a fixed fd. The init
 * assembles the root filesystem from the mount plan, enters it, then
 * serves one socket (one fd of the runtime per sandbox, for runtimes of
 * thousands), which carries
 *   requests: the runtime sends one, the init answers it (spawn a child
 *             from a packed plan, create a socket inside the sandbox's
 *             network namespace, hold or give back an fd);
 *   events:   the init reports the exit of every child it started, between
 *             replies; the runtime keeps those it reads while it waits for a
 *             reply and delivers them from its loop.
 * It reaps every orphan of the sandbox, and dies with the runtime
 * (PDEATHSIG) or when the runtime shuts the socket down, taking the whole
 * pid namespace with it. */
#ifndef MOONBOX_NSINIT_H
#define MOONBOX_NSINIT_H

#include <stdint.h>
#include <sys/types.h>

#define MB_NSINIT_MAX_MOUNTS 128
#define MB_NSINIT_MAX_CGROUPS 8

/* the host's device nodes a sandbox's /dev gets (MB_MOUNT_DEV) */
#define MB_NSINIT_NDEV 6
static const char *const mb_nsinit_dev_nodes[MB_NSINIT_NDEV] = {"null", "zero", "full", "random", "urandom", "tty"};

/* The fds moonbox-init starts with (besides the runtime's stdio), in this
 * order; nothing else is open. MB_NSINIT_FD_CGROUP + i: the i-th cgroup.procs. */
enum {
  MB_NSINIT_FD_PLAN = 3, /* memfd: an mb_nsinit_wire, then its strings */
  MB_NSINIT_FD_SOCK,     /* the init's end of its socket */
  MB_NSINIT_FD_GO,       /* read end: one byte once the id maps are written */
  MB_NSINIT_FD_REPORT,   /* write end: one mb_nsinit_report */
  MB_NSINIT_FD_CGROUP,
};

enum mb_mount_type {
  MB_MOUNT_BIND,
  MB_MOUNT_RO_BIND,
  MB_MOUNT_TMPFS,
  MB_MOUNT_PROC,
  MB_MOUNT_DEV,
  MB_MOUNT_SYMLINK,
  MB_MOUNT_FILE,
  MB_MOUNT_DIR,
  MB_MOUNT_READONLY, /* an existing path (of an earlier mount) bound over itself read-only */
  MB_MOUNT_MASK,     /* an existing path hidden: an empty read-only dir or file over it */
  MB_MOUNT_SYSCTL,   /* data written into an existing file (a /proc/sys entry of our namespaces) */
  MB_MOUNT_OVERLAY,  /* the root itself becomes an overlayfs (an image's layers): data = its options */
};

typedef struct {
  int type;
  const char *src;  /* host path (binds), link target (symlink) */
  const char *dst;  /* absolute path inside the sandbox */
  const char *data; /* file contents (file) */
  size_t data_len;
  uint64_t size; /* tmpfs size in bytes (dev: its /dev/shm); 0: the kernel default */
  int optional;  /* a bind whose source (readonly, mask, sysctl: whose dst) is missing is skipped */
} mb_mount;

typedef struct {
  int clone_flags;
  const char *hostname; /* NULL: keep */
  int loopback;         /* bring lo up (new net namespace) */
  mb_mount mounts[MB_NSINIT_MAX_MOUNTS];
  int nmounts;
  int cgroup_fds[MB_NSINIT_MAX_CGROUPS]; /* cgroup.procs files to join first; -1: none */
  int first_cgroup_joined;               /* born in the first of them (clone3, src/child/clone_into.c) */
  int sock_fd;                           /* the init's end of its socket */
  int go_fd;                             /* read end: the runtime writes one byte once the id maps are set */
  int report_fd;                         /* write end: one mb_nsinit_report, then closed */
  int defer_pivot;                       /* build the root but stay outside it until MB_NSINIT_FINISH */
  int drop_groups;                       /* setgroups(0, NULL) once the maps are written (setgroups allowed) */
  int zygote;       /* cloned from the zygote (src/zygote.c): the new root is entered by a move onto "/" and chroot, not
                 pivot_root */
  int trees_passed; /* the binds and device nodes come as MB_NSINIT_TREE messages, detached by the runtime: from the
                       zygote (which cannot see the host's paths), and wherever the init is born with an owner uid's
                       credentials (src/owner.c), which cannot search the runtime's private directories */
} mb_nsinit_plan;

enum mb_nsinit_stage {
  MB_NSINIT_READY = 0,
  MB_NSINIT_GO,
  MB_NSINIT_PDEATHSIG,
  MB_NSINIT_CGROUP,
  MB_NSINIT_HOSTNAME,
  MB_NSINIT_LOOPBACK,
  MB_NSINIT_MOUNT,
  MB_NSINIT_PIVOT,
  MB_NSINIT_SIGNALS,
  MB_NSINIT_IDS,
  MB_NSINIT_EXEC, /* exec of moonbox-init, its capabilities or its plan */
};

/* The plan as bytes (the memfd on MB_NSINIT_FD_PLAN): this header, then
 * NUL-terminated strings at the offsets (-1: none) from its start. */
#define MB_NSINIT_WIRE_MAGIC 0x6d62696eu /* "mbin" */
typedef struct {
  uint32_t magic, header_size;
  uint64_t size; /* the whole memfd */
  int32_t clone_flags, loopback, defer_pivot, drop_groups;
  int32_t first_cgroup_joined; /* written by the pre-exec child: born in the first cgroup */
  int32_t ncgroups;
  int64_t hostname_off;
  int32_t nmounts, zygote, trees_passed;
  struct {
    int32_t type, optional;
    int64_t src_off, dst_off, data_off;
    uint64_t data_len, size;
  } mounts[MB_NSINIT_MAX_MOUNTS];
} mb_nsinit_wire;

typedef struct {
  int32_t stage, err, index;
} mb_nsinit_report;

/* requests */
enum { MB_NSINIT_SPAWN = 1, MB_NSINIT_SOCKET = 2, MB_NSINIT_FINISH = 3, MB_NSINIT_HOLD = 4, MB_NSINIT_GIVE = 5 };
/* HOLD: keep the one fd passed (the runtime's lock on the sandbox root, so
 * that it costs the runtime no fd); GIVE: pass it back. */
typedef struct {
  int32_t type, arg1, arg2;
} mb_nsinit_request;
/* A pre-built init (defer_pivot) becomes a sandbox's: its hostname, one more
 * bind (the workspace: a detached tree passed as SCM_RIGHTS when the runtime
 * could make one, else src opened by the init), then it enters the root. */
typedef struct {
  int32_t type;
  char hostname[65];
  char src[4096];
  char dst[256];
} mb_nsinit_finish;

/* An init cloned from the zygote cannot see the host's paths, and one born
 * with an owner uid's credentials cannot search the runtime's private
 * directories (a 0700 home): for both (plan.trees_passed) the runtime
 * detaches the sources of its binds and its device nodes and sends them,
 * before "go", one per message with its fd (SCM_RIGHTS), so that it holds
 * one at a time: index names the mount, or the device node index -
 * MB_NSINIT_MAX_MOUNTS; a message with index -1 and no fd ends them. */
#define MB_NSINIT_TREE 0x54
typedef struct {
  int32_t kind, index;
} mb_nsinit_tree;

/* what the init sends, told apart by kind */
enum { MB_NSINIT_REPLY = 0x52, MB_NSINIT_EVENT = 0x45 };
typedef struct {
  int32_t kind, stage, err, pid;
} mb_nsinit_reply; /* pid inside; SCM_CREDENTIALS carry it outside */
typedef struct {
  int32_t kind, pid, status;
} mb_nsinit_event;

#endif
