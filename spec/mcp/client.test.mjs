// The official MCP TypeScript SDK (@modelcontextprotocol/sdk, pinned in
// spec/mcp/package-lock.json) drives `moonbox mcp` over stdio and /mcp of
// `moonbox serve` over streamable HTTP (docs/mcp.md). Run:
//   MCP_NODE_MODULES=build/mcp/node_modules node --test spec/mcp/client.test.mjs
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { existsSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { createServer } from 'node:net';
import { tmpdir } from 'node:os';
import { join, dirname, resolve } from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { randomBytes } from 'node:crypto';
import { createInterface } from 'node:readline';

const REPO = resolve(dirname(fileURLToPath(import.meta.url)), '..', '..');
const BIN = process.env.MOONBOX_BIN || join(REPO, 'build', 'moonbox');
const MODULES = process.env.MCP_NODE_MODULES || join(REPO, 'build', 'mcp', 'node_modules');
const sdk = (p) => import(pathToFileURL(join(MODULES, '@modelcontextprotocol', 'sdk', 'dist', 'esm', p)).href);
const { Client } = await sdk('client/index.js');
const { StdioClientTransport } = await sdk('client/stdio.js');
const { StreamableHTTPClientTransport } = await sdk('client/streamableHttp.js');

const HOME = mkdtempSync(join(tmpdir(), 'moonbox-mcp-'));
const ENV = { ...process.env, MOONBOX_HOME: HOME };
const TOOLS = ['create_code_context', 'create_sandbox', 'delete_file', 'destroy_sandbox', 'expose_port',
  'get_process_logs', 'kill_process', 'list_files', 'list_processes', 'read_file', 'run_code', 'run_command',
  'start_process', 'write_file'];

const sleep = (ms) => new Promise((ok) => setTimeout(ok, ms));

async function stdioClient(args = []) {
  const client = new Client({ name: 'moonbox-test', version: '1.0.0' });
  await client.connect(new StdioClientTransport({ command: BIN, args: ['mcp', ...args], env: ENV, stderr: 'pipe' }));
  return client;
}

function freePort() {
  return new Promise((ok, fail) => {
    const srv = createServer();
    srv.on('error', fail);
    srv.listen(0, '127.0.0.1', () => {
      const { port } = srv.address();
      srv.close(() => ok(port));
    });
  });
}

let server; // {origin, token, child, exited}
async function startServer() {
  const token = randomBytes(16).toString('hex');
  writeFileSync(join(HOME, 'token'), token + '\n', { mode: 0o600 });
  const port = await freePort();
  const child = spawn(BIN, ['serve', '--listen', `127.0.0.1:${port}`, '--token-file', join(HOME, 'token'),
    '--access-log', 'off'], { env: ENV, stdio: ['ignore', 'pipe', 'inherit'] });
  const exited = new Promise((ok) => child.on('exit', ok));
  await new Promise((ok, fail) => {
    let out = '';
    child.stdout.on('data', (d) => {
      out += d;
      if (out.includes('listening on')) ok();
    });
    exited.then((code) => fail(new Error(`moonbox serve exited (${code}) before listening`)));
  });
  return { origin: `http://127.0.0.1:${port}`, port, token, child, exited };
}

async function httpClient() {
  const client = new Client({ name: 'moonbox-test', version: '1.0.0' });
  const transport = new StreamableHTTPClientTransport(new URL(server.origin + '/mcp'), {
    requestInit: { headers: { Authorization: `Bearer ${server.token}` } },
  });
  await client.connect(transport);
  return { client, transport };
}

const call = (client, name, args, options) => client.callTool({ name, arguments: args }, undefined, options);
const text = (r) => r.content.map((c) => c.text).join('');

// The tool error: isError with our code first in the text and in structuredContent.
function assertToolError(r, code) {
  assert.equal(r.isError, true, JSON.stringify(r));
  assert.equal(r.structuredContent.code, code, JSON.stringify(r));
  assert.ok(text(r).startsWith(code + ': '), text(r));
}

// Cancelling a call whose command sleeps 300 s: the call rejects at once,
// and the command's process is gone (its pid, recorded by the command, no
// longer runs in the sandbox). The probe queues behind the command in the
// session's shell: it answers within its 20 s only when the command was killed.
async function assertCancelKills(client) {
  const ac = new AbortController();
  const pending = call(client, 'run_command',
    { command: "sh -c 'echo $$ > sleep.pid; exec sleep 300'", timeout: 600000 }, { signal: ac.signal });
  await sleep(1500);
  const started = Date.now();
  ac.abort('the test cancels');
  await assert.rejects(pending);
  assert.ok(Date.now() - started < 5000);
  const probe = await call(client, 'run_command', {
    command: 'p=$(cat sleep.pid); for i in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done; ' +
      'if kill -0 "$p" 2>/dev/null; then echo alive; else echo gone; fi',
  }, { timeout: 20000 });
  assert.equal(text(probe), 'gone\n[exit code 0]');
}

// A call that asks for progress (onprogress: the SDK sends a progressToken)
// hears that it still runs, once a second has passed, in rising numbers.
async function assertProgress(client) {
  const seen = [];
  const r = await call(client, 'run_command', { command: 'sleep 2.5; echo slept' }, {
    onprogress: (p) => seen.push(p),
  });
  assert.equal(text(r), 'slept\n[exit code 0]');
  assert.ok(seen.length >= 1, 'a progress notification arrived');
  assert.deepEqual(seen[0], { progress: 1, message: 'running for 1 s' });
  for (let i = 1; i < seen.length; i++) assert.ok(seen[i].progress > seen[i - 1].progress);
}

before(async () => { server = await startServer(); });
after(async () => {
  if (server) {
    server.child.kill('SIGTERM');
    await server.exited;
  }
  rmSync(HOME, { recursive: true, force: true });
});

test('stdio: the tools and their input schemas', async () => {
  const client = await stdioClient();
  try {
    assert.equal(client.getServerVersion().name, 'moonbox');
    const { tools } = await client.listTools();
    assert.deepEqual(tools.map((t) => t.name).sort(), TOOLS);
    const run = tools.find((t) => t.name === 'run_command');
    assert.deepEqual(run.inputSchema.required, ['command']);
    assert.equal(run.inputSchema.additionalProperties, false);
    assert.deepEqual(Object.keys(run.inputSchema.properties).sort(), ['command', 'cwd', 'env', 'sandbox', 'timeout']);
    assert.equal(run.inputSchema.properties.timeout.type, 'integer');
    assert.deepEqual(run.inputSchema.properties.env.additionalProperties, { type: 'string' });
    const code = tools.find((t) => t.name === 'run_code');
    assert.deepEqual(code.inputSchema.properties.language.enum, ['python', 'javascript', 'typescript', 'lua']);
    for (const t of tools) {
      assert.equal(t.inputSchema.type, 'object', t.name);
      assert.ok(t.description.length > 20, t.name);
    }
    assert.deepEqual(tools.find((t) => t.name === 'write_file').inputSchema.required, ['path', 'content']);
    assert.deepEqual(tools.find((t) => t.name === 'read_file').annotations,
      { readOnlyHint: true, destructiveHint: false });
    assert.deepEqual(tools.find((t) => t.name === 'delete_file').annotations,
      { readOnlyHint: false, destructiveHint: true });
    assert.deepEqual(tools.find((t) => t.name === 'expose_port').inputSchema.properties.port,
      { type: 'integer', minimum: 1, maximum: 65535 });
  } finally {
    await client.close();
  }
});

test('stdio: run_command output, exit code, cwd, env, state, truncation, timeout', async () => {
  const client = await stdioClient();
  try {
    let r = await call(client, 'run_command', { command: "printf 'a\\nb'; echo e >&2; exit 3" });
    assert.equal(r.isError, false);
    assert.equal(text(r), 'a\nb\n[stderr]\ne\n[exit code 3]');
    assert.equal(r.structuredContent.exitCode, 3);
    assert.equal(r.structuredContent.stdout, 'a\nb');
    assert.equal(r.structuredContent.stderr, 'e\n');
    r = await call(client, 'run_command', { command: 'mkdir -p sub && export KEPT=yes' });
    assert.equal(text(r), '[exit code 0]');
    r = await call(client, 'run_command', { command: 'basename "$PWD"; echo "$X $KEPT"', cwd: '/workspace/sub',
      env: { X: 'x y' } });
    assert.equal(text(r), 'sub\nx y yes\n[exit code 0]');
    r = await call(client, 'run_command', { command: "head -c 150000 /dev/zero | tr '\\0' a" });
    assert.equal(r.structuredContent.stdout.length, 100000);
    assert.equal(r.structuredContent.truncated, true);
    assert.ok(text(r).endsWith('a\n[output truncated: only the first 100000 bytes of each stream are kept]\n' +
      '[exit code 0]'));
    r = await call(client, 'run_command', { command: 'echo before; sleep 5', timeout: 300 });
    assertToolError(r, 'TIMEOUT');
    assert.equal(text(r), 'TIMEOUT: before\n[timed out: the command was killed after 300 ms]\n[exit code 124]');
    assert.equal(r.structuredContent.exitCode, 124);
    assert.equal(r.structuredContent.timedOut, true);
    r = await call(client, 'run_command', { command: 'echo still usable' });
    assert.equal(text(r), 'still usable\n[exit code 0]');
  } finally {
    await client.close();
  }
});

test('stdio: files', async () => {
  const client = await stdioClient();
  try {
    let r = await call(client, 'write_file', { path: 'hello.txt', content: 'hello\n' });
    assert.equal(text(r), 'wrote /workspace/hello.txt');
    r = await call(client, 'write_file', { path: '/workspace/bin.dat', content: Buffer.from([0, 1, 2, 255]).toString('base64'),
      encoding: 'base64' });
    assert.equal(r.isError, false);
    r = await call(client, 'read_file', { path: '/workspace/hello.txt' });
    assert.equal(text(r), 'hello\n');
    assert.equal(r.structuredContent.size, 6);
    r = await call(client, 'read_file', { path: 'bin.dat' });
    assert.equal(r.structuredContent.encoding, 'base64');
    assert.equal(r.structuredContent.content, 'AAEC/w==');
    await call(client, 'run_command', { command: 'mkdir -p d && touch d/x .hidden' });
    r = await call(client, 'list_files', { path: '/workspace' });
    assert.equal(text(r), 'bin.dat\nd/\nhello.txt');
    assert.equal(r.structuredContent.count, 3);
    r = await call(client, 'list_files', { path: '.', recursive: true, includeHidden: true });
    assert.equal(text(r), '.hidden\nbin.dat\nd/\nd/x\nhello.txt');
    r = await call(client, 'delete_file', { path: 'hello.txt' });
    assert.equal(text(r), 'deleted /workspace/hello.txt');
    assertToolError(await call(client, 'read_file', { path: 'hello.txt' }), 'FILE_NOT_FOUND');
    assertToolError(await call(client, 'delete_file', { path: 'd' }), 'IS_DIRECTORY');
    assertToolError(await call(client, 'write_file', { path: 'no/such/dir/f', content: 'x' }), 'FILE_NOT_FOUND');
    assertToolError(await call(client, 'read_file', { path: 'a\u0000b' }), 'VALIDATION_FAILED');
  } finally {
    await client.close();
  }
});

test('stdio: background processes', async () => {
  const client = await stdioClient();
  try {
    let r = await call(client, 'start_process', { command: 'echo started; echo oops >&2; sleep 30', processId: 'srv' });
    assert.equal(r.structuredContent.id, 'srv');
    assert.match(text(r), /^started process srv \(pid \d+\)$/);
    for (let i = 0; i < 100; i++) {
      r = await call(client, 'get_process_logs', { processId: 'srv' });
      if (r.structuredContent.stderr === 'oops\n') break;
      await sleep(100);
    }
    assert.equal(text(r), 'started\n[stderr]\noops\n');
    r = await call(client, 'list_processes', {});
    assert.equal(text(r), 'srv\trunning\techo started; echo oops >&2; sleep 30');
    assert.equal(r.structuredContent.processes[0].status, 'running');
    r = await call(client, 'kill_process', { processId: 'srv' });
    assert.equal(text(r), 'process srv: killed');
    r = await call(client, 'list_processes', {});
    assert.equal(r.structuredContent.processes[0].status, 'killed');
    assertToolError(await call(client, 'get_process_logs', { processId: 'nope' }), 'PROCESS_NOT_FOUND');
    assertToolError(await call(client, 'kill_process', { processId: 'nope' }), 'PROCESS_NOT_FOUND');
  } finally {
    await client.close();
  }
});

test('stdio: run_code in python, javascript, typescript, lua and in a context', async () => {
  const client = await stdioClient();
  try {
    let r = await call(client, 'run_code', { code: 'x = 40\nprint("hi")' });
    assert.equal(text(r), 'hi\n');
    r = await call(client, 'run_code', { code: 'x + 2', language: 'python' });
    assert.equal(text(r), '42');
    assert.deepEqual(r.structuredContent.results, [{ text: '42' }]);
    for (const language of ['javascript', 'typescript', 'lua']) {
      r = await call(client, 'run_code', { code: '2 + 3', language });
      assert.equal(text(r), '5', language);
    }
    r = await call(client, 'run_code', { code: 'raise ValueError("boom")' });
    assert.equal(r.isError, true);
    assert.equal(text(r), 'ValueError: boom');
    assert.equal(r.structuredContent.error.name, 'ValueError');
    r = await call(client, 'create_code_context', { language: 'javascript' });
    const id = r.structuredContent.id;
    assert.equal(text(r), `context ${id} (javascript)`);
    assert.match(id, /^ctx-\d+$/);
    await call(client, 'run_code', { code: 'var y = 7', context: id });
    r = await call(client, 'run_code', { code: 'y * 6', context: id });
    assert.equal(text(r), '42');
    assertToolError(await call(client, 'run_code', { code: '1', context: 'nope' }), 'CONTEXT_NOT_FOUND');
  } finally {
    await client.close();
  }
});

test('stdio: protocol errors for an unknown tool and bad arguments', async () => {
  const client = await stdioClient();
  try {
    await assert.rejects(call(client, 'no_such_tool', {}), (e) => e.code === -32602 && /unknown tool/.test(e.message));
    await assert.rejects(call(client, 'run_command', {}), (e) => e.code === -32602 && /missing argument "command"/.test(e.message));
    await assert.rejects(call(client, 'run_command', { command: 'ls', bogus: 1 }), (e) => e.code === -32602);
    await assert.rejects(call(client, 'run_command', { command: 'ls', timeout: 'soon' }), (e) => e.code === -32602);
    await assert.rejects(client.request({ method: 'no/such', params: {} }, (await sdk('types.js')).EmptyResultSchema),
      (e) => e.code === -32601);
    assert.deepEqual(await client.ping(), {});
  } finally {
    await client.close();
  }
});

test('stdio: named sandboxes, unknown sandboxes, the session sandbox goes at the end', async () => {
  const name = `mcp-named-${process.pid}`;
  const a = await stdioClient();
  let own;
  try {
    assertToolError(await call(a, 'run_command', { command: 'true', sandbox: 'no-such-box' }), 'SANDBOX_NOT_FOUND');
    assertToolError(await call(a, 'create_sandbox', { sandbox: 'Bad Name' }), 'VALIDATION_FAILED');
    let r = await call(a, 'create_sandbox', { sandbox: name });
    assert.equal(r.structuredContent.id, name);
    r = await call(a, 'write_file', { path: 'kept.txt', content: 'kept\n', sandbox: name });
    assert.equal(r.isError, false);
    r = await call(a, 'expose_port', { port: 8000 });
    assert.match(r.structuredContent.url, /^http:\/\/8000-mcp-[0-9a-f]{16}\.localhost:8080\/$/);
    own = r.structuredContent.url.match(/8000-(mcp-[0-9a-f]{16})\./)[1];
    assert.ok(existsSync(join(HOME, 'sandboxes', own)));
  } finally {
    await a.close();
  }
  for (let i = 0; i < 50 && existsSync(join(HOME, 'sandboxes', own)); i++) await sleep(100);
  assert.equal(existsSync(join(HOME, 'sandboxes', own)), false, 'the session sandbox is destroyed');
  const b = await stdioClient();
  try {
    let r = await call(b, 'read_file', { path: 'kept.txt', sandbox: name });
    assert.equal(text(r), 'kept\n');
    r = await call(b, 'destroy_sandbox', { sandbox: name });
    assert.equal(text(r), `destroyed sandbox ${name}`);
    assertToolError(await call(b, 'read_file', { path: 'kept.txt', sandbox: name }), 'SANDBOX_NOT_FOUND');
  } finally {
    await b.close();
  }
});

test('stdio: moonbox mcp --sandbox NAME works in that sandbox and keeps it', async () => {
  const name = `mcp-flag-${process.pid}`;
  let c = await stdioClient(['--sandbox', name]);
  try {
    assert.equal(text(await call(c, 'write_file', { path: 'stays.txt', content: 'stays' })), 'wrote /workspace/stays.txt');
  } finally {
    await c.close();
  }
  c = await stdioClient(['--sandbox', name]);
  try {
    assert.equal(text(await call(c, 'read_file', { path: 'stays.txt' })), 'stays');
    assert.equal(text(await call(c, 'read_file', { path: 'stays.txt', sandbox: name })), 'stays');
    assert.equal(text(await call(c, 'destroy_sandbox', {})), `destroyed sandbox ${name}`);
  } finally {
    await c.close();
  }
  assert.equal(existsSync(join(HOME, 'sandboxes', name)), false);
});

test('stdio: two concurrent clients get separate sandboxes', async () => {
  const [a, b] = await Promise.all([stdioClient(), stdioClient()]);
  try {
    const [ra, rb] = await Promise.all([
      call(a, 'run_command', { command: 'echo A > mine.txt; sleep 0.5; ls' }),
      call(b, 'run_command', { command: 'echo B > mine.txt; sleep 0.5; ls' }),
    ]);
    assert.equal(text(ra), 'mine.txt\n[exit code 0]');
    assert.equal(text(rb), 'mine.txt\n[exit code 0]');
    assert.equal(text(await call(a, 'read_file', { path: 'mine.txt' })), 'A\n');
    assert.equal(text(await call(b, 'read_file', { path: 'mine.txt' })), 'B\n');
  } finally {
    await Promise.all([a.close(), b.close()]);
  }
});

test('stdio: a cancelled call kills its command; progress of a long call', async () => {
  const client = await stdioClient();
  try {
    await assertCancelKills(client);
    await assertProgress(client);
  } finally {
    await client.close();
  }
});

// Raw lines: a cancelled request gets no response; bad JSON is a parse error.
test('stdio: no response for a cancelled request; parse errors', async () => {
  const child = spawn(BIN, ['mcp'], { env: ENV, stdio: ['pipe', 'pipe', 'inherit'] });
  const lines = [];
  const waiters = [];
  createInterface({ input: child.stdout }).on('line', (l) => {
    lines.push(JSON.parse(l));
    waiters.splice(0).forEach((w) => w());
  });
  const send = (m) => child.stdin.write((typeof m === 'string' ? m : JSON.stringify(m)) + '\n');
  const reply = async (id) => {
    for (;;) {
      const m = lines.find((l) => l.id === id);
      if (m) return m;
      await new Promise((ok) => waiters.push(ok));
    }
  };
  try {
    send({ jsonrpc: '2.0', id: 1, method: 'initialize', params: { protocolVersion: '2025-03-26', capabilities: {},
      clientInfo: { name: 'raw', version: '1' } } });
    assert.equal((await reply(1)).result.protocolVersion, '2025-03-26');
    send({ jsonrpc: '2.0', method: 'notifications/initialized' });
    send('{"jsonrpc": "2.0", "id": 2, "method": ');
    assert.equal((await reply(null)).error.code, -32700);
    send({ jsonrpc: '2.0', id: 3, method: 'tools/call', params: { name: 'run_command', arguments: { command: 'sleep 300', timeout: 600000 } } });
    await sleep(1000);
    send({ jsonrpc: '2.0', method: 'notifications/cancelled', params: { requestId: 3, reason: 'test' } });
    send({ jsonrpc: '2.0', id: 4, method: 'tools/call', params: { name: 'run_command', arguments: { command: 'echo after' } } });
    // (queued behind the sleep in the session's shell: it answers in time only when the sleep was killed)
    const after = await Promise.race([reply(4), sleep(20000).then(() => null)]);
    assert.ok(after, 'the call after the cancelled one answered');
    assert.equal(after.result.content[0].text, 'after\n[exit code 0]');
    await sleep(500);
    assert.equal(lines.filter((l) => l.id === 3).length, 0);
  } finally {
    child.stdin.end();
    await new Promise((ok) => child.on('exit', ok));
  }
});

test('http: a token is required', async () => {
  const init = JSON.stringify({ jsonrpc: '2.0', id: 1, method: 'initialize', params: { protocolVersion: '2025-06-18',
    capabilities: {}, clientInfo: { name: 'raw', version: '1' } } });
  const headers = { 'content-type': 'application/json', accept: 'application/json, text/event-stream' };
  let res = await fetch(server.origin + '/mcp', { method: 'POST', headers, body: init });
  assert.equal(res.status, 401);
  res = await fetch(server.origin + '/mcp', { method: 'POST', headers: { ...headers, authorization: 'Bearer ' + 'f'.repeat(32) },
    body: init });
  assert.equal(res.status, 401);
  const client = new Client({ name: 'moonbox-test', version: '1.0.0' });
  await assert.rejects(client.connect(new StreamableHTTPClientTransport(new URL(server.origin + '/mcp'))),
    (e) => e.code === 401);
  // with the token: unknown sessions are 404, GET is 405
  const auth = { authorization: `Bearer ${server.token}` };
  res = await fetch(server.origin + '/mcp', { method: 'POST', headers: { ...headers, ...auth, 'mcp-session-id': 'nope' },
    body: JSON.stringify({ jsonrpc: '2.0', id: 2, method: 'ping' }) });
  assert.equal(res.status, 404);
  res = await fetch(server.origin + '/mcp', { headers: { ...auth, accept: 'text/event-stream' } });
  assert.equal(res.status, 405);
  res = await fetch(server.origin + '/mcp', { method: 'POST', headers: { ...headers, ...auth }, body: '{"jsonrpc":' });
  assert.equal(res.status, 400);
  assert.equal((await res.json()).error.code, -32700);
  // a session's message that is no JSON-RPC message: 400 with -32600
  const made = await fetch(server.origin + '/mcp', { method: 'POST', headers: { ...headers, ...auth }, body: init });
  const sid = made.headers.get('mcp-session-id');
  assert.match(sid, /^[0-9a-f]{32}$/);
  await made.text();
  res = await fetch(server.origin + '/mcp', { method: 'POST', headers: { ...headers, ...auth, 'mcp-session-id': sid },
    body: '{"jsonrpc": "2.0"}' });
  assert.equal(res.status, 400);
  assert.equal((await res.json()).error.code, -32600);
  res = await fetch(server.origin + '/mcp', { method: 'DELETE', headers: { ...auth, 'mcp-session-id': sid } });
  assert.equal(res.status, 200);
  res = await fetch(server.origin + '/mcp', { method: 'DELETE', headers: { ...auth, 'mcp-session-id': sid } });
  assert.equal(res.status, 404);
  // another site's page (DNS rebinding): refused whatever it carries
  res = await fetch(server.origin + '/mcp', { method: 'POST', headers: { ...headers, ...auth, origin: 'http://evil.example' },
    body: init });
  assert.equal(res.status, 403);
  // an initialize that fails leaves no session
  res = await fetch(server.origin + '/mcp', { method: 'POST', headers: { ...headers, ...auth },
    body: JSON.stringify({ jsonrpc: '2.0', id: 3, method: 'initialize', params: {} }) });
  assert.equal(res.status, 200);
  assert.equal(res.headers.get('mcp-session-id'), null);
  assert.equal((await res.json()).error.code, -32602);
});

test('http: tools over streamable HTTP; DELETE ends the session and its sandbox', async () => {
  const { client, transport } = await httpClient();
  const { tools } = await client.listTools();
  assert.deepEqual(tools.map((t) => t.name).sort(), TOOLS);
  let r = await call(client, 'run_command', { command: 'echo hi' });
  assert.equal(text(r), 'hi\n[exit code 0]');
  r = await call(client, 'write_file', { path: 'f.txt', content: 'over http' });
  assert.equal(text(await call(client, 'read_file', { path: 'f.txt' })), 'over http');
  r = await call(client, 'expose_port', { port: 3000, name: 'web' });
  assert.match(r.structuredContent.url, new RegExp(`^http://3000-mcp-[0-9a-f]{16}\\.localhost:${server.port}/$`));
  const id = r.structuredContent.url.match(/3000-(mcp-[0-9a-f]{16})\./)[1];
  const auth = { authorization: `Bearer ${server.token}` };
  assert.equal((await fetch(`${server.origin}/v1/sandboxes/${id}`, { headers: auth })).status, 200);
  assertToolError(await call(client, 'read_file', { path: 'nope' }), 'FILE_NOT_FOUND');
  assertToolError(await call(client, 'run_command', { command: 'true', sandbox: 'no-such-box' }), 'SANDBOX_NOT_FOUND');
  await transport.terminateSession();
  await client.close();
  assert.equal((await fetch(`${server.origin}/v1/sandboxes/${id}`, { headers: auth })).status, 404);
});

test('http: two concurrent clients get separate sandboxes', async () => {
  const [a, b] = await Promise.all([httpClient(), httpClient()]);
  try {
    assert.notEqual(a.transport.sessionId, b.transport.sessionId);
    await Promise.all([
      call(a.client, 'write_file', { path: 'who', content: 'a' }),
      call(b.client, 'write_file', { path: 'who', content: 'b' }),
    ]);
    assert.equal(text(await call(a.client, 'read_file', { path: 'who' })), 'a');
    assert.equal(text(await call(b.client, 'read_file', { path: 'who' })), 'b');
  } finally {
    for (const c of [a, b]) {
      await c.transport.terminateSession();
      await c.client.close();
    }
  }
});

test('http: a cancelled call kills its command; progress of a long call', async () => {
  const { client, transport } = await httpClient();
  try {
    await assertCancelKills(client);
    await assertProgress(client);
  } finally {
    await transport.terminateSession();
    await client.close();
  }
});
