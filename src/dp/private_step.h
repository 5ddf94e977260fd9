// src/dp/private_step.h — one private step's transaction, on every rank (design.md §2 steps 5–7):
// after the last micro-batch of a logical batch has gone through the book (book.h), the ranks
// agree that the step may be taken, the budget allows it, the ledger holds it durably and the
// accountant is charged; only then is the noisy update applied.
//
// One step, top to bottom (PrivateStep::take):
//   1. verdict    this rank's own refusal, if any: the book's error (a gradient that escaped
//                 clipping or would count twice), a stale logical batch, a forward whose
//                 backward has not run, or the caller's (StepRequest::refusal).
//   2. agreement  one all-reduce of [samples, dropped, refused, caller-sampled, s, s², k, k²,
//                 t, t², bad settings] (Note [one agreement per step]); any rank's refusal,
//                 unequal logical batch sizes, charge counts or steps, or more clipped rows
//                 than examples refuses the step everywhere.
//   3. budget     a charge past max_steps is refused (BudgetExhausted; with bands, the
//                 equivalent steps: Note [banded steps]).
//   4. ledger     rank 0 appends the step's record and fsyncs it (accounting/ledger.h); every
//                 rank waits for its verdict, so no rank updates with a step the ledger lacks.
//   5. charge     charges += 1, and the run's accountant composes the step (C++ all the way:
//                 the step calls nothing outside it, whichever front door made it).
//   6. update     ZeroState's update with StepNoise (step_noise.h): noise N(0, (σC)²) drawn
//                 at the charge index (Note [noise index]) on exactly the coordinates
//                 this rank updates, the sum scaled by 1/(q·N), the optimizer. With bands:
//                 the banded noise of row t, the sum scaled by b/(q·N) (Note [banded steps]).
// A refusal in 1–4 charges nothing. Whatever stops a step before its update completes drops the
// logical batch (the book's micro-batches, the ZeRO state's gradients), so no gradient of it can be
// released later under another step's charge. Failpoints (Note [failpoints] in failpoints.h) sit
// before 4, after 4, after 5 and after 6. A collective that fails is a CollectiveError saying
// whether the step was already charged; any other failure after the charge (the accountant, the
// update) is an UpdateError, which says it was (errors.h). An accountant that failed to compose
// a charged step composes it with the next charge (charge()), so ε never counts fewer steps than
// the ledger once a step completes.
//
// Note [noise index]
// ~~~~~~~~~~~~~~~~~~
// The noise of a step is z(key, k, j) with k the index of the step's ledger charge (the number of
// steps charged before it), not the sampler's step t. A step that is charged but never applied (a
// failure after the ledger write) or replayed after a crash is charged again with a new k, so no
// draw is ever applied twice; k is the same on every rank and for every W, stage and plan. Both
// front doors start their sampler at the charge count a continued ledger holds (run.h), so no
// Poisson mask is drawn twice either.
//
// Note [banded steps]
// ~~~~~~~~~~~~~~~~~~~
// With bands b > 1 the noise is correlated across steps (src/dp/correlated_noise.h): the step
// adds κσC·w_t, w = C⁻¹z for the run's strategy C (Note [run strategy] in run.h: the banded
// square root of the prefix sums, or the optimized strategy of the run's length), κ the largest
// column norm of C (its full band), so C/κ has columns of norm at most 1 as the amplified accounting
// requires (Note [amplified banded accounting] in accounting/banded.h). The row is the sampler's
// step t, not the charge index: the partition a batch was drawn from is t mod b (Note [cyclic
// poisson] in privacy/poisson.h), so the row must be t for an example's participations to lie b
// rows apart. So a banded step refuses, before its charge, a t at or before a row it has charged
// (a row is never reused: its noise would repeat; every step refuses a sampler's t already
// charged, whose Poisson batch would repeat), a batch the caller sampled (own_batch: no
// partition, nothing the theorem covers), and a budget its equivalent steps ⌈(t + 1)/b⌉ would
// pass. The accountant composes the equivalent steps as the rows grow; the gradient sum is
// scaled by the expected batch of one partition, q·N/b. Two premises lie outside the step: a
// logical batch is all the sampler's (the front doors refuse a loader batch while an own_batch
// batch is open, and the converse), and the dataset keeps its order for the whole run, resumes
// included (a partition is a set of indices; nothing that holds no data can check it, so the
// user guide says it).
//
// Note [one agreement per step]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every rank checks its own state, then all agree in a single all-reduce, so no rank waits in a
// collective another rank skipped (Note [collective order] in src/zero/state.h), and every verdict
// must come out the same on every rank from the agreed sums. The realised logical batch size s
// (the sampler's, or own_batch's caller's) must be one value: rank r checks Σ s = W·s_r and
// Σ s² = W·s_r², which hold together only if every s equals s_r (the variance Σ s²/W − (Σ s/W)²
// is then 0), so either every rank passes or none does. The charge count k is checked the same
// way: the budget guard and the noise index read it, and a rank with another k would stop alone
// or draw other noise. The sums alone would not do: a rank whose
// s is the mean of unequal sizes would pass while the others refuse, and wait alone in the ledger
// agreement. Rows clipped beyond s mean some example reached the clipping twice (a micro-batch
// back-propagated twice, or batches mixed); the sizes are named only when the caller gave them,
// since a Poisson batch's size is private (Note [released figures] in
// python/dpzero/private/engine.py).
//
// Note [host reads of a step]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// On a GPU the host enqueues a step's kernels and runs ahead; every read of a device value makes
// it wait until the device has caught up, and leaves the device idle while the host enqueues what
// comes next. Forward and backward read nothing (the certification, the clip factors and the
// dropped mask stay on the device; the checks on values are kept unread: Note [deferred checks]
// in python/dpzero/private/book.py). A step waits on the device only here:
//   1. the verdict read: Book::read_checks copies the step's check flags (the module-state
//      flags, python/dpzero/private/state_guard.py; the kept verdicts) and the dropped count to
//      the host in one transfer per device (one, unless the model spans devices). The
//      agreement needs them as host values: whether this rank refuses, and how many rows it
//      dropped. A front door without Python's checks (the C++ API) reads the count alone, in
//      Book::take_stats.
//   2. the agreement and the ledger's verdict (steps 2 and 4): one all-reduce each of a few
//      integers, on the host with Gloo, through the device with NCCL (both wait for it). With
//      one rank neither runs.
//   3. with parameter offload only, before an update writes a host master shard: the device
//      must have finished reading it (Note [parameter offload] in src/zero/flat_param.h).
// Everything else a step computes on the device (the noise, drawn from a counter the host
// passes; the update) is enqueued and not waited for. Outside a step: the first call's probe
// (Note [batch provenance]) and every release (state_dict, checkpoints) read what they need; a
// refused step reads what its message names. tests/python/test_device_path.py counts these reads
// on the path a GPU takes.
//
// Note [CUDA graphs]
// ~~~~~~~~~~~~~~~~~~
// A CUDA graph replays recorded kernels with no host work between them. A whole private step
// cannot be one: between the backward and the update the host must read the verdict, agree with
// the other ranks and wait for the ledger's fsync (Note [host reads of a step]); an update that
// ran without them could apply a step the ledger lacks. Nor can a micro-batch's forward and
// backward be replayed as recorded today: the book decides on the host, per micro-batch, which
// parts reported, when a group completes and when a unit is handed to the ZeRO state, and Python
// checks every call (provenance, module state); a replay would skip all of it, and the noise
// kernels take the charge index as a host argument, so a replayed update would draw the same
// noise again. What capture would need: fixed micro-batch shapes (Poisson batches padded to a
// fixed size), the book's decisions made once for a static layer structure, and the charge index
// and the clip factors as device tensors the graph reads. The forward and backward no longer
// read the device (Note [host reads of a step]), which capture needs first; whether the remaining
// launch overhead justifies the rest is what the GPU kit's profile stage measures.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

#include "accounting/accountant.h"
#include "accounting/ledger.h"
#include "src/dp/book.h"
#include "src/dp/correlated_noise.h"
#include "src/dp/errors.h"
#include "src/dp/failpoints.h"
#include "src/dp/step_noise.h"

namespace dpzero::zero {
class ZeroState;
}

namespace dpzero::dp {

// The run's privacy settings, fixed when the model is made private.
struct StepSettings {
  double noise_multiplier = 0.0;     // σ >= 0 (0: no noise, a non-private run; ε is infinite)
  double max_grad_norm = 1.0;        // C > 0 (inf: no clipping, allowed only when σ = 0)
  double sample_rate = 0.0;          // q in (0, 1]
  int64_t dataset_size = 0;          // N > 0
  std::optional<int64_t> max_steps;  // the steps the ε budget allows at (q, σ); nullopt: no budget
                                     // (with bands > 1: equivalent steps, Note [banded steps])
  int64_t bands = 1;                 // >= 1; > 1: banded correlated noise (Note [banded steps])
  std::vector<double> strategy;      // bands > 1: the strategy's c_0 = 1, c_1 .. c_{b−1} (Note
                                     // [run strategy] in run.h); bands 1: empty
  std::string budget;                // the budget as BudgetExhausted names it
                                     // ("epsilon=3.0 at delta=1e-05 (prv)")
  NoiseKey noise_key;          // the run's Philox seed or secure-mode key
};

// What this rank brings to the step.
struct StepRequest {
  int64_t step = 0;                         // the logical step t the batch was sampled for
  int64_t logical_size = 0;                 // the realised logical batch size over all ranks
  bool caller_sampled = false;              // own_batch: the caller Poisson-sampled it
  std::optional<std::string> refusal;       // a refusal only the caller can see (PrivacyError)
  std::optional<std::string> bad_settings;  // invalid optimizer settings (std::invalid_argument)
};

// What a step released and its data-dependent diagnostics (Note [released figures]: samples and dropped
// depend on the data and are not covered by ε).
struct StepOutcome {
  int64_t step = 0;             // t
  int64_t noise_index = 0;      // k: the step's charge index, which its noise was drawn at
  bool caller_sampled = false;  // some rank's batch came from own_batch ("caller" in the ledger)
  int64_t samples = 0;          // rows clipped over all ranks (padding excluded)
  int64_t dropped = 0;          // of them, dropped for a non-finite norm
};

class PrivateStep {
 public:
  // `ledger`: rank 0's, or null (other ranks; a run without one). `accountant`: the run's, which
  // each charge with σ > 0 composes; null: none (ε is the caller's). `charges` and `rows`: the
  // steps charged before and one more than the last step they hold (a reopened ledger's), which
  // the accountant already holds. Throws std::invalid_argument naming a bad setting.
  PrivateStep(std::shared_ptr<Book> book, zero::ZeroState& zero,
              std::shared_ptr<accounting::Ledger> ledger, StepSettings settings,
              std::shared_ptr<accounting::Accountant> accountant, int64_t charges = 0,
              int64_t rows = 0);

  // The transaction above, a collective: every rank calls it once per logical batch. Throws
  // PrivacyError, std::invalid_argument (bad settings) or BudgetExhausted, nothing charged;
  // accounting::LedgerError (nothing charged or applied); CollectiveError. The batch is dropped
  // whenever the update did not complete.
  StepOutcome take(const StepRequest& request);

  // Drops the logical batch: the book's micro-batches and the ZeRO state's gradients (a refused
  // step; the caller's own refusals, e.g. a GradScaler driving the step).
  void drop_batch();

  int64_t charges() const { return charges_; }
  // A checkpoint's charge count and accountant, which holds its charges. Note [noise index]: a
  // charge index is never reused, so a count below the current one is a std::invalid_argument
  // (and nothing changes).
  // `rows` likewise (Note [banded steps]: a row is never reused).
  void restore(int64_t charges, std::shared_ptr<accounting::Accountant> accountant,
               int64_t rows = 0);
  // One more than the last step charged (at least what the constructor or restore gave).
  int64_t rows() const { return rows_; }
  // The DP-SGD steps the charges equal: the charges, or ⌈rows / b⌉ with bands b > 1 (Note
  // [amplified banded accounting] in accounting/banded.h).
  int64_t equivalent_steps() const;
  const std::shared_ptr<accounting::Accountant>& accountant() const { return accountant_; }
  // The run's noise key (a checkpoint's secure-mode key); std::invalid_argument for a secure key
  // without 8 words.
  void set_noise_key(NoiseKey key);
  const StepSettings& settings() const { return settings_; }

 private:
  StepOutcome transact(const StepRequest& request);
  // Counts step t as charged at index k, and the accountant composes every equivalent step it
  // has not yet.
  void charge(int64_t k, int64_t t);
  // fn(), a collective of step t; a failure of the process group becomes a CollectiveError.
  [[noreturn]] void collective_failed(const char* what, int64_t step, ChargeState state,
                                      const c10::DistBackendError& e) const;
  template <typename Fn>
  auto collective(const char* what, int64_t step, ChargeState state, Fn&& fn);

  std::shared_ptr<Book> book_;
  zero::ZeroState& zero_;
  std::shared_ptr<accounting::Ledger> ledger_;
  StepSettings settings_;
  std::shared_ptr<accounting::Accountant> accountant_;
  Failpoints failpoints_;  // Note [failpoints], read when the step is made
  int64_t charges_ = 0;
  int64_t rows_ = 0;
  int64_t accounted_ = 0;  // the equivalent steps the accountant has composed
  // Note [banded steps]: bands > 1 only; rebuilt with the noise key.
  std::unique_ptr<CorrelatedNoise> banded_;
  double band_norm_ = 1.0;  // κ, the strategy's largest column norm
};

}  // namespace dpzero::dp
