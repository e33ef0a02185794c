// moonbox code-interpreter kernel protocol (shared by the python, node and lua kernels):
//   stdin: one JSON request per line: {"id": n, "code": "<source>"}
//   fd 3:  one JSON message per line, flushed at once: {"type":"ready","language","version"} at start; per request
//          0+ {"id","type":"result","data":{"text","json"?,"html"?,"png"?,...}} / {"id","type":"error","error":
//          {"name","message","traceback"}}, then one {"id","type":"done","executionCount"}. fd 1/2: raw user output
//   fd 1/2: the user code's own stdout/stderr, raw (not JSON); flushed before each result and before "done"
'use strict';

// JavaScript kernel for moonbox code-interpreter contexts (node >= 18, no npm dependencies).
// User code runs in one persistent vm context. Top-level let/const/class declarations are rewritten
// into assignments on the context's global object so they survive between runs and can be re-run;
// code using top-level await (or static `import`) is wrapped in an async function whose final
// expression statement is returned. See docs/code-interpreter.md for the limits of that rewrite.

const fs = require('fs');
const net = require('net');
const path = require('path');
const util = require('util');
const vm = require('vm');
const { Writable, Readable } = require('stream');
const { Console } = require('console');
const { createRequire, builtinModules } = require('module');
const { pathToFileURL } = require('url');

const KERNEL_FILE = __filename;
const MSG_FD = 3;
const sleepCell = new Int32Array(new SharedArrayBuffer(4));

// ------------------------------------------------------------------ output

function writeAll(fd, data) {
  const buf = typeof data === 'string' ? Buffer.from(data, 'utf8') : data;
  let off = 0;
  while (off < buf.length) {
    try {
      off += fs.writeSync(fd, buf, off, buf.length - off);
    } catch (e) {
      if (e.code === 'EAGAIN') { Atomics.wait(sleepCell, 0, 0, 1); continue; }
      throw e;
    }
  }
}

function send(msg) {
  try {
    writeAll(MSG_FD, JSON.stringify(msg) + '\n');
  } catch (e) {
    if (e.code === 'EBADF') { writeAll(2, 'node_kernel: fd 3 (protocol channel) is not open\n'); process.exit(2); }
    process.exit(0); // EPIPE: the runtime went away
  }
}

// process.stdout/stderr would switch fds 1/2 to O_NONBLOCK and queue writes asynchronously once a pipe
// is full; replace them (before anything touches them) by writables that write synchronously.
function syncWritable(fd) {
  const w = new Writable({
    decodeStrings: false,
    write(chunk, encoding, cb) {
      try { writeAll(fd, typeof chunk === 'string' ? Buffer.from(chunk, encoding) : chunk); } catch (_) { /* closed */ }
      cb();
    },
  });
  w.fd = fd;
  w.isTTY = false;
  w._type = 'pipe';
  w._isStdio = true;
  w.destroySoon = w.destroy;
  w._destroy = (err, cb) => cb(err);
  return w;
}
const userStdout = syncWritable(1);
const userStderr = syncWritable(2);

// Requests are read from a private close-on-exec re-open of fd 0, and fd 0 becomes /dev/null, so that
// user code and the processes it spawns with inherited stdio cannot consume requests. Where that is not
// possible (no /proc, stdin not a pipe), fd 0 itself is used.
function openRequestStream() {
  let fd = -1;
  try {
    fd = fs.openSync('/proc/self/fd/0', fs.constants.O_RDONLY | fs.constants.O_NONBLOCK);
    const s = new net.Socket({ fd, readable: true, writable: false });
    fs.closeSync(0);
    const nul = fs.openSync('/dev/null', 'r'); // lowest free fd: 0
    if (nul !== 0) fs.closeSync(nul);
    return s;
  } catch (_) {
    if (fd >= 0) { try { fs.closeSync(fd); } catch (_e) { /* ignore */ } }
    return process.stdin;
  }
}
const realStdin = openRequestStream(); // user code sees an empty process.stdin instead
const emptyStdin = new Readable({ read() { this.push(null); } });
emptyStdin.fd = 0;
emptyStdin.isTTY = false;
for (const [name, value] of [['stdout', userStdout], ['stderr', userStderr], ['stdin', emptyStdin]]) {
  Object.defineProperty(process, name, { configurable: true, enumerable: false, get: () => value });
}
const userConsole = new Console({ stdout: userStdout, stderr: userStderr, colorMode: false });
try { Object.defineProperty(globalThis, 'console', { configurable: true, writable: true, value: userConsole }); } catch (_) { /* keep */ }

// ------------------------------------------------------------------ results

let currentId = null;
let executionCount = 0;
let lastValue; // what `_` was last set to by the kernel

function isPlainObject(v) {
  if (v === null || typeof v !== 'object') return false;
  const proto = Object.getPrototypeOf(v);
  if (proto === null) return true;
  return Object.getPrototypeOf(proto) === null && typeof proto.constructor === 'function' && proto.constructor.name === 'Object';
}

function formatValue(v) {
  const data = { text: util.inspect(v, { depth: 4, colors: false, maxArrayLength: 200, breakLength: 80 }) };
  if (Array.isArray(v) || isPlainObject(v)) {
    try {
      const j = JSON.stringify(v);
      if (j !== undefined) data.json = JSON.parse(j);
    } catch (_) { /* circular, BigInt, throwing toJSON: no json */ }
  }
  return data;
}

function emitResult(data) {
  if (typeof data.text !== 'string') {
    data.text = '[' + Object.keys(data).filter((k) => k !== 'text').join(', ') + ']';
  }
  send({ id: currentId, type: 'result', data });
}

function toBase64(x) {
  if (typeof x === 'string') return x.replace(/\s+/g, '');
  return Buffer.from(x.buffer ? new Uint8Array(x.buffer, x.byteOffset, x.byteLength) : x).toString('base64');
}

// display(v, ...): show values as results now (like a final expression); display.html(s) etc. for rich output.
function display(...values) {
  for (const v of values) emitResult(formatValue(v));
}
display.html = (s) => emitResult({ html: String(s) });
display.markdown = (s) => emitResult({ text: String(s), markdown: String(s) });
display.latex = (s) => emitResult({ text: String(s), latex: String(s) });
display.svg = (s) => emitResult({ svg: String(s) });
display.png = (b) => emitResult({ png: toBase64(b) });
display.jpeg = (b) => emitResult({ jpeg: toBase64(b) });
display.json = (v) => emitResult({ text: util.inspect(v, { depth: 4 }), json: JSON.parse(JSON.stringify(v)) });
display.raw = (data) => emitResult(Object.assign({}, data));

// ------------------------------------------------------------------ context

const cwd = process.cwd();
const userRequire = createRequire(path.join(cwd, '[moonbox]'));
const builtinSet = new Set(builtinModules);

function findPackageDir(name) {
  for (let dir = cwd; ; dir = path.dirname(dir)) {
    const cand = path.join(dir, 'node_modules', name);
    if (fs.existsSync(path.join(cand, 'package.json'))) return cand;
    if (path.dirname(dir) === dir) return null;
  }
}

function pickExport(target) {
  if (typeof target === 'string') return target;
  if (Array.isArray(target)) {
    for (const t of target) { const r = pickExport(t); if (r) return r; }
    return null;
  }
  if (target && typeof target === 'object') { // conditions match in the object's key order, as node does
    for (const [cond, sub] of Object.entries(target)) {
      if (cond === 'node' || cond === 'import' || cond === 'default') { const r = pickExport(sub); if (r) return r; }
    }
  }
  return null;
}

// ESM-aware resolution of a bare specifier from cwd (for packages that only export an "import" condition).
function resolveEsm(spec) {
  const parts = spec.split('/');
  const name = spec.startsWith('@') ? parts.slice(0, 2).join('/') : parts[0];
  const sub = '.' + spec.slice(name.length);
  const dir = findPackageDir(name);
  if (!dir) return null;
  const pkg = JSON.parse(fs.readFileSync(path.join(dir, 'package.json'), 'utf8'));
  let rel = null;
  if (pkg.exports !== undefined) {
    const ex = pkg.exports;
    const isMap = ex && typeof ex === 'object' && !Array.isArray(ex) && Object.keys(ex).some((k) => k.startsWith('.'));
    rel = pickExport(isMap ? ex[sub] : (sub === '.' ? ex : undefined));
  } else if (sub === '.') {
    rel = pkg.module || pkg.main || 'index.js';
  } else {
    rel = sub;
  }
  return rel ? path.resolve(dir, rel) : null;
}

// import() for user code, resolving relative paths and bare package names against the kernel's cwd.
function moonboxImport(spec, options) {
  spec = String(spec);
  let target = spec;
  if (spec.startsWith('./') || spec.startsWith('../') || spec.startsWith('/') || spec === '.' || spec === '..') {
    target = pathToFileURL(path.resolve(cwd, spec)).href;
  } else if (!/^[a-z][a-z0-9+.-]*:/i.test(spec) && !builtinSet.has(spec)) {
    let file = null;
    try { file = resolveEsm(spec); } catch (_) { file = null; }
    if (!file || !fs.existsSync(file)) {
      try { file = userRequire.resolve(spec); } catch (_) { file = null; }
    }
    if (file) target = pathToFileURL(file).href;
  }
  return options === undefined ? import(target) : import(target, options);
}

const sandbox = {};
const context = vm.createContext(sandbox, { name: 'moonbox' });
const ownInContext = new Set(vm.runInContext('Object.getOwnPropertyNames(globalThis)', context));
for (const name of Object.getOwnPropertyNames(globalThis)) {
  if (ownInContext.has(name) || name === 'global' || name === 'globalThis') continue;
  const desc = Object.getOwnPropertyDescriptor(globalThis, name);
  try { Object.defineProperty(sandbox, name, desc); } catch (_) { /* skip */ }
}
Object.assign(sandbox, {
  console: userConsole,
  process,
  require: userRequire,
  module: { exports: {}, require: userRequire, id: '[moonbox]', filename: path.join(cwd, '[moonbox]') },
  __dirname: cwd,
  __filename: path.join(cwd, '[moonbox]'),
  display,
  __moonbox_import: moonboxImport,
});
sandbox.exports = sandbox.module.exports;
vm.runInContext('globalThis.global = globalThis;', context);

// ------------------------------------------------------------------ tokenizer

const RE_PUNCT = />>>=|\.\.\.|===|!==|\*\*=|<<=|>>=|>>>|&&=|\|\|=|\?\?=|=>|==|!=|<=|>=|&&|\|\||\?\?|\?\.(?![0-9])|\+\+|--|\+=|-=|\*=|\/=|%=|&=|\|=|\^=|\*\*|<<|>>|[^]/y;
const RE_IDENT = /(?:[A-Za-z_$\u0080-\uffff]|#(?=[A-Za-z_$\u0080-\uffff\\])|\\u[0-9a-fA-F]{4}|\\u\{[0-9a-fA-F]+\})(?:[A-Za-z0-9_$\u0080-\uffff]|\\u[0-9a-fA-F]{4}|\\u\{[0-9a-fA-F]+\})*/y;
const RE_NUMBER = /(?:0[xXoObB][0-9a-fA-F_]+|(?:[0-9][0-9_]*\.?[0-9_]*|\.[0-9][0-9_]*)(?:[eE][+-]?[0-9_]+)?)n?/y;
const KEYWORDS_BEFORE_EXPR = new Set(['return', 'typeof', 'instanceof', 'in', 'of', 'new', 'delete', 'void', 'throw',
  'case', 'do', 'else', 'yield', 'await', 'extends']);

function regexAllowed(prev) {
  if (!prev) return true;
  switch (prev.type) {
    case 'num': case 'str': case 'regex': return false;
    case 'tmpl': return !prev.tail;
    case 'ident': return KEYWORDS_BEFORE_EXPR.has(prev.value);
    default: return !(prev.value === ')' || prev.value === ']' || prev.value === '++' || prev.value === '--');
  }
}

// Tokens: {type: ident|num|str|tmpl|regex|punct, value, start, end, depth, nl (newline before it)}.
// depth counts enclosing (), [], {} and template ${}: openers and closers carry their outer depth.
function tokenize(src) {
  const toks = [];
  const stack = [];
  const n = src.length;
  let i = 0;
  let nl = false;
  let prev = null;
  const push = (type, value, start, end, depth, extra) => {
    const t = { type, value, start, end, depth, nl };
    if (extra) Object.assign(t, extra);
    toks.push(t);
    prev = t;
    nl = false;
    return t;
  };
  const scanTemplate = (from, startTok) => { // from: index after ` or }
    let j = from;
    while (j < n) {
      const ch = src[j];
      if (ch === '\\') { j += 2; continue; }
      if (ch === '`') { push('tmpl', null, startTok, j + 1, stack.length, { tail: true }); return j + 1; }
      if (ch === '$' && src[j + 1] === '{') {
        push('tmpl', null, startTok, j + 2, stack.length, { tail: false });
        stack.push('${');
        return j + 2;
      }
      j++;
    }
    push('tmpl', null, startTok, n, stack.length, { tail: true });
    return n;
  };
  if (src.startsWith('#!')) { const j = src.indexOf('\n'); i = j < 0 ? n : j; }
  while (i < n) {
    const ch = src[i];
    const c = src.charCodeAt(i);
    if (ch === '\n' || ch === '\r' || c === 0x2028 || c === 0x2029) { nl = true; i++; continue; }
    if (ch === ' ' || ch === '\t' || c === 11 || c === 12 || c === 0xa0 || c === 0xfeff || (c > 0x7f && /\s/.test(ch))) { i++; continue; }
    if (ch === '/') {
      const d = src[i + 1];
      if (d === '/') { const j = src.indexOf('\n', i); i = j < 0 ? n : j; continue; }
      if (d === '*') {
        const j = src.indexOf('*/', i + 2);
        const end = j < 0 ? n : j + 2;
        if (/[\n\r\u2028\u2029]/.test(src.slice(i, end))) nl = true;
        i = end;
        continue;
      }
      if (regexAllowed(prev)) {
        let j = i + 1;
        let inClass = false;
        while (j < n) {
          const e = src[j];
          if (e === '\\') { j += 2; continue; }
          if (e === '\n' || e === '\r') break;
          if (inClass) { if (e === ']') inClass = false; } else if (e === '[') inClass = true; else if (e === '/') { j++; break; }
          j++;
        }
        while (j < n && /[A-Za-z]/.test(src[j])) j++;
        push('regex', src.slice(i, j), i, j, stack.length);
        i = j;
        continue;
      }
    }
    if (ch === '"' || ch === "'") {
      let j = i + 1;
      while (j < n && src[j] !== ch && src[j] !== '\n') j += src[j] === '\\' ? 2 : 1;
      j = Math.min(j + 1, n);
      push('str', src.slice(i, j), i, j, stack.length);
      i = j;
      continue;
    }
    if (ch === '`') { i = scanTemplate(i + 1, i); continue; }
    if (ch === '}' && stack[stack.length - 1] === '${') { stack.pop(); i = scanTemplate(i + 1, i); continue; }
    if ((ch >= '0' && ch <= '9') || (ch === '.' && src[i + 1] >= '0' && src[i + 1] <= '9')) {
      RE_NUMBER.lastIndex = i;
      const m = RE_NUMBER.exec(src);
      const j = m && m[0].length ? i + m[0].length : i + 1;
      push('num', src.slice(i, j), i, j, stack.length);
      i = j;
      continue;
    }
    RE_IDENT.lastIndex = i;
    const idm = (c > 0x7f || ch === '_' || ch === '$' || ch === '#' || ch === '\\' || (c | 32) >= 97 && (c | 32) <= 122) ? RE_IDENT.exec(src) : null;
    if (idm) {
      const j = i + idm[0].length;
      push('ident', idm[0], i, j, stack.length);
      i = j;
      continue;
    }
    RE_PUNCT.lastIndex = i;
    const p = RE_PUNCT.exec(src)[0];
    if (p === '(' || p === '[' || p === '{') {
      push('punct', p, i, i + 1, stack.length);
      stack.push(p);
    } else if (p === ')' || p === ']' || p === '}') {
      if (stack.length && stack[stack.length - 1] !== '${') stack.pop();
      push('punct', p, i, i + 1, stack.length);
    } else {
      push('punct', p, i, i + p.length, stack.length);
    }
    i += p.length;
  }
  return toks;
}

// ------------------------------------------------------------------ rewriting

const CONTINUE_AFTER_IDENT = new Set(['in', 'instanceof', 'typeof', 'new', 'delete', 'void', 'await', 'yield', 'extends', 'of', 'case', 'return', 'throw']);
const CONTINUE_BEFORE = new Set(['.', '?.', ',', '(', '[', '=', '?', ':', '=>', '+', '-', '*', '/', '%', '**', '==', '===', '!=', '!==',
  '<', '>', '<=', '>=', '&&', '||', '??', '&', '|', '^', '<<', '>>', '>>>', '+=', '-=', '*=', '/=', '%=', '**=', '<<=', '>>=',
  '>>>=', '&=', '|=', '^=', '&&=', '||=', '??=']);

// May a statement end between tokens a and b, given a line break between them? (approximate ASI)
function canEndBetween(a, b) {
  if (!a || !b) return true;
  if (a.type === 'punct' && !(a.value === ')' || a.value === ']' || a.value === '}' || a.value === '++' || a.value === '--')) return false;
  if (a.type === 'ident' && CONTINUE_AFTER_IDENT.has(a.value)) return false;
  if (a.type === 'tmpl' && !a.tail) return false;
  if (b.type === 'punct' && CONTINUE_BEFORE.has(b.value)) return false;
  if (b.type === 'ident' && (b.value === 'in' || b.value === 'instanceof')) return false;
  if (b.type === 'tmpl') return false;
  return true;
}

const isCloser = (t) => t.type === 'punct' && (t.value === ')' || t.value === ']' || t.value === '}');

function isStatementStart(toks, k) {
  const t = toks[k];
  if (t.depth !== 0 || isCloser(t)) return false;
  if (k === 0) return true;
  const p = toks[k - 1];
  if (p.type === 'punct' && (p.value === ';' || p.value === '}')) return true;
  return t.nl && canEndBetween(p, t);
}

// Index of the first token after the statement starting at k (a ';' belongs to the statement).
// For a declaration (decl): before an element's '=' only '=', ',' or ';' may follow a line break.
function statementEnd(toks, k, decl) {
  let inInit = false;
  for (let j = k + 1; j < toks.length; j++) {
    const t = toks[j];
    if (t.depth !== 0) continue;
    if (t.type === 'punct' && t.value === ';') return j + 1;
    if (isCloser(t)) continue; // closes a bracket opened inside this statement
    const prev = toks[j - 1];
    if (decl && j > k + 1 && !inInit && t.nl && !isP(t, '=') && !isP(t, ',') && (prev.type === 'ident' || isCloser(prev))) return j;
    if (t.nl && canEndBetween(prev, t)) return j;
    if (decl && isP(t, '=')) inInit = true;
    if (decl && isP(t, ',')) inInit = false;
  }
  return toks.length;
}

const isP = (t, v) => t && t.type === 'punct' && t.value === v;
const isI = (t, v) => t && t.type === 'ident' && (v === undefined || t.value === v);

function parseImport(src, toks, k) {
  // import 'm' | import D from 'm' | import * as NS from 'm' | import {a, b as c} from 'm' | import D, {..} / * as NS from 'm'
  let j = k + 1;
  let def = null;
  let ns = null;
  let named = null;
  if (toks[j] && toks[j].type !== 'str') {
    if (isI(toks[j]) && !isI(toks[j], 'from')) { def = toks[j].value; j++; if (isP(toks[j], ',')) j++; else if (!isI(toks[j], 'from')) return null; }
    if (isP(toks[j], '*')) {
      if (!isI(toks[j + 1], 'as') || !isI(toks[j + 2])) return null;
      ns = toks[j + 2].value;
      j += 3;
    } else if (isP(toks[j], '{')) {
      const parts = [];
      j++;
      while (toks[j] && !isP(toks[j], '}')) {
        const name = toks[j];
        if (!name || !(name.type === 'ident' || name.type === 'str')) return null;
        let local = name.value;
        j++;
        if (isI(toks[j], 'as')) { local = toks[j + 1] && toks[j + 1].value; j += 2; }
        parts.push(name.value === local ? local : `${name.type === 'str' ? name.value : name.value}: ${local}`);
        if (isP(toks[j], ',')) j++;
      }
      if (!toks[j]) return null;
      named = parts;
      j++;
    }
    if (!isI(toks[j], 'from')) return null;
    j++;
  }
  const mod = toks[j];
  if (!mod || mod.type !== 'str') return null;
  j++;
  let opts = '';
  if ((isI(toks[j], 'with') || isI(toks[j], 'assert')) && isP(toks[j + 1], '{') && !toks[j].nl) {
    let e = j + 2;
    while (e < toks.length && !(isP(toks[e], '}') && toks[e].depth === toks[j + 1].depth)) e++;
    if (e >= toks.length) return null;
    opts = `, { with: ${src.slice(toks[j + 1].start, toks[e].end)} }`;
    j = e + 1;
  }
  const call = `await __moonbox_import(${mod.value}${opts})`;
  const parts = [];
  let text;
  if (def === null && ns === null && named === null) {
    text = `void (${call})`;
  } else {
    let source = call;
    const count = (def !== null) + (ns !== null) + (named !== null);
    if (count > 1) { parts.push(`__moonbox_tmp = ${call}`); source = '__moonbox_tmp'; }
    if (def !== null) parts.push(`${def} = (${source}).default`);
    if (ns !== null) parts.push(`${ns} = ${source}`);
    if (named !== null) parts.push(`{${named.join(', ')}} = ${source}`);
    text = `void (${parts.join(', ')})`;
  }
  if (isP(toks[j], ';')) j++;
  return { text: text + ';', end: j };
}

// Rewrite top-level declarations of a cell; returns {src, functions, usesImport}.
function rewriteDeclarations(src, toks) {
  const edits = []; // {start, end, text}
  const functions = [];
  let usesImport = false;
  // dynamic import(...) anywhere -> __moonbox_import(...) (resolves against the cwd, works in a vm context)
  for (let k = 0; k < toks.length; k++) {
    const t = toks[k];
    if (isI(t, 'import') && isP(toks[k + 1], '(') && !isP(toks[k - 1], '.') && !isP(toks[k - 1], '?.')) {
      edits.push({ start: t.start, end: t.end, text: '__moonbox_import' });
    }
  }
  for (let k = 0; k < toks.length; k++) {
    const t = toks[k];
    if (t.type !== 'ident' || t.depth !== 0 || !isStatementStart(toks, k)) continue;
    let kw = t.value;
    let kk = k;
    if (kw === 'export') {
      const nx = toks[k + 1];
      if (!nx || nx.type !== 'ident' || !['const', 'let', 'var', 'function', 'async', 'class'].includes(nx.value)) continue;
      edits.push({ start: t.start, end: nx.start, text: '' });
      kk = k + 1;
      kw = nx.value;
    }
    const next = toks[kk + 1];
    if (kw === 'var' || kw === 'const' || (kw === 'let' && next && (next.type === 'ident' || isP(next, '[') || isP(next, '{')))) {
      if (isI(next, 'in') || isI(next, 'of')) continue;
      const end = statementEnd(toks, kk, true);
      const last = isP(toks[end - 1], ';') ? end - 2 : end - 1;
      if (last <= kk) continue;
      // split the binding list at depth-0 commas; give initialiser-less bindings "= undefined"
      let elemHasInit = false;
      for (let j = kk + 1; j <= last; j++) {
        const u = toks[j];
        if (u.depth !== 0) continue;
        if (isP(u, '=')) elemHasInit = true;
        if (isP(u, ',')) {
          if (!elemHasInit) edits.push({ start: toks[j - 1].end, end: toks[j - 1].end, text: ' = undefined' });
          elemHasInit = false;
        }
      }
      edits.push({ start: toks[kk].start, end: next.start, text: 'void (' });
      edits.push({ start: toks[last].end, end: toks[last].end, text: (elemHasInit ? '' : ' = undefined') + ')' + (isP(toks[end - 1], ';') ? '' : ';') });
      k = end - 1;
    } else if (kw === 'class' && isI(next) && next.value !== 'extends') {
      let j = kk + 2;
      while (j < toks.length && !(isP(toks[j], '{') && toks[j].depth === 0)) j++;
      let e = j + 1;
      while (e < toks.length && !(isP(toks[e], '}') && toks[e].depth === 0)) e++;
      if (e >= toks.length) continue;
      edits.push({ start: toks[kk].start, end: toks[kk].start, text: `void (${next.value} = ` });
      edits.push({ start: toks[e].end, end: toks[e].end, text: ');' });
      k = e;
    } else if (kw === 'function' || (kw === 'async' && isI(next, 'function') && !next.nl)) {
      let j = kw === 'async' ? kk + 2 : kk + 1;
      if (isP(toks[j], '*')) j++;
      if (isI(toks[j])) functions.push(toks[j].value);
    } else if (kw === 'import' && kk === k && next && !isP(next, '(') && !isP(next, '.')) {
      const imp = parseImport(src, toks, k);
      if (!imp) continue;
      usesImport = true;
      const endPos = imp.end > k ? toks[imp.end - 1].end : t.end;
      edits.push({ start: t.start, end: endPos, text: imp.text });
      k = imp.end - 1;
    }
  }
  edits.sort((a, b) => a.start - b.start || a.end - b.end);
  let out = '';
  let pos = 0;
  for (const e of edits) {
    if (e.start < pos) continue; // overlapping edit: keep the first
    out += src.slice(pos, e.start) + e.text;
    pos = e.end;
  }
  out += src.slice(pos);
  return { src: out, functions, usesImport };
}

const NOT_EXPRESSION_START = new Set(['function', 'class', 'if', 'for', 'while', 'do', 'switch', 'try', 'return', 'throw',
  'break', 'continue', 'var', 'let', 'const', 'import', 'export', 'debugger', 'with']);
const MAX_TAIL_CANDIDATES = 64;

// Wrap (already declaration-rewritten) code in an async function, returning its final expression statement.
function buildAsync(src, functions, filename) {
  const toks = tokenize(src);
  const prefix = '(async () => { ' + functions.map((f) => `globalThis[${JSON.stringify(f)}] = ${f}; `).join('');
  const plain = prefix + src + '\n})()';
  if (!toks.length) return plain;
  let lastIdx = toks.length - 1;
  if (isP(toks[lastIdx], ';') && toks[lastIdx].depth === 0) lastIdx--;
  if (lastIdx < 0) return plain;
  const tailEnd = toks[lastIdx].end;
  const candidates = [];
  for (let k = 0; k <= lastIdx; k++) if (isStatementStart(toks, k)) candidates.push(k);
  for (const k of candidates.slice(-MAX_TAIL_CANDIDATES)) {
    const t = toks[k];
    if (isP(t, '{') || isP(t, ';')) continue;
    if (t.type === 'ident' && NOT_EXPRESSION_START.has(t.value)) continue;
    if (t.type === 'ident' && isP(toks[k + 1], ':')) continue; // label
    if (isI(t, 'async') && isI(toks[k + 1], 'function')) continue;
    const tail = src.slice(t.start, tailEnd);
    try { new vm.Script('(async () => (' + tail + '\n))'); } catch (_) { continue; } // cheap check first
    const code = prefix + src.slice(0, t.start) + 'return (' + tail + '\n);' + src.slice(tailEnd) + '\n})()';
    try {
      new vm.Script(code, { filename });
      return code;
    } catch (_) { /* not an expression statement: try a shorter tail */ }
  }
  return plain;
}

function mentionsAwait(toks) {
  return toks.some((t) => t.type === 'ident' && t.value === 'await');
}

function compile(code, filename) {
  const opts = { filename };
  if (code.startsWith('#!')) code = '//' + code.slice(2);
  let toks = null;
  let rw = null;
  try {
    toks = tokenize(code);
    rw = rewriteDeclarations(code, toks);
  } catch (_) { rw = null; }
  // A cell that is just an object literal: {a: 1} means an object, not a block (as in node's REPL).
  if (/^\s*\{/.test(code) && /\}\s*;?\s*$/.test(code)) {
    try { return { script: new vm.Script('(' + code.trim().replace(/;$/, '') + '\n)', opts), isAsync: false }; } catch (_) { /* a block */ }
  }
  if (rw && !rw.usesImport) {
    try { return { script: new vm.Script(rw.src, opts), isAsync: false }; } catch (_) { /* await, or a bad rewrite */ }
  }
  let asyncErr = null;
  if (rw && (rw.usesImport || mentionsAwait(toks))) {
    try { return { script: new vm.Script(buildAsync(rw.src, rw.functions, filename), opts), isAsync: true }; } catch (e) { asyncErr = e; }
  }
  try {
    return { script: new vm.Script(code, opts), isAsync: false }; // rewrite failed: run the code as written
  } catch (e) {
    if (asyncErr && /await|import/.test(String(e && e.message))) throw asyncErr;
    throw e;
  }
}

// ------------------------------------------------------------------ errors

const cellSources = new Map(); // filename -> the code as the user wrote it (the compiled code may be rewritten)

function cleanStack(stack) {
  const lines = String(stack).split('\n');
  const out = [];
  for (const line of lines) {
    if (/^\s+at /.test(line) && (line.includes(KERNEL_FILE) || /\(node:vm[:)]|node:internal\/vm|at node:vm|processTicksAndRejections/.test(line))) break;
    out.push(line);
  }
  // V8's "<cell-N>:L\n<source line>\n<caret>" header quotes the compiled code: show the user's line instead
  const head = /^(<cell-\d+>):(\d+)$/.exec(out[0] || '');
  if (head && cellSources.has(head[1]) && out.length > 2) {
    const orig = cellSources.get(head[1]).split('\n')[Number(head[2]) - 1];
    if (orig !== undefined && orig !== out[1]) out.splice(1, /^\s*\^+\s*$/.test(out[2]) ? 2 : 1, orig);
  }
  while (out.length && out[out.length - 1].trim() === '') out.pop();
  return out.join('\n');
}

function errorPayload(e) {
  if (e !== null && (typeof e === 'object' || typeof e === 'function') && 'message' in e) {
    let name = 'Error';
    let message = '';
    try { name = String(e.name || (e.constructor && e.constructor.name) || 'Error'); } catch (_) { /* keep */ }
    try { message = String(e.message); } catch (_) { /* keep */ }
    let traceback;
    try { traceback = typeof e.stack === 'string' ? cleanStack(e.stack) : `${name}: ${message}`; } catch (_) { traceback = `${name}: ${message}`; }
    return { name, message, traceback };
  }
  const shown = util.inspect(e);
  return { name: 'Uncaught', message: shown, traceback: 'Uncaught ' + shown };
}

// ------------------------------------------------------------------ execution

// ------------------------------------------------------------------ typescript

// Language "typescript" (node_kernel.js --typescript): each cell's types are removed before it runs, with no type
// checking. Node's own type stripping where the installed node has it (module.stripTypeScriptTypes, node >= 22.13);
// otherwise the TypeScript compiler's transpileModule, from Debian's node-typescript (/usr/share/nodejs/typescript)
// or a `typescript` package require() finds.
const TYPESCRIPT = process.argv.includes('--typescript');
let tsToJs = null;
function loadTypeScript() {
  const nodeModule = require('module');
  if (typeof nodeModule.stripTypeScriptTypes === 'function') {
    return { how: 'node', fn: (code) => nodeModule.stripTypeScriptTypes(code, { mode: 'transform' }) };
  }
  for (const name of ['typescript', '/usr/share/nodejs/typescript', '/usr/lib/nodejs/typescript']) {
    let ts;
    try { ts = require(name); } catch (_) { continue; }
    const compilerOptions = { target: ts.ScriptTarget.ES2022, module: ts.ModuleKind.ESNext, sourceMap: false,
      removeComments: false, useDefineForClassFields: true, esModuleInterop: true };
    return {
      how: 'typescript ' + ts.version,
      fn: (code, filename) => {
        const out = ts.transpileModule(code, { compilerOptions, fileName: filename + '.ts', reportDiagnostics: true });
        const diag = (out.diagnostics || []).find((d) => d.category === ts.DiagnosticCategory.Error);
        if (diag) {
          const text = ts.flattenDiagnosticMessageText(diag.messageText, '\n');
          let where = '';
          if (diag.file && diag.start !== undefined) {
            const lc = diag.file.getLineAndCharacterOfPosition(diag.start);
            where = ` (${filename}:${lc.line + 1}:${lc.character + 1})`;
          }
          const e = new SyntaxError(text + where);
          e.stack = 'SyntaxError: ' + text + where;
          throw e;
        }
        // an import-free cell stays a script: drop the `export {};` the compiler may add for a module
        return out.outputText.replace(/\n?export \{\};\s*$/, '\n');
      },
    };
  }
  return null;
}
if (TYPESCRIPT) {
  tsToJs = loadTypeScript();
  if (!tsToJs) {
    writeAll(2, 'node_kernel: language typescript needs node >= 22.13 (type stripping) or the TypeScript compiler ' +
      '(Debian: apt-get install node-typescript)\n');
    process.exit(3);
  }
}

async function execute(code) {
  if (tsToJs) {
    try {
      code = tsToJs.fn(code, `<cell-${executionCount + 1}>`);
    } catch (e) {
      executionCount += 1;
      send({ id: currentId, type: 'error', error: errorPayload(e) });
      return;
    }
  }
  executionCount += 1;
  const filename = `<cell-${executionCount}>`;
  cellSources.set(filename, code);
  if (cellSources.size > 200) cellSources.delete(cellSources.keys().next().value);
  let compiled;
  try {
    compiled = compile(code, filename);
  } catch (e) {
    send({ id: currentId, type: 'error', error: errorPayload(e) });
    return;
  }
  try {
    let value = compiled.script.runInContext(context, { breakOnSigint: true, displayErrors: true });
    if (compiled.isAsync || util.types.isPromise(value)) value = await value;
    if (value !== undefined) {
      if (!('_' in sandbox) || sandbox._ === lastValue) { sandbox._ = value; lastValue = value; } // never clobber a user's `_`
      emitResult(formatValue(value));
    }
  } catch (e) {
    send({ id: currentId, type: 'error', error: errorPayload(e) });
  }
}

async function handleLine(line) {
  let req;
  try {
    req = JSON.parse(line);
    if (req === null || typeof req !== 'object' || Array.isArray(req)) throw new Error('request is not a JSON object');
  } catch (e) {
    currentId = null;
    send({ id: null, type: 'error', error: { name: 'ProtocolError', message: 'bad request: ' + e.message, traceback: '' } });
    send({ id: null, type: 'done', executionCount });
    return;
  }
  currentId = req.id === undefined ? null : req.id;
  if (typeof req.code !== 'string') {
    send({ id: currentId, type: 'error', error: { name: 'ProtocolError', message: 'request has no string "code"', traceback: '' } });
  } else {
    try { await execute(req.code); } catch (e) { send({ id: currentId, type: 'error', error: errorPayload(e) }); }
  }
  send({ id: currentId, type: 'done', executionCount });
}

// Errors thrown later by timers/promises of user code: report on stderr, keep the kernel alive.
process.on('uncaughtException', (e) => {
  try { writeAll(2, 'Uncaught ' + (e && e.stack ? cleanStack(e.stack) : util.inspect(e)) + '\n'); } catch (_) { /* ignore */ }
});
process.on('unhandledRejection', (e) => {
  try { writeAll(2, 'Uncaught (in promise) ' + (e && e.stack ? cleanStack(e.stack) : util.inspect(e)) + '\n'); } catch (_) { /* ignore */ }
});
process.on('SIGINT', () => { /* idle or awaiting: nothing to interrupt; synchronous code uses breakOnSigint */ });

const queue = [];
let busy = false;
let inputEnded = false;

async function pump() {
  if (busy) return;
  busy = true;
  while (queue.length) await handleLine(queue.shift());
  busy = false;
  if (inputEnded) process.exit(0);
}

let pending = '';
realStdin.setEncoding('utf8');
realStdin.on('data', (chunk) => {
  pending += chunk;
  let nlAt;
  while ((nlAt = pending.indexOf('\n')) >= 0) {
    const line = pending.slice(0, nlAt);
    pending = pending.slice(nlAt + 1);
    if (line.trim()) queue.push(line);
  }
  pump();
});
realStdin.on('end', () => {
  if (pending.trim()) queue.push(pending);
  pending = '';
  inputEnded = true;
  if (!busy) pump();
});

send({ type: 'ready', language: TYPESCRIPT ? 'typescript' : 'javascript', version: process.versions.node,
  implementation: tsToJs ? 'node (' + tsToJs.how + ')' : 'node' });
