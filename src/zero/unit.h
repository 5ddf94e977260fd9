// src/zero/unit.h — one unit under a ZeRO stage (stage.h): when its parameters are
// gathered and freed, when and how its gradient is reduced, and its optimizer step on the owned
// shard (design.md §2 steps 2, 4 and 7).
//
// Note [gradient buffers]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Stages 0–1 keep one persistent full flat gradient per unit (flat_grad_, [padded_numel]) and make
// every parameter's .grad a view of it (FlatParam::attach_grad_views), so autograd's
// AccumulateGrad adds each backward's gradient into it in place and nothing is reduced until
// step(). Stages 2–3 keep only the owned shard (grad_shard_, [shard_numel]), and only from the
// first reduction of a step until the step consumes it: between steps no gradient memory is
// held, so it does not add to the forward's activation peak (torch's zero_grad(set_to_none=True)
// does the same for .grad). The per-parameter
// .grad that autograd allocates lives until the unit's last parameter gradient of that backward
// arrives (post-accumulate-grad hooks → grad_ready); then the unit's gradient is packed into one
// flat buffer, reduce-scattered, added into grad_shard_, and every piece of the full unit gradient
// is freed, so no more than one unit's full gradient is alive per unit whose backward is running.
//
// Under mixed precision (Note [master weights] in flat_param.h) autograd's .grad has the
// parameters' 16-bit dtype, but gradients are reduced and accumulated in reduce_dtype (fp32 by
// default, as FSDP2's MixedPrecisionPolicy and DeepSpeed do). Stages 0–1 then cannot use views
// (a .grad must have its parameter's dtype): they take the stages 2–3 path without the
// reduce-scatter — the unit's gradient is packed in reduce_dtype when its backward completes and
// added into flat_grad_ (packs_grads()). With reduce_dtype equal to the parameters' dtype the
// views path stays, and gradients accumulate in that dtype (ZeRO's 2Ψ gradient term).
//
// Note [reduce-scatter overlap]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Stages 2–3 start a unit's reduce-scatter when its gradient is complete and do not wait for it:
// the backward of the next unit runs while the collective is in flight (on Gloo's threads or
// NCCL's stream). At most one reduction per unit is in flight; it is folded into grad_shard_
// (written directly for the step's first reduction, added for later ones) before the unit's next
// reduction, at the end of the backward (finish_backward), and before step() or zero_grad() use or
// drop the shard — so gradients are summed in the same order as with blocking collectives and
// results are bit-identical. The packed gradient stays alive until the collective is done, so
// ZeroState lets at most two units have a reduction in flight: when a unit starts one, the unit
// that started the previous one is folded first (ZeroState::grad_ready). Otherwise every unit's
// packed full gradient would live until the end of backward — the whole model's gradient, which
// stages 2–3 exist not to hold.
//
// Note [gradient accumulation]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Gradients of micro-batches sum. Stages 0–1: AccumulateGrad sums in place, one reduction per
// step. Stages 2–3: each backward reduce-scatters its own unit gradients and adds them into
// grad_shard_; reduce-scatter is linear, so the sum of the reductions is the reduction of the sum
// (up to fp32 summation order). A unit some of whose parameters got no gradient in a backward is
// reduced at the end of that backward with zeros in their place (finish_backward); by linearity
// a unit reduced in several parts (e.g. around a reentrant checkpoint's inner backward) still sums
// to the right gradient. step() consumes the accumulated gradient: it scales the reduced shard by
// grad_scale (Note [sum collectives]), runs the optimizer and zeroes every gradient buffer.
//
// Note [stage-3 gathers]
// ~~~~~~~~~~~~~~~~~~~~~~
// A stage-3 unit is gathered (FlatParam::unshard) by a forward pre-hook of its module, and freed
// by the matching forward hook — unless that forward runs inside a backward pass, which is how
// activation recompute runs (torch.utils.checkpoint, reentrant or not): recomputed forward nodes
// and their saved tensors are consumed by the backward that is running, so the unit stays gathered
// until its gradient is reduced. Before the unit's backward it is gathered again by a gradient
// hook on each of its forward outputs that requires grad (the hook fires when the gradient w.r.t.
// that output is complete, i.e. before any node of the unit's backward runs), and it is freed
// right after its gradient has been reduced — by then every autograd node that uses its
// parameters has run, since a parameter's AccumulateGrad waits for all of them. Units still
// gathered at the end of a backward (no gradient reached them) are freed by finish_backward, and
// all units are freed after step() (the owned shards changed, so any gathered copy is stale).
// Note [checkpoint slices]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// What a rank writes to a checkpoint is the coordinates it owns, [rank·m, (rank+1)·m) of the
// unit's flat layout (m = shard_numel), in every stage: stage-0 ranks hold every coordinate but
// write only their slice, so the files of all ranks hold each coordinate exactly once. Entries
// are "param" (the fp32 master values) and the optimizer's state entries, each [m] fp32, plus the
// optimizer's step count. Loading is the reverse over the coordinates a rank keeps
// (kept_range()): its owned shard in stages 1–3, the whole layout in stage 0; the caller gathers
// them from the old files by parameter name, which is what lets a checkpoint written at one world
// size and stage load at another (src/checkpoint/).
//
// Note [private gradients]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Under DP (python/dpzero/private/) autograd computes no weight gradient of a DP layer: the layer's
// backward hands its input and output gradient to the clipping code, which forms the clipped sum
// sum_i c_i g_i per parameter (kernels/) and packs a unit's parameters into one fp32 flat tensor.
// add_grad takes that tensor where take_grads would have packed autograd's .grad: the same
// reduction, the same overlap cap, the same accumulation over micro-batches. Clipped sums stay in
// fp32 up to the reduction (design.md §4); they are cast only if reduce_dtype is 16-bit.
// Under DP the engine is switched to private mode (set_private): no .grad views in stages 0–1,
// since step() would copy any .grad found there into the buffer (a .grad set by the caller
// released unclipped; one set to None by model.zero_grad() zeroing the clipped sums), and the
// stage 0–1 buffer is zeroed only when written since its last zeroing.
//
// Note [private accumulator]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// In stages 0–1 add_grad only adds `full` into flat_grad_, so packing a unit first costs a
// unit-sized zero fill, the packed tensor and one more pass over it per micro-batch (with
// the clipping ops' own output tensors, three passes over every trainable parameter: measured
// in experiments/results/private.md). private_accumulator() hands the clipping code flat_grad_
// itself instead, and the clipped sums are added straight into the parameters' slots (Note
// [accumulating clipped sums] in kernels/per_sample/linear.h): the same additions into the same
// buffer the step reduces. It is defined only where that holds — stages 0–1 with a float32
// flat_grad_ (a 16-bit reduce_dtype would round each addition; add_grad casts the whole sum
// once) — and the caller then never calls add_grad for the unit. The padding stays zero: the
// caller writes parameter slots only.
//
// Forward-output gradient hooks were chosen over module full-backward-pre-hooks because they
// need no wrapping of the module's outputs (in-place use of outputs keeps working) and apply to
// any output structure.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "src/comm/collectives.h"
#include "src/zero/flat_param.h"
#include "src/zero/optim.h"
#include "src/zero/gradient_noise.h"
#include "src/zero/stage.h"

namespace dpzero::zero {

class Unit {
 public:
  // reduce_dtype: the dtype gradients are reduced and accumulated in (kFloat, kBFloat16, kHalf).
  Unit(std::string name, FlatParam flat, Stage stage,
             std::unique_ptr<ShardOptimizer> optimizer, at::ScalarType reduce_dtype);

  const std::string& name() const { return name_; }
  FlatParam& flat() { return flat_; }
  const FlatParam& flat() const { return flat_; }
  const ShardOptimizer& optimizer() const { return *optimizer_; }
  ShardOptimizer& optimizer() { return *optimizer_; }

  // Note [stage-3 gathers]; no-ops below stage 3.
  void pre_forward(const comm::Collectives& comm) { flat_.unshard(comm); }
  void post_forward(bool in_backward);
  void pre_backward(const comm::Collectives& comm) { flat_.unshard(comm); }

  // Whether gradients are taken per backward through grad_ready (stages 2–3, and stages 0–1
  // when reduce_dtype differs from the parameters' dtype) rather than accumulated by autograd
  // into views (Note [gradient buffers]).
  bool packs_grads() const { return packs_grads_; }
  // packs_grads(): parameter `index` has its final gradient of this backward (post-accumulate-grad
  // hook). When every parameter of the unit has, reduces (stages 2–3) or accumulates (stages 0–1)
  // the unit's gradient (Note [gradient buffers]) and, in stage 3, frees the gathered parameters.
  void grad_ready(int64_t index, const comm::Collectives& comm);
  // The private path (Note [private gradients]): `full` ([padded_numel], any floating dtype, on
  // the parameters' device, zeros in the padding) is this backward's whole gradient of the unit,
  // computed outside autograd; it is reduced (stages 2–3) or accumulated (stages 0–1) exactly as a
  // packed autograd gradient would be. Any stage, with or without packs_grads(). `release`:
  // stage 3 frees the gathered parameters now (the caller knows no backward node still reads
  // them); otherwise the end of the backward does (finish_backward).
  // `donated`: the caller will not touch `full` again, so the reduction may keep it instead of a
  // copy.
  void add_grad(const at::Tensor& full, const comm::Collectives& comm, bool release,
                bool donated = false);
  // Note [private accumulator]: flat_grad_ ([padded_numel] float32, the buffer step() reduces),
  // into which the private path may add this unit's clipped sums directly instead of calling
  // add_grad; undefined in stages 2–3 and when flat_grad_ is not float32. Marks the buffer as
  // written (zero_grad zeroes it).
  at::Tensor private_accumulator();
  // Note [private gradients]: under DP (on) the unit's gradient arrives only through add_grad or
  // the private accumulator. No .grad views are attached (off again restores them), so nothing
  // written to a parameter's .grad reaches the step, and setting it to None (model.zero_grad())
  // cannot wipe the clipped sums: with views, step() copies each .grad into the buffer and zeroes
  // the slots of those that are None. And zero_grad() zeroes the stage 0–1 buffer only if
  // something wrote it since it was last zeroed (with views autograd may write at any time).
  void set_private(bool on);
  // End of a backward pass: takes the gradient of a unit that got some but not all of it, then
  // (stage 3) frees the gathered parameters.
  void finish_backward(const comm::Collectives& comm);

  // Reduces what is not reduced yet (stages 0–1), adds `noise` (when given) to the reduced
  // gradient this rank holds, scales by grad_scale, updates the owned shard, all-gathers
  // parameters (stages 1–2) or frees them (stage 3), zeroes the gradients.
  // `index`: this unit's index in the ZeRO state (what `noise` keys its state by).
  void step(const comm::Collectives& comm, double grad_scale, GradientNoise* noise,
            int64_t index);
  // Drops all accumulated gradient (Note [gradient accumulation]).
  void zero_grad();
  // Note [reduce-scatter overlap]: waits for this unit's reduction in flight and folds it into
  // grad_shard_; no-op when none is.
  void wait_reduce();
  // Whether a reduction of this unit is in flight.
  bool reducing() const { return pending_.has_value(); }
  // How many reductions this unit has started since construction.
  int64_t reductions_started() const { return reductions_started_; }

  // Note [checkpoint slices]: the owned coordinates' entries ("param" first), each [shard_numel]
  // fp32 (views, not copies: write them before the next step).
  std::vector<std::pair<std::string, at::Tensor>> owned_state() const;
  // The flat coordinates [begin, end) this rank keeps master values and optimizer state for.
  std::pair<int64_t, int64_t> kept_range() const;
  // Note [weight decay runs] in optim.h: parameter i (layout order) gets no weight decay when
  // exempt[i]; sets the optimizer's decayed runs over kept_range(). exempt: one flag per
  // parameter; TORCH_CHECK naming a count mismatch.
  void set_decay_exempt(const std::vector<bool>& exempt);
  // Note [checkpoint slices]: restores "param" and the optimizer state over kept_range() (each
  // entry [end - begin]) and the optimizer's step count, then makes the parameters consistent
  // (stages 1–2 all-gather: a collective; stage 3 leaves them freed) and drops all gradients.
  void load_state(const std::vector<std::pair<std::string, at::Tensor>>& values, int64_t steps,
                  const comm::Collectives& comm);

  // The gradient of the owned coordinates reduced so far ([shard_numel]; stages 2–3 only;
  // undefined before the first reduction of a step).
  // Waits for a reduction in flight first (Note [reduce-scatter overlap]).
  const at::Tensor& grad_shard() {
    wait_reduce();
    return grad_shard_;
  }

  // Bytes held now: parameter storage (FlatParam::param_bytes), persistent gradient buffers,
  // optimizer state.
  int64_t param_bytes() const { return flat_.param_bytes(); }
  int64_t master_bytes() const { return flat_.master_bytes(); }
  int64_t grad_bytes() const;
  // Most bytes of gradient buffers this unit held at once since construction.
  int64_t peak_grad_bytes() const { return peak_grad_bytes_; }
  int64_t optimizer_bytes() const { return optimizer_->state_bytes(); }
  // The most bytes of short-lived buffers this unit allocated at once for a collective or a dtype
  // change (packed unit gradient, reduce-scatter output, all-gather input, fp32 gradient copy).
  int64_t peak_comm_bytes() const { return peak_comm_bytes_; }
  at::ScalarType reduce_dtype() const { return reduce_dtype_; }

 private:
  // Packs the unit's gradient of this backward and reduce-scatters (stages 2–3) or adds
  // (stages 0–1) it into the persistent buffer.
  void take_grads(const comm::Collectives& comm);
  // take_grads and add_grad: reduce-scatter (stages 2–3) or add (stages 0–1) one packed
  // [padded_numel] reduce_dtype gradient.
  void reduce_packed(at::Tensor full, const comm::Collectives& comm);
  void note_comm_bytes(int64_t bytes) { peak_comm_bytes_ = std::max(peak_comm_bytes_, bytes); }

  // Stages 2–3: the reduce-scatter in flight (Note [reduce-scatter overlap]).
  struct PendingReduce {
    c10::intrusive_ptr<c10d::Work> work;  // null when it completed at once (W = 1)
    at::Tensor full;                      // [padded_numel] the packed gradient, kept alive
    at::Tensor reduced;  // [shard_numel] its result when grad_shard_ already held a reduction
                         // (added on completion); undefined when written into grad_shard_
  };
  std::optional<PendingReduce> pending_;
  int64_t reductions_started_ = 0;

  std::string name_;
  FlatParam flat_;
  Stage stage_;
  std::unique_ptr<ShardOptimizer> optimizer_;
  at::ScalarType reduce_dtype_;
  bool packs_grads_;
  int64_t peak_comm_bytes_ = 0;
  int64_t peak_grad_bytes_ = 0;
  // [padded_numel] reduce_dtype, stages 0–1: the parameters' .grad are views of it, or packed
  // gradients are added into it (Note [gradient buffers]).
  at::Tensor flat_grad_;
  bool private_ = false;    // Note [private gradients]: no .grad views, gradients only by add_grad
  bool grad_dirty_ = true;  // flat_grad_ may be nonzero (stages 0-1)
  // [shard_numel] reduce_dtype, stages 2–3: Σ of this step's reduce-scattered unit gradients;
  // allocated by the first reduction of a step, released by step() and zero_grad().
  at::Tensor grad_shard_;
  // packs_grads(): which parameters have their gradient in the backward now running.
  std::vector<char> ready_;
  int64_t ready_count_ = 0;
};

}  // namespace dpzero::zero
