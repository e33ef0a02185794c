-- The interactive prompt: `moonbox` with no script on a terminal, or
-- `moonbox -i`. Each line (or each complete chunk, with `>>` for more) runs
-- as its own task on the event loop, so `sb:exec(...)` works at the prompt
-- while everything else a line started goes on; results print as
-- `luajit -i` prints them, tables pretty-printed (M.format). Ctrl-C cancels the running line (at the prompt
-- it drops what was typed); Ctrl-D at the prompt ends the session.
-- With libedit (Debian's libedit2, BSD-licensed) the prompt has line
-- editing and history; without it lines are read as the terminal gives them.
local async = require "moonbox.async"
local core = require "moonbox.core"
local errors = require "moonbox.errors"

local M = {}

local function pack(...) return select("#", ...), { ... } end

-- compile(text) -> fn | nil, message, incomplete. An expression first (so
-- `1 + 1` prints 2), then a statement; a chunk that ends too early is
-- incomplete and waits for more lines.
-- (`=expr` as in lua 5.1's prompt too.) fn(pack) -> n, {results}: the
-- expression is evaluated in the chunk's own frame (an argument, not a
-- tail call), so an error in it names `stdin:1:` as it should.
function M.compile(text, env)
  local expr = text:match("^%s*=(.*)$") or text
  local fn = loadstring("local __mb_pack = ...; return __mb_pack(" .. expr .. "\n)", "=stdin")
  if not fn then
    local err
    fn, err = loadstring(text, "=stdin")
    if not fn then
      return nil, err, err:find("<eof>", 1, true) ~= nil
    end
    local statement = fn
    if env then setfenv(statement, env) end
    fn = function(p) return p(statement()) end
  end
  if env then setfenv(fn, env) end
  return fn
end

-- What the prompt prints for a line's results: as `luajit -i` does (each
-- as tostring, tabs between, nothing for none), but a table as a person
-- reads it (moonbox.lib.pretty): a command's result as its exit code,
-- stdout and stderr, other tables as indented literals.
function M.format(n, results)
  if n == 0 then return nil end
  local pretty = require "moonbox.lib.pretty"
  local parts = {}
  for i = 1, n do parts[i] = pretty.format(results[i]) end
  return table.concat(parts, "\t")
end

-- Line reading: libedit through the FFI when it loads, else plain reads
-- of the terminal (or whatever stdin is) through the loop.
local function plain_reader()
  local path = "/dev/stdin"
  local fd = core.open_fd(path, "r")
  if not fd then return nil end
  local stream = core.stream_open(fd)
  if not stream then core.close_fd(fd) return nil end
  local buf, eof, waiting = "", false, nil
  stream:read_start(function(_, data)
    if data then buf = buf .. data else eof = true end
    if waiting and (eof or buf:find("\n", 1, true)) then
      local w = waiting
      waiting = nil
      w()
    end
  end)
  local reader = {}
  -- read(prompt) -> line (without its newline) or nil at EOF
  function reader.read(prompt)
    io.stdout:write(prompt)
    io.stdout:flush()
    while not buf:find("\n", 1, true) and not eof do
      async.await(function(resume)
        waiting = resume
        return function() waiting = nil end
      end, "the prompt")
    end
    local line, rest = buf:match("^([^\n]*)\n(.*)$")
    if line then
      buf = rest
      return line
    end
    if buf ~= "" then
      line, buf = buf, ""
      return line
    end
    return nil
  end
  -- Ctrl-C at the prompt: what was typed goes (the terminal dropped its
  -- line too), a fresh prompt
  function reader.drop(prompt)
    buf = ""
    io.stdout:write("\n", prompt)
    io.stdout:flush()
  end
  function reader.close() stream:close() end
  return reader
end

-- libedit's readline interface, fed by the loop: bytes read from the
-- terminal go to rl_callback_read_char one at a time through
-- rl_getc_function, so nothing blocks and the line's handler hands the line
-- back. nil when libedit is not there (or stdin is no terminal, or TERM is
-- dumb: plain reads then).
local function edit_reader()
  local term = os.getenv("TERM")
  if not term or term == "" or term == "dumb" then return nil end
  local okffi, ffi = pcall(require, "ffi")
  if not okffi then return nil end
  pcall(ffi.cdef, [[
    typedef void mb_rl_vcpfunc_t(char *);
    typedef int mb_rl_getc_t(void *);
    void rl_callback_handler_install(const char *, mb_rl_vcpfunc_t *);
    void rl_callback_read_char(void);
    void rl_callback_handler_remove(void);
    int add_history(const char *);
    int rl_initialize(void);
    extern mb_rl_getc_t *rl_getc_function;
    extern int rl_catch_signals;
    extern int rl_catch_sigwinch;
    int isatty(int);
    void free(void *);
  ]])
  if ffi.C.isatty(0) ~= 1 or ffi.C.isatty(1) ~= 1 then return nil end
  local okload, el = pcall(ffi.load, "edit.so.2")
  if not okload then okload, el = pcall(ffi.load, "edit") end
  if not okload then return nil end
  local fd = core.open_fd("/dev/stdin", "r")
  if not fd then return nil end
  local stream = core.stream_open(fd)
  if not stream then core.close_fd(fd) return nil end
  local queue, qi = "", 1 -- bytes not yet given to libedit: queue from qi
  local lines, eof, waiting = {}, false, nil
  local getc = ffi.cast("mb_rl_getc_t *", function()
    local b = queue:byte(qi)
    if not b then return -1 end
    qi = qi + 1
    return b
  end)
  local on_line = ffi.cast("mb_rl_vcpfunc_t *", function(p)
    if p == nil then
      lines[#lines + 1] = false -- Ctrl-D on an empty line
    else
      local line = ffi.string(p)
      ffi.C.free(p)
      if line:find("%S") then el.add_history(line) end
      lines[#lines + 1] = line
    end
  end)
  -- libedit must leave the loop's signal handlers alone
  el.rl_catch_signals = 0
  el.rl_catch_sigwinch = 0
  el.rl_getc_function = getc
  if el.rl_initialize() ~= 0 then
    stream:close()
    return nil
  end
  local installed = false
  local function wake()
    if waiting and (#lines > 0 or eof) then
      local w = waiting
      waiting = nil
      w()
    end
  end
  stream:read_start(function(_, data)
    if not data then
      eof = true
    elseif installed then
      queue, qi = queue:sub(qi) .. data, 1
      while installed and qi <= #queue and #lines == 0 do el.rl_callback_read_char() end
      if #lines > 0 then
        el.rl_callback_handler_remove()
        installed = false
      end
    else
      -- typed while a line runs: kept for the next prompt
      queue, qi = queue:sub(qi) .. data, 1
    end
    wake()
  end)
  local reader = {}
  local prompt_text
  function reader.read(prompt)
    io.stdout:flush()
    if #lines == 0 and not eof then
      prompt_text = prompt
      el.rl_callback_handler_install(prompt, on_line)
      installed = true
      while installed and qi <= #queue and #lines == 0 do el.rl_callback_read_char() end
      if #lines > 0 and installed then
        el.rl_callback_handler_remove()
        installed = false
      end
      while #lines == 0 and not eof do
        async.await(function(resume)
          waiting = resume
          return function() waiting = nil end
        end, "the prompt")
      end
    end
    if installed then
      el.rl_callback_handler_remove()
      installed = false
    end
    local line = table.remove(lines, 1)
    if line == nil or line == false then return nil end
    return line
  end
  function reader.drop(prompt)
    queue, qi = "", 1
    if installed then
      el.rl_callback_handler_remove()
      io.stdout:write("\n")
      io.stdout:flush()
      el.rl_callback_handler_install(prompt or prompt_text or "> ", on_line)
    end
  end
  local closed = false
  function reader.close()
    if installed then el.rl_callback_handler_remove() installed = false end
    if not closed then
      closed = true
      stream:close()
    end
  end
  -- a signal that ends the runtime at the prompt: the terminal back as it was
  require("moonbox._runtime").at_exit(reader.close)
  return reader
end

function M.main()
  local reader = edit_reader() or plain_reader()
  if not reader then
    io.stderr:write("moonbox: cannot read the prompt's input\n")
    return
  end
  local runtime = require "moonbox._runtime"
  local released = runtime.release_signal("SIGINT")
  local running -- the task of the line that runs
  local pending = nil -- the lines of a chunk not complete yet
  local interrupted = false
  local sigint = core.signal()
  sigint:start("SIGINT", function()
    if running then
      running:cancel()
    else
      interrupted = true
      pending = nil
      reader.drop("> ")
    end
  end)
  sigint:unref()
  local env = _G
  while true do
    local line = reader.read(pending and ">> " or "> ")
    if line == nil then
      io.stdout:write("\n")
      break
    end
    if interrupted then
      interrupted = false
      pending = nil
    end
    local text = pending and (pending .. "\n" .. line) or line
    local fn, err, incomplete = M.compile(text, env)
    if fn then
      pending = nil
      running = async.spawn(fn, pack)
      local ok, n, results = pcall(running.wait, running)
      local cancelled = running.cancelled
      running = nil
      if ok then
        local out = M.format(n, results)
        if out then io.stdout:write(out, "\n") end
      elseif cancelled then
        io.stderr:write("interrupted\n")
      else
        io.stderr:write(errors.format(n), "\n")
      end
      io.stdout:flush()
    elseif incomplete then
      pending = text
    else
      pending = nil
      io.stderr:write(err, "\n")
    end
  end
  sigint:close()
  reader.close()
  -- what the lines started may go on: Ctrl-C stops it all, as for a script
  if released then runtime.reclaim_signal("SIGINT") end
end

return M
