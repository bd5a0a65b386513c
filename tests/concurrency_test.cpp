// Concurrent use of one const sdpa::ScaledDotProductAttention (float and double): eval-mode forward from
// four std::threads at once, each with its own inputs, gives exactly the serial results, with and without
// a 2-thread Eigen::ThreadPoolDevice shared by all callers. In training mode, concurrent calls each take
// their own dropout draw: together they give exactly the outputs of the same number of serial calls.
#include "sdpa/scaled_dot_product_attention.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "support/reference.hpp"

namespace concurrency_test {

using Index = Eigen::Index;
using sdpa_test::Rng;
using Mask = Eigen::Tensor<bool, 4, Eigen::RowMajor>;

constexpr int kThreads = 4;
constexpr int kIterations = 6;

template <typename T>
class ConcurrencyTest : public ::testing::Test {
 protected:
  using Module = sdpa::ScaledDotProductAttention<T>;
  using Tensor3 = Eigen::Tensor<T, 3, Eigen::RowMajor>;
  static constexpr bool kFloat = std::is_same<T, float>::value;

  struct Inputs {
    Tensor3 q, k, v;
    Mask mask;
    bool use_mask;
  };

  static Tensor3 random3(Rng& rng, Index a, Index b, Index c) {
    Tensor3 t(a, b, c);
    rng.fill_normal(t);
    return t;
  }

  // Thread t gets its own shapes and data; odd threads also a mask. batch * nq >= 80 rows, so a device
  // splits the projections as well as the heads.
  static std::vector<Inputs> make_inputs(Rng& rng, Index d_model) {
    std::vector<Inputs> in;
    for (int t = 0; t < kThreads; ++t) {
      const Index batch = 2 + t % 2, nq = 40 + 3 * t, nk = 30 + 5 * t;
      Inputs x{random3(rng, batch, nq, d_model), random3(rng, batch, nk, d_model), random3(rng, batch, nk, d_model),
               Mask(), t % 2 == 1};
      if (x.use_mask) x.mask = t == 1 ? sdpa::causal_mask(nq, nk) : sdpa::key_padding_mask(std::vector<Index>(
                                                                          static_cast<std::size_t>(batch), nk - 7), nk);
      in.push_back(std::move(x));
    }
    return in;
  }

  static bool identical(const Tensor3& a, const Tensor3& b) {
    for (int i = 0; i < 3; ++i)
      if (a.dimension(i) != b.dimension(i)) return false;
    for (Index i = 0; i < a.size(); ++i)
      if (!(a.data()[i] == b.data()[i] || (std::isnan(a.data()[i]) && std::isnan(b.data()[i])))) return false;
    return true;
  }

  // Runs every thread's inputs kIterations times, all threads started together; returns per thread, per
  // iteration, whether the result was identical to `serial`.
  static std::vector<int> run_concurrently(const Module& m, const std::vector<Inputs>& in,
                                           const std::vector<Tensor3>& serial, const Eigen::ThreadPoolDevice* device) {
    std::vector<int> mismatches(kThreads, 0);
    std::atomic<int> ready{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        ready.fetch_add(1);
        while (ready.load() < kThreads) std::this_thread::yield();
        const Inputs& x = in[static_cast<std::size_t>(t)];
        for (int it = 0; it < kIterations; ++it) {
          const Tensor3 out = m.forward(x.q, x.k, x.v, x.use_mask ? &x.mask : nullptr, nullptr, device);
          if (!identical(out, serial[static_cast<std::size_t>(t)])) ++mismatches[static_cast<std::size_t>(t)];
        }
      });
    }
    for (auto& th : threads) th.join();
    return mismatches;
  }
};

using ScalarTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(ConcurrencyTest, ScalarTypes);

TYPED_TEST(ConcurrencyTest, EvalForwardFromFourThreadsMatchesSerial) {
  using Module = typename TestFixture::Module;
  Rng rng(41);
  Module owned(16, 4, 4, 4);
  sdpa_test::randomize_module(owned, rng);
  owned.eval();
  const Module& m = owned;
  const auto in = TestFixture::make_inputs(rng, 16);
  std::vector<typename TestFixture::Tensor3> serial;
  for (const auto& x : in) {
    serial.push_back(m.forward(x.q, x.k, x.v, x.use_mask ? &x.mask : nullptr));
    // The serial result is itself right.
    EXPECT_LT(sdpa_test::max_relative_error(serial.back(),
                                            sdpa_test::reference_forward(m, x.q, x.k, x.v, x.use_mask ? &x.mask : nullptr)),
              TestFixture::kFloat ? 2e-5 : 1e-10);
  }
  const auto mismatches = TestFixture::run_concurrently(m, in, serial, nullptr);
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(mismatches[static_cast<std::size_t>(t)], 0) << "thread " << t;
}

TYPED_TEST(ConcurrencyTest, EvalForwardFromFourThreadsSharingADevice) {
  using Module = typename TestFixture::Module;
  Rng rng(42);
  Module owned(16, 4, 4, 4);
  sdpa_test::randomize_module(owned, rng);
  owned.eval();
  const Module& m = owned;
  const auto in = TestFixture::make_inputs(rng, 16);
  Eigen::ThreadPool pool(2);
  Eigen::ThreadPoolDevice device(&pool, 2);
  std::vector<typename TestFixture::Tensor3> serial;
  for (const auto& x : in) serial.push_back(m.forward(x.q, x.k, x.v, x.use_mask ? &x.mask : nullptr, nullptr, &device));
  const auto mismatches = TestFixture::run_concurrently(m, in, serial, &device);
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(mismatches[static_cast<std::size_t>(t)], 0) << "thread " << t;
  // And the device result is the no-device result within rounding.
  for (std::size_t t = 0; t < in.size(); ++t) {
    const auto& x = in[t];
    const auto plain = m.forward(x.q, x.k, x.v, x.use_mask ? &x.mask : nullptr);
    EXPECT_LT(sdpa_test::max_relative_error(serial[t], sdpa_test::to_array3(plain)),
              TestFixture::kFloat ? 1e-5 : 1e-12);
  }
}

TYPED_TEST(ConcurrencyTest, ConcurrentTrainingCallsTakeDistinctDraws) {
  using Module = typename TestFixture::Module;
  using Tensor3 = typename TestFixture::Tensor3;
  Rng rng(43);
  Module a(8, 4, 4, 2, TypeParam(0.5));
  sdpa_test::randomize_module(a, rng);
  a.manual_seed(123);
  Module b(a);
  b.manual_seed(123);  // a copy takes a seed of its own
  const auto q = TestFixture::random3(rng, 2, 6, 8), k = TestFixture::random3(rng, 2, 7, 8);
  const int calls = kThreads * kIterations;
  std::vector<Tensor3> serial;
  for (int c = 0; c < calls; ++c) serial.push_back(a.forward(q, k, k));
  // Each call draws its own mask, so the serial outputs are pairwise different.
  for (int c = 0; c < calls; ++c)
    for (int d = c + 1; d < calls; ++d)
      ASSERT_FALSE(TestFixture::identical(serial[static_cast<std::size_t>(c)], serial[static_cast<std::size_t>(d)]))
          << "serial calls " << c << " and " << d << " drew the same dropout mask";

  std::vector<std::vector<Tensor3>> got(kThreads);
  std::atomic<int> ready{0};
  std::vector<std::thread> threads;
  const Module& shared = b;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      ready.fetch_add(1);
      while (ready.load() < kThreads) std::this_thread::yield();
      for (int it = 0; it < kIterations; ++it) got[static_cast<std::size_t>(t)].push_back(shared.forward(q, k, k));
    });
  }
  for (auto& th : threads) th.join();

  // Every concurrent output is one of the serial outputs, and each serial output appears exactly once.
  std::vector<int> used(static_cast<std::size_t>(calls), 0);
  for (const auto& outs : got)
    for (const auto& o : outs) {
      int match = -1;
      for (int c = 0; c < calls; ++c)
        if (!used[static_cast<std::size_t>(c)] && TestFixture::identical(o, serial[static_cast<std::size_t>(c)])) {
          match = c;
          break;
        }
      ASSERT_GE(match, 0) << "a concurrent training output matches no unused serial call";
      used[static_cast<std::size_t>(match)] = 1;
    }
  for (int c = 0; c < calls; ++c) EXPECT_EQ(used[static_cast<std::size_t>(c)], 1) << "serial call " << c;
  // The next call continues after all of them.
  EXPECT_TRUE(TestFixture::identical(b.forward(q, k, k), a.forward(q, k, k)));
}

}  // namespace concurrency_test
