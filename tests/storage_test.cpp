// Tests of sdpa/storage.hpp and of what stores through it: the bfloat16 / float16 conversions against a
// plain double-precision reference (nearest value, ties to even, overflow, subnormals, NaN), every half
// widened exactly; int8 quantisation's bound (the row kernels over stored rows: rows_test.cpp); KVCache<float>
// with bfloat16, float16 and int8
// entries: its bytes, its entries equal to the float cache's rounded ones, its kernels (the decoding and the
// tiled one) giving what a float cache of the widened entries gives, a 256-token decode within the issue's
// bounds of the float cache on random and on peaked attention, rolling windows, truncate, reorder,
// grouped-query heads with rotary, thread counts, no allocation in a step, and refusals; module weights
// stored as bfloat16 / float16: forward and decoding equal to the float module with rounded weights, init,
// training refused. (Saving and loading them: safetensors_test.cpp.)
#include "support/alloc_tracking.hpp"

#include "sdpa/storage.hpp"

#include "sdpa/kv_cache.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "support/narrow.hpp"
#include "support/reference.hpp"

namespace storage_test {

using Index = Eigen::Index;
using sdpa::Storage;
using sdpa_test::expect_invalid;
using sdpa_test::Rng;
using Tensor3 = Eigen::Tensor<float, 3, Eigen::RowMajor>;
using Module = sdpa::ScaledDotProductAttention<float>;
using Cache = sdpa::KVCache<float>;
using sdpa_test::narrow::make_module;
using sdpa_test::narrow::max_abs_diff;
using sdpa_test::narrow::max_rel;
using sdpa_test::narrow::random3;
using sdpa_test::narrow::rounded;

constexpr const auto& kNarrow = sdpa_test::narrow::kStorages;

using sdpa_test::bits_of;

float float_of(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---- Plain references, in double ----

// The value of a binary16 bit pattern, from its definition (NaN for NaN patterns).
double half_value(std::uint16_t h) {
  const int sign = (h >> 15) ? -1 : 1, e = (h >> 10) & 0x1F, m = h & 0x3FF;
  if (e == 0x1F) return m != 0 ? std::numeric_limits<double>::quiet_NaN() : sign * std::numeric_limits<double>::infinity();
  if (e == 0) return sign * std::ldexp(m, -24);
  return sign * std::ldexp(1024 + m, e - 25);
}

// The value of a bfloat16 bit pattern, from its definition: sign, 8 exponent bits, 7 mantissa bits.
double bfloat16_value(std::uint16_t b) {
  const int sign = (b >> 15) ? -1 : 1, e = (b >> 7) & 0xFF, m = b & 0x7F;
  if (e == 0xFF) return m != 0 ? std::numeric_limits<double>::quiet_NaN() : sign * std::numeric_limits<double>::infinity();
  if (e == 0) return sign * std::ldexp(m, -133);
  return sign * std::ldexp(128 + m, e - 134);
}

// The bit pattern nearest x among all finite patterns of a format (value(bits)), ties to the even pattern,
// and +-inf where IEEE rounding overflows: |x| at or past the largest finite value plus half its spacing.
template <typename Value>
std::uint16_t nearest(double x, Value value, std::uint16_t inf_bits) {
  const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(x);
  // The largest finite magnitude and the one past it (what the exponent's next power would be).
  const std::uint16_t max_bits = static_cast<std::uint16_t>(inf_bits - 1);
  const double max = value(max_bits);
  const double spacing = max - value(static_cast<std::uint16_t>(max_bits - 1));
  if (a >= max + spacing / 2) return static_cast<std::uint16_t>(sign | inf_bits);
  // Binary search for the largest pattern whose value is <= a (magnitudes are monotone in the bits).
  std::uint16_t lo = 0, hi = max_bits;
  while (lo < hi) {
    const std::uint16_t mid = static_cast<std::uint16_t>((lo + hi + 1) / 2);
    if (value(mid) <= a) lo = mid;
    else hi = static_cast<std::uint16_t>(mid - 1);
  }
  std::uint16_t best = lo;
  if (lo < max_bits) {
    const double d_lo = a - value(lo), d_hi = value(static_cast<std::uint16_t>(lo + 1)) - a;
    if (d_hi < d_lo || (d_hi == d_lo && (lo & 1))) best = static_cast<std::uint16_t>(lo + 1);
  }
  return static_cast<std::uint16_t>(sign | best);
}

// Floats that probe the conversions: random ones over many magnitudes, exact midpoints between
// neighbouring halves / bfloat16s (ties), the edges of the formats, zeros, infinities.
std::vector<float> probe_floats(Rng& rng) {
  std::vector<float> v = {0.0f, -0.0f, 1.0f, -1.0f, 65504.0f, 65519.0f, 65520.0f, 65536.0f, -65520.0f, 1e-8f, -1e-8f,
                          std::ldexp(1.0f, -24), std::ldexp(1.0f, -25), std::ldexp(1.5f, -25), std::ldexp(1.0f, -14),
                          std::ldexp(1023.0f, -24), std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
                          std::numeric_limits<float>::min(), std::numeric_limits<float>::denorm_min(),
                          std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()};
  for (int i = 0; i < 20000; ++i) {
    const double mag = std::ldexp(rng.uniform(1.0, 2.0), static_cast<int>(rng.uniform(-30, 20)));
    v.push_back(static_cast<float>(rng.bernoulli(0.5) ? mag : -mag));
    v.push_back(float_of(static_cast<std::uint32_t>(rng.uniform(0, 4294967295.0))));  // any bits (NaNs too)
  }
  for (int i = 0; i < 2000; ++i) {  // ties: the midpoint of two neighbours is exact in float
    const std::uint16_t h = static_cast<std::uint16_t>(rng.uniform(0, 0x7BFE));
    v.push_back(static_cast<float>((half_value(h) + half_value(static_cast<std::uint16_t>(h + 1))) / 2));
    const std::uint16_t b = static_cast<std::uint16_t>(rng.uniform(0, 0x7F7E));
    v.push_back(static_cast<float>((bfloat16_value(b) + bfloat16_value(static_cast<std::uint16_t>(b + 1))) / 2));
  }
  return v;
}

TEST(StorageConversion, EveryHalfWidensExactly) {
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const double want = half_value(static_cast<std::uint16_t>(h));
    const float got = sdpa::half_to_float(static_cast<std::uint16_t>(h));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << std::hex << h;
      ASSERT_EQ(bits_of(got) >> 31, h >> 15) << "the sign of NaN " << std::hex << h;
      continue;
    }
    ASSERT_EQ(static_cast<double>(got), want) << std::hex << h;
    ASSERT_EQ(std::signbit(got), (h >> 15) != 0) << std::hex << h;
    // And back: every half is a float, so the round trip is the identity.
    ASSERT_EQ(sdpa::to_float16(got).bits, h) << std::hex << h;
  }
}

TEST(StorageConversion, EveryBFloat16WidensExactly) {
  for (std::uint32_t b = 0; b < 0x10000; ++b) {
    const double want = bfloat16_value(static_cast<std::uint16_t>(b));
    const float got = sdpa::bfloat16_to_float(static_cast<std::uint16_t>(b));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got));
      continue;
    }
    ASSERT_EQ(static_cast<double>(got), want) << std::hex << b;
    ASSERT_EQ(sdpa::to_bfloat16(got).bits, b) << std::hex << b;
  }
}

TEST(StorageConversion, RoundsToTheNearestTiesToEven) {
  Rng rng(1);
  for (const float x : probe_floats(rng)) {
    const sdpa::Float16 h = sdpa::to_float16(x);
    const sdpa::BFloat16 b = sdpa::to_bfloat16(x);
    if (std::isnan(x)) {
      EXPECT_TRUE(std::isnan(sdpa::half_to_float(h.bits)));
      EXPECT_TRUE(std::isnan(sdpa::bfloat16_to_float(b.bits)));
      EXPECT_EQ(h.bits >> 15, bits_of(x) >> 31);
      EXPECT_EQ(b.bits >> 15, bits_of(x) >> 31);
      continue;
    }
    const std::uint16_t want_h = std::isinf(x) ? static_cast<std::uint16_t>((x < 0 ? 0x8000 : 0) | 0x7C00)
                                               : nearest(static_cast<double>(x), half_value, 0x7C00);
    const std::uint16_t want_b = std::isinf(x) ? static_cast<std::uint16_t>((x < 0 ? 0x8000 : 0) | 0x7F80)
                                               : nearest(static_cast<double>(x), bfloat16_value, 0x7F80);
    ASSERT_EQ(h.bits, want_h) << "float16 of " << x << " (bits " << std::hex << bits_of(x) << ")";
    ASSERT_EQ(b.bits, want_b) << "bfloat16 of " << x << " (bits " << std::hex << bits_of(x) << ")";
  }
}

TEST(StorageConversion, Int8QuantisationIsWithinHalfAStep) {
  Rng rng(2);
  for (int trial = 0; trial < 200; ++trial) {
    const Index n = 1 + trial % 70;
    std::vector<float> x(static_cast<std::size_t>(n));
    const double spread = std::ldexp(1.0, trial % 20 - 10);
    for (float& v : x) v = static_cast<float>(rng.normal(spread));
    std::vector<std::int8_t> q(x.size());
    const float scale = sdpa::quantize_int8(x.data(), n, q.data());
    double amax = 0;
    for (float v : x) amax = std::max(amax, std::fabs(static_cast<double>(v)));
    EXPECT_NEAR(scale, amax / 127, amax / 127 * 1e-6);
    for (std::size_t i = 0; i < x.size(); ++i) {
      EXPECT_GE(q[i], -127);
      EXPECT_LE(std::fabs(static_cast<double>(x[i]) - static_cast<double>(scale) * q[i]), 0.5 * scale * (1 + 1e-5) + 1e-30)
          << "value " << i << " of trial " << trial;
    }
  }
  std::vector<float> zeros(5, 0.0f), bad = {1.0f, std::numeric_limits<float>::quiet_NaN(), 2.0f};
  std::vector<std::int8_t> q(5, 9);
  EXPECT_EQ(sdpa::quantize_int8(zeros.data(), 5, q.data()), 0.0f);
  for (auto v : q) EXPECT_EQ(v, 0);
  EXPECT_TRUE(std::isnan(sdpa::quantize_int8(bad.data(), 3, q.data())));  // reads back as NaN, never lost
  bad[1] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(std::isnan(sdpa::quantize_int8(bad.data(), 3, q.data())));
}

// ---- Key/value caches ----

class NarrowCache : public ::testing::TestWithParam<Storage> {};

// Bytes: exactly half for bfloat16 / float16, (d + 4) / (4 d) for int8 with its scales.
TEST_P(NarrowCache, Bytes) {
  Rng rng(4);
  const Module m = make_module(rng, 64, 64, 8, 8);
  const Cache f(m, 3, 100), n(m, 3, 100, GetParam());
  EXPECT_EQ(n.storage(), GetParam());
  const double ratio = static_cast<double>(n.bytes()) / static_cast<double>(f.bytes());
  EXPECT_EQ(f.bytes(), std::size_t{3 * 100 * 8 * (64 + 64) * 4});
  if (GetParam() == Storage::kInt8) {
    EXPECT_DOUBLE_EQ(ratio, (64.0 + 4) / (4 * 64));
    EXPECT_LE(ratio, 0.27);
  } else {
    EXPECT_DOUBLE_EQ(ratio, 0.5);
  }
}

// The entries are the float cache's rounded to the storage (keys after rotary), and the kernels give what a
// float cache holding exactly those values gives: one query (the decoding kernel) and many (tiled).
TEST_P(NarrowCache, EntriesAreRoundedAndKernelsReadThem) {
  const Storage s = GetParam();
  Rng rng(5);
  Module m = make_module(rng, 96, 48, 4, 2);  // d 48: paired and single vectors, and a tail on AVX-512
  m.set_rotary(sdpa::rope_llama3(32, 10000, 8, 1, 4, 64));
  const Index batch = 2;
  Cache f(m, batch), n(m, batch, 0, s);
  const Tensor3 prompt = random3(rng, batch, 300, 96);
  (void)m.step(prompt, f);
  (void)m.step(prompt, n);
  EXPECT_EQ(max_abs_diff(n.keys(), rounded(f.keys(), s, 48)), 0.0);
  EXPECT_EQ(max_abs_diff(n.values(), rounded(f.values(), s, 48)), 0.0);
  // A float cache with the widened entries.
  Cache w(m, batch);
  w.assign(n.keys(), n.values(), n.position());
  sdpa::AttentionOptions<float> o;
  o.alibi_slopes = sdpa::alibi_slopes<float>(4);
  o.softcap = 20;
  o.sinks = std::vector<float>(4, 0.5f);
  for (Index nq : {Index(1), Index(5), Index(40)}) {
    const Tensor3 q = random3(rng, batch, nq, 96);
    o.causal = nq > 1;
    // The tiled kernel (40 queries) widens a key block and packs it: the same bits. The decoding kernel
    // widens in registers: float16 the same bits; bfloat16 sums the features as even and odd ones, and int8
    // applies a key's scale after its sum (a value's to its weight), so they round differently; where the
    // path sums int8 keys' products in integers, against the query rounded to int16 (a relative step of
    // 2^-15 of its largest entry), the outputs move by up to about that much.
    const bool exact = nq > 16 || s == Storage::kFloat16 || sdpa::active_isa() == sdpa::Isa::kPortable;
    const bool integer = s == Storage::kInt8 && sdpa::simd::int8_integer_products(sdpa::active_isa());
    const double tol = exact ? 0.0 : integer ? 1e-4 : 2e-6;
    const Tensor3 a = m.attend(q, n, o), b = m.attend(q, w, o);
    EXPECT_LE(max_rel(a, b), tol) << sdpa::storage_name(s) << ", " << nq << " queries";
    // Probabilities come from the same widened keys.
    Eigen::Tensor<float, 4, Eigen::RowMajor> pa, pb;
    o.probabilities = &pa;
    (void)m.attend(q, n, o);
    o.probabilities = &pb;
    (void)m.attend(q, w, o);
    o.probabilities = nullptr;
    double d = 0;
    for (Index i = 0; i < pa.size(); ++i) d = std::max(d, std::fabs(static_cast<double>(pa.data()[i]) - pb.data()[i]));
    EXPECT_LE(d, tol) << "probabilities, " << nq << " queries";
  }
  // Steps on 1 and 2 threads give the same bits.
  Eigen::ThreadPool pool(2);
  Eigen::ThreadPoolDevice device(&pool, 2);
  Cache n2(m, batch, 0, s);
  (void)m.step(prompt, n2);
  sdpa::AttentionOptions<float> threaded;
  threaded.device = &device;
  const Tensor3 t = random3(rng, batch, 1, 96);
  EXPECT_EQ(max_abs_diff(m.step(t, n), m.step(t, n2, threaded)), 0.0);
}

// A step whose every row sees the same keys (no mask, not causal) takes the value rows for all heads at once,
// one call per query: it gives what a float cache of the widened entries gives (grouped heads, a batch of two,
// one to three queries, key lengths that differ between the batch entries).
TEST_P(NarrowCache, EveryHeadAtOnceReadsTheWidenedEntries) {
  const Storage s = GetParam();
  Rng rng(21);
  const Module m = make_module(rng, 128, 32, 4, 2);
  const Index batch = 2;
  Cache n(m, batch, 0, s);
  (void)m.step(random3(rng, batch, 300, 128), n);
  Cache w(m, batch);
  w.assign(n.keys(), n.values(), n.position());
  const bool exact = s == Storage::kFloat16 || sdpa::active_isa() == sdpa::Isa::kPortable;
  const bool integer = s == Storage::kInt8 && sdpa::simd::int8_integer_products(sdpa::active_isa());
  const double tol = exact ? 0.0 : integer ? 1e-4 : 2e-6;
  for (bool lengths : {false, true})
    for (Index nq : {Index(1), Index(2), Index(3)}) {
      sdpa::AttentionOptions<float> o;
      if (lengths) o.key_lengths = {300, 131};
      const Tensor3 q = random3(rng, batch, nq, 128);
      EXPECT_LE(max_rel(m.attend(q, n, o), m.attend(q, w, o)), tol)
          << sdpa::storage_name(s) << ", " << nq << " queries" << (lengths ? ", key lengths" : "");
    }
}

// A 256-token decode against the float cache, on random and on peaked attention (queries scaled so that the
// largest logits are in the tens): the bounds on the relative max-norm error.
TEST_P(NarrowCache, DecodeErrorAgainstTheFloatCache) {
  const Storage s = GetParam();
  const double bound = s == Storage::kBFloat16 ? 1e-2 : s == Storage::kFloat16 ? 2e-3 : 3e-2;
  for (double q_scale : {1.0, 8.0}) {
    Rng rng(6);
    const Module m = make_module(rng, 128, 32, 4, 4, q_scale);
    Cache f(m, 1), n(m, 1, 0, s);
    const Tensor3 prompt = random3(rng, 1, 64, 128);
    (void)m.step(prompt, f);
    (void)m.step(prompt, n);
    Tensor3 yf(1, 256, 128), yn(1, 256, 128);
    for (Index t = 0; t < 256; ++t) {
      const Tensor3 x = random3(rng, 1, 1, 128);
      const Tensor3 a = m.step(x, f), b = m.step(x, n);
      for (Index d = 0; d < 128; ++d) {
        yf(0, t, d) = a(0, 0, d);
        yn(0, t, d) = b(0, 0, d);
      }
    }
    const double err = max_rel(yn, yf);
    EXPECT_LE(err, bound) << sdpa::storage_name(s) << ", queries scaled by " << q_scale;
    EXPECT_GT(err, 0.0);  // it is a different cache
    std::printf("[ info ] %s cache, queries x%g: relative max-norm error %.3g over 256 steps\n", sdpa::storage_name(s),
                q_scale, err);
  }
}

// Sliding windows (the rolling buffer), truncate and reorder keep the entries as stored.
TEST_P(NarrowCache, WindowsTruncateReorder) {
  const Storage s = GetParam();
  Rng rng(7);
  const Module m = make_module(rng, 32, 8, 4, 2);
  Cache f(m, 3), n(m, 3, 0, s);
  sdpa::AttentionOptions<float> o;
  o.window_left = 20;
  for (int t = 0; t < 100; ++t) {
    const Tensor3 x = random3(rng, 3, 1 + t % 3, 32);
    const Tensor3 a = m.step(x, f, o), b = m.step(x, n, o);
    ASSERT_LE(max_rel(b, a), 3e-2) << "step " << t;
  }
  EXPECT_LE(n.size(), 2 * 21 + 3);  // the window's entries, not the sequence
  EXPECT_EQ(n.position(), f.position());
  EXPECT_EQ(max_abs_diff(n.keys(), rounded(f.keys(), s, 8)), 0.0);
  const Tensor3 keys = n.keys(), values = n.values();
  // truncate: the oldest entries stay as they were.
  n.truncate(n.size() - 4);
  const Tensor3 kt = n.keys();
  for (Index b = 0; b < 3; ++b)
    for (Index i = 0; i < n.size(); ++i)
      for (Index c = 0; c < kt.dimension(2); ++c) ASSERT_EQ(kt(b, i, c), keys(b, i, c));
  // reorder: sequences move whole.
  n.reorder({2, 0, 2, 1});
  const Tensor3 kr = n.keys(), vr = n.values();
  const Index order[4] = {2, 0, 2, 1};
  for (Index b = 0; b < 4; ++b)
    for (Index i = 0; i < n.size(); ++i) {
      for (Index c = 0; c < kr.dimension(2); ++c) ASSERT_EQ(kr(b, i, c), keys(order[b], i, c));
      for (Index c = 0; c < vr.dimension(2); ++c) ASSERT_EQ(vr(b, i, c), values(order[b], i, c));
    }
}

// step() in chunks with grouped-query heads and rotary equals the causal forward within the storage's error.
TEST_P(NarrowCache, ChunkedStepsFollowTheCausalForward) {
  const Storage s = GetParam();
  Rng rng(8);
  Module m = make_module(rng, 64, 16, 8, 2);
  m.set_rotary(sdpa::rope_yarn(16, 10000, 4, 64));
  const Tensor3 x = random3(rng, 2, 80, 64);
  sdpa::AttentionOptions<float> causal;
  causal.causal = true;
  const Tensor3 full = m.forward(x, x, x, causal);
  Cache n(m, 2, 0, s);
  Tensor3 out(2, 80, 64);
  Index t0 = 0;
  for (Index size : {Index(1), Index(30), Index(3), Index(17), Index(29)}) {
    const Eigen::array<Index, 3> off{0, t0, 0}, ext{2, size, 64};
    const Tensor3 chunk = x.slice(off, ext);
    const Tensor3 y = m.step(chunk, n);
    out.slice(off, ext) = y;
    t0 += size;
  }
  EXPECT_LE(max_rel(out, full), 3e-2);
}

// Once the cache has room, a step allocates nothing (operator new and the library's aligned_alloc).
TEST_P(NarrowCache, StepsWithRoomAllocateNothing) {
  Rng rng(9);
  const Module m = make_module(rng, 32, 8, 4, 2);
  Cache n(m, 2, 600, GetParam());
  (void)m.step(random3(rng, 2, 300, 32), n);
  const Tensor3 token = random3(rng, 2, 1, 32);
  std::vector<float> out(64);
  Eigen::TensorMap<Tensor3> out_map(out.data(), 2, 1, 32);
  m.step(token, n, {}, out_map);
  sdpa_test::alloc::Scope scope;
  for (int i = 0; i < 10; ++i) m.step(token, n, {}, out_map);
  EXPECT_EQ(scope.count(), 0);
}

INSTANTIATE_TEST_SUITE_P(Storages, NarrowCache, ::testing::ValuesIn(kNarrow),
                         [](const ::testing::TestParamInfo<Storage>& i) { return std::string(sdpa::storage_name(i.param)).substr(1); });

TEST(NarrowCacheRefusals, NameTheStorageAndTheKernel) {
  Rng rng(10);
  Module m = make_module(rng, 32, 8, 4, 2);
  expect_invalid([&] { Cache c(m, 1, 0, Storage::kFloat64); }, {"KVCache", "storage", "kFloat64"});
  expect_invalid([&] { Cache c(m, 1, 0, static_cast<Storage>(99)); }, {"KVCache", "storage", "99"});
  sdpa::ScaledDotProductAttention<double> md(32, 8, 8, 4);
  expect_invalid([&] { sdpa::KVCache<double> c(md, 1, 0, Storage::kBFloat16); },
                 {"KVCache", "storage", "kFloat64", "kBFloat16"});
  Cache n(m, 1, 0, Storage::kInt8);
  (void)m.step(random3(rng, 1, 5, 32), n);
  m.set_kernel(sdpa::Kernel::kReference);
  const Tensor3 x = random3(rng, 1, 1, 32);
  expect_invalid([&] { (void)m.step(x, n); }, {"ScaledDotProductAttention::step", "kReference", "kInt8"});
  expect_invalid([&] { (void)m.attend(x, n); }, {"ScaledDotProductAttention::attend", "kReference"});
  EXPECT_EQ(n.size(), 5);  // nothing appended
  m.set_kernel(sdpa::Kernel::kTiled);  // the tiled kernel reads a narrow cache also for one query
  const Tensor3 tiled = m.attend(x, n);
  m.set_kernel(sdpa::Kernel::kAuto);
  // (The decoding kernel: int8 keys' products in integers against the query rounded to int16 where the
  // path has them.)
  EXPECT_LE(max_rel(tiled, m.attend(x, n)), sdpa::simd::int8_integer_products(sdpa::active_isa()) ? 1e-4 : 1e-5);
}

// ---- Module weights ----

class NarrowWeights : public ::testing::TestWithParam<Storage> {};

// Forward, decoding steps and attend with bfloat16 / float16 weights compute what the float module with the
// rounded weights computes (the same bits on the vector paths: the products widen while they pack).
TEST_P(NarrowWeights, ComputeTheFloatModuleOfTheRoundedWeights) {
  const Storage s = GetParam();
  Rng rng(11);
  const Module base = make_module(rng, 64, 16, 8, 2);
  Module narrow = base;
  narrow.set_weight_storage(s);
  EXPECT_EQ(narrow.weight_storage(), s);
  Module rounded_module = base;
  for (auto* l : {&rounded_module.fc_q(), &rounded_module.fc_k(), &rounded_module.fc_v(), &rounded_module.fc_o()})
    for (Index i = 0; i < l->weight().size(); ++i) {
      float& w = l->weight().data()[i];
      w = s == Storage::kBFloat16 ? sdpa::to_float(sdpa::to_bfloat16(w)) : sdpa::to_float(sdpa::to_float16(w));
    }
  // weight_values() are the rounded weights.
  const auto wv = narrow.fc_k().weight_values();
  for (Index i = 0; i < wv.size(); ++i) ASSERT_EQ(wv.data()[i], rounded_module.fc_k().weight().data()[i]);
  const bool exact = sdpa::active_isa() != sdpa::Isa::kPortable;
  const double tol = exact ? 0.0 : 1e-5;
  const Tensor3 x = random3(rng, 2, 70, 64), m2 = random3(rng, 2, 9, 64);
  EXPECT_LE(max_rel(narrow(x, x, x), rounded_module(x, x, x)), tol);
  EXPECT_LE(max_rel(narrow(x, m2, m2), rounded_module(x, m2, m2)), tol);
  EXPECT_GT(max_rel(narrow(x, x, x), base(x, x, x)), 0.0);
  Cache a(narrow, 2, 0, Storage::kBFloat16), b(rounded_module, 2, 0, Storage::kBFloat16);
  EXPECT_LE(max_rel(narrow.step(x, a), rounded_module.step(x, b)), tol);
  for (int t = 0; t < 5; ++t) {
    const Tensor3 token = random3(rng, 2, 1, 64);
    EXPECT_LE(max_rel(narrow.step(token, a), rounded_module.step(token, b)), tol) << "step " << t;
  }
  EXPECT_LE(max_rel(narrow.attend(m2, a), rounded_module.attend(m2, b)), tol);
  // Back to float: exactly the rounded weights.
  narrow.set_weight_storage(Storage::kFloat32);
  for (Index i = 0; i < wv.size(); ++i) ASSERT_EQ(narrow.fc_k().weight().data()[i], wv.data()[i]);
}

// init_weights on a narrow module draws in float and rounds.
TEST_P(NarrowWeights, InitDrawsInFloatAndRounds) {
  const Storage s = GetParam();
  Module a(32, 8, 8, 4, 0.0f), b(32, 8, 8, 4, 0.0f);
  a.manual_seed(3);
  b.manual_seed(3);
  a.set_weight_storage(s);
  a.init_weights();
  b.init_weights();
  b.set_weight_storage(s);
  const auto wa = a.fc_v().weight_values(), wb = b.fc_v().weight_values();
  for (Index i = 0; i < wa.size(); ++i) ASSERT_EQ(wa.data()[i], wb.data()[i]);
}

// Training needs float weights; narrow storages a path cannot take are named.
TEST_P(NarrowWeights, Refusals) {
  const Storage s = GetParam();
  Rng rng(12);
  Module m = make_module(rng, 32, 8, 4, 4);
  m.set_weight_storage(s);
  m.train();
  const Tensor3 x = random3(rng, 1, 6, 32);
  sdpa::ForwardState<float> state;
  const char* name = sdpa::storage_name(s);
  expect_invalid([&] { (void)m.forward(x, x, x, {}, state); }, {"ScaledDotProductAttention::forward", "kFloat32", name});
  expect_invalid([&] { (void)m.named_parameters(); }, {"named_parameters", name});
  expect_invalid([&] { (void)m.fc_q().weight(); }, {"Linear::weight", "weight_values", name});
  expect_invalid([&] { m.set_weight_storage(Storage::kInt8); }, {"set_weight_storage", "storage", "kInt8"});
  sdpa::ScaledDotProductAttention<double> md(32, 8, 8, 4);
  expect_invalid([&] { md.set_weight_storage(s); }, {"set_weight_storage", "kFloat64", name});
  EXPECT_EQ(m.weight_storage(), s);
  (void)m(x, x, x);  // inference works in training mode too (no state kept)
}

INSTANTIATE_TEST_SUITE_P(Storages, NarrowWeights, ::testing::Values(Storage::kBFloat16, Storage::kFloat16),
                         [](const ::testing::TestParamInfo<Storage>& i) { return std::string(sdpa::storage_name(i.param)).substr(1); });

}  // namespace storage_test
