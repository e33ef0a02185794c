/* The moonbox command: a thin main over libmoonbox. */
#include "moonbox.h"

#include <lua.h>
#include <luajit.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

static const char usage[] =
  "usage: moonbox [--policy file.lua] script.lua [args...]\n"
  "       moonbox [--policy file.lua] -e 'lua code' [args...]\n"
  "       moonbox [--policy file.lua] - [args...]        (the script from standard input)\n"
  "       moonbox [--policy file.lua] [-i]               (a prompt: each line runs as a task)\n"
  "       moonbox [--policy file.lua] serve [--listen 127.0.0.1:8080 | --listen unix:/path.sock]\n"
  "               [--policy file.lua] [--handler app.lua] [--token-file F]   (docs/server.md)\n"
  "       moonbox image pull REF [--name NAME] | image ls | image rm NAME   (docs/images.md)\n"
  "       moonbox [--policy file.lua] mcp [--sandbox ID]      (an MCP server on stdio; docs/mcp.md)\n"
  "       moonbox --version | --help\n"
  "\n"
  "Runs the script as a task on the event loop and exits when it and every\n"
  "task it started are done; an uncaught error prints a traceback, exit 1.\n"
  "\n"
  "  --policy P     every sandbox's default policy: a preset (strict, dev) or a\n"
  "                 file.lua returning a policy table; one that cannot be loaded\n"
  "                 or is invalid is exit 2, as any usage mistake (and for serve)\n"
  "  MOONBOX_HOME   where sandboxes live (MOONBOX_HOME/sandboxes/ID); default\n"
  "                 ~/.local/share/moonbox\n"
  "See moonbox(1) and docs/ for the rest.\n";

/* Every session, process and sandbox holds a few fds: the soft limit a
 * service manager hands out (often 1024) would stop the runtime at ~100
 * sandboxes, so take the hard limit the administrator allowed. */
static void raise_fd_limit(struct rlimit *out) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) {
    out->rlim_cur = out->rlim_max = 0;
    return;
  }
  if (rl.rlim_cur < rl.rlim_max) {
    struct rlimit want = {rl.rlim_max, rl.rlim_max};
    if (setrlimit(RLIMIT_NOFILE, &want) == 0) rl.rlim_cur = rl.rlim_max;
  }
  *out = rl;
}

/* All of standard input, NUL-terminated; NULL when it cannot be read. */
static char *read_stdin(void) {
  size_t len = 0, cap = 65536;
  char *buf = malloc(cap);
  while (buf) {
    size_t n = fread(buf + len, 1, cap - len - 1, stdin);
    len += n;
    if (n == 0) break;
    if (cap - len - 1 == 0) {
      char *bigger = realloc(buf, cap * 2);
      if (!bigger) {
        free(buf);
        return NULL;
      }
      buf = bigger;
      cap *= 2;
    }
  }
  if (!buf || ferror(stdin)) {
    free(buf);
    return NULL;
  }
  buf[len] = 0;
  return buf;
}

static int unknown_option(const char *opt) {
  fprintf(stderr, "moonbox: unknown option '%s'\n%s", opt, usage);
  return 2;
}

/* The subcommands written in Lua; each gets the rest of argv as `arg`. */
typedef struct {
  const char *name, *chunk, *chunkname;
} lua_command;

static const lua_command lua_commands[] = {
  {"serve", "return require('moonbox.server.cli').main(arg)", "=(moonbox serve)"}, /* docs/server.md */
  {"image", "return require('moonbox.images.cli').main(arg)", "=(moonbox image)"}, /* docs/images.md */
  {"mcp", "return require('moonbox.mcp.stdio').main(arg)", "=(moonbox mcp)"},      /* docs/mcp.md */
};

static const lua_command *find_lua_command(const char *name) {
  for (size_t i = 0; i < sizeof lua_commands / sizeof *lua_commands; i++)
    if (strcmp(name, lua_commands[i].name) == 0) return &lua_commands[i];
  return NULL;
}

int main(int argc, char **argv) {
  struct rlimit fds;
  raise_fd_limit(&fds);
  /* no script: on a terminal a prompt, as luajit gives one */
  static char *repl_argv[] = {"moonbox", "-i", NULL};
  if (argc < 2) {
    if (!isatty(0)) {
      fputs(usage, stderr);
      return 2;
    }
    repl_argv[0] = argv[0];
    argc = 2;
    argv = repl_argv;
  }
  if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
    fputs(usage, stdout);
    return 0;
  }
  if (strcmp(argv[1], "--version") == 0) {
    printf("moonbox %s\n%s\nlibuv %s\nopen files: soft %llu, hard %llu\n", moonbox_version(), LUAJIT_VERSION,
           uv_version_string(), (unsigned long long)fds.rlim_cur, (unsigned long long)fds.rlim_max);
    return 0;
  }
  if (argv[1][0] == '-' && argv[1][1] && strcmp(argv[1], "--policy") != 0 && strcmp(argv[1], "-e") != 0 &&
      strcmp(argv[1], "-i") != 0)
    return unknown_option(argv[1]);
  moonbox *mb = moonbox_new(NULL);
  if (!mb) {
    fputs("moonbox: cannot create the runtime\n", stderr);
    return 1;
  }
  if (strcmp(argv[1], "--policy") == 0) {
    /* `moonbox --policy` alone, or followed by an option: the value is missing */
    if (argc < 3 || (argv[2][0] == '-' && argv[2][1])) {
      fputs("moonbox: --policy needs a value: a preset (strict, dev) or a file.lua\n", stderr);
      moonbox_close(mb);
      return 2;
    }
    if (argc < 4 && isatty(0)) argc = 4, argv[3] = "-i"; /* argv[argc] is NULL: room for one */
    if (argc < 4) {
      fputs(usage, stderr);
      moonbox_close(mb);
      return 2;
    }
    if (strcmp(argv[3], "--help") == 0 || strcmp(argv[3], "-h") == 0) {
      fputs(usage, stdout);
      moonbox_close(mb);
      return 0;
    }
    if (argv[3][0] == '-' && argv[3][1] && strcmp(argv[3], "-e") != 0 && strcmp(argv[3], "-i") != 0) {
      moonbox_close(mb);
      return unknown_option(argv[3]);
    }
    /* a policy that cannot be loaded or is invalid is a usage mistake: exit 2,
     * as `moonbox serve --policy` says it */
    if (moonbox_set_policy(mb, argv[2]) != 0) {
      fprintf(stderr, "moonbox: %s\n", moonbox_error(mb));
      moonbox_close(mb);
      return 2;
    }
    argc -= 2;
    argv += 2;
  }
  int rc;
  const lua_command *command = find_lua_command(argv[1]);
  if (command) {
    lua_State *L = moonbox_lua(mb);
    lua_createtable(L, argc - 2, 0);
    for (int i = 2; i < argc; i++) {
      lua_pushstring(L, argv[i]);
      lua_rawseti(L, -2, i - 1);
    }
    lua_setglobal(L, "arg");
    rc = moonbox_run_string(mb, command->chunk, command->chunkname);
  } else if (strcmp(argv[1], "-i") == 0) {
    if (argc > 2) {
      fputs(usage, stderr);
      moonbox_close(mb);
      return 2;
    }
    rc = moonbox_run_string(mb, "return require('moonbox.repl').main()", "=(prompt)");
  } else if (strcmp(argv[1], "-e") == 0) {
    if (argc < 3) {
      fputs(usage, stderr);
      moonbox_close(mb);
      return 2;
    }
    rc = moonbox_run_string_args(mb, argv[2], "=(command line)", "-e", argc - 3, argv + 3);
  } else if (strcmp(argv[1], "-") == 0) {
    char *code = read_stdin();
    if (!code) {
      fputs("moonbox: cannot read the script from standard input\n", stderr);
      moonbox_close(mb);
      return 1;
    }
    rc = moonbox_run_string_args(mb, code, "=stdin", "-", argc - 2, argv + 2);
    free(code);
  } else {
    rc = moonbox_run_file(mb, argv[1], argc - 2, argv + 2);
  }
  if (rc) fprintf(stderr, "moonbox: %s\n", moonbox_error(mb));
  moonbox_close(mb);
  return rc;
}
