// src/zero/optim.h — optimizers that update one flat fp32 shard in place (design.md §2 step 7).
//
// Note [shard optimizers match torch.optim]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Each optimizer applies, elementwise, the same tensor operations in the same order with the same
// scalars (computed in double, as Python computes them) as torch.optim's single-tensor path
// (`_single_tensor_sgd`, `_single_tensor_adam` in torch 2.11), so a shard updated here equals the
// same coordinates updated by torch.optim up to the gradient's own summation order. Elementwise
// updates do not care where a shard starts or ends, which is what makes sharding them exact. The
// shard is the fp32 master copy of the coordinates a rank owns; its state (momentum, first and
// second moments) covers exactly those coordinates, padding included (padding has zero gradient
// and zero value, so every update leaves it zero).
//
// Differences from torch.optim, by design: there are no parameter groups (one set of
// hyperparameters for all coordinates, except that weight decay may exempt some: Note [weight
// decay runs]), and a coordinate whose parameter got no gradient is updated with a zero gradient
// (weight decay and momentum still act on it), where torch.optim skips a parameter whose .grad
// is None.
//
// Note [weight decay runs]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// The usual fine-tuning recipe (transformers.Trainer, most Opacus and HF scripts) gives torch.optim
// two parameter groups that differ only in weight_decay: biases and norm weights get none. A
// shard holds coordinates of several parameters, so the exemption is a set of coordinate runs:
// set_decayed_runs lists the [begin, end) ranges of the shard that weight decay acts on (each a
// decayed parameter's coordinates, or the part of it the shard holds; adjacent ones merged), and
// nothing else decays. On each run the optimizer applies torch's own decay op to a view of the
// shard (grad.add(param, wd) for SGD and Adam, param.mul_(1 - lr·wd) for AdamW), so a decayed
// coordinate is updated as torch.optim's decayed group updates it and an exempt one as its
// weight_decay=0 group does. Without runs every coordinate decays (torch's single group).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace dpzero::zero {

enum class OptimizerKind { kSgd, kAdam, kAdamW };

// Parses "sgd", "adam" or "adamw"; TORCH_CHECK error naming any other value.
OptimizerKind parse_optimizer_kind(const std::string& name);

// torch.optim's hyperparameters; which ones apply depends on the kind.
struct OptimizerOptions {
  OptimizerKind kind = OptimizerKind::kSgd;
  double lr = 1e-3;
  // SGD, Adam: added to the gradient; AdamW: decoupled (p *= 1 - lr·wd)
  double weight_decay = 0.0;
  bool maximize = false;
  // SGD
  double momentum = 0.0;
  double dampening = 0.0;
  bool nesterov = false;
  // Adam, AdamW
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  bool amsgrad = false;
};

// Checks the ranges torch.optim checks (lr >= 0, 0 <= beta < 1, eps >= 0, weight_decay >= 0,
// momentum >= 0, nesterov needs momentum > 0 and dampening 0); errors name the bad value.
void check_options(const OptimizerOptions& options);
// check_options(next), and that next keeps current's kind and amsgrad (fixed for an optimizer's
// life: amsgrad keeps a state entry the others lack); errors name the changed value.
void check_options_change(const OptimizerOptions& current, const OptimizerOptions& next);

// The optimizer state of one flat shard. State tensors are created on the first step, as
// torch.optim creates them (SGD's momentum buffer starts as a copy of the first gradient).
class ShardOptimizer {
 public:
  virtual ~ShardOptimizer() = default;

  // param: [n] fp32, the owned shard (master weights), updated in place.
  // grad:  [n] fp32, the reduced and scaled gradient of the same coordinates (read only).
  virtual void step(at::Tensor& param, const at::Tensor& grad) = 0;

  // Named state tensors (each [n]) for checkpoints and tests; empty before the first step.
  virtual std::vector<std::pair<std::string, at::Tensor>> state() const = 0;
  // Replaces the state with `state` (entries named as state() names them, each [n] fp32 on the
  // shard's device) and the step count, as a checkpoint restores it. Throws naming a missing,
  // unexpected or mis-shaped entry: a resumed run must continue exactly, not from fresh moments.
  virtual void load_state(const std::vector<std::pair<std::string, at::Tensor>>& state,
                          int64_t steps, int64_t n) = 0;
  // How many steps this shard has taken.
  int64_t steps() const { return steps_; }
  // Bytes of the state tensors held now.
  int64_t state_bytes() const;

  const OptimizerOptions& options() const { return options_; }
  void set_lr(double lr);
  // Note [weight decay runs]: weight decay acts only on these [begin, end) ranges of the shard
  // (sorted, disjoint, within [0, n)); nullopt: on every coordinate. Checked at the next step.
  void set_decayed_runs(std::optional<std::vector<std::pair<int64_t, int64_t>>> runs);
  const std::optional<std::vector<std::pair<int64_t, int64_t>>>& decayed_runs() const {
    return decayed_runs_;
  }
  // New hyperparameters for the next steps (an LR scheduler cycling momentum or betas, a
  // param_groups entry changed by hand), checked by check_options_change.
  void set_options(const OptimizerOptions& options);

 protected:
  explicit ShardOptimizer(OptimizerOptions options);
  // For load_state: checks that `state` has exactly the entries `expected`, each [n], and
  // returns them in that order (copies, contiguous, fp32).
  static std::vector<at::Tensor> take_entries(
      const std::vector<std::pair<std::string, at::Tensor>>& state,
      const std::vector<std::string>& expected, int64_t n, const char* optimizer);
  // torch's coupled decay (SGD, Adam): grad + weight_decay·param on the decayed coordinates,
  // grad elsewhere; a new tensor when anything decays, else `grad` itself. param, grad: [n].
  at::Tensor coupled_decay(const at::Tensor& grad, const at::Tensor& param) const;
  // AdamW's decoupled decay: param *= 1 - lr·weight_decay on the decayed coordinates. param: [n].
  void decoupled_decay(at::Tensor& param) const;

  OptimizerOptions options_;
  int64_t steps_ = 0;

 private:
  // Checks that the runs lie sorted and disjoint within [0, n); errors name the bad run.
  void check_runs(int64_t n) const;
  std::optional<std::vector<std::pair<int64_t, int64_t>>> decayed_runs_;
};

std::unique_ptr<ShardOptimizer> make_shard_optimizer(const OptimizerOptions& options);

// Implementations (sgd.cpp, adam.cpp).
std::unique_ptr<ShardOptimizer> make_sgd(const OptimizerOptions& options);
std::unique_ptr<ShardOptimizer> make_adam(const OptimizerOptions& options);

}  // namespace dpzero::zero
