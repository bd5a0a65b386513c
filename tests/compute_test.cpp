// Tests of sdpa/compute.hpp (the products' compute type, Compute::kBf16, and its run-time paths) through
// sdpa::attention and the module. Every kBf16 test runs once per path this CPU runs (AMX, AVX512_BF16,
// emulated; under SDPA_ISA=avx2 or portable the emulated one only) and names it (SCOPED_TRACE and the
// test's "bf16_paths" property). References are plain float64 loops over the bfloat16-rounded inputs:
//   - a row whose weight sits on one key returns that key's value rounded to bfloat16, bit for bit (and
//     kFloat the value itself), on ragged shapes;
//   - probabilities are those of scores of rounded q and k (float sums of exact products);
//   - outputs within the rounding of the probabilities to bfloat16 of a float64 reference, with GQA,
//     causal, windows, key lengths, bias and sinks;
//   - a hidden key's non-finite value row adds nothing (the padding to whole tiles reaches such rows);
//   - the error against float64 is no larger than PyTorch's own bf16 SDPA's on the same inputs
//     (tests/fixtures/bf16_accuracy.txt, scripts/fixtures/make_bf16_fixtures.py), at n = 1024 and 4096, d 64 and
//     128, causal and not, random and peaked, over 512 rows of each;
//   - the projections (project_rows_bf16) multiply rounded x and weights (float, bfloat16, float16), with
//     the same bits on 1 and 2 threads;
//   - gradients (sdpa::attention_backward after a kBf16 forward: q, k, v, dO, P and dS rounded, sums in float)
//     no further from float64 than PyTorch's bf16 autograd, n = 1024 and 4096 (tests/fixtures/bf16_gradients.txt);
//   - the refusals (double, the reference kernel, unknown paths).
#include "sdpa/attention.hpp"
#include "sdpa/compute.hpp"
#include "sdpa/kernels/bf16_projection.hpp"
#include "sdpa/scaled_dot_product_attention.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "support/reference.hpp"

namespace compute_test {

using Index = Eigen::Index;
using sdpa_test::expect_invalid;
using T4 = Eigen::Tensor<float, 4, Eigen::RowMajor>;
using T3 = Eigen::Tensor<float, 3, Eigen::RowMajor>;

float bf16(float x) { return sdpa::bfloat16_to_float(sdpa::to_bfloat16(x).bits); }

// The paths this process can run, lowest first.
std::vector<sdpa::Bf16Path> paths() {
  std::vector<sdpa::Bf16Path> out{sdpa::Bf16Path::kEmulated};
  if (sdpa::active_isa() != sdpa::Isa::kAvx512) return out;
  for (sdpa::Bf16Path p : {sdpa::Bf16Path::kAvx512Bf16, sdpa::Bf16Path::kAmx})
    if (p <= sdpa::best_bf16_path()) out.push_back(p);
  return out;
}

// f() once per path, the path set process-wide and named; "auto" again afterwards.
void for_each_path(const std::function<void()>& f) {
  std::string ran;
  for (sdpa::Bf16Path p : paths()) {
    sdpa::set_bf16_compute_path(p);
    ASSERT_EQ(std::string(sdpa::bf16_compute_path()), sdpa::bf16_path_name(p));
    SCOPED_TRACE(std::string("bf16 path ") + sdpa::bf16_path_name(p));
    ran += std::string(ran.empty() ? "" : ",") + sdpa::bf16_path_name(p);
    f();
  }
  sdpa::set_bf16_compute_path("auto");
  ::testing::Test::RecordProperty("bf16_paths", ran);
  std::cout << "[ bf16 paths ] " << ran << "\n";
}

void fill(T4& t, sdpa_test::Rng& rng, double scale = 1.0) {
  for (Index i = 0; i < t.size(); ++i) t.data()[i] = static_cast<float>(rng.normal() * scale);
}

T4 rounded(const T4& t) {
  T4 r(t.dimensions());
  for (Index i = 0; i < t.size(); ++i) r.data()[i] = bf16(t.data()[i]);
  return r;
}

// Plain float64 attention over (b, h, n, d) tensors, GQA by h / kv_heads, with the options these tests set.
struct Reference {
  bool causal = false;
  Index window_left = -1;
  std::vector<Index> key_lengths;
  const T4* bias = nullptr;  // (b, h, nq, nk)
  std::vector<float> sinks;

  std::vector<double> run(const T4& q, const T4& k, const T4& v) const {
    const Index b = q.dimension(0), h = q.dimension(1), nq = q.dimension(2), d = q.dimension(3);
    const Index kvh = k.dimension(1), nk = k.dimension(2), dv = v.dimension(3);
    std::vector<double> out(static_cast<std::size_t>(b * h * nq * dv), 0.0);
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    std::vector<double> s(static_cast<std::size_t>(nk));
    for (Index bi = 0; bi < b; ++bi)
      for (Index hi = 0; hi < h; ++hi) {
        const Index g = hi / (h / kvh);
        for (Index i = 0; i < nq; ++i) {
          const Index pos = i + nk - nq;
          double m = -std::numeric_limits<double>::infinity();
          for (Index j = 0; j < nk; ++j) {
            const bool hidden = (causal && j > pos) || (window_left >= 0 && j < pos - window_left) ||
                                (!key_lengths.empty() && j >= key_lengths[static_cast<std::size_t>(bi)]);
            double acc = 0;
            for (Index x = 0; x < d; ++x) acc += static_cast<double>(q(bi, hi, i, x)) * k(bi, g, j, x);
            acc *= scale;
            if (bias != nullptr) acc += (*bias)(bi, hi, i, j);
            s[static_cast<std::size_t>(j)] = hidden ? -std::numeric_limits<double>::infinity() : acc;
            m = std::max(m, s[static_cast<std::size_t>(j)]);
          }
          if (!sinks.empty()) m = std::max(m, static_cast<double>(sinks[static_cast<std::size_t>(hi)]));
          if (std::isinf(m)) continue;  // nothing visible: zero
          double sum = sinks.empty() ? 0.0 : std::exp(sinks[static_cast<std::size_t>(hi)] - m);
          for (double& x : s) {
            x = std::isinf(x) ? 0.0 : std::exp(x - m);
            sum += x;
          }
          double* o = out.data() + ((bi * h + hi) * nq + i) * dv;
          for (Index j = 0; j < nk; ++j) {
            const double p = s[static_cast<std::size_t>(j)] / sum;
            if (p == 0.0) continue;
            for (Index x = 0; x < dv; ++x) o[x] += p * v(bi, g, j, x);
          }
        }
      }
    return out;
  }
};

double max_abs(const T4& t) {
  double m = 0;
  for (Index i = 0; i < t.size(); ++i) m = std::max(m, std::abs(static_cast<double>(t.data()[i])));
  return m;
}

TEST(ComputePaths, NamesTheBestPathAndRefusesOthers) {
  const std::string best = sdpa::bf16_path_name(sdpa::best_bf16_path());
  EXPECT_TRUE(best == "amx" || best == "avx512_bf16" || best == "emulated") << best;
  const sdpa::CpuFeatures& f = sdpa::cpu_features();
  if (sdpa::best_bf16_path() == sdpa::Bf16Path::kAmx) {
    EXPECT_TRUE(f.amx_tile && f.amx_bf16 && f.avx512bf16);
  }
  if (sdpa::best_bf16_path() >= sdpa::Bf16Path::kAvx512Bf16) {
    EXPECT_TRUE(f.avx512bf16);
  }
  std::cout << "[ bf16 paths ] best " << best << ", now " << sdpa::bf16_compute_path() << " (ISA "
            << sdpa::cpu_isa() << ")\n";
  if (sdpa::active_isa() != sdpa::Isa::kAvx512) {
    EXPECT_STREQ(sdpa::bf16_compute_path(), "emulated");
  }
  expect_invalid([] { sdpa::set_bf16_compute_path("fp8"); }, {"set_bf16_compute_path", "auto, emulated", "\"fp8\""});
  if (sdpa::best_bf16_path() < sdpa::Bf16Path::kAmx)
    expect_invalid([] { sdpa::set_bf16_compute_path("amx"); }, {"set_bf16_compute_path", "\"amx\""});
  sdpa::set_bf16_compute_path("emulated");
  EXPECT_STREQ(sdpa::bf16_compute_path(), "emulated");
  sdpa::set_bf16_compute_path("auto");
  if (sdpa::active_isa() == sdpa::Isa::kAvx512) {
    EXPECT_EQ(sdpa::active_bf16_path(), sdpa::best_bf16_path());
  }
}

// Query i's scores are 0 except for key i % 32 (724 after the scale): its weight is exactly 1, every other
// exactly 0, so the output is that key's value as the products read it.
TEST(ComputeBf16, ARowOnOneKeyReturnsItsValueRoundedToBf16) {
  const Index nq = 50, nk = 32, d = 32, dv = 70;
  T4 q(1, 2, nq, d), k(1, 2, nk, d), v(1, 2, nk, dv);
  q.setZero();
  k.setZero();
  for (Index h = 0; h < 2; ++h) {
    for (Index i = 0; i < nq; ++i) q(0, h, i, i % d) = 64.0f;
    for (Index j = 0; j < nk; ++j) k(0, h, j, j) = 64.0f;
  }
  sdpa_test::Rng rng(3);
  fill(v, rng);
  Index inexact = 0;
  for (Index i = 0; i < v.size(); ++i) inexact += bf16(v.data()[i]) != v.data()[i];
  ASSERT_GT(inexact, v.size() / 2);
  sdpa::AttentionOptions<float> o;
  const T4 exact = sdpa::attention(q, k, v, o);
  for (Index h = 0; h < 2; ++h)
    for (Index i = 0; i < nq; ++i)
      for (Index x = 0; x < dv; ++x) ASSERT_EQ(exact(0, h, i, x), v(0, h, i % d, x));
  o.compute = sdpa::Compute::kBf16;
  for_each_path([&] {
    const T4 out = sdpa::attention(q, k, v, o);
    for (Index h = 0; h < 2; ++h)
      for (Index i = 0; i < nq; ++i)
        for (Index x = 0; x < dv; ++x) ASSERT_EQ(out(0, h, i, x), bf16(v(0, h, i % d, x))) << h << " " << i << " " << x;
  });
}

// The probabilities are exp(s - lse) with s = scale * (rounded q . rounded k): within float rounding of a
// float64 reference over the rounded operands, while unrounded ones would move scores by about 2^-8 |s|.
TEST(ComputeBf16, ProbabilitiesComeFromScoresOfRoundedOperands) {
  const Index nq = 70, nk = 300, d = 80;
  T4 q(1, 2, nq, d), k(1, 2, nk, d), v(1, 2, nk, 16);
  sdpa_test::Rng rng(5);
  fill(q, rng, 1.5);
  fill(k, rng, 1.5);
  fill(v, rng);
  const T4 qr = rounded(q), kr = rounded(k);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> ref(static_cast<std::size_t>(2 * nq * nk));
  for (Index h = 0; h < 2; ++h)
    for (Index i = 0; i < nq; ++i) {
      std::vector<double> s(static_cast<std::size_t>(nk));
      double m = -1e300, sum = 0;
      for (Index j = 0; j < nk; ++j) {
        double acc = 0;
        for (Index x = 0; x < d; ++x) acc += static_cast<double>(qr(0, h, i, x)) * kr(0, h, j, x);
        s[static_cast<std::size_t>(j)] = acc * scale;
        m = std::max(m, acc * scale);
      }
      for (double& x : s) sum += (x = std::exp(x - m));
      for (Index j = 0; j < nk; ++j) ref[static_cast<std::size_t>((h * nq + i) * nk + j)] = s[static_cast<std::size_t>(j)] / sum;
    }
  const auto worst = [&](const T4& p) {
    double e = 0;
    for (Index i = 0; i < p.size(); ++i) {
      const double r = ref[static_cast<std::size_t>(i)];
      e = std::max(e, std::abs(p.data()[i] - r) / std::max(r, 1e-6));
    }
    return e;
  };
  sdpa::AttentionOptions<float> o;
  T4 p;
  o.probabilities = &p;
  sdpa::attention(q, k, v, o);
  const double float_error = worst(p);
  EXPECT_GT(float_error, 1e-3);  // the test tells rounded operands from unrounded ones
  o.compute = sdpa::Compute::kBf16;
  for_each_path([&] {
    sdpa::attention(q, k, v, o);
    EXPECT_LT(worst(p), 2e-5);
  });
}

struct Case {
  const char* name;
  Index batch, heads, kv_heads, nq, nk, d, dv;
  bool causal = false;
  Index window_left = -1;
  bool key_lengths = false, bias = false, sinks = false;
};

// Each output row is a weighted mean of rounded values with weights rounded to bfloat16 (relative error at
// most 2^-9 each) and normalised by their float sum: within 2^-8 max |v| of the float64 reference.
TEST(ComputeBf16, OutputsWithinTheProbabilitiesRoundingOfAFloat64Reference) {
  const std::vector<Case> cases = {
      {"plain", 1, 2, 2, 64, 64, 64, 64},
      {"ragged", 2, 3, 3, 49, 130, 70, 45},
      {"gqa causal", 1, 4, 2, 300, 300, 64, 64, true},
      {"window causal", 1, 2, 1, 200, 520, 128, 128, true, 100},
      {"key lengths bias sinks", 2, 2, 2, 33, 275, 64, 32, false, -1, true, true, true},
      {"decode-sized", 3, 4, 1, 3, 513, 64, 64, true},
  };
  sdpa_test::Rng rng(11);
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    T4 q(c.batch, c.heads, c.nq, c.d), k(c.batch, c.kv_heads, c.nk, c.d), v(c.batch, c.kv_heads, c.nk, c.dv);
    fill(q, rng);
    fill(k, rng);
    fill(v, rng);
    T4 bias(c.batch, c.heads, c.nq, c.nk);
    fill(bias, rng);
    sdpa::AttentionOptions<float> o;
    Reference r;
    o.causal = r.causal = c.causal;
    o.window_left = r.window_left = c.window_left;
    if (c.key_lengths) {
      for (Index b = 0; b < c.batch; ++b) o.key_lengths.push_back(c.nk - 37 * (b + 1));
      r.key_lengths = o.key_lengths;
    }
    if (c.bias) o.attention_bias = r.bias = &bias;
    if (c.sinks) {
      for (Index h = 0; h < c.heads; ++h) o.sinks.push_back(0.5f * static_cast<float>(h));
      r.sinks = o.sinks;
    }
    const std::vector<double> ref = r.run(rounded(q), rounded(k), rounded(v));
    const double bound = std::ldexp(max_abs(v), -8) + 1e-5;
    o.compute = sdpa::Compute::kBf16;
    for_each_path([&] {
      const T4 out = sdpa::attention(q, k, v, o);
      double e = 0;
      for (Index i = 0; i < out.size(); ++i) e = std::max(e, std::abs(out.data()[i] - ref[static_cast<std::size_t>(i)]));
      EXPECT_LE(e, bound);
    });
  }
}

// Keys past a key length and before a window hold NaN and inf values: no output sees them, although the
// products' padding to whole tiles reaches their rows. Equal to the same call with those rows zero (to the
// order of the float sums: a tile that would reach such a row adds its visible keys one by one).
TEST(ComputeBf16, HiddenNonFiniteValuesAddNothing) {
  const Index nq = 40, nk = 150, d = 64;
  T4 q(2, 2, nq, d), k(2, 2, nk, d), v(2, 2, nk, d);
  sdpa_test::Rng rng(13);
  fill(q, rng);
  fill(k, rng);
  fill(v, rng);
  sdpa::AttentionOptions<float> o;
  o.compute = sdpa::Compute::kBf16;
  o.key_lengths = {131, 97};
  o.causal = true;
  o.window_left = 20;  // queries at 110 .. 149 see keys from 90 on
  T4 poisoned = v, clean = v;
  for (Index b = 0; b < 2; ++b)
    for (Index h = 0; h < 2; ++h)
      for (Index j = 0; j < nk; ++j) {
        if (j >= o.key_lengths[static_cast<std::size_t>(b)] || j < nk - nq - 20) {
          for (Index x = 0; x < d; ++x) {
            poisoned(b, h, j, x) = (j % 2) ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
            clean(b, h, j, x) = 0.0f;
          }
        }
      }
  for_each_path([&] {
    const T4 a = sdpa::attention(q, k, poisoned, o), b = sdpa::attention(q, k, clean, o);
    for (Index i = 0; i < a.size(); ++i) {
      ASSERT_TRUE(std::isfinite(a.data()[i])) << i;
      ASSERT_NEAR(a.data()[i], b.data()[i], 1e-6) << i;
    }
  });
}

// Forward and backward give the same bits on 1 and 2 threads (the work is split by rows, never by a sum).
TEST(ComputeBf16, SameBitsOnOneAndTwoThreads) {
  T4 q(2, 4, 150, 64), k(2, 2, 190, 64), v(2, 2, 190, 48), d_out(2, 4, 150, 48);
  sdpa_test::Rng rng(23);
  for (T4* t : {&q, &k, &v, &d_out}) fill(*t, rng);
  Eigen::ThreadPool pool(2);
  Eigen::ThreadPoolDevice two(&pool, 2);
  sdpa::AttentionOptions<float> o;
  o.compute = sdpa::Compute::kBf16;
  o.causal = true;
  for_each_path([&] {
    sdpa::AttentionState<float> s1, s2;
    o.device = nullptr;
    const T4 out1 = sdpa::attention(q, k, v, o, s1);
    o.device = &two;
    const T4 out2 = sdpa::attention(q, k, v, o, s2);
    const sdpa::AttentionGradients<float> g1 = sdpa::attention_backward(d_out, s1), g2 = sdpa::attention_backward(d_out, s2);
    for (const auto& [a, b] : {std::make_pair(&out1, &out2), std::make_pair(&g1.q, &g2.q), std::make_pair(&g1.k, &g2.k),
                               std::make_pair(&g1.v, &g2.v)})
      for (Index i = 0; i < a->size(); ++i) ASSERT_EQ(a->data()[i], b->data()[i]) << i;
  });
}

// The backward with the options that reach its tiles (GQA, key lengths, a window, bias with its gradient,
// sinks, dropout replayed) follows the float backward to bfloat16's rounding, and a key row of inf past a
// key length changes nothing (its gradient products are taken over rounded operands too).
TEST(ComputeBf16, GradientsWithOptionsFollowTheFloatOnes) {
  T4 q(2, 4, 70, 64), k(2, 2, 140, 64), v(2, 2, 140, 32), d_out(2, 4, 70, 32), bias(2, 4, 70, 140);
  sdpa_test::Rng rng(29);
  for (T4* t : {&q, &k, &v, &d_out, &bias}) fill(*t, rng);
  sdpa::AttentionOptions<float> o;
  o.key_lengths = {140, 111};
  o.causal = true;
  o.window_left = 90;
  o.attention_bias = &bias;
  o.sinks = {0.1f, -0.2f, 0.3f, 0.0f};
  o.dropout = 0.2f;
  o.dropout_seed = 7;
  sdpa::AttentionState<float> sf;
  sdpa::attention(q, k, v, o, sf);
  const sdpa::AttentionGradients<float> gf = sdpa::attention_backward(d_out, sf);
  T4 k_poisoned = k;
  for (Index h = 0; h < 2; ++h)
    for (Index j = 111; j < 140; ++j)
      for (Index x = 0; x < 64; ++x) k_poisoned(1, h, j, x) = std::numeric_limits<float>::infinity();
  o.compute = sdpa::Compute::kBf16;
  for_each_path([&] {
    sdpa::AttentionState<float> s, sp;
    sdpa::attention(q, k, v, o, s);
    sdpa::attention(q, k_poisoned, v, o, sp);
    const sdpa::AttentionGradients<float> g = sdpa::attention_backward(d_out, s), gp = sdpa::attention_backward(d_out, sp);
    const auto close = [](const T4& a, const T4& b, const char* name) {
      double e = 0, m = 0;
      for (Index i = 0; i < a.size(); ++i) {
        e = std::max(e, std::abs(static_cast<double>(a.data()[i]) - b.data()[i]));
        m = std::max(m, std::abs(static_cast<double>(b.data()[i])));
      }
      EXPECT_LE(e, 0.02 * m) << name;
      EXPECT_GT(e, 0.0) << name;  // rounded operands move the gradients
    };
    close(g.q, gf.q, "dq");
    close(g.k, gf.k, "dk");
    close(g.v, gf.v, "dv");
    close(g.attention_bias, gf.attention_bias, "dbias");
    ASSERT_EQ(g.sinks.size(), gf.sinks.size());
    // A sink's gradient is a sum over the rows of terms of either sign (-p_sink D): within the rounding of
    // its terms, not of its small total.
    for (std::size_t i = 0; i < g.sinks.size(); ++i) EXPECT_NEAR(g.sinks[i], gf.sinks[i], 2e-3);
    for (const auto& [a, b] : {std::make_pair(&g.q, &gp.q), std::make_pair(&g.v, &gp.v)})
      for (Index i = 0; i < a->size(); ++i) ASSERT_EQ(a->data()[i], b->data()[i]) << i;
  });
}

TEST(ComputeBf16, RefusesWhatItDoesNotRun) {
  using T4d = Eigen::Tensor<double, 4, Eigen::RowMajor>;
  T4d qd(1, 1, 4, 8), kd(1, 1, 4, 8), vd(1, 1, 4, 8);
  qd.setConstant(0.5);
  kd.setConstant(0.5);
  vd.setConstant(0.5);
  sdpa::AttentionOptions<double> od;
  od.compute = sdpa::Compute::kBf16;
  expect_invalid([&] { sdpa::attention(qd, kd, vd, od); }, {"attention", "compute", "kFloat for double", "kBf16"});
  T4 q(1, 1, 4, 8), k(1, 1, 4, 8), v(1, 1, 4, 8);
  q.setConstant(0.5f);
  k.setConstant(0.5f);
  v.setConstant(0.5f);
  sdpa::AttentionOptions<float> o;
  o.compute = sdpa::Compute::kBf16;
  o.kernel = sdpa::Kernel::kReference;
  expect_invalid([&] { sdpa::attention(q, k, v, o); }, {"compute", "Kernel::kReference", "kBf16"});
  o.kernel = sdpa::Kernel::kAuto;

  sdpa::ScaledDotProductAttention<double> md(16, 8, 8, 2);
  expect_invalid([&] { md.set_compute(sdpa::Compute::kBf16); }, {"set_compute", "kFloat for double"});
  EXPECT_EQ(md.compute(), sdpa::Compute::kFloat);
  sdpa::ScaledDotProductAttention<float> m(16, 8, 8, 2);
  T3 x(1, 5, 16);
  x.setConstant(0.25f);
  sdpa::AttentionOptions<float> mo;
  mo.compute = sdpa::Compute::kBf16;
  expect_invalid([&] { m.forward(x, x, x, mo); }, {"compute (set_compute sets the module's)"});
  m.set_kernel(sdpa::Kernel::kReference);
  expect_invalid([&] { m.set_compute(sdpa::Compute::kBf16); }, {"set_compute", "Kernel::kReference"});
  m.set_kernel(sdpa::Kernel::kAuto);
  m.set_compute(sdpa::Compute::kBf16);
  m.set_kernel(sdpa::Kernel::kReference);
  expect_invalid([&] { m.forward(x, x, x); }, {"forward", "Kernel::kReference"});
  m.set_kernel(sdpa::Kernel::kAuto);
}

// The module's forward with set_compute(kBf16): its attention core's error, carried through fc_o, stays
// within the probabilities' rounding of the float forward; a copy keeps the setting.
TEST(ComputeBf16, ModuleForwardRunsTheCoreInBf16) {
  sdpa::ScaledDotProductAttention<float> m(64, 16, 16, 4);
  m.eval();
  sdpa_test::Rng rng(17);
  sdpa_test::randomize_module(m, rng, 0.1);
  T3 x(2, 37, 64);
  for (Index i = 0; i < x.size(); ++i) x.data()[i] = static_cast<float>(rng.normal());
  const T3 exact = m.forward(x, x, x);
  m.set_compute(sdpa::Compute::kBf16);
  const sdpa::ScaledDotProductAttention<float> copy(m);
  EXPECT_EQ(copy.compute(), sdpa::Compute::kBf16);
  double scale = 0;
  for (Index i = 0; i < exact.size(); ++i) scale = std::max(scale, std::abs(static_cast<double>(exact.data()[i])));
  for_each_path([&] {
    const T3 out = m.forward(x, x, x);
    double e = 0, moved = 0;
    for (Index i = 0; i < out.size(); ++i) {
      e = std::max(e, std::abs(static_cast<double>(out.data()[i]) - exact.data()[i]));
      moved += out.data()[i] != exact.data()[i];
    }
    EXPECT_LE(e, 0.02 * scale);
    EXPECT_GT(moved, out.size() / 2);  // the setting reached the core
  });
}

// project_rows_bf16: y = sum of bf16(x) bf16(w) products (exact in float) + b, summed in float: within float
// rounding of a float64 sum over the rounded operands, for float, bfloat16 and float16 weights, rows and
// outputs that are not whole tiles, several targets in one pass, side by side in one buffer; the same bits
// on 1 and 2 threads.
TEST(ComputeBf16, ProjectionsMultiplyRoundedOperands) {
  const Index rows = 77, in = 200;
  const std::vector<Index> outs = {48, 37, 64};
  const std::vector<sdpa::Storage> storages = {sdpa::Storage::kFloat32, sdpa::Storage::kBFloat16, sdpa::Storage::kFloat16};
  sdpa_test::Rng rng(19);
  std::vector<float> x(static_cast<std::size_t>(rows * (in + 3)));
  for (float& v : x) v = static_cast<float>(rng.normal());
  std::vector<std::vector<float>> w(3), bias(3);
  std::vector<std::vector<std::uint16_t>> narrow(3);
  Index width = 0;
  for (std::size_t t = 0; t < 3; ++t) {
    width += outs[t];
    w[t].resize(static_cast<std::size_t>(outs[t] * in));
    for (float& v : w[t]) v = static_cast<float>(rng.normal(0.1));
    bias[t].resize(static_cast<std::size_t>(outs[t]));
    for (float& v : bias[t]) v = static_cast<float>(rng.normal());
    narrow[t].resize(w[t].size());
    for (std::size_t i = 0; i < w[t].size(); ++i) {
      if (storages[t] == sdpa::Storage::kBFloat16) narrow[t][i] = sdpa::to_bfloat16(w[t][i]).bits;
      if (storages[t] == sdpa::Storage::kFloat16) narrow[t][i] = sdpa::to_float16(w[t][i]).bits;
    }
  }
  // The weights as the layers hold them, then rounded to bfloat16 as the products read them.
  const auto held = [&](std::size_t t, std::size_t i) {
    if (storages[t] == sdpa::Storage::kBFloat16) return sdpa::bfloat16_to_float(narrow[t][i]);
    if (storages[t] == sdpa::Storage::kFloat16) return sdpa::half_to_float(narrow[t][i]);
    return w[t][i];
  };
  std::vector<double> ref(static_cast<std::size_t>(rows * width)), magnitude(ref.size());
  for (Index r = 0; r < rows; ++r) {
    Index c0 = 0;
    for (std::size_t t = 0; t < 3; ++t) {
      for (Index o = 0; o < outs[t]; ++o) {
        double acc = bias[t][static_cast<std::size_t>(o)], mag = std::abs(acc);
        for (Index i = 0; i < in; ++i) {
          const double prod = static_cast<double>(bf16(x[static_cast<std::size_t>(r * (in + 3) + i)])) *
                              bf16(held(t, static_cast<std::size_t>(o * in + i)));
          acc += prod;
          mag += std::abs(prod);
        }
        ref[static_cast<std::size_t>(r * width + c0 + o)] = acc;
        magnitude[static_cast<std::size_t>(r * width + c0 + o)] = mag;
      }
      c0 += outs[t];
    }
  }
  Eigen::ThreadPool pool(2);
  Eigen::ThreadPoolDevice two(&pool, 2);
  for_each_path([&] {
    std::vector<float> y1(ref.size(), -1.0f), y2(ref.size(), -2.0f);
    for (std::vector<float>* y : {&y1, &y2}) {
      std::vector<sdpa::kernels::ProjectionTarget<float>> targets;
      Index c0 = 0;
      for (std::size_t t = 0; t < 3; ++t) {
        sdpa::kernels::ProjectionTarget<float> tg{storages[t] == sdpa::Storage::kFloat32 ? w[t].data() : nullptr,
                                                  bias[t].data(), outs[t], y->data() + c0, width};
        tg.weight_storage = storages[t];
        tg.weight_stored = storages[t] == sdpa::Storage::kFloat32 ? nullptr : narrow[t].data();
        targets.push_back(tg);
        c0 += outs[t];
      }
      sdpa::kernels::project_rows_bf16(x.data(), rows, in, in + 3, targets.data(), targets.size(),
                                       y == &y1 ? nullptr : &two, sdpa::active_bf16_path());
    }
    double worst = 0;
    for (std::size_t i = 0; i < ref.size(); ++i) {
      ASSERT_EQ(y1[i], y2[i]) << i;
      worst = std::max(worst, std::abs(y1[i] - ref[i]) / magnitude[i]);
    }
    EXPECT_LT(worst, 1e-6);
  });
}

// ---- Against PyTorch's bf16 SDPA (tests/fixtures/bf16_accuracy.txt) ----

std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// scripts/fixtures/make_bf16_fixtures.py's inputs: exact in float before the rounding, so both get the same bits.
T4 fixture_tensor(std::uint64_t seed, std::uint64_t which, Index n, Index d, bool peaked) {
  T4 t(1, 1, n, d);
  const std::uint64_t base = splitmix64(4 * seed + which);
  for (Index i = 0; i < n * d; ++i) {
    const std::uint64_t h = splitmix64(base + static_cast<std::uint64_t>(i));
    float x = 2.0f * (static_cast<float>(h >> 40) / 16777216.0f) - 1.0f;
    if (peaked && which < 2) x *= 4.0f;
    t.data()[i] = bf16(x);
  }
  return t;
}

// Float64 attention of one head for query rows stride - 1, 2 stride - 1, ... (the rows the fixture's
// errors were taken over), (rows, d) row-major.
std::vector<double> reference_rows(const T4& q, const T4& k, const T4& v, bool causal, Index stride) {
  using Mat = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using MapF = Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;
  const Index n = q.dimension(2), d = q.dimension(3), rows = n / stride;
  const Mat K = MapF(k.data(), n, d).cast<double>(), V = MapF(v.data(), n, d).cast<double>();
  const MapF Q(q.data(), n, d);
  Mat Qr(rows, d);
  for (Index r = 0; r < rows; ++r) Qr.row(r) = Q.row((r + 1) * stride - 1).cast<double>();
  Mat s = (Qr * K.transpose()) * (1.0 / std::sqrt(static_cast<double>(d)));
  for (Index r = 0; r < rows; ++r) {
    const Index seen = causal ? (r + 1) * stride : n;
    const double m = s.row(r).head(seen).maxCoeff();
    s.row(r).head(seen) = (s.row(r).head(seen).array() - m).exp().matrix();
    s.row(r).tail(n - seen).setZero();
    s.row(r) /= s.row(r).sum();
  }
  const Mat out = s * V;
  return std::vector<double>(out.data(), out.data() + out.size());
}

struct AccuracyCase {
  std::string name;
  Index n = 0, d = 0;
  bool causal = false, peaked = false;
  std::uint64_t seed = 0;
  double torch_max = 0, torch_rms = 0;
};

std::vector<AccuracyCase> accuracy_cases() {
  std::ifstream in(std::string(SDPA_FIXTURE_DIR) + "/bf16_accuracy.txt");
  std::vector<AccuracyCase> out;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream s(line);
    AccuracyCase c;
    int causal = 0, peaked = 0;
    s >> c.name >> c.n >> c.d >> causal >> peaked >> c.seed >> c.torch_max >> c.torch_rms;
    c.causal = causal != 0;
    c.peaked = peaked != 0;
    if (s) out.push_back(c);
  }
  return out;
}

class Bf16Accuracy : public ::testing::TestWithParam<AccuracyCase> {};

TEST_P(Bf16Accuracy, NoFurtherFromFloat64ThanPyTorchsBf16) {
  const AccuracyCase& c = GetParam();
  const T4 q = fixture_tensor(c.seed, 0, c.n, c.d, c.peaked), k = fixture_tensor(c.seed, 1, c.n, c.d, c.peaked),
           v = fixture_tensor(c.seed, 2, c.n, c.d, c.peaked);
  const Index stride = c.n / 512;
  const std::vector<double> ref = reference_rows(q, k, v, c.causal, stride);
  sdpa::AttentionOptions<float> o;
  o.causal = c.causal;
  o.compute = sdpa::Compute::kBf16;
  for_each_path([&] {
    const T4 out = sdpa::attention(q, k, v, o);
    double worst = 0, sq = 0;
    for (std::size_t i = 0; i < ref.size(); ++i) {
      const Index r = static_cast<Index>(i) / c.d, x = static_cast<Index>(i) % c.d;
      const double e = std::abs(out(0, 0, (r + 1) * stride - 1, x) - ref[i]);
      worst = std::max(worst, e);
      sq += e * e;
    }
    const double rms = std::sqrt(sq / static_cast<double>(ref.size()));
    std::cout << "[ accuracy ] " << c.name << " " << sdpa::bf16_compute_path() << ": max " << worst << " (torch "
              << c.torch_max << "), rms " << rms << " (torch " << c.torch_rms << ")\n";
    EXPECT_LE(worst, c.torch_max);
    EXPECT_LE(rms, c.torch_rms);
  });
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Bf16Accuracy, ::testing::ValuesIn(accuracy_cases()),
                         [](const ::testing::TestParamInfo<AccuracyCase>& info) { return info.param.name; });

// ---- Gradients against PyTorch's bf16 autograd (tests/fixtures/bf16_gradients.txt, n = 1024 and 4096) ----

struct GradientCase {
  AccuracyCase c;
  double torch[6] = {};  // max and rms error of dq, dk, dv
};

std::vector<GradientCase> gradient_cases() {
  std::ifstream in(std::string(SDPA_FIXTURE_DIR) + "/bf16_gradients.txt");
  std::vector<GradientCase> out;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream s(line);
    GradientCase g;
    int causal = 0, peaked = 0;
    s >> g.c.name >> g.c.n >> g.c.d >> causal >> peaked >> g.c.seed;
    for (double& e : g.torch) s >> e;
    g.c.causal = causal != 0;
    g.c.peaked = peaked != 0;
    if (s) out.push_back(g);
  }
  return out;
}

// Float64 gradients of one head's attention (q, k, v: (n, d)) for dO on the rows r with r % stride ==
// stride - 1 (of q for dq, of k and v for dk and dv): dq, dk, dv, each (n, d) row-major, zero on the other
// rows. Query rows in blocks of 256, so that n = 4096 needs a few n-wide blocks, not n x n matrices.
std::vector<std::vector<double>> reference_gradients(const T4& q, const T4& k, const T4& v, const T4& d_out, bool causal,
                                                     Index stride) {
  using Mat = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using MapF = Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;
  const Index n = q.dimension(2), d = q.dimension(3), picked = n / stride;
  const Mat Q = MapF(q.data(), n, d).cast<double>(), K = MapF(k.data(), n, d).cast<double>(),
            V = MapF(v.data(), n, d).cast<double>(), dO = MapF(d_out.data(), n, d).cast<double>();
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const auto cols = Eigen::seqN(stride - 1, picked, stride);
  Mat dQ = Mat::Zero(n, d), dK_picked = Mat::Zero(picked, d), dV_picked = Mat::Zero(picked, d);
  for (Index i0 = 0; i0 < n; i0 += 256) {
    const Index rb = std::min<Index>(256, n - i0);
    Mat P = (Q.middleRows(i0, rb) * K.transpose()) * scale;
    for (Index r = 0; r < rb; ++r) {
      const Index seen = causal ? i0 + r + 1 : n;
      const double m = P.row(r).head(seen).maxCoeff();
      P.row(r).head(seen) = (P.row(r).head(seen).array() - m).exp().matrix();
      P.row(r).tail(n - seen).setZero();
      P.row(r) /= P.row(r).sum();
    }
    const Mat O = P * V;
    const Eigen::VectorXd D = (dO.middleRows(i0, rb).array() * O.array()).rowwise().sum();
    const Mat dP = dO.middleRows(i0, rb) * V.transpose();
    const Mat dS = (P.array() * (dP.colwise() - D).array()).matrix() * scale;
    for (Index r = 0; r < rb; ++r)
      if ((i0 + r) % stride == stride - 1) dQ.row(i0 + r) = dS.row(r) * K;
    dK_picked += Mat(dS(Eigen::all, cols)).transpose() * Q.middleRows(i0, rb);
    dV_picked += Mat(P(Eigen::all, cols)).transpose() * dO.middleRows(i0, rb);
  }
  Mat dK = Mat::Zero(n, d), dV = Mat::Zero(n, d);
  dK(cols, Eigen::all) = dK_picked;
  dV(cols, Eigen::all) = dV_picked;
  std::vector<std::vector<double>> out;
  for (const Mat* g : {&dQ, &dK, &dV}) out.emplace_back(g->data(), g->data() + g->size());
  return out;
}

class Bf16Gradients : public ::testing::TestWithParam<GradientCase> {};

TEST_P(Bf16Gradients, NoFurtherFromFloat64ThanPyTorchsBf16) {
  const AccuracyCase& c = GetParam().c;
  const T4 q = fixture_tensor(c.seed, 0, c.n, c.d, c.peaked), k = fixture_tensor(c.seed, 1, c.n, c.d, c.peaked),
           v = fixture_tensor(c.seed, 2, c.n, c.d, c.peaked), d_out = fixture_tensor(c.seed, 3, c.n, c.d, false);
  const Index stride = c.n / 512;
  const std::vector<std::vector<double>> ref = reference_gradients(q, k, v, d_out, c.causal, stride);
  sdpa::AttentionOptions<float> o;
  o.causal = c.causal;
  o.compute = sdpa::Compute::kBf16;
  for_each_path([&] {
    sdpa::AttentionState<float> state;
    sdpa::attention(q, k, v, o, state);
    const sdpa::AttentionGradients<float> g = sdpa::attention_backward(d_out, state);
    const T4* grads[3] = {&g.q, &g.k, &g.v};
    const char* names[3] = {"dq", "dk", "dv"};
    for (int t = 0; t < 3; ++t) {
      double worst = 0, sq = 0;
      Index count = 0;
      for (Index r = stride - 1; r < c.n; r += stride)
        for (Index x = 0; x < c.d; ++x, ++count) {
          const double e = std::abs((*grads[t])(0, 0, r, x) - ref[static_cast<std::size_t>(t)][static_cast<std::size_t>(r * c.d + x)]);
          worst = std::max(worst, e);
          sq += e * e;
        }
      const double rms = std::sqrt(sq / static_cast<double>(count));
      const double* torch = GetParam().torch + 2 * t;
      std::cout << "[ gradients ] " << c.name << " " << sdpa::bf16_compute_path() << " " << names[t] << ": max " << worst
                << " (torch " << torch[0] << "), rms " << rms << " (torch " << torch[1] << ")\n";
      EXPECT_LE(worst, torch[0]) << names[t];
      EXPECT_LE(rms, torch[1]) << names[t];
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Bf16Gradients, ::testing::ValuesIn(gradient_cases()),
                         [](const ::testing::TestParamInfo<GradientCase>& info) { return info.param.c.name; });

TEST(Bf16AccuracyFixtures, AreAllThere) {
  EXPECT_EQ(accuracy_cases().size(), 16u);
  EXPECT_EQ(gradient_cases().size(), 16u);
}

}  // namespace compute_test
