// privacy/adaptive_clipping.cpp — see adaptive_clipping.h (Note [adaptive clipping]).
#include "privacy/adaptive_clipping.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "accounting/types.h"
#include "privacy/noise.h"
#include "privacy/secure_noise.h"
#include "privacy/streams.h"

namespace dpzero::privacy {
namespace {

using accounting::format_double;

[[noreturn]] void refuse(const std::string& what) {
  throw std::invalid_argument("clipping='adaptive': " + what);
}

}  // namespace

void check_adaptive_clipping(const AdaptiveClipping& a, double noise_multiplier,
                             double max_grad_norm) {
  const double gamma = a.target_unclipped_quantile, eta = a.clipbound_learning_rate;
  if (!(gamma >= 0.0 && gamma <= 1.0))
    refuse("target_unclipped_quantile must be in [0, 1], got " + format_double(gamma));
  if (!(eta > 0.0) || !std::isfinite(eta))
    refuse("clipbound_learning_rate must be finite and > 0, got " + format_double(eta));
  if (!(a.min_clipbound > 0.0) || !std::isfinite(a.min_clipbound))
    refuse("min_clipbound must be finite and > 0, got " + format_double(a.min_clipbound));
  if (!(a.max_clipbound >= a.min_clipbound) || !std::isfinite(a.max_clipbound))
    refuse("max_clipbound must be finite and >= min_clipbound=" +
           format_double(a.min_clipbound) + ", got " + format_double(a.max_clipbound));
  if (!(max_grad_norm >= a.min_clipbound && max_grad_norm <= a.max_clipbound))
    refuse("the initial max_grad_norm=" + format_double(max_grad_norm) +
           " must lie in [min_clipbound, max_clipbound] = [" + format_double(a.min_clipbound) +
           ", " + format_double(a.max_clipbound) + "]");
  const double sb = a.unclipped_num_std;
  if (!(sb >= 0.0) || !std::isfinite(sb))
    refuse("unclipped_num_std must be finite and >= 0, got " + format_double(sb));
  if (noise_multiplier > 0.0 && !(2.0 * sb > noise_multiplier))
    refuse("unclipped_num_std=" + format_double(sb) + " must be above noise_multiplier / 2 = " +
           format_double(noise_multiplier / 2.0) +
           ": the count's noise takes part of the step's privacy cost (Note [adaptive "
           "clipping]), and the gradient's noise multiplier (z^-2 - (2 unclipped_num_std)^-2)"
           "^(-1/2) exists only then; Andrew et al. suggest about the expected batch size / 20");
  const double sd = gradient_noise_multiplier(a, noise_multiplier);
  // The noise kernels draw in float32 (noise.h): the standard deviation must be one.
  if (!(sd * a.max_clipbound <= std::numeric_limits<float>::max()))
    refuse("the gradient's noise multiplier " + format_double(sd) + " (noise_multiplier=" +
           format_double(noise_multiplier) + ", unclipped_num_std=" + format_double(sb) +
           ") times max_clipbound=" + format_double(a.max_clipbound) +
           " is not a finite standard deviation in float32");
}

void check_clipbound(const AdaptiveClipping& a, double clip) {
  if (!(clip >= a.min_clipbound && clip <= a.max_clipbound))
    refuse("the clip bound must lie in [min_clipbound, max_clipbound] = [" +
           format_double(a.min_clipbound) + ", " + format_double(a.max_clipbound) + "], got " +
           format_double(clip));
}

double gradient_noise_multiplier(const AdaptiveClipping& a, double noise_multiplier) {
  if (noise_multiplier == 0.0) return 0.0;
  // (z⁻² − (2σ_b)⁻²)^(−1/2) = z / √(1 − (z / 2σ_b)²): no square of z or σ_b to overflow or
  // underflow.
  const double ratio = noise_multiplier / (2.0 * a.unclipped_num_std);
  return noise_multiplier / std::sqrt(1.0 - ratio * ratio);
}

double next_clipbound(const AdaptiveClipping& a, double clip, double noisy_centred_count,
                      double expected_batch) {
  const double fraction = noisy_centred_count / expected_batch + 0.5;
  const double next =
      clip * std::exp(-a.clipbound_learning_rate * (fraction - a.target_unclipped_quantile));
  // std::clamp would pass a NaN through; the bound must stay a valid threshold.
  if (!(next >= a.min_clipbound)) return a.min_clipbound;
  return std::min(next, a.max_clipbound);
}

double count_noise_draw(uint64_t seed, uint32_t step) {
  float z[2];
  normal2(seed, step, kClipCountStream, 0, z);
  return z[0];
}

double count_noise_draw(const ChaCha20Key& key, uint32_t step) {
  double z[2];
  secure_normal2(key, step, 0, z, kClipCountStream);
  return z[0];
}

}  // namespace dpzero::privacy
