// Tests of the row kernels over stored rows (sdpa/simd/rows.hpp's views, simd/generic_rows.inc,
// simd/generic_int8.inc, simd/portable.hpp through simd/dispatch.hpp) on the path under test (SDPA_ISA):
// widening bfloat16 / float16 / int8 rows, dot products with stored operands, a decoding step's scores and
// weighted sums over stored keys and values against a plain double reference, int8 scores of queries that
// are not finite, and the unrolled and per-head forms giving the general kernels' bits. (The storage types'
// conversions are tested in storage_test.cpp.)
#include "sdpa/simd/dispatch.hpp"
#include "sdpa/storage.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "support/narrow.hpp"
#include "support/reference.hpp"

namespace rows_test {

using Index = Eigen::Index;
using sdpa::Storage;
using sdpa_test::Rng;

constexpr const auto& kNarrow = sdpa_test::narrow::kStorages;

using sdpa_test::bits_of;

// The path under test (SDPA_ISA) widens every pattern as the scalar forms do, at every length and offset.
TEST(StorageConversion, VectorWideningMatchesTheScalarForms) {
  const sdpa::Isa isa = sdpa::active_isa();
  Rng rng(3);
  for (Index cols : {Index(1), Index(7), Index(16), Index(33), Index(64), Index(70)}) {
    const Index rows = 5, lds = cols + 3, ldd = cols + 1, span = (cols + 1) / 2;
    std::vector<sdpa::BFloat16> b(static_cast<std::size_t>(rows * lds));
    std::vector<sdpa::Float16> h(b.size());
    std::vector<std::int8_t> q(b.size());
    std::vector<float> scales(static_cast<std::size_t>(rows * 2));
    for (std::size_t i = 0; i < b.size(); ++i) {
      b[i].bits = static_cast<std::uint16_t>(rng.uniform(0, 65535.99));
      h[i].bits = static_cast<std::uint16_t>(rng.uniform(0, 65535.99));
      q[i] = static_cast<std::int8_t>(rng.uniform(-127, 127.99));
    }
    for (float& s : scales) s = static_cast<float>(rng.uniform(1e-3, 1));
    std::vector<float> out(static_cast<std::size_t>(rows * ldd), -7.0f);
    const auto same = [](float a, float b) { return bits_of(a) == bits_of(b) || (std::isnan(a) && std::isnan(b)); };
    sdpa::simd::widen_rows(isa, sdpa::simd::Rows<sdpa::BFloat16>{b.data(), lds}, rows, cols, cols, out.data(), ldd);
    for (Index r = 0; r < rows; ++r)
      for (Index c = 0; c < cols; ++c)
        ASSERT_TRUE(same(out[static_cast<std::size_t>(r * ldd + c)], sdpa::to_float(b[static_cast<std::size_t>(r * lds + c)])));
    sdpa::simd::widen_rows(isa, sdpa::simd::Rows<sdpa::Float16>{h.data(), lds}, rows, cols, cols, out.data(), ldd);
    for (Index r = 0; r < rows; ++r)
      for (Index c = 0; c < cols; ++c)
        ASSERT_TRUE(same(out[static_cast<std::size_t>(r * ldd + c)], sdpa::to_float(h[static_cast<std::size_t>(r * lds + c)])));
    sdpa::simd::widen_rows(isa, sdpa::simd::Rows<std::int8_t>{q.data(), lds, 0, scales.data(), Index{2}}, rows, cols, span,
                           out.data(), ldd);
    for (Index r = 0; r < rows; ++r)
      for (Index c = 0; c < cols; ++c) {
        const float want = static_cast<float>(q[static_cast<std::size_t>(r * lds + c)]) * scales[static_cast<std::size_t>(r * 2 + c / span)];
        ASSERT_EQ(bits_of(out[static_cast<std::size_t>(r * ldd + c)]), bits_of(want)) << r << ", " << c;
      }
    for (Index r = 0; r < rows; ++r)  // nothing past cols is written
      EXPECT_EQ(out[static_cast<std::size_t>(r * ldd + cols)], -7.0f);
    // dot_stored: the value of dot over the widened row (the vector paths: the same bits).
    std::vector<float> x(static_cast<std::size_t>(cols)), wide(x.size());
    for (float& v : x) v = static_cast<float>(rng.normal());
    for (std::size_t i = 0; i < wide.size(); ++i) {
      b[i].bits = sdpa::to_bfloat16(static_cast<float>(rng.normal())).bits;
      wide[i] = sdpa::to_float(b[i]);
    }
    const float stored = sdpa::simd::dot_stored(isa, b.data(), x.data(), cols);
    const float plain = sdpa::simd::dot(isa, wide.data(), x.data(), cols);
    if (isa != sdpa::Isa::kPortable) {
      EXPECT_EQ(bits_of(stored), bits_of(plain)) << cols;
    }
    EXPECT_NEAR(stored, plain, 1e-5 * (1 + std::fabs(plain)));
  }
}

// dot_rows (the few-row projections: one weight row against several input rows) gives each row the bits of
// dot, or of dot_stored for bfloat16 / float16 weights, on every path: row counts odd and even (every mix of
// dot_row_block's blocks, 3 to 8, and the pairs past them, up to project_few_rows' 16), lengths
// around the vector widths; and those are within rounding of a double-precision sum.
TEST(StorageConversion, DotRowsGiveEachRowTheBitsOfOneDot) {
  const sdpa::Isa isa = sdpa::active_isa();
  Rng rng(19);
  for (Index n : {Index(1), Index(7), Index(8), Index(16), Index(31), Index(64), Index(70), Index(512)})
    for (Index rows : {Index(1), Index(2), Index(3), Index(4), Index(5), Index(6), Index(7), Index(8), Index(9), Index(16)}) {
      const Index ldb = n + 3;
      std::vector<float> a(static_cast<std::size_t>(n)), b(static_cast<std::size_t>(rows * ldb)), out(16, 0.0f);
      for (float& v : a) v = static_cast<float>(rng.normal());
      for (float& v : b) v = static_cast<float>(rng.normal());
      std::vector<double> ad(a.begin(), a.end()), bd(b.begin(), b.end()), outd(16, 0.0);
      std::vector<sdpa::BFloat16> ab(a.size());
      std::vector<sdpa::Float16> ah(a.size());
      for (std::size_t i = 0; i < a.size(); ++i) {
        ab[i] = sdpa::to_bfloat16(a[i]);
        ah[i] = sdpa::to_float16(a[i]);
      }
      const auto check = [&](const char* what, const auto* w, auto one) {
        sdpa::simd::dot_rows(isa, w, b.data(), ldb, rows, n, out.data());
        for (Index r = 0; r < rows; ++r) {
          const float want = one(b.data() + r * ldb);
          ASSERT_EQ(bits_of(out[static_cast<std::size_t>(r)]), bits_of(want)) << what << " n " << n << " row " << r << " of " << rows;
          double exact = 0, norm = 0;
          for (Index c = 0; c < n; ++c) {
            const double p = static_cast<double>(a[static_cast<std::size_t>(c)]) * b[static_cast<std::size_t>(r * ldb + c)];
            exact += p;
            norm += std::fabs(p);
          }
          // bfloat16 / float16 weights: the rounding of a (2^-8 / 2^-11) on top of the sum's.
          ASSERT_NEAR(out[static_cast<std::size_t>(r)], exact, 5e-3 * norm + 1e-6) << what << " n " << n << " row " << r;
        }
      };
      check("float", a.data(), [&](const float* x) { return sdpa::simd::dot(isa, a.data(), x, n); });
      check("bfloat16", ab.data(), [&](const float* x) { return sdpa::simd::dot_stored(isa, ab.data(), x, n); });
      check("float16", ah.data(), [&](const float* x) { return sdpa::simd::dot_stored(isa, ah.data(), x, n); });
      sdpa::simd::dot_rows(isa, ad.data(), bd.data(), ldb, rows, n, outd.data());
      for (Index r = 0; r < rows; ++r)
        ASSERT_EQ(outd[static_cast<std::size_t>(r)], sdpa::simd::dot(isa, ad.data(), bd.data() + r * ldb, n))
            << "double n " << n << " row " << r;
    }
}

// A query as a path with integer products of int8 keys uses it (simd::int8_integer_products): each value
// times 32767 / max |q| rounded to nearest (ties to even), times max |q| / 32767 again; written here from
// that definition, in double.
std::vector<double> int16_rounded(const float* q, Index d) {
  double a = 0;
  for (Index c = 0; c < d; ++c) a = std::max(a, std::fabs(static_cast<double>(q[c])));
  std::vector<double> r(static_cast<std::size_t>(d), 0.0);
  if (a == 0) return r;
  for (Index c = 0; c < d; ++c) r[static_cast<std::size_t>(c)] = std::nearbyint(static_cast<double>(q[c]) * (32767.0 / a)) * (a / 32767.0);
  return r;
}

// The decoding kernel's row products over stored keys and values (the path under test) against a
// double-precision reference on the widened values: every storage, head sizes around the vector widths, a
// short last block of keys, grouped heads, one query per head (at d = 64 and 128: the unrolled kernel,
// unrolled_chunk_scores) and several. int8 keys on a path with integer products: the reference takes the
// query rounded to int16 (int16_rounded), and the scores also lie within that rounding's bound (half a
// step of the query times the key's magnitudes) of the unrounded reference; past the longest such query
// (d = 513) the widened float products as for the other storages.
TEST(StorageConversion, StoredRowProductsMatchADoubleReference) {
  const sdpa::Isa isa = sdpa::active_isa();
  Rng rng(13);
  for (Storage s : kNarrow)
    for (Index nq : {Index(1), Index(2)})
    for (Index d : {Index(1), Index(8), Index(15), Index(16), Index(17), Index(32), Index(48), Index(64), Index(70), Index(128), Index(512), Index(513)}) {
      const bool integer = s == Storage::kInt8 && sdpa::simd::int8_integer_products(isa) && d <= sdpa::kInt16QueryMaxLength;
      const Index n = 37, kv = 2, heads = 4, row = kv * d;
      std::vector<float> x(static_cast<std::size_t>(n * row)), scales(static_cast<std::size_t>(n * kv), 1.0f), wide(x.size());
      for (float& v : x) v = static_cast<float>(rng.normal());
      std::vector<sdpa::BFloat16> b(x.size());
      std::vector<sdpa::Float16> h(x.size());
      std::vector<std::int8_t> q8(x.size());
      for (Index j = 0; j < n; ++j)
        for (Index g = 0; g < kv; ++g) {
          const std::size_t at = static_cast<std::size_t>(j * row + g * d);
          scales[static_cast<std::size_t>(j * kv + g)] = sdpa::quantize_int8(x.data() + at, d, q8.data() + at);
          for (Index c = 0; c < d; ++c) {
            const std::size_t i = at + static_cast<std::size_t>(c);
            b[i] = sdpa::to_bfloat16(x[i]);
            h[i] = sdpa::to_float16(x[i]);
            wide[i] = s == Storage::kBFloat16 ? sdpa::to_float(b[i])
                      : s == Storage::kFloat16 ? sdpa::to_float(h[i])
                                               : static_cast<float>(q8[i]) * scales[static_cast<std::size_t>(j * kv + g)];
          }
        }
      std::vector<float> q(static_cast<std::size_t>(heads * nq * d)), out(static_cast<std::size_t>(heads * nq * 40), 0.0f);
      for (float& v : q) v = static_cast<float>(rng.normal());
      const float* sc = s == Storage::kInt8 ? scales.data() : nullptr;
      const auto scores = [&](const auto* k) {
        using T = std::decay_t<decltype(*k)>;
        sdpa::simd::chunk_scores(isa, sdpa::simd::Rows<T>{k, row, d, sc, kv}, n,
                                 sdpa::simd::Queries<float>{q.data(), nq * d, d, heads, heads / kv, nq, d},
                                 sdpa::simd::Scores<float>{out.data(), 40, 0.5f});
      };
      if (s == Storage::kBFloat16) scores(b.data());
      else if (s == Storage::kFloat16) scores(h.data());
      else scores(q8.data());
      for (Index hh = 0; hh < heads; ++hh)
        for (Index i = 0; i < nq; ++i) {
          const float* qi = q.data() + (hh * nq + i) * d;
          const std::vector<double> qr = int16_rounded(qi, d);
          double step = 0;  // the rounding's step, max |q| / 32767
          for (Index c = 0; c < d; ++c) step = std::max(step, std::fabs(static_cast<double>(qi[c])) / 32767.0);
          for (Index j = 0; j < n; ++j) {
            double want = 0, unrounded = 0, norm = 0, keys = 0;
            for (Index c = 0; c < d; ++c) {
              const double k = wide[static_cast<std::size_t>(j * row + (hh / (heads / kv)) * d + c)];
              const double p = (integer ? qr[static_cast<std::size_t>(c)] : static_cast<double>(qi[c])) * k;
              want += p;
              unrounded += static_cast<double>(qi[c]) * k;
              norm += std::fabs(p);
              keys += std::fabs(k);
            }
            const float got = out[static_cast<std::size_t>((hh * nq + i) * 40 + j)];
            ASSERT_NEAR(got, 0.5 * want, 1e-6 * (1 + norm))
                << sdpa::storage_name(s) << " d " << d << " head " << hh << " query " << i << " key " << j;
            if (integer) {
              ASSERT_NEAR(got, 0.5 * unrounded, 0.5 * (step / 2) * keys + 1e-6 * (1 + norm))
                  << "the query's rounding, d " << d << " head " << hh << " query " << i << " key " << j;
            }
          }
        }
      // acc += sum_j w_j * value row j of head 1, then the natural order back.
      std::vector<float> w(static_cast<std::size_t>(n)), acc(static_cast<std::size_t>(d), 0.25f);
      for (float& v : w) v = static_cast<float>(rng.uniform(0, 1));
      const float* vs = s == Storage::kInt8 ? scales.data() + 1 : nullptr;
      const auto values = [&](const auto* v) {
        using T = std::decay_t<decltype(*v)>;
        sdpa::simd::add_weighted_rows_stored(isa, acc.data(), d, w.data(), sdpa::simd::Rows<T>{v + d, row, 0, vs, kv}, n);
      };
      if (s == Storage::kBFloat16) values(b.data());
      else if (s == Storage::kFloat16) values(h.data());
      else values(q8.data());
      if (s == Storage::kBFloat16) sdpa::simd::unpair_features(isa, acc.data(), d);
      for (Index c = 0; c < d; ++c) {
        double want = 0.25, norm = 0.25;
        for (Index j = 0; j < n; ++j) {
          const double p = static_cast<double>(w[static_cast<std::size_t>(j)]) * wide[static_cast<std::size_t>(j * row + d + c)];
          want += p;
          norm += std::fabs(p);
        }
        ASSERT_NEAR(acc[static_cast<std::size_t>(c)], want, 1e-6 * (1 + norm)) << sdpa::storage_name(s) << " d " << d << " feature " << c;
      }
    }
}

// int8 keys against queries that are not finite (a path with integer products takes the widened float
// products for them): a NaN or an infinity reaches the scores as in a float cache of the widened keys (NaN
// where an infinity meets a zero key entry or one of the other sign, the infinity's sign otherwise), and the
// finite queries of the same call keep their scores.
TEST(StorageConversion, Int8ScoresOfQueriesThatAreNotFinite) {
  const sdpa::Isa isa = sdpa::active_isa();
  Rng rng(14);
  const Index n = 21, heads = 4, d = 64;
  std::vector<std::int8_t> k(static_cast<std::size_t>(n * heads * d));
  std::vector<float> scales(static_cast<std::size_t>(n * heads));
  for (auto& v : k) v = static_cast<std::int8_t>(std::lround(rng.uniform(-127, 127)));
  for (Index j = 0; j < n; j += 3)
    for (Index h = 0; h < heads; ++h) k[static_cast<std::size_t>((j * heads + h) * d + 3)] = 0;
  for (auto& v : scales) v = static_cast<float>(rng.uniform(0.001, 0.01));
  std::vector<float> q(static_cast<std::size_t>(heads * d)), out(static_cast<std::size_t>(heads * n), 0.0f);
  for (float& v : q) v = static_cast<float>(rng.normal());
  const float inf = std::numeric_limits<float>::infinity();
  q[static_cast<std::size_t>(1 * d + 3)] = inf;
  q[static_cast<std::size_t>(2 * d + 10)] = std::numeric_limits<float>::quiet_NaN();
  q[static_cast<std::size_t>(3 * d + 0)] = -inf;
  q[static_cast<std::size_t>(3 * d + 1)] = inf;
  sdpa::simd::chunk_scores(isa, sdpa::simd::Rows<std::int8_t>{k.data(), heads * d, d, scales.data(), heads}, n,
                           sdpa::simd::Queries<float>{q.data(), d, d, heads, Index{1}, Index{1}, d},
                           sdpa::simd::Scores<float>{out.data(), n, 0.5f});
  for (Index h = 0; h < heads; ++h)
    for (Index j = 0; j < n; ++j) {
      double want = 0, norm = 0;
      const double ks = scales[static_cast<std::size_t>(j * heads + h)];
      for (Index c = 0; c < d; ++c) {
        const double p = static_cast<double>(q[static_cast<std::size_t>(h * d + c)]) * k[static_cast<std::size_t>((j * heads + h) * d + c)] * ks;
        want += p;
        norm += std::fabs(p);
      }
      const float got = out[static_cast<std::size_t>(h * n + j)];
      if (h == 0) {
        EXPECT_NEAR(got, 0.5 * want, 1e-4 * (1 + norm)) << "key " << j;  // (the int16 rounding's bound and more)
      } else {
        EXPECT_EQ(std::isnan(got), std::isnan(want)) << "head " << h << " key " << j << ": " << got << " against " << want;
        if (!std::isnan(want)) {
          EXPECT_EQ(got, 0.5 * want) << "head " << h << " key " << j;
        }
      }
    }
  // A finite query whose rounding factor times the scale passes float's range: an all-zero key still
  // scores 0 (as its widened products do), not 0 * infinity.
  std::vector<float> big(static_cast<std::size_t>(d), 1e30f);
  std::vector<std::int8_t> zero_key(static_cast<std::size_t>(d), 0);
  std::vector<float> one_scale(1, 0.01f), got(1, -1.0f);
  sdpa::simd::chunk_scores(isa, sdpa::simd::Rows<std::int8_t>{zero_key.data(), d, d, one_scale.data(), Index{1}}, Index{1},
                           sdpa::simd::Queries<float>{big.data(), d, d, Index{1}, Index{1}, Index{1}, d},
                           sdpa::simd::Scores<float>{got.data(), Index{1}, 1e20f});
  EXPECT_EQ(got[0], 0.0f);
}

// Normal entries and per-(row, head) scales in [0.001, 0.1], drawn in that order, stored as every narrow
// type: bfloat16 and float16 rounded, int8 as round(40 x) within +-127 (a pattern, not a quantisation).
struct NarrowRows {
  std::vector<float> x, scales;
  std::vector<sdpa::BFloat16> b;
  std::vector<sdpa::Float16> h;
  std::vector<std::int8_t> q8;

  NarrowRows(Rng& rng, Index entries, Index scale_count)
      : x(static_cast<std::size_t>(entries)), scales(static_cast<std::size_t>(scale_count)), b(x.size()), h(x.size()), q8(x.size()) {
    for (float& v : x) v = static_cast<float>(rng.normal());
    for (float& v : scales) v = static_cast<float>(rng.uniform(0.001, 0.1));
    for (std::size_t i = 0; i < x.size(); ++i) {
      b[i] = sdpa::to_bfloat16(x[i]);
      h[i] = sdpa::to_float16(x[i]);
      q8[i] = static_cast<std::int8_t>(std::lround(std::max(-127.0f, std::min(127.0f, 40 * x[i]))));
    }
  }
  // f(rows) with the rows as storage s's type.
  template <typename F>
  void with(Storage s, F&& f) const {
    if (s == Storage::kBFloat16) f(b.data());
    else if (s == Storage::kFloat16) f(h.data());
    else f(q8.data());
  }
};

// Stored keys at d = 64 and 128 with one query per head go through the unrolled kernel for whole blocks of
// keys (unrolled_chunk_scores) and the general one for the rest: every key's score has the bits that the
// general kernel gives it alone (a call of one key), for every storage on every path (the test runs once
// per path).
TEST(StorageConversion, UnrolledScoresGiveTheGeneralKernelsBits) {
  const sdpa::Isa isa = sdpa::active_isa();
  Rng rng(17);
  for (Storage s : kNarrow)
    for (Index d : {Index(64), Index(128)}) {
      const Index n = 45, kv = 2, heads = 6, row = kv * d;
      const NarrowRows rows(rng, n * row, n * kv);
      const std::vector<float>& scales = rows.scales;
      std::vector<float> q(static_cast<std::size_t>(heads * d));
      for (float& v : q) v = static_cast<float>(rng.normal());
      const Index lds = 48;
      std::vector<float> all(static_cast<std::size_t>(heads * lds), 0.0f), one(all.size(), 0.0f);
      const float* sc = s == Storage::kInt8 ? scales.data() : nullptr;
      const auto check = [&](const auto* k) {
        using T = std::decay_t<decltype(*k)>;
        const sdpa::simd::Rows<T> keys{k, row, d, sc, kv};
        const sdpa::simd::Queries<float> queries{q.data(), d, d, heads, heads / kv, 1, d};
        sdpa::simd::chunk_scores(isa, keys, n, queries, sdpa::simd::Scores<float>{all.data(), lds, 0.125f});
        for (Index j = 0; j < n; ++j)
          sdpa::simd::chunk_scores(isa, keys.at(j), 1, queries, sdpa::simd::Scores<float>{one.data() + j, lds, 0.125f});
      };
      rows.with(s, check);
      for (Index hh = 0; hh < heads; ++hh)
        for (Index j = 0; j < n; ++j) {
          const std::size_t at = static_cast<std::size_t>(hh * lds + j);
          ASSERT_NE(all[at], 0.0f);
          ASSERT_EQ(bits_of(all[at]), bits_of(one[at]))
              << sdpa::storage_name(s) << " " << sdpa::isa_name(isa) << " d " << d << " head " << hh << " key " << j;
        }
    }
}

// add_weighted_rows_stored_heads (the decoding step's value rows for every head at once) gives each head the
// bits of one add_weighted_rows_stored call over its value head's rows (grouped heads, int8 scales, blocks of
// 16 and short ones, head sizes with and without a tail).
TEST(StorageConversion, StoredValueRowsForEveryHeadGiveEachHeadsBits) {
  const sdpa::Isa isa = sdpa::active_isa();
  Rng rng(19);
  for (Storage s : kNarrow)
    for (Index d : {Index(48), Index(64), Index(70)})
      for (Index group : {Index(1), Index(2), Index(3)})
        for (Index m : {Index(16), Index(5)}) {
          const Index kv = 2, heads = kv * group, row = kv * d, n = 24, lw = 20;
          const NarrowRows rows(rng, n * row, n * kv);
          const std::vector<float>& scales = rows.scales;
          std::vector<float> w(static_cast<std::size_t>(heads * lw));
          for (float& v : w) v = static_cast<float>(rng.uniform(0, 1));
          const Index la = d + 3;  // accumulators apart by more than d
          std::vector<float> all(static_cast<std::size_t>(heads * la)), one(all.size());
          for (std::size_t i = 0; i < all.size(); ++i) all[i] = one[i] = static_cast<float>(rng.normal());
          const float* sc = s == Storage::kInt8 ? scales.data() : nullptr;
          const auto check = [&](const auto* v) {
            // From row 2, with the rest of the rows as the prefetched ones.
            const auto* v2 = v + 2 * row;
            const float* sc2 = sc == nullptr ? nullptr : sc + 2 * kv;
            using T = std::decay_t<decltype(*v)>;
            const sdpa::simd::Rows<T> values{v2, row, d, sc2, kv};
            sdpa::simd::add_weighted_rows_stored_heads(isa, sdpa::simd::HeadSums<float>{all.data(), la, w.data(), lw, heads, group},
                                                       d, values, m, std::min<Index>(16, n - 2 - m));
            for (Index hh = 0; hh < heads; ++hh)
              sdpa::simd::add_weighted_rows_stored(isa, one.data() + hh * la, d, w.data() + hh * lw, values.at(0, hh / group), m);
          };
          rows.with(s, check);
          for (std::size_t i = 0; i < all.size(); ++i)
            ASSERT_EQ(bits_of(all[i]), bits_of(one[i])) << sdpa::storage_name(s) << " " << sdpa::isa_name(isa) << " d " << d
                                                        << " group " << group << " rows " << m << " entry " << i;
        }
}

}  // namespace rows_test
