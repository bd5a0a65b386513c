// Tests of sdpa/rotary.hpp: apply_rotary against a plain double rotation (half-split and interleaved
// pairs, partial rotary, an attention factor, strided rows and heads), its inverse undoing it, and the
// scalings: rope_linear, rope_llama3 and rope_yarn against Hugging Face's rope functions
// (tests/fixtures/rope/, written by scripts/fixtures/make_rope_fixtures.py with transformers; skipped without
// them) and against the rules they follow (what stays, what is divided, the YaRN attention factor).
#include "sdpa/rotary.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "support/fixture.hpp"
#include "support/reference.hpp"

namespace rotary_test {

using Index = Eigen::Index;

// The rotation of one head's features (d of them) at `pos`, in double, from the definition.
std::vector<double> rotate_reference(const std::vector<double>& x, const sdpa::Rotary& r, Index pos) {
  const Index d = static_cast<Index>(x.size()), n = r.dim == 0 ? d : r.dim;
  std::vector<double> out = x;
  for (Index m = 0; m < n / 2; ++m) {
    const double f = r.inv_freq.empty() ? std::pow(r.theta, -2.0 * double(m) / double(n)) : r.inv_freq[std::size_t(m)];
    const double angle = double(pos) * f, c = std::cos(angle) * r.attention_factor, s = std::sin(angle) * r.attention_factor;
    const Index i = r.interleaved ? 2 * m : m, j = r.interleaved ? 2 * m + 1 : m + n / 2;
    out[std::size_t(i)] = x[std::size_t(i)] * c - x[std::size_t(j)] * s;
    out[std::size_t(j)] = x[std::size_t(j)] * c + x[std::size_t(i)] * s;
  }
  return out;
}

template <typename T>
class RotaryTest : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(RotaryTest, Scalars);

TYPED_TEST(RotaryTest, RotatesPairsAsDefinedAndTheInverseUndoesIt) {
  using T = TypeParam;
  std::mt19937 gen(5);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  const Index rows = 9, heads = 3, d = 10, head_stride = 12, row_stride = heads * head_stride + 5, first = 37;
  for (const bool interleaved : {false, true})
    for (const Index dim : {Index(0), Index(4), Index(10)})
      for (const double factor : {1.0, 1.3}) {
        sdpa::Rotary r;
        r.dim = dim;
        r.interleaved = interleaved;
        r.theta = 500;
        r.attention_factor = factor;
        std::vector<T> x(static_cast<std::size_t>(rows * row_stride));
        for (T& v : x) v = T(u(gen));
        const std::vector<T> original = x;
        sdpa::apply_rotary(r, sdpa::RotaryRows(x.data(), rows, row_stride, heads, head_stride, d), first);
        const double tol = std::is_same<T, float>::value ? 2e-5 : 1e-13;
        for (Index i = 0; i < rows; ++i)
          for (Index h = 0; h < heads; ++h) {
            std::vector<double> head(static_cast<std::size_t>(d));
            for (Index c = 0; c < d; ++c) head[std::size_t(c)] = double(original[std::size_t(i * row_stride + h * head_stride + c)]);
            const std::vector<double> want = rotate_reference(head, r, first + i);
            for (Index c = 0; c < d; ++c)
              ASSERT_NEAR(double(x[std::size_t(i * row_stride + h * head_stride + c)]), want[std::size_t(c)], tol)
                  << "interleaved " << interleaved << " dim " << dim << " row " << i << " head " << h << " feature " << c;
            // Features outside a head are untouched.
            for (Index c = d; c < head_stride && h * head_stride + c < row_stride; ++c)
              ASSERT_EQ(x[std::size_t(i * row_stride + h * head_stride + c)], original[std::size_t(i * row_stride + h * head_stride + c)]);
          }
        // The inverse rotation with factor f undoes the rotation up to f^2 per pair.
        sdpa::apply_rotary(r, sdpa::RotaryRows(x.data(), rows, row_stride, heads, head_stride, d), first,
                           /*inverse=*/true);
        const Index n = dim == 0 ? d : dim;
        for (Index i = 0; i < rows; ++i)
          for (Index h = 0; h < heads; ++h)
            for (Index c = 0; c < d; ++c) {
              const double o = double(original[std::size_t(i * row_stride + h * head_stride + c)]);
              const double want = c < n ? o * factor * factor : o;
              ASSERT_NEAR(double(x[std::size_t(i * row_stride + h * head_stride + c)]), want, 10 * tol);
            }
      }
}

TEST(RotaryScalings, FollowTheirRules) {
  const sdpa::Rotary base = [] {
    sdpa::Rotary r;
    r.dim = 64;
    r.theta = 500000;
    return r;
  }();
  const std::vector<double> f0 = base.frequencies(64);
  const sdpa::Rotary lin = sdpa::rope_linear(64, 500000, 4);
  for (std::size_t m = 0; m < f0.size(); ++m) EXPECT_DOUBLE_EQ(lin.inv_freq[m], f0[m] / 4);
  // Llama 3.1: wavelengths below 8192 / 4 kept, above 8192 / 1 divided by 8, blended between.
  const sdpa::Rotary l3 = sdpa::rope_llama3(64, 500000, 8, 1, 4, 8192);
  const double pi = 3.14159265358979323846;
  int kept = 0, divided = 0, blended = 0;
  for (std::size_t m = 0; m < f0.size(); ++m) {
    const double wavelen = 2 * pi / f0[m];
    if (wavelen < 8192.0 / 4) {
      EXPECT_DOUBLE_EQ(l3.inv_freq[m], f0[m]);
      ++kept;
    } else if (wavelen > 8192.0) {
      EXPECT_DOUBLE_EQ(l3.inv_freq[m], f0[m] / 8);
      ++divided;
    } else {
      EXPECT_LT(l3.inv_freq[m], f0[m]);
      EXPECT_GT(l3.inv_freq[m], f0[m] / 8);
      ++blended;
    }
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(divided, 0);
  EXPECT_GT(blended, 0);
  // YaRN: the fastest frequencies extrapolate (kept), the slowest interpolate (divided), and cos and sin are
  // scaled by 0.1 ln(factor) + 1.
  const sdpa::Rotary y = sdpa::rope_yarn(64, 10000, 4, 4096);
  EXPECT_NEAR(y.attention_factor, 0.1 * std::log(4.0) + 1, 1e-15);
  EXPECT_DOUBLE_EQ(y.inv_freq.front(), 1.0);
  EXPECT_NEAR(y.inv_freq.back(), std::pow(10000.0, -62.0 / 64) / 4, 1e-18);
  EXPECT_EQ(sdpa::rope_yarn(64, 10000, 1, 4096).attention_factor, 1.0);
  sdpa_test::expect_invalid([] { sdpa::rope_linear(7, 10000, 2); }, {"rope_linear", "dim", "even", "7"});
  sdpa_test::expect_invalid([] { sdpa::rope_llama3(64, 10000, 8, 4, 1, 8192); }, {"rope_llama3", "high_freq_factor"});
  sdpa_test::expect_invalid([] { sdpa::rope_yarn(64, 10000, -1, 4096); }, {"rope_yarn", "factor", "-1"});
}

// Against transformers' _compute_*_parameters (inv_freq and attention factor), when its fixtures exist.
TEST(RotaryScalings, MatchHuggingFaceRopeFunctions) {
  const std::filesystem::path dir = std::filesystem::path(SDPA_FIXTURE_DIR) / "rope";
  if (!std::filesystem::exists(dir))
    GTEST_SKIP() << "no fixtures in " << dir << " (scripts/fixtures/make_rope_fixtures.py)";
  int checked = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().extension() != ".sdpafix") continue;
    const sdpa_test::Fixture f = sdpa_test::Fixture::load(e.path().string());
    SCOPED_TRACE(e.path().string());
    const Index dim = f.integer("dim");
    const double theta = f.real("theta", 0).f64[0];
    const std::int64_t type = f.integer("rope_type");  // 0 default, 1 linear, 2 llama3, 3 yarn
    sdpa::Rotary r;
    if (type == 0) {
      r.dim = dim;
      r.theta = theta;
      r.inv_freq = r.frequencies(dim);
    } else if (type == 1) {
      r = sdpa::rope_linear(dim, theta, f.real("factor", 0).f64[0]);
    } else if (type == 2) {
      r = sdpa::rope_llama3(dim, theta, f.real("factor", 0).f64[0], f.real("low_freq_factor", 0).f64[0],
                            f.real("high_freq_factor", 0).f64[0], f.integer("original_max_positions"));
    } else {
      r = sdpa::rope_yarn(dim, theta, f.real("factor", 0).f64[0], f.integer("original_max_positions"));
    }
    const std::vector<double>& want = f.get("inv_freq").f64;
    ASSERT_EQ(r.inv_freq.size(), want.size());
    // transformers computes in float32 (powers, divisions, the llama3 blend): agreement to a few of its ulp.
    for (std::size_t m = 0; m < want.size(); ++m) EXPECT_NEAR(r.inv_freq[m], want[m], 1e-6 * std::abs(want[m])) << "m " << m;
    EXPECT_NEAR(r.attention_factor, f.real("attention_factor", 0).f64[0], 1e-6);
    ++checked;
  }
  EXPECT_GT(checked, 0);
}

}  // namespace rotary_test
