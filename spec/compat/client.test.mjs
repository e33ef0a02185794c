// The seed's published client (@cloudflare/sandbox 0.12.10, SandboxClient)
// drives `moonbox serve` unchanged, through every /api route of the
// container protocol (docs/compat.md). Run:
//   node --import ./spec/compat/register.mjs --test spec/compat/client.test.mjs
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { startServer, loadSdk } from './serve.mjs';

const SDK = await loadSdk();
const { SandboxClient, parseSSEStream, collectFile, ProcessExitedBeforeReadyError } = SDK;

// A policy that lets gitCheckout clone a local repository where the
// runtime's policy knows that switch (moonbox serve refuses it by default).
const POLICY = `local d = require("moonbox.policy").defaults
return d.git and { git = { allowLocal = true } } or {}
`;

let server;
let client;
const BOX = `compat-${process.pid}`;
const SID = 'sandbox-compat'; // like the Sandbox DO's default session id

function newClient(id = BOX) {
  return new SandboxClient({ baseUrl: server.baseUrl(id), defaultHeaders: server.headers, retryTimeoutMs: 1000 });
}

// The error the client throws: its class name, code and status.
async function rejects(promise, name, code, status) {
  let err;
  try {
    await promise;
  } catch (e) {
    err = e;
  }
  assert.ok(err, `expected ${name}`);
  assert.equal(err.name, name, `${err.name}: ${err.message}`);
  assert.equal(err.constructor.name, name);
  assert.equal(err.code, code);
  if (status !== undefined) assert.equal(err.httpStatus, status);
  assert.equal(typeof err.context, 'object');
  return err;
}

async function events(stream, until) {
  const out = [];
  for await (const ev of parseSSEStream(stream)) {
    out.push(ev);
    if (until && until(ev)) break;
  }
  return out;
}

before(async () => {
  server = await startServer({ policy: POLICY });
  client = newClient();
  await client.utils.createSession({ id: SID });
});

after(async () => {
  if (!server) return;
  await fetch(`${server.baseUrl(BOX)}`, { method: 'DELETE', headers: server.headers });
  await server.stop();
});

test('utilities: ping, version, commands', async () => {
  assert.equal(await client.utils.ping(), 'pong');
  assert.match(await client.utils.getVersion(), /^\d+\.\d+\.\d+/);
  const commands = await client.utils.getCommands();
  assert.ok(commands.includes('bash'), 'bash is on the PATH');
  assert.ok(commands.includes('ls'));
});

test('ping and version on a sandbox id never used answer without making the sandbox', async () => {
  // the seed's container always answers ping (hardening finding 10)
  const id = `unused-${process.pid}`;
  const fresh = newClient(id);
  assert.equal(await fresh.utils.ping(), 'pong');
  assert.match(await fresh.utils.getVersion(), /^\d+\.\d+\.\d+/);
  const res = await fetch(`${server.origin}/v1/sandboxes`, { headers: server.headers });
  assert.equal(res.status, 200);
  const list = JSON.stringify(await res.json());
  assert.ok(!list.includes(id), `ping made the sandbox: ${list}`);
});

test('the token is required: no Authorization, no answer', async () => {
  const res = await fetch(`${server.baseUrl(BOX)}/api/ping`);
  assert.equal(res.status, 401);
  await res.text();
});

test('execute: output, exit status, env, cwd, timeout, onCommandComplete', async () => {
  const done = [];
  const c = new SandboxClient({ baseUrl: server.baseUrl(BOX), defaultHeaders: server.headers,
    onCommandComplete: (...a) => done.push(a) });
  const r = await c.commands.execute('echo hi; echo err >&2', SID);
  assert.equal(r.success, true);
  assert.equal(r.exitCode, 0);
  assert.equal(r.stdout, 'hi\n');
  assert.equal(r.stderr, 'err\n');
  assert.equal(r.command, 'echo hi; echo err >&2');
  assert.match(r.timestamp, /^\d{4}-\d\d-\d\dT/);
  assert.deepEqual(done, [[true, 0, 'hi\n', 'err\n', 'echo hi; echo err >&2']]);
  const failed = await c.commands.execute('exit 3', SID);
  assert.equal(failed.success, false);
  assert.equal(failed.exitCode, 3);
  const envd = await c.commands.execute('echo "$A"; pwd', SID, { env: { A: 'x y' }, cwd: '/tmp' });
  assert.equal(envd.stdout, 'x y\n/tmp\n');
  const slow = await c.commands.execute('sleep 5', SID, { timeoutMs: 300 });
  assert.equal(slow.exitCode, 124);
  assert.equal(slow.success, false);
});

test('execute/stream: start, stdout, stderr, complete through parseSSEStream', async () => {
  const stream = await client.commands.executeStream('echo one; echo two >&2; exit 2', SID);
  const evs = await events(stream);
  assert.equal(evs[0].type, 'start');
  assert.equal(evs[0].command, 'echo one; echo two >&2; exit 2');
  const text = (t) => evs.filter((e) => e.type === t).map((e) => e.data).join('');
  assert.equal(text('stdout'), 'one\n');
  assert.equal(text('stderr'), 'two\n');
  const last = evs[evs.length - 1];
  assert.equal(last.type, 'complete');
  assert.equal(last.exitCode, 2);
});

test('sessions: state persists, a second client resumes a session, ids conflict, delete', async () => {
  const r = await client.utils.createSession({ id: 'resume-me', env: { FOO: 'bar' }, cwd: '/workspace' });
  assert.equal(r.success, true);
  assert.equal(r.id, 'resume-me');
  assert.equal(typeof r.message, 'string');
  await client.commands.execute('cd /tmp && X=kept', 'resume-me');
  // another client, another request: the same shell
  const other = newClient();
  const again = await other.commands.execute('pwd; echo "$X $FOO"', 'resume-me');
  assert.equal(again.stdout, '/tmp\nkept bar\n');
  await rejects(other.utils.createSession({ id: 'resume-me' }), 'SessionAlreadyExistsError',
    'SESSION_ALREADY_EXISTS', 409);
  const del = await other.utils.deleteSession('resume-me');
  assert.equal(del.success, true);
  assert.equal(del.sessionId, 'resume-me');
  assert.match(del.timestamp, /Z$/);
  // a used id after delete is a fresh session
  const fresh = await client.commands.execute('pwd; echo "[$X]"', 'resume-me');
  assert.equal(fresh.stdout, '/workspace\n[]\n');
});

test('sessions: a command cut by deleteSession is SESSION_DESTROYED, 410', async () => {
  await client.utils.createSession({ id: 'doomed' });
  const running = rejects(client.commands.execute('sleep 30', 'doomed'), 'SessionDestroyedError',
    'SESSION_DESTROYED', 410);
  await new Promise((ok) => setTimeout(ok, 500));
  await client.utils.deleteSession('doomed');
  await running;
});

test('__DISABLE_SESSION__: a fresh shell for each call', async () => {
  await client.commands.execute('cd /tmp; export Y=2', '__DISABLE_SESSION__');
  const r = await client.commands.execute('pwd; echo "${Y:-unset}"', '__DISABLE_SESSION__');
  assert.equal(r.stdout, '/workspace\nunset\n');
  const stream = await client.commands.executeStream('echo streamed', '__DISABLE_SESSION__');
  const evs = await events(stream);
  assert.equal(evs.filter((e) => e.type === 'stdout').map((e) => e.data).join(''), 'streamed\n');
});

test('files: write, read, exists, mkdir, list, rename, move, delete', async () => {
  const f = client.files;
  await f.mkdir('/workspace/d/e', SID, { recursive: true });
  const w = await f.writeFile('/workspace/d/e/a.txt', 'héllo\n', SID);
  assert.equal(w.success, true);
  assert.equal(w.path, '/workspace/d/e/a.txt');
  const r = await f.readFile('/workspace/d/e/a.txt', SID);
  assert.equal(r.content, 'héllo\n');
  assert.equal(r.encoding, 'utf-8');
  assert.equal(r.isBinary, false);
  assert.equal(r.mimeType, 'text/plain');
  assert.equal(r.size, 7);
  await f.writeFile('/workspace/d/bin', Buffer.from([0, 1, 2, 255]).toString('base64'), SID, { encoding: 'base64' });
  const b = await f.readFile('/workspace/d/bin', SID);
  assert.equal(b.isBinary, true);
  assert.equal(b.encoding, 'base64');
  assert.deepEqual([...Buffer.from(b.content, 'base64')], [0, 1, 2, 255]);
  assert.equal((await f.exists('/workspace/d/e/a.txt', SID)).exists, true);
  assert.equal((await f.exists('/workspace/d/nope', SID)).exists, false);
  await f.writeFile('/workspace/d/.hidden', 'h', SID);
  const flat = await f.listFiles('/workspace/d', SID);
  assert.deepEqual(flat.files.map((x) => x.name).sort(), ['bin', 'e']);
  const deep = await f.listFiles('/workspace/d', SID, { recursive: true, includeHidden: true });
  assert.deepEqual(deep.files.map((x) => x.relativePath).sort(), ['.hidden', 'bin', 'e', 'e/a.txt']);
  assert.equal(deep.count, 4);
  const a = deep.files.find((x) => x.relativePath === 'e/a.txt');
  assert.equal(a.type, 'file');
  assert.equal(a.size, 7);
  assert.equal(a.absolutePath, '/workspace/d/e/a.txt');
  assert.equal(a.permissions.readable, true);
  const ren = await f.renameFile('/workspace/d/e/a.txt', '/workspace/d/e/b.txt', SID);
  assert.equal(ren.newPath, '/workspace/d/e/b.txt');
  const mv = await f.moveFile('/workspace/d/e/b.txt', '/workspace/d/c.txt', SID);
  assert.equal(mv.path, '/workspace/d/e/b.txt');
  assert.equal((await f.readFile('/workspace/d/c.txt', SID)).content, 'héllo\n');
  await f.deleteFile('/workspace/d/c.txt', SID);
  assert.equal((await f.exists('/workspace/d/c.txt', SID)).exists, false);
  // relative paths follow the session's cwd
  await client.commands.execute('cd /workspace/d', SID);
  assert.equal((await f.exists('bin', SID)).exists, true);
  await client.commands.execute('cd /workspace', SID);
});

test('files: errors come as the package\'s classes', async () => {
  const f = client.files;
  const e = await rejects(f.readFile('/workspace/missing.txt', SID), 'FileNotFoundError', 'FILE_NOT_FOUND', 404);
  assert.equal(e.context.path, '/workspace/missing.txt');
  await f.mkdir('/workspace/dir1', SID);
  await rejects(f.mkdir('/workspace/dir1', SID), 'FileExistsError', 'FILE_EXISTS', 409);
  await rejects(f.deleteFile('/workspace/dir1', SID), 'FileSystemError', 'IS_DIRECTORY', 400);
  await rejects(f.mkdir('/workspace/x/y/z', SID), 'FileNotFoundError', 'FILE_NOT_FOUND', 404);
});

test('errors: the seed\'s body shape on the wire', async () => {
  const res = await fetch(`${server.baseUrl(BOX)}/api/read`, {
    method: 'POST', headers: { ...server.headers, 'Content-Type': 'application/json' },
    body: JSON.stringify({ path: '/workspace/missing.txt', sessionId: SID }),
  });
  assert.equal(res.status, 404);
  const body = await res.json();
  assert.equal(body.code, 'FILE_NOT_FOUND');
  assert.equal(typeof body.message, 'string');
  assert.equal(typeof body.context, 'object');
  assert.equal(body.httpStatus, 404);
  assert.match(body.timestamp, /^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$/);
  const bad = await fetch(`${server.baseUrl(BOX)}/api/execute`, {
    method: 'POST', headers: { ...server.headers, 'Content-Type': 'application/json' },
    body: JSON.stringify({ sessionId: SID }),
  });
  assert.equal(bad.status, 400);
  assert.equal((await bad.json()).code, 'VALIDATION_FAILED');
  // the request type's `background`: false is a plain execute; true is
  // /api/process/start's, refused here with the field named
  const post = (body) => fetch(`${server.baseUrl(BOX)}/api/execute`, {
    method: 'POST', headers: { ...server.headers, 'Content-Type': 'application/json' },
    body: JSON.stringify({ sessionId: SID, ...body }),
  });
  const plain = await post({ command: 'echo fg', background: false });
  assert.equal(plain.status, 200);
  assert.equal((await plain.json()).stdout, 'fg\n');
  const bg = await post({ command: 'echo bg', background: true });
  assert.equal(bg.status, 400);
  const refused = await bg.json();
  assert.equal(refused.code, 'VALIDATION_FAILED');
  assert.equal(refused.context.field, 'background');
});

test('read/stream: metadata, chunks that decode alone, complete (collectFile)', async () => {
  // text past one chunk, with two-byte characters across the cut
  const text = 'é'.repeat(50000) + 'end\n';
  await client.files.writeFile('/workspace/big.txt', text, SID);
  const t = await collectFile(await client.files.readFileStream('/workspace/big.txt', SID));
  assert.equal(t.metadata.isBinary, false);
  assert.equal(t.metadata.mimeType, 'text/plain');
  assert.equal(t.metadata.size, Buffer.byteLength(text));
  assert.equal(t.content, text);
  // binary past one chunk
  const bytes = Buffer.alloc(200001);
  for (let i = 0; i < bytes.length; i++) bytes[i] = (i * 7) & 255;
  await client.files.writeFile('/workspace/big.bin', bytes.toString('base64'), SID, { encoding: 'base64' });
  const raw = await events(await client.files.readFileStream('/workspace/big.bin', SID));
  assert.equal(raw[0].type, 'metadata');
  assert.ok(raw.filter((e) => e.type === 'chunk').length > 1, 'more than one chunk');
  assert.equal(raw[raw.length - 1].type, 'complete');
  assert.equal(raw[raw.length - 1].bytesRead, bytes.length);
  const bin = await collectFile(await client.files.readFileStream('/workspace/big.bin', SID));
  assert.equal(bin.metadata.isBinary, true);
  assert.equal(bin.metadata.encoding, 'base64');
  assert.ok(Buffer.from(bin.content).equals(bytes));
  await rejects(client.files.readFileStream('/workspace/none', SID), 'FileNotFoundError', 'FILE_NOT_FOUND', 404);
});

test('processes: start, list, get, logs, stream, kill, kill-all', async () => {
  const p = client.processes;
  const started = await p.startProcess('echo started; sleep 30', SID, { processId: 'sleeper' });
  assert.equal(started.processId, 'sleeper');
  assert.equal(typeof started.pid, 'number');
  assert.equal(started.command, 'echo started; sleep 30');
  // its log stream replays what is buffered and follows
  const stream = await p.streamProcessLogs('sleeper');
  const seen = await events(stream, (e) => e.type === 'stdout' && e.data.includes('started'));
  assert.equal(seen[seen.length - 1].processId, 'sleeper');
  await stream.cancel();
  const logs = await p.getProcessLogs('sleeper');
  assert.equal(logs.stdout, 'started\n');
  assert.equal(logs.processId, 'sleeper');
  const list = await p.listProcesses();
  const mine = list.processes.find((x) => x.id === 'sleeper');
  assert.equal(mine.status, 'running');
  assert.match(mine.startTime, /Z$/);
  const got = await p.getProcess('sleeper');
  assert.equal(got.process.id, 'sleeper');
  assert.equal(got.process.pid, started.pid);
  await p.killProcess('sleeper');
  await events(await p.streamProcessLogs('sleeper'), (e) => e.type === 'exit');
  const after = await p.getProcess('sleeper');
  assert.equal(after.process.status, 'killed');
  await rejects(p.getProcess('no-such'), 'ProcessNotFoundError', 'PROCESS_NOT_FOUND', 404);
  await rejects(p.getProcessLogs('no-such'), 'ProcessNotFoundError', 'PROCESS_NOT_FOUND', 404);

  // an exit with its code, through the stream
  await p.startProcess('echo bye; exit 4', SID, { processId: 'quitter' });
  const evs = await events(await p.streamProcessLogs('quitter'), (e) => e.type === 'exit');
  assert.equal(evs.filter((e) => e.type === 'stdout').map((e) => e.data).join(''), 'bye\n');
  assert.equal(evs[evs.length - 1].exitCode, 4);

  // kill-all is matched before /process/{id}
  await p.startProcess('sleep 30', SID, { processId: 'k1' });
  await p.startProcess('sleep 30', SID, { processId: 'k2' });
  const killed = await p.killAllProcesses();
  assert.equal(killed.cleanedCount, 2);
  for (const id of ['k1', 'k2']) {
    await events(await p.streamProcessLogs(id), (e) => e.type === 'exit');
    assert.equal((await p.getProcess(id)).process.status, 'killed');
  }
});

test('port-watch: watching then ready; process_exited; the SDK error class', async () => {
  const port = 20000 + (process.pid % 20000);
  await client.processes.startProcess(`python3 -m http.server ${port} --bind 127.0.0.1`, SID,
    { processId: 'web', cwd: '/workspace' });
  const stream = await client.ports.watchPort({ port, mode: 'http', path: '/', statusMin: 200, statusMax: 399,
    processId: 'web', interval: 100 });
  const evs = await events(stream);
  assert.deepEqual(evs.map((e) => e.type), ['watching', 'ready']);
  assert.equal(evs[1].port, port);
  await client.processes.killProcess('web');

  await client.processes.startProcess('sleep 0.3; exit 5', SID, { processId: 'dies' });
  const gone = await events(await client.ports.watchPort({ port: port + 1, mode: 'tcp', path: '/',
    statusMin: 200, statusMax: 399, processId: 'dies', interval: 100 }));
  assert.deepEqual(gone.map((e) => e.type), ['watching', 'process_exited']);
  assert.equal(gone[1].exitCode, 5);
  assert.ok(ProcessExitedBeforeReadyError, 'the package exports the class the DO throws for it');
});

test('git checkout: a local repository; a bad URL is InvalidGitUrlError', async () => {
  const repo = mkdtempSync(join(tmpdir(), 'moonbox-compat-repo-'));
  try {
    const git = (...a) => execFileSync('git', ['-C', repo, ...a], { stdio: 'pipe' });
    git('init', '-q', '-b', 'main');
    execFileSync('sh', ['-c', `echo content > ${repo}/file.txt`]);
    git('add', '.');
    git('-c', 'user.name=t', '-c', 'user.email=t@e', 'commit', '-q', '-m', 'one');
    const r = await client.git.checkout(repo, SID, { targetDir: '/workspace/cloned', branch: 'main' });
    assert.equal(r.success, true);
    assert.equal(r.branch, 'main');
    assert.equal(r.targetDir, '/workspace/cloned');
    assert.equal((await client.files.readFile('/workspace/cloned/file.txt', SID)).content, 'content\n');
  } finally {
    rmSync(repo, { recursive: true, force: true });
  }
  await rejects(client.git.checkout('ext::sh -c touch% /tmp/pwned', SID), 'InvalidGitUrlError', 'INVALID_GIT_URL', 400);
});

test('interpreter: contexts, execute/code line SSE, errors', async () => {
  const it = client.interpreter;
  const ctx = await it.createCodeContext({ language: 'python', envVars: { GREETING: 'hey' } });
  assert.equal(typeof ctx.id, 'string');
  assert.equal(ctx.language, 'python');
  assert.equal(ctx.cwd, '/workspace');
  const out = [];
  const results = [];
  const errs = [];
  const cb = {
    onStdout: (m) => out.push(m.text), onStderr: (m) => out.push('E:' + m.text),
    onResult: (r) => results.push(r), onError: (e) => errs.push(e),
  };
  await it.runCodeStream(ctx.id, 'import os\nprint(os.environ["GREETING"])\nx = 41\nx + 1', undefined, cb);
  assert.equal(out.join(''), 'hey\n');
  assert.equal(results.length, 1);
  assert.equal(results[0].text, '42');
  assert.deepEqual(errs, []);
  await it.runCodeStream(ctx.id, 'print(x)\nraise ValueError("bad")', undefined, cb);
  assert.equal(out.join(''), 'hey\n41\n');
  assert.equal(errs.length, 1);
  assert.equal(errs[0].name, 'ValueError');
  assert.equal(errs[0].message, 'bad');
  assert.ok(Array.isArray(errs[0].traceback) && errs[0].traceback.length > 0);
  const listed = await it.listCodeContexts();
  assert.ok(listed.some((c) => c.id === ctx.id && c.language === 'python'));
  await it.deleteCodeContext(ctx.id);
  assert.ok(!(await it.listCodeContexts()).some((c) => c.id === ctx.id));
  await rejects(it.runCodeStream(ctx.id, '1', undefined, cb), 'ContextNotFoundError', 'CONTEXT_NOT_FOUND', 404);
  await rejects(it.deleteCodeContext(ctx.id), 'ContextNotFoundError', 'CONTEXT_NOT_FOUND', 404);
});

test('watch: watching first, then changes as events', async () => {
  await client.files.mkdir('/workspace/w', SID);
  const stream = await client.watch.watch({ path: '/workspace/w', recursive: true, sessionId: SID });
  await client.files.writeFile('/workspace/w/new.txt', 'x', SID);
  await client.files.renameFile('/workspace/w/new.txt', '/workspace/w/moved.txt', SID);
  const evs = await events(stream, (e) => e.type === 'event' && e.eventType === 'move_to');
  await stream.cancel();
  assert.equal(evs[0].type, 'watching');
  assert.equal(evs[0].path, '/workspace/w');
  const kinds = evs.slice(1).map((e) => `${e.eventType} ${e.path}`);
  assert.equal(kinds[0], 'create /workspace/w/new.txt');
  assert.ok(kinds.includes('move_from /workspace/w/new.txt'), kinds.join(', '));
  assert.equal(kinds[kinds.length - 1], 'move_to /workspace/w/moved.txt');
  await rejects(client.watch.watch({ path: '/workspace/none', sessionId: SID }), 'FileNotFoundError',
    'FILE_NOT_FOUND', 404);
});

test('watch/check: unchanged, changed, resync for a version it does not know', async () => {
  await client.files.mkdir('/workspace/cc', SID);
  const req = { path: '/workspace/cc', sessionId: SID };
  const first = await client.watch.checkChanges(req);
  assert.equal(first.success, true);
  assert.equal(first.status, 'unchanged');
  assert.equal(typeof first.version, 'string');
  assert.equal((await client.watch.checkChanges({ ...req, since: first.version })).status, 'unchanged');
  await client.files.writeFile('/workspace/cc/sub.txt', 'x', SID);
  const changed = await client.watch.checkChanges({ ...req, since: first.version });
  assert.equal(changed.status, 'changed');
  assert.notEqual(changed.version, first.version);
  const other = await client.watch.checkChanges({ ...req, since: 'gone-state:3' });
  assert.equal(other.status, 'resync');
  assert.equal(other.reason, 'restarted');
  await rejects(client.watch.checkChanges({ ...req, since: 'nonsense' }), 'ValidationFailedError',
    'VALIDATION_FAILED', 400);
});

test('backup: create a squashfs archive at the named path, restore it over changed content', async () => {
  await client.commands.execute('mkdir -p /workspace/proj/src && printf "one\\n" > /workspace/proj/src/a.txt' +
    ' && printf "log\\n" > /workspace/proj/debug.log && ln -s src/a.txt /workspace/proj/link', SID);
  const made = await client.backup.createArchive('/workspace/proj', '/tmp/proj.sqsh', SID, { excludes: ['*.log'] });
  assert.equal(made.success, true);
  assert.equal(made.archivePath, '/tmp/proj.sqsh');
  assert.ok(made.sizeBytes > 0);
  // a real squashfs archive, read by squashfs-tools' own lister
  const listing = await client.commands.execute('unsquashfs -l -d x /tmp/proj.sqsh', SID);
  assert.equal(listing.exitCode, 0);
  assert.deepEqual(listing.stdout.split('\n').filter((l) => l.startsWith('x')).sort(),
    ['x', 'x/link', 'x/src', 'x/src/a.txt']);
  await client.commands.execute('rm -rf /workspace/proj/src && echo junk > /workspace/proj/junk', SID);
  const restored = await client.backup.restoreArchive('/workspace/proj', '/tmp/proj.sqsh', SID);
  assert.equal(restored.success, true);
  assert.equal(restored.dir, '/workspace/proj');
  const after = await client.commands.execute('cd /workspace/proj && find . | sort && cat src/a.txt && readlink link',
    SID);
  assert.equal(after.stdout, '.\n./link\n./src\n./src/a.txt\none\nsrc/a.txt\n');
  const missing = await fetch(`${server.baseUrl(BOX)}/api/backup/restore`, {
    method: 'POST', headers: { ...server.headers, 'Content-Type': 'application/json' },
    body: JSON.stringify({ dir: '/workspace/proj', archivePath: '/tmp/none.sqsh', sessionId: SID }),
  });
  assert.equal(missing.status, 404);
  assert.equal((await missing.json()).code, 'BACKUP_NOT_FOUND');
  await rejects(client.backup.createArchive('/workspace/proj', '/tmp/p2.sqsh', SID, { compression: 'brotli' }),
    'InvalidBackupConfigError', 'INVALID_BACKUP_CONFIG', 400);
});

test('a sandbox is made on first use by any route, reads too', async () => {
  const id = `compat-fresh-${process.pid}`;
  const fresh = newClient(id);
  try {
    const list = await fresh.processes.listProcesses();
    assert.deepEqual(list.processes, []);
    assert.equal((await fresh.commands.execute('echo made', undefined)).stdout, 'made\n');
  } finally {
    await fetch(server.baseUrl(id), { method: 'DELETE', headers: server.headers });
  }
});

test('streams end with an error event the client can read: a session deleted under a stream, a code timeout', async () => {
  await client.utils.createSession({ id: 'doomed-stream' });
  const stream = await client.commands.executeStream('echo begun; sleep 30', 'doomed-stream');
  const reading = events(stream);
  await new Promise((ok) => setTimeout(ok, 500));
  await client.utils.deleteSession('doomed-stream');
  const evs = await reading;
  const last = evs[evs.length - 1];
  assert.equal(last.type, 'error');
  assert.equal(typeof last.data, 'string');
  assert.match(last.data, /doomed-stream/);
  assert.equal(last.code, 'SESSION_DESTROYED');
  assert.ok(!evs.some((e) => e.type === 'complete'));

  const ctx = await client.interpreter.createCodeContext({ language: 'python' });
  const errs = [];
  await client.interpreter.runCodeStream(ctx.id, 'import time\ntime.sleep(10)', undefined,
    { onError: (e) => errs.push(e) }, 300);
  assert.equal(errs.length, 1);
  assert.equal(errs[0].name, 'TimeoutError');
  assert.ok(Array.isArray(errs[0].traceback));
  await client.interpreter.deleteCodeContext(ctx.id);
});
