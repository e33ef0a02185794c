/* The pure half of the codec family (src/codec_pure.c): base64 and the
 * UTF-8 / text scans on plain byte ranges. No Lua, no libuv, no allocation:
 * src/codec.c binds them to Lua (and runs them on the thread pool), and the
 * fuzz targets (spec/fuzz/fuzz_base64.c, spec/fuzz/fuzz_text.c) link this
 * file alone. Safe to call from any thread. */
#ifndef MOONBOX_CODEC_PURE_H
#define MOONBOX_CODEC_PURE_H

#include <stddef.h>

/* ---- base64: the standard alphabet, '=' padding ----------------------------- */

/* Length of the encoding of len bytes (padded: a multiple of 4). */
size_t mb_b64_encoded_len(size_t len);
/* Writes exactly mb_b64_encoded_len(len) characters to out (no NUL). */
void mb_b64_encode(const unsigned char *in, size_t len, char *out);
/* The decoded length of in, or -1 if it cannot be base64: '=' padding only
 * at the very end (and then a length of 4n), no whitespace, no length of
 * 4n+1. Characters are checked by mb_b64_decode. */
long long mb_b64_decoded_len(const unsigned char *in, size_t len);
/* Decodes in into out (mb_b64_decoded_len bytes, which must be >= 0);
 * 0, or -1 for a character outside the alphabet (out is then garbage). */
int mb_b64_decode(const unsigned char *in, size_t len, unsigned char *out);

/* ---- UTF-8 and text ---------------------------------------------------------- */

/* The 1-based position of the first invalid UTF-8 sequence of s, or 0 if
 * s is valid (no overlongs, no surrogates, nothing above U+10FFFF). */
size_t mb_utf8_first_bad(const unsigned char *s, size_t len);
/* One pass: any NUL byte? any control byte other than \b \t \n \v \f \r
 * ESC (and DEL counts as one)? and *bad as mb_utf8_first_bad. The scan
 * stops at the first invalid sequence: *nul and *control then describe
 * only what came before it. */
void mb_text_info_scan(const unsigned char *s, size_t len, int *nul, int *control, size_t *bad);

#endif
