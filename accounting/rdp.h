// accounting/rdp.h — Rényi-DP accountant for the Poisson-subsampled Gaussian mechanism.
//
// References:
//  [MTZ19] Mironov, Talwar, Zhang. "Rényi Differential Privacy of the Sampled Gaussian Mechanism",
//          arXiv:1908.10530, 2019. Integer orders: §3.3 (binomial sum); fractional orders: §3.3,
//          two-sided series with erfc terms.
//  [BBGHS20] Balle, Barthe, Gaboardi, Hsu, Sato. "Hypothesis testing interpretations and Rényi
//          differential privacy", AISTATS 2020, Thm. 21 (RDP -> (eps, delta) conversion).
// Sums for A_alpha run in log space; the Gauss-Hermite branch (large sigma) sums bounded
// non-negative terms of A_alpha - 1 and takes log1p at the end.
#pragma once

#include <cstdint>
#include <vector>

#include "accounting/accountant.h"
#include "accounting/types.h"

namespace dpzero::accounting {

// Opacus's default order grid: [1 + x/10 for x in 1..99] + [12 .. 63].
std::vector<double> opacus_default_orders();
// TF-Privacy's default grid: [1.25,1.5,1.75,2,2.25,2.5,3,3.5,4,4.5] + [5..63] + [128,256,512].
std::vector<double> tfp_default_orders();

// log A_alpha for one step of the sampled Gaussian mechanism [MTZ19, §3.3]; 1 < alpha <= 1e5.
// q = 0 gives 0 (RDP of a never-sampled mechanism is 0); q = 1 gives the plain Gaussian value
// alpha (alpha-1) / (2 sigma^2) (RDP = log A / (alpha-1) = alpha / (2 sigma^2)).
// Integer alpha: the binomial sum, summed as A - 1 (all terms positive). Fractional alpha: the
// two-sided erfc series (also summed as A - 1, alternating tail by Euler's transform); for
// sigma >= max(100, 2 alpha), where that series cancels, Gauss-Hermite quadrature of the defining
// integral. Relative error < 1e-9 against mpmath over q in [1e-8, 0.999], sigma in [0.1, 1e5].
// Throws std::invalid_argument naming the bad q, sigma or alpha.
double compute_log_a(double q, double sigma, double alpha);

// RDP epsilon at each order for `steps` compositions: steps * log A_alpha / (alpha - 1).
std::vector<double> compute_rdp(double q, double sigma, int64_t steps,
                                const std::vector<double>& orders);

struct RdpEpsilon {
  double epsilon = 0.0;     // >= 0 always
  double best_order = 0.0;  // the order attaining the minimum
  bool order_on_edge = false;  // best order is the smallest or largest of the grid: widen the grid
};

// (eps, delta) from an RDP curve by [BBGHS20, Thm. 21]:
//   eps = min_a [ r_a + log((a-1)/a) - (log(delta) + log(a)) / (a-1) ], clamped at 0.
RdpEpsilon rdp_to_epsilon(const std::vector<double>& orders, const std::vector<double>& rdp,
                          double delta);
// delta for a given eps from an RDP curve: [BBGHS20, Thm. 21] solved for delta,
//   delta = min_a exp((a-1) (r_a - eps + log(1 - 1/a)) - log(a)), capped at 1,
// the exact inverse of rdp_to_epsilon (the two round-trip). An order with r_a = +inf is skipped
// (no bound there); all +inf gives eps = +inf and delta = 1. Both throw std::invalid_argument for
// an empty grid, an order <= 1, NaN or negative r_a, or a bad delta / epsilon, naming the value.
double rdp_to_delta(const std::vector<double>& orders, const std::vector<double>& rdp,
                    double epsilon);

// Accumulates the RDP curve of its phases (accountant.h); cheap to copy.
class RdpAccountant final : public Accountant {
 public:
  explicit RdpAccountant(std::vector<double> orders = opacus_default_orders());

  AccountantKind kind() const override { return AccountantKind::kRdp; }
  // (0, 0) while no phase releases anything (Note [nothing released] in rdp.cpp).
  RdpEpsilon epsilon(double delta) const;
  double get_epsilon(double delta) const override { return epsilon(delta).epsilon; }
  double delta(double epsilon) const;

  const std::vector<double>& orders() const { return orders_; }
  const std::vector<double>& rdp() const { return rdp_; }  // accumulated, one per order

 private:
  void compose(const Phase& phase) override;

  std::vector<double> orders_;
  std::vector<double> rdp_;
};

}  // namespace dpzero::accounting
