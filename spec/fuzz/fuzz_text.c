/* libFuzzer target: the UTF-8 and text scans in src/codec_pure.c
 * (core.utf8_valid, core.text_info and their bytes: forms), which decide
 * whether a file's content goes into the server's JSON as a string or as
 * base64. moonbox has no JSON codec of its own: the server and the Lua
 * kernel encode and parse JSON with lua-cjson (Debian's), so this is the
 * JSON-facing text code src/codec.c has.
 *
 * Property: the fast scans (16-byte SSE2 blocks, 8-byte words, then bytes)
 * agree, for every input, with a byte-at-a-time reference that decodes each
 * code point and checks it against the Unicode definition of well-formed
 * UTF-8 (shortest form, no surrogates, at most U+10FFFF); and they never
 * read past the input (libFuzzer's buffer is exactly its size; ASan). */
#include "codec_pure.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(cond)                                                                                                    \
  do {                                                                                                                 \
    if (!(cond)) {                                                                                                     \
      fprintf(stderr, "fuzz_text: %s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);                              \
      abort();                                                                                                         \
    }                                                                                                                  \
  } while (0)

/* Length of the well-formed sequence at s[i], or 0. */
static size_t ref_seq(const unsigned char *s, size_t len, size_t i) {
  unsigned char c = s[i];
  size_t n;
  uint32_t cp, min;
  if (c < 0x80) return 1;
  if ((c & 0xE0) == 0xC0) n = 2, cp = c & 0x1F, min = 0x80;
  else if ((c & 0xF0) == 0xE0) n = 3, cp = c & 0x0F, min = 0x800;
  else if ((c & 0xF8) == 0xF0) n = 4, cp = c & 0x07, min = 0x10000;
  else return 0;
  if (len - i < n) return 0;
  for (size_t k = 1; k < n; k++) {
    if ((s[i + k] & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (s[i + k] & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  return n;
}

/* \b \t \n \v \f \r and ESC are text; other bytes below 0x20, and DEL, are not */
static int ref_control(unsigned char c) {
  if (c == 0x7F) return 1;
  if (c == 0 || c >= 0x20) return 0;
  return !(c == '\b' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r' || c == 0x1B);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  int want_nul = 0, want_control = 0;
  size_t want_bad = 0;
  for (size_t i = 0; i < size;) {
    size_t n = ref_seq(data, size, i);
    if (!n) {
      want_bad = i + 1;
      break;
    }
    if (data[i] == 0) want_nul = 1;
    if (ref_control(data[i])) want_control = 1;
    i += n;
  }
  int nul = -1, control = -1;
  size_t bad = (size_t)-1;
  mb_text_info_scan(data, size, &nul, &control, &bad);
  CHECK(bad == want_bad);
  CHECK(nul == want_nul);
  CHECK(control == want_control);
  CHECK(mb_utf8_first_bad(data, size) == want_bad);
  return 0;
}
