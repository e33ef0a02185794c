/* Checks an id map (the text written to /proc/<pid>/uid_map or gid_map)
 * before the runtime writes it for a sandbox's init: the map comes from Lua
 * (lua/moonbox/sandbox/isolation.lua derives it), and a malformed one must
 * fail as the caller's error, not as a half-set-up user namespace. */
#include "private.h"

#include <stdint.h>
#include <string.h>

/* The kernel's limit on a map's lines (UID_GID_MAP_MAX_EXTENTS, Linux >= 4.15). */
#define MAX_LINES 340

/* One decimal number below 2^32 at *s (leading blanks skipped); -1 if none. */
static long long number(const char **s) {
  const char *p = *s;
  while (*p == ' ' || *p == '\t') p++;
  if (*p < '0' || *p > '9') return -1;
  long long v = 0;
  for (; *p >= '0' && *p <= '9'; p++) {
    v = v * 10 + (*p - '0');
    if (v > (long long)UINT32_MAX) return -1;
  }
  *s = p;
  return v;
}

const char *mb_id_map_check(const char *text, size_t len) {
  if (len == 0) return "is empty";
  if (strlen(text) != len) return "has a NUL byte";
  const char *s = text, *end = text + len;
  int lines = 0;
  while (s < end) {
    if (++lines > MAX_LINES) return "has more than 340 lines";
    long long inside = number(&s), outside = number(&s), count = number(&s);
    if (inside < 0 || outside < 0 || count < 0) return "has a line that is not \"inside outside count\"";
    while (*s == ' ' || *s == '\t') s++;
    if (*s == '\n') s++;
    else if (*s) return "has a line that is not \"inside outside count\"";
    if (count == 0) return "has a line with a count of 0";
    if (inside + count > (long long)UINT32_MAX + 1 || outside + count > (long long)UINT32_MAX + 1)
      return "has a range past 2^32";
  }
  return NULL;
}
