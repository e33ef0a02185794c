/* libFuzzer target: the request-stream parser, src/http/head.c (mbh_parse,
 * mbh_decode_path, mbh_next_arg), the only HTTP parser the server has.
 *
 * The input's first byte seeds how the rest is cut into reads; the stream
 * is parsed twice, as one read and in those pieces (each a buffer of its
 * own, exactly as long, so ASan sees a byte read past it), driven as
 * src/http/conn.c drives it: the next request after one ends, nothing after
 * an error or a head whose body is not framed here. Properties:
 *   - mbh_parse uses at most the bytes given; NEED_MORE means it took them all;
 *   - after an error (400/431 with a reason) or a stop, no event follows;
 *   - a head is sane (method, target, fields within bounds, body framing
 *     as it said) and a body never exceeds its Content-Length;
 *   - both ways of reading give the same requests, bodies and verdict;
 *   - the path and query decoders stay in the room they promise to use. */
#include "http/proto.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(cond)                                                                                                    \
  do {                                                                                                                 \
    if (!(cond)) {                                                                                                     \
      fprintf(stderr, "fuzz_http_head: %s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);                         \
      abort();                                                                                                         \
    }                                                                                                                  \
  } while (0)

/* What a reading of the stream gave, to compare two readings. */
typedef struct transcript {
  uint64_t hash; /* of the heads' lines and fields, and the bodies, in order */
  int requests, status;
  size_t body_bytes;
} transcript;

/* bytes alone (a body, however it was cut), or bytes and their length (a
 * line, a value) */
static void mix_bytes(transcript *t, const void *data, size_t len) {
  const unsigned char *p = data;
  for (size_t i = 0; i < len; i++) t->hash = (t->hash ^ p[i]) * 1099511628211ull;
}

static void mix(transcript *t, const void *data, size_t len) {
  mix_bytes(t, data, len);
  t->hash = (t->hash ^ len) * 1099511628211ull;
}

static void check_decoders(const mbh_head *h) {
  char *path = malloc(h->target_len + 2);
  CHECK(path);
  size_t n = mbh_decode_path(h->target, h->target_len, path);
  CHECK(n >= 1 && n <= h->target_len + 2 && path[0] == '/');
  free(path);
  char *arg = malloc(h->target_len ? h->target_len : 1);
  CHECK(arg);
  size_t pos = 0, last = 0;
  for (int i = 0; i <= (int)h->target_len; i++) {
    long len = mbh_next_arg(h->target, h->target_len, &pos, arg);
    if (len < 0) break;
    CHECK((size_t)len <= h->target_len && pos > last); /* it moves on */
    last = pos;
  }
  free(arg);
}

static void check_head(const mbh_head *h) {
  CHECK(h->line && h->line_len > 0 && h->line_len < MBH_HEAD_MAX);
  CHECK(h->method_len > 0 && h->target_len > 0 && h->method_len + h->target_len < h->line_len);
  CHECK(h->method == h->line && h->target > h->line && h->target + h->target_len <= h->line + h->line_len);
  CHECK(h->minor == 0 || h->minor == 1);
  CHECK(h->nfields <= MBH_MAX_FIELDS);
  for (size_t i = 0; i < h->nfields; i++) CHECK(h->fields[i].name_len > 0);
  CHECK(!(h->has_te && h->has_length));
  CHECK(h->has_length || h->content_length == 0);
  CHECK(!h->websocket || (!h->has_te && h->content_length == 0));
  check_decoders(h);
}

/* Parse the stream in reads of the given sizes (0: the rest). */
static void read_stream(const char *data, size_t size, uint32_t seed, int split, transcript *t) {
  mbh_parser p;
  mbh_parser_init(&p);
  memset(t, 0, sizeof *t);
  t->hash = 14695981039346656037ull;
  int over = 0;      /* an error or a stop: nothing may follow */
  uint64_t left = 0; /* body bytes the head announced and not yet seen */
  for (size_t at = 0; at < size;) {
    size_t n = size - at;
    if (split) {
      seed = seed * 1103515245u + 12345u;
      size_t cut = 1 + (seed >> 16) % 64;
      if (cut < n) n = cut;
    }
    char *read = malloc(n);
    CHECK(read);
    memcpy(read, data + at, n);
    size_t off = 0;
    for (int guard = 0; guard < 100000; guard++) {
      mbh_event ev;
      long used = mbh_parse(&p, read + off, n - off, &ev);
      CHECK(used >= 0 && (size_t)used <= n - off);
      off += (size_t)used;
      if (over) {
        CHECK(ev.kind == MBH_STOPPED && used == 0);
        break;
      }
      if (ev.kind == MBH_NEED_MORE) {
        CHECK(off == n);
        break;
      }
      if (ev.kind == MBH_ERROR) {
        CHECK((ev.status == 400 || ev.status == 431) && ev.why && *ev.why);
        t->status = ev.status;
        over = 1;
        continue;
      }
      if (ev.kind == MBH_STOPPED) {
        over = 1;
        continue;
      }
      if (ev.kind == MBH_HEAD) {
        check_head(ev.head);
        t->requests++;
        mix(t, ev.head->line, ev.head->line_len);
        for (size_t i = 0; i < ev.head->nfields; i++) mix(t, ev.head->fields[i].value, ev.head->fields[i].value_len);
        left = ev.head->content_length;
        CHECK(!ev.end || left == 0);
        if (ev.head->websocket || ev.head->has_te) {
          over = 1; /* the parser stops; conn.c hands the rest to ws.c or closes */
          CHECK(!ev.end);
          continue;
        }
      } else {
        CHECK(ev.kind == MBH_BODY && ev.len <= left && ev.len > 0 && ev.data == read + off - used);
        left -= ev.len;
        t->body_bytes += ev.len;
        mix_bytes(t, ev.data, ev.len);
        CHECK(ev.end == (left == 0));
      }
      if (ev.end) mbh_parser_next(&p);
    }
    free(read);
    at += n;
    if (over) break;
  }
  mbh_parser_free(&p);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  uint32_t seed = data[0];
  transcript whole, pieces;
  read_stream((const char *)data + 1, size - 1, seed, 0, &whole);
  read_stream((const char *)data + 1, size - 1, seed, 1, &pieces);
  CHECK(whole.requests == pieces.requests);
  CHECK(whole.body_bytes == pieces.body_bytes);
  CHECK(whole.status == pieces.status);
  CHECK(whole.hash == pieces.hash);
  return 0;
}
