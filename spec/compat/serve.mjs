// Start `moonbox serve` on a free loopback port for the compat suite and its
// benchmark, and load the pinned @cloudflare/sandbox (run node with
// --import ./spec/compat/register.mjs so `cloudflare:workers` resolves).
//   MOONBOX_BIN            the moonbox binary (default <repo>/build/moonbox)
//   COMPAT_NODE_MODULES    where `npm ci` put the package (default <repo>/build/compat/node_modules)
import { spawn } from 'node:child_process';
import { mkdtempSync, writeFileSync, rmSync } from 'node:fs';
import { createServer } from 'node:net';
import { tmpdir } from 'node:os';
import { join, dirname, resolve } from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { randomBytes } from 'node:crypto';

const here = dirname(fileURLToPath(import.meta.url));
export const REPO = resolve(here, '..', '..');

export async function loadSdk() {
  const modules = process.env.COMPAT_NODE_MODULES || join(REPO, 'build', 'compat', 'node_modules');
  return import(pathToFileURL(join(modules, '@cloudflare', 'sandbox', 'dist', 'index.js')).href);
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

// startServer({policy?}) -> {origin, token, headers, dir, stop()}. The token
// goes in through --token-file (the server then requires it), so the suite
// works whether or not the server insists on a token by default.
export async function startServer(opts = {}) {
  const bin = process.env.MOONBOX_BIN || join(REPO, 'build', 'moonbox');
  const dir = mkdtempSync(join(tmpdir(), 'moonbox-compat-'));
  const token = randomBytes(16).toString('hex');
  writeFileSync(join(dir, 'token'), token + '\n', { mode: 0o600 });
  const port = await freePort();
  const args = ['serve', '--listen', `127.0.0.1:${port}`, '--token-file', join(dir, 'token')];
  if (opts.policy) {
    writeFileSync(join(dir, 'policy.lua'), opts.policy);
    args.push('--policy', join(dir, 'policy.lua'));
  }
  const child = spawn(bin, args, {
    env: { ...process.env, MOONBOX_HOME: join(dir, 'home') },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  let stderr = '';
  child.stderr.on('data', (d) => { stderr += d; });
  const exited = new Promise((ok) => child.on('exit', (code, signal) => ok({ code, signal })));
  await new Promise((ok, fail) => {
    let out = '';
    const onData = (d) => {
      out += d;
      if (out.includes('listening on')) {
        child.stdout.off('data', onData);
        child.stdout.resume();
        ok();
      }
    };
    child.stdout.on('data', onData);
    exited.then(({ code }) => fail(new Error(`moonbox serve exited (${code}) before listening: ${stderr}`)));
  });
  const origin = `http://127.0.0.1:${port}`;
  const headers = { Authorization: `Bearer ${token}` };
  return {
    origin, token, headers, dir,
    stderr: () => stderr,
    // the sandbox's base URL, as SandboxClient takes it
    baseUrl: (id) => `${origin}/v1/sandboxes/${id}`,
    async stop() {
      child.kill('SIGTERM');
      await exited;
      rmSync(dir, { recursive: true, force: true });
    },
  };
}
