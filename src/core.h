/* Internal helpers shared by the moonbox.core families.
 *
 * Conventions (after luv): a uv handle lives in C memory (mb_handle); the Lua
 * userdata only points at it. While a handle is open it is anchored in the
 * registry, so libuv can always call back into a live object; close() drops
 * the anchor in the close callback. OS failures return nil, message, CODE;
 * misuse raises. Callbacks run on the core's own callback thread through
 * mb_call, which adds a traceback and hands errors to a Lua error handler
 * instead of printing from deep inside C. */
#ifndef MOONBOX_CORE_H
#define MOONBOX_CORE_H

#include <lua.h>
#include <lauxlib.h>
#include <uv.h>

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
  } uv;
  mb_core *core;
  const char *type_name;       /* metatable name, for error messages */
  int self_ref;                /* registry anchor while open */
  int cb_ref[MB_MAX_CALLBACKS];
  int closing;
  void *extra;                 /* family-specific state */
  struct mb_handle *next, *prev; /* the core's list of open handles */
} mb_handle;

struct mb_core {
  uv_loop_t *loop;
  int own_loop;
  lua_State *cbL;              /* thread all callbacks run on */
  int cbL_ref;
  int error_handler_ref;
  int open_handles;            /* handles created by us and not yet closed */
  mb_handle *handles;          /* list of those handles, for teardown */
  int dead;                    /* the Lua state is being closed */
  void *spawn_state;           /* owned by spawn.c */
  char *read_buf;              /* shared by every stream's reads (stream.c) */
};

mb_core *mb_core_get(lua_State *L);

/* Push nil, "CODE: message[ (detail)]", "CODE"; returns 3. */
int mb_push_error(lua_State *L, int uv_err, const char *detail);
/* Same for a plain errno value. */
int mb_push_errno(lua_State *L, int errnum, const char *detail);

/* Handles. */
mb_handle *mb_handle_new(lua_State *L, const char *type_name, size_t extra_size);
mb_handle *mb_handle_check(lua_State *L, int idx, const char *type_name);
void mb_handle_set_cb(lua_State *L, mb_handle *h, int slot, int idx);
void mb_handle_unset_cb(lua_State *L, mb_handle *h, int slot);
/* Push the callback in slot onto cbL; returns cbL or NULL if none is set. */
lua_State *mb_handle_push_cb(mb_handle *h, int slot);
/* Close the handle (idempotent); optional Lua callback at stack idx (0: none). */
void mb_handle_close(lua_State *L, mb_handle *h, int cb_idx);
/* Methods every handle type gets: close, is_closing, is_active, ref, unref, fileno. */
void mb_handle_methods(lua_State *L);
/* Create a metatable for a handle type with the given methods (+ common ones). */
void mb_new_class(lua_State *L, const char *type_name, const luaL_Reg *methods);

/* Call the function on cbL below nargs arguments in protected mode with a
 * traceback; on error hand the message to the Lua error handler. */
void mb_call(mb_core *core, lua_State *cbL, int nargs);

/* Parse an optional integer field from the table at idx. */
lua_Integer mb_opt_intfield(lua_State *L, int idx, const char *key, lua_Integer def);

/* Family registration: each adds its functions to the module table on top. */
/* the directory of the shared object the core is linked into (dladdr) */
int mb_self_dir(char *out, size_t size);

void mb_open_timer(lua_State *L);
void mb_open_signal(lua_State *L);
void mb_open_stream(lua_State *L);
void mb_open_fs(lua_State *L);
/* fs_tree.c: registered with the fs family (fs.c). */
int mb_fs_remove_tree(lua_State *L);
int mb_fs_lock(lua_State *L);
/* userns.c: core.userns_probe. */
void mb_open_userns(lua_State *L);
void mb_open_spawn(lua_State *L);
void mb_open_pty(lua_State *L);
void mb_open_sys(lua_State *L);
void mb_open_codec(lua_State *L);
void mb_open_magic(lua_State *L);
void mb_open_fsevent(lua_State *L);
/* The content of a core.bytes buffer at idx (codec.c); 0 if it is not one. */
int mb_bytes_view(lua_State *L, int idx, const char **data, size_t *len);
void mb_open_tcp(lua_State *L);
/* Open rel (O_PATH) under the root at idx: a confinement (core.fs_confine)
 * or a directory fd; -1 with errno on failure (fs.c). */
int mb_fs_root_open_path(lua_State *L, int idx, const char *rel);
/* A confinement's rules for another family (fs_tree.c); see fs.c. */
void *mb_fs_confine_rules(lua_State *L, int idx, int *root, unsigned long long *resolve, const char **resolve_name,
                          int *has_creds, unsigned *uid, unsigned *gid);
int mb_fs_rules_check(const void *rules, int fd);
void mb_open_seccomp(lua_State *L);
void mb_open_nsinit(lua_State *L);
void mb_open_http(lua_State *L);
struct sock_fprog;
const struct sock_fprog *mb_seccomp_check(lua_State *L, int idx);

int mb_check_signal(lua_State *L, int idx);

/* Stream objects are created by spawn/pty/stream families from an fd. */
int mb_stream_push_fd(lua_State *L, int fd, int is_pty);

/* Close spawn bookkeeping at core teardown. */
void mb_spawn_teardown(mb_core *core);
/* Destroy every HTTP server's lws context at core teardown (http.c). */
void mb_http_teardown(mb_core *core);

#endif
