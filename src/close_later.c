/* core.close_later(fd, ...): fds closed at the end of this turn of the
 * loop (a check handle, after its I/O callbacks), not now.
 *
 * A session shell's command ends with its record, read in an I/O callback
 * that resumes the caller, who usually sends the next command before the
 * callback returns. The last command's output pipes closed then, in the
 * check phase, cost nothing on the way from one command to the next: the
 * shell runs the new one on another CPU meanwhile (issue #32). An fd stays
 * allocated until then, so its number cannot be reused under the queue;
 * nothing else may close it. */
#include "private.h"

#include <stdlib.h>
#include <unistd.h>

typedef struct close_list {
  uv_check_t check;
  int *fds;
  int n, cap;
} close_list;

static void close_all(close_list *cl) {
  for (int i = 0; i < cl->n; i++) close(cl->fds[i]);
  cl->n = 0;
}

static void on_check(uv_check_t *check) {
  close_list *cl = (close_list *)check->data;
  close_all(cl);
  uv_check_stop(check);
}

static void on_list_closed(uv_handle_t *h) {
  close_list *cl = (close_list *)h->data;
  free(cl->fds);
  free(cl);
}

static close_list *list_of(lua_State *L, mb_core *core) {
  if (core->close_later) return (close_list *)core->close_later;
  close_list *cl = (close_list *)calloc(1, sizeof *cl);
  if (!cl) luaL_error(L, "out of memory");
  int rc = uv_check_init(core->loop, &cl->check);
  if (rc < 0) {
    free(cl);
    luaL_error(L, "cannot create a check handle: %s", uv_strerror(rc));
  }
  cl->check.data = cl;
  /* pending closes are no reason for the loop to go on */
  uv_unref((uv_handle_t *)&cl->check);
  core->close_later = cl;
  return cl;
}

/* core.close_later(fd, ...) -> true | nil, message, code */
static int core_close_later(lua_State *L) {
  int n = lua_gettop(L);
  for (int i = 1; i <= n; i++)
    if (luaL_checkinteger(L, i) < 0) return luaL_argerror(L, i, "expected an fd >= 0");
  close_list *cl = list_of(L, mb_core_get(L));
  if (cl->n + n > cl->cap) {
    int cap = cl->cap ? cl->cap * 2 : 16;
    while (cap < cl->n + n) cap *= 2;
    int *fds = (int *)realloc(cl->fds, sizeof(int) * (size_t)cap);
    if (!fds) {
      /* no room to queue them: closed now */
      for (int i = 1; i <= n; i++) close((int)lua_tointeger(L, i));
      lua_pushboolean(L, 1);
      return 1;
    }
    cl->fds = fds;
    cl->cap = cap;
  }
  for (int i = 1; i <= n; i++) cl->fds[cl->n++] = (int)lua_tointeger(L, i);
  int rc = uv_check_start(&cl->check, on_check);
  if (rc < 0) {
    close_all(cl);
    return mb_push_error(L, rc, "uv_check_start");
  }
  lua_pushboolean(L, 1);
  return 1;
}

void mb_close_later_teardown(mb_core *core) {
  close_list *cl = (close_list *)core->close_later;
  if (!cl) return;
  core->close_later = NULL;
  close_all(cl);
  uv_close((uv_handle_t *)&cl->check, on_list_closed);
}

void mb_open_close_later(lua_State *L) {
  lua_pushcfunction(L, core_close_later);
  lua_setfield(L, -2, "close_later");
}
