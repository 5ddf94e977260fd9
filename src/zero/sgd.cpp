// src/zero/sgd.cpp — SGD with momentum, dampening, Nesterov and weight decay on a flat shard,
// op for op torch.optim.SGD's single-tensor path (Note [shard optimizers match torch.optim]).
#include <c10/util/Exception.h>

#include "src/zero/optim.h"

namespace dpzero::zero {
namespace {

class ShardSgd final : public ShardOptimizer {
 public:
  explicit ShardSgd(OptimizerOptions options) : ShardOptimizer(std::move(options)) {}

  void step(at::Tensor& param, const at::Tensor& grad_in) override {
    TORCH_CHECK(param.sizes() == grad_in.sizes(), "sgd step: param ", param.sizes(),
                " and grad ", grad_in.sizes(), " differ in shape");
    const OptimizerOptions& o = options_;
    at::Tensor grad = o.maximize ? grad_in.neg() : grad_in;
    grad = coupled_decay(grad, param);
    if (o.momentum != 0.0) {
      if (!momentum_buffer_.defined()) {
        momentum_buffer_ = grad.detach().clone();  // [n]
      } else {
        momentum_buffer_.mul_(o.momentum).add_(grad, 1.0 - o.dampening);
      }
      grad = o.nesterov ? grad.add(momentum_buffer_, o.momentum) : momentum_buffer_;
    }
    param.add_(grad, -o.lr);
    ++steps_;
  }

  void load_state(const std::vector<std::pair<std::string, at::Tensor>>& state, int64_t steps,
                  int64_t n) override {
    TORCH_CHECK(steps >= 0, "sgd state: steps must be >= 0, got ", steps);
    // torch.optim creates the momentum buffer on the first step, and only with momentum.
    const bool has_buffer = options_.momentum != 0.0 && steps > 0;
    std::vector<at::Tensor> t =
        take_entries(state, has_buffer ? std::vector<std::string>{"momentum_buffer"}
                                       : std::vector<std::string>{},
                     n, "sgd");
    momentum_buffer_ = has_buffer ? t[0] : at::Tensor();
    steps_ = steps;
  }

  std::vector<std::pair<std::string, at::Tensor>> state() const override {
    if (!momentum_buffer_.defined()) return {};
    return {{"momentum_buffer", momentum_buffer_}};
  }

 private:
  at::Tensor momentum_buffer_;  // [n]; only with momentum != 0, created on the first step
};

}  // namespace

std::unique_ptr<ShardOptimizer> make_sgd(const OptimizerOptions& options) {
  return std::make_unique<ShardSgd>(options);
}

}  // namespace dpzero::zero
