// src/zero/shard_noise.h — DESIGN.md §2 step 5: add the step's noise to the shard a rank owns.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

#include "src/zero/shard_plan.h"

namespace dpzero::zero {

// shard: [layout.shard_numel()], contiguous, rank `rank`'s part of the unit's flat gradient.
// Adds stddev * z(seed, step, j) to every element that holds a global coordinate j (Note [noise
// ownership]); padding elements are left untouched. Returns the number of coordinates noised.
int64_t add_shard_noise_(at::Tensor& shard, const UnitLayout& layout, int64_t rank, double stddev,
                         int64_t seed, int64_t step);

}  // namespace dpzero::zero
