/* codec_pure: base64 and the UTF-8 / text scans of the codec family, on
 * plain byte ranges (src/codec_pure.h). src/codec.c binds them to Lua; the
 * fuzz targets under spec/fuzz/ link this file alone, so it touches no Lua
 * state, no libuv and allocates nothing. */
#include "codec_pure.h"

#include <pthread.h>
#include <stdint.h>
#include <string.h>

/* ---- base64 ---------------------------------------------------------------- */

static const char b64_alphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/* Two output characters for every 12-bit group: half the table lookups. */
static uint16_t enc_pairs[4096];
/* Each character's 6 bits already shifted into place for its position in a
 * group of four; B64_BAD marks a character outside the alphabet. */
#define B64_BAD 0x01000000u
static uint32_t dec[4][256];
static pthread_once_t tables_once = PTHREAD_ONCE_INIT;

static void build_tables(void) {
  for (int i = 0; i < 4096; i++) {
    unsigned char pair[2] = {(unsigned char)b64_alphabet[i >> 6], (unsigned char)b64_alphabet[i & 63]};
    memcpy(&enc_pairs[i], pair, 2);
  }
  for (int p = 0; p < 4; p++)
    for (int c = 0; c < 256; c++) dec[p][c] = B64_BAD;
  for (int v = 0; v < 64; v++) {
    unsigned char c = (unsigned char)b64_alphabet[v];
    dec[0][c] = (uint32_t)v << 18;
    dec[1][c] = (uint32_t)v << 12;
    dec[2][c] = (uint32_t)v << 6;
    dec[3][c] = (uint32_t)v;
  }
}

static void init_tables(void) { pthread_once(&tables_once, build_tables); }

size_t mb_b64_encoded_len(size_t len) { return (len + 2) / 3 * 4; }

void mb_b64_encode(const unsigned char *in, size_t len, char *out) {
  init_tables();
  size_t i = 0;
  for (; i + 3 <= len; i += 3) {
    uint32_t v = ((uint32_t)in[i] << 16) | ((uint32_t)in[i + 1] << 8) | in[i + 2];
    memcpy(out, &enc_pairs[v >> 12], 2);
    memcpy(out + 2, &enc_pairs[v & 4095], 2);
    out += 4;
  }
  if (len - i == 1) {
    uint32_t v = (uint32_t)in[i] << 16;
    out[0] = b64_alphabet[v >> 18];
    out[1] = b64_alphabet[(v >> 12) & 63];
    out[2] = '=';
    out[3] = '=';
  } else if (len - i == 2) {
    uint32_t v = ((uint32_t)in[i] << 16) | ((uint32_t)in[i + 1] << 8);
    out[0] = b64_alphabet[v >> 18];
    out[1] = b64_alphabet[(v >> 12) & 63];
    out[2] = b64_alphabet[(v >> 6) & 63];
    out[3] = '=';
  }
}

/* The decoded length of in, or -1 if it cannot be base64: the standard
 * alphabet only, '=' padding only at the very end, no whitespace, no
 * length of 4n+1. (Characters are checked while decoding.) */
long long mb_b64_decoded_len(const unsigned char *in, size_t len) {
  size_t pad = 0;
  if (len > 0 && in[len - 1] == '=') pad++;
  if (len > 1 && in[len - 2] == '=') pad++;
  if (pad && len % 4 != 0) return -1;
  size_t data_len = len - pad, tail = data_len % 4;
  if (tail == 1) return -1;
  return (long long)(data_len / 4 * 3 + (tail ? tail - 1 : 0));
}

/* Decode into out (mb_b64_decoded_len bytes); 0, or -1 for a bad character. */
int mb_b64_decode(const unsigned char *in, size_t len, unsigned char *out) {
  init_tables();
  size_t pad = 0;
  if (len > 0 && in[len - 1] == '=') pad++;
  if (len > 1 && in[len - 2] == '=') pad++;
  size_t data_len = len - pad, tail = data_len % 4, full = data_len - tail;
  uint32_t bad = 0;
  for (size_t i = 0; i < full; i += 4) {
    uint32_t v = dec[0][in[i]] | dec[1][in[i + 1]] | dec[2][in[i + 2]] | dec[3][in[i + 3]];
    bad |= v;
    out[0] = (unsigned char)(v >> 16);
    out[1] = (unsigned char)(v >> 8);
    out[2] = (unsigned char)v;
    out += 3;
  }
  if (tail) {
    const unsigned char *t = in + full;
    uint32_t v = dec[0][t[0]] | dec[1][t[1]] | (tail == 3 ? dec[2][t[2]] : 0);
    bad |= v;
    out[0] = (unsigned char)(v >> 16);
    if (tail == 3) out[1] = (unsigned char)(v >> 8);
  }
  return (bad & B64_BAD) ? -1 : 0;
}

/* ---- UTF-8 ------------------------------------------------------------------ */

/* Length of the valid UTF-8 sequence at p (n bytes left), or 0: no
 * overlongs, no surrogates, nothing above U+10FFFF. */
static size_t utf8_seq(const unsigned char *p, size_t n) {
  unsigned char c = p[0];
  if (c < 0x80) return 1;
  if (c < 0xC2) return 0;
  if (c < 0xE0) return (n >= 2 && (p[1] & 0xC0) == 0x80) ? 2 : 0;
  if (c < 0xF0) {
    if (n < 3 || (p[1] & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80) return 0;
    if (c == 0xE0 && p[1] < 0xA0) return 0;  /* overlong */
    if (c == 0xED && p[1] >= 0xA0) return 0; /* surrogate */
    return 3;
  }
  if (c < 0xF5) {
    if (n < 4 || (p[1] & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80 || (p[3] & 0xC0) != 0x80) return 0;
    if (c == 0xF0 && p[1] < 0x90) return 0;  /* overlong */
    if (c == 0xF4 && p[1] >= 0x90) return 0; /* above U+10FFFF */
    return 4;
  }
  return 0;
}

/* One pass over s: valid UTF-8?, any NUL byte?, any control byte other than
 * \b \t \n \v \f \r and ESC? (what tells text from binary; core.text_info
 * returns the answers). The scan stops at an invalid sequence, so nul and
 * control then only describe what came before it. */
#define ONES 0x0101010101010101ull
#define HIGHS 0x8080808080808080ull
#define HAS_LESS(x, n) (((x)-ONES * (n)) & ~(x)&HIGHS)

static int is_odd_control(unsigned char c) { return (c < 0x20 && !(c >= 0x08 && c <= 0x0D) && c != 0x1B) || c == 0x7F; }

#ifdef __SSE2__
#include <emmintrin.h>
/* ASCII in blocks of 16 bytes, NULs and odd controls collected without a
 * branch per block (readFile of 100 MB of 88-byte lines: text_info 42 ->
 * 16-25 ms); stops at the first block that holds a byte >= 0x80. Signed
 * compares are right for ASCII bytes. */
static size_t ascii_blocks(const unsigned char *s, size_t i, size_t len, int *nul, int *control) {
  const __m128i zero = _mm_setzero_si128(), space = _mm_set1_epi8(0x20), bs_minus1 = _mm_set1_epi8(0x07),
                cr_plus1 = _mm_set1_epi8(0x0E), esc = _mm_set1_epi8(0x1B), del = _mm_set1_epi8(0x7F);
  __m128i nuls = zero, odd = zero;
  while (i + 16 <= len) {
    __m128i v = _mm_loadu_si128((const __m128i *)(s + i));
    if (_mm_movemask_epi8(v)) break;
    __m128i is_nul = _mm_cmpeq_epi8(v, zero);
    __m128i allowed = _mm_or_si128(_mm_and_si128(_mm_cmpgt_epi8(v, bs_minus1), _mm_cmplt_epi8(v, cr_plus1)),
                                   _mm_or_si128(_mm_cmpeq_epi8(v, esc), is_nul));
    odd = _mm_or_si128(odd, _mm_or_si128(_mm_andnot_si128(allowed, _mm_cmplt_epi8(v, space)), _mm_cmpeq_epi8(v, del)));
    nuls = _mm_or_si128(nuls, is_nul);
    i += 16;
  }
  if (_mm_movemask_epi8(nuls)) *nul = 1;
  if (_mm_movemask_epi8(odd)) *control = 1;
  return i;
}
#endif

/* The scan behind text_info: *bad is the 1-based position of the first
 * invalid sequence, 0 when there is none. Touches no Lua state (it also
 * runs on the thread pool). */
void mb_text_info_scan(const unsigned char *s, size_t len, int *nul_out, int *control_out, size_t *bad_out) {
  size_t i = 0, bad = 0;
  int nul = 0, control = 0;
  while (i < len) {
#ifdef __SSE2__
    i = ascii_blocks(s, i, len, &nul, &control);
#endif
    /* ASCII, eight bytes at a time; a word holding a control byte (a
     * newline, mostly) is classified in place, not left to the byte loop,
     * which would then re-test the same word at every byte before it */
    while (i + 8 <= len) {
      uint64_t w;
      memcpy(&w, s + i, 8);
      if (w & HIGHS) break;
      if (HAS_LESS(w, 0x20) || HAS_LESS(w ^ (ONES * 0x7F), 1)) {
        for (size_t k = i; k < i + 8; k++) {
          if (s[k] == 0) nul = 1;
          else if (is_odd_control(s[k])) control = 1;
        }
      }
      i += 8;
    }
    if (i >= len) break;
    unsigned char c = s[i];
    if (c < 0x80) {
      if (c == 0) nul = 1;
      else if (is_odd_control(c)) control = 1;
      i++;
      continue;
    }
    size_t n = utf8_seq(s + i, len - i);
    if (n == 0) { /* not text: the rest does not matter */
      bad = i + 1;
      break;
    }
    i += n;
  }
  *nul_out = nul;
  *control_out = control;
  *bad_out = bad;
}

/* The scan behind utf8_valid. */
size_t mb_utf8_first_bad(const unsigned char *s, size_t len) {
  size_t i = 0;
  while (i < len) {
    while (i + 8 <= len) { /* ASCII runs, eight bytes at a time */
      uint64_t w;
      memcpy(&w, s + i, 8);
      if (w & HIGHS) break;
      i += 8;
    }
    if (i >= len) break;
    size_t n = utf8_seq(s + i, len - i);
    if (n == 0) return i + 1;
    i += n;
  }
  return 0;
}
