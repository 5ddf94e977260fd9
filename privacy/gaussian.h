// privacy/gaussian.h — uniform and Gaussian transforms of block-function output, host and device.
//
// Note [gaussian tail]
// ~~~~~~~~~~~~~~~~~~~~
// A sampler whose |z| can never exceed r_max leaks: an output beyond r_max·σC above the sum
// without one example is impossible without it and has probability about Φc(r_max − 1/σ) with it.
// Box–Muller's radius is sqrt(−2 ln u1), so r_max is set by the smallest u1 the generator can
// produce. With 24-bit float uniforms r_max would be 5.77 (≈ 1e-6 per step at σ = 1 — far above
// any δ over 10^4 steps). We therefore take u1 from 64 random bits, u1 = (m + 1/2)·2^-64, and
// compute −ln u1 = 64 ln 2 − ln(m + 1/2) in fp64: r_max = sqrt(130 ln 2) ≈ 9.49, and
// Φc(9.49 − 1/σ) ≤ 6e-14 per step for σ ≥ 0.5 — below 1e-7 even over 10^6 steps. The angle needs no
// such care (u2 only rotates).
#pragma once

#include <cmath>
#include <cstdint>

#include "privacy/host_device.h"

namespace dpzero::privacy {

// A float uniform in the OPEN interval (0, 1) from 32 random bits: u = (2k + 1) * 2^-24 with
// k = bits >> 9, i.e. the midpoints of 2^23 equal cells. Every value is exact in fp32 (2k + 1 < 2^24),
// the grid is symmetric about 1/2, and neither 0 nor 1 can occur.
DPZERO_HOST_DEVICE float uniform_open01(uint32_t bits) {
  constexpr float kTwoPowMinus24 = 5.9604644775390625e-08f;  // 2^-24
  return static_cast<float>(((bits >> 9) << 1) | 1u) * kTwoPowMinus24;
}

// The Box–Muller radius sqrt(−2 ln u1) for u1 = (m + 1/2)·2^-64, m = hi·2^32 + lo, in fp64
// (Note [gaussian tail]): 0 <= radius <= sqrt(130 ln 2) ≈ 9.49.
DPZERO_HOST_DEVICE double box_muller_radius64(uint32_t hi, uint32_t lo) {
  constexpr double kLn2Times64 = 44.361419555836499802;  // 64 ln 2
  const uint64_t m = (static_cast<uint64_t>(hi) << 32) | lo;
  const double minus_log_u1 = kLn2Times64 - log(static_cast<double>(m) + 0.5);
  return sqrt(2.0 * (minus_log_u1 > 0.0 ? minus_log_u1 : 0.0));
}

// Box–Muller [Box & Muller 1958, Ann. Math. Statist. 29(2), eq. (1)]: radius r = sqrt(−2 ln u1)
// and angle 2π·u2 give two independent N(0, 1) draws z0 = r cos(2π u2), z1 = r sin(2π u2).
// fp32 default path: the radius comes from box_muller_radius64, the angle in fp32.
DPZERO_HOST_DEVICE void box_muller(double radius, float u2, float& z0, float& z1) {
  constexpr float kTwoPi = 6.283185307179586f;
  const float r = static_cast<float>(radius);
  const float theta = kTwoPi * u2;
  z0 = r * cosf(theta);
  z1 = r * sinf(theta);
}

}  // namespace dpzero::privacy
