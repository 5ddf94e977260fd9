// privacy/banded.cpp — see banded.h (Note [banded strategies]).
#include "privacy/banded.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>

#include "accounting/types.h"

namespace dpzero::privacy {
namespace {

using accounting::format_double;

void require_positive(const char* name, int64_t value) {
  if (value < 1)
    throw std::invalid_argument(std::string("BandedToeplitz: ") + name + " must be >= 1, got " +
                                std::to_string(value));
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
