-- doc-blocks.lua DOC.md [--serve]: run every code block of a Markdown
-- document and compare what each command prints with what the document shows.
-- Run by the moonbox executable (CTest doc.tutorial, doc.http_api):
--   moonbox spec/doc-blocks.lua docs/tutorial.md
--   moonbox spec/doc-blocks.lua docs/http-api.md --serve
--
-- The blocks, in order:
-- - ```lua whose first line is `-- NAME.lua`: written to NAME.lua in the
--   work directory (the commands' cwd), for a later `$ moonbox NAME.lua`;
-- - ```sh with `$ ` lines: each `$ ` line (with `\` continuations) is a
--   command, the lines below it up to the next `$ ` what it prints (stdout
--   and stderr together, as on a terminal; trailing empty lines ignored);
-- - ```sh without `$ ` lines: every line but `#` comments is a command whose
--   output is not shown.
-- All commands run in one bash, in order (variables, `cd` and background
-- jobs carry over), with `moonbox` (this build's) first on PATH and a fresh
-- HOME and MOONBOX_HOME under a temporary work directory removed at the end.
-- A command must exit 0, and every HTTP request curl makes in a command
-- whose output is not shown must answer below 400; a shown output must match.
--
-- What the document shows is matched line by line with spec/match-lines.lua:
-- the text is literal except `...`, which stands for anything: inside a
-- line any text, on a line of its own any run of lines. A line holding JSON
-- (after an optional prefix such as `data: `) also matches a JSON line with
-- the same members in another order; there `...` as a value is any value,
-- as a member (`{"a":1,...}`) any further members, as the last element of
-- an array any further elements.
-- Every `8080` in commands and shown output stands for the port of the test's
-- server: a free one.
--
-- Directives, an HTML comment on its own line before a block (not rendered):
--   <!-- doc-test: setup CMD -->   run CMD first (not shown; must exit 0)
--   <!-- doc-test: skip REASON --> do not run the block; the test prints REASON
-- --serve: before the blocks, start `moonbox serve` on a free port with a
-- token file, and set B=http://127.0.0.1:PORT/v1/sandboxes/demo; every curl
-- then sends the token (the document leaves it out, as docs/http-api.md says).
local cjson = require "cjson"

local script_dir = arg[0]:match("^(.*)/[^/]*$") or "."
local matcher = assert(loadfile(script_dir .. "/match-lines.lua"))("--module")

local doc_path, serve_mode = arg[1], false
for i = 2, #arg do
  if arg[i] == "--serve" then serve_mode = true else error("unknown argument " .. arg[i]) end
end
assert(doc_path, "usage: moonbox spec/doc-blocks.lua DOC.md [--serve]")
local bin = os.getenv("MOONBOX_BIN") or arg[-1]
assert(bin and bin ~= "", "MOONBOX_BIN is not set")

local function sh_quote(s) return "'" .. s:gsub("'", "'\\''") .. "'" end
local function run(cmd)
  local ok, how, code = os.execute(cmd)
  if type(ok) == "number" then return ok == 0, ok end -- Lua 5.1 os.execute
  return ok == true, code or how
end
local function read(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("*a")
  f:close()
  return s
end
local function write(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end
local function capture(cmd)
  local p = assert(io.popen(cmd))
  local s = p:read("*a")
  p:close()
  return s
end
local function split_lines(s)
  local t = {}
  for l in (s .. "\n"):gmatch("(.-)\n") do t[#t + 1] = l end
  while #t > 0 and t[#t] == "" do t[#t] = nil end
  return t
end

-- The document: blocks with their directives
local blocks, pending = {}, { setup = {} }
do
  local lineno, fence, indent, body, info, start = 0, nil, nil, nil, nil, nil
  for line in io.lines(doc_path) do
    lineno = lineno + 1
    if fence then
      if line:match("^%s*```%s*$") then
        blocks[#blocks + 1] = { lang = info, lines = body, line = start,
          skip = pending.skip, setup = pending.setup }
        pending = { setup = {} }
        fence = nil
      else
        body[#body + 1] = line:sub(1, #indent) == indent and line:sub(#indent + 1) or line
      end
    else
      local ind, lang = line:match("^(%s*)```(%S*)%s*$")
      if ind then
        fence, indent, body, info, start = true, ind, {}, lang, lineno
      else
        local kind, rest = line:match("^%s*<!%-%- doc%-test: (%a+) (.-) %-%->%s*$")
        if kind == "setup" then
          table.insert(pending.setup, rest)
        elseif kind == "skip" then
          pending.skip = rest
        elseif kind then
          error(("%s:%d: unknown doc-test directive %q"):format(doc_path, lineno, kind))
        end
      end
    end
  end
  assert(not fence, doc_path .. ": a code block is not closed")
end

-- Commands: { text, want = {lines} or nil, hidden = bool, line }
local commands, files, skipped = {}, {}, {}
for _, b in ipairs(blocks) do
  local where = ("%s:%d"):format(doc_path, b.line)
  if b.skip then
    skipped[#skipped + 1] = where .. ": " .. b.skip
  elseif b.lang == "lua" then
    local name = (b.lines[1] or ""):match("^%-%- ([%w_%-]+%.lua)")
    if not name then error(where .. ": a Lua block must start with `-- NAME.lua` (or be skipped)") end
    if files[name] then error(where .. ": " .. name .. " is written twice") end
    files[name] = table.concat(b.lines, "\n") .. "\n"
  elseif b.lang == "sh" then
    for _, s in ipairs(b.setup) do
      commands[#commands + 1] = { text = s, hidden = true, line = where .. " (setup)" }
    end
    local prompted = false
    for _, l in ipairs(b.lines) do if l:match("^%$ ") then prompted = true end end
    local cur, continuing = nil, false
    for i, l in ipairs(b.lines) do
      local at = ("%s:%d"):format(doc_path, b.line + i)
      if continuing then
        cur.text = cur.text .. "\n" .. l
        continuing = l:match("\\$") ~= nil
      elseif prompted and l:match("^%$ ") then
        cur = { text = l:sub(3), want = {}, line = at }
        commands[#commands + 1] = cur
        continuing = l:match("\\$") ~= nil
      elseif prompted then
        if not cur then error(at .. ": output before the first `$ ` command") end
        table.insert(cur.want, l)
      elseif l:match("%S") and not l:match("^%s*#") then
        cur = { text = l, line = at }
        commands[#commands + 1] = cur
        continuing = l:match("\\$") ~= nil
      end
    end
    for _, c in ipairs(commands) do
      if c.want then
        while #c.want > 0 and c.want[#c.want] == "" do c.want[#c.want] = nil end
        if #c.want == 0 then c.want = nil end
      end
    end
  else
    error(("%s: a ```%s block: only lua and sh blocks run (skip it with a reason)"):format(where, b.lang))
  end
end

-- The work directory
local work = capture("mktemp -d /tmp/moonbox-doc-XXXXXX"):gsub("%s+$", "")
assert(work:match("^/tmp/moonbox%-doc%-"), "mktemp failed")
local out = work .. "/.out"
assert(run("mkdir -p " .. sh_quote(out) .. " " .. sh_quote(work .. "/home") .. " " .. sh_quote(work .. "/bin")))
assert(run("ln -s " .. sh_quote(bin) .. " " .. sh_quote(work .. "/bin/moonbox")))
for name, text in pairs(files) do write(work .. "/" .. name, text) end

local env = ("export HOME=%s MOONBOX_HOME=%s PATH=%s:\"$PATH\"; unset XDG_DATA_HOME; cd %s")
  :format(sh_quote(work .. "/home"), sh_quote(work .. "/home/moonbox"), sh_quote(work .. "/bin"), sh_quote(work))

local serve_pid, port, token
local function cleanup()
  if serve_pid then
    run(("kill %s 2>/dev/null; while kill -0 %s 2>/dev/null; do sleep 0.1; done"):format(serve_pid, serve_pid))
  end
  -- as root a stopped server or script leaves its sandboxes' disk images
  -- mounted on their roots (sandbox/disk.lua, for a restart): unmounted
  -- first, deepest first, so no loop device outlives the run
  run(("awk '{print $5}' /proc/self/mountinfo | grep '^%s/' | sort -r | " ..
    "while read -r m; do umount \"$m\" 2>/dev/null || umount -l \"$m\"; done"):format(work))
  run("rm -rf " .. sh_quote(work))
end

-- everything from here on runs with the work directory (and the server)
-- made, which cleanup() removes whatever happens
local function body()
  if serve_mode then
    token = capture("od -An -tx1 -N16 /dev/urandom | tr -d ' \\n'")
    write(work .. "/.token", token .. "\n")
    serve_pid = capture(("%s; (setsid moonbox serve --listen 127.0.0.1:0 --token-file %s --access-log off " ..
      "</dev/null >%s 2>&1 & echo $!)"):format(env, sh_quote(work .. "/.token"), sh_quote(work .. "/.serve.log")))
      :gsub("%s+$", "")
    -- wait until it says where it listens (or has died)
    for _ = 1, 600 do
      local log = read(work .. "/.serve.log") or ""
      port = log:match("moonbox: listening on http://127%.0%.0%.1:(%d+)")
      if port or not run("kill -0 " .. serve_pid .. " 2>/dev/null") then break end
      run("sleep 0.1")
    end
    if not port then
      error("doc-blocks: moonbox serve did not start:\n" .. (read(work .. "/.serve.log") or ""), 0)
    end
  else
    port = capture("python3 -c 'import socket; s = socket.socket(); s.bind((\"127.0.0.1\", 0)); " ..
      "print(s.getsockname()[1])'"):gsub("%s+$", "")
    assert(port:match("^%d+$"), "no free port")
  end

  local function subst(s) return (s:gsub("8080", port)) end

  -- One bash for every command; each command's output, exit status and the
  -- HTTP statuses of its curl requests go to files under .out/
  local script = { env }
  if serve_mode then
    table.insert(script, ("B=http://127.0.0.1:%s/v1/sandboxes/demo; MB_TOKEN=%s"):format(port, token))
    table.insert(script, [[curl() { command curl -H "Authorization: Bearer $MB_TOKEN" ]] ..
      [[-w '%{stderr}HTTP %{http_code}\n' "$@" 2>>"$MB_STATUS"; }]])
  else
    table.insert(script, [[curl() { command curl -w '%{stderr}HTTP %{http_code}\n' "$@" 2>>"$MB_STATUS"; }]])
  end
  table.insert(script, "trap 'kill $(jobs -p) 2>/dev/null; wait' EXIT")
  for i, c in ipairs(commands) do
    table.insert(script, ("echo %d >%s/current; MB_STATUS=%s/%d.status; : >\"$MB_STATUS\""):format(i, out, out, i))
    table.insert(script, ("{ %s\n} >%s/%d 2>&1 </dev/null; echo $? >%s/%d.rc"):format(subst(c.text), out, i, out, i))
  end
  write(work .. "/.script.sh", table.concat(script, "\n") .. "\n")

  run("timeout -k 10 900 bash " .. sh_quote(work .. "/.script.sh"))

  -- Compare
  local lit_pattern = function(s)
    return (s:gsub("[%^%$%(%)%%%.%[%]%*%+%-%?]", "%%%0"):gsub("%%%.%%%.%%%.", ".-"))
  end
  local ANY, MORE = "\1ANY", "\1MORE"
  -- JSON text with `...` placeholders to plain JSON (placeholders as sentinels)
  local function unellipsis(s)
    local o, stack, i, in_str, last = {}, {}, 1, false, nil
    while i <= #s do
      local ch = s:sub(i, i)
      if in_str then
        o[#o + 1] = ch
        if ch == "\\" then o[#o + 1] = s:sub(i + 1, i + 1); i = i + 1
        elseif ch == '"' then in_str = false; last = '"' end
      elseif s:sub(i, i + 2) == "..." then
        if stack[#stack] == "{" and (last == "{" or last == ",") then
          o[#o + 1] = '"\\u0001MORE":true'
        else
          o[#o + 1] = '"\\u0001ANY"'
        end
        last = '"'
        i = i + 2
      else
        o[#o + 1] = ch
        if ch == '"' then in_str = true
        elseif ch == "{" or ch == "[" then stack[#stack + 1] = ch
        elseif ch == "}" or ch == "]" then stack[#stack] = nil end
        if ch:match("%S") then last = ch end
      end
      i = i + 1
    end
    return table.concat(o)
  end
  local function jeq(w, g)
    if w == ANY then return g ~= nil end
    if type(w) == "string" then
      if type(g) ~= "string" then return false end
      if w:find("...", 1, true) then return g:match("^" .. lit_pattern(w) .. "$") ~= nil end
      return w == g
    end
    if type(w) ~= "table" then return w == g end
    if type(g) ~= "table" then return false end
    if #w > 0 or next(w) == nil then -- an array (or an empty one)
      for i = 1, #w do
        if w[i] == ANY and i == #w then return #g >= i - 1 end
        if not jeq(w[i], g[i]) then return false end
      end
      return #g == #w and (#w > 0 or next(g) == nil)
    end
    for k, v in pairs(w) do
      if k ~= MORE and not jeq(v, g[k]) then return false end
    end
    if w[MORE] == nil then
      for k in pairs(g) do if w[k] == nil then return false end end
    end
    return true
  end
  local function line_eq(w, g)
    if g:match("^" .. lit_pattern(w) .. "$") then return true end
    local p = w:find("[{%[]")
    if not p or g:sub(1, p - 1) ~= w:sub(1, p - 1) then return false end
    local okw, jw = pcall(cjson.decode, unellipsis(w:sub(p)))
    local okg, jg = pcall(cjson.decode, g:sub(p))
    return okw and okg and jeq(jw, jg)
  end

  local failures, shown = 0, 0
  local current = tonumber(read(out .. "/current") or "")
  for i, c in ipairs(commands) do
    local got = read(out .. "/" .. i)
    local rc = tonumber(read(out .. "/" .. i .. ".rc") or "")
    local problem
    if not got or not rc then
      problem = (i == current) and "did not finish (the test's time ran out)" or "did not run"
    elseif rc ~= 0 then
      problem = "exit status " .. rc
    elseif c.want then
      local want = {}
      for k, l in ipairs(c.want) do want[k] = l == "..." and matcher.GAP or subst(l) end
      local ok, msg = matcher.match(want, split_lines(got), line_eq)
      if not ok then problem = "output does not match: " .. msg end
    else
      for status in (read(out .. "/" .. i .. ".status") or ""):gmatch("HTTP (%d+)") do
        if tonumber(status) >= 400 or status == "000" then problem = "HTTP status " .. status end
      end
    end
    if c.want then shown = shown + 1 end
    local head = c.text:gsub("\n.*", " ...")
    if problem then
      failures = failures + 1
      io.write(("FAIL %s: %s\n  %s\n"):format(c.line, head, problem))
      io.write("  it printed:\n    " .. (got or ""):gsub("\n$", ""):gsub("\n", "\n    ") .. "\n")
    else
      io.write(("ok   %s: %s\n"):format(c.line, head))
    end
  end
  for _, s in ipairs(skipped) do io.write("not run " .. s .. "\n") end
  if serve_mode and failures > 0 then
    io.write("moonbox serve's log:\n" .. (read(work .. "/.serve.log") or "") .. "\n")
  end
  return failures, shown
end
local ok, failures, shown = pcall(body)
cleanup()
if not ok then error(failures, 0) end
local nfiles = 0
for _ in pairs(files) do nfiles = nfiles + 1 end
if failures > 0 then
  io.write(("doc-blocks: %s: %d of %d commands failed\n"):format(doc_path, failures, #commands))
  os.exit(1)
end
io.write(("doc-blocks: %s: ok, %d commands (%d with their output compared), %d Lua files, %d blocks not run\n")
  :format(doc_path, #commands, shown, nfiles, #skipped))
