// An exposed port in headless Debian chromium (playwright-core): a page
// served by python3's http.server (spec/server/port_app.py) inside a
// sandbox, started with startProcess through /v1, exposed, and loaded
// through the proxy by both URL forms with the token given once as
// ?access_token= (then a cookie). The page's own script fetches a file and
// talks to a WebSocket echo, both by relative URLs through the proxy (the
// host-name form; in the path form the page is sandboxed and cannot).
// Usage: node ports_page_test.js MOONBOX_BIN NODE_MODULES OUT_DIR
const { spawn } = require("child_process");
const fs = require("fs");
const os = require("os");
const path = require("path");
const [bin, modules, outDir] = process.argv.slice(2);
const { chromium } = require(path.join(modules, "playwright-core"));

const TOKEN = "ports-page-token-" + process.pid + "-0123456789";
const PAGE = `<!doctype html><meta charset=utf-8><title>port page</title>
<p id=out>loading</p>
<script>
(async () => {
  const out = document.getElementById("out");
  try {
    const data = (await (await fetch("data.txt")).text()).trim();
    const ws = new WebSocket(new URL("ws", location.href).href.replace(/^http/, "ws"));
    ws.onopen = () => ws.send("ping");
    ws.onmessage = (e) => { out.textContent = "data:" + data + " ws:" + e.data; ws.close(); };
    ws.onerror = () => { out.textContent = "ws error"; };
  } catch (e) { out.textContent = "error " + e; }
})();
</script>`;

function fail(message) { console.error("ports page test: " + message); process.exitCode = 1; }

const { releaseMounts } = require("./release_mounts");

async function main() {
  fs.mkdirSync(outDir, { recursive: true });
  const home = fs.mkdtempSync(path.join(os.tmpdir(), "moonbox-ports-page-"));
  fs.writeFileSync(path.join(home, "token"), TOKEN + "\n", { mode: 0o600 });
  const server = spawn(bin, ["serve", "--listen", "127.0.0.1:0", "--token-file", path.join(home, "token")], {
    env: { PATH: process.env.PATH, HOME: home, MOONBOX_HOME: home }, stdio: ["ignore", "pipe", "inherit"],
  });
  let browser;
  try {
    const url = await new Promise((resolve, reject) => {
      let buf = "";
      server.stdout.on("data", (d) => {
        buf += d;
        const m = buf.match(/listening on (http:\/\/\S+)/);
        if (m) resolve(m[1]);
      });
      server.on("exit", (code) => reject(new Error("moonbox serve exited with " + code)));
    });
    const id = "page-" + process.pid;
    const base = `${url}/v1/sandboxes/${id}`;
    const api = async (method, sub, body) => {
      const r = await fetch(base + sub, { method, headers: { authorization: "Bearer " + TOKEN },
        body: body === undefined ? undefined : JSON.stringify(body) });
      const j = await r.json();
      if (!r.ok) throw new Error(`${method} ${sub}: ${r.status} ${JSON.stringify(j)}`);
      return j;
    };
    const app = fs.readFileSync(path.join(__dirname, "port_app.py"), "utf8");
    await api("POST", "/files/write", { path: "/workspace/app.py", content: app });
    await api("POST", "/files/write", { path: "/workspace/index.html", content: PAGE });
    await api("POST", "/files/write", { path: "/workspace/data.txt", content: "hello-data\n" });
    const port = 8000;
    const proc = await api("POST", "/processes", { command: `exec python3 app.py ${port}`, cwd: "/workspace" });
    await api("POST", `/processes/${proc.id}/wait`, { port, timeout: 20000 });
    const exposed = await api("POST", "/ports", { port, name: "page" });
    browser = await chromium.launch({
      executablePath: "/usr/bin/chromium",
      args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"],
    });
    const pathForm = `${base}/ports/${port}/index.html`;
    // the path form shares the server's origin: its pages get an opaque one
    // (a CSP sandbox), so their scripts cannot read the server's paths with
    // the operator's cookies, their own port's included (docs/server.md)
    const wants = { "host name": "data:hello-data ws:echo:ping", path: "error TypeError: Failed to fetch" };
    for (const [form, pageUrl] of [["host name", exposed.url + "index.html"], ["path", pathForm]]) {
      const want = wants[form];
      const page = await browser.newPage();
      page.on("pageerror", (e) => fail(`${form}: page error: ${e.message}`));
      const resp = await page.goto(pageUrl + "?access_token=" + TOKEN);
      if (!resp || resp.status() !== 200) throw new Error(`${form}: status ${resp && resp.status()}`);
      if (page.url().includes("access_token")) throw new Error(`${form}: the token stayed in the URL ${page.url()}`);
      await page.waitForFunction((w) => document.getElementById("out").textContent === w, want, { timeout: 20000 });
      await page.screenshot({ path: path.join(outDir, `port-${form.replace(" ", "-")}.png`) });
      console.log(`ports page test: ${form} form ${pageUrl}: "${want}"`);
      await page.close();
    }
    // without the token (a fresh browser context: no cookie) the page is refused
    const ctx = await browser.newContext();
    const page = await ctx.newPage();
    const resp = await page.goto(exposed.url + "index.html");
    if (resp.status() !== 401) throw new Error("without the token: status " + resp.status());
    await ctx.close();
    await api("DELETE", "");
  } finally {
    if (browser) await browser.close();
    server.kill("SIGTERM");
    await new Promise((r) => (server.exitCode !== null ? r() : server.on("exit", r)));
    releaseMounts(home);
    fs.rmSync(home, { recursive: true, force: true });
  }
}

main().catch((e) => { fail(e.stack || String(e)); process.exit(1); });
