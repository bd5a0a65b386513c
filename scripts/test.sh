#!/usr/bin/env bash
# Quick start 2: builds and runs every test (unit tests, PyTorch parity fixtures, examples, consumer
# projects, the -Werror header check with g++ and clang++), installing what is missing on Debian 12.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
. "$root/scripts/deps.sh"
sdpa_install_missing g++ make cmake libeigen3-dev libgtest-dev nlohmann-json3-dev libdnnl-dev clang
build=${SDPA_BUILD_DIR:-$root/build}
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DSDPA_BUILD_TESTS=ON -DSDPA_BUILD_EXAMPLES=ON \
  -DSDPA_IO=ON -DSDPA_ONEDNN=ON -DSDPA_NATIVE=ON ${SDPA_CMAKE_ARGS:-} >/dev/null
cmake --build "$build" -j "$(nproc)"
ctest --test-dir "$build" --output-on-failure -j "$(nproc)"
