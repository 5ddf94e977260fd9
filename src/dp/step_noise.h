// src/dp/step_noise.h — design.md §2 step 5: the private step's Gaussian noise, drawn on exactly
// the global coordinates of the gradient a rank updates (Note [noise ownership] in
// privacy/noise.h). The ZeRO state adds it through its one hook (src/zero/gradient_noise.h).
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "src/zero/gradient_noise.h"
#include "src/zero/shard_plan.h"

namespace dpzero::dp {

using zero::UnitLayout;

// Where the noise comes from: a Philox seed (default) or secure mode's 256-bit ChaCha20 key as
// eight 32-bit words (Note [secure noise] in privacy/secure_noise.h).
struct NoiseKey {
  bool secure = false;
  int64_t seed = 0;           // used when !secure (its 64 bits, as int64)
  std::vector<int64_t> key;   // [8] used when secure
};

// shard: [layout.shard_numel()], contiguous, rank `rank`'s part of the unit's flat gradient.
// Adds stddev * z(key, step, j) to every element that holds a global coordinate j (Note [noise
// ownership]); padding elements are left untouched. `step` is the charge index (Note [fresh
// randomness on replay] in privacy/noise.h). Returns the number of coordinates noised.
int64_t add_shard_noise_(at::Tensor& shard, const UnitLayout& layout, int64_t rank, double stddev,
                         const NoiseKey& key, int64_t step);

// full: [layout.padded_numel()], contiguous, the whole unit (stage 0, where every rank holds every
// coordinate and adds the same draws, so the replicas stay equal). Same contract otherwise.
int64_t add_unit_noise_(at::Tensor& full, const UnitLayout& layout, double stddev,
                        const NoiseKey& key, int64_t step);

// The noise of one private step (design.md §2 step 5): stddev = σ·C, drawn from `key` at counter
// `step` (the ledger charge index). Constructing it checks it (c10::Error naming the value unless
// stddev is finite and >= 0, step >= 0, and a secure key has 8 words).
class StepNoise final : public zero::GradientNoise {
 public:
  StepNoise(double stddev, NoiseKey key, int64_t step);
  // Stage 0 (`whole`): add_unit_noise_, every rank the same draws; else add_shard_noise_. A
  // stddev of 0 (σ = 0) draws nothing rather than adding 0·z.
  void add_(at::Tensor& grad, int64_t unit, const UnitLayout& layout, int64_t rank,
            bool whole) override;

  double stddev() const { return stddev_; }
  const NoiseKey& key() const { return key_; }
  int64_t step() const { return step_; }

 private:
  double stddev_;
  NoiseKey key_;
  int64_t step_;
};

}  // namespace dpzero::dp
