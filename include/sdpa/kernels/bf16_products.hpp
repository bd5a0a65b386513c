// The two products of an attention tile under Compute::kBf16 (sdpa/compute.hpp), behind TileProducts'
// interface (tile_products.hpp): s = alpha * bf16(q) bf16(k)^T and o += bf16(p) bf16(v), with the products
// of bfloat16 pairs accumulated in float and alpha applied in float after the sum.
//
// On the hardware paths (AMX, AVX512_BF16) the key block is packed once into bfloat16 pairs (and its value
// block on first use), each query block of the group once per group, and p once per tile; a product covers
// the 16-row tiles and 16-column panels that hold the tile's computed rectangle: scores go to the scorer's
// tile in place where its tiles fit there (then times alpha), else through a float scratch, outputs through
// the scratch into the accumulators. The emulated path rounds the same
// operands to bfloat16 values held in floats and hands them to the float products: a product of two
// bfloat16 is exact in float, so the two differ only in the order of the float sums (and in the hardware's
// treatment of subnormal bfloat16 as zero).
//
// A hidden key adds nothing to an output even when its value row is not finite: where the products would
// reach a value row outside the tile's keys (the padding to 32 keys), the block's non-finite value rows are
// left out of the product and the tile's visible keys added one by one instead.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "sdpa/compute.hpp"
#include "sdpa/detail/buffer.hpp"
#include "sdpa/kernels/tile_products.hpp"
#include "sdpa/simd/bf16.hpp"
#include "sdpa/simd/dispatch.hpp"
#include "sdpa/storage.hpp"

SDPA_NAMESPACE_BEGIN
namespace kernels {

// n floats at x rounded to bfloat16 and back (sdpa::to_bfloat16's rounding), on the path `isa`.
inline void round_to_bf16(Isa isa, const float* x, Eigen::Index n, float* out) noexcept {
  simd::with_isa(isa, [&](auto path) {
#if SDPA_DISPATCH
    if constexpr (decltype(path)::value == Isa::kAvx512) return avx512::round_to_bf16(x, n, out);
    else if constexpr (decltype(path)::value == Isa::kAvx2) return avx2::round_to_bf16(x, n, out);
#else
    (void)path;
#endif
    for (Eigen::Index i = 0; i < n; ++i) out[i] = bfloat16_to_float(to_bfloat16(x[i]).bits);
  });
}

class Bf16TileProducts {
 public:
  using Index = Eigen::Index;

  Bf16TileProducts(const TileShape& shape, Isa isa, Bf16Path path)
      : d_k_(shape.d_k),
        d_v_(shape.d_v),
        block_q_(shape.block_q),
        isa_(isa),
        // Never above what this CPU and OS run (asking for the tile state on the way), whatever the problem says.
        path_(std::min(path, isa == Isa::kAvx512 ? best_bf16_path() : Bf16Path::kEmulated)) {
    const Index block_q = shape.block_q, block_k = shape.block_k, d_k = shape.d_k, d_v = shape.d_v;
    const std::size_t g = static_cast<std::size_t>(shape.group);
    q_ready_.assign(g, false);
    if (path_ == Bf16Path::kEmulated) {
      emulated_ = std::make_unique<TileProducts<float>>(shape, isa);
      q_round_.resize(g);
      for (auto& q : q_round_) q.resize(static_cast<std::size_t>(block_q * d_k));
      k_round_.resize(static_cast<std::size_t>(block_k * d_k));
      v_round_.resize(static_cast<std::size_t>(block_k * d_v));
      return;
    }
    dk_pad_ = bf16::round_up(d_k, bf16::kStep);
    dv_pad_ = bf16::round_up(d_v, bf16::kTile);
    rows_pad_ = bf16::round_up(block_q, bf16::kTile);
    keys_pad_ = bf16::round_up(block_k, bf16::kStep);
    q_packed_.resize(g);
    for (auto& q : q_packed_) q.resize(static_cast<std::size_t>(rows_pad_ * dk_pad_));
    k_packed_.resize(static_cast<std::size_t>(keys_pad_ * dk_pad_));
    v_packed_.resize(static_cast<std::size_t>(keys_pad_ * dv_pad_));
    p_packed_.resize(static_cast<std::size_t>(rows_pad_ * keys_pad_));
    c_.resize(static_cast<std::size_t>(rows_pad_ * std::max(keys_pad_, dv_pad_)));
  }

  void new_group(bool single_key_block = false) noexcept {
    std::fill(q_ready_.begin(), q_ready_.end(), false);
    if (emulated_) emulated_->new_group(single_key_block);
  }

  void set_keys(const float* k, Index ldk, const float* v, Index ldv, Index cols) noexcept {
    k_ = k;
    ldk_ = ldk;
    v_ = v;
    ldv_ = ldv;
    cols_ = cols;
    k_ready_ = v_ready_ = false;
  }

  // TileProducts::scores' contract, on bfloat16 operands; but the hardware paths may also write the entries
  // of s around the rectangle that share its 16 x 16 tiles (s has block_q rows of lds >= block_k entries).
  void scores(Index slot, gemm::Matrix<const float> qm, const TileRect& t, float alpha, gemm::Matrix<float> sm) {
    const Index rows = t.rows, i0 = t.i0, ni = t.ni, j0 = t.j0, nj = t.nj, ldq = qm.ld, lds = sm.ld;
    const float* q = qm.data;
    float* s = sm.data;
    const std::size_t sl = static_cast<std::size_t>(slot);
    if (emulated_) {
      if (!k_ready_) {
        for (Index j = 0; j < cols_; ++j) round_to_bf16(isa_, k_ + j * ldk_, d_k_, k_round_.data() + j * d_k_);
        for (Index j = 0; j < cols_; ++j) round_to_bf16(isa_, v_ + j * ldv_, d_v_, v_round_.data() + j * d_v_);
        emulated_->set_keys(k_round_.data(), d_k_, v_round_.data(), d_v_, cols_);
        k_ready_ = v_ready_ = true;
      }
      if (!q_ready_[sl]) {
        for (Index i = 0; i < rows; ++i) round_to_bf16(isa_, q + i * ldq, d_k_, q_round_[sl].data() + i * d_k_);
        q_ready_[sl] = true;
      }
      emulated_->scores(slot, {q_round_[sl].data(), d_k_}, t, alpha, sm);
      return;
    }
#if SDPA_DISPATCH
    if (!k_ready_) {
      avx512_bf16::pack_transposed_pairs(k_, ldk_, cols_, d_k_, keys());
      k_ready_ = true;
    }
    // A power of two alpha up to 1 (d_k = 1, 4, 16, 64, 256, ...) rides on the queries: bf16(alpha q) =
    // alpha bf16(q) exactly (but below 2^-126, where the hardware reads bfloat16 as zero anyway; nothing can
    // overflow), and the products then need no pass of their own.
    int exponent = 0;
    const bool folded = alpha <= 1.0f && std::frexp(alpha, &exponent) == 0.5f;
    BFloat16* qp = q_packed_[sl].data();
    if (!q_ready_[sl]) {
      avx512_bf16::pack_rows(bf16::Rect{q, ldq, 0, rows, 0, d_k_}, bf16::Block{qp, dk_pad_, bf16::round_up(rows, 16), dk_pad_},
                             folded ? alpha : 1.0f);
      q_ready_[sl] = true;
    }
    const Index m_lo = i0 / 16, m_hi = (i0 + ni + 15) / 16, n_lo = j0 / 16, n_hi = (j0 + nj + 15) / 16;
    bf16::Product x;
    x.a = qp + m_lo * 16 * dk_pad_;
    x.lda = dk_pad_;
    x.b = k_packed_.data() + n_lo * (dk_pad_ / 2) * 32;
    x.panel_stride = (dk_pad_ / 2) * 32;
    x.m_tiles = m_hi - m_lo;
    x.n_panels = n_hi - n_lo;
    x.steps = dk_pad_ / bf16::kStep;
    if (m_hi * 16 <= block_q_ && n_hi * 16 <= lds) {
      // The whole tiles fit in s (block_q rows of lds): written there, the entries around the rectangle
      // inside its tiles included.
      x.c = s + m_lo * 16 * lds + n_lo * 16;
      x.ldc = lds;
      multiply(x);
      if (!folded) avx512_bf16::scale_rows(s + i0 * lds + j0, lds, ni, nj, alpha, s + i0 * lds + j0, lds);
      return;
    }
    x.c = c_.data();
    x.ldc = (n_hi - n_lo) * 16;
    multiply(x);
    avx512_bf16::scale_rows(c_.data() + (i0 - m_lo * 16) * x.ldc + (j0 - n_lo * 16), x.ldc, ni, nj, folded ? 1.0f : alpha,
                            s + i0 * lds + j0, lds);
#else
    (void)q, (void)ldq, (void)rows, (void)i0, (void)ni, (void)j0, (void)nj, (void)alpha, (void)s, (void)lds, (void)sl;
#endif
  }

  // TileProducts::accumulate's contract, on bfloat16 operands (p rounded as it is read).
  void accumulate(const TileRect& t, gemm::Matrix<const float> pm, gemm::Matrix<float> om) {
    const Index rows = t.rows, i0 = t.i0, ni = t.ni, j0 = t.j0, nj = t.nj, ldp = pm.ld, ldo = om.ld;
    const float* p = pm.data;
    float* o = om.data;
    if (emulated_) {
      // The scores came first for this key block: k and v are rounded. p's rectangle rounded into scratch.
      const Index need = (i0 + ni) * ldp;
      if (static_cast<Index>(p_round_.size()) < need) p_round_.resize(static_cast<std::size_t>(need));
      for (Index i = i0; i < i0 + ni; ++i) round_to_bf16(isa_, p + i * ldp + j0, nj, p_round_.data() + i * ldp + j0);
      emulated_->accumulate(t, {p_round_.data(), ldp}, om);
      return;
    }
#if SDPA_DISPATCH
    if (!v_ready_) {
      avx512_bf16::pack_pairs(v_, ldv_, cols_, d_v_, values());
      values_finite_ = true;
      for (Index j = 0; j < cols_ && values_finite_; ++j) values_finite_ = row_is_finite(v_ + j * ldv_, d_v_);
      v_ready_ = true;
    }
    const Index m_lo = i0 / 16, m_hi = (i0 + ni + 15) / 16;
    const Index k_lo = j0 / bf16::kStep * bf16::kStep, k_hi = bf16::round_up(j0 + nj, bf16::kStep);
    if (!values_finite_ && (k_lo < j0 || std::min(k_hi, cols_) > j0 + nj)) {
      // The padding would multiply a zero p by a non-finite value row outside the tile's keys.
      for (Index i = i0; i < i0 + ni; ++i)
        for (Index j = j0; j < j0 + nj; ++j) {
          const float w = bfloat16_to_float(to_bfloat16(p[i * ldp + j]).bits);
          const float* v = v_ + j * ldv_;
          for (Index d = 0; d < d_v_; ++d) o[i * ldo + d] += w * bfloat16_to_float(to_bfloat16(v[d]).bits);
        }
      return;
    }
    (void)rows;
    const Index width = k_hi - k_lo;
    bf16::Rect rect{p + m_lo * 16 * ldp + k_lo, ldp, i0 - m_lo * 16, i0 + ni - m_lo * 16, j0 - k_lo, j0 + nj - k_lo};
    avx512_bf16::pack_rows(rect, bf16::Block{p_packed_.data(), width, (m_hi - m_lo) * 16, width});
    const Index pairs = keys_pad_ / 2;
    bf16::Product x;
    x.a = p_packed_.data();
    x.lda = width;
    x.b = v_packed_.data() + (k_lo / 2) * 32;
    x.panel_stride = pairs * 32;
    x.m_tiles = m_hi - m_lo;
    x.n_panels = dv_pad_ / 16;
    x.steps = width / bf16::kStep;
    x.c = c_.data();
    x.ldc = dv_pad_;
    multiply(x);
    avx512_bf16::add_rows(c_.data() + (i0 - m_lo * 16) * x.ldc, x.ldc, ni, d_v_, o + i0 * ldo, ldo);
#else
    (void)rows, (void)i0, (void)ni, (void)j0, (void)nj, (void)p, (void)ldp, (void)o, (void)ldo;
#endif
  }

  Bf16Path path() const noexcept { return path_; }

 private:
  // No NaN or infinity in x[0, n): no entry's exponent bits all set (an integer reduction without an exit,
  // which the compiler vectorises).
  static bool row_is_finite(const float* x, Index n) noexcept {
    std::uint32_t all_ones = 0;
    for (Index i = 0; i < n; ++i) {
      std::uint32_t bits;
      std::memcpy(&bits, x + i, sizeof bits);
      all_ones |= static_cast<std::uint32_t>((bits & 0x7F800000u) == 0x7F800000u);
    }
    return all_ones == 0;
  }

#if SDPA_DISPATCH
  bf16::Panels keys() noexcept { return bf16::Panels{k_packed_.data(), dk_pad_ / 2, keys_pad_ / 16}; }
  bf16::Panels values() noexcept { return bf16::Panels{v_packed_.data(), keys_pad_ / 2, dv_pad_ / 16}; }
  void multiply(const bf16::Product& x) const noexcept {
    if (path_ == Bf16Path::kAmx)
      amx::product(x);
    else
      avx512_bf16::product(x);
  }
#endif

  const Index d_k_, d_v_, block_q_;
  const Isa isa_;
  const Bf16Path path_;
  Index dk_pad_ = 0, dv_pad_ = 0, rows_pad_ = 0, keys_pad_ = 0;
  std::vector<bool> q_ready_;
  // Hardware paths: the group's query blocks, the key and value blocks in pairs, one tile's p, the products.
  // (On cache lines: the tile loads and stores move 64-byte rows.)
  std::vector<sdpa::detail::AlignedVector<BFloat16>> q_packed_;
  sdpa::detail::AlignedVector<BFloat16> k_packed_, v_packed_, p_packed_;
  sdpa::detail::AlignedVector<float> c_;
  bool values_finite_ = true;
  // The emulated path: the rounded operands and the float products that multiply them.
  std::unique_ptr<TileProducts<float>> emulated_;
  std::vector<std::vector<float>> q_round_;
  std::vector<float> k_round_, v_round_, p_round_;
  const float* k_ = nullptr;
  const float* v_ = nullptr;
  Index ldk_ = 0, ldv_ = 0, cols_ = 0;
  bool k_ready_ = false, v_ready_ = false;
};

// The backward's tile products under kBf16 on a hardware path, each packing its two operands as bfloat16
// (rounded) and summing in float: nt (dP = dO v^T), nn_add (dq += dS k) and tn_add (dv += P^T dO, dk += dS^T
// q: a tile read transposed). Scratch grows to the largest call and is kept.
class Bf16Gemm {
 public:
  using Index = Eigen::Index;

  explicit Bf16Gemm(Bf16Path path) noexcept
      : path_(std::min(path, active_isa() == Isa::kAvx512 ? best_bf16_path() : Bf16Path::kEmulated)) {}

  // Whether the products run bfloat16 instructions here (else the caller's float products over rounded operands).
  bool hardware() const noexcept { return path_ != Bf16Path::kEmulated; }

  // c[m, n] = alpha * a[m, k] b[n, k]^T, for s = {m, n, k}.
  void nt(gemm::Shape s, float alpha, gemm::Matrix<const float> am, gemm::Matrix<const float> bm,
          gemm::Matrix<float> cm) {
    const Index m = s.m, n = s.n, k = s.k, lda = am.ld, ldb = bm.ld, ldc = cm.ld;
    const float* a = am.data;
    const float* b = bm.data;
    float* c = cm.data;
#if SDPA_DISPATCH
    if (m <= 0 || n <= 0) return;
    const Shape x = shape(m, n, k);
    avx512_bf16::pack_rows(bf16::Rect{a, lda, 0, m, 0, k}, bf16::Block{a_.data(), x.k_pad, x.m_pad, x.k_pad});
    avx512_bf16::pack_transposed_pairs(b, ldb, n, k, bf16::Panels{b_.data(), x.k_pad / 2, x.n_pad / 16});
    multiply(x);
    avx512_bf16::scale_rows(c_.data(), x.n_pad, m, n, alpha, c, ldc);
#else
    (void)m, (void)n, (void)k, (void)alpha, (void)a, (void)lda, (void)b, (void)ldb, (void)c, (void)ldc;
#endif
  }

  // c[m, n] += a[m, k] b[k, n].
  void nn_add(gemm::Shape s, gemm::Matrix<const float> am, gemm::Matrix<const float> bm, gemm::Matrix<float> cm) {
    const Index m = s.m, n = s.n, k = s.k, lda = am.ld, ldb = bm.ld, ldc = cm.ld;
    const float* a = am.data;
    const float* b = bm.data;
    float* c = cm.data;
#if SDPA_DISPATCH
    add(m, n, k, b, ldb, c, ldc, [&](const Shape& x) {
      avx512_bf16::pack_rows(bf16::Rect{a, lda, 0, m, 0, k}, bf16::Block{a_.data(), x.k_pad, x.m_pad, x.k_pad});
    });
#else
    (void)m, (void)n, (void)k, (void)a, (void)lda, (void)b, (void)ldb, (void)c, (void)ldc;
#endif
  }

  // c[m, n] += a[k, m]^T b[k, n].
  void tn_add(gemm::Shape s, gemm::Matrix<const float> am, gemm::Matrix<const float> bm, gemm::Matrix<float> cm) {
    const Index m = s.m, n = s.n, k = s.k, lda = am.ld, ldb = bm.ld, ldc = cm.ld;
    const float* a = am.data;
    const float* b = bm.data;
    float* c = cm.data;
#if SDPA_DISPATCH
    add(m, n, k, b, ldb, c, ldc, [&](const Shape& x) {
      avx512_bf16::pack_transposed_rows(a, lda, k, m, bf16::Block{a_.data(), x.k_pad, x.m_pad, x.k_pad});
    });
#else
    (void)m, (void)n, (void)k, (void)a, (void)lda, (void)b, (void)ldb, (void)c, (void)ldc;
#endif
  }

 private:
  struct Shape {
    Index m_pad, n_pad, k_pad;
  };

  template <typename T>
  static void grow(sdpa::detail::AlignedVector<T>& v, Index n) {
    if (static_cast<Index>(v.size()) < n) v.resize(static_cast<std::size_t>(n));
  }

  // The padded sizes of a product, its scratch grown to them.
  Shape shape(Index m, Index n, Index k) {
    const Shape x{bf16::round_up(m, 16), bf16::round_up(n, 16), bf16::round_up(std::max<Index>(k, 1), bf16::kStep)};
    grow(a_, x.m_pad * x.k_pad);
    grow(b_, x.n_pad * x.k_pad);
    grow(c_, x.m_pad * x.n_pad);
    return x;
  }

#if SDPA_DISPATCH
  // c (ldc) += A b, A packed into a_ by pack_a(shape), b (k rows of n, ldb) packed in pairs here.
  template <typename PackA>
  void add(Index m, Index n, Index k, const float* b, Index ldb, float* c, Index ldc, PackA&& pack_a) {
    if (m <= 0 || n <= 0 || k <= 0) return;
    const Shape x = shape(m, n, k);
    pack_a(x);
    avx512_bf16::pack_pairs(b, ldb, k, n, bf16::Panels{b_.data(), x.k_pad / 2, x.n_pad / 16});
    multiply(x);
    avx512_bf16::add_rows(c_.data(), x.n_pad, m, n, c, ldc);
  }

  // c_ (m_pad x n_pad) = a_ b_.
  void multiply(const Shape& s) {
    bf16::Product x;
    x.a = a_.data();
    x.lda = s.k_pad;
    x.b = b_.data();
    x.panel_stride = (s.k_pad / 2) * 32;
    x.m_tiles = s.m_pad / 16;
    x.n_panels = s.n_pad / 16;
    x.steps = s.k_pad / bf16::kStep;
    x.c = c_.data();
    x.ldc = s.n_pad;
    if (path_ == Bf16Path::kAmx)
      amx::product(x);
    else
      avx512_bf16::product(x);
  }
#endif

  const Bf16Path path_;
  sdpa::detail::AlignedVector<BFloat16> a_, b_;  // on cache lines, as the tile loads want
  sdpa::detail::AlignedVector<float> c_;
};

// The products of a tile in the problem's compute type: TileProducts (kFloat), or Bf16TileProducts (kBf16,
// float problems only; the checked core refuses it for double).
template <typename Scalar>
class ComputeTileProducts {
 public:
  using Index = Eigen::Index;

  // (The float products of a kBf16 problem are never used: made for one row and one feature.)
  ComputeTileProducts(const TileShape& shape, Isa isa, Compute compute, Bf16Path path, bool packed = true)
      : float_(compute == Compute::kBf16 ? TileShape{shape.block_q, shape.block_k, 1, 1, 1} : shape, isa, packed) {
    if constexpr (std::is_same<Scalar, float>::value) {
      if (compute == Compute::kBf16) bf16_ = std::make_unique<Bf16TileProducts>(shape, isa, path);
    } else {
      (void)path;
    }
  }

  void new_group(bool single_key_block = false) noexcept {
    if (bf16_) bf16_->new_group(single_key_block);
    else float_.new_group(single_key_block);
  }
  void set_keys(const Scalar* k, Index ldk, const Scalar* v, Index ldv, Index cols) noexcept {
    if constexpr (std::is_same<Scalar, float>::value)
      if (bf16_) return bf16_->set_keys(k, ldk, v, ldv, cols);
    float_.set_keys(k, ldk, v, ldv, cols);
  }
  void scores(Index slot, gemm::Matrix<const Scalar> q, const TileRect& t, Scalar alpha, gemm::Matrix<Scalar> s) {
    if constexpr (std::is_same<Scalar, float>::value)
      if (bf16_) return bf16_->scores(slot, q, t, alpha, s);
    float_.scores(slot, q, t, alpha, s);
  }
  void accumulate(const TileRect& t, gemm::Matrix<const Scalar> p, gemm::Matrix<Scalar> o) {
    if constexpr (std::is_same<Scalar, float>::value)
      if (bf16_) return bf16_->accumulate(t, p, o);
    float_.accumulate(t, p, o);
  }

 private:
  TileProducts<Scalar> float_;  // sized for nothing under kBf16
  std::unique_ptr<Bf16TileProducts> bf16_;
};

}  // namespace kernels
SDPA_NAMESPACE_END
