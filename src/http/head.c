/* The request stream of one connection, cut into heads and bodies: a pure
 * parser (no Lua, no libuv; src/http/proto.h), the only one the server has.
 * A head is read whole (at most MBH_HEAD_MAX bytes) before a byte of it is
 * believed, then checked line by line; what could smuggle a request past
 * a proxy in front (a repeated or listed Content-Length, Transfer-Encoding
 * with Content-Length, obsolete line folding, a blank before a colon, a
 * repeated Host) is an error, never a guess. Bodies are framed by
 * Content-Length only: a chunked body is not decoded (the server answers
 * 411), so there is one framing rule to get right. Empty lines before a
 * request line are skipped (RFC 9112 2.2). */
#include "http/proto.h"

#include <stdlib.h>
#include <string.h>

enum { P_START, P_HEAD, P_BODY, P_DONE, P_STOPPED, P_FAILED };

void mbh_parser_init(mbh_parser *p) {
  memset(p, 0, sizeof *p);
  p->state = P_START;
}

void mbh_parser_free(mbh_parser *p) {
  free(p->buf);
  mbh_parser_init(p);
}

void mbh_parser_next(mbh_parser *p) { mbh_parser_free(p); }

static int lower(int c) { return c >= 'A' && c <= 'Z' ? c + 32 : c; }

static int ieq(const char *a, size_t alen, const char *lname) {
  size_t n = strlen(lname);
  if (alen != n) return 0;
  for (size_t i = 0; i < n; i++)
    if (lower((unsigned char)a[i]) != lname[i]) return 0;
  return 1;
}

/* RFC 9110 5.6.2 tchar */
static int is_tchar(unsigned char c) {
  if ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return 1;
  return c && strchr("!#$%&'*+-.^_`|~", c) != NULL;
}

/* Whether the comma-separated list v holds token (lowercase). */
static int has_token(const char *v, size_t len, const char *token) {
  size_t i = 0;
  while (i < len) {
    size_t s = i;
    while (i < len && v[i] != ',') i++;
    size_t e = i++;
    while (s < e && (v[s] == ' ' || v[s] == '\t')) s++;
    while (e > s && (v[e - 1] == ' ' || v[e - 1] == '\t')) e--;
    if (ieq(v + s, e - s, token)) return 1;
  }
  return 0;
}

static int fail(mbh_parser *p, mbh_event *ev, int status, const char *why) {
  p->state = P_FAILED;
  ev->kind = MBH_ERROR;
  ev->status = status;
  ev->why = why;
  return -1;
}

/* The request line: METHOD SP target SP HTTP/1.x */
static const char *parse_request_line(mbh_head *h, const char *s, size_t len) {
  size_t i = 0;
  while (i < len && s[i] >= 'A' && s[i] <= 'Z') i++;
  if (i == 0 || i > 20 || i >= len || s[i] != ' ') return "a malformed request line";
  h->method = s;
  h->method_len = i;
  size_t t = ++i;
  while (i < len && (unsigned char)s[i] > ' ' && s[i] != 0x7f) i++;
  if (i == t || i >= len || s[i] != ' ') return "a malformed request line";
  h->target = s + t;
  h->target_len = i - t;
  i++;
  if (len - i != 8 || memcmp(s + i, "HTTP/1.", 7) != 0 || (s[i + 7] != '0' && s[i + 7] != '1'))
    return "an unsupported HTTP version (HTTP/1.0 and HTTP/1.1 are served)";
  h->minor = s[i + 7] - '0';
  return NULL;
}

/* The head in p->buf[0, p->len), which ends with its blank line. Returns
 * NULL, or why it is refused (*status 400 or 431). */
static const char *parse_head(mbh_parser *p, int *status) {
  mbh_head *h = &p->head;
  const char *buf = p->buf, *end = buf + p->len;
  int conn_close = 0, conn_keep = 0, conn_upgrade = 0, upgrade_ws = 0, hosts = 0;
  *status = 400;
  for (const char *at = buf; at < end;) {
    const char *nl = memchr(at, '\n', (size_t)(end - at));
    if (!nl) return "a head without its end"; /* (cannot happen: it ends with LF) */
    size_t len = (size_t)(nl - at);
    if (len && at[len - 1] == '\r') len--;
    const char *line = at;
    at = nl + 1;
    if (memchr(line, '\r', len)) return "a CR inside a line";
    if (!h->line) {
      h->line = line;
      h->line_len = len;
      const char *why = parse_request_line(h, line, len);
      if (why) return why;
      continue;
    }
    if (len == 0) break; /* the blank line */
    if (line[0] == ' ' || line[0] == '\t') return "obsolete line folding (a header line starting with a space or tab)";
    const char *colon = memchr(line, ':', len);
    if (!colon) return "a header line without a colon";
    size_t nlen = (size_t)(colon - line);
    if (nlen == 0) return "an empty header name";
    if (line[nlen - 1] == ' ' || line[nlen - 1] == '\t') return "a blank between a header name and its colon";
    for (size_t i = 0; i < nlen; i++)
      if (!is_tchar((unsigned char)line[i])) return "an invalid header name";
    const char *v = colon + 1, *ve = line + len;
    while (v < ve && (*v == ' ' || *v == '\t')) v++;
    while (ve > v && (ve[-1] == ' ' || ve[-1] == '\t')) ve--;
    size_t vlen = (size_t)(ve - v);
    for (size_t i = 0; i < vlen; i++) {
      unsigned char c = (unsigned char)v[i];
      if ((c < 0x20 && c != '\t') || c == 0x7f) return "a control character in a header value";
    }
    if (h->nfields == MBH_MAX_FIELDS) {
      *status = 431;
      return "more than 100 header fields";
    }
    h->fields[h->nfields++] = (mbh_field){line, v, nlen, vlen};
    if (ieq(line, nlen, "content-length")) {
      if (h->has_length) return "repeated Content-Length headers";
      h->has_length = 1;
      if (vlen == 0 || vlen > 18) return "an invalid Content-Length";
      uint64_t n = 0;
      for (size_t i = 0; i < vlen; i++) {
        if (v[i] < '0' || v[i] > '9') return "an invalid Content-Length";
        n = n * 10 + (uint64_t)(v[i] - '0');
      }
      h->content_length = n;
    } else if (ieq(line, nlen, "transfer-encoding")) {
      h->has_te = 1;
    } else if (ieq(line, nlen, "host")) {
      if (hosts++) return "repeated Host headers";
    } else if (ieq(line, nlen, "connection")) {
      conn_close |= has_token(v, vlen, "close");
      conn_keep |= has_token(v, vlen, "keep-alive");
      conn_upgrade |= has_token(v, vlen, "upgrade");
    } else if (ieq(line, nlen, "upgrade")) {
      upgrade_ws |= has_token(v, vlen, "websocket");
    } else if (ieq(line, nlen, "expect")) {
      h->expect_continue = ieq(v, vlen, "100-continue");
    } else if (ieq(line, nlen, "sec-websocket-key")) {
      if (!h->ws_key) {
        h->ws_key = v;
        h->ws_key_len = vlen;
      }
    } else if (ieq(line, nlen, "sec-websocket-version")) {
      h->ws_version_ok = vlen == 2 && v[0] == '1' && v[1] == '3';
    } else if (ieq(line, nlen, "sec-websocket-protocol")) {
      h->ws_protocol = 1;
    }
  }
  if (h->has_te && h->has_length) return "Transfer-Encoding together with Content-Length";
  h->keep_alive = h->minor >= 1 ? !conn_close : conn_keep && !conn_close;
  h->websocket = upgrade_ws && conn_upgrade;
  if (h->websocket && (h->has_te || h->content_length)) return "a WebSocket upgrade with a body";
  return NULL;
}

long mbh_parse(mbh_parser *p, const char *data, size_t len, mbh_event *ev) {
  memset(ev, 0, sizeof *ev);
  size_t used = 0;
  switch (p->state) {
  case P_DONE:
  case P_STOPPED:
  case P_FAILED: ev->kind = MBH_STOPPED; return 0;
  case P_BODY: {
    if (len == 0) {
      ev->kind = MBH_NEED_MORE;
      return 0;
    }
    size_t take = p->body_left < len ? (size_t)p->body_left : len;
    p->body_left -= take;
    ev->kind = MBH_BODY;
    ev->head = &p->head;
    ev->data = data;
    ev->len = take;
    if (!p->body_left) {
      ev->end = 1;
      p->state = P_DONE;
    }
    return (long)take;
  }
  case P_START:
    while (used < len && (data[used] == '\r' || data[used] == '\n')) used++;
    if (used == len) {
      ev->kind = MBH_NEED_MORE;
      return (long)used;
    }
    if (!p->buf && !(p->buf = malloc(MBH_HEAD_MAX))) return -1;
    p->len = p->scan = p->line_start = 0;
    memset(&p->head, 0, sizeof p->head);
    p->state = P_HEAD;
    /* fall through */
  case P_HEAD: break;
  default: ev->kind = MBH_STOPPED; return 0;
  }
  size_t n = len - used, room = MBH_HEAD_MAX - p->len;
  size_t take = n < room ? n : room, before = p->len;
  memcpy(p->buf + p->len, data + used, take);
  p->len += take;
  size_t k = p->scan, head_end = 0;
  for (; k < p->len; k++) {
    if (p->buf[k] != '\n') continue;
    size_t content = k - p->line_start;
    if (content && p->buf[k - 1] == '\r') content--;
    if (content == 0 && p->line_start > 0) {
      head_end = k + 1;
      break;
    }
    p->line_start = k + 1;
  }
  p->scan = k;
  if (!head_end) {
    if (p->len == MBH_HEAD_MAX) {
      fail(p, ev, 431, "the request head is larger than 8192 bytes");
      return (long)(used + take);
    }
    ev->kind = MBH_NEED_MORE;
    return (long)(used + take);
  }
  used += head_end - before; /* what follows the head is not ours yet */
  p->len = head_end;
  int status;
  const char *why = parse_head(p, &status);
  if (why) {
    fail(p, ev, status, why);
    return (long)used;
  }
  ev->kind = MBH_HEAD;
  ev->head = &p->head;
  if (p->head.websocket || p->head.has_te) {
    p->state = P_STOPPED;
  } else if (p->head.content_length) {
    p->state = P_BODY;
    p->body_left = p->head.content_length;
  } else {
    p->state = P_DONE;
    ev->end = 1;
  }
  return (long)used;
}

const char *mbh_head_get(const mbh_head *h, const char *lname, size_t *len) {
  for (size_t i = 0; i < h->nfields; i++)
    if (ieq(h->fields[i].name, h->fields[i].name_len, lname)) {
      *len = h->fields[i].value_len;
      return h->fields[i].value;
    }
  return NULL;
}

static int hexval(int c) {
  if (c >= '0' && c <= '9') return c - '0';
  c = lower(c);
  return c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

/* Percent-decode s[0, len) into out; '+' becomes a space if plus. */
static size_t decode(const char *s, size_t len, char *out, int plus) {
  size_t w = 0;
  for (size_t i = 0; i < len; i++) {
    int hi, lo;
    if (s[i] == '%' && i + 2 < len && (hi = hexval((unsigned char)s[i + 1])) >= 0 &&
        (lo = hexval((unsigned char)s[i + 2])) >= 0) {
      out[w++] = (char)(hi * 16 + lo);
      i += 2;
    } else {
      out[w++] = plus && s[i] == '+' ? ' ' : s[i];
    }
  }
  return w;
}

size_t mbh_decode_path(const char *target, size_t len, char *out) {
  size_t end = 0;
  while (end < len && target[end] != '?' && target[end] != '#') end++;
  /* decoded at out + 1, then the segments written from out on: the
   * writer never passes the reader (each segment it writes is preceded by
   * one '/', each it reads by at least one, or by the slot at out[0]) */
  size_t dlen = decode(target, end, out + 1, 0);
  const char *d = out + 1;
  size_t w = 0;
  for (size_t r = 0; r < dlen;) {
    while (r < dlen && d[r] == '/') r++;
    size_t s = r;
    while (r < dlen && d[r] != '/') r++;
    size_t seg = r - s;
    if (seg == 0 || (seg == 1 && d[s] == '.')) continue;
    if (seg == 2 && d[s] == '.' && d[s + 1] == '.') {
      while (w > 0 && out[--w] != '/') {}
      continue;
    }
    out[w++] = '/';
    memmove(out + w, d + s, seg);
    w += seg;
  }
  if (w == 0) out[w++] = '/';
  else if (dlen && d[dlen - 1] == '/') out[w++] = '/';
  return w;
}

long mbh_next_arg(const char *target, size_t len, size_t *pos, char *out) {
  size_t end = 0, q;
  while (end < len && target[end] != '#') end++;
  if (*pos == 0) {
    const char *qm = memchr(target, '?', end);
    if (!qm) return -1;
    q = (size_t)(qm - target) + 1;
  } else {
    q = *pos;
  }
  while (q < end) {
    const char *amp = memchr(target + q, '&', end - q);
    size_t e = amp ? (size_t)(amp - target) : end;
    size_t s = q;
    q = e + 1;
    *pos = q;
    if (e > s) return (long)decode(target + s, e - s, out, 1);
  }
  *pos = end + 1;
  return -1;
}
