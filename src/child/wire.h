/* A child plan as bytes, so a process other than the runtime (the sandbox
 * init, which lives in the sandbox's namespaces) can carry it out.
 *
 * The runtime packs the plan into a memfd and sends it, with the fds the
 * plan refers to, over a unix socket (SCM_RIGHTS). The receiver maps the
 * memfd privately and turns offsets back into pointers in place: no
 * allocation on either side of the fork. */
#ifndef MOONBOX_CHILD_WIRE_H
#define MOONBOX_CHILD_WIRE_H

#include "child.h"

#include <stddef.h>
#include <sys/types.h>

/* fds that travel with a plan: the memfd, a cgroup (cgroup.procs and its directory), extra cgroups, stdio */
#define MB_WIRE_MAX_FDS (3 + MB_MAX_EXTRA_CGROUPS + MB_MAX_FDS)

/* Pack p into a new sealed memfd. fds[0] is the memfd; fds[1..] are the
 * runtime's fds the plan uses (not dup'ed: send them before closing). */
int mb_wire_pack(const mb_child_plan *p, int *fds, int *nfds);

/* Rebuild a plan from a mapped, writable copy of the memfd and the fds that
 * arrived with it (fds[0] is the memfd itself). Returns 0 or an errno. */
int mb_wire_unpack(void *map, size_t len, const int *fds, int nfds, mb_child_plan *p, struct sock_fprog *prog);

/* What came with a message besides its bytes (mb_wire_recv). */
typedef struct {
  int fds[MB_WIRE_MAX_FDS]; /* SCM_RIGHTS, close-on-exec; the caller owns them */
  int nfds;
  pid_t cred_pid; /* SCM_CREDENTIALS' pid (with SO_PASSCRED), or 0 */
  int flags;      /* the message's msg_flags: MSG_TRUNC, MSG_CTRUNC */
} mb_wire_in;

/* One message of at most len bytes into buf from the unix socket sock,
 * retried on EINTR, with its fds (any beyond MB_WIRE_MAX_FDS are closed,
 * and MSG_CTRUNC set) and sender's pid into *in. Returns the byte count
 * (0: EOF) or -1 with errno (EAGAIN on a non-blocking socket). */
ssize_t mb_wire_recv(int sock, void *buf, size_t len, mb_wire_in *in);

/* len bytes of buf with nfds fds attached (SCM_RIGHTS, nfds <= MB_WIRE_MAX_FDS,
 * 0 for none) on the unix socket sock, retried on EINTR, never raising
 * SIGPIPE; flags add to MSG_NOSIGNAL (MSG_DONTWAIT). The fds stay ours.
 * Returns the byte count or -1 with errno. */
ssize_t mb_wire_send(int sock, const void *buf, size_t len, const int *fds, int nfds, int flags);

#endif
