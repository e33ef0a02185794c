/* libmoonbox: embed the moonbox runtime in a C program.
 *
 *   moonbox *mb = moonbox_new(NULL);            // own loop
 *   int rc = moonbox_run_file(mb, "job.lua", argc, argv);
 *   if (rc) fprintf(stderr, "%s\n", moonbox_error(mb));
 *   moonbox_close(mb);
 *
 * With the caller's loop (moonbox_new(loop)), moonbox_run_* start the script
 * as a task and return at once; the caller drives uv_run() and can ask
 * moonbox_pending() whether tasks remain. moonbox_close() kills every
 * sandbox process the runtime started and closes its handles. */
#ifndef MOONBOX_H
#define MOONBOX_H

#include <uv.h>

/* MOONBOX_VERSION, "major.minor.patch": generated from the project version
 * (CMakeLists.txt), installed beside this header */
#include "moonbox_version.h"

#ifdef __cplusplus
extern "C" {
#endif

/* libmoonbox is built with -fvisibility=hidden: these functions are all it
 * exports */
#if defined(__GNUC__)
#define MOONBOX_API __attribute__((visibility("default")))
#else
#define MOONBOX_API
#endif

typedef struct moonbox moonbox;
struct lua_State;

MOONBOX_API moonbox *moonbox_new(uv_loop_t *loop);
/* Run a Lua file with argv as its `arg` table; 0 on success, 1 on error. */
MOONBOX_API int moonbox_run_file(moonbox *mb, const char *path, int argc, char **argv);
/* Run Lua source text; chunkname names it in tracebacks. */
MOONBOX_API int moonbox_run_string(moonbox *mb, const char *code, const char *chunkname);
/* Run Lua source text with arguments: `arg` is {[0] = arg0, argv...} and the
 * chunk gets argv as `...` (what `moonbox -e CODE args` and `moonbox -` do). */
MOONBOX_API int moonbox_run_string_args(moonbox *mb, const char *code, const char *chunkname, const char *arg0,
                                        int argc, char **argv);
/* Use the policy in this Lua file (or module name) for every sandbox that
 * is not given one; 0 on success, 1 on error (see moonbox_error). */
MOONBOX_API int moonbox_set_policy(moonbox *mb, const char *policy);
/* Number of tasks still running (useful with a caller-owned loop). */
MOONBOX_API int moonbox_pending(moonbox *mb);
/* The last error message with its traceback, or NULL. */
MOONBOX_API const char *moonbox_error(moonbox *mb);
MOONBOX_API uv_loop_t *moonbox_loop(moonbox *mb);
MOONBOX_API struct lua_State *moonbox_lua(moonbox *mb);
MOONBOX_API void moonbox_close(moonbox *mb);
MOONBOX_API const char *moonbox_version(void);

#ifdef __cplusplus
}
#endif
#endif
