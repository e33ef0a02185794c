// The page of `moonbox serve`: pick or create a sandbox and session, get its
// terminal over a WebSocket (binary frames: pty bytes; text frames: JSON
// control), and watch the sandbox's background processes.
(function () {
  "use strict";
  const $ = (id) => document.getElementById(id);
  // xterm.js is vendored (share/page/vendor/): should it fail to load all
  // the same, the page says so and still lists the processes
  const term = typeof Terminal === "function"
    ? new Terminal({ cols: 100, rows: 30, cursorBlink: true, convertEol: false }) : null;
  if (term) term.open($("terminal"));
  else {
    $("terminal").className = "unavailable";
    $("terminal").textContent = "The terminal is unavailable: xterm.js did not load " +
      "(/page/xterm.js; it ships in share/moonbox/page/vendor/).";
  }
  const encoder = new TextEncoder();
  let socket = null;

  // The token comes in the URL `moonbox serve` prints (/?token=...): kept
  // for this tab (a reload finds it) and taken out of the address bar; API
  // calls send it as a bearer token, the terminal's WebSocket as access_token.
  (function takeToken() {
    const params = new URLSearchParams(location.search);
    const given = params.get("token") || params.get("access_token");
    if (given) {
      try { sessionStorage.setItem("moonbox-token", given); } catch (e) { /* storage off: this load only */ }
      history.replaceState(null, "", location.pathname);
    }
    let kept = null;
    try { kept = sessionStorage.getItem("moonbox-token"); } catch (e) { kept = null; }
    $("token").value = given || kept || "";
  })();

  function setStatus(text) { $("status").textContent = text; }
  function headers() {
    const h = { "Content-Type": "application/json" };
    if ($("token").value) h.Authorization = "Bearer " + $("token").value;
    return h;
  }
  function api(method, path, body) {
    return fetch("/v1/sandboxes/" + encodeURIComponent($("sandbox").value) + path, {
      method, headers: headers(), body: body === undefined ? undefined : JSON.stringify(body),
    }).then(async (r) => {
      const data = await r.json().catch(() => ({}));
      if (!r.ok) throw new Error((data.code || r.status) + ": " + (data.message || r.statusText));
      return data;
    });
  }

  function connect() {
    if (!term) { setStatus("terminal unavailable"); return; }
    if (socket) { socket.onclose = null; socket.close(); }
    const proto = location.protocol === "https:" ? "wss:" : "ws:";
    let url = proto + "//" + location.host + "/v1/sandboxes/" + encodeURIComponent($("sandbox").value) +
      "/sessions/" + encodeURIComponent($("session").value) + "/terminal?cols=" + term.cols + "&rows=" + term.rows;
    if ($("token").value) url += "&access_token=" + encodeURIComponent($("token").value);
    const ws = new WebSocket(url);
    ws.binaryType = "arraybuffer";
    socket = ws;
    setStatus("connecting");
    ws.onmessage = (e) => {
      if (typeof e.data !== "string") { term.write(new Uint8Array(e.data)); return; }
      const msg = JSON.parse(e.data);
      if (msg.type === "ready") { term.reset(); setStatus("connected: " + $("sandbox").value + "/" + $("session").value); term.focus(); }
      else if (msg.type === "exit") setStatus("shell exited with " + msg.code);
      else if (msg.type === "error") setStatus("error: " + msg.message);
    };
    ws.onclose = (e) => { if (socket === ws) setStatus("disconnected (" + e.code + (e.reason ? " " + e.reason : "") + ")"); };
  }

  if (term) {
    term.onData((data) => { if (socket && socket.readyState === WebSocket.OPEN) socket.send(encoder.encode(data)); });
    term.onResize(({ cols, rows }) => {
      if (socket && socket.readyState === WebSocket.OPEN) socket.send(JSON.stringify({ type: "resize", cols, rows }));
    });
  }

  $("pick").addEventListener("submit", (e) => { e.preventDefault(); connect(); });
  $("create").addEventListener("click", () => {
    api("POST", "/sessions", {})
      .then((s) => { $("session").value = s.id || s.sessionId; connect(); })
      .catch((err) => setStatus(err.message));
  });

  function refreshProcesses() {
    api("GET", "/processes").then((list) => {
      const items = Array.isArray(list) ? list : (list.processes || []);
      const ul = $("processes");
      ul.replaceChildren();
      for (const p of items) {
        const li = document.createElement("li");
        li.textContent = p.id + "  " + p.status + "  " + p.command;
        ul.appendChild(li);
      }
      if (!items.length) { const li = document.createElement("li"); li.className = "none"; li.textContent = "none"; ul.appendChild(li); }
    }).catch(() => {});
  }
  setInterval(refreshProcesses, 2000);
  refreshProcesses();
  connect();
})();
