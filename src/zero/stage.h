// src/zero/stage.h — the ZeRO stages (Rajbhandari et al. 2020, §5): what each rank keeps whole
// and what it keeps only for the coordinates it owns.
//
//   stage | parameters | gradients                               | optimizer state
//   ------+------------+-----------------------------------------+----------------
//     0   | full       | full, all-reduced at step (DDP-like)    | full
//     1   | full       | full, reduce-scattered at step          | owned shard
//     2   | full       | owned shard, reduce-scattered per unit  | owned shard
//         |            | during backward                         |
//     3   | owned shard, a unit gathered only around its forward  | owned shard
//         | and backward (Note [stage-3 gathers] in unit.h)|
#pragma once

#include <cstdint>

#include <c10/util/Exception.h>

namespace dpzero::zero {

enum class Stage : int64_t { k0 = 0, k1 = 1, k2 = 2, k3 = 3 };

inline Stage parse_stage(int64_t stage) {
  TORCH_CHECK(stage >= 0 && stage <= 3, "stage must be 0, 1, 2 or 3, got ", stage);
  return static_cast<Stage>(stage);
}

// Stages 2 and 3 reduce a unit's gradient during backward, as soon as it is complete.
inline bool reduces_in_backward(Stage stage) { return stage == Stage::k2 || stage == Stage::k3; }

}  // namespace dpzero::zero
