/* Start a child already inside its cgroup (clone3's CLONE_INTO_CGROUP).
 *
 * Why: joining a cgroup by writing to cgroup.procs takes the kernel's
 * cgroup threadgroup lock for writing, and that waits out an RCU grace
 * period whenever no migration happened lately: 4-7 ms on this VM after
 * 80 ms of quiet (0.2 ms back to back), paid by every session, process and
 * sandbox a quiet program starts. A child born in its cgroup pays nothing.
 *
 * clone3 has no libc wrapper that runs a function on the child's stack, so
 * this is one for x86_64: the child calls fn(arg) on [stack, stack + size)
 * and exits with its result, as clone(2)'s glibc wrapper does. Elsewhere,
 * and on kernels without clone3 or CLONE_INTO_CGROUP, it fails with ENOSYS
 * or EINVAL and the caller uses clone() and cgroup.procs as before. */
#include "child.h"

#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>

#ifndef CLONE_INTO_CGROUP
#define CLONE_INTO_CGROUP 0x200000000ULL
#endif

/* the kernel's struct clone_args, up to the cgroup field (CLONE_ARGS_SIZE_VER2) */
struct mb_clone_args {
  uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls;
  uint64_t set_tid, set_tid_size, cgroup;
};

pid_t mb_clone_into_cgroup(int (*fn)(void *), void *arg, void *stack, size_t stack_size, int flags, int cgroup_dir_fd) {
#if defined(__x86_64__) && defined(SYS_clone3)
  if (cgroup_dir_fd < 0) {
    errno = EINVAL;
    return -1;
  }
  struct mb_clone_args args;
  memset(&args, 0, sizeof args);
  args.flags = (uint64_t)(unsigned)flags | CLONE_INTO_CGROUP;
  args.exit_signal = SIGCHLD;
  args.stack = (uint64_t)(uintptr_t)stack;
  args.stack_size = stack_size & ~(size_t)15; /* the child's rsp: 16-byte aligned */
  args.cgroup = (uint64_t)cgroup_dir_fd;
  register void *fn_reg __asm__("r12") = (void *)fn;
  register void *arg_reg __asm__("r13") = arg;
  long ret;
  /* r12 and r13 survive the syscall; the child starts at the next
   * instruction on its own stack, calls fn(arg) and exits (SYS_exit: this
   * thread only, as after a clone() that returns) */
  __asm__ volatile("syscall\n\t"
                   "testq %%rax, %%rax\n\t"
                   "jnz 1f\n\t"
                   "xorl %%ebp, %%ebp\n\t"
                   "movq %%r13, %%rdi\n\t"
                   "callq *%%r12\n\t"
                   "movl %%eax, %%edi\n\t"
                   "movl %[sys_exit], %%eax\n\t"
                   "syscall\n\t"
                   "hlt\n\t"
                   "1:\n\t"
                   : "=a"(ret)
                   : "0"((long)SYS_clone3), "D"(&args), "S"(sizeof args), "r"(fn_reg),
                     "r"(arg_reg), [sys_exit] "i"(SYS_exit)
                   : "rcx", "r11", "memory");
  if (ret < 0) {
    errno = (int)-ret;
    return -1;
  }
  return (pid_t)ret;
#else
  (void)fn;
  (void)arg;
  (void)stack;
  (void)stack_size;
  (void)flags;
  (void)cgroup_dir_fd;
  errno = ENOSYS;
  return -1;
#endif
}
