/* The moonbox command: a thin main over libmoonbox. */
#include "moonbox.h"

#include <lua.h>
#include <luajit.h>
#include <stdio.h>
#include <string.h>

static const char usage[] =
  "usage: moonbox [--policy file.lua] script.lua [args...]\n"
  "       moonbox [--policy file.lua] -e 'lua code'\n"
  "       moonbox [--policy file.lua] serve [--listen 127.0.0.1:8080 | --listen unix:/path.sock]\n"
  "               [--policy file.lua] [--handler app.lua] [--token-file F]   (docs/server.md)\n"
  "       moonbox --version | --help\n"
  "\n"
  "Runs the script as a task on the event loop and exits when it and every\n"
  "task it started are done; an uncaught error prints a traceback, exit 1.\n";

int main(int argc, char **argv) {
  if (argc < 2) { fputs(usage, stderr); return 2; }
  if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) { fputs(usage, stdout); return 0; }
  if (strcmp(argv[1], "--version") == 0) {
    printf("moonbox %s\n%s\nlibuv %s\n", moonbox_version(), LUAJIT_VERSION, uv_version_string());
    return 0;
  }
  moonbox *mb = moonbox_new(NULL);
  if (!mb) { fputs("moonbox: cannot create the runtime\n", stderr); return 1; }
  if (strcmp(argv[1], "--policy") == 0) {
    if (argc < 4) { fputs(usage, stderr); moonbox_close(mb); return 2; }
    if (moonbox_set_policy(mb, argv[2]) != 0) {
      fprintf(stderr, "moonbox: %s\n", moonbox_error(mb));
      moonbox_close(mb);
      return 1;
    }
    argc -= 2;
    argv += 2;
  }
  int rc;
  if (strcmp(argv[1], "serve") == 0) {
    /* the server is Lua (lua/moonbox/server/cli.lua); it gets the rest of argv */
    lua_State *L = moonbox_lua(mb);
    lua_createtable(L, argc - 2, 0);
    for (int i = 2; i < argc; i++) { lua_pushstring(L, argv[i]); lua_rawseti(L, -2, i - 1); }
    lua_setglobal(L, "arg");
    rc = moonbox_run_string(mb, "return require('moonbox.server.cli').main(arg)", "=(moonbox serve)");
  } else if (strcmp(argv[1], "-e") == 0) {
    if (argc < 3) { fputs(usage, stderr); moonbox_close(mb); return 2; }
    rc = moonbox_run_string(mb, argv[2], "=(command line)");
  } else {
    rc = moonbox_run_file(mb, argv[1], argc - 2, argv + 2);
  }
  if (rc) fprintf(stderr, "moonbox: %s\n", moonbox_error(mb));
  moonbox_close(mb);
  return rc;
}
