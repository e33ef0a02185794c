/* Plan <-> bytes (see wire.h). Layout: a fixed header, then NUL-terminated
 * strings and the seccomp program, addressed by offsets from the start.
 * String arrays are arrays of 64-bit offsets ending in 0, rewritten in
 * place into char* on unpack (same size on the 64-bit targets we build).
 * mb_wire_recv is the one receiving side of the runtime <-> init socket. */
#include "wire.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#define WIRE_MAGIC 0x6d627770u /* "mbwp" */

typedef struct {
  uint32_t magic, size;
  int32_t ncand, cand_off, argv_off, env_off, cwd_off;
  int32_t setsid, setpgid, ctty, pdeathsig;
  int32_t cgroup_idx, cgroup_dir_idx, extra_idx[MB_MAX_EXTRA_CGROUPS];
  int32_t nfds;
  struct {
    int32_t target, kind, source_idx, null_flags;
  } fds[MB_MAX_FDS];
  int32_t nrlimits;
  struct {
    int32_t resource;
    uint64_t cur, max;
  } rlimits[MB_MAX_RLIMITS];
  int32_t set_ids;
  uint32_t uid, gid;
  int32_t ngroups;
  uint32_t groups[MB_MAX_GROUPS];
  int32_t no_new_privs, drop_caps;
  uint64_t cap_keep;
  int32_t seccomp_len, seccomp_off;
} wire_header;

_Static_assert(sizeof(char *) == sizeof(uint64_t), "offsets are rewritten into pointers in place");

typedef struct {
  char *buf;
  size_t len, cap;
  int failed;
} growbuf;

static size_t put(growbuf *b, const void *data, size_t len, size_t align) {
  size_t at = (b->len + align - 1) & ~(align - 1);
  if (at + len > b->cap) {
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < at + len) cap *= 2;
    char *nb = realloc(b->buf, cap);
    if (!nb) {
      b->failed = 1;
      return 0;
    }
    b->buf = nb;
    b->cap = cap;
  }
  memset(b->buf + b->len, 0, at - b->len);
  if (data) memcpy(b->buf + at, data, len);
  else memset(b->buf + at, 0, len);
  b->len = at + len;
  return at;
}

static int32_t put_string(growbuf *b, const char *s) { return s ? (int32_t)put(b, s, strlen(s) + 1, 1) : -1; }

static int32_t put_array(growbuf *b, const char *const *v, int n) {
  if (n < 0)
    for (n = 0; v && v[n]; n++) {}
  size_t at = put(b, NULL, (size_t)(n + 1) * 8, 8);
  for (int i = 0; i < n; i++) {
    uint64_t off = (uint64_t)put_string(b, v[i]);
    if (!b->failed) memcpy(b->buf + at + (size_t)i * 8, &off, 8);
  }
  return (int32_t)at;
}

static int fd_index(int *fds, int *nfds, int fd) {
  if (fd < 0) return -1;
  for (int i = 1; i < *nfds; i++)
    if (fds[i] == fd) return i;
  fds[(*nfds)++] = fd;
  return *nfds - 1;
}

int mb_wire_pack(const mb_child_plan *p, int *fds, int *nfds) {
  growbuf b = {0};
  wire_header h;
  memset(&h, 0, sizeof h);
  put(&b, NULL, sizeof h, 8);
  *nfds = 1;
  h.magic = WIRE_MAGIC;
  h.ncand = p->ncandidates;
  h.cand_off = put_array(&b, p->candidates, p->ncandidates);
  h.argv_off = put_array(&b, (const char *const *)p->argv, -1);
  h.env_off = put_array(&b, (const char *const *)p->envp, -1);
  h.cwd_off = put_string(&b, p->cwd);
  h.setsid = p->setsid;
  h.setpgid = p->setpgid;
  h.ctty = p->ctty;
  h.pdeathsig = p->pdeathsig;
  h.cgroup_idx = fd_index(fds, nfds, p->cgroup_procs_fd);
  h.cgroup_dir_idx = fd_index(fds, nfds, p->cgroup_dir_fd);
  for (int i = 0; i < MB_MAX_EXTRA_CGROUPS; i++) h.extra_idx[i] = fd_index(fds, nfds, p->extra_cgroup_fds[i]);
  h.nfds = p->nfds;
  for (int i = 0; i < p->nfds; i++) {
    h.fds[i].target = p->fds[i].target;
    h.fds[i].kind = p->fds[i].kind;
    h.fds[i].null_flags = p->fds[i].null_flags;
    h.fds[i].source_idx = p->fds[i].kind == MB_FD_SOURCE ? fd_index(fds, nfds, p->fds[i].source) : -1;
  }
  h.nrlimits = p->nrlimits;
  for (int i = 0; i < p->nrlimits; i++) {
    h.rlimits[i].resource = p->rlimits[i].resource;
    h.rlimits[i].cur = p->rlimits[i].limit.rlim_cur;
    h.rlimits[i].max = p->rlimits[i].limit.rlim_max;
  }
  h.set_ids = p->set_ids;
  h.uid = p->uid;
  h.gid = p->gid;
  h.ngroups = p->ngroups;
  for (int i = 0; i < p->ngroups && i < MB_MAX_GROUPS; i++) h.groups[i] = p->groups[i];
  h.no_new_privs = p->no_new_privs;
  h.drop_caps = p->drop_caps;
  h.cap_keep = p->cap_keep;
  h.seccomp_off = -1;
  if (p->seccomp) {
    h.seccomp_len = p->seccomp->len;
    h.seccomp_off = (int32_t)put(&b, p->seccomp->filter, p->seccomp->len * sizeof(struct sock_filter), 8);
  }
  if (b.failed) {
    free(b.buf);
    return ENOMEM;
  }
  h.size = (uint32_t)b.len;
  memcpy(b.buf, &h, sizeof h);
  int memfd = memfd_create("moonbox-plan", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (memfd < 0) {
    int e = errno;
    free(b.buf);
    return e;
  }
  size_t done = 0;
  while (done < b.len) {
    ssize_t n = write(memfd, b.buf + done, b.len - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int e = n < 0 ? errno : EIO;
      free(b.buf);
      close(memfd);
      return e;
    }
    done += (size_t)n;
  }
  free(b.buf);
  /* the receiver maps it privately; sealing keeps the shared copy as sent */
  fcntl(memfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL);
  fds[0] = memfd;
  return 0;
}

static int in_bounds(size_t len, int64_t off, size_t need) {
  return off >= 0 && (uint64_t)off <= len && need <= len - (size_t)off;
}

static char **fix_array(char *base, size_t len, int32_t off, int *count) {
  if (!in_bounds(len, off, 8)) return NULL;
  uint64_t *slots = (uint64_t *)(base + off);
  int n = 0;
  for (;; n++) {
    if (!in_bounds(len, off + (int64_t)n * 8, 8)) return NULL;
    uint64_t o = slots[n];
    if (o == 0) break;
    if (o >= len || memchr(base + o, 0, len - o) == NULL) return NULL;
    char *ptr = base + o;
    memcpy(&slots[n], &ptr, 8);
  }
  if (count) *count = n;
  return (char **)slots;
}

static int fd_at(const int *fds, int nfds, int32_t idx) { return idx > 0 && idx < nfds ? fds[idx] : -1; }

int mb_wire_unpack(void *map, size_t len, const int *fds, int nfds, mb_child_plan *p, struct sock_fprog *prog) {
  char *base = (char *)map;
  wire_header h;
  if (len < sizeof h) return EINVAL;
  memcpy(&h, base, sizeof h);
  if (h.magic != WIRE_MAGIC || h.size != len || h.ncand < 0 || h.ncand > MB_MAX_CANDIDATES || h.nfds < 0 ||
      h.nfds > MB_MAX_FDS || h.nrlimits < 0 || h.nrlimits > MB_MAX_RLIMITS)
    return EINVAL;
  memset(p, 0, sizeof *p);
  int n = 0;
  char **cand = fix_array(base, len, h.cand_off, &n);
  if (!cand || n != h.ncand) return EINVAL;
  for (int i = 0; i < n; i++) p->candidates[i] = cand[i];
  p->ncandidates = n;
  p->argv = fix_array(base, len, h.argv_off, NULL);
  p->envp = fix_array(base, len, h.env_off, NULL);
  if (!p->argv || !p->envp) return EINVAL;
  if (h.cwd_off >= 0) {
    if ((size_t)h.cwd_off >= len || !memchr(base + h.cwd_off, 0, len - (size_t)h.cwd_off)) return EINVAL;
    p->cwd = base + h.cwd_off;
  }
  p->setsid = h.setsid;
  p->setpgid = h.setpgid;
  p->ctty = h.ctty;
  p->pdeathsig = h.pdeathsig;
  p->cgroup_procs_fd = fd_at(fds, nfds, h.cgroup_idx);
  p->cgroup_dir_fd = fd_at(fds, nfds, h.cgroup_dir_idx);
  p->cgroup_joined = 0;
  for (int i = 0; i < MB_MAX_EXTRA_CGROUPS; i++) p->extra_cgroup_fds[i] = fd_at(fds, nfds, h.extra_idx[i]);
  p->nfds = h.nfds;
  for (int i = 0; i < h.nfds; i++) {
    p->fds[i].target = h.fds[i].target;
    p->fds[i].kind = (enum mb_fd_kind)h.fds[i].kind;
    p->fds[i].null_flags = h.fds[i].null_flags;
    if (p->fds[i].kind == MB_FD_SOURCE) {
      p->fds[i].source = fd_at(fds, nfds, h.fds[i].source_idx);
      if (p->fds[i].source < 0) return EBADF;
    }
  }
  p->nrlimits = h.nrlimits;
  for (int i = 0; i < h.nrlimits; i++) {
    p->rlimits[i].resource = h.rlimits[i].resource;
    p->rlimits[i].limit.rlim_cur = h.rlimits[i].cur;
    p->rlimits[i].limit.rlim_max = h.rlimits[i].max;
  }
  p->set_ids = h.set_ids;
  p->uid = h.uid;
  p->gid = h.gid;
  if (h.ngroups < 0 || h.ngroups > MB_MAX_GROUPS) return EINVAL;
  p->ngroups = h.ngroups;
  for (int i = 0; i < h.ngroups; i++) p->groups[i] = h.groups[i];
  p->no_new_privs = h.no_new_privs;
  p->drop_caps = h.drop_caps;
  p->cap_keep = h.cap_keep;
  if (h.seccomp_off >= 0) {
    if (h.seccomp_len <= 0 || !in_bounds(len, h.seccomp_off, (size_t)h.seccomp_len * sizeof(struct sock_filter)))
      return EINVAL;
    prog->len = (unsigned short)h.seccomp_len;
    prog->filter = (struct sock_filter *)(base + h.seccomp_off);
    p->seccomp = prog;
  }
  p->report_fd = -1;
  return 0;
}

ssize_t mb_wire_recv(int sock, void *buf, size_t len, mb_wire_in *in) {
  union {
    char buf[CMSG_SPACE(sizeof(struct ucred)) + CMSG_SPACE(sizeof(int) * MB_WIRE_MAX_FDS)];
    struct cmsghdr align;
  } u;
  struct iovec iov = {buf, len};
  struct msghdr msg;
  memset(&msg, 0, sizeof msg);
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = u.buf;
  msg.msg_controllen = sizeof u.buf;
  in->nfds = 0;
  in->cred_pid = 0;
  in->flags = 0;
  ssize_t n;
  do n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  while (n < 0 && errno == EINTR);
  if (n < 0) return -1;
  in->flags = msg.msg_flags;
  for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET) continue;
    if (c->cmsg_type == SCM_CREDENTIALS && c->cmsg_len == CMSG_LEN(sizeof(struct ucred))) {
      struct ucred cred;
      memcpy(&cred, CMSG_DATA(c), sizeof cred);
      in->cred_pid = cred.pid;
    } else if (c->cmsg_type == SCM_RIGHTS) {
      size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < k; i++) {
        int fd;
        memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
        if (in->nfds < MB_WIRE_MAX_FDS) {
          in->fds[in->nfds++] = fd;
        } else {
          close(fd); /* more than any message of ours carries */
          in->flags |= MSG_CTRUNC;
        }
      }
    }
  }
  return n;
}

ssize_t mb_wire_send(int sock, const void *buf, size_t len, const int *fds, int nfds, int flags) {
  union {
    char buf[CMSG_SPACE(sizeof(int) * MB_WIRE_MAX_FDS)];
    struct cmsghdr align;
  } u;
  if (nfds < 0 || nfds > MB_WIRE_MAX_FDS) {
    errno = EINVAL;
    return -1;
  }
  struct iovec iov = {(void *)buf, len};
  struct msghdr msg;
  memset(&msg, 0, sizeof msg);
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (nfds > 0) {
    memset(&u, 0, sizeof u);
    msg.msg_control = u.buf;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
    memcpy(CMSG_DATA(c), fds, sizeof(int) * (size_t)nfds);
  }
  ssize_t n;
  do n = sendmsg(sock, &msg, MSG_NOSIGNAL | flags);
  while (n < 0 && errno == EINTR);
  return n;
}
