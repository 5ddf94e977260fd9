// accounting/prv_numerics.h — numerical building blocks of the PRV accountant (private to
// accounting/; the public interface is prv.h):
//   * PrvDirection: which order of the neighbouring pair a PRV describes (remove or add);
//   * SubsampledGaussianPrv: the privacy random variable (PRV) of one Poisson-subsampled Gaussian
//     step in either direction, its CDF and survival function in closed form, tail quantiles and
//     truncated mean;
//   * DiscretePrv / discretise(): the truncated PRV on a lattice of mesh h with a mean correction;
//   * chernoff_window(): where the composed discrete PRV lives (tails bounded by Chernoff);
//   * ComposedPrv / compose(): the FFT composition of all phases and its delta(eps) / eps(delta);
//   * directional_delta() / directional_epsilon(): one direction's bounds with the full error
//     budget (implemented in prv.cpp; PrvAccountant reports the max over both directions).
//
// Reference: [GLW21] Gopi, Lee, Wutschitz. "Numerical Composition of Differential Privacy",
// NeurIPS 2021 (arXiv:2106.02848). The error analysis that ties these pieces together (mesh,
// truncation, wrap-around and round-off budgets) lives in prv.cpp, Note [PRV error budget]; why
// both directions are needed, in Note [PRV directions] there.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "accounting/prv.h"
#include "accounting/types.h"

namespace dpzero::accounting::prv_detail {

// The two orders of a neighbouring pair under add/remove adjacency (Note [PRV directions],
// prv.cpp). With M0 = N(0, s^2) (the example absent) and M1 = (1-q) N(0, s^2) + q N(1, s^2)
// (present, sampled with probability q):
enum class PrvDirection {
  kRemove,  // (P, Q) = (M1, M0): the neighbouring dataset lacks the example
  kAdd,     // (P, Q) = (M0, M1): the neighbouring dataset has one more example
};

// "remove" / "add", for messages.
const char* direction_name(PrvDirection direction);

// Privacy random variable Y = log(P(X) / Q(X)), X ~ P, of one step of the Poisson-subsampled
// Gaussian mechanism with sample rate q in (0, 1] and noise multiplier sigma > 0 (sensitivity 1)
// [GLW21, Def. 3.1 and §6], in either direction. Both directions go through one map of x,
//   g(x) = log(M1(x) / M0(x)) = log(1 - q + q e^z),   z = (2x - 1) / (2 s^2),          (PRV-1)
// (s = sigma), increasing in x, with inverse in terms of z
//   z(t) = log((e^t - 1 + q) / q)   for t > log(1 - q)   (-inf at or below).           (PRV-2)
// Remove: Y = g(X), X ~ M1; Y is increasing in X, supported on (log(1-q), inf), and since
// X <= s^2 z + 1/2 and X is N(0, s^2) or N(1, s^2) with weights 1-q, q,
//   P(Y <= t) = (1-q) Phi(s z(t) + 1/(2s)) + q Phi(s z(t) - 1/(2s)).                   (PRV-3)
// Add: Y = -g(X), X ~ M0 (log(M0/M1) = -g); Y is decreasing in X, supported on
// (-inf, -log(1-q)), and Y <= t  <=>  g(X) >= -t  <=>  X >= s^2 z(-t) + 1/2, so
//   P(Y <= t) = Phi_c(s z(-t) + 1/(2s)),   P(Y > t) = Phi(s z(-t) + 1/(2s)).           (PRV-4)
// Survival functions are the formulas with Phi and Phi_c = 1 - Phi exchanged, evaluated through
// erfc so that both tails keep full relative precision. For q = 1 both directions are
// Y ~ N(1/(2 s^2), 1/s^2) (the Gaussian PLRV, symmetric in P and Q); the add direction is then
// computed as the remove direction, so that the two give bit-identical results.
class SubsampledGaussianPrv {
 public:
  // Requires 0 < q <= 1 and sigma > 0 finite (checked by the caller, prv.cpp).
  SubsampledGaussianPrv(double q, double sigma, PrvDirection direction = PrvDirection::kRemove);

  double q() const { return q_; }
  double sigma() const { return sigma_; }
  PrvDirection direction() const { return direction_; }
  // Infimum of the support: log(1 - q) for remove (-inf for q = 1), -inf for add.
  double support_lower() const { return support_lower_; }
  // Supremum of the support: +inf for remove, -log(1 - q) for add.
  double support_upper() const { return support_upper_; }

  // z(t) of (PRV-2) (the remove direction's loss t to z, in both directions); -inf at or below
  // log(1 - q).
  double z_of_loss(double t) const;
  // g as a function of z, (PRV-1), stable for |z| large (the remove direction's loss).
  double loss_of_z(double z) const;

  double cdf(double t) const;  // P(Y <= t)
  double sf(double t) const;   // P(Y > t)

  // A loss t with P(Y <= t) <= tail (as large as bisection finds; support_lower() if the whole
  // lower tail already qualifies). 0 < tail < 1/2.
  double lower_quantile(double tail) const;
  // A loss t with P(Y > t) <= tail (as small as bisection finds; support_upper() if the whole
  // upper tail already qualifies). 0 < tail < 1/2.
  double upper_quantile(double tail) const;

  // E[Y | lower < Y <= upper], by composite Gauss-Legendre quadrature over X (where the integrand
  // is smooth): E[Y 1{.}] = int +-g(x) p_X(x) dx with g from (PRV-1).
  double truncated_mean(double lower, double upper) const;

 private:
  // (PRV-3) and its survival function at z = z(t) (remove direction).
  double cdf_z(double z) const;
  double sf_z(double z) const;

  double q_;
  double sigma_;
  PrvDirection direction_;
  double log_q_;
  double log_one_minus_q_;  // log(1 - q), where z(t) of (PRV-2) becomes -inf
  double support_lower_;
  double support_upper_;
};

// The truncated PRV of one step discretised on the lattice {k h} [GLW21, §5, Alg. 1]:
// the cell C_k = ((k - 1/2) h, (k + 1/2) h] ∩ (lower, upper] gets mass P(Y in C_k), placed at
// k h + shift. The common shift makes the discrete mean equal the continuous truncated mean
// (the bias correction of [GLW21, §5]; mathematically |shift| <= h/2 since every conditional cell
// mean lies inside its cell). Mass outside (lower, upper] is dropped, so the sequence is
// defective: sum(mass) = 1 - dropped.
struct DiscretePrv {
  double mesh = 0.0;           // h
  int64_t first_index = 0;     // lattice index k of mass[0]
  std::vector<double> mass;    // [K] P(Y in C_k), k = first_index .. first_index + K - 1
  double shift = 0.0;          // value of mass[i] is (first_index + i) * mesh + shift
  double dropped = 0.0;        // P(Y <= lower) + P(Y > upper)
  double continuous_mean = 0.0;  // E[Y | lower < Y <= upper]

  double value(std::size_t i) const {
    return static_cast<double>(first_index + static_cast<int64_t>(i)) * mesh + shift;
  }
  // log sum_i mass[i] exp(lambda * value(i)), for any real lambda, without overflow.
  double log_mgf(double lambda) const;
};

// Throws std::runtime_error when the cell count exceeds max_cells or when the discrete mean is
// not within h/2 of the continuous mean (loss of precision in the CDF or the quadrature).
DiscretePrv discretise(const SubsampledGaussianPrv& prv, double mesh, double lower, double upper,
                       int64_t max_cells);

// Chernoff bounds for S = sum over phases of steps[i] independent copies of phases[i]'s discrete
// (defective) variable: returns (a, b) with P(S < a) <= e^log_tail and P(S > b) <= e^log_tail,
//   P(S > b) <= min_{l>0} exp(K(l) - l b),  P(S < a) <= min_{l>0} exp(K(-l) + l a),
//   K(l) = sum_i steps[i] log E[e^{l V_i}],
// each optimised over l by golden-section search in log l (the bound is quasi-convex in l).
// a and b are also clipped to the support of S. log_tail < 0.
std::pair<double, double> chernoff_window(const std::vector<DiscretePrv>& phases,
                                          const std::vector<int64_t>& steps, double log_tail);

// Smallest n' >= n with n' a multiple of 4 and of the form 2^a 3^b 5^c: Eigen's kissfft runs its
// real-input fast path on multiples of 4 and has radix-2/3/4/5 butterflies.
int64_t fast_fft_size(int64_t n);

// The composed discrete PRV on the window of lattice indices [first_index, first_index + size):
// value(j) = (first_index + j) h + offset, with pmf[j] >= 0.
class ComposedPrv {
 public:
  ComposedPrv() = default;
  ComposedPrv(double mesh, int64_t first_index, double offset, std::vector<double> pmf);

  std::size_t size() const { return pmf_.size(); }
  double mesh() const { return mesh_; }
  double value(std::size_t j) const {
    return static_cast<double>(first_index_ + static_cast<int64_t>(j)) * mesh_ + offset_;
  }
  const std::vector<double>& pmf() const { return pmf_; }
  double total_mass() const { return tail_mass_.empty() ? 0.0 : tail_mass_[0]; }

  // delta(eps) = sum_j pmf[j] (1 - e^(eps - value(j)))_+   [GLW21, Eq. (2) / Thm. 3.5], any real
  // eps. 0 for an empty distribution.
  double delta(double eps) const;
  // The smallest eps (possibly negative) with delta(eps) <= target, target > 0. delta is
  // continuous and non-increasing with delta(-inf) = total_mass() and delta(last value) = 0, so a
  // finite answer exists unless target >= total_mass(), where -inf is returned.
  double epsilon(double target) const;

 private:
  // Index of the first lattice point strictly above eps (size() if none).
  std::size_t first_above(double eps) const;

  double mesh_ = 0.0;
  int64_t first_index_ = 0;
  double offset_ = 0.0;
  std::vector<double> pmf_;
  // [size + 1] tail_mass_[j] = sum_{i >= j} pmf[i], summed from the small end of the tail up, so
  // each tail sum has relative error <= size * eps_machine / 2 (no cancellation: all terms >= 0).
  std::vector<double> tail_mass_;
  // [size + 1] tail_weighted_[j] = sum_{i >= j} pmf[i] e^{-(i - j) h}; every exponent <= 0, so
  // delta(eps) = tail_mass_[j] - e^{eps - value(j)} tail_weighted_[j] never overflows.
  std::vector<double> tail_weighted_;
};

struct Composition {
  ComposedPrv prv;
  // Estimated floating-point round-off of the FFT pipeline (Note [PRV round-off] in
  // prv_numerics.cpp): |delta_computed(eps) - delta_exact(eps)| <= roundoff_absolute +
  // roundoff_relative * delta_computed(eps), where delta_exact is the curve of the exact discrete
  // sum on the window.
  double roundoff_absolute = 0.0;
  double roundoff_relative = 0.0;
};

// pmf of sum_i steps[i] copies of phases[i] (all on the same mesh) by FFT on a circular domain of
// `size` points [GLW21, §5, Alg. 1]: each phase is placed at (lattice index mod size), transformed
// once, raised to its step count pointwise in the frequency domain (binary exponentiation), the
// phases are multiplied, and one inverse transform gives the distribution of the lattice index of
// S modulo `size`. The window [window_first, window_first + size) is read back; mass of S outside
// the window is folded into it (the caller bounds it with chernoff_window()). size must be a
// multiple of 4 (fast_fft_size()).
Composition compose(const std::vector<DiscretePrv>& phases, const std::vector<int64_t>& steps,
                    int64_t window_first, int64_t size);

// One direction's privacy curve of the composition of `phases`, with the full error budget of
// Note [PRV error budget] (prv.cpp): the same validation, defaults and failure modes as
// PrvAccountant::delta / epsilon, which return the elementwise max of these over both directions
// (Note [PRV directions]). Exposed so that tests can check each direction against its own oracle.
PrvDelta directional_delta(const std::vector<Phase>& phases, PrvDirection direction,
                           double epsilon, const PrvOptions& options = {});
PrvEpsilon directional_epsilon(const std::vector<Phase>& phases, PrvDirection direction,
                               double delta, const PrvOptions& options = {});

}  // namespace dpzero::accounting::prv_detail
