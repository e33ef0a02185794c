#!/bin/sh
# The bash completion the package ships (share/completion/moonbox.bash), in
# bash with Debian's bash-completion: completion-test.sh SOURCE_DIR WORK_DIR
# completes words as a user's Tab would and checks what it offers.
set -eu
src=$(cd "$1" && pwd)
mkdir -p "$2"
work=$(cd "$2" && pwd)
lib=/usr/share/bash-completion/bash_completion
[ -r "$lib" ] || { echo "completion-test: no $lib (apt-get install bash-completion)" >&2; exit 1; }
mkdir -p "$work/dir"
: >"$work/dir/app.lua"
: >"$work/dir/notes.txt"
# complete WORDS...: what completing the last word offers, sorted, one line
cat >"$work/complete.bash" <<'BASH'
source "$1"
source "$2"
cd "$3"
shift 3
COMP_WORDS=("$@")
COMP_CWORD=$((${#COMP_WORDS[@]} - 1))
COMP_LINE="${COMP_WORDS[*]}"
COMP_POINT=${#COMP_LINE}
_moonbox
printf '%s\n' "${COMPREPLY[@]}" | LC_ALL=C sort | tr '\n' ' '
BASH
offered() { bash "$work/complete.bash" "$lib" "$src/share/completion/moonbox.bash" "$work/dir" "$@"; }
check() { # expected, words...
  want=$1
  shift
  got=$(offered "$@")
  [ "$got" = "$want" ] || { echo "completion-test: $* <Tab>: '$got', expected '$want'" >&2; exit 1; }
  echo "$* <Tab>: $got"
}
check "serve " moonbox se
check "app.lua image mcp serve " moonbox ""
check "--policy " moonbox --p
check "--version " moonbox --v
check "app.lua dev strict " moonbox --policy ""
check "--listen " moonbox serve --li
check "off on " moonbox serve --prewarm ""
check "ls pull rm " moonbox image ""
check "--max-body --max-buffered-bytes --max-connections --max-sandboxes " moonbox serve --max
check "serve " moonbox --policy dev se
echo "completion-test: ok"
