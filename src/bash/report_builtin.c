/* __mb_rep: the session shell's report after each command, as a bash
 * loadable builtin (loaded with __mb_run from the same module).
 *
 *   __mb_rep ID STATUS KIND ENVFILE
 *
 * writes the status record "\n<ID> <STATUS> <KIND> <e|->\0<PWD>\0" on fd 1
 * (the status pipe) in one write. Before it, if the shell's exported
 * environment differs from the one it last reported, ENVFILE is rewritten
 * with it as NUL-terminated NAME=VALUE entries and the flag is `e`; else the
 * file is left alone and the flag is `-` (the runtime keeps what it has).
 *
 * The shell function it replaces ran `export -p` into ENVFILE every time:
 * bash sorts and quotes every variable for that, about 10 us a command.
 * bash's export environment (what its children get) is kept up to date by
 * bash itself; exported functions (BASH_FUNC_...) are left out, as
 * `export -p` leaves them out.
 */
#include <loadables.h>

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "version.h"

/* the environment last written (in this shell process) */
static char *last_env;
static size_t last_len;

static int write_all(int fd, const char *p, size_t len) {
  while (len > 0) {
    ssize_t n = write(fd, p, len);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return -1;
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

/* The export environment as NUL-terminated entries (malloc'd). */
static char *export_entries(size_t *len) {
  maybe_make_export_env();
  size_t total = 0;
  for (char **e = export_env; e && *e; e++)
    if (strncmp(*e, "BASH_FUNC_", 10) != 0) total += strlen(*e) + 1;
  char *buf = malloc(total ? total : 1);
  if (!buf) return NULL;
  size_t off = 0;
  for (char **e = export_env; e && *e; e++) {
    if (strncmp(*e, "BASH_FUNC_", 10) == 0) continue;
    size_t n = strlen(*e) + 1;
    memcpy(buf + off, *e, n);
    off += n;
  }
  *len = off;
  return buf;
}

/* Rewrite the env file if the environment changed: 1 if it was rewritten,
 * 0 if unchanged, -1 if it could not be. */
static int report_env(const char *path) {
  size_t len;
  char *env = export_entries(&len);
  if (!env) return -1;
  if (last_env && len == last_len && memcmp(env, last_env, len) == 0) {
    free(env);
    return 0;
  }
  int fd = open(path, O_WRONLY | O_TRUNC | O_CLOEXEC);
  if (fd < 0) { free(env); return -1; }
  int rc = write_all(fd, env, len);
  close(fd);
  if (rc < 0) { free(env); return -1; }
  free(last_env);
  last_env = env;
  last_len = len;
  return 1;
}

static int mb_rep_builtin(WORD_LIST *list) {
  char *args[4];
  for (int i = 0; i < 4; i++) {
    if (!list) { builtin_usage(); return EX_USAGE; }
    args[i] = list->word->word;
    list = list->next;
  }
  int changed = report_env(args[3]);
  /* after a failed rewrite the file may hold anything: say it changed, so
   * the runtime reads it rather than trusting its copy (and the next report
   * tries again) */
  char flag = changed == 0 ? '-' : 'e';
  const char *pwd = get_string_value("PWD");
  if (!pwd) pwd = "";
  size_t len = strlen(args[0]) + strlen(args[1]) + strlen(args[2]) + strlen(pwd) + 16;
  char *record = malloc(len);
  if (!record) return EXECUTION_FAILURE;
  int n = snprintf(record, len, "\n%s %s %s %c", args[0], args[1], args[2], flag);
  record[n++] = 0;
  size_t pwd_len = strlen(pwd) + 1;
  memcpy(record + n, pwd, pwd_len);
  int rc = write_all(1, record, (size_t)n + pwd_len);
  free(record);
  return rc < 0 ? EXECUTION_FAILURE : EXECUTION_SUCCESS;
}

int __mb_rep_builtin_load(char *name) {
  (void)name;
  return strcmp(dist_version, DISTVERSION) == 0;
}

static char *mb_rep_doc[] = {
  "Report a command's end to the moonbox runtime.",
  "",
  "Writes the status record on fd 1, and the exported environment to",
  "ENVFILE when it changed.",
  NULL,
};

struct builtin __mb_rep_struct = {
  "__mb_rep", mb_rep_builtin, BUILTIN_ENABLED, mb_rep_doc, "__mb_rep ID STATUS KIND ENVFILE", 0,
};
