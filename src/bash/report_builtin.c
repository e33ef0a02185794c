/* __mb_rep: the session shell's report after each command, as a bash
 * loadable builtin (loaded with __mb_run from the same module).
 *
 *   __mb_rep ID STATUS KIND ENVFILE
 *   __mb_rep -h          (once, from the start-up script: the hello)
 *
 * writes the status record
 * "\n<ID> <STATUS> <KIND> <e|-><k?> <NONCE> <NEXT>\0<PWD>\0" on the status pipe
 * in one write. The runtime takes a command's word for being done only
 * when NONCE is the one it was told last (in the previous record, or in
 * the hello for the first): commands run in this very shell (a sourced
 * body) and can write on any fd it holds, so the record is authenticated
 * by a secret the command cannot read. The nonces (128 bits from
 * getrandom) live only in this module's memory and travel only on the
 * status pipe, which the shell writes and never reads:
 * - the status pipe arrives as fd 1; on load it moves to a private
 *   close-on-exec fd and fd 1 becomes /dev/null, so no redirection ever
 *   saves a copy of it (bash kept one on fd 11 during each body), and a
 *   fork of the shell (subshell, background job) closes it and wipes the
 *   nonces at once (pthread_atfork): no child of the shell inherits either;
 * - the shell is made non-dumpable, so its memory is not readable through
 *   /proc/<pid>/mem by its commands (that needs CAP_SYS_PTRACE, which
 *   sandbox processes do not have);
 * - the builtin writes a record only where the runtime's command shapes
 *   call it: in the shell process itself (a fork has no status fd), at the top
 *   level (bash's sourcelevel 0: no body is being sourced) and in no trap
 *   for a `run` record, in the EXIT trap for an `exit` one. A body that
 *   calls `builtin __mb_rep` itself gets nothing written (status 3).
 * - bytes waiting on the control pipe when a `run` record is due (a
 *   command that wrote commands there, to run at the top level) are
 *   dropped before bash reads them; the record is written all the same.
 * What this does not stop: a command that loads native code of its own
 * into the shell (`enable -f its.so`) can read the shell's memory.
 *
 * Before the record, if the shell's exported
 * environment differs from the one it last reported, ENVFILE is rewritten
 * with it as NUL-terminated NAME=VALUE entries and the flag is `e`; else the
 * file is left alone and the flag is `-` (the runtime keeps what it has).
 * `k` after it: the command's output pipes, sent on the socket, are in no
 * other process (the shell made none since they came, outputs.c): the
 * runtime may send them again with the next command.
 *
 * The shell function it replaces ran `export -p` into ENVFILE every time:
 * bash sorts and quotes every variable for that, about 10 us a command.
 * bash's export environment (what its children get) is kept up to date by
 * bash itself; exported functions (BASH_FUNC_...) are left out, as
 * `export -p` leaves them out.
 */
#include <loadables.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <unistd.h>

#include "mb_builtins.h"
#include "version.h"
#include <alias.h>

#define NONCE_HEX 32

static int status_fd = -1; /* the status pipe, private to this process */

/* outputs.c receives a command's outputs on it (mb_outputs_open) */
int mb_status_fd(void) { return status_fd; }
static int control_fd = -1;       /* the control FIFO's writer (fd 60 at start), held, never used */
static int null_in = -1;          /* /dev/null, read-only: fd 0 between commands (restore_null_stdin) */
static char nonce[NONCE_HEX + 1]; /* what the next record must carry */
static int said_hello, exiting_reported;

/* Random bytes drawn 1 KiB at a time: a system call per command is dear
 * on a paravirtualised VM (docs/benchmarks.md). Wiped in forks too. */
static unsigned char pool[1024];
static size_t pool_left;

/* 128 random bits as hex into out (NONCE_HEX + 1 bytes); -1 on failure. */
static int new_nonce(char *out) {
  unsigned char raw[NONCE_HEX / 2];
  if (pool_left < sizeof raw) {
    size_t got = 0;
    while (got < sizeof pool) {
      ssize_t n = getrandom(pool + got, sizeof pool - got, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return -1;
      got += (size_t)n;
    }
    pool_left = sizeof pool;
  }
  pool_left -= sizeof raw;
  memcpy(raw, pool + pool_left, sizeof raw);
  memset(pool + pool_left, 0, sizeof raw); /* used once */
  static const char hex[] = "0123456789abcdef";
  for (size_t i = 0; i < sizeof raw; i++) {
    out[2 * i] = hex[raw[i] >> 4];
    out[2 * i + 1] = hex[raw[i] & 15];
  }
  out[NONCE_HEX] = 0;
  return 0;
}

/* In every fork of the shell: no status pipe, no nonce. */
static void forked_child(void) {
  if (status_fd >= 0) close(status_fd);
  status_fd = -1;
  if (control_fd >= 0) close(control_fd);
  control_fd = -1;
  memset(nonce, 0, sizeof nonce);
  memset(pool, 0, sizeof pool);
  pool_left = 0;
  if (null_in >= 0) close(null_in);
  null_in = -1;
}

/* the environment last written (in this shell process) */
static char *last_env;
static size_t last_len;

static int write_all(int fd, const char *p, size_t len) {
  while (len > 0) {
    ssize_t n = write(fd, p, len);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return -1;
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

/* The export environment as NUL-terminated entries (malloc'd). */
static char *export_entries(size_t *len) {
  maybe_make_export_env();
  size_t total = 0;
  for (char **e = export_env; e && *e; e++)
    if (strncmp(*e, "BASH_FUNC_", 10) != 0) total += strlen(*e) + 1;
  char *buf = malloc(total ? total : 1);
  if (!buf) return NULL;
  size_t off = 0;
  for (char **e = export_env; e && *e; e++) {
    if (strncmp(*e, "BASH_FUNC_", 10) == 0) continue;
    size_t n = strlen(*e) + 1;
    memcpy(buf + off, *e, n);
    off += n;
  }
  *len = off;
  return buf;
}

/* Rewrite the env file if the environment changed: 1 if it was rewritten,
 * 0 if unchanged, -1 if it could not be. */
static int report_env(const char *path) {
  size_t len;
  char *env = export_entries(&len);
  if (!env) return -1;
  if (last_env && len == last_len && memcmp(env, last_env, len) == 0) {
    free(env);
    return 0;
  }
  int fd = open(path, O_WRONLY | O_TRUNC | O_CLOEXEC);
  if (fd < 0) {
    free(env);
    return -1;
  }
  int rc = write_all(fd, env, len);
  close(fd);
  if (rc < 0) {
    free(env);
    return -1;
  }
  free(last_env);
  last_env = env;
  last_len = len;
  return 1;
}

/* Drop what waits on bash's script fd (the control pipe), never blocking:
 * a background job of the command may read the pipe too, and take what
 * FIONREAD counted. The file description is bash's, shared with nothing
 * but the pipe's other openers, and bash is in this builtin: O_NONBLOCK is
 * set for the drain only. At most 1 MiB, so a writer that never stops
 * cannot keep the shell here. */
static void drop_pending(int fd) {
  int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || (!(flags & O_NONBLOCK) && fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0)) return;
  char junk[4096];
  for (int i = 0; i < 256; i++) {
    ssize_t n = read(fd, junk, sizeof junk);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
  }
  if (!(flags & O_NONBLOCK)) fcntl(fd, F_SETFL, flags);
}

/* The shell's stdin is /dev/null (read-only) between commands: the command
 * shapes without a stdin no longer redirect `</dev/null` around the body
 * (bash's save, open, dup2 and restore: 10 system calls a command, issue
 * #32), so what a body did to fd 0 (`exec 0<file`, `exec 0<&-`,
 * `exec 0<>/dev/null`) is undone here, before the next command runs, as the
 * redirection undid it: a private read-only /dev/null is dup2()ed onto fd
 * 0, one system call (checking what fd 0 is took two, fcntl and fstat).
 * Private as the status fd is: close-on-exec, above the fds commands use,
 * closed in forks; a body that closes it gets it opened again, one that
 * puts a file of its own on that number gives its own session that stdin. */
static int lowest_private_fd(void) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < 200)
    return (int)rl.rlim_cur / 2;
  return 100;
}

static int open_null_in(void) {
  int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  int high = fcntl(fd, F_DUPFD_CLOEXEC, lowest_private_fd());
  if (high >= 0) {
    close(fd);
    fd = high;
  }
  null_in = fd;
  return 0;
}

/* Bytes waiting on bash's script fd, dropped (see mb_rep_builtin). */
static void drop_script_pending(void) {
  int pending = 0;
  if (default_buffered_input >= 0 && ioctl(default_buffered_input, FIONREAD, &pending) == 0 && pending > 0)
    drop_pending(default_buffered_input);
}

static void restore_null_stdin(void) {
  if (null_in >= 0 && dup2(null_in, 0) == 0) return;
  if (open_null_in() == 0) dup2(null_in, 0);
}

/* A report refused (or that failed) is status REFUSED, not 1: 1 is what
 * `builtin __mb_rep` gives when the builtin was disabled, and the report
 * then goes through `__mb_run -r` instead. */
#define REFUSED 3

static int hello(void) {
  if (said_hello || status_fd < 0) return REFUSED;
  said_hello = 1;
  char record[64 + NONCE_HEX];
  int n = snprintf(record, sizeof record, "\n0 0 hello - H %s", nonce);
  record[n++] = 0;
  record[n++] = 0;
  return write_all(status_fd, record, (size_t)n) < 0 ? REFUSED : EXECUTION_SUCCESS;
}

/* The names the runtime's control line and command shapes call (`@ N`,
 * line_builtin.c, or `eval "$__mb_cN"`; `builtin __mb_run`, `__mb_report`):
 * a function or an alias a command gave one of them would take every later
 * command's place (the session would hang, or run the alias instead), so
 * they go after the command that made them, as each report is written; a
 * `@` the command disabled is enabled again. */
static void keep_protocol_names(void) {
  static char *const names[] = {"@", "eval", "builtin", "__mb_run", "__mb_rep", "__mb_report", NULL};
  mb_keep_line_enabled();
  for (int i = 0; names[i]; i++) {
    if (find_alias(names[i])) remove_alias(names[i]);
    SHELL_VAR *f = find_function(names[i]);
    if (f && !readonly_p(f)) unbind_func(names[i]);
  }
}

/* What a report leaves as it was before the command: stdin /dev/null,
 * fds 1 and 2 closed, no bytes waiting on the script fd (those dropped
 * before the record unless after: see mb_rep_builtin). */
static void settle(int exiting, int after) {
  if (exiting) return;
  if (after) drop_script_pending();
  restore_null_stdin();
  mb_outputs_settle();
}

/* Also `__mb_run -r ...` (spawn_builtin.c): a command that disables
 * __mb_rep (`builtin enable -d`) must not cost the session its reports. */
int mb_rep_builtin(WORD_LIST *list) {
  if (list && !list->next && strcmp(list->word->word, "-h") == 0) return hello();
  char *args[4];
  for (int i = 0; i < 4; i++) {
    if (!list) {
      builtin_usage();
      return EX_USAGE;
    }
    args[i] = list->word->word;
    list = list->next;
  }
  /* only where the runtime's shapes report: see the top of this file */
  int exiting = strcmp(args[2], "exit") == 0;
  /* (in a fork of the shell status_fd is -1: forked_child) */
  if (status_fd < 0 || !said_hello || exiting_reported) return REFUSED;
  if (exiting ? running_trap != 1 : (sourcelevel != 0 || running_trap != 0)) return REFUSED;
  /* The runtime sends the next command only once it has this record: bytes
   * already waiting on the control pipe were put there by the command (it
   * can write on the FIFO's writer this module holds, or reopen bash's
   * script fd through /proc/self/fd) to run at the top level, where a
   * report is allowed. They are dropped before bash reads any of them, and
   * the record is written all the same: the command did end here. (Before,
   * the record was refused too, so a command that wrote on every fd it
   * could reach left exec waiting for its timeout, or for ever.) */
  /* Once the runtime sends no more lines (mb_messages_only) this, stdin's
   * /dev/null and the outputs' closes come after the record, while the
   * runtime reads it (issue #32: 4 system calls off the way from one
   * command to the next); bash reads no line before this builtin returns. */
  int after = mb_messages_only;
  if (!exiting && !after) drop_script_pending();
  char next[NONCE_HEX + 1];
  if (new_nonce(next) < 0) {
    settle(exiting, after);
    return REFUSED;
  }
  keep_protocol_names();
  int changed = report_env(args[3]);
  /* after a failed rewrite the file may hold anything: say it changed, so
   * the runtime reads it rather than trusting its copy (and the next report
   * tries again) */
  char flag = changed == 0 ? '-' : 'e';
  const char *pwd = get_string_value("PWD");
  if (!pwd) pwd = "";
  size_t len = strlen(args[0]) + strlen(args[1]) + strlen(args[2]) + strlen(pwd) + 2 * NONCE_HEX + 16;
  char *record = malloc(len);
  if (!record) {
    settle(exiting, after);
    return REFUSED;
  }
  /* k: the outputs the command came with were in no other process (it made
   * none): the runtime may send the same pipes with the next command */
  const char *keep = !exiting && mb_outputs_private() ? "k" : "";
  int n = snprintf(record, len, "\n%s %s %s %c%s %s %s", args[0], args[1], args[2], flag, keep, nonce, next);
  record[n++] = 0;
  size_t pwd_len = strlen(pwd) + 1;
  memcpy(record + n, pwd, pwd_len);
  int rc = write_all(status_fd, record, (size_t)n + pwd_len);
  free(record);
  settle(exiting, after);
  /* the runtime now expects next (a record it failed to get leaves the
   * session waiting, as a dead shell would: its timeout ends it) */
  memcpy(nonce, next, sizeof nonce);
  if (exiting) exiting_reported = 1;
  return rc < 0 ? REFUSED : EXECUTION_SUCCESS;
}

/* On load (in the start-up script, before any command of the session):
 * take the status pipe off fd 1, draw the first nonce, guard the forks. */
int __mb_rep_builtin_load(char *name) {
  (void)name;
  if (strcmp(dist_version, DISTVERSION) != 0) return 0;
  if (status_fd >= 0) return 1; /* loaded again: keep what we have */
  if (new_nonce(nonce) < 0) return 0;
  /* above the fds commands use, below a low RLIMIT_NOFILE (bash keeps its
   * script's fd at the top) */
  int lowest = lowest_private_fd();
  int fd = fcntl(1, F_DUPFD_CLOEXEC, lowest);
  if (fd < 0) return 0;
  int null = open("/dev/null", O_WRONLY | O_CLOEXEC);
  if (null < 0 || dup2(null, 1) < 0) {
    if (null >= 0) close(null);
    close(fd);
    return 0;
  }
  close(null);
  if (pthread_atfork(NULL, NULL, forked_child) != 0) {
    dup2(fd, 1);
    close(fd);
    return 0;
  }
  status_fd = fd;
  /* The control FIFO (lua/moonbox/session/shell.lua) came as fd 60,
   * read-write: bash reads its script through /dev/fd/60, and this copy is
   * the writer that keeps bash from ever reading EOF there, so the runtime
   * needs no fd of its own between commands (it opens the FIFO per
   * command). Off fd 60, close-on-exec, closed in forks: no command
   * inherits it. */
  if (fcntl(60, F_GETFD) >= 0) {
    control_fd = fcntl(60, F_DUPFD_CLOEXEC, lowest);
    if (control_fd >= 0) close(60);
  }
  prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
  return 1;
}

static char *mb_rep_doc[] = {
  "Report a command's end to the moonbox runtime.",
  "",
  "Writes the status record on the status pipe, and the exported",
  "environment to ENVFILE when it changed; -h writes the hello.",
  NULL,
};

struct builtin __mb_rep_struct = {
  "__mb_rep", mb_rep_builtin, BUILTIN_ENABLED, mb_rep_doc, "__mb_rep ID STATUS KIND ENVFILE | -h", 0,
};
