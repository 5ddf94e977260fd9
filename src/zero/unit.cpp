// src/zero/unit.cpp — one unit's gathers, gradient reduction and shard update per stage
// (Notes [gradient buffers], [gradient accumulation] and [stage-3 gathers] in unit.h).
#include "src/zero/unit.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace dpzero::zero {

Unit::Unit(std::string name, FlatParam flat, Stage stage,
                       std::unique_ptr<ShardOptimizer> optimizer, at::ScalarType reduce_dtype)
    : name_(std::move(name)),
      flat_(std::move(flat)),
      stage_(stage),
      optimizer_(std::move(optimizer)),
      reduce_dtype_(reduce_dtype),
      packs_grads_(reduces_in_backward(stage) || reduce_dtype != flat_.param_dtype()),
      ready_(flat_.params().size(), 0) {
  TORCH_CHECK(flat_.shards_params() == (stage_ == Stage::k3), "unit '", name_,
              "': parameters must be sharded exactly in stage 3");
  FlatParam::check_param_dtype(reduce_dtype);  // the same three dtypes are allowed
  if (!reduces_in_backward(stage_)) {
    flat_grad_ = at::zeros({flat_.layout().padded_numel()},
                           flat_.full().options().dtype(reduce_dtype_));
    peak_grad_bytes_ = grad_bytes();
  }
  if (packs_grads_) {
    flat_.drop_grads();  // a gradient from before sharding would enter the first reduction
  } else {
    flat_.attach_grad_views(flat_grad_, /*keep_values=*/false);
  }
}

void Unit::post_forward(bool in_backward) {
  if (!in_backward) flat_.reshard();
}

void Unit::grad_ready(int64_t index, const comm::Collectives& comm) {
  TORCH_CHECK(packs_grads_, "unit '", name_, "': grad_ready is for units whose gradients are "
              "packed per backward (stages 2-3, or a reduce dtype other than the parameters'); "
              "this unit is stage ", static_cast<int64_t>(stage_));
  TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(ready_.size()), "unit '", name_,
              "' has ", ready_.size(), " parameters, got parameter index ", index);
  if (ready_[index]) return;  // AccumulateGrad runs once per leaf and backward; tolerate repeats
  ready_[index] = 1;
  if (++ready_count_ == static_cast<int64_t>(ready_.size())) {
    take_grads(comm);
    flat_.reshard();
  }
}

void Unit::finish_backward(const comm::Collectives& comm) {
  if (!packs_grads_) return;
  if (ready_count_ > 0) take_grads(comm);
  flat_.reshard();
  wait_reduce();  // the backward's gradient is complete when the backward returns
}

void Unit::wait_reduce() {
  if (!pending_) return;
  if (pending_->work) {  // Note [collective failures]
    comm::wait(*pending_->work,
               "reduce-scatter of unit '" + name_ + "' on rank " + std::to_string(flat_.rank()));
  }
  if (pending_->reduced.defined()) grad_shard_.add_(pending_->reduced);
  pending_.reset();
}

void Unit::take_grads(const comm::Collectives& comm) {
  // [padded_numel] reduce_dtype; the per-parameter .grad are freed
  reduce_packed(flat_.take_grads(reduce_dtype_), comm);
  std::fill(ready_.begin(), ready_.end(), 0);
  ready_count_ = 0;
}

void Unit::add_grad(const at::Tensor& full, const comm::Collectives& comm, bool release,
                          bool donated) {
  const int64_t n = flat_.layout().padded_numel();
  TORCH_CHECK(full.dim() == 1 && full.numel() == n, "unit '", name_,
              "': a private gradient must have shape [", n, "] (the padded flat layout), got ",
              full.sizes());
  TORCH_CHECK(full.is_floating_point(), "unit '", name_,
              "': a private gradient must be floating point, got ", full.scalar_type());
  TORCH_CHECK(full.device() == flat_.device(), "unit '", name_,
              "': a private gradient must be on ", flat_.device(), ", got ",
              full.device());
  // Stages 0-1 add it to the gradient buffer at once. Stages 2-3 reduce it asynchronously and keep
  // it alive until then, so the caller's tensor is copied unless the caller has donated it (will
  // neither read nor write it again) and it is already in the reduction dtype.
  const bool copy = reduces_in_backward(stage_) &&
                    !(donated && full.scalar_type() == reduce_dtype_ && full.is_contiguous());
  reduce_packed(full.to(reduce_dtype_, /*non_blocking=*/false, copy), comm);
  // Stage 3: with `release` the caller has handed the unit's gradient over after every use of its
  // parameters in this backward ran, so the gathered parameters can go (as after take_grads).
  if (release) flat_.reshard();
}

at::Tensor Unit::private_accumulator() {
  if (reduces_in_backward(stage_) || flat_grad_.scalar_type() != at::kFloat) return {};
  grad_dirty_ = true;
  return flat_grad_;
}

void Unit::set_private(bool on) {
  at::NoGradGuard no_grad;
  private_ = on;
  if (packs_grads_) return;  // no views in this mode either way
  if (on) {
    flat_.drop_grads();
  } else {
    flat_.attach_grad_views(flat_grad_, /*keep_values=*/false);
  }
}

void Unit::reduce_packed(at::Tensor full, const comm::Collectives& comm) {
  at::NoGradGuard no_grad;
  const int64_t full_bytes = full.numel() * static_cast<int64_t>(full.element_size());
  if (!reduces_in_backward(stage_)) {
    flat_grad_.add_(full);
    grad_dirty_ = true;
    note_comm_bytes(full_bytes);
  } else {
    wait_reduce();  // one reduction in flight per unit, folded in order
    PendingReduce pending;
    pending.full = full;
    if (grad_shard_.defined()) {
      pending.reduced = at::empty_like(grad_shard_);  // [shard_numel]
      pending.work = comm.reduce_scatter_sum_async(pending.reduced, full);
      note_comm_bytes(full_bytes +
                      pending.reduced.numel() * static_cast<int64_t>(pending.reduced.element_size()));
    } else {
      grad_shard_ = at::empty({flat_.layout().shard_numel()}, full.options());
      pending.work = comm.reduce_scatter_sum_async(grad_shard_, full);
      peak_grad_bytes_ = std::max(peak_grad_bytes_, grad_bytes());
      note_comm_bytes(full_bytes);
    }
    pending_ = std::move(pending);
    ++reductions_started_;
  }
}

void Unit::step(const comm::Collectives& comm, double grad_scale, GradientNoise* noise,
                int64_t index) {
  at::NoGradGuard no_grad;
  wait_reduce();
  at::Tensor grad;  // reduce_dtype, the reduced gradient of the coordinates master() holds:
                    // [padded_numel] in stage 0, [shard_numel] otherwise
  switch (stage_) {
    case Stage::k0:
      if (!packs_grads_ && !private_) flat_.attach_grad_views(flat_grad_, /*keep_values=*/true);
      comm.all_reduce_sum_(flat_grad_);
      grad = flat_grad_;
      // The reduction, the noise and the scale write this buffer in place, whether or not this
      // rank wrote a gradient into it: zero_grad must clear it, or the next step would count
      // this one's sum (and noise) again.
      grad_dirty_ = true;
      break;
    case Stage::k1:
      if (!packs_grads_ && !private_) flat_.attach_grad_views(flat_grad_, /*keep_values=*/true);
      grad = at::empty({flat_.layout().shard_numel()}, flat_grad_.options());
      comm.reduce_scatter_sum(grad, flat_grad_);
      note_comm_bytes(grad.numel() * static_cast<int64_t>(grad.element_size()));
      break;
    case Stage::k2:
    case Stage::k3:
      // No reduction since the last step (no backward ran): a zero gradient, which the optimizer
      // still applies (weight decay, momentum), as for a parameter without a gradient.
      grad = grad_shard_.defined()
                 ? grad_shard_
                 : at::zeros({flat_.layout().shard_numel()},
                             flat_.full().options().dtype(reduce_dtype_));
      break;
  }
  at::Tensor& master = flat_.master();
  if (grad.scalar_type() != at::kFloat || grad.device() != master.device()) {
    // The optimizer runs in fp32 where the master is (Note [master weights]).
    grad = grad.to(master.device(), at::kFloat);
    note_comm_bytes(grad.numel() * static_cast<int64_t>(grad.element_size()));
  }
  // design.md §2 step 5, on the fp32 reduced gradient (§4): stage 0 holds the whole unit on
  // every rank, the other stages the owned shard.
  if (noise != nullptr)
    noise->add_(grad, index, flat_.layout(), flat_.rank(), stage_ == Stage::k0);
  if (grad_scale != 1.0) grad.mul_(grad_scale);  // §2 step 6: after the noise
  flat_.prepare_master_write();  // Note [parameter offload]
  optimizer_->step(master, grad);
  flat_.publish_master(comm);
  zero_grad();
}

void Unit::zero_grad() {
  at::NoGradGuard no_grad;
  wait_reduce();  // a collective in flight still writes into the buffers about to be dropped
  if (reduces_in_backward(stage_)) {
    grad_shard_ = at::Tensor();  // Note [gradient buffers]: released between steps
  } else if (grad_dirty_ || !private_) {  // with views autograd may have written it any time
    flat_grad_.zero_();
  }
  grad_dirty_ = false;
  if (packs_grads_) {
    flat_.drop_grads();  // per-parameter gradients of a backward that was not finished
    std::fill(ready_.begin(), ready_.end(), 0);
    ready_count_ = 0;
  } else if (private_) {
    flat_.drop_grads();  // Note [private gradients]: a .grad set by the caller is ignored
  } else {
    flat_.attach_grad_views(flat_grad_, /*keep_values=*/false);
  }
}

std::pair<int64_t, int64_t> Unit::kept_range() const {
  const UnitLayout& layout = flat_.layout();
  if (stage_ == Stage::k0) return {0, layout.padded_numel()};
  const int64_t m = layout.shard_numel();
  return {flat_.rank() * m, (flat_.rank() + 1) * m};
}

void Unit::set_decay_exempt(const std::vector<bool>& exempt) {
  const UnitLayout& layout = flat_.layout();
  const std::vector<ParamSpec>& params = layout.params();
  TORCH_CHECK(exempt.size() == params.size(), "unit '", name_, "': ", exempt.size(),
              " weight decay flags for ", params.size(), " parameters");
  if (std::none_of(exempt.begin(), exempt.end(), [](bool e) { return e; })) {
    optimizer_->set_decayed_runs(std::nullopt);  // every coordinate decays
    return;
  }
  const auto [begin, end] = kept_range();
  std::vector<std::pair<int64_t, int64_t>> runs;  // relative to begin
  bool extend = false;  // parameter i - 1 decays and runs.back() ends with it
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t lo = std::max(layout.flat_offsets()[i], begin);
    const int64_t hi = std::min(layout.flat_offsets()[i] + params[i].numel, end);
    if (exempt[i] || lo >= hi) {
      extend = false;
      continue;
    }
    // Only padding (alignment, or a ragged plan's shard tail: zero values and gradients) lies
    // between parameters adjacent in layout order, so two decayed neighbours share one run.
    if (extend) {
      runs.back().second = hi - begin;
    } else {
      runs.emplace_back(lo - begin, hi - begin);
    }
    extend = true;
  }
  optimizer_->set_decayed_runs(std::move(runs));
}

std::vector<std::pair<std::string, at::Tensor>> Unit::owned_state() const {
  const int64_t m = flat_.layout().shard_numel();
  // Stage 0 keeps every coordinate: its slice of the full buffer and of the full state.
  const int64_t begin = stage_ == Stage::k0 ? flat_.rank() * m : 0;
  const at::Tensor& master = flat_.master();
  std::vector<std::pair<std::string, at::Tensor>> out{{"param", master.narrow(0, begin, m)}};
  for (const auto& [name, tensor] : optimizer_->state()) {
    out.emplace_back(name, tensor.narrow(0, begin, m));
  }
  return out;
}

void Unit::load_state(const std::vector<std::pair<std::string, at::Tensor>>& values,
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
      optimizer_state.emplace_back(name, tensor.to(flat_.master().device()));
    }
  }
  TORCH_CHECK(param.defined(), "unit '", name_, "': the checkpoint has no parameter values");
  TORCH_CHECK(param.dim() == 1 && param.numel() == n, "unit '", name_,
              "': checkpoint parameter values must have shape [", n, "], got ", param.sizes());
  optimizer_->load_state(optimizer_state, steps, n);  // checks everything before any write
  flat_.prepare_master_write();  // Note [parameter offload]
  flat_.master().copy_(param);
  flat_.publish_master(comm);
  zero_grad();
}

int64_t Unit::grad_bytes() const {
  const at::Tensor& held = reduces_in_backward(stage_) ? grad_shard_ : flat_grad_;
  return held.defined() ? held.numel() * static_cast<int64_t>(held.element_size()) : 0;
}

}  // namespace dpzero::zero
