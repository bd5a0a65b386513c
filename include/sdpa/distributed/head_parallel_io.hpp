// A head-parallel rank's slice of a whole module's safetensors file (needs sdpa::io and sdpa::mpi): the
// file every rank can read (the whole module's state dict, as save_safetensors or PyTorch's
// safetensors.torch.save_file(module.state_dict()) writes it: prefix + "fc_q.weight" ...), of which each
// rank converts only its rows of fc_q, fc_k and fc_v and its columns of fc_o.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/distributed/head_parallel.hpp"
#include "sdpa/io/safetensors.hpp"

#include <string>

SDPA_NAMESPACE_BEGIN

// Loads `hp`'s slice of the whole module saved at `path` (F32, F64, F16 or BF16 tensors of the whole
// module's shapes). Every tensor is checked before anything changes; a file refused on any rank throws the
// same SafetensorsError on every rank. Collective.
template <typename Scalar>
void load_safetensors_slice(HeadParallelAttention<Scalar>& hp, const std::string& path, const std::string& prefix = "") {
  using Index = Eigen::Index;
  using Weight = typename Linear<Scalar>::Weight;
  using Bias = typename Linear<Scalar>::Bias;
  const char* where = "load_safetensors_slice";
  const distributed::detail::CommShape cs = distributed::detail::comm_shape(hp.comm(), where);
  ScaledDotProductAttention<Scalar>& local = hp.local();
  const Index d_model = local.d_model(), d_k = local.d_k(), d_v = local.d_v();
  const Index hl = hp.h() / hp.ranks(), kvl = hp.kv_heads() / hp.ranks();
  struct Part {
    const char* name;
    Index whole_rows, whole_cols, first_row, rows;  // rows [first_row, first_row + rows) of the whole weight
  };
  const Part parts[3] = {{"fc_q", hp.h() * d_k, d_model, hp.first_head() * d_k, hl * d_k},
                         {"fc_k", hp.kv_heads() * d_k, d_model, hp.first_kv_head() * d_k, kvl * d_k},
                         {"fc_v", hp.kv_heads() * d_v, d_model, hp.first_kv_head() * d_v, kvl * d_v}};
  Weight weights[4];
  Bias biases[4];
  std::string refusal;
  try {
    const SafetensorsFile file = read_safetensors(path);
    const auto find = [&](const std::string& name, const std::vector<Index>& shape) -> const SafetensorsTensor& {
      const SafetensorsTensor* t = file.find(prefix + name);
      if (t == nullptr) detail::safetensors::fail(file.name, "has no tensor " + detail::safetensors::quote(prefix + name));
      if (t->shape != shape)
        detail::safetensors::fail(file.name, "tensor " + detail::safetensors::quote(prefix + name) + " has shape " +
                                                 detail::safetensors::shape_text(t->shape) + ", not the whole module's " +
                                                 detail::safetensors::shape_text(shape));
      return *t;
    };
    for (int i = 0; i < 3; ++i) {
      const Part& p = parts[i];
      const SafetensorsTensor& w = find(std::string(p.name) + ".weight", {p.whole_rows, p.whole_cols});
      // This rank's rows are contiguous in the file: convert those alone.
      SafetensorsTensor rows = w;
      const std::uint64_t width = w.numel() == 0 ? 0 : w.nbytes() / static_cast<std::uint64_t>(w.numel());
      rows.shape = {p.rows, p.whole_cols};
      rows.data = w.data + static_cast<std::uint64_t>(p.first_row * p.whole_cols) * width;
      rows.begin = w.begin + static_cast<std::uint64_t>(p.first_row * p.whole_cols) * width;
      rows.end = rows.begin + static_cast<std::uint64_t>(p.rows * p.whole_cols) * width;
      const std::vector<Scalar> values = tensor_values<Scalar>(file, rows);
      weights[i] = Weight(p.rows, p.whole_cols);
      std::copy(values.begin(), values.end(), weights[i].data());
      const std::vector<Scalar> b = tensor_values<Scalar>(file, find(std::string(p.name) + ".bias", {p.whole_rows}));
      biases[i] = Bias(p.rows);
      std::copy_n(b.begin() + p.first_row, p.rows, biases[i].data());
    }
    const std::vector<Scalar> o = tensor_values<Scalar>(file, find("fc_o.weight", {d_model, hp.h() * d_v}));
    weights[3] = Weight(d_model, hl * d_v);
    const Index first = hp.first_head() * d_v;
    for (Index r = 0; r < d_model; ++r)
      for (Index c = 0; c < hl * d_v; ++c) weights[3](r, c) = o[static_cast<std::size_t>(r * hp.h() * d_v + first + c)];
    const std::vector<Scalar> ob = tensor_values<Scalar>(file, find("fc_o.bias", {d_model}));
    biases[3] = Bias(d_model);
    if (cs.rank == 0)
      std::copy(ob.begin(), ob.end(), biases[3].data());
    else
      biases[3].setZero();
  } catch (const std::runtime_error& e) {  // SafetensorsError included
    refusal = e.what();
  }
  const std::string message =
      distributed::detail::agreed_refusal(hp.comm(), cs, where, refusal, distributed::detail::Fields());
  if (!message.empty()) throw SafetensorsError(message);
  Linear<Scalar>* layers[4] = {&local.fc_q(), &local.fc_k(), &local.fc_v(), &local.fc_o()};
  for (int i = 0; i < 4; ++i) {
    layers[i]->set_weight_storage(native_storage<Scalar>());
    layers[i]->weight() = weights[i];
    layers[i]->bias() = biases[i];
  }
}

SDPA_NAMESPACE_END
