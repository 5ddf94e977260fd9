// src/dp/errors.h — the typed errors of the private step. Each message names the bad value and
// what the caller can do; the Python bindings raise them as dpzero.PrivacyViolation,
// dpzero.BudgetExhausted and dpzero.CollectiveError (python/csrc/dp_bindings.cpp).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace dpzero::dp {

// A gradient would escape clipping or be counted twice, or the ranks disagree about the step: the
// batch is dropped and nothing is charged or applied.
class PrivacyError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The next step would spend more than the run's ε budget; nothing was charged or applied.
class BudgetExhausted : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Whether a failed step had been charged to the ledger (and this rank's count and accountant).
enum class ChargeState {
  kNotCharged,  // nothing was charged or applied
  kCharged,     // the ledger holds the step; it was not applied on this rank
  kUnknown,     // rank 0's ledger may hold the step (this rank never learnt its verdict)
};

// A collective of the private step failed on this rank: a peer rank died, hung past the process
// group's timeout, or lost its connection (Note [collective failures] in src/comm/collectives.h).
// charge_state() says whether the step had been charged, so the caller knows its privacy cost
// counts; a resumed run reads the ledger, which is what counts.
class CollectiveError : public std::runtime_error {
 public:
  CollectiveError(const std::string& message, ChargeState charge_state)
      : std::runtime_error(message), charge_state_(charge_state) {}
  ChargeState charge_state() const { return charge_state_; }

 private:
  ChargeState charge_state_;
};

// The message of a CollectiveError: "rank r of W, step t: <what> failed: ...; <charge state>
// (<cause>)", `cause` cut to its first line (at most 300 characters).
std::string collective_error_text(int64_t rank, int64_t world_size, int64_t step,
                                  const std::string& what, ChargeState charge_state,
                                  const std::string& cause);

// The step was charged (the ledger holds it, this rank counted it) and then failed on this rank
// for another reason than a collective: the accountant or the noisy update raised (an allocation,
// a kernel). It was not applied on this rank; a resumed run reads the ledger,
// where it counts. Thrown with std::throw_with_nested, so the cause is still there for
// std::rethrow_if_nested.
class UpdateError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The message of an UpdateError: "rank r of W, step t (charge k): the step was charged to the
// privacy ledger, then failed on this rank before its update was applied: <cause>", `cause` cut
// as collective_error_text's.
std::string update_error_text(int64_t rank, int64_t world_size, int64_t step, int64_t charge,
                              const std::string& cause);

}  // namespace dpzero::dp
