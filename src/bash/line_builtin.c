/* @: the session shell's control line (`@ N`), a bash loadable builtin
 * loaded with __mb_run and __mb_rep.
 *
 *   @ N      (N = 1..6: run the command shape __mb_cN, as `eval "$__mb_cN"`)
 *   @        (the shape N is the byte the runtime sent with the command's
 *             outputs on the status socket: a 2-byte line)
 *
 * bash reads its script from the control FIFO one byte per read(2), so each
 * byte of the line the runtime sends per command is a system call of the
 * shell's: `eval "$__mb_c1"` was 16, `@ 1` is 4 (issue #32). The shape
 * itself is still the readonly variable the start-up script defined; this
 * only evaluates it, as eval would (bash's evalstring, at the top level).
 * Not a shell function: a function's body runs in a scope of its own, so
 * `declare X=1` or `local` in a command would make a local that ends with
 * it, and a command's `return` could leave the shape before its report.
 *
 * Only at the top level, where the runtime's line runs: a body (sourced), a
 * function or a trap calling `@ 1` gets status 3 and nothing runs (a body
 * running its own shape would source itself again, without end). The name
 * is kept usable by the report (report_builtin.c, keep_protocol_names):
 * an alias or function `@` goes, a disabled `@` is enabled again.
 * Named `@`, not a word: no script names a function or alias so, where
 * `_` (a common helper name) would have been taken from the user at each
 * report.
 */
#include <loadables.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mb_builtins.h"
#include "version.h"

#define REFUSED 3

int mb_messages_only;
int mb_user_xtrace = -1;

/* A readonly scalar of the start-up script's */
static int protocol_var(SHELL_VAR *v) {
  return v && readonly_p(v) && !invisible_p(v) && !array_p(v) && !assoc_p(v) && value_cell(v);
}

/* A shell whose outputs come on the status socket: __mb_fdo is "1". */
static int outputs_sent(void) {
  SHELL_VAR *fdo = find_variable("__mb_fdo");
  return protocol_var(fdo) && strcmp(value_cell(fdo), "1") == 0;
}

/* Shapes 1 and 5 in a shell whose outputs come on the status socket
 * (__mb_fdo), without evaluating their text:
 *   __mb_id=$((__mb_id+1)); __mb_in=1; builtin __mb_run [-s] BODY - -;
 *   __mb_report $__mb_id $? run
 * done in C, so bash parses, expands and calls none of it per command
 * (issue #32: the shell's user time). The report is the builtin itself,
 * called directly (never a function a command could shadow). -1: not such
 * a shell, or an __mb_id a command made something else than a plain
 * variable: the shape's text then runs as before. A body that leaves by a
 * longjmp (`exit`) leaves as it does from the text (the EXIT trap reports). */
static int direct_shape(int shape) {
  SHELL_VAR *body = find_variable("__mb_bp"), *env = find_variable("__mb_ep");
  if (!outputs_sent() || !protocol_var(body) || !protocol_var(env)) return -1;
  SHELL_VAR *idv = find_variable_noref("__mb_id");
  if (!idv || readonly_p(idv) || nameref_p(idv) || array_p(idv) || assoc_p(idv) || invisible_p(idv) || !value_cell(idv))
    return -1;
  char id[24], status[16];
  snprintf(id, sizeof id, "%ld", strtol(value_cell(idv), NULL, 10) + 1);
  if (!bind_variable("__mb_id", id, 0) || !bind_variable("__mb_in", "1", 0)) return -1;
  WORD_LIST *run = make_word_list(make_word("-"), NULL);
  run = make_word_list(make_word("-"), run);
  run = make_word_list(make_word(value_cell(body)), run);
  if (shape == 1) run = make_word_list(make_word("-s"), run);
  int rc = mb_run_builtin(run);
  dispose_words(run);
  snprintf(status, sizeof status, "%d", rc);
  bind_variable("__mb_in", "", 0);
  WORD_LIST *rep = make_word_list(make_word(value_cell(env)), NULL);
  rep = make_word_list(make_word("run"), rep);
  rep = make_word_list(make_word(status), rep);
  rep = make_word_list(make_word(id), rep);
  rc = mb_rep_builtin(rep);
  dispose_words(rep);
  return rc;
}

/* Run command shape N: 1 and 5 in C where they can be, else its text. */
static int run_shape(int shape) {
  if (shape == 1 || shape == 5) {
    int rc = direct_shape(shape);
    if (rc >= 0) return rc;
  }
  char name[] = "__mb_cN";
  name[6] = (char)('0' + shape);
  SHELL_VAR *var = find_variable(name);
  if (!var || !readonly_p(var) || invisible_p(var) || array_p(var) || assoc_p(var) || !value_cell(var)) {
    mb_outputs_settle();
    return REFUSED;
  }
  /* as eval_builtin: evalstring frees its copy. The shape's own words are
   * not traced under the user's `set -x` (__mb_id=..., the prelude's path,
   * __mb_report ...): __mb_run traces the body alone (mb_user_xtrace). */
  int outer = mb_user_xtrace;
  mb_user_xtrace = echo_command_at_execute;
  echo_command_at_execute = 0;
  int rc = evalstring(savestring(value_cell(var)), "eval", SEVAL_NOHIST);
  echo_command_at_execute = mb_user_xtrace;
  mb_user_xtrace = outer;
  return rc;
}

/* A shape sent with the outputs comes with them; a prelude's (3, 4) alone. */
static int valid_message(int shape, int with_outputs) {
  if (shape == 1 || shape == 2 || shape == 5 || shape == 6) return with_outputs;
  return (shape == 3 || shape == 4) && !with_outputs;
}

static int line_builtin(WORD_LIST *list) {
  if (list && (list->next || strlen(list->word->word) != 1 || list->word->word[0] < '1' || list->word->word[0] > '6')) {
    builtin_usage();
    return EX_USAGE;
  }
  if (sourcelevel != 0 || running_trap != 0 || variable_context != 0 || parse_and_execute_level != 0) return REFUSED;
  if (list) return run_shape(list->word->word[0] - '0');
  /* `@` alone: the shape is the byte sent with the command's outputs on
   * the status socket. No message waiting (a line a command wrote into the
   * control FIFO) runs nothing. */
  int shape;
  if (!outputs_sent() || mb_outputs_take(&shape) < 0) return REFUSED;
  mb_messages_only = 1;
  shape -= '0';
  if (!valid_message(shape, 1)) {
    mb_outputs_settle();
    return REFUSED;
  }
  int rc = run_shape(shape);
  /* Then every later command of the session, without a control line: the
   * shell waits for the runtime's next message on the status socket here,
   * at the top level still (each body is sourced and reported as before),
   * instead of going back to bash's reader for a line (issue #32: the
   * runtime's write of the line, bash's reads and parse of it). Only the
   * shell's end leaves (`exit`, a fatal error: a longjmp), or the runtime's
   * closing the socket. */
  int with_outputs;
  for (;;) {
    /* a SIGINT or SIGTERM bash caught, and the traps of signals that came
     * while the command ran, now, between commands, as bash checks them
     * when a builtin returns (the timeout's interrupt among them: left
     * pending it would end the next body) */
    check_signals_and_traps();
    if (mb_outputs_next(&shape, &with_outputs) < 0) break;
    /* and those of signals the runtime sent before this message (an
     * interrupt of the last command's timeout, repeated until its record
     * came: handled before the wait began, it is pending here), before the
     * body, where the interrupt would end it */
    check_signals_and_traps();
    shape -= '0';
    if (!valid_message(shape, with_outputs)) {
      mb_outputs_settle();
      continue;
    }
    rc = run_shape(shape);
  }
  return rc;
}

/* Enable `@` again if a command disabled it (`builtin enable -n @`): every
 * later control line calls it. (One deleted, `enable -d`, is gone: the
 * session then waits for its timeout, as with the report disabled.) */
void mb_keep_line_enabled(void) {
  for (int i = 0; i < num_shell_builtins; i++)
    if (shell_builtins[i].function == line_builtin) {
      shell_builtins[i].flags |= BUILTIN_ENABLED;
      return;
    }
}

/* Only into the bash version these headers describe. */
int __builtin_load(char *name) {
  (void)name;
  return strcmp(dist_version, DISTVERSION) == 0;
}

static char *line_doc[] = {
  "Run the session shell's command shape N (the control line).",
  "Without N, the shape is the one sent with the command's outputs.",
  "",
  "Evaluates the readonly variable __mb_cN, as eval would; only at the top",
  "level, where the session's control line runs.",
  NULL,
};

struct builtin __struct = {
  "@", line_builtin, BUILTIN_ENABLED, line_doc, "@ [N]", 0,
};
