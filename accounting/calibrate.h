// accounting/calibrate.h — noise calibration: sigma for a target epsilon, steps for a budget.
#pragma once

#include <cstdint>

#include "accounting/prv.h"
#include "accounting/rdp.h"
#include "accounting/types.h"

namespace dpzero::accounting {

struct CalibrationOptions {
  AccountantKind accountant = AccountantKind::kRdp;
  double epsilon_tolerance = 0.01;  // stop when target - tol <= eps(sigma) <= target
  double sigma_min = 0.0;           // search bracket; 0 / 0 = automatic
  double sigma_max = 0.0;
  PrvOptions prv;                   // used when accountant == kPrv
  std::vector<double> orders;       // used when accountant == kRdp; empty = Opacus default grid
};

// Smallest-found sigma (to tolerance) such that `steps` steps at sample rate q give eps <= target
// (PRV: upper bound). The search mirrors Opacus's get_noise_multiplier (so equal inputs give equal
// sigmas): with an automatic bracket the upper end starts at 20 and doubles up to 1e6, then
// bisection from (0, upper] runs until target - tol <= eps(sigma) <= target. An explicit
// sigma_min whose epsilon already meets the target is returned as is. Throws
// std::invalid_argument naming the value for target_epsilon <= 0, bad delta/q/steps/options,
// q = 0 or steps = 0 (epsilon is 0 for every sigma), and when the target cannot be reached inside
// the bracket (the message names target and bracket).
double noise_multiplier_for_epsilon(double target_epsilon, double delta, double q, int64_t steps,
                                    const CalibrationOptions& options = {});

// Largest number of steps with sigma and q whose epsilon stays <= target (0 if even one step
// exceeds it). Saturates at INT64_MAX when epsilon stays below target past 2^62 steps (and for
// q = 0, where epsilon is always 0). With the PRV accountant, a probe the PRV method refuses
// (calibrate.cpp) counts as exceeding the target; if it refuses even one step, this throws
// std::runtime_error with the PRV's reason rather than answering 0.
int64_t steps_for_epsilon(double target_epsilon, double delta, double q, double sigma,
                          const CalibrationOptions& options = {});

}  // namespace dpzero::accounting
