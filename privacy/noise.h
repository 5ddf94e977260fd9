// privacy/noise.h — the per-coordinate Gaussian noise draw z(seed, t, j), host and device.
//
// Note [noise ownership]
// ~~~~~~~~~~~~~~~~~~~~~~
// The noise added to global coordinate j at step t is  std * z(seed, t, j), where z is a pure
// function of (seed, t, j): Philox4x32-10 keyed by the 64-bit seed, counter
// (block lo, block hi, t, stream) with block = j / 4, and Box–Muller on the four output words
// (lanes 0,1 from words 0,1; lanes 2,3 from words 2,3); coordinate j takes lane j % 4.
// Consequences the engine relies on (DESIGN.md §2.5, §3 "Noise"):
//  * a rank that owns global coordinates [offset, offset + n) computes exactly their draws and no
//    others, so over any shard plan every coordinate is drawn once per step;
//  * the union of all ranks' shards equals the single-tensor noise bit for bit (same device type),
//    so a run does not depend on the world size, stage or shard plan;
//  * distinct `stream` values give independent sequences for other uses (e.g. the sampler) of
//    the same seed.
#pragma once

#include <cstdint>

#include "privacy/gaussian.h"
#include "privacy/host_device.h"
#include "privacy/philox.h"

namespace dpzero::privacy {

// Stream tags ("nois", "samp" in ASCII) keep the noise and the Poisson sampler independent.
constexpr uint32_t kNoiseStream = 0x6e6f6973u;
constexpr uint32_t kSamplerStream = 0x73616d70u;

DPZERO_HOST_DEVICE Philox4x32Key philox_key(uint64_t seed) {
  return Philox4x32Key{{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)}};
}

// Four N(0,1) draws for global coordinates 4*block .. 4*block + 3 at step t.
DPZERO_HOST_DEVICE void normal4(uint64_t seed, uint32_t step, uint32_t stream, uint64_t block,
                                float out[4]) {
  const Philox4x32Counter counter{{static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32),
                                   step, stream}};
  const Philox4x32Counter bits = philox4x32_10(counter, philox_key(seed));
  box_muller(uniform_open01(bits.v[0]), uniform_open01(bits.v[1]), out[0], out[1]);
  box_muller(uniform_open01(bits.v[2]), uniform_open01(bits.v[3]), out[2], out[3]);
}

// The single draw z(seed, t, j) of Note [noise ownership].
DPZERO_HOST_DEVICE float noise_draw(uint64_t seed, uint32_t step, uint64_t j) {
  float z[4];
  normal4(seed, step, kNoiseStream, j / 4, z);
  return z[j % 4];
}

}  // namespace dpzero::privacy
