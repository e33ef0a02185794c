#!/bin/sh
# Set up and run every test: install missing packages, build, run the specs,
# examples and luacheck under CTest, then the same specs in the ASan/UBSan build,
# then the fuzz targets (clang, libFuzzer; MOONBOX_SKIP_FUZZ=1 leaves them out).
set -eu
cd "$(dirname "$0")/.."
./scripts/install-deps.sh test
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j"$(nproc)"
status=0
ctest --test-dir build --output-on-failure -j2 || status=$?
if [ "${MOONBOX_SKIP_SANITIZE:-0}" != 1 ]; then
  cmake -S . -B build-asan -DMOONBOX_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug >/dev/null
  cmake --build build-asan -j"$(nproc)"
  ctest --test-dir build-asan --output-on-failure -j2 -R '^spec\.' || status=$?
fi
# the libFuzzer targets (spec/fuzz/, docs/testing.md): 60 s each, ASan+UBSan
if [ "${MOONBOX_SKIP_FUZZ:-0}" != 1 ]; then
  cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DMOONBOX_FUZZ=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build build-fuzz -j"$(nproc)" --target fuzz
  ctest --test-dir build-fuzz --output-on-failure -j2 -L '^fuzz$' || status=$?
  for d in build-fuzz/fuzz/*/; do
    if [ -f "$d/stats.txt" ]; then
      echo "fuzz.$(basename "$d"): $(sed -n 's/^stat::average_exec_per_sec: *//p' "$d/stats.txt") exec/s"
    fi
  done
fi
exit $status
