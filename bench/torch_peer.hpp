// The LibTorch peer of sdpa's module, behind a plain interface so that only torch_peer.cpp includes
// LibTorch's (slow to compile) headers and the benchmark's other translation units stay Eigen-only.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace sdpa_bench {

struct TorchShape {
  std::int64_t batch, nq, nk, d_model, d_k, d_v, h;
};

// One nn.Linear's parameters in PyTorch's layout: weight (out, in) row-major, bias (out).
struct TorchLinearParams {
  const float* weight;
  const float* bias;
};

// External-Attention-pytorch's ScaledDotProductAttention written with LibTorch ops exactly as its
// forward: fc_q/fc_k/fc_v, view + permute, matmul / sqrt(d_k), masked_fill(-inf), softmax, dropout
// (eval: identity), matmul, permute + contiguous + view, fc_o. Eval mode, NoGradGuard, InferenceMode.
class TorchPeer {
 public:
  // Copies the four layers' parameters into torch::nn::Linear modules.
  TorchPeer(const TorchShape& shape, TorchLinearParams fc_q, TorchLinearParams fc_k, TorchLinearParams fc_v,
            TorchLinearParams fc_o);
  ~TorchPeer();
  TorchPeer(const TorchPeer&) = delete;
  TorchPeer& operator=(const TorchPeer&) = delete;

  // Borrows the callers' row-major buffers (no copy): queries (batch, nq, d_model), keys and values
  // (batch, nk, d_model); they may be the same buffer. causal adds torch.triu(ones(nq, nk), 1) as a bool
  // (1, 1, nq, nk) attention_mask, built here once.
  void set_inputs(const float* queries, const float* keys, const float* values, bool causal);

  // One forward; the result stays alive until the next call (or drop_output()).
  void forward();
  const float* output() const;  // (batch, nq, d_model), contiguous
  void drop_output();

  static void set_num_threads(int threads);  // at::set_num_threads
  static std::string describe();             // version and at::get_parallel_info()

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Hugging Face's decoding loop with its legacy cache, in LibTorch ops on the same weights: past keys and
// values as (batch, h, n, d) tensors; a step projects the new token, torch::cat's its key and value onto
// the past ones, attends (the new query sees every key: no mask), merges the heads and applies fc_o. The
// grown past is not kept, so that every timed step runs against the same cache length.
class TorchDecoder {
 public:
  TorchDecoder(const TorchShape& shape, TorchLinearParams fc_q, TorchLinearParams fc_k, TorchLinearParams fc_v,
               TorchLinearParams fc_o);
  ~TorchDecoder();
  TorchDecoder(const TorchDecoder&) = delete;
  TorchDecoder& operator=(const TorchDecoder&) = delete;

  // The past: the keys and values of prefix (batch, n, d_model).
  void set_past(const float* prefix, std::int64_t n);
  // One step for token (batch, 1, d_model); the result stays until the next step.
  void step(const float* token);
  const float* output() const;  // (batch, 1, d_model)

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// PyTorch autograd through the same module in LibTorch ops (the weights requiring gradients, the inputs
// too): one forward and backward(grad_output), for the training benchmark.
class TorchTrainer {
 public:
  TorchTrainer(const TorchShape& shape, TorchLinearParams fc_q, TorchLinearParams fc_k, TorchLinearParams fc_v,
               TorchLinearParams fc_o);
  ~TorchTrainer();
  TorchTrainer(const TorchTrainer&) = delete;
  TorchTrainer& operator=(const TorchTrainer&) = delete;

  // x (batch, n, d_model) is queries, keys and values; grad_output (batch, n, d_model); causal as set_inputs.
  void set_inputs(const float* x, const float* grad_output, bool causal);
  void forward_backward();
  const float* input_grad() const;  // d loss / d x, (batch, n, d_model)

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace sdpa_bench
