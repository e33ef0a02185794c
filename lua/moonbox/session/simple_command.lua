-- Which command bodies are a plain external command: one line of words
-- that bash would split exactly at blanks and run as they are. Such a body
-- is run by the shell's __mb_run builtin without forking the shell
-- (src/bash/spawn_builtin.c); the shell still decides, from its own state,
-- whether the first word is a file or an alias, function or builtin.
local M = {}

-- Characters that are never special to bash's parser or expansions in the
-- middle of a word: no quoting, $, `, globs, braces, ~, #, !, operators.
local WORD = "^[%w_%./:,+@%%=-]+$"
local MAX_BYTES = 2048

-- bash 5.2's reserved words and builtins (`compgen -k`, `compgen -b`): bash
-- would not fork for them, so they take the ordinary path at once.
local NOT_EXTERNAL = {}
for w in ([[if then else elif fi case esac for select while until do done in function time coproc
  . : alias bg bind break builtin caller cd command compgen complete compopt continue declare dirs
  disown echo enable eval exec exit export false fc fg getopts hash help history jobs kill let local
  logout mapfile popd printf pushd pwd read readarray readonly return set shift shopt source suspend
  test times trap true type typeset ulimit umask unalias unset wait]]):gmatch("%S+") do
  NOT_EXTERNAL[w] = true
end

-- words(body) -> the body's words, or nil when it is anything but a plain
-- external command line.
function M.words(body)
  if #body > MAX_BYTES then return nil end
  local line = body:match("^[ \t]*(.-)[ \t]*\n?$")
  if not line or line == "" or line:find("\n", 1, true) then return nil end
  -- the first word first: most bodies that are not plain commands are told
  -- by it, before anything is made (a table of words, an iterator)
  local first = line:match("^[^ \t]+")
  -- an assignment (A=1 cmd), a job spec (%1), an option-looking name
  if first:find("=", 1, true) or first:find("^[%%-]") or NOT_EXTERNAL[first] then return nil end
  local words, at = {}, 1
  while true do
    local s, e = line:find("[^ \t]+", at)
    if not s then break end
    local w = line:sub(s, e)
    if not w:find(WORD) then return nil end
    words[#words + 1] = w
    at = e + 1
  end
  return words
end

return M
