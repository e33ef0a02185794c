/* Low fd slots: what lets a pre-exec child skip a copy of our fd table.
 *
 * A clone without CLONE_FILES copies the runtime's whole fd table into the
 * child, which then closes all but a few: with thousands of sandboxes or
 * sessions that is tens of thousands of files, about 1 us each (perf:
 * dup_fd, and close_range's filp_close), on every spawn. So the child
 * shares our table (CLONE_FILES) and, before anything else, unshares only
 * its low end: close_range(K, ~0, CLOSE_RANGE_UNSHARE) copies the fds below
 * K alone (Linux 5.9). The fds it needs are first dup3()ed into slots below
 * K: /dev/null placeholders reserved when the module loads (so their
 * numbers are low), put back once the clone has returned. Loop thread only. */

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "child.h"

#define NSLOTS 24 /* a spawn's plan: its fds, cgroup files and report pipe */

static int slots[NSLOTS];
static int nslots_taken;
static int slot_null = -1; /* what a slot holds between clones */
static int slots_below;    /* K: 1 + the highest slot; 0: no slots */

/* Whether this kernel (and any seccomp filter we run under) lets a child
 * unshare its table's low end: tried once, in a child of our own, never
 * here (our threads share this table). */
static char probe_stack[16 * 1024] __attribute__((aligned(16)));
static int probe_child(void *arg) {
  (void)arg;
  return mb_unshare_fds_below(slots_below) == 0 ? 0 : 1;
}
static int unshare_works(void) {
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  pid_t pid =
    clone(probe_child, probe_stack + sizeof probe_stack, CLONE_VM | CLONE_VFORK | CLONE_FILES | SIGCHLD, NULL);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  int status = 0;
  if (pid < 0) return 0;
  while (waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) return 0;
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

void mb_fd_slots_reserve(void) {
  if (slot_null >= 0) return;
  int fds[NSLOTS + 1], n = 0, top = 0;
  for (; n < NSLOTS + 1; n++) {
    if ((fds[n] = open("/dev/null", O_RDONLY | O_CLOEXEC)) < 0) break;
    if (fds[n] > top) top = fds[n];
  }
  if (n < NSLOTS + 1) { /* (no fds to spare: every clone copies the table) */
    while (n > 0) close(fds[--n]);
    return;
  }
  for (int i = 0; i < NSLOTS; i++) slots[i] = fds[i];
  slot_null = fds[NSLOTS];
  slots_below = top + 1;
  if (!unshare_works()) { /* before Linux 5.9: every clone copies the table, as it did */
    for (int i = 0; i <= NSLOTS; i++) close(fds[i]);
    slots_below = 0;
  }
}

int mb_fd_slots_below(void) { return slots_below; }

int mb_fd_slot_take(int *fd) {
  if (*fd < 0) return 0;
  if (!slots_below || nslots_taken == NSLOTS) {
    errno = EMFILE;
    return -1;
  }
  if (dup3(*fd, slots[nslots_taken], O_CLOEXEC) < 0) return -1;
  *fd = slots[nslots_taken++];
  return 0;
}

void mb_fd_slots_put(void) {
  while (nslots_taken > 0) dup3(slot_null, slots[--nslots_taken], O_CLOEXEC);
}
