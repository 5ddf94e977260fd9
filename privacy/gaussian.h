// privacy/gaussian.h — uniform and Gaussian transforms of block-function output (fp32 default).
#pragma once

#include <cmath>
#include <cstdint>

#include "privacy/host_device.h"

namespace dpzero::privacy {

// A float uniform in the OPEN interval (0, 1) from 32 random bits: u = (2k + 1) * 2^-24 with
// k = bits >> 9, i.e. the midpoints of 2^23 equal cells. Every value is exact in fp32 (2k + 1 < 2^24),
// the grid is symmetric about 1/2, and neither 0 (log(0) in Box–Muller) nor 1 can occur.
DPZERO_HOST_DEVICE float uniform_open01(uint32_t bits) {
  constexpr float kTwoPowMinus24 = 5.9604644775390625e-08f;  // 2^-24
  return static_cast<float>(((bits >> 9) << 1) | 1u) * kTwoPowMinus24;
}

// Box–Muller [Box & Muller 1958, Ann. Math. Statist. 29(2), eq. (1)]: two independent uniforms
// (u1, u2) in (0, 1) give two independent N(0, 1) draws
//   z0 = sqrt(-2 ln u1) cos(2 pi u2),   z1 = sqrt(-2 ln u1) sin(2 pi u2).
// With u1 >= 2^-24 the radius is bounded by sqrt(48 ln 2) ~ 5.77: the tail beyond that is not
// produced (probability 2^-24 ~ 6e-8 per pair); the statistical tests bound what this changes.
DPZERO_HOST_DEVICE void box_muller(float u1, float u2, float& z0, float& z1) {
  constexpr float kTwoPi = 6.283185307179586f;
  const float radius = sqrtf(-2.0f * logf(u1));
  const float theta = kTwoPi * u2;
  z0 = radius * cosf(theta);
  z1 = radius * sinf(theta);
}

}  // namespace dpzero::privacy
