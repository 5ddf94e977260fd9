// privacy/banded.cpp — see banded.h (Note [banded strategies]).
#include "privacy/banded.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>

#include <Eigen/Dense>

#include "accounting/types.h"

namespace dpzero::privacy {
namespace {

using accounting::format_double;

void require_positive(const char* name, int64_t value) {
  if (value < 1)
    throw std::invalid_argument(std::string("BandedToeplitz: ") + name + " must be >= 1, got " +
                                std::to_string(value));
}

// Note [optimized banded strategies]: f(c) = ‖c‖² · MeanSE(c, n) for c = (1, x_1, .., x_{b−1})
// and, when `grad` is given, ∂f/∂x_j (b − 1 of them), in O(n·b) by reverse-mode
// differentiation of
//   d_0 = 1, d_k = −Σ_{i=1}^{min(k, b−1)} c_i d_{k−i}   (C⁻¹'s coefficients),
//   e_k = Σ_{i≤k} d_i,   L = Σ_k (n − k)·e_k²,   f = ‖c‖²·L/n.
// The adjoint of d_i is first the suffix sum Σ_{k≥i} 2(n − k)e_k (through the e's); then,
// from k = n − 1 down, d_k's adjoint a is final (the d's that read d_k come after it) and passes
// −a·d_{k−i} to c_i and −a·c_i to d_{k−i}. +inf where the series overflows.
double banded_objective(const std::vector<double>& x, int64_t n, std::vector<double>* grad) {
  const int64_t b = static_cast<int64_t>(x.size()) + 1;
  auto c = [&](int64_t i) { return i == 0 ? 1.0 : x[static_cast<size_t>(i - 1)]; };
  std::vector<double> d(static_cast<size_t>(n));
  double e = 0.0, loss = 0.0;
  for (int64_t k = 0; k < n; ++k) {
    double s = k == 0 ? 1.0 : 0.0;
    for (int64_t i = 1; i <= std::min<int64_t>(k, b - 1); ++i) s -= c(i) * d[k - i];
    d[k] = s;
    e += s;
    loss += static_cast<double>(n - k) * e * e;
    if (!std::isfinite(loss)) return INFINITY;
  }
  const double scale = 1.0 / static_cast<double>(n);
  double norm2 = 1.0;
  for (double v : x) norm2 += v * v;
  if (grad != nullptr) {
    // adjoint[i]: ∂L/∂d_i; e_k again from the d's, then the suffix sums of 2(n − k)e_k.
    std::vector<double> adjoint(static_cast<size_t>(n));
    e = 0.0;
    for (int64_t k = 0; k < n; ++k) {
      e += d[k];
      adjoint[k] = 2.0 * static_cast<double>(n - k) * e;
    }
    for (int64_t k = n - 2; k >= 0; --k) adjoint[k] += adjoint[k + 1];
    std::vector<double> dc(static_cast<size_t>(b), 0.0);  // ∂L/∂c_i
    for (int64_t k = n - 1; k >= 1; --k) {
      const double a = adjoint[k];
      for (int64_t i = 1; i <= std::min<int64_t>(k, b - 1); ++i) {
        dc[i] -= a * d[k - i];
        adjoint[k - i] -= a * c(i);
      }
    }
    grad->resize(x.size());
    for (size_t j = 0; j < x.size(); ++j)
      (*grad)[j] = 2.0 * x[j] * loss * scale + norm2 * dc[j + 1] * scale;
  }
  return norm2 * loss * scale;
}

}  // namespace

BandedToeplitz::BandedToeplitz(std::vector<double> coefficients) : c_(std::move(coefficients)) {
  if (c_.empty())
    throw std::invalid_argument("BandedToeplitz: coefficients must hold c_0 at least, got none");
  for (size_t k = 0; k < c_.size(); ++k)
    if (!std::isfinite(c_[k]))
      throw std::invalid_argument("BandedToeplitz: coefficient c_" + std::to_string(k) +
                                  " must be finite, got " + format_double(c_[k]));
  if (!(c_[0] > 0.0))
    throw std::invalid_argument("BandedToeplitz: c_0 (the diagonal) must be > 0, got " +
                                format_double(c_[0]));
}

bool BandedToeplitz::is_run_strategy(const std::vector<double>& c, int64_t bands) {
  if (static_cast<int64_t>(c.size()) != bands || c.empty() || c[0] != 1.0) return false;
  for (double x : c)
    if (!std::isfinite(x)) return false;
  return std::isfinite(BandedToeplitz(c).column_norm(bands, 0));
}

BandedToeplitz BandedToeplitz::identity() { return BandedToeplitz({1.0}); }

BandedToeplitz BandedToeplitz::sqrt_prefix_sum(int64_t bands) {
  require_positive("bands", bands);
  // binom(2k, k) / 4^k = c_{k−1} · (2k − 1) / (2k): the ratio of consecutive terms, so no
  // factorial overflows.
  std::vector<double> c(static_cast<size_t>(bands));
  c[0] = 1.0;
  for (int64_t k = 1; k < bands; ++k)
    c[k] = c[k - 1] * static_cast<double>(2 * k - 1) / static_cast<double>(2 * k);
  return BandedToeplitz(std::move(c));
}

BandedToeplitz BandedToeplitz::optimized(int64_t bands, int64_t n) {
  require_positive("bands", bands);
  require_positive("n", n);
  if (static_cast<double>(n) * static_cast<double>(bands) * static_cast<double>(bands) >
      kMaxOptimizedWork)
    throw std::invalid_argument(
        "BandedToeplitz: fitting " + std::to_string(bands) + " bands to n=" + std::to_string(n) +
        " steps is n·b² = " + format_double(static_cast<double>(n) * bands * bands) +
        ", above the " + format_double(kMaxOptimizedWork) +
        " the fit takes (its time grows as n·b²); fit fewer steps or bands");
  const std::vector<double> start = sqrt_prefix_sum(bands).coefficients();
  std::vector<double> x(start.begin() + 1, start.end());
  const auto m = static_cast<Eigen::Index>(x.size());
  std::vector<double> grad, g_plus, g_minus, trial;
  double f = banded_objective(x, n, &grad);
  for (int iteration = 0; iteration < 200 && m > 0; ++iteration) {
    // The Hessian by central differences of the exact gradient, symmetrised.
    Eigen::MatrixXd hessian(m, m);
    for (Eigen::Index i = 0; i < m; ++i) {
      const double h = 1e-6 * std::max(1.0, std::abs(x[static_cast<size_t>(i)]));
      trial = x;
      trial[static_cast<size_t>(i)] += h;
      banded_objective(trial, n, &g_plus);
      trial[static_cast<size_t>(i)] -= 2.0 * h;
      banded_objective(trial, n, &g_minus);
      for (Eigen::Index r = 0; r < m; ++r)
        hessian(r, i) = (g_plus[static_cast<size_t>(r)] - g_minus[static_cast<size_t>(r)]) /
                        (2.0 * h);
    }
    hessian = 0.5 * (hessian + hessian.transpose()).eval();
    const Eigen::Map<const Eigen::VectorXd> g(grad.data(), m);
    const Eigen::LDLT<Eigen::MatrixXd> ldlt(hessian);
    Eigen::VectorXd step = -g;
    if (ldlt.info() == Eigen::Success && ldlt.isPositive()) {
      const Eigen::VectorXd newton = ldlt.solve(-g);
      if (newton.allFinite() && newton.dot(g) < 0.0) step = newton;
    }
    double f_new = INFINITY;
    for (double t = 1.0; t > 1e-12; t *= 0.5) {
      trial = x;
      for (Eigen::Index i = 0; i < m; ++i) trial[static_cast<size_t>(i)] += t * step(i);
      f_new = banded_objective(trial, n, nullptr);
      if (f_new < f) break;
    }
    if (!(f_new < f)) break;  // no step decreases f: a local minimum to this precision
    const bool converged = f - f_new <= 1e-12 * f;
    x = trial;
    f = banded_objective(x, n, &grad);
    if (converged) break;
  }
  std::vector<double> c{1.0};
  c.insert(c.end(), x.begin(), x.end());
  return BandedToeplitz(std::move(c));
}

double BandedToeplitz::next(double z, const std::vector<double>& previous) const {
  double s = z;
  const size_t reach = std::min(previous.size(), c_.size() - 1);
  for (size_t j = 1; j <= reach; ++j) s -= c_[j] * previous[j - 1];
  return s / c_[0];
}

double BandedToeplitz::column_norm(int64_t n, int64_t i) const {
  require_positive("n", n);
  if (i < 0 || i >= n)
    throw std::invalid_argument("BandedToeplitz: column " + std::to_string(i) +
                                " is outside an n = " + std::to_string(n) + " step run");
  double sq = 0.0;
  const int64_t rows = std::min<int64_t>(bands(), n - i);
  for (int64_t k = 0; k < rows; ++k) sq += c_[k] * c_[k];
  return std::sqrt(sq);
}

double BandedToeplitz::sensitivity_squared(int64_t n, int64_t separation,
                                           int64_t max_participations) const {
  require_positive("n", n);
  require_positive("max_participations", max_participations);
  if (separation < bands())
    throw std::invalid_argument(
        "BandedToeplitz: participations " + std::to_string(separation) +
        " steps apart overlap the " + std::to_string(bands()) +
        " bands' columns; the sensitivity here needs a separation of at least the band count");
  double sq = 0.0;
  for (int64_t m = 0; m < max_participations && m * separation < n; ++m) {
    const double norm = column_norm(n, m * separation);
    sq += norm * norm;
  }
  return sq;
}

double BandedToeplitz::mean_squared_error(int64_t n) const {
  require_positive("n", n);
  // d: the power-series inverse of c (C⁻¹'s coefficients); e: its prefix sums (A·C⁻¹'s).
  std::vector<double> d(static_cast<size_t>(n));
  double e = 0.0, frobenius = 0.0;
  for (int64_t k = 0; k < n; ++k) {
    double s = k == 0 ? 1.0 : 0.0;
    for (int64_t j = 1; j <= std::min<int64_t>(k, bands() - 1); ++j) s -= c_[j] * d[k - j];
    d[k] = s / c_[0];
    e += d[k];
    frobenius += static_cast<double>(n - k) * e * e;
  }
  return frobenius / static_cast<double>(n);
}

}  // namespace dpzero::privacy
