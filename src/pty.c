/* pty: open a master/slave pair and resize it. Spawning a child on the slave
 * (as its controlling terminal) is done by core.spawn with setsid and the
 * slave placed on fds 0-2; the child's first open tty becomes controlling
 * thanks to TIOCSCTTY in the plan (ctty = fd). */
#include "private.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <termios.h>
#include <unistd.h>

#ifndef TIOCGPTPEER
#define TIOCGPTPEER _IO('T', 0x41)
#endif

/* A pty from another devpts instance (a sandbox's, reached through
 * /proc/<init>/root/dev/ptmx): the slave comes from TIOCGPTPEER, since its
 * name only means something inside that sandbox. */
static int pty_open_at(lua_State *L, const char *ptmx, int cols, int rows) {
  int master = open(ptmx, O_RDWR | O_NOCTTY | O_CLOEXEC);
  if (master < 0) return mb_push_errno(L, errno, ptmx);
  int unlock = 0;
  if (ioctl(master, TIOCSPTLCK, &unlock) < 0) {
    int e = errno;
    close(master);
    return mb_push_errno(L, e, "TIOCSPTLCK");
  }
  int slave = ioctl(master, TIOCGPTPEER, O_RDWR | O_NOCTTY | O_CLOEXEC);
  if (slave < 0) {
    int e = errno;
    close(master);
    return mb_push_errno(L, e, "TIOCGPTPEER");
  }
  unsigned int n = 0;
  ioctl(master, TIOCGPTN, &n);
  struct winsize ws = {.ws_row = (unsigned short)rows, .ws_col = (unsigned short)cols};
  ioctl(master, TIOCSWINSZ, &ws);
  lua_pushinteger(L, master);
  lua_pushinteger(L, slave);
  lua_pushfstring(L, "/dev/pts/%d", (int)n);
  return 3;
}

/* core.openpty(cols, rows[, ptmx_path]) -> master_fd, slave_fd, slave_name */
static int pty_open(lua_State *L) {
  int cols = (int)luaL_optinteger(L, 1, 80), rows = (int)luaL_optinteger(L, 2, 24);
  if (cols <= 0 || rows <= 0 || cols > 65535 || rows > 65535) return luaL_error(L, "bad pty size");
  if (!lua_isnoneornil(L, 3)) return pty_open_at(L, luaL_checkstring(L, 3), cols, rows);
  int master = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
  if (master < 0) return mb_push_errno(L, errno, "posix_openpt");
  char name[128];
  if (grantpt(master) < 0 || unlockpt(master) < 0 || ptsname_r(master, name, sizeof name) != 0) {
    int e = errno;
    close(master);
    return mb_push_errno(L, e, "ptsname");
  }
  int slave = open(name, O_RDWR | O_NOCTTY | O_CLOEXEC);
  if (slave < 0) {
    int e = errno;
    close(master);
    return mb_push_errno(L, e, name);
  }
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

/* core.pty_size(master_fd) -> cols, rows */
static int pty_size(lua_State *L) {
  int fd = (int)luaL_checkinteger(L, 1);
  struct winsize ws;
  if (ioctl(fd, TIOCGWINSZ, &ws) < 0) return mb_push_errno(L, errno, "TIOCGWINSZ");
  lua_pushinteger(L, ws.ws_col);
  lua_pushinteger(L, ws.ws_row);
  return 2;
}

void mb_open_pty(lua_State *L) {
  lua_pushcfunction(L, pty_open);
  lua_setfield(L, -2, "openpty");
  lua_pushcfunction(L, pty_resize);
  lua_setfield(L, -2, "pty_resize");
  lua_pushcfunction(L, pty_size);
  lua_setfield(L, -2, "pty_size");
}
