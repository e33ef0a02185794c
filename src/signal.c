/* Signal watchers on the loop (SIGINT, SIGTERM, SIGCHLD, ...). */
#include "private.h"

#include <signal.h>
#include <strings.h>
#include <string.h>

#define SIGNAL "moonbox.signal"

static const struct {
  const char *name;
  int num;
} signal_names[] = {{"SIGHUP", SIGHUP},
                    {"SIGINT", SIGINT},
                    {"SIGQUIT", SIGQUIT},
                    {"SIGILL", SIGILL},
                    {"SIGTRAP", SIGTRAP},
                    {"SIGABRT", SIGABRT},
                    {"SIGBUS", SIGBUS},
                    {"SIGFPE", SIGFPE},
                    {"SIGKILL", SIGKILL},
                    {"SIGUSR1", SIGUSR1},
                    {"SIGSEGV", SIGSEGV},
                    {"SIGUSR2", SIGUSR2},
                    {"SIGPIPE", SIGPIPE},
                    {"SIGALRM", SIGALRM},
                    {"SIGTERM", SIGTERM},
                    {"SIGCHLD", SIGCHLD},
                    {"SIGCONT", SIGCONT},
                    {"SIGSTOP", SIGSTOP},
                    {"SIGTSTP", SIGTSTP},
                    {"SIGTTIN", SIGTTIN},
                    {"SIGTTOU", SIGTTOU},
                    {"SIGURG", SIGURG},
                    {"SIGXCPU", SIGXCPU},
                    {"SIGXFSZ", SIGXFSZ},
                    {"SIGVTALRM", SIGVTALRM},
                    {"SIGPROF", SIGPROF},
                    {"SIGWINCH", SIGWINCH},
                    {"SIGIO", SIGIO},
                    {"SIGPWR", SIGPWR},
                    {"SIGSYS", SIGSYS},
                    {NULL, 0}};

/* "SIGRTMIN", "SIGRTMIN+N", "SIGRTMAX-N" (the SIG optional, any case), as
 * bash and kill(1) name them: libc's SIGRTMIN is a call, not a constant
 * (glibc keeps the first two for itself); 0 when s is none of them. */
static int realtime_signal(const char *s) {
  if (strncasecmp(s, "SIG", 3) == 0) s += 3;
  int base, sign;
  if (strncasecmp(s, "RTMIN", 5) == 0) base = SIGRTMIN, sign = 1;
  else if (strncasecmp(s, "RTMAX", 5) == 0) base = SIGRTMAX, sign = -1;
  else return 0;
  s += 5;
  if (!*s) return base;
  if (*s != (sign > 0 ? '+' : '-') || !s[1] || strlen(s + 1) > 2) return 0;
  int n = 0;
  for (const char *p = s + 1; *p; p++) {
    if (*p < '0' || *p > '9') return 0;
    n = n * 10 + (*p - '0');
  }
  int sig = base + sign * n;
  return sig >= SIGRTMIN && sig <= SIGRTMAX ? sig : 0;
}

/* Accepts a number or a name with or without the SIG prefix; raises on junk. */
int mb_check_signal(lua_State *L, int idx) {
  if (lua_type(L, idx) == LUA_TNUMBER) {
    /* compared as a double first: 1.5 is not SIGHUP, and inf or NaN is no int */
    lua_Number d = lua_tonumber(L, idx);
    if (!(d >= 0 && d < NSIG) || d != (lua_Number)(int)d) luaL_argerror(L, idx, "signal number out of range");
    return (int)d;
  }
  const char *s = luaL_checkstring(L, idx);
  for (int i = 0; signal_names[i].name; i++) {
    if (strcasecmp(s, signal_names[i].name) == 0 || strcasecmp(s, signal_names[i].name + 3) == 0)
      return signal_names[i].num;
  }
  int rt = realtime_signal(s);
  if (rt > 0) return rt;
  return luaL_argerror(L, idx, lua_pushfstring(L, "unknown signal '%s'", s));
}

static void on_signal(uv_signal_t *s, int signum) {
  mb_handle *h = (mb_handle *)s->data;
  lua_State *cbL = mb_handle_push_cb(h, 1);
  if (!cbL) return;
  lua_pushinteger(cbL, signum);
  mb_call(h->core, cbL, 1);
}

static int signal_new(lua_State *L) {
  mb_handle *h = mb_handle_new(L, SIGNAL, 0);
  uv_signal_init(h->core->loop, &h->uv.signal);
  return 1;
}

/* signal:start(signal, callback(signum)) */
static int signal_start(lua_State *L) {
  mb_handle *h = mb_handle_check(L, 1, SIGNAL);
  int signum = mb_check_signal(L, 2);
  mb_handle_set_cb(L, h, 1, 3);
  int rc = uv_signal_start(&h->uv.signal, on_signal, signum);
  if (rc < 0) return mb_push_error(L, rc, NULL);
  lua_pushboolean(L, 1);
  return 1;
}

static int signal_stop(lua_State *L) {
  mb_handle *h = mb_handle_check(L, 1, SIGNAL);
  uv_signal_stop(&h->uv.signal);
  return 0;
}

/* core.signum("TERM") -> 15; core.signame(15) -> "SIGTERM" */
static int signum(lua_State *L) {
  lua_pushinteger(L, mb_check_signal(L, 1));
  return 1;
}

static int signame(lua_State *L) {
  int n = (int)luaL_checkinteger(L, 1);
  for (int i = 0; signal_names[i].name; i++)
    if (signal_names[i].num == n) {
      lua_pushstring(L, signal_names[i].name);
      return 1;
    }
  if (n == SIGRTMIN) lua_pushstring(L, "SIGRTMIN");
  else if (n > SIGRTMIN && n <= SIGRTMAX) lua_pushfstring(L, "SIGRTMIN+%d", n - SIGRTMIN);
  else lua_pushnil(L);
  return 1;
}

static const luaL_Reg signal_methods[] = {{"start", signal_start}, {"stop", signal_stop}, {NULL, NULL}};

void mb_open_signal(lua_State *L) {
  mb_new_class(L, SIGNAL, signal_methods);
  lua_pushcfunction(L, signal_new);
  lua_setfield(L, -2, "signal");
  lua_pushcfunction(L, signum);
  lua_setfield(L, -2, "signum");
  lua_pushcfunction(L, signame);
  lua_setfield(L, -2, "signame");
}
