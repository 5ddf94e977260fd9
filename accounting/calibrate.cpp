// accounting/calibrate.cpp — noise calibration: the noise multiplier sigma that meets a target
// epsilon (bisection on sigma) and the number of steps a budget allows (exponential search, then
// bisection on steps), for the RDP and the PRV accountant.
//
// Both searches assume monotonicity: epsilon falls as sigma grows and grows with the number of
// steps (true of the exact privacy curves; the accountants' numerical bounds follow it).
#include "accounting/calibrate.h"

#include <cmath>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>

namespace dpzero::accounting {
namespace {

// Opacus's get_noise_multiplier search, mirrored so that the same inputs give the same sigma:
// the upper end starts at 2 * 10 and doubles while epsilon is above target, giving up past 1e6.
constexpr double kAutoSigmaStart = 20.0;
constexpr double kAutoSigmaLimit = 1e6;

// The largest power of two steps_for_epsilon probes; past it the answer saturates at INT64_MAX.
constexpr int64_t kMaxProbeSteps = int64_t{1} << 62;

void validate_target(double target_epsilon) {
  if (!(target_epsilon > 0.0 && std::isfinite(target_epsilon))) {
    throw std::invalid_argument("target epsilon must be > 0 and finite, got " +
                                format_double(target_epsilon));
  }
}

void validate_options(const CalibrationOptions& options) {
  if (!(options.epsilon_tolerance > 0.0 && std::isfinite(options.epsilon_tolerance))) {
    throw std::invalid_argument("epsilon_tolerance must be > 0 and finite, got " +
                                format_double(options.epsilon_tolerance));
  }
  if (!(options.sigma_min >= 0.0 && std::isfinite(options.sigma_min))) {
    throw std::invalid_argument("sigma_min must be >= 0 and finite (0 = automatic), got " +
                                format_double(options.sigma_min));
  }
  if (!(options.sigma_max >= 0.0 && std::isfinite(options.sigma_max))) {
    throw std::invalid_argument("sigma_max must be >= 0 and finite (0 = automatic), got " +
                                format_double(options.sigma_max));
  }
  if (options.sigma_max > 0.0 && !(options.sigma_min < options.sigma_max)) {
    throw std::invalid_argument("sigma bracket must satisfy sigma_min < sigma_max, got [" +
                                format_double(options.sigma_min) + ", " +
                                format_double(options.sigma_max) + "]");
  }
}

// epsilon of one phase under the chosen accountant (PRV: the upper bound).
//
// The PRV method refuses (std::runtime_error) exactly where epsilon is huge or delta tiny (FFT size
// cap, round-off floor; see prv.cpp). During a search such a probe counts as epsilon = +inf, i.e.
// "above any target": the search then moves towards more noise (or fewer steps), never towards
// less privacy. The refusal's text is kept in `failure` so an unreachable target can say why.
double phase_epsilon(const Phase& phase, double delta, const CalibrationOptions& options,
                     const std::vector<double>& orders, std::string* failure = nullptr) {
  if (options.accountant == AccountantKind::kPrv) {
    PrvAccountant accountant;
    accountant.add(phase);
    try {
      return accountant.epsilon(delta, options.prv).upper;
    } catch (const std::invalid_argument&) {
      throw;
    } catch (const std::runtime_error& e) {
      if (failure != nullptr) *failure = e.what();
      return std::numeric_limits<double>::infinity();
    }
  }
  RdpAccountant accountant(orders);
  accountant.add(phase);
  return accountant.epsilon(delta).epsilon;
}

std::string phase_text(double q, double delta, const std::string& what) {
  return "(q = " + format_double(q) + ", " + what + ", delta = " + format_double(delta) + ")";
}

}  // namespace

double noise_multiplier_for_epsilon(double target_epsilon, double delta, double q, int64_t steps,
                                    const CalibrationOptions& options) {
  validate_target(target_epsilon);
  validate_delta(delta);
  validate_phase(Phase{q, 1.0, steps});
  validate_options(options);
  if (q == 0.0 || steps == 0) {
    throw std::invalid_argument(
        "no noise multiplier to calibrate: epsilon is 0 for every sigma when q = " +
        format_double(q) + " and steps = " + std::to_string(steps));
  }
  const std::vector<double> orders =
      options.orders.empty() ? opacus_default_orders() : options.orders;
  std::string prv_failure;  // the last PRV refusal, if any probe hit one
  const auto eps = [&](double sigma) {
    return phase_epsilon(Phase{q, sigma, steps}, delta, options, orders, &prv_failure);
  };
  const std::string context = phase_text(q, delta, "steps = " + std::to_string(steps));
  const auto why = [&] { return prv_failure.empty() ? "" : " (PRV: " + prv_failure + ")"; };

  // Bracket (lo, hi] with eps(hi) <= target; lo is either 0 (never evaluated: eps -> inf as
  // sigma -> 0) or an explicit sigma_min whose epsilon is above target.
  double lo = options.sigma_min;
  double eps_lo = std::numeric_limits<double>::infinity();
  if (lo > 0.0) {
    eps_lo = eps(lo);
    if (eps_lo <= target_epsilon) return lo;  // the whole bracket meets the target
  }
  double hi = 0.0;
  double eps_hi = 0.0;
  if (options.sigma_max > 0.0) {
    hi = options.sigma_max;
    eps_hi = eps(hi);
    if (eps_hi > target_epsilon) {
      throw std::invalid_argument(
          "target epsilon " + format_double(target_epsilon) + " cannot be reached with sigma in [" +
          format_double(options.sigma_min) + ", " + format_double(hi) + "]: epsilon at sigma_max " +
          format_double(hi) + " is " + format_double(eps_hi) + " " + context + why());
    }
  } else {
    hi = std::max(kAutoSigmaStart, 2.0 * lo);
    for (;;) {
      eps_hi = eps(hi);
      if (eps_hi <= target_epsilon) break;
      lo = hi;
      eps_lo = eps_hi;
      hi *= 2.0;
      if (hi > kAutoSigmaLimit) {
        throw std::invalid_argument(
            "target epsilon " + format_double(target_epsilon) +
            " cannot be reached with sigma in [" + format_double(options.sigma_min) + ", " +
            format_double(kAutoSigmaLimit) + "]: epsilon at sigma " + format_double(lo) + " is " +
            format_double(eps_lo) + " " + context + why());
      }
    }
  }

  // Bisection until target - tolerance <= eps(hi) <= target. If the bracket collapses first
  // (epsilon jumps across the tolerance band, e.g. numerical noise of a bound), hi still meets
  // the target and is returned.
  while (target_epsilon - eps_hi > options.epsilon_tolerance) {
    const double mid = 0.5 * (lo + hi);
    if (!(mid > lo && mid < hi)) break;
    const double eps_mid = eps(mid);
    if (eps_mid < target_epsilon) {
      hi = mid;
      eps_hi = eps_mid;
    } else {
      lo = mid;
    }
  }
  return hi;
}

int64_t steps_for_epsilon(double target_epsilon, double delta, double q, double sigma,
                          const CalibrationOptions& options) {
  validate_target(target_epsilon);
  validate_delta(delta);
  validate_phase(Phase{q, sigma, 0});
  validate_options(options);
  if (q == 0.0) return std::numeric_limits<int64_t>::max();  // eps is 0 for any number of steps

  std::function<double(int64_t)> eps;
  std::string prv_failure;  // the PRV refusal at the latest probe, if any
  if (options.accountant == AccountantKind::kRdp) {
    // The per-step RDP curve is computed once; n steps cost n times it [Mironov 2017, Prop. 1].
    // RdpAccountant::add multiplies the same way, so the result is bit-identical to it.
    const std::vector<double> orders =
        options.orders.empty() ? opacus_default_orders() : options.orders;
    const std::vector<double> per_step = compute_rdp(q, sigma, 1, orders);
    eps = [orders, per_step, delta](int64_t steps) {
      std::vector<double> rdp(per_step.size());
      const double n = static_cast<double>(steps);
      for (std::size_t i = 0; i < rdp.size(); ++i) rdp[i] = n * per_step[i];
      return rdp_to_epsilon(orders, rdp, delta).epsilon;
    };
  } else {
    eps = [q, sigma, delta, &options, &prv_failure](int64_t steps) {
      return phase_epsilon(Phase{q, sigma, steps}, delta, options, {}, &prv_failure);
    };
  }

  if (eps(1) > target_epsilon) {
    // A PRV refusal at one step is not "one step already exceeds the target": the method could
    // not answer at all, so say so instead of returning 0.
    if (!prv_failure.empty()) {
      throw std::runtime_error("cannot count steps for target epsilon " +
                               format_double(target_epsilon) + " with the PRV accountant: " +
                               prv_failure);
    }
    return 0;
  }
  // Exponential search: lo meets the target, hi exceeds it.
  int64_t lo = 1;
  int64_t hi = 2;
  for (;;) {
    if (eps(hi) > target_epsilon) break;
    lo = hi;
    if (hi >= kMaxProbeSteps) return std::numeric_limits<int64_t>::max();
    hi *= 2;
  }
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (eps(mid) <= target_epsilon) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

}  // namespace dpzero::accounting
