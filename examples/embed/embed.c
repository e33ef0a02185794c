/* Embedding moonbox: run a Lua script on a loop the host owns. */
#include <moonbox.h>
#include <stdio.h>

int main(void) {
  uv_loop_t loop;
  uv_loop_init(&loop);
  moonbox *mb = moonbox_new(&loop);
  if (!mb) return 1;
  int rc = moonbox_run_string(mb,
                              "local moonbox = require 'moonbox'\n"
                              "moonbox.sleep(10)\n"
                              "print('hello from a task on the host loop')\n",
                              "=embedded");
  if (rc == 0) uv_run(&loop, UV_RUN_DEFAULT);
  const char *err = moonbox_error(mb);
  if (rc || err) fprintf(stderr, "embed: %s\n", err ? err : "failed");
  printf("pending tasks: %d\n", moonbox_pending(mb));
  moonbox_close(mb);
  uv_loop_close(&loop);
  return (rc || err) ? 1 : 0;
}
