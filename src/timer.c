/* Timers: one-shot and repeating. */
#include "private.h"

#define TIMER "moonbox.timer"

static void on_timer(uv_timer_t *t) {
  mb_handle *h = (mb_handle *)t->data;
  lua_State *cbL = mb_handle_push_cb(h, 1);
  if (cbL) mb_call(h->core, cbL, 0);
}

/* core.timer() -> timer */
static int timer_new(lua_State *L) {
  mb_handle *h = mb_handle_new(L, TIMER, 0);
  uv_timer_init(h->core->loop, &h->uv.timer);
  return 1;
}

/* timer:start(timeout_ms, repeat_ms, callback) */
static int timer_start(lua_State *L) {
  mb_handle *h = mb_handle_check(L, 1, TIMER);
  lua_Number timeout = luaL_checknumber(L, 2);
  lua_Number repeat = luaL_optnumber(L, 3, 0);
  if (!(timeout >= 0) || !(repeat >= 0)) return luaL_error(L, "timer durations must be >= 0"); /* NaN too */
  if (timeout > 9007199254740992.0) timeout = 9007199254740992.0; /* 2^53 ms: forever, and castable */
  if (repeat > 9007199254740992.0) repeat = 9007199254740992.0;
  mb_handle_set_cb(L, h, 1, 4);
  /* A timer counts from now, not from the loop's cached time (stale by as
   * long as the current callback has run), and never fires early: the loop
   * clock is whole milliseconds, truncated, so one more is added. */
  uv_update_time(h->core->loop);
  if (timeout > 0) timeout += 1;
  int rc = uv_timer_start(&h->uv.timer, on_timer, (uint64_t)timeout, (uint64_t)repeat);
  if (rc < 0) return mb_push_error(L, rc, NULL);
  lua_pushboolean(L, 1);
  return 1;
}

static int timer_stop(lua_State *L) {
  mb_handle *h = mb_handle_check(L, 1, TIMER);
  uv_timer_stop(&h->uv.timer);
  return 0;
}

static int timer_again(lua_State *L) {
  mb_handle *h = mb_handle_check(L, 1, TIMER);
  int rc = uv_timer_again(&h->uv.timer);
  if (rc < 0) return mb_push_error(L, rc, NULL);
  lua_pushboolean(L, 1);
  return 1;
}

static int timer_get_due_in(lua_State *L) {
  mb_handle *h = mb_handle_check(L, 1, TIMER);
  /* libuv keeps the old deadline after uv_timer_stop: a stopped timer is due never */
  uint64_t due = uv_is_active(&h->uv.handle) ? uv_timer_get_due_in(&h->uv.timer) : 0;
  lua_pushnumber(L, (lua_Number)due);
  return 1;
}

static const luaL_Reg timer_methods[] = {
  {"start", timer_start}, {"stop", timer_stop}, {"again", timer_again}, {"get_due_in", timer_get_due_in}, {NULL, NULL}};

void mb_open_timer(lua_State *L) {
  mb_new_class(L, TIMER, timer_methods);
  lua_pushcfunction(L, timer_new);
  lua_setfield(L, -2, "timer");
}
