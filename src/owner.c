/* Charging a sandbox's kernel counters to a host uid of its own.
 *
 * The kernel counts inotify instances and watches, namespaces and
 * processes per user, in the caller's user namespace and again for the
 * namespace's owner in every ancestor. A root runtime that made each
 * sandbox's user namespace (and each watch's inotify instance) as root had
 * every sandbox charged to host root: four sandboxes using their own cap of
 * 32 inotify instances took host root's whole 128, and with it every other
 * sandbox's watch(). So those objects are made while this thread's
 * effective uid is the sandbox's owner id (lua/moonbox/sandbox/isolation.lua
 * picks one per sandbox), then the thread is root again.
 *
 * Raw syscalls, not glibc's setresuid: glibc changes every thread of the
 * process; this changes the calling thread only, for a few syscalls, on
 * the loop's thread or the zygote's. The real and saved uids stay 0, so
 * root comes back with every capability. fsuid is put back to 0 at once:
 * what the thread opens meanwhile (the cgroup it clones into) is checked as
 * root, and only the effective uid decides who is charged. */
#include "private.h"

#include <errno.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

int mb_owner_enter(uid_t owner) {
  if (owner == 0) return 0;
  if (geteuid() != 0) {
    errno = EPERM;
    return -1;
  }
  if (syscall(SYS_setresuid, (uid_t)-1, owner, (uid_t)-1) < 0) return -1;
  syscall(SYS_setfsuid, 0); /* returns the old fsuid, never an error */
  if ((uid_t)syscall(SYS_setfsuid, (uid_t)-1) != 0) {
    mb_owner_leave(owner);
    errno = EPERM;
    return -1;
  }
  return 0;
}

void mb_owner_leave(uid_t owner) {
  if (owner == 0) return;
  /* with the saved uid 0 this cannot fail; if it did, the thread would go
   * on without root's privileges, which nothing after could recover from */
  if (syscall(SYS_setresuid, (uid_t)-1, 0, (uid_t)-1) < 0) abort();
}
