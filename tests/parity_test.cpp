// Parity with PyTorch: every fixture of tests/fixtures (written by scripts/fixtures/make_fixtures.py from the
// original External-Attention-pytorch module, eval() mode) is loaded into a ScaledDotProductAttention
// of its scalar type and run three ways: on Eigen::Tensor inputs, on TensorMaps of the same values (must
// give bit-identical results), and on a two-thread ThreadPoolDevice. Each is compared with PyTorch's
// output: max|y - ref| / max(max|ref|, tiny) <= 2e-5 (float) or 1e-10 (double), NaN exactly where
// PyTorch has NaN, and no NaN or infinity elsewhere.
#define EIGEN_USE_THREADS
#include <sdpa/sdpa.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "support/fixture.hpp"

namespace parity_test {

using sdpa_test::Fixture;

// The fixtures make_fixtures.py writes, each as <case>_f32 and <case>_f64.
std::vector<std::string> case_names() {
  std::vector<std::string> cases = {"self_attention", "cross_attention"};
  // The 16 broadcast forms of (batch, heads, nq, nk): a letter for a full dimension, '1' for a broadcast one.
  std::vector<std::string> forms;
  for (int bits = 15; bits >= 0; --bits) {
    std::string form = "bhqk";
    for (int i = 0; i < 4; ++i)
      if (!((bits >> (3 - i)) & 1)) form[static_cast<std::size_t>(i)] = '1';
    forms.push_back(form);
  }
  for (const auto& form : forms) cases.push_back("mask_" + form);
  for (const auto& form : forms) cases.push_back("weights_" + form);
  cases.push_back("mask_and_weights");
  for (const char* policy : {"nan", "zero"})
    for (const char* kind : {"rows", "batch", "head"})
      cases.push_back(std::string("fully_masked_") + kind + "_" + policy);
  for (const char* name :
       {"large_logits", "single_head", "single_batch", "single_query", "single_key", "single_everything",
        "nonfinite_query_nan", "nonfinite_key_inf", "nonfinite_hidden_key_nan"})
    cases.push_back(name);
  // sdpa::AttentionOptions: PyTorch's output and probabilities for explicit masks and float biases.
  for (const char* name :
       {"causal_square", "causal_more_keys", "causal_more_queries", "window_left", "window_right", "window_both",
        "window_zero", "window_sliding_causal", "key_lengths", "bias_bhqk", "bias_1hqk", "bias_b11k", "bias_11qk",
        "alibi", "alibi_causal_more_keys", "all_options"})
    cases.push_back(name);
  std::vector<std::string> files;
  for (const auto& c : cases) {
    files.push_back(c + "_f32");
    files.push_back(c + "_f64");
  }
  return files;
}

std::string fixture_path(const std::string& name) { return std::string(SDPA_FIXTURE_DIR) + "/" + name + ".sdpafix"; }

// Compares y with the fixture's output: shape, NaN positions, finiteness and the relative error.
template <typename Scalar>
::testing::AssertionResult matches(const Eigen::Tensor<Scalar, 3, Eigen::RowMajor>& y, const sdpa_test::Array& ref,
                                   double tolerance) {
  if (ref.rank() != 3 || y.dimension(0) != ref.dims[0] || y.dimension(1) != ref.dims[1] ||
      y.dimension(2) != ref.dims[2]) {
    return ::testing::AssertionFailure() << "shape (" << y.dimension(0) << ", " << y.dimension(1) << ", "
                                         << y.dimension(2) << ") != expected " << ref.shape_string();
  }
  const Eigen::Index d = y.dimension(2), n = y.dimension(1) * d;
  auto where = [&](Eigen::Index i) {
    std::ostringstream os;
    os << "[" << i / n << ", " << (i % n) / d << ", " << i % d << "]";
    return os.str();
  };
  double ref_max = 0, err_max = 0;
  Eigen::Index worst = -1, nans = 0;
  for (Eigen::Index i = 0; i < y.size(); ++i) {
    const double r = ref.f64[static_cast<std::size_t>(i)], v = static_cast<double>(y.data()[i]);
    if (std::isnan(r)) {
      ++nans;
      if (!std::isnan(v)) return ::testing::AssertionFailure() << "expected NaN at " << where(i) << ", got " << v;
      continue;
    }
    if (!std::isfinite(v))
      return ::testing::AssertionFailure() << "got " << v << " at " << where(i) << ", expected " << r;
    ref_max = std::max(ref_max, std::abs(r));
    if (std::abs(v - r) > err_max) {
      err_max = std::abs(v - r);
      worst = i;
    }
  }
  const double rel = err_max / std::max(ref_max, 1e-30);
  if (rel > tolerance) {
    return ::testing::AssertionFailure()
           << "relative error " << rel << " > " << tolerance << " (max |y - ref| " << err_max << " at "
           << where(worst) << ": got " << static_cast<double>(y.data()[worst]) << ", expected "
           << ref.f64[static_cast<std::size_t>(worst)] << "; max |ref| " << ref_max << ")";
  }
  return ::testing::AssertionSuccess() << "relative error " << rel << ", " << nans << " NaN";
}

// Bitwise equality, NaN equal to NaN.
template <typename Scalar>
::testing::AssertionResult identical(const Eigen::Tensor<Scalar, 3, Eigen::RowMajor>& a,
                                     const Eigen::Tensor<Scalar, 3, Eigen::RowMajor>& b) {
  if (a.dimensions() != b.dimensions()) return ::testing::AssertionFailure() << "shapes differ";
  for (Eigen::Index i = 0; i < a.size(); ++i) {
    const Scalar x = a.data()[i], y = b.data()[i];
    if (!(x == y || (std::isnan(x) && std::isnan(y))))
      return ::testing::AssertionFailure() << "element " << i << ": " << x << " vs " << y;
  }
  return ::testing::AssertionSuccess();
}

template <typename Scalar>
void run_fixture(const Fixture& f, double tolerance) {
  using Module = sdpa::ScaledDotProductAttention<Scalar>;
  using Tensor3 = typename Module::Tensor3;
  using Map3 = Eigen::TensorMap<const Tensor3>;

  Module m(f.integer("d_model"), f.integer("d_k"), f.integer("d_v"), f.integer("h"));
  m.eval();
  const std::int64_t policy = f.integer("masked_rows");
  ASSERT_TRUE(policy == 0 || policy == 1) << "masked_rows = " << policy;
  m.set_masked_rows(policy == 1 ? sdpa::MaskedRows::kNaN : sdpa::MaskedRows::kZero);
  ASSERT_NO_THROW(sdpa_test::load_parameters(m, f));
  ASSERT_FALSE(m.is_training());

  const bool self = f.integer("self_attention") == 1;
  const Tensor3 q = sdpa_test::to_tensor<Scalar, 3>(f, "queries");
  const Tensor3 k = sdpa_test::to_tensor<Scalar, 3>(f, "keys");
  const Tensor3 v = sdpa_test::to_tensor<Scalar, 3>(f, "values");
  std::unique_ptr<typename Module::Mask> mask;
  std::unique_ptr<typename Module::Weights> weights;
  if (f.has("attention_mask")) mask = std::make_unique<typename Module::Mask>(sdpa_test::to_mask(f, "attention_mask"));
  if (f.has("attention_weights"))
    weights = std::make_unique<typename Module::Weights>(sdpa_test::to_tensor<Scalar, 4>(f, "attention_weights"));
  const sdpa_test::Array& expected = f.real("output", 3);

  if (f.has("causal")) {
    // An options case: every tensor-free option, the bias, and the probabilities PyTorch computed.
    sdpa::AttentionOptions<Scalar> o;
    o.attention_mask = mask.get();
    o.attention_weights = weights.get();
    o.causal = f.integer("causal") != 0;
    o.window_left = f.integer("window_left");
    o.window_right = f.integer("window_right");
    if (f.has("key_lengths"))
      for (std::int64_t l : f.get("key_lengths").i64) o.key_lengths.push_back(static_cast<Eigen::Index>(l));
    if (f.has("alibi_slopes"))
      for (double a : f.real("alibi_slopes", 1).f64) o.alibi_slopes.push_back(static_cast<Scalar>(a));
    Eigen::Tensor<Scalar, 4, Eigen::RowMajor> bias;
    if (f.has("attention_bias")) {
      bias = sdpa_test::to_tensor<Scalar, 4>(f, "attention_bias");
      o.attention_bias = &bias;
    }
    const sdpa_test::Array& want_probs = f.real("probabilities", 4);
    Eigen::ThreadPool pool(2);
    Eigen::ThreadPoolDevice device(&pool, 2);
    for (sdpa::Kernel kernel : {sdpa::Kernel::kAuto, sdpa::Kernel::kReference}) {
      m.set_kernel(kernel);
      for (const Eigen::ThreadPoolDevice* d : {static_cast<const Eigen::ThreadPoolDevice*>(nullptr),
                                               static_cast<const Eigen::ThreadPoolDevice*>(&device)}) {
        SCOPED_TRACE(::testing::Message() << (kernel == sdpa::Kernel::kAuto ? "tiled" : "reference")
                                          << (d ? ", 2 threads" : ""));
        Eigen::Tensor<Scalar, 4, Eigen::RowMajor> probs;
        o.probabilities = &probs;
        o.device = d;
        const Tensor3 y = self ? m.forward(q, q, q, o) : m.forward(q, k, v, o);
        EXPECT_TRUE(matches(y, expected, tolerance)) << "output";
        ASSERT_EQ(static_cast<std::size_t>(probs.size()), want_probs.f64.size());
        for (Eigen::Index i = 0; i < probs.size(); ++i) {
          const double w = want_probs.f64[static_cast<std::size_t>(i)], g = static_cast<double>(probs.data()[i]);
          if (std::isnan(w)) {
            ASSERT_TRUE(std::isnan(g)) << "probability " << i;
          } else if (w == 0.0) {
            ASSERT_EQ(g, 0.0) << "probability " << i << " of a hidden key";
          } else {
            ASSERT_NEAR(g, w, tolerance) << "probability " << i;
          }
        }
      }
    }
    return;
  }

  // 1. Eigen::Tensor inputs (self-attention: one object passed three times).
  const Tensor3 y = self ? m.forward(q, q, q, mask.get(), weights.get()) : m.forward(q, k, v, mask.get(), weights.get());
  EXPECT_TRUE(matches(y, expected, tolerance)) << "Tensor inputs";

  // 2. TensorMaps over plain buffers holding the same values, read in place.
  std::vector<Scalar> qs = sdpa_test::to_vector<Scalar>(f, "queries");
  std::vector<Scalar> ks = sdpa_test::to_vector<Scalar>(f, "keys");
  std::vector<Scalar> vs = sdpa_test::to_vector<Scalar>(f, "values");
  const Map3 qm(qs.data(), q.dimension(0), q.dimension(1), q.dimension(2));
  const Map3 km(ks.data(), k.dimension(0), k.dimension(1), k.dimension(2));
  const Map3 vm(vs.data(), v.dimension(0), v.dimension(1), v.dimension(2));
  const Tensor3 ym = self ? m(qm, qm, qm, mask.get(), weights.get()) : m(qm, km, vm, mask.get(), weights.get());
  EXPECT_TRUE(matches(ym, expected, tolerance)) << "TensorMap inputs";
  EXPECT_TRUE(identical(y, ym)) << "TensorMap inputs give a different result from Tensor inputs";

  // 3. A two-thread pool.
  Eigen::ThreadPool pool(2);
  Eigen::ThreadPoolDevice device(&pool, 2);
  const Tensor3 yd = self ? m.forward(q, q, q, mask.get(), weights.get(), &device)
                          : m.forward(q, k, v, mask.get(), weights.get(), &device);
  EXPECT_TRUE(matches(yd, expected, tolerance)) << "ThreadPoolDevice";

  // 4. The plain reference kernel.
  m.set_kernel(sdpa::Kernel::kReference);
  const Tensor3 yr = self ? m.forward(q, q, q, mask.get(), weights.get()) : m.forward(q, k, v, mask.get(), weights.get());
  EXPECT_TRUE(matches(yr, expected, tolerance)) << "reference kernel";
}

class Parity : public ::testing::TestWithParam<std::string> {};

TEST_P(Parity, MatchesPyTorch) {
  Fixture f;
  ASSERT_NO_THROW(f = Fixture::load(fixture_path(GetParam()))) << fixture_path(GetParam());
  const std::int64_t bits = f.integer("scalar_bits");
  if (bits == 32) {
    run_fixture<float>(f, 2e-5);
  } else if (bits == 64) {
    run_fixture<double>(f, 1e-10);
  } else {
    FAIL() << "scalar_bits = " << bits;
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Parity, ::testing::ValuesIn(case_names()),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

// The list above and the directory agree, so that no fixture is silently skipped.
TEST(ParityFixtures, DirectoryHoldsExactlyTheListedFixtures) {
  const std::vector<std::string> listed = case_names();
  const std::set<std::string> want(listed.begin(), listed.end());
  ASSERT_EQ(want.size(), listed.size()) << "duplicate case names";
  std::set<std::string> have;
  for (const auto& entry : std::filesystem::directory_iterator(SDPA_FIXTURE_DIR))
    if (entry.path().extension() == ".sdpafix") have.insert(entry.path().stem().string());
  for (const auto& name : want) EXPECT_TRUE(have.count(name)) << "missing fixture " << name;
  for (const auto& name : have) EXPECT_TRUE(want.count(name)) << "fixture not listed in parity_test.cpp: " << name;
}

// The reader refuses damaged files with std::runtime_error.
TEST(ParityFixtures, ReaderRejectsBadFiles) {
  const std::string dir = ::testing::TempDir();
  auto write = [&](const std::string& name, const std::string& bytes) {
    const std::string path = dir + "/" + name;
    std::ofstream(path, std::ios::binary) << bytes;
    return path;
  };
  EXPECT_THROW(Fixture::load(dir + "/does_not_exist.sdpafix"), std::runtime_error);
  EXPECT_THROW(Fixture::load(write("bad_magic.sdpafix", std::string("SDPAFIX2\0\0\0\0", 12))), std::runtime_error);
  // A valid file to truncate and extend: one i64 scalar "x" = 7.
  std::string good("SDPAFIX1", 8);
  good += std::string("\x01\x00\x00\x00", 4) + std::string("\x01\x00\x00\x00", 4) + "x" + std::string("\x02\x00", 2) +
          std::string("\x07\x00\x00\x00\x00\x00\x00\x00", 8);
  EXPECT_EQ(Fixture::load(write("good.sdpafix", good)).integer("x"), 7);
  EXPECT_THROW(Fixture::load(write("truncated.sdpafix", good.substr(0, good.size() - 1))), std::runtime_error);
  EXPECT_THROW(Fixture::load(write("trailing.sdpafix", good + "z")), std::runtime_error);
  std::string bad_dtype = good;
  bad_dtype[8 + 4 + 4 + 1] = '\x09';
  EXPECT_THROW(Fixture::load(write("bad_dtype.sdpafix", bad_dtype)), std::runtime_error);
  // A real fixture truncated in its data.
  std::ifstream in(fixture_path("single_everything_f64"), std::ios::binary);
  const std::string real((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GT(real.size(), 100u);
  EXPECT_NO_THROW(Fixture::load(write("real.sdpafix", real)));
  EXPECT_THROW(Fixture::load(write("real_cut.sdpafix", real.substr(0, real.size() - 9))), std::runtime_error);
}

}  // namespace parity_test
