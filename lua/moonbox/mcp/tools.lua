-- The MCP server's tools: name, description, inputSchema (JSON Schema) and
-- a handler over the Lua API. A handler gets (ctx, args) with args already
-- checked against its schema (moonbox.mcp.schema) and returns
-- {text = ..., structured = ..., isError?, content?}; an error it raises
-- (an errors table) becomes a tool result with isError (moonbox.mcp.session).
-- ctx:sandbox(args) is the sandbox a call works on: the one its `sandbox`
-- argument names, or the MCP session's own.
local V = require "moonbox.lib.validate"
local errors = require "moonbox.errors"
local json = require "moonbox.server.api_json"
local api_errors = require "moonbox.server.api_errors"

local M = {}

-- Output of run_command kept per stream (the rest is counted and dropped
-- by exec), and its default timeout: an agent's command must end.
M.MAX_OUTPUT_BYTES = 100000
M.DEFAULT_TIMEOUT_MS = 120000

local SANDBOX = { type = "string", minLength = 1,
  description = "a named sandbox (made with create_sandbox); without it, this MCP session's own sandbox" }
local ENV = { type = "object", additionalProperties = { type = "string" },
  description = "environment variables for this call only" }
local CWD = { type = "string", minLength = 1, description = "working directory (default /workspace)" }
local PATH = { type = "string", minLength = 1, description = "a path in the sandbox; relative to /workspace" }

local function object(properties, required)
  return { type = "object", properties = properties, required = required and json.array(required) or nil,
    additionalProperties = false }
end

-- texts joined one after another, each on lines of its own
local function join(parts)
  local out = {}
  for _, p in ipairs(parts) do
    if #out > 0 and not out[#out]:find("\n$") then out[#out] = out[#out] .. "\n" end
    out[#out + 1] = p
  end
  return table.concat(out)
end

-- a command's output as one text: stdout, then stderr under a heading, then
-- the notes (truncation, timeout, exit code)
local function command_text(r, timeout)
  local parts = {}
  if r.stdout ~= "" then parts[#parts + 1] = r.stdout end
  if r.stderr ~= "" then parts[#parts + 1] = "[stderr]\n" .. r.stderr end
  if r.truncated then
    parts[#parts + 1] = ("[output truncated: only the first %d bytes of each stream are kept]"):format(
      M.MAX_OUTPUT_BYTES)
  end
  if r.timedOut then parts[#parts + 1] = ("[timed out: the command was killed after %d ms]"):format(timeout) end
  parts[#parts + 1] = ("[exit code %d]"):format(r.exitCode)
  return join(parts)
end

local function process_info(p)
  return { id = p.id, pid = p.pid, command = p.command, status = p.status, startTime = p.startTime,
    endTime = p.endTime, exitCode = p.exitCode }
end

local function lines_of(list)
  local out = {}
  for i, s in ipairs(list or {}) do out[i] = s end
  return table.concat(out)
end

M.list = {
  {
    name = "run_command",
    description = "Run a shell command (bash) in the sandbox and return its output and exit code. " ..
      "The MCP session's shell keeps its working directory and exported variables between calls. " ..
      "Output past " .. M.MAX_OUTPUT_BYTES .. " bytes per stream is cut off with a note.",
    inputSchema = object({
      command = { type = "string", minLength = 1, description = "the command line" },
      timeout = { type = "integer", minimum = 1, description = "milliseconds before the command's whole " ..
        "process tree is killed (default " .. M.DEFAULT_TIMEOUT_MS .. ")" },
      cwd = CWD, env = ENV, sandbox = SANDBOX,
    }, { "command" }),
    handler = function(ctx, args)
      local sb = ctx:sandbox(args)
      local timeout = args.timeout or M.DEFAULT_TIMEOUT_MS
      local r = sb:exec(args.command, { timeout = timeout, cwd = args.cwd, env = args.env,
        maxOutputBytes = M.MAX_OUTPUT_BYTES })
      local structured = { exitCode = r.exitCode, stdout = r.stdout, stderr = r.stderr, timedOut = r.timedOut,
        truncated = r.truncated == true, durationMs = math.floor(r.duration + 0.5) }
      if r.timedOut then
        structured.code = "TIMEOUT"
        return { isError = true, text = "TIMEOUT: " .. command_text(r, timeout), structured = structured }
      end
      return { text = command_text(r, timeout), structured = structured }
    end,
  },
  {
    name = "start_process",
    description = "Start a background process (a shell command) in the sandbox; read its output with " ..
      "get_process_logs, end it with kill_process.",
    inputSchema = object({
      command = { type = "string", minLength = 1, description = "the command line" },
      processId = { type = "string", minLength = 1, description = "an id for it (default generated)" },
      cwd = CWD, env = ENV, sandbox = SANDBOX,
    }, { "command" }),
    handler = function(ctx, args)
      local p = ctx:sandbox(args):startProcess(args.command, { processId = args.processId, cwd = args.cwd,
        env = args.env })
      local info = process_info(p)
      return { text = ("started process %s (pid %s)"):format(p.id, tostring(p.pid)), structured = info }
    end,
  },
  {
    name = "list_processes",
    description = "List the sandbox's background processes with their status and exit code.",
    inputSchema = object({ sandbox = SANDBOX }),
    handler = function(ctx, args)
      local list, lines = json.array(), {}
      for i, p in ipairs(ctx:sandbox(args):listProcesses()) do
        list[i] = process_info(p)
        lines[i] = ("%s\t%s\t%s%s"):format(p.id, p.status, p.command,
          p.exitCode ~= nil and ("\t(exit code %d)"):format(p.exitCode) or "")
      end
      return { text = #lines > 0 and table.concat(lines, "\n") or "no processes",
        structured = { processes = list } }
    end,
  },
  {
    name = "kill_process",
    description = "Kill a background process and its whole process tree (SIGTERM, then SIGKILL after a " ..
      "grace period; or only the signal given).",
    inputSchema = object({
      processId = { type = "string", minLength = 1 },
      signal = { type = "string", minLength = 1, description = "a signal name such as SIGKILL (default: " ..
        "SIGTERM, then SIGKILL)" },
      sandbox = SANDBOX,
    }, { "processId" }),
    handler = function(ctx, args)
      local sb = ctx:sandbox(args)
      sb:killProcess(args.processId, args.signal)
      local p = sb:getProcess(args.processId)
      local info = p and process_info(p) or { id = args.processId }
      return { text = ("process %s: %s"):format(args.processId, tostring(info.status or "signalled")),
        structured = info }
    end,
  },
  {
    name = "get_process_logs",
    description = "Read what a background process wrote to stdout and stderr so far (the newest bytes " ..
      "when its logs outgrew their bound).",
    inputSchema = object({ processId = { type = "string", minLength = 1 }, sandbox = SANDBOX }, { "processId" }),
    handler = function(ctx, args)
      local sb = ctx:sandbox(args)
      local logs = sb:getProcessLogs(args.processId)
      local p = sb:getProcess(args.processId)
      local parts = {}
      if logs.stdout ~= "" then parts[#parts + 1] = logs.stdout end
      if logs.stderr ~= "" then parts[#parts + 1] = "[stderr]\n" .. logs.stderr end
      if logs.truncated then parts[#parts + 1] = "[older output was dropped: only the newest bytes are kept]" end
      return { text = #parts > 0 and join(parts) or "(no output yet)",
        structured = { processId = args.processId, stdout = logs.stdout, stderr = logs.stderr,
          truncated = logs.truncated == true, status = p and p.status, exitCode = p and p.exitCode } }
    end,
  },
  {
    name = "read_file",
    description = "Read a file from the sandbox. Text comes back as is; binary content as base64.",
    inputSchema = object({ path = PATH,
      encoding = { type = "string", enum = { "utf-8", "base64" }, description = "force an encoding" },
      sandbox = SANDBOX }, { "path" }),
    handler = function(ctx, args)
      local r = ctx:sandbox(args):readFile(args.path, { encoding = args.encoding })
      local structured = { path = r.path, content = r.content, encoding = r.encoding, isBinary = r.isBinary,
        mimeType = r.mimeType, size = r.size }
      if r.encoding == "base64" then
        return { text = ("[%s, %d bytes, base64]\n%s"):format(tostring(r.mimeType), r.size, r.content),
          structured = structured }
      end
      return { text = r.content, structured = structured }
    end,
  },
  {
    name = "write_file",
    description = "Write a file in the sandbox (replacing it); its directory must exist.",
    inputSchema = object({ path = PATH, content = { type = "string" },
      encoding = { type = "string", enum = { "utf-8", "base64" }, description = "of content (default utf-8)" },
      sandbox = SANDBOX }, { "path", "content" }),
    handler = function(ctx, args)
      local r = ctx:sandbox(args):writeFile(args.path, args.content, { encoding = args.encoding })
      return { text = "wrote " .. r.path, structured = { path = r.path, success = true } }
    end,
  },
  {
    name = "list_files",
    description = "List a directory of the sandbox (dot-files only with includeHidden).",
    inputSchema = object({ path = PATH, recursive = { type = "boolean" }, includeHidden = { type = "boolean" },
      sandbox = SANDBOX }, { "path" }),
    handler = function(ctx, args)
      local r = ctx:sandbox(args):listFiles(args.path, { recursive = args.recursive,
        includeHidden = args.includeHidden })
      local files, lines = json.array(), {}
      for i, f in ipairs(r.files) do
        local name = args.recursive and f.relativePath or f.name
        files[i] = { name = name, type = f.type, size = f.size }
        lines[i] = name .. (f.type == "directory" and "/" or "")
      end
      table.sort(lines)
      return { text = #lines > 0 and table.concat(lines, "\n") or "(empty directory)",
        structured = { path = r.path, files = files, count = r.count } }
    end,
  },
  {
    name = "delete_file",
    description = "Delete a file of the sandbox (not a directory).",
    inputSchema = object({ path = PATH, sandbox = SANDBOX }, { "path" }),
    handler = function(ctx, args)
      local r = ctx:sandbox(args):deleteFile(args.path)
      return { text = "deleted " .. r.path, structured = { path = r.path, success = true } }
    end,
  },
  {
    name = "create_code_context",
    description = "Start a code interpreter context (its variables persist between run_code calls).",
    inputSchema = object({
      language = { type = "string", enum = { "python", "javascript", "typescript", "lua" } },
      cwd = CWD, sandbox = SANDBOX,
    }, { "language" }),
    handler = function(ctx, args)
      local c = ctx:sandbox(args):createCodeContext { language = args.language, cwd = args.cwd }
      return { text = ("context %s (%s)"):format(c.id, c.language),
        structured = { id = c.id, language = c.language, cwd = c.cwd } }
    end,
  },
  {
    name = "run_code",
    description = "Run code in a persistent interpreter: in the context given, or in the default context " ..
      "of the language. The value of a final expression is returned as a result.",
    inputSchema = object({
      code = { type = "string", minLength = 1 },
      language = { type = "string", enum = { "python", "javascript", "typescript", "lua" },
        description = "default python (ignored with context)" },
      context = { type = "string", minLength = 1, description = "a context id from create_code_context" },
      timeout = { type = "integer", minimum = 1, description = "milliseconds (default " ..
        M.DEFAULT_TIMEOUT_MS .. ")" },
      sandbox = SANDBOX,
    }, { "code" }),
    handler = function(ctx, args)
      local sb = ctx:sandbox(args)
      local r = sb:runCode(args.code, { context = args.context, timeout = args.timeout or M.DEFAULT_TIMEOUT_MS,
        language = args.context == nil and (args.language or "python") or nil })
      local stdout, stderr = lines_of(r.logs and r.logs.stdout), lines_of(r.logs and r.logs.stderr)
      local results, texts, images = json.array(), {}, {}
      for i, res in ipairs(r.results or {}) do
        results[i] = { text = res.text, json = res.json, html = res.html, markdown = res.markdown }
        if res.text then texts[#texts + 1] = res.text end
        for _, kind in ipairs { "png", "jpeg" } do
          if res[kind] then images[#images + 1] = { type = "image", data = res[kind], mimeType = "image/" .. kind } end
        end
      end
      local parts = {}
      if stdout ~= "" then parts[#parts + 1] = stdout end
      if stderr ~= "" then parts[#parts + 1] = "[stderr]\n" .. stderr end
      for _, t in ipairs(texts) do parts[#parts + 1] = t end
      local structured = { stdout = stdout, stderr = stderr, results = results, executionCount = r.executionCount }
      if r.error then
        structured.error = { name = r.error.name, message = r.error.message, traceback = r.error.traceback }
        parts[#parts + 1] = ("%s: %s"):format(tostring(r.error.name), tostring(r.error.message))
      end
      return { isError = r.error ~= nil, text = join(parts), structured = structured,
        images = images }
    end,
  },
  {
    name = "expose_port",
    description = "Expose a port a server in the sandbox listens on through `moonbox serve`'s proxy; " ..
      "returns its URL.",
    inputSchema = object({ port = { type = "integer", minimum = 1, maximum = 65535 },
      name = { type = "string", minLength = 1 }, sandbox = SANDBOX }, { "port" }),
    handler = function(ctx, args)
      local sb = ctx:sandbox(args)
      local r = sb:exposePort(args.port, { name = args.name })
      return { text = r.url, structured = { url = r.url, port = r.port, name = r.name,
        path = ("/v1/sandboxes/%s/ports/%d/"):format(sb.id, r.port) } }
    end,
  },
  {
    name = "create_sandbox",
    description = "Create (or open) a named sandbox that outlives this MCP session; pass its name as " ..
      "`sandbox` to the other tools.",
    inputSchema = object({ sandbox = { type = "string", minLength = 1,
      description = "its name: 1-63 characters a-z 0-9 _ -, not starting or ending with -" } }, { "sandbox" }),
    handler = function(ctx, args)
      V.sandbox_id(args.sandbox, "sandbox")
      local sb = ctx:make_sandbox(args.sandbox)
      local info = sb:info()
      return { text = ("sandbox %s (isolation %s)"):format(sb.id, tostring(info.isolation)),
        structured = { id = sb.id, isolation = info.isolation } }
    end,
  },
  {
    name = "destroy_sandbox",
    description = "Destroy a named sandbox (its processes and files), or without `sandbox` this MCP " ..
      "session's own (a fresh one is made on next use).",
    inputSchema = object({ sandbox = SANDBOX }),
    handler = function(ctx, args)
      local id = ctx:destroy_sandbox(args.sandbox)
      return { text = "destroyed sandbox " .. id, structured = { id = id, success = true } }
    end,
  },
}

M.by_name = {}
for _, t in ipairs(M.list) do M.by_name[t.name] = t end

-- Hints for clients (MCP tool annotations): which tools only read, and
-- which only add (every other may destroy: a command can do anything in
-- its sandbox; a client may ask before running those).
local READ_ONLY = { list_processes = true, get_process_logs = true, read_file = true, list_files = true }
local ADDITIVE = { create_sandbox = true, create_code_context = true, expose_port = true }

-- The tools/list entries (what a client sees).
function M.definitions()
  local out = json.array()
  for i, t in ipairs(M.list) do
    out[i] = { name = t.name, description = t.description, inputSchema = t.inputSchema,
      annotations = { readOnlyHint = READ_ONLY[t.name] == true,
        destructiveHint = not (READ_ONLY[t.name] or ADDITIVE[t.name]) } }
  end
  return out
end

-- An error raised by a handler as a tool result.
function M.error_result(err)
  if not errors.is_error(err) then
    io.stderr:write("moonbox mcp: internal error: ", errors.format(err), "\n")
    err = errors.new(api_errors.INTERNAL, "internal error")
  end
  local body = { code = err.code, message = err.message, context = err.context or {} }
  return { isError = true, content = json.array { { type = "text", text = err.code .. ": " .. tostring(err.message) } },
    structuredContent = body }
end

-- A handler's return value as a CallToolResult.
function M.result(r)
  local content = json.array { { type = "text", text = r.text or "" } }
  for _, img in ipairs(r.images or {}) do content[#content + 1] = img end
  return { content = content, structuredContent = r.structured, isError = r.isError == true }
end

return M
