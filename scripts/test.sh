#!/bin/sh
# Set up and run every test: install missing packages, build, run the specs,
# examples and luacheck under CTest, then the same specs in the ASan/UBSan build.
set -eu
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j"$(nproc)"
status=0
ctest --test-dir build --output-on-failure -j2 || status=$?
if [ "${MOONBOX_SKIP_SANITIZE:-0}" != 1 ]; then
  cmake -S . -B build-asan -DMOONBOX_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug >/dev/null
  cmake --build build-asan -j"$(nproc)"
  ctest --test-dir build-asan --output-on-failure -j2 -R '^spec\.' || status=$?
fi
exit $status
