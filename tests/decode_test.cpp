// Tests of sdpa/kernels/decode.hpp (the decoding kernel: a few queries against many keys, split into key
// chunks) on problems built by tests/support/problem.hpp: its float output and log-sum-exp against a plain
// double-precision reference on the same (float-rounded) inputs, for one to kDecodeQueries queries, key
// counts around the chunk size, grouped-query heads, head sizes with and without a vector tail, every
// option that reaches the kernel (mask with fully masked rows under both policies, weights, bias, causal,
// windows, key lengths, ALiBi, dropout, strided rows); and the same bits on one and two threads.
#include "sdpa/kernels/decode.hpp"
#include "sdpa/kernels/reference.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "support/problem.hpp"
#include "support/reference.hpp"

namespace decode_test {

using Index = Eigen::Index;
using sdpa::MaskedRows;
using sdpa_test::Spec;
using sdpa_test::TestProblem;

// The float problem of a spec and the same problem in double holding the float inputs' exact values.
struct Pair {
  std::unique_ptr<TestProblem<float>> f;
  std::unique_ptr<TestProblem<double>> d;
};

Pair make_both(const Spec& s) {
  Pair p{sdpa_test::make_problem<float>(s), sdpa_test::make_problem<double>(s)};
  const auto widen = [](const auto& from, auto& to) {
    for (std::size_t i = 0; i < to.size(); ++i) to[i] = static_cast<double>(from[i]);
  };
  widen(p.f->qkv, p.d->qkv);
  widen(p.f->alibi, p.d->alibi);
  for (Index i = 0; i < p.d->weights.size(); ++i) p.d->weights.data()[i] = p.f->weights.data()[i];
  for (Index i = 0; i < p.d->bias.size(); ++i) p.d->bias.data()[i] = p.f->bias.data()[i];
  return p;
}

struct Result {
  std::vector<double> out, lse;
};

template <typename T>
Result run(TestProblem<T>& t, bool decode, const Eigen::ThreadPoolDevice* device = nullptr) {
  std::vector<T> out(static_cast<std::size_t>(t.out_size()), T(-7)), lse(static_cast<std::size_t>(t.p.batch * t.p.heads * t.p.nq), T(-7));
  sdpa::kernels::AttentionProblem<T> p = t.p;
  p.out = {out.data(), p.nq * p.heads * p.d_v, p.heads * p.d_v, p.d_v};
  p.lse = lse.data();
  if (decode) {
    sdpa::kernels::DecodeWorkspace<T> ws;
    sdpa::kernels::decode_attention(p, ws, device);
  } else {
    sdpa::kernels::reference_attention(p, device);
  }
  return {std::vector<double>(out.begin(), out.end()), std::vector<double>(lse.begin(), lse.end())};
}

// decode_test's comparison: sdpa_test::close_elements over two result vectors.
::testing::AssertionResult close(const std::vector<double>& got, const std::vector<double>& want, double tol,
                                 const char* what) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << what << ": sizes differ";
  return sdpa_test::close_elements(got.data(), want.data(), got.size(), tol, what);
}

void expect_matches_double(const Spec& s) {
  SCOPED_TRACE(sdpa_test::describe(s));
  Pair pair = make_both(s);
  const Result want = run(*pair.d, /*decode=*/false);
  const Result got = run(*pair.f, /*decode=*/true);
  EXPECT_TRUE(close(got.out, want.out, 2e-5, "output"));
  EXPECT_TRUE(close(got.lse, want.lse, 2e-5, "log-sum-exp"));
  // The kernel's double form against the same reference, to double rounding.
  const Result exact = run(*pair.d, /*decode=*/true);
  EXPECT_TRUE(close(exact.out, want.out, 1e-12, "double output"));
}

TEST(DecodeKernel, FewQueriesAroundTheChunkSize) {
  for (Index nq : {Index(1), Index(3), sdpa::kernels::kDecodeQueries})
    for (Index nk : {Index(1), Index(17), sdpa::kernels::kDecodeChunk - 1, sdpa::kernels::kDecodeChunk,
                     sdpa::kernels::kDecodeChunk + 1, Index(3 * 256 + 40)})
      for (Index d : {Index(1), Index(16), Index(64), Index(70)}) {
        Spec s;
        s.batch = 2;
        s.heads = 4;
        s.nq = nq;
        s.nk = std::max(nk, nq);
        s.d_k = d;
        s.d_v = d == 1 ? 3 : d;
        s.seed = static_cast<std::uint32_t>(nq * 1000 + nk * 10 + d);
        expect_matches_double(s);
      }
}

TEST(DecodeKernel, GroupedQueryHeads) {
  for (Index kv : {Index(4), Index(2), Index(1)})
    for (Index nq : {Index(1), Index(5)}) {
      Spec s;
      s.heads = 8;
      s.kv_heads = kv;
      s.nq = nq;
      s.nk = 300;
      s.d_k = 32;
      s.d_v = 24;
      s.pad = 3;
      expect_matches_double(s);
    }
}

TEST(DecodeKernel, EveryOptionThatReachesTheKernel) {
  for (MaskedRows policy : {MaskedRows::kZero, MaskedRows::kNaN})
    for (int option = 0; option < 8; ++option) {
      Spec s;
      s.heads = 2;
      s.nq = 4;
      s.nk = 520;
      s.d_k = 16;
      s.d_v = 8;
      s.policy = policy;
      s.seed = static_cast<std::uint32_t>(11 + option);
      switch (option) {
        case 0: s.has_mask = true, s.fully_masked_rate = 0.3; break;
        case 1: s.has_mask = true, s.mask_full = {{false, true, true, false}}; break;
        case 2: s.has_weights = true, s.has_bias = true; break;
        case 3: s.causal = true; break;
        case 4: s.window_left = 100, s.window_right = 3; break;
        case 5: s.key_lengths = {0, 300}; break;
        case 6: s.alibi = true, s.causal = true; break;
        default: s.dropout = 0.25; break;
      }
      expect_matches_double(s);
    }
}

// Chunks are fixed by the key count, never by the threads: one and two threads give the same bits.
TEST(DecodeKernel, SameBitsOnOneAndTwoThreads) {
  Eigen::ThreadPool pool(2);
  Eigen::ThreadPoolDevice two(&pool, 2);
  Spec s;
  s.batch = 3;
  s.heads = 4;
  s.kv_heads = 2;
  s.nq = 2;
  s.nk = 1100;
  s.d_k = 64;
  s.d_v = 64;
  s.has_mask = true;
  auto t = sdpa_test::make_problem<float>(s);
  const Result one = run(*t, true), both = run(*t, true, &two);
  EXPECT_EQ(0, std::memcmp(one.out.data(), both.out.data(), one.out.size() * sizeof(double)));
  EXPECT_EQ(0, std::memcmp(one.lse.data(), both.lse.data(), one.lse.size() * sizeof(double)));
}

}  // namespace decode_test
