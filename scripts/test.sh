#!/usr/bin/env bash
# Quick start 2: builds the tests and examples and runs the `quick` label with ctest: every unit test once
# per instruction-set path this CPU runs (AVX-512, AVX2, portable), the PyTorch parity fixtures, the
# examples. Built at -O2 without -march, as distributions build (sdpa picks its kernels at run time), so that the
# same binaries also run on other CPUs (.ci/emulated.sh). Installs what is missing on Debian 12. (The consumer projects and -Werror builds are the
# `consumers` label, which CI runs: ctest --test-dir build -L consumers.)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
. "$root/scripts/deps.sh"
sdpa_install_missing g++ make cmake ninja-build libeigen3-dev libgtest-dev nlohmann-json3-dev libdnnl-dev
build=${SDPA_BUILD_DIR:-$root/build}
mapfile -t generator < <(sdpa_generator_args "$build")
cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DSDPA_BUILD_TESTS=ON -DSDPA_BUILD_EXAMPLES=ON \
  -DSDPA_IO=ON -DSDPA_ONEDNN=ON -DSDPA_NATIVE=OFF -DCMAKE_CXX_FLAGS_RELEASE="-O2 -DNDEBUG" ${SDPA_CMAKE_ARGS:-} >/dev/null
cmake --build "$build" -j "$(nproc)"
ctest --test-dir "$build" --output-on-failure -j "$(nproc)" -L quick
