/* __mb_run: a bash loadable builtin that runs a session's simple external
 * command with posix_spawn instead of bash's fork.
 *
 * bash runs every external command in a fork of itself, which copies its
 * page tables and write-protects its heap; on this kind of VM that is about
 * 0.15 ms of the 0.8 ms an exec("/bin/true") takes. posix_spawn (vfork and
 * exec) shares the address space until exec and copies nothing.
 *
 *   __mb_run BODY [OUT ERR]
 *   __mb_run -s BODY [OUT ERR]   (only source it, as below)
 *
 * With OUT and ERR the body's stdout and stderr are those files, opened
 * here instead of by bash's redirection (outputs.c).
 *
 * The runtime sends this shape only for a body it has checked is one line
 * of plain words (no quoting, expansion, redirection or operator), so its
 * words are what bash would make of it: the body split at blanks. BODY is a
 * regular file (a memfd or a file of the run directory), read here and, if
 * need be, sourced after. Here the shell's own state decides the
 * rest: if the first word is a reserved word, alias, function or builtin,
 * is not found, or cannot be spawned, or the shell is restricted, has job
 * control on, traces commands (set -x, -v, -n) or has a CHLD, DEBUG, ERR or
 * RETURN trap, the builtin does what `builtin . BODY` does instead (bash's
 * own source_builtin), so the command runs as it always did.
 *
 * What bash's forked child would do before exec is done here too: the
 * environment is bash's export environment with `_` set to the command's
 * path, the PATH lookup goes through (and fills) bash's hash table, signals
 * the shell handles start at their defaults (glibc's posix_spawn resets
 * every handled signal; ignored ones stay ignored), the signal mask is the
 * shell's, fds, cwd, umask and rlimits are the shell's. A command killed by
 * a signal is reported on stderr as bash reports a foreground job's death.
 *
 * The builtin refuses to load into any bash but the one its headers came
 * from (struct layouts and function signatures are bash-internal).
 */
#include <loadables.h>

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "alias.h"
#include "execute_cmd.h"
#include "mb_builtins.h"
#include "version.h"
#include "y.tab.h"

/* bash's own, not in its installed headers (parse.y, flags.c, trap.c) */
extern int current_token;
extern int function_trace_mode;
extern void run_return_trap(void);

#define CMDSRCH_HASH 0x01
/* bash's pseudo-signals for its DEBUG, ERR and RETURN traps (trap.h) */
#define DEBUG_TRAP NSIG
#define ERROR_TRAP (NSIG + 1)
#define RETURN_TRAP (NSIG + 2)
#define MAX_BODY_BYTES 4096
#define MAX_WORDS 256

/* buf's words (split at blanks), -1 if there are too many. */
static int split_words(char *buf, char **argv) {
  int argc = 0;
  for (char *save = NULL, *w = strtok_r(buf, " \t\n", &save); w; w = strtok_r(NULL, " \t\n", &save)) {
    if (argc == MAX_WORDS) return -1;
    argv[argc++] = w;
  }
  argv[argc] = NULL;
  return argc;
}

/* The whole of the body's file, malloc'd, when it is one source_text
 * takes (at most MAX_SOURCE_BYTES); NULL otherwise, or on any failure:
 * bash's own source then reads it. */
#define MAX_SOURCE_BYTES (1 << 20)
static char *read_body_text(const char *path, size_t *len) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return NULL;
  struct stat st;
  char *text = NULL;
  if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size <= MAX_SOURCE_BYTES)
    text = malloc((size_t)st.st_size + 1);
  size_t got = 0;
  while (text) {
    ssize_t n = read(fd, text + got, (size_t)st.st_size + 1 - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 || (n > 0 && got + (size_t)n > (size_t)st.st_size)) { /* (an error, or it grew) */
      free(text);
      text = NULL;
    } else if (n == 0) {
      text[got] = 0;
      *len = got;
      break;
    } else {
      got += (size_t)n;
    }
  }
  close(fd);
  return text;
}

/* The command's file, if this is a command bash would fork and exec
 * (NULL otherwise). Malloc'd. */
static char *external_command(char *name) {
  if (restricted || job_control) return NULL;
  /* what would trace, trap or skip the commands of a sourced body: a CHLD
   * trap runs when bash reaps the child, DEBUG before it, ERR after it
   * fails, RETURN when the body ends; set -x and -v print it, -n skips it */
  if (echo_command_at_execute || verbose_flag || read_but_dont_execute) return NULL;
  if (signal_is_trapped(SIGCHLD) || signal_is_trapped(DEBUG_TRAP) || signal_is_trapped(ERROR_TRAP) ||
      signal_is_trapped(RETURN_TRAP))
    return NULL;
  if (find_reserved_word(name) >= 0) return NULL;
  if (expand_aliases && find_alias(name)) return NULL;
  if (find_function(name) || find_shell_builtin(name)) return NULL;
  char *path = strchr(name, '/') ? savestring(name) : search_for_command(name, CMDSRCH_HASH);
  if (!path) return NULL;
  struct stat st;
  if (stat(path, &st) < 0 || !S_ISREG(st.st_mode) || access(path, X_OK) < 0) {
    xfree(path); /* bash's allocation */
    return NULL;
  }
  return path;
}

/* bash's export environment, with `_` naming the command (as bash's child
 * sets it). *underscore is that entry, malloc'd. */
static char **command_env(const char *path, char **underscore) {
  maybe_make_export_env();
  char **src = export_env ? export_env : environ;
  size_t n = 0;
  while (src[n]) n++;
  char **env = malloc((n + 2) * sizeof *env);
  if (!env) return NULL;
  size_t k = 0;
  for (size_t i = 0; i < n; i++)
    if (strncmp(src[i], "_=", 2) != 0) env[k++] = src[i];
  size_t len = strlen(path) + 3;
  if (!(*underscore = malloc(len))) {
    free(env);
    return NULL;
  }
  snprintf(*underscore, len, "_=%s", path);
  env[k++] = *underscore;
  env[k] = NULL;
  return env;
}

/* What bash prints when a foreground command dies of a signal in a
 * non-interactive shell (jobs.c, notify_of_job_status, as Debian builds it
 * with DONT_REPORT_SIGPIPE and DONT_REPORT_SIGTERM): nothing for SIGINT and
 * SIGPIPE; the signal's name alone for SIGTERM and signals the shell traps;
 * else where, pid, what and the command. */
static void report_signal(const char *body, pid_t pid, int status, char **argv) {
  int sig = WTERMSIG(status);
  if (sig == SIGINT || sig == SIGPIPE) return;
  const char *what = strsignal(sig);
  const char *core = WCOREDUMP(status) ? " (core dumped)" : "";
  if (sig == SIGTERM || signal_is_trapped(sig)) {
    fprintf(stderr, "%s%s\n", what, core);
  } else {
    char desc[128];
    snprintf(desc, sizeof desc, "%s%s", what, core);
    (void)body;
    fprintf(stderr, "bash: line 1: %5ld %-22s  ", (long)pid, desc);
    for (int i = 0; argv[i]; i++) fprintf(stderr, "%s%s", i ? " " : "", argv[i]);
    fputc('\n', stderr);
  }
  fflush(stderr);
}

/* Spawn and wait. Returns the exit status (128 + signal for a signal), or
 * -1 if the command could not be spawned (nothing ran). */
static int spawn_and_wait(const char *body, char *path, char **argv) {
  char *underscore;
  char **env = command_env(path, &underscore);
  if (!env) return -1;
  /* SIGCHLD stays blocked until we have reaped our child: bash's handler
   * would otherwise reap it first, as a child it does not know */
  sigset_t chld, old;
  sigemptyset(&chld);
  sigaddset(&chld, SIGCHLD);
  sigprocmask(SIG_BLOCK, &chld, &old);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setsigmask(&attr, &old);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK);
  pid_t pid;
  int rc = posix_spawn(&pid, path, NULL, &attr, argv, env);
  mb_outputs_spawned(); /* (posix_spawn runs no fork handlers) */
  posix_spawnattr_destroy(&attr);
  int status = 0;
  if (rc == 0)
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
  sigprocmask(SIG_SETMASK, &old, NULL);
  free(underscore);
  free(env);
  if (rc != 0) return -1;
  if (WIFSIGNALED(status)) {
    report_signal(body, pid, status, argv);
    return 128 + WTERMSIG(status);
  }
  return WEXITSTATUS(status);
}

/* `builtin . BODY`, except that a `set -n` (noexec) in it ends with it: a
 * non-interactive bash would go on reading the session's control pipe
 * without running anything, the report included, and never answer again.
 * (An interactive bash ignores -n altogether.) */
static int source_body(char *body) {
  WORD_LIST *list = make_word_list(make_word(body), NULL);
  int rc = source_builtin(list);
  dispose_words(list);
  read_but_dont_execute = 0;
  return rc;
}

/* `builtin . BODY` with BODY's text already here (it came in the
 * command's message, outputs.c): bash's _evalfile for `source FILE` (no
 * arguments) without the open, fstat, read and close, 6-8 us on this VM
 * (issue #32). The same frame as bash makes for it: BASH_SOURCE (the body's
 * path: error messages name it, renamed `bash` below), BASH_LINENO,
 * FUNCNAME `source`, BASH_ARGV and BASH_ARGC, sourcelevel, a `return`
 * caught here, non-interactive, the RETURN trap after. A syntax error names
 * the input `-c`, as bash -c's does (a body sourced from its file gets its
 * path there). What source_builtin
 * does differently with a DEBUG trap (unset for the body), extdebug or NULs
 * in the text (dropped) is left to it: the body is sourced from its file,
 * which holds the same text. (A body read from its file, read_body_text,
 * goes the same way.) */
static int source_text(const char *text, size_t len, char *body) {
  if (strlen(text) != len || debugging_mode || (signal_is_trapped(DEBUG_TRAP) && function_trace_mode == 0)) return -1;
  if (len == 0) return EXECUTION_SUCCESS; /* (as _evalfile: nothing read) */
  SHELL_VAR *funcname_v, *source_v, *lineno_v, *argv_v, *argc_v;
  ARRAY *funcname_a, *source_a, *lineno_a, *argv_a, *argc_a;
  GET_ARRAY_FROM_VAR("FUNCNAME", funcname_v, funcname_a);
  GET_ARRAY_FROM_VAR("BASH_SOURCE", source_v, source_a);
  GET_ARRAY_FROM_VAR("BASH_LINENO", lineno_v, lineno_a);
  set_dollar_vars_unchanged();
  begin_unwind_frame("mb_source");
  unwind_protect_int(return_catch_flag);
  unwind_protect_jmp_buf(return_catch);
  unwind_protect_int(interactive);
  unwind_protect_int(sourcelevel);
  /* (its commands are traced as `bash -c`'s are, `+ cmd`, not one level
   * down for each eval and source the shape went through) */
  unwind_protect_int(indirection_level);
  indirection_level = 0;
  interactive = 0;
  return_catch_flag++;
  sourcelevel++;
  array_push(source_a, body);
  char *line = itos(executing_line_number());
  array_push(lineno_a, line);
  free(line);
  array_push(funcname_a, "source");
  struct func_array_state *fa = xmalloc(sizeof *fa);
  fa->source_a = source_a;
  fa->source_v = source_v;
  fa->lineno_a = lineno_a;
  fa->lineno_v = lineno_v;
  fa->funcname_a = funcname_a;
  fa->funcname_v = funcname_v;
  add_unwind_protect(restore_funcarray_state, fa);
  if (shell_compatibility_level <= 44) init_bash_argv();
  GET_ARRAY_FROM_VAR("BASH_ARGV", argv_v, argv_a);
  GET_ARRAY_FROM_VAR("BASH_ARGC", argc_v, argc_a);
  array_push(argv_a, body);
  array_push(argc_a, "1");
  add_unwind_protect(pop_args, 0);
  /* parse_and_execute frees its string */
  char *string = savestring(text);
  volatile int result;
  if (setjmp_nosigs(return_catch)) {
    /* `return` outside a function, in the body */
    parse_and_execute_cleanup(-1);
    result = return_catch_value;
  } else {
    /* (the parser names its input in a syntax error: `-c`, as bash -c
     * does, not the body's path) */
    result = parse_and_execute(string, "-c", SEVAL_RESETLINE | SEVAL_NOHIST);
  }
  run_unwind_frame("mb_source");
  if (current_token == yacc_EOF) push_token('\n');
  run_return_trap();
  read_but_dont_execute = 0; /* (as source_body) */
  return result;
}

static int run_body(char *body, const char *text, size_t text_len) {
  char buf[MAX_BODY_BYTES + 1];
  char *argv[MAX_WORDS + 1];
  int argc;
  /* (the body's text is here whenever its file could be read: a longer
   * one is not a command the runtime sends this way) */
  if (text && text_len <= MAX_BODY_BYTES && strlen(text) == text_len) {
    memcpy(buf, text, text_len + 1);
    argc = split_words(buf, argv);
  } else {
    argc = -1;
  }
  char *path = argc > 0 ? external_command(argv[0]) : NULL;
  if (path) {
    /* no body is being sourced: the timeout trap (SIGRTMIN+3) has nothing to
     * return from, and the command's death is the end of it */
    bind_variable("__mb_in", "", 0);
    int status = spawn_and_wait(body, path, argv);
    xfree(path); /* bash's allocation */
    if (status >= 0) return status;
    bind_variable("__mb_in", "1", 0);
  }
  int rc = text ? source_text(text, text_len, body) : -1;
  return rc >= 0 ? rc : source_body(body);
}

/* The interrupt's trap (a timeout: share/shell/prelude.bash) turned the
 * user's xtrace off to run untraced, and kept what $- was in __mb_xt:
 * whether to turn it on again. */
static int xtrace_after_interrupt(void) {
  SHELL_VAR *v = find_variable("__mb_xt");
  if (!v) return 0;
  int on = value_cell(v) && strchr(value_cell(v), 'x') != NULL;
  unbind_variable("__mb_xt");
  return on;
}

/* The DEBUG trap the interrupt set to leave a function's callers too
 * (__mb_dbg): gone with the body, whether or not bash saw a __mb_report
 * command take it away (the direct shapes report in C: line_builtin.c). */
static void end_interrupt_trap(void) {
  if (!find_variable("__mb_dbg")) return;
  unbind_variable("__mb_dbg");
  int echo = echo_command_at_execute;
  echo_command_at_execute = 0;
  /* (the trap runs before this command, sees no __mb_dbg and removes
   * itself; the command makes sure) */
  evalstring(savestring("builtin trap - DEBUG"), "__mb_run", SEVAL_NOHIST);
  echo_command_at_execute = echo;
}

int mb_run_builtin(WORD_LIST *list) {
  if (list && strcmp(list->word->word, "-r") == 0) return mb_rep_builtin(list->next);
  /* -q: a prelude of the runtime's (shapes 3, 4), sourced untraced */
  int quiet = list && strcmp(list->word->word, "-q") == 0;
  int source_only = quiet || (list && strcmp(list->word->word, "-s") == 0);
  if (source_only) list = list->next;
  int words = 0;
  for (WORD_LIST *w = list; w; w = w->next) words++;
  if (words != 1 && words != 3) {
    builtin_usage();
    return EX_USAGE;
  }
  char *body = list->word->word;
  /* BODY OUT ERR: the command's outputs on 1 and 2 for the body (outputs.c) */
  if (words == 3 && mb_outputs_open(list->next->word->word, list->next->next->word->word) < 0) {
    builtin_error("cannot open the command's output: %s", strerror(errno));
    return EXECUTION_FAILURE;
  }
  /* the body's text, if it came in this command's message (BODY - -) */
  size_t text_len = 0;
  const char *text = mb_outputs_inline_body(&text_len);
  if (words != 3 || strcmp(list->next->word->word, "-") != 0) text = NULL;
  /* A body not in the message (a session's first command, sent before
   * the shell's hello; one over 4096 bytes; a shell whose outputs are
   * files) is read here, so that it runs as one in the message does: a
   * syntax error names `-c`, never the runtime's file of it. */
  char *file_text = text ? NULL : read_body_text(body, &text_len);
  if (file_text) text = file_text;
  /* the body runs under the user's xtrace (a shape's text ran without it:
   * line_builtin.c), and what it left is the user's from then on. (Only
   * the shape's own call, at no source level: a command may call the
   * builtin too, and that call leaves the shape's state alone.) */
  int top = sourcelevel == 0;
  int traced = top && mb_user_xtrace >= 0 && !quiet;
  if (traced) echo_command_at_execute = mb_user_xtrace;
  int rc = -1;
  if (source_only && text) rc = source_text(text, text_len, body);
  if (rc < 0) rc = source_only ? source_body(body) : run_body(body, text, text_len);
  if (top) end_interrupt_trap();
  int resumed = top && xtrace_after_interrupt();
  if (traced) {
    mb_user_xtrace = echo_command_at_execute || resumed;
    echo_command_at_execute = 0;
  } else if (resumed) {
    echo_command_at_execute = 1;
  }
  free(file_text);
  /* (once the runtime sends messages only, the report closes them after
   * its record, off the way from one command to the next: issue #32) */
  if (words == 3 && !mb_messages_only) mb_outputs_restore();
  return rc;
}

/* Error messages name the shell, never the runtime's files. bash names
 * an error's source after BASH_SOURCE[0] (error.c, get_name_for_error):
 * the body's path (`/run/moonbox/sh-1/body`, `/proc/PID/fd/N`) while a
 * body runs, the same path for a function it defined, the prelude's for
 * the session's own functions. BASH_SOURCE is a dynamic variable: every
 * lookup goes through its value function, which here renames those paths
 * `bash`, as `bash -c` names itself (`bash: line 1: x: command not found`).
 * They are learnt from where they sit: one above the script bash runs
 * (the bottom entry), the depth every body and the prelude are sourced at.
 * A file a command sources keeps its name, as in any bash. */
#define MAX_INTERNAL 8
static char *internal_names[MAX_INTERNAL];
static int n_internal;
static sh_var_value_func_t *bash_source_value;

static int is_internal(const char *v) {
  for (int i = 0; i < n_internal; i++)
    if (strcmp(internal_names[i], v) == 0) return 1;
  return 0;
}

static int runtime_path(const char *v) {
  return strncmp(v, "/proc/", 6) == 0 || strncmp(v, "/dev/fd/", 8) == 0 || strstr(v, "/moonbox/") != NULL;
}

static SHELL_VAR *bash_source(SHELL_VAR *var) {
  if (bash_source_value) var = bash_source_value(var);
  if (!var || !array_p(var) || !array_cell(var)) return var;
  ARRAY *a = array_cell(var);
  arrayind_t n = array_num_elements(a);
  if (n < 2 || array_max_index(a) != n - 1) return var;
  char *at = array_reference(a, n - 2);
  if (at && n_internal < MAX_INTERNAL && runtime_path(at) && !is_internal(at)) {
    char *copy = strdup(at);
    if (copy) internal_names[n_internal++] = copy;
  }
  for (arrayind_t i = 0; i < n - 1; i++) {
    char *v = array_reference(a, i);
    if (v && is_internal(v)) array_insert(a, i, "bash");
  }
  return var;
}

/* Only into the bash version these headers describe. */
int __mb_run_builtin_load(char *name) {
  (void)name;
  if (strcmp(dist_version, DISTVERSION) != 0) return 0;
  SHELL_VAR *v = find_variable("BASH_SOURCE");
  if (v && v->dynamic_value != bash_source) {
    bash_source_value = v->dynamic_value;
    v->dynamic_value = bash_source;
  }
  /* a command killed by SIGKILL (a timeout, the OOM killer, kill -9) is
   * noted as a terminal's shell notes it, `Killed`, not with the line,
   * pid and command a script's shell adds (jobs.c prints the short form
   * for a signal the shell traps; SIGKILL cannot really be caught) */
  ignore_signal(SIGKILL);
  return 1;
}

static char *mb_run_doc[] = {
  "Run a session's simple external command without forking the shell.",
  "",
  "Splits BODY, a plain command line, at blanks; runs the words with",
  "posix_spawn when the first names an external command, else sources BODY.",
  "With -s, only sources BODY. A set -n in BODY ends with it. With OUT",
  "and ERR, BODY's stdout and stderr are those files.",
  "With -r, reports as __mb_rep does.",
  NULL,
};

struct builtin __mb_run_struct = {
  "__mb_run", mb_run_builtin, BUILTIN_ENABLED, mb_run_doc, "__mb_run [-s] BODY [OUT ERR] | -r ID STATUS KIND ENVFILE",
  0,
};
