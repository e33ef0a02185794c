/* The sandbox init, moonbox-init (see nsinit.h): a binary of its own,
 * exec'd by the runtime's clone in the sandbox's new namespaces. It links
 * only libc and src/child/ (to start the sandbox's processes); it never
 * allocates after start-up. Set-up failures go to the runtime as (stage,
 * errno, index). */
#include "nsinit.h"
#include "child/child.h"
#include "child/mount_api.h"
#include "child/wire.h"
#include "openat2.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <grp.h>
#include <sys/wait.h>
#include <unistd.h>
#include <linux/capability.h>

#define NDEV MB_NSINIT_NDEV
#define dev_nodes mb_nsinit_dev_nodes

static void report(const mb_nsinit_plan *p, int stage, int err, int index) {
  mb_nsinit_report r = {stage, err, index};
  ssize_t n;
  do n = write(p->report_fd, &r, sizeof r);
  while (n < 0 && errno == EINTR);
}

static void die(const mb_nsinit_plan *p, int stage, int index) {
  report(p, stage, errno, index);
  _exit(1);
}

/* ---- root filesystem ---------------------------------------------------- */

/* dst inside the new root (cwd) as a relative path: "/usr/bin" -> "usr/bin" */
static const char *rel(const char *dst) {
  while (*dst == '/') dst++;
  return *dst ? dst : ".";
}

static int mkdirs(const char *path, int last_too) {
  char buf[PATH_MAX];
  size_t n = strlen(path);
  if (n >= sizeof buf) {
    errno = ENAMETOOLONG;
    return -1;
  }
  memcpy(buf, path, n + 1);
  for (char *s = buf + 1; *s; s++) {
    if (*s != '/') continue;
    *s = 0;
    if (mkdir(buf, 0755) < 0 && errno != EEXIST) return -1;
    *s = '/';
  }
  if (last_too && mkdir(buf, 0755) < 0 && errno != EEXIST) return -1;
  return 0;
}

static int touch(const char *path) {
  int fd = open(path, O_CREAT | O_WRONLY | O_CLOEXEC, 0644);
  if (fd < 0) return errno == EEXIST ? 0 : -1;
  close(fd);
  return 0;
}

/* The host's /tmp as it was before the new root was mounted over it, for a
 * deferred bind whose source lies under /tmp. */
static int old_tmp_fd = -1;

static int detach(const char *src, int readonly, int devices) {
  int dirfd = AT_FDCWD, at_flags = 0;
  if (old_tmp_fd >= 0 && strncmp(src, "/tmp", 4) == 0 && (src[4] == '/' || src[4] == 0)) {
    dirfd = old_tmp_fd;
    src += 4;
    while (*src == '/') src++;
    if (!*src) at_flags = AT_EMPTY_PATH;
  }
  return mb_detach_tree(dirfd, src, at_flags, readonly, devices);
}

/* Attach a detached tree at dst, creating a directory or an empty file to
 * mount on, whichever the source is. */
static int attach(int fd, const char *dst) {
  struct stat st;
  if (fstat(fd, &st) < 0) return -1;
  if (S_ISDIR(st.st_mode) ? mkdirs(dst, 1) : (mkdirs(dst, 0) || touch(dst))) return -1;
  return (int)syscall(SYS_move_mount, fd, "", AT_FDCWD, dst, MOVE_MOUNT_F_EMPTY_PATH);
}

/* A sized tmpfs also gets an inode cap, one per 8 KiB of its size (at least
 * 1024): empty files cost no bytes of size= but host kernel memory each
 * (400,000 of them took 500 MB of slab), and tmpfs's own default is half
 * the host's RAM pages. */
static int mount_tmpfs(const char *dst, uint64_t size, int sticky) {
  char opts[96];
  uint64_t inodes = size / 8192 < 1024 ? 1024 : size / 8192;
  if (size)
    snprintf(opts, sizeof opts, "mode=%s,size=%llu,nr_inodes=%llu", sticky ? "1777" : "0755", (unsigned long long)size,
             (unsigned long long)inodes);
  else snprintf(opts, sizeof opts, "mode=%s", sticky ? "1777" : "0755");
  if (mkdirs(dst, 1) < 0) return -1;
  return mount("tmpfs", dst, "tmpfs", MS_NOSUID | MS_NODEV, opts);
}

static int write_file(const char *dst, const char *data, size_t len) {
  if (mkdirs(dst, 0) < 0) return -1;
  int fd = open(dst, O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0644);
  if (fd < 0) return -1;
  while (len > 0) {
    ssize_t n = write(fd, data, len);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      close(fd);
      return -1;
    }
    data += n;
    len -= (size_t)n;
  }
  return close(fd);
}

/* A minimal, read-only /dev: a few host device nodes bound in, a private
 * devpts with its own ptmx, a tmpfs /dev/shm (of shm_size bytes), and the
 * usual symlinks. */
/* (trees_passed) The runtime's device nodes, of its own detached trees, which we
 * may attach but not copy: attached once on a small tmpfs of their own
 * under the new root (detached again once the root is built: the binds
 * keep them), and bound from there into every devfs (a policy may ask for
 * more than one, and one over another). */
#define DEV_DIR ".mb-dev"
static int dev_dir_ready;

static int stage_dev_nodes(const int *devfds) {
  char path[64];
  if (mkdirs(DEV_DIR, 1) < 0 || mount("tmpfs", DEV_DIR, "tmpfs", MS_NOSUID | MS_NOEXEC, "size=4096,mode=0700") < 0)
    return -1;
  dev_dir_ready = 1;
  for (size_t i = 0; i < NDEV; i++) {
    snprintf(path, sizeof path, DEV_DIR "/%s", dev_nodes[i]);
    if (devfds[i] >= 0 && attach(devfds[i], path) < 0) return -1;
  }
  return 0;
}

static int make_dev(const char *dst, const int *devfds, uint64_t shm_size, int staged_nodes) {
  char path[PATH_MAX];
  if (mkdirs(dst, 1) < 0 || mount("tmpfs", dst, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=65536") < 0) return -1;
  for (size_t i = 0; i < NDEV; i++) {
    if (devfds[i] < 0) continue;
    snprintf(path, sizeof path, "%s/%s", dst, dev_nodes[i]);
    if (staged_nodes) {
      char staged[64];
      snprintf(staged, sizeof staged, DEV_DIR "/%s", dev_nodes[i]);
      if ((!dev_dir_ready && stage_dev_nodes(devfds) < 0) || touch(path) < 0 ||
          mount(staged, path, NULL, MS_BIND, NULL) < 0)
        return -1;
      continue;
    }
    /* a copy of the detached node: attaching the node itself would move it
     * here from a devfs made before (a policy may ask for more than one) */
    int copy = (int)syscall(SYS_open_tree, devfds[i], "", OPEN_TREE_CLONE | O_CLOEXEC | AT_EMPTY_PATH);
    if (copy < 0) return -1;
    int rc = attach(copy, path);
    int e = errno;
    close(copy);
    errno = e;
    if (rc < 0) return -1;
  }
  snprintf(path, sizeof path, "%s/pts", dst);
  if (mkdirs(path, 1) < 0 ||
      mount("devpts", path, "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620") < 0)
    return -1;
  snprintf(path, sizeof path, "%s/shm", dst);
  if (mount_tmpfs(path, shm_size, 1) < 0) return -1;
  static const char *const links[][2] = {{"pts/ptmx", "ptmx"},
                                         {"/proc/self/fd", "fd"},
                                         {"/proc/self/fd/0", "stdin"},
                                         {"/proc/self/fd/1", "stdout"},
                                         {"/proc/self/fd/2", "stderr"}};
  for (size_t i = 0; i < sizeof links / sizeof links[0]; i++) {
    snprintf(path, sizeof path, "%s/%s", dst, links[i][1]);
    if (symlink(links[i][0], path) < 0) return -1;
  }
  /* Read-only from here (pts and shm are mounts of their own): the runtime
   * opens /dev/ptmx from outside, which must stay the devpts one, never a
   * symlink someone inside put there to a host device. */
  return mount(NULL, dst, NULL, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NOEXEC, NULL);
}

/* An empty read-only file to bind over masked files: on a small tmpfs of
 * its own under the new root, detached again once the root is built (the
 * binds keep the file). */
#define MASK_DIR ".mb-mask"
static int mask_dir_ready;

static int mask_path(const char *dst) {
  struct stat st;
  if (lstat(dst, &st) < 0) return -1;
  if (S_ISDIR(st.st_mode))
    return mount("tmpfs", dst, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4096,mode=0555");
  if (!mask_dir_ready) {
    if (mkdirs(MASK_DIR, 1) < 0 ||
        mount("tmpfs", MASK_DIR, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4096,mode=0700") < 0)
      return -1;
    mask_dir_ready = 1;
    int fd = open(MASK_DIR "/empty", O_CREAT | O_WRONLY | O_CLOEXEC, 0444);
    if (fd < 0) return -1;
    close(fd);
  }
  if (mount(MASK_DIR "/empty", dst, NULL, MS_BIND, NULL) < 0) return -1;
  return mount(NULL, dst, NULL, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
}

/* dst (and every mount below it) bound over itself read-only */
static int readonly_path(const char *dst) {
  if (mount(dst, dst, NULL, MS_BIND | MS_REC, NULL) < 0) return -1;
  struct mb_mount_attr attr = {MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC, 0, 0, 0};
  return (int)syscall(SYS_mount_setattr, AT_FDCWD, dst, AT_RECURSIVE, &attr, sizeof attr);
}

/* An image's root (sandbox/isolation.lua): an overlayfs over the root
 * built so far (a tmpfs at /tmp, our cwd), whose lower and upper dirs were
 * bound into that tmpfs by the entries before this one; the options name
 * them relative to it. We then stand in the overlay: what follows is made
 * in it (in its upper dir), and the bound layers stay under it, out of
 * every path. Mounted in the sandbox's user namespace, so with userxattr
 * (user.overlay.* xattrs, Linux 5.11+); nosuid and nodev as every root. */
static int image_root; /* the root is an image's overlay: its paths are the tenant's */

static int mount_overlay_root(const char *opts) {
  if (mount("overlay", "/tmp", "overlay", MS_NOSUID | MS_NODEV, opts) < 0) return -1;
  image_root = 1;
  return chdir("/tmp");
}

/* Whether dst (relative to the root under construction) passes through
 * or is a symlink, as far as it exists. In an image root, the image and
 * the sandbox's upper dir (what its processes left) decide what is there,
 * and every step here resolves paths against the host's root: a symlink
 * at /etc/hostname or /workspace would point a write or a mount at the
 * host. Nothing of the sandbox runs while its init builds the root, so the
 * check holds until the entry is made. */
static int has_symlink(const char *dst) {
  char buf[PATH_MAX];
  size_t n = strlen(dst);
  if (n >= sizeof buf) return errno = ENAMETOOLONG, -1;
  memcpy(buf, dst, n + 1);
  for (;;) {
    int fd = mb_openat2(AT_FDCWD, buf, O_PATH | O_NOFOLLOW | O_CLOEXEC, 0,
                        RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS);
    if (fd >= 0) {
      struct stat st;
      int link = fstat(fd, &st) == 0 && S_ISLNK(st.st_mode);
      close(fd);
      return link;
    }
    if (errno == ELOOP || errno == EXDEV) return 1;
    if (errno != ENOENT) return -1;
    char *slash = strrchr(buf, '/');
    if (!slash) return 0; /* nothing of it exists yet: made here, no link */
    *slash = 0;
  }
}

/* Write data into an existing file (no create, no truncate needed: sysctls) */
static int write_existing(const char *dst, const char *data, size_t len) {
  int fd = open(dst, O_WRONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return -1;
  ssize_t n;
  do n = write(fd, data, len);
  while (n < 0 && errno == EINTR);
  int e = n == (ssize_t)len ? 0 : (n < 0 ? errno : EIO);
  close(fd);
  errno = e;
  return e ? -1 : 0;
}

static int srcfd[MB_NSINIT_MAX_MOUNTS];
static int devfd[NDEV];
static int pre_err, pre_index = -1; /* the first failure of detach_sources, reported after "go" */

/* plan.trees_passed: the runtime's detached trees (MB_NSINIT_TREE) into
 * srcfd and devfd. */
static int receive_trees(int sock_fd, int nmounts) {
  for (;;) {
    mb_nsinit_tree t;
    mb_wire_in in;
    ssize_t n = mb_wire_recv(sock_fd, &t, sizeof t, &in);
    if (n < 0) return -1;
    int fd = in.nfds == 1 ? in.fds[0] : -1;
    errno = EPROTO;
    if (n != (ssize_t)sizeof t || t.kind != MB_NSINIT_TREE || in.nfds > 1 || (in.flags & MSG_CTRUNC)) {
      for (int i = 0; i < in.nfds; i++) close(in.fds[i]);
      return -1;
    }
    if (t.index == -1 && fd < 0) return 0;
    int i = t.index, d = i - MB_NSINIT_MAX_MOUNTS;
    if (fd >= 0 && i >= 0 && i < nmounts && srcfd[i] < 0) srcfd[i] = fd;
    else if (fd >= 0 && d >= 0 && d < (int)NDEV && devfd[d] < 0) devfd[d] = fd;
    else {
      if (fd >= 0) close(fd);
      return -1;
    }
  }
}

/* Before the id maps are written (our credentials are still the runtime's,
 * so the runtime's path permissions apply, unless the runtime passes the
 * trees: plan.trees_passed): detach every bind source, since
 * mounting the new root may hide them and the sandbox's ids may not reach
 * them. A failure is kept for report() once the runtime listens. */
static void detach_sources(const mb_nsinit_plan *p) {
  int need_dev = 0;
  for (int i = 0; i < p->nmounts; i++) srcfd[i] = -1;
  for (size_t i = 0; i < NDEV; i++) devfd[i] = -1;
  if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) {
    pre_err = errno;
    return;
  }
  if (p->trees_passed) {
    if (receive_trees(p->sock_fd, p->nmounts) < 0) pre_err = errno;
    return;
  }
  for (int i = 0; i < p->nmounts; i++) {
    const mb_mount *m = &p->mounts[i];
    if (m->type == MB_MOUNT_DEV) need_dev = 1;
    if (m->type != MB_MOUNT_BIND && m->type != MB_MOUNT_RO_BIND) continue;
    srcfd[i] = detach(m->src, m->type == MB_MOUNT_RO_BIND, 0);
    if (srcfd[i] < 0 && !(m->optional && errno == ENOENT)) {
      pre_err = errno;
      pre_index = i;
      return;
    }
  }
  for (size_t i = 0; i < NDEV; i++) {
    char path[32];
    snprintf(path, sizeof path, "/dev/%s", dev_nodes[i]);
    devfd[i] = need_dev ? detach(path, 0, 1) : -1;
  }
  if (p->defer_pivot) old_tmp_fd = open("/tmp", O_PATH | O_DIRECTORY | O_CLOEXEC);
}

/* (zygote) Our namespace still holds, under the new root, the zygote's
 * proc (of a pid namespace with no process left), which let us mount our
 * own: the kernel lets a user namespace mount proc only where one is fully
 * visible (mount_too_revealing), and it counts mounts no path reaches. Once
 * ours are made, an empty tmpfs over it makes it not fully visible to any
 * namespace made below ours (where that mount is locked), so that a
 * tenant's nested user and mount namespace can no more mount a proc without
 * our masks than under pivot_root, and hides it from a tenant that unmounts
 * its root. Our cwd is the new root, still at /tmp of the namespace, whose
 * /proc that proc is. */
static int cover_zygote_proc(void) {
  return mount("tmpfs", "/proc", "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4096,mode=0555");
}

static void setup_root(const mb_nsinit_plan *p) {
  if (pre_err) {
    errno = pre_err;
    die(p, MB_NSINIT_MOUNT, pre_index);
  }
  /* The new root is a small tmpfs over /tmp of this (private) mount tree. */
  if (mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1048576") < 0 || chdir("/tmp") < 0)
    die(p, MB_NSINIT_MOUNT, -1);
  for (int i = 0; i < p->nmounts; i++) {
    const mb_mount *m = &p->mounts[i];
    const char *dst = rel(m->dst);
    int rc = 0;
    if (image_root) {
      int s = has_symlink(dst);
      if (s != 0) {
        if (s > 0) errno = ELOOP;
        die(p, MB_NSINIT_MOUNT, i);
      }
    }
    switch (m->type) {
    case MB_MOUNT_BIND:
    case MB_MOUNT_RO_BIND:
      if (srcfd[i] >= 0) {
        rc = attach(srcfd[i], dst);
        close(srcfd[i]);
      }
      break;
    case MB_MOUNT_TMPFS: {
      size_t n = strlen(dst);
      int sticky = strcmp(dst, "tmp") == 0 || (n >= 3 && strcmp(dst + n - 3, "shm") == 0);
      rc = mount_tmpfs(dst, m->size, sticky);
      break;
    }
    case MB_MOUNT_PROC:
      rc = mkdirs(dst, 1) < 0 ? -1 : mount("proc", dst, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
      break;
    case MB_MOUNT_DEV: rc = make_dev(dst, devfd, m->size, p->trees_passed); break;
    case MB_MOUNT_SYMLINK: rc = mkdirs(dst, 0) < 0 ? -1 : symlink(m->src, dst); break;
    case MB_MOUNT_FILE: rc = write_file(dst, m->data, m->data_len); break;
    case MB_MOUNT_DIR: rc = mkdirs(dst, 1); break;
    case MB_MOUNT_READONLY: rc = readonly_path(dst); break;
    case MB_MOUNT_MASK: rc = mask_path(dst); break;
    case MB_MOUNT_SYSCTL: rc = write_existing(dst, m->data, m->data_len); break;
    case MB_MOUNT_OVERLAY: rc = mount_overlay_root(m->data); break;
    default: errno = EINVAL; rc = -1;
    }
    if (rc < 0 && m->optional && errno == ENOENT &&
        (m->type == MB_MOUNT_READONLY || m->type == MB_MOUNT_MASK || m->type == MB_MOUNT_SYSCTL))
      rc = 0;
    if (rc < 0) die(p, MB_NSINIT_MOUNT, i);
  }
  for (size_t i = 0; i < NDEV; i++)
    if (devfd[i] >= 0) close(devfd[i]);
  if (mask_dir_ready && (umount2(MASK_DIR, MNT_DETACH) < 0 || rmdir(MASK_DIR) < 0)) die(p, MB_NSINIT_MOUNT, -1);
  if (dev_dir_ready && (umount2(DEV_DIR, MNT_DETACH) < 0 || rmdir(DEV_DIR) < 0)) die(p, MB_NSINIT_MOUNT, -1);
  if (p->zygote && cover_zygote_proc() < 0) die(p, MB_NSINIT_MOUNT, -1);
}

static int zroot_fd = -1; /* (zygote) the namespace's empty root, which the new root goes over */

/* (zygote) Into the new root (our cwd) at once, while it is still a mount
 * at /tmp of the namespace: what a spare starts before its finish lives in
 * it too, as pivot_root would have moved it there. */
static int chroot_built(void) {
  zroot_fd = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
  return zroot_fd < 0 ? -1 : chroot(".");
}

/* From the new root's directory (our cwd), into it; the root becomes
 * read-only. Cloned from the zygote, the namespace's root is an empty tmpfs
 * (src/zygote.c): the new root, our root already, moves over it. Else the
 * namespace is a copy of the host's, whose root must go: pivot_root(".",
 * "."), the old root ends up on top, then goes away (pivot_root walks every
 * task on the host, which the zygote spares). Only the init runs yet. */
static int pivot_into_root(const mb_nsinit_plan *p) {
  if (p->zygote) {
    if (syscall(SYS_move_mount, AT_FDCWD, ".", zroot_fd, "", MOVE_MOUNT_T_EMPTY_PATH) < 0 || chdir("/") < 0) return -1;
    close(zroot_fd);
    zroot_fd = -1;
  } else {
    if (syscall(SYS_pivot_root, ".", ".") < 0) return -1;
    if (umount2(".", MNT_DETACH) < 0 || chdir("/") < 0) return -1;
  }
  /* an image's root stays writable: writes land in the sandbox's upper dir */
  return mount(NULL, "/", NULL, MS_REMOUNT | MS_BIND | (image_root ? 0 : MS_RDONLY) | MS_NOSUID | MS_NODEV, NULL);
}

static int loopback_up(void) {
  int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (s < 0) return -1;
  struct ifreq ifr;
  memset(&ifr, 0, sizeof ifr);
  strcpy(ifr.ifr_name, "lo");
  int rc = ioctl(s, SIOCGIFFLAGS, &ifr);
  if (rc == 0) {
    ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
    rc = ioctl(s, SIOCSIFFLAGS, &ifr);
  }
  int e = errno;
  close(s);
  errno = e;
  return rc;
}

/* ---- serving ------------------------------------------------------------ */

#define MAX_PID (1 << 22)
static unsigned char tracked[MAX_PID / 8]; /* pids we started: their exits are reported */
#define EVENT_QUEUE 4096
static mb_nsinit_event queue[EVENT_QUEUE];
static int queue_head, queue_len;
static char child_stack[64 * 1024] __attribute__((aligned(16)));

static void track(pid_t pid, int on) {
  if (pid <= 0 || pid >= MAX_PID) return;
  if (on) tracked[pid / 8] |= (unsigned char)(1u << (pid % 8));
  else tracked[pid / 8] &= (unsigned char)~(1u << (pid % 8));
}
static int is_tracked(pid_t pid) { return pid > 0 && pid < MAX_PID && (tracked[pid / 8] & (1u << (pid % 8))); }

static void reap(void) {
  int status;
  pid_t pid;
  while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
    if (!is_tracked(pid)) continue; /* an orphan of the sandbox: just reaped */
    track(pid, 0);
    if (queue_len == EVENT_QUEUE) continue; /* cannot happen: at most as many as we started */
    queue[(queue_head + queue_len++) % EVENT_QUEUE] = (mb_nsinit_event){MB_NSINIT_EVENT, pid, status};
  }
}

static void flush_events(int sock_fd) {
  while (queue_len > 0) {
    ssize_t n = send(sock_fd, &queue[queue_head], sizeof queue[0], MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n < 0) _exit(0); /* the runtime is gone */
    queue_head = (queue_head + 1) % EVENT_QUEUE;
    queue_len--;
  }
}

static void reply(int sock_fd, mb_nsinit_reply r, pid_t cred_pid, int pass_fd) {
  union {
    char buf[CMSG_SPACE(sizeof(struct ucred)) + CMSG_SPACE(sizeof(int))];
    struct cmsghdr align;
  } u;
  r.kind = MB_NSINIT_REPLY;
  struct iovec iov = {&r, sizeof r};
  struct msghdr msg;
  memset(&msg, 0, sizeof msg);
  memset(&u, 0, sizeof u);
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = u.buf;
  size_t clen = 0;
  struct cmsghdr *c = (struct cmsghdr *)u.buf;
  if (cred_pid > 0) {
    /* the kernel translates this pid into the runtime's pid namespace */
    struct ucred cred = {cred_pid, getuid(), getgid()};
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_CREDENTIALS;
    c->cmsg_len = CMSG_LEN(sizeof cred);
    memcpy(CMSG_DATA(c), &cred, sizeof cred);
    clen += CMSG_SPACE(sizeof cred);
    c = (struct cmsghdr *)(u.buf + clen);
  }
  if (pass_fd >= 0) {
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &pass_fd, sizeof(int));
    clen += CMSG_SPACE(sizeof(int));
  }
  msg.msg_controllen = clen;
  if (!clen) msg.msg_control = NULL;
  ssize_t n;
  do n = sendmsg(sock_fd, &msg, MSG_NOSIGNAL);
  while (n < 0 && errno == EINTR);
  if (n < 0) _exit(0);
}

static void do_spawn(int sock_fd, const int *fds, int nfds) {
  mb_nsinit_reply r = {0, 0, 0, 0};
  struct stat st;
  void *map = MAP_FAILED;
  mb_child_plan plan;
  struct sock_fprog prog;
  int report[2] = {-1, -1};
  pid_t pid = -1;
  if (nfds < 1 || fstat(fds[0], &st) < 0 || st.st_size <= 0) {
    r.stage = MB_STAGE_NONE;
    r.err = EINVAL;
    goto out;
  }
  map = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fds[0], 0);
  if (map == MAP_FAILED) {
    r.err = errno;
    goto out;
  }
  if ((r.err = mb_wire_unpack(map, (size_t)st.st_size, fds, nfds, &plan, &prog)) != 0) goto out;
  if (pipe2(report, O_CLOEXEC) < 0) {
    r.err = errno;
    goto out;
  }
  plan.report_fd = report[1];
  plan.parent_pid = getpid();
  /* born in its cgroup where the kernel can (src/child/clone_into.c) */
  plan.cgroup_joined = plan.cgroup_dir_fd >= 0;
  pid = plan.cgroup_joined ? mb_clone_into_cgroup(mb_child_main, &plan, child_stack, sizeof child_stack,
                                                  CLONE_VM | CLONE_VFORK, plan.cgroup_dir_fd)
                           : -1;
  if (pid < 0) {
    plan.cgroup_joined = 0;
    pid = clone(mb_child_main, child_stack + sizeof child_stack, CLONE_VM | CLONE_VFORK | SIGCHLD, &plan);
  }
  if (pid < 0) {
    r.err = errno;
    goto out;
  }
  close(report[1]);
  report[1] = -1;
  mb_child_report cr;
  ssize_t n;
  do n = read(report[0], &cr, sizeof cr);
  while (n < 0 && errno == EINTR);
  if (n == (ssize_t)sizeof cr) {
    int status;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
    r.stage = cr.stage;
    r.err = cr.err;
    pid = -1;
  } else {
    track(pid, 1);
    r.pid = pid;
  }
out:
  if (r.err && !r.stage) r.stage = MB_STAGE_NONE;
  if (report[0] >= 0) close(report[0]);
  if (report[1] >= 0) close(report[1]);
  if (map != MAP_FAILED) munmap(map, (size_t)st.st_size);
  for (int i = 0; i < nfds; i++) close(fds[i]);
  reply(sock_fd, r, r.err ? 0 : pid, -1);
}

static int pivoted;
static mb_nsinit_plan plan; /* read once at start (read_plan) */

static void do_finish(int sock_fd, const mb_nsinit_finish *f, int passed) {
  mb_nsinit_reply r = {0, 0, 0, 0};
  char hostname[66], line[80];
  memcpy(hostname, f->hostname, sizeof f->hostname);
  hostname[sizeof f->hostname] = 0;
  if (pivoted || !memchr(f->src, 0, sizeof f->src) || !memchr(f->dst, 0, sizeof f->dst) || f->dst[0] != '/') {
    r.stage = MB_NSINIT_MOUNT;
    r.err = EINVAL;
  } else if (hostname[0] && sethostname(hostname, strlen(hostname)) < 0) {
    r.stage = MB_NSINIT_HOSTNAME;
    r.err = errno;
  } else {
    int n = snprintf(line, sizeof line, "%s\n", hostname);
    /* a tree the runtime detached (our ids may not reach src), else src;
     * never src from the zygote's namespace: we are in the new root there,
     * where a path names what is inside */
    int fd = passed >= 0 ? passed : (f->src[0] && !plan.zygote ? detach(f->src, 0, 0) : -1);
    if (fd < 0 && plan.zygote) errno = EPERM;
    passed = -1;
    if ((f->src[0] && (fd < 0 || attach(fd, rel(f->dst)) < 0)) ||
        (hostname[0] && write_file("etc/hostname", line, (size_t)n) < 0)) {
      r.stage = MB_NSINIT_MOUNT;
      r.err = errno;
    } else if (pivot_into_root(&plan) < 0) {
      r.stage = MB_NSINIT_PIVOT;
      r.err = errno;
    } else {
      pivoted = 1;
    }
    if (fd >= 0) close(fd);
  }
  if (passed >= 0) close(passed);
  reply(sock_fd, r, 0, -1);
}

static void do_socket(int sock_fd, int domain, int type) {
  mb_nsinit_reply r = {0, 0, 0, 0};
  int fd = socket(domain, type | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    r.stage = 1;
    r.err = errno;
  }
  reply(sock_fd, r, 0, fd);
  if (fd >= 0) close(fd);
}

static int held_fd = -1; /* MB_NSINIT_HOLD's: the runtime's lock on the sandbox root */

static void handle_request(int sock_fd) {
  static union {
    mb_nsinit_request req;
    mb_nsinit_finish finish;
  } in;
  mb_nsinit_request req;
  mb_wire_in got;
  ssize_t n = mb_wire_recv(sock_fd, &in, sizeof in, &got);
  if (n <= 0) _exit(0); /* the runtime closed the sandbox (or died) */
  memcpy(&req, &in.req, sizeof req);
  int *fds = got.fds, nfds = got.nfds;
  if (n == (ssize_t)sizeof req && req.type == MB_NSINIT_SPAWN) {
    do_spawn(sock_fd, fds, nfds);
    return;
  }
  if (n == (ssize_t)sizeof in.finish && req.type == MB_NSINIT_FINISH) {
    for (int i = 1; i < nfds; i++) close(fds[i]);
    do_finish(sock_fd, &in.finish, nfds > 0 ? fds[0] : -1);
    return;
  }
  if (n == (ssize_t)sizeof req && req.type == MB_NSINIT_HOLD && nfds == 1) {
    if (held_fd >= 0) close(held_fd);
    held_fd = fds[0]; /* close-on-exec (MSG_CMSG_CLOEXEC): nothing we start gets it */
    reply(sock_fd, (mb_nsinit_reply){0, 0, 0, 0}, 0, -1);
    return;
  }
  for (int i = 0; i < nfds; i++) close(fds[i]);
  if (n == (ssize_t)sizeof req && req.type == MB_NSINIT_SOCKET) {
    do_socket(sock_fd, req.arg1, req.arg2);
    return;
  }
  if (n == (ssize_t)sizeof req && req.type == MB_NSINIT_GIVE) {
    int err = held_fd < 0 ? ENOENT : 0;
    reply(sock_fd, (mb_nsinit_reply){0, err ? MB_STAGE_NONE : 0, err, 0}, 0, held_fd);
    if (held_fd >= 0) close(held_fd);
    held_fd = -1;
    return;
  }
  reply(sock_fd, (mb_nsinit_reply){0, MB_STAGE_NONE, EINVAL, 0}, 0, -1);
}

/* Requests are answered in order; exits are sent between them, as the
 * socket takes them (a runtime busy elsewhere makes them wait here). EOF,
 * the runtime's shutdown of its end or its death, ends us. */
static void serve(int sock_fd, int sig_fd) {
  for (;;) {
    struct pollfd pf[2] = {{sock_fd, (short)(POLLIN | (queue_len ? POLLOUT : 0)), 0}, {sig_fd, POLLIN, 0}};
    if (poll(pf, 2, -1) < 0) {
      if (errno == EINTR) continue;
      _exit(1);
    }
    if (pf[1].revents & POLLIN) {
      struct signalfd_siginfo si;
      while (read(sig_fd, &si, sizeof si) == (ssize_t)sizeof si) {}
      reap();
    }
    if (pf[0].revents & (POLLIN | POLLHUP | POLLERR)) handle_request(sock_fd);
    flush_events(sock_fd);
  }
}

/* The pre-exec child (nsinit_host.c) raised every capability it holds in
 * the new user namespace into the ambient set, so that they survive the
 * exec of this binary by a user the namespace does not map yet. Drop the
 * ambient and inheritable sets again, at once: what this init starts must
 * not inherit them through its own execs (a child that drops a capability
 * from its bounding set would get it back from the ambient set). We keep
 * the permitted and effective sets: those a clone into a new user
 * namespace gets. */
static int drop_exec_caps(void) {
  if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0) return -1;
  struct __user_cap_header_struct hdr = {_LINUX_CAPABILITY_VERSION_3, 0};
  struct __user_cap_data_struct data[2];
  if (syscall(SYS_capget, &hdr, data) < 0) return -1;
  data[0].inheritable = data[1].inheritable = 0;
  return (int)syscall(SYS_capset, &hdr, data);
}

static int wire_string(const char *base, uint64_t size, int64_t off, const char **out) {
  if (off == -1) {
    *out = NULL;
    return 0;
  }
  if (off < (int64_t)sizeof(mb_nsinit_wire) || (uint64_t)off >= size || !memchr(base + off, 0, size - (uint64_t)off))
    return -1;
  *out = base + off;
  return 0;
}

/* The plan from the memfd on MB_NSINIT_FD_PLAN: every offset checked, the
 * strings used in place in a private mapping (kept for our lifetime). */
static int read_plan(mb_nsinit_plan *p) {
  struct stat st;
  memset(p, 0, sizeof *p);
  p->sock_fd = MB_NSINIT_FD_SOCK;
  p->go_fd = MB_NSINIT_FD_GO;
  p->report_fd = MB_NSINIT_FD_REPORT;
  for (int i = 0; i < MB_NSINIT_MAX_CGROUPS; i++) p->cgroup_fds[i] = -1;
  if (fstat(MB_NSINIT_FD_PLAN, &st) < 0) return -1;
  if (st.st_size < (off_t)sizeof(mb_nsinit_wire)) {
    errno = EINVAL;
    return -1;
  }
  char *base = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, MB_NSINIT_FD_PLAN, 0);
  if (base == MAP_FAILED) return -1;
  close(MB_NSINIT_FD_PLAN);
  const mb_nsinit_wire *w = (const mb_nsinit_wire *)base;
  uint64_t size = (uint64_t)st.st_size;
  errno = EINVAL;
  if (w->magic != MB_NSINIT_WIRE_MAGIC || w->header_size != sizeof *w || w->size != size || w->nmounts < 0 ||
      w->nmounts > MB_NSINIT_MAX_MOUNTS || w->ncgroups < 0 || w->ncgroups > MB_NSINIT_MAX_CGROUPS)
    return -1;
  p->clone_flags = w->clone_flags;
  p->loopback = w->loopback;
  p->defer_pivot = w->defer_pivot;
  p->drop_groups = w->drop_groups;
  p->zygote = w->zygote;
  p->trees_passed = w->trees_passed;
  p->first_cgroup_joined = w->first_cgroup_joined;
  for (int i = 0; i < w->ncgroups; i++) p->cgroup_fds[i] = MB_NSINIT_FD_CGROUP + i;
  if (wire_string(base, size, w->hostname_off, &p->hostname) < 0) return -1;
  for (int i = 0; i < w->nmounts; i++) {
    mb_mount *m = &p->mounts[i];
    m->type = w->mounts[i].type;
    m->optional = w->mounts[i].optional;
    m->size = w->mounts[i].size;
    if (m->type < MB_MOUNT_BIND || m->type > MB_MOUNT_OVERLAY ||
        wire_string(base, size, w->mounts[i].src_off, &m->src) < 0 ||
        wire_string(base, size, w->mounts[i].dst_off, &m->dst) < 0 || !m->dst ||
        wire_string(base, size, w->mounts[i].data_off, &m->data) < 0)
      return -1;
    m->data_len = w->mounts[i].data_len;
    if (!m->data) {
      m->data = "";
      m->data_len = 0;
    }
    if (m->data_len >= size - (uint64_t)(m->data - base)) return -1; /* NUL-terminated after data_len bytes */
  }
  p->nmounts = w->nmounts;
  /* the fds this plan names: close-on-exec for whatever we exec */
  for (int fd = MB_NSINIT_FD_SOCK; fd < MB_NSINIT_FD_CGROUP + w->ncgroups; fd++)
    if (fcntl(fd, F_SETFD, FD_CLOEXEC) < 0) return -1;
  errno = 0;
  return 0;
}

/* moonbox-init: started only by the runtime (nsinit_host.c), in its new
 * namespaces, with the fds of nsinit.h and an empty environment. */
int main(int argc, char **argv) {
  (void)argc;
  (void)argv;
  mb_nsinit_plan *p = &plan;
  p->report_fd = MB_NSINIT_FD_REPORT; /* for die() until the plan is read */
  if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0) die(p, MB_NSINIT_PDEATHSIG, -1);
  if (drop_exec_caps() < 0) die(p, MB_NSINIT_EXEC, -1);
  prctl(PR_SET_NAME, "moonbox-init", 0, 0, 0);
  if (read_plan(p) < 0) die(p, MB_NSINIT_EXEC, -1);
  detach_sources(p);
  char go;
  if (read(p->go_fd, &go, 1) != 1) _exit(1); /* the runtime gave up (or died) */
  close(p->go_fd);
  for (int i = 0; i < MB_NSINIT_MAX_CGROUPS && p->cgroup_fds[i] >= 0; i++) {
    if ((i > 0 || !p->first_cgroup_joined) && write(p->cgroup_fds[i], "0", 1) != 1) die(p, MB_NSINIT_CGROUP, i);
    close(p->cgroup_fds[i]);
  }
  /* Become root of the namespace: until now our ids were the runtime's
   * (unmapped when the maps give root inside a range of its own), and the
   * runtime's supplementary groups go too. Every child inherits this. A
   * change of ids clears the parent-death signal: set it again. */
  if (p->drop_groups && setgroups(0, NULL) < 0) die(p, MB_NSINIT_IDS, -1);
  if (setresgid(0, 0, 0) < 0 || setresuid(0, 0, 0) < 0) die(p, MB_NSINIT_IDS, -1);
  if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0) die(p, MB_NSINIT_PDEATHSIG, -1);
  if (p->hostname && sethostname(p->hostname, strlen(p->hostname)) < 0) die(p, MB_NSINIT_HOSTNAME, -1);
  if (p->loopback && loopback_up() < 0) die(p, MB_NSINIT_LOOPBACK, -1);
  setup_root(p);
  if (p->zygote && chroot_built() < 0) die(p, MB_NSINIT_PIVOT, -1);
  if (!p->defer_pivot) {
    if (pivot_into_root(p) < 0) die(p, MB_NSINIT_PIVOT, -1);
    pivoted = 1;
  }
  setsid();
  /* stdio of pid 1 is /dev/null from here on */
  int null = open("/dev/null", O_RDWR | O_CLOEXEC);
  if (null >= 0) {
    dup2(null, 0);
    dup2(null, 1);
    dup2(null, 2);
    close(null);
  }
  sigset_t all, chld;
  sigfillset(&all);
  sigemptyset(&chld);
  sigaddset(&chld, SIGCHLD);
  if (sigprocmask(SIG_SETMASK, &all, NULL) < 0) die(p, MB_NSINIT_SIGNALS, -1);
  int sig_fd = signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK);
  if (sig_fd < 0) die(p, MB_NSINIT_SIGNALS, -1);
  report(p, MB_NSINIT_READY, 0, 0);
  close(p->report_fd);
  serve(p->sock_fd, sig_fd);
  return 0;
}
