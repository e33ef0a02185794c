/* The control FIFO read in blocks (issue #32).
 *
 * bash reads its script from a pipe or FIFO one byte per read(2): input
 * that is not seekable cannot be given back, and a command reading the
 * same fd (`bash < script` with a `read` in it) must find the bytes after
 * its line. The session shell's script fd is the control FIFO, which no
 * command reads as its stdin (theirs is /dev/null or the stdin slot), and
 * the runtime sends the next line only after the record of the last: so
 * the control line is read in one read(2) instead of 16.
 *
 * The buffered stream is bash's (input.c, BUFFERED_STREAM, not in the
 * installed headers; its layout has been the same since bash 2, and the
 * module loads only into the bash it was built against: dist_version). It
 * is reached through set_buffered_stream, which bash exports. bash takes
 * it out of that table while it runs a sourced file or an `eval` (push_stream),
 * so this runs once from the top level: the runtime's first line ends with
 * `builtin __mb_rep -b` (lua/moonbox/session/shell.lua, Shell:begin).
 *
 * Bytes a command writes into the FIFO stay in the kernel while the
 * command runs (bash does not read there meanwhile), and the report drops
 * them as before (report_builtin.c, drop_pending). */
#include <loadables.h>

#include <string.h>

#include "mb_builtins.h"

typedef struct {
  int b_fd;
  char *b_buffer;
  size_t b_size;
  size_t b_used;
  int b_flag;
  size_t b_inputp;
} bash_stream;

#define B_UNBUFF 0x04
#define B_SHAREDBUF 0x20
#define CONTROL_BUFFER 4096

extern void *set_buffered_stream(int, void *);

static bash_stream *control_stream(void) {
  int fd = default_buffered_input;
  if (fd < 0) return NULL;
  bash_stream *bp = set_buffered_stream(fd, NULL);
  set_buffered_stream(fd, bp);
  return bp && bp->b_fd == fd ? bp : NULL;
}

void mb_buffer_control_input(void) {
  bash_stream *bp = control_stream();
  if (!bp || bp->b_size != 1 || (bp->b_flag & B_SHAREDBUF)) return;
  /* (bash's own allocator, as bash frees it; the 1-byte buffer is left
   * alone, whoever allocated it) */
  char *buf = xmalloc(CONTROL_BUFFER);
  size_t left = bp->b_used > bp->b_inputp ? bp->b_used - bp->b_inputp : 0;
  if (left) memcpy(buf, bp->b_buffer + bp->b_inputp, left);
  bp->b_buffer = buf;
  bp->b_size = CONTROL_BUFFER;
  bp->b_used = left;
  bp->b_inputp = 0;
  bp->b_flag &= ~B_UNBUFF;
}
