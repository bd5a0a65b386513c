#!/usr/bin/env bash
# Quick start 1: builds and runs the demo (a (50, 49, 512) input through
# ScaledDotProductAttention(512, 512, 512, 8)), installing what is missing on Debian 12.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
. "$root/scripts/deps.sh"
sdpa_install_missing g++ make cmake libeigen3-dev
build=${SDPA_BUILD_DIR:-$root/build}
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DSDPA_BUILD_TESTS=OFF -DSDPA_BUILD_EXAMPLES=ON -DSDPA_NATIVE=OFF >/dev/null
cmake --build "$build" --target demo -j "$(nproc)"
"$build/examples/demo"
