/* A command's stdout and stderr for __mb_run (spawn_builtin.c), without
 * bash's redirection.
 *
 * `builtin __mb_run -s BODY >|OUT 2>|ERR` made bash open each file, save
 * the shell's fd above 9 (F_DUPFD, two F_GETFDs, F_SETFD), dup2 the new one
 * into place and close it, then after the body dup2 the saved one back,
 * check and close it: 20 system calls per command (issue #32). Between
 * commands the shell's fds 1 and 2 are closed (the status channel lives on
 * a private fd, report_builtin.c), so nothing needs saving: the runtime's
 * two pipes arrive straight on 1 and 2 (the lowest free fds) and are
 * closed after the body (once the runtime sends messages only, by the
 * report, after its record), which also undoes what the body did to 1 and
 * 2 (`exec >file`, `exec 2>&1`), as the redirection's restore did.
 *
 * Closed, not /dev/null: a command's fds land on 1 and 2 with no close
 * before, and none of /dev/null's dup2s after (4 system calls a command).
 * What runs in the shell between commands writes nowhere either way (a
 * trap's output: EBADF instead of /dev/null); something it opens there
 * lands on 1 or 2 and is moved aside by the next command's receive.
 *
 * A body that leaves through a longjmp (`exit`, a fatal error) skips the
 * restore: the shell is then ending, or the report closes them
 * (mb_outputs_settle) before the next command.
 */
#include <loadables.h>

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "mb_builtins.h"

static int placed; /* 1 and 2 are a command's until mb_outputs_restore */
static int taken;  /* they came with the control line (`@`, mb_outputs_take): __mb_run uses them */

/* Whether a command's output pipes stayed the shell's alone: the processes
 * the shell made (forks, spawns) are counted, and a command that came with
 * its pipes on the socket, when the shell made none since the last report
 * (between commands too: a trap's fork inherits a copy the shell kept,
 * `exec 7>&1`), left them in no other process (only in the shell's own
 * fds; the shell is not dumpable, so no other process opens them through
 * /proc). The report says so and the runtime sends the same pipes again
 * (issue #32). */
static unsigned long made;      /* processes made by the shell so far */
static unsigned long made_mark; /* ... at the last report */
static int received;            /* this command's outputs came on the socket */

/* A command's body sent in its message (the runtime's INLINE_SHAPES): the
 * shape's byte in upper case, two bytes of length (big-endian), the body.
 * The body file holds it too (the fallback, spawn_builtin.c); taken by the
 * command's __mb_run, dropped by the report. */
static char inline_body[MB_INLINE_MAX + 1];
static int inline_len = -1; /* -1: none */

/* A fork of the shell (a subshell, a background job) owns what it holds. */
static void forked_child(void) {
  placed = taken = received = 0;
  inline_len = -1;
}
static void forked_parent(void) { made++; }

static int guard_forks(void) {
  static int guarded;
  if (!guarded && pthread_atfork(NULL, forked_parent, forked_child) != 0) return -1;
  guarded = 1;
  return 0;
}

void mb_outputs_spawned(void) { made++; }

int mb_outputs_private(void) {
  int alone = received && made == made_mark;
  made_mark = made;
  return alone;
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

const char *mb_outputs_inline_body(size_t *len) {
  if (inline_len < 0) return NULL;
  *len = (size_t)inline_len;
  inline_len = -1;
  return inline_body;
}

/* The rest of a message (what the first recvmsg did not bring) into
 * buf[have..want): -1 (EPROTO) if it does not come within a second. */
static int receive_rest(int sock, char *buf, size_t have, size_t want) {
  while (have < want) {
    struct pollfd p = {sock, POLLIN, 0};
    int ready = poll(&p, 1, 1000);
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) {
      errno = EPROTO; /* (the runtime sends a message whole) */
      return -1;
    }
    ssize_t n = recv(sock, buf + have, want - have, MSG_DONTWAIT);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) {
      errno = EPROTO;
      return -1;
    }
    have += (size_t)n;
  }
  return 0;
}

/* One message of the runtime's on the status socket: a byte (the command's
 * shape; an upper-case one with its body, above) and up to two fds
 * (SCM_RIGHTS). flags: MSG_DONTWAIT or 0 (wait). 0 and *got fds in fds;
 * -1 at EOF (errno 0) or on an error. */
static int receive_message(char *byte, int fds[2], int *got, int flags) {
  int sock = mb_status_fd();
  if (sock < 0) {
    errno = EBADF;
    return -1;
  }
  unsigned char head[3];
  struct iovec iov[2] = {{head, sizeof head}, {inline_body, MB_INLINE_MAX}};
  inline_len = -1;
  union {
    char buf[CMSG_SPACE(sizeof(int) * 2)];
    struct cmsghdr align;
  } u;
  struct msghdr msg;
  memset(&msg, 0, sizeof msg);
  msg.msg_iov = iov;
  msg.msg_iovlen = 2;
  msg.msg_control = u.buf;
  msg.msg_controllen = sizeof u.buf;
  int wait = !(flags & MSG_DONTWAIT);
  ssize_t n;
  for (;;) {
    /* Waiting is in poll(POLLIN), never in recvmsg: the runtime's reading
     * of the shell's record frees memory charged to this socket, and that
     * wakes every task sleeping on it whatever it waits for
     * (unix_write_space); a recvmsg sleeper woke for nothing once per
     * command, a poll for POLLIN is not woken by that (issue #32). */
    if (wait) {
      struct pollfd p = {sock, POLLIN, 0};
      if (poll(&p, 1, -1) < 0) {
        if (errno != EINTR) return -1;
        /* a signal while waiting between commands: its trap runs now, at
         * the top level, as it would while bash waited for its next line */
        check_signals_and_traps();
        continue;
      }
    }
    n = recvmsg(sock, &msg, MSG_DONTWAIT);
    if (n >= 0) break;
    if (errno == EINTR || (errno == EAGAIN && wait)) continue;
    return -1;
  }
  *got = 0;
  for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < k; i++) {
      int fd;
      memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
      if (*got < 2) fds[(*got)++] = fd;
      else close(fd);
    }
  }
  if (n == 0) errno = 0;
  int with_body = n >= 1 && (head[0] == 'A' || head[0] == 'E');
  size_t body_len = 0, body_got = n > 3 ? (size_t)n - 3 : 0;
  int bad = n < 1 || (msg.msg_flags & MSG_CTRUNC) || (!with_body && n != 1);
  if (!bad && with_body) {
    bad = n < 3 && receive_rest(sock, (char *)head, (size_t)n, sizeof head) < 0;
    body_len = (size_t)head[1] << 8 | head[2];
    bad =
      bad || body_len > MB_INLINE_MAX || body_got > body_len || receive_rest(sock, inline_body, body_got, body_len) < 0;
  }
  if (bad) {
    for (int i = 0; i < *got; i++) close(fds[i]);
    if (n >= 1) errno = EPROTO;
    return -1;
  }
  /* (the shape's own byte: '1' or '5') */
  *byte = with_body ? (char)(head[0] == 'A' ? '1' : '5') : (char)head[0];
  if (with_body) {
    inline_body[body_len] = 0;
    inline_len = (int)body_len;
  }
  return 0;
}

/* fds onto 1 and 2. They are closed between commands, so received fds
 * arrive there (the lowest free ones) and nothing is done (issue #32);
 * anywhere else (the first command, where 1 and 2 are still the start's
 * /dev/null; a command closed fd 0; something a trap opened between
 * commands) they are moved. Not close-on-exec: they are the command's. */
static int place_received(int fds[2]) {
  placed = 1;
  received = 1;
  if (fds[0] == 1 && fds[1] == 2) return 0;
  /* above 2 first, so neither is overwritten by the other's move */
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

/* The two fds the runtime sent for this command (sent before its control
 * line: none waiting is a failure), onto 1 and 2; *byte: the byte sent. */
static int receive(char *byte) {
  int fds[2], got;
  if (receive_message(byte, fds, &got, MSG_DONTWAIT) < 0) return -1;
  if (got != 2) {
    for (int i = 0; i < got; i++) close(fds[i]);
    errno = EPROTO;
    return -1;
  }
  return place_received(fds);
}

int mb_outputs_next(int *shape, int *with_outputs) {
  if (guard_forks() < 0) return -1;
  char byte;
  int fds[2], got;
  if (receive_message(&byte, fds, &got, 0) < 0) return -1;
  *shape = (unsigned char)byte;
  *with_outputs = got == 2;
  if (got == 1) close(fds[0]);
  /* (a move that fails leaves the command what did land: it still runs
   * and reports, rather than leave the runtime waiting) */
  if (got == 2) place_received(fds);
  taken = got == 2;
  return 0;
}

void mb_outputs_restore(void) {
  close(1);
  close(2);
  placed = 0;
}

int mb_outputs_take(int *shape) {
  if (guard_forks() < 0) return -1;
  char byte;
  if (receive(&byte) < 0) {
    int saved = errno;
    if (placed) mb_outputs_restore();
    errno = saved;
    return -1;
  }
  taken = 1;
  *shape = (unsigned char)byte;
  return 0;
}

int mb_outputs_open(const char *out, const char *err) {
  if (guard_forks() < 0) return -1;
  int received = strcmp(out, "-") == 0 && strcmp(err, "-") == 0;
  if (received && taken) {
    taken = 0;
    return 0;
  }
  char byte;
  placed = 1;
  if (received ? receive(&byte) < 0 : (place(out, 1) < 0 || place(err, 2) < 0)) {
    int saved = errno;
    mb_outputs_restore();
    errno = saved;
    return -1;
  }
  return 0;
}

void mb_outputs_settle(void) {
  inline_len = -1;
  if (placed) mb_outputs_restore();
  taken = 0;
  received = 0;
}
