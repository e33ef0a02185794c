/* A detached copy of a mount tree (open_tree's OPEN_TREE_CLONE), with the
 * attributes a sandbox's bind gets: the sandbox init uses it for its binds,
 * the runtime for the binds of an init cloned from the zygote (whose mount
 * namespace cannot see the host's paths). */
#include "child.h"
#include "mount_api.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

int mb_detach_tree(int dirfd, const char *path, int at_flags, int readonly, int devices) {
  int fd = (int)syscall(SYS_open_tree, dirfd, path, OPEN_TREE_CLONE | O_CLOEXEC | AT_RECURSIVE | at_flags);
  if (fd < 0) return -1;
  struct mb_mount_attr attr = {
    MOUNT_ATTR_NOSUID | (devices ? 0 : MOUNT_ATTR_NODEV) | (readonly ? MOUNT_ATTR_RDONLY : 0), 0, 0, 0};
  if (syscall(SYS_mount_setattr, fd, "", AT_EMPTY_PATH | AT_RECURSIVE, &attr, sizeof attr) < 0) {
    int e = errno;
    close(fd);
    errno = e;
    return -1;
  }
  return fd;
}
