// privacy/banded.h — banded Toeplitz strategies for correlated noise across steps (the matrix
// factorization mechanisms of DP-FTRL; McKenna et al. 2024 "Scaling up the banded matrix
// factorization mechanism"; Choquette-Choo et al. 2023 "(Amplified) Banded Matrix
// Factorization"; Kalinin & Lampert 2024 "Banded Square Root Matrix Factorization").
//
// Note [banded strategies]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Training's workload is the prefix sums of the gradients: A is the n × n lower-triangular
// matrix of ones. A factorization A = B·C with C lower triangular releases B·(C·G + Z) =
// A·G + B·Z, which is DP-SGD with the noise of step t replaced by w_t = (C⁻¹ z)_t. When C is
// b-banded (C[t, s] = 0 for t − s ≥ b), C⁻¹z is computed by back-substitution from the b − 1
// previous w's alone:
//   w_t = (z_t − Σ_{j=1}^{b−1} C[t, t−j] · w_{t−j}) / C[t, t]
// (Choquette-Choo et al. 2023, §2). b = 1 with C = I is DP-SGD. Here C is Toeplitz:
// C[t, t−k] = c_k for k < b.
//
// Sensitivity. One example that participates in steps π changes C·G by Σ_{i∈π} C[:, i]·g_iᵀ with
// ‖g_i‖ ≤ 1 (after clipping, in units of the clip norm). Column i of a b-banded C is supported on
// rows i .. i+b−1, so participations at least b apart have disjoint supports and the squared
// Frobenius norm of the change is Σ_{i∈π} ‖C[:, i]‖² whatever the g_i. Column norms of a
// Toeplitz C do not increase with i (later columns are cut by the end of the run), so over every
// π of at most k participations at least s ≥ b apart the largest is the earliest: columns 0, s,
// 2s, …, (k−1)s. sensitivity_squared returns that sum, which is exact (McKenna et al. 2024, §3,
// the min-separation sensitivity; Choquette-Choo et al. 2023, Thm 2 for the banded case).
//
// Error. With unit-variance noise, the prefix sums' error is B·Z, B = A·C⁻¹. C⁻¹ is lower
// triangular Toeplitz with the power-series inverse of c (d_0 = 1/c_0, d_k = −Σ_{j=1}^{min(k,
// b−1)} c_j d_{k−j} / c_0), and A·C⁻¹ is Toeplitz with the prefix sums e_k = Σ_{j≤k} d_j, so
// ‖B‖_F² = Σ_{k<n} (n − k)·e_k². mean_squared_error returns ‖B‖_F² / n, the expected squared error
// of a prefix sum, averaged over the n steps, per unit of noise variance (Kalinin & Lampert 2024,
// §2, the "MeanSE" of a factorization before the sensitivity scales it). DP-SGD's is (n + 1)/2.
//
// Note [optimized banded strategies]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// What a strategy costs in noise is its error after the sensitivity is normalised: the noise is
// scaled by κ = ‖c‖ (every full column's norm; later columns are shorter), so the expected squared
// error of a prefix sum per unit σ² is f(c) = ‖c‖² · MeanSE(c, n). sqrt_prefix_sum's truncation
// is not the banded minimiser of f; optimized() minimises f over c_1 .. c_{b−1} with c_0 = 1 fixed
// (f is invariant to scaling c), the objective McKenna et al. 2024 (§4) optimise over banded
// matrices, here kept Toeplitz so that the run needs only b numbers. f is smooth wherever C⁻¹'s
// power series stays bounded on n steps; from sqrt_prefix_sum a damped Newton iteration: the
// gradient exact (reverse-mode through the recursion of d, O(n b)), the Hessian by central
// differences of the gradient (O(n b²) an iteration), a step accepted only where f decreases (halved until it does; the
// gradient's direction where the Hessian is not positive definite), stopping when f falls by less
// than 1e-12 of itself or after 200 iterations. The result is a local minimum no worse than the
// start; tests/python/test_banded.py checks it against SciPy's minimiser on dense matrices.
#pragma once

#include <cstdint>
#include <vector>

namespace dpzero::privacy {

class BandedToeplitz {
 public:
  // coefficients: c_0 .. c_{b−1}, all finite, c_0 > 0 (b >= 1 bands). Throws
  // std::invalid_argument naming the bad value.
  explicit BandedToeplitz(std::vector<double> coefficients);

  // The identity (b = 1): DP-SGD's independent noise.
  static BandedToeplitz identity();
  // The banded square root of the prefix-sum workload: c_k = binom(2k, k) / 4^k, the
  // coefficients of (1 − x)^(−1/2), for k < bands (Kalinin & Lampert 2024, §3). With bands >= n
  // it is A^(1/2) exactly on an n-step run.
  static BandedToeplitz sqrt_prefix_sum(int64_t bands);
  // Note [optimized banded strategies]: the b-banded Toeplitz strategy with c_0 = 1 of least
  // expected error for an n-step run (a local minimum reached from sqrt_prefix_sum). Throws
  // std::invalid_argument for bands or n < 1, and for n·b² above kMaxOptimizedWork.
  static BandedToeplitz optimized(int64_t bands, int64_t n);
  // The largest n·b² optimized() takes: an iteration costs O(n·b²) and the fit holds 2n
  // doubles.
  static constexpr double kMaxOptimizedWork = 1e10;

  // Whether `coefficients` can be a run's strategy of `bands` bands (Note [run strategy] in
  // src/dp/run.h): exactly b finite numbers, c_0 = 1, and a finite full column norm κ (the
  // noise's scale).
  static bool is_run_strategy(const std::vector<double>& coefficients, int64_t bands);

  int64_t bands() const { return static_cast<int64_t>(c_.size()); }
  const std::vector<double>& coefficients() const { return c_; }

  // Note [banded strategies]: w_t from z_t and the previous w's, newest first (w_{t−1},
  // w_{t−2}, …; only the first b − 1 are read, fewer at a run's start).
  double next(double z, const std::vector<double>& previous) const;
  // ‖C[:, i]‖ of an n-step run (0 <= i < n).
  double column_norm(int64_t n, int64_t i) const;
  // The squared sensitivity (in units of the clip norm) of an n-step run whose examples
  // participate at most max_participations times, any two at least `separation` >= b steps
  // apart. Throws std::invalid_argument for a separation below b (the columns' supports would
  // overlap) and for n, separation or max_participations < 1.
  double sensitivity_squared(int64_t n, int64_t separation, int64_t max_participations) const;
  // ‖A·C⁻¹‖_F² / n of an n-step run: the mean squared error of a prefix sum per unit of noise
  // variance.
  double mean_squared_error(int64_t n) const;

 private:
  std::vector<double> c_;
};

}  // namespace dpzero::privacy
