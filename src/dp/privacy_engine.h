// src/dp/privacy_engine.h — the C++ front door: a LibTorch program trains a torch::nn model
// privately, with no Python, on one rank or several (a c10d process group, e.g. Gloo).
//
//   auto model = std::make_shared<MyModel>();        // DP layers from modules.h
//   dp::PrivacyEngine engine(model, options, pg);    // ZeRO state, book, step, ledger
//   for (int64_t s = 0; s < steps; ++s) {
//     for (const dp::MicroBatch& mb : engine.sample()) {   // Poisson-sampled, this rank's share
//       engine.hand_out(mb);
//       auto loss = loss_fn(model->forward(x.index_select(0, mb.indices())), ...);
//       loss.backward();                                // clipped sums into the engine
//     }
//     engine.step();                                    // the private step's transaction
//   }
//   engine.epsilon(1e-5);
//
// What it does, as the Python PrivacyEngine does (python/dpzero/private/engine.py):
//   - the model: every trainable parameter must sit in a DP module (modules.h), else the
//     constructor refuses naming the module; parameters are numbered 0..D-1 in named_parameters()
//     order (tied ones once), the global coordinates the noise is drawn at, so a Python model with
//     the same parameters in the same order draws the same noise (design.md §2.5); units are
//     Note [default units]'s (src/zero/default_units.h, the rule Python's front door calls too;
//     ModuleList and ModuleDict are this door's containers);
//   - sampling: Poisson with rate q from the run's key or seed (privacy/poisson.h; Note [secure
//     by default] in privacy/entropy.h), each logical batch
//     split over the ranks and into micro-batches of at most max_physical_batch_size rows; a rank
//     with no rows runs one padding row (Note [padding batches] in book.h);
//   - clipping: flat, threshold C (privacy/clipping.h), one sample per row (Note [C++ batch
//     dimension] in modules.h);
//   - the run's rules (settings, the ranks' agreement, secure mode or the seed, the ledger, the
//     budget, clipping components): run.h, which Python's front door calls too (Note [one set of
//     rules]); what is here is only this door's: its options, torch::nn traversal, its limits;
//   - module state: buffers and frozen parameters held fixed, trained parameters written by the
//     step alone (state_guard.h: Note [state written from data]);
//   - the step: PrivateStep::take (private_step.h): agreement, budget, ledger, charge, noisy
//     update; the charge also goes to this engine's accountant, which epsilon() reads.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include "accounting/ledger.h"
#include "accounting/rdp.h"
#include "privacy/poisson.h"
#include "src/dp/book.h"
#include "src/dp/generators.h"
#include "src/dp/private_step.h"
#include "src/dp/run.h"
#include "src/dp/state_guard.h"
#include "src/zero/state.h"

namespace c10d {
class ProcessGroup;
}

namespace dpzero::dp {

// The run's settings (RunSettings, run.h: the names, defaults and rules both front doors share)
// and what only this front door has. Stages 0–2: stage 3 gathers in module hooks, which torch::nn
// in C++ does not have. Clipping is flat (RunSettings::clipping must stay "flat").
struct PrivacyOptions : RunSettings {
  zero::OptimizerOptions optimizer;  // SGD by default
  // Take the model's batch-first layout on trust: step() then runs without check_batch_first
  // (Note [C++ batch dimension]). Off: steps are refused until the check has passed.
  bool trust_batch_first = false;
};

// One micro-batch of a logical step on this rank: which dataset rows to feed.
struct MicroBatch {
  int64_t step = 0;   // the logical step t it was sampled for
  int64_t index = 0;  // its index among the step's micro-batches (all ranks run `count`)
  int64_t count = 0;
  int64_t logical_size = 0;    // the logical batch's realised size over all ranks (private)
  std::vector<int64_t> rows;   // dataset indices; a padding batch holds example 0
  bool padding = false;        // Note [padding batches]: its gradient is replaced by zeros
  at::Tensor indices() const;  // rows as an int64 tensor, for index_select
};

// What the DP modules of a model share with the engine that took it (modules.h).
struct EngineSession {
  std::shared_ptr<Book> book;
  bool handed_out = false;  // a micro-batch is handed out; DP layer calls may register
  // PrivacyEngine::check_batch_first runs: DP layer calls run plain, on detached copies of their
  // parameters, and leave their input and output here.
  struct ProbeCall {
    std::string layer;
    at::Tensor input, output;  // [B, ...]
  };
  bool probing = false;
  std::vector<ProbeCall> probe_calls;
};

class PrivacyEngine {
 public:
  // Takes `model` (the DP modules are bound to this engine; parameters become views of the ZeRO
  // engine's buffers, broadcast from rank 0). `process_group`: null for one rank. Throws
  // std::invalid_argument naming a bad option or a module whose trainable parameters are not in
  // a DP module; accounting::LedgerError for a ledger that cannot be opened (on every rank).
  PrivacyEngine(std::shared_ptr<torch::nn::Module> model, PrivacyOptions options,
                c10::intrusive_ptr<c10d::ProcessGroup> process_group = {});
  ~PrivacyEngine();
  PrivacyEngine(const PrivacyEngine&) = delete;
  PrivacyEngine& operator=(const PrivacyEngine&) = delete;

  // Note [C++ batch dimension]: checks that every DP layer call holds the examples on dim 0, one
  // per row, with nothing across rows. `loss_of(rows)` runs the model on the dataset's examples
  // `rows` ([P] int64) and returns their losses [P] (reduction none). Example 0 replaced by
  // another must leave every DP layer's input and output rows 1.. unchanged, bit for bit, and
  // example 0's loss alone must give every DP layer's output a gradient zero outside row 0.
  // Throws PrivacyError naming the first layer that fails, std::invalid_argument for a loss of
  // another shape. Needed once before the first step unless trust_batch_first.
  void check_batch_first(const std::function<at::Tensor(const at::Tensor& rows)>& loss_of);

  // This rank's micro-batches of the next logical step (Poisson, every rank the same count).
  // Throws std::logic_error while a logical batch is accumulated (step() or zero_grad() first).
  std::vector<MicroBatch> sample();
  // Makes `micro` the micro-batch whose forward comes next (its rows are what every DP layer
  // call must see on dim 0).
  void hand_out(const MicroBatch& micro);
  // The opt-out for a caller who Poisson-samples itself: `rows` examples of one micro-batch of a
  // logical batch of `logical_size` over all ranks; the step is recorded as "caller" sampling.
  void own_batch(int64_t rows, int64_t logical_size);

  // The private step (PrivateStep::take) for the logical batch handed out; throws as take does.
  // Refused (PrivacyError, every rank) when a micro-batch of it was not handed out and
  // back-propagated, the trainable parameters changed since the engine took the model, or its
  // state did (Note [state written from data] in state_guard.h: a buffer or frozen parameter
  // written, one added or removed, a trained parameter written outside the step).
  StepOutcome step();
  // Drops the logical batch accumulated so far (its gradients are never released).
  void zero_grad();

  // ε at `delta` of the steps charged so far, with the run's accountant (its get_epsilon).
  double epsilon(double delta) const;
  int64_t charges() const { return step_->charges(); }
  int64_t rank() const { return rank_; }
  int64_t world_size() const { return world_size_; }
  // The run's Philox seed; nullopt in secure mode (Note [secure by default]).
  std::optional<uint64_t> seed() const {
    return secure_ ? std::nullopt : std::optional<uint64_t>(seed_);
  }
  bool secure_mode() const { return secure_; }
  // The ZeRO state, to read (its step() would release gradients with no noise and no charge).
  const zero::ZeroState& zero() const { return *zero_; }
  // The trained parameter's current full value (a copy; all-gathers in stages 1–2: call on
  // every rank), looked up by its named_parameters() name.
  at::Tensor parameter(const std::string& name);

  // Before the model (or anything computed from it) is released, e.g. saved: throws PrivacyError
  // naming what of its state changed since the engine took it (the check every step makes, read
  // now; a forward outside the loop, such as an evaluation on training data, can write state).
  // A collective over several ranks (call it on every rank, as parameter()): every rank throws
  // if any rank's state changed, since one rank's write can reach what another releases (a
  // trained shard it owns, gathered by parameter()); the others name the ranks that found it.
  void verify_state() const;
  // Takes the model's state now as its own: all of it, the trained parameters' writes so far
  // included (`names` empty), or only the named buffers and frozen parameters (dotted, as
  // named_buffers() names them). For writes that hold nothing of the training data (a load, a
  // value computed from the released model). std::invalid_argument naming a name the model does
  // not have.
  void accept_state_change(const std::vector<std::string>& names = {});

 private:
  struct Param {
    std::string name;
    at::Tensor tensor;
    int64_t global = 0;  // its first global coordinate
    int64_t unit = 0;    // its unit, and its offset in the unit's flat buffer
    int64_t offset = 0;
  };
  void close_logical_batch();
  // Note [the model's own randomness] (generators.h): torch's generators from the run's secret.
  void reseed_generators(DrawPurpose purpose, int64_t step, int64_t index) const;

  std::shared_ptr<torch::nn::Module> model_;
  PrivacyOptions options_;
  int64_t rank_ = 0, world_size_ = 1;
  std::vector<Param> params_;      // trained, in global order
  std::vector<std::pair<at::Tensor, unsigned>> hooks_;  // each parameter's escape hook
  std::unique_ptr<zero::ZeroState> zero_;
  std::shared_ptr<EngineSession> session_;
  std::unique_ptr<StateGuard> state_;  // Note [state written from data]
  std::shared_ptr<accounting::Ledger> ledger_;  // rank 0's
  std::unique_ptr<PrivateStep> step_;
  // The step composes each charge into it (private_step.h); epsilon() reads it.
  std::shared_ptr<accounting::Accountant> accountant_;
  uint64_t seed_ = 0;
  bool secure_ = false;  // Note [secure by default]
  privacy::SamplerSource sampler_;
  std::vector<MicroBatch> schedule_;  // the last sample()'s micro-batches, as drawn
  int64_t next_step_ = 0;             // the sampler's next logical step (never one already charged)
  // The logical batch handed out: its step, size, micro-batch count and how many were handed out.
  std::optional<MicroBatch> current_;
  int64_t handed_ = 0;
  bool caller_sampled_ = false;
  bool batch_first_checked_ = false;
};

}  // namespace dpzero::dp
