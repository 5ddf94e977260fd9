// privacy/noise.h — the per-coordinate Gaussian noise draw z(seed, t, j), host and device.
//
// Note [noise ownership]
// ~~~~~~~~~~~~~~~~~~~~~~
// The noise added to global coordinate j at step t is  std * z(seed, t, j), where z is a pure
// function of (seed, t, j): Philox4x32-10 keyed by the 64-bit seed, counter
// (block lo, block hi, t, stream) with block = j / 2; words 0-1 give the Box–Muller radius from
// 64 bits (Note [gaussian tail] in gaussian.h), word 2 the angle; coordinate j takes the cosine
// (j even) or sine (j odd) draw; word 3 is unused.
// Consequences the engine relies on (design.md §2.5, §3 "Noise"):
//  * a rank that owns global coordinates [offset, offset + n) computes exactly their draws and no
//    others, so over any shard plan every coordinate is drawn once per step;
//  * the union of all ranks' shards equals the single-tensor noise bit for bit (same device type),
//    so a run does not depend on the world size, stage or shard plan;
//  * distinct `stream` values (streams.h) give independent sequences for other uses of the seed.
//
// Note [fresh randomness on replay]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Because z depends on t alone, the `t` given to the noise op and to the Poisson sampler must be
// the run's *charge index* — the number of steps already charged to the privacy ledger
// (Ledger::total_steps() before the step's append) — and never a training-step number that can
// repeat. A run that resumes from a checkpoint older than its ledger replays training steps; their
// updates are charged again (accounting/ledger.h), and the charge is only valid if the replayed
// step's noise and batch are fresh draws. With t = charge index they are: charge indices never
// repeat, so no two releases of a run ever share a noise vector. (In a run that never resumes the
// charge index equals the step number.)
#pragma once

#include <cstdint>

#include "privacy/gaussian.h"
#include "privacy/host_device.h"
#include "privacy/philox.h"
#include "privacy/streams.h"

namespace dpzero::privacy {

constexpr int kNoiseLanes = 2;  // coordinates per Philox block

DPZERO_HOST_DEVICE Philox4x32Key philox_key(uint64_t seed) {
  return Philox4x32Key{{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)}};
}

// Two N(0,1) draws for global coordinates 2*block and 2*block + 1 at step t.
DPZERO_HOST_DEVICE void normal2(uint64_t seed, uint32_t step, uint32_t stream, uint64_t block,
                                float out[2]) {
  const Philox4x32Counter counter{{static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32),
                                   step, stream}};
  const Philox4x32Counter bits = philox4x32_10(counter, philox_key(seed));
  box_muller(box_muller_radius64(bits.v[0], bits.v[1]), uniform_open01(bits.v[2]), out[0], out[1]);
}

// The single draw z(seed, t, j) of Note [noise ownership].
DPZERO_HOST_DEVICE float noise_draw(uint64_t seed, uint32_t step, uint64_t j) {
  float z[2];
  normal2(seed, step, kNoiseStream, j / 2, z);
  return z[j % 2];
}

}  // namespace dpzero::privacy
