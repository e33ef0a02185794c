/* seccomp: compile a profile (Lua data) into a BPF program with libseccomp,
 * in the parent; the spawned child only installs the finished program
 * (no_new_privs, then SECCOMP_MODE_FILTER) as its last step before exec.
 *
 * core.seccomp_compile{deny = {"mount", ...}, deny_ioctls = {0x5412, ...},
 *   deny_clone_flags = {0x10000000, ...}, enosys = {"clone3"}}
 *   -> filter | nil, message, code
 * Denied calls fail with EPERM; ioctl requests match on their low 32 bits
 * (CVE-2019-10063); syscalls of a foreign ABI (i386, x32) kill the process. */
#include "private.h"
#include "child/child.h"

#include <errno.h>
#include <linux/filter.h>
#include <seccomp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define FILTER "moonbox.seccomp"

typedef struct {
  struct sock_fprog prog;
  struct sock_filter insns[];
} mb_filter;

static int fail(lua_State *L, scmp_filter_ctx ctx, int rc, const char *what) {
  if (ctx) seccomp_release(ctx);
  return mb_push_errno(L, rc < 0 ? -rc : rc, what);
}

static int add_names(lua_State *L, scmp_filter_ctx ctx, const char *field, uint32_t action) {
  lua_getfield(L, 1, field);
  if (lua_isnil(L, -1)) {
    lua_pop(L, 1);
    return 0;
  }
  luaL_checktype(L, -1, LUA_TTABLE);
  for (int i = 1; i <= (int)lua_objlen(L, -1); i++) {
    lua_rawgeti(L, -1, i);
    const char *name = luaL_checkstring(L, -1);
    int nr = seccomp_syscall_resolve_name(name);
    if (nr == __NR_SCMP_ERROR) {
      lua_pop(L, 2);
      return luaL_error(L, "seccomp: unknown syscall '%s'", name);
    }
    int rc = seccomp_rule_add(ctx, action, nr, 0);
    lua_pop(L, 1);
    if (rc < 0) {
      lua_pop(L, 1);
      return rc;
    }
  }
  lua_pop(L, 1);
  return 0;
}

/* One masked rule per value: (arg & mask) == value -> action */
static int add_masked(lua_State *L, scmp_filter_ctx ctx, const char *field, int nr, unsigned arg, uint64_t mask_all,
                      int mask_is_value) {
  lua_getfield(L, 1, field);
  if (lua_isnil(L, -1)) {
    lua_pop(L, 1);
    return 0;
  }
  luaL_checktype(L, -1, LUA_TTABLE);
  for (int i = 1; i <= (int)lua_objlen(L, -1); i++) {
    lua_rawgeti(L, -1, i);
    uint64_t v = (uint64_t)luaL_checknumber(L, -1);
    lua_pop(L, 1);
    uint64_t mask = mask_is_value ? v : mask_all;
    struct scmp_arg_cmp cmp = {arg, SCMP_CMP_MASKED_EQ, mask, v};
    int rc = seccomp_rule_add_array(ctx, SCMP_ACT_ERRNO(EPERM), nr, 1, &cmp);
    if (rc < 0) {
      lua_pop(L, 1);
      return rc;
    }
  }
  lua_pop(L, 1);
  return 0;
}

static int seccomp_compile(lua_State *L) {
  luaL_checktype(L, 1, LUA_TTABLE);
  scmp_filter_ctx ctx = seccomp_init(SCMP_ACT_ALLOW);
  if (!ctx) return mb_push_errno(L, ENOMEM, "seccomp_init");
  int rc = seccomp_attr_set(ctx, SCMP_FLTATR_ACT_BADARCH, SCMP_ACT_KILL_PROCESS);
  if (rc < 0) return fail(L, ctx, rc, "seccomp badarch");
  if ((rc = add_names(L, ctx, "deny", SCMP_ACT_ERRNO(EPERM))) < 0) return fail(L, ctx, rc, "seccomp deny");
  if ((rc = add_names(L, ctx, "enosys", SCMP_ACT_ERRNO(ENOSYS))) < 0) return fail(L, ctx, rc, "seccomp enosys");
  if ((rc = add_masked(L, ctx, "deny_ioctls", SCMP_SYS(ioctl), 1, 0xffffffffULL, 0)) < 0)
    return fail(L, ctx, rc, "seccomp ioctl");
  if ((rc = add_masked(L, ctx, "deny_clone_flags", SCMP_SYS(clone), 0, 0, 1)) < 0)
    return fail(L, ctx, rc, "seccomp clone");
  if ((rc = add_masked(L, ctx, "deny_unshare_flags", SCMP_SYS(unshare), 0, 0, 1)) < 0)
    return fail(L, ctx, rc, "seccomp unshare");
  /* export the BPF program through a memfd and keep it in the userdata */
  int fd = memfd_create("moonbox-seccomp", MFD_CLOEXEC);
  if (fd < 0) return fail(L, ctx, errno, "memfd_create");
  rc = seccomp_export_bpf(ctx, fd);
  seccomp_release(ctx);
  if (rc < 0) {
    close(fd);
    return mb_push_errno(L, -rc, "seccomp_export_bpf");
  }
  off_t size = lseek(fd, 0, SEEK_END);
  if (size <= 0 || size % (off_t)sizeof(struct sock_filter) != 0 || size > 65535 * (off_t)sizeof(struct sock_filter)) {
    close(fd);
    return mb_push_errno(L, EINVAL, "seccomp program size");
  }
  mb_filter *f = (mb_filter *)lua_newuserdata(L, sizeof(mb_filter) + (size_t)size);
  if (pread(fd, f->insns, (size_t)size, 0) != size) {
    int e = errno;
    close(fd);
    return mb_push_errno(L, e, "pread");
  }
  close(fd);
  f->prog.len = (unsigned short)(size / (off_t)sizeof(struct sock_filter));
  f->prog.filter = f->insns;
  luaL_getmetatable(L, FILTER);
  lua_setmetatable(L, -2);
  return 1;
}

static int filter_size(lua_State *L) {
  mb_filter *f = (mb_filter *)luaL_checkudata(L, 1, FILTER);
  lua_pushinteger(L, f->prog.len);
  return 1;
}

/* For spawn.c: the program of a filter userdata at idx (raises otherwise). */
const struct sock_fprog *mb_seccomp_check(lua_State *L, int idx) {
  mb_filter *f = (mb_filter *)luaL_checkudata(L, idx, FILTER);
  return &f->prog;
}

void mb_open_seccomp(lua_State *L) {
  luaL_newmetatable(L, FILTER);
  lua_newtable(L);
  lua_pushcfunction(L, filter_size);
  lua_setfield(L, -2, "size");
  lua_setfield(L, -2, "__index");
  lua_pop(L, 1);
  lua_pushcfunction(L, seccomp_compile);
  lua_setfield(L, -2, "seccomp_compile");
}
