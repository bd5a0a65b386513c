// The ODR test's AVX-512 translation unit, compiled with -mavx512f -mavx512bw -mavx512dq -mavx512vl -mfma (and
// linked first, so that the linker meets its copies of every inline function first): it uses the same
// sdpa functions as odr_main.cpp. Its baseline gives its copies of sdpa another ABI namespace
// (sdpa/config.hpp), so none of them can stand in for the generic translation unit's. It is called only on
// a CPU with AVX-512.
#include <sdpa/sdpa.hpp>

#if !defined(__AVX512F__)
#error "odr_avx512.cpp must be compiled with AVX-512 enabled"
#endif

float odr_avx512_forward() {
  sdpa::ScaledDotProductAttention<float> att(32, 8, 8, 4, 0.0f);
  att.eval();
  Eigen::Tensor<float, 3, Eigen::RowMajor> x(2, 5, 32);
  std::fill_n(x.data(), x.size(), 0.5f);  // not Eigen's setConstant: this file tests sdpa's functions, not Eigen's
  sdpa::KVCache<float> cache(att, 2, 8);
  const auto y = att.step(x, cache);
  return y(1, 4, 31) + att(x, x, x)(0, 0, 0);
}
