// The page of `moonbox serve` in headless Debian chromium (playwright-core),
// opened at the URL with the token that moonbox serve prints: the terminal
// connects, `echo hi` typed into it prints hi, and a screenshot is kept;
// should xterm.js fail to load, the page says the terminal is unavailable.
// Usage: node page_test.js MOONBOX_BIN NODE_MODULES OUT_DIR
const { spawn } = require("child_process");
const fs = require("fs");
const os = require("os");
const path = require("path");
const [bin, modules, outDir] = process.argv.slice(2);
const { chromium } = require(path.join(modules, "playwright-core"));

function fail(message) { console.error("page test: " + message); process.exitCode = 1; }

const { releaseMounts } = require("./release_mounts");

async function main() {
  fs.mkdirSync(outDir, { recursive: true });
  const home = fs.mkdtempSync(path.join(os.tmpdir(), "moonbox-page-"));
  const server = spawn(bin, ["serve", "--listen", "127.0.0.1:0"], {
    env: { PATH: process.env.PATH, HOME: home, MOONBOX_HOME: home }, stdio: ["ignore", "pipe", "inherit"],
  });
  const url = await new Promise((resolve, reject) => {
    let buf = "";
    server.stdout.on("data", (d) => {
      buf += d;
      // the page's URL with the token, as `moonbox serve` prints it
      const m = buf.match(/moonbox: open (http:\/\/\S+\/\?token=[0-9a-f]+)/);
      if (m) resolve(m[1]);
    });
    server.on("exit", (code) => reject(new Error("moonbox serve exited with " + code)));
  });
  const browser = await chromium.launch({
    executablePath: "/usr/bin/chromium",
    args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
      "--disable-component-update", "--disable-sync"],
  });
  try {
    const page = await browser.newPage({ viewport: { width: 1200, height: 700 } });
    page.on("pageerror", (e) => fail("page error: " + e.message));
    await page.goto(url);
    await page.waitForFunction(() => document.getElementById("status").textContent.startsWith("connected"),
      null, { timeout: 20000 });
    await page.click("#terminal");
    await page.keyboard.type("echo hi");
    await page.keyboard.press("Enter");
    // a row of the terminal that is exactly "hi": the command's output, not its echo
    await page.waitForFunction(() => {
      const rows = document.querySelector(".xterm-rows");
      return rows && [...rows.children].some((r) => r.textContent.trim() === "hi");
    }, null, { timeout: 20000 });
    await page.screenshot({ path: path.join(outDir, "terminal.png") });
    console.log("page test: typed `echo hi`, saw hi; screenshot " + path.join(outDir, "terminal.png"));

    // xterm.js failing to load (a proxy dropping it, a broken install): the page says the
    // terminal is unavailable instead of failing, and still lists processes
    const bare = await browser.newPage();
    bare.on("pageerror", (e) => fail("page error without xterm.js: " + e.message));
    await bare.route("**/page/xterm.js", (route) => route.fulfill({ status: 404, body: "" }));
    await bare.goto(url);
    await bare.waitForFunction(() => document.getElementById("status").textContent === "terminal unavailable",
      null, { timeout: 20000 });
    const said = await bare.textContent("#terminal");
    if (!said.startsWith("The terminal is unavailable")) fail("without xterm.js the page says: " + said);
    await bare.waitForFunction(() => document.querySelector("#processes li") !== null, null, { timeout: 20000 });
    console.log("page test: without xterm.js the page says the terminal is unavailable");
  } finally {
    await browser.close();
    server.kill("SIGTERM");
    await new Promise((r) => server.on("exit", r));
    releaseMounts(home);
    fs.rmSync(home, { recursive: true, force: true });
  }
}

main().catch((e) => { fail(e.stack || String(e)); process.exit(1); });
