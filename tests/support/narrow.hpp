// Helpers of the tests of narrow storage (storage_test.cpp, rows_test.cpp, safetensors_test.cpp): the
// types, small float modules with weights of a given spread, random tensors, errors, and the entries a
// narrow cache should hold (the float ones rounded to the storage and widened back, with
// sdpa/storage.hpp's scalar conversions).
#pragma once

#include "sdpa/kv_cache.hpp"
#include "sdpa/storage.hpp"

#include <cmath>
#include <cstdint>
#include <vector>

#include "support/reference.hpp"

namespace sdpa_test {
namespace narrow {

using Index = Eigen::Index;
using Storage = sdpa::Storage;
using Tensor3 = Eigen::Tensor<float, 3, Eigen::RowMajor>;
using Module = sdpa::ScaledDotProductAttention<float>;

// The narrow storage types, for tests that run each.
constexpr Storage kStorages[] = {Storage::kBFloat16, Storage::kFloat16, Storage::kInt8};

// weights ~ N(0, 1 / d_model), queries' weights times q_scale (peaked attention for q_scale >> 1).
inline Module make_module(Rng& rng, Index d_model, Index d_k, Index h, Index kv_heads, double q_scale = 1.0) {
  Module m(d_model, d_k, d_k, h, 0.0f, kv_heads);
  m.eval();
  randomize_module(m, rng, 1.0 / std::sqrt(static_cast<double>(d_model)));
  for (Index i = 0; i < m.fc_q().weight().size(); ++i) m.fc_q().weight().data()[i] *= static_cast<float>(q_scale);
  return m;
}

inline Tensor3 random3(Rng& rng, Index a, Index b, Index c) {
  Tensor3 t(a, b, c);
  rng.fill_normal(t);
  return t;
}

inline double max_rel(const Tensor3& a, const Tensor3& ref) {
  double err = 0, norm = 0;
  for (Index i = 0; i < ref.size(); ++i) {
    err = std::max(err, std::fabs(static_cast<double>(a.data()[i]) - ref.data()[i]));
    norm = std::max(norm, std::fabs(static_cast<double>(ref.data()[i])));
  }
  return err / norm;
}

inline double max_abs_diff(const Tensor3& a, const Tensor3& b) {
  double err = 0;
  for (Index i = 0; i < a.size(); ++i) err = std::max(err, std::fabs(static_cast<double>(a.data()[i]) - b.data()[i]));
  return err;
}

// What a narrow cache should hold: the float entries rounded to the storage and widened back.
inline Tensor3 rounded(const Tensor3& x, Storage s, Index d) {
  Tensor3 out(x.dimensions());
  const Index rows = x.dimension(0) * x.dimension(1), width = x.dimension(2);
  for (Index r = 0; r < rows; ++r) {
    const float* in = x.data() + r * width;
    float* o = out.data() + r * width;
    for (Index g = 0; g < width / d; ++g) {
      if (s == Storage::kInt8) {
        std::vector<std::int8_t> q(static_cast<std::size_t>(d));
        const float scale = sdpa::quantize_int8(in + g * d, d, q.data());
        for (Index c = 0; c < d; ++c) o[g * d + c] = static_cast<float>(q[static_cast<std::size_t>(c)]) * scale;
      } else {
        for (Index c = 0; c < d; ++c)
          o[g * d + c] = s == Storage::kBFloat16 ? sdpa::to_float(sdpa::to_bfloat16(in[g * d + c]))
                                                 : sdpa::to_float(sdpa::to_float16(in[g * d + c]));
      }
    }
  }
  return out;
}

}  // namespace narrow
}  // namespace sdpa_test
