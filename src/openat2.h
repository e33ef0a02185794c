/* openat2(2) (Linux >= 5.6), the one path resolution every confined open of
 * the core goes through (fs.c, fs_tree.c, image_unpack.c): the syscall
 * wrapper with its retries, and the resolve modes a Lua caller names. glibc
 * 2.36 has no wrapper for it, so it is called by number. */
#ifndef MOONBOX_OPENAT2_H
#define MOONBOX_OPENAT2_H

#include <linux/openat2.h>

#define MB_OPENAT2_ENOSYS_MSG "ENOSYS: openat2 not supported by this kernel (needs Linux 5.6)"

/* The resolve modes by name, index = which: "beneath" (any escape fails with
 * EXDEV), "in_root" ("/" and ".." clamped to the root, like chroot); NULL
 * ends the list (for luaL_checkoption). */
extern const char *const mb_resolve_names[];

/* RESOLVE_* for mb_resolve_names[which], always with RESOLVE_NO_MAGICLINKS. */
unsigned long long mb_resolve_bits(int which);

/* openat2 of path from dirfd with flags (O_*), mode (used only with O_CREAT
 * or O_TMPFILE) and resolve (RESOLVE_*), retried (a bounded number of
 * times) on EINTR and on the EAGAIN the kernel returns when a concurrent
 * rename or mount makes a confined lookup unsafe to complete. The fd, or -1
 * with errno. */
int mb_openat2(int dirfd, const char *path, unsigned long long flags, unsigned long long mode,
               unsigned long long resolve);

#endif
