/* WebSocket framing for the server side of RFC 6455, pure (no Lua, no
 * libuv; src/http/proto.h). wslay's frame API reads frame headers,
 * lengths and masks and writes frames; the rules of a conversation are
 * ours: client frames must be masked, no extension bits, control frames
 * whole and short, continuations only inside a message, and a message over
 * max_msg bytes ends the connection (1009) before it is buffered. */
#include "http/proto.h"

#include <stdlib.h>
#include <string.h>
#include <wslay/wslay.h>

/* ---- the handshake: Sec-WebSocket-Accept ------------------------------------------- */

static uint32_t rol(uint32_t x, int n) { return (x << n) | (x >> (32 - n)); }

static void sha1_block(uint32_t h[5], const uint8_t *p) {
  uint32_t w[80];
  for (int i = 0; i < 16; i++)
    w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
  for (int i = 16; i < 80; i++) w[i] = rol(w[i - 3] ^ w[i - 8] ^ w[i - 14] ^ w[i - 16], 1);
  uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4];
  for (int i = 0; i < 80; i++) {
    uint32_t f, k;
    if (i < 20) f = (b & c) | (~b & d), k = 0x5a827999;
    else if (i < 40) f = b ^ c ^ d, k = 0x6ed9eba1;
    else if (i < 60) f = (b & c) | (b & d) | (c & d), k = 0x8f1bbcdc;
    else f = b ^ c ^ d, k = 0xca62c1d6;
    uint32_t t = rol(a, 5) + f + e + k + w[i];
    e = d, d = c, c = rol(b, 30), b = a, a = t;
  }
  h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e;
}

/* SHA-1 of a message under 120 bytes (a key and the GUID: two blocks at most) */
static void sha1_short(const uint8_t *msg, size_t len, uint8_t out[20]) {
  uint32_t h[5] = {0x67452301, 0xefcdab89, 0x98badcfe, 0x10325476, 0xc3d2e1f0};
  uint8_t buf[128] = {0};
  memcpy(buf, msg, len);
  buf[len] = 0x80;
  size_t total = len + 9 <= 64 ? 64 : 128;
  uint64_t bits = (uint64_t)len * 8;
  for (int i = 0; i < 8; i++) buf[total - 1 - i] = (uint8_t)(bits >> (8 * i));
  for (size_t at = 0; at < total; at += 64) sha1_block(h, buf + at);
  for (int i = 0; i < 20; i++) out[i] = (uint8_t)(h[i / 4] >> (24 - 8 * (i % 4)));
}

static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

int mbh_ws_accept(const char *key, size_t len, char out[MBH_WS_ACCEPT_LEN]) {
  /* 16 bytes in base64: 22 characters and "==" */
  if (len != 24 || key[22] != '=' || key[23] != '=') return -1;
  for (size_t i = 0; i < 22; i++)
    if (!key[i] || !strchr(b64, key[i])) return -1;
  static const char guid[] = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11";
  uint8_t msg[24 + sizeof guid], digest[21] = {0};
  memcpy(msg, key, 24);
  memcpy(msg + 24, guid, sizeof guid - 1);
  sha1_short(msg, 24 + sizeof guid - 1, digest);
  for (int i = 0, o = 0; i < 21; i += 3) { /* 20 bytes: the last group has two */
    uint32_t v = (uint32_t)digest[i] << 16 | (uint32_t)digest[i + 1] << 8 | digest[i + 2];
    out[o++] = b64[v >> 18];
    out[o++] = b64[(v >> 12) & 63];
    out[o++] = b64[(v >> 6) & 63];
    out[o++] = i == 18 ? '=' : b64[v & 63];
  }
  return 0;
}

/* ---- wslay's callbacks: bytes from ws->in, frames into ws->out --------------------- */

static ssize_t take_input(uint8_t *buf, size_t len, int flags, void *user) {
  (void)flags;
  mbh_ws *ws = user;
  size_t n = ws->in_len - ws->in_used;
  if (n == 0) return -1; /* wslay reports WANT_READ */
  if (n > len) n = len;
  memcpy(buf, ws->in + ws->in_used, n);
  ws->in_used += n;
  return (ssize_t)n;
}

static ssize_t put_output(const uint8_t *data, size_t len, int flags, void *user) {
  (void)flags;
  mbh_ws *ws = user;
  memcpy(ws->out + ws->out_len, data, len);
  ws->out_len += len;
  return (ssize_t)len;
}

static int no_mask(uint8_t *buf, size_t len, void *user) {
  (void)user;
  memset(buf, 0, len); /* (never asked for: a server's frames are not masked) */
  return 0;
}

int mbh_ws_init(mbh_ws *ws, size_t max_msg) {
  memset(ws, 0, sizeof *ws);
  ws->max_msg = max_msg;
  static const struct wslay_frame_callbacks callbacks = {put_output, take_input, no_mask};
  return wslay_frame_context_init(&ws->fc, &callbacks, ws) == 0 ? 0 : -1;
}

void mbh_ws_free(mbh_ws *ws) {
  if (ws->fc) wslay_frame_context_free(ws->fc);
  free(ws->msg);
  memset(ws, 0, sizeof *ws);
}

/* ---- reading ------------------------------------------------------------------------ */

static int fail(mbh_ws *ws, mbh_ws_event *ev, int code, const char *why) {
  ws->done = 1;
  ev->kind = MBH_WS_ERROR;
  ev->code = code;
  ev->why = why;
  return 1;
}

static int is_control(int opcode) { return opcode >= 8; }

/* A frame begins: check it against the conversation so far. */
static int frame_start(mbh_ws *ws, const struct wslay_frame_iocb *io, mbh_ws_event *ev) {
  int op = io->opcode;
  if (!io->mask) return fail(ws, ev, 1002, "an unmasked frame from the client");
  if (io->rsv) return fail(ws, ev, 1002, "reserved bits set (no extension was agreed)");
  if ((op > 2 && op < 8) || op > 10) return fail(ws, ev, 1002, "an unknown opcode");
  if (is_control(op) && (!io->fin || io->payload_length > 125)) return fail(ws, ev, 1002, "a malformed control frame");
  if (op == 0 && !ws->msg_open) return fail(ws, ev, 1002, "a continuation outside a message");
  if ((op == 1 || op == 2) && ws->msg_open) return fail(ws, ev, 1002, "a new message inside a fragmented one");
  if (op == 8 && io->payload_length == 1) return fail(ws, ev, 1002, "a close frame with a one-byte payload");
  if (!is_control(op)) {
    if (op != 0) {
      ws->msg_open = 1;
      ws->msg_binary = op == 2;
      ws->msg_len = 0;
    }
    if (io->payload_length > ws->max_msg - ws->msg_len) return fail(ws, ev, 1009, "message too large");
    size_t need = ws->msg_len + (size_t)io->payload_length;
    if (need > ws->msg_cap) {
      size_t cap = ws->msg_cap ? ws->msg_cap : 1024;
      while (cap < need) cap *= 2;
      uint8_t *m = realloc(ws->msg, cap);
      if (!m) return fail(ws, ev, 1011, "out of memory");
      ws->msg = m;
      ws->msg_cap = cap;
    }
  }
  ws->in_frame = 1;
  ws->opcode = op;
  ws->fin = io->fin;
  ws->frame_left = io->payload_length;
  ws->ctrl_len = 0;
  return 0;
}

/* The frame is whole: its event, if it makes one. */
static int frame_end(mbh_ws *ws, mbh_ws_event *ev) {
  ws->in_frame = 0;
  switch (ws->opcode) {
  case 8:
    ws->done = 1;
    ev->kind = MBH_WS_CLOSE;
    ev->code = 1005;
    if (ws->ctrl_len >= 2) {
      ev->code = ws->ctrl[0] << 8 | ws->ctrl[1];
      ev->data = ws->ctrl + 2;
      ev->len = ws->ctrl_len - 2;
    }
    return 1;
  case 9:
  case 10:
    ev->kind = ws->opcode == 9 ? MBH_WS_PING : MBH_WS_PONG;
    ev->data = ws->ctrl;
    ev->len = ws->ctrl_len;
    return 1;
  default:
    if (!ws->fin) return 0;
    ws->msg_open = 0;
    ev->kind = MBH_WS_MESSAGE;
    ev->data = ws->msg ? ws->msg : (const uint8_t *)"";
    ev->len = ws->msg_len;
    ev->binary = ws->msg_binary;
    return 1;
  }
}

size_t mbh_ws_read(mbh_ws *ws, const uint8_t *data, size_t len, mbh_ws_event *ev) {
  memset(ev, 0, sizeof *ev);
  ev->kind = MBH_WS_NEED_MORE;
  if (ws->done || !ws->fc) return len; /* after a close or an error nothing is read */
  ws->in = data;
  ws->in_len = len;
  ws->in_used = 0;
  for (;;) {
    struct wslay_frame_iocb io;
    memset(&io, 0, sizeof io);
    ssize_t r = wslay_frame_recv(ws->fc, &io);
    if (r == WSLAY_ERR_PROTO) {
      fail(ws, ev, 1002, "a malformed frame");
      break;
    }
    if (r < 0) break; /* every byte is in wslay's buffer */
    if (!ws->in_frame && frame_start(ws, &io, ev)) break;
    size_t n = io.data_length;
    if (n > ws->frame_left) n = (size_t)ws->frame_left; /* (wslay never gives more) */
    if (is_control(ws->opcode)) {
      memcpy(ws->ctrl + ws->ctrl_len, io.data, n);
      ws->ctrl_len += n;
    } else if (n) {
      memcpy(ws->msg + ws->msg_len, io.data, n);
      ws->msg_len += n;
    }
    ws->frame_left -= n;
    if (ws->frame_left == 0 && frame_end(ws, ev)) break;
    if (n == 0 && ws->frame_left) break; /* (no progress: wait for bytes) */
  }
  size_t used = ws->in_used;
  ws->in = NULL;
  ws->in_len = ws->in_used = 0;
  return used;
}

/* ---- writing ------------------------------------------------------------------------ */

size_t mbh_ws_frame(mbh_ws *ws, int opcode, int fin, const void *data, size_t len, uint8_t *out) {
  struct wslay_frame_iocb io = {.fin = (uint8_t)(fin != 0),
                                .opcode = (uint8_t)opcode,
                                .payload_length = len,
                                .mask = 0,
                                .data = data,
                                .data_length = len};
  ws->out = out;
  ws->out_len = 0;
  for (size_t sent = 0, idle = 0; idle < 2;) {
    ssize_t r = wslay_frame_send(ws->fc, &io);
    if (r < 0) break;
    idle = r == 0 ? idle + 1 : 0; /* (the header alone goes out with no payload counted) */
    sent += (size_t)r;
    if (sent >= len) break;
    io.data = (const uint8_t *)data + sent;
    io.data_length = len - sent;
  }
  ws->out = NULL;
  return ws->out_len;
}

size_t mbh_ws_close_payload(int code, const char *reason, size_t len, uint8_t out[125]) {
  if (len > 123) len = 123;
  out[0] = (uint8_t)(code >> 8);
  out[1] = (uint8_t)(code & 0xff);
  memcpy(out + 2, reason, len);
  return len + 2;
}
