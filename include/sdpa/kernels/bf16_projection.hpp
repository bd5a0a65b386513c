// The projections under Compute::kBf16 (sdpa/compute.hpp): y = bf16(x) bf16(W)^T + b, products of bfloat16
// pairs summed in float, for the targets of one projection pass (kernels/projection.hpp's ProjectionTarget:
// float, bfloat16 or float16 weights). On the hardware paths each call packs every target's weights into
// bfloat16 pairs once (a weight may change between calls), then multiplies blocks of 32 input rows, packed
// as bfloat16, by each target's panels, the sums starting from the bias, split over the device's threads by
// row blocks (any thread count gives the same bits). The emulated path rounds x and the weights to bfloat16
// values held in floats and runs the float products.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <algorithm>
#include <cstddef>
#include <vector>

#include "sdpa/compute.hpp"
#include "sdpa/detail/buffer.hpp"
#include "sdpa/kernels/bf16_products.hpp"
#include "sdpa/kernels/projection.hpp"
#include "sdpa/parallel.hpp"
#include "sdpa/simd/bf16.hpp"
#include "sdpa/storage.hpp"

SDPA_NAMESPACE_BEGIN
namespace kernels {

// A target's weights (out, in) as floats, widened from their storage (exactly).
inline void widen_weights(const ProjectionTarget<float>& t, Eigen::Index in, float* out) {
  const Eigen::Index n = t.out * in;
  if (t.weight_storage == Storage::kBFloat16) {
    const BFloat16* w = static_cast<const BFloat16*>(t.weight_stored);
    for (Eigen::Index i = 0; i < n; ++i) out[i] = to_float(w[i]);
  } else if (t.weight_storage == Storage::kFloat16) {
    const Float16* w = static_cast<const Float16*>(t.weight_stored);
    for (Eigen::Index i = 0; i < n; ++i) out[i] = to_float(w[i]);
  } else {
    std::copy_n(t.weight, n, out);
  }
}

// project_rows' contract (x[rows, in], row stride ldx, through `count` targets; no grouped targets) with
// bfloat16 products on `path` (lowered to what the CPU runs).
inline void project_rows_bf16(const float* x, Eigen::Index rows, Eigen::Index in, Eigen::Index ldx,
                              const ProjectionTarget<float>* targets, std::size_t count,
                              const Eigen::ThreadPoolDevice* device, Bf16Path path) {
  using Index = Eigen::Index;
  const Isa isa = active_isa();
  path = std::min(path, isa == Isa::kAvx512 ? best_bf16_path() : Bf16Path::kEmulated);
  if (rows <= 0 || count == 0) return;
  if (path == Bf16Path::kEmulated) {
    std::vector<float> xr(static_cast<std::size_t>(rows * in));
    for (Index r = 0; r < rows; ++r) round_to_bf16(isa, x + r * ldx, in, xr.data() + r * in);
    std::vector<std::vector<float>> weights(count);
    std::vector<ProjectionTarget<float>> rounded(targets, targets + count);
    for (std::size_t t = 0; t < count; ++t) {
      weights[t].resize(static_cast<std::size_t>(targets[t].out * in));
      widen_weights(targets[t], in, weights[t].data());
      round_to_bf16(isa, weights[t].data(), targets[t].out * in, weights[t].data());
      rounded[t].weight = weights[t].data();
      rounded[t].weight_storage = Storage::kFloat32;
      rounded[t].weight_stored = nullptr;
    }
    project_rows<float>(xr.data(), rows, in, in, rounded.data(), count, device, isa);
    return;
  }
#if SDPA_DISPATCH
  const Index in_pad = bf16::round_up(in, bf16::kStep);
  // Tile operands on cache lines (detail::AlignedVector): the tile loads move 64-byte rows.
  std::vector<sdpa::detail::AlignedVector<BFloat16>> panels(count);
  std::vector<sdpa::detail::AlignedVector<float>> biases(count);
  Index widest = 0;
  {
    std::vector<float> wide;
    for (std::size_t t = 0; t < count; ++t) {
      const ProjectionTarget<float>& tg = targets[t];
      const Index n_panels = (tg.out + 15) / 16;
      widest = std::max(widest, n_panels * 16);
      panels[t].resize(static_cast<std::size_t>(n_panels * 16 * in_pad));
      const float* w = tg.weight;
      if (tg.narrow()) {
        wide.resize(static_cast<std::size_t>(tg.out * in));
        widen_weights(tg, in, wide.data());
        w = wide.data();
      }
      avx512_bf16::pack_transposed_pairs(w, in, tg.out, in, bf16::Panels{panels[t].data(), in_pad / 2, n_panels});
      biases[t].assign(static_cast<std::size_t>(n_panels * 16), 0.0f);
      std::copy_n(tg.bias, tg.out, biases[t].data());
    }
  }
  constexpr Index kRows = 32;
  const Index blocks = (rows + kRows - 1) / kRows;
  parallel_for(device, blocks, balanced_grain(device, blocks, 4), [&](Index b0, Index b1) {
    sdpa::detail::AlignedVector<BFloat16> a(static_cast<std::size_t>(kRows * in_pad));
    sdpa::detail::AlignedVector<float> c(static_cast<std::size_t>(kRows * widest));
    for (Index b = b0; b < b1; ++b) {
      const Index r0 = b * kRows, m = std::min(kRows, rows - r0);
      const Index m_tiles = (m + 15) / 16;
      avx512_bf16::pack_rows(bf16::Rect{x + r0 * ldx, ldx, 0, m, 0, in}, bf16::Block{a.data(), in_pad, m_tiles * 16, in_pad});
      for (std::size_t t = 0; t < count; ++t) {
        const ProjectionTarget<float>& tg = targets[t];
        bf16::Product p;
        p.bias = biases[t].data();
        p.a = a.data();
        p.lda = in_pad;
        p.b = panels[t].data();
        p.panel_stride = (in_pad / 2) * 32;
        p.m_tiles = m_tiles;
        p.n_panels = (tg.out + 15) / 16;
        p.steps = in_pad / bf16::kStep;
        const bool in_place = m % 16 == 0 && tg.out % 16 == 0 && tg.group_rows == 0;
        p.c = in_place ? tg.y + r0 * tg.ldy : c.data();
        p.ldc = in_place ? tg.ldy : p.n_panels * 16;
        if (path == Bf16Path::kAmx)
          amx::product(p);
        else
          avx512_bf16::product(p);
        if (!in_place)
          for (Index r = 0; r < m; ++r) std::copy_n(c.data() + r * p.ldc, tg.out, tg.row(r0 + r));
      }
    }
  });
#else
  (void)x, (void)ldx, (void)targets, (void)device;
#endif
}

}  // namespace kernels
SDPA_NAMESPACE_END
