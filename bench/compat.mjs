// The seed's container protocol against /v1 (issue #16): `/api/execute` of
// `true` through the real SandboxClient (@cloudflare/sandbox, installed as
// for spec/compat) against `POST /v1/sandboxes/{id}/exec` of `true` through
// the same Node fetch, in the same run, on one `moonbox serve` this script
// starts on loopback. Sequential (one request in flight) and 16 in flight,
// each in its own session.
// Run: node --import ./spec/compat/register.mjs bench/compat.mjs [seconds per row]
import { startServer, loadSdk } from '../spec/compat/serve.mjs';

const SECONDS = Number(process.argv[2] || 10);
const CONCURRENCY = 16;
const { SandboxClient } = await loadSdk();
const server = await startServer();
const BOX = 'bench';

function quantile(sorted, p) {
  return sorted[Math.max(0, Math.min(sorted.length - 1, Math.round(sorted.length * p) - 1))];
}

// Run `workers` loops of each call for SECONDS in all, the two calls
// taking turns in slices of SLICE_MS (so a busy spell of the machine
// weighs on both alike); per call: req/s, p50, p99 in ms.
const SLICE_MS = 250;
async function measure(workers, calls) {
  const stats = calls.map(() => ({ samples: [], busy: 0 }));
  const end = performance.now() + SECONDS * 1000;
  while (performance.now() < end) {
    for (const [i, call] of calls.entries()) {
      const sliceEnd = performance.now() + SLICE_MS;
      const started = performance.now();
      await Promise.all(Array.from({ length: workers }, async (_, w) => {
        while (performance.now() < sliceEnd) {
          const t = performance.now();
          await call(w);
          stats[i].samples.push(performance.now() - t);
        }
      }));
      stats[i].busy += performance.now() - started;
    }
  }
  return stats.map(({ samples, busy }) => {
    samples.sort((a, b) => a - b);
    return { rps: samples.length / (busy / 1000), p50: quantile(samples, 0.5), p99: quantile(samples, 0.99),
      n: samples.length };
  });
}

const client = new SandboxClient({ baseUrl: server.baseUrl(BOX), defaultHeaders: server.headers });
const v1 = `${server.baseUrl(BOX)}/exec`;
const headers = { ...server.headers, 'Content-Type': 'application/json' };

async function viaClient(sid) {
  const r = await client.commands.execute('true', sid);
  if (r.exitCode !== 0) throw new Error(`exit ${r.exitCode}`);
}

async function viaV1(sid) {
  const res = await fetch(v1, { method: 'POST', headers, body: JSON.stringify({ command: 'true', sessionId: sid }) });
  const r = await res.json();
  if (res.status !== 200 || r.exitCode !== 0) throw new Error(`status ${res.status}`);
}

try {
  for (let i = 0; i < CONCURRENCY; i++) await client.utils.createSession({ id: `s${i}` });
  // warm both paths
  for (let i = 0; i < 200; i++) {
    await viaClient('s0');
    await viaV1('s0');
  }
  const rows = [];
  for (const [label, workers] of [['sequential', 1], [`${CONCURRENCY} in flight`, CONCURRENCY]]) {
    const [v1Row, apiRow] = await measure(workers, [(w) => viaV1(`s${w}`), (w) => viaClient(`s${w}`)]);
    rows.push([`/v1/exec via fetch, ${label}`, v1Row]);
    rows.push([`/api/execute via SandboxClient, ${label}`, apiRow]);
    rows.push([`ratio /api : /v1, ${label}`, { rps: apiRow.rps / v1Row.rps, p50: apiRow.p50 / v1Row.p50, ratio: true }]);
  }
  console.log('| measurement | req/s | p50 ms | p99 ms | requests |');
  console.log('|---|---|---|---|---|');
  for (const [label, r] of rows) {
    if (r.ratio) console.log(`| ${label} | **${r.rps.toFixed(2)}x** | ${r.p50.toFixed(2)}x | - | - |`);
    else console.log(`| ${label} | ${r.rps.toFixed(0)} | ${r.p50.toFixed(3)} | ${r.p99.toFixed(3)} | ${r.n} |`);
  }
} finally {
  await fetch(server.baseUrl(BOX), { method: 'DELETE', headers: server.headers });
  await server.stop();
}
