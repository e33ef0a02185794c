/* pty: open a master/slave pair and resize it. Spawning a child on the slave
 * (as its controlling terminal) is done by core.spawn with setsid and the
 * slave placed on fds 0-2; the child's first open tty becomes controlling
 * thanks to TIOCSCTTY in the plan (ctty = fd). */
#include "core.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <termios.h>
#include <unistd.h>

/* core.openpty(cols, rows) -> master_fd, slave_fd, slave_name */
static int pty_open(lua_State *L) {
  int cols = (int)luaL_optinteger(L, 1, 80), rows = (int)luaL_optinteger(L, 2, 24);
  if (cols <= 0 || rows <= 0 || cols > 65535 || rows > 65535) return luaL_error(L, "bad pty size");
  int master = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
  if (master < 0) return mb_push_errno(L, errno, "posix_openpt");
  char name[128];
  if (grantpt(master) < 0 || unlockpt(master) < 0 || ptsname_r(master, name, sizeof name) != 0) {
    int e = errno;
    close(master);
    return mb_push_errno(L, e, "ptsname");
  }
  int slave = open(name, O_RDWR | O_NOCTTY | O_CLOEXEC);
  if (slave < 0) { int e = errno; close(master); return mb_push_errno(L, e, name); }
  struct winsize ws = {.ws_row = (unsigned short)rows, .ws_col = (unsigned short)cols};
  ioctl(master, TIOCSWINSZ, &ws);
  lua_pushinteger(L, master);
  lua_pushinteger(L, slave);
  lua_pushstring(L, name);
  return 3;
}

/* core.pty_resize(master_fd, cols, rows) */
static int pty_resize(lua_State *L) {
  int fd = (int)luaL_checkinteger(L, 1);
  int cols = (int)luaL_checkinteger(L, 2), rows = (int)luaL_checkinteger(L, 3);
  if (cols <= 0 || rows <= 0 || cols > 65535 || rows > 65535) return luaL_error(L, "bad pty size");
  struct winsize ws = {.ws_row = (unsigned short)rows, .ws_col = (unsigned short)cols};
  if (ioctl(fd, TIOCSWINSZ, &ws) < 0) return mb_push_errno(L, errno, "TIOCSWINSZ");
  lua_pushboolean(L, 1);
  return 1;
}

void mb_open_pty(lua_State *L) {
  lua_pushcfunction(L, pty_open);
  lua_setfield(L, -2, "openpty");
  lua_pushcfunction(L, pty_resize);
  lua_setfield(L, -2, "pty_resize");
}
