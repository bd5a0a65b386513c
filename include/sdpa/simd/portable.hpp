// The portable kernels (namespace sdpa::portable): the same operations as sdpa::avx512 and sdpa::avx2 in
// plain C++ and Eigen, compiled for the translation unit's baseline. They run where neither AVX2 nor
// AVX-512 is available (or SDPA_ISA=portable asks for them), on every architecture (ARM64 included), and
// with compilers that have no target attributes. The GEMM kernel multiplies each packed block with one
// Eigen product: mr = nr = 1 makes a packed block a plain row-major matrix (A as [rows, kc], B as
// [cols, kc]), which is correct on any target.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "sdpa/gemm/epilogue.hpp"
#include "sdpa/gemm/operands.hpp"
#include "sdpa/gemm/pack.hpp"
#include "sdpa/simd/rows.hpp"
#include "sdpa/storage.hpp"

SDPA_NAMESPACE_BEGIN
namespace portable {

template <typename Scalar>
struct GemmKernel {
  using Index = Eigen::Index;
  using Epilogue = gemm::detail::Epilogue<Scalar>;
  static constexpr Index mr = 1;
  static constexpr Index nr = 1;
  // Eigen's kernels take different code paths (and roundings) for different block shapes.
  static constexpr bool kShapeDependentRounding = true;

  static void pack_a(Index rows, Index kc, const Scalar* a, Index lda, Scalar* dst) noexcept {
    gemm::detail::pack_rows<mr>(rows, kc, a, lda, dst);
  }
  template <typename T>
  static void pack_b_rows(Index cols, Index kc, const T* b, Index ldb, Scalar* dst) noexcept {
    gemm::detail::pack_rows<nr>(cols, kc, b, ldb, dst);
  }
  static void pack_b_cols(Index cols, Index kc, const Scalar* b, Index ldb, Scalar* dst) noexcept {
    gemm::detail::pack_cols<nr>(cols, kc, b, ldb, dst);
  }

  static void block(gemm::Shape s, const Scalar* pa, const Scalar* pb, gemm::Matrix<Scalar> c,
                    const Epilogue& ep) noexcept {
    block_in_place(s, {pa, s.k}, pb, c, ep);
  }

  static void block_rows(gemm::Shape s, gemm::Matrix<const Scalar> a, const Scalar* pb, gemm::Matrix<Scalar> c,
                         const Epilogue& ep) noexcept {
    block_in_place(s, a, pb, c, ep);
  }

  static void block_in_place(gemm::Shape s, gemm::Matrix<const Scalar> am, const Scalar* pb, gemm::Matrix<Scalar> cmat,
                             const Epilogue& ep) noexcept {
    const Index kc = s.k, rows = s.m, cols = s.n, lda = am.ld, ldc = cmat.ld;
    const Scalar* pa = am.data;
    Scalar* c = cmat.data;
    using RowMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    using Stride = Eigen::OuterStride<>;
    const Eigen::Map<const RowMatrix, Eigen::Unaligned, Stride> a(pa, rows, kc, Stride(lda));
    const Eigen::Map<const RowMatrix> b(pb, cols, kc);
    Eigen::Map<RowMatrix, Eigen::Unaligned, Stride> cm(c, rows, cols, Stride(ldc));
    if (!ep.first) {
      cm.noalias() += ep.alpha * a * b.transpose();
      return;
    }
    if (ep.beta == Scalar(0)) {
      cm.noalias() = ep.alpha * a * b.transpose();
    } else {
      cm *= ep.beta;
      cm.noalias() += ep.alpha * a * b.transpose();
    }
    if (ep.bias != nullptr) {
      cm.rowwise() += Eigen::Map<const Eigen::Matrix<Scalar, 1, Eigen::Dynamic>>(ep.bias, cols);
    }
  }
};

// x[j] = exp(x[j] - shift) for j < n, returning the sum of the results. Hidden keys (-inf) give exactly 0
// (Eigen's vectorised exp clamps its argument, so they are selected to 0 explicitly).
template <typename Scalar>
Scalar exp_shifted_sum(Scalar* x, Eigen::Index n, Scalar shift) noexcept {
  Eigen::Map<Eigen::Array<Scalar, Eigen::Dynamic, 1>> a(x, n);
  a = (a == -std::numeric_limits<Scalar>::infinity()).select(Scalar(0), (a - shift).exp());
  return a.sum();
}

// exp_shifted_sum over the row up to the first group of 32 scores holding one above `limit`, where it
// stops; *done is where it stopped (n when it did not), and x[*done, n) is left as it was.
template <typename Scalar>
Scalar exp_shifted_sum_below(Scalar* x, Eigen::Index n, Scalar shift, Scalar limit, Eigen::Index* done) noexcept {
  constexpr Eigen::Index kGroup = 32;
  Eigen::Index j = 0;
  for (; j < n; j += kGroup) {
    const Eigen::Index m = std::min(kGroup, n - j);
    if ((Eigen::Map<const Eigen::Array<Scalar, Eigen::Dynamic, 1>>(x + j, m) > limit).any()) break;
  }
  *done = j < n ? j : n;
  return exp_shifted_sum(x, *done, shift);
}

// The largest of x[0 .. n) for n > 0 (a NaN may or may not win, as in the vector kernels).
template <typename Scalar>
Scalar row_max(const Scalar* x, Eigen::Index n) noexcept {
  return Eigen::Map<const Eigen::Array<Scalar, Eigen::Dynamic, 1>>(x, n).maxCoeff();
}

template <typename Scalar>
Scalar dot(const Scalar* a, const Scalar* b, Eigen::Index n) noexcept {
  using V = Eigen::Map<const Eigen::Matrix<Scalar, Eigen::Dynamic, 1>>;
  return V(a, n).dot(V(b, n));
}

template <typename Scalar>
void add_weighted_rows(Scalar* acc, Eigen::Index n, const Scalar* w, const Scalar* rows, Eigen::Index stride,
                       Eigen::Index m) noexcept {
  Eigen::Map<Eigen::Array<Scalar, Eigen::Dynamic, 1>> a(acc, n);
  for (Eigen::Index j = 0; j < m; ++j) a += w[j] * Eigen::Map<const Eigen::Array<Scalar, Eigen::Dynamic, 1>>(rows + j * stride, n);
}

// x[j] = cap * tanh(x[j] / cap) for j < n (logit softcapping).
template <typename Scalar>
void softcap_row(Scalar* x, Eigen::Index n, Scalar cap) noexcept {
  for (Eigen::Index j = 0; j < n; ++j) x[j] = cap * std::tanh(x[j] / cap);
}

// The decoding step's scores of a chunk of keys stored as Scalar (see generic_rows.inc's chunk_scores).
template <typename Scalar>
void native_chunk_scores(simd::Rows<Scalar> k, Eigen::Index n, simd::Queries<Scalar> q,
                         simd::Scores<Scalar> s) noexcept {
  for (Eigen::Index j = 0; j < n; ++j)
    for (Eigen::Index h = 0; h < q.heads; ++h) {
      const Scalar* kr = k.data + j * k.row + (h / q.group) * k.head;
      for (Eigen::Index i = 0; i < q.count; ++i)
        s.data[(h * q.count + i) * s.ld + j] = s.scale * dot(kr, q.data + h * q.head + i * q.row, q.d);
    }
}

// Stored rows widened to float (see generic_rows.inc's widen_rows).
inline float widen(BFloat16 x) noexcept { return to_float(x); }
inline float widen(Float16 x) noexcept { return to_float(x); }
inline float widen(std::int8_t x) noexcept { return static_cast<float>(x); }

// a . b with a stored: dot on a's widened values.
template <typename T>
float dot_stored(const T* a, const float* b, Eigen::Index n) noexcept {
  float s = 0.0f;
  for (Eigen::Index i = 0; i < n; ++i) s += widen(a[i]) * b[i];
  return s;
}

// dot or dot_stored of a against each of rows rows of b (ldb apart).
template <typename T, typename Scalar>
void dot_rows(const T* a, const Scalar* b, Eigen::Index ldb, Eigen::Index rows, Eigen::Index n, Scalar* out) noexcept {
  for (Eigen::Index r = 0; r < rows; ++r) {
    if constexpr (std::is_same<T, Scalar>::value) out[r] = dot(a, b + r * ldb, n);
    else out[r] = dot_stored(a, b + r * ldb, n);
  }
}

// chunk_scores and add_weighted_rows over stored rows: the rows widened into the calling thread's scratch
// (grown once), then the float forms, so that the bits are those of the widened rows.
inline std::vector<float>& widen_scratch(std::size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf;
}

template <typename T, typename Scalar>
void chunk_scores(simd::Rows<T> k, Eigen::Index n, simd::Queries<Scalar> q, simd::Scores<Scalar> s) noexcept {
  if constexpr (std::is_same<T, Scalar>::value) {
    native_chunk_scores(k, n, q, s);
  } else {
    const Eigen::Index kv_heads = (q.heads + q.group - 1) / q.group, d = q.d;
    std::vector<float>& wide = widen_scratch(static_cast<std::size_t>(kv_heads * d));
    for (Eigen::Index j = 0; j < n; ++j) {
      for (Eigen::Index g = 0; g < kv_heads; ++g)
        for (Eigen::Index c = 0; c < d; ++c) {
          const float x = widen(k.data[j * k.row + g * k.head + c]);
          wide[static_cast<std::size_t>(g * d + c)] = k.scales != nullptr ? x * k.scales[j * k.scale_row + g] : x;
        }
      simd::Scores<Scalar> sj = s;
      sj.data += j;
      native_chunk_scores(simd::Rows<float>{wide.data(), 0, d}, Eigen::Index{1}, q, sj);
    }
  }
}

template <typename T>
void add_weighted_rows_stored(float* acc, Eigen::Index n, const float* w, simd::Rows<T> rows, Eigen::Index m,
                              Eigen::Index /*ahead*/ = 0) noexcept {
  std::vector<float>& wide = widen_scratch(static_cast<std::size_t>(n));
  for (Eigen::Index j = 0; j < m; ++j) {
    for (Eigen::Index c = 0; c < n; ++c) {
      const float x = widen(rows.data[j * rows.row + c]);
      wide[static_cast<std::size_t>(c)] = rows.scales != nullptr ? x * rows.scales[j * rows.scale_row] : x;
    }
    add_weighted_rows(acc, n, w + j, wide.data(), n, Eigen::Index{1});
  }
}

template <typename T>
void add_weighted_rows_stored_heads(simd::HeadSums<float> sums, Eigen::Index n, simd::Rows<T> rows, Eigen::Index m,
                                    Eigen::Index /*ahead*/) noexcept {
  for (Eigen::Index h = 0; h < sums.heads; ++h)
    add_weighted_rows_stored(sums.acc + h * sums.acc_head, n, sums.w + h * sums.w_head, rows.at(0, h / sums.group), m);
}

template <typename T>
void widen_rows(simd::Rows<T> src, Eigen::Index rows, Eigen::Index cols, Eigen::Index span, float* dst,
                Eigen::Index ldd) noexcept {
  for (Eigen::Index r = 0; r < rows; ++r)
    for (Eigen::Index c = 0; c < cols; ++c) {
      const float x = widen(src.data[r * src.row + c]);
      dst[r * ldd + c] = src.scales != nullptr ? x * src.scales[r * src.scale_row + c / span] : x;
    }
}

}  // namespace portable
SDPA_NAMESPACE_END
