#!/usr/bin/env bash
# Compile-time cost of sdpa: compiling examples/demo.cpp (which includes <sdpa/sdpa.hpp>) versus a file that
# only includes <unsupported/Eigen/CXX11/Tensor> and has an empty main, both with exactly the compile
# command CMake gives the demo (Release: -O3 -DNDEBUG, C++17, the include directories and warning flags of
# the examples), compile only (-c, no link). Each is compiled RUNS times (default 3); the minimum counts.
# Prints one line per file and finally "ratio: X" (demo / Tensor-only; target <= 6).
#
# usage: bench/compile_time.sh [RUNS]      (env: CXX to pick the compiler, SDPA_CMAKE_ARGS for extra
#                                             configure arguments)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
runs=${1:-3}
work=$(mktemp -d "${TMPDIR:-/tmp}/sdpa_compile_time.XXXXXX")
trap 'rm -rf "$work"' EXIT

# A throwaway configure, only to obtain the demo's real compile command.
cmake -S "$root" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_EXPORT_COMPILE_COMMANDS=ON \
  -DSDPA_BUILD_EXAMPLES=ON -DSDPA_BUILD_TESTS=OFF -DSDPA_BUILD_BENCHMARKS=OFF -DSDPA_INSTALL=OFF \
  ${SDPA_CMAKE_ARGS:-} >"$work/configure.log" 2>&1 || { cat "$work/configure.log" >&2; exit 1; }

cat >"$work/tensor_only.cpp" <<'EOF'
#include <unsupported/Eigen/CXX11/Tensor>
int main() { return 0; }
EOF

# Prints the demo's compile command (from compile_commands.json) with its source and object replaced.
command_for() {  # $1 = source, $2 = object
  python3 - "$work/build/compile_commands.json" "$root/examples/demo.cpp" "$1" "$2" <<'EOF'
import json, shlex, sys
db, demo, src, obj = sys.argv[1:5]
entry = next(e for e in json.load(open(db)) if e["file"].endswith("examples/demo.cpp"))
args = entry["arguments"] if "arguments" in entry else shlex.split(entry["command"])
out = []
skip = False
for a in args:
    if skip:
        out.append(obj); skip = False; continue
    if a == "-o":
        out.append(a); skip = True; continue
    out.append(src if a in (entry["file"], demo) else a)
print(entry["directory"])
print(shlex.join(out))
EOF
}

# Minimum wall time in seconds over $runs compilations, into $best; prints the runs.
time_compile() {  # $1 = label, $2 = source
  local spec dir cmd t0 t1 t all=()
  best=""
  spec=$(command_for "$2" "$work/$1.o")
  dir=$(sed -n 1p <<<"$spec")
  cmd=$(sed -n 2p <<<"$spec")
  for ((i = 0; i < runs; i++)); do
    t0=$(date +%s%N)
    (cd "$dir" && eval "$cmd")
    t1=$(date +%s%N)
    t=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.3f", (b - a) / 1e9 }')
    all+=("$t")
    if [ -z "$best" ] || awk -v x="$t" -v y="$best" 'BEGIN { exit !(x < y) }'; then best=$t; fi
  done
  echo "$1: min ${best} s (runs: ${all[*]})"
}

echo "command: $(sed -n 2p <<<"$(command_for "$root/examples/demo.cpp" "$work/demo.o")")"
time_compile demo.cpp "$root/examples/demo.cpp"
demo=$best
time_compile tensor_only.cpp "$work/tensor_only.cpp"
base=$best
awk -v a="$demo" -v b="$base" 'BEGIN { printf "ratio: %.2f\n", a / b }'
