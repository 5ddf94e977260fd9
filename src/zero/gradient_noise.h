// src/zero/gradient_noise.h — what a private update adds to a unit's reduced gradient before the
// optimizer runs: the ZeRO state's one hook for differential privacy. The noise itself (its key,
// its draws, which coordinates each rank owns) is src/dp/step_noise.h's; the ZeRO state only
// says where in the update it goes and hands over the buffer.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

#include "src/zero/shard_plan.h"

namespace dpzero::zero {

class GradientNoise {
 public:
  virtual ~GradientNoise() = default;
  // grad: unit `unit`'s reduced fp32 gradient on rank `rank`, after the reduction and before
  // the scale and the optimizer: the whole unit [layout.padded_numel()] when `whole` (stage 0,
  // where every rank holds every coordinate), else the rank's shard [layout.shard_numel()].
  // Called once per unit and step, units in order; not const: a noise may keep state per unit
  // (correlated noise keeps its previous draws).
  virtual void add_(at::Tensor& grad, int64_t unit, const UnitLayout& layout, int64_t rank,
                    bool whole) = 0;
};

}  // namespace dpzero::zero
