// The optimizers of torch.optim that training a module needs, with PyTorch's update rules, defaults and
// argument checks: SGD (momentum, dampening, Nesterov, L2 weight decay), Adam (bias-corrected moments,
// L2 weight decay, AMSGrad) and AdamW (Adam with decoupled weight decay). step() pairs a module's
// parameters with a backward pass's gradients by their state_dict names (any Module whose
// named_parameters() gives ParameterRefs, not only ScaledDotProductAttention) and refuses a name or shape
// that differs before it changes anything. The state (momentum buffers, moment estimates, step counts) is
// kept per parameter name, as torch.optim's state_dict keeps it per parameter. Hyperparameters are held as
// doubles, as Python holds them, and derived scalars (1 - beta1, lr / (1 - beta1^t), ...) are formed in
// double and rounded to Scalar where PyTorch rounds them to the tensor's type, so a float run follows
// PyTorch's float32 run to rounding. Not in the umbrella header: include sdpa/optim.hpp to train.
#pragma once

#include "sdpa/config.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "sdpa/detail/eigen.hpp"

#include "sdpa/error.hpp"
#include "sdpa/gradients.hpp"
#include "sdpa/parameter.hpp"

SDPA_NAMESPACE_BEGIN
namespace optim {
namespace detail {

// One parameter of a step with its gradient: what the update loops run over.
template <typename Scalar>
struct Update {
  const std::string* name = nullptr;
  Scalar* param = nullptr;
  const Scalar* grad = nullptr;
  const std::vector<Eigen::Index>* shape = nullptr;
  std::size_t size = 0;
};

inline std::string quoted(const std::string& name) { return sdpa::detail::concat('"', name, '"'); }

inline std::string shape_of(const std::vector<Eigen::Index>& shape) {
  return sdpa::detail::shape_string(shape.data(), shape.size());
}

// Pairs every parameter of the module with the gradient of the same name. Throws std::invalid_argument,
// naming the parameter, when a name is missing on either side, appears twice, or the shapes differ.
template <typename Scalar>
std::vector<Update<Scalar>> pair_parameters(const char* where, std::vector<ParameterRef<Scalar>>& params,
                                            std::vector<ParameterRef<Scalar>>& grads) {
  std::map<std::string, std::size_t> by_name;
  for (std::size_t i = 0; i < grads.size(); ++i) {
    if (!by_name.emplace(grads[i].name, i).second)
      sdpa::detail::throw_invalid(where, "gradients", "one entry per parameter name",
                                  sdpa::detail::concat("two entries named ", quoted(grads[i].name)));
  }
  std::vector<Update<Scalar>> out;
  std::vector<bool> used(grads.size(), false);
  for (ParameterRef<Scalar>& p : params) {
    const auto it = by_name.find(p.name);
    if (it == by_name.end()) {
      std::string known;
      for (const auto& g : grads) known += (known.empty() ? "" : ", ") + g.name;
      sdpa::detail::throw_invalid(where, "gradients",
                                  sdpa::detail::concat("an entry for the module's parameter ", quoted(p.name)),
                                  sdpa::detail::concat("missing (the gradients have: ", known, ")"));
    }
    if (used[it->second])
      sdpa::detail::throw_invalid(where, "module", "one parameter per name",
                                  sdpa::detail::concat("two parameters named ", quoted(p.name)));
    used[it->second] = true;
    ParameterRef<Scalar>& g = grads[it->second];
    if (g.shape != p.shape)
      sdpa::detail::throw_invalid(where, sdpa::detail::concat("the gradient of ", quoted(p.name), " shape"),
                                  sdpa::detail::concat(shape_of(p.shape), " (the parameter's)"), shape_of(g.shape));
    if (p.size() > 0 && (p.data == nullptr || g.data == nullptr))
      sdpa::detail::throw_invalid(where, sdpa::detail::concat("the data of ", quoted(p.name)), "not null",
                                  p.data == nullptr ? "null in the module" : "null in the gradients");
    out.push_back({&p.name, p.data, g.data, &p.shape, static_cast<std::size_t>(p.size())});
  }
  for (std::size_t i = 0; i < grads.size(); ++i) {
    if (!used[i])
      sdpa::detail::throw_invalid(where, "gradients", "entries for the module's parameters only",
                                  sdpa::detail::concat("an entry ", quoted(grads[i].name), " the module does not have"));
  }
  return out;
}

// The module's parameters as ParameterRef<Scalar> (not const): a module of another Scalar, or a const one,
// stops here rather than deep inside the update.
template <typename Scalar, typename Module>
std::vector<ParameterRef<Scalar>> module_parameters(Module& module) {
  static_assert(std::is_same<decltype(module.named_parameters()), std::vector<ParameterRef<Scalar>>>::value,
                "sdpa::optim: module.named_parameters() must return std::vector<ParameterRef<Scalar>> with the "
                "optimizer's Scalar (a non-const module of the same Scalar)");
  return module.named_parameters();
}

// State buffers of one parameter must have the shape it had when they were made.
inline void check_state_shape(const char* where, const std::string& name, const std::vector<Eigen::Index>& state_shape,
                              const std::vector<Eigen::Index>& shape) {
  if (state_shape != shape)
    sdpa::detail::throw_invalid(
        where, sdpa::detail::concat("the shape of parameter ", quoted(name)),
        sdpa::detail::concat(shape_of(state_shape), " as in the optimizer's state (zero_state() starts afresh)"),
        shape_of(shape));
}

inline double check_non_negative(const char* where, const char* argument, double value) {
  if (!(value >= 0.0 && std::isfinite(value)))
    sdpa::detail::throw_invalid(where, argument, "finite and >= 0", value);
  return value;
}

inline double check_beta(const char* where, const char* argument, double value) {
  if (!(value >= 0.0 && value < 1.0)) sdpa::detail::throw_invalid(where, argument, "in [0, 1)", value);
  return value;
}

}  // namespace detail

// torch.optim.SGD: g = grad + weight_decay * p; with momentum, buf = g at the first step and
// momentum * buf + (1 - dampening) * g after it, and g = buf (or g + momentum * buf with Nesterov);
// p -= lr * g. (The arguments' order is lr, momentum, weight_decay, dampening, nesterov; PyTorch's
// positional order has dampening before weight_decay.)
template <typename Scalar>
class SGD {
  static_assert(std::is_floating_point<Scalar>::value, "sdpa::optim::SGD needs a floating-point Scalar");

 public:
  struct State {
    std::vector<Eigen::Index> shape;
    std::vector<Scalar> momentum_buffer;
  };

  explicit SGD(double lr, double momentum = 0.0, double weight_decay = 0.0, double dampening = 0.0,
               bool nesterov = false)
      : lr_(detail::check_non_negative(kWhere, "lr", lr)),
        momentum_(detail::check_non_negative(kWhere, "momentum", momentum)),
        weight_decay_(detail::check_non_negative(kWhere, "weight_decay", weight_decay)),
        dampening_(dampening),
        nesterov_(nesterov) {
    if (!std::isfinite(dampening)) sdpa::detail::throw_invalid(kWhere, "dampening", "finite", dampening);
    if (nesterov && !(momentum > 0.0 && dampening == 0.0))
      sdpa::detail::throw_invalid(kWhere, "nesterov", "false unless momentum > 0 and dampening == 0",
                                  sdpa::detail::concat("true with momentum ", momentum, " and dampening ", dampening));
  }

  // One update of every parameter of `module` from the gradient of the same name.
  template <class Module>
  void step(Module& module, Gradients<Scalar>& gradients) {
    std::vector<ParameterRef<Scalar>> params = detail::module_parameters<Scalar>(module);
    std::vector<ParameterRef<Scalar>> grads = gradients.named_parameters();
    const std::vector<detail::Update<Scalar>> updates = detail::pair_parameters(kStepWhere, params, grads);
    for (const auto& u : updates) {
      const auto it = state_.find(*u.name);
      if (it != state_.end()) detail::check_state_shape(kStepWhere, *u.name, it->second.shape, *u.shape);
    }
    const Scalar wd = static_cast<Scalar>(weight_decay_), mom = static_cast<Scalar>(momentum_);
    const Scalar keep = static_cast<Scalar>(1.0 - dampening_), neg_lr = static_cast<Scalar>(-lr_);
    std::vector<Scalar> d;
    for (const auto& u : updates) {
      d.assign(u.grad, u.grad + u.size);
      if (weight_decay_ != 0.0)
        for (std::size_t i = 0; i < u.size; ++i) d[i] = d[i] + wd * u.param[i];
      if (momentum_ != 0.0) {
        auto it = state_.find(*u.name);
        if (it == state_.end()) {
          it = state_.emplace(*u.name, State{*u.shape, d}).first;  // the first step: buf = g
        } else {
          std::vector<Scalar>& buf = it->second.momentum_buffer;
          for (std::size_t i = 0; i < u.size; ++i) buf[i] = buf[i] * mom + keep * d[i];
        }
        const std::vector<Scalar>& buf = it->second.momentum_buffer;
        if (nesterov_) {
          for (std::size_t i = 0; i < u.size; ++i) d[i] = d[i] + mom * buf[i];
        } else {
          d = buf;
        }
      }
      for (std::size_t i = 0; i < u.size; ++i) u.param[i] = u.param[i] + neg_lr * d[i];
    }
  }

  // Forgets every momentum buffer: the next step is a first step again.
  void zero_state() noexcept { state_.clear(); }

  // The state of a parameter, or null before its first step with momentum.
  const State* state(const std::string& name) const {
    const auto it = state_.find(name);
    return it == state_.end() ? nullptr : &it->second;
  }

  double lr() const noexcept { return lr_; }
  void set_lr(double lr) { lr_ = detail::check_non_negative(kWhere, "lr", lr); }
  double momentum() const noexcept { return momentum_; }
  double weight_decay() const noexcept { return weight_decay_; }
  double dampening() const noexcept { return dampening_; }
  bool nesterov() const noexcept { return nesterov_; }

 private:
  static constexpr const char* kWhere = "optim::SGD";
  static constexpr const char* kStepWhere = "optim::SGD::step";

  double lr_, momentum_, weight_decay_, dampening_;
  bool nesterov_;
  std::map<std::string, State> state_;
};

namespace detail {

// Adam and AdamW, which differ only in how weight decay applies: added to the gradient (Adam's L2 penalty)
// or multiplied into the parameter before the update (AdamW, decoupled). Per parameter and step t:
//   m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g * g;  (AMSGrad: vmax = max(vmax, v))
//   p += -(lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps).
template <typename Scalar>
class AdamRule {
  static_assert(std::is_floating_point<Scalar>::value, "sdpa::optim::Adam needs a floating-point Scalar");

 public:
  struct State {
    std::vector<Eigen::Index> shape;
    std::int64_t step = 0;
    std::vector<Scalar> exp_avg, exp_avg_sq, max_exp_avg_sq;  // the last one with amsgrad only
  };

  template <class Module>
  void step(Module& module, Gradients<Scalar>& gradients) {
    std::vector<ParameterRef<Scalar>> params = module_parameters<Scalar>(module);
    std::vector<ParameterRef<Scalar>> grads = gradients.named_parameters();
    const std::vector<Update<Scalar>> updates = pair_parameters(step_where_.c_str(), params, grads);
    for (const auto& u : updates) {
      const auto it = state_.find(*u.name);
      if (it != state_.end()) check_state_shape(step_where_.c_str(), *u.name, it->second.shape, *u.shape);
    }
    const Scalar beta1 = static_cast<Scalar>(beta1_), beta2 = static_cast<Scalar>(beta2_);
    const Scalar one_minus_beta1 = static_cast<Scalar>(1.0 - beta1_), one_minus_beta2 = static_cast<Scalar>(1.0 - beta2_);
    const Scalar wd = static_cast<Scalar>(weight_decay_), eps = static_cast<Scalar>(eps_);
    const Scalar decay = static_cast<Scalar>(1.0 - lr_ * weight_decay_);
    std::vector<Scalar> g;
    for (const auto& u : updates) {
      State& s = state_[*u.name];
      if (s.step == 0) {
        s.shape = *u.shape;
        s.exp_avg.assign(u.size, Scalar(0));
        s.exp_avg_sq.assign(u.size, Scalar(0));
        if (amsgrad_) s.max_exp_avg_sq.assign(u.size, Scalar(0));
      }
      ++s.step;
      g.assign(u.grad, u.grad + u.size);
      if (decoupled_) {
        for (std::size_t i = 0; i < u.size; ++i) u.param[i] = u.param[i] * decay;
      } else if (weight_decay_ != 0.0) {
        for (std::size_t i = 0; i < u.size; ++i) g[i] = g[i] + wd * u.param[i];
      }
      for (std::size_t i = 0; i < u.size; ++i) {
        s.exp_avg[i] = s.exp_avg[i] * beta1 + one_minus_beta1 * g[i];
        s.exp_avg_sq[i] = s.exp_avg_sq[i] * beta2 + one_minus_beta2 * g[i] * g[i];
      }
      // The bias corrections in double from the step count, as Python forms them.
      const double t = static_cast<double>(s.step);
      const double bias_correction1 = 1.0 - std::pow(beta1_, t);
      const double bias_correction2 = 1.0 - std::pow(beta2_, t);
      const Scalar neg_step_size = static_cast<Scalar>(-(lr_ / bias_correction1));
      const Scalar correction2_sqrt = static_cast<Scalar>(std::sqrt(bias_correction2));
      const std::vector<Scalar>& second = amsgrad_ ? s.max_exp_avg_sq : s.exp_avg_sq;
      for (std::size_t i = 0; i < u.size; ++i) {
        if (amsgrad_) s.max_exp_avg_sq[i] = std::max(s.max_exp_avg_sq[i], s.exp_avg_sq[i]);
        const Scalar denom = std::sqrt(second[i]) / correction2_sqrt + eps;
        u.param[i] = u.param[i] + neg_step_size * s.exp_avg[i] / denom;
      }
    }
  }

  // Forgets every moment estimate and step count: the next step is a first step again.
  void zero_state() noexcept { state_.clear(); }

  // The state of a parameter, or null before its first step.
  const State* state(const std::string& name) const {
    const auto it = state_.find(name);
    return it == state_.end() ? nullptr : &it->second;
  }

  double lr() const noexcept { return lr_; }
  void set_lr(double lr) { lr_ = check_non_negative(where_.c_str(), "lr", lr); }
  std::pair<double, double> betas() const noexcept { return {beta1_, beta2_}; }
  double eps() const noexcept { return eps_; }
  double weight_decay() const noexcept { return weight_decay_; }
  bool amsgrad() const noexcept { return amsgrad_; }

 protected:
  AdamRule(const char* name, bool decoupled, double lr, std::pair<double, double> betas, double eps, double weight_decay,
           bool amsgrad)
      : where_(std::string("optim::") + name),
        step_where_(where_ + "::step"),
        decoupled_(decoupled),
        lr_(check_non_negative(where_.c_str(), "lr", lr)),
        beta1_(check_beta(where_.c_str(), "betas.first (beta1)", betas.first)),
        beta2_(check_beta(where_.c_str(), "betas.second (beta2)", betas.second)),
        eps_(check_non_negative(where_.c_str(), "eps", eps)),
        weight_decay_(check_non_negative(where_.c_str(), "weight_decay", weight_decay)),
        amsgrad_(amsgrad) {}

 private:
  std::string where_, step_where_;
  bool decoupled_;
  double lr_, beta1_, beta2_, eps_, weight_decay_;
  bool amsgrad_;
  std::map<std::string, State> state_;
};

}  // namespace detail

// torch.optim.Adam: weight decay as an L2 penalty added to the gradient.
template <typename Scalar>
class Adam : public detail::AdamRule<Scalar> {
 public:
  explicit Adam(double lr = 1e-3, std::pair<double, double> betas = {0.9, 0.999}, double eps = 1e-8,
                double weight_decay = 0.0, bool amsgrad = false)
      : detail::AdamRule<Scalar>("Adam", /*decoupled=*/false, lr, betas, eps, weight_decay, amsgrad) {}
};

// torch.optim.AdamW: the parameter shrinks by (1 - lr * weight_decay) before each update (decoupled weight
// decay, Loshchilov and Hutter, ICLR 2019).
template <typename Scalar>
class AdamW : public detail::AdamRule<Scalar> {
 public:
  explicit AdamW(double lr = 1e-3, std::pair<double, double> betas = {0.9, 0.999}, double eps = 1e-8,
                 double weight_decay = 1e-2, bool amsgrad = false)
      : detail::AdamRule<Scalar>("AdamW", /*decoupled=*/true, lr, betas, eps, weight_decay, amsgrad) {}
};

}  // namespace optim
SDPA_NAMESPACE_END
