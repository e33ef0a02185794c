/* libFuzzer target: WebSocket framing, src/http/ws.c (mbh_ws_read over
 * wslay's frame reader, mbh_ws_frame, mbh_ws_accept).
 *
 * The input's first byte sets the message limit and how the rest is cut
 * into reads; the bytes are read as a client's frames twice, as one read
 * and in those pieces (each a buffer of its own, exactly as long), calling
 * again until NEED_MORE as src/http/conn.c does. Properties:
 *   - mbh_ws_read uses at most the bytes given;
 *   - after a close or an error (1002, 1009 with a reason) nothing follows;
 *   - a message is never over the limit, a control payload never over 125;
 *   - both ways of reading give the same events;
 *   - a frame of ours is the payload plus a header of 2 to 10 bytes, and
 *     the accept key of a 24-byte key is 28 base64 characters. */
#include "http/proto.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(cond)                                                                                                    \
  do {                                                                                                                 \
    if (!(cond)) {                                                                                                     \
      fprintf(stderr, "fuzz_ws_frame: %s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);                          \
      abort();                                                                                                         \
    }                                                                                                                  \
  } while (0)

static uint64_t mix(uint64_t h, const void *data, size_t len) {
  const unsigned char *p = data;
  for (size_t i = 0; i < len; i++) h = (h ^ p[i]) * 1099511628211ull;
  return (h ^ len) * 1099511628211ull;
}

static void check_frame(mbh_ws *ws, const mbh_ws_event *ev) {
  uint8_t *out = malloc(ev->len + 10);
  CHECK(out);
  size_t n = mbh_ws_frame(ws, ev->binary ? 2 : 1, 1, ev->data, ev->len, out);
  CHECK(n >= ev->len + 2 && n <= ev->len + 10 && (out[1] & 0x80) == 0);
  CHECK(memcmp(out + n - ev->len, ev->data, ev->len) == 0);
  free(out);
}

static uint64_t read_frames(const uint8_t *data, size_t size, size_t max_msg, uint32_t seed, int split) {
  mbh_ws ws;
  CHECK(mbh_ws_init(&ws, max_msg) == 0);
  uint64_t h = 14695981039346656037ull;
  int over = 0;
  for (size_t at = 0; at < size && !over;) {
    size_t n = size - at;
    if (split) {
      seed = seed * 1103515245u + 12345u;
      size_t cut = 1 + (seed >> 16) % 48;
      if (cut < n) n = cut;
    }
    uint8_t *read = malloc(n);
    CHECK(read);
    memcpy(read, data + at, n);
    size_t off = 0;
    for (int guard = 0;; guard++) {
      CHECK(guard < 100000);
      mbh_ws_event ev;
      size_t used = mbh_ws_read(&ws, read + off, n - off, &ev);
      CHECK(used <= n - off);
      off += used;
      if (ev.kind == MBH_WS_NEED_MORE) break;
      CHECK(!over);
      h = mix(h, &ev.kind, sizeof ev.kind);
      switch (ev.kind) {
      case MBH_WS_MESSAGE:
        CHECK(ev.len <= max_msg);
        check_frame(&ws, &ev);
        h = mix(h, ev.data, ev.len);
        h = mix(h, &ev.binary, sizeof ev.binary);
        break;
      case MBH_WS_PING:
      case MBH_WS_PONG:
        CHECK(ev.len <= 125);
        h = mix(h, ev.data, ev.len);
        break;
      case MBH_WS_CLOSE:
        CHECK(ev.len <= 123);
        h = mix(h, &ev.code, sizeof ev.code);
        over = 1;
        break;
      case MBH_WS_ERROR:
        CHECK((ev.code == 1002 || ev.code == 1009 || ev.code == 1011) && ev.why && *ev.why);
        h = mix(h, &ev.code, sizeof ev.code);
        over = 1;
        break;
      default: CHECK(0);
      }
    }
    free(read);
    at += n;
  }
  mbh_ws_free(&ws);
  return h;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  size_t max_msg = 1 + (size_t)data[0] * 64;
  uint64_t whole = read_frames(data + 1, size - 1, max_msg, data[0], 0);
  uint64_t pieces = read_frames(data + 1, size - 1, max_msg, data[0], 1);
  CHECK(whole == pieces);
  if (size >= 25) {
    char accept[MBH_WS_ACCEPT_LEN];
    if (mbh_ws_accept((const char *)data + 1, 24, accept) == 0)
      for (int i = 0; i < MBH_WS_ACCEPT_LEN; i++) CHECK(accept[i] && (i < 27 || accept[i] == '='));
  }
  return 0;
}
