#!/bin/sh
# Run an example and compare its stdout with examples/expected/<name>.txt,
# where each line is a Lua pattern the matching output line must match.
set -eu
bin=$1 example=$2
name=$(basename "$example" .lua)
expected="$(dirname "$example")/expected/$name.txt"
out=$(mktemp)
trap 'rm -f "$out"' EXIT
"$bin" "$example" >"$out"
if [ -f "$expected" ]; then
  "$bin" "$(dirname "$0")/match-lines.lua" "$expected" "$out"
fi
cat "$out"
