// accounting/prv.h — Privacy Random Variable (PRV) accountant for the Poisson-subsampled Gaussian.
//
// Reference: [GLW21] Gopi, Lee, Wutschitz. "Numerical Composition of Differential Privacy",
// NeurIPS 2021 (arXiv:2106.02848). The PRV of each phase is truncated to a domain [-L, L],
// discretised on a mesh chosen from the paper's error analysis (Thm. 5.5 / App. B), self-composed
// `steps` times by FFT, and the phases are convolved. epsilon comes with a lower bound, an
// estimate and an upper bound for the requested eps_error and delta_error.
//
// Two properties a caller should know:
//  * the bounds also carry the measured round-off of the double-precision FFT (about 1e-12
//    absolute in delta, added on top of delta_error rather than taken out of it), so a bound is
//    at most that much wider than delta_error alone would make it;
//  * under add/remove adjacency both orders of a neighbouring pair count, so the accountant
//    composes the PRV of each direction, remove (mixture (1-q)N(0,s^2) + qN(1,s^2) vs N(0,s^2),
//    the pair of [GLW21] and Opacus) and add (the same pair swapped), and reports the worse:
//    delta() the elementwise max of the two directions' bounds, epsilon() the max of each of
//    lower / estimate / upper, each direction with the full eps_error and delta_error (Note [PRV
//    directions] in prv.cpp; [ZDW22] Zhu, Dong, Wang, AISTATS 2022). This costs about twice one
//    direction; runs made only of q = 1 phases (where the two coincide) are computed once.
#pragma once

#include <cstdint>
#include <vector>

#include "accounting/accountant.h"
#include "accounting/types.h"

namespace dpzero::accounting {

struct PrvEpsilon {
  double lower = 0.0;
  double estimate = 0.0;
  double upper = 0.0;
};

struct PrvDelta {
  double lower = 0.0;
  double estimate = 0.0;
  double upper = 0.0;
};

struct PrvOptions {
  double eps_error = 0.01;    // additive error allowed on epsilon, > 0
  double delta_error = 0.0;   // additive error allowed on delta; 0 means delta / 1000
};

// Records its phases (accountant.h); epsilon() and delta() compose them.
class PrvAccountant final : public Accountant {
 public:
  PrvAccountant() = default;

  AccountantKind kind() const override { return AccountantKind::kPrv; }
  // Throws std::invalid_argument for bad delta/options, std::runtime_error with a clear message
  // when the numerical method cannot meet the requested accuracy (the caller may fall back to RDP).
  PrvEpsilon epsilon(double delta, const PrvOptions& options = {}) const;
  double get_epsilon(double delta) const override { return epsilon(delta).upper; }
  // delta_error here defaults to 1e-10 when options.delta_error == 0 (there is no delta to scale).
  PrvDelta delta(double epsilon, const PrvOptions& options = {}) const;

 private:
  void compose(const Phase&) override {}  // the record is the state
};

}  // namespace dpzero::accounting
