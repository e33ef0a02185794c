/* A command's stdout and stderr for __mb_run (spawn_builtin.c), without
 * bash's redirection.
 *
 * `builtin __mb_run -s BODY >|OUT 2>|ERR` made bash open each file, save
 * the shell's fd above 9 (F_DUPFD, two F_GETFDs, F_SETFD), dup2 the new one
 * into place and close it, then after the body dup2 the saved one back,
 * check and close it: 20 system calls per command (issue #32). Between
 * commands the shell's fds 1 and 2 are /dev/null (the status pipe lives on
 * a private fd, report_builtin.c), so nothing needs saving: the files are
 * opened straight onto 1 and 2 (close, open: the lowest free fd), and
 * /dev/null is put back after the body from a private fd (two dup2s),
 * which also undoes what the body did to 1 and 2 (`exec >file`,
 * `exec 1>&-`), as the redirection's restore did.
 *
 * A body that leaves through a longjmp (`exit`, a fatal error) skips the
 * restore: the shell is then ending, or the report puts /dev/null back
 * (mb_outputs_settle) before the next command.
 */
#include <loadables.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "mb_builtins.h"

static int null_fd = -1; /* /dev/null, write-only, close-on-exec, above the fds commands use; closed in forks */
static int placed;       /* 1 and 2 are a command's until mb_outputs_restore */

/* Above the fds commands use, below a low RLIMIT_NOFILE (as the status fd). */
static int private_floor(void) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < 200)
    return (int)rl.rlim_cur / 2;
  return 100;
}

/* A fork of the shell (a subshell, a background job) gets no copy: it holds
 * what bash gives it and nothing of ours (it opens its own if it needs one). */
static void forked_child(void) {
  if (null_fd >= 0) close(null_fd);
  null_fd = -1;
  placed = 0;
}

static int open_null(void) {
  static int guarded;
  if (!guarded) {
    if (pthread_atfork(NULL, NULL, forked_child) != 0) return -1;
    guarded = 1;
  }
  int fd = open("/dev/null", O_WRONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  int high = fcntl(fd, F_DUPFD_CLOEXEC, private_floor());
  if (high >= 0) {
    close(fd);
    fd = high;
  }
  null_fd = fd;
  return 0;
}

/* path, opened as bash opens `>|path`, onto fd target */
static int place(const char *path, int target) {
  close(target);
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0666);
  if (fd < 0 || fd == target) return fd < 0 ? -1 : 0;
  int rc = dup2(fd, target);
  int saved = errno;
  close(fd);
  errno = saved;
  return rc < 0 ? -1 : 0;
}

/* The two fds the runtime sent for this command on the status socket (one
 * byte with SCM_RIGHTS, sent before the control line), onto 1 and 2. With
 * 1 and 2 closed first they arrive there (the lowest free fds), so a
 * command costs three system calls (issue #32); anywhere else (a command
 * closed fd 0) they are moved. Not close-on-exec: they are the command's. */
static int receive(void) {
  int sock = mb_status_fd();
  if (sock < 0) {
    errno = EBADF;
    return -1;
  }
  close(1);
  close(2);
  char byte;
  struct iovec iov = {&byte, 1};
  union {
    char buf[CMSG_SPACE(sizeof(int) * 2)];
    struct cmsghdr align;
  } u;
  struct msghdr msg;
  memset(&msg, 0, sizeof msg);
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = u.buf;
  msg.msg_controllen = sizeof u.buf;
  ssize_t n;
  do n = recvmsg(sock, &msg, MSG_DONTWAIT);
  while (n < 0 && errno == EINTR);
  if (n < 0) return -1;
  int fds[2] = {-1, -1}, got = 0;
  for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < k; i++) {
      int fd;
      memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
      if (got < 2) fds[got++] = fd;
      else close(fd);
    }
  }
  if (n != 1 || got != 2 || (msg.msg_flags & MSG_CTRUNC)) {
    for (int i = 0; i < got; i++) close(fds[i]);
    errno = EPROTO;
    return -1;
  }
  if (fds[0] == 1 && fds[1] == 2) return 0;
  /* elsewhere (a command closed fd 0: they are on 0 and 1): above 2 first,
   * so neither is overwritten by the other's move */
  for (int i = 0; i < 2; i++) {
    int high = fds[i] > 2 ? fds[i] : fcntl(fds[i], F_DUPFD, 3);
    if (high < 0) return -1;
    if (high != fds[i]) close(fds[i]);
    fds[i] = high;
  }
  for (int i = 0; i < 2; i++) {
    if (dup2(fds[i], i + 1) < 0) return -1;
    close(fds[i]);
  }
  return 0;
}

void mb_outputs_restore(void) {
  /* (a body may have closed or replaced the private fd: open it again) */
  if ((null_fd < 0 || dup2(null_fd, 1) < 0) && open_null() == 0) dup2(null_fd, 1);
  if (null_fd >= 0 && dup2(null_fd, 2) < 0 && open_null() == 0) dup2(null_fd, 2);
  placed = 0;
}

int mb_outputs_open(const char *out, const char *err) {
  if (null_fd < 0 && open_null() < 0) return -1;
  placed = 1;
  int received = strcmp(out, "-") == 0 && strcmp(err, "-") == 0;
  if (received ? receive() < 0 : (place(out, 1) < 0 || place(err, 2) < 0)) {
    int saved = errno;
    mb_outputs_restore();
    errno = saved;
    return -1;
  }
  return 0;
}

void mb_outputs_settle(void) {
  if (placed) mb_outputs_restore();
}
