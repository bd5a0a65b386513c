// sdpa::gemm against plain double-precision loops written here, for float and double, on the path
// sdpa::cpu_isa() names (ctest runs this file once per path the CPU has: SDPA_ISA=avx512, avx2, portable). Sizes: small and odd ones, primes, and the micro-tile and cache-block boundaries (mr,
// nr, kc, nc, mc of this build's blocking) +-1, k = 0, m or n = 0; strided operands; alpha/beta variants,
// beta = 0 over a C full of NaN; the bias epilogue; the packed API and its storage reuse; 1 and 2
// threads, whose results must be bit-identical.
//
// Tolerance: |C - C_ref| <= tol * sqrt(max(k, 1)) * (|alpha| sum_p |a_ip b_pj| + |beta c_ij| + |bias_j|),
// tol = 1e-5 for float and 1e-12 for double: a relative bound on the sum of the terms' magnitudes, which
// holds for any summation order (the kernels sum k in blocks of kc, with FMAs) and does not blow up where
// terms cancel.
#include <sdpa/gemm/gemm.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace gemm_test {

using Index = Eigen::Index;
namespace gemm = sdpa::gemm;

template <typename Scalar>
constexpr double tolerance() {
  return std::is_same<Scalar, float>::value ? 1e-5 : 1e-12;
}

// kInPlace*: B packed, A read in place (multiply(m, a, lda, packed_b, ...)).
enum class Op { kNT, kNN, kNTBias, kPackedNT, kPackedNN, kInPlaceNT, kInPlaceNN };

const char* op_name(Op op) {
  switch (op) {
    case Op::kNT:
      return "gemm_nt";
    case Op::kNN:
      return "gemm_nn";
    case Op::kNTBias:
      return "gemm_nt_bias";
    case Op::kPackedNT:
      return "packed nt";
    case Op::kPackedNN:
      return "packed nn";
    case Op::kInPlaceNT:
      return "packed B nt, A in place";
    case Op::kInPlaceNN:
      return "packed B nn, A in place";
  }
  return "?";
}
bool is_nt(Op op) { return op != Op::kNN && op != Op::kPackedNN && op != Op::kInPlaceNN; }
bool has_bias(Op op) { return op == Op::kNTBias; }

struct Shape {
  Index m, n, k;
};

std::string describe(Op op, const Shape& s, double alpha, double beta, bool strided, int threads) {
  return std::string(op_name(op)) + " m=" + std::to_string(s.m) + " n=" + std::to_string(s.n) +
         " k=" + std::to_string(s.k) + " alpha=" + std::to_string(alpha) + " beta=" + std::to_string(beta) +
         (strided ? " strided" : " dense") + " threads=" + std::to_string(threads) + " isa=" + sdpa::cpu_isa();
}

const Eigen::ThreadPoolDevice* two_threads() {
  static Eigen::ThreadPool pool(2);
  static Eigen::ThreadPoolDevice device(&pool, 2);
  return &device;
}

std::size_t to_size(Index i) { return static_cast<std::size_t>(i); }

// Operands of one product in row-major buffers with leading dimensions; a is m x k, b is n x k (nt) or
// k x n (nn), c is m x n inside ldc columns plus a guard row, the padding and guard holding a sentinel
// that no call may overwrite.
template <typename Scalar>
struct Operands {
  static constexpr Scalar kSentinel = Scalar(-12345.5);
  Index lda, ldb, ldc;
  std::vector<Scalar> a, b, c0, bias;

  Operands(Op op, const Shape& s, bool strided, unsigned seed, bool nan_c) {
    lda = std::max<Index>(s.k, 1) + (strided ? 3 : 0);
    ldb = std::max<Index>(is_nt(op) ? s.k : s.n, 1) + (strided ? 5 : 0);
    ldc = std::max<Index>(s.n, 1) + (strided ? 7 : 0);
    std::mt19937 gen(seed);
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    a.assign(to_size(s.m * lda), kSentinel);
    for (Index i = 0; i < s.m; ++i)
      for (Index p = 0; p < s.k; ++p) a[to_size(i * lda + p)] = Scalar(u(gen));
    const Index b_rows = is_nt(op) ? s.n : s.k, b_cols = is_nt(op) ? s.k : s.n;
    b.assign(to_size(b_rows * ldb), kSentinel);
    for (Index i = 0; i < b_rows; ++i)
      for (Index j = 0; j < b_cols; ++j) b[to_size(i * ldb + j)] = Scalar(u(gen));
    c0.assign(to_size((s.m + 1) * ldc), kSentinel);
    for (Index i = 0; i < s.m; ++i)
      for (Index j = 0; j < s.n; ++j)
        c0[to_size(i * ldc + j)] = nan_c ? std::numeric_limits<Scalar>::quiet_NaN() : Scalar(u(gen));
    bias.resize(to_size(std::max<Index>(s.n, 1)));
    for (Scalar& x : bias) x = Scalar(u(gen));
  }

  double a_at(Index i, Index p) const { return double(a[to_size(i * lda + p)]); }
  double b_at(Op op, Index p, Index j) const {
    return double(is_nt(op) ? b[to_size(j * ldb + p)] : b[to_size(p * ldb + j)]);
  }
};

// Runs op on a copy of c0 and returns it.
template <typename Scalar>
std::vector<Scalar> run(Op op, const Shape& s, Scalar alpha, Scalar beta, const Operands<Scalar>& x,
                        const Eigen::ThreadPoolDevice* device) {
  std::vector<Scalar> c = x.c0;
  switch (op) {
    case Op::kNT:
      gemm::gemm_nt<Scalar>({s.m, s.n, s.k}, alpha, {x.a.data(), x.lda}, {x.b.data(), x.ldb}, beta, {c.data(), x.ldc},
                            {device});
      break;
    case Op::kNN:
      gemm::gemm_nn<Scalar>({s.m, s.n, s.k}, alpha, {x.a.data(), x.lda}, {x.b.data(), x.ldb}, beta, {c.data(), x.ldc},
                            {device});
      break;
    case Op::kNTBias:
      gemm::gemm_nt_bias<Scalar>({s.m, s.n, s.k}, {x.a.data(), x.lda}, {x.b.data(), x.ldb}, x.bias.data(),
                                 {c.data(), x.ldc}, {device});
      break;
    case Op::kPackedNT:
    case Op::kPackedNN: {
      gemm::PackedA<Scalar> pa;
      gemm::PackedB<Scalar> pb;
      pa.pack(s.m, s.k, x.a.data(), x.lda);
      if (op == Op::kPackedNT) {
        pb.pack_nt(s.n, s.k, x.b.data(), x.ldb);
      } else {
        pb.pack_nn(s.k, s.n, x.b.data(), x.ldb);
      }
      gemm::multiply(pa, pb, alpha, beta, c.data(), x.ldc, nullptr, device);
      break;
    }
    case Op::kInPlaceNT:
    case Op::kInPlaceNN: {
      gemm::PackedB<Scalar> pb;
      if (op == Op::kInPlaceNT) {
        pb.pack_nt(s.n, s.k, x.b.data(), x.ldb);
      } else {
        pb.pack_nn(s.k, s.n, x.b.data(), x.ldb);
      }
      gemm::multiply(s.m, {x.a.data(), x.lda}, pb, alpha, beta, {c.data(), x.ldc}, nullptr, device);
      break;
    }
  }
  return c;
}

// The double-precision product A B of one shape's operands, and the sum of its terms' magnitudes (the
// scale of the rounding error): it depends only on the operands' values, which Operands draws in the same
// order whatever the layout and scaling, so one product serves every (alpha, beta, strided) of a shape.
struct Product {
  Index n = 0;
  std::vector<double> sum, magnitude;
  template <typename Scalar>
  Product(Op op, const Shape& s, const Operands<Scalar>& x)
      : n(s.n), sum(to_size(s.m * s.n)), magnitude(to_size(s.m * s.n)) {
    std::vector<double> bt(to_size(s.n * s.k));  // B transposed, n x k
    for (Index p = 0; p < s.k; ++p)
      for (Index j = 0; j < s.n; ++j) bt[to_size(j * s.k + p)] = x.b_at(op, p, j);
    std::vector<double> a_row(to_size(s.k));
    for (Index i = 0; i < s.m; ++i) {
      for (Index p = 0; p < s.k; ++p) a_row[to_size(p)] = x.a_at(i, p);
      for (Index j = 0; j < s.n; ++j) {
        const double* b = bt.data() + j * s.k;
        double total = 0, size = 0;
        for (Index p = 0; p < s.k; ++p) {
          const double t = a_row[to_size(p)] * b[p];
          total += t;
          size += std::abs(t);
        }
        sum[to_size(i * s.n + j)] = total;
        magnitude[to_size(i * s.n + j)] = size;
      }
    }
  }
};

// Checks c against the double-precision reference (product: A B of x's values, computed here when not
// given), and that the padding and guard row kept the sentinel.
template <typename Scalar>
void expect_matches(Op op, const Shape& s, double alpha, double beta, const Operands<Scalar>& x,
                    const std::vector<Scalar>& c, const std::string& what, const Product* product = nullptr) {
  const double tol = tolerance<Scalar>() * std::sqrt(double(std::max<Index>(s.k, 1)));
  std::unique_ptr<Product> own;
  if (product == nullptr) {
    own = std::make_unique<Product>(op, s, x);
    product = own.get();
  }
  Index bad = 0;
  for (Index i = 0; i < s.m; ++i) {
    for (Index j = 0; j < s.n; ++j) {
      double expected = alpha * product->sum[to_size(i * s.n + j)];
      double magnitude = std::abs(alpha) * product->magnitude[to_size(i * s.n + j)];
      if (beta != 0) {
        const double c_in = double(x.c0[to_size(i * x.ldc + j)]);
        expected += beta * c_in;
        magnitude += std::abs(beta * c_in);
      }
      if (has_bias(op)) {
        expected += double(x.bias[to_size(j)]);
        magnitude += std::abs(double(x.bias[to_size(j)]));
      }
      const double got = double(c[to_size(i * x.ldc + j)]);
      if (!(std::abs(got - expected) <= tol * magnitude) && bad++ < 5) {
        ADD_FAILURE() << what << ": C(" << i << ", " << j << ") = " << got << ", expected " << expected << " (bound "
                      << tol * magnitude << ")";
      }
    }
  }
  EXPECT_EQ(bad, 0) << what;
  Index touched = 0;
  for (Index i = 0; i <= s.m; ++i) {
    for (Index j = (i < s.m ? s.n : 0); j < x.ldc; ++j) {
      if (c[to_size(i * x.ldc + j)] != Operands<Scalar>::kSentinel) ++touched;
    }
  }
  EXPECT_EQ(touched, 0) << what << ": elements outside C were written";
}

// Runs op on 1 and 2 threads, checks the first against the reference and the second bit for bit.
template <typename Scalar>
void check(Op op, const Shape& s, double alpha, double beta, bool strided, unsigned seed = 1,
           const Product* product = nullptr) {
  if (has_bias(op)) alpha = 1, beta = 0;  // gemm_nt_bias has neither
  const bool nan_c = beta == 0 && !has_bias(op);
  const Operands<Scalar> x(op, s, strided, seed, nan_c);
  const std::vector<Scalar> one = run(op, s, Scalar(alpha), Scalar(beta), x, nullptr);
  expect_matches(op, s, alpha, beta, x, one, describe(op, s, alpha, beta, strided, 1), product);
  const std::vector<Scalar> two = run(op, s, Scalar(alpha), Scalar(beta), x, two_threads());
  EXPECT_TRUE(std::memcmp(one.data(), two.data(), one.size() * sizeof(Scalar)) == 0)
      << describe(op, s, alpha, beta, strided, 2) << ": 2 threads differ from 1 thread";
}

// Small and odd sizes, primes, and the blocking's boundaries +-1.
std::vector<Shape> shapes(const gemm::Blocking& bl) {
  std::vector<Shape> v;
  for (Index m : {1, 2, 3, 7, 13})
    for (Index n : {1, 2, 3, 7, 13})
      for (Index k : {0, 1, 3, 7, 13}) v.push_back({m, n, k});
  for (Index m : {bl.mr - 1, bl.mr, bl.mr + 1, 2 * bl.mr + 1})
    for (Index n : {bl.nr - 1, bl.nr, bl.nr + 1, 2 * bl.nr + 1}) v.push_back({m, n, 31});
  v.push_back({97, 131, 31});
  v.push_back({131, 97, 97});
  v.push_back({31, 13, 131});
  for (Index k : {bl.kc - 1, bl.kc, bl.kc + 1, 2 * bl.kc + 1}) v.push_back({29, 37, k});
  for (Index n : {bl.nc - 1, bl.nc, bl.nc + 1, 2 * bl.nc + 1}) v.push_back({13, n, 7});
  // Enough rows and columns for the work split to cut both (several items per worker).
  v.push_back({200, 4 * bl.nr + 1, 9});
  v.push_back({65, 3 * bl.nr, bl.kc + 5});
  // Several k blocks with one item (one worker owns it), two (each worker owns one, gemm_loops), three
  // column chunks (cut into four narrower ones for two workers) and four (the workers share each k
  // block's items); so with the micro-kernels (the Eigen fallback cuts all into four items).
  v.push_back({40, 13, bl.kc + 3});
  v.push_back({40, bl.nc + 1, bl.kc + 3});
  v.push_back({40, 2 * bl.nc + 1, bl.kc + 3});
  v.push_back({40, 3 * bl.nc + 1, bl.kc + 3});
  v.push_back({0, 5, 3});
  v.push_back({5, 0, 3});
  v.push_back({0, 0, 0});
  return v;
}

template <typename Scalar>
class GemmTest : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
struct ScalarName {
  template <typename T>
  static std::string GetName(int) {
    return std::is_same<T, float>::value ? "float" : "double";
  }
};
TYPED_TEST_SUITE(GemmTest, Scalars, ScalarName);

// (alpha, beta): plain, scaled, accumulate, both; beta = 0 runs over a C full of NaN.
const std::vector<std::pair<double, double>>& scalings() {
  static const std::vector<std::pair<double, double>> v{{1.0, 0.0}, {0.5, 0.0}, {1.0, 1.0}, {-1.5, 0.25}};
  return v;
}

template <typename Scalar>
void check_all_shapes(Op op) {
  for (const Shape& s : shapes(gemm::blocking<Scalar>())) {
    const Product product(op, s, Operands<Scalar>(op, s, false, 1, false));
    for (const auto& [alpha, beta] : scalings()) {
      for (bool strided : {false, true}) check<Scalar>(op, s, alpha, beta, strided, 1, &product);
    }
  }
}

TYPED_TEST(GemmTest, NtMatchesReference) { check_all_shapes<TypeParam>(Op::kNT); }
TYPED_TEST(GemmTest, NnMatchesReference) { check_all_shapes<TypeParam>(Op::kNN); }
TYPED_TEST(GemmTest, PackedNtMatchesReference) { check_all_shapes<TypeParam>(Op::kPackedNT); }
TYPED_TEST(GemmTest, PackedNnMatchesReference) { check_all_shapes<TypeParam>(Op::kPackedNN); }
TYPED_TEST(GemmTest, InPlaceANtMatchesReference) { check_all_shapes<TypeParam>(Op::kInPlaceNT); }
TYPED_TEST(GemmTest, InPlaceANnMatchesReference) { check_all_shapes<TypeParam>(Op::kInPlaceNN); }

TYPED_TEST(GemmTest, NtBiasMatchesReference) {
  for (const Shape& s : shapes(gemm::blocking<TypeParam>())) {
    const Product product(Op::kNTBias, s, Operands<TypeParam>(Op::kNTBias, s, false, 1, false));
    for (bool strided : {false, true}) check<TypeParam>(Op::kNTBias, s, 1.0, 0.0, strided, 1, &product);
  }
}

// gemm_nt_bias_shared: several projections of one A into one fused C (side by side, as q | k | v; and 11 of
// them, more than one pass takes), each bit for bit what gemm_nt_bias gives it alone (which
// NtBiasMatchesReference checks against the reference), on 1 and 2 threads, nothing written outside them.
TYPED_TEST(GemmTest, SharedANtBiasMatchesEachProductAlone) {
  using Scalar = TypeParam;
  const gemm::Blocking& bl = gemm::blocking<Scalar>();
  const std::vector<std::vector<Index>> widths = {
      {bl.nr + 1, 0, 2 * bl.nc + 3}, {1, 7, 13}, {3 * bl.nr, bl.nr - 1}, {bl.nc, bl.nc, bl.nc}, {5},
      {3, 1, bl.nr + 1, 2, 9, 4, 0, 17, 6, 5, 11}};  // more outputs than one pass takes (8)
  for (const Index m : {Index{1}, Index{13}, bl.mr + 1, Index{200}, bl.mc + 1}) {
    for (const Index k : {Index{0}, Index{7}, bl.kc + 1}) {
      for (const std::vector<Index>& ns : widths) {
        if (m > 200 && k > 7) continue;  // the mc boundary needs only one depth
        std::mt19937 gen(static_cast<unsigned>(m * 131 + k));
        std::uniform_real_distribution<double> u(-1.0, 1.0);
        const Index lda = k + 3;
        Index total = 0;
        for (Index n : ns) total += n;
        const Index ldc = total + 5;
        std::vector<Scalar> a(to_size(std::max<Index>(m * lda, 1)));
        for (Scalar& x : a) x = Scalar(u(gen));
        std::vector<std::vector<Scalar>> w(ns.size()), bias(ns.size());
        std::vector<gemm::BiasedProduct<Scalar>> products;
        std::vector<Scalar> fused(to_size((m + 1) * ldc), Operands<Scalar>::kSentinel);
        Index offset = 0;
        for (std::size_t o = 0; o < ns.size(); ++o) {
          const Index ldw = k + 2;
          w[o].resize(to_size(std::max<Index>(ns[o] * ldw, 1)));
          for (Scalar& x : w[o]) x = Scalar(u(gen));
          bias[o].resize(to_size(std::max<Index>(ns[o], 1)));
          for (Scalar& x : bias[o]) x = Scalar(u(gen));
          products.push_back({w[o].data(), ldw, ns[o], bias[o].data(), fused.data() + offset, ldc});
          offset += ns[o];
        }
        const std::string what = "m=" + std::to_string(m) + " k=" + std::to_string(k) + " outputs=" +
                                 std::to_string(ns.size());
        std::vector<Scalar> one = fused, two = fused;
        for (std::size_t o = 0; o < products.size(); ++o) products[o].c = one.data() + (products[o].c - fused.data());
        gemm::gemm_nt_bias_shared<Scalar>(m, k, {a.data(), lda}, products.data(), products.size());
        for (std::size_t o = 0; o < products.size(); ++o) products[o].c = two.data() + (products[o].c - one.data());
        gemm::gemm_nt_bias_shared<Scalar>(m, k, {a.data(), lda}, products.data(), products.size(), {two_threads()});
        EXPECT_TRUE(std::memcmp(one.data(), two.data(), one.size() * sizeof(Scalar)) == 0) << what << ": 2 threads differ";
        // Each output alone, into a copy of the sentinel-filled buffer at the same place.
        std::vector<Scalar> alone = fused;
        offset = 0;
        for (std::size_t o = 0; o < ns.size(); ++o) {
          gemm::gemm_nt_bias<Scalar>({m, ns[o], k}, {a.data(), lda}, {w[o].data(), k + 2}, bias[o].data(),
                                     {alone.data() + offset, ldc});
          offset += ns[o];
        }
        EXPECT_TRUE(std::memcmp(one.data(), alone.data(), one.size() * sizeof(Scalar)) == 0)
            << what << ": differs from the products one by one (or wrote outside them)";
        Index written = 0;
        for (Index i = 0; i < m; ++i)
          for (Index j = 0; j < total; ++j) written += one[to_size(i * ldc + j)] != Operands<Scalar>::kSentinel;
        EXPECT_EQ(written, m * total) << what;
      }
    }
  }
}

// The mc boundary: the only case with more than one block of rows (thousands of rows, so a narrow C).
TYPED_TEST(GemmTest, RowBlockBoundary) {
  const gemm::Blocking& bl = gemm::blocking<TypeParam>();
  for (Index m : {bl.mc - 1, bl.mc, bl.mc + 1}) {
    for (Op op : {Op::kNT, Op::kNN, Op::kNTBias}) check<TypeParam>(op, {m, 5, 3}, 1.0, 0.5, true);
  }
  check<TypeParam>(Op::kNT, {bl.mc + 1, 2 * bl.nr + 3, bl.kc + 2}, 1.0, 0.0, false);
}

// alpha = 0 and k = 0 leave beta * C (+ bias) and read neither A nor B (here full of NaN).
TYPED_TEST(GemmTest, NoProductTerm) {
  using Scalar = TypeParam;
  const Scalar nan = std::numeric_limits<Scalar>::quiet_NaN();
  const Index m = 7, n = 45, k = 9;
  std::vector<Scalar> a(to_size(m * k), nan), b(to_size(n * k), nan), bias(to_size(n), Scalar(2));
  for (const auto& [alpha, kk] : {std::pair<Scalar, Index>{Scalar(0), k}, std::pair<Scalar, Index>{Scalar(1), 0}}) {
    std::vector<Scalar> c(to_size(m * n), Scalar(3));
    gemm::gemm_nt<Scalar>({m, n, kk}, alpha, {a.data(), k}, {b.data(), k}, Scalar(0.5), {c.data(), n});
    for (Scalar x : c) ASSERT_EQ(x, Scalar(1.5));
    gemm::gemm_nn<Scalar>({m, n, kk}, alpha, {a.data(), k}, {b.data(), n}, Scalar(0), {c.data(), n});
    for (Scalar x : c) ASSERT_EQ(x, Scalar(0));
  }
  std::vector<Scalar> c(to_size(m * n), nan);
  gemm::gemm_nt_bias<Scalar>({m, n, Index{0}}, {a.data(), k}, {b.data(), k}, bias.data(), {c.data(), n});
  for (Scalar x : c) ASSERT_EQ(x, Scalar(2));
}

// Operands and C at odd addresses: the kernels' unaligned accesses are the callers' memory, the aligned
// ones only their own packed buffers.
TYPED_TEST(GemmTest, MisalignedPointers) {
  using Scalar = TypeParam;
  const Index m = 37, n = 53, k = 41;
  Operands<Scalar> x(Op::kNT, {m, n, k}, true, 7, false);
  // Shift every buffer by one element: copies with a leading pad.
  auto shifted = [](const std::vector<Scalar>& v) {
    std::vector<Scalar> s(v.size() + 1);
    std::copy(v.begin(), v.end(), s.begin() + 1);
    return s;
  };
  const std::vector<Scalar> a1 = shifted(x.a), b1 = shifted(x.b);
  std::vector<Scalar> c1 = shifted(x.c0);
  gemm::gemm_nt<Scalar>({m, n, k}, Scalar(1), {a1.data() + 1, x.lda}, {b1.data() + 1, x.ldb}, Scalar(1),
                        {c1.data() + 1, x.ldc});
  const std::vector<Scalar> c(c1.begin() + 1, c1.end());
  expect_matches(Op::kNT, {m, n, k}, 1.0, 1.0, x, c, "misaligned gemm_nt");
}

// Packed objects keep their storage: packing a smaller operand after a larger one must not read stale
// padding, packing a larger one must grow, and a product of packed operands equals gemm_nt / gemm_nn bit
// for bit (the same blocks in the same order).
TYPED_TEST(GemmTest, PackedReuseAndAgreement) {
  using Scalar = TypeParam;
  gemm::PackedA<Scalar> pa(16, 16);
  gemm::PackedB<Scalar> pb(16, 16);
  const gemm::Blocking& bl = gemm::blocking<Scalar>();
  const Shape sequence[] = {
      {40, 70, 33}, {3, 5, 2}, {2 * bl.mr + 1, 2 * bl.nr + 1, bl.kc + 3}, {1, 1, 1}, {19, 23, 29}};
  unsigned seed = 11;
  for (const Shape& s : sequence) {
    for (Op op : {Op::kNT, Op::kNN}) {
      const Operands<Scalar> x(op, s, true, seed++, false);
      std::vector<Scalar> packed = x.c0, direct = x.c0;
      pa.pack(s.m, s.k, x.a.data(), x.lda);
      if (op == Op::kNT) {
        pb.pack_nt(s.n, s.k, x.b.data(), x.ldb);
        gemm::gemm_nt<Scalar>({s.m, s.n, s.k}, Scalar(0.75), {x.a.data(), x.lda}, {x.b.data(), x.ldb}, Scalar(-1),
                              {direct.data(), x.ldc});
      } else {
        pb.pack_nn(s.k, s.n, x.b.data(), x.ldb);
        gemm::gemm_nn<Scalar>({s.m, s.n, s.k}, Scalar(0.75), {x.a.data(), x.lda}, {x.b.data(), x.ldb}, Scalar(-1),
                              {direct.data(), x.ldc});
      }
      ASSERT_EQ(pa.rows(), s.m);
      ASSERT_EQ(pa.depth(), s.k);
      ASSERT_EQ(pb.cols(), s.n);
      ASSERT_EQ(pb.depth(), s.k);
      gemm::multiply(pa, pb, Scalar(0.75), Scalar(-1), packed.data(), x.ldc);
      const std::string what = std::string("reused packed ") + op_name(op) + " m=" + std::to_string(s.m);
      expect_matches(op, s, 0.75, -1.0, x, packed, what);
      EXPECT_TRUE(std::memcmp(packed.data(), direct.data(), packed.size() * sizeof(Scalar)) == 0)
          << what << ": packed product differs from the direct one";
    }
  }
}

// A Workspace kept across calls of different sizes (growing, then smaller again) gives the same bits as
// a call's own scratch, on 1 and 2 threads.
TYPED_TEST(GemmTest, WorkspaceReuse) {
  using Scalar = TypeParam;
  const gemm::Blocking& bl = gemm::blocking<Scalar>();
  gemm::Workspace<Scalar> workspace;
  const Shape sequence[] = {{5, 7, 3}, {150, 3 * bl.nr + 1, bl.kc + 9}, {1, 1, 1}, {37, 2 * bl.nr, 40}};
  unsigned seed = 21;
  for (const Shape& s : sequence) {
    for (Op op : {Op::kNT, Op::kNN, Op::kNTBias}) {
      for (const Eigen::ThreadPoolDevice* device :
           {static_cast<const Eigen::ThreadPoolDevice*>(nullptr), two_threads()}) {
        const Operands<Scalar> x(op, s, true, seed++, false);
        std::vector<Scalar> own = x.c0, kept = x.c0;
        switch (op) {
          case Op::kNT:
            gemm::gemm_nt<Scalar>({s.m, s.n, s.k}, Scalar(2), {x.a.data(), x.lda}, {x.b.data(), x.ldb}, Scalar(0.5),
                                  {own.data(), x.ldc}, {device});
            gemm::gemm_nt<Scalar>({s.m, s.n, s.k}, Scalar(2), {x.a.data(), x.lda}, {x.b.data(), x.ldb}, Scalar(0.5),
                                  {kept.data(), x.ldc}, {device, &workspace});
            break;
          case Op::kNN:
            gemm::gemm_nn<Scalar>({s.m, s.n, s.k}, Scalar(2), {x.a.data(), x.lda}, {x.b.data(), x.ldb}, Scalar(0.5),
                                  {own.data(), x.ldc}, {device});
            gemm::gemm_nn<Scalar>({s.m, s.n, s.k}, Scalar(2), {x.a.data(), x.lda}, {x.b.data(), x.ldb}, Scalar(0.5),
                                  {kept.data(), x.ldc}, {device, &workspace});
            break;
          default:
            gemm::gemm_nt_bias<Scalar>({s.m, s.n, s.k}, {x.a.data(), x.lda}, {x.b.data(), x.ldb}, x.bias.data(),
                                       {own.data(), x.ldc}, {device});
            gemm::gemm_nt_bias<Scalar>({s.m, s.n, s.k}, {x.a.data(), x.lda}, {x.b.data(), x.ldb}, x.bias.data(),
                                       {kept.data(), x.ldc}, {device, &workspace});
            break;
        }
        EXPECT_TRUE(std::memcmp(own.data(), kept.data(), own.size() * sizeof(Scalar)) == 0)
            << op_name(op) << " m=" << s.m << ": the workspace changed the result";
      }
    }
  }
  EXPECT_GT(workspace.capacity(), std::size_t{0});
}

// multiply's bias epilogue, on 1 and 2 threads.
TYPED_TEST(GemmTest, PackedBias) {
  using Scalar = TypeParam;
  const gemm::Blocking& bl = gemm::blocking<Scalar>();
  for (const Shape& s : {Shape{1, 1, 1}, Shape{13, 2 * bl.nr + 5, bl.kc + 1}, Shape{150, 5 * bl.nr - 1, 17}}) {
    const Operands<Scalar> x(Op::kNTBias, s, true, 5, true);
    gemm::PackedA<Scalar> pa;
    gemm::PackedB<Scalar> pb;
    pa.pack(s.m, s.k, x.a.data(), x.lda);
    pb.pack_nt(s.n, s.k, x.b.data(), x.ldb);
    std::vector<Scalar> one = x.c0, two = x.c0, in_place = x.c0;
    gemm::multiply(pa, pb, Scalar(1), Scalar(0), one.data(), x.ldc, x.bias.data());
    gemm::multiply(pa, pb, Scalar(1), Scalar(0), two.data(), x.ldc, x.bias.data(), two_threads());
    gemm::multiply(s.m, {x.a.data(), x.lda}, pb, Scalar(1), Scalar(0), {in_place.data(), x.ldc}, x.bias.data());
    expect_matches(Op::kNTBias, s, 1.0, 0.0, x, one, "packed bias m=" + std::to_string(s.m));
    expect_matches(Op::kNTBias, s, 1.0, 0.0, x, in_place, "in-place A bias m=" + std::to_string(s.m));
    EXPECT_TRUE(std::memcmp(one.data(), two.data(), one.size() * sizeof(Scalar)) == 0);
  }
}

// The attention kernel's use: query blocks packed once, each key and value block packed once and
// multiplied by every query block of the group; S = scale Q_i K_j^T, O_i += S_i V_j (S standing in for
// the probabilities, read in place for one key block in two and packed for the others), against the
// reference over the whole sequence.
TYPED_TEST(GemmTest, AttentionTilePattern) {
  using Scalar = TypeParam;
  const Index bq = 19, bk = 45, d = 72, dv = 40, groups = 3, key_blocks = 3;
  const Index nq = bq * groups, nk = bk * key_blocks;
  const Scalar scale = Scalar(1) / std::sqrt(Scalar(d));
  std::mt19937 gen(3);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  auto fill = [&](Index count) {
    std::vector<Scalar> v(to_size(count));
    for (Scalar& x : v) x = Scalar(u(gen));
    return v;
  };
  const std::vector<Scalar> q = fill(nq * d), k = fill(nk * d), v = fill(nk * dv);
  std::vector<gemm::PackedA<Scalar>> qa(to_size(groups));
  for (Index i = 0; i < groups; ++i) qa[to_size(i)].pack(bq, d, q.data() + i * bq * d, d);
  gemm::PackedB<Scalar> kb, vb;
  gemm::PackedA<Scalar> sa;
  std::vector<Scalar> s(to_size(bq * bk)), o(to_size(nq * dv), Scalar(0));
  for (Index j = 0; j < key_blocks; ++j) {
    kb.pack_nt(bk, d, k.data() + j * bk * d, d);
    vb.pack_nn(bk, dv, v.data() + j * bk * dv, dv);
    for (Index i = 0; i < groups; ++i) {
      gemm::multiply(qa[to_size(i)], kb, scale, Scalar(0), s.data(), bk);
      if (j % 2 == 0) {
        gemm::multiply(bq, {s.data(), bk}, vb, Scalar(1), Scalar(1), {o.data() + i * bq * dv, dv});
      } else {
        sa.pack(bq, bk, s.data(), bk);
        gemm::multiply(sa, vb, Scalar(1), Scalar(1), o.data() + i * bq * dv, dv);
      }
    }
  }
  const double tol = tolerance<Scalar>() * std::sqrt(double(d + nk));
  for (Index r = 0; r < nq; ++r) {
    for (Index c = 0; c < dv; ++c) {
      double expected = 0, magnitude = 0;
      for (Index t = 0; t < nk; ++t) {
        double score = 0, score_magnitude = 0;
        for (Index p = 0; p < d; ++p) {
          const double x = double(q[to_size(r * d + p)]) * double(k[to_size(t * d + p)]);
          score += x;
          score_magnitude += std::abs(x);
        }
        score *= double(scale);
        score_magnitude *= double(scale);
        const double vt = double(v[to_size(t * dv + c)]);
        expected += score * vt;
        magnitude += score_magnitude * std::abs(vt);
      }
      ASSERT_LE(std::abs(double(o[to_size(r * dv + c)]) - expected), tol * magnitude) << "O(" << r << ", " << c << ")";
    }
  }
}

TEST(GemmBlocking, FollowsTheDocumentedRule) {
  // 48 KiB L1, 1 MiB L2, a 512 MiB "L3" as a VM reports it, float on a 12 x 32 tile.
  const gemm::Blocking b = gemm::detail::compute_blocking(12, 32, 4, 48 << 10, 1 << 20, Index{512} << 20);
  EXPECT_EQ(b.kc, 512);
  EXPECT_EQ(b.nc, 256);
  EXPECT_EQ(b.mc, (Index{16} << 20) / (512 * 4) / 12 * 12);
  // Unknown cache sizes fall back to small common ones; kc stays a multiple of 8 within [16, 1024].
  const gemm::Blocking u = gemm::detail::compute_blocking(6, 16, 8, 0, 0, 0);
  EXPECT_EQ(u.kc % 8, 0);
  EXPECT_GE(u.kc, 16);
  EXPECT_LE(u.kc, 1024);
  EXPECT_EQ(u.nc % 16, 0);
  EXPECT_EQ(u.mc % 6, 0);
  EXPECT_EQ(gemm::detail::compute_blocking(1, 1, 4, 48 << 10, 1 << 20, 1 << 20).kc, 1024);
}

// The work split: a few column chunks that the workers cannot share evenly are cut into as many as the
// next multiple of the workers (3 on 2 workers: one would run two while the other waits); rows are cut
// only when the chunks are fewer than the workers.
TEST(GemmBlocking, FewChunksAreSharedEvenly) {
  const gemm::Blocking bl{12, 32, 4092, 512, 512};
  const gemm::detail::Split three(4096, 1536, bl, 2);
  EXPECT_EQ(three.n_items, 4);
  EXPECT_EQ(three.n_step, 384);
  EXPECT_EQ(three.m_items, 1);
  const gemm::detail::Split alone(4096, 1536, bl, 1);  // one worker: the chunks stay whole
  EXPECT_EQ(alone.n_items, 3);
  EXPECT_EQ(alone.n_step, 512);
  const gemm::detail::Split five(4096, 2560, bl, 2);  // five chunks of 512 become six of 448
  EXPECT_EQ(five.count(), 6);
  const gemm::detail::Split even(4096, 2048, bl, 2);  // four: as they are
  EXPECT_EQ(even.n_items, 4);
  EXPECT_EQ(even.n_step, 512);
  const gemm::detail::Split rows(4096, 512, bl, 2);  // one chunk: the rows are cut in two
  EXPECT_EQ(rows.n_items, 1);
  EXPECT_EQ(rows.m_items, 2);
  // Chunks of two micro-tiles: three (160 columns) cannot become four of whole micro-tiles, and stay.
  // Chunks of nc that would leave a narrow last one are evened out: 384 columns in chunks of at most 256
  // become two of 192, not 256 and 128 (one worker would run twice the other's columns).
  const gemm::detail::Split uneven(2450, 384, gemm::Blocking{6, 64, 5460, 1024, 256}, 2);
  EXPECT_EQ(uneven.n_items, 2);
  EXPECT_EQ(uneven.n_step, 192);
  EXPECT_EQ(uneven.m_items, 1);
  const gemm::detail::Split qkv(2450, 1152, gemm::Blocking{6, 64, 5460, 1024, 256}, 2);  // 5 chunks -> 6 of 192
  EXPECT_EQ(qkv.n_items, 6);
  EXPECT_EQ(qkv.n_step, 192);
  const gemm::detail::Split narrow(4096, 160, gemm::Blocking{12, 32, 4092, 512, 64}, 2);
  EXPECT_EQ(narrow.n_items, 3);
  EXPECT_EQ(narrow.n_step, 64);
}

// A right edge of at most half a tile runs a tile of half the vectors; its columns get the bits the full
// tile gives them when the product is wider (the same products in the same order).
TYPED_TEST(GemmTest, NarrowEdgeTileGivesTheFullTilesBits) {
  using Scalar = TypeParam;
  if (sdpa::active_isa() == sdpa::Isa::kPortable) GTEST_SKIP() << "Eigen's products may round by shape";
  const Index nr = gemm::blocking<Scalar>().nr;
  std::mt19937 gen(17);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (const Index m : {Index(1), Index(7), Index(40)}) {
    for (const Index k : {Index(3), Index(64), Index(300)}) {
      const Index wide = 2 * nr;
      std::vector<Scalar> a(to_size(m * k)), b(to_size(wide * k));
      for (Scalar& x : a) x = Scalar(u(gen));
      for (Scalar& x : b) x = Scalar(u(gen));
      std::vector<Scalar> full(to_size(m * wide));
      gemm::gemm_nt<Scalar>({m, wide, k}, Scalar(1), {a.data(), k}, {b.data(), k}, Scalar(0), {full.data(), wide});
      for (const Index n : {nr + 1, nr + nr / 2 - 1, nr + nr / 2}) {  // edges of 1 .. nr / 2 columns
        std::vector<Scalar> narrow(to_size(m * n));
        gemm::gemm_nt<Scalar>({m, n, k}, Scalar(1), {a.data(), k}, {b.data(), k}, Scalar(0), {narrow.data(), n});
        for (Index i = 0; i < m; ++i)
          ASSERT_EQ(std::memcmp(narrow.data() + i * n, full.data() + i * wide, to_size(n) * sizeof(Scalar)), 0)
              << "m " << m << " k " << k << " n " << n << " row " << i;
      }
    }
  }
}

// A full tile (its k loop is assembly: on AVX-512 from a depth of 384, sdpa/simd/avx512_tile.hpp; on AVX2
// at every depth, avx2_tile.hpp) gives each row the bits that a one-row edge tile (the intrinsics' loop)
// gives it, with A packed or in place, for depths with and without a remainder of k steps past a multiple
// of four (the attention tiles' 64 and 256 among them), and columns with an edge.
TYPED_TEST(GemmTest, FullTileGivesTheEdgeTilesBits) {
  using T = TypeParam;
  std::mt19937 gen(29);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  sdpa::simd::with_gemm_kernel<T>(sdpa::active_isa(), [&](auto kernel) {
    using K = decltype(kernel);
    if constexpr (K::kShapeDependentRounding) {
      GTEST_SKIP() << "Eigen's products may round by shape";
    } else {
      const Index kc_max = sdpa::gemm::blocking<T>().kc;
      for (const Index m : {Index(6), Index(13)}) {
        for (const Index k : {Index(1), Index(3), Index(4), Index(6), Index(64), Index(255), Index(256), Index(383),
                              Index(384), Index(385), Index(387), Index(kc_max)}) {
          const Index n = 2 * K::nr + 5, lda = k + 3;
          std::vector<T> a(to_size(m * lda)), b(to_size(n * k));
          for (T& x : a) x = T(u(gen));
          for (T& x : b) x = T(u(gen));
          const Index padded_n = (n + K::nr - 1) / K::nr * K::nr;
          std::unique_ptr<T[]> pb_store(new T[to_size(padded_n * k + 64)]);
          T* pb = pb_store.get();
          while (reinterpret_cast<std::uintptr_t>(pb) % 64 != 0) ++pb;
          K::template pack_b_rows<T>(n, k, b.data(), k, pb);
          const Index padded_m = (m + K::mr - 1) / K::mr * K::mr;
          std::vector<T> pa(to_size(padded_m * k));
          K::pack_a(m, k, a.data(), lda, pa.data());
          const sdpa::gemm::detail::Epilogue<T> ep{T(1), T(0), nullptr, true};
          std::vector<T> packed(to_size(m * n)), in_place(to_size(m * n)), rows(to_size(m * n));
          K::block({m, n, k}, pa.data(), pb, {packed.data(), n}, ep);
          K::block_rows({m, n, k}, {a.data(), lda}, pb, {in_place.data(), n}, ep);
          for (Index i = 0; i < m; ++i)
            K::block_in_place({1, n, k}, {a.data() + i * lda, lda}, pb, {rows.data() + i * n, n}, ep);
          for (Index i = 0; i < m; ++i) {
            const auto where = ::testing::Message() << "m " << m << " k " << k << " row " << i;
            ASSERT_EQ(std::memcmp(packed.data() + i * n, rows.data() + i * n, to_size(n) * sizeof(T)), 0) << where;
            ASSERT_EQ(std::memcmp(in_place.data() + i * n, rows.data() + i * n, to_size(n) * sizeof(T)), 0) << where;
          }
        }
      }
    }
  });
}

// LinePrefetch's remaining() and advance(n), which the assembly tile uses to walk the lines itself, agree
// with n calls of next(): from the start and from the middle of a segment, over segments of whole and
// partial lines.
TYPED_TEST(GemmTest, LinePrefetchAdvanceMatchesNext) {
  using T = TypeParam;
  std::vector<T> buffer(4000);
  for (const Index width : {Index(5), Index(16), Index(17), Index(100)}) {
    for (const Index rows : {Index(1), Index(3)}) {
      for (const Index skip : {Index(0), Index(1), Index(2)}) {
        for (const Index n : {Index(0), Index(1), Index(2), Index(7), Index(30)}) {
          gemm::detail::LinePrefetch<T> walked{buffer.data(), 1000, rows, width, 0, 0};
          for (Index i = 0; i < skip; ++i) walked.next();
          gemm::detail::LinePrefetch<T> jumped = walked, counted = walked;
          Index total = 0;
          while (counted.next() != nullptr) ++total;
          const auto where = ::testing::Message()
                             << "width " << width << " rows " << rows << " skip " << skip << " n " << n;
          ASSERT_EQ(walked.remaining(), total) << where;
          const Index steps = std::min(n, total);
          for (Index i = 0; i < steps; ++i) walked.next();
          jumped.advance(steps);
          ASSERT_EQ(jumped.row, walked.row) << where;
          ASSERT_EQ(jumped.done, walked.done) << where;
          ASSERT_EQ(jumped.remaining(), total - steps) << where;
        }
      }
    }
  }
}

// Every path's packing of A writes its slivers and nothing past them: each sliver of mr rows holds, step
// by step, the rows' values (zeros past the last row), in a buffer whose end is followed by sentinels. A
// sliver narrower than a vector (6 floats in 16 lanes) is stored with whole vectors that spill into the
// next steps; the spill must stop at the sliver's end.
TYPED_TEST(GemmTest, PackedAStaysWithinItsSlivers) {
  using T = TypeParam;
  const T sentinel = T(-7.25);
  for (Index m : {Index(1), Index(5), Index(6), Index(7), Index(12), Index(13), Index(37)}) {
    for (Index k : {Index(1), Index(7), Index(16), Index(17), Index(64), Index(100)}) {
      const Index lda = k + 3;
      std::vector<T> a(static_cast<std::size_t>(m * lda));
      for (std::size_t i = 0; i < a.size(); ++i) a[i] = T(static_cast<double>(i % 97) + 1);
      sdpa::simd::with_gemm_kernel<T>(sdpa::active_isa(), [&](auto kernel) {
        using K = decltype(kernel);
        const Index padded = (m + K::mr - 1) / K::mr * K::mr;
        constexpr Index guard = 64;
        std::vector<T> dst(static_cast<std::size_t>(padded * k + guard), sentinel);
        K::pack_a(m, k, a.data(), lda, dst.data());
        const auto where = ::testing::Message() << "m " << m << " k " << k << " mr " << K::mr;
        for (Index s = 0; s < padded; s += K::mr) {
          for (Index p = 0; p < k; ++p) {
            for (Index i = 0; i < K::mr; ++i) {
              const T want = s + i < m ? a[static_cast<std::size_t>((s + i) * lda + p)] : T(0);
              ASSERT_EQ(dst[static_cast<std::size_t>(s * k + p * K::mr + i)], want)
                  << where << " row " << s + i << " step " << p;
            }
          }
        }
        for (Index g = 0; g < guard; ++g)
          ASSERT_EQ(dst[static_cast<std::size_t>(padded * k + g)], sentinel) << where << " past the end " << g;
      });
    }
  }
}

// The products run on the path sdpa::cpu_isa() names (ctest runs this file once per path the CPU has):
// its register tile, whose rows decide the blocking.
TEST(GemmIsa, FollowsTheChosenPath) {
  const std::string isa = sdpa::cpu_isa();
  const Index mr = gemm::blocking<float>().mr, nr = gemm::blocking<float>().nr;
  if (isa == "avx512") {
    EXPECT_EQ(mr, 6);
    EXPECT_EQ(nr, 64);
  } else if (isa == "avx2") {
    EXPECT_EQ(mr, 6);
    EXPECT_EQ(nr, 16);
  } else {
    EXPECT_EQ(isa, "portable");
    EXPECT_EQ(mr, 1);
    EXPECT_EQ(nr, 1);
  }
  EXPECT_EQ(gemm::blocking<double>(sdpa::Isa::kPortable).mr, 1);
}

}  // namespace gemm_test
