/* libFuzzer target: base64 in src/codec_pure.c (core.base64_encode/decode,
 * bytes:base64_encode/decode).
 *
 * Properties, for every input x:
 *   - encode(x) has the promised length, holds only the alphabet and '=' at
 *     the end, and decodes back to x, padded or with the padding stripped;
 *   - x read as base64: mb_b64_decoded_len and mb_b64_decode accept exactly
 *     what a plain reference decoder below accepts (the standard alphabet,
 *     at most two '=' at the very end and then a length of 4n, no length of
 *     4n+1) and produce the same bytes.
 * Every buffer is exactly as long as the functions claim (libFuzzer's input
 * too), so ASan catches a read or write of one byte past it. */
#include "codec_pure.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(cond)                                                                                                    \
  do {                                                                                                                 \
    if (!(cond)) {                                                                                                     \
      fprintf(stderr, "fuzz_base64: %s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);                            \
      abort();                                                                                                         \
    }                                                                                                                  \
  } while (0)

static const char alphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

static int value_of(unsigned char c) {
  const char *p = c ? memchr(alphabet, c, 64) : NULL;
  return p ? (int)(p - alphabet) : -1;
}

/* The reference: -1 if in is not base64, else the decoded length (bytes in
 * out, which has room for len bytes). One bit at a time, nothing shared
 * with the code under test. */
static long long ref_decode(const unsigned char *in, size_t len, unsigned char *out) {
  size_t pad = 0;
  while (pad < 2 && pad < len && in[len - 1 - pad] == '=') pad++;
  if (pad && len % 4) return -1;
  size_t n = len - pad;
  if (n % 4 == 1) return -1;
  uint32_t acc = 0;
  int bits = 0;
  long long o = 0;
  for (size_t i = 0; i < n; i++) {
    int v = value_of(in[i]);
    if (v < 0) return -1;
    acc = (acc << 6) | (uint32_t)v;
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out[o++] = (unsigned char)(acc >> bits);
      acc &= (1u << bits) - 1;
    }
  }
  return o;
}

static void round_trip(const uint8_t *data, size_t size) {
  size_t elen = mb_b64_encoded_len(size);
  CHECK(elen % 4 == 0 && elen >= size && elen <= size / 3 * 4 + 4);
  char *enc = malloc(elen);
  CHECK(enc || !elen);
  mb_b64_encode(data, size, enc);
  size_t pad = size % 3 ? 3 - size % 3 : 0;
  for (size_t i = 0; i < elen; i++) {
    if (i >= elen - pad) CHECK(enc[i] == '=');
    else CHECK(value_of((unsigned char)enc[i]) >= 0);
  }
  /* padded, then with the padding stripped: both decode to the input */
  for (int strip = 0; strip < 2; strip++) {
    size_t n = strip ? elen - pad : elen;
    CHECK(mb_b64_decoded_len((const unsigned char *)enc, n) == (long long)size);
    unsigned char *dec = malloc(size);
    CHECK(dec || !size);
    CHECK(mb_b64_decode((const unsigned char *)enc, n, dec) == 0);
    CHECK(size == 0 || memcmp(dec, data, size) == 0);
    free(dec);
  }
  free(enc);
}

static void decode_arbitrary(const uint8_t *data, size_t size) {
  unsigned char *want = malloc(size ? size : 1);
  CHECK(want);
  long long ref = ref_decode(data, size, want);
  long long n = mb_b64_decoded_len(data, size);
  if (n >= 0) {
    CHECK((unsigned long long)n <= size);
    unsigned char *got = malloc((size_t)n);
    CHECK(got || !n);
    int rc = mb_b64_decode(data, size, got);
    if (ref < 0) {
      CHECK(rc < 0); /* the length check passed: a bad character */
    } else {
      CHECK(rc == 0 && n == ref);
      CHECK(n == 0 || memcmp(got, want, (size_t)n) == 0);
    }
    free(got);
  } else {
    CHECK(ref < 0);
  }
  free(want);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  round_trip(data, size);
  decode_arbitrary(data, size);
  return 0;
}
