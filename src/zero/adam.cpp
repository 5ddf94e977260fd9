// src/zero/adam.cpp — Adam and AdamW (decoupled weight decay) with optional AMSGrad on a flat
// shard, op for op torch.optim.Adam/AdamW's single-tensor path (Note [shard optimizers match
// torch.optim]): Kingma & Ba 2015, Alg. 1 with the bias corrections folded into the step size;
// Loshchilov & Hutter 2019, Alg. 2 for the decoupled decay.
#include <cmath>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "src/zero/optim.h"

namespace dpzero::zero {
namespace {

class ShardAdam final : public ShardOptimizer {
 public:
  explicit ShardAdam(OptimizerOptions options) : ShardOptimizer(std::move(options)) {}

  void step(at::Tensor& param, const at::Tensor& grad_in) override {
    TORCH_CHECK(param.sizes() == grad_in.sizes(), "adam step: param ", param.sizes(),
                " and grad ", grad_in.sizes(), " differ in shape");
    const OptimizerOptions& o = options_;
    if (!exp_avg_.defined()) {
      exp_avg_ = at::zeros_like(param, at::MemoryFormat::Contiguous);
      exp_avg_sq_ = at::zeros_like(param, at::MemoryFormat::Contiguous);
      if (o.amsgrad) max_exp_avg_sq_ = at::zeros_like(param, at::MemoryFormat::Contiguous);
    }
    ++steps_;
    at::Tensor grad = o.maximize ? grad_in.neg() : grad_in;
    if (o.kind == OptimizerKind::kAdamW) {
      decoupled_decay(param);
    } else {
      grad = coupled_decay(grad, param);
    }
    exp_avg_.lerp_(grad, 1.0 - o.beta1);
    exp_avg_sq_.mul_(o.beta2).addcmul_(grad, grad, 1.0 - o.beta2);
    // Python computes these in double from the float step count.
    const double step = static_cast<double>(steps_);
    const double bias_correction1 = 1.0 - std::pow(o.beta1, step);
    const double bias_correction2 = 1.0 - std::pow(o.beta2, step);
    const double step_size = o.lr / bias_correction1;
    const double bias_correction2_sqrt = std::pow(bias_correction2, 0.5);
    at::Tensor denom;  // [n]
    if (o.amsgrad) {
      at::maximum_out(max_exp_avg_sq_, max_exp_avg_sq_, exp_avg_sq_);
      denom = (max_exp_avg_sq_.sqrt() / bias_correction2_sqrt).add_(o.eps);
    } else {
      denom = (exp_avg_sq_.sqrt() / bias_correction2_sqrt).add_(o.eps);
    }
    param.addcdiv_(exp_avg_, denom, -step_size);
  }

  void load_state(const std::vector<std::pair<std::string, at::Tensor>>& state, int64_t steps,
                  int64_t n) override {
    TORCH_CHECK(steps >= 0, "adam state: steps must be >= 0, got ", steps);
    std::vector<std::string> expected;
    if (steps > 0) {
      expected = {"exp_avg", "exp_avg_sq"};
      if (options_.amsgrad) expected.emplace_back("max_exp_avg_sq");
    }
    std::vector<at::Tensor> t = take_entries(state, expected, n, "adam");
    exp_avg_ = steps > 0 ? t[0] : at::Tensor();
    exp_avg_sq_ = steps > 0 ? t[1] : at::Tensor();
    max_exp_avg_sq_ = steps > 0 && options_.amsgrad ? t[2] : at::Tensor();
    steps_ = steps;
  }

  std::vector<std::pair<std::string, at::Tensor>> state() const override {
    if (!exp_avg_.defined()) return {};
    std::vector<std::pair<std::string, at::Tensor>> out{{"exp_avg", exp_avg_},
                                                         {"exp_avg_sq", exp_avg_sq_}};
    if (max_exp_avg_sq_.defined()) out.emplace_back("max_exp_avg_sq", max_exp_avg_sq_);
    return out;
  }

 private:
  at::Tensor exp_avg_;         // [n] first moment
  at::Tensor exp_avg_sq_;      // [n] second moment
  at::Tensor max_exp_avg_sq_;  // [n] running maximum of the second moment (AMSGrad only)
};

}  // namespace

std::unique_ptr<ShardOptimizer> make_adam(const OptimizerOptions& options) {
  TORCH_CHECK(options.kind != OptimizerKind::kSgd, "make_adam: options are for SGD");
  return std::make_unique<ShardAdam>(options);
}

}  // namespace dpzero::zero
