// The two matrix products of an attention tile behind one small interface: scores s = alpha * q k^T for a
// query block against the current key block, and the accumulation o += p v. A worker sets the key block
// once (its k and v are packed on first use and shared by every query block of the group) and packs each
// query block once per group (`slot`), so a tile's products only stream packed operands. A tile trimmed to
// a sub-rectangle (part of its rows or keys hidden) runs the public products on the trimmed operands
// instead. The packed path uses Eigen 3.4's GEMM building blocks (its packing routines and block-panel
// kernel, unchanged through 3.4.x; measured 6% faster overall at d = 64 than public products, which pack all
// three operands again for every tile); with another Eigen, or SDPA_TILED_PACKED_PRODUCTS defined to 0,
// every tile takes the public products.
#pragma once

#include "sdpa/detail/eigen.hpp"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "sdpa/kernels/projection.hpp"

#ifndef SDPA_TILED_PACKED_PRODUCTS
#if EIGEN_WORLD_VERSION == 3 && EIGEN_MAJOR_VERSION == 4
#define SDPA_TILED_PACKED_PRODUCTS 1
#else
#define SDPA_TILED_PACKED_PRODUCTS 0
#endif
#endif

namespace sdpa {
namespace kernels {

template <typename Scalar>
class TileProducts {
 public:
  using Index = Eigen::Index;

  TileProducts(Index block_q, Index block_k, Index group, Index d_k, Index d_v)
      : d_k_(d_k), d_v_(d_v), q_copy_(static_cast<std::size_t>(block_q * d_k + kLine)) {
#if SDPA_TILED_PACKED_PRODUCTS
    // One cache-line-aligned slot per query block: the kernel's loads from packed operands are aligned.
    q_slot_ = (block_q * d_k + kLine - 1) / kLine * kLine;
    packed_q_.resize(static_cast<std::size_t>(group * q_slot_ + 2 * kLine));
    packed_k_.resize(static_cast<std::size_t>(block_k * d_k + 2 * kLine));
    packed_v_.resize(static_cast<std::size_t>(block_k * d_v + 2 * kLine));
    packed_p_.resize(static_cast<std::size_t>(block_k * block_q + 2 * kLine));
    q_packed_.resize(static_cast<std::size_t>(group));
#else
    (void)block_k;
    (void)group;
#endif
  }

  // A new group of query blocks: every slot must be packed again.
  void new_group() noexcept {
#if SDPA_TILED_PACKED_PRODUCTS
    std::fill(q_packed_.begin(), q_packed_.end(), false);
#endif
  }

  // The key block the next tiles use: cols rows of k (stride ldk) and of v (stride ldv).
  void set_keys(const Scalar* k, Index ldk, const Scalar* v, Index ldv, Index cols) noexcept {
    k_ = k;
    ldk_ = ldk;
    v_ = v;
    ldv_ = ldv;
    cols_ = cols;
    kv_packed_ = false;
  }

  // s(i, j) (row stride lds) = alpha * q_i . k_j for the tile rows [i0, i0 + ni) and keys [j0, j0 + nj) of
  // query block `slot`, whose rows (rows of them, stride ldq) start at q. Other entries of s are left alone.
  void scores(Index slot, const Scalar* q, Index ldq, Index rows, Index i0, Index ni, Index j0, Index nj, Scalar alpha,
              Scalar* s, Index lds) {
#if SDPA_TILED_PACKED_PRODUCTS
    if (ni == rows && nj == cols_) {
      pack_kv();
      Scalar* packed_q = aligned(packed_q_) + slot * q_slot_;
      if (!q_packed_[static_cast<std::size_t>(slot)]) {
        PackRhs()(packed_q, ColMapper(q, ldq), d_k_, rows);
        q_packed_[static_cast<std::size_t>(slot)] = true;
      }
      // s^T = k q^T on the column-major kernel, which accumulates into its result.
      for (Index i = 0; i < rows; ++i) std::fill_n(s + i * lds, cols_, Scalar(0));
      Kernel()(ResMapper(s, lds), aligned(packed_k_), packed_q, cols_, d_k_, rows, alpha);
      return;
    }
#else
    (void)slot;
    (void)rows;
#endif
    // A trimmed tile: the public product on the trimmed operands. Strided q rows are copied first so that
    // the product reads a few contiguous pages.
    const Scalar* qi = q + i0 * ldq;
    Index ldqi = ldq;
    if (ldq != d_k_ && ni > 1) {
      Scalar* copy = aligned(q_copy_);
      for (Index i = 0; i < ni; ++i) std::copy_n(qi + i * ldq, d_k_, copy + i * d_k_);
      qi = copy;
      ldqi = d_k_;
    }
    gemm_nt(ni, nj, d_k_, alpha, qi, ldqi, k_ + j0 * ldk_, ldk_, s + i0 * lds + j0, lds);
  }

  // o(i, :) (row stride ldo) += sum over j of p(i, j) v_j for the same sub-rectangle of the tile.
  void accumulate(Index rows, Index i0, Index ni, Index j0, Index nj, const Scalar* p, Index ldp, Scalar* o, Index ldo) {
#if SDPA_TILED_PACKED_PRODUCTS
    if (ni == rows && nj == cols_ && ldo == d_v_) {
      pack_kv();
      PackRhs()(aligned(packed_p_), ColMapper(p, ldp), cols_, rows);
      Kernel()(ResMapper(o, ldo), aligned(packed_v_), aligned(packed_p_), d_v_, cols_, rows, Scalar(1));
      return;
    }
#else
    (void)rows;
#endif
    gemm_nn_add(ni, d_v_, nj, p + i0 * ldp + j0, ldp, v_ + j0 * ldv_, ldv_, o + i0 * ldo, ldo);
  }

  const Scalar* v() const noexcept { return v_; }
  Index ldv() const noexcept { return ldv_; }

 private:
  static constexpr Index kLine = 64 / static_cast<Index>(sizeof(Scalar));

  static Scalar* aligned(std::vector<Scalar>& buf) noexcept {
    const auto addr = reinterpret_cast<std::uintptr_t>(buf.data());
    return buf.data() + ((64 - addr % 64) % 64) / sizeof(Scalar);
  }

#if SDPA_TILED_PACKED_PRODUCTS
  // Eigen's GEMM building blocks, as its own GEMM runs them for a row-major result: s^T = k q^T and
  // o^T += v^T p^T, column-major.
  using Traits = Eigen::internal::gebp_traits<Scalar, Scalar>;
  using RowMapper = Eigen::internal::const_blas_data_mapper<Scalar, Index, Eigen::RowMajor>;
  using ColMapper = Eigen::internal::const_blas_data_mapper<Scalar, Index, Eigen::ColMajor>;
  using ResMapper = Eigen::internal::blas_data_mapper<Scalar, Index, Eigen::ColMajor, Eigen::Unaligned, 1>;
  using PackRowLhs = Eigen::internal::gemm_pack_lhs<Scalar, Index, RowMapper, Traits::mr, Traits::LhsProgress,
                                                     typename Traits::LhsPacket4Packing, Eigen::RowMajor>;
  using PackColLhs = Eigen::internal::gemm_pack_lhs<Scalar, Index, ColMapper, Traits::mr, Traits::LhsProgress,
                                                     typename Traits::LhsPacket4Packing, Eigen::ColMajor>;
  using PackRhs = Eigen::internal::gemm_pack_rhs<Scalar, Index, ColMapper, Traits::nr, Eigen::ColMajor>;
  using Kernel = Eigen::internal::gebp_kernel<Scalar, Scalar, Index, ResMapper, Traits::mr, Traits::nr>;

  void pack_kv() {
    if (kv_packed_) return;
    PackRowLhs()(aligned(packed_k_), RowMapper(k_, ldk_), d_k_, cols_);
    PackColLhs()(aligned(packed_v_), ColMapper(v_, ldv_), cols_, d_v_);
    kv_packed_ = true;
  }

  std::vector<Scalar> packed_q_, packed_k_, packed_v_, packed_p_;
  std::vector<bool> q_packed_;
  Index q_slot_ = 0;
#endif

  const Index d_k_, d_v_;
  std::vector<Scalar> q_copy_;
  const Scalar* k_ = nullptr;
  const Scalar* v_ = nullptr;
  Index ldk_ = 0, ldv_ = 0, cols_ = 0;
  bool kv_packed_ = false;
};

}  // namespace kernels
}  // namespace sdpa
