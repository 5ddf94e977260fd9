// src/zero/state.h — the ZeRO state of one model: its units (Unit), the shard plan that
// checks they cover the model's global coordinates, the entry points of the module and gradient
// hooks, and the step (design.md §2; stages in stage.h).
//
// One training step, top to bottom (non-private path):
//   forward   — stage 3: pre_forward(u) gathers unit u, post_forward(u) frees it.
//   backward  — stage 3: pre_backward(u) gathers u again; stages 2–3: grad_ready(u, i) for each
//               parameter, and when u is complete its gradient is reduce-scattered (and, stage 3,
//               u freed); finish_backward runs as the backward's final callback.
//   step()    — every unit in plan order: reduce (stages 0–1), scale by grad_scale, optimizer on
//               the owned shard, all-gather parameters (stages 1–2), zero gradients.
//
// Note [collective order]
// ~~~~~~~~~~~~~~~~~~~~~~~
// c10d matches collectives by the order each rank issues them, so every rank must issue the same
// sequence. The engine issues them from: construction and step() (units in plan order), forward
// hooks (module execution order), gradient hooks (autograd execution order) and finish_backward
// (plan order). All ranks run the same model, so these orders agree as long as every rank runs
// the same modules and uses the same parameters in each forward/backward — the same requirement
// DistributedDataParallel has without find_unused_parameters. Data-dependent control flow that
// skips a unit on some ranks only is not supported.
//
// Note [stage-3 prefetch]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Stage 3 gathers a unit just before it runs; without prefetch the compute waits for every
// gather. With `prefetch`, the forward records the order in which units start (first forward
// after construction, frozen at the first step()), and from then on, when unit order[i] starts
// its forward the gather of order[i+1] is started without waiting (FlatParam::unshard_async),
// and when order[i] starts its backward the gather of order[i-1] is — backward visits units in
// reverse. The collective runs on the backend's stream (NCCL) or threads (Gloo) while the
// current unit computes; the next unit's own pre-hook waits for it. Only a unit that starts at
// the expected position triggers a prefetch (a tied head re-entering the embedding's unit does
// not), and a wrong guess is harmless: a prefetched unit that does not run is freed with the
// others at the end of backward, or by step(). All ranks run the same hooks in the same order,
// so they issue the same prefetches (Note [collective order]). Cost: one more unit gathered at a
// time, as FSDP2's default prefetch of one.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "src/comm/collectives.h"
#include "src/zero/optim.h"
#include "src/zero/unit.h"
#include "src/zero/gradient_noise.h"
#include "src/zero/shard_plan.h"
#include "src/zero/stage.h"

namespace dpzero::dp {
class PrivateStep;
}

namespace dpzero::zero {

// One unit as the caller (Python's model traversal) found it.
struct UnitSpec {
  std::string name;                     // module name ("" for the root unit)
  std::vector<at::Tensor> params;       // trainable, canonical order, tied ones once
  std::vector<std::string> param_names; // canonical names (named_parameters())
  std::vector<int64_t> global_offsets;  // global coordinate of each parameter's first element
};

struct ZeroConfig {
  Stage stage = Stage::k0;
  OptimizerOptions optimizer;
  int64_t alignment = 4;          // flat offset alignment, in elements (UnitLayout)
  ShardBoundaries boundaries = ShardBoundaries::kEven;  // Note [ragged plans]
  double grad_scale = 1.0;        // applied to the reduced gradient before the optimizer
  bool sync_module_states = true; // broadcast rank 0's parameters at construction
  bool prefetch = true;           // stage 3: Note [stage-3 prefetch]
  // Mixed precision (Note [master weights] in flat_param.h): the dtype parameters are computed
  // in, and the dtype gradients are reduced and accumulated in. fp32 master weights always.
  at::ScalarType param_dtype = at::kFloat;
  at::ScalarType reduce_dtype = at::kFloat;
  // Keep the fp32 master and the optimizer state on the host (Note [master weights]).
  bool offload_optimizer = false;
  // Stage 3: keep the owned parameter shards on the host too (Note [parameter offload] in
  // flat_param.h); implies offload_optimizer.
  bool offload_params = false;
};

// Bytes this rank holds now (storage actually allocated), and two peaks.
struct MemoryStats {
  int64_t param_bytes = 0;       // parameter storage: full buffers held now, + owned shards in
                                 // stage 3 (Note [master weights]: the master when it is fp32)
  int64_t master_bytes = 0;      // separate fp32 master values under mixed precision, else 0
  int64_t grad_bytes = 0;        // gradient buffers held now (full in 0–1; shard in 2–3, only
                                 // between a step's first reduction and the step)
  int64_t peak_grad_bytes = 0;   // most gradient-buffer bytes held at once since construction
  int64_t optimizer_bytes = 0;   // optimizer state
  int64_t peak_param_bytes = 0;  // most parameter bytes held at once since construction
  int64_t peak_comm_bytes = 0;   // largest short-lived collective/cast buffer set of one unit
  int64_t host_bytes = 0;        // of master, optimizer state and (parameter offload) owned
                                 // shards, bytes in host memory while the parameters are
                                 // computed on an accelerator
};

class ZeroState {
 public:
  // Builds a UnitLayout per unit and a ShardPlan over all of them (which throws
  // std::invalid_argument if the units do not cover [0, total_coordinates) exactly once), then
  // flattens each unit (FlatParam), broadcasting rank 0's values with sync_module_states.
  ZeroState(std::vector<UnitSpec> units, int64_t total_coordinates, ZeroConfig config,
            c10::intrusive_ptr<c10d::ProcessGroup> process_group);

  // Hook entry points; `unit` indexes units in plan order.
  void pre_forward(int64_t unit);
  void post_forward(int64_t unit);
  void pre_backward(int64_t unit);
  void grad_ready(int64_t unit, int64_t param_index);
  // The private path (Note [private gradients] in unit.h): unit `unit`'s whole gradient of
  // this backward, [padded_numel], computed outside autograd. Reduced like grad_ready's packed
  // gradient, under the same overlap cap (Note [reduce-scatter overlap]).
  // `release_params`: stage 3 may free the unit's gathered parameters now (else at the end of the
  // backward). `donated`: the caller will neither read nor write `full` again, so an
  // asynchronous reduction may use it without a copy.
  void add_unit_grad(int64_t unit, const at::Tensor& full, bool release_params = true,
                     bool donated = false);
  // Note [private accumulator] in unit.h: unit `unit`'s float32 gradient buffer
  // ([padded_numel]) in stages 0–1, into which the private path adds clipped sums directly (then
  // never calling add_unit_grad for the unit); undefined where add_unit_grad must be used.
  at::Tensor grad_accumulator(int64_t unit);
  // Note [private gradients] in unit.h: on (the private path) every unit takes its
  // gradient only from add_unit_grad / grad_accumulator and attaches no .grad views; off restores
  // the views.
  void set_private(bool on);
  // Stage 3: frees unit `unit`'s gathered parameters now — the caller knows no autograd node of
  // this backward still reads them (the private path: every DP layer call using them has run its
  // backward, Note [early release] in src/dp/book.h). A later gather hook may
  // gather it again. No-op in stages 0–2.
  void release_params(int64_t unit);
  // Note [writes to a gathered unit] in flat_param.h: every stage-3 unit's gathered copies are
  // fingerprinted with `fingerprint` (empty: the watch stops; a no-op in stages 0–2), and
  // take_gathered_written() hands over one 0-dim device bool per unit, resetting them.
  void watch_gathered(const FlatParam::Fingerprint& fingerprint);
  std::vector<at::Tensor> take_gathered_written();

  // Note [only the private step updates a private model]: with set_private(true) the update is
  // the private step's (dp::PrivateStep, which records the step in the ledger, charges it and
  // draws its noise first); step() and noisy_step() are refused there, since either would
  // release the clipped sums without the charge (and step() without noise).
  void step();
  // The private step's engine part (design.md §2 steps 5–7 minus the ledger, which the caller
  // writes before calling this): every unit's reduced gradient gets `noise` (src/dp/step_noise.h
  // draws it on exactly the global coordinates this rank updates; null: none), is scaled by
  // `grad_scale` (1 / (q·N) for DP-SGD) instead of config().grad_scale, and the optimizer runs.
  void noisy_step(GradientNoise* noise, double grad_scale);
  void zero_grad();

  // Unit `unit`'s full flat fp32 master values ([padded_numel], a copy); all-gathers in stages
  // 1–3 when the master is sharded, so every rank must call it (Note [collective order]).
  at::Tensor full_parameters(int64_t unit);

  const ShardPlan& plan() const { return *plan_; }
  const comm::Collectives& comm() const { return comm_; }
  const ZeroConfig& config() const { return config_; }
  int64_t num_units() const { return static_cast<int64_t>(units_.size()); }
  // Whether grad_ready must be called for every parameter (Note [gradient buffers]).
  bool needs_grad_hooks() const;
  Unit& unit_at(int64_t unit);
  int64_t steps() const { return steps_; }
  // A checkpoint's step counter (src/checkpoint/); the units' own state is restored through
  // unit_at(u).load_state.
  void set_steps(int64_t steps);
  void set_lr(double lr);
  // ShardOptimizer::set_options on every unit (checked once, before any unit changes).
  void set_optimizer_options(const OptimizerOptions& options);
  // Note [weight decay runs] in optim.h: unit `unit`'s parameter i gets no weight decay when
  // exempt[i] (one flag per parameter, in the unit's order).
  void set_decay_exempt(int64_t unit, const std::vector<bool>& exempt) {
    unit_at(unit).set_decay_exempt(exempt);
  }
  // Unit `unit`'s owned_state() entries ("param" and the optimizer's state), each gathered over
  // the ranks to the whole flat layout [padded_numel] (a copy; all-gathers when W > 1: call on
  // every rank). The step count is unit_at(unit).optimizer().steps().
  std::vector<std::pair<std::string, at::Tensor>> gathered_state(int64_t unit);
  MemoryStats memory() const;

 private:
  friend class dp::PrivateStep;  // Note [only the private step updates a private model]
  void private_update(GradientNoise* noise, double grad_scale);
  bool private_ = false;
  // Stages 2–3 (Note [gradient accumulation], [stage-3 gathers]): reduce incomplete units and
  // free gathered ones at the end of a backward pass.
  void finish_backward();
  // Installs finish_backward as the final callback of the backward pass now running (once).
  void queue_finish_backward();
  void note_param_bytes();
  // Note [reduce-scatter overlap]: after unit `unit` took a gradient, folds the previous unit's
  // reduction if `unit` started a new one (its count was `started_before`).
  void note_reduction(int64_t unit, int64_t started_before);
  // step() and noisy_step(): every unit's step with this scale and optional noise.
  void run_step(double grad_scale, GradientNoise* noise);
  // Note [stage-3 prefetch]: records the forward order, or starts the next unit's gather.
  void prefetch_after(int64_t unit, bool backward);

  ZeroConfig config_;
  comm::Collectives comm_;
  std::unique_ptr<ShardPlan> plan_;
  std::vector<Unit> units_;
  int64_t steps_ = 0;
  bool finish_queued_ = false;  // finish_backward is installed for the backward now running
  int64_t peak_param_bytes_ = 0;
  // Note [stage-3 prefetch]: units in the order their forwards started; frozen at the first step.
  std::vector<int64_t> forward_order_;
  bool order_frozen_ = false;
  int64_t forward_cursor_ = -1;   // position in forward_order_ of the unit forward last started
  // Note [reduce-scatter overlap]: the unit whose reduce-scatter started last and may be in
  // flight (-1: none).
  int64_t reducing_unit_ = -1;
  int64_t backward_cursor_ = -1;  // position of the unit whose backward last started
};

}  // namespace dpzero::zero
