// src/dp/private_step.cpp — see private_step.h.
#include "src/dp/private_step.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>

#include "accounting/banded.h"
#include "accounting/types.h"
#include "src/dp/failpoints.h"
#include "src/zero/state.h"

namespace dpzero::dp {
namespace {

using accounting::format_double;

constexpr const char* kStale =
    "a new logical batch began while the previous one's gradients were still accumulated "
    "(step() was not called for it); they would be released together";
constexpr const char* kOpen =
    "step() after a forward whose backward has not run; call loss.backward() first (or "
    "zero_grad() to drop it)";
constexpr const char* kDropped = " (the batch was dropped; call zero_grad() to go on)";

std::string format_g(double value, int digits) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, "%.*g", digits, value);
  return buffer;
}

// Positions in the step's agreement (Note [one agreement per step]).
enum Agreed : size_t {
  kSamples,
  kDroppedRows,
  kRefused,
  kCaller,
  kSizes,
  kSizeSquares,
  kCharges,
  kChargeSquares,
  kSteps,
  kStepSquares,
  kBad,
  kCount
};

}  // namespace

PrivateStep::PrivateStep(std::shared_ptr<Book> book, zero::ZeroState& zero,
                         std::shared_ptr<accounting::Ledger> ledger, StepSettings settings,
                         std::shared_ptr<accounting::Accountant> accountant, int64_t charges,
                         int64_t rows)
    : book_(std::move(book)),
      zero_(zero),
      ledger_(std::move(ledger)),
      settings_(std::move(settings)),
      accountant_(std::move(accountant)),
      failpoints_(Failpoints::from_env()) {
  const StepSettings& s = settings_;
  if (!book_) throw std::invalid_argument("PrivateStep: book must not be null");
  if (!(s.noise_multiplier >= 0.0) || !std::isfinite(s.noise_multiplier)) {
    throw std::invalid_argument("PrivateStep: noise_multiplier must be finite and >= 0, got " +
                                format_double(s.noise_multiplier));
  }
  if (!(s.max_grad_norm > 0.0) || (std::isinf(s.max_grad_norm) && s.noise_multiplier > 0.0)) {
    throw std::invalid_argument(
        "PrivateStep: max_grad_norm must be > 0 (inf only without noise), got " +
        format_double(s.max_grad_norm) + " with noise_multiplier " +
        format_double(s.noise_multiplier));
  }
  if (!(s.sample_rate > 0.0 && s.sample_rate <= 1.0)) {
    throw std::invalid_argument("PrivateStep: sample_rate must be in (0, 1], got " +
                                format_double(s.sample_rate));
  }
  if (s.dataset_size <= 0) {
    throw std::invalid_argument("PrivateStep: dataset_size must be > 0, got " +
                                std::to_string(s.dataset_size));
  }
  if (s.max_steps && *s.max_steps < 0) {
    throw std::invalid_argument("PrivateStep: max_steps must be >= 0, got " +
                                std::to_string(*s.max_steps));
  }
  if (s.bands < 1) {
    throw std::invalid_argument("PrivateStep: bands must be >= 1, got " +
                                std::to_string(s.bands));
  }
  if (s.bands > 1 && s.noise_multiplier == 0.0) {
    throw std::invalid_argument("PrivateStep: bands=" + std::to_string(s.bands) +
                                " needs noise (noise_multiplier > 0)");
  }
  // Note [run strategy] (run.h): start_run gives a banded run b checked coefficients, DP-SGD none.
  if (s.bands == 1 ? !s.strategy.empty()
                    : !privacy::BandedToeplitz::is_run_strategy(s.strategy, s.bands)) {
    throw std::invalid_argument(
        "PrivateStep: bands=" + std::to_string(s.bands) + " needs " +
        (s.bands == 1 ? std::string("no strategy")
                      : std::to_string(s.bands) +
                            " finite strategy coefficients, the first 1, with a finite column "
                            "norm") +
        ", got " + std::to_string(s.strategy.size()) + " coefficient(s)");
  }
  if (s.bands > 1) band_norm_ = privacy::BandedToeplitz(s.strategy).column_norm(s.bands, 0);
  set_noise_key(settings_.noise_key);
  restore(charges, accountant_, rows);
}

void PrivateStep::restore(int64_t charges, std::shared_ptr<accounting::Accountant> accountant,
                          int64_t rows) {
  if (charges < charges_) {
    throw std::invalid_argument("PrivateStep: charges must not go below the " +
                                std::to_string(charges_) +
                                " already charged (Note [noise "
                                "index]: a charge index is never reused), got " +
                                std::to_string(charges));
  }
  if (rows < rows_) {
    throw std::invalid_argument("PrivateStep: rows must not go below the " +
                                std::to_string(rows_) +
                                " already charged (Note [banded steps]: a row is never reused), "
                                "got " + std::to_string(rows));
  }
  charges_ = charges;
  rows_ = rows;
  accounted_ = equivalent_steps();
  accountant_ = std::move(accountant);
}

int64_t PrivateStep::equivalent_steps() const {
  return accounting::equivalent_steps(charges_, rows_, settings_.bands);
}

void PrivateStep::set_noise_key(NoiseKey key) {
  if (key.secure && key.key.size() != 8) {
    throw std::invalid_argument("PrivateStep: a secure-mode noise key has 8 words, got " +
                                std::to_string(key.key.size()));
  }
  settings_.noise_key = std::move(key);
  if (settings_.bands > 1) {  // Note [banded steps]: the history is of this key's draws
    banded_ = std::make_unique<CorrelatedNoise>(privacy::BandedToeplitz(settings_.strategy),
                                                settings_.noise_key);
  }
}

void PrivateStep::charge(int64_t k, int64_t t) {
  charges_ = k + 1;  // first: whatever fails next, charge k's noise index is never drawn again
  rows_ = std::max(rows_, t + 1);  // and row t is never reused (Note [banded steps])
  const StepSettings& s = settings_;
  const int64_t owed = equivalent_steps();
  if (s.noise_multiplier > 0.0 && accountant_ && accounted_ < owed) {
    accountant_->step(s.sample_rate, s.noise_multiplier, owed - accounted_);
  }
  accounted_ = owed;
}

void PrivateStep::collective_failed(const char* what, int64_t step, ChargeState state,
                                    const c10::DistBackendError& e) const {
  const auto& comm = zero_.comm();
  throw CollectiveError(
      collective_error_text(comm.rank(), comm.world_size(), step, what, state,
                            std::string("DistBackendError: ") + e.what_without_backtrace()),
      state);
}

template <typename Fn>
auto PrivateStep::collective(const char* what, int64_t step, ChargeState state, Fn&& fn) {
  try {
    return fn();
  } catch (const c10::DistBackendError& e) {
    collective_failed(what, step, state, e);
  }
}

void PrivateStep::drop_batch() {
  book_->discard();
  book_->take_stats();
  zero_.zero_grad();
}

StepOutcome PrivateStep::take(const StepRequest& request) {
  try {
    return transact(request);
  } catch (...) {
    // The update did not complete: the batch is never released (a process group that failed
    // may fail the drop's wait for reductions in flight too; the original error is the one).
    try {
      drop_batch();
    } catch (...) {
    }
    throw;
  }
}

StepOutcome PrivateStep::transact(const StepRequest& request) {
  const StepSettings& s = settings_;
  const comm::Collectives& comm = zero_.comm();
  const int64_t t = request.step, size = request.logical_size, w = comm.world_size();

  // 1. This rank's verdict.
  std::optional<std::string> refusal = book_->error();
  if (!refusal && book_->stale()) refusal = kStale;
  if (!refusal) refusal = request.refusal;
  if (!refusal && book_->open()) refusal = kOpen;
  const bool size_ok = size >= 0 && size <= s.dataset_size;
  if (!refusal && !size_ok) {
    refusal = "the logical batch size must be in [0, " + std::to_string(s.dataset_size) +
              "] (the dataset size), got " + std::to_string(size);
  }
  if (!refusal && s.bands > 1 && request.caller_sampled) {
    refusal = "a run with bands=" + std::to_string(s.bands) +
              " samples its own batches (one partition a step, Note [banded steps]); own_batch "
              "cannot drive it: iterate the data loader make_private returned";
  }
  if (!refusal && !request.caller_sampled && t < rows_) {
    // The sampler's step t is drawn once (Note [noise index]); with bands it is also the noise
    // row (Note [banded steps]), which must never repeat.
    refusal = "step " + std::to_string(t) + " is at or before step " + std::to_string(rows_ - 1) +
              ", which this run has charged: its Poisson batch" +
              (s.bands > 1 ? std::string(" and its noise row") : std::string()) +
              " would repeat (Note [noise index])";
  }
  const StepStats stats = refusal ? StepStats{} : book_->take_stats();
  const int64_t k = charges_;

  // 2. Every rank's (Note [one agreement per step]).
  std::vector<int64_t> mine(kCount, 0);
  mine[kSamples] = stats.samples;
  mine[kDroppedRows] = stats.dropped;
  mine[kRefused] = refusal ? 1 : 0;
  mine[kCaller] = request.caller_sampled ? 1 : 0;
  mine[kSizes] = size_ok ? size : 0;
  mine[kSizeSquares] = mine[kSizes] * mine[kSizes];
  mine[kCharges] = k;
  mine[kChargeSquares] = k * k;
  mine[kSteps] = t;
  mine[kStepSquares] = t * t;
  mine[kBad] = request.bad_settings ? 1 : 0;
  const std::vector<int64_t> all = collective("agreeing on the step", t, ChargeState::kNotCharged,
                                              [&] { return comm.all_reduce_sum(mine); });
  if (all[kRefused] != 0) {
    throw PrivacyError("refusing the step: " + refusal.value_or("another rank refused it") +
                       kDropped);
  }
  if (all[kBad] != 0) {
    throw std::invalid_argument(
        "refusing the step: " +
        request.bad_settings.value_or("another rank has invalid optimizer settings") +
        " (nothing charged or applied; the batch was dropped, call zero_grad() to go on)");
  }
  std::optional<std::string> disagreement;
  if (all[kSizes] != w * size || all[kSizeSquares] != w * size * size) {
    disagreement = "the ranks gave different logical batch sizes (this rank " +
                   std::to_string(size) + ") for logical step " + std::to_string(t) +
                   ": own_batch's logical_batch_size is the size over all ranks, the same on "
                   "every rank";
  } else if (all[kCharges] != w * k || all[kChargeSquares] != w * k * k) {
    disagreement = "the ranks have charged different numbers of steps (this rank " +
                   std::to_string(k) + "): every rank must load the same checkpoint";
  } else if (all[kSteps] != w * t || all[kStepSquares] != w * t * t) {
    disagreement = "the ranks are at different logical steps (this rank " + std::to_string(t) +
                   "): every rank must draw its batches from the same sampler position";
  } else if (all[kSamples] > size) {
    disagreement =
        "more rows reached the clipping in logical step " + std::to_string(t) +
        " than its batch has examples" +
        (request.caller_sampled ? " (" + std::to_string(all[kSamples]) +
                                      " rows, logical_batch_size=" + std::to_string(size) + ")"
                                : "");
  }
  if (disagreement) {
    book_->set_error(disagreement);  // the step refuses until zero_grad()
    throw PrivacyError("refusing the step: " + *disagreement + kDropped);
  }

  // 3. The budget.
  const double sigma = s.noise_multiplier, c = s.max_grad_norm, q = s.sample_rate;
  if (s.max_steps && s.bands == 1 && k + 1 > *s.max_steps) {
    throw BudgetExhausted("the privacy budget " + s.budget + " allows " +
                          std::to_string(*s.max_steps) + " steps at sigma=" + format_double(sigma) +
                          ", q=" + format_g(q, 6) + "; " + std::to_string(k) +
                          " are charged, so step " + std::to_string(k + 1) +
                          " was not taken (nothing charged or applied)");
  }
  if (s.max_steps && s.bands > 1 &&
      accounting::banded_equivalent_steps(t + 1, s.bands) > *s.max_steps) {
    throw BudgetExhausted("the privacy budget " + s.budget + " allows " +
                          std::to_string(*s.max_steps) + " equivalent steps at sigma=" +
                          format_double(sigma) + ", q=" + format_g(q, 6) + ", " +
                          std::to_string(*s.max_steps * s.bands) + " steps of bands=" +
                          std::to_string(s.bands) + ", so step " + std::to_string(t) +
                          " was not taken (nothing charged or applied)");
  }

  // 4. The ledger, durable before the update; nothing that depends on the data goes in (Note
  // [ledger format] in accounting/ledger.h).
  const bool caller = all[kCaller] != 0;
  failpoints_.hit("before_ledger", k, comm.rank());
  std::exception_ptr ledger_error;
  if (ledger_) {
    accounting::LedgerRecord record;
    record.first_step = record.last_step = t;
    record.q = q;
    record.sigma = sigma;
    // C = inf (no clipping, only without noise) is recorded as 0: noise=false makes ε inf anyway.
    record.max_grad_norm = std::isfinite(c) ? c : 0.0;
    record.noise = sigma > 0.0;
    record.sampling = caller ? "caller" : "poisson";
    try {
      ledger_->append(record);
    } catch (...) {
      ledger_error = std::current_exception();
    }
  }
  bool ledger_failed = false;
  try {
    ledger_failed = comm.all_reduce_sum(std::vector<int64_t>{ledger_error ? 1 : 0})[0] != 0;
  } catch (const c10::DistBackendError& e) {
    // Rank 0's record is on disk: the step is charged there (Note [noise index]: its index is
    // never reused); the others cannot know.
    ChargeState state = ChargeState::kUnknown;
    if (ledger_) state = ledger_error ? ChargeState::kNotCharged : ChargeState::kCharged;
    if (!ledger_ && comm.rank() == 0) state = ChargeState::kNotCharged;
    if (state == ChargeState::kCharged) charge(k, t);
    collective_failed("waiting for rank 0's ledger record", t, state, e);
  }
  if (ledger_failed) {
    if (ledger_error) std::rethrow_exception(ledger_error);
    throw accounting::LedgerError(
        "rank 0 could not write the privacy ledger (its error is in its log); no update was "
        "made");
  }
  failpoints_.hit("after_ledger", k, comm.rank());

  // 5. The charge, and 6. the noisy update. From the charge on the step's privacy cost counts
  // whatever happens; a failure says so: a collective's is a CollectiveError (charged), any
  // other an UpdateError with its cause nested.
  try {
    charge(k, t);
    failpoints_.hit("after_charge", k, comm.rank());
    // The expected logical batch: q·N, or q·N/b of one partition (Note [banded steps]).
    const double grad_scale =
        static_cast<double>(s.bands) / (q * static_cast<double>(s.dataset_size));
    if (banded_) {
      CorrelatedNoise::Step noise = banded_->at(t, sigma * c * band_norm_);
      collective("the noisy update", t, ChargeState::kCharged,
                 [&] { zero_.private_update(&noise, grad_scale); });
    } else {
      StepNoise noise(sigma > 0.0 ? sigma * c : 0.0, s.noise_key, k);
      collective("the noisy update", t, ChargeState::kCharged,
                 [&] { zero_.private_update(&noise, grad_scale); });
    }
  } catch (const CollectiveError&) {
    throw;
  } catch (const std::exception& e) {
    std::throw_with_nested(
        UpdateError(update_error_text(comm.rank(), comm.world_size(), t, k, e.what())));
  }
  failpoints_.hit("after_update", k, comm.rank());
  return StepOutcome{t, k, caller, all[kSamples], all[kDroppedRows]};
}

}  // namespace dpzero::dp
