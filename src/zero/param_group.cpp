// src/zero/param_group.cpp — one unit's gathers, gradient reduction and shard update per stage
// (Notes [gradient buffers], [gradient accumulation] and [stage-3 gathers] in param_group.h).
#include "src/zero/param_group.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace dpzero::zero {

ParamGroup::ParamGroup(std::string name, FlatParam flat, Stage stage,
                       std::unique_ptr<ShardOptimizer> optimizer)
    : name_(std::move(name)),
      flat_(std::move(flat)),
      stage_(stage),
      optimizer_(std::move(optimizer)),
      ready_(flat_.params().size(), 0) {
  TORCH_CHECK(flat_.shards_params() == (stage_ == Stage::k3), "unit '", name_,
              "': parameters must be sharded exactly in stage 3");
  if (reduces_in_backward(stage_)) {
    grad_shard_ = at::zeros({flat_.layout().shard_numel()}, flat_.shard().options());
    flat_.drop_grads();  // a gradient from before sharding would enter the first reduction
  } else {
    flat_grad_ = at::zeros({flat_.layout().padded_numel()}, flat_.shard().options());
    flat_.attach_grad_views(flat_grad_, /*keep_values=*/false);
  }
}

void ParamGroup::post_forward(bool in_backward) {
  if (!in_backward) flat_.reshard();
}

void ParamGroup::grad_ready(int64_t index, const comm::Collectives& comm) {
  TORCH_CHECK(reduces_in_backward(stage_), "unit '", name_,
              "': grad_ready is for stages 2-3, this unit is stage ", static_cast<int64_t>(stage_));
  TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(ready_.size()), "unit '", name_,
              "' has ", ready_.size(), " parameters, got parameter index ", index);
  if (ready_[index]) return;  // AccumulateGrad runs once per leaf and backward; tolerate repeats
  ready_[index] = 1;
  if (++ready_count_ == static_cast<int64_t>(ready_.size())) {
    reduce_grads(comm);
    flat_.reshard();
  }
}

void ParamGroup::finish_backward(const comm::Collectives& comm) {
  if (!reduces_in_backward(stage_)) return;
  if (ready_count_ > 0) reduce_grads(comm);
  flat_.reshard();
}

void ParamGroup::reduce_grads(const comm::Collectives& comm) {
  at::NoGradGuard no_grad;
  at::Tensor full = flat_.take_grads();  // [padded_numel]; the per-parameter .grad are freed
  if (grad_shard_written_) {
    at::Tensor reduced = at::empty_like(grad_shard_);
    comm.reduce_scatter_sum(reduced, full);
    grad_shard_.add_(reduced);
  } else {
    comm.reduce_scatter_sum(grad_shard_, full);
    grad_shard_written_ = true;
  }
  std::fill(ready_.begin(), ready_.end(), 0);
  ready_count_ = 0;
}

void ParamGroup::step(const comm::Collectives& comm, double grad_scale) {
  at::NoGradGuard no_grad;
  at::Tensor grad;  // [shard_numel] (stage 0: [padded_numel]) reduced gradient of the coordinates
                    // this rank updates
  switch (stage_) {
    case Stage::k0:
      flat_.attach_grad_views(flat_grad_, /*keep_values=*/true);
      comm.all_reduce_sum_(flat_grad_);
      grad = flat_grad_;
      break;
    case Stage::k1:
      flat_.attach_grad_views(flat_grad_, /*keep_values=*/true);
      grad = at::empty({flat_.layout().shard_numel()}, flat_grad_.options());
      comm.reduce_scatter_sum(grad, flat_grad_);
      break;
    case Stage::k2:
    case Stage::k3:
      grad = grad_shard_;
      break;
  }
  if (grad_scale != 1.0) grad.mul_(grad_scale);
  // Stage 0 updates every coordinate on every rank (its optimizer state is full); the others
  // update the owned shard only.
  at::Tensor& param = stage_ == Stage::k0 ? flat_.full() : flat_.shard();
  optimizer_->step(param, grad);
  if (stage_ == Stage::k1 || stage_ == Stage::k2) flat_.all_gather_params(comm);
  if (stage_ == Stage::k3) flat_.reshard();
  zero_grad();
}

void ParamGroup::zero_grad() {
  at::NoGradGuard no_grad;
  if (reduces_in_backward(stage_)) {
    grad_shard_.zero_();
    grad_shard_written_ = false;
    flat_.drop_grads();  // per-parameter gradients of a backward that was not finished
    std::fill(ready_.begin(), ready_.end(), 0);
    ready_count_ = 0;
  } else {
    flat_grad_.zero_();
    flat_.attach_grad_views(flat_grad_, /*keep_values=*/false);
  }
}

std::pair<int64_t, int64_t> ParamGroup::kept_range() const {
  const UnitLayout& layout = flat_.layout();
  if (stage_ == Stage::k0) return {0, layout.padded_numel()};
  const int64_t m = layout.shard_numel();
  return {flat_.rank() * m, (flat_.rank() + 1) * m};
}

std::vector<std::pair<std::string, at::Tensor>> ParamGroup::owned_state() const {
  const int64_t m = flat_.layout().shard_numel();
  // Stage 0 keeps every coordinate: its slice of the full buffer and of the full state.
  const int64_t begin = stage_ == Stage::k0 ? flat_.rank() * m : 0;
  FlatParam& flat = const_cast<FlatParam&>(flat_);
  const at::Tensor& master = stage_ == Stage::k0 ? flat.full() : flat.shard();
  std::vector<std::pair<std::string, at::Tensor>> out{{"param", master.narrow(0, begin, m)}};
  for (const auto& [name, tensor] : optimizer_->state()) {
    out.emplace_back(name, tensor.narrow(0, begin, m));
  }
  return out;
}

void ParamGroup::load_state(const std::vector<std::pair<std::string, at::Tensor>>& values,
                            int64_t steps, const comm::Collectives& comm) {
  at::NoGradGuard no_grad;
  const auto [begin, end] = kept_range();
  const int64_t n = end - begin;
  std::vector<std::pair<std::string, at::Tensor>> optimizer_state;
  at::Tensor param;
  for (const auto& [name, tensor] : values) {
    if (name == "param") {
      param = tensor;
    } else {
      optimizer_state.emplace_back(name, tensor.to(flat_.shard().device()));
    }
  }
  TORCH_CHECK(param.defined(), "unit '", name_, "': the checkpoint has no parameter values");
  TORCH_CHECK(param.dim() == 1 && param.numel() == n, "unit '", name_,
              "': checkpoint parameter values must have shape [", n, "], got ", param.sizes());
  optimizer_->load_state(optimizer_state, steps, n);  // checks everything before any write
  at::Tensor& master = stage_ == Stage::k0 ? flat_.full() : flat_.shard();
  master.copy_(param);
  if (stage_ == Stage::k1 || stage_ == Stage::k2) flat_.all_gather_params(comm);
  if (stage_ == Stage::k3) flat_.reshard();
  zero_grad();
}

int64_t ParamGroup::grad_bytes() const {
  const at::Tensor& held = reduces_in_backward(stage_) ? grad_shard_ : flat_grad_;
  return held.numel() * static_cast<int64_t>(held.element_size());
}

}  // namespace dpzero::zero
