#!/usr/bin/env bash
# The whole test suite under AddressSanitizer + UndefinedBehaviorSanitizer (any report fails the run),
# then the concurrency tests under ThreadSanitizer. Consumer projects are left to the plain build.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
. "$root/scripts/deps.sh"
sdpa_install_missing g++ make cmake libeigen3-dev libgtest-dev nlohmann-json3-dev
jobs=$(nproc)

build=${SDPA_ASAN_BUILD_DIR:-$root/build-asan}
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSDPA_BUILD_TESTS=ON -DSDPA_BUILD_EXAMPLES=OFF \
  -DSDPA_IO=ON -DSDPA_ONEDNN=OFF -DCMAKE_CXX_FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer" \
  >/dev/null
cmake --build "$build" -j "$jobs"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir "$build" --output-on-failure -j "$jobs" -LE consumer

tsan=${SDPA_TSAN_BUILD_DIR:-$root/build-tsan}
if [ -f "$root/tests/concurrency_test.cpp" ]; then
  cmake -S "$root" -B "$tsan" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSDPA_BUILD_TESTS=ON -DSDPA_BUILD_EXAMPLES=OFF \
    -DSDPA_ONEDNN=OFF -DCMAKE_CXX_FLAGS="-fsanitize=thread -Wno-tsan" >/dev/null
  cmake --build "$tsan" --target concurrency_test -j "$jobs"
  TSAN_OPTIONS=halt_on_error=1 "$tsan/tests/concurrency_test"
fi
