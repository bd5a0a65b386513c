// Tests of sdpa/kernels/tiled.hpp against reference_attention on the same AttentionProblem, built here
// straight from random projected buffers: shapes on and around block boundaries (forced tiny blocks and the
// cache-derived default, query groups), every broadcast form of mask and weights, causal, key-padding and
// sliding-window masks, fully masked rows under both policies, large logits, dropout, fused and padded
// strided layouts, and a two-thread device. Also: tiles that are fully masked are skipped (counted, and
// never read), the block rule, no Eigen heap allocation in the tile loop, and no allocation of size
// nq * nk for a long sequence (operator new and the library's aligned_alloc counted). Every tile is also
// run with its products on unpacked operands, which must give the same bits. (The softmax's exponent is
// tested on every path in simd_test.cpp.)
//
// EIGEN_RUNTIME_NO_MALLOC and this eigen_assert let a test forbid Eigen's heap allocations and see them
// even in a Release build; they must come before any Eigen header.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <new>

#include "support/alloc_tracking.hpp"

namespace tiled_test {
std::atomic<int> g_eigen_assert_failures{0};
}  // namespace tiled_test
#define EIGEN_RUNTIME_NO_MALLOC
#define eigen_assert(x)                                                                            \
  do {                                                                                             \
    if (!(x)) {                                                                                    \
      ::tiled_test::g_eigen_assert_failures.fetch_add(1);                                          \
      std::fprintf(stderr, "eigen_assert failed: %s (%s:%d)\n", #x, __FILE__, __LINE__);          \
    }                                                                                              \
  } while (false)

#include "sdpa/kernels/tiled.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "sdpa/kernels/reference.hpp"
#include "sdpa/mask.hpp"
#include "support/problem.hpp"


namespace tiled_test {

using Index = Eigen::Index;
using sdpa::MaskedRows;
using sdpa::kernels::AttentionProblem;
using sdpa::kernels::TileConfig;
using sdpa::kernels::TileStats;

// The problems: tests/support/problem.hpp (q, k, v buffers, the options, an AttentionProblem over them).
using sdpa_test::make_problem;
using sdpa_test::Spec;
using sdpa_test::TestProblem;

template <typename T>
std::vector<T> run_reference(TestProblem<T>& t, const Eigen::ThreadPoolDevice* device = nullptr) {
  std::vector<T> out(static_cast<std::size_t>(t.out_size()), T(-7));
  AttentionProblem<T> p = t.p;
  p.out = {out.data(), p.nq * p.heads * p.d_v, p.heads * p.d_v, p.d_v};
  sdpa::kernels::reference_attention(p, device);
  return out;
}

template <typename T>
std::vector<T> run_tiled_once(TestProblem<T>& t, const Eigen::ThreadPoolDevice* device, TileConfig config,
                              TileStats* stats) {
  // Garbage in the output first: the kernel must write every element.
  std::vector<T> out(static_cast<std::size_t>(t.out_size()), T(-7));
  AttentionProblem<T> p = t.p;
  p.out = {out.data(), p.nq * p.heads * p.d_v, p.heads * p.d_v, p.d_v};
  sdpa::kernels::tiled_attention(p, device, config, stats);
  return out;
}

template <typename T>
double tolerance() {
  return std::is_same<T, float>::value ? 2e-5 : 1e-12;
}

// Same NaN positions; elsewhere |a - b| <= tol * max(1, |b|).
template <typename T>
::testing::AssertionResult outputs_match(const std::vector<T>& got, const std::vector<T>& want,
                                         double tol = tolerance<T>()) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "sizes differ";
  for (std::size_t i = 0; i < got.size(); ++i) {
    const bool got_nan = std::isnan(got[i]), want_nan = std::isnan(want[i]);
    if (got_nan != want_nan)
      return ::testing::AssertionFailure() << "element " << i << ": got " << got[i] << ", want " << want[i];
    if (want_nan || got[i] == want[i]) continue;  // equal infinities included
    const double err = std::abs(double(got[i]) - double(want[i]));
    if (!(err <= tol * std::max(1.0, std::abs(double(want[i])))))
      return ::testing::AssertionFailure() << "element " << i << ": got " << got[i] << ", want " << want[i]
                                           << " (error " << err << ")";
  }
  return ::testing::AssertionSuccess();
}

// The tiled kernel's output; it also runs the same problem with every tile's products on the operands
// where they lie (TileConfig::pack_operands false, the path the packing is checked against), which must
// give the same bits: the micro-kernels sum the products in the same order either way. The portable
// path's products are Eigen's, which round by shape (they split a deep product by the L1 size: 513 keys
// in one block on a 32 KiB L1), so there the two agree to rounding only.
template <typename T>
std::vector<T> run_tiled(TestProblem<T>& t, const Eigen::ThreadPoolDevice* device = nullptr,
                         TileConfig config = TileConfig{}, TileStats* stats = nullptr) {
  std::vector<T> out = run_tiled_once(t, device, config, stats);
  if (config.pack_operands) {
    TileConfig unpacked = config;
    unpacked.pack_operands = false;
    const std::vector<T> plain = run_tiled_once(t, device, unpacked, nullptr);
    if (t.p.isa != sdpa::Isa::kPortable) {
      EXPECT_EQ(std::memcmp(out.data(), plain.data(), out.size() * sizeof(T)), 0)
          << "packed and unpacked tile products differ";
    } else {
      EXPECT_TRUE(outputs_match(out, plain, std::is_same_v<T, float> ? 1e-5 : 1e-13))
          << "packed and unpacked tile products differ beyond rounding";
    }
  }
  return out;
}

std::string describe(const Spec& s, const TileConfig& c) {
  return "batch " + std::to_string(s.batch) + " heads " + std::to_string(s.heads) + " nq " + std::to_string(s.nq) +
         " nk " + std::to_string(s.nk) + " d_k " + std::to_string(s.d_k) + " d_v " + std::to_string(s.d_v) +
         " blocks " + std::to_string(c.block_q) + "x" + std::to_string(c.block_k) + (s.fused ? " fused" : "") +
         (s.has_mask ? " mask" : "") + (s.has_weights ? " weights" : "") +
         (s.policy == MaskedRows::kNaN ? " kNaN" : "") + (s.dropout > 0 ? " dropout " + std::to_string(s.dropout) : "");
}

template <typename T>
void expect_matches_reference(const Spec& s, const TileConfig& config) {
  auto t = make_problem<T>(s);
  EXPECT_TRUE(outputs_match(run_tiled(*t, nullptr, config), run_reference(*t))) << describe(s, config);
}

const TileConfig kTiny{4, 8, 1};
const TileConfig kTinyGroups{4, 8, 3};  // three query blocks take turns on each key block

template <typename T>
class TiledTest : public ::testing::Test {};
using ScalarTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(TiledTest, ScalarTypes);

TYPED_TEST(TiledTest, ShapesAroundTinyBlockBoundaries) {
  using T = TypeParam;
  const Index sizes[] = {1, 2, 3, 4, 5, 7, 8, 9, 11, 13, 16, 17, 23, 31};
  std::uint32_t seed = 1;
  for (Index nq : sizes)
    for (Index nk : sizes) {
      Spec s;
      s.nq = nq;
      s.nk = nk;
      s.seed = seed++;
      expect_matches_reference<T>(s, kTiny);
      expect_matches_reference<T>(s, kTinyGroups);
    }
}

TYPED_TEST(TiledTest, ShapesAroundDefaultBlockBoundaries) {
  using T = TypeParam;
  const TileConfig c = TileConfig::for_problem<T>(16, 16);
  for (Index nq : {Index(1), c.block_q - 1, c.block_q, c.block_q + 1, Index(2) * c.block_q + 3})
    for (Index nk : {Index(1), c.block_k - 1, c.block_k, c.block_k + 1, Index(97)}) {
      Spec s;
      s.batch = 1;
      s.heads = 2;
      s.d_k = 16;
      s.d_v = 16;
      s.nq = nq;
      s.nk = nk;
      s.seed = static_cast<std::uint32_t>(nq * 1000 + nk);
      SCOPED_TRACE("nq " + std::to_string(nq) + ", nk " + std::to_string(nk));
      expect_matches_reference<T>(s, TileConfig{});
      s.has_mask = true;
      s.mask_full = {{false, true, true, true}};
      s.fully_masked_rate = 0.1;
      expect_matches_reference<T>(s, TileConfig{});
    }
}

TYPED_TEST(TiledTest, OddBlockSizesAndHeadDims) {
  using T = TypeParam;
  std::uint32_t seed = 100;
  for (const TileConfig c : {TileConfig{1, 1, 1}, TileConfig{3, 5, 1}, TileConfig{7, 3, 2}, TileConfig{5, 13, 3},
                             TileConfig{2, 4, 8}, TileConfig{64, 64}})
    for (Index d_k : {1, 3, 17})
      for (Index d_v : {1, 5, 16}) {
        Spec s;
        s.nq = 19;
        s.nk = 23;
        s.d_k = d_k;
        s.d_v = d_v;
        s.has_mask = true;
        s.has_weights = true;
        s.seed = seed++;
        expect_matches_reference<T>(s, c);
        s.dropout = 0.3;
        expect_matches_reference<T>(s, c);
      }
}

TYPED_TEST(TiledTest, NoKeysGiveZerosUnderBothPolicies) {
  using T = TypeParam;
  for (MaskedRows policy : {MaskedRows::kZero, MaskedRows::kNaN}) {
    Spec s;
    s.nk = 0;
    s.policy = policy;
    s.has_mask = true;
    auto t = make_problem<T>(s);
    const std::vector<T> ref = run_reference(*t);
    for (const TileConfig& c : {kTiny, TileConfig{}}) {
      const std::vector<T> got = run_tiled(*t, nullptr, c);
      EXPECT_TRUE(outputs_match(got, ref));
      for (T x : got) EXPECT_EQ(x, T(0));
    }
  }
}

TYPED_TEST(TiledTest, EveryMaskBroadcastForm) {
  using T = TypeParam;
  std::uint32_t seed = 200;
  for (int form = 0; form < 16; ++form) {
    for (MaskedRows policy : {MaskedRows::kZero, MaskedRows::kNaN}) {
      Spec s;
      s.batch = 2;
      s.heads = 3;
      s.nq = 13;
      s.nk = 21;
      s.has_mask = true;
      s.mask_full = {{(form & 1) != 0, (form & 2) != 0, (form & 4) != 0, (form & 8) != 0}};
      s.mask_rate = 0.4;
      s.fully_masked_rate = 0.15;
      s.policy = policy;
      s.seed = seed++;
      expect_matches_reference<T>(s, kTiny);
      expect_matches_reference<T>(s, kTinyGroups);
      expect_matches_reference<T>(s, TileConfig{});
    }
  }
}

TYPED_TEST(TiledTest, EveryWeightsBroadcastForm) {
  using T = TypeParam;
  std::uint32_t seed = 300;
  for (int form = 0; form < 16; ++form) {
    Spec s;
    s.batch = 2;
    s.heads = 3;
    s.nq = 13;
    s.nk = 21;
    s.has_weights = true;
    s.weights_full = {{(form & 1) != 0, (form & 2) != 0, (form & 4) != 0, (form & 8) != 0}};
    s.seed = seed++;
    expect_matches_reference<T>(s, kTiny);
    expect_matches_reference<T>(s, TileConfig{});
    s.has_mask = true;  // weights multiply before the mask applies
    s.mask_full = {{(form & 8) != 0, (form & 4) != 0, (form & 2) != 0, (form & 1) != 0}};
    expect_matches_reference<T>(s, kTiny);
  }
}

// Points tiled_attention at a mask tensor built by the library's helpers.
template <typename T>
void set_mask(TestProblem<T>& t, const sdpa::Mask& mask) {
  t.mask = mask;
  t.p.mask = sdpa::make_broadcast_view<bool>(&t.mask, {{t.p.batch, t.p.heads, t.p.nq, t.p.nk}}, "tiled_test", "mask");
}

TYPED_TEST(TiledTest, CausalMaskMatchesReferenceAndSkipsTheUpperTiles) {
  using T = TypeParam;
  for (Index n : {Index(1), Index(9), Index(64), Index(77)}) {
    Spec s;
    s.nq = n;
    s.nk = n;
    auto t = make_problem<T>(s);
    set_mask(*t, sdpa::causal_mask(n, n));
    const std::vector<T> ref = run_reference(*t);
    TileStats stats;
    EXPECT_TRUE(outputs_match(run_tiled(*t, nullptr, kTiny, &stats), ref)) << "n " << n;
    // Tile (qb, kb) holds an unmasked score iff its first key is at most its last query.
    Index expected = 0, total = 0;
    for (Index q0 = 0; q0 < n; q0 += kTiny.block_q)
      for (Index k0 = 0; k0 < n; k0 += kTiny.block_k) {
        ++total;
        if (k0 <= std::min(n, q0 + kTiny.block_q) - 1) ++expected;
      }
    EXPECT_EQ(stats.tiles_computed, expected * s.batch * s.heads) << "n " << n;
    // The key loop ends at the diagonal: the tiles above it are not even visited.
    EXPECT_EQ(stats.tiles_skipped, 0) << "n " << n;
    EXPECT_LE(stats.tiles_computed, total * s.batch * s.heads) << "n " << n;
    EXPECT_TRUE(outputs_match(run_tiled(*t, nullptr, TileConfig{}), ref)) << "n " << n;
    TileStats grouped;
    EXPECT_TRUE(outputs_match(run_tiled(*t, nullptr, kTinyGroups, &grouped), ref)) << "n " << n;
    EXPECT_EQ(grouped.tiles_computed, stats.tiles_computed) << "n " << n;
  }
}

TYPED_TEST(TiledTest, CausalMaskWithMoreKeysThanQueries) {
  using T = TypeParam;
  Spec s;
  s.nq = 11;
  s.nk = 30;
  auto t = make_problem<T>(s);
  set_mask(*t, sdpa::causal_mask(s.nq, s.nk));
  EXPECT_TRUE(outputs_match(run_tiled(*t, nullptr, kTiny), run_reference(*t)));
}

TYPED_TEST(TiledTest, KeyPaddingMaskNeverReadsThePaddedKeys) {
  using T = TypeParam;
  Spec s;
  s.batch = 3;
  s.nq = 10;
  s.nk = 29;
  const std::vector<Index> lengths = {29, 8, 13};  // 8: a whole number of key blocks; 13: mid-block
  auto t = make_problem<T>(s);
  set_mask(*t, sdpa::key_padding_mask(lengths, s.nk));
  const std::vector<T> ref = run_reference(*t);
  EXPECT_TRUE(outputs_match(run_tiled(*t, nullptr, kTiny), ref));
  EXPECT_TRUE(outputs_match(run_tiled(*t, nullptr, TileConfig{}), ref));
  // NaN in the padded keys' k and v: the reference would multiply them by 0 and give NaN, but a kernel
  // that skips masked tiles and trims tiles to their unmasked keys never reads them.
  const T nan = std::numeric_limits<T>::quiet_NaN();
  for (Index b = 0; b < s.batch; ++b)
    for (Index j = lengths[static_cast<std::size_t>(b)]; j < s.nk; ++j)
      for (Index h = 0; h < s.heads; ++h) {
        std::fill_n(const_cast<T*>(t->p.k.row(b, h, j)), s.d_k, nan);
        std::fill_n(const_cast<T*>(t->p.v.row(b, h, j)), s.d_v, nan);
      }
  TileStats stats;
  EXPECT_TRUE(outputs_match(run_tiled(*t, nullptr, kTiny, &stats), ref));
  // Per batch entry, only the key blocks before its length are visited: 4, 1 and 2 blocks of 8 keys.
  const Index q_blocks = (s.nq + kTiny.block_q - 1) / kTiny.block_q;
  EXPECT_EQ(stats.tiles_computed + stats.tiles_skipped, q_blocks * s.heads * (4 + 1 + 2));
  EXPECT_TRUE(outputs_match(run_tiled(*t, nullptr, kTinyGroups), ref));
  EXPECT_TRUE(outputs_match(run_tiled(*t, nullptr, TileConfig{}), ref));
}

// The finiteness test behind the hidden-key rule, against std::isfinite: every non-finite value (NaN,
// both infinities) at every position of rows of 1 to 37 values is found, and the finite extremes (zeros,
// denormals, the largest values) are not taken for one.
TYPED_TEST(TiledTest, RowFiniteFindsEveryNonFiniteValue) {
  using T = TypeParam;
  using L = std::numeric_limits<T>;
  const T finite[] = {T(0), -T(0), L::denorm_min(), -L::denorm_min(), L::min(), L::max(), L::lowest(), T(1)};
  const T special[] = {L::quiet_NaN(), -L::quiet_NaN(), L::infinity(), -L::infinity()};
  for (Index n = 1; n <= 37; ++n) {
    std::vector<T> row(static_cast<std::size_t>(n));
    for (Index i = 0; i < n; ++i) row[static_cast<std::size_t>(i)] = finite[i % 8];
    EXPECT_TRUE(sdpa::kernels::row_finite(row.data(), n)) << "n " << n;
    for (Index at = 0; at < n; ++at)
      for (T x : special) {
        std::vector<T> bad = row;
        bad[static_cast<std::size_t>(at)] = x;
        ASSERT_FALSE(std::isfinite(x));
        EXPECT_FALSE(sdpa::kernels::row_finite(bad.data(), n)) << "n " << n << " at " << at << " value " << x;
      }
  }
}

// SoftmaxRow's lazy reference on every path, against a softmax in double: one row folded segment by
// segment as the tiled forward folds it (the accumulator scaled by each fold's factor, then the
// exponentials times the values added), with scores that rise within kLag of the reference (the lazy pass
// keeps it), rise past it at the start of a segment, in its middle and by far more than exp's range (the
// pass stops and the reference moves to the largest score), fall far below, and hidden keys. After every
// fold the reference lies at most kLag below the largest score so far and not above it; the row's
// log-sum-exp and output match the double softmax's. A NaN score makes both NaN.
TYPED_TEST(TiledTest, LazySoftmaxReferenceMatchesADoubleSoftmax) {
  using T = TypeParam;
  using Row = sdpa::kernels::SoftmaxRow<T>;
  const T lag = Row::kLag;
  const double tol = std::is_same<T, float>::value ? 2e-5 : 1e-12;
  struct Piece {
    Index n;
    double base;  // the segment's scores: base + u * lag with u in (-0.1, 0.1), plus jump from `from` on
    Index from;
    double jump;
  };
  // In units of the lag L: the reference starts near 0.1 L; later segments rise within the lag (kept), past
  // it from their middle after scores near the limit (what the pass took must follow the reference), past
  // it from their start (nothing taken before the stop), far past exp's range from their middle, and drop
  // far below.
  const double L = double(lag);
  const std::vector<Piece> pieces = {{37, 0.0, 0, 0.0},
                                     {64, 0.5 * L, 0, 0.0},
                                     {5, 0.8 * L, 0, 0.0},
                                     {100, 0.9 * L, 60, 1.5 * L},
                                     {33, 40.0, 0, 0.0},
                                     {70, 40.0 + 0.5 * L, 40, 100.0},
                                     {1, -900.0, 0, 0.0},
                                     {48, 140.0 + 0.9 * L, 0, 0.0},
                                     {90, 140.0 + 0.9 * L, 70, 1.2 * L},
                                     {17, 10.0, 0, 0.0}};
  for (int i = 0; i <= static_cast<int>(sdpa::best_isa()); ++i) {
    const sdpa::Isa isa = static_cast<sdpa::Isa>(i);
    for (bool with_nan : {false, true}) {
      std::mt19937 gen(17 + i);
      std::uniform_real_distribution<double> u(-0.1 * double(lag), 0.1 * double(lag)), value(-3.0, 3.0);
      const Index d = 3;
      Row row;
      row.seen = true;
      std::vector<double> acc(d, 0.0), all_scores;
      std::vector<std::array<double, 3>> all_values;
      double running_max = -std::numeric_limits<double>::infinity();
      for (std::size_t s_i = 0; s_i < pieces.size(); ++s_i) {
        const Piece& piece = pieces[s_i];
        std::vector<T> x(static_cast<std::size_t>(piece.n));
        std::vector<std::array<double, 3>> v(x.size());
        for (Index j = 0; j < piece.n; ++j) {
          const std::size_t uj = static_cast<std::size_t>(j);
          x[uj] = T(piece.base + u(gen) + (j >= piece.from ? piece.jump : 0.0));
          if (j % 13 == 7) x[uj] = -std::numeric_limits<T>::infinity();  // a hidden key
          for (Index c = 0; c < d; ++c) v[uj][static_cast<std::size_t>(c)] = value(gen);
          all_scores.push_back(double(x[uj]));
          all_values.push_back(v[uj]);
          running_max = std::max(running_max, double(x[uj]));
        }
        if (with_nan && s_i == 5) x[40] = std::numeric_limits<T>::quiet_NaN();
        const T alpha = row.fold(isa, x.data(), piece.n);
        for (double& a : acc) a *= double(alpha);
        for (std::size_t j = 0; j < x.size(); ++j)
          for (std::size_t c = 0; c < acc.size(); ++c) acc[c] += double(x[j]) * v[j][c];
        if (!with_nan) {
          EXPECT_LE(double(row.max), running_max) << "isa " << i << " segment " << s_i;
          EXPECT_GE(double(row.max), running_max - double(lag)) << "isa " << i << " segment " << s_i;
          // Kept where the scores stayed within the lag, moved to the largest score where they did not.
          if (s_i == 1 || s_i == 2 || s_i == 7) {
            EXPECT_LT(double(row.max), running_max) << "isa " << i << " segment " << s_i;
          }
          if (s_i == 3 || s_i == 4 || s_i == 5 || s_i == 8) {
            EXPECT_EQ(double(row.max), running_max) << "isa " << i << " segment " << s_i;
          }
        }
      }
      double m = -std::numeric_limits<double>::infinity(), z = 0;
      for (double x : all_scores) m = std::max(m, x);
      for (double x : all_scores) z += std::exp(x - m);
      const double want_lse = m + std::log(z);
      if (with_nan) {
        EXPECT_TRUE(std::isnan(row.log_sum_exp())) << "isa " << i;
        EXPECT_TRUE(std::isnan(acc[0] / double(row.sum))) << "isa " << i;
        continue;
      }
      EXPECT_NEAR(double(row.log_sum_exp()), want_lse, tol * std::abs(want_lse)) << "isa " << i;
      for (std::size_t c = 0; c < acc.size(); ++c) {
        double want = 0;
        for (std::size_t j = 0; j < all_scores.size(); ++j) want += std::exp(all_scores[j] - m) / z * all_values[j][c];
        EXPECT_NEAR(acc[c] / double(row.sum), want, tol) << "isa " << i << " feature " << c;
      }
    }
  }
}

// Keys hidden from every query inside causal tiles hold NaN and infinity in their value rows: the output
// is the one with finite values there. Key 30 lies in the part of its key block (24 to 31) that the
// query block 28 to 31 reaches beyond the block 24 to 27 of its group (blocks of 4 queries and 8 keys,
// groups of 3): the keys known finite from the first tile do not cover it, and it must still be read.
TYPED_TEST(TiledTest, NonFiniteValuesOfHiddenKeysInsideCausalTiles) {
  using T = TypeParam;
  Spec s;
  s.nq = 40;
  s.nk = 40;
  auto t = make_problem<T>(s);
  sdpa::Mask mask = sdpa::causal_mask(s.nq, s.nk);
  for (Index i = 0; i < s.nq; ++i)
    for (Index j : {17, 30}) mask(0, 0, i, j) = true;
  set_mask(*t, mask);
  const std::vector<T> ref = run_reference(*t);
  for (Index b = 0; b < s.batch; ++b)
    for (Index h = 0; h < s.heads; ++h) {
      std::fill_n(const_cast<T*>(t->p.v.row(b, h, 17)), s.d_v, std::numeric_limits<T>::quiet_NaN());
      std::fill_n(const_cast<T*>(t->p.v.row(b, h, 30)), s.d_v, std::numeric_limits<T>::infinity());
    }
  for (const TileConfig& c : {kTiny, kTinyGroups, TileConfig{4, 16, 4}, TileConfig{}}) {
    const std::vector<T> got = run_tiled(*t, nullptr, c);
    for (T x : got) ASSERT_TRUE(std::isfinite(x));
    EXPECT_TRUE(outputs_match(got, ref));
  }
}

TYPED_TEST(TiledTest, FullyMaskedRowsFollowThePolicy) {
  using T = TypeParam;
  for (MaskedRows policy : {MaskedRows::kZero, MaskedRows::kNaN}) {
    Spec s;
    s.nq = 17;
    s.nk = 19;
    s.has_mask = true;
    s.fully_masked_rate = 0.3;
    s.policy = policy;
    s.seed = 400 + static_cast<std::uint32_t>(policy);
    auto t = make_problem<T>(s);
    const std::vector<T> ref = run_reference(*t);
    std::size_t nan_count = 0;
    for (T x : ref) nan_count += std::isnan(x) ? 1 : 0;
    if (policy == MaskedRows::kNaN) {
      EXPECT_GT(nan_count, 0u);  // the spec did produce fully masked rows
    } else {
      EXPECT_EQ(nan_count, 0u);
    }
    for (const TileConfig& c : {kTiny, TileConfig{2, 3, 4}, TileConfig{}})
      EXPECT_TRUE(outputs_match(run_tiled(*t, nullptr, c), ref));
  }
  // Every key of every row masked.
  for (MaskedRows policy : {MaskedRows::kZero, MaskedRows::kNaN}) {
    Spec s;
    s.has_mask = true;
    s.mask_full = {{false, false, false, false}};
    s.mask_rate = 1.0;
    s.policy = policy;
    auto t = make_problem<T>(s);
    TileStats stats;
    const std::vector<T> got = run_tiled(*t, nullptr, kTiny, &stats);
    EXPECT_TRUE(outputs_match(got, run_reference(*t)));
    EXPECT_EQ(stats.tiles_computed, 0);
    for (T x : got) EXPECT_TRUE(policy == MaskedRows::kNaN ? std::isnan(x) : x == T(0));
  }
}

// Rows that see keys in some tiles and none in others: the running max starts at -inf and must not turn
// into NaN (exp(-inf - -inf)).
TYPED_TEST(TiledTest, RowsMaskedInTheirFirstTiles) {
  using T = TypeParam;
  Spec s;
  s.nq = 9;
  s.nk = 40;
  auto t = make_problem<T>(s);
  sdpa::Mask mask(1, 1, s.nq, s.nk);
  for (Index i = 0; i < s.nq; ++i)
    for (Index j = 0; j < s.nk; ++j) mask(0, 0, i, j) = j < 4 * i || (j % 3 == 0 && i % 2 == 0);
  set_mask(*t, mask);
  const std::vector<T> ref = run_reference(*t);
  for (const TileConfig& c : {kTiny, TileConfig{3, 4, 2}, TileConfig{}})
    EXPECT_TRUE(outputs_match(run_tiled(*t, nullptr, c), ref));
}

// Sliding windows: each row's unmasked keys are one run that starts and ends mid-sequence, so tiles on
// both sides of it are skipped; every other row also gets a hole (two runs).
TYPED_TEST(TiledTest, SlidingWindowsAndRowsWithHoles) {
  using T = TypeParam;
  Spec s;
  s.nq = 37;
  s.nk = 45;
  auto t = make_problem<T>(s);
  sdpa::Mask mask(1, 1, s.nq, s.nk);
  for (Index i = 0; i < s.nq; ++i)
    for (Index j = 0; j < s.nk; ++j) {
      const bool outside = j < i || j > i + 6;
      const bool hole = i % 2 == 1 && j == i + 3;
      mask(0, 0, i, j) = outside || hole;
    }
  set_mask(*t, mask);
  const std::vector<T> ref = run_reference(*t);
  TileStats stats;
  for (const TileConfig& c : {kTiny, kTinyGroups, TileConfig{5, 3, 2}, TileConfig{}}) {
    EXPECT_TRUE(outputs_match(run_tiled(*t, nullptr, c, &stats), ref));
  }
  run_tiled(*t, nullptr, kTiny, &stats);
  // The band of 7 keys per row touches 2 or 3 key blocks of 8 out of 6 per query block of 4.
  const Index q_blocks = (s.nq + kTiny.block_q - 1) / kTiny.block_q, k_blocks = (s.nk + kTiny.block_k - 1) / kTiny.block_k;
  EXPECT_LE(stats.tiles_computed + stats.tiles_skipped, 3 * q_blocks * s.batch * s.heads);
  EXPECT_LT(3 * q_blocks, q_blocks * k_blocks);
}

// A mask view built by hand whose keys are not adjacent in memory (stride 2): the kernel reads it through
// the view like the reference does.
TYPED_TEST(TiledTest, HandBuiltMaskViewWithStridedKeys) {
  using T = TypeParam;
  Spec s;
  s.batch = 2;
  s.nq = 11;
  s.nk = 19;
  auto t = make_problem<T>(s);
  std::mt19937 gen(900);
  std::bernoulli_distribution masked(0.7);
  std::unique_ptr<bool[]> storage(new bool[static_cast<std::size_t>(s.batch * s.nq * s.nk * 2)]);
  for (Index b = 0; b < s.batch; ++b)
    for (Index i = 0; i < s.nq; ++i)
      for (Index j = 0; j < 2 * s.nk; ++j) {
        // Odd bytes are not part of the view: "masked" there catches a kernel that reads them. Row 3 of
        // each batch fully masked, row 5 one solid run; the rest random.
        bool value = j % 2 == 1 || masked(gen);
        if (i == 3) value = true;
        if (i == 5) value = j % 2 == 1 || j / 2 < 4 || j / 2 > 9;
        storage[static_cast<std::size_t>((b * s.nq + i) * 2 * s.nk + j)] = value;
      }
  t->p.mask.data = storage.get();
  t->p.mask.stride = {{s.nq * 2 * s.nk, 0, 2 * s.nk, 2}};
  for (MaskedRows policy : {MaskedRows::kZero, MaskedRows::kNaN}) {
    t->p.masked_rows = policy;
    const std::vector<T> ref = run_reference(*t);
    for (const TileConfig& c : {kTiny, kTinyGroups, TileConfig{}})
      EXPECT_TRUE(outputs_match(run_tiled(*t, nullptr, c), ref));
  }
}

TYPED_TEST(TiledTest, LargeLogitsStayFinite) {
  using T = TypeParam;
  Spec s;
  s.nq = 21;
  s.nk = 37;
  s.d_k = 16;  // scale 1/4: integer dot products times it stay exact, so both kernels see the same logits
  s.integer_values = true;
  s.has_mask = true;
  s.mask_rate = 0.2;
  s.has_weights = true;  // all ones with integer_values
  auto t = make_problem<T>(s);
  // Logits reach 1e4: |q . k| / 4 with entries up to 100 in 16 dims.
  Index big = 0;
  for (Index j = 0; j < s.nk; ++j) {
    const T* q = t->p.q.row(0, 0, 0);
    const T* k = t->p.k.row(0, 0, j);
    T dot = 0;
    for (Index d = 0; d < s.d_k; ++d) dot += q[d] * k[d];
    big += std::abs(dot * t->p.scale) > T(5000) ? 1 : 0;
  }
  EXPECT_GT(big, 0);
  const std::vector<T> ref = run_reference(*t);
  for (const TileConfig& c : {kTiny, TileConfig{}}) {
    const std::vector<T> got = run_tiled(*t, nullptr, c);
    EXPECT_TRUE(outputs_match(got, ref));
    for (T x : got) EXPECT_TRUE(std::isfinite(x));
  }
  // Logits of 1e4 in magnitude from a scaled q (not exact, but a max-subtracting softmax stays finite).
  Spec f;
  f.nq = 16;
  f.nk = 16;
  f.q_magnitude = 3e4;
  auto u = make_problem<T>(f);
  for (T x : run_tiled(*u, nullptr, kTiny)) EXPECT_TRUE(std::isfinite(x));
}

TYPED_TEST(TiledTest, DropoutDropsTheReferencesElements) {
  using T = TypeParam;
  std::uint32_t seed = 500;
  for (double rate : {0.3, 1.0}) {
    for (const TileConfig& c : {kTiny, TileConfig{5, 7, 2}, TileConfig{}}) {
      Spec s;
      s.batch = 2;
      s.heads = 3;
      s.nq = 14;
      s.nk = 27;
      s.dropout = rate;
      s.seed = seed++;
      expect_matches_reference<T>(s, c);
      s.has_mask = true;
      s.fully_masked_rate = 0.2;
      s.policy = MaskedRows::kNaN;
      s.has_weights = true;
      expect_matches_reference<T>(s, c);
    }
  }
  // The outputs differ from the undropped ones, so matching the reference means the same elements dropped.
  Spec s;
  s.dropout = 0.3;
  auto t = make_problem<T>(s);
  std::vector<T> dropped = run_tiled(*t, nullptr, kTiny);
  t->p.dropout = false;
  EXPECT_FALSE(outputs_match(dropped, run_tiled(*t, nullptr, kTiny)));
}

TYPED_TEST(TiledTest, FusedAndPaddedStridedLayouts) {
  using T = TypeParam;
  std::uint32_t seed = 600;
  for (Index n : {Index(1), Index(6), Index(33)}) {
    Spec s;
    s.heads = 3;
    s.nq = n;
    s.nk = n;
    s.d_k = 5;
    s.d_v = 7;
    s.fused = true;
    s.has_mask = true;
    s.seed = seed++;
    expect_matches_reference<T>(s, kTiny);
    expect_matches_reference<T>(s, kTinyGroups);
    expect_matches_reference<T>(s, TileConfig{});
    s.fused = false;
    s.pad = 3;
    s.nk = n + 4;
    expect_matches_reference<T>(s, kTiny);
    expect_matches_reference<T>(s, kTinyGroups);
    expect_matches_reference<T>(s, TileConfig{});
  }
}

TYPED_TEST(TiledTest, TwoThreadsMatchOneThread) {
  using T = TypeParam;
  Eigen::ThreadPool pool(2);
  Eigen::ThreadPoolDevice device(&pool, 2);
  std::uint32_t seed = 700;
  for (const TileConfig& c : {kTiny, kTinyGroups, TileConfig{}}) {
    Spec s;
    s.batch = 2;
    s.heads = 3;
    s.nq = 45;
    s.nk = 38;
    s.has_mask = true;
    s.has_weights = true;
    s.fully_masked_rate = 0.1;
    s.policy = MaskedRows::kNaN;
    s.dropout = 0.3;
    s.seed = seed++;
    auto t = make_problem<T>(s);
    const std::vector<T> one = run_tiled(*t, nullptr, c);
    TileStats one_stats, two_stats;
    run_tiled(*t, nullptr, c, &one_stats);
    const std::vector<T> two = run_tiled(*t, &device, c, &two_stats);
    EXPECT_TRUE(outputs_match(two, one));
    EXPECT_TRUE(outputs_match(two, run_reference(*t)));
    EXPECT_EQ(one_stats.tiles_computed, two_stats.tiles_computed);
    EXPECT_EQ(one_stats.tiles_skipped, two_stats.tiles_skipped);
  }
}

// A group that sees a single key block reads its query rows where they lie instead of packing them (one
// use each): the scores must be the packed path's bits, or results would depend on how rows are grouped
// (which the thread count changes). Odd sizes around the micro-tile (12 or 6 rows, 32 or 16 columns).
TYPED_TEST(TiledTest, QueriesReadInPlaceGiveThePackedScores) {
  using T = TypeParam;
  std::mt19937 gen(91);
  std::uniform_real_distribution<double> uniform(-2.0, 2.0);
  for (Index rows : {Index(1), Index(5), Index(12), Index(13), Index(37)})
    for (Index cols : {Index(1), Index(16), Index(31), Index(33)})
      for (Index d : {Index(1), Index(7), Index(64), Index(67)}) {
        const Index ldq = d + 3, ldk = d + 1, lds = cols + 2;
        std::vector<T> q(static_cast<std::size_t>(rows * ldq)), k(static_cast<std::size_t>(cols * ldk)),
            v(static_cast<std::size_t>(cols * ldk));
        for (T& x : q) x = T(uniform(gen));
        for (T& x : k) x = T(uniform(gen));
        for (T& x : v) x = T(uniform(gen));
        const T alpha = T(1) / std::sqrt(T(d));
        std::vector<T> packed(static_cast<std::size_t>(rows * lds), T(-3)), in_place = packed;
        sdpa::kernels::TileProducts<T> products(sdpa::kernels::TileShape{rows, cols, 1, d, d}, sdpa::active_isa());
        products.set_keys(k.data(), ldk, v.data(), ldk, cols);
        products.new_group(/*single_key_block=*/false);
        products.scores(0, {q.data(), ldq}, sdpa::kernels::TileRect{rows, 0, rows, 0, cols}, alpha,
                        {packed.data(), lds});
        products.new_group(/*single_key_block=*/true);
        products.scores(0, {q.data(), ldq}, sdpa::kernels::TileRect{rows, 0, rows, 0, cols}, alpha,
                        {in_place.data(), lds});
        const auto where = ::testing::Message() << "rows " << rows << " cols " << cols << " d " << d;
        ASSERT_EQ(std::memcmp(packed.data(), in_place.data(), packed.size() * sizeof(T)), 0) << where;
        // And they are the scores (the padding between rows untouched).
        for (Index i = 0; i < rows; ++i) {
          for (Index j = 0; j < cols; ++j) {
            double dot = 0;
            for (Index c = 0; c < d; ++c)
              dot += double(q[static_cast<std::size_t>(i * ldq + c)]) * double(k[static_cast<std::size_t>(j * ldk + c)]);
            const double got = double(in_place[static_cast<std::size_t>(i * lds + j)]);
            ASSERT_NEAR(got, dot * double(alpha), 1e-4 * (1 + std::abs(dot))) << where;
          }
          for (Index j = cols; j < lds; ++j) ASSERT_EQ(in_place[static_cast<std::size_t>(i * lds + j)], T(-3)) << where;
        }
      }
}

TYPED_TEST(TiledTest, ForcedBlocksAreUsed) {
  using T = TypeParam;
  Spec s;
  s.nq = 10;
  s.nk = 17;
  auto t = make_problem<T>(s);
  TileStats stats;
  run_tiled(*t, nullptr, TileConfig{3, 4}, &stats);
  EXPECT_EQ(stats.tiles_computed, s.batch * s.heads * 4 * 5);
  EXPECT_EQ(stats.tiles_skipped, 0);
  run_tiled(*t, nullptr, TileConfig{3, 4, 3}, &stats);  // groups change the order of tiles, not their number
  EXPECT_EQ(stats.tiles_computed, s.batch * s.heads * 4 * 5);
  // Blocks longer than the sequences shrink to them.
  run_tiled(*t, nullptr, TileConfig{1000, 1000}, &stats);
  EXPECT_EQ(stats.tiles_computed, s.batch * s.heads);
}

// ------------------------------------------------------------------------------ options without tensors

// Sets the tensor-free options on a test problem (q' = q + nk - nq, as the module sets it).
template <typename T>
struct OptionSet {
  bool causal = false;
  Index window_left = -1, window_right = -1;
  std::vector<Index> key_lengths;
  std::vector<T> alibi;
  bool bias = false;
};

template <typename T>
struct OptionProblem {
  std::unique_ptr<TestProblem<T>> t;
  std::vector<Index> key_lengths;
  std::vector<T> alibi;
  Eigen::Tensor<T, 4, Eigen::RowMajor> bias;
};

template <typename T>
OptionProblem<T> make_option_problem(const Spec& s, const OptionSet<T>& o) {
  OptionProblem<T> op;
  op.t = make_problem<T>(s);
  op.key_lengths = o.key_lengths;
  op.alibi = o.alibi;
  AttentionProblem<T>& p = op.t->p;
  p.causal = o.causal;
  p.window_left = o.window_left;
  p.window_right = o.window_right;
  p.query_offset = s.nk - s.nq;
  p.key_lengths = op.key_lengths.empty() ? nullptr : op.key_lengths.data();
  p.alibi = op.alibi.empty() ? nullptr : op.alibi.data();
  if (o.bias) {
    op.bias.resize(1, s.heads, s.nq, s.nk);
    std::mt19937 gen(s.seed + 99);
    std::uniform_real_distribution<double> u(-2.0, 2.0);
    for (Index i = 0; i < op.bias.size(); ++i) op.bias.data()[i] = T(u(gen));
    p.bias = sdpa::make_broadcast_view<T>(&op.bias, {{s.batch, s.heads, s.nq, s.nk}}, "tiled_test", "bias");
  }
  return op;
}

// The tiled kernel with every tensor-free option against the reference kernel, on tiny blocks (so that
// the ranges cross many block boundaries), query groups, odd blocks and the default, on 1 and 2 threads;
// the probabilities and the rows' log-sum-exp too.
TYPED_TEST(TiledTest, OptionsMatchReferenceOnEveryBlocking) {
  using T = TypeParam;
  Eigen::ThreadPool pool(2);
  Eigen::ThreadPoolDevice device(&pool, 2);
  const std::array<std::array<Index, 2>, 3> sizes{{{{23, 23}}, {{9, 30}}, {{30, 9}}}};
  for (const auto& n : sizes)
    for (int variant = 0; variant < 7; ++variant) {
      Spec s;
      s.batch = 3;
      s.nq = n[0];
      s.nk = n[1];
      s.seed = static_cast<std::uint32_t>(variant + 10 * n[0]);
      OptionSet<T> o;
      o.causal = variant == 0 || variant == 3 || variant == 6;
      if (variant == 1 || variant == 3) o.window_left = 5;
      if (variant == 2 || variant == 3) o.window_right = 0;
      if (variant == 4 || variant == 6) o.key_lengths = {n[1], 0, n[1] / 2};
      if (variant == 5 || variant == 6) {
        o.alibi = {T(0.5), T(0.125)};
        o.bias = true;
      }
      if (variant == 6) s.has_mask = true;
      auto op = make_option_problem<T>(s, o);
      TestProblem<T>& t = *op.t;
      const std::vector<T> ref = run_reference(t);
      std::vector<T> ref_probs(static_cast<std::size_t>(s.batch * s.heads * s.nq * s.nk), T(-1));
      std::vector<T> ref_lse(static_cast<std::size_t>(s.batch * s.heads * s.nq), T(-1));
      {
        std::vector<T> out(ref.size());
        AttentionProblem<T> p = t.p;
        p.out = {out.data(), p.nq * p.heads * p.d_v, p.heads * p.d_v, p.d_v};
        p.probabilities = ref_probs.data();
        p.lse = ref_lse.data();
        sdpa::kernels::reference_attention(p);
      }
      for (const TileConfig& c : {kTiny, kTinyGroups, TileConfig{5, 3, 2}, TileConfig{1, 1, 1}, TileConfig{}})
        for (const Eigen::ThreadPoolDevice* d : {static_cast<const Eigen::ThreadPoolDevice*>(nullptr),
                                                 static_cast<const Eigen::ThreadPoolDevice*>(&device)}) {
          SCOPED_TRACE(describe(s, c) + " variant " + std::to_string(variant) + (d ? " 2 threads" : ""));
          std::vector<T> out(ref.size(), T(-7)), probs(ref_probs.size(), T(-7)), lse(ref_lse.size(), T(-7));
          AttentionProblem<T> p = t.p;
          p.out = {out.data(), p.nq * p.heads * p.d_v, p.heads * p.d_v, p.d_v};
          p.probabilities = probs.data();
          p.lse = lse.data();
          sdpa::kernels::tiled_attention(p, d, c);
          EXPECT_TRUE(outputs_match(out, ref));
          EXPECT_TRUE(outputs_match(probs, ref_probs, std::is_same<T, float>::value ? 1e-6 : 1e-13));
          EXPECT_TRUE(outputs_match(lse, ref_lse, std::is_same<T, float>::value ? 1e-5 : 1e-12));
          for (std::size_t i = 0; i < probs.size(); ++i) {
            if (ref_probs[i] == T(0)) {
              ASSERT_EQ(probs[i], T(0)) << i;
            }
          }
        }
    }
}

// Tiles that no row of a query block sees are not computed, for each option: causal and a window bound
// the key loop of every query block; key lengths bound it per batch entry.
TYPED_TEST(TiledTest, HiddenTilesAreNeverComputedForAnyOption) {
  using T = TypeParam;
  const Index n = 64;
  Spec s;
  s.batch = 2;
  s.heads = 1;
  s.nq = n;
  s.nk = n;
  const TileConfig c{4, 8, 1};
  const Index q_blocks = n / c.block_q, k_blocks = n / c.block_k;
  auto computed = [&](const OptionSet<T>& o) {
    auto op = make_option_problem<T>(s, o);
    TileStats stats;
    const std::vector<T> out = run_tiled(*op.t, nullptr, c, &stats);
    EXPECT_TRUE(outputs_match(out, run_reference(*op.t)));
    return stats.tiles_computed;
  };
  OptionSet<T> causal;
  causal.causal = true;
  Index lower = 0;  // tiles with a key at or below the diagonal
  for (Index q0 = 0; q0 < n; q0 += c.block_q)
    for (Index k0 = 0; k0 < n; k0 += c.block_k) lower += k0 <= q0 + c.block_q - 1 ? 1 : 0;
  EXPECT_EQ(computed(causal), s.batch * lower);
  OptionSet<T> window;
  window.causal = true;
  window.window_left = 3;  // each query block of 4 sees keys q0 - 3 .. q0 + 3: one or two key blocks
  EXPECT_LE(computed(window), s.batch * q_blocks * 2);
  OptionSet<T> lengths;
  lengths.key_lengths = {8, 17};  // one block, three blocks
  EXPECT_EQ(computed(lengths), q_blocks * (1 + 3));
  EXPECT_EQ(computed(OptionSet<T>{}), s.batch * q_blocks * k_blocks);
}

TEST(TileConfig, DerivedFromTheCaches) {
  const auto is_pow2 = [](Index x) { return x > 0 && (x & (x - 1)) == 0; };
  for (Index l2 : {Index(256) << 10, Index(512) << 10, Index(1) << 20, Index(2) << 20})
    for (Index bytes : {4, 8})
      for (Index d : {8, 64, 128, 256}) {
        const TileConfig c = TileConfig::for_caches(bytes, d, d, l2);
        EXPECT_TRUE(is_pow2(c.block_q) && is_pow2(c.block_k) && is_pow2(c.group))
            << c.block_q << "x" << c.block_k << "x" << c.group;
        EXPECT_GE(c.block_q, 16);
        EXPECT_LE(c.block_q, 256);
        EXPECT_GE(c.block_k, 16);
        EXPECT_LE(c.block_k, 512);
        EXPECT_GE(c.group, 1);
        EXPECT_LE(c.group, 8);
        // What Eigen packs for the products fits its stack buffers.
        const Index limit = EIGEN_STACK_ALLOCATION_LIMIT;
        EXPECT_LE(c.block_k * d * bytes, limit);
        EXPECT_LE(c.block_q * d * bytes, limit);
        EXPECT_LE(c.block_q * c.block_k * bytes, limit);
        // A larger L2 never gives smaller blocks.
        const TileConfig bigger = TileConfig::for_caches(bytes, d, d, 2 * l2);
        EXPECT_GE(bigger.block_q * bigger.block_k * bigger.group, c.block_q * c.block_k * c.group);
      }
  const TileConfig here = TileConfig::for_problem<float>(64, 64);
  const TileConfig rule = TileConfig::for_caches(4, 64, 64, static_cast<Index>(Eigen::l2CacheSize()));
  EXPECT_EQ(here.block_q, rule.block_q);
  EXPECT_EQ(here.block_k, rule.block_k);
  EXPECT_EQ(here.group, rule.group);
}

// Tiles that sdpa::gemm multiplies are bounded by the caches alone: the score tile within an eighth of L2
// and a group's q rows and accumulators within half, groups of up to 16; never smaller than the tiles
// within Eigen's stack buffers, and with the same key blocks (which fix a row's order of summation).
TEST(TileConfig, WithoutEigensProductsOnlyTheCachesBound) {
  const auto is_pow2 = [](Index x) { return x > 0 && (x & (x - 1)) == 0; };
  for (Index l2 : {Index(256) << 10, Index(512) << 10, Index(1) << 20, Index(2) << 20, Index(4) << 20})
    for (Index bytes : {4, 8})
      for (Index d : {8, 64, 128, 256, 512}) {
        const TileConfig c = TileConfig::for_caches(bytes, d, d, l2, /*eigen_products=*/false);
        const TileConfig eigen = TileConfig::for_caches(bytes, d, d, l2);
        SCOPED_TRACE(std::to_string(l2) + " " + std::to_string(bytes) + " " + std::to_string(d));
        EXPECT_TRUE(is_pow2(c.block_q) && is_pow2(c.block_k) && is_pow2(c.group));
        EXPECT_GE(c.block_q, 16);
        EXPECT_LE(c.block_q, 256);
        EXPECT_GE(c.group, 1);
        EXPECT_LE(c.group, 16);
        EXPECT_EQ(c.block_k, eigen.block_k);
        EXPECT_GE(c.block_q, eigen.block_q);
        EXPECT_GE(c.group * c.block_q, eigen.group * eigen.block_q);
        const Index sized = std::max(l2, Index(1) << 20);  // an L2 under 1 MiB is taken as 1 MiB
        if (c.block_q > 16) {
          EXPECT_LE(c.block_q * c.block_k * bytes, sized / 8);
        }
        if (c.group > 1) {
          EXPECT_LE(c.group * c.block_q * 2 * d * bytes, sized / 2);
        }
      }
  // A 2 MiB L2, float, d 64: 128 x 512 tiles in groups of 16 (Eigen's bound: 64 x 512 in groups of 8).
  const TileConfig c = TileConfig::for_caches(4, 64, 64, Index(2) << 20, false);
  EXPECT_EQ(c.block_q, 128);
  EXPECT_EQ(c.block_k, 512);
  EXPECT_EQ(c.group, 16);
  // 1 MiB and anything smaller: 128 x 256 in groups of 8.
  for (const Index l2 : {Index(1) << 20, Index(512) << 10, Index(128) << 10}) {
    const TileConfig small = TileConfig::for_caches(4, 64, 64, l2, false);
    EXPECT_EQ(small.block_q, 128) << l2;
    EXPECT_EQ(small.block_k, 256) << l2;
    EXPECT_EQ(small.group, 8) << l2;
  }
}

// The tile loop runs on scratch sized once per chunk of work: with Eigen's heap allocation forbidden the
// products and the softmax must still go through (Eigen's product blocking must fit its stack buffers).
TYPED_TEST(TiledTest, TileLoopMakesNoEigenHeapAllocation) {
  using T = TypeParam;
  for (Index d : {Index(32), Index(64), Index(128)}) {
    Spec s;
    s.batch = 1;
    s.heads = 2;
    s.nq = 300;
    s.nk = 700;
    s.d_k = d;
    s.d_v = d;
    s.has_mask = true;
    s.mask_full = {{false, false, true, true}};
    s.has_weights = true;
    s.dropout = 0.2;
    auto t = make_problem<T>(s);
    std::vector<T> out(static_cast<std::size_t>(t->out_size()));
    AttentionProblem<T> p = t->p;
    p.out = {out.data(), p.nq * p.heads * p.d_v, p.heads * p.d_v, p.d_v};
    const int before = g_eigen_assert_failures.load();
    Eigen::internal::set_is_malloc_allowed(false);
    sdpa::kernels::tiled_attention(p);
    Eigen::internal::set_is_malloc_allowed(true);
    EXPECT_EQ(g_eigen_assert_failures.load(), before) << "d " << d;
    EXPECT_TRUE(outputs_match(out, run_reference(*t))) << "d " << d;
  }
}

// O(N) memory: a long sequence allocates scratch per worker, never anything of nq * nk size.
TEST(TiledMemory, LongSequenceAllocatesNoScoreMatrix) {
  Spec s;
  s.batch = 1;
  s.heads = 1;
  s.nq = 16384;
  s.nk = 16384;
  s.d_k = 4;
  s.d_v = 4;
  auto t = make_problem<float>(s);
  // Causal through a (1, 1, nq, nk) mask would itself be nq * nk bytes: use key padding instead.
  t->mask = sdpa::key_padding_mask({s.nk - 5}, s.nk);
  t->p.mask = sdpa::make_broadcast_view<bool>(&t->mask, {{1, 1, s.nq, s.nk}}, "tiled_test", "mask");
  std::vector<float> out(static_cast<std::size_t>(t->out_size()));
  AttentionProblem<float> p = t->p;
  p.out = {out.data(), p.nq * p.d_v, p.d_v, p.d_v};
  std::size_t largest = 0;
  {
    sdpa_test::alloc::Scope allocations;  // operator new and the library's aligned_alloc
    sdpa::kernels::tiled_attention(p);
    largest = allocations.largest();
  }
  const std::size_t scores = static_cast<std::size_t>(s.nq) * static_cast<std::size_t>(s.nk) * sizeof(float);
  EXPECT_LT(largest, scores / 64) << "largest allocation " << largest;
  for (float x : out) ASSERT_TRUE(std::isfinite(x));
  // Spot-check a few rows against the reference on a cut-down problem with the same first rows.
  AttentionProblem<float> few = t->p;
  few.nq = 3;
  std::vector<float> got(static_cast<std::size_t>(3 * s.d_v)), want(got.size());
  few.out = {got.data(), 3 * s.d_v, s.d_v, s.d_v};
  sdpa::kernels::tiled_attention(few);
  few.out = {want.data(), 3 * s.d_v, s.d_v, s.d_v};
  sdpa::kernels::reference_attention(few);
  EXPECT_TRUE(outputs_match(got, want));
  EXPECT_TRUE(outputs_match(std::vector<float>(out.begin(), out.begin() + 3 * s.d_v), want));
}

}  // namespace tiled_test
