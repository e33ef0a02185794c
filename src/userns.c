/* userns: whether this kernel lets the runtime make user namespaces.
 *
 * core.userns_probe() -> true | nil, message, CODE
 *   Clones a child into a new user namespace (CLONE_NEWUSER alone, nothing
 *   else asked of the kernel) that exits at once, and reaps it. The errno of
 *   a refused clone tells why: EPERM (forbidden by a sysctl such as
 *   kernel.unprivileged_userns_clone, an LSM or a seccomp filter), EINVAL (no
 *   user namespace support), ENOSPC (user.max_user_namespaces reached, or
 *   0), EUSERS (nested too deep), or a transient shortage (EAGAIN, ENOMEM).
 *   The Lua side (sandbox.lua) decides which of these are a refusal.
 *   Synchronous; the child does nothing but _exit.
 */
#include "private.h"

#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#define PROBE_STACK (64 * 1024)

static int probe_child(void *arg) {
  (void)arg;
  _exit(0);
}

static int userns_probe(lua_State *L) {
  char *stack = (char *)malloc(PROBE_STACK);
  if (!stack) return mb_push_errno(L, ENOMEM, "clone(CLONE_NEWUSER)");
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  pid_t pid = clone(probe_child, stack + PROBE_STACK, CLONE_NEWUSER | SIGCHLD, NULL);
  int err = errno;
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (pid > 0) {
    /* the runtime's SIGCHLD handler may reap it first: ECHILD is fine */
    while (waitpid(pid, NULL, __WALL) < 0 && errno == EINTR) {}
  }
  free(stack);
  if (pid < 0) return mb_push_errno(L, err, "clone(CLONE_NEWUSER)");
  lua_pushboolean(L, 1);
  return 1;
}

void mb_open_userns(lua_State *L) {
  lua_pushcfunction(L, userns_probe);
  lua_setfield(L, -2, "userns_probe");
}
