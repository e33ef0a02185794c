/* The connection layer's private contract: conn.c (sockets, queues,
 * deadlines, accept limits) and lua.c (core.http_listen and the server's
 * methods). The pure protocol half is src/http/proto.h. */
#ifndef MOONBOX_HTTP_HTTP_H
#define MOONBOX_HTTP_HTTP_H

#include "private.h"
#include "http/proto.h"

#define MBH_SERVER "moonbox.http_server"
/* A connection's socket is not read while more than this is queued for it:
 * a client that does not read cannot make the server buffer without bound
 * (Lua waits at http.lua's HIGH_WATER, 256 KiB, before writing more). */
#define MBH_READ_PAUSE (512 * 1024)
/* Bytes read ahead of the request being answered (pipelining) at most. */
#define MBH_READ_AHEAD (64 * 1024)
#define MBH_ACCEPT_PAUSE_MS 100
#define MBH_WS_PING_MS 30000   /* a quiet WebSocket is pinged */
#define MBH_WS_HANGUP_MS 75000 /* and hung up when the peer stays silent */

enum { MBH_CB_CLOSE = 0, MBH_CB_EVENT = 1 };

/* What a connection does now. */
enum {
  PH_HEAD,    /* reading a request head */
  PH_BODY,    /* reading its body */
  PH_HANDLER, /* the request is Lua's: nothing more is parsed until its response is out */
  PH_WS,      /* a WebSocket */
  PH_LINGER   /* the last response is out; what the client still sends is dropped until it closes */
};

typedef struct mbh_out {
  struct mbh_out *next; /* while held back (WebSocket frames before the 101) */
  uv_write_t req;
  struct mbh_conn *conn;
  const char *bytes; /* data, or a Lua string's bytes */
  int lua_ref;       /* that string's registry anchor until written; LUA_NOREF: data */
  size_t len;
  char data[];
} mbh_out;

typedef struct mbh_server mbh_server;

typedef struct mbh_conn {
  struct mbh_conn *next, *prev;
  mbh_server *srv;
  union {
    uv_handle_t handle;
    uv_stream_t stream;
    uv_tcp_t tcp;
    uv_pipe_t pipe;
  } sock;
  uv_shutdown_t shutdown_req;
  char peer[64];
  int phase;
  int closing, reading, eof, shut;
  mbh_parser parser;
  char *in; /* read and not yet parsed: in[in_off, in_len) */
  size_t in_off, in_len, in_cap;
  uint64_t deadline; /* loop time the client must act by; 0: none */
  /* the current request (id 0: none) */
  lua_Integer id;
  int over;        /* accepted past max_connections: answered 503, then closed */
  int too_large;   /* 1: body over max_body, 2: Transfer-Encoding (411); not read */
  int head_only;   /* a HEAD request: no body bytes go out */
  int responding;  /* the response's head is queued */
  int finishing;   /* the response ends once the queue is written */
  int close_after; /* close the connection after this response */
  char *body;
  size_t body_len;
  uint64_t body_start; /* loop time the body's head was parsed */
  size_t queued;       /* bytes handed to uv_write and not yet written */
  uint64_t out_total;  /* bytes ever handed to uv_write */
  uint64_t out_moved;  /* of those, how many the socket had taken at the last check */
  /* a WebSocket */
  int is_ws, established;
  mbh_ws ws;
  int ws_out_open; /* a fragmented message of ours is under way */
  int ws_close_sent, ws_peer_closed;
  uint64_t ws_last_rx;
  uint64_t ws_stalled_since; /* loop time our frames stopped moving (0: moving, or none queued) */
  int ws_pinged;
  mbh_out *held, *held_tail; /* frames written before the handshake's answer */
  char *reject;              /* its whole response */
  size_t reject_len;
} mbh_conn;

struct mbh_server {
  mb_handle *h; /* the server's handle (its timer checks deadlines) */
  uv_poll_t listener;
  int fd;
  int listening;          /* the listener's poll is open */
  int aux_open;           /* the listener and connections not yet closed */
  uint64_t accept_resume; /* loop time to accept again after a failure; 0: accepting */
  uint64_t accept_logged;
  mbh_conn *conns;
  int nconns;
  lua_Integer next_id;
  size_t max_body;
  int max_conns, overflow;
  uint64_t idle_ms;
  int port;
  int close_requested, draining;
  lua_Integer refused, accept_failed;
  int is_unix;
  char unix_path[108]; /* the socket file, until close() removes it */
  mbh_server *next_server;
};

/* ---- conn.c ---------------------------------------------------------------- */

/* A listening socket for host:port or unix_path: its fd, or a negative errno. */
int mbh_listen_socket(const char *host, int port, const char *unix_path, int *bound_port);
/* Start accepting on s->fd, and the deadline checks on s->h's timer. */
void mbh_server_start(mbh_server *s);
/* Stop accepting, drop every connection; s->h closes once all are closed. */
void mbh_server_stop(mbh_server *s);
/* Queue bytes for c's socket; -1 if it cannot take them (c is being closed). */
int mbh_send(mbh_conn *c, const void *data, size_t len);
/* The Lua string at idx, queued without a copy (anchored until written):
 * a large body is not copied on the loop. */
int mbh_send_string(mbh_conn *c, lua_State *L, int idx);
/* A WebSocket frame of ours (held back until the handshake is answered). */
int mbh_send_frame(mbh_conn *c, int opcode, int fin, const void *data, size_t len);
/* The response's queue is complete: finish the request once it is written. */
void mbh_finish(mbh_conn *c);
/* Close a WebSocket with code and reason after what is queued. */
void mbh_ws_send_close(mbh_conn *c, int code, const char *reason, size_t len);
mbh_conn *mbh_conn_by_id(mbh_server *s, lua_Integer id);
void mbh_conn_close(mbh_conn *c);

/* ---- lua.c: events to Lua --------------------------------------------------- */

void mbh_emit(mbh_server *s, const char *kind, lua_Integer id);
/* The "request" event for c's current head (and body, if read). */
void mbh_emit_request(mbh_conn *c);
void mbh_emit_message(mbh_conn *c, const uint8_t *data, size_t len, int binary);
/* Every connection closed after stop: close the server's handle. */
void mbh_server_closed(mbh_server *s);

#endif
