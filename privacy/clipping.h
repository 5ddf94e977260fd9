// privacy/clipping.h — clipping policies: per-sample clip factors and per-group thresholds
// (design.md §2 step 3), host and device.
//
//  * flat:       c = min(1, C / (||g|| + 1e-6))            (Abadi et al. 2016, Alg. 1, "clip")
//  * automatic:  c = C / (||g|| + gamma), gamma = 0.01     (Bu et al. 2023, "Automatic clipping",
//                                                           eq. (4.1), normalisation)
//  * per-layer / per-group: thresholds C_l with sum_l C_l^2 = C^2 (McMahan et al. 2018, §3), so
//    the whole sample's clipped gradient still has norm <= C.
// A NaN, infinite or negative norm gives factor 0: the sample contributes nothing (and is counted).
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "privacy/host_device.h"

namespace dpzero::privacy {

constexpr double kFlatClipEpsilon = 1e-6;
constexpr double kDefaultAutomaticGamma = 0.01;

// Note [smallest clip norm]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// The clipped sums' rounding bound (Note [clipped-sum rounding] in kernels/per_sample/common.h)
// is relative: each float32 product c_i g and each addition is within a factor 1 + 2^-24 of the
// exact one. A result among float32's subnormals (below 2^-126) rounds by up to 2^-150
// absolutely instead, which no relative margin absorbs once C is itself that small: a privacy
// review measured a contribution of 1.0003 C at C = 1e-42. A contribution of m entries gains at
// most sqrt(m) 2^-150 that way; for C >= 2^-64 and any m < 2^70 that is below 2^-25 C, inside the
// margin the certified norms carry (a contribution near C has S_i c_i >= C / 2, so its margin
// exceeds 2^-25 C). So a run's C, each clipping group's threshold and the ops' max_norm must be
// at least kMinClipNorm; nobody clips at a smaller one.
constexpr double kMinClipNorm = 0x1p-64;

enum class ClipMode { kFlat, kAutomatic };

// A norm the clip can use: finite and >= 0 (a per-sample norm is a square root, so a negative one
// is a caller bug; it must not turn into a factor that breaks the sensitivity bound).
DPZERO_HOST_DEVICE bool valid_norm(float norm) {
#if defined(__CUDA_ARCH__)
  return isfinite(norm) && norm >= 0.0f;
#else
  return std::isfinite(norm) && norm >= 0.0f;
#endif
}

// The float32 threshold of a float64 clip norm C: C rounded toward zero, so the threshold the
// factors are computed against never exceeds C (C = 0.1 is 0.100000001490116... rounded to
// nearest, above 0.1) and group thresholds keep sum_g C_g^2 <= C^2 after the conversion.
// Non-finite or non-positive values are passed through (the callers check them).
DPZERO_HOST_DEVICE float threshold_f32(double max_norm) {
  float f = static_cast<float>(max_norm);
  if (static_cast<double>(f) > max_norm) f = nextafterf(f, 0.0f);
  return f;
}

// The factor of one sample with gradient norm `norm` (fp32, as the norms are accumulated).
// `max_norm` is the threshold as threshold_f32 gives it.
// Sensitivity (design.md §3): norm * factor <= max_norm holds EXACTLY, not only up to rounding —
// the factor is computed in fp64, rounded to fp32, and stepped down one ulp while the exact
// product (two fp32 values multiply exactly in fp64) still exceeds max_norm.
DPZERO_HOST_DEVICE float clip_factor(float norm, float max_norm, ClipMode mode, float gamma) {
  if (!valid_norm(norm)) return 0.0f;
  const double n = static_cast<double>(norm);
  double c = mode == ClipMode::kAutomatic ? static_cast<double>(max_norm) / (n + gamma)
                                          : static_cast<double>(max_norm) / (n + kFlatClipEpsilon);
  if (mode == ClipMode::kFlat && c > 1.0) c = 1.0;
  float f = static_cast<float>(c);
  while (f > 0.0f && n * static_cast<double>(f) > static_cast<double>(max_norm)) {
    f = nextafterf(f, 0.0f);
  }
  return f;
}

// "flat" / "automatic"; throws std::invalid_argument naming the string otherwise.
ClipMode parse_clip_mode(const std::string& name);

// Per-group thresholds C_l = C * sqrt(w_l / sum w), each rounded toward zero to a float32 (the
// precision clip_factor works in, threshold_f32), so that sum C_l^2 <= C^2 holds exactly for the
// values the clipping uses (and equals C^2 up to float32 rounding). `weights` empty means
// `num_groups` equal weights. Throws std::invalid_argument naming the value for C <= 0, a weight
// <= 0 or non-finite, num_groups < 1, weights.size() != num_groups, or a threshold below
// kMinClipNorm (Note [smallest clip norm]).
std::vector<double> group_thresholds(double max_norm, int64_t num_groups,
                                     const std::vector<double>& weights = {});

}  // namespace dpzero::privacy
