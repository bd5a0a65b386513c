// The projections as matrix products on the callers' memory: y = x W^T + b over row-major buffers with
// leading dimensions, so that several layers can write side by side into one fused buffer (q | k | v) that
// the attention kernel then reads in place. sdpa::gemm's kernels by default (Eigen's products where the
// target has no AVX2 or AVX-512); with SDPA_USE_ONEDNN (the opt-in sdpa::onednn target) float products go to
// oneDNN's dnnl_sgemm, pinned to the calling thread so that sdpa's own work split stays the only threading.
// Also the tile-sized products the attention kernels share, and the few-row projections of a decoding step.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "sdpa/cpu.hpp"
#include "sdpa/gemm/gemm.hpp"
#include "sdpa/simd/dispatch.hpp"
#include "sdpa/parallel.hpp"
#include "sdpa/storage.hpp"

#ifdef SDPA_USE_ONEDNN
#include <dnnl.h>
// Declared here rather than through <omp.h> so that users need no -fopenmp (which would also switch on
// Eigen's own OpenMP threading); the symbols come from the OpenMP runtime oneDNN links.
extern "C" int omp_get_max_threads(void);
extern "C" void omp_set_num_threads(int);
#endif

SDPA_NAMESPACE_BEGIN
namespace kernels {

// The calling thread's packing scratch for the products below: kept from one call to the next, so that the
// tile-sized products of the attention kernels do not allocate (it grows to the largest call).
template <typename Scalar>
gemm::Workspace<Scalar>& thread_workspace() {
  thread_local gemm::Workspace<Scalar> workspace;
  return workspace;
}

// Two tile-sized products on row-major memory, on the calling thread (s = {m, n, k}):
//   gemm_nt: c[m, n] = alpha * a[m, k] * b[n, k]^T
//   gemm_nn_add: c[m, n] += a[m, k] * b[k, n]
template <typename Scalar>
void gemm_nt(Isa isa, gemm::Shape s, Scalar alpha, gemm::Matrix<const Scalar> a, gemm::Matrix<const Scalar> b,
             gemm::Matrix<Scalar> c) {
  gemm::gemm_nt<Scalar>(s, alpha, a, b, Scalar(0), c, {nullptr, &thread_workspace<Scalar>(), isa});
}

template <typename Scalar>
void gemm_nn_add(Isa isa, gemm::Shape s, gemm::Matrix<const Scalar> a, gemm::Matrix<const Scalar> b,
                 gemm::Matrix<Scalar> c) {
  gemm::gemm_nn<Scalar>(s, Scalar(1), a, b, Scalar(1), c, {nullptr, &thread_workspace<Scalar>(), isa});
}

// y[rows, out] = x[rows, in] * w[out, in]^T + b[out], for s = {rows, out, in}: sdpa::gemm's
// register-blocked kernels of the path `isa` (Eigen's products on the portable path), split over the
// device's threads by blocks of y, never of the sum, so any number of threads gives the same bits. The
// packed blocks live in the calling thread's workspace (kept between calls: fresh ones cost their page
// faults on every call).
template <typename Scalar>
void gemm_bias_rows(gemm::Shape s, gemm::Matrix<const Scalar> x, const Scalar* w, const Scalar* b,
                    gemm::Matrix<Scalar> y, const Eigen::ThreadPoolDevice* device = nullptr, Isa isa = active_isa()) {
  gemm::gemm_nt_bias<Scalar>(s, x, {w, s.k}, b, y, {device, &thread_workspace<Scalar>(), isa});
}

#ifdef SDPA_USE_ONEDNN
}  // namespace kernels

// Whether float projections go to oneDNN's sgemm (a program built with sdpa::onednn): yes unless the
// environment variable SDPA_ONEDNN is 0 or set_onednn_projections(false) said otherwise; the process-wide
// choice is read once per product. (One test binary checks both backends this way.)
inline std::atomic<bool>& onednn_projections_flag() noexcept {
  static std::atomic<bool> flag{[] {
    const char* env = std::getenv("SDPA_ONEDNN");
    return !(env != nullptr && (std::strcmp(env, "0") == 0 || std::strcmp(env, "off") == 0));
  }()};
  return flag;
}
inline bool onednn_projections() noexcept { return onednn_projections_flag().load(std::memory_order_relaxed); }
inline void set_onednn_projections(bool on) noexcept { onednn_projections_flag().store(on, std::memory_order_relaxed); }

namespace kernels {

// oneDNN's sgemm on row blocks of at least 64 rows, one block per worker (the opt-in sdpa::onednn backend).
inline void dnnl_bias_rows(gemm::Shape s, gemm::Matrix<const float> x, const float* w, const float* b,
                           gemm::Matrix<float> y) {
  const Eigen::Index rows = s.m, out = s.n, in = s.k, ldy = y.ld;
  if (rows == 0) return;
  for (Eigen::Index r = 0; r < rows; ++r) std::copy(b, b + out, y.data + r * ldy);
  // dnnl_sgemm would open an OpenMP team of all cores; one thread here keeps sdpa's split in charge.
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  dnnl_sgemm('N', 'T', rows, out, in, 1.0f, x.data, x.ld, w, in, 1.0f, y.data, ldy);
  omp_set_num_threads(threads);
}

inline void gemm_bias_rows(gemm::Shape s, gemm::Matrix<const float> x, const float* w, const float* b,
                           gemm::Matrix<float> y, const Eigen::ThreadPoolDevice* device = nullptr,
                           Isa isa = active_isa()) {
  if (!onednn_projections()) {
    gemm::gemm_nt_bias<float>(s, x, {w, s.k}, b, y, {device, &thread_workspace<float>(), isa});
    return;
  }
  const Eigen::Index grain = std::max<Eigen::Index>(64, balanced_grain(device, s.m, 1));
  parallel_for(device, s.m, grain, [&](Eigen::Index r0, Eigen::Index r1) {
    dnnl_bias_rows({r1 - r0, s.n, s.k}, {x.data + r0 * x.ld, x.ld}, w, b, {y.data + r0 * y.ld, y.ld});
  });
}
#endif

// One layer's share of a projection pass: rows of the pass's input times this layer into y (ldy).
template <typename Scalar>
struct ProjectionTarget {
  const Scalar* weight;  // (out, in) row-major; null when the weights are stored narrower
  const Scalar* bias;    // (out)
  Eigen::Index out;
  Scalar* y;
  Eigen::Index ldy;
  // project_few_rows only: output rows in groups of group_rows, group g starting at y + g * group_stride
  // (a cache's batch entries); 0 means one group.
  Eigen::Index group_rows = 0;
  Eigen::Index group_stride = 0;
  // Weights stored as bfloat16 or float16 (a float Linear's set_weight_storage): (out, in) at weight_stored,
  // converted where the products pack or read them.
  Storage weight_storage = native_storage<Scalar>();
  const void* weight_stored = nullptr;

  bool narrow() const noexcept { return weight_storage != native_storage<Scalar>(); }

  Scalar* row(Eigen::Index r) const noexcept {
    return group_rows > 0 ? y + (r / group_rows) * group_stride + (r % group_rows) * ldy : y + r * ldy;
  }
};

// Applies every target to the same input rows x[rows, in] (row stride ldx; the fused QKV projection): one
// product over all the targets, split over the device's threads (oneDNN: one call per target, for float
// weights).
template <typename Scalar>
void project_rows(const Scalar* x, Eigen::Index rows, Eigen::Index in, Eigen::Index ldx, const ProjectionTarget<Scalar>* targets,
                  std::size_t count, const Eigen::ThreadPoolDevice* device, Isa isa = active_isa()) {
#ifdef SDPA_USE_ONEDNN
  if constexpr (std::is_same<Scalar, float>::value) {
    bool narrow = false;
    for (std::size_t i = 0; i < count; ++i) narrow = narrow || targets[i].narrow();
    if (onednn_projections() && !narrow) {
      for (std::size_t i = 0; i < count; ++i) {
        const ProjectionTarget<Scalar>& t = targets[i];
        gemm_bias_rows({rows, t.out, in}, {x, ldx}, t.weight, t.bias, {t.y, t.ldy}, device, isa);
      }
      return;
    }
  }
#endif
  std::vector<gemm::BiasedProduct<Scalar>> products;
  products.reserve(count);
  for (std::size_t i = 0; i < count; ++i) {
    const ProjectionTarget<Scalar>& t = targets[i];
    gemm::BiasedProduct<Scalar> p{t.weight, in, t.out, t.bias, t.y, t.ldy};
    p.storage = t.weight_storage;
    p.w_stored = t.weight_stored;
    products.push_back(p);
  }
  gemm::gemm_nt_bias_shared<Scalar>(rows, in, {x, ldx}, products.data(), products.size(),
                                    {device, &thread_workspace<Scalar>(), isa});
}

template <typename Scalar>
void project_rows(const Scalar* x, Eigen::Index rows, Eigen::Index in, const std::vector<ProjectionTarget<Scalar>>& targets,
                  const Eigen::ThreadPoolDevice* device, Isa isa = active_isa()) {
  project_rows<Scalar>(x, rows, in, in, targets.data(), targets.size(), device, isa);
}

// The most rows that go through project_few_rows instead of the GEMM of project_rows: a decoding step's
// tokens, an output gate's or fc_o's rows of a step. The module's callers choose by it in one place each,
// so that a step's rows get the same bits whichever entry point they come through.
constexpr Eigen::Index kFewRows = 16;

// The same for a few rows (a decoding step): each weight row is read from memory once for all rows, where a
// matrix product's packing or a matrix-vector product per row would read the weights again, and its
// vectors are loaded once for up to eight rows (simd::dot_rows: each output the bits of one dot); threads split the
// output features. Narrow weights are read as they are stored (widened as dot_stored does), in the same
// order of operations as float ones. Allocates nothing.
template <typename Scalar>
void project_few_rows(const Scalar* x, Eigen::Index rows, Eigen::Index in, Eigen::Index ldx,
                      const ProjectionTarget<Scalar>* targets, std::size_t count, const Eigen::ThreadPoolDevice* device,
                      Isa isa = active_isa()) {
  using Index = Eigen::Index;
  constexpr Index kRowBlock = 16;  // rows whose dots with one weight row are taken together
  Index total = 0;
  for (std::size_t t = 0; t < count; ++t) total += targets[t].out;
  parallel_for(device, total, std::max<Index>(64, balanced_grain(device, total, 2)), [&](Index o0, Index o1) {
    Index base = 0;
    for (std::size_t t = 0; t < count; ++t) {
      const ProjectionTarget<Scalar>& tg = targets[t];
      const Index lo = std::max(o0, base), hi = std::min(o1, base + tg.out);
      for (Index o = lo; o < hi; ++o) {
        const Index row = (o - base) * in;
        // Output o for every row, w its weight row as stored.
        const auto products = [&](const auto* w) SDPA_ALWAYS_INLINE_LAMBDA {
          if (rows == 1) {  // a single sequence's step: one dot
            Scalar d;
            if constexpr (std::is_same<std::decay_t<decltype(*w)>, Scalar>::value) d = simd::dot(isa, w, x, in);
            else d = simd::dot_stored(isa, w, x, in);
            tg.row(0)[o - base] = d + tg.bias[o - base];
            return;
          }
          for (Index r0 = 0; r0 < rows; r0 += kRowBlock) {
            const Index m = std::min(kRowBlock, rows - r0);
            Scalar d[kRowBlock];
            simd::dot_rows(isa, w, x + r0 * ldx, ldx, m, in, d);
            for (Index r = 0; r < m; ++r) tg.row(r0 + r)[o - base] = d[r] + tg.bias[o - base];
          }
        };
        if constexpr (std::is_same<Scalar, float>::value) {
          if (tg.weight_storage == Storage::kBFloat16) products(static_cast<const BFloat16*>(tg.weight_stored) + row);
          else if (tg.weight_storage == Storage::kFloat16) products(static_cast<const Float16*>(tg.weight_stored) + row);
          else products(tg.weight + row);
        } else {
          products(tg.weight + row);
        }
      }
      base += tg.out;
    }
  });
}

}  // namespace kernels
SDPA_NAMESPACE_END
