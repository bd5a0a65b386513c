// int8 keys' scores on the VNNI instructions (sdpa/simd/vnni.hpp): the bits of the multiply-add kernel they
// replace on the same path, and an error against float64 no larger than the widened float products'.
// Each test names the path it ran and skips where the CPU has no VNNI (the kernels' tests under SDPA_ISA
// cover the other paths).
#include "sdpa/simd/dispatch.hpp"
#include "sdpa/storage.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "support/reference.hpp"

namespace vnni_test {

using Index = Eigen::Index;

#if SDPA_DISPATCH

// n keys of kv heads of d int8 features with their scales, queries of heads x nq x d (query head h reads key
// head h / group), scores of heads x nq rows of lds.
struct Problem {
  Index n, d, kv, heads, nq;
  std::vector<float> keys, scales, q;
  std::vector<std::int8_t> k;
  Problem(sdpa_test::Rng& rng, Index n_, Index d_, Index kv_, Index heads_, Index nq_)
      : n(n_), d(d_), kv(kv_), heads(heads_), nq(nq_), keys(static_cast<std::size_t>(n_ * kv_ * d_)),
        scales(static_cast<std::size_t>(n_ * kv_)), q(static_cast<std::size_t>(heads_ * nq_ * d_)), k(keys.size()) {
    for (float& v : keys) v = static_cast<float>(rng.normal());
    for (float& v : q) v = static_cast<float>(rng.normal());
    for (Index j = 0; j < n; ++j)
      for (Index g = 0; g < kv; ++g) {
        const std::size_t at = static_cast<std::size_t>((j * kv + g) * d);
        scales[static_cast<std::size_t>(j * kv + g)] = sdpa::quantize_int8(keys.data() + at, d, k.data() + at);
      }
  }
  Index lds() const { return n + 3; }
  template <typename Kernel>
  std::vector<float> run(Kernel kernel) const {
    std::vector<float> s(static_cast<std::size_t>(heads * nq * lds()), -1.0f);
    kernel(sdpa::simd::Rows<std::int8_t>{k.data(), kv * d, d, scales.data(), kv}, n,
           sdpa::simd::Queries<float>{q.data(), nq * d, d, heads, heads / kv, nq, d}, sdpa::simd::Scores<float>{s.data(), lds(), 0.125f});
    return s;
  }
  // The exact scores of the unrounded keys and queries, in double.
  double exact(Index h, Index i, Index j) const {
    double x = 0;
    for (Index c = 0; c < d; ++c)
      x += static_cast<double>(q[static_cast<std::size_t>((h * nq + i) * d + c)]) *
           static_cast<double>(keys[static_cast<std::size_t>((j * kv + h / (heads / kv)) * d + c)]);
    return 0.125 * x;
  }
};

struct Pair {
  const char* name;  // the VNNI kernel's instructions
  bool runs;
  using Kernel = void (*)(sdpa::simd::Rows<std::int8_t>, Index, sdpa::simd::Queries<float>, sdpa::simd::Scores<float>) noexcept;
  Kernel vnni;
  Kernel plain;
};

std::vector<Pair> pairs() {
  const sdpa::CpuFeatures& f = sdpa::cpu_features();
  const sdpa::Isa best = sdpa::detail::best_isa_of(f);
  return {{"vpdpwssd zmm (AVX512_VNNI) against vpmaddwd zmm", best >= sdpa::Isa::kAvx512 && f.avx512vnni,
           &sdpa::avx512_vnni::int8_scores<float>, &sdpa::avx512::int8_scores<float>},
          {"vpdpwssd ymm (AVX-VNNI) against vpmaddwd ymm", best >= sdpa::Isa::kAvx2 && f.avx_vnni,
           &sdpa::avx_vnni::int8_scores<float>, &sdpa::avx2::int8_scores<float>}};
}

// f(pair) for each VNNI kernel this CPU runs, named; skips the test when there is none.
template <typename F>
void for_each_pair(F&& f) {
  int ran = 0;
  for (const Pair& p : pairs()) {
    if (!p.runs) continue;
    ++ran;
    std::printf("[ path ] %s\n", p.name);
    SCOPED_TRACE(p.name);
    f(p);
  }
  if (ran == 0) GTEST_SKIP() << "no AVX512_VNNI or AVX-VNNI on this CPU";
}

// Head sizes around the steps (16 / 32 features) and the unrolled sizes, up to the longest int16 query; a
// short last block of keys; one query per head and several; a query with a NaN (the widened fallback).
TEST(Int8Vnni, ProductsGiveTheBitsOfTheMultiplyAddKernel) {
  for_each_pair([](const Pair& p) {
    sdpa_test::Rng rng(7);
    for (Index d : {Index(1), Index(15), Index(16), Index(17), Index(32), Index(48), Index(64), Index(70), Index(128),
                    Index(200), sdpa::kInt16QueryMaxLength})
      for (Index nq : {Index(1), Index(3)})
        for (Index n : {Index(5), Index(37), Index(64)}) {
          Problem pr(rng, n, d, 2, 6, nq);
          if (d == 70 && nq == 3) pr.q[static_cast<std::size_t>(d + 3)] = std::numeric_limits<float>::quiet_NaN();
          const std::vector<float> a = pr.run(p.vnni), b = pr.run(p.plain);
          ASSERT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << "d " << d << " nq " << nq << " n " << n;
        }
  });
}

// The error against float64 of the unrounded keys: the key's rounding to int8 dominates; rounding the query
// to int16 adds at most a hundredth to the widened float products' error.
TEST(Int8Vnni, ErrorIsTheWidenedProductsError) {
  for_each_pair([](const Pair& p) {
    sdpa_test::Rng rng(11);
    for (Index d : {Index(64), Index(128)}) {
      Problem pr(rng, 512, d, 2, 4, 1);
      const std::vector<float> a = pr.run(p.vnni);
      const std::vector<float> w = pr.run(p.vnni == &sdpa::avx512_vnni::int8_scores<float>
                                              ? &sdpa::avx512::widened_chunk_scores<std::int8_t, float>
                                              : &sdpa::avx2::widened_chunk_scores<std::int8_t, float>);
      double err = 0, err_widened = 0;
      for (Index h = 0; h < pr.heads; ++h)
        for (Index j = 0; j < pr.n; ++j) {
          const double x = pr.exact(h, 0, j);
          const std::size_t at = static_cast<std::size_t>(h * pr.lds() + j);
          err = std::max(err, std::fabs(a[at] - x));
          err_widened = std::max(err_widened, std::fabs(w[at] - x));
        }
      EXPECT_GT(err_widened, 0.0);
      EXPECT_LE(err, 1.01 * err_widened) << "d " << d;
    }
  });
}

#endif  // SDPA_DISPATCH

}  // namespace vnni_test
