// The ODR test: this translation unit is compiled without any -march flag and runs sdpa's module, its
// decoding step and its products, linked after odr_avx512.cpp, which uses the same functions compiled with
// AVX-512. Run under `qemu-x86_64 -cpu Haswell` (AVX2, no AVX-512; .ci/emulated.sh) it must not meet an
// AVX-512 instruction: each baseline has its own copies of sdpa's inline functions (sdpa/config.hpp), and
// the kernels chosen at run time (sdpa/cpu.hpp) run the AVX2 path. Prints the path and a checksum; exits
// non-zero when the path is not the one expected (argv[1], if given) or the results are not finite.
#include <sdpa/sdpa.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

float odr_avx512_forward();

int main(int argc, char** argv) {
  sdpa::ScaledDotProductAttention<float> att(32, 8, 8, 4, 0.0f);
  att.eval();
  Eigen::Tensor<float, 3, Eigen::RowMajor> x(2, 5, 32);
  std::fill_n(x.data(), x.size(), 0.5f);  // not Eigen's setConstant: this file tests sdpa's functions, not Eigen's
  sdpa::KVCache<float> cache(att, 2, 8);
  const auto y = att.step(x, cache);
  double sum = 0;
  for (Eigen::Index i = 0; i < y.size(); ++i) sum += double(y.data()[i]);
  const auto z = att(x, x, x);
  for (Eigen::Index i = 0; i < z.size(); ++i) sum += double(z.data()[i]);
  // The AVX-512 translation unit's copies, only where they can run.
  if (sdpa::best_isa() == sdpa::Isa::kAvx512) sum += double(odr_avx512_forward()) * 0.0;
  std::printf("odr: path %s, checksum %.6f\n", sdpa::cpu_isa(), sum);
  if (argc > 1 && std::strcmp(argv[1], sdpa::cpu_isa()) != 0) {
    std::printf("odr: expected the %s path\n", argv[1]);
    return 1;
  }
  return std::isfinite(sum) ? 0 : 1;
}
