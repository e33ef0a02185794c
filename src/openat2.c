/* openat2(2) by syscall number, with its retries: see openat2.h. */
#include "openat2.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef SYS_openat2
#define SYS_openat2 437
#endif

/* a lookup raced by renames this often is being attacked: give up (EAGAIN) */
#define MAX_TRIES 16

const char *const mb_resolve_names[] = {"beneath", "in_root", NULL};

unsigned long long mb_resolve_bits(int which) {
  return (which == 0 ? RESOLVE_BENEATH : RESOLVE_IN_ROOT) | RESOLVE_NO_MAGICLINKS;
}

int mb_openat2(int dirfd, const char *path, unsigned long long flags, unsigned long long mode,
               unsigned long long resolve) {
  struct open_how how;
  memset(&how, 0, sizeof how);
  how.flags = flags;
  how.mode = (flags & O_CREAT) || (flags & O_TMPFILE) == O_TMPFILE ? mode : 0;
  how.resolve = resolve;
  long rc = -1;
  for (int tries = 0; tries < MAX_TRIES; tries++) {
    rc = syscall(SYS_openat2, dirfd, path, &how, sizeof how);
    if (rc >= 0 || (errno != EINTR && errno != EAGAIN)) break;
  }
  return (int)rc;
}
