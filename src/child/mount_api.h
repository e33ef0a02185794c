/* The new mount API (Linux 5.2+, mount_setattr 5.12+), called by syscall
 * number: glibc 2.36's <sys/mount.h> and <linux/mount.h> clash, so the few
 * constants and mount_setattr's argument live here, once, for the init
 * (nsinit.c) and child/mount_tree.c. */
#ifndef MOONBOX_CHILD_MOUNT_API_H
#define MOONBOX_CHILD_MOUNT_API_H

#include <stdint.h>

#ifndef OPEN_TREE_CLONE
#define OPEN_TREE_CLONE 1
#endif
#ifndef AT_RECURSIVE
#define AT_RECURSIVE 0x8000
#endif
#ifndef MOVE_MOUNT_F_EMPTY_PATH
#define MOVE_MOUNT_F_EMPTY_PATH 0x00000004
#endif
#ifndef MOVE_MOUNT_T_EMPTY_PATH
#define MOVE_MOUNT_T_EMPTY_PATH 0x00000040
#endif
#ifndef MOUNT_ATTR_RDONLY
#define MOUNT_ATTR_RDONLY 0x00000001
#define MOUNT_ATTR_NOSUID 0x00000002
#define MOUNT_ATTR_NODEV 0x00000004
#endif
#ifndef MOUNT_ATTR_NOEXEC
#define MOUNT_ATTR_NOEXEC 0x00000008
#endif

/* struct mount_attr of <linux/mount.h> */
struct mb_mount_attr {
  uint64_t attr_set, attr_clr, propagation, userns_fd;
};

#endif
