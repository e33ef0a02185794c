/* Loop-mounted disk images (lua/moonbox/sandbox/disk.lua): attach an image
 * file to a free loop device and mount it, or unmount a mount point, on
 * libuv's thread pool. Before, each was a mount(8) or umount(8) process: two
 * spawns and waits per sandbox (3-10 ms each on a busy host), for what is
 * three ioctls and one system call.
 *
 *   core.loop_mount(image, target, fstype, options, cb)
 *       options: comma-separated; nosuid, nodev, noexec, noatime, ro become
 *       mount flags, "loop" is implied, the rest is the file system's data
 *       (e.g. "discard"). The device is set up with LO_FLAGS_AUTOCLEAR: it
 *       goes with the mount's last user. -> true (queued) | nil, msg, code;
 *       cb(nil, "/dev/loopN") | cb(message, nil, CODE)
 *   core.umount(target, lazy, cb)  umount2, MNT_DETACH when lazy;
 *       -> true | nil, msg, code; cb(nil) | cb(message, nil, CODE)
 *   core.mount_detach_copy(path) -> fd | nil, msg, code: open_tree's
 *       OPEN_TREE_CLONE of the mount at path, a detached mount only the
 *       (close-on-exec) fd holds; the kernel unmounts it at its last close
 *   core.mount_attach(fd, target) -> true | nil, msg, code: move_mount of
 *       that detached mount onto target (the fd stays the caller's)
 *
 * Mechanism only: which image, where, and when is the Lua side's. */
#include "private.h"
#include "child/mount_api.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/loop.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/syscall.h>
#include <unistd.h>

#define OPT_MAX 256

typedef struct {
  uv_work_t work;
  mb_core *core;
  int cb_ref;
  int is_mount, lazy;
  char image[PATH_MAX], target[PATH_MAX], fstype[32], data[OPT_MAX];
  unsigned long flags;
  char device[64];
  int err;            /* errno of the step that failed, 0 when all went well */
  const char *failed; /* that step */
} loop_req;

static const struct {
  const char *name;
  unsigned long flag;
} mount_flags[] = {
  {"nosuid", MS_NOSUID}, {"nodev", MS_NODEV}, {"noexec", MS_NOEXEC}, {"noatime", MS_NOATIME}, {"ro", MS_RDONLY}};

/* Split options into flags and the file system's data; 0, or -1 if too long. */
static int parse_options(const char *options, unsigned long *flags, char *data, size_t size) {
  char buf[OPT_MAX];
  if (strlen(options) >= sizeof buf) return -1;
  strcpy(buf, options);
  *flags = 0;
  data[0] = 0;
  char *save = NULL;
  for (char *opt = strtok_r(buf, ",", &save); opt; opt = strtok_r(NULL, ",", &save)) {
    int known = strcmp(opt, "loop") == 0;
    for (size_t i = 0; !known && i < sizeof mount_flags / sizeof *mount_flags; i++) {
      if (strcmp(opt, mount_flags[i].name) == 0) {
        *flags |= mount_flags[i].flag;
        known = 1;
      }
    }
    if (known) continue;
    size_t used = strlen(data);
    if (used + strlen(opt) + 2 > size) return -1;
    if (used) strcat(data, ",");
    strcat(data, opt);
  }
  return 0;
}

/* A free loop device, configured over image_fd; its fd (the caller closes
 * it once mounted: autoclear then waits for the mount). -1 with errno. */
static int attach(loop_req *r, int image_fd) {
  int ctl = open("/dev/loop-control", O_RDWR | O_CLOEXEC);
  if (ctl < 0) {
    r->failed = "open /dev/loop-control";
    return -1;
  }
  int fd = -1;
  /* another attacher may take the device between GET_FREE and CONFIGURE */
  for (int attempt = 0; attempt < 16 && fd < 0; attempt++) {
    int n = ioctl(ctl, LOOP_CTL_GET_FREE);
    if (n < 0) {
      r->failed = "LOOP_CTL_GET_FREE";
      break;
    }
    snprintf(r->device, sizeof r->device, "/dev/loop%d", n);
    fd = open(r->device, (r->flags & MS_RDONLY ? O_RDONLY : O_RDWR) | O_CLOEXEC);
    if (fd < 0) {
      r->failed = "open the loop device";
      break;
    }
    struct loop_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.fd = (unsigned)image_fd;
    cfg.info.lo_flags = LO_FLAGS_AUTOCLEAR | (r->flags & MS_RDONLY ? LO_FLAGS_READ_ONLY : 0);
    /* (a label only: the kernel keeps the first 63 bytes) */
    memcpy(cfg.info.lo_file_name, r->image, strnlen(r->image, LO_NAME_SIZE - 1));
    if (ioctl(fd, LOOP_CONFIGURE, &cfg) == 0) break;
    int e = errno;
    close(fd);
    fd = -1;
    errno = e;
    if (e != EBUSY) {
      r->failed = "LOOP_CONFIGURE";
      break;
    }
  }
  int e = errno;
  close(ctl);
  errno = e;
  if (fd < 0 && !r->failed) r->failed = "no free loop device";
  return fd;
}

static void loop_work(uv_work_t *w) {
  loop_req *r = w->data;
  if (!r->is_mount) {
    if (umount2(r->target, r->lazy ? MNT_DETACH : 0) < 0) {
      r->err = errno;
      r->failed = "umount";
    }
    return;
  }
  int image_fd = open(r->image, (r->flags & MS_RDONLY ? O_RDONLY : O_RDWR) | O_CLOEXEC | O_NOFOLLOW);
  if (image_fd < 0) {
    r->err = errno;
    r->failed = "open the image";
    return;
  }
  int dev_fd = attach(r, image_fd);
  if (dev_fd < 0) {
    r->err = errno;
    close(image_fd);
    return;
  }
  close(image_fd); /* the device holds the file now */
  if (mount(r->device, r->target, r->fstype, r->flags, r->data[0] ? r->data : NULL) < 0) {
    r->err = errno;
    r->failed = "mount";
    ioctl(dev_fd, LOOP_CLR_FD, 0);
  }
  close(dev_fd); /* autoclear: the device now goes with the mount */
}

static void loop_after(uv_work_t *w, int status) {
  loop_req *r = w->data;
  mb_core *core = r->core;
  if (core->dead) {
    free(r);
    return;
  }
  lua_State *cbL = core->cbL;
  lua_rawgeti(cbL, LUA_REGISTRYINDEX, r->cb_ref);
  luaL_unref(cbL, LUA_REGISTRYINDEX, r->cb_ref);
  int nargs;
  if (status < 0) {
    lua_pushfstring(cbL, "%s: %s", uv_err_name(status), uv_strerror(status));
    lua_pushnil(cbL);
    lua_pushstring(cbL, uv_err_name(status));
    nargs = 3;
  } else if (r->err) {
    lua_pushfstring(cbL, "%s: %s (%s %s)", uv_err_name(uv_translate_sys_error(r->err)), strerror(r->err), r->failed,
                    r->is_mount ? r->image : r->target);
    lua_pushnil(cbL);
    lua_pushstring(cbL, uv_err_name(uv_translate_sys_error(r->err)));
    nargs = 3;
  } else {
    lua_pushnil(cbL);
    if (r->is_mount) lua_pushstring(cbL, r->device);
    else lua_pushboolean(cbL, 1);
    nargs = 2;
  }
  free(r);
  mb_call(core, cbL, nargs);
}

static int submit(lua_State *L, loop_req *r, int cb_idx) {
  luaL_checktype(L, cb_idx, LUA_TFUNCTION);
  r->core = mb_core_get(L);
  r->work.data = r;
  lua_pushvalue(L, cb_idx);
  r->cb_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  int rc = uv_queue_work(r->core->loop, &r->work, loop_work, loop_after);
  if (rc < 0) {
    luaL_unref(L, LUA_REGISTRYINDEX, r->cb_ref);
    free(r);
    return mb_push_error(L, rc, "uv_queue_work");
  }
  lua_pushboolean(L, 1);
  return 1;
}

/* A string argument that fits size with its NUL and holds no other NUL. */
static const char *check_path(lua_State *L, int idx, size_t size) {
  size_t len;
  const char *s = luaL_checklstring(L, idx, &len);
  if (len == 0 || len >= size || memchr(s, 0, len)) luaL_argerror(L, idx, "empty, too long or holds a NUL");
  return s;
}

static int loop_mount(lua_State *L) {
  loop_req probe; /* (the arguments are checked before anything is allocated) */
  const char *image = check_path(L, 1, sizeof probe.image);
  const char *target = check_path(L, 2, sizeof probe.target);
  const char *fstype = check_path(L, 3, sizeof probe.fstype);
  const char *options = luaL_optstring(L, 4, "");
  luaL_checktype(L, 5, LUA_TFUNCTION);
  unsigned long flags;
  char data[OPT_MAX];
  if (parse_options(options, &flags, data, sizeof data) < 0) return luaL_argerror(L, 4, "options too long");
  loop_req *r = calloc(1, sizeof *r);
  if (!r) return luaL_error(L, "out of memory");
  strcpy(r->image, image);
  strcpy(r->target, target);
  strcpy(r->fstype, fstype);
  strcpy(r->data, data);
  r->flags = flags;
  r->is_mount = 1;
  return submit(L, r, 5);
}

static int do_umount(lua_State *L) {
  size_t len;
  const char *target = luaL_checklstring(L, 1, &len);
  if (len == 0 || len >= PATH_MAX) return luaL_argerror(L, 1, "empty or too long");
  luaL_checktype(L, 3, LUA_TFUNCTION);
  loop_req *r = calloc(1, sizeof *r);
  if (!r) return luaL_error(L, "out of memory");
  memcpy(r->target, target, len + 1);
  r->lazy = lua_toboolean(L, 2);
  return submit(L, r, 3);
}

/* Two system calls that never wait on I/O: on the loop, not the pool. */
static int mount_detach_copy(lua_State *L) {
  const char *path = check_path(L, 1, PATH_MAX);
  int fd = (int)syscall(SYS_open_tree, AT_FDCWD, path, OPEN_TREE_CLONE | O_CLOEXEC);
  if (fd < 0) return mb_push_errno(L, errno, "open_tree");
  lua_pushinteger(L, fd);
  return 1;
}

static int mount_attach(lua_State *L) {
  int fd = (int)luaL_checkinteger(L, 1);
  const char *target = check_path(L, 2, PATH_MAX);
  if (fd < 0) return luaL_argerror(L, 1, "fd must be >= 0");
  if (syscall(SYS_move_mount, fd, "", AT_FDCWD, target, MOVE_MOUNT_F_EMPTY_PATH) < 0)
    return mb_push_errno(L, errno, "move_mount");
  lua_pushboolean(L, 1);
  return 1;
}

void mb_open_loopmount(lua_State *L) {
  static const luaL_Reg funcs[] = {{"loop_mount", loop_mount},
                                   {"umount", do_umount},
                                   {"mount_detach_copy", mount_detach_copy},
                                   {"mount_attach", mount_attach},
                                   {NULL, NULL}};
  luaL_register(L, NULL, funcs);
}
