// privacy/secure_noise.h — secure mode's per-coordinate draw: ChaCha20, fp64, and the
// floating-point-attack mitigation, host and device.
//
// Note [secure noise]
// ~~~~~~~~~~~~~~~~~~~
// Mironov (CCS 2012, "On significance of the least significant bits for differential privacy")
// showed that floating-point samplers leave gaps in the set of values they can output, and that an
// attacker who sees a noised value can tell which inputs could have produced it. Secure mode
// counters the two known avenues:
//  * the generator is ChaCha20 (RFC 8439) keyed with 256 bits from the OS entropy source (Boost
//    .Random's random_device, see entropy.h), so the draws are unpredictable — a Philox seed is a
//    64-bit value the user may have chosen;
//  * each coordinate's N(0,1) draw is the sum of k = 4 independent fp64 Box–Muller normals divided
//    by 2 (= sqrt(k)), the construction Opacus's secure mode uses after Holohan & Braghin ("Secure
//    random sampling in differential privacy", ESORICS 2021): the sum's low-order bits are smeared
//    over many more representable values, which closes the gaps one Box–Muller output leaves.
//    Independent means four radii and four angles: the two outputs of one Box–Muller pair are
//    independent normals, but their sum z0 + z1 = sqrt(2) r sin(theta + pi/4) is one output of one
//    (r, theta), with that output's gaps. So a coordinate takes one output of each of four pairs,
//    never both outputs of one pair.
// Cost: one ChaCha20 block (16 words) yields 8 fp64 normals from 53-bit-grid uniforms, i.e. 2 secure
// coordinates per block — about 4x the fp64 Box–Muller work and 8x the 32-bit words per
// coordinate of the default path. The noise-ownership contract (Note [noise ownership] in
// noise.h) is unchanged: the draw of coordinate j at step t is a pure function of (key, t, j), so
// all ranks must hold the same key (rank 0 draws it and broadcasts it before the first step).
//
// Layout: coordinates 2m and 2m + 1 use block (counter = low 32 bits of m, nonce = (high 32 bits
// of m, step, stream)); its words 4p .. 4p + 3 (p = 0..3) are Box–Muller pair p (radius from the
// first two, angle from the last two), and coordinate 2m + c sums output c (the cosine for c = 0,
// the sine for c = 1) of the four pairs, in the order p = 0, 1, 2, 3.
#pragma once

#include <cmath>
#include <cstdint>

#include "privacy/chacha20.h"
#include "privacy/gaussian.h"
#include "privacy/host_device.h"
#include "privacy/streams.h"

namespace dpzero::privacy {

constexpr int kSecureSummands = 4;  // k in Note [secure noise]

// A double uniform in the open interval (0, 1) from 64 bits: (2m + 1) * 2^-53 with m the top
// 52 bits — the midpoints of 2^52 equal cells; 2m + 1 < 2^53 is exact in fp64, never 0 or 1.
DPZERO_HOST_DEVICE double uniform_open01_f64(uint32_t hi, uint32_t lo) {
  const uint64_t m = ((static_cast<uint64_t>(hi) << 32) | lo) >> 12;  // 52 bits
  return static_cast<double>((m << 1) | 1u) * 1.1102230246251565e-16;  // 2^-53
}

// Box–Muller in fp64 [Box & Muller 1958, eq. (1)] with the radius from 64 bits (Note [gaussian
// tail] in gaussian.h) and the angle from a 52-bit-grid uniform.
DPZERO_HOST_DEVICE void box_muller_f64(double radius, double u2, double& z0, double& z1) {
  constexpr double kTwoPi = 6.283185307179586476925286766559;
  z0 = radius * cos(kTwoPi * u2);
  z1 = radius * sin(kTwoPi * u2);
}

// The two secure N(0, 1) draws of coordinates 2*pair and 2*pair + 1 at `step`.
DPZERO_HOST_DEVICE void secure_normal2(const ChaCha20Key& key, uint32_t step, uint64_t pair,
                                       double out[2]) {
  const ChaCha20Block b = chacha20_block(key, static_cast<uint32_t>(pair),
                                         static_cast<uint32_t>(pair >> 32), step, kNoiseStream);
  double sum0 = 0.0, sum1 = 0.0;
  for (int p = 0; p < kSecureSummands; ++p) {
    const uint32_t* w = &b.w[4 * p];
    double z0, z1;
    box_muller_f64(box_muller_radius64(w[0], w[1]), uniform_open01_f64(w[2], w[3]), z0, z1);
    sum0 += z0;
    sum1 += z1;
  }
  out[0] = sum0 * 0.5;  // divide by sqrt(k) = 2: the sum of 4 N(0,1) is N(0,4)
  out[1] = sum1 * 0.5;
}

DPZERO_HOST_DEVICE double secure_noise_draw(const ChaCha20Key& key, uint32_t step, uint64_t j) {
  double z[2];
  secure_normal2(key, step, j / 2, z);
  return z[j % 2];
}

}  // namespace dpzero::privacy
