// LibTorch side of the benchmark; see torch_peer.hpp. The only translation unit that includes <torch/torch.h>.
#include "torch_peer.hpp"

#include <torch/torch.h>

#include <ATen/Parallel.h>
#include <torch/version.h>

#include <dlfcn.h>

#include <cmath>
#include <limits>
#include <sstream>

namespace sdpa_bench {

namespace {

// The original module (External-Attention-pytorch, model/attention/SelfAttention.py) in C++.
struct ScaledDotProductAttentionImpl : torch::nn::Module {
  ScaledDotProductAttentionImpl(std::int64_t d_model, std::int64_t d_k, std::int64_t d_v, std::int64_t h,
                                double dropout)
      : fc_q(register_module("fc_q", torch::nn::Linear(d_model, h * d_k))),
        fc_k(register_module("fc_k", torch::nn::Linear(d_model, h * d_k))),
        fc_v(register_module("fc_v", torch::nn::Linear(d_model, h * d_v))),
        fc_o(register_module("fc_o", torch::nn::Linear(h * d_v, d_model))),
        drop(register_module("dropout", torch::nn::Dropout(dropout))),
        d_k(d_k),
        d_v(d_v),
        h(h) {}

  torch::Tensor forward(const torch::Tensor& queries, const torch::Tensor& keys, const torch::Tensor& values,
                        const torch::Tensor& attention_mask) {
    const std::int64_t b_s = queries.size(0), nq = queries.size(1), nk = keys.size(1);
    auto q = fc_q(queries).view({b_s, nq, h, d_k}).permute({0, 2, 1, 3});  // (b_s, h, nq, d_k)
    auto k = fc_k(keys).view({b_s, nk, h, d_k}).permute({0, 2, 3, 1});     // (b_s, h, d_k, nk)
    auto v = fc_v(values).view({b_s, nk, h, d_v}).permute({0, 2, 1, 3});   // (b_s, h, nk, d_v)
    auto att = torch::matmul(q, k) / std::sqrt(static_cast<double>(d_k));  // (b_s, h, nq, nk)
    if (attention_mask.defined()) att = att.masked_fill(attention_mask, -std::numeric_limits<double>::infinity());
    att = torch::softmax(att, -1);
    att = drop(att);
    auto out = torch::matmul(att, v).permute({0, 2, 1, 3}).contiguous().view({b_s, nq, h * d_v});
    return fc_o(out);
  }

  torch::nn::Linear fc_q, fc_k, fc_v, fc_o;
  torch::nn::Dropout drop;
  std::int64_t d_k, d_v, h;
};
TORCH_MODULE(ScaledDotProductAttention);

void copy_linear(torch::nn::Linear& layer, TorchLinearParams p) {
  const auto out = layer->weight.size(0), in = layer->weight.size(1);
  auto opts = torch::TensorOptions().dtype(torch::kFloat32);
  layer->weight.copy_(torch::from_blob(const_cast<float*>(p.weight), {out, in}, opts));
  layer->bias.copy_(torch::from_blob(const_cast<float*>(p.bias), {out}, opts));
}

}  // namespace

struct TorchPeer::Impl {
  TorchShape shape;
  ScaledDotProductAttention module{nullptr};
  torch::Tensor queries, keys, values, mask, output;
};

TorchPeer::TorchPeer(const TorchShape& s, TorchLinearParams fc_q, TorchLinearParams fc_k, TorchLinearParams fc_v,
                     TorchLinearParams fc_o)
    : impl_(std::make_unique<Impl>()) {
  impl_->shape = s;
  impl_->module = ScaledDotProductAttention(s.d_model, s.d_k, s.d_v, s.h, 0.1);
  {
    torch::NoGradGuard no_grad;
    copy_linear(impl_->module->fc_q, fc_q);
    copy_linear(impl_->module->fc_k, fc_k);
    copy_linear(impl_->module->fc_v, fc_v);
    copy_linear(impl_->module->fc_o, fc_o);
  }
  impl_->module->eval();
}

TorchPeer::~TorchPeer() = default;

void TorchPeer::set_inputs(const float* queries, const float* keys, const float* values, bool causal) {
  const TorchShape& s = impl_->shape;
  auto opts = torch::TensorOptions().dtype(torch::kFloat32);
  impl_->queries = torch::from_blob(const_cast<float*>(queries), {s.batch, s.nq, s.d_model}, opts);
  impl_->keys = torch::from_blob(const_cast<float*>(keys), {s.batch, s.nk, s.d_model}, opts);
  impl_->values = torch::from_blob(const_cast<float*>(values), {s.batch, s.nk, s.d_model}, opts);
  impl_->mask = causal ? torch::triu(torch::ones({s.nq, s.nk}, torch::TensorOptions().dtype(torch::kBool)), 1)
                             .view({1, 1, s.nq, s.nk})
                       : torch::Tensor();
}

void TorchPeer::forward() {
  torch::NoGradGuard no_grad;
  c10::InferenceMode inference;
  impl_->output = torch::Tensor();  // free the previous result first, as a caller's loop would
  impl_->output = impl_->module->forward(impl_->queries, impl_->keys, impl_->values, impl_->mask);
}

const float* TorchPeer::output() const {
  TORCH_CHECK(impl_->output.defined() && impl_->output.is_contiguous(), "TorchPeer: no contiguous output");
  return impl_->output.data_ptr<float>();
}

void TorchPeer::drop_output() { impl_->output = torch::Tensor(); }

struct TorchDecoder::Impl {
  TorchShape shape;
  ScaledDotProductAttention module{nullptr};
  torch::Tensor past_k, past_v, output;
};

TorchDecoder::TorchDecoder(const TorchShape& s, TorchLinearParams fc_q, TorchLinearParams fc_k, TorchLinearParams fc_v,
                           TorchLinearParams fc_o)
    : impl_(std::make_unique<Impl>()) {
  impl_->shape = s;
  impl_->module = ScaledDotProductAttention(s.d_model, s.d_k, s.d_v, s.h, 0.0);
  torch::NoGradGuard no_grad;
  copy_linear(impl_->module->fc_q, fc_q);
  copy_linear(impl_->module->fc_k, fc_k);
  copy_linear(impl_->module->fc_v, fc_v);
  copy_linear(impl_->module->fc_o, fc_o);
  impl_->module->eval();
}

TorchDecoder::~TorchDecoder() = default;

void TorchDecoder::set_past(const float* prefix, std::int64_t n) {
  torch::NoGradGuard no_grad;
  c10::InferenceMode inference;
  const TorchShape& s = impl_->shape;
  auto x = torch::from_blob(const_cast<float*>(prefix), {s.batch, n, s.d_model}, torch::TensorOptions().dtype(torch::kFloat32));
  auto& m = impl_->module;
  impl_->past_k = m->fc_k(x).view({s.batch, n, s.h, s.d_k}).permute({0, 2, 1, 3}).contiguous();
  impl_->past_v = m->fc_v(x).view({s.batch, n, s.h, s.d_v}).permute({0, 2, 1, 3}).contiguous();
}

void TorchDecoder::step(const float* token) {
  torch::NoGradGuard no_grad;
  c10::InferenceMode inference;
  const TorchShape& s = impl_->shape;
  auto& m = impl_->module;
  impl_->output = torch::Tensor();
  auto x = torch::from_blob(const_cast<float*>(token), {s.batch, 1, s.d_model}, torch::TensorOptions().dtype(torch::kFloat32));
  auto q = m->fc_q(x).view({s.batch, 1, s.h, s.d_k}).permute({0, 2, 1, 3});
  auto k = torch::cat({impl_->past_k, m->fc_k(x).view({s.batch, 1, s.h, s.d_k}).permute({0, 2, 1, 3})}, 2);
  auto v = torch::cat({impl_->past_v, m->fc_v(x).view({s.batch, 1, s.h, s.d_v}).permute({0, 2, 1, 3})}, 2);
  auto att = torch::softmax(torch::matmul(q, k.transpose(2, 3)) / std::sqrt(static_cast<double>(s.d_k)), -1);
  auto out = torch::matmul(att, v).permute({0, 2, 1, 3}).contiguous().view({s.batch, 1, s.h * s.d_v});
  impl_->output = m->fc_o(out);
}

const float* TorchDecoder::output() const {
  TORCH_CHECK(impl_->output.defined() && impl_->output.is_contiguous(), "TorchDecoder: no contiguous output");
  return impl_->output.data_ptr<float>();
}

struct TorchTrainer::Impl {
  TorchShape shape;
  ScaledDotProductAttention module{nullptr};
  torch::Tensor x, grad_output, mask;
};

TorchTrainer::TorchTrainer(const TorchShape& s, TorchLinearParams fc_q, TorchLinearParams fc_k, TorchLinearParams fc_v,
                           TorchLinearParams fc_o)
    : impl_(std::make_unique<Impl>()) {
  impl_->shape = s;
  impl_->module = ScaledDotProductAttention(s.d_model, s.d_k, s.d_v, s.h, 0.0);
  {
    torch::NoGradGuard no_grad;
    copy_linear(impl_->module->fc_q, fc_q);
    copy_linear(impl_->module->fc_k, fc_k);
    copy_linear(impl_->module->fc_v, fc_v);
    copy_linear(impl_->module->fc_o, fc_o);
  }
  impl_->module->train();
}

TorchTrainer::~TorchTrainer() = default;

void TorchTrainer::set_inputs(const float* x, const float* grad_output, bool causal) {
  const TorchShape& s = impl_->shape;
  auto opts = torch::TensorOptions().dtype(torch::kFloat32);
  impl_->x = torch::from_blob(const_cast<float*>(x), {s.batch, s.nq, s.d_model}, opts).clone().requires_grad_(true);
  impl_->grad_output = torch::from_blob(const_cast<float*>(grad_output), {s.batch, s.nq, s.d_model}, opts);
  impl_->mask = causal ? torch::triu(torch::ones({s.nq, s.nq}, torch::TensorOptions().dtype(torch::kBool)), 1)
                             .view({1, 1, s.nq, s.nq})
                       : torch::Tensor();
}

void TorchTrainer::forward_backward() {
  impl_->module->zero_grad();
  if (impl_->x.grad().defined()) impl_->x.mutable_grad() = torch::Tensor();
  auto y = impl_->module->forward(impl_->x, impl_->x, impl_->x, impl_->mask);
  y.backward(impl_->grad_output);
}

const float* TorchTrainer::input_grad() const { return impl_->x.grad().data_ptr<float>(); }

void TorchPeer::set_num_threads(int threads) {
  at::set_num_threads(threads);
  // Debian's LibTorch calls whatever libblas.so.3 provides; OpenBLAS keeps its own thread pool, which
  // at::set_num_threads does not reach, so a 1-thread case would otherwise run its GEMMs on every core.
  using SetThreads = void (*)(int);
  if (auto set_blas_threads = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads")))
    set_blas_threads(threads);
}

std::string TorchPeer::describe() {
  std::ostringstream os;
  os << "LibTorch " << TORCH_VERSION_MAJOR << "." << TORCH_VERSION_MINOR << "." << TORCH_VERSION_PATCH << "; "
     << at::get_parallel_info();
  return os.str();
}

}  // namespace sdpa_bench
