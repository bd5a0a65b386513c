// The module's parameters and settings (declared in sdpa/scaled_dot_product_attention.hpp, which includes
// this header after the class): the checks of its constructor's sizes, init_weights' layer drawing, the
// output gate's projection, swap, and named_parameters' list in PyTorch's state_dict order.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <array>
#include <string>
#include <vector>

#include "sdpa/scaled_dot_product_attention.hpp"

SDPA_NAMESPACE_BEGIN

template <typename Scalar>
ScaledDotProductAttention<Scalar>::ScaledDotProductAttention(const ScaledDotProductAttention& other)
    : d_model_(other.d_model_), d_k_(other.d_k_), d_v_(other.d_v_), h_(other.h_), kv_heads_(other.kv_heads_),
      dropout_(other.dropout_), training_(other.training_), masked_rows_(other.masked_rows_), kernel_(other.kernel_),
      compute_(other.compute_), rotary_(other.rotary_), has_rotary_(other.has_rotary_), qk_norm_(other.qk_norm_),
      temperature_(other.temperature_), has_temperature_(other.has_temperature_), gated_(other.gated_),
      seed_(next_seed()), calls_(0), id_(detail::next_module_id()), fc_q_(other.fc_q_), fc_k_(other.fc_k_),
      fc_v_(other.fc_v_), fc_o_(other.fc_o_), fc_g_(other.fc_g_) {}

template <typename Scalar>
auto ScaledDotProductAttention<Scalar>::operator=(const ScaledDotProductAttention& other) -> ScaledDotProductAttention& {
  if (this != &other) {
    ScaledDotProductAttention copy(other);
    swap(copy);
  }
  return *this;
}

template <typename Scalar>
ScaledDotProductAttention<Scalar>::ScaledDotProductAttention(ScaledDotProductAttention&& other) noexcept
    : d_model_(1), d_k_(1), d_v_(1), h_(1), kv_heads_(1), dropout_(0), seed_(0), id_(0),
      fc_q_(1, 1), fc_k_(1, 1), fc_v_(1, 1), fc_o_(1, 1), fc_g_(1, 1) {
  swap(other);
}

template <typename Scalar>
auto ScaledDotProductAttention<Scalar>::operator=(ScaledDotProductAttention&& other) noexcept -> ScaledDotProductAttention& {
  swap(other);
  return *this;
}

template <typename Scalar>
template <typename Policy>
void ScaledDotProductAttention<Scalar>::init_weights(const Policy& policy) {
  LinearType* layers[5] = {&fc_q_, &fc_k_, &fc_v_, &fc_o_, &fc_g_};
  for (int i = 0; i < (gated_ ? 5 : 4); ++i) {
    Philox gen(seed_, static_cast<std::uint64_t>(i));
    init_layer(*layers[i], policy, gen);
  }
}

template <typename Scalar>
template <typename Policy, typename Gen>
void ScaledDotProductAttention<Scalar>::init_weights(const Policy& policy, Gen& gen) {
  for (LinearType* layer : {&fc_q_, &fc_k_, &fc_v_, &fc_o_}) init_layer(*layer, policy, gen);
  if (gated_) init_layer(fc_g_, policy, gen);
}

template <typename Scalar>
void ScaledDotProductAttention<Scalar>::set_output_gate(bool on) {
  if (on == gated_) return;
  gated_ = on;
  if (!on) {
    fc_g_ = LinearType(1, 1);
    return;
  }
  LinearType g(d_model_, h_ * d_v_);
  Philox gen(seed_, 4);
  init_layer(g, init::ExternalAttentionPolicy{}, gen);
  g.set_weight_storage(fc_q_.weight_storage());
  fc_g_ = std::move(g);
}

template <typename Scalar>
void ScaledDotProductAttention<Scalar>::swap(ScaledDotProductAttention& other) noexcept {
  using std::swap;
  swap(d_model_, other.d_model_);
  swap(d_k_, other.d_k_);
  swap(d_v_, other.d_v_);
  swap(h_, other.h_);
  swap(kv_heads_, other.kv_heads_);
  swap(rotary_, other.rotary_);
  swap(has_rotary_, other.has_rotary_);
  swap(qk_norm_, other.qk_norm_);
  swap(temperature_, other.temperature_);
  swap(has_temperature_, other.has_temperature_);
  swap(gated_, other.gated_);
  swap(dropout_, other.dropout_);
  swap(training_, other.training_);
  swap(masked_rows_, other.masked_rows_);
  swap(kernel_, other.kernel_);
  swap(compute_, other.compute_);
  swap(seed_, other.seed_);
  swap(id_, other.id_);
  const std::uint64_t calls = calls_.load();
  calls_.store(other.calls_.load());
  other.calls_.store(calls);
  swap(fc_q_, other.fc_q_);
  swap(fc_k_, other.fc_k_);
  swap(fc_v_, other.fc_v_);
  swap(fc_o_, other.fc_o_);
  swap(fc_g_, other.fc_g_);
  scratch_.swap(other.scratch_);
}

template <typename Scalar>
auto ScaledDotProductAttention<Scalar>::checked_size(const char* name, Index value) -> Index {
  if (value <= 0) detail::throw_invalid("ScaledDotProductAttention", name, "positive", value);
  return value;
}

template <typename Scalar>
auto ScaledDotProductAttention<Scalar>::checked_product(const char* name, Index a, Index b) -> Index {
  if (a > 0 && b > 0 && a > std::numeric_limits<Index>::max() / b)
    detail::throw_invalid("ScaledDotProductAttention", name, "representable as Eigen::Index",
                          detail::concat(a, " * ", b));
  return a * b;
}

template <typename Scalar>
auto ScaledDotProductAttention<Scalar>::checked_kv_heads(Index kv_heads, Index h) -> Index {
  if (kv_heads == 0) return h;
  if (kv_heads < 0 || kv_heads > h || h % kv_heads != 0)
    detail::throw_invalid("ScaledDotProductAttention", "kv_heads",
                          detail::concat("0 (as many as h) or a divisor of h = ", h), kv_heads);
  return kv_heads;
}

template <typename Scalar>
template <typename Policy, typename Gen>
void ScaledDotProductAttention<Scalar>::init_layer(LinearType& layer, const Policy& policy, Gen& gen) {
  if (layer.weight_storage() == native_storage<Scalar>()) return policy.linear(layer.weight(), layer.bias(), gen);
  typename LinearType::Weight w(layer.out_features(), layer.in_features());  // drawn in Scalar, then rounded
  policy.linear(w, layer.bias(), gen);
  layer.set_weight_values(w);
}

template <typename Scalar>
void ScaledDotProductAttention<Scalar>::check_scalar_weights(const char* where) const {
  if (weight_storage() != native_storage<Scalar>())
    detail::throw_invalid(where, "the module's weight storage",
                          detail::concat(storage_name(native_storage<Scalar>()),
                                         " (training and named_parameters need Scalar weights: "
                                         "set_weight_storage(", storage_name(native_storage<Scalar>()), ") first)"),
                          storage_name(weight_storage()));
}

template <typename Scalar>
auto ScaledDotProductAttention<Scalar>::checked_dropout(Scalar p) -> Scalar {
  if (!(std::isfinite(p) && p >= Scalar(0) && p <= Scalar(1)))
    detail::throw_invalid("ScaledDotProductAttention", "dropout", "a finite probability in [0, 1]", p);
  return p;
}

template <typename Scalar>
template <typename T, typename Self>
auto ScaledDotProductAttention<Scalar>::collect(Self& self) -> std::vector<ParameterRef<T>> {
  std::vector<ParameterRef<T>> out;
  const char* names[4] = {"fc_q", "fc_k", "fc_v", "fc_o"};
  const std::array<decltype(&self.fc_q_), 4> layers{&self.fc_q_, &self.fc_k_, &self.fc_v_, &self.fc_o_};
  for (std::size_t i = 0; i < 4; ++i) {
    auto& layer = *layers[i];
    out.push_back({std::string(names[i]) + ".weight", layer.weight().data(),
                   {layer.weight().dimension(0), layer.weight().dimension(1)}});
    out.push_back({std::string(names[i]) + ".bias", layer.bias().data(), {layer.bias().dimension(0)}});
  }
  // The options' parameters, when the module has them: the gate's projection, the QK-norm's weights.
  if (self.gated_) {
    out.push_back({"fc_g.weight", self.fc_g_.weight().data(), {self.fc_g_.weight().dimension(0), self.fc_g_.weight().dimension(1)}});
    out.push_back({"fc_g.bias", self.fc_g_.bias().data(), {self.fc_g_.bias().dimension(0)}});
  }
  if (self.qk_norm_.kind != QkNormKind::kNone && !self.qk_norm_.q_weight.empty())
    out.push_back({"q_norm.weight", self.qk_norm_.q_weight.data(), {static_cast<Index>(self.qk_norm_.q_weight.size())}});
  if (self.qk_norm_.kind != QkNormKind::kNone && !self.qk_norm_.k_weight.empty())
    out.push_back({"k_norm.weight", self.qk_norm_.k_weight.data(), {static_cast<Index>(self.qk_norm_.k_weight.size())}});
  return out;
}

template <typename Scalar>
template <typename T>
auto ScaledDotProductAttention<Scalar>::find(std::vector<ParameterRef<T>> params, const std::string& name)
    -> ParameterRef<T> {
  std::string known;
  for (auto& p : params) {
    if (p.name == name) return p;
    known += (known.empty() ? "" : ", ") + p.name;
  }
  detail::throw_invalid("ScaledDotProductAttention::parameter", "name", detail::concat("one of ", known),
                        detail::concat('"', name, '"'));
}

template <typename Scalar>
void ScaledDotProductAttention<Scalar>::set_compute(Compute compute) {
  detail::check_compute<Scalar>("ScaledDotProductAttention::set_compute", compute, kernel_);
  compute_ = compute;
}

template <typename Scalar>
void ScaledDotProductAttention<Scalar>::set_rotary(const Rotary& rotary) {
  detail::check_rotary("ScaledDotProductAttention::set_rotary", rotary, d_k_);
  rotary_ = rotary;
  has_rotary_ = true;
}

template <typename Scalar>
void ScaledDotProductAttention<Scalar>::set_qk_norm(QkNorm<Scalar> norm) {
  detail::check_qk_norm("ScaledDotProductAttention::set_qk_norm", norm, h_, kv_heads_, d_k_);
  qk_norm_ = std::move(norm);
}

template <typename Scalar>
void ScaledDotProductAttention<Scalar>::set_query_temperature(const QueryTemperature& temperature) {
  detail::check_temperature("ScaledDotProductAttention::set_query_temperature", temperature);
  temperature_ = temperature;
  has_temperature_ = true;
}

template <typename Scalar>
void ScaledDotProductAttention<Scalar>::rotate(Scalar* x, Index batch, Index batch_stride, Index n, Index ld, Index heads,
                                               Index first, bool inverse) const {
  if (!has_rotary_ || x == nullptr) return;
  for (Index b = 0; b < batch; ++b)
    apply_rotary(rotary_, RotaryRows(x + b * batch_stride, n, ld, heads, d_k_, d_k_), first, inverse);
}

SDPA_NAMESPACE_END
