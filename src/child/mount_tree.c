/* A detached copy of a mount tree (open_tree's OPEN_TREE_CLONE), with the
 * attributes a sandbox's bind gets: the sandbox init uses it for its binds,
 * the runtime for the binds of an init cloned from the zygote (whose mount
 * namespace cannot see the host's paths). */
#include "child.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef OPEN_TREE_CLONE
#define OPEN_TREE_CLONE 1
#endif
#ifndef AT_RECURSIVE
#define AT_RECURSIVE 0x8000
#endif
#define ATTR_RDONLY 0x00000001
#define ATTR_NOSUID 0x00000002
#define ATTR_NODEV 0x00000004

int mb_detach_tree(int dirfd, const char *path, int at_flags, int readonly, int devices) {
  int fd = (int)syscall(SYS_open_tree, dirfd, path, OPEN_TREE_CLONE | O_CLOEXEC | AT_RECURSIVE | at_flags);
  if (fd < 0) return -1;
  struct {
    uint64_t attr_set, attr_clr, propagation, userns_fd;
  } attr = {ATTR_NOSUID | (devices ? 0 : ATTR_NODEV) | (readonly ? ATTR_RDONLY : 0), 0, 0, 0};
  if (syscall(SYS_mount_setattr, fd, "", AT_EMPTY_PATH | AT_RECURSIVE, &attr, sizeof attr) < 0) {
    int e = errno;
    close(fd);
    errno = e;
    return -1;
  }
  return fd;
}
