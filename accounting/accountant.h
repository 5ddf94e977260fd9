// accounting/accountant.h — what every accountant is: a record of the run's phases that it
// composes, the interface the private step charges (src/dp/private_step.h) without knowing which
// accountant the run chose.
//
// The record merges: a phase with the same q and sigma as the last one extends it, so a run of
// n equal steps is one phase of n steps (the history Opacus's accountants keep, and what the
// accountants compose anyway). Phases with other settings in between stay apart.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "accounting/types.h"

namespace dpzero::accounting {

class Accountant {
 public:
  virtual ~Accountant() = default;

  // Validates `phase` (validate_phase, naming the bad value) and composes it.
  void add(const Phase& phase);
  void step(double q, double sigma, int64_t steps = 1) { add(Phase{q, sigma, steps}); }

  virtual AccountantKind kind() const = 0;
  // The ε a run reports at `delta` (Opacus's get_epsilon): RDP's conversion (rdp.h), the PRV's
  // upper bound at its default accuracy (prv.h).
  virtual double get_epsilon(double delta) const = 0;
  const std::vector<Phase>& phases() const { return phases_; }
  // No phase releases anything (releases() below): Note [nothing released] in rdp.cpp.
  bool releases_nothing() const;
  int64_t steps() const { return steps_; }  // the steps of every phase

 protected:
  Accountant() = default;
  Accountant(const Accountant&) = default;
  Accountant& operator=(const Accountant&) = default;

 private:
  // What the accountant's own state needs of a valid phase (add has recorded it already).
  virtual void compose(const Phase& phase) = 0;

  std::vector<Phase> phases_;
  int64_t steps_ = 0;
};

// Whether `phase` releases anything: it samples (q > 0) and has steps.
inline bool releases(const Phase& phase) { return phase.q > 0.0 && phase.steps > 0; }

// A new accountant of `kind`, with its default options (RDP: Opacus's orders).
std::shared_ptr<Accountant> make_accountant(AccountantKind kind);

}  // namespace dpzero::accounting
