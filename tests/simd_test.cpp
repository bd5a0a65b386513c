// Tests of sdpa/cpu.hpp and the per-ISA row kernels of sdpa/simd/: the run-time choice (what cpu_isa()
// reports, set_cpu_isa and its refusals), and, on every path this CPU runs (forced in turn), the softmax
// exponent against std::exp to within a few ulp (masked -inf exactly 0, NaN kept, overflow to inf) and its
// bounded pass (where it stops), the row max, dot products, weighted row sums and the decoding step's chunk
// scores against double loops, and Philox words against the scalar bijection, bit for bit on every path.
#include "sdpa/cpu.hpp"
#include "sdpa/random.hpp"
#include "sdpa/simd/dispatch.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace simd_test {

using Index = Eigen::Index;
using sdpa::Isa;

// The paths this CPU runs, lowest first.
std::vector<Isa> paths() {
  std::vector<Isa> out;
  for (int i = 0; i <= static_cast<int>(sdpa::best_isa()); ++i) out.push_back(static_cast<Isa>(i));
  return out;
}

// Restores the process-wide choice when a test that forces paths ends.
struct RestoreIsa {
  Isa saved = sdpa::active_isa();
  ~RestoreIsa() { sdpa::set_cpu_isa(saved); }
};

// How many representable floats (or doubles) lie between a and b (both finite, same sign).
template <typename T>
double ulps(T a, T b) {
  if (a == b) return 0;
  return std::abs(double(a) - double(b)) / double(std::nextafter(std::abs(b), std::numeric_limits<T>::infinity()) - std::abs(b));
}

TEST(CpuIsa, ReportsAPathTheCpuRuns) {
  const std::string name = sdpa::cpu_isa();
  EXPECT_TRUE(name == "avx512" || name == "avx2" || name == "portable") << name;
  EXPECT_LE(sdpa::active_isa(), sdpa::best_isa());
  const sdpa::CpuFeatures& f = sdpa::cpu_features();
  if (sdpa::best_isa() == Isa::kAvx512) {
    EXPECT_TRUE(f.avx512f && f.avx512bw && f.avx512dq && f.avx512vl && f.avx2);
  }
  if (sdpa::best_isa() >= Isa::kAvx2) {
    EXPECT_TRUE(f.avx2 && f.fma && f.f16c);
  }
  // The environment's choice, when the test runs under one (ctest runs the suite once per path), and the
  // path an emulated CPU must get (.ci/emulated.sh: portable on Nehalem, avx2 on Haswell).
  if (const char* env = std::getenv("SDPA_ISA")) {
    if (std::strcmp(env, "auto") != 0) {
      EXPECT_EQ(name, env);
    }
  }
  if (const char* expect = std::getenv("SDPA_EXPECT_ISA")) {
    EXPECT_EQ(name, expect);
  }
}

TEST(CpuIsa, SetCpuIsaForcesLowerPathsAndRefusesHigherOnes) {
  RestoreIsa restore;
  for (Isa isa : paths()) {
    sdpa::set_cpu_isa(isa);
    EXPECT_EQ(sdpa::active_isa(), isa);
    sdpa::set_cpu_isa(std::string(sdpa::isa_name(isa)));
    EXPECT_STREQ(sdpa::cpu_isa(), sdpa::isa_name(isa));
  }
  sdpa::set_cpu_isa("auto");
  EXPECT_EQ(sdpa::active_isa(), sdpa::best_isa());
  try {
    sdpa::set_cpu_isa("sse9");
    FAIL() << "an unknown path was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("set_cpu_isa: name must be auto, portable"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("\"sse9\""), std::string::npos) << e.what();
  }
  if (sdpa::best_isa() < Isa::kAvx512) {
    EXPECT_THROW(sdpa::set_cpu_isa(Isa::kAvx512), std::invalid_argument);
    EXPECT_THROW(sdpa::set_cpu_isa("avx512"), std::invalid_argument);
  }
  EXPECT_EQ(sdpa::active_isa(), sdpa::best_isa()) << "a refused choice changed the path";
}

// The exponent pass on every path: every length up to a few vectors (masked tails), arguments from 0 down
// past the float range, masked -inf (exactly 0), NaN (stays NaN), arguments above the shift up to and past
// where exp overflows.
template <typename T>
void check_exp(Isa isa, double max_ulps) {
  const auto where = ::testing::Message() << "isa " << sdpa::isa_name(isa);
  std::mt19937 gen(77);
  std::uniform_real_distribution<double> spread(-120.0, 0.0), near(-3.0, 0.0);
  const T shift = T(3.5);
  for (Index n = 1; n <= 70; ++n) {
    std::vector<T> x(static_cast<std::size_t>(n));
    for (Index j = 0; j < n; ++j) {
      T v = T(j % 2 == 0 ? near(gen) : spread(gen)) + shift;
      if (j % 7 == 3) v = -std::numeric_limits<T>::infinity();
      if (j % 11 == 5) v = shift;  // exp(0)
      x[static_cast<std::size_t>(j)] = v;
    }
    std::vector<T> got = x;
    const T got_sum = sdpa::simd::exp_shifted_sum(isa, got.data(), n, shift);
    double sum = 0;
    for (std::size_t j = 0; j < x.size(); ++j) {
      const T want = T(std::exp(double(x[j]) - double(shift)));
      sum += double(want);
      if (std::isinf(x[j])) {
        EXPECT_EQ(got[j], T(0)) << where << " n " << n << " j " << j;
      } else if (double(want) >= double(std::numeric_limits<T>::min())) {
        EXPECT_LE(ulps(got[j], want), max_ulps) << where << " x " << x[j] << " got " << got[j] << " want " << want;
      } else {
        // Below the normal range (exp(-87.3) and less in float) a kernel may flush to 0.
        EXPECT_LE(double(got[j]), double(std::numeric_limits<T>::min())) << where;
      }
    }
    EXPECT_NEAR(double(got_sum), sum, 8 * std::numeric_limits<T>::epsilon() * sum) << where << " n " << n;
  }
  T nan_row[3] = {shift, std::numeric_limits<T>::quiet_NaN(), shift - 1};
  EXPECT_TRUE(std::isnan(sdpa::simd::exp_shifted_sum(isa, nan_row, 3, shift))) << where;
  EXPECT_TRUE(std::isnan(nan_row[1])) << where;
  std::uniform_real_distribution<double> above(0.0, 88.0);
  std::vector<T> big(37);
  for (std::size_t j = 0; j < big.size(); ++j) big[j] = T(above(gen)) + shift;
  big[3] = shift + T(1e-6);
  const std::vector<T> big_in = big;
  sdpa::simd::exp_shifted_sum(isa, big.data(), Index(big.size()), shift);
  for (std::size_t j = 0; j < big.size(); ++j) {
    const T want = T(std::exp(double(big_in[j]) - double(shift)));
    EXPECT_LE(ulps(big[j], want), max_ulps) << where << " x " << big_in[j];
  }
  // (46243800: where a float exp that reduces the argument without bounding it first gave -inf.)
  const T huge = std::numeric_limits<T>::max();
  T overflow[5] = {T(89), T(46243800), huge, std::numeric_limits<T>::infinity(), T(0)};
  EXPECT_EQ(sdpa::simd::exp_shifted_sum(isa, overflow, 5, T(0)), std::numeric_limits<T>::infinity()) << where;
  if (std::is_same<T, float>::value) {  // double's exp overflows only from 709.8
    for (int j = 0; j < 4; ++j) EXPECT_EQ(overflow[j], std::numeric_limits<T>::infinity()) << where << " j " << j;
  }
  EXPECT_EQ(overflow[4], T(1)) << where;
}

TEST(SimdExp, WithinAFewUlpOfStdExpOnEveryPath) {
  for (Isa isa : paths()) {
    check_exp<float>(isa, 2.0);
    check_exp<double>(isa, 2.0);
  }
}

// The bounded exponent pass (the online softmax's lazy reference) on every path: rows of every length up to
// a few vectors, scores between far below the shift and the limit (kLag = 16 above it, where the pass takes
// no clamp), hidden -inf, and one score above the limit by a little or by far more than exp's range at each
// position. The pass stops before that score, at most a group of 32 earlier (each path checks 32, 16 or 8
// scores at a time), leaves the rest untouched, and what it did take equals exp within a few ulp.
template <typename T>
void check_bounded_exp(Isa isa, double max_ulps) {
  const auto where = ::testing::Message() << "isa " << sdpa::isa_name(isa);
  std::mt19937 gen(91);
  const T shift = T(-2.25), limit = shift + T(16);
  std::uniform_real_distribution<double> below(double(shift) - 40.0, double(limit));
  for (Index n = 1; n <= 70; ++n) {
    std::vector<T> x(static_cast<std::size_t>(n));
    for (Index j = 0; j < n; ++j) x[static_cast<std::size_t>(j)] = j % 9 == 4 ? -std::numeric_limits<T>::infinity() : T(below(gen));
    x[static_cast<std::size_t>(n / 2)] = limit;  // on the limit: taken
    for (Index at = -1; at < n; ++at) {
      for (const T above : {limit + T(0.01), limit + T(500)}) {
        std::vector<T> in = x;
        if (at >= 0) in[static_cast<std::size_t>(at)] = above;
        std::vector<T> got = in;
        Index done = -1;
        const T sum = sdpa::simd::exp_shifted_sum_below(isa, got.data(), n, shift, limit, &done);
        const auto here = ::testing::Message() << where << " n " << n << " above at " << at << " (" << above << ")";
        if (at < 0) {
          EXPECT_EQ(done, n) << here;
        } else {
          EXPECT_LE(done, at) << here;
          EXPECT_GT(done, at - 32) << here;
        }
        ASSERT_GE(done, 0) << here;
        ASSERT_LE(done, n) << here;
        double want_sum = 0;
        for (Index j = 0; j < n; ++j) {
          const std::size_t u = static_cast<std::size_t>(j);
          if (j >= done) {
            EXPECT_EQ(std::memcmp(&got[u], &in[u], sizeof(T)), 0) << here << " changed j " << j;
            continue;
          }
          // exp of the difference as T rounds it (above the shift, its rounding is what exp magnifies).
          const T want = T(std::exp(double(T(in[u] - shift))));
          want_sum += double(want);
          if (std::isinf(in[u])) {
            EXPECT_EQ(got[u], T(0)) << here << " j " << j;
          } else if (double(want) >= double(std::numeric_limits<T>::min())) {
            EXPECT_LE(ulps(got[u], want), max_ulps) << here << " x " << in[u] << " got " << got[u] << " want " << want;
          } else {
            EXPECT_LE(double(got[u]), double(std::numeric_limits<T>::min())) << here;
          }
        }
        EXPECT_NEAR(double(sum), want_sum, 8 * std::numeric_limits<T>::epsilon() * want_sum) << here;
        if (at < 0) break;
      }
    }
  }
  // A NaN score is taken (it is not above the limit) and makes the sum NaN.
  T nan_row[3] = {shift, std::numeric_limits<T>::quiet_NaN(), shift + 1};
  Index done = -1;
  EXPECT_TRUE(std::isnan(sdpa::simd::exp_shifted_sum_below(isa, nan_row, 3, shift, limit, &done))) << where;
  EXPECT_EQ(done, 3) << where;
}

TEST(SimdExp, BoundedPassStopsBeforeTheFirstScoreAboveTheLimit) {
  for (Isa isa : paths()) {
    check_bounded_exp<float>(isa, 2.0);
    check_bounded_exp<double>(isa, 2.0);
  }
}

// A million floats spread over [-87.3, 88.7] (uniform, plus the integers and the half-integers) through
// each path's float exponent: the largest error in ulp.
TEST(SimdExp, SweepOfTheFloatRange) {
  std::mt19937 gen(123);
  std::uniform_real_distribution<float> u(-87.3f, 88.7f);
  std::vector<float> x;
  for (int i = 0; i < (1 << 20); ++i) x.push_back(u(gen));
  for (float v = -87.0f; v <= 88.5f; v += 0.5f) x.push_back(v);
  for (Isa isa : paths()) {
    std::vector<float> y = x;
    sdpa::simd::exp_shifted_sum(isa, y.data(), Index(y.size()), 0.0f);
    double worst = 0;
    float worst_x = 0;
    for (std::size_t j = 0; j < x.size(); ++j) {
      const double e = ulps(y[j], float(std::exp(double(x[j]))));
      if (e > worst) {
        worst = e;
        worst_x = x[j];
      }
    }
    EXPECT_LE(worst, 2.0) << sdpa::isa_name(isa) << " at x = " << worst_x;
    std::printf("[ simd ] %s float exp: at most %.2f ulp (at %g)\n", sdpa::isa_name(isa), worst, double(worst_x));
  }
}

template <typename T>
void check_rows(Isa isa) {
  const auto where = ::testing::Message() << "isa " << sdpa::isa_name(isa);
  std::mt19937 gen(5);
  std::uniform_real_distribution<double> u(-2.0, 2.0);
  for (Index n : {Index(1), Index(3), Index(7), Index(8), Index(15), Index(16), Index(17), Index(31), Index(32),
                  Index(33), Index(64), Index(65), Index(100), Index(257)}) {
    std::vector<T> a(static_cast<std::size_t>(n)), b(static_cast<std::size_t>(n));
    for (T& x : a) x = T(u(gen));
    for (T& x : b) x = T(u(gen));
    double want_dot = 0, magnitude = 0, want_max = -1e300;
    for (std::size_t i = 0; i < a.size(); ++i) {
      want_dot += double(a[i]) * double(b[i]);
      magnitude += std::abs(double(a[i]) * double(b[i]));
      want_max = std::max(want_max, double(a[i]));
    }
    const double eps = std::numeric_limits<T>::epsilon();
    EXPECT_NEAR(double(sdpa::simd::dot(isa, a.data(), b.data(), n)), want_dot, 4 * eps * magnitude) << where << " n " << n;
    EXPECT_EQ(double(sdpa::simd::row_max(isa, a.data(), n)), want_max) << where << " n " << n;
    // All negative: the masked tail must not contribute a 0.
    std::vector<T> neg(a.size());
    for (std::size_t i = 0; i < a.size(); ++i) neg[i] = -std::abs(a[i]) - T(1);
    double neg_max = -1e300;
    for (T x : neg) neg_max = std::max(neg_max, double(x));
    EXPECT_EQ(double(sdpa::simd::row_max(isa, neg.data(), n)), neg_max) << where << " n " << n;

    // acc += sum_j w_j rows_j, m rows with a stride past n; lanes past n untouched.
    const Index m = 5, stride = n + 3;
    std::vector<T> rows(static_cast<std::size_t>(m * stride)), w(static_cast<std::size_t>(m));
    for (T& x : rows) x = T(u(gen));
    for (T& x : w) x = T(u(gen));
    std::vector<T> acc(static_cast<std::size_t>(n + 1), T(0.5));
    acc[static_cast<std::size_t>(n)] = T(-7);
    sdpa::simd::add_weighted_rows(isa, acc.data(), n, w.data(), rows.data(), stride, m);
    for (Index i = 0; i < n; ++i) {
      double want = 0.5, mag = 0.5;
      for (Index j = 0; j < m; ++j) {
        want += double(w[static_cast<std::size_t>(j)]) * double(rows[static_cast<std::size_t>(j * stride + i)]);
        mag += std::abs(double(w[static_cast<std::size_t>(j)]) * double(rows[static_cast<std::size_t>(j * stride + i)]));
      }
      EXPECT_NEAR(double(acc[static_cast<std::size_t>(i)]), want, 4 * eps * mag) << where << " n " << n << " i " << i;
    }
    EXPECT_EQ(acc[static_cast<std::size_t>(n)], T(-7)) << where << " wrote past n";
  }
}

TEST(SimdRows, DotMaxAndWeightedRowsOnEveryPath) {
  for (Isa isa : paths()) {
    check_rows<float>(isa);
    check_rows<double>(isa);
  }
}

// chunk_scores over grouped heads (query head h reads key head h / group), strided rows: every key count
// around the vector widths (full blocks, a short last block), head sizes with and without a vector tail;
// and a key's score has the same bits when the chunk starts elsewhere (another block position).
template <typename T>
void check_chunk_scores(Isa isa, Index n, Index d) {
  std::mt19937 gen(static_cast<unsigned>(9 + n * 131 + d));
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  const Index heads = 4, group = 2, kv_heads = heads / group, nq = 3;
  const Index k_head = d + 1, k_row = kv_heads * k_head + 5, q_head = nq * (d + 2), q_row = d + 2, lds = n + 4;
  std::vector<T> k(static_cast<std::size_t>((n + 1) * k_row)), q(static_cast<std::size_t>(heads * q_head));
  for (T& x : k) x = T(u(gen));
  for (T& x : q) x = T(u(gen));
  const std::string where = std::string(sdpa::isa_name(isa)) + " n " + std::to_string(n) + " d " + std::to_string(d);
  std::vector<T> s(static_cast<std::size_t>(heads * nq * lds), T(-5));
  const sdpa::simd::Queries<T> queries{q.data(), q_head, q_row, heads, group, nq, d};
  sdpa::simd::chunk_scores(isa, sdpa::simd::Rows<T>{k.data(), k_row, k_head}, n, queries, sdpa::simd::Scores<T>{s.data(), lds, T(0.25)});
  // The chunk one key later: key j + 1 of the first call is key j here.
  std::vector<T> shifted(static_cast<std::size_t>(heads * nq * lds), T(-5));
  sdpa::simd::chunk_scores(isa, sdpa::simd::Rows<T>{k.data() + k_row, k_row, k_head}, n, queries,
                           sdpa::simd::Scores<T>{shifted.data(), lds, T(0.25)});
  const double eps = std::numeric_limits<T>::epsilon();
  for (Index h = 0; h < heads; ++h)
    for (Index i = 0; i < nq; ++i)
      for (Index j = 0; j < lds; ++j) {
        const std::size_t at = static_cast<std::size_t>((h * nq + i) * lds + j);
        if (j >= n) {
          EXPECT_EQ(s[at], T(-5)) << where << ": wrote past the chunk";
          EXPECT_EQ(shifted[at], T(-5)) << where << ": wrote past the chunk";
          continue;
        }
        double want = 0, mag = 0;
        for (Index c = 0; c < d; ++c) {
          const double x = double(k[static_cast<std::size_t>(j * k_row + (h / group) * k_head + c)]) *
                           double(q[static_cast<std::size_t>(h * q_head + i * q_row + c)]);
          want += x;
          mag += std::abs(x);
        }
        EXPECT_NEAR(double(s[at]), 0.25 * want, 0.25 * 4 * eps * mag) << where << " h " << h << " i " << i << " j " << j;
        if (j + 1 < n) {
          EXPECT_EQ(s[at + 1], shifted[at]) << where << ": key " << j + 1 << " depends on its block position";
        }
      }
}

TEST(SimdRows, ChunkScoresOnEveryPath) {
  for (Isa isa : paths())
    for (Index n : {1, 3, 4, 8, 15, 16, 17, 19, 40})
      for (Index d : {8, 37, 64}) {
        check_chunk_scores<float>(isa, n, d);
        check_chunk_scores<double>(isa, n, d);
      }
}

// Philox words from every path's vector rounds equal the scalar bijection's, whatever the block count
// (vector blocks and a scalar tail) and the counter (up to the 32-bit wrap).
TEST(SimdPhilox, EveryPathGivesTheScalarWords) {
  RestoreIsa restore;
  const sdpa::DropoutSampler s(0x1234567890abcdefULL, 7, 0.4);
  for (Isa isa : paths()) {
    for (std::int64_t begin : {std::int64_t{0}, std::int64_t{1}, std::int64_t{5}, std::int64_t{1000}, std::int64_t{4294967290}}) {
      for (std::int64_t blocks : {0, 1, 7, 8, 9, 15, 16, 17, 33, 64}) {
        std::vector<std::uint32_t> out(static_cast<std::size_t>(4 * blocks) + 1, 0xdeadbeefu);
        s.fill_bits(isa, 11, 3, begin, blocks, out.data());
        for (std::int64_t i = 0; i < blocks; ++i) {
          const auto words = s.block(11, 3, begin + i);
          for (int j = 0; j < 4; ++j)
            ASSERT_EQ(out[static_cast<std::size_t>(4 * i + j)], words[static_cast<std::size_t>(j)])
                << sdpa::isa_name(isa) << " begin " << begin << " block " << i << " word " << j;
        }
        EXPECT_EQ(out.back(), 0xdeadbeefu) << "wrote past the end";
      }
    }
  }
}

}  // namespace simd_test
