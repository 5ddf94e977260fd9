// src/zero/state.cpp — ZeroState: building the units and the plan, dispatching hook calls to
// units, the backward's final callback and the step.
#include "src/zero/state.h"

#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

namespace dpzero::zero {
namespace {

bool in_backward() { return torch::autograd::get_current_graph_task_id() != -1; }

}  // namespace

ZeroState::ZeroState(std::vector<UnitSpec> units, int64_t total_coordinates, ZeroConfig config,
                     c10::intrusive_ptr<c10d::ProcessGroup> process_group)
    : config_(std::move(config)), comm_(std::move(process_group)) {
  check_options(config_.optimizer);
  TORCH_CHECK(!units.empty(), "the model has no trainable parameters to shard");
  TORCH_CHECK(config_.alignment >= 1, "alignment must be >= 1, got ", config_.alignment);
  TORCH_CHECK(!config_.offload_params || config_.stage == Stage::k3,
              "offload_params keeps the owned parameter shards in host memory and needs ZeRO "
              "stage 3 (sharded parameters), got stage ", static_cast<int64_t>(config_.stage));
  FlatParam::check_param_dtype(config_.param_dtype);
  TORCH_CHECK(config_.reduce_dtype == at::kFloat || config_.reduce_dtype == config_.param_dtype,
              "reduce_dtype must be float32 or the param_dtype (", config_.param_dtype, "), got ",
              config_.reduce_dtype);
  std::vector<UnitLayout> layouts;
  for (const UnitSpec& unit : units) {
    TORCH_CHECK(!unit.params.empty(), "unit '", unit.name, "' has no trainable parameters");
    TORCH_CHECK(unit.params.size() == unit.global_offsets.size() &&
                    unit.params.size() == unit.param_names.size(),
                "unit '", unit.name, "': ", unit.params.size(), " parameters, ",
                unit.param_names.size(), " names and ", unit.global_offsets.size(),
                " global offsets");
    FlatParam::check_params(unit.params, unit.param_names);
    std::vector<ParamSpec> specs;
    for (size_t i = 0; i < unit.params.size(); ++i) {
      specs.push_back({unit.params[i].numel(), unit.global_offsets[i]});
    }
    layouts.emplace_back(std::move(specs), comm_.world_size(), config_.alignment,
                         config_.boundaries);
  }
  // Every check above runs before any parameter is touched: a failed construction leaves the
  // model as it was.
  plan_ = std::make_unique<ShardPlan>(layouts, total_coordinates);
  units_.reserve(units.size());
  FlatParamOptions flat_options;
  flat_options.shard_params = config_.stage == Stage::k3;
  flat_options.master_full = config_.stage == Stage::k0;
  flat_options.param_dtype = config_.param_dtype;
  flat_options.offload_master = config_.offload_optimizer || config_.offload_params;
  flat_options.offload_params = config_.offload_params;
  for (size_t u = 0; u < units.size(); ++u) {
    FlatParam flat(std::move(units[u].params), std::move(units[u].param_names), layouts[u], comm_,
                   config_.sync_module_states, flat_options);
    units_.emplace_back(units[u].name, std::move(flat), config_.stage,
                         make_shard_optimizer(config_.optimizer), config_.reduce_dtype);
  }
  note_param_bytes();
}

Unit& ZeroState::unit_at(int64_t unit) {
  TORCH_CHECK(unit >= 0 && unit < num_units(), "unit index must be in [0, ", num_units(),
              "), got ", unit);
  return units_[unit];
}

void ZeroState::pre_forward(int64_t unit) {
  unit_at(unit).pre_forward(comm_);
  if (!in_backward()) prefetch_after(unit, /*backward=*/false);  // not during recompute
  note_param_bytes();
}

void ZeroState::prefetch_after(int64_t unit, bool backward) {
  if (config_.stage != Stage::k3 || !config_.prefetch) return;
  if (!order_frozen_) {
    if (!backward &&
        std::find(forward_order_.begin(), forward_order_.end(), unit) == forward_order_.end()) {
      forward_order_.push_back(unit);
    }
    return;
  }
  const auto n = static_cast<int64_t>(forward_order_.size());
  if (n == 0) return;
  int64_t next = -1;
  if (!backward) {
    if (unit == forward_order_.front()) {
      forward_cursor_ = 0;
    } else if (forward_cursor_ >= 0 && forward_cursor_ + 1 < n &&
               forward_order_[forward_cursor_ + 1] == unit) {
      ++forward_cursor_;
    } else {
      return;  // not at the expected position: no guess
    }
    if (forward_cursor_ + 1 < n) next = forward_order_[forward_cursor_ + 1];
  } else {
    if (unit == forward_order_.back()) {
      backward_cursor_ = n - 1;
    } else if (backward_cursor_ > 0 && forward_order_[backward_cursor_ - 1] == unit) {
      --backward_cursor_;
    } else {
      return;
    }
    if (backward_cursor_ > 0) next = forward_order_[backward_cursor_ - 1];
  }
  if (next >= 0) units_[next].flat().unshard_async(comm_);
}

void ZeroState::post_forward(int64_t unit) { unit_at(unit).post_forward(in_backward()); }

void ZeroState::pre_backward(int64_t unit) {
  queue_finish_backward();
  unit_at(unit).pre_backward(comm_);
  prefetch_after(unit, /*backward=*/true);
  note_param_bytes();
}

void ZeroState::grad_ready(int64_t unit, int64_t param_index) {
  queue_finish_backward();
  Unit& g = unit_at(unit);
  const int64_t started = g.reductions_started();
  g.grad_ready(param_index, comm_);
  note_reduction(unit, started);
}

void ZeroState::add_unit_grad(int64_t unit, const at::Tensor& full, bool release_params,
                              bool donated) {
  queue_finish_backward();
  Unit& g = unit_at(unit);
  const int64_t started = g.reductions_started();
  g.add_grad(full, comm_, release_params, donated);
  note_reduction(unit, started);
}

at::Tensor ZeroState::grad_accumulator(int64_t unit) { return unit_at(unit).private_accumulator(); }

void ZeroState::set_private(bool on) {
  private_ = on;
  for (Unit& g : units_) g.set_private(on);
}

void ZeroState::release_params(int64_t unit) {
  unit_at(unit).flat().reshard();  // no-op unless parameters are sharded (stage 3)
}

void ZeroState::note_reduction(int64_t unit, int64_t started_before) {
  if (units_[unit].reductions_started() != started_before) {
    // Note [reduce-scatter overlap]: this unit started a reduction; fold the previous one so at
    // most two units' packed gradients are alive.
    if (reducing_unit_ >= 0 && reducing_unit_ != unit) units_[reducing_unit_].wait_reduce();
    reducing_unit_ = unit;
  }
}

void ZeroState::queue_finish_backward() {
  if (finish_queued_ || !in_backward()) return;
  torch::autograd::Engine::get_default_engine().queue_callback([this] { finish_backward(); });
  finish_queued_ = true;
}

void ZeroState::finish_backward() {
  finish_queued_ = false;
  for (Unit& g : units_) g.finish_backward(comm_);  // each folds its own reduction
  reducing_unit_ = -1;
}

void ZeroState::step() {
  TORCH_CHECK(!private_,
              "ZeroState.step(): this model is private (Note [only the private step updates a "
              "private model]); step its private optimizer, which charges the step and adds its "
              "noise. This would release the clipped gradients with neither");
  run_step(config_.grad_scale, nullptr);
}

void ZeroState::noisy_step(GradientNoise* noise, double grad_scale) {
  TORCH_CHECK(!private_,
              "ZeroState.noisy_step(): this model is private (Note [only the private step updates "
              "a private model]); step its private optimizer, which records and charges the step "
              "before its update");
  private_update(noise, grad_scale);
}

void ZeroState::private_update(GradientNoise* noise, double grad_scale) {
  TORCH_CHECK(std::isfinite(grad_scale) && grad_scale > 0.0,
              "grad_scale must be finite and > 0, got ", grad_scale);
  run_step(grad_scale, noise);
}

void ZeroState::run_step(double grad_scale, GradientNoise* noise) {
  finish_queued_ = false;  // no backward is running; a failed one may have left the flag set
  reducing_unit_ = -1;     // every unit folds its reduction in its step
  order_frozen_ = true;    // Note [stage-3 prefetch]
  forward_cursor_ = backward_cursor_ = -1;
  for (size_t u = 0; u < units_.size(); ++u)
    units_[u].step(comm_, grad_scale, noise, static_cast<int64_t>(u));
  ++steps_;
}

void ZeroState::zero_grad() {
  finish_queued_ = false;
  reducing_unit_ = -1;
  for (Unit& g : units_) g.zero_grad();
}

void ZeroState::watch_gathered(const FlatParam::Fingerprint& fingerprint) {
  for (Unit& g : units_) {
    if (g.flat().shards_params()) g.flat().watch_gathered(fingerprint);
  }
}

std::vector<at::Tensor> ZeroState::take_gathered_written() {
  std::vector<at::Tensor> out;
  out.reserve(units_.size());
  for (Unit& g : units_) out.push_back(g.flat().take_gathered_written());
  return out;
}

at::Tensor ZeroState::full_parameters(int64_t unit) {
  FlatParam& flat = unit_at(unit).flat();
  at::Tensor master = flat.master();  // a handle: all_gather takes it by reference
  if (master.numel() == flat.layout().padded_numel()) return master.detach().clone();
  // Gathered on the compute device: an offloaded master is on the host, which NCCL cannot use.
  at::Tensor source = master.device() == flat.device() ? master : master.to(flat.device());
  at::Tensor out = at::empty({flat.layout().padded_numel()}, source.options());
  comm_.all_gather(out, source);
  return out;
}

bool ZeroState::needs_grad_hooks() const {
  return std::any_of(units_.begin(), units_.end(),
                     [](const Unit& g) { return g.packs_grads(); });
}

void ZeroState::set_steps(int64_t steps) {
  TORCH_CHECK(steps >= 0, "steps must be >= 0, got ", steps);
  steps_ = steps;
}

void ZeroState::set_lr(double lr) {
  for (Unit& g : units_) g.optimizer().set_lr(lr);
  config_.optimizer.lr = lr;
}

void ZeroState::set_optimizer_options(const OptimizerOptions& options) {
  check_options_change(config_.optimizer, options);  // before any unit changes
  for (Unit& g : units_) g.optimizer().set_options(options);
  config_.optimizer = options;
}

std::vector<std::pair<std::string, at::Tensor>> ZeroState::gathered_state(int64_t unit) {
  Unit& g = unit_at(unit);
  const int64_t padded = g.flat().layout().padded_numel();
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& [name, slice] : g.owned_state()) {  // each [shard_numel], this rank's slice
    // Gathered on the compute device: an offloaded shard is on the host, which NCCL cannot use.
    at::Tensor source = slice.to(g.flat().device()).contiguous();
    at::Tensor full = at::empty({padded}, source.options());
    if (comm_.world_size() == 1) {
      full.copy_(source);
    } else {
      comm_.all_gather(full, source);
    }
    out.emplace_back(name, full);
  }
  return out;
}

void ZeroState::note_param_bytes() {
  int64_t held = 0;
  for (const Unit& g : units_) held += g.param_bytes();
  peak_param_bytes_ = std::max(peak_param_bytes_, held);
}

MemoryStats ZeroState::memory() const {
  MemoryStats stats;
  for (const Unit& g : units_) {
    stats.param_bytes += g.param_bytes();
    stats.grad_bytes += g.grad_bytes();
    stats.optimizer_bytes += g.optimizer_bytes();
    stats.master_bytes += g.master_bytes();
    stats.peak_grad_bytes += g.peak_grad_bytes();  // all units' buffers coexist before a step
    stats.peak_comm_bytes = std::max(stats.peak_comm_bytes, g.peak_comm_bytes());
    if (g.flat().master().is_cpu() && !g.flat().device().is_cpu()) {
      stats.host_bytes += g.master_bytes() + g.optimizer_bytes() + g.flat().host_param_bytes();
    }
  }
  stats.peak_param_bytes = std::max(peak_param_bytes_, stats.param_bytes);
  return stats;
}

}  // namespace dpzero::zero
