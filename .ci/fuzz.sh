#!/usr/bin/env bash
# Builds tests/fuzz/safetensors_fuzzer.cpp with clang++-14 (libFuzzer, AddressSanitizer,
# UndefinedBehaviorSanitizer) and fuzzes sdpa's safetensors reader for a bounded time.
#
#   .ci/fuzz.sh [SECONDS]        (default 60)
#
# Needs clang-14, libfuzzer-14-dev, libclang-rt-14-dev, libeigen3-dev and nlohmann-json3-dev. Works in
# $SDPA_FUZZ_DIR (default build-fuzz/): the binary, the growing corpus (seeded from tests/fuzz/corpus/,
# which is only read) and any crash reproducer (crash-*, leak-*, timeout-*). Exits non-zero on a crash,
# a sanitizer report, a leak or a timeout; replay a reproducer with "$SDPA_FUZZ_DIR/safetensors_fuzzer FILE".
set -euo pipefail

seconds="${1:-60}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="${SDPA_FUZZ_DIR:-$root/build-fuzz}"
. "$root/scripts/deps.sh"
sdpa_install_missing clang-14 libfuzzer-14-dev libclang-rt-14-dev libeigen3-dev nlohmann-json3-dev
cxx="${CXX_FUZZ:-clang++-14}"
mkdir -p "$work/corpus" "$work/artifacts"

echo "fuzz.sh: building $work/safetensors_fuzzer with $cxx"
"$cxx" -std=c++17 -g -O1 -pthread \
  -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer \
  -I"$root/include" -I/usr/include/eigen3 \
  "$root/tests/fuzz/safetensors_fuzzer.cpp" -o "$work/safetensors_fuzzer"

echo "fuzz.sh: fuzzing for ${seconds}s"
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
# -rss_limit_mb: a file that made the reader allocate far beyond its own size would trip this.
"$work/safetensors_fuzzer" "$work/corpus" "$root/tests/fuzz/corpus" \
  -max_total_time="$seconds" -max_len=4096 -timeout=10 -rss_limit_mb=1024 -malloc_limit_mb=256 \
  -artifact_prefix="$work/artifacts/" -print_final_stats=1
echo "fuzz.sh: no crash in ${seconds}s"
