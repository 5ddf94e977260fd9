// Adaptive clipping's rules (privacy/adaptive_clipping.h) against the formulas of Andrew et al.
// 2021 written out here.
#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>
#include <string>

#include "privacy/adaptive_clipping.h"
#include "privacy/noise.h"
#include "privacy/secure_noise.h"

namespace dpzero::privacy {
namespace {

AdaptiveClipping settings(double sigma_b) {
  AdaptiveClipping a;
  a.target_unclipped_quantile = 0.6;
  a.clipbound_learning_rate = 0.3;
  a.min_clipbound = 0.05;
  a.max_clipbound = 20.0;
  a.unclipped_num_std = sigma_b;
  return a;
}

std::string refusal(const AdaptiveClipping& a, double z, double c) {
  try {
    check_adaptive_clipping(a, z, c);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

TEST(AdaptiveClipping, TheTwoNoisesComposeToTheRunsMultiplier) {
  // Theorem 1: the gradient (σ_Δ) and the count (σ_b, sensitivity ½) together cost one
  // Gaussian step of multiplier z: σ_Δ⁻² + (2σ_b)⁻² = z⁻².
  for (double z : {0.3, 1.0, 2.5}) {
    for (double sb : {0.6 * z, z, 10.0 * z}) {
      const double sd = gradient_noise_multiplier(settings(sb), z);
      EXPECT_GT(sd, z);
      EXPECT_NEAR(1.0 / (sd * sd) + 1.0 / (4.0 * sb * sb), 1.0 / (z * z), 1e-12 / (z * z));
    }
  }
  EXPECT_EQ(gradient_noise_multiplier(settings(0.0), 0.0), 0.0);
  // At the ends of the doubles, where z⁻² would overflow or underflow: σ_b = z gives
  // σ_Δ = 2z/√3, and a tiny z against σ_b = 1 keeps σ_Δ = z.
  EXPECT_NEAR(gradient_noise_multiplier(settings(1e154), 1e154) / (2e154 / std::sqrt(3.0)), 1.0,
              1e-15);
  EXPECT_NEAR(gradient_noise_multiplier(settings(1.0), 1e-170) / 1e-170, 1.0, 1e-15);
}

TEST(AdaptiveClipping, TheGeometricUpdateMovesTowardsTheTarget) {
  const AdaptiveClipping a = settings(1.0);
  const double n = 40.0;  // expected batch
  // Fraction f = s/n + 1/2 at the target: unchanged. Above it: shrinks by exp(−η(f − γ)).
  const double at_target = (0.6 - 0.5) * n;
  EXPECT_DOUBLE_EQ(next_clipbound(a, 2.0, at_target, n), 2.0);
  EXPECT_DOUBLE_EQ(next_clipbound(a, 2.0, 0.5 * n, n), 2.0 * std::exp(-0.3 * (1.0 - 0.6)));
  EXPECT_DOUBLE_EQ(next_clipbound(a, 2.0, -0.5 * n, n), 2.0 * std::exp(-0.3 * (0.0 - 0.6)));
  // Clamped to [min_clipbound, max_clipbound], also for a count noise far out.
  EXPECT_EQ(next_clipbound(a, 0.05, 1e6, n), 0.05);
  EXPECT_EQ(next_clipbound(a, 20.0, -1e6, n), 20.0);
}

TEST(AdaptiveClipping, BadSettingsAreRefusedNamingTheValue) {
  AdaptiveClipping a = settings(1.0);
  EXPECT_EQ(refusal(a, 1.0, 1.0), "");
  EXPECT_NE(refusal(a, 2.0, 1.0).find("unclipped_num_std=1 must be above noise_multiplier / 2 = 1"),
            std::string::npos);
  EXPECT_EQ(refusal(settings(0.0), 0.0, 1.0), "");  // no noise: the count may be exact too
  EXPECT_NE(refusal(a, 1.0, 30.0).find("the initial max_grad_norm=30 must lie in"),
            std::string::npos);
  a.target_unclipped_quantile = -0.1;
  EXPECT_NE(refusal(a, 1.0, 1.0).find("target_unclipped_quantile must be in [0, 1], got -0.1"),
            std::string::npos);
  a = settings(1.0);
  a.clipbound_learning_rate = std::nan("");
  EXPECT_NE(refusal(a, 1.0, 1.0).find("clipbound_learning_rate must be finite and > 0, got nan"),
            std::string::npos);
  a = settings(1.0);
  a.max_clipbound = INFINITY;
  EXPECT_NE(refusal(a, 1.0, 1.0).find("max_clipbound must be finite"), std::string::npos);
  EXPECT_THROW(check_clipbound(settings(1.0), 0.01), std::invalid_argument);
  EXPECT_NO_THROW(check_clipbound(settings(1.0), 0.05));
}

TEST(AdaptiveClipping, TheCountsDrawIsItsOwnStream) {
  // The count's z is not any gradient coordinate's draw at the same step (a shared draw would
  // correlate the two releases Theorem 1 treats as independent).
  for (uint32_t step : {0u, 1u, 77u}) {
    const double count = count_noise_draw(uint64_t{12345}, step);
    float z[2];
    normal2(12345, step, kNoiseStream, 0, z);
    EXPECT_NE(count, static_cast<double>(z[0]));
    normal2(12345, step, kClipCountStream, 0, z);
    EXPECT_EQ(count, static_cast<double>(z[0]));
    ChaCha20Key key{{1, 2, 3, 4, 5, 6, 7, 8}};
    EXPECT_NE(count_noise_draw(key, step), secure_noise_draw(key, step, 0));
  }
}

}  // namespace
}  // namespace dpzero::privacy
