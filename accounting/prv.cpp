// accounting/prv.cpp — PrvAccountant: the error budget (mesh, truncation, window, round-off) of the
// PRV accountant, the two directions of the neighbouring relation, and epsilon(delta) /
// delta(epsilon) with lower and upper bounds. The numerical pieces (PRV CDF, discretisation,
// Chernoff window, FFT) are in prv_numerics.*.
//
// References: [GLW21] Gopi, Lee, Wutschitz. "Numerical Composition of Differential Privacy",
// NeurIPS 2021 (arXiv:2106.02848). [ZDW22] Zhu, Dong, Wang. "Optimal Accounting of Differential
// Privacy via Characteristic Function", AISTATS 2022 (arXiv:2106.08567). [BBG18] Balle, Barthe,
// Gaboardi. "Privacy Amplification by Subsampling: Tight Analyses via Couplings and
// Divergences", NeurIPS 2018. [MTZ19] Mironov, Talwar, Zhang. "Renyi Differential Privacy of the
// Sampled Gaussian Mechanism", arXiv:1908.10530.
//
// Note [PRV directions]
// ---------------------
// Under add/remove adjacency the neighbouring datasets D and D' = D + {x} must be protected in
// both orders: (eps, delta)-DP asks H_{e^eps}(M(D') || M(D)) <= delta AND
// H_{e^eps}(M(D) || M(D')) <= delta, H the hockey-stick divergence, so the privacy profile is
// the larger of the two [BBG18, privacy profiles over a symmetric neighbouring relation; ZDW22,
// dominating pairs, defined per ordered pair of neighbours]. For one step of the
// Poisson-subsampled Gaussian (sensitivity 1), with M0 = N(0, s^2) and
// M1 = (1-q) N(0, s^2) + q N(1, s^2), the order (D', D) is dominated by the pair (M1, M0)
// ("remove", the pair of [GLW21, §6] and Opacus) and the order (D, D') by (M0, M1) ("add")
// [ZDW22, dominating pairs of Poisson subsampling under the remove and the add relation]. A
// composition on a fixed pair of datasets keeps its order in every step, so the order (D', D)
// of the composition is dominated by the product of the remove pairs and (D, D') by the product
// of the add pairs [ZDW22, composition of dominating pairs]. Hence
//   delta(eps) = max(delta_remove(eps), delta_add(eps)),                                 (D1)
//   eps(delta) = max(eps_remove(delta), eps_add(delta)),                                 (D2)
// (D2) because each delta_d is non-increasing: max_d delta_d(eps) <= delta iff every
// delta_d(eps) <= delta. dp_accounting's PLD accountant does the same under add/remove
// adjacency (one PMF per direction, the larger delta). Each direction's PRV is its own
// SubsampledGaussianPrv (prv_numerics.h, (PRV-3) and (PRV-4)), discretised, windowed and
// composed on its own.
// Neither order dominates the other for the hockey-stick divergence in general: [MTZ19] show
// that the remove order dominates for the Renyi divergences of this mechanism (so the RDP
// accountant needs one order), which does not carry over to delta(eps). For the Gaussian, every
// case we evaluated (q in [0.01, 0.5], sigma in [0.5, 2], 1 to 1000 steps, eps in [0, 3]; at
// eps = 0 both directions are the total variation distance and agree) had
// delta_remove >= delta_add, but with no proof that this holds for every (q, sigma, steps, eps)
// the accountant does not rely on it. For q = 1 the two pairs give the same Gaussian PLRV
// (N(1/(2 s^2), 1/s^2) either way), so a run made only of q = 1 phases is computed once.
// Error budget: the bounds (B) of Note [PRV error budget] hold for each direction
// deterministically, not with some probability: (1)-(3) there are masses of events of a
// coupling that enter (B) as additive terms. So with L_d <= delta_d <= U_d for each d,
// max_d L_d <= max_d delta_d <= max_d U_d by monotonicity of max, and for epsilon
// e_l,d <= eps_d(delta) <= e_u,d gives max_d e_l,d <= eps(delta) <= max_d e_u,d. Nothing is split
// between the directions (no union bound is involved): each gets the full eps_error and
// delta_error, and the combined bracket is no wider than the wider of the two. max_d L_d bounds
// the max (D1) from below, not necessarily the smaller direction; the estimate is the max of the
// estimates.
//
// Note [PRV error budget]
// -----------------------
// Per direction (Note [PRV directions]):
// let S = sum of the N = sum_i N_i per-step PRVs Y (phase i: N_i steps of PRV Y_i) and
// delta_S(eps) = E[(1 - e^{eps - S})_+] the privacy curve of the composition [GLW21, Thm. 3.5,
// Eq. (2)]. We compute a non-negative sequence p~ on a window of lattice points v_j and
// delta~(eps) = sum_j p~_j (1 - e^{eps - v_j})_+, and guarantee, with eta = eps_error,
//   delta~(eps + eta) (1 - R) - D  <=  delta_S(eps)  <=  delta~(eps - eta) (1 + R) + D,      (B)
// with D = D_M + D_R: D_M <= delta_error is the error of the method (1)-(3), fixed by the
// options; D_R and R (4) are the estimated round-off of double-precision arithmetic, ~1e-12 and
// ~1e-10 for 10^4-10^5 steps, added on top because no choice of options removes them. (B) yields
// the bounds returned by epsilon() and delta() (see there).
//  (1) Truncation [GLW21, §5]: Y_i is kept on (lower_i, upper_i], where each tail has mass
//      <= delta_error / (48 P N_i) (P = number of distinct phases); D_T = sum_i N_i P(Y_i outside)
//      <= delta_error / 24 is the probability that some step falls outside. Outside, the
//      discrete sum counts nothing (the sequence is defective), which the coupling below absorbs.
//  (2) Discretisation [GLW21, §5, Thm. 5.5]: inside its range Y is coupled with the lattice
//      point Y^ = c(Y) + shift_i (c = centre of Y's cell); e = Y - Y^ lies in an interval of
//      length h and has mean 0 because shift_i equalises the means. Hoeffding's inequality gives
//      P(|sum e| >= eta) <= 2 exp(-2 eta^2 / (N h^2)) =: D_H. We choose D_H = delta_error / 6:
//          h = eta / sqrt(N/2 * log(12 / delta_error)).
//      Off the events of (1) and (2), |S - S^| <= eta, and since x -> (1 - e^{eps - x})_+ is
//      non-decreasing and bounded by 1, delta_S(eps) <= delta_S^(eps - eta) + D_T + D_H and
//      delta_S(eps) >= delta_S^(eps + eta) - D_T - D_H.
//  (3) Wrap-around [GLW21, §5]: the FFT computes the lattice index of S^ modulo the FFT size M.
//      The window read back holds S^ except with probability D_W <= 2 * delta_error / 24: each
//      end is placed by a Chernoff bound on the exact moment generating function of the discrete
//      steps (prv_numerics.h, chernoff_window). Mass outside the window is either folded in or
//      missing; either way delta changes by at most D_W (each term is weighted by <= 1).
//  (4) Round-off of the double-precision FFT, estimated in compose() (Note [PRV round-off],
//      prv_numerics.cpp) as |delta~ - delta_exact_discrete| <= D_R + R delta~, where D_R
//      covers the incoherent noise and R ~ 4 eps sqrt(log2 M) N the coherent, relative part.
// So D_M = D_T + D_H + D_W <= (1/6 + 1/24 + 1/12) delta_error. (1) and (3) take small shares
// because they cost only logarithmically (a slightly wider support / window), while (2) fixes
// the mesh; the mesh formula matches [GLW21] and Opacus, so the estimates agree with theirs.
//
// Failure modes (each a std::runtime_error naming the values and what to change, never a hang,
// NaN or negative epsilon):
//  - a single step's PRV or the composed PRV needs more than kMaxFftSize lattice points (very
//    large epsilon such as sigma = 0.3, q = 1, 10^4 steps; very many steps; tiny eps_error) ->
//    "increase eps_error or use the RDP accountant" (this also caps memory at ~0.8 GB);
//  - discrete and continuous means differ by more than h/2 (precision loss; see discretise());
//  - epsilon(delta): the round-off estimate D_R exceeds delta / 10 (tiny delta such as 1e-30)
//    -> "delta is too small ... use the RDP accountant";
//  - any non-finite intermediate result.
// Overflow of exponentials cannot occur: CDFs use erfc and e^{-t} forms, moment generating
// functions are evaluated relative to their largest term, and delta uses e^{eps - v} with
// eps < v only.
#include "accounting/prv.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "accounting/prv_numerics.h"

namespace dpzero::accounting {
namespace {

using prv_detail::ComposedPrv;
using prv_detail::Composition;
using prv_detail::DiscretePrv;
using prv_detail::PrvDirection;
using prv_detail::SubsampledGaussianPrv;

// Largest FFT size / lattice span (2^24 points: ~0.8 GB of buffers, a few seconds): enough for
// 10^6 steps at eps_error = 0.01 (about 5.6 million points for q = 0.001, sigma = 1).
constexpr int64_t kMaxFftSize = int64_t{1} << 24;

// Largest relative round-off accepted (Note [PRV error budget], (4)); 4 eps sqrt(log2 M) per
// step reaches it only past ~10^11 steps, far beyond what the mesh allows anyway.
constexpr double kMaxRelativeRoundoff = 1e-3;

// epsilon(delta) refuses deltas whose round-off estimate D_R exceeds this share of delta: the
// curve itself is then mostly round-off.
constexpr double kMaxRoundoffShareOfDelta = 0.1;

// Default delta_error of delta(): there is no delta to scale (prv.h).
constexpr double kDefaultDeltaErrorForDelta = 1e-10;

void validate_options(const PrvOptions& options) {
  if (!(options.eps_error > 0.0 && std::isfinite(options.eps_error))) {
    throw std::invalid_argument("PRV eps_error must be > 0 and finite, got " +
                                format_double(options.eps_error));
  }
  if (!(options.delta_error >= 0.0 && options.delta_error < 1.0)) {
    throw std::invalid_argument("PRV delta_error must be in [0, 1) (0 = default), got " +
                                format_double(options.delta_error));
  }
}

// Validates epsilon()'s arguments and returns its delta_error (default delta / 1000).
double epsilon_delta_error(double delta, const PrvOptions& options) {
  validate_delta(delta);
  validate_options(options);
  const double delta_error = options.delta_error == 0.0 ? delta / 1000.0 : options.delta_error;
  if (!(delta_error < delta)) {
    throw std::invalid_argument("PRV delta_error (" + format_double(delta_error) +
                                ") must be smaller than delta (" + format_double(delta) + ")");
  }
  return delta_error;
}

// Validates delta()'s arguments and returns its delta_error (default kDefaultDeltaErrorForDelta).
double delta_delta_error(double epsilon, const PrvOptions& options) {
  validate_epsilon(epsilon);
  validate_options(options);
  return options.delta_error == 0.0 ? kDefaultDeltaErrorForDelta : options.delta_error;
}

// Merge phases with the same (q, sigma): composition is commutative, so this only saves work.
// Phases with q = 0 or no steps have the PRV identically 0 (in both directions) and are dropped.
std::vector<Phase> merge_phases(const std::vector<Phase>& phases) {
  std::vector<Phase> merged;
  for (const Phase& phase : phases) {
    if (!releases(phase)) continue;
    bool found = false;
    for (Phase& m : merged) {
      if (m.q == phase.q && m.sigma == phase.sigma) {
        m.steps += phase.steps;
        found = true;
        break;
      }
    }
    if (!found) merged.push_back(phase);
  }
  return merged;
}

// Whether the add direction can differ from the remove direction: some phase has q < 1
// (Note [PRV directions]; for q = 1 both are the same Gaussian PLRV).
bool has_subsampled_phase(const std::vector<Phase>& merged) {
  return std::any_of(merged.begin(), merged.end(), [](const Phase& p) { return p.q < 1.0; });
}

// One direction's composed, discretised PRV of a run and its round-off estimate.
struct Built {
  bool trivial = true;   // no step can leak (no phase with q > 0 and steps > 0): S = 0
  Composition composition;
  double absolute = 0.0;  // D_R of Note [PRV error budget], (4)
  double relative = 0.0;  // R of Note [PRV error budget], (4)
};

// Note [PRV error budget] for one direction, on phases already merged by merge_phases().
Built build(const std::vector<Phase>& merged, PrvDirection direction, double eps_error,
            double delta_error) {
  Built built;
  if (merged.empty()) return built;
  built.trivial = false;
  const std::string which = std::string(prv_detail::direction_name(direction)) + " direction";

  double total_steps = 0.0;
  for (const Phase& phase : merged) total_steps += static_cast<double>(phase.steps);
  const double distinct = static_cast<double>(merged.size());

  // (2) Mesh from Hoeffding with D_H = delta_error / 6 [GLW21, Thm. 5.5].
  const double hoeffding = delta_error / 6.0;
  const double mesh = eps_error / std::sqrt(total_steps * std::log(2.0 / hoeffding) / 2.0);
  if (!(mesh > 0.0 && std::isfinite(mesh))) {
    throw std::runtime_error("PRV mesh is not a positive finite number (" + format_double(mesh) +
                             ") for eps_error = " + format_double(eps_error) +
                             ", delta_error = " + format_double(delta_error) + ", " +
                             format_double(total_steps) + " steps");
  }

  // (1) Truncation and discretisation of each phase: each tail of each step delta_error / (48 P n).
  std::vector<DiscretePrv> discrete;
  std::vector<int64_t> steps;
  double truncation = 0.0;
  for (const Phase& phase : merged) {
    const SubsampledGaussianPrv prv(phase.q, phase.sigma, direction);
    const double n = static_cast<double>(phase.steps);
    const double tail = delta_error / (48.0 * distinct * n);
    const double lower = prv.lower_quantile(tail);
    const double upper = prv.upper_quantile(tail);
    discrete.push_back(prv_detail::discretise(prv, mesh, lower, upper, kMaxFftSize));
    steps.push_back(phase.steps);
    truncation += n * discrete.back().dropped;
  }
  // The quantiles hit their targets up to the round trip through (PRV-1) (~1e-4 relative in the
  // far tail next to log(1-q)); check that (1) really stays within its share.
  if (!(truncation <= 1.01 * delta_error / 24.0)) {
    throw std::runtime_error("PRV truncation (" + which + ") dropped mass " +
                             format_double(truncation) +
                             ", more than its share delta_error / 24 = " +
                             format_double(delta_error / 24.0));
  }

  // (3) Window of the composed lattice index from Chernoff bounds, each end delta_error / 24.
  const double wrap_tail = delta_error / 24.0;
  const auto [window_low, window_high] =
      prv_detail::chernoff_window(discrete, steps, std::log(wrap_tail));
  double offset = 0.0;
  for (std::size_t p = 0; p < discrete.size(); ++p) {
    offset += static_cast<double>(steps[p]) * discrete[p].shift;
  }
  const double first_real = std::floor((window_low - offset) / mesh);
  const double last_real = std::ceil((window_high - offset) / mesh);
  const double needed_real = last_real - first_real + 1.0;
  if (!(needed_real <= static_cast<double>(kMaxFftSize))) {
    throw std::runtime_error(
        "PRV of the composition (" + which + ") spans [" + format_double(window_low) + ", " +
        format_double(window_high) + "], " + format_double(needed_real) +
        " lattice points of mesh " + format_double(mesh) + " (limit " +
        std::to_string(kMaxFftSize) + "; the privacy loss is too large or the mesh too fine): "
        "increase eps_error (now " + format_double(eps_error) + ") or use the RDP accountant");
  }
  const int64_t needed = static_cast<int64_t>(needed_real);
  const int64_t size = prv_detail::fast_fft_size(needed);
  if (size > kMaxFftSize) {
    throw std::runtime_error("PRV FFT size " + std::to_string(size) + " (" + which +
                             ") exceeds the limit " + std::to_string(kMaxFftSize) +
                             ": increase eps_error (now " + format_double(eps_error) +
                             ") or use the RDP accountant");
  }
  // Spread the extra points of the rounded-up size over both ends (more room, less folding).
  const int64_t window_first = static_cast<int64_t>(first_real) - (size - needed) / 2;

  // (4) Round-off, on top of delta_error.
  built.composition = prv_detail::compose(discrete, steps, window_first, size);
  built.absolute = built.composition.roundoff_absolute;
  built.relative = built.composition.roundoff_relative;
  if (!(built.relative <= kMaxRelativeRoundoff) || !std::isfinite(built.absolute)) {
    throw std::runtime_error("PRV FFT round-off (" + which + ", relative " +
                             format_double(built.relative) + ", absolute " +
                             format_double(built.absolute) + ", " + format_double(total_steps) +
                             " steps) is too large: use the RDP accountant");
  }
  return built;
}

double clamp_epsilon(double eps) {
  if (std::isnan(eps)) throw std::runtime_error("PRV accountant produced a NaN epsilon");
  return eps > 0.0 ? eps : 0.0;  // -inf (every eps >= 0 meets the target) -> 0
}

// epsilon(delta) bounds of one direction from (B).
PrvEpsilon epsilon_bounds(const Built& built, double delta, double delta_error,
                          const PrvOptions& options) {
  PrvEpsilon result;
  if (built.trivial) return result;  // S = 0: delta(eps) = 0 for every eps >= 0
  const ComposedPrv& prv = built.composition.prv;
  if (!(built.absolute <= kMaxRoundoffShareOfDelta * delta)) {
    throw std::runtime_error(
        "PRV FFT round-off (~" + format_double(built.absolute) + " on " +
        std::to_string(prv.size()) + " points) is more than " +
        format_double(kMaxRoundoffShareOfDelta) + " of delta = " + format_double(delta) +
        ": delta is too small for a double-precision PRV accountant; use the RDP accountant");
  }
  if (!(delta - delta_error - built.absolute > 0.0)) {
    throw std::runtime_error(
        "PRV cannot certify an epsilon upper bound: delta_error (" + format_double(delta_error) +
        ") plus round-off (~" + format_double(built.absolute) + ") is not below delta (" +
        format_double(delta) + "); decrease delta_error");
  }
  // From (B): with e_u = eps~((delta - delta_error - D_R) / (1 + R)) + eta,
  // delta_S(e_u) <= delta~(e_u - eta) (1 + R) + delta_error + D_R = delta, so e_u is an upper
  // bound; symmetrically e_l = eps~((delta + delta_error + D_R) / (1 - R)) - eta has
  // delta_S(e_l) >= delta, a lower bound. eps~ is the inverse of delta~.
  const double r = built.relative;
  const double slack = delta_error + built.absolute;
  result.estimate = clamp_epsilon(prv.epsilon(delta));
  result.upper = clamp_epsilon(prv.epsilon((delta - slack) / (1.0 + r)) + options.eps_error);
  result.lower = clamp_epsilon(prv.epsilon((delta + slack) / (1.0 - r)) - options.eps_error);
  if (!std::isfinite(result.upper)) {
    throw std::runtime_error("PRV accountant produced a non-finite epsilon upper bound " +
                             format_double(result.upper) + " for delta = " + format_double(delta));
  }
  return result;
}

// delta(epsilon) bounds of one direction: directly (B).
PrvDelta delta_bounds(const Built& built, double epsilon, double delta_error,
                      const PrvOptions& options) {
  PrvDelta result;
  if (built.trivial) return result;
  const ComposedPrv& prv = built.composition.prv;
  const double r = built.relative;
  const double slack = delta_error + built.absolute;
  result.estimate = prv.delta(epsilon);
  result.upper = std::min(1.0, prv.delta(epsilon - options.eps_error) * (1.0 + r) + slack);
  result.lower = std::max(0.0, prv.delta(epsilon + options.eps_error) * (1.0 - r) - slack);
  if (!std::isfinite(result.estimate) || !std::isfinite(result.upper) ||
      !std::isfinite(result.lower)) {
    throw std::runtime_error("PRV accountant produced a non-finite delta for epsilon = " +
                             format_double(epsilon));
  }
  return result;
}

void validate_phases(const std::vector<Phase>& phases) {
  for (const Phase& phase : phases) validate_phase(phase);
}

}  // namespace

namespace {
// The elementwise max of two directions' bounds (Note [PRV directions]): PrvEpsilon or PrvDelta.
template <typename Bounds>
Bounds worse_of(const Bounds& a, const Bounds& b) {
  return Bounds{std::max(a.lower, b.lower), std::max(a.estimate, b.estimate),
                std::max(a.upper, b.upper)};
}
}  // namespace

PrvEpsilon PrvAccountant::epsilon(double delta, const PrvOptions& options) const {
  const double delta_error = epsilon_delta_error(delta, options);
  const std::vector<Phase> merged = merge_phases(phases());
  PrvEpsilon result = epsilon_bounds(
      build(merged, PrvDirection::kRemove, options.eps_error, delta_error), delta, delta_error,
      options);
  if (has_subsampled_phase(merged)) {
    // (D2) of Note [PRV directions], each of lower / estimate / upper.
    const PrvEpsilon add = epsilon_bounds(
        build(merged, PrvDirection::kAdd, options.eps_error, delta_error), delta, delta_error,
        options);
    result = worse_of(result, add);
  }
  return result;
}

PrvDelta PrvAccountant::delta(double epsilon, const PrvOptions& options) const {
  const double delta_error = delta_delta_error(epsilon, options);
  const std::vector<Phase> merged = merge_phases(phases());
  PrvDelta result = delta_bounds(
      build(merged, PrvDirection::kRemove, options.eps_error, delta_error), epsilon, delta_error,
      options);
  if (has_subsampled_phase(merged)) {
    // (D1) of Note [PRV directions], elementwise.
    const PrvDelta add = delta_bounds(
        build(merged, PrvDirection::kAdd, options.eps_error, delta_error), epsilon, delta_error,
        options);
    result = worse_of(result, add);
  }
  return result;
}

namespace prv_detail {

PrvDelta directional_delta(const std::vector<Phase>& phases, PrvDirection direction,
                           double epsilon, const PrvOptions& options) {
  validate_phases(phases);
  const double delta_error = delta_delta_error(epsilon, options);
  return delta_bounds(build(merge_phases(phases), direction, options.eps_error, delta_error),
                      epsilon, delta_error, options);
}

PrvEpsilon directional_epsilon(const std::vector<Phase>& phases, PrvDirection direction,
                               double delta, const PrvOptions& options) {
  validate_phases(phases);
  const double delta_error = epsilon_delta_error(delta, options);
  return epsilon_bounds(build(merge_phases(phases), direction, options.eps_error, delta_error),
                        delta, delta_error, options);
}

}  // namespace prv_detail

}  // namespace dpzero::accounting
