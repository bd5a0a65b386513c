#!/usr/bin/env bash
# The whole test suite under AddressSanitizer + UndefinedBehaviorSanitizer (any report fails the run), built
# with g++ and again with clang++ (whose UBSan also checks pointer arithmetic, e.g. an offset applied to a
# null pointer), then the concurrency tests under ThreadSanitizer. Consumer projects are left to the plain
# build.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
. "$root/scripts/deps.sh"
sdpa_install_missing g++ make cmake libeigen3-dev libgtest-dev nlohmann-json3-dev clang-14 libclang-rt-14-dev
jobs=$(nproc)
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

asan_suite() {  # build dir, C++ compiler, [targets...] (default: every test)
  local dir=$1 cxx=$2
  shift 2
  cmake -S "$root" -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER="$cxx" -DSDPA_BUILD_TESTS=ON \
    -DSDPA_BUILD_EXAMPLES=OFF -DSDPA_IO=ON -DSDPA_ONEDNN=OFF \
    -DCMAKE_CXX_FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer" >/dev/null
  if [ $# -eq 0 ]; then
    cmake --build "$dir" -j "$jobs"
    ctest --test-dir "$dir" --output-on-failure -j "$jobs" -LE consumer -E "^compile_fail_"
  else
    cmake --build "$dir" -j "$jobs" --target "$@"
    local t
    for t in "$@"; do "$dir/tests/$t"; done
  fi
}
echo "sanitize.sh: ASan + UBSan, g++ (every test)"
asan_suite "${SDPA_ASAN_BUILD_DIR:-$root/build-asan}" g++
# clang's UBSan checks pointer arithmetic that g++'s does not (an offset applied to a null pointer): the
# tests that drive the module, its kernels and the weight files run under it too (the whole suite twice
# would not fit CI's time on two cores).
echo "sanitize.sh: ASan + UBSan, clang++-14 (module, kernels, cache, training, weight files)"
asan_suite "${SDPA_ASAN_CLANG_BUILD_DIR:-$root/build-asan-clang}" clang++-14 module_test options_test kv_cache_test \
  training_test tiled_test backward_test parallel_test safetensors_test

tsan=${SDPA_TSAN_BUILD_DIR:-$root/build-tsan}
echo "sanitize.sh: TSan, concurrency and parallel_for tests"
cmake -S "$root" -B "$tsan" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSDPA_BUILD_TESTS=ON -DSDPA_BUILD_EXAMPLES=OFF \
  -DSDPA_ONEDNN=OFF -DCMAKE_CXX_FLAGS="-fsanitize=thread -Wno-tsan" >/dev/null
cmake --build "$tsan" --target concurrency_test parallel_test -j "$jobs"
TSAN_OPTIONS=halt_on_error=1 "$tsan/tests/concurrency_test"
TSAN_OPTIONS=halt_on_error=1 "$tsan/tests/parallel_test"
