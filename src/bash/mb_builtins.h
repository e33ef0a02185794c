/* The contract of the bash loadable (src/bash/, built into bash_spawn.so,
 * loaded by the session shells, apart from the core and src/private.h):
 * what its two files share, and the bash internals they use that the
 * installed headers (bash-builtins) do not declare. */
#ifndef MOONBOX_BASH_BUILTINS_H
#define MOONBOX_BASH_BUILTINS_H

#include <loadables.h>

/* spawn_builtin.c: __mb_run [-s] BODY [OUT ERR] (the direct shapes call it) */
int mb_run_builtin(WORD_LIST *list);

/* report_builtin.c: __mb_rep, reached as `__mb_run -r ARGS` too (spawn_builtin.c) */
int mb_rep_builtin(WORD_LIST *list);

/* report_builtin.c: the status channel (private, closed in forks), -1 before load */
int mb_status_fd(void);

/* line_builtin.c: `@`, the control line, enabled again after each report */
void mb_keep_line_enabled(void);
/* line_builtin.c: 1 once `@` alone ran: the runtime then sends messages on
 * the status socket only, never a line on the control FIFO again (its
 * Shell.looping, never unset either) */
extern int mb_messages_only;
/* line_builtin.c: the user's xtrace (`set -x`) while `@` evaluates a
 * shape's text with it off, so that only the command's own lines are
 * traced; __mb_run turns it on for the body and keeps what the body left
 * (-1: no shape is being evaluated) */
extern int mb_user_xtrace;

/* outputs.c: a command's stdout and stderr on fds 1 and 2 (-1 and errno if
 * one cannot be opened: 1 and 2 are closed again), closed after the body
 * (they stay closed between commands); settle is the report's check for a
 * body that skipped that. out and err "-": the two fds the runtime sent on
 * the status socket (received here, or already by `@`: take). take: those
 * fds and the byte sent with them (the shape, for `@` without a number). */
int mb_outputs_open(const char *out, const char *err);
int mb_outputs_take(int *shape);
/* outputs.c: wait for the runtime's next message (the `@` loop): its byte
 * (*shape) and, when it came with two fds, those on 1 and 2 as take puts
 * them (*with_outputs 1); -1 at EOF (errno 0) or on an error. */
int mb_outputs_next(int *shape, int *with_outputs);
void mb_outputs_restore(void);
/* outputs.c: the body that came in the command's message, NUL-terminated
 * (*len: its length, NULs in it included), or NULL; taken once. */
#define MB_INLINE_MAX 4096
const char *mb_outputs_inline_body(size_t *len);
void mb_outputs_settle(void);
/* outputs.c: the shell made a process (spawn_builtin.c's posix_spawn; its
 * forks are counted by themselves); private: 1 if this command's outputs
 * came on the socket and the shell made no process since the last call
 * (the report's `k`, asked once per report) */
void mb_outputs_spawned(void);
int mb_outputs_private(void);

/* bash internals (defined in bash itself) */
extern char *search_for_command(const char *, int);
extern int find_reserved_word(char *);
extern int source_builtin(WORD_LIST *);
extern int signal_is_trapped(int);
extern void ignore_signal(int);
extern void check_signals_and_traps(void); /* QUIT (a SIGINT, SIGTERM), then run_pending_traps */
extern int job_control;
extern int expand_aliases;
extern int restricted;
extern int echo_command_at_execute, verbose_flag, read_but_dont_execute; /* set -x, -v, -n */
extern int sourcelevel;            /* > 0 while a file is sourced (unwound on errors) */
extern int running_trap;           /* signal + 1 while a trap runs; 1 for EXIT */
extern int default_buffered_input; /* the fd bash reads its commands from */

#endif
