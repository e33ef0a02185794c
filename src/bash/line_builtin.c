/* @: the session shell's control line (`@ N`), a bash loadable builtin
 * loaded with __mb_run and __mb_rep.
 *
 *   @ N      (N = 1..6: run the command shape __mb_cN, as `eval "$__mb_cN"`)
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

#include <string.h>

#include "mb_builtins.h"
#include "version.h"

#define REFUSED 3

static int line_builtin(WORD_LIST *list) {
  if (!list || list->next || strlen(list->word->word) != 1 || list->word->word[0] < '1' || list->word->word[0] > '6') {
    builtin_usage();
    return EX_USAGE;
  }
  if (sourcelevel != 0 || running_trap != 0 || variable_context != 0 || parse_and_execute_level != 0) return REFUSED;
  char name[] = "__mb_cN";
  name[6] = list->word->word[0];
  SHELL_VAR *shape = find_variable(name);
  if (!shape || !readonly_p(shape) || invisible_p(shape) || array_p(shape) || assoc_p(shape) || !value_cell(shape))
    return REFUSED;
  /* as eval_builtin: evalstring frees its copy */
  return evalstring(savestring(value_cell(shape)), "eval", SEVAL_NOHIST);
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
  "",
  "Evaluates the readonly variable __mb_cN, as eval would; only at the top",
  "level, where the session's control line runs.",
  NULL,
};

struct builtin __struct = {
  "@", line_builtin, BUILTIN_ENABLED, line_doc, "@ N", 0,
};
