// src/zero/optim.cpp — option checks, the factory and the shared part of ShardOptimizer.
#include "src/zero/optim.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace dpzero::zero {

OptimizerKind parse_optimizer_kind(const std::string& name) {
  if (name == "sgd") return OptimizerKind::kSgd;
  if (name == "adam") return OptimizerKind::kAdam;
  if (name == "adamw") return OptimizerKind::kAdamW;
  TORCH_CHECK(false, "optimizer must be 'sgd', 'adam' or 'adamw', got '", name, "'");
}

void check_options(const OptimizerOptions& o) {
  TORCH_CHECK(o.lr >= 0.0, "lr must be >= 0, got ", o.lr);
  TORCH_CHECK(o.weight_decay >= 0.0, "weight_decay must be >= 0, got ", o.weight_decay);
  if (o.kind == OptimizerKind::kSgd) {
    TORCH_CHECK(o.momentum >= 0.0, "momentum must be >= 0, got ", o.momentum);
    TORCH_CHECK(!o.nesterov || (o.momentum > 0.0 && o.dampening == 0.0),
                "nesterov momentum needs momentum > 0 and dampening 0, got momentum ", o.momentum,
                " and dampening ", o.dampening);
  } else {
    TORCH_CHECK(o.beta1 >= 0.0 && o.beta1 < 1.0, "beta1 must be in [0, 1), got ", o.beta1);
    TORCH_CHECK(o.beta2 >= 0.0 && o.beta2 < 1.0, "beta2 must be in [0, 1), got ", o.beta2);
    TORCH_CHECK(o.eps >= 0.0, "eps must be >= 0, got ", o.eps);
  }
}

ShardOptimizer::ShardOptimizer(OptimizerOptions options) : options_(std::move(options)) {
  check_options(options_);
}

int64_t ShardOptimizer::state_bytes() const {
  int64_t bytes = 0;
  for (const auto& [name, tensor] : state()) {
    bytes += static_cast<int64_t>(tensor.numel()) * static_cast<int64_t>(tensor.element_size());
  }
  return bytes;
}

std::vector<at::Tensor> ShardOptimizer::take_entries(
    const std::vector<std::pair<std::string, at::Tensor>>& state,
    const std::vector<std::string>& expected, int64_t n, const char* optimizer) {
  std::vector<at::Tensor> out;
  for (const std::string& name : expected) {
    auto it = std::find_if(state.begin(), state.end(),
                           [&](const auto& entry) { return entry.first == name; });
    TORCH_CHECK(it != state.end(), optimizer, " state: the checkpoint has no '", name,
                "' (the optimizer's settings differ from the run that wrote it?)");
    const at::Tensor& t = it->second;
    TORCH_CHECK(t.dim() == 1 && t.numel() == n, optimizer, " state '", name, "': expected [", n,
                "], got ", t.sizes());
    out.push_back(t.to(at::kFloat).contiguous().clone());
  }
  for (const auto& [name, tensor] : state) {
    TORCH_CHECK(std::find(expected.begin(), expected.end(), name) != expected.end(), optimizer,
                " state: unexpected entry '", name, "' in the checkpoint");
  }
  return out;
}

void ShardOptimizer::set_lr(double lr) {
  TORCH_CHECK(lr >= 0.0, "lr must be >= 0, got ", lr);
  options_.lr = lr;
}

void ShardOptimizer::set_decayed_runs(
    std::optional<std::vector<std::pair<int64_t, int64_t>>> runs) {
  decayed_runs_ = std::move(runs);
}

void ShardOptimizer::check_runs(int64_t n) const {
  int64_t last = 0;
  for (const auto& [begin, end] : *decayed_runs_) {
    TORCH_CHECK(begin >= last && begin < end && end <= n, "weight decay run [", begin, ", ", end,
                ") is empty, overlaps the one before it or leaves the shard [0, ", n, ")");
    last = end;
  }
}

at::Tensor ShardOptimizer::coupled_decay(const at::Tensor& grad, const at::Tensor& param) const {
  const double wd = options_.weight_decay;
  if (wd == 0.0) return grad;
  if (!decayed_runs_) return grad.add(param, wd);
  check_runs(param.numel());
  if (decayed_runs_->empty()) return grad;
  at::Tensor out = grad.clone();  // [n]
  for (const auto& [begin, end] : *decayed_runs_) {
    out.narrow(0, begin, end - begin).add_(param.narrow(0, begin, end - begin), wd);
  }
  return out;
}

void ShardOptimizer::decoupled_decay(at::Tensor& param) const {
  const double wd = options_.weight_decay;
  if (wd == 0.0) return;
  const double factor = 1.0 - options_.lr * wd;
  if (!decayed_runs_) {
    param.mul_(factor);
    return;
  }
  check_runs(param.numel());
  for (const auto& [begin, end] : *decayed_runs_) {
    param.narrow(0, begin, end - begin).mul_(factor);
  }
}

void check_options_change(const OptimizerOptions& current, const OptimizerOptions& next) {
  TORCH_CHECK(next.kind == current.kind, "the optimizer kind cannot change during a run");
  TORCH_CHECK(next.amsgrad == current.amsgrad, "amsgrad cannot change during a run (it is ",
              current.amsgrad, ", got ", next.amsgrad, ")");
  check_options(next);
}

void ShardOptimizer::set_options(const OptimizerOptions& options) {
  check_options_change(options_, options);
  options_ = options;
}

std::unique_ptr<ShardOptimizer> make_shard_optimizer(const OptimizerOptions& options) {
  return options.kind == OptimizerKind::kSgd ? make_sgd(options) : make_adam(options);
}

}  // namespace dpzero::zero
