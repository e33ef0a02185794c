/* HTTP/1.1, Server-Sent Events and WebSocket through libwebsockets, on the
 * runtime's own uv loop (a foreign loop for lws). Mechanism only: requests
 * go to one Lua callback as events, responses come back as queued writes;
 * what a path means is Lua's business.
 *
 *   core.http_listen(opts, on_event(kind, id, ...)) -> server | nil, msg, CODE
 *     opts: host, port | unix (path), max_body, max_connections, idle_timeout_ms
 *   events: "request", id, req, body   (req.too_large, req.length_required:
 *                                       the body was not read; req.raw_line:
 *                                       the request line as sent)
 *           "message", id, data, is_binary   (a whole WebSocket message)
 *           "drain", id                      (every queued byte was written)
 *           "done", id                       (the response is complete)
 *           "closed", id                     (the client is gone)
 *
 * Each request gets a new id (a keep-alive connection carries several);
 * methods given an id that is no longer current return nil, "closed".
 * A server is one handle for core.open_handles(); close() destroys the lws
 * context (its own uv handles close asynchronously) and the handle closes
 * once lws reports the context gone. */
#include "private.h"

#include <libwebsockets.h>
#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#define SERVER "moonbox.http_server"
#define HTTP_SLICE 65536 /* bytes of body per writeable callback */

enum { CB_CLOSE = 0, CB_EVENT = 1 };
enum { OUT_HEADERS, OUT_BODY, OUT_TEXT, OUT_BINARY };

typedef struct out_chunk {
  struct out_chunk *next;
  int kind;
  int more; /* a WebSocket fragment: the message goes on in the next chunk */
  size_t len, off;
  unsigned char *data; /* points LWS_PRE into mem */
  unsigned char mem[];
} out_chunk;

typedef struct server server;

typedef struct conn {
  struct conn *next, *prev;
  server *srv;
  struct lws *wsi;
  lua_Integer id; /* the current request, 0 between requests */
  int req_ref;    /* request table while its body arrives */
  char *body;     /* request body or WebSocket message being assembled */
  size_t body_len, body_cap;
  int too_large; /* body over the limit: answered without reading it */
  int over;      /* accepted past max_connections: answered 503, then closed */
  int msg_binary;
  int is_ws, established;
  int ws_out_open; /* a fragmented outgoing message is under way */
  int responding;  /* headers queued */
  int finishing;   /* no more data after the queue */
  int close_after; /* close the connection once the response is out */
  int ws_closing, ws_close_code;
  char ws_reason[124];
  size_t ws_reason_len;
  int reject_status; /* WebSocket upgrade refused synchronously by Lua */
  uint64_t deadline; /* loop time (ms) the client must act by, 0: none */
  int kill;          /* the deadline passed: hang up at the next chance */
  char *reject_body, *reject_type;
  char *reject_headers; /* "name:\0value\0" pairs, reject_headers_len bytes */
  size_t reject_headers_len;
  out_chunk *head, *tail;
  size_t queued;
  uv_poll_t *poll;  /* lws's uv poll handle for the socket (see raw heads) */
  int poll_walked;  /* looked for it */
  int head_refused; /* answered 431 or 400 straight on the socket */
  /* the request stream as lws reads it (see raw heads) */
  int scan_state;  /* SCAN_* */
  char *scan_line; /* the line being assembled */
  size_t scan_len;
  unsigned long long scan_body; /* body bytes still to skip */
  int scan_cl, scan_te, scan_upgrade, scan_bad;
  char *scan_target;               /* the request line of the head being scanned */
  struct head *heads, *heads_tail; /* scanned heads lws has not reported yet, in order */
  char *stash;                     /* bytes read past the end of a request, held back from lws */
  size_t stash_len, stash_off;
  int stash_wake; /* lws should read the stash: wake it once (on_wake) */
  int stash_tries;
} conn;

/* A request head as the client sent it: its request line, and why it must
 * be refused (NULL if it need not). */
typedef struct head {
  struct head *next;
  char *line;
  const char *bad;
} head;

struct server {
  mb_handle *h;        /* anchor (a uv timer that also drives teardown) */
  uv_prepare_t rehook; /* before each poll: put the wrappers back (raw heads) */
  int rehook_on;
  uv_idle_t wake; /* hands held-back requests to lws (raw heads) */
  int wake_on;
  struct lws_context *ctx; /* lws writes NULL here once destruction is done */
  struct lws_vhost *vh;
  struct lws_protocols protocols[2];
  lws_retry_bo_t retry;
  conn *conns;
  int nconns;
  lua_Integer next_id;
  size_t max_body;
  int max_conns;
  int idle_secs;
  int64_t idle_ms;
  int close_requested;       /* close() was called */
  int draining;              /* drain() was called: new connections are refused at accept */
  int overflow;              /* connections past max_conns still accepted, to be answered 503 */
  lua_Integer refused;       /* connections hung up at accept (past max_conns + overflow, draining) */
  uv_poll_t *listen_poll;    /* lws's poll of the listening socket, once found (see accept pauses) */
  int listen_walks;          /* searches for it so far (a uv_walk each; two at most) */
  uint64_t accept_resume;    /* loop time to poll the listening socket again; 0: not paused */
  uint64_t accept_logged;    /* loop time of the last line about a failed accept */
  lua_Integer accept_failed; /* accepts the kernel refused (out of fds or memory) */
  int heads_400, heads_431;  /* heads answered straight on the socket, not yet reported to Lua */
  int destroying;            /* lws_context_destroy was called */
  char unix_path[108];
  struct server *next_server; /* the core's live servers, for teardown */
};

static server *live_servers; /* one core per process in practice; see teardown */

/* ---- raw request heads ----------------------------------------------------------
 * lws 4.1 decodes the request target while it parses it (%2F becomes a '/'
 * that splits segments, "." and ".." segments, also %2E%2E, are removed) and
 * keeps nothing of what the client sent, so "/sessions/a%2Fb" and
 * "/sessions/%2E%2E" reach us as "/sessions/a/b" and "/". It also takes the
 * first of two Content-Length headers, and reads a pipelined request out of
 * the same buffer as the one before it. So every byte lws reads from a
 * client passes through a scanner of our own first: lws's import of recv()
 * is pointed at recv_hook (its GOT slot, patched once), which hands what
 * lws reads from a connection's socket to scan(), in order, before lws
 * parses it. scan() splits the stream into request heads and bodies
 * (Content-Length) and keeps each head's request line, in order, with what
 * is wrong with it: repeated or conflicting Content-Length,
 * Transfer-Encoding with Content-Length, obsolete line folding. Each request
 * lws reports takes the next head: the request event carries its line as
 * raw_line (Lua routes on it, after checking it decodes to lws's path) and
 * a refused head is answered 400 straight on the socket (at once when no
 * request is in flight, the read lws is in failing so lws never parses it;
 * else when lws reaches it), and the connection closed. lws gets one
 * request at a time: what a read brings past the end of a request
 * (pipelined requests) is held back in c->stash and handed to lws by its
 * next reads, which on_wake prompts once the response before is out; lws's
 * own buffering of pipelined requests (which mislays their bodies and
 * stalls on an empty line) is never used.
 *
 * lws's uv poll callback for each connection is wrapped too: the wrapper
 * knows which connection lws is parsing, which is how an oversized head
 * (lws only logs "Ran out of header data space" and drops the connection)
 * gets its 431, and it asks for UV_DISCONNECT, so a client that hangs up
 * while its request runs (a stream that writes nothing for a while, a wait)
 * is dropped at once rather than at the idle timeout. lws restarts its poll
 * (uv_poll_start) whenever it changes the events it waits for, which puts
 * its own callback back; the wrapper is put back after every lws callback
 * for the connection and after every poll event. */
static uv_poll_cb lws_poll_cb;                        /* lws's callback: one function for every socket */
static struct conn *servicing;                        /* the connection whose socket event lws handles now */
static ssize_t (*lws_recv)(int, void *, size_t, int); /* what lws's recv slot held */
static size_t scan(conn *c, char *buf, size_t n, size_t *used);
static void want_wake(conn *c);
static conn *conn_by_fd(int fd);
static void refuse_bad(conn *c, const char *why);

/* ---- output queue -------------------------------------------------------- */

static out_chunk *chunk_new(int kind, const void *data, size_t len) {
  out_chunk *c = (out_chunk *)malloc(sizeof *c + LWS_PRE + len);
  if (!c) return NULL;
  c->next = NULL;
  c->kind = kind;
  c->more = 0;
  c->len = len;
  c->off = 0;
  c->data = c->mem + LWS_PRE;
  if (data && len) memcpy(c->data, data, len);
  return c;
}

static void queue_push(conn *c, out_chunk *ch) {
  if (c->tail) c->tail->next = ch;
  else c->head = ch;
  c->tail = ch;
  c->queued += ch->len;
}

static void queue_free(conn *c) {
  while (c->head) {
    out_chunk *n = c->head->next;
    free(c->head);
    c->head = n;
  }
  c->tail = NULL;
  c->queued = 0;
}

/* ---- events to Lua ------------------------------------------------------- */

static mb_core *srv_core(server *s) { return s->h->core; }

/* Push the event callback and its first two arguments; NULL if Lua is gone. */
static lua_State *event_begin(server *s, const char *kind, lua_Integer id) {
  if (srv_core(s)->dead) return NULL;
  lua_State *cbL = mb_handle_push_cb(s->h, CB_EVENT);
  if (!cbL) return NULL;
  lua_pushstring(cbL, kind);
  lua_pushinteger(cbL, id);
  return cbL;
}

static void emit_simple(server *s, const char *kind, lua_Integer id) {
  lua_State *cbL = event_begin(s, kind, id);
  if (cbL) mb_call(srv_core(s), cbL, 2);
}

/* ---- connections ---------------------------------------------------------- */

static conn *conn_of(server *s, struct lws *wsi) {
  conn *c = (conn *)lws_get_opaque_user_data(wsi);
  if (c || !s) return c;
  c = (conn *)calloc(1, sizeof *c);
  if (!c) return NULL;
  c->srv = s;
  c->wsi = wsi;
  c->req_ref = LUA_NOREF;
  c->next = s->conns;
  if (c->next) c->next->prev = c;
  s->conns = c;
  s->nconns++;
  c->over = s->nconns > s->max_conns;
  lws_set_opaque_user_data(wsi, c);
  return c;
}

static void request_reset(conn *c) {
  mb_core *core = srv_core(c->srv);
  if (c->req_ref != LUA_NOREF && !core->dead) luaL_unref(core->cbL, LUA_REGISTRYINDEX, c->req_ref);
  c->req_ref = LUA_NOREF;
  free(c->body);
  c->body = NULL;
  c->body_len = c->body_cap = 0;
  c->too_large = 0;
  c->id = 0;
  c->responding = c->finishing = 0;
  free(c->reject_body);
  free(c->reject_type);
  free(c->reject_headers);
  c->reject_body = c->reject_type = c->reject_headers = NULL;
  c->reject_headers_len = 0;
  c->reject_status = 0;
  queue_free(c);
}

static void conn_gone(server *s, struct lws *wsi) {
  conn *c = (conn *)lws_get_opaque_user_data(wsi);
  if (!c) return;
  lws_set_opaque_user_data(wsi, NULL);
  if (servicing == c) servicing = NULL;
  lua_Integer id = c->id;
  request_reset(c);
  while (c->heads) {
    head *h = c->heads;
    c->heads = h->next;
    free(h->line);
    free(h);
  }
  free(c->scan_line);
  free(c->scan_target);
  free(c->stash);
  if (c->prev) c->prev->next = c->next;
  else s->conns = c->next;
  if (c->next) c->next->prev = c->prev;
  s->nconns--;
  free(c);
  if (id) emit_simple(s, "closed", id);
}

/* The client must send (or read) something within the idle timeout. */
static void arm(conn *c) { c->deadline = uv_now(srv_core(c->srv)->loop) + (uint64_t)c->srv->idle_ms; }

static conn *conn_by_id(server *s, lua_Integer id) {
  if (id <= 0) return NULL;
  for (conn *c = s->conns; c; c = c->next)
    if (c->id == id) return c;
  return NULL;
}

static conn *conn_by_poll(uv_poll_t *p) {
  for (server *s = live_servers; s; s = s->next_server)
    for (conn *c = s->conns; c; c = c->next)
      if (c->poll == p) return c;
  return NULL;
}

static void on_conn_poll(uv_poll_t *p, int status, int events);

static void find_poll(uv_handle_t *h, void *arg) {
  conn *c = (conn *)arg;
  uv_os_fd_t fd;
  if (c->poll || h->type != UV_POLL || uv_is_closing(h)) return;
  if (uv_fileno(h, &fd) == 0 && fd == lws_get_socket_fd(c->wsi)) c->poll = (uv_poll_t *)h;
}

/* Wrap lws's poll callback for c's socket (again, if lws restarted it). */
static void hook_poll(conn *c) {
  if (!c->poll) {
    if (c->poll_walked || lws_get_socket_fd(c->wsi) < 0) return;
    c->poll_walked = 1;
    uv_walk(srv_core(c->srv)->loop, find_poll, c);
    if (!c->poll) return;
  }
  uv_poll_cb cb = c->poll->poll_cb;
  if (!cb || uv_is_closing((uv_handle_t *)c->poll)) return;
  if (cb != on_conn_poll) {
    if (lws_poll_cb && cb != lws_poll_cb) return; /* not lws's: leave it alone */
    lws_poll_cb = cb;
    c->poll->poll_cb = on_conn_poll;
  }
  /* also hear of a hang-up while lws does not read (see raw heads) */
  unsigned int pe = c->poll->io_watcher.pevents;
  if (uv_is_active((uv_handle_t *)c->poll) && !(pe & EPOLLRDHUP)) {
    int ev = ((pe & POLLIN) ? UV_READABLE : 0) | ((pe & POLLOUT) ? UV_WRITABLE : 0) |
             ((pe & POLLPRI) ? UV_PRIORITIZED : 0) | UV_DISCONNECT;
    uv_poll_start(c->poll, ev, on_conn_poll);
  }
}

/* ---- accept pauses --------------------------------------------------------------
 * lws 4.1 answers a failed accept (EMFILE: the runtime is out of fds) with a
 * log line and nothing else; the listening socket stays readable, so the
 * loop would spin on it at full CPU, printing the line each time. Its poll
 * is stopped instead for ACCEPT_PAUSE_MS at a time (the connections wait in
 * the kernel's backlog), the failures counted and reported once in a while;
 * everything else goes on being served. */
#define ACCEPT_PAUSE_MS 100
#define ACCEPT_LOG_EVERY_MS 10000
static server *accepting;        /* the server whose listening socket lws is servicing */
static uv_poll_cb lws_listen_cb; /* lws's callback for it */
static void on_listen_poll(uv_poll_t *p, int status, int events);

static int is_listener(int fd, const server *s) {
  int acc = 0;
  socklen_t len = sizeof acc;
  if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &acc, &len) < 0 || !acc) return 0;
  struct sockaddr_storage ss;
  len = sizeof ss;
  if (getsockname(fd, (struct sockaddr *)&ss, &len) < 0) return 0;
  if (ss.ss_family == AF_UNIX)
    return s->unix_path[0] && strcmp(((struct sockaddr_un *)&ss)->sun_path, s->unix_path) == 0;
  if (ss.ss_family == AF_INET && s->vh)
    return ntohs(((struct sockaddr_in *)&ss)->sin_port) == lws_get_vhost_listen_port(s->vh);
  return 0;
}

static void find_listen(uv_handle_t *h, void *arg) {
  server *s = (server *)arg;
  uv_os_fd_t fd;
  if (s->listen_poll || h->type != UV_POLL || uv_is_closing(h)) return;
  if (uv_fileno(h, &fd) == 0 && is_listener(fd, s)) s->listen_poll = (uv_poll_t *)h;
}

/* Wrap lws's poll callback for the listening socket (again, if lws restarted it). */
static void hook_listen(server *s) {
  if (!s->listen_poll) {
    if (s->listen_walks >= 2 || s->destroying) return;
    s->listen_walks++;
    uv_walk(srv_core(s)->loop, find_listen, s);
    if (!s->listen_poll) return;
  }
  uv_poll_t *p = s->listen_poll;
  if (uv_is_closing((uv_handle_t *)p) || !p->poll_cb || p->poll_cb == on_listen_poll) return;
  if (lws_listen_cb && p->poll_cb != lws_listen_cb) return; /* not lws's: leave it alone */
  lws_listen_cb = p->poll_cb;
  p->poll_cb = on_listen_poll;
}

static server *server_by_listen(uv_poll_t *p) {
  for (server *s = live_servers; s; s = s->next_server)
    if (s->listen_poll == p) return s;
  return NULL;
}

static void on_listen_poll(uv_poll_t *p, int status, int events) {
  server *prev = accepting;
  accepting = server_by_listen(p);
  if (lws_listen_cb) lws_listen_cb(p, status, events);
  accepting = prev;
}

/* lws said accept failed (inside on_listen_poll): stop polling for a while */
static void pause_accept(server *s, const char *line) {
  uint64_t now = uv_now(srv_core(s)->loop);
  s->accept_failed++;
  if (s->listen_poll && !uv_is_closing((uv_handle_t *)s->listen_poll)) {
    uv_poll_stop(s->listen_poll);
    s->accept_resume = now + ACCEPT_PAUSE_MS;
  }
  if (!s->accept_logged || now - s->accept_logged >= ACCEPT_LOG_EVERY_MS) {
    s->accept_logged = now;
    size_t n = strcspn(line, "\n");
    fprintf(stderr, "moonbox: http: %.*s: not accepting for %d ms at a time until it succeeds (%lld so far)\n", (int)n,
            line, ACCEPT_PAUSE_MS, (long long)s->accept_failed);
  }
}

/* From the loop's prepare and the service tick: poll again after a pause
 * (lws restarts the poll itself when a connection closes: it is stopped
 * again until the pause is over). */
static void resume_accept(server *s) {
  if (!s->accept_resume) return;
  uv_poll_t *p = s->listen_poll;
  if (!p || s->destroying || uv_is_closing((uv_handle_t *)p)) {
    s->accept_resume = 0;
    return;
  }
  if (uv_now(srv_core(s)->loop) < s->accept_resume) {
    if (uv_is_active((uv_handle_t *)p)) uv_poll_stop(p);
    return;
  }
  s->accept_resume = 0;
  uv_poll_start(p, UV_READABLE, on_listen_poll);
}

/* ---- the request stream scanner ---- */

enum { SCAN_LINE, SCAN_HEADERS, SCAN_BODY, SCAN_OPAQUE };
#define SCAN_MAX_LINE (8192 + 512)

static conn *conn_by_fd(int fd) {
  for (server *s = live_servers; s; s = s->next_server)
    for (conn *c = s->conns; c; c = c->next)
      if (c->wsi && lws_get_socket_fd(c->wsi) == fd) return c;
  return NULL;
}

static int ieq_prefix(const char *line, size_t len, const char *name) {
  size_t n = strlen(name);
  if (len < n) return 0;
  for (size_t i = 0; i < n; i++) {
    char ch = line[i];
    if (ch >= 'A' && ch <= 'Z') ch = (char)(ch + 32);
    if (ch != name[i]) return 0;
  }
  return 1;
}

/* A header line "name: value" whose name is `name` (lowercase, no colon):
 * the value without surrounding blanks, or NULL. A blank before the colon
 * makes the name another one (and such a line is refused below). */
static const char *header_value(const char *line, size_t len, const char *name, size_t *vlen) {
  size_t n = strlen(name);
  if (len <= n || line[n] != ':' || !ieq_prefix(line, len, name)) return NULL;
  const char *v = line + n + 1, *end = line + len;
  while (v < end && (*v == ' ' || *v == '\t')) v++;
  while (end > v && (end[-1] == ' ' || end[-1] == '\t')) end--;
  *vlen = (size_t)(end - v);
  return v;
}

static void head_push(conn *c, char *line, const char *bad) {
  head *h = (head *)calloc(1, sizeof *h);
  if (!h) {
    free(line);
    c->scan_state = SCAN_OPAQUE;
    return;
  }
  h->line = line;
  h->bad = bad;
  if (c->heads_tail) c->heads_tail->next = h;
  else c->heads = h;
  c->heads_tail = h;
}

/* One complete line of the head (without its CR LF). */
static void scan_line_done(conn *c, const char *line, size_t len) {
  if (c->scan_state == SCAN_LINE) {
    if (len == 0) return; /* empty lines before a request line are allowed (RFC 9112 2.2) */
    c->scan_target = (char *)malloc(len + 1);
    if (!c->scan_target) {
      c->scan_state = SCAN_OPAQUE;
      return;
    }
    memcpy(c->scan_target, line, len);
    c->scan_target[len] = 0;
    c->scan_cl = c->scan_te = c->scan_upgrade = 0;
    c->scan_bad = 0;
    c->scan_body = 0;
    c->scan_state = SCAN_HEADERS;
    return;
  }
  static const char *const why[] = {
    NULL,
    "repeated Content-Length headers",
    "Transfer-Encoding together with Content-Length",
    "obsolete line folding (a header line starting with a space or tab)",
    "an invalid Content-Length",
    "a blank between a header name and its colon",
  };
  if (len == 0) { /* the end of the head */
    char *line0 = c->scan_target;
    c->scan_target = NULL;
    int bad = c->scan_bad;
    if (!bad && c->scan_te && c->scan_cl) bad = 2;
    head_push(c, line0, why[bad]);
    if (bad) {
      c->scan_state = SCAN_OPAQUE; /* the connection is closed after the 400 */
      if (!c->id && c->heads == c->heads_tail) refuse_bad(c, why[bad]);
    } else if (c->scan_te || c->scan_upgrade) {
      c->scan_state = SCAN_OPAQUE; /* answered 411 (and closed), or a WebSocket from here on */
    } else {
      c->scan_state = c->scan_body ? SCAN_BODY : SCAN_LINE;
    }
    return;
  }
  if (line[0] == ' ' || line[0] == '\t') {
    if (!c->scan_bad) c->scan_bad = 3;
    return;
  }
  const char *colon = memchr(line, ':', len);
  if (colon && colon > line && (colon[-1] == ' ' || colon[-1] == '\t')) {
    if (!c->scan_bad) c->scan_bad = 5;
    return;
  }
  size_t vlen;
  const char *v;
  if ((v = header_value(line, len, "content-length", &vlen))) {
    if (c->scan_cl++) {
      if (!c->scan_bad) c->scan_bad = 1;
      return;
    }
    unsigned long long n = 0;
    if (vlen == 0 || vlen > 18) {
      if (!c->scan_bad) c->scan_bad = 4;
      return;
    }
    for (size_t i = 0; i < vlen; i++) {
      if (v[i] < '0' || v[i] > '9') {
        if (!c->scan_bad) c->scan_bad = 4;
        return;
      }
      n = n * 10 + (unsigned long long)(v[i] - '0');
    }
    c->scan_body = n;
  } else if ((v = header_value(line, len, "transfer-encoding", &vlen))) {
    c->scan_te = 1;
  } else if ((v = header_value(line, len, "upgrade", &vlen))) {
    /* a WebSocket's frames follow its head; other upgrades lws does not take */
    for (size_t i = 0; i + 9 <= vlen; i++)
      if (ieq_prefix(v + i, vlen - i, "websocket")) c->scan_upgrade = 1;
  }
}

/* Bytes lws has just read from c's socket, in the order the client sent
 * them; returns how many of them lws gets. Empty lines between requests
 * are taken out (lws 4.1 stalls on one before a pipelined request; RFC 9112
 * 2.2 lets a server ignore them). */
static size_t scan(conn *c, char *buf, size_t n, size_t *used) {
  char *p = buf, *w = buf;
  int ended = 0; /* a request (head and body) ended in this buffer */
  while (n) {
    if (ended && c->scan_state == SCAN_LINE) break; /* the next request waits (see raw heads) */
    if (c->scan_state == SCAN_OPAQUE) {
      memmove(w, p, n);
      w += n;
      p += n;
      n = 0;
      break;
    }
    if (c->scan_state == SCAN_BODY) {
      size_t k = c->scan_body < n ? (size_t)c->scan_body : n;
      memmove(w, p, k);
      w += k;
      c->scan_body -= k;
      p += k;
      n -= k;
      if (!c->scan_body) {
        c->scan_state = SCAN_LINE;
        ended = 1;
      }
      continue;
    }
    if (c->scan_state == SCAN_LINE && c->scan_len == 0 && (*p == '\r' || *p == '\n')) {
      p++;
      n--;
      continue;
    }
    const char *eol = (const char *)memchr(p, '\n', n);
    size_t take = eol ? (size_t)(eol - p) + 1 : n;
    if (c->scan_len + take > SCAN_MAX_LINE || (!c->scan_line && !(c->scan_line = (char *)malloc(SCAN_MAX_LINE)))) {
      c->scan_state = SCAN_OPAQUE; /* over lws's limit too: lws answers 431 */
      continue;
    }
    memcpy(c->scan_line + c->scan_len, p, take);
    memmove(w, p, take);
    w += take;
    c->scan_len += take;
    p += take;
    n -= take;
    if (!eol) break;
    size_t len = c->scan_len - 1; /* without the LF */
    if (len && c->scan_line[len - 1] == '\r') len--;
    c->scan_len = 0;
    int in_head = c->scan_state == SCAN_HEADERS;
    scan_line_done(c, c->scan_line, len);
    if (in_head && c->scan_state == SCAN_LINE) ended = 1; /* a head without a body */
  }
  *used = (size_t)(p - buf);
  return (size_t)(w - buf);
}

/* What lws's recv() calls reach: the bytes lws reads from a client go
 * through the scanner first, one request at a time. What the client sent
 * past the end of a request (pipelined requests) is held back in c->stash
 * and handed to lws once it reads for the next request, so lws never
 * parses a request out of its own buffer (where lws 4.1 mislays bodies). */
static ssize_t recv_hook(int fd, void *buf, size_t len, int flags) {
  conn *c = (flags & MSG_PEEK) ? NULL : conn_by_fd(fd);
  if (!c) return lws_recv(fd, buf, len, flags);
  ssize_t n;
  int from_stash = c->stash_off < c->stash_len;
  if (from_stash) {
    size_t k = c->stash_len - c->stash_off;
    if (k > len) k = len;
    memcpy(buf, c->stash + c->stash_off, k);
    c->stash_off += k;
    n = (ssize_t)k;
  } else {
    n = lws_recv(fd, buf, len, flags);
  }
  if (n <= 0) return n;
  int saved = errno;
  size_t used = 0;
  size_t out = scan(c, (char *)buf, (size_t)n, &used);
  if (c->head_refused) {
    errno = ECONNRESET;
    return -1;
  }                       /* answered: lws drops it unread */
  if (used < (size_t)n) { /* hold back the rest */
    if (from_stash) {
      c->stash_off -= (size_t)n - used;
    } else {
      char *st = (char *)malloc((size_t)n - used);
      if (!st) {
        errno = ENOMEM;
        return -1;
      }
      memcpy(st, (char *)buf + used, (size_t)n - used);
      free(c->stash);
      c->stash = st;
      c->stash_len = (size_t)n - used;
      c->stash_off = 0;
    }
  }
  if (c->stash_off >= c->stash_len) {
    free(c->stash);
    c->stash = NULL;
    c->stash_len = c->stash_off = 0;
  } else if (c->scan_state != SCAN_LINE) {
    want_wake(c); /* lws reads on for this request's head or body: from the stash */
  }
  errno = saved;
  if (out == 0) {
    errno = EAGAIN;
    return -1;
  } /* only empty lines: nothing yet */
  return (ssize_t)out;
}

typedef struct {
  const char *lib, *sym; /* the library, the import */
  void *hook;            /* what its GOT slot should hold */
  void **orig;           /* set to what it held */
  int found, patched;
} got_search;

/* Point g->lib's import of g->sym at g->hook (see raw heads, lws's event pipe). */
static int patch_got_slot(struct dl_phdr_info *info, size_t size, void *arg) {
  (void)size;
  got_search *g = (got_search *)arg;
  if (!info->dlpi_name || !strstr(info->dlpi_name, g->lib)) return 0;
  g->found = 1;
  ElfW(Addr) base = info->dlpi_addr;
  const ElfW(Dyn) *dyn = NULL;
  ElfW(Addr) relro_start = 0, relro_end = 0;
  long page = sysconf(_SC_PAGESIZE);
  for (int i = 0; i < info->dlpi_phnum; i++) {
    const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
    if (ph->p_type == PT_DYNAMIC) dyn = (const ElfW(Dyn) *)(base + ph->p_vaddr);
    if (ph->p_type == PT_GNU_RELRO) {
      relro_start = (base + ph->p_vaddr) & ~(ElfW(Addr))(page - 1);
      relro_end = (base + ph->p_vaddr + ph->p_memsz) & ~(ElfW(Addr))(page - 1);
    }
  }
  if (!dyn) return 1;
  ElfW(Addr) jmprel = 0, rela = 0, symtab = 0, strtab = 0;
  size_t jmprel_sz = 0, rela_sz = 0;
  for (const ElfW(Dyn) *d = dyn; d->d_tag != DT_NULL; d++) {
    switch (d->d_tag) {
    case DT_JMPREL: jmprel = d->d_un.d_ptr; break;
    case DT_PLTRELSZ: jmprel_sz = d->d_un.d_val; break;
    case DT_RELA: rela = d->d_un.d_ptr; break;
    case DT_RELASZ: rela_sz = d->d_un.d_val; break;
    case DT_SYMTAB: symtab = d->d_un.d_ptr; break;
    case DT_STRTAB: strtab = d->d_un.d_ptr; break;
    default: break;
    }
  }
  /* glibc relocates these addresses in place; be sure either way */
  if (symtab && symtab < base) symtab += base;
  if (strtab && strtab < base) strtab += base;
  if (jmprel && jmprel < base) jmprel += base;
  if (rela && rela < base) rela += base;
  if (!symtab || !strtab) return 1;
  const ElfW(Sym) *syms = (const ElfW(Sym) *)symtab;
  const char *strs = (const char *)strtab;
  struct {
    ElfW(Addr) at;
    size_t sz;
  } tables[2] = {{jmprel, jmprel_sz}, {rela, rela_sz}};
  for (int t = 0; t < 2; t++) {
    if (!tables[t].at) continue;
    const ElfW(Rela) *r = (const ElfW(Rela) *)tables[t].at;
    for (size_t i = 0; i < tables[t].sz / sizeof *r; i++) {
      size_t sym = ELF64_R_SYM(r[i].r_info);
      if (!sym || strcmp(strs + syms[sym].st_name, g->sym) != 0) continue;
      void **slot = (void **)(base + r[i].r_offset);
      if (*slot == g->hook) {
        g->patched = 1;
        continue;
      }
      ElfW(Addr) pg = (ElfW(Addr))slot & ~(ElfW(Addr))(page - 1);
      int ro = pg >= relro_start && pg < relro_end;
      if (ro && mprotect((void *)pg, (size_t)page, PROT_READ | PROT_WRITE) != 0) continue;
      if (!*g->orig) *g->orig = *slot;
      *slot = g->hook;
      if (ro) mprotect((void *)pg, (size_t)page, PROT_READ);
      g->patched = 1;
    }
  }
  return 1;
}

/* ---- lws's event pipe ------------------------------------------------------------
 * lws 4.1 on a uv loop closes the eventfd of its event pipe twice: the
 * first lws_context_destroy starts the close of the pipe's uv poll and
 * closes the eventfd (lws_plat_pipe_close), and the poll's close callback,
 * at the end of that loop iteration, closes the pipe wsi's fd, the same
 * number, again (__lws_close_free_wsi_final). In between the number is
 * free: a file another thread opens then (the thread pool: proc_scan, a
 * tree removal, uv_fs_*) gets it and loses it to the second close (proc_scan
 * failed with "opendir /proc: EBADF"). So lws's imports of eventfd() and
 * close() are pointed at pipe_eventfd and pipe_close: the eventfds lws makes
 * are noted, the first close of one leaves it open (held: the number stays
 * taken), the second closes it. One still held when its context is gone
 * (an lws that closes it once) is closed then. lws runs on the loop thread
 * only, as do these. */
#define MAX_PIPES 64 /* contexts alive at once; past that, lws's own closes */

typedef struct {
  int fd;
  int held;  /* lws closed it once: ours until lws closes it again */
  server *s; /* whose context made it; NULL once that is unknown or gone */
} lws_pipe;

static lws_pipe pipes[MAX_PIPES];
static int npipes;
static server *creating;                      /* the server whose lws_create_context runs */
static int (*lws_eventfd)(unsigned int, int); /* what lws's eventfd slot held */
static int (*lws_close)(int);                 /* what lws's close slot held */

static int pipe_eventfd(unsigned int initval, int flags) {
  int fd = lws_eventfd(initval, flags);
  if (fd < 0) return fd;
  for (int i = 0; i < npipes; i++)
    if (pipes[i].fd == fd) { /* a stale note: the number was free */
      pipes[i] = pipes[--npipes];
      break;
    }
  if (npipes < MAX_PIPES) pipes[npipes++] = (lws_pipe){fd, 0, creating};
  return fd;
}

static int pipe_close(int fd) {
  for (int i = 0; i < npipes; i++) {
    if (pipes[i].fd != fd) continue;
    if (!pipes[i].held) {
      pipes[i].held = 1;
      return 0;
    }
    pipes[i] = pipes[--npipes];
    break;
  }
  return lws_close(fd);
}

/* s's context is gone (gone: lws closes none of its fds again, else whether
 * it will is unknown: its pipes then get lws's closes, two at most). */
static void pipes_done(server *s, int gone) {
  for (int i = 0; i < npipes;) {
    if (pipes[i].s != s) {
      i++;
    } else if (!gone) {
      pipes[i++].s = NULL;
    } else {
      if (pipes[i].held) lws_close(pipes[i].fd);
      pipes[i] = pipes[--npipes];
    }
  }
}

/* Point libwebsockets' recv() at recv_hook, and its eventfd() and close() at
 * pipe_eventfd and pipe_close where it has them (an lws without eventfd
 * makes no pipe to note); 0 when done (or done before). */
static int hook_lws_imports(void) {
  got_search g = {"libwebsockets", "recv", (void *)recv_hook, (void **)&lws_recv, 0, 0};
  dl_iterate_phdr(patch_got_slot, &g);
  if (!g.patched || !lws_recv) return -1;
  got_search pg[2] = {{"libwebsockets", "eventfd", (void *)pipe_eventfd, (void **)&lws_eventfd, 0, 0},
                      {"libwebsockets", "close", (void *)pipe_close, (void **)&lws_close, 0, 0}};
  for (int i = 0; i < 2; i++) dl_iterate_phdr(patch_got_slot, &pg[i]);
  return 0;
}

/* Hand held-back bytes to lws: a readable event for each connection whose
 * stash lws should read now, once per want_wake (lws that does not read
 * then is not asked again, so this never spins). */
static void on_conn_poll(uv_poll_t *p, int status, int events);

static int conn_live(server *s, conn *c) {
  for (conn *x = s->conns; x; x = x->next)
    if (x == c) return 1;
  return 0;
}

static void on_wake(uv_idle_t *idle) {
  server *s = (server *)idle->data;
  int more = 0;
  for (int again = 1; again;) {
    again = 0;
    for (conn *c = s->conns; c; c = c->next) {
      if (c->stash_wake != 1) continue;
      c->stash_wake = 0;
      if (!c->stash || c->kill || !c->poll || uv_is_closing((uv_handle_t *)c->poll)) continue;
      size_t before = c->stash_off;
      c->stash_tries++;
      on_conn_poll(c->poll, 0, UV_READABLE | UV_WRITABLE); /* may free c */
      /* lws did not read (it finishes the last transaction first): again next turn, a few times */
      if (conn_live(s, c) && c->stash && c->stash_off == before && !c->stash_wake && c->stash_tries < 4)
        c->stash_wake = 2;
      again = 1;
      break;
    }
  }
  for (conn *c = s->conns; c; c = c->next) {
    if (c->stash_wake == 2) c->stash_wake = 1;
    more |= c->stash_wake;
  }
  if (!more && s->wake_on) uv_idle_stop(idle);
}

static void want_wake(conn *c) {
  server *s = c->srv;
  c->stash_tries = 0;
  c->stash_wake = 1;
  if (s->wake_on && !uv_is_active((uv_handle_t *)&s->wake)) uv_idle_start(&s->wake, on_wake);
}

/* Before the loop polls: lws restarts a socket's poll (accepting it, or
 * changing its events) from wherever it is, so the wrappers are put back
 * here, ahead of the events they are for. */
static void on_rehook(uv_prepare_t *p) {
  server *s = (server *)p->data;
  servicing = NULL;
  for (conn *c = s->conns; c; c = c->next) hook_poll(c);
  hook_listen(s);
  resume_accept(s);
  /* heads answered 400/431 on the socket itself (inside lws): told to Lua
   * here, outside lws, as "refused" events (the access log, /metrics) */
  for (; s->heads_400 > 0 && !s->destroying; s->heads_400--) emit_simple(s, "refused", 400);
  for (; s->heads_431 > 0 && !s->destroying; s->heads_431--) emit_simple(s, "refused", 431);
}

static void on_conn_poll(uv_poll_t *p, int status, int events) {
  conn *c = conn_by_poll(p);
  if (c && status == 0 && (events & UV_DISCONNECT) && c->id && !c->is_ws && !c->kill && !c->stash) {
    /* the client hung up (or shut its sending side) while its request runs:
     * with nothing left unread, it is gone; drop it now (lws, not reading
     * while it answers, would notice only at the idle timeout) */
    char b;
    ssize_t n = recv(lws_get_socket_fd(c->wsi), &b, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      c->kill = 1;
      lws_set_timeout(c->wsi, PENDING_TIMEOUT_USER_OK, LWS_TO_KILL_SYNC); /* frees c */
      return;
    }
  }
  events &= ~UV_DISCONNECT;
  if (status == 0 && !events) {
    if (c) hook_poll(c);
    return;
  }

  conn *prev = servicing;
  servicing = c;
  lws_poll_cb(p, status, events);
  servicing = prev;
  if ((c = conn_by_poll(p))) hook_poll(c); /* still open: lws may have restarted its poll */
}

/* 431 for a head over max_http_header_data, written straight to the socket
 * (lws is about to drop the connection without a word). The unread rest of
 * the head is read and dropped first, so the close is not a reset that
 * could destroy the response before the client reads it. */
static void refuse_head(conn *c) {
  static const char body[] =
    "{\"code\":\"REQUEST_HEADER_FIELDS_TOO_LARGE\",\"httpStatus\":431,"
    "\"message\":\"the request head is larger than 8192 bytes\",\"context\":{\"limit\":8192}}\n";
  char resp[512];
  int fd = lws_get_socket_fd(c->wsi);
  if (c->head_refused || fd < 0) return;
  c->head_refused = 1;
  c->srv->heads_431++;
  char sink[16384];
  for (int i = 0; i < 64 && recv(fd, sink, sizeof sink, MSG_DONTWAIT) > 0; i++) {}
  int n = snprintf(resp, sizeof resp,
                   "HTTP/1.1 431 Request Header Fields Too Large\r\n"
                   "content-type: application/json\r\ncontent-length: %zu\r\nconnection: close\r\n\r\n%s",
                   sizeof body - 1, body);
  if (n > 0 && send(fd, resp, (size_t)n, MSG_NOSIGNAL | MSG_DONTWAIT) == n) shutdown(fd, SHUT_WR);
}

/* 400 for a refused head (see scan), written straight to the socket while
 * no request is in flight; the read lws is in then fails, so lws never
 * parses the head (and what follows it). */
static void refuse_bad(conn *c, const char *why) {
  char body[384], resp[768];
  int fd = lws_get_socket_fd(c->wsi);
  if (c->head_refused || fd < 0) return;
  c->head_refused = 1;
  c->srv->heads_400++;
  char sink[16384];
  for (int i = 0; i < 64 && lws_recv(fd, sink, sizeof sink, MSG_DONTWAIT) > 0; i++) {}
  int bn = snprintf(body, sizeof body,
                    "{\"code\":\"BAD_REQUEST\",\"httpStatus\":400,"
                    "\"message\":\"refused request head: %s\",\"context\":{}}\n",
                    why);
  if (bn < 0 || (size_t)bn >= sizeof body) return;
  int n = snprintf(resp, sizeof resp,
                   "HTTP/1.1 400 Bad Request\r\n"
                   "content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s",
                   bn, body);
  if (n > 0 && (size_t)n < sizeof resp && send(fd, resp, (size_t)n, MSG_NOSIGNAL | MSG_DONTWAIT) == n)
    shutdown(fd, SHUT_WR);
}

/* lws reports a request whose head the scanner refused (it was pipelined
 * behind another, so it could not be answered when it was read): every
 * response before it is out (lws takes a pipelined request only once the
 * one before has completed), so the 400 goes straight to the socket, and
 * the connection closes with the body and whatever follows unread. */
static int refused_head(conn *c) {
  head *h = c->heads;
  if (!h || !h->bad) return 0;
  if (!lws_partial_buffered(c->wsi)) refuse_bad(c, h->bad); /* else: bytes of ours still queued, just close */
  return 1;
}

static int append_body(conn *c, const void *in, size_t len) {
  if (c->body_len + len > c->srv->max_body) return -1;
  if (c->body_len + len > c->body_cap) {
    size_t cap = c->body_cap ? c->body_cap : 4096;
    while (cap < c->body_len + len) cap *= 2;
    if (cap > c->srv->max_body) cap = c->srv->max_body;
    char *nb = (char *)realloc(c->body, cap);
    if (!nb) return -1;
    c->body = nb;
    c->body_cap = cap;
  }
  memcpy(c->body + c->body_len, in, len);
  c->body_len += len;
  return 0;
}

/* ---- the request table ------------------------------------------------------ */

static const char *const method_names[] = {"GET",    "POST",    "OPTIONS", "PUT",  "PATCH",
                                           "DELETE", "CONNECT", "HEAD",    ":path"};

static void push_header_value(lua_State *L, struct lws *wsi, int token) {
  int n = lws_hdr_total_length(wsi, (enum lws_token_indexes)token);
  char *buf = (char *)malloc((size_t)n + 1);
  if (!buf || lws_hdr_copy(wsi, buf, n + 1, (enum lws_token_indexes)token) < 0) {
    lua_pushliteral(L, "");
  } else {
    lua_pushstring(L, buf);
  }
  free(buf);
}

/* {method, path, args = {fragments}, headers = {lowercase = value}, websocket, peer} */
static void push_request(lua_State *L, struct lws *wsi, int websocket) {
  lua_createtable(L, 0, 7);
  char *uri = NULL;
  int uri_len = 0;
  int m = lws_http_get_uri_and_method(wsi, &uri, &uri_len);
  lua_pushstring(L, m >= 0 && m < (int)(sizeof method_names / sizeof *method_names) ? method_names[m] : "UNKNOWN");
  lua_setfield(L, -2, "method");
  if (uri) lua_pushlstring(L, uri, (size_t)uri_len);
  else lua_pushliteral(L, "/");
  lua_setfield(L, -2, "path");
  lua_newtable(L);
  char frag[8192];
  for (int i = 0; lws_hdr_copy_fragment(wsi, frag, sizeof frag, WSI_TOKEN_HTTP_URI_ARGS, i) > 0; i++) {
    lua_pushstring(L, frag);
    lua_rawseti(L, -2, i + 1);
  }
  lua_setfield(L, -2, "args");
  lua_newtable(L);
  for (int t = WSI_TOKEN_HOST; t < WSI_TOKEN_COUNT; t++) {
    if (t == WSI_TOKEN_HTTP_URI_ARGS || t == WSI_TOKEN_GET_URI || t == WSI_TOKEN_POST_URI ||
        t == WSI_TOKEN_OPTIONS_URI || t == WSI_TOKEN_PATCH_URI || t == WSI_TOKEN_PUT_URI || t == WSI_TOKEN_DELETE_URI ||
        t == WSI_TOKEN_HEAD_URI || t == WSI_TOKEN_CONNECT || t == WSI_TOKEN_HTTP || t == WSI_TOKEN_HTTP1_0)
      continue;
    if (lws_hdr_total_length(wsi, (enum lws_token_indexes)t) <= 0) continue;
    const char *name = (const char *)lws_token_to_string((enum lws_token_indexes)t);
    if (!name || name[0] == ':' || name[0] == 0) continue;
    size_t nlen = strlen(name);
    if (nlen && name[nlen - 1] == ':') nlen--; /* lws names end with ':' */
    char lower[64];
    if (nlen >= sizeof lower) continue;
    for (size_t i = 0; i < nlen; i++) lower[i] = (char)((name[i] >= 'A' && name[i] <= 'Z') ? name[i] + 32 : name[i]);
    lua_pushlstring(L, lower, nlen);
    push_header_value(L, wsi, t);
    lua_rawset(L, -3);
  }
  lua_setfield(L, -2, "headers");
  lua_pushboolean(L, websocket);
  lua_setfield(L, -2, "websocket");
  char peer[64];
  peer[0] = 0;
  lws_get_peer_simple(wsi, peer, sizeof peer);
  lua_pushstring(L, peer);
  lua_setfield(L, -2, "peer");
  conn *c = (conn *)lws_get_opaque_user_data(wsi);
  head *h = c ? c->heads : NULL;
  if (h) {
    c->heads = h->next;
    if (!c->heads) c->heads_tail = NULL;
    lua_pushstring(L, h->line);
    lua_setfield(L, -2, "raw_line");
    free(h->line);
    free(h);
  }
}

static void emit_request(conn *c) {
  server *s = c->srv;
  lua_State *cbL = event_begin(s, "request", c->id);
  if (!cbL) return;
  lua_rawgeti(cbL, LUA_REGISTRYINDEX, c->req_ref);
  luaL_unref(cbL, LUA_REGISTRYINDEX, c->req_ref);
  c->req_ref = LUA_NOREF;
  if (c->over) {
    lua_pushboolean(cbL, 1);
    lua_setfield(cbL, -2, "over_limit");
  }
  if (c->too_large) {
    lua_pushboolean(cbL, 1);
    lua_setfield(cbL, -2, c->too_large == 2 ? "length_required" : "too_large");
    lua_pushnil(cbL);
  } else {
    lua_pushlstring(cbL, c->body ? c->body : "", c->body_len);
  }
  free(c->body);
  c->body = NULL;
  c->body_len = c->body_cap = 0;
  mb_call(srv_core(s), cbL, 4);
}

/* Take the request's headers now: they are gone once the body has arrived. */
static int begin_request(conn *c, int websocket) {
  server *s = c->srv;
  mb_core *core = srv_core(s);
  if (core->dead) return -1;
  c->id = ++s->next_id;
  push_request(core->cbL, c->wsi, websocket);
  c->req_ref = luaL_ref(core->cbL, LUA_REGISTRYINDEX);
  return 0;
}

/* ---- writing ---------------------------------------------------------------- */

static int write_http(conn *c) {
  struct lws *wsi = c->wsi;
  /* several pieces per callback while the socket takes them, as lws's own
   * file serving does: headers and a small body leave in one pass */
  for (int n_writes = 0; c->head && n_writes < 8; n_writes++) {
    if (n_writes && lws_send_pipe_choked(wsi)) break;
    out_chunk *ch = c->head;
    if (ch->kind == OUT_HEADERS) {
      if (lws_write(wsi, ch->data, ch->len, LWS_WRITE_HTTP_HEADERS) != (int)ch->len) return -1;
      ch->off = ch->len;
    } else {
      size_t n = ch->len - ch->off;
      if (n > HTTP_SLICE) n = HTTP_SLICE;
      int last = c->finishing && ch->next == NULL && ch->off + n == ch->len;
      /* lws may use the LWS_PRE bytes before the buffer: those are either
       * headroom or bytes of this chunk already sent */
      if (lws_write(wsi, ch->data + ch->off, n, last ? LWS_WRITE_HTTP_FINAL : LWS_WRITE_HTTP) != (int)n) return -1;
      ch->off += n;
      c->queued -= n;
    }
    if (ch->off == ch->len) {
      c->head = ch->next;
      if (!c->head) c->tail = NULL;
      if (ch->kind == OUT_HEADERS) c->queued -= ch->len;
      free(ch);
    }
  }
  if (c->head) {
    lws_callback_on_writable(wsi);
    arm(c); /* a reader that stops reading is dropped */
    return 0;
  }
  c->deadline = 0;
  if (c->finishing) {
    lua_Integer id = c->id;
    int close_after = c->close_after;
    request_reset(c);
    emit_simple(c->srv, "done", id);
    if (close_after) return -1;
    if (lws_http_transaction_completed(wsi)) return -1;
    /* kept alive: the next request head must arrive within the idle timeout */
    arm(c);
    hook_poll(c);
    if (c->stash) want_wake(c); /* it is here already: held back (see raw heads) */
    return 0;
  }
  emit_simple(c->srv, "drain", c->id);
  return 0;
}

static int write_ws(conn *c) {
  struct lws *wsi = c->wsi;
  out_chunk *ch = c->head;
  if (ch) {
    int flags =
      lws_write_ws_flags(ch->kind == OUT_BINARY ? LWS_WRITE_BINARY : LWS_WRITE_TEXT, !c->ws_out_open, !ch->more);
    int n = lws_write(wsi, ch->data, ch->len, (enum lws_write_protocol)flags);
    if (n < (int)ch->len) return -1;
    c->ws_out_open = ch->more;
    c->head = ch->next;
    if (!c->head) c->tail = NULL;
    c->queued -= ch->len;
    free(ch);
  }
  /* the close frame goes in a callback of its own: after a write in the
   * same callback lws drops the connection without sending it */
  if (c->head || (ch && c->ws_closing)) {
    lws_callback_on_writable(wsi);
    return 0;
  }
  if (c->ws_closing == 1) {
    /* lws_close_reason() followed by -1 drops the connection here without
     * a close frame (lws 4.1); send it as lws itself does (opcode 4, the
     * value lws keeps for LWS_WRITE_CLOSE) and wait for the peer's reply */
    unsigned char frame[LWS_PRE + 2 + sizeof c->ws_reason];
    unsigned char *p = frame + LWS_PRE;
    p[0] = (unsigned char)(c->ws_close_code >> 8);
    p[1] = (unsigned char)(c->ws_close_code & 0xff);
    memcpy(p + 2, c->ws_reason, c->ws_reason_len);
    c->ws_closing = 2;
    if (lws_write(wsi, p, 2 + c->ws_reason_len, (enum lws_write_protocol)4) < 0) return -1;
    arm(c); /* a peer that never answers the close is dropped */
    return 0;
  }
  if (ch) emit_simple(c->srv, "drain", c->id);
  return 0;
}

/* Refuse an upgrade with a plain response, written at once (lws expects it). */
static int write_reject(conn *c) {
  struct lws *wsi = c->wsi;
  size_t blen = c->reject_body ? strlen(c->reject_body) : 0;
  unsigned char buf[LWS_PRE + 2048], *start = buf + LWS_PRE, *p = start, *end = buf + sizeof buf - 1;
  if (lws_add_http_common_headers(wsi, (unsigned int)c->reject_status, c->reject_type ? c->reject_type : "text/plain",
                                  blen, &p, end))
    return -1;
  for (size_t at = 0; at < c->reject_headers_len;) {
    const char *name = c->reject_headers + at;
    const char *value = name + strlen(name) + 1;
    at = (size_t)(value - c->reject_headers) + strlen(value) + 1;
    if (lws_add_http_header_by_name(wsi, (const unsigned char *)name, (const unsigned char *)value, (int)strlen(value),
                                    &p, end))
      return -1;
  }
  if (lws_finalize_write_http_header(wsi, start, &p, end)) return -1;
  if (blen) {
    out_chunk *ch = chunk_new(OUT_BODY, c->reject_body, blen);
    if (!ch) return -1;
    int n = lws_write(wsi, ch->data, blen, LWS_WRITE_HTTP_FINAL);
    free(ch);
    if (n != (int)blen) return -1;
  }
  return 1;
}

/* ---- the lws callback ---------------------------------------------------------- */

static int on_lws(struct lws *wsi, enum lws_callback_reasons reason, void *user, void *in, size_t len) {
  (void)user;
  struct lws_context *ctx = lws_get_context(wsi);
  server *s = ctx ? (server *)lws_context_user(ctx) : NULL;
  if (!s) return lws_callback_http_dummy(wsi, reason, user, in, len);
  conn *c = (conn *)lws_get_opaque_user_data(wsi);
  if (c && c->poll && reason != LWS_CALLBACK_WSI_DESTROY) hook_poll(c);
  switch (reason) {
  case LWS_CALLBACK_FILTER_NETWORK_CONNECTION:
    /* past max_conns a few more are taken, to be answered 503 (Lua); past
     * those, or while draining, the connection is hung up at accept */
    if (s->close_requested || s->draining || s->nconns >= s->max_conns + s->overflow) {
      s->refused++;
      return -1;
    }
    return 0;
  case LWS_CALLBACK_SERVER_NEW_CLIENT_INSTANTIATED:
    /* the whole request head must arrive within the idle timeout */
    if ((c = conn_of(s, wsi))) {
      arm(c);
      hook_poll(c);
      servicing = c; /* lws reads a head already there in the listening socket's callback */
    }
    return 0;
  case LWS_CALLBACK_HTTP: {
    if (s->close_requested || !(c = conn_of(s, wsi))) return -1;
    if (refused_head(c)) return -1;
    request_reset(c);
    if (begin_request(c, 0) < 0) return -1;
    c->deadline = 0;
    char cl[32];
    long long length = 0;
    if (lws_hdr_copy(wsi, cl, sizeof cl, WSI_TOKEN_HTTP_CONTENT_LENGTH) > 0) length = atoll(cl);
    int chunked = lws_hdr_total_length(wsi, WSI_TOKEN_HTTP_TRANSFER_ENCODING) > 0;
    /* "Connection: close" is the client's to ask (RFC 9112 9.6); lws 4.1
     * honours it only on some paths (not a POST without a length) */
    char connection[64];
    if (lws_hdr_copy(wsi, connection, sizeof connection, WSI_TOKEN_CONNECTION) > 0 && strcasestr(connection, "close"))
      c->close_after = 1;
    if (c->over) {
      c->close_after = 1; /* answered 503 without reading a body */
      if (length > 0) c->too_large = 1;
      emit_request(c);
      return 0;
    }
    if (length > (long long)s->max_body) {
      c->too_large = 1;
      c->close_after = 1; /* the body stays unread: the connection cannot be reused */
      emit_request(c);
      return 0;
    }
    if (chunked && length <= 0) {
      /* lws 4.1 does not decode chunked request bodies: answer 411 */
      c->too_large = 2;
      c->close_after = 1;
      emit_request(c);
      return 0;
    }
    if (length > 0) {
      arm(c);
      return 0; /* the body follows */
    }
    emit_request(c);
    return 0;
  }
  case LWS_CALLBACK_HTTP_BODY:
    if (!(c = conn_of(NULL, wsi)) || !c->id) return 0;
    if (c->too_large || c->req_ref == LUA_NOREF) return 0; /* answered already, discard */
    arm(c);
    if (append_body(c, in, len) < 0) {
      c->too_large = 1;
      c->close_after = 1;
      emit_request(c);
    }
    return 0;
  case LWS_CALLBACK_HTTP_BODY_COMPLETION:
    if (!(c = conn_of(NULL, wsi)) || !c->id) return 0;
    c->deadline = 0;
    if (c->req_ref != LUA_NOREF) emit_request(c);
    return 0;
  case LWS_CALLBACK_HTTP_WRITEABLE:
    if ((c = conn_of(NULL, wsi)) && c->kill) return -1;
    if (!c || !c->id) return 0;
    return write_http(c);
  case LWS_CALLBACK_HTTP_CONFIRM_UPGRADE: {
    if (s->close_requested || !in || strcmp((const char *)in, "websocket") != 0) return -1;
    if (!(c = conn_of(s, wsi))) return -1;
    if (refused_head(c)) return -1;
    request_reset(c);
    if (begin_request(c, 1) < 0) return -1;
    c->deadline = 0; /* the head is in; a quiet WebSocket is not idle */
    c->is_ws = 1;
    emit_request(c);
    if (c->reject_status) {
      int rc = write_reject(c);
      lua_Integer id = c->id;
      c->is_ws = 0;
      request_reset(c);
      emit_simple(s, "done", id); /* the refusal is the whole response */
      return rc;
    }
    return 0;
  }
  case LWS_CALLBACK_ESTABLISHED:
    if (!(c = conn_of(NULL, wsi))) return -1;
    c->established = 1;
    if (c->head || c->ws_closing) lws_callback_on_writable(wsi);
    return 0;
  case LWS_CALLBACK_RECEIVE:
    if (!(c = conn_of(NULL, wsi)) || !c->id) return 0;
    if (lws_is_first_fragment(wsi)) {
      c->body_len = 0;
      c->msg_binary = lws_frame_is_binary(wsi);
    }
    if (c->ws_closing) return 0; /* closing: the rest is not read */
    if (append_body(c, in, len) < 0) {
      c->ws_close_code = LWS_CLOSE_STATUS_MESSAGE_TOO_LARGE;
      memcpy(c->ws_reason, "message too large", 17);
      c->ws_reason_len = 17;
      c->ws_closing = 1;
      c->body_len = 0;
      lws_callback_on_writable(wsi);
      return 0;
    }
    if (lws_is_final_fragment(wsi) && !lws_remaining_packet_payload(wsi)) {
      lua_State *cbL = event_begin(s, "message", c->id);
      if (cbL) {
        lua_pushlstring(cbL, c->body ? c->body : "", c->body_len);
        lua_pushboolean(cbL, c->msg_binary);
        c->body_len = 0;
        mb_call(srv_core(s), cbL, 4);
      }
      c->body_len = 0;
    }
    return 0;
  case LWS_CALLBACK_SERVER_WRITEABLE:
    if ((c = conn_of(NULL, wsi)) && c->kill) return -1;
    if (!c || !c->id) return 0;
    return write_ws(c);
  case LWS_CALLBACK_WSI_DESTROY: conn_gone(s, wsi); return 0;
  default: break;
  }
  return lws_callback_http_dummy(wsi, reason, user, in, len);
}

/* ---- server lifetime ----------------------------------------------------------- */

static void unlink_server(server *s) {
  for (server **p = &live_servers; *p; p = &(*p)->next_server)
    if (*p == s) {
      *p = s->next_server;
      break;
    }
}

/* The socket file goes when close() is asked for: a process that exits
 * right after (moonbox serve on SIGTERM) leaves none behind. */
static void forget_socket_file(server *s) {
  if (s->unix_path[0]) unlink(s->unix_path);
  s->unix_path[0] = 0;
}

/* Start lws's teardown; it closes its uv handles and NULLs s->ctx when done. */
static void destroy_context(server *s) {
  if (s->destroying) return;
  s->destroying = s->close_requested = 1;
  s->listen_poll = NULL; /* lws closes it */
  s->accept_resume = 0;
  if (s->rehook_on) {
    s->rehook_on = 0;
    uv_close((uv_handle_t *)&s->rehook, NULL); /* finish_context waits for it */
  }
  if (s->wake_on) {
    s->wake_on = 0;
    uv_close((uv_handle_t *)&s->wake, NULL);
  }
  forget_socket_file(s);
  if (s->ctx) lws_context_destroy(s->ctx);
}

static void count_closing(uv_handle_t *uvh, void *arg) {
  if (uv_is_closing(uvh)) (*(int *)arg)++;
}

/* lws (4.1) finishes a context on a foreign loop in two steps: the first
 * destroy closes its uv handles; once their close callbacks have run, a
 * second destroy frees the context (and NULLs s->ctx). Calling it earlier
 * frees memory those callbacks still use. */
static void finish_context(server *s, uv_loop_t *loop) {
  int closing = 0;
  uv_walk(loop, count_closing, &closing);
  if (closing == 0 && s->ctx) lws_context_destroy(s->ctx);
}

/* While serving, once a second: lws 4.1 on a foreign uv loop does not run
 * its own wsi timeouts while a connection is quiet (its timer is armed
 * only on socket activity), so the deadlines are kept here. An expired
 * connection is closed at once (we are outside any lws callback); closing
 * frees it, so the walk starts over after each. */
static void on_service_tick(uv_timer_t *t) {
  server *s = (server *)((mb_handle *)t->data)->extra;
  uint64_t now = uv_now(t->loop);
  resume_accept(s);
  for (int again = 1; again && !s->close_requested;) {
    again = 0;
    for (conn *c = s->conns; c; c = c->next) {
      if (c->deadline && now > c->deadline && !c->kill) {
        c->kill = 1;
        lws_set_timeout(c->wsi, PENDING_TIMEOUT_USER_OK, LWS_TO_KILL_SYNC);
        again = 1;
        break;
      }
    }
  }
}

static void on_anchor_tick(uv_timer_t *t) {
  mb_handle *h = (mb_handle *)t->data;
  server *s = (server *)h->extra;
  if (!s->destroying) {
    destroy_context(s);
    return;
  }
  if (s->ctx) {
    finish_context(s, t->loop);
    if (s->ctx) return;
  }
  uv_timer_stop(t);
  unlink_server(s);
  pipes_done(s, 1);
  mb_core *core = h->core;
  if (h->closing || core->dead) return;
  /* mb_handle_close takes the close callback from a stack slot */
  lua_State *cbL = core->cbL;
  int top = lua_gettop(cbL);
  if (h->cb_ref[CB_CLOSE] != LUA_NOREF) lua_rawgeti(cbL, LUA_REGISTRYINDEX, h->cb_ref[CB_CLOSE]);
  mb_handle_close(cbL, h, lua_gettop(cbL) > top ? lua_gettop(cbL) : 0);
  lua_settop(cbL, top);
}

/* Called from core teardown with the Lua state closing: finish every lws
 * context on the loop before the core frees its handles. */
void mb_http_teardown(mb_core *core) {
  for (server *s = live_servers; s; s = s->next_server) {
    if (s->h->core != core) continue;
    destroy_context(s);
    for (int i = 0; s->ctx && i < 1000; i++) {
      uv_run(core->loop, UV_RUN_NOWAIT);
      finish_context(s, core->loop);
    }
    pipes_done(s, !s->ctx);
  }
  for (server **p = &live_servers; *p;) {
    if ((*p)->h->core == core) *p = (*p)->next_server;
    else p = &(*p)->next_server;
  }
}

static server *check_server(lua_State *L, int idx) {
  mb_handle **ud = (mb_handle **)luaL_checkudata(L, idx, SERVER);
  if (!*ud || (*ud)->closing) return NULL;
  server *s = (server *)(*ud)->extra;
  return s->close_requested ? NULL : s;
}

static int push_closed(lua_State *L) {
  lua_pushnil(L);
  lua_pushliteral(L, "ECONNRESET: the client or the server has gone");
  lua_pushliteral(L, "ECONNRESET");
  return 3;
}

/* Bind the address once ourselves before lws does: when lws fails to bind
 * on a foreign loop it leaves a close pending on that loop for a context it
 * has already freed (lws 4.1), so its failure path must not be taken.
 * Returns 0 or a negative errno. */
static int probe_bind(const char *host, int port, const char *unix_path) {
  int fd = socket(unix_path ? AF_UNIX : AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -errno;
  int rc = 0;
  if (unix_path) {
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", unix_path);
    if (bind(fd, (struct sockaddr *)&sa, sizeof sa) < 0) rc = -errno;
    else unlink(unix_path);
  } else {
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)port);
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one); /* as lws does */
    if (inet_pton(AF_INET, host, &sa.sin_addr) != 1) rc = -EINVAL;
    else if (bind(fd, (struct sockaddr *)&sa, sizeof sa) < 0) rc = -errno;
  }
  close(fd);
  return rc;
}

static void lws_log_to_stderr(int level, const char *line) {
  (void)level;
  /* lws 4.1's only word on a head over max_http_header_data (it then
   * drops the connection): answer 431 on the connection it is parsing */
  if (servicing && !servicing->id && strstr(line, "Ran out of header data space")) {
    refuse_head(servicing);
    return;
  }
  if (strncmp(line, "accept: ", 8) == 0) {
    /* (lws's own callback, where it restarted the poll before the rehook) */
    server *s = accepting ? accepting : (live_servers && !live_servers->next_server ? live_servers : NULL);
    if (s) {
      pause_accept(s, line);
      return;
    }
  }
  fprintf(stderr, "moonbox: lws: %s", line);
}

/* core.http_listen({host, port | unix, max_body, max_connections, idle_timeout_ms}, on_event) */
static int http_listen(lua_State *L) {
  luaL_checktype(L, 1, LUA_TTABLE);
  luaL_checktype(L, 2, LUA_TFUNCTION);
  lua_getfield(L, 1, "host");
  const char *host = lua_tostring(L, -1);
  lua_getfield(L, 1, "unix");
  const char *unix_path = lua_tostring(L, -1);
  lua_pop(L, 2);
  lua_Integer port = mb_opt_intfield(L, 1, "port", 0);
  lua_Integer max_body = mb_opt_intfield(L, 1, "max_body", 1 << 20);
  lua_Integer max_conns = mb_opt_intfield(L, 1, "max_connections", 256);
  lua_Integer idle_ms = mb_opt_intfield(L, 1, "idle_timeout_ms", 30000);
  if (!host == !unix_path) return luaL_argerror(L, 1, "give exactly one of host or unix");
  if (port < 0 || port > 65535) return luaL_argerror(L, 1, "port must be 0-65535");
  if (max_body < 0 || max_conns < 1 || idle_ms < 1) return luaL_argerror(L, 1, "limits must be positive");
  if (unix_path && strlen(unix_path) >= sizeof(((server *)0)->unix_path))
    return luaL_argerror(L, 1, "unix socket path too long");

  if (unix_path) {
    struct stat sb;
    /* a socket file left by an earlier run would make bind fail */
    if (lstat(unix_path, &sb) == 0 && S_ISSOCK(sb.st_mode)) unlink(unix_path);
  }
  int probe = probe_bind(host, (int)port, unix_path);
  if (probe < 0) return mb_push_errno(L, -probe, unix_path ? unix_path : host);
  /* fail closed: without the scanner, requests could not be routed on
   * what the client sent (see raw heads) */
  if (hook_lws_imports() != 0) {
    lua_pushnil(L);
    lua_pushliteral(L, "cannot watch the request stream: libwebsockets' recv import was not found");
    lua_pushliteral(L, "ENOSYS");
    return 3;
  }

  mb_handle *h = mb_handle_new(L, SERVER, sizeof(server));
  server *s = (server *)h->extra;
  s->h = h;
  s->max_body = (size_t)max_body;
  s->max_conns = (int)max_conns;
  s->overflow = max_conns / 4 > 16 ? (int)(max_conns / 4) : 16;
  s->idle_secs = (int)((idle_ms + 999) / 1000);
  s->idle_ms = idle_ms;
  uv_timer_init(h->core->loop, &h->uv.timer);
  mb_handle_set_cb(L, h, CB_EVENT, 2);

  lws_set_log_level(LLL_ERR, lws_log_to_stderr);
  /* lws loads its libuv glue as a plugin and unloads it with the context;
   * keep it mapped, so no late uv callback can land in unmapped code */
  static int pinned;
  if (!pinned) pinned = dlopen("libwebsockets-evlib_uv.so", RTLD_NOW | RTLD_NODELETE) != NULL;
  s->protocols[0].name = "moonbox";
  s->protocols[0].callback = on_lws;
  s->protocols[0].rx_buffer_size = 65536;
  /* ping a quiet WebSocket after 30 s, hang up when the peer stays silent */
  s->retry.secs_since_valid_ping = 30;
  s->retry.secs_since_valid_hangup = 75;

  struct lws_context_creation_info info;
  memset(&info, 0, sizeof info);
  void *loops[1] = {h->core->loop};
  info.options = LWS_SERVER_OPTION_LIBUV | LWS_SERVER_OPTION_DISABLE_IPV6;
  info.foreign_loops = loops;
  info.protocols = s->protocols;
  info.user = s;
  info.pcontext = &s->ctx;
  info.max_http_header_data = 8192;
  info.max_http_header_pool = (unsigned short)(max_conns + s->overflow < 65535 ? max_conns + s->overflow : 65535);
  info.timeout_secs = (unsigned int)s->idle_secs;
  info.keepalive_timeout = s->idle_secs;
  info.retry_and_idle_policy = &s->retry;
  info.vhost_name = "moonbox";
  if (unix_path) {
    snprintf(s->unix_path, sizeof s->unix_path, "%s", unix_path);
    info.options |= LWS_SERVER_OPTION_UNIX_SOCK;
    info.iface = s->unix_path;
    info.port = 0;
  } else {
    info.iface = host;
    info.port = (int)port; /* 0: the kernel picks a free port */
  }

  creating = s;
  struct lws_context *ctx = lws_create_context(&info);
  creating = NULL;
  if (!ctx) {
    pipes_done(s, 0);
    s->unix_path[0] = 0;
    s->destroying = 1;
    mb_handle_close(L, h, 0);
    lua_pop(L, 1);
    return mb_push_error(L, UV_EADDRNOTAVAIL, unix_path ? unix_path : host);
  }
  s->ctx = ctx;
  s->vh = lws_get_vhost_by_name(ctx, "moonbox");
  if (!s->vh || (!unix_path && lws_get_vhost_listen_port(s->vh) <= 0)) {
    int e = UV_EADDRINUSE;
    destroy_context(s);
    s->unix_path[0] = 0;
    for (int i = 0; s->ctx && i < 1000; i++) {
      uv_run(h->core->loop, UV_RUN_NOWAIT);
      finish_context(s, h->core->loop);
    }
    pipes_done(s, !s->ctx);
    mb_handle_close(L, h, 0);
    lua_pop(L, 1);
    return mb_push_error(L, e, unix_path ? unix_path : host);
  }
  s->next_server = live_servers;
  live_servers = s;
  uv_prepare_init(h->core->loop, &s->rehook);
  s->rehook.data = s;
  uv_prepare_start(&s->rehook, on_rehook);
  uv_unref((uv_handle_t *)&s->rehook);
  s->rehook_on = 1;
  uv_idle_init(h->core->loop, &s->wake);
  s->wake.data = s;
  s->wake_on = 1;
  uv_timer_start(&h->uv.timer, on_service_tick, 1000, 1000);
  uv_unref(&h->uv.handle); /* the listening socket keeps the loop alive, not this */
  hook_listen(s);
  return 1;
}

/* server:port() -> the port listened on (0 for a unix socket) */
static int server_port(lua_State *L) {
  server *s = check_server(L, 1);
  if (!s) return push_closed(L);
  lua_pushinteger(L, s->unix_path[0] ? 0 : lws_get_vhost_listen_port(s->vh));
  return 1;
}

static void add_header(lua_State *L, struct lws *wsi, unsigned char **p, unsigned char *end, int *err) {
  /* key at -2, value at -1 */
  if (lua_type(L, -2) != LUA_TSTRING || lua_type(L, -1) != LUA_TSTRING) {
    *err = 1;
    return;
  }
  size_t klen, vlen;
  const char *k = lua_tolstring(L, -2, &klen);
  const char *v = lua_tolstring(L, -1, &vlen);
  char name[256];
  if (klen == 0 || klen + 2 > sizeof name || memchr(v, '\n', vlen) || memchr(v, '\r', vlen)) {
    *err = 1;
    return;
  }
  for (size_t i = 0; i < klen; i++)
    if (k[i] == ':' || k[i] == '\r' || k[i] == '\n' || k[i] == ' ') {
      *err = 1;
      return;
    }
  memcpy(name, k, klen);
  name[klen] = ':';
  name[klen + 1] = 0;
  if (lws_add_http_header_by_name(wsi, (unsigned char *)name, (const unsigned char *)v, (int)vlen, p, end)) *err = 2;
}

/* server:respond(id, status, content_type, headers, length|nil, body|nil)
 * -> true | nil, msg, code. With a body the response is complete; without
 * one, write() and finish() follow (length: the content length, if known;
 * unknown means the connection closes at the end). */
static int server_respond(lua_State *L) {
  server *s = check_server(L, 1);
  lua_Integer id = luaL_checkinteger(L, 2);
  int status = (int)luaL_checkinteger(L, 3);
  const char *ctype = luaL_optstring(L, 4, "text/plain");
  if (!lua_isnoneornil(L, 5)) luaL_checktype(L, 5, LUA_TTABLE);
  size_t blen = 0;
  const char *body = lua_isnoneornil(L, 7) ? NULL : luaL_checklstring(L, 7, &blen);
  lua_Integer length = body ? (lua_Integer)blen : (lua_isnoneornil(L, 6) ? -1 : luaL_checkinteger(L, 6));
  if (status < 100 || status > 999) return luaL_argerror(L, 3, "status must be 100-999");
  conn *c = s ? conn_by_id(s, id) : NULL;
  if (!c || c->is_ws) return push_closed(L);
  if (c->responding) return luaL_error(L, "response already started");
  size_t hsize = 1024 + strlen(ctype);
  if (!lua_isnoneornil(L, 5)) {
    lua_pushnil(L);
    while (lua_next(L, 5)) {
      size_t a = 0, b = 0;
      if (lua_type(L, -2) == LUA_TSTRING) lua_tolstring(L, -2, &a);
      if (lua_type(L, -1) == LUA_TSTRING) lua_tolstring(L, -1, &b);
      hsize += a + b + 8;
      lua_pop(L, 1);
    }
  }
  out_chunk *hc = chunk_new(OUT_HEADERS, NULL, hsize);
  if (!hc) return luaL_error(L, "out of memory");
  unsigned char *start = hc->data, *p = start, *end = start + hsize - 1;
  int err = 0;
  if (lws_add_http_common_headers(c->wsi, (unsigned int)status, ctype,
                                  length < 0 ? LWS_ILLEGAL_HTTP_CONTENT_LEN : (lws_filepos_t)length, &p, end))
    err = 2;
  if (!err && !lua_isnoneornil(L, 5)) {
    lua_pushnil(L);
    while (!err && lua_next(L, 5)) {
      add_header(L, c->wsi, &p, end, &err);
      lua_pop(L, 1);
    }
    if (err) lua_pop(L, 1);
  }
  if (!err && lws_finalize_http_header(c->wsi, &p, end)) err = 2;
  if (err) {
    free(hc);
    if (err == 1) return luaL_argerror(L, 5, "header names and values must be strings without CR, LF or ':'");
    return mb_push_error(L, UV_E2BIG, "response headers");
  }
  hc->len = (size_t)(p - start);
  c->responding = 1;
  queue_push(c, hc);
  if (body) {
    if (blen) {
      out_chunk *bc = chunk_new(OUT_BODY, body, blen);
      if (!bc) return luaL_error(L, "out of memory");
      queue_push(c, bc);
    }
    c->finishing = 1;
  }
  lws_callback_on_writable(c->wsi);
  lua_pushboolean(L, 1);
  return 1;
}

/* server:write(id, data[, is_binary[, more]]) -> queued bytes | nil, msg, code
 * Body bytes of a started response, or a WebSocket message (text unless
 * is_binary). With more, a WebSocket write is a fragment: the message goes
 * on with the next write (whose is_binary is ignored) and ends with the
 * first write without more, so a large message never sits whole in memory.
 * "drain" follows once everything queued is written. */
static int server_write(lua_State *L) {
  server *s = check_server(L, 1);
  lua_Integer id = luaL_checkinteger(L, 2);
  size_t len;
  const char *data = luaL_checklstring(L, 3, &len);
  int binary = lua_toboolean(L, 4);
  int more = lua_toboolean(L, 5);
  conn *c = s ? conn_by_id(s, id) : NULL;
  if (!c || c->finishing || c->ws_closing) return push_closed(L);
  if (!c->is_ws && !c->responding) return luaL_error(L, "write before respond");
  if (!c->is_ws && len == 0) {
    lua_pushnumber(L, (lua_Number)c->queued);
    return 1;
  }
  out_chunk *ch = chunk_new(c->is_ws ? (binary ? OUT_BINARY : OUT_TEXT) : OUT_BODY, data, len);
  if (!ch) return luaL_error(L, "out of memory");
  ch->more = c->is_ws && more;
  queue_push(c, ch);
  if (!c->is_ws || c->established) lws_callback_on_writable(c->wsi);
  lua_pushnumber(L, (lua_Number)c->queued);
  return 1;
}

/* server:finish(id): end a streamed response once the queue is written */
static int server_finish(lua_State *L) {
  server *s = check_server(L, 1);
  lua_Integer id = luaL_checkinteger(L, 2);
  conn *c = s ? conn_by_id(s, id) : NULL;
  if (!c || c->is_ws) return push_closed(L);
  if (!c->responding) return luaL_error(L, "finish before respond");
  c->finishing = 1;
  lws_callback_on_writable(c->wsi);
  lua_pushboolean(L, 1);
  return 1;
}

/* server:ws_close(id[, code[, reason]]): close a WebSocket after its queue */
static int server_ws_close(lua_State *L) {
  server *s = check_server(L, 1);
  lua_Integer id = luaL_checkinteger(L, 2);
  int code = (int)luaL_optinteger(L, 3, 1000);
  size_t rlen = 0;
  const char *reason = luaL_optlstring(L, 4, "", &rlen);
  if (code < 1000 || code > 4999) return luaL_argerror(L, 3, "close code must be 1000-4999");
  conn *c = s ? conn_by_id(s, id) : NULL;
  if (!c || !c->is_ws) return push_closed(L);
  if (c->ws_closing) {
    lua_pushboolean(L, 1);
    return 1;
  }
  if (rlen > sizeof c->ws_reason) rlen = sizeof c->ws_reason;
  memcpy(c->ws_reason, reason, rlen);
  c->ws_reason_len = rlen;
  c->ws_close_code = code;
  c->ws_closing = 1;
  if (c->established) lws_callback_on_writable(c->wsi);
  lua_pushboolean(L, 1);
  return 1;
}

/* The extra headers of a refused upgrade ({name = value}) as "name:\0value\0"
 * pairs in one allocation, checked as add_header checks a response's; NULL
 * with *len 0 for none, 1 for a bad table, 2 when out of memory. */
static char *reject_headers(lua_State *L, int idx, size_t *len) {
  *len = 0;
  if (lua_isnoneornil(L, idx)) return NULL;
  luaL_checktype(L, idx, LUA_TTABLE);
  size_t cap = 0;
  for (lua_pushnil(L); lua_next(L, idx); lua_pop(L, 1)) {
    size_t klen, vlen;
    if (lua_type(L, -2) != LUA_TSTRING || lua_type(L, -1) != LUA_TSTRING) goto bad;
    const char *k = lua_tolstring(L, -2, &klen);
    const char *v = lua_tolstring(L, -1, &vlen);
    if (klen == 0 || klen > 200 || vlen > 1000 || strcspn(k, ": \r\n") != klen || strcspn(v, "\r\n") != vlen) goto bad;
    cap += klen + vlen + 3;
  }
  if (cap == 0) return NULL;
  char *buf = malloc(cap), *at = buf;
  if (!buf) {
    *len = 2;
    return NULL;
  }
  for (lua_pushnil(L); lua_next(L, idx); lua_pop(L, 1)) {
    size_t klen, vlen;
    const char *k = lua_tolstring(L, -2, &klen);
    const char *v = lua_tolstring(L, -1, &vlen);
    memcpy(at, k, klen);
    at += klen;
    *at++ = ':';
    *at++ = 0;
    memcpy(at, v, vlen + 1);
    at += vlen + 1;
  }
  *len = cap;
  return buf;
bad:
  lua_pop(L, 2);
  *len = 1;
  return NULL;
}

/* server:ws_reject(id, status, content_type, body[, headers]): refuse a
 * WebSocket upgrade with a plain response. Only while the "request" event
 * for it is being delivered; afterwards the upgrade has happened (returns
 * false). */
static int server_ws_reject(lua_State *L) {
  server *s = check_server(L, 1);
  lua_Integer id = luaL_checkinteger(L, 2);
  int status = (int)luaL_checkinteger(L, 3);
  const char *ctype = luaL_optstring(L, 4, "text/plain");
  const char *body = luaL_optstring(L, 5, "");
  if (status < 100 || status > 999) return luaL_argerror(L, 3, "status must be 100-999");
  size_t hlen;
  char *headers = reject_headers(L, 6, &hlen);
  if (!headers && hlen == 1) return luaL_argerror(L, 6, "headers must map names to one-line values");
  if (!headers && hlen == 2) return luaL_error(L, "out of memory");
  conn *c = s ? conn_by_id(s, id) : NULL;
  if (!c || !c->is_ws || c->established) {
    free(headers);
    lua_pushboolean(L, 0);
    return 1;
  }
  free(c->reject_body);
  free(c->reject_type);
  free(c->reject_headers);
  c->reject_body = strdup(body);
  c->reject_type = strdup(ctype);
  c->reject_headers = headers;
  c->reject_headers_len = headers ? hlen : 0;
  c->reject_status = status;
  lua_pushboolean(L, 1);
  return 1;
}

/* server:header(id, name) -> value | nil: any request header by name, also
 * those lws has no token for, while the request's headers are held. */
static int server_header(lua_State *L) {
  server *s = check_server(L, 1);
  lua_Integer id = luaL_checkinteger(L, 2);
  size_t nlen;
  const char *name = luaL_checklstring(L, 3, &nlen);
  conn *c = s ? conn_by_id(s, id) : NULL;
  if (!c || nlen == 0 || nlen > 200) return 0;
  char key[256];
  memcpy(key, name, nlen);
  key[nlen] = ':';
  key[nlen + 1] = 0;
  int n = lws_hdr_custom_length(c->wsi, key, (int)nlen + 1);
  if (n < 0) return 0;
  char *buf = (char *)malloc((size_t)n + 1);
  if (!buf) return luaL_error(L, "out of memory");
  if (lws_hdr_custom_copy(c->wsi, buf, n + 1, key, (int)nlen + 1) < 0) {
    free(buf);
    return 0;
  }
  lua_pushlstring(L, buf, (size_t)n);
  free(buf);
  return 1;
}

/* server:hangup(id): close the connection once this response is out */
static int server_hangup(lua_State *L) {
  server *s = check_server(L, 1);
  conn *c = s ? conn_by_id(s, luaL_checkinteger(L, 2)) : NULL;
  if (!c) return push_closed(L);
  c->close_after = 1;
  lua_pushboolean(L, 1);
  return 1;
}

/* server:queued(id) -> bytes waiting to be written | nil when gone */
static int server_queued(lua_State *L) {
  server *s = check_server(L, 1);
  conn *c = s ? conn_by_id(s, luaL_checkinteger(L, 2)) : NULL;
  if (!c) return push_closed(L);
  lua_pushnumber(L, (lua_Number)c->queued);
  return 1;
}

/* server:connections() -> open connections */
static int server_connections(lua_State *L) {
  server *s = check_server(L, 1);
  lua_pushinteger(L, s ? s->nconns : 0);
  return 1;
}

/* server:drain(): refuse new connections at accept (graceful stop) */
static int server_drain(lua_State *L) {
  server *s = check_server(L, 1);
  if (s) s->draining = 1;
  return 0;
}

/* server:refused() -> connections hung up at accept so far, accepts the
 * kernel refused (each pauses accepting, see accept pauses) */
static int server_refused(lua_State *L) {
  server *s = check_server(L, 1);
  lua_pushinteger(L, s ? s->refused : 0);
  lua_pushinteger(L, s ? s->accept_failed : 0);
  return 2;
}

/* server:close([callback]): stop listening, drop every connection; the
 * handle closes once lws has closed its own uv handles. */
static int server_close(lua_State *L) {
  mb_handle **ud = (mb_handle **)luaL_checkudata(L, 1, SERVER);
  mb_handle *h = *ud;
  if (!h || h->closing) return 0;
  server *s = (server *)h->extra;
  if (s->close_requested) return 0;
  if (lua_isfunction(L, 2)) mb_handle_set_cb(L, h, CB_CLOSE, 2);
  s->close_requested = 1; /* no new requests; lws is destroyed outside its callbacks */
  forget_socket_file(s);
  uv_ref(&h->uv.handle);
  uv_timer_start(&h->uv.timer, on_anchor_tick, 0, 1);
  return 0;
}

static const luaL_Reg server_methods[] = {{"port", server_port},         {"respond", server_respond},
                                          {"write", server_write},       {"finish", server_finish},
                                          {"ws_close", server_ws_close}, {"ws_reject", server_ws_reject},
                                          {"header", server_header},     {"hangup", server_hangup},
                                          {"queued", server_queued},     {"connections", server_connections},
                                          {"drain", server_drain},       {"refused", server_refused},
                                          {"close", server_close},       {NULL, NULL}};

void mb_open_http(lua_State *L) {
  mb_new_class(L, SERVER, server_methods);
  lua_pushcfunction(L, http_listen);
  lua_setfield(L, -2, "http_listen");
}
