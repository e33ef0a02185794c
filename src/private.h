/* The contract between the files of the C core (moonbox.core): every
 * function one file of src/ calls in another is declared here, once, beside
 * the name of the file that defines it. No .c file declares another's
 * function (or an extern) itself. Nothing here is exported from libmoonbox
 * or core.so: they are built with -fvisibility=hidden (src/moonbox.h is the
 * library's API, luaopen_moonbox_core the Lua module's).
 *
 * The layers, each calling only those above it (no circle):
 *   core.c      the loop, handles, callbacks, errors: the plumbing;
 *   <family>.c  one primitive family each (timer, fs, spawn, ...), built on
 *               core.c and, in a few named cases below, on another family;
 *   module.c    luaopen_moonbox_core: creates the core and calls every
 *               family's mb_open_* (the registration list) and teardown.
 * The code that runs in a child between clone and exec (child/) and the
 * sandbox init (nsinit.c) see only child/child.h, child/wire.h, nsinit.h.
 * openat2.h (openat2.c) is the one confined path resolution, for fs.c,
 * fs_tree.c, image_unpack.c and nsinit.c.
 *
 * Conventions (after luv): a uv handle lives in C memory (mb_handle); the Lua
 * userdata only points at it. While a handle is open it is anchored in the
 * registry, so libuv can always call back into a live object; close() drops
 * the anchor in the close callback. OS failures return nil, message, CODE;
 * misuse raises. Callbacks run on the core's own callback thread through
 * mb_call, which adds a traceback and hands errors to a Lua error handler
 * instead of printing from deep inside C. */
#ifndef MOONBOX_PRIVATE_H
#define MOONBOX_PRIVATE_H

#include <lua.h>
#include <lauxlib.h>
#include <uv.h>
#include <sys/types.h>

#include "child/child.h"

#define MB_MAX_CALLBACKS 3

typedef struct mb_core mb_core;

typedef struct mb_handle {
  union {
    uv_handle_t handle;
    uv_stream_t stream;
    uv_timer_t timer;
    uv_signal_t signal;
    uv_pipe_t pipe;
    uv_poll_t poll;
    uv_fs_event_t fs_event;
    uv_udp_t udp;
  } uv;
  mb_core *core;
  const char *type_name; /* metatable name, for error messages */
  int self_ref;          /* registry anchor while open */
  int cb_ref[MB_MAX_CALLBACKS];
  int closing;
  void *extra;                   /* family-specific state */
  struct mb_handle *next, *prev; /* the core's list of open handles */
} mb_handle;

struct mb_core {
  uv_loop_t *loop;
  int own_loop;
  lua_State *cbL; /* thread all callbacks run on */
  int cbL_ref;
  int error_handler_ref;
  int open_handles;                /* handles created by us and not yet closed */
  mb_handle *handles;              /* list of those handles, for teardown */
  int dead;                        /* the Lua state is being closed */
  void *spawn_state;               /* owned by spawn.c */
  char *read_buf;                  /* shared by every stream's reads (stream.c) */
  void *close_later;               /* close_later.c: fds closed at the end of the loop's turn */
  void (*teardown)(mb_core *core); /* the families' teardown (module.c), before the handles close */
};

/* ---- core.c: the plumbing ---------------------------------------------- */

/* Create the core for this Lua state (once; later calls find it): its loop
 * (the host's, set as light userdata "moonbox.loop" in the registry, else
 * its own) and its callback thread. teardown runs first when the Lua state
 * closes, before the core closes the handles still open. */
mb_core *mb_core_open(lua_State *L, void (*teardown)(mb_core *core));
mb_core *mb_core_get(lua_State *L);
/* The loop functions (run, stop, now, ...) into the module table on top. */
void mb_open_loop(lua_State *L);

/* Push nil, "CODE: message[ (detail)]", "CODE"; returns 3. */
int mb_push_error(lua_State *L, int uv_err, const char *detail);
/* Same for a plain errno value. */
int mb_push_errno(lua_State *L, int errnum, const char *detail);

/* src/owner.c: this thread's effective uid is owner (0: unchanged) until
 * mb_owner_leave, so what it makes is charged to owner's kernel counters */
int mb_owner_enter(uid_t owner);
void mb_owner_leave(uid_t owner);

/* Handles. */
mb_handle *mb_handle_new(lua_State *L, const char *type_name, size_t extra_size);
mb_handle *mb_handle_check(lua_State *L, int idx, const char *type_name);
void mb_handle_set_cb(lua_State *L, mb_handle *h, int slot, int idx);
void mb_handle_unset_cb(lua_State *L, mb_handle *h, int slot);
/* Push the callback in slot onto cbL; returns cbL or NULL if none is set. */
lua_State *mb_handle_push_cb(mb_handle *h, int slot);
/* Close the handle (idempotent); optional Lua callback at stack idx (0: none). */
void mb_handle_close(lua_State *L, mb_handle *h, int cb_idx);
/* Create a metatable for a handle type with the given methods (+ the ones
 * every handle gets: close, is_closing, is_active, ref, unref, fileno). */
void mb_new_class(lua_State *L, const char *type_name, const luaL_Reg *methods);

/* Call the function on cbL below nargs arguments in protected mode with a
 * traceback; on error hand the message to the Lua error handler. */
void mb_call(mb_core *core, lua_State *cbL, int nargs);

/* Parse an optional integer field from the table at idx. */
lua_Integer mb_opt_intfield(lua_State *L, int idx, const char *key, lua_Integer def);

/* The directory of the shared object the core is linked into (dladdr). */
int mb_self_dir(char *out, size_t size);

/* ---- module.c: the Lua module --------------------------------------------- */

/* Creates the core and the module table (core.version, the families). Only
 * moonbox/core.so exports it (built with MOONBOX_EXPORT_LUAOPEN); libmoonbox
 * puts it in package.preload (runtime.c). */
int luaopen_moonbox_core(lua_State *L);

/* ---- the families: registration (called by module.c only) --------------- */
/* Each adds its functions to the module table on top of the stack. */

void mb_open_timer(lua_State *L);       /* timer.c */
void mb_open_signal(lua_State *L);      /* signal.c */
void mb_open_stream(lua_State *L);      /* stream.c */
void mb_open_close_later(lua_State *L); /* close_later.c */
void mb_open_fs(lua_State *L);          /* fs.c */
void mb_open_fs_tree(lua_State *L);     /* fs_tree.c: fs_remove_tree, fs_lock */
void mb_open_userns(lua_State *L);      /* userns.c: userns_probe */
void mb_open_spawn(lua_State *L);       /* spawn.c */
void mb_open_pty(lua_State *L);         /* pty.c */
void mb_open_sys(lua_State *L);         /* sys.c */
void mb_open_codec(lua_State *L);       /* codec.c */
void mb_open_magic(lua_State *L);       /* magic.c */
void mb_open_image(lua_State *L);       /* image_unpack.c: image layers, blob digests */
void mb_open_image_pack(lua_State *L);  /* image_pack.c: an upper dir as a layer (commit) */
void mb_open_fsevent(lua_State *L);     /* fsevent.c */
void mb_open_loopmount(lua_State *L);   /* loopmount.c: loop_mount, umount (the disk quota) */
void mb_open_tcp(lua_State *L);         /* tcp.c */
void mb_open_udp(lua_State *L);         /* udp.c */
void mb_open_seccomp(lua_State *L);     /* seccomp.c */
void mb_open_nsinit(lua_State *L);      /* nsinit_host.c */
void mb_open_http(lua_State *L);        /* http/lua.c */

/* Teardown at core teardown (module.c's list). */
void mb_spawn_teardown(mb_core *core);       /* spawn.c: SIGCHLD watcher, tracked children */
void mb_http_teardown(mb_core *core);        /* http/lua.c: every HTTP server's sockets */
void mb_close_later_teardown(mb_core *core); /* close_later.c: the queued fds closed */

/* ---- what one family offers another --------------------------------------- */

/* codec.c: the content of a core.bytes buffer at idx; 0 if it is not one (magic.c). */
int mb_bytes_view(lua_State *L, int idx, const char **data, size_t *len);
/* codec_pure.c (base64, UTF-8 and text scans on byte ranges) is declared in
 * codec_pure.h instead: it needs no Lua or libuv, and spec/fuzz/ links it alone. */

/* id_map.c: NULL when text (len bytes) is an id map the kernel can take
 * (lines of "inside outside count"), else why not ("is empty", ...). */
const char *mb_id_map_check(const char *text, size_t len);

/* fs.c: open rel (O_PATH) under the root at idx: a confinement
 * (core.fs_confine) or a directory fd; -1 with errno on failure (fsevent.c). */
int mb_fs_root_open_path(lua_State *L, int idx, const char *rel);
/* fs.c: a confinement's rules, for fs_tree.c. */
void *mb_fs_confine_rules(lua_State *L, int idx, int *root, unsigned long long *resolve, const char **resolve_name,
                          int *has_creds, unsigned *uid, unsigned *gid);
int mb_fs_rules_check(const void *rules, int fd);

/* seccomp.c: the compiled filter of a core.seccomp object (spawn.c). */
struct sock_fprog;
const struct sock_fprog *mb_seccomp_check(lua_State *L, int idx);

/* signal.c: a signal number or name at idx (spawn.c, nsinit_host.c). */
int mb_check_signal(lua_State *L, int idx);

/* stream.c: a stream object from an fd (spawn.c). */
int mb_stream_push_fd(lua_State *L, int fd, int is_pty);

/* spawn.c and nsinit_host.c are one family in two files: spawn.c starts a
 * child inside a sandbox through nsinit_host.c, which reports the children
 * its init started back to spawn.c's process objects. */
/* nsinit_host.c: start plan inside the sandbox init at idx. */
int mb_nsinit_spawn(lua_State *L, int idx, const mb_child_plan *plan, pid_t *host_pid, pid_t *inside_pid,
                    mb_child_report *fail);
/* spawn.c: a process object for pid, tracked until exit (pushed). */
int mb_spawn_track(lua_State *L, mb_core *core, pid_t pid, int exit_cb_idx);
/* spawn.c: pid exited with status: call its exit callback. */
int mb_spawn_deliver(mb_core *core, pid_t pid, int status);

/* zygote.c: the thread sandbox inits are cloned from (nsinit_host.c), in a
 * mount namespace rooted at an empty tmpfs. available: 1 once it runs (it
 * starts on the first call), 0 where it cannot (not root, MOONBOX_ZYGOTE=0).
 * run: fn(arg) on that thread, waited for; 0, or why it cannot run. */
int mb_zygote_available(void);
int mb_zygote_run(void (*fn)(void *), void *arg);

#endif
