// accounting/prv_numerics.cpp — the PRV of the Poisson-subsampled Gaussian (CDF, tails, truncated
// mean), its lattice discretisation, Chernoff windows and the FFT composition (see prv_numerics.h
// for the formulas; [GLW21] = Gopi, Lee, Wutschitz, NeurIPS 2021, arXiv:2106.02848).
#include "accounting/prv_numerics.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <complex>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>

#include <unsupported/Eigen/FFT>

#include "accounting/types.h"

namespace dpzero::accounting::prv_detail {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kSqrtHalf = 0.70710678118654752440;  // 1 / sqrt(2)
constexpr double kPi = 3.14159265358979323846;

// Phi(x) and Phi_c(x) = 1 - Phi(x) through erfc, each with full relative precision in its small
// tail (erfc(x) only underflows past x ~ 26.5, i.e. Phi_c below ~1e-308).
double normal_cdf(double x) { return 0.5 * std::erfc(-x * kSqrtHalf); }
double normal_sf(double x) { return 0.5 * std::erfc(x * kSqrtHalf); }

// Beyond 40 standard deviations a normal tail is below 1e-349: exactly 0 in double.
constexpr double kNormalSupport = 40.0;

// Gauss-Legendre rule on [-1, 1] with n nodes: nodes are the roots of the Legendre polynomial
// P_n, found by Newton's method from Tricomi's initial guess cos(pi (i - 1/4) / (n + 1/2));
// weights w_i = 2 / ((1 - x_i^2) P_n'(x_i)^2) (Abramowitz & Stegun 25.4.29).
template <int N>
struct GaussLegendre {
  std::array<double, N> nodes{};
  std::array<double, N> weights{};
  GaussLegendre() {
    for (int i = 0; i < N; ++i) {
      double x = std::cos(kPi * (i + 0.75) / (N + 0.5));  // i is 0-based here
      double derivative = 1.0;
      for (int iteration = 0; iteration < 100; ++iteration) {
        // Three-term recurrence (k+1) P_{k+1} = (2k+1) x P_k - k P_{k-1}.
        double p_prev = 1.0;
        double p = x;
        for (int k = 1; k < N; ++k) {
          const double p_next = ((2.0 * k + 1.0) * x * p - k * p_prev) / (k + 1.0);
          p_prev = p;
          p = p_next;
        }
        derivative = N * (x * p - p_prev) / (x * x - 1.0);
        const double step = p / derivative;
        x -= step;
        if (std::fabs(step) < 1e-16) break;
      }
      nodes[i] = x;
      weights[i] = 2.0 / ((1.0 - x * x) * derivative * derivative);
    }
  }
};

const GaussLegendre<16>& gauss_legendre_16() {
  static const GaussLegendre<16> rule;
  return rule;
}

// Complex product without the NaN/Inf recovery path of std::complex's operator* (which compiles
// to a library call); every operand here is finite with modulus <= 1 (+ round-off).
struct Cplx {
  double re;
  double im;
};
inline Cplx mul(Cplx a, Cplx b) { return {a.re * b.re - a.im * b.im, a.re * b.im + a.im * b.re}; }

// z^n by binary exponentiation: ~2 log2(n) products, relative error ~ n * eps_machine (the same
// order as exp(n log z)). Once |z|^(2^k) drops below 1e-150 the result is below 1e-150 as well
// (|z| <= 1 up to round-off) and is returned as 0, which keeps denormals out of the loop.
Cplx power(Cplx z, int64_t n) {
  Cplx result{1.0, 0.0};
  Cplx base = z;
  while (n > 0) {
    if (n & 1) result = mul(result, base);
    n >>= 1;
    if (n == 0) break;
    base = mul(base, base);
    if (base.re * base.re + base.im * base.im < 1e-300) return {0.0, 0.0};
  }
  return result;
}

// Eigen::FFT keeps the twiddle tables ("plans") of every size it has run; building them costs
// O(n) sines and cosines, as much as a transform, and fresh buffers cost page faults of the same
// order. Calibration calls the accountant many times with the same sizes, and each call composes
// both directions (Note [PRV directions], prv.cpp), whose windows usually need different sizes.
// So each thread keeps one FFT object holding the plans of at most kRetainedPlans sizes (rebuilt
// when a further size comes) and buffers of the largest size seen, released after sizes above
// kRetainedFftSize (so an occasional huge call does not pin ~100 MB per thread).
constexpr int64_t kRetainedFftSize = int64_t{1} << 20;
constexpr std::size_t kRetainedPlans = 2;

struct FftWorkspace {
  std::vector<int64_t> planned;  // sizes whose plans `fft` holds, at most kRetainedPlans
  std::unique_ptr<Eigen::FFT<double>> fft;
  std::vector<double> signal;                  // [size] time domain
  std::vector<std::complex<double>> spectrum;  // [size/2 + 1] one phase
  std::vector<std::complex<double>> product;   // [size/2 + 1] all phases, powered

  void prepare(int64_t n) {
    const bool known = std::find(planned.begin(), planned.end(), n) != planned.end();
    if (!fft || (!known && planned.size() >= kRetainedPlans)) {
      fft = std::make_unique<Eigen::FFT<double>>();
      fft->SetFlag(Eigen::FFT<double>::HalfSpectrum);
      fft->SetFlag(Eigen::FFT<double>::Unscaled);
      planned.clear();
    }
    if (std::find(planned.begin(), planned.end(), n) == planned.end()) planned.push_back(n);
    // resize() keeps the capacity, so alternating between two sizes allocates nothing.
    signal.resize(static_cast<std::size_t>(n));
    spectrum.resize(static_cast<std::size_t>(n / 2 + 1));
    product.resize(static_cast<std::size_t>(n / 2 + 1));
  }
  void release_if_large() {
    if (signal.capacity() <= static_cast<std::size_t>(kRetainedFftSize)) return;
    *this = FftWorkspace();
  }
};

FftWorkspace& workspace() {
  thread_local FftWorkspace instance;
  return instance;
}

int64_t positive_mod(int64_t a, int64_t m) {
  const int64_t r = a % m;
  return r < 0 ? r + m : r;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// SubsampledGaussianPrv
// ---------------------------------------------------------------------------------------------

const char* direction_name(PrvDirection direction) {
  return direction == PrvDirection::kAdd ? "add" : "remove";
}

SubsampledGaussianPrv::SubsampledGaussianPrv(double q, double sigma, PrvDirection direction)
    : q_(q),
      sigma_(sigma),
      // q = 1: both directions are the same Gaussian PLRV (prv_numerics.h); use one code path.
      direction_(q == 1.0 ? PrvDirection::kRemove : direction),
      log_q_(std::log(q)),
      log_one_minus_q_(std::log1p(-q)),
      support_lower_(direction_ == PrvDirection::kRemove ? log_one_minus_q_ : -kInf),
      support_upper_(direction_ == PrvDirection::kRemove ? kInf : -log_one_minus_q_) {}

double SubsampledGaussianPrv::z_of_loss(double t) const {
  if (q_ == 1.0) return t;  // g(x) = z exactly (PRV-1)
  if (!(t > log_one_minus_q_)) return -kInf;
  // z = log((e^t - 1 + q) / q). For t > 1 factor out e^t: z = t - log q + log(1 - (1-q) e^-t),
  // which cannot overflow (and 1 - (1-q) e^-t >= 1 - 1/e has no cancellation); for t <= 1,
  // expm1 keeps e^t - 1 accurate near t = 0, also when q is tiny. Near t = log(1-q) (the remove
  // direction's lower edge, the add direction's upper edge via t -> -t) e^t - 1 + q is a
  // difference of nearly equal numbers whose absolute error ~ ulp(q) is that of t itself: no
  // formula in t can do better.
  if (t > 1.0) return t - log_q_ + std::log1p(-(1.0 - q_) * std::exp(-t));
  const double u = std::expm1(t) + q_;
  if (!(u > 0.0)) return -kInf;
  return std::log(u) - log_q_;
}

double SubsampledGaussianPrv::loss_of_z(double z) const {
  if (q_ == 1.0) return z;
  // (PRV-1): log(1 - q + q e^z) = log1p(q (e^z - 1)), exact to rounding while q e^z is finite;
  // past z = 700 (e^z near overflow) use z + log(q + (1-q) e^-z).
  if (z <= 700.0) return std::log1p(q_ * std::expm1(z));
  return z + std::log(q_ + (1.0 - q_) * std::exp(-z));
}

double SubsampledGaussianPrv::cdf_z(double z) const {
  if (z == -kInf) return 0.0;
  if (z == kInf) return 1.0;
  const double a = sigma_ * z;
  const double b = 0.5 / sigma_;
  // (PRV-3)
  return (1.0 - q_) * normal_cdf(a + b) + q_ * normal_cdf(a - b);
}

double SubsampledGaussianPrv::sf_z(double z) const {
  if (z == -kInf) return 1.0;
  if (z == kInf) return 0.0;
  const double a = sigma_ * z;
  const double b = 0.5 / sigma_;
  return (1.0 - q_) * normal_sf(a + b) + q_ * normal_sf(a - b);
}

double SubsampledGaussianPrv::cdf(double t) const {
  if (direction_ == PrvDirection::kRemove) return cdf_z(z_of_loss(t));
  // (PRV-4): Phi_c(s z(-t) + 1/(2s)); z(-t) = -inf (t at or above the supremum) gives 1.
  const double z = z_of_loss(-t);
  if (z == -kInf) return 1.0;
  return normal_sf(sigma_ * z + 0.5 / sigma_);
}

double SubsampledGaussianPrv::sf(double t) const {
  if (direction_ == PrvDirection::kRemove) return sf_z(z_of_loss(t));
  // (PRV-4): Phi(s z(-t) + 1/(2s)).
  const double z = z_of_loss(-t);
  if (z == -kInf) return 0.0;
  return normal_cdf(sigma_ * z + 0.5 / sigma_);
}

namespace {

// Bisection on t for the boundary of {t : below(t)} (true at a, false at b, monotone), down to
// adjacent doubles: returns (last t where it holds, first t where it fails). The predicate is
// evaluated at the returned values themselves, so the tail each certifies is exactly the one
// computed later from the same t.
template <typename Predicate>
std::pair<double, double> bisect_loss(double a, double b, Predicate below) {
  for (int iteration = 0; iteration < 400; ++iteration) {
    const double mid = 0.5 * (a + b);
    if (mid <= a || mid >= b) break;
    if (below(mid)) {
      a = mid;
    } else {
      b = mid;
    }
  }
  return {a, b};
}

}  // namespace

double SubsampledGaussianPrv::lower_quantile(double tail) const {
  const double s = sigma_;
  double t_low;
  double t_high;
  if (direction_ == PrvDirection::kRemove) {
    // Bracket: cdf_z(z) <= Phi(s z + 1/(2s)) (both Phi terms are at most that), so the CDF is 0
    // in double at z = -(40 + 1/(2s)) / s, and for q < 1 at the support's infimum log(1-q)
    // itself; at z = 1/(2 s^2) the q-component alone is at its median and the CDF is
    // >= 1/2 > tail.
    t_low = q_ < 1.0 ? support_lower_ : loss_of_z(-(kNormalSupport + 0.5 / s) / s);
    t_high = loss_of_z(0.5 / (s * s));
  } else {
    // (PRV-4): the CDF Phi_c(s z(-t) + 1/(2s)) is 0 in double where s z(-t) + 1/(2s) = 40,
    // i.e. t = -g at z = (40 - 1/(2s)) / s, and 1/2 at z = -1/(2 s^2).
    t_low = -loss_of_z((kNormalSupport - 0.5 / s) / s);
    t_high = -loss_of_z(-0.5 / (s * s));
  }
  // The bisection runs on t (not z): near log(1-q) the map z -> t -> z loses digits, and the
  // truncated mass must be the CDF at the returned t.
  return bisect_loss(t_low, t_high, [&](double t) { return cdf(t) <= tail; }).first;
}

double SubsampledGaussianPrv::upper_quantile(double tail) const {
  const double s = sigma_;
  double t_low;
  double t_high;
  if (direction_ == PrvDirection::kRemove) {
    // sf_z(z) <= Phi_c(s z - 1/(2s)) = 0 in double at z = (40 + 1/(2s)) / s; at z = -1/(2 s^2)
    // the (1-q)-component is at its median (and the q-component above it), so sf >= 1/2 > tail.
    t_low = loss_of_z(-0.5 / (s * s));
    t_high = loss_of_z((kNormalSupport + 0.5 / s) / s);
  } else {
    // (PRV-4): sf = Phi(s z(-t) + 1/(2s)) is 1/2 at z = -1/(2 s^2) and 0 at the supremum
    // -log(1-q) (z = -inf); q < 1 here (q = 1 runs as the remove direction).
    t_low = -loss_of_z(-0.5 / (s * s));
    t_high = support_upper_;
  }
  // The first t with sf(t) <= tail: "sf(t) > tail" holds below it.
  return bisect_loss(t_low, t_high, [&](double t) { return sf(t) > tail; }).second;
}

double SubsampledGaussianPrv::truncated_mean(double lower, double upper) const {
  // Y = +-g(X) with g increasing (PRV-1), so {lower < Y <= upper} is an interval of x, and
  //   E[Y | lower < Y <= upper] = int_{x_low}^{x_high} +-g p_X / int_{x_low}^{x_high} p_X,
  // x(t) = s^2 z(t) + 1/2 the inverse of g:
  //   remove: X ~ (1-q) N(0, s^2) + q N(1, s^2), x from x(lower) to x(upper), sign +;
  //   add:    X ~ N(0, s^2), x from x(-upper) to x(-lower) (g(X) in [-upper, -lower)), sign -.
  // Beyond 40 s from every component mean p_X is 0 in double, which bounds the range. p_X varies
  // on the scale s and g on the scale s^2 (z = (2x-1)/(2 s^2)), so panels of min(s, s^2)/2 make
  // both smooth on each panel and 16-point Gauss-Legendre exact to rounding. The common factor
  // 1/(s sqrt(2 pi)) of p_X cancels in the ratio.
  const double s = sigma_;
  const double s2 = s * s;
  const bool add = direction_ == PrvDirection::kAdd;
  const double weight_one = add ? 0.0 : q_;  // weight of N(1, s^2) in p_X
  const double sign = add ? -1.0 : 1.0;
  double x_low;
  double x_high;
  if (add) {
    x_low = std::max(s2 * z_of_loss(-upper) + 0.5, -kNormalSupport * s);
    x_high = std::min(s2 * z_of_loss(-lower) + 0.5, kNormalSupport * s);
  } else {
    x_low = std::max(s2 * z_of_loss(lower) + 0.5, -kNormalSupport * s);
    x_high = std::min(s2 * z_of_loss(upper) + 0.5, 1.0 + kNormalSupport * s);
  }
  if (!(x_high > x_low)) return 0.5 * (lower + upper);
  const double panel_target = 0.5 * std::min(s, s2);
  const double panels_real = std::ceil((x_high - x_low) / panel_target);
  constexpr double kMaxPanels = 4e6;
  if (!(panels_real <= kMaxPanels)) {
    throw std::runtime_error(
        "PRV mean quadrature for q = " + format_double(q_) + ", sigma = " + format_double(s) +
        " (" + direction_name(direction_) + " direction) needs " + format_double(panels_real) +
        " panels (more than " + format_double(kMaxPanels) +
        "): sigma is too small for the PRV accountant; use RDP");
  }
  const int64_t panels = std::max<int64_t>(1, static_cast<int64_t>(panels_real));
  const double width = (x_high - x_low) / static_cast<double>(panels);
  const auto& rule = gauss_legendre_16();
  const double inv_two_s2 = 0.5 / s2;
  long double numerator = 0.0L;
  long double denominator = 0.0L;
  for (int64_t panel = 0; panel < panels; ++panel) {
    const double center = x_low + (static_cast<double>(panel) + 0.5) * width;
    for (int i = 0; i < 16; ++i) {
      const double x = center + 0.5 * width * rule.nodes[i];
      double density = (1.0 - weight_one) * std::exp(-x * x * inv_two_s2);
      if (weight_one > 0.0) density += weight_one * std::exp(-(x - 1.0) * (x - 1.0) * inv_two_s2);
      const double w = rule.weights[i] * density;
      numerator += static_cast<long double>(w * loss_of_z((2.0 * x - 1.0) * inv_two_s2));
      denominator += static_cast<long double>(w);
    }
  }
  if (!(denominator > 0.0L)) return 0.5 * (lower + upper);
  return sign * static_cast<double>(numerator / denominator);
}

// ---------------------------------------------------------------------------------------------
// Discretisation
// ---------------------------------------------------------------------------------------------

DiscretePrv discretise(const SubsampledGaussianPrv& prv, double mesh, double lower, double upper,
                       int64_t max_cells) {
  // Cells C_k = ((k - 1/2) h, (k + 1/2) h]; lower lies in C_{k_lo}, upper in C_{k_hi}.
  const double h = mesh;
  const double cells_real = std::floor(upper / h + 0.5) - std::floor(lower / h + 0.5) + 1.0;
  if (!(cells_real <= static_cast<double>(max_cells))) {
    throw std::runtime_error(
        "PRV of one step with q = " + format_double(prv.q()) + ", sigma = " +
        format_double(prv.sigma()) + " (" + direction_name(prv.direction()) +
        " direction) spans [" + format_double(lower) + ", " +
        format_double(upper) + "], " + format_double(cells_real) + " cells of mesh " +
        format_double(h) + " (limit " + std::to_string(max_cells) +
        "): increase eps_error (the mesh grows with it) or use the RDP accountant");
  }
  const int64_t k_low = static_cast<int64_t>(std::floor(lower / h + 0.5));
  const int64_t k_high = static_cast<int64_t>(std::ceil(upper / h - 0.5));
  const int64_t cells = std::max<int64_t>(1, k_high - k_low + 1);

  // Boundaries B_0 = lower, B_i = (k_lo + i - 1/2) h, B_K = upper; cell i is (B_i, B_{i+1}].
  auto boundary = [&](int64_t i) {
    if (i <= 0) return lower;
    if (i >= cells) return upper;
    return (static_cast<double>(k_low + i) - 0.5) * h;
  };
  // Below the median, CDF differences; above it, survival-function differences: each side then
  // subtracts two small numbers of the same sign instead of two numbers near 1, so cell masses in
  // both tails keep their relative precision. split = first boundary with CDF >= 1/2.
  int64_t split_low = 0;
  int64_t split_high = cells + 1;
  while (split_low < split_high) {
    const int64_t mid = split_low + (split_high - split_low) / 2;
    if (prv.cdf(boundary(mid)) >= 0.5) {
      split_high = mid;
    } else {
      split_low = mid + 1;
    }
  }
  const int64_t split = split_low;  // in [0, cells + 1]
  std::vector<double> at_boundary(static_cast<std::size_t>(cells) + 1);
  for (int64_t i = 0; i <= cells; ++i) {
    const double b = boundary(i);
    at_boundary[static_cast<std::size_t>(i)] = i < split ? prv.cdf(b) : prv.sf(b);
  }
  // At the split boundary both functions are needed.
  const double cdf_at_split = split <= cells ? prv.cdf(boundary(split)) : 0.0;

  DiscretePrv out;
  out.mesh = h;
  std::vector<double> mass(static_cast<std::size_t>(cells));
  for (int64_t i = 0; i < cells; ++i) {
    const std::size_t u = static_cast<std::size_t>(i);
    double m;
    if (i + 1 < split) {
      m = at_boundary[u + 1] - at_boundary[u];
    } else if (i >= split) {
      m = at_boundary[u] - at_boundary[u + 1];
    } else {  // i + 1 == split: the cell straddles the median
      m = cdf_at_split - at_boundary[u];
    }
    // CDF and SF are monotone; a negative difference is rounding of a zero mass.
    mass[u] = std::max(0.0, m);
  }
  out.dropped = prv.cdf(lower) + prv.sf(upper);

  // Trim empty cells at both ends (log_mgf() needs positive end masses).
  int64_t first = 0;
  int64_t last = cells - 1;
  while (first < last && mass[static_cast<std::size_t>(first)] == 0.0) ++first;
  while (last > first && mass[static_cast<std::size_t>(last)] == 0.0) --last;
  if (mass[static_cast<std::size_t>(first)] == 0.0) {
    throw std::runtime_error("PRV discretisation for q = " + format_double(prv.q()) +
                             ", sigma = " + format_double(prv.sigma()) + " (" +
                             direction_name(prv.direction()) + " direction) produced no mass on [" +
                             format_double(lower) + ", " + format_double(upper) + "]");
  }
  out.first_index = k_low + first;
  out.mass.assign(mass.begin() + first, mass.begin() + last + 1);

  // Mean correction [GLW21, §5]: shift every point by E[Y | trunc] - E[discrete | trunc].
  long double total = 0.0L;
  long double moment = 0.0L;
  for (std::size_t i = 0; i < out.mass.size(); ++i) {
    total += out.mass[i];
    moment += static_cast<long double>(out.mass[i]) *
              static_cast<long double>(static_cast<double>(out.first_index + static_cast<int64_t>(i)) * h);
  }
  const double discrete_mean = static_cast<double>(moment / total);
  out.continuous_mean = prv.truncated_mean(lower, upper);
  out.shift = out.continuous_mean - discrete_mean;
  // Each cell's conditional mean lies in its cell, so |shift| <= h/2 exactly; a larger value
  // means the CDF differences or the quadrature lost precision, and the discretisation error
  // analysis (which needs the means to agree) would not hold.
  if (!(std::fabs(out.shift) <= 0.5 * h * (1.0 + 1e-6)) || !std::isfinite(out.continuous_mean)) {
    throw std::runtime_error(
        "PRV discretisation for q = " + format_double(prv.q()) + ", sigma = " +
        format_double(prv.sigma()) + " (" + direction_name(prv.direction()) +
        " direction): discrete mean " + format_double(discrete_mean) +
        " is farther than half a mesh (" + format_double(0.5 * h) + ") from the continuous mean " +
        format_double(out.continuous_mean) + "; the PRV accountant cannot reach the requested "
        "accuracy for these parameters (use RDP)");
  }
  return out;
}

double DiscretePrv::log_mgf(double lambda) const {
  // sum_i m_i e^{lambda v_i} = e^{lambda v_end} sum_i m_i r^{|end - i|}, r = e^{-|lambda| h} <= 1,
  // with v_end the largest value for lambda >= 0 and the smallest for lambda < 0; Horner's rule
  // runs from the far end, so nothing overflows and end masses (> 0 after trimming) keep the sum
  // positive.
  const std::size_t n = mass.size();
  const double r = std::exp(-std::fabs(lambda) * mesh);
  // Four interleaved Horner chains in r^4 (independent multiply-add chains pipeline better).
  const double r2 = r * r;
  const double r4 = r2 * r2;
  double acc0 = 0.0, acc1 = 0.0, acc2 = 0.0, acc3 = 0.0;
  if (lambda >= 0.0) {
    // Coefficient of mass[i] must be r^(n-1-i): process i ascending.
    std::size_t i = 0;
    const std::size_t head = n % 4;
    double acc = 0.0;  // head: sum_{i < head} m_i r^(head-1-i), still to be scaled by r^(n-head)
    for (; i < head; ++i) acc = acc * r + mass[i];
    for (; i < n; i += 4) {
      acc0 = acc0 * r4 + mass[i];
      acc1 = acc1 * r4 + mass[i + 1];
      acc2 = acc2 * r4 + mass[i + 2];
      acc3 = acc3 * r4 + mass[i + 3];
    }
    // Chain c holds m_i r^{4j} for i = n - 4 - 4j + c, whose weight must be r^{n-1-i} =
    // r^{4j + 3 - c}: chain c still needs r^{3-c}.
    const double body = ((acc0 * r + acc1) * r + acc2) * r + acc3;
    const double head_part = head > 0 ? acc * std::pow(r, static_cast<double>(n - head)) : 0.0;
    return lambda * value(n - 1) + std::log(body + head_part);
  }
  // lambda < 0: coefficient of mass[i] is r^i; process i descending.
  std::size_t remaining = n;
  const std::size_t head = n % 4;
  double acc = 0.0;
  for (std::size_t k = 0; k < head; ++k) {
    --remaining;
    acc = acc * r + mass[remaining];
  }
  // acc: sum_{i >= n-head} m_i r^(i-(n-head)), still to be scaled by r^(n-head). Then indices
  // [0, remaining), remaining a multiple of 4, descending in blocks: chain c holds m_i r^{4j} for
  // i = 4j + 3 - c and needs r^{3-c} more.
  while (remaining > 0) {
    remaining -= 4;
    acc0 = acc0 * r4 + mass[remaining + 3];
    acc1 = acc1 * r4 + mass[remaining + 2];
    acc2 = acc2 * r4 + mass[remaining + 1];
    acc3 = acc3 * r4 + mass[remaining];
  }
  const double body = ((acc0 * r + acc1) * r + acc2) * r + acc3;
  const double head_part =
      head > 0 ? acc * std::pow(r, static_cast<double>(n - head)) : 0.0;
  return lambda * value(0) + std::log(body + head_part);
}

// ---------------------------------------------------------------------------------------------
// Chernoff window
// ---------------------------------------------------------------------------------------------

std::pair<double, double> chernoff_window(const std::vector<DiscretePrv>& phases,
                                          const std::vector<int64_t>& steps, double log_tail) {
  // Support of S and its standard deviation (which sets the scale of the optimal lambda).
  double support_low = 0.0;
  double support_high = 0.0;
  long double variance = 0.0L;
  for (std::size_t p = 0; p < phases.size(); ++p) {
    const DiscretePrv& d = phases[p];
    const double n = static_cast<double>(steps[p]);
    support_low += n * d.value(0);
    support_high += n * d.value(d.mass.size() - 1);
    // Two passes (mean, then centred second moment): no cancellation.
    long double total = 0.0L, first = 0.0L, second = 0.0L;
    for (std::size_t i = 0; i < d.mass.size(); ++i) {
      total += d.mass[i];
      first += d.mass[i] * static_cast<long double>(d.value(i));
    }
    const long double mean = first / total;
    for (std::size_t i = 0; i < d.mass.size(); ++i) {
      const long double centred = d.value(i) - mean;
      second += d.mass[i] * centred * centred;
    }
    variance += static_cast<long double>(n) * (second / total);
  }
  const double sd = std::sqrt(static_cast<double>(variance));
  if (!(sd > 0.0)) return {support_low, support_high};

  const double c = -log_tail;
  auto cumulant = [&](double lambda) {
    double k = 0.0;
    for (std::size_t p = 0; p < phases.size(); ++p) {
      k += static_cast<double>(steps[p]) * phases[p].log_mgf(lambda);
    }
    return k;
  };
  // For a Gaussian S the optimum is lambda = sqrt(2c) / sd; search e^{+-12} around it. Every
  // lambda > 0 gives a valid bound, so an optimum outside the range only loosens the window.
  const double center = std::log(std::sqrt(2.0 * c) / sd);
  auto minimise = [&](auto objective) {
    const double golden = 0.6180339887498949;
    double a = center - 12.0;
    double b = center + 12.0;
    double x1 = b - golden * (b - a);
    double x2 = a + golden * (b - a);
    double f1 = objective(x1);
    double f2 = objective(x2);
    for (int iteration = 0; iteration < 48; ++iteration) {
      if (f1 <= f2) {
        b = x2;
        x2 = x1;
        f2 = f1;
        x1 = b - golden * (b - a);
        f1 = objective(x1);
      } else {
        a = x1;
        x1 = x2;
        f1 = f2;
        x2 = a + golden * (b - a);
        f2 = objective(x2);
      }
    }
    return std::min(f1, f2);
  };
  // P(S > b) <= exp(K(l) - l b) <= e^log_tail  iff  b >= (K(l) + c) / l.
  const double upper = minimise([&](double u) {
    const double lambda = std::exp(u);
    return (cumulant(lambda) + c) / lambda;
  });
  // P(S < a) <= exp(K(-l) + l a) <= e^log_tail  iff  a <= -(K(-l) + c) / l.
  const double lower = -minimise([&](double u) {
    const double lambda = std::exp(u);
    return (cumulant(-lambda) + c) / lambda;
  });
  if (!std::isfinite(upper) || !std::isfinite(lower)) {
    throw std::runtime_error("PRV Chernoff window is not finite (lower " + format_double(lower) +
                             ", upper " + format_double(upper) + ")");
  }
  return {std::max(lower, support_low), std::min(upper, support_high)};
}

int64_t fast_fft_size(int64_t n) {
  n = std::max<int64_t>(n, 4);
  int64_t best = std::numeric_limits<int64_t>::max();
  for (int64_t p5 = 1; p5 < 2 * n; p5 *= 5) {
    for (int64_t p35 = p5; p35 < 2 * n; p35 *= 3) {
      int64_t m = 4 * p35;
      while (m < n) m *= 2;
      best = std::min(best, m);
    }
  }
  return best;
}

// ---------------------------------------------------------------------------------------------
// Composition
// ---------------------------------------------------------------------------------------------

ComposedPrv::ComposedPrv(double mesh, int64_t first_index, double offset, std::vector<double> pmf)
    : mesh_(mesh), first_index_(first_index), offset_(offset), pmf_(std::move(pmf)) {
  const std::size_t n = pmf_.size();
  tail_mass_.assign(n + 1, 0.0);
  tail_weighted_.assign(n + 1, 0.0);
  const double decay = std::exp(-mesh_);
  for (std::size_t j = n; j-- > 0;) {
    tail_mass_[j] = tail_mass_[j + 1] + pmf_[j];
    tail_weighted_[j] = pmf_[j] + decay * tail_weighted_[j + 1];
  }
}

std::size_t ComposedPrv::first_above(double eps) const {
  const std::size_t n = pmf_.size();
  if (n == 0) return 0;
  const double guess = std::floor((eps - offset_) / mesh_) - static_cast<double>(first_index_) + 1.0;
  std::size_t j;
  if (!(guess > 0.0)) {
    j = 0;
  } else if (guess >= static_cast<double>(n)) {
    j = n;
  } else {
    j = static_cast<std::size_t>(guess);
  }
  // Repair the rounding of the guess.
  while (j > 0 && value(j - 1) > eps) --j;
  while (j < n && value(j) <= eps) ++j;
  return j;
}

double ComposedPrv::delta(double eps) const {
  const std::size_t j = first_above(eps);
  if (j >= pmf_.size()) return 0.0;
  // [GLW21, Eq. (2)]: sum_{i >= j} p_i (1 - e^{eps - v_i}) = T_j - e^{eps - v_j} W_j.
  const double d = tail_mass_[j] - std::exp(eps - value(j)) * tail_weighted_[j];
  return std::max(0.0, d);
}

double ComposedPrv::epsilon(double target) const {
  const std::size_t n = pmf_.size();
  if (n == 0 || !(target < tail_mass_[0])) return -kInf;
  const double decay = std::exp(-mesh_);
  // delta at the lattice point v_j: first point above it is j + 1.
  auto delta_at_point = [&](std::size_t j) {
    return tail_mass_[j + 1] - decay * tail_weighted_[j + 1];
  };
  // Smallest j with delta(v_j) <= target (delta(v_{n-1}) = 0 <= target).
  std::size_t lo = 0;
  std::size_t hi = n - 1;
  while (lo < hi) {
    const std::size_t mid = lo + (hi - lo) / 2;
    if (delta_at_point(mid) <= target) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  const std::size_t j = lo;
  // On (v_{j-1}, v_j]: delta(eps) = T_j - e^{eps - v_j} W_j = target.
  double eps = value(j) + std::log((tail_mass_[j] - target) / tail_weighted_[j]);
  eps = std::min(eps, value(j));
  if (j > 0) eps = std::max(eps, value(j - 1));
  return eps;
}

Composition compose(const std::vector<DiscretePrv>& phases, const std::vector<int64_t>& steps,
                    int64_t window_first, int64_t size) {
  const std::size_t m = static_cast<std::size_t>(size);
  const std::size_t half = m / 2 + 1;
  FftWorkspace& ws = workspace();
  ws.prepare(size);
  std::fill(ws.product.begin(), ws.product.end(), std::complex<double>(1.0, 0.0));
  double offset = 0.0;
  double weighted_norm = 0.0;  // sum_i steps_i * ||p_i||_2, for the round-off estimate
  double total_steps = 0.0;    // sum_i steps_i, likewise
  for (std::size_t p = 0; p < phases.size(); ++p) {
    const DiscretePrv& d = phases[p];
    std::fill(ws.signal.begin(), ws.signal.end(), 0.0);
    // Lattice index k sits at k mod size, so indices of sums add modulo size.
    int64_t position = positive_mod(d.first_index, size);
    double norm2 = 0.0;
    for (double mass : d.mass) {
      ws.signal[static_cast<std::size_t>(position)] += mass;
      norm2 += mass * mass;
      if (++position == size) position = 0;
    }
    weighted_norm += static_cast<double>(steps[p]) * std::sqrt(norm2);
    total_steps += static_cast<double>(steps[p]);
    ws.fft->fwd(ws.spectrum.data(), ws.signal.data(), size);
    // |psi|^n < e^-700 (~1e-304) makes the factor 0 in double: skip the powering when
    // |psi|^2 < exp(-1400 / n).
    const double cutoff2 = std::exp(-1400.0 / static_cast<double>(steps[p]));
    for (std::size_t f = 0; f < half; ++f) {
      const std::complex<double> current = ws.product[f];
      if (current.real() == 0.0 && current.imag() == 0.0) continue;
      const Cplx psi{ws.spectrum[f].real(), ws.spectrum[f].imag()};
      if (psi.re * psi.re + psi.im * psi.im < cutoff2) {
        ws.product[f] = {0.0, 0.0};
        continue;
      }
      const Cplx powered = mul(Cplx{current.real(), current.imag()}, power(psi, steps[p]));
      ws.product[f] = {powered.re, powered.im};
    }
    offset += static_cast<double>(steps[p]) * d.shift;
  }
  ws.fft->inv(ws.signal.data(), ws.product.data(), size);
  const double scale = 1.0 / static_cast<double>(size);

  std::vector<double> pmf(m);  // [size] window order: pmf[j] is lattice index window_first + j
  double negative = 0.0;
  double norm2 = 0.0;
  int64_t position = positive_mod(window_first, size);
  for (std::size_t j = 0; j < m; ++j) {
    const double v = ws.signal[static_cast<std::size_t>(position)] * scale;
    if (!std::isfinite(v)) {
      ws.release_if_large();
      throw std::runtime_error("PRV FFT composition produced a non-finite value (size " +
                               std::to_string(size) + ")");
    }
    if (v < 0.0) negative -= v;
    const double clamped = std::max(0.0, v);
    pmf[j] = clamped;
    norm2 += clamped * clamped;
    if (++position == size) position = 0;
  }
  ws.release_if_large();

  // Note [PRV round-off]. Rounding errors of an FFT behave like independent noise of relative
  // 2-norm u = eps sqrt(log2 M) [Higham, "Accuracy and Stability of Numerical Algorithms", 2nd
  // ed., §24.1, rms form of Thm. 24.2]. With r the result (||r||_1 ~ 1), M the size and n_i the
  // step counts:
  //  * inverse transform: white noise of 2-norm u ||r||_2, so 1-norm <= sqrt(M) u ||r||_2;
  //  * forward transform of p_i, incoherent part: per-frequency noise ~ u ||p_i||_2, multiplied
  //    by n_i psi_i^(n_i - 1) when powered; by Parseval its inverse has 1-norm
  //    ~ n_i u ||p_i||_2 ||r||_2 sqrt(M);
  //  * coherent part near frequency 0, where |psi| ~ 1 and the partial sums of the transform are
  //    O(1): relative error ~ u amplified n_i times, a smooth perturbation of r that changes
  //    delta(eps) by ~ (sum_i n_i) u delta(eps), i.e. relatively.
  // So |delta_computed(eps) - delta_exact(eps)| <~ A + B delta(eps) with
  //    A = u ||r||_2 sqrt(M) (1 + sum_i n_i ||p_i||_2),   B = u sum_i n_i.
  // Measured in development over q in [1e-4, 1], sigma in [0.7, 20], 10 to 10^5 steps: the noise
  // on a region holding none of the distribution stayed below 1.25 A (median 0.1 A; the test
  // RoundoffEstimateCoversPureNoiseRegion repeats this), and the difference in delta(eps)
  // between this pipeline and the same pipeline in long double below 1.02 (A + B delta(eps)).
  // A factor 4 is applied to both, and twice the negative mass clamped above (a direct sample of
  // the noise) is added to A.
  const double unit = std::numeric_limits<double>::epsilon() *
                      std::sqrt(std::log2(static_cast<double>(size)));
  Composition out;
  out.roundoff_absolute =
      4.0 * unit * std::sqrt(static_cast<double>(size) * norm2) * (1.0 + weighted_norm) +
      2.0 * negative;
  out.roundoff_relative = 4.0 * unit * total_steps;
  out.prv = ComposedPrv(phases.empty() ? 1.0 : phases[0].mesh, window_first, offset, std::move(pmf));
  return out;
}

}  // namespace dpzero::accounting::prv_detail
