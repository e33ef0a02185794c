/* The root zygote: a thread of the runtime that lives in a mount namespace
 * of its own, rooted at an empty read-only tmpfs. Every sandbox init is
 * cloned from it (nsinit_host.c), so its new mount namespace is a copy of
 * that one, not of the host's.
 *
 * Why: a sandbox's mount namespace must not keep the host's root under its
 * own. Copied from the host's namespace, it had to pivot_root away from
 * it, and pivot_root walks every task on the host (chroot_fs_refs) under
 * the tasklist lock: 3.3 ms of each creation at 6,400 tasks, so creating a
 * sandbox slowed as a server filled. Copied from this namespace, whose root
 * is already empty (one pivot_root, here, once), an init mounts its new
 * root over that empty root (MS_MOVE onto "/") and chroots into it, and
 * nothing walks the tasks. ".." from a mount stacked on a namespace's root
 * leads nowhere (the mount under it is itself a root), and under it lies
 * only this tmpfs, read-only at the superblock, holding two empty
 * directories.
 *
 * One of them holds a proc of a pid namespace with no process left: the
 * kernel lets a user namespace mount proc only where a proc is already
 * fully visible (mount_too_revealing), and this one shows no process.
 *
 * Only a runtime with CAP_SYS_ADMIN can make the namespace (an unprivileged
 * one would need a user namespace of its own, which a threaded process
 * cannot join): there mb_zygote_run() fails, and the caller clones from the
 * host's namespace and pivots as before. MOONBOX_ZYGOTE=0 does the same.
 *
 * The thread outlives every init: their PR_SET_PDEATHSIG is tied to the
 * thread that cloned them. It ends only with the process. */
#include "private.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

enum { UNTRIED, READY, FAILED };
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cond = PTHREAD_COND_INITIALIZER;
static int state = UNTRIED, start_err;
static void (*job_fn)(void *);
static void *job_arg;
static int busy, done;

static char proc_stack[16 * 1024] __attribute__((aligned(16)));

/* pid 1 of a new pid namespace, sharing our memory until it exits: mount
 * its proc, and end (the namespace ends with it) */
static int mount_empty_proc(void *unused) {
  (void)unused;
  _exit(mount("proc", "/tmp/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0 ? errno : 0);
}

/* This thread into its own mount namespace, rooted at the empty tmpfs. */
static int build(void) {
  if (unshare(CLONE_FS | CLONE_NEWNS) < 0) return errno;
  if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) return errno;
  if (mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0755,size=16384,nr_inodes=16") < 0)
    return errno;
  if (mkdir("/tmp/tmp", 0755) < 0 || mkdir("/tmp/proc", 0555) < 0) return errno;
  pid_t pid = clone(mount_empty_proc, proc_stack + sizeof proc_stack, CLONE_NEWPID | CLONE_VM | CLONE_VFORK, NULL);
  if (pid < 0) return errno;
  int status;
  while (waitpid(pid, &status, __WALL) < 0)
    if (errno != EINTR) return errno;
  if (!WIFEXITED(status)) return EIO;
  if (WEXITSTATUS(status)) return WEXITSTATUS(status);
  if (chdir("/tmp") < 0 || syscall(SYS_pivot_root, ".", ".") < 0 || umount2(".", MNT_DETACH) < 0 || chdir("/") < 0)
    return errno;
  /* read-only for good: no one below the host's root may remount it */
  if (mount(NULL, "/", NULL, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0) return errno;
  return 0;
}

static void *zygote_main(void *unused) {
  (void)unused;
  int err = build();
  pthread_mutex_lock(&lock);
  start_err = err;
  state = err ? FAILED : READY;
  pthread_cond_broadcast(&cond);
  while (!err) {
    while (!job_fn) pthread_cond_wait(&cond, &lock);
    void (*fn)(void *) = job_fn;
    void *arg = job_arg;
    job_fn = NULL;
    pthread_mutex_unlock(&lock);
    fn(arg);
    pthread_mutex_lock(&lock);
    done = 1;
    pthread_cond_broadcast(&cond);
  }
  pthread_mutex_unlock(&lock);
  return NULL;
}

/* With the lock held: start the thread once, and wait until it is ready. */
static void start(void) {
  const char *env = getenv("MOONBOX_ZYGOTE");
  state = FAILED;
  start_err = ENOTSUP;
  if (env && strcmp(env, "0") == 0) return;
  pthread_t t;
  pthread_attr_t attr;
  sigset_t all, old;
  sigfillset(&all);
  /* the thread takes no signal: SIGCHLD of the inits it clones goes to the
   * loop's thread */
  pthread_sigmask(SIG_SETMASK, &all, &old);
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_attr_setstacksize(&attr, 64 * 1024);
  int e = pthread_create(&t, &attr, zygote_main, NULL);
  pthread_attr_destroy(&attr);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (e) {
    start_err = e;
    return;
  }
  state = UNTRIED;
  while (state == UNTRIED) pthread_cond_wait(&cond, &lock);
}

int mb_zygote_available(void) {
  pthread_mutex_lock(&lock);
  if (state == UNTRIED) start();
  int ok = state == READY;
  pthread_mutex_unlock(&lock);
  return ok;
}

int mb_zygote_run(void (*fn)(void *), void *arg) {
  pthread_mutex_lock(&lock);
  if (state == UNTRIED) start();
  if (state != READY) {
    int e = start_err ? start_err : ENOTSUP;
    pthread_mutex_unlock(&lock);
    return e;
  }
  while (busy) pthread_cond_wait(&cond, &lock);
  busy = 1;
  done = 0;
  job_arg = arg;
  job_fn = fn;
  pthread_cond_broadcast(&cond);
  while (!done) pthread_cond_wait(&cond, &lock);
  busy = 0;
  pthread_cond_broadcast(&cond);
  pthread_mutex_unlock(&lock);
  return 0;
}
