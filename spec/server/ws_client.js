// A scripted WebSocket client for the server specs (Node's built-in
// WebSocket: node --experimental-websocket on Node 20, plain on 22).
//   node ws_client.js URL STEPS_JSON
// STEPS: [{"send": "text"}, {"fill": N (a text message of N "m"s)}, {"binary": "bytes"}, {"expect": "regex"}, {"sleep": ms}, {"close": 1000}]
// "expect" waits until the received data (text and binary frames, in
// order, concatenated) matches. Prints one JSON line per event:
// {"open":true}, {"text":..}, {"binary":..}, {"close":code,"reason":..},
// {"error":..}, and {"timeout":step} if an expectation is not met in 10 s.
const [url, stepsJson] = process.argv.slice(2);
const steps = JSON.parse(stepsJson || "[]");
const fs = require("fs");
// synchronous: process.exit() must not cut a large frame short
const out = (o) => fs.writeSync(1, JSON.stringify(o) + "\n");
let received = "";
let waiting = null;
const ws = new WebSocket(url);
ws.binaryType = "arraybuffer";
ws.onmessage = (e) => {
  if (typeof e.data === "string") { out({ text: e.data }); received += e.data; }
  else { const s = Buffer.from(e.data).toString("latin1"); out({ binary: s }); received += s; }
  if (waiting) waiting();
};
ws.onclose = (e) => { out({ close: e.code, reason: e.reason }); if (waiting) waiting(); process.exit(0); };
ws.onerror = (e) => out({ error: String(e.message || e.type) });
ws.onopen = async () => {
  out({ open: true });
  for (const step of steps) {
    if (step.send !== undefined) ws.send(step.send);
    else if (step.fill !== undefined) ws.send("m".repeat(step.fill));
    else if (step.binary !== undefined) ws.send(Buffer.from(step.binary, "latin1"));
    else if (step.close !== undefined) ws.close(step.close);
    else if (step.sleep !== undefined) await new Promise((r) => setTimeout(r, step.sleep));
    else if (step.expect !== undefined) {
      const re = new RegExp(step.expect);
      const timer = setTimeout(() => { out({ timeout: step.expect }); process.exit(1); }, 10000);
      while (!re.test(received) && ws.readyState === WebSocket.OPEN) {
        await new Promise((r) => { waiting = r; });
        waiting = null;
      }
      clearTimeout(timer);
      if (!re.test(received)) { out({ timeout: step.expect }); process.exit(1); }
    }
  }
};
