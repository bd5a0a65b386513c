#!/usr/bin/env bash
# The test suite under AddressSanitizer + UndefinedBehaviorSanitizer (any report fails the run): clang++
# (whose UBSan also checks pointer arithmetic, e.g. an offset applied to a null pointer) over every test
# group and every instruction-set path the CPU has (ctest's quick label, examples aside); then the
# concurrency tests under ThreadSanitizer (g++). g++ builds the same suite without sanitizers in the
# README's test command. (Until 2026-12-04 g++'s ASan ran over every group and clang++'s over the kernels
# only: two instrumented builds. One clang++ build of everything takes about as long on the Zen 3, and
# checks every group with clang++'s UBSan.)
# At -O1 with line tables: the instrumented suite compiles in a fraction of -O2 -g's time and runs about
# as fast. Consumer projects are left to the plain build.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
. "$root/scripts/deps.sh"
sdpa_install_missing g++ make cmake libeigen3-dev libgtest-dev nlohmann-json3-dev clang-14 libclang-rt-14-dev
jobs=$(nproc)
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
flags="-O1 -gline-tables-only -fno-omit-frame-pointer"

# Ninja when installed (CI installs it; sdpa_generator_args in scripts/deps.sh says why).
configure() {  # build dir, C++ compiler, sanitizer flags
  local generator=()
  mapfile -t generator < <(sdpa_generator_args "$1")
  cmake -S "$root" -B "$1" "${generator[@]}" -DCMAKE_BUILD_TYPE=None -DCMAKE_CXX_COMPILER="$2" -DSDPA_BUILD_TESTS=ON \
    -DSDPA_BUILD_EXAMPLES=OFF -DSDPA_IO=ON -DSDPA_ONEDNN=OFF -DSDPA_MPI=OFF -DCMAKE_CXX_FLAGS="$3 $flags" >/dev/null
}

asan="-fsanitize=address,undefined -fno-sanitize-recover=all"
echo "sanitize.sh: ASan + UBSan, clang++-14 (every test group, every path)"
dir=${SDPA_ASAN_BUILD_DIR:-$root/build-asan-clang}
configure "$dir" clang++-14 "$asan"
# (Not the ODR test: it checks what two -march settings link to, which the plain build and QEMU run.)
cmake --build "$dir" -j "$jobs" --target core_tests module_tests concurrency_tests kernel_tests io_tests
ctest --test-dir "$dir" --output-on-failure -j "$jobs" -L quick -E '^odr_test$'

echo "sanitize.sh: TSan, concurrency and parallel_for tests"
dir=${SDPA_TSAN_BUILD_DIR:-$root/build-tsan}
flags="-O1 -g1 -fno-omit-frame-pointer" configure "$dir" g++ "-fsanitize=thread -Wno-tsan"
cmake --build "$dir" --target concurrency_tests -j "$jobs"
TSAN_OPTIONS=halt_on_error=1 "$dir/tests/concurrency_tests" --gtest_brief=1
