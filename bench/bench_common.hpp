// What the benchmarks share: the configurations, their useful FLOP counts, the devices, the peak-RSS reading and a
// fixture (module with PyTorch-default weights, deterministic inputs, causal mask) that both the sdpa and
// the LibTorch cases read, so that the two sides always run the same computation on the same data.
#pragma once

#include <sdpa/sdpa.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

namespace sdpa_bench {

using Index = Eigen::Index;
using Module = sdpa::ScaledDotProductAttention<float>;
using Tensor3 = Module::Tensor3;

// The benchmarks' devices: none on one thread (sdpa runs on the calling thread), one process-wide pool of two
// threads otherwise.
inline const Eigen::ThreadPoolDevice* device_for(int threads) {
  if (threads <= 1) return nullptr;
  static Eigen::ThreadPool pool(2);
  static Eigen::ThreadPoolDevice device(&pool, 2);
  return &device;
}

// This process's peak resident set size (VmHWM) in MiB; -1 where /proc does not tell.
inline double vm_hwm_mib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::atof(line.c_str() + 6) / 1024.0;
  return -1;
}

struct Config {
  std::string name;  // benchmark name prefix, e.g. "long/N:4096"
  std::string group;  // demo, standard, long, causal, cross
  Index batch, nq, nk, d_model, d_k, d_v, h;
  bool causal;
  bool cross;  // queries separate from keys = values (encoder memory); otherwise q = k = v (self-attention)
};

inline Config demo_config() { return {"demo", "demo", 50, 49, 49, 512, 512, 512, 8, false, false}; }
inline Config standard_config() { return {"standard", "standard", 8, 256, 256, 512, 64, 64, 8, false, false}; }
inline Config long_config(Index n, bool causal) {
  return {std::string(causal ? "causal" : "long") + "/N:" + std::to_string(n), causal ? "causal" : "long",
          1, n, n, 512, 64, 64, 8, causal, false};
}
inline Config cross_config() { return {"cross/nq:256/nk:1024", "cross", 8, 256, 1024, 512, 64, 64, 8, false, true}; }

inline const std::vector<Index>& long_lengths() {
  static const std::vector<Index> n{512, 1024, 2048, 4096, 8192, 16384};
  return n;
}

// Query-key pairs that take part in the softmax: all of them, or for the top-left aligned causal mask
// (key k visible to query q when k <= q) sum over q of min(q + 1, nk).
inline double visible_pairs(const Config& c) {
  if (!c.causal) return static_cast<double>(c.nq) * static_cast<double>(c.nk);
  double pairs = 0;
  for (Index q = 0; q < c.nq; ++q) pairs += static_cast<double>(std::min(q + 1, c.nk));
  return pairs;
}

// The module's useful multiply-add FLOPs (2 per multiply-add): the four projections and, per head, q k^T
// and p v over the visible pairs. Softmax, scaling and bias adds are not counted.
inline double useful_flops(const Config& c) {
  const double b = static_cast<double>(c.batch), nq = static_cast<double>(c.nq), nk = static_cast<double>(c.nk);
  const double dm = static_cast<double>(c.d_model), hk = static_cast<double>(c.h * c.d_k),
               hv = static_cast<double>(c.h * c.d_v);
  const double projections = 2 * b * nq * dm * hk + 2 * b * nk * dm * hk + 2 * b * nk * dm * hv + 2 * b * nq * hv * dm;
  const double attention = 2 * b * static_cast<double>(c.h) * visible_pairs(c) * static_cast<double>(c.d_k + c.d_v);
  return projections + attention;
}

// Everything a case needs, built outside the timed region. Weights follow PyTorch's nn.Linear default
// (U(+-1/sqrt(fan_in))) rather than the seed project's N(0, 0.001), so that the softmax is far from
// uniform and the sdpa / LibTorch agreement check means something; the speed does not depend on it.
struct Fixture {
  Config cfg;
  Module module;
  Tensor3 x;    // queries; also keys and values for self-attention
  Tensor3 mem;  // keys and values for cross-attention (empty otherwise)
  sdpa::Mask mask;
  bool has_mask = false;

  explicit Fixture(const Config& c) : cfg(c), module(c.d_model, c.d_k, c.d_v, c.h, 0.1f) {
    module.init_weights(sdpa::init::PyTorchDefaultPolicy{});
    module.eval();
    x = Tensor3(c.batch, c.nq, c.d_model);
    sdpa::Philox gen(0xbe7c4, 1);
    sdpa::init::Uniform{-1.0, 1.0}(x, gen);
    if (c.cross) {
      mem = Tensor3(c.batch, c.nk, c.d_model);
      sdpa::Philox gen_mem(0xbe7c4, 2);
      sdpa::init::Uniform{-1.0, 1.0}(mem, gen_mem);
    }
    if (c.causal) {
      mask = sdpa::causal_mask(c.nq, c.nk);
      has_mask = true;
    }
  }

  const Tensor3& queries() const { return x; }
  const Tensor3& keys() const { return cfg.cross ? mem : x; }
  const Tensor3& values() const { return cfg.cross ? mem : x; }
  const sdpa::Mask* mask_ptr() const { return has_mask ? &mask : nullptr; }

  Tensor3 run(const Eigen::ThreadPoolDevice* device) const {
    return module(queries(), keys(), values(), mask_ptr(), nullptr, device);
  }
};

}  // namespace sdpa_bench
