// privacy/clipping.cpp — parse_clip_mode and group_thresholds.
#include "privacy/clipping.h"

#include <stdexcept>

namespace dpzero::privacy {

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
  for (double wi : w) thresholds.push_back(max_norm * std::sqrt(wi / total));
  return thresholds;
}

}  // namespace dpzero::privacy
