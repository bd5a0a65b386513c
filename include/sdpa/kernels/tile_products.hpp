// The two matrix products of an attention tile behind one small interface: scores s = alpha * q k^T for a
// query block against the current key block, and the accumulation o += p v. A worker sets the key block
// once (its k and v are packed on first use and shared by every query block of the group) and packs each
// query block once per group (`slot`), so a tile's products only stream packed operands; p is read where
// it lies, and so are the query rows of a group that sees a single key block (one use each: a short
// sequence). A tile trimmed to a sub-rectangle (part of its rows or keys hidden) multiplies the trimmed
// operands instead. Both go through sdpa::gemm's register-blocked kernels (gemm/packed.hpp, gemm.hpp) of
// the call's ISA. With `packed` false (TileConfig::pack_operands), every tile takes the unpacked products
// (the path the packing is tested against).
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "sdpa/gemm/gemm.hpp"
#include "sdpa/kernels/projection.hpp"

SDPA_NAMESPACE_BEGIN
namespace kernels {

// The sizes a worker's tile products are made for: query blocks of block_q rows, `group` of them sharing a
// key block of block_k keys, head sizes d_k and d_v.
struct TileShape {
  Eigen::Index block_q = 0;
  Eigen::Index block_k = 0;
  Eigen::Index group = 1;
  Eigen::Index d_k = 0;
  Eigen::Index d_v = 0;
};

// The part of a tile one product covers: rows [i0, i0 + ni) of a query block of `rows` rows, against keys
// [j0, j0 + nj) of the key block.
struct TileRect {
  Eigen::Index rows = 0;
  Eigen::Index i0 = 0;
  Eigen::Index ni = 0;
  Eigen::Index j0 = 0;
  Eigen::Index nj = 0;
};

template <typename Scalar>
class TileProducts {
 public:
  using Index = Eigen::Index;

  TileProducts(const TileShape& shape, Isa isa, bool packed = true)
      : d_k_(shape.d_k),
        d_v_(shape.d_v),
        isa_(isa),
        packed_(packed),
        q_(static_cast<std::size_t>(shape.group)),
        q_packed_(static_cast<std::size_t>(shape.group)) {
    for (auto& q : q_) q.reserve(shape.block_q, shape.d_k, isa);
    k_packed_.reserve(shape.d_k, shape.block_k, isa);
    v_packed_.reserve(shape.block_k, shape.d_v, isa);
  }

  // A new group of query blocks: every slot must be packed again. With `single_key_block` (the group sees
  // one key block), each query block takes part in one product only, and is read where it lies instead:
  // packing it would cost a transposing copy for a single use (a short sequence's whole attention).
  void new_group(bool single_key_block = false) noexcept {
    std::fill(q_packed_.begin(), q_packed_.end(), false);
    q_in_place_ = single_key_block;
  }

  // The key block the next tiles use: cols rows of k (stride ldk) and of v (stride ldv).
  void set_keys(const Scalar* k, Index ldk, const Scalar* v, Index ldv, Index cols) noexcept {
    k_ = k;
    ldk_ = ldk;
    v_ = v;
    ldv_ = ldv;
    cols_ = cols;
    k_ready_ = v_ready_ = false;
  }

  // s(i, j) = alpha * q_i . k_j for the rectangle t of query block `slot`, whose t.rows rows start at q.
  // Other entries of s are left alone.
  void scores(Index slot, gemm::Matrix<const Scalar> qm, const TileRect& t, Scalar alpha, gemm::Matrix<Scalar> sm) {
    const Index rows = t.rows, i0 = t.i0, ni = t.ni, j0 = t.j0, nj = t.nj, ldq = qm.ld, lds = sm.ld;
    const Scalar* q = qm.data;
    Scalar* s = sm.data;
    if (packed_ && ni == rows && nj == cols_) {
      if (!k_ready_) {
        k_packed_.pack_nt(cols_, d_k_, k_, ldk_, isa_);
        k_ready_ = true;
      }
      if (q_in_place_) {
        gemm::multiply(rows, {q, ldq}, k_packed_, alpha, Scalar(0), {s, lds});
        return;
      }
      const std::size_t sl = static_cast<std::size_t>(slot);
      if (!q_packed_[sl]) {
        q_[sl].pack(rows, d_k_, q, ldq, isa_);
        q_packed_[sl] = true;
      }
      gemm::multiply(q_[sl], k_packed_, alpha, Scalar(0), s, lds);
      return;
    }
    gemm::gemm_nt<Scalar>({ni, nj, d_k_}, alpha, {q + i0 * ldq, ldq}, {k_ + j0 * ldk_, ldk_}, Scalar(0),
                          {s + i0 * lds + j0, lds}, {nullptr, &workspace_, isa_});
  }

  // o(i, :) += sum over j of p(i, j) v_j for the rectangle t of the tile.
  void accumulate(const TileRect& t, gemm::Matrix<const Scalar> pm, gemm::Matrix<Scalar> om) {
    const Index rows = t.rows, i0 = t.i0, ni = t.ni, j0 = t.j0, nj = t.nj, ldp = pm.ld, ldo = om.ld;
    const Scalar* p = pm.data;
    Scalar* o = om.data;
    if (packed_ && ni == rows && nj == cols_) {
      if (!v_ready_) {
        v_packed_.pack_nn(cols_, d_v_, v_, ldv_, isa_);
        v_ready_ = true;
      }
      gemm::multiply(rows, {p, ldp}, v_packed_, Scalar(1), Scalar(1), {o, ldo});
      return;
    }
    gemm::gemm_nn<Scalar>({ni, d_v_, nj}, Scalar(1), {p + i0 * ldp + j0, ldp}, {v_ + j0 * ldv_, ldv_}, Scalar(1),
                          {o + i0 * ldo, ldo}, {nullptr, &workspace_, isa_});
  }

  const Scalar* v() const noexcept { return v_; }
  Index ldv() const noexcept { return ldv_; }

 private:
  const Index d_k_, d_v_;
  const Isa isa_;
  const bool packed_;
  std::vector<gemm::PackedA<Scalar>> q_;  // the group's query blocks
  std::vector<bool> q_packed_;
  gemm::PackedB<Scalar> k_packed_, v_packed_;
  gemm::Workspace<Scalar> workspace_;  // the unpacked products' scratch
  const Scalar* k_ = nullptr;
  const Scalar* v_ = nullptr;
  Index ldk_ = 0, ldv_ = 0, cols_ = 0;
  bool k_ready_ = false, v_ready_ = false;
  bool q_in_place_ = false;
};

}  // namespace kernels
SDPA_NAMESPACE_END
