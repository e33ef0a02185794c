/* The pure half of the HTTP family: the request-stream parser (head.c) and
 * WebSocket framing (ws.c, over wslay's frame API). No Lua, no libuv: bytes
 * in, events out, so the fuzz targets (spec/fuzz/fuzz_http_head.c,
 * spec/fuzz/fuzz_ws_frame.c) link these files alone. conn.c drives them
 * from the sockets (src/http/http.h). */
#ifndef MOONBOX_HTTP_PROTO_H
#define MOONBOX_HTTP_PROTO_H

#include <stddef.h>
#include <stdint.h>

/* ---- head.c: the request stream ------------------------------------------------ */

#define MBH_HEAD_MAX 8192 /* a whole head, request line to blank line: over it, 431 */
#define MBH_MAX_FIELDS 100

typedef struct mbh_field {
  const char *name, *value; /* into the parser's head buffer; value without surrounding blanks */
  size_t name_len, value_len;
} mbh_field;

/* A parsed request head. Everything points into the parser's buffer and
 * lives until mbh_parser_next. */
typedef struct mbh_head {
  const char *line; /* the request line as sent, without its CR LF (raw_line) */
  size_t line_len;
  const char *method, *target;
  size_t method_len, target_len;
  int minor; /* HTTP/1.minor */
  mbh_field fields[MBH_MAX_FIELDS];
  size_t nfields;
  uint64_t content_length; /* 0 without the header */
  int has_length;
  int has_te;          /* Transfer-Encoding (any coding): the body is not read (411) */
  int keep_alive;      /* the client allows another request on the connection */
  int websocket;       /* Upgrade: websocket with Connection: upgrade */
  int expect_continue; /* Expect: 100-continue */
  const char *ws_key;  /* Sec-WebSocket-Key, NULL if absent */
  size_t ws_key_len;
  int ws_version_ok; /* Sec-WebSocket-Version: 13 */
  int ws_protocol;   /* Sec-WebSocket-Protocol given (no subprotocol is offered) */
} mbh_head;

enum {
  MBH_NEED_MORE, /* every byte given was taken: feed more */
  MBH_HEAD,      /* ev.head is complete; ev.end if the request has no body */
  MBH_BODY,      /* ev.data/ev.len: body bytes (in the caller's buffer); ev.end on the last */
  MBH_STOPPED,   /* after a head whose body is not framed here (Transfer-Encoding, WebSocket) */
  MBH_ERROR      /* ev.status (400, 431) and ev.why: refuse, and close */
};

typedef struct mbh_event {
  int kind;
  int end;
  const mbh_head *head;
  const char *data;
  size_t len;
  int status;
  const char *why;
} mbh_event;

typedef struct mbh_parser {
  int state;
  char *buf; /* the head being read (MBH_HEAD_MAX bytes while one is), else NULL */
  size_t len;
  size_t scan;       /* where the search for the head's end goes on */
  size_t line_start; /* the start of the line that search is in */
  uint64_t body_left;
  mbh_head head;
} mbh_parser;

void mbh_parser_init(mbh_parser *p);
/* The request is over: forget its head, read the next one. */
void mbh_parser_next(mbh_parser *p);
void mbh_parser_free(mbh_parser *p);
/* Take bytes of the stream; one event per call. Returns how many bytes of
 * data were used (the rest is the caller's to give again). -1 with no event
 * when out of memory. Call again while bytes are left (also after MBH_HEAD
 * with ev.end: the next request may follow). */
long mbh_parse(mbh_parser *p, const char *data, size_t len, mbh_event *ev);

/* The value of the first field named lname (lowercase), or NULL. */
const char *mbh_head_get(const mbh_head *h, const char *lname, size_t *len);
/* The request's path (req.path): the target up to '?' or
 * '#', percent-decoded, then empty, '.' and '..' segments taken out (a
 * trailing '/' kept). out has room for target_len + 2 bytes; returns the
 * length written (no NUL). */
size_t mbh_decode_path(const char *target, size_t len, char *out);
/* The query's next '&'-separated parameter, decoded ('+' is a space),
 * from *pos on (start at 0); empty ones are skipped. out has room for
 * len bytes. Returns its length, or -1 when there is none left. */
long mbh_next_arg(const char *target, size_t len, size_t *pos, char *out);

/* ---- ws.c: WebSocket framing ----------------------------------------------------- */

#define MBH_WS_ACCEPT_LEN 28 /* base64 of a SHA-1 */

/* Sec-WebSocket-Accept for a client's key: 0, or -1 when the key is not
 * the base64 of 16 bytes (RFC 6455 4.2.1). out gets 28 characters, no NUL. */
int mbh_ws_accept(const char *key, size_t len, char out[MBH_WS_ACCEPT_LEN]);

enum {
  MBH_WS_NEED_MORE, /* every byte given was taken */
  MBH_WS_MESSAGE,   /* ev.data/ev.len: a whole message, ev.binary */
  MBH_WS_PING,      /* ev.data/ev.len: answer with a pong of it */
  MBH_WS_PONG,
  MBH_WS_CLOSE, /* the peer's close: ev.code (1005: none), ev.data/ev.len the reason */
  MBH_WS_ERROR  /* close with ev.code (1002, 1009) and ev.why; nothing more is read */
};

typedef struct mbh_ws_event {
  int kind;
  const uint8_t *data;
  size_t len;
  int binary;
  int code;
  const char *why;
} mbh_ws_event;

struct wslay_frame_context;

typedef struct mbh_ws {
  struct wslay_frame_context *fc; /* wslay's frame reader and writer */
  const uint8_t *in;              /* the bytes being read (wslay's recv callback takes from here) */
  size_t in_len, in_used;
  uint8_t *out; /* where wslay's send callback writes a frame */
  size_t out_len;
  int in_frame; /* a frame's payload is being read */
  uint64_t frame_left;
  int opcode, fin;
  int msg_open, msg_binary;
  uint8_t *msg; /* the data message being assembled, at most max_msg bytes */
  size_t msg_len, msg_cap, max_msg;
  uint8_t ctrl[125]; /* a control frame's payload */
  size_t ctrl_len;
  int done; /* a close was read, or an error: the rest is not read */
} mbh_ws;

/* 0, or -1 when out of memory. Messages over max_msg bytes are an error (1009). */
int mbh_ws_init(mbh_ws *ws, size_t max_msg);
void mbh_ws_free(mbh_ws *ws);
/* Read frames from a client (masked, as RFC 6455 requires); one event per
 * call, returns how many bytes of data were used. Call again until
 * MBH_WS_NEED_MORE, also with len 0: bytes taken earlier may hold frames. */
size_t mbh_ws_read(mbh_ws *ws, const uint8_t *data, size_t len, mbh_ws_event *ev);
/* A frame from the server (unmasked) into out, which has room for len +
 * 10 bytes; returns its size. opcode: 0 continuation, 1 text, 2 binary,
 * 8 close, 9 ping, 10 pong (a control payload is at most 125 bytes). */
size_t mbh_ws_frame(mbh_ws *ws, int opcode, int fin, const void *data, size_t len, uint8_t *out);
/* The payload of a close frame: code and reason (cut to 123 bytes) into
 * out (125 bytes); returns its length. */
size_t mbh_ws_close_payload(int code, const char *reason, size_t len, uint8_t out[125]);

#endif
