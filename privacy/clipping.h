// privacy/clipping.h — clipping policies: per-sample clip factors and per-group thresholds
// (DESIGN.md §2 step 3), host and device.
//
//  * flat:       c = min(1, C / (||g|| + 1e-6))            (Abadi et al. 2016, Alg. 1, "clip")
//  * automatic:  c = C / (||g|| + gamma), gamma = 0.01     (Bu et al. 2023, "Automatic clipping",
//                                                           eq. (4.1), normalisation)
//  * per-layer / per-group: thresholds C_l with sum_l C_l^2 = C^2 (McMahan et al. 2018, §3), so
//    the whole sample's clipped gradient still has norm <= C.
// A NaN or infinite norm gives factor 0: the sample contributes nothing (and is counted).
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "privacy/host_device.h"

namespace dpzero::privacy {

constexpr double kFlatClipEpsilon = 1e-6;
constexpr double kDefaultAutomaticGamma = 0.01;

enum class ClipMode { kFlat, kAutomatic };

DPZERO_HOST_DEVICE bool finite_norm(float norm) {
#if defined(__CUDA_ARCH__)
  return isfinite(norm);
#else
  return std::isfinite(norm);
#endif
}

// The factor of one sample with gradient norm `norm` (fp32, as the norms are accumulated).
DPZERO_HOST_DEVICE float clip_factor(float norm, float max_norm, ClipMode mode, float gamma) {
  if (!finite_norm(norm)) return 0.0f;
  if (mode == ClipMode::kAutomatic) return max_norm / (norm + gamma);
  const float c = max_norm / (norm + static_cast<float>(kFlatClipEpsilon));
  return c < 1.0f ? c : 1.0f;
}

// "flat" / "automatic"; throws std::invalid_argument naming the string otherwise.
ClipMode parse_clip_mode(const std::string& name);

// Per-group thresholds C_l = C * sqrt(w_l / sum w) so that sum C_l^2 = C^2. `weights` empty means
// `num_groups` equal weights. Throws std::invalid_argument naming the value for C <= 0, a weight
// <= 0 or non-finite, num_groups < 1, or weights.size() != num_groups.
std::vector<double> group_thresholds(double max_norm, int64_t num_groups,
                                     const std::vector<double>& weights = {});

}  // namespace dpzero::privacy
