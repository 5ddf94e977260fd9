// privacy/clipping.cpp — parse_clip_mode and group_thresholds.
#include "privacy/clipping.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <stdexcept>

namespace dpzero::privacy {
namespace {

// A double as printf's %.17g writes it (std::to_string would print 1e-42 as 0.000000).
std::string shown(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", x);
  return buf;
}

}  // namespace

ClipMode parse_clip_mode(const std::string& name) {
  if (name == "flat") return ClipMode::kFlat;
  if (name == "automatic") return ClipMode::kAutomatic;
  throw std::invalid_argument("clipping mode must be 'flat' or 'automatic', got '" + name + "'");
}

std::vector<double> group_thresholds(double max_norm, int64_t num_groups,
                                     const std::vector<double>& weights) {
  if (!(max_norm > 0.0) || !std::isfinite(max_norm)) {
    throw std::invalid_argument("max_grad_norm C must be finite and > 0, got " +
                                std::to_string(max_norm));
  }
  if (num_groups < 1) {
    throw std::invalid_argument("number of clipping groups must be >= 1, got " +
                                std::to_string(num_groups));
  }
  std::vector<double> w = weights;
  if (w.empty()) w.assign(static_cast<size_t>(num_groups), 1.0);
  if (static_cast<int64_t>(w.size()) != num_groups) {
    throw std::invalid_argument("got " + std::to_string(w.size()) + " group weights for " +
                                std::to_string(num_groups) + " groups");
  }
  double total = 0.0;
  for (size_t i = 0; i < w.size(); ++i) {
    if (!(w[i] > 0.0) || !std::isfinite(w[i])) {
      throw std::invalid_argument("group weight " + std::to_string(i) +
                                  " must be finite and > 0, got " + std::to_string(w[i]));
    }
    total += w[i];
  }
  std::vector<double> thresholds;
  thresholds.reserve(w.size());
  for (size_t g = 0; g < w.size(); ++g) {
    const double t = w.size() == 1 ? max_norm : max_norm * std::sqrt(w[g] / total);
    thresholds.push_back(threshold_f32(t));
    if (thresholds.back() < kMinClipNorm) {  // Note [smallest clip norm]
      const std::string what =
          w.size() == 1 ? "max_grad_norm C = " + shown(max_norm)
                        : "clipping group " + std::to_string(g) +
                              "'s threshold C sqrt(w_g / sum w) = " + shown(t);
      throw std::invalid_argument(what +
                                  " is below 2^-64, the smallest clip norm whose rounding the "
                                  "clipped sums' bound absorbs; raise C" +
                                  (w.size() == 1 ? "" : " or that group's weight"));
    }
  }
  if (w.size() == 1) return thresholds;  // threshold_f32(C) <= C: done
  // Each t_g is a float32, so t_g^2 is exact in float64; the float64 sum S of k such squares is
  // within (k - 1) 2^-53 S of the exact one, and C^2 rounds by at most 2^-53 C^2. With the margin
  // below, S <= C^2 is then certain; the thresholds are C sqrt(w_g / sum w) rounded down to
  // float32, so this steps one down only when the sum lands within the margin of C^2 (an exact
  // split such as C = 2, k = 4), and then by one float32 ulp.
  const double k = static_cast<double>(thresholds.size());
  const double c_sq_bound = max_norm * max_norm * (1.0 - (k + 4.0) * std::ldexp(1.0, -52));
  for (;;) {
    double sum = 0.0;
    for (double t : thresholds) sum += t * t;
    if (sum <= c_sq_bound) break;
    double& largest = *std::max_element(thresholds.begin(), thresholds.end());
    largest = static_cast<double>(std::nextafterf(static_cast<float>(largest), 0.0f));
  }
  return thresholds;
}

}  // namespace dpzero::privacy
