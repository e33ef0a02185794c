/* Connections of the HTTP server on the runtime's loop: accepting (with its
 * limits), reading into the request parser (head.c) or the WebSocket
 * reader (ws.c), one request at a time per connection, the output queue,
 * and the deadlines that drop a slow or silent client. Lua sees none of
 * this: lua.c turns what happens here into events.
 *
 * Backpressure, both ways: a connection's socket is read only while less
 * than MBH_READ_PAUSE bytes are queued for it and less than MBH_READ_AHEAD
 * bytes wait unparsed behind the request being answered; Lua is told
 * ("drain") when its queue is empty and waits before writing past
 * http.lua's HIGH_WATER. */
#include "http/http.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define LINGER_MS 2000 /* at most, after a refusal, for the client to stop sending */

/* A request body must keep an average of this many bytes a second once
 * its first idle timeout has passed: by t ms after its head, at least
 * (t - idle_timeout_ms) * BODY_MIN_RATE / 1000 bytes, and never a pause
 * of idle_timeout_ms. A deadline that restarted on every read let a
 * client hold a connection (one of max_connections) for as long as its
 * body took at a byte per idle period; a fixed deadline from
 * Content-Length would let one that declares max_body and sends nothing
 * hold it as long. 1 KiB/s is 8 kbit/s, below any real link, so only a
 * trickle is cut off; the longest a body can hold a connection is then
 * idle_timeout_ms + max_body / 1 KiB/s. */
#define BODY_MIN_RATE 1024

static uint64_t now_of(mbh_server *s) { return uv_now(s->h->core->loop); }
static void pump(mbh_conn *c);
static void update_reading(mbh_conn *c);

/* When a body that has body_len bytes so far must have more (BODY_MIN_RATE). */
static uint64_t body_deadline(mbh_conn *c) {
  mbh_server *s = c->srv;
  uint64_t by_rate = c->body_start + s->idle_ms + (uint64_t)c->body_len * 1000 / BODY_MIN_RATE;
  uint64_t by_pause = now_of(s) + s->idle_ms;
  return by_rate < by_pause ? by_rate : by_pause;
}

/* ---- listening ---------------------------------------------------------------- */

int mbh_listen_socket(const char *host, int port, const char *unix_path, int *bound_port) {
  int fd = socket(unix_path ? AF_UNIX : AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return -errno;
  int rc = 0;
  *bound_port = 0;
  if (unix_path) {
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", unix_path);
    if (bind(fd, (struct sockaddr *)&sa, sizeof sa) < 0) rc = -errno;
  } else {
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)port);
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one); /* a restart finds the port in TIME_WAIT */
    socklen_t len = sizeof sa;
    if (inet_pton(AF_INET, host, &sa.sin_addr) != 1) rc = -EINVAL;
    else if (bind(fd, (struct sockaddr *)&sa, sizeof sa) < 0) rc = -errno;
    else if (getsockname(fd, (struct sockaddr *)&sa, &len) == 0) *bound_port = ntohs(sa.sin_port);
  }
  if (rc == 0 && listen(fd, 511) < 0) rc = -errno;
  if (rc < 0) {
    close(fd);
    if (unix_path && rc != -EADDRINUSE) unlink(unix_path);
    return rc;
  }
  return fd;
}

/* ---- closing ---------------------------------------------------------------------- */

static void aux_closed(mbh_server *s) {
  if (--s->aux_open == 0 && s->close_requested) mbh_server_closed(s);
}

static void out_free(mbh_out *o);

static void free_held(mbh_conn *c) {
  while (c->held) {
    mbh_out *o = c->held;
    c->held = o->next;
    out_free(o);
  }
  c->held_tail = NULL;
}

static void on_conn_closed(uv_handle_t *handle) {
  mbh_conn *c = handle->data;
  mbh_server *s = c->srv;
  if (c->prev) c->prev->next = c->next;
  else s->conns = c->next;
  if (c->next) c->next->prev = c->prev;
  s->nconns--;
  lua_Integer id = c->id;
  mbh_parser_free(&c->parser);
  mbh_ws_free(&c->ws);
  free_held(c);
  free(c->in);
  free(c->body);
  free(c->reject);
  free(c);
  if (id) mbh_emit(s, "closed", id);
  aux_closed(s);
}

void mbh_conn_close(mbh_conn *c) {
  if (c->closing) return;
  c->closing = 1;
  c->deadline = 0;
  uv_close(&c->sock.handle, on_conn_closed); /* its pending writes end with UV_ECANCELED first */
}

static void on_shutdown(uv_shutdown_t *req, int status) {
  mbh_conn *c = req->data;
  if (status < 0 || c->eof) mbh_conn_close(c);
}

/* The last response is out: half-close, and drop what the client still
 * sends until it closes, so the response is not lost to a reset. */
static void linger(mbh_conn *c) {
  if (c->closing || c->shut) return;
  c->phase = PH_LINGER;
  c->shut = 1;
  uint64_t wait = c->srv->idle_ms < LINGER_MS ? c->srv->idle_ms : LINGER_MS;
  c->deadline = now_of(c->srv) + wait;
  c->shutdown_req.data = c;
  if (c->eof || uv_shutdown(&c->shutdown_req, &c->sock.stream, on_shutdown) < 0) {
    mbh_conn_close(c);
    return;
  }
  update_reading(c);
}

/* ---- the output queue ----------------------------------------------------------- */

static void after_flush(mbh_conn *c);

/* (a Lua string's anchor is let go, unless the state is closing: then
 * every string goes with it, and Lua must not be called) */
static void out_free(mbh_out *o) {
  mb_core *core = o->conn->srv->h->core;
  if (o->lua_ref != LUA_NOREF && !core->dead) luaL_unref(core->cbL, LUA_REGISTRYINDEX, o->lua_ref);
  free(o);
}

static void on_written(uv_write_t *req, int status) {
  mbh_out *o = req->data;
  mbh_conn *c = o->conn;
  c->queued -= o->len;
  out_free(o);
  if (c->closing) return;
  if (status < 0) {
    mbh_conn_close(c); /* the client is gone */
    return;
  }
  if (c->queued) {
    /* a reader that stops reading is dropped (on_tick also counts bytes taken mid-write) */
    c->deadline = c->phase == PH_BODY ? body_deadline(c) : now_of(c->srv) + c->srv->idle_ms;
    update_reading(c);
    return;
  }
  after_flush(c);
}

static mbh_out *out_new(mbh_conn *c, size_t len) {
  mbh_out *o = malloc(sizeof *o + len);
  if (!o) return NULL;
  o->next = NULL;
  o->conn = c;
  o->bytes = o->data;
  o->lua_ref = LUA_NOREF;
  o->len = len;
  o->req.data = o;
  return o;
}

static int out_write(mbh_conn *c, mbh_out *o) {
  uv_buf_t buf = uv_buf_init((char *)o->bytes, (unsigned int)o->len);
  c->queued += o->len;
  c->out_total += o->len;
  if (uv_write(&o->req, &c->sock.stream, &buf, 1, on_written) < 0) {
    c->queued -= o->len;
    c->out_total -= o->len;
    out_free(o);
    mbh_conn_close(c);
    return -1;
  }
  if (!c->deadline && c->phase != PH_WS) c->deadline = now_of(c->srv) + c->srv->idle_ms;
  update_reading(c);
  return 0;
}

int mbh_send(mbh_conn *c, const void *data, size_t len) {
  if (c->closing || c->shut) return -1;
  if (len == 0) return 0;
  mbh_out *o = out_new(c, len);
  if (!o) return -1;
  memcpy(o->data, data, len);
  return out_write(c, o);
}

/* Below this a copy costs less than the registry's anchor. */
#define MBH_COPY_BELOW 16384

int mbh_send_string(mbh_conn *c, lua_State *L, int idx) {
  size_t len;
  const char *s = lua_tolstring(L, idx, &len);
  if (len < MBH_COPY_BELOW) return mbh_send(c, s, len);
  if (c->closing || c->shut) return -1;
  mbh_out *o = out_new(c, 0);
  if (!o) return -1;
  lua_pushvalue(L, idx);
  o->lua_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  o->bytes = s; /* (a Lua string never moves) */
  o->len = len;
  return out_write(c, o);
}

int mbh_send_frame(mbh_conn *c, int opcode, int fin, const void *data, size_t len) {
  if (c->closing || c->shut) return -1;
  mbh_out *o = out_new(c, len + 14);
  if (!o) return -1;
  o->len = mbh_ws_frame(&c->ws, opcode, fin, data, len, (uint8_t *)o->data);
  if (!c->established) { /* the answer to the handshake goes first */
    if (c->held_tail) c->held_tail->next = o;
    else c->held = o;
    c->held_tail = o;
    c->queued += o->len;
    return 0;
  }
  return out_write(c, o);
}

void mbh_ws_send_close(mbh_conn *c, int code, const char *reason, size_t len) {
  if (c->ws_close_sent) return;
  uint8_t payload[125];
  size_t n = mbh_ws_close_payload(code, reason, len, payload);
  if (mbh_send_frame(c, 8, 1, payload, n) == 0) c->ws_close_sent = 1;
}

/* ---- requests ------------------------------------------------------------------------ */

static const char *reason_phrase(int status) {
  switch (status) {
  case 400: return "Bad Request";
  case 431: return "Request Header Fields Too Large";
  default: return "Error";
  }
}

/* A head the parser refused (400, 431): answered here, and the connection
 * closes; Lua hears of it as a "refused" event (the access log, metrics). */
static void refuse(mbh_conn *c, int status, const char *why) {
  char body[512], resp[1024];
  if (status == 431)
    snprintf(body, sizeof body,
             "{\"code\":\"REQUEST_HEADER_FIELDS_TOO_LARGE\",\"httpStatus\":431,"
             "\"message\":\"the request head is larger than %d bytes\",\"context\":{\"limit\":%d}}\n",
             MBH_HEAD_MAX, MBH_HEAD_MAX);
  else
    snprintf(body, sizeof body,
             "{\"code\":\"BAD_REQUEST\",\"httpStatus\":%d,"
             "\"message\":\"refused request head: %s\",\"context\":{}}\n",
             status, why);
  int n = snprintf(resp, sizeof resp,
                   "HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %zu\r\n"
                   "connection: close\r\n\r\n%s",
                   status, reason_phrase(status), strlen(body), body);
  c->phase = PH_LINGER;
  c->close_after = 1;
  if (mbh_send(c, resp, (size_t)n) == 0 && c->queued == 0) linger(c);
  mbh_emit(c->srv, "refused", status);
}

static void deliver(mbh_conn *c) {
  c->phase = PH_HANDLER;
  c->deadline = 0;
  mbh_emit_request(c);
}

/* The 101, then whatever Lua wrote meanwhile; or the refusal Lua chose. */
static void answer_upgrade(mbh_conn *c) {
  if (c->closing || c->srv->close_requested) return;
  if (c->reject) {
    c->is_ws = 0;
    c->close_after = 1;
    c->responding = 1;
    free_held(c);
    c->queued = 0;
    char *r = c->reject;
    c->reject = NULL;
    mbh_send(c, r, c->reject_len);
    free(r);
    mbh_finish(c);
    return;
  }
  size_t klen;
  const char *key = mbh_head_get(&c->parser.head, "sec-websocket-key", &klen);
  char accept[MBH_WS_ACCEPT_LEN], resp[256];
  mbh_ws_accept(key, klen, accept); /* (checked before the request event) */
  int n = snprintf(resp, sizeof resp,
                   "HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
                   "sec-websocket-accept: %.*s\r\n\r\n",
                   MBH_WS_ACCEPT_LEN, accept);
  if (mbh_send(c, resp, (size_t)n) < 0) return;
  c->established = 1;
  c->phase = PH_WS;
  c->deadline = 0; /* a quiet WebSocket is not idle (it is pinged) */
  c->ws_last_rx = now_of(c->srv);
  mbh_out *o = c->held;
  c->held = c->held_tail = NULL;
  while (o) {
    mbh_out *next = o->next;
    c->queued -= o->len;
    o->next = NULL;
    if (out_write(c, o) < 0) {
      for (o = next; o; o = next) {
        next = o->next;
        out_free(o);
      }
      return;
    }
    o = next;
  }
  pump(c); /* frames that came with the head */
}

static void on_upgrade(mbh_conn *c, const mbh_head *h) {
  char accept[MBH_WS_ACCEPT_LEN];
  if (!h->ws_key || !h->ws_version_ok || mbh_ws_accept(h->ws_key, h->ws_key_len, accept) < 0) {
    refuse(c, 400, "a WebSocket upgrade without a valid Sec-WebSocket-Key and Sec-WebSocket-Version 13");
    return;
  }
  if (h->ws_protocol) { /* no subprotocol is offered */
    refuse(c, 400, "a WebSocket subprotocol was asked for (none is offered)");
    return;
  }
  if (mbh_ws_init(&c->ws, c->srv->max_body) < 0) {
    mbh_conn_close(c);
    return;
  }
  c->id = ++c->srv->next_id;
  c->is_ws = 1;
  c->close_after = 1;
  deliver(c); /* ws_reject and the first writes happen in here */
  answer_upgrade(c);
}

static void on_head(mbh_conn *c, const mbh_head *h) {
  mbh_server *s = c->srv;
  c->head_only = h->method_len == 4 && memcmp(h->method, "HEAD", 4) == 0;
  c->close_after = !h->keep_alive || c->over;
  if (h->websocket) {
    on_upgrade(c, h);
    return;
  }
  c->id = ++s->next_id;
  if (c->over) {
    if (h->content_length || h->has_te) c->too_large = 1; /* answered 503 without reading it */
  } else if (h->has_te) {
    c->too_large = 2;
  } else if (h->content_length > s->max_body) {
    c->too_large = 1;
  } else if (h->content_length) {
    c->body = malloc((size_t)h->content_length);
    if (!c->body) {
      mbh_conn_close(c);
      return;
    }
    c->phase = PH_BODY;
    c->body_start = now_of(s);
    c->deadline = body_deadline(c);
    static const char go_on[] = "HTTP/1.1 100 Continue\r\n\r\n";
    if (h->expect_continue) mbh_send(c, go_on, sizeof go_on - 1);
    return;
  }
  if (c->too_large) c->close_after = 1; /* the body stays unread: the connection cannot be reused */
  deliver(c);
}

/* Bytes read: into the parser, one request at a time. */
static void pump_http(mbh_conn *c) {
  while (!c->closing && !c->srv->close_requested && (c->phase == PH_HEAD || c->phase == PH_BODY)) {
    mbh_event ev;
    long used = mbh_parse(&c->parser, c->in + c->in_off, c->in_len - c->in_off, &ev);
    if (used < 0) {
      mbh_conn_close(c);
      return;
    }
    c->in_off += (size_t)used;
    switch (ev.kind) {
    case MBH_HEAD:
      c->deadline = 0;
      on_head(c, ev.head);
      break;
    case MBH_BODY:
      memcpy(c->body + c->body_len, ev.data, ev.len);
      c->body_len += ev.len;
      c->deadline = body_deadline(c); /* not a fresh idle period per read: a trickle is dropped */
      if (ev.end) deliver(c);
      break;
    case MBH_ERROR: refuse(c, ev.status, ev.why); return;
    case MBH_NEED_MORE:
      if (c->eof) mbh_conn_close(c); /* half a request, and the client has stopped sending */
      else if (c->phase == PH_HEAD && !c->deadline)
        c->deadline = now_of(c->srv) + c->srv->idle_ms; /* the whole head within the idle timeout */
      return;
    default: return;
    }
  }
}

static void pump_ws(mbh_conn *c) {
  while (!c->closing && !c->srv->close_requested && c->phase == PH_WS) {
    mbh_ws_event ev;
    size_t used = mbh_ws_read(&c->ws, (const uint8_t *)c->in + c->in_off, c->in_len - c->in_off, &ev);
    c->in_off += used;
    if (used) {
      c->ws_last_rx = now_of(c->srv);
      c->ws_pinged = 0;
    }
    switch (ev.kind) {
    case MBH_WS_MESSAGE:
      if (!c->ws_close_sent) mbh_emit_message(c, ev.data, ev.len, ev.binary);
      break;
    case MBH_WS_PING:
      if (!c->ws_close_sent) mbh_send_frame(c, 10, 1, ev.data, ev.len);
      break;
    case MBH_WS_PONG: break;
    case MBH_WS_CLOSE:
      c->ws_peer_closed = 1;
      /* the peer's code goes back as the answer (none: none) */
      if (!c->ws_close_sent) {
        uint8_t payload[2] = {(uint8_t)(ev.code >> 8), (uint8_t)ev.code};
        if (mbh_send_frame(c, 8, 1, payload, ev.code == 1005 ? 0 : 2) == 0) c->ws_close_sent = 1;
      }
      if (!c->queued) mbh_conn_close(c);
      return;
    case MBH_WS_ERROR:
      mbh_ws_send_close(c, ev.code, ev.why, strlen(ev.why));
      c->ws_peer_closed = 1; /* nothing more is read: close once the close frame is out */
      if (!c->queued) mbh_conn_close(c);
      return;
    default:
      if (c->eof) mbh_conn_close(c);
      return;
    }
  }
}

static void pump(mbh_conn *c) {
  if (c->phase == PH_WS) pump_ws(c);
  else pump_http(c);
  if (c->closing) return;
  if (c->in_off == c->in_len) c->in_off = c->in_len = 0;
  update_reading(c);
}

/* ---- reading -------------------------------------------------------------------------- */

static void on_alloc(uv_handle_t *handle, size_t suggested, uv_buf_t *buf) {
  (void)suggested;
  mbh_conn *c = handle->data;
  if (c->in_off) { /* keep what is unparsed at the start */
    memmove(c->in, c->in + c->in_off, c->in_len - c->in_off);
    c->in_len -= c->in_off;
    c->in_off = 0;
  }
  if (c->in_cap - c->in_len < 16384) {
    size_t cap = c->in_len + 65536;
    char *in = realloc(c->in, cap);
    if (!in) {
      *buf = uv_buf_init(NULL, 0); /* libuv reports UV_ENOBUFS */
      return;
    }
    c->in = in;
    c->in_cap = cap;
  }
  *buf = uv_buf_init(c->in + c->in_len, (unsigned int)(c->in_cap - c->in_len));
}

static void on_read(uv_stream_t *stream, ssize_t n, const uv_buf_t *buf) {
  (void)buf;
  mbh_conn *c = stream->data;
  if (c->closing) return;
  if (n < 0) {
    c->eof = 1;
    uv_read_stop(stream);
    c->reading = 0;
    if (n != UV_EOF || c->phase == PH_LINGER || c->phase == PH_WS) {
      mbh_conn_close(c);
    } else if (c->phase == PH_HANDLER && c->in_off == c->in_len) {
      mbh_conn_close(c); /* the client hung up while its request runs: gone */
    } else if (c->phase != PH_HANDLER) {
      pump(c); /* closes it, unless a whole request waits */
    }
    return;
  }
  if (c->phase == PH_LINGER) {
    c->in_len = c->in_off = 0; /* dropped */
    return;
  }
  c->in_len += (size_t)n;
  if (c->phase != PH_HANDLER) pump(c);
  else update_reading(c);
}

static void update_reading(mbh_conn *c) {
  if (c->closing || c->eof) return;
  int want = c->queued <= MBH_READ_PAUSE && c->in_len - c->in_off < MBH_READ_AHEAD;
  if (c->phase == PH_LINGER) want = 1;
  if (want && !c->reading) c->reading = uv_read_start(&c->sock.stream, on_alloc, on_read) == 0;
  else if (!want && c->reading) {
    uv_read_stop(&c->sock.stream);
    c->reading = 0;
  }
}

/* ---- the end of a response ------------------------------------------------------------ */

void mbh_finish(mbh_conn *c) {
  c->finishing = 1;
  /* Everything is out already: an empty write, so the end ("done", the
   * next pipelined request) comes from the loop, never from inside the
   * Lua call that finished */
  mbh_out *o = c->queued || c->closing ? NULL : out_new(c, 0);
  if (o) out_write(c, o);
}

/* Everything queued has been written. */
static void after_flush(mbh_conn *c) {
  mbh_server *s = c->srv;
  c->deadline = 0;
  if (c->phase == PH_LINGER) {
    linger(c);
    return;
  }
  if (c->is_ws) {
    if (c->ws_close_sent && c->ws_peer_closed) mbh_conn_close(c);
    else if (c->ws_close_sent) c->deadline = now_of(s) + s->idle_ms; /* the peer must answer the close */
    else if (c->established) mbh_emit(s, "drain", c->id);
    update_reading(c);
    return;
  }
  if (c->phase == PH_BODY) { /* (the 100 Continue) */
    c->deadline = body_deadline(c);
    return;
  }
  if (!c->finishing) {
    if (c->id) mbh_emit(s, "drain", c->id);
    if (!c->closing) update_reading(c);
    return;
  }
  lua_Integer id = c->id;
  c->id = 0;
  c->finishing = c->responding = c->too_large = 0;
  free(c->body);
  c->body = NULL;
  c->body_len = 0;
  mbh_parser_next(&c->parser);
  mbh_emit(s, "done", id);
  if (c->closing) return;
  if (c->close_after || s->close_requested) {
    linger(c);
    return;
  }
  /* kept alive: the next head, perhaps here already */
  c->phase = PH_HEAD;
  c->deadline = now_of(s) + s->idle_ms;
  if (c->eof && c->in_off == c->in_len) {
    mbh_conn_close(c);
    return;
  }
  pump(c);
}

mbh_conn *mbh_conn_by_id(mbh_server *s, lua_Integer id) {
  if (id <= 0) return NULL;
  for (mbh_conn *c = s->conns; c; c = c->next)
    if (c->id == id && !c->closing) return c;
  return NULL;
}

/* ---- accepting ---------------------------------------------------------------------------- */

static void on_listener_closed(uv_handle_t *handle) {
  mbh_server *s = handle->data;
  close(s->fd); /* here, once libuv is done with the number */
  s->fd = -1;
  aux_closed(s);
}

static void pause_accept(mbh_server *s, int err) {
  uint64_t now = now_of(s);
  s->accept_failed++;
  uv_poll_stop(&s->listener);
  s->accept_resume = now + MBH_ACCEPT_PAUSE_MS;
  uv_ref(&s->h->uv.handle); /* the timer resumes it */
  if (!s->accept_logged || now - s->accept_logged >= 10000) {
    s->accept_logged = now;
    fprintf(stderr, "moonbox: http: accept: %s: not accepting for %d ms at a time until it succeeds (%lld so far)\n",
            strerror(err), MBH_ACCEPT_PAUSE_MS, (long long)s->accept_failed);
  }
}

static void on_accept(uv_poll_t *poll, int status, int events);

static void resume_accept(mbh_server *s) {
  s->accept_resume = 0;
  uv_unref(&s->h->uv.handle);
  if (s->listening && !s->close_requested) uv_poll_start(&s->listener, UV_READABLE, on_accept);
}

static void new_conn(mbh_server *s, int fd) {
  mbh_conn *c = calloc(1, sizeof *c);
  uv_loop_t *loop = s->h->core->loop;
  if (!c) {
    close(fd);
    return;
  }
  int rc = s->is_unix ? uv_pipe_init(loop, &c->sock.pipe, 0) : uv_tcp_init(loop, &c->sock.tcp);
  if (rc < 0) {
    free(c);
    close(fd);
    return;
  }
  c->srv = s;
  c->sock.handle.data = c;
  c->next = s->conns;
  if (c->next) c->next->prev = c;
  s->conns = c;
  s->nconns++;
  s->aux_open++;
  c->over = s->nconns > s->max_conns;
  mbh_parser_init(&c->parser);
  rc = s->is_unix ? uv_pipe_open(&c->sock.pipe, fd) : uv_tcp_open(&c->sock.tcp, fd);
  if (rc < 0) {
    close(fd);
    mbh_conn_close(c);
    return;
  }
  if (!s->is_unix) {
    uv_tcp_nodelay(&c->sock.tcp, 1);
    struct sockaddr_in sa;
    socklen_t len = sizeof sa;
    if (getpeername(fd, (struct sockaddr *)&sa, &len) == 0 && sa.sin_family == AF_INET)
      inet_ntop(AF_INET, &sa.sin_addr, c->peer, sizeof c->peer);
  }
  c->phase = PH_HEAD;
  c->deadline = now_of(s) + s->idle_ms; /* the whole head within the idle timeout */
  update_reading(c);
}

static void on_accept(uv_poll_t *poll, int status, int events) {
  (void)events;
  mbh_server *s = poll->data;
  if (status < 0) return;
  for (int i = 0; i < 64 && !s->close_requested; i++) {
    int fd = accept4(s->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) pause_accept(s, errno);
      return; /* EAGAIN, or a connection that went away meanwhile */
    }
    /* past max_connections a few more are taken, to be answered 503
     * (Lua); past those, or while draining, hung up at once */
    if (s->draining || s->nconns >= s->max_conns + s->overflow) {
      s->refused++;
      close(fd);
      continue;
    }
    new_conn(s, fd);
  }
}

/* ---- deadlines ---------------------------------------------------------------------------- */

static void on_tick(uv_timer_t *t) {
  mbh_server *s = ((mb_handle *)t->data)->extra;
  uint64_t now = uv_now(t->loop);
  if (s->accept_resume && now >= s->accept_resume) resume_accept(s);
  for (mbh_conn *c = s->conns; c; c = c->next) {
    if (c->closing) continue;
    if (c->deadline && c->queued && (c->phase == PH_HANDLER || c->phase == PH_LINGER)) {
      /* a response being written: the deadline is for the client to take
       * bytes, so any taken since the last tick (a large write completes
       * only when all of it is taken) give it a new idle period */
      uint64_t moved = c->out_total - uv_stream_get_write_queue_size(&c->sock.stream);
      if (moved > c->out_moved) {
        c->out_moved = moved;
        c->deadline = now + s->idle_ms;
      }
    }
    if (c->phase == PH_WS && c->queued) {
      /* frames queued for a peer that takes none of them: dropped after an
       * idle period without progress, even if it keeps sending (a writer
       * that never reads would hold its queue for ever) */
      uint64_t moved = c->out_total - uv_stream_get_write_queue_size(&c->sock.stream);
      if (moved > c->out_moved || !c->ws_stalled_since) {
        c->out_moved = moved;
        c->ws_stalled_since = now;
        if (c->deadline) c->deadline = now + s->idle_ms; /* (set by on_written: bytes are moving) */
      } else if (now - c->ws_stalled_since > s->idle_ms) {
        mbh_conn_close(c);
        continue;
      }
    } else {
      c->ws_stalled_since = 0;
    }
    if (c->deadline && now > c->deadline) {
      mbh_conn_close(c);
    } else if (c->phase == PH_WS && c->established && !c->ws_close_sent) {
      if (now - c->ws_last_rx > MBH_WS_HANGUP_MS) {
        mbh_conn_close(c);
      } else if (now - c->ws_last_rx > MBH_WS_PING_MS && !c->ws_pinged) {
        c->ws_pinged = 1;
        mbh_send_frame(c, 9, 1, "", 0);
      }
    }
  }
}

void mbh_server_start(mbh_server *s) {
  uv_loop_t *loop = s->h->core->loop;
  uv_poll_init_socket(loop, &s->listener, s->fd);
  s->listener.data = s;
  s->listening = 1;
  s->aux_open = 1;
  uv_poll_start(&s->listener, UV_READABLE, on_accept);
  uv_timer_init(loop, &s->h->uv.timer);
  uint64_t every = s->idle_ms < 1000 ? 50 : 250;
  uv_timer_start(&s->h->uv.timer, on_tick, every, every);
  uv_unref(&s->h->uv.handle); /* the listening socket keeps the loop alive, not this */
}

void mbh_server_stop(mbh_server *s) {
  if (s->close_requested) return;
  s->close_requested = 1;
  s->accept_resume = 0;                      /* (close() has taken the handle's reference) */
  if (s->unix_path[0]) unlink(s->unix_path); /* a process that exits right after leaves none behind */
  s->unix_path[0] = 0;
  if (s->listening) {
    s->listening = 0;
    uv_poll_stop(&s->listener);
    uv_close((uv_handle_t *)&s->listener, on_listener_closed);
  }
  for (mbh_conn *c = s->conns; c; c = c->next) mbh_conn_close(c);
}
