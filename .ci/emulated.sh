#!/usr/bin/env bash
# sdpa on CPUs this machine is not, under QEMU's user-mode emulation (Debian's qemu-user):
#   1. A portable x86-64 build (no -march flag, as distributions build) of the core tests under
#      `qemu-x86_64 -cpu Nehalem` (SSE4.2, no AVX: the portable path) and `-cpu Haswell` (AVX2 + FMA, no
#      AVX-512: the AVX2 path; QEMU 7.2 emulates AVX2): they pass and sdpa::cpu_isa() reports the path the
#      CPU must get (SDPA_EXPECT_ISA), with no illegal instruction.
#   2. The ODR test (tests/odr/): a translation unit built with AVX-512 and one without in one program,
#      run under -cpu Haswell.
#   3. ARM64: a cross build (g++-aarch64-linux-gnu, GoogleTest built from Debian's sources) of the module,
#      parity-fixture, options, decoding and backward tests, run under qemu-aarch64.
# Emulation is 10-50 times slower than the host, so the runs take subsets (gtest filters below).
#
#   bash .ci/emulated.sh           work dirs under $SDPA_EMULATED_DIR (default build-emulated/)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
. "$root/scripts/deps.sh"
sdpa_install_missing g++ make cmake libeigen3-dev libgtest-dev qemu-user g++-aarch64-linux-gnu libc6-dev-arm64-cross
work=${SDPA_EMULATED_DIR:-$root/build-emulated}
jobs=$(nproc)
mkdir -p "$work"

# 1. The portable x86-64 build: the README's test build (scripts/test.sh builds without -march) when
# SDPA_EMULATED_X86_BUILD names it, as CI does; otherwise a build of its own.
x86=${SDPA_EMULATED_X86_BUILD:-$work/x86-64}
if [ -z "${SDPA_EMULATED_X86_BUILD:-}" ]; then
  cmake -S "$root" -B "$x86" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-O2 -DNDEBUG" -DSDPA_BUILD_TESTS=ON -DSDPA_BUILD_EXAMPLES=OFF \
    -DSDPA_IO=OFF -DSDPA_ONEDNN=OFF -DSDPA_NATIVE=OFF >/dev/null
fi
grep -q '^SDPA_NATIVE:BOOL=OFF' "$x86/CMakeCache.txt" || { echo "emulated.sh: $x86 is not a build without -march" >&2; exit 2; }
cmake --build "$x86" -j "$jobs" --target core_tests module_tests kernel_tests odr_test
# What each emulated CPU runs: the choice of path and the kernels' tests on it (gemm, softmax and Philox
# rows, the module with every option, decoding). QEMU runs AVX2 code 10-20 times slower than SSE code, so
# under Haswell the sweeps that add sizes, not code paths, are left to the native runs of the AVX2 path
# (the README's test command runs every test with SDPA_ISA=avx2): the bias GEMM sweep, the block-boundary
# lengths, the init statistics, the longest cache sequences.
core_filter='CpuIsa*:Simd*:DropoutSampler*:LinearTest*:GemmTest/*.AttentionTilePattern:GemmTest/*.NtBias*'
module_filter='ModuleTest*:OptionsTest*:ParityFixtures*'
cache_filter='KVCacheTest/0.*:TiledTest/0.ShapesAroundTinyBlockBoundaries'
haswell_skip='*NtBias*:*BlockBoundaryLengths*:*InitWeightsStatistics*:*WideHeadsSteps*:*TwoThreadsGiveTheSameSteps*:*StepsWithRoomAllocateNothing*'
# Each emulated process runs on one core: the jobs below run side by side (the two x86 CPU models while the
# ARM64 build compiles, then the two ARM64 programs), each one's output printed when it is done.
jobs_pids=()
jobs_logs=()
trap 'kill "${jobs_pids[@]}" 2>/dev/null || true' EXIT
jobs_names=()
start_job() {  # name, log file, command... (a shell function runs in a subshell, under set -e)
  jobs_names+=("$1")
  jobs_logs+=("$2")
  shift 2
  "$@" >"${jobs_logs[-1]}" 2>&1 &
  jobs_pids+=($!)
}
wait_jobs() {  # waits for every started job, prints its output; fails when one failed
  local i failed=0
  for i in "${!jobs_pids[@]}"; do
    if ! wait "${jobs_pids[$i]}"; then
      failed=1
      echo "emulated.sh: FAILED: ${jobs_names[$i]} (its output follows)"
    fi
    cat "${jobs_logs[$i]}"
  done
  jobs_pids=()
  jobs_logs=()
  jobs_names=()
  return $failed
}
run_x86() {  # CPU model, the path it must get
  local model=$1 path=$2 skip='*DemoShape*'
  [ "$model" = Haswell ] && skip="$skip:$haswell_skip"
  echo "emulated.sh: x86-64 -cpu $model (expects the $path path)"
  export SDPA_EXPECT_ISA=$path
  qemu-x86_64 -cpu "$model" "$x86/tests/core_tests" --gtest_brief=1 --gtest_filter="$core_filter:-$skip"
  qemu-x86_64 -cpu "$model" "$x86/tests/module_tests" --gtest_brief=1 --gtest_filter="$module_filter:-$skip"
  qemu-x86_64 -cpu "$model" "$x86/tests/kernel_tests" --gtest_brief=1 --gtest_filter="$cache_filter:-$skip"
  unset SDPA_EXPECT_ISA
  if [ "$model" = Haswell ]; then
    echo "emulated.sh: the ODR test under -cpu Haswell"
    qemu-x86_64 -cpu Haswell "$x86/tests/odr_test" avx2
  fi
}
start_job "x86-64 -cpu Nehalem" "$work/x86-nehalem.log" run_x86 Nehalem portable
start_job "x86-64 -cpu Haswell" "$work/x86-haswell.log" run_x86 Haswell avx2

# 3. ARM64.
arm="$work/aarch64"
gtest="$work/gtest-aarch64"
if [ ! -f "$gtest/.complete" ]; then
  echo "emulated.sh: building GoogleTest for aarch64 from /usr/src/googletest"
  cmake -S /usr/src/googletest -B "$work/gtest-build-aarch64" -DCMAKE_TOOLCHAIN_FILE="$root/cmake/aarch64-linux-gnu.cmake" \
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$gtest" -DBUILD_GMOCK=OFF >/dev/null
  cmake --build "$work/gtest-build-aarch64" -j "$jobs" >/dev/null
  cmake --install "$work/gtest-build-aarch64" >/dev/null
  touch "$gtest/.complete"
fi
mapfile -t arm_generator < <(sdpa_generator_args "$arm")
cmake -S "$root" -B "$arm" "${arm_generator[@]}" -DCMAKE_TOOLCHAIN_FILE="$root/cmake/aarch64-linux-gnu.cmake" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-O2 -DNDEBUG" \
  -DGTest_DIR="$gtest/lib/cmake/GTest" -DSDPA_BUILD_TESTS=ON -DSDPA_BUILD_EXAMPLES=OFF -DSDPA_IO=OFF \
  -DSDPA_ONEDNN=OFF >/dev/null
cmake --build "$arm" -j "$jobs" --target module_tests kernel_tests
wait_jobs
echo "emulated.sh: ARM64 under qemu-aarch64"
export QEMU_LD_PREFIX=/usr/aarch64-linux-gnu
export SDPA_EXPECT_ISA=portable
start_job "ARM64 module_tests" "$work/arm64-module.log" qemu-aarch64 "$arm/tests/module_tests" --gtest_brief=1 \
  --gtest_filter="$module_filter:TrainingTest*:-*DemoShape*"
start_job "ARM64 kernel_tests" "$work/arm64-kernel.log" qemu-aarch64 "$arm/tests/kernel_tests" --gtest_brief=1 \
  --gtest_filter='KVCacheTest*:BackwardTest/0.*'
wait_jobs
echo "emulated.sh: all passed"
