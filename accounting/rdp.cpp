// accounting/rdp.cpp — Rényi-DP of the Poisson-subsampled Gaussian mechanism: log A_alpha
// [MTZ19, §3.3], composition over phases, and the RDP -> (eps, delta) conversions [BBGHS20, Thm. 21].
//
// Notation (MTZ19): mu0 = N(0, sigma^2), mu1 = N(1, sigma^2), mu = (1-q) mu0 + q mu1. One step of
// the sampled Gaussian mechanism is (alpha, log(A_alpha) / (alpha-1))-RDP with
//   A_alpha = E_{z~mu0}[ (mu(z) / mu0(z))^alpha ]  >= 1 (Jensen), so log A_alpha >= 0.
// Everything below works with logarithms of positive quantities; -inf represents 0.
#include "accounting/rdp.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include <Eigen/Eigenvalues>

namespace dpzero::accounting {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kPi = 3.141592653589793;
constexpr double kLogPi = 1.1447298858494002;  // log(pi)

// Orders above this are refused: the integer sum and the fractional series both cost O(alpha)
// terms per order, and such orders never attain the minimum for any practical (q, sigma, delta).
constexpr double kMaxOrder = 1e5;

// A series term (or tail estimate) whose log is this far below the positive mass summed so far
// is negligible: e^-40 ~ 4e-18 relative, below the rounding error of the sum.
constexpr double kSeriesLogCutoff = 40.0;

// log(e^a + e^b).
double log_add(double a, double b) {
  const double hi = std::max(a, b);
  const double lo = std::min(a, b);
  if (lo == -kInf) return hi;
  return hi + std::log1p(std::exp(lo - hi));
}

// log(1 - e^x) for x <= 0, accurate near both ends (Maechler's log1mexp split at -log 2).
double log1m_exp(double x) {
  if (x > -0.6931471805599453) return std::log(-std::expm1(x));
  return std::log1p(-std::exp(x));
}

// log(e^a - e^b) for a >= b.
double log_sub(double a, double b) {
  if (b == -kInf) return a;
  if (b >= a) return -kInf;
  return a + log1m_exp(b - a);
}

// log(e^x - 1) for x > 0.
double log_expm1(double x) {
  if (x > 30.0) return x + std::log1p(-std::exp(-x));  // e^-x below 1e-13: no cancellation
  return std::log(std::expm1(x));
}

// log(1 + e^x) (softplus), stable for all x.
double log1p_exp(double x) {
  if (x > 0.0) return x + std::log1p(std::exp(-x));
  return std::log1p(std::exp(x));
}

// log erfc(x). std::erfc keeps full relative accuracy while its result is a normal double
// (x below ~26.5); past x = 20 we use Laplace's continued fraction
//   erfc(x) = exp(-x^2) / sqrt(pi) * 1 / (x + (1/2) / (x + 1 / (x + (3/2) / (x + 2 / (x + ...)))))
// (Abramowitz & Stegun 7.1.14), which at x >= 20 converges to double precision within a few
// levels; 32 levels, evaluated from the bottom up, are ample.
double log_erfc(double x) {
  if (x < 20.0) return std::log(std::erfc(x));
  double tail = x;
  for (int k = 32; k >= 1; --k) tail = x + (0.5 * k) / tail;
  return -x * x - 0.5 * kLogPi - std::log(tail);
}

// log |binom(n, k)| for real n and integer k >= 0, via log|Gamma| (std::lgamma returns log|Gamma|).
double log_abs_binom(double n, double k) {
  return std::lgamma(n + 1.0) - std::lgamma(k + 1.0) - std::lgamma(n - k + 1.0);
}

void validate_order(double alpha) {
  if (!(alpha > 1.0 && alpha <= kMaxOrder)) {  // NaN fails too
    throw std::invalid_argument("RDP order alpha must be in (1, " + format_double(kMaxOrder) +
                                "], got " + format_double(alpha));
  }
}

void validate_orders(const std::vector<double>& orders) {
  if (orders.empty()) throw std::invalid_argument("RDP order grid is empty (no orders given)");
  for (const double alpha : orders) validate_order(alpha);
}

void validate_curve(const std::vector<double>& orders, const std::vector<double>& rdp) {
  validate_orders(orders);
  if (rdp.size() != orders.size()) {
    throw std::invalid_argument("RDP curve has " + std::to_string(rdp.size()) +
                                " values for " + std::to_string(orders.size()) + " orders");
  }
  for (std::size_t i = 0; i < rdp.size(); ++i) {
    if (!(rdp[i] >= 0.0)) {  // NaN fails too; +inf is allowed (no guarantee at that order)
      throw std::invalid_argument("RDP value must be >= 0, got " + format_double(rdp[i]) +
                                  " at order " + format_double(orders[i]));
    }
  }
}

// Integer alpha [MTZ19, §3.3]:
//   A_alpha = sum_{k=0}^{alpha} binom(alpha, k) (1-q)^(alpha-k) q^k exp((k^2 - k) / (2 sigma^2)).
// By the binomial theorem sum_k binom(alpha, k) (1-q)^(alpha-k) q^k = 1, hence
//   A_alpha - 1 = sum_{k=2}^{alpha} binom(alpha, k) (1-q)^(alpha-k) q^k expm1((k^2 - k) / (2 sigma^2))
// (the k = 0, 1 terms have exponent 0). Every term is positive, so log(A - 1) is a plain log-sum
// and log A = log1p(A - 1) keeps full relative precision even when A - 1 ~ 1e-12 (small q),
// where summing A directly would leave only its rounding error.
double log_a_integer(double q, double sigma, int64_t alpha) {
  const double log_q = std::log(q);
  const double log_1mq = std::log1p(-q);
  const double two_var = 2.0 * sigma * sigma;
  const double n = static_cast<double>(alpha);
  double log_a_minus_1 = -kInf;
  for (int64_t k = 2; k <= alpha; ++k) {
    const double kd = static_cast<double>(k);
    const double log_term = log_abs_binom(n, kd) + kd * log_q + (n - kd) * log_1mq +
                            log_expm1((kd * kd - kd) / two_var);
    log_a_minus_1 = log_add(log_a_minus_1, log_term);
  }
  return log1p_exp(log_a_minus_1);
}

// A signed sum kept as two log-space sums, subtracted once at the end.
struct SignedLogSum {
  double log_pos = -kInf;
  double log_neg = -kInf;
  void add(double log_magnitude, bool negative) {
    if (negative) {
      log_neg = log_add(log_neg, log_magnitude);
    } else {
      log_pos = log_add(log_pos, log_magnitude);
    }
  }
  // log of the sum, -inf when it is not positive.
  double log_value() const { return log_pos > log_neg ? log_sub(log_pos, log_neg) : -kInf; }
};

// log((1-q)^alpha - 1 + alpha q) for 0 < q < 1, alpha > 1 (positive by convexity). For
// alpha q < 1/2 the binomial series sum_{k>=2} binom(alpha, k) (-q)^k avoids the cancellation of
// the direct form (successive terms shrink by |alpha - k| q / (k+1) < 1/2). Otherwise the value
// is >= e^-(alpha q) - 1 + alpha q >= 0.1, comparable to alpha q, and the direct form loses
// nothing.
double log_binomial_remainder(double q, double alpha) {
  if (alpha * q >= 0.5) return std::log(std::expm1(alpha * std::log1p(-q)) + alpha * q);
  double term = alpha * (alpha - 1.0) / 2.0 * q * q;
  double sum = term;
  for (int k = 2; k < 200; ++k) {
    term *= (alpha - k) / (k + 1.0) * (-q);
    sum += term;
    if (std::fabs(term) <= 1e-17 * std::fabs(sum)) break;
  }
  return std::log(sum);
}

// Fractional alpha [MTZ19, §3.3]: split the integral at z0, where (1-q) mu0(z0) = q mu1(z0),
//   z0 = sigma^2 log(1/q - 1) + 1/2,
// and expand L^alpha, L = mu/mu0, by the binomial series on each side (convergent because the
// ratio of the two mixture components is < 1 there): A_alpha = A_{alpha,1} + A_{alpha,2} with
//   A_{alpha,1} = sum_{i>=0} binom(alpha, i) (1-q)^(alpha-i) q^i
//                   exp((i^2 - i) / (2 sigma^2)) * erfc((i - z0) / (sqrt(2) sigma)) / 2,
//   A_{alpha,2} = sum_{i>=0} binom(alpha, i) q^(alpha-i) (1-q)^i
//                   exp(((alpha-i)^2 - (alpha-i)) / (2 sigma^2)) * erfc((z0 - (alpha-i)) / (sqrt(2) sigma)) / 2.
//
// Precision for small q. A_alpha - 1 is O(q^2) while A_alpha's leading terms are O(1), so we sum
// A_alpha - 1 instead. Because E_mu0[L] = 1,
//   A_alpha - 1 = E_mu0[ L^alpha - 1 - alpha (L - 1) ],   1 + alpha (L - 1) = (1 - alpha q) + alpha q mu1/mu0,
// and subtracting the linear part region by region (E_mu0[(mu1/mu0) 1{z<z0}] = Phi((z0-1)/sigma))
// turns the i = 0, 1 terms of A_{alpha,1} into
//   c0 Phi(z0/sigma) + c1 Phi((z0-1)/sigma),  c0 = (1-q)^alpha - 1 + alpha q >= 0,
//                                            c1 = alpha q ((1-q)^(alpha-1) - 1) <= 0,
// and adds  -(1 - alpha q) Phi^c(z0/sigma) - alpha q Phi^c((z0-1)/sigma)  for the region z > z0
// (Phi^c = 1 - Phi). Every remaining term is O(q^2) or exponentially small, so log A = log1p(A-1)
// keeps its relative precision when A - 1 ~ 1e-12. What remains is a cancellation between O(q^2)
// terms whose sum is O(q^2 / sigma^2), harmless for sigma <= 100 (relative error < 1e-9 against
// mpmath) but not beyond (~1e-7 at sigma = 1e3, ~1e-3 at 1e5); large sigmas therefore go to
// log_a_gauss_hermite below.
//
// binom(alpha, i) is positive for i <= ceil(alpha) and alternates in sign after, so positive and
// negative terms are accumulated separately. Past i > alpha the terms of both series decay only
// polynomially (~ i^-(alpha+2)) near q = 1/2, so the alternating tail is summed by the Euler
// transform (see euler_tail) once the direct terms stop being negligible.
class FractionalLogA {
 public:
  FractionalLogA(double q, double sigma, double alpha)
      : alpha_(alpha),
        log_q_(std::log(q)),
        log_1mq_(std::log1p(-q)),
        two_var_(2.0 * sigma * sigma),
        sqrt2_sigma_(std::sqrt(2.0) * sigma),
        z0_(sigma * sigma * (log_1mq_ - log_q_) + 0.5),  // log(1/q - 1) = log(1-q) - log(q)
        first_negative_(std::ceil(alpha) + 1.0) {}

  // log |t_i| of the i-th combined term t_i = s1_i + s2_i (s1 only from i = 2 on, see above).
  double log_term(int64_t ii) const {
    const double i = static_cast<double>(ii);
    const double j = alpha_ - i;
    const double log_coef = log_abs_binom(alpha_, i);
    const double log_s2 = log_coef + j * log_q_ + i * log_1mq_ + (j * j - j) / two_var_ +
                          kLogHalf + log_erfc((z0_ - j) / sqrt2_sigma_);
    if (ii < 2) return log_s2;
    const double log_s1 = log_coef + i * log_q_ + j * log_1mq_ + (i * i - i) / two_var_ +
                          kLogHalf + log_erfc((i - z0_) / sqrt2_sigma_);
    return log_add(log_s1, log_s2);
  }

  // Sign of binom(alpha, i): (-1)^(i - ceil(alpha)) for i > ceil(alpha), positive before.
  bool negative(int64_t ii) const {
    const double i = static_cast<double>(ii);
    return i >= first_negative_ && std::fmod(i - first_negative_, 2.0) == 0.0;
  }

  double z0() const { return z0_; }
  double sqrt2_sigma() const { return sqrt2_sigma_; }

 private:
  static constexpr double kLogHalf = -0.6931471805599453;
  double alpha_, log_q_, log_1mq_, two_var_, sqrt2_sigma_, z0_, first_negative_;
};

// Euler transform of an alternating tail sum_{k>=0} (-1)^k b_k, b_k = |t_{start+k}| > 0:
//   sum_k (-1)^k b_k = sum_{m>=0} (-1)^m (Delta^m b)_0 / 2^(m+1)   (Delta = forward difference;
// Euler's transformation of alternating series). For b_k smooth in k the m-th term shrinks like
// (m+p) / (2 start) for b ~ k^-p, so a few dozen terms give double precision. Returns false (no
// estimate) when the transformed terms do not fall below tolerance: the caller then keeps
// summing directly.
// On success *log_tail = log |tail| and the tail has the sign of t_start.
bool euler_tail(const FractionalLogA& series, int64_t start, double log_tolerance,
                double* log_tail) {
  constexpr int kTerms = 40;
  double b[kTerms];
  const double log_b0 = series.log_term(start);
  for (int k = 0; k < kTerms; ++k) b[k] = std::exp(series.log_term(start + k) - log_b0);
  const double tolerance = std::exp(log_tolerance - log_b0);  // relative to b_0
  double sum = 0.0;
  double scale = 0.5;
  int small_in_a_row = 0;
  for (int m = 0; m < kTerms; ++m) {
    const double term = (m % 2 == 0 ? scale : -scale) * b[0];
    sum += term;
    if (std::fabs(term) < tolerance) {
      if (++small_in_a_row == 2) {
        if (!(sum > 0.0 && sum <= 1.0)) return false;
        *log_tail = log_b0 + std::log(sum);
        return true;
      }
    } else {
      small_in_a_row = 0;
    }
    for (int k = 0; k + 1 < kTerms - m; ++k) b[k] = b[k + 1] - b[k];
    scale *= 0.5;
  }
  return false;
}

double log_a_fractional(double q, double sigma, double alpha) {
  const FractionalLogA series(q, sigma, alpha);
  const double z0 = series.z0();
  const double s = series.sqrt2_sigma();
  const double log_half = -0.6931471805599453;
  const double log_alpha_q = std::log(alpha) + std::log(q);

  SignedLogSum sum;  // A_alpha - 1
  // c0 Phi(z0/sigma) and c1 Phi((z0-1)/sigma), Phi(x/sigma) = erfc(-x / (sqrt(2) sigma)) / 2.
  sum.add(log_binomial_remainder(q, alpha) + log_half + log_erfc(-z0 / s), false);
  sum.add(log_alpha_q + std::log(-std::expm1((alpha - 1.0) * std::log1p(-q))) + log_half +
              log_erfc((1.0 - z0) / s),
          true);
  // -(1 - alpha q) Phi^c(z0/sigma) - alpha q Phi^c((z0-1)/sigma).
  const double one_minus_alpha_q = 1.0 - alpha * q;
  if (one_minus_alpha_q != 0.0) {
    sum.add(std::log(std::fabs(one_minus_alpha_q)) + log_half + log_erfc(z0 / s),
            one_minus_alpha_q > 0.0);
  }
  sum.add(log_alpha_q + log_half + log_erfc((z0 - 1.0) / s), true);

  // A_alpha - 1 from the finished sum. Its rounding error is a few ulps of the positive mass P
  // summed; a value below that resolution (large sigma, where A - 1 ~ q^2 / sigma^2 cancels
  // between O(q^2) terms) is replaced by the resolution itself, an upper bound, so that log A is
  // never understated.
  const auto finish = [&sum] {
    const double log_resolution = sum.log_pos + std::log(8.0 * std::numeric_limits<double>::epsilon());
    return log1p_exp(std::max(sum.log_value(), log_resolution));
  };

  // The series. Stopping rule: a term, or the Euler estimate of the whole remaining tail, that is
  // kSeriesLogCutoff below the positive mass summed so far is below the sum's own rounding error.
  // The hard bound on the loop is never reached for orders <= kMaxOrder; hitting it means the
  // series did not converge numerically.
  const int64_t tail_start = static_cast<int64_t>(std::ceil(alpha)) + 2;  // alternating from here
  const int64_t max_terms = tail_start + 1000000;
  int64_t next_euler_try = tail_start;
  for (int64_t i = 0; i < max_terms; ++i) {
    const double log_term = series.log_term(i);
    sum.add(log_term, series.negative(i));
    if (i + 1 < tail_start) continue;
    const double log_tolerance = sum.log_pos - kSeriesLogCutoff;
    if (log_term < log_tolerance) return finish();
    if (i + 1 >= next_euler_try) {
      double log_tail = 0.0;
      if (euler_tail(series, i + 1, log_tolerance, &log_tail)) {
        sum.add(log_tail, series.negative(i + 1));
        return finish();
      }
      next_euler_try = i + 1 + 32;  // not smooth yet (e.g. inside an erfc transition)
    }
  }
  throw std::runtime_error("log A_alpha series did not converge for q = " + format_double(q) +
                           ", sigma = " + format_double(sigma) +
                           ", alpha = " + format_double(alpha));
}

// Large sigma, fractional alpha. There the series above loses relative precision (A - 1 is
// O(q^2 / sigma^2) but its terms are O(q^2)), while the integrand of
//   A_alpha - 1 = E_{z~mu0}[ g(L(z)) ],  g(L) = L^alpha - 1 - alpha (L - 1) >= 0,
//   L(z) = 1 + u(z),  u(z) = q expm1((2z - 1) / (2 sigma^2))
// is as smooth as it gets: with z = sqrt(2) sigma x, g is analytic in the strip
// |Im x| < pi sigma / sqrt(2) (L vanishes only at Im z = pi sigma^2) and grows like
// e^(sqrt(2) alpha x / sigma), so an n-point Gauss–Hermite rule is exact to rounding once
// sigma >= max(kGaussHermiteMinSigma, 2 alpha). Every node contributes a non-negative term, so
// the sum keeps full relative precision.
constexpr double kGaussHermiteMinSigma = 100.0;

struct GaussHermiteRule {
  std::vector<double> nodes;    // [n]
  std::vector<double> weights;  // [n], sum = sqrt(pi)
};

// Orthonormal Hermite polynomials for the weight e^{-x^2}: p_0 = pi^{-1/4},
// p_j = sqrt(2/j) x p_{j-1} - sqrt((j-1)/j) p_{j-2}. Fills p_0..p_n (n + 1 values).
void orthonormal_hermite(double x, int n, double* p) {
  p[0] = std::pow(kPi, -0.25);
  p[1] = std::sqrt(2.0) * x * p[0];
  for (int j = 2; j <= n; ++j) {
    p[j] = std::sqrt(2.0 / j) * x * p[j - 1] - std::sqrt((j - 1.0) / j) * p[j - 2];
  }
}

// Nodes: eigenvalues of the Jacobi matrix (off-diagonal sqrt(k/2)) [Golub & Welsch, Math. Comp.
// 23 (1969)], polished by Newton steps on p_n (p_n' = sqrt(2n) p_{n-1}). Weights: Christoffel
// numbers 1 / sum_{j<n} p_j(x)^2, a sum of squares and so accurate even for the tiny tail weights.
GaussHermiteRule make_gauss_hermite_rule(int n) {
  Eigen::MatrixXd jacobi = Eigen::MatrixXd::Zero(n, n);
  for (int k = 1; k < n; ++k) jacobi(k, k - 1) = jacobi(k - 1, k) = std::sqrt(k / 2.0);
  const Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> solver(jacobi, Eigen::EigenvaluesOnly);
  GaussHermiteRule rule;
  std::vector<double> p(static_cast<std::size_t>(n) + 1);
  for (int i = 0; i < n; ++i) {
    double x = solver.eigenvalues()(i);
    for (int step = 0; step < 3; ++step) {
      orthonormal_hermite(x, n, p.data());
      x -= p[n] / (std::sqrt(2.0 * n) * p[n - 1]);
    }
    orthonormal_hermite(x, n, p.data());
    double sum_sq = 0.0;
    for (int j = 0; j < n; ++j) sum_sq += p[j] * p[j];
    rule.nodes.push_back(x);
    rule.weights.push_back(1.0 / sum_sq);
  }
  return rule;
}

const GaussHermiteRule& gauss_hermite_rule() {
  static const GaussHermiteRule rule = make_gauss_hermite_rule(64);
  return rule;
}

// g(1 + u) = (1+u)^alpha - 1 - alpha u for u > -1, without cancellation: for |alpha u| < 1/2 by
// its binomial series sum_{k>=2} binom(alpha, k) u^k (successive terms shrink by
// |alpha - k| |u| / (k+1) < 1/2); otherwise directly (then g >= ~0.1 |alpha u| or more, and the
// direct form loses nothing).
double binomial_excess(double u, double alpha) {
  if (std::fabs(alpha * u) >= 0.5) return std::expm1(alpha * std::log1p(u)) - alpha * u;
  double term = alpha * (alpha - 1.0) / 2.0 * u * u;
  double sum = term;
  for (int k = 2; k < 200 && term != 0.0; ++k) {
    term *= (alpha - k) / (k + 1.0) * u;
    sum += term;
    if (std::fabs(term) <= 1e-17 * std::fabs(sum)) break;
  }
  return sum;
}

double log_a_gauss_hermite(double q, double sigma, double alpha) {
  const GaussHermiteRule& rule = gauss_hermite_rule();
  const double two_var = 2.0 * sigma * sigma;
  double sum = 0.0;
  for (std::size_t i = 0; i < rule.nodes.size(); ++i) {
    const double z = std::sqrt(2.0) * sigma * rule.nodes[i];
    const double u = q * std::expm1((2.0 * z - 1.0) / two_var);
    sum += rule.weights[i] * binomial_excess(u, alpha);
  }
  // E_{z~N(0, sigma^2)}[f(z)] = pi^{-1/2} sum_i w_i f(sqrt(2) sigma x_i).
  return std::log1p(sum / std::sqrt(kPi));
}

}  // namespace

std::vector<double> opacus_default_orders() {
  std::vector<double> orders;
  orders.reserve(99 + 52);
  for (int x = 1; x <= 99; ++x) orders.push_back(1.0 + x / 10.0);
  for (int a = 12; a <= 63; ++a) orders.push_back(a);
  return orders;
}

std::vector<double> tfp_default_orders() {
  std::vector<double> orders = {1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 3.5, 4.0, 4.5};
  for (int a = 5; a <= 63; ++a) orders.push_back(a);
  orders.push_back(128.0);
  orders.push_back(256.0);
  orders.push_back(512.0);
  return orders;
}

double compute_log_a(double q, double sigma, double alpha) {
  validate_phase(Phase{q, sigma, 0});
  validate_order(alpha);
  // q = 0: the example is never used, mu = mu0 and A_alpha = 1.
  if (q == 0.0) return 0.0;
  // q = 1: the plain Gaussian mechanism, A_alpha = exp(alpha (alpha-1) / (2 sigma^2))
  // [Mironov 2017, "Rényi Differential Privacy", Prop. 7: RDP alpha / (2 sigma^2)].
  if (q == 1.0) return alpha * (alpha - 1.0) / (2.0 * sigma * sigma);
  double log_a = 0.0;
  if (alpha == std::floor(alpha)) {
    log_a = log_a_integer(q, sigma, static_cast<int64_t>(alpha));
  } else if (sigma >= kGaussHermiteMinSigma && sigma >= 2.0 * alpha) {
    log_a = log_a_gauss_hermite(q, sigma, alpha);
  } else {
    log_a = log_a_fractional(q, sigma, alpha);
  }
  // Only reachable for absurd sigmas (~1e-150) whose squares overflow; +inf is a valid answer.
  if (std::isnan(log_a)) {
    throw std::runtime_error("log A_alpha is not representable in double precision for q = " +
                             format_double(q) + ", sigma = " + format_double(sigma) +
                             ", alpha = " + format_double(alpha));
  }
  return log_a;
}

std::vector<double> compute_rdp(double q, double sigma, int64_t steps,
                                const std::vector<double>& orders) {
  validate_phase(Phase{q, sigma, steps});
  validate_orders(orders);
  // RDP composes additively [Mironov 2017, Prop. 1]: steps * log A_alpha / (alpha - 1).
  // log A is computed once per order, never per step.
  std::vector<double> rdp(orders.size(), 0.0);
  if (steps == 0 || q == 0.0) return rdp;
  const double n = static_cast<double>(steps);
  for (std::size_t i = 0; i < orders.size(); ++i) {
    rdp[i] = n * (compute_log_a(q, sigma, orders[i]) / (orders[i] - 1.0));
  }
  return rdp;
}

RdpEpsilon rdp_to_epsilon(const std::vector<double>& orders, const std::vector<double>& rdp,
                          double delta) {
  validate_curve(orders, rdp);
  validate_delta(delta);
  const double log_delta = std::log(delta);
  double best = kInf;
  std::size_t best_index = 0;
  for (std::size_t i = 0; i < orders.size(); ++i) {
    const double a = orders[i];
    // [BBGHS20, Thm. 21]: (a, r)-RDP implies (eps, delta)-DP with
    //   eps = r + log((a-1)/a) - (log(delta) + log(a)) / (a-1).
    const double eps = rdp[i] + std::log1p(-1.0 / a) - (log_delta + std::log(a)) / (a - 1.0);
    if (eps < best) {
      best = eps;
      best_index = i;
    }
  }
  RdpEpsilon result;
  // Every order is a valid bound, so a negative minimum means eps = 0 holds.
  result.epsilon = std::max(0.0, best);
  result.best_order = orders[best_index];
  const auto [lo, hi] = std::minmax_element(orders.begin(), orders.end());
  result.order_on_edge = result.best_order == *lo || result.best_order == *hi;
  return result;
}

double rdp_to_delta(const std::vector<double>& orders, const std::vector<double>& rdp,
                    double epsilon) {
  validate_curve(orders, rdp);
  validate_epsilon(epsilon);
  double best_log_delta = kInf;
  for (std::size_t i = 0; i < orders.size(); ++i) {
    const double a = orders[i];
    // [BBGHS20, Thm. 21] solved for delta (the form used by Canonne, Kamath, Steinke 2020,
    // "The Discrete Gaussian for Differential Privacy", Prop. 12):
    //   log(delta) = (a-1) (r - eps + log(1 - 1/a)) - log(a).
    // It is the exact inverse of rdp_to_epsilon's per-order bound, so the two conversions
    // round-trip.
    const double log_delta = (a - 1.0) * (rdp[i] - epsilon + std::log1p(-1.0 / a)) - std::log(a);
    best_log_delta = std::min(best_log_delta, log_delta);
  }
  return std::min(1.0, std::exp(best_log_delta));
}

RdpAccountant::RdpAccountant(std::vector<double> orders) : orders_(std::move(orders)) {
  validate_orders(orders_);
  rdp_.assign(orders_.size(), 0.0);
}

void RdpAccountant::compose(const Phase& phase) {
  const std::vector<double> rdp = compute_rdp(phase.q, phase.sigma, phase.steps, orders_);
  for (std::size_t i = 0; i < rdp_.size(); ++i) rdp_[i] += rdp[i];
}

// Note [nothing released]
// ~~~~~~~~~~~~~~~~~~~~~~~
// An accountant none of whose phases released anything (no phase, or only phases with q = 0 or no
// steps: releases() in accountant.h) stands for a run whose outputs do not depend on the data,
// which is (0, 0)-DP. Theorem 21 of [BBGHS20] on its all-zero curve would still give
// eps = min_a [log((a-1)/a) - (log(delta) + log(a)) / (a-1)] > 0 (0.10 at delta = 1e-5 on
// Opacus's orders), a bound for nothing; the PRV accountant composes only the phases that
// release (merge_phases in prv.cpp) and says 0, and so must this one. Any phase that releases
// goes through the conversion, whatever its curve (one that underflowed to zeros included).
RdpEpsilon RdpAccountant::epsilon(double delta) const {
  if (releases_nothing()) {
    validate_delta(delta);
    return RdpEpsilon{};
  }
  return rdp_to_epsilon(orders_, rdp_, delta);
}

double RdpAccountant::delta(double epsilon) const {
  if (releases_nothing()) {
    validate_epsilon(epsilon);
    return 0.0;
  }
  return rdp_to_delta(orders_, rdp_, epsilon);
}

}  // namespace dpzero::accounting
